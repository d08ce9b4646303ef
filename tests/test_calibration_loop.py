"""Issue 16 items 4-6: a GPU's measured file feeds the simulator, gpu_check writes it, gpu_all.sh runs it all.

The measured file (conf/hardware/measured/<name>.yaml, bench.gpu_check's output) is written here by hand with
known tables; the simulator's expert time, kernel floor and all-to-all time must then follow those tables
exactly. gpu_all.sh is rehearsed with --dry-run (a subset of its steps, one forced to time out).
"""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import repro.sim.hardware as hardware_module
from bench.a2a_probe import a2a_summary, measure_a2a
from bench.gpu_check import GENERATED_BY, gpu_profile_name, write_measured_profile
from repro.errors import ConfigError
from repro.sim.costs import CostModel, phase_seconds
from repro.sim.hardware import interpolate, load_hardware
from repro.sim.shapes import ModelShape, RoutingMap

ROOT = Path(__file__).resolve().parents[1]
H200 = yaml.safe_load((ROOT / "conf" / "hardware" / "h200.yaml").read_text())
SHAPE = ModelShape.from_config(yaml.safe_load((ROOT / "conf" / "sim" / "shape" / "deepseek_v2_lite.yaml").read_text()))
EXPERT_TABLE = [[1, 20e-6], [64, 40e-6], [1024, 300e-6]]  # rows of one expert -> seconds


def write_measured(directory: Path, measured: dict, ranks: int = 1, name: str = "h200") -> None:
    document = {"name": name, "generated_by": GENERATED_BY, "ranks": ranks, "notes": {}, "measured": measured}
    (directory / f"{name}.yaml").write_text(yaml.safe_dump(document))


def expert_seconds(hw, slot_tokens_KLP: np.ndarray) -> np.ndarray:
    mapping = RoutingMap("strict", SHAPE.num_moe_layers, SHAPE.num_experts, SHAPE.top_k, 1.0,
                         SHAPE.moe_intermediate_size, "test")
    return CostModel(SHAPE, hw, mapping, 8, "dp", "nccl").experts(slot_tokens_KLP)


def test_measured_file_sets_expert_time_and_kernel_floor(tmp_path, monkeypatch):
    write_measured(tmp_path, {"expert_gemm": {SHAPE.name: EXPERT_TABLE}, "kernel_floor_us": 30.0})
    monkeypatch.setattr(hardware_module, "MEASURED_DIR", tmp_path)  # what load_hardware reads by default
    calibrated = load_hardware(H200)
    formula = load_hardware(H200, measured_dir=tmp_path / "none")
    assert calibrated.calibrated_parts == ("kernel_floor", f"expert_gemm.{SHAPE.name}")
    assert formula.calibrated_parts == () and formula.kernel_floor == pytest.approx(3e-6)
    assert calibrated.kernel_floor == pytest.approx(30e-6)
    # 8 ranks x 8 slots: empty slots, one row (below the floor), inside the table, past its end (extrapolated)
    slots = np.zeros((1, 1, 64), dtype=np.int64)
    slots[0, 0, 8] = 1
    slots[0, 0, 16:18] = [64, 544]
    slots[0, 0, 24] = 2048
    got = expert_seconds(calibrated, slots)[0, 0]
    # 1 row -> 20 us, lifted to the 30 us floor; 64 + 544 rows -> 40 + 170 us; 2048 rows -> 300 + 1024 * 260/960 us
    want = np.array([0.0, 30e-6, 210e-6, 300e-6 + 1024 * 260e-6 / 960, 0, 0, 0, 0])
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert not np.allclose(expert_seconds(formula, slots)[0, 0], want)


def test_a2a_tables_merge_only_at_the_measured_rank_count(tmp_path):
    table = [[0, 10e-6], [1 << 20, 50e-6], [1 << 24, 400e-6]]  # busiest rank's remote bytes -> seconds
    write_measured(tmp_path, {"a2a": {"nccl": {"dispatch": table, "combine": table}}}, ranks=8)
    eight = load_hardware(H200, measured_dir=tmp_path)
    assert eight.calibrated_parts == ("a2a.nccl.dispatch", "a2a.nccl.combine")
    np.testing.assert_array_equal(eight.backends["nccl"].dispatch.measured, np.array(table))
    # a 2-device profile of the same name: an 8-GPU curve does not price it
    two = load_hardware(dict(H200, devices_per_node=2), measured_dir=tmp_path)
    assert two.backends["nccl"].dispatch.measured is None and two.calibrated_parts == ()
    # the simulator's dispatch time is the table at the busiest rank's bytes: rank 0 sends 3 copies of 4 KiB
    from repro.sim.costs import LevelLoad

    send = np.zeros((1, 1, 8))
    send[0, 0, 0] = 3
    load = LevelLoad((send, send * 0, send * 0, send * 0), ())
    seconds = phase_seconds(load, eight.backends["nccl"].dispatch, 4096)
    assert seconds[0, 0] == pytest.approx(float(interpolate(np.array(table), np.array(3 * 4096.0))))


