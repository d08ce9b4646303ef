"""Sharded routing traces: one trace made of several trace directories, read without copying their arrays.

A sharded trace is a folder holding `shards.json`:

    {"format": "repro-sharded-trace", "version": 1, "shards": ["part-000", "../hour-01/trace", ...]}

Each entry is a normal trace directory (repro.traces.format), a path relative to the folder (or absolute), in
request order: the sharded trace's requests are shard 0's, then shard 1's, ... Every shard has the same model,
num_experts, top_k, layer_ids, dense_layers, vocab_size and tokenizer, all or none have gate weights, and no
request id appears in two shards. The meta is shard 0's, its dataset the shards' distinct datasets joined by
"+" (as concat_traces does); so trace_digest of a sharded trace equals that of its concatenation.

    python -m repro.traces.shards combine OUT SHARD [SHARD ...]

writes OUT/shards.json listing the shard directories by relative path (nothing is copied or linked); the shards
are read and checked first, and nothing is written when one is refused.

`read_trace` reads a sharded folder too (it returns a RoutingTrace whose token_ids, experts and weights are
`ConcatArray`s: read-only row concatenations that index only the shards concerned and materialise on
np.asarray), so every reader (split, affinity, systems, evaluator, simulator, run.py) accepts it.

Legend: S shards, R requests, N tokens, L MoE layers, k experts per token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from repro.atomic import atomic_write_text
from repro.errors import ReproError, TraceError
from repro.traces.arrays import ConcatArray

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


def combine_shards(shards: list, names: list[str]):
    """One RoutingTrace over `shards` (RoutingTraces in request order), refusing mismatched meta or request ids.

    names[i] names shard i in messages. Arrays are not copied: token_ids, experts and weights are
    ConcatArrays over the shards' arrays; offsets int64[R+1] and prefill_len int32[R] are concatenated.
    """
    from repro.traces.format import RoutingTrace  # format imports this module to dispatch read_trace

    first = shards[0].meta
    for name, trace in zip(names[1:], shards[1:], strict=True):
        for field in SHARED_META:
            if getattr(trace.meta, field) != getattr(first, field):
                raise TraceError(
                    f"{name} has {field}={getattr(trace.meta, field)!r} but {names[0]} has {getattr(first, field)!r}; "
                    "every shard of a sharded trace must come from the same model and tokenizer."
                )
        if (trace.weights is None) != (shards[0].weights is None):
            raise TraceError(
                f"{name} {'lacks' if trace.weights is None else 'has'} gate weights but {names[0]} "
                f"{'has' if shards[0].weights is not None else 'lacks'} them; all shards or none must carry weights.npy."
            )
    owner: dict[str, int] = {}
    for index, trace in enumerate(shards):
        for request_id in trace.request_ids:
            if owner.setdefault(request_id, index) != index:
                raise TraceError(
                    f"request id {request_id!r} is in both {names[owner[request_id]]} and {names[index]}; request ids "
                    "must be unique across shards (re-export one capture with distinct ids)."
                )
    lengths = np.concatenate([t.lengths() for t in shards])
    datasets = sorted({t.meta.dataset for t in shards})
    return RoutingTrace(
        meta=replace(first, dataset="+".join(datasets)),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        token_ids=ConcatArray([t.token_ids for t in shards]),
        experts=ConcatArray([t.experts for t in shards]),
        prefill_len=np.concatenate([t.prefill_len for t in shards]).astype(np.int32),
        request_ids=tuple(i for t in shards for i in t.request_ids),
        request_datasets=tuple(d for t in shards for d in t.request_datasets),
        request_labels=tuple(x for t in shards for x in t.request_labels),
        weights=None if shards[0].weights is None else ConcatArray([t.weights for t in shards]),
    )


def read_sharded_trace(path: str | os.PathLike, mmap: bool = True):
    """The sharded trace at `path` (see the module docstring); each shard is read and validated by read_trace."""
    from repro.traces.format import read_trace

    path = Path(path)
    shard_dirs = manifest_shards(path)
    shards = []
    for shard_dir in shard_dirs:
        if is_sharded(shard_dir):
            raise TraceError(f"shard {shard_dir} of {path} is itself sharded; list its shards in {path / MANIFEST} instead.")
        if not shard_dir.is_dir():
            raise TraceError(f"shard {shard_dir} listed in {path / MANIFEST} is missing; restore it or re-create the manifest.")
        shards.append(read_trace(shard_dir, mmap=mmap))
    return combine_shards(shards, [f"shard {s}" for s in shard_dirs])


def write_manifest(out: str | os.PathLike, shard_dirs: list) -> Path:
    """Check the shards combine (reading each), then write out/shards.json listing them by relative path.

    Nothing is copied or linked. `out` may be absent or an empty folder or hold only a previous shards.json;
    anything else there is refused, and nothing is written when a shard is refused.
    """
    out = Path(out)
    if not shard_dirs:
        raise TraceError("combine needs at least one shard directory.")
    if out.exists() and (not out.is_dir() or any(p.name != MANIFEST for p in out.iterdir())):
        raise TraceError(f"{out} exists and holds more than a {MANIFEST}; choose a new or empty folder for the manifest.")
    from repro.traces.format import read_trace

    for shard_dir in shard_dirs:
        if is_sharded(shard_dir):
            raise TraceError(f"shard {shard_dir} is itself sharded; pass its shard directories instead.")
    combine_shards([read_trace(s) for s in shard_dirs], [f"shard {s}" for s in shard_dirs])
    out.mkdir(parents=True, exist_ok=True)
    entries = [os.path.relpath(Path(s).resolve(), out.resolve()) for s in shard_dirs]
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "shards": entries}
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m repro.traces.shards", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    combine = sub.add_parser("combine", help="write OUT/shards.json over existing trace directories (no copies)")
    combine.add_argument("out")
    combine.add_argument("shards", nargs="+")
    args = parser.parse_args(argv)
    try:
        out = write_manifest(args.out, args.shards)
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{out / MANIFEST}: {len(args.shards)} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
