"""Routing statistics of a stretch of traffic and the distances that say how far live traffic has drifted from the
traffic a placement was fitted on. Pure functions, arrays in and out.

Three statistics, each per MoE layer, each normalised so that windows of different sizes compare:
- expert load: share of the layer's activations each expert receives, float[L, E];
- co-activation: share of the layer's (token, expert pair) co-activations each unordered pair receives,
  float[L, E, E] (symmetric, zero diagonal, sums to 1 per layer): the structure co-clustering exploits;
- request-to-rank affinity under a placement: per request, the share of its activations (all layers) served by
  the one device holding most of them, averaged over requests: what an Attention-DP scheduler can at best keep
  local for that request (1/D for a request spread evenly, 1 for one whose experts all sit on one device).

Distances (all >= 0, 0 for identical traffic): total variation (half the L1 distance) averaged over layers for the
load and co-activation; for affinity, how much the live affinity fell below the fitted one (max(0, fitted - live)).
Sampling noise alone gives a distance above 0 between two windows of the same traffic: thresholds are chosen on a
stationary stream (docs/drift.md).

Legend: N tokens, L MoE layers, k experts per token, E experts, D devices, R requests, W windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from repro.errors import ConfigError

STATISTICS = ("expert_load", "coactivation", "affinity")


@dataclass(frozen=True)
class RoutingStats:
    """expert_load float64[L, E] and coactivation float64[L, E, E] shares (module docstring) of some traffic."""

    expert_load: np.ndarray
    coactivation: np.ndarray


def window_bounds(num_requests: int, window_requests: int) -> np.ndarray:
    """int64[W + 1] request offsets of the windows: window w holds requests bounds[w] .. bounds[w + 1] - 1 in
    arrival order, W = num_requests // window_requests (a last partial window is left out, so every window
    weighs the same)."""
    if window_requests < 1 or num_requests < window_requests:
        raise ConfigError(f"drift windows of {window_requests} requests need window_requests >= 1 and at least one "
                          f"window in the {num_requests} requests; lower drift.window_requests.")
    return np.arange(num_requests // window_requests + 1, dtype=np.int64) * window_requests


def routing_stats(experts_NLk: np.ndarray, num_experts: int) -> RoutingStats:
    """RoutingStats of the tokens experts_NLk int[N, L, k] (N >= 1)."""
    experts = np.asarray(experts_NLk, dtype=np.int64)
    num_tokens, num_layers, _ = experts.shape
    load = np.zeros((num_layers, num_experts))
    coactivation = np.zeros((num_layers, num_experts, num_experts))
    for layer in range(num_layers):  # L steps, each a [N, E] one-hot product
        onehot = np.zeros((num_tokens, num_experts))
        np.put_along_axis(onehot, experts[:, layer], 1.0, axis=1)
        load[layer] = onehot.sum(axis=0)
        pairs = onehot.T @ onehot
        np.fill_diagonal(pairs, 0.0)
        coactivation[layer] = pairs
    load /= np.maximum(load.sum(axis=1, keepdims=True), 1e-30)
    coactivation /= np.maximum(coactivation.sum(axis=(1, 2), keepdims=True), 1e-30)
    return RoutingStats(load, coactivation)


def request_affinity(experts_NLk: np.ndarray, offsets: np.ndarray, expert_device_LE: np.ndarray,
                     num_devices: int) -> float:
    """Mean over requests of the share of a request's activations served by its best device (module docstring).

    experts_NLk int[N, L, k]; offsets int64[R + 1] into the N tokens (R >= 1); expert_device_LE int[L, E]."""
    experts = np.asarray(experts_NLk, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    num_layers = experts.shape[1]
    device = np.asarray(expert_device_LE)[np.arange(num_layers)[None, :, None], experts]  # [N, L, k]
    request = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))  # [N]
    counts = np.zeros((len(offsets) - 1, num_devices))
    np.add.at(counts, (np.broadcast_to(request[:, None, None], device.shape).ravel(), device.ravel()), 1.0)
    totals = counts.sum(axis=1)
    served = totals > 0
    return float(np.mean(counts[served].max(axis=1) / totals[served])) if served.any() else 0.0


def total_variation(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over the first axis (layers) of half the L1 distance between the share arrays a[l] and b[l]."""
    diff = np.abs(np.asarray(a) - np.asarray(b)).reshape(len(a), -1)
    return float(np.mean(0.5 * diff.sum(axis=1)))


def drift_distances(fitted: RoutingStats, live: RoutingStats, fitted_affinity: float,
                    live_affinity: float) -> dict[str, float]:
    """{"expert_load", "coactivation", "affinity"}: the three distances of the module docstring."""
    return {
        "expert_load": total_variation(fitted.expert_load, live.expert_load),
        "coactivation": total_variation(fitted.coactivation, live.coactivation),
        "affinity": max(0.0, fitted_affinity - live_affinity),
    }


def intra_device_coactivation(coactivation_LEE: np.ndarray, expert_device_LE: np.ndarray) -> np.ndarray:
    """float64[L] share of each layer's co-activations whose two experts sit on one device."""
    device = np.asarray(expert_device_LE)
    same = device[:, :, None] == device[:, None, :]  # [L, E, E]
    return (np.asarray(coactivation_LEE) * same).sum(axis=(1, 2))


def mix_distance(fitted_sources: np.ndarray, live_sources: np.ndarray) -> float:
    """Total variation between two windows' request mixes: the shares of each source dataset (arrays of source ids
    per request, any hashable dtype). 0 when both hold the same datasets in the same shares."""
    fitted_sources, live_sources = np.asarray(fitted_sources), np.asarray(live_sources)
    names = np.union1d(fitted_sources, live_sources)
    share = lambda s: np.array([np.mean(s == n) for n in names]) if len(s) else np.zeros(len(names))  # noqa: E731
    return float(0.5 * np.abs(share(fitted_sources) - share(live_sources)).sum())
