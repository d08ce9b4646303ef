"""Token -> expert affinity tables (paper §2.1): counts, confidence C_p, token -> device T / T_p, OOV
fallback and the inter-layer device Markov table A / A_p.

Legend: N routed tokens in a trace, L MoE layers, E experts per layer (the paper's N), D devices (EP ranks,
the paper's E), t distinct token ids seen in the profile (rows of every table; row t is the OOV fallback
row where a function says so), V model vocabulary size, k experts per token, h lookback layers, H embedding
width, Q = D**h device histories.

Tables are sparse-aware: rows exist only for token ids seen in the profile (`token_vocab`, sorted unique), so
a DeepSeek-V3 vocabulary of 129,280 ids never becomes a dense [L, V, E] array. Lookups go through
`np.searchsorted` on `token_vocab` (`lookup_rows`) or through the dense int32[V] row map built from it
(`vocab_row_map`, 4 bytes per vocabulary id) when a hot path needs O(1) lookups.

Profiles are read in chunks of token rows (`profile_chunks`, PROFILE_CHUNK_TOKENS at a time, memory-mapped
pages released after each), and counts are integer histograms summed over chunks (`add_pair_counts`), so a
table costs memory proportional to its own size, not to the profile's tokens, and equals the one-pass table
exactly (integer sums do not depend on the chunking).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from repro.errors import ConfigError, TraceError
from repro.traces import RoutingTrace
from repro.traces.arrays import iter_row_chunks, release_pages

# a Markov table over D**h histories stops being a table beyond this many rows per layer
MAX_MARKOV_ROWS = 1 << 22
# profile token rows read at a time (DeepSeek-V3 shape: 2**17 x 58 layers x top-8 int16 = 122 MB per chunk)
PROFILE_CHUNK_TOKENS = 1 << 17


def profile_chunks(
    trace: RoutingTrace, keep: np.ndarray, chunk_tokens: int | None = None, experts: bool = True
) -> Iterator[tuple[slice, np.ndarray, np.ndarray | None]]:
    """(part, token_ids int32[n], experts int16[n, L, k] or None) for the kept tokens of each chunk of trace rows
    (chunk_tokens rows, default PROFILE_CHUNK_TOKENS).

    keep int64[N'] sorted token indices; part is the slice of `keep` the chunk covers (keep[part] are its tokens,
    in order). experts=False reads token ids only. Memory-mapped pages are released after each chunk.
    """
    for start, stop in iter_row_chunks(trace.num_tokens, chunk_tokens or PROFILE_CHUNK_TOKENS):
        lo, hi = (int(i) for i in np.searchsorted(keep, [start, stop]))
        if lo == hi:
            continue
        rows = keep[lo:hi]
        dense = hi - lo == stop - start  # every row kept: one contiguous read
        token_ids = np.asarray(trace.token_ids[start:stop] if dense else trace.token_ids[rows])
        chunk_experts = None
        if experts:
            chunk_experts = np.asarray(trace.experts[start:stop] if dense else trace.experts[rows])
        yield slice(lo, hi), token_ids, chunk_experts
        release_pages(trace.token_ids)
        release_pages(trace.experts)


def sample_profile_requests(offsets: np.ndarray, keep: np.ndarray, max_tokens: int, seed: int = 0) -> np.ndarray:
    """int64[N''] the kept tokens (keep int64[N'] sorted) of a seeded random subset of whole requests holding at
    most max_tokens of them: requests are taken in one seeded permutation while the total stays within the cap
    (at least the first one). offsets int64[R+1]. The same arguments give the same sample."""
    request_of_kept = np.searchsorted(np.asarray(offsets), keep, side="right") - 1
    kept_per_request = np.bincount(request_of_kept, minlength=len(offsets) - 1)
    order = np.random.default_rng(seed).permutation(len(kept_per_request))
    within = np.cumsum(kept_per_request[order]) <= max_tokens
    within[0] = True
    chosen = np.zeros(len(kept_per_request), dtype=bool)
    chosen[order[within]] = True
    return keep[chosen[request_of_kept]]


def gather_rows(array, rows: np.ndarray, chunk_tokens: int | None = None) -> np.ndarray:
    """array[rows] for sorted rows int64[n], read one block of chunk_tokens array rows at a time (default
    PROFILE_CHUNK_TOKENS) with memory-mapped pages released after each block: a sparse sample of a big trace
    would otherwise leave most of the file mapped (the kernel maps the cached pages around every fault)."""
    parts = []
    for start, stop in iter_row_chunks(len(array), chunk_tokens or PROFILE_CHUNK_TOKENS):
        lo, hi = np.searchsorted(rows, [start, stop])
        if lo < hi:
            parts.append(np.array(array[rows[lo:hi]]))
            release_pages(array)
    return np.concatenate(parts) if parts else np.asarray(array[rows])


def profile_vocab(trace: RoutingTrace, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(token_vocab int32[t] sorted unique ids of the kept tokens, occurrences int64[t] kept tokens per row).

    Equal to encode_tokens(trace.token_ids[keep])'s vocabulary, read chunk by chunk (memory O(t) plus a chunk).
    """
    vocab = np.zeros(0, dtype=np.int32)
    for _, token_ids, _ in profile_chunks(trace, keep, experts=False):
        vocab = np.union1d(vocab, token_ids).astype(np.int32)
    occurrences = np.zeros(len(vocab), dtype=np.int64)
    for _, token_ids, _ in profile_chunks(trace, keep, experts=False):
        occurrences += np.bincount(np.searchsorted(vocab, token_ids), minlength=len(vocab))
    return vocab, occurrences


def add_pair_counts(counts: np.ndarray, row: np.ndarray, column: np.ndarray) -> np.ndarray:
    """counts[num_rows, num_columns] += pair_counts(row, column, num_rows, num_columns), in place; returns counts.

    counts a C-contiguous integer (or float) array; row int[n]; column int[n, m]. A bincount over all cells when
    the chunk's pairs are at least a quarter of them, else a sort of the pairs (np.unique): O(pairs) either way.
    """
    num_columns = counts.shape[1]
    keys = (np.asarray(row, dtype=np.int64)[:, None] * num_columns + np.asarray(column, dtype=np.int64)).ravel()
    flat = counts.reshape(-1)
    if flat.size <= 4 * keys.size:
        flat += np.bincount(keys, minlength=flat.size).astype(counts.dtype, copy=False)
    else:
        cells, times = np.unique(keys, return_counts=True)
        flat[cells] += times.astype(counts.dtype, copy=False)
    return counts


def token_device_counts(
    trace: RoutingTrace, keep: np.ndarray, token_vocab: np.ndarray, expert_device: np.ndarray, num_devices: int
) -> np.ndarray:
    """int64[L, t, D] how many of each token row's activations land on each device, per layer, over the kept
    tokens (rows: searchsorted in token_vocab int32[t]); expert_device int[L, E]. One chunked pass."""
    expert_device = np.asarray(expert_device, dtype=np.int64)
    counts = np.zeros((trace.num_layers, len(token_vocab), num_devices), dtype=np.int64)
    for _, token_ids, experts in profile_chunks(trace, keep):
        token_row = np.searchsorted(token_vocab, token_ids)
        for layer in range(trace.num_layers):
            add_pair_counts(counts[layer], token_row, expert_device[layer][experts[:, layer].astype(np.int64)])
    return counts


def device_mass_from_counts(counts: np.ndarray) -> np.ndarray:
    """float32[t, D] each row of int counts[t, D] divided by its total (`routed_device_mass`'s normalisation)."""
    mass = counts.astype(np.float32)
    return mass / np.maximum(mass.sum(axis=1, keepdims=True), 1e-30)


def encode_tokens(token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(token_vocab int32[t] sorted unique ids, token_row int64[N] row of each token in token_vocab)."""
    token_vocab, token_row = np.unique(np.asarray(token_ids), return_inverse=True)
    return token_vocab.astype(np.int32), token_row.astype(np.int64).ravel()


def pair_counts(row: np.ndarray, column: np.ndarray, num_rows: int, num_columns: int) -> np.ndarray:
    """int64[num_rows, num_columns] histogram of (row[i], column[i, j]) pairs: row int[n], column int[n, m].

    The one (row, expert) / (row, device) histogram behind the count, mass and share tables below.
    """
    keys = (np.asarray(row, dtype=np.int64)[:, None] * num_columns + np.asarray(column, dtype=np.int64)).ravel()
    return np.bincount(keys, minlength=num_rows * num_columns).reshape(num_rows, num_columns)


def layer_token_expert_counts(token_row: np.ndarray, experts: np.ndarray, num_rows: int, num_experts: int) -> np.ndarray:
    """float32[t, E] how often each token row activated each expert in one layer (all k slots counted).

    token_row int64[N] from `encode_tokens`; experts int[N, k] the layer's routing.
    """
    return pair_counts(token_row, experts, num_rows, num_experts).astype(np.float32)


def layer_token_expert_coo(
    token_row: np.ndarray, experts: np.ndarray, num_rows: int, num_experts: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row int64[nnz], expert int64[nnz], count float32[nnz]): the nonzeros of `layer_token_expert_counts`,
    sorted by (row, expert). Memory O(t x E) for one transient histogram, O(nnz) after."""
    counts = pair_counts(token_row, experts, num_rows, num_experts)
    row, expert = np.nonzero(counts)
    return row, expert, counts[row, expert].astype(np.float32)


def routed_device_mass(
    token_row: np.ndarray, experts: np.ndarray, num_rows: int, expert_device: np.ndarray, num_devices: int
) -> np.ndarray:
    """float32[t, D] `device_mass` of one layer straight from the routing: O(N x k + t x D), no [t, E] table.

    token_row int64[N]; experts int[N, k] the layer's routing; expert_device int[E] the layer's placement.
    """
    device = np.asarray(expert_device)[np.asarray(experts, dtype=np.int64)]  # [N, k]
    return device_mass_from_counts(pair_counts(token_row, device, num_rows, num_devices))


def profile_tokens(trace: RoutingTrace, prompt_only: bool = False) -> np.ndarray:
    """int64[N'] indices of the trace tokens a profile uses (all tokens, or prompt tokens only)."""
    if prompt_only:
        return np.flatnonzero(trace.prompt_mask())
    return np.arange(trace.num_tokens)


def token_expert_counts(
    trace: RoutingTrace, layers=None, prompt_only: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(token_vocab int32[t], counts float32[L', t, E]) from a profile trace (L' = len(layers), default all).

    Raises TraceError when the profile has no tokens (nothing to learn affinity from).
    """
    keep = profile_tokens(trace, prompt_only)
    if len(keep) == 0:
        raise TraceError(
            f"the profile trace of {trace.meta.model!r} has no {'prompt ' if prompt_only else ''}tokens; "
            "profile on a split with at least one routed token."
        )
    layers = list(range(trace.num_layers) if layers is None else layers)
    token_vocab, _ = profile_vocab(trace, keep)
    # summed in float32 where that is exact (every cell < 2**24), else in float64 then rounded once, as the
    # one-pass int64 -> float32 table is
    exact = np.float32 if len(keep) < (1 << 24) else np.float64
    counts = np.zeros((len(layers), len(token_vocab), trace.meta.num_experts), dtype=exact)
    for _, token_ids, experts in profile_chunks(trace, keep):
        token_row = np.searchsorted(token_vocab, token_ids)
        for i, layer in enumerate(layers):
            add_pair_counts(counts[i], token_row, experts[:, layer])
    return token_vocab, counts.astype(np.float32, copy=False)


def confidence_table(counts: np.ndarray) -> np.ndarray:
    """float32[..., t, E] C_p = Pr(expert | token): each row of counts divided by its sum (rows sum to 1).

    A row with no activations is an error: every profiled token was routed in every layer.
    """
    counts = np.asarray(counts, dtype=np.float32)
    totals = counts.sum(axis=-1, keepdims=True)
    if np.any(totals <= 0):
        where = np.argwhere(totals[..., 0] <= 0)[0].tolist()
        raise TraceError(f"token row {where} of the count table has no activations; rebuild it with token_expert_counts.")
    return counts / totals


def token_frequency(counts: np.ndarray, top_k: int) -> np.ndarray:
    """float32[t] a_j: occurrences of each token row (its activations in one layer divided by k).

    counts float[t, E] (one layer) or float[L, t, E] (the first layer is used; every layer sees every token).
    """
    counts = np.asarray(counts, dtype=np.float32)
    one_layer = counts[0] if counts.ndim == 3 else counts
    return one_layer.sum(axis=-1) / top_k


def expert_popularity(counts: np.ndarray) -> np.ndarray:
    """float32[L, E] each layer's expert activation share (rows sum to 1): the OOV fallback distribution."""
    load = np.asarray(counts, dtype=np.float64).sum(axis=1)
    return (load / np.maximum(load.sum(axis=1, keepdims=True), 1e-30)).astype(np.float32)


def lookup_rows(token_vocab: np.ndarray, token_ids: np.ndarray, fallback_row: int) -> np.ndarray:
    """int64[T] the table row of each token id; ids not in token_vocab get `fallback_row` (OOV)."""
    token_ids = np.asarray(token_ids)
    pos = np.searchsorted(token_vocab, token_ids)
    pos_clipped = np.minimum(pos, len(token_vocab) - 1)
    seen = (pos < len(token_vocab)) & (token_vocab[pos_clipped] == token_ids)
    return np.where(seen, pos_clipped, fallback_row).astype(np.int64)


def nearest_seen_rows(
    token_vocab: np.ndarray, query_ids: np.ndarray, embeddings: np.ndarray, chunk: int = 4096
) -> np.ndarray:
    """int64[Q'] the row of the seen token whose input embedding is most cosine-similar to each query id.

    embeddings float[V, H] is the model's input embedding matrix. Work is chunked over queries so memory is
    O(chunk x t); the cost is O(Q' x t x H) multiply-adds.
    """
    embeddings = np.asarray(embeddings)
    query_ids = np.asarray(query_ids, dtype=np.int64)
    if embeddings.ndim != 2 or embeddings.shape[0] <= max(int(token_vocab.max()), int(query_ids.max(initial=0))):
        raise ConfigError(
            f"the embedding matrix has shape {embeddings.shape}; it needs one row per vocabulary id "
            f"(at least {max(int(token_vocab.max()), int(query_ids.max(initial=0))) + 1}); pass the model's input embeddings."
        )

    def unit(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float32)
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

    seen_unit = unit(embeddings[token_vocab])  # [t, H]
    out = np.empty(len(query_ids), dtype=np.int64)
    for start in range(0, len(query_ids), chunk):
        sims = unit(embeddings[query_ids[start : start + chunk]]) @ seen_unit.T
        out[start : start + chunk] = np.argmax(sims, axis=1)
    return out


def vocab_row_map(token_vocab: np.ndarray, vocab_size: int, embeddings: np.ndarray | None = None) -> np.ndarray:
    """int32[V] table row for every vocabulary id.

    Seen ids map to their own row. Unseen ids map to their nearest seen neighbour by input-embedding cosine
    when `embeddings` float[V, H] is given, otherwise to row t (the fallback row holding each layer's expert
    popularity; tables built for plans carry t + 1 rows).
    """
    if len(token_vocab) and int(token_vocab.max()) >= vocab_size:
        raise TraceError(f"token id {int(token_vocab.max())} is outside the vocabulary of {vocab_size} ids.")
    row_of = np.full(vocab_size, len(token_vocab), dtype=np.int32)
    row_of[token_vocab] = np.arange(len(token_vocab), dtype=np.int32)
    if embeddings is not None:
        unseen = np.flatnonzero(row_of == len(token_vocab))
        if len(unseen):
            row_of[unseen] = nearest_seen_rows(token_vocab, unseen, embeddings)
    return row_of


def with_fallback_row(counts: np.ndarray) -> np.ndarray:
    """float32[L, t + 1, E] counts plus one last row per layer: the layer's expert popularity (OOV fallback)."""
    return np.concatenate([counts, expert_popularity(counts)[:, None, :]], axis=1)


def one_hot_devices(expert_device: np.ndarray, num_devices: int) -> np.ndarray:
    """float32[..., E, D] one-hot of expert_device int[..., E]."""
    return (np.asarray(expert_device)[..., None] == np.arange(num_devices)).astype(np.float32)


def device_mass(counts: np.ndarray, expert_device: np.ndarray, num_devices: int) -> np.ndarray:
    """float32[L, t, D] share of each token row's activations that land on each device (rows sum to 1).

    counts float[L, t, E]; expert_device int[L, E].
    """
    mass = np.matmul(np.asarray(counts, dtype=np.float32), one_hot_devices(expert_device, num_devices))
    return mass / np.maximum(mass.sum(axis=-1, keepdims=True), 1e-30)


def token_device_table(counts: np.ndarray, expert_device: np.ndarray, num_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """(T int16[L, t], T_p float32[L, t]): the device holding most of each token row's activations and that share.

    counts float[L, t, E]; expert_device int[L, E]. Ties go to the lowest device id (np.argmax).
    """
    mass = device_mass(counts, expert_device, num_devices)
    table = np.argmax(mass, axis=-1)
    return table.astype(np.int16), np.take_along_axis(mass, table[..., None], axis=-1)[..., 0]


def majority_device(experts: np.ndarray, expert_device: np.ndarray, num_devices: int) -> np.ndarray:
    """int64[...] the device hosting most of each token's k experts; ties -> lowest device id.

    experts int[..., k] logical ids; expert_device int[E] (one layer's placement). One bincount over
    (token, device) keys: O(n x (k + D)) rather than the O(n x k x D) of comparing against every device.
    """
    experts = np.asarray(experts, dtype=np.int64)
    lead_shape, top_k = experts.shape[:-1], experts.shape[-1]
    device = np.asarray(expert_device)[experts.reshape(-1, top_k)]  # [n, k]
    per_device = pair_counts(np.arange(len(device)), device, len(device), num_devices)
    return np.argmax(per_device, axis=1).reshape(lead_shape)


def history_keys(history: np.ndarray, num_devices: int) -> np.ndarray:
    """int64[N] mixed-radix index of device histories int[N, h'] (chronological: column -1 is the last layer).

    key = sum_i history[:, -1 - i] * D**i, so the most recent layer is the least significant digit and a
    shorter history (early layers) indexes the first D**h' rows of the same table.
    """
    history = np.asarray(history, dtype=np.int64)
    weights = num_devices ** np.arange(history.shape[1] - 1, -1, -1, dtype=np.int64)
    return history @ weights


def check_markov_size(num_devices: int, lookback: int) -> None:
    """Raise ConfigError when a D**h Markov table would be too large to tabulate."""
    if lookback < 0:
        raise ConfigError(f"system.params.lookback must be >= 0, got {lookback}.")
    if num_devices**lookback > MAX_MARKOV_ROWS:
        raise ConfigError(
            f"a device Markov table with lookback={lookback} over {num_devices} devices has "
            f"{num_devices}**{lookback} rows per layer (> {MAX_MARKOV_ROWS}); lower system.params.lookback."
        )


def local_shares(experts: np.ndarray, expert_device: np.ndarray, num_devices: int) -> np.ndarray:
    """float32[n, D] share of each token's k activations that land on each device (rows sum to 1).

    experts int[n, k] one layer's routing; expert_device int[E] that layer's placement. Placing a token on
    device d makes share[:, d] of its activations local, so this is the LAR a prediction d earns.
    """
    experts = np.asarray(experts, dtype=np.int64)
    num, top_k = experts.shape
    counts = pair_counts(np.arange(num), np.asarray(expert_device)[experts], num, num_devices)
    return (counts / top_k).astype(np.float32)


def row_share_totals(token_row: np.ndarray, device: np.ndarray, num_rows: int, num_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """(totals float64[t, D], occurrences int64[t]): each token row's summed `local_shares` over the profile.

    token_row int64[n]; device int[n, k] the device serving each of an occurrence's k activations. Counted from
    the k device ids directly (integer histogram, then / k), never through a dense [n, D] share matrix.
    """
    totals = pair_counts(token_row, device, num_rows, num_devices) / device.shape[1]
    return totals, np.bincount(token_row, minlength=num_rows)


def token_table_occurrences(
    token_row: np.ndarray, share: np.ndarray, totals: np.ndarray, occurrences: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(held-out T int64[n], T_p float32[n]) of profile occurrences, for calibrating against the token table.

    token_row int64[n] and share float32[n, D] (`local_shares`) of the occurrences to score, each of which is
    counted in totals float[t, D] / occurrences int[t] (`row_share_totals` over the whole profile). T_p is the
    full-profile confidence of the occurrence's row, the number the online rule will compare. The device is the
    one the table would predict were the occurrence not in the profile: row j's mean share without occurrence
    i, (sum_j - share_i) / (n_j - 1), or the layer's mean share (the OOV row) for ids seen once. Scoring the
    in-sample T would be optimistic for rare ids (one occurrence with all experts on one device has T_p = 1 and
    is always right), so the token table would look better than it is on unseen requests.
    """
    seen = occurrences[token_row]
    confidence = (totals.max(axis=1)[token_row] / seen).astype(np.float32)
    held_out = (totals[token_row] - share) / np.maximum(seen - 1, 1)[:, None]
    held_out = np.where((seen > 1)[:, None], held_out, totals.sum(axis=0) / occurrences.sum())
    return np.argmax(held_out, axis=1), confidence


def break_even_confidence(
    keys: np.ndarray, token_confidence: np.ndarray, gain: np.ndarray, num_rows: int, margin: float = 1.0
) -> np.ndarray:
    """float32[Q] per history row, the token confidence below which the Markov prediction should win.

    keys int64[n] history row of each profile occurrence; token_confidence float32[n] its row's T_p (as the
    online rule sees it); gain float[n] local share of the Markov device minus that of the token device. For each row, the
    occurrences are sorted by T_p and the cut c maximising sum(gain of the c least confident) - margin *
    sqrt(c) is kept when positive; the result is the smallest float32 above the T_p at that cut, so
    `where(T_p > A_p, T, A)` switches exactly those occurrences. Gains lie in [-1, 1] (std <= 1), so the
    margin asks the profile gain to beat `margin` worst-case standard errors: cuts that win by chance on a
    few samples are dropped. Rows without a winning cut get 0 (the token table always wins).
    """
    num = len(keys)
    threshold = np.zeros(num_rows, dtype=np.float32)
    if num == 0:
        return threshold
    order = np.lexsort((token_confidence, keys))
    key_s, conf_s = keys[order], token_confidence[order]
    cumulative = np.cumsum(np.asarray(gain, dtype=np.float64)[order])
    start = np.searchsorted(key_s, key_s, side="left")
    prefix_gain = cumulative - np.concatenate([[0.0], cumulative])[start]
    score = prefix_gain - margin * np.sqrt(np.arange(num) - start + 1.0)
    # a cut can only fall between distinct T_p values: the rule cannot split occurrences of equal confidence
    last = np.ones(num, dtype=bool)
    last[:-1] = (key_s[1:] != key_s[:-1]) | (conf_s[1:] != conf_s[:-1])
    score = np.where(last, score, -np.inf)
    # the best cut per row: sort by (row, score) and take each row's last entry
    by_score = np.lexsort((score, key_s))
    row_last = np.flatnonzero(np.r_[key_s[by_score][1:] != key_s[by_score][:-1], True])
    best = by_score[row_last]
    win = score[best] > 0
    threshold[key_s[best[win]]] = np.nextafter(conf_s[best[win]].astype(np.float32), np.float32(np.inf))
    return threshold


def device_markov_table(
    trace: RoutingTrace,
    expert_device: np.ndarray,
    num_devices: int,
    lookback: int = 2,
    tokens: np.ndarray | None = None,
    margin: float = 1.0,
    max_occurrences: int = 1 << 17,
    device_counts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(A int16[L, Q], A_p float32[L, Q]): the Markov device per device history, and its calibrated confidence.

    tokens int[N'] the profile tokens to learn from (sorted; default all); device_counts int64[L, t, D] their
    `token_device_counts` when the caller has them (else one chunked pass computes them); A and A_p are estimated on at most
    `max_occurrences` of them per layer (an evenly strided subset; all of them on smaller profiles). A token's device at a layer is the
    device hosting most of its k experts (`majority_device` semantics); row q of layer l is the mixed-radix
    key (`history_keys`) of its devices at layers l-h'..l-1, h' = min(h, l); at layer 0 only row 0 is used.

    A[l, q]: the device with the highest mean local share (`local_shares`) over the row's occurrences, i.e.
    the prediction that keeps most activations local; unseen rows get the layer's best device.

    A_p[l, q] is calibrated against the token table, not the paper's raw Pr(A | history): Algorithm 3 picks
    `where(T_p > A_p, T, A)`, and T_p (a token's share of activations on its best device) and Pr(A | q) (a
    frequency of majority votes) are not on one scale -- on learned routing the raw rule lowered LAR (tiny
    Mixtral, MMLU, EP4: 0.379 at h=0 vs 0.350 at h=1). Even comparing expected local shares is biased, since
    a token with a low T_p is also a poor fit for the row's average. So A_p is measured on T_p's own scale:
    the break-even token confidence (`break_even_confidence`) below which using A instead of T raised the
    profile's local share. The cut is placed on the T_p the online rule sees, while T's share is scored
    leave-one-out (`token_table_occurrences`) so the token table is judged out of sample. A_p = 0 where A never helps, so the Markov table can only switch tokens
    for which the profile says it wins.
    """
    check_markov_size(num_devices, lookback)
    keep = np.arange(trace.num_tokens) if tokens is None else np.asarray(tokens, dtype=np.int64)
    if np.any(np.diff(keep) <= 0):
        raise ConfigError("device_markov_table's tokens must be sorted, distinct token indices (profile_tokens gives them).")
    num_layers = trace.num_layers
    num_rows = num_devices**lookback
    token_vocab, occurrences = profile_vocab(trace, keep)
    if device_counts is None:
        device_counts = token_device_counts(trace, keep, token_vocab, expert_device, num_devices)
    # every s-th occurrence (deterministic) bounds the dense [n, D] work at DeepSeek-V3 scale; the token
    # table's totals still come from the whole profile
    sample = np.arange(0, len(keep), max(1, -(-len(keep) // max_occurrences)))
    sample_experts = gather_rows(trace.experts, keep[sample])  # int16[S, L, k]
    sample_row = np.searchsorted(token_vocab, gather_rows(trace.token_ids, keep[sample]))  # int64[S]
    token_device = np.empty((len(sample), num_layers), dtype=np.int64)
    table = np.zeros((num_layers, num_rows), dtype=np.int16)
    confidence = np.zeros((num_layers, num_rows), dtype=np.float32)
    arange = np.arange(len(sample))
    for layer in range(num_layers):  # one forward pass: a layer's history only needs earlier layers
        # `row_share_totals` over the whole profile, from the chunked counts (the same integers, / k)
        totals = device_counts[layer] / trace.meta.top_k
        share = local_shares(sample_experts[:, layer], expert_device[layer], num_devices)  # [S, D]
        token_device[:, layer] = np.argmax(share, axis=1)  # ties -> lowest id, as majority_device
        depth = min(lookback, layer)
        keys = history_keys(token_device[:, layer - depth : layer], num_devices)
        row_mass = np.stack(
            [np.bincount(keys, weights=share[:, d], minlength=num_rows) for d in range(num_devices)], axis=1
        )
        seen = np.bincount(keys, minlength=num_rows) > 0
        table[layer] = np.where(seen, np.argmax(row_mass, axis=1), np.argmax(row_mass.sum(axis=0)))
        token_table, token_conf = token_table_occurrences(sample_row, share, totals, occurrences)
        gain = share[arange, table[layer][keys]] - share[arange, token_table]
        confidence[layer] = break_even_confidence(keys, token_conf, gain, num_rows, margin)
    return table, confidence
