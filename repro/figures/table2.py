"""The paper's Table 2 (Attention-TP, 1 req/s, inputs of exactly 256 / 512 / 1,024 tokens) from the jobs of
`experiment=paper_table2`, beside the paper's raw values, with Sem-MoE's TTFT gain read both ways the paper's
numbers can be read (reference/paper.md, the note on R5):

    quoted    worse baseline / Sem-MoE - 1   (how the paper's 12.21 / 10.60 / 18.89 % etc. come out)
    vs best   1 - Sem-MoE / best baseline    (the reduction against the stronger of SGLang and MoETuner)

Baselines are vanilla EP (`ep`, the paper's SGLang + DeepEP) and MoETuner. Reads only runs/: each job's
metrics.json (its config: shape, system, workload.input_len) and, per job, its per-request latencies
(`sim_requests.parquet` as the simulator writes it, or `.csv`: rate, seed, ttft_s, e2e_s and optionally in_window)
when the job has them, else its per-seed statistics (`sim_per_rate.csv`: ttft_p99_s, e2e_p50_s per seed). With requests, a point's
p99 TTFT / median E2E are over all its window requests pooled across seeds; without, they are the mean over seeds of
each seed's statistic. Either way the per-seed values give each reduction's range over seeds (paired: every system
sees the same arrivals and request draws seed by seed).

    frame = table2_frame(summary)            # summary = repro.figures.jobs.read_jobs(runs_dir)[0]
    lines = table2_section(summary, out_dir)  # markdown, and out_dir/table2.csv
    python -m repro.figures.table2 --runs runs --out figures
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from repro import cli
from repro.atomic import atomic_write
from repro.errors import ReproError
from repro.figures.jobs import log, read_jobs
from repro.figures.paper import PAPER_TABLE2
from repro.figures.render import markdown_table

EXPERIMENT = "paper_table2"
RATE = 1.0  # req/s, the paper's Attention-TP load
SYSTEMS = ("ep", "moetuner", "semmoe")  # ep = the paper's SGLang
BASELINES = ("ep", "moetuner")
SHAPE_NAMES = {"deepseek_v2_lite": "DeepSeek-V2-Lite", "qwen3_30b_a3b": "Qwen3-30B-A3B"}  # sim shape -> paper's name
STATS = (("ttft_p99", "ttft_s", 99), ("e2e_p50", "e2e_s", 50))  # (table key, per-request column, percentile)
REQUEST_FILES = ("sim_requests.parquet", "sim_requests.csv")


def reductions(baselines_B: np.ndarray, semmoe: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(quoted, vs_best): Sem-MoE's latency gain read the paper's way and against the best baseline.

    baselines_B float[..., B] latencies of the baselines, semmoe float[...] Sem-MoE's (same unit).
    quoted = max_B(baselines) / semmoe - 1; vs_best = 1 - semmoe / min_B(baselines). NaN where a value is NaN.
    """
    baselines_B, semmoe = np.asarray(baselines_B, dtype=np.float64), np.asarray(semmoe, dtype=np.float64)
    return baselines_B.max(axis=-1) / semmoe - 1, 1 - semmoe / baselines_B.min(axis=-1)


def paper_reductions() -> pd.DataFrame:
    """The paper's Table 2 rows (model, input, ms per system) with its TTFT and E2E gains read both ways."""
    paper = PAPER_TABLE2.copy()
    for stat, _, _ in STATS:
        quoted, vs_best = reductions(paper[[f"{stat}_{b}" for b in BASELINES]].to_numpy(), paper[f"{stat}_semmoe"])
        paper[f"{stat}_quoted"], paper[f"{stat}_vs_best"] = quoted, vs_best
    return paper


def _read_requests(run_dir: Path) -> pd.DataFrame | None:
    """The job's per-request latencies at RATE (window requests only when the file says which), or None."""
    for name in REQUEST_FILES:
        path = run_dir / name
        if path.is_file():
            table = pd.read_parquet(path) if name.endswith(".parquet") else pd.read_csv(path)
            missing = sorted({"rate", "ttft_s", "e2e_s"} - set(table))
            if missing:
                raise ValueError(f"{path.name} lacks the column(s) {missing}")
            table = table[np.isclose(table["rate"], RATE)]
            if "in_window" in table:
                table = table[table["in_window"].astype(bool)]
            return table.assign(seed=table["seed"] if "seed" in table else 0)
    return None


