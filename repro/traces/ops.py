"""Request-level operations on traces: select, split (profile / evaluate), concatenate."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from repro.errors import TraceError
from repro.traces.format import RoutingTrace, make_trace


def select_requests(trace: RoutingTrace, indices) -> RoutingTrace:
    """A new in-memory trace holding requests `indices` (int[R']) in that order."""
    idx = np.asarray(indices, dtype=np.int64)
    lengths = trace.lengths()[idx]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    # gather token rows of every selected request without a Python loop per token
    starts = trace.offsets[:-1][idx]
    token_rows = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
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
    """Split by request into (profile, evaluate), the paper's 20 % / 80 %.

    Requests are shuffled with `rng` (default seed 0) before cutting; each part keeps the original request
    order so arrival order survives.
    """
    profile, evaluate = split_indices(trace.num_requests, profile_fraction, rng)
    return select_requests(trace, profile), select_requests(trace, evaluate)


def split_indices(
    num_requests: int, profile_fraction: float = 0.2, rng: np.random.Generator | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(profile int[R_p], evaluate int[R - R_p]) sorted request indices of a seeded random split."""
    if not 0.0 < profile_fraction < 1.0:
        raise TraceError(f"profile_fraction must be in (0, 1), got {profile_fraction}.")
    n_profile = int(round(profile_fraction * num_requests))
    if n_profile < 1 or n_profile >= num_requests:
        raise TraceError(
            f"a {profile_fraction:.0%} profile split of {num_requests} requests leaves one side empty; "
            "use more requests."
        )
    rng = np.random.default_rng(0) if rng is None else rng
    perm = rng.permutation(num_requests)
    return np.sort(perm[:n_profile]), np.sort(perm[n_profile:])


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
