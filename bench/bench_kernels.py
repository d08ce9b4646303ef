"""Time of every MoE data-path kernel of repro.kernels against its torch reference, measured in one process.

Shapes: a Mixtral-shaped layer scaled down (hidden 1024, intermediate 3584, 8 experts, top-2 softmax, EP 4,
T 4096; quick: T 1024), DeepSeek-V3-like routing (256 experts, 8 groups, 4 kept, top-8 sigmoid, EP 8), and
the Sem-MoE TP shuffle on a planted 64-expert top-6 plan over 8 ranks (layer 2, two layers of history).
On CUDA the Triton kernel and the reference both run, on bf16 data, and speedup = torch ms / triton ms; on
CPU Triton runs only in its interpreter, which is not a performance path, so only the references are timed
(fp32) and the result says so first (`measured`: references only, no compiled kernel, no speed-up). The torch
references are not speed baselines (fused_experts_reference computes in fp32), so on CUDA the `baselines` table
adds bench.gpu_check's fair ones: the Triton grouped GEMM against a bf16 cuBLAS per-expert loop and the Triton
layer against vLLM's fused_experts when vllm is importable (the row says when not), on the DeepSeek-V2-Lite,
Qwen3-30B-A3B and Mixtral expert shapes (quick: 16 / 256 tokens; full: 16 / 256 / 4,096 / 16,384), with
TFLOP/s and the fraction of a dense same-FLOP cuBLAS GEMM. Kernels whose module is not importable yet are
listed under `skipped` with the reason. The cases live in bench.kernel_cases, which `bench.gpu_check` uses for
its correctness and calibration sweep.

Timing: median of one call; on CUDA by triton.testing.do_bench (CUDA events), on CPU by wall time.
Legend: T tokens, H hidden, I intermediate, E experts, k top-k, G groups, D ranks, M = T x k routed rows.
"""

from __future__ import annotations

import contextlib

import torch

from bench.bench_eval import one_core
from bench.gpu_check import BASELINE_TOKENS, expert_rows
from bench.kernel_cases import KernelCase, collect_cases, median_ms

NO_CUDA = "not run (no CUDA device)"
REFERENCES_ONLY = ("torch references only (fp32, CPU): no compiled Triton kernel ran, so no kernel time or speed-up "
                   "is reported; on a CUDA GPU this bench times Triton against a bf16 cuBLAS per-expert loop and "
                   "vLLM's fused_experts (make gpu-check for the full sweep)")


def run(quick: bool) -> dict:
    """Reference (and on CUDA Triton) time per kernel case; every number measured in this process."""
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    num_tokens = 1024 if quick else 4096
    warmup, repeats = (1, 3) if quick else (2, 7)
    cases, skipped = collect_cases(num_tokens, dtype, device)
    rows: dict = {}
    # on a shared CPU a 2-thread pool stalls whenever the other core is busy (measured 10x on gating), so the
    # references run pinned to one core, single-threaded, as bench_eval does
    with contextlib.nullcontext() if cuda else one_core():
        threads = torch.get_num_threads()
        for case in cases:
            rows[f"{case.kernel} {case.shape}"] = measure(case, cuda, warmup, repeats)
    if not cuda:
        print(f"bench kernels: {REFERENCES_ONLY}", flush=True)
    return {
        "measured": "Triton kernels compiled, their torch references, and the fair baselines (table baselines)"
        if cuda else REFERENCES_ONLY,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": num_tokens,
        "torch_threads": threads,
        "triton": "run on CUDA" if cuda else NO_CUDA,
        "timing": "triton.testing.do_bench median (CUDA events)" if cuda else f"median of {repeats} calls after {warmup} warm-up calls",
        "skipped": skipped or "none",
        "reference": "torch_ms: each kernel's torch reference (fused_experts_reference runs in fp32: not a speed "
        "baseline; see baselines)",
        "cases": rows,
        **({"baselines": fair_baselines(quick)} if cuda else {}),
    }


def fair_baselines(quick: bool) -> dict:
    """bench.gpu_check's fair-baseline rows on CUDA (bf16): {"<kernel> <shape> T<tokens>": timing and note}."""
    rows = expert_rows((16, 256) if quick else BASELINE_TOKENS, torch.bfloat16, "cuda")
    keep = ("triton_ms", "torch_ms", "speedup", "note")
    return {f"{r['kernel']} {r['shape']} T{r['tokens']}": {k: r[k] for k in keep} for r in rows}


def measure(case: KernelCase, cuda: bool, warmup: int, repeats: int) -> dict:
    """Reference time (and on CUDA Triton time and speedup) of one case, with token and FLOP rates."""
    torch_ms = median_ms(case.run_torch, cuda, warmup, repeats)
    row = {"torch_ms": torch_ms, "torch_tokens_per_s": case.tokens / torch_ms * 1e3}
    if case.flops:
        row["torch_tflops"] = case.flops / torch_ms / 1e9
    if cuda:
        triton_ms = median_ms(case.run_triton, cuda, warmup, repeats)
        row.update({"triton_ms": triton_ms, "triton_tokens_per_s": case.tokens / triton_ms * 1e3,
                    "speedup": torch_ms / triton_ms})
        if case.flops:
            row["triton_tflops"] = case.flops / triton_ms / 1e9
    return row


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
