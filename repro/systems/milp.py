"""Exact MILPs on HiGHS: shared solver helpers, the co-clustering MILP and the `semmoe_exact` system.

The paper's co-clustering objective (§2.2, per MoE layer) is

    L = θ · Σ_i | Σ_j R_ij a_j − S/D |  +  (1−θ) · Σ_j a_j Σ_k C_p[j,k] · [cluster(k) ≠ cluster(j)]

with R_ij = 1 when token j is in cluster i, C_ik = 1 when expert k is in cluster i, exactly N/D experts per
cluster and S = Σ_j a_j. The paper solves it with a heuristic (repro.systems.semmoe); this module solves small
instances exactly so the heuristic's optimality gap can be measured.

Linearisation. Write w_jk = a_j C_p[j,k]. The remote term is Σ_jk w_jk − Σ_jk w_jk Σ_i R_ij C_ik.
"product": for every pair (j,k) with w_jk > 0 and every cluster i a continuous z_ijk ∈ [0,1] with
z_ijk ≤ R_ij and z_ijk ≤ C_ik stands for R_ij C_ik (the objective rewards large z, so these upper bounds are
the whole standard linearisation), plus the cut Σ_k w_jk z_ijk ≤ W_j R_ij (W_j = sum of token j's N/D largest
weights). "local" (default, smaller and measured faster): one continuous u_ij ∈ [0, W_j] per token and
cluster with u_ij ≤ Σ_k w_jk C_ik and u_ij ≤ W_j R_ij, maximising Σ u_ij. Each absolute value gets a slack dev_i ≥ ±(Σ_j R_ij a_j − S/D).
Symmetry breaking: clusters are interchangeable, so we label them by their smallest expert: expert k may only
sit in clusters 0..k (expert 0 is fixed to cluster 0, expert 1 to cluster 0 or 1, ...). This removes all D!
relabellings without cutting off any partition.

Legend: t distinct profiled tokens, N experts per layer, D devices (= clusters), V solver variables,
M constraint rows, L MoE layers, E experts per layer (= N), k experts per token.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, milp

from repro.affinity.tables import layer_token_expert_counts
from repro.errors import ConfigError, SolverError
from repro.parallel import ParallelConfig
from repro.systems.semmoe import SemMoE, SemMoEPlan
from repro.traces import RoutingTrace


class SolverNodeLimitWarning(UserWarning):
    """A MILP used up its node budget; the plan uses the best feasible answer and says so in plan.info."""


@dataclass(frozen=True)
class MilpResult:
    """Best feasible point of a HiGHS solve.

    x float[V]; objective includes the constant offset; status "optimal" (proved within mip_rel_gap) or
    "node_limit" (best feasible answer when the node budget ran out: the same on every machine); gap = (objective −
    dual bound) / |objective| (0 when the objective is 0 and proved); seconds = wall time of the solve.
    """

    x: np.ndarray
    objective: float
    status: str
    gap: float
    seconds: float


def solve_milp(
    cost: np.ndarray,
    constraints: list[LinearConstraint],
    integrality: np.ndarray,
    bounds: Bounds,
    *,
    time_limit: float,
    mip_rel_gap: float,
    what: str,
    node_limit: int | None = None,
    objective_offset: float = 0.0,
) -> MilpResult:
    """Minimise cost @ x + objective_offset with scipy.optimize.milp (HiGHS).

    cost float[V]; integrality int[V] (1 = integer); `what` names the problem in messages.
    node_limit (branch-and-bound nodes) is the budget that may cut a solve short: where it runs out, the best
    feasible answer is returned with status "node_limit" and its gap, warned (SolverNodeLimitWarning). It stops at
    the same point on every machine (measured: the same answer twice at 20 and at 200 nodes). time_limit
    (seconds) is only a safety net: an answer cut short by the wall clock depends on the machine's speed and load,
    so reaching it raises SolverError, as does no feasible point at all. Never returns a partial answer silently.
    """
    if not time_limit > 0:
        raise ConfigError(f"{what}: time_limit must be > 0 seconds, got {time_limit}.")
    if not mip_rel_gap >= 0:
        raise ConfigError(f"{what}: mip_rel_gap must be >= 0, got {mip_rel_gap}.")
    if node_limit is not None and not (isinstance(node_limit, int | np.integer) and node_limit >= 1):
        raise ConfigError(f"{what}: node_limit must be an integer >= 1 or null, got {node_limit!r}.")
    options = {"time_limit": float(time_limit), "mip_rel_gap": float(mip_rel_gap), "disp": False}
    if node_limit is not None:
        options["node_limit"] = int(node_limit)
    start = time.perf_counter()
    res = milp(cost, constraints=constraints, integrality=integrality, bounds=bounds, options=options)
    seconds = time.perf_counter() - start
    timed_out = "time limit" in res.message.lower()
    if res.x is None:
        reason = "hit its time limit before finding any feasible answer" if timed_out else res.message
        raise SolverError(
            f"{what}: HiGHS found no feasible solution ({reason}); raise time_limit or shrink the instance."
        )
    objective = float(res.fun) + objective_offset
    bound = getattr(res, "mip_dual_bound", None)
    bound = float(res.fun) if bound is None or not np.isfinite(bound) else float(bound)
    gap = max(0.0, float(res.fun) - bound) / max(abs(objective), 1e-12)
    if res.status == 0:
        return MilpResult(res.x, objective, "optimal", gap, seconds)
    if timed_out:
        raise SolverError(
            f"{what}: HiGHS reached the {time_limit:g} s time limit before a proved optimum (best so far: objective "
            f"{objective:.6g}, relative gap {gap:.2%}); an answer cut short by the wall clock depends on the "
            "machine's speed, so none is used: raise time_limit, or set a lower node_limit (a budget that stops at "
            "the same answer on every machine)."
        )
    if node_limit is None:
        raise SolverError(f"{what}: HiGHS stopped without a proved optimum ({res.message}); no answer is used.")
    warnings.warn(
        f"{what}: HiGHS used its budget of {node_limit} nodes ({res.message}); using the best feasible answer "
        f"(objective {objective:.6g}, relative gap {gap:.2%}); raise node_limit for a proved optimum.",
        SolverNodeLimitWarning,
        stacklevel=2,
    )
    return MilpResult(res.x, objective, "node_limit", gap, seconds)


def merge_status(results: list[MilpResult] | list[CoclusterSolution]) -> dict:
    """plan.info entries for a sequence of solves (anything with status, gap, seconds, objective): worst status, max gap, total seconds, summed objective."""
    return {
        "solver_status": "node_limit" if any(r.status == "node_limit" for r in results) else "optimal",
        "solver_gap": max((r.gap for r in results), default=0.0),
        "solver_seconds": float(sum(r.seconds for r in results)),
        "solver_objective": float(sum(r.objective for r in results)),
        "solver_node_limited_solves": int(sum(r.status == "node_limit" for r in results)),
    }


@dataclass(frozen=True)
class CoclusterSolution:
    """token_cluster int[t], expert_cluster int[N]; objective = the paper's L; status/gap/seconds as MilpResult."""

    token_cluster: np.ndarray
    expert_cluster: np.ndarray
    objective: float
    status: str
    gap: float
    seconds: float


