"""Decode placement by prefill signature (repro/systems/signature.py, repro/eval/decode_phase.py) and generated-token
routing in imported tables: a planted case where prefill signatures predict decode experts exactly, the honesty of
the online decode router (it sees prompt routing only), the pure functions, and the input boundaries."""

import numpy as np
import pandas as pd
import pytest
import yaml
from test_import import write_table
from test_run import ROOT

from repro.errors import ConfigError, TraceError
from repro.eval import evaluate
from repro.eval.accounting import home_devices
from repro.eval.decode_phase import decode_phase_metrics, prompt_tail_as_decode
from repro.eval.time_cost import load_shape, time_model
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.systems.signature import (
    balanced_kmeans,
    place_balanced,
    place_by_activations,
    request_signatures,
    row_pearson,
    segment_counts,
    signature_correlation,
)
from repro.traces import TraceMeta, make_trace
from repro.traces.tabular import import_table

DEVICES, EXPERTS, LAYERS, TOP_K = 4, 16, 3, 2


def planted(groups, seed=0, prompt_len=16, gen_len=8, noise=0.0):
    """A trace whose request r belongs to groups[r]: at layer l, all its tokens (prompt and generated) pick their
    TOP_K experts among the E/D experts of block groups[r] of a random permutation of layer l's experts (so the
    blocks are not EP's contiguous ones); a `noise` share of tokens picks uniformly instead."""
    rng = np.random.default_rng(seed)
    per = EXPERTS // DEVICES
    blocks = np.stack([np.random.default_rng(99 + layer).permutation(EXPERTS).reshape(DEVICES, per)
                       for layer in range(LAYERS)])  # the same model for every seed
    groups = np.asarray(groups)
    lengths = np.full(len(groups), prompt_len + gen_len)
    n = int(lengths.sum())
    owner = np.repeat(groups, lengths)
    experts = np.empty((n, LAYERS, TOP_K), dtype=np.int64)
    for layer in range(LAYERS):
        pick = np.argsort(rng.random((n, per)), axis=1)[:, :TOP_K]
        experts[:, layer] = blocks[layer, owner][np.arange(n)[:, None], pick]
        noisy = rng.random(n) < noise
        experts[noisy, layer] = np.argsort(rng.random((int(noisy.sum()), EXPERTS)), axis=1)[:, :TOP_K]
    meta = TraceMeta(model="planted", num_experts=EXPERTS, top_k=TOP_K, layer_ids=tuple(range(LAYERS)),
                     vocab_size=50, dataset="planted")
    return make_trace(meta, np.concatenate([[0], np.cumsum(lengths)]), rng.integers(0, 50, n), experts,
                      prefill_len=np.full(len(groups), prompt_len))


def windowed_groups(windows, seed):
    """Every window of DEVICES requests holds one request of each group, in random order (balance is feasible)."""
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.permutation(DEVICES) for _ in range(windows)])


DP = ParallelConfig(devices=DEVICES, attention="dp", tokens_per_step=64)


def fit(name, profile, **params):
    return make_system(name, **params).fit(profile, DP, np.random.default_rng(0))


@pytest.fixture(scope="module")
def split():
    return planted(windowed_groups(40, 1), seed=1), planted(windowed_groups(30, 2), seed=2)


def test_planted_signature_routes_decode_locally_with_balance(split):
    profile, evaluation = split
    ep = decode_phase_metrics(fit("ep", profile), evaluation)
    plan = fit("signature", profile)
    sig = decode_phase_metrics(plan, evaluation)
    assert sig["decode_lar"] > 0.99 and ep["decode_lar"] < 0.45
    assert sig["decode_token_imbalance_max_mean"] == 1.0  # capacity_slack=1: one decode per rank per window
    # each rank's decode batch activates only its own group's E/D experts
    assert sig["decode_batch_distinct_experts_max"] <= EXPERTS // DEVICES < ep["decode_batch_distinct_experts_max"]
    assert plan.info["cluster_size_max_mean"] == 1.0 and plan.info["profile_signature_correlation"] > 0.5
    eldr = decode_phase_metrics(fit("signature_eldr", profile), evaluation)
    assert eldr["decode_lar"] > 0.9 and eldr["decode_token_imbalance_max_mean"] < 1.25
    # signature routing on EP's contiguous blocks cannot co-locate a group's scattered experts
    vanilla = decode_phase_metrics(fit("signature", profile, placement="vanilla", match="experts"), evaluation)
    assert ep["decode_lar"] <= vanilla["decode_lar"] + 0.05 and vanilla["decode_lar"] < sig["decode_lar"] - 0.3


