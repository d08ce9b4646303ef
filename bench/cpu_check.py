"""CPU calibration of the cost model on this machine: the CPU counterpart of bench.gpu_check.

    python -m bench.cpu_check [--ranks 2 4] [--repeats 25] [--out DIR] [--measured-dir D] [--hardware-dir D]
                              [--name NAME] [--quick]

A "device" here is one gloo rank of repro.exec on this host: `ranks` processes run at once, each with
torch.set_num_threads(cpus // ranks) as repro.exec.launch gives them, so with more ranks than cores a device is a
share of a core. For each rank count N one launch of N processes measures, on every rank at the same time (the
slowest rank's median is kept, as a layer waits for its slowest rank):
- GEMM peak: a 512^3 fp32 torch matmul (FLOP/s), memory bandwidth: a 32 MiB tensor copy (read + write bytes/s);
- the expert curve of EXEC_SHAPE (hidden 256, expert intermediate 512, 8 experts, fp32): one rank's local step
  of repro.exec.moe.ep_moe_forward (permute, the torch grouped GEMM, unpermute) over its E / N slots with n rows
  each, divided by its slots (the simulator sums the table over a rank's slots), n = 1 .. 2048;
- the gate curve: the router (GEMM + top-k softmax, as repro.exec runs it) at n = 1 .. 2048 tokens on a rank
  (`measured.gate`; on a CPU the top-k costs several times the GEMM's roofline, so the simulator prices the gate by
  this table where it has one);
- per-call costs: the kernel floor = the smallest modelled kernel call, the gate at one token (on a GPU gpu_check
  takes one grouped-GEMM row; here the torch local step has many small ops and its one-row time, in notes, is
  carried by the expert table's first row);
Every timed call starts cold (`cold_start`: caches flushed, then a barrier), as phases of an EP layer do.
- the gloo all-to-all curve: all_to_all_single of 8 B .. 1 MiB per peer, per call the fastest
  rank's time (the last to arrive: no wait for a late peer), median over calls: [busiest rank's remote bytes, s].
Writes, per N (atomically):
- conf/hardware/cpu_<host>_<N>ranks.yaml: a hardware profile (the keys of conf/hardware/h200.yaml; the "gpu"
  numbers are the measured fp32 GEMM FLOP/s and copy bandwidth, efficiencies 1) loadable as `hardware=` by the
  simulator and the time estimate;
- conf/hardware/measured/cpu_<host>_<N>ranks.yaml: its calibration document in bench.gpu_check's format (ranks,
  notes, measured: expert_gemm, gate, kernel_floor_us, a2a), which repro.sim.hardware merges into the profile;
- DIR/cpu_check.json (default bench/results): everything, with the machine's load (os.getloadavg) before and after.
Files there that this script did not write are never overwritten. About 2 minutes on 2 cores (--quick: less).
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from repro import cli
from repro.atomic import atomic_write_text
from repro.errors import ConfigError
from repro.sim.hardware import MEASURED_DIR, load_hardware

GENERATED_BY = "bench.cpu_check"
ROOT = Path(__file__).resolve().parents[1]
HARDWARE_DIR = ROOT / "conf" / "hardware"
RESULTS = ROOT / "bench" / "results"
# the expert shape of bench.bench_cost_model's executions (small enough for 4 ranks on 2 cores); experts and top-k
# those of its routing, the smoke-size tiny Mixtral (16 experts, top-4)
EXEC_SHAPE = {"name": "exec_cpu", "hidden_size": 256, "moe_intermediate_size": 512, "num_experts": 16, "top_k": 4,
              "dtype_bytes": 4}
EXPERT_ROWS = (1, 4, 16, 64, 256, 1024, 2048)
PEER_BYTES = (8, 256, 1024, 4096, 16384, 65536, 262144, 1048576)


def host_name() -> str:
    return re.sub(r"[^a-z0-9]+", "_", socket.gethostname().lower()).strip("_") or "host"


def profile_name(host: str, ranks: int) -> str:
    return f"cpu_{host}_{ranks}ranks"


STATS = {"median": np.median, "min": np.min}  # how a quantity's calls are summarised (see `slowest`)


def call_times(fn, repeats: int, warmup: int = 2, before=None) -> list[float]:
    """Seconds of each of `repeats` calls of fn(); `before` (untimed) runs ahead of every call, e.g. a barrier."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


FLUSH_BYTES = 32 * 2**20  # more than this host's last-level cache


