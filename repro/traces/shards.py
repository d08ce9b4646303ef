"""Sharded routing traces: one trace made of several trace directories, read without copying their arrays.

A sharded trace is a folder holding `shards.json`:

    {"format": "repro-sharded-trace", "version": 1, "shards": ["part-000", "../hour-01/trace", ...]}

Each entry is a normal trace directory (repro.traces.format), a path relative to the folder (or absolute), in
request order: the sharded trace's requests are shard 0's, then shard 1's, ... Every shard has the same model,
num_experts, top_k, layer_ids, dense_layers, vocab_size and tokenizer, all or none have gate weights, and no
request id appears in two shards. The meta is shard 0's, its dataset the shards' distinct datasets joined by
"+" (as concat_traces does); so trace_digest of a sharded trace equals that of its concatenation.

    python -m repro.traces.shards combine OUT SHARD [SHARD ...] [--overwrite]

writes OUT/shards.json listing the shard directories by relative path (nothing is copied or linked); the shards
are read and checked first, and nothing is written when one is refused.

`read_trace` reads a sharded folder too (it returns a RoutingTrace whose token_ids, experts and weights are
`ConcatArray`s: read-only row concatenations that index only the shards concerned and materialise on
np.asarray), so every reader (split, affinity, systems, evaluator, simulator, run.py) accepts it.

Legend: S shards, R requests, N tokens, L MoE layers, k experts per token.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from repro import cli
from repro.atomic import atomic_write_text
from repro.errors import ReproError, TraceError
from repro.traces.format import combine_shards, read_sharded_trace, read_trace  # noqa: F401 (read_sharded_trace: public here too)
from repro.traces.manifest import MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION, is_sharded, manifest_shards  # noqa: F401


def write_manifest(out: str | os.PathLike, shard_dirs: list, overwrite: bool = False) -> Path:
    """Check the shards combine (reading each), then write out/shards.json listing them by relative path.

    Nothing is copied or linked. `out` may be absent or an empty folder, or hold only a previous shards.json when
    `overwrite` (--overwrite) says to replace it; anything else there is refused, and nothing is written when a
    shard is refused.
    """
    out = Path(out)
    if not shard_dirs:
        raise TraceError("combine needs at least one shard directory.")
    if out.exists() and (not out.is_dir() or any(p.name != MANIFEST for p in out.iterdir())):
        raise TraceError(f"{out} exists and holds more than a {MANIFEST}; choose a new or empty folder for the manifest.")
    if (out / MANIFEST).exists() and not overwrite:
        raise TraceError(f"{out / MANIFEST} exists; pass --overwrite to replace it, or choose a new folder.")
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
    parser = cli.ArgumentParser(prog="python -m repro.traces.shards", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    combine = sub.add_parser("combine", help="write OUT/shards.json over existing trace directories (no copies)")
    combine.add_argument("out")
    combine.add_argument("shards", nargs="+")
    combine.add_argument("--overwrite", action="store_true", help="replace an existing OUT/shards.json")
    args = parser.parse_args(argv)
    try:
        out = write_manifest(args.out, args.shards, args.overwrite)
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # an unwritable OUT
        print(f"error: cannot write {Path(args.out) / MANIFEST} ({e.strerror or e}); choose a writable folder.", file=sys.stderr)
        return 1
    print(f"{out / MANIFEST}: {len(args.shards)} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