def test_profile_entries_win_over_the_file(tmp_path):
    write_measured(tmp_path, {"expert_gemm": {SHAPE.name: EXPERT_TABLE, "other": EXPERT_TABLE}, "kernel_floor_us": 9})
    own = [[1, 1e-3], [2, 2e-3]]
    hw = load_hardware(dict(H200, measured={"expert_gemm": {SHAPE.name: own}}), measured_dir=tmp_path)
    np.testing.assert_array_equal(hw.measured_expert_gemm[SHAPE.name], np.array(own))
    np.testing.assert_array_equal(hw.measured_expert_gemm["other"], np.array(EXPERT_TABLE))
    assert hw.kernel_floor == pytest.approx(9e-6)


@pytest.mark.parametrize("text, match", [
    ("measured: [1, 2]\n", "must hold a `measured:` mapping"),
    ("measured: {expert_gemm: [\n", "is not readable YAML"),
    ("measured: {kernel_floor_us: fast}\n", "measured.kernel_floor_us must be a number"),
    ("measured: {expert_gemm: {x: [[1, 2]]}}\n", "measured.expert_gemm.x must be a list of at least two"),
])
def test_a_bad_measured_file_is_one_sentence(tmp_path, text, match):
    (tmp_path / "h200.yaml").write_text(text)
    with pytest.raises(ConfigError, match=match) as error:
        load_hardware(H200, measured_dir=tmp_path)
    assert "\n" not in str(error.value)


def test_gpu_check_writes_what_the_simulator_reads_and_keeps_foreign_files(tmp_path):
    document = {"name": "h200", "generated_by": GENERATED_BY, "ranks": 1, "notes": {"device": "NVIDIA H200"},
                "measured": {"expert_gemm": {SHAPE.name: EXPERT_TABLE}, "kernel_floor_us": 4.5}}
    path = tmp_path / "h200.yaml"
    write_measured_profile(path, document)
    write_measured_profile(path, document)  # its own file is replaced
    hw = load_hardware(H200, measured_dir=tmp_path)
    assert hw.kernel_floor == pytest.approx(4.5e-6) and SHAPE.name in hw.measured_expert_gemm
    foreign = tmp_path / "a100.yaml"
    foreign.write_text("# hand-written\nmeasured: {}\n")
    with pytest.raises(ConfigError, match="was not written by bench.gpu_check"):
        write_measured_profile(foreign, dict(document, name="a100"))
    assert foreign.read_text() == "# hand-written\nmeasured: {}\n"


@pytest.mark.parametrize("device, name", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA H800", "h800"), ("NVIDIA GeForce RTX 4090", "geforce_rtx_4090"),
])
def test_gpu_profile_name(device, name):
    assert gpu_profile_name(device) == name


def test_a2a_measurement_on_gloo_gives_a_table_the_simulator_takes():
    table = measure_a2a(2, cuda=False, peer_bytes=(64, 4096), repeats=2)
    assert [row[0] for row in table] == [64, 4096]  # (ranks - 1) x bytes per peer
    assert all(row[1] > 0 for row in table)
    assert set(a2a_summary(table)) == {"fixed_us", "bandwidth_gbps"}
    hardware_module._table(table, "a2a")  # the form load_hardware accepts


def gpu_all(out: Path, steps: str, *extra: str, **env) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHON=sys.executable, GPU_ALL_STEPS=steps, **env)
    environment.pop("TRITON_INTERPRET", None)
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu_all.sh"), "--dry-run", "--out", str(out), *extra],
                          capture_output=True, text=True, env=environment, timeout=400)


