"""Synthetic routing: determinism, valid shapes and presets, the concentration knob, and the persistence knob's
effect on Sem-MoE's Markov history (the property the offline default sources must have)."""

from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from repro.affinity.stats import affinity_statistics
from repro.errors import ConfigError
from repro.eval import evaluate
from repro.parallel import ParallelConfig
from repro.routing import PRODUCERS, route_workload
from repro.routing.synthetic import SYNTHETIC_DEFAULTS, check_synthetic_config, route_with_synthetic
from repro.systems import make_system
from repro.traces import select_requests, split_indices
from repro.workloads.request import Request

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"
SMALL = {"num_experts": 32, "top_k": 4, "num_layers": 6, "first_layer": 1, "groups": 4, "candidates": 8}


def zipf_requests(num_requests=160, length=200, vocab=3000, classes=8, seed=0) -> list[Request]:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, vocab + 1)
    return [
        Request(id=str(i), dataset="toy", label=f"c{i % classes}",
                token_ids=rng.choice(vocab, size=length, p=weights / weights.sum()).astype(np.int32))
        for i in range(num_requests)
    ]


def route(cfg, requests, seed=0):
    return route_with_synthetic(cfg, requests, [], cache_dir=None, seed=seed, dataset="toy", tokenizer="mixtral", vocab_size=3000)


def test_same_seed_same_trace_and_rows_are_distinct_experts():
    requests = zipf_requests(40, 100)
    a, b, c = route(SMALL, requests), route(SMALL, requests), route(SMALL, requests, seed=1)
    assert np.array_equal(a.experts, b.experts) and not np.array_equal(a.experts, c.experts)
    assert a.experts.shape == (4000, 6, 4) and a.meta.layer_ids == tuple(range(1, 7)) and a.meta.dense_layers == (0,)
    assert a.experts.min() >= 0 and a.experts.max() < 32
    e = np.sort(a.experts.astype(np.int64), axis=2)
    assert (np.diff(e, axis=2) > 0).all(), "k distinct experts per token and layer"
    # the same token id routes alike across requests: its slot-0 expert at layer 0 is far from uniform (1/32)
    tok = a.token_ids == np.bincount(a.token_ids).argmax()
    assert np.bincount(a.experts[tok, 0, 0]).max() / tok.sum() > 0.3


def test_extreme_knobs_still_give_distinct_experts():
    cfg = dict(SMALL, num_experts=8, top_k=4, groups=8, popularity_skew=4.0, concentration=1.0, candidates=4)
    e = np.sort(route(cfg, zipf_requests(10, 50)).experts.astype(np.int64), axis=2)
    assert (np.diff(e, axis=2) > 0).all()


def test_table1_statistics_rise_with_concentration():
    requests = zipf_requests(120, 200)
    rows = []
    for concentration in (0.0, 0.5, 1.0):
        stats = affinity_statistics(route(dict(SMALL, concentration=concentration, explore=0.0), requests))
        rows.append((stats.f1_p50.mean(), stats.topk_hotness_p50.mean(), stats.f1_p25.mean()))
    f1, hot, f1_low = np.array(rows).T
    assert (np.diff(hot) > 0).all() and (np.diff(f1_low) > 0).all() and f1[-1] > f1[0], rows


def test_persistence_gives_sem_moe_history_a_gain():
    # the key property: with persistence the layer-(l-1, l-2) devices predict layer l beyond the token id,
    # so Sem-MoE's Attention-TP LAR with lookback 2 beats lookback 0; without persistence the gain is ~0.
    requests = zipf_requests(160, 200)
    gains = {}
    for persistence in (0.0, 0.9):
        trace = route(dict(SMALL, concentration=0.7, persistence=persistence), requests)
        profile_idx, _, eval_idx = split_indices(trace.num_requests, 0.2, np.random.default_rng(0))
        profile, evaluation = select_requests(trace, profile_idx), select_requests(trace, eval_idx)
        lar = {}
        for lookback in (0, 2):
            plan = make_system("semmoe", lookback=lookback, n_starts=1, polish_rounds=0).fit(
                profile, ParallelConfig(devices=4, attention="tp", tokens_per_step=1024), np.random.default_rng(0)
            )
            lar[lookback] = evaluate(plan, evaluation, history=2).summary["lar"]
        gains[persistence] = lar[2] - lar[0]
    assert gains[0.9] > 0.03 and gains[0.0] < 0.02 and gains[0.9] > gains[0.0] + 0.02, gains


@pytest.mark.parametrize("path", sorted(CONF.glob("synthetic_*.yaml")), ids=lambda p: p.stem)
def test_presets_are_valid_and_route(path):
    cfg = OmegaConf.to_container(OmegaConf.load(path))
    assert set(cfg) == set(SYNTHETIC_DEFAULTS) and cfg["kind"] == "synthetic"
    check_synthetic_config(cfg)
    trace = route_workload(dict(cfg, num_layers=3), zipf_requests(4, 30), [], cache_dir=Path("."), seed=0,
                           dataset="toy", tokenizer="mixtral", vocab_size=3000)
    assert trace.experts.shape == (120, 3, cfg["top_k"]) and trace.meta.source == "synthetic"


def test_presets_have_the_model_shapes():
    shapes = {p.stem: OmegaConf.load(p) for p in CONF.glob("synthetic_*.yaml")}
    want = {"deepseek_v2_lite": (64, 6, 26), "qwen3_30b_a3b": (128, 8, 48), "deepseek_v3": (256, 8, 58), "mixtral": (8, 2, 32)}
    for name, (e, k, layers) in want.items():
        c = shapes[f"synthetic_{name}"]
        assert (c.num_experts, c.top_k, c.num_layers) == (e, k, layers)
    assert "synthetic" in PRODUCERS


def test_bad_configs_are_refused():
    for bad in ({"top_k": 70}, {"candidates": 2}, {"persistence": 1.5}, {"groups": 100}, {"domain_key": "x"}, {"oops": 1}):
        with pytest.raises(ConfigError):
            check_synthetic_config(bad)
