"""The one counting loop under the evaluator (`accounting.account`) and the simulator (`sim.traffic.batch_traffic`):
where each activation is served and which token copies cross devices, compiled with numba.

Activation (token n, layer l, slot j) of a token living on device s = home[n, l] is served by physical slot
p = slot_table[l, s, expert] on device d = p // slots_per_device. A token travels once to each distinct device
(DeepEP's per-rank dedup: the "copy") and once to each distinct node. Rows belong to one of G groups (the
simulator's iterations of a block; the evaluator uses one).

Why compiled: in numpy the exact accounting took ~10 array passes per activation (lookups, a k x k duplicate test,
histogram keys, bincounts) and two hand-vectorised copies of them (evaluator, simulator); here it is one loop that
reads like the definition. Measured 2026-12-01 on the 2-core machine against the numpy versions it replaced: the
simulator's counting 150-175 M activations/s (was ~85 M), `bench eval` at top-8 1.4x faster, at top-2 0.6x (the
per-token-layer bit-set work dominates when k is small). Counts are integers, so results are unchanged (tests
compare both users against a pure-Python reference).

Legend: N token rows, G groups, L MoE layers, k experts per token, E logical experts, D devices, P physical slots
per layer, M nodes.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def count_rows(group_N, home_NL, experts_NLk, slot_table_LDE, device_table_LDE, devices_per_node,
               activations_GLDD, copies_GLDD, node_copies_GLDM, slot_tokens_GLP):  # pragma: no cover (compiled)
    """Add the rows' counts into the int64 tables (shapes in the names; node_copies may have M = 0 columns and
    slot_tokens P = 0 columns, then they are not counted). Inputs: group_N int[N] in [0, G), home_NL int[N, L] (a broadcast view is
    fine), experts_NLk int[N, L, k], slot_table_LDE int[L, D, E] and device_table_LDE int[L, D, E] (the
    slot's device).

    Returns -1, or the first row whose expert id lies outside [0, E) or whose home lies outside [0, D) (its
    earlier rows are counted; the caller raises and discards the tables).
    """
    num_rows, num_layers, top_k = experts_NLk.shape
    num_devices, num_experts = slot_table_LDE.shape[1], slot_table_LDE.shape[2]
    num_nodes = node_copies_GLDM.shape[3]
    count_slots = slot_tokens_GLP.shape[2] > 0
    # devices a token-layer reaches, as a bit set (64 devices per word): branch-free, unlike a per-copy test
    reached = np.zeros((num_devices + 63) // 64, dtype=np.uint64)
    node_reached = np.zeros(max(1, num_nodes), dtype=np.int64)
    for n in range(num_rows):
        g = group_N[n]
        for layer in range(num_layers):
            s = home_NL[n, layer]
            if s < 0 or s >= num_devices:
                return n
            reached[:] = 0
            for j in range(top_k):
                e = experts_NLk[n, layer, j]
                if e < 0 or e >= num_experts:
                    return n
                d = device_table_LDE[layer, s, e]
                if count_slots:
                    slot_tokens_GLP[g, layer, slot_table_LDE[layer, s, e]] += 1
                activations_GLDD[g, layer, s, d] += 1
                reached[d >> 6] |= np.uint64(1) << np.uint64(d & 63)
            copies_row = copies_GLDD[g, layer, s]
            for d in range(num_devices):
                copies_row[d] += (reached[d >> 6] >> np.uint64(d & 63)) & np.uint64(1)
            if num_nodes > 0:
                node_reached[:] = 0
                for d in range(num_devices):
                    node_reached[d // devices_per_node] |= (reached[d >> 6] >> np.uint64(d & 63)) & np.uint64(1)
                node_row = node_copies_GLDM[g, layer, s]
                for m in range(num_nodes):
                    node_row[m] += node_reached[m]
    return -1


@numba.njit(cache=True, nogil=True)
def count_rows_at(rows_N, group_N, home_NL, experts_RLk, slot_table_LDE, device_table_LDE, device_bits_LDE,
                  devices_per_node, activations_GLDD, copies_GLDD, node_copies_GLDM, slot_tokens_GLP,
                  stats_G3):  # pragma: no cover (compiled)
    """`count_rows` over the rows experts_RLk[rows_N] (the simulator's stream rows, read in place instead of
    gathered first): same tables, same return value; also stats_G3[g] += (activations, local activations, remote
    copies) of group g. device_bits_LDE uint64[L, D, E]: 1 << (the slot's device), for D <= 64 (else size 0: the
    devices are then marked word by word as `count_rows` does).

    When the rows hold more activations than a [G, L, D, E] table has cells, activations are first counted per
    (group, layer, home, expert), one increment each, and then spread to slots and devices per cell (the same
    integers, fewer scattered writes); otherwise each activation goes straight to its slot and device.
    """
    num_rows = rows_N.shape[0]
    num_groups = activations_GLDD.shape[0]
    num_layers, top_k = experts_RLk.shape[1], experts_RLk.shape[2]
    num_devices, num_experts = slot_table_LDE.shape[1], slot_table_LDE.shape[2]
    num_nodes = node_copies_GLDM.shape[3]
    count_slots = slot_tokens_GLP.shape[2] > 0
    aggregate = num_rows * top_k >= num_groups * num_devices * num_experts and device_bits_LDE.shape[0] > 0
    by_expert = np.zeros((num_groups if aggregate else 0, num_layers, num_devices, num_experts), dtype=np.int64)
    reached = np.zeros((num_devices + 63) // 64, dtype=np.uint64)
    node_reached = np.zeros(max(1, num_nodes), dtype=np.int64)
    for n in range(num_rows):
        g = group_N[n]
        row = rows_N[n]
        local = 0
        remote = 0
        for layer in range(num_layers):
            s = home_NL[n, layer]
            if s < 0 or s >= num_devices:
                return n
            if aggregate:  # one increment per activation; slots and devices per cell below
                bits = np.uint64(0)
                for j in range(top_k):
                    e = experts_RLk[row, layer, j]
                    if e < 0 or e >= num_experts:
                        return n
                    bits |= device_bits_LDE[layer, s, e]
                    by_expert[g, layer, s, e] += 1
                reached[0] = bits
            else:
                reached[:] = 0
                for j in range(top_k):
                    e = experts_RLk[row, layer, j]
                    if e < 0 or e >= num_experts:
                        return n
                    d = device_table_LDE[layer, s, e]
                    if count_slots:
                        slot_tokens_GLP[g, layer, slot_table_LDE[layer, s, e]] += 1
                    activations_GLDD[g, layer, s, d] += 1
                    local += d == s
                    reached[d >> 6] |= np.uint64(1) << np.uint64(d & 63)
            copies_row = copies_GLDD[g, layer, s]
            for d in range(num_devices):
                bit = np.int64((reached[d >> 6] >> np.uint64(d & 63)) & np.uint64(1))
                copies_row[d] += bit
                remote += bit
            remote -= np.int64((reached[s >> 6] >> np.uint64(s & 63)) & np.uint64(1))  # the home's own "copy"
            if num_nodes > 0:
                node_reached[:] = 0
                for d in range(num_devices):
                    node_reached[d // devices_per_node] |= (reached[d >> 6] >> np.uint64(d & 63)) & np.uint64(1)
                node_row = node_copies_GLDM[g, layer, s]
                for m in range(num_nodes):
                    node_row[m] += node_reached[m]
        stats_G3[g, 0] += num_layers * top_k
        stats_G3[g, 1] += local
        stats_G3[g, 2] += remote
    if aggregate:
        for g in range(num_groups):
            for layer in range(num_layers):
                for s in range(num_devices):
                    for e in range(num_experts):
                        c = by_expert[g, layer, s, e]
                        if c:
                            d = device_table_LDE[layer, s, e]
                            if count_slots:
                                slot_tokens_GLP[g, layer, slot_table_LDE[layer, s, e]] += c
                            activations_GLDD[g, layer, s, d] += c
                            if d == s:
                                stats_G3[g, 1] += c
    return -1