def test_evaluator_accounts_prompt_on_prefill_rank_and_generated_tokens_on_decode_rank(split):
    profile, evaluation = split
    plan = fit("signature", profile)
    home = home_devices(plan, evaluation)[:, 0]
    request = evaluation.request_of_token()
    prompt = evaluation.prompt_mask()
    np.testing.assert_array_equal(home[prompt], request[prompt] % DEVICES)  # round-robin prefill
    result = evaluate(plan, evaluation)
    local_decode = decode_phase_metrics(plan, evaluation)["decode_lar"] * (~prompt).sum()
    assert result.summary["local_activations"] >= local_decode * LAYERS * TOP_K  # decode locality reaches the totals
    # a request-count scheduler that moves whole requests would put its generated tokens on its prefill rank
    moved = (home != request % DEVICES) & ~prompt
    assert moved.any()


# ---- honesty: the decode router sees the request's prompt routing, never its decode routing ------------------


def with_experts(trace, experts):
    return make_trace(trace.meta, trace.offsets, trace.token_ids, experts, prefill_len=trace.prefill_len)


@pytest.mark.parametrize("name", ["signature", "signature_eldr"])
def test_decode_ranks_ignore_decode_routing_and_follow_prompt_routing(split, name):
    profile, evaluation = split
    plan = fit(name, profile)
    home = home_devices(plan, evaluation)
    prompt = evaluation.prompt_mask()
    rng = np.random.default_rng(5)
    experts = np.array(evaluation.experts)
    scrambled = experts.copy()
    scrambled[~prompt] = np.argsort(rng.random(((~prompt).sum(), LAYERS, EXPERTS)), axis=2)[:, :, :TOP_K]
    np.testing.assert_array_equal(home_devices(plan, with_experts(evaluation, scrambled)), home)
    # positive control: the same change to the prompt routing moves decode ranks
    moved = experts.copy()
    moved[prompt] = np.argsort(rng.random((prompt.sum(), LAYERS, EXPERTS)), axis=2)[:, :, :TOP_K]
    changed = home_devices(plan, with_experts(evaluation, moved))
    assert np.any(changed[~prompt] != home[~prompt])


def test_decode_router_is_shown_only_read_only_prompt_routing(split):
    profile, evaluation = split
    plan = fit("signature", profile)
    seen = {}
    original = plan.assign_decode

    def spy(prompt_experts, prompt_offsets, prefill_ranks):
        seen.update(experts=prompt_experts, offsets=prompt_offsets, writeable=prompt_experts.flags.writeable)
        return original(prompt_experts, prompt_offsets, prefill_ranks)

    plan.assign_decode = spy
    home_devices(plan, evaluation)
    np.testing.assert_array_equal(seen["experts"], np.asarray(evaluation.experts)[evaluation.prompt_mask()])
    np.testing.assert_array_equal(np.diff(seen["offsets"]), evaluation.prefill_len)
    assert not seen["writeable"]


def test_decode_assignment_streams_one_request_at_a_time(split):
    """Deciding the requests in two calls gives the same ranks as one call: no look-ahead over later requests."""
    profile, evaluation = split
    plan = fit("signature", profile)
    prompt = evaluation.prompt_mask()
    experts = np.asarray(evaluation.experts)[prompt]
    offsets = np.concatenate([[0], np.cumsum(evaluation.prefill_len)])
    ranks = np.zeros(evaluation.num_requests, dtype=np.int64)
    plan.reset()
    whole = plan.assign_decode(experts, offsets, ranks)
    plan.reset()
    cut = 37
    first = plan.assign_decode(experts[: offsets[cut]], offsets[: cut + 1], ranks[:cut])
    second = plan.assign_decode(experts[offsets[cut] :], offsets[cut:] - offsets[cut], ranks[cut:])
    np.testing.assert_array_equal(np.concatenate([first, second]), whole)


# ---- pure functions ------------------------------------------------------------------------------------------


def test_segment_counts_match_a_loop():
    rng = np.random.default_rng(0)
    experts = rng.integers(0, 6, (50, 2, 3))
    starts, stops = np.array([0, 10, 10, 30]), np.array([10, 10, 25, 50])
    got = segment_counts(experts, starts, stops, 6)
    for r, (a, b) in enumerate(zip(starts, stops, strict=True)):
        for layer in range(2):
            np.testing.assert_array_equal(got[r, layer], np.bincount(experts[a:b, layer].ravel(), minlength=6))


