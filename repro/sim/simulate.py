"""`simulate`: one system's plan served on simulated hardware, measured in steady state over request rates.

    result = simulate(config, plan, trace, config["hardware"], config["sim"]["shape"], np.random.default_rng(seed))
    result.summary     # dict: throughput under each SLO rule per seed and its mean, the SLOs and how they were set,
                       # headline breakdown, what the numbers rest on (same keys for every system)
    result.per_rate    # DataFrame, one row per (grid rate, seed): repro.sim.metrics.rate_row + SLO flags
    result.per_layer   # DataFrame, one row per (grid rate, seed, MoE layer): component seconds, prefill/decode apart
    result.probes      # DataFrame, one row per simulation run (reference, grid and bisection probes), role column
    result.tables      # {"sim_per_rate", "sim_per_layer", "sim_probes"}: what a job writes as CSV
    result.requests    # DataFrame, one row per window request of every run: TTFT / TPOT / E2E (sim_requests.parquet)

Hardware: `config["hardware"]` priced as written, or with the calibration alternative `sim.calibration` names (the
profile's `alternatives:`, repro.sim.hardware); the summary's sim_calibration says which.

Method (conf/sim/default.yaml holds the defaults; every choice is stated in the summary):
- Seeds. `sim.seeds` seeds are spawned from `rng`; seed s draws its own Poisson arrivals and its own request order,
  so systems simulated with the same `rng` seed see the same arrivals and requests seed by seed (paired seeds).
  Seeds are independent of each other: `sim.workers` > 1 simulates them in forked processes, same numbers.
- Requests. At rate r, max(`min_requests`, ceil(r x `duration_s`)) requests arrive; they are the trace's requests
  in consecutive random permutations (`draw_requests`: without replacement while they suffice, so a seed changes
  the order, not the length mix; one seeded sequence per seed, every rate uses its prefix), so the number of
  requests scales with the rate; each run reports its drawn mix (mean and p99 prompt tokens). With
  `arrival: given`, the trace's first len(arrival_times) requests in order arrive at those times (normalised to
  unit rate, scaled per rate). Prompts are the tokens before prefill_len. Output lengths: the trace's generated
  tokens when it has any ("trace"), else `sim.output_len` (a fixed count, or [lo, hi] drawn uniformly).
- Decode routing (`sim.decode_routing`): captured (decode step j feeds generated token j - 1 with its captured
  routing; needs generated tokens) | prompt_resample (decode step j reuses the routing of a prompt token of the
  same request drawn uniformly: the request's own experts, at the prompt's frequencies, no drift) | auto.
- Window. Measurement window [`warmup_s`, last arrival - `cooldown_s`]; the run stops `drain_s` after the last
  arrival (requests still unfinished then miss every SLO). Throughput, latencies and queue stability come from
  the window, cut into `batches` batches (repro/sim/metrics.py steady_state).
- Convergence. A run doubles its arrivals (the same pattern's longer prefix) until it has converged: its queue
  decidedly stable or unstable (an unstable verdict confirmed on the run twice as long), and when stable the 95 %
  half-widths of mean TTFT and E2E within `rel_halfwidth`; a bisection probe stops as soon as every rule's
  comparison with its SLO is settled. At `max_duration_s` of arrivals it stops anyway, labelled unconverged; a
  rule's throughput is converged (`converged_<rule>_per_seed`) when the runs deciding it settled it.
- SLOs, fixed before any bisection and the same for every system compared: `slo.reference: ep` serves vanilla EP's
  plan (repro/systems/ep.py, fitted here on the same trace and parallel config) at `slo.light_rate` (null: the
  lowest grid rate) on every seed, pools the window requests of those runs and takes multiplier x their statistic
  (mean by default) of TTFT, TPOT and E2E; every system of a comparison run with the same config and seed thus
  gets the same SLO values. `reference: self` uses this plan instead (an own-SLO number, not for comparisons);
  `slo.ttft_s` etc. set a value directly.
- Rules and bisection. A rate meets: `ttft` / `e2e` (the paper's rule) when the window's statistic is within the
  SLO; `distserve` when >= `attainment` of the window's requests meet TTFT and TPOT; `capacity` when the queue is
  stable. With `require_stable` every rule also needs a stable queue and no unfinished window request. Seed 0
  runs the rate grid (the per-rate table) and gallops (`bisect_rate`) along it to each rule's crossing, bisecting
  it to `slo.rel_tol`; the other seeds gallop along a ladder of `rel_tol` steps from seed 0's crossing (run after
  seed 0, so the same in forked workers). Midpoints and ladders lie on one lattice, lowest rate x (1 + rel_tol)^k, and runs are cached per seed, so the rules share runs.
  Throughput under a rule is the highest rate meeting it (with a stable queue its steady-state throughput; the window's measured throughput is reported beside it; DistServe
  goodput is that rate too), per seed and as a mean; ratios between systems come from the per-seed values
  (repro.sim.metrics.ratio_interval).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

from repro.config_values import FLAG, MAPPING, OPTIONAL_MAPPING, Value, check_table, check_value, integer, number, text
from repro.errors import ConfigError, TraceError, check_known_keys
from repro.sim.costs import A2A_BACKENDS, CostModel
from repro.sim.engine import SCHEDULES, Engine, EngineConfig, Requests
from repro.sim.hardware import Hardware, load_hardware
from repro.sim.metrics import (
    LATENCIES,
    STATISTICS,
    batch_of_arrival,
    bisect_rate,
    decided,
    layer_rows,
    rate_row,
    request_latencies,
    run_until_converged,
    share_interval,
    span_to_settle,
    statistic,
    window_requests,
)
from repro.sim.shapes import ModelShape, routing_map
from repro.sim.traffic import dispatch_slots
from repro.systems.base import Plan
from repro.traces import RoutingTrace

DECODE_ROUTINGS = ("auto", "captured", "prompt_resample")
ARRIVALS = ("poisson", "given")
REFERENCES = ("ep", "self")
RULES = ("ttft", "e2e", "distserve", "capacity")  # the paper's TTFT and E2E rules, DistServe goodput, stable queue
SIM_KEYS = {
    "rates", "duration_s", "min_requests", "warmup_s", "cooldown_s", "drain_s", "seeds", "stable_tolerance",
    "arrival", "output_len", "decode_routing", "backend", "schedule", "max_batched_tokens", "max_running_requests",
    "max_block_iterations", "iteration_overhead_us", "calibration", "kv_capacity_tokens", "routing_map", "slo", "shape",
    "batches", "rel_halfwidth", "max_duration_s", "workers", "seeds_until",
}
SIM_TABLE = {  # the types and ranges of the job config's sim group (check_sim_config owns choices and cross-field rules)
    "rates": Value(("list",)),
    "duration_s": number(0, low_open=True),
    "min_requests": integer(1),
    "warmup_s": number(0),
    "cooldown_s": number(0),
    "drain_s": number(0),
    "seeds": integer(1),
    "stable_tolerance": number(0),
    "max_batched_tokens": integer(1),
    "max_running_requests": integer(1),
    "max_block_iterations": integer(1),
    "iteration_overhead_us": number(0, null=True),
    "calibration": text(),
    "kv_capacity_tokens": integer(1, null=True),
    "batches": integer(3),
    "rel_halfwidth": number(0, 1, low_open=True, high_open=True),
    "max_duration_s": number(0, low_open=True, null=True),
    "workers": Value(("int", "str"), low=1, choices=("auto",)),
    "slo": MAPPING,
    "seeds_until": OPTIONAL_MAPPING,
}
SIM_SLO_TABLE = {
    "multiplier": number(0, low_open=True),
    "statistic": text(),
    "ttft_s": number(0, low_open=True, null=True),
    "tpot_s": number(0, low_open=True, null=True),
    "e2e_s": number(0, low_open=True, null=True),
    "attainment": number(0, 1, low_open=True),
    "reference": text(),
    "light_rate": number(0, low_open=True, null=True),
    "rel_tol": number(0, 1, low_open=True, high_open=True),
    "require_stable": FLAG,
}
SLO_KEYS = set(SIM_SLO_TABLE)  # every slo key has a type; check_sim_config owns the choices
SEEDS_UNTIL_TABLE = {  # sim.seeds_until: add seeds until each rule's per-seed spread is this tight (`seeds_settled`)
    "rel_halfwidth": number(0, 1, low_open=True, high_open=True),
    "max_seeds": integer(2),
    "step": integer(1),
}
SETTLING_RULES = ("capacity", "ttft")  # the rules whose paired ratios the report judges (repro/figures/serving.py)


def check_sim_table(sim: dict) -> None:
    """The job config's sim group: every key known, every value of its type and range (one ConfigError sentence)."""
    check_table("sim", sim, SIM_TABLE, SIM_KEYS)
    for rate in sim.get("rates", []):
        check_value("sim.rates[...]", rate, number(0, low_open=True))
    check_table("sim.slo", sim.get("slo") or {}, SIM_SLO_TABLE, SLO_KEYS)
    if sim.get("seeds_until") is not None:
        check_table("sim.seeds_until", sim["seeds_until"], SEEDS_UNTIL_TABLE, set(SEEDS_UNTIL_TABLE))


