"""Affinity statistics: the paper's Table 1 (per layer p25/p50/p75 of the static top-k predictor's F1, the
cumulative top-k hotness and the max non-top-k hotness) and the per-token kurtosis of App. A.2.

Legend: N routed tokens, L MoE layers, E experts per layer, t distinct token ids (rows), k experts per token.

Definitions (the paper gives numbers, not formulas; these reproduce its multiples of 1/k):
- static top-k F1 of a token: its occurrences are split in order into a first `predict_share` (at least one)
  and the rest; the predictor is the k experts most often chosen in the first part, the truth the k most
  often chosen in the rest; both sets have k members, so F1 = precision = recall = |overlap| / k.
- hotness: the confidence row C_p[j] (activation shares summing to 1). Cumulative top-k hotness is the sum of
  the k largest shares; max non-top-k hotness is the (k+1)-th largest share.
- kurtosis: Pearson kurtosis (not excess) of the row C_p[j] across the E experts; k equal spikes among E
  experts give (1 - 3p + 3p^2) / (p (1 - p)) with p = k/E, e.g. 8.8 for 6 of 64, the paper's "> 8" regime.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from repro.affinity.tables import (
    add_pair_counts,
    confidence_table,
    layer_token_expert_counts,
    profile_chunks,
    profile_tokens,
    profile_vocab,
)
from repro.errors import ConfigError, TraceError
from repro.traces import RoutingTrace

QUANTILES = (0.25, 0.5, 0.75)


def top_k_sets(counts: np.ndarray, top_k: int) -> np.ndarray:
    """int64[t, k] the k most counted experts of each row; ties go to the lower expert id."""
    order = np.argsort(-np.asarray(counts), axis=-1, kind="stable")
    return order[..., :top_k]


def static_topk_f1(
    token_row: np.ndarray,
    experts: np.ndarray,
    num_rows: int,
    num_experts: int,
    predict_share: float = 0.25,
    min_occurrences: int = 4,
) -> tuple[np.ndarray, np.ndarray]:
    """(rows int64[t'], f1 float32[t']) for the token rows with at least `min_occurrences` occurrences.

    token_row int64[N] (rows in trace order); experts int[N, k] one layer's routing.
    """
    if not 0.0 < predict_share < 1.0:
        raise ConfigError(f"predict_share must be in (0, 1), got {predict_share}.")
    top_k = experts.shape[1]
    order = np.argsort(token_row, kind="stable")  # occurrences grouped by row, in trace order
    occurrences = np.bincount(token_row, minlength=num_rows)
    group_start = np.concatenate([[0], np.cumsum(occurrences)[:-1]])
    rank = np.empty(len(token_row), dtype=np.int64)
    rank[order] = np.arange(len(token_row)) - np.repeat(group_start, occurrences)
    predict_len = np.maximum(1, np.floor(predict_share * occurrences).astype(np.int64))
    in_predict = rank < predict_len[token_row]
    predict = layer_token_expert_counts(token_row[in_predict], experts[in_predict], num_rows, num_experts)
    truth = layer_token_expert_counts(token_row[~in_predict], experts[~in_predict], num_rows, num_experts)
    return topk_f1_from_counts(predict, truth, occurrences, top_k, min_occurrences)


def topk_f1_from_counts(
    predict: np.ndarray, truth: np.ndarray, occurrences: np.ndarray, top_k: int, min_occurrences: int
) -> tuple[np.ndarray, np.ndarray]:
    """(rows int64[t'], f1 float32[t']) of `static_topk_f1` from its two count tables float32[t, E] (each row's
    first predict_share of occurrences, and the rest) and occurrences int[t]."""
    rows = np.flatnonzero(occurrences >= max(2, min_occurrences))
    predicted = top_k_sets(predict[rows], top_k)
    actual = top_k_sets(truth[rows], top_k)
    overlap = (predicted[:, :, None] == actual[:, None, :]).any(axis=2).sum(axis=1)
    return rows, (overlap / top_k).astype(np.float32)


def occurrence_rank(token_row: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """int64[n] how many earlier occurrences each token has: seen int64[t] counts those before this chunk
    (token_row int64[n] in trace order); seen is advanced past the chunk in place."""
    order = np.argsort(token_row, kind="stable")
    sorted_rows = token_row[order]
    rank = np.empty(len(token_row), dtype=np.int64)
    rank[order] = np.arange(len(token_row)) - np.searchsorted(sorted_rows, sorted_rows, side="left") + seen[sorted_rows]
    seen += np.bincount(token_row, minlength=len(seen))
    return rank


def topk_hotness(confidence: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(cumulative top-k hotness float32[t], max non-top-k hotness float32[t]) of confidence rows [t, E]."""
    ordered = -np.sort(-np.asarray(confidence, dtype=np.float32), axis=-1)
    beyond = ordered[:, top_k] if ordered.shape[1] > top_k else np.zeros(len(ordered), dtype=np.float32)
    return ordered[:, :top_k].sum(axis=1), beyond


