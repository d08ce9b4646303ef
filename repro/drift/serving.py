"""The drift experiment's serving pass: every policy's plan changes replayed in the serving simulator (repro.sim.engine),
so the series show what re-placement does to latency, beside the offline per-window scoring (repro.drift.timeline).

    setup = serving_setup(config, stream)                       # rate, SLOs, the served arrivals (once per job)
    served = serve_policy(setup, first_plan, [(w, plan, mode), ...], mode)  # one policy's run and its series

The served stream (same for every policy: paired). Window w of the drift stream stands for `drift.serving.window_s`
seconds of arrivals, [w T, (w + 1) T): Poisson arrivals at the serving rate, each one of window w's requests
(consecutive seeded permutations of them, repro.sim.simulate.draw_requests: every request of the window about
equally often), its output length and decode routing as the suite's simulator builds them (sim.output_len,
sim.decode_routing; repro.sim.simulate.build_requests). The profile's requests are not served.

The rate. `drift.serving.rate_rps` when given; else `drift.serving.load` x the static vanilla-EP plan's capacity
(fitted on the profile), estimated as its saturated throughput: a flood of 4 x D x sim.max_running_requests
profile requests arriving at once, counting the middle half of the completions over the time they take.

The SLOs, the suite's rule (repro/sim/simulate.py): sim.slo.multiplier x the static vanilla-EP plan's
sim.slo.statistic of TTFT and of TPOT at the light rate (sim.slo.light_rate, else the lowest of sim.rates), served
with max(sim.min_requests, ceil(light rate x sim.duration_s)) profile requests, over the window [sim.warmup_s,
last arrival - sim.cooldown_s]; sim.slo.ttft_s / tpot_s set a value directly. A request attains the SLOs when its
TTFT and its TPOT are within them (DistServe's rule; a one-token output has no TPOT and passes on TTFT).

When a change is asked for. A policy decides after window w on that window's routing (and earlier windows'), as
the offline pass did (the same decisions, the same plans). Online, window w's routing is known once its last
request has finished: the change is asked for then, at the time that request finishes in this very run, and no
earlier than the change before it. The engine (Engine.run changes, repro/sim/plan_changes.py) begins it at the next
iteration boundary and serves the new plan once its migration ends: a sync one stalls every rank for its stall,
an async one takes `drift.migration.bandwidth_share` of every link meanwhile. Since the asked times depend on the
run, they are found by a fixed point: guessed from the run without changes, then, while some change is asked
before its window's last request finished in the run with the changes, moved to that finish and the run repeated
(times only move later, so a change may end up asked somewhat after its window's last finish, when an earlier
guess's stall had pushed that finish later; the run reported is one in which every change was asked only after its
window's routing was all served: the check is exact because a run is causal).

Per-window series (one row per policy and window; window w = simulated time [w T, (w + 1) T), the last one open
to the end of the run): TTFT and TPOT mean and p99 and SLO attainment of the requests arriving in it; migrations
that began in it (count, stall seconds, experts moved) and the seconds of it a migration was running; and, with
`drift.serving.window_costs`, the all-to-all seconds (dispatch + combine summed over layers) of the iterations
starting in it and the LAR of the activations they served: a run with the horizon at the window's end and its
measurement window on it (Engine.run until / window: a run is causal, so its prefix is the whole run's), the LAR
from the difference of the cumulative counts (an iteration counted at its block's start). Those horizon runs are
shared between policies that serve the same plan and changes up to the horizon.

Legend: R served requests, W windows, K changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from repro.errors import ConfigError, ReproError

SERVING_KEYS = ("enabled", "load", "rate_rps", "window_s", "window_costs", "sim")
SERVING_SUMMARY = ("ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "tpot_p99_s", "slo_attainment", "serving_stall_s",
                   "serving_migrations", "serving_a2a_s", "serving_lar", "serving_asked_after_window_s")
MAX_FIXED_POINT_RUNS = 12  # runs to settle the times changes are asked for (module docstring)
FLOOD_PER_SLOT = 4  # the capacity flood: this many requests per running slot of every rank


def check_serving_config(serving: dict) -> None:
    """One ConfigError sentence for a malformed drift.serving (module docstring)."""
    if not isinstance(serving, dict):
        raise ConfigError(f"drift.serving must be a mapping of {list(SERVING_KEYS)}, got {serving!r}.")
    unknown = sorted(set(serving) - set(SERVING_KEYS))
    if unknown:
        raise ConfigError(f"drift.serving has no key(s) {unknown}; its keys are {list(SERVING_KEYS)}.")
    for key in ("enabled", "window_costs"):
        if not isinstance(serving.get(key, False), bool):
            raise ConfigError(f"drift.serving.{key} must be true or false, got {serving.get(key)!r}.")
    rate, load = serving.get("rate_rps"), serving.get("load")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < math.inf):
        raise ConfigError(f"drift.serving.rate_rps must be null (load x capacity) or requests/s > 0, got {rate!r}.")
    if rate is None and (isinstance(load, bool) or not isinstance(load, int | float) or not 0 < load <= 1):
        raise ConfigError(f"drift.serving.load must be a share of static EP's capacity in (0, 1], got {load!r}.")
    window = serving.get("window_s")
    if isinstance(window, bool) or not isinstance(window, int | float) or not 0 < window < math.inf:
        raise ConfigError(f"drift.serving.window_s must be seconds > 0 of arrivals per window, got {window!r}.")
    if serving.get("enabled"):
        from repro.sim.simulate import check_sim_config

        if not isinstance(serving.get("sim"), dict):
            raise ConfigError("drift.serving.enabled needs drift.serving.sim, the simulator's settings (conf/drift/"
                              "default.yaml composes conf/sim/default.yaml there); or set drift.serving.enabled=false.")
        check_sim_config(serving["sim"])


@dataclass
class ServingSetup:
    """What every policy's serving run shares: the engine's inputs, the served arrivals, the rate and the SLOs.

    arrivals float64[R] seconds (sorted); window_R int64[R] the drift window each request belongs to; requests: the
    engine's Requests (repro.sim.engine); slo {"ttft": s, "tpot": s}."""

    cost: object
    engine_config: object
    hardware: object
    shape: object
    requests: object
    arrivals: np.ndarray
    window_R: np.ndarray
    num_windows: int
    window_s: float
    rate_rps: float
    capacity_rps: float | None
    slo: dict
    info: dict
    migration: dict
    window_costs: bool
    runs: int = 0  # engine runs so far (the policies' runs, fixed points and horizons; not the SLO and capacity runs)
    _horizons: dict = field(default_factory=dict)

    def engine(self, plan):
        from repro.sim.engine import Engine
        from repro.sim.traffic import dispatch_slots

        return Engine(plan, self.requests, self.cost, dispatch_slots(plan.placement), self.engine_config)


