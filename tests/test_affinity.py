"""repro.affinity: hand-computed tables, OOV fallback, Markov table and Table 1 statistics."""

import numpy as np
import pytest

from repro.affinity import (
    affinity_statistics,
    confidence_table,
    device_markov_table,
    encode_tokens,
    history_keys,
    lookup_rows,
    majority_device,
    nearest_seen_rows,
    static_topk_f1,
    token_device_table,
    token_expert_counts,
    token_frequency,
    token_kurtosis,
    topk_hotness,
    vocab_row_map,
    with_fallback_row,
)
from repro.affinity.tables import break_even_confidence, row_share_totals, token_table_occurrences
from repro.errors import TraceError
from repro.traces import RoutingTrace, TraceMeta, make_trace


def tiny_trace(token_ids, experts, num_experts=4, vocab_size=16, lengths=None):
    """A trace of one request (or `lengths` requests) from explicit token ids and experts int[N, L, k]."""
    experts = np.asarray(experts)
    n, num_layers, top_k = experts.shape
    lengths = [n] if lengths is None else lengths
    meta = TraceMeta(model="tiny", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(num_layers)), vocab_size=vocab_size)
    return make_trace(meta, np.concatenate([[0], np.cumsum(lengths)]), token_ids, experts)


def test_counts_confidence_and_frequency_by_hand():
    # token 5 twice (experts {0,1} then {0,2}), token 3 once ({3,2}); one layer, k=2
    trace = tiny_trace([5, 3, 5], [[[0, 1]], [[3, 2]], [[0, 2]]])
    vocab, counts = token_expert_counts(trace)
    assert vocab.tolist() == [3, 5]
    assert counts.shape == (1, 2, 4)
    assert counts[0].tolist() == [[0, 0, 1, 1], [2, 1, 1, 0]]
    conf = confidence_table(counts)
    np.testing.assert_allclose(conf[0, 1], [0.5, 0.25, 0.25, 0.0])
    np.testing.assert_allclose(conf.sum(-1), 1.0)
    assert token_frequency(counts, top_k=2).tolist() == [1.0, 2.0]


def test_confidence_of_an_empty_row_is_an_error():
    with pytest.raises(TraceError, match="no activations"):
        confidence_table(np.zeros((1, 2, 4)))


def test_empty_profile_is_a_trace_error():
    meta = TraceMeta(model="tiny", num_experts=4, top_k=2, layer_ids=(0,), vocab_size=8)
    with pytest.raises(TraceError, match="no tokens"):  # the trace format refuses it first
        make_trace(meta, [0], np.zeros(0, np.int32), np.zeros((0, 1, 2), np.int16))
    # built past validation: the affinity functions still refuse it themselves
    empty = RoutingTrace(meta, np.zeros(1, np.int64), np.zeros(0, np.int32), np.zeros((0, 1, 2), np.int16),
                         np.zeros(0, np.int32), (), (), ())
    with pytest.raises(TraceError, match="no tokens"):
        token_expert_counts(empty)
    with pytest.raises(TraceError, match="no tokens"):
        affinity_statistics(empty)


def test_token_device_table_majority_and_lowest_id_ties():
    counts = np.array([[[3, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 5]]], dtype=np.float32)  # [L=1, t=3, E=4]
    expert_device = np.array([[0, 1, 1, 0]])  # D=2
    table, conf = token_device_table(counts, expert_device, 2)
    assert table.tolist() == [[0, 0, 0]]  # row 1 ties 2-2 -> device 0
    np.testing.assert_allclose(conf, [[0.75, 0.5, 1.0]])


def test_lookup_and_oov_fallback_row():
    vocab = np.array([2, 7, 9], dtype=np.int32)
    assert lookup_rows(vocab, np.array([7, 3, 9, 100]), fallback_row=3).tolist() == [1, 3, 2, 3]
    row_of = vocab_row_map(vocab, vocab_size=12)
    assert row_of[[2, 7, 9]].tolist() == [0, 1, 2]
    assert set(np.delete(row_of, [2, 7, 9]).tolist()) == {3}
    # the fallback row of a table is the layer's expert popularity
    counts = np.array([[[2, 0], [0, 2]], [[1, 0], [3, 0]]], dtype=np.float32)
    padded = with_fallback_row(counts)
    np.testing.assert_allclose(padded[:, 2], [[0.5, 0.5], [1.0, 0.0]])


