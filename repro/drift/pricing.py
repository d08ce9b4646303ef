"""Migration priced for the drift job: the one place the drift experiment turns a change of placement into seconds.

It calls the suite's migration model, `repro.sim.migration_cost.price_migration` (branch `migrate`, docs/migration.md:
copies routed over NVLink / RDMA, a fixed per-layer overhead, sync stall = host + layers in turn, async at a share
of every link with the all-to-all slowed by 1 / (1 - share) while it runs), with the drift group's `migration`
settings. What the drift job charges for one re-placement, in the window the new plan first serves:
- sync: `stall_s` (serving stops);
- async: no stall, but that window's all-to-all seconds x (slowdown - 1) x min(1, duration / the window's MoE
  seconds) (the share of the window the copies overlap, the MoE seconds standing for the window's length).
A re-placement decided after window w serves from window w + 1 in both modes: the transfer (`duration_s`, in the
events table with its share of that window) is assumed to end inside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from repro.errors import ConfigError
from repro.parallel import ParallelConfig
from repro.systems.base import Placement

PRICING = "repro.sim.migration_cost.price_migration (docs/migration.md)"
MIGRATION_KEYS = ("bandwidth_share", "layer_overhead_s", "host_seconds", "bytes_per_weight")


@dataclass(frozen=True)
class MigrationCharge:
    """One re-placement's cost: experts_moved (copies received), bytes_moved, stall_s (sync), duration_s (until the new
    placement serves), a2a_slowdown (factor on all-to-all seconds while an async one runs; 1 for sync)."""

    experts_moved: int
    bytes_moved: float
    stall_s: float
    duration_s: float
    a2a_slowdown: float


def check_migration_config(migration: dict) -> None:
    """One ConfigError sentence for an unknown key of drift.migration (values are checked by price_migration)."""
    unknown = sorted(set(migration) - set(MIGRATION_KEYS))
    if unknown:
        raise ConfigError(f"drift.migration has no key(s) {unknown}; its keys are {list(MIGRATION_KEYS)}.")


def price_change(old: Placement, new: Placement, shape: dict, hardware: dict, parallel: ParallelConfig, mode: str,
                 migration: dict) -> MigrationCharge:
    """What going from `old` to `new` costs (module docstring). shape: a conf/sim/shape/*.yaml dict; hardware: a
    conf/hardware/*.yaml dict, priced on the job's topology as the time estimate is; migration: drift.migration."""
    from repro.sim.hardware import load_hardware
    from repro.sim.migration_cost import price_migration
    from repro.sim.shapes import ModelShape

    check_migration_config(migration)
    hw = load_hardware(dict(hardware, nodes=parallel.num_nodes, devices_per_node=parallel.devices_per_node))
    cost = price_migration(old, new, ModelShape.from_config(shape), hw, mode,
                           bandwidth_share=float(migration.get("bandwidth_share", 0.25)) if mode == "async" else 1.0,
                           host_seconds=float(migration.get("host_seconds", 0.0)),
                           bytes_per_weight=migration.get("bytes_per_weight"),
                           layer_overhead_s=float(migration.get("layer_overhead_s", 0.0)))
    return MigrationCharge(cost.experts_moved, cost.bytes_moved, cost.stall_s, cost.duration_s, cost.a2a_slowdown)
