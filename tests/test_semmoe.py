"""repro.systems.semmoe: Algorithms 1-3 on hand-made instances, plan contracts, bad inputs."""

import numpy as np
import pytest

from repro.errors import ConfigError, TraceError
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.systems.semmoe import (
    SemMoE,
    SemMoEPlan,
    SparseAffinity,
    align_to_slices,
    balanced_cocluster,
    capacity_assign,
    coclustering_objective,
    inverse_permutation,
    masked_argmax_assign,
    place_experts,
    polish_units,
    request_scores,
    request_votes,
    token_balance_assign,
    window_exact_assign,
    window_lookahead,
)
from repro.systems.base import Plan
from repro.systems.semmoe.dp import slack_argmax
from repro.systems.semmoe.tp import align_steps_to_slices, fill_groups
from repro.traces import TraceMeta, make_trace, split_trace


def community_trace(rng, num_requests=64, request_len=16, num_layers=2, num_experts=8, top_k=2, communities=2, noise=0.0):
    """Requests of one community each; community c uses tokens c*10..c*10+9 and experts of block c
    (E / communities experts), rotated per layer so every layer needs its own placement."""
    block = num_experts // communities
    community = np.repeat(rng.integers(communities, size=num_requests), request_len)
    token_ids = community * 10 + rng.integers(10, size=len(community))
    first = (token_ids % block)[:, None] + np.arange(top_k)  # [N, k] members of the block
    experts = np.stack(
        [((community[:, None] * block + first % block) + layer * block) % num_experts for layer in range(num_layers)],
        axis=1,
    )
    noisy = rng.random(experts.shape) < noise
    noisy_experts = np.where(noisy, rng.integers(num_experts, size=experts.shape), experts)
    # a token's top-k experts are distinct (traces reject repeats): keep the planted row where noise repeats one
    repeated = (np.diff(np.sort(noisy_experts, axis=2), axis=2) == 0).any(axis=2, keepdims=True)
    experts = np.where(repeated, experts, noisy_experts)
    meta = TraceMeta(model="communities", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(num_layers)),
                     vocab_size=10 * communities)
    return make_trace(meta, np.arange(num_requests + 1) * request_len, token_ids, experts)


# ---------------------------------------------------------------------------------------------- objective


def test_coclustering_objective_by_hand():
    # 2 tokens, 4 experts, 2 devices; token 0 (a=3) on device 0 puts 0.25 of its mass on device-1 experts;
    # token 1 (a=1) on device 0 too: loads 4 vs 0 -> imbalance |4-2| + |0-2| = 4
    confidence = np.array([[0.5, 0.25, 0.25, 0.0], [0.0, 0.0, 0.5, 0.5]])
    frequency = np.array([3.0, 1.0])
    expert_cluster = np.array([0, 0, 1, 1])
    remote = 3 * 0.25 + 1 * 1.0
    value = coclustering_objective(np.array([0, 0]), expert_cluster, confidence, frequency, 2, theta=0.25)
    assert value == pytest.approx(0.25 * 4 + 0.75 * remote)
    # perfect: token 1 on device 1 -> imbalance |3-2| + |1-2| = 2, remote 0.75
    value = coclustering_objective(np.array([0, 1]), expert_cluster, confidence, frequency, 2, theta=0.5)
    assert value == pytest.approx(0.5 * 2 + 0.5 * 0.75)


# ---------------------------------------------------------------------------------------------- Algorithm 1


def test_cocluster_separates_two_obvious_communities():
    # tokens 0-9 use only experts 0-3, tokens 10-19 only experts 4-7 (shuffled ids), equal frequencies
    rng = np.random.default_rng(0)
    expert_ids = rng.permutation(8)
    confidence = np.zeros((20, 8), dtype=np.float32)
    confidence[:10, expert_ids[:4]] = 0.25
    confidence[10:, expert_ids[4:]] = 0.25
    frequency = np.full(20, 5.0)
    result = balanced_cocluster((confidence * frequency[:, None])[None], frequency, 2, np.random.default_rng(1))
    experts = result.expert_device[0]
    assert len(set(experts[expert_ids[:4]])) == 1 and len(set(experts[expert_ids[4:]])) == 1
    assert experts[expert_ids[0]] != experts[expert_ids[4]]
    assert np.all(result.unit_cluster[:10] == experts[expert_ids[0]])
    assert np.all(result.unit_cluster[10:] == experts[expert_ids[4]])
    assert result.objective == pytest.approx(0.0, abs=1e-6)
    assert coclustering_objective(result.unit_cluster, experts, confidence, frequency, 2, 0.5) == pytest.approx(0.0, abs=1e-6)


def test_cocluster_matches_objective_and_never_beats_the_brute_force_optimum():
    # 6 tokens, 4 experts, 2 devices: enumerate every balanced expert split and every token clustering
    rng = np.random.default_rng(3)
    confidence = rng.dirichlet(np.full(4, 0.3), size=6)
    frequency = rng.integers(1, 6, size=6).astype(float)
    result = balanced_cocluster((confidence * frequency[:, None])[None], frequency, 2, np.random.default_rng(0))
    heuristic = coclustering_objective(result.unit_cluster, result.expert_device[0], confidence, frequency, 2, 0.5)
    assert heuristic == pytest.approx(result.objective, rel=1e-5)
    best = np.inf
    for split in ([0, 0, 1, 1], [0, 1, 0, 1], [0, 1, 1, 0]):
        for code in range(2**6):
            tokens = (code >> np.arange(6)) & 1
            best = min(best, coclustering_objective(tokens, np.array(split), confidence, frequency, 2, 0.5))
    assert best <= heuristic + 1e-9
    assert heuristic <= 1.05 * best + 1e-9  # within the 5 % of the optimum (test_milp checks 9 more)


