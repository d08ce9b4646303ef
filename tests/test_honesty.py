"""Tests that guard the honesty of reported numbers.

- No leakage: a deployed system never sees routing it could not know online. Black box: change the evaluated
  routing a system may not see and check that its decisions do not move (bounds, which see it by definition,
  are the positive control that the change was visible).
- Bounds bound: every bound's LAR >= the LAR of every system it bounds, on the same run.
- Routing models learn only from the profile split.
- Cross-dataset runs really evaluate the other workload.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from test_run import ROOT, compose, synthetic_trace_dir

from repro.eval import evaluate
from repro.eval.accounting import home_devices
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.traces import TraceMeta, make_trace, read_trace, select_requests, split_trace

DEPLOYED = ("ep", "semmoe", "moetuner", "eplb")
SHARED = ROOT.parent / "shared" / "data"


def routed_trace(seed=0, num_requests=80, num_experts=16, top_k=2, layers=4):
    """Token-determined routing with noise and layer-to-layer persistence, so every system has something to learn."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 30, num_requests)
    n = int(lengths.sum())
    token_ids = rng.integers(0, 60, n)
    favourite = rng.permutation(np.arange(60 * top_k) % num_experts).reshape(60, top_k)
    experts = np.empty((n, layers, top_k), dtype=np.int64)
    experts[:, 0] = favourite[token_ids]
    for layer in range(1, layers):
        shifted = (experts[:, layer - 1] + layer) % num_experts
        noisy = rng.random(n) < 0.3
        shifted[noisy] = np.argsort(rng.random((int(noisy.sum()), num_experts)), axis=1)[:, :top_k]
        experts[:, layer] = shifted
    dup = experts[:, :, 0] == experts[:, :, 1]
    experts[:, :, 1][dup] = (experts[:, :, 1][dup] + 1) % num_experts
    meta = TraceMeta(model="toy", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(layers)),
                     vocab_size=60, dataset="toy")
    return make_trace(meta, np.concatenate([[0], np.cumsum(lengths)]), token_ids, experts)


def with_experts(trace, experts):
    return make_trace(trace.meta, trace.offsets, trace.token_ids, experts, prefill_len=trace.prefill_len,
                      request_ids=trace.request_ids, request_labels=trace.request_labels)


def requests_rerouted(trace, requests):
    """The same tokens with every expert of `requests` shifted by 5 (mod E): their routing changed, the rest kept."""
    rows = np.concatenate([np.arange(trace.offsets[r], trace.offsets[r + 1]) for r in requests])
    experts = np.array(trace.experts)
    experts[rows] = (experts[rows] + 5) % trace.meta.num_experts
    return with_experts(trace, experts)


def scrambled(trace, from_layer, seed=1):
    """The same tokens with the routing of layers >= from_layer replaced by random distinct experts."""
    rng = np.random.default_rng(seed)
    experts = np.array(trace.experts)
    n, layers, k = experts.shape
    fresh = np.argsort(rng.random((n, layers - from_layer, trace.meta.num_experts)), axis=2)[:, :, :k]
    experts[:, from_layer:] = fresh
    return with_experts(trace, experts)


def fitted(name, profile, devices, attention, **params):
    parallel = ParallelConfig(devices=devices, attention=attention, tokens_per_step=128)
    return make_system(name, **params).fit(profile, parallel, np.random.default_rng(0))


@pytest.mark.parametrize("system", DEPLOYED)
def test_tp_decisions_up_to_a_layer_ignore_that_layers_routing_and_later(system):
    """Attention-TP: the device of each token at layer l may depend on the routing of layers < l only."""
    profile, evaluation = split_trace(routed_trace(), 0.3, np.random.default_rng(0))
    plan = fitted(system, profile, 4, "tp")
    home = home_devices(plan, evaluation, history=2)
    for cut in range(evaluation.num_layers):
        changed = home_devices(plan, scrambled(evaluation, cut), history=2)
        np.testing.assert_array_equal(changed[:, : cut + 1], home[:, : cut + 1], err_msg=f"{system}, layer {cut}")


