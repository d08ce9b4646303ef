"""repro.kernels.shuffle: the Triton Algorithm 3 equals SemMoEPlan.shuffle_tokens bit for bit (interpreter).

Plans are fitted on a tiny synthetic trace (tokens 0..39 profiled, 40..59 out of vocabulary of the profile,
60+ outside the model's vocabulary). Their Markov confidences are overwritten with quarter steps so the
history overrides some tokens and ties with T_p on purpose; fitted T_p already ties across token rows.
"""

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_device import on_kernel_device

from repro.errors import ConfigError, ReproError, TraceError
from repro.kernels import shuffle
from repro.kernels.shuffle import semmoe_shuffle_reference
from repro.parallel import ParallelConfig
from repro.systems.semmoe import tp
from repro.systems.semmoe.system import SemMoE
from repro.traces import TraceMeta, make_trace

# the kernels run where tests/kernel_device.py says (interpreter on a CPU, compiled on CUDA); results come back
semmoe_shuffle = on_kernel_device(shuffle.semmoe_shuffle)
inverse_permutation = on_kernel_device(shuffle.inverse_permutation)

LAYERS, EXPERTS, TOP_K, VOCAB, PROFILED = 3, 12, 2, 60, 40


def tiny_trace(seed: int = 0):
    """24 requests x 16 tokens; expert 1 of each token follows its id, expert 2 is noise (distinct from 1)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(PROFILED, size=24 * 16)
    first = (tokens * 5)[:, None] + 3 * np.arange(LAYERS)
    second = first + 1 + rng.integers(EXPERTS - 1, size=first.shape)
    experts = np.stack([first % EXPERTS, second % EXPERTS], axis=2)
    meta = TraceMeta(model="tiny", num_experts=EXPERTS, top_k=TOP_K, layer_ids=tuple(range(LAYERS)), vocab_size=VOCAB)
    return make_trace(meta, np.arange(25) * 16, tokens, experts)


@functools.cache
def fitted_plan(devices: int, lookback: int, devices_per_node: int = 8):
    parallel = ParallelConfig(devices=devices, attention="tp", tokens_per_step=64, devices_per_node=devices_per_node)
    system = SemMoE(n_steps=1, lookback=lookback, hierarchical=devices_per_node < devices)
    plan = system.fit(tiny_trace(), parallel, np.random.default_rng(1))
    if plan.markov_confidence is not None:
        rng = np.random.default_rng(devices * 10 + lookback)
        plan.markov_confidence[:] = np.round(rng.random(plan.markov_confidence.shape) * 4) / 4
    return plan


def step(rng, num_tokens: int, history: int):
    """(token ids int32[T] with repeats and unprofiled ids, prev_experts int16[T, h', k] or None)."""
    tokens = rng.integers(VOCAB, size=num_tokens).astype(np.int32)
    prev = np.argsort(rng.random((num_tokens, history, EXPERTS)), axis=2)[..., :TOP_K].astype(np.int16)
    return tokens, (prev if history else None)


def assert_same_as_plan(plan, tokens, layer, prev, **kwargs):
    plan.reset()
    want_permutation, want_counts = plan.shuffle_tokens(tokens, layer, prev)
    want_info = dict(plan.info)
    plan.reset()
    permutation, counts = semmoe_shuffle(plan, tokens, layer, prev, backend="triton", **kwargs)
    assert permutation.dtype == counts.dtype == torch.int64
    assert np.array_equal(permutation.numpy(), want_permutation)
    assert np.array_equal(counts.numpy(), want_counts)
    assert plan.info == want_info
    return permutation


@pytest.mark.parametrize("devices", [2, 3, 4])
@pytest.mark.parametrize("lookback", [0, 1, 2])
def test_prediction_equals_plan_on_every_layer_and_history(devices, lookback, monkeypatch):
    # kernel 1 over every step size, layer and history length; the align step runs as torch here because
    # tl.sort is slow in the interpreter (~0.3 s per 128-token step), kernel 2 is covered below
    monkeypatch.setattr(shuffle, "MAX_SORT_TOKENS", 0)
    plan = fitted_plan(devices, lookback)
    rng = np.random.default_rng(devices + 7 * lookback)
    for num_tokens in (0, 1, 7, 64, 100, 300):  # 300: two programs of kernel 1
        for layer in range(LAYERS):
            # None, shorter than the lookback (ignored), exactly h, one layer more than used
            for history in sorted({0, max(layer - 1, 0), layer, min(layer + 1, 3)}):
                tokens, prev = step(rng, num_tokens, history)
                assert_same_as_plan(plan, tokens, layer, prev)


@pytest.mark.parametrize(("devices", "lookback"), [(1, 1), (2, 0), (3, 1), (4, 2)])
def test_align_kernel_equals_plan(devices, lookback):
    plan = fitted_plan(devices, lookback)
    rng = np.random.default_rng(devices)
    for num_tokens in (0, 1, 7, 64, 100):
        tokens, prev = step(rng, num_tokens, 2)
        assert_same_as_plan(plan, tokens, 2, prev)


def test_history_overrides_some_tokens_and_align_moves_some():
    # guards the equality test above against a degenerate instance where the Markov branch never fires
    plan = fitted_plan(3, 2)
    tokens, prev = step(np.random.default_rng(5), 100, 2)
    device, _ = plan.predicted_devices(tokens, 2, prev)
    table_device = plan.token_device[2, plan.row_of_token[tokens]]
    assert 0 < (device != table_device).sum() < len(tokens)
    assert_same_as_plan(plan, tokens, 2, prev)
    assert plan.info["align_moved_tokens"] > 0


@settings(max_examples=25, deadline=None)
@given(
    num_tokens=st.integers(0, 100),
    layer=st.integers(0, LAYERS - 1),
    history=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_shuffle_equals_plan_randomized(num_tokens, layer, history, seed):
    tokens, prev = step(np.random.default_rng(seed), num_tokens, history)
    assert_same_as_plan(fitted_plan(4, 2), tokens, layer, prev)


@pytest.mark.parametrize("seed", range(3))
def test_topology_aware_plan_aligns_by_node_like_the_plan(seed):
    # 4 devices as 2 nodes x 2: the plan aligns by node first; the kernel's torch align must do the same
    plan = fitted_plan(4, 1, devices_per_node=2)
    assert plan.info["hierarchical"]
    rng = np.random.default_rng(seed)
    for num_tokens in (0, 1, 7, 64, 100):
        tokens, prev = step(rng, num_tokens, 1)
        assert_same_as_plan(plan, tokens, 2, prev)


def test_confidence_ties_break_by_token_index():
    # every token and history equally confident: align must keep the lowest indices of each device group
    plan = fitted_plan(2, 1)
    saved = plan.token_confidence.copy(), plan.markov_confidence.copy()
    tokens, prev = step(np.random.default_rng(3), 41, 1)
    try:
        plan.token_confidence[:] = 0.5
        plan.markov_confidence[:] = 0.5
        shuffle.forget_plan_tables(plan)  # changed in place: a device copy must be made again
        assert_same_as_plan(plan, tokens, 1, prev)
    finally:
        plan.token_confidence[:], plan.markov_confidence[:] = saved
        shuffle.forget_plan_tables(plan)


def test_signed_zero_confidences_tie():
    # -0.0 and 0.0 tie in numpy's sort; their bit patterns differ, the packed key must not
    plan = fitted_plan(2, 0)
    saved = plan.token_confidence.copy()
    tokens, _ = step(np.random.default_rng(3), 41, 0)
    try:
        plan.token_confidence[:, ::2] = -0.0
        plan.token_confidence[:, 1::2] = 0.0
        _, confidence = plan.predicted_devices(tokens, 1, None)
        assert np.signbit(confidence).any() and not np.signbit(confidence).all()
        shuffle.forget_plan_tables(plan)
        assert_same_as_plan(plan, tokens, 1, None)
    finally:
        plan.token_confidence[:] = saved
        shuffle.forget_plan_tables(plan)


def test_torch_inputs_and_reference_backend_give_the_same_result():
    plan = fitted_plan(4, 1)
    tokens, prev = step(np.random.default_rng(4), 64, 1)
    want = assert_same_as_plan(plan, tokens, 1, prev)
    for backend in ("triton", "torch"):
        plan.reset()
        permutation, counts = semmoe_shuffle(plan, torch.from_numpy(tokens), 1, torch.from_numpy(prev), backend=backend)
        assert torch.equal(permutation, want) and counts.tolist() == [16, 16, 16, 16]
    plan.reset()
    assert torch.equal(semmoe_shuffle_reference(plan, tokens, 1, prev)[0], want)


def test_bad_inputs_raise_the_plans_errors():
    plan = fitted_plan(2, 2)
    for bad in (np.array([3, VOCAB]), np.array([-1, 3])):
        with pytest.raises(TraceError, match="outside the plan's vocabulary"):
            plan.shuffle_tokens(bad, 0, None)
        with pytest.raises(TraceError, match="outside the plan's vocabulary"):
            semmoe_shuffle(plan, bad, 0, None, backend="triton")
    tokens, prev = step(np.random.default_rng(0), 5, 2)
    with pytest.raises(TraceError, match="expert ids outside 0..11"):
        semmoe_shuffle(plan, tokens, 2, np.full_like(prev, EXPERTS), backend="triton")
    with pytest.raises(ConfigError, match=r"prev_experts must be integer \[T, h', k\] with T = 5"):
        semmoe_shuffle(plan, tokens, 2, prev[:4], backend="triton")
    with pytest.raises(ConfigError, match="layer 3 is outside the plan's 3 MoE layers"):
        semmoe_shuffle(plan, tokens, LAYERS, None, backend="triton")


def test_inverse_permutation_restores_order():
    rng = np.random.default_rng(2)
    for num_tokens in (0, 1, 7, 100, 1500):  # 1500 spans two kernel blocks
        permutation = torch.from_numpy(rng.permutation(num_tokens))
        inverse = inverse_permutation(permutation, backend="triton")
        assert torch.equal(inverse, torch.from_numpy(tp.inverse_permutation(permutation.numpy())))
        assert torch.equal(permutation[inverse], torch.arange(num_tokens))
        assert torch.equal(inverse_permutation(permutation, backend="torch"), inverse)
    for bad in ([0, 0, 1], [0, 3, 1]):
        with pytest.raises(ReproError, match="repeats or misses a position"):
            inverse_permutation(torch.tensor(bad), backend="triton")
