"""repro.sim: a hand-computed case, queueing theory, the traffic counter against the evaluator, monotonicity,
goodput rules, determinism, configs and bad input.

Legend: N tokens, L MoE layers, k experts per token, D devices, E experts, R requests.
"""

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from repro.errors import ConfigError, ReproError, TraceError
from repro.eval.accounting import account
from repro.parallel import ParallelConfig
from repro.sim import ModelShape, load_hardware, simulate
from repro.sim.costs import CostModel, a2a_seconds
from repro.sim.engine import Engine, EngineConfig, Requests
from repro.sim.metrics import bisect_rate, paper_slo, phase_breakdown, throughput_under_slo
from repro.sim.shapes import routing_map
from repro.sim.simulate import build_requests
from repro.sim.traffic import batch_traffic, dispatch_slots
from repro.systems.base import Placement, Plan
from repro.systems.ep import contiguous_placement
from repro.traces import TraceMeta, make_trace

ROOT = Path(__file__).resolve().parents[1]


def load_yaml(*parts) -> dict:
    return OmegaConf.to_container(OmegaConf.load(ROOT.joinpath("conf", *parts)), resolve=True)


def sim_config(**overrides) -> dict:
    """conf/sim/default.yaml with overrides; one seed and a window from 0 unless the test says otherwise."""
    sim = load_yaml("sim", "default.yaml")
    sim.pop("defaults")
    sim.update(seeds=1, warmup_s=0.0, cooldown_s=0.0, duration_s=1.0, min_requests=20, max_duration_s=1.0)
    slo = dict(sim["slo"], **overrides.pop("slo", {}))
    return {"sim": dict(sim, slo=slo, **overrides), "history": 2}


# ---- the hand-computed case -------------------------------------------------------------------------------------
# One MoE layer, two devices (expert 0 on device 0, expert 1 on device 1), top-1, round-robin DP. Memory is
# effectively free, so every kernel costs FLOPs / rate: GEMMs at F = 1000 FLOP/s, attention at A = 500 FLOP/s.
# The all-to-all (nccl) costs ALPHA + bytes / W with bytes per token = hidden 2 x bf16 = 4 and W = 40 B/s.
# Shape: hidden 2, one attention head (GQA, 1 KV head of dim 2): 16 projection weights, 8 FLOPs per (query, key)
# pair; experts of width 1 (6 weights, 12 FLOPs per token); gate 2 x 2 weights (8 FLOPs per token); LM head over a
# vocabulary of 1 (4 FLOPs per sampled token).
F, A, ALPHA, W = 1000.0, 500.0, 0.01, 40.0
HAND_SHAPE = {
    "name": "hand", "hidden_size": 2, "num_hidden_layers": 1, "first_dense_layers": 0, "num_experts": 2, "top_k": 1,
    "num_shared_experts": 0, "moe_intermediate_size": 1, "shared_intermediate_size": 0, "intermediate_size": 1,
    "vocab_size": 1, "dtype_bytes": 2, "attention": {"kind": "gqa", "num_heads": 1, "num_kv_heads": 1, "head_dim": 2},
}


def hand_hardware() -> dict:
    hw = load_yaml("hardware", "h200.yaml")
    hw.update(name="hand", devices_per_node=2, gemm_tile_tokens=1, kernel_floor_us=0, memory_fraction=1.0,
              gpu={"bf16_tflops": F * 1e-12, "hbm_gbps": 1e15, "hbm_gb": 1.0},
              efficiency={"gemm": 1.0, "attention": A / F, "memory": 1.0})
    phase = {"latency_us": ALPHA * 1e6, "peer_half_kb": 0, "nvlink_gbps": W * 1e-9, "rdma_gbps": 0}
    for backend in hw["a2a"].values():
        backend.update(dispatch=dict(phase), combine=dict(phase), dispatch_bytes_per_element=2,
                       combine_bytes_per_element=2, token_header_bytes=0)
    return hw


def hand_trace():
    # r0: prompt tokens -> experts 0, 1; r1: 1, 1; r2: 0, 0 then one generated token (captured) -> expert 1
    experts = np.array([0, 1, 1, 1, 0, 0, 1, 1]).reshape(-1, 1, 1)
    meta = TraceMeta(model="hand", num_experts=2, top_k=1, layer_ids=(0,), vocab_size=10, source="hand")
    return make_trace(meta, [0, 2, 4, 8], np.arange(8) % 10, experts, prefill_len=[2, 2, 2])


