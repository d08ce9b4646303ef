"""End to end through the Hydra app: the smoke experiment, resume, and config errors at the CLI boundary."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_app(*overrides, cache: Path, out: Path):
    env = dict(os.environ, WANDB_MODE="disabled", REPRO_CACHE=str(cache))
    return subprocess.run(
        [sys.executable, "-m", "repro.run", "logger=none", f"hydra.run.dir={out}", *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.slow
def test_smoke_writes_metrics_then_resumes(tmp_path, cache):
    out = tmp_path / "job"
    first = run_app("experiment=smoke", "parallel.attention=tp", cache=cache, out=out)
    assert first.returncode == 0, first.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    s = metrics["summary"]
    assert 0.0 < s["lar"] <= 1.0
    assert s["dispatch_bytes"] == s["combine_bytes"] > 0
    assert metrics["config"]["parallel"]["attention"] == "tp"
    for name in ("per_layer.csv", "traffic.npy", "expert_load.npy", "config.yaml", "activation_map.npz"):
        assert (out / name).exists(), name
    stamp = (out / "metrics.json").stat().st_mtime_ns
    second = run_app("experiment=smoke", "parallel.attention=tp", cache=cache, out=out)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "skipping" in second.stdout + second.stderr
    assert (out / "metrics.json").stat().st_mtime_ns == stamp


@pytest.mark.parametrize(
    "override, message",
    [
        ("parallel.devcies=4", "devcies"),  # Hydra strict mode names the typo
        ("system=nope", "nope"),
        ("workload=nope", "nope"),
    ],
)
def test_config_errors_are_one_clear_message(tmp_path, cache, override, message):
    res = run_app("experiment=smoke", override, cache=cache, out=tmp_path / "job")
    assert res.returncode != 0
    assert message in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "job" / "metrics.json").exists()


@pytest.mark.slow
def test_ep_degree_must_divide_experts(tmp_path, cache):
    res = run_app("experiment=smoke", "parallel.devices=3", cache=cache, out=tmp_path / "job")
    assert res.returncode == 2
    assert "does not divide" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "job" / "metrics.json").exists()