def job_point(run_dir: str | Path, pooled: bool = True) -> dict:
    """One job's Table 2 statistics at RATE, in seconds: {"<stat>", "<stat>_per_seed": list, "requests", "source"}.
    pooled False: the per-seed statistics of sim_per_rate.csv even where per-request latencies exist (so a row
    whose jobs do not all have them compares like with like).

    Raises ValueError (with the reason) when the job holds no latencies at RATE."""
    run_dir = Path(run_dir)
    requests = _read_requests(run_dir) if pooled else None
    point: dict = {}
    if requests is not None and len(requests):
        finite = requests[np.isfinite(requests["ttft_s"]) & np.isfinite(requests["e2e_s"])]
        for stat, column, q in STATS:
            point[stat] = float(np.percentile(finite[column], q))
            point[f"{stat}_per_seed"] = finite.groupby("seed")[column].quantile(q / 100).tolist()
        point.update(requests=len(requests), unfinished=len(requests) - len(finite),
                     source="per-request latencies pooled over seeds")
        return point
    per_rate = pd.read_csv(run_dir / "sim_per_rate.csv")
    rows = per_rate[np.isclose(per_rate["rate"], RATE)]
    if not len(rows):
        raise ValueError(f"its sim_per_rate.csv has no row at {RATE:g} req/s")
    for stat, _, _ in STATS:
        values = rows[f"{stat}_s"].to_numpy(dtype=np.float64)
        point[stat], point[f"{stat}_per_seed"] = float(values.mean()), values.tolist()
    point.update(requests=int(rows["num_requests"].sum()), unfinished=int(rows["unfinished"].sum()) if "unfinished" in rows else 0,
                 source="mean over seeds of each seed's statistic (no per-request file)")
    return point


def _job_config(run_dir: str) -> dict:
    return json.loads((Path(run_dir) / "metrics.json").read_text(encoding="utf-8"))["config"]


def table2_frame(summary: pd.DataFrame, experiment: str = EXPERIMENT) -> pd.DataFrame:
    """One row per (model, input length) of `experiment`'s jobs: ours in ms per system and statistic, the
    reductions both ways (pooled statistic; per-seed min and max), the requests behind each point, and the paper's
    raw values and reductions beside them. Empty when no job of `experiment` is found."""
    jobs = summary[summary["experiment"] == experiment] if len(summary) else summary
    points = []
    for _, job in jobs.iterrows():
        if job.get("system") not in SYSTEMS:
            continue
        try:
            cfg = _job_config(job["run_dir"])
            point = job_point(job["run_dir"])
        except (OSError, ValueError, KeyError) as error:  # one unreadable job leaves a gap, not a crash
            log.warning("table 2: skipped the job at %s (%s).", job["run_dir"], error)
            continue
        shape = str(job.get("sim_shape", cfg.get("sim", {}).get("shape", {}).get("name")))
        points.append(dict(point, model=SHAPE_NAMES.get(shape, shape), input=cfg["workload"].get("input_len"),
                           system=job["system"], run_dir=job["run_dir"], routing=cfg["model"].get("name")))
    if not points:
        return pd.DataFrame()
    points = pd.DataFrame(points)
    repeated = points[points.duplicated(["model", "input", "system"], keep=False)]
    if len(repeated):
        raise ReproError(f"experiment {experiment} holds several jobs for one model, input length and system (e.g. "
                         f"{sorted(repeated['run_dir'])[:2]}); give the variant its own name= so the table reads one.")
    paper = paper_reductions().set_index(["model", "input"])
    rows = []
    for (model, input_len), group in points.groupby(["model", "input"], sort=True, dropna=False):
        if group["source"].nunique() > 1:  # some jobs kept per-request latencies, some not: per-seed for all
            group = group.assign(**pd.DataFrame([job_point(d, pooled=False) for d in group["run_dir"]],
                                                index=group.index))
        by = group.set_index("system")
        row = {"model": model, "input": input_len, "routing": by["routing"].iloc[0],
               "requests_per_system": int(by["requests"].min()), "source": by["source"].iloc[0],
               "missing": ",".join(s for s in SYSTEMS if s not in by.index)}
        for stat, _, _ in STATS:
            for system in SYSTEMS:
                row[f"{stat}_{system}_ms"] = by.at[system, stat] * 1e3 if system in by.index else np.nan
            if set(SYSTEMS) <= set(by.index):
                base = np.array([by.at[b, stat] for b in BASELINES])
                row[f"{stat}_quoted"], row[f"{stat}_vs_best"] = (float(v) for v in reductions(base, by.at["semmoe", stat]))
                seeds = [np.asarray(by.at[s, f"{stat}_per_seed"], dtype=np.float64) for s in SYSTEMS]
                if len({len(v) for v in seeds}) == 1 and len(seeds[0]) > 1:  # paired seeds: each seed's reduction
                    quoted_S, vs_best_S = reductions(np.stack(seeds[:2], axis=-1), seeds[2])
                    row[f"{stat}_quoted_seed_min"], row[f"{stat}_quoted_seed_max"] = quoted_S.min(), quoted_S.max()
                    row[f"{stat}_vs_best_seed_min"], row[f"{stat}_vs_best_seed_max"] = vs_best_S.min(), vs_best_S.max()
            key = (model, input_len)
            for system in SYSTEMS:
                row[f"paper_{stat}_{system}_ms"] = paper.at[key, f"{stat}_{system}"] if key in paper.index else np.nan
            for way in ("quoted", "vs_best"):
                row[f"paper_{stat}_{way}"] = paper.at[key, f"{stat}_{way}"] if key in paper.index else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def _pct(value: float) -> str:
    return "n/a" if not np.isfinite(value) else f"{100 * value:+.1f} %"


