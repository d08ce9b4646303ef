"""repro.systems.semmoe.predictor: the learned request-level predictor for Sem-MoE's Attention-DP scheduler."""

import numpy as np
import pytest
import scipy.sparse as sp

from repro.errors import ConfigError
from repro.eval import evaluate
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.systems.base import Placement
from repro.systems.semmoe import SemMoEPlan
from repro.systems.semmoe.predictor import (
    CV_FOLDS,
    RIDGE_GRID,
    _centred,
    fit_learned_table,
    prompt_bag,
    request_device_shares,
    ridge_cv_errors,
)
from repro.traces import TraceMeta, make_trace, split_trace


def marker_trace(seed=0, num_requests=160, request_len=16, num_experts=8, top_k=2, num_layers=2, noise=0.1):
    """Two topics; a request's first token is its topic's marker (id 0 or 1), the others are shared ids 2..21 drawn
    regardless of topic, and EVERY token of the request routes to its topic's expert block (rotated per layer).
    A token table sees the shared ids split ~50/50 between topics, so their votes are noise that outvotes the one
    marker; a request-level model can learn that the marker decides."""
    rng = np.random.default_rng(seed)
    topic = rng.integers(2, size=num_requests)
    token_ids = rng.integers(2, 22, size=(num_requests, request_len))
    token_ids[:, 0] = topic
    block = num_experts // 2
    slot = rng.integers(block, size=(num_requests * request_len, num_layers))
    base = np.repeat(topic, request_len)[:, None] * block + slot
    noisy = rng.random(base.shape) < noise
    base = np.where(noisy, rng.integers(num_experts, size=base.shape), base)
    first = (base + np.arange(num_layers) * block) % num_experts
    experts = np.stack([first, (first + 1) % num_experts], axis=2)[:, :, :top_k]
    meta = TraceMeta(model="markers", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(num_layers)),
                     vocab_size=22)
    return make_trace(meta, np.arange(num_requests + 1) * request_len, token_ids.ravel(), experts)


@pytest.fixture(scope="module")
def marker_split():
    return split_trace(marker_trace(), 0.5, np.random.default_rng(0))


def test_prompt_bag_counts_prompt_tokens_only_by_hand():
    row_of_token = np.array([0, 1, 2, 3, 3])  # ids 3 and 4 unseen: both map to the OOV row 3
    token_ids = np.array([0, 0, 1, 9, 4, 2, 1])  # request 0: prompt [0, 0, 1] + generated 9; request 1: [4, 2, 1]
    bag = prompt_bag(row_of_token, token_ids, np.array([0, 4, 7]), np.array([3, 3]), 4).toarray()
    np.testing.assert_allclose(bag, [[2 / 3, 1 / 3, 0, 0], [0, 1 / 3, 1 / 3, 1 / 3]])


def test_request_device_shares_by_hand_with_a_replica():
    # 2 layers, 3 experts, 2 devices; expert 2 has a replica on both devices in layer 1
    present = np.zeros((2, 3, 2), dtype=bool)
    present[0, [0, 1, 2], [0, 1, 1]] = True
    present[1, [0, 1, 2, 2], [0, 1, 0, 1]] = True
    experts = np.array([[[0], [2]], [[1], [1]], [[2], [0]]])  # [N=3, L=2, k=1]
    shares = request_device_shares(np.array([0, 0, 1]), experts, present, 2)
    # request 0: layer 0 experts 0, 1 -> devices 0, 1; layer 1 experts 2 (both), 1 -> d0 1, d1 2; over 4 activations
    np.testing.assert_allclose(shares, [[2 / 4, 3 / 4], [1 / 2, 1 / 2]])


def primal_ridge(features, target, penalty):
    """Ridge with an unpenalised intercept, solved in the primal: (weights [F, D], intercept [D])."""
    mean_x, mean_y = features.mean(axis=0), target.mean(axis=0)
    xc = features - mean_x
    weights = np.linalg.solve(xc.T @ xc + penalty * np.eye(features.shape[1]), xc.T @ (target - mean_y))
    return weights, mean_y - mean_x @ weights


def test_ridge_cv_errors_equal_the_primal_fold_by_fold():
    rng = np.random.default_rng(3)
    features, target = rng.random((23, 5)), rng.random((23, 3))
    penalties = np.array([0.01, 0.3, 5.0])
    errors = ridge_cv_errors(features @ features.T, target, penalties, folds=4)
    fold = np.arange(23) % 4
    for i, penalty in enumerate(penalties):
        total = 0.0
        for f in range(4):
            weights, intercept = primal_ridge(features[fold != f], target[fold != f], penalty)
            total += ((features[fold == f] @ weights + intercept - target[fold == f]) ** 2).sum()
        assert errors[i] == pytest.approx(total / target.size, rel=1e-9)