def coclustering_num_variables(num_tokens: int, num_experts: int, num_devices: int) -> int:
    """V of the default ("local") co-clustering MILP: R (t·D) + C (N·D) + dev (D) + u (t·D)."""
    return (2 * num_tokens + num_experts + 1) * num_devices


def solve_coclustering_milp(
    confidence: np.ndarray,
    frequency: np.ndarray,
    num_devices: int,
    theta: float,
    time_limit: float = 60,
    mip_rel_gap: float = 1e-4,
    formulation: str = "local",
    node_limit: int | None = None,
) -> CoclusterSolution:
    """Exact balanced token–expert co-clustering of one layer (the paper's L, see the module docstring).

    confidence float[t, N] = C_p (Pr(expert | token); rows need not sum to 1); frequency float[t] = a_j;
    num_devices D divides N. Returns the optimal (or, where node_limit runs out, best feasible) clusters; the limits
    are solve_milp's.
    formulation "local" (default): one continuous u_ij per token and cluster bounded by the cluster's local
    weight and by W_j R_ij; "product": the pairwise product linearisation z_ijk (module docstring) plus the
    W_j cut. Both are exact; "local" is smaller.
    """
    if formulation not in ("local", "product"):
        raise ConfigError(f"formulation must be 'local' or 'product', got {formulation!r}.")
    confidence = np.asarray(confidence, dtype=np.float64)
    frequency = np.asarray(frequency, dtype=np.float64)
    _check_coclustering_instance(confidence, frequency, num_devices, theta)
    num_tokens, num_experts = confidence.shape
    D = num_devices
    # variable blocks: R[j, i] | C[k, i] | dev[i] | z[p, i] for the nonzero pairs p = (j_p, k_p), or u[j, i]
    pair_token, pair_expert = np.nonzero(confidence > 0)
    pair_weight = frequency[pair_token] * confidence[pair_token, pair_expert]  # w_p, float[nnz]
    num_pairs = len(pair_token)
    r0, c0 = 0, num_tokens * D
    d0 = c0 + num_experts * D
    z0 = d0 + D
    num_vars = z0 + (num_pairs if formulation == "product" else num_tokens) * D
    cluster = np.arange(D)

    cost = np.zeros(num_vars)
    cost[d0:z0] = theta
    # maximise local weight: z per pair weighted by w_p ("product"), or u per token already in weight units
    cost[z0:] = -(1 - theta) * (np.repeat(pair_weight, D) if formulation == "product" else 1.0)
    offset = (1 - theta) * float(pair_weight.sum())

    rows = []  # (row indices, column indices, values, lower, upper) blocks of the constraint matrix

    def block(row_idx, col_idx, vals, lo, hi):
        rows.append((np.asarray(row_idx), np.asarray(col_idx), np.asarray(vals, dtype=np.float64),
                     np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)))

    n_row = 0
    # each token in exactly one cluster: Σ_i R[j, i] = 1
    block(n_row + np.repeat(np.arange(num_tokens), D), r0 + np.arange(num_tokens * D), np.ones(num_tokens * D),
          np.ones(num_tokens), np.ones(num_tokens))
    n_row += num_tokens
    # each expert in exactly one cluster: Σ_i C[k, i] = 1
    block(n_row + np.repeat(np.arange(num_experts), D), c0 + np.arange(num_experts * D), np.ones(num_experts * D),
          np.ones(num_experts), np.ones(num_experts))
    n_row += num_experts
    # exactly N/D experts per cluster: Σ_k C[k, i] = N/D
    size = num_experts // D
    block(n_row + np.tile(cluster, num_experts), c0 + np.arange(num_experts * D), np.ones(num_experts * D),
          np.full(D, size), np.full(D, size))
    n_row += D
    # dev_i ≥ ±(load_i − S/D): dev_i − load_i ≥ −S/D and dev_i + load_i ≥ S/D
    share = frequency.sum() / D
    for sign in (-1.0, 1.0):
        block(np.concatenate([n_row + cluster, n_row + np.tile(cluster, num_tokens)]),
              np.concatenate([d0 + cluster, r0 + np.arange(num_tokens * D)]),
              np.concatenate([np.ones(D), sign * np.repeat(frequency, D)]),
              np.full(D, sign * share), np.full(D, np.inf))
        n_row += D
    weight_table = np.zeros((num_tokens, num_experts))
    weight_table[pair_token, pair_expert] = pair_weight
    # W_j: a cluster holds N/D experts, so token j's local weight is at most its N/D largest weights
    top_weight = -np.sort(-weight_table, axis=1)[:, :size].sum(axis=1)  # float[t]
    if formulation == "product":
        # z[p, i] ≤ R[j_p, i] and z[p, i] ≤ C[k_p, i]
        z_cols = z0 + np.arange(num_pairs * D)
        for other in (r0 + np.repeat(pair_token, D) * D + np.tile(cluster, num_pairs),
                      c0 + np.repeat(pair_expert, D) * D + np.tile(cluster, num_pairs)):
            n = num_pairs * D
            block(np.concatenate([n_row + np.arange(n)] * 2), np.concatenate([z_cols, other]),
                  np.concatenate([np.ones(n), -np.ones(n)]), np.full(n, -np.inf), np.zeros(n))
            n_row += n
        # valid cut that tightens the LP relaxation: Σ_k w_jk z[(j,k), i] ≤ W_j R[j, i]
        n = num_tokens * D
        block(np.concatenate([n_row + np.repeat(pair_token, D) * D + np.tile(cluster, num_pairs), n_row + np.arange(n)]),
              np.concatenate([z_cols, r0 + np.arange(n)]),
              np.concatenate([np.repeat(pair_weight, D), -np.repeat(top_weight, D)]),
              np.full(n, -np.inf), np.zeros(n))
        n_row += n
    else:
        # u[j, i] ≤ Σ_k w_jk C[k, i] (local weight if j sits in i) and u[j, i] ≤ W_j R[j, i] (only where j sits)
        n = num_tokens * D
        u_cols = z0 + np.arange(n)
        block(np.concatenate([n_row + np.arange(n), n_row + np.repeat(pair_token, D) * D + np.tile(cluster, num_pairs)]),
              np.concatenate([u_cols, c0 + np.repeat(pair_expert, D) * D + np.tile(cluster, num_pairs)]),
              np.concatenate([np.ones(n), -np.repeat(pair_weight, D)]), np.full(n, -np.inf), np.zeros(n))
        n_row += n
        block(np.concatenate([n_row + np.arange(n)] * 2), np.concatenate([u_cols, r0 + np.arange(n)]),
              np.concatenate([np.ones(n), -np.repeat(top_weight, D)]), np.full(n, -np.inf), np.zeros(n))
        n_row += n

    matrix = sp.csr_array(
        (np.concatenate([b[2] for b in rows]), (np.concatenate([b[0] for b in rows]), np.concatenate([b[1] for b in rows]))),
        shape=(n_row, num_vars),
    )
    lower = np.concatenate([b[3] for b in rows])
    upper = np.concatenate([b[4] for b in rows])

    integrality = np.zeros(num_vars, dtype=np.int8)
    integrality[:d0] = 1
    ub = np.ones(num_vars)
    ub[d0:z0] = np.inf
    if formulation == "local":
        ub[z0:] = np.repeat(top_weight, D)  # u is in weight units, not a 0/1 product
    # symmetry breaking: expert k only in clusters 0..k (clusters labelled by their smallest expert)
    expert_upper = ub[c0:d0].reshape(num_experts, D)
    expert_upper[cluster[None, :] > np.arange(num_experts)[:, None]] = 0.0
    result = solve_milp(
        cost,
        [LinearConstraint(matrix, lower, upper)],
        integrality,
        Bounds(np.zeros(num_vars), ub),
        time_limit=time_limit,
        mip_rel_gap=mip_rel_gap,
        node_limit=node_limit,
        what=f"co-clustering MILP (t={num_tokens} tokens, N={num_experts} experts, D={D})",
        objective_offset=offset,
    )
    token_cluster = np.argmax(result.x[r0:c0].reshape(num_tokens, D), axis=1)
    expert_cluster = np.argmax(result.x[c0:d0].reshape(num_experts, D), axis=1)
    return CoclusterSolution(token_cluster, expert_cluster, result.objective, result.status, result.gap, result.seconds)


