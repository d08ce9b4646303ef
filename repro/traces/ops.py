"""Request-level operations on traces: select, split (profile / validate / evaluate), digest, concatenate."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from repro.errors import TraceError
from repro.traces.arrays import LazyRows, RowsView, iter_row_chunks, release_pages
from repro.traces.format import RoutingTrace, make_trace

DIGEST_CHUNK_ROWS = 1 << 16  # token rows hashed at a time
LAZY_SELECT_BYTES = 1 << 28  # selected experts beyond this (256 MB) stay on disk (RowsView) when the source does


def select_requests(trace: RoutingTrace, indices) -> RoutingTrace:
    """A trace holding requests `indices` (int[R']) in that order.

    In memory, except when the routing it selects from lives on disk (memory-mapped or sharded) and the selected
    experts exceed LAZY_SELECT_BYTES: then token_ids, experts and weights are RowsViews that read the selected rows
    on demand (a profile / evaluate split of a big trace is not copied; values are the same either way).
    """
    idx = np.asarray(indices, dtype=np.int64)
    lengths = trace.lengths()[idx]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    # gather token rows of every selected request without a Python loop per token
    starts = trace.offsets[:-1][idx]
    token_rows = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
    on_disk = isinstance(trace.experts, (np.memmap, LazyRows))
    if on_disk and len(token_rows) * trace.experts[:1].nbytes > LAZY_SELECT_BYTES and len(token_rows):
        return RoutingTrace(  # the source was validated when read, and a request subset of it stays valid
            meta=trace.meta,
            offsets=offsets,
            token_ids=RowsView(trace.token_ids, token_rows),
            experts=RowsView(trace.experts, token_rows),
            prefill_len=np.asarray(trace.prefill_len)[idx].astype(np.int32),
            request_ids=tuple(trace.request_ids[i] for i in idx),
            request_datasets=tuple(trace.request_datasets[i] for i in idx),
            request_labels=tuple(trace.request_labels[i] for i in idx),
            weights=None if trace.weights is None else RowsView(trace.weights, token_rows),
        )
    return make_trace(
        trace.meta,
        offsets,
        trace.token_ids[token_rows],
        trace.experts[token_rows],
        prefill_len=trace.prefill_len[idx],
        request_ids=[trace.request_ids[i] for i in idx],
        request_datasets=[trace.request_datasets[i] for i in idx],
        request_labels=[trace.request_labels[i] for i in idx],
        weights=None if trace.weights is None else trace.weights[token_rows],
    )


def split_trace(
    trace: RoutingTrace, profile_fraction: float = 0.2, rng: np.random.Generator | None = None
) -> tuple[RoutingTrace, RoutingTrace]:
    """Split by request into (profile, evaluate), the paper's 20 % / 80 % (no validate split).

    Requests are shuffled with `rng` (default seed 0) before cutting; each part keeps the original request
    order so arrival order survives.
    """
    split = split_indices(trace.num_requests, profile_fraction, rng)
    return select_requests(trace, split.profile), select_requests(trace, split.evaluate)


class Split(NamedTuple):
    """Sorted request indices of the three parts: fit on profile, tune on validate, report on evaluate."""

    profile: np.ndarray  # int64[R_p]
    validate: np.ndarray  # int64[R_v] (empty when validate_fraction is 0)
    evaluate: np.ndarray  # int64[R - R_p - R_v]

    def part(self, name: str) -> np.ndarray:
        if name not in self._fields:
            raise TraceError(f"unknown split {name!r}; choose one of {self._fields}.")
        return getattr(self, name)

    def to_json(self) -> dict:
        return {name: getattr(self, name).tolist() for name in self._fields}

    @classmethod
    def from_json(cls, d: dict) -> Split:
        return cls(*(np.asarray(d.get(name, []), dtype=np.int64) for name in cls._fields))


def split_indices(
    num_requests: int,
    profile_fraction: float = 0.2,
    rng: np.random.Generator | None = None,
    validate_fraction: float = 0.0,
) -> Split:
    """A seeded random split by request into profile / validate / evaluate (each part sorted).

    The profile part is the first round(profile_fraction x R) requests of one seeded permutation, the validate
    part the next round(validate_fraction x R), the evaluate part the rest; so for a given seed the profile
    part does not depend on validate_fraction (a model trained on it stays valid when the validate share changes).
    """
    if not 0.0 < profile_fraction < 1.0:
        raise TraceError(f"profile_fraction must be in (0, 1), got {profile_fraction}.")
    if not 0.0 <= validate_fraction < 1.0 - profile_fraction:
        raise TraceError(
            f"validate_fraction must be in [0, 1 - profile_fraction) = [0, {1 - profile_fraction:g}), "
            f"got {validate_fraction}."
        )
    n_profile = int(round(profile_fraction * num_requests))
    n_validate = int(round(validate_fraction * num_requests))
    if n_profile < 1 or n_profile + n_validate >= num_requests or (validate_fraction > 0 and n_validate < 1):
        raise TraceError(
            f"a {profile_fraction:.0%} profile / {validate_fraction:.0%} validate split of {num_requests} requests "
            "leaves a part empty; use more requests."
        )
    rng = np.random.default_rng(0) if rng is None else rng
    perm = rng.permutation(num_requests)
    cut = n_profile + n_validate
    return Split(np.sort(perm[:n_profile]), np.sort(perm[n_profile:cut]), np.sort(perm[cut:]))


def concat_traces(traces: list[RoutingTrace]) -> RoutingTrace:
    """Concatenate traces of the same model (same experts, top_k and MoE layers) request-wise."""
    if not traces:
        raise TraceError("concat_traces needs at least one trace.")
    m = traces[0].meta
    for t in traces[1:]:
        if (t.meta.num_experts, t.meta.top_k, t.meta.layer_ids) != (m.num_experts, m.top_k, m.layer_ids):
            raise TraceError(
                f"cannot concatenate traces of different routing shapes: {t.meta.model} "
                f"(E={t.meta.num_experts}, k={t.meta.top_k}) vs {m.model} (E={m.num_experts}, k={m.top_k})."
            )
    lengths = np.concatenate([t.lengths() for t in traces])
    has_w = all(t.weights is not None for t in traces)
    datasets = sorted({t.meta.dataset for t in traces})
    meta = replace(m, vocab_size=max(t.meta.vocab_size for t in traces), dataset="+".join(datasets))
    return make_trace(
        meta,
        np.concatenate([[0], np.cumsum(lengths)]),
        np.concatenate([t.token_ids for t in traces]),
        np.concatenate([t.experts for t in traces]),
        prefill_len=np.concatenate([t.prefill_len for t in traces]),
        request_ids=[i for t in traces for i in t.request_ids],
        request_datasets=[d for t in traces for d in t.request_datasets],
        request_labels=[x for t in traces for x in t.request_labels],
        weights=np.concatenate([t.weights for t in traces]) if has_w else None,
    )


def trace_digest(trace: RoutingTrace) -> str:
    """sha256 (hex, 16 chars) of a trace's meta, request table and arrays: same routing <=> same digest.

    meta.extra is provenance (training time, cache hits, ...) and is left out: it differs between two builds of
    the same routing.
    """
    meta = {k: v for k, v in trace.meta.to_json().items() if k != "extra"}
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    h.update(json.dumps([trace.request_ids, trace.request_datasets, trace.request_labels]).encode())
    for array in (trace.offsets, trace.token_ids, trace.experts, trace.prefill_len, trace.weights):
        if array is not None:
            h.update(str((np.dtype(array.dtype).str, tuple(int(n) for n in array.shape))).encode())
            # hashed in row chunks: the same bytes as the whole array, without holding a big trace (or a sharded
            # one's concatenation) in memory, so a sharded trace has its concatenation's digest
            for start, stop in iter_row_chunks(len(array), DIGEST_CHUNK_ROWS):
                h.update(memoryview(np.ascontiguousarray(array[start:stop])).cast("B"))
            release_pages(array)
    return h.hexdigest()[:16]
