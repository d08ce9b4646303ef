"""Exact routing capture from Hugging Face transformers MoE models.

Every supported family (transformers 5.24: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2, DeepSeek-V3, and
GPT-OSS via `mlp.router`) computes its routing in one router module per MoE layer, `layer.mlp.gate`, whose
`forward` returns `(router_logits, topk_weights, topk_indices)`. A forward hook on that module records the ids
the model itself used, so family-specific selection rules (DeepSeek-V3's sigmoid + correction bias +
group-limited top-k, DeepSeek-V2's group-limited greedy) are captured as executed rather than re-derived from
logits. Dense layers (DeepSeek's first `first_k_dense_replace` layers, Qwen's `mlp_only_layers`) have no router
and are listed in `meta.dense_layers`.

Requests are routed independently: a batch holds whole requests, right-padded to the batch's longest one with
an attention mask; causal attention keeps every real token blind to the padding after it, and padded positions
are dropped before anything reaches the trace.

Legend: R requests, N tokens (all requests), L MoE layers, k experts per token, E experts, B requests in a
batch, S padded batch length, V model vocabulary.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from repro.errors import ConfigError, DataUnavailableError, WorkloadError
from repro.traces.format import RoutingTrace, TraceMeta, make_trace
from repro.workloads.request import Request

IdMap = Callable[[np.ndarray], np.ndarray]

# model_cfg keys understood by route_with_hf_model, with their defaults
HF_DEFAULTS = {
    "name": "",
    "kind": "hf",
    "tokenizer": "",
    "checkpoint": "",
    "dtype": "float32",
    "batch_tokens": 8192,
    "max_new_tokens": 0,
    "trust_remote_code": False,
    "from_config": None,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def check_hf_config(model: dict) -> None:
    """The hf producer's config check (repro.config_schema composes it): known keys, integer and flag values."""
    from repro.config_values import FLAG, check_value, integer
    from repro.errors import check_known_keys

    check_known_keys("model (kind=hf)", model, HF_DEFAULTS)
    check_value("model.batch_tokens", model.get("batch_tokens", HF_DEFAULTS["batch_tokens"]), integer(1))
    check_value("model.max_new_tokens", model.get("max_new_tokens", 0), integer(0))
    check_value("model.trust_remote_code", model.get("trust_remote_code", False), FLAG)


def moe_routers(model) -> list[tuple[int, torch.nn.Module]]:
    """(model layer index, router module) of every MoE layer of a `*ForCausalLM`, in layer order.

    A router is the layer's `mlp.gate` (or GPT-OSS's `mlp.router`) when its class name contains "Router";
    dense MLPs have `gate_proj` instead and are skipped. Raises ConfigError when the model has no decoder
    layers or no router at all (a dense model has no routing to capture).
    """
    layers = _decoder_layers(model)
    routers = []
    for layer_id, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        for attr in ("gate", "router"):
            module = getattr(mlp, attr, None)
            if isinstance(module, torch.nn.Module) and "router" in type(module).__name__.lower():
                routers.append((layer_id, module))
                break
    if not routers:
        raise ConfigError(
            f"{type(model).__name__} has no MoE router (no layer.mlp.gate/router module named *Router); "
            "use an MoE checkpoint (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3)."
        )
    return routers


def _decoder_layers(model) -> torch.nn.ModuleList:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(
            f"{type(model).__name__} has no `model.layers` list of decoder layers; pass a *ForCausalLM model."
        )
    return layers


def _router_shape(routers: list[tuple[int, torch.nn.Module]]) -> tuple[int, int]:
    """(num_experts E, top_k k), the same for every router (ConfigError otherwise)."""
    shapes = {(int(r.num_experts), int(r.top_k)) for _, r in routers}
    if len(shapes) != 1:
        raise ConfigError(f"MoE layers disagree on (num_experts, top_k): {sorted(shapes)}; the trace needs one shape.")
    return shapes.pop()