def _check_coclustering_instance(confidence, frequency, num_devices, theta) -> None:
    if confidence.ndim != 2 or confidence.shape[0] < 1 or confidence.shape[1] < 1:
        raise ConfigError(f"confidence must be a non-empty 2-D [tokens, experts] table, got shape {confidence.shape}.")
    num_tokens, num_experts = confidence.shape
    if frequency.shape != (num_tokens,):
        raise ConfigError(f"frequency has shape {frequency.shape}; confidence says ({num_tokens},) one per token.")
    if not (np.all(np.isfinite(confidence)) and np.all(confidence >= 0)):
        raise ConfigError("confidence has negative or non-finite entries; it must hold probabilities >= 0.")
    if not (np.all(np.isfinite(frequency)) and np.all(frequency >= 0)):
        raise ConfigError("frequency has negative or non-finite entries; it must hold token counts >= 0.")
    if num_devices < 1 or num_devices > num_experts:
        raise ConfigError(
            f"num_devices={num_devices} must be between 1 and the {num_experts} experts per layer; use fewer devices."
        )
    if num_experts % num_devices:
        raise ConfigError(f"num_devices={num_devices} does not divide the {num_experts} experts; choose a divisor.")
    if not 0.0 < theta < 1.0:
        raise ConfigError(f"theta must be in (0, 1), got {theta}.")