def cold_start(flush: torch.Tensor):
    """What runs (untimed) before each timed call: evict the caches by writing FLUSH_BYTES, then a barrier of all
    ranks. In an EP layer every phase starts after a collective and after other work has run through the caches,
    so a phase's small ops run cold; back-to-back calls of the same small op on hot caches cost several times less
    (the first comparison with the executor showed every small phase under-predicted without this)."""
    import torch.distributed as dist

    def before():
        flush.add_(1.0)
        dist.barrier()
    return before


def cold_start_local(flush: torch.Tensor):
    """`cold_start` without the barrier: for a rank timed while the others wait."""
    def before():
        flush.add_(1.0)
    return before


def local_expert_step(x_RH: torch.Tensor, slots_Rk: torch.Tensor, weights_Rk: torch.Tensor, w13_S2IH: torch.Tensor,
                      w2_SHI: torch.Tensor) -> torch.Tensor:
    """What a rank runs between dispatch and combine in repro.exec.moe.ep_moe_forward (torch kernels): permute
    the R received copies by local slot, the grouped SwiGLU GEMM, weighted unpermute."""
    from repro.kernels.dispatch import permute, unpermute
    from repro.kernels.grouped_gemm import fused_experts

    x_sorted_MH, offsets_S1, position_Rk = permute(x_RH, slots_Rk, w13_S2IH.shape[0], backend="torch")
    y_MH = fused_experts(x_sorted_MH, offsets_S1, w13_S2IH, w2_SHI, backend="torch")
    return unpermute(y_MH, position_Rk, weights_Rk, backend="torch")


