"""PLACEHOLDER migration pricing: the one place where the drift experiment turns expert copies into seconds.

The suite's migration pricing (repro/sim/migration_cost.py: routes over NVLink / RDMA, sync stall, async bandwidth
share) is being written on branch `migrate` and was not committed when this was written; swap
`migration_stall_seconds` for its `price_migration(...).stall_s` when it lands. Until then, the placeholder:

    bytes of one expert  = 3 x hidden_size x moe_intermediate_size x dtype_bytes (gate, up, down; the shape's sizes)
    seconds of layer l   = collective latency + max over devices of (copies received in l x bytes) / NVLink bandwidth
    sync stall           = sum over layers (they move one after another, serving stopped)
    async stall          = 0 (the copies ride beside serving; the bandwidth they take from the all-to-all is NOT
                           priced here, a known under-count)

Every device is assumed on one NVLink domain (no RDMA level) and a copy is received once (sends are not priced).
"""

from __future__ import annotations

import numpy as np

from repro.errors import ConfigError
from repro.systems.base import Placement
from repro.systems.migration import experts_received

PRICING = "placeholder (repro/drift/pricing.py): NVLink receive time per layer, layers in sequence"
MODES = ("sync", "async")


def expert_bytes(shape: dict) -> float:
    """Bytes of one routed expert's weights for a conf/sim/shape/*.yaml dict."""
    return 3.0 * shape["hidden_size"] * shape["moe_intermediate_size"] * shape["dtype_bytes"]


def migration_stall_seconds(old: Placement, new: Placement, shape: dict, hardware: dict, mode: str) -> tuple[int, float]:
    """(expert copies moved, serving stall in seconds) of going from `old` to `new` (module docstring)."""
    if mode not in MODES:
        raise ConfigError(f"a migration mode must be one of {MODES}, got {mode!r}.")
    received_LD = experts_received(old, new)
    moved = int(received_LD.sum())
    if mode == "async" or moved == 0:
        return moved, 0.0
    link = hardware["collective"]
    per_layer = received_LD.max(axis=1) * expert_bytes(shape) / (link["nvlink_gbps"] * 1e9)
    moving = received_LD.max(axis=1) > 0
    return moved, float(np.sum(per_layer[moving] + link["latency_us"] * 1e-6))
