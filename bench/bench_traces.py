"""Routing-trace benchmarks: the format's throughput (write, memory-mapped read, split) and the streaming import.

Format (1M-token trace): write, read and split, beside np.save / np.load of the trace's largest array (experts)
into the same directory, i.e. what the raw .npy layer costs without the format's validation and atomic rename.
The trace was just written, so reads come from the page cache: these are upper bounds for a cold disk.

Import (issue 19 item 4): DeepSeek-V3-shaped tables (256 experts, top-8, 58 MoE layers, a token_id column, rows
sorted by request, position, layer as a capture writes them; requests of 200..4000 tokens) are generated chunk by
chunk as CSV and Parquet into a temporary folder (removed after), and `python -m repro.traces.import` imports each
in a fresh subprocess with the default --batch-rows. rows/s = rows / the subprocess's wall time (Python start-up
included; startup_s is that start-up alone); peak RSS = the import process's ru_maxrss (taken by a small
stdlib-only launcher with os.wait4, so neither this process's memory nor the launcher's is counted). Targets on
the 2-core machine: >= 1 M rows/s and peak RSS <= 1.5 GB at any size; the ratios to them are printed.
Sizes: 1 M and 10 M rows (and one shuffled 1 M-row Parquet, the external-sort path); 50 M rows only with
BENCH_TRACES_50M=1 (about 3 GB of CSV on disk and a few minutes), else recorded as skipped. --quick: 20 k rows.
The machine is shared: other processes' load moved these rates by up to 2x between runs (peak RSS did not move).

Legend: N tokens, L MoE layers, k experts per token.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pa_parquet

from bench.bench_eval import best_time, synthetic_trace
from repro.traces import read_trace, split_trace, write_trace

MB = 1e6


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def format_throughput(quick: bool) -> dict:
    num_tokens = 1_000_000
    num_layers, top_k = (8, 8) if quick else (16, 8)
    repeats = 2 if quick else 3
    trace = synthetic_trace(np.random.default_rng(0), num_tokens, num_layers, top_k, skew=1.0)
    with tempfile.TemporaryDirectory(prefix="bench_traces.") as tmp:
        tmp = Path(tmp)
        path = tmp / "trace"
        write_s, _, _, _ = best_time(lambda: write_trace(trace, path), repeats)
        size = directory_bytes(path)
        raw_file = tmp / "experts_raw.npy"
        raw_write_s, _, _, _ = best_time(lambda: np.save(raw_file, trace.experts, allow_pickle=False), repeats)
        # read_trace validates, which scans every array once: time it with and without memory mapping
        read_mmap_s, _, _, mapped = best_time(lambda: read_trace(path), repeats)
        read_full_s, _, _, _ = best_time(lambda: read_trace(path, mmap=False), repeats)
        raw_read_s, _, _, _ = best_time(lambda: np.load(raw_file, allow_pickle=False), repeats)
        open_only_s, _, _, _ = best_time(lambda: np.load(raw_file, mmap_mode="r", allow_pickle=False), repeats)
        split_s, _, _, (profile, _) = best_time(lambda: split_trace(mapped, 0.2), repeats)
    experts_bytes = trace.experts.nbytes
    return {
        "tokens": num_tokens,
        "requests": trace.num_requests,
        "layers": num_layers,
        "top_k": top_k,
        "trace_mb": size / MB,
        "timing": f"best of {repeats}, page cache warm",
        "write_s": write_s,
        "write_mb_per_s": size / MB / write_s,
        "write_tokens_per_s": num_tokens / write_s,
        "raw_np_save_experts_mb_per_s": experts_bytes / MB / raw_write_s,
        "write_over_raw": (write_s / size) / (raw_write_s / experts_bytes),
        "read_mmap_validated_s": read_mmap_s,
        "read_mmap_mb_per_s": size / MB / read_mmap_s,
        "read_mmap_tokens_per_s": num_tokens / read_mmap_s,
        "read_in_memory_mb_per_s": size / MB / read_full_s,
        "raw_np_load_experts_mb_per_s": experts_bytes / MB / raw_read_s,
        "raw_mmap_open_s": open_only_s,
        "split_20_80_s": split_s,
        "split_tokens_per_s": num_tokens / split_s,
        "split_profile_requests": profile.num_requests,
    }


# ---- import ----------------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
NUM_EXPERTS, TOP_K, NUM_LAYERS, VOCAB = 256, 8, 58, 129_280
GEN_ROWS = 500_000  # rows generated and written at a time
TARGET_ROWS_PER_S, TARGET_RSS_GB = 1e6, 1.5
BIG_ENV = "BENCH_TRACES_50M"
# runs argv[1:], prints its wall seconds and the child's own peak RSS (KiB); stdlib only, so it stays small
LAUNCHER = ("import json, os, subprocess, sys, time; t = time.perf_counter(); p = subprocess.Popen(sys.argv[1:], "
            "stdout=subprocess.DEVNULL, stderr=subprocess.PIPE); err = p.stderr.read(); _, status, usage = "
            "os.wait4(p.pid, 0); print(json.dumps({'rc': os.waitstatus_to_exitcode(status), 'wall_s': "
            "time.perf_counter() - t, 'maxrss_kib': usage.ru_maxrss, 'stderr': err.decode()[-500:]}))")


def routing_rows(rng: np.random.Generator, rows: int, first_token: int) -> pa.Table:
    """`rows` rows (whole tokens) of a DeepSeek-V3-shaped table in (request, position, layer) order, starting at
    global token index first_token; request r has a length drawn from 200..4000 by a per-request seed."""
    tokens = rows // NUM_LAYERS
    token_index = first_token + np.arange(tokens)
    lengths = np.random.default_rng(12345).integers(200, 4001, 1 + (first_token + tokens) // 200)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    request = np.searchsorted(starts, token_index, side="right") - 1
    position = token_index - starts[request]
    # group-limited top-8: 8 of 32 groups of 8 experts, one expert in each (distinct by construction)
    groups = np.argpartition(rng.random((tokens * NUM_LAYERS, NUM_EXPERTS // 8), dtype=np.float32), TOP_K, axis=1)[:, :TOP_K]
    experts = (groups * 8 + rng.integers(0, 8, groups.shape)).astype(np.int16)
    return pa.table({
        "request_id": pa.array(np.repeat(request, NUM_LAYERS)).cast(pa.string()),
        "position": np.repeat(position, NUM_LAYERS),
        "layer": np.tile(np.arange(NUM_LAYERS), tokens),
        "token_id": np.repeat(rng.integers(0, VOCAB, tokens), NUM_LAYERS),
        "experts": pa.FixedSizeListArray.from_arrays(pa.array(experts.ravel()), TOP_K).cast(pa.list_(pa.int16())),
    })


def as_csv(table: pa.Table) -> pa.Table:
    """The experts lists as JSON text "[3, 5, ...]", as a CSV export writes them."""
    text = pc.binary_join_element_wise("[", pc.binary_join(pc.cast(table["experts"], pa.list_(pa.string())), ", "), "]", "")
    return table.set_column(table.schema.get_field_index("experts"), "experts", text)


def write_tables(folder: Path, rows: int, seed: int = 0) -> tuple[Path, Path]:
    """CSV and Parquet files of the same `rows` rows (rounded down to whole tokens), written GEN_ROWS at a time."""
    rng = np.random.default_rng(seed)
    csv_path, parquet_path = folder / f"routing_{rows}.csv", folder / f"routing_{rows}.parquet"
    csv_writer = parquet_writer = None
    step = GEN_ROWS - GEN_ROWS % NUM_LAYERS
    for start in range(0, rows - rows % NUM_LAYERS, step):
        table = routing_rows(rng, min(step, rows - start), start // NUM_LAYERS)
        if parquet_writer is None:
            parquet_writer = pa_parquet.ParquetWriter(parquet_path, table.schema)
            csv_writer = pa_csv.CSVWriter(csv_path, as_csv(table).schema)
        parquet_writer.write_table(table)
        csv_writer.write_table(as_csv(table))
    parquet_writer.close()
    csv_writer.close()
    return csv_path, parquet_path


def launch(args: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", LAUNCHER, *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def import_once(path: Path, rows: int, out: Path, startup_s: float) -> dict:
    report = launch([sys.executable, "-m", "repro.traces.import", str(path), "--out", str(out), "--num-experts",
                     str(NUM_EXPERTS), "--vocab-size", str(VOCAB)])
    if report["rc"] != 0:
        raise RuntimeError(f"import of {path.name} failed: {report['stderr']}")
    rows_per_s = rows / report["wall_s"]
    rss_gb = report["maxrss_kib"] * 1024 / 1e9
    return {
        "rows": rows,
        "file_mb": path.stat().st_size / 1e6,
        "seconds": report["wall_s"],
        "rows_per_s": rows_per_s,
        # only where start-up is a small part: on the shared machine its own time varies by a few tenths of a second
        "rows_per_s_after_startup": rows / (report["wall_s"] - startup_s) if report["wall_s"] > 3 * startup_s else None,
        "peak_rss_gb": rss_gb,
        "rows_per_s_over_target": rows_per_s / TARGET_ROWS_PER_S,
        "peak_rss_over_target": rss_gb / TARGET_RSS_GB,
        "meets_targets": bool(rows_per_s >= TARGET_ROWS_PER_S and rss_gb <= TARGET_RSS_GB),
    }


def import_throughput(quick: bool) -> dict:
    sizes = [20_000] if quick else [1_000_000, 10_000_000]
    big = os.environ.get(BIG_ENV) == "1" and not quick
    if big:
        sizes.append(50_000_000)
    cases = {}
    with tempfile.TemporaryDirectory(prefix="bench_traces_import.") as tmp:
        tmp = Path(tmp)
        startup = launch([sys.executable, "-c", "import repro.traces.tabular"])
        startup_s = startup["wall_s"]
        for rows in sizes:
            csv_path, parquet_path = write_tables(tmp, rows)
            rows_written = rows - rows % NUM_LAYERS
            for fmt, path in (("parquet", parquet_path), ("csv", csv_path)):
                print(f"  import {rows_written:,} rows of {fmt} ...", flush=True)
                cases[f"{fmt}_{rows_written}"] = import_once(path, rows_written, tmp / "trace", startup_s)
                shutil.rmtree(tmp / "trace")
            if rows == 1_000_000:  # the external-sort path: the same rows in a random order
                table = pa_parquet.read_table(parquet_path)
                shuffled = tmp / "shuffled.parquet"
                pa_parquet.write_table(table.take(np.random.default_rng(1).permutation(len(table))), shuffled)
                del table
                cases[f"parquet_{rows_written}_shuffled"] = import_once(shuffled, rows_written, tmp / "trace", startup_s)
                shutil.rmtree(tmp / "trace")
                shuffled.unlink()
            csv_path.unlink()
            parquet_path.unlink()
    return {
        "import": cases,
        "import_startup_s": startup_s,
        "import_targets": f">= {TARGET_ROWS_PER_S:,.0f} rows/s, peak RSS <= {TARGET_RSS_GB} GB",
        "import_50m": "measured" if big else f"skipped (set {BIG_ENV}=1: ~3 GB of CSV on disk, minutes)",
        "import_all_meet_targets": all(case["meets_targets"] for case in cases.values()),
    }


def run(quick: bool) -> dict:
    return {**format_throughput(quick), **import_throughput(quick)}
