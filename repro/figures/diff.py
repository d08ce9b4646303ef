"""`python -m repro.figures.diff RUNS_A RUNS_B [--out DIR] [--threshold 0.01] [--ignore COLS]`: what changed
between two result sets (two code versions, two machines, or two experiments), job by job.

    summary_a, summary_b = load_results("runs_old"), load_results("runs")
    changes = diff_runs(summary_a, summary_b, threshold=0.01)

Jobs are matched on KEY = (experiment, model_name, workload, eval_workload, evaluate_split, system, attention,
devices, job). `job` is the job's directory name (Hydra's override string): it tells apart the jobs of a sweep
that differ in something the other columns do not name (system.params.replicas_per_device, +serve_model,
lookback). Two jobs of one set with the same key are an error. `--ignore experiment,attention` matches on the
other key columns only, e.g. to put runs/paper_dp beside runs/paper_tp.

Compared, when a job has them: LAR (and a bound's achieved LAR, the simulator's LAR, the node-local rate), all-to-all, dispatch,
inter-node and real-execution bytes, load imbalance, the all-to-all time estimate, the simulator's throughput
under SLO and latencies at the lightest rate, and, from sim_per_rate.csv, mean TTFT / TPOT / E2E and p99 E2E at
every offered rate (`<metric>@<rate>rps`). A metric is reported when |B/A - 1| > threshold, or when one side
lacks it; the change is printed as B - A for the LAR columns (fractions) and as B/A otherwise.
Exit code 0 whatever changed; 2 with one sentence on stderr, and nothing written, on bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from repro.atomic import atomic_write, atomic_write_text  # noqa: E402
from repro.errors import ReproError  # noqa: E402
from repro.figures.html import write_html  # noqa: E402
from repro.figures.report import load_runs, markdown_table  # noqa: E402

KEY = ("experiment", "model_name", "workload", "eval_workload", "evaluate_split", "system", "attention", "devices",
       "job")
RATES = ("lar", "lar_achieved", "lar_sim", "node_local_activation_rate")  # fractions: the change is B - A
METRICS = RATES + (
    "a2a_bytes", "dispatch_bytes", "dispatch_bytes_inter_node", "exec_dispatch_bytes",
    "token_imbalance_max_mean", "expert_load_imbalance_max_mean", "a2a_seconds_est",
    "throughput_under_ttft_slo_rps", "throughput_under_e2e_slo_rps", "goodput_distserve_rps",
    "ttft_p99_s_lightest", "e2e_p50_s_lightest", "moe_layer_s_lightest",
)
PER_RATE = ("ttft_mean_s", "tpot_mean_s", "e2e_mean_s", "e2e_p99_s")  # sim_per_rate.csv columns, one per rate
FIGURE_BARS = 40  # the largest relative changes drawn; the tables list all of them


def load_results(runs_dir: str | Path) -> pd.DataFrame:
    """load_runs' summary (one row per finished job) plus `<metric>@<rate>rps` columns from each sim_per_rate.csv."""
    if not Path(runs_dir).is_dir():
        raise ReproError(f"{runs_dir} is not a directory; pass a runs directory (e.g. runs or runs/paper_dp).")
    summary, _ = load_runs(runs_dir)
    per_rate = []
    for run_dir in summary["run_dir"]:
        path = Path(run_dir) / "sim_per_rate.csv"
        row = {}
        if path.exists():
            table = pd.read_csv(path).set_index("rate")
            row = {f"{m}@{rate:g}rps": table.at[rate, m] for m in PER_RATE if m in table for rate in table.index}
        per_rate.append(row)
    return summary.join(pd.DataFrame(per_rate, index=summary.index))


def metric_columns(columns) -> list[str]:
    """The compared metrics among `columns` (once each), in METRICS order, then PER_RATE order by ascending rate."""
    columns = set(columns)
    rated = [c.split("@") for c in columns if "@" in c and c.split("@")[0] in PER_RATE]
    rated.sort(key=lambda mr: (PER_RATE.index(mr[0]), float(mr[1].removesuffix("rps"))))
    return [c for c in METRICS if c in columns] + ["@".join(mr) for mr in rated]


def _keyed(summary: pd.DataFrame, key: list[str], side: str) -> pd.DataFrame:
    keyed = summary.copy()
    keyed[key] = keyed[key].fillna("-")
    dup = keyed.duplicated(subset=key, keep=False)
    if dup.any():
        first = keyed[dup].iloc[0]
        dirs = keyed[dup & (keyed[key] == first[key]).all(axis=1)]["run_dir"].tolist()
        same = ", ".join(f"{k}={first[k]}" for k in key)
        raise ReproError(f"set {side} holds {len(dirs)} jobs with the same key ({same}): {dirs}; compare one "
                         "experiment directory at a time, or ignore fewer key columns (--ignore).")
    return keyed.set_index(key)


