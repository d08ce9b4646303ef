"""The paper's figures and tables (repro.figures.paper) on fabricated runs/ dirs, the one-SLO-for-all rule on a
hand-made per-rate table, and the per-request activation artifact (repro.affinity.requests) on a hand-made trace."""

import numpy as np
import pytest
import scipy.stats

from repro.affinity.requests import request_activations, spikes_kurtosis
from repro.errors import ConfigError
from repro.traces import TraceMeta, make_trace

# ---- repro.affinity.requests ---------------------------------------------------------------------------------


def hand_trace():
    """3 requests, 3 MoE layers, E=4, k=2. Request 1's last token is generated (prefill 2 of 3)."""
    experts = np.array([
        # request 0 (label "a"): tokens 7, 8
        [[0, 1], [0, 2], [3, 1]],
        [[0, 2], [1, 2], [3, 2]],
        # request 1 (label "b"): tokens 7, 9 prompt, token 8 generated
        [[2, 3], [0, 3], [1, 0]],
        [[3, 0], [2, 3], [0, 2]],
        [[1, 2], [1, 2], [1, 2]],
        # request 2 (label "a"): token 7
        [[0, 1], [0, 2], [3, 1]],
    ])
    meta = TraceMeta(model="hand", num_experts=4, top_k=2, layer_ids=(1, 2, 3), vocab_size=16, dataset="d")
    return make_trace(meta, [0, 2, 5, 6], [7, 8, 7, 9, 8, 7], experts, prefill_len=[2, 2, 1],
                      request_labels=["a", "b", "a"])


def test_request_activations_by_hand():
    out = request_activations(hand_trace(), min_occurrences=1)
    assert out["layer_index"].tolist() == [0, 1, 2]
    assert out["layer_ids"].tolist() == [1, 2, 3]
    assert out["labels"].tolist() == ["a", "b", "a"]
    acts = out["activations"]
    assert acts.shape == (3, 3, 4) and acts.dtype == np.float32
    # request 0, layer 0: experts 0,1,0,2 -> [2,1,1,0]/4; request 1 (generated token left out): 2,3,3,0 -> [1,0,1,2]/4
    np.testing.assert_allclose(acts[0, 0], [0.5, 0.25, 0.25, 0.0])
    np.testing.assert_allclose(acts[1, 0], [0.25, 0.0, 0.25, 0.5])
    np.testing.assert_allclose(acts[1, 2], [0.5, 0.25, 0.25, 0.0])  # layer 2: 1,0,0,2
    np.testing.assert_allclose(acts[2, 1], [0.5, 0.0, 0.5, 0.0])
    # pairs (0,1) and (1,2) over the 5 prompt tokens: 5 x 2 x 2 = 20 triples each
    assert out["pair_layers"].tolist() == [0, 1]
    co = out["coactivation"]
    assert co.shape == (2, 4, 4)
    np.testing.assert_allclose(co.sum(axis=(1, 2)), 1.0, rtol=1e-6)
    # (expert 0 at layer 0, expert 0 at layer 1): tokens 0 and 5 ({0,1}->{0,2}), token 3 ({3,0}->{2,3}: no),
    # token 1 ({0,2}->{1,2}: no), token 2 ({2,3}->{0,3}: no) -> 2 of 20
    assert co[0, 0, 0] == pytest.approx(2 / 20)
    # (expert 3 at layer 0, expert 3 at layer 1): token 2 ({2,3}->{0,3}) and token 3 ({3,0}->{2,3}) -> 2 of 20
    assert co[0, 3, 3] == pytest.approx(2 / 20)
    # kurtosis of layer 0 for token ids 7 (experts 0,1,2,3,0,1 -> [2,2,1,1]), 8 ([1,0,1,0]), 9 ([1,0,0,1])
    expected = scipy.stats.kurtosis(np.array([[2, 2, 1, 1], [1, 0, 1, 0], [1, 0, 0, 1]]) / [[6], [2], [2]],
                                    axis=1, fisher=False)
    np.testing.assert_allclose(out["token_kurtosis"], expected, rtol=1e-5)
    assert float(out["kurtosis_spikes"]) == pytest.approx(1.0)  # 2 equal spikes among 4: p = 1/2


def test_request_activations_caps_and_rare_tokens():
    out = request_activations(hand_trace(), layers=[1], max_requests=2, max_pairs=1, min_occurrences=2)
    assert out["activations"].shape == (2, 1, 4)
    assert out["request_index"].tolist() == [0, 1] and out["labels"].tolist() == ["a", "b"]
    assert out["pair_layers"].tolist() == [0]
    # layer 1's prompt tokens: only id 7 is seen twice (3 times) -> one kurtosis value
    assert out["token_kurtosis"].shape == (1,)
    assert int(out["kurtosis_layer"]) == 1


def test_spikes_kurtosis_matches_the_paper_regime():
    assert spikes_kurtosis(64, 6) == pytest.approx(8.7701, rel=1e-4)
    row = np.zeros(64)
    row[:6] = 1 / 6
    assert spikes_kurtosis(64, 6) == pytest.approx(scipy.stats.kurtosis(row, fisher=False))


def test_request_activations_bad_input():
    with pytest.raises(ConfigError, match="outside"):
        request_activations(hand_trace(), layers=[3])
    with pytest.raises(ConfigError, match=">= 1"):
        request_activations(hand_trace(), max_requests=0)