@dataclass
class SimResult:
    summary: dict
    per_rate: pd.DataFrame
    per_layer: pd.DataFrame
    probes: pd.DataFrame
    requests: pd.DataFrame  # one row per window request of every run of the measured plan (request_table)

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        """The tables a job writes, by file stem."""
        return {"sim_per_rate": self.per_rate, "sim_per_layer": self.per_layer, "sim_probes": self.probes}


def check_sim_config(sim: dict) -> dict:
    """Validate the `sim` config group; one ConfigError sentence per problem."""
    check_known_keys("sim", sim, SIM_KEYS)
    missing = sorted(SIM_KEYS - {"kv_capacity_tokens", "shape", "seeds_until"} - set(sim))
    if missing:
        raise ConfigError(f"sim misses key(s) {missing}; see conf/sim/default.yaml.")
    rates = np.asarray(sim["rates"], dtype=np.float64).ravel()
    if not len(rates) or not np.all(np.isfinite(rates)) or np.any(rates <= 0):
        raise ConfigError(f"sim.rates must be request rates > 0 (requests per second), got {sim['rates']!r}.")
    if len(np.unique(rates)) != len(rates):
        raise ConfigError(f"sim.rates must not repeat a rate, got {sim['rates']!r}.")
    choices = (("arrival", ARRIVALS), ("decode_routing", DECODE_ROUTINGS), ("backend", A2A_BACKENDS),
               ("schedule", SCHEDULES))
    for key, allowed in choices:
        if sim[key] not in allowed:
            raise ConfigError(f"sim.{key} must be one of {allowed}, got {sim[key]!r}.")
    if sim["workers"] != "auto" and (not isinstance(sim["workers"], int | np.integer)
                                     or isinstance(sim["workers"], bool) or sim["workers"] < 1):
        raise ConfigError(f"sim.workers must be an integer >= 1 or 'auto' (the CPUs this process may use), "
                          f"got {sim['workers']!r}.")
    for key in ("min_requests", "seeds", "max_batched_tokens", "max_running_requests", "max_block_iterations"):
        if not isinstance(sim[key], int | np.integer) or isinstance(sim[key], bool) or sim[key] < 1:
            raise ConfigError(f"sim.{key} must be an integer >= 1, got {sim[key]!r}.")
    for key in ("duration_s", "warmup_s", "cooldown_s", "drain_s", "stable_tolerance"):
        value = sim[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"sim.{key} must be a number >= 0, got {value!r}.")
    if not (isinstance(sim["batches"], int) and not isinstance(sim["batches"], bool) and sim["batches"] >= 3):
        raise ConfigError(f"sim.batches must be an integer >= 3 (batch means need a trend's 2 dof), got {sim['batches']!r}.")
    if isinstance(sim["rel_halfwidth"], bool) or not isinstance(sim["rel_halfwidth"], int | float) \
            or not 0 < sim["rel_halfwidth"] < 1:
        raise ConfigError(f"sim.rel_halfwidth must be a relative half-width in (0, 1), got {sim['rel_halfwidth']!r}.")
    cap = sim["max_duration_s"]
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float) or not math.isfinite(cap)
                            or cap < sim["duration_s"]):
        raise ConfigError(f"sim.max_duration_s (the cap on a run's arrivals while it converges) must be null (8 x "
                          f"duration_s) or a number >= sim.duration_s={sim['duration_s']}, got {cap!r}.")
    if not sim["duration_s"] > sim["warmup_s"] + sim["cooldown_s"]:
        raise ConfigError(
            f"sim.duration_s={sim['duration_s']} leaves no measurement window after warmup_s={sim['warmup_s']} and "
            f"cooldown_s={sim['cooldown_s']}; make duration_s longer than their sum."
        )
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
    if slo["reference"] not in REFERENCES:
        raise ConfigError(f"sim.slo.reference must be one of {REFERENCES}, got {slo['reference']!r}.")
    if not 0 < slo["attainment"] <= 1 or slo["multiplier"] <= 0:
        raise ConfigError(f"sim.slo needs 0 < attainment <= 1 and multiplier > 0, got {slo}.")
    if not (isinstance(slo["rel_tol"], int | float) and 0 < slo["rel_tol"] < 1):
        raise ConfigError(f"sim.slo.rel_tol must be a relative tolerance in (0, 1), got {slo['rel_tol']!r}.")
    if not isinstance(slo["require_stable"], bool):
        raise ConfigError(f"sim.slo.require_stable must be true or false, got {slo['require_stable']!r}.")
    light = slo["light_rate"]
    if light is not None and not (isinstance(light, int | float) and light > 0):
        raise ConfigError(f"sim.slo.light_rate must be null (the lowest rate) or a rate > 0, got {light!r}.")
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        if slo[key] is not None and not slo[key] > 0:
            raise ConfigError(f"sim.slo.{key} must be null (derived) or seconds > 0, got {slo[key]!r}.")
    overhead = sim["iteration_overhead_us"]
    if overhead is not None and (isinstance(overhead, bool) or not isinstance(overhead, int | float) or overhead < 0):
        raise ConfigError(f"sim.iteration_overhead_us must be null (the hardware profile's) or >= 0, got {overhead!r}.")
    if not isinstance(sim["calibration"], str):
        raise ConfigError(f"sim.calibration must name a calibration alternative of the hardware profile, got {sim['calibration']!r}.")
    until = sim.get("seeds_until")
    if until is not None:
        until = dict(until)
        if set(until) != set(SEEDS_UNTIL_TABLE):
            raise ConfigError(f"sim.seeds_until must be null or have exactly the keys {sorted(SEEDS_UNTIL_TABLE)}, "
                              f"got {sorted(until)}.")
        check_table("sim.seeds_until", until, SEEDS_UNTIL_TABLE, set(SEEDS_UNTIL_TABLE))
        if until["max_seeds"] < sim["seeds"]:
            raise ConfigError(f"sim.seeds_until.max_seeds={until['max_seeds']} is below sim.seeds={sim['seeds']}; "
                              "the cap counts every seed, the first sim.seeds included.")
    cap = float(8 * sim["duration_s"] if cap is None else cap)  # three doublings by default
    return dict(sim, rates=sorted(rates.tolist()), slo=slo, max_duration_s=cap, seeds_until=until)