def capture_routing(
    model,
    requests: list[Request],
    *,
    model_name: str,
    tokenizer: str,
    vocab_size: int,
    dataset: str,
    input_ids_of: IdMap | None = None,
    batch_tokens: int = 8192,
    max_new_tokens: int = 0,
    source: str = "hf_capture",
    real_ids_of: IdMap | None = None,
    on_progress: Callable[[dict], None] | None = None,
) -> RoutingTrace:
    """Route every request through `model` and record each MoE layer's exact top-k choice.

    requests: their `token_ids` int[S_r] are real tokenizer ids in 0..vocab_size-1.
    input_ids_of: maps real ids int[n] -> model ids int[n] (a restricted vocabulary); identity when None.
    real_ids_of: maps model ids int[n] -> real ids int[n], < 0 where a model id has no real id (e.g. UNK); only
        needed to bring greedily generated tokens back to real ids. Model ids without a real id in
        0..vocab_size-1 are never generated.
    batch_tokens: requests are batched while B * S <= batch_tokens (a longer request goes alone).
    max_new_tokens: greedy tokens generated per request (stopping early at the model's EOS) and appended to
        the request; `prefill_len` marks where the prompt ends. Routing of the whole sequence is then captured
        in one forward pass, which matches the routing the tokens get during decoding.
    on_progress: called after every batch with {"phase": "capture" (or "generate"), "step": batch number,
        "requests", "tokens" (done so far), "requests_per_s", "tokens_per_s"} (repro.tracking logs them).

    Returns a trace with token_ids int32[N] (real ids), experts int16[N, L, k] and weights float16[N, L, k],
    each token's k experts ordered by descending gate weight; meta.layer_ids are the MoE layers and
    meta.dense_layers the layers without a router.
    """
    if not requests:
        raise WorkloadError(f"capture_routing got no requests for {model_name!r}; the workload is empty.")
    if batch_tokens < 1 or max_new_tokens < 0:
        raise ConfigError(f"batch_tokens={batch_tokens} must be >= 1 and max_new_tokens={max_new_tokens} >= 0.")
    if max_new_tokens and input_ids_of is not None and real_ids_of is None:
        raise ConfigError(
            "generation with a restricted vocabulary (input_ids_of) needs real_ids_of to map tokens back."
        )
    routers = moe_routers(model)
    num_experts, top_k = _router_shape(routers)
    model_vocab = model.get_input_embeddings().num_embeddings
    prompts = [_real_prompt(r, vocab_size) for r in requests]
    to_model = input_ids_of if input_ids_of is not None else (lambda ids: ids)
    model_prompts = [np.asarray(to_model(p), dtype=np.int64) for p in prompts]
    for r, ids in zip(requests, model_prompts, strict=True):
        if ids.size and (ids.min() < 0 or ids.max() >= model_vocab):
            raise ConfigError(
                f"request {r.id!r} has token id {int(ids.max())} outside the model's vocabulary of {model_vocab}; "
                f"its tokenizer ({tokenizer!r}) does not match {model_name!r}."
            )

    was_training = model.training
    model.eval()
    try:
        generated = (
            _generate_greedy(model, model_prompts, max_new_tokens, batch_tokens, real_ids_of, vocab_size, on_progress)
            if max_new_tokens
            else [np.zeros(0, np.int64)] * len(requests)
        )
        model_seqs = [np.concatenate([p, g]) for p, g in zip(model_prompts, generated, strict=True)]
        experts_NLk, weights_NLk = _route_sequences(
            model, routers, top_k, model_seqs, batch_tokens, model_name, on_progress
        )
    finally:
        model.train(was_training)

    to_real = real_ids_of if real_ids_of is not None else (lambda ids: ids)
    real_seqs = [
        np.concatenate([p, np.asarray(to_real(g), dtype=np.int64)]) for p, g in zip(prompts, generated, strict=True)
    ]
    lengths = np.array([len(s) for s in real_seqs], dtype=np.int64)
    routed_layers = [layer_id for layer_id, _ in routers]
    dense = tuple(sorted(set(range(len(_decoder_layers(model)))) - set(routed_layers)))
    meta = TraceMeta(
        model=model_name,
        num_experts=num_experts,
        top_k=top_k,
        layer_ids=tuple(routed_layers),
        vocab_size=int(vocab_size),
        tokenizer=tokenizer,
        source=source,
        dataset=dataset,
        dense_layers=dense,
        extra={
            "model_class": type(model).__name__,
            "router_class": type(routers[0][1]).__name__,
            "batch_tokens": int(batch_tokens),
            "max_new_tokens": int(max_new_tokens),
            "generated_tokens": int(sum(len(g) for g in generated)),
            # near-tie top-k choices can depend on where the forward ran and, on a CPU, on the thread count (GEMMs
            # split their sums by it): recorded so two captures can be told apart
            "device": str(next(model.parameters()).device),
            "torch_threads": int(torch.get_num_threads()),
        },
    )
    return make_trace(
        meta,
        np.concatenate([[0], np.cumsum(lengths)]),
        np.concatenate(real_seqs) if real_seqs else np.zeros(0, np.int64),
        experts_NLk,
        prefill_len=np.array([len(p) for p in prompts], dtype=np.int32),
        request_ids=[r.id for r in requests],
        request_datasets=[r.dataset or dataset for r in requests],
        request_labels=[r.label for r in requests],
        weights=weights_NLk,
    )


