"""Finding and reading the finished jobs under a runs directory, for the report and the diff.

    summary, per_layer, skipped = read_jobs("runs")

A job counts when its metrics.json exists (repro.run publishes it last). Skipped without a word: the model cache
(`cache/`) and anything under a dot-prefixed folder (a job's `.staging-*` folder holds a run still being written,
or one killed mid-write). Skipped with one log warning and a SkippedJob each: a metrics.json (or its per_layer.csv)
that cannot be read or parsed, so one corrupt job never hides the others.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from repro.errors import ReproError

log = logging.getLogger("repro.figures")

# copied from a job's config into its summary row and each of its per_layer rows
PER_LAYER_KEYS = ("experiment", "run_dir", "devices", "attention", "system", "kind", "eval_workload", "workload",
                  "model_name", "job", "lookback")


@dataclass(frozen=True)
class SkippedJob:
    """A job whose files could not be read: where (its metrics.json) and why, in words."""

    metrics_path: Path
    reason: str

    def sentence(self) -> str:
        return f"skipped the job at {self.metrics_path.parent}: {self.reason}."


def find_job_files(runs_dir: str | Path, name: str = "metrics.json") -> list[Path]:
    """Sorted paths of the files called `name` (the jobs' metrics.json by default) under runs_dir, leaving out the
    model cache and dot-prefixed folders."""
    runs_dir = Path(runs_dir)
    found = []
    for path in sorted(runs_dir.rglob(name)):
        folders = path.relative_to(runs_dir).parts[:-1]
        if "cache" in folders or any(part.startswith(".") for part in folders):
            continue
        found.append(path)
    return found


def _refuse_non_finite(constant: str):
    """json's hook for NaN / Infinity: the suite writes strict JSON, so such a file was edited or written by another
    tool, and its NaN would read as a missing metric (figures.diff said "removed") or break a figure."""
    raise ValueError(f"metrics.json holds {constant}, which the suite never writes (strict JSON); rerun the job")


def check_out_dir(out: str | Path, flag: str = "--out") -> Path:
    """`out` as a folder to write into (absent, or a folder); one sentence when it is a file or sits where nothing
    can be created, before anything is read or written (nothing is created here: a later refusal leaves no folder)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ReproError(f"{flag} {out} is a file, not a folder; give a folder to write into.")
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ReproError(f"cannot write into {flag} {out}: {existing} is not a writable folder; choose another place.")
    return out


def _timings(path: Path) -> dict:
    """A job's wall-clock seconds (repro.run writes them beside metrics.json, which stays the same across runs);
    {} when absent or unreadable: they are measurements of the run, not results."""
    try:
        timings = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return timings if isinstance(timings, dict) else {}


def _job_row(metrics: Path) -> dict:
    """One summary row from a metrics.json; raises ValueError / KeyError / TypeError / OSError on a corrupt file."""
    data = json.loads(metrics.read_text(encoding="utf-8"), parse_constant=_refuse_non_finite)
    if not isinstance(data, dict) or not isinstance(data.get("summary"), dict) or not isinstance(data.get("config"), dict):
        raise ValueError("it is not a JSON object with a 'summary' and a 'config' object")
    cfg = data["config"]
    row = dict(data["summary"])
    row.update(_timings(metrics.parent / "timings.json"))
    row.update(
        experiment=cfg.get("name", "adhoc"),
        run_dir=str(metrics.parent),
        devices=cfg["parallel"]["devices"],
        attention=cfg["parallel"]["attention"],
        workload=cfg["workload"]["name"],
        eval_workload=(cfg.get("eval_workload") or cfg["workload"])["name"],
        model_name=cfg["model"]["name"],
        job=metrics.parent.name,
        lookback=(cfg["system"].get("params") or {}).get("lookback"),
    )
    row.setdefault("system", cfg["system"].get("name"))
    row.setdefault("kind", "system")
    row.setdefault("evaluate_split", "evaluate")
    return row


def _reason(error: Exception) -> str:
    if isinstance(error, json.JSONDecodeError):
        return f"metrics.json is not valid JSON ({error.msg} at line {error.lineno})"
    if isinstance(error, KeyError):
        return f"metrics.json lacks the key {error}"
    if isinstance(error, UnicodeDecodeError):
        return "metrics.json is not UTF-8 text"
    if isinstance(error, OSError):
        return f"it cannot be read ({error.strerror or error})"
    return str(error)


class _Unreadable(Exception):
    """A job's files cannot be read; the message says why."""


def _read_job(metrics: Path) -> tuple[dict, pd.DataFrame | None]:
    """(the job's summary row, its per_layer.csv or None); raises _Unreadable with the reason."""
    try:
        row = _job_row(metrics)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise _Unreadable(_reason(error)) from error
    per_layer = metrics.parent / "per_layer.csv"
    if not per_layer.exists():
        return row, None
    try:
        return row, pd.read_csv(per_layer)
    except (OSError, ValueError) as error:  # pandas' parser errors are ValueErrors
        raise _Unreadable(f"its per_layer.csv cannot be read ({str(error).strip().rstrip('.')})") from error


def read_jobs(runs_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame, list[SkippedJob]]:
    """(one row per finished job: summary + config keys + run_dir, one row per job and MoE layer, the jobs skipped
    because their files are corrupt or unreadable). Raises ReproError when no job could be read."""
    rows, layers, skipped = [], [], []
    for metrics in find_job_files(runs_dir):
        try:
            row, layer_rows = _read_job(metrics)
        except _Unreadable as error:
            skipped.append(SkippedJob(metrics, str(error)))
            log.warning("%s", skipped[-1].sentence())
            continue
        rows.append(row)
        if layer_rows is not None:
            layers.append(layer_rows.assign(**{key: row[key] for key in PER_LAYER_KEYS}))
    if not rows:
        why = (f" ({len(skipped)} skipped as unreadable, e.g. {skipped[0].metrics_path}: {skipped[0].reason})"
               if skipped else "")
        raise ReproError(f"no readable finished runs under {runs_dir}{why}; run `make reproduce` (or python -m "
                         "repro.run) first.")
    summary = pd.DataFrame(rows)
    # a flag column every job has comes back as numpy bools, for which `flag is True` is False: keep Python's (as a
    # column with gaps holds them), so the readers' `is True` / `is False` tests mean what they say
    flags = [c for c in summary.columns if summary[c].dtype == bool]
    summary[flags] = summary[flags].astype(object)
    return summary, pd.concat(layers, ignore_index=True) if layers else pd.DataFrame(), skipped


def load_runs(runs_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """read_jobs without the skipped list: (one row per finished job, one row per job and MoE layer)."""
    summary, per_layer, _ = read_jobs(runs_dir)
    return summary, per_layer


def planned_jobs(sweep_dir: str | Path) -> int | None:
    """How many jobs the Hydra multirun that wrote sweep_dir/multirun.yaml launched: the product of the sizes of
    its sweeper params and command-line sweeps (a command-line sweep replaces the param of the same key, as Hydra's
    basic sweeper does). None when there is no multirun.yaml or its sweep cannot be counted (e.g. glob())."""
    path = Path(sweep_dir) / "multirun.yaml"
    if not path.is_file():
        return None
    try:
        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        hydra = cfg.get("hydra") or {}
        params = [f"{k}={v}" for k, v in ((hydra.get("sweeper") or {}).get("params") or {}).items()]
        task = list((hydra.get("overrides") or {}).get("task") or [])
        sizes = {}
        for override in OverridesParser.create().parse_overrides(params + task):
            sweep = override.is_sweep_override()
            sizes[override.key_or_group] = len(list(override.sweep_string_iterator())) if sweep else 1
    except Exception as error:  # noqa: BLE001 (a sweep that cannot be counted is reported as unknown, not fatal)
        log.warning("cannot count the jobs of the sweep in %s (%s); its completeness is not checked.", path, error)
        return None
    return int(np.prod(list(sizes.values()), dtype=np.int64)) if sizes else 1


def sweep_notes(summary: pd.DataFrame, skipped: list[SkippedJob]) -> dict[str, str]:
    """{experiment: "partial sweep: n of N jobs finished (k skipped as unreadable)"} for each experiment whose
    sweep folders' multirun.yaml planned more jobs than the finished ones found in them."""
    notes = {}
    skipped_dirs = [job.metrics_path.parent.parent for job in skipped]
    for experiment, runs in summary.groupby("experiment", sort=True):
        sweep_dirs = sorted({Path(d).parent for d in runs["run_dir"]})
        planned = [planned_jobs(d) for d in sweep_dirs]
        if not any(n is not None for n in planned):
            continue
        counted = [d for d, n in zip(sweep_dirs, planned, strict=True) if n is not None]
        found = sum(Path(d).parent in counted for d in runs["run_dir"])
        total = sum(n for n in planned if n is not None)
        if found < total:
            unreadable = sum(d in counted for d in skipped_dirs)
            notes[experiment] = (f"partial sweep: {found} of the {total} jobs its multirun launched have finished"
                                 + (f" ({unreadable} skipped as unreadable)" if unreadable else ""))
    return notes


def skipped_lines(skipped: list[SkippedJob], runs_dir: str | Path) -> list[str]:
    """Markdown lines naming each skipped job (its folder relative to runs_dir) and why; [] when none was skipped."""
    if not skipped:
        return []
    lines = [f"**{len(skipped)} job(s) skipped** (unreadable files; rerun them or remove the folders):", ""]
    for job in skipped:
        try:
            where = job.metrics_path.parent.relative_to(runs_dir)
        except ValueError:
            where = job.metrics_path.parent
        lines.append(f"- `{where}`: {job.reason}.")
    return lines + [""]
