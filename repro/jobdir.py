"""Job folders: the name under runs/<name>/, as the Hydra resolver `job_dirname` that conf/config.yaml's
hydra.run.dir and hydra.sweep.subdir use (every entry point composing that config, repro.run and repro.exec,
imports this module, so the resolver is registered before Hydra resolves its run dir); a single run's config check
before Hydra creates its folder (check_run_config, for the Hydra callbacks); and the removal of a folder a refused
job left holding only Hydra's own files (remove_failed_job_dir)."""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from repro.errors import ReproError


def trace_label(path: str) -> str:
    """`<folder name>-<8 hex>`: the name a user recognises plus a digest of the resolved absolute path, so two
    traces in different folders with the same name (/a/good, /b/good) never share a job folder."""
    resolved = Path(str(path)).expanduser().resolve()
    return f"{resolved.name}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:8]}"


# file systems cap a name at 255 bytes; a job folder's name stays well under (its files' temporaries add a little)
MAX_NAME_BYTES = 200


def job_dirname(override_dirname: str, trace: str | None, profile_trace: str | None) -> str:
    """Hydra's override string, with `trace` / `profile_trace` named by trace_label.

    (`trace` and `profile_trace` are excluded from override_dirname, so an absolute path never nests folders.)
    A name longer than MAX_NAME_BYTES keeps its leading overrides up to a comma and ends in `digest=<12 hex>` of the
    whole string, so long sweeps still get one distinct folder per job instead of "File name too long".
    """
    parts = [f"trace={trace_label(trace)}"] if trace else []
    parts += [f"profile_trace={trace_label(profile_trace)}"] if profile_trace else []
    parts += [override_dirname] if override_dirname else []
    name = ",".join(parts)
    if len(name.encode()) <= MAX_NAME_BYTES:
        return name
    digest = f"digest={hashlib.sha256(name.encode()).hexdigest()[:12]}"
    head = name.encode()[: MAX_NAME_BYTES - len(digest) - 1].decode(errors="ignore")
    head = head[: head.rfind(",")] if "," in head else head
    return f"{head},{digest}"


OmegaConf.register_new_resolver("job_dirname", job_dirname, replace=True)


# ---- job folders of refused or failed jobs (every Hydra entry point: run, tune, exec, count_job) ------------------


def check_run_config(config, check) -> None:
    """check(task) on a single run's resolved task config (no `hydra` node), before Hydra creates the run's folder;
    a refusal is one `error:` line and exit code 2 (a refused config left a job folder of Hydra's files behind)."""
    task = OmegaConf.to_container(config, resolve=False)
    task.pop("hydra", None)
    try:
        task = OmegaConf.to_container(OmegaConf.create(task), resolve=True)
    except OmegaConfBaseException:
        return  # an interpolation that does not resolve here: the job reports it itself
    try:
        check(task)
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def remove_failed_job_dir(out_dir: Path) -> None:
    """Remove the folder of a job that failed before writing anything: only Hydra's .hydra/ and its empty
    <job name>.log (run.log, tune.log, __main__.log, ...) are in it (a failed job left such folders behind). A folder
    with results or a non-empty log is kept."""
    try:
        hydra_only = all(p.name == ".hydra" or (p.suffix == ".log" and p.is_file() and p.stat().st_size == 0)
                         for p in out_dir.iterdir())
        if hydra_only:
            shutil.rmtree(out_dir, ignore_errors=True)
    except OSError:
        pass  # nothing to tidy, or not ours to tidy

