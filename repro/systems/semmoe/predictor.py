"""A learned request-level predictor for Sem-MoE's Attention-DP scheduler (beyond the paper; issue 17 item 3).

Legend: L MoE layers, E experts per layer, D devices, R requests, t distinct profiled token ids (table rows; row
t is the OOV row), P prompt tokens.

The paper's tables score a request by the folded votes of its prompt tokens, each table row estimated from that
token's own routing. The learned predictor instead fits, on the PROFILE split, a ridge regression from the
request's bag of prompt token rows (term frequencies, idf-weighted) to what the scheduler wants to know: the share
of the request's activations (every layer, every token of the request, generated ones included) served by each
device of the plan's placement (`request_device_shares`). The ridge penalty is chosen by K-fold cross-validation on
the profile requests (mean squared error of the shares), so the validate and evaluate splits are never read.

The model is linear in the bag, so it is itself a per-token table W float32[t+1, D] (row t, unseen ids, is 0)
plus the profile's mean score (the prior, subtracted as the tables' prior is): online scoring is
`dp.request_scores` on W, the same lookup-and-mean as dp_scoring "expected", and a request's score depends on its
own prompt only. Scores are in units of predicted activation share (a few hundredths apart between devices), not
of votes, so the time scheduler's dp_balance_weight is chosen for each predictor separately.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from repro.errors import ConfigError
from repro.systems.base import Placement
from repro.systems.semmoe.dp import packed_prompts, request_scores
from repro.traces import RoutingTrace

DP_PREDICTORS = ("tables", "learned")
# ridge penalties tried, as multiples of the mean diagonal of the centred kernel (the bag's mean squared norm)
RIDGE_GRID = tuple(10.0 ** np.arange(-3.0, 2.5, 0.5))
CV_FOLDS = 5
# profile requests the ridge sees (the longest prompts); its dual solve is O(R^3) in them
MAX_PREDICTOR_REQUESTS = 4096


def prompt_bag(
    row_of_token: np.ndarray, token_ids: np.ndarray, offsets: np.ndarray, prefill_len: np.ndarray, num_rows: int
) -> sp.csr_matrix:
    """float64 csr [R, num_rows]: each request's prompt token rows as term frequencies (counts / prompt length).

    row_of_token int[V] (vocabulary id -> table row); token_ids int[N]; offsets int64[R+1]; prefill_len int[R].
    A request with an empty prompt is an empty row.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    prefill_len = np.asarray(prefill_len, dtype=np.int64)
    packed, prompt_start = packed_prompts(token_ids, offsets, prefill_len)
    rows = np.repeat(np.arange(len(prefill_len)), prefill_len)
    weight = np.repeat(1.0 / np.maximum(prefill_len, 1), prefill_len)
    bag = sp.csr_matrix((weight, (rows, row_of_token[packed])), shape=(len(prefill_len), num_rows))
    bag.sum_duplicates()
    return bag


def request_device_shares(
    request_of_token: np.ndarray, experts: np.ndarray, present: np.ndarray, num_requests: int
) -> np.ndarray:
    """float64[R, D] share of each request's activations (all layers, all its tokens) served on device d.

    request_of_token int[N]; experts int[N, L, k] (array-like, read one layer at a time); present bool[L, E, D]
    (an expert's replicas count on every device holding one, so a row can sum to more than 1 with replicas).
    """
    num_layers, num_experts, _ = present.shape
    request_of_token = np.asarray(request_of_token, dtype=np.int64)
    counts = np.bincount(request_of_token, minlength=num_requests).astype(np.float64)
    shares = np.zeros((num_requests, present.shape[2]))
    for layer in range(num_layers):  # loop over layers only: an [R, E] count matrix per layer
        layer_experts = np.asarray(experts[:, layer], dtype=np.int64)
        key = np.repeat(request_of_token, layer_experts.shape[1]) * num_experts + layer_experts.ravel()
        per_expert = np.bincount(key, minlength=num_requests * num_experts).reshape(num_requests, num_experts)
        shares += per_expert @ present[layer].astype(np.float64)
        top_k = layer_experts.shape[1]
    return shares / np.maximum(counts * num_layers * top_k, 1.0)[:, None]


def _centred(kernel: np.ndarray) -> np.ndarray:
    """float64[n, n] the kernel of mean-centred features (double centring)."""
    row = kernel.mean(axis=1, keepdims=True)
    return kernel - row - row.T + row.mean()


def ridge_cv_errors(kernel: np.ndarray, target: np.ndarray, penalties: np.ndarray, folds: int) -> np.ndarray:
    """float64[len(penalties)] out-of-fold mean squared error of kernel ridge with an intercept.

    kernel float64[R, R] = X X^T of the (uncentred) features; target float64[R, D]; fold of request r: r % folds
    (the profile split is already a seeded random draw). One eigendecomposition per fold serves every penalty.
    """
    num = len(target)
    fold_of = np.arange(num) % folds
    errors = np.zeros(len(penalties))
    for fold in range(folds):
        train, held = np.flatnonzero(fold_of != fold), np.flatnonzero(fold_of == fold)
        k_train = kernel[np.ix_(train, train)]
        k_held = kernel[np.ix_(held, train)]
        # held rows centred with the TRAIN feature mean: <x - m, x_i - m> from kernel entries only
        held_c = k_held - k_held.mean(axis=1, keepdims=True) - k_train.mean(axis=0)[None, :] + k_train.mean()
        values, vectors = np.linalg.eigh(_centred(k_train))
        mean = target[train].mean(axis=0)
        projected = vectors.T @ (target[train] - mean)
        for i, penalty in enumerate(penalties):
            alpha = vectors @ (projected / (np.maximum(values, 0.0) + penalty)[:, None])
            errors[i] += float(((held_c @ alpha + mean - target[held]) ** 2).sum())
    return errors / target.size


