"""The tiny Mixtral over real multi-process EP (repro.exec.model) against the transformers model and the evaluator.

References: logits of `MixtralForCausalLM` itself (one request at a time), the routing `capture_routing` recorded
from it, and the bytes `repro.eval.accounting` predicts for the same plan (account(home_devices(plan, trace))).
One small random-init model, a trace of it with a restricted vocabulary (real ids != model ids, so the TP
shuffle must read the trace's ids), plans from ep, semmoe and a hand-built placement with replicated experts
whose TP shuffle reads the routing history.
Each launch costs a few seconds, so the grid is small: DP and TP each at 2 and 4 gloo ranks.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from repro.errors import ConfigError
from repro.eval.accounting import account, home_devices
from repro.exec.model import forward, load_tiny_model, reference_logits, run_model, weights_of
from repro.parallel import ParallelConfig
from repro.routing.hf_capture import capture_routing
from repro.routing.tiny_model import TINY_DEFAULTS, VocabMap, tiny_mixtral_config
from repro.systems.base import Placement, Plan, even_counts
from repro.systems.ep import VanillaEP
from repro.systems.semmoe import SemMoE
from repro.traces.ops import select_requests
from repro.workloads.request import Request

MODEL_VOCAB = 97  # model id 96 is UNK: real ids not divisible by 3 map to it
CFG = {
    **TINY_DEFAULTS,
    "num_layers": 3,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_experts": 8,
    "top_k": 2,
    "num_attention_heads": 4,
}
TOL = 1e-4


@pytest.fixture(scope="module")
def setup():
    from transformers import MixtralForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MixtralForCausalLM(tiny_mixtral_config(CFG, MODEL_VOCAB)).eval()
    vocab = VocabMap(real_ids=np.arange(MODEL_VOCAB - 1, dtype=np.int64) * 3, real_vocab_size=3 * MODEL_VOCAB)
    rng = np.random.default_rng(0)
    requests = [
        Request(id=f"r{i}", dataset="unit", label=f"c{i % 2}", token_ids=rng.integers(0, 3 * MODEL_VOCAB, n).astype(np.int32))
        for i, n in enumerate([7, 25, 1, 18, 12, 3, 22, 9])
    ]
    trace = capture_routing(
        model, requests, model_name="tiny", tokenizer="unit", vocab_size=3 * MODEL_VOCAB, dataset="unit",
        input_ids_of=vocab.to_model, real_ids_of=vocab.to_real,
    )
    assert trace.num_tokens == 97  # the TP step size below relies on it
    return model, vocab, trace


def replicated_plan(num_layers: int, parallel: ParallelConfig) -> Plan:
    """8 experts on 4 devices x 3 slots: every expert once, experts 0..3 (shifted per layer) twice."""
    base = np.array([0, 1, 4, 2, 3, 5, 6, 7, 0, 4, 5, 1])  # replicas on other devices than the originals
    rows = np.stack([(base + layer) % 8 for layer in range(num_layers)])
    return Plan(Placement(rows, parallel.devices, 8), parallel)


class HistoryPlan(Plan):
    """TP slices sorted by the routing history, read as a base-E number (oldest layer first): a wrong, missing or
    reordered history changes every slice, which the evaluator's byte count then catches."""

    def shuffle_tokens(self, token_ids, layer, prev_experts):
        if prev_experts is None:
            return super().shuffle_tokens(token_ids, layer, prev_experts)
        digits = self.placement.num_experts ** np.arange(prev_experts.shape[1])[::-1]
        key = (prev_experts[:, :, 0].astype(np.int64) * digits).sum(axis=1)
        return np.argsort(key, kind="stable"), even_counts(len(token_ids), self.parallel.devices)


def make_plan(kind: str, trace, parallel: ParallelConfig) -> Plan:
    if kind == "ep":
        return VanillaEP().fit(trace, parallel, np.random.default_rng(0))
    if kind == "semmoe":
        return SemMoE(n_steps=1).fit(trace, parallel, np.random.default_rng(0))
    return HistoryPlan(replicated_plan(trace.num_layers, parallel).placement, parallel)


