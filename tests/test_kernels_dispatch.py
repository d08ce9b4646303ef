"""Dispatch kernels (layout, permute, unpermute): Triton (CPU interpreter) vs the torch reference over odd-sized
grids with skipped slots and an expert no token picks, and the reference vs a hand-worked example and a plain
Python version.

Tolerances: positions, counts and permuted rows exact; unpermute fp32 rtol 1e-5 / atol 1e-5, fp16 rtol 1e-3 /
atol 1e-3 (one fp16 rounding of an fp32 sum; only the summation order may differ).
Legend: T tokens, k experts per token, E experts, D ranks, H hidden size, M routed slots.
"""

import pytest
import torch
from kernel_device import compiled_only, interpreter_only, on_kernel_device

from repro.errors import ConfigError
from repro.kernels import dispatch
from repro.kernels.dispatch import (
    DispatchLayout,
    dispatch_layout_reference,
    permute_reference,
    unpermute_reference,
)

# the kernels run where tests/kernel_device.py says (interpreter on a CPU, compiled on CUDA); results come back
dispatch_layout = on_kernel_device(dispatch.dispatch_layout)
permute = on_kernel_device(dispatch.permute)
unpermute = on_kernel_device(dispatch.unpermute)

COMBINE_TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float16: {"rtol": 1e-3, "atol": 1e-3}}
TOKENS = (0, 1, 33, 127)
# (E, k, D): E not a power of two (12, 60), top-k 1/2/6/8
SHAPES = [(8, 2, 4), (12, 6, 3), (16, 1, 2), (60, 8, 6), (64, 8, 8)]

# hand-worked example: E = 4 experts on D = 2 ranks, expert_rank = [1, 0, 1, 0]
#   t0 -> experts 0, 2 (both on rank 1: one copy)   t1 -> expert 1 and a skipped slot
#   t2 -> experts 3, 0 (ranks 0 and 1)               t3 -> nothing
HAND_IDS = [[0, 2], [1, -1], [3, 0], [-1, -1]]
HAND_RANK = [1, 0, 1, 0]
# rank 0 receives t1, t2 (rows 0, 1); rank 1 receives t0, t2 (rows 2, 3)
HAND_COPY_POSITION = [[-1, 2], [0, -1], [1, 3], [-1, -1]]
# expert 0: slots (0,0), (2,1) -> rows 0, 1; expert 1: (1,0) -> 2; expert 2: (0,1) -> 3; expert 3: (2,0) -> 4
HAND_SLOT_POSITION = [[0, 3], [2, -1], [4, 1], [-1, -1]]
HAND_OFFSETS = [0, 2, 3, 4, 5]


