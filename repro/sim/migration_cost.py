"""What a change of placement costs in bytes over the links and in seconds of serving (issue 34, item 4).

Pure functions: placements (or copy counts) in, arrays and one small record out. The copy counts come from the
shared repro.systems.migration (`experts_received`); this module only routes and prices them.

    routes = copy_routes(old, new, devices_per_node)          # CopyRoutes: copies per layer, device and link
    cost   = price_migration(old, new, shape, hardware, mode)  # MigrationCost: bytes, layer seconds, stall, slowdown

The model, stated once (docs/migration.md gives its sources and its measured errors):
1. **Bytes of one expert** (`expert_weight_bytes`): the routed expert's three matrices, gate and up (H x I each)
   and down (I x H), times the bytes of one weight (the shape's dtype_bytes unless `bytes_per_weight` says
   otherwise, e.g. 1 for FP8, ~0.56 for NVFP4 with its scales). Biases, the gate (router) and shared experts do
   not move: they are replicated on every rank.
2. **Where a copy comes from** (`copy_routes`): device d receives expert e of layer l when the new placement holds
   more replicas of e on d than the old one did (experts_received). A device that already holds e copies it in its
   own memory (a local copy: no link, priced at nothing beside the transfers). Otherwise the copy is read from the lowest-id device
   that holds e in the old placement on d's own node (NVLink); only when no device of d's node holds it does it
   come from the lowest-id holder on another node (RDMA). Why lowest id: deterministic, and the engines pick one
   holder by a fixed rule too; why the same node first: NVLink is ~8x the RDMA bandwidth per GPU.
3. **Seconds of one layer** (`layer_transfer_seconds`): the layer's copies travel in one batch of point-to-point
   transfers (vLLM's rearrangement posts one batch_isend_irecv per layer; SGLang's per chunk of layers); it lasts
   the collective latency plus, per link level, the busiest device's max(bytes sent, bytes received) over that
   level's per-device bandwidth (the profile's `collective` NVLink / RDMA numbers: large NCCL transfers), the two
   levels running at the same time (the same rule as the all-to-all's `phase_seconds`), plus `layer_overhead_s`,
   a fixed cost per layer that moves anything (the host builds and posts the layer's transfers and waits for
   them; the engines' published stalls are dominated by it, docs/migration.md: 0 by default, and
   `python -m repro.sim.validation` fits it on one published row). A layer with nothing to move costs nothing.
4. **Synchronous** (`mode="sync"`): every rank stops serving; the layers move one after another, so the stall is
   `host_seconds` (the rebalancing algorithm and building the transfer list, on the host) plus the sum of the
   layer seconds. The new placement serves from the end of the stall.
5. **Asynchronous** (`mode="async"`): serving goes on; the layers move one after another on a side stream that
   takes `bandwidth_share` s (0 < s < 1) of every link, so each layer's transfer lasts overhead + latency + (its
   bandwidth seconds) / s, and serving keeps 1 - s of the links while the migration runs: the all-to-all's and the
   collectives' bandwidth terms take 1 / (1 - s) times as long (`a2a_slowdown`; `links_shared` gives the
   hardware serving sees meanwhile; a measured all-to-all table has all its seconds scaled, latency included,
   since it does not split them). Expert compute is not slowed (copies use the copy engines, not the SMs). The
   new placement serves from the end of the last layer's transfer (its dispatch tables switch then, atomically
   for all layers, as vLLM's async EPLB does before it frees the old buffers).

Legend: L MoE layers, E experts, D devices.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from repro.errors import ConfigError
from repro.sim.hardware import Hardware, Phase
from repro.sim.shapes import ModelShape
from repro.systems.base import Placement
from repro.systems.migration import experts_received

MODES = ("sync", "async")


def expert_weight_bytes(shape: ModelShape, bytes_per_weight: float | None = None) -> float:
    """Bytes of one routed expert: gate, up and down matrices (3 x hidden x moe_intermediate) x bytes per weight
    (the shape's dtype_bytes when None)."""
    per_weight = shape.dtype_bytes if bytes_per_weight is None else bytes_per_weight
    if isinstance(per_weight, bool) or not isinstance(per_weight, int | float) or not np.isfinite(per_weight) or per_weight <= 0:
        raise ConfigError(f"bytes per expert weight must be a finite number > 0 (2 for bf16, 1 for fp8), got {per_weight!r}.")
    return 3.0 * shape.hidden_size * shape.moe_intermediate_size * float(per_weight)


@dataclass(frozen=True)
class CopyRoutes:
    """Expert copies of one migration by layer, device and link level (all int64[L, D]).

    received_local + received_nvlink + received_rdma == experts_received(old, new) (local: an extra replica of an
    expert the device already holds, copied in its own memory); sent_* count the copies each device reads out
    for others (a device that holds an expert several receivers need sends it once per receiver).
    """

    received_local: np.ndarray
    received_nvlink: np.ndarray
    received_rdma: np.ndarray
    sent_nvlink: np.ndarray
    sent_rdma: np.ndarray

    @property
    def received(self) -> np.ndarray:
        """int64[L, D] copies each device receives (local and over both link levels)."""
        return self.received_local + self.received_nvlink + self.received_rdma

    @property
    def experts_moved(self) -> int:
        """Copies moved in all layers (what `experts_received(...).sum()` counts)."""
        return int(self.received.sum())


LINKS = ("local", "nvlink", "rdma")  # the link column of expert_copies, by index


def expert_copies(old: Placement, new: Placement, devices_per_node: int) -> np.ndarray:
    """int64[M, 5] one row per expert copy that going from `old` to `new` makes: (layer, expert, from_device,
    to_device, link), link an index into LINKS (rule 2 of the module docstring: local when to_device holds the
    expert already, else NVLink from the lowest-id holder on its node, else RDMA from the lowest-id holder).
    Rows in (layer, expert, to_device) order; a device that needs two more replicas of one expert has two rows.

    devices_per_node: consecutive devices per node of the machine that serves (the hardware's); must divide D.
    """
    received = experts_received(old, new)  # checks the shapes; int[L, D]
    num_devices = received.shape[1]
    if isinstance(devices_per_node, bool) or not isinstance(devices_per_node, int | np.integer) or devices_per_node < 1 \
            or num_devices % min(int(devices_per_node), num_devices):
        raise ConfigError(f"devices_per_node must be an integer >= 1 that divides the {num_devices} devices, got {devices_per_node!r}.")
    before, after = old.replicas(), new.replicas()  # int[L, E, D]
    need = np.maximum(after - before, 0)  # int[L, E, D] copies device d receives of expert e
    layer, expert, to_device = np.nonzero(need)  # C-order: (layer, expert, to_device)
    repeat = need[layer, expert, to_device]
    layer, expert, to_device = (np.repeat(a, repeat) for a in (layer, expert, to_device))
    held = before[layer, expert] > 0  # bool[M, D] old holders of each copy's expert
    node = np.arange(num_devices) // int(devices_per_node)
    near = held & (node[None, :] == node[to_device][:, None])
    has_near = near.any(axis=1)
    from_device = np.where(has_near, np.argmax(near, axis=1), np.argmax(held, axis=1))  # lowest id of the candidates
    local = held[np.arange(len(layer)), to_device]
    from_device = np.where(local, to_device, from_device)
    link = np.where(local, 0, np.where(has_near, 1, 2))
    return np.stack([layer, expert, from_device, to_device, link], axis=1).astype(np.int64).reshape(-1, 5)


def copy_routes(old: Placement, new: Placement, devices_per_node: int) -> CopyRoutes:
    """`expert_copies` counted per layer, device and link (received by to_device, sent by from_device)."""
    copies = expert_copies(old, new, devices_per_node)
    num_layers, num_devices = old.num_layers, old.num_devices
    out = {}
    for index, level in enumerate(LINKS):
        rows = copies[copies[:, 4] == index]
        for role, column in (("received", 3), ("sent", 2)):
            counts = np.zeros((num_layers, num_devices), dtype=np.int64)
            np.add.at(counts, (rows[:, 0], rows[:, column]), 1)
            out[f"{role}_{level}"] = counts
    del out["sent_local"]  # a local copy reads the device's own memory
    return CopyRoutes(**out)


def layer_transfer_seconds(routes: CopyRoutes, expert_bytes: float, hardware: Hardware) -> np.ndarray:
    """float64[L] seconds each layer's copies spend on the links at their full bandwidth (rule 3): latency + max
    over link levels of the busiest device's max(sent, received) bytes / that level's bandwidth; 0 for a layer
    that moves nothing over a link."""
    times = []
    for sent, received, bandwidth in ((routes.sent_nvlink, routes.received_nvlink, hardware.collective_nvlink),
                                      (routes.sent_rdma, routes.received_rdma, hardware.collective_rdma)):
        busiest = np.maximum(sent, received).max(axis=1) * float(expert_bytes)  # [L]
        if np.any(busiest > 0) and bandwidth <= 0:
            raise ConfigError(f"hardware {hardware.name!r} has no bandwidth for copies across nodes (collective.rdma_gbps is 0); set it.")
        times.append(busiest / bandwidth if bandwidth > 0 else np.zeros_like(busiest))
    moves = (routes.received_nvlink + routes.received_rdma).sum(axis=1) > 0
    return np.where(moves, hardware.collective_latency + np.maximum(times[0], times[1]), 0.0)


@dataclass(frozen=True)
class MigrationCost:
    """What one change of placement costs (rules 1-5 of the module docstring).

    expert_bytes: bytes of one expert. copies_received / copies_rdma: int64[L, D] copies each device receives,
    and how many of them cross nodes. bytes_received / bytes_sent: float64[L, D]. layer_seconds: float64[L] each
    layer's transfer in this mode (sync: full bandwidth; async: at the bandwidth share), its overhead included;
    layer_overhead_s and host_seconds as given. stall_s: seconds every
    rank stops serving (sync: host + sum of layers; async: 0). duration_s: seconds from the start of the change
    until the new placement serves (sync: = stall_s; async: host + sum of layers). a2a_slowdown: factor on
    all-to-all time while the migration runs (sync 1.0: nothing is served; async 1 / (1 - share)).
    """

    mode: str
    bandwidth_share: float
    expert_bytes: float
    copies_received: np.ndarray
    copies_rdma: np.ndarray
    bytes_received: np.ndarray
    bytes_sent: np.ndarray
    layer_seconds: np.ndarray
    layer_overhead_s: float
    host_seconds: float
    stall_s: float
    duration_s: float
    a2a_slowdown: float

    @property
    def experts_moved(self) -> int:
        return int(self.copies_received.sum())

    @property
    def bytes_moved(self) -> float:
        return float(self.bytes_received.sum())

    def summary(self) -> dict:
        """Scalars worth reporting (JSON-ready)."""
        return {"mode": self.mode, "bandwidth_share": self.bandwidth_share, "experts_moved": self.experts_moved,
                "experts_moved_rdma": int(self.copies_rdma.sum()), "bytes_moved": self.bytes_moved,
                "stall_s": self.stall_s, "duration_s": self.duration_s, "a2a_slowdown": self.a2a_slowdown}


def check_migration_mode(mode: str, bandwidth_share: float, host_seconds: float = 0.0,
                         layer_overhead_s: float = 0.0) -> None:
    """One ConfigError naming the bad value: mode in MODES; async needs 0 < bandwidth_share < 1; host seconds and
    the per-layer overhead finite and >= 0."""
    if mode not in MODES:
        raise ConfigError(f"migration mode must be one of {MODES}, got {mode!r}.")
    share_ok = isinstance(bandwidth_share, int | float) and not isinstance(bandwidth_share, bool) and np.isfinite(bandwidth_share)
    if mode == "async" and not (share_ok and 0 < bandwidth_share < 1):
        raise ConfigError(f"an async migration's bandwidth_share must lie strictly between 0 and 1 (the all-to-all keeps "
                          f"the rest), got {bandwidth_share!r}.")
    for name, value in (("host_seconds", host_seconds), ("layer_overhead_s", layer_overhead_s)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value) or value < 0:
            raise ConfigError(f"migration {name} must be a finite number >= 0, got {value!r}.")


def price_routes(routes: CopyRoutes, expert_bytes: float, hardware: Hardware, mode: str = "sync",
                 bandwidth_share: float = 1.0, host_seconds: float = 0.0, layer_overhead_s: float = 0.0) -> MigrationCost:
    """Price already-routed copies (rules 3-5); `price_migration` routes them from two placements first."""
    check_migration_mode(mode, bandwidth_share, host_seconds, layer_overhead_s)
    full = layer_transfer_seconds(routes, expert_bytes, hardware)  # [L]
    latency = np.where(full > 0, hardware.collective_latency, 0.0)
    overhead = np.where(full > 0, float(layer_overhead_s), 0.0)
    if mode == "sync":
        layer_seconds, share, slowdown = overhead + full, 1.0, 1.0
    else:
        share = float(bandwidth_share)
        layer_seconds, slowdown = overhead + latency + (full - latency) / share, 1.0 / (1.0 - share)
    duration = float(host_seconds + layer_seconds.sum())
    received = routes.received
    sent = routes.sent_nvlink + routes.sent_rdma
    if not received.any():  # nothing moves: no event, so no host work either, nothing stalls, nothing slows
        duration, slowdown = 0.0, 1.0
    return MigrationCost(
        mode=mode, bandwidth_share=share, expert_bytes=float(expert_bytes), copies_received=received,
        copies_rdma=routes.received_rdma, bytes_received=received * float(expert_bytes),
        bytes_sent=sent * float(expert_bytes), layer_seconds=layer_seconds, layer_overhead_s=float(layer_overhead_s),
        host_seconds=float(host_seconds),
        stall_s=duration if mode == "sync" else 0.0, duration_s=duration, a2a_slowdown=slowdown,
    )


def price_migration(old: Placement, new: Placement, shape: ModelShape, hardware: Hardware, mode: str = "sync",
                    bandwidth_share: float = 1.0, host_seconds: float = 0.0,
                    bytes_per_weight: float | None = None, layer_overhead_s: float = 0.0) -> MigrationCost:
    """The cost of serving `new` instead of `old` on `hardware` (rules 1-5 of the module docstring).

    old, new: placements of the same shape (L, E, D, P). mode "sync" or "async"; bandwidth_share: the share of
    every link an async migration takes (ignored for sync); host_seconds: host work per event (the rebalancing
    algorithm), added before the first transfer; bytes_per_weight: the weights' storage (None: shape.dtype_bytes);
    layer_overhead_s: fixed seconds per layer that moves anything (rule 3).
    """
    check_migration_mode(mode, bandwidth_share, host_seconds, layer_overhead_s)
    expert_bytes = expert_weight_bytes(shape, bytes_per_weight)
    routes = copy_routes(old, new, min(hardware.devices_per_node, old.num_devices))
    return price_routes(routes, expert_bytes, hardware, mode, bandwidth_share, host_seconds, layer_overhead_s)


def links_shared(hardware: Hardware, share: float) -> Hardware:
    """The hardware serving sees while an async migration takes `share` (0 < share < 1) of every link (rule 5):
    every all-to-all and collective bandwidth x (1 - share), measured all-to-all seconds / (1 - share); latencies,
    compute and memory unchanged."""
    check_migration_mode("async", share)
    keep = 1.0 - float(share)

    def phase(p: Phase) -> Phase:
        table = None if p.measured is None else p.measured * np.array([1.0, 1.0 / keep])
        return replace(p, nvlink_bandwidth=p.nvlink_bandwidth * keep, rdma_bandwidth=p.rdma_bandwidth * keep, measured=table)

    backends = {name: replace(b, dispatch=phase(b.dispatch), combine=phase(b.combine)) for name, b in hardware.backends.items()}
    return replace(hardware, backends=backends, collective_nvlink=hardware.collective_nvlink * keep,
                   collective_rdma=hardware.collective_rdma * keep)
