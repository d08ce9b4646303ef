"""system=semmoe_replicated / semmoe_hottest (repro.systems.semmoe.replicate): replica choice by hand, equality
with Sem-MoE at r = 0, a planted instance where affinity beats hotness, plan round trip and SGLang export.

Legend: N tokens, L MoE layers, k experts per token, D devices, E experts, u units, r replicas per device.
"""

import json

import numpy as np
import pytest

from repro.affinity.tables import routed_device_mass
from repro.engines.layout import ModelLayout
from repro.engines.sglang import check_location
from repro.errors import ConfigError
from repro.eval import evaluate
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.systems.semmoe import SemMoEPlan, SparseAffinity
from repro.systems.semmoe.replicate import (
    choose_replicas,
    hottest_replicas,
    present_from,
    present_local_mass,
    replicate_cocluster,
    time_replicas,
)
from repro.systems.semmoe.system import present_device_mass
from repro.traces import TraceMeta, make_trace


def test_choose_replicas_by_hand():
    # 1 layer, D=2, E=4; device 0 holds {0, 1}, device 1 holds {2, 3}
    expert_device = np.array([[0, 0, 1, 1]])
    primary = present_from(expert_device, np.zeros((1, 2, 0), dtype=np.int64), 2)
    cluster_affinity = np.array([[[5.0, 4.0, 1.0, 3.0],    # units on device 0 miss 3 (mass 3) more than 2 (1)
                                  [2.0, 2.0, 9.0, 0.0]]])  # units on device 1: 0 and 1 tie at 2
    hotness = np.array([[1.0, 6.0, 1.0, 1.0]])
    replicas = choose_replicas(cluster_affinity, primary, 1, hotness)
    assert replicas.tolist() == [[[3], [1]]]  # device 1's tie goes to the hotter expert 1
    assert choose_replicas(cluster_affinity, primary, 2, hotness).tolist() == [[[3, 2], [1, 0]]]
    # hottest: device 0 takes the hottest it lacks (ties: 2 before 3 by id), device 1 takes 1 then 0
    assert hottest_replicas(hotness, primary, 1).tolist() == [[[2], [1]]]
    present = present_from(expert_device, replicas, 2)
    assert present[0].tolist() == [[True, False], [True, True], [False, True], [True, True]]


def test_time_replicas_relieve_the_busiest_device_and_weigh_locality():
    # 1 layer, D=3, one expert per device; units on device 0 use expert 0 (10), on device 1 expert 0 (5), on
    # device 2 experts 0 (5) and 1 (6): device 0 serves 20 of 26 activations
    primary = present_from(np.array([[0, 1, 2]]), np.zeros((1, 3, 0), dtype=np.int64), 3)
    gain = np.array([[[10.0, 0.0, 0.0], [5.0, 0.0, 0.0], [5.0, 6.0, 0.0]]])
    # balance only: device 2 copies expert 0 (busiest device 20 -> 12.5: its own 5 local, device 1's 5 split),
    # though expert 1 would turn more mass local (6) and is what the affinity choice takes
    assert time_replicas(gain, primary, 1, 0.0)[0, 2, 0] == 0
    assert time_replicas(gain, primary, 1, 100.0)[0, 2, 0] == 1
    assert choose_replicas(gain, primary, 1, gain.sum(axis=1))[0, 2, 0] == 1
    for weight in (0.0, 1.0, 100.0):
        replicas = time_replicas(gain, primary, 2, weight)
        present = present_from(np.array([[0, 1, 2]]), replicas, 3)
        assert np.all(present.sum(axis=1) == 3)  # each device: its primary + 2 distinct new experts