def test_hand_computed_case():
    """r0 and r1 arrive at 0, r2 at 0.125 (all three with 2 prompt tokens; r2 generates 2 tokens)."""
    trace = hand_trace()
    plan = Plan(contiguous_placement(1, 2, 2), ParallelConfig(devices=2, attention="dp", bytes_per_token=4,
                                                              devices_per_node=2))
    config = sim_config(rates=[24.0], arrival="given", backend="nccl", decode_routing="captured",
                        slo={})
    result = simulate(config, plan, trace, hand_hardware(), HAND_SHAPE, np.random.default_rng(0),
                      arrival_times=np.array([0.0, 0.0, 0.125]))
    a2a = ALPHA + 4 / W  # one token copy crosses in each direction
    prefill_attention = 3 * 8 / A + 2 * 16 * 2 / F  # causal pairs 0 + 1 + 2 = 3; projections of 2 tokens
    # iteration 1: r0 on rank 0 (its token 1 goes to device 1), r1 on rank 1 (both tokens local on device 1)
    it1 = prefill_attention + 2 * 4 * 2 / F + a2a + 3 * 12 / F + a2a + 4 / F  # device 1 serves 3 tokens
    # iteration 2: r2 (round robin: rank 0) prefills alone, both tokens local: no copy crosses
    it2 = prefill_attention + 2 * 4 * 2 / F + ALPHA + 2 * 12 / F + ALPHA + 4 / F
    # iteration 3: r2's decode step feeds its first generated token (context 2, 3 pairs) routed to expert 1
    it3 = 3 * 8 / A + 2 * 16 / F + 2 * 4 / F + a2a + 12 / F + a2a + 4 / F
    row = result.per_rate.iloc[0]
    expected_ttft = [it1, it1, it1 + it2 - 0.125]
    assert row["ttft_mean_s"] == pytest.approx(np.mean(expected_ttft), rel=1e-12)
    assert row["ttft_p50_s"] == pytest.approx(it1, rel=1e-12)
    assert row["e2e_mean_s"] == pytest.approx((2 * it1 + it1 + it2 + it3 - 0.125) / 3, rel=1e-12)
    assert row["tpot_mean_s"] == pytest.approx(it3, rel=1e-12)
    assert row["makespan_s"] == pytest.approx(it1 + it2 + it3, rel=1e-12)
    assert row["iterations"] == 3 and row["prefill_iterations"] == 2
    # activations: r0 1 of 2 local, r1 2 of 2, r2 2 of 2 then 0 of 1 -> 5 of 7 local
    assert row["lar"] == pytest.approx(5 / 7)
    assert row["moe_dispatch_s"] == pytest.approx((a2a + ALPHA + a2a) / 3, rel=1e-12)
    assert result.summary["sim_decode_routing"] == "captured"
    assert result.summary["sim_output_len_source"] == "trace"


def test_hand_case_prefill_and_decode_apart():
    """The hand case's three iterations by phase: two hold prefill tokens (dispatch a2a, then ALPHA: no copy
    crosses), one decodes only (dispatch a2a); a window over the whole run sums what the run sums."""
    trace = hand_trace()
    plan = Plan(contiguous_placement(1, 2, 2), ParallelConfig(devices=2, attention="dp", bytes_per_token=4,
                                                              devices_per_node=2))
    shape = ModelShape.from_config(HAND_SHAPE)
    cost = CostModel(shape, load_hardware(hand_hardware()), routing_map(shape, trace), 2, "dp", "nccl")
    rng = np.random.default_rng(0)
    requests, _, _ = build_requests(trace, np.arange(3), 1, "captured", rng, rng)
    engine = Engine(plan, requests, cost, dispatch_slots(plan.placement), EngineConfig(8192, 256, "mixed", 100, 64, 0.0, 2))
    run = engine.run(np.array([0.0, 0.0, 0.125]))
    a2a = ALPHA + 4 / W
    assert run.window_iterations.tolist() == [2, 1] and run.window_prefill_tokens == 6
    np.testing.assert_allclose(run.window_moe_seconds.sum(axis=0), run.moe_seconds, rtol=1e-12)
    phases = phase_breakdown(run)
    assert phases["moe_dispatch_prefill_s"] == pytest.approx((a2a + ALPHA) / 2, rel=1e-12)
    assert phases["moe_dispatch_decode_s"] == pytest.approx(a2a, rel=1e-12)
    assert phases["tokens_per_prefill_iteration"] == 3 and phases["tokens_per_decode_iteration"] == 1
    assert phases["prefill_token_share"] == 1.0
    # a window that opens after the first iteration starts leaves it out
    late = engine.run(np.array([0.0, 0.0, 0.125]), window=(0.01, np.inf))
    assert late.window_iterations.tolist() == [1, 1]


