"""`python -m repro.figures.diff RUNS_A RUNS_B [--out DIR] [--threshold 0.01] [--ignore COLS]
[--allow-different-traces]`: what changed between two result sets (two code versions, two machines, or two
experiments), job by job.

    summary_a, summary_b = load_results("runs_old"), load_results("runs")
    changes = diff_runs(summary_a, summary_b, threshold=0.01)

Jobs are matched on KEY = (experiment, model_name, workload, eval_workload, evaluate_split, system, attention,
devices, job). `job` is the job's directory name (Hydra's override string): it tells apart the jobs of a sweep
that differ in something the other columns do not name (system.params.replicas_per_device, +serve_model,
lookback). Two jobs of one set with the same key are an error. `--ignore experiment,attention` matches on the
other key columns only, e.g. to put runs/paper_dp beside runs/paper_tp.

Compared, when a job has them: LAR (and a bound's achieved LAR, the simulator's LAR, the node-local rate), all-to-all, dispatch,
inter-node and real-execution bytes, load imbalance, the all-to-all time estimate, the simulator's throughput
under each SLO rule (bisected, mean over seeds), the heaviest stable rate, latencies, all-to-all shares and MoE-layer
time (prefill-containing and decode-only iterations apart) at the lightest rate, and, from sim_per_rate.csv, mean
TTFT / TPOT / E2E and p99 E2E at every rate of the grid (`<metric>@<rate>rps`; seed 0's grid runs of a steady-state
table). A metric is reported when |B/A - 1| > threshold, or when one side
lacks it; the change is printed as B - A for the LAR columns (fractions) and as B/A otherwise.

Matched jobs must have been measured on the same routing: when both record `trace_digests` (the profile and
evaluated splits' digests) and these differ, the diff is refused, or, with --allow-different-traces, made with those
jobs' rows labelled "different traces". A job whose metrics.json (or sim_per_rate.csv) cannot be read is skipped and
listed, not fatal. Exit code 0 whatever changed; 2 with one sentence on stderr, and nothing written, on bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from repro import cli
from repro.atomic import atomic_write_text  # noqa: E402
from repro.errors import ReproError  # noqa: E402
from repro.figures.html import write_html  # noqa: E402
from repro.figures.jobs import SkippedJob, check_out_dir, log, read_jobs  # noqa: E402
from repro.figures.paper import rate_grid  # noqa: E402
from repro.figures.render import markdown_table, save_png  # noqa: E402

KEY = ("experiment", "model_name", "workload", "eval_workload", "evaluate_split", "system", "attention", "devices",
       "job")
RATES = ("lar", "lar_achieved", "lar_sim", "node_local_activation_rate")  # fractions: the change is B - A
METRICS = RATES + (
    "a2a_bytes", "dispatch_bytes", "dispatch_bytes_inter_node", "exec_dispatch_bytes",
    "token_imbalance_max_mean", "expert_load_imbalance_max_mean", "a2a_seconds_est",
    "throughput_under_ttft_slo_rps", "throughput_under_e2e_slo_rps", "goodput_distserve_rps", "capacity_rps",
    "sim_heaviest_stable_rate_rps", "ttft_p99_s_lightest", "e2e_p50_s_lightest", "moe_layer_s_lightest",
    "a2a_share_lightest", "a2a_share_heaviest",
    "moe_layer_prefill_s_lightest", "moe_layer_decode_s_lightest", "a2a_share_prefill_lightest",
    "a2a_share_decode_lightest", "moe_layer_prefill_s_heaviest_stable", "moe_layer_decode_s_heaviest_stable",
)
PER_RATE = ("ttft_mean_s", "tpot_mean_s", "e2e_mean_s", "e2e_p99_s")  # sim_per_rate.csv columns, one per rate
FIGURE_BARS = 40  # the largest relative changes drawn; the tables list all of them


def read_results(runs_dir: str | Path) -> tuple[pd.DataFrame, list[SkippedJob]]:
    """(read_jobs' summary, one row per readable finished job, plus `<metric>@<rate>rps` columns from each
    sim_per_rate.csv; the jobs skipped because their metrics.json or sim_per_rate.csv cannot be read)."""
    if not Path(runs_dir).is_dir():
        raise ReproError(f"{runs_dir} is not a directory; pass a runs directory (e.g. runs or runs/paper_dp).")
    summary, _, skipped = read_jobs(runs_dir)
    per_rate, readable = [], []
    for run_dir in summary["run_dir"]:
        path = Path(run_dir) / "sim_per_rate.csv"
        row = {}
        try:
            if path.exists():
                # a steady-state table holds every run (seeds, bisection probes): the curve is seed 0's grid
                table = rate_grid(pd.read_csv(path)).drop_duplicates("rate", keep="last").set_index("rate")
                row = {f"{m}@{rate:g}rps": table.at[rate, m] for m in PER_RATE if m in table for rate in table.index}
        except (OSError, ValueError, KeyError, TypeError) as error:  # pandas' parser errors are ValueErrors
            skipped.append(SkippedJob(Path(run_dir) / "metrics.json",
                                      f"its sim_per_rate.csv cannot be read ({type(error).__name__}: {error})"))
            log.warning("%s", skipped[-1].sentence())
        else:
            readable.append(run_dir)
        per_rate.append(row)
    results = summary.join(pd.DataFrame(per_rate, index=summary.index))
    return results[results["run_dir"].isin(readable)].reset_index(drop=True), skipped


def load_results(runs_dir: str | Path) -> pd.DataFrame:
    """read_results without the skipped jobs' list."""
    return read_results(runs_dir)[0]


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