def fit_learned_table(bag: sp.csr_matrix, shares: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
    """(table float32[t+1, D], prior float64[D], info): ridge from idf-weighted prompt bags to device shares.

    bag csr float[R, t+1] (`prompt_bag` of the profile requests; column t, unseen ids, is ignored); shares
    float[R, D] (`request_device_shares`). The penalty minimises `ridge_cv_errors` over RIDGE_GRID x the mean
    diagonal of the centred kernel. The prediction for a bag x is x @ table + intercept; the scheduler uses
    x @ table - prior, prior = the profile's mean x @ table, so the profile's mean score is 0 on every device
    (the intercept cancels). Deterministic: no randomness.
    """
    num_requests, num_columns = bag.shape
    if num_requests < 2 * CV_FOLDS:
        raise ConfigError(
            f"system.params.dp_predictor=learned needs at least {2 * CV_FOLDS} profile requests to choose its ridge "
            f"penalty by {CV_FOLDS}-fold cross-validation, got {num_requests}; profile more requests or use "
            "dp_predictor=tables."
        )
    shares = np.asarray(shares, dtype=np.float64)
    bag = sp.csr_matrix(bag, dtype=np.float64)
    if num_requests > MAX_PREDICTOR_REQUESTS:  # the longest prompts: most tokens, least noisy shares
        length = np.asarray((bag > 0).sum(axis=1)).ravel()
        keep = np.sort(np.argsort(-length, kind="stable")[:MAX_PREDICTOR_REQUESTS])
        bag, shares = bag[keep], shares[keep]
    # idf: a token in every prompt (stop words) says little about where a request belongs
    document_frequency = np.bincount(bag.indices, minlength=num_columns)
    idf = np.log((1.0 + len(shares)) / (1.0 + document_frequency)) + 1.0
    idf[num_columns - 1] = 0.0  # unseen ids carry no signal
    features = bag @ sp.diags(idf)
    kernel = (features @ features.T).toarray()
    scale = float(np.mean(np.diag(_centred(kernel))))
    penalties = np.asarray(RIDGE_GRID) * max(scale, 1e-30)
    errors = ridge_cv_errors(kernel, shares, penalties, CV_FOLDS)
    best = int(np.argmin(errors))
    mean = shares.mean(axis=0)
    alpha = np.linalg.solve(_centred(kernel) + penalties[best] * np.eye(len(shares)), shares - mean)
    alpha -= alpha.mean(axis=0)  # W = Xc^T alpha = X^T (alpha - mean(alpha))
    table = np.asarray(features.T @ alpha) * idf[:, None]  # back onto raw term frequencies
    table[num_columns - 1] = 0.0
    prior = np.asarray(bag.mean(axis=0)).ravel() @ table
    baseline = float(((shares - mean) ** 2).mean())  # error of predicting the mean share (no model)
    info = {
        "dp_predictor_requests": int(len(shares)),
        "dp_predictor_ridge": float(RIDGE_GRID[best]),
        "dp_predictor_cv_mse": float(errors[best]),
        "dp_predictor_cv_r2": float(1.0 - errors[best] / max(baseline, 1e-30)),
    }
    return table.astype(np.float32), prior, info


def fit_request_predictor(
    profile: RoutingTrace, placement: Placement, row_of_token: np.ndarray, num_rows: int
) -> tuple[np.ndarray, np.ndarray, dict]:
    """(table float32[t+1, D], prior float64[D], info): `fit_learned_table` on the profile's prompt bags
    (row_of_token int[V], the plan's vocabulary map, num_rows = t + 1) and its device shares on `placement`."""
    present = placement.replicas() > 0  # [L, E, D]
    bag = prompt_bag(row_of_token, profile.token_ids, profile.offsets, profile.prefill_len, num_rows)
    shares = request_device_shares(profile.request_of_token(), profile.experts, present, profile.num_requests)
    return fit_learned_table(bag, shares)


def learned_request_scores(
    table: np.ndarray, prior: np.ndarray, row_of_token: np.ndarray, token_ids: np.ndarray, offsets: np.ndarray,
    prefill_len: np.ndarray,
) -> np.ndarray:
    """float32[R, D] the learned predictor's score of each request: its prompt bag @ table - prior.

    table float32[t+1, D], prior float[D] (`fit_learned_table`); row_of_token int[V]; token_ids int[N]; offsets
    int[R+1]; prefill_len int[R]. Request r's row depends on its own prompt tokens only.
    """
    scores = request_scores(table, row_of_token, token_ids, offsets, prefill_len)
    return scores - np.asarray(prior, dtype=np.float32)[None, :]
