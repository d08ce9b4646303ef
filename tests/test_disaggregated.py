"""Prefill/decode-disaggregated serving (repro/sim/disaggregated.py): unloaded pools with a free KV link equal the
aggregated simulator, the KV transfer shifts decode by exactly its price, the merged-pool handoff is the aggregated
engine when it keeps every rank and moves decodes when the plan says so, and pools of different sizes run."""

import numpy as np
import pytest
import yaml
from test_run import ROOT
from test_signature import planted, windowed_groups

from repro.parallel import ParallelConfig
from repro.sim import ModelShape, load_hardware
from repro.sim.costs import CostModel
from repro.sim.disaggregated import HandoffEngine, KVLink, kv_link, pd_metrics, run_disaggregated
from repro.sim.engine import Engine, EngineConfig
from repro.sim.shapes import routing_map
from repro.sim.simulate import build_requests
from repro.sim.traffic import dispatch_slots
from repro.systems import make_system

CONFIG = EngineConfig(4096, 64, "mixed", 100_000, 64, 0.0, 2)


def load(*parts):
    return yaml.safe_load((ROOT / "conf").joinpath(*parts).read_text())


@pytest.fixture(scope="module")
def setup():
    trace = planted(windowed_groups(4, 3), seed=3)
    shape = ModelShape.from_config(load("sim", "shape", "deepseek_v2_lite.yaml"))
    hw = load_hardware(load("hardware", "h200.yaml"))
    rng = np.random.default_rng(0)
    requests, _, _ = build_requests(trace, np.arange(trace.num_requests), 1, "captured", rng, rng)

    def pool(devices, backend="nccl", system="ep", **params):
        parallel = ParallelConfig(devices=devices, attention="dp", tokens_per_step=64)
        plan = make_system(system, **params).fit(trace, parallel, np.random.default_rng(0))
        return plan, CostModel(shape, hw, routing_map(shape, trace, "trace"), devices, "dp", backend)

    return trace, shape, hw, requests, pool


def test_unloaded_pools_with_a_free_kv_link_equal_the_aggregated_simulator(setup):
    """Requests 1 s apart never overlap, so each is served alone: prefill on one pool and decode on another (the
    same plan and cost, no KV cost) must give the aggregated engine's first-token and finish times."""
    _, _, _, requests, pool = setup
    plan, cost = pool(4)
    arrivals = np.arange(8, dtype=np.float64)
    together = Engine(plan, requests, cost, dispatch_slots(plan.placement), CONFIG).run(arrivals)
    apart = run_disaggregated(plan, cost, CONFIG, plan, cost, CONFIG, requests, arrivals, KVLink(0.0, np.inf, 0.0),
                              decode_rule="prefill_rank")
    np.testing.assert_allclose(apart.first_token, together.first_token, rtol=1e-12)
    np.testing.assert_allclose(apart.finish, together.finish, rtol=1e-9)
    assert apart.decode.iterations + apart.prefill.iterations == together.iterations


def test_the_kv_transfer_delays_decode_by_its_price(setup):
    _, shape, hw, requests, pool = setup
    plan, cost = pool(4)
    arrivals = np.arange(8, dtype=np.float64)
    free = run_disaggregated(plan, cost, CONFIG, plan, cost, CONFIG, requests, arrivals, kv_link(shape, hw, "none"))
    rdma = kv_link(shape, hw, "rdma")
    paid = run_disaggregated(plan, cost, CONFIG, plan, cost, CONFIG, requests, arrivals, rdma)
    price = rdma.seconds(requests.prompt_len[:8])
    assert np.all(price > 0)
    np.testing.assert_allclose(paid.finish - free.finish, price, rtol=1e-9)
    np.testing.assert_allclose(paid.first_token, free.first_token)
    # KV bytes: prompt tokens x MLA latent + rope key x 2 bytes x 27 layers, over the profile's RDMA bandwidth
    per_token = (shape.attention["kv_lora_rank"] + shape.attention["qk_rope_head_dim"]) * 2 * shape.num_hidden_layers
    assert price[0] == pytest.approx(hw.collective_latency + requests.prompt_len[0] * per_token / hw.collective_rdma)


class AllOnZero:
    """A plan wrapper whose decode rule sends every decode to rank 0 (to see the handoff move requests)."""

    def __init__(self, plan):
        self.plan = plan

    def __getattr__(self, name):
        return getattr(self.plan, name)

    def assign_decode(self, prompt_experts, prompt_offsets, prefill_ranks):
        return np.zeros(len(prompt_offsets) - 1, dtype=np.int64)


def test_the_merged_handoff_is_the_aggregated_engine_unless_it_moves_decodes(setup):
    _, _, _, requests, pool = setup
    plan, cost = pool(4)
    arrivals = np.linspace(0, 0.01, 16)  # loaded: requests overlap
    together = Engine(plan, requests, cost, dispatch_slots(plan.placement), CONFIG).run(arrivals)
    stay = HandoffEngine(plan, requests, cost, CONFIG, decode_rule="stay").run(arrivals)
    np.testing.assert_array_equal(stay.finish, together.finish)
    np.testing.assert_array_equal(stay.moe_seconds, together.moe_seconds)
    moved = HandoffEngine(AllOnZero(plan), requests, cost, CONFIG, decode_rule="plan").run(arrivals)
    assert np.all(moved.rank == 0) and not np.all(together.rank == 0)
    assert np.all(np.isfinite(moved.finish))


def test_pools_of_their_own_size_placement_and_backend(setup):
    trace, _, _, requests, pool = setup
    prefill_plan, prefill_cost = pool(4, "deepep_normal")
    decode_plan, decode_cost = pool(8, "deepep_low_latency", "signature", placement="signature_time")
    arrivals = np.linspace(0, 0.05, trace.num_requests)
    for rule in ("plan", "plan_live", "round_robin", "least_loaded", "prefill_rank"):
        result = run_disaggregated(prefill_plan, prefill_cost, CONFIG, decode_plan, decode_cost, CONFIG, requests,
                                   arrivals, KVLink(5e-6, 40e9, 70_000.0), decode_rule=rule)
        metrics = pd_metrics(result, ttft_slo_s=1.0, tpot_slo_s=1.0)
        assert metrics["finished"] == trace.num_requests
        assert metrics["decode_tpot_mean_s"] > 0 and metrics["prefill_ttft_mean_s"] > 0
        assert result.decode.rank.max() < 8 and result.prefill.rank.max() < 4
        assert metrics["goodput_requests_per_s"] > 0


def test_decode_rules_find_perfect_signature_clusters_in_the_decode_pool(setup):
    """Planted clusters (each request's tokens use its group's experts): fitted on another draw, the signature plan's
    rules put nearly every decode where its experts are, round-robin does not."""
    trace, shape, hw, requests, pool = setup
    profile = planted(windowed_groups(40, 1), seed=1)
    parallel = ParallelConfig(devices=4, attention="dp", tokens_per_step=64)
    decode_plan = make_system("signature").fit(profile, parallel, np.random.default_rng(0))
    prefill_plan, cost = pool(4)
    arrivals = np.linspace(0, 0.05, trace.num_requests)
    lar = {}
    for rule in ("plan", "plan_live", "round_robin"):
        result = run_disaggregated(prefill_plan, cost, CONFIG, decode_plan, cost, CONFIG, requests, arrivals,
                                   kv_link(shape, hw, "nvlink"), decode_rule=rule)
        lar[rule] = pd_metrics(result, 1.0, 1.0)["decode_lar"]
    assert lar["plan"] > 0.9 and lar["plan_live"] > 0.9 and lar["round_robin"] < 0.5
