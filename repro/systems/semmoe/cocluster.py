"""Sem-MoE Algorithm 1 (arXiv 2503.04398): balanced token-expert co-clustering, offline, on a profile.

Legend: L MoE layers, E experts per layer (the paper's N), D devices = EP ranks (the paper's E), t distinct
profiled token ids (rows of the paper's per-layer instance), u clustering units (token rows or profile
requests), k experts per token.

`balanced_cocluster` alternates expert placement (`place_experts`: greedy by hotness with the score
alpha * expert-expert co-activation share + beta * unit-cluster affinity share - gamma * overload beyond the
device's fair share, exactly E/D experts per device, then `ft_steps` random pairwise swaps kept when they
gain, then by default the exact linear-assignment version of that step) and unit clustering
(`assign_units`: the better of a Lagrangian price iteration on the paper's |load - S/D| term and the paper's
capacity mask, `capacity_assign`), for `n_steps` rounds after an initial round from expert co-activation
alone; the round with the lowest paper objective L (`coclustering_objective`: theta * imbalance +
(1 - theta) * remote activations) is kept. Beyond the paper, on instances small enough for it
(`SEARCH_CELLS`): up to `n_starts` runs of that alternation, then `refine_cocluster`, a local search on the
exact L (unit moves and swaps: `polish_units`; kicks: `kick_units`, `swap_random_experts`; re-placed
experts); it brought 12-token planted instances from 15-60 % to within ~1 % of the exact MILP optimum
(repro.systems.milp). At 8192 units x 32 devices it is one start plus one polish.

The affinity is a `SparseAffinity` (COO float[L, u, E]); what the units are (token rows per layer under
Attention-TP, profile requests shared by all layers under Attention-DP) is chosen by the caller
(repro.systems.semmoe.system.SemMoE.solve_placement).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numba
import numpy as np
import scipy.sparse as sp
from scipy.optimize import linear_sum_assignment

from repro.errors import ConfigError, TraceError

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
    """COO affinity float[L, u, E]: unit[i] activates expert e value[i] times (load units) in layer l, where
    layer_expert[i] = l * E + e; entries are sorted by layer (layer_start[l] is layer l's first entry).

    Profile tables are sparse (a token row touches few experts), so a solver round costs O(nnz + u x D +
    L x D x E) instead of O(u x E x D): what makes a 58-layer, 256-expert instance feasible on 2 cores. Each
    entry takes 16 bytes (int32 unit and layer-expert, float64 value): at 8192 request units x 58 layers x 256
    experts the table itself is what a production-size Attention-DP fit holds.
    """

    unit: np.ndarray  # int32[nnz]
    layer_expert: np.ndarray  # int32[nnz]
    value: np.ndarray  # float64[nnz]
    layer_start: np.ndarray  # int64[L + 1]
    num_layers: int
    num_units: int
    num_experts: int

    @classmethod
    def from_coo(cls, layer, unit, expert, value, num_layers: int, num_units: int, num_experts: int) -> SparseAffinity:
        """From int[nnz] layer (non-decreasing), unit, expert and float[nnz] value."""
        layer = np.asarray(layer)
        if len(layer) and np.any(np.diff(layer) < 0):
            raise ConfigError("SparseAffinity entries must be sorted by layer.")
        if num_units >= 2**31 or num_layers * num_experts >= 2**31:
            raise ConfigError(f"{num_units} units or {num_layers} x {num_experts} layer-experts overflow int32 indices.")
        layer_expert = (layer * num_experts + np.asarray(expert)).astype(np.int32)
        layer_start = np.searchsorted(layer, np.arange(num_layers + 1))
        return cls(np.asarray(unit).astype(np.int32), layer_expert, np.asarray(value, dtype=np.float64), layer_start,
                   num_layers, num_units, num_experts)

    @classmethod
    def from_dense(cls, affinity: np.ndarray) -> SparseAffinity:
        """From float[L, u, E]."""
        affinity = np.asarray(affinity)
        if affinity.ndim != 3:
            raise ConfigError(f"affinity must be a [layers, units, experts] array, got shape {affinity.shape}.")
        layer, unit, expert = np.nonzero(affinity)
        return cls.from_coo(layer, unit, expert, affinity[layer, unit, expert], *affinity.shape)

    @property
    def layer(self) -> np.ndarray:
        """int64[nnz] (computed: a temporary the size of the table)."""
        return self.layer_expert // self.num_experts

    @property
    def expert(self) -> np.ndarray:
        """int64[nnz] (computed)."""
        return self.layer_expert % self.num_experts

    def hotness(self) -> np.ndarray:
        """float64[L, E] activations per expert."""
        flat = np.bincount(self.layer_expert, weights=self.value, minlength=self.num_layers * self.num_experts)
        return flat.reshape(self.num_layers, self.num_experts)

    def coactivation(self, unit_load: np.ndarray) -> np.ndarray:
        """float64[L, E, E] sum_u A[u, e] A[u, e'] / load_u per layer, zero diagonal (sparse products)."""
        out = np.empty((self.num_layers, self.num_experts, self.num_experts))
        for layer in range(self.num_layers):
            sel = slice(self.layer_start[layer], self.layer_start[layer + 1])
            unit = self.unit[sel]
            scale = self.value[sel] / np.sqrt(np.maximum(unit_load[unit], 1e-12))
            expert = self.layer_expert[sel] - layer * self.num_experts
            a = sp.csr_matrix((scale, (unit, expert)), shape=(self.num_units, self.num_experts))
            out[layer] = (a.T @ a).toarray()
        idx = np.arange(self.num_experts)
        out[:, idx, idx] = 0.0
        return out

    def cluster_affinity(self, unit_cluster: np.ndarray, num_devices: int) -> np.ndarray:
        """float64[L, D, E] activations of expert e by the units of cluster d."""
        num_layer_experts = self.num_layers * self.num_experts
        flat = _scatter_sum(self.unit, np.asarray(unit_cluster, dtype=np.int64), num_layer_experts, self.layer_expert,
                            np.arange(num_layer_experts), self.value, num_devices * num_layer_experts)
        return np.ascontiguousarray(flat.reshape(num_devices, self.num_layers, self.num_experts).transpose(1, 0, 2))

    def local_mass(self, expert_device: np.ndarray, num_devices: int) -> np.ndarray:
        """float64[u, D] mass of each unit's activations hosted on each device, summed over layers."""
        flat = _scatter_sum(self.unit, np.arange(self.num_units), num_devices, self.layer_expert,
                            np.ascontiguousarray(expert_device, dtype=np.int64).ravel(), self.value,
                            self.num_units * num_devices)
        return flat.reshape(self.num_units, num_devices)


@numba.njit(cache=True)
def _scatter_sum(major, major_of, stride, minor, minor_of, value, size):  # pragma: no cover (compiled)
    """float64[size]: out[major_of[major[i]] * stride + minor_of[minor[i]]] += value[i], i in order. Equals
    np.bincount(keys, weights=value) to the last bit (the same sequential sums) without the nnz-sized key and
    lookup temporaries, which at production size are as large as the affinity table itself."""
    out = np.zeros(size)
    for i in range(len(value)):
        out[major_of[major[i]] * stride + minor_of[minor[i]]] += value[i]
    return out


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
    O(E^3) per layer); on replayed OLMoE routing (3,000 MMLU requests, layer_coupling 0.5) it raised DP LAR
    at EP4 on the validate split from 0.2594 to 0.2673 (and cut the expert load max/mean 1.383 -> 1.248).
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
# beyond the paper: the expert-load post-pass (issue 17 item 2)


def check_expert_load_cap(cap: float | None) -> float | None:
    """The cap as a float, None when off (null or 0); raise ConfigError for a cap below 1 (max/mean >= 1)."""
    if cap is None or float(cap) == 0.0:
        return None
    if not float(cap) >= 1.0:
        raise ConfigError(
            f"system.params.expert_load_cap must be null / 0 (off) or a max/mean expert load >= 1, got {cap}."
        )
    return float(cap)


def balance_expert_load(
    expert_device: np.ndarray,
    expert_load: np.ndarray,
    local_gain: np.ndarray,
    cap: float | None,
    same_group: np.ndarray | None = None,
    max_swaps_per_layer: int | None = None,
) -> tuple[np.ndarray, int]:
    """(expert_device int64[L, E], swaps made): pairwise expert swaps per layer until the busiest device's load
    is <= cap x the mean device load, each swap the one that loses the least local mass per unit of load it
    takes off the busiest device.

    expert_device int[L, E] (E/D experts per device); expert_load float[L, E] profile activations per expert;
    local_gain float[L, D, E] activations of expert e by the units clustered to device d (what placing e on d
    makes local: `SparseAffinity.cluster_affinity`); cap None = off (returns a copy, 0 swaps); same_group
    bool[D, D] which device pairs may swap (default all; the hierarchical solver keeps swaps inside a node).
    A swap of e1 on the busiest device d1 with a lighter e2 on d2 is a candidate only when both devices end below
    d1's load before it, so no layer's maximum device load ever rises and the experts per device stay E/D.
    Stops at the cap, when no candidate lowers d1's load, or after max_swaps_per_layer (default 4 x E) swaps.
    Why: without replicas a device's expert load does not depend on the request scheduler, and the
    co-clustering piles co-activated hot experts on one device (replay_olmoe, validate, EP 8: expert load
    max/mean 1.48 vs vanilla EP's 1.18), so the busiest device's expert compute and receives set the layer's time.
    Cost O(swaps x E^2 / D) per layer.
    """
    expert_device = np.array(expert_device, dtype=np.int64)
    cap = check_expert_load_cap(cap)
    if cap is None:
        return expert_device, 0
    expert_load = np.asarray(expert_load, dtype=np.float64)
    num_layers, num_experts = expert_device.shape
    num_devices = local_gain.shape[1]
    limit = 4 * num_experts if max_swaps_per_layer is None else int(max_swaps_per_layer)
    swaps = 0
    for layer in range(num_layers):
        device, load_e, gain = expert_device[layer], expert_load[layer], local_gain[layer]
        load = np.bincount(device, weights=load_e, minlength=num_devices)
        target = cap * load.mean()
        tol = 1e-9 * max(load.sum(), 1.0)
        for _ in range(limit):
            busiest = int(np.argmax(load))
            if load[busiest] <= target + tol:
                break
            mine, others = np.flatnonzero(device == busiest), np.flatnonzero(device != busiest)
            other_device = device[others]
            moved = load_e[mine][:, None] - load_e[others][None, :]  # [c, E - c] load leaving the busiest device
            pair_max = np.maximum(load[busiest] - moved, load[other_device][None, :] + moved)
            reduction = load[busiest] - pair_max
            lost = (gain[busiest, mine][:, None] + gain[other_device, others][None, :]
                    - gain[other_device[None, :], mine[:, None]] - gain[busiest, others][None, :])
            valid = reduction > tol
            if same_group is not None:
                valid &= same_group[busiest, other_device][None, :]
            if not valid.any():
                break
            # least loss per unit of load taken off; ties (e.g. zero loss) to the larger reduction
            cost = np.where(valid, lost / np.where(valid, reduction, 1.0), np.inf)
            best = np.flatnonzero(cost == cost.min())
            i, j = np.unravel_index(best[np.argmax(reduction.ravel()[best])], cost.shape)
            e1, e2, d2 = mine[i], others[j], other_device[j]
            device[e1], device[e2] = d2, busiest
            load[busiest] -= moved[i, j]
            load[d2] += moved[i, j]
            swaps += 1
    return expert_device, swaps
