"""Partial count tables: profile each shard of a sharded trace in its own job, then merge the tables exactly.

    python -m repro.affinity.partial count --trace T --shard I --out parts/I.npz [--prompt-only]
    python -m repro.affinity.partial merge --trace T --out merged.npz [--overwrite] parts/*.npz

`count` reads shard I of the sharded trace T (repro.traces.shards; a plain trace is one shard, I = 0) in chunks
and writes its sparse token -> expert counts; `merge` checks that the partials are one per shard of T (each
stores T's identity and its shard index) and sums them. Counts are integers, so the merged table equals the
single-process `token_expert_counts(read_trace(T))` exactly, whatever the sharding. Everything is saved and
loaded with allow_pickle=False and written atomically (a refused merge writes nothing). On a cluster the
count jobs are independent: a SLURM job array (one task per shard), or a Hydra multirun over the shard index.

A table (partial or merged) is an .npz of plain arrays:
    identity <U64 (scalar)  sha256 of T's shards (meta.json, requests.json, offsets.npy, sampled routing)
    shards int64[P]         the shard indices it covers (one for a partial, all for a merged table)
    num_shards int64, num_layers int64, num_experts int64, prompt_only bool
    token_vocab int32[t]    sorted token ids seen; occurrences int64[t] tokens per id
    layer int64[nnz], row int64[nnz], expert int64[nnz], count int64[nnz]: nonzero (layer, token row, expert)
                            activation counts, sorted by (layer, row, expert)

Legend: S shards, L MoE layers, E experts, t distinct token ids, nnz nonzero cells.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import zipfile
from pathlib import Path

import numpy as np

from repro.affinity.tables import profile_chunks, profile_tokens, profile_vocab
from repro.atomic import atomic_write
from repro.errors import ReproError, TraceError
from repro.traces import RoutingTrace, read_trace
from repro.traces.manifest import is_sharded, manifest_shards

FIELDS = ("identity", "shards", "num_shards", "num_layers", "num_experts", "prompt_only", "token_vocab",
          "occurrences", "layer", "row", "expert", "count")
MERGE_EVERY = 8  # chunks whose sparse counts are collected before they are re-summed (bounds the COO lists)


def shard_dirs(trace_path: str | Path) -> list[Path]:
    """The trace directories of `trace_path`: its shards in order, or [trace_path] for a plain trace."""
    return manifest_shards(trace_path) if is_sharded(trace_path) else [Path(trace_path)]


IDENTITY_FILES = ("meta.json", "requests.json", "offsets.npy")
ROUTING_FILES = ("experts.npy", "weights.npy")  # sampled: another capture of the same requests differs there
ROUTING_SAMPLES, SAMPLE_BYTES = 256, 4096


def trace_identity(trace_path: str | Path) -> str:
    """sha256 (hex), in shard order, of each shard's meta.json, requests.json and offsets.npy, and of the size and
    256 evenly spaced 4 KiB blocks of its experts.npy (and weights.npy): the same for every copy of one sharded
    trace, different for another capture, even of the same requests and tokens; cheap (at most 1 MiB of routing
    read per shard)."""
    h = hashlib.sha256()
    for directory in shard_dirs(trace_path):
        for name in IDENTITY_FILES + ROUTING_FILES:
            try:
                if name in IDENTITY_FILES:
                    h.update((directory / name).read_bytes())
                elif (directory / name).exists():
                    h.update(sampled_bytes(directory / name))
            except OSError as e:
                raise TraceError(f"cannot read {directory / name} ({e.strerror}); is {trace_path} a complete trace?") from e
    return h.hexdigest()


def sampled_bytes(path: Path) -> bytes:
    """The file's size and ROUTING_SAMPLES evenly spaced blocks of SAMPLE_BYTES (the whole file when smaller)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= ROUTING_SAMPLES * SAMPLE_BYTES:
            return str(size).encode() + f.read()
        blocks = [str(size).encode()]
        for start in np.linspace(0, size - SAMPLE_BYTES, ROUTING_SAMPLES).astype(np.int64).tolist():
            f.seek(start)
            blocks.append(f.read(SAMPLE_BYTES))
    return b"".join(blocks)


