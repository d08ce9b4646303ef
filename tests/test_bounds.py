"""The Attention-DP ceiling (dp_bound): a hand-made case where hindsight fitting loses to round-robin, and random
tiny instances where the LP bound >= the exact joint MILP optimum >= every DP system's evaluated LAR."""

import numpy as np
import pytest

from repro.errors import ConfigError
from repro.eval import evaluate
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.systems.dp_bound import dp_exact_milp, dp_lar_bound, layer_bound
from repro.systems.fit_assign import request_device_scores
from repro.traces import TraceMeta, make_trace

# every DP system of the suite that obeys the request-count balance (<= ceil(R/D) requests per rank) with E/D
# experts per device; fit_assign with its default token balance may break the count balance and is checked apart
DP_SYSTEMS = [("ep", {}), ("semmoe", {}), ("semmoe", {"dp_assign": "batch_window"}), ("semmoe", {"expert_load_cap": 1.0}),
              ("moetuner", {}), ("eplb", {}), ("fit_assign", {"token_balance": None}),
              ("fit_assign", {"token_balance": None, "expert_load_cap": 1.0})]


def alternating_trace(num_requests=8):
    """Requests alternating 10 tokens on expert 0 and 1 token on expert 1 (E = 2, top-1, one layer)."""
    lengths = np.where(np.arange(num_requests) % 2 == 0, 10, 1)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    experts = np.repeat(np.arange(num_requests) % 2, lengths)[:, None, None]
    meta = TraceMeta(model="t", num_experts=2, top_k=1, layer_ids=(0,), vocab_size=10)
    return make_trace(meta, offsets, np.zeros(offsets[-1]), experts)


