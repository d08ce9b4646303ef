"""A job's outputs survive kills and reruns (issue 18): staged outputs published with metrics.json last, an atomic
plan folder, job folders that tell traces apart, strict metrics.json, and entry points that refuse early."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from test_run import compose, synthetic_trace_dir

from repro.errors import ConfigError, ReproError

ROOT = Path(__file__).resolve().parents[1]


class Killed(BaseException):
    """A simulated kill: a BaseException, so no `except Exception` in the code under test swallows it."""


def job_config(trace: Path, tmp_path: Path, *overrides) -> OmegaConf:
    return OmegaConf.create(compose("logger=none", f"trace={trace}", "parallel.tokens_per_step=256",
                                    f"cache_dir={tmp_path / 'cache'}", *overrides))


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under folder (relative path -> bytes), staging and temporaries left out."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)}


def kill_after(monkeypatch, calls: int) -> list:
    """Make os.replace and os.rename (every rename publishing uses) raise Killed once `calls` of them have run."""
    done = []
    for name in ("replace", "rename"):
        real = getattr(os, name)

        def renamed(src, dst, real=real):
            if len(done) >= calls:
                raise Killed(f"killed before rename {len(done)}")
            done.append((src, dst))
            return real(src, dst)

        monkeypatch.setattr(os, name, renamed)
    return done


def test_a_kill_at_every_publishing_step_leaves_the_old_job_or_no_finished_job(tmp_path, monkeypatch):
    from repro.figures.jobs import find_job_files
    from repro.run import run_job

    trace = synthetic_trace_dir(tmp_path / "trace")
    old_cfg, new_cfg = job_config(trace, tmp_path, "system=ep"), job_config(trace, tmp_path, "system=eplb")
    reference = tmp_path / "reference"  # what a clean run of the new config publishes
    run_job(new_cfg, reference)
    expected_new = snapshot(reference)
    run_job(old_cfg, tmp_path / "count")  # count the renames of a rerun over an old job, as below
    with monkeypatch.context() as m:
        done = kill_after(m, 10**9)
        run_job(new_cfg, tmp_path / "count", replace_other=True)
    renames = len(done)
    # staged, then published (timings.json is written once, beside metrics.json)
    assert renames >= 2 * len({name.split("/")[0] for name in expected_new} - {"timings.json"})

    old_job = tmp_path / "runs" / "job"
    run_job(old_cfg, old_job)
    (old_job / "sim_per_rate.csv").write_text("rate\n1\n")  # an output the new config does not write
    old = snapshot(old_job)
    shutil.copytree(old_job, tmp_path / "old_copy")
    unfinished = 0
    for calls in range(renames + 1):
        with monkeypatch.context() as m:
            kill_after(m, calls)
            try:
                run_job(new_cfg, old_job, replace_other=True)
                finished = True
            except Killed:
                finished = False
        now = snapshot(old_job)
        if finished:
            assert calls == renames and now.keys() == expected_new.keys()
        elif "metrics.json" in now:  # the old job, whole and unmixed
            assert now == old, f"kill after {calls} renames left a finished-looking mix"
        else:
            unfinished += 1
            assert find_job_files(tmp_path / "runs") == []  # the report does not count it
        if not finished:  # back to the old complete job for the next kill point
            shutil.rmtree(old_job)
            shutil.copytree(tmp_path / "old_copy", old_job)
    assert unfinished > 0  # some kill points fell inside publishing (else this test checked nothing)
    run_job(new_cfg, old_job, replace_other=True)  # the rerun with the changed config completes
    published = snapshot(old_job)
    assert published.keys() == expected_new.keys() and "sim_per_rate.csv" not in published
    for name in published.keys() - {"timings.json"}:  # wall-clock seconds; metrics.json is the same bytes
        assert published[name] == expected_new[name], name
    assert json.loads(published["metrics.json"])["config"]["system"]["name"] == "eplb"
    assert not list(old_job.glob(".staging-*"))


def test_a_hard_kill_mid_publish_leaves_no_finished_job_and_the_rerun_cleans_up(tmp_path):
    """SIGKILL-like (os._exit, no cleanup runs) half-way through publishing: no metrics.json, a staging folder
    the report ignores; the next run removes that dead process's staging folder and finishes."""
    from repro.figures.jobs import find_job_files
    from repro.run import run_job

    trace = synthetic_trace_dir(tmp_path / "trace")
    job = tmp_path / "runs" / "job"
    run_job(job_config(trace, tmp_path, "system=ep"), job)
    script = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from test_run import compose
        from omegaconf import OmegaConf
        from repro.run import run_job
        real = os.replace
        def replace(src, dst):
            if str(src).endswith("/per_layer.csv") and ".staging-" in str(src):  # publishing, half-way
                os._exit(9)
            return real(src, dst)
        os.replace = replace
        run_job(OmegaConf.create(compose("logger=none", "trace={trace}", "parallel.tokens_per_step=256",
                                         "cache_dir={tmp_path / 'cache'}", "system=eplb")), Path({str(job)!r}),
                replace_other=True)
    """)
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 9, res.stderr[-2000:]
    assert not (job / "metrics.json").exists()
    (staging,) = job.glob(".staging-*")
    assert (staging / "per_layer.csv").exists() and find_job_files(tmp_path / "runs") == []
    run_job(job_config(trace, tmp_path, "system=eplb"), job)
    assert not staging.exists() and find_job_files(tmp_path / "runs") == [job / "metrics.json"]


def test_staging_folders_of_live_processes_are_kept(tmp_path):
    import socket

    from repro.run import remove_dead_staging

    live = tmp_path / f".staging-{socket.gethostname()}-{os.getpid()}-abc"
    other_host = tmp_path / ".staging-elsewhere-1-abc"
    for folder in (live, other_host):
        folder.mkdir()
    remove_dead_staging(tmp_path)
    assert live.exists() and other_host.exists()


def test_plan_save_is_atomic_and_refuses_a_folder_that_is_not_a_plan(tmp_path, monkeypatch):
    from repro.parallel import ParallelConfig
    from repro.systems import make_system
    from repro.traces import read_trace

    trace = read_trace(synthetic_trace_dir(tmp_path / "trace"))
    parallel = ParallelConfig(devices=4, attention="tp", tokens_per_step=256)
    plans = [make_system(name).fit(trace, parallel, np.random.default_rng(0)) for name in ("ep", "semmoe")]
    plans[0].save(tmp_path / "plan")
    first = snapshot(tmp_path / "plan")
    with monkeypatch.context() as m:
        kill_after(m, 0)
        with pytest.raises(Killed):
            plans[1].save(tmp_path / "plan")
    assert snapshot(tmp_path / "plan") == first and sorted(p.name for p in tmp_path.iterdir()) == ["plan", "trace"]
    plans[1].save(tmp_path / "plan")
    assert "semmoe.json" in snapshot(tmp_path / "plan") and not list(tmp_path.glob(".plan*"))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep")
    with pytest.raises(ConfigError, match="holds no saved plan"):
        plans[0].save(tmp_path / "notes")
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep"


def test_traces_with_the_same_folder_name_get_different_job_folders(tmp_path):
    from repro.jobdir import job_dirname

    a, b = tmp_path / "a" / "good", tmp_path / "b" / "good"
    names = {job_dirname("system=ep", str(path), None) for path in (a, b)}
    assert len(names) == 2 and all(re.fullmatch(r"trace=good-[0-9a-f]{8},system=ep", n) for n in names)
    # a relative path names the same folder as its absolute form; profile_trace is labelled the same way
    assert job_dirname("", "a/good", None) == job_dirname("", str(Path.cwd() / "a" / "good"), None)
    assert job_dirname("", str(a), str(b)).split(",")[1] == f"profile_trace={job_dirname('', str(b), None)[6:]}"


def test_exec_experiment_resolves_its_run_dirs(tmp_path):
    """The exec experiment's Hydra run dir and sweep subdir resolve with the runner's job_dirname, and two traces
    named alike land in different folders."""
    script = textwrap.dedent(f"""
        import repro.run
        from hydra import compose, initialize_config_dir
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf
        with initialize_config_dir(config_dir={str(ROOT / 'conf')!r}, version_base="1.3"):
            for trace in ("/a/good", "/b/good"):
                cfg = compose("config", overrides=["experiment=exec", "logger=none", "trace=" + trace],
                              return_hydra_config=True)
                HydraConfig.instance().set_config(cfg)
                print(cfg.hydra.run.dir, cfg.hydra.sweep.subdir)
    """)
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.split("\n")[:2]
    dirs = [line.split() for line in lines]
    assert all(run == f"runs/exec/{sub}" and sub.startswith("trace=good-") for run, sub in dirs)
    assert dirs[0] != dirs[1]


def test_torchrun_with_another_world_size_is_refused_before_any_rendezvous(tmp_path):
    """The README's command under torchrun's environment with WORLD_SIZE=2 for a 4-device plan: one sentence, at
    once (no rank waits for a peer that will never come), and no job written."""
    env = dict(os.environ, WANDB_MODE="disabled", REPRO_CACHE=str(tmp_path / "cache"), RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    res = subprocess.run([sys.executable, "-m", "repro.run", "experiment=exec", "logger=none"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "torchrun started WORLD_SIZE=2 ranks but the plan places experts on parallel.devices=4" in res.stderr
    assert "Traceback" not in res.stderr
    assert not list(tmp_path.rglob("metrics.json"))


@pytest.mark.parametrize(
    "override, field",
    [
        ("hardware.gpu.hbm_gbps=0", "hbm_gbps"),
        ("hardware.gpu.hbm_gbps=-5", "hbm_gbps"),
        ("hardware.nodes=abc", "nodes"),
        ("hardware=h100_2x8_ib hardware.a2a.nccl.dispatch.rdma_gbps=0", "a2a.nccl.dispatch.rdma_gbps"),
    ],
)
def test_hardware_bandwidths_that_would_give_infinite_seconds_are_refused(override, field):
    """Refused where the job's config is read (make_job), naming the field, in one sentence."""
    from repro.run import make_job

    with pytest.raises(ConfigError) as refused:
        make_job(compose("logger=none", *override.split()))
    message = str(refused.value)
    assert field in message and override.split("=")[-1] in message and "\n" not in message


