"""Benchmark of the prefill/decode-disaggregated simulator (issue 27 item 6): simulated requests per CPU second on
a DeepSeek-V2-Lite-shaped routing (26 MoE layers, 64 experts, top-6; random routing) with a prefill pool of 8
ranks (DeepEP normal kernels) and a decode pool of 8 ranks (DeepEP low-latency kernels), KV over the H200
profile's RDMA, at a request rate that keeps both pools busy. Target: >= 2,000 simulated requests per CPU second
(issue 33: >= 7,500). The same run is repeated in the same process with the engine's former numpy pricing
(bench/sim_reference.py): both timings, their ratio, and whether every request's times came out identical.
`run(quick)` returns measured numbers only (quick shrinks the instance for CI smoke runs).

Legend: R requests, L MoE layers, E experts, k top-k.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import yaml

from bench.sim_reference import reference_pricing
from repro.parallel import ParallelConfig
from repro.sim import ModelShape, load_hardware
from repro.sim.costs import CostModel
from repro.sim.disaggregated import kv_link, pd_metrics, run_disaggregated
from repro.sim.engine import EngineConfig
from repro.sim.shapes import routing_map
from repro.sim.simulate import build_requests
from repro.systems.ep import VanillaEP
from repro.traces import TraceMeta, make_trace

CONF = Path(__file__).resolve().parents[1] / "conf"


def random_trace(rng: np.random.Generator, num_requests: int, prompt_len: int, gen_len: int, num_layers: int = 26,
                 num_experts: int = 64, top_k: int = 6):
    """R requests of prompt_len + gen_len tokens, each token's k experts distinct: a uniformly drawn first expert and
    the next k - 1 at stride 11 (coprime with E = 64), enough for a speed benchmark."""
    lengths = np.full(num_requests, prompt_len + gen_len)
    n = int(lengths.sum())
    first = rng.integers(0, num_experts, (n, num_layers, 1), dtype=np.int64)
    experts = ((first + 11 * np.arange(top_k)) % num_experts).astype(np.int16)
    meta = TraceMeta(model="bench", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(num_layers)),
                     vocab_size=32_000, dataset="bench")
    return make_trace(meta, np.concatenate([[0], np.cumsum(lengths)]), rng.integers(0, 32_000, n), experts,
                      prefill_len=np.full(num_requests, prompt_len))


def run(quick: bool = False) -> dict:
    rng = np.random.default_rng(0)
    requests_n, prompt_len, gen_len = (200, 128, 32) if quick else (4000, 256, 64)
    trace = random_trace(rng, requests_n, prompt_len, gen_len)
    shape = ModelShape.from_config(yaml.safe_load((CONF / "sim" / "shape" / "deepseek_v2_lite.yaml").read_text()))
    hw = load_hardware(yaml.safe_load((CONF / "hardware" / "h200.yaml").read_text()))
    requests, _, _ = build_requests(trace, np.arange(requests_n), 1, "captured", rng, rng)
    parallel = ParallelConfig(devices=8, attention="dp", tokens_per_step=64)
    plan = VanillaEP().fit(trace, parallel, rng)
    mapping = routing_map(shape, trace, "strict")
    prefill_cost = CostModel(shape, hw, mapping, 8, "dp", "deepep_normal")
    decode_cost = CostModel(shape, hw, mapping, 8, "dp", "deepep_low_latency")
    config = EngineConfig(8192, 256, "mixed", 200_000, 64, 0.0, 2)
    rate = 1000.0  # requests per second: both pools batch several requests per iteration, neither saturates
    arrivals = np.sort(rng.random(requests_n)) * requests_n / rate
    link = kv_link(shape, hw, "rdma")
    # warm-up: the compiled counting loop is loaded on its first call (about a CPU second), not per request
    run_disaggregated(plan, prefill_cost, config, plan, decode_cost, config, requests, arrivals[:8], link)
    start_cpu, start = time.process_time(), time.perf_counter()
    result = run_disaggregated(plan, prefill_cost, config, plan, decode_cost, config, requests, arrivals, link)
    cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start
    metrics = pd_metrics(result, ttft_slo_s=1.0, tpot_slo_s=0.1)
    with reference_pricing():
        ref_cpu = time.process_time()
        reference = run_disaggregated(plan, prefill_cost, config, plan, decode_cost, config, requests, arrivals, link)
        ref_cpu = time.process_time() - ref_cpu
    identical = all(np.array_equal(getattr(result, name), getattr(reference, name), equal_nan=True)
                    for name in ("first_token", "kv_arrival", "finish")) and all(
        np.array_equal(getattr(result, pool).moe_seconds, getattr(reference, pool).moe_seconds)
        for pool in ("prefill", "decode"))
    return {"requests": requests_n, "prompt_tokens": prompt_len, "output_tokens": gen_len, "rate_per_s": rate,
            "cpu_seconds": cpu, "wall_seconds": wall, "requests_per_cpu_second": requests_n / cpu,
            "prefill_iterations": result.prefill.iterations, "decode_iterations": result.decode.iterations,
            "prefill_ttft_mean_s": metrics["prefill_ttft_mean_s"], "decode_tpot_mean_s": metrics["decode_tpot_mean_s"],
            "finished": metrics["finished"], "reference_cpu_seconds": ref_cpu, "speedup_cpu": ref_cpu / cpu,
            "identical_to_reference": bool(identical)}


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
