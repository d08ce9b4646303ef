"""Decode as a phase of its own in every job (repro/eval/decode_phase.py through repro.run.fit_and_evaluate): a
hand-worked decode accounting, the job path with and without generated tokens, in both attention modes, and the
report's decode section."""

import numpy as np
import pandas as pd
import pytest
from test_run import compose

from repro.errors import ConfigError
from repro.eval.decode_phase import NO_DECODE, decode_phase_metrics, decode_summary
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.traces import TraceMeta, make_trace, write_trace


def two_request_trace():
    """D=2, E=4 (experts 0,1 on device 0 and 2,3 on device 1 under EP), one layer, top-1; each request has one
    prompt token and two generated ones. Round-robin puts request 0 on rank 0 and request 1 on rank 1.
    Generated experts: request 0 -> [0, 2], request 1 -> [3, 3]."""
    experts = np.array([1, 0, 2, 2, 3, 3]).reshape(6, 1, 1)
    meta = TraceMeta(model="hand", num_experts=4, top_k=1, layer_ids=(0,), vocab_size=8, dataset="hand")
    return make_trace(meta, np.array([0, 3, 6]), np.zeros(6, dtype=np.int64), experts, prefill_len=np.array([1, 1]))


def test_decode_metrics_match_a_hand_worked_example():
    trace = two_request_trace()
    parallel = ParallelConfig(devices=2, attention="dp", tokens_per_step=8, bytes_per_token=10)
    plan = make_system("ep").fit(trace, parallel, np.random.default_rng(0))
    out = decode_summary(plan, trace)
    # step 0: r0 -> expert 0 (local on 0), r1 -> 3 (local on 1); step 1: r0 -> 2 (remote, device 1), r1 -> 3 (local)
    assert out["decode_phase"] == "measured" and out["decode_steps"] == 2 and out["decode_tokens"] == 4
    assert out["decode_lar"] == 0.75
    assert out["decode_a2a_bytes"] == 2 * 10  # one remote copy, dispatch and combine
    assert out["decode_token_imbalance_max_mean"] == 1.0 and out["decode_step_token_imbalance_max_mean"] == 1.0
    # experts served per device: step 0 {0} | {3}; step 1 {} | {2, 3} -> busiest 1 then 2
    assert out["decode_device_distinct_experts_max"] == 1.5 and out["decode_device_distinct_experts_mean"] == 1.0
    assert out["decode_batch_distinct_experts_max"] == 1.0  # each rank's batch: one token, one expert
    # prompt tokens: r0 expert 1 on rank 0 (local), r1 expert 2 on rank 1 (local)
    assert out["prefill_lar"] == 1.0 and out["prefill_tokens"] == 2
    # a TP job is accounted on the token scheduler's per-layer homes
    tp = ParallelConfig(devices=2, attention="tp", tokens_per_step=2, bytes_per_token=10)
    tp_out = decode_phase_metrics(make_system("ep").fit(trace, tp, np.random.default_rng(0)), trace)
    assert 0.0 <= tp_out["decode_lar"] <= 1.0 and tp_out["decode_tokens"] == 4


def test_a_trace_without_generated_tokens_says_so_once():
    trace = two_request_trace()
    prompt_only = make_trace(trace.meta, trace.offsets, trace.token_ids, trace.experts)
    plan = make_system("ep").fit(prompt_only, ParallelConfig(devices=2, attention="dp", tokens_per_step=8),
                                 np.random.default_rng(0))
    assert decode_summary(plan, prompt_only) == {"decode_phase": NO_DECODE}


def generated_trace_dir(path, generated: bool):
    rng = np.random.default_rng(0)
    lengths = rng.integers(12, 30, 60)
    n = int(lengths.sum())
    token_ids = rng.integers(0, 50, n)
    experts = np.stack([token_ids % 16, (token_ids + 5) % 16], axis=1)[:, None, :].repeat(2, axis=1)
    meta = TraceMeta(model="imported", num_experts=16, top_k=2, layer_ids=(3, 4), vocab_size=50, dataset="x")
    prefill = lengths - 8 if generated else None
    return write_trace(make_trace(meta, np.concatenate([[0], np.cumsum(lengths)]), token_ids, experts,
                                  prefill_len=prefill), path)


