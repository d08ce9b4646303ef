"""dp_bound: a proven Attention-DP LAR ceiling, with the best hindsight-feasible solution beside it.

What it bounds. Every Attention-DP system that (a) sends each request to one rank for all layers with at most
q = ceil(R/D) requests per rank (round-robin `ep`, `moetuner`, `eplb`, and Sem-MoE's round-robin dev_mask, where
every D consecutive requests hit all D ranks) and (b) places the experts of each layer on P slots, P/D per
device (P = E + num_redundant; num_redundant = 0 is the no-replication case, E/D experts per device), with each
activation served locally when its device holds a replica (SGLang's static dispatch). LAR = local activations /
all activations (every token, every layer, every top-k slot).

Relaxation (per layer l, an LP). Let c[r, e] = activations of request r on expert e in layer l (all its tokens,
all k slots) and m[e] the replica count of e. Any feasible (assignment, placement) induces s[r, e] = 1 when the
device of r holds e, and

    Σ_e s[r, e] ≤ P/D            (a device holds at most P/D distinct experts)
    Σ_r s[r, e] ≤ q · m[e]        (e sits on at most m[e] devices, each holding at most q requests)
    Σ_e m[e] ≤ P, 1 ≤ m[e] ≤ D    (every expert needs a slot; only P slots)

with local activations = Σ c[r, e] s[r, e]. Maximising that over 0 ≤ s ≤ 1 and real m is a relaxation, so its
value bounds every feasible solution's local activations in that layer, and the sum over layers bounds the
total. With P = E the m are forced to 1 and the LP is a bipartite b-matching (totally unimodular): its vertex is
the exact optimum of the relaxed integer problem. Pairs with c = 0 are dropped (they add nothing and only loosen
≤ rows). The relaxation ignores that the assignment is shared across layers and that requests on one device see
the same experts, so it can be loose: plan.info reports the gap to the witness.

Witness (the plan that is evaluated). fit_assign's alternation with request-count balance (token_balance null:
floor/ceil(R/D) requests per rank, exact per-layer re-placement with E/D experts per device) from each base in
`bases` (placements fitted on the evaluated trace), keeping the best; the plan replays those ranks, so the
evaluated LAR is `lar_feasible` exactly. With num_redundant > 0 the witness keeps P = E, still feasible (extra
slots can only add locality), so lar_feasible ≤ optimum ≤ lar_bound holds as well.

On several nodes (parallel.devices_per_node < D) the same LP with the Nn nodes as the "devices" (at most
G x q requests and P / Nn slots per node) bounds the share of activations served on their request's own node:
node_local_bound, the ceiling of the evaluator's node_local_activation_rate for the same systems, so
1 − node_local_bound is a floor on the activations (hence traffic) that must cross nodes.

plan.info: lar_bound, lar_bound_per_layer (list), lar_feasible, lar_feasible_per_layer (list), bound_gap =
lar_bound − lar_feasible, bound_max_requests_per_rank (q), bound_slots_per_device, witness_base,
bound_seconds, and node_local_bound on several nodes.

`dp_exact_milp` solves the joint problem (one assignment for all layers, one placement per layer, P = E) exactly
with HiGHS on tiny instances; tests check lar_bound ≥ exact ≥ every DP system's LAR.

Legend: R requests, E experts per layer, D devices, L MoE layers, P physical slots per layer, q the most
requests per rank, V LP variables (request-expert pairs with activations).
"""

from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, linprog

from repro.errors import ConfigError, ReproError
from repro.parallel import ParallelConfig
from repro.systems.base import Plan
from repro.systems.fit_assign import FitAssignPlan, fit_request_assignment, request_device_scores
from repro.systems.milp import solve_milp
from repro.systems.oracle import make_base
from repro.traces import RoutingTrace


