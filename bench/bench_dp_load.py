"""Decision rate of the Attention-DP schedulers that read the engine's live state (issue 32: >= 50k requests/s at
EP 8): one request per call with a live RankLoad view, as the simulator's engine and the router call them.

Each scheduler decides the same stream of 1k-token prompts; the view changes between calls (a rank's queue grows
with each decision) so no decision is cached. Rates are requests per second of the assign_requests calls alone.
"""

from __future__ import annotations

import time

import numpy as np

from bench.bench_semmoe import planted_trace
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.systems.load import RankLoad

SYSTEMS = ("shortest_queue", "minimum_tokens", "vllm_dp", "balance_route", "gimbal", "least_wait")
# Sem-MoE dp_scheduler=load under its configured default rule and under the wait rule
SEMMOE_RULES = {"semmoe_load_shortest_queue": ("shortest_queue", 0.0), "semmoe_load_wait": ("wait", 1.0)}


def decision_rate(plan, token_ids: np.ndarray, prompt_len: int, num_requests: int, devices: int) -> float:
    """Requests per second of plan.assign_requests, one request per call, each with a fresh live view."""
    rng = np.random.default_rng(0)
    views = []
    for _ in range(64):  # a few distinct engine states, cycled
        running = rng.integers(0, 256, devices)
        views.append(RankLoad(running, rng.integers(0, 8, devices), rng.integers(0, 20_000, devices), running,
                              rng.integers(0, 500_000, devices), 1_000_000, 8192, 256))
    offsets = np.array([0, prompt_len])
    prefill = np.array([prompt_len], dtype=np.int32)
    plan.assign_requests(token_ids[:prompt_len], offsets, prefill, load=views[0])  # compiled code loaded, not timed
    plan.reset()
    started = time.perf_counter()
    for r in range(num_requests):
        plan.assign_requests(token_ids[r * prompt_len : (r + 1) * prompt_len], offsets, prefill, load=views[r % 64])
    return num_requests / (time.perf_counter() - started)


def run(quick: bool, devices: int = 8, prompt_len: int = 1024) -> dict:
    rng = np.random.default_rng(1)
    profile = planted_trace(rng, num_requests=200, request_len=256, num_layers=4, num_experts=256, top_k=8,
                            vocab_size=129_280, num_topics=16)
    parallel = ParallelConfig(devices=devices, attention="dp")
    num_requests = 1000 if quick else 20_000
    token_ids = rng.integers(129_280, size=num_requests * prompt_len).astype(np.int32)
    out = {"devices": devices, "prompt_len": prompt_len, "requests": num_requests}
    systems = {name: make_system(name) for name in SYSTEMS}
    systems |= {name: make_system("semmoe", n_steps=2, dp_scheduler="load", dp_load_rule=rule, dp_load_slack=slack)
                for name, (rule, slack) in SEMMOE_RULES.items()}
    for name, system in systems.items():
        plan = system.fit(profile, parallel, np.random.default_rng(0))
        rate = max(decision_rate(plan, token_ids, prompt_len, num_requests, devices) for _ in range(1 if quick else 3))
        out[f"{name}_requests_per_s"] = rate
        out[f"{name}_target_met"] = rate >= 50_000 if not quick else None
    return out
