"""Benchmark of the signature decode router (issue 17 items 5 and 8): requests/s of `SignaturePlan.assign_decode`
at EP 8 on 1k-token prompts of a DeepSeek-V2-Lite-shaped routing (26 MoE layers, 64 experts, top-6), for the
capacity rule and ELDR's rule. The cost per request is the signature histogram of its prompt (N_p x L x k
activations) plus D distances; the streaming decision is O(D) per request, measured alone too (`decide` on
signatures an engine accumulates during prefill; target >= 50k decisions/s at EP 8).
`run(quick)` returns measured numbers only (quick shrinks the instance for CI smoke runs).

Legend: R requests, S prompt tokens per request, L MoE layers, E experts, k top-k, D devices.
"""

from __future__ import annotations

import time

import numpy as np

from repro.parallel import ParallelConfig
from repro.systems.signature import SignatureDecode
from repro.traces import TraceMeta, make_trace


def profile_trace(rng: np.random.Generator, num_requests: int, prompt_len: int, gen_len: int, num_layers: int,
                  num_experts: int = 64, top_k: int = 6):
    """Random routing with R requests of prompt_len + gen_len tokens (the generated ones after prefill_len)."""
    lengths = np.full(num_requests, prompt_len + gen_len)
    n = int(lengths.sum())
    experts = np.argsort(rng.random((n, num_layers, num_experts), dtype=np.float32), axis=2)[:, :, :top_k]
    meta = TraceMeta(model="bench", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(num_layers)),
                     vocab_size=32_000, dataset="bench")
    return make_trace(meta, np.concatenate([[0], np.cumsum(lengths)]), rng.integers(0, 32_000, n), experts,
                      prefill_len=np.full(num_requests, prompt_len))


def run(quick: bool = False) -> dict:
    rng = np.random.default_rng(0)
    num_layers = 4 if quick else 26
    requests, prompt_len = (64, 256) if quick else (512, 1024)
    decisions = 2_000 if quick else 20_000
    signatures = rng.random((decisions, num_layers * 64))
    parallel = ParallelConfig(devices=8, attention="dp")
    profile = profile_trace(rng, 64, 64, 16, num_layers)
    # the prompts the router reads: R x S tokens, L layers, 6 expert ids each (int16 as in a trace; repeats within a
    # row do not change the router's work, and drawing distinct ids would need an [N, L, E] sort)
    prompt_experts = rng.integers(0, 64, (requests * prompt_len, num_layers, 6), dtype=np.int16)
    offsets = np.arange(requests + 1, dtype=np.int64) * prompt_len
    prefill_ranks = np.arange(requests) % parallel.devices
    out = {"requests": requests, "prompt_tokens": prompt_len, "layers": num_layers, "experts": 64, "top_k": 6,
           "devices": parallel.devices}
    for rule in ("capacity", "eldr"):
        plan = SignatureDecode(rule=rule).fit(profile, parallel, np.random.default_rng(0))
        plan.reset()
        start = time.perf_counter()
        plan.assign_decode(prompt_experts, offsets, prefill_ranks)
        seconds = time.perf_counter() - start
        out[f"{rule}_requests_per_s"] = requests / seconds
        out[f"{rule}_us_per_request"] = 1e6 * seconds / requests
        # the decision alone (issue 27 item 6, target >= 50k/s at EP 8): signatures accumulated during prefill
        best = float("inf")
        for _ in range(3):  # best of three: the first call pays cold memory and BLAS start-up on a shared machine
            plan.reset()
            start = time.perf_counter()
            plan.decide(signatures)
            best = min(best, time.perf_counter() - start)
        out[f"{rule}_decisions_per_s"] = decisions / best
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