def _real_prompt(request: Request, vocab_size: int) -> np.ndarray:
    ids = np.asarray(request.token_ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise WorkloadError(
            f"request {request.id!r} token_ids must be a 1-D integer array, got {ids.dtype}{ids.shape}."
        )
    if ids.size == 0:
        raise WorkloadError(f"request {request.id!r} has no tokens; drop empty prompts from the workload.")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise WorkloadError(
            f"request {request.id!r} has token id {int(ids.max() if ids.max() >= vocab_size else ids.min())} "
            f"outside 0..{vocab_size - 1} (the tokenizer's vocab_size); tokenize it with the model's tokenizer."
        )
    return ids.astype(np.int64)


def _batches(lengths: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Groups of request indices, longest first, with B * S <= batch_tokens (or a single request)."""
    order = np.argsort(-lengths, kind="stable")
    groups, start = [], 0
    while start < len(order):
        # sorted descending, so the first request of a group sets its padded length S
        fits = max(1, batch_tokens // max(int(lengths[order[start]]), 1))
        groups.append(order[start : start + fits])
        start += fits
    return groups


def _route_sequences(model, routers, top_k: int, model_seqs: list[np.ndarray], batch_tokens: int, model_name: str,
                     on_progress=None):
    """experts int16[N, L, k] and weights float16[N, L, k] of the concatenated sequences (model ids)."""
    lengths = np.array([len(s) for s in model_seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    experts_NLk = np.zeros((int(offsets[-1]), len(routers), top_k), dtype=np.int16)
    weights_NLk = np.zeros((int(offsets[-1]), len(routers), top_k), dtype=np.float16)
    records: list[list] = [[] for _ in routers]

    def recorder(slot):
        def hook(module, args, output):
            # (router_logits, topk_weights, topk_indices) in every supported family
            records[slot].append((output[2].detach().to("cpu"), output[1].detach().float().to("cpu")))

        return hook

    handles = [router.register_forward_hook(recorder(slot)) for slot, (_, router) in enumerate(routers)]
    progress = _Progress() if on_progress is not None else None  # reads no clock unless asked to
    device = next(model.parameters()).device
    try:
        with torch.inference_mode(), tqdm(total=int(offsets[-1]), desc=f"capture {model_name}", unit="tok") as bar:
            for group in _batches(lengths, batch_tokens):
                ids_BS, mask_BS = _right_pad([model_seqs[i] for i in group])
                for rec in records:
                    rec.clear()
                model(input_ids=ids_BS.to(device), attention_mask=mask_BS.to(device), use_cache=False)
                # rows of the batch's real tokens in the trace, request after request like mask_BS[mask_BS]
                group_len = lengths[group]
                dest = np.repeat(offsets[group] - np.concatenate([[0], np.cumsum(group_len)[:-1]]), group_len)
                dest = dest + np.arange(int(group_len.sum()))
                valid = mask_BS.reshape(-1).bool()
                for slot, rec in enumerate(records):
                    if len(rec) != 1:
                        raise ConfigError(
                            f"router of layer {routers[slot][0]} ran {len(rec)} times in one forward pass; "
                            "capture_routing supports models that call each router once."
                        )
                    idx, w = rec[0]
                    if idx.shape != (valid.numel(), top_k) or idx.dtype.is_floating_point:
                        raise ConfigError(
                            f"router {type(routers[slot][1]).__name__} of layer {routers[slot][0]} returned ids "
                            f"{tuple(idx.shape)} {idx.dtype}; expected ({valid.numel()}, {top_k}) integers."
                        )
                    idx, w = idx[valid].numpy(), w[valid].numpy()
                    # DeepSeek routers return unsorted top-k; store in descending weight ("top-k order")
                    order = np.argsort(-w, axis=-1, kind="stable")
                    experts_NLk[dest, slot] = np.take_along_axis(idx, order, axis=-1)
                    weights_NLk[dest, slot] = np.take_along_axis(w, order, axis=-1)
                bar.update(int(group_len.sum()))
                if on_progress is not None:
                    on_progress(progress.update("capture", len(group), int(group_len.sum())))
    finally:
        for h in handles:
            h.remove()
    return experts_NLk, weights_NLk


class _Progress:
    """Requests and tokens done so far and their rates since this object was made (on time.perf_counter)."""

    def __init__(self):
        self.start, self.step, self.requests, self.tokens = time.perf_counter(), 0, 0, 0

    def update(self, phase: str, requests: int, tokens: int) -> dict:
        self.step, self.requests, self.tokens = self.step + 1, self.requests + requests, self.tokens + tokens
        seconds = max(time.perf_counter() - self.start, 1e-9)
        return {"phase": phase, "step": self.step, "requests": self.requests, "tokens": self.tokens,
                "requests_per_s": self.requests / seconds, "tokens_per_s": self.tokens / seconds}


def _right_pad(seqs: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids int64[B, S] (padding id 0) and attention mask int64[B, S] of right-padded sequences."""
    lengths = np.array([len(s) for s in seqs])
    mask = np.arange(lengths.max())[None, :] < lengths[:, None]
    ids = np.zeros(mask.shape, dtype=np.int64)
    ids[mask] = np.concatenate(seqs)
    return torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))


