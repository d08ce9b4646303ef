"""The job folder name under runs/<name>/, as the Hydra resolver `job_dirname` that conf/config.yaml's
hydra.run.dir and hydra.sweep.subdir use. Every entry point composing that config (repro.run, repro.exec)
imports this module, so the resolver is registered before Hydra resolves its run dir."""

from __future__ import annotations

import hashlib
from pathlib import Path

from omegaconf import OmegaConf


def trace_label(path: str) -> str:
    """`<folder name>-<8 hex>`: the name a user recognises plus a digest of the resolved absolute path, so two
    traces in different folders with the same name (/a/good, /b/good) never share a job folder."""
    resolved = Path(str(path)).expanduser().resolve()
    return f"{resolved.name}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:8]}"


def job_dirname(override_dirname: str, trace: str | None, profile_trace: str | None) -> str:
    """Hydra's override string, with `trace` / `profile_trace` named by trace_label.

    (`trace` and `profile_trace` are excluded from override_dirname, so an absolute path never nests folders.)
    """
    parts = [f"trace={trace_label(trace)}"] if trace else []
    parts += [f"profile_trace={trace_label(profile_trace)}"] if profile_trace else []
    parts += [override_dirname] if override_dirname else []
    return ",".join(parts)


OmegaConf.register_new_resolver("job_dirname", job_dirname, replace=True)
