"""Sem-MoE Algorithm 3 at run time (arXiv 2503.04398 §2.4): put each TP rank's slice on the tokens it hosts.

Legend: T tokens in one TP step, D devices (TP ranks = EP ranks), P_D = D padded to a power of two, L MoE
layers, E experts per layer, k experts per token, h' previous layers given, h layers of history used
(min(lookback, layer), 0 when fewer than h are given), V vocabulary ids, t + 1 table rows (row t: OOV
fallback), Q = D**lookback Markov rows, b bits of a token index.

Pseudo-code (the numpy form is repro.systems.semmoe.tp; this reproduces it bit for bit):

    # kernel 1 (_predict_kernel), one program per BLOCK_T tokens
    row = row_of_token[token];  device, conf = T[layer, row], T_p[layer, row]
    if h > 0:
        key = 0
        for i in range(h):  # oldest first: the last layer is the least significant digit
            key = key * D + the device hosting most of prev_experts[:, h' - h + i] under the placement
                            of layer - h + i (ties -> lowest device)
        device = A[layer, key] if A_p[layer, key] > conf else device;  conf = max(conf, A_p[layer, key])
    sort_key = device << (32 + b) | descending_bits(conf) << b | token index
    # kernel 2 (_align_kernel), one program for the whole step
    key = sort(sort_key)                 # device, confidence descending, index: numpy's stable lexsort
    rank = position - group_start[device];  kept = rank < slice[device]     # slice = even split of T
    an overflow token (its group's tail) of overflow rank r takes the first device f with free_end[f] > r
    permutation = sort(final_device << b | index) & (2**b - 1)             # stable argsort by device

The paper sorts with a custom Triton argsort ("argsort(dev_ids)"); here both sorts are `tl.sort` over unique
packed int64 keys, so sort stability never matters. Kernel 2 holds the step in one block: for steps above
MAX_SORT_TOKENS, and for topology-aware plans (align by node, then by device inside the node), the same keys are
sorted with torch.sort and aligned by torch (`_align_torch`, multi-program and free of host syncs too).
The limit is one CTA's registers: 8,192 int64 keys (plus a [BLOCK_T, P_D] one-hot) in 16 warps.

Host syncs: none with validate=False. The plan's tables go to the device once per (plan, device)
(`plan_tables`; `forget_plan_tables(plan)` after changing a plan's arrays in place), and the count of
tokens the align step moved stays on the device until `flush_shuffle_info(plan)` adds it to plan.info.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
import triton
import triton.language as tl

from repro.errors import ConfigError, ReproError, TraceError
from repro.kernels import use_triton

# one block of kernel 2 holds the whole step (the default TP step is 4096 tokens)
MAX_SORT_TOKENS = 8192


@triton.jit
def _predict_kernel(
    token_ptr, row_of_token_ptr, token_device_ptr, token_confidence_ptr,  # [T], [V], the layer's [t + 1] rows
    prev_ptr, stride_pt, stride_ph, stride_pk,  # prev_experts [T, h', k]
    expert_device_ptr, stride_el,  # [L, E]
    markov_device_ptr, markov_confidence_ptr,  # the layer's [Q] rows of A and A_p
    key_ptr,  # out: int64 [T] sort keys
    num_tokens, layer, first_column,  # first_column = h' - h
    HISTORY: tl.constexpr, TOP_K: tl.constexpr, NUM_DEVICES: tl.constexpr, DEVICES_PAD: tl.constexpr,
    INDEX_BITS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = offs < num_tokens
    token = tl.load(token_ptr + offs, mask=mask, other=0)
    row = tl.load(row_of_token_ptr + token, mask=mask, other=0)
    device = tl.load(token_device_ptr + row, mask=mask, other=0).to(tl.int64)
    confidence = tl.load(token_confidence_ptr + row, mask=mask, other=0.0)
    if HISTORY > 0:
        devices = tl.arange(0, DEVICES_PAD)
        history = tl.zeros([BLOCK_T], dtype=tl.int64)
        for i in tl.static_range(HISTORY):
            votes = tl.zeros([BLOCK_T, DEVICES_PAD], dtype=tl.int32)
            for j in tl.static_range(TOP_K):
                expert = tl.load(prev_ptr + offs * stride_pt + (first_column + i) * stride_ph + j * stride_pk, mask=mask, other=0)
                host = tl.load(expert_device_ptr + (layer - HISTORY + i) * stride_el + expert, mask=mask, other=0)
                votes += (host[:, None] == devices[None, :]).to(tl.int32)
            # padded devices get no votes and k >= 1 votes exist, so they never win
            history = history * NUM_DEVICES + tl.argmax(votes, axis=1, tie_break_left=True)
        markov_confidence = tl.load(markov_confidence_ptr + history, mask=mask, other=0.0)
        markov_device = tl.load(markov_device_ptr + history, mask=mask, other=0).to(tl.int64)
        device = tl.where(markov_confidence > confidence, markov_device, device)  # ties keep T
        confidence = tl.maximum(confidence, markov_confidence)
    bits = confidence.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits).to(tl.int64)  # -0.0 ties +0.0, as numpy compares them
    ascending = tl.where(bits >= 0, bits + 2147483648, -1 - bits)  # unsigned pattern, ordered as the floats
    descending = 4294967295 - ascending
    key = (device << (32 + INDEX_BITS)) | (descending << INDEX_BITS) | offs.to(tl.int64)
    tl.store(key_ptr + offs, key, mask=mask)


@triton.jit
def _align_kernel(
    key_ptr, permutation_ptr, moved_ptr,  # [T] sort keys in; [T] permutation and [1] moved count out
    num_tokens,
    NUM_DEVICES: tl.constexpr, DEVICES_PAD: tl.constexpr, INDEX_BITS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    position = tl.arange(0, BLOCK_T)
    valid = position < num_tokens
    key = tl.sort(tl.load(key_ptr + position, mask=valid, other=9223372036854775807))
    index = key & ((1 << INDEX_BITS) - 1)
    device = key >> (32 + INDEX_BITS)
    devices = tl.arange(0, DEVICES_PAD)
    slice_D = tl.where(devices < NUM_DEVICES, num_tokens // NUM_DEVICES + (devices < num_tokens % NUM_DEVICES), 0)
    member = (device[:, None] == devices[None, :]) & valid[:, None]  # [BLOCK_T, P_D]
    group_D = tl.sum(member.to(tl.int32), axis=0)
    group_start_D = tl.cumsum(group_D, 0) - group_D
    overflow_D = tl.maximum(group_D - slice_D, 0)
    overflow_start_D = tl.cumsum(overflow_D, 0) - overflow_D
    free_end_D = tl.cumsum(slice_D - tl.minimum(group_D, slice_D), 0)  # padded devices end at the total
    # registers have no gather: each token reads its device's numbers through the one-hot `member`
    group_start = tl.sum(tl.where(member, group_start_D[None, :], 0), axis=1)
    slice_size = tl.sum(tl.where(member, slice_D[None, :], 0), axis=1)
    overflow_start = tl.sum(tl.where(member, overflow_start_D[None, :], 0), axis=1)
    rank = position - group_start
    kept = valid & (rank < slice_size)
    overflow_rank = overflow_start + rank - slice_size
    free_device = tl.sum((free_end_D[None, :] <= overflow_rank[:, None]).to(tl.int32), axis=1)
    final = tl.where(kept, device, free_device.to(tl.int64))
    final_key = tl.where(valid, (final << INDEX_BITS) | index, 9223372036854775807)
    permutation = tl.sort(final_key) & ((1 << INDEX_BITS) - 1)
    tl.store(permutation_ptr + position, permutation, mask=valid)
    tl.store(moved_ptr, tl.sum((valid & ~kept).to(tl.int32), axis=0))


def _group_count(group_T: torch.Tensor, num_groups: int, weight_T: torch.Tensor | None = None) -> torch.Tensor:
    """int64[G] members per group (of weight_T's True entries); a scatter-add, since CUDA's bincount syncs."""
    ones = torch.ones_like(group_T) if weight_T is None else weight_T.to(torch.int64)
    return torch.zeros(num_groups, dtype=torch.int64, device=group_T.device).scatter_add_(0, group_T, ones)


def _fill_torch(key_T: torch.Tensor, capacity_G: torch.Tensor, index_bits: int,
                evicted_T: torch.Tensor | None = None) -> torch.Tensor:
    """int64[T] final group per token (repro.systems.semmoe.tp.fill_groups): key_T[t] = group << (32 + b) |
    descending confidence bits << b | t; each group keeps its first capacity_G[g] keys in sorted order
    (evicted_T bool[T] never kept), the rest fill the free places in key order, free places in group order.
    No host sync: every size is T or G."""
    num_groups = capacity_G.numel()
    key = torch.sort(key_T).values
    index, group = key & ((1 << index_bits) - 1), key >> (32 + index_bits)
    group_count = _group_count(group, num_groups)
    rank = torch.arange(key.numel(), device=key.device) - (torch.cumsum(group_count, 0) - group_count)[group]
    kept = rank < capacity_G[group]
    if evicted_T is not None:
        kept &= ~evicted_T[index]
    free_end = torch.cumsum(capacity_G - _group_count(group, num_groups, kept), 0)
    # the r-th token not kept (in key order) takes the first group whose free places end past r
    overflow_rank = torch.cumsum(~kept, 0) - (~kept).to(torch.int64)
    final_sorted = torch.where(kept, group, torch.searchsorted(free_end, overflow_rank, right=True))
    return torch.empty_like(final_sorted).scatter_(0, index, final_sorted)


def _align_torch(key_T: torch.Tensor, num_devices: int, index_bits: int,
                 devices_per_node: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(permutation int64[T], moved int64 scalar tensor): kernel 2's arithmetic with torch.sort (key_T[t] holds token t), for steps
    above MAX_SORT_TOKENS and for topology-aware plans, which align by node first (SemMoEPlan's
    align_to_slices with devices_per_node)."""
    shift = 32 + index_bits
    tail = key_T & ((1 << shift) - 1)  # confidence bits and index
    device = key_T >> shift
    slice_D = _even_counts(key_T.numel(), num_devices, key_T.device)
    if devices_per_node is None or devices_per_node >= num_devices:
        final = _fill_torch(key_T, slice_D, index_bits)
    else:
        node_of = device // devices_per_node
        node = _fill_torch((node_of << shift) | tail, slice_D.reshape(-1, devices_per_node).sum(dim=1), index_bits)
        crossed = node != node_of
        # a token that crossed nodes waits last (all-ones confidence bits) in its new node's first device, then
        # takes a free place of that node
        last = ((1 << 32) - 1) << index_bits | torch.arange(key_T.numel(), device=key_T.device)
        group = torch.where(crossed, node * devices_per_node, device)
        final = _fill_torch((group << shift) | torch.where(crossed, last, tail), slice_D, index_bits, crossed)
    order = torch.sort((final << index_bits) | torch.arange(final.numel(), device=final.device)).values
    return order & ((1 << index_bits) - 1), (final != device).sum()


def _even_counts(num_tokens: int, num_devices: int, device: torch.device) -> torch.Tensor:
    """int64[D] the reduce-scatter slice sizes (repro.systems.base.even_counts)."""
    return torch.full((num_devices,), num_tokens // num_devices, dtype=torch.int64, device=device) + (
        torch.arange(num_devices, device=device) < num_tokens % num_devices
    )


def _as_tensor(array, device: torch.device | None = None) -> torch.Tensor:
    """A torch view of a numpy array (a copy when it is read-only: torch cannot alias those), on `device`."""
    if isinstance(array, torch.Tensor):
        return array if device is None else array.to(device)
    array = np.asarray(array)
    if not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array)
    return tensor if device is None else tensor.to(device)


