"""NCCL (GPU) or gloo (CPU) all-to-all timing over local processes, for bench.gpu_check's calibration.

Kept apart from gpu_check so each spawned rank imports torch and this file only (not the benchmarks and the
simulator): on a shared CPU that halves the start-up of a rehearsal.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from repro.atomic import atomic_write_text

A2A_PEER_BYTES = tuple(4096 * t for t in (1, 4, 16, 64, 256, 1024, 4096))  # one to 4,096 tokens of 4 KiB per peer
A2A_REPEATS = 20


def _a2a_worker(rank: int, world: int, backend: str, init_file: str, peer_bytes: list[int], repeats: int,
                result_path: str) -> None:
    """One rank of `measure_a2a`: all_to_all_single of peer_bytes per peer; rank 0 writes [[bytes, s], ...]."""
    import torch.distributed as dist

    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    rows = []
    try:
        for size in peer_bytes:
            send = torch.full((world * size,), rank % 251, dtype=torch.uint8, device=device)
            recv = torch.empty_like(send)
            for _ in range(3):  # warm-up: communicator set-up and buffer registration stay out of the numbers
                dist.all_to_all_single(recv, send)
            seconds = []
            for _ in range(repeats):
                dist.barrier()  # every rank starts together, so a rank's time is the collective's, not the skew
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    dist.all_to_all_single(recv, send)
                    end.record()
                    end.synchronize()
                    seconds.append(start.elapsed_time(end) * 1e-3)
                else:
                    began = time.perf_counter()
                    dist.all_to_all_single(recv, send)
                    seconds.append(time.perf_counter() - began)
            slowest = torch.tensor([float(np.median(seconds))], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a layer waits for its slowest rank
            rows.append([(world - 1) * size, float(slowest)])
        if rank == 0:
            atomic_write_text(Path(result_path), json.dumps(rows))
    finally:
        dist.destroy_process_group()


def measure_a2a(ranks: int, cuda: bool, peer_bytes=A2A_PEER_BYTES, repeats: int = A2A_REPEATS) -> list[list[float]]:
    """[[busiest rank's remote bytes, seconds], ...] of an even all-to-all over `ranks` local processes (NCCL on
    GPUs 0..ranks-1, gloo on the CPU), per size the slowest rank's median over `repeats` calls."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gpu_check_a2a_") as tmp:
        result = Path(tmp) / "a2a.json"
        mp.spawn(_a2a_worker, args=(ranks, "nccl" if cuda else "gloo", str(Path(tmp) / "init"), list(peer_bytes),
                                    repeats, str(result)), nprocs=ranks, join=True)
        return json.loads(result.read_text())


def a2a_summary(table: list[list[float]]) -> dict:
    """Fixed cost (the smallest message's time) and bandwidth (slope of the two largest) of an a2a table."""
    (b0, t0), (b1, t1) = table[-2], table[-1]
    return {"fixed_us": round(table[0][1] * 1e6, 2),
            "bandwidth_gbps": round((b1 - b0) / (t1 - t0) / 1e9, 1) if t1 > t0 else None}
