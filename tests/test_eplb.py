"""DeepSeek EPLB port: hand-computed packings, replication, hierarchical policy, the system, sglang cross-check."""

import numpy as np
import pytest

from repro.errors import ConfigError
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.systems.base import Placement
from repro.systems.eplb import (
    balanced_packing,
    device_load,
    expert_activation_counts,
    rebalance_experts,
    replicate_experts,
)
from repro.traces import TraceMeta, make_trace


def test_balanced_packing_hand_computed():
    # heaviest first: 9 -> pack0, 7 -> pack1, 5 -> pack1 (7 < 9), 4 -> pack0 (full packs excluded: 2 items each)
    pack, rank = balanced_packing(np.array([[9.0, 4.0, 7.0, 5.0]]), 2)
    assert pack.tolist() == [[0, 0, 1, 1]] and rank.tolist() == [[0, 1, 0, 1]]


def test_replicate_experts_hand_computed():
    # loads 10, 4: slot 2 copies expert 0 (10/1), slot 3 compares 10/2=5 vs 4 -> expert 0 again
    phy2log, rank, count = replicate_experts(np.array([[10.0, 4.0]]), 4)
    assert phy2log.tolist() == [[0, 1, 0, 0]] and rank.tolist() == [[0, 0, 1, 2]] and count.tolist() == [[3, 1]]


def test_rebalance_outputs_match_docstring_shapes_and_invariants():
    rng = np.random.default_rng(0)
    weight = rng.random((3, 16)) * 100
    phy2log, log2phy, count = rebalance_experts(weight, 16 + 4, num_groups=4, num_nodes=2, num_gpus=4)
    assert phy2log.shape == (3, 20) and count.shape == (3, 16) and log2phy.shape == (3, 16, count.max())
    assert np.all(count.sum(1) == 20) and np.all(count >= 1)
    for layer in range(3):  # log2phy inverts phy2log, -1 padded
        for expert in range(16):
            slots = log2phy[layer, expert]
            assert sorted(np.flatnonzero(phy2log[layer] == expert).tolist()) == sorted(slots[slots >= 0].tolist())
    # hierarchical: every group of 4 experts lives on one node (GPUs 0-1 = node 0, 2-3 = node 1)
    node_of_slot = np.arange(20) // 10
    for layer in range(3):
        for group in range(4):
            nodes = {node_of_slot[p] for p in range(20) if phy2log[layer, p] // 4 == group}
            assert len(nodes) == 1


def test_balance_beats_contiguous_on_skewed_load():
    weight = np.array([[100.0, 90, 80, 70, 4, 3, 2, 1]])
    phy2log, _, _ = rebalance_experts(weight, 8, 1, 1, 4)
    load = device_load(weight, Placement(phy2log, 4, 8))
    # heaviest first to the lightest pack with room: 100+1, 90+2, 80+3, 70+4 (contiguous would give 190)
    assert sorted(load[0].tolist()) == [74.0, 83.0, 92.0, 101.0]
    phy2log, _, count = rebalance_experts(weight, 12, 1, 1, 4)
    assert count[0].tolist() == [2, 2, 2, 2, 1, 1, 1, 1]  # each redundant slot halves the heaviest expert
    assert device_load(weight, Placement(phy2log, 4, 8)).max() < 101.0


def trace(seed=0, num_tokens=400, num_experts=8, num_layers=2, top_k=2):
    rng = np.random.default_rng(seed)
    probs = np.arange(num_experts, 0, -1.0) ** 2
    experts = np.stack(
        [np.stack([rng.choice(num_experts, top_k, replace=False, p=probs / probs.sum()) for _ in range(num_tokens)])
         for _ in range(num_layers)], axis=1)
    meta = TraceMeta(model="t", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(num_layers)), vocab_size=50)
    return make_trace(meta, [0, num_tokens // 2, num_tokens], rng.integers(0, 50, num_tokens), experts)


def test_expert_activation_counts():
    t = trace()
    counts = expert_activation_counts(t)
    assert counts.shape == (2, 8) and np.all(counts.sum(1) == 400 * 2)
    assert counts[0, 3] == np.sum(np.asarray(t.experts[:, 0, :]) == 3)


def test_system_with_redundant_slots_is_balanced_and_deterministic():
    t = trace()
    parallel = ParallelConfig(devices=4, tokens_per_step=8)
    plans = [make_system("eplb", num_redundant=4).fit(t, parallel, np.random.default_rng(s)) for s in (0, 1)]
    assert np.array_equal(plans[0].placement.physical_to_logical, plans[1].placement.physical_to_logical)
    placement = plans[0].placement
    assert placement.num_slots == 12 and placement.slots_per_device == 3
    assert plans[0].info["profile_load_imbalance_max_mean"] < plans[0].info["profile_load_imbalance_max_mean_contiguous"]
    # static dispatch: a device holding a replica serves its own tokens
    dispatch = placement.dispatch_device()
    replicas = placement.replicas() > 0
    layer, expert, device = np.argwhere(replicas)[0]
    assert dispatch[layer, device, expert] == device


def test_bad_input():
    t = trace()
    with pytest.raises(ConfigError, match="does not divide"):
        make_system("eplb", num_redundant=1).fit(t, ParallelConfig(devices=4, tokens_per_step=8), np.random.default_rng(0))
    with pytest.raises(ConfigError, match="exceeds the model's 8 experts"):
        make_system("eplb").fit(t, ParallelConfig(devices=16, tokens_per_step=16), np.random.default_rng(0))
    with pytest.raises(ConfigError, match="num_redundant must be >= 0"):
        make_system("eplb", num_redundant=-1)
    with pytest.raises(ConfigError, match="negative or non-finite"):
        rebalance_experts(np.array([[1.0, -1.0]]), 2, 1, 1, 1)
    # Placement's own checks: an expert listed twice (so another is missing) and one missing with replicas
    with pytest.raises(ConfigError, match="misses expert 2 in layer 0"):
        Placement(np.array([[0, 1, 1, 3]]), 2, 4)
    with pytest.raises(ConfigError, match="misses expert 2 in layer 0"):
        Placement(np.array([[0, 1, 3, 3, 0, 1]]), 2, 4)


def test_matches_sglang_rebalance_experts():
    deepseek = pytest.importorskip("sglang.srt.eplb.eplb_algorithms.deepseek")
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    for num_experts, gpus, redundant, groups, nodes in [(16, 4, 0, 4, 2), (64, 8, 0, 8, 1), (32, 4, 8, 1, 1), (16, 4, 4, 4, 2)]:
        weight = (rng.random((3, num_experts)) * 100).astype(np.float32)
        ours = rebalance_experts(weight, num_experts + redundant, groups, nodes, gpus)
        theirs = deepseek.rebalance_experts(torch.tensor(weight), num_experts + redundant, groups, nodes, gpus, True)
        assert np.array_equal(ours[2], theirs[2].numpy())  # replica counts
        if redundant == 0:  # no equal-load replicas -> no ties -> identical maps
            assert np.array_equal(ours[0], theirs[0].numpy())
        # with replicas, upstream's unstable torch.sort may order equal loads differently: same per-GPU loads
        ours_load = np.sort(device_load(weight, Placement(ours[0], gpus, num_experts)), axis=1)
        theirs_load = np.sort(device_load(weight, Placement(theirs[0].numpy(), gpus, num_experts)), axis=1)
        np.testing.assert_allclose(ours_load, theirs_load, rtol=1e-5)
