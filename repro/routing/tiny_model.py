"""The offline default routing model: a tiny Mixtral-architecture MoE trained for a few CPU minutes.

No MoE weights can be downloaded here, and a random-init router's choices carry little of the token/topic
structure Sem-MoE exploits, so the suite trains a small `MixtralForCausalLM` on the profiling split's tokens
(next-token loss + Mixtral's load-balancing aux loss) and captures its routing with `hf_capture`.

The vocabulary is restricted to the `vocab_top` most frequent real ids of the training tokens plus one UNK
id (model id `vocab_top`) for the rest: a 32k-row embedding and LM head would take most of the CPU budget
(see reference/data.md §4). Traces still carry the real tokenizer ids.

Training runs exactly `max_steps` steps, so the same config and seed give the same weights bit for bit at any
machine speed (same torch build). An explicit time budget (`train_seconds`, default none) may cut training
short; such a model is used for this run only, with a warning in the log and in the trace's
meta.extra["warnings"], and is never cached (nor, by repro.run, its routing).

Trained models are cached under `cache_dir/tiny_<key>/` with `model.safetensors`, `vocab_map.npy` and
`config.json`; the key hashes every training setting, the seed and the training tokens, never the capture
settings. config.json records how the entry was made (training config, seed, data digest, steps done, what
stopped training, library versions); an entry whose record differs from the job's config is refused. When two
processes write one entry, the first rename wins and the other keeps its own (identical) model in memory.

Legend: N tokens, R requests, V real vocabulary, M model vocabulary (vocab_top + 1), B batch, S seq_len,
L MoE layers, k experts per token.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from repro.atomic import atomic_dir
from repro.errors import ConfigError, WorkloadError
from repro.routing import ROUTING_CACHE_VERSION
from repro.routing.hf_capture import capture_routing
from repro.traces.format import RoutingTrace, with_meta
from repro.workloads.request import Request

log = logging.getLogger(__name__)

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
    "max_steps": 600,
    "train_seconds": None,  # opt-in time budget; a model it cuts short is not cached
    "lr": 1e-3,
    "aux_loss_coef": 0.01,
    "capture_batch_tokens": 8192,
    "max_new_tokens": 0,
}
# settings that change the trained weights (the cache key); the rest only change the capture. train_seconds is
# not one: a model trained to max_steps is the same with or without a budget, and a cut-short one is never cached
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
        if key == "train_seconds" and cfg[key] is None:
            continue  # no time budget: training always runs max_steps
        number = isinstance(cfg[key], (int, float)) and not isinstance(cfg[key], bool) and math.isfinite(cfg[key])
        if not number or cfg[key] < 0 or (key != "aux_loss_coef" and cfg[key] == 0):
            raise ConfigError(
                f"model.{key}={cfg[key]!r} must be a positive number (aux_loss_coef may be 0, train_seconds null)."
            )
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


def made_from(cfg: dict, *, seed: int, tokenizer: str, vocab_size: int, tokens: np.ndarray, lengths: np.ndarray) -> dict:
    """Every input that changes the trained weights: recorded in a cache entry's config.json, hashed into its key."""
    data = hashlib.sha256(tokens.astype(np.int32).tobytes() + lengths.astype(np.int64).tobytes()).hexdigest()
    return {
        "cache_version": ROUTING_CACHE_VERSION,  # bump it when training changes what a config produces
        "train_config": {k: cfg[k] for k in TRAIN_KEYS},
        "seed": int(seed),
        "tokenizer": tokenizer,
        "vocab_size": int(vocab_size),
        "data_digest": data,
    }


def cache_key(cfg: dict, *, seed: int, tokenizer: str, vocab_size: int, tokens: np.ndarray, lengths: np.ndarray) -> str:
    """sha256 hex of every input that changes the trained weights."""
    payload = made_from(cfg, seed=seed, tokenizer=tokenizer, vocab_size=vocab_size, tokens=tokens, lengths=lengths)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@contextlib.contextmanager
def deterministic_torch():
    """torch's deterministic kernels on one intra-op thread inside the block, the previous settings restored after.

    Without deterministic kernels two CPU trainings of one seed differ (40 steps: weights up to 6e-3 apart, so two
    fresh clones routed differently). The thread count changes how GEMMs split their sums: measured 2026-12-02,
    20 steps on 1 and on 2 threads gave different weights, and two 600-step models under one cache key routed
    MMLU differently (final loss 1.068 vs 1.103). One thread makes the weights and the routing the same on every
    machine (`make reproduce` trains on one thread anyway, beside another stream)."""
    previous, previous_threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)
        torch.set_num_threads(previous_threads)


