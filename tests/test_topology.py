"""Topology-aware (multi-node) placement: repro.systems.semmoe.topology, intra/inter-node bytes, the per-level
all-to-all time estimate.

Legend: N tokens, L MoE layers, k experts per token, D devices, E experts, u units, G devices per node.
"""

import numpy as np
import pytest

from repro.engines.layout import ModelLayout
from repro.engines.sglang import check_location
from repro.eval import evaluate
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.systems.semmoe import SparseAffinity
from repro.systems.semmoe.topology import hierarchical_cocluster, node_subproblem
from repro.systems.semmoe.tp import align_to_slices
from repro.traces import TraceMeta, make_trace


def test_node_subproblem_by_hand():
    # 1 layer, 3 units, 4 experts; node 0 = units {0, 2}, experts {1, 3}; node 1 = unit 1, experts {0, 2}
    dense = np.array([[[1.0, 2.0, 0.0, 3.0], [4.0, 0.0, 5.0, 6.0], [0.0, 7.0, 8.0, 9.0]]])
    affinity = SparseAffinity.from_dense(dense)
    unit_node, expert_node = np.array([0, 1, 0]), np.array([[1, 0, 1, 0]])
    sub, units, experts = node_subproblem(affinity, unit_node, expert_node, 2, 0)
    assert units.tolist() == [0, 2] and experts.tolist() == [[1, 3]]
    dense_sub = np.zeros((1, 2, 2))
    dense_sub[sub.layer, sub.unit, sub.expert] = sub.value
    np.testing.assert_array_equal(dense_sub, [[[2.0, 3.0], [7.0, 9.0]]])  # activations to other nodes dropped
    sub, units, experts = node_subproblem(affinity, unit_node, expert_node, 2, 1)
    assert units.tolist() == [1] and experts.tolist() == [[0, 2]]
    assert sorted(sub.value.tolist()) == [4.0, 5.0]


def nested_communities(seed=0, num_requests=96, request_len=32, num_layers=2):
    """E=8 in 4 blocks of 2; request community c (tokens c*10..c*10+9) routes to one expert of its block and,
    half the time, to one of its sibling block c^1 (else the other expert of its own block). Siblings should
    share a node: then no activation crosses nodes."""
    rng = np.random.default_rng(seed)
    community = np.repeat(np.arange(num_requests) % 4, request_len)
    n = len(community)
    token_ids = community * 10 + rng.integers(0, 10, n)
    own = community * 2 + token_ids % 2
    second = np.where(rng.random(n) < 0.5, (community ^ 1) * 2 + rng.integers(0, 2, n), community * 2 + 1 - token_ids % 2)
    experts = np.repeat(np.stack([own, second], axis=1)[:, None, :], num_layers, axis=1)
    meta = TraceMeta(model="nested", num_experts=8, top_k=2, layer_ids=tuple(range(num_layers)), vocab_size=40)
    return make_trace(meta, np.arange(num_requests + 1) * request_len, token_ids, experts)


@pytest.mark.parametrize("attention", ["dp", "tp"])
def test_hierarchical_keeps_sibling_communities_on_one_node(attention):
    profile, evaluation = nested_communities(0, 48), nested_communities(1)
    parallel = ParallelConfig(devices=4, attention=attention, tokens_per_step=128, devices_per_node=2)
    summaries = {}
    for name in ("ep", "semmoe", "semmoe_hierarchical"):
        plan = make_system(name).fit(profile, parallel, np.random.default_rng(0))
        summaries[name] = evaluate(plan, evaluation).summary
        if name == "semmoe_hierarchical":
            node = plan.placement.expert_device() // 2  # [L, E]: sibling blocks {0,1,2,3} and {4,5,6,7} per node
            assert np.all(node[:, :4] == node[:, [0]]) and np.all(node[:, 4:] == node[:, [4]])
            assert np.all(node[:, 0] != node[:, 4])
        if name == "semmoe_hierarchical":  # engine-ready: SGLang's map checks out like any other plan's
            layout = ModelLayout("nested", num_hidden_layers=3, moe_layer_ids=(1, 2), num_experts=8)
            check_location(plan.placement.to_sglang((1, 2), 3), layout, 4, num_redundant_experts=0)
    hier, flat, ep = summaries["semmoe_hierarchical"], summaries["semmoe"], summaries["ep"]
    assert hier["dispatch_bytes_inter_node"] <= flat["dispatch_bytes_inter_node"]
    assert hier["dispatch_bytes_inter_node"] <= 0.1 * ep["dispatch_bytes_inter_node"]
    assert hier["lar"] >= flat["lar"] - 0.01
    assert hier["plan_hierarchical"] and not flat["plan_hierarchical"]
    for s in summaries.values():
        assert s["dispatch_bytes_inter_node"] + s["dispatch_bytes_intra_node"] == s["dispatch_bytes"]


def test_hierarchical_on_one_node_is_flat_semmoe():
    profile = nested_communities(0, 48)
    parallel = ParallelConfig(devices=4, attention="tp", tokens_per_step=128, devices_per_node=8)
    plans = [make_system(name).fit(profile, parallel, np.random.default_rng(0)) for name in ("semmoe", "semmoe_hierarchical")]
    np.testing.assert_array_equal(plans[0].placement.physical_to_logical, plans[1].placement.physical_to_logical)
    np.testing.assert_array_equal(plans[0].token_device, plans[1].token_device)


def test_hierarchical_cocluster_returns_a_balanced_flat_solution():
    rng = np.random.default_rng(0)
    dense = rng.random((2, 30, 16)) * (rng.random((2, 30, 16)) < 0.3)
    unit_load = dense.sum(axis=(0, 2)) / 2 + 0.1
    result = hierarchical_cocluster(SparseAffinity.from_dense(dense), unit_load, 8, 4, rng, n_starts=1, polish_kicks=2)
    assert all(np.bincount(row, minlength=8).tolist() == [2] * 8 for row in result.expert_device)
    assert result.unit_cluster.min() >= 0 and result.unit_cluster.max() < 8
    assert result.objective == result.history[-1]


def test_align_by_node_keeps_overflow_on_its_node_when_it_can():
    # 6 devices as 3 nodes x 2, one slot each. Node 0 predicts 3 tokens on device 0 (one must leave the node),
    # node 1 two on device 2, node 2 one on device 4. Flat align fills free slots in device order: device 0's
    # overflow takes device 1 and device 3, pushing device 2's overflow (token 4) to device 5 on node 2.
    device = np.array([0, 0, 0, 2, 2, 4])
    confidence = np.array([0.9, 0.8, 0.7, 0.9, 0.8, 0.9])
    flat, counts, moved = align_to_slices(device, confidence, 6)
    assert flat.tolist() == [0, 1, 3, 2, 5, 4] and moved == 3  # tokens 2 and 4 cross nodes
    by_node, counts_by_node, moved_by_node = align_to_slices(device, confidence, 6, devices_per_node=2)
    # by node: only token 2 (node 0's least confident) crosses, to node 2's free device 5; token 4 stays on node 1
    assert by_node.tolist() == [0, 1, 3, 4, 5, 2] and moved_by_node == 3
    assert counts.tolist() == counts_by_node.tolist() == [1] * 6
    assert align_to_slices(device, confidence, 6, devices_per_node=6)[0].tolist() == flat.tolist()  # one node