def random_trace(seed, num_requests=7, num_experts=4, num_layers=2, top_k=2):
    """Tiny skewed routing: each request prefers a random pair of experts, lengths 1..6."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 7, num_requests)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    experts = np.empty((offsets[-1], num_layers, top_k), dtype=np.int64)
    for r in range(num_requests):
        for layer in range(num_layers):
            p = rng.dirichlet(np.full(num_experts, 0.4))
            for t in range(offsets[r], offsets[r + 1]):
                experts[t, layer] = rng.choice(num_experts, top_k, replace=False, p=p)
    meta = TraceMeta(model="t", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(num_layers)), vocab_size=50)
    return make_trace(meta, offsets, rng.integers(0, 50, offsets[-1]), experts)


def evaluated(name, params, trace, parallel):
    """(LAR, most requests on one rank) of a system fitted on the evaluated trace itself (the strongest fit)."""
    plan = make_system(name, **params).fit(trace, parallel, np.random.default_rng(0))
    plan.reset()
    ranks = plan.assign_requests(trace.token_ids, trace.offsets, trace.prefill_len)
    return evaluate(plan, trace).summary["lar"], int(np.bincount(ranks, minlength=parallel.devices).max())


def test_alternating_lengths_round_robin_is_optimal_and_the_bound_says_so():
    trace = alternating_trace()
    parallel = ParallelConfig(devices=2, attention="dp", tokens_per_step=16)
    lar = {name: evaluated(name, params, trace, parallel)[0] for name, params in DP_SYSTEMS}
    lar["fit_assign_token_balanced"] = evaluated("fit_assign", {}, trace, parallel)[0]
    plan = make_system("dp_bound").fit(trace, parallel, np.random.default_rng(0))
    assert lar["ep"] == 1.0
    assert lar["fit_assign_token_balanced"] < 1.0  # the former "fit oracle" was no ceiling
    assert plan.info["lar_bound"] == pytest.approx(1.0) and plan.info["lar_bound_per_layer"] == pytest.approx([1.0])
    assert plan.info["lar_feasible"] == pytest.approx(1.0) and plan.info["bound_gap"] == pytest.approx(0.0)
    assert all(value <= plan.info["lar_bound"] + 1e-12 for value in lar.values())
    assert evaluate(plan, trace).summary["lar"] == pytest.approx(plan.info["lar_feasible"])


@pytest.mark.parametrize("seed", range(6))
def test_bound_exceeds_exact_optimum_exceeds_every_dp_system(seed):
    trace = random_trace(seed, num_requests=6 + seed % 3)
    parallel = ParallelConfig(devices=2, attention="dp", tokens_per_step=16)
    _, per_layer = request_device_scores(trace, np.ones((trace.num_layers, 4, 1), dtype=bool))
    total = sum(counts.sum() for counts in per_layer)
    exact, _ = dp_exact_milp(per_layer, 2)
    plan = make_system("dp_bound").fit(trace, parallel, np.random.default_rng(0))
    bound, feasible = plan.info["lar_bound"], plan.info["lar_feasible"]
    assert bound >= exact / total - 1e-9 >= feasible - 2e-9
    assert evaluate(plan, trace).summary["lar"] == pytest.approx(feasible)
    q = -(-trace.num_requests // 2)
    for name, params in DP_SYSTEMS:
        lar, most = evaluated(name, params, trace, parallel)
        assert most <= q, f"{name} breaks the request-count balance the bound assumes"
        assert lar <= exact / total + 1e-9, name
    lar, most = evaluated("fit_assign", {}, trace, parallel)  # token-balanced: bounded when it keeps the counts
    if most <= q:
        assert lar <= exact / total + 1e-9
    # replicas: the bound with P = E + 2 slots covers EPLB with 2 redundant slots and is no lower than with P = E
    replicated = make_system("dp_bound", num_redundant=2).fit(trace, parallel, np.random.default_rng(0))
    assert replicated.info["lar_bound"] >= bound - 1e-12
    assert evaluated("eplb", {"num_redundant": 2}, trace, parallel)[0] <= replicated.info["lar_bound"] + 1e-12


def test_layer_bound_is_the_b_matching_by_hand():
    # 4 requests, 2 experts, 2 ranks: each request may hold 1 expert locally and each expert 2 requests.
    # Three requests want expert 0 most; greedy would give it requests 0 and 1 (9 + 0 + 2 = 11), but request 1
    # loses least by moving to expert 1: {0, 2} on expert 0 and {1, 3} on expert 1 give 5 + 3 + 3 + 2 = 13.
    counts = np.array([[5.0, 1.0], [4.0, 3.0], [3.0, 0.0], [0.0, 2.0]])
    assert layer_bound(counts, num_devices=2, num_slots=2, max_requests=2) == pytest.approx(13.0)
    assert dp_lar_bound([counts], 2, 2)[0] == pytest.approx(13.0)
    exact, rank = dp_exact_milp([counts], 2)  # one layer: the relaxation is tight
    assert exact == pytest.approx(13.0) and rank[0] == rank[2] != rank[1] == rank[3]


def test_dp_bound_config_errors():
    trace = alternating_trace()
    with pytest.raises(ConfigError, match="Attention-DP only"):
        make_system("dp_bound").fit(trace, ParallelConfig(devices=2, attention="tp", tokens_per_step=16), None)
    with pytest.raises(ConfigError, match="multiple of D"):
        make_system("dp_bound", num_redundant=1).fit(trace, ParallelConfig(devices=2, tokens_per_step=16), None)
    with pytest.raises(ConfigError, match="rounds must be >= 1"):
        make_system("dp_bound", rounds=0)
    other = alternating_trace(10)
    plan = make_system("dp_bound").fit(trace, ParallelConfig(devices=2, tokens_per_step=16), np.random.default_rng(0))
    with pytest.raises(ConfigError, match="dp_bound was fitted on another trace"):
        plan.reset()
        plan.assign_requests(other.token_ids, other.offsets, other.prefill_len)
    assert make_system("dp_bound").kind == "bound" and "ceil(R/D)" in make_system("dp_bound").bound_constraint
    assert make_system("fit_assign").kind == "hindsight"


@pytest.mark.parametrize("seed", range(3))
def test_node_bound_covers_every_dp_systems_node_local_rate(seed):
    # 4 devices as 2 nodes x 2: the LP over nodes bounds the activations served on the request's own node
    trace = random_trace(seed, num_requests=12, num_experts=8)
    parallel = ParallelConfig(devices=4, attention="dp", tokens_per_step=16, devices_per_node=2)
    plan = make_system("dp_bound").fit(trace, parallel, np.random.default_rng(0))
    node_bound = plan.info["node_local_bound"]
    assert plan.info["lar_bound"] <= node_bound + 1e-12  # local on the device is local on its node
    for name, params in DP_SYSTEMS + [("semmoe_hierarchical", {})]:
        system = make_system(name, **params).fit(trace, parallel, np.random.default_rng(0))
        system.reset()
        assert evaluate(system, trace).summary["node_local_activation_rate"] <= node_bound + 1e-9, name
    one_node = ParallelConfig(devices=4, attention="dp", tokens_per_step=16, devices_per_node=4)
    assert "node_local_bound" not in make_system("dp_bound").fit(trace, one_node, np.random.default_rng(0)).info


def test_bound_and_hindsight_plans_carry_the_time_objective():
    """dp_bound's witness and fit_assign are priced by the same time estimate as every system (the evaluator's);
    the bound says it bounds LAR under request-count balance only and that its time is the witness's; fit_assign's
    time variant (expert_load_cap) lowers the evaluated busiest device's expert load without losing the count
    balance it was given."""
    from omegaconf import OmegaConf
    from test_run import ROOT

    from repro.eval import load_shape, time_model

    hardware = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "hardware" / "h200.yaml"))
    trace = random_trace(3, num_requests=40, num_experts=8, num_layers=3)
    parallel = ParallelConfig(devices=4, attention="dp", tokens_per_step=16)

    def summary(name, **params):
        plan = make_system(name, **params).fit(trace, parallel, np.random.default_rng(0))
        model = time_model(plan, trace, hardware, load_shape("deepseek_v2_lite"))
        return evaluate(plan, trace, time_model=model).summary

    bound = summary("dp_bound")
    assert bound["time_estimate_s"] > 0 and bound["plan_time_estimate_of"] == "witness"
    sentence = make_system("dp_bound").bound_constraint
    assert "only under that request-count balance" in sentence and "not a bound on time" in sentence
    plain = summary("fit_assign", token_balance=None)
    timed = summary("fit_assign", token_balance=None, expert_load_cap=1.0)
    assert plain["time_estimate_s"] > 0 and timed["time_estimate_s"] > 0
    assert timed["plan_oracle_expert_load_cap"] == 1.0 and plain["plan_oracle_expert_load_cap"] == 0.0
    assert timed["expert_load_imbalance_max_mean"] < plain["expert_load_imbalance_max_mean"]
    with pytest.raises(ConfigError, match="expert_load_cap must be null / 0"):
        make_system("fit_assign", expert_load_cap=0.5)
    # system=fit_assign_time: the time variant as a named hindsight reference (tight token balance + load cap)
    reference = make_system("fit_assign_time")
    assert (reference.kind, reference.token_balance, reference.expert_load_cap) == ("hindsight", 1.02, 1.05)
    timed_ref = summary("fit_assign_time")
    lengths = np.diff(trace.offsets)
    # at most one request past the cap (the rounding's documented worst case)
    assert timed_ref["plan_oracle_token_imbalance_fit"] <= 1.02 + lengths.max() / (lengths.sum() / 4) + 1e-9
    assert timed_ref["plan_oracle_expert_load_cap"] == 1.05 and timed_ref["time_estimate_s"] > 0
