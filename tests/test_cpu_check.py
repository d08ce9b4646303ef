"""bench.cpu_check and bench.bench_cost_model: the pure parts (no timings asserted)."""

from pathlib import Path

import numpy as np
import pytest
import yaml

from bench import bench_cost_model as cm
from bench import cpu_check
from repro.config_schema import check_hardware
from repro.errors import ConfigError
from repro.sim.costs import CostModel
from repro.sim.hardware import load_hardware
from repro.sim.shapes import RoutingMap
from repro.systems.ep import contiguous_placement

ROOT = Path(__file__).resolve().parents[1]


def fake_measurement(ranks: int) -> dict:
    return {"gemm_flops": 5e10, "copy_bytes_per_s": 2e10, "threads": 1, "kernel_floor_s": 2e-4, "gate_1_token_s": 1e-4,
            "expert_gemm": [[1, 1e-4], [16, 4e-4], [256, 5e-3]], "gate": [[1, 1e-4], [16, 1.5e-4], [256, 6e-4]],
            "a2a": [[(ranks - 1) * b, 1e-4 + (ranks - 1) * b / 1e9] for b in (8, 4096, 1048576)]}


def test_fit_a2a_recovers_latency_and_bandwidth():
    fit = cpu_check.fit_a2a([[8, 1e-4 + 8 / 2e9], [1e6, 1e-4 + 1e6 / 2e9], [4e6, 1e-4 + 4e6 / 2e9]])
    assert fit["latency_us"] == pytest.approx(100, abs=0.1) and fit["gbps"] == pytest.approx(2.0, rel=1e-3)
    assert fit["max_rel_error"] < 1e-3


def test_written_profile_loads_like_any_other_and_foreign_files_are_kept(tmp_path):
    m = fake_measurement(2)
    fit = cpu_check.fit_a2a(m["a2a"])
    name = cpu_check.profile_name("testhost", 2)
    profile = cpu_check.profile_document(name, 2, m, fit)
    calibration = cpu_check.calibration_document(name, 2, m, fit, {"before": [0, 0, 0], "after": [0, 0, 0]})
    (tmp_path / "measured").mkdir()
    base, measured = cpu_check.write_profile(tmp_path, tmp_path / "measured", profile, calibration)
    document = yaml.safe_load(base.read_text())
    check_hardware(document)  # the keys of a conf/hardware profile, nothing else
    hw = load_hardware(document, tmp_path / "measured")
    assert set(hw.calibrated_parts) >= {"kernel_floor", "a2a.nccl.dispatch", "expert_gemm.exec_cpu", "gate.exec_cpu"}
    assert hw.kernel_floor == pytest.approx(1e-4)
    # the gate is priced by its measured curve (interpolated), not by the router GEMM's roofline
    shape = cm.exec_shape(cpu_check.EXEC_SHAPE, 1)
    model = CostModel(shape, hw, RoutingMap("strict", 1, shape.num_experts, shape.top_k, 1.0,
                                            shape.moe_intermediate_size, ""), 2, "dp", "nccl")
    assert model.gate(np.array([0.0, 16.0, 136.0])) == pytest.approx([0.0, 1.5e-4, 3.75e-4])
    base.write_text("name: mine\n")
    with pytest.raises(ConfigError, match="not written by bench.cpu_check"):
        cpu_check.write_profile(tmp_path, tmp_path / "measured", profile, calibration)


@pytest.mark.parametrize("path", sorted((ROOT / "conf" / "hardware").glob("cpu_*.yaml")), ids=lambda p: p.stem)
def test_committed_cpu_profiles_load(path):
    document = yaml.safe_load(path.read_text())
    check_hardware(document)
    hw = load_hardware(document)
    assert "expert_gemm.exec_cpu" in hw.calibrated_parts and hw.num_devices == document["devices_per_node"]


def test_reduce_ranks_takes_slowest_compute_and_fastest_call():
    times = np.zeros((2, 1, 1, 1, 6))  # [D, C, L, R, 6]
    times[0, ..., :] = [1, 1, 1, 1, 5, 1]
    times[1, ..., :] = [2, 3, 3, 3, 4, 3]
    out = cm.reduce_ranks(times)[0, 0, 0]
    assert out.tolist() == [2, 3, 5, 1]  # gating max, dispatch = sum of the three calls' min, experts max, combine min


class _Trace:
    offsets = np.array([0, 3, 5, 9, 10])
    prefill_len = np.array([2, 2, 4, 1])


def test_batches_of_prefill_and_decode():
    ranks = np.array([0, 1, 0, 1])
    prefill = cm.batches_of(_Trace, ranks, 2, "prefill", 4)
    assert prefill[0].tolist() == [0, 1, 5, 6] and prefill[1].tolist() == [3, 4, 9]
    decode = cm.batches_of(_Trace, ranks, 2, "decode", 2)
    assert decode[0].tolist() == [2, 8] and decode[1].tolist() == [4, 9]  # first generated, else last prompt token


def test_predict_prices_every_phase_from_the_batch():
    hw = load_hardware(cpu_check.profile_document("t", 2, fake_measurement(2), cpu_check.fit_a2a(fake_measurement(2)["a2a"])))
    shape = cm.exec_shape(cpu_check.EXEC_SHAPE, 1)
    rng = np.random.default_rng(0)
    e, k = cpu_check.EXEC_SHAPE["num_experts"], cpu_check.EXEC_SHAPE["top_k"]
    experts = np.argsort(-rng.random((40, e)), axis=1)[:, :k].astype(np.int16)[:, None, :]
    pred = cm.predict(hw, shape, contiguous_placement(1, e, 2), [np.arange(20), np.arange(20, 40)], experts)
    assert set(pred) == {"gating", "dispatch", "experts", "combine", "dispatch_sim"}
    assert all(v.shape == (1,) and v[0] > 0 for v in pred.values())
    assert pred["dispatch"][0] > pred["dispatch_sim"][0]  # three calls cost more than one


def test_summarise_reports_errors_and_the_order_check():
    cells = [{"ranks": 2, "phase_kind": "prefill", "system": "ep", **{f"{p}_measured_s": 1.0 for p in cm.PHASES},
              **{f"{p}_predicted_s": 1.1 for p in cm.PHASES}, "dispatch_sim_predicted_s": 0.5}]
    orders = [{"resolved": True, "agrees": True}, {"resolved": False, "agrees": None}]
    s = cm.summarise(cells, orders)
    assert s["experts"]["all"]["median_abs_error"] == pytest.approx(0.1) and s["experts"]["meets_target"]
    assert s["dispatch_sim"]["all"]["median_signed_error"] == pytest.approx(-0.5)
    assert s["order"] == {"comparisons": 2, "resolved": 1, "agree": 1}
