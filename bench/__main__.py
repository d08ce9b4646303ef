"""Run the benchmarks and write their results to files.

    python -m bench [--out bench/results] [--only NAME ...] [--quick]

Every module bench/bench_<name>.py exposes `run(quick: bool) -> dict` whose numbers are all measured on this
machine in this process. Each result goes to <out>/<name>.json (written atomically, with the machine it ran on)
and <out>/SUMMARY.md is rebuilt from every <name>.json in <out>, so `--only` refreshes one row group and keeps the
others. Exit status 1 when a benchmark raised (its error is recorded in its JSON), 2 for a bad command line.
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import os
import pkgutil
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from repro import cli
from repro.atomic import atomic_write_text

PREFIX = "bench_"
# --only NAME runs these modules together (issue 19: the trace benchmarks are the import and the fit at scale)
GROUPS = {"traces": ["traces", "fit_scale"]}


def discover() -> list[str]:
    """Names (without the bench_ prefix) of the benchmark modules in this package, sorted."""
    here = Path(__file__).resolve().parent
    return sorted(m.name[len(PREFIX) :] for m in pkgutil.iter_modules([str(here)]) if m.name.startswith(PREFIX))


def machine() -> dict:
    """Where the numbers were measured."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def run_one(name: str, quick: bool) -> dict:
    """Import bench_<name>, run it, and wrap its results (or its error) with context."""
    record: dict = {
        "name": name,
        "quick": quick,
        "started_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
    }
    start = time.perf_counter()
    try:
        module = importlib.import_module(f"bench.{PREFIX}{name}")
        record["results"] = module.run(quick=quick)
        record["ok"] = True
    except Exception as e:  # a failing benchmark must not hide the others; its error is kept in its file
        record["ok"] = False
        record["error"] = f"{type(e).__name__}: {e}"
        record["traceback"] = traceback.format_exc()
    record["elapsed_s"] = round(time.perf_counter() - start, 3)
    return record


def flatten(results: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists are kept as JSON text."""
    flat: dict = {}
    for key, value in results.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, list | tuple):
            flat[name] = json.dumps(value)
        else:
            flat[name] = value
    return flat


def fmt(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return str(value).replace("|", "\\|")


def is_case_table(value) -> bool:
    """A dict of dicts (e.g. {"case name": {metric: value}}) reads best as a table with one row per case."""
    return isinstance(value, dict) and bool(value) and all(isinstance(v, dict) for v in value.values())


def summary_markdown(records: list[dict]) -> str:
    """One section per benchmark: scalar metrics as metric | value rows, case groups as their own tables."""
    lines = ["# Benchmark results", ""]
    if records:
        m = records[0]["machine"]
        lines += [
            f"Machine: {m['processor']}, {m['cpu_count']} CPUs ({m['cpus_usable']} usable), {m['platform']}, "
            f"Python {m['python']}, numpy {m['numpy']}.",
            "",
        ]
    for rec in records:
        mode = "quick" if rec.get("quick") else "full"
        lines += [f"## {rec['name']} ({mode}, {rec.get('started_utc', '?')}, {rec.get('elapsed_s', 0):.1f} s)", ""]
        if not rec.get("ok"):
            lines += [f"ERROR: {rec.get('error', 'unknown error')}", ""]
            continue
        results = rec["results"]
        scalars = {k: v for k, v in results.items() if not is_case_table(v)}
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {key} | {fmt(value)} |" for key, value in flatten(scalars).items()]
        lines.append("")
        for group, cases in results.items():
            if not is_case_table(cases):
                continue
            rows = {name: flatten(case) for name, case in cases.items()}
            columns = list(dict.fromkeys(col for row in rows.values() for col in row))
            lines += [f"### {rec['name']}: {group}", "", "| case | " + " | ".join(columns) + " |"]
            lines.append("|---" * (len(columns) + 1) + "|")
            for name, row in rows.items():
                lines.append(f"| {name} | " + " | ".join(fmt(row.get(col, "")) for col in columns) + " |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    available = discover()
    parser = cli.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results", help="directory for <name>.json and SUMMARY.md")
    parser.add_argument("--only", action="append", metavar="NAME", help=f"run only these ({', '.join(available)})")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats (well under a minute)")
    args = parser.parse_args(argv)
    names = available
    if args.only:
        names = [m for n in args.only for m in GROUPS.get(n.removeprefix(PREFIX), [n.removeprefix(PREFIX)])]
        unknown = sorted(set(names) - set(available))
        if unknown:
            print(f"error: unknown benchmark {', '.join(unknown)}; choose from {', '.join(available)}.", file=sys.stderr)
            return 2
    out = Path(args.out)
    failed = False
    for name in names:
        print(f"bench {name} ({'quick' if args.quick else 'full'}) ...", flush=True)
        record = run_one(name, args.quick)
        atomic_write_text(out / f"{name}.json", json.dumps(record, indent=1, default=float) + "\n")
        if record["ok"]:
            print(f"  done in {record['elapsed_s']:.1f} s -> {out / (name + '.json')}")
        else:
            failed = True
            print(f"  FAILED: {record['error']}", file=sys.stderr)
    records = []
    for path in sorted(out.glob("*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # a foreign or damaged file is not ours to summarise
    atomic_write_text(out / "SUMMARY.md", summary_markdown([r for r in records if "name" in r and "machine" in r]))
    print(f"summary -> {out / 'SUMMARY.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
