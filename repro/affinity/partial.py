"""Partial count tables: profile each shard of a sharded trace in its own job, then merge the tables exactly.

    python -m repro.affinity.partial count --trace T --shard I --out parts/I.npz [--prompt-only] [--overwrite]
    python -m repro.affinity.partial merge --trace T --out merged.npz [--overwrite] parts/*.npz

`count` reads shard I of the sharded trace T (repro.traces.shards; a plain trace is one shard, I = 0) in chunks
and writes its sparse token -> expert counts; `merge` checks that the partials are one per shard of T (each
stores T's identity, its shard index and the digest of the exact routing it counted) and sums them. Counts are
integers, so the merged table equals the single-process `token_expert_counts(read_trace(T))` exactly, whatever
the sharding. Everything is saved and loaded with allow_pickle=False and written atomically (a refused merge writes
nothing; an existing table is replaced only with --overwrite). On a cluster the count jobs are independent: a
SLURM job array (one task per shard), or a Hydra multirun over the shard index.

A table (partial or merged) is an .npz of plain arrays:
    identity <U64 (scalar)  sha256 of T's shards' meta.json, requests.json and offsets.npy (trace_identity)
    shards int64[P]         the shard indices it covers (one for a partial, all for a merged table)
    shard_digest <U16[P]    trace_digest of each of those shards (every byte of its routing): what was counted
    num_shards int64, num_layers int64, num_experts int64, prompt_only bool
    token_vocab int32[t]    sorted token ids seen; occurrences int64[t] tokens per id
    layer int64[nnz], row int64[nnz], expert int64[nnz], count int64[nnz]: nonzero (layer, token row, expert)
                            activation counts, sorted by (layer, row, expert)

Legend: S shards, L MoE layers, E experts, t distinct token ids, nnz nonzero cells.
"""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

import numpy as np

from repro import cli
from repro.affinity.tables import profile_chunks, profile_tokens, profile_vocab
from repro.errors import TraceError
from repro.traces import RoutingTrace, read_trace
from repro.traces.digest import dir_digest
from repro.traces.manifest import is_sharded, manifest_shards

FIELDS = ("identity", "shards", "shard_digest", "num_shards", "num_layers", "num_experts", "prompt_only", "token_vocab",
          "occurrences", "layer", "row", "expert", "count")
MERGE_EVERY = 8  # chunks whose sparse counts are collected before they are re-summed (bounds the COO lists)


def shard_dirs(trace_path: str | Path) -> list[Path]:
    """The trace directories of `trace_path`: its shards in order, or [trace_path] for a plain trace."""
    return manifest_shards(trace_path) if is_sharded(trace_path) else [Path(trace_path)]


IDENTITY_FILES = ("meta.json", "requests.json", "offsets.npy")


def trace_identity(trace_path: str | Path) -> str:
    """sha256 (hex), in shard order, of each shard's meta.json, requests.json and offsets.npy: what the trace is
    (its requests and how it is cut into shards). Which routing each shard holds is shard_digest's."""
    h = hashlib.sha256()
    for directory in shard_dirs(trace_path):
        for name in IDENTITY_FILES:
            try:
                h.update((directory / name).read_bytes())
            except OSError as e:
                raise TraceError(f"cannot read {directory / name} ({e.strerror}); is {trace_path} a complete trace?") from e
    return h.hexdigest()


def shard_digest(directory: str | Path) -> str:
    """trace_digest of one shard: every byte of its routing, streamed in row chunks. A capture that differs from
    another in one expert of one token has another digest (a sample of the routing once let such a part through).
    Computed once and cached in the shard's folder for the state of its files (repro.traces.digest): each count job
    and the merge read it instead of hashing the whole trace again; a stale cache is never used."""
    return dir_digest(directory)


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


def count_shard(trace_path: str | Path, shard: int, out: str | Path, prompt_only: bool = False,
                overwrite: bool = False) -> Path:
    """Write the partial table of shard `shard` of the trace at trace_path to `out` (atomically; an existing `out`
    only with overwrite=True)."""
    cli.claim_output(out, overwrite=overwrite)  # before the counting, which can take long
    dirs = shard_dirs(trace_path)
    if not 0 <= shard < len(dirs):
        raise TraceError(f"shard {shard} is not one of the {len(dirs)} shards of {trace_path} (0..{len(dirs) - 1}).")
    table = shard_counts(read_trace(dirs[shard]), prompt_only)
    table.update(identity=np.str_(trace_identity(trace_path)), shards=np.array([shard], dtype=np.int64),
                 shard_digest=np.array([shard_digest(dirs[shard])]), num_shards=np.int64(len(dirs)))
    return save_table(table, out, overwrite=overwrite)


