"""The drift job's serving pass (repro/drift/serving.py): a planted abrupt switch whose drift-triggered re-placement
stalls the window it lands in and then brings TTFT back; a change asked for only once its window's routing was all
served; a stationary stream served exactly as the static plan; one-sentence refusals; the same numbers twice.

The case: test_drift's planted cliques (8 experts, top-2, 2 layers, 2 devices) served on test_sim's hand hardware
sped up 10^4 times (slow links, so locality sets the latency), a 0.25 s per-layer migration overhead (a 0.5 s sync
stall), 20 requests/s, one second of arrivals per window."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from test_drift import PROFILE, WINDOW, planted_trace
from test_sim import HAND_SHAPE, hand_hardware

from repro.drift.serving import asked_times, check_serving_config, serving_setup, window_last_finish
from repro.drift.timeline import drift_job
from repro.errors import ConfigError

SWITCH, WINDOWS = 3, 7


def fast_hand_hardware(k: float = 1e4) -> dict:
    hw = hand_hardware()
    hw["gpu"] = dict(hw["gpu"], bf16_tflops=hw["gpu"]["bf16_tflops"] * k)
    for backend in hw["a2a"].values():
        for phase in ("dispatch", "combine"):
            backend[phase] = dict(backend[phase], latency_us=backend[phase]["latency_us"] / k,
                                  nvlink_gbps=backend[phase]["nvlink_gbps"] * k)
    hw["collective"] = dict(hw.get("collective", {}), latency_us=10.0, nvlink_gbps=1.0, rdma_gbps=0)
    return hw


def config_for(policies: dict, **serving) -> dict:
    sim = OmegaConf.to_container(OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "sim" / "default.yaml"))
    sim.pop("defaults")
    sim.update(shape=dict(HAND_SHAPE, num_hidden_layers=2, num_experts=8, top_k=2), output_len=4)
    small = {"lookback": 0, "n_starts": 1, "polish_rounds": 0, "ft_steps": 8}
    return {
        "seed": 0, "history": 2, "parallel": {"devices": 2, "attention": "dp", "devices_per_node": 2},
        "hardware": fast_hand_hardware(), "system": {"name": "semmoe", "params": small},
        "drift": {"window_requests": WINDOW, "profile_requests": PROFILE, "step_tokens": None, "window_steps": 1000,
                  "headline": "semmoe_drift", "reference": "semmoe", "eplb_reference": "semmoe_drift",
                  "mix_tolerance": 0.1, "migration": {"layer_overhead_s": 0.25},
                  "serving": {"enabled": True, "load": 0.7, "rate_rps": 20.0, "window_s": 1.0, "window_costs": True,
                              "sim": sim, **serving},
                  "policies": policies},
    }


POLICIES = {"semmoe": {"kind": "static", "system": "semmoe"},
            "semmoe_drift": {"kind": "semmoe_drift", "threshold": 0.2, "mode": "sync"}}


@pytest.fixture(scope="module")
def abrupt():
    trace = planted_trace(PROFILE + WINDOWS * WINDOW, PROFILE + SWITCH * WINDOW)
    return drift_job(config_for(POLICIES), trace)


def series(serving, policy: str, column: str) -> np.ndarray:
    return serving.loc[serving.policy == policy].sort_values("window")[column].to_numpy(dtype=float)


def test_planted_switch_stalls_the_window_the_migration_lands_in_then_ttft_recovers(abrupt):
    summary, _, events, serving = abrupt
    [event] = events.to_dict("records")
    assert event["after_window"] == SWITCH and event["mode"] == "sync"
    start, end = event["serving_start_s"], event["serving_end_s"]
    stall = summary["policies"]["semmoe_drift"]["serving_stall_s"]  # priced on the serving pass's shape and hardware
    assert end - start == pytest.approx(stall) and stall > 0.5  # 2 layers x 0.25 s, and the copies
    landing = int(end // 1.0)  # the window whose arrivals the stall holds back (the change is asked after window
    assert landing == SWITCH + 1  # SWITCH's last request finished, so after its arrivals)
    drift_p99, static_p99 = series(serving, "semmoe_drift", "ttft_p99_s"), series(serving, "semmoe", "ttft_p99_s")
    assert drift_p99[landing] > 10 * static_p99[landing]  # the stall shows in the TTFT of the window it lands in
    assert drift_p99[landing] > 0.5 * (end - landing * 1.0)  # a request arriving at the window's start waited for it
    assert series(serving, "semmoe_drift", "migrations_began").sum() == 1
    # the switch made static Sem-MoE's plan remote; the re-placement brings TTFT and LAR back for the rest of the run
    drift_mean, static_mean = series(serving, "semmoe_drift", "ttft_mean_s"), series(serving, "semmoe", "ttft_mean_s")
    before = drift_mean[:SWITCH].max()
    assert static_mean[SWITCH:].min() > 1.2 * before  # static: every window after the switch is slower than any before
    after = slice(landing + 1, WINDOWS)
    assert np.all(drift_mean[after] <= 1.05 * before) and np.all(drift_mean[after] < static_mean[after])
    assert np.all(drift_p99[after] <= 1.05 * drift_p99[:SWITCH].max())  # p99 TTFT back to its level before the switch
    assert np.all(series(serving, "semmoe_drift", "lar")[after] > series(serving, "semmoe", "lar")[after] + 0.2)
    # the window before the switch: both policies served the same plan, so the same numbers
    np.testing.assert_array_equal(drift_p99[:SWITCH + 1], static_p99[:SWITCH + 1])
    policy = summary["policies"]["semmoe_drift"]
    assert policy["serving_migrations"] == 1
    assert summary["serving_stall_s"] == policy["serving_stall_s"]  # the headline's serving keys at the top level
    for key in ("ttft_p99_s", "tpot_p99_s", "slo_attainment", "gain_kept_vs_hindsight", "experts_moved_vs_eplb",
                "false_alarms", "stall_s", "slo_ttft_s", "slo_tpot_s", "serving_rate_rps"):
        assert key in summary


def test_a_change_is_asked_for_only_after_its_window_was_served():
    from repro.drift.policies import SemMoEOnDrift, Stream
    from repro.drift.statistics import window_bounds
    from repro.parallel import ParallelConfig
    from repro.systems import make_system
    from repro.traces import select_requests

    config = config_for(POLICIES)
    trace = planted_trace(PROFILE + WINDOWS * WINDOW, PROFILE + SWITCH * WINDOW)
    parallel = ParallelConfig.from_config(config["parallel"])
    rest = select_requests(trace, np.arange(PROFILE, trace.num_requests))
    stream = Stream(rest, window_bounds(rest.num_requests, WINDOW), select_requests(trace, np.arange(PROFILE)), parallel,
                    np.full(WINDOWS, 1000))
    setup = serving_setup(config, stream, config["drift"]["serving"])
    policy = SemMoEOnDrift("d", make_system("semmoe", **config["system"]["params"]), threshold=0.2)
    first = policy.start(stream)
    fresh = make_system("semmoe", **config["system"]["params"]).fit(stream.window(SWITCH), parallel,
                                                                    np.random.default_rng(1))
    # two changes decided after windows 1 and 2: each asked when its window's last request finished in the run
    # reported, the second no earlier than the first
    for mode in ("sync", "async"):
        run, changes, times = asked_times(setup, first, [(1, fresh), (2, first)], mode)
        finish = window_last_finish(setup, run)
        assert times[0] >= finish[1] and times[1] >= max(finish[2], times[0])  # known when asked (the rule)
        if mode == "async":  # no stall pushes the finishes later while the times settle: asked (nearly) right then
            assert times[0] == finish[1] and times[1] == pytest.approx(max(finish[2], times[0]), abs=1e-3)
        assert [c.time_s for c in changes] == times and len(run.changes) == 2
        assert times[0] > setup.arrivals[setup.window_R == 1].max()  # after window 1's last arrival


def test_stationary_stream_is_served_as_the_static_plan_and_twice_the_same():
    trace = planted_trace(PROFILE + 4 * WINDOW, None)
    config = config_for(POLICIES)
    summary, _, events, serving = drift_job(config, trace)
    assert len(events) == 0 and summary["policies"]["semmoe_drift"]["serving_migrations"] == 0
    columns = ["ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "tpot_p99_s", "slo_attainment", "a2a_s", "lar"]
    for column in columns:
        np.testing.assert_array_equal(series(serving, "semmoe_drift", column), series(serving, "semmoe", column))
    again = drift_job(copy.deepcopy(config), trace)
    assert again[0] == summary and again[3].equals(serving)


def test_serving_config_refusals_are_one_sentence():
    good = config_for(POLICIES)["drift"]["serving"]
    check_serving_config(good)
    for bad, match in ((dict(good, speed=1), "has no key"), (dict(good, load=1.5, rate_rps=None), "load must be"),
                       (dict(good, rate_rps=-1), "rate_rps must be"), (dict(good, window_s=0), "window_s must be"),
                       (dict(good, enabled="yes"), "enabled must be"), (dict(good, sim=None), "needs drift.serving.sim"),
                       (dict(good, sim=dict(good["sim"], schedule="lifo")), "sim.schedule")):
        with pytest.raises(ConfigError, match=match) as error:
            check_serving_config(bad)
        assert str(error.value).count(". ") == 0 and "\n" not in str(error.value)


def test_no_policy_decision_reads_routing_after_its_window():
    """Two streams that agree up to window K and differ after it: every policy decides the same re-placements, with
    the same placements, after windows <= K (a decision at window w reads only windows <= w)."""
    from test_drift import TOKENS, serve, small_semmoe, stream_of

    from repro.drift.policies import EPLBSchedule, SemMoEOnDrift
    from repro.traces import make_trace

    last_same = SWITCH  # windows 0..SWITCH agree
    trace = planted_trace(PROFILE + WINDOWS * WINDOW, PROFILE + SWITCH * WINDOW)
    cut = (PROFILE + (last_same + 1) * WINDOW) * TOKENS  # first token of the windows that differ
    experts = np.asarray(trace.experts).copy()
    experts[cut:] = 7 - experts[cut:]  # another routing from there on
    other = make_trace(trace.meta, trace.offsets, trace.token_ids, experts,
                       request_datasets=list(trace.request_datasets))
    for make in (lambda: SemMoEOnDrift("d", small_semmoe(), threshold=0.2),
                 lambda: EPLBSchedule("e", interval=1000, window_size=1000)):
        runs = [serve(make(), stream_of(t)) for t in (trace, other)]
        early = [[(e["after_window"], e["experts_moved"]) for e in run.events if e["after_window"] <= last_same]
                 for run in runs]
        assert early[0] == early[1] and early[0]
        plans = [[plan.placement.physical_to_logical for w, plan in run.decisions if w <= last_same] for run in runs]
        for a, b in zip(*plans, strict=True):
            np.testing.assert_array_equal(a, b)
        # and the streams do differ after window K: some later decision or distance sees it
        assert any(x != y for x, y in zip(runs[0].rows[last_same + 1:], runs[1].rows[last_same + 1:], strict=True))


def test_a_window_without_arrivals_is_served_and_known_at_its_end():
    """At 1 request/s and 0.5 s windows some windows get no arrival: their series are empty, the run goes on."""
    trace = planted_trace(PROFILE + WINDOWS * WINDOW, PROFILE + SWITCH * WINDOW)
    _, _, _, serving = drift_job(config_for(POLICIES, rate_rps=1.0, window_s=0.5), trace)
    rows = serving.loc[serving.policy == "semmoe_drift"]
    empty = rows.loc[rows.requests == 0]
    assert len(empty) >= 1 and empty.ttft_p99_s.isna().all() and empty.slo_attainment.isna().all()
