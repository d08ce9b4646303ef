"""Token oracle and fit_assign: hand-made alignment cases, exact LP vs the MILP reference vs greedy, fit_assign's
request assignment, evaluator cross-checks. The Attention-DP ceiling is tested in test_bounds.py."""

from itertools import permutations, product

import numpy as np
import pytest

from repro.errors import ConfigError, ReproError
from repro.eval import evaluate
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.systems.base import Placement
from repro.systems.fit_assign import fit_request_assignment, token_balanced_assign
from repro.systems.oracle import (
    align_exact,
    align_greedy,
    local_scores,
    max_weight_transport,
    max_weight_transport_milp,
)
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


def test_lp_transport_matches_the_milp_reference():
    rng = np.random.default_rng(1)
    for trial in range(20):
        num_types, num_bins = int(rng.integers(1, 40)), int(rng.integers(1, 6))
        score = rng.integers(0, 5, size=(num_types, num_bins)).astype(float) + (trial % 2) * rng.random((num_types, num_bins))
        count = rng.integers(1, 9, num_types)
        floor, extra = divmod(int(count.sum()), num_bins)
        lower, upper = np.full(num_bins, floor), np.full(num_bins, floor + (extra > 0))
        fast = max_weight_transport(score, lower, upper, count, what="test")
        slow = max_weight_transport_milp(score, lower, upper, count, what="test")
        for x in (fast, slow):  # a feasible integral assignment
            assert np.array_equal(x.sum(axis=1), count) and np.all(x >= 0)
            assert np.all(x.sum(axis=0) >= lower) and np.all(x.sum(axis=0) <= upper)
        assert (fast * score).sum() == pytest.approx((slow * score).sum(), abs=1e-9)


@pytest.mark.parametrize("num_tokens,num_devices,top_k,replicated", [(33, 4, 2, False), (511, 8, 6, False), (64, 3, 3, True)])
def test_exact_alignment_equals_the_reference_on_random_routing(num_tokens, num_devices, top_k, replicated):
    rng = np.random.default_rng(num_tokens)
    num_experts = 8 * num_devices
    present = np.zeros((num_experts, num_devices), dtype=bool)
    present[np.arange(num_experts), rng.permutation(np.arange(num_experts) % num_devices)] = True
    if replicated:  # a few experts with a second replica, one expert map with missing local copies
        present[rng.choice(num_experts, 4, replace=False), rng.integers(0, num_devices, 4)] = True
    popularity = rng.dirichlet(np.full(num_experts, 0.3))
    experts = np.stack([rng.choice(num_experts, top_k, replace=False, p=popularity) for _ in range(num_tokens)])
    score = local_scores(experts, present)
    floor = num_tokens // num_devices
    lower, upper = np.full(num_devices, floor), np.full(num_devices, floor + (num_tokens % num_devices > 0))
    fast, slow = align_exact(score, lower, upper), align_exact(score, lower, upper, reference=True)
    for device in (fast, slow):
        load = np.bincount(device, minlength=num_devices)
        assert np.all(load >= lower) and np.all(load <= upper)
    picked = np.arange(num_tokens)
    greedy = align_greedy(score, lower + (np.arange(num_devices) < num_tokens % num_devices))
    assert score[picked, fast].sum() == score[picked, slow].sum() >= score[picked, greedy].sum()


def planted_trace(seed=0, num_requests=24, length=16, num_experts=8, num_layers=2, top_k=2, communities=4, spread=0):
    """Requests of `length` tokens (± spread, drawn uniformly) in planted expert communities."""
    rng = np.random.default_rng(seed)
    label = rng.integers(0, communities, num_requests)
    lengths = length + rng.integers(-spread, spread + 1, num_requests)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    request = np.repeat(np.arange(num_requests), lengths)
    per = num_experts // communities
    home = label[request]
    noisy = rng.random(len(request)) < 0.2
    group = np.where(noisy, rng.integers(0, communities, len(request)), home)
    experts = np.stack([group * per, group * per + 1], axis=-1)[:, None, :].repeat(num_layers, axis=1)
    meta = TraceMeta(model="t", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(num_layers)), vocab_size=40)
    return make_trace(meta, offsets, rng.integers(0, 40, len(request)), experts)


def test_fit_request_assignment_recovers_communities_and_is_balanced():
    trace = planted_trace()
    ranks, placement, history, _ = fit_request_assignment(trace, Placement(np.tile(np.arange(8), (2, 1)), 4, 8), rounds=3)
    assert np.all(np.diff(history) >= -1e-9)  # alternation never loses local activations
    counts = np.bincount(ranks, minlength=4)
    assert counts.max() - counts.min() <= 1


def brute_force(score, length, capacity=np.inf, count=None):
    """Best Σ score over all assignments with every rank's load <= capacity (and exactly `count` requests)."""
    num_requests, num_devices = score.shape
    best = -np.inf
    for ranks in product(range(num_devices), repeat=num_requests):
        ranks = np.array(ranks)
        load = np.bincount(ranks, weights=length, minlength=num_devices)
        if load.max() > capacity or (count is not None and np.any(np.bincount(ranks, minlength=num_devices) != count)):
            continue
        best = max(best, score[np.arange(num_requests), ranks].sum())
    return best


