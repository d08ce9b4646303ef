"""Decode placement for time (repro/systems/signature.py placement=signature_time / time): planted cases where the
signature clusters are perfect (the rule must find them and the time search must keep them) and where the
co-placement piles co-activated experts on one device (the time objective must spread them)."""

import numpy as np
import pytest
import yaml
from test_run import ROOT
from test_signature import DEVICES, EXPERTS, LAYERS, TOP_K, planted, windowed_groups

from repro.eval.decode_phase import decode_phase_metrics
from repro.eval.time_cost import load_shape, time_model
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.systems.signature import decode_step_cost, decode_step_tables, place_for_decode_time
from repro.traces import make_trace

DP = ParallelConfig(devices=DEVICES, attention="dp", tokens_per_step=64)


def fit(name, profile, **params):
    return make_system(name, **params).fit(profile, DP, np.random.default_rng(0))


def test_time_search_spreads_experts_that_are_active_together():
    """Two devices, four experts: experts 0 and 1 are active together in every step, 2 and 3 together in none;
    the start piles 0 and 1 on device 0, so device 0 reads two experts' weights per step. Spread, each step's
    busiest device reads ceil(active / 2) experts: 1 + 2 + 2."""
    active_KE = np.array([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]], dtype=np.float32)
    sent_KDE = np.zeros((3, 2, 4), dtype=np.float32)  # no remote traffic: only the weights read count
    start = np.array([0, 0, 1, 1])
    assert decode_step_cost(start, active_KE, sent_KDE, 100.0) == 6.0  # 2 reads per step on device 0
    out = place_for_decode_time(active_KE[None], sent_KDE[None], start[None], 100.0)[0]
    assert out[0] != out[1] and np.bincount(out, minlength=2).tolist() == [2, 2]
    assert decode_step_cost(out, active_KE, sent_KDE, 100.0) == 5.0


def test_time_search_keeps_locality_when_weights_read_are_equal():
    """Every expert active in every step (equal weights read under any placement): the search must not trade away
    the locality of a co-placement where each rank's tokens use its own experts."""
    active_KE = np.ones((2, 4), dtype=np.float32)
    sent_KDE = np.zeros((2, 2, 4), dtype=np.float32)
    sent_KDE[:, 0, :2] = 5  # rank 0's tokens use experts 0, 1; rank 1's use 2, 3
    sent_KDE[:, 1, 2:] = 5
    start = np.array([0, 0, 1, 1])
    np.testing.assert_array_equal(place_for_decode_time(active_KE[None], sent_KDE[None], start[None], 10.0)[0], start)
    assert decode_step_cost(np.array([0, 1, 0, 1]), active_KE, sent_KDE, 10.0) > decode_step_cost(
        start, active_KE, sent_KDE, 10.0)


def test_decode_step_tables_count_each_step_on_its_rank():
    split = planted([0, 1], seed=0, prompt_len=2, gen_len=3)
    active, sent = decode_step_tables(split.experts, split.offsets, split.prefill_len, np.array([1, 3]), EXPERTS,
                                      DEVICES)
    assert active.shape == (LAYERS, 3, EXPERTS) and sent.shape == (LAYERS, 3, DEVICES, EXPERTS)
    assert sent.sum() == 2 * 3 * LAYERS * TOP_K and sent[:, :, [0, 2]].sum() == 0
    row = split.offsets[1] + 2 + 1  # request 1's second generated token
    np.testing.assert_array_equal(np.flatnonzero(sent[0, 1, 3]), np.sort(np.asarray(split.experts[row, 0])))


@pytest.fixture(scope="module")
def perfect():
    return planted(windowed_groups(40, 1), seed=1), planted(windowed_groups(30, 2), seed=2)


@pytest.mark.parametrize("name", ["signature", "signature_eldr"])
def test_time_placement_finds_perfect_clusters(perfect, name):
    profile, evaluation = perfect
    out = decode_phase_metrics(fit(name, profile, placement="signature_time"), evaluation)
    ep = decode_phase_metrics(fit("ep", profile), evaluation)
    assert out["decode_lar"] > 0.95 and ep["decode_lar"] < 0.45
    assert out["decode_token_imbalance_max_mean"] < 1.25


def piled_split(seed):
    """Group 0's requests generate 24 tokens, the others 2: after step 2 only group 0 decodes, so the co-placement
    (group 0's four experts on one device) makes that device read all four while the others idle."""
    base = planted(windowed_groups(30, seed), seed=seed, prompt_len=16, gen_len=24)
    groups = windowed_groups(30, seed)
    keep = np.where(groups == 0, 16 + 24, 16 + 2)
    rows = np.concatenate([np.arange(base.offsets[r], base.offsets[r] + keep[r]) for r in range(base.num_requests)])
    return make_trace(base.meta, np.concatenate([[0], np.cumsum(keep)]), np.asarray(base.token_ids)[rows],
                      np.asarray(base.experts)[rows], prefill_len=np.full(base.num_requests, 16))


def test_time_objective_spreads_what_the_co_placement_piles_up():
    profile, evaluation = piled_split(1), piled_split(2)
    hardware = yaml.safe_load((ROOT / "conf" / "hardware" / "h200.yaml").read_text())
    out = {}
    for placement in ("signature", "signature_time"):
        plan = fit("signature", profile, placement=placement)
        model = time_model(plan, evaluation, hardware, load_shape("deepseek_v2_lite"))
        out[placement] = decode_phase_metrics(plan, evaluation, time_model=model)
    piled, spread = out["signature"], out["signature_time"]
    assert piled["decode_device_distinct_experts_max"] > spread["decode_device_distinct_experts_max"] + 0.5
    assert spread["decode_moe_seconds_per_step"] < piled["decode_moe_seconds_per_step"]


def test_through_the_app_the_time_placement_never_sees_the_evaluated_routing(tmp_path):
    """Scrambling the evaluate split's routing (prompt and generated tokens) leaves the fitted placement unchanged
    and changes the decode numbers (the scramble was visible)."""
    from test_decode_phase import generated_trace_dir
    from test_run import compose

    from repro.run import build_traces, fit_and_evaluate, request_split
    from repro.traces import read_trace, select_requests

    trace_dir = generated_trace_dir(tmp_path / "t", True)
    config = compose(f"trace={trace_dir}", "parallel.attention=dp", "parallel.devices=4", "parallel.tokens_per_step=64",
                     "logger=none", "system=signature")
    trace = read_trace(trace_dir, mmap=False)
    split = request_split(config, trace.num_requests)
    rows = np.concatenate([np.arange(trace.offsets[r], trace.offsets[r + 1]) for r in split.evaluate])
    experts = np.array(trace.experts)
    experts[rows] = (experts[rows] + 5) % trace.meta.num_experts
    scrambled = make_trace(trace.meta, trace.offsets, trace.token_ids, experts, prefill_len=trace.prefill_len)
    profile, evaluation = build_traces(config)
    first, _, plan = fit_and_evaluate(config, profile, evaluation)
    second, _, other = fit_and_evaluate(config, profile, select_requests(scrambled, split.evaluate))
    assert plan.info["placement"] == "signature_time"
    np.testing.assert_array_equal(plan.placement.physical_to_logical, other.placement.physical_to_logical)
    assert first["decode_moe_seconds_per_step"] != second["decode_moe_seconds_per_step"]
