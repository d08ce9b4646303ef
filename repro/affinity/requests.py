"""Per-request expert activations, inter-layer expert co-activation and per-token kurtosis of a routing trace:
the data behind the paper's Fig. 6 (a) request activations coloured by class, (b) the kurtosis histogram and
(c) the layer-l x layer-(l+1) expert correlation, small enough to store with every job.

Legend: R requests of the trace, R' requests kept (the first `max_requests`), N tokens, L MoE layers,
l chosen layers, P adjacent layer pairs kept, E experts per layer, k experts per token, t' distinct token ids
seen at least `min_occurrences` times.
"""

from __future__ import annotations

import numpy as np

from repro.affinity.stats import token_kurtosis
from repro.affinity.tables import add_pair_counts, confidence_table, profile_chunks, profile_vocab
from repro.errors import ConfigError, TraceError
from repro.traces import RoutingTrace


def spikes_kurtosis(num_experts: int, top_k: int) -> float:
    """Pearson kurtosis of a row with k equal spikes among E experts (a token always routed alike).

    (1 - 3p + 3p^2) / (p (1 - p)) with p = k / E: the ceiling a fully deterministic token reaches; 8.8 for
    6 of 64, but only 2.3 for 2 of 8, so the paper's "> 8" reads differently per shape.
    """
    p = top_k / num_experts
    return float((1 - 3 * p + 3 * p * p) / (p * (1 - p)))


def request_activations(
    trace: RoutingTrace,
    layers=None,
    max_requests: int = 2000,
    max_pairs: int = 8,
    min_occurrences: int = 4,
) -> dict[str, np.ndarray]:
    """Arrays for Fig. 6 (a)-(c) of one trace's prompt tokens (generated tokens are left out: a request's
    class shows in its prompt, and the paper profiles prompts only).

    layers: MoE layer indices to keep per request; default the first, middle and last MoE layer.
    Returns (every value a plain array, savable with np.savez and loadable without pickle):
      layer_index int64[l], layer_ids int64[l] (model layer ids)
      request_index int64[R'] (the first R' = min(R, max_requests) requests, in trace order)
      labels <U[R'], datasets <U[R'] (the trace's request table)
      activations float32[R', l, E]: share of each request's prompt activations (all k slots) on each expert;
        rows sum to 1 (all zeros for a request without prompt tokens)
      pair_layers int64[P]: MoE layer index a of each adjacent pair (a, a + 1), at most max_pairs evenly spaced
      pair_layer_ids int64[P, 2]: model layer ids of each pair (a trace may store non-adjacent model layers)
      coactivation float32[P, E, E]: share of (token, expert i at layer a, expert j at layer a + 1) triples over
        all prompt tokens; each [E, E] sums to 1
      kurtosis_layer int64 (scalar: layer_index[0]); token_kurtosis float32[t']: Pearson kurtosis of the
        activation-share row of each token id seen >= min_occurrences times in that layer (rarer ids are left out:
        an id seen once is k equal spikes by construction)
      kurtosis_spikes float64 (scalar): spikes_kurtosis(E, k), the deterministic-token reference
    """
    if max_requests < 1 or max_pairs < 1 or min_occurrences < 1:
        raise ConfigError(
            f"max_requests, max_pairs and min_occurrences must be >= 1, got {max_requests}, {max_pairs}, "
            f"{min_occurrences}."
        )
    L, E, k = trace.num_layers, trace.meta.num_experts, trace.meta.top_k
    if L < 1 or trace.num_requests < 1:
        raise TraceError(f"the trace of {trace.meta.model!r} has no requests or no MoE layers; nothing to summarise.")
    layer_index = np.unique(np.array([0, L // 2, L - 1] if layers is None else layers, dtype=np.int64))
    if layer_index.min() < 0 or layer_index.max() >= L:
        raise ConfigError(f"layers {layer_index.tolist()} are outside the trace's {L} MoE layers.")

    prompt = np.flatnonzero(trace.prompt_mask())
    owner = np.searchsorted(np.asarray(trace.offsets), prompt, side="right") - 1  # int64[N'] request of each
    kept = min(trace.num_requests, max_requests)
    pair_layers = np.unique(np.linspace(0, max(L - 2, 0), min(max_pairs, max(L - 1, 0))).round().astype(np.int64))
    token_vocab, _ = profile_vocab(trace, prompt)
    # integer counts summed over chunks of prompt tokens (memory: the tables, not the tokens)
    counts = np.zeros((len(layer_index), kept, E), dtype=np.int64)  # per chosen layer, kept request x expert
    joint = np.zeros((len(pair_layers), E * E), dtype=np.int64)
    first = np.zeros((len(token_vocab), E), dtype=np.int64)  # token row x expert at layer_index[0]
    for part, token_ids, experts in profile_chunks(trace, prompt):
        experts = experts.astype(np.int64)  # [n, L, k]
        mine = owner[part] < kept
        for i, layer in enumerate(layer_index):
            add_pair_counts(counts[i], owner[part][mine], experts[mine, layer])
        for p, a in enumerate(pair_layers):
            # every (slot of layer a, slot of layer a + 1) pair of a token: n x k x k keys
            joint[p] += np.bincount((experts[:, a, :, None] * E + experts[:, a + 1, None, :]).ravel(), minlength=E * E)
        add_pair_counts(first, np.searchsorted(token_vocab, token_ids), experts[:, layer_index[0]])
    counts = counts.transpose(1, 0, 2).astype(np.float32)  # [R', l, E]
    activations = counts / np.maximum(counts.sum(axis=2, keepdims=True), 1.0)
    coactivation = np.zeros((len(pair_layers), E, E), dtype=np.float32)
    for p in range(len(pair_layers)):
        total = joint[p].astype(np.float64)
        coactivation[p] = (total / max(total.sum(), 1.0)).reshape(E, E)
    first = first.astype(np.float32)  # `layer_token_expert_counts` of the first chosen layer, [t, E]
    frequent = first.sum(axis=1) >= min_occurrences * k
    kurtosis = token_kurtosis(confidence_table(first[frequent])) if frequent.any() else np.zeros(0)

    return {
        "layer_index": layer_index,
        "layer_ids": np.asarray(trace.meta.layer_ids, dtype=np.int64)[layer_index],
        "request_index": np.arange(kept, dtype=np.int64),
        "labels": np.asarray(trace.request_labels[:kept], dtype=str),
        "datasets": np.asarray(trace.request_datasets[:kept], dtype=str),
        "activations": activations,
        "pair_layers": pair_layers,
        "pair_layer_ids": np.asarray(trace.meta.layer_ids, dtype=np.int64)[np.stack([pair_layers, pair_layers + 1], axis=1)],
        "coactivation": coactivation,
        "kurtosis_layer": np.int64(layer_index[0]),
        "token_kurtosis": kurtosis.astype(np.float32),
        "kurtosis_spikes": np.float64(spikes_kurtosis(E, k)),
    }


__all__ = ["request_activations", "spikes_kurtosis"]