def sum_sparse(keys: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique keys int64[m], summed counts int64[m]) of keys int64[n] with counts int64[n]."""
    unique, inverse = np.unique(keys, return_inverse=True)
    return unique, np.bincount(inverse.ravel(), weights=counts, minlength=len(unique)).astype(np.int64)


def shard_counts(trace: RoutingTrace, prompt_only: bool = False) -> dict[str, np.ndarray]:
    """The sparse count table of one shard (fields as in the module docstring, without identity and shards)."""
    keep = profile_tokens(trace, prompt_only)
    token_vocab, occurrences = profile_vocab(trace, keep)
    num_layers, num_experts = trace.num_layers, trace.meta.num_experts
    cells = np.int64(len(token_vocab) * num_experts)  # key = layer x t x E + row x E + expert
    keys, counts, pending = np.zeros(0, np.int64), np.zeros(0, np.int64), []
    for _, token_ids, experts in profile_chunks(trace, keep):
        row = np.searchsorted(token_vocab, token_ids).astype(np.int64)
        chunk = (np.arange(num_layers, dtype=np.int64)[None, :, None] * cells + row[:, None, None] * num_experts
                 + experts.astype(np.int64)).ravel()
        pending.append(np.unique(chunk, return_counts=True))
        if len(pending) >= MERGE_EVERY:
            keys, counts = sum_sparse(np.concatenate([keys, *(k for k, _ in pending)]),
                                      np.concatenate([counts, *(c for _, c in pending)]))
            pending = []
    keys, counts = sum_sparse(np.concatenate([keys, *(k for k, _ in pending)]),
                              np.concatenate([counts, *(c for _, c in pending)]))
    return {
        "num_layers": np.int64(num_layers), "num_experts": np.int64(num_experts), "prompt_only": np.bool_(prompt_only),
        "token_vocab": token_vocab, "occurrences": occurrences,
        "layer": keys // cells, "row": keys % cells // num_experts, "expert": keys % num_experts, "count": counts,
    }


def count_shard(trace_path: str | Path, shard: int, out: str | Path, prompt_only: bool = False) -> Path:
    """Write the partial table of shard `shard` of the trace at trace_path to `out` (atomically)."""
    dirs = shard_dirs(trace_path)
    if not 0 <= shard < len(dirs):
        raise TraceError(f"shard {shard} is not one of the {len(dirs)} shards of {trace_path} (0..{len(dirs) - 1}).")
    table = shard_counts(read_trace(dirs[shard]), prompt_only)
    table.update(identity=np.str_(trace_identity(trace_path)), shards=np.array([shard], dtype=np.int64),
                 num_shards=np.int64(len(dirs)))
    return save_table(table, out)


def save_table(table: dict[str, np.ndarray], out: str | Path) -> Path:
    out = Path(out)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: np.savez would append .npz to a temporary name
            np.savez(f, **{name: table[name] for name in FIELDS})

    atomic_write(out, write)
    return out


def load_table(path: str | Path) -> dict[str, np.ndarray]:
    """A partial or merged table saved by this module (allow_pickle=False); refused with one sentence otherwise."""
    try:
        with np.load(path, allow_pickle=False) as data:
            table = {name: data[name] for name in FIELDS}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:  # truncated: BadZipFile
        raise TraceError(
            f"{path} is not a count table written by repro.affinity.partial ({e}); re-run its count job."
        ) from e
    return table


def merge_tables(trace_path: str | Path, paths: list) -> dict[str, np.ndarray]:
    """The sum of the partial tables at `paths`, which must be exactly one per shard of the trace at trace_path."""
    identity, dirs = trace_identity(trace_path), shard_dirs(trace_path)
    tables = [load_table(p) for p in paths]
    seen: dict[int, str] = {}
    for path, table in zip(paths, tables, strict=True):
        if str(table["identity"]) != identity or int(table["num_shards"]) != len(dirs):
            raise TraceError(
                f"{path} was counted on another trace than {trace_path} (its identity differs); re-run its count job "
                "on this trace."
            )
        if bool(table["prompt_only"]) != bool(tables[0]["prompt_only"]):
            raise TraceError(f"{path} has prompt_only={bool(table['prompt_only'])} unlike {paths[0]}; count all shards alike.")
        for shard in table["shards"].tolist():
            if shard in seen:
                raise TraceError(f"shard {shard} is counted in both {seen[shard]} and {path}; pass each partial once.")
            seen[shard] = str(path)
    missing = sorted(set(range(len(dirs))) - set(seen))
    if missing:
        raise TraceError(f"no partial table covers shard {missing[0]} of {trace_path} ({len(missing)} missing); run its count job.")
    vocab = np.unique(np.concatenate([t["token_vocab"] for t in tables])).astype(np.int32)
    num_layers, num_experts = int(tables[0]["num_layers"]), int(tables[0]["num_experts"])
    cells = np.int64(len(vocab) * num_experts)
    occurrences = np.zeros(len(vocab), dtype=np.int64)
    keys, counts = [], []
    for t in tables:
        global_row = np.searchsorted(vocab, t["token_vocab"])
        occurrences[global_row] += t["occurrences"]
        keys.append(t["layer"] * cells + global_row[t["row"]] * num_experts + t["expert"])
        counts.append(t["count"])
    keys, summed = sum_sparse(np.concatenate(keys), np.concatenate(counts))
    return {
        "identity": np.str_(identity), "shards": np.arange(len(dirs), dtype=np.int64), "num_shards": np.int64(len(dirs)),
        "num_layers": np.int64(num_layers), "num_experts": np.int64(num_experts), "prompt_only": tables[0]["prompt_only"],
        "token_vocab": vocab, "occurrences": occurrences,
        "layer": keys // cells, "row": keys % cells // num_experts, "expert": keys % num_experts, "count": summed,
    }


def dense_counts(table: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(token_vocab int32[t], counts float32[L, t, E]): the table as `token_expert_counts` returns it."""
    counts = np.zeros((int(table["num_layers"]), len(table["token_vocab"]), int(table["num_experts"])), np.float64)
    counts[table["layer"], table["row"], table["expert"]] = table["count"]
    return table["token_vocab"], counts.astype(np.float32)


