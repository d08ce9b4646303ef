"""repro.figures under faults: figures written atomically, corrupt jobs skipped, diffs refusing mismatched traces."""

import ast
import importlib.util
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from repro.errors import ReproError
from repro.figures.__main__ import main as figures_main
from repro.figures.diff import diff_runs, load_results
from repro.figures.diff import main as diff_main
from repro.figures.jobs import read_jobs
from repro.figures.render import save_png

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_save_writes_a_png_atomically_and_a_failed_save_leaves_nothing(tmp_path, monkeypatch):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    path = save_png(fig, tmp_path / "sub" / "fig.png")
    assert path.read_bytes().startswith(PNG_MAGIC)  # PNG although the temporary name ends in a random suffix
    before = path.read_bytes()

    fig, ax = plt.subplots()

    def killed_mid_write(target, **kwargs):
        with open(target, "wb") as f:
            f.write(PNG_MAGIC[:4])  # a partial file, then the writer dies
        raise KeyboardInterrupt

    monkeypatch.setattr(fig, "savefig", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        save_png(fig, path)
    assert path.read_bytes() == before  # the old complete figure stays
    assert [p.name for p in path.parent.iterdir()] == ["fig.png"]  # no temporary file left behind
    assert not plt.get_fignums()  # closed even on failure


# ---- corrupt jobs are skipped and listed; staging folders are not jobs ------------------------------------------


def write_job(root: Path, experiment: str, system: str, devices: int = 2, lar: float = 0.5,
              digests: dict | None = None) -> Path:
    """A finished job as repro.run leaves it (metrics.json + traffic.npy), with optional trace_digests."""
    job = root / experiment / f"parallel.devices={devices},system={system}"
    job.mkdir(parents=True)
    summary = {"lar": lar, "a2a_bytes": 2**20, "system": system, "kind": "system"}
    if digests is not None:
        summary["trace_digests"] = digests
    config = {"name": experiment, "model": {"name": "tiny_mixtral"}, "workload": {"name": "mmlu"},
              "system": {"name": system, "params": {}}, "parallel": {"devices": devices, "attention": "dp"}}
    np.save(job / "traffic.npy", np.ones((1, devices, devices)))
    (job / "metrics.json").write_text(json.dumps({"summary": summary, "config": config}))
    return job


def corrupt_jobs(root: Path) -> dict[str, str]:
    """Four broken jobs beside good ones: {job folder relative to root: a phrase its skip reason must contain}."""
    broken = {}
    job = write_job(root, "paper_dp", "eplb")
    (job / "metrics.json").write_text('{"summary": {"lar": 0.5')  # cut short by a kill (old, non-atomic writers)
    broken[str(job.relative_to(root))] = "not valid JSON"
    job = write_job(root, "paper_dp", "moetuner")
    (job / "metrics.json").write_bytes(b"\xff\xfe\x00garbage")
    broken[str(job.relative_to(root))] = "not UTF-8"
    job = write_job(root, "paper_dp", "semmoe_hottest")
    (job / "metrics.json").write_text(json.dumps({"summary": {"lar": 1.0}, "config": {"name": "paper_dp"}}))
    broken[str(job.relative_to(root))] = "lacks the key 'parallel'"
    job = root / "paper_dp" / "unreadable"
    (job / "metrics.json").mkdir(parents=True)  # unreadable as a file (chmod does not stop root)
    broken[str(job.relative_to(root))] = "cannot be read"
    return broken


def test_report_skips_each_corrupt_job_once_with_a_warning_and_a_report_line(tmp_path, caplog, capsys):
    runs = tmp_path / "runs"
    write_job(runs, "paper_dp", "ep", lar=0.5)
    write_job(runs, "paper_dp", "semmoe", lar=0.6)
    broken = corrupt_jobs(runs)
    # a job being published (repro.run's staging folder) and a model cache entry are not jobs, not even skipped ones
    staging = write_job(runs / "paper_dp" / "parallel.devices=2,system=ep" / ".staging-1234", "x", "ep")
    (staging / "metrics.json").write_text("{ half written")
    write_job(runs / "cache", "x", "ep")
    caplog.set_level(logging.WARNING, logger="repro.figures")
    out = tmp_path / "figures"
    assert figures_main(["--runs", str(runs), "--out", str(out)]) == 0
    report = (out / "REPORT.md").read_text()
    assert "(2 finished jobs)" in report and "**4 job(s) skipped**" in report
    for folder, reason in broken.items():
        assert report.count(f"- `{folder}`: ") == 1 and reason in report, (folder, reason)
    warned = [r.getMessage() for r in caplog.records if r.name == "repro.figures"]
    assert len(warned) == 4 and all(w.startswith("skipped the job at ") for w in warned)
    assert ".staging" not in report and "cache" not in report.split("## Experiment")[0]
    summary, _, skipped = read_jobs(runs)
    assert sorted(summary["system"]) == ["ep", "semmoe"] and len(skipped) == 4


def test_report_renders_an_experiment_whose_jobs_measure_no_lar(tmp_path):
    """make reproduce's short drift run (drift.serving.window_costs=false) leaves jobs without LAR or all-to-all
    bytes; their experiment lists them and the drift report's policy table instead of ending the report with a
    KeyError."""
    runs = tmp_path / "runs"
    write_job(runs, "paper_dp", "ep", lar=0.5)
    for seed in (0, 1):
        job = write_job(runs / "drift_short", f"seed={seed}", "semmoe")
        record = json.loads((job / "metrics.json").read_text())
        record["config"]["name"] = "drift_short"
        record["summary"] = {"system": "semmoe", "kind": "system", "headline_policy": "semmoe_drift", "replacements": 0,
                             "policies": {"ep": {"kind": "system", "a2a_s": 7.5 + seed, "replacements": 0}}}
        record["config"].update(seed=seed, drift={"threshold": 0.1})
        (job / "metrics.json").write_text(json.dumps(record))
    out = tmp_path / "figures"
    assert figures_main(["--runs", str(runs), "--out", str(out)]) == 0
    section = (out / "REPORT.md").read_text().split("## Experiment `drift_short`")[1].split("## Experiment")[0]
    assert "2 jobs" in section and "| semmoe |" in section and "lar_vs_ep" not in section
    assert "| stationary | 0 | ep | 7.5 |" in section and "| stationary | 1 | ep | 8.5 |" in section


def test_only_corrupt_jobs_is_one_sentence_not_a_traceback(tmp_path, capsys):
    runs = tmp_path / "runs"
    corrupt_jobs(runs)
    out = tmp_path / "figures"
    assert figures_main(["--runs", str(runs), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no readable finished runs") and "4 skipped as unreadable" in err
    assert "\n" not in err and not out.exists()


def test_diff_skips_corrupt_jobs_and_says_so(tmp_path, capsys):
    write_job(tmp_path / "a", "paper_dp", "ep", lar=0.5)
    write_job(tmp_path / "b", "paper_dp", "ep", lar=0.6)
    job = write_job(tmp_path / "b", "paper_dp", "semmoe")
    (job / "metrics.json").write_text("not json")
    job = write_job(tmp_path / "b", "paper_dp", "eplb")
    (job / "sim_per_rate.csv").write_text('rate,ttft_mean_s\n1,"unterminated\n')
    out = tmp_path / "out"
    assert diff_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("warning: set B: skipped the job at ") == 2
    assert "not valid JSON" in printed and "sim_per_rate.csv cannot be read" in printed
    assert re.search(r"ep\s+dp\s+2\s+lar\s+0\.5000\s+0\.6000", printed)
    assert "only in B" not in printed  # the skipped jobs are not reported as new jobs
    md = (out / "diff.md").read_text()
    assert md.count("**Warning:** set B: skipped the job at") == 2


# ---- figures.diff: trace digests and threshold -------------------------------------------------------------------

SAME = {"profile": "p" * 64, "evaluated": "e" * 64}
OTHER = {"profile": "p" * 64, "evaluated": "f" * 64}


def test_diff_refuses_jobs_measured_on_different_traces(tmp_path, capsys):
    write_job(tmp_path / "a", "paper_dp", "ep", lar=0.5, digests=SAME)
    write_job(tmp_path / "a", "paper_dp", "semmoe", lar=0.6, digests=SAME)
    write_job(tmp_path / "b", "paper_dp", "ep", lar=0.5, digests=SAME)
    write_job(tmp_path / "b", "paper_dp", "semmoe", lar=0.7, digests=OTHER)
    out = tmp_path / "out"
    assert diff_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: 1 of the 2 matched jobs were measured on different traces") and "\n" not in err
    assert "evaluated eeeeeeeeeeee in A vs ffffffffffff in B" in err and "--allow-different-traces" in err
    assert not out.exists()
    with pytest.raises(ReproError, match="different traces"):
        diff_runs(load_results(tmp_path / "a"), load_results(tmp_path / "b"))

    assert diff_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out), "--allow-different-traces"]) == 0
    printed = capsys.readouterr().out
    assert "warning: 1 matched job(s) ran on different traces" in printed
    assert re.search(r"semmoe\s+dp\s+2\s+lar\s+0\.6000\s+0\.7000\s+\+0\.1000\s+DIFFERENT traces", printed)
    assert "| DIFFERENT traces |" in (out / "diff.md").read_text()
    diff = pd.read_csv(out / "diff.csv")
    assert diff[["system", "traces"]].values.tolist() == [["semmoe", "different"]]