def _is_integer(tensor: torch.Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)


def _check_step(plan, tokens_T: torch.Tensor, layer: int, validate: bool = True) -> None:
    vocab = len(plan.row_of_token)
    if tokens_T.dim() != 1 or not _is_integer(tokens_T):
        raise ConfigError(f"token_ids must be one integer id per token [T], got {tokens_T.dtype} {tuple(tokens_T.shape)}.")
    bad = tokens_T[(tokens_T < 0) | (tokens_T >= vocab)] if validate else tokens_T[:0]
    if bad.numel():
        raise TraceError(
            f"token id {int(bad[0])} is outside the plan's vocabulary of {vocab} ids; fit the plan on a profile of the same model."
        )
    num_layers = plan.token_device.shape[0]
    if not 0 <= layer < num_layers:
        raise ConfigError(f"layer {layer} is outside the plan's {num_layers} MoE layers.")
    for name in ("token_confidence", "markov_confidence"):
        table = getattr(plan, name)
        if table is not None and table.dtype != np.float32:
            raise ConfigError(f"plan.{name} is {table.dtype}; the kernel orders float32 confidences (as SemMoE builds them).")


def _history(plan, layer: int, prev_experts_Thk, num_tokens: int, device: torch.device,
             validate: bool = True) -> tuple[int, torch.Tensor | None]:
    """(h, prev_experts int[T, h', k] on `device`): h = 0 when the plan cannot use the given history.

    The Markov rows of `layer` index exactly min(lookback, layer) previous devices, so a shorter history is
    ignored (as repro.systems.semmoe.tp.predict_devices does).
    """
    depth = min(plan.lookback, layer)
    if depth == 0 or prev_experts_Thk is None:
        return 0, None
    prev = _as_tensor(prev_experts_Thk, device)
    if prev.dim() != 3 or prev.shape[0] != num_tokens or not _is_integer(prev):
        raise ConfigError(
            f"prev_experts must be integer [T, h', k] with T = {num_tokens}, got {prev.dtype} {tuple(prev.shape)}."
        )
    if prev.shape[1] < depth:
        return 0, None
    num_experts = plan.placement.num_experts
    used = prev[:, prev.shape[1] - depth :]
    if validate and used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_experts):
        raise TraceError(
            f"prev_experts holds expert ids outside 0..{num_experts - 1}; the trace and the plan disagree on the model."
        )
    return depth, prev


