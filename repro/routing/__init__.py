"""Routing producers: who routes each token to which experts.

`route_workload(model_cfg, requests, train_requests, ...)` dispatches on model_cfg["kind"]:
  tiny   - the offline default: a small Mixtral-architecture MoE trained for CPU minutes (tiny_model.py)
  hf     - any HF transformers MoE checkpoint or config, captured with router hooks (hf_capture.py)
  replay - sampling from measured per-token expert tables of a real model (replay.py)
  synthetic - a seeded generative router with popularity, class, per-token and inter-layer knobs (synthetic.py)
Every producer returns a RoutingTrace over `requests` (in order); `train_requests` is the profile split, the only
data a producer may learn from.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from pathlib import Path

import numpy as np

from repro.errors import ConfigError
from repro.traces import RoutingTrace, TraceMeta, make_trace
from repro.workloads.request import Request

# bump when a producer changes the routing (or the tiny model's weights) that a given config produces: it is part
# of the cache keys of routed traces (repro.run) and of trained tiny models. 2: tiny-model entries record how they
# were made and the time budget left the key (version 1 entries may hold models a time limit cut short); 3: the tiny
# model trains and routes on one thread (before, its weights depended on the machine's thread count under one key).
ROUTING_CACHE_VERSION = 3

PRODUCERS = {
    "tiny": "repro.routing.tiny_model:route_with_tiny_model",
    "hf": "repro.routing.hf_capture:route_with_hf_model",
    "replay": "repro.routing.replay:route_with_replay",
    "synthetic": "repro.routing.synthetic:route_with_synthetic",
}


def route_workload(
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
    """The producer of model_cfg["kind"]'s trace of `requests`; on_progress (e.g. repro.tracking's) reaches the
    producers that report progress (tiny: training and capture; hf: capture)."""
    kind = model_cfg.get("kind")
    if kind not in PRODUCERS:
        raise ConfigError(f"model.kind={kind!r} is not a routing producer; choose one of {sorted(PRODUCERS)}.")
    module, fn = PRODUCERS[kind].split(":")
    produce = getattr(importlib.import_module(module), fn)
    reports = on_progress is not None and "on_progress" in inspect.signature(produce).parameters
    return produce(
        dict(model_cfg),
        requests,
        train_requests,
        cache_dir=Path(cache_dir),
        seed=seed,
        dataset=dataset,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        **({"on_progress": on_progress} if reports else {}),
    )


def prompts_trace(meta: TraceMeta, requests: list[Request], experts) -> RoutingTrace:
    """The trace of `requests`' prompts (every token is prefill) routed to experts int[N, L, k], in request order."""
    lengths = np.array([len(r.token_ids) for r in requests], dtype=np.int64)
    return make_trace(
        meta,
        np.concatenate([[0], np.cumsum(lengths)]),
        np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in requests]),
        experts,
        prefill_len=lengths,
        request_ids=[r.id for r in requests],
        request_datasets=[r.dataset for r in requests],
        request_labels=[r.label for r in requests],
    )
