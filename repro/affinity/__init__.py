"""Token -> expert affinity: profile tables (C_p, T, T_p), OOV fallback, device Markov table (A, A_p) and
the paper's Table 1 statistics. Placement decisions live in repro/systems, not here."""

from repro.affinity.stats import affinity_statistics, static_topk_f1, token_kurtosis, topk_hotness
from repro.affinity.tables import (
    confidence_table,
    device_markov_table,
    device_mass,
    encode_tokens,
    expert_popularity,
    history_keys,
    layer_token_expert_counts,
    lookup_rows,
    majority_device,
    nearest_seen_rows,
    token_device_table,
    token_expert_counts,
    token_frequency,
    vocab_row_map,
    with_fallback_row,
)

__all__ = [
    "affinity_statistics",
    "confidence_table",
    "device_markov_table",
    "device_mass",
    "encode_tokens",
    "expert_popularity",
    "history_keys",
    "layer_token_expert_counts",
    "lookup_rows",
    "majority_device",
    "nearest_seen_rows",
    "static_topk_f1",
    "token_device_table",
    "token_expert_counts",
    "token_frequency",
    "token_kurtosis",
    "topk_hotness",
    "vocab_row_map",
    "with_fallback_row",
]