def test_signatures_and_their_correlation():
    trace = planted(windowed_groups(3, 0), seed=0)
    prefill, decode = request_signatures(trace, "prefill"), request_signatures(trace, "decode")
    assert prefill.shape == (12, LAYERS * EXPERTS)
    np.testing.assert_allclose(prefill.reshape(12, LAYERS, EXPERTS).sum(axis=2), 1.0)
    rng = np.random.default_rng(0)
    a, b = rng.random((5, 9)), rng.random((5, 9))
    np.testing.assert_allclose(row_pearson(a, b), [np.corrcoef(x, y)[0, 1] for x, y in zip(a, b, strict=True)])
    assert signature_correlation(prefill, prefill) == pytest.approx(1.0)
    assert signature_correlation(prefill, decode) > 0.5  # same group's experts in both phases
    assert np.isnan(signature_correlation(prefill, np.zeros_like(decode)))  # no decode tokens: undefined
    # a popularity profile shared by all requests, plus noise drawn apart per phase: plain high, centred ~0
    popular = rng.dirichlet(np.full(40, 0.3))
    alike_prefill = popular + rng.normal(0, 0.01, (200, 40))
    alike_decode = popular + rng.normal(0, 0.01, (200, 40))
    assert signature_correlation(alike_prefill, alike_decode) > 0.8
    assert abs(signature_correlation(alike_prefill, alike_decode, centred=True)) < 0.05
    assert signature_correlation(prefill, decode, centred=True) > 0.5  # the planted groups are request-specific
    with pytest.raises(ConfigError, match="phase"):
        request_signatures(trace, "generate")


def test_balanced_kmeans_recovers_planted_clusters_under_capacity():
    rng = np.random.default_rng(0)
    truth = np.repeat(np.arange(4), [30, 30, 30, 10])  # one small cluster: capacity 25 each moves nobody out
    points = np.eye(4)[truth] * 5 + rng.normal(0, 0.1, (100, 4))
    labels, centroids, _ = balanced_kmeans(points, 4, np.random.default_rng(1))
    assert np.bincount(labels, minlength=4).max() <= 25
    for c in range(3):  # each big true cluster keeps a 25-point core
        assert np.bincount(labels[truth == c]).max() >= 25
    assert len({int(np.bincount(labels[truth == c]).argmax()) for c in range(3)}) == 3
    with pytest.raises(ConfigError, match="at least 4 points"):
        balanced_kmeans(points[:3], 4, np.random.default_rng(0))


def test_place_by_activations_gives_each_device_its_clusters_experts():
    rng = np.random.default_rng(0)
    want = np.stack([rng.permutation(np.arange(8) % 4) for _ in range(2)])  # [L, E] device of each expert
    act = np.where(want[:, None, :] == np.arange(4)[None, :, None], 10.0, 1.0) * rng.uniform(0.9, 1.1, (2, 4, 8))
    np.testing.assert_array_equal(place_by_activations(act), want)


def test_balanced_placement_spreads_the_hot_experts_that_the_exact_one_piles_up():
    # cluster 0 uses the four hot experts (0-3) most, cluster 1 the cold ones: max locality puts all hot on device 0
    act = np.zeros((1, 2, 8))
    act[0, 0, :4], act[0, 1, :4] = 12.0, 8.0
    act[0, 0, 4:], act[0, 1, 4:] = 0.5, 1.0
    hot = act.sum(axis=1)[0]
    exact = place_by_activations(act)[0]
    balanced = place_balanced(act, np.random.default_rng(0))[0]
    assert np.bincount(balanced, minlength=2).tolist() == [4, 4]

    def max_load(device):
        return np.bincount(device, weights=hot, minlength=2).max()
    assert max_load(exact) == 80.0 and max_load(balanced) < max_load(exact)


# ---- input boundaries ------------------------------------------------------------------------------------------


def test_the_system_refuses_what_it_cannot_do(split):
    profile, _ = split
    with pytest.raises(ConfigError, match="Attention-DP"):
        make_system("signature").fit(profile, ParallelConfig(devices=4, attention="tp"), np.random.default_rng(0))
    prompt_only = make_trace(profile.meta, profile.offsets, profile.token_ids, profile.experts)
    with pytest.raises(ConfigError, match="no generated tokens"):
        fit("signature", prompt_only)
    fit("signature", prompt_only, placement="vanilla", match="experts")  # matching on EP's blocks needs no decode
    with pytest.raises(ConfigError, match="match=experts"):
        make_system("signature", placement="vanilla")
    for bad in (dict(rule="random"), dict(capacity_slack=0), dict(eldr_top=1.5), dict(cluster_slack=2),
                dict(load_weight=-1.0)):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            make_system("signature", **bad)