@pytest.mark.parametrize("attention", ["dp", "tp"])
def test_every_job_reports_decode_beside_prefill(tmp_path, attention):
    from repro.run import build_traces, fit_and_evaluate, metrics_text

    for generated in (True, False):
        trace = generated_trace_dir(tmp_path / f"t{generated}", generated)
        config = compose(f"trace={trace}", f"parallel.attention={attention}", "parallel.tokens_per_step=64",
                         "parallel.devices=4", "logger=none", "system=ep")
        summary, _, _ = fit_and_evaluate(config, *build_traces(config))
        metrics_text(summary, config)  # every decode number is finite and serialisable
        if generated:
            assert summary["decode_phase"] == "measured"
            assert summary["decode_tokens"] == summary["num_requests"] * 8 and summary["decode_steps"] == 8
            assert summary["decode_moe_seconds_per_step"] > 0 and 0 <= summary["decode_lar"] <= 1
            assert 0 <= summary["prefill_lar"] <= 1
            # the serving-shaped estimate: prompt tokens in prefill steps, generated ones in decode steps
            assert summary["time_estimate_serving_s"] == pytest.approx(
                summary["prefill_time_estimate_s"] + summary["decode_moe_seconds"])
            assert 0 < summary["prefill_time_estimate_s"] < summary["time_estimate_s"]
        else:
            assert summary["decode_phase"] == NO_DECODE
            assert summary["time_estimate_serving_s"] == summary["time_estimate_s"]
            assert not any(key.startswith("decode_") for key in summary if key != "decode_phase")


def test_the_report_puts_decode_time_beside_vanilla_ep():
    from repro.figures.report import decode_section

    runs = pd.DataFrame({
        "eval_workload": ["w"] * 3, "attention": ["dp"] * 3, "devices": [8] * 3, "system": ["ep", "signature", "ep"],
        "decode_phase": ["measured", "measured", NO_DECODE], "prefill_lar": [0.1, 0.2, np.nan],
        "decode_lar": [0.1, 0.3, np.nan], "decode_moe_seconds_per_step": [2e-3, 1e-3, np.nan],
    })
    text = "\n".join(decode_section(runs))
    assert "1 of 3 jobs: routing without generated tokens" in text
    row = next(line for line in text.splitlines() if "| signature" in line)
    assert "0.5" in row.split("|")[-2]  # decode_time_vs_ep of signature = 1 ms / 2 ms


@pytest.fixture
def fake_wandb(monkeypatch):
    import sys

    from test_tracking import FakeWandb

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")  # conftest disables W&B for every other test
    return fake


def test_the_decode_metrics_reach_metrics_json_and_wandb(tmp_path, fake_wandb):
    import json

    from omegaconf import OmegaConf

    from repro.run import run_job

    trace = generated_trace_dir(tmp_path / "trace", True)
    config = compose("logger=wandb", "name=trk", f"trace={trace}", "parallel.tokens_per_step=64", "parallel.devices=4",
                     "parallel.attention=dp", "system=signature")
    out = tmp_path / "runs" / "trk" / "job"
    summary = run_job(OmegaConf.create(config), out)
    written = json.loads((out / "metrics.json").read_text())["summary"]
    for key in ("decode_lar", "decode_step_token_imbalance_max_mean", "decode_device_distinct_experts_max",
                "decode_moe_seconds_per_step", "prefill_lar"):
        assert written[key] == summary[key] == fake_wandb.run.summary[key]
    assert written["decode_phase"] == "measured"


def test_decode_counts_do_not_depend_on_the_step_block(monkeypatch):
    """Distinct experts are counted a block of steps at a time: blocks of 1 and 7 steps give the 64-step numbers."""
    import repro.eval.decode_phase as decode_phase

    rng = np.random.default_rng(4)
    lengths = rng.integers(20, 150, 12)
    n = int(lengths.sum())
    experts = np.argsort(rng.random((n, 2, 8)), axis=2)[:, :, :2]
    meta = TraceMeta(model="r", num_experts=8, top_k=2, layer_ids=(0, 1), vocab_size=8, dataset="r")
    trace = make_trace(meta, np.concatenate([[0], np.cumsum(lengths)]), np.zeros(n, dtype=np.int64), experts,
                       prefill_len=np.full(12, 10))
    plan = make_system("ep").fit(trace, ParallelConfig(devices=4, attention="dp", tokens_per_step=8),
                                 np.random.default_rng(0))
    whole = decode_phase_metrics(plan, trace)
    assert whole["decode_steps"] > 64
    for block in (1, 7):
        monkeypatch.setattr(decode_phase, "STEPS_PER_BLOCK", block)
        assert decode_phase_metrics(plan, trace) == whole


def test_decode_in_waves_of_requests():
    """batch_requests=1: request 0 decodes alone (steps 0-1), then request 1 (steps 2-3); one token per step."""
    trace = two_request_trace()
    plan = make_system("ep").fit(trace, ParallelConfig(devices=2, attention="dp", tokens_per_step=8),
                                 np.random.default_rng(0))
    out = decode_phase_metrics(plan, trace, batch_requests=1)
    assert out["decode_steps"] == 4 and out["decode_batch_tokens_mean"] == 1.0
    assert out["decode_device_distinct_experts_max"] == 1.0  # one expert per step
    assert out["decode_step_token_imbalance_max_mean"] == 2.0  # one of two ranks busy
    assert out["decode_lar"] == 0.75  # the same tokens on the same ranks
    assert decode_phase_metrics(plan, trace, batch_requests=2) == decode_phase_metrics(plan, trace)
    with pytest.raises(ConfigError, match="batch_requests"):
        decode_phase_metrics(plan, trace, batch_requests=0)