def test_every_layer_places_exactly_e_over_d_experts_per_device():
    rng = np.random.default_rng(4)
    affinity = rng.random((3, 50, 16)).astype(np.float32)
    load = affinity[0].sum(axis=1)
    affinity = affinity / affinity.sum(axis=2, keepdims=True) * load[None, :, None]
    result = balanced_cocluster(affinity, load, 4, np.random.default_rng(0), n_steps=3, ft_steps=32)
    for layer in range(3):
        assert np.bincount(result.expert_device[layer], minlength=4).tolist() == [4, 4, 4, 4]
    assert result.objective == min(result.history)


# ---------------------------------------------------------------------------------------------- Algorithm 2


def test_dp_mask_covers_all_ranks_every_d_requests_and_streams():
    rng = np.random.default_rng(5)
    scores = rng.random((103, 4))
    ranks, position, taken = masked_argmax_assign(scores, 0, np.zeros(4, dtype=np.int64))
    for start in range(0, 100, 4):
        assert sorted(ranks[start : start + 4]) == [0, 1, 2, 3]
    assert position == 3 and taken.sum() == 3
    # streaming in uneven pieces gives the same ranks as one call
    pieces, position, taken = [], 0, np.zeros(4, dtype=np.int64)
    for lo, hi in ((0, 1), (1, 7), (7, 50), (50, 103)):
        part, position, taken = masked_argmax_assign(scores[lo:hi], position, taken)
        pieces.append(part)
    assert np.concatenate(pieces).tolist() == ranks.tolist()


def test_dp_mask_by_hand_and_wider_windows():
    # everyone prefers rank 2, then 0: the window forces 2, 0, then the lowest free ids
    scores = np.tile([0.5, 0.1, 0.9, 0.0], (4, 1))
    ranks, _, _ = masked_argmax_assign(scores, 0, np.zeros(4, dtype=np.int64))
    assert ranks.tolist() == [2, 0, 1, 3]
    ranks, _, _ = masked_argmax_assign(np.tile(scores, (2, 1)), 0, np.zeros(4, dtype=np.int64), per_rank=2)
    assert np.bincount(ranks, minlength=4).tolist() == [2, 2, 2, 2] and ranks[:2].tolist() == [2, 2]


def test_request_scores_use_only_the_prompt():
    token_score = np.array([[1, 0], [0, 1], [0, 0]], dtype=np.float32)  # rows: token 0, token 1, OOV
    row_of_token = np.array([0, 1, 2, 2], dtype=np.int32)
    token_ids = np.array([0, 0, 1, 1, 1, 3, 0])
    offsets = np.array([0, 3, 5, 7])
    scores = request_scores(token_score, row_of_token, token_ids, offsets, np.array([2, 0, 2]))
    np.testing.assert_allclose(scores, [[1, 0], [0, 0], [0.5, 0]])  # request 2 prompt = (3 -> OOV, 0)
    scores = request_scores(token_score, row_of_token, token_ids, offsets, np.array([3, 2, 2]))
    np.testing.assert_allclose(scores, [[2 / 3, 1 / 3], [0, 1], [0.5, 0]])


# ---------------------------------------------------------------------------------------------- Algorithm 3


