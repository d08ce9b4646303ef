"""Top-k gating: which k experts each token goes to, and with what weights.

    topk_softmax (Mixtral, Qwen3, OLMoE):
        probs[t, :]   = softmax(float32(logits[t, :]))
        ids[t, :]     = the k experts with the largest logits (= largest probs), ties -> lower expert id
        weights[t, j] = probs[t, ids[t, j]]            (/ sum_j weights[t, j] when renormalize)

    topk_sigmoid_grouped (DeepSeek-V3 "noaux_tc"):
        scores[t, :]  = sigmoid(float32(logits[t, :]))
        choice[t, :]  = scores[t, :] + bias[:]          (the bias steers selection only, never the weights)
        group g       = experts g*S .. g*S+S-1;  group_score[t, g] = sum of the 2 largest choice values in g
        kept groups   = the topk_groups best groups of token t (ties -> lower group id)
        ids[t, :]     = top-k of choice over the experts of kept groups (ties -> lower expert id)
        weights[t, j] = scores[t, ids[t, j]]  (/ (sum_j + 1e-20) when renormalize)  * scaling_factor

Each program takes BLOCK_T tokens and keeps their whole logit rows in registers (E <= a few hundred), so the
selection is k rounds of "row max, lowest id holding it, mask it out" on a [BLOCK_T, E] tile; the grouped
kernel views the tile as [BLOCK_T, G, S] to score groups, then flattens it for the same selection. Ranking by
logit instead of by rounded probability keeps kernel and reference on identical keys, so ids agree exactly.
Logits are assumed finite (NaN has no rank).

Legend: T tokens, E experts, k experts per token, G groups, S = E / G experts per group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repro.errors import ConfigError
from repro.kernels import use_triton

# tile budget (elements of one [BLOCK_T, E] tile) that keeps a program's logits in registers on a GPU
_TILE_ELEMENTS = 4096


@triton.jit
def _top_k_of_rows(key, value, avail, expert, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, K: tl.constexpr):
    """k rounds of argmax over the available entries of each row of key [BLOCK_T, N].

    Returns (value at the picks float32[BLOCK_T, BLOCK_K], expert id of the picks int32[BLOCK_T, BLOCK_K]);
    `expert` holds each entry's expert id and decides ties (lowest id first).
    """
    slot = tl.arange(0, BLOCK_K)[None, :]
    weights = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(tl.where(avail, key, float("-inf")), axis=1)
        pick = tl.min(tl.where(avail & (key == best[:, None]), expert, 2**30), axis=1)
        chosen = expert == pick[:, None]
        picked_value = tl.sum(tl.where(chosen, value, 0.0), axis=1)
        weights = tl.where(slot == j, picked_value[:, None], weights)
        ids = tl.where(slot == j, pick[:, None], ids)
        avail = avail & ~chosen
    return weights, ids


@triton.jit
def _topk_softmax_kernel(
    logits_ptr, weights_ptr, ids_ptr,
    T, E, stride_lt, stride_le,
    K: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    expert = tl.arange(0, BLOCK_E)
    real = tl.broadcast_to(expert[None, :] < E, (BLOCK_T, BLOCK_E))
    # rows past T read zeros (finite, never stored) so no program divides 0 by 0
    logits = tl.load(
        logits_ptr + token[:, None].to(tl.int64) * stride_lt + expert[None, :] * stride_le,
        mask=real & (token[:, None] < T), other=0.0,
    ).to(tl.float32)
    logits = tl.where(real, logits, float("-inf"))
    unnormalised = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = unnormalised / tl.sum(unnormalised, axis=1)[:, None]

    weights, ids = _top_k_of_rows(logits, probs, real, expert[None, :], BLOCK_T, BLOCK_K, K)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]

    slot = tl.arange(0, BLOCK_K)
    out = token[:, None].to(tl.int64) * K + slot[None, :]
    keep = (token[:, None] < T) & (slot[None, :] < K)
    tl.store(weights_ptr + out, weights, mask=keep)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=keep)


@triton.jit
def _topk_sigmoid_grouped_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    T, stride_lt, stride_le, scaling_factor,
    NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    K: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    group = tl.arange(0, BLOCK_G)[None, :, None]
    member = tl.arange(0, BLOCK_S)[None, None, :]
    expert = group * GROUP_SIZE + member  # [1, G, S]
    real = tl.broadcast_to((group < NUM_GROUPS) & (member < GROUP_SIZE), (BLOCK_T, BLOCK_G, BLOCK_S))
    logits = tl.load(
        logits_ptr + token[:, None, None].to(tl.int64) * stride_lt + expert * stride_le,
        mask=real & (token[:, None, None] < T), other=0.0,
    ).to(tl.float32)
    scores = tl.sigmoid(logits)
    choice = scores + tl.load(bias_ptr + expert, mask=real, other=0.0).to(tl.float32)

    # group score: the two largest choice values of the group (the second: largest after removing the first)
    first = tl.max(tl.where(real, choice, float("-inf")), axis=2)
    first_at = tl.min(tl.where(real & (choice == first[:, :, None]), member, BLOCK_S), axis=2)
    second = tl.max(tl.where(real & (member != first_at[:, :, None]), choice, float("-inf")), axis=2)
    group_score = first + second  # [BLOCK_T, BLOCK_G]

    group_id = tl.broadcast_to(tl.arange(0, BLOCK_G)[None, :], (BLOCK_T, BLOCK_G))
    open_group = group_id < NUM_GROUPS
    kept = tl.zeros((BLOCK_T, BLOCK_G), dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUPS):
        best = tl.max(tl.where(open_group, group_score, float("-inf")), axis=1)
        pick = tl.min(tl.where(open_group & (group_score == best[:, None]), group_id, BLOCK_G), axis=1)
        kept = kept | (group_id == pick[:, None])
        open_group = open_group & (group_id != pick[:, None])

    flat = (BLOCK_T, BLOCK_G * BLOCK_S)
    avail = tl.reshape(real & kept[:, :, None], flat)
    # padding members (s >= S) would alias the next group's ids: give them an id no pick can equal
    expert_flat = tl.reshape(tl.where(real, expert, -1), flat)
    weights, ids = _top_k_of_rows(
        tl.reshape(choice, flat), tl.reshape(scores, flat), avail, expert_flat, BLOCK_T, BLOCK_K, K
    )
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    weights = weights * scaling_factor

    slot = tl.arange(0, BLOCK_K)
    out = token[:, None].to(tl.int64) * K + slot[None, :]
    keep = (token[:, None] < T) & (slot[None, :] < K)
    tl.store(weights_ptr + out, weights, mask=keep)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=keep)


def _check_logits(logits_TE: torch.Tensor, top_k: int) -> None:
    if logits_TE.dim() != 2 or not logits_TE.is_floating_point():
        raise ConfigError(
            f"router logits must be a float tensor [T, E], got {logits_TE.dtype} of shape {tuple(logits_TE.shape)}."
        )
    if not 1 <= top_k <= logits_TE.shape[1]:
        raise ConfigError(f"top_k must be in [1, E={logits_TE.shape[1]}], got {top_k}.")


def _check_grouped(
    logits_TE: torch.Tensor, correction_bias_E: torch.Tensor, top_k: int, num_groups: int, topk_groups: int
) -> None:
    _check_logits(logits_TE, top_k)
    num_experts = logits_TE.shape[1]
    if correction_bias_E.shape != (num_experts,) or not correction_bias_E.is_floating_point():
        raise ConfigError(
            f"correction_bias must be a float tensor [E={num_experts}], got {correction_bias_E.dtype} of shape "
            f"{tuple(correction_bias_E.shape)}."
        )
    if num_groups < 1 or num_experts % num_groups or num_experts // num_groups < 2:
        raise ConfigError(
            f"num_groups={num_groups} must divide E={num_experts} into groups of at least 2 experts (a group's "
            "score is the sum of its top-2 scores)."
        )
    if not 1 <= topk_groups <= num_groups:
        raise ConfigError(f"topk_groups must be in [1, num_groups={num_groups}], got {topk_groups}.")
    if top_k > topk_groups * (num_experts // num_groups):
        raise ConfigError(
            f"top_k={top_k} exceeds the {topk_groups * (num_experts // num_groups)} experts in the "
            f"topk_groups={topk_groups} kept groups; raise topk_groups or lower top_k."
        )


def _block_tokens(num_tokens: int, row_elements: int) -> int:
    return max(1, min(triton.next_power_of_2(max(num_tokens, 1)), _TILE_ELEMENTS // row_elements))


def topk_softmax(
    logits_TE: torch.Tensor, top_k: int, renormalize: bool, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing. logits_TE float[T, E] -> (weights float32[T, k], ids int64[T, k]).

    Ids are in descending probability order, ties to the lower expert id; weights are renormalised to sum 1
    over k when `renormalize` (Mixtral, Qwen3), raw probabilities otherwise (OLMoE).
    """
    _check_logits(logits_TE, top_k)
    if not use_triton(logits_TE, backend):
        return topk_softmax_reference(logits_TE, top_k, renormalize)
    num_tokens, num_experts = logits_TE.shape
    weights_Tk = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits_TE.device)
    ids_Tk = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits_TE.device)
    if num_tokens == 0:
        return weights_Tk, ids_Tk
    block_e = triton.next_power_of_2(num_experts)
    block_t = _block_tokens(num_tokens, block_e)
    _topk_softmax_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits_TE, weights_Tk, ids_Tk,
        num_tokens, num_experts, logits_TE.stride(0), logits_TE.stride(1),
        K=top_k, RENORMALIZE=bool(renormalize),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
    )
    return weights_Tk, ids_Tk


