"""Figures a reviewer accepts: one colour per system, bounds / hindsight dashed and labelled, axis labels with
units, LAR axes fixed to [0, 1], colour bars, no averaging across models, partial sweeps marked, the paper's value
drawn, and an HTML report with a table of contents and scrollable tables. Figures are captured before saving."""

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from repro.figures import paper, report
from repro.figures.html import markdown_to_html
from repro.figures.jobs import read_jobs
from repro.figures.palette import SYSTEM_COLORS, series_style, system_color


@pytest.fixture
def captured(monkeypatch):
    """{"folder/file name": matplotlib figure} of every figure the report and paper modules save (still written)."""
    figures = {}

    def keep(fig, path):
        figures[f"{Path(path).parent.name}/{Path(path).name}"] = fig
        return save(fig, path)

    save = report.save_png
    monkeypatch.setattr(report, "save_png", keep)
    monkeypatch.setattr(paper, "save_png", keep)
    return figures


def write_job(root: Path, experiment: str, job: str, system: str, devices: int, lar: float, *, kind: str = "system",
              model: str = "tiny_mixtral", layer_ids=(1, 2, 3), attention: str = "dp") -> Path:
    out = root / experiment / job
    out.mkdir(parents=True)
    config = {"name": experiment, "model": {"name": model, "kind": "tiny"}, "workload": {"name": "mmlu"},
              "system": {"name": system, "params": {}}, "parallel": {"devices": devices, "attention": attention}}
    summary = {"system": system, "kind": kind, "lar": lar, "a2a_bytes": 2**21, "dispatch_bytes": 2**20,
               "bound_constraint": "a ceiling" if kind == "bound" else None}
    np.save(out / "traffic.npy", np.ones((1, devices, devices)))
    layers = np.asarray(layer_ids)
    pd.DataFrame({"layer_id": layers, "lar": lar + 0.01 * np.arange(len(layers)),
                  "dispatch_bytes": 2.0**20 * np.ones(len(layers))}).to_csv(out / "per_layer.csv", index=False)
    (out / "metrics.json").write_text(json.dumps({"summary": summary, "config": config}))
    return out


def sweep(root: Path) -> Path:
    for devices in (2, 4):
        for system, lar, kind in (("ep", 1 / devices, "system"), ("semmoe", 1.5 / devices, "system"),
                                  ("dp_bound", 2 / devices, "bound"), ("fit_assign", 1.8 / devices, "hindsight")):
            write_job(root, "paper_dp", f"parallel.devices={devices},system={system}", system, devices, lar, kind=kind)
    # two routing sources with different layer counts, each at two lookbacks (one system)
    for model, layers in (("synthetic_mixtral", range(0, 4)), ("synthetic_deepseek_v2_lite", range(1, 7))):
        for lookback, lar in ((0, 0.4), (2, 0.5)):
            write_job(root, "routing_sources", f"model={model},system.params.lookback={lookback}", "semmoe", 4, lar,
                      model=model, layer_ids=list(layers), attention="tp")
    return root


def lines_of(ax) -> dict[str, object]:
    return {line.get_label(): line for line in ax.get_lines()}


def test_palette_is_one_colour_per_system_and_a_line_style_per_kind():
    assert len(set(SYSTEM_COLORS.values()) - {SYSTEM_COLORS["dp_bound"]}) == len(SYSTEM_COLORS) - 2  # bounds share
    assert system_color("a_new_system") == system_color("a_new_system")  # stable for unknown systems
    assert series_style("dp_bound", "bound")["linestyle"] == "--" and series_style("dp_bound", "bound")["label"] == "dp_bound (bound)"
    assert series_style("fit_assign", "hindsight")["label"] == "fit_assign (hindsight)"
    assert series_style("semmoe", float("nan"))["linestyle"] == "-"
    assert series_style("semmoe", variant=1)["color"] != series_style("semmoe")["color"]


def test_report_figures_use_the_palette_dash_bounds_fix_lar_axes_and_label_units(tmp_path, captured):
    report.write_report(sweep(tmp_path / "runs"), tmp_path / "figs")
    fig = captured["paper_dp/lar_vs_ep.png"]
    ax = fig.axes[0]
    lines = lines_of(ax)
    assert set(lines) >= {"ep", "semmoe", "dp_bound (bound)", "fit_assign (hindsight)", "1/D (uniform placement)"}
    assert lines["semmoe"].get_color() == SYSTEM_COLORS["semmoe"] and lines["semmoe"].get_linestyle() == "-"
    assert lines["dp_bound (bound)"].get_linestyle() == "--" and lines["fit_assign (hindsight)"].get_linestyle() == "-."
    assert ax.get_ylim() == (0.0, 1.0)
    assert ax.get_ylabel() == "local activation rate (LAR)" and ax.get_xlabel() == "EP degree D (devices)"
    # the same system has the same colour in another figure of another kind
    per_layer = captured["paper_dp/lar_per_layer.png"]
    assert {a.get_ylim() for a in per_layer.axes if a.get_lines()} == {(0.0, 1.0)}
    assert lines_of(per_layer.axes[0])["semmoe"].get_color() == SYSTEM_COLORS["semmoe"]
    assert captured["paper_dp/bytes_vs_ep.png"].axes[0].get_ylabel() == "all-to-all bytes, dispatch + combine (MiB)"
    np.testing.assert_allclose(lines_of(captured["paper_dp/bytes_vs_ep.png"].axes[0])["ep"].get_ydata(), [2, 2])  # 2 MiB
    # heatmap: a colour bar with its unit
    heat = captured["paper_dp/traffic_heatmap.png"]
    assert len(heat.axes) == 2 and heat.axes[1].get_ylabel() == "dispatch MiB, summed over MoE layers"