def test_nearest_neighbour_oov_by_embedding_cosine():
    embeddings = np.zeros((6, 2), dtype=np.float32)
    embeddings[1] = [1, 0]  # seen
    embeddings[4] = [0, 1]  # seen
    embeddings[0] = [5, 1]  # close in angle to 1
    embeddings[2] = [0.2, 3]  # close to 4
    embeddings[3] = [-1, 0.1]  # opposite of 1, nearer (cosine) to 4
    embeddings[5] = [1, 1.2]  # nearer to 4
    vocab = np.array([1, 4], dtype=np.int32)
    assert nearest_seen_rows(vocab, np.array([0, 2, 3, 5]), embeddings).tolist() == [0, 1, 1, 1]
    row_of = vocab_row_map(vocab, 6, embeddings)
    assert row_of.tolist() == [0, 0, 1, 1, 1, 1]


def test_majority_device_and_history_keys():
    expert_device = np.array([0, 0, 1, 1, 2, 2])
    experts = np.array([[0, 1, 4], [2, 4, 0], [5, 4, 3]])
    assert majority_device(experts, expert_device, 3).tolist() == [0, 0, 2]  # row 1 ties 1-1-1 -> 0
    # most recent layer is the least significant digit: (d[l-2], d[l-1]) = (2, 1) -> 2*3 + 1
    assert history_keys(np.array([[2, 1], [0, 0], [1, 2]]), 3).tolist() == [7, 0, 5]


def test_markov_table_recovers_a_deterministic_chain():
    # D=2, experts 0,1 on device 0 and 2,3 on device 1 in every layer; layer l+1's device flips layer l's
    rng = np.random.default_rng(0)
    n = 2000  # enough occurrences per history row for the gain to clear the margin
    dev0 = rng.integers(2, size=n)
    dev1 = 1 - dev0
    dev2 = dev0.copy()
    experts = np.stack([np.stack([2 * d, 2 * d + 1], axis=1) for d in (dev0, dev1, dev2)], axis=1)
    trace = tiny_trace(rng.integers(16, size=n), experts)
    expert_device = np.tile([0, 0, 1, 1], (3, 1))
    table, conf = device_markov_table(trace, expert_device, 2, lookback=2)
    assert table.shape == (3, 4)
    # layer 1, history (d0) -> key d0: flips
    assert table[1, 0] == 1 and table[1, 1] == 0
    # layer 2, history (d0, d1) = (0, 1) -> key 1 -> device 0; (1, 0) -> key 2 -> device 1; others unseen
    assert table[2, 1] == 0 and table[2, 2] == 1
    # the history is exact and token ids say little (T_p ~0.5-0.6), so A_p, on T_p's scale, must let the
    # chain override the token table wherever they disagree: where(T_p > A_p, T, A) then follows the chain
    # for (almost) every occurrence, against ~55 % for T alone. Unseen rows never override T.
    _, row = encode_tokens(trace.token_ids)
    token_dev, token_conf = token_device_table(token_expert_counts(trace)[1], expert_device, 2)
    for layer, keys, truth in ((1, dev0, dev1), (2, history_keys(np.stack([dev0, dev1], axis=1), 2), dev2)):
        pick = np.where(token_conf[layer, row] > conf[layer, keys], token_dev[layer, row], table[layer, keys])
        assert np.mean(pick == truth) >= 0.95 and np.mean(token_dev[layer, row] == truth) < 0.7
    assert conf[2, 0] == 0.0 and conf[2, 3] == 0.0


def test_markov_confidence_stays_off_when_the_history_is_noise():
    # D=2, k=2, experts 0,1 on device 0 and 2,3 on device 1. Layer 0 is a random coin (the history); at
    # layer 1 token id j has a side s = j % 2: 40 % of its occurrences put both experts on s, 60 % split
    # one-one (majority ties -> device 0). Every token has T = s with T_p = 0.4 + 0.6 / 2 = 0.7 of its
    # activations local, while device 0 wins the majority vote in ~80 % of every history row: the paper's
    # raw A_p = Pr(majority | history) ~ 0.8 > T_p would send side-1 tokens to device 0 (25 % local instead
    # of 75 %). The calibrated A_p must leave every token on its own table.
    rng = np.random.default_rng(3)
    n = 4000
    tokens = rng.integers(16, size=n)
    side = tokens % 2
    coin = rng.integers(2, size=n)
    layer0 = np.stack([2 * coin, 2 * coin + 1], axis=1)
    split = rng.random(n) < 0.6
    layer1 = np.where(split[:, None], np.array([[0, 2]]), np.stack([2 * side, 2 * side + 1], axis=1))
    trace = tiny_trace(tokens, np.stack([layer0, layer1], axis=1))
    expert_device = np.tile([0, 0, 1, 1], (2, 1))
    raw_markov = np.mean(majority_device(layer1, expert_device[1], 2) == 0)
    _, token_conf = token_device_table(token_expert_counts(trace)[1], expert_device, 2)
    assert raw_markov > token_conf[1].max()  # the raw rule would override T here
    _, conf = device_markov_table(trace, expert_device, 2, lookback=1)
    assert np.all(conf[1] == 0.0)


