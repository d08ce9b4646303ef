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

from repro.atomic import atomic_dir
from repro.errors import ConfigError
from repro.parallel import ParallelConfig, check_devices_per_node
from repro.traces import RoutingTrace


@dataclass(frozen=True)
class Placement:
    """physical_to_logical int[L, P]: the logical expert held in physical slot p of MoE layer l.

    P = E + r x D with r >= 0 redundant slots per device (SGLang's `--ep-num-redundant-experts`); an expert may
    have several replicas. Two optional fields decide which replica serves a remote token (`dispatch_device`):
    devices_per_node (None: every device in one node) and expert_load float[L, E] (expected activations per
    expert, from the profile; None: every expert equally loaded). Neither matters without replication.
    """

    physical_to_logical: np.ndarray
    num_devices: int
    num_experts: int
    devices_per_node: int | None = None
    expert_load: np.ndarray | None = None

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
        if self.devices_per_node is not None:
            check_devices_per_node(self.num_devices, self.devices_per_node)
        if self.expert_load is not None:
            load = np.asarray(self.expert_load, dtype=np.float64)
            if load.shape != (num_layers, self.num_experts) or not np.all(np.isfinite(load)) or np.any(load < 0):
                raise ConfigError(
                    f"placement expert_load must be finite activation counts >= 0 of shape "
                    f"{(num_layers, self.num_experts)}, got shape {load.shape}; pass the profile's expert loads."
                )
            object.__setattr__(self, "expert_load", load)

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

    @property
    def is_replicated(self) -> bool:
        """True when some expert has more than one physical slot (P > E)."""
        return self.num_slots > self.num_experts

    def node_of_device(self) -> np.ndarray:
        """int[D] node of each device (devices_per_node consecutive devices per node; one node when None)."""
        return np.arange(self.num_devices) // (self.devices_per_node or self.num_devices)

    def dispatch_device(self, seed: int = 0) -> np.ndarray:
        """int[L, D, E] the device that source device s sends expert e's tokens to: a static table (SGLang's
        `static` dispatch, fixed per layer, source device and expert).

        The rule, the only place it lives (the evaluator, the simulator and real execution all read this table):
        1. local: a replica on s itself serves s's tokens;
        2. nearest: otherwise only replicas on s's node are candidates when there is one, else all replicas;
        3. least loaded: among the candidates, the device with the least expected load so far, where load is
           filled like water over sources s = 0, 1, ..., D-1 in turn. Each source sends an equal share
           expert_load[l, e] / D of expert e (uniform when expert_load is None); every device starts with the
           shares of the sources it serves locally (its own, for each expert it holds), and each remote choice
           adds the source's share to the chosen device before the next source picks. Within one source all
           experts choose against the same loads;
        4. ties (equal load) go to the first candidate in device order seed, seed + 1, ... (mod D), so seed 0
           picks the lowest device id.
        The expected loads assume each source sends an equal share of every expert; the evaluator counts the
        activations each replica really serves. Without replication every expert has one device and the table is
        expert_device broadcast over sources.
        """
        present = self.replicas() > 0  # [L, E, D]
        num_layers, num_devices = self.num_layers, self.num_devices
        if not self.is_replicated:
            return np.ascontiguousarray(np.broadcast_to(self.expert_device()[:, None, :], (num_layers, num_devices, self.num_experts)))
        load = np.ones((num_layers, self.num_experts)) if self.expert_load is None else self.expert_load
        share = load / num_devices  # [L, E]
        device_load = np.einsum("le,led->ld", share, present.astype(np.float64))  # [L, D]
        node = self.node_of_device()
        tie_rank = (np.arange(num_devices) - seed) % num_devices  # [D] lower wins
        layer = np.repeat(np.arange(num_layers), self.num_experts).reshape(num_layers, self.num_experts)
        out = np.empty((num_layers, num_devices, self.num_experts), dtype=np.int64)
        for source in range(num_devices):  # D vectorised steps over all layers and experts
            near = present & (node == node[source])[None, None, :]
            candidate = np.where(near.any(axis=2, keepdims=True), near, present)  # [L, E, D]
            candidate_load = np.where(candidate, device_load[:, None, :], np.inf)
            least = candidate & (candidate_load <= candidate_load.min(axis=2, keepdims=True))
            choice = np.argmin(np.where(least, tie_rank, num_devices), axis=2)  # [L, E]
            local = present[:, :, source]
            out[:, source] = np.where(local, source, choice)
            remote = ~local
            np.add.at(device_load, (layer[remote], choice[remote]), share[remote])
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

    def save(self, directory: str | Path) -> None:
        """Write physical_to_logical.npy, expert_load.npy (when set) and placement.json (no pickle)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        np.save(directory / "physical_to_logical.npy", self.physical_to_logical, allow_pickle=False)
        if self.expert_load is not None:
            np.save(directory / "expert_load.npy", self.expert_load, allow_pickle=False)
        meta = {"num_devices": self.num_devices, "num_experts": self.num_experts, "devices_per_node": self.devices_per_node}
        (directory / "placement.json").write_text(json.dumps(meta))

    @classmethod
    def load(cls, directory: str | Path, num_devices: int, num_experts: int) -> Placement:
        """Read what `save` wrote (directories without placement.json or expert_load.npy: those fields None)."""
        directory = Path(directory)
        try:
            p2l = np.load(directory / "physical_to_logical.npy", allow_pickle=False)
        except OSError as e:
            raise ConfigError(f"{directory} holds no physical_to_logical.npy ({e}); write the plan with plan.save().") from e
        meta_path, load_path = directory / "placement.json", directory / "expert_load.npy"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        if meta and (meta["num_devices"], meta["num_experts"]) != (num_devices, num_experts):
            raise ConfigError(
                f"the placement in {directory} is for {meta['num_devices']} devices and {meta['num_experts']} experts, "
                f"not {num_devices} and {num_experts}; load it with the parallel config and model it was fitted for."
            )
        expert_load = np.load(load_path, allow_pickle=False) if load_path.exists() else None
        return cls(p2l, num_devices, num_experts, meta.get("devices_per_node"), expert_load)

    def to_sglang(self, layer_ids: tuple[int, ...], num_hidden_layers: int) -> dict:
        """SGLang `--init-expert-location` format A: rows for all model layers, dense ones trivial."""
        rows = np.tile(np.arange(self.num_slots) % self.num_experts, (num_hidden_layers, 1))
        rows[list(layer_ids)] = self.physical_to_logical
        return {"physical_to_logical_map": rows.tolist()}


def even_counts(total: int, parts: int) -> np.ndarray:
    """int[parts] the most even split of `total` (reduce-scatter slice sizes)."""
    return np.full(parts, total // parts, dtype=np.int64) + (np.arange(parts) < total % parts)


def even_counts_of(totals: np.ndarray, parts: int) -> np.ndarray:
    """int64[S, parts]: even_counts of each of totals int[S]."""
    totals = np.asarray(totals, dtype=np.int64)[:, None]
    return totals // parts + (np.arange(parts) < totals % parts)


class Plan:
    """Vanilla online behaviour: round-robin requests (DP) and contiguous token slices (TP).

    Systems subclass this and override what they schedule differently. `info` carries scalars worth
    reporting (solver status, share of tokens moved by the TP align step, ...). A plan whose request assignment
    reads the engine's live state sets `reads_load = True`; it then accepts `assign_requests(..., load=RankLoad)`
    (repro.systems.load), one request per call, from whoever has the state (simulator, router).
    """

    reads_load = False

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

    def shuffle_steps(
        self, token_ids: np.ndarray, step_sizes: np.ndarray, layer: int, prev_experts: np.ndarray | None, **extra
    ) -> tuple[np.ndarray, np.ndarray]:
        """shuffle_tokens of S steps at once (the simulator prices a block of iterations per layer in one call).

        token_ids int32[N] hold the steps' tokens one step after another (step s: step_sizes[s] of them);
        prev_experts int[N, h, k] and any `extra` per-token array likewise. Returns (permutation int64[N],
        counts int64[S, D]) where permutation[a:b] over step s's positions a..b-1 is that step's own
        shuffle_tokens permutation plus a, and counts[s] its counts. Here: one shuffle_tokens call per step;
        a system whose shuffle is vectorised overrides it with the same result."""
        if type(self).shuffle_tokens is Plan.shuffle_tokens:  # contiguous slices: nothing to call per step
            return np.arange(len(token_ids)), even_counts_of(step_sizes, self.parallel.devices)
        permutations, counts, start = [], [], 0
        for size in np.asarray(step_sizes, dtype=np.int64).tolist():
            part = slice(start, start + size)
            perm, per_rank = self.shuffle_tokens(token_ids[part], layer, None if prev_experts is None else
                                                 prev_experts[part], **{k: v[part] for k, v in extra.items()})
            permutations.append(np.asarray(perm, dtype=np.int64) + start)
            counts.append(np.asarray(per_rank, dtype=np.int64))
            start += size
        return (np.concatenate(permutations) if permutations else np.zeros(0, np.int64),
                np.array(counts, dtype=np.int64).reshape(len(counts), self.parallel.devices))

    def save(self, directory: str | Path) -> None:
        """Write the plan's folder (`write_files`) atomically: filled in a temporary sibling, then swapped in, so
        a reader or a kill never sees a folder mixing two plans. An existing folder is replaced only when it holds
        a saved plan (physical_to_logical.npy); anything else there is refused, never deleted."""
        directory = Path(directory)
        if directory.is_dir() and any(directory.iterdir()) and not (directory / "physical_to_logical.npy").exists():
            raise ConfigError(f"{directory} exists and holds no saved plan; give plan.save() a new or plan folder.")
        if directory.exists() and not directory.is_dir():
            raise ConfigError(f"{directory} is a file; give plan.save() a folder path.")
        atomic_dir(directory, self.write_files, replace=True)

    def write_files(self, directory: Path) -> None:
        """Write the placement (`Placement.save`) and plan_info.json (`to_sglang` gives the engine format) into an
        existing folder; subclasses add their tables here (save makes it atomic)."""
        self.placement.save(directory)
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
