"""SwiGLU experts over expert-sorted rows: one grouped GEMM per projection, SwiGLU fused into the first.

Legend: M expert-sorted rows (token copies, grouped by expert), H hidden size, I expert intermediate size,
E experts, T tokens, k experts per token, B row blocks (each inside one expert), BM / BN / BK block sizes.

Pseudo-code (rows offsets[e]:offsets[e+1] of x belong to expert e; empty experts give no block):

    # blocks never straddle experts (vLLM's moe_align_block_size, here from expert_offsets)
    for e in experts, for r0 in range(offsets[e], offsets[e+1], BM): block (e, r0, offsets[e+1])
    # gate-up GEMM, grid (B, cdiv(I, BN)); gate and up tiles share the x tile and one K loop
    for each (block, n-block):
        gate, up = 0, 0                                           # fp32 [BM, BN]
        for k0 in range(0, H, BK):
            gate += x[rows, k0:k0+BK] @ w13[e, n, k0:k0+BK].T     # w13[e, :I] is the gate projection
            up   += x[rows, k0:k0+BK] @ w13[e, I + n, k0:k0+BK].T # w13[e, I:] is the up projection
        h[rows, n] = silu(gate) * up                              # epilogue, stored in x's dtype
    # down GEMM, grid (B, cdiv(H, BN)): y[rows, n] = h[rows, :] @ w2[e, n, :].T, fp32 accumulation

Row-block id is grid axis 0, so neighbouring programs read the same weight tile of one expert (L2 reuse).
The intermediate h is stored in x's dtype, as vLLM stores it; the references round it the same way.
FLOPs: 2 * M * H * 2I (gate-up) + 2 * M * I * H (down) = 6 * M * H * I.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from repro.errors import ConfigError, TraceError
from repro.kernels import use_triton


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr,  # a [M, K] expert-sorted rows, b [E, N or 2N, K] weights, c [M, N] output
    block_expert_ptr, block_row_start_ptr, block_row_end_ptr,  # [B] per row block (expert -1: no rows)
    N, K,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    SWIGLU: tl.constexpr,  # b holds [gate; up] (2N rows): write silu(a @ gate.T) * (a @ up.T)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # grid is sized for the worst case of one partial block per expert
        return
    row_start = tl.load(block_row_start_ptr + pid_m)
    row_end = tl.load(block_row_end_ptr + pid_m)
    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_mask = offs_m < row_end
    col_mask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SWIGLU:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if SWIGLU:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _row_blocks(expert_offsets_E1: torch.Tensor, num_rows: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """(block_expert_B, block_row_start_B, block_row_end_B) int64, B = M // BM + E (no host sync).

    Expert e's rows are cut into cdiv(count_e, BM) blocks; B bounds their total (each expert adds at most one
    partial block). Blocks past the total get expert -1 and exit at once.
    """
    num_experts = expert_offsets_E1.numel() - 1
    counts_E = expert_offsets_E1[1:] - expert_offsets_E1[:-1]
    blocks_E = (counts_E + block_m - 1) // block_m
    block_end_E = torch.cumsum(blocks_E, 0)
    block = torch.arange(num_rows // block_m + num_experts, device=expert_offsets_E1.device)
    expert_B = torch.searchsorted(block_end_E, block, right=True)
    valid = expert_B < num_experts
    expert = expert_B.clamp(max=num_experts - 1)
    first_block = block_end_E[expert] - blocks_E[expert]
    row_start = expert_offsets_E1[expert] + (block - first_block) * block_m
    return torch.where(valid, expert_B, -1), row_start, expert_offsets_E1[expert + 1]


def _check_expert_inputs(x_MH, expert_offsets_E1, w13_E2IH, w2_EHI) -> None:
    if x_MH.dim() != 2 or w13_E2IH.dim() != 3 or w2_EHI.dim() != 3:
        raise ConfigError(
            f"fused_experts needs x [M, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x_MH.shape)}, "
            f"{tuple(w13_E2IH.shape)}, {tuple(w2_EHI.shape)}."
        )
    num_experts, hidden, inter = w2_EHI.shape
    if w13_E2IH.shape != (num_experts, 2 * inter, hidden) or x_MH.shape[1] != hidden:
        raise ConfigError(
            f"fused_experts shapes disagree: x {tuple(x_MH.shape)}, w13 {tuple(w13_E2IH.shape)} (needs "
            f"[{num_experts}, {2 * inter}, {hidden}]), w2 {tuple(w2_EHI.shape)}."
        )
    if not (x_MH.dtype == w13_E2IH.dtype == w2_EHI.dtype) or not x_MH.is_floating_point():
        raise ConfigError(
            f"fused_experts needs one floating dtype for x and the weights, got {x_MH.dtype}, {w13_E2IH.dtype}, "
            f"{w2_EHI.dtype}; cast the weights to x's dtype."
        )
    offsets = expert_offsets_E1
    if offsets.shape != (num_experts + 1,) or offsets.is_floating_point():
        raise ConfigError(f"expert_offsets must be integer [E + 1] = [{num_experts + 1}], got {offsets.dtype} {tuple(offsets.shape)}.")
    if offsets[0] != 0 or offsets[-1] != x_MH.shape[0] or bool((offsets[1:] < offsets[:-1]).any()):
        raise TraceError(
            f"expert_offsets must rise from 0 to M = {x_MH.shape[0]} (got {offsets.tolist()[:8]}...); "
            "build it with repro.kernels.dispatch.permute."
        )


def fused_experts(
    x_sorted_MH: torch.Tensor,
    expert_offsets_E1: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """y_MH (x's dtype): rows offsets[e]:offsets[e+1] go through expert e's SwiGLU MLP, fp32 accumulation.

    x_sorted_MH float [M, H] rows grouped by expert; expert_offsets_E1 int [E + 1] rising from 0 to M (empty
    experts allowed); w13_E2IH [E, 2I, H] = [gate; up] projections; w2_EHI [E, H, I] down projection.
    y = (silu(x @ w13[e, :I].T) * (x @ w13[e, I:].T)) @ w2[e].T, the SwiGLU product stored in x's dtype.
    """
    _check_expert_inputs(x_sorted_MH, expert_offsets_E1, w13_E2IH, w2_EHI)
    if not use_triton(x_sorted_MH, backend):
        return fused_experts_reference(x_sorted_MH, expert_offsets_E1, w13_E2IH, w2_EHI)
    num_rows, hidden = x_sorted_MH.shape
    num_experts, _, inter = w2_EHI.shape
    y_MH = torch.empty_like(x_sorted_MH)
    if num_rows == 0:
        return y_MH
    # untuned: the interpreter runs fastest on few large blocks; the CUDA sizes are vLLM's common defaults
    block_m, block_n, block_k = (16, 32, 32) if not x_sorted_MH.is_cuda else (64, 64, 32)
    blocks = _row_blocks(expert_offsets_E1.to(device=x_sorted_MH.device, dtype=torch.int64), num_rows, block_m)
    # fp32 inputs would otherwise run as tf32 on GPUs; the contract is fp32 arithmetic
    precision = "ieee" if x_sorted_MH.dtype == torch.float32 else None
    h_MI = torch.empty((num_rows, inter), dtype=x_sorted_MH.dtype, device=x_sorted_MH.device)
    for a, b, c, swiglu in ((x_sorted_MH, w13_E2IH, h_MI, True), (h_MI, w2_EHI, y_MH, False)):
        n = c.shape[1]
        grid = (blocks[0].numel(), triton.cdiv(n, block_n))
        _grouped_gemm_kernel[grid](
            a, b, c, *blocks, n, a.shape[1],
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
            SWIGLU=swiglu, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision,
        )
    return y_MH


def _swiglu_expert(x_mH: torch.Tensor, w13_2IH: torch.Tensor, w2_HI: torch.Tensor) -> torch.Tensor:
    """y_mH (x's dtype) of one expert in fp32, the SwiGLU product rounded to x's dtype as the kernel stores it."""
    inter = w2_HI.shape[1]
    gate_up = x_mH.float() @ w13_2IH.float().T  # [m, 2I]
    h_mI = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x_mH.dtype)
    return (h_mI.float() @ w2_HI.float().T).to(x_mH.dtype)


def fused_experts_reference(
    x_sorted_MH: torch.Tensor, expert_offsets_E1: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor
) -> torch.Tensor:
    """Torch form of `fused_experts` (same shapes and rounding): one fp32 matmul pair per non-empty expert."""
    _check_expert_inputs(x_sorted_MH, expert_offsets_E1, w13_E2IH, w2_EHI)
    y_MH = torch.empty_like(x_sorted_MH)
    bounds = expert_offsets_E1.tolist()
    for expert, (start, stop) in enumerate(itertools.pairwise(bounds)):
        if stop > start:
            y_MH[start:stop] = _swiglu_expert(x_sorted_MH[start:stop], w13_E2IH[expert], w2_EHI[expert])
    return y_MH


def moe_reference(
    x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor, topk_weights_Tk: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor
) -> torch.Tensor:
    """out_TH (x's dtype): the plain single-process MoE, out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t]).

    topk_ids_Tk int [T, k] (ids < 0 are skipped, as repro.kernels.dispatch.permute skips them);
    topk_weights_Tk float [T, k]; weights as in `fused_experts`. Each expert output is rounded to x's dtype
    (what fused_experts returns) and the weighted sum runs in fp32, as permute -> fused_experts -> unpermute.
    """
    num_experts = w2_EHI.shape[0]
    if topk_ids_Tk.shape != topk_weights_Tk.shape or topk_ids_Tk.dim() != 2 or topk_ids_Tk.shape[0] != x_TH.shape[0]:
        raise ConfigError(
            f"moe_reference needs topk_ids and topk_weights [T, k] with T = {x_TH.shape[0]}, got "
            f"{tuple(topk_ids_Tk.shape)} and {tuple(topk_weights_Tk.shape)}."
        )
    if topk_ids_Tk.numel() and int(topk_ids_Tk.max()) >= num_experts:
        raise TraceError(f"expert id {int(topk_ids_Tk.max())} is outside the {num_experts} experts of w13 / w2.")
    out_TH = torch.zeros(x_TH.shape, dtype=torch.float32, device=x_TH.device)
    flat_ids = topk_ids_Tk.reshape(-1)
    flat_weights = topk_weights_Tk.reshape(-1).float()
    token = torch.arange(x_TH.shape[0], device=x_TH.device).repeat_interleave(topk_ids_Tk.shape[1])
    for expert in flat_ids[flat_ids >= 0].unique().tolist():
        slots = torch.nonzero(flat_ids == expert).squeeze(1)
        y = _swiglu_expert(x_TH[token[slots]], w13_E2IH[expert], w2_EHI[expert])
        out_TH.index_add_(0, token[slots], flat_weights[slots, None] * y.float())
    return out_TH.to(x_TH.dtype)
