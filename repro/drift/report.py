"""`python -m repro.drift.report runs/drift`: the drift experiment's summary table and its targets, read from the jobs'
metrics.json files (nothing is recomputed).

One markdown row per (stream, seed, policy), then, for jobs with the serving pass (drift.serving.enabled), a second
table of its keys (p99 / mean TTFT and TPOT over the whole served stream, SLO attainment, serving stall seconds,
migrations, LAR, all-to-all seconds) with each job's rate and SLOs, then the issue's three targets judged by stated
rules over the jobs found: on every abrupt-switch job the headline policy keeps >= 90 % of the hindsight all-to-all gain
(gain_kept_vs_hindsight >= 0.9) and moves <= 25 % of EPLB's experts (experts_moved_vs_eplb <= 0.25); on every
stationary job it never re-places (false_alarms == 0 and replacements == 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from repro import cli
from repro.errors import ReproError

COLUMNS = ("a2a_s", "stall_s", "migration_s", "gain_kept_vs_hindsight", "gain_kept_vs_best_per_window", "experts_moved", "experts_moved_vs_eplb", "replacements",
           "false_alarms", "lar_mean", "balance_mean")


SERVING_COLUMNS = ("ttft_p99_s", "ttft_mean_s", "tpot_p99_s", "tpot_mean_s", "slo_attainment", "serving_stall_s",
                   "serving_migrations", "serving_lar", "serving_a2a_s")


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def series_table(csv: Path, column: str = "ttft_p99_s", scale: float = 1e3) -> list[str]:
    """Markdown rows: one per policy of a job's drift_serving.csv, `column` x scale per window, a window in which a
    migration began marked with *."""
    import pandas as pd

    frame = pd.read_csv(csv)
    windows = sorted(frame["window"].unique())
    lines = ["| policy | " + " | ".join(f"w{w}" for w in windows) + " |", "|" + "---|" * (len(windows) + 1)]
    for name, rows in frame.groupby("policy", sort=False):
        rows = rows.set_index("window")
        cells = [("-" if pd.isna(rows.at[w, column]) else f"{rows.at[w, column] * scale:.3g}")
                 + ("*" if rows.at[w, "migrations_began"] else "") for w in windows]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def load_jobs(root: Path, folders: list[Path] | None = None) -> list[tuple[str, int, dict]]:
    """(stream name, seed, summary) of every finished drift job under root (or in `folders`, job folders the caller
    already found), sorted; each summary also gets "_folder", the job's folder (for its CSVs)."""
    jobs = []
    files = sorted(Path(root).rglob("metrics.json")) if folders is None else [Path(f) / "metrics.json" for f in folders]
    for metrics in files:
        payload = json.loads(metrics.read_text())
        config, summary = payload.get("config", {}), payload.get("summary", {})
        if "policies" not in summary or not config.get("drift"):
            continue
        workload = config["workload"]
        stream = (f"trace {Path(config['trace']).name}" if config.get("trace")  # an imported trace, not the workload
                  else "abrupt" if workload.get("segments") and len(workload["segments"]) > 1
                  else "periodic" if workload.get("mix") else "stationary")
        jobs.append((stream, int(config["seed"]), {**summary, "_folder": str(metrics.parent)}))
    if not jobs:
        raise ReproError(f"{root} holds no finished drift job (metrics.json with a drift summary); run "
                         "`python -m repro.run -m experiment=drift` first.")
    return sorted(jobs, key=lambda j: (j[0], j[1]))


def report(root: Path, folders: list[Path] | None = None) -> str:
    jobs = load_jobs(root, folders)
    lines = ["| stream | seed | policy | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 3)]
    for stream, seed, summary in jobs:
        for name, policy in summary["policies"].items():
            label = f"{name} ({policy['kind']})" if policy["kind"] != "system" else name
            lines.append(f"| {stream} | {seed} | {label} | " + " | ".join(_cell(policy.get(c)) for c in COLUMNS) + " |")
    lines.append("")
    served = [(stream, seed, summary) for stream, seed, summary in jobs if "serving_rate_rps" in summary]
    if served:
        lines += ["Serving pass (repro.drift.serving): each policy's plan changes replayed in the serving simulator.", "",
                  "| stream | seed | policy | " + " | ".join(SERVING_COLUMNS) + " |", "|" + "---|" * (len(SERVING_COLUMNS) + 3)]
        for stream, seed, summary in served:
            for name, policy in summary["policies"].items():
                if "ttft_p99_s" in policy:
                    lines.append(f"| {stream} | {seed} | {name} | "
                                 + " | ".join(_cell(policy.get(c)) for c in SERVING_COLUMNS) + " |")
        lines.append("")
        for stream, seed, summary in served:
            lines.append(f"- {stream} seed {seed}: {_cell(summary['serving_rate_rps'])} req/s"
                         + (f" ({_cell(summary['serving_load'])} x static EP's {_cell(summary['serving_capacity_rps'])} "
                            "req/s flood throughput)" if summary.get("serving_capacity_rps") else " (given)")
                         + f", {summary['serving_window_s']} s per window, {summary['serving_requests']} requests; SLOs "
                         f"TTFT {_cell(summary['slo_ttft_s'])} s, TPOT {_cell(summary['slo_tpot_s'])} s ({summary['slo_rule']})")
        lines.append("")
        for stream, seed, summary in served:
            csv = Path(summary["_folder"]) / "drift_serving.csv"
            if csv.is_file():
                lines += [f"p99 TTFT (ms) per served window, {stream} seed {seed} (* a migration began in it):", "",
                          *series_table(csv), ""]
    abrupt = [s for stream, _, s in jobs if stream == "abrupt"]
    stationary = [s for stream, _, s in jobs if stream == "stationary"]
    if abrupt:
        kept = [s["gain_kept_vs_hindsight"] for s in abrupt]
        moved = [s["experts_moved_vs_eplb"] for s in abrupt]
        lines.append(f"- gain kept vs hindsight >= 0.90 on every abrupt job: "
                     f"{'met' if all(k is not None and k >= 0.9 for k in kept) else 'missed'} ({[_cell(k) for k in kept]})")
        lines.append(f"- experts moved <= 0.25 x EPLB's on every abrupt job: "
                     f"{'met' if all(m is not None and m <= 0.25 for m in moved) else 'missed'} ({[_cell(m) for m in moved]})")
    if stationary:
        alarms = [s["replacements"] for s in stationary]
        lines.append(f"- no re-placement on any stationary job: {'met' if not any(alarms) else 'missed'} "
                     f"(re-placements per job {alarms})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(prog="python -m repro.drift.report", description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=cli.existing_dir, help="the experiment's folder, e.g. runs/drift")
    args = parser.parse_args(argv)
    return cli.run(lambda: print(report(Path(args.runs))))


if __name__ == "__main__":
    sys.exit(main())
