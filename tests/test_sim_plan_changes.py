"""Plan changes priced in the serving simulator (repro/sim/plan_changes.py, Engine.run(changes=...)): a synchronous
migration shifts every request in flight by exactly its stall, an asynchronous one prices the iterations it overlaps
on the shared links, the new plan places only the requests that arrive after it takes over, and a run without
changes is today's run bit for bit.

The case: test_sim's hand hardware and shape with top-2 of 2 experts, one expert per device. Every token activates
both experts, so swapping them between the devices changes no iteration's cost: what a change adds is its migration.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_sim import ALPHA, HAND_SHAPE, W, hand_hardware

from repro.errors import ConfigError
from repro.parallel import ParallelConfig
from repro.sim import ModelShape, load_hardware
from repro.sim.costs import CostModel
from repro.sim.engine import Engine, EngineConfig
from repro.sim.migration_cost import links_shared
from repro.sim.plan_changes import priced_changes
from repro.sim.shapes import routing_map
from repro.sim.simulate import build_requests
from repro.sim.traffic import dispatch_slots
from repro.systems.base import Placement, Plan
from repro.traces import TraceMeta, make_trace

PARALLEL = ParallelConfig(devices=2, attention="dp", bytes_per_token=4, devices_per_node=2)
CONFIG = EngineConfig(8192, 256, "mixed", 100, 64, 0.0, 2)
SHAPE = ModelShape.from_config(dict(HAND_SHAPE, top_k=2))
EXPERT_BYTES = 3 * 2 * 1 * 2  # gate, up, down: hidden 2 x width 1 x bf16


def top2_trace(num_requests=4, prompt=2, generated=3):
    tokens = prompt + generated
    experts = np.tile(np.array([[0, 1]]), (num_requests * tokens, 1)).reshape(-1, 1, 2)
    meta = TraceMeta(model="hand", num_experts=2, top_k=2, layer_ids=(0,), vocab_size=10, source="hand")
    return make_trace(meta, np.arange(num_requests + 1) * tokens, np.arange(num_requests * tokens) % 10, experts,
                      prefill_len=[prompt] * num_requests)


def hardware(collective_bytes_per_s=40.0):
    """The hand hardware; its point-to-point copies (the collective level) at `collective_bytes_per_s`."""
    hw = hand_hardware()
    hw["collective"] = {"latency_us": ALPHA * 1e6, "nvlink_gbps": collective_bytes_per_s * 1e-9, "rdma_gbps": 0}
    return load_hardware(hw)


@pytest.fixture(scope="module")
def case():
    trace = top2_trace()
    rng = np.random.default_rng(0)
    requests, _, _ = build_requests(trace, np.arange(trace.num_requests), 1, "captured", rng, rng)
    hw = hardware()
    cost = CostModel(SHAPE, hw, routing_map(SHAPE, trace), 2, "dp", "nccl")
    old = Plan(Placement(np.array([[0, 1]]), 2, 2), PARALLEL)
    new = Plan(Placement(np.array([[1, 0]]), 2, 2), PARALLEL)
    return requests, hw, cost, old, new


def engine(case, plan=None):
    requests, _, cost, old, _ = case
    plan = plan or old
    return Engine(plan, requests, cost, dispatch_slots(plan.placement), CONFIG)


def test_no_changes_is_todays_run_bit_for_bit(case):
    _, hw, _, old, new = case
    arrivals = np.array([0.0, 0.0, 0.05, 0.3])
    plain = engine(case).run(arrivals)
    sim = engine(case)
    empty = sim.run(arrivals, changes=())
    sim.run(arrivals, changes=priced_changes(old, [(0.1, new)], SHAPE, hw, "sync"))
    again = sim.run(arrivals)  # a run after one that changed plan starts from the first plan again
    for run in (empty, again):
        for field in ("first_token", "finish", "rank", "moe_seconds"):
            np.testing.assert_array_equal(getattr(run, field), getattr(plain, field))
        assert run.changes == [] and run.stall_seconds == 0.0 and run.iterations == plain.iterations


def test_a_sync_change_adds_exactly_its_stall_to_the_requests_in_flight(case):
    _, hw, _, old, new = case
    arrivals = np.zeros(2)
    plain = engine(case).run(arrivals)
    changes = priced_changes(old, [(0.05, new)], SHAPE, hw, "sync", host_seconds=0.25)
    # both experts move, each over NVLink between the node's two devices: each device sends and receives one
    # 12-byte expert at 40 B/s after a 0.01 s latency; the host's 0.25 s first
    stall = 0.25 + ALPHA + EXPERT_BYTES / W
    assert changes[0].cost.stall_s == pytest.approx(stall, rel=1e-12)
    run = engine(case).run(arrivals, changes=changes)
    first_iteration_end = plain.first_token[0]  # both prompts fill iteration 1, which is in flight at 0.05 s
    assert first_iteration_end > 0.05
    [record] = run.changes
    assert record["start_s"] == first_iteration_end and record["end_s"] == pytest.approx(first_iteration_end + stall)
    assert record["experts_moved"] == 2 and run.stall_seconds == pytest.approx(stall, rel=1e-12)
    np.testing.assert_array_equal(run.first_token, plain.first_token)  # made before the stall
    np.testing.assert_allclose(run.finish - plain.finish, stall, rtol=1e-9)  # decoded after it
    assert run.iterations == plain.iterations


def test_latency_around_changes_splits_the_requests_a_migration_overlaps(case):
    from repro.sim.metrics import latency_around_changes, overlaps_changes

    requests, hw, _, old, new = case
    arrivals = np.array([0.0, 0.0, 20.0, 20.0])  # two served around the change at 0.05 s, two long after it
    changes = priced_changes(old, [(0.05, new)], SHAPE, hw, "sync", host_seconds=0.25)
    run = engine(case).run(arrivals, changes=changes)
    plain = engine(case).run(arrivals)
    assert overlaps_changes(run).tolist() == [True, True, False, False]
    split = latency_around_changes(run, requests.output_len, "mean")
    stall = changes[0].cost.stall_s
    assert split["requests_during"] == 2 and split["requests_outside"] == 2
    # 3 generated tokens: first token before the stall, the two decode steps after it
    tpot_plain = float(np.mean((plain.finish - plain.first_token)[:2] / 2))
    assert split["tpot_mean_s_during"] == pytest.approx(tpot_plain + stall / 2, rel=1e-9)
    assert split["ttft_mean_s_during"] == pytest.approx(float(np.mean(plain.first_token[:2])), rel=1e-12)
    assert split["e2e_mean_s_outside"] == pytest.approx(float(np.mean(plain.finish[2:] - 20.0)), rel=1e-9)


def test_an_async_change_prices_the_iterations_it_overlaps_on_the_shared_links(case):
    requests, hw, cost, old, new = case
    arrivals = np.zeros(2)
    share = 0.5
    # a migration longer than the run (100 s of host work): every iteration is served beside it
    changes = priced_changes(old, [(0.0, new)], SHAPE, hw, "async", bandwidth_share=share, host_seconds=100.0)
    run = engine(case).run(arrivals, changes=changes)
    shared = CostModel(SHAPE, links_shared(hw, share), cost.map, 2, "dp", "nccl")
    slowed = Engine(old, requests, shared, dispatch_slots(old.placement), CONFIG).run(arrivals)
    np.testing.assert_allclose(run.finish, slowed.finish, rtol=1e-12)
    plain = engine(case).run(arrivals)
    assert np.all(run.finish > plain.finish) and run.stall_seconds == 0.0
    # the all-to-all's bandwidth term doubles at half the links: ALPHA + bytes / (W / 2)
    assert shared.hw.backends["nccl"].dispatch.nvlink_bandwidth == pytest.approx(W * (1 - share))
    [record] = run.changes
    expected = 100.0 + ALPHA + EXPERT_BYTES / W / share
    assert record["end_s"] == pytest.approx(record["start_s"] + expected) and record["a2a_slowdown"] == 2.0


def test_the_new_plan_places_only_requests_arriving_after_it_takes_over(case):
    _, hw, _, old, _ = case

    class AllOnOne(Plan):
        def assign_requests(self, token_ids, offsets, prefill_len):
            return np.ones(len(offsets) - 1, dtype=np.int64)

    new = AllOnOne(Placement(np.array([[1, 0]]), 2, 2), PARALLEL)
    arrivals = np.array([0.0, 0.0, 0.0, 5.0])  # round robin places the first three 0, 1, 0
    changes = priced_changes(old, [(0.01, new)], SHAPE, hw, "sync")
    run = engine(case).run(arrivals, changes=changes)
    assert run.changes[0]["end_s"] < 5.0
    assert run.rank.tolist() == [0, 1, 0, 1]
    assert np.all(np.isfinite(run.finish))


def test_changes_asked_for_during_a_migration_wait_for_it(case):
    _, hw, _, old, new = case
    changes = priced_changes(old, [(0.01, new), (0.02, old)], SHAPE, hw, "sync", host_seconds=1.0)
    run = engine(case).run(np.zeros(2), changes=changes)
    first, second = run.changes
    assert second["start_s"] == first["end_s"] and run.stall_seconds == pytest.approx(2 * changes[0].cost.stall_s)


def test_a_change_that_moves_nothing_takes_effect_at_once(case):
    _, hw, _, old, _ = case
    same = Plan(Placement(np.array([[0, 1]]), 2, 2), PARALLEL)
    plain = engine(case).run(np.zeros(2))
    run = engine(case).run(np.zeros(2), changes=priced_changes(old, [(0.05, same)], SHAPE, hw, "sync", host_seconds=1.0))
    np.testing.assert_array_equal(run.finish, plain.finish)
    assert run.changes[0]["start_s"] == run.changes[0]["end_s"] and run.stall_seconds == 0.0


def test_a_placement_stands_for_a_round_robin_plan_and_a_schedule_priced_for_another_plan_is_refused(case):
    _, hw, _, old, new = case
    [change] = priced_changes(old, [(0.05, new.placement)], SHAPE, hw, "sync")
    assert type(change.plan) is Plan and change.plan.parallel == old.parallel and change.cost.experts_moved == 2
    with pytest.raises(ConfigError, match="priced from another placement"):
        engine(case, plan=new).run(np.zeros(2), changes=[change])  # priced from `old`, served from `new`


def test_bad_schedules_are_one_sentence(case):
    _, hw, _, old, new = case
    with pytest.raises(ConfigError, match="non-decreasing"):
        priced_changes(old, [(2.0, new), (1.0, old)], SHAPE, hw)
    with pytest.raises(ConfigError, match="non-decreasing"):
        priced_changes(old, [(float("nan"), new)], SHAPE, hw)
    with pytest.raises(ConfigError, match=r"\(time in seconds, Plan or Placement\) pair"):
        priced_changes(old, [new], SHAPE, hw)
    other = Plan(new.placement, ParallelConfig(devices=2, attention="tp", bytes_per_token=4, devices_per_node=2))
    with pytest.raises(ConfigError, match="same parallel config"):
        priced_changes(old, [(1.0, other)], SHAPE, hw)
    with pytest.raises(ConfigError, match="strictly between 0 and 1"):
        priced_changes(old, [(1.0, new)], SHAPE, hw, "async", bandwidth_share=1.0)
