"""The drift experiment's job: every re-placement policy served window by window over one drifting stream, scored by
the offline evaluator (repro.eval.evaluate with the simulator's cost model) on each window, with its migrations
counted (repro.systems.migration) and priced (repro.drift.pricing: repro.sim.migration_cost), against the per-window
hindsight.

    python -m repro.run experiment=drift            # conf/experiment/drift.yaml, conf/drift/default.yaml

Per window w (drift.window_requests requests in arrival order, after drift.profile_requests of profile) and policy:
the plan in force serves the window (LAR, all-to-all seconds = the busiest rank's dispatch + combine, MoE seconds,
expert-load max/mean), then the policy may decide a re-placement. It serves from window w + 1, which is charged its
migration_s (repro.drift.pricing: the stall of a synchronous one; for an asynchronous one the all-to-all slowdown
over the share of the window its copies overlap). With drift.window_steps set, each window stands for that many
engine steps of its traffic: its seconds are scaled by window_steps x step_tokens / (its tokens); migrations are not.

Summary per policy (metrics.json summary["policies"][name], and the headline policy's at the top level):
- gain_kept_vs_hindsight = (A_ref - A_policy - migration_s) / (A_ref - A_hindsight), A = all-to-all seconds summed over
  windows, ref = the static reference (drift.reference, static EP): the share of the hindsight gain kept, migration
  included (null when hindsight gains nothing);
- gain_kept_vs_best_per_window: the same over the best any policy reached in each window (hindsight included):
  a stronger reference than the hindsight alone, which is fitted on one window's few requests and for LAR, so it can
  lose to a plan fitted on more traffic (then gain_kept_vs_hindsight exceeds 1);
- experts_moved, experts_moved_vs_eplb (over drift.eplb_reference's, null when that moved none);
- false_alarms: re-placements decided after a window whose request mix (shares of source datasets) is within
  drift.mix_tolerance (total variation) of the mix the plan in force was fitted on: nothing changed, yet it re-placed;
- stall_s (sync stalls), migration_s (stalls + async slowdowns), replacements, and the means of lar, balance;
- windows_to_first_replacement_after_switch: 0 when the policy re-places right after the first window holding a
  change of source dataset (the abrupt switch), null without a switch or a re-placement after it.

With drift.serving.enabled, a serving pass follows (repro.drift.serving): every policy but the hindsight served
through the serving simulator with its re-placements (the plans decided here) applied when decided; its per-window
series are the fourth table drift_job returns (drift_serving.csv), its keys (ttft_p99_s, tpot_p99_s,
slo_attainment, serving_stall_s, ...) join each policy's summary, and the headline's join the top level.

Legend: W windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from repro.drift.policies import EPLBSchedule, SemMoEOnDrift, StaticPolicy, Stream
from repro.drift.pricing import PRICING, MigrationCharge, check_migration_config, price_change
from repro.drift.schedule import steps_per_window
from repro.drift.serving import SERVING_SUMMARY, check_serving_config, serve_policy, serving_frame, serving_setup
from repro.drift.statistics import mix_distance, window_bounds
from repro.errors import ConfigError
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.systems.base import Plan
from repro.traces import RoutingTrace, select_requests

POLICY_KINDS = ("static", "eplb", "semmoe_drift", "hindsight")
DRIFT_KEYS = ("window_requests", "profile_requests", "step_tokens", "window_steps", "headline", "reference",
              "eplb_reference", "mix_tolerance", "migration", "policies", "serving")


def check_drift_config(drift: dict) -> None:
    """One ConfigError sentence for an unknown key or a malformed policy of the drift group."""
    unknown = sorted(set(drift) - set(DRIFT_KEYS))
    if unknown:
        raise ConfigError(f"drift has no key(s) {unknown}; its keys are {list(DRIFT_KEYS)}.")
    policies = drift.get("policies") or {}
    if not isinstance(policies, dict) or not policies:
        raise ConfigError("drift.policies must map policy names to {kind: ..., ...}; none given.")
    for name, spec in policies.items():
        if not isinstance(spec, dict) or spec.get("kind") not in POLICY_KINDS:
            raise ConfigError(f"drift.policies.{name}.kind must be one of {POLICY_KINDS}, got {spec!r}.")
    for key in ("headline", "reference", "eplb_reference"):
        if drift.get(key) not in policies:
            raise ConfigError(f"drift.{key}={drift.get(key)!r} names no policy of drift.policies ({sorted(policies)}).")
    for key in ("window_requests", "profile_requests"):
        value = drift.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"drift.{key} must be an integer >= 1, got {value!r}.")
    check_migration_config(drift.get("migration") or {})
    if drift.get("serving") is not None:
        check_serving_config(drift["serving"])
    tolerance = drift.get("mix_tolerance")
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not 0 <= tolerance < 1:
        raise ConfigError(f"drift.mix_tolerance must be a number in [0, 1), got {tolerance!r}.")


def make_policy(name: str, spec: dict, system_cfg: dict):
    """The policy object of one drift.policies entry; Sem-MoE policies take the job's system=semmoe params."""
    params = {k: v for k, v in spec.items() if k != "kind"}
    kind = spec["kind"]
    if kind in ("semmoe_drift", "hindsight") or params.get("system") == "semmoe":
        if system_cfg.get("name") != "semmoe":
            raise ConfigError(f"drift policy {name!r} runs Sem-MoE with the job's system params; set system=semmoe.")
    semmoe = lambda: make_system("semmoe", **(system_cfg.get("params") or {}))  # noqa: E731
    if kind == "static":
        system = params.pop("system", None)
        if params or system is None:
            raise ConfigError(f"drift policy {name!r} (static) takes only system=<name>, got {spec!r}.")
        return StaticPolicy(name, semmoe() if system == "semmoe" else make_system(system))
    if kind == "eplb":
        try:
            return EPLBSchedule(name, **params)
        except TypeError as error:
            raise ConfigError(f"drift policy {name!r} (eplb): {error}; see repro/drift/policies.py.") from None
    if kind == "semmoe_drift":
        try:
            return SemMoEOnDrift(name, semmoe(), **params)
        except TypeError as error:
            raise ConfigError(f"drift policy {name!r} (semmoe_drift): {error}; see repro/drift/policies.py.") from None
    if params:
        raise ConfigError(f"drift policy {name!r} (hindsight) takes no parameters, got {sorted(params)}.")
    return Hindsight(name, semmoe())


