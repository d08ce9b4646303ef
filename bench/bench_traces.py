"""Throughput of the routing-trace format (repro.traces) on a 1M-token trace: write, memory-mapped read, split.

Baseline measured in the same run: np.save / np.load of the trace's largest array (experts) into the same
directory, i.e. what the raw .npy layer costs without the format's validation and atomic rename.
The trace was just written, so reads come from the page cache: these are upper bounds for a cold disk.

Legend: N tokens, L MoE layers, k experts per token.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from bench.bench_eval import best_time, synthetic_trace
from repro.traces import read_trace, split_trace, write_trace

MB = 1e6


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def run(quick: bool) -> dict:
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