def test_simulator_refuses_zero_rdma_bandwidth_across_nodes():
    from repro.sim.hardware import load_hardware

    profile = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "hardware" / "h100_2x8_ib.yaml"), resolve=True)
    profile["a2a"]["deepep_normal"]["combine"]["rdma_gbps"] = 0
    with pytest.raises(ConfigError, match=re.escape("a2a.deepep_normal.combine.rdma_gbps is 0")):
        load_hardware(profile)


def test_a_non_finite_metric_is_one_sentence_and_leaves_the_old_job(tmp_path):
    from repro.run import metrics_text, publish_job

    with pytest.raises(ReproError, match=r"non-finite number inf at summary\.a2a_seconds_est;"):
        metrics_text({"lar": 0.5, "a2a_seconds_est": float("inf")}, {"seed": 0})
    with pytest.raises(ReproError, match=r"nan at summary\.per_rate\[1\]\.x"):
        metrics_text({"per_rate": [{"x": 1.0}, {"x": np.float32("nan")}]}, {})
    assert json.loads(metrics_text({"lar": np.float64(0.5), "n": np.int64(3)}, {}))["summary"] == {"lar": 0.5, "n": 3}
    job, staging = tmp_path / "job", tmp_path / "job" / ".staging-x"
    staging.mkdir(parents=True)
    (job / "metrics.json").write_text("old")
    (staging / "per_layer.csv").write_text("new")
    with pytest.raises(ReproError):
        publish_job(staging, job, {"lar": float("-inf")}, {})
    assert (job / "metrics.json").read_text() == "old" and not (job / "per_layer.csv").exists()


def test_a_long_sweep_gets_short_distinct_job_folders():
    from repro.jobdir import MAX_NAME_BYTES, job_dirname

    overrides = ",".join(f"sim.option_{i}=value_{i}" for i in range(20))
    a, b = job_dirname(overrides + ",system=ep", "t", None), job_dirname(overrides + ",system=moetuner", "t", None)
    assert a != b and max(len(a.encode()), len(b.encode())) <= MAX_NAME_BYTES
    assert a.startswith("trace=t-") and a.split(",")[-1].startswith("digest=") and "sim.option_0=value_0" in a
    assert job_dirname("system=ep", None, None) == "system=ep"  # short names are Hydra's string unchanged