def save_table(table: dict[str, np.ndarray], out: str | Path, overwrite: bool = False, inputs=()) -> Path:
    """Write a table to `out` atomically; an existing file only with overwrite=True (--overwrite)."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: np.savez would append .npz to a temporary name
            np.savez(f, **{name: table[name] for name in FIELDS})

    return cli.write_output(out, write, overwrite=overwrite, inputs=inputs)


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
        for shard, digest in zip(table["shards"].tolist(), table["shard_digest"].tolist(), strict=True):
            if not 0 <= shard < len(dirs) or digest != shard_digest(dirs[shard]):
                raise TraceError(
                    f"{path} was counted on another trace than {trace_path} (the routing of shard {shard} differs in "
                    "some token); re-run its count job on this trace."
                )
        check_counts(path, table, trace_path)
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
        "identity": np.str_(identity), "shards": np.arange(len(dirs), dtype=np.int64),
        "shard_digest": np.array([shard_digest(d) for d in dirs]), "num_shards": np.int64(len(dirs)),
        "num_layers": np.int64(num_layers), "num_experts": np.int64(num_experts), "prompt_only": tables[0]["prompt_only"],
        "token_vocab": vocab, "occurrences": occurrences,
        "layer": keys // cells, "row": keys % cells // num_experts, "expert": keys % num_experts, "count": summed,
    }


def check_counts(path, table: dict[str, np.ndarray], trace_path) -> None:
    """Refuse a table whose cells cannot come from the trace: shapes that disagree, an expert, layer or token row out
    of range, a count or an occurrence that is not positive (a hand-edited or corrupted part was once merged)."""
    meta = read_trace(shard_dirs(trace_path)[0]).meta
    num_layers, num_experts, rows = int(table["num_layers"]), int(table["num_experts"]), len(table["token_vocab"])
    if num_experts != meta.num_experts or num_layers != len(meta.layer_ids):
        raise TraceError(f"{path} counts {num_layers} layers x {num_experts} experts but {trace_path} has "
                         f"{len(meta.layer_ids)} x {meta.num_experts}; re-run its count job on this trace.")
    cells = {name: table[name] for name in ("layer", "row", "expert", "count")}
    if len({len(a) for a in cells.values()}) != 1 or len(table["occurrences"]) != rows:
        raise TraceError(f"{path} has cell arrays of different lengths; re-run its count job.")
    for name, high in (("layer", num_layers), ("row", rows), ("expert", num_experts)):
        values = cells[name]
        if values.size and (values.min() < 0 or values.max() >= high):
            bad = values[(values < 0) | (values >= high)][0]
            raise TraceError(f"{path} holds {name} {bad}, outside 0..{high - 1}; re-run its count job.")
    for name in ("count", "occurrences"):
        if table[name].size and table[name].min() <= 0:
            raise TraceError(f"{path} holds a {name} of {table[name].min()} (counts are positive); re-run its count job.")


def dense_counts(table: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(token_vocab int32[t], counts float32[L, t, E]): the table as `token_expert_counts` returns it."""
    counts = np.zeros((int(table["num_layers"]), len(table["token_vocab"]), int(table["num_experts"])), np.float64)
    counts[table["layer"], table["row"], table["expert"]] = table["count"]
    return table["token_vocab"], counts.astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(prog="python -m repro.affinity.partial", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    count = sub.add_parser("count", help="count one shard's token -> expert activations")
    count.add_argument("--trace", type=cli.existing_dir, required=True)
    count.add_argument("--shard", type=cli.count, required=True)
    cli.add_output(count, "--out", suffix=".npz", help="the partial table to write (a re-run needs --overwrite)")
    count.add_argument("--prompt-only", action="store_true")
    merge = sub.add_parser("merge", help="sum one partial table per shard into one table")
    merge.add_argument("--trace", type=cli.existing_dir, required=True)
    cli.add_output(merge, "--out", suffix=".npz", help="the merged table to write")
    merge.add_argument("partials", nargs="+", type=cli.existing_file)
    args = parser.parse_args(argv)

    def work() -> None:
        if args.command == "count":
            out = count_shard(args.trace, args.shard, args.out, args.prompt_only, overwrite=args.overwrite)
        else:
            out = save_table(merge_tables(args.trace, args.partials), args.out, args.overwrite, inputs=args.partials)
        print(out)

    return cli.run(work)


if __name__ == "__main__":
    sys.exit(main())
