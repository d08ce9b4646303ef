"""The offline default routing model: a tiny Mixtral-architecture MoE trained for a few CPU minutes.

No MoE weights can be downloaded here, and a random-init router's choices carry little of the token/topic
structure Sem-MoE exploits, so the suite trains a small `MixtralForCausalLM` on the profiling split's tokens
(next-token loss + Mixtral's load-balancing aux loss) and captures its routing with `hf_capture`.

The vocabulary is restricted to the `vocab_top` most frequent real ids of the training tokens plus one UNK
id (model id `vocab_top`) for the rest: a 32k-row embedding and LM head would take most of the CPU budget
(see reference/data.md §4). Traces still carry the real tokenizer ids.

Trained models are cached under `cache_dir/tiny_<key>/` with `model.safetensors`, `vocab_map.npy` and
`config.json`; the key hashes every training setting, the seed and the training tokens, never the capture
settings. A time limit (`train_seconds`) makes the number of steps machine-dependent, so config.json records
the steps done and a cache hit reuses the model as trained. With the same config and seed, training that
stops at `max_steps` gives the same weights bit for bit on the same machine and torch build.

Legend: N tokens, R requests, V real vocabulary, M model vocabulary (vocab_top + 1), B batch, S seq_len,
L MoE layers, k experts per token.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from repro.errors import ConfigError, WorkloadError
from repro.routing.hf_capture import capture_routing
from repro.traces.format import RoutingTrace, with_meta
from repro.workloads.request import Request

CACHE_VERSION = 1  # bump when training code changes what a given config produces
TINY_DEFAULTS = {
    "name": "tiny_mixtral",
    "kind": "tiny",
    "tokenizer": "mixtral",
    "num_layers": 6,
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_experts": 16,
    "top_k": 4,
    "num_attention_heads": 4,
    "vocab_top": 4096,
    "seq_len": 256,
    "batch_size": 8,
    "train_seconds": 900,
    "max_steps": 600,
    "lr": 1e-3,
    "aux_loss_coef": 0.01,
    "capture_batch_tokens": 8192,
    "max_new_tokens": 0,
}
# settings that change the trained weights (the cache key); the rest only change the capture
TRAIN_KEYS = (
    "num_layers",
    "hidden_size",
    "intermediate_size",
    "num_experts",
    "top_k",
    "num_attention_heads",
    "vocab_top",
    "seq_len",
    "batch_size",
    "train_seconds",
    "max_steps",
    "lr",
    "aux_loss_coef",
)
IGNORE_INDEX = -100  # HF loss ignores these labels: UNK targets teach nothing about real tokens
EVAL_BATCHES = 4


@dataclass(frozen=True)
class VocabMap:
    """Real tokenizer ids <-> model ids of the restricted vocabulary.

    real_ids int64[M-1]: the real id of model id m (most frequent first); model id M-1 is UNK.
    """

    real_ids: np.ndarray
    real_vocab_size: int
    # int64[V] model id of every real id, built once (to_model runs once per request)
    _model_id_of: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        table = np.full(self.real_vocab_size, len(self.real_ids), dtype=np.int64)
        table[self.real_ids] = np.arange(len(self.real_ids))
        object.__setattr__(self, "_model_id_of", table)

    @property
    def unk_id(self) -> int:
        return len(self.real_ids)

    @property
    def model_vocab_size(self) -> int:
        return len(self.real_ids) + 1

    def to_model(self, real_ids: np.ndarray) -> np.ndarray:
        """int64[n] model ids of real ids int[n] (UNK for ids outside the kept vocabulary)."""
        return self._model_id_of[np.asarray(real_ids, dtype=np.int64)]

    def to_real(self, model_ids: np.ndarray) -> np.ndarray:
        """int64[n] real ids of model ids int[n]; -1 for UNK, which has no real id."""
        return np.append(self.real_ids, -1)[np.asarray(model_ids, dtype=np.int64)]


def build_vocab_map(token_ids: np.ndarray, vocab_top: int, real_vocab_size: int) -> VocabMap:
    """Keep the `vocab_top` most frequent ids of token_ids int[N] (ties broken by the smaller id).

    Ids that never occur are never kept, so M - 1 = min(vocab_top, distinct ids in token_ids).
    """
    counts = np.bincount(np.asarray(token_ids, dtype=np.int64), minlength=real_vocab_size)
    order = np.argsort(-counts, kind="stable")  # stable: equal counts keep ascending id order
    kept = order[: min(vocab_top, int(np.count_nonzero(counts)))]
    return VocabMap(real_ids=kept.astype(np.int64), real_vocab_size=int(real_vocab_size))


def tiny_mixtral_config(cfg: dict, model_vocab_size: int):
    """The transformers MixtralConfig of the tiny model (no BOS/EOS: model ids are not the tokenizer's)."""
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=model_vocab_size,
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_attention_heads"],
        num_local_experts=cfg["num_experts"],
        num_experts_per_tok=cfg["top_k"],
        router_aux_loss_coef=cfg["aux_loss_coef"],
        output_router_logits=False,  # training asks for it per call; capture does not need it
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )


