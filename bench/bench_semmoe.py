"""Benchmarks of Sem-MoE: the offline co-clustering solver on a DeepSeek-V3-shaped synthetic instance, the
Attention-DP scheduler's throughput on 1k-token prompts, and the Attention-TP reshuffle's throughput.

Targets (issue 3): solver <= 60 s and <= 4 GB on 2 cores (256 experts, 58 MoE layers, vocabulary 129,280,
top-8, EP 32); DP scheduler >= 50k requests/s on one core; TP reshuffle: measured and reported. Issue 9: the
replication-aware solver (semmoe_replicated, r = 1 extra slot per device) on the same instance fits in <= 2 x the
r = 0 fit time measured in the same run.
`run(quick)` returns measured numbers only (quick shrinks the instance for CI smoke runs).

Legend: R requests, S tokens per request, N = R x S tokens, L MoE layers, E experts, k top-k, V vocabulary,
D devices, T tokens per TP step.
"""

from __future__ import annotations

import resource
import time

import numpy as np

from repro.parallel import ParallelConfig
from repro.systems.semmoe import SemMoE
from repro.systems.semmoe.replicate import SemMoEReplicated
from repro.traces import TraceMeta, make_trace


def planted_trace(
    rng: np.random.Generator,
    num_requests: int = 400,
    request_len: int = 128,
    num_layers: int = 4,
    num_experts: int = 64,
    top_k: int = 6,
    vocab_size: int = 32_000,
    num_topics: int = 8,
    topic_token_share: float = 0.8,
    noise: float = 0.1,
    model: str = "planted",
):
    """A RoutingTrace with planted token -> expert affinity (R requests of S tokens, L layers).

    Each token id belongs to topic id * topics // V; in each layer a topic owns a random group of E / topics
    experts, and each token prefers k consecutive experts of its topic's group (a per-token, per-layer
    offset). A request has one topic; a share `topic_token_share` of its tokens come from that topic's
    vocabulary slice, the rest from the whole vocabulary, both with Zipf-like (log-uniform) ranks. Each routed slot
    keeps the preferred expert with probability 1 - noise, otherwise a random expert outside the topic's group.
    """
    group = num_experts // num_topics
    slice_len = vocab_size // num_topics
    # per layer, topic t owns experts expert_perm[l, t*group:(t+1)*group]
    expert_perm = np.argsort(rng.random((num_layers, num_experts)), axis=1)
    request_topic = rng.integers(num_topics, size=num_requests)
    num_tokens = num_requests * request_len
    topic_of_token = np.repeat(request_topic, request_len)
    in_topic = rng.random(num_tokens) < topic_token_share
    # Zipf-like ranks (log-uniform: Pr(rank r) ~ 1/r), like word frequencies in text
    in_slice = (slice_len ** rng.random(num_tokens)).astype(np.int64) - 1
    background = rng.permutation(vocab_size)[(vocab_size ** rng.random(num_tokens)).astype(np.int64) - 1]
    token_ids = np.where(in_topic, topic_of_token * slice_len + in_slice, background)
    token_topic = np.minimum(token_ids // slice_len, num_topics - 1)
    # preferred experts: consecutive group members from a per-(layer, token id) offset; hashing the id keeps
    # memory O(N) instead of a [L, V, k] table. One layer at a time keeps int64 temporaries at [N, k].
    layer_salt = rng.integers(1, 2**31 - 1, size=num_layers)
    experts = np.empty((num_tokens, num_layers, top_k), dtype=np.int16)
    for layer in range(num_layers):
        offset = ((token_ids * 2654435761 + layer_salt[layer]) % 1_000_003) % group  # [N]
        member = (offset[:, None] + np.arange(top_k)) % group  # [N, k]
        chosen = expert_perm[layer][token_topic[:, None] * group + member]
        # a noisy slot takes an expert outside the token's topic group (slot j: the (base + j)-th of them, a
        # random base per token), so a token's k experts stay distinct, as a router's are
        noisy = rng.random(chosen.shape) < noise
        outside = (rng.integers(num_experts - group, size=(num_tokens, 1)) + np.arange(top_k)) % (num_experts - group)
        stray = expert_perm[layer][(token_topic[:, None] * group + group + outside) % num_experts]
        experts[:, layer] = np.where(noisy, stray, chosen)
    meta = TraceMeta(model=model, num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(num_layers)),
                     vocab_size=vocab_size, source="planted")
    offsets = np.arange(num_requests + 1) * request_len
    return make_trace(meta, offsets, token_ids, experts, request_labels=[str(t) for t in request_topic])


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far, in GB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def bench_solver(quick: bool, seed: int = 0) -> dict:
    """Fit Sem-MoE (Attention-TP, token units) on a DeepSeek-V3-shaped planted profile: 256 experts, top-8,
    vocabulary 129,280, EP 32, 58 MoE layers (quick: 4 layers, fewer requests); then semmoe_replicated with
    r = 1 on the same profile (issue 9's solver-time target: <= 2 x the r = 0 fit)."""
    rng = np.random.default_rng(seed)
    num_layers, num_requests = (4, 200) if quick else (58, 2000)
    profile = planted_trace(rng, num_requests=num_requests, request_len=256, num_layers=num_layers, num_experts=256,
                            top_k=8, vocab_size=129_280, num_topics=16, model="deepseek-v3-shaped")
    parallel = ParallelConfig(devices=32, attention="tp")
    started = time.perf_counter()
    plan = SemMoE().fit(profile, parallel, np.random.default_rng(seed))
    seconds = time.perf_counter() - started
    started = time.perf_counter()
    SemMoEReplicated(replicas_per_device=1).fit(profile, parallel, np.random.default_rng(seed))
    replicated_seconds = time.perf_counter() - started
    return {
        "solver_replicated_r1_fit_seconds": replicated_seconds,
        "solver_replicated_r1_vs_r0": replicated_seconds / seconds,
        "solver_replicated_target_met": replicated_seconds <= 2 * seconds if not quick else None,
        "solver_layers": num_layers,
        "solver_profile_tokens": profile.num_tokens,
        "solver_token_rows": plan.info["profile_token_rows"],
        "solver_units": plan.info["solver_units"],
        "solver_load_share": plan.info["solver_load_share"],
        "solver_fit_seconds": seconds,
        "solver_cocluster_seconds": plan.info["solver_seconds"],
        "solver_peak_rss_gb": peak_rss_gb(),
        "solver_target_met": (seconds <= 60 and peak_rss_gb() <= 4) if not quick else None,
    }


