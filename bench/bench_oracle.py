"""Benchmarks of the ceilings: the token oracle's exact alignment (the LP over distinct score rows vs the former
MILP path, kept as `align_exact(..., reference=True)`) on a DeepSeek-V2-Lite-shaped trace (64 experts, 26 MoE
layers, top-6, EP 8, 2,048-token steps), and the dp_bound LP bound vs its feasible witness on topic-skewed routing.

Both alignments run on the same score matrices in this process; the objectives must agree exactly.

Legend: E experts, D devices, L MoE layers, k top-k, T tokens per step.
"""

from __future__ import annotations

import time

import numpy as np

from repro.eval import evaluate
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.systems.ep import contiguous_placement
from repro.systems.oracle import align_exact, local_scores
from repro.traces import TraceMeta, make_trace


def skewed_trace(num_tokens: int, num_layers: int, num_experts: int = 64, top_k: int = 6, request_len: int = 256,
                 num_topics: int = 8, seed: int = 0):
    """Synthetic routing with topic skew: every request has a topic, every (topic, layer) a Dirichlet(0.3) expert
    popularity, and each token its k distinct experts by Gumbel top-k on that popularity."""
    rng = np.random.default_rng(seed)
    offsets = np.unique(np.r_[np.arange(0, num_tokens, request_len), num_tokens])
    topic = np.repeat(rng.integers(0, num_topics, len(offsets) - 1), np.diff(offsets))  # [N]
    popularity = rng.dirichlet(np.full(num_experts, 0.3), size=(num_topics, num_layers))  # [topics, L, E]
    keys = np.log(popularity[topic]) + rng.gumbel(size=(num_tokens, num_layers, num_experts))
    experts = np.argpartition(-keys, top_k, axis=2)[:, :, :top_k]
    meta = TraceMeta(model="synthetic", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(num_layers)),
                     vocab_size=32000)
    return make_trace(meta, offsets, rng.integers(0, 32000, num_tokens), experts)


def token_oracle_alignment(quick: bool) -> dict:
    """Seconds per 2,048-token step (all layers) of the exact alignment, fast LP vs the MILP reference, EP 8."""
    num_steps, num_layers, tokens_per_step, num_devices = (1, 4, 2048, 8) if quick else (3, 26, 2048, 8)
    trace = skewed_trace(num_steps * tokens_per_step, num_layers)
    present = contiguous_placement(num_layers, 64, num_devices).replicas() > 0  # [L, E, D]
    floor = tokens_per_step // num_devices
    bounds = np.full(num_devices, floor), np.full(num_devices, floor)
    seconds = {"fast": 0.0, "reference": 0.0}
    local = {"fast": 0, "reference": 0}
    distinct_rows = []
    for start in range(0, trace.num_tokens, tokens_per_step):
        experts = np.asarray(trace.experts[start : start + tokens_per_step])
        for layer in range(num_layers):
            for path in ("fast", "reference"):
                t0 = time.perf_counter()
                score = local_scores(experts[:, layer], present[layer])
                device = align_exact(score, *bounds, reference=path == "reference")
                seconds[path] += time.perf_counter() - t0
                local[path] += int(score[np.arange(len(score)), device].sum())
            distinct_rows.append(len(np.unique(score, axis=0)))
    if local["fast"] != local["reference"]:
        raise AssertionError(f"the fast alignment lost exactness: {local['fast']} vs {local['reference']} local activations")
    evaluate_start = time.perf_counter()
    plan = make_system("token_oracle", base="ep").fit(
        trace, ParallelConfig(devices=num_devices, attention="tp", tokens_per_step=tokens_per_step),
        np.random.default_rng(0),
    )
    lar = evaluate(plan, trace).summary["lar"]
    return {
        "shape": {"experts": 64, "top_k": 6, "layers": num_layers, "devices": num_devices,
                  "tokens_per_step": tokens_per_step, "steps": num_steps},
        "seconds_per_step_fast": seconds["fast"] / num_steps,
        "seconds_per_step_reference_milp": seconds["reference"] / num_steps,
        "speedup": seconds["reference"] / max(seconds["fast"], 1e-12),
        "local_activations_equal": True,
        "distinct_score_rows_mean": float(np.mean(distinct_rows)),
        "evaluate_seconds_fast": time.perf_counter() - evaluate_start,
        "lar_aligned": lar,
    }


def dp_bound_gap(quick: bool) -> dict:
    """dp_bound's LP ceiling vs its feasible witness on topic-skewed routing (EP 4 and 8), with fit seconds."""
    trace = skewed_trace((120 if quick else 600) * 48, 2 if quick else 8, num_experts=32, top_k=4, request_len=48,
                         seed=3)
    out = {}
    for devices in (4, 8):
        parallel = ParallelConfig(devices=devices, attention="dp", tokens_per_step=256)
        start = time.perf_counter()
        plan = make_system("dp_bound").fit(trace, parallel, np.random.default_rng(0))
        fit_seconds = time.perf_counter() - start
        lar_ep = evaluate(make_system("ep").fit(trace, parallel, np.random.default_rng(0)), trace).summary["lar"]
        out[f"ep{devices}"] = {key: plan.info[key] for key in ("lar_bound", "lar_feasible", "bound_gap", "bound_seconds")}
        out[f"ep{devices}"].update(fit_seconds=fit_seconds, lar_vanilla_ep=lar_ep, witness_base=plan.info["witness_base"])
    return out


def run(quick: bool) -> dict:
    return {"token_oracle_alignment": token_oracle_alignment(quick), "dp_bound_topic_skew": dp_bound_gap(quick)}


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run("--quick" in sys.argv), indent=1, default=float))
