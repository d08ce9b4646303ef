"""What every system produces: a Placement of experts on devices plus online schedulers (a Plan).

Legend: L MoE layers, E logical experts per layer, D devices (EP ranks), P physical slots per layer
(P = D x slots_per_device; slot p lives on device p // slots_per_device, SGLang's rule), T tokens in a step,
R requests, h layers of routing history, k experts per token.

A System is fitted offline on the profile split and returns a Plan; the evaluator then only calls
`plan.placement`, `plan.assign_requests` (Attention-DP) and `plan.shuffle_tokens` (Attention-TP), so a new
system plugs in without touching the evaluator.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from repro.errors import ConfigError
from repro.parallel import ParallelConfig
from repro.traces import RoutingTrace


@dataclass(frozen=True)
class Placement:
    """physical_to_logical int[L, P]: the logical expert held in physical slot p of MoE layer l."""

    physical_to_logical: np.ndarray
    num_devices: int
    num_experts: int

    def __post_init__(self) -> None:
        p2l = np.asarray(self.physical_to_logical)
        object.__setattr__(self, "physical_to_logical", p2l.astype(np.int64, copy=False))
        if p2l.ndim != 2:
            raise ConfigError(f"physical_to_logical must be 2-D [layers, slots], got shape {p2l.shape}.")
        num_layers, num_slots = p2l.shape
        if num_slots % self.num_devices:
            raise ConfigError(
                f"{num_slots} physical slots per layer do not split over {self.num_devices} devices; "
                "the slot count must be a multiple of the EP degree."
            )
        if p2l.size and (p2l.min() < 0 or p2l.max() >= self.num_experts):
            raise ConfigError(f"placement names expert ids outside 0..{self.num_experts - 1}.")
        counts = np.zeros((num_layers, self.num_experts), dtype=np.int64)
        np.add.at(counts, (np.repeat(np.arange(num_layers), num_slots), p2l.ravel()), 1)
        missing = np.argwhere(counts == 0)
        if len(missing):
            layer, expert = missing[0]
            raise ConfigError(f"placement misses expert {expert} in layer {layer}; every expert needs a slot.")
        if num_slots == self.num_experts and np.any(counts > 1):
            layer, expert = np.argwhere(counts > 1)[0]
            raise ConfigError(f"placement lists expert {expert} twice in layer {layer} and has no redundant slots.")

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def num_slots(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def slots_per_device(self) -> int:
        return self.num_slots // self.num_devices

    def slot_device(self) -> np.ndarray:
        """int[P] device of each physical slot."""
        return np.arange(self.num_slots) // self.slots_per_device

    def replicas(self) -> np.ndarray:
        """int[L, E, D] how many replicas of expert e layer l has on device d."""
        out = np.zeros((self.num_layers, self.num_experts, self.num_devices), dtype=np.int64)
        layer = np.repeat(np.arange(self.num_layers), self.num_slots)
        np.add.at(out, (layer, self.physical_to_logical.ravel(), np.tile(self.slot_device(), self.num_layers)), 1)
        return out

    def expert_device(self) -> np.ndarray:
        """int[L, E] the device of each expert (its first replica; exact when there is no replication)."""
        return np.argmax(self.replicas() > 0, axis=2)

    def dispatch_device(self, seed: int = 0) -> np.ndarray:
        """int[L, D, E] the device that source device d sends expert e's tokens to.

        SGLang's `static` dispatch: a local replica when there is one, otherwise a fixed, seeded, fair pick
        among the expert's replicas. Without replication this is expert_device broadcast over d.
        """
        present = self.replicas() > 0  # [L, E, D]
        rng = np.random.default_rng(seed)
        src = np.arange(self.num_devices)[:, None]
        out = np.empty((self.num_layers, self.num_devices, self.num_experts), dtype=np.int64)
        for layer in range(self.num_layers):  # per layer keeps the D x E x D priorities small at DeepSeek scale
            # random priority per (source, expert, candidate device); the highest present candidate wins
            priority = rng.random((self.num_devices, self.num_experts, self.num_devices), dtype=np.float32)
            priority[:, ~present[layer]] = -1.0
            local = present[layer].T  # [D(source), E]
            out[layer] = np.where(local, src, np.argmax(priority, axis=2))
        return out

    @classmethod
    def from_expert_device(cls, expert_device: np.ndarray, num_devices: int) -> Placement:
        """Build a no-replication placement from int[L, E] expert -> device (exactly E/D per device)."""
        expert_device = np.asarray(expert_device, dtype=np.int64)
        num_layers, num_experts = expert_device.shape
        per_device = np.apply_along_axis(np.bincount, 1, expert_device, minlength=num_devices)
        if np.any(per_device != num_experts // num_devices) or num_experts % num_devices:
            layer = int(np.argmax(np.any(per_device != num_experts // num_devices, axis=1)))
            raise ConfigError(
                f"layer {layer} places {per_device[layer].tolist()} experts per device; each of the "
                f"{num_devices} devices needs exactly {num_experts // num_devices}."
            )
        # stable sort by device keeps experts in id order inside a device
        return cls(np.argsort(expert_device, axis=1, kind="stable"), num_devices, num_experts)

    def to_sglang(self, layer_ids: tuple[int, ...], num_hidden_layers: int) -> dict:
        """SGLang `--init-expert-location` format A: rows for all model layers, dense ones trivial."""
        rows = np.tile(np.arange(self.num_slots) % self.num_experts, (num_hidden_layers, 1))
        rows[list(layer_ids)] = self.physical_to_logical
        return {"physical_to_logical_map": rows.tolist()}


def even_counts(total: int, parts: int) -> np.ndarray:
    """int[parts] the most even split of `total` (reduce-scatter slice sizes)."""
    return np.full(parts, total // parts, dtype=np.int64) + (np.arange(parts) < total % parts)


class Plan:
    """Vanilla online behaviour: round-robin requests (DP) and contiguous token slices (TP).

    Systems subclass this and override what they schedule differently. `info` carries scalars worth
    reporting (solver status, share of tokens moved by the TP align step, ...).
    """

    def __init__(self, placement: Placement, parallel: ParallelConfig, info: dict | None = None):
        self.placement = placement
        self.parallel = parallel
        self.info: dict = dict(info or {})
        self.reset()

    def reset(self) -> None:
        """Forget online state (round-robin position, masks) before a new evaluation."""
        self._next_rank = 0

    def assign_requests(self, token_ids: np.ndarray, offsets: np.ndarray, prefill_len: np.ndarray) -> np.ndarray:
        """int[R] DP rank for each request, streaming: later calls continue where earlier ones stopped.

        token_ids int32[N] and offsets int64[R+1] as in a trace; prefill_len int32[R] marks the prompt (the
        only part a scheduler may look at).
        """
        num_requests = len(offsets) - 1
        ranks = (self._next_rank + np.arange(num_requests)) % self.parallel.devices
        self._next_rank = (self._next_rank + num_requests) % self.parallel.devices
        return ranks

    def shuffle_tokens(
        self, token_ids: np.ndarray, layer: int, prev_experts: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Order the T tokens of one step for the reduce-scatter before MoE layer `layer`.

        token_ids int32[T]; prev_experts int[T, h, k] true routing of the h previous MoE layers (None at the
        first). Returns (permutation int[T], per_rank_counts int[D]): rank d receives tokens
        permutation[sum(counts[:d]) : sum(counts[:d+1])]; counts are equal up to one (reduce-scatter).
        """
        return np.arange(len(token_ids)), even_counts(len(token_ids), self.parallel.devices)

    def save(self, directory: str | Path) -> None:
        """Write physical_to_logical.npy and plan_info.json for inspection (`to_sglang` gives the engine format)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        np.save(directory / "physical_to_logical.npy", self.placement.physical_to_logical, allow_pickle=False)
        (directory / "plan_info.json").write_text(json.dumps(self.info, indent=1, default=float))


class System(Protocol):
    """Offline fitting on the profile split; `name` is the registry key.

    `kind` says what its LAR means: "system" (deployable, fitted on the profile; the default, so ordinary
    systems need not set it), "bound" (a proven ceiling: it also sets `bound_constraint`, one sentence saying
    what it bounds under which constraint, and its plan.info carries `lar_bound` float and `lar_bound_per_layer`
    list[float], while the plan itself evaluates to a feasible witness below the ceiling) or "hindsight" (fitted
    on the evaluated routing, neither deployable nor a ceiling). Read it as getattr(system, "kind", "system").
    """

    name: str
    kind: str = "system"

    def fit(self, profile: RoutingTrace, parallel: ParallelConfig, rng: np.random.Generator) -> Plan: ...