@pytest.mark.slow  # ~25 s alone, minutes when the shared machine is loaded; the full dry run is `make gpu-all-dry`
def test_gpu_all_dry_run_keeps_results_after_a_failed_step(tmp_path):
    out = tmp_path / "results"
    done = gpu_all(out, "bench calibrate", "--tar", str(tmp_path / "all.tar.gz"), GPU_ALL_T_BENCH="1")
    assert done.returncode == 1, done.stdout + done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    steps = {s["step"]: s for s in manifest["steps"]}
    assert manifest["dry_run"] and not manifest["ok"] and list(steps) == ["bench", "calibrate"]
    assert steps["bench"]["status"] == "timed_out" and (out / "bench.log").exists()
    assert steps["calibrate"]["status"] == "ok", (out / "calibrate.log").read_text()
    assert "gpu_check/measured/cpu_dry_run.yaml" in steps["calibrate"]["files"]
    # the rehearsal file is one the simulator reads (a 2-rank gloo table, so into a 2-device profile)
    hw = load_hardware(dict(H200, name="cpu_dry_run", devices_per_node=2), measured_dir=out / "gpu_check" / "measured")
    assert set(hw.calibrated_parts) == {"kernel_floor", "a2a.nccl.dispatch", "a2a.nccl.combine"} | {
        f"expert_gemm.{name}" for name in ("deepseek_v2_lite", "qwen3_30b_a3b", "mixtral_8x7b")}
    assert not (ROOT / "conf" / "hardware" / "measured" / "cpu_dry_run.yaml").exists()
    with tarfile.open(tmp_path / "all.tar.gz") as archive:
        assert "results/manifest.json" in archive.getnames()


def test_gpu_all_refuses_bad_arguments_and_a_used_folder(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_all.sh"), "--bogus"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown argument '--bogus'" in done.stderr
    used = tmp_path / "used"
    used.mkdir()
    (used / "mine.txt").write_text("keep")
    done = gpu_all(used, "setup")
    assert done.returncode == 2 and "exists and is not empty" in done.stderr
    assert [p.name for p in used.iterdir()] == ["mine.txt"]
    done = gpu_all(tmp_path / "new", "setup nonsense")
    assert done.returncode == 2 and "unknown step 'nonsense'" in done.stderr and not (tmp_path / "new").exists()
    if not torch.cuda.is_available():  # without --dry-run it needs a GPU, and says so before writing anything
        done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_all.sh"), "--out", str(tmp_path / "gpu")],
                              capture_output=True, text=True, env=dict(os.environ, PYTHON=sys.executable))
        assert done.returncode == 2 and "sees no CUDA device" in done.stderr and not (tmp_path / "gpu").exists()


def test_bench_kernels_says_it_measured_references_only_on_a_cpu(monkeypatch):
    import bench.bench_kernels as bench_kernels

    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine the bench times the compiled kernels")
    monkeypatch.setattr(bench_kernels, "collect_cases", lambda *a, **k: ([], {}))  # the statement, not the timings
    result = bench_kernels.run(quick=True)
    assert result["measured"] == bench_kernels.REFERENCES_ONLY and result["triton"] == bench_kernels.NO_CUDA
    assert "baselines" not in result


def test_tuned_tiles_merge_into_the_file_the_grouped_gemm_reads(tmp_path):
    from bench.gpu_check import TUNE_ROWS_PER_EXPERT, tune_tiles, write_tuned
    from repro.kernels.grouped_gemm import CANDIDATE_TILES, load_tuned, tuned_key

    path = tmp_path / "NVIDIA_H200.json"
    path.write_text(json.dumps({"E=1,H=16,I=16,dtype=bfloat16": {"16": [16, 32, 32, 1, 4, 3]}}))
    # on the CPU the timings are the torch reference's (any tile wins); the format and the merge are the point
    table = tune_tiles({"tiny": (32, 16, 2, 1)}, torch.float32, "cpu")
    write_tuned(path, table)
    tuned = load_tuned(path)
    assert set(tuned) == {"E=1,H=16,I=16,dtype=bfloat16", tuned_key(2, 32, 16, torch.float32)}
    assert set(tuned[tuned_key(2, 32, 16, torch.float32)]) == set(TUNE_ROWS_PER_EXPERT)
    assert all(tile in CANDIDATE_TILES for tile in tuned[tuned_key(2, 32, 16, torch.float32)].values())
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid"):
        write_tuned(path, table)
    assert path.read_text() == "{not json"
