"""DeepSeek's expert-parallel load balancer (EPLB), ported to numpy, as the `eplb` system.

The four pure functions follow deepseek-ai/EPLB `eplb.py` (HEAD d52c72d, global policy with GPU-level packing)
step for step, with the same tie-breaking (stable descending sort; the lightest pack with room, lowest index
on ties; the replica goes to the expert with the largest load per replica, lowest index on ties), so their
outputs match upstream's on inputs without ties. Only the loops differ: ours run over items with all layers
vectorised instead of a Python loop per layer and item.

The system fits EPLB on the profile's per-layer expert activation counts with `num_redundant` extra physical
slots (P = E + num_redundant, P divisible by D; or `replicas_per_device` r, i.e. num_redundant = r x D).
Redundant replicas are served by Placement.dispatch_device()'s static rule (a replica on the token's own
device, else the nearest, least loaded one; loads from the same profile counts). Online: round-robin requests (DP), contiguous token slices (TP).

Legend: X rows solved independently (layers, or layers × nodes), n items per row, m packs, L MoE layers,
E logical experts per layer, P physical slots per layer, G expert groups, Nn nodes, D devices (GPUs),
Xr max replicas of one expert.
"""

from __future__ import annotations

import numpy as np

from repro.errors import ConfigError
from repro.parallel import ParallelConfig
from repro.systems.base import Placement, Plan
from repro.traces import RoutingTrace


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack n weighted items into m packs of exactly n/m items each, greedily balancing pack weights.

    weight float[X, n]; returns (pack_index int[X, n] in 0..m-1, rank_in_pack int[X, n] in 0..n/m-1).
    Items are taken heaviest first; each goes to the lightest pack that still has room.
    """
    num_rows, num_items = weight.shape
    if num_items % num_packs:
        raise ConfigError(f"balanced_packing: {num_items} items do not split into {num_packs} equal packs.")
    items_per_pack = num_items // num_packs
    if items_per_pack == 1:
        return np.broadcast_to(np.arange(num_items), weight.shape).copy(), np.zeros(weight.shape, dtype=np.int64)
    order = np.argsort(-weight, axis=1, kind="stable")  # [X, n] heaviest first
    rows = np.arange(num_rows)
    pack_index = np.full(weight.shape, -1, dtype=np.int64)
    rank_in_pack = np.full(weight.shape, -1, dtype=np.int64)
    pack_weight = np.zeros((num_rows, num_packs))
    pack_items = np.zeros((num_rows, num_packs), dtype=np.int64)
    for step in range(num_items):
        item = order[:, step]
        # full packs are excluded by an infinite weight; argmin picks the lowest index on ties like min()
        pack = np.argmin(np.where(pack_items < items_per_pack, pack_weight, np.inf), axis=1)
        pack_index[rows, item] = pack
        rank_in_pack[rows, item] = pack_items[rows, pack]
        pack_weight[rows, pack] += weight[rows, item]
        pack_items[rows, pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicate n logical experts into `num_physical` slots, minimising the largest load per replica.

    weight float[X, n]; returns (phy2log int[X, num_physical]: logical expert of each slot, the first n slots
    being the identity; replica_rank int[X, num_physical]: 0 for the original, 1.. for copies;
    logical_count int[X, n]: replicas per logical expert, >= 1).
    """
    num_rows, num_logical = weight.shape
    if num_physical < num_logical:
        raise ConfigError(f"replicate_experts: {num_physical} physical slots cannot hold {num_logical} experts.")
    rows = np.arange(num_rows)
    phy2log = np.tile(np.arange(num_physical), (num_rows, 1))
    replica_rank = np.zeros((num_rows, num_physical), dtype=np.int64)
    logical_count = np.ones((num_rows, num_logical), dtype=np.int64)
    for slot in range(num_logical, num_physical):
        expert = np.argmax(weight / logical_count, axis=1)
        phy2log[:, slot] = expert
        replica_rank[:, slot] = logical_count[rows, expert]
        logical_count[rows, expert] += 1
    return phy2log, replica_rank, logical_count