def token_kurtosis(confidence: np.ndarray) -> np.ndarray:
    """float64[t] Pearson kurtosis of each confidence row across experts (uniform rows give 0 by convention)."""
    rows = np.asarray(confidence, dtype=np.float64)
    centred = rows - rows.mean(axis=1, keepdims=True)
    variance = (centred**2).mean(axis=1)
    fourth = (centred**4).mean(axis=1)
    flat = variance <= 0
    return np.where(flat, 0.0, fourth / np.where(flat, 1.0, variance**2))


def affinity_statistics(
    trace: RoutingTrace,
    layers=None,
    predict_share: float = 0.25,
    min_occurrences: int = 4,
    prompt_only: bool = False,
) -> pd.DataFrame:
    """One row per MoE layer: Table 1's quartiles plus kurtosis medians.

    Columns: layer, model_layer, tokens (distinct ids), f1_tokens (ids with >= min_occurrences),
    f1_p25/p50/p75, topk_hotness_p25/p50/p75, max_nontopk_hotness_p25/p50/p75, kurtosis_p50,
    kurtosis_gt8_share. F1 quartiles are NaN when no id occurs min_occurrences times.
    """
    keep = profile_tokens(trace, prompt_only)
    if len(keep) == 0:
        raise TraceError(f"the trace of {trace.meta.model!r} has no tokens to compute affinity statistics from.")
    if not 0.0 < predict_share < 1.0:
        raise ConfigError(f"predict_share must be in (0, 1), got {predict_share}.")
    token_vocab, occurrences = profile_vocab(trace, keep)
    num_rows, num_experts = len(token_vocab), trace.meta.num_experts
    predict_len = np.maximum(1, np.floor(predict_share * occurrences).astype(np.int64))
    layers = list(range(trace.num_layers) if layers is None else layers)
    # layers are counted a group at a time (one chunked pass each) so the int64 [t, E] tables stay <= STATS_TABLE_BYTES
    group_size = max(1, STATS_TABLE_BYTES // (2 * 8 * max(num_rows * num_experts, 1)))
    records = []
    for first in range(0, len(layers), group_size):
        group = layers[first : first + group_size]
        total = np.zeros((len(group), num_rows, num_experts), dtype=np.int64)
        predicted = np.zeros_like(total)  # counts of each row's first predict_share of occurrences (trace order)
        seen = np.zeros(num_rows, dtype=np.int64)
        for _, token_ids, experts in profile_chunks(trace, keep):
            token_row = np.searchsorted(token_vocab, token_ids)
            in_predict = occurrence_rank(token_row, seen) < predict_len[token_row]
            for i, layer in enumerate(group):
                add_pair_counts(total[i], token_row, experts[:, layer])
                add_pair_counts(predicted[i], token_row[in_predict], experts[in_predict, layer])
        for i, layer in enumerate(group):
            records.append(_layer_record(trace, layer, total[i], predicted[i], occurrences, min_occurrences))
    return pd.DataFrame.from_records(records)


STATS_TABLE_BYTES = 1 << 29  # int64 count tables held at once by affinity_statistics (512 MB)


def _layer_record(
    trace: RoutingTrace, layer: int, total: np.ndarray, predicted: np.ndarray, occurrences: np.ndarray,
    min_occurrences: int,
) -> dict:
    """One row of `affinity_statistics` from a layer's int counts total[t, E] and predicted[t, E] (the part of
    total in each row's first predict_share of occurrences)."""
    num_rows, top_k = total.shape[0], trace.meta.top_k
    confidence = confidence_table(total.astype(np.float32))
    _, f1 = topk_f1_from_counts(predicted.astype(np.float32), (total - predicted).astype(np.float32), occurrences,
                                top_k, min_occurrences)
    cumulative, beyond = topk_hotness(confidence, top_k)
    kurtosis = token_kurtosis(confidence)
    row = {"layer": layer, "model_layer": trace.meta.layer_ids[layer], "tokens": num_rows, "f1_tokens": len(f1)}
    for name, values in (("f1", f1), ("topk_hotness", cumulative), ("max_nontopk_hotness", beyond)):
        quartiles = np.quantile(values, QUANTILES) if len(values) else [np.nan] * len(QUANTILES)
        row.update({f"{name}_p{int(q * 100)}": float(v) for q, v in zip(QUANTILES, quartiles, strict=True)})
    row["kurtosis_p50"] = float(np.median(kurtosis))
    row["kurtosis_gt8_share"] = float(np.mean(kurtosis > 8))
    return row
