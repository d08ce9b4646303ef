"""`simulate`: one system's plan served on simulated hardware over a sweep of request rates.

    result = simulate(config, plan, trace, config["hardware"], config["sim"]["shape"], np.random.default_rng(seed))
    result.summary     # dict: goodputs, SLOs, headline breakdown, what the numbers rest on (same keys for every system)
    result.per_rate    # DataFrame, one row per simulated rate (columns of repro.sim.metrics.rate_row + SLO flags)
    result.per_layer   # DataFrame, one row per (rate, MoE layer): gate / dispatch / experts / combine seconds

Requests are the first `sim.num_requests` of the trace (its order is the arrival order). Prompts are the tokens
before prefill_len. Output lengths: the trace's generated tokens when it has any ("trace"), else `sim.output_len`
(a fixed count, or [lo, hi] drawn uniformly with the seed). Decode routing (`sim.decode_routing`):
  captured         decode step j feeds generated token j - 1 with its captured routing (needs generated tokens);
  prompt_resample  decode step j reuses the routing (all layers) and id of a prompt token of the same request drawn
                   uniformly with the seed: the request's own experts, at the prompt's frequencies, with no drift;
  auto             captured when the trace has generated tokens, else prompt_resample.
Arrivals: a unit-rate pattern scaled to each rate (Poisson: cumulative Exp(1) gaps drawn once with the seed, or
`arrival_times` given by the caller, normalised to unit rate), so every rate and every system sees the same
arrival order and the same relative gaps. Summary fields say which of these choices made the numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pandas as pd

from repro.errors import ConfigError, TraceError, check_known_keys
from repro.sim.costs import A2A_BACKENDS, CostModel
from repro.sim.engine import SCHEDULES, Engine, EngineConfig, Requests
from repro.sim.hardware import Hardware, load_hardware
from repro.sim.metrics import (
    STATISTICS,
    attainment,
    bisect_goodput,
    layer_rows,
    paper_slo,
    rate_row,
    request_latencies,
    throughput_under_slo,
)
from repro.sim.shapes import ModelShape, routing_map
from repro.sim.traffic import dispatch_slots
from repro.systems.base import Plan
from repro.traces import RoutingTrace

DECODE_ROUTINGS = ("auto", "captured", "prompt_resample")
ARRIVALS = ("poisson", "given")
SIM_KEYS = {
    "rates", "num_requests", "arrival", "output_len", "decode_routing", "backend", "schedule", "max_batched_tokens",
    "max_running_requests", "max_block_iterations", "iteration_overhead_us", "kv_capacity_tokens", "routing_map",
    "slo", "shape",
}
SLO_KEYS = {"multiplier", "statistic", "ttft_s", "tpot_s", "e2e_s", "attainment", "bisect_steps"}


@dataclass
class SimResult:
    summary: dict
    per_rate: pd.DataFrame
    per_layer: pd.DataFrame


def check_sim_config(sim: dict) -> dict:
    """Validate the `sim` config group; one ConfigError sentence per problem."""
    check_known_keys("sim", sim, SIM_KEYS)
    missing = sorted(SIM_KEYS - {"kv_capacity_tokens", "shape"} - set(sim))
    if missing:
        raise ConfigError(f"sim misses key(s) {missing}; see conf/sim/default.yaml.")
    rates = np.asarray(sim["rates"], dtype=np.float64).ravel()
    if not len(rates) or not np.all(np.isfinite(rates)) or np.any(rates <= 0):
        raise ConfigError(f"sim.rates must be request rates > 0 (requests per second), got {sim['rates']!r}.")
    choices = (("arrival", ARRIVALS), ("decode_routing", DECODE_ROUTINGS), ("backend", A2A_BACKENDS),
               ("schedule", SCHEDULES))
    for key, allowed in choices:
        if sim[key] not in allowed:
            raise ConfigError(f"sim.{key} must be one of {allowed}, got {sim[key]!r}.")
    for key in ("num_requests", "max_batched_tokens", "max_running_requests", "max_block_iterations"):
        if not isinstance(sim[key], int | np.integer) or sim[key] < 1:
            raise ConfigError(f"sim.{key} must be an integer >= 1, got {sim[key]!r}.")
    if sim["max_running_requests"] > sim["max_batched_tokens"]:
        raise ConfigError(
            f"sim.max_running_requests={sim['max_running_requests']} exceeds sim.max_batched_tokens="
            f"{sim['max_batched_tokens']}: every running request needs a token of the budget each decode step."
        )
    out = sim["output_len"]
    fixed = isinstance(out, int | np.integer) and out >= 1
    ranged = isinstance(out, list | tuple) and len(out) == 2 and all(isinstance(v, int | np.integer) for v in out) \
        and 1 <= out[0] <= out[1]
    if not (fixed or ranged):
        raise ConfigError(f"sim.output_len must be an integer >= 1 or a range [lo, hi] with 1 <= lo <= hi, got {out!r}.")
    slo = dict(sim["slo"] or {})
    unknown = sorted(set(slo) - SLO_KEYS)
    if unknown or SLO_KEYS - set(slo):
        raise ConfigError(f"sim.slo must have exactly the keys {sorted(SLO_KEYS)}, got {sorted(slo)}.")
    if slo["statistic"] not in STATISTICS:
        raise ConfigError(f"sim.slo.statistic must be one of {STATISTICS}, got {slo['statistic']!r}.")
    if not 0 < slo["attainment"] <= 1 or slo["multiplier"] <= 0:
        raise ConfigError(f"sim.slo needs 0 < attainment <= 1 and multiplier > 0, got {slo}.")
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        if slo[key] is not None and not slo[key] > 0:
            raise ConfigError(f"sim.slo.{key} must be null (derived) or seconds > 0, got {slo[key]!r}.")
    if sim["iteration_overhead_us"] < 0:
        raise ConfigError(f"sim.iteration_overhead_us must be >= 0, got {sim['iteration_overhead_us']!r}.")
    return dict(sim, rates=sorted(rates.tolist()), slo=slo)


def build_requests(trace: RoutingTrace, num_requests: int, output_len, decode_routing: str,
                   rng_output: np.random.Generator, rng_decode: np.random.Generator) -> tuple[Requests, str, str]:
    """(Requests of the first num_requests of the trace, decode routing used, output length source)."""
    n = min(num_requests, trace.num_requests)
    offsets = np.asarray(trace.offsets[: n + 1], dtype=np.int64)
    lengths = np.diff(offsets)
    prompt = np.asarray(trace.prefill_len[:n], dtype=np.int64)
    if np.any(prompt < 1):
        bad = int(np.argmax(prompt < 1))
        raise TraceError(f"request {bad} of the trace has prefill_len {prompt[bad]}; every request needs a prompt token.")
    generated = lengths - prompt
    if decode_routing == "auto":
        decode_routing = "captured" if generated.any() else "prompt_resample"
    if decode_routing == "captured" and not generated.any():
        raise ConfigError("sim.decode_routing=captured needs a trace with generated tokens (model.max_new_tokens > 0); "
                          "use auto or prompt_resample.")
    if generated.any():
        out, source = np.maximum(generated, 1), "trace"
    elif isinstance(output_len, list | tuple):
        low, high = (int(v) for v in output_len)
        out, source = rng_output.integers(low, high, size=n, endpoint=True), f"uniform[{low},{high}]"
    else:
        out, source = np.full(n, int(output_len)), f"fixed:{int(output_len)}"
    out = out.astype(np.int64)
    row_start = offsets[:-1] - offsets[0]
    stream_len = prompt + out - 1
    stream_start = np.concatenate([[0], np.cumsum(stream_len)[:-1]])
    position = np.arange(stream_len.sum()) - np.repeat(stream_start, stream_len)  # position in its request
    owner = np.repeat(np.arange(n), stream_len)
    if decode_routing == "captured":
        stream = row_start[owner] + position
    else:
        # a decode position takes a uniformly drawn prompt token of its own request
        uniform = rng_decode.random(len(position))
        drawn = (uniform * prompt[owner]).astype(np.int64)
        stream = row_start[owner] + np.where(position < prompt[owner], position, drawn)
    requests = Requests(
        prompt_len=prompt, output_len=out, row_start=row_start, stream_start=stream_start, stream=stream,
        experts=np.array(trace.experts[offsets[0] : offsets[-1]]), token_ids=np.array(trace.token_ids[offsets[0] : offsets[-1]]),
    )
    return requests, decode_routing, source


def kv_capacity(shape: ModelShape, hw: Hardware, devices: int, attention_mode: str) -> int:
    """KV-cache tokens one DP rank (or the TP group) holds after the weights, within memory_fraction of HBM."""
    free = hw.hbm_bytes * hw.memory_fraction - shape.weight_bytes_per_rank(devices, attention_mode == "dp")
    if free <= 0:
        need = shape.weight_bytes_per_rank(devices, attention_mode == "dp") / 1e9
        raise ConfigError(
            f"shape {shape.name} needs {need:.1f} GB of weights per rank at EP {devices} ({attention_mode}) but "
            f"{hw.name} gives {hw.hbm_bytes * hw.memory_fraction / 1e9:.1f} GB; use more devices or larger GPUs."
        )
    per_token = shape.kv_bytes_per_token_layer() * shape.num_hidden_layers
    if attention_mode == "tp" and shape.attention["kind"] == "gqa":
        per_token /= min(devices, shape.attention["num_kv_heads"])
    return int(free // per_token)


def _check_fit(plan: Plan, trace: RoutingTrace, hw: Hardware) -> None:
    parallel, placement = plan.parallel, plan.placement
    if placement.num_layers != trace.num_layers or placement.num_experts != trace.meta.num_experts:
        raise ConfigError(
            f"the plan places {placement.num_layers} layers x {placement.num_experts} experts but the trace routes "
            f"{trace.num_layers} x {trace.meta.num_experts}; fit the system on a trace of the same model."
        )
    if parallel.devices > hw.num_devices:
        raise ConfigError(f"parallel.devices={parallel.devices} exceeds the {hw.num_devices} GPUs of hardware {hw.name}.")
    if parallel.devices_per_node != hw.devices_per_node:
        raise ConfigError(
            f"parallel.devices_per_node={parallel.devices_per_node} but hardware {hw.name} has {hw.devices_per_node} "
            "GPUs per node; set them equal."
        )
    if parallel.devices > hw.devices_per_node and parallel.devices % hw.devices_per_node:
        raise ConfigError(
            f"parallel.devices={parallel.devices} spans nodes of {hw.devices_per_node} GPUs unevenly; use a multiple "
            f"of {hw.devices_per_node}."
        )


def unit_rate_pattern(arrival: str, num_requests: int, rng: np.random.Generator,
                      arrival_times: np.ndarray | None) -> np.ndarray:
    """float64[R] arrival times of a unit-rate process (request i arrives at pattern[i] / rate)."""
    if arrival == "poisson":
        return np.cumsum(rng.exponential(1.0, size=num_requests))
    if arrival_times is None:
        raise ConfigError("sim.arrival=given needs arrival_times (seconds per request) passed to simulate.")
    times = np.asarray(arrival_times, dtype=np.float64)[:num_requests]
    if len(times) < num_requests or not np.all(np.isfinite(times)) or np.any(times < 0) or times.max() <= 0:
        raise ConfigError(f"arrival_times must hold {num_requests} finite times >= 0 with a positive last one.")
    return times * (num_requests / times.max())


def simulate(config: dict, plan: Plan, trace: RoutingTrace, hardware: dict, shape: dict, rng: np.random.Generator,
             *, arrival_times: np.ndarray | None = None, progress: bool = False) -> SimResult:
    """Sweep config["sim"]["rates"] for `plan` on `trace` (see the module docstring); same inputs, same numbers."""
    started = time.perf_counter()
    sim = check_sim_config(config.get("sim") or {})
    model = ModelShape.from_config(shape)
    hw = load_hardware(hardware)
    mapping = routing_map(model, trace, sim["routing_map"])
    _check_fit(plan, trace, hw)
    parallel = plan.parallel
    rng_arrival, rng_output, rng_decode = rng.spawn(3)
    requests, decode_routing, output_source = build_requests(
        trace, sim["num_requests"], sim["output_len"], sim["decode_routing"], rng_output, rng_decode)
    pattern = unit_rate_pattern(sim["arrival"], requests.num_requests, rng_arrival, arrival_times)
    capacity = sim.get("kv_capacity_tokens") or kv_capacity(model, hw, parallel.devices, parallel.attention)
    engine = Engine(
        plan, requests, CostModel(model, hw, mapping, parallel.devices, parallel.attention, sim["backend"]),
        dispatch_slots(plan.placement),
        EngineConfig(sim["max_batched_tokens"], sim["max_running_requests"], sim["schedule"], int(capacity),
                     sim["max_block_iterations"], sim["iteration_overhead_us"] * 1e-6, int(config.get("history", 2))),
    )

    rows, layers, latencies = [], [], []
    rates = sim["rates"]
    if progress:
        from tqdm import tqdm

        rates = tqdm(rates, desc="simulate rates", unit="rate")
    for rate in rates:
        run = engine.run(pattern / rate)
        rows.append(rate_row(rate, run, requests.prompt_len, requests.output_len))
        layers += layer_rows(rate, run, trace.meta.layer_ids)
        latencies.append(request_latencies(run, requests.output_len))
    per_rate = pd.DataFrame(rows)
    per_layer = pd.DataFrame(layers)

    slo, stat, warnings = sim["slo"], sim["slo"]["statistic"], []
    derived = {name: slo[f"{name}_s"] or paper_slo(per_rate, name, stat, slo["multiplier"]) for name in ("ttft", "e2e", "tpot")}
    for name in ("ttft", "e2e"):
        per_rate[f"meets_{name}_slo"] = per_rate[f"{name}_{stat}_s"] <= derived[name]
    per_rate["attainment"] = [attainment(lat, derived["ttft"], derived["tpot"]) for lat in latencies]

    def probe(rate: float) -> float:
        return attainment(request_latencies(engine.run(pattern / rate), requests.output_len), derived["ttft"], derived["tpot"])

    goodput, bracketed = bisect_goodput(per_rate["rate"].to_numpy(), per_rate["attainment"].to_numpy(),
                                        slo["attainment"], probe, slo["bisect_steps"])
    under = {name: throughput_under_slo(per_rate, name, stat, derived[name]) for name in ("ttft", "e2e")}
    for name, value in under.items():
        if value == 0.0:
            warnings.append(f"no swept rate meets the {name.upper()} SLO of {derived[name]:.4g} s ({stat}); "
                            f"throughput under it is reported as 0.")
    if goodput == 0.0:
        warnings.append(f"fewer than {slo['attainment']:.0%} of requests meet TTFT <= {derived['ttft']:.4g} s and "
                        f"TPOT <= {derived['tpot']:.4g} s even at the lightest rate; DistServe goodput is reported as 0.")
    lightest, heaviest = per_rate.iloc[0], per_rate.iloc[-1]
    wall = time.perf_counter() - started
    iterations = int(per_rate["iterations"].sum())
    summary = {
        "sim_time_basis": ("calibrated: " + ", ".join(hw.calibrated_parts)) if hw.calibrated_parts else
        "uncalibrated (roofline compute, all-to-all fitted to published curves); compare systems, not seconds",
        "sim_calibrated_parts": list(hw.calibrated_parts),
        "sim_hardware": hw.name,
        "sim_shape": model.name,
        "sim_routing_source": f"{trace.meta.source or 'unknown'}:{trace.meta.model}:{trace.meta.dataset}",
        "sim_routing_map": mapping.description,
        "sim_decode_routing": decode_routing,
        "sim_output_len_source": output_source,
        "sim_arrival": sim["arrival"],
        "sim_backend": sim["backend"],
        "sim_schedule": sim["schedule"],
        "sim_attention": parallel.attention,
        "sim_devices": parallel.devices,
        "sim_num_requests": requests.num_requests,
        "sim_kv_capacity_tokens": int(capacity),
        "sim_rates": [float(r) for r in per_rate["rate"]],
        "slo_statistic": stat,
        "slo_ttft_s": derived["ttft"],
        "slo_e2e_s": derived["e2e"],
        "slo_tpot_s": derived["tpot"],
        "slo_derived_from_lightest_rate": {name: slo[f"{name}_s"] is None for name in ("ttft", "e2e", "tpot")},
        "throughput_under_ttft_slo_rps": under["ttft"],
        "throughput_under_e2e_slo_rps": under["e2e"],
        "goodput_distserve_rps": goodput,
        "goodput_distserve_bracketed": bracketed,
        "goodput_attainment_target": slo["attainment"],
        "a2a_share_lightest": float(lightest["a2a_share"]),
        "a2a_share_heaviest": float(heaviest["a2a_share"]),
        "moe_layer_s_lightest": float(sum(lightest[f"moe_{c}_s"] for c in ("gate", "dispatch", "experts", "combine"))),
        "ttft_p99_s_lightest": float(lightest["ttft_p99_s"]),
        "e2e_p50_s_lightest": float(lightest["e2e_p50_s"]),
        "lar_sim": float(np.average(per_rate["lar"])),
        "sim_wall_s": wall,
        "sim_iterations": iterations,
        "sim_requests_per_wall_s": requests.num_requests * len(per_rate) / wall,
        "sim_events_per_wall_s": (iterations + requests.num_requests * len(per_rate)) / wall,
        "warnings": warnings,
    }
    return SimResult(summary, per_rate, per_layer)


__all__ = ["SimResult", "check_sim_config", "simulate"]
