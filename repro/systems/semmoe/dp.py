"""Sem-MoE Algorithm 2 (arXiv 2503.04398): online Attention-DP request scheduling.

Legend: L MoE layers, D devices = EP ranks (the paper's E), t distinct profiled token ids (table rows; row t
is the OOV fallback row), R requests, N tokens, P prompt tokens of R requests, V vocabulary size, W = dp_window
x D requests per mask window.

The paper's pseudo-code body is lost; what it states is kept: a request's per-device score comes from its
prompt tokens' entries in the offline tables, and a round-robin dev_mask makes every D consecutive requests
cover all D ranks. Per-token scores are folded over layers at plan build (`fold_dp_scores`): dp_scoring
"confidence" (default): each token casts one vote for the device of its folded T_p-weighted votes, weighted
by that device's share; "vote": the same with weight 1; "expected": the full folded device mass (expected
local activations, a dense [D] row per token: slower). A request's score is the mean over its prompt tokens
(`request_votes` for the votes, `request_scores` for "expected"), minus the score of the average profile
token (so every request is not drawn to the device hosting the experts of stop words).

Assignment (dp_assign), both keeping the round-robin dev_mask (`dp_window` = w allows w requests per rank
per window of W = w x D consecutive requests, so every window spreads exactly w requests on every rank):
  "online" (default, the paper's Algorithm 2): each request is decided at arrival from what has arrived so
    far: its best rank still free in the window (`masked_argmax_assign`, vectorised across windows). With
    load_aware_lambda > 0 the score also pays for the rank's queued prompt tokens (`load_aware_assign`, one
    step per request): the online queued-token price.
  "batch_window" (beyond the paper, not online): waits for the window's W requests and gives them a
    maximum-weight assignment of score x prompt length, minus dp_token_price x prompt length x the rank's
    relative excess of queued prompt tokens (`window_exact_assign`). A request's decision thus waits for,
    and depends on, up to W - 1 later requests (`window_lookahead`).
Arrival times are not in the traces yet, so the look-ahead is reported in requests; once they exist, the
queueing delay batch_window adds to request r is arrival(last request of r's window) - arrival(r).

The time-aware scheduler (dp_scheduler "time", beyond the paper; the two above are dp_scheduler "paper"): a layer
finishes when its busiest rank does, and a rank's all-to-all and expert work grow with its tokens, not its
requests, so the round-robin mask (equal request counts) leaves long prompts piling up on some ranks. Instead each
request, at arrival, takes its best rank by score - dp_balance_weight x (rank's queued tokens - least queued) /
mean request tokens (`token_balance_assign`), a request's tokens being its prompt plus the expected decode tokens
(the profile's mean generated tokens per request, or a configured number). No mask: counts may differ, tokens
are what is balanced. Weight 0 is pure affinity; a large weight is least-queued-tokens first.

The load-aware scheduler (dp_scheduler "load", beyond the paper): the time-aware one balances the tokens it handed
out since the start and sees nothing of the engine, so with heavy-tailed prompts one rank's queue builds while others
drain and every MoE layer waits for it (the EP barrier). Here each request reads the ranks' live state at arrival
(repro.systems.load.RankLoad, from the engine or the router) and takes its best-scoring rank among those whose load
under `dp_load_rule` is within `dp_load_slack` of the least loaded rank's (`slack_argmax`): affinity decides only
between ranks a load balancer would call equal, so locality never overloads a rank. Slack 0 is the load balancer
itself with affinity as its tie-break; a large slack is pure affinity.
"""

from __future__ import annotations

import numba
import numpy as np
from scipy.optimize import linear_sum_assignment

from repro.errors import TraceError

DP_SCORINGS = ("confidence", "vote", "expected")
DP_SCHEDULERS = ("paper", "time", "load")
DP_ASSIGNS = ("online", "batch_window")
# names of the dp_assign options before they were named for what they are; plans saved with them still load
LEGACY_DP_ASSIGNS = {"greedy": "online", "exact": "batch_window"}


