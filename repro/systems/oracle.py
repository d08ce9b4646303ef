"""Upper bounds reported beside every system: the token oracle (TP ceiling) and the fit oracle (DP ceiling).

token_oracle (Attention-TP): the placement of a base system fitted on the profile (`base: semmoe | ep | ...`);
    at every step and layer each token goes to the device holding most of its k experts, knowing the layer's
    true routing (the evaluator passes `current_experts` because the plan sets `uses_true_routing = True`), then
    slices are equalised as reduce-scatter needs by an exact max-weight transportation (`align: exact`,
    HiGHS) or a regret-ordered greedy (`align: greedy`). plan.info reports the aligned LAR and the unaligned
    ceiling (every token on its best device, slices ignored). It bounds Attention-TP only: a DP request lives
    on one rank, so in DP mode it raises ConfigError (use fit_oracle).

fit_oracle (Attention-DP, and TP): `fits_on_evaluation = True` tells the app to call
    `system.fit(eval_trace, parallel, rng)` — the placement and the request assignment are fitted on the
    evaluated routing itself. DP: request r on device d scores its activations of d's experts over all layers
    and tokens, and the requests are assigned to maximise the total score under a balance constraint:
    `token_balance` = b ≥ 1 (default 1.3, the DP balance target max/mean <= 1.3): every rank's token load (prompt + generated tokens of its requests)
    ≤ b × the mean load, request counts free (the token load is what attention and the MoE layers pay for and
    what token_imbalance_max_mean reports; a count constraint on top would make it a ceiling only for
    schedulers that also fix the counts, and lower it, never raise it). This
    generalised assignment is solved as its LP relaxation (HiGHS dual simplex, a vertex, so at most D requests
    are fractional) and the fractional requests are then placed by a tiny exact MILP over them alone, given the
    capacity left by the integral ones, minimising first the overflow past the cap (zero whenever some
    rounding fits given the integral requests, as in every evaluated run measured; otherwise a rank exceeds
    the bound by at most one request, and plan.info's oracle_token_imbalance_fit shows it),
    then the lost score. Deterministic; `oracle_lar_lp_bound` in plan.info is the LP value, a proven ceiling
    for the balanced assignment on the final placement. token_balance null or 0: the old request-count
    balance (R/D ± 1 per rank, exact max-weight transportation, token loads unconstrained). Then, when the
    placement has no replicas, the experts of each layer are re-placed exactly given the assignment (E/D per
    device), alternating for `rounds` rounds (a round keeps the previous assignment when the new one does not
    score higher on the new placement, so the objective never decreases). assign_requests then replays the
    fitted ranks in trace order and refuses a different trace. TP: the token oracle on the placement fitted on
    the evaluation trace.

Legend: T tokens in a step, k experts per token, D devices, E experts per layer, L MoE layers, R requests,
n items of a transportation problem, h layers of routing history.
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


def max_weight_transport(
    score: np.ndarray, lower: np.ndarray, upper: np.ndarray, multiplicity: np.ndarray | None = None, *, what: str
) -> np.ndarray:
    """Exact max-weight assignment of n item types to D bins with bin-size bounds.

    score float[n, D]; lower/upper int[D] bounds on items per bin; multiplicity int[n] items of each type
    (default 1). Returns int[n, D] items of type i put in bin d. The constraint matrix is a transportation
    matrix (totally unimodular), so HiGHS solves it at the root; integrality is declared anyway.
    """
    num_types, num_bins = score.shape
    multiplicity = np.ones(num_types) if multiplicity is None else np.asarray(multiplicity, dtype=np.float64)
    num_vars = num_types * num_bins
    type_idx, bin_idx = np.divmod(np.arange(num_vars), num_bins)
    matrix = sp.csr_array(
        (np.ones(2 * num_vars), (np.concatenate([type_idx, num_types + bin_idx]), np.tile(np.arange(num_vars), 2))),
        shape=(num_types + num_bins, num_vars),
    )
    lo = np.concatenate([multiplicity, lower])
    hi = np.concatenate([multiplicity, upper])
    scale = max(float(np.abs(score).max(initial=0.0)), 1.0)
    result = solve_milp(
        -(score / scale).ravel(),
        [LinearConstraint(matrix, lo, hi)],
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


def align_exact(score: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """int[T] device per token maximising Σ score[t, device[t]] with lower[d] ≤ tokens on d ≤ upper[d].

    score int[T, D]. Tokens with identical score rows are interchangeable, so the transportation problem is
    solved over the distinct rows (at most (k+1)^D, usually a few hundred) and expanded back.
    """
    rows, inverse, counts = np.unique(score, axis=0, return_inverse=True, return_counts=True)
    per_type = max_weight_transport(rows.astype(np.float64), lower, upper, counts, what="token-oracle align")
    # expand: tokens of type i (in index order) take bins in order, per_type[i, d] of them for bin d
    order = np.argsort(inverse.ravel(), kind="stable")
    device_sorted = np.repeat(np.tile(np.arange(score.shape[1]), len(rows)), per_type.ravel())
    device = np.empty(len(score), dtype=np.int64)
    device[order] = device_sorted
    return device


def _make_base(base: str, base_params: dict | None):
    from repro.systems import make_system  # late import: the registry imports this module lazily

    if base in ("token_oracle", "fit_oracle"):
        raise ConfigError(f"oracle base system {base!r} would recurse; choose a placement system (semmoe, ep, ...).")
    return make_system(base, **(base_params or {}))


class TokenOraclePlan(Plan):
    """Same placement as the base plan; TP tokens placed with the true routing of the current layer."""

    uses_true_routing = True

    def __init__(self, placement: Placement, parallel: ParallelConfig, info: dict | None = None, align: str = "exact"):
        self.align = align
        self._present = placement.replicas() > 0  # [L, E, D]
        super().__init__(placement, parallel, info)

    def reset(self) -> None:
        super().reset()
        self._local_aligned = 0
        self._local_unaligned = 0
        self._activations = 0

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
        self._local_aligned += int(score[np.arange(num_tokens), device].sum())
        self._local_unaligned += int(score.max(axis=1).sum())
        self._activations += int(np.asarray(current_experts).size)
        self.info["oracle_lar_aligned"] = self._local_aligned / max(self._activations, 1)
        self.info["oracle_lar_unaligned"] = self._local_unaligned / max(self._activations, 1)
        permutation = np.argsort(device, kind="stable")
        return permutation, np.bincount(device, minlength=num_devices)


class TokenOracle:
    """The Attention-TP ceiling on a base system's placement (see the module docstring)."""

    name = "token_oracle"

    def __init__(self, base: str = "semmoe", base_params: dict | None = None, align: str = "exact"):
        if align not in ALIGN_MODES:
            raise ConfigError(f"system.params.align must be one of {ALIGN_MODES}, got {align!r}.")
        self.base, self.base_params, self.align = base, dict(base_params or {}), align

    def fit(self, profile: RoutingTrace, parallel: ParallelConfig, rng: np.random.Generator) -> Plan:
        if parallel.attention != "tp":
            raise ConfigError(
                "token_oracle bounds Attention-TP only (a DP request lives on one rank); use system=fit_oracle "
                "for the Attention-DP ceiling or set parallel.attention=tp."
            )
        base_plan = _make_base(self.base, self.base_params).fit(profile, parallel, rng)
        info = {"base": self.base, "align": self.align}
        info.update({f"base_{k}": v for k, v in base_plan.info.items() if np.isscalar(v)})
        return TokenOraclePlan(base_plan.placement, parallel, info, self.align)


