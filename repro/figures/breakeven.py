"""When does co-scheduling pay: the break-even map of Sem-MoE over vanilla EP (issue 15, beyond the paper).

Reads only what `python -m repro.sim.breakeven --out runs/breakeven` wrote (ratio_grid.csv, breakeven.csv,
breakeven.json) and the finished jobs under runs/ (their measured LAR, to place the suite's routing sources on the
map). One figure (per hardware x backend panel: the MoE-layer time ratio over tokens per rank x LAR gain with both
systems balanced, the break-even LAR gain when Sem-MoE's busiest rank carries more load, the measured gains as
lines) and one table (break-even LAR gain per setting).

    python -m repro.figures.breakeven --runs runs --out figures
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.patheffects as path_effects  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from repro import cli
from repro.errors import ReproError  # noqa: E402
from repro.figures.jobs import log, read_jobs  # noqa: E402
from repro.figures.render import markdown_table, save_png  # noqa: E402

RESULTS = "breakeven"  # the folder under runs/ that repro.sim.breakeven writes by default
MAIN_MODEL = "deepseek_v2_lite"
# the break-even lines, one per Sem-MoE imbalance (drawn over the viridis map: light and dark)
IMBALANCE_STYLES = ({"color": "white", "linestyle": "--", "marker": "o"},
                    {"color": "#d62728", "linestyle": "-", "marker": "s"},
                    {"color": "black", "linestyle": ":", "marker": "D"})
SOURCE_COLOR = "#e7298a"  # magenta: visible on every viridis shade
OUTLINE = [path_effects.Stroke(linewidth=2.6, foreground="#404040"), path_effects.Normal()]  # white lines on white


def read_results(results_dir: str | Path) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """(breakeven.json, ratio_grid.csv, breakeven.csv) of a repro.sim.breakeven output folder."""
    results_dir = Path(results_dir)
    try:
        meta = json.loads((results_dir / "breakeven.json").read_text(encoding="utf-8"))
        grid = pd.read_csv(results_dir / "ratio_grid.csv")
        table = pd.read_csv(results_dir / "breakeven.csv")
    except (OSError, ValueError) as error:
        raise ReproError(f"{results_dir} holds no readable break-even results ({error}); rerun `python -m "
                         f"repro.sim.breakeven --out {results_dir}`.") from None
    missing = sorted(({"model", "hardware", "backend", "devices", "tokens_per_rank", "imbalance_ep", "imbalance_semmoe",
                       "lar_gain", "ratio"} - set(grid)) | ({"break_even_gain", "ratio_at_lar_1"} - set(table)))
    if not isinstance(meta, dict) or missing or not len(grid):
        raise ReproError(f"{results_dir} holds incomplete break-even results (missing {missing or 'rows'}); rerun "
                         f"`python -m repro.sim.breakeven --out {results_dir}`.")
    return meta, grid, table


def routing_sources(summary: pd.DataFrame | None) -> pd.DataFrame:
    """One row per (experiment, trace model, attention, devices, Sem-MoE variant) with finished jobs of both a
    semmoe* system and ep on the same experiment, workload, model and deployment: their mean measured LAR and the
    gain. summary: read_jobs' rows (None or empty: no sources)."""
    columns = ["experiment", "model", "attention", "devices", "system", "lar_ep", "lar_semmoe", "lar_gain",
               "token_imbalance_semmoe", "expert_imbalance_semmoe", "jobs"]
    if summary is None or not len(summary) or "lar" not in summary:
        return pd.DataFrame(columns=columns)
    jobs = summary.assign(model=summary.get("model", summary.get("model_name")))
    jobs = jobs[jobs["kind"].fillna("system") == "system"]
    key = ["experiment", "model", "workload", "eval_workload", "attention", "devices"]
    ep = jobs[jobs["system"] == "ep"].groupby(key, dropna=False)["lar"].mean().rename("lar_ep")
    semmoe = jobs[jobs["system"].astype(str).str.startswith("semmoe")]
    if not len(ep) or not len(semmoe):
        return pd.DataFrame(columns=columns)
    paired = semmoe.join(ep, on=key, how="inner")
    for name in ("token_imbalance_max_mean", "expert_load_imbalance_max_mean"):
        if name not in paired:
            paired[name] = np.nan
    rows = paired.groupby(["experiment", "model", "attention", "devices", "system"], dropna=False).agg(
        lar_ep=("lar_ep", "mean"), lar_semmoe=("lar", "mean"),
        token_imbalance_semmoe=("token_imbalance_max_mean", "mean"),
        expert_imbalance_semmoe=("expert_load_imbalance_max_mean", "mean"), jobs=("lar", "size")).reset_index()
    rows["lar_gain"] = rows["lar_semmoe"] - rows["lar_ep"]
    return rows[columns].sort_values(["devices", "lar_gain"], ignore_index=True)


