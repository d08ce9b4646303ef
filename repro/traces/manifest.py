"""The manifest of a sharded routing trace (`shards.json`; repro.traces.shards has the whole story): reading it and
telling a sharded folder from a plain trace. Below repro.traces.format, which reads sharded folders through it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from repro.errors import TraceError

MANIFEST = "shards.json"
MANIFEST_FORMAT = "repro-sharded-trace"
MANIFEST_VERSION = 1
# meta fields every shard must share (the rest, e.g. source or extra, is provenance and may differ)
SHARED_META = ("model", "num_experts", "top_k", "layer_ids", "dense_layers", "vocab_size", "tokenizer", "format_version")


def is_sharded(path: str | os.PathLike) -> bool:
    """True when `path` is a folder holding a shards.json manifest."""
    return (Path(path) / MANIFEST).is_file()


def manifest_shards(path: str | os.PathLike) -> list[Path]:
    """The shard directories listed in path/shards.json, in order (relative entries resolved against `path`)."""
    path = Path(path)
    where = path / MANIFEST
    try:
        manifest = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{where} cannot be read as JSON ({e}); re-create it with python -m repro.traces.shards combine.") from e
    shards = manifest.get("shards") if isinstance(manifest, dict) else None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != MANIFEST_FORMAT
        or manifest.get("version") != MANIFEST_VERSION
        or not isinstance(shards, list)
        or not shards
        or not all(isinstance(s, str) and s for s in shards)
    ):
        raise TraceError(
            f"{where} is not a version-{MANIFEST_VERSION} {MANIFEST_FORMAT} manifest with a non-empty list of shard "
            "paths; re-create it with python -m repro.traces.shards combine."
        )
    return [path / s for s in shards]
