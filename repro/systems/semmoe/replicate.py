"""Beyond the paper: replication-aware Sem-MoE (`system=semmoe_replicated`) and its "hottest experts
everywhere" baseline (`system=semmoe_hottest`).

Legend: L MoE layers, E experts per layer, D devices, r replicas per device (extra slots), u clustering units
(profile requests under Attention-DP, token rows per layer under Attention-TP), t token rows, k experts per token.

Sem-MoE places exactly E/D experts per device, so with balanced ranks a request (DP) or token (TP) can only be
local to one device's experts. Serving engines already hold redundant slots (SGLang
`--ep-num-redundant-experts`, vLLM / DeepSeek EPLB) but fill them by load alone. Here the r extra slots of each
device are filled jointly with the unit clustering (`replicate_cocluster`), starting from Sem-MoE's
co-clustering at r = 0 (its expert placement stays the primary copy of every expert):
  1. replicas: device d's slots take the r experts, not yet on d, with the most activation mass from the units
     clustered to d (`choose_replicas`): exactly the remote mass one replica per slot turns local;
  2. units: re-clustered for the placement with replicas (`assign_units` + `polish_units` on local mass that
     counts every copy, `present_local_mass`), under the same balance term of the paper's L;
  and back to 1, `rounds` times, keeping the pair with the lowest L. The DP scheduler and TP shuffle then score
a device by every expert present there (`SemMoE.plan_for`). `semmoe_hottest` keeps Sem-MoE's placement and
schedulers but fills each device's r slots with the layer's hottest experts not already on it.

Measured (experiment=replication_dp / _tp, EP 4, r = 2, evaluate split): where request clusters are weak (the
synthetic DeepSeek-V2-Lite router under Attention-DP: r = 0 LAR 0.262 against vanilla 0.250) a cluster's mass
follows global hotness, so the co-clustered replicas equal the hottest ones within 0.002 LAR (0.3526 vs 0.3539);
with token-level clusters (Attention-TP) they win (0.7108 vs 0.7055; tiny model 0.682 vs 0.673). Re-clustering
the units after the replicas (replica_rounds) did not lower L there: round 0 was kept.

`replica_choice="time"` (`time_replicas`) fills the slots greedily by a critical-path proxy instead (busiest
device's expected expert load + a weight x remote activations per device). On the validate split by the time
estimate (conf/system/semmoe_replicated.yaml) it tied the affinity choice in Attention-DP and lost in
Attention-TP, where the locality the affinity replicas buy is what the time pays for; affinity stays the default.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from repro.errors import ConfigError
from repro.parallel import ParallelConfig
from repro.systems.base import Placement
from repro.systems.eplb import expert_activation_counts
from repro.systems.semmoe.cocluster import SparseAffinity, _objective, assign_units, polish_units
from repro.systems.semmoe.system import SemMoE, SemMoEPlan, UnitGroup, check_semmoe_params
from repro.traces import RoutingTrace

REPLICA_CHOICES = ("affinity", "hottest", "time")


def check_replicas(replicas_per_device: int, num_experts: int, num_devices: int) -> None:
    """Raise unless every device can take r distinct experts it does not hold yet (r <= E - E/D)."""
    room = num_experts - num_experts // num_devices
    if replicas_per_device < 0 or replicas_per_device > room:
        raise ConfigError(
            f"system.params.replicas_per_device={replicas_per_device} asks for more replicas per device than the "
            f"{room} experts a device does not already hold (E={num_experts}, D={num_devices}), so some expert would "
            f"get a useless second copy on one device; use 0..{room}."
        )


def present_from(expert_device: np.ndarray, replicas: np.ndarray, num_devices: int) -> np.ndarray:
    """bool[L, E, D] expert e has a copy on device d: its primary device (expert_device int[L, E]) or one of
    the replicas int[L, D, r] (expert ids per device slot)."""
    num_layers, num_experts = expert_device.shape
    present = np.zeros((num_layers, num_experts, num_devices), dtype=bool)
    layer = np.arange(num_layers)[:, None]
    present[layer, np.arange(num_experts)[None, :], expert_device] = True
    r = replicas.shape[2]
    present[
        np.repeat(layer, num_devices * r, axis=1),
        replicas.reshape(num_layers, -1),
        np.tile(np.repeat(np.arange(num_devices), r), (num_layers, 1)),
    ] = True
    return present


def choose_replicas(
    cluster_affinity: np.ndarray, present: np.ndarray, replicas_per_device: int, hotness: np.ndarray
) -> np.ndarray:
    """int64[L, D, r] the r experts each device replicates: those not on d with the largest
    cluster_affinity[l, d, e] (activation mass of the units clustered to d: the remote mass the replica makes
    local), ties by hotness float[L, E] (descending), then expert id. present bool[L, E, D] (primary copies).
    """
    num_layers, num_devices, num_experts = cluster_affinity.shape
    by_hotness = np.argsort(-hotness, axis=1, kind="stable")  # [L, E]
    gain = np.where(present.transpose(0, 2, 1), -np.inf, cluster_affinity)  # [L, D, E]
    gain = np.take_along_axis(gain, by_hotness[:, None, :], axis=2)
    order = np.argsort(-gain, axis=2, kind="stable")[:, :, :replicas_per_device]  # stable: hotter first on ties
    return np.take_along_axis(np.broadcast_to(by_hotness[:, None, :], gain.shape), order, axis=2)


def time_replicas(
    cluster_affinity: np.ndarray, present: np.ndarray, replicas_per_device: int, remote_weight: float
) -> np.ndarray:
    """int64[L, D, r] replicas chosen greedily, one slot at a time, by a critical-path proxy per layer:
    the busiest device's expected expert load + remote_weight x the remote activations per device.

    cluster_affinity float[L, D, E] activations of expert e by the units clustered to device d; present bool[L, E, D]
    (primary copies). Expected loads: a unit's activation is served by its own device when that holds a copy,
    otherwise shared evenly by the expert's copies (the least-loaded dispatch rule's mean); so a replica of a hot
    expert that overloads its device takes load off it (a candidate by the max term) and one of an expert a
    device's units use turns their mass local (the remote term). Each step takes the (device with a free slot,
    expert not on it) of the lowest cost, ties to the one that turns the most mass local. O(r x D x D^2 x E)
    per layer. remote_weight 0: balance only; large: the affinity choice (most remote mass turned local).
    """
    num_layers, num_devices, num_experts = cluster_affinity.shape
    out = np.empty((num_layers, num_devices, replicas_per_device), dtype=np.int64)
    eye = np.eye(num_devices, dtype=bool)[:, :, None]  # [X, D, 1]: candidate device d is device x
    for layer in range(num_layers):
        gain = np.asarray(cluster_affinity[layer], dtype=np.float64)  # [D, E]
        has = present[layer].T.copy()  # [D, E]
        taken = np.zeros(num_devices, dtype=np.int64)
        scale = max(gain.sum(), 1e-30)
        for _ in range(replicas_per_device * num_devices):
            copies = has.sum(axis=0)  # [E]
            remote = np.where(has, 0.0, gain).sum(axis=0)  # [E] activations from devices without a copy
            load = np.where(has, gain + remote / copies, 0.0).sum(axis=1)  # [D]
            new_share = (remote[None, :] - gain) / (copies + 1)[None, :]  # [D, E] remote share per copy after (d, e)
            new_load = (load[:, None, None] + has[:, None, :] * (new_share - remote / copies)[None, :, :]
                        + eye * (gain + new_share)[None, :, :])  # [X, D, E]
            cost = (new_load.max(axis=0) + remote_weight * (remote.sum() - gain) / num_devices) / scale
            valid = ~has & (taken < replicas_per_device)[:, None]
            cost = np.where(valid, cost, np.inf)
            tied = valid & (cost <= cost.min() + 1e-12)
            device, expert = np.unravel_index(np.argmax(np.where(tied, gain, -1.0)), gain.shape)
            out[layer, device, taken[device]] = expert
            has[device, expert] = True
            taken[device] += 1
    return out


def hottest_replicas(hotness: np.ndarray, present: np.ndarray, replicas_per_device: int) -> np.ndarray:
    """int64[L, D, r] each device's r hottest experts (hotness float[L, E]) among those not on it (present
    bool[L, E, D]); the hottest experts thus sit on every device."""
    num_layers, num_experts, num_devices = present.shape
    score = np.broadcast_to(hotness[:, None, :], (num_layers, num_devices, num_experts))
    return choose_replicas(score, present, replicas_per_device, hotness)


def present_local_mass(affinity: SparseAffinity, present: np.ndarray) -> np.ndarray:
    """float64[u, D] mass of each unit's activations with a copy on device d, summed over layers.

    present bool[L, E, D]. Equals `SparseAffinity.local_mass` without replication; one sparse product.
    """
    num_layers, num_experts, num_devices = present.shape
    matrix = sp.csr_matrix(
        (affinity.value, (affinity.unit, affinity.layer_expert)),
        shape=(affinity.num_units, num_layers * num_experts),
    )
    return np.asarray(matrix @ present.reshape(num_layers * num_experts, num_devices).astype(np.float64))


@dataclass
class ReplicaResult:
    """replicas int64[L, D, r]; unit_cluster int64[u]; objective: the paper's L (summed over layers) of the
    pair with replicas counted as local; history: L of every round (round 0: the r = 0 clustering)."""

    replicas: np.ndarray
    unit_cluster: np.ndarray
    objective: float
    history: list


def replicate_cocluster(
    affinity: SparseAffinity,
    unit_load: np.ndarray,
    unit_cluster: np.ndarray,
    expert_device: np.ndarray,
    num_devices: int,
    replicas_per_device: int,
    theta: float = 0.5,
    rounds: int = 4,
    price_iters: int = 12,
    polish_rounds: int = 64,
) -> ReplicaResult:
    """Replicas and unit clusters, alternated from a co-clustering at r = 0.

    affinity float[L, u, E] (`SparseAffinity`); unit_load float[u]; unit_cluster int[u] and expert_device
    int[L, E] (over num_devices devices) the r = 0 solution (kept as every expert's primary copy). Each round
    picks every device's r replicas for the current clusters (`choose_replicas`), then re-clusters the units
    on local mass with replicas counted (`assign_units`, then `polish_units` unless polish_rounds = 0). Returns the (replicas,
    clusters) pair with the lowest L over the rounds, the start's clusters with their replicas included.
    """
    num_layers = expert_device.shape[0]
    hotness = affinity.hotness()
    primary = present_from(expert_device, np.zeros((num_layers, num_devices, 0), dtype=np.int64), num_devices)
    cluster = np.asarray(unit_cluster, dtype=np.int64)
    prices = np.zeros(num_devices)
    best: ReplicaResult | None = None
    history: list[float] = []
    for step in range(1 + rounds):
        replicas = choose_replicas(affinity.cluster_affinity(cluster, num_devices), primary, replicas_per_device, hotness)
        local = present_local_mass(affinity, present_from(expert_device, replicas, num_devices))
        if step:  # step 0 scores the r = 0 clusters with their replicas as they are
            cluster, prices, _ = assign_units(local, unit_load, num_layers, theta, prices, price_iters)
            if polish_rounds:
                cluster = polish_units(cluster, local, unit_load, num_layers, theta, polish_rounds)
        objective = _objective(cluster, local, unit_load, num_layers, theta)
        history.append(objective)
        if best is None or objective < best.objective:
            best = ReplicaResult(replicas, cluster.copy(), objective, [])
    best.history = history
    return best


def replicated_placement(
    expert_device: np.ndarray, replicas: np.ndarray, parallel: ParallelConfig, expert_load: np.ndarray
) -> Placement:
    """Placement with P = E + r x D slots: device d's slots hold its primaries (ascending id) then its replicas.

    expert_device int[L, E] (E/D per device); replicas int[L, D, r]; expert_load float[L, E] profile loads
    (the dispatch rule's least-loaded choice reads them).
    """
    num_layers, num_experts = expert_device.shape
    primaries = np.argsort(expert_device, axis=1, kind="stable").reshape(num_layers, parallel.devices, -1)
    slots = np.concatenate([primaries, replicas], axis=2).reshape(num_layers, -1)
    return Placement(slots, parallel.devices, num_experts, parallel.devices_per_node, expert_load)


class SemMoEReplicated(SemMoE):
    """Sem-MoE with r extra slots per device filled by `replica_choice`: "affinity" (`replicate_cocluster`),
    "hottest" (`hottest_replicas`) or "time" (`time_replicas`, the critical-path proxy with weight
    replica_remote_weight; the r = 0 unit clusters are kept, replica_rounds does not apply).

    replicas_per_device: r (0 gives Sem-MoE's plan exactly). replica_rounds: alternations of replica choice and
    unit re-clustering. Every other parameter is SemMoE's.
    """

    name = "semmoe_replicated"

    def __init__(self, replicas_per_device: int = 0, replica_rounds: int = 4, replica_choice: str = "affinity",
                 replica_remote_weight: float = 1.0, **params):
        check_semmoe_params(self.name, params,
                            ("replicas_per_device", "replica_rounds", "replica_choice", "replica_remote_weight"))
        super().__init__(**params)
        if int(replicas_per_device) < 0:
            raise ConfigError(f"system.params.replicas_per_device must be >= 0, got {replicas_per_device}.")
        if int(replica_rounds) < 0:
            raise ConfigError(f"system.params.replica_rounds must be >= 0, got {replica_rounds}.")
        if replica_choice not in REPLICA_CHOICES:
            raise ConfigError(f"system.params.replica_choice must be one of {REPLICA_CHOICES}, got {replica_choice!r}.")
        self.replicas_per_device, self.replica_rounds = int(replicas_per_device), int(replica_rounds)
        if not float(replica_remote_weight) >= 0:
            raise ConfigError(f"system.params.replica_remote_weight must be >= 0, got {replica_remote_weight}.")
        self.replica_choice, self.replica_remote_weight = replica_choice, float(replica_remote_weight)

    def fit(self, profile: RoutingTrace, parallel: ParallelConfig, rng: np.random.Generator) -> SemMoEPlan:
        """Co-clustering at r = 0, then the replicas (per unit group), then the online tables with replicas."""
        started = time.perf_counter()
        check_replicas(self.replicas_per_device, profile.meta.num_experts, parallel.devices)
        expert_load = expert_activation_counts(profile).astype(np.float64) if self.replicas_per_device else None
        replicas = np.empty((profile.num_layers, parallel.devices, self.replicas_per_device), dtype=np.int64)
        objectives: list[float] = []
        replica_seconds = [0.0]

        def replicate(group: UnitGroup, group_expert_device: np.ndarray) -> None:
            started_group = time.perf_counter()
            layers = list(group.layers)
            no_replicas = np.zeros((len(layers), parallel.devices, 0), dtype=np.int64)
            primary = present_from(group_expert_device, no_replicas, parallel.devices)
            if self.replica_choice == "hottest":
                replicas[layers] = hottest_replicas(expert_load[layers], primary, self.replicas_per_device)
            elif self.replica_choice == "time":
                gain = group.affinity.cluster_affinity(group.unit_cluster, parallel.devices)
                replicas[layers] = time_replicas(gain, primary, self.replicas_per_device, self.replica_remote_weight)
            else:
                result = replicate_cocluster(
                    group.affinity, group.unit_load, group.unit_cluster, group_expert_device, parallel.devices,
                    self.replicas_per_device, self.theta, self.replica_rounds, self.price_iters, self.polish_rounds,
                )
                replicas[layers] = result.replicas
                objectives.append(result.objective)
            replica_seconds[0] += time.perf_counter() - started_group

        expert_device, info = self.cocluster(profile, parallel, rng, replicate if self.replicas_per_device else None)
        info["replicas_per_device"] = self.replicas_per_device
        info["replica_choice"] = self.replica_choice
        if self.replica_choice == "time":
            info["replica_remote_weight"] = self.replica_remote_weight
        if self.replicas_per_device == 0:
            plan = self.plan_for_placement(profile, parallel, expert_device, info)
            plan.info["fit_seconds"] = time.perf_counter() - started
            return plan
        if objectives:
            info["objective_replicated"] = float(np.sum(objectives))
        info["replica_seconds"] = replica_seconds[0]
        placement = replicated_placement(expert_device, replicas, parallel, expert_load)
        plan = self.plan_for(profile, parallel, placement, info)
        plan.info["fit_seconds"] = time.perf_counter() - started
        return plan


class SemMoEHottest(SemMoEReplicated):
    """Baseline at the same memory: Sem-MoE's placement and schedulers, each device's r extra slots holding the
    layer's hottest experts (profile activation counts) it does not already hold."""

    name = "semmoe_hottest"

    def __init__(self, replicas_per_device: int = 0, **params):
        super().__init__(replicas_per_device=replicas_per_device, replica_rounds=0, replica_choice="hottest", **params)
