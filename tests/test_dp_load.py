"""Attention-DP routing that sees the engine: the live view (RankLoad), the load rules engines ship, Sem-MoE's
load-aware scheduler, and what each does in serving on planted cases."""

from __future__ import annotations

import numpy as np
import pytest
from test_sim import load_yaml, random_routing, sim_config

from repro.errors import ConfigError
from repro.eval.accounting import home_devices
from repro.parallel import ParallelConfig
from repro.sim import simulate
from repro.systems import make_system
from repro.systems.base import Plan
from repro.systems.ep import contiguous_placement
from repro.systems.load import RankLoad, margin_price, rank_load
from repro.systems.semmoe.dp import slack_argmax
from repro.traces import TraceMeta, make_trace

LAYERS, EXPERTS, TOP_K, DEVICES = 26, 64, 6, 8  # the deepseek_v2_lite shape the simulator prices


def view(running=(0, 0), waiting=(0, 0), prefill=(0, 0), decoding=(0, 0), kv=(0, 0), capacity=1000, budget=100):
    as_array = lambda values: np.asarray(values, dtype=np.int64)  # noqa: E731
    return RankLoad(as_array(running), as_array(waiting), as_array(prefill), as_array(decoding), as_array(kv),
                    capacity, budget)


def test_each_rule_ranks_as_its_source_does():
    # SGLang shortest_queue: running + waiting requests
    assert np.argmin(rank_load(view(running=(3, 1), waiting=(0, 1)), "shortest_queue", 10, 20)) == 1
    # vLLM: a waiting request weighs 4 running ones (rank 0: 4 x 1 = 4 > rank 1: 3 running)
    assert np.argmin(rank_load(view(running=(0, 3), waiting=(1, 0)), "vllm", 10, 20)) == 1
    assert np.argmin(rank_load(view(running=(0, 3), waiting=(1, 0)), "shortest_queue", 10, 20)) == 0
    # SGLang minimum_tokens: KV tokens + queued prompt tokens, request counts only break ties
    assert np.argmin(rank_load(view(running=(1, 5), kv=(500, 100), prefill=(0, 300)), "minimum_tokens", 10, 20)) == 1
    assert np.argmin(rank_load(view(running=(2, 1), kv=(100, 100)), "minimum_tokens", 10, 20)) == 1
    # ties go to the lowest rank id everywhere
    for rule in ("shortest_queue", "minimum_tokens", "vllm", "balance_route", "wait"):
        assert np.argmin(rank_load(view(), rule, 10, 20)) == 0
    # BalanceRoute-style margin: past 90 % of a capacity the price rises 10x faster
    np.testing.assert_allclose(margin_price(np.array([0.5, 0.9, 1.0])), [0.5, 0.9, 1.9])
    # a rank near its KV capacity loses to a busier-in-tokens rank with room
    near_full = view(kv=(880, 100), prefill=(0, 60), capacity=1000, budget=100)
    assert np.argmin(rank_load(near_full, "balance_route", 10, 50)) == 1
    # wait: queued prefill over the budget its decodes leave (rank 0: 60 / 40 > rank 1: 90 / 90)
    assert np.argmin(rank_load(view(prefill=(50, 80), decoding=(60, 10)), "wait", 10, 20)) == 1
    with pytest.raises(ConfigError, match="unknown DP load rule 'nope'"):
        rank_load(view(), "nope", 10, 20)


def test_slack_argmax_lets_affinity_choose_only_among_near_least_loaded_ranks():
    score, load = np.array([0.9, 0.1, 0.5]), np.array([3.0, 0.0, 1.0])
    assert slack_argmax(score, load, 0.0) == 1  # the load balancer
    assert slack_argmax(score, load, 1.0) == 2  # rank 0 is 3 over the least: excluded
    assert slack_argmax(score, load, 10.0) == 0  # pure affinity


class RecordingPlan(Plan):
    """Round robin that keeps every live view it is shown."""

    reads_load = True

    def reset(self) -> None:
        super().reset()
        self.views: list[RankLoad] = []

    def assign_requests(self, token_ids, offsets, prefill_len, load=None):
        self.views.append(load)
        return super().assign_requests(token_ids, offsets, prefill_len)