def _inverse(perm: np.ndarray) -> np.ndarray:
    """int[X, n] row-wise inverse permutation."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_experts_hierarchical(
    weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB's hierarchical policy: groups → nodes, replication inside nodes, physical experts → GPUs.

    weight float[L, E]; num_physical P (multiple of num_gpus D); num_groups G divides E and is a multiple of
    num_nodes Nn; D is a multiple of Nn. Returns (phy2log int[L, P], replica_rank int[L, P],
    logical_count int[L, E]); slot p is on GPU p // (P / D).
    """
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_physical // num_gpus
    log_per_node = num_logical // num_nodes

    # step 1: pack expert groups onto nodes (keeps group-limited routing inside a node)
    tokens_per_group = weight.reshape(num_layers, num_groups, group_size).sum(-1)  # [L, G]
    group_pack, group_rank = balanced_packing(tokens_per_group, num_nodes)
    # log2mlog[l, e]: position of logical expert e in the node-major ("middle") order
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size)[:, :, None] + np.arange(group_size)).reshape(
        num_layers, num_logical
    )
    mlog2log = _inverse(log2mlog)

    # step 2: replicate experts within each node; rows are (layer, node) pairs [L·Nn, E/Nn]
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, axis=1).reshape(-1, log_per_node)
    phy2mlog, phy_rank, mlog_count = replicate_experts(tokens_per_mlog, num_physical // num_nodes)

    # step 3: pack physical experts onto the GPUs of their node by load per replica
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlog_count, phy2mlog, axis=1)  # [L·Nn, P/Nn]
    pack_index, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    pphy2phy = _inverse(pack_index * phy_per_gpu + rank_in_pack)

    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)  # [L·Nn, P/Nn]
    pphy2mlog = (pphy2mlog.reshape(num_layers, num_nodes, -1) + (np.arange(num_nodes) * log_per_node)[None, :, None])
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog.reshape(num_layers, -1), axis=1)
    pphy_rank = np.take_along_axis(phy_rank, pphy2phy, axis=1).reshape(num_layers, -1)
    logical_count = np.take_along_axis(mlog_count.reshape(num_layers, -1), log2mlog, axis=1)
    return pphy2log, pphy_rank, logical_count