def test_replicated_masses_equal_the_unreplicated_ones_without_replicas():
    rng = np.random.default_rng(0)
    experts = np.argsort(rng.random((200, 8)), axis=1)[:, :3]
    token_row = rng.integers(0, 30, 200)
    expert_device = rng.permutation(np.repeat(np.arange(4), 2))
    present = expert_device[:, None] == np.arange(4)
    np.testing.assert_array_equal(present_device_mass(token_row, experts, 30, present),
                                  routed_device_mass(token_row, experts, 30, expert_device, 4))
    dense = rng.random((2, 10, 8)) * (rng.random((2, 10, 8)) < 0.4)
    affinity = SparseAffinity.from_dense(dense)
    layered = np.stack([expert_device, np.roll(expert_device, 1)])
    np.testing.assert_allclose(present_local_mass(affinity, layered[:, :, None] == np.arange(4)),
                               affinity.local_mass(layered, 4))


def test_replicate_cocluster_never_loses_to_its_start():
    rng = np.random.default_rng(3)
    dense = rng.random((2, 40, 8)) * (rng.random((2, 40, 8)) < 0.5)
    affinity = SparseAffinity.from_dense(dense)
    unit_load = dense.sum(axis=(0, 2)) / 2 + 1e-9
    expert_device = np.stack([rng.permutation(np.repeat(np.arange(4), 2)) for _ in range(2)])
    start = rng.integers(0, 4, 40)
    result = replicate_cocluster(affinity, unit_load, start, expert_device, 4, 2, rounds=3)
    assert result.objective == min(result.history) and len(result.history) == 4
    assert result.replicas.shape == (2, 4, 2)
    present = present_from(expert_device, result.replicas, 4)
    assert np.all(present.sum(axis=2) >= 1) and np.all(present.sum(axis=1) == 4)  # 2 primaries + 2 replicas


def planted_trace(seed=0, num_requests=160, request_len=24):
    """D=2, E=8, top-2, 1 layer. Class A (tokens 0..9) routes to one of {0, 1, 2, 3} plus expert 4 half the time;
    class B (tokens 10..19) always routes to the hot expert 5 plus one of {6, 7} or, a third of the time, 4.
    So device "A" gains most from a replica of 4, while the hottest expert it lacks is 5 (B-only). Classes
    alternate, so the DP mask (every 2 consecutive requests on both ranks) never forces a request off its class."""
    rng = np.random.default_rng(seed)
    label = np.arange(num_requests) % 2
    cls = np.repeat(label, request_len)
    n = len(cls)
    token_ids = cls * 10 + rng.integers(0, 10, n)
    first_a = rng.integers(0, 4, n)
    second_a = np.where(rng.random(n) < 0.5, 4, (first_a + 1 + rng.integers(0, 3, n)) % 4)
    second_b = np.where(rng.random(n) < 1 / 3, 4, 6 + rng.integers(0, 2, n))
    experts = np.where(cls[:, None] == 0, np.stack([first_a, second_a], 1), np.stack([np.full(n, 5), second_b], 1))
    meta = TraceMeta(model="planted", num_experts=8, top_k=2, layer_ids=(1,), vocab_size=20)
    return make_trace(meta, np.arange(num_requests + 1) * request_len, token_ids, experts[:, None, :])


@pytest.fixture(scope="module")
def planted_split():
    return planted_trace(seed=0, num_requests=48), planted_trace(seed=1)


@pytest.mark.parametrize("attention", ["dp", "tp"])
def test_r0_is_semmoe_and_affinity_replicas_beat_hottest_and_eplb(planted_split, attention):
    profile, evaluation = planted_split
    parallel = ParallelConfig(devices=2, attention=attention, tokens_per_step=96, devices_per_node=2)

    def fit(name, **params):
        return make_system(name, **params).fit(profile, parallel, np.random.default_rng(0))

    base, zero = fit("semmoe"), fit("semmoe_replicated", replicas_per_device=0)
    np.testing.assert_array_equal(base.placement.physical_to_logical, zero.placement.physical_to_logical)
    for name in ("token_device", "token_confidence", "dp_score", "markov_device", "markov_confidence"):
        np.testing.assert_array_equal(getattr(base, name), getattr(zero, name))
    assert evaluate(base, evaluation).summary["lar"] == evaluate(zero, evaluation).summary["lar"]

    lar = {r: evaluate(fit("semmoe_replicated", replicas_per_device=r), evaluation).summary for r in (1, 2)}
    hottest = evaluate(fit("semmoe_hottest", replicas_per_device=1), evaluation).summary["lar"]
    eplb = evaluate(fit("eplb", replicas_per_device=1), evaluation).summary["lar"]
    base_lar = evaluate(base, evaluation).summary["lar"]
    # r = 0: A's tokens miss expert 4 half the time (LAR 0.88); one replica of 4 on A's device makes all local,
    # while the hottest expert A's device lacks is 5, which A never uses
    assert base_lar < 0.9 and lar[1]["lar"] == lar[2]["lar"] == 1.0 and hottest == pytest.approx(base_lar)
    assert eplb < base_lar
    assert lar[1]["num_slots"] == 10 and lar[1]["replica_slots"] == 2 and lar[1]["plan_replicas_per_device"] == 1
    # B's device got the replica with the most mass among the experts it lacks, but B never routes to it: waste
    assert lar[1]["replica_slots_unused"] == 1 and lar[1]["replica_slots_unused_share"] == 0.5


