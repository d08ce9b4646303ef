"""Beyond the paper: topology-aware (multi-node) Sem-MoE co-clustering, `system=semmoe_hierarchical`.

Legend: L MoE layers, E experts per layer, D devices, Nn nodes, G = D / Nn devices per node, u units.

Across nodes the links are several times slower than inside one (NVLink ~900 GB/s per H100 against a ~50 GB/s
NIC), so what matters at scale is the bytes that cross nodes. Flat Sem-MoE clusters units and experts over D
devices and numbers the clusters arbitrarily, so a remote activation crosses nodes about (D - G) / (D - 1) of
the time. `hierarchical_cocluster` does what DeepSeek's hierarchical EPLB does for load, for traffic: it first
co-clusters units and experts over the Nn nodes (E / Nn experts per node, balanced units), minimising
inter-node activations, then, inside each node, co-clusters that node's units and experts over its G devices.
"""

from __future__ import annotations

import numpy as np

from repro.systems.semmoe.cocluster import CoclusterResult, SparseAffinity, _objective, balanced_cocluster


def node_subproblem(
    affinity: SparseAffinity, unit_node: np.ndarray, expert_node: np.ndarray, num_nodes: int, node: int
) -> tuple[SparseAffinity, np.ndarray, np.ndarray]:
    """(affinity float[L, u_n, E_n] of node `node`, its units int[u_n], its experts int[L, E_n]).

    unit_node int[u]; expert_node int[L, E] with exactly E_n = E / Nn experts per node per layer. Keeps the
    activations of the node's units on the node's experts (the rest cross nodes whatever the devices are);
    experts are renumbered per layer by ascending id inside the node.
    """
    num_layers, num_experts = expert_node.shape
    per_node = num_experts // num_nodes
    # stable sort by node keeps ascending ids inside each node's block of per_node experts
    experts = np.argsort(expert_node, axis=1, kind="stable")[:, node * per_node : (node + 1) * per_node]
    units = np.flatnonzero(unit_node == node)
    local_unit = np.full(len(unit_node), -1, dtype=np.int64)
    local_unit[units] = np.arange(len(units))
    local_expert = np.full((num_layers, num_experts), -1, dtype=np.int64)
    np.put_along_axis(local_expert, experts, np.broadcast_to(np.arange(experts.shape[1]), experts.shape), axis=1)
    layer_expert = affinity.layer_expert
    keep = (local_unit[affinity.unit] >= 0) & (expert_node.ravel()[layer_expert] == node)
    sub = SparseAffinity.from_coo(
        layer_expert[keep] // num_experts, local_unit[affinity.unit[keep]], local_expert.ravel()[layer_expert[keep]],
        affinity.value[keep], num_layers, len(units), experts.shape[1],
    )
    return sub, units, experts


def hierarchical_cocluster(
    affinity: SparseAffinity,
    unit_load: np.ndarray,
    num_devices: int,
    devices_per_node: int,
    rng: np.random.Generator,
    theta: float = 0.5,
    **solver_args,
) -> CoclusterResult:
    """Algorithm 1 by node, then by device inside each node (device d is in node d // devices_per_node).

    affinity float[L, u, E]; unit_load float[u]; solver_args as `balanced_cocluster`. Returns unit_cluster
    int64[u] and expert_device int64[L, E] (E / D per device), objective = the paper's flat L of the result
    (over all D devices, so comparable with a flat solution), history = [node-level L, flat L].
    """
    num_nodes = num_devices // devices_per_node
    nodes = balanced_cocluster(affinity, unit_load, num_nodes, rng, theta=theta, **solver_args)
    unit_cluster = np.empty(affinity.num_units, dtype=np.int64)
    expert_device = np.empty((affinity.num_layers, affinity.num_experts), dtype=np.int64)
    for node in range(num_nodes):
        sub, units, experts = node_subproblem(affinity, nodes.unit_cluster, nodes.expert_device, num_nodes, node)
        inner = balanced_cocluster(sub, unit_load[units], devices_per_node, rng, theta=theta, **solver_args)
        unit_cluster[units] = node * devices_per_node + inner.unit_cluster
        np.put_along_axis(expert_device, experts, node * devices_per_node + inner.expert_device, axis=1)
    local = affinity.local_mass(expert_device, num_devices)
    objective = _objective(unit_cluster, local, unit_load, affinity.num_layers, theta)
    return CoclusterResult(unit_cluster, expert_device, objective, [nodes.objective, objective])