def test_align_is_a_bijection_with_equal_slices_and_inverse_restores_order():
    rng = np.random.default_rng(6)
    for num_tokens, num_devices in ((33, 4), (511, 8), (7, 7), (1, 1)):
        device = rng.integers(num_devices, size=num_tokens)
        device[: num_tokens // 2] = 0  # heavy skew forces moves
        permutation, counts, moved = align_to_slices(device, rng.random(num_tokens), num_devices)
        assert sorted(permutation.tolist()) == list(range(num_tokens))
        assert counts.sum() == num_tokens and counts.max() - counts.min() <= 1
        values = rng.random(num_tokens)
        assert np.array_equal(values[permutation][inverse_permutation(permutation)], values)
        final = np.repeat(np.arange(num_devices), counts)[inverse_permutation(permutation)]
        assert moved == int((final != device).sum())


def test_align_keeps_balanced_predictions_and_spills_the_least_confident():
    device = np.array([1, 0, 1, 0])
    permutation, counts, moved = align_to_slices(device, np.ones(4), 2)
    assert moved == 0 and permutation.tolist() == [1, 3, 0, 2]
    # three tokens want device 0, slices are 2/2: the least confident (token 1) moves to device 1
    permutation, counts, moved = align_to_slices(np.array([0, 0, 0, 1]), np.array([0.9, 0.2, 0.8, 0.7]), 2)
    assert moved == 1 and permutation.tolist() == [0, 2, 1, 3]


# ---------------------------------------------------------------------------------------------- system


@pytest.fixture(scope="module")
def community_split():
    trace = community_trace(np.random.default_rng(7), noise=0.05)
    return split_trace(trace, 0.25, np.random.default_rng(0))


@pytest.mark.parametrize("attention", ["tp", "dp"])
def test_semmoe_finds_the_communities_end_to_end(community_split, attention):
    from repro.eval.accounting import evaluate

    profile, evaluation = community_split
    # long TP steps: with 4 requests per step the community mix of a step, not the plan, caps the LAR
    parallel = ParallelConfig(devices=2, attention=attention, tokens_per_step=768)
    plan = make_system("semmoe").fit(profile, parallel, np.random.default_rng(0))
    assert isinstance(plan, SemMoEPlan)
    for layer in range(profile.num_layers):
        assert np.bincount(plan.placement.expert_device()[layer], minlength=2).tolist() == [4, 4]
    lar = evaluate(plan, evaluation).summary["lar"]
    vanilla = evaluate(make_system("ep").fit(profile, parallel, None), evaluation).summary["lar"]
    # planted communities: TP predicts every token's block; DP is capped by the one-request-per-rank mask
    assert lar > (0.85 if attention == "tp" else 0.6)
    assert lar > vanilla + 0.2


def test_same_seed_gives_identical_plans_and_save_load_round_trips(community_split, tmp_path):
    profile, evaluation = community_split
    parallel = ParallelConfig(devices=2, attention="tp", tokens_per_step=64)
    plans = [SemMoE(n_steps=3).fit(profile, parallel, np.random.default_rng(11)) for _ in range(2)]
    for name in ("token_device", "token_confidence", "dp_score", "markov_device", "markov_confidence"):
        assert np.array_equal(getattr(plans[0], name), getattr(plans[1], name))
    assert np.array_equal(plans[0].placement.physical_to_logical, plans[1].placement.physical_to_logical)
    plans[0].save(tmp_path / "plan")
    loaded = SemMoEPlan.load(tmp_path / "plan", parallel, profile.meta.num_experts)
    tokens = evaluation.token_ids[:64]
    prev = evaluation.experts[:64, :1]
    for plan in (plans[0], loaded):
        plan.reset()
    assert np.array_equal(plans[0].shuffle_tokens(tokens, 1, prev)[0], loaded.shuffle_tokens(tokens, 1, prev)[0])
    offsets, prefill = evaluation.offsets[:9], evaluation.prefill_len[:8]
    assert np.array_equal(
        plans[0].assign_requests(evaluation.token_ids, offsets, prefill),
        loaded.assign_requests(evaluation.token_ids, offsets, prefill),
    )


def test_tp_shuffle_contract_and_moved_share(community_split):
    profile, evaluation = community_split
    plan = SemMoE(n_steps=2).fit(profile, ParallelConfig(devices=2, attention="tp", tokens_per_step=64), np.random.default_rng(0))
    tokens = evaluation.token_ids[:65]
    permutation, counts = plan.shuffle_tokens(tokens, 1, evaluation.experts[:65, :1])
    assert sorted(permutation.tolist()) == list(range(65)) and sorted(counts.tolist()) == [32, 33]
    assert 0.0 <= plan.info["align_moved_share"] <= 1.0 and plan.info["shuffled_tokens"] == 65


def _align_one_step(device, confidence, num_devices, devices_per_node):
    """The per-step align as first written (fill_groups over one step's devices), the reference of the grouped one."""
    counts = np.full(num_devices, len(device) // num_devices) + (np.arange(num_devices) < len(device) % num_devices)
    if devices_per_node is None:
        final = fill_groups(device, confidence, counts)
    else:
        node = fill_groups(device // devices_per_node, confidence, counts.reshape(-1, devices_per_node).sum(axis=1))
        crossed = node != device // devices_per_node
        final = fill_groups(np.where(crossed, node * devices_per_node, device), confidence, counts, crossed)
    return np.argsort(final, kind="stable"), counts, int((final != device).sum())


@pytest.mark.parametrize("devices_per_node", [None, 2])
def test_aligning_many_steps_at_once_equals_aligning_each(devices_per_node):
    rng = np.random.default_rng(5)
    sizes = np.array([0, 1, 7, 3, 16, 0, 9, 2])
    device = rng.integers(0, 4, sizes.sum())
    device[sizes[:4].sum():sizes[:5].sum()] = 1  # one step predicts a single device: most of it must move
    confidence = rng.choice([0.2, 0.5, 0.9], sizes.sum())  # ties: the original order breaks them
    permutation, counts, moved = align_steps_to_slices(device, confidence, sizes, 4, devices_per_node)
    start, total_moved = 0, 0
    for s, size in enumerate(sizes):
        part = slice(start, start + size)
        perm, want_counts, want_moved = _align_one_step(device[part], confidence[part], 4, devices_per_node)
        assert permutation[part].tolist() == (perm + start).tolist() and counts[s].tolist() == want_counts.tolist()
        start, total_moved = start + size, total_moved + want_moved
    assert moved == total_moved > 0


def test_semmoe_shuffles_a_block_of_steps_as_it_shuffles_each(community_split):
    profile, evaluation = community_split
    plan = SemMoE(n_steps=2).fit(profile, ParallelConfig(devices=2, attention="tp", tokens_per_step=64), np.random.default_rng(0))
    sizes = np.array([5, 0, 33, 64, 1])
    tokens, prev = evaluation.token_ids[: sizes.sum()], evaluation.experts[: sizes.sum(), :1]
    plan.reset()
    fast = plan.shuffle_steps(tokens, sizes, 1, prev)
    moved = plan.info["align_moved_tokens"]
    plan.reset()
    one_by_one = Plan.shuffle_steps(plan, tokens, sizes, 1, prev)  # the base class: one shuffle_tokens per step
    assert np.array_equal(fast[0], one_by_one[0]) and np.array_equal(fast[1], one_by_one[1])
    assert moved == plan.info["align_moved_tokens"] and plan.info["shuffled_tokens"] == sizes.sum()


def test_contiguous_slices_of_a_block_of_steps_are_each_steps_slices():
    plan = Plan(make_system("ep").fit(community_trace(np.random.default_rng(0)), ParallelConfig(devices=4, attention="tp"),
                                      None).placement, ParallelConfig(devices=4, attention="tp"))
    sizes = np.array([4, 0, 1, 8])
    permutation, counts = plan.shuffle_steps(np.zeros(13, np.int32), sizes, 0, None)
    assert permutation.tolist() == list(range(13))
    assert counts.tolist() == [plan.shuffle_tokens(np.zeros(n, np.int32), 0, None)[1].tolist() for n in sizes]


def test_markov_table_wins_only_when_more_confident(community_split):
    profile, _ = community_split
    plan = SemMoE(n_steps=1).fit(profile, ParallelConfig(devices=2, attention="tp", tokens_per_step=64), np.random.default_rng(0))
    tokens = np.array([0, 15])
    plan.token_confidence[:] = 0.6
    plan.markov_confidence[:] = 0.9
    plan.markov_device[1] = 1 - plan.token_device[1, plan.row_of_token[tokens[0]]]  # disagree for token 0
    prev = np.zeros((2, 1, 2), dtype=np.int16)
    device, confidence = plan.predicted_devices(tokens, 1, prev)
    assert device[0] != plan.token_device[1, plan.row_of_token[tokens[0]]]
    assert np.allclose(confidence, 0.9)
    plan.markov_confidence[:] = 0.5
    device, _ = plan.predicted_devices(tokens, 1, prev)
    assert device.tolist() == plan.token_device[1, plan.row_of_token[tokens]].tolist()


def test_load_aware_variant_keeps_the_mask():
    trace = community_trace(np.random.default_rng(8), num_requests=40)
    plan = SemMoE(n_steps=1, load_aware_lambda=0.5).fit(trace, ParallelConfig(devices=2, tokens_per_step=64), np.random.default_rng(0))
    ranks = plan.assign_requests(trace.token_ids, trace.offsets, trace.prefill_len)
    assert all(sorted(ranks[i : i + 2]) == [0, 1] for i in range(0, 40, 2))



def test_window_exact_assign_keeps_the_mask_and_beats_greedy():
    # greedy in arrival order: request 0 takes rank 0 (0.6 > 0.5), request 1 is left rank 1 (total 0.6);
    # the exact window gives request 1 rank 0 (total 0.5 + 1.0)
    gain = np.array([[0.6, 0.5], [1.0, 0.0]])
    greedy, _, _ = masked_argmax_assign(gain, 0, np.zeros(2, np.int64))
    exact, position, taken, queued = window_exact_assign(gain, np.ones(2), 0, np.zeros(2, np.int64), np.zeros(2))
    assert greedy.tolist() == [0, 1] and exact.tolist() == [1, 0]
    assert position == 0 and taken.tolist() == [0, 0] and queued.tolist() == [1.0, 1.0]
    rng = np.random.default_rng(3)
    gain, lengths = rng.random((37, 4)), rng.integers(1, 50, 37).astype(float)
    whole, *_ = window_exact_assign(gain, lengths, 0, np.zeros(4, np.int64), np.zeros(4), per_rank=2, token_price=1.0)
    state = (0, np.zeros(4, np.int64), np.zeros(4))
    parts = []
    for lo, hi in ((0, 5), (5, 19), (19, 37)):  # a partly filled window carried across calls
        ranks, *rest = window_exact_assign(gain[lo:hi], lengths[lo:hi], *state, per_rank=2, token_price=1.0)
        parts.append(ranks)
        state = tuple(rest)
    split = np.concatenate(parts)  # a window cut by a call is solved in parts: the balance still holds
    for ranks in (whole, split):
        assert all(np.bincount(ranks[i : i + 8], minlength=4).tolist() == [2] * 4 for i in range(0, 32, 8))
        assert np.bincount(ranks[32:], minlength=4).max() <= 2


def test_batch_window_assignment_is_deterministic_and_balanced():
    trace = community_trace(np.random.default_rng(8), num_requests=40)
    parallel = ParallelConfig(devices=2, tokens_per_step=64, attention="dp")
    ranks = []
    for _ in range(2):
        plan = SemMoE(n_steps=1, dp_assign="batch_window", dp_token_price=1.5).fit(trace, parallel, np.random.default_rng(0))
        ranks.append(plan.assign_requests(trace.token_ids, trace.offsets, trace.prefill_len))
    assert ranks[0].tolist() == ranks[1].tolist()
    assert all(sorted(ranks[0][i : i + 2]) == [0, 1] for i in range(0, 40, 2))
    with pytest.raises(ConfigError, match="dp_assign"):
        SemMoE(dp_assign="magic")
    with pytest.raises(ConfigError, match="'exact' is now 'batch_window'"):
        SemMoE(dp_assign="exact")  # old names are for old plan files only
    with pytest.raises(ConfigError, match="dp_token_price"):
        SemMoE(dp_token_price=-1.0)
    with pytest.raises(ConfigError, match="load_aware_lambda"):
        SemMoE(dp_token_price=1.0)  # the online assignment's token price is load_aware_lambda
    with pytest.raises(ConfigError, match="dp_token_price"):
        SemMoE(dp_assign="batch_window", load_aware_lambda=0.5)


# ---------------------------------------------------------------------------------------------- online means online


def test_online_is_the_default_in_code_and_config():
    from omegaconf import OmegaConf

    params = OmegaConf.to_container(OmegaConf.load("conf/system/semmoe.yaml"))["params"]
    assert params["dp_assign"] == "online" and SemMoE().dp_assign == "online"
    assert SemMoE(**params).dp_token_price == 0.0


def test_load_scheduler_is_the_configured_default_and_the_paper_one_stays_selectable():
    """conf/system/semmoe.yaml runs dp_scheduler=load with the engines' shortest queue and no slack (chosen by
    serving on validate, see its comment); the class default and system=semmoe_paper run the paper's Algorithm 2,
    which refuses a time weight."""
    from omegaconf import OmegaConf

    params = OmegaConf.to_container(OmegaConf.load("conf/system/semmoe.yaml"))["params"]
    assert (params["dp_scheduler"], params["dp_load_rule"], params["dp_load_slack"]) == ("load", "shortest_queue", 0)
    assert SemMoE(**params).dp_scheduler == "load" and SemMoE().dp_scheduler == "paper"
    paper = OmegaConf.to_container(OmegaConf.load("conf/system/semmoe_paper.yaml"))["params"]
    assert make_system("semmoe_paper", **{**params, **paper}).dp_scheduler == "paper"
    with pytest.raises(ConfigError, match="semmoe_paper runs the paper's DP scheduler"):
        make_system("semmoe_paper", dp_scheduler="time")


def stream(token_ids, lengths):
    """(token_ids, offsets, prefill_len) of an all-prompt request stream."""
    return np.asarray(token_ids), np.concatenate([[0], np.cumsum(lengths)]), np.asarray(lengths)


@pytest.mark.parametrize(
    "params",
    [{}, {"load_aware_lambda": 0.5}, {"dp_window": 2}, {"dp_scoring": "expected"},
     {"dp_scheduler": "time", "dp_balance_weight": 0.5}, {"dp_scheduler": "time", "dp_balance_weight": 0.0},
     {"dp_scheduler": "load", "dp_load_rule": "shortest_queue", "dp_load_slack": 0.0}],
    ids=["masked_argmax", "load_aware", "wider_window", "expected_scores", "time", "time_affinity_only", "engine_load"],
)
def test_online_rank_of_a_request_ignores_later_prompts(community_split, params):
    # black box: assign a stream; rewrite every prompt after request i (new tokens, new lengths); reassign from a
    # fresh state: requests 0..i keep their ranks, for i at every position of a mask window
    profile, _ = community_split
    plan = SemMoE(n_steps=1, **params).fit(profile, ParallelConfig(devices=2, attention="dp"), np.random.default_rng(0))
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 30, size=24)
    tokens = rng.integers(20, size=lengths.sum())
    plan.reset()
    ranks = plan.assign_requests(*stream(tokens, lengths))
    assert plan.info["dp_lookahead_requests_max"] == 0 and plan.info["dp_lookahead_requests_mean"] == 0.0
    later_changed = False
    for i in (0, 1, 2, 5, 11, 22):
        new_lengths = np.concatenate([lengths[: i + 1], rng.integers(1, 30, size=len(lengths) - i - 1)])
        keep = lengths[: i + 1].sum()
        new_tokens = np.concatenate([tokens[:keep], rng.integers(20, size=new_lengths.sum() - keep)])
        plan.reset()
        new_ranks = plan.assign_requests(*stream(new_tokens, new_lengths))
        assert new_ranks[: i + 1].tolist() == ranks[: i + 1].tolist(), f"request <= {i} changed"
        later_changed |= new_ranks[i + 1 :].tolist() != ranks[i + 1 :].tolist()
    assert later_changed  # the rewrites did matter to the later requests


def test_batch_window_looks_ahead_and_reports_it(community_split):
    # positive control of the test above: request 0 (8 tokens of community 0) is followed either by a long
    # community-1 prompt or a long community-0 prompt. Online, request 0 takes community 0's rank either way;
    # batch_window gives that rank to the longer request 1 in the second case, so request 0's rank depends on
    # a prompt that arrived after it
    profile, _ = community_split
    parallel = ParallelConfig(devices=2, attention="dp")
    first = np.arange(8) % 10  # community 0 uses tokens 0..9, community 1 tokens 10..19
    second = {"other": 10 + np.arange(32) % 10, "same": np.arange(32) % 10}
    rank0 = {}
    for assign in ("online", "batch_window"):
        plan = SemMoE(n_steps=1, dp_assign=assign).fit(profile, parallel, np.random.default_rng(0))
        for case, tokens in second.items():
            plan.reset()
            rank0[assign, case] = int(plan.assign_requests(*stream(np.concatenate([first, tokens]), [8, 32]))[0])
        lookahead = plan.info["dp_lookahead_requests_max"], plan.info["dp_lookahead_requests_mean"]
        assert lookahead == ((0, 0.0) if assign == "online" else (1, 0.5))  # D = 2: request 0 saw request 1
    assert rank0["online", "other"] == rank0["online", "same"] == rank0["batch_window", "other"]
    assert rank0["batch_window", "same"] != rank0["batch_window", "other"]


def test_window_lookahead_by_hand():
    # windows of 2 slots, one slot of the open window filled by an earlier call: slots 1..5 of the stream
    assert window_lookahead(5, 1, 2).tolist() == [0, 1, 0, 1, 0]
    assert window_lookahead(4, 0, 4).tolist() == [3, 2, 1, 0]
    assert window_lookahead(0, 0, 4).tolist() == []


def test_plan_save_load_keeps_dp_assign_and_maps_old_names(community_split, tmp_path):
    import json

    profile, evaluation = community_split
    parallel = ParallelConfig(devices=2, attention="dp")
    plan = SemMoE(n_steps=1, dp_assign="batch_window", dp_token_price=1.5).fit(profile, parallel, np.random.default_rng(0))
    plan.save(tmp_path / "plan")
    loaded = SemMoEPlan.load(tmp_path / "plan", parallel, profile.meta.num_experts)
    assert (loaded.dp_assign, loaded.dp_token_price) == ("batch_window", 1.5)
    requests = (evaluation.token_ids, evaluation.offsets, evaluation.prefill_len)
    for p in (plan, loaded):
        p.reset()
    assert plan.assign_requests(*requests).tolist() == loaded.assign_requests(*requests).tolist()
    scalars_path = tmp_path / "plan" / "semmoe.json"
    scalars = json.loads(scalars_path.read_text())
    for saved, lam, expected in (("exact", 0.0, "batch_window"), ("greedy", 0.0, "online"), ("exact", 0.5, "online"),
                                 (None, 0.0, "online")):
        old = {k: v for k, v in scalars.items() if k != "dp_assign"} | {"load_aware_lambda": lam}
        if saved is not None:
            old["dp_assign"] = saved
        scalars_path.write_text(json.dumps(old))
        assert SemMoEPlan.load(tmp_path / "plan", parallel, profile.meta.num_experts).dp_assign == expected, saved


# ---------------------------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_one_clear_error():
    trace = community_trace(np.random.default_rng(9), num_requests=4)
    for theta in (0.0, 1.0, 1.5):
        with pytest.raises(ConfigError, match="theta"):
            SemMoE(theta=theta)
    with pytest.raises(ConfigError, match="exceeds the model's 8 experts"):
        SemMoE().fit(trace, ParallelConfig(devices=16, tokens_per_step=64), np.random.default_rng(0))
    with pytest.raises(ConfigError, match="more than|impossible"):
        balanced_cocluster(np.ones((1, 2, 4), np.float32), np.ones(2), 8, np.random.default_rng(0))
    meta = trace.meta
    with pytest.raises(TraceError, match="no tokens"):  # the trace format may refuse it first
        empty = make_trace(meta, [0, 0], np.zeros(0, np.int32), np.zeros((0, meta.num_layers, meta.top_k), np.int16))
        SemMoE().fit(empty, ParallelConfig(devices=2, tokens_per_step=64), np.random.default_rng(0))
    no_prompt = make_trace(meta, trace.offsets, trace.token_ids, trace.experts, prefill_len=np.zeros(4, np.int32))
    with pytest.raises(TraceError, match="no prompt tokens"):
        SemMoE(prompt_only=True).fit(no_prompt, ParallelConfig(devices=2, tokens_per_step=64), np.random.default_rng(0))
    with pytest.raises(ConfigError, match="dp_scoring"):
        SemMoE(dp_scoring="magic")
    with pytest.raises(ConfigError, match="dp_scheduler must be one of"):
        SemMoE(dp_scheduler="fastest")
    for params in ({"dp_assign": "batch_window"}, {"load_aware_lambda": 0.1}, {"dp_window": 2}):
        with pytest.raises(ConfigError, match="has no round-robin mask"):
            SemMoE(dp_scheduler="time", **params)
    with pytest.raises(ConfigError, match="dp_scheduler=time only"):
        SemMoE(dp_scheduler="paper", dp_balance_weight=0.5)
    with pytest.raises(ConfigError, match="dp_balance_weight must be >= 0"):
        SemMoE(dp_scheduler="time", dp_balance_weight=-1.0)
    with pytest.raises(ConfigError, match="dp_decode_tokens"):
        SemMoE(dp_decode_tokens=-3)


# ---------------------------------------------------------------------------------------------- time-aware DP


def test_token_balance_assign_by_hand():
    # 2 ranks, weight 1: r0 (10 tokens) likes rank 0 -> 0; r1 (10) likes rank 0 by 0.4, but rank 0 is 10 tokens
    # ahead = 1 mean request -> price 1 > 0.4 -> rank 1; r2 (30) likes rank 1 by 2.0, queues equal -> rank 1;
    # r3 (10) likes rank 1 by 0.5, rank 1 is 30 ahead, mean 15 -> price 2 -> rank 0
    scores = np.array([[1.0, 0.0], [0.4, 0.0], [0.0, 2.0], [0.0, 0.5]])
    ranks, queued, assigned = token_balance_assign(scores, np.array([10.0, 10, 30, 10]), np.zeros(2), 0, 1.0)
    assert ranks.tolist() == [0, 1, 1, 0] and queued.tolist() == [20.0, 40.0] and assigned == 4
    # weight 0 is the affinity argmax (ties -> lowest id); streaming in two calls gives the same ranks
    assert token_balance_assign(scores, np.ones(4), np.zeros(2), 0, 0.0)[0].tolist() == [0, 0, 1, 1]
    first = token_balance_assign(scores[:2], np.array([10.0, 10]), np.zeros(2), 0, 1.0)
    second = token_balance_assign(scores[2:], np.array([30.0, 10]), first[1], first[2], 1.0)
    assert np.concatenate([first[0], second[0]]).tolist() == [0, 1, 1, 0]


def alternating_stream(num_pairs=12, long_len=64, short_len=4):
    """Long prompts of community 0 alternating with short prompts of community 1 (community_trace's tokens):
    request counts and token counts disagree on what balance means."""
    rng = np.random.default_rng(3)
    lengths = np.tile([long_len, short_len], num_pairs)
    tokens = np.concatenate([rng.integers(10, size=n) + (10 if i % 2 else 0) for i, n in enumerate(lengths)])
    return tokens, lengths


@pytest.mark.parametrize("weight", [0.1, 1.0])
def test_time_scheduler_beats_round_robin_and_the_paper_on_busiest_rank_tokens(community_split, weight):
    """Issue 17 item 7: on alternating long and short prompts, the busiest rank's token load of the time-aware
    scheduler is strictly lower than round-robin's (vanilla EP) and the paper's Algorithm 2's."""
    profile, _ = community_split
    parallel = ParallelConfig(devices=2, attention="dp")
    tokens, lengths = alternating_stream()

    def busiest(plan):
        plan.reset()
        ranks = plan.assign_requests(*stream(tokens, lengths))
        return np.bincount(ranks, weights=lengths, minlength=2).max()

    round_robin = busiest(make_system("ep").fit(profile, parallel, None))
    paper = busiest(SemMoE(n_steps=1, dp_scheduler="paper").fit(profile, parallel, np.random.default_rng(0)))
    time_aware = busiest(SemMoE(n_steps=1, dp_scheduler="time", dp_balance_weight=weight).fit(
        profile, parallel, np.random.default_rng(0)))
    assert round_robin == paper == 12 * 64  # both put every long prompt on one rank
    assert time_aware < min(round_robin, paper)
    if weight >= 1.0:  # a price of one affinity unit per mean request of excess: within one long prompt of balance
        assert time_aware <= 0.5 * lengths.sum() + 64


def test_expected_decode_tokens_come_from_the_profile_and_count_in_the_balance(community_split):
    profile, _ = community_split
    parallel = ParallelConfig(devices=2, attention="dp")
    # the profile with its last 4 tokens of every request marked generated: 4 expected decode tokens
    decoded = make_trace(profile.meta, profile.offsets, profile.token_ids, profile.experts,
                         prefill_len=np.diff(profile.offsets) - 4)
    plan = SemMoE(n_steps=1, dp_scheduler="time", dp_balance_weight=1.0).fit(decoded, parallel, np.random.default_rng(0))
    assert plan.dp_decode_tokens == 4.0 and plan.info["dp_decode_tokens"] == 4.0
    assert SemMoE(n_steps=1).fit(profile, parallel, np.random.default_rng(0)).dp_decode_tokens == 0.0
    fixed = SemMoE(n_steps=1, dp_scheduler="time", dp_decode_tokens=100).fit(decoded, parallel, np.random.default_rng(0))
    assert fixed.dp_decode_tokens == 100.0
    # decode tokens weigh in: with 1000 expected decode tokens, 1-token and 64-token prompts are nearly the same
    # load, so the scheduler alternates ranks like round-robin instead of balancing prompt tokens
    heavy = SemMoE(n_steps=1, dp_scheduler="time", dp_balance_weight=1.0, dp_decode_tokens=1000).fit(
        profile, parallel, np.random.default_rng(0))
    tokens, lengths = alternating_stream()
    ranks = heavy.assign_requests(*stream(tokens, lengths))
    assert np.bincount(ranks, minlength=2).tolist() == [12, 12]


def test_time_scheduler_survives_save_and_load(community_split, tmp_path):
    profile, _ = community_split
    parallel = ParallelConfig(devices=2, attention="dp")
    plan = SemMoE(n_steps=1, dp_scheduler="time", dp_balance_weight=0.3, dp_decode_tokens=7).fit(
        profile, parallel, np.random.default_rng(0))
    plan.save(tmp_path / "plan")
    loaded = SemMoEPlan.load(tmp_path / "plan", parallel, profile.meta.num_experts)
    assert (loaded.dp_scheduler, loaded.dp_balance_weight, loaded.dp_decode_tokens) == ("time", 0.3, 7.0)
    tokens, lengths = alternating_stream()
    plan.reset()
    assert loaded.assign_requests(*stream(tokens, lengths)).tolist() == plan.assign_requests(*stream(tokens, lengths)).tolist()


# ---------------------------------------------------------------------------------------------- helpers


def test_capacity_assign_respects_capacity_and_preferences():
    # 6 units of load 1 all prefer device 0; capacity 1.02 x 2 = 2.04 per device -> 2 each, strongest first
    local = np.array([[0.9, 0.1, 0.0], [0.8, 0.0, 0.2], [0.7, 0.3, 0.0], [0.6, 0.0, 0.4], [0.5, 0.5, 0.0], [0.95, 0.0, 0.05]])
    cluster = capacity_assign(local, np.ones(6))
    assert np.bincount(cluster, minlength=3).tolist() == [2, 2, 2]
    assert set(np.flatnonzero(cluster == 0).tolist()) == {0, 5}  # the two strongest device-0 shares


def test_request_votes_match_dense_scores_of_one_hot_tables():
    rng = np.random.default_rng(12)
    vocab_device = rng.integers(3, size=20)
    vocab_weight = rng.random(20)
    token_score = np.zeros((20, 3), dtype=np.float32)
    token_score[np.arange(20), vocab_device] = vocab_weight
    token_ids = rng.integers(20, size=300)
    offsets = np.array([0, 10, 10, 150, 300])
    for prefill in (np.diff(offsets), np.array([4, 0, 100, 1])):
        votes = request_votes(vocab_device, vocab_weight, token_ids, offsets, prefill, 3)
        dense = request_scores(token_score, np.arange(20), token_ids, offsets, prefill)
        np.testing.assert_allclose(votes, dense, rtol=1e-5, atol=1e-6)


def test_one_request_vote_equals_the_batch_path_and_refuses_unknown_ids():
    rng = np.random.default_rng(14)
    vocab_device = rng.integers(8, size=500)
    vocab_weight = rng.random(500)
    token_ids = rng.integers(500, size=3000)
    offsets = np.array([0, 1000, 1700, 3000])
    prefill = np.array([1000, 650, 1300])
    batch = request_votes(vocab_device, vocab_weight, token_ids, offsets, prefill, 8)
    for r in range(3):  # the compiled one-request pass, bit for bit
        one = request_votes(vocab_device, vocab_weight, token_ids, offsets[r : r + 2], prefill[r : r + 1], 8)
        assert np.array_equal(one[0], batch[r])
    with pytest.raises(TraceError, match="outside the plan's vocabulary of 500 ids"):
        request_votes(vocab_device, vocab_weight, np.array([3, 500]), np.array([0, 2]), np.array([2]), 8)


def test_slack_argmax_keeps_affinity_within_the_slack():
    score = np.array([0.1, 0.9, 0.5, 0.9])
    assert slack_argmax(score, np.array([3, 5, 3, 5]), 0.0) == 2  # rank 1 and 3 score best but are busier
    assert slack_argmax(score, np.array([3, 5, 3, 5]), 2.0) == 1  # within slack: best score, lowest id
    assert slack_argmax(score, np.array([3.0, 2.5, 9.0, 2.0]), 0.5) == 1


def test_exact_expert_step_never_loses_local_activations():
    rng = np.random.default_rng(13)
    cluster_affinity = rng.random((2, 4, 16))
    hotness = cluster_affinity.sum(axis=1)
    coact = np.zeros((2, 16, 16))
    greedy = place_experts(cluster_affinity, hotness, coact, 4, np.random.default_rng(0), ft_steps=16)
    exact = place_experts(cluster_affinity, hotness, coact, 4, np.random.default_rng(0), ft_steps=16, exact=True)

    def local(expert_device):
        return sum(cluster_affinity[layer, expert_device[layer], np.arange(16)].sum() for layer in range(2))

    assert local(exact) >= local(greedy) - 1e-9
    for layer in range(2):
        assert np.bincount(exact[layer], minlength=4).tolist() == [4, 4, 4, 4]


@pytest.mark.parametrize("num_units, num_devices, theta", [(7, 2, 0.5), (30, 4, 0.3), (300, 8, 0.7)])
def test_polish_never_raises_l_and_leaves_no_improving_move_or_swap(num_units, num_devices, theta):
    # one layer of token rows: local[u, d] = a_u * (C_p mass of u on the experts of device d)
    rng = np.random.default_rng(num_units)
    num_experts = 2 * num_devices
    confidence = rng.dirichlet(np.full(num_experts, 0.3), size=num_units)
    frequency = rng.zipf(1.5, num_units).clip(max=60).astype(float)
    expert_cluster = rng.permutation(np.repeat(np.arange(num_devices), 2))
    local = (frequency[:, None] * confidence) @ (expert_cluster[:, None] == np.arange(num_devices))

    def objective(cluster):
        return coclustering_objective(cluster, expert_cluster, confidence, frequency, num_devices, theta)

    start = rng.integers(num_devices, size=num_units)
    polished = polish_units(start, local, frequency, 1, theta, max_rounds=10_000, swap_units=num_units)
    assert polished.dtype == np.int64 and polished.shape == (num_units,) and polished.max() < num_devices
    value = objective(polished)
    assert value <= objective(start) + 1e-9
    tol = 1e-7 * frequency.sum()
    for unit in range(num_units if num_units < 40 else 0):  # brute force on the small ones
        for device in range(num_devices):
            moved = polished.copy()
            moved[unit] = device
            assert objective(moved) >= value - tol
        for other in range(unit + 1, num_units):
            swapped = polished.copy()
            swapped[[unit, other]] = polished[[other, unit]]
            assert objective(swapped) >= value - tol


def test_paper_only_search_is_the_plain_alternation():
    # n_starts=1, polish_rounds=0: one alternation of 1 + n_steps rounds, the best round returned
    rng = np.random.default_rng(5)
    affinity = rng.random((2, 40, 8))
    load = affinity[0].sum(axis=1)
    affinity = affinity / affinity.sum(axis=2, keepdims=True) * load[None, :, None]
    plain = balanced_cocluster(affinity, load, 4, np.random.default_rng(0), n_steps=3, n_starts=1, polish_rounds=0)
    assert len(plain.history) == 4 and plain.objective == min(plain.history)
    full = balanced_cocluster(affinity, load, 4, np.random.default_rng(0), n_steps=3)
    assert full.objective <= plain.objective + 1e-9  # start 0 is the same run; the rest only adds
    assert len(full.history) == 4 * 4 + 1


def test_sparse_affinity_sums_equal_the_bincount_definition_to_the_last_bit():
    """The compiled scatter sums add in entry order, as np.bincount does: bit-identical, with non-dyadic values."""
    rng = np.random.default_rng(5)
    num_layers, num_units, num_experts, devices = 3, 70, 16, 4
    dense = rng.integers(1, 50, (num_layers, num_units, num_experts)) * (rng.random((num_layers, num_units, num_experts)) < 0.3) / 6
    affinity = SparseAffinity.from_dense(dense)
    layer, unit, expert = np.nonzero(dense)
    assert np.array_equal(affinity.layer, layer) and np.array_equal(affinity.expert, expert)
    expert_device = rng.integers(0, devices, (num_layers, num_experts))
    unit_cluster = rng.integers(0, devices, num_units)
    local = np.bincount(unit * devices + expert_device[layer, expert], weights=dense[layer, unit, expert],
                        minlength=num_units * devices).reshape(num_units, devices)
    cluster = np.bincount((layer * devices + unit_cluster[unit]) * num_experts + expert, weights=dense[layer, unit, expert],
                          minlength=num_layers * devices * num_experts).reshape(num_layers, devices, num_experts)
    assert np.array_equal(affinity.local_mass(expert_device, devices), local)
    assert np.array_equal(affinity.cluster_affinity(unit_cluster, devices), cluster)
    hotness = np.bincount(layer * num_experts + expert, weights=dense[layer, unit, expert], minlength=num_layers * num_experts)
    assert np.array_equal(affinity.hotness(), hotness.reshape(num_layers, num_experts))