def train_tiny_model(cfg: dict, stream: np.ndarray, model_vocab_size: int, unk_id: int, *, seed: int,
                     on_progress: Callable[[dict], None] | None = None):
    """Train a MixtralForCausalLM on windows of stream int64[N] (model ids); returns (model, stats dict).

    Windows of S = min(seq_len, N) tokens start at positions drawn by a torch.Generator seeded with `seed`;
    weights are initialised under torch.manual_seed(seed) inside a forked RNG so global state is untouched.
    Runs max_steps steps; an explicit train_seconds budget (not None) may stop it earlier, read on time.monotonic().
    Loss on a fixed held-out draw of EVAL_BATCHES batches is measured before and after training.
    on_progress, when given, is called with {"phase": "train", "step", "lm_loss", "aux_loss", "tokens_per_s"} after
    every step and {"phase": "train", "step", "eval_loss"} before and after training (repro.tracking logs them);
    it reads time.perf_counter only, so it cannot change when a train_seconds budget stops training.
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
    if on_progress is not None:
        on_progress({"phase": "train", "step": 0, "eval_loss": loss_before})
        step_tokens, tick = cfg["batch_size"] * seq_len, time.perf_counter()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    model.train()
    lm_losses, aux_losses = [], []
    start = time.monotonic()
    deadline = math.inf if cfg["train_seconds"] is None else start + cfg["train_seconds"]
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
            if on_progress is not None:
                tock = time.perf_counter()
                on_progress({"phase": "train", "step": len(lm_losses), "lm_loss": lm_losses[-1], "aux_loss": aux,
                             "tokens_per_s": step_tokens / max(tock - tick, 1e-9)})
                tick = tock
    seconds = time.monotonic() - start
    loss_after = eval_loss()
    if on_progress is not None:
        on_progress({"phase": "train", "step": len(lm_losses), "eval_loss": loss_after})
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
        "eval_loss_after": loss_after,
        "num_parameters": int(sum(p.numel() for p in model.parameters())),
        "seq_len": seq_len,
    }
    model.eval()
    return model, stats


ENTRY_FILES = ("model.safetensors", "vocab_map.npy", "config.json")


def library_versions() -> dict:
    """Versions of what trained a cache entry (recorded, not checked: another torch build may round differently)."""
    import transformers

    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def entry_mismatch(record: dict, expected: dict, max_steps: int) -> str | None:
    """How a cache entry's record (its config.json) differs from the model a job asks for, or None.

    expected holds the cache key and made_from()'s fields; the entry must also have run all max_steps steps.
    """
    for name, want in expected.items():
        got = record.get(name)
        if isinstance(want, dict) and isinstance(got, dict):
            differing = sorted(k for k in want.keys() | got.keys() if got.get(k) != want.get(k))
            if differing:
                k = differing[0]
                return f"{name}.{k}={got.get(k)!r} where this job has {want.get(k)!r}"
        elif got != want:
            return f"{name}={got!r} where this job has {want!r}"
    stats = record.get("stats") if isinstance(record.get("stats"), dict) else {}
    if stats.get("steps") != max_steps or stats.get("stopped_by") != "max_steps":
        return (
            f"{stats.get('steps')!r} training steps (stopped by {stats.get('stopped_by')!r}) where this job trains "
            f"max_steps={max_steps}"
        )
    return None


def _load_entry(entry: Path, cfg: dict, expected: dict, vocab_size: int):
    """(model in eval mode, VocabMap, record) of an existing cache entry that matches `expected`, else ConfigError."""
    import safetensors.torch
    from transformers import MixtralForCausalLM

    files = [entry / name for name in ENTRY_FILES]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        # entries are renamed into place complete, so a partial one was made or changed by something else
        raise ConfigError(
            f"the tiny model cache entry {entry} lacks {missing}, so the suite did not write it whole; "
            "delete that directory to retrain."
        )
    try:
        record = json.loads(files[2].read_text())
        if not isinstance(record, dict):
            raise ValueError("config.json is not a JSON object")
        mismatch = entry_mismatch(record, expected, cfg["max_steps"])
        if mismatch is None:
            vocab = VocabMap(np.load(files[1], allow_pickle=False).astype(np.int64), int(vocab_size))
            model = MixtralForCausalLM(tiny_mixtral_config(cfg, vocab.model_vocab_size))
            safetensors.torch.load_model(model, files[0], strict=True)
    except (OSError, ValueError, RuntimeError, KeyError, IndexError) as e:  # JSONDecodeError is a ValueError
        raise ConfigError(f"the cached tiny model at {entry} is unreadable ({e}); delete that directory to retrain.") from e
    if mismatch is not None:
        raise ConfigError(
            f"the cached tiny model {entry} was made with {mismatch}, so it is not the model this config trains; "
            "delete that directory to retrain it."
        )
    return model.eval(), vocab, record


def check_cache_writable(cache_dir: Path) -> None:
    """ConfigError unless a directory can be created in cache_dir (made if missing); called before training so
    an unwritable cache costs no training time."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".write-check.", dir=cache_dir))
    except OSError as e:
        raise ConfigError(
            f"cache_dir {cache_dir} is not writable ({e.strerror or e}); set cache_dir= (or REPRO_CACHE) to a "
            "writable folder."
        ) from e