def layer_bound(counts: np.ndarray, num_devices: int, num_slots: int, max_requests: int) -> float:
    """Upper bound on one layer's local activations (the module docstring's LP).

    counts float[R, E] activations of request r on expert e; num_slots P (a multiple of num_devices, ≥ E);
    max_requests q, the most requests any rank holds. Returns the LP optimum (HiGHS dual simplex).
    """
    num_requests, num_experts = counts.shape
    slots_per_device = num_slots // num_devices
    request_idx, expert_idx = np.nonzero(counts > 0)
    weight = counts[request_idx, expert_idx].astype(np.float64)
    num_pairs = len(weight)
    if num_pairs == 0:
        return 0.0
    replicated = num_slots > num_experts
    num_vars = num_pairs + (num_experts if replicated else 0)
    pair = np.arange(num_pairs)
    per_request = sp.csr_array((np.ones(num_pairs), (request_idx, pair)), shape=(num_requests, num_vars))
    per_expert = sp.coo_array((np.ones(num_pairs), (expert_idx, pair)), shape=(num_experts, num_vars))
    rows, rhs = [per_request], [np.full(num_requests, float(slots_per_device))]
    bounds = [(0.0, 1.0)] * num_pairs
    if replicated:  # Σ_r s[r, e] − q m[e] ≤ 0 and Σ_e m[e] ≤ P, 1 ≤ m[e] ≤ D
        m = num_pairs + np.arange(num_experts)
        per_expert = per_expert + sp.coo_array(
            (np.full(num_experts, -float(max_requests)), (np.arange(num_experts), m)), shape=(num_experts, num_vars)
        )
        rows += [per_expert, sp.csr_array((np.ones(num_experts), (np.zeros(num_experts, dtype=np.int64), m)),
                                          shape=(1, num_vars))]
        rhs += [np.zeros(num_experts), [float(num_slots)]]
        bounds += [(1.0, float(num_devices))] * num_experts
    else:
        rows.append(per_expert)
        rhs.append(np.full(num_experts, float(max_requests)))
    scale = max(float(weight.max()), 1.0)
    cost = np.concatenate([-weight / scale, np.zeros(num_vars - num_pairs)])
    lp = linprog(cost, A_ub=sp.vstack(rows).tocsr(), b_ub=np.concatenate(rhs), bounds=bounds, method="highs-ds",
                 options={"presolve": False})
    if lp.status != 0:
        raise ReproError(f"dp_bound: the per-layer LP failed ({lp.message}).")
    return -float(lp.fun) * scale


