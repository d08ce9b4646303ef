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