def check_threshold(threshold: float) -> float:
    """The threshold if it is a finite number >= 0; else ReproError (a negative one would report every metric)."""
    if not np.isfinite(threshold) or threshold < 0:
        raise ReproError(f"the threshold {threshold} is not a number >= 0; pass the smallest |B/A - 1| to report, "
                         "e.g. --threshold 0.01 for 1 %.")
    return threshold


def trace_status(digests_a: pd.Series, digests_b: pd.Series) -> np.ndarray:
    """Per matched job: "same" / "different" when both sides record trace_digests ({split: digest}), else
    "unknown" (runs written before digests were recorded). digests_a, digests_b: aligned Series of dicts or NaN."""
    return np.array(["unknown" if not (isinstance(x, dict) and isinstance(y, dict)) else "same" if x == y
                     else "different" for x, y in zip(digests_a, digests_b, strict=True)], dtype=object)


def _refuse_different_traces(common: pd.Index, status: np.ndarray, a: pd.DataFrame, b: pd.DataFrame) -> None:
    different = np.flatnonzero(status == "different")
    if not len(different):
        return
    job = common[different[0]]
    x, y = a.at[job, "trace_digests"], b.at[job, "trace_digests"]
    splits = ", ".join(f"{k} {str(x.get(k))[:12]} in A vs {str(y.get(k))[:12]} in B"
                       for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k))
    raise ReproError(f"{len(different)} of the {len(common)} matched jobs were measured on different traces (e.g. "
                     f"{' / '.join(map(str, job))}: {splits}), so their metrics are not comparable; rerun one set on "
                     "the same trace and splits, or pass --allow-different-traces to list them labelled.")


