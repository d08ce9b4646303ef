"""repro.kernels.grouped_gemm: the Triton SwiGLU grouped GEMM against its torch reference and a float64 MoE.

Tolerances are absolute, scaled by the largest reference output: fp32 1e-5 (fp32 accumulation on both
sides, only the summation order differs); fp16 2e-3, about two fp16 ulps at the output's scale, since the
SwiGLU product is stored in fp16 and a one-ulp difference there passes through the down projection.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from kernel_device import COMPILED, interpreter_only, on_kernel_device

from repro.errors import ConfigError, TraceError
from repro.kernels import grouped_gemm
from repro.kernels.grouped_gemm import fused_experts_reference, moe_reference

# the kernel runs where tests/kernel_device.py says (interpreter on a CPU, compiled on CUDA); results come back
fused_experts = on_kernel_device(grouped_gemm.fused_experts)
# bf16 (compiled only): a few bf16 ulps (2**-8) of the output scale, as bench.gpu_check allows
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}


def expert_weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    """(w13 [E, 2I, H], w2 [E, H, I]) scaled so outputs stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.numel():
        scale = want.float().abs().max().item()
        assert (got.float() - want.float()).abs().max().item() <= TOLERANCE[dtype] * scale


def swiglu64(x_mH: torch.Tensor, w13_2IH: torch.Tensor, w2_HI: torch.Tensor) -> torch.Tensor:
    """One expert in float64, written out independently of the module."""
    inter = w2_HI.shape[1]
    gate = x_mH.double() @ w13_2IH[:inter].double().T
    up = x_mH.double() @ w13_2IH[inter:].double().T
    return (F.silu(gate) * up) @ w2_HI.double().T


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows_per_expert", "hidden", "inter"),
    [
        ([5, 0, 17, 11], 48, 40),  # odd M = 33, an empty expert, I not a multiple of the block
        ([33, 0, 0], 32, 64),  # every row in one expert
        ([1, 2, 3, 32], 32, 40),  # one- to three-row experts next to one of exactly two 16-row blocks
        ([0, 0], 32, 64),  # M = 0
    ],
)
def test_fused_experts_matches_reference(dtype, rows_per_expert, hidden, inter):
    if dtype == torch.bfloat16 and not COMPILED:
        pytest.skip("bf16 runs only compiled on a CUDA device (the Triton CPU interpreter computes bf16 wrongly)")
    w13, w2 = expert_weights(len(rows_per_expert), hidden, inter, dtype)
    offsets = torch.cumsum(torch.tensor([0, *rows_per_expert]), 0)
    x = torch.randn(sum(rows_per_expert), hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = fused_experts(x, offsets, w13, w2, backend="triton")
    want = fused_experts_reference(x, offsets, w13, w2)
    assert_close(got, want, dtype)
    truth = torch.cat(
        [swiglu64(x[s:t], w13[e], w2[e]) for e, (s, t) in enumerate(itertools.pairwise(offsets.tolist()))]
    )
    assert_close(want, truth.to(dtype), dtype)
    assert torch.equal(fused_experts(x, offsets, w13, w2, backend="torch"), want)


def test_strided_weights_give_the_same_result():
    # w2 stored as [E, I, H] and viewed transposed: the kernel reads strides, not a contiguous layout
    w13, w2 = expert_weights(3, 32, 40, torch.float32)
    w2_view = w2.transpose(1, 2).contiguous().transpose(1, 2)
    offsets = torch.tensor([0, 9, 9, 23])
    x = torch.randn(23, 32, generator=torch.Generator().manual_seed(2))
    assert_close(fused_experts(x, offsets, w13, w2_view, backend="triton"), fused_experts_reference(x, offsets, w13, w2), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_moe_reference_equals_a_naive_per_expert_loop_through_fused_experts(dtype):
    # 13 tokens, top-3 of 5 experts, expert 2 never chosen, one skipped slot (-1): sort rows by expert by
    # hand, run the Triton grouped GEMM, combine token by token; against moe_reference and float64
    num_tokens, top_k, num_experts, hidden, inter = 13, 3, 5, 32, 40
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(4, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids = torch.where(ids >= 2, ids + 1, ids)
    ids[4, 1] = -1
    weights = torch.rand(num_tokens, top_k, generator=gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13, w2 = expert_weights(num_experts, hidden, inter, dtype, seed=4)
    slots = [(t, j) for e in range(num_experts) for t in range(num_tokens) for j in range(top_k) if ids[t, j] == e]
    counts = torch.bincount(ids[ids >= 0], minlength=num_experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
    y = fused_experts(x[[t for t, _ in slots]], offsets, w13, w2, backend="triton")
    out = torch.zeros(num_tokens, hidden)
    truth = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    for row, (t, j) in enumerate(slots):
        out[t] += weights[t, j] * y[row].float()
        truth[t] += weights[t, j].double() * swiglu64(x[t : t + 1], w13[ids[t, j]], w2[ids[t, j]])[0]
    want = moe_reference(x, ids, weights, w13, w2)
    assert_close(out.to(dtype), want, dtype)
    assert_close(want, truth.to(dtype), dtype)


@interpreter_only
def test_bf16_is_refused_in_the_interpreter_and_runs_as_torch():
    w13, w2 = expert_weights(2, 32, 64, torch.bfloat16)
    offsets = torch.tensor([0, 3, 5])
    x = torch.randn(5, 32).to(torch.bfloat16)
    with pytest.raises(ConfigError, match="bf16 is computed wrongly"):
        fused_experts(x, offsets, w13, w2, backend="triton")
    assert fused_experts(x, offsets, w13, w2, backend="torch").dtype == torch.bfloat16


def test_bad_inputs_raise_one_clear_error():
    w13, w2 = expert_weights(2, 32, 64, torch.float32)
    x = torch.randn(5, 32)
    with pytest.raises(TraceError, match="expert_offsets must rise from 0 to M = 5"):
        fused_experts(x, torch.tensor([0, 4, 3]), w13, w2, backend="triton")
    with pytest.raises(TraceError, match="expert_offsets must rise from 0 to M = 5"):
        fused_experts(x, torch.tensor([0, 2, 4]), w13, w2, backend="triton")
    with pytest.raises(ConfigError, match="shapes disagree"):
        fused_experts(x, torch.tensor([0, 2, 5]), w13, w2[:, :16], backend="triton")
    with pytest.raises(ConfigError, match="one floating dtype"):
        fused_experts(x.half(), torch.tensor([0, 2, 5]), w13, w2, backend="triton")
    with pytest.raises(TraceError, match="expert id 2 is outside the 2 experts"):
        moe_reference(x, torch.tensor([[0], [2], [1], [0], [1]]), torch.ones(5, 1), w13, w2)
