"""A re-placement in the middle of a serving run, synchronous and asynchronous (issue 34, docs/migration.md).

    python -m bench --only migration [--quick]

DeepSeek-V2-Lite's shape on 8 x H200 (conf/hardware/h200.yaml), Attention-DP, vanilla EP's round robin; routing
uniform over the experts (top-6 of 64, seeded), 240 requests of 256 prompt + 64 generated tokens (quick: 96) arriving
uniformly over `span_s`. Halfway through, the placement changes to a re-plan that moves 78 % of the slots
(repro.sim.validation.rearrangement_placements, the published rows' assumption), priced by repro.sim.migration_cost
with the per-layer overhead fitted on vLLM PR #28369 (`fitted_layer_overhead_s`): once synchronous, once
asynchronous at a quarter of the links. Reported per run: the change's record, TTFT and TPOT (mean, p99) of all
requests, and p99 of the requests the migration overlaps against the others. Simulated seconds (uncalibrated
absolute times, docs/serving-simulator.md); only the wall time is this machine's.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import yaml

from repro.parallel import ParallelConfig
from repro.sim.costs import CostModel
from repro.sim.engine import Engine, EngineConfig
from repro.sim.hardware import load_hardware
from repro.sim.metrics import latency_around_changes, request_latencies, statistic
from repro.sim.plan_changes import priced_changes
from repro.sim.shapes import ModelShape, routing_map
from repro.sim.simulate import build_requests
from repro.sim.traffic import dispatch_slots
from repro.sim.validation import fitted_layer_overhead_s, rearrangement_placements
from repro.systems.base import Plan
from repro.traces import TraceMeta, make_trace

ROOT = Path(__file__).resolve().parents[1]
PROMPT, GENERATED, MOVED_FRACTION, ASYNC_SHARE = 256, 64, 0.78, 0.25


def uniform_trace(shape: ModelShape, num_requests: int, rng: np.random.Generator):
    """Requests of PROMPT + GENERATED tokens routed to k distinct experts per layer, uniformly (a random offset plus
    one of 512 random k-subsets, mod E: cheap at this size)."""
    layers, experts, k = shape.num_moe_layers, shape.num_experts, shape.top_k
    rows = num_requests * (PROMPT + GENERATED)
    subsets = np.argsort(rng.random((512, experts)), axis=1)[:, :k]
    routed = (rng.integers(0, experts, (rows, layers))[:, :, None] + subsets[rng.integers(0, 512, (rows, layers))]) % experts
    meta = TraceMeta(model="uniform", num_experts=experts, top_k=k, layer_ids=tuple(range(1, layers + 1)),
                     vocab_size=1000, source="bench_migration")
    return make_trace(meta, np.arange(num_requests + 1) * (PROMPT + GENERATED),
                      rng.integers(0, 1000, rows).astype(np.int32), routed.astype(np.int16),
                      prefill_len=[PROMPT] * num_requests)


def _ms(value: float) -> float:
    return round(value * 1e3, 3)


def run(quick: bool) -> dict:
    num_requests = 96 if quick else 240
    span_s = 0.6 if quick else 1.5  # 160 requests/s
    rng = np.random.default_rng(0)
    shape = ModelShape.from_config(yaml.safe_load((ROOT / "conf/sim/shape/deepseek_v2_lite.yaml").read_text()))
    hw = load_hardware(yaml.safe_load((ROOT / "conf/hardware/h200.yaml").read_text()))
    trace = uniform_trace(shape, num_requests, rng)
    requests, _, _ = build_requests(trace, np.arange(num_requests), 1, "captured", rng, rng)
    parallel = ParallelConfig(devices=8, attention="dp", devices_per_node=8)
    old_placement, new_placement = rearrangement_placements(shape.num_moe_layers, shape.num_experts, 8, 0,
                                                            MOVED_FRACTION, np.random.default_rng(1))
    old, new = Plan(old_placement, parallel), Plan(new_placement, parallel)
    cost = CostModel(shape, hw, routing_map(shape, trace), 8, "dp", "nccl")
    config = EngineConfig(8192, 256, "mixed", 200_000, 64, 0.0, 2)
    arrivals = np.sort(rng.uniform(0, span_s, num_requests))
    overhead = fitted_layer_overhead_s()
    started = time.perf_counter()
    out = {"requests": num_requests, "span_s": span_s, "layer_overhead_ms": _ms(overhead), "runs": {}}
    for mode in ("none", "sync", "async"):
        changes = [] if mode == "none" else priced_changes(
            old, [(span_s / 2, new)], shape, hw, mode, ASYNC_SHARE if mode == "async" else 1.0, layer_overhead_s=overhead)
        result = Engine(old, requests, cost, dispatch_slots(old_placement), config).run(arrivals, changes=changes)
        latency = request_latencies(result, requests.output_len[:num_requests])
        row = {f"{name}_{stat}_ms": _ms(statistic(latency[name], stat)) for name in ("ttft", "tpot") for stat in ("mean", "p99")}
        if result.changes:
            change = result.changes[0]
            row["change"] = {"experts_moved": change["experts_moved"], "gb_moved": round(change["bytes_moved"] / 1e9, 3),
                             "start_s": round(change["start_s"], 4), "end_s": round(change["end_s"], 4),
                             "stall_ms": _ms(change["stall_s"]), "a2a_slowdown": round(change["a2a_slowdown"], 4)}
            split = latency_around_changes(result, requests.output_len, "p99")
            row["p99_around_the_change"] = {
                key.replace("_s_", "_ms_"): _ms(value) if key.startswith(("ttft", "tpot", "e2e")) else value
                for key, value in split.items()}
        out["runs"][mode] = row
    out["wall_s"] = round(time.perf_counter() - started, 2)
    return out