def iteration_overhead(sim: dict, hw: Hardware) -> float:
    """Seconds added to every engine iteration: sim.iteration_overhead_us when given, else the hardware profile's."""
    given = sim["iteration_overhead_us"]
    return hw.iteration_overhead if given is None else given * 1e-6


def build_requests(trace: RoutingTrace, picked: np.ndarray, output_len, decode_routing: str,
                   rng_output: np.random.Generator, rng_decode: np.random.Generator) -> tuple[Requests, str, str]:
    """(Requests of the trace requests `picked` int[R], in that order and repeats allowed; decode routing used;
    output length source). The compact rows are the trace's own rows, shared by repeats."""
    picked = np.asarray(picked, dtype=np.int64)
    n = len(picked)
    offsets = np.asarray(trace.offsets, dtype=np.int64)
    prompt = np.asarray(trace.prefill_len, dtype=np.int64)[picked]
    if np.any(prompt < 1):
        bad = int(picked[np.argmax(prompt < 1)])
        raise TraceError(f"request {bad} of the trace has prefill_len {trace.prefill_len[bad]}; every request needs a "
                         "prompt token.")
    generated = (offsets[picked + 1] - offsets[picked]) - prompt
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
    row_start = offsets[picked] - offsets[0]
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
        experts=np.asarray(trace.experts[offsets[0] : offsets[-1]]),
        token_ids=np.asarray(trace.token_ids[offsets[0] : offsets[-1]]),
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
    times = np.asarray(arrival_times, dtype=np.float64)
    if times.ndim != 1 or len(times) < 1 or not np.all(np.isfinite(times)) or np.any(times < 0) or times.max() <= 0:
        raise ConfigError("arrival_times must be one finite time >= 0 per request with a positive last one.")
    return times * (len(times) / times.max())


def requests_at(rate: float, sim: dict, duration_s: float | None = None) -> int:
    """Requests offered at `rate`: max(min_requests, ceil(rate x duration_s)) (sim.duration_s when not given)."""
    duration_s = sim["duration_s"] if duration_s is None else duration_s
    return max(int(sim["min_requests"]), math.ceil(rate * duration_s - 1e-9))