def check_out(out: str | Path, inputs: list, overwrite: bool) -> None:
    """Refuse an --out that would destroy data: not an .npz, one of the inputs, or (without --overwrite) an existing
    file; an existing input CSV was once silently replaced by the merged table."""
    out = Path(out)
    if out.suffix != ".npz":
        raise TraceError(f"--out {out} must end in .npz (a count table); choose another name.")
    if any(out.resolve() == Path(p).resolve() for p in inputs):
        raise TraceError(f"--out {out} is one of the partial tables being merged; write the merged table elsewhere.")
    if out.exists() and not overwrite:
        raise TraceError(f"--out {out} exists; pass --overwrite to replace it, or choose a new file.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m repro.affinity.partial", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    count = sub.add_parser("count", help="count one shard's token -> expert activations")
    count.add_argument("--trace", required=True)
    count.add_argument("--shard", type=int, required=True)
    count.add_argument("--out", required=True)
    count.add_argument("--prompt-only", action="store_true")
    merge = sub.add_parser("merge", help="sum one partial table per shard into one table")
    merge.add_argument("--trace", required=True)
    merge.add_argument("--out", required=True)
    merge.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    merge.add_argument("partials", nargs="+")
    args = parser.parse_args(argv)
    try:
        if args.command == "count":
            check_out(args.out, [], overwrite=True)  # a count job re-run replaces its own part
            out = count_shard(args.trace, args.shard, args.out, args.prompt_only)
        else:
            check_out(args.out, args.partials, args.overwrite)
            out = save_table(merge_tables(args.trace, args.partials), args.out)
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # an unwritable --out folder, a full disk
        print(f"error: cannot write {args.out} ({e.strerror or e}); choose a writable place.", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