def local_step_inputs(rows: int, slots: int, hidden: int, inter: int, top_k: int, g: torch.Generator):
    """Inputs of `local_expert_step` with `rows` rows on each of `slots` slots: one slot per received copy
    (the other k - 1 ids -1), as when a token's other experts live on other ranks."""
    w13 = torch.randn(slots, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(slots, hidden, inter, generator=g) / inter**0.5
    x = torch.randn(rows * slots, hidden, generator=g)
    ids = torch.full((rows * slots, top_k), -1, dtype=torch.int64)
    ids[:, 0] = torch.arange(slots).repeat_interleave(rows)
    weights = torch.rand(rows * slots, top_k, generator=g)
    return x, ids, weights, w13, w2


def _compute_part(world: int, repeats: int, rows_list) -> dict:
    """Every call starts cold (`cold_start`: caches flushed, then a barrier of all ranks), as each phase of an EP
    layer follows a collective and other work: a small op issued after a wait costs several times its back-to-back
    time here (measured: the gate at 16 tokens 25 us back to back, ~100 us after a barrier or a 2 ms sleep)."""
    import functools

    from repro.kernels.gating import topk_softmax

    flush = torch.zeros(FLUSH_BYTES // 4)
    timed = functools.partial(call_times, before=cold_start(flush))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)
    gemm_s = timed(lambda: a @ b, repeats)
    src = torch.randn(8 * 2**20, generator=g)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), repeats)
    h, inter, experts, k = (EXEC_SHAPE[f] for f in ("hidden_size", "moe_intermediate_size", "num_experts", "top_k"))
    slots = max(1, experts // world)
    table = []
    for n in rows_list:
        step = functools.partial(local_expert_step, *local_step_inputs(n, slots, h, inter, k, g))
        table.append([n, [t / slots for t in timed(step, repeats if n <= 256 else max(3, repeats // 3))]])
    # the same curve with this rank computing alone (the others wait at a barrier): the cost a busiest rank pays
    # when the other ranks have finished their lighter share (a diagnostic, in notes; the profile keeps `table`)
    import torch.distributed as dist

    alone = []
    for n in rows_list[::2]:
        step = functools.partial(local_expert_step, *local_step_inputs(n, slots, h, inter, k, g))
        mine = []
        for turn in range(world):
            if turn == dist.get_rank():
                mine = [t / slots for t in call_times(step, max(3, repeats // 3), before=cold_start_local(flush))]
            dist.barrier()
        alone.append([n, mine])
    floor_s = timed(functools.partial(local_expert_step, *local_step_inputs(1, 1, 64, 64, k, g)), repeats)
    router = torch.randn(experts, h, generator=g)
    gate = []  # the router (GEMM + top-k softmax, as repro.exec runs it) at n tokens on this rank
    for n in rows_list:
        x = torch.randn(n, h, generator=g)
        gate.append([n, timed(lambda x=x: topk_softmax(x @ router.T, k, True, backend="torch"), repeats)])
    return {"gemm_flops": [2 * 512**3 / t for t in gemm_s], "copy_bytes_per_s": [2 * src.numel() * 4 / t for t in copy_s],
            "expert_gemm": table, "expert_gemm_alone": alone, "kernel_floor_s": floor_s, "gate": gate,
            "threads": torch.get_num_threads()}


def _a2a_part(world: int, repeats: int, peer_bytes) -> list[list]:
    """[[busiest rank's remote bytes, [seconds of each call]], ...] of this rank."""
    import torch.distributed as dist

    rows, before = [], cold_start(torch.zeros(FLUSH_BYTES // 4))
    for size in peer_bytes:
        send = torch.full((world * size,), dist.get_rank() % 251, dtype=torch.uint8)
        recv = torch.empty_like(send)
        for _ in range(3):
            dist.all_to_all_single(recv, send)
        seconds = []
        for _ in range(repeats):
            before()  # cold caches, and every rank starts together: the time is the collective's, not the skew
            start = time.perf_counter()
            dist.all_to_all_single(recv, send)
            seconds.append(time.perf_counter() - start)
        rows.append([(world - 1) * size, seconds])
    return rows


def calibration_worker(rank: int, world: int, *, repeats: int, rows_list: list[int], peer_bytes: list[int]) -> dict:
    """One rank of a launch: the compute part on every rank at once, then the all-to-all sweep."""
    import torch.distributed as dist

    dist.barrier()
    out = _compute_part(world, repeats, rows_list)
    dist.barrier()
    out["a2a"] = _a2a_part(world, repeats, peer_bytes)
    return out


def slowest(results: list[dict], stat: str = "median") -> dict:
    """One number per quantity from every rank's calls: per rank the `stat` of its calls ("median", or "min": the
    undisturbed cost on a busy machine), then the slowest rank (least FLOP/s and bandwidth, most seconds). The
    all-to-all: per call the fastest rank (the last to arrive after the barrier: the transfer without the wait for
    a late peer, as bench.bench_cost_model reduces the executor's calls), then the `stat` over calls."""
    f = STATS[stat]
    table = np.max([[f(row[1]) for row in r["expert_gemm"]] for r in results], axis=0)
    alone = np.max([[f(row[1]) for row in r["expert_gemm_alone"]] for r in results], axis=0)
    gate = np.max([[f(row[1]) for row in r["gate"]] for r in results], axis=0)
    calls = np.asarray([[row[1] for row in r["a2a"]] for r in results])  # [D, sizes, repeats]
    a2a = f(calls.min(axis=0), axis=1)
    first = results[0]
    return {
        "gemm_flops": float(min(f(r["gemm_flops"]) if stat == "median" else max(r["gemm_flops"]) for r in results)),
        "copy_bytes_per_s": float(min(f(r["copy_bytes_per_s"]) if stat == "median" else max(r["copy_bytes_per_s"])
                                      for r in results)),
        "expert_gemm": [[int(row[0]), float(s)] for row, s in zip(first["expert_gemm"], table, strict=True)],
        "expert_gemm_alone": [[int(row[0]), float(s)] for row, s in zip(first["expert_gemm_alone"], alone, strict=True)],
        "kernel_floor_s": max(float(f(r["kernel_floor_s"])) for r in results),
        "gate": [[int(row[0]), float(s)] for row, s in zip(first["gate"], gate, strict=True)],
        "gate_1_token_s": float(gate[0]),  # the kernel floor: the gate curve's first row (rows lists start at 1)
        "a2a": [[int(row[0]), float(s)] for row, s in zip(first["a2a"], a2a, strict=True)],
        "threads": first["threads"],
        "stat": stat,
    }


def fit_a2a(table: list[list[float]]) -> dict:
    """t = latency + bytes / bandwidth through the table's ends: latency the smallest message's time, bandwidth
    the slope from it to the largest (robust to one noisy middle point); max_rel_error over the rows."""
    b, t = np.asarray(table, dtype=np.float64).T
    latency = float(t[0])
    per_byte = max(float((t[-1] - t[0]) / (b[-1] - b[0])), 1e-15) if b[-1] > b[0] else 1e-15
    predicted = latency + (b - b[0]) * per_byte
    return {"latency_us": round(latency * 1e6, 2), "gbps": round(1e-9 / per_byte, 4),
            "max_rel_error": round(float(np.max(np.abs(predicted - t) / t)), 3)}


def profile_document(name: str, ranks: int, m: dict, fit: dict) -> dict:
    """The hardware profile (the keys of conf/hardware/h200.yaml) of one measured rank count."""
    phase = {"latency_us": fit["latency_us"], "peer_half_kb": 0, "nvlink_gbps": fit["gbps"], "rdma_gbps": 0}
    backend = {"dispatch_bytes_per_element": EXEC_SHAPE["dtype_bytes"],
               "combine_bytes_per_element": EXEC_SHAPE["dtype_bytes"], "token_header_bytes": 0,
               "dispatch": dict(phase), "combine": dict(phase)}
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return {
        "name": name, "nodes": 1, "devices_per_node": ranks,
        "gpu": {"bf16_tflops": round(m["gemm_flops"] / 1e12, 6), "hbm_gbps": round(m["copy_bytes_per_s"] / 1e9, 3),
                "hbm_gb": round(memory_gb / ranks, 2)},
        "efficiency": {"gemm": 1.0, "attention": 1.0, "memory": 1.0},
        "gemm_tile_tokens": 1,
        "kernel_floor_us": round(m["gate_1_token_s"] * 1e6, 2),
        "memory_fraction": 0.5,
        "collective": {"latency_us": fit["latency_us"], "nvlink_gbps": fit["gbps"], "rdma_gbps": 0},
        "a2a": {b: json.loads(json.dumps(backend)) for b in ("nccl", "deepep_normal", "deepep_low_latency")},
        "iteration_overhead_us": 0,
        "measured": {},
    }


def calibration_document(name: str, ranks: int, m: dict, fit: dict, load: dict) -> dict:
    """bench.gpu_check's calibration format (conf/hardware/measured/README.md)."""
    tflops = {int(n): round(6.0 * n * EXEC_SHAPE["hidden_size"] * EXEC_SHAPE["moe_intermediate_size"] / s / 1e9, 2)
              for n, s in m["expert_gemm"] if s > 0}
    return {
        "name": name, "generated_by": GENERATED_BY, "ranks": ranks,
        "notes": {
            "device": f"one of {ranks} gloo ranks on {platform.processor() or platform.machine()} "
                      f"({os.cpu_count()} cpus, {m['threads']} torch thread(s) per rank)",
            "torch": str(torch.__version__),
            "load_before_after": load,
            "statistic": (f"{m.get('stat', 'median')} of each rank's calls, then the slowest rank (all-to-all: per "
                          "call the fastest rank)"),
            "gemm_gflops_fp32": round(m["gemm_flops"] / 1e9, 2),
            "copy_gbps": round(m["copy_bytes_per_s"] / 1e9, 2),
            "expert_gemm": (f"per slot: one rank's permute + torch grouped GEMM + unpermute over E / {ranks} slots "
                            "with n rows each / its slots, fp32, slowest rank's median"),
            "expert_gemm_gflops": tflops,
            "expert_gemm_alone": m.get("expert_gemm_alone"),  # each rank alone, the others waiting (a diagnostic)
            "kernel_floor": ("the smallest modelled kernel call with work: the gate (router GEMM + top-k softmax) at "
                             "one token; the expert table carries its own fixed cost"),
            "local_step_1_row_us": round(m["kernel_floor_s"] * 1e6, 2),
            "a2a": {"backend": "gloo (filed under nccl)", "ranks": ranks, "fit": fit},
        },
        "measured": {
            "expert_gemm": {EXEC_SHAPE["name"]: m["expert_gemm"]},
            "gate": {EXEC_SHAPE["name"]: m["gate"]},
            "kernel_floor_us": round(m["gate_1_token_s"] * 1e6, 2),
            "a2a": {"nccl": {"dispatch": m["a2a"], "combine": [list(r) for r in m["a2a"]]}},
        },
    }


PROFILE_MARKERS = {"base": lambda text: text.startswith(f"# Written by {GENERATED_BY}"),
                   "measured": lambda text: f"generated_by: {GENERATED_BY}" in text}


def _writable(path: Path, marker, flag: str = "the profile") -> None:
    """Refuse a path this run may not (re)write: a file another tool wrote, or a place that cannot hold a file."""
    cli.claim_output(path, name=flag, overwrite=True)  # its own earlier calibration is regenerated
    if path.exists() and not marker(path.read_text(errors="replace")):
        raise ConfigError(f"{path} exists and was not written by {GENERATED_BY}; move it away or pass another "
                          "directory, then run again.")


def write_profile(hardware_dir: Path, measured_dir: Path, profile: dict, calibration: dict) -> list[Path]:
    base, measured = hardware_dir / f"{profile['name']}.yaml", measured_dir / f"{profile['name']}.yaml"
    _writable(base, PROFILE_MARKERS["base"])
    _writable(measured, PROFILE_MARKERS["measured"])
    header = (f"# Written by {GENERATED_BY} (python -m bench.cpu_check) on this host: one of {calibration['ranks']} "
              "gloo ranks of repro.exec is a device.\n# gpu.bf16_tflops / hbm_gbps hold the measured fp32 GEMM "
              "FLOP/s and copy bandwidth of a rank (efficiencies 1: achieved, not peak);\n# a2a: the gloo "
              f"all-to-all fit; measured/{profile['name']}.yaml holds the tables that replace the formulas. "
              "Regenerate rather than edit.\n")
    atomic_write_text(base, header + yaml.safe_dump(profile, sort_keys=False, default_flow_style=None, width=110))
    atomic_write_text(measured, f"# Written by {GENERATED_BY}; merged into conf/hardware/{profile['name']}.yaml.\n"
                      + yaml.safe_dump(calibration, sort_keys=False, default_flow_style=None, width=110))
    return [base, measured]


def measure(ranks: int, repeats: int, rows_list, peer_bytes) -> list[dict]:
    """Every rank's call times (`calibration_worker`) of one launch of `ranks` gloo processes."""
    from repro.exec.launch import launch

    return launch(calibration_worker, ranks, backend="gloo", timeout_s=600, repeats=repeats,
                  rows_list=list(rows_list), peer_bytes=list(peer_bytes))


def calibrate(ranks: int, repeats: int, rows_list, peer_bytes, stat: str = "median") -> dict:
    return slowest(measure(ranks, repeats, rows_list, peer_bytes), stat)


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(prog="python -m bench.cpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=cli.Integer(2), nargs="+", default=[2, 4],
                        help="gloo ranks per profile (>= 2: an all-to-all needs two)")
    parser.add_argument("--repeats", type=cli.positive, default=25)
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of cpu_check.json (regenerated each run)")
    parser.add_argument("--hardware-dir", type=Path, default=HARDWARE_DIR)
    parser.add_argument("--measured-dir", type=Path, default=MEASURED_DIR)
    parser.add_argument("--name", default=None, help="host part of the profile names (default: the host name)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats (a rehearsal)")
    args = parser.parse_args(argv)
    return cli.run(lambda: calibrate_profiles(args))


def calibrate_profiles(args) -> None:
    rows_list, peer_bytes, repeats = EXPERT_ROWS, PEER_BYTES, args.repeats
    if args.quick:
        rows_list, peer_bytes, repeats = (1, 16, 256), (8, 4096, 65536), 3
    host = args.name or host_name()
    # every file this run writes is checked before minutes of calibration (an --out file failed only at the end)
    _writable(args.out / "cpu_check.json", lambda text: True, "--out")
    for ranks in args.ranks:
        name = profile_name(host, ranks)
        for folder, kind, flag in ((args.hardware_dir, "base", "--hardware-dir"),
                                   (args.measured_dir, "measured", "--measured-dir")):
            _writable(folder / f"{name}.yaml", PROFILE_MARKERS[kind], flag)
    report = {"host": host, "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
              "profiles": {}}
    for ranks in args.ranks:
        load_before = os.getloadavg()
        started = time.perf_counter()
        m = calibrate(ranks, repeats, rows_list, peer_bytes)
        load = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}
        fit = fit_a2a(m["a2a"])
        name = profile_name(host, ranks)
        profile, calibration = profile_document(name, ranks, m, fit), calibration_document(name, ranks, m, fit, load)
        paths = write_profile(args.hardware_dir, args.measured_dir, profile, calibration)
        hw = load_hardware(yaml.safe_load(paths[0].read_text()), args.measured_dir)  # loads like any other
        report["profiles"][name] = {"paths": [str(p) for p in paths], "seconds": round(time.perf_counter() - started, 1),
                                    "calibrated_parts": list(hw.calibrated_parts), **calibration["notes"],
                                    "measured": calibration["measured"]}
        print(f"{name}: GEMM {calibration['notes']['gemm_gflops_fp32']} GFLOP/s, copy "
              f"{calibration['notes']['copy_gbps']} GB/s, floor {calibration['measured']['kernel_floor_us']} us, "
              f"a2a {fit['latency_us']} us + bytes / {fit['gbps']} GB/s (max fit error {fit['max_rel_error']}), "
              f"load {load} -> {', '.join(map(str, paths))}", flush=True)
    atomic_write_text(args.out / "cpu_check.json", json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
