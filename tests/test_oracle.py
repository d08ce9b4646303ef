"""Oracle bounds: hand-made alignment cases, exact vs greedy, fit-oracle assignment, evaluator cross-checks."""

from itertools import permutations

import numpy as np
import pytest

from repro.errors import ConfigError, ReproError
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.systems.base import Placement
from repro.systems.oracle import align_exact, align_greedy, fit_request_assignment, local_scores
from repro.traces import TraceMeta, make_trace


def test_local_scores_with_replicas():
    present = np.array([[1, 0], [0, 1], [1, 1]], dtype=bool)  # expert 2 replicated on both devices
    assert local_scores(np.array([[0, 2], [1, 2], [0, 1]]), present).tolist() == [[2, 1], [1, 2], [1, 1]]


def test_alignment_hand_made():
    # 4 tokens, 2 devices, 2 slots each: three tokens prefer device 0; token 2 loses least by moving
    score = np.array([[2, 0], [2, 0], [2, 1], [0, 2]])
    for device in (align_exact(score, np.array([2, 2]), np.array([2, 2])), align_greedy(score, np.array([2, 2]))):
        assert device.tolist() == [0, 0, 1, 1]
        assert np.all(np.bincount(device, minlength=2) == 2)


def test_exact_alignment_is_optimal_and_never_below_greedy():
    rng = np.random.default_rng(0)
    for _ in range(5):
        score = rng.integers(0, 3, size=(9, 3))
        capacity = np.array([3, 3, 3])
        exact = align_exact(score, capacity, capacity)
        greedy = align_greedy(score, capacity)
        def value(device, score=score):
            return score[np.arange(9), device].sum()

        assert np.all(np.bincount(exact, minlength=3) == 3) and np.all(np.bincount(greedy, minlength=3) == 3)
        # brute force over all balanced assignments of 9 tokens to 3 devices (1680 of them)
        best = max(value(np.array(p)) for p in set(permutations([0, 0, 0, 1, 1, 1, 2, 2, 2])))
        assert value(exact) == best >= value(greedy)


def planted_trace(seed=0, num_requests=24, length=16, num_experts=8, num_layers=2, top_k=2, communities=4):
    rng = np.random.default_rng(seed)
    label = rng.integers(0, communities, num_requests)
    request = np.repeat(np.arange(num_requests), length)
    per = num_experts // communities
    home = label[request]
    noisy = rng.random(len(request)) < 0.2
    group = np.where(noisy, rng.integers(0, communities, len(request)), home)
    experts = np.stack([group * per, group * per + 1], axis=-1)[:, None, :].repeat(num_layers, axis=1)
    meta = TraceMeta(model="t", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(num_layers)), vocab_size=40)
    return make_trace(meta, np.arange(num_requests + 1) * length, rng.integers(0, 40, len(request)), experts)


def test_fit_request_assignment_recovers_communities_and_is_balanced():
    trace = planted_trace()
    ranks, placement, history = fit_request_assignment(trace, Placement(np.tile(np.arange(8), (2, 1)), 4, 8), rounds=3)
    assert np.all(np.diff(history) >= -1e-9)  # alternation never loses local activations
    counts = np.bincount(ranks, minlength=4)
    assert counts.max() - counts.min() <= 1


def evaluate_or_skip():
    accounting = pytest.importorskip("repro.eval.accounting")
    return accounting.evaluate


def test_fit_oracle_dp_bounds_vanilla_and_matches_evaluator():
    evaluate = evaluate_or_skip()
    trace = planted_trace()
    parallel = ParallelConfig(devices=4, attention="dp", tokens_per_step=16)
    rng = np.random.default_rng(0)
    oracle = make_system("fit_oracle", base="ep").fit(trace, parallel, rng)
    assert make_system("fit_oracle").fits_on_evaluation is True
    lar_oracle = evaluate(oracle, trace).summary["lar"]
    lar_ep = evaluate(make_system("ep").fit(trace, parallel, rng), trace).summary["lar"]
    assert lar_oracle == pytest.approx(oracle.info["oracle_lar_fit"])
    assert lar_oracle > lar_ep
    other = planted_trace(seed=1)
    with pytest.raises(ConfigError, match="fitted on another trace"):
        oracle.reset()
        oracle.assign_requests(other.token_ids, other.offsets, other.prefill_len)


def test_token_oracle_tp_is_an_upper_bound_and_matches_evaluator():
    evaluate = evaluate_or_skip()
    trace = planted_trace()
    parallel = ParallelConfig(devices=4, attention="tp", tokens_per_step=32)
    rng = np.random.default_rng(0)
    plans = {
        "ep": make_system("ep").fit(trace, parallel, rng),
        "oracle": make_system("token_oracle", base="ep").fit(trace, parallel, rng),
        "greedy": make_system("token_oracle", base="ep", align="greedy").fit(trace, parallel, rng),
    }
    lar = {name: evaluate(plan, trace).summary["lar"] for name, plan in plans.items()}
    assert lar["oracle"] == pytest.approx(plans["oracle"].info["oracle_lar_aligned"])
    assert lar["ep"] < lar["greedy"] <= lar["oracle"] <= plans["oracle"].info["oracle_lar_unaligned"] + 1e-12


def test_token_oracle_same_seed_same_plan_and_bad_input():
    trace = planted_trace()
    tp = ParallelConfig(devices=4, attention="tp", tokens_per_step=32)
    plan = make_system("token_oracle", base="ep").fit(trace, tp, np.random.default_rng(0))
    token_ids = np.asarray(trace.token_ids[:32])
    current = np.asarray(trace.experts[:32, 0, :])
    first = plan.shuffle_tokens(token_ids, 0, None, current_experts=current)
    second = plan.shuffle_tokens(token_ids, 0, None, current_experts=current)
    assert np.array_equal(first[0], second[0]) and np.array_equal(first[1], second[1])
    assert sorted(first[0].tolist()) == list(range(32)) and first[1].tolist() == [8, 8, 8, 8]
    with pytest.raises(ReproError, match="needs current_experts"):
        plan.shuffle_tokens(token_ids, 0, None)
    with pytest.raises(ConfigError, match="Attention-TP only"):
        make_system("token_oracle", base="ep").fit(trace, ParallelConfig(devices=4, tokens_per_step=32), np.random.default_rng(0))
    with pytest.raises(ConfigError, match="would recurse"):
        make_system("token_oracle", base="token_oracle").fit(trace, tp, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="align must be one of"):
        make_system("fit_oracle", align="best")


def test_fit_oracle_on_semmoe_base():
    pytest.importorskip("repro.systems.semmoe")
    trace = planted_trace()
    parallel = ParallelConfig(devices=4, attention="dp", tokens_per_step=16)
    plan = make_system("fit_oracle").fit(trace, parallel, np.random.default_rng(0))
    assert plan.info["oracle_lar_fit"] >= plan.info["oracle_lar_first_round"]
    assert np.all(np.apply_along_axis(np.bincount, 1, plan.placement.expert_device(), minlength=4) == 2)