def load_or_train(
    cfg: dict, train_requests: list[Request], *, cache_dir: Path, seed: int, tokenizer: str, vocab_size: int,
    on_progress: Callable[[dict], None] | None = None,
):
    """(model in eval mode, VocabMap, record dict, cache hit bool) for a checked cfg.

    record is the entry's config.json: how the model was made. A model that an explicit train_seconds budget cut
    short is returned for this run with record["warnings"] saying so, and is not cached.
    """
    tokens, lengths = training_tokens(train_requests, vocab_size)
    made = made_from(cfg, seed=seed, tokenizer=tokenizer, vocab_size=vocab_size, tokens=tokens, lengths=lengths)
    key = cache_key(cfg, seed=seed, tokenizer=tokenizer, vocab_size=vocab_size, tokens=tokens, lengths=lengths)
    cache_dir = Path(cache_dir)
    entry = cache_dir / f"tiny_{key[:16]}"
    if entry.exists() or entry.is_symlink():
        model, vocab, record = _load_entry(entry, cfg, {"cache_key": key, **made}, vocab_size)
        return model, vocab, record, True

    check_cache_writable(cache_dir)
    vocab = build_vocab_map(tokens, cfg["vocab_top"], vocab_size)
    stream = vocab.to_model(tokens)
    with deterministic_torch():
        model, stats = train_tiny_model(cfg, stream, vocab.model_vocab_size, vocab.unk_id, seed=seed,
                                        on_progress=on_progress)
    stats["vocab_coverage"] = float(np.mean(stream != vocab.unk_id))
    stats["train_tokens"] = int(tokens.size)
    record = {
        "cache_key": key,
        **made,
        "model_vocab_size": vocab.model_vocab_size,
        "stats": stats,
        "versions": library_versions(),
        "mixtral_config": tiny_mixtral_config(cfg, vocab.model_vocab_size).to_dict(),
    }
    if stats["stopped_by"] != "max_steps":
        record["warnings"] = [
            f"the tiny model's time budget model.train_seconds={cfg['train_seconds']} stopped its training after "
            f"{stats['steps']} of max_steps={cfg['max_steps']} steps, so this run's routing depends on the machine's "
            "speed and the model is not cached; set model.train_seconds=null for seed-exact results."
        ]
        log.warning(record["warnings"][0])
        return model, vocab, record, False
    _write_entry(entry, model, vocab, record)
    return model, vocab, record, False


def _write_entry(entry: Path, model, vocab: VocabMap, record: dict) -> bool:
    """Publish the cache entry in one rename (repro.atomic.atomic_dir): readers never see half an entry.

    Returns False when another process published the same entry first: the first writer wins and is never
    replaced (the key fixes every input of training, so its model is this one).
    """
    import safetensors.torch

    def write_into(tmp: Path) -> None:
        safetensors.torch.save_model(model, str(tmp / "model.safetensors"))
        np.save(tmp / "vocab_map.npy", vocab.real_ids, allow_pickle=False)
        (tmp / "config.json").write_text(json.dumps(record, indent=1, default=str))

    try:
        published = atomic_dir(entry, write_into)
    except OSError as e:
        raise ConfigError(
            f"could not write the tiny model cache entry {entry} ({e.strerror or e}); free disk space, delete "
            "whatever is at that path, or set cache_dir= to another folder."
        ) from e
    if not published:
        if not all((entry / name).is_file() for name in ENTRY_FILES):
            raise ConfigError(
                f"{entry} appeared while the tiny model was trained but is not a complete cache entry; delete that "
                "directory to retrain."
            )
        log.info("tiny model cache entry %s was written by another process first; keeping that one", entry)
    return published


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
    on_progress: Callable[[dict], None] | None = None,
) -> RoutingTrace:
    """Train (or load from cache) the tiny Mixtral on train_requests, then capture the routing of requests.

    Returns a trace with real tokenizer ids (meta.vocab_size = vocab_size), meta.model = model_cfg name,
    meta.source = "tiny_model", and meta.extra holding the training stats (steps, losses, seconds, vocabulary
    coverage of the training and routed tokens, cache key, whether the cache was hit, whether the model is
    cached) and, when a time budget cut training short, "warnings" (one sentence each; repro.run does not cache
    such a trace and copies the warnings into metrics.json). on_progress (a plain callable, e.g. repro.tracking's)
    receives the training steps' losses and the capture's throughput (see train_tiny_model and capture_routing).
    """
    cfg = check_tiny_config(model_cfg)
    model, vocab, record, cache_hit = load_or_train(
        cfg, train_requests, cache_dir=Path(cache_dir), seed=seed, tokenizer=tokenizer, vocab_size=vocab_size,
        on_progress=on_progress,
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
            on_progress=on_progress,
        )
    routed_coverage = float(np.mean(vocab.to_model(trace.token_ids) != vocab.unk_id)) if trace.num_tokens else 0.0
    extra = {
        **trace.meta.extra,
        **record["stats"],
        "cache_key": record["cache_key"],
        "cache_hit": cache_hit,
        "model_cached": record["stats"]["stopped_by"] == "max_steps",  # load_or_train caches only full runs
        "model_vocab_size": vocab.model_vocab_size,
        "routed_vocab_coverage": routed_coverage,
    }
    if record.get("warnings"):
        extra["warnings"] = [*trace.meta.extra.get("warnings", []), *record["warnings"]]
    return with_meta(trace, extra=extra)