def test_token_oracle_sees_the_current_layer_positive_control():
    profile, evaluation = split_trace(routed_trace(), 0.3, np.random.default_rng(0))
    plan = fitted("token_oracle", profile, 4, "tp")
    home = home_devices(plan, evaluation, history=2)
    changed = home_devices(plan, scrambled(evaluation, 2), history=2)
    np.testing.assert_array_equal(changed[:, :2], home[:, :2])
    assert (changed[:, 2] != home[:, 2]).any()


@pytest.mark.parametrize("system", DEPLOYED)
def test_dp_assignment_ignores_all_evaluated_routing(system):
    """Attention-DP: a request's rank is decided from its prompt tokens, before any of its routing exists."""
    profile, evaluation = split_trace(routed_trace(), 0.3, np.random.default_rng(0))
    plan = fitted(system, profile, 4, "dp")
    home = home_devices(plan, evaluation)
    np.testing.assert_array_equal(home_devices(plan, scrambled(evaluation, 0)), home)


TIME_SCHEDULER = {"dp_scheduler": "time", "dp_balance_weight": 0.5}


def with_generated(trace, generated, seed=2):
    """The same prompts (ids, lengths) followed by generated[r] new tokens of request r with random ids and routing."""
    rng = np.random.default_rng(seed)
    prompt = np.asarray(trace.prefill_len, dtype=np.int64)
    pieces_ids, pieces_experts = [], []
    for r in range(trace.num_requests):
        start = trace.offsets[r]
        pieces_ids += [trace.token_ids[start : start + prompt[r]], rng.integers(60, size=generated[r])]
        fresh = np.argsort(rng.random((generated[r], trace.num_layers, trace.meta.num_experts)), axis=2)
        pieces_experts += [trace.experts[start : start + prompt[r]], fresh[:, :, : trace.meta.top_k]]
    offsets = np.concatenate([[0], np.cumsum(prompt + generated)])
    return make_trace(trace.meta, offsets, np.concatenate(pieces_ids), np.concatenate(pieces_experts), prefill_len=prompt)


def test_time_scheduler_ignores_evaluated_routing_and_generated_tokens():
    """dp_scheduler=time: a request's rank comes from its prompt and the earlier requests only: scrambling the
    evaluated routing, or changing how many tokens each request generates (unknown at arrival; the scheduler
    uses the profile's expected count), moves no rank; streamed one request at a time it gives the same ranks."""
    profile, evaluation = split_trace(routed_trace(), 0.3, np.random.default_rng(0))
    plan = fitted("semmoe", profile, 4, "dp", **TIME_SCHEDULER)
    home = home_devices(plan, evaluation)
    np.testing.assert_array_equal(home_devices(plan, scrambled(evaluation, 0)), home)
    rng = np.random.default_rng(4)
    ranks = []
    for generated in (np.zeros(evaluation.num_requests, np.int64), rng.integers(0, 40, evaluation.num_requests)):
        decoded = with_generated(evaluation, generated)
        plan.reset()
        ranks.append(plan.assign_requests(decoded.token_ids, decoded.offsets, decoded.prefill_len))
    np.testing.assert_array_equal(ranks[0], ranks[1])
    np.testing.assert_array_equal(ranks[0], home[evaluation.offsets[:-1], 0])
    plan.reset()
    one_by_one = [plan.assign_requests(evaluation.token_ids[evaluation.offsets[r] : evaluation.offsets[r + 1]],
                                       evaluation.offsets[r : r + 2] - evaluation.offsets[r], evaluation.prefill_len[r : r + 1])
                  for r in range(evaluation.num_requests)]
    np.testing.assert_array_equal(np.concatenate(one_by_one), ranks[0])
    # positive control: the scheduler does read prompts (rewriting them moves ranks)
    rewritten = make_trace(evaluation.meta, evaluation.offsets, (np.asarray(evaluation.token_ids) * 7 + 3) % 60,
                           evaluation.experts, prefill_len=evaluation.prefill_len)
    assert not np.array_equal(home_devices(plan, rewritten), home)