def _rng(seed: int, part: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), 34, part])  # 34: the issue; part: which draw


def _light_slo(config: dict, sim: dict, ep_plan, trace, engine_inputs) -> tuple[dict, float]:
    """({"ttft", "tpot"} SLO seconds, the light rate) by the suite's rule (module docstring)."""
    from repro.sim.engine import Engine
    from repro.sim.metrics import request_latencies, statistic, window_requests
    from repro.sim.simulate import build_requests, draw_requests, requests_at
    from repro.sim.traffic import dispatch_slots

    slo_cfg = sim["slo"]
    light = float(slo_cfg["light_rate"] or min(sim["rates"]))
    slo = {name: float(slo_cfg[f"{name}_s"]) for name in ("ttft", "tpot") if slo_cfg[f"{name}_s"] is not None}
    if len(slo) == 2:
        return slo, light
    rng_pick, rng_arrival, rng_out, rng_decode = _rng(config["seed"], 1).spawn(4)
    n = requests_at(light, sim)
    picked = draw_requests(trace.num_requests, n, rng_pick)
    requests, _, _ = build_requests(trace, picked, sim["output_len"], sim["decode_routing"], rng_out, rng_decode)
    cost, engine_config = engine_inputs
    arrivals = np.cumsum(rng_arrival.exponential(1.0 / light, size=n))
    run = Engine(ep_plan, requests, cost, dispatch_slots(ep_plan.placement), engine_config).run(arrivals)
    inside = window_requests(arrivals, (sim["warmup_s"], arrivals[-1] - sim["cooldown_s"]))
    if not inside.any():
        raise ConfigError(f"the light-load SLO run at {light} req/s holds no request in its window [sim.warmup_s, last "
                          "arrival - sim.cooldown_s]; lower sim.warmup_s or raise sim.min_requests.")
    latencies = request_latencies(run, requests.output_len)
    for name in ("ttft", "tpot"):
        if name not in slo:
            slo[name] = float(slo_cfg["multiplier"] * statistic(latencies[name][inside], slo_cfg["statistic"]))
    return slo, light


