"""Dispatch bookkeeping of an expert-parallel MoE layer: where each token's copies go, and back.

    dispatch_layout (DeepEP's get_dispatch_layout, experts placed anywhere):
        dest[t, j]              = expert_rank[ids[t, j]]            (ids < 0: no expert, no destination)
        sends[t, d]             = any_j dest[t, j] == d              (one copy per (token, rank), however many
                                                                      of the token's experts live on d)
        tokens_per_rank[d]      = sum_t sends[t, d];   tokens_per_expert[e] = #{(t, j): ids[t, j] == e}
        copy_position[t, d]     = sum_{d' < d} tokens_per_rank[d'] + #{t' < t: sends[t', d]}   (-1: no copy)

    permute (group the k activations of every token by expert):
        slots (t, j) with ids[t, j] >= 0, stably sorted by expert: inside an expert, (t, j) order
        expert_offsets[e]       = sum_{e' < e} tokens_per_expert[e']
        slot_position[t, j]     = expert_offsets[e] + #{(t', j') < (t, j): ids[t', j'] == e}   (-1: skipped)
        x_sorted[slot_position[t, j]] = x[t]

    unpermute (weighted combine, fp32 accumulation):
        out[t]                  = sum_{j: slot_position[t, j] >= 0} w[t, j] * y[slot_position[t, j]]

Positions must not depend on thread timing, so counting and placing are two passes over the same token
blocks (vLLM's moe_align_block_size in spirit): pass 1 writes each block's histogram [B, E] (or [B, D]);
a prefix sum over blocks (torch.cumsum, one small launch) gives every block its first row per expert; pass
2 recounts inside the block with tl.cumsum over tokens and writes positions. Rows are then moved by a
separate copy kernel over (token block, hidden block) tiles. Index loads (`ptr + id` with a loaded id) are
the only data-dependent addresses, which the Triton CPU interpreter supports. Host syncs happen only with
validate=True (the default): permute reads M and the count of ids >= E once between its passes,
dispatch_layout that count and the range of expert_rank, unpermute max(slot_position). With validate=False
(the hot path) nothing syncs: ids >= E count as skipped, and permute returns T * k rows (an upper bound of M
known on the host) of which rows offsets[E]: are unused.

Legend: T tokens, k experts per token, E experts, D ranks, H hidden size, M = #{ids >= 0} activations,
B token blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from repro.errors import ConfigError
from repro.kernels import use_triton

# elements of one [BLOCK_T, E] counting tile (keeps a program's histogram in registers on a GPU)
_TILE_ELEMENTS = 8192
_COPY_BLOCK_T = 16


class DispatchLayout(NamedTuple):
    """tokens_per_rank_D int64[D], tokens_per_expert_E int64[E], copy_position_TD int64[T, D] (-1: no copy)."""

    tokens_per_rank_D: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    copy_position_TD: torch.Tensor


@triton.jit
def _expert_counts(ids_ptr, token, T, E, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """(activations of each expert per token int32[BLOCK_T, BLOCK_E], ids >= E per token int32[BLOCK_T])."""
    expert = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
    invalid = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for j in tl.static_range(K):
        ids = tl.load(ids_ptr + token.to(tl.int64) * K + j, mask=token < T, other=-1)
        counts += (ids[:, None] == expert[None, :]).to(tl.int32)
        invalid += (ids >= E).to(tl.int32)
    return counts, invalid


@triton.jit
def _rank_sends(ids_ptr, rank_ptr, token, T, E, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """int32[BLOCK_T, BLOCK_D]: 1 where the token has at least one expert on rank d (DeepEP's dedup)."""
    rank = tl.arange(0, BLOCK_D)
    sends = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.int32)
    for j in tl.static_range(K):
        ids = tl.load(ids_ptr + token.to(tl.int64) * K + j, mask=token < T, other=-1)
        routed = (ids >= 0) & (ids < E)
        dest = tl.load(rank_ptr + tl.where(routed, ids, 0), mask=routed, other=-1)
        sends = tl.maximum(sends, (dest[:, None] == rank[None, :]).to(tl.int32))
    return sends