def test_replicated_plan_round_trips_and_exports_for_sglang(planted_split, tmp_path):
    profile, evaluation = planted_split
    parallel = ParallelConfig(devices=2, attention="tp", tokens_per_step=96, devices_per_node=2)
    plan = make_system("semmoe_replicated", replicas_per_device=2).fit(profile, parallel, np.random.default_rng(0))
    plan.save(tmp_path / "plan")
    loaded = SemMoEPlan.load(tmp_path / "plan", parallel, 8)
    np.testing.assert_array_equal(loaded.placement.dispatch_device(), plan.placement.dispatch_device())
    assert evaluate(loaded, evaluation).summary == evaluate(plan, evaluation).summary
    # SGLang --init-expert-location: [num_hidden_layers][P], P divisible by the EP size, every expert in every layer
    exported = json.loads(json.dumps(plan.placement.to_sglang((1,), 3)))
    rows = np.asarray(exported["physical_to_logical_map"])
    assert rows.shape == (3, 12) and rows.shape[1] % parallel.devices == 0
    assert all(set(row.tolist()) == set(range(8)) for row in rows)
    layout = ModelLayout("planted", num_hidden_layers=3, moe_layer_ids=(1,), num_experts=8)
    np.testing.assert_array_equal(check_location(exported, layout, 2, num_redundant_experts=4), rows)


def test_bad_input_raises_one_clear_sentence(planted_split):
    profile, _ = planted_split
    parallel = ParallelConfig(devices=2, tokens_per_step=8)
    with pytest.raises(ConfigError, match="replicas_per_device=5 asks for more replicas per device than the 4"):
        make_system("semmoe_replicated", replicas_per_device=5).fit(profile, parallel, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="replicas_per_device must be >= 0"):
        make_system("semmoe_hottest", replicas_per_device=-1)
    with pytest.raises(ConfigError, match=r"has no parameter\(s\) \['replicas'\]"):
        make_system("semmoe_replicated", replicas=1)
    with pytest.raises(ConfigError, match="replica_choice must be one of"):
        make_system("semmoe_replicated", replica_choice="random")
    with pytest.raises(ConfigError, match="replica_remote_weight must be >= 0"):
        make_system("semmoe_replicated", replica_choice="time", replica_remote_weight=-1)


@pytest.mark.parametrize("attention", ["dp", "tp"])
def test_time_replica_choice_fits_and_serves(planted_split, attention):
    profile, evaluation = planted_split
    parallel = ParallelConfig(devices=2, attention=attention, tokens_per_step=96, devices_per_node=2)
    plan = make_system("semmoe_replicated", replicas_per_device=1, replica_choice="time",
                       replica_remote_weight=1.0).fit(profile, parallel, np.random.default_rng(0))
    summary = evaluate(plan, evaluation).summary
    assert plan.info["replica_choice"] == "time" and summary["replica_slots"] == 2
    # the planted instance: one replica of expert 4 on A's device turns all of A's mass local (as affinity does)
    assert summary["lar"] == 1.0
