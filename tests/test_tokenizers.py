"""Real tokenizers: reference ids, round trips, no added specials, caching, and each loading error."""

import importlib.util
import json

import pytest

from repro.errors import ConfigError, DataUnavailableError
from repro.workloads import tokenizers
from repro.workloads.tokenizers import load_tokenizer, package_file

SENTENCE = "The quick brown fox jumps over the lazy dog."
# ids from reference/data.md §3 (Mixtral, Qwen); OLMoE = GPT-NeoX-20B BPE ids ("The" = 510, "." = 15)
REFERENCE_IDS = {
    "mixtral": [415, 2936, 9060, 285, 1142, 461, 10575, 754, 272, 17898, 3914, 28723],
    "qwen": [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13],
    "olmoe": [510, 3158, 8516, 30013, 27287, 689, 253, 22658, 4370, 15],
}
VOCAB_SIZES = {"mixtral": 32_000, "qwen": 151_646, "olmoe": 50_280}
TEXTS = [SENTENCE, "", "Grüße, 世界! Ünïcödé — emoji 🦊\n\n  def f(x):\n\treturn x**2  ", "a" * 500]


@pytest.mark.parametrize("name", sorted(REFERENCE_IDS))
def test_reference_ids_and_vocab(name):
    tok = load_tokenizer(name)
    assert tok.encode(SENTENCE) == REFERENCE_IDS[name]
    assert tok.vocab_size == VOCAB_SIZES[name]
    assert tok.name == name


@pytest.mark.parametrize("name", sorted(REFERENCE_IDS))
def test_round_trip_batch_and_no_bos(name):
    tok = load_tokenizer(name)
    batch = tok.encode_batch(TEXTS)
    assert batch == [tok.encode(text) for text in TEXTS]
    assert [tok.decode(ids) for ids in batch] == TEXTS
    assert tok.encode("") == []  # no BOS / EOS added
    assert all(0 <= i < tok.vocab_size for ids in batch for i in ids)


def test_special_token_spellings_stay_text():
    qwen = load_tokenizer("qwen")
    ids = qwen.encode("hi <|endoftext|> there")
    assert 151643 not in ids and qwen.decode(ids) == "hi <|endoftext|> there"


def test_cached_and_unknown_names():
    assert load_tokenizer("mixtral") is load_tokenizer("mixtral")
    with pytest.raises(ConfigError, match="unknown tokenizer 'llama'"):
        load_tokenizer("llama")
    with pytest.raises(ConfigError, match="needs a repo id"):
        load_tokenizer("hf:")


def test_missing_package_names_the_pip_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "dashscope" else real_find_spec(name, *a))
    with pytest.raises(DataUnavailableError, match=r"pip install dashscope"):
        tokenizers._qwen()  # the uncached builder behind load_tokenizer("qwen")
    with pytest.raises(DataUnavailableError, match="reinstall"):
        package_file("mistral_common", "data/no-such-file", "pip install mistral-common")


def test_hf_offline_repo_is_one_clear_error(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataUnavailableError, match="HF_HUB_OFFLINE=1.*offline tokenizer"):
        load_tokenizer("hf:no-such-org/no-such-tokenizer-xyz")


def test_hf_local_folder_matches_olmoe(tmp_path):
    pytest.importorskip("transformers")
    olmoe = load_tokenizer("olmoe")
    (tmp_path / "tokenizer.json").write_text(open(olmoe.source, encoding="utf-8").read(), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    tok = load_tokenizer(f"hf:{tmp_path}")
    assert tok.encode(SENTENCE) == REFERENCE_IDS["olmoe"]
    assert tok.encode_batch(TEXTS[:3]) == olmoe.encode_batch(TEXTS[:3])
    assert tok.decode(REFERENCE_IDS["olmoe"]) == SENTENCE
    assert tok.vocab_size == olmoe.vocab_size