def _generate_greedy(model, prompts, max_new_tokens, batch_tokens, real_ids_of, vocab_size,
                     on_progress=None) -> list[np.ndarray]:
    """Greedy continuations int64[<= max_new_tokens] (model ids) per prompt, cut after the first EOS."""
    lengths = np.array([len(p) for p in prompts], dtype=np.int64)
    # never generate a model id without a real id in 0..vocab_size-1 (UNK, or rows padding the embedding)
    model_ids = np.arange(model.get_input_embeddings().num_embeddings)
    real_of_model = np.asarray(real_ids_of(model_ids)) if real_ids_of is not None else model_ids
    suppress = np.flatnonzero((real_of_model < 0) | (real_of_model >= vocab_size)).tolist() or None
    eos = model.generation_config.eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    out: list[np.ndarray] = [np.zeros(0, np.int64)] * len(prompts)
    device = next(model.parameters()).device
    generated = _Progress() if on_progress is not None else None
    with torch.inference_mode(), tqdm(total=len(prompts), desc="generate", unit="req") as bar:
        for group in _batches(lengths + max_new_tokens, batch_tokens):
            ids_BS, mask_BS = _right_pad([prompts[i] for i in group])
            # generation appends on the right, so prompts are left-aligned to end together
            ids_BS, mask_BS = _left_align(ids_BS, mask_BS)
            new_BT = (
                model.generate(
                    input_ids=ids_BS.to(device),
                    attention_mask=mask_BS.to(device),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    suppress_tokens=suppress,
                    pad_token_id=eos_ids[0] if eos_ids else 0,
                    eos_token_id=eos_ids or None,
                )[:, ids_BS.shape[1] :]
                .cpu()
                .numpy()
            )
            is_eos = np.isin(new_BT, eos_ids) if eos_ids else np.zeros(new_BT.shape, bool)
            # keep tokens up to and including the first EOS; generate pads finished rows after it
            keep = np.where(is_eos.any(1), is_eos.argmax(1) + 1, new_BT.shape[1])
            for row, i in enumerate(group):
                out[i] = new_BT[row, : keep[row]].astype(np.int64)
            bar.update(len(group))
            if on_progress is not None:
                on_progress(generated.update("generate", len(group), int(sum(len(out[i]) for i in group))))
    return out


