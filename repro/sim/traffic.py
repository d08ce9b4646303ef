"""Where the tokens of a batch are served and which copies cross devices: the evaluator's counting, per iteration.

`batch_traffic` is the vectorised, per-iteration form of `repro.eval.accounting.account` (tests check it equal):
activation (token n, layer l, slot j) of a token living on device s is served by physical slot
slot_table[l, s, expert] on device dst = slot // slots_per_device; a token travels once to each distinct remote
device (DeepEP's per-rank dedup), and once to each distinct remote node where the backend forwards inside the
node (DeepEP normal kernels). Rows belong to one of K iterations (`group`), so a block of K decode iterations is
counted in one pass.

Legend: N token rows, K iterations in a block, L MoE layers, k experts per token, E logical experts, D devices,
P physical slots per layer, M nodes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from repro.errors import ConfigError
from repro.systems.base import Placement

# token-layers per chunk: int32 work arrays of k x chunk stay in L2 (the evaluator's measured optimum)
CHUNK_EVENTS = 1 << 14


class BatchTraffic(NamedTuple):
    """Exact counts of one block of iterations (all int64).

    activations[g, l, s, d]: activations of tokens living on s served on d (diagonal: local activations).
    copies[g, l, s, d]: distinct (token, d) pairs, the dispatch copies s sends to d (diagonal: tokens keeping an
        activation at home; they travel nowhere).
    node_copies[g, l, s, m]: distinct (token, node m) pairs, or None when there is one node.
    slot_tokens[g, l, p]: activations served by physical slot p (the rows of its grouped GEMM).
    """

    activations: np.ndarray
    copies: np.ndarray
    node_copies: np.ndarray | None
    slot_tokens: np.ndarray


def dispatch_slots(placement: Placement, seed: int = 0) -> np.ndarray:
    """int32[L, D, E] the physical slot that serves expert e for tokens living on device s.

    The device is `Placement.dispatch_device(seed)` (the evaluator's rule); inside it, the first slot holding e.
    """
    dispatch_LDE = placement.dispatch_device(seed)
    p2l_LP = placement.physical_to_logical
    num_layers, num_slots = p2l_LP.shape
    spd = placement.slots_per_device
    # first slot of each (layer, device, expert): write slots in reverse so the lowest index wins
    first_LDE = np.full((num_layers, placement.num_devices, placement.num_experts), -1, dtype=np.int64)
    layer = np.repeat(np.arange(num_layers), num_slots)[::-1]
    slot = np.tile(np.arange(num_slots), num_layers)[::-1]
    first_LDE[layer, slot // spd, p2l_LP.ravel()[::-1]] = slot
    layer_idx = np.arange(num_layers)[:, None, None]
    expert_idx = np.arange(placement.num_experts)[None, None, :]
    return first_LDE[layer_idx, dispatch_LDE, expert_idx].astype(np.int32)


def batch_traffic(
    group_N: np.ndarray,
    home_NL: np.ndarray,
    experts_NLk: np.ndarray,
    slot_table_LDE: np.ndarray,
    slots_per_device: int,
    num_groups: int,
    devices_per_node: int,
) -> BatchTraffic:
    """Count one block: group_N int[N] iteration of each row, home_NL int[N, L] device each token lives on
    before each layer (a broadcast view is fine), experts_NLk int[N, L, k] logical experts,
    slot_table_LDE int[L, D, E] from `dispatch_slots`. Returns BatchTraffic (shapes in its docstring).

    Like `account`, rows are processed in chunks whose int32 work arrays stay in cache, and every activation
    gets one histogram key looked up from a [L, D, E] table (layer, first-copy flag, home, destination).
    """
    num_layers, num_devices, num_experts = slot_table_LDE.shape
    num_slots = num_devices * slots_per_device
    num_nodes = -(-num_devices // devices_per_node)
    pairs = num_devices * num_devices
    per_group = num_layers * 2 * pairs
    if num_groups * max(per_group, num_layers * num_devices * num_nodes, num_layers * num_slots) >= 2**31:
        raise ConfigError(
            f"{num_groups} iterations x {num_layers} layers x {num_devices} devices overflow the int32 histogram keys "
            "of batch_traffic; lower sim.max_block_iterations."
        )
    layer_L = np.arange(num_layers, dtype=np.int64)[:, None, None]
    dest_LDE = slot_table_LDE.astype(np.int64) // slots_per_device
    home_LDE = np.arange(num_devices)[None, :, None]
    key_table = ((layer_L * 2 * num_devices + home_LDE) * num_devices + dest_LDE).astype(np.int32).ravel()
    slot_table = (layer_L * num_slots + slot_table_LDE).astype(np.int32).ravel()
    node_table = ((layer_L * num_devices + home_LDE) * num_nodes + dest_LDE // devices_per_node).astype(np.int32).ravel()
    row_L = (np.arange(num_layers) * num_devices * num_experts).astype(np.int32)
    histogram = np.zeros(num_groups * per_group, dtype=np.int64)
    slot_tokens = np.zeros(num_groups * num_layers * num_slots, dtype=np.int64)
    node_copies = np.zeros(num_groups * num_layers * num_devices * num_nodes, dtype=np.int64) if num_nodes > 1 else None
    group_N = np.asarray(group_N, dtype=np.int32)

    chunk = max(16, CHUNK_EVENTS // num_layers)
    for start in range(0, len(group_N), chunk):
        experts_nLk = np.asarray(experts_NLk[start : start + chunk])
        row_nL = home_NL[start : start + chunk].astype(np.int32) * num_experts + row_L
        index_knL = np.empty((experts_nLk.shape[2], len(row_nL), num_layers), dtype=np.int32)
        np.add(experts_nLk.transpose(2, 0, 1), row_nL, out=index_knL)
        group_n1 = group_N[start : start + chunk, None]
        key_knL = np.take(key_table, index_knL)
        _flag_first_copies(key_knL, pairs)
        key_knL += group_n1 * np.int32(per_group)
        histogram += np.bincount(key_knL.ravel(), minlength=len(histogram))
        slot_knL = np.take(slot_table, index_knL)
        slot_knL += group_n1 * np.int32(num_layers * num_slots)
        slot_tokens += np.bincount(slot_knL.ravel(), minlength=len(slot_tokens))
        if node_copies is not None:
            node_knL = np.take(node_table, index_knL)
            first = _first_occurrence(node_knL)
            node_knL += group_n1 * np.int32(num_layers * num_devices * num_nodes)
            node_copies += np.bincount(node_knL[first], minlength=len(node_copies))

    histogram = histogram.reshape(num_groups, num_layers, 2, num_devices, num_devices)
    return BatchTraffic(
        activations=histogram.sum(axis=2),
        copies=histogram[:, :, 1],
        node_copies=None if node_copies is None else node_copies.reshape(num_groups, num_layers, num_devices, num_nodes),
        slot_tokens=slot_tokens.reshape(num_groups, num_layers, num_slots),
    )


def _flag_first_copies(key_knL: np.ndarray, pairs: int) -> None:
    """Add `pairs` (the first-copy flag) to every key whose destination no earlier slot of its row has.

    Keys of one token-layer differ only by destination, so comparing keys compares destinations; walk j
    downwards so earlier slots still hold their unflagged keys when compared (as `account` does).
    """
    for j in range(key_knL.shape[0] - 1, 0, -1):
        duplicate = key_knL[j] == key_knL[0]
        for i in range(1, j):
            duplicate |= key_knL[j] == key_knL[i]
        key_knL[j] += ~duplicate * np.int32(pairs)
    key_knL[0] += pairs


def _first_occurrence(values_kNL: np.ndarray) -> np.ndarray:
    """bool[k, N, L]: True where slot j's value differs from every earlier slot's value of the same row."""
    top_k = values_kNL.shape[0]
    first = np.ones(values_kNL.shape, dtype=bool)
    for j in range(1, top_k):
        duplicate = values_kNL[j] == values_kNL[0]
        for i in range(1, j):
            duplicate |= values_kNL[j] == values_kNL[i]
        first[j] = ~duplicate
    return first