def test_break_even_confidence_and_held_out_token_table_by_hand():
    # one history row; occurrences sorted by T_p: the Markov device gains 1 on the three least confident
    # and loses 1 on the rest, so the best cut switches the three (gain 3 - sqrt(3) > 0), not more
    keys = np.zeros(6, dtype=np.int64)
    conf = np.array([0.9, 0.3, 0.5, 0.4, 0.8, 0.95], dtype=np.float32)
    gain = np.array([-1, 1, 1, 1, -1, -1], dtype=np.float64)
    threshold = break_even_confidence(keys, conf, gain, 1, margin=1.0)
    assert 0.5 < threshold[0] < 0.8 and (conf > threshold[0]).tolist() == [True, False, False, False, True, True]
    # a margin the gain cannot beat keeps the token table: 3 - 2 * sqrt(3) < 0
    assert break_even_confidence(keys, conf, gain, 1, margin=2.0)[0] == 0.0
    # held-out token table: row 0 seen twice (devices 0 then 1), row 1 once -> the layer's mean share
    share = np.array([[1.0, 0.0], [0.0, 1.0], [0.25, 0.75]], dtype=np.float32)
    devices = np.array([[0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 1]])  # k = 4 activations per occurrence
    totals, occurrences = row_share_totals(np.array([0, 0, 1]), devices, 2, 2)
    np.testing.assert_allclose(totals, [[1, 1], [0.25, 0.75]])
    assert occurrences.tolist() == [2, 1]
    share = np.array([[1.0, 0.0], [0.0, 1.0], [0.25, 0.75]], dtype=np.float32)
    device, confidence = token_table_occurrences(np.array([0, 0, 1]), share, totals, occurrences)
    assert device.tolist() == [1, 0, 1]  # each occurrence of row 0 is predicted by the other one
    np.testing.assert_allclose(confidence, [0.5, 0.5, 0.75])


def test_static_topk_f1_by_hand():
    # token 0: 8 occurrences always {0,1} -> F1 1; token 1: first 2 of 8 use {0,1}, the rest {2,3} -> F1 0;
    # token 2: occurs 3 times -> below min_occurrences, not scored
    token_row = np.array([0] * 8 + [1] * 8 + [2] * 3)
    experts = np.array([[0, 1]] * 8 + [[0, 1]] * 2 + [[2, 3]] * 6 + [[1, 2]] * 3)
    rows, f1 = static_topk_f1(token_row, experts, 3, 4, predict_share=0.25, min_occurrences=4)
    assert rows.tolist() == [0, 1]
    assert f1.tolist() == [1.0, 0.0]


def test_hotness_and_kurtosis_by_hand():
    conf = np.array([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    cumulative, beyond = topk_hotness(conf, 2)
    np.testing.assert_allclose(cumulative, [0.8, 0.5])
    np.testing.assert_allclose(beyond, [0.15, 0.25])
    spikes = np.zeros((1, 64))
    spikes[0, :6] = 1 / 6
    p = 6 / 64
    np.testing.assert_allclose(token_kurtosis(spikes), [(1 - 3 * p + 3 * p * p) / (p * (1 - p))])
    assert token_kurtosis(conf)[1] == 0.0


def test_affinity_statistics_one_row_per_layer():
    rng = np.random.default_rng(1)
    tokens = rng.integers(4, size=400)
    experts = np.stack([np.stack([tokens % 4, (tokens + 1) % 4], axis=1)] * 2, axis=1)  # deterministic per token
    trace = tiny_trace(tokens, experts)
    stats = affinity_statistics(trace)
    assert stats["layer"].tolist() == [0, 1]
    assert np.allclose(stats[["f1_p25", "f1_p50", "f1_p75"]], 1.0)
    assert np.allclose(stats["topk_hotness_p50"], 1.0)
    assert np.allclose(stats["max_nontopk_hotness_p75"], 0.0)


def test_encode_tokens_round_trip():
    ids = np.array([9, 2, 9, 5])
    vocab, row = encode_tokens(ids)
    assert vocab[row].tolist() == ids.tolist()