def topk_softmax_reference(
    logits_TE: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch form of `topk_softmax` (same shapes and tie rule; a stable sort puts lower ids first)."""
    _check_logits(logits_TE, top_k)
    logits = logits_TE.float()
    ids_Tk = torch.sort(logits, dim=1, descending=True, stable=True).indices[:, :top_k]
    weights_Tk = torch.softmax(logits, dim=1).gather(1, ids_Tk)
    if renormalize:
        weights_Tk = weights_Tk / weights_Tk.sum(dim=1, keepdim=True)
    return weights_Tk, ids_Tk


def topk_sigmoid_grouped(
    logits_TE: torch.Tensor,
    correction_bias_E: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    scaling_factor: float = 1.0,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 grouped sigmoid routing (see the module docstring).

    logits_TE float[T, E], correction_bias_E float[E] -> (weights float32[T, k], ids int64[T, k]); ids in
    descending order of score + bias within the kept groups, ties to the lower expert id.
    """
    _check_grouped(logits_TE, correction_bias_E, top_k, num_groups, topk_groups)
    if not use_triton(logits_TE, backend):
        return topk_sigmoid_grouped_reference(
            logits_TE, correction_bias_E, top_k, num_groups, topk_groups, renormalize, scaling_factor
        )
    num_tokens, num_experts = logits_TE.shape
    weights_Tk = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits_TE.device)
    ids_Tk = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits_TE.device)
    if num_tokens == 0:
        return weights_Tk, ids_Tk
    group_size = num_experts // num_groups
    block_g, block_s = triton.next_power_of_2(num_groups), triton.next_power_of_2(group_size)
    block_t = _block_tokens(num_tokens, block_g * block_s)
    _topk_sigmoid_grouped_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits_TE, correction_bias_E.contiguous(), weights_Tk, ids_Tk,
        num_tokens, logits_TE.stride(0), logits_TE.stride(1), float(scaling_factor),
        NUM_GROUPS=num_groups, GROUP_SIZE=group_size, TOPK_GROUPS=topk_groups,
        K=top_k, RENORMALIZE=bool(renormalize),
        BLOCK_T=block_t, BLOCK_G=block_g, BLOCK_S=block_s, BLOCK_K=triton.next_power_of_2(top_k),
    )
    return weights_Tk, ids_Tk


