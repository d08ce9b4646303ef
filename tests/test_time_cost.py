"""repro.eval.time_cost: the critical-path time estimate is the simulator's pricing, counted the evaluator's way."""

from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from repro.errors import ConfigError
from repro.eval import account, evaluate, home_devices, load_shape, moe_layer_seconds, time_model
from repro.eval.accounting import served_activations
from repro.eval.time_cost import PARTS, dp_steps
from repro.parallel import ParallelConfig
from repro.sim.costs import COMPONENTS
from repro.sim.traffic import batch_traffic
from repro.systems.base import Placement, Plan
from repro.traces import TraceMeta, make_trace

ROOT = Path(__file__).resolve().parents[1]
H200 = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "hardware" / "h200.yaml"))


def random_case(seed=0, num_tokens=300, num_layers=3, num_experts=16, top_k=4, devices=4):
    """(plan with a random balanced placement, trace of random distinct experts and random request lengths)."""
    rng = np.random.default_rng(seed)
    expert_device = np.stack([rng.permutation(np.arange(num_experts) % devices) for _ in range(num_layers)])
    plan = Plan(Placement.from_expert_device(expert_device, devices), ParallelConfig(devices=devices, attention="dp"))
    experts = np.argsort(rng.random((num_tokens, num_layers, num_experts)), axis=2)[:, :, :top_k]
    lengths = np.diff(np.concatenate([[0], np.sort(rng.choice(np.arange(1, num_tokens), 19, replace=False)), [num_tokens]]))
    meta = TraceMeta(model="toy", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(num_layers)), vocab_size=50)
    trace = make_trace(meta, np.concatenate([[0], np.cumsum(lengths)]), rng.integers(50, size=num_tokens), experts)
    return plan, trace


def test_shared_cost_equals_the_simulators_pricing_on_a_random_batch():
    """One random DP batch: moe_layer_seconds equals CostModel.block's MoE components with real attention inputs,
    and a hand computation of the nccl formula and the expert roofline from the evaluator's own counts."""
    plan, trace = random_case()
    model = time_model(plan, trace, H200, load_shape("deepseek_v2_lite"), backend="nccl")
    rng = np.random.default_rng(1)
    home = rng.integers(plan.parallel.devices, size=trace.num_tokens)
    home_NL = np.broadcast_to(home[:, None], (trace.num_tokens, trace.num_layers))
    experts = np.asarray(trace.experts)
    traffic = batch_traffic(np.zeros(trace.num_tokens, dtype=np.int64), home_NL, experts, model.slot_table,
                            model.slots_per_device, 1, model.devices_per_node)
    tokens_KD = np.bincount(home, minlength=plan.parallel.devices)[None, :]
    shared = moe_layer_seconds(model.cost, traffic, tokens_KD, None, np.ones(1, dtype=bool))
    seg = {"pairs_prefill": rng.random((1, 4)) * 1e6, "pairs_decode": np.zeros((1, 4)), "kv_read": rng.random((1, 4)) * 1e3,
           "tokens": tokens_KD.astype(float), "samples": np.ones((1, 4))}
    simulator = model.cost.block(seg, traffic, tokens_KD, None, np.ones(1, dtype=bool))["moe"]
    for part in PARTS:
        np.testing.assert_array_equal(shared[part], simulator[:, :, COMPONENTS.index(part)], err_msg=part)

    # by hand, from the evaluator's counts (account / served_activations), on h200's nccl numbers
    counts = account(home_NL, experts, plan.placement.dispatch_device(), 1, plan.parallel.devices)
    remote = counts.remote_copies  # [L, D, D]
    bytes_per_copy = 2048 * 2  # deepseek_v2_lite hidden x bf16
    peer_half, bandwidth, latency = 310e3, 290e9, 5.4e-6
    send = remote.sum(axis=2) * bytes_per_copy + (remote > 0).sum(axis=2) * peer_half
    recv = remote.sum(axis=1) * bytes_per_copy + (remote > 0).sum(axis=1) * peer_half
    np.testing.assert_allclose(shared["dispatch"][0], latency + np.maximum(send, recv).max(axis=1) / bandwidth)
    np.testing.assert_allclose(shared["combine"][0], shared["dispatch"][0])
    # experts: per expert rows padded to 16-row tiles, weights read once; plus the shared experts on each rank's
    # tokens; a rank's time is the sum, the layer's the busiest rank's (routing_map scales the expert width)
    served = served_activations(home_NL, experts, plan.placement.dispatch_device(), plan.parallel.devices)  # [L, D, E]
    width = round(1408 * 6 / 4)
    params, shared_params, flops, memory = 3 * 2048 * width, 3 * 2048 * 2816, 989e12 * 0.7, 4800e9 * 0.8

    def gemm(rows, padded, weights):
        return np.where(rows > 0, np.maximum(np.maximum(2.0 * weights * padded / flops,
                                                        (weights * 2 + 2.0 * rows * 2048 * 2) / memory), 3e-6), 0.0)

    routed = gemm(served, np.ceil(served / 16) * 16, params).sum(axis=2)  # [L, D] (each expert's rows on its device)
    routed = np.where(routed > 0, np.maximum(routed, 3e-6), 0.0)
    per_rank = routed + gemm(tokens_KD, tokens_KD, shared_params)
    np.testing.assert_allclose(shared["experts"][0], per_rank.max(axis=1), rtol=1e-12)


