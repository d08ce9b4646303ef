"""SwiGLU experts over expert-sorted rows: one grouped GEMM per projection, SwiGLU fused into the first.

Legend: M expert-sorted rows (token copies, grouped by expert), H hidden size, I expert intermediate size,
E experts, T tokens, k experts per token, B row blocks (each inside one expert), BM / BN / BK block sizes,
GM row blocks per swizzle group.

Pseudo-code (rows offsets[e]:offsets[e+1] belong to expert e; empty experts give no block):

    # blocks never straddle experts (vLLM's moe_align_block_size, here from expert_offsets)
    for e in experts, for r0 in range(offsets[e], offsets[e+1], BM): block (e, r0, offsets[e+1])
    # one program per (row block, n-block), launched as a 1-D grid in grouped-M order: GM row blocks
    # sweep the n-blocks together, so the GM x-tiles and one weight tile stay in L2 (Triton's matmul tutorial)
    for each (block, n-block):
        a_rows = rows                        (gather: a_rows = sorted_slot[rows] // k, rows of x_TH itself)
        gate, up = 0, 0                                           # fp32 [BM, BN]
        for k0 in range(0, H, BK):
            gate += x[a_rows, k0:k0+BK] @ w13[e, n, k0:k0+BK].T     # w13[e, :I] is the gate projection
            up   += x[a_rows, k0:k0+BK] @ w13[e, I + n, k0:k0+BK].T # w13[e, I:] is the up projection
        h[rows, n] = silu(gate) * up                                # epilogue, stored in x's dtype
    # down GEMM, same grid over cdiv(H, BN): y[rows, n] = h[rows, :] @ w2[e, n, :].T, fp32 accumulation

The gather form (`fused_experts_gathered`, vLLM fused_moe's sorted_token_ids) reads token rows of x_TH
through the sorted slot ids, so no permuted copy of x is written; `fused_experts` over a permuted x
(repro.kernels.dispatch.permute) is kept beside it as the reference path. The intermediate h is stored in
x's dtype, as vLLM stores it; the references round it the same way. FLOPs: 6 * M * H * I.

Tile configs: `tile_config` picks one per call. In the interpreter always INTERPRETER_TILE (its cost is per
program, so few large blocks); compiled, a tuned entry for this device and (E, H, I, dtype) if
`repro/kernels/configs/<device>.json` has one (written by `python -m bench.gpu_check --tune`, vLLM's
per-device JSON), else DEFAULT_TILES by average rows per expert. Every config is valid in both modes
(blocks >= 16 for tl.dot; tests run each through the interpreter).
Host syncs: none with validate=False (the grid is sized from M and E, both known on the host).
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from repro.errors import ConfigError, TraceError
from repro.kernels import interpreter_on, use_triton

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class TileConfig(NamedTuple):
    """One launch config of the grouped GEMM: block sizes, grouped-M width, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int = 4
    num_stages: int = 3


# the interpreter's cost is per program: few large blocks, one config
INTERPRETER_TILE = TileConfig(16, 32, 32, 4, 4, 1)
# compiled defaults by average rows per expert (upper bound -> config), vLLM's get_default_config in spirit:
# decode-sized experts take 16-row blocks (less padding), prefill-sized ones 64/128-row blocks with grouping
DEFAULT_TILES = {
    16: TileConfig(16, 64, 64, 1, 4, 3),
    64: TileConfig(32, 64, 64, 4, 4, 3),
    256: TileConfig(64, 64, 64, 8, 4, 3),
    2**62: TileConfig(64, 128, 64, 8, 4, 3),
}
# what `python -m bench.gpu_check --tune` tries per M bucket (every one valid in the interpreter too)
CANDIDATE_TILES = tuple(dict.fromkeys([
    *DEFAULT_TILES.values(),
    TileConfig(16, 32, 64, 1, 4, 4), TileConfig(16, 128, 64, 1, 4, 3), TileConfig(32, 128, 64, 8, 4, 3),
    TileConfig(64, 128, 32, 8, 4, 4), TileConfig(128, 64, 64, 8, 8, 3), TileConfig(128, 128, 64, 8, 8, 3),
]))


