"""Benchmarks of the baselines and bounds: exact co-clustering MILP (seconds and gap vs instance size),
MoETuner / EPLB fit times on a DeepSeek-V2-Lite-shaped instance (64 experts, 26 MoE layers, top-6, EP 8), and
the LAR of every system and bound on planted routing (bench.bench_semmoe.planted_trace), DP and TP; a
bound's lar is its ceiling and lar_achieved its evaluated witness.

Everything is measured in this process; `quick` shrinks the instances for CI smoke runs.

Legend: t MILP tokens, E experts, D devices, L MoE layers, k top-k.
"""

from __future__ import annotations

import time
import warnings

import numpy as np

from bench.bench_semmoe import planted_trace
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.systems.milp import SolverNodeLimitWarning, solve_coclustering_milp
from repro.traces import split_trace


def milp_scaling(quick: bool) -> dict:
    """Seconds, status and gap of the co-clustering MILP on random planted instances of growing size."""
    sizes = [(8, 8, 2), (12, 8, 4)] if quick else [(8, 8, 2), (16, 8, 2), (12, 8, 4), (24, 8, 4), (16, 16, 4)]
    rng = np.random.default_rng(0)
    out = {}
    for num_tokens, num_experts, num_devices in sizes:
        group = rng.integers(0, num_devices, num_tokens)
        per = num_experts // num_devices
        confidence = 0.2 * rng.dirichlet(np.ones(num_experts), size=num_tokens)
        confidence[np.arange(num_tokens), group * per] += 0.8
        frequency = rng.integers(1, 30, num_tokens).astype(float)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SolverNodeLimitWarning)  # the status column says it
            sol = solve_coclustering_milp(confidence, frequency, num_devices, 0.5, time_limit=600,
                                          node_limit=200 if quick else 2000)
        out[f"t{num_tokens}_E{num_experts}_D{num_devices}"] = {
            "seconds": sol.seconds, "status": sol.status, "gap": sol.gap, "objective": sol.objective,
        }
    return out


def fit_times(quick: bool) -> dict:
    """Fit seconds of MoETuner and EPLB on a DeepSeek-V2-Lite-shaped profile (E=64, L=26, k=6, EP 8)."""
    rng = np.random.default_rng(1)
    layers = 4 if quick else 26
    profile = planted_trace(rng, num_requests=100 if quick else 400, request_len=64, num_layers=layers,
                            num_experts=64, top_k=6, vocab_size=8000)
    parallel = ParallelConfig(devices=8, tokens_per_step=512)
    out = {"layers": layers, "profile_tokens": profile.num_tokens}
    for name, params in (("eplb", {}), ("eplb", {"num_redundant": 8}), ("moetuner", {})):
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SolverNodeLimitWarning)
            plan = make_system(name, **params).fit(profile, parallel, np.random.default_rng(0))
        key = name + (f"_r{params['num_redundant']}" if "num_redundant" in params else "")
        out[key] = {"fit_seconds": time.perf_counter() - start,
                    **{k: v for k, v in plan.info.items() if isinstance(v, (int, float, str))}}
    return out


def lar_table(quick: bool) -> dict:
    """LAR of every system on the evaluation split of planted routing, DP and TP, EP 4."""
    from repro.eval import evaluate

    rng = np.random.default_rng(2)
    trace = planted_trace(rng, num_requests=150 if quick else 400, request_len=64, num_layers=2 if quick else 4,
                          num_experts=16, top_k=2, vocab_size=4000)
    profile, evaluation = split_trace(trace, 0.2, np.random.default_rng(0))
    out = {}
    systems = [("ep", {}), ("eplb", {"num_redundant": 4}), ("moetuner", {}), ("semmoe", {}),
               ("token_oracle", {}), ("dp_bound", {}), ("fit_assign", {})]
    for attention in ("dp", "tp"):
        parallel = ParallelConfig(devices=4, attention=attention, tokens_per_step=256)
        for name, params in systems:
            if (name, attention) in (("token_oracle", "dp"), ("dp_bound", "tp")):
                continue
            system = make_system(name, **params)
            fit_on = evaluation if getattr(system, "fits_on_evaluation", False) else profile
            start = time.perf_counter()
            plan = system.fit(fit_on, parallel, np.random.default_rng(0))
            fit_seconds = time.perf_counter() - start
            summary = evaluate(plan, evaluation).summary
            out[f"{attention}_{name}"] = {"lar": plan.info.get("lar_bound", summary["lar"]), "lar_achieved": summary["lar"],
                                          "fit_seconds": fit_seconds,
                                          "token_imbalance_max_mean": summary.get("token_imbalance_max_mean"),
                                          "expert_load_imbalance_max_mean": summary.get("expert_load_imbalance_max_mean")}
    return out


def run(quick: bool) -> dict:
    return {"milp": milp_scaling(quick), "fit_times_dsv2lite_shape": fit_times(quick), "lar_planted_ep4": lar_table(quick)}


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run("--quick" in sys.argv), indent=1, default=float))
