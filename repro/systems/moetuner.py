"""MoETuner-style placement (Go & Mahajan, arXiv 2502.06643) on HiGHS, as the `moetuner` system.

ILP 1 (per layer): assign the E experts to D clusters of exactly E/D experts minimising the heaviest cluster's
token load P[l, e] (profile activation counts). ILP 2 (cluster → device, per layer): place the clusters so the
heaviest device pair's inter-layer traffic (tokens whose expert at layer l sits on device g1 and expert at
layer l+1 on device g2 ≠ g1, divided by the bandwidth B[g1, g2]) is as small as possible.

Deviations from the paper, disclosed:
- Fixed cluster size E/D (the paper's ILP 1 has no size constraint): SGLang/vLLM need the same number of slots
  per rank in every layer, so engines can load the placement (the sjqsjq/EPLB port does the same). With fixed
  sizes the equal-total-memory constraint of ILP 2 holds by construction.
- ILP 1 minimises the maximum cluster load (min-max; the printed objective is the sum of absolute deviations
  from the mean); both target balance and min-max closes its relative gap quickly.
- ILP 2 is solved layer by layer (layer 0's clusters go to devices in order; layer l+1's assignment is exact
  given layer l's), instead of one joint model with y·y products over all layers: the joint model has
  D⁴ product variables per layer pair and is out of reach for HiGHS at D = 8. A small secondary term
  (`locality_weight`) also rewards traffic that stays on a device.
- HiGHS instead of Gurobi; a node budget per solve (node_limit: where it runs out, the best feasible answer is
  used, warned, and plan.info["solver_status"] = "node_limit" with the gap; the same answer on every machine);
  time_limit is a safety net that fails the fit rather than use an answer that depends on the machine's speed.
- No data placement: requests round-robin (DP), contiguous token slices (TP) — MoETuner has none.

Legend: L MoE layers, E experts per layer, D devices (= clusters), N tokens, k experts per token.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint

from repro.errors import ConfigError
from repro.parallel import ParallelConfig
from repro.systems.base import Placement, Plan
from repro.systems.ep import contiguous_placement
from repro.systems.eplb import device_load, expert_activation_counts, mean_max_over_mean
from repro.systems.milp import MilpResult, merge_status, solve_milp
from repro.traces import RoutingTrace


def layer_transitions(trace: RoutingTrace) -> np.ndarray:
    """float[L-1, E, E] R[l, e, e']: token activations routed to e at layer l and e' at layer l+1 (all k×k pairs)."""
    num_layers, num_experts = trace.num_layers, trace.meta.num_experts
    experts = np.asarray(trace.experts, dtype=np.int64)  # [N, L, k]
    top_k = experts.shape[2]
    out = np.zeros((max(num_layers - 1, 0), num_experts, num_experts))
    for layer in range(num_layers - 1):  # loop over layers only; all tokens and k×k pairs vectorised
        src = np.repeat(experts[:, layer, :], top_k, axis=1)  # [N, k·k]
        dst = np.tile(experts[:, layer + 1, :], (1, top_k))
        out[layer] = np.bincount((src * num_experts + dst).ravel(), minlength=num_experts**2).reshape(
            num_experts, num_experts
        )
    return out


def balanced_clusters(load: np.ndarray, num_clusters: int, *, time_limit: float, mip_rel_gap: float,
                      node_limit: int | None = None) -> tuple[np.ndarray, MilpResult]:
    """ILP 1: expert → cluster with exactly E/D experts per cluster, minimising the maximum cluster load.

    load float[E] profile activations of one layer. Returns (cluster int[E], solve result); variables
    x[e, c] binary and the max load t; expert e may only sit in clusters 0..e (symmetry breaking).
    """
    num_experts = len(load)
    size = num_experts // num_clusters
    scale = max(float(load.sum()), 1.0)  # normalised loads keep HiGHS tolerances meaningful
    w = load / scale
    num_x = num_experts * num_clusters
    cost = np.zeros(num_x + 1)
    cost[-1] = 1.0
    cluster = np.arange(num_clusters)
    x_col = np.arange(num_x).reshape(num_experts, num_clusters)
    rows, cols, vals = [], [], []
    # Σ_c x[e, c] = 1 (rows 0..E-1); Σ_e x[e, c] = E/D (rows E..E+D-1); Σ_e w_e x[e, c] − t ≤ 0 (next D rows)
    rows += [np.repeat(np.arange(num_experts), num_clusters), num_experts + np.tile(cluster, num_experts)]
    cols += [x_col.ravel(), x_col.ravel()]
    vals += [np.ones(num_x), np.ones(num_x)]
    rows += [num_experts + num_clusters + np.tile(cluster, num_experts), num_experts + num_clusters + cluster]
    cols += [x_col.ravel(), np.full(num_clusters, num_x)]
    vals += [np.repeat(w, num_clusters), -np.ones(num_clusters)]
    n_rows = num_experts + 2 * num_clusters
    matrix = sp.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n_rows, num_x + 1))
    lower = np.concatenate([np.ones(num_experts), np.full(num_clusters, size), np.full(num_clusters, -np.inf)])
    upper = np.concatenate([np.ones(num_experts), np.full(num_clusters, size), np.zeros(num_clusters)])
    ub = np.ones(num_x + 1)
    ub[-1] = np.inf
    ub[:num_x][(cluster[None, :] > np.arange(num_experts)[:, None]).ravel()] = 0.0
    integrality = np.ones(num_x + 1, dtype=np.int8)
    integrality[-1] = 0
    result = solve_milp(
        cost, [LinearConstraint(matrix, lower, upper)], integrality, Bounds(np.zeros(num_x + 1), ub),
        time_limit=time_limit, mip_rel_gap=mip_rel_gap, node_limit=node_limit,
        what=f"MoETuner ILP 1 (E={num_experts} experts, D={num_clusters} clusters)",
    )
    result = MilpResult(result.x, result.objective * scale, result.status, result.gap, result.seconds)
    return np.argmax(result.x[:num_x].reshape(num_experts, num_clusters), axis=1), result


def place_clusters(
    traffic: np.ndarray, bandwidth: np.ndarray, *, locality_weight: float, time_limit: float, mip_rel_gap: float,
    node_limit: int | None = None,
) -> tuple[np.ndarray, MilpResult]:
    """ILP 2 step: device of each cluster of layer l+1 given layer l's placement.

    traffic float[D, C] tokens from device g (layer l) to cluster c (layer l+1); bandwidth float[D, D].
    Minimises max_{g ≠ h} traffic(g → h) / B[g, h] − locality_weight · mean local traffic over a one-to-one
    assignment y[c, h]. Returns (device int[C], solve result).
    """
    num_devices = traffic.shape[0]
    scale = max(float(traffic.sum()), 1.0)
    tr = traffic / scale
    num_y = num_devices * num_devices  # y[c, h] at c * D + h
    t_col = num_y
    cost = np.zeros(num_y + 1)
    cost[t_col] = 1.0
    # local traffic of cluster c on device h is tr[h, c]; reward it a little (ties between equal max pairs)
    cost[:num_y] = -locality_weight * tr.T.ravel() / num_devices
    c_idx, h_idx = np.divmod(np.arange(num_y), num_devices)
    rows, cols, vals = [], [], []
    # assignment: Σ_h y[c, h] = 1 (rows 0..D-1), Σ_c y[c, h] = 1 (rows D..2D-1)
    rows += [c_idx, num_devices + h_idx]
    cols += [np.arange(num_y)] * 2
    vals += [np.ones(num_y)] * 2
    # pair (g, h), g ≠ h: Σ_c tr[g, c] y[c, h] / B[g, h] − t ≤ 0
    pairs_g, pairs_h = np.nonzero(~np.eye(num_devices, dtype=bool))
    pair_row = 2 * num_devices + np.arange(len(pairs_g))
    rows += [np.repeat(pair_row, num_devices), pair_row]
    cols += [(np.arange(num_devices)[None, :] * num_devices + pairs_h[:, None]).ravel(), np.full(len(pairs_g), t_col)]
    vals += [(tr[pairs_g] / bandwidth[pairs_g, pairs_h][:, None]).ravel(), -np.ones(len(pairs_g))]
    n_rows = 2 * num_devices + len(pairs_g)
    matrix = sp.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n_rows, num_y + 1))
    lower = np.concatenate([np.ones(2 * num_devices), np.full(len(pairs_g), -np.inf)])
    upper = np.concatenate([np.ones(2 * num_devices), np.zeros(len(pairs_g))])
    ub = np.ones(num_y + 1)
    ub[t_col] = np.inf
    integrality = np.ones(num_y + 1, dtype=np.int8)
    integrality[t_col] = 0
    result = solve_milp(
        cost, [LinearConstraint(matrix, lower, upper)], integrality, Bounds(np.zeros(num_y + 1), ub),
        time_limit=time_limit, mip_rel_gap=mip_rel_gap, node_limit=node_limit, what=f"MoETuner ILP 2 (D={num_devices} devices)",
    )
    device = np.argmax(result.x[:num_y].reshape(num_devices, num_devices), axis=1)
    return device, result


def bandwidth_matrix(num_devices: int, devices_per_node: int, inter_node_bandwidth: float) -> np.ndarray:
    """float[D, D] relative bandwidth: 1 inside a node, `inter_node_bandwidth` across nodes (1 = uniform)."""
    node = np.arange(num_devices) // devices_per_node
    return np.where(node[:, None] == node[None, :], 1.0, inter_node_bandwidth)


def max_pair_traffic(expert_device: np.ndarray, transitions: np.ndarray, num_devices: int) -> np.ndarray:
    """float[L-1] heaviest off-diagonal device-pair traffic between consecutive layers for a placement.

    expert_device int[L, E]; transitions float[L-1, E, E].
    """
    onehot = np.eye(num_devices)[expert_device]  # [L, E, D]
    pair = np.einsum("lef,led,lfg->ldg", transitions, onehot[:-1], onehot[1:])  # [L-1, D, D]
    pair[:, np.arange(num_devices), np.arange(num_devices)] = 0.0
    return pair.reshape(len(pair), -1).max(axis=1) if len(pair) else np.zeros(0)


def moetuner_placement(
    load: np.ndarray,
    transitions: np.ndarray,
    bandwidth: np.ndarray,
    *,
    locality_weight: float = 1e-3,
    time_limit: float = 600.0,
    mip_rel_gap: float = 0.025,
    node_limit: int | None = 1000,
) -> tuple[np.ndarray, list[MilpResult]]:
    """ILP 1 per layer, then ILP 2 layer by layer. load float[L, E]; transitions float[L-1, E, E];
    bandwidth float[D, D]. Returns (expert_device int[L, E] with exactly E/D experts per device, solves)."""
    num_layers, num_experts = load.shape
    num_devices = bandwidth.shape[0]
    solves: list[MilpResult] = []
    clusters = np.empty((num_layers, num_experts), dtype=np.int64)
    for layer in range(num_layers):
        clusters[layer], res = balanced_clusters(load[layer], num_devices, time_limit=time_limit, mip_rel_gap=mip_rel_gap,
                                                 node_limit=node_limit)
        solves.append(res)
    expert_device = np.empty_like(clusters)
    expert_device[0] = clusters[0]  # layer 0: cluster c on device c (devices are interchangeable up to B)
    for layer in range(num_layers - 1):
        # traffic[g, c]: tokens from device g at this layer to cluster c at the next layer
        onehot_dev = np.eye(num_devices)[expert_device[layer]]  # [E, D]
        onehot_next = np.eye(num_devices)[clusters[layer + 1]]  # [E, C]
        traffic = onehot_dev.T @ transitions[layer] @ onehot_next
        device_of_cluster, res = place_clusters(
            traffic, bandwidth, locality_weight=locality_weight, time_limit=time_limit, mip_rel_gap=mip_rel_gap,
            node_limit=node_limit,
        )
        solves.append(res)
        expert_device[layer + 1] = device_of_cluster[clusters[layer + 1]]
    return expert_device, solves


class MoETuner:
    """MoETuner-style expert placement; no data placement (round-robin DP, contiguous TP).

    inter_node_bandwidth: relative bandwidth across nodes (parallel.devices_per_node devices per node); 1.0
    gives the uniform matrix. node_limit / mip_rel_gap / time_limit apply to every ILP solve (MoETuner used a 0.025
    gap; see repro.systems.milp.solve_milp for the two limits).
    """

    name = "moetuner"

    def __init__(
        self,
        time_limit: float = 600.0,
        mip_rel_gap: float = 0.025,
        inter_node_bandwidth: float = 1.0,
        locality_weight: float = 1e-3,
        node_limit: int | None = 1000,
    ):
        if not inter_node_bandwidth > 0:
            raise ConfigError(f"system.params.inter_node_bandwidth must be > 0, got {inter_node_bandwidth}.")
        if locality_weight < 0:
            raise ConfigError(f"system.params.locality_weight must be >= 0, got {locality_weight}.")
        self.time_limit = float(time_limit)
        self.mip_rel_gap = float(mip_rel_gap)
        self.node_limit = node_limit
        self.inter_node_bandwidth = float(inter_node_bandwidth)
        self.locality_weight = float(locality_weight)

    def fit(self, profile: RoutingTrace, parallel: ParallelConfig, rng: np.random.Generator) -> Plan:
        parallel.check_experts(profile.meta.num_experts)
        if profile.num_tokens == 0:
            raise ConfigError("the profile trace has no tokens; MoETuner needs profiled expert loads.")
        load = expert_activation_counts(profile).astype(np.float64)
        transitions = layer_transitions(profile)
        bandwidth = bandwidth_matrix(parallel.devices, parallel.devices_per_node, self.inter_node_bandwidth)
        expert_device, solves = moetuner_placement(
            load, transitions, bandwidth,
            locality_weight=self.locality_weight, time_limit=self.time_limit, mip_rel_gap=self.mip_rel_gap,
            node_limit=self.node_limit,
        )
        placement = Placement.from_expert_device(expert_device, parallel.devices)
        contiguous = contiguous_placement(profile.num_layers, profile.meta.num_experts, parallel.devices)

        def mean_max_pair(device: np.ndarray) -> float:
            return float(max_pair_traffic(device, transitions, parallel.devices).mean()) if len(transitions) else 0.0

        info = merge_status(solves)
        info["profile_load_imbalance_max_mean"] = mean_max_over_mean(device_load(load, placement))
        info["profile_max_pair_traffic"] = mean_max_pair(expert_device)
        info["profile_max_pair_traffic_contiguous"] = mean_max_pair(contiguous.expert_device())
        return Plan(placement, parallel, info)