def packed_prompts(
    token_ids: np.ndarray, offsets: np.ndarray, prefill_len: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(packed int[P], prompt_start int64[R+1]): request r's prompt tokens are
    packed[prompt_start[r] : prompt_start[r + 1]], P = sum(prefill_len); offsets int64[R+1], prefill_len int64[R].

    Without a Python loop; when every request is all prompt it is one contiguous slice of token_ids.
    """
    if np.array_equal(prefill_len, np.diff(offsets)):
        return np.asarray(token_ids[offsets[0] : offsets[-1]]), offsets - offsets[0]
    prompt_start = np.concatenate([[0], np.cumsum(prefill_len)])
    gather = np.arange(int(prompt_start[-1])) + np.repeat(offsets[:-1] - prompt_start[:-1], prefill_len)
    return np.asarray(token_ids)[gather], prompt_start


def request_scores(
    token_score: np.ndarray, row_of_token: np.ndarray, token_ids: np.ndarray, offsets: np.ndarray, prefill_len: np.ndarray
) -> np.ndarray:
    """float32[R, D] per-request device scores: the mean over its prompt tokens of token_score rows.

    token_score float[t + 1, D]; row_of_token int[V] (`vocab_row_map`); token_ids int[N]; offsets int[R+1];
    prefill_len int[R]. Requests with an empty prompt score 0 everywhere.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    prefill_len = np.asarray(prefill_len, dtype=np.int64)
    num_requests = len(offsets) - 1
    scores = np.zeros((num_requests, token_score.shape[1]), dtype=np.float32)
    if int(prefill_len.sum()) == 0:
        return scores
    packed, prompt_start = packed_prompts(token_ids, offsets, prefill_len)
    nonempty = prefill_len > 0
    scores[nonempty] = np.add.reduceat(token_score[row_of_token[packed]], prompt_start[:-1][nonempty], axis=0)
    return scores / np.maximum(prefill_len, 1)[:, None].astype(np.float32)


# prompt tokens per request_votes chunk: keeps the per-token work arrays (~0.5 MB each) in cache; measured
# about 2x faster than one pass over 8M tokens (bench/bench_semmoe.py, 1k-token prompts)
VOTE_CHUNK_TOKENS = 1 << 16


def request_votes(
    vocab_device: np.ndarray,
    vocab_weight: np.ndarray,
    token_ids: np.ndarray,
    offsets: np.ndarray,
    prefill_len: np.ndarray,
    num_devices: int,
) -> np.ndarray:
    """float32[R, D] per-request device scores from one weighted vote per prompt token, divided by the prompt length.

    vocab_device int64[V] and vocab_weight float64[V]: each vocabulary id's vote and its weight (the top entry
    of the folded score table, looked up per id once at plan build). One bincount per chunk of requests, so
    the cost is a few nanoseconds per token (the >= 50k requests/s path for 1k-token prompts).
    """
    if len(offsets) == 2:  # one request (an arrival in the engine or the router): one compiled pass
        tokens = np.asarray(token_ids[int(offsets[0]) : int(offsets[0]) + int(prefill_len[0])])
        scores = np.empty((1, num_devices), dtype=np.float32)
        bad = _vote_one(vocab_device, vocab_weight, tokens, scores[0])
        if bad >= 0:
            raise TraceError(
                f"token id {int(tokens[bad])} is outside the plan's vocabulary of {len(vocab_device)} ids; "
                "fit the plan on a profile of the same model."
            )
        return scores
    offsets = np.asarray(offsets, dtype=np.int64)
    prefill_len = np.asarray(prefill_len, dtype=np.int64)
    num_requests = len(offsets) - 1
    scores = np.zeros((num_requests, num_devices), dtype=np.float32)
    if num_requests == 0:
        return scores
    packed, prompt_start = packed_prompts(token_ids, offsets, prefill_len)
    first = 0
    while first < num_requests:
        last = int(np.searchsorted(prompt_start, prompt_start[first] + VOTE_CHUNK_TOKENS, side="right")) - 1
        last = min(max(last, first + 1), num_requests)
        tokens = packed[prompt_start[first] : prompt_start[last]]
        key = vocab_device[tokens]
        key += np.repeat(np.arange(last - first, dtype=np.int64) * num_devices, prefill_len[first:last])
        votes = np.bincount(key, weights=vocab_weight[tokens], minlength=(last - first) * num_devices)
        scores[first:last] = votes.reshape(last - first, num_devices)
        first = last
    return scores / np.maximum(prefill_len, 1)[:, None].astype(np.float32)


@numba.njit(cache=True, nogil=True)
def _vote_one(vocab_device, vocab_weight, tokens, out):  # pragma: no cover (compiled)
    """Fill out float32[D] with one request's votes divided by its length, summed in token order like np.bincount
    (so equal to the batch path bit for bit); returns -1, or the position of the first token outside the tables."""
    votes = np.zeros(len(out))
    for i in range(len(tokens)):
        t = tokens[i]
        if t < 0 or t >= len(vocab_device):
            return i
        votes[vocab_device[t]] += vocab_weight[t]
    length = np.float32(max(len(tokens), 1))
    for d in range(len(out)):
        out[d] = np.float32(votes[d]) / length
    return -1


def masked_argmax_assign(
    scores: np.ndarray, position: int, taken: np.ndarray, per_rank: int = 1
) -> tuple[np.ndarray, int, np.ndarray]:
    """(ranks int64[R], next position, next taken int64[D]): Algorithm 2's round-robin dev_mask.

    scores float[R, D]. The request stream is cut into windows of W = per_rank x D consecutive requests;
    inside a window each request takes its highest-scoring rank that has fewer than `per_rank` requests of
    the window (ties -> lowest id), so every window spreads exactly per_rank requests on every rank. The
    paper's mask is per_rank = 1: every D consecutive requests cover all D ranks. `position` (0..W-1) and
    `taken` (requests per rank in the open window) carry a partly filled window across calls. Vectorised
    across windows: W passes, pass i places the i-th request of every window. Online: request r's rank
    depends on its own scores and the ranks of the earlier requests of its window only.
    """
    num_requests, num_devices = scores.shape
    window_size = per_rank * num_devices
    slot = position + np.arange(num_requests)
    window = slot // window_size
    used = np.zeros((int(window[-1]) + 1 if num_requests else 1, num_devices), dtype=np.int64)
    used[0] = taken
    ranks = np.empty(num_requests, dtype=np.int64)
    for i in range(window_size):
        members = np.arange((i - position) % window_size, num_requests, window_size)  # requests at step i
        if len(members) == 0:
            continue
        masked = np.where(used[window[members]] >= per_rank, -np.inf, scores[members])
        choice = np.argmax(masked, axis=1)
        ranks[members] = choice
        used[window[members], choice] += 1
    next_position = (position + num_requests) % window_size
    next_taken = used[-1].copy() if next_position else np.zeros(num_devices, dtype=np.int64)
    return ranks, next_position, next_taken


def load_aware_assign(
    scores: np.ndarray,
    prompt_len: np.ndarray,
    position: int,
    taken: np.ndarray,
    queued: np.ndarray,
    assigned: int,
    per_rank: int = 1,
    load_lambda: float = 0.0,
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray, int]:
    """(ranks int64[R], next position, next taken int64[D], next queued float64[D], next assigned): online
    masked argmax with a price on queued prompt tokens.

    scores float[R, D]; prompt_len float[R]. Request r, in arrival order, takes the best rank still free in its
    window (same windows as `masked_argmax_assign`) of scores[r] - load_lambda x (queued - min(queued)) /
    mean prompt length, queued float[D] being the prompt tokens assigned so far (the plan never learns when a
    request finishes) and the mean taken over the `assigned` earlier requests and r. Sequential by nature
    (each choice changes the queues the next request sees): one step per request, ~6 us.
    """
    ranks = np.empty(len(scores), dtype=np.int64)
    taken = np.asarray(taken, dtype=np.int64).copy()
    queued = np.asarray(queued, dtype=np.float64).copy()
    window_size = per_rank * len(taken)
    for r, score in enumerate(scores):
        mean_len = max((queued.sum() + prompt_len[r]) / (assigned + 1), 1.0)
        adjusted = score - load_lambda * (queued - queued.min()) / mean_len
        adjusted[taken >= per_rank] = -np.inf
        rank = int(np.argmax(adjusted))
        ranks[r] = rank
        queued[rank] += prompt_len[r]
        assigned += 1
        taken[rank] += 1
        position = (position + 1) % window_size
        if position == 0:
            taken[:] = 0
    return ranks, position, taken, queued, assigned


def token_balance_assign(
    scores: np.ndarray, request_tokens: np.ndarray, queued: np.ndarray, assigned: int, balance_weight: float
) -> tuple[np.ndarray, np.ndarray, int]:
    """(ranks int64[R], next queued float64[D], next assigned): the time-aware online scheduler.

    scores float[R, D] affinity of each request for each rank; request_tokens float[R] its expected tokens
    (prompt + expected decode); queued float[D] tokens assigned to each rank so far; assigned: requests so far.
    Request r, in arrival order, takes argmax_d scores[r, d] - balance_weight x (queued[d] - min(queued)) / m,
    m the mean request tokens of the `assigned` earlier requests and r (so the weight is in units of score per
    mean-sized request of imbalance); ties -> lowest rank id. Online: r's rank depends on its own prompt and the
    earlier requests only. One step per request on D-sized arrays (the plan never learns when a request
    finishes, so queued counts every assigned token).
    """
    # plain Python floats: each step touches D numbers, where numpy's per-call overhead (~1 us per operation) would
    # cost 3-4x more at D = 8 (same ranks, measured with /tmp scripts on 8192 requests)
    rows = np.asarray(scores, dtype=np.float64).tolist()
    tokens = np.asarray(request_tokens, dtype=np.float64).tolist()
    load = np.asarray(queued, dtype=np.float64).tolist()
    total = sum(load)
    devices = range(len(load))
    ranks = [0] * len(rows)
    for r, row in enumerate(rows):
        total += tokens[r]
        assigned += 1
        scale = balance_weight * assigned / max(total, 1.0)
        least = min(load)
        rank, best = 0, -np.inf
        for d in devices:
            value = row[d] - (load[d] - least) * scale
            if value > best:  # strict: ties keep the lowest rank id
                rank, best = d, value
        ranks[r] = rank
        load[rank] += tokens[r]
    return np.asarray(ranks, dtype=np.int64), np.asarray(load, dtype=np.float64), assigned


@numba.njit(cache=True, nogil=True)
def slack_argmax(score: np.ndarray, load: np.ndarray, slack: float) -> int:
    """The best-scoring rank among those with load <= min(load) + slack (ties: lowest id).

    score float[D] the request's affinity per rank; load float[D] per-rank load (lower is better, see
    repro.systems.load.rank_load); slack >= 0 in the load's own units."""
    least = load.min() + slack
    best = -1
    for d in range(len(score)):  # compiled: one call per arrival, ~1 us instead of ~10 with numpy
        if load[d] <= least and (best < 0 or score[d] > score[best]):
            best = d
    return best


def window_exact_assign(
    gain: np.ndarray,
    prompt_len: np.ndarray,
    position: int,
    taken: np.ndarray,
    queued: np.ndarray,
    per_rank: int = 1,
    token_price: float = 0.0,
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """(ranks int64[R], next position, next taken int64[D], next queued float64[D]): the dev_mask, solved exactly.

    gain float[R, D]: what request r is worth on rank d (expected local activations). Same windows as
    `masked_argmax_assign` (W = per_rank x D consecutive requests, exactly per_rank of them per rank, a
    partly filled window carried across calls by `position` / `taken`), but each window's requests take the
    ranks of a maximum-weight assignment (linear_sum_assignment over the window's free slots) instead of
    greedily in arrival order, so an early request no longer takes the rank a later one needs more. A
    per-rank constant cancels inside a window (every rank gets exactly per_rank requests), so no prior is
    needed. token_price > 0 subtracts token_price x prompt_len[r] x (queued_d - mean) / mean from gain[r, d],
    queued float[D] being the prompt tokens assigned so far (updated per window): it steers long prompts off
    ranks that already hold more tokens, keeping the max/mean token load near 1 (request counts stay exact).
    One small assignment per window: O(R / W x W^3). Not online: a request waits for the rest of its window
    (`window_lookahead`), and a later request can change its rank.
    """
    num_requests, num_devices = gain.shape
    window_size = per_rank * num_devices
    ranks = np.empty(num_requests, dtype=np.int64)
    taken = np.asarray(taken, dtype=np.int64).copy()
    queued = np.asarray(queued, dtype=np.float64).copy()
    prompt_len = np.asarray(prompt_len, dtype=np.float64)
    start = 0
    while start < num_requests:
        stop = min(start + window_size - position, num_requests)
        slots = np.repeat(np.arange(num_devices), per_rank - taken)  # free slots of the open window
        block = gain[start:stop].astype(np.float64)
        if token_price > 0 and queued.sum() > 0:
            excess = (queued - queued.mean()) / queued.mean()
            block = block - token_price * prompt_len[start:stop, None] * excess[None, :]
        rows, cols = linear_sum_assignment(block[:, slots], maximize=True)
        ranks[start + rows] = slots[cols]
        taken += np.bincount(slots[cols], minlength=num_devices)
        queued += np.bincount(slots[cols], weights=prompt_len[start + rows], minlength=num_devices)
        position = (position + stop - start) % window_size
        if position == 0:
            taken[:] = 0
        start = stop
    return ranks, position, taken, queued


def window_lookahead(num_requests: int, position: int, window_size: int) -> np.ndarray:
    """int64[R] later requests each request's batch_window decision waited for and saw (0 for online modes).

    Request r of a call sits at slot position + r of the window stream (windows of `window_size` requests,
    `position` = slots of the open window filled by earlier calls, whose decisions are already made); it is
    decided with the later requests of its window that are in the same call: up to window_size - 1.
    """
    slot = position + np.arange(num_requests, dtype=np.int64)
    window_end = np.minimum((slot // window_size + 1) * window_size, position + num_requests)
    return window_end - 1 - slot


def fold_dp_scores(mass: np.ndarray, scoring: str) -> np.ndarray:
    """float32[t, D] one layer's contribution to the per-token DP score table from its device mass float[t, D].

    "expected": the mass itself (summed over layers: expected local activations per token / k);
    "confidence": T_p on T (a T_p-weighted vote); "vote": 1 on T (a hard vote).
    """
    if scoring == "expected":
        return mass.astype(np.float32)
    best = np.argmax(mass, axis=1)
    weight = np.ones(len(mass), dtype=np.float32) if scoring == "vote" else mass[np.arange(len(mass)), best]
    out = np.zeros_like(mass, dtype=np.float32)
    out[np.arange(len(mass)), best] = weight
    return out