def bench_dp_scheduler(
    quick: bool, devices: int = 8, prompt_len: int = 1024, seed: int = 1, load_aware_lambda: float = 0.0,
    dp_scheduler: str = "paper",
) -> dict:
    """Requests per second of Algorithm 2 (score + round-robin mask, or the load-aware variant), or of the
    time-aware token-balance scheduler (dp_scheduler="time"), on 1k-token prompts, one process."""
    rng = np.random.default_rng(seed)
    profile = planted_trace(rng, num_requests=200, request_len=256, num_layers=4, num_experts=256, top_k=8,
                            vocab_size=129_280, num_topics=16)
    system = SemMoE(n_steps=2, load_aware_lambda=load_aware_lambda, dp_window=1 if load_aware_lambda == 0 else 10**9,
                    dp_scheduler=dp_scheduler, dp_balance_weight=0.5 if dp_scheduler == "time" else 0.0)
    plan = system.fit(profile, ParallelConfig(devices=devices, attention="dp"), np.random.default_rng(seed))
    num_requests = 512 if quick else 8192
    token_ids = rng.integers(129_280, size=num_requests * prompt_len).astype(np.int32)
    offsets = np.arange(num_requests + 1, dtype=np.int64) * prompt_len
    prefill = np.full(num_requests, prompt_len, dtype=np.int32)
    plan.assign_requests(token_ids[: 8 * prompt_len], offsets[:9], prefill[:8])  # warm-up
    best = np.inf
    for _ in range(1 if quick else 3):
        plan.reset()
        started = time.perf_counter()
        plan.assign_requests(token_ids, offsets, prefill)
        best = min(best, time.perf_counter() - started)
    rate = num_requests / best
    name = f"dp{devices}" + ("_load_aware" if load_aware_lambda else "") + ("_time" if dp_scheduler == "time" else "")
    return {f"{name}_prompt_len": prompt_len, f"{name}_requests_per_s": rate,
            f"{name}_target_met": rate >= 50_000 if not quick else None}


def bench_tp_reshuffle(quick: bool, devices: int = 8, tokens_per_step: int = 4096, seed: int = 2) -> dict:
    """Tokens per second of Algorithm 3 (T / A lookup with 2 layers of history, align, permutation)."""
    rng = np.random.default_rng(seed)
    profile = planted_trace(rng, num_requests=200, request_len=256, num_layers=4, num_experts=256, top_k=8,
                            vocab_size=129_280, num_topics=16)
    plan = SemMoE(n_steps=2).fit(profile, ParallelConfig(devices=devices, attention="tp", tokens_per_step=tokens_per_step),
                                 np.random.default_rng(seed))
    token_ids = profile.token_ids[:tokens_per_step]
    prev = np.asarray(profile.experts[:tokens_per_step, 1:3])
    steps = 20 if quick else 200
    plan.shuffle_tokens(token_ids, 3, prev)  # warm-up
    started = time.perf_counter()
    for _ in range(steps):
        plan.shuffle_tokens(token_ids, 3, prev)
    seconds = time.perf_counter() - started
    return {"tp_devices": devices, "tp_tokens_per_step": tokens_per_step,
            "tp_tokens_per_s": steps * tokens_per_step / seconds, "tp_steps_per_s": steps / seconds,
            "tp_align_moved_share": plan.info["align_moved_share"]}


def run(quick: bool) -> dict:
    """All Sem-MoE benchmarks; every number is measured on this machine."""
    results = {}
    results.update(bench_dp_scheduler(quick))
    results.update(bench_dp_scheduler(quick, devices=32))
    results.update(bench_dp_scheduler(quick, load_aware_lambda=0.01))
    results.update(bench_dp_scheduler(quick, dp_scheduler="time"))
    results.update(bench_tp_reshuffle(quick))
    results.update(bench_solver(quick))
    return results


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