def diff_runs(summary_a: pd.DataFrame, summary_b: pd.DataFrame, threshold: float = 0.01,
              key: tuple[str, ...] = KEY) -> pd.DataFrame:
    """Changed metrics of jobs in both sets and the jobs in one set only.

    summary_a, summary_b: one row per job (load_results), with the `key` columns unique per job.
    Returns one row per change, key columns then `metric`, `a`, `b`, `delta` (b - a), `ratio` (b / a) and `status`:
    "changed" (|ratio - 1| > threshold, or a = 0 != b, or one side lacks the metric), "only in A" or "only in B"
    (a whole job; metric "", numbers NaN). Rows are sorted by key, then in metric_columns order.
    """
    key = list(key)
    a, b = _keyed(summary_a, key, "A"), _keyed(summary_b, key, "B")
    metrics = metric_columns([*summary_a.columns, *summary_b.columns])
    common = a.index.intersection(b.index).sort_values()
    values_a = a.reindex(index=common, columns=metrics).apply(pd.to_numeric, errors="coerce").to_numpy(float)
    values_b = b.reindex(index=common, columns=metrics).apply(pd.to_numeric, errors="coerce").to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = values_b / values_a
        changed = (np.abs(ratio - 1) > threshold) | (np.isnan(values_a) != np.isnan(values_b))
    row, col = np.nonzero(changed)
    changes = pd.DataFrame(list(common[row]), columns=key).assign(
        metric=np.array(metrics, dtype=object)[col], a=values_a[row, col], b=values_b[row, col],
        delta=values_b[row, col] - values_a[row, col], ratio=ratio[row, col], status="changed")
    only = [pd.DataFrame(list(side.index.difference(other.index).sort_values()), columns=key).assign(
        metric="", a=np.nan, b=np.nan, delta=np.nan, ratio=np.nan, status=status)
        for side, other, status in ((a, b, "only in A"), (b, a, "only in B"))]
    return pd.concat([changes, *only], ignore_index=True)


def label_columns(summary_a: pd.DataFrame, summary_b: pd.DataFrame, key: tuple[str, ...] = KEY) -> list[str]:
    """Key columns that tell the jobs of both sets apart when printed: system, attention mode and EP degree, the
    others that vary, and `job` only when those do not already tell every job apart."""
    jobs = pd.concat([summary_a[list(key)], summary_b[list(key)]]).fillna("-").drop_duplicates()
    always = ("system", "attention", "devices")
    cols = [c for c in key if c != "job" and (c in always or jobs[c].nunique() > 1)]
    if "job" in key and jobs[cols].duplicated().any():
        cols.append("job")
    return cols


def _kind(metric: str) -> str:
    base = metric.split("@")[0]
    if base in RATES:
        return "rate"
    if "bytes" in base:
        return "bytes"
    if base.endswith("_rps"):
        return "rps"
    if "_s_" in base + "_" or "seconds" in base:
        return "seconds"
    return "ratio"


def format_value(metric: str, value: float) -> str:
    """A metric's value with its unit (bytes in MiB/GiB, seconds in ms)."""
    if not np.isfinite(value):
        return "-"
    kind = _kind(metric)
    if kind == "bytes":
        return f"{value / 2**30:.3f} GiB" if abs(value) >= 2**30 else f"{value / 2**20:.2f} MiB"
    if kind == "seconds":
        return f"{value * 1e3:.4g} ms"
    if kind == "rps":
        return f"{value:.5g} rps"
    return f"{value:.4f}" if kind == "rate" else f"{value:.4g}"


def format_change(row) -> str:
    """B - A for the LAR columns, B/A otherwise; 'added' / 'removed' when one side lacks the metric."""
    if np.isnan(row.a) or np.isnan(row.b):
        return "added" if np.isnan(row.a) else "removed"
    if _kind(row.metric) == "rate":
        return f"{row.delta:+.4f}"
    return f"{row.ratio:.4f}x" if np.isfinite(row.ratio) else "from 0"


def changes_table(diff: pd.DataFrame, labels: list[str]) -> pd.DataFrame:
    """The 'changed' rows as strings: label columns, metric, A, B, change."""
    changed = diff[diff["status"] == "changed"]
    table = changed[labels].rename(columns={"devices": "D"}).reset_index(drop=True)
    table["metric"] = changed["metric"].to_numpy()
    table["A"] = [format_value(r.metric, r.a) for r in changed.itertuples()]
    table["B"] = [format_value(r.metric, r.b) for r in changed.itertuples()]
    table["change"] = [format_change(r) for r in changed.itertuples()]
    return table


def job_labels(rows: pd.DataFrame, labels: list[str]) -> list[str]:
    """One line per row: its label columns joined ("paper_dp / semmoe / dp / D=4")."""
    return [" / ".join(f"D={v}" if c == "devices" else str(v) for c, v in zip(labels, r, strict=True))
            for r in rows[labels].itertuples(index=False)]