def test_decode_metrics_need_generated_tokens_and_the_proxy_marks_prompt_tails(split):
    profile, evaluation = split
    plan = fit("ep", profile)
    prompt_only = make_trace(evaluation.meta, evaluation.offsets, evaluation.token_ids, evaluation.experts)
    with pytest.raises(TraceError, match="no generated tokens"):
        decode_phase_metrics(plan, prompt_only)
    proxy = prompt_tail_as_decode(prompt_only, 0.25)
    np.testing.assert_array_equal(proxy.prefill_len, evaluation.lengths() - 6)  # ceil(0.25 x 24)
    assert decode_phase_metrics(plan, proxy)["decode_tokens"] == 6 * evaluation.num_requests
    with pytest.raises(TraceError, match="already holds generated tokens"):
        prompt_tail_as_decode(evaluation, 0.25)
    with pytest.raises(ConfigError, match="decode_share"):
        prompt_tail_as_decode(prompt_only, 1.0)


def test_decode_time_is_priced_and_signature_reads_fewer_expert_rows(split):
    profile, evaluation = split
    hardware = yaml.safe_load((ROOT / "conf" / "hardware" / "h200.yaml").read_text())
    out = {}
    for name in ("ep", "signature"):
        plan = fit(name, profile)
        model = time_model(plan, evaluation, hardware, load_shape("deepseek_v2_lite"))
        out[name] = decode_phase_metrics(plan, evaluation, time_model=model)
        assert out[name]["decode_moe_seconds"] > 0
        assert out[name]["decode_moe_seconds_per_step"] == pytest.approx(out[name]["decode_moe_seconds"] / 8)
    assert out["signature"]["decode_moe_seconds"] < out["ep"]["decode_moe_seconds"]  # local dispatch is cheaper


# ---- imported tables carry generated-token routing -------------------------------------------------------------


def phase_table(phases_per_request) -> pd.DataFrame:
    rows = []
    for r, phases in enumerate(phases_per_request):
        for p, phase in enumerate(phases):
            for layer in (0, 1):
                rows.append(dict(request_id=f"q{r}", position=p, layer=layer, token_id=p, experts=[layer, 2 + p],
                                 phase=phase))
    return pd.DataFrame(rows)


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_import_reads_a_phase_or_prefill_len_column(tmp_path, suffix):
    table = phase_table([["prefill", "prefill", "decode"], ["prefill", "decode", "decode", "decode"], ["prefill"]])
    trace = import_table(write_table(table, tmp_path / f"t{suffix}"))
    np.testing.assert_array_equal(trace.prefill_len, [2, 1, 1])
    as_len = table.drop(columns="phase").assign(prefill_len=table.request_id.map({"q0": 2, "q1": 1, "q2": 1}))
    np.testing.assert_array_equal(import_table(write_table(as_len, tmp_path / f"l{suffix}")).prefill_len, [2, 1, 1])
    plain = import_table(write_table(table.drop(columns="phase"), tmp_path / f"p{suffix}"))
    np.testing.assert_array_equal(plain.prefill_len, plain.lengths())  # no column: every token is prompt


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.assign(phase=t.phase.where(t.index != 4, "generate")), "line 6: phase 'generate' is neither"),
        (lambda t: t.assign(phase=t.phase.where(t.index != 5, "prefill")), "line 6: .* differs between the token's layers"),
        (lambda t: t.assign(phase=t.phase.where(~t.index.isin([10, 11]), "prefill")), "line 12: .* prefill after a decode"),
        (lambda t: t.assign(prefill_len=2), "both a phase column"),
    ],
)
def test_import_refuses_inconsistent_phases(tmp_path, edit, message):
    # q0: prefill, prefill, decode (rows 0-5, CSV lines 2-7); q1: prefill, decode, decode (rows 6-11)
    table = phase_table([["prefill", "prefill", "decode"], ["prefill", "decode", "decode"]])
    with pytest.raises(TraceError, match=message):
        import_table(write_table(edit(table), tmp_path / "t.csv"))


def test_import_refuses_a_bad_prefill_len(tmp_path):
    table = phase_table([["prefill"] * 3, ["prefill"] * 2]).drop(columns="phase")
    differs = table.assign(prefill_len=np.where(table.index == 3, 1, 2))
    with pytest.raises(TraceError, match="line 5: prefill_len 1 differs from 2"):
        import_table(write_table(differs, tmp_path / "a.csv"))
    too_long = table.assign(prefill_len=3)
    with pytest.raises(TraceError, match="line 8: prefill_len 3 exceeds the 2 tokens of request_id q1"):
        import_table(write_table(too_long, tmp_path / "b.csv"))