def _capacity(config: dict, sim: dict, ep_plan, trace, engine_inputs) -> float:
    """Requests/s of static EP saturated: a flood of profile requests at t = 0, middle half of its completions."""
    from repro.sim.engine import Engine
    from repro.sim.simulate import build_requests, draw_requests
    from repro.sim.traffic import dispatch_slots

    cost, engine_config = engine_inputs
    n = FLOOD_PER_SLOT * ep_plan.parallel.devices * int(sim["max_running_requests"])
    rng_pick, rng_out, rng_decode = _rng(config["seed"], 2).spawn(3)
    picked = draw_requests(trace.num_requests, n, rng_pick)
    requests, _, _ = build_requests(trace, picked, sim["output_len"], sim["decode_routing"], rng_out, rng_decode)
    run = Engine(ep_plan, requests, cost, dispatch_slots(ep_plan.placement), engine_config).run(np.zeros(n))
    finish = np.sort(run.finish)
    low, high = finish[n // 4], finish[(3 * n) // 4]
    if not high > low:
        raise ReproError("the capacity flood finished its middle half at one instant; set drift.serving.rate_rps.")
    return float((3 * n) // 4 - n // 4) / float(high - low)


def serving_setup(config: dict, stream, serving: dict) -> ServingSetup:
    """The serving pass's shared inputs for one drift job (module docstring); `stream` is the job's Stream."""
    from repro.sim.costs import CostModel
    from repro.sim.engine import EngineConfig
    from repro.sim.hardware import load_hardware
    from repro.sim.shapes import ModelShape, routing_map
    from repro.sim.simulate import build_requests, check_sim_config, draw_requests, iteration_overhead, kv_capacity
    from repro.systems.ep import VanillaEP

    check_serving_config(serving)
    sim = check_sim_config(serving["sim"])
    parallel = stream.parallel
    model = ModelShape.from_config(serving["sim"]["shape"])
    hw = load_hardware(config["hardware"], alternative=sim["calibration"])
    if parallel.devices > hw.num_devices:
        raise ConfigError(f"parallel.devices={parallel.devices} exceeds the {hw.num_devices} GPUs of hardware {hw.name}.")
    trace = stream.trace
    mapping = routing_map(model, trace, sim["routing_map"])
    capacity_tokens = sim.get("kv_capacity_tokens") or kv_capacity(model, hw, parallel.devices, parallel.attention)
    cost = CostModel(model, hw, mapping, parallel.devices, parallel.attention, sim["backend"])
    engine_config = EngineConfig(sim["max_batched_tokens"], sim["max_running_requests"], sim["schedule"],
                                 int(capacity_tokens), sim["max_block_iterations"], iteration_overhead(sim, hw),
                                 int(config.get("history", 2)))
    ep_plan = VanillaEP().fit(stream.profile, parallel, np.random.default_rng(0))  # contiguous blocks: no randomness
    inputs = (cost, engine_config)
    slo, light = _light_slo(config, sim, ep_plan, stream.profile, inputs)
    capacity = None
    if serving.get("rate_rps") is not None:
        rate = float(serving["rate_rps"])
    else:
        capacity = _capacity(config, sim, ep_plan, stream.profile, inputs)
        rate = float(serving["load"]) * capacity
    window_s, num_windows = float(serving["window_s"]), stream.num_windows
    rng_arrival, rng_pick, rng_out, rng_decode = _rng(config["seed"], 3).spawn(4)
    expected = rate * window_s * num_windows
    gaps = rng_arrival.exponential(1.0 / rate, size=int(expected + 10 * math.sqrt(expected) + 100))
    arrivals = np.cumsum(gaps)
    while arrivals[-1] < window_s * num_windows:  # practically never: the draw above covers 10 sigma
        arrivals = np.concatenate([arrivals, arrivals[-1] + np.cumsum(rng_arrival.exponential(1.0 / rate, size=1000))])
    arrivals = arrivals[arrivals < window_s * num_windows]
    window_R = np.minimum((arrivals // window_s).astype(np.int64), num_windows - 1)
    picked = np.empty(len(arrivals), dtype=np.int64)
    for w, rng in enumerate(rng_pick.spawn(num_windows)):  # W windows: each draws among its own requests
        mine = np.flatnonzero(window_R == w)
        if not len(mine):  # no arrival in this window (a low rate or a short window)
            continue
        first, last = int(stream.bounds[w]), int(stream.bounds[w + 1])
        picked[mine] = first + draw_requests(last - first, len(mine), rng)
    requests, decode_routing, output_source = build_requests(trace, picked, sim["output_len"], sim["decode_routing"],
                                                             rng_out, rng_decode)
    info = {"serving_rate_rps": rate, "serving_load": None if capacity is None else float(serving["load"]),
            "serving_capacity_rps": capacity, "serving_window_s": window_s, "serving_requests": int(len(arrivals)),
            "slo_ttft_s": slo["ttft"], "slo_tpot_s": slo["tpot"], "slo_light_rate_rps": light,
            "slo_rule": f"{sim['slo']['multiplier']} x static EP's {sim['slo']['statistic']} at the light rate",
            "serving_decode_routing": decode_routing, "serving_output_len": output_source,
            "serving_hardware": hw.name}
    return ServingSetup(cost, engine_config, hw, model, requests, arrivals, window_R, num_windows, window_s, rate,
                        capacity, slo, info, dict(config["drift"].get("migration") or {}),
                        bool(serving.get("window_costs", True)))


def _priced(setup: ServingSetup, first, times: list[float], plans: list, mode: str) -> list:
    from repro.sim.plan_changes import priced_changes

    migration = setup.migration
    return priced_changes(first, list(zip(times, plans, strict=True)), setup.shape, setup.hardware, mode,
                          bandwidth_share=float(migration.get("bandwidth_share", 0.25)) if mode == "async" else 1.0,
                          host_seconds=float(migration.get("host_seconds", 0.0)),
                          bytes_per_weight=migration.get("bytes_per_weight"),
                          layer_overhead_s=float(migration.get("layer_overhead_s", 0.0)))


def window_last_finish(setup: ServingSetup, run) -> np.ndarray:
    """float64[W] the time the last request of each window finished in `run` (+inf: one is unfinished; a window
    without arrivals: its end, when its routing, none, is known)."""
    finish = np.where(np.isnan(run.finish), np.inf, run.finish)
    out = np.full(setup.num_windows, -np.inf)
    np.maximum.at(out, setup.window_R, finish)
    return np.where(np.isneginf(out), (np.arange(setup.num_windows) + 1.0) * setup.window_s, out)


def asked_times(setup: ServingSetup, first, decisions: list[tuple[int, object]], mode: str):
    """(run, changes, times) of `first` served with `decisions` [(after window, plan)], each change asked for once
    its window's last request finished in that same run (module docstring: a fixed point)."""
    engine = setup.engine(first)
    last = ((setup.num_windows - 1) * setup.window_s, math.inf)  # the last window's costs come with the run
    run = engine.run(setup.arrivals, window=last)
    setup.runs += 1
    if not decisions:
        return run, [], []
    windows = [w for w, _ in decisions]
    plans = [plan for _, plan in decisions]
    times, changes = [0.0] * len(decisions), None
    for _ in range(MAX_FIXED_POINT_RUNS):
        known = window_last_finish(setup, run)[windows]
        if not np.all(np.isfinite(known)):
            raise ReproError("a window's requests never finished in the serving run; lower drift.serving.load.")
        wanted = []
        for k in range(len(times)):  # no earlier than its window's last finish, nor than the change before it
            wanted.append(max(times[k], float(known[k]), wanted[k - 1] if k else 0.0))
        if changes is not None and wanted == times:
            return run, changes, times
        times = wanted
        changes = _priced(setup, first, times, plans, mode)
        run = engine.run(setup.arrivals, window=last, changes=changes)
        setup.runs += 1
    raise ReproError(f"the times the changes are asked for did not settle in {MAX_FIXED_POINT_RUNS} serving runs; "
                     "lower drift.serving.load or widen drift.serving.window_s.")


def _plan_key(plan) -> tuple:
    return type(plan).__name__, plan.placement.physical_to_logical.tobytes()


def _window_costs(setup: ServingSetup, first, changes: list, times: list[float], run) -> tuple[np.ndarray, np.ndarray]:
    """(a2a seconds float64[W], LAR float64[W]) of the iterations starting in each window (module docstring); `run`
    is the whole run (asked_times), whose measurement window is the last window."""
    from repro.sim.costs import COMPONENTS

    a2a_columns = [COMPONENTS.index("dispatch"), COMPONENTS.index("combine")]
    engine = setup.engine(first)
    a2a, lar = np.zeros(setup.num_windows), np.full(setup.num_windows, np.nan)
    before = (0, 0)
    for w in range(setup.num_windows):
        start, end = w * setup.window_s, (w + 1) * setup.window_s
        last = w == setup.num_windows - 1
        horizon = math.inf if last else end
        asked = [c for c, t in zip(changes, times, strict=True) if t < horizon]
        key = (_plan_key(first), tuple((t, _plan_key(c.plan), c.cost.mode) for c, t in zip(asked, times, strict=False)), w)
        if last:
            setup._horizons[key] = _costs(run, a2a_columns)
        if key not in setup._horizons:
            horizon_run = engine.run(setup.arrivals, until=horizon, window=(start, end), changes=tuple(asked))
            setup.runs += 1
            setup._horizons[key] = _costs(horizon_run, a2a_columns)
        a2a[w], counts = setup._horizons[key]
        local, total = counts[0] - before[0], counts[1] - before[1]
        lar[w] = local / total if total > 0 else np.nan
        before = counts
    return a2a, lar


def _costs(run, a2a_columns: list[int]) -> tuple[float, tuple[int, int]]:
    """(all-to-all seconds of the run's measurement window, (local, total) activations so far) of one run."""
    return float(run.window_moe_seconds[:, :, a2a_columns].sum()), (int(run.local_activations), int(run.total_activations))


@dataclass
class Served:
    """One policy's serving pass: per-window rows, its change records, summary keys."""

    rows: list[dict]
    changes: list[dict]
    summary: dict


def serve_policy(setup: ServingSetup, name: str, first, decisions: list[tuple[int, object]], mode: str) -> Served:
    """Serve the stream with `first`, then each decision's plan from when it is asked for (module docstring)."""
    from repro.sim.metrics import request_latencies, statistic

    run, changes, times = asked_times(setup, first, decisions, mode)
    latency = request_latencies(run, setup.requests.output_len[: len(setup.arrivals)])
    ok = (latency["ttft"] <= setup.slo["ttft"]) & (np.isnan(latency["tpot"]) | (latency["tpot"] <= setup.slo["tpot"]))
    if setup.window_costs:
        a2a, lar = _window_costs(setup, first, changes, times, run)
    else:
        a2a, lar = np.full(setup.num_windows, np.nan), np.full(setup.num_windows, np.nan)
    records = [dict(record, policy=name, after_window=w) for record, (w, _) in zip(run.changes or [], decisions, strict=True)]
    rows = []
    end_of_run = float(np.nanmax(run.finish)) if len(run.finish) else 0.0
    for w in range(setup.num_windows):
        start = w * setup.window_s
        end = (w + 1) * setup.window_s if w < setup.num_windows - 1 else max(end_of_run, (w + 1) * setup.window_s)
        mine = setup.window_R == w
        began = [c for c in records if start <= c["start_s"] < end]
        overlap = sum(max(0.0, min(c["end_s"], end) - max(c["start_s"], start)) for c in records)
        rows.append({
            "policy": name, "window": w, "start_s": start, "end_s": end, "requests": int(mine.sum()),
            "ttft_mean_s": _finite(statistic(latency["ttft"][mine], "mean")),
            "ttft_p99_s": _finite(statistic(latency["ttft"][mine], "p99")),
            "tpot_mean_s": _finite(statistic(latency["tpot"][mine], "mean")),
            "tpot_p99_s": _finite(statistic(latency["tpot"][mine], "p99")),
            "slo_attainment": float(ok[mine].mean()) if mine.any() else None,
            "a2a_s": _finite(a2a[w]), "lar": _finite(lar[w]),
            "migrations_began": len(began), "stall_s": float(sum(c["stall_s"] for c in began)),
            "experts_moved": int(sum(c["experts_moved"] for c in began)), "migrating_s": overlap,
        })
    summary = {
        "ttft_mean_s": _finite(statistic(latency["ttft"], "mean")), "ttft_p99_s": _finite(statistic(latency["ttft"], "p99")),
        "tpot_mean_s": _finite(statistic(latency["tpot"], "mean")), "tpot_p99_s": _finite(statistic(latency["tpot"], "p99")),
        "slo_attainment": float(ok.mean()),
        "serving_stall_s": float(run.stall_seconds), "serving_migrations": len(records),
        "serving_a2a_s": _finite(float(np.nansum(a2a))) if setup.window_costs else None,
        "serving_lar": _finite(run.local_activations / run.total_activations) if run.total_activations else None,
        "serving_iterations_per_window": run.iterations / setup.num_windows,
        "serving_asked_after_window_s": [float(t - (w + 1) * setup.window_s) for t, (w, _) in zip(times, decisions, strict=True)],
    }
    return Served(rows, records, summary)


def _finite(value) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def serving_frame(served: dict[str, Served]) -> pd.DataFrame:
    """All policies' per-window rows (drift_serving.csv)."""
    return pd.DataFrame([row for one in served.values() for row in one.rows])
