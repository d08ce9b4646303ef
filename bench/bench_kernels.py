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
listed under `skipped` with the reason. `bench.gpu_check` reuses these cases for its correctness and
calibration sweep.

Timing: median of one call; on CUDA by triton.testing.do_bench (CUDA events), on CPU by wall time.
Legend: T tokens, H hidden, I intermediate, E experts, k top-k, G groups, D ranks, M = T x k routed rows.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from bench.bench_eval import one_core

HIDDEN, INTERMEDIATE = 1024, 3584  # Mixtral's 4096 / 14336, scaled by 1/4
MIXTRAL = {"experts": 8, "top_k": 2, "ranks": 4}
DEEPSEEK_V3 = {"experts": 256, "groups": 8, "topk_groups": 4, "top_k": 8, "ranks": 8, "scaling": 2.5}
SHUFFLE = {"experts": 64, "top_k": 6, "ranks": 8, "layer": 2}
NO_CUDA = "not run (no CUDA device)"
REFERENCES_ONLY = ("torch references only (fp32, CPU): no compiled Triton kernel ran, so no kernel time or speed-up "
                   "is reported; on a CUDA GPU this bench times Triton against a bf16 cuBLAS per-expert loop and "
                   "vLLM's fused_experts (make gpu-check for the full sweep)")


@dataclass
class KernelCase:
    """One contract kernel at one shape: the Triton call and the torch reference call on the same inputs."""

    kernel: str
    shape: str
    tokens: int
    run_triton: Callable[[], object]
    run_torch: Callable[[], object]
    flops: float = 0.0  # arithmetic per call, for TFLOP/s (0: a data-movement kernel)


