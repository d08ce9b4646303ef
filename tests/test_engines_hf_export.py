"""repro.engines.hf_export: the tiny model over the real vocabulary, saved as an HF checkpoint, routes real ids
exactly as the suite captured them through the restricted vocabulary; the folder loads with from_pretrained and
holds the real tokenizer; nothing is overwritten."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from repro.engines.hf_export import export_checkpoint, real_vocab_model
from repro.errors import ConfigError
from repro.routing.hf_capture import capture_routing
from repro.routing.tiny_model import TINY_DEFAULTS, VocabMap, tiny_mixtral_config
from repro.workloads.request import Request

REAL_VOCAB = 32000  # Mixtral v1's, so the exported folder's tokenizer matches its embedding
# hidden 64 over 2 heads: vLLM's CPU attention refuses head_dim 16 (tests/test_engine_cpu.py serves this model)
CFG = {**TINY_DEFAULTS, "num_layers": 2, "hidden_size": 64, "intermediate_size": 16, "num_experts": 8, "top_k": 2,
       "num_attention_heads": 2}


def random_tiny_model():
    """(a random-init tiny MixtralForCausalLM over CFG in eval mode, its VocabMap of 200 real ids)."""
    from transformers import MixtralForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        real_ids = np.sort(np.random.default_rng(0).choice(REAL_VOCAB, 200, replace=False)).astype(np.int64)
        vocab = VocabMap(real_ids=real_ids, real_vocab_size=REAL_VOCAB)
        model = MixtralForCausalLM(tiny_mixtral_config(CFG, vocab.model_vocab_size)).eval()
    return model, vocab


@pytest.fixture(scope="module")
def tiny():
    model, vocab = random_tiny_model()
    rng = np.random.default_rng(1)
    # half the ids from the model's vocabulary, half anywhere (mostly UNK)
    requests = [Request(id=f"r{i}", dataset="unit", label="x", token_ids=np.concatenate(
        [rng.choice(vocab.real_ids, n), rng.integers(0, REAL_VOCAB, n)]).astype(np.int32))
        for i, n in enumerate([3, 9, 14])]
    return model, vocab, requests


def capture(model, requests, **maps):
    return capture_routing(model, requests, model_name="tiny", tokenizer="mixtral", vocab_size=REAL_VOCAB,
                           dataset="unit", **maps)


def test_real_vocabulary_model_routes_real_ids_as_the_tiny_model_routes_model_ids(tiny):
    model, vocab, requests = tiny
    suite = capture(model, requests, input_ids_of=vocab.to_model, real_ids_of=vocab.to_real)
    engine_side = capture(real_vocab_model(model, vocab), requests)  # real ids straight in, as an engine gets them
    np.testing.assert_array_equal(engine_side.experts, suite.experts)
    ids = torch.as_tensor(requests[1].token_ids, dtype=torch.long)[None]
    with torch.inference_mode():
        logits = real_vocab_model(model, vocab)(input_ids=ids).logits
        reference = model(input_ids=torch.as_tensor(vocab.to_model(ids.numpy())))[0]
    # the real-vocabulary logits are the model's, gathered at each real id's model id
    torch.testing.assert_close(logits[..., vocab.real_ids], reference[..., : len(vocab.real_ids)], rtol=0, atol=0)


def test_export_loads_with_from_pretrained_and_refuses_to_overwrite(tiny, tmp_path):
    from transformers import AutoTokenizer, MixtralForCausalLM

    model, vocab, requests = tiny
    out = export_checkpoint(model, vocab, tmp_path / "ckpt")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.model", "tokenizer_config.json"]
    loaded = MixtralForCausalLM.from_pretrained(out).eval()
    np.testing.assert_array_equal(capture(loaded, requests).experts,
                                  capture(model, requests, input_ids_of=vocab.to_model).experts)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == REAL_VOCAB == loaded.config.vocab_size
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [22557, 1526]  # Mixtral v1's ids
    before = (out / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(ConfigError, match="exists"):
        export_checkpoint(model, vocab, out)
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(ConfigError, match="only 'mixtral'"):
        export_checkpoint(model, vocab, tmp_path / "other", tokenizer="qwen")
    assert not (tmp_path / "other").exists()


def test_cli_refuses_a_trace_no_tiny_model_routed(tmp_path, capsys):
    from repro.engines.hf_export import main
    from repro.traces import write_trace

    trace = tiny_trace_without_key()
    write_trace(trace, tmp_path / "trace")
    assert main(["--trace", str(tmp_path / "trace"), "--out", str(tmp_path / "out")]) == 2
    assert "without a tiny-model cache key" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def tiny_trace_without_key():
    model, vocab = random_tiny_model()
    request = Request(id="r0", dataset="unit", label="x", token_ids=vocab.real_ids[:6].astype(np.int32))
    return capture(model, [request], input_ids_of=vocab.to_model)
