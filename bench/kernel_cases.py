"""Kernel cases and timers shared by the kernel benches (bench.bench_kernels times them, bench.gpu_check checks
and calibrates with them): one module, so neither bench imports the other's internals.

Shapes: a Mixtral-shaped layer scaled down (hidden 1024, intermediate 3584, 8 experts, top-2 softmax, EP 4),
DeepSeek-V3-like routing (256 experts, 8 groups, 4 kept, top-8 sigmoid, EP 8), and the Sem-MoE TP shuffle on a
planted 64-expert top-6 plan over 8 ranks (layer 2, two layers of history).

Timing: median of one call; on CUDA by triton.testing.do_bench (CUDA events), on CPU by wall time.
Legend: T tokens, H hidden, I intermediate, E experts, k top-k, G groups, D ranks, M = T x k routed rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

HIDDEN, INTERMEDIATE = 1024, 3584  # Mixtral's 4096 / 14336, scaled by 1/4
MIXTRAL = {"experts": 8, "top_k": 2, "ranks": 4}
DEEPSEEK_V3 = {"experts": 256, "groups": 8, "topk_groups": 4, "top_k": 8, "ranks": 8, "scaling": 2.5}
SHUFFLE = {"experts": 64, "top_k": 6, "ranks": 8, "layer": 2}
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