def topk_sigmoid_grouped_reference(
    logits_TE: torch.Tensor,
    correction_bias_E: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch form of `topk_sigmoid_grouped` (same shapes and tie rules, through stable sorts)."""
    _check_grouped(logits_TE, correction_bias_E, top_k, num_groups, topk_groups)
    num_tokens, num_experts = logits_TE.shape
    scores_TE = torch.sigmoid(logits_TE.float())
    choice_TE = scores_TE + correction_bias_E.float()
    group_score_TG = choice_TE.view(num_tokens, num_groups, num_experts // num_groups).topk(2, dim=2).values.sum(dim=2)
    kept_groups = torch.sort(group_score_TG, dim=1, descending=True, stable=True).indices[:, :topk_groups]
    kept_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, kept_groups, True)
    kept_TE = kept_TG.repeat_interleave(num_experts // num_groups, dim=1)
    masked_TE = choice_TE.masked_fill(~kept_TE, float("-inf"))
    ids_Tk = torch.sort(masked_TE, dim=1, descending=True, stable=True).indices[:, :top_k]
    weights_Tk = scores_TE.gather(1, ids_Tk)
    if renormalize:
        weights_Tk = weights_Tk / (weights_Tk.sum(dim=1, keepdim=True) + 1e-20)
    return weights_Tk * scaling_factor, ids_Tk