@triton.jit
def _expert_histogram_kernel(
    ids_ptr, hist_ptr, invalid_ptr, T, E, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr
):
    """Pass 1 of permute: hist[b, e] = activations of expert e in token block b; invalid[b] = ids >= E."""
    block = tl.program_id(0)
    token = block * BLOCK_T + tl.arange(0, BLOCK_T)
    expert = tl.arange(0, BLOCK_E)
    counts, invalid = _expert_counts(ids_ptr, token, T, E, K, BLOCK_T, BLOCK_E)
    tl.store(hist_ptr + block * E + expert, tl.sum(counts, axis=0), mask=expert < E)
    tl.store(invalid_ptr + block, tl.sum(invalid, axis=0))


@triton.jit
def _permute_positions_kernel(
    ids_ptr, start_ptr, position_ptr, T, E, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr
):
    """Pass 2 of permute: slot_position[t, j] from the block's first row per expert (start[b, e])."""
    block = tl.program_id(0)
    token = block * BLOCK_T + tl.arange(0, BLOCK_T)
    expert = tl.arange(0, BLOCK_E)
    counts, _ = _expert_counts(ids_ptr, token, T, E, K, BLOCK_T, BLOCK_E)
    start = tl.load(start_ptr + block * E + expert, mask=expert < E, other=0)
    # rows already taken in expert e by this block's earlier tokens, then by this token's earlier slots
    taken = start[None, :] + tl.cumsum(counts, axis=0) - counts
    for j in tl.static_range(K):
        ids = tl.load(ids_ptr + token.to(tl.int64) * K + j, mask=token < T, other=-1)
        hit = ids[:, None] == expert[None, :]
        position = tl.where((ids >= 0) & (ids < E), tl.sum(tl.where(hit, taken, 0), axis=1), -1)
        tl.store(position_ptr + token.to(tl.int64) * K + j, position, mask=token < T)
        taken += hit.to(tl.int64)


@triton.jit
def _permute_rows_kernel(
    x_ptr, position_ptr, out_ptr, T, H, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr
):
    """out[slot_position[t, j], h-block] = x[t, h-block] for every routed slot of the block's tokens."""
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    col = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rows = token < T
    x = tl.load(x_ptr + token[:, None].to(tl.int64) * H + col[None, :], mask=rows[:, None] & (col[None, :] < H))
    for j in tl.static_range(K):
        position = tl.load(position_ptr + token.to(tl.int64) * K + j, mask=rows, other=-1)
        live = position >= 0
        tl.store(
            out_ptr + tl.where(live, position, 0)[:, None] * H + col[None, :], x,
            mask=live[:, None] & (col[None, :] < H),
        )