# ----------------------------------------------------------------------------------------------- the system


def frequent_token_rows(profile: RoutingTrace, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(token_rank int64[N] row of each profile token among the `max_tokens` most frequent ids, -1 outside them;
    frequency float[t] occurrences a_j of those ids, rows ordered by descending frequency, ties by id)."""
    vocab, inverse, occurrences = np.unique(np.asarray(profile.token_ids), return_inverse=True, return_counts=True)
    keep = np.lexsort((vocab, -occurrences))[:max_tokens]  # most frequent first
    rank_of = np.full(len(vocab), -1, dtype=np.int64)
    rank_of[keep] = np.arange(len(keep))
    return rank_of[inverse.ravel()], occurrences[keep].astype(np.float64)


def layer_token_table(profile: RoutingTrace, layer: int, token_rank: np.ndarray, frequency: np.ndarray) -> np.ndarray:
    """float[t, E] confidence C_p = activations / (k · occurrences) of the rows of `frequent_token_rows` in one
    MoE layer (rows sum to 1)."""
    mask = token_rank >= 0
    experts = np.asarray(profile.experts[:, layer, :], dtype=np.int64)[mask]  # [n_kept, k]
    counts = layer_token_expert_counts(token_rank[mask], experts, len(frequency), profile.meta.num_experts)
    return counts / (profile.meta.top_k * frequency[:, None])


# Sem-MoE parameters that shape the online plan; semmoe_exact passes them on to SemMoE.plan_for_placement
ONLINE_PARAMS = (
    "lookback", "dp_scoring", "dp_assign", "dp_token_price", "load_aware_lambda", "dp_window", "prompt_only",
    "embeddings_path",
)


class SemMoEExact:
    """Sem-MoE with the co-clustering solved exactly per layer (small instances only).

    Per MoE layer: the `max_tokens` most frequent profile token ids enter the MILP (their confidence rows and
    frequencies); the optimal expert clusters become the placement (exactly E/D experts per device). The online
    side is the Sem-MoE plan built on that placement (repro.systems.semmoe), so the only difference to
    `system=semmoe` is the offline solver. Raises ConfigError when a layer's MILP would exceed `max_variables`.
    """

    name = "semmoe_exact"

    def __init__(
        self,
        theta: float = 0.5,
        max_tokens: int = 24,
        max_variables: int = 20_000,
        time_limit: float = 600.0,
        mip_rel_gap: float = 1e-4,
        node_limit: int | None = 700,
        **semmoe_params,
    ):
        if max_tokens < 1:
            raise ConfigError(f"system.params.max_tokens must be >= 1, got {max_tokens}.")
        self.max_tokens = int(max_tokens)
        self.max_variables = int(max_variables)
        self.time_limit = float(time_limit)
        self.mip_rel_gap = float(mip_rel_gap)
        self.node_limit = node_limit
        unknown = set(semmoe_params) - set(ONLINE_PARAMS)
        if unknown:
            raise ConfigError(
                f"semmoe_exact does not know system.params {sorted(unknown)}; allowed: {sorted(ONLINE_PARAMS)} and its own."
            )
        # the online side (tables T/T_p, DP scores, Markov A/A_p) is Sem-MoE's own: built (and its params,
        # theta included, checked) by the same SemMoE object, so the only difference to system=semmoe is the
        # offline solver
        self.online = SemMoE(theta=theta, **semmoe_params)
        self.theta = self.online.theta

    def solve_layers(self, profile: RoutingTrace, parallel: ParallelConfig) -> tuple[np.ndarray, list[CoclusterSolution]]:
        """(expert_device int[L, E], one CoclusterSolution per layer)."""
        num_experts = profile.meta.num_experts
        parallel.check_experts(num_experts)
        token_rank, frequency = frequent_token_rows(profile, self.max_tokens)
        if len(frequency) == 0:
            raise ConfigError("the profile trace has no tokens; semmoe_exact needs profiled tokens in every MoE layer.")
        num_vars = coclustering_num_variables(len(frequency), num_experts, parallel.devices)
        if num_vars > self.max_variables:
            raise ConfigError(
                f"semmoe_exact: each MoE layer needs {num_vars} MILP variables (t={len(frequency)} tokens, "
                f"E={num_experts}, D={parallel.devices}), over the limit max_variables={self.max_variables}; "
                "lower system.params.max_tokens or use system=semmoe for instances this large."
            )
        solutions = [
            solve_coclustering_milp(
                layer_token_table(profile, layer, token_rank, frequency), frequency, parallel.devices, self.theta,
                self.time_limit, self.mip_rel_gap, node_limit=self.node_limit,
            )
            for layer in range(profile.num_layers)
        ]
        return np.stack([s.expert_cluster for s in solutions]), solutions

    def fit(self, profile: RoutingTrace, parallel: ParallelConfig, rng: np.random.Generator) -> SemMoEPlan:
        """Exact placement per layer, then Sem-MoE's online tables for it (SemMoE.plan_for_placement)."""
        expert_device, solutions = self.solve_layers(profile, parallel)
        info = merge_status(solutions) | {"max_tokens": self.max_tokens}
        return self.online.plan_for_placement(profile, parallel, expert_device, info)
