"""Real expert-parallel execution (repro.exec) of vanilla EP vs Sem-MoE: all-to-all bytes and time on 4 gloo ranks.

A Mixtral-shaped MoE layer scaled to a CPU (hidden 1024, 8 experts, top-2, expert intermediate 1024, fp32) runs
the MMLU evaluate-split tokens routed by the synthetic Mixtral routing model (conf/model/synthetic_mixtral.yaml,
8 experts top-2, cut to a few layers), in Attention-DP and Attention-TP; all four plans run in ONE launch of 4
gloo processes. Per mode: the measured dispatch + combine bytes of semmoe over ep, which must equal the
evaluator's ratio exactly (asserted: every rank's bytes equal the evaluator's), and the wall-time ratio of
dispatch + combine (per layer the slowest rank's seconds, summed over layers). Timing runs with a barrier before
each collective (exec barrier_timing), so the seconds are transfers, not the wait for ranks that are still
computing (expert-load imbalance and this harness's reference checks). gloo moves the bytes over loopback TCP on
a shared 2-core machine: the time ratio is noisy and mostly per-call overhead, while the bytes ratio is exact.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("ep", "semmoe")
MODES = ("dp", "tp")


def compose(*overrides: str) -> dict:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_container(hydra_compose("config", overrides=list(overrides)), resolve=True)


def run(quick: bool) -> dict:
    from repro.exec.trace_mode import ExecConfig, run_exec_plans
    from repro.parallel import ParallelConfig
    from repro.run import build_traces
    from repro.systems import make_system

    layers, max_tokens, requests = (2, 512, 200) if quick else (4, 2048, 600)
    with tempfile.TemporaryDirectory(prefix="bench_exec_") as cache:
        config = compose("experiment=exec", "logger=none", f"model.num_layers={layers}",
                         f"workload.num_requests={requests}", f"cache_dir={cache}")
        t0 = time.perf_counter()
        profile, evaluation = build_traces(config)
        routing_s = time.perf_counter() - t0
    exec_cfg = ExecConfig(hidden_size=1024, intermediate_size=1024, max_tokens=max_tokens, timeout_s=600,
                          barrier_timing=True)
    plans, names = [], []
    for mode in MODES:
        parallel = ParallelConfig.from_config(dict(config["parallel"], attention=mode))
        for system in SYSTEMS:
            params = config["system"]["params"] if system == config["system"]["name"] else {}
            plans.append(make_system(system, **params).fit(profile, parallel, np.random.default_rng(config["seed"])))
            names.append((mode, system))
    t0 = time.perf_counter()
    results = dict(zip(names, run_exec_plans(exec_cfg, plans, evaluation, seed=config["seed"],
                                             history=config["history"]), strict=True))
    exec_s = time.perf_counter() - t0

    cases, modes = {}, {}
    for (mode, system), (summary, _, _) in results.items():
        assert summary["bytes_match_evaluator"], f"{mode} {system}: measured bytes differ from the evaluator's"
        assert summary["output_matches_reference"], f"{mode} {system}: output error {summary['max_abs_error']}"
        cases[f"{mode} {system}"] = {
            "a2a_bytes": summary["dispatch_bytes"] + summary["combine_bytes"],
            "evaluator_a2a_bytes": summary["evaluator_dispatch_bytes"] + summary["evaluator_combine_bytes"],
            "dispatch_s": summary["dispatch_seconds"],
            "combine_s": summary["combine_seconds"],
            "dispatch_meta_bytes": summary["dispatch_meta_bytes"],
            "reduce_scatter_s": summary["reduce_scatter_seconds"],
            "all_gather_s": summary["all_gather_seconds"],
            "max_abs_error": summary["max_abs_error"],
        }
    for mode in MODES:
        ep, sem = cases[f"{mode} ep"], cases[f"{mode} semmoe"]
        measured = sem["a2a_bytes"] / ep["a2a_bytes"]
        predicted = sem["evaluator_a2a_bytes"] / ep["evaluator_a2a_bytes"]
        assert measured == predicted, f"{mode}: measured bytes ratio {measured} != evaluator's {predicted}"
        modes[mode] = {
            "bytes_ratio_semmoe_over_ep": measured,
            "evaluator_bytes_ratio": predicted,
            "a2a_time_ratio_semmoe_over_ep": (sem["dispatch_s"] + sem["combine_s"]) / (ep["dispatch_s"] + ep["combine_s"]),
        }
    first = next(iter(results.values()))[0]
    return {
        "world_size": first["world_size"],
        "backend": f"{first['backend']} / kernels {first['kernel_backend']}",
        "shape": f"H {exec_cfg.hidden_size}, I {exec_cfg.intermediate_size}, E 8, k 2, {layers} layers, fp32",
        "tokens": first["num_tokens"],
        "tokens_per_step": config["parallel"]["tokens_per_step"],
        "routing_s": routing_s,
        "exec_launch_s": exec_s,
        "modes": modes,
        "cases": cases,
    }