class PlanTables:
    """One plan's arrays on one device, uploaded once (`plan_tables`), plus the align step's moved-token count
    and shuffled-token count not yet added to plan.info (`flush_shuffle_info`)."""

    def __init__(self, plan, device: torch.device):
        self.row_of_token_V = _as_tensor(plan.row_of_token, device)
        self.expert_device_LE = _as_tensor(plan.placement.expert_device(), device)
        self.token_device_Lt = _as_tensor(plan.token_device, device)
        self.token_confidence_Lt = _as_tensor(plan.token_confidence, device)
        has_markov = plan.markov_device is not None
        self.markov_device_LQ = _as_tensor(plan.markov_device, device) if has_markov else None
        self.markov_confidence_LQ = _as_tensor(plan.markov_confidence, device) if has_markov else None
        self.pending_moved = torch.zeros((), dtype=torch.int64, device=device)
        self.pending_tokens = 0


# id(plan) -> (weak reference to the plan, {device: PlanTables}); entries leave with their plan
_PLAN_TABLES: dict[int, tuple[weakref.ref, dict]] = {}


def plan_tables(plan, device: torch.device) -> PlanTables:
    """The plan's tables on `device`, copied there on the first call for this (plan, device) only. On the CPU
    they alias the plan's numpy arrays (no copy); elsewhere a plan changed in place needs forget_plan_tables."""
    entry = _PLAN_TABLES.get(id(plan))
    if entry is None or entry[0]() is not plan:
        entry = (weakref.ref(plan), {})
        _PLAN_TABLES[id(plan)] = entry
        weakref.finalize(plan, _PLAN_TABLES.pop, id(plan), None)
    by_device = entry[1]
    if device not in by_device:
        by_device[device] = PlanTables(plan, device)
    return by_device[device]