def test_token_balance_and_count_balance_choose_different_assignments():
    # two long requests both prefer rank 0: 2 + 2 requests per rank puts both there (loads 20 / 2); a token
    # cap of 1.1 x mean = 12.1 splits them and sends the two short ones to rank 0 instead (loads 12 / 10)
    score = np.array([[5.0, 0.0], [4.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    length = np.array([10, 10, 1, 1])
    by_count = np.argmax(max_weight_transport(score, np.array([2, 2]), np.array([2, 2]), what="test"), axis=1)
    assert by_count.tolist() == [0, 0, 1, 1]
    assert np.bincount(by_count, weights=length).tolist() == [20.0, 2.0]
    by_tokens, bound = token_balanced_assign(score, length, 1.1 * length.sum() / 2, what="test")
    assert by_tokens.tolist() == [0, 1, 0, 0]
    assert np.bincount(by_tokens, weights=length).tolist() == [12.0, 10.0]
    value = score[np.arange(4), by_tokens].sum()
    assert value == 7.0 == brute_force(score, length, 12.1) < brute_force(score, length, count=2) == 9.0
    assert value <= bound + 1e-9


def test_token_balanced_assign_respects_the_cap_and_the_lp_bound():
    rng = np.random.default_rng(3)
    for _ in range(6):  # tiny and tight: the rounding may overflow, but by less than one request
        score = rng.integers(0, 6, size=(7, 3)).astype(float)
        length = rng.integers(1, 9, size=7)
        capacity = 1.2 * length.sum() / 3
        ranks, bound = token_balanced_assign(score, length, capacity, what="test")
        load = np.bincount(ranks, weights=length, minlength=3)
        value = score[np.arange(7), ranks].sum()
        assert load.max() <= capacity + length.max()
        assert brute_force(score, length, capacity) <= bound + 1e-9
        if load.max() <= capacity:
            assert value <= brute_force(score, length, capacity)
    # many short requests (the evaluated traces): the cap holds and at most D requests lose their score
    score = rng.random((300, 4)) * 10
    length = rng.integers(5, 60, size=300)
    capacity = 1.05 * length.sum() / 4
    ranks, bound = token_balanced_assign(score, length, capacity, what="test")
    assert np.bincount(ranks, weights=length, minlength=4).max() <= capacity
    assert bound - 4 * score.max() <= score[np.arange(300), ranks].sum() <= bound + 1e-9
    again, _ = token_balanced_assign(score, length, capacity, what="test")
    assert np.array_equal(ranks, again)


def test_fit_assign_token_balance_bounds_token_load_and_vanilla():
    trace = planted_trace(num_requests=40, spread=12)
    parallel = ParallelConfig(devices=4, attention="dp", tokens_per_step=16)
    rng = np.random.default_rng(0)
    balanced = make_system("fit_assign", base="ep", token_balance=1.1).fit(trace, parallel, rng)
    by_count = make_system("fit_assign", base="ep", token_balance=None).fit(trace, parallel, rng)
    summary = {name: evaluate(plan, trace).summary for name, plan in (("balanced", balanced), ("count", by_count))}
    lar_ep = evaluate(make_system("ep").fit(trace, parallel, rng), trace).summary["lar"]
    assert summary["balanced"]["token_imbalance_max_mean"] <= 1.1 + 1e-9
    assert summary["balanced"]["token_imbalance_max_mean"] == pytest.approx(balanced.info["oracle_token_imbalance_fit"])
    assert summary["balanced"]["lar"] == pytest.approx(balanced.info["oracle_lar_fit"])
    assert lar_ep < summary["balanced"]["lar"] <= balanced.info["oracle_lar_lp_bound"] + 1e-12
    assert "oracle_lar_lp_bound" not in by_count.info
    by_count.reset()
    counts = np.bincount(by_count.assign_requests(trace.token_ids, trace.offsets, trace.prefill_len), minlength=4)
    assert counts.max() - counts.min() <= 1
    with pytest.raises(ConfigError, match="token_balance must be >= 1"):
        make_system("fit_assign", token_balance=0.9)


def test_fit_assign_dp_beats_vanilla_on_planted_routing_and_matches_evaluator():
    trace = planted_trace()
    parallel = ParallelConfig(devices=4, attention="dp", tokens_per_step=16)
    rng = np.random.default_rng(0)
    oracle = make_system("fit_assign", base="ep").fit(trace, parallel, rng)
    assert make_system("fit_assign").fits_on_evaluation is True
    lar_oracle = evaluate(oracle, trace).summary["lar"]
    lar_ep = evaluate(make_system("ep").fit(trace, parallel, rng), trace).summary["lar"]
    assert lar_oracle == pytest.approx(oracle.info["oracle_lar_fit"])
    assert lar_oracle > lar_ep
    other = planted_trace(seed=1)
    with pytest.raises(ConfigError, match="fitted on another trace"):
        oracle.reset()
        oracle.assign_requests(other.token_ids, other.offsets, other.prefill_len)


def test_token_oracle_tp_is_an_upper_bound_and_matches_evaluator():
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
    # the exact oracle is a bound whose plan evaluates to its ceiling; greedy alignment is no ceiling
    assert make_system("token_oracle").kind == "bound" and make_system("token_oracle", align="greedy").kind == "hindsight"
    assert plans["oracle"].info["lar_bound"] == pytest.approx(lar["oracle"])
    per_layer = evaluate(plans["oracle"], trace).per_layer["lar"].to_numpy()
    assert np.allclose(plans["oracle"].info["lar_bound_per_layer"], per_layer)
    assert "lar_bound" not in plans["greedy"].info
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
        make_system("fit_assign", align="best")


def test_fit_assign_on_semmoe_base():
    trace = planted_trace()
    parallel = ParallelConfig(devices=4, attention="dp", tokens_per_step=16)
    plan = make_system("fit_assign").fit(trace, parallel, np.random.default_rng(0))
    assert plan.info["oracle_lar_fit"] >= plan.info["oracle_lar_first_round"]
    assert np.all(np.apply_along_axis(np.bincount, 1, plan.placement.expert_device(), minlength=4) == 2)
