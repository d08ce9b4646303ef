"""Sem-MoE (arXiv 2503.04398): balanced token-expert co-clustering offline, plus two online schedulers.

Legend: L MoE layers, E experts per layer (the paper's N), D devices = EP ranks (the paper's E), t distinct
profiled token ids (table rows; row t is the OOV fallback row), u clustering units (token rows or profile
requests), R requests, N tokens, T tokens in one TP step, k experts per token, h lookback layers,
Q = D**h device histories, V vocabulary size.

1. Offline (Algorithm 1, `balanced_cocluster`): alternate expert placement (`place_experts`: greedy by
   hotness with the score alpha * expert-expert co-activation share + beta * unit-cluster affinity share -
   gamma * overload beyond the device's fair share, exactly E/D experts per device, then `ft_steps` random
   pairwise swaps kept when they gain, then by default the exact linear-assignment version of that step)
   and unit clustering (`assign_units`: the better of a Lagrangian price iteration on the paper's
   |load - S/D| term and the paper's capacity mask, `capacity_assign`), for `n_steps` rounds after an
   initial round from expert co-activation alone; the round with the lowest paper objective L
   (theta * imbalance + (1 - theta) * remote activations) is kept. Beyond the paper, on instances small
   enough for it (`SEARCH_CELLS`): up to `n_starts` runs of that alternation, then `refine_cocluster`, a
   local search on the exact L (unit moves and swaps, kicks, re-placed experts); it brought 12-token planted
   instances from 15-60 % to within ~1 % of the exact MILP optimum (repro.systems.milp). At 8192 units x 32
   devices it is one start plus one polish. Units depend on the attention mode: under
   Attention-TP every layer clusters token ids on its own (token level, per-layer choice, as in the paper's
   L); under Attention-DP a request lives on one rank for all layers, so profile requests are clustered once
   and shared by every layer's expert placement (otherwise device labels would disagree between layers and
   a request could be local in one layer only). Only the `max_units` heaviest units enter the solver
   (8192 token rows cover ~70 % of a 512k-token profile's load and lose no LAR on the planted bench).
2. Online Attention-DP (Algorithm 2; its body is lost in the paper): a request's per-device score is the
   mean over its prompt tokens of a per-token score folded over layers, minus the score of the average
   profile token (so every request is not drawn to the device hosting the experts of stop words).
   dp_scoring "confidence" (default): each token casts one vote for the device of its folded T_p-weighted
   votes, weighted by that device's share; "vote": the same with weight 1; "expected": the full folded
   device mass (expected local activations, a dense [D] row per token: slower). `masked_argmax_assign` is
   the round-robin dev_mask: every D consecutive requests cover all D ranks (`dp_window` = w allows w
   requests per rank per window of w x D). dp_assign "exact" (default; "greedy" = the paper's in-order
   argmax) gives each window's requests a maximum-weight assignment of score x prompt length
   (`window_exact_assign`, same windows and balance), minus dp_token_price x prompt length x the rank's
   relative excess of queued prompt tokens; on replayed OLMoE routing at EP4 it raised DP LAR 0.270 -> 0.280
   and cut the max/mean token load 1.29 -> 1.05. Optional load-aware variant (`load_aware_lambda` > 0): score
   minus lambda * (prompt tokens queued on the rank beyond the least-loaded rank) / (mean prompt length),
   one Python step per request; with a wide `dp_window` it balances tokens rather than request counts.
3. Online Attention-TP (Algorithm 3, `align_to_slices`): each token's device is T[tok] or the Markov
   prediction A[history], whichever is more confident: where(T_p > A_p, T, A). A_p is calibrated to T_p's
   scale (`device_markov_table`): it is the token confidence below which A beat T on the profile (T judged
   leave-one-out), so the history only overrides tokens whose own table is weak, and only where that gained
   local activations. The paper's raw A_p (a majority-vote frequency) overrode T too often and lowered LAR
   on learned and replayed routing. Tokens are grouped by device (most confident first),
   groups are cut to the equal slices reduce-scatter needs and the overflow fills the free slots (the
   paper's align); the share of tokens moved off their predicted device is reported in
   info["align_moved_share"].
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linear_sum_assignment

from repro.affinity.tables import (
    check_markov_size,
    device_markov_table,
    encode_tokens,
    history_keys,
    layer_token_expert_coo,
    majority_device,
    profile_tokens,
    routed_device_mass,
    vocab_row_map,
)
from repro.errors import ConfigError, TraceError
from repro.parallel import ParallelConfig
from repro.systems.base import Placement, Plan, even_counts
from repro.traces import RoutingTrace

DP_SCORINGS = ("confidence", "vote", "expected")
DP_ASSIGNS = ("greedy", "exact")
CLUSTER_UNITS = ("auto", "tokens", "requests")


# ----------------------------------------------------------------------------------------------------------
# the objective


def coclustering_objective(
    token_cluster: np.ndarray,
    expert_cluster: np.ndarray,
    confidence: np.ndarray,
    frequency: np.ndarray,
    num_devices: int,
    theta: float,
) -> float:
    """The paper's L for one layer: theta * sum_i |sum_j R_ij a_j - S/D| + (1 - theta) * remote mass.

    token_cluster int[t] device of each token row; expert_cluster int[E] device of each expert;
    confidence float[t, E] C_p (rows sum to 1); frequency float[t] a_j; S = sum_j a_j. The remote mass is
    sum_j a_j sum_k C_p[j, k] [cluster(k) != cluster(j)].
    """
    token_cluster = np.asarray(token_cluster, dtype=np.int64)
    expert_cluster = np.asarray(expert_cluster, dtype=np.int64)
    confidence = np.asarray(confidence, dtype=np.float64)
    frequency = np.asarray(frequency, dtype=np.float64)
    load = np.bincount(token_cluster, weights=frequency, minlength=num_devices)
    imbalance = np.abs(load - frequency.sum() / num_devices).sum()
    on_device = confidence @ (expert_cluster[:, None] == np.arange(num_devices))  # [t, D] mass per device
    local = on_device[np.arange(len(token_cluster)), token_cluster]
    remote = float(frequency @ (confidence.sum(axis=1) - local))
    return float(theta * imbalance + (1.0 - theta) * remote)


# ----------------------------------------------------------------------------------------------------------
# Algorithm 1: balanced token-expert co-clustering


@dataclass
class CoclusterResult:
    """unit_cluster int64[u]; expert_device int64[L, E]; objective = L summed over layers (lower is better);
    history = objective of every round (round 0 is the expert-affinity initialisation)."""

    unit_cluster: np.ndarray
    expert_device: np.ndarray
    objective: float
    history: list = field(default_factory=list)


def check_cocluster_args(num_experts: int, num_devices: int, theta: float, n_steps: int, ft_steps: int) -> None:
    """Raise ConfigError for parameters Algorithm 1 cannot work with."""
    if not 0.0 < theta < 1.0:
        raise ConfigError(f"system.params.theta must be strictly between 0 and 1, got {theta}.")
    if num_devices < 1 or num_devices > num_experts:
        raise ConfigError(
            f"co-clustering {num_experts} experts onto {num_devices} devices is impossible; use 1..{num_experts} devices."
        )
    if num_experts % num_devices:
        raise ConfigError(
            f"{num_experts} experts do not split into {num_devices} equal clusters; choose a divisor of {num_experts}."
        )
    if n_steps < 1 or ft_steps < 0:
        raise ConfigError(f"system.params.n_steps must be >= 1 and ft_steps >= 0, got {n_steps} and {ft_steps}.")


@dataclass(frozen=True)
class SparseAffinity:
    """COO affinity float[L, u, E]: unit[i] activates expert[i] value[i] times (load units) in layer[i].

    Profile tables are sparse (a token row touches few experts), so a solver round costs O(nnz + u x D +
    L x D x E) instead of O(u x E x D): what makes a 58-layer, 256-expert instance feasible on 2 cores.
    """

    layer: np.ndarray  # int64[nnz]
    unit: np.ndarray  # int64[nnz]
    expert: np.ndarray  # int64[nnz]
    value: np.ndarray  # float64[nnz]
    num_layers: int
    num_units: int
    num_experts: int

    @classmethod
    def from_dense(cls, affinity: np.ndarray) -> SparseAffinity:
        """From float[L, u, E]."""
        affinity = np.asarray(affinity)
        if affinity.ndim != 3:
            raise ConfigError(f"affinity must be a [layers, units, experts] array, got shape {affinity.shape}.")
        layer, unit, expert = np.nonzero(affinity)
        return cls(layer, unit, expert, affinity[layer, unit, expert].astype(np.float64), *affinity.shape)

    def hotness(self) -> np.ndarray:
        """float64[L, E] activations per expert."""
        flat = np.bincount(self.layer * self.num_experts + self.expert, weights=self.value,
                           minlength=self.num_layers * self.num_experts)
        return flat.reshape(self.num_layers, self.num_experts)

    def coactivation(self, unit_load: np.ndarray) -> np.ndarray:
        """float64[L, E, E] sum_u A[u, e] A[u, e'] / load_u per layer, zero diagonal (sparse products)."""
        scale = self.value / np.sqrt(np.maximum(unit_load[self.unit], 1e-12))
        out = np.empty((self.num_layers, self.num_experts, self.num_experts))
        for layer in range(self.num_layers):
            sel = self.layer == layer
            a = sp.csr_matrix((scale[sel], (self.unit[sel], self.expert[sel])), shape=(self.num_units, self.num_experts))
            out[layer] = (a.T @ a).toarray()
        idx = np.arange(self.num_experts)
        out[:, idx, idx] = 0.0
        return out

    def cluster_affinity(self, unit_cluster: np.ndarray, num_devices: int) -> np.ndarray:
        """float64[L, D, E] activations of expert e by the units of cluster d."""
        key = (self.layer * num_devices + unit_cluster[self.unit]) * self.num_experts + self.expert
        flat = np.bincount(key, weights=self.value, minlength=self.num_layers * num_devices * self.num_experts)
        return flat.reshape(self.num_layers, num_devices, self.num_experts)

    def local_mass(self, expert_device: np.ndarray, num_devices: int) -> np.ndarray:
        """float64[u, D] mass of each unit's activations hosted on each device, summed over layers."""
        key = self.unit * num_devices + expert_device[self.layer, self.expert]
        dense = np.bincount(key, weights=self.value, minlength=self.num_units * num_devices)
        return dense.reshape(self.num_units, num_devices)


def place_experts(
    cluster_affinity: np.ndarray | None,
    hotness: np.ndarray,
    coact: np.ndarray,
    num_devices: int,
    rng: np.random.Generator,
    alpha: float = 1.0,
    beta: float = 1.0,
    gamma: float = 1.0,
    ft_steps: int = 64,
    exact: bool = False,
) -> np.ndarray:
    """int64[L, E] expert -> device with exactly E/D experts per device in every layer (paper's expert_place).

    cluster_affinity float[L, D, E]: activations of expert e by the units of cluster d (None before any unit
    clustering exists: only co-activation and load count); hotness float[L, E]; coact float[L, E, E].
    Greedy over experts in descending hotness (all layers at once), then ft_steps random swaps per layer kept
    when their affinity gain is > 0 and they do not raise the layer's maximum device load. With `exact` and
    unit clusters, the swaps' goal is then reached exactly: each layer's experts go to the E/D slots per
    device that maximise the local activations sum_e cluster_affinity[device(e), e] (a linear assignment,
    O(E^3) per layer); on replayed OLMoE routing it raised DP LAR at EP4 from 0.262 to 0.275.
    """
    num_layers, num_experts = hotness.shape
    capacity = num_experts // num_devices
    layer = np.arange(num_layers)
    eps = 1e-12
    affinity_share = (
        np.zeros((num_layers, num_devices, num_experts), dtype=np.float32)
        if cluster_affinity is None
        else cluster_affinity / np.maximum(hotness[:, None, :], eps)
    )
    coact_total = np.maximum(coact.sum(axis=2), eps)  # [L, E]
    mean_load = np.maximum(hotness.sum(axis=1) / num_devices, eps)  # [L]
    order = np.argsort(-hotness, axis=1, kind="stable")
    expert_device = np.full((num_layers, num_experts), -1, dtype=np.int64)
    count = np.zeros((num_layers, num_devices), dtype=np.int64)
    load = np.zeros((num_layers, num_devices), dtype=np.float64)
    coact_on = np.zeros((num_layers, num_experts, num_devices), dtype=np.float32)  # sum of coact with placed experts
    for i in range(num_experts):  # one expert per layer per iteration, all layers together
        expert = order[:, i]
        score = (
            alpha * coact_on[layer, expert] / coact_total[layer, expert][:, None]
            + beta * affinity_share[layer, :, expert]
            # only the load beyond a device's fair share costs: an absolute load term would outweigh
            # the affinity shares (both in [0, 1]) and scatter co-activated experts
            - gamma * np.maximum(load + hotness[layer, expert][:, None] - mean_load[:, None], 0.0) / mean_load[:, None]
        )
        score[count >= capacity] = -np.inf
        device = np.argmax(score, axis=1)
        expert_device[layer, expert] = device
        count[layer, device] += 1
        load[layer, device] += hotness[layer, expert]
        coact_on[layer, :, device] += coact[layer, :, expert]

    # refinement: random pairwise swaps, gain in shares of the layer's total activation / co-activation
    total_act = np.maximum(hotness.sum(axis=1), eps)
    total_co = np.maximum(coact.sum(axis=(1, 2)), eps)
    raw_affinity = np.zeros_like(affinity_share) if cluster_affinity is None else cluster_affinity
    for _ in range(ft_steps):
        e1, e2 = rng.integers(num_experts, size=(2, num_layers))
        d1, d2 = expert_device[layer, e1], expert_device[layer, e2]
        affinity_gain = (
            raw_affinity[layer, d2, e1] + raw_affinity[layer, d1, e2]
            - raw_affinity[layer, d1, e1] - raw_affinity[layer, d2, e2]
        ) / total_act
        pair = coact[layer, e1, e2]
        coact_gain = (
            coact_on[layer, e1, d2] - pair + coact_on[layer, e2, d1] - pair
            - coact_on[layer, e1, d1] - coact_on[layer, e2, d2]
        ) / total_co
        delta = hotness[layer, e2] - hotness[layer, e1]
        new_max = np.maximum(load[layer, d1] + delta, load[layer, d2] - delta)
        accept = (d1 != d2) & (beta * affinity_gain + alpha * coact_gain > 0) & (new_max <= load.max(axis=1) + eps)
        lay, a, b, da, db = layer[accept], e1[accept], e2[accept], d1[accept], d2[accept]
        expert_device[lay, a], expert_device[lay, b] = db, da
        load[lay, da] += delta[accept]
        load[lay, db] -= delta[accept]
        swap_co = coact[lay, :, b] - coact[lay, :, a]  # [accepted, E]
        coact_on[lay, :, da] += swap_co
        coact_on[lay, :, db] -= swap_co
    if exact and cluster_affinity is not None:
        for lay in range(num_layers):
            slot_gain = np.repeat(cluster_affinity[lay], capacity, axis=0)  # [E slots, E], slot s on device s // (E/D)
            experts, slots = linear_sum_assignment(slot_gain.T, maximize=True)
            expert_device[lay, experts] = slots // capacity
    return expert_device


def _objective(cluster: np.ndarray, local: np.ndarray, unit_load: np.ndarray, num_layers: int, theta: float) -> float:
    """L summed over layers for unit clusters int[u] given local float[u, D] (load units, summed over layers)."""
    num_devices = local.shape[1]
    load = np.bincount(cluster, weights=unit_load, minlength=num_devices)
    imbalance = np.abs(load - unit_load.sum() / num_devices).sum()
    remote = num_layers * unit_load.sum() - local[np.arange(len(cluster)), cluster].sum()
    return float(theta * num_layers * imbalance + (1.0 - theta) * remote)


def capacity_assign(local: np.ndarray, unit_load: np.ndarray, slack: float = 0.02) -> np.ndarray:
    """int64[u] units -> devices with every device's load <= (1 + slack) x the mean, by proposal rounds.

    local float[u, D]. Each round every unassigned unit proposes to its best device that is not full; a
    device accepts proposals in descending order of the unit's local share until its capacity and becomes
    full at its first rejection. Units still open after D rounds (bigger than any remaining capacity) go,
    heaviest first, to the device with the most capacity left. Vectorised per round (sort by device,
    cumulative load): the paper's "mask a cluster once it is full".
    """
    num_units, num_devices = local.shape
    capacity = np.full(num_devices, (1.0 + slack) * unit_load.sum() / num_devices)
    full = np.zeros(num_devices, dtype=bool)
    cluster = np.full(num_units, -1, dtype=np.int64)
    share = local / np.maximum(unit_load, 1e-12)[:, None]
    for _ in range(num_devices):
        open_units = np.flatnonzero(cluster < 0)
        if len(open_units) == 0 or full.all():
            break
        choice = np.argmax(np.where(full[None, :], -np.inf, share[open_units]), axis=1)
        order = np.lexsort((-share[open_units, choice], choice))
        units, devices = open_units[order], choice[order]
        cumulative = np.cumsum(unit_load[units])
        group_start = np.searchsorted(devices, devices, side="left")
        earlier = np.concatenate([[0.0], cumulative])[group_start]  # load proposed to lower device ids
        accept = cumulative - earlier <= capacity[devices]
        cluster[units[accept]] = devices[accept]
        capacity -= np.bincount(devices[accept], weights=unit_load[units[accept]], minlength=num_devices)
        full[devices[~accept]] = True
    leftovers = np.flatnonzero(cluster < 0)
    for unit in leftovers[np.argsort(-unit_load[leftovers], kind="stable")]:  # few: a loop is fine
        device = int(np.argmax(capacity))
        cluster[unit] = device
        capacity[device] -= unit_load[unit]
    return cluster


# work cap of the search beyond the paper, in unit x device cells (a polish round or a kick costs O(u x D)):
# starts and kicks = SEARCH_CELLS / (u x D), so small instances get the full n_starts / polish_kicks and an
# 8192-unit, 32-device layer one start and no kicks (a kick moves 3 of 8192 units there: no use)
SEARCH_CELLS = 1 << 16


def _device_disjoint(delta: np.ndarray, source: np.ndarray, dest: np.ndarray, num_devices: int) -> np.ndarray:
    """int64[m] indices of candidates, best first, that share no device: greedy over candidates sorted by delta.

    delta float[c] objective change of each candidate (only negative ones are passed); source, dest int[c].
    Only the best candidate of each (source, dest) pair can be picked, so the Python loop runs over at most
    D x (D - 1) entries however many units want to move.
    """
    pair = source * num_devices + dest
    order = np.lexsort((delta, pair))
    best_of_pair = order[np.unique(pair[order], return_index=True)[1]]
    best_of_pair = best_of_pair[np.argsort(delta[best_of_pair], kind="stable")]
    busy = np.zeros(num_devices, dtype=bool)
    chosen = []
    for k, s, d in zip(best_of_pair.tolist(), source[best_of_pair].tolist(), dest[best_of_pair].tolist(), strict=True):
        if busy[s] or busy[d]:
            continue
        busy[s] = busy[d] = True
        chosen.append(k)
        if len(chosen) == num_devices // 2:
            break
    return np.asarray(chosen, dtype=np.int64)


def _side_preserving_moves(
    cluster: np.ndarray, local: np.ndarray, own: np.ndarray, unit_load: np.ndarray, load: np.ndarray,
    target: float, balance: float, tol: float,
) -> bool:
    """Apply, in place, many improving single-unit moves that leave every device on its side of S/D.

    While no device crosses S/D, |load_d - S/D| is linear in the load moved, so the gains of any set of
    such moves add up exactly: a device above S/D gets -1 per unit of load leaving (+1 arriving), one below
    +1 per unit leaving (-1 arriving). Each unit proposes its best device under these slopes; proposals are
    taken in order of gain while the gross load leaving each device above S/D stays within its excess and
    the gross load entering each device below S/D within its deficit (prefix sums over all proposals, so the
    check is conservative and vectorised). Returns whether any move was applied. cluster int64[u] and load
    float[D] are updated; local float[u, D]; own float[u] = local[u, cluster[u]].
    """
    num_units, num_devices = local.shape
    above = load > target
    out_slope = np.where(above, -1.0, 1.0)  # [D]
    in_slope = np.where(load >= target, 1.0, -1.0)
    out_room = np.where(above, load - target, np.inf)
    in_room = np.where(load < target, target - load, np.inf)
    score = unit_load[:, None] * (balance * in_slope[None, :])  # [u, D]
    score -= local
    score[np.arange(num_units), cluster] = np.inf
    dest = np.argmin(score, axis=1)
    delta = score[np.arange(num_units), dest] + balance * unit_load * out_slope[cluster] + own
    fits = (delta < -tol) & (unit_load <= out_room[cluster]) & (unit_load <= in_room[dest])
    units = np.flatnonzero(fits)
    if len(units) == 0:
        return False
    units = units[np.argsort(delta[units], kind="stable")]
    source, dest = cluster[units], dest[units]
    # running gross load per device in proposal order: one cumsum per device via a stable sort by device
    def running(device: np.ndarray) -> np.ndarray:
        order = np.argsort(device, kind="stable")
        total = np.cumsum(unit_load[units][order])
        start = np.searchsorted(device[order], device[order], side="left")
        out = np.empty(len(units))
        out[order] = total - np.concatenate([[0.0], total])[start]
        return out

    accept = (running(source) <= out_room[source]) & (running(dest) <= in_room[dest])
    if not accept.any():
        return False
    units, source, dest = units[accept], source[accept], dest[accept]
    cluster[units] = dest
    load -= np.bincount(source, weights=unit_load[units], minlength=num_devices)
    load += np.bincount(dest, weights=unit_load[units], minlength=num_devices)
    return True


def polish_units(
    cluster: np.ndarray,
    local: np.ndarray,
    unit_load: np.ndarray,
    num_layers: int,
    theta: float,
    max_rounds: int = 64,
    swap_units: int = 256,
) -> np.ndarray:
    """int64[u] unit clusters after a local search on the exact L (summed over layers) for fixed experts.

    cluster int[u] start; local float[u, D] (as in `assign_units`); unit_load float[u]. A round first tries
    a batch of moves that keep every device on its side of S/D (`_side_preserving_moves`, many at once);
    when there is none it evaluates every single-unit move ([u, D]) and every pairwise swap among the
    `swap_units` units with the best move (all units when u <= swap_units; [m, m]) exactly, and applies the
    best improving ones that touch pairwise distinct devices: L's imbalance terms |load_d - S/D| of distinct
    devices are independent and each unit's remote term depends on its own device only, so their gains add
    up exactly and L never rises. Stops when nothing improves, or after `max_rounds` rounds (O(u x D + m^2)
    each). Why: the price and capacity assignments place units against a load estimate and leave units that
    one move or swap would improve (on 12-token instances, where one unit is a large share of S/D).
    """
    cluster = np.asarray(cluster, dtype=np.int64).copy()
    local = np.asarray(local, dtype=np.float64)
    unit_load = np.asarray(unit_load, dtype=np.float64)
    num_units, num_devices = local.shape
    if num_devices < 2 or num_units < 2:
        return cluster
    target = unit_load.sum() / num_devices
    balance = theta * num_layers / (1.0 - theta)  # deltas below are L / (1 - theta): remote units
    tol = 1e-9 * (num_layers * unit_load.sum())
    load = np.bincount(cluster, weights=unit_load, minlength=num_devices)
    rows = np.arange(num_units)
    no_partner = np.full(num_units, -1, dtype=np.int64)
    for _ in range(max_rounds):
        own = local[rows, cluster]  # [u]
        if _side_preserving_moves(cluster, local, own, unit_load, load, target, balance, tol):
            continue
        excess = np.abs(load - target)  # [D]
        # move u: a -> b changes L / (1 - theta) by balance * (leave_u + enter_ub) - (local_ub - own_u)
        leave = np.abs(load[cluster] - unit_load - target) - excess[cluster]  # [u]
        move = np.abs(load[None, :] + unit_load[:, None] - target)  # [u, D], in place below: one temporary
        move -= excess[None, :]
        move *= balance
        move -= local
        move[rows, cluster] = np.inf
        move_dest = np.argmin(move, axis=1)
        move_delta = move[rows, move_dest] + balance * leave + own
        # swap u (on a) with v (on b): a's load changes by w_v - w_u, b's by w_u - w_v
        pool = rows if num_units <= swap_units else np.argpartition(move_delta, swap_units)[:swap_units]
        home = cluster[pool]
        shift = unit_load[pool][:, None] - unit_load[pool][None, :]  # [m, m]
        swap = np.abs(load[home][:, None] - shift - target) + np.abs(load[home][None, :] + shift - target)
        swap -= excess[home][:, None] + excess[home][None, :]
        swap *= balance
        pool_local = local[pool][:, home]  # [m, m] local mass of pool unit i on pool unit j's device
        swap -= pool_local + pool_local.T - own[pool][:, None] - own[pool][None, :]
        swap[home[:, None] >= home[None, :]] = np.inf  # each pair once, never within one device
        i, j = np.nonzero(swap < -tol)
        improving = np.flatnonzero(move_delta < -tol)
        if len(improving) == 0 and len(i) == 0:
            break
        delta = np.concatenate([move_delta[improving], swap[i, j]])
        source = np.concatenate([cluster[improving], home[i]])
        dest = np.concatenate([move_dest[improving], home[j]])
        first = np.concatenate([improving, pool[i]])
        second = np.concatenate([no_partner[improving], pool[j]])
        chosen = _device_disjoint(delta, source, dest, num_devices)
        first, second, source, dest = first[chosen], second[chosen], source[chosen], dest[chosen]
        moved = unit_load[first] - np.where(second >= 0, unit_load[np.maximum(second, 0)], 0.0)
        cluster[first] = dest
        is_swap = second >= 0
        cluster[second[is_swap]] = source[is_swap]
        load -= np.bincount(source, weights=moved, minlength=num_devices)
        load += np.bincount(dest, weights=moved, minlength=num_devices)
    return cluster


def assign_units(
    local: np.ndarray,
    unit_load: np.ndarray,
    num_layers: int,
    theta: float,
    prices: np.ndarray,
    price_iters: int = 12,
) -> tuple[np.ndarray, np.ndarray, float]:
    """(unit_cluster int64[u], prices float64[D], objective) for fixed expert placements (request_schedule).

    local float[u, D]: mass (load units, summed over layers) of unit u's activations hosted on device d.
    Two candidates, the one with the lower objective L (summed over layers) wins: (1) Lagrangian prices:
    each unit takes argmin_d -(1 - theta) local[u, d] + theta * L * price_d * load_u, prices being
    subgradient steps of the imbalance term clipped to its subgradient range [-1, 1], starting from
    `prices`, best iterate kept; (2) `capacity_assign`, the paper's capacity mask, which stays balanced
    where big units (requests) make the prices oscillate.
    """
    num_devices = local.shape[1]
    target = unit_load.sum() / num_devices
    weight = theta * num_layers * unit_load
    prices = prices.astype(np.float64).copy()
    cluster = capacity_assign(local, unit_load)
    best = (cluster, prices.copy(), _objective(cluster, local, unit_load, num_layers, theta))
    for it in range(price_iters):
        cluster = np.argmin(-(1.0 - theta) * local + weight[:, None] * prices[None, :], axis=1)
        objective = _objective(cluster, local, unit_load, num_layers, theta)
        if objective < best[2]:
            best = (cluster, prices.copy(), objective)
        load = np.bincount(cluster, weights=unit_load, minlength=num_devices)
        prices = np.clip(prices + (load - target) / max(target, 1e-12) / np.sqrt(it + 1.0), -1.0, 1.0)
    return best


def kick_units(cluster: np.ndarray, num_devices: int, rng: np.random.Generator, kick_size: int = 3) -> np.ndarray:
    """int64[u] copy of cluster with `kick_size` random units sent to random other devices (unchanged if D = 1)."""
    cluster = np.array(cluster, dtype=np.int64)
    if num_devices < 2:
        return cluster
    picked = rng.choice(len(cluster), size=min(kick_size, len(cluster)), replace=False)
    cluster[picked] = (cluster[picked] + rng.integers(1, num_devices, size=len(picked))) % num_devices
    return cluster


def perturb_units(
    cluster: np.ndarray,
    local: np.ndarray,
    unit_load: np.ndarray,
    num_layers: int,
    theta: float,
    rng: np.random.Generator,
    kicks: int,
    polish_rounds: int = 64,
) -> tuple[np.ndarray, float]:
    """(unit_cluster int64[u], objective): iterated local search on the unit clusters for fixed experts.

    cluster int[u]; local float[u, D]; unit_load float[u]. Polishes `cluster` (`polish_units`), then `kicks`
    times sends 3 random units (`kick_units`) to random other devices, polishes again and keeps the result when
    L drops. Why: moves and pairwise swaps stop at local optima that need two simultaneous swaps (seen on
    12-token instances 10-34 % above the MILP optimum); a random kick plus polish gets out of them.
    """
    num_units, num_devices = local.shape
    cluster = polish_units(cluster, local, unit_load, num_layers, theta, max_rounds=polish_rounds)
    best = _objective(cluster, local, unit_load, num_layers, theta)
    if num_devices < 2:
        return cluster, best
    for _ in range(kicks):
        trial = kick_units(cluster, num_devices, rng)
        trial = polish_units(trial, local, unit_load, num_layers, theta, max_rounds=polish_rounds)
        objective = _objective(trial, local, unit_load, num_layers, theta)
        if objective < best:
            cluster, best = trial, objective
    return cluster, best


def swap_random_experts(expert_device: np.ndarray, num_devices: int, rng: np.random.Generator) -> np.ndarray:
    """int64[L, E] copy of expert_device with two experts of one random layer on different devices swapped.

    Keeps exactly E/D experts per device; returned unchanged (a copy) when D = 1.
    """
    expert_device = np.array(expert_device, dtype=np.int64)
    if num_devices < 2:
        return expert_device
    layer = rng.integers(expert_device.shape[0])
    first = rng.integers(expert_device.shape[1])
    second = rng.choice(np.flatnonzero(expert_device[layer] != expert_device[layer, first]))
    expert_device[layer, [first, second]] = expert_device[layer, [second, first]]
    return expert_device


def balanced_cocluster(
    affinity: np.ndarray | SparseAffinity,
    unit_load: np.ndarray,
    num_devices: int,
    rng: np.random.Generator,
    theta: float = 0.5,
    alpha: float = 1.0,
    beta: float = 1.0,
    gamma: float = 1.0,
    n_steps: int = 8,
    ft_steps: int = 64,
    price_iters: int = 12,
    exact_expert_step: bool = True,
    n_starts: int = 4,
    polish_rounds: int = 64,
    polish_kicks: int = 32,
) -> CoclusterResult:
    """Algorithm 1 on units shared by L layers: (unit clusters, expert placement per layer).

    affinity float[L, u, E] (dense or `SparseAffinity`): expected activations of expert e by unit u in layer
    l, in load units (a token row j has row a_j C_p[j]; a request has its tokens' counts / k), so each row
    sums to unit_load[u]. unit_load float[u] > 0: tokens per unit (a_j for token rows). With L = 1 and token
    rows this minimises exactly `coclustering_objective`. Returns the best solution found; history lists the
    objective of every round of every start, then (with polish_rounds > 0) the refined objective.

    Beyond the paper, both capped by work so they vanish at 8192 units x 32 devices (SEARCH_CELLS): (1) up
    to `n_starts` runs of the alternation (they differ in the random swaps of the first expert placement),
    best kept; (2) `refine_cocluster` (local search on the exact L) on the best, unless polish_rounds = 0.
    """
    if not isinstance(affinity, SparseAffinity):
        affinity = SparseAffinity.from_dense(affinity)
    unit_load = np.asarray(unit_load, dtype=np.float64)
    num_layers, num_units, num_experts = affinity.num_layers, affinity.num_units, affinity.num_experts
    check_cocluster_args(num_experts, num_devices, theta, n_steps, ft_steps)
    if num_units == 0 or unit_load.sum() <= 0 or len(unit_load) != num_units:
        raise TraceError(
            f"the co-clustering got {num_units} units with total load {unit_load.sum():g} (and {len(unit_load)} loads); "
            "profile on a split with routed tokens."
        )
    hotness = affinity.hotness()
    coact = affinity.coactivation(unit_load)
    budget = max(1, SEARCH_CELLS // (num_units * num_devices))

    def place(cluster_affinity):
        return place_experts(
            cluster_affinity, hotness, coact, num_devices, rng, alpha, beta, gamma, ft_steps, exact_expert_step
        )

    best, history = None, []
    for _ in range(min(n_starts, budget)):
        prices = np.zeros(num_devices)
        cluster_affinity = None  # round 0: the paper initialises the clusters from expert affinity alone
        for _ in range(1 + n_steps):
            expert_device = place(cluster_affinity)
            local = affinity.local_mass(expert_device, num_devices)
            unit_cluster, prices, objective = assign_units(local, unit_load, num_layers, theta, prices, price_iters)
            history.append(objective)
            if best is None or objective < best.objective:
                best = CoclusterResult(unit_cluster, expert_device, objective)
            cluster_affinity = affinity.cluster_affinity(unit_cluster, num_devices)
    if polish_rounds > 0:
        best = refine_cocluster(best, affinity, unit_load, theta, num_devices, rng, place, polish_rounds,
                                min(polish_kicks, budget - 1))
        history.append(best.objective)
    best.history = history
    return best


def refine_cocluster(
    result: CoclusterResult,
    affinity: SparseAffinity,
    unit_load: np.ndarray,
    theta: float,
    num_devices: int,
    rng: np.random.Generator,
    place,
    polish_rounds: int = 64,
    kicks: int = 32,
) -> CoclusterResult:
    """Iterated local search on the exact L from a solution of the alternation; never returns a worse one.

    result: unit_cluster int[u], expert_device int[L, E]; affinity float[L, u, E]; unit_load float[u];
    place: cluster_affinity float[L, D, E] -> expert_device int[L, E] (the alternation's expert step).
    Step 0 kick-and-polishes the units for the given experts (`perturb_units`, `kicks` kicks); step k > 0
    kicks the best solution (odd k: two experts of one layer swap devices; even k: 3 units move), then the
    units follow the experts (`polish_units`), the experts follow the units (`place`) and the units follow
    again; a step is kept when L drops. Why: the alternation stops where neither block alone improves, and
    its price/capacity unit step leaves units a move or swap would improve; on 12-token planted instances
    that was 15-60 % above the MILP optimum (`repro.systems.milp`), after this at most 1.1 % (24 instances).
    """
    num_layers = affinity.num_layers
    best = CoclusterResult(result.unit_cluster, result.expert_device, result.objective)
    for step in range(1 + kicks):
        expert_device = swap_random_experts(best.expert_device, num_devices, rng) if step % 2 else best.expert_device
        local = affinity.local_mass(expert_device, num_devices)
        if step == 0:
            unit_cluster, objective = perturb_units(best.unit_cluster, local, unit_load, num_layers, theta, rng, kicks,
                                                    polish_rounds=polish_rounds)
            if objective < best.objective:  # kept even if the (non-exact) expert step below does worse
                best = CoclusterResult(unit_cluster, expert_device, objective)
        else:
            unit_cluster = best.unit_cluster if step % 2 else kick_units(best.unit_cluster, num_devices, rng)
            unit_cluster = polish_units(unit_cluster, local, unit_load, num_layers, theta, polish_rounds)
        expert_device = place(affinity.cluster_affinity(unit_cluster, num_devices))
        local = affinity.local_mass(expert_device, num_devices)
        unit_cluster = polish_units(unit_cluster, local, unit_load, num_layers, theta, polish_rounds)
        objective = _objective(unit_cluster, local, unit_load, num_layers, theta)
        if objective < best.objective:
            best = CoclusterResult(unit_cluster, expert_device, objective)
    return best


# ----------------------------------------------------------------------------------------------------------
# Algorithm 2: Attention-DP request scheduling


def packed_prompts(
    token_ids: np.ndarray, offsets: np.ndarray, prefill_len: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(packed int[P], prompt_start int64[R+1]): request r's prompt tokens are
    packed[prompt_start[r] : prompt_start[r + 1]], P = sum(prefill_len); offsets int64[R+1], prefill_len int64[R].

    Without a Python loop; when every request is all prompt it is one contiguous slice of token_ids.
    """
    if np.array_equal(prefill_len, np.diff(offsets)):
        return np.asarray(token_ids[offsets[0] : offsets[-1]]), offsets - offsets[0]
    prompt_start = np.concatenate([[0], np.cumsum(prefill_len)])
    gather = np.arange(int(prompt_start[-1])) + np.repeat(offsets[:-1] - prompt_start[:-1], prefill_len)
    return np.asarray(token_ids)[gather], prompt_start


def request_scores(
    token_score: np.ndarray, row_of_token: np.ndarray, token_ids: np.ndarray, offsets: np.ndarray, prefill_len: np.ndarray
) -> np.ndarray:
    """float32[R, D] per-request device scores: the mean over its prompt tokens of token_score rows.

    token_score float[t + 1, D]; row_of_token int[V] (`vocab_row_map`); token_ids int[N]; offsets int[R+1];
    prefill_len int[R]. Requests with an empty prompt score 0 everywhere.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    prefill_len = np.asarray(prefill_len, dtype=np.int64)
    num_requests = len(offsets) - 1
    scores = np.zeros((num_requests, token_score.shape[1]), dtype=np.float32)
    if int(prefill_len.sum()) == 0:
        return scores
    packed, prompt_start = packed_prompts(token_ids, offsets, prefill_len)
    nonempty = prefill_len > 0
    scores[nonempty] = np.add.reduceat(token_score[row_of_token[packed]], prompt_start[:-1][nonempty], axis=0)
    return scores / np.maximum(prefill_len, 1)[:, None].astype(np.float32)


# prompt tokens per request_votes chunk: keeps the per-token work arrays (~0.5 MB each) in cache; measured
# about 2x faster than one pass over 8M tokens (bench/bench_semmoe.py, 1k-token prompts)
VOTE_CHUNK_TOKENS = 1 << 16


def request_votes(
    vocab_device: np.ndarray,
    vocab_weight: np.ndarray,
    token_ids: np.ndarray,
    offsets: np.ndarray,
    prefill_len: np.ndarray,
    num_devices: int,
) -> np.ndarray:
    """float32[R, D] per-request device scores from one weighted vote per prompt token, divided by the prompt length.

    vocab_device int64[V] and vocab_weight float64[V]: each vocabulary id's vote and its weight (the top entry
    of the folded score table, looked up per id once at plan build). One bincount per chunk of requests, so
    the cost is a few nanoseconds per token (the >= 50k requests/s path for 1k-token prompts).
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    prefill_len = np.asarray(prefill_len, dtype=np.int64)
    num_requests = len(offsets) - 1
    scores = np.zeros((num_requests, num_devices), dtype=np.float32)
    if num_requests == 0:
        return scores
    packed, prompt_start = packed_prompts(token_ids, offsets, prefill_len)
    first = 0
    while first < num_requests:
        last = int(np.searchsorted(prompt_start, prompt_start[first] + VOTE_CHUNK_TOKENS, side="right")) - 1
        last = min(max(last, first + 1), num_requests)
        tokens = packed[prompt_start[first] : prompt_start[last]]
        key = vocab_device[tokens]
        key += np.repeat(np.arange(last - first, dtype=np.int64) * num_devices, prefill_len[first:last])
        votes = np.bincount(key, weights=vocab_weight[tokens], minlength=(last - first) * num_devices)
        scores[first:last] = votes.reshape(last - first, num_devices)
        first = last
    return scores / np.maximum(prefill_len, 1)[:, None].astype(np.float32)


def masked_argmax_assign(
    scores: np.ndarray, position: int, taken: np.ndarray, per_rank: int = 1
) -> tuple[np.ndarray, int, np.ndarray]:
    """(ranks int64[R], next position, next taken int64[D]): Algorithm 2's round-robin dev_mask.

    scores float[R, D]. The request stream is cut into windows of W = per_rank x D consecutive requests;
    inside a window each request takes its highest-scoring rank that has fewer than `per_rank` requests of
    the window (ties -> lowest id), so every window spreads exactly per_rank requests on every rank. The
    paper's mask is per_rank = 1: every D consecutive requests cover all D ranks. `position` (0..W-1) and
    `taken` (requests per rank in the open window) carry a partly filled window across calls. Vectorised
    across windows: W passes, pass i places the i-th request of every window.
    """
    num_requests, num_devices = scores.shape
    window_size = per_rank * num_devices
    slot = position + np.arange(num_requests)
    window = slot // window_size
    used = np.zeros((int(window[-1]) + 1 if num_requests else 1, num_devices), dtype=np.int64)
    used[0] = taken
    ranks = np.empty(num_requests, dtype=np.int64)
    for i in range(window_size):
        members = np.arange((i - position) % window_size, num_requests, window_size)  # requests at step i
        if len(members) == 0:
            continue
        masked = np.where(used[window[members]] >= per_rank, -np.inf, scores[members])
        choice = np.argmax(masked, axis=1)
        ranks[members] = choice
        used[window[members], choice] += 1
    next_position = (position + num_requests) % window_size
    next_taken = used[-1].copy() if next_position else np.zeros(num_devices, dtype=np.int64)
    return ranks, next_position, next_taken


def window_exact_assign(
    gain: np.ndarray,
    prompt_len: np.ndarray,
    position: int,
    taken: np.ndarray,
    queued: np.ndarray,
    per_rank: int = 1,
    token_price: float = 0.0,
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """(ranks int64[R], next position, next taken int64[D], next queued float64[D]): the dev_mask, solved exactly.

    gain float[R, D]: what request r is worth on rank d (expected local activations). Same windows as
    `masked_argmax_assign` (W = per_rank x D consecutive requests, exactly per_rank of them per rank, a
    partly filled window carried across calls by `position` / `taken`), but each window's requests take the
    ranks of a maximum-weight assignment (linear_sum_assignment over the window's free slots) instead of
    greedily in arrival order, so an early request no longer takes the rank a later one needs more. A
    per-rank constant cancels inside a window (every rank gets exactly per_rank requests), so no prior is
    needed. token_price > 0 subtracts token_price x prompt_len[r] x (queued_d - mean) / mean from gain[r, d],
    queued float[D] being the prompt tokens assigned so far (updated per window): it steers long prompts off
    ranks that already hold more tokens, keeping the max/mean token load near 1 (request counts stay exact).
    One small assignment per window: O(R / W x W^3).
    """
    num_requests, num_devices = gain.shape
    window_size = per_rank * num_devices
    ranks = np.empty(num_requests, dtype=np.int64)
    taken = np.asarray(taken, dtype=np.int64).copy()
    queued = np.asarray(queued, dtype=np.float64).copy()
    prompt_len = np.asarray(prompt_len, dtype=np.float64)
    start = 0
    while start < num_requests:
        stop = min(start + window_size - position, num_requests)
        slots = np.repeat(np.arange(num_devices), per_rank - taken)  # free slots of the open window
        block = gain[start:stop].astype(np.float64)
        if token_price > 0 and queued.sum() > 0:
            excess = (queued - queued.mean()) / queued.mean()
            block = block - token_price * prompt_len[start:stop, None] * excess[None, :]
        rows, cols = linear_sum_assignment(block[:, slots], maximize=True)
        ranks[start + rows] = slots[cols]
        taken += np.bincount(slots[cols], minlength=num_devices)
        queued += np.bincount(slots[cols], weights=prompt_len[start + rows], minlength=num_devices)
        position = (position + stop - start) % window_size
        if position == 0:
            taken[:] = 0
        start = stop
    return ranks, position, taken, queued


# ----------------------------------------------------------------------------------------------------------
# Algorithm 3: Attention-TP token reshuffling


def align_to_slices(device: np.ndarray, confidence: np.ndarray, num_devices: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(permutation int64[T], counts int64[D], moved): order tokens so each rank's equal slice holds its tokens.

    device int[T] predicted device per token; confidence float[T]. Slices are even_counts(T, D). Each
    device keeps its most confident predicted tokens up to its slice size; the overflow, in (device,
    confidence-descending) order, fills the free slots in device order. moved = tokens not on their
    predicted device. Within a slice tokens keep their original order.
    """
    device = np.asarray(device, dtype=np.int64)
    num_tokens = len(device)
    counts = even_counts(num_tokens, num_devices)
    order = np.lexsort((-np.asarray(confidence, dtype=np.float64), device))
    sorted_device = device[order]
    group_count = np.bincount(device, minlength=num_devices)
    group_start = np.cumsum(group_count) - group_count
    rank_in_group = np.arange(num_tokens) - group_start[sorted_device]
    keep = rank_in_group < counts[sorted_device]
    free = counts - np.minimum(group_count, counts)
    final_sorted = sorted_device.copy()
    final_sorted[~keep] = np.repeat(np.arange(num_devices), free)
    final = np.empty(num_tokens, dtype=np.int64)
    final[order] = final_sorted
    return np.argsort(final, kind="stable"), counts, int((~keep).sum())


def inverse_permutation(permutation: np.ndarray) -> np.ndarray:
    """int64[T] inv with inv[permutation[i]] = i: applying it after the permutation restores the order."""
    inverse = np.empty(len(permutation), dtype=np.int64)
    inverse[np.asarray(permutation)] = np.arange(len(permutation))
    return inverse


# ----------------------------------------------------------------------------------------------------------
# the plan and the system


def fold_dp_scores(mass: np.ndarray, scoring: str) -> np.ndarray:
    """float32[t, D] one layer's contribution to the per-token DP score table from its device mass float[t, D].

    "expected": the mass itself (summed over layers: expected local activations per token / k);
    "confidence": T_p on T (a T_p-weighted vote); "vote": 1 on T (a hard vote).
    """
    if scoring == "expected":
        return mass.astype(np.float32)
    best = np.argmax(mass, axis=1)
    weight = np.ones(len(mass), dtype=np.float32) if scoring == "vote" else mass[np.arange(len(mass)), best]
    out = np.zeros_like(mass, dtype=np.float32)
    out[np.arange(len(mass)), best] = weight
    return out


class SemMoEPlan(Plan):
    """Sem-MoE placement plus the DP request scheduler and the TP token reshuffler.

    Tables: token_vocab int32[t]; row_of_token int32[V]; token_device int16[L, t+1] (T) and token_confidence
    float32[L, t+1] (T_p), row t = OOV fallback (expert popularity); dp_score float32[t+1, D];
    markov_device int16[L, Q] (A) and markov_confidence float32[L, Q] (A_p, on T_p's scale: the token
    confidence below which A wins; see `device_markov_table`), or None when lookback = 0.
    """

    def __init__(
        self,
        placement: Placement,
        parallel: ParallelConfig,
        token_vocab: np.ndarray,
        row_of_token: np.ndarray,
        token_device: np.ndarray,
        token_confidence: np.ndarray,
        dp_score: np.ndarray,
        markov_device: np.ndarray | None = None,
        markov_confidence: np.ndarray | None = None,
        lookback: int = 2,
        load_aware_lambda: float = 0.0,
        dp_window: int = 1,
        dp_scoring: str = "confidence",
        token_frequency: np.ndarray | None = None,
        info: dict | None = None,
        dp_assign: str = "greedy",
        dp_token_price: float = 0.0,
    ):
        self.dp_window = int(dp_window)
        self.dp_scoring = dp_scoring
        self.dp_assign, self.dp_token_price = dp_assign, float(dp_token_price)
        # "expected" score rows sum to the number of layers (device mass per layer); votes sum to <= 1
        self._gain_scale = 1.0 / max(token_device.shape[0], 1) if dp_scoring == "expected" else 1.0
        self.token_vocab = token_vocab
        self.row_of_token = row_of_token
        self.token_device = token_device
        self.token_confidence = token_confidence
        self.dp_score = dp_score
        self.markov_device = markov_device
        self.markov_confidence = markov_confidence
        self.lookback = int(lookback) if markov_device is not None else 0
        self.load_aware_lambda = float(load_aware_lambda)
        self._expert_device = placement.expert_device()
        # "vote" / "confidence": each vocabulary id casts one vote for the top device of its folded score row
        # (weight: the row's top share for "confidence", 1 for "vote"; 0 for rows without any score, e.g. OOV)
        top = np.argmax(dp_score, axis=1)
        top_score = dp_score[np.arange(len(dp_score)), top]
        row_total = dp_score.sum(axis=1)
        weight = top_score / np.maximum(row_total, 1e-30) if dp_scoring == "confidence" else (row_total > 0).astype(np.float32)
        self._vocab_device = top.astype(np.int64)[row_of_token]
        self._vocab_weight = weight.astype(np.float64)[row_of_token]
        # the score of the average profile token: subtracted so a request is placed by what sets it apart,
        # not by the devices that every request leans to (hot experts of stop words, punctuation, ...)
        self.token_frequency = token_frequency
        self.dp_prior = np.zeros(parallel.devices)
        if token_frequency is not None and token_frequency.sum() > 0:
            share = token_frequency / token_frequency.sum()
            if dp_scoring == "expected":
                self.dp_prior = share @ dp_score.astype(np.float64)
            else:
                self.dp_prior = np.bincount(top, weights=share * weight, minlength=parallel.devices)
        super().__init__(placement, parallel, info)

    def reset(self) -> None:
        super().reset()
        self._position = 0
        self._taken = np.zeros(self.parallel.devices, dtype=np.int64)
        self._queued = np.zeros(self.parallel.devices, dtype=np.float64)
        self._assigned_requests = 0
        self.info["align_moved_tokens"] = 0
        self.info["shuffled_tokens"] = 0
        self.info["align_moved_share"] = 0.0

    def _check_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        token_ids = np.asarray(token_ids)
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= len(self.row_of_token)):
            raise TraceError(
                f"token id {int(token_ids.max())} is outside the plan's vocabulary of {len(self.row_of_token)} ids; "
                "fit the plan on a profile of the same model."
            )
        return token_ids

    def assign_requests(self, token_ids: np.ndarray, offsets: np.ndarray, prefill_len: np.ndarray) -> np.ndarray:
        """int64[R] DP rank per request (Algorithm 2); requests stay on their rank for decode."""
        token_ids = self._check_tokens(token_ids)
        if self.dp_scoring == "expected":
            scores = request_scores(self.dp_score, self.row_of_token, token_ids, offsets, prefill_len)
        else:
            scores = request_votes(
                self._vocab_device, self._vocab_weight, token_ids, offsets, prefill_len, self.parallel.devices
            )
        if len(scores) == 0:
            return np.zeros(0, dtype=np.int64)
        if self.dp_assign == "exact" and self.load_aware_lambda == 0:
            # gain: the request's expected local activations per layer (tokens), without the prior: a per-rank
            # constant cancels inside a window, and prior x prompt length would not
            prompt_len = np.asarray(prefill_len, dtype=np.float64)
            gain = scores * (prompt_len * self._gain_scale)[:, None]
            ranks, self._position, self._taken, self._queued = window_exact_assign(
                gain, prompt_len, self._position, self._taken, self._queued, self.dp_window, self.dp_token_price
            )
            return ranks
        scores = scores - self.dp_prior.astype(np.float32)
        if self.load_aware_lambda > 0:
            return self._assign_load_aware(scores, np.asarray(prefill_len, dtype=np.float64))
        ranks, self._position, self._taken = masked_argmax_assign(scores, self._position, self._taken, self.dp_window)
        return ranks

    def _assign_load_aware(self, scores: np.ndarray, prompt_len: np.ndarray) -> np.ndarray:
        # sequential by nature: each choice changes the queues the next request sees (one loop per request).
        # The plan never learns when a request finishes, so "queued" = prompt tokens assigned so far.
        ranks = np.empty(len(scores), dtype=np.int64)
        window_size = self.dp_window * self.parallel.devices
        for r, score in enumerate(scores):
            mean_len = max((self._queued.sum() + prompt_len[r]) / (self._assigned_requests + 1), 1.0)
            adjusted = score - self.load_aware_lambda * (self._queued - self._queued.min()) / mean_len
            adjusted[self._taken >= self.dp_window] = -np.inf
            rank = int(np.argmax(adjusted))
            ranks[r] = rank
            self._queued[rank] += prompt_len[r]
            self._assigned_requests += 1
            self._taken[rank] += 1
            self._position = (self._position + 1) % window_size
            if self._position == 0:
                self._taken[:] = 0
        return ranks

    def predicted_devices(
        self, token_ids: np.ndarray, layer: int, prev_experts: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(device int64[T], confidence float32[T]): T / T_p, or A / A_p where the Markov table is more confident.

        prev_experts int[T, h', k] is chronological (column -1 = layer - 1), as repro.eval passes it. A_p is the
        break-even T_p of the token's history row, so `A_p > T_p` reads "this token's own table is weaker than
        the history's prediction was on the profile"; the returned confidence (max of the two) orders align.
        """
        rows = self.row_of_token[self._check_tokens(token_ids)]
        device = self.token_device[layer, rows].astype(np.int64)
        confidence = self.token_confidence[layer, rows]
        depth = min(self.lookback, layer)
        # the table's rows at this layer index exactly `depth` previous devices: a shorter history is unusable
        if depth and prev_experts is not None and np.shape(prev_experts)[1] >= depth:
            prev_experts = np.asarray(prev_experts)
            history = np.stack(
                [
                    majority_device(prev_experts[:, j], self._expert_device[layer - depth + i], self.parallel.devices)
                    for i, j in enumerate(range(prev_experts.shape[1] - depth, prev_experts.shape[1]))
                ],
                axis=1,
            )
            keys = history_keys(history, self.parallel.devices)
            markov_confidence = self.markov_confidence[layer, keys]
            use_markov = markov_confidence > confidence  # Algorithm 3: where(T_p > A_p, T, A), ties -> T
            device = np.where(use_markov, self.markov_device[layer, keys], device)
            confidence = np.maximum(confidence, markov_confidence)
        return device, confidence

    def shuffle_tokens(
        self, token_ids: np.ndarray, layer: int, prev_experts: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(permutation int64[T], counts int64[D]) for the shuffled reduce-scatter before MoE layer `layer`."""
        device, confidence = self.predicted_devices(token_ids, layer, prev_experts)
        permutation, counts, moved = align_to_slices(device, confidence, self.parallel.devices)
        self.info["align_moved_tokens"] += moved
        self.info["shuffled_tokens"] += len(device)
        self.info["align_moved_share"] = self.info["align_moved_tokens"] / max(self.info["shuffled_tokens"], 1)
        return permutation, counts

    def save(self, directory: str | Path) -> None:
        """Placement and info (base), plus every table as .npy (no pickle) and the scalars as semmoe.json."""
        super().save(directory)
        directory = Path(directory)
        tables = {
            "token_vocab": self.token_vocab,
            "row_of_token": self.row_of_token,
            "token_device": self.token_device,
            "token_confidence": self.token_confidence,
            "dp_score": self.dp_score,
            "token_frequency": self.token_frequency,
        }
        if self.markov_device is not None:
            tables.update(markov_device=self.markov_device, markov_confidence=self.markov_confidence)
        for name, array in tables.items():
            if array is None:
                continue
            np.save(directory / f"{name}.npy", np.ascontiguousarray(array), allow_pickle=False)
        scalars = {
            "lookback": self.lookback,
            "load_aware_lambda": self.load_aware_lambda,
            "dp_window": self.dp_window,
            "dp_scoring": self.dp_scoring,
            "dp_assign": self.dp_assign,
            "dp_token_price": self.dp_token_price,
        }
        (directory / "semmoe.json").write_text(json.dumps(scalars))

    @classmethod
    def load(cls, directory: str | Path, parallel: ParallelConfig, num_experts: int) -> SemMoEPlan:
        """Read a plan written by `save` (arrays with allow_pickle=False)."""
        directory = Path(directory)

        def read(name: str):
            path = directory / f"{name}.npy"
            return np.load(path, allow_pickle=False) if path.exists() else None

        try:
            scalars = json.loads((directory / "semmoe.json").read_text())
            info = json.loads((directory / "plan_info.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{directory} does not hold a saved Sem-MoE plan ({e}); write one with plan.save().") from e
        placement = Placement(read("physical_to_logical"), parallel.devices, num_experts)
        return cls(
            placement, parallel, read("token_vocab"), read("row_of_token"), read("token_device"),
            read("token_confidence"), read("dp_score"), read("markov_device"), read("markov_confidence"),
            scalars["lookback"], scalars["load_aware_lambda"], scalars["dp_window"], scalars["dp_scoring"],
            read("token_frequency"), info, scalars.get("dp_assign", "greedy"), scalars.get("dp_token_price", 0.0),
        )


class SemMoE:
    """Sem-MoE: co-clustered placement + Algorithm 2 (DP) + Algorithm 3 (TP); see the module docstring.

    cluster_units: "auto" (token rows per layer under Attention-TP, profile requests shared by all layers
    under Attention-DP), or force "tokens" / "requests". prompt_only: profile prompt tokens only (the paper
    profiles prompts). embeddings_path: optional .npy float[V, H] input-embedding matrix for the
    nearest-neighbour OOV fallback (without it unseen ids use each layer's expert popularity).
    """

    name = "semmoe"

    def __init__(
        self,
        theta: float = 0.5,
        alpha: float = 1.0,
        beta: float = 1.0,
        gamma: float = 1.0,
        n_steps: int = 8,
        ft_steps: int = 64,
        lookback: int = 2,
        dp_scoring: str = "confidence",
        load_aware_lambda: float = 0.0,
        dp_window: int = 1,
        dp_assign: str = "exact",
        dp_token_price: float = 1.5,
        max_units: int = 8192,
        price_iters: int = 12,
        exact_expert_step: bool = True,
        n_starts: int = 4,
        polish_rounds: int = 64,
        polish_kicks: int = 32,
        cluster_units: str = "auto",
        prompt_only: bool = False,
        embeddings_path: str | None = None,
    ):
        if not 0.0 < float(theta) < 1.0:
            raise ConfigError(f"system.params.theta must be strictly between 0 and 1, got {theta}.")
        if min(alpha, beta, gamma) < 0:
            raise ConfigError(f"system.params alpha, beta, gamma must be >= 0, got {alpha}, {beta}, {gamma}.")
        if int(n_steps) < 1 or int(ft_steps) < 0 or int(price_iters) < 1:
            raise ConfigError(
                f"system.params.n_steps and price_iters must be >= 1 and ft_steps >= 0, got {n_steps}, {price_iters}, {ft_steps}."
            )
        if int(n_starts) < 1:
            raise ConfigError(f"system.params.n_starts must be >= 1, got {n_starts}.")
        if int(polish_rounds) < 0 or int(polish_kicks) < 0:
            raise ConfigError(
                f"system.params.polish_rounds and polish_kicks must be >= 0 (0 = off), got {polish_rounds}, {polish_kicks}."
            )
        if int(lookback) < 0:
            raise ConfigError(f"system.params.lookback must be >= 0, got {lookback}.")
        if dp_scoring not in DP_SCORINGS:
            raise ConfigError(f"system.params.dp_scoring must be one of {DP_SCORINGS}, got {dp_scoring!r}.")
        if load_aware_lambda < 0:
            raise ConfigError(f"system.params.load_aware_lambda must be >= 0, got {load_aware_lambda}.")
        if int(max_units) < 1:
            raise ConfigError(f"system.params.max_units must be >= 1, got {max_units}.")
        if dp_assign not in DP_ASSIGNS:
            raise ConfigError(f"system.params.dp_assign must be one of {DP_ASSIGNS}, got {dp_assign!r}.")
        if float(dp_token_price) < 0:
            raise ConfigError(f"system.params.dp_token_price must be >= 0, got {dp_token_price}.")
        if int(dp_window) < 1:
            raise ConfigError(f"system.params.dp_window must be >= 1 (requests per rank per mask window), got {dp_window}.")
        if cluster_units not in CLUSTER_UNITS:
            raise ConfigError(f"system.params.cluster_units must be one of {CLUSTER_UNITS}, got {cluster_units!r}.")
        self.theta, self.alpha, self.beta, self.gamma = float(theta), float(alpha), float(beta), float(gamma)
        self.n_steps, self.ft_steps, self.lookback = int(n_steps), int(ft_steps), int(lookback)
        self.price_iters, self.max_units = int(price_iters), int(max_units)
        self.exact_expert_step = bool(exact_expert_step)
        self.n_starts, self.polish_rounds, self.polish_kicks = int(n_starts), int(polish_rounds), int(polish_kicks)
        self.dp_scoring, self.load_aware_lambda, self.dp_window = dp_scoring, float(load_aware_lambda), int(dp_window)
        self.dp_assign, self.dp_token_price = dp_assign, float(dp_token_price)
        self.cluster_units, self.prompt_only, self.embeddings_path = cluster_units, bool(prompt_only), embeddings_path

    def _solver_args(self) -> dict:
        return dict(
            theta=self.theta, alpha=self.alpha, beta=self.beta, gamma=self.gamma,
            n_steps=self.n_steps, ft_steps=self.ft_steps, price_iters=self.price_iters,
            exact_expert_step=self.exact_expert_step, n_starts=self.n_starts,
            polish_rounds=self.polish_rounds, polish_kicks=self.polish_kicks,
        )

    def fit(self, profile: RoutingTrace, parallel: ParallelConfig, rng: np.random.Generator) -> SemMoEPlan:
        """Algorithm 1 on the profile, then the online tables for the resulting placement."""
        started = time.perf_counter()
        expert_device, info = self.solve_placement(profile, parallel, rng)
        plan = self.plan_for_placement(profile, parallel, expert_device, info)
        plan.info["fit_seconds"] = time.perf_counter() - started
        return plan

    def _profile_rows(self, profile: RoutingTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(kept token indices int64[N'], token_vocab int32[t], token_row int64[N']) of the profile."""
        keep = profile_tokens(profile, self.prompt_only)
        if len(keep) == 0:
            raise TraceError(
                f"the profile split of {profile.meta.model!r} has no {'prompt ' if self.prompt_only else ''}tokens "
                "in any MoE layer; profile on more requests (or set system.params.prompt_only=false)."
            )
        token_vocab, token_row = encode_tokens(profile.token_ids[keep])
        return keep, token_vocab, token_row

    def solve_placement(
        self, profile: RoutingTrace, parallel: ParallelConfig, rng: np.random.Generator
    ) -> tuple[np.ndarray, dict]:
        """(expert_device int64[L, E] with exactly E/D experts per device per layer, solver info)."""
        started = time.perf_counter()
        meta = profile.meta
        num_experts, top_k, num_devices, num_layers = meta.num_experts, meta.top_k, parallel.devices, profile.num_layers
        parallel.check_experts(num_experts)  # theta, n_steps, ft_steps were checked in __init__
        keep, token_vocab, token_row = self._profile_rows(profile)
        units = self.cluster_units
        if units == "auto":
            units = "requests" if parallel.attention == "dp" else "tokens"
        expert_device = np.empty((num_layers, num_experts), dtype=np.int64)
        objectives: list[float] = []
        if units == "requests":
            unit_of_token = profile.request_of_token()[keep]
            num_units = profile.num_requests
        else:
            unit_of_token, num_units = token_row, len(token_vocab)
        unit_load = np.bincount(unit_of_token, minlength=num_units).astype(np.float64)  # a_j or request tokens
        # the solver sees the `max_units` heaviest units; lighter ones (rare token ids, short requests) still
        # get tables from the resulting placement, they just do not steer it
        solver_units = np.sort(np.argsort(-unit_load, kind="stable")[: self.max_units])
        solver_units = solver_units[unit_load[solver_units] > 0]
        unit_index = np.full(num_units, -1, dtype=np.int64)
        unit_index[solver_units] = np.arange(len(solver_units))
        solver_tokens = unit_index[unit_of_token] >= 0
        solver_unit_of_token = unit_index[unit_of_token[solver_tokens]]

        def layer_coo(layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            experts = profile.experts[keep[solver_tokens], layer]
            return layer_token_expert_coo(solver_unit_of_token, experts, len(solver_units), num_experts)

        def sparse(layers: list[int]) -> SparseAffinity:
            parts = [layer_coo(layer) for layer in layers]
            return SparseAffinity(
                np.repeat(np.arange(len(layers)), [len(p[0]) for p in parts]),
                np.concatenate([p[0] for p in parts]),
                np.concatenate([p[1] for p in parts]),
                np.concatenate([p[2] for p in parts]).astype(np.float64) / top_k,  # token units
                len(layers), len(solver_units), num_experts,
            )

        if units == "requests":  # one clustering shared by every layer
            result = balanced_cocluster(sparse(list(range(num_layers))), unit_load[solver_units], num_devices, rng, **self._solver_args())
            expert_device[:] = result.expert_device
            objectives.append(result.objective)
        else:  # one clustering per layer keeps memory at one layer's nonzeros
            for layer in range(num_layers):
                result = balanced_cocluster(sparse([layer]), unit_load[solver_units], num_devices, rng, **self._solver_args())
                expert_device[layer] = result.expert_device[0]
                objectives.append(result.objective)
        info = {
            "cluster_units": units,
            "objective": float(np.sum(objectives)),
            "objective_per_layer": [float(x) for x in objectives] if units == "tokens" else [],
            "profile_token_rows": len(token_vocab),
            "solver_units": len(solver_units),
            "solver_load_share": float(unit_load[solver_units].sum() / unit_load.sum()),
            "solver_seconds": time.perf_counter() - started,
        }
        return expert_device, info

    def plan_for_placement(
        self, profile: RoutingTrace, parallel: ParallelConfig, expert_device: np.ndarray, info: dict | None = None
    ) -> SemMoEPlan:
        """The online plan (tables T, T_p, dp_score, A, A_p) for a given expert_device int[L, E] placement.

        Also used by system=semmoe_exact, whose placement comes from the exact MILP.
        """
        meta = profile.meta
        num_experts, num_devices, num_layers = meta.num_experts, parallel.devices, profile.num_layers
        expert_device = np.asarray(expert_device, dtype=np.int64)
        if expert_device.shape != (num_layers, num_experts):
            raise ConfigError(
                f"expert_device has shape {expert_device.shape}; the profile needs ({num_layers}, {num_experts})."
            )
        check_markov_size(num_devices, self.lookback)
        placement = Placement.from_expert_device(expert_device, num_devices)
        keep, token_vocab, token_row = self._profile_rows(profile)
        num_rows = len(token_vocab)
        token_device = np.empty((num_layers, num_rows + 1), dtype=np.int16)
        token_confidence = np.empty((num_layers, num_rows + 1), dtype=np.float32)
        dp_score = np.zeros((num_rows + 1, num_devices), dtype=np.float32)
        for layer in range(num_layers):
            experts = np.asarray(profile.experts[keep, layer])
            mass = np.empty((num_rows + 1, num_devices), dtype=np.float32)
            mass[:num_rows] = routed_device_mass(token_row, experts, num_rows, expert_device[layer], num_devices)
            # row t, the OOV fallback: the layer's expert popularity, folded onto devices
            device_load = np.bincount(expert_device[layer][experts.ravel()], minlength=num_devices)
            mass[num_rows] = device_load / device_load.sum()
            token_device[layer] = np.argmax(mass, axis=1)
            token_confidence[layer] = mass.max(axis=1)
            dp_score += fold_dp_scores(mass, self.dp_scoring)
        dp_score[num_rows] = 0.0  # an unseen token says nothing about where its request belongs
        token_frequency = np.bincount(token_row, minlength=num_rows + 1).astype(np.float32)
        markov_device = markov_confidence = None
        if self.lookback > 0:
            markov_device, markov_confidence = device_markov_table(
                profile, expert_device, num_devices, self.lookback, tokens=keep
            )
        embeddings = None if self.embeddings_path is None else np.load(self.embeddings_path, allow_pickle=False)
        row_of_token = vocab_row_map(token_vocab, meta.vocab_size, embeddings)
        info = dict(info or {})
        info["dp_scoring"] = self.dp_scoring
        return SemMoEPlan(
            placement, parallel, token_vocab, row_of_token, token_device, token_confidence, dp_score,
            markov_device, markov_confidence, self.lookback, self.load_aware_lambda, self.dp_window, self.dp_scoring,
            token_frequency, info, self.dp_assign, self.dp_token_price,
        )