def request_device_scores(trace: RoutingTrace, present: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """(score float[R, D]: activations of each request served on device d over all layers; per-layer
    request→expert activation counts, a list of L float[R, E]). present bool[L, E, D]."""
    num_requests, num_experts = trace.num_requests, trace.meta.num_experts
    request = np.repeat(trace.request_of_token(), trace.meta.top_k)
    per_layer = []
    score = np.zeros((num_requests, present.shape[2]))
    for layer in range(trace.num_layers):  # loop over layers only
        experts = np.asarray(trace.experts[:, layer, :], dtype=np.int64).ravel()
        counts = np.bincount(request * num_experts + experts, minlength=num_requests * num_experts)
        per_layer.append(counts.reshape(num_requests, num_experts).astype(np.float64))
        score += per_layer[-1] @ present[layer]
    return score, per_layer


def token_balanced_assign(score: np.ndarray, length: np.ndarray, capacity: float, *, what: str) -> tuple[np.ndarray, float]:
    """(rank int[R], LP bound): maximise Σ score[r, rank[r]] with every rank's Σ length ≤ capacity.

    score float[R, D]; length int[R] tokens per request; capacity float, the same for every rank (needs
    capacity × D ≥ Σ length). The LP relaxation (HiGHS dual simplex) returns a vertex, whose fractional requests
    number at most D (one per binding capacity row); they are placed by an exact MILP over them alone given the
    capacity the integral ones leave, minimising the largest overflow past the capacity first (zero whenever
    some rounding of them fits; never more than the longest request, as the LP support matches every fractional
    request to its own rank) and the lost score second. The LP value bounds every feasible integral assignment,
    and the result is within D requests' scores of it.
    """
    num_requests, num_devices = score.shape
    length = np.asarray(length, dtype=np.float64)
    num_vars = num_requests * num_devices
    request_idx, rank_idx = np.divmod(np.arange(num_vars), num_devices)
    scale = max(float(np.abs(score).max(initial=0.0)), 1.0)
    one_each = sp.csr_array((np.ones(num_vars), (request_idx, np.arange(num_vars))), shape=(num_requests, num_vars))
    load = sp.csr_array((length[request_idx], (rank_idx, np.arange(num_vars))), shape=(num_devices, num_vars))
    lp = linprog(
        -(score / scale).ravel(), A_ub=load, b_ub=np.full(num_devices, capacity), A_eq=one_each,
        b_eq=np.ones(num_requests), bounds=(0.0, 1.0), method="highs-ds",
    )
    if lp.status != 0:
        raise ReproError(f"{what}: the LP relaxation failed ({lp.message}).")
    x = lp.x.reshape(num_requests, num_devices)
    rank = np.argmax(x, axis=1)
    fractional = np.flatnonzero(x.max(axis=1) < 1.0 - 1e-9)
    if len(fractional):
        integral = np.ones(num_requests, dtype=bool)
        integral[fractional] = False
        left = capacity - np.bincount(rank[integral], weights=length[integral], minlength=num_devices)
        num_frac = len(fractional)
        # variables: y[f, d] (binary), then z ≥ 0 the largest overflow; two solves: the least overflow, then the
        # most score at that overflow (lexicographic, no big-M)
        num_y = num_frac * num_devices
        f_idx, d_idx = np.divmod(np.arange(num_y), num_devices)
        pick = sp.csr_array((np.ones(num_y), (f_idx, np.arange(num_y))), shape=(num_frac, num_y + 1))
        fill = sp.hstack([
            sp.csr_array((length[fractional][f_idx], (d_idx, np.arange(num_y))), shape=(num_devices, num_y)),
            sp.csr_array(-np.ones((num_devices, 1))),
        ])
        constraints = [LinearConstraint(pick, 1.0, 1.0), LinearConstraint(fill, -np.inf, left)]
        integrality = np.concatenate([np.ones(num_y, dtype=np.int8), [0]])
        least = solve_milp(
            np.concatenate([np.zeros(num_y), [1.0]]), constraints, integrality,
            Bounds(np.zeros(num_y + 1), np.concatenate([np.ones(num_y), [np.inf]])),
            time_limit=60.0, mip_rel_gap=1e-9, what=f"{what} (rounding overflow)",
        ).objective
        result = solve_milp(
            np.concatenate([-(score[fractional] / scale).ravel(), [0.0]]), constraints, integrality,
            Bounds(np.zeros(num_y + 1), np.concatenate([np.ones(num_y), [least + 1e-6]])),
            time_limit=60.0, mip_rel_gap=1e-9, what=f"{what} (rounding)",
        )
        rank[fractional] = np.argmax(result.x[:-1].reshape(num_frac, num_devices), axis=1)
    return rank, -float(lp.fun) * scale


def picked(score: np.ndarray, rank: np.ndarray) -> float:
    """Σ_r score[r, rank[r]]: the local activations of an assignment (score float[R, D], rank int[R])."""
    return float(score[np.arange(len(rank)), rank].sum())


def check_token_balance(token_balance: float | None) -> None:
    """Raise ConfigError unless token_balance is null / 0 (request-count balance) or a max/mean cap >= 1."""
    if token_balance and token_balance < 1.0:
        raise ConfigError(
            "system.params.token_balance must be >= 1 (max/mean token load), or null / 0 for request-count "
            f"balance; got {token_balance}."
        )


def fit_request_assignment(
    trace: RoutingTrace, placement: Placement, rounds: int, token_balance: float | None = None
) -> tuple[np.ndarray, Placement, list[float], dict]:
    """Alternate request assignment and (without replicas) exact per-layer expert placement.

    token_balance b ≥ 1: every rank's token load (prompt + generated) ≤ b × mean, request counts free
    (`token_balanced_assign`); None or 0: R/D ± 1 requests per rank, exact max-weight transportation.
    Returns (rank int[R], the final placement, local activations after each round (non-decreasing: a round
    keeps the previous ranks when the new ones score no higher on the new placement), info: the LP bound of the
    last balanced assignment (local activations) and the fitted max/mean token load).
    """
    num_devices, num_experts = placement.num_devices, placement.num_experts
    num_requests = trace.num_requests
    if num_requests < num_devices:
        raise ConfigError(f"the evaluation trace has {num_requests} requests for {num_devices} DP ranks; need at least one per rank.")
    check_token_balance(token_balance)
    length = np.diff(np.asarray(trace.offsets)).astype(np.float64)
    capacity = (token_balance or 0.0) * length.sum() / num_devices
    floor, extra = divmod(num_requests, num_devices)
    lower, upper = np.full(num_devices, floor), np.full(num_devices, floor + (extra > 0))
    history: list[float] = []
    info: dict = {}
    rank = None
    for step in range(max(rounds, 1)):
        score, per_layer = request_device_scores(trace, placement.replicas() > 0)
        if token_balance:
            new_rank, info["lp_bound"] = token_balanced_assign(score, length, capacity, what="fit-oracle request assignment")
        else:
            new_rank = np.argmax(max_weight_transport(score, lower, upper, what="fit-oracle request assignment"), axis=1)
        if rank is None or picked(score, new_rank) > picked(score, rank):
            rank = new_rank
        history.append(picked(score, rank))
        if placement.num_slots != num_experts or step == rounds - 1:
            break
        size = num_experts // num_devices
        onehot = np.eye(num_devices)[rank]  # [R, D]
        expert_device = np.stack([
            np.argmax(max_weight_transport(counts.T @ onehot, np.full(num_devices, size), np.full(num_devices, size),
                                           what="fit-oracle expert placement"), axis=1)
            for counts in per_layer
        ])
        placement = Placement.from_expert_device(expert_device, num_devices)
    token_load = np.bincount(rank, weights=length, minlength=num_devices)
    info["token_imbalance_max_mean"] = float(token_load.max() / token_load.mean())
    return rank, placement, history, info


class FitOraclePlan(TokenOraclePlan):
    """DP: replays request ranks fitted on the evaluation trace; TP: the token oracle on the fitted placement."""

    def __init__(self, placement, parallel, info, align, fitted_ranks, fitted_offsets, fitted_token_ids):
        self._ranks = fitted_ranks
        self._offsets = fitted_offsets
        self._token_ids = fitted_token_ids
        super().__init__(placement, parallel, info, align)

    def reset(self) -> None:
        super().reset()
        self._cursor = 0

    def assign_requests(self, token_ids, offsets, prefill_len):
        if self._ranks is None:
            raise ConfigError("this fit_oracle plan was fitted for Attention-TP; refit it with parallel.attention=dp.")
        num_requests = len(offsets) - 1
        start, stop = self._cursor, self._cursor + num_requests
        lengths_ok = stop < len(self._offsets) and np.array_equal(
            np.diff(offsets), np.diff(self._offsets[start : stop + 1])
        )
        if not lengths_ok or not np.array_equal(
            np.asarray(token_ids)[offsets[0] : offsets[-1]], self._token_ids[self._offsets[start] : self._offsets[stop]]
        ):
            raise ConfigError(
                f"fit_oracle was fitted on another trace (requests {start}..{stop - 1} differ); evaluate it on the "
                "trace passed to fit (fits_on_evaluation = True)."
            )
        self._cursor = stop
        return self._ranks[start:stop]


class FitOracle:
    """The ceiling with everything fitted on the evaluated routing (see the module docstring).

    fits_on_evaluation = True: the app calls fit(eval_trace, ...) instead of fit(profile_trace, ...).
    """

    name = "fit_oracle"
    fits_on_evaluation = True

    def __init__(
        self,
        base: str = "semmoe",
        base_params: dict | None = None,
        rounds: int = 3,
        align: str = "exact",
        token_balance: float | None = 1.3,
    ):
        if align not in ALIGN_MODES:
            raise ConfigError(f"system.params.align must be one of {ALIGN_MODES}, got {align!r}.")
        if rounds < 1:
            raise ConfigError(f"system.params.rounds must be >= 1, got {rounds}.")
        check_token_balance(token_balance)
        self.base, self.base_params, self.rounds, self.align = base, dict(base_params or {}), int(rounds), align
        self.token_balance = float(token_balance) if token_balance else None

    def fit(self, evaluation: RoutingTrace, parallel: ParallelConfig, rng: np.random.Generator) -> Plan:
        base_plan = _make_base(self.base, self.base_params).fit(evaluation, parallel, rng)
        placement = base_plan.placement
        info = {"base": self.base, "align": self.align}
        ranks = None
        if parallel.attention == "dp":
            ranks, placement, history, fit_info = fit_request_assignment(
                evaluation, placement, self.rounds, self.token_balance
            )
            total = max(evaluation.num_tokens * evaluation.num_layers * evaluation.meta.top_k, 1)
            info["oracle_token_balance"] = self.token_balance or 0.0
            info["oracle_lar_fit"] = history[-1] / total
            info["oracle_lar_first_round"] = history[0] / total
            info["oracle_token_imbalance_fit"] = fit_info["token_imbalance_max_mean"]
            if "lp_bound" in fit_info:
                info["oracle_lar_lp_bound"] = fit_info["lp_bound"] / total
        return FitOraclePlan(
            placement, parallel, info, self.align, ranks, np.asarray(evaluation.offsets),
            np.asarray(evaluation.token_ids),
        )
