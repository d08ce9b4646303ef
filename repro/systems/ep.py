"""Vanilla expert parallelism: the baseline every engine ships.

Placement: contiguous blocks (expert e on device e // (E/D)), identical in every layer.
Attention-DP: round-robin requests over ranks. Attention-TP: contiguous equal token slices.
"""

from __future__ import annotations

import numpy as np

from repro.parallel import ParallelConfig
from repro.systems.base import Placement, Plan
from repro.traces import RoutingTrace


def contiguous_placement(num_layers: int, num_experts: int, num_devices: int) -> Placement:
    """Placement with physical_to_logical[l] = arange(E) for every layer l."""
    return Placement(np.tile(np.arange(num_experts), (num_layers, 1)), num_devices, num_experts)


class VanillaEP:
    name = "ep"

    def fit(self, profile: RoutingTrace, parallel: ParallelConfig, rng: np.random.Generator) -> Plan:
        parallel.check_experts(profile.meta.num_experts)
        placement = contiguous_placement(profile.num_layers, profile.meta.num_experts, parallel.devices)
        return Plan(placement, parallel)