def dp_lar_bound(
    per_layer: list[np.ndarray], num_devices: int, num_slots: int, max_requests: int | None = None
) -> np.ndarray:
    """float[L] upper bounds on each layer's local activations; per_layer is L float[R, E] (request_device_scores).

    max_requests: the most requests one device holds (default ceil(R / num_devices)). With num_devices = the
    node count, P / nodes slots per node and max_requests = devices_per_node x ceil(R / D) it bounds the
    activations served on their request's own node instead (`node_local_bound`)."""
    num_requests = per_layer[0].shape[0]
    if max_requests is None:
        max_requests = -(-num_requests // num_devices)
    return np.array([layer_bound(counts, num_devices, num_slots, max_requests) for counts in per_layer])


def dp_exact_milp(per_layer: list[np.ndarray], num_devices: int, *, time_limit: float = 60.0) -> tuple[float, np.ndarray]:
    """(most local activations, rank int[R]) over every assignment with ≤ ceil(R/D) requests per rank and every
    no-replication placement (E/D experts per device per layer), solved exactly by HiGHS. Tiny instances only:
    R·D + L·E·D binaries and L·R·E·D continuous products.

    Variables x[r, d] (request r on d), y[l, e, d] (expert e of layer l on d), w[l, r, e, d] ≤ x[r, d],
    w ≤ y[l, e, d] (local when both hold; maximised, so the upper bounds are the whole linearisation). Request 0
    is fixed to rank 0 (ranks are interchangeable).
    """
    num_layers = len(per_layer)
    num_requests, num_experts = per_layer[0].shape
    if num_experts % num_devices:
        raise ConfigError(f"{num_experts} experts do not split over {num_devices} devices.")
    nx, ny = num_requests * num_devices, num_layers * num_experts * num_devices
    nw = num_layers * num_requests * num_experts * num_devices
    x_id = np.arange(nx).reshape(num_requests, num_devices)
    y_id = nx + np.arange(ny).reshape(num_layers, num_experts, num_devices)
    w_id = nx + ny + np.arange(nw).reshape(num_layers, num_requests, num_experts, num_devices)
    num_vars = nx + ny + nw
    q, size = -(-num_requests // num_devices), num_experts // num_devices
    rows, lo, hi = [], [], []

    def row(variables, low, high):  # Σ x[variables] in [low, high]
        dense = np.zeros(num_vars)
        dense[variables] = 1.0
        rows.append(dense)
        lo.append(low)
        hi.append(high)

    for r in range(num_requests):
        row(x_id[r], 1, 1)  # one rank per request
    for d in range(num_devices):
        row(x_id[:, d], 0, q)  # at most q requests per rank
    for layer in range(num_layers):
        for e in range(num_experts):
            row(y_id[layer, e], 1, 1)  # one device per expert
        for d in range(num_devices):
            row(y_id[layer, :, d], size, size)  # E/D experts per device
    w_flat, x_flat, y_flat = w_id.ravel(), np.broadcast_to(x_id[None, :, None, :], w_id.shape).ravel(), \
        np.broadcast_to(y_id[:, None, :, :], w_id.shape).ravel()
    product = sp.vstack([
        sp.csr_array((np.r_[np.ones(nw), -np.ones(nw)], (np.r_[np.arange(nw), np.arange(nw)], np.r_[w_flat, x_flat])),
                     shape=(nw, num_vars)),
        sp.csr_array((np.r_[np.ones(nw), -np.ones(nw)], (np.r_[np.arange(nw), np.arange(nw)], np.r_[w_flat, y_flat])),
                     shape=(nw, num_vars)),
    ])
    constraints = [LinearConstraint(sp.csr_array(np.array(rows)), lo, hi), LinearConstraint(product, -np.inf, 0.0)]
    cost = np.zeros(num_vars)
    cost[w_id] = -np.stack(per_layer)[..., None]  # [L, R, E, 1] broadcast over d
    lower = np.zeros(num_vars)
    lower[x_id[0, 0]] = 1.0
    integrality = np.r_[np.ones(nx + ny, dtype=np.int8), np.zeros(nw, dtype=np.int8)]
    result = solve_milp(cost, constraints, integrality, Bounds(lower, np.ones(num_vars)), time_limit=time_limit,
                        mip_rel_gap=1e-9, what="dp_bound exact MILP")
    return -result.objective, np.argmax(result.x[:nx].reshape(num_requests, num_devices), axis=1)


def local_per_layer(per_layer: list[np.ndarray], present: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """float[L] local activations of an assignment rank int[R] on replica map present bool[L, E, D]."""
    return np.array([(counts * present[layer][:, rank].T).sum() for layer, counts in enumerate(per_layer)])


class DPBoundPlan(FitAssignPlan):
    """Replays the witness's request ranks on the evaluated trace (refuses another one)."""

    system_name = "dp_bound"


class DPBound:
    """The Attention-DP LAR ceiling with a hindsight-feasible witness (see the module docstring).

    fits_on_evaluation = True: the app calls fit(eval_trace, ...); the bound is about the evaluated routing.
    """

    name = "dp_bound"
    kind = "bound"
    fits_on_evaluation = True
    bound_constraint = (
        "Attention-DP LAR ceiling: any request assignment with at most ceil(R/D) requests per rank and any placement "
        "with P/D expert slots per device per layer (P = E + num_redundant); LP relaxation, per layer. It bounds "
        "the LAR only under that request-count balance (token-balanced schedulers, e.g. semmoe's time scheduler, may "
        "exceed it), and its time_estimate_s is the request-count-balanced witness's, not a bound on time."
    )

    def __init__(self, bases: list[str] | tuple[str, ...] = ("semmoe", "ep"), rounds: int = 5, num_redundant: int = 0):
        if rounds < 1:
            raise ConfigError(f"system.params.rounds must be >= 1, got {rounds}.")
        if not bases:
            raise ConfigError("system.params.bases must name at least one placement system for the witness.")
        if num_redundant < 0:
            raise ConfigError(f"system.params.num_redundant must be >= 0, got {num_redundant}.")
        self.bases, self.rounds, self.num_redundant = tuple(bases), int(rounds), int(num_redundant)

    def fit(self, evaluation: RoutingTrace, parallel: ParallelConfig, rng: np.random.Generator) -> Plan:
        if parallel.attention != "dp":
            raise ConfigError(
                "dp_bound bounds Attention-DP only (a request on one rank for all layers); use system=token_oracle "
                "for the Attention-TP ceiling or set parallel.attention=dp."
            )
        num_devices, num_experts = parallel.devices, evaluation.meta.num_experts
        parallel.check_experts(num_experts)
        num_slots = num_experts + self.num_redundant
        if num_slots % num_devices:
            raise ConfigError(
                f"{num_experts} experts + system.params.num_redundant={self.num_redundant} slots do not split over "
                f"{num_devices} devices; choose num_redundant so that the slot count is a multiple of D."
            )
        if evaluation.num_requests < num_devices:
            raise ConfigError(
                f"the evaluation trace has {evaluation.num_requests} requests for {num_devices} DP ranks; need at "
                "least one per rank."
            )
        start = time.perf_counter()
        _, per_layer = request_device_scores(evaluation, np.ones((evaluation.num_layers, num_experts, 1), dtype=bool))
        bound = dp_lar_bound(per_layer, num_devices, num_slots)
        node_bound = None
        if parallel.num_nodes > 1:  # the same systems seen by node: at most G x ceil(R/D) requests, P / nodes slots
            most_per_node = parallel.devices_per_node * -(-evaluation.num_requests // num_devices)
            node_bound = dp_lar_bound(per_layer, parallel.num_nodes, num_slots, most_per_node)
        bound_seconds = time.perf_counter() - start
        best = None
        for base in self.bases:
            placement = make_base(base, {}).fit(evaluation, parallel, rng).placement
            if placement.num_slots > num_slots:
                raise ConfigError(
                    f"witness base {base!r} places {placement.num_slots} slots per layer, more than the bound's "
                    f"{num_slots}; raise system.params.num_redundant or choose bases without replicas."
                )
            rank, placement, _, _ = fit_request_assignment(evaluation, placement, self.rounds, token_balance=None)
            local = local_per_layer(per_layer, placement.replicas() > 0, rank)
            if best is None or local.sum() > best[0].sum():
                best = (local, rank, placement, base)
        local, rank, placement, base = best
        total = np.array([counts.sum() for counts in per_layer])
        info = {
            "lar_bound": float(bound.sum() / max(total.sum(), 1)),
            "lar_bound_per_layer": (bound / np.maximum(total, 1)).tolist(),
            "lar_feasible": float(local.sum() / max(total.sum(), 1)),
            "lar_feasible_per_layer": (local / np.maximum(total, 1)).tolist(),
            "bound_max_requests_per_rank": int(-(-evaluation.num_requests // num_devices)),
            "bound_slots_per_device": num_slots // num_devices,
            "witness_base": base,
            # the evaluator's time estimate of this plan is the witness's (request-count balanced), not a time bound
            "time_estimate_of": "witness",
            "bound_seconds": bound_seconds,
        }
        info["bound_gap"] = info["lar_bound"] - info["lar_feasible"]
        if node_bound is not None:
            info["node_local_bound"] = float(node_bound.sum() / max(total.sum(), 1))
        if info["bound_gap"] < -1e-9:
            raise ReproError(f"dp_bound: the witness ({info['lar_feasible']:.6f}) beats the bound "
                             f"({info['lar_bound']:.6f}); the relaxation is wrong.")
        return DPBoundPlan(
            placement, parallel, info, "exact", rank, np.asarray(evaluation.offsets), np.asarray(evaluation.token_ids)
        )


__all__ = ["DPBound", "dp_exact_milp", "dp_lar_bound", "layer_bound", "local_per_layer"]
