"""End to end through the Hydra app: the smoke experiment, resume, and config errors at the CLI boundary."""

import json
import os
import re
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
    for name in ("per_layer.csv", "traffic.npy", "expert_load.npy", "config.yaml", "activation_map.npz", "affinity_stats.csv"):
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
        ("+parallel.devics=4", "parallel has no key(s) ['devics']"),  # `+` bypasses strict mode
        ("+system.params.thta=0.3", "system 'ep' has no parameter(s) ['thta']"),
        ("system=semmoe parallel.attention=tp system.params.lookback=3", "lookback=3"),
        ("system=nope", "nope"),
        ("workload=nope", "nope"),
    ],
)
def test_config_errors_are_one_clear_message(tmp_path, cache, override, message):
    res = run_app("experiment=smoke", *override.split(), cache=cache, out=tmp_path / "job")
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


@pytest.mark.slow
def test_sweep_then_figures(tmp_path, cache):
    """A two-job multirun lands under one sweep dir; the report renders from runs/ alone."""
    env = dict(os.environ, WANDB_MODE="disabled", REPRO_CACHE=str(cache))
    res = subprocess.run(
        [sys.executable, "-m", "repro.run", "-m", "experiment=smoke", "logger=none", "parallel.devices=2,4",
         f"hydra.sweep.dir={tmp_path / 'runs' / 'smoke'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = sorted(p.parent.name for p in (tmp_path / "runs").rglob("metrics.json"))
    assert jobs == ["parallel.devices=2", "parallel.devices=4"]
    from repro.figures import load_runs, write_report

    summary, per_layer = load_runs(tmp_path / "runs")
    assert sorted(summary["devices"]) == [2, 4]
    assert len(per_layer) == 2 * summary["num_layers"].iloc[0]
    report = write_report(tmp_path / "runs", tmp_path / "figures")
    text = report.read_text()
    assert "paper Table 1" in text
    for png in ("lar_per_layer.png", "lar_vs_ep.png", "traffic_heatmap.png", "activation_heatmap.png"):
        assert png in text
        assert (tmp_path / "figures" / "smoke" / png).stat().st_size > 1000


def test_existing_trace_is_evaluated_as_is(tmp_path, cache):
    """`trace=DIR` skips workload and routing: any imported trace can be compared across systems."""
    synthetic_trace_dir(tmp_path / "t")
    lars = {}
    for system in ("ep", "semmoe"):
        out = tmp_path / system
        res = run_app(f"trace={tmp_path / 't'}", f"system={system}", "parallel.attention=tp", "parallel.tokens_per_step=256",
                      cache=cache, out=out)
        assert res.returncode == 0, res.stderr[-3000:]
        lars[system] = json.loads((out / "metrics.json").read_text())["summary"]["lar"]
    assert lars["semmoe"] > lars["ep"] + 0.1


def synthetic_trace_dir(path: Path) -> Path:
    import numpy as np

    from repro.traces import TraceMeta, make_trace, write_trace

    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 40, 60)
    n = int(lengths.sum())
    token_ids = rng.integers(0, 50, n)
    # token-determined routing: expert pair fixed per token id, so co-location can help
    experts = np.stack([token_ids % 16, (token_ids + 5) % 16], axis=1)[:, None, :].repeat(2, axis=1)
    meta = TraceMeta(model="imported", num_experts=16, top_k=2, layer_ids=(3, 4), vocab_size=50, dataset="x")
    return write_trace(make_trace(meta, np.concatenate([[0], np.cumsum(lengths)]), token_ids, experts), path)


@pytest.mark.sweep
@pytest.mark.parametrize(
    "experiment",
    # cross_dataset(_offline) routes two workloads and exec_model runs the tiny model that routed the workload, which trace=
    # cannot stand in for: test_honesty and tests/test_exec_model.py run them for real
    sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml") if p.stem not in ("cross_dataset", "cross_dataset_offline", "exec_model")),
)
def test_every_experiment_sweep_runs(tmp_path, cache, experiment):
    """Each experiment's whole sweep (every system x mode x degree it names) runs, on a small imported trace."""
    trace = synthetic_trace_dir(tmp_path / "trace")
    env = dict(os.environ, WANDB_MODE="disabled", REPRO_CACHE=str(cache))
    # the small trace's 16 experts x 2 layers are mapped onto the simulated model shape (stated in the results)
    # and each rate serves ~20 requests over 1 s (warm-up and cool-down shortened to fit): the sweep, not the numbers
    serve = ["sim.routing_map=trace", "sim.min_requests=20", "sim.rates=[1,4]", "sim.duration_s=1", "sim.warmup_s=0.2",
             "sim.cooldown_s=0.1", "sim.drain_s=1", "sim.seeds=2", "sim.max_duration_s=1"]
    # the multi-node sweeps' EP 32 (4 x 8) needs more than the trace's 16 experts: run their EP 16 (2 x 8) only
    nodes = ["parallel.devices=16"] if experiment.startswith("multinode") else []
    # a trace's requests keep their own lengths: paper_table2's input_len sweep applies to routed workloads only
    nodes += ["workload.input_len=null"] if experiment == "paper_table2" else []
    nodes += ["workload.input_len_lognormal=null"] if experiment == "serve_dp_heavy" else []
    # the small trace's 60 requests: a shorter profile and windows, so the stream holds several windows
    # and its serving pass with the trace's experts mapped onto the simulated shape, at a given small rate
    nodes += ["drift.profile_requests=20", "drift.window_requests=10", "drift.serving.sim.routing_map=trace",
              "drift.serving.rate_rps=200", "drift.serving.window_s=0.2"] if experiment == "drift" else []
    res = subprocess.run(
        [sys.executable, "-m", "repro.run", "-m", f"experiment={experiment}", "logger=none", f"trace={trace}",
         "parallel.tokens_per_step=256", f"hydra.sweep.dir={tmp_path / 'runs'}",
         *(serve if compose(f"experiment={experiment}").get("sim") else []), *nodes],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    launched = sum(int(n) for n in re.findall(r"Launching (\d+) jobs", res.stdout + res.stderr))
    assert launched >= 1
    assert len(list((tmp_path / "runs").rglob("metrics.json"))) == launched


def compose(*overrides) -> dict:
    """The resolved job config the app would see (no Hydra runtime node)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_container(hydra_compose("config", overrides=list(overrides)), resolve=True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trace=/x", "+workload@eval_workload=arena_hard"], "eval_workload"),
        (["trace=/x", "+workload@train_workload=mmlu"], "train_workload"),
        (["trace=/x", "profile_trace=/x"], "profile_trace is the evaluated trace itself"),
        (["profile_trace=/x"], "profile_trace needs trace="),
        (["evaluate_split=profile"], "evaluate_split must be one of"),
        (["experiment=exec_model", "trace=/x"], "exec.mode=model runs the tiny model"),
        (["experiment=exec_model", "model=synthetic_mixtral"], "exec.mode=model runs the tiny model"),
    ],
)
def test_trace_options_that_would_be_silently_ignored_are_errors(overrides, message):
    from repro.errors import ConfigError
    from repro.run import make_job

    with pytest.raises(ConfigError, match=re.escape(message)):
        make_job(compose("logger=none", *overrides))


def test_a_copy_of_the_evaluated_trace_is_not_a_profile(tmp_path):
    import shutil

    from repro.errors import ConfigError
    from repro.run import build_traces

    synthetic_trace_dir(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    with pytest.raises(ConfigError, match="same routing"):
        build_traces(compose(f"trace={tmp_path / 'a'}", f"profile_trace={tmp_path / 'b'}"))


def test_splits_of_a_trace_are_disjoint_and_validate_is_selectable(tmp_path):
    from repro.run import build_traces

    synthetic_trace_dir(tmp_path / "t")
    profile, evaluate = build_traces(compose(f"trace={tmp_path / 't'}"))
    _, validate = build_traces(compose(f"trace={tmp_path / 't'}", "evaluate_split=validate"))
    ids = [set(t.request_ids) for t in (profile, validate, evaluate)]
    assert [len(i) for i in ids] == [12, 6, 42]  # 20 / 10 / 70 % of 60 requests
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])


def test_job_folder_resume_and_warnings_follow_the_trace_content(tmp_path, cache):
    """An absolute trace path names the job folder by the trace's name; resume checks the routing, not only the
    config; a trace declaring more experts than it routes to says so in metrics."""
    import numpy as np

    from repro.traces import read_trace, with_meta, write_trace

    trace_dir = synthetic_trace_dir(tmp_path / "data" / "mine")
    write_trace(with_meta(read_trace(trace_dir, mmap=False), num_experts=32), trace_dir)  # ids use 0..15 only
    env = dict(os.environ, WANDB_MODE="disabled", REPRO_CACHE=str(cache))

    def run():
        return subprocess.run(
            [sys.executable, "-m", "repro.run", "logger=none", f"trace={trace_dir}", "system=ep", "name=edge"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,  # the default run dir, under tmp_path
        )

    assert run().returncode == 0
    (job,) = [p.parent for p in (tmp_path / "runs").rglob("metrics.json")]
    from repro.jobdir import trace_label

    assert job.relative_to(tmp_path / "runs").parts == ("edge", f"trace={trace_label(trace_dir)},system=ep")
    assert re.fullmatch(r"mine-[0-9a-f]{8}", trace_label(trace_dir))
    summary = json.loads((job / "metrics.json").read_text())["summary"]
    assert summary["unrouted_experts"] == 16 and "never routed" in summary["warnings"][0]
    assert summary["kind"] == "system" and summary["fit_split"] == "profile"
    assert "skipping" in (second := run()).stdout + second.stderr
    # same path and config, different routing: the job runs again
    t = read_trace(trace_dir, mmap=False)
    experts = np.array(t.experts)
    experts[:, :, 0], experts[:, :, 1] = t.experts[:, :, 1], t.experts[:, :, 0] + 16
    write_trace(t.__class__(**{**t.__dict__, "experts": experts.astype(np.int16)}), trace_dir)
    third = run()
    assert third.returncode == 0 and "skipping" not in third.stdout + third.stderr
    assert json.loads((job / "metrics.json").read_text())["summary"]["unrouted_experts"] == 0


def test_a_cached_trace_is_keyed_by_the_routing_code_version(tmp_path, monkeypatch):
    """A trace routed by older routing code (or an older tiny model) is never reused: the version is in the key."""
    import repro.routing
    from repro.run import routed_workload
    from repro.traces import trace_digest

    cfg = compose("model=synthetic_mixtral", "workload=mmlu", "workload.num_requests=20", f"cache_dir={tmp_path}")
    first, _ = routed_workload(cfg, cfg["workload"], tmp_path)
    again, _ = routed_workload(cfg, cfg["workload"], tmp_path)
    assert len(list((tmp_path / "traces").iterdir())) == 1 and trace_digest(again) == trace_digest(first)
    monkeypatch.setattr(repro.routing, "ROUTING_CACHE_VERSION", repro.routing.ROUTING_CACHE_VERSION + 1)
    routed_workload(cfg, cfg["workload"], tmp_path)
    assert len(list((tmp_path / "traces").iterdir())) == 2