def tuned_key(num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> str:
    """The key of one expert shape in a tuned-config file, e.g. 'E=64,H=2048,I=1408,dtype=bfloat16'."""
    return f"E={num_experts},H={hidden},I={inter},dtype={str(dtype).removeprefix('torch.')}"


def config_file(device_name: str) -> Path:
    """repro/kernels/configs/<device name with non-alphanumerics as _>.json."""
    return CONFIG_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


@functools.cache
def load_tuned(path: Path) -> dict:
    """{tuned_key: {rows-per-expert bucket (int): TileConfig}} of a tuned file ({} when absent).

    File format: {"E=..,H=..,I=..,dtype=..": {"<bucket>": [BM, BN, BK, GM, warps, stages], ...}, ...}.
    """
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
        return {key: {int(b): TileConfig(*map(int, c)) for b, c in buckets.items()} for key, buckets in raw.items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise ConfigError(f"tuned tile file {path} is not valid ({e}); rerun python -m bench.gpu_check --tune or delete it.") from None


def _bucket(table: dict, rows_per_expert: float):
    """The config of the smallest bucket >= rows_per_expert (the largest bucket past the end)."""
    bounds = sorted(table)
    return table[next((b for b in bounds if rows_per_expert <= b), bounds[-1])]


def tile_config(num_rows: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                device: torch.device, *, interpreted: bool | None = None) -> TileConfig:
    """The TileConfig a call with these sizes uses (see the module docstring); host-only, no device query
    beyond the device name, which is cached."""
    if interpreter_on() if interpreted is None else interpreted:
        return INTERPRETER_TILE
    rows_per_expert = num_rows / max(num_experts, 1)
    if device.type == "cuda":
        tuned = load_tuned(config_file(_device_name(device))).get(tuned_key(num_experts, hidden, inter, dtype))
        if tuned:
            return _bucket(tuned, rows_per_expert)
    return _bucket(DEFAULT_TILES, rows_per_expert)


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr,  # a [M or T, K] rows, b [E, N or 2N, K] weights, c [M, N] output
    block_expert_ptr, block_row_start_ptr, block_row_end_ptr,  # [B] per row block (expert -1: no rows)
    sorted_slot_ptr,  # GATHER: int64 [M] slot t * TOP_K + j of each sorted row (a is then x_TH); else unread
    N, K, num_row_blocks,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    SWIGLU: tl.constexpr,  # b holds [gate; up] (2N rows): write silu(a @ gate.T) * (a @ up.T)
    GATHER: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grouped-M order: GROUP_M consecutive row blocks take the n-blocks together
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    programs_per_group = GROUP_M * num_pid_n
    first_block = (pid // programs_per_group) * GROUP_M
    group_rows = tl.minimum(num_row_blocks - first_block, GROUP_M)
    pid_m = first_block + (pid % programs_per_group) % group_rows
    pid_n = (pid % programs_per_group) // group_rows
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
    if GATHER:
        a_rows = tl.load(sorted_slot_ptr + offs_m, mask=row_mask, other=0) // TOP_K
    else:
        a_rows = offs_m
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
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
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
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


def _check_weights(w13_E2IH, w2_EHI, hidden: int, dtype: torch.dtype) -> None:
    if w13_E2IH.dim() != 3 or w2_EHI.dim() != 3:
        raise ConfigError(
            f"fused_experts needs w13 [E, 2I, H], w2 [E, H, I]; got {tuple(w13_E2IH.shape)}, {tuple(w2_EHI.shape)}."
        )
    num_experts, w_hidden, inter = w2_EHI.shape
    if w13_E2IH.shape != (num_experts, 2 * inter, hidden) or w_hidden != hidden:
        raise ConfigError(
            f"fused_experts shapes disagree: x has H = {hidden}, w13 {tuple(w13_E2IH.shape)} (needs "
            f"[{num_experts}, {2 * inter}, {hidden}]), w2 {tuple(w2_EHI.shape)}."
        )
    if not (dtype == w13_E2IH.dtype == w2_EHI.dtype) or not dtype.is_floating_point:
        raise ConfigError(
            f"fused_experts needs one floating dtype for x and the weights, got {dtype}, {w13_E2IH.dtype}, "
            f"{w2_EHI.dtype}; cast the weights to x's dtype."
        )


def _check_offsets(offsets_E1, num_experts: int, num_rows: int, *, exact: bool, validate: bool) -> None:
    """Integer [E + 1] always (host-only); with validate, rising from 0 to M (exact) or to at most M (one host sync)."""
    if offsets_E1.shape != (num_experts + 1,) or offsets_E1.is_floating_point():
        raise ConfigError(f"expert_offsets must be integer [E + 1] = [{num_experts + 1}], got {offsets_E1.dtype} {tuple(offsets_E1.shape)}.")
    if not validate:
        return
    end_ok = offsets_E1[-1] == num_rows if exact else offsets_E1[-1] <= num_rows
    if offsets_E1[0] != 0 or not end_ok or bool((offsets_E1[1:] < offsets_E1[:-1]).any()):
        raise TraceError(
            f"expert_offsets must rise from 0 to {'' if exact else 'at most '}M = {num_rows} (got "
            f"{offsets_E1.tolist()[:8]}...); build it with repro.kernels.dispatch.permute."
        )


def _check_expert_inputs(x_MH, expert_offsets_E1, w13_E2IH, w2_EHI, validate: bool = True) -> None:
    """Shapes and dtypes always (host-only); with validate, also the offsets' values (one host sync)."""
    if x_MH.dim() != 2:
        raise ConfigError(f"fused_experts needs x [M, H], got shape {tuple(x_MH.shape)}.")
    _check_weights(w13_E2IH, w2_EHI, x_MH.shape[1], x_MH.dtype)
    _check_offsets(expert_offsets_E1, w2_EHI.shape[0], x_MH.shape[0], exact=validate, validate=validate)


def _launch_experts(a, sorted_slot_M, top_k: int, num_rows: int, expert_offsets_E1, w13_E2IH, w2_EHI,
                    config: TileConfig | None) -> torch.Tensor:
    """y_MH of both GEMMs; a is x_sorted_MH (sorted_slot_M None) or x_TH read through sorted_slot_M."""
    hidden, dtype, device = a.shape[1], a.dtype, a.device
    num_experts, _, inter = w2_EHI.shape
    y_MH = torch.empty((num_rows, hidden), dtype=dtype, device=device)
    if num_rows == 0:
        return y_MH
    tile = config or tile_config(num_rows, num_experts, hidden, inter, dtype, device)
    blocks = _row_blocks(expert_offsets_E1.to(device=device, dtype=torch.int64), num_rows, tile.block_m)
    num_row_blocks = blocks[0].numel()
    # fp32 inputs would otherwise run as tf32 on GPUs; the contract is fp32 arithmetic
    precision = "ieee" if dtype == torch.float32 else None
    h_MI = torch.empty((num_rows, inter), dtype=dtype, device=device)
    launches = ((a, w13_E2IH, h_MI, True, sorted_slot_M is not None), (h_MI, w2_EHI, y_MH, False, False))
    for a_in, b, c, swiglu, gather in launches:
        n = c.shape[1]
        _grouped_gemm_kernel[(num_row_blocks * triton.cdiv(n, tile.block_n),)](
            a_in, b, c, *blocks, sorted_slot_M if gather else blocks[0], n, a_in.shape[1], num_row_blocks,
            a_in.stride(0), a_in.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
            SWIGLU=swiglu, GATHER=gather, TOP_K=top_k,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
            DOT_PRECISION=precision, num_warps=tile.num_warps, num_stages=tile.num_stages,
        )
    return y_MH


def fused_experts(
    x_sorted_MH: torch.Tensor,
    expert_offsets_E1: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    *,
    backend: str = "auto",
    validate: bool = True,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """y_MH (x's dtype): rows offsets[e]:offsets[e+1] go through expert e's SwiGLU MLP, fp32 accumulation.

    x_sorted_MH float [M, H] rows grouped by expert; expert_offsets_E1 int [E + 1] rising from 0 to M (empty
    experts allowed); w13_E2IH [E, 2I, H] = [gate; up] projections; w2_EHI [E, H, I] down projection.
    y = (silu(x @ w13[e, :I].T) * (x @ w13[e, I:].T)) @ w2[e].T, the SwiGLU product stored in x's dtype.
    validate=False skips the offsets' value check (a host sync) and allows offsets[-1] < M (a padded
    buffer, as permute(validate=False) returns): rows offsets[-1]: of y are then left unwritten.
    config: a TileConfig to force (default: `tile_config`).
    """
    _check_expert_inputs(x_sorted_MH, expert_offsets_E1, w13_E2IH, w2_EHI, validate)
    if not use_triton(x_sorted_MH, backend):
        return fused_experts_reference(x_sorted_MH, expert_offsets_E1, w13_E2IH, w2_EHI)
    return _launch_experts(x_sorted_MH, None, 1, x_sorted_MH.shape[0], expert_offsets_E1, w13_E2IH, w2_EHI, config)


def fused_experts_gathered(
    x_TH: torch.Tensor,
    sorted_slot_M: torch.Tensor,
    top_k: int,
    expert_offsets_E1: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    *,
    backend: str = "auto",
    validate: bool = True,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """`fused_experts` reading each sorted row straight from x_TH: row r is x[sorted_slot[r] // top_k].

    x_TH float [T, H] tokens in their own order; sorted_slot_M int64 [M] the slot t * top_k + j of each
    expert-sorted row (repro.kernels.dispatch.sorted_slots); expert_offsets_E1 int [E + 1] as in
    `fused_experts` (offsets[-1] <= M; rows past it are unread and left unwritten). Returns y_MH in sorted
    order, equal to fused_experts(x[sorted_slot // top_k], ...) without writing that copy.
    """
    if sorted_slot_M.dim() != 1 or sorted_slot_M.is_floating_point() or top_k < 1:
        raise ConfigError(
            f"sorted_slot must be integer [M] and top_k >= 1, got {sorted_slot_M.dtype} {tuple(sorted_slot_M.shape)}, top_k {top_k}."
        )
    if x_TH.dim() != 2:
        raise ConfigError(f"fused_experts_gathered needs x [T, H], got shape {tuple(x_TH.shape)}.")
    _check_weights(w13_E2IH, w2_EHI, x_TH.shape[1], x_TH.dtype)
    num_rows = sorted_slot_M.shape[0]
    _check_offsets(expert_offsets_E1, w2_EHI.shape[0], num_rows, exact=False, validate=validate)
    if validate:
        routed = sorted_slot_M[: int(expert_offsets_E1[-1])]
        if routed.numel() and (int(routed.min()) < 0 or int(routed.max()) >= x_TH.shape[0] * top_k):
            raise TraceError(
                f"sorted_slot holds slots outside 0..{x_TH.shape[0] * top_k - 1} (T x k); build it with "
                "repro.kernels.dispatch.sorted_slots from the same routing."
            )
    if not use_triton(x_TH, backend):
        end = int(expert_offsets_E1[-1])  # the reference syncs; rows past the end are zero
        x_sorted_MH = x_TH[sorted_slot_M[:end].long() // top_k]
        y_MH = torch.zeros((num_rows, x_TH.shape[1]), dtype=x_TH.dtype, device=x_TH.device)
        y_MH[:end] = fused_experts_reference(x_sorted_MH, expert_offsets_E1, w13_E2IH, w2_EHI)
        return y_MH
    return _launch_experts(x_TH.contiguous(), sorted_slot_M.contiguous(), top_k, num_rows, expert_offsets_E1,
                           w13_E2IH, w2_EHI, config)


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
