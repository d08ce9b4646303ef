"""W&B as the field uses it (issue 18): a run per job from its start (before training), training and capture
progress, tags / job_type / group, the plan as an artifact, failed jobs marked failed, nothing with logger=none.

A fake `wandb` module records what a job asks of W&B, so these tests need no network and no W&B files."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from test_run import compose, synthetic_trace_dir

from repro import tracking
from repro.errors import ReproError
from repro.run import run_job
from repro.workloads.request import Request

ROOT = Path(__file__).resolve().parents[1]
# a micro tiny model: its few training steps take well under a second
MICRO = ["model.num_layers=1", "model.hidden_size=16", "model.intermediate_size=16", "model.num_experts=4",
         "model.top_k=2", "model.num_attention_heads=2", "model.vocab_top=32", "model.seq_len=16",
         "model.batch_size=2", "model.max_steps=5", "model.capture_batch_tokens=256"]
VOCAB = 200


class FakeWandb(types.ModuleType):
    """What a job asks of W&B, in order: calls holds ("init", kwargs), ("log", dict), ("artifact", Artifact),
    ("finish", exit_code, whether metrics.json was published by then)."""

    def __init__(self, fail_on: str | None = None):
        super().__init__("wandb")
        self.calls: list[tuple] = []
        self.fail_on = fail_on
        fake = self

        class Run:
            def __init__(self, kwargs):
                self.kwargs, self.tags, self.summary = kwargs, tuple(kwargs.get("tags") or ()), {}

            def define_metric(self, name, step_metric=None):
                fake.calls.append(("define_metric", name, step_metric))

            def log(self, data):
                fake.check("log")
                fake.calls.append(("log", data))

            def log_artifact(self, artifact):
                fake.check("log_artifact")
                fake.calls.append(("artifact", artifact))

            def finish(self, exit_code=None):
                published = (Path(self.kwargs["dir"]) / "metrics.json").exists()
                fake.calls.append(("finish", exit_code, published))

        class Artifact:
            def __init__(self, name, type, description=None, metadata=None):
                self.name, self.type, self.metadata, self.files = name, type, metadata, []

            def add_dir(self, path):  # what the folder holds now: the staging folder moves on after logging
                self.files += sorted(p.relative_to(path).as_posix() for p in Path(path).rglob("*") if p.is_file())

        self.Run, self.Artifact = Run, Artifact
        self.Settings = lambda **kwargs: kwargs
        self.Table = lambda dataframe: ("table", dataframe.shape)
        self.Image = lambda path: ("image", Path(path).name)

    def check(self, call: str) -> None:
        if self.fail_on == call:
            raise RuntimeError(f"fake W&B failure in {call}")

    def init(self, **kwargs):
        self.check("init")
        self.calls.append(("init", kwargs))
        self.run = self.Run(kwargs)
        return self.run

    def named(self, kind: str) -> list[tuple]:
        return [call for call in self.calls if call[0] == kind]

    def logged(self, prefix: str) -> list[dict]:
        return [data for kind, data in self.named("log") if any(key.startswith(prefix) for key in data)]


@pytest.fixture
def fake_wandb(monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")  # conftest disables W&B for every other test
    return fake


def unit_workload(name, *, num_requests=None, tokenizer="mixtral", seed=0, **_):
    """A small workload of random-token requests standing in for MMLU (no dataset files, no tokenizer)."""
    rng = np.random.default_rng(seed)
    requests = [Request(id=f"r{i}", dataset="unit", label="", token_ids=rng.integers(0, VOCAB, 40).astype(np.int32))
                for i in range(30)]
    return types.SimpleNamespace(requests=requests, name="unit", tokenizer=tokenizer, vocab_size=VOCAB)


def tiny_job(tmp_path, monkeypatch, *overrides):
    """(config, out_dir) of a job that trains the micro tiny model on unit_workload."""
    monkeypatch.setattr("repro.workloads.load_workload", unit_workload)
    config = compose("logger=wandb", "name=trk", "parallel.devices=2", "parallel.tokens_per_step=64",
                     f"cache_dir={tmp_path / 'cache'}", *MICRO, *overrides)
    return OmegaConf.create(config), tmp_path / "runs" / "trk" / "parallel.devices=2"


def trace_job(tmp_path, *overrides):
    trace = synthetic_trace_dir(tmp_path / "trace")
    logger = [] if any(o.startswith("logger=") for o in overrides) else ["logger=wandb"]
    config = compose(*logger, "name=trk", f"trace={trace}", "parallel.tokens_per_step=256", *overrides)
    return OmegaConf.create(config), tmp_path / "runs" / "trk" / "job"


def test_the_run_starts_before_training_and_logs_the_curve_tags_and_plan(tmp_path, monkeypatch, fake_wandb):
    cfg, out = tiny_job(tmp_path, monkeypatch)
    summary = run_job(cfg, out)

    kinds = [call[0] for call in fake_wandb.calls]
    assert kinds[0] == "init" and kinds[-1] == "finish"
    first_train = next(i for i, call in enumerate(fake_wandb.calls) if call[0] == "log" and "train/step" in call[1])
    assert first_train > kinds.index("init")
    init = fake_wandb.named("init")[0][1]
    assert (init["job_type"], init["group"], init["name"], init["dir"]) == ("evaluate", "trk", out.name, str(out))
    assert {"experiment=trk", "system=ep", "attention=dp", "ep=2", "model=tiny_mixtral", "routing=tiny"} <= set(init["tags"])
    assert init["config"]["parallel"]["devices"] == 2
    # the trace's own model and source are added once it is routed
    assert {"routing=tiny_model", "dataset=unit"} <= set(fake_wandb.run.tags)

    # the loss curve: every step's lm / aux loss and throughput, and the held-out loss before and after
    steps = [d for d in fake_wandb.logged("train/") if "train/lm_loss" in d]
    assert [d["train/step"] for d in steps] == [1, 2, 3, 4, 5]
    assert all(np.isfinite(d["train/lm_loss"]) and d["train/aux_loss"] > 0 and d["train/tokens_per_s"] > 0
               for d in steps)
    evals = [d for d in fake_wandb.logged("train/") if "train/eval_loss" in d]
    assert [d["train/step"] for d in evals] == [0, 5]
    # capture progress: requests and tokens routed so far, growing to the whole workload
    capture = fake_wandb.logged("capture/")
    assert capture and [d["capture/step"] for d in capture] == list(range(1, len(capture) + 1))
    assert capture[-1]["capture/requests"] == 30 and capture[-1]["capture/tokens"] == 30 * 40
    assert all(d["capture/tokens_per_s"] > 0 and d["capture/requests_per_s"] > 0 for d in capture)
    assert ("define_metric", "train/*", "train/step") in fake_wandb.calls

    (artifact,) = [call[1] for call in fake_wandb.named("artifact")]
    assert artifact.type == "plan" and artifact.name == "plan-trk-parallel.devices_2"
    assert "placement.json" in artifact.files
    assert sorted(artifact.files) == sorted(p.name for p in (out / "plan").iterdir())
    assert fake_wandb.run.summary["lar"] == summary["lar"]
    assert fake_wandb.run.summary["routing/steps"] == 5  # the training stats of the routing model
    assert any("per_layer" in d for d in fake_wandb.logged("per_layer"))
    # finished (exit code 0) only once metrics.json was published
    assert fake_wandb.named("finish") == [("finish", 0, True)]


def test_a_failing_job_marks_its_run_failed_and_a_wandb_failure_publishes_nothing(tmp_path, monkeypatch, fake_wandb):
    cfg, out = trace_job(tmp_path)

    def broken(*args, **kwargs):
        raise ReproError("the system could not be fitted")

    monkeypatch.setattr("repro.run.fit_and_evaluate", broken)
    with pytest.raises(ReproError, match="could not be fitted"):
        run_job(cfg, out)
    assert fake_wandb.named("finish") == [("finish", 1, False)]
    monkeypatch.undo()

    # W&B itself failing (here: logging the plan) fails the job with one sentence before anything is published
    failing = FakeWandb(fail_on="log_artifact")
    monkeypatch.setitem(sys.modules, "wandb", failing)
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(ReproError, match=r"W&B could not log the job's results .*nothing was published.*logger=none"):
        run_job(cfg, out)
    assert failing.named("finish") == [("finish", 1, False)]
    assert not (out / "metrics.json").exists() and not (out / "plan").exists()


def test_a_wandb_start_failure_is_one_sentence_before_any_routing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(fail_on="init"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg, out = tiny_job(tmp_path, monkeypatch)
    routed = []
    monkeypatch.setattr("repro.routing.route_workload", lambda *a, **k: routed.append(1))
    with pytest.raises(ReproError, match="W&B could not start a run"):
        run_job(cfg, out)
    assert not routed and not (out / "metrics.json").exists()


def test_a_skipped_resume_starts_no_run_and_a_sim_job_is_a_serve_sim_run(tmp_path, fake_wandb):
    cfg, out = trace_job(tmp_path)
    run_job(cfg, out)
    fake_wandb.calls.clear()
    assert run_job(cfg, out) is None  # finished with this config and trace: skipped
    assert fake_wandb.calls == []

    config = OmegaConf.to_container(cfg)
    assert tracking.job_type_of({**config, "sim": {"rates": [1]}}) == "serve-sim"
    assert tracking.job_type_of({**config, "exec": {"mode": "trace"}}) == "exec"


@pytest.mark.parametrize("off", ["logger=none", "WANDB_MODE=disabled", "logger.mode=disabled"])
def test_tracking_off_imports_nothing(tmp_path, monkeypatch, off):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` now raises ImportError
    monkeypatch.setenv("WANDB_MODE", "disabled" if off == "WANDB_MODE=disabled" else "offline")
    cfg, out = trace_job(tmp_path, *([] if off.startswith("WANDB") else [off]))
    assert run_job(cfg, out)["lar"] > 0
    assert not (out / "wandb").exists()
    run = tracking.JobRun(OmegaConf.to_container(cfg), out)
    assert run.on_progress is None  # producers then skip their progress bookkeeping


def test_importing_the_job_code_does_not_import_wandb():
    code = "import sys, repro.run, repro.tracking; print('wandb' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "False"


def test_producers_without_progress_still_route_and_the_tiny_model_reports_through_route_workload(tmp_path):
    from repro.routing import route_workload

    requests = unit_workload("unit").requests
    events: list[dict] = []
    model = {"name": "tiny_micro", "kind": "tiny", "tokenizer": "mixtral", "num_layers": 1, "hidden_size": 16,
             "intermediate_size": 16, "num_experts": 4, "top_k": 2, "num_attention_heads": 2, "vocab_top": 32,
             "seq_len": 16, "batch_size": 2, "max_steps": 3, "capture_batch_tokens": 400}
    args = dict(cache_dir=tmp_path, seed=0, dataset="unit", tokenizer="mixtral", vocab_size=VOCAB)
    route_workload(model, requests, requests[:6], **args, on_progress=events.append)
    phases = [e["phase"] for e in events]
    assert phases.count("train") == 3 + 2 and phases.count("capture") == 3  # 400 tokens a batch: 10 requests
    assert events[-1]["tokens"] == 30 * 40
    # cached: no training, only capture progress
    events.clear()
    route_workload(model, requests, requests[:6], **args, on_progress=events.append)
    assert {e["phase"] for e in events} == {"capture"}
    # the synthetic producer takes no on_progress; route_workload does not pass it one
    synthetic = compose("model=synthetic_mixtral")["model"]
    assert route_workload(synthetic, requests, requests[:6], **args, on_progress=events.append).num_tokens == 1200


def test_report_figures_are_logged_as_images_and_an_artifact(tmp_path, monkeypatch, fake_wandb):
    figures = tmp_path / "figures"
    (figures / "smoke").mkdir(parents=True)
    (figures / "smoke" / "lar_per_layer.png").write_bytes(b"png")
    (figures / "lar_vs_ep.png").write_bytes(b"png")
    (figures / "REPORT.md").write_text("# report")
    assert tracking.log_report_figures(figures, tmp_path / "runs")
    init = fake_wandb.named("init")[0][1]
    assert (init["job_type"], init["dir"]) == ("report", str(tmp_path / "runs"))
    (images,) = [data for kind, data in fake_wandb.named("log")]
    assert images == {"lar_vs_ep": ("image", "lar_vs_ep.png"), "smoke/lar_per_layer": ("image", "lar_per_layer.png")}
    (artifact,) = [call[1] for call in fake_wandb.named("artifact")]
    assert artifact.type == "report" and "REPORT.md" in artifact.files
    assert fake_wandb.named("finish") == [("finish", None, False)]

    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert tracking.log_report_figures(figures, tmp_path / "runs") is False


def test_artifact_names_are_valid_and_distinct():
    assert tracking.artifact_name("plan", "smoke", "parallel.devices=2,system=ep") == "plan-smoke-parallel.devices_2_system_ep"
    long_a, long_b = ("plan", "x", "a" * 200 + "1"), ("plan", "x", "a" * 200 + "2")
    assert len(tracking.artifact_name(*long_a)) == tracking.MAX_ARTIFACT_NAME
    assert tracking.artifact_name(*long_a) != tracking.artifact_name(*long_b)