@pytest.mark.parametrize("attention", ["dp", "tp"])
def test_the_app_fits_deployed_systems_on_the_profile_only(tmp_path, attention):
    """Through the app: scrambling the routing of the evaluate split leaves every deployed plan unchanged;
    a hindsight system (fit_assign) moves, showing the scramble was visible."""
    from repro.run import build_traces, fit_and_evaluate, request_split

    trace_dir = synthetic_trace_dir(tmp_path / "t")
    overrides = [f"trace={trace_dir}", f"parallel.attention={attention}", "parallel.tokens_per_step=256", "logger=none"]
    trace = read_trace(trace_dir, mmap=False)
    split = request_split(compose(*overrides), trace.num_requests)
    rows = np.concatenate([np.arange(trace.offsets[r], trace.offsets[r + 1]) for r in split.evaluate])
    experts = np.array(trace.experts)
    experts[rows] = (experts[rows] + 5) % trace.meta.num_experts
    changed = with_experts(trace, experts)

    def placements(system, routing):
        config = compose(*overrides, f"system={system}")
        profile, evaluation = build_traces(config)
        if routing is not None:
            evaluation = select_requests(routing, split.evaluate)
        _, _, plan = fit_and_evaluate(config, profile, evaluation)
        return plan.placement.physical_to_logical

    for system in DEPLOYED:
        np.testing.assert_array_equal(placements(system, None), placements(system, changed), err_msg=system)
    if attention == "dp":
        assert not np.array_equal(placements("fit_assign", None), placements("fit_assign", changed))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_bound_is_at_least_every_system_it_bounds(seed):
    """TP: the token oracle on a system's placement >= that system. DP: dp_bound >= every DP system."""
    profile, evaluation = split_trace(routed_trace(seed=seed), 0.3, np.random.default_rng(seed))
    for system in DEPLOYED:
        lar = evaluate(fitted(system, profile, 4, "tp"), evaluation).summary["lar"]
        oracle = evaluate(fitted("token_oracle", profile, 4, "tp", base=system), evaluation).summary["lar"]
        assert oracle >= lar - 1e-12, (system, oracle, lar)
    bound_plan = fitted("dp_bound", evaluation, 4, "dp")
    bound = bound_plan.info["lar_bound"]
    assert evaluate(bound_plan, evaluation).summary["lar"] <= bound + 1e-12  # its feasible witness
    for system in DEPLOYED + ("fit_assign",):
        fit_on = evaluation if system == "fit_assign" else profile
        lar = evaluate(fitted(system, fit_on, 4, "dp"), evaluation).summary["lar"]
        assert bound >= lar - 1e-12, (system, bound, lar)