def fig_changes(diff: pd.DataFrame, labels: list[str], path: Path) -> Path | None:
    """Horizontal bars of B/A - 1 (%) for the FIGURE_BARS largest finite changes; None when there are none."""
    changed = diff[(diff["status"] == "changed") & np.isfinite(diff["ratio"])].copy()
    if not len(changed):
        return None
    changed["rel"] = (changed["ratio"] - 1) * 100
    top = changed.reindex(changed["rel"].abs().sort_values(ascending=False).index[:FIGURE_BARS])
    names = [f"{job} · {m}" for job, m in zip(job_labels(top, labels), top["metric"], strict=True)]
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(top) + 1.2), layout="constrained")
    ax.barh(np.arange(len(top)), top["rel"], color=np.where(top["rel"] > 0, "#c44e52", "#4c72b0"))
    ax.set_yticks(np.arange(len(top)), names, fontsize="small")
    ax.invert_yaxis()
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel("B / A - 1 (%)")
    ax.set_title(f"The {len(top)} largest of {len(changed)} relative changes" if len(changed) > len(top)
                 else "Relative changes")
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=130, bbox_inches="tight"))
    finally:
        plt.close(fig)
    return path


def render_text(diff: pd.DataFrame, labels: list[str], threshold: float, n_matched: int) -> str:
    """The terminal report: the changes table, then the jobs in one set only."""
    table = changes_table(diff, labels)
    lines = [table.to_string(index=False) if len(table) else
             f"no metric changed by more than {threshold:.1%} in the {n_matched} jobs of both sets."]
    for status in ("only in A", "only in B"):
        jobs = job_labels(diff[diff["status"] == status], labels)
        lines += [f"{status} ({len(jobs)}):"] + [f"  {j}" for j in jobs] if jobs else []
    return "\n".join(lines)


def render_markdown(diff: pd.DataFrame, labels: list[str], runs: tuple[str, str], counts: tuple[int, int],
                    key: list[str], threshold: float, figure: Path | None) -> str:
    """diff.md: the sets compared, how jobs were matched, the changes table and figure, the unmatched jobs."""
    table = changes_table(diff, labels)
    jobs = diff[diff["status"] == "changed"][key].drop_duplicates()
    lines = ["# What changed between two result sets", "",
             f"A: `{runs[0]}` ({counts[0]} jobs); B: `{runs[1]}` ({counts[1]} jobs). Jobs matched on "
             f"{', '.join(f'`{k}`' for k in key)}. A metric is listed when |B/A - 1| > {threshold:g} or one side "
             "lacks it; change = B - A for LAR columns, B/A otherwise.", "",
             f"## Changed metrics ({len(table)} in {len(jobs)} jobs)", ""]
    lines += [markdown_table(table) if len(table) else "None above the threshold.", ""]
    if figure is not None:
        lines += [f"![Relative changes]({figure.name})", ""]
    for status in ("only in A", "only in B"):
        names = job_labels(diff[diff["status"] == status], labels)
        lines += [f"## Jobs {status} ({len(names)})", ""] + [f"- {n}" for n in names] + [""]
    return "\n".join(lines)


def write_diff(diff: pd.DataFrame, labels: list[str], runs: tuple[str, str], counts: tuple[int, int],
               key: list[str], threshold: float, out_dir: Path) -> list[Path]:
    """Write diff_changes.png (when anything changed by a finite ratio), diff.csv, diff.md and diff.html."""
    out_dir = Path(out_dir)
    figure = fig_changes(diff, labels, out_dir / "diff_changes.png")
    written = [figure] if figure is not None else []
    csv, md = out_dir / "diff.csv", out_dir / "diff.md"
    atomic_write_text(csv, diff.to_csv(index=False))
    atomic_write_text(md, render_markdown(diff, labels, runs, counts, key, threshold, figure))
    return written + [csv, md, write_html(md, out_dir / "diff.html")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs_a", metavar="RUNS_A")
    parser.add_argument("runs_b", metavar="RUNS_B")
    parser.add_argument("--out", help="also write diff.md, diff.csv, diff.html and diff_changes.png here")
    parser.add_argument("--threshold", type=float, default=0.01, help="smallest |B/A - 1| reported (default 0.01)")
    parser.add_argument("--ignore", default="", help=f"comma-separated key columns not matched on, of {list(KEY)}")
    args = parser.parse_args(argv)
    try:
        ignore = [c for c in args.ignore.split(",") if c]
        if (unknown := sorted(set(ignore) - set(KEY))) or set(ignore) == set(KEY):
            raise ReproError(f"--ignore names {unknown or ignore}, not a proper subset of the key columns "
                             f"{list(KEY)}; keep at least one to match jobs on.")
        key = [c for c in KEY if c not in ignore]
        summary_a, summary_b = load_results(args.runs_a), load_results(args.runs_b)
        diff = diff_runs(summary_a, summary_b, args.threshold, tuple(key))
        labels = label_columns(summary_a, summary_b, tuple(key))
        n_matched = len(summary_a) - int((diff["status"] == "only in A").sum())
        print(render_text(diff, labels, args.threshold, n_matched))
        if args.out:
            for path in write_diff(diff, labels, (args.runs_a, args.runs_b), (len(summary_a), len(summary_b)), key,
                                   args.threshold, Path(args.out)):
                print(path)
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
