"""Where the tokens of a batch are served and which copies cross devices: the evaluator's counting, per iteration.

`batch_traffic` is the per-iteration form of `repro.eval.accounting.account` (both count with
`repro.counting.count_rows`; tests check them equal):
activation (token n, layer l, slot j) of a token living on device s is served by physical slot
slot_table[l, s, expert] on device dst = slot // slots_per_device; a token travels once to each distinct remote
device (DeepEP's per-rank dedup), and once to each distinct remote node where the backend forwards inside the
node (DeepEP normal kernels). Rows belong to one of K iterations (`group`), so a block of K decode iterations is
counted in one pass. `stream_traffic` counts the same with `counting.count_rows_at` (rows read in place, the
engine's stats in the same pass): the engine's two-step path; its one-call path is CostModel.count_and_price.

Legend: N token rows, K iterations in a block, L MoE layers, k experts per token, E logical experts, D devices,
P physical slots per layer, M nodes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from repro.counting import count_rows, count_rows_at
from repro.errors import ConfigError
from repro.systems.base import Placement


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
    """
    num_layers, num_devices, _ = slot_table_LDE.shape
    num_nodes, (activations, copies, node_copies, slot_tokens) = _zero_tables(
        num_groups, num_layers, num_devices, devices_per_node, slots_per_device)
    bad_row = count_rows(np.asarray(group_N), home_NL, np.asarray(experts_NLk), slot_table_LDE,
                         slot_table_LDE // slots_per_device, devices_per_node, activations, copies, node_copies,
                         slot_tokens)
    if bad_row >= 0:
        raise ConfigError(f"token row {bad_row} of the batch has an expert id or home device outside the placement "
                          f"({slot_table_LDE.shape[2]} experts, {num_devices} devices); check the trace's model.")
    return BatchTraffic(activations=activations, copies=copies,
                        node_copies=node_copies if num_nodes > 1 else None, slot_tokens=slot_tokens)


def _zero_tables(num_groups: int, num_layers: int, num_devices: int, devices_per_node: int,
                 slots_per_device: int) -> tuple[int, tuple[np.ndarray, ...]]:
    """(nodes, the four zeroed int64 tables of BatchTraffic the counting loop fills; node_copies has 0 columns
    on one node)."""
    num_nodes = -(-num_devices // devices_per_node)
    activations = np.zeros((num_groups, num_layers, num_devices, num_devices), dtype=np.int64)
    node_copies = np.zeros((num_groups, num_layers, num_devices, num_nodes if num_nodes > 1 else 0), dtype=np.int64)
    slot_tokens = np.zeros((num_groups, num_layers, num_devices * slots_per_device), dtype=np.int64)
    return num_nodes, (activations, np.zeros_like(activations), node_copies, slot_tokens)


def device_tables(slot_table_LDE: np.ndarray, slots_per_device: int) -> tuple[np.ndarray, np.ndarray]:
    """(device int64[L, D, E] of each dispatch slot, uint64[L, D, E] 1 << that device, or size 0 past 64 devices):
    what `stream_traffic` needs beside the slot table, computed once per placement."""
    device = (slot_table_LDE // slots_per_device).astype(np.int64)
    bits = np.left_shift(np.uint64(1), device.astype(np.uint64)) if slot_table_LDE.shape[1] <= 64 \
        else np.zeros((0, 0, 0), dtype=np.uint64)
    return device, bits


def stream_traffic(rows_N: np.ndarray, group_N: np.ndarray, home_NL: np.ndarray, experts_RLk: np.ndarray,
                   slot_table_LDE: np.ndarray, device_tables_: tuple[np.ndarray, np.ndarray], slots_per_device: int,
                   num_groups: int, devices_per_node: int) -> tuple[BatchTraffic, np.ndarray]:
    """`batch_traffic` of the rows experts_RLk[rows_N] (rows_N int64[N]; read in place), device_tables_ from
    `device_tables`, and int64[G, 3] per group: activations, local activations, remote copies (what the engine
    reports)."""
    num_layers, num_devices, _ = slot_table_LDE.shape
    num_nodes, (activations, copies, node_copies, slot_tokens) = _zero_tables(
        num_groups, num_layers, num_devices, devices_per_node, slots_per_device)
    stats = np.zeros((num_groups, 3), dtype=np.int64)
    bad_row = count_rows_at(np.arange(len(rows_N)), rows_N, group_N, home_NL, experts_RLk, slot_table_LDE, device_tables_[0], device_tables_[1],
                            devices_per_node, activations, copies, node_copies, slot_tokens, stats)
    if bad_row >= 0:
        raise ConfigError(f"token row {bad_row} of the batch has an expert id or home device outside the placement "
                          f"({slot_table_LDE.shape[2]} experts, {num_devices} devices); check the trace's model.")
    traffic = BatchTraffic(activations=activations, copies=copies, node_copies=node_copies if num_nodes > 1 else None,
                           slot_tokens=slot_tokens)
    return traffic, stats
