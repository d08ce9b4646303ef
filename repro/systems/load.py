"""What an engine shows of its Attention-DP ranks when a request arrives, and the load rules routers apply to it.

One small view (`RankLoad`) reaches a plan's `assign_requests` from whoever runs it: the serving simulator from
its engine's live state (repro/sim/engine.py), the router from the engines' load signals
(repro/engines/load_signals.py), and, where nothing runs, the plan's own count of what it handed out
(`HandedOut`, the state of the offline evaluator's static batches). A plan that reads it sets `reads_load = True`;
every other plan is called exactly as before.

The rules (pure functions: a view in, a float64[D] load or score out, lower is better; ties go to the lowest
rank id, as SGLang's `list.index(min(...))` and vLLM's first-minimum scan do):
  shortest_queue   running + waiting requests (SGLang `--load-balance-method shortest_queue`, now
                   `total_requests`: data_parallel_controller.py DPBudget, num_running_reqs + num_waiting_reqs)
  minimum_tokens   tokens the rank holds: KV tokens in use + prompt tokens still queued for prefill, ties by
                   requests (SGLang `minimum_tokens`, now `total_tokens`: num_total_tokens, total_requests as the
                   tie-break)
  vllm             4 x waiting + running (vLLM v1 DPLBAsyncMPClient.get_core_engine_for_request, the engine
                   queue statistics of its DP coordinator)
  balance_route    BalanceRoute BR-0-style (arXiv 2605.06113, no prediction): the rank's utilisation after the
                   admission, of KV cache ((kv used + this request's tokens) / capacity) and of its per-iteration
                   token budget ((decoding + queued prefill + prompt) / max batched tokens), each through a
                   piecewise-linear price that is the utilisation up to a safe margin (0.9) and rises 10x faster
                   past it; the two prices summed. The paper's exact coefficients are not public here: margin and
                   slope are this suite's, stated.
  wait             estimated iterations before this request's first token on the rank: the wait for a request
                   slot when the rank is at its running-request cap (the requests ahead of it beyond the free
                   slots, over the finishes per iteration: decoding requests / expected output tokens) plus its
                   prefill behind the queued prompt tokens ((queued prefill + its prompt) / the token budget left
                   after the rank's decodes); the load term of the suite's load-aware Sem-MoE (beyond any engine).
                   Near capacity the running-request cap binds first, so a rule blind to it (minimum_tokens) piles
                   short requests on ranks that cannot admit them.

Legend: D Attention-DP ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from repro.errors import ConfigError

LOAD_RULES = ("shortest_queue", "minimum_tokens", "vllm", "balance_route", "wait")
SAFE_MARGIN = 0.9  # balance_route: share of a capacity used before the price steepens
OVER_MARGIN_SLOPE = 10.0  # balance_route: price per unit of utilisation past the margin


@dataclass(frozen=True)
class RankLoad:
    """Each Attention-DP rank's state (int64[D] arrays, D ranks) at one request's arrival.

    running: requests admitted (prefilling or decoding); waiting: requests queued, not admitted;
    queued_prefill_tokens: prompt tokens not yet prefilled (waiting requests and unfinished chunks);
    decoding: requests in decode (each feeds one token to every iteration); kv_used_tokens: KV cache tokens
    the rank's admission counts as used; kv_capacity_tokens, max_batched_tokens and max_running_requests (ints):
    the rank's KV capacity, per-iteration token budget and running-request cap (the engine's config).
    """

    running: np.ndarray
    waiting: np.ndarray
    queued_prefill_tokens: np.ndarray
    decoding: np.ndarray
    kv_used_tokens: np.ndarray
    kv_capacity_tokens: int
    max_batched_tokens: int
    max_running_requests: int = 1 << 62

    @classmethod
    def idle(cls, num_ranks: int, kv_capacity_tokens: int, max_batched_tokens: int,
             max_running_requests: int = 1 << 62) -> RankLoad:
        zeros = np.zeros(num_ranks, dtype=np.int64)
        return cls(zeros, zeros, zeros, zeros, zeros, kv_capacity_tokens, max_batched_tokens, max_running_requests)


def rank_load(view: RankLoad, rule: str, prompt_len: int, request_tokens: int) -> np.ndarray:
    """float[D] (int64 for the request-count rules) the load `rule` gives each rank for a request of prompt_len prompt tokens and request_tokens
    tokens of KV (prompt + expected output); lower is better (module docstring)."""
    running, waiting = view.running, view.waiting
    if rule == "shortest_queue":
        return running + waiting
    if rule == "minimum_tokens":
        # requests as the tie-break: a fraction below one token of difference
        tokens = view.kv_used_tokens + view.queued_prefill_tokens
        return tokens + (running + waiting) / (running.sum() + waiting.sum() + 1.0)
    if rule == "vllm":
        return 4 * waiting + running
    budget_left = np.maximum(view.max_batched_tokens - view.decoding, 1)
    if rule == "wait":
        ahead = np.maximum(waiting + 1 - np.maximum(view.max_running_requests - running, 0), 0)
        finishes = np.maximum(view.decoding, 1) / max(request_tokens - prompt_len, 1)  # per iteration
        return ahead / finishes + (view.queued_prefill_tokens + prompt_len) / budget_left
    if rule == "balance_route":
        kv = (view.kv_used_tokens + request_tokens) / max(view.kv_capacity_tokens, 1)
        tokens = (view.decoding + view.queued_prefill_tokens + prompt_len) / max(view.max_batched_tokens, 1)
        return margin_price(kv) + margin_price(tokens)
    check_rule(rule)  # raises: every known rule returned above
    raise AssertionError(rule)


def margin_price(utilisation: np.ndarray) -> np.ndarray:
    """float64[D]: utilisation up to SAFE_MARGIN, then OVER_MARGIN_SLOPE per unit beyond (BalanceRoute BR-0-style)."""
    over = np.maximum(utilisation - SAFE_MARGIN, 0.0)
    return np.minimum(utilisation, SAFE_MARGIN) + OVER_MARGIN_SLOPE * over


def check_rule(rule: str) -> str:
    if rule not in LOAD_RULES:
        raise ConfigError(f"unknown DP load rule {rule!r}; choose one of {LOAD_RULES}.")
    return rule


class HandedOut:
    """The load a plan can know without an engine: what it handed out so far, nothing ever finishing.

    Every request handed to rank d counts as running there with its prompt tokens queued and its KV tokens
    (prompt + expected output) used: the state of the offline evaluator's static batches, where all requests of
    the evaluated split are in flight together. A load-reading plan falls back to it when no view is passed.
    """

    def __init__(self, num_ranks: int, kv_capacity_tokens: int = 1 << 62, max_batched_tokens: int = 1 << 62):
        self.requests = np.zeros(num_ranks, dtype=np.int64)
        self.prompt_tokens = np.zeros(num_ranks, dtype=np.int64)
        self.kv_tokens = np.zeros(num_ranks, dtype=np.int64)
        self.kv_capacity_tokens, self.max_batched_tokens = kv_capacity_tokens, max_batched_tokens

    def view(self) -> RankLoad:
        zeros = np.zeros_like(self.requests)
        return RankLoad(self.requests, zeros, self.prompt_tokens, zeros, self.kv_tokens,
                        self.kv_capacity_tokens, self.max_batched_tokens)

    def add(self, rank: int, prompt_len: int, request_tokens: int) -> None:
        self.requests[rank] += 1
        self.prompt_tokens[rank] += prompt_len
        self.kv_tokens[rank] += request_tokens