def draw_requests(num_requests: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """int64[size] trace requests to serve: consecutive independent permutations of all `num_requests`, cut to
    `size`. Without replacement while the trace suffices, and beyond it every prefix holds each request
    floor(n / R) or ceil(n / R) times: a seed changes the order, never the workload's length mix beyond one
    partial permutation (heavy-tailed prompts drawn with replacement made it the largest noise between seeds)."""
    blocks = -(-size // num_requests)
    return np.concatenate([g.permutation(num_requests) for g in rng.spawn(blocks)])[:size]


@dataclass
class Pool:
    """One seed's requests and arrival pattern: rate r serves the first n(r) of them."""

    requests: Requests
    pattern: np.ndarray  # float64[R] unit-rate arrival times
    picked: np.ndarray  # int64[R] trace request of each
    decode_routing: str
    output_source: str


def _pool(trace: RoutingTrace, sim: dict, size: int, rng: np.random.Generator,
          arrival_times: np.ndarray | None) -> Pool:
    rng_arrival, rng_sample, rng_output, rng_decode = rng.spawn(4)
    if sim["arrival"] == "given":
        if arrival_times is None:
            raise ConfigError("sim.arrival=given needs arrival_times (seconds per request) passed to simulate.")
        size = len(arrival_times)
        if size > trace.num_requests:
            raise ConfigError(f"{size} arrival_times for a trace of {trace.num_requests} requests; pass at most one "
                              "per trace request.")
        picked = np.arange(size)
    else:
        picked = draw_requests(trace.num_requests, size, rng_sample)
    requests, decode_routing, source = build_requests(trace, picked, sim["output_len"], sim["decode_routing"],
                                                      rng_output, rng_decode)
    pattern = unit_rate_pattern(sim["arrival"], size, rng_arrival, arrival_times)
    return Pool(requests, pattern, picked, decode_routing, source)


class _Runner:
    """Runs (and caches) one seed's simulations of one plan: rate -> rate_row with the SLO flags. A run doubles its
    arrivals until its window has converged (metrics.steady_state), up to sim.max_duration_s of arrivals."""

    def __init__(self, engine: Engine, pool: Pool, sim: dict, layer_ids, seed: int, plan: str):
        self.engine, self.pool, self.sim, self.layer_ids, self.seed = engine, pool, sim, layer_ids, seed
        self.plan = plan  # "plan" (the system measured) or "reference" (vanilla EP serving for the SLO)
        self.cache: dict[float, dict] = {}
        self.latency: dict[float, dict] = {}  # window requests' latencies (reference runs keep them for the SLO)
        self.layers: dict[float, list[dict]] = {}
        self.batch: dict[float, np.ndarray] = {}  # window requests' batch of arrival
        self.log: list[dict] = []
        self.slo: dict | None = None

    def measure(self, rate: float, role: str) -> dict:
        """The row of one rate. A grid or reference run lengthens until its estimates converge; a bisection probe
        only until the decisions it is asked for are settled (every rule's comparison with its SLO, the queue's
        stability: a sequential test), or until either happens at sim.max_duration_s."""
        rate = float(rate)
        if rate in self.cache:
            return self.cache[rate]
        sim, pool = self.sim, self.pool
        given = sim["arrival"] == "given"
        n = len(pool.pattern) if given else requests_at(rate, sim)
        last: dict = {}

        def run_n(requests: int) -> dict:
            last["run"], row, last["window"] = self._run(rate, requests)
            last["latency"], last["batch"] = self._window_latency(last["run"], last["window"])
            return row

        def enough(row: dict) -> bool:
            if self.slo is None or role != "bisect":
                return row["converged"]
            self._flag(row, last["latency"], last["batch"])
            return row["converged"] or all(row[f"settled_{rule}"] for rule in RULES)

        cap = n if given else requests_at(rate, sim, sim["max_duration_s"])
        row, extensions = run_until_converged(run_n, n, cap, enough)
        run = last["run"]
        n = len(run.arrival)
        prompt = pool.requests.prompt_len[:n]
        row.update(seed=self.seed, plan=self.plan, role=role, distinct_prompts=int(len(np.unique(pool.picked[:n]))),
                   extensions=extensions, arrivals_span_s=float(run.arrival.max()),
                   prompt_tokens_mean=float(prompt.mean()), prompt_tokens_p99=float(np.percentile(prompt, 99)))
        self.latency[rate], self.batch[rate] = last["latency"], last["batch"]
        if self.slo is not None:
            self._flag(row, last["latency"], last["batch"])
        self.cache[rate] = row
        self.layers[rate] = layer_rows(rate, run, self.layer_ids)
        self.log.append(row)
        return row

    def _window_latency(self, run, window) -> tuple[dict, np.ndarray]:
        """({"ttft", "tpot", "e2e"}: float64[W] latencies of the window's W requests, int64[W] their batches)."""
        inside = window_requests(run.arrival, window)
        latency = request_latencies(run, self.pool.requests.output_len[:len(run.arrival)])
        batch = batch_of_arrival(run.arrival, window, self.sim["batches"])[inside]
        return {k: v[inside] for k, v in latency.items()}, np.maximum(batch, 0)

    def _run(self, rate: float, n: int):
        sim, req = self.sim, self.pool.requests
        arrivals = self.pool.pattern[:n] / rate
        last = float(arrivals.max())
        window = (float(sim["warmup_s"]), last - float(sim["cooldown_s"]))
        if window[1] <= window[0]:
            raise ConfigError(
                f"at {rate:g} req/s the arrivals end at {last:.4g} s, before the measurement window [warmup_s="
                f"{sim['warmup_s']}, last arrival - cooldown_s={sim['cooldown_s']}] opens; raise sim.duration_s or "
                "sim.min_requests, or lower warmup_s / cooldown_s."
            )
        run = self.engine.run(arrivals, until=last + float(sim["drain_s"]), window=window)
        row = rate_row(rate, run, req.prompt_len, req.output_len, window, sim["stable_tolerance"], sim["batches"],
                       sim["rel_halfwidth"])
        return run, row, window

    def _flag(self, row: dict, latency: dict, batch: np.ndarray) -> None:
        """Each rule's verdict at this rate (meets_*) and whether the window settles it (settled_*: the interval
        of the compared estimate lies on one side of the SLO or is within rel_halfwidth; a statistic other than
        the mean, which has no batch-means interval here, needs the run converged)."""
        slo, sim = self.slo, self.sim
        stat, tol = sim["slo"]["statistic"], sim["rel_halfwidth"]
        need_stable = sim["slo"]["require_stable"]
        steady = (row["stable"] and row["unfinished"] == 0) or not need_stable
        failed_by_queue = need_stable and row["stability"] == "unstable" and row["stability_settled"]
        # DistServe's rule: the share of window requests meeting both TTFT and TPOT (a one-token one meets TPOT)
        ok = (latency["ttft"] <= slo["ttft"]) & (np.isnan(latency["tpot"]) | (latency["tpot"] <= slo["tpot"]))
        row["attainment"], row["attainment_halfwidth"] = share_interval(ok, batch, sim["batches"])
        for name in ("ttft", "e2e"):
            row[f"meets_{name}_slo"] = bool(steady and row[f"{name}_{stat}_s"] <= slo[name])
            compared = (decided(row[f"{name}_batch_mean_s"], row[f"{name}_halfwidth_s"], slo[name], tol)
                        if stat == "mean" else row["converged"])
            row[f"settled_{name}"] = bool(failed_by_queue or (row["stability_settled"] and compared))
        row["meets_distserve_slo"] = bool(steady and row["attainment"] >= sim["slo"]["attainment"])
        row["settled_distserve"] = bool(failed_by_queue or (row["stability_settled"] and decided(
            row["attainment"], row["attainment_halfwidth"], sim["slo"]["attainment"], tol)))
        row["meets_capacity"] = bool(row["stable"] and row["unfinished"] == 0)
        row["settled_capacity"] = bool(row["stability_settled"])

    def set_slo(self, slo: dict) -> None:
        self.slo = slo
        for rate, row in self.cache.items():
            self._flag(row, self.latency[rate], self.batch[rate])


def _same_plan(plan: Plan, other: Plan) -> bool:
    """Whether two plans schedule alike: both the base Plan (no scheduler of their own) with one placement."""
    return (type(plan) is Plan and type(other) is Plan and plan.parallel == other.parallel
            and np.array_equal(plan.placement.physical_to_logical, other.placement.physical_to_logical))


@dataclass
class _Setup:
    """What every seed's work needs (inherited by forked workers: nothing here is pickled)."""

    plan: Plan
    reference_plan: Plan
    trace: RoutingTrace
    sim: dict
    size: int
    cost: CostModel
    engine_config: EngineConfig
    arrival_times: np.ndarray | None
    light_rate: float
    grid: np.ndarray


def _runners(setup: _Setup, seed: int, seed_seq: np.random.SeedSequence) -> tuple[_Runner, _Runner]:
    """(the plan's runner, the SLO reference's runner: the same one when the reference is the plan) of one seed.
    The seed's requests come from a fresh copy of its SeedSequence (spawning advances a sequence: both phases, in
    this process or a forked one, must draw the very same pool)."""
    fresh = np.random.SeedSequence(seed_seq.entropy, spawn_key=seed_seq.spawn_key, pool_size=seed_seq.pool_size)
    pool = _pool(setup.trace, setup.sim, setup.size, np.random.default_rng(fresh), setup.arrival_times)
    layer_ids = setup.trace.meta.layer_ids
    engine = Engine(setup.plan, pool.requests, setup.cost, dispatch_slots(setup.plan.placement), setup.engine_config)
    runner = _Runner(engine, pool, setup.sim, layer_ids, seed, "plan")
    if setup.reference_plan is setup.plan:
        return runner, runner
    ref_engine = Engine(setup.reference_plan, pool.requests, setup.cost, dispatch_slots(setup.reference_plan.placement),
                        setup.engine_config)
    return runner, _Runner(ref_engine, pool, setup.sim, layer_ids, seed, "reference")


def _seed_work(setup: _Setup, seed: int, seed_seq: np.random.SeedSequence, slo: dict | None,
               light: dict | None = None, anchors: dict | None = None) -> dict:
    """One seed's runs: they depend on no other seed's but through `anchors` (so seeds may run in parallel
    processes, with the same numbers). slo None: the SLO reference's light-load run only (`light`, its result, is
    reused when the reference is the plan). Else: seed 0 runs the rate grid (the per-rate table) and bisects each
    rule along it; a later seed gallops from `anchors` ({rule: seed 0's crossing}) along a ladder of rel_tol steps,
    and a rule seed 0 did not bracket from the crossing this seed found before, else along the grid. Midpoints and
    ladders lie on one lattice grid[0] x (1 + rel_tol)^k, so the rules and seeds share rates."""
    runner, reference = _runners(setup, seed, seed_seq)
    if slo is None:
        reference.measure(setup.light_rate, "reference")
        rate = setup.light_rate
        return {"row": reference.cache[rate], "latency": reference.latency[rate], "batch": reference.batch[rate],
                "layers": reference.layers[rate], "log": reference.log}
    if light is not None and reference is runner:
        rate = setup.light_rate
        runner.cache[rate], runner.latency[rate], runner.layers[rate] = dict(light["row"]), light["latency"], light["layers"]
        runner.batch[rate] = light["batch"]
    runner.set_slo(slo)
    tol = setup.sim["slo"]["rel_tol"]
    if seed == 0:
        for rate in setup.grid:
            runner.measure(rate, "grid")
    found, lowest, highest = {}, float(setup.grid[0]), float(setup.grid[-1])
    for rule in RULES:
        key = "meets_capacity" if rule == "capacity" else f"meets_{rule}_slo"
        # seeds and rules cross near each other: start next to a crossing already found
        near = [f["low"] for f in found.values() if f["bracketed"] and f["low"] > 0]
        near = [anchors[rule]] if anchors and anchors.get(rule) else near
        rates, start = (lattice_ladder(near[-1], lowest, highest, tol) if near else (setup.grid, 0))
        found[rule] = bisect_rate(lambda r, k=key: runner.measure(r, "bisect")[k], rates, tol, start, lattice=lowest)
        found[rule]["window_throughput"] = runner.cache[found[rule]["low"]]["throughput_rps"] \
            if found[rule]["low"] > 0 else 0.0
        deciding = [runner.cache[r] for r in _deciding_rates(found[rule], lowest)]
        found[rule]["converged"] = all(row[f"settled_{rule}"] for row in deciding)
        # an SLO on a statistic without a batch-means interval (p50, p90, p99) settles only on a converged run
        latency_slos = {"ttft": slo["ttft"], "e2e": slo["e2e"]} if setup.sim["slo"]["statistic"] == "mean" else {}
        thresholds = dict(latency_slos, attainment=setup.sim["slo"]["attainment"])
        found[rule]["span_to_settle"] = max(span_to_settle(row, rule, thresholds, setup.sim["stable_tolerance"],
                                                           setup.sim["rel_halfwidth"]) for row in deciding)
    pool = runner.pool
    return {"seed": seed, "cache": runner.cache, "latency": runner.latency, "layers": runner.layers,
            "log": runner.log, "found": found, "distinct": int(len(np.unique(pool.picked))),
            "decode_routing": pool.decode_routing, "output_source": pool.output_source}


def lattice_ladder(rate: float, lowest: float, highest: float, rel_tol: float) -> tuple[np.ndarray, int]:
    """(rates float64[n], index of the one nearest `rate`): the lattice lowest x (1 + rel_tol)^k within [lowest,
    highest], computed as bisect_rate snaps its midpoints, bit for bit (so that cached runs are found again)."""
    step = float(np.log1p(rel_tol))
    top = math.floor(math.log(highest / lowest) / step + 1e-9)
    k = int(np.clip(np.round(np.log(rate / lowest) / step), 0, top))
    return lowest * np.exp(step * np.arange(top + 1, dtype=np.float64)), k


def _deciding_rates(found: dict, lowest: float) -> list[float]:
    """The rates whose runs decide a bisected rule: the highest meeting rate and the lowest failing one (the lowest
    grid rate's when even it fails)."""
    rates = [found["low"] if found["low"] > 0 else lowest]
    if np.isfinite(found["high"]) and found["high"] != rates[0]:
        rates.append(found["high"])
    return rates


_FORKED: _Setup | None = None  # the setup a forked worker inherits


def _forked_seed_work(seed: int, seed_seq: np.random.SeedSequence, slo: dict | None, light: dict | None,
                      anchors: dict | None) -> dict:
    return _seed_work(_FORKED, seed, seed_seq, slo, light, anchors)


def _anchors(seed0: dict) -> dict:
    """{rule: seed 0's crossing} where seed 0 bracketed one: where later seeds start their searches."""
    return {rule: f["low"] for rule, f in seed0["found"].items() if f["bracketed"] and f["low"] > 0}


def seed_workers(workers: int | str) -> int:
    """sim.workers as a process count: `auto` is the number of CPUs this process may run on (its affinity). Under
    make reproduce's two streams that oversubscribes while both run, which costs a little switching and no result;
    it lets the stream that finishes last use every core."""
    if workers != "auto":
        return int(workers)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _each_seed(setup: _Setup, seed_seqs: list, slo: dict | None, workers: int, light: list | None = None,
               first_seed: int = 0, anchors: dict | None = None) -> list[dict]:
    """_seed_work of seeds first_seed, first_seed + 1, ... (one per seed_seqs entry), in seed order: in this
    process, or in `workers` forked processes. With SLOs, seed 0 first (its crossings anchor the others' searches),
    then the rest; later batches (first_seed > 0) take seed 0's `anchors`."""
    light = light or [None] * len(seed_seqs)
    first = []
    if slo is not None and first_seed == 0:
        first = [_seed_work(setup, 0, seed_seqs[0], slo, light[0])]
        anchors = _anchors(first[0])
    todo = list(range(len(first), len(seed_seqs)))
    if workers <= 1 or len(todo) <= 1:
        return first + [_seed_work(setup, first_seed + i, seed_seqs[i], slo, light[i], anchors) for i in todo]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    global _FORKED
    _FORKED = setup
    try:
        with ProcessPoolExecutor(min(workers, len(todo)), mp_context=multiprocessing.get_context("fork")) as pool:
            return first + list(pool.map(_forked_seed_work, [first_seed + i for i in todo], [seed_seqs[i] for i in todo],
                                         [slo] * len(todo), [light[i] for i in todo], [anchors] * len(todo)))
    finally:
        _FORKED = None


def seeds_settled(seeds: list[dict], rel_halfwidth: float) -> bool:
    """Whether adding seeds would change nothing worth their cost: True when some seed's value of a settling rule
    (capacity, TTFT-SLO throughput) is unconverged or 0 (more seeds cannot fix that), or when every settling rule's
    per-seed values have a 95 % Student-t half-width <= rel_halfwidth x their mean.

    Why a system's own spread: the paired ratio against another system run on the same seeds has a half-width of
    at most sqrt(2) x the larger of the two when their per-seed values are not negatively correlated (the same
    arrivals and requests make them positively correlated in practice), so rel_halfwidth 0.02 keeps a paired
    ratio within about +-5 % after the report widens it by slo.rel_tol 0.02 (repro.sim.metrics.ratio_interval)."""
    for rule in SETTLING_RULES:
        found = [seed["found"][rule] for seed in seeds]
        values = np.array([f["low"] for f in found], dtype=np.float64)
        if not all(f["converged"] for f in found) or np.any(values <= 0):
            return True
        if len(values) < 2:
            return False
        half = scipy_stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
        if half > rel_halfwidth * values.mean():
            return False
    return True


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (forked seed workers)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def simulate(config: dict, plan: Plan, trace: RoutingTrace, hardware: dict, shape: dict, rng: np.random.Generator,
             *, arrival_times: np.ndarray | None = None, progress: bool = False) -> SimResult:
    """Measure `plan` on `trace` in steady state (see the module docstring); same inputs, same numbers."""
    started, cpu_started = time.perf_counter(), _cpu_seconds()
    sim = check_sim_config(config.get("sim") or {})
    model = ModelShape.from_config(shape)
    hw = load_hardware(hardware, alternative=sim["calibration"])
    mapping = routing_map(model, trace, sim["routing_map"])
    _check_fit(plan, trace, hw)
    parallel = plan.parallel
    slo_cfg, stat = sim["slo"], sim["slo"]["statistic"]
    grid = np.asarray(sim["rates"], dtype=np.float64)
    light_rate = float(slo_cfg["light_rate"] or grid[0])
    size = max(requests_at(float(grid[-1]), sim, sim["max_duration_s"]),
               requests_at(light_rate, sim, sim["max_duration_s"]))
    capacity = sim.get("kv_capacity_tokens") or kv_capacity(model, hw, parallel.devices, parallel.attention)
    cost = CostModel(model, hw, mapping, parallel.devices, parallel.attention, sim["backend"])
    engine_config = EngineConfig(sim["max_batched_tokens"], sim["max_running_requests"], sim["schedule"], int(capacity),
                                 sim["max_block_iterations"], iteration_overhead(sim, hw),
                                 int(config.get("history", 2)))
    derive = [name for name in ("ttft", "tpot", "e2e") if slo_cfg[f"{name}_s"] is None]
    reference_plan = plan
    if derive and slo_cfg["reference"] == "ep":
        from repro.systems.ep import VanillaEP

        fitted = VanillaEP().fit(trace, parallel, np.random.default_rng(0))  # contiguous blocks: no randomness used
        reference_plan = plan if _same_plan(plan, fitted) else fitted
    setup = _Setup(plan, reference_plan, trace, sim, size, cost, engine_config, arrival_times, light_rate, grid)
    seed_seqs = [g.bit_generator.seed_seq for g in rng.spawn(sim["seeds"])]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="simulate seeds", unit="seed", total=2 * sim["seeds"] if derive else sim["seeds"])

    # the SLOs, fixed before any bisection: multiplier x the reference's statistic at the light rate, seeds pooled
    workers = seed_workers(sim["workers"])
    light = _each_seed(setup, seed_seqs, None, workers) if derive else []
    if bar is not None:
        bar.update(len(light))
    slo = {}
    for name in ("ttft", "tpot", "e2e"):
        if slo_cfg[f"{name}_s"] is not None:
            slo[name] = float(slo_cfg[f"{name}_s"])
            continue
        pooled = np.concatenate([seed_light["latency"][name] for seed_light in light])
        slo[name] = float(slo_cfg["multiplier"] * statistic(pooled, stat))
    seeds = _each_seed(setup, seed_seqs, slo, workers, light)
    if bar is not None:
        bar.update(len(seeds))
    until = sim["seeds_until"]
    while until and len(seeds) < until["max_seeds"] and not seeds_settled(seeds, until["rel_halfwidth"]):
        # rng.spawn continues the same sequence of children: seed i is the same whether it came first or was added
        more = [g.bit_generator.seed_seq for g in rng.spawn(min(until["step"], until["max_seeds"] - len(seeds)))]
        if bar is not None:  # the seeds added count too
            bar.total += len(more)
            bar.refresh()
        seeds += _each_seed(setup, more, slo, workers, first_seed=len(seeds), anchors=_anchors(seeds[0]))
        if bar is not None:
            bar.update(len(more))
    if bar is not None:
        bar.close()

    per_rate = pd.DataFrame([row for seed in seeds for _, row in sorted(seed["cache"].items())])
    per_layer = pd.DataFrame([dict(row, seed=0) for rate in grid for row in seeds[0]["layers"][float(rate)]])
    probes = pd.DataFrame([row for part in light + seeds for row in part["log"]])
    results = {rule: [seed["found"][rule] for seed in seeds] for rule in RULES}
    summary = _summary(sim, slo, stat, light_rate, results, per_rate, probes, seeds, trace, hw, model, mapping,
                       parallel, capacity, reference_plan is plan, time.perf_counter() - started,
                       _cpu_seconds() - cpu_started)
    return SimResult(summary, per_rate, per_layer, probes, request_table(seeds))


def request_table(seeds: list[dict]) -> pd.DataFrame:
    """Per-request latencies of every run of the measured plan, window requests only (the ones its statistics are
    over): rate, seed, role (grid / bisect / reference), ttft_s, tpot_s, e2e_s (inf: unfinished when the run
    stopped; tpot NaN for one-token outputs), in_window (always true here; repro.figures.table2 reads it)."""
    frames = [pd.DataFrame({"rate": rate, "seed": seed["seed"], "role": seed["cache"][rate]["role"],
                            "ttft_s": latency["ttft"], "tpot_s": latency["tpot"], "e2e_s": latency["e2e"],
                            "in_window": True})
              for seed in seeds for rate, latency in sorted(seed["latency"].items())]
    columns = ["rate", "seed", "role", "ttft_s", "tpot_s", "e2e_s", "in_window"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


def _finite(value: float) -> float | None:
    """The value, or None (JSON null) where it is not finite: metrics.json holds strict JSON."""
    return float(value) if np.isfinite(value) else None


def _summary(sim, slo, stat, light_rate, results, per_rate, probes, seeds, trace, hw, model, mapping, parallel,
             capacity, reference_is_plan, wall, cpu) -> dict:
    slo_cfg, warnings = sim["slo"], []
    names = {"ttft": "the paper's TTFT rule", "e2e": "the paper's E2E rule", "distserve": "DistServe's rule",
             "capacity": "queue stability"}
    for rule, found in results.items():
        lows = [f["low"] for f in found]
        if min(lows) == 0.0:
            warnings.append(f"under {names[rule]} even the lowest rate {sim['rates'][0]:g} req/s fails on "
                            f"{lows.count(0.0)} of {len(lows)} seeds; its throughput is reported as 0 there.")
        if not all(f["bracketed"] for f in found):
            warnings.append(f"under {names[rule]} the highest rate {sim['rates'][-1]:g} req/s still passes on some "
                            "seeds; the value there is a lower bound (raise sim.rates).")
    seed0 = per_rate[(per_rate["seed"] == 0) & per_rate["rate"].isin(sim["rates"])]
    lightest, heaviest = seed0.iloc[0], seed0.iloc[-1]
    stable = seed0[seed0["stable"]]
    busiest = stable.iloc[-1] if len(stable) else lightest  # the heaviest stable grid rate: steady-state batches
    first = seeds[0]
    prompts = np.asarray(trace.prefill_len, dtype=np.float64)
    reference = "given" if not any(slo_cfg[f"{n}_s"] is None for n in ("ttft", "tpot", "e2e")) else (
        "self" if slo_cfg["reference"] == "self" else "ep" + (" (this plan)" if reference_is_plan else ""))
    summary = {
        "sim_time_basis": ("calibrated: " + ", ".join(hw.calibrated_parts)) if hw.calibrated_parts else
        "uncalibrated (roofline compute, all-to-all fitted to published curves); compare systems, not seconds",
        "sim_calibrated_parts": list(hw.calibrated_parts),
        "sim_hardware": hw.name,
        "sim_calibration": hw.calibration,
        "sim_iteration_overhead_us": iteration_overhead(sim, hw) * 1e6,
        "sim_shape": model.name,
        "sim_routing_source": f"{trace.meta.source or 'unknown'}:{trace.meta.model}:{trace.meta.dataset}",
        "sim_routing_map": mapping.description,
        "sim_decode_routing": first["decode_routing"],
        "sim_output_len_source": first["output_source"],
        "sim_arrival": sim["arrival"],
        "sim_backend": sim["backend"],
        "sim_schedule": sim["schedule"],
        "sim_attention": parallel.attention,
        "sim_devices": parallel.devices,
        "sim_seeds": len(seeds),  # sim.seeds, plus those sim.seeds_until added
        "sim_seeds_added": len(seeds) - sim["seeds"],
        "sim_seeds_settled": bool(seeds_settled(seeds, sim["seeds_until"]["rel_halfwidth"]))
        if sim["seeds_until"] else None,  # false: the cap sim.seeds_until.max_seeds was hit first
        "sim_duration_s": float(sim["duration_s"]),
        "sim_warmup_s": float(sim["warmup_s"]),
        "sim_cooldown_s": float(sim["cooldown_s"]),
        "sim_drain_s": float(sim["drain_s"]),
        "sim_stable_tolerance": float(sim["stable_tolerance"]),
        "sim_num_requests": int(probes["requests_total"].sum()),  # simulated requests, all runs
        "sim_requests_per_rate": [int(r) for r in seed0["requests_total"]],
        "sim_trace_requests": trace.num_requests,
        "sim_distinct_prompts": int(max(seed["distinct"] for seed in seeds)),  # in the largest run of a seed
        "sim_sampling": "trace order (given arrivals)" if sim["arrival"] == "given" else
        "consecutive permutations of the trace's requests (without replacement while they suffice)",
        "sim_trace_prompt_tokens_mean": float(prompts.mean()),
        "sim_trace_prompt_tokens_p99": float(np.percentile(prompts, 99)),
        "sim_drawn_prompt_tokens_mean_per_seed": [float(per_rate.loc[per_rate["seed"] == seed["seed"],
                                                                     "prompt_tokens_mean"].mean()) for seed in seeds],
        "sim_drawn_prompt_tokens_p99_per_seed": [float(per_rate.loc[per_rate["seed"] == seed["seed"],
                                                                    "prompt_tokens_p99"].mean()) for seed in seeds],
        "sim_batches": int(sim["batches"]),
        "sim_rel_halfwidth": float(sim["rel_halfwidth"]),
        "sim_max_duration_s": float(sim["max_duration_s"]),
        "sim_workers": seed_workers(sim["workers"]),
        "sim_kv_capacity_tokens": int(capacity),
        "sim_rates": [float(r) for r in sim["rates"]],
        "sim_runs": len(probes),
        "slo_statistic": stat,
        "slo_reference": reference,
        "slo_light_rate_rps": light_rate,
        "slo_multiplier": float(slo_cfg["multiplier"]),
        "slo_ttft_s": slo["ttft"],
        "slo_e2e_s": slo["e2e"],
        "slo_tpot_s": slo["tpot"],
        "slo_rel_tol": float(slo_cfg["rel_tol"]),
        "slo_require_stable": bool(slo_cfg["require_stable"]),
        "goodput_attainment_target": slo_cfg["attainment"],
    }
    # Throughput under a rule: the highest rate meeting it. With require_stable that rate's queue keeps up, so its
    # steady-state throughput is the rate itself; the window's measured completions (a few % short near the knee,
    # where a short window still sees the running set fill) are reported beside it. Without it: the measured one.
    keys = {"ttft": "throughput_under_ttft_slo_rps", "e2e": "throughput_under_e2e_slo_rps",
            "distserve": "goodput_distserve_rps", "capacity": "capacity_rps"}
    summary["throughput_under_slo_basis"] = ("highest rate meeting the rule (stable queue: throughput = rate)"
                                             if slo_cfg["require_stable"] else "window throughput at that rate")
    for rule, found in results.items():
        rates = [float(f["low"]) for f in found]
        measured = [float(f["window_throughput"]) for f in found]
        headline = rates if slo_cfg["require_stable"] else measured
        summary[keys[rule]] = float(np.mean(headline))
        summary[keys[rule] + "_per_seed"] = headline
        summary[f"rate_{rule}_rps_per_seed"] = rates
        summary[f"rate_{rule}_fails_rps_per_seed"] = [_finite(f["high"]) for f in found]  # null: none failed
        summary[f"window_throughput_{rule}_rps_per_seed"] = measured
        summary[f"bracketed_{rule}"] = bool(all(f["bracketed"] for f in found))
        summary[f"converged_{rule}_per_seed"] = [bool(f["converged"]) for f in found]
        summary[f"converged_{rule}"] = bool(all(f["converged"] for f in found))
        # what a longer cap would buy: the arrivals span at which the deciding runs would settle (an extrapolation)
        summary[f"arrivals_to_settle_{rule}_s_per_seed"] = [_finite(f["span_to_settle"]) for f in found]
    # nothing downstream may treat a rule's value as converged unless the runs deciding it settled it on every seed
    settled = probes[[f"settled_{rule}" for rule in RULES]].fillna(False).astype(bool).all(axis=1) \
        if f"settled_{RULES[0]}" in probes else False
    unconverged = probes[~(probes["converged"].astype(bool) | settled)]
    summary["sim_converged"] = bool(all(summary[f"converged_{rule}"] for rule in RULES))
    summary["sim_runs_converged"] = int(len(probes) - len(unconverged))  # estimates converged, or every rule settled
    summary["sim_unconverged_runs"] = [f"{row.plan} seed {row.seed} at {row.rate:.6g} req/s ({row.stability})"
                                       for row in unconverged.itertuples()]
    summary["sim_extensions"] = int(probes["extensions"].sum())
    for rule in RULES:
        if not summary[f"converged_{rule}"]:
            seeds_left = [s for s, ok in enumerate(summary[f"converged_{rule}_per_seed"]) if not ok]
            spans = ", ".join(f"{results[rule][s]['span_to_settle']:.3g}" for s in seeds_left)
            warnings.append(f"under {names[rule]} the runs deciding the rate of seed(s) {seeds_left} did not settle "
                            f"it within sim.max_duration_s={sim['max_duration_s']:g} s of arrivals; that value is "
                            f"unconverged (raise max_duration_s: at their present estimates, with half-widths "
                            f"shrinking as 1/sqrt(arrivals), they would settle at about {spans} s of arrivals, though "
                            "longer runs may move the crossing to a rate nearer its SLO).")
    summary["goodput_distserve_bracketed"] = summary["bracketed_distserve"]
    summary.update({
        "a2a_share_lightest": float(lightest["a2a_share"]),
        "a2a_share_heaviest": float(heaviest["a2a_share"]),
        "moe_layer_s_lightest": float(sum(lightest[f"moe_{c}_s"] for c in ("gate", "dispatch", "experts", "combine"))),
        "sim_heaviest_stable_rate_rps": float(busiest["rate"]),
    })
    for phase in ("prefill", "decode"):  # Fig. 1 for both kinds of iteration, lightest and heaviest stable rate
        for label, row in (("lightest", lightest), ("heaviest_stable", busiest)):
            # null: no such iteration in the window (at high load every mixed batch holds a prefill chunk)
            for column in (f"moe_layer_{phase}_s", f"a2a_share_{phase}", f"tokens_per_{phase}_iteration"):
                summary[f"{column}_{label}"] = _finite(row[column])
    summary.update({
        "ttft_p99_s_lightest": float(lightest["ttft_p99_s"]),
        "e2e_p50_s_lightest": float(lightest["e2e_p50_s"]),
        "lar_sim": float(np.average(per_rate["lar"])),
        "sim_wall_s": wall,
        "sim_cpu_s": cpu,
        # simulated time of every run (the SLO reference's light runs included): arrivals span plus the drain
        "sim_simulated_s": float((probes["arrivals_span_s"] + float(sim["drain_s"])).sum()),
        "sim_iterations": int(probes["iterations"].sum()),
        "sim_requests_per_wall_s": float(probes["requests_total"].sum()) / wall,
        "sim_events_per_wall_s": float(probes["iterations"].sum() + probes["requests_total"].sum()) / wall,
        "warnings": warnings,
    })
    for name in LATENCIES:  # keep the statistic a reader compares the SLO with beside it
        summary[f"{name}_{stat}_s_lightest"] = float(lightest[f"{name}_{stat}_s"])
    return summary


__all__ = ["SimResult", "check_sim_config", "simulate"]
