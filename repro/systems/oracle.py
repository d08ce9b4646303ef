"""The Attention-TP token oracle and the exact transportation solver the hindsight systems share.

token_oracle (Attention-TP, kind "bound"): the placement of a base system fitted on the profile
    (`base: semmoe | ep | ...`); at every step and layer each token goes to the device holding most of its k
    experts, knowing the layer's true routing (the evaluator passes `current_experts` because the plan sets
    `uses_true_routing = True`), then slices are equalised as reduce-scatter needs by an exact max-weight
    transportation (`align: exact`) or a regret-ordered greedy (`align: greedy`). With `align: exact` it is the
    LAR ceiling of every Attention-TP token scheduler on that placement (equal slices up to one token, any
    token-to-rank choice per layer). plan.info reports the aligned LAR (= `lar_bound` with exact alignment) and
    the unaligned ceiling (every token on its best device, slices ignored). A DP request lives on one rank, so
    in DP mode it raises ConfigError (use dp_bound).

Exact alignment. Scores are small integers (0..k experts on each device), so tokens with identical score rows
are interchangeable: the transportation problem is solved over the distinct rows (at most C(k+D-1, D-1)
without replicas, a few hundred in practice) with integer supplies, as an LP by HiGHS dual simplex. The
constraint matrix is a transportation matrix (totally unimodular) and the right-hand sides are integers, so the
simplex vertex is integral: the LP is exact. `max_weight_transport_milp` (the former path: the same problem as a
HiGHS MILP, ~25x slower) is kept as the reference the tests and bench/bench_oracle.py compare with.

Legend: T tokens in a step, k experts per token, D devices, E experts per layer, n item types of a
transportation problem.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, linprog

from repro.errors import ConfigError, ReproError
from repro.parallel import ParallelConfig
from repro.systems.base import Placement, Plan, even_counts
from repro.systems.milp import solve_milp
from repro.traces import RoutingTrace

ALIGN_MODES = ("exact", "greedy")


def _transport_matrix(num_types: int, num_bins: int) -> sp.csr_array:
    """The (n + D) x (n·D) transportation matrix: one row per item type (its variables x[i, ·]), then one per bin."""
    num_vars = num_types * num_bins
    type_idx, bin_idx = np.divmod(np.arange(num_vars), num_bins)
    return sp.csr_array(
        (np.ones(2 * num_vars), (np.concatenate([type_idx, num_types + bin_idx]), np.tile(np.arange(num_vars), 2))),
        shape=(num_types + num_bins, num_vars),
    )


def max_weight_transport(
    score: np.ndarray, lower: np.ndarray, upper: np.ndarray, multiplicity: np.ndarray | None = None, *, what: str
) -> np.ndarray:
    """Exact max-weight assignment of n item types to D bins with bin-size bounds.

    score float[n, D]; lower/upper int[D] bounds on items per bin; multiplicity int[n] items of each type
    (default 1). Returns int[n, D] items of type i put in bin d. Solved as an LP (HiGHS dual simplex): the
    constraint matrix is a transportation matrix (totally unimodular) with integer right-hand sides, so the
    simplex vertex is integral; the answer is checked and a non-integral one (never seen) falls back to
    `max_weight_transport_milp`.
    """
    num_types, num_bins = score.shape
    multiplicity = np.ones(num_types) if multiplicity is None else np.asarray(multiplicity, dtype=np.float64)
    lower, upper = np.asarray(lower, dtype=np.float64), np.asarray(upper, dtype=np.float64)
    matrix = _transport_matrix(num_types, num_bins)
    per_type, per_bin = matrix[:num_types], matrix[num_types:]
    scale = max(float(np.abs(score).max(initial=0.0)), 1.0)
    cost = -(np.asarray(score, dtype=np.float64) / scale).ravel()
    # presolve off: on these small dense transportation LPs HiGHS's presolve costs more than the solve (measured
    # 0.34 s vs 0.8 s, and 14 s with equality rows, per 26-layer step of 2,048 tokens at EP 8)
    options = {"presolve": False}
    if np.array_equal(lower, upper):
        lp = linprog(cost, A_eq=matrix, b_eq=np.concatenate([multiplicity, upper]), bounds=(0.0, None),
                     method="highs-ds", options=options)
    else:
        lp = linprog(cost, A_ub=sp.vstack([per_bin, -per_bin]), b_ub=np.concatenate([upper, -lower]), A_eq=per_type,
                     b_eq=multiplicity, bounds=(0.0, None), method="highs-ds", options=options)
    if lp.status != 0:
        raise ReproError(
            f"{what}: the transportation LP failed ({lp.message}); bin bounds {lower.tolist()}..{upper.tolist()} "
            f"must admit {multiplicity.sum():g} items."
        )
    x = np.rint(lp.x)
    if np.abs(lp.x - x).max(initial=0.0) > 1e-6:
        return max_weight_transport_milp(score, lower, upper, multiplicity, what=what)
    return x.astype(np.int64).reshape(num_types, num_bins)


def max_weight_transport_milp(
    score: np.ndarray, lower: np.ndarray, upper: np.ndarray, multiplicity: np.ndarray | None = None, *, what: str
) -> np.ndarray:
    """Reference for `max_weight_transport` (same arguments and result): the problem as a HiGHS MILP with
    integrality declared. Exact but ~25x slower at token-oracle sizes; kept for tests and the benchmark."""
    num_types, num_bins = score.shape
    multiplicity = np.ones(num_types) if multiplicity is None else np.asarray(multiplicity, dtype=np.float64)
    num_vars = num_types * num_bins
    lo = np.concatenate([multiplicity, lower])
    hi = np.concatenate([multiplicity, upper])
    scale = max(float(np.abs(score).max(initial=0.0)), 1.0)
    result = solve_milp(
        -(np.asarray(score, dtype=np.float64) / scale).ravel(),
        [LinearConstraint(_transport_matrix(num_types, num_bins), lo, hi)],
        np.ones(num_vars, dtype=np.int8),
        Bounds(np.zeros(num_vars), np.repeat(multiplicity, num_bins)),
        time_limit=60.0,
        mip_rel_gap=1e-9,
        what=what,
    )
    return np.rint(result.x).astype(np.int64).reshape(num_types, num_bins)


def local_scores(experts: np.ndarray, present: np.ndarray) -> np.ndarray:
    """int[T, D] how many of each token's k experts have a replica on device d.

    experts int[T, k] one layer's true routing; present bool[E, D] replica map of that layer.
    """
    return present[np.asarray(experts, dtype=np.int64)].sum(axis=1)


def align_greedy(score: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """int[T] device per token with exactly capacity[d] tokens on d, greedily keeping high scores.

    score int[T, D]; capacity int[D] summing to T. Each round every unplaced token proposes its best device
    with room left; a device accepts the proposers with the largest regret (best − second best), then score,
    then lowest index. At most D rounds (each round fills a device or places everybody).
    """
    num_tokens, num_devices = score.shape
    device = np.full(num_tokens, -1, dtype=np.int64)
    remaining = capacity.astype(np.int64).copy()
    for _ in range(num_devices):
        open_tokens = np.flatnonzero(device < 0)
        if not len(open_tokens):
            break
        s = np.where(remaining[None, :] > 0, score[open_tokens], -np.inf).astype(np.float64)
        order = np.argsort(-s, axis=1, kind="stable")
        choice = order[:, 0]
        best = s[np.arange(len(open_tokens)), choice]
        second = s[np.arange(len(open_tokens)), order[:, 1]] if num_devices > 1 else best
        regret = np.where(np.isfinite(second), best - second, np.inf)
        rank_key = np.lexsort((open_tokens, -best, -regret, choice))  # group by device, best first
        sorted_choice = choice[rank_key]
        group_start = np.searchsorted(sorted_choice, sorted_choice, side="left")
        position = np.arange(len(rank_key)) - group_start
        accepted = rank_key[position < remaining[sorted_choice]]
        device[open_tokens[accepted]] = choice[accepted]
        remaining -= np.bincount(choice[accepted], minlength=num_devices)
    return device


def align_exact(score: np.ndarray, lower: np.ndarray, upper: np.ndarray, *, reference: bool = False) -> np.ndarray:
    """int[T] device per token maximising Σ score[t, device[t]] with lower[d] ≤ tokens on d ≤ upper[d].

    score int[T, D]. Tokens with identical score rows are interchangeable, so the transportation problem is
    solved over the distinct rows (usually a few hundred) and expanded back: the LP (`max_weight_transport`), or
    with reference=True the former MILP path (`max_weight_transport_milp`), for tests and benchmarks. When every
    token's best device already fits the bounds, that is the answer and no solver runs.
    """
    num_tokens, num_devices = score.shape
    best = np.argmax(score, axis=1)
    load = np.bincount(best, minlength=num_devices)
    if not reference and np.all(load >= lower) and np.all(load <= upper):
        return best
    rows, inverse, counts = np.unique(score, axis=0, return_inverse=True, return_counts=True)
    transport = max_weight_transport_milp if reference else max_weight_transport
    per_type = transport(rows.astype(np.float64), lower, upper, counts, what="token-oracle align")
    # expand: tokens of type i (in index order) take bins in order, per_type[i, d] of them for bin d
    order = np.argsort(inverse.ravel(), kind="stable")
    device_sorted = np.repeat(np.tile(np.arange(num_devices), len(rows)), per_type.ravel())
    device = np.empty(num_tokens, dtype=np.int64)
    device[order] = device_sorted
    return device


def make_base(base: str, base_params: dict | None):
    from repro.systems import make_system  # late import: the registry imports this module lazily

    if base in ("token_oracle", "fit_assign", "dp_bound"):
        raise ConfigError(f"oracle base system {base!r} would recurse; choose a placement system (semmoe, ep, ...).")
    return make_system(base, **(base_params or {}))


class TokenOraclePlan(Plan):
    """Same placement as the base plan; TP tokens placed with the true routing of the current layer."""

    uses_true_routing = True
    reports_bound = True  # with exact alignment, plan.info's lar_bound is the Attention-TP ceiling

    def __init__(self, placement: Placement, parallel: ParallelConfig, info: dict | None = None, align: str = "exact"):
        self.align = align
        self._present = placement.replicas() > 0  # [L, E, D]
        super().__init__(placement, parallel, info)

    def reset(self) -> None:
        super().reset()
        self._local_aligned = np.zeros(self.placement.num_layers, dtype=np.int64)
        self._local_unaligned = 0
        self._activations = np.zeros(self.placement.num_layers, dtype=np.int64)

    def shuffle_tokens(self, token_ids, layer, prev_experts, current_experts=None):
        if current_experts is None:
            raise ReproError(
                f"{type(self).__name__}.shuffle_tokens needs current_experts (the layer's true routing); the "
                "evaluator passes it for plans with uses_true_routing = True."
            )
        num_tokens, num_devices = len(token_ids), self.parallel.devices
        score = local_scores(current_experts, self._present[layer])  # [T, D]
        if self.align == "exact":
            floor = num_tokens // num_devices
            ceil = floor + (num_tokens % num_devices > 0)
            device = align_exact(score, np.full(num_devices, floor), np.full(num_devices, ceil))
        else:
            device = align_greedy(score, even_counts(num_tokens, num_devices))
        self._local_aligned[layer] += int(score[np.arange(num_tokens), device].sum())
        self._local_unaligned += int(score.max(axis=1).sum())
        self._activations[layer] += int(np.asarray(current_experts).size)
        total = max(int(self._activations.sum()), 1)
        self.info["oracle_lar_aligned"] = int(self._local_aligned.sum()) / total
        self.info["oracle_lar_unaligned"] = self._local_unaligned / total
        if self.reports_bound and self.align == "exact":  # the ceiling, filled in as the evaluator walks the steps
            self.info["lar_bound"] = self.info["oracle_lar_aligned"]
            self.info["lar_bound_per_layer"] = (self._local_aligned / np.maximum(self._activations, 1)).tolist()
        permutation = np.argsort(device, kind="stable")
        return permutation, np.bincount(device, minlength=num_devices)


class TokenOracle:
    """The Attention-TP ceiling on a base system's placement (see the module docstring).

    With align: greedy it is no ceiling, so the instance's kind becomes "hindsight" and no lar_bound is reported.
    """

    name = "token_oracle"
    kind = "bound"
    bound_constraint = (
        "Attention-TP LAR ceiling on the base system's placement: any per-layer token-to-rank choice with slices "
        "equal up to one token per step (reduce-scatter), knowing the layer's true routing; exact transportation "
        "per step and layer."
    )

    def __init__(self, base: str = "semmoe", base_params: dict | None = None, align: str = "exact"):
        if align not in ALIGN_MODES:
            raise ConfigError(f"system.params.align must be one of {ALIGN_MODES}, got {align!r}.")
        self.base, self.base_params, self.align = base, dict(base_params or {}), align
        if align != "exact":
            self.kind = "hindsight"

    def fit(self, profile: RoutingTrace, parallel: ParallelConfig, rng: np.random.Generator) -> Plan:
        if parallel.attention != "tp":
            raise ConfigError(
                "token_oracle bounds Attention-TP only (a DP request lives on one rank); use system=dp_bound "
                "for the Attention-DP ceiling or set parallel.attention=tp."
            )
        base_plan = make_base(self.base, self.base_params).fit(profile, parallel, rng)
        info = {"base": self.base, "align": self.align}
        info.update({f"base_{k}": v for k, v in base_plan.info.items() if np.isscalar(v)})
        return TokenOraclePlan(base_plan.placement, parallel, info, self.align)