def _edges(values: np.ndarray) -> np.ndarray:
    mid = (values[1:] + values[:-1]) / 2
    return np.concatenate([[values[0] - (mid[0] - values[0])], mid, [values[-1] + (values[-1] - mid[-1])]])


def fig_breakeven(grid: pd.DataFrame, table: pd.DataFrame, sources: pd.DataFrame, path: Path,
                  model: str = MAIN_MODEL) -> Path:
    """The break-even map of `model`: one panel per hardware (rows) x all-to-all backend (columns)."""
    grid, table = grid[grid["model"] == model], table[table["model"] == model]
    if not len(grid):
        raise ReproError(f"the break-even results hold no model {model!r}; rerun repro.sim.breakeven with --models {model}.")
    hardware, backends = list(dict.fromkeys(grid["hardware"])), list(dict.fromkeys(grid["backend"]))
    balanced = grid[(grid["imbalance_semmoe"] == 1.0) & (grid["imbalance_ep"] == 1.0)]
    vmin = float(balanced["ratio"].min())
    skewed = sorted(f for f in table["imbalance_semmoe"].unique() if f != 1.0)
    fig, axes = plt.subplots(len(hardware), len(backends), figsize=(4.2 * len(backends), 3.3 * len(hardware)),
                             squeeze=False, constrained_layout=True)
    mesh = None
    for row, hw in enumerate(hardware):
        for col, backend in enumerate(backends):
            ax = axes[row, col]
            cell = balanced[(balanced["hardware"] == hw) & (balanced["backend"] == backend)]
            tokens = np.sort(cell["tokens_per_rank"].unique())
            gains = np.sort(cell["lar_gain"].unique())
            ratio = cell.pivot_table(index="lar_gain", columns="tokens_per_rank", values="ratio").loc[gains, tokens]
            x = np.arange(len(tokens), dtype=float)
            mesh = ax.pcolormesh(_edges(x), _edges(gains), ratio.to_numpy(), cmap="viridis", vmin=vmin, vmax=1.0,
                                 shading="flat")
            top = float(gains[-1])
            devices = int(cell["devices"].iloc[0])
            for i, (style, f) in enumerate(zip(IMBALANCE_STYLES, skewed, strict=False)):
                line = table[(table["hardware"] == hw) & (table["backend"] == backend)
                             & (table["imbalance_semmoe"] == f)].set_index("tokens_per_rank").loc[tokens]
                gain = line["break_even_gain"].to_numpy(dtype=float)
                ax.plot(x, gain, color=style["color"], linestyle=style["linestyle"], marker=style["marker"],
                        markersize=4, linewidth=1.4, label=f"break-even, Sem-MoE imbalance {f:g}",
                        markeredgecolor="black", markeredgewidth=0.5, path_effects=OUTLINE)
                never = np.isnan(gain)
                ax.plot(x[never], np.full(never.sum(), top * (0.95 - 0.07 * i)), linestyle="none", marker="X",
                        markersize=9, color=style["color"], markeredgecolor="black", markeredgewidth=0.6, zorder=5)
            for source in sources[sources["devices"] == devices].itertuples():
                ax.axhline(source.lar_gain, color=SOURCE_COLOR, linewidth=1.3, linestyle="-.")
                ax.annotate(f"{source.model} {source.attention} ({source.system})", (x[-1] + 0.45, source.lar_gain),
                            fontsize=6.5, color=SOURCE_COLOR, ha="right", va="bottom",
                            bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "alpha": 0.8, "linewidth": 0})
            ax.set_xticks(x, [str(t) for t in tokens])
            ax.grid(False)
            ax.set_ylim(0, top)
            ax.set_title(f"{hw} ({devices} GPUs), {backend}", fontsize=9)
            if row == len(hardware) - 1:
                ax.set_xlabel("tokens per rank per iteration")
            if col == 0:
                ax.set_ylabel("LAR gain over EP's 1/D")
    fig.colorbar(mesh, ax=axes, shrink=0.6, label="MoE-layer time, Sem-MoE / EP (both balanced)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    handles.append(plt.Line2D([], [], linestyle="none", marker="X", markersize=9, color="grey", markeredgecolor="black"))
    labels.append("never pays (not even at LAR = 1), in the line's colour")
    if len(sources):
        handles.append(plt.Line2D([], [], color=SOURCE_COLOR, linestyle="-."))
        labels.append("measured LAR gain of a routing source (semmoe vs ep)")
    fig.legend(handles, labels, loc="outside lower center", ncol=2, fontsize=8)
    note = ("" if len(sources) else " No finished semmoe/ep job pairs under runs/: curves only.")
    fig.suptitle(f"When does co-scheduling pay: {model}, one MoE layer on the busiest rank (Attention-DP).{note}\n"
                 "Colour: time ratio with both systems balanced; lines: the LAR gain above which Sem-MoE is faster "
                 "when its busiest rank carries more load. Not a throughput-under-SLO ratio.", fontsize=9)
    return save_png(fig, path)


def breakeven_table(table: pd.DataFrame) -> pd.DataFrame:
    """Break-even LAR gain per (model, hardware, backend, Sem-MoE imbalance) x tokens per rank, as text cells
    ('never' where not even LAR = 1 pays), in the order the results were computed. Balanced settings are left out:
    there any gain pays (break-even 0)."""
    skewed = table[table["imbalance_semmoe"] != table["imbalance_ep"]]
    cells = skewed.assign(cell=[("never" if np.isnan(g) else f"{g:.3f}") for g in skewed["break_even_gain"]],
                          imbalance_semmoe=[f"{f:g}" for f in skewed["imbalance_semmoe"]])
    keys = ["model", "hardware", "backend", "imbalance_semmoe"]
    wide = cells.pivot(index=keys, columns="tokens_per_rank", values="cell")
    wide = wide.loc[list(dict.fromkeys(map(tuple, cells[keys].itertuples(index=False))))]
    wide.columns = [f"{t} tok" for t in wide.columns]
    return wide.reset_index()


def breakeven_section(runs_dir: str | Path, out_dir: str | Path, summary: pd.DataFrame | None = None) -> list[str]:
    """Markdown lines of the report's "When does co-scheduling pay" section ([] when runs_dir/breakeven is absent).
    summary: read_jobs' rows of runs_dir (read here when None) for the measured routing sources."""
    results = Path(runs_dir) / RESULTS
    if not (results / "breakeven.json").is_file():
        return []
    title = "## When does co-scheduling pay (beyond the paper)"
    try:
        meta, grid, table = read_results(results)
    except ReproError as error:  # one unreadable result hides only its own section
        log.warning("%s", error)
        return [title, "", f"Skipped: {error}", ""]
    if summary is None:
        try:
            summary = read_jobs(runs_dir)[0]
        except ReproError:
            summary = None
    sources = routing_sources(summary)
    model = MAIN_MODEL if MAIN_MODEL in set(grid["model"]) else str(grid["model"].iloc[0])
    figure = fig_breakeven(grid, table, sources, Path(out_dir) / f"breakeven_{model}.png", model)
    balanced = table[(table["imbalance_semmoe"] == 1.0) & (table["imbalance_ep"] == 1.0)]
    keys = ["model", "hardware", "backend"]
    best = balanced.assign(ratio=[f"{r:.3f}" for r in balanced["ratio_at_lar_1"]]).pivot(
        index=keys, columns="tokens_per_rank", values="ratio")
    best = best.loc[list(dict.fromkeys(map(tuple, balanced[keys].itertuples(index=False))))]
    best.columns = [f"{t} tok" for t in best.columns]
    lines = [
        title, "",
        f"The MoE-layer time (gate + dispatch + experts + combine on the busiest rank, Attention-DP) of Sem-MoE over "
        f"vanilla EP, priced by the simulator's cost model (repro/sim/costs.py) for each hardware profile and "
        f"all-to-all backend, from `{results}/` (`python -m repro.sim.breakeven`). Assumptions: "
        + "; ".join(meta.get("assumptions", [])) + ". This is the MoE-layer time ratio, not the throughput under "
        "an SLO (that needs queueing; see the serving experiments).", "",
        f"![break-even map]({figure.name})", "",
        "Break-even LAR gain over EP's 1/D (Sem-MoE is faster above it; EP balanced, Sem-MoE's busiest rank at the "
        "given max/mean load; with both balanced any gain pays):", "",
        markdown_table(breakeven_table(table)), "",
        "Best case, both balanced: time ratio at LAR = 1 (no token leaves its rank; the fixed per-call latency of "
        "the all-to-all stays):", "",
        markdown_table(best.reset_index()), "",
    ]
    if len(sources):
        drawn = set(grid.loc[grid["model"] == model, "devices"])
        shown = sources.assign(on_the_map=["drawn" if d in drawn else f"no panel with {d} GPUs" for d in sources["devices"]])
        lines += ["Routing sources placed on the map (measured LAR of a semmoe system and of ep, same experiment, "
                  "workload, model and deployment; a source is drawn on the panels with its GPU count, its routing "
                  "comes from its own model while the map prices the shape named in the figure):", "",
                  markdown_table(shown), ""]
    else:
        lines += ["No finished semmoe/ep job pairs under runs/: the map shows the curves only.", ""]
    return lines


def main(argv=None) -> None:
    parser = cli.ArgumentParser(prog="python -m repro.figures.breakeven", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="runs", help="runs folder (results in <runs>/breakeven)")
    parser.add_argument("--out", default="figures", help="where the PNG goes")
    args = parser.parse_args(argv)
    try:
        lines = breakeven_section(args.runs, args.out)
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if not lines:
        print(f"error: {args.runs}/{RESULTS} holds no break-even results; run `python -m repro.sim.breakeven --out "
              f"{args.runs}/{RESULTS}` first.", file=sys.stderr)
        raise SystemExit(2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