@triton.jit
def _unpermute_kernel(
    y_ptr, position_ptr, weight_ptr, out_ptr, T, H,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[t, h-block] = sum_j w[t, j] * y[slot_position[t, j], h-block], accumulated in fp32."""
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    col = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rows = token < T
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(K):
        position = tl.load(position_ptr + token.to(tl.int64) * K + j, mask=rows, other=-1)
        live = position >= 0
        weight = tl.load(weight_ptr + token.to(tl.int64) * K + j, mask=live, other=0.0).to(tl.float32)
        y = tl.load(
            y_ptr + tl.where(live, position, 0)[:, None] * H + col[None, :],
            mask=live[:, None] & (col[None, :] < H), other=0.0,
        ).to(tl.float32)
        acc += weight[:, None] * y
    tl.store(
        out_ptr + token[:, None].to(tl.int64) * H + col[None, :], acc.to(out_ptr.dtype.element_ty),
        mask=rows[:, None] & (col[None, :] < H),
    )


@triton.jit
def _layout_histogram_kernel(
    ids_ptr, rank_ptr, rank_hist_ptr, expert_hist_ptr, invalid_ptr, T, E, D,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Pass 1 of dispatch_layout: per token block, distinct tokens per rank and activations per expert."""
    block = tl.program_id(0)
    token = block * BLOCK_T + tl.arange(0, BLOCK_T)
    expert = tl.arange(0, BLOCK_E)
    rank = tl.arange(0, BLOCK_D)
    counts, invalid = _expert_counts(ids_ptr, token, T, E, K, BLOCK_T, BLOCK_E)
    sends = _rank_sends(ids_ptr, rank_ptr, token, T, E, K, BLOCK_T, BLOCK_D)
    tl.store(expert_hist_ptr + block * E + expert, tl.sum(counts, axis=0), mask=expert < E)
    tl.store(rank_hist_ptr + block * D + rank, tl.sum(sends, axis=0), mask=rank < D)
    tl.store(invalid_ptr + block, tl.sum(invalid, axis=0))


@triton.jit
def _layout_positions_kernel(
    ids_ptr, rank_ptr, start_ptr, position_ptr, T, E, D,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Pass 2 of dispatch_layout: copy_position[t, d] from the block's first row per rank (start[b, d])."""
    block = tl.program_id(0)
    token = block * BLOCK_T + tl.arange(0, BLOCK_T)
    rank = tl.arange(0, BLOCK_D)
    sends = _rank_sends(ids_ptr, rank_ptr, token, T, E, K, BLOCK_T, BLOCK_D)
    start = tl.load(start_ptr + block * D + rank, mask=rank < D, other=0)
    position = tl.where(sends > 0, start[None, :] + tl.cumsum(sends, axis=0) - 1, -1)
    tl.store(
        position_ptr + token[:, None].to(tl.int64) * D + rank[None, :], position,
        mask=(token[:, None] < T) & (rank[None, :] < D),
    )


def _block_starts(hist_BX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hist int[B, X] per-block counts -> (totals int64[X], first row of column x for block b int64[B, X]),
    rows laid out column-major (all of column 0, then column 1, ...) and block order inside a column."""
    hist = hist_BX.to(torch.int64)
    totals_X = hist.sum(dim=0)
    starts_BX = (torch.cumsum(totals_X, 0) - totals_X)[None, :] + torch.cumsum(hist, dim=0) - hist
    return totals_X, starts_BX


def _check_ids(topk_ids_Tk: torch.Tensor, num_experts: int) -> None:
    if topk_ids_Tk.dim() != 2 or topk_ids_Tk.is_floating_point() or topk_ids_Tk.dtype == torch.bool:
        raise ConfigError(
            f"topk_ids must be an integer tensor [T, k], got {topk_ids_Tk.dtype} of shape {tuple(topk_ids_Tk.shape)}."
        )
    if num_experts < 1:
        raise ConfigError(f"the number of experts must be >= 1, got {num_experts}.")


def _raise_out_of_range_ids(count: int, num_experts: int) -> None:
    if count:
        raise ConfigError(
            f"{count} topk_ids are >= the {num_experts} experts; ids must be < E (or < 0 for no expert)."
        )


def _check_layout_args(topk_ids_Tk: torch.Tensor, expert_rank_E: torch.Tensor, num_ranks: int,
                       validate: bool = True) -> None:
    if expert_rank_E.dim() != 1 or expert_rank_E.is_floating_point():
        raise ConfigError(f"expert_rank must be an integer tensor [E], got shape {tuple(expert_rank_E.shape)}.")
    _check_ids(topk_ids_Tk, expert_rank_E.numel())
    if num_ranks < 1:
        raise ConfigError(f"num_ranks must be >= 1, got {num_ranks}.")
    if not validate:
        return
    low, high = torch.stack([expert_rank_E.min(), expert_rank_E.max()]).tolist()  # one device sync
    if low < 0 or high >= num_ranks:
        raise ConfigError(
            f"expert_rank holds ranks in [{low}, {high}], outside "
            f"[0, num_ranks={num_ranks}); pass this source rank's row of Placement.dispatch_device()."
        )


def _counting_block(num_tokens: int, columns: int) -> int:
    return max(1, min(triton.next_power_of_2(max(num_tokens, 1)), _TILE_ELEMENTS // triton.next_power_of_2(columns)))


def dispatch_layout(
    topk_ids_Tk: torch.Tensor, expert_rank_E: torch.Tensor, num_ranks: int, *, backend: str = "auto",
    validate: bool = True,
) -> DispatchLayout:
    """Send-buffer layout of one source rank (see the module docstring).

    topk_ids_Tk int[T, k] (< 0: no expert), expert_rank_E int[E] destination rank of each expert for this
    source rank -> DispatchLayout(tokens_per_rank_D int64[D], tokens_per_expert_E int64[E],
    copy_position_TD int64[T, D]: row in the rank-major send buffer, tokens ascending inside a rank, -1 none).
    validate=False skips the checks that read device values (no host sync): ids >= E then count as skipped
    and expert_rank must hold ranks in [0, num_ranks).
    """
    _check_layout_args(topk_ids_Tk, expert_rank_E, num_ranks, validate)
    num_tokens, top_k = topk_ids_Tk.shape
    if not use_triton(topk_ids_Tk, backend) or num_tokens == 0:
        return dispatch_layout_reference(topk_ids_Tk, expert_rank_E, num_ranks)
    num_experts = expert_rank_E.numel()
    ids, ranks = topk_ids_Tk.contiguous(), expert_rank_E.contiguous()
    block_t = _counting_block(num_tokens, max(num_experts, num_ranks))
    num_blocks = triton.cdiv(num_tokens, block_t)
    device = topk_ids_Tk.device
    rank_hist = torch.empty(num_blocks, num_ranks, dtype=torch.int32, device=device)
    expert_hist = torch.empty(num_blocks, num_experts, dtype=torch.int32, device=device)
    invalid = torch.empty(num_blocks, dtype=torch.int32, device=device)
    block_e, block_d = triton.next_power_of_2(num_experts), triton.next_power_of_2(num_ranks)
    _layout_histogram_kernel[(num_blocks,)](
        ids, ranks, rank_hist, expert_hist, invalid, num_tokens, num_experts, num_ranks,
        K=top_k, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_D=block_d,
    )
    if validate:
        _raise_out_of_range_ids(int(invalid.sum()), num_experts)
    tokens_per_rank_D, starts_BD = _block_starts(rank_hist)
    copy_position_TD = torch.empty(num_tokens, num_ranks, dtype=torch.int64, device=device)
    _layout_positions_kernel[(num_blocks,)](
        ids, ranks, starts_BD, copy_position_TD, num_tokens, num_experts, num_ranks,
        K=top_k, BLOCK_T=block_t, BLOCK_D=block_d,
    )
    return DispatchLayout(tokens_per_rank_D, expert_hist.to(torch.int64).sum(dim=0), copy_position_TD)


def dispatch_layout_reference(
    topk_ids_Tk: torch.Tensor, expert_rank_E: torch.Tensor, num_ranks: int
) -> DispatchLayout:
    """torch form of `dispatch_layout` (same shapes and order)."""
    _check_layout_args(topk_ids_Tk, expert_rank_E, num_ranks)
    num_experts = expert_rank_E.numel()
    ids_Tk = topk_ids_Tk.long()
    routed_Tk = ids_Tk >= 0
    _raise_out_of_range_ids(int((ids_Tk >= num_experts).sum()), num_experts)
    tokens_per_expert_E = torch.bincount(ids_Tk[routed_Tk], minlength=num_experts)
    dest_Tk = torch.where(routed_Tk, expert_rank_E.long()[ids_Tk.clamp(min=0)], -1)
    sends_TD = (dest_Tk[:, :, None] == torch.arange(num_ranks, device=ids_Tk.device)).any(dim=1)
    tokens_per_rank_D = sends_TD.sum(dim=0)
    start_D = torch.cumsum(tokens_per_rank_D, 0) - tokens_per_rank_D
    copy_position_TD = torch.where(sends_TD, start_D + torch.cumsum(sends_TD, dim=0) - 1, -1)
    return DispatchLayout(tokens_per_rank_D, tokens_per_expert_E, copy_position_TD)


def _check_permute(x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor, num_experts: int) -> None:
    _check_ids(topk_ids_Tk, num_experts)
    if x_TH.dim() != 2 or x_TH.shape[0] != topk_ids_Tk.shape[0]:
        raise ConfigError(
            f"x must be [T, H] with the T={topk_ids_Tk.shape[0]} tokens of topk_ids, got shape {tuple(x_TH.shape)}."
        )


def permute_positions(
    topk_ids_Tk: torch.Tensor, num_experts: int, *, backend: str = "auto", validate: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each routed slot goes, without moving rows: topk_ids_Tk int[T, k] (< 0 skipped) ->
    (expert_offsets_E1 int64[E+1], slot_position_Tk int64[T, k], -1 skipped), as `permute` returns them.

    validate=False: no host sync; ids >= E are skipped instead of refused.
    """
    _check_ids(topk_ids_Tk, num_experts)
    num_tokens, top_k = topk_ids_Tk.shape
    if not use_triton(topk_ids_Tk, backend) or num_tokens == 0:
        _, offsets, positions = permute_reference(topk_ids_Tk.new_empty((num_tokens, 0), dtype=torch.float32),
                                                  topk_ids_Tk, num_experts)
        return offsets, positions
    ids, device = topk_ids_Tk.contiguous(), topk_ids_Tk.device
    block_t = _counting_block(num_tokens, num_experts)
    num_blocks = triton.cdiv(num_tokens, block_t)
    block_e = triton.next_power_of_2(num_experts)
    hist = torch.empty(num_blocks, num_experts, dtype=torch.int32, device=device)
    invalid = torch.empty(num_blocks, dtype=torch.int32, device=device)
    _expert_histogram_kernel[(num_blocks,)](ids, hist, invalid, num_tokens, num_experts, K=top_k,
                                            BLOCK_T=block_t, BLOCK_E=block_e)
    tokens_per_expert_E, starts_BE = _block_starts(hist)
    if validate:
        _raise_out_of_range_ids(int(invalid.sum()), num_experts)
    expert_offsets_E1 = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    expert_offsets_E1[1:] = torch.cumsum(tokens_per_expert_E, 0)
    slot_position_Tk = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    _permute_positions_kernel[(num_blocks,)](ids, starts_BE, slot_position_Tk, num_tokens, num_experts, K=top_k,
                                             BLOCK_T=block_t, BLOCK_E=block_e)
    return expert_offsets_E1, slot_position_Tk


def sorted_slots(slot_position_Tk: torch.Tensor) -> torch.Tensor:
    """int64[T * k]: the slot t * k + j each expert-sorted row holds (vLLM's sorted_token_ids); one scatter, no
    host sync. Rows no slot fills (past offsets[E]) hold T * k."""
    num_slots = slot_position_Tk.numel()
    position_S = slot_position_Tk.reshape(-1).long()
    # skipped slots (-1) write into an extra last entry that is cut off
    sorted_S1 = torch.full((num_slots + 1,), num_slots, dtype=torch.int64, device=slot_position_Tk.device)
    sorted_S1.scatter_(0, torch.where(position_S >= 0, position_S, num_slots),
                       torch.arange(num_slots, device=slot_position_Tk.device))
    return sorted_S1[:num_slots]


def permute(
    x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor, num_experts: int, *, backend: str = "auto", validate: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group token rows by expert: x_TH [T, H], topk_ids_Tk int[T, k] (< 0 skipped) ->
    (x_sorted_MH [M, H] in x's dtype, expert_offsets_E1 int64[E+1], slot_position_Tk int64[T, k], -1 skipped).

    Expert e's rows are x_sorted[offsets[e]:offsets[e+1]], in (t, j) order. validate=False: no host sync;
    x_sorted has T * k rows, of which rows offsets[E]: are unused, and ids >= E are skipped.
    """
    _check_permute(x_TH, topk_ids_Tk, num_experts)
    num_tokens, top_k = topk_ids_Tk.shape
    if not use_triton(x_TH, backend) or num_tokens == 0:
        return permute_reference(x_TH, topk_ids_Tk, num_experts)
    expert_offsets_E1, slot_position_Tk = permute_positions(topk_ids_Tk, num_experts, backend=backend,
                                                            validate=validate)
    hidden = x_TH.shape[1]
    x = x_TH.contiguous()
    num_rows = int(expert_offsets_E1[-1]) if validate else num_tokens * top_k
    x_sorted_MH = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    block_h = min(256, triton.next_power_of_2(max(hidden, 1)))
    if num_rows and hidden:
        _permute_rows_kernel[(triton.cdiv(num_tokens, _COPY_BLOCK_T), triton.cdiv(hidden, block_h))](
            x, slot_position_Tk, x_sorted_MH, num_tokens, hidden, K=top_k, BLOCK_T=_COPY_BLOCK_T, BLOCK_H=block_h,
        )
    return x_sorted_MH, expert_offsets_E1, slot_position_Tk


def permute_reference(
    x_TH: torch.Tensor, topk_ids_Tk: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch form of `permute`: a stable argsort of the flattened ids (skipped slots sorted last, dropped)."""
    _check_permute(x_TH, topk_ids_Tk, num_experts)
    num_tokens, top_k = topk_ids_Tk.shape
    ids_S = topk_ids_Tk.reshape(-1).long()  # S = T * k slots in (t, j) order
    routed_S = ids_S >= 0
    _raise_out_of_range_ids(int((ids_S >= num_experts).sum()), num_experts)
    expert_offsets_E1 = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids_S.device)
    expert_offsets_E1[1:] = torch.cumsum(torch.bincount(ids_S[routed_S], minlength=num_experts), 0)
    num_rows = int(expert_offsets_E1[-1])
    order_M = torch.argsort(torch.where(routed_S, ids_S, num_experts), stable=True)[:num_rows]
    slot_position_S = torch.full_like(ids_S, -1)
    slot_position_S[order_M] = torch.arange(num_rows, device=ids_S.device)
    return x_TH[order_M // top_k], expert_offsets_E1, slot_position_S.view(num_tokens, top_k)


def _check_unpermute(y_MH: torch.Tensor, slot_position_Tk: torch.Tensor, topk_weights_Tk: torch.Tensor,
                     validate: bool = True) -> None:
    if y_MH.dim() != 2 or not y_MH.is_floating_point():
        raise ConfigError(f"y must be a float tensor [M, H], got {y_MH.dtype} of shape {tuple(y_MH.shape)}.")
    if slot_position_Tk.is_floating_point() or slot_position_Tk.dtype == torch.bool:
        raise ConfigError(f"slot_position must be an integer tensor, got {slot_position_Tk.dtype}.")
    if slot_position_Tk.dim() != 2 or slot_position_Tk.shape != topk_weights_Tk.shape:
        raise ConfigError(
            f"slot_position {tuple(slot_position_Tk.shape)} and topk_weights {tuple(topk_weights_Tk.shape)} must "
            "be the same [T, k] shape (both from the same routing)."
        )
    if validate and slot_position_Tk.numel() and int(slot_position_Tk.max()) >= y_MH.shape[0]:
        raise ConfigError(
            f"slot_position points at row {int(slot_position_Tk.max())} but y has {y_MH.shape[0]} rows; pass the "
            "slot_position that permute returned for these rows."
        )


def unpermute(
    y_MH: torch.Tensor, slot_position_Tk: torch.Tensor, topk_weights_Tk: torch.Tensor, *, backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Weighted combine: y_MH [M, H], slot_position_Tk int[T, k] (-1 skipped), topk_weights_Tk float[T, k] ->
    out_TH [T, H] in y's dtype, out[t] = sum_{j: pos >= 0} w[t, j] * y[pos[t, j]] accumulated in fp32.
    validate=False skips the check that positions are < M (a host sync)."""
    _check_unpermute(y_MH, slot_position_Tk, topk_weights_Tk, validate)
    num_tokens, top_k = slot_position_Tk.shape
    hidden = y_MH.shape[1]
    if not use_triton(y_MH, backend) or num_tokens == 0 or hidden == 0:
        return unpermute_reference(y_MH, slot_position_Tk, topk_weights_Tk)
    out_TH = torch.empty(num_tokens, hidden, dtype=y_MH.dtype, device=y_MH.device)
    block_h = min(256, triton.next_power_of_2(hidden))
    _unpermute_kernel[(triton.cdiv(num_tokens, _COPY_BLOCK_T), triton.cdiv(hidden, block_h))](
        y_MH.contiguous(), slot_position_Tk.contiguous(), topk_weights_Tk.contiguous(), out_TH, num_tokens, hidden,
        K=top_k, BLOCK_T=_COPY_BLOCK_T, BLOCK_H=block_h,
    )
    return out_TH


def unpermute_reference(
    y_MH: torch.Tensor, slot_position_Tk: torch.Tensor, topk_weights_Tk: torch.Tensor
) -> torch.Tensor:
    """torch form of `unpermute` (gathers [T, k, H] in fp32, so use it at test and benchmark sizes)."""
    _check_unpermute(y_MH, slot_position_Tk, topk_weights_Tk)
    position_Tk = slot_position_Tk.long()
    live_Tk = position_Tk >= 0
    # skipped slots read row M, an appended zero row, so one gather serves every slot
    y_padded = torch.cat([y_MH.float(), y_MH.new_zeros(1, y_MH.shape[1], dtype=torch.float32)])
    gathered_TkH = y_padded[torch.where(live_Tk, position_Tk, y_MH.shape[0])]
    weight_Tk = torch.where(live_Tk, topk_weights_Tk.float(), 0.0)
    return (weight_Tk[:, :, None] * gathered_TkH).sum(dim=1).to(y_MH.dtype)
