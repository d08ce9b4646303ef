"""Re-placement policies over windows of a drifting stream: each starts with a plan fitted on the profile and, after
each window, may hand back a new plan (a re-placement) that serves from a later window.

- `StaticPolicy`: never re-places (static EP, static Sem-MoE: the references).
- `EPLBSchedule`: the engines' rebalancers (repro.drift.schedule): vLLM (every step_interval steps on the last
  window_size steps' load, sync or async) and SGLang (every num_iterations iterations, skipped above a utilisation
  threshold); each re-plan is DeepSeek's EPLB (repro.systems.eplb.rebalance_experts) on that load, its physical
  slots taken as they come (the engines do not relabel devices; `min_move=True` adds a per-layer relabelling).
- `SemMoEOnDrift`: Sem-MoE re-fitted when a measured drift distance (repro.drift.statistics) crosses a threshold:
  re-fitted on the last refit_windows windows, relabelled onto the current placement's devices by the minimum-move
  permutation (one for all layers, so a device's experts stay with its DP rank; the plan's DP and token tables are
  rebuilt for the relabelled placement, so they name the same ranks), and held to a migration budget: when the
  re-fit would move more than budget x L x E expert copies, only the layers that gain most intra-device
  co-activation per copy moved are taken, up to the budget; the others keep their current experts.
  "Warm-started" means exactly this: the co-clustering itself restarts from scratch, but its result is mapped
  onto the current placement (relabelling) and limited to the layers worth moving (budget).
- `Hindsight` (kind "hindsight"): in every window the Sem-MoE plan fitted on that window itself, no migration
  counted: a reference to measure decay against, not deployable and not a proven bound.

Legend: L MoE layers, E experts, D devices, W windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from repro.drift.schedule import load_window_tokens, rebalances_in_window, utilization
from repro.drift.statistics import (
    STATISTICS,
    RoutingStats,
    drift_distances,
    intra_device_coactivation,
    request_affinity,
    routing_stats,
    total_variation,
)
from repro.errors import ConfigError
from repro.parallel import ParallelConfig
from repro.systems.base import Placement, Plan
from repro.systems.eplb import device_load, rebalance_experts
from repro.systems.migration import experts_received, min_move_permutation, relabel_devices
from repro.traces import RoutingTrace, select_requests


@dataclass
class Stream:
    """The drifting stream cut into windows, and what every policy may read of it.

    trace: every evaluated request in arrival order; bounds int64[W + 1] request offsets of the windows;
    profile: the traffic the initial plans are fitted on (before window 0); steps_W int64[W] engine steps per
    window (repro.drift.schedule); stats: RoutingStats per window (filled by `window_stats`)."""

    trace: RoutingTrace
    bounds: np.ndarray
    profile: RoutingTrace
    parallel: ParallelConfig
    steps_W: np.ndarray
    seed: int = 0
    _windows: dict = field(default_factory=dict)
    _stats: dict = field(default_factory=dict)

    @property
    def num_windows(self) -> int:
        return len(self.bounds) - 1

    def window(self, first: int, last: int | None = None) -> RoutingTrace:
        """The requests of windows first..last (inclusive; last=None: first only) as one trace."""
        last = first if last is None else last
        key = (first, last)
        if key not in self._windows:
            self._windows[key] = select_requests(self.trace, np.arange(self.bounds[first], self.bounds[last + 1]))
        return self._windows[key]

    def window_stats(self, w: int) -> RoutingStats:
        if w not in self._stats:
            self._stats[w] = routing_stats(np.asarray(self.window(w).experts), self.trace.meta.num_experts)
        return self._stats[w]

    def token_end(self, w: int) -> int:
        """Tokens of the stream up to the end of window w."""
        return int(np.asarray(self.trace.offsets)[self.bounds[w + 1]])

    def rng(self, w: int) -> np.random.Generator:
        """The seeded generator of a fit after window w (-1: the initial fit)."""
        return np.random.default_rng([self.seed, w + 1])


@dataclass
class Replacement:
    """A new plan decided after a window, with why (reason) and the drift distances seen then."""

    plan: Plan
    reason: str
    distances: dict = field(default_factory=dict)


class StaticPolicy:
    """Fits `system` on the profile once and never re-places; it still measures, after every window, the drift
    distances between that window and the profile it was fitted on (`distances`: the decay's cause)."""

    kind = "system"
    mode = "sync"

    def __init__(self, name: str, system):
        self.name, self.system = name, system

    def start(self, stream: Stream) -> Plan:
        plan = self.system.fit(stream.profile, stream.parallel, stream.rng(-1))
        self._fitted = fitted_statistics(stream, stream.profile, plan.placement.expert_device())
        self.distances: list[dict] = []
        return plan

    def decide(self, stream: Stream, w: int, plan: Plan) -> Replacement | None:
        self.distances.append({"window": w, **distances_to(stream, w, plan, *self._fitted)})
        return None


def fitted_statistics(stream: Stream, fit_on: RoutingTrace, expert_device: np.ndarray) -> tuple[RoutingStats, float]:
    """(RoutingStats, request affinity under expert_device int[L, E]) of the traffic a plan was fitted on."""
    stats = routing_stats(np.asarray(fit_on.experts), stream.trace.meta.num_experts)
    return stats, request_affinity(np.asarray(fit_on.experts), fit_on.offsets, expert_device, stream.parallel.devices)


def distances_to(stream: Stream, w: int, plan: Plan, fitted: RoutingStats, fitted_affinity: float) -> dict[str, float]:
    """The three drift distances between window w (affinity under the plan's placement) and the fitted traffic."""
    window = stream.window(w)
    live_affinity = request_affinity(np.asarray(window.experts), window.offsets, plan.placement.expert_device(),
                                     stream.parallel.devices)
    return drift_distances(fitted, stream.window_stats(w), fitted_affinity, live_affinity)


class EPLBSchedule:
    """An engine's periodic EPLB (module docstring). interval: steps between rebalances (vLLM step_interval, SGLang
    eplb_rebalance_num_iterations); window_size: steps of load a re-plan reads (SGLang: None = since the last one);
    utilization_threshold: skip when the recent utilisation exceeds it (SGLang; None or >= 1: never skip);
    utilization_steps: the steps that utilisation is measured over (SGLang: 10)."""

    kind = "system"

    def __init__(self, name: str, interval: int, window_size: int | None = None, num_redundant: int = 0,
                 mode: str = "sync", utilization_threshold: float | None = None, utilization_steps: int = 10,
                 min_move: bool = False):
        if mode not in ("sync", "async"):
            raise ConfigError(f"{name}.mode must be sync or async, got {mode!r}.")
        if window_size is not None and int(window_size) < 1:
            raise ConfigError(f"{name}.window_size must be null or >= 1 steps, got {window_size}.")
        if int(num_redundant) < 0:
            raise ConfigError(f"{name}.num_redundant must be >= 0, got {num_redundant}.")
        self.name, self.interval, self.window_size = name, int(interval), window_size
        self.num_redundant, self.mode, self.min_move = int(num_redundant), mode, bool(min_move)
        self.utilization_threshold, self.utilization_steps = utilization_threshold, int(utilization_steps)
        self._last_end = 0

    def _placement(self, load_LE: np.ndarray, parallel: ParallelConfig) -> Placement:
        num_experts = load_LE.shape[1]
        phy2log, _, _ = rebalance_experts(load_LE, num_experts + self.num_redundant, 1, 1, parallel.devices)
        return Placement(phy2log, parallel.devices, num_experts, parallel.devices_per_node, load_LE)

    def _load(self, trace: RoutingTrace, first: int, end: int) -> np.ndarray:
        experts = np.asarray(trace.experts[first:end], dtype=np.int64)
        num_layers, num_experts = trace.num_layers, trace.meta.num_experts
        key = (np.arange(num_layers)[None, :, None] * num_experts + experts).ravel()
        return np.bincount(key, minlength=num_layers * num_experts).reshape(num_layers, num_experts).astype(float)

    def start(self, stream: Stream) -> Plan:
        self._schedule = rebalances_in_window(stream.steps_W, self.interval)
        self._last_end = 0
        profile = stream.profile
        return Plan(self._placement(self._load(profile, 0, profile.num_tokens), stream.parallel), stream.parallel)

    def decide(self, stream: Stream, w: int, plan: Plan) -> Replacement | None:
        if self._schedule[w] == 0:
            return None
        end = stream.token_end(w)
        tokens_per_step = (end - stream.token_end(w - 1) if w else end) / max(int(stream.steps_W[w]), 1)
        first = self._last_end if self.window_size is None else load_window_tokens(end, self.window_size, tokens_per_step)[0]
        self._last_end = end
        load = self._load(stream.trace, first, end)
        if self.utilization_threshold is not None and self.utilization_threshold < 1.0:
            recent = self._load(stream.trace, *load_window_tokens(end, self.utilization_steps, tokens_per_step))
            if utilization(device_load(recent, plan.placement)) > self.utilization_threshold:
                return None  # already balanced enough: SGLang skips the rebalance
        placement = self._placement(load, stream.parallel)
        if self.min_move:
            placement = relabel_devices(placement, min_move_permutation(plan.placement, placement, per_layer=True))
        return Replacement(Plan(placement, stream.parallel), f"schedule ({self.interval} steps)")


class SemMoEOnDrift:
    """Sem-MoE re-fitted when drift crosses `threshold` on statistic `trigger` (module docstring).

    refit_windows: at most this many windows of traffic the re-fit reads, ending with the window that fired;
    refit_rule: "last" reads exactly refit_windows windows, "similar" only the run of windows before it whose
    co-activation distance to the window that fired is within the threshold (the recent traffic that looks like the
    live one: on an abrupt switch the new domain only, under a gradual drift more requests); cooldown: windows after
    a re-fit before the next may fire; budget: at most this share of the L x E expert copies moved per re-placement
    (1.0 = no limit). refit_first: the first window the last re-fit read (for the caller's bookkeeping)."""

    kind = "system"

    def __init__(self, name: str, system, trigger: str = "coactivation", threshold: float = 0.2,
                 refit_windows: int = 1, cooldown: int = 1, budget: float = 1.0, mode: str = "sync",
                 refit_rule: str = "last"):
        if trigger not in STATISTICS:
            raise ConfigError(f"{name}.trigger must be one of {STATISTICS}, got {trigger!r}.")
        if not threshold > 0:
            raise ConfigError(f"{name}.threshold must be > 0 (a distance), got {threshold}.")
        if int(refit_windows) < 1 or int(cooldown) < 1:
            raise ConfigError(f"{name}.refit_windows and cooldown must be >= 1, got {refit_windows}, {cooldown}.")
        if not 0 < budget <= 1:
            raise ConfigError(f"{name}.budget must be a share of the experts in (0, 1], got {budget}.")
        if mode not in ("sync", "async"):
            raise ConfigError(f"{name}.mode must be sync or async, got {mode!r}.")
        if refit_rule not in ("last", "similar"):
            raise ConfigError(f"{name}.refit_rule must be last or similar, got {refit_rule!r}.")
        self.refit_rule = refit_rule
        self.name, self.system, self.trigger, self.threshold = name, system, trigger, float(threshold)
        self.refit_windows, self.cooldown, self.budget, self.mode = int(refit_windows), int(cooldown), float(budget), mode

    def start(self, stream: Stream) -> Plan:
        plan = self.system.fit(stream.profile, stream.parallel, stream.rng(-1))
        self._fitted = fitted_statistics(stream, stream.profile, plan.placement.expert_device())
        self._last_fit = -1
        self.distances: list[dict] = []
        return plan

    def decide(self, stream: Stream, w: int, plan: Plan) -> Replacement | None:
        distances = distances_to(stream, w, plan, *self._fitted)
        self.distances.append({"window": w, **distances})
        if distances[self.trigger] <= self.threshold or w - self._last_fit < self.cooldown:
            return None
        first = max(0, w - self.refit_windows + 1)
        if self.refit_rule == "similar":
            live = stream.window_stats(w).coactivation
            # keep the unbroken run of look-alike windows ending at w
            while first < w and any(total_variation(stream.window_stats(v).coactivation, live) > self.threshold
                                    for v in range(first, w)):
                first += 1
        self.refit_first = first
        refit_on = stream.window(first, w)
        new_device, info = self.system.solve_placement(refit_on, stream.parallel, stream.rng(w))
        old = plan.placement
        fresh = Placement.from_expert_device(new_device, stream.parallel.devices)
        fresh = relabel_devices(fresh, min_move_permutation(old, fresh))  # one permutation for every layer
        fitted = fitted_statistics(stream, refit_on, fresh.expert_device())
        expert_device, kept = budget_layers(old.expert_device(), fresh.expert_device(), experts_received(old, fresh),
                                            fitted[0].coactivation, self.budget)
        new_plan = self.system.plan_for_placement(refit_on, stream.parallel, expert_device,
                                                  {**info, "layers_replaced": int((~kept).sum())})
        # the affinity reference is the placement actually deployed (layers over budget keep their old experts)
        self._fitted = (fitted[0], fitted_statistics(stream, refit_on, expert_device)[1])
        self._last_fit = w
        return Replacement(new_plan, f"{self.trigger} distance {distances[self.trigger]:.4f} > {self.threshold}",
                           distances)


def budget_layers(old_LE: np.ndarray, new_LE: np.ndarray, received_LD: np.ndarray, coactivation_LEE: np.ndarray,
                  budget: float) -> tuple[np.ndarray, np.ndarray]:
    """(expert_device int64[L, E] taking `new_LE`'s layers within the budget and `old_LE`'s elsewhere, kept bool[L]:
    True where the old layer stays).

    received_LD int[L, D] copies each layer's change moves; coactivation_LEE float[L, E, E] the re-fit traffic's
    co-activation shares. Within budget x L x E copies in all, layers are taken in decreasing order of
    intra-device co-activation gained per copy moved, only those that gain; with budget 1 every layer is taken."""
    old_LE, new_LE = np.asarray(old_LE, dtype=np.int64), np.asarray(new_LE, dtype=np.int64)
    moves_L = np.asarray(received_LD).sum(axis=1)
    num_layers, num_experts = old_LE.shape
    if budget >= 1.0:
        return new_LE.copy(), np.zeros(num_layers, dtype=bool)
    gain_L = intra_device_coactivation(coactivation_LEE, new_LE) - intra_device_coactivation(coactivation_LEE, old_LE)
    order = np.argsort(-gain_L / np.maximum(moves_L, 1), kind="stable")
    allowed, spent = budget * num_layers * num_experts, 0
    take = np.zeros(num_layers, dtype=bool)
    for layer in order:  # L steps
        if gain_L[layer] > 0 and spent + moves_L[layer] <= allowed:
            take[layer], spent = True, spent + moves_L[layer]
    return np.where(take[:, None], new_LE, old_LE), ~take