def _pct_range(row: pd.Series, stat: str, way: str) -> str:
    text = _pct(row.get(f"{stat}_{way}", np.nan))
    low, high = row.get(f"{stat}_{way}_seed_min", np.nan), row.get(f"{stat}_{way}_seed_max", np.nan)
    if np.isfinite(low) and np.isfinite(high):
        text += f" [{100 * low:+.1f}, {100 * high:+.1f}]"
    return text


def _ms(values) -> str:
    return " / ".join("n/a" if not np.isfinite(v) else f"{v:.2f}" for v in values)


def markdown_rows(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(TTFT table, E2E table) for the report: ours and the paper's ms (ep / MoETuner / Sem-MoE), gains both ways."""
    tables = []
    for stat, label in (("ttft_p99", "p99 TTFT"), ("e2e_p50", "median E2E")):
        out = pd.DataFrame({"model": frame["model"], "input": frame["input"]})
        out[f"ours {label} ms (ep / MoETuner / Sem-MoE)"] = [
            _ms(r[[f"{stat}_{s}_ms" for s in SYSTEMS]].astype(float)) for _, r in frame.iterrows()]
        out[f"paper {label} ms (SGLang / MoETuner / Sem-MoE)"] = [
            _ms(r[[f"paper_{stat}_{s}_ms" for s in SYSTEMS]].astype(float)) for _, r in frame.iterrows()]
        out["ours quoted (worse / Sem-MoE - 1) [seeds]"] = [_pct_range(r, stat, "quoted") for _, r in frame.iterrows()]
        out["paper quoted"] = frame[f"paper_{stat}_quoted"].map(_pct)
        out["ours vs best (1 - Sem-MoE / best) [seeds]"] = [_pct_range(r, stat, "vs_best") for _, r in frame.iterrows()]
        out["paper vs best"] = frame[f"paper_{stat}_vs_best"].map(_pct)
        tables.append(out)
    return tables[0], tables[1]


def table2_section(summary: pd.DataFrame, out_dir: str | Path, experiment: str = EXPERIMENT) -> list[str]:
    """Markdown lines of the report's Table 2 section ([] when `experiment` has no jobs); writes out_dir/table2.csv."""
    frame = table2_frame(summary, experiment)
    if not len(frame):
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "table2.csv", lambda p: frame.to_csv(p, index=False))
    ttft, e2e = markdown_rows(frame)
    sources = sorted(set(frame["source"]))
    missing = [f"{r['model']} {r['input']}: {r['missing']}" for _, r in frame.iterrows() if r["missing"]]
    lines = [
        "## Table 2: Attention-TP latency at the paper's setting (1 req/s, inputs of 256 / 512 / 1,024 tokens)", "",
        f"From `{experiment}` (conf/experiment/{experiment}.yaml): each input is real MMLU text, consecutive "
        "questions' token ids concatenated and the last one truncated to exactly the input length "
        "(`workload.input_len`); `ep` is vanilla EP (the paper's SGLang + DeepEP). Routing: synthetic routers "
        f"shaped like each model ({', '.join(sorted(set(frame['routing'])))}), not the real models'; simulated "
        "absolute times are uncalibrated, so compare the gains. Statistic: " + "; ".join(sources) + f"; at least "
        f"{int(frame['requests_per_system'].min())} requests per system and point. Gains are read both ways "
        "(reference/paper.md, R5): *quoted* = worse baseline / Sem-MoE - 1 (how the paper's percentages come out), "
        "*vs best* = 1 - Sem-MoE / best baseline; positive = Sem-MoE faster; brackets: min and max over seeds.", "",
        "**p99 TTFT**", "", markdown_table(ttft), "",
        "**Median E2E latency**", "", markdown_table(e2e), "",
        f"Every number of this table: `{(out_dir / 'table2.csv').name}`.", "",
    ]
    if missing:
        lines[3:3] = ["**Missing jobs** (their cells read n/a): " + "; ".join(missing) + ".", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(prog="python -m repro.figures.table2", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs", help="the runs directory (read only)")
    parser.add_argument("--out", default="figures", help="where table2.csv goes")
    parser.add_argument("--experiment", default=EXPERIMENT)
    args = parser.parse_args(argv)
    try:
        lines = table2_section(read_jobs(args.runs)[0], args.out, args.experiment)
    except ReproError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not lines:
        print(f"error: no finished job of experiment {args.experiment} under {args.runs}; run `python -m repro.run -m "
              f"experiment={args.experiment}` first.", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