class ExpertSlices(Plan):
    """Attention-TP with hindsight: each token's slice is the device of its (single) current expert."""

    uses_true_routing = True

    def shuffle_tokens(self, token_ids, layer, prev_experts, current_experts=None):
        device = self.placement.expert_device()[layer][current_experts[:, 0]]
        return np.argsort(device, kind="stable"), np.bincount(device, minlength=self.parallel.devices)


def test_attention_tp_uses_the_plans_slices():
    """Two prompts of tokens routed to experts 1 then 0: slicing by expert device makes every activation local
    (the dispatch costs its latency only); contiguous slices put each token on the other expert's device."""
    experts = np.array([1, 0, 1, 0]).reshape(-1, 1, 1)
    meta = TraceMeta(model="hand", num_experts=2, top_k=1, layer_ids=(0,), vocab_size=10, source="hand")
    trace = make_trace(meta, [0, 2, 4], np.arange(4), experts, prefill_len=[2, 2])
    parallel = ParallelConfig(devices=2, attention="tp", tokens_per_step=2, bytes_per_token=4, devices_per_node=2)
    config = sim_config(rates=[1.0], output_len=1, backend="nccl", slo={})
    rows = {}
    for plan in (ExpertSlices(contiguous_placement(1, 2, 2), parallel), Plan(contiguous_placement(1, 2, 2), parallel)):
        result = simulate(config, plan, trace, hand_hardware(), HAND_SHAPE, np.random.default_rng(0))
        rows[type(plan).__name__] = result.per_rate.iloc[0]
    assert rows["ExpertSlices"]["lar"] == 1.0 and rows["ExpertSlices"]["moe_dispatch_s"] == pytest.approx(ALPHA)
    assert rows["Plan"]["lar"] == 0.0 and rows["Plan"]["moe_dispatch_s"] == pytest.approx(ALPHA + 4 / W)
    assert rows["Plan"]["moe_tp_collectives_s"] > 0


class BadSlices(Plan):
    def shuffle_tokens(self, token_ids, layer, prev_experts):
        return np.zeros(len(token_ids), dtype=np.int64), np.array([len(token_ids), 0])


def test_attention_tp_rejects_a_bad_shuffle():
    parallel = ParallelConfig(devices=2, attention="tp", tokens_per_step=2, bytes_per_token=4, devices_per_node=2)
    with pytest.raises(ReproError, match="BadSlices.shuffle_tokens returned no permutation"):
        simulate(sim_config(rates=[1.0], output_len=1, slo={}), BadSlices(contiguous_placement(1, 2, 2), parallel),
                 hand_trace(), hand_hardware(), HAND_SHAPE, np.random.default_rng(0))


def test_measured_tables_override_formulas():
    """A measured all-to-all table replaces the formula (busiest rank's remote bytes -> seconds) and is named."""
    hw = hand_hardware()
    hw["measured"] = {"a2a": {"nccl": {"dispatch": [[0, 0.5], [8, 0.9]], "combine": [[0, 0.2], [4, 0.3]]}}}
    plan = Plan(contiguous_placement(1, 2, 2), ParallelConfig(devices=2, attention="dp", bytes_per_token=4,
                                                              devices_per_node=2))
    config = sim_config(rates=[24.0], arrival="given", backend="nccl", decode_routing="captured",
                        slo={})
    result = simulate(config, plan, hand_trace(), hw, HAND_SHAPE, np.random.default_rng(0),
                      arrival_times=np.array([0.0, 0.0, 0.125]))
    # iterations move 4, 0 and 4 remote bytes (see the hand-computed case)
    assert result.per_rate["moe_dispatch_s"].iloc[0] == pytest.approx((0.7 + 0.5 + 0.7) / 3)
    assert result.per_rate["moe_combine_s"].iloc[0] == pytest.approx((0.3 + 0.2 + 0.3) / 3)
    assert result.summary["sim_time_basis"] == "calibrated: a2a.nccl.dispatch, a2a.nccl.combine"