def median_ms(fn: Callable[[], object], cuda: bool, warmup: int, repeats: int) -> float:
    """Median milliseconds of one fn() call.

    CUDA: triton.testing.do_bench (CUDA events, L2 flushed between calls, ~100 ms of calls after ~25 ms of
    warm-up; warmup/repeats are not used). CPU: wall time of `repeats` calls after `warmup` calls.
    """
    if cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, return_mode="median"))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def random_routing(num_tokens: int, num_experts: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """int64[T, k] distinct experts per token, uniform."""
    return torch.rand(num_tokens, num_experts, generator=generator).topk(top_k, dim=1).indices


def gating_cases(num_tokens: int, dtype: torch.dtype, device: str, seed: int) -> list[KernelCase]:
    from repro.kernels.gating import (
        topk_sigmoid_grouped,
        topk_sigmoid_grouped_reference,
        topk_softmax,
        topk_softmax_reference,
    )

    g = torch.Generator().manual_seed(seed)
    mixtral_TE = torch.randn(num_tokens, MIXTRAL["experts"], generator=g).to(device, dtype)
    ds = DEEPSEEK_V3
    deepseek_TE = torch.randn(num_tokens, ds["experts"], generator=g).to(device, dtype)
    bias_E = (0.01 * torch.randn(ds["experts"], generator=g)).to(device)
    grouped = (bias_E, ds["top_k"], ds["groups"], ds["topk_groups"], True, ds["scaling"])
    return [
        KernelCase(
            "topk_softmax", f"T{num_tokens} E{MIXTRAL['experts']} k{MIXTRAL['top_k']}", num_tokens,
            lambda: topk_softmax(mixtral_TE, MIXTRAL["top_k"], True, backend="triton"),
            lambda: topk_softmax_reference(mixtral_TE, MIXTRAL["top_k"], True),
        ),
        KernelCase(
            "topk_sigmoid_grouped",
            f"T{num_tokens} E{ds['experts']} G{ds['groups']}/{ds['topk_groups']} k{ds['top_k']}", num_tokens,
            lambda: topk_sigmoid_grouped(deepseek_TE, *grouped, backend="triton"),
            lambda: topk_sigmoid_grouped_reference(deepseek_TE, *grouped),
        ),
    ]


def dispatch_cases(num_tokens: int, dtype: torch.dtype, device: str, seed: int) -> list[KernelCase]:
    from repro.kernels.dispatch import (
        dispatch_layout,
        dispatch_layout_reference,
        permute,
        permute_reference,
        unpermute,
        unpermute_reference,
    )

    g = torch.Generator().manual_seed(seed)
    cases = []
    for name, shape in (("mixtral", MIXTRAL), ("deepseek_v3", DEEPSEEK_V3)):
        ids_Tk = random_routing(num_tokens, shape["experts"], shape["top_k"], g).to(device)
        # experts in contiguous blocks per rank, as an unbalanced-free default EP placement
        rank_E = (torch.arange(shape["experts"]) // (shape["experts"] // shape["ranks"])).to(device)
        cases.append(KernelCase(
            "dispatch_layout", f"T{num_tokens} E{shape['experts']} k{shape['top_k']} D{shape['ranks']} ({name})",
            num_tokens,
            lambda ids=ids_Tk, rank=rank_E, d=shape["ranks"]: dispatch_layout(ids, rank, d, backend="triton"),
            lambda ids=ids_Tk, rank=rank_E, d=shape["ranks"]: dispatch_layout_reference(ids, rank, d),
        ))
    experts, top_k = MIXTRAL["experts"], MIXTRAL["top_k"]
    ids_Tk = random_routing(num_tokens, experts, top_k, g).to(device)
    x_TH = torch.randn(num_tokens, HIDDEN, generator=g).to(device, dtype)
    weights_Tk = torch.rand(num_tokens, top_k, generator=g).to(device)
    y_MH, _, slot_position_Tk = permute_reference(x_TH, ids_Tk, experts)
    shape = f"T{num_tokens} H{HIDDEN} E{experts} k{top_k}"
    return cases + [
        KernelCase("permute", shape, num_tokens, lambda: permute(x_TH, ids_Tk, experts, backend="triton"),
                   lambda: permute_reference(x_TH, ids_Tk, experts)),
        KernelCase("unpermute", shape, num_tokens, lambda: unpermute(y_MH, slot_position_Tk, weights_Tk, backend="triton"),
                   lambda: unpermute_reference(y_MH, slot_position_Tk, weights_Tk)),
    ]


def moe_inputs(num_tokens: int, dtype: torch.dtype, device: str, seed: int) -> dict:
    """The Mixtral-shaped layer's tensors: x_TH, ids_Tk, weights_Tk, w13_E2IH, w2_EHI (unit-scale outputs)."""
    g = torch.Generator().manual_seed(seed)
    experts, top_k = MIXTRAL["experts"], MIXTRAL["top_k"]
    return {
        "x_TH": torch.randn(num_tokens, HIDDEN, generator=g).to(device, dtype),
        "ids_Tk": random_routing(num_tokens, experts, top_k, g).to(device),
        "weights_Tk": torch.rand(num_tokens, top_k, generator=g).to(device),
        "w13_E2IH": (torch.randn(experts, 2 * INTERMEDIATE, HIDDEN, generator=g) / HIDDEN**0.5).to(device, dtype),
        "w2_EHI": (torch.randn(experts, HIDDEN, INTERMEDIATE, generator=g) / INTERMEDIATE**0.5).to(device, dtype),
    }


def expert_cases(num_tokens: int, dtype: torch.dtype, device: str, seed: int) -> list[KernelCase]:
    from repro.kernels.dispatch import permute_reference
    from repro.kernels.grouped_gemm import fused_experts, fused_experts_reference

    layer = moe_inputs(num_tokens, dtype, device, seed)
    x_MH, offsets_E1, _ = permute_reference(layer["x_TH"], layer["ids_Tk"], MIXTRAL["experts"])
    weights = (layer["w13_E2IH"], layer["w2_EHI"])
    rows = x_MH.shape[0]
    return [KernelCase(
        "fused_experts", f"M{rows} H{HIDDEN} I{INTERMEDIATE} E{MIXTRAL['experts']}", num_tokens,
        lambda: fused_experts(x_MH, offsets_E1, *weights, backend="triton"),
        lambda: fused_experts_reference(x_MH, offsets_E1, *weights),
        flops=6.0 * rows * HIDDEN * INTERMEDIATE,  # gate, up and down projections, 2 flops per multiply-add
    )]


def shuffle_context(num_tokens: int, device: str, seed: int) -> dict:
    """A Sem-MoE TP plan fitted on a planted profile, and one step: plan, token_ids_T, prev_experts_Thk, layer."""
    from bench.bench_semmoe import planted_trace
    from repro.parallel import ParallelConfig
    from repro.systems.semmoe import SemMoE

    rng = np.random.default_rng(seed)
    profile = planted_trace(rng, num_requests=64, request_len=256, num_layers=SHUFFLE["layer"] + 1,
                            num_experts=SHUFFLE["experts"], top_k=SHUFFLE["top_k"], num_topics=8)
    parallel = ParallelConfig(devices=SHUFFLE["ranks"], attention="tp", tokens_per_step=num_tokens)
    plan = SemMoE(n_steps=2).fit(profile, parallel, np.random.default_rng(seed))
    rows = np.arange(num_tokens) % profile.num_tokens  # repeat the profile when the step is longer
    layer = SHUFFLE["layer"]
    return {
        "plan": plan,
        "token_ids_T": torch.from_numpy(profile.token_ids[rows].astype(np.int64)).to(device),
        "prev_experts_Thk": torch.from_numpy(np.asarray(profile.experts[rows, :layer]).astype(np.int64)).to(device),
        "layer": layer,
    }


def shuffle_cases(num_tokens: int, dtype: torch.dtype, device: str, seed: int) -> list[KernelCase]:
    from repro.kernels.shuffle import (
        inverse_permutation,
        inverse_permutation_reference,
        semmoe_shuffle,
        semmoe_shuffle_reference,
    )

    step = shuffle_context(num_tokens, device, seed)
    args = (step["plan"], step["token_ids_T"], step["layer"], step["prev_experts_Thk"])
    permutation_T, _ = semmoe_shuffle_reference(*args)
    shape = f"T{num_tokens} E{SHUFFLE['experts']} k{SHUFFLE['top_k']} D{SHUFFLE['ranks']} h2"
    return [
        KernelCase("semmoe_shuffle", shape, num_tokens, lambda: semmoe_shuffle(*args, backend="triton"),
                   lambda: semmoe_shuffle_reference(*args)),
        KernelCase("inverse_permutation", f"T{num_tokens}", num_tokens,
                   lambda: inverse_permutation(permutation_T, backend="triton"),
                   lambda: inverse_permutation_reference(permutation_T)),
    ]


BUILDERS = {"gating": gating_cases, "dispatch": dispatch_cases, "grouped_gemm": expert_cases, "shuffle": shuffle_cases}


def collect_cases(num_tokens: int, dtype: torch.dtype, device: str, seed: int = 0) -> tuple[list[KernelCase], dict]:
    """Every kernel case at `num_tokens`, and {module: reason} for kernel modules that are not importable."""
    cases, skipped = [], {}
    for module, build in BUILDERS.items():
        try:
            cases += build(num_tokens, dtype, device, seed)
        except ImportError as e:  # another kernel file not written yet (or an optional dependency missing)
            skipped[module] = f"repro.kernels.{module} not importable: {e}"
    return cases, skipped


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
    from bench.gpu_check import BASELINE_TOKENS, expert_rows  # gpu_check imports this module: import here

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