def test_routing_models_learn_from_the_profile_split_only(monkeypatch, tmp_path):
    """The app hands a routing producer exactly the profile requests of the training workload."""
    import repro.routing
    import repro.run

    seen = {}

    def fake_route(model_cfg, requests, train_requests, **kwargs):
        seen["all"] = [r.id for r in requests]
        seen["train"] = [r.id for r in train_requests]
        raise RuntimeError("stop after the call")

    monkeypatch.setattr(repro.routing, "route_workload", fake_route)
    config = compose("experiment=smoke", "logger=none", f"cache_dir={tmp_path}")
    with pytest.raises(RuntimeError, match="stop after the call"):
        repro.run.build_traces(config)
    split = repro.run.request_split(config, len(seen["all"]))
    assert seen["train"] == [seen["all"][i] for i in split.profile]
    assert not set(seen["train"]) & {seen["all"][i] for i in np.concatenate([split.validate, split.evaluate])}


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "arena-hard").exists(), reason="needs ../shared/data (arena-hard prompts)")
def test_cross_dataset_evaluates_the_other_workload(tmp_path):
    """eval_workload for real: profile on MMLU, evaluate zero-shot on arena-hard prompts, one routing model."""
    env = dict(os.environ, WANDB_MODE="disabled", REPRO_CACHE=str(tmp_path / "cache"))
    small = ["model.num_layers=2", "model.hidden_size=32", "model.intermediate_size=64",
             "model.num_attention_heads=2", "model.vocab_top=1024", "model.seq_len=64", "model.max_steps=20",
             "workload.num_requests=150", "+workload@eval_workload=arena_hard", "eval_workload.num_requests=120",
             "train_workload.num_requests=150", "system=semmoe"]
    res = subprocess.run(
        [sys.executable, "-m", "repro.run", "experiment=cross_dataset", "logger=none", *small,
         f"hydra.run.dir={tmp_path / 'job'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "job" / "metrics.json").read_text())["summary"]
    assert summary["dataset"] == "arena_hard" and summary["profile_dataset"] == "mmlu"
    assert summary["num_requests"] == 120 - 24 - 12  # arena-hard's evaluate split (70 %)


LEARNED = {"dp_predictor": "learned", "dp_scheduler": "time", "dp_balance_weight": 0.05}


@pytest.mark.parametrize("params", [LEARNED, {"dp_predictor": "learned", "dp_scheduler": "paper"}])
def test_learned_predictor_ranks_ignore_evaluated_routing_and_stream(params):
    """dp_predictor=learned: the ranks come from the prompts only (scrambling every evaluated layer moves none), and
    one request at a time gives the ranks of one batch call; rewriting the prompts does move ranks (control)."""
    profile, evaluation = split_trace(routed_trace(), 0.3, np.random.default_rng(0))
    plan = fitted("semmoe", profile, 4, "dp", **params)
    home = home_devices(plan, evaluation)
    np.testing.assert_array_equal(home_devices(plan, scrambled(evaluation, 0)), home)
    plan.reset()
    batch = plan.assign_requests(evaluation.token_ids, evaluation.offsets, evaluation.prefill_len)
    plan.reset()
    one_by_one = [plan.assign_requests(evaluation.token_ids[evaluation.offsets[r] : evaluation.offsets[r + 1]],
                                       evaluation.offsets[r : r + 2] - evaluation.offsets[r], evaluation.prefill_len[r : r + 1])
                  for r in range(evaluation.num_requests)]
    np.testing.assert_array_equal(np.concatenate(one_by_one), batch)
    np.testing.assert_array_equal(batch, home[evaluation.offsets[:-1], 0])
    rewritten = make_trace(evaluation.meta, evaluation.offsets, (np.asarray(evaluation.token_ids) * 7 + 3) % 60,
                           evaluation.experts, prefill_len=evaluation.prefill_len)
    assert not np.array_equal(home_devices(plan, rewritten), home)


def test_the_app_fits_the_learned_predictor_on_the_profile_only(tmp_path):
    """Through the app: scrambling the routing of every validate and evaluate request leaves the learned predictor's
    table and the evaluated ranks bit for bit; scrambling the profile's routing changes the table (control)."""
    from repro.run import build_traces, fit_and_evaluate, request_split

    trace_dir = synthetic_trace_dir(tmp_path / "t")
    overrides = [f"trace={trace_dir}", "parallel.attention=dp", "parallel.tokens_per_step=256", "logger=none",
                 "system=semmoe", *[f"system.params.{k}={v}" for k, v in LEARNED.items()]]
    config = compose(*overrides)
    trace = read_trace(trace_dir, mmap=False)
    split = request_split(config, trace.num_requests)

    def fitted_plan(routing):
        profile, evaluation = build_traces(config)
        if routing is not None:
            profile = select_requests(routing, split.profile)
            evaluation = select_requests(routing, split.evaluate)
        _, _, plan = fit_and_evaluate(config, profile, evaluation)
        plan.reset()
        return plan, plan.assign_requests(evaluation.token_ids, evaluation.offsets, evaluation.prefill_len)

    plan, ranks = fitted_plan(None)
    assert plan.dp_predictor == "learned"
    unseen = np.concatenate([split.validate, split.evaluate])
    plan_moved, ranks_moved = fitted_plan(requests_rerouted(trace, unseen))
    np.testing.assert_array_equal(plan_moved.learned_table, plan.learned_table)
    np.testing.assert_array_equal(ranks_moved, ranks)
    plan_profile, _ = fitted_plan(requests_rerouted(trace, split.profile))
    assert not np.array_equal(plan_profile.learned_table, plan.learned_table)