def test_diff_same_or_unrecorded_digests_are_compared_unlabelled(tmp_path, capsys):
    write_job(tmp_path / "a", "paper_dp", "ep", lar=0.5, digests=SAME)
    write_job(tmp_path / "a", "paper_dp", "semmoe", lar=0.6)  # written before digests were recorded
    write_job(tmp_path / "b", "paper_dp", "ep", lar=0.4, digests=SAME)
    write_job(tmp_path / "b", "paper_dp", "semmoe", lar=0.7, digests=OTHER)
    diff = diff_runs(load_results(tmp_path / "a"), load_results(tmp_path / "b"))
    assert diff[["system", "traces"]].values.tolist() == [["ep", "same"], ["semmoe", "unknown"]]
    assert diff_main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "DIFFERENT" not in capsys.readouterr().out


@pytest.mark.parametrize("threshold", ["-0.01", "nan"])
def test_diff_refuses_a_negative_threshold(tmp_path, capsys, threshold):
    write_job(tmp_path / "a", "paper_dp", "ep")
    write_job(tmp_path / "b", "paper_dp", "ep")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:  # refused while parsing (repro.cli.non_negative)
        diff_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out), "--threshold", threshold])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "\n" not in err
    assert err.startswith(f"error: argument --threshold: must be a finite number >= 0, got '{threshold}'")
    assert not out.exists()
    with pytest.raises(ReproError, match="threshold"):
        diff_runs(load_results(tmp_path / "a"), load_results(tmp_path / "b"), threshold=-0.5)


# ---- no import circle ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["repro.figures.paper", "repro.figures.report", "repro.figures.diff",
                                    "repro.figures.replication"])
def test_each_figures_module_imports_first_in_a_fresh_interpreter(module):
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_paper_and_report_do_not_import_each_other_in_a_circle():
    def imported(name: str) -> set[str]:
        tree = ast.parse(Path(importlib.util.find_spec(name).origin).read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    assert "repro.figures.report" not in imported("repro.figures.paper")
    for leaf in ("repro.figures.render", "repro.figures.jobs", "repro.figures.palette"):
        if importlib.util.find_spec(leaf) is not None:
            assert not {m for m in imported(leaf) if m.startswith("repro.figures")}, leaf