def diff_runs(summary_a: pd.DataFrame, summary_b: pd.DataFrame, threshold: float = 0.01,
              key: tuple[str, ...] = KEY, allow_different_traces: bool = False) -> pd.DataFrame:
    """Changed metrics of jobs in both sets and the jobs in one set only.

    summary_a, summary_b: one row per job (load_results), with the `key` columns unique per job.
    Returns one row per change, key columns then `metric`, `a`, `b`, `delta` (b - a), `ratio` (b / a), `status`:
    "changed" (|ratio - 1| > threshold, or a = 0 != b, or one side lacks the metric), "only in A" or "only in B"
    (a whole job; metric "", numbers NaN; mark_unreadable turns those present but unreadable on the other side into
    "unreadable in B" / "unreadable in A"), and `traces` ("same", "different", "unknown"; "" for one-sided jobs).
    Rows are sorted by key, then in metric_columns order. Raises ReproError when matched jobs ran on different
    traces (trace_digests) unless allow_different_traces, or when the threshold is negative.
    """
    check_threshold(threshold)
    key = list(key)
    a, b = _keyed(summary_a, key, "A"), _keyed(summary_b, key, "B")
    metrics = metric_columns([*summary_a.columns, *summary_b.columns])
    common = a.index.intersection(b.index).sort_values()
    no_digests = pd.Series(np.nan, index=common, dtype=object)
    traces = trace_status(a["trace_digests"].reindex(common) if "trace_digests" in a else no_digests,
                          b["trace_digests"].reindex(common) if "trace_digests" in b else no_digests)
    if not allow_different_traces:
        _refuse_different_traces(common, traces, a, b)
    values_a = a.reindex(index=common, columns=metrics).apply(pd.to_numeric, errors="coerce").to_numpy(float)
    values_b = b.reindex(index=common, columns=metrics).apply(pd.to_numeric, errors="coerce").to_numpy(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = values_b / values_a
        changed = (np.abs(ratio - 1) > threshold) | (np.isnan(values_a) != np.isnan(values_b))
    row, col = np.nonzero(changed)
    changes = pd.DataFrame(list(common[row]), columns=key).assign(
        metric=np.array(metrics, dtype=object)[col], a=values_a[row, col], b=values_b[row, col],
        delta=values_b[row, col] - values_a[row, col], ratio=ratio[row, col], status="changed", traces=traces[row])
    only = [pd.DataFrame(list(side.index.difference(other.index).sort_values()), columns=key).assign(
        metric="", a=np.nan, b=np.nan, delta=np.nan, ratio=np.nan, status=status, traces="")
        for side, other, status in ((a, b, "only in A"), (b, a, "only in B"))]
    diff = pd.concat([changes, *only], ignore_index=True)
    # matched jobs on different traces, changed or not, so the report can say how many were labelled
    diff.attrs["jobs_on_different_traces"] = int((traces == "different").sum())
    return diff


ONE_SIDED = ("only in A", "only in B", "unreadable in A", "unreadable in B")


def mark_unreadable(diff: pd.DataFrame, summaries: tuple[pd.DataFrame, pd.DataFrame], roots: tuple[str, str],
                    skipped: tuple[list[SkippedJob], list[SkippedJob]], key: list[str]) -> pd.DataFrame:
    """Relabel a job "only in A" whose folder is in B too but was skipped there as unreadable (a metrics.json holding
    NaN, say) as "unreadable in B", and the same the other way: it is not missing from B, and the list said so."""
    for side, other in ((0, 1), (1, 0)):
        unreadable = {os.path.relpath(job.metrics_path.parent, roots[other]) for job in skipped[other]}
        rows = diff.index[diff["status"] == f"only in {'AB'[side]}"]
        if not unreadable or not len(rows):
            continue
        run_dirs = _keyed(summaries[side], key, "AB"[side])["run_dir"]
        for i in rows:
            at = tuple(diff.loc[i, key]) if len(key) > 1 else diff.at[i, key[0]]
            if os.path.relpath(run_dirs.loc[at], roots[side]) in unreadable:
                diff.at[i, "status"] = f"unreadable in {'AB'[other]}"
    return diff


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
    if "traces" in changed and (changed["traces"] == "different").any():
        table["traces"] = np.where(changed["traces"] == "different", "DIFFERENT traces", "same")
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
    return save_png(fig, path)


def notes(diff: pd.DataFrame, skipped: tuple[list[SkippedJob], list[SkippedJob]]) -> list[str]:
    """Sentences the reader needs before trusting the table: matched jobs that ran on different traces (only with
    allow_different_traces) and the jobs of either set skipped as unreadable."""
    lines = []
    if n := diff.attrs.get("jobs_on_different_traces", 0):
        lines.append(f"{n} matched job(s) ran on different traces (trace_digests differ): their rows are labelled "
                     "'DIFFERENT traces' and their changes are not caused by the code or the machine alone.")
    for side, jobs in zip("AB", skipped, strict=True):
        lines += [f"set {side}: {job.sentence()}" for job in jobs]
    return lines


def render_text(diff: pd.DataFrame, labels: list[str], threshold: float, n_matched: int,
                warnings: list[str] = ()) -> str:
    """The terminal report: the warnings (notes()), the changes table, then the jobs in one set only."""
    table = changes_table(diff, labels)
    lines = [f"warning: {w}" for w in warnings]
    lines += [table.to_string(index=False) if len(table) else
              f"no metric changed by more than {threshold:.1%} in the {n_matched} jobs of both sets."]
    for status in ONE_SIDED:
        jobs = job_labels(diff[diff["status"] == status], labels)
        lines += [f"{status} ({len(jobs)}):"] + [f"  {j}" for j in jobs] if jobs else []
    return "\n".join(lines)


def render_markdown(diff: pd.DataFrame, labels: list[str], runs: tuple[str, str], counts: tuple[int, int],
                    key: list[str], threshold: float, figure: Path | None, warnings: list[str] = ()) -> str:
    """diff.md: the sets compared, how jobs were matched, the warnings (notes()), the changes table and figure,
    the unmatched jobs."""
    table = changes_table(diff, labels)
    jobs = diff[diff["status"] == "changed"][key].drop_duplicates()
    lines = ["# What changed between two result sets", "",
             f"A: `{runs[0]}` ({counts[0]} jobs); B: `{runs[1]}` ({counts[1]} jobs). Jobs matched on "
             f"{', '.join(f'`{k}`' for k in key)}. A metric is listed when |B/A - 1| > {threshold:g} or one side "
             "lacks it; change = B - A for LAR columns, B/A otherwise.", "",
             *[line for w in warnings for line in (f"**Warning:** {w}", "")],
             f"## Changed metrics ({len(table)} in {len(jobs)} jobs)", ""]
    lines += [markdown_table(table) if len(table) else "None above the threshold.", ""]
    if figure is not None:
        lines += [f"![Relative changes]({figure.name})", ""]
    for status in ONE_SIDED:
        names = job_labels(diff[diff["status"] == status], labels)
        lines += [f"## Jobs {status} ({len(names)})", ""] + [f"- {n}" for n in names] + [""]
    return "\n".join(lines)


def write_diff(diff: pd.DataFrame, labels: list[str], runs: tuple[str, str], counts: tuple[int, int],
               key: list[str], threshold: float, out_dir: Path, warnings: list[str] = ()) -> list[Path]:
    """Write diff_changes.png (when anything changed by a finite ratio), diff.csv, diff.md and diff.html."""
    out_dir = Path(out_dir)
    figure = fig_changes(diff, labels, out_dir / "diff_changes.png")
    written = [figure] if figure is not None else []
    csv, md = out_dir / "diff.csv", out_dir / "diff.md"
    atomic_write_text(csv, diff.to_csv(index=False))
    atomic_write_text(md, render_markdown(diff, labels, runs, counts, key, threshold, figure, warnings))
    return written + [csv, md, write_html(md, out_dir / "diff.html")]


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m repro.figures.diff", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs_a", metavar="RUNS_A")
    parser.add_argument("runs_b", metavar="RUNS_B")
    parser.add_argument("--out", help="also write diff.md, diff.csv, diff.html and diff_changes.png here")
    parser.add_argument("--threshold", type=cli.non_negative, default=0.01,
                        help="smallest |B/A - 1| reported (default 0.01)")
    parser.add_argument("--ignore", default="", help=f"comma-separated key columns not matched on, of {list(KEY)}")
    parser.add_argument("--allow-different-traces", action="store_true",
                        help="compare matched jobs whose trace_digests differ, labelling their rows, instead of refusing")
    args = parser.parse_args(argv)
    try:
        ignore = [c for c in args.ignore.split(",") if c]
        if (unknown := sorted(set(ignore) - set(KEY))) or set(ignore) == set(KEY):
            raise ReproError(f"--ignore names {unknown or ignore}, not a proper subset of the key columns "
                             f"{list(KEY)}; keep at least one to match jobs on.")
        key = [c for c in KEY if c not in ignore]
        check_threshold(args.threshold)
        if args.out:
            check_out_dir(args.out)
        (summary_a, skipped_a), (summary_b, skipped_b) = read_results(args.runs_a), read_results(args.runs_b)
        diff = diff_runs(summary_a, summary_b, args.threshold, tuple(key), args.allow_different_traces)
        diff = mark_unreadable(diff, (summary_a, summary_b), (args.runs_a, args.runs_b), (skipped_a, skipped_b), key)
        labels = label_columns(summary_a, summary_b, tuple(key))
        n_matched = len(summary_a) - int(diff["status"].isin(["only in A", "unreadable in B"]).sum())
        warnings = notes(diff, (skipped_a, skipped_b))
        print(render_text(diff, labels, args.threshold, n_matched, warnings))
        if args.out:
            for path in write_diff(diff, labels, (args.runs_a, args.runs_b), (len(summary_a), len(summary_b)), key,
                                   args.threshold, Path(args.out), warnings):
                print(path)
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
