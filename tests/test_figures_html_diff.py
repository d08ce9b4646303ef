"""Shareable reports: the self-contained HTML (repro.figures.html, --html) and the run-set diff (repro.figures.diff).

Fake runs dirs hold metrics.json files in the layout repro.run writes (summary + config) with hand-picked numbers,
so every expected ratio below is worked out by hand.
"""

import base64
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from repro.errors import ReproError
from repro.figures.__main__ import main as figures_main
from repro.figures.diff import diff_runs, load_results
from repro.figures.diff import main as diff_main
from repro.figures.html import markdown_to_html, write_html

PNG = base64.b64decode(  # a valid 1x1 PNG
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==")
SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"><rect width="4" height="4"/></svg>'
EXTERNAL = re.compile(r'(?:src|href)\s*=\s*"(?:https?:)?//', re.I)
DATA_SRC = re.compile(r'<img src="data:([^;"]+);base64,([^"]+)"')


def write_job(root: Path, experiment: str, system: str, devices: int, *, lar: float = 0.5,
              a2a_bytes: int = 2**30, per_rate: pd.DataFrame | None = None, **summary) -> Path:
    """A finished job as repro.run leaves it: metrics.json (summary + config), traffic.npy, optional sim_per_rate.csv."""
    job = root / experiment / f"parallel.devices={devices},system={system}"
    job.mkdir(parents=True)
    summary = {"lar": lar, "a2a_bytes": a2a_bytes, "dispatch_bytes": a2a_bytes // 2, "combine_bytes": a2a_bytes // 2,
               "dispatch_bytes_inter_node": 0, "token_imbalance_max_mean": 1.1, "a2a_seconds_est": 0.02,
               "system": system, "kind": "system", "bound_constraint": None, "evaluate_split": "evaluate", **summary}
    config = {"name": experiment, "model": {"name": "tiny_mixtral"}, "workload": {"name": "mmlu"},
              "system": {"name": system, "params": {}}, "parallel": {"devices": devices, "attention": "dp"}, "seed": 0}
    (job / "metrics.json").write_text(json.dumps({"summary": summary, "config": config}))
    np.save(job / "traffic.npy", np.arange(2 * devices * devices, dtype=np.int64).reshape(2, devices, devices))
    if per_rate is not None:
        per_rate.to_csv(job / "sim_per_rate.csv", index=False)
    return job


def fake_runs(root: Path) -> Path:
    write_job(root, "paper_dp", "ep", 2, lar=0.5)
    write_job(root, "paper_dp", "semmoe", 2, lar=0.6, a2a_bytes=2**29)
    write_job(root, "paper_dp", "semmoe", 4, lar=0.3)
    return root


# ---- HTML ----------------------------------------------------------------------------------------------------


def test_html_inlines_local_images_renders_tables_and_loads_nothing_remote(tmp_path):
    (tmp_path / "sub dir").mkdir()
    (tmp_path / "fig.png").write_bytes(PNG)
    (tmp_path / "sub dir" / "plot.svg").write_bytes(SVG)
    report = tmp_path / "REPORT.md"
    report.write_text("# My report\n\n| system | lar |\n|---|---|\n| ep | 0.5000 |\n\n![a png](fig.png)\n\n"
                      "![an svg](<sub dir/plot.svg>)\n\n<img src=\"http://example.com/x.png\">\n")
    page = markdown_to_html(report)
    assert "<title>My report</title>" in page
    assert re.search(r"<table>\s*<thead>\s*<tr>\s*<th>system</th>", page)
    assert "<td>0.5000</td>" in page
    images = DATA_SRC.findall(page)
    assert [(mime, base64.b64decode(data)) for mime, data in images] == [("image/png", PNG), ("image/svg+xml", SVG)]
    assert not EXTERNAL.search(page)  # the raw <img> tag is escaped text, not an element
    assert "&lt;img src=" in page


def test_write_html_missing_or_remote_image_writes_nothing(tmp_path):
    report = tmp_path / "REPORT.md"
    report.write_text("# R\n\n![gone](figs/missing.png)\n")
    with pytest.raises(ReproError, match="does not exist"):
        write_html(report, tmp_path / "REPORT.html")
    report.write_text("# R\n\n![remote](https://example.com/a.png)\n")
    with pytest.raises(ReproError, match="remote image"):
        write_html(report, tmp_path / "REPORT.html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["REPORT.md"]  # no partial or temporary file


def test_figures_cli_html_writes_report_html_beside_report_md(tmp_path, capsys):
    out = tmp_path / "figures"
    assert figures_main(["--runs", str(fake_runs(tmp_path / "runs")), "--out", str(out), "--html"]) == 0
    assert capsys.readouterr().out.split() == [str(out / "REPORT.md"), str(out / "REPORT.html")]
    md, page = (out / "REPORT.md").read_text(), (out / "REPORT.html").read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    images = DATA_SRC.findall(page)
    assert len(links) == len(images) >= 3  # lar_vs_ep, bytes_vs_ep, traffic heatmap
    assert [base64.b64decode(data) for _, data in images] == [(out / link).read_bytes() for link in links]
    assert "<table>" in page and not EXTERNAL.search(page)


# ---- diff ----------------------------------------------------------------------------------------------------


def test_diff_runs_reports_changed_metrics_with_ratio_and_delta_and_unmatched_jobs(tmp_path):
    write_job(tmp_path / "a", "paper_dp", "ep", 2, lar=0.5)
    write_job(tmp_path / "a", "paper_dp", "semmoe", 2, lar=0.3, a2a_bytes=1000)
    write_job(tmp_path / "a", "paper_dp", "eplb", 2)
    write_job(tmp_path / "b", "paper_dp", "ep", 2, lar=0.5)
    # LAR 0.3 -> 0.36 (x1.2, +0.06); bytes 1000 -> 1005 (+0.5 %, under the 1 % threshold)
    write_job(tmp_path / "b", "paper_dp", "semmoe", 2, lar=0.36, a2a_bytes=1005)
    write_job(tmp_path / "b", "paper_dp", "moetuner", 2)
    diff = diff_runs(load_results(tmp_path / "a"), load_results(tmp_path / "b"), threshold=0.01)

    changed = diff[diff["status"] == "changed"]
    assert changed[["system", "devices", "metric"]].values.tolist() == [["semmoe", 2, "lar"]]
    row = changed.iloc[0]
    assert (row.a, row.b) == (0.3, 0.36)
    assert row.ratio == pytest.approx(1.2) and row.delta == pytest.approx(0.06)
    assert diff.loc[diff["status"] == "only in A", "system"].tolist() == ["eplb"]
    assert diff.loc[diff["status"] == "only in B", "system"].tolist() == ["moetuner"]

    finer = diff_runs(load_results(tmp_path / "a"), load_results(tmp_path / "b"), threshold=0.001)
    bytes_rows = finer[finer["metric"] == "a2a_bytes"]
    assert bytes_rows[["a", "b"]].values.tolist() == [[1000, 1005]]
    assert bytes_rows["ratio"].iloc[0] == pytest.approx(1.005)


def test_diff_runs_compares_simulator_latency_per_rate_and_one_sided_metrics(tmp_path):
    rates = pd.DataFrame({"rate": [1.0, 8.0], "ttft_mean_s": [0.10, 0.20], "tpot_mean_s": [0.01, 0.02],
                          "e2e_mean_s": [1.0, 2.0], "e2e_p99_s": [1.5, 3.0]})
    slower = rates.assign(ttft_mean_s=[0.10, 0.25])  # only the 8 req/s TTFT moves: x1.25
    write_job(tmp_path / "a", "serve_dp", "semmoe", 8, per_rate=rates, throughput_under_ttft_slo_rps=100.0)
    write_job(tmp_path / "b", "serve_dp", "semmoe", 8, per_rate=slower)  # throughput metric gone in B
    diff = diff_runs(load_results(tmp_path / "a"), load_results(tmp_path / "b"))
    assert diff["metric"].tolist() == ["throughput_under_ttft_slo_rps", "ttft_mean_s@8rps"]
    assert diff["b"].isna().tolist() == [True, False]
    assert diff["ratio"].iloc[1] == pytest.approx(1.25)


def test_diff_runs_reads_a_steady_state_table_as_seed_0s_grid_and_compares_the_new_columns(tmp_path):
    # one row per run: seed 0's reference and grid runs, a bisection probe, seed 1's runs; only seed 0's grid counts
    rows = [(1.0, 0, "reference", 0.10), (4.0, 0, "grid", 0.20), (3.0, 0, "bisect", 9.0), (1.0, 1, "grid", 9.0),
            (4.0, 1, "bisect", 9.0)]
    table = pd.DataFrame([{"rate": r, "seed": s, "role": role, "ttft_mean_s": t} for r, s, role, t in rows])
    slower = table.assign(ttft_mean_s=[0.10, 0.30, 5.0, 5.0, 5.0])  # seed 0's 4 req/s grid run x1.5; the rest ignored
    write_job(tmp_path / "a", "serve_dp", "semmoe", 8, per_rate=table, a2a_share_decode_lightest=0.30)
    write_job(tmp_path / "b", "serve_dp", "semmoe", 8, per_rate=slower, a2a_share_decode_lightest=0.40)
    diff = diff_runs(load_results(tmp_path / "a"), load_results(tmp_path / "b"))
    assert diff["metric"].tolist() == ["a2a_share_decode_lightest", "ttft_mean_s@4rps"]
    assert diff["ratio"].tolist() == pytest.approx([4 / 3, 1.5])


def test_diff_runs_rejects_two_jobs_with_one_key(tmp_path):
    write_job(tmp_path / "a" / "copy1", "paper_dp", "ep", 2)
    write_job(tmp_path / "a" / "copy2", "paper_dp", "ep", 2)
    write_job(tmp_path / "b", "paper_dp", "ep", 2)
    with pytest.raises(ReproError, match="set A holds 2 jobs with the same key"):
        diff_runs(load_results(tmp_path / "a"), load_results(tmp_path / "b"))


def test_diff_cli_prints_and_writes_a_self_contained_diff(tmp_path, capsys):
    write_job(tmp_path / "a", "paper_dp", "semmoe", 4, lar=0.25)
    write_job(tmp_path / "b", "paper_dp", "semmoe", 4, lar=0.2)
    write_job(tmp_path / "b", "paper_dp", "ep", 4)
    out = tmp_path / "out"
    assert diff_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"semmoe\s+dp\s+4\s+lar\s+0\.2500\s+0\.2000\s+-0\.0500", printed)
    assert "only in B (1):\n  ep / dp / D=4" in printed
    assert sorted(p.name for p in out.iterdir()) == ["diff.csv", "diff.html", "diff.md", "diff_changes.png"]
    assert pd.read_csv(out / "diff.csv")["status"].tolist() == ["changed", "only in B"]
    page = (out / "diff.html").read_text()
    assert "<table>" in page and not EXTERNAL.search(page)
    assert [base64.b64decode(d) for _, d in DATA_SRC.findall(page)] == [(out / "diff_changes.png").read_bytes()]


@pytest.mark.parametrize("bad", ["missing", "empty"])
def test_diff_cli_bad_input_exits_2_with_one_sentence_and_writes_nothing(tmp_path, capsys, bad):
    write_job(tmp_path / "a", "paper_dp", "ep", 2)
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    assert diff_main([str(tmp_path / "a"), str(tmp_path / bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and str(tmp_path / bad) in err
    assert not out.exists()
