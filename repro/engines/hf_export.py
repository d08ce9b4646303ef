"""The suite's tiny Mixtral as a Hugging Face checkpoint a serving engine loads (vLLM's CPU build, docs/cost_model.md).

    python -m repro.engines.hf_export --trace runs/cache/traces/<key>/trace --out runs/engine_cpu/checkpoint

The tiny model (repro.routing.tiny_model) reads model ids of a restricted vocabulary: the `vocab_top` most frequent
real ids plus one UNK id. An engine is sent real tokenizer ids, so the exported model has the real vocabulary: the
embedding row and LM-head row of real id r are the tiny model's rows of its model id (UNK for ids outside the
top), which gives every real prompt exactly the hidden states, and so the routing, the suite captured. The folder
holds config.json + model.safetensors (save_pretrained) and the real tokenizer (sentencepiece tokenizer.model of
Mixtral v1 from mistral-common). HF's conversion of that tokenizer splits some whitespace differently from
sentencepiece itself, so the suite's clients send token ids, never text.

Legend: V real vocabulary, M model vocabulary (vocab_top + 1), H hidden size.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from repro import cli
from repro.atomic import atomic_dir
from repro.errors import ConfigError

# Mixtral v1's special ids (mistral-common's tokenizer.model.v1); the suite's prompts never contain them
BOS_ID, EOS_ID = 1, 2
TOKENIZER_CONFIG = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
                    "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": True}


def real_vocab_model(model, vocab):
    """A MixtralForCausalLM over the real vocabulary V whose output for real ids equals `model`'s for their model ids.

    model: the tiny MixtralForCausalLM (embedding float[M, H], LM head float[M, H]); vocab: its VocabMap.
    Returns a new model in eval mode: embedding and LM head float[V, H] gathered at vocab.to_model(0..V-1), every
    other weight copied.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**{**model.config.to_dict(), "vocab_size": vocab.real_vocab_size, "bos_token_id": BOS_ID,
                              "eos_token_id": EOS_ID, "architectures": ["MixtralForCausalLM"]})
    rows = torch.as_tensor(vocab.to_model(np.arange(vocab.real_vocab_size)), dtype=torch.long)
    state = dict(model.state_dict())
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name][rows].clone()
    exported = MixtralForCausalLM(config)
    exported.load_state_dict(state, strict=True)
    return exported.eval()


def export_checkpoint(model, vocab, out: str | Path, tokenizer: str = "mixtral") -> Path:
    """Write the real-vocabulary checkpoint of the tiny model (model, VocabMap) to `out` in one rename.

    `out` must not exist yet (nothing is overwritten). Returns `out`.
    """
    from repro.workloads.tokenizers import package_file

    if tokenizer != "mixtral":
        raise ConfigError(f"the tiny model was trained on tokenizer {tokenizer!r}; only 'mixtral' exports with its "
                          "tokenizer files (mistral-common's sentencepiece model).")
    out = Path(out)
    if out.exists():
        raise ConfigError(f"{out} exists; the export writes a new folder, choose another --out or delete it.")
    sentencepiece = package_file("mistral_common", "data/tokenizer.model.v1", "pip install mistral-common")
    exported = real_vocab_model(model, vocab)

    def write_into(tmp: Path) -> None:
        exported.save_pretrained(tmp, safe_serialization=True)
        shutil.copyfile(sentencepiece, tmp / "tokenizer.model")
        (tmp / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=1))

    try:
        published = atomic_dir(out, write_into)
    except OSError as e:  # a read-only folder, a full disk
        raise ConfigError(f"cannot write --out {out} ({e.strerror or e}); choose a writable place.") from None
    if not published:
        raise ConfigError(f"{out} appeared while the checkpoint was written; nothing of ours is there.")
    return out


def main(argv: list[str] | None = None) -> int:
    from repro.exec.model import load_tiny_model
    from repro.traces import read_trace

    p = cli.ArgumentParser(prog="python -m repro.engines.hf_export", description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=cli.existing_dir, required=True,
                   help="a trace the tiny model routed (its cache key names it)")
    p.add_argument("--cache-dir", type=Path, default=Path("runs/cache"), help="where the tiny model is cached")
    p.add_argument("--out", type=cli.output_dir, required=True, help="new folder for the checkpoint")
    args = p.parse_args(argv)

    def work() -> None:
        trace = read_trace(args.trace)
        model, vocab = load_tiny_model(trace, cache_dir=args.cache_dir)
        export_checkpoint(model, vocab, args.out, trace.meta.tokenizer)
        print(args.out)

    return cli.run(work)


if __name__ == "__main__":
    sys.exit(main())
