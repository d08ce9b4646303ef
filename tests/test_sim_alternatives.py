"""Calibration alternatives of the hardware profiles (repro.sim.hardware): every one loads and changes exactly the
fields it names, the simulator prices with the one sim.calibration picks (and says which), bad ones are refused."""

import copy

import numpy as np
import pytest

from repro.errors import ConfigError
from repro.sim import load_hardware
from repro.sim.hardware import PUBLISHED, REQUIRED, _get, calibration_alternatives, with_alternative
from tests.test_sim import ROOT, load_yaml, run_small, small_setup  # noqa: F401  (fixture)


def profiles():
    return [load_yaml("hardware", p.name) for p in sorted((ROOT / "conf" / "hardware").glob("*.yaml"))]


def test_every_alternative_loads_and_changes_only_its_fields():
    seen = 0
    for profile in profiles():
        original = copy.deepcopy(profile)
        for name, spec in calibration_alternatives(profile).items():
            assert spec["source"].strip(), (profile["name"], name)
            changed = with_alternative(profile, name)
            differ = {f for f in REQUIRED if f != "name" and _get(changed, f) != _get(profile, f)}
            assert differ == set(spec.get("set", {})), (profile["name"], name)  # each field really moves
            assert load_hardware(profile, alternative=name).calibration == name
            seen += 1
        assert profile == original  # the profile itself is never modified
        assert with_alternative(profile, PUBLISHED) == profile
    assert seen >= 10  # the NVLink profiles carry the three open readings


def test_alternatives_move_the_priced_numbers():
    profile = load_yaml("hardware", "h200.yaml")
    base = load_hardware(profile)
    rdma = load_hardware(profile, alternative="deepep_ll_rdma").backends["deepep_low_latency"]
    assert rdma.dispatch.nvlink_bandwidth == base.backends["deepep_low_latency"].dispatch.rdma_bandwidth
    assert load_hardware(profile, alternative="ll_call_cost_128").backends["deepep_low_latency"].combine.latency \
        == pytest.approx(114e-6)
    assert base.iteration_overhead == 0
    assert load_hardware(profile, alternative="iteration_overhead_3ms").iteration_overhead == pytest.approx(3e-3)


def test_error_band_alternatives_scale_every_term_and_match_the_measured_band():
    """The band_* readings scale the priced numbers (scale:), and the published band is the worst out-of-sample
    all-to-all error that repro.sim.validation computes today (a band copied from a stale table fails here)."""
    from repro.sim import trust

    profile = load_yaml("hardware", "h200.yaml")
    base = load_hardware(profile)
    found = calibration_alternatives(profile)
    for name in ("band_published_comm_up", "band_exec_median_comm_down"):
        scale = found[name]["scale"]
        hw = load_hardware(profile, alternative=name)
        assert hw.calibration == name
        assert hw.gemm_flops == pytest.approx(base.gemm_flops / scale["compute"])
        assert hw.kernel_floor == pytest.approx(base.kernel_floor * scale["compute"])
        ll = hw.backends["deepep_low_latency"].combine
        assert ll.latency == pytest.approx(base.backends["deepep_low_latency"].combine.latency * scale["comm"])
        assert ll.nvlink_bandwidth == pytest.approx(base.backends["deepep_low_latency"].combine.nvlink_bandwidth / scale["comm"])
        assert hw.iteration_overhead == base.iteration_overhead
    worst = trust.published_errors()["worst_comm_out_of_sample"]
    assert found["band_published_comm_up"]["scale"] == {"comm": pytest.approx(1 + worst, abs=5e-4), "compute": 1.0}
    assert found["band_published_comm_down"]["scale"] == {"comm": pytest.approx(1 - worst, abs=5e-4), "compute": 1.0}
    up, down = found["band_exec_median_comm_up"]["scale"], found["band_exec_median_comm_down"]["scale"]
    assert up["comm"] - 1 == pytest.approx(1 - down["comm"]) and 1 - up["compute"] == pytest.approx(down["compute"] - 1)


def test_simulator_prices_with_the_chosen_alternative(small_setup):  # noqa: F811
    published = run_small(small_setup)
    slower = run_small(small_setup, calibration="iteration_overhead_3ms")
    assert published.summary["sim_calibration"] == PUBLISHED
    assert slower.summary["sim_calibration"] == "iteration_overhead_3ms"
    assert slower.summary["sim_iteration_overhead_us"] == pytest.approx(3000)
    # 3 ms per iteration more: every request's end-to-end time grows by at least 3 ms per iteration it takes
    assert np.all(slower.per_rate["e2e_mean_s"].to_numpy()[:2] > published.per_rate["e2e_mean_s"].to_numpy()[:2] + 3e-3)
    # an explicit sim.iteration_overhead_us wins over the profile's
    explicit = run_small(small_setup, calibration="iteration_overhead_3ms", iteration_overhead_us=0)
    assert explicit.summary["sim_iteration_overhead_us"] == 0
    np.testing.assert_array_equal(explicit.per_rate["e2e_mean_s"], published.per_rate["e2e_mean_s"])


def test_unknown_alternative_names_the_ones_there_are(small_setup):  # noqa: F811
    with pytest.raises(ConfigError, match=r"no calibration alternative 'nvlink_x3'; it has \['published', 'deepep_ll_rdma'"):
        run_small(small_setup, calibration="nvlink_x3")


@pytest.mark.parametrize(
    "alternatives, words",
    [
        ({"published": {"source": "x", "set": {"kernel_floor_us": 1}}}, "is the profile as written"),
        ({"a": {"source": "x", "set": {"gpu.colour": 1}}}, "not a numeric field"),
        ({"a": {"source": "x", "set": {"kernel_floor_us": "fast"}}}, "must be a number"),
        ({"a": {"set": {"kernel_floor_us": 1}}}, "must be {source"),
        ({"a": {"source": "x"}}, "must be {source"),
        ({"a": {"source": "x", "scale": {"comm": 1.2}}}, "scale must be {comm"),
        ({"a": {"source": "x", "scale": {"comm": 1.2, "compute": 0}}}, "scale must be {comm"),
        ({"a": {"source": " ", "set": {"kernel_floor_us": 1}}}, "must be {source"),
        ([1], "must map a name"),
    ],
)
def test_bad_alternatives_are_refused(alternatives, words):
    profile = dict(load_yaml("hardware", "h200.yaml"), alternatives=alternatives)
    with pytest.raises(ConfigError, match=words.replace("{", r"\{")):
        load_hardware(profile)