class Hindsight:
    """Per window, the Sem-MoE plan fitted on that window itself (kind "hindsight": a reference, not a bound)."""

    kind = "hindsight"
    mode = "sync"

    def __init__(self, name: str, system):
        self.name, self.system = name, system


@dataclass
class PolicyRun:
    """Per-window rows and re-placement events of one policy over the stream."""

    rows: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    first: Plan | None = None  # the plan it starts with (None: hindsight)
    decisions: list[tuple[int, Plan]] = field(default_factory=list)  # (after window, new plan), in order
    mode: str = "sync"


def window_scale(stream: Stream, step_tokens: int, window_steps: int | None) -> np.ndarray:
    """float64[W] factor from a window's own seconds to the traffic it stands for (1 without window_steps)."""
    tokens = np.diff(np.asarray(stream.trace.offsets)[stream.bounds])
    if window_steps is None:
        return np.ones(len(tokens))
    return window_steps * step_tokens / np.maximum(tokens, 1)


def run_policy(policy, stream: Stream, score, migrate, scale: np.ndarray, sources: np.ndarray,
               mix_tolerance: float) -> PolicyRun:
    """Serve every window with `policy` (module docstring). score(plan, window trace) -> dict of window metrics;
    migrate(old plan, new plan, mode) -> MigrationCharge; sources[r]: source dataset of request r."""
    out = PolicyRun()
    if isinstance(policy, Hindsight):
        for w in range(stream.num_windows):
            plan = policy.system.fit(stream.window(w), stream.parallel, stream.rng(w))
            out.rows.append(_row(policy, w, score(plan, stream.window(w)), scale[w], None))
        return out
    plan = policy.start(stream)
    out.first, out.mode = plan, getattr(policy, "mode", "sync")
    fitted_mix = np.asarray(stream.profile.request_datasets)
    landing = None  # (plan, MigrationCharge, event index) serving from the next window
    for w in range(stream.num_windows):
        charge = None
        if landing is not None:
            plan, charge, event = landing
            landing = None
        row = _row(policy, w, score(plan, stream.window(w)), scale[w], charge)
        if charge is not None:
            out.events[event]["migration_window_share"] = charge.duration_s / max(row["moe_s"], 1e-30)
        out.rows.append(row)
        if w == stream.num_windows - 1:
            continue
        decision = policy.decide(stream, w, plan)
        if decision is None:
            continue
        mode = getattr(policy, "mode", "sync")
        charge = migrate(plan, decision.plan, mode)
        live_mix = sources[stream.bounds[w]:stream.bounds[w + 1]]
        out.events.append({"policy": policy.name, "after_window": w, "serves_from_window": w + 1, "mode": mode,
                           "experts_moved": charge.experts_moved, "bytes_moved": charge.bytes_moved,
                           "stall_s": charge.stall_s, "duration_s": charge.duration_s,
                           "a2a_slowdown": charge.a2a_slowdown, "reason": decision.reason,
                           "mix_distance": mix_distance(fitted_mix, live_mix),
                           "false_alarm": mix_distance(fitted_mix, live_mix) <= mix_tolerance,
                           **{f"distance_{k}": v for k, v in decision.distances.items()}})
        first = getattr(policy, "refit_first", w)  # the windows the new plan was fitted on
        fitted_mix = sources[stream.bounds[first]:stream.bounds[w + 1]]
        landing = (decision.plan, charge, len(out.events) - 1)
        out.decisions.append((w, decision.plan))
    return out