def test_dp_steps_by_hand():
    # 2 ranks x 2 tokens per step: each window of 4 arriving tokens is one step, whatever ranks they go to
    np.testing.assert_array_equal(dp_steps(6, 2, 2), [0, 0, 0, 0, 1, 1])


class AllOnRankZero(Plan):
    """Every request on rank 0: the most unbalanced DP scheduler."""

    def assign_requests(self, token_ids, offsets, prefill_len):
        return np.zeros(len(offsets) - 1, dtype=np.int64)


def test_evaluate_reports_the_time_estimate_and_its_split():
    plan, trace = random_case(seed=2, num_tokens=600)
    model = time_model(plan, trace, H200, load_shape("deepseek_v2_lite"), step_tokens=64)
    summary = evaluate(plan, trace, time_model=model).summary
    parts = [summary[f"time_estimate_{part}_s"] for part in PARTS]
    assert summary["time_estimate_s"] == pytest.approx(sum(parts)) and min(parts) > 0
    assert summary["time_estimate_shape"] == "deepseek_v2_lite" and summary["time_estimate_step_tokens"] == 64
    assert summary["time_estimate_hardware"] == "h200 (1 x 8)"
    # the same trace with every request on one rank: the same arrival windows, but one rank serves each alone
    lazy = AllOnRankZero(plan.placement, plan.parallel)
    lazy_summary = evaluate(lazy, trace, time_model=model).summary
    assert lazy_summary["time_estimate_steps"] == summary["time_estimate_steps"] == int(np.ceil(trace.num_tokens / (64 * plan.parallel.devices)))
    assert lazy_summary["time_estimate_experts_s"] > summary["time_estimate_experts_s"]
    # without a time model nothing is priced
    assert "time_estimate_s" not in evaluate(plan, trace).summary


def test_one_step_equals_pricing_the_whole_trace_as_one_batch():
    """With a step as large as the trace, the estimate is moe_layer_seconds of the whole trace in one batch; TP too."""
    plan, trace = random_case(seed=3)
    for attention in ("dp", "tp"):
        parallel = ParallelConfig(devices=4, attention=attention, tokens_per_step=1024)
        run = Plan(plan.placement, parallel)
        model = time_model(run, trace, H200, load_shape("deepseek_v2_lite"))
        result = evaluate(run, trace, time_model=model)
        home_NL = np.asarray(home_devices(run, trace))
        traffic = batch_traffic(np.zeros(trace.num_tokens, dtype=np.int64), home_NL, np.asarray(trace.experts),
                                model.slot_table, model.slots_per_device, 1, model.devices_per_node)
        load = np.stack([np.bincount(home_NL[:, layer], minlength=4) for layer in range(trace.num_layers)])
        tokens, slices = (load[:1], None) if attention == "dp" else (None, load[None])
        seconds = moe_layer_seconds(model.cost, traffic, tokens, slices, np.ones(1, dtype=bool))
        for part in PARTS:
            np.testing.assert_allclose(result.per_layer[f"time_{part}_s"], seconds[part][0], err_msg=attention)
        assert result.summary["time_estimate_steps"] == 1


def test_the_plans_topology_is_priced_with_the_profiles_links():
    """EP 16 over nodes of 4 on the one-node h200 profile: priced as 4 nodes, the cross-node copies over RDMA
    (40 GB/s, much slower than NVLink), so dispatch takes longer than on one 16-GPU node."""
    _, trace = random_case(seed=4, num_experts=32, devices=16)
    rng = np.random.default_rng(0)
    placement = Placement.from_expert_device(np.stack([rng.permutation(np.arange(32) % 16) for _ in range(3)]), 16)
    seconds = {}
    for per_node in (4, 16):
        plan = Plan(placement, ParallelConfig(devices=16, attention="dp", tokens_per_step=256, devices_per_node=per_node))
        model = time_model(plan, trace, H200, load_shape("deepseek_v2_lite"))
        summary = evaluate(plan, trace, time_model=model).summary
        seconds[per_node] = summary["time_estimate_dispatch_s"]
        assert summary["time_estimate_hardware"] == f"h200 ({16 // per_node} x {per_node})"
    assert seconds[4] > seconds[16]


def test_bad_time_model_inputs_raise_one_clear_error():
    plan, trace = random_case()
    with pytest.raises(ConfigError, match="no model shape 'nope'"):
        load_shape("nope")
    with pytest.raises(ConfigError, match="step_tokens"):
        time_model(plan, trace, H200, load_shape("deepseek_v2_lite"), step_tokens=2)
    with pytest.raises(ConfigError, match="backend"):
        time_model(plan, trace, H200, load_shape("deepseek_v2_lite"), backend="carrier_pigeon")


def test_the_plain_evaluator_does_not_import_the_simulator():
    """repro.sim is imported only when a time is priced: accounting alone keeps working while repro.sim changes."""
    import subprocess
    import sys

    code = "import sys, repro.eval; print(any(m.startswith('repro.sim') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"