def _left_align(ids_BS: torch.Tensor, mask_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shift = (mask_BS == 0).sum(1)
    cols = (torch.arange(ids_BS.shape[1])[None, :] - shift[:, None]) % ids_BS.shape[1]
    return ids_BS.gather(1, cols), mask_BS.gather(1, cols)


def load_hf_model(model_cfg: dict, *, seed: int):
    """A `*ForCausalLM` in eval mode: random-init from `from_config`, or loaded from `checkpoint`.

    from_config: {"config_class": "MixtralConfig", "kwargs": {...}} (a transformers config class name).
    checkpoint: a local directory, or a hub id that must already be in the local Hugging Face cache unless
    the network is reachable (HF_HUB_OFFLINE unset).
    """
    import transformers

    dtype = model_cfg.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype={dtype!r} is not one of {sorted(DTYPES)}.")
    from_config = model_cfg.get("from_config")
    if from_config:
        cls_name = from_config.get("config_class", "")
        config_cls = getattr(transformers, cls_name, None)
        if not (isinstance(config_cls, type) and issubclass(config_cls, transformers.PretrainedConfig)):
            raise ConfigError(f"model.from_config.config_class={cls_name!r} is not a transformers config class.")
        config = config_cls(**dict(from_config.get("kwargs") or {}))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = transformers.AutoModelForCausalLM.from_config(config)
        if DTYPES[dtype] != "auto":
            model = model.to(DTYPES[dtype])
        return model.eval()
    checkpoint = str(model_cfg.get("checkpoint") or "")
    if not checkpoint:
        raise ConfigError("model.kind=hf needs model.checkpoint (a local path or hub id) or model.from_config.")
    kwargs = {"dtype": DTYPES[dtype], "trust_remote_code": bool(model_cfg.get("trust_remote_code", False))}
    if Path(checkpoint).expanduser().exists():
        try:
            return transformers.AutoModelForCausalLM.from_pretrained(Path(checkpoint).expanduser(), **kwargs).eval()
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"cannot load the checkpoint at {checkpoint} ({e}); point model.checkpoint at a HF model directory."
            ) from e
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True, **kwargs).eval()
    except OSError as local_error:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        if not offline:
            try:
                return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs).eval()
            except OSError:
                pass
        raise DataUnavailableError(
            f"checkpoint {checkpoint!r} is not a local path and is not in the local Hugging Face cache, and the hub "
            "is unreachable here (it needs the network and, for gated models, HF_TOKEN); use model=tiny_mixtral "
            "or set model.checkpoint to a local checkpoint directory."
        ) from local_error


def route_with_hf_model(
    model_cfg: dict, requests, train_requests, *, cache_dir, seed, dataset, tokenizer, vocab_size, on_progress=None
) -> RoutingTrace:
    """Capture the routing of `requests` through a transformers MoE model (model_cfg kind: hf); on_progress gets
    capture_routing's progress events.

    train_requests and cache_dir are unused: a pretrained model needs no training and loading is its own cache.
    """
    unknown = set(model_cfg) - set(HF_DEFAULTS)
    if unknown:
        raise ConfigError(f"model config has unknown keys {sorted(unknown)}; kind=hf accepts {sorted(HF_DEFAULTS)}.")
    cfg = {**HF_DEFAULTS, **model_cfg}
    model = load_hf_model(cfg, seed=seed)
    name = cfg["name"] or cfg["checkpoint"] or cfg["from_config"]["config_class"]
    return capture_routing(
        model,
        requests,
        model_name=str(name),
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        dataset=dataset,
        batch_tokens=int(cfg["batch_tokens"]),
        max_new_tokens=int(cfg["max_new_tokens"]),
        source="hf_capture",
        on_progress=on_progress,
    )