def test_hand_written_forward_matches_transformers(setup):
    model, vocab, trace = setup
    ids = vocab.to_model(trace.token_ids)
    offsets = np.asarray(trace.offsets)
    logits, experts = forward(weights_of(model), torch.as_tensor(ids), torch.as_tensor(offsets), backend="torch")
    reference = np.concatenate([logits for _, logits in reference_logits(model, ids, offsets)])
    assert np.abs(reference).max() > 0.1  # not a degenerate comparison
    np.testing.assert_allclose(logits.numpy(), reference, atol=TOL, rtol=0)
    np.testing.assert_array_equal(experts.numpy(), trace.experts)


@pytest.mark.parametrize(
    ("attention", "devices", "kind", "num_requests"),
    # DP at 4 ranks with 3 requests: one rank has no tokens yet joins every all-to-all
    [("dp", 2, "semmoe", 8), ("dp", 4, "ep", 3), ("tp", 2, "semmoe", 8), ("tp", 4, "replicated_history", 8)],
)
def test_distributed_run_matches_model_trace_and_evaluator(setup, attention, devices, kind, num_requests):
    model, vocab, trace = setup
    # 32-token TP steps cut requests in two, and the last step of 97 tokens holds one (3 ranks get empty slices)
    parallel = ParallelConfig(devices=devices, attention=attention, tokens_per_step=32, bytes_per_token=CFG["hidden_size"] * 4)
    plan = make_plan(kind, trace, parallel)
    trace = select_requests(trace, np.arange(num_requests))
    summary = run_model(plan, trace, model, vocab, backend="gloo", kernel_backend="torch", timeout_s=60)

    assert summary["max_logit_error"] < TOL and summary["max_logit"] > 0.1
    assert summary["routing_match"] and summary["routing_mismatches"] == 0
    traffic = account(
        home_devices(plan, trace), trace.experts, plan.placement.dispatch_device(), CFG["hidden_size"] * 4, devices
    ).traffic
    assert traffic.sum() > 0
    np.testing.assert_array_equal(summary["dispatch_bytes"], traffic.sum(axis=2).T)
    np.testing.assert_array_equal(summary["combine_bytes"], traffic.sum(axis=1).T)
    assert summary["bytes_match"]
    assert set(summary["collective_seconds"]) >= {"dispatch", "combine"}


def test_tp_needs_heads_divisible_by_world_size(setup):
    model, vocab, trace = setup
    parallel = ParallelConfig(devices=3, attention="tp", tokens_per_step=32)
    rows = np.tile(np.r_[np.arange(8), 0], (trace.num_layers, 1))  # 9 slots: 3 per device
    plan = Plan(Placement(rows, 3, 8), parallel)
    with pytest.raises(ConfigError, match="4 attention heads .* over 3 ranks"):
        run_model(plan, trace, model, vocab)


def test_load_tiny_model_finds_the_cached_model_by_the_traces_key(setup, tmp_path):
    import safetensors.torch

    from repro.traces.format import with_meta

    model, vocab, trace = setup
    key = "ab" * 32
    entry = tmp_path / f"tiny_{key[:16]}"
    entry.mkdir()
    safetensors.torch.save_model(model, str(entry / "model.safetensors"))
    np.save(entry / "vocab_map.npy", vocab.real_ids, allow_pickle=False)
    train_config = {k: CFG[k] for k in ("num_layers", "hidden_size", "intermediate_size", "num_experts", "top_k", "num_attention_heads")}
    (entry / "config.json").write_text(json.dumps({"cache_key": key, "vocab_size": vocab.real_vocab_size, "train_config": train_config}))
    tiny_trace = with_meta(trace, source="tiny_model", extra={"cache_key": key})

    loaded, loaded_vocab = load_tiny_model(tiny_trace, cache_dir=tmp_path)
    np.testing.assert_array_equal(loaded_vocab.real_ids, vocab.real_ids)
    ids = torch.as_tensor(vocab.to_model(trace.token_ids[:25]))[None]
    with torch.inference_mode():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="without a tiny-model cache key"):
        load_tiny_model(trace, cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="not cached"):
        load_tiny_model(with_meta(trace, source="tiny_model", extra={"cache_key": "cd" * 32}), cache_dir=tmp_path)