def test_per_layer_plot_never_averages_models_with_different_layer_counts(tmp_path, captured):
    runs = sweep(tmp_path / "runs")
    report.write_report(runs, tmp_path / "figs")
    axes = [a for a in captured["routing_sources/lar_per_layer.png"].axes if a.get_lines()]
    by_title = {a.get_title(): a for a in axes}
    assert set(by_title) == {"synthetic_deepseek_v2_lite, mmlu, Attention-TP, EP 4",
                             "synthetic_mixtral, mmlu, Attention-TP, EP 4"}
    for title, layer_ids in (("synthetic_mixtral", [0, 1, 2, 3]), ("synthetic_deepseek_v2_lite", [1, 2, 3, 4, 5, 6])):
        lines = lines_of(by_title[f"{title}, mmlu, Attention-TP, EP 4"])
        # one line per lookback, each the job's own per-layer values (0.4 + 0.01 i), not a mean over jobs
        assert set(lines) == {"semmoe [lookback=0]", "semmoe [lookback=2]"}
        for name, lar in (("semmoe [lookback=0]", 0.4), ("semmoe [lookback=2]", 0.5)):
            assert list(lines[name].get_xdata()) == layer_ids
            np.testing.assert_allclose(lines[name].get_ydata(), lar + 0.01 * np.arange(len(layer_ids)))
        assert lines["semmoe [lookback=0]"].get_marker() != lines["semmoe [lookback=2]"].get_marker()


def test_a_partial_sweep_is_marked_in_the_report_and_its_figures(tmp_path, captured):
    runs = sweep(tmp_path / "runs")
    # the multirun launched 3 EP degrees x 4 systems = 12 jobs; 8 finished, 1 more is corrupt
    (runs / "paper_dp" / "multirun.yaml").write_text(
        "hydra:\n  sweeper:\n    params:\n      system: ep,semmoe,dp_bound,fit_assign\n      parallel.devices: 2,4\n"
        "  overrides:\n    task:\n    - experiment=paper_dp\n    - parallel.devices=2,4,8\n")
    (runs / "paper_dp" / "parallel.devices=8,system=ep").mkdir()
    (runs / "paper_dp" / "parallel.devices=8,system=ep" / "metrics.json").write_text("{")
    (runs / "routing_sources" / "multirun.yaml").write_text(
        "hydra:\n  sweeper:\n    params:\n      model: synthetic_mixtral,synthetic_deepseek_v2_lite\n"
        "      system.params.lookback: 0,2\n")
    text = report.write_report(runs, tmp_path / "figs").read_text()
    note = "partial sweep: 8 of the 12 jobs its multirun launched have finished (1 skipped as unreadable)"
    assert f"- **paper_dp**: {note}." in text and "## Experiment `paper_dp` (partial sweep)" in text
    assert "## Experiment `routing_sources`\n" in text  # 4 of 4: complete, unmarked
    assert captured["paper_dp/lar_vs_ep.png"].get_suptitle() == f"paper_dp: {note}"
    assert captured["routing_sources/lar_per_layer.png"].get_suptitle() == ""


def test_paper_figures_draw_the_papers_value_and_use_the_palette(tmp_path, captured):
    from tests.test_figures_paper import fake_job, per_rate_table

    root = tmp_path / "runs"
    ep = per_rate_table([1.0, 2.0], [0.01, 0.02], [1.0, 2.0], [1.0, 2.0], 0.125)
    fake_job(root, "serve_dp", "ep", per_rate=ep)
    for system, lar in (("ep", 0.25), ("moetuner", 0.3), ("semmoe", 0.4)):
        fake_job(root, "paper_dp", system, devices=4, model={"name": "tiny_mixtral", "kind": "tiny"}, lar=lar)
    summary, _, _ = read_jobs(root)
    paper.fig1_breakdown(summary, tmp_path)
    share = captured["paper/fig1_moe_breakdown.png"].axes[1]  # the twin axis: all-to-all share in %
    assert lines_of(share)["paper: 59.2 % (R1)"].get_ydata()[0] == pytest.approx(59.2)
    assert share.get_ylim() == (0.0, 100.0)
    paper.fig5b_lar_imbalance(summary, tmp_path)
    lar_ax = captured["paper/fig5b_lar_imbalance.png"].axes[0]
    assert [p.get_facecolor()[:3] for p in lar_ax.patches] == [
        pytest.approx(tuple(int(SYSTEM_COLORS[s][i:i + 2], 16) / 255 for i in (1, 3, 5))) for s in ("ep", "moetuner", "semmoe")]
    marker = [c for c in lar_ax.collections if c.get_label().startswith("paper:")]
    assert len(marker) == 1 and marker[0].get_segments()[0][0][1] == pytest.approx(0.3 * 1.154)


def test_report_html_has_anchors_a_table_of_contents_scrollable_tables_and_no_outside_links(tmp_path):
    runs = sweep(tmp_path / "runs")
    md = report.write_report(runs, tmp_path / "figs")
    text = md.read_text()
    assert not re.findall(r"\]\((?:\.\./|/)", text) and "../shared" not in text
    page = markdown_to_html(md)
    toc = re.search(r'<nav class="toc">(.*?)</nav>', page, re.S).group(1)
    targets = re.findall(r'href="#([^"]+)"', toc)
    ids = re.findall(r'<h[23] id="([^"]+)"', page)
    assert targets == ids and len(set(ids)) == len(ids) >= 6
    assert "experiment-paper_dp" in ids and "experiment-routing_sources" in ids  # GitHub's slugs (heading_slug)
    assert page.index("</h1>") < page.index('<nav class="toc">') < page.index("<h2")
    assert page.count("<table>") == page.count('<div class="table-scroll"><table>') >= 2