def check_tiny_config(model_cfg: dict) -> dict:
    """model_cfg merged over TINY_DEFAULTS, with every value checked; ConfigError names the bad key."""
    unknown = set(model_cfg) - set(TINY_DEFAULTS)
    if unknown:
        raise ConfigError(
            f"model config has unknown keys {sorted(unknown)}; kind=tiny accepts {sorted(TINY_DEFAULTS)}."
        )
    cfg = {**TINY_DEFAULTS, **model_cfg}
    positive = (
        "num_layers",
        "hidden_size",
        "intermediate_size",
        "num_experts",
        "top_k",
        "num_attention_heads",
        "vocab_top",
        "seq_len",
        "batch_size",
        "max_steps",
        "capture_batch_tokens",
    )
    for key in positive:
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ConfigError(f"model.{key}={cfg[key]!r} must be a positive integer.")
    if cfg["top_k"] > cfg["num_experts"]:
        raise ConfigError(f"model.top_k={cfg['top_k']} exceeds model.num_experts={cfg['num_experts']}.")
    if cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise ConfigError(
            f"model.hidden_size={cfg['hidden_size']} is not divisible by "
            f"model.num_attention_heads={cfg['num_attention_heads']}."
        )
    for key in ("train_seconds", "lr", "aux_loss_coef"):
        if not isinstance(cfg[key], (int, float)) or cfg[key] < 0 or (key != "aux_loss_coef" and cfg[key] == 0):
            raise ConfigError(f"model.{key}={cfg[key]!r} must be a positive number (aux_loss_coef may be 0).")
    if not isinstance(cfg["max_new_tokens"], int) or cfg["max_new_tokens"] < 0:
        raise ConfigError(f"model.max_new_tokens={cfg['max_new_tokens']!r} must be an integer >= 0.")
    return cfg


