"""Top-k gating kernels: Triton (CPU interpreter) vs the torch reference over odd-sized grids, and the
reference vs hand-worked examples and an independent numpy version.

Tolerances: ids exact; weights rtol 1e-5 / atol 1e-6 (fp32 math on identical inputs, only exp/sigmoid and
summation order differ). Legend: T tokens, E experts, k experts per token, G groups.
"""

import math

import numpy as np
import pytest
import torch
from kernel_device import compiled_only, interpreter_only, on_kernel_device

from repro.errors import ConfigError
from repro.kernels import gating
from repro.kernels.gating import topk_sigmoid_grouped_reference, topk_softmax_reference

# the kernels run where tests/kernel_device.py says (interpreter on a CPU, compiled on CUDA); results come back
topk_softmax = on_kernel_device(gating.topk_softmax)
topk_sigmoid_grouped = on_kernel_device(gating.topk_sigmoid_grouped)

WEIGHT_TOL = {"rtol": 1e-5, "atol": 1e-6}
TOKENS = (0, 1, 33, 127)


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def random_logits(num_tokens: int, num_experts: int, dtype: torch.dtype, seed: int, ties: bool = False):
    """float[T, E]; with ties, small integers so equal logits (and equal probabilities) are common."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        return torch.randint(-2, 3, (num_tokens, num_experts), generator=g).to(dtype)
    return (2 * torch.randn(num_tokens, num_experts, generator=g)).to(dtype)


# ---- reference vs hand-worked examples -------------------------------------------------------------------


def test_softmax_reference_hand_worked():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    z = math.exp(1) + 2 * math.exp(3) + 1
    weights, ids = topk_softmax_reference(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [0, 1]]  # the tie 3.0 == 3.0 goes to the lower expert id first
    torch.testing.assert_close(weights, torch.tensor([[math.exp(3) / z] * 2, [0.25, 0.25]]), **WEIGHT_TOL)
    weights, _ = topk_softmax_reference(logits, 3, renormalize=True)
    top3 = [math.exp(3), math.exp(3), math.exp(1)]
    torch.testing.assert_close(weights[0], torch.tensor([v / sum(top3) for v in top3]), **WEIGHT_TOL)
    torch.testing.assert_close(weights[1], torch.full((3,), 1 / 3), **WEIGHT_TOL)


def test_grouped_reference_hand_worked():
    # token 0: equal scores (0.5), the bias alone picks: group scores 1.1, 1.6, 1.0, 1.45 -> groups 1 and 3,
    # then top-3 of choice over experts {2, 3, 6, 7} = 0.8 (2), 0.8 (3, tie -> after 2), 0.75 (7)
    # token 1: no bias; group scores s(2)+s(-1), 2 s(0), 2 s(1), s(-2)+s(0) -> groups 2 and 0; top-2 over
    # {0, 1, 4, 5}: expert 0 (s(2)), then 4 and 5 tie at s(1) -> 4
    logits = torch.tensor([[0.0] * 8, [2.0, -1.0, 0.0, 0.0, 1.0, 1.0, -2.0, 0.0]])
    bias = torch.tensor([0.1, 0.0, 0.3, 0.3, 0.0, 0.0, 0.2, 0.25])
    weights, ids = topk_sigmoid_grouped_reference(logits[:1], bias, 3, 4, 2, True, 2.5)
    assert ids.tolist() == [[2, 3, 7]]
    torch.testing.assert_close(weights, torch.full((1, 3), 2.5 / 3), **WEIGHT_TOL)
    weights, ids = topk_sigmoid_grouped_reference(logits[1:], torch.zeros(8), 2, 4, 2, False)
    assert ids.tolist() == [[0, 4]]  # raw sigmoid scores, not renormalised; the bias never enters the weights
    torch.testing.assert_close(weights, torch.tensor([[sigmoid(2.0), sigmoid(1.0)]]), **WEIGHT_TOL)
    weights, _ = topk_sigmoid_grouped_reference(logits[1:], torch.zeros(8), 2, 4, 2, True)
    total = sigmoid(2.0) + sigmoid(1.0)
    torch.testing.assert_close(weights, torch.tensor([[sigmoid(2.0) / total, sigmoid(1.0) / total]]), **WEIGHT_TOL)


def numpy_topk_softmax(logits: np.ndarray, top_k: int, renormalize: bool):
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, ids, axis=1)
    return (weights / weights.sum(axis=1, keepdims=True) if renormalize else weights), ids


def numpy_grouped(logits, bias, top_k, num_groups, topk_groups, renormalize, scaling):
    scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + bias
    num_tokens, num_experts = logits.shape
    group_score = np.sort(choice.reshape(num_tokens, num_groups, -1), axis=2)[:, :, -2:].sum(axis=2)
    kept = np.argsort(-group_score, axis=1, kind="stable")[:, :topk_groups]
    in_kept = (np.arange(num_experts)[None, :, None] // (num_experts // num_groups) == kept[:, None, :]).any(axis=2)
    ids = np.argsort(-np.where(in_kept, choice, -np.inf), axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, ids, axis=1)
    if renormalize:
        weights = weights / (weights.sum(axis=1, keepdims=True) + 1e-20)
    return weights * scaling, ids


@pytest.mark.parametrize("ties", [False, True])
def test_softmax_reference_matches_numpy(ties):
    logits = random_logits(33, 12, torch.float32, seed=1, ties=ties)
    for renormalize in (True, False):
        weights, ids = topk_softmax_reference(logits, 4, renormalize)
        np_weights, np_ids = numpy_topk_softmax(logits.double().numpy(), 4, renormalize)
        assert np.array_equal(ids.numpy(), np_ids)
        np.testing.assert_allclose(weights.numpy(), np_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ties", [False, True])
def test_grouped_reference_matches_numpy(ties):
    logits = random_logits(33, 16, torch.float32, seed=2, ties=ties)
    bias = torch.zeros(16) if ties else 0.1 * torch.randn(16, generator=torch.Generator().manual_seed(3))
    weights, ids = topk_sigmoid_grouped_reference(logits, bias, 4, 4, 2, True, 2.5)
    np_weights, np_ids = numpy_grouped(logits.numpy(), bias.numpy(), 4, 4, 2, True, 2.5)
    assert np.array_equal(ids.numpy(), np_ids)
    np.testing.assert_allclose(weights.numpy(), np_weights, rtol=1e-5, atol=1e-6)


# ---- Triton (interpreter) vs the reference ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize(("num_experts", "top_k"), [(8, 2), (12, 1), (16, 6), (60, 8), (64, 8)])
def test_topk_softmax_triton_matches_reference(dtype, num_tokens, num_experts, top_k):
    logits = random_logits(num_tokens, num_experts, dtype, seed=num_tokens * 100 + num_experts)
    logits[:, num_experts // 2] = -1e4  # an expert no token picks
    for renormalize in (True, False):
        weights, ids = topk_softmax(logits, top_k, renormalize, backend="triton")
        ref_weights, ref_ids = topk_softmax_reference(logits, top_k, renormalize)
        assert ids.dtype == torch.int64 and weights.dtype == torch.float32
        assert weights.shape == ids.shape == (num_tokens, top_k)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, **WEIGHT_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_topk_softmax_triton_ties(dtype):
    logits = random_logits(127, 16, dtype, seed=4, ties=True)
    weights, ids = topk_softmax(logits, 6, True, backend="triton")
    ref_weights, ref_ids = topk_softmax_reference(logits, 6, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, **WEIGHT_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize(
    ("num_experts", "num_groups", "topk_groups", "top_k"),
    [(64, 8, 4, 8), (16, 4, 2, 2), (12, 3, 2, 3), (60, 6, 3, 6), (8, 1, 1, 1)],
)
def test_topk_sigmoid_grouped_triton_matches_reference(dtype, num_tokens, num_experts, num_groups, topk_groups, top_k):
    seed = num_tokens * 100 + num_experts
    logits = random_logits(num_tokens, num_experts, dtype, seed=seed)
    bias = 0.1 * torch.randn(num_experts, generator=torch.Generator().manual_seed(seed + 1))
    for renormalize, scaling in ((True, 2.5), (False, 1.0)):
        args = (logits, bias, top_k, num_groups, topk_groups, renormalize, scaling)
        weights, ids = topk_sigmoid_grouped(*args, backend="triton")
        ref_weights, ref_ids = topk_sigmoid_grouped_reference(*args)
        assert weights.shape == ids.shape == (num_tokens, top_k)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, **WEIGHT_TOL)


def test_topk_sigmoid_grouped_triton_ties():
    logits = random_logits(127, 64, torch.float32, seed=5, ties=True)
    args = (logits, torch.zeros(64), 8, 8, 4, True, 2.5)
    weights, ids = topk_sigmoid_grouped(*args, backend="triton")
    ref_weights, ref_ids = topk_sigmoid_grouped_reference(*args)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, **WEIGHT_TOL)


def test_hand_worked_examples_through_triton():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert topk_softmax(logits, 2, True, backend="triton")[1].tolist() == [[1, 2], [0, 1]]
    bias = torch.tensor([0.1, 0.0, 0.3, 0.3, 0.0, 0.0, 0.2, 0.25])
    assert topk_sigmoid_grouped(torch.zeros(1, 8), bias, 3, 4, 2, True, backend="triton")[1].tolist() == [[2, 3, 7]]


# ---- argument checks, backends, bf16 ---------------------------------------------------------------------


def test_bad_arguments_raise_one_config_error():
    logits = torch.zeros(4, 12)
    with pytest.raises(ConfigError, match="top_k"):
        topk_softmax(logits, 13, True)
    with pytest.raises(ConfigError, match="num_groups"):
        topk_sigmoid_grouped(logits, torch.zeros(12), 2, 5, 2, True)
    with pytest.raises(ConfigError, match="num_groups"):
        topk_sigmoid_grouped(logits, torch.zeros(12), 1, 12, 1, True)  # groups of one expert have no top-2
    with pytest.raises(ConfigError, match="topk_groups"):
        topk_sigmoid_grouped(logits, torch.zeros(12), 2, 4, 5, True)
    with pytest.raises(ConfigError, match="kept groups"):
        topk_sigmoid_grouped(logits, torch.zeros(12), 7, 4, 2, True)
    with pytest.raises(ConfigError, match="correction_bias"):
        topk_sigmoid_grouped(logits, torch.zeros(8), 2, 4, 2, True)
    with pytest.raises(ConfigError, match="backend"):
        topk_softmax(logits, 2, True, backend="cuda")


def test_torch_backend_is_the_reference():
    logits = random_logits(33, 12, torch.float32, seed=6)
    weights, ids = topk_softmax(logits, 3, True, backend="torch")
    ref_weights, ref_ids = topk_softmax_reference(logits, 3, True)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


@interpreter_only
def test_bf16_refused_on_cpu_with_a_clear_message():
    logits = random_logits(4, 8, torch.bfloat16, seed=7)
    for backend in ("triton", "auto"):
        with pytest.raises(ConfigError, match="bf16 is computed wrongly by the Triton CPU interpreter"):
            topk_softmax(logits, 2, True, backend=backend)
        with pytest.raises(ConfigError, match="bf16"):
            topk_sigmoid_grouped(logits, torch.zeros(8), 2, 4, 2, True, backend=backend)
    assert torch.equal(topk_softmax(logits, 2, True, backend="torch")[1], topk_softmax_reference(logits, 2, True)[1])


@compiled_only
def test_bf16_numerics():
    logits = random_logits(127, 64, torch.bfloat16, seed=8)
    weights, ids = topk_softmax(logits, 8, True, backend="triton")
    ref_weights, ref_ids = topk_softmax_reference(logits, 8, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, **WEIGHT_TOL)