def random_routing(num_tokens: int, num_experts: int, top_k: int, num_ranks: int, seed: int):
    """(ids int64[T, k] with ~10 % skipped slots and expert 1 never picked, expert_rank int64[E])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=g)
    ids[ids == 1] = 0  # an expert with no tokens
    ids[torch.rand(num_tokens, top_k, generator=g) < 0.1] = -1
    return ids, torch.randint(0, num_ranks, (num_experts,), generator=g)


def python_layout(ids: list, expert_rank: list, num_ranks: int):
    """Plain Python dispatch_layout: (tokens per rank, tokens per expert, copy positions)."""
    sends = [sorted({expert_rank[e] for e in row if e >= 0}) for row in ids]
    per_rank = [sum(d in s for s in sends) for d in range(num_ranks)]
    per_expert = [sum(row.count(e) for row in ids) for e in range(len(expert_rank))]
    start = [sum(per_rank[:d]) for d in range(num_ranks)]
    positions, seen = [], [0] * num_ranks
    for s in sends:
        positions.append([start[d] + seen[d] if d in s else -1 for d in range(num_ranks)])
        for d in s:
            seen[d] += 1
    return per_rank, per_expert, positions


def python_permute(ids: list, num_experts: int):
    """Plain Python permute bookkeeping: (expert offsets, slot positions, source token of each row)."""
    slots = sorted(((e, t, j) for t, row in enumerate(ids) for j, e in enumerate(row) if e >= 0))
    offsets = [sum(1 for e, _, _ in slots if e < x) for x in range(num_experts + 1)]
    positions = [[-1] * len(row) for row in ids]
    for row, (_, t, j) in enumerate(slots):
        positions[t][j] = row
    return offsets, positions, [t for _, t, _ in slots]


# ---- reference vs hand-worked example and plain Python ---------------------------------------------------


def test_layout_reference_hand_worked():
    layout = dispatch_layout_reference(torch.tensor(HAND_IDS), torch.tensor(HAND_RANK), 2)
    assert isinstance(layout, DispatchLayout)
    assert layout.tokens_per_rank_D.tolist() == [2, 2]
    assert layout.tokens_per_expert_E.tolist() == [2, 1, 1, 1]
    assert layout.copy_position_TD.tolist() == HAND_COPY_POSITION
    assert all(t.dtype == torch.int64 for t in layout)


def test_permute_unpermute_reference_hand_worked():
    x = torch.arange(12, dtype=torch.float32).view(4, 3)
    x_sorted, offsets, slot_position = permute_reference(x, torch.tensor(HAND_IDS), 4)
    assert offsets.tolist() == HAND_OFFSETS
    assert slot_position.tolist() == HAND_SLOT_POSITION
    assert torch.equal(x_sorted, x[[0, 2, 1, 0, 2]])
    y = torch.arange(15, dtype=torch.float32).view(5, 3) ** 2
    w = torch.tensor([[0.5, 0.25], [2.0, 9.0], [1.0, 3.0], [7.0, 7.0]])
    out = unpermute_reference(y, slot_position, w)
    expected = torch.stack([0.5 * y[0] + 0.25 * y[3], 2.0 * y[2], 1.0 * y[4] + 3.0 * y[1], torch.zeros(3)])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize(("num_experts", "top_k", "num_ranks"), [(12, 6, 3), (64, 8, 8)])
def test_references_match_plain_python(num_experts, top_k, num_ranks):
    ids, ranks = random_routing(33, num_experts, top_k, num_ranks, seed=num_experts)
    per_rank, per_expert, positions = python_layout(ids.tolist(), ranks.tolist(), num_ranks)
    layout = dispatch_layout_reference(ids, ranks, num_ranks)
    assert layout.tokens_per_rank_D.tolist() == per_rank
    assert layout.tokens_per_expert_E.tolist() == per_expert
    assert layout.copy_position_TD.tolist() == positions
    x = torch.randn(33, 5, generator=torch.Generator().manual_seed(0))
    offsets, slot_positions, sources = python_permute(ids.tolist(), num_experts)
    x_sorted, ref_offsets, ref_positions = permute_reference(x, ids, num_experts)
    assert ref_offsets.tolist() == offsets and ref_positions.tolist() == slot_positions
    assert torch.equal(x_sorted, x[sources])


# ---- Triton (interpreter) vs the reference ---------------------------------------------------------------


def test_hand_worked_example_through_triton():
    layout = dispatch_layout(torch.tensor(HAND_IDS), torch.tensor(HAND_RANK), 2, backend="triton")
    assert layout.copy_position_TD.tolist() == HAND_COPY_POSITION
    x = torch.arange(12, dtype=torch.float32).view(4, 3)
    x_sorted, offsets, slot_position = permute(x, torch.tensor(HAND_IDS), 4, backend="triton")
    assert offsets.tolist() == HAND_OFFSETS and slot_position.tolist() == HAND_SLOT_POSITION


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize(("num_experts", "top_k", "num_ranks"), SHAPES)
def test_dispatch_layout_triton_matches_reference(num_tokens, num_experts, top_k, num_ranks):
    ids, ranks = random_routing(num_tokens, num_experts, top_k, num_ranks, seed=num_tokens + num_experts)
    for id_dtype in (torch.int64, torch.int32):
        layout = dispatch_layout(ids.to(id_dtype), ranks, num_ranks, backend="triton")
        reference = dispatch_layout_reference(ids, ranks, num_ranks)
        for name, got, want in zip(DispatchLayout._fields, layout, reference, strict=True):
            assert got.dtype == torch.int64, name
            assert torch.equal(got, want), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize(("num_experts", "top_k", "num_ranks"), SHAPES)
def test_permute_unpermute_triton_match_reference(dtype, num_tokens, num_experts, top_k, num_ranks):
    seed = num_tokens * 7 + num_experts
    ids, _ = random_routing(num_tokens, num_experts, top_k, num_ranks, seed=seed)
    g = torch.Generator().manual_seed(seed)
    hidden = 33
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    x_sorted, offsets, slot_position = permute(x, ids, num_experts, backend="triton")
    ref_sorted, ref_offsets, ref_position = permute_reference(x, ids, num_experts)
    assert torch.equal(offsets, ref_offsets) and torch.equal(slot_position, ref_position)
    assert x_sorted.dtype == dtype and torch.equal(x_sorted, ref_sorted)
    assert offsets[1] == offsets[2]  # expert 1 is empty
    y = torch.randn(x_sorted.shape[0], hidden, generator=g).to(dtype)
    w = torch.rand(num_tokens, top_k, generator=g)
    out = unpermute(y, slot_position, w, backend="triton")
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    torch.testing.assert_close(out, unpermute_reference(y, slot_position, w), **COMBINE_TOL[dtype])


def test_round_trip_with_identity_experts():
    """unpermute(permute(x)) with identity experts is sum_j w[t, j] x[t] over routed slots."""
    ids, _ = random_routing(127, 16, 6, 4, seed=11)
    x = torch.randn(127, 40, generator=torch.Generator().manual_seed(12))
    w = torch.rand(127, 6, generator=torch.Generator().manual_seed(13))
    x_sorted, _, slot_position = permute(x, ids, 16, backend="triton")
    out = unpermute(x_sorted, slot_position, w, backend="triton")
    torch.testing.assert_close(out, ((ids >= 0) * w).sum(dim=1, keepdim=True) * x, rtol=1e-5, atol=1e-5)


def test_all_slots_skipped():
    ids = torch.full((5, 2), -1)
    x_sorted, offsets, slot_position = permute(torch.ones(5, 4), ids, 8, backend="triton")
    assert x_sorted.shape == (0, 4) and offsets.tolist() == [0] * 9 and (slot_position == -1).all()
    out = unpermute(x_sorted, slot_position, torch.ones(5, 2), backend="triton")
    assert torch.equal(out, torch.zeros(5, 4))
    layout = dispatch_layout(ids, torch.zeros(8, dtype=torch.int64), 3, backend="triton")
    assert layout.tokens_per_rank_D.tolist() == [0, 0, 0] and (layout.copy_position_TD == -1).all()


# ---- argument checks, backends, bf16 ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_arguments_raise_one_config_error(backend):
    ids = torch.tensor([[0, 9]])
    with pytest.raises(ConfigError, match="topk_ids are >= the 8 experts"):
        permute(torch.zeros(1, 4), ids, 8, backend=backend)
    with pytest.raises(ConfigError, match="topk_ids are >= the 8 experts"):
        dispatch_layout(ids, torch.zeros(8, dtype=torch.int64), 2, backend=backend)
    with pytest.raises(ConfigError, match="expert_rank"):
        dispatch_layout(torch.tensor([[0, 1]]), torch.tensor([0, 2, 1, 0]), 2, backend=backend)
    with pytest.raises(ConfigError, match="integer"):
        permute(torch.zeros(1, 4), ids.float(), 8, backend=backend)
    with pytest.raises(ConfigError, match="tokens of topk_ids"):
        permute(torch.zeros(2, 4), ids, 8, backend=backend)
    with pytest.raises(ConfigError, match="rows"):
        unpermute(torch.zeros(2, 4), torch.tensor([[0, 2]]), torch.ones(1, 2), backend=backend)
    with pytest.raises(ConfigError, match="same"):
        unpermute(torch.zeros(2, 4), torch.tensor([[0, 1]]), torch.ones(1, 3), backend=backend)


@interpreter_only
def test_bf16_refused_on_cpu_with_a_clear_message():
    x = torch.zeros(3, 4, dtype=torch.bfloat16)
    ids = torch.tensor([[0], [1], [0]])
    for backend in ("triton", "auto"):
        with pytest.raises(ConfigError, match="bf16 is computed wrongly by the Triton CPU interpreter"):
            permute(x, ids, 2, backend=backend)
        with pytest.raises(ConfigError, match="bf16"):
            unpermute(x, ids, torch.ones(3, 1), backend=backend)
    x_sorted, _, _ = permute(x, ids, 2, backend="torch")
    assert x_sorted.dtype == torch.bfloat16


@compiled_only
def test_bf16_numerics():
    ids, _ = random_routing(127, 64, 8, 8, seed=14)
    x = torch.randn(127, 64, dtype=torch.bfloat16)
    w = torch.rand(127, 8)
    x_sorted, offsets, slot_position = permute(x, ids, 64, backend="triton")
    ref_sorted, ref_offsets, ref_position = permute_reference(x, ids, 64)
    assert torch.equal(x_sorted, ref_sorted) and torch.equal(slot_position, ref_position)
    torch.testing.assert_close(
        unpermute(x_sorted, slot_position, w, backend="triton"), unpermute_reference(x_sorted, slot_position, w),
        rtol=1e-2, atol=1e-2,
    )
