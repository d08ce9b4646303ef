"""Sem-MoE Algorithm 3 (arXiv 2503.04398): online Attention-TP token reshuffling.

Legend: L MoE layers, E experts per layer, D devices = EP ranks (the paper's E), t distinct profiled token ids
(table rows; row t is the OOV fallback row), T tokens in one TP step, k experts per token, h lookback layers
(h' <= h given), Q = D**h device histories.

Each token's device is T[tok] or the Markov prediction A[history], whichever is more confident:
where(T_p > A_p, T, A) (`predict_devices`). A_p is calibrated to T_p's scale
(repro.affinity.tables.device_markov_table): it is the token confidence below which A beat T on the profile
(T judged leave-one-out), so the history only overrides tokens whose own table is weak, and only where that
gained local activations. The paper's raw A_p (a majority-vote frequency) overrode T too often and lowered
LAR on learned and replayed routing. Tokens are then grouped by device (most confident first), groups are
cut to the equal slices reduce-scatter needs and the overflow fills the free slots (the paper's align,
`align_to_slices`); `inverse_permutation` undoes the shuffle after the MoE layer.
"""

from __future__ import annotations

import numpy as np

from repro.affinity.tables import history_keys, majority_device
from repro.systems.base import even_counts_of


def fill_groups(
    group: np.ndarray, confidence: np.ndarray, capacity: np.ndarray, evicted: np.ndarray | None = None
) -> np.ndarray:
    """int64[T] final group per token: each group keeps its most confident tokens up to capacity int[G]; the
    overflow (and `evicted` bool[T], tokens that must leave their group) fills the free places in (group,
    confidence-descending) order, free places taken in group order. Needs capacity.sum() == T."""
    confidence = np.asarray(confidence, dtype=np.float64)
    if evicted is not None:
        confidence = np.where(evicted, -np.inf, confidence)  # last in their group, so they never displace a keeper
    num_tokens, num_groups = len(group), len(capacity)
    order = np.lexsort((-confidence, group))
    sorted_group = group[order]
    group_count = np.bincount(group, minlength=num_groups)
    rank_in_group = np.arange(num_tokens) - (np.cumsum(group_count) - group_count)[sorted_group]
    keep = rank_in_group < capacity[sorted_group]
    if evicted is not None:
        keep &= ~evicted[order]
    free = capacity - np.bincount(sorted_group[keep], minlength=num_groups)
    final_sorted = sorted_group.copy()
    final_sorted[~keep] = np.repeat(np.arange(num_groups), free)
    final = np.empty(num_tokens, dtype=np.int64)
    final[order] = final_sorted
    return final


def align_to_slices(
    device: np.ndarray, confidence: np.ndarray, num_devices: int, devices_per_node: int | None = None
) -> tuple[np.ndarray, np.ndarray, int]:
    """(permutation int64[T], counts int64[D], moved): order tokens so each rank's equal slice holds its tokens.

    device int[T] predicted device per token; confidence float[T]. Slices are even_counts(T, D). Each
    device keeps its most confident predicted tokens up to its slice size; the overflow, in (device,
    confidence-descending) order, fills the free slots in device order. moved = tokens not on their
    predicted device. Within a slice tokens keep their original order.

    devices_per_node G (several nodes, topology-aware plans): the same by node first (a node's capacity is
    its devices' slices), then by device inside each node, so an overflowing token moves to another device
    of its predicted node before it crosses nodes.
    """
    permutation, counts, moved = align_steps_to_slices(device, confidence, [len(device)], num_devices, devices_per_node)
    return permutation, counts[0], moved


def align_steps_to_slices(
    device: np.ndarray, confidence: np.ndarray, step_sizes, num_devices: int, devices_per_node: int | None = None
) -> tuple[np.ndarray, np.ndarray, int]:
    """align_to_slices of S steps at once: (permutation int64[N], counts int64[S, D], moved).

    device int[N], confidence float[N] hold the steps' tokens one step after another (step s: step_sizes[s] of
    them). permutation[a:b], over step s's positions a..b-1, is that step's own align_to_slices permutation plus a,
    and counts[s] its slices, bit for bit: every (step, device) pair is one group of fill_groups, and a step's
    overflow exactly fills its own free places, which follow its groups in group order."""
    device = np.asarray(device, dtype=np.int64)
    sizes = np.asarray(step_sizes, dtype=np.int64)
    num_steps = len(sizes)
    step = np.repeat(np.arange(num_steps), sizes)
    counts = even_counts_of(sizes, num_devices)
    if devices_per_node is None or devices_per_node >= num_devices:
        final = fill_groups(step * num_devices + device, confidence, counts.ravel()) - step * num_devices
    else:
        nodes = num_devices // devices_per_node
        predicted_node = device // devices_per_node
        node = fill_groups(step * nodes + predicted_node, confidence,
                           counts.reshape(num_steps, nodes, devices_per_node).sum(axis=2).ravel()) - step * nodes
        crossed = node != predicted_node  # wait in the first device of their new node, then fill
        final = fill_groups(step * num_devices + np.where(crossed, node * devices_per_node, device), confidence,
                            counts.ravel(), crossed) - step * num_devices
    permutation = np.argsort(step * num_devices + final, kind="stable")
    return permutation, counts, int((final != device).sum())


def inverse_permutation(permutation: np.ndarray) -> np.ndarray:
    """int64[T] inv with inv[permutation[i]] = i: applying it after the permutation restores the order."""
    inverse = np.empty(len(permutation), dtype=np.int64)
    inverse[np.asarray(permutation)] = np.arange(len(permutation))
    return inverse



def predict_devices(
    rows: np.ndarray,
    layer: int,
    prev_experts: np.ndarray | None,
    token_device: np.ndarray,
    token_confidence: np.ndarray,
    markov_device: np.ndarray | None,
    markov_confidence: np.ndarray | None,
    expert_device: np.ndarray,
    lookback: int,
    num_devices: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(device int64[T], confidence float32[T]): T / T_p, or A / A_p where the Markov table is more confident.

    rows int[T] table rows of the step's tokens; token_device int[L, t+1] (T), token_confidence float[L, t+1]
    (T_p); markov_device int[L, Q] (A), markov_confidence float[L, Q] (A_p), unused when lookback = 0;
    expert_device int[L, E]. prev_experts int[T, h', k] is chronological (column -1 = layer - 1), as
    repro.eval passes it. A_p is the break-even T_p of the token's history row, so `A_p > T_p` reads "this
    token's own table is weaker than the history's prediction was on the profile"; the returned confidence
    (max of the two) orders align.
    """
    device = token_device[layer, rows].astype(np.int64)
    confidence = token_confidence[layer, rows]
    depth = min(lookback, layer)
    # the table's rows at this layer index exactly `depth` previous devices: a shorter history is unusable
    if depth and prev_experts is not None and np.shape(prev_experts)[1] >= depth:
        prev_experts = np.asarray(prev_experts)
        history = np.stack(
            [
                majority_device(prev_experts[:, j], expert_device[layer - depth + i], num_devices)
                for i, j in enumerate(range(prev_experts.shape[1] - depth, prev_experts.shape[1]))
            ],
            axis=1,
        )
        keys = history_keys(history, num_devices)
        history_confidence = markov_confidence[layer, keys]
        use_markov = history_confidence > confidence  # Algorithm 3: where(T_p > A_p, T, A), ties -> T
        device = np.where(use_markov, markov_device[layer, keys], device)
        confidence = np.maximum(confidence, history_confidence)
    return device, confidence