# ---- queueing theory ---------------------------------------------------------------------------------------------


class ConstantCostEngine(Engine):
    """Every iteration costs SERVICE seconds: with one request per iteration the engine is an M/D/1 server."""

    SERVICE = 1.0

    def _cost_block(self, dec, segments, num_k):
        zeros = np.zeros(num_k, dtype=np.int64)
        stats = {"local_activations": zeros, "total_activations": zeros, "remote_copies": zeros, "tokens": zeros}
        return np.full(num_k, self.SERVICE), np.zeros((num_k, 1, 6)), stats


def test_md1_mean_wait_within_sampling_error():
    rho, num_requests = 0.5, 40_000
    n = num_requests
    requests = Requests(prompt_len=np.ones(n, np.int64), output_len=np.ones(n, np.int64), row_start=np.arange(n),
                        stream_start=np.arange(n), stream=np.arange(n), experts=np.zeros((n, 1, 1), np.int16),
                        token_ids=np.zeros(n, np.int32))
    plan = Plan(contiguous_placement(1, 1, 1), ParallelConfig(devices=1, attention="dp", tokens_per_step=1))
    engine = ConstantCostEngine(plan, requests, None, np.zeros((1, 1, 1), np.int32),
                                EngineConfig(8, 1, "mixed", 10, 1, 0.0, 0))
    arrivals = np.cumsum(np.random.default_rng(3).exponential(ConstantCostEngine.SERVICE / rho, size=n))
    run = engine.run(arrivals)
    wait = run.first_token - run.arrival - ConstantCostEngine.SERVICE
    theory = rho * ConstantCostEngine.SERVICE / (2 * (1 - rho))  # Pollaczek-Khinchine for deterministic service
    batches = wait[n // 10 :].reshape(40, -1).mean(axis=1)  # batch means after a warm-up tenth
    standard_error = batches.std(ddof=1) / np.sqrt(len(batches))
    assert abs(batches.mean() - theory) <= 4 * standard_error, (batches.mean(), theory, standard_error)
    assert standard_error < 0.05 * theory  # the check is sharp enough to mean something


# ---- the traffic counter is the evaluator's rule -------------------------------------------------------------------


def random_routing(rng, num_tokens, num_layers, top_k, num_experts):
    return np.argsort(rng.random((num_tokens, num_layers, num_experts)), axis=2)[:, :, :top_k].astype(np.int16)


@pytest.mark.parametrize("replicated", [False, True])
def test_batch_traffic_equals_account(replicated):
    rng = np.random.default_rng(0)
    num_layers, num_experts, devices, top_k, n = 3, 8, 4, 3, 500
    if replicated:  # 12 slots: every expert once plus 4 hot experts twice, on different devices
        p2l = np.stack([np.concatenate([rng.permutation(8), rng.choice(8, 4, replace=False)]) for _ in range(3)])
        p2l = p2l[:, [0, 1, 8, 2, 3, 9, 4, 5, 10, 6, 7, 11]]
        placement = Placement(p2l, devices, num_experts)
    else:
        placement = contiguous_placement(num_layers, num_experts, devices)
    experts = random_routing(rng, n, num_layers, top_k, num_experts)
    home = rng.integers(0, devices, (n, num_layers))  # per-layer homes, as in Attention-TP
    group = np.sort(rng.integers(0, 3, n))
    traffic = batch_traffic(group, home, experts, dispatch_slots(placement), placement.slots_per_device, 3, 2)
    for g in range(3):
        rows = group == g
        counts = account(home[rows], experts[rows], placement.dispatch_device(), 1, devices)
        np.testing.assert_array_equal(traffic.activations[g], counts.activations)
        np.testing.assert_array_equal(traffic.copies[g], counts.token_copies)
    # node copies: distinct (token, destination node) pairs, by brute force; slot loads sum to the activations
    dest = dispatch_slots(placement)[np.arange(num_layers)[None, :, None], home[:, :, None], experts] // placement.slots_per_device
    for g in range(3):
        brute = np.zeros((num_layers, devices, 2), dtype=np.int64)
        for t in np.flatnonzero(group == g):
            for layer in range(num_layers):
                for node in set((dest[t, layer] // 2).tolist()):
                    brute[layer, home[t, layer], node] += 1
        np.testing.assert_array_equal(traffic.node_copies[g], brute)
    assert traffic.slot_tokens.sum() == n * num_layers * top_k


# ---- more remote bytes never lower the all-to-all time --------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([8, 16]), st.integers(1, 4), st.floats(0.05, 1.0))
def test_more_remote_traffic_never_faster(seed, devices, top_k, flip_share):
    """Turning local activations into remote ones (same tokens, same experts elsewhere) never lowers any backend's
    dispatch or combine time, in one node or across two."""
    rng = np.random.default_rng(seed)
    num_experts, n = 32, 64
    placement = contiguous_placement(1, num_experts, devices)
    home = rng.integers(0, devices, (n, 1))
    experts = random_routing(rng, n, 1, top_k, num_experts)
    owner = experts // (num_experts // devices)
    local = owner == home[:, :, None]
    flip = local & (rng.random(experts.shape) < flip_share)
    # a flipped slot moves to the same local index on another device (distinct from the row's other experts,
    # since devices hold disjoint expert ranges)
    shift = rng.integers(1, devices, experts.shape) * (num_experts // devices)
    more = np.where(flip, (experts + shift) % num_experts, experts).astype(np.int16)
    hw = load_hardware(dict(load_yaml("hardware", "h100_2x8_ib.yaml"), nodes=devices // 8 if devices > 8 else 1))
    slots = dispatch_slots(placement)
    before = batch_traffic(np.zeros(n, np.int64), home, experts, slots, placement.slots_per_device, 1, 8)
    after = batch_traffic(np.zeros(n, np.int64), home, more, slots, placement.slots_per_device, 1, 8)
    for backend in hw.backends.values():
        for t0, t1 in zip(a2a_seconds(before, backend, 2048, 8), a2a_seconds(after, backend, 2048, 8), strict=True):
            assert np.all(t1 >= t0 - 1e-15), backend.name


# ---- goodput rules -----------------------------------------------------------------------------------------------


def test_goodput_on_a_synthetic_latency_curve():
    """Latency L(r) = L0 / (1 - r / 100): the paper rule's SLO is 5 L(10); L(r) <= 5 L(10) for r <= 82."""
    rates = np.array([10.0, 20, 40, 60, 80, 90, 95])
    latency = 0.1 / (1 - rates / 100)
    per_rate = pd.DataFrame({"rate": rates, "throughput_rps": rates * 0.99, "ttft_mean_s": latency})
    slo = paper_slo(per_rate, "ttft", "mean", 5)
    assert slo == pytest.approx(5 * 0.1 / 0.9)
    assert throughput_under_slo(per_rate, "ttft", "mean", slo) == pytest.approx(80 * 0.99)
    assert throughput_under_slo(per_rate, "ttft", "mean", 1e-6) == 0.0  # nobody meets it: zero, no error
    # bisection on the same curve: the exact crossing 100 (1 - 0.9 / 5) = 82, found to 0.1 %
    found = bisect_rate(lambda r: 0.1 / (1 - r / 100) <= slo, rates, 1e-3)
    assert found["bracketed"] and found["low"] <= 82 < found["high"] <= found["low"] * 1.001
    assert bisect_rate(lambda r: False, rates, 0.01) == {"low": 0.0, "high": 10.0, "bracketed": True, "probes": [10.0]}
    assert bisect_rate(lambda r: True, rates, 0.01)["high"] == float("inf")


# ---- determinism, schema, configs -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_setup():
    rng = np.random.default_rng(1)
    num_layers, num_experts, top_k, requests = 26, 64, 6, 60
    lengths = rng.integers(16, 96, requests)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    meta = TraceMeta(model="toy-v2-lite", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(1, 27)),
                     vocab_size=1000, source="synthetic", dataset="toy")
    trace = make_trace(meta, offsets, rng.integers(0, 1000, offsets[-1]),
                       random_routing(rng, int(offsets[-1]), num_layers, top_k, num_experts))
    shape = load_yaml("sim", "shape", "deepseek_v2_lite.yaml")
    plan = Plan(contiguous_placement(num_layers, num_experts, 8), ParallelConfig(devices=8, attention="dp"))
    return trace, shape, plan


def run_small(setup, seed=0, **overrides):
    trace, shape, plan = setup
    config = sim_config(**dict({"rates": [5.0, 40.0], "output_len": [4, 24], "slo": {}}, **overrides))
    return simulate(config, plan, trace, load_yaml("hardware", "h200.yaml"), shape, np.random.default_rng(seed))


def test_same_seed_same_numbers_and_block_size_invariance(small_setup):
    first, again = run_small(small_setup), run_small(small_setup)
    pd.testing.assert_frame_equal(first.per_rate, again.per_rate, check_exact=True)
    pd.testing.assert_frame_equal(first.per_layer, again.per_layer, check_exact=True)
    timing = ("wall", "cpu")
    assert {k: v for k, v in first.summary.items() if not any(t in k for t in timing)} == \
        {k: v for k, v in again.summary.items() if not any(t in k for t in timing)}
    other = run_small(small_setup, seed=1)
    assert not np.array_equal(other.per_rate["ttft_mean_s"], first.per_rate["ttft_mean_s"])
    # pricing decode iterations one by one changes no request time (summed breakdowns only in rounding)
    stepwise = run_small(small_setup, max_block_iterations=1)
    latency = [c for c in first.per_rate if c.endswith("_s") and c.split("_")[0] in ("ttft", "tpot", "e2e")]
    pd.testing.assert_frame_equal(first.per_rate[latency], stepwise.per_rate[latency], check_exact=True)
    assert first.per_rate["blocks"].sum() < stepwise.per_rate["blocks"].sum()


def test_result_schema_and_labels(small_setup):
    result = run_small(small_setup, schedule="prefill_first", backend="deepep_auto")
    s = result.summary
    assert s["sim_time_basis"].startswith("uncalibrated")
    assert s["sim_decode_routing"] == "prompt_resample" and s["sim_output_len_source"] == "uniform[4,24]"
    for key in ("throughput_under_ttft_slo_rps", "throughput_under_e2e_slo_rps", "goodput_distserve_rps",
                "a2a_share_lightest", "slo_ttft_s", "slo_tpot_s", "slo_e2e_s"):
        assert np.isfinite(s[key]), key
    assert 0 < s["a2a_share_lightest"] < 1
    assert list(result.per_rate.query("role != 'bisect'")["rate"]) == [5.0, 40.0]
    assert {"ttft_p99_s", "tpot_p90_s", "e2e_p50_s", "throughput_rps", "output_tok_s", "a2a_share", "lar",
            "moe_gate_s", "moe_dispatch_s", "moe_experts_s", "moe_combine_s", "attainment"} <= set(result.per_rate)
    assert len(result.per_layer) == 2 * 26 and result.per_layer["dispatch_s"].gt(0).all()
    # uniform routing on contiguous EP at EP 8: LAR ~ 1/8
    assert result.per_rate["lar"].iloc[0] == pytest.approx(1 / 8, abs=0.03)


def test_every_shape_matches_its_model_card_size():
    """Total parameters from the shape fields against the model cards (billions)."""
    cards = {"deepseek_v2_lite": 15.7, "deepseek_v3": 671, "moonlight_16b_a3b": 16.0, "qwen3_30b_a3b": 30.5,
             "mixtral_8x7b": 46.7, "olmoe_1b_7b": 6.9}
    for name, billions in cards.items():
        shape = ModelShape.from_config(load_yaml("sim", "shape", f"{name}.yaml"))
        assert shape.name == name
        total = shape.weight_bytes_per_rank(1, attention_replicated=True) / shape.dtype_bytes / 1e9
        assert total == pytest.approx(billions, rel=0.03), name


def test_every_hardware_profile_loads_and_keeps_the_run_keys():
    for path in sorted((ROOT / "conf" / "hardware").glob("*.yaml")):
        profile = load_yaml("hardware", path.name)
        hw = load_hardware(profile)
        # bench.cpu_check's measured CPU profiles describe the N gloo ranks they were measured with (2, 4)
        assert hw.name == path.stem and (hw.num_devices >= 8 or path.stem.startswith("cpu_"))


def test_sim_group_composes_with_hydra():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["sim=default", "sim/shape=qwen3_30b_a3b", "logger=none"])
    sim = OmegaConf.to_container(cfg.sim, resolve=True)
    assert sim["shape"]["name"] == "qwen3_30b_a3b" and sim["rates"][0] == 10


# ---- bad input: one clear sentence each --------------------------------------------------------------------------


def test_slo_nobody_meets_reports_zero(small_setup):
    result = run_small(small_setup, slo={"ttft_s": 1e-9, "tpot_s": 1e-9, "e2e_s": 1e-9})
    s = result.summary
    assert s["throughput_under_ttft_slo_rps"] == 0.0 and s["goodput_distserve_rps"] == 0.0
    assert s["slo_reference"] == "given"
    lowest = [w for w in s["warnings"] if "even the lowest rate" in w]
    assert len(lowest) == 3 and all(w.endswith(".") for w in s["warnings"])


@pytest.mark.parametrize("field", ["gpu.hbm_gbps", "a2a.deepep_low_latency.combine.rdma_gbps", "kernel_floor_us"])
def test_hardware_missing_field(field):
    profile = load_yaml("hardware", "h200.yaml")
    node = profile
    *parents, leaf = field.split(".")
    for part in parents:
        node = node[part]
    del node[leaf]
    with pytest.raises(ConfigError, match=f"misses field '{field}'"):
        load_hardware(profile)


def test_trace_expert_count_mismatch_needs_an_explicit_mapping(small_setup):
    trace, shape, plan = small_setup
    qwen = ModelShape.from_config(load_yaml("sim", "shape", "qwen3_30b_a3b.yaml"))
    with pytest.raises(TraceError, match="routing_map=trace") as error:
        routing_map(qwen, trace)
    assert str(error.value).endswith(".") and not re.search(r"\.\s+[A-Z]", str(error.value))  # one sentence
    mapped = routing_map(qwen, trace, "trace")
    assert mapped.layer_weight == pytest.approx(48 / 26) and mapped.expert_intermediate == 768 * 8 // 6
    config = sim_config(rates=[5.0], output_len=4, routing_map="trace", slo={})
    result = simulate(config, plan, trace, load_yaml("hardware", "h200.yaml"), load_yaml("sim", "shape", "qwen3_30b_a3b.yaml"),
                      np.random.default_rng(0))
    assert "mapped onto shape qwen3_30b_a3b" in result.summary["sim_routing_map"]


@pytest.mark.parametrize("rates", [[0.0], [5.0, -1.0], []])
def test_rate_must_be_positive(small_setup, rates):
    with pytest.raises(ConfigError, match="sim.rates must be request rates > 0"):
        run_small(small_setup, rates=rates)


def test_cost_model_rejects_unknown_backend():
    shape = ModelShape.from_config(HAND_SHAPE)
    hw = load_hardware(hand_hardware())
    trace = hand_trace()
    with pytest.raises(ConfigError, match="sim.backend must be one of"):
        CostModel(shape, hw, routing_map(shape, trace), 2, "dp", "gloo")


def test_per_request_latencies_are_the_ones_the_statistics_are_over(small_setup):
    result = run_small(small_setup, seeds=2)
    requests, per_rate = result.requests, result.per_rate
    assert list(requests.columns) == ["rate", "seed", "role", "ttft_s", "tpot_s", "e2e_s", "in_window"]
    for row in per_rate.itertuples():
        mine = requests[(requests["rate"] == row.rate) & (requests["seed"] == row.seed)]
        assert len(mine) == row.num_requests and set(mine["role"]) == {row.role}
        finite = mine["ttft_s"][np.isfinite(mine["ttft_s"])]
        assert finite.mean() == pytest.approx(row.ttft_mean_s, rel=1e-12)
        assert np.percentile(mine["e2e_s"][np.isfinite(mine["e2e_s"])], 99) == pytest.approx(row.e2e_p99_s, rel=1e-12)