def _row(policy, w: int, metrics: dict, scale: float, charge: MigrationCharge | None) -> dict:
    """One window's row; a migration landing in it adds its stall (sync) or its all-to-all slowdown over the share of
    the window it overlaps (async), as migration_s."""
    a2a, moe = metrics["a2a_s"] * scale, metrics["moe_s"] * scale
    moved, stall, slowed = 0, 0.0, 0.0
    if charge is not None:
        moved, stall = charge.experts_moved, charge.stall_s
        slowed = a2a * (charge.a2a_slowdown - 1.0) * min(1.0, charge.duration_s / max(moe, 1e-30))
    return {"policy": policy.name, "kind": policy.kind, "window": w, "lar": metrics["lar"], "a2a_s": a2a,
            "moe_s": moe, "balance": metrics["balance"], "experts_moved": moved, "stall_s": stall,
            "migration_s": stall + slowed, "replaced": charge is not None}


def summarise(runs: dict[str, PolicyRun], drift: dict) -> dict:
    """{"policies": {name: summary}, and the headline policy's summary keys at the top level} (module docstring)."""
    frames = {name: pd.DataFrame(run.rows) for name, run in runs.items()}
    hindsight = next((n for n, r in runs.items() if r.rows and r.rows[0]["kind"] == "hindsight"), None)
    a2a = {name: float(frame["a2a_s"].sum()) for name, frame in frames.items()}
    reference = a2a[drift["reference"]]
    # the best all-to-all seconds any policy (hindsight included) reached in each window, migration left out
    best = float(pd.concat(frames.values()).groupby("window")["a2a_s"].min().sum())
    eplb_moved = sum(e["experts_moved"] for e in runs[drift["eplb_reference"]].events)
    policies = {}
    for name, run in runs.items():
        frame = frames[name]
        stall, migration = float(frame["stall_s"].sum()), float(frame["migration_s"].sum())
        moved = int(frame["experts_moved"].sum())
        hindsight_gain = reference - a2a[hindsight] if hindsight else 0.0
        policies[name] = {
            "kind": frame["kind"].iloc[0],
            "a2a_s": a2a[name], "moe_s": float(frame["moe_s"].sum()), "stall_s": stall, "migration_s": migration,
            "lar_mean": float(frame["lar"].mean()), "balance_mean": float(frame["balance"].mean()),
            "experts_moved": moved,
            "replacements": len(run.events),
            "false_alarms": int(sum(e["false_alarm"] for e in run.events)),
            "gain_kept_vs_hindsight": (reference - a2a[name] - migration) / hindsight_gain if hindsight_gain > 0 else None,
            "experts_moved_vs_eplb": moved / eplb_moved if eplb_moved else None,
            "gain_kept_vs_best_per_window": (reference - a2a[name] - migration) / (reference - best)
            if reference > best else None,
        }
    return {**policies[drift["headline"]], "headline_policy": drift["headline"], "policies": policies,
            "hindsight_gain_a2a_s": reference - a2a[hindsight] if hindsight else None,
            "best_per_window_gain_a2a_s": reference - best,
            "migration_pricing": PRICING}