def rebalance_experts(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB's entry point: hierarchical policy when num_groups % num_nodes == 0, else the global policy.

    weight float[L, E] load per logical expert; num_replicas P (multiple of num_gpus). Returns
    (phy2log int[L, P] logical expert of each physical slot; log2phy int[L, E, Xr] physical slots of each
    logical expert, -1 padded; logical_count int[L, E] replicas per expert).
    """
    weight = np.asarray(weight, dtype=np.float64)
    _check_rebalance(weight, num_replicas, num_groups, num_nodes, num_gpus)
    num_layers, num_logical = weight.shape
    if num_groups % num_nodes == 0:
        phy2log, phy_rank, logical_count = rebalance_experts_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        phy2log, phy_rank, logical_count = rebalance_experts_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    max_count = int(logical_count.max())
    log2phy = np.full((num_layers, num_logical * max_count), -1, dtype=np.int64)
    np.put_along_axis(
        log2phy, phy2log * max_count + phy_rank, np.broadcast_to(np.arange(num_replicas), phy2log.shape), axis=1
    )
    return phy2log, log2phy.reshape(num_layers, num_logical, max_count), logical_count


def _check_rebalance(weight, num_replicas, num_groups, num_nodes, num_gpus) -> None:
    if weight.ndim != 2 or weight.shape[1] < 1:
        raise ConfigError(f"EPLB weight must be 2-D [layers, experts], got shape {weight.shape}.")
    if not (np.all(np.isfinite(weight)) and np.all(weight >= 0)):
        raise ConfigError("EPLB weight has negative or non-finite loads; pass activation counts >= 0.")
    num_logical = weight.shape[1]
    if num_gpus < 1 or num_gpus > num_logical:
        raise ConfigError(f"EPLB: {num_gpus} GPUs for {num_logical} experts; use between 1 and {num_logical} GPUs.")
    if num_replicas < num_logical or num_replicas % num_gpus:
        raise ConfigError(
            f"EPLB: {num_replicas} physical slots must be >= the {num_logical} experts and a multiple of the "
            f"{num_gpus} GPUs; change num_redundant."
        )
    if num_groups < 1 or num_logical % num_groups:
        raise ConfigError(f"EPLB: num_groups={num_groups} must divide the {num_logical} experts.")
    if num_nodes < 1 or num_gpus % num_nodes:
        raise ConfigError(f"EPLB: {num_gpus} GPUs do not split over num_nodes={num_nodes} nodes.")
    if num_groups % num_nodes == 0 and (num_replicas // num_nodes) < (num_logical // num_nodes):
        raise ConfigError("EPLB: too few physical slots per node for the node's experts.")


def expert_activation_counts(trace: RoutingTrace) -> np.ndarray:
    """int64[L, E] how many token activations each expert receives per MoE layer (EPLB's load)."""
    num_experts = trace.meta.num_experts
    # one layer at a time: an int64 copy of the whole [N, L, k] array is gigabytes at DeepSeek-V3 scale
    return np.stack(
        [np.bincount(np.asarray(trace.experts[:, layer]).ravel(), minlength=num_experts) for layer in range(trace.num_layers)]
    ).astype(np.int64)


def device_load(weight: np.ndarray, placement: Placement) -> np.ndarray:
    """float[L, D] load per device when each expert's load splits evenly over its replicas."""
    replicas = placement.replicas()  # [L, E, D]
    per_replica = weight / np.maximum(replicas.sum(axis=2), 1)  # [L, E]
    return np.einsum("le,led->ld", per_replica, replicas)


def mean_max_over_mean(load_LD: np.ndarray) -> float:
    """Mean over layers of max/mean load over devices (load float[L, D]): the profile imbalance in plan.info."""
    return float(np.mean(load_LD.max(1) / np.maximum(load_LD.mean(1), 1e-12)))


class EPLB:
    """DeepSeek EPLB on the profile's expert loads; `num_redundant` extra replicas, static dispatch.

    num_groups: expert groups (DeepSeek-V3 group-limited routing; 1 = no groups). num_nodes: None derives
    ceil(D / parallel.devices_per_node); the hierarchical policy applies when num_groups % num_nodes == 0.
    """

    name = "eplb"

    def __init__(
        self, num_redundant: int = 0, num_groups: int = 1, num_nodes: int | None = None, replicas_per_device: int = 0
    ):
        if num_redundant < 0:
            raise ConfigError(f"system.params.num_redundant must be >= 0, got {num_redundant}.")
        if replicas_per_device < 0:
            raise ConfigError(f"system.params.replicas_per_device must be >= 0, got {replicas_per_device}.")
        if num_redundant and replicas_per_device:
            raise ConfigError(
                f"system.params.num_redundant={num_redundant} and replicas_per_device={replicas_per_device} both size "
                "the redundant slots; set only one (num_redundant = replicas_per_device x parallel.devices)."
            )
        self.num_redundant = int(num_redundant)
        self.replicas_per_device = int(replicas_per_device)
        self.num_groups = int(num_groups)
        self.num_nodes = num_nodes

    def fit(self, profile: RoutingTrace, parallel: ParallelConfig, rng: np.random.Generator) -> Plan:
        num_experts = profile.meta.num_experts
        num_redundant = self.num_redundant + self.replicas_per_device * parallel.devices
        num_slots = num_experts + num_redundant
        parallel.check_experts(num_experts, num_slots)
        num_nodes = self.num_nodes or -(-parallel.devices // parallel.devices_per_node)
        load = expert_activation_counts(profile).astype(np.float64)
        phy2log, _, logical_count = rebalance_experts(load, num_slots, self.num_groups, num_nodes, parallel.devices)
        placement = Placement(phy2log, parallel.devices, num_experts, parallel.devices_per_node, load)
        per_device = device_load(load, placement)
        contiguous = load.reshape(profile.num_layers, parallel.devices, -1).sum(-1) if num_experts % parallel.devices == 0 else None
        info = {
            "num_redundant": num_redundant,
            "replicas_per_device": num_redundant / parallel.devices,
            "num_nodes": num_nodes,
            "policy": "hierarchical" if self.num_groups % num_nodes == 0 else "global",
            "profile_load_imbalance_max_mean": mean_max_over_mean(per_device),
            "max_replicas": int(logical_count.max()),
        }
        if contiguous is not None:
            info["profile_load_imbalance_max_mean_contiguous"] = mean_max_over_mean(contiguous)
        return Plan(placement, parallel, info)