def flush_shuffle_info(plan) -> None:
    """Add the moved / shuffled token counts of validate=False shuffles to plan.info (one host sync per device)."""
    entry = _PLAN_TABLES.get(id(plan))
    if entry is None or entry[0]() is not plan:
        return
    for tables in entry[1].values():
        if tables.pending_tokens:
            _record_step(plan.info, int(tables.pending_moved), tables.pending_tokens)
            tables.pending_moved.zero_()
            tables.pending_tokens = 0


def forget_plan_tables(plan) -> None:
    """Drop the plan's device copies (after changing its arrays in place); pending counts are flushed first."""
    flush_shuffle_info(plan)
    _PLAN_TABLES.pop(id(plan), None)


def _record_step(info: dict, moved: int, num_tokens: int) -> None:
    """plan.info bookkeeping of SemMoEPlan.shuffle_tokens, so either path leaves the same counters."""
    info["align_moved_tokens"] += moved
    info["shuffled_tokens"] += num_tokens
    info["align_moved_share"] = info["align_moved_tokens"] / max(info["shuffled_tokens"], 1)


def semmoe_shuffle(plan, token_ids_T, layer: int, prev_experts_Thk=None, *, backend: str = "auto",
                   validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(permutation_T int64, counts_D int64) on token_ids' device: exactly `plan.shuffle_tokens(...)`.

    plan: a repro.systems.semmoe.system.SemMoEPlan; token_ids_T int [T] (numpy or torch); layer: the MoE
    layer about to run; prev_experts_Thk int [T, h', k] true routing of the h' previous layers,
    chronological (column -1 = layer - 1), or None. Rank d receives tokens
    permutation[sum(counts[:d]) : sum(counts[:d + 1])]. Updates plan.info's align_moved_tokens,
    shuffled_tokens and align_moved_share as shuffle_tokens does.
    validate=False (the hot path): no host sync. Token ids outside the vocabulary and expert ids outside
    0..E-1 are not checked (they read out of bounds), and plan.info is updated at flush_shuffle_info(plan).
    """
    tokens_T = _as_tensor(token_ids_T)
    if not use_triton(tokens_T, backend):
        return semmoe_shuffle_reference(plan, token_ids_T, layer, prev_experts_Thk)
    _check_step(plan, tokens_T, layer, validate)
    device, num_tokens, num_devices = tokens_T.device, tokens_T.numel(), plan.parallel.devices
    depth, prev = _history(plan, layer, prev_experts_Thk, num_tokens, device, validate)
    counts_D = _even_counts(num_tokens, num_devices, device)
    if num_tokens == 0:
        if validate:
            _record_step(plan.info, 0, 0)
        return torch.zeros(0, dtype=torch.int64, device=device), counts_D
    index_bits = max(1, (num_tokens - 1).bit_length())
    if index_bits + (num_devices - 1).bit_length() > 31:  # device | 32 confidence bits | index in 63 bits
        raise ConfigError(f"a step of {num_tokens} tokens over {num_devices} devices does not fit the 63-bit sort key; split the step.")
    devices_pad = triton.next_power_of_2(num_devices)
    tables = plan_tables(plan, device)
    expert_device_LE = tables.expert_device_LE
    token_device_t, token_confidence_t = tables.token_device_Lt[layer], tables.token_confidence_Lt[layer]
    markov_device_Q, markov_confidence_Q = (
        (tables.markov_device_LQ[layer], tables.markov_confidence_LQ[layer])
        if depth else (token_device_t, token_confidence_t)  # unread placeholders when h = 0
    )
    prev_Thk = prev if depth else tokens_T[:, None, None]  # unread placeholder when h = 0
    key_T = torch.empty(num_tokens, dtype=torch.int64, device=device)
    block_t = 256
    _predict_kernel[(triton.cdiv(num_tokens, block_t),)](
        tokens_T, tables.row_of_token_V, token_device_t, token_confidence_t,
        prev_Thk, *prev_Thk.stride(), expert_device_LE, expert_device_LE.stride(0),
        markov_device_Q, markov_confidence_Q, key_T,
        num_tokens, layer, prev_Thk.shape[1] - depth,
        HISTORY=depth, TOP_K=prev_Thk.shape[2], NUM_DEVICES=num_devices, DEVICES_PAD=devices_pad,
        INDEX_BITS=index_bits, BLOCK_T=block_t,
    )
    align_node = plan.align_devices_per_node
    if num_tokens > MAX_SORT_TOKENS or align_node is not None:
        permutation_T, moved = _align_torch(key_T, num_devices, index_bits, align_node)
    else:
        permutation_T = torch.empty(num_tokens, dtype=torch.int64, device=device)
        moved_1 = torch.zeros(1, dtype=torch.int32, device=device)
        block = triton.next_power_of_2(num_tokens)
        _align_kernel[(1,)](
            key_T, permutation_T, moved_1, num_tokens,
            NUM_DEVICES=num_devices, DEVICES_PAD=devices_pad, INDEX_BITS=index_bits, BLOCK_T=block,
            num_warps=max(4, min(16, block // 512)),
        )
        moved = moved_1[0]
    if validate:
        _record_step(plan.info, int(moved), num_tokens)
    else:
        tables.pending_moved += moved
        tables.pending_tokens += num_tokens
    return permutation_T, counts_D


def semmoe_shuffle_reference(plan, token_ids_T, layer: int, prev_experts_Thk=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch-typed `semmoe_shuffle` through the plan's numpy path (plan.shuffle_tokens), on token_ids' device."""
    device = token_ids_T.device if isinstance(token_ids_T, torch.Tensor) else torch.device("cpu")

    def host(array):
        return array.cpu().numpy() if isinstance(array, torch.Tensor) else array

    prev = None if prev_experts_Thk is None else host(prev_experts_Thk)
    permutation, counts = plan.shuffle_tokens(host(token_ids_T), layer, prev)
    return torch.from_numpy(np.asarray(permutation, dtype=np.int64)).to(device), torch.from_numpy(counts).to(device)


@triton.jit
def _inverse_kernel(permutation_ptr, inverse_ptr, num_tokens, BLOCK_T: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = offs < num_tokens
    target = tl.load(permutation_ptr + offs, mask=mask, other=0)
    tl.store(inverse_ptr + target, offs.to(tl.int64), mask=mask)


def _check_permutation(permutation_T: torch.Tensor) -> None:
    num_tokens = permutation_T.numel()
    if permutation_T.dim() != 1 or not _is_integer(permutation_T):
        raise ConfigError(f"permutation must be integer [T], got {permutation_T.dtype} {tuple(permutation_T.shape)}.")
    if num_tokens and not bool((torch.bincount(permutation_T.clamp(-1, num_tokens) + 1, minlength=num_tokens + 2)[1:-1] == 1).all()):
        raise ReproError(f"the permutation of {num_tokens} tokens repeats or misses a position; pass semmoe_shuffle's output.")


def inverse_permutation(permutation_T, *, backend: str = "auto") -> torch.Tensor:
    """int64[T] inv with inv[permutation[i]] = i: applying it after the permutation restores token order."""
    permutation_T = _as_tensor(permutation_T)
    if not use_triton(permutation_T, backend):
        return inverse_permutation_reference(permutation_T)
    _check_permutation(permutation_T)
    inverse_T = torch.empty(permutation_T.numel(), dtype=torch.int64, device=permutation_T.device)
    block_t = 1024
    _inverse_kernel[(triton.cdiv(permutation_T.numel(), block_t),)](permutation_T, inverse_T, permutation_T.numel(), BLOCK_T=block_t)
    return inverse_T


def inverse_permutation_reference(permutation_T) -> torch.Tensor:
    """Torch form of `inverse_permutation`: one scatter of the positions."""
    permutation_T = _as_tensor(permutation_T)
    _check_permutation(permutation_T)
    inverse_T = torch.empty(permutation_T.numel(), dtype=torch.int64, device=permutation_T.device)
    inverse_T[permutation_T.long()] = torch.arange(permutation_T.numel(), device=permutation_T.device)
    return inverse_T