def test_fitted_table_is_the_primal_ridge_on_idf_features():
    rng = np.random.default_rng(4)
    counts = rng.integers(0, 3, size=(30, 7)).astype(float)
    counts[:, 6] = rng.integers(0, 2, size=30)  # the OOV column: ignored by the model
    bag = sp.csr_matrix(counts / np.maximum(counts.sum(axis=1, keepdims=True), 1))
    shares = rng.random((30, 2))
    table, prior, info = fit_learned_table(bag, shares)
    df = (counts > 0).sum(axis=0)
    idf = np.log(31.0 / (1.0 + df)) + 1.0
    idf[6] = 0.0
    features = bag.toarray() * idf
    scale = np.mean(np.diag(_centred(features @ features.T)))
    weights, intercept = primal_ridge(features, shares, info["dp_predictor_ridge"] * scale)
    np.testing.assert_allclose(table, weights * idf[:, None], rtol=1e-4, atol=1e-6)
    assert table[6].tolist() == [0.0, 0.0]
    np.testing.assert_allclose(prior, bag.toarray().mean(axis=0) @ table, rtol=1e-6)
    assert info["dp_predictor_ridge"] in RIDGE_GRID


def fit_dp(name, profile, devices=2, **params):
    parallel = ParallelConfig(devices=devices, attention="dp", tokens_per_step=256)
    return make_system(name, **params).fit(profile, parallel, np.random.default_rng(0))


@pytest.mark.parametrize("weight", [0.0, 0.05])
def test_learned_predictor_finds_the_marker_the_token_tables_miss(marker_split, weight):
    """Time scheduler (no round-robin mask, which caps both at two ranks): the planted ceiling is ~0.85 (noise and
    the expert pairs that straddle a block); the learned scores get near it, the token tables stay near chance."""
    profile, evaluation = marker_split
    lar = {}
    for predictor in ("tables", "learned"):
        plan = fit_dp("semmoe", profile, dp_predictor=predictor, dp_scheduler="time", dp_balance_weight=weight)
        lar[predictor] = evaluate(plan, evaluation).summary["lar"]
    assert plan.info["dp_predictor_cv_r2"] > 0.5
    assert lar["learned"] > 0.78, lar
    assert lar["learned"] > lar["tables"] + 0.15, lar


def test_learned_plan_save_load_round_trips(marker_split, tmp_path):
    profile, evaluation = marker_split
    parallel = ParallelConfig(devices=2, attention="dp", tokens_per_step=256)
    plan = fit_dp("semmoe", profile, dp_predictor="learned", dp_scheduler="time", dp_balance_weight=0.05)
    plan.save(tmp_path / "plan")
    loaded = SemMoEPlan.load(tmp_path / "plan", parallel, profile.meta.num_experts)
    assert loaded.dp_predictor == "learned"
    args = evaluation.token_ids, evaluation.offsets, evaluation.prefill_len
    plan.reset()
    np.testing.assert_array_equal(loaded.assign_requests(*args), plan.assign_requests(*args))


def test_bad_predictor_inputs_raise_one_clear_error(marker_split):
    profile, _ = marker_split
    with pytest.raises(ConfigError, match="dp_predictor must be one of"):
        make_system("semmoe", dp_predictor="embedding")
    few = make_trace(profile.meta, profile.offsets[: 2 * CV_FOLDS], profile.token_ids[: profile.offsets[2 * CV_FOLDS - 1]],
                     profile.experts[: profile.offsets[2 * CV_FOLDS - 1]])
    with pytest.raises(ConfigError, match="needs at least 10 profile requests"):
        fit_dp("semmoe", few, dp_predictor="learned")
    with pytest.raises(ConfigError, match="semmoe_paper scores requests with the paper's token tables"):
        make_system("semmoe_paper", dp_predictor="learned")
    plan = fit_dp("semmoe", profile)
    with pytest.raises(ConfigError, match="comes with its fitted table"):
        SemMoEPlan(Placement.from_expert_device(plan.placement.expert_device(), 2), plan.parallel, plan.token_vocab,
                   plan.row_of_token, plan.token_device, plan.token_confidence, plan.dp_score, dp_predictor="learned")