def training_tokens(train_requests: list[Request], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(token_ids int64[N], lengths int64[R]) of the training requests, checked against vocab_size."""
    if not train_requests:
        raise WorkloadError("the tiny model needs training requests (the profiling split) and got none.")
    lengths = np.array([len(r.token_ids) for r in train_requests], dtype=np.int64)
    tokens = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in train_requests])
    if tokens.size < 2:
        raise WorkloadError(f"the training requests hold {tokens.size} token(s); the tiny model needs at least 2.")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        bad = int(tokens.min() if tokens.min() < 0 else tokens.max())
        raise WorkloadError(
            f"training token id {bad} is outside 0..{vocab_size - 1} (vocab_size); tokenize with the tokenizer named."
        )
    return tokens, lengths


def cache_key(cfg: dict, *, seed: int, tokenizer: str, vocab_size: int, tokens: np.ndarray, lengths: np.ndarray) -> str:
    """sha256 hex of every input that changes the trained weights."""
    data = hashlib.sha256(tokens.astype(np.int32).tobytes() + lengths.astype(np.int64).tobytes()).hexdigest()
    payload = {
        "version": CACHE_VERSION,
        "train": {k: cfg[k] for k in TRAIN_KEYS},
        "seed": int(seed),
        "tokenizer": tokenizer,
        "vocab_size": int(vocab_size),
        "data": data,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@contextlib.contextmanager
def deterministic_torch():
    """torch's deterministic kernels inside the block, the previous setting restored after. Without them two CPU
    trainings of one seed differ (40 steps: weights up to 6e-3 apart, so two fresh clones routed differently);
    with them they are bit-identical, at the same speed."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def train_tiny_model(cfg: dict, stream: np.ndarray, model_vocab_size: int, unk_id: int, *, seed: int):
    """Train a MixtralForCausalLM on windows of stream int64[N] (model ids); returns (model, stats dict).

    Windows of S = min(seq_len, N) tokens start at positions drawn by a torch.Generator seeded with `seed`;
    weights are initialised under torch.manual_seed(seed) inside a forked RNG so global state is untouched.
    Stops at max_steps or after train_seconds, whichever comes first. Loss on a fixed held-out draw of
    EVAL_BATCHES batches is measured before and after training.
    """
    from transformers import MixtralForCausalLM

    seq_len = min(cfg["seq_len"], len(stream))
    stream_t = torch.from_numpy(stream)
    window = torch.arange(seq_len)

    def draw(gen: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(stream) - seq_len + 1, (cfg["batch_size"],), generator=gen)
        return stream_t[starts[:, None] + window]  # int64[B, S]

    def labels_of(ids_BS: torch.Tensor) -> torch.Tensor:
        return ids_BS.masked_fill(ids_BS == unk_id, IGNORE_INDEX)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MixtralForCausalLM(tiny_mixtral_config(cfg, model_vocab_size))
    eval_gen = torch.Generator().manual_seed(seed + 1)
    eval_batches = [draw(eval_gen) for _ in range(EVAL_BATCHES)]
    batch_gen = torch.Generator().manual_seed(seed)

    def eval_loss() -> float:
        model.eval()
        with torch.inference_mode():
            losses = [model(input_ids=b, labels=labels_of(b), use_cache=False).loss.item() for b in eval_batches]
        model.train()
        return float(np.mean(losses))

    loss_before = eval_loss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    model.train()
    lm_losses, aux_losses = [], []
    start = time.monotonic()
    deadline = start + cfg["train_seconds"]
    with tqdm(total=cfg["max_steps"], desc="train tiny_mixtral", unit="step") as bar:
        while len(lm_losses) < cfg["max_steps"] and time.monotonic() < deadline:
            ids_BS = draw(batch_gen)
            out = model(input_ids=ids_BS, labels=labels_of(ids_BS), output_router_logits=True, use_cache=False)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            optimizer.step()
            aux = float(out.aux_loss.detach())
            lm_losses.append(float(out.loss.detach()) - cfg["aux_loss_coef"] * aux)
            aux_losses.append(aux)
            bar.update(1)
            bar.set_postfix(loss=f"{lm_losses[-1]:.3f}", aux=f"{aux:.3f}")
    seconds = time.monotonic() - start
    tail = max(1, min(20, len(lm_losses) // 5))
    stats = {
        "steps": len(lm_losses),
        "seconds": round(seconds, 3),
        "steps_per_second": round(len(lm_losses) / max(seconds, 1e-9), 3),
        "stopped_by": "max_steps" if len(lm_losses) >= cfg["max_steps"] else "train_seconds",
        "first_loss": lm_losses[0] if lm_losses else math.nan,
        "final_loss": float(np.mean(lm_losses[-tail:])) if lm_losses else math.nan,
        "final_aux_loss": float(np.mean(aux_losses[-tail:])) if aux_losses else math.nan,
        "eval_loss_before": loss_before,
        "eval_loss_after": eval_loss(),
        "num_parameters": int(sum(p.numel() for p in model.parameters())),
        "seq_len": seq_len,
    }
    model.eval()
    return model, stats


def load_or_train(
    cfg: dict, train_requests: list[Request], *, cache_dir: Path, seed: int, tokenizer: str, vocab_size: int
):
    """(model in eval mode, VocabMap, record dict from config.json, cache hit bool) for a checked cfg."""
    import safetensors.torch
    from transformers import MixtralForCausalLM

    tokens, lengths = training_tokens(train_requests, vocab_size)
    key = cache_key(cfg, seed=seed, tokenizer=tokenizer, vocab_size=vocab_size, tokens=tokens, lengths=lengths)
    entry = Path(cache_dir) / f"tiny_{key[:16]}"
    files = [entry / "model.safetensors", entry / "vocab_map.npy", entry / "config.json"]
    if all(f.is_file() for f in files):
        try:
            record = json.loads(files[2].read_text())
            vocab = VocabMap(np.load(files[1], allow_pickle=False).astype(np.int64), int(vocab_size))
            model = MixtralForCausalLM(tiny_mixtral_config(cfg, vocab.model_vocab_size))
            safetensors.torch.load_model(model, files[0], strict=True)
        except (OSError, ValueError, RuntimeError, KeyError, json.JSONDecodeError) as e:
            raise ConfigError(
                f"the cached tiny model at {entry} is unreadable ({e}); delete that directory to retrain."
            ) from e
        return model.eval(), vocab, record, True

    vocab = build_vocab_map(tokens, cfg["vocab_top"], vocab_size)
    stream = vocab.to_model(tokens)
    with deterministic_torch():
        model, stats = train_tiny_model(cfg, stream, vocab.model_vocab_size, vocab.unk_id, seed=seed)
    stats["vocab_coverage"] = float(np.mean(stream != vocab.unk_id))
    stats["train_tokens"] = int(tokens.size)
    record = {
        "cache_key": key,
        "cache_version": CACHE_VERSION,
        "train_config": {k: cfg[k] for k in TRAIN_KEYS},
        "seed": int(seed),
        "tokenizer": tokenizer,
        "vocab_size": int(vocab_size),
        "model_vocab_size": vocab.model_vocab_size,
        "stats": stats,
        "mixtral_config": tiny_mixtral_config(cfg, vocab.model_vocab_size).to_dict(),
    }
    _write_entry(entry, model, vocab, record)
    return model, vocab, record, False


def _write_entry(entry: Path, model, vocab: VocabMap, record: dict) -> None:
    """Write the cache entry into a temporary sibling, then rename it into place (readers never see half)."""
    import safetensors.torch

    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        safetensors.torch.save_model(model, str(tmp / "model.safetensors"))
        np.save(tmp / "vocab_map.npy", vocab.real_ids, allow_pickle=False)
        (tmp / "config.json").write_text(json.dumps(record, indent=1, default=str))
        if entry.exists():  # a stale incomplete entry: replace it
            shutil.rmtree(entry)
        tmp.rename(entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def route_with_tiny_model(
    model_cfg: dict,
    requests: list[Request],
    train_requests: list[Request],
    *,
    cache_dir: Path,
    seed: int,
    dataset: str,
    tokenizer: str,
    vocab_size: int,
) -> RoutingTrace:
    """Train (or load from cache) the tiny Mixtral on train_requests, then capture the routing of requests.

    Returns a trace with real tokenizer ids (meta.vocab_size = vocab_size), meta.model = model_cfg name,
    meta.source = "tiny_model", and meta.extra holding the training stats (steps, losses, seconds, vocabulary
    coverage of the training and routed tokens, cache key, whether the cache was hit).
    """
    cfg = check_tiny_config(model_cfg)
    model, vocab, record, cache_hit = load_or_train(
        cfg, train_requests, cache_dir=Path(cache_dir), seed=seed, tokenizer=tokenizer, vocab_size=vocab_size
    )
    with deterministic_torch():
        trace = capture_routing(
            model,
            requests,
            model_name=str(cfg["name"]),
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            dataset=dataset,
            input_ids_of=vocab.to_model,
            real_ids_of=vocab.to_real,
            batch_tokens=cfg["capture_batch_tokens"],
            max_new_tokens=cfg["max_new_tokens"],
            source="tiny_model",
        )
    routed_coverage = float(np.mean(vocab.to_model(trace.token_ids) != vocab.unk_id)) if trace.num_tokens else 0.0
    extra = {
        **trace.meta.extra,
        **record["stats"],
        "cache_key": record["cache_key"],
        "cache_hit": cache_hit,
        "model_vocab_size": vocab.model_vocab_size,
        "routed_vocab_coverage": routed_coverage,
    }
    return with_meta(trace, extra=extra)