def drift_job(config: dict, trace: RoutingTrace) -> tuple[dict, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(summary, per-window rows, events, serving rows) of the drift experiment on `trace` (the whole stream, arrival
    order); serving rows (drift_serving.csv) are empty unless drift.serving.enabled (repro.drift.serving)."""
    from repro.eval import evaluate, time_model_from_config

    drift = config["drift"]
    check_drift_config(drift)
    parallel = ParallelConfig.from_config(config["parallel"])
    profile_requests = drift["profile_requests"]
    if trace.num_requests < profile_requests + drift["window_requests"]:
        raise ConfigError(f"the stream holds {trace.num_requests} requests, fewer than drift.profile_requests="
                          f"{profile_requests} plus one window of {drift['window_requests']}; route more requests.")
    profile = select_requests(trace, np.arange(profile_requests))
    rest = select_requests(trace, np.arange(profile_requests, trace.num_requests))
    bounds = window_bounds(rest.num_requests, drift["window_requests"])
    step_tokens = drift.get("step_tokens") or parallel.tokens_per_step * parallel.devices
    window_tokens = np.diff(np.asarray(rest.offsets)[bounds])
    stream = Stream(rest, bounds, profile, parallel, steps_per_window(window_tokens, step_tokens,
                                                                      drift.get("window_steps")), config["seed"])
    scale = window_scale(stream, step_tokens, drift.get("window_steps"))
    sources = np.asarray(rest.request_datasets)
    shape = (config.get("sim") or {}).get("shape")
    if shape is None:
        from repro.eval.time_cost import DEFAULT_SHAPE, load_shape

        shape = load_shape(DEFAULT_SHAPE)

    def score(plan: Plan, window: RoutingTrace) -> dict:
        plan.reset()
        result = evaluate(plan, window, history=config["history"], time_model=time_model_from_config(config, plan, window))
        s = result.summary
        return {"lar": s["lar"], "a2a_s": s["time_estimate_dispatch_s"] + s["time_estimate_combine_s"],
                "moe_s": s["time_estimate_s"], "balance": s["expert_load_imbalance_max_mean"]}

    def migrate(old: Plan, new: Plan, mode: str) -> MigrationCharge:
        return price_change(old.placement, new.placement, shape, config["hardware"], parallel, mode,
                            drift.get("migration") or {})

    runs = {}
    for name, spec in drift["policies"].items():
        policy = make_policy(name, spec, config["system"])
        runs[name] = run_policy(policy, stream, score, migrate, scale, sources, drift["mix_tolerance"])
        if isinstance(policy, SemMoEOnDrift | StaticPolicy):  # distances after each window, to the plan's fit data
            for row, distances in zip(runs[name].rows, policy.distances, strict=False):
                row.update({f"distance_{k}": v for k, v in distances.items() if k != "window"})
    summary = summarise(runs, drift)
    boundaries = [int(w) for w in np.flatnonzero(
        [len(set(sources[bounds[w]:bounds[w + 1]])) > 1 or (w and sources[bounds[w]] != sources[bounds[w] - 1])
         for w in range(stream.num_windows)])]
    for name, run in runs.items():  # windows from the first switch to the first re-placement decided after it
        after = [e["after_window"] for e in run.events if boundaries and e["after_window"] >= boundaries[0]]
        delay = after[0] - boundaries[0] if after else None
        summary["policies"][name]["windows_to_first_replacement_after_switch"] = delay
        if name == drift["headline"]:
            summary["windows_to_first_replacement_after_switch"] = delay
    summary.update(num_windows=stream.num_windows, window_requests=drift["window_requests"],
                   profile_requests=profile_requests, step_tokens=int(step_tokens),
                   window_steps=drift.get("window_steps"), windows_with_a_switch=boundaries,
                   steps_per_window=[int(s) for s in stream.steps_W])
    serving = drift.get("serving") or {}
    served = {}
    if serving.get("enabled"):
        setup = serving_setup(config, stream, serving)
        for name, run in runs.items():
            if run.first is None:  # the hindsight: a reference per window, not a deployable run
                continue
            served[name] = serve_policy(setup, name, run.first, run.decisions, run.mode)
            summary["policies"][name].update(served[name].summary)
            for event, record in zip(run.events, served[name].changes, strict=True):
                event.update(serving_asked_s=record["asked_s"], serving_start_s=record["start_s"],
                             serving_end_s=record["end_s"])
        summary.update(setup.info, serving_engine_runs=setup.runs)
        summary.update({k: v for k, v in summary["policies"][drift["headline"]].items() if k in SERVING_SUMMARY})
    rows = pd.DataFrame([row for run in runs.values() for row in run.rows])
    events = pd.DataFrame([event for run in runs.values() for event in run.events])
    return summary, rows, events, serving_frame(served)
