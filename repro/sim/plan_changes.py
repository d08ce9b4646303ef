"""Plans that change during a simulated run, each change priced (issue 34, item 4).

    changes = priced_changes(first_plan, [(30.0, plan_b), (90.0, plan_c)], shape, hardware, mode="async",
                             bandwidth_share=0.25)
    run = Engine(first_plan, requests, cost, dispatch_slots(first_plan.placement), config).run(arrivals, changes=changes)
    run.changes        # one record per change: asked, start and end times, stall, experts and bytes moved
    run.stall_seconds  # seconds every rank stood still for synchronous migrations

Each change is priced against the plan served before it (repro/sim/migration_cost.py: bytes per layer and device,
sync stall or async duration and all-to-all slowdown). How the engine serves it (repro/sim/engine.py `run`):
- a change asked for at time t begins at the first iteration boundary at or after t (an iteration in flight
  finishes first; an idle engine begins at t); one migration at a time, so a change asked for while another
  migrates begins when that one ends;
- sync: no rank runs an iteration for stall_s; requests in flight (and those arriving meanwhile) wait;
- async: iterations go on, priced on the hardware with the migration's share of the links taken
  (`migration_cost.links_shared`), for duration_s;
- at the end, the new plan takes over at once for every layer: its dispatch tables price the next iteration, and
  its request scheduler (reset) places the requests that arrive from then on. A request already placed keeps its
  rank (its KV cache lives there).
A change priced as moving nothing takes effect at once, without a stall.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from repro.errors import ConfigError
from repro.sim.costs import CostModel
from repro.sim.hardware import Hardware
from repro.sim.migration_cost import MigrationCost, check_migration_mode, links_shared, price_migration
from repro.sim.shapes import ModelShape
from repro.sim.traffic import dispatch_slots
from repro.systems.base import Placement, Plan


@dataclass(frozen=True)
class PlanChange:
    """A change of plan asked for at time_s (seconds of simulated time), priced by `cost` from the placement
    `before` (int64[L, P] physical_to_logical of the plan it replaces); slot_table int32[L, D, E] is
    dispatch_slots(plan.placement), the new dispatch tables."""

    time_s: float
    plan: Plan
    slot_table: np.ndarray
    cost: MigrationCost
    before: np.ndarray


def check_chain(first: Plan, changes: Sequence[PlanChange]) -> None:
    """One ConfigError unless each change was priced from the placement served before it (`first`'s for the
    first): changes priced for another plan would charge the wrong copies."""
    served = first.placement.physical_to_logical
    for i, change in enumerate(changes):
        if not np.array_equal(change.before, served):
            raise ConfigError(f"placement change {i} was priced from another placement than the one served before it; "
                              "build the schedule with priced_changes(the engine's plan, ...).")
        served = change.plan.placement.physical_to_logical


def priced_changes(first: Plan, schedule: Sequence[tuple[float, Plan | Placement]], shape: ModelShape, hardware: Hardware,
                   mode: str = "sync", bandwidth_share: float = 1.0, host_seconds: float = 0.0,
                   bytes_per_weight: float | None = None, layer_overhead_s: float = 0.0) -> list[PlanChange]:
    """One PlanChange per (time_s, plan) of `schedule` (times >= 0, non-decreasing), each priced against the plan
    before it (`first` for the first); the plans must share first's parallel config and placement shape. A bare
    Placement stands for Plan(placement, first.parallel): round-robin request assignment. mode,
    bandwidth_share, host_seconds, bytes_per_weight and layer_overhead_s as `migration_cost.price_migration`."""
    check_migration_mode(mode, bandwidth_share, host_seconds, layer_overhead_s)
    changes, before, last_time = [], first, 0.0
    for i, item in enumerate(schedule):
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[1], Plan | Placement)):
            raise ConfigError(f"placement change {i} must be a (time in seconds, Plan or Placement) pair, got {item!r}.")
        time_s, plan = item
        if isinstance(plan, Placement):
            plan = Plan(plan, first.parallel)
        if isinstance(time_s, bool) or not isinstance(time_s, int | float) or not np.isfinite(time_s) or time_s < last_time:
            raise ConfigError(f"placement change {i} is asked for at {time_s!r} s; times must be finite, >= 0 and "
                              f"non-decreasing (the change before is at {last_time} s).")
        if plan.parallel != first.parallel:
            raise ConfigError(f"placement change {i}'s plan is for {plan.parallel}, not the served {first.parallel}; "
                              "re-fit it for the same parallel config.")
        cost = price_migration(before.placement, plan.placement, shape, hardware, mode, bandwidth_share, host_seconds,
                               bytes_per_weight, layer_overhead_s)
        changes.append(PlanChange(float(time_s), plan, dispatch_slots(plan.placement), cost,
                                  before.placement.physical_to_logical))
        before, last_time = plan, float(time_s)
    return changes


def cost_while_migrating(cost: CostModel, change: PlanChange) -> CostModel:
    """The cost model serving uses while `change`'s async migration holds its share of the links."""
    return CostModel(cost.shape, links_shared(cost.hw, change.cost.bandwidth_share), cost.map, cost.devices, cost.mode,
                     cost.backend)