def planted_trace(prompt_lengths: np.ndarray, seed: int = 1, token_block=None, expert_block=None):
    """A deepseek_v2_lite-shaped trace: random routing, or request r's tokens drawn from vocabulary block
    token_block[r] and routed inside expert clique expert_block[r] (8 experts) when those are given."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(prompt_lengths)])
    num_tokens = int(offsets[-1])
    token_ids = rng.integers(0, 1000, num_tokens)
    experts = random_routing(rng, num_tokens, LAYERS, TOP_K, EXPERTS)
    if token_block is not None:
        owner = np.repeat(np.arange(len(prompt_lengths)), prompt_lengths)
        token_ids = token_block[owner] * 100 + rng.integers(0, 100, num_tokens)
        within = np.argsort(rng.random((num_tokens, LAYERS, 8)), axis=2)[:, :, :TOP_K]
        experts = (expert_block[owner][:, None, None] * 8 + within).astype(np.int16)
    meta = TraceMeta(model="toy", num_experts=EXPERTS, top_k=TOP_K, layer_ids=tuple(range(1, 27)), vocab_size=1000,
                     source="synthetic", dataset="toy")
    return make_trace(meta, offsets, token_ids, experts)


def serve(plan, trace, arrival_times, output_len=8):
    config = sim_config(rates=[1.0 / float(np.mean(np.diff(arrival_times)))], arrival="given", output_len=output_len,
                        slo={})
    return simulate(config, plan, trace, load_yaml("hardware", "h200.yaml"), load_yaml("sim", "shape", "deepseek_v2_lite.yaml"),
                    np.random.default_rng(0), arrival_times=arrival_times)


def test_the_engine_shows_each_arrival_the_state_before_it():
    """Requests arriving together queue on their ranks: each sees the earlier ones waiting with their prompts."""
    lengths = np.arange(1, 17) * 10
    trace = planted_trace(lengths)
    plan = RecordingPlan(contiguous_placement(LAYERS, EXPERTS, DEVICES), ParallelConfig(devices=DEVICES, attention="dp"))
    arrivals = np.zeros(16)
    arrivals[1:] = 1e-9 * np.arange(1, 16)  # one instant as far as the engine's first iteration is concerned
    serve(plan, trace, arrivals)
    first = plan.views[:16]
    for r, seen in enumerate(first):
        before = np.arange(r)
        np.testing.assert_array_equal(seen.waiting + seen.running, np.bincount(before % DEVICES, minlength=DEVICES))
        expected_prefill = np.bincount(before % DEVICES, weights=lengths[before], minlength=DEVICES)
        np.testing.assert_array_equal(seen.queued_prefill_tokens, expected_prefill)
        assert seen.decoding.sum() == 0 and seen.kv_capacity_tokens > 0 and seen.max_batched_tokens > 0


@pytest.fixture(scope="module")
def heavy_tail():
    """Every 8th request has a 2,000-token prompt, the others 16: round robin sends all long ones to rank 0."""
    lengths = np.where(np.arange(320) % DEVICES == 0, 2000, 16)
    return planted_trace(lengths), np.arange(320) * 1e-3


def test_round_robin_piles_long_prompts_on_one_rank_and_the_load_aware_routers_remove_the_backlog(heavy_tail):
    trace, arrivals = heavy_tail
    parallel = ParallelConfig(devices=DEVICES, attention="dp")
    rows = {}
    for name in ("ep", "minimum_tokens", "balance_route", "gimbal"):
        plan = make_system(name).fit(trace, parallel, np.random.default_rng(0))
        rows[name] = serve(plan, trace, arrivals).per_rate.iloc[0]
    for name in ("minimum_tokens", "balance_route", "gimbal"):
        assert rows[name]["ttft_p99_s"] < 0.5 * rows["ep"]["ttft_p99_s"], name
        assert rows[name]["makespan_s"] < 0.75 * rows["ep"]["makespan_s"], name


def test_without_an_engine_a_load_balancer_reads_what_it_handed_out(heavy_tail):
    """The offline evaluator passes no view: minimum_tokens then balances the tokens it assigned."""
    trace, _ = heavy_tail
    plan = make_system("minimum_tokens").fit(trace, ParallelConfig(devices=DEVICES, attention="dp"), np.random.default_rng(0))
    home = home_devices(plan, trace)[:, 0]
    tokens = np.bincount(home, minlength=DEVICES)
    assert tokens.max() / tokens.mean() < 1.1  # round robin: 2000 x 40 tokens on rank 0 alone, max/mean ~ 7.5


@pytest.fixture(scope="module")
def cliques():
    """Disjoint cliques: class c's tokens come from vocabulary block c and route to experts 8c..8c+7, so the
    co-clustering puts each clique on one device and affinity can serve every activation locally."""
    rng = np.random.default_rng(3)
    classes = rng.integers(0, DEVICES, 400)
    return planted_trace(np.full(400, 24), seed=3, token_block=classes, expert_block=classes)


@pytest.mark.parametrize("rule, slack", [("shortest_queue", 0.0), ("wait", 1.0)])  # the configured default; wait
def test_load_aware_semmoe_keeps_locality_at_light_load(cliques, rule, slack):
    parallel = ParallelConfig(devices=DEVICES, attention="dp")
    semmoe = make_system("semmoe", dp_scheduler="load", dp_load_rule=rule, dp_load_slack=slack, n_starts=1,
                         polish_rounds=0, n_steps=2, ft_steps=0)
    plan = semmoe.fit(cliques, parallel, np.random.default_rng(0))
    balancer = make_system("shortest_queue").fit(cliques, parallel, np.random.default_rng(0))
    light = np.arange(200) * 0.05  # one request every 50 ms: every rank idle at each arrival
    lar = {name: serve(p, cliques, light).per_rate.iloc[0]["lar"] for name, p in (("semmoe", plan), ("ep", balancer))}
    assert lar["semmoe"] > 0.9 and lar["ep"] < 0.3, lar
    if rule == "shortest_queue":
        # without an engine the plan's own handed-out counts are the queue: exactly Algorithm 2's round-robin mask
        args = (cliques.token_ids, cliques.offsets, cliques.prefill_len)
        plan.reset()
        load_aware = plan.assign_requests(*args)
        plan.dp_scheduler = "paper"
        plan.reset()
        np.testing.assert_array_equal(load_aware, plan.assign_requests(*args))


def test_load_aware_semmoe_sheds_locality_under_a_backlog(cliques):
    parallel = ParallelConfig(devices=DEVICES, attention="dp")
    semmoe = make_system("semmoe", dp_scheduler="load", dp_load_rule="wait", dp_load_slack=1.0, n_starts=1,
                         polish_rounds=0, n_steps=2, ft_steps=0)
    plan = semmoe.fit(cliques, parallel, np.random.default_rng(0))
    trace = cliques
    # the favourite rank keeps a request while its backlog is within the slack (1 iteration), not beyond
    prompt = np.asarray(trace.token_ids[: int(trace.offsets[1])])
    args = (prompt, np.array([0, len(prompt)]), np.array([len(prompt)]))
    budget = 2048
    idle = RankLoad.idle(DEVICES, 10**6, budget)
    favourite = int(plan.assign_requests(*args, load=idle)[0])
    backlog = np.zeros(DEVICES, dtype=np.int64)
    for queued, stays in ((budget // 2, True), (3 * budget, False)):
        backlog[favourite] = queued
        busy = RankLoad(idle.running, idle.waiting, backlog.copy(), idle.decoding, idle.kv_used_tokens, 10**6, budget)
        assert (int(plan.assign_requests(*args, load=busy)[0]) == favourite) == stays


def test_wait_counts_the_slot_a_request_waits_for_at_the_running_cap():
    """Rank 0 has fewer queued tokens but is at its running-request cap with requests waiting: a request there waits
    for finishes first, so `wait` prefers rank 1, which token-only rules (minimum_tokens) do not."""
    at_cap = RankLoad(np.array([4, 2]), np.array([2, 0]), np.array([20, 200]), np.array([4, 2]), np.array([100, 400]),
                      10**6, 100, 4)
    assert np.argmin(rank_load(at_cap, "wait", 10, 10 + 64)) == 1
    assert np.argmin(rank_load(at_cap, "minimum_tokens", 10, 10 + 64)) == 0
