"""What moving from one placement to another costs in expert copies, and the device relabelling that minimises it.

Pure functions over `Placement`s of the same shape (L layers, E experts, D devices, P slots). A device must
receive an expert's weights when the new placement holds more replicas of it there than the old one did; slot order
inside a device is free (an engine rewrites its local slot table without moving weights).

    received = experts_received(old, new)              # int[L, D] expert copies each device must receive
    perm     = min_move_permutation(old, new)          # int[D]: new device b becomes device perm[b]
    new_min  = relabel_devices(new, perm)              # same grouping of experts, fewest copies moved

Why a relabelling: a re-fit (co-clustering, EPLB's packing) returns groups of experts whose device ids are arbitrary;
renaming the devices changes nothing a request sees once the DP ranks are renamed with them, yet it decides how
many experts cross the links (deepseek-ai/EPLB #25). One permutation for all layers (`per_layer=False`) keeps a
device's experts on the same Attention-DP rank in every layer, which Sem-MoE's request-to-rank affinity needs;
per-layer permutations (`per_layer=True`) suit placements without DP affinity (EPLB).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment

from repro.errors import ConfigError
from repro.systems.base import Placement


def _check_same_shape(old: Placement, new: Placement) -> None:
    if (old.num_layers, old.num_experts, old.num_devices, old.num_slots) != (
        new.num_layers, new.num_experts, new.num_devices, new.num_slots
    ):
        raise ConfigError(
            f"cannot migrate between placements of different shapes: {old.num_layers} layers x {old.num_experts} "
            f"experts x {old.num_devices} devices x {old.num_slots} slots vs {new.num_layers} x {new.num_experts} x "
            f"{new.num_devices} x {new.num_slots}; re-fit for the same model and parallel config."
        )


def device_overlap(old: Placement, new: Placement) -> np.ndarray:
    """int[L, D, D] overlap[l, a, b]: expert copies old device a holds in layer l that new device b also needs
    (sum over experts of min(replicas on a before, replicas on b after))."""
    _check_same_shape(old, new)
    before, after = old.replicas(), new.replicas()  # [L, E, D]
    return np.minimum(before[:, :, :, None], after[:, :, None, :]).sum(axis=1)


def experts_received(old: Placement, new: Placement) -> np.ndarray:
    """int[L, D] expert copies device d must receive in layer l to go from `old` to `new` (weights moved)."""
    _check_same_shape(old, new)
    return np.maximum(new.replicas() - old.replicas(), 0).sum(axis=1)


def min_move_permutation(old: Placement, new: Placement, per_layer: bool = False) -> np.ndarray:
    """The relabelling of `new`'s devices that keeps the most expert copies where `old` has them.

    Returns int[D] (one permutation for every layer) or int[L, D] (per_layer): new device b becomes device
    perm[b]. A maximum-weight assignment on the device overlap (Hungarian, scipy), so exact, not a heuristic.
    """
    overlap = device_overlap(old, new)  # [L, D(old), D(new)]
    blocks = overlap if per_layer else overlap.sum(axis=0, keepdims=True)
    perm = np.empty((len(blocks), old.num_devices), dtype=np.int64)
    for i, block in enumerate(blocks):
        old_device, new_device = linear_sum_assignment(block, maximize=True)
        perm[i, new_device] = old_device
    return perm if per_layer else perm[0]


def relabel_devices(placement: Placement, perm: np.ndarray) -> Placement:
    """`placement` with device b renamed perm[b] (int[D], or int[L, D] per layer); slots keep their order
    inside a device."""
    perm = np.asarray(perm, dtype=np.int64)
    num_devices, per_device = placement.num_devices, placement.slots_per_device
    layers = np.broadcast_to(perm, (placement.num_layers, num_devices)) if perm.ndim == 1 else perm
    if layers.shape != (placement.num_layers, num_devices) or np.any(np.sort(layers, axis=1) != np.arange(num_devices)):
        raise ConfigError(f"a device relabelling must be a permutation of 0..{num_devices - 1} (per layer or for all).")
    p2l = np.empty_like(placement.physical_to_logical)
    for layer, row in enumerate(placement.physical_to_logical):
        blocks = row.reshape(num_devices, per_device)
        p2l[layer] = blocks[np.argsort(layers[layer])].ravel()  # new device perm[b] gets old block b
    return Placement(p2l, num_devices, placement.num_experts, placement.devices_per_node, placement.expert_load)
