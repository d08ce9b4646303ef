"""Hardware profiles (conf/hardware/*.yaml) as validated numbers: GPU roofline, link levels, all-to-all backends.

A profile describes a cluster of `nodes` x `devices_per_node` GPUs: peak dense BF16 FLOP/s and HBM bandwidth
with efficiency factors (roofline), NVLink inside a node and RDMA across nodes, and per all-to-all backend
(nccl, deepep_normal, deepep_low_latency) one parameter set per direction (dispatch, combine): a fixed latency,
the effective bandwidth of each link level, and the per-message half-bandwidth size of the message-size ramp.
`measured` tables (from repro/exec benchmarks or a GPU) override the formulas where given; `calibrated_parts`
says which. Every number's source is a comment in the YAML file. A GPU's own measurements, written by
`make gpu-check` as conf/hardware/measured/<name>.yaml, merge into the `measured` of the profile of that name.

Calibration alternatives: where the published sources leave a number open (is DeepEP's low-latency mode bound by
NVLink or by the NIC inside a node? how much does a call cost at 1-128 tokens? how much host time does an
iteration add?), a profile lists the other readings under `alternatives:`, each {source: why and from where,
set: {dotted field: value}}. An alternative may instead (or also) carry `scale: {comm: c, compute: x}`: every
all-to-all and collective time x c, every GEMM / memory time x x (`scaled_hardware`), which is how the cost
model's measured error bands re-price a result (issue 26). `load_hardware(profile, alternative=name)` prices
with one of them (`published`, the default, is the profile as written), so a result can be reported under each
(sim.calibration).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import yaml

from repro.errors import ConfigError

BACKENDS = ("nccl", "deepep_normal", "deepep_low_latency")
PUBLISHED = "published"  # the calibration alternative that is the profile as written
PHASE_FIELDS = ("latency_us", "peer_half_kb", "nvlink_gbps", "rdma_gbps")
REQUIRED = (
    "name", "nodes", "devices_per_node", "gpu.bf16_tflops", "gpu.hbm_gbps", "gpu.hbm_gb", "efficiency.gemm",
    "efficiency.attention", "efficiency.memory", "gemm_tile_tokens", "kernel_floor_us", "memory_fraction", "collective.latency_us",
    "collective.nvlink_gbps", "collective.rdma_gbps", "iteration_overhead_us",
) + tuple(
    f"a2a.{b}.{key}" for b in BACKENDS for key in ("dispatch_bytes_per_element", "combine_bytes_per_element",
                                                   "token_header_bytes")
) + tuple(f"a2a.{b}.{phase}.{f}" for b in BACKENDS for phase in ("dispatch", "combine") for f in PHASE_FIELDS)


@dataclass(frozen=True)
class Phase:
    """One direction (dispatch or combine) of one backend, in SI units (seconds, bytes, bytes/s)."""

    latency: float
    peer_half_bytes: float
    nvlink_bandwidth: float
    rdma_bandwidth: float
    measured: np.ndarray | None  # float64[n, 2] (busiest rank's remote bytes, seconds), sorted by bytes


@dataclass(frozen=True)
class Backend:
    name: str
    dispatch: Phase
    combine: Phase
    dispatch_bytes_per_element: float
    combine_bytes_per_element: float
    token_header_bytes: int

    def bytes_per_token(self, hidden_size: int) -> tuple[int, int]:
        """(dispatch, combine) bytes of one token copy on the wire."""
        return (int(np.ceil(hidden_size * self.dispatch_bytes_per_element)) + self.token_header_bytes,
                int(np.ceil(hidden_size * self.combine_bytes_per_element)))


@dataclass(frozen=True)
class Hardware:
    """Validated profile; flops and bandwidths are the achievable ones (peak x efficiency)."""

    name: str
    nodes: int
    devices_per_node: int
    gemm_flops: float  # FLOP/s a large GEMM reaches
    attention_flops: float
    memory_bandwidth: float  # bytes/s a streaming kernel reaches
    hbm_bytes: float
    memory_fraction: float
    gemm_tile_tokens: int
    kernel_floor: float  # seconds: the least any modelled kernel with work takes (launch + ramp + tail)
    iteration_overhead: float  # seconds of host time (scheduling, launches) added to every engine iteration
    collective_latency: float
    collective_nvlink: float
    collective_rdma: float
    backends: dict
    measured_expert_gemm: dict  # shape name -> float64[n, 2] (tokens of one expert, seconds)
    measured_gate: dict  # shape name -> float64[n, 2] (tokens on a rank, seconds of router GEMM + top-k)
    calibrated_parts: tuple[str, ...]
    calibration: str = PUBLISHED  # which of the profile's calibration alternatives priced this

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node


def _get(profile: dict, dotted: str):
    node = profile
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node or node[part] is None:
            raise KeyError(dotted)
        node = node[part]
    return node


def _table(rows, where: str) -> np.ndarray:
    table = np.asarray(rows, dtype=np.float64)
    if table.ndim != 2 or table.shape[1] != 2 or len(table) < 2 or np.any(table < 0):
        raise ConfigError(f"{where} must be a list of at least two [size, seconds] pairs >= 0, got {rows!r}.")
    return table[np.argsort(table[:, 0], kind="stable")]


MEASURED_DIR = Path(__file__).resolve().parents[2] / "conf" / "hardware" / "measured"


def merged_measured(profile: dict, directory: Path | None = None) -> dict:
    """The profile's `measured` section with <directory>/<name>.yaml (bench.gpu_check's output; directory None:
    MEASURED_DIR) merged in.

    The file holds {ranks: GPUs it was measured on, measured: {expert_gemm: ..., kernel_floor_us: ..., a2a: ...}}.
    The profile's own entries win (a table written into a profile is a deliberate choice). Expert GEMM tables
    and the kernel floor describe one GPU, so they always merge; all-to-all tables merge only into a profile of
    exactly `ranks` devices, since a 2-GPU curve does not price an 8-GPU all-to-all. No file: the section as is.
    """
    own = dict(profile.get("measured") or {})
    path = Path(MEASURED_DIR if directory is None else directory) / f"{profile.get('name')}.yaml"
    if not path.is_file():
        return own
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path} is not readable YAML ({type(e).__name__}); rerun make gpu-check or delete it.") from None
    found = document.get("measured") if isinstance(document, dict) else None
    if not isinstance(found, dict) or not all(isinstance(found.get(k, {}), dict) for k in ("expert_gemm", "gate", "a2a")):
        raise ConfigError(f"{path} must hold a `measured:` mapping as bench.gpu_check writes it; rerun make gpu-check or delete it.")
    merged = {**found, **own}
    for table in ("expert_gemm", "gate"):
        merged[table] = {**found.get(table, {}), **(own.get(table) or {})}
    devices = profile["nodes"] * profile["devices_per_node"]
    file_a2a = found.get("a2a", {}) if document.get("ranks") == devices else {}
    merged["a2a"] = {b: {**(file_a2a.get(b) or {}), **((own.get("a2a") or {}).get(b) or {})}
                     for b in set(file_a2a) | set(own.get("a2a") or {})}
    return merged


def calibration_alternatives(profile: dict) -> dict[str, dict]:
    """{name: {"source": str, "set": {dotted field: number}}} of the profile's `alternatives` (validated; empty when
    none); `published` (the profile as written) is implied and may not be redefined."""
    found = profile.get("alternatives") or {}
    name = profile.get("name", "<unnamed>")
    if not isinstance(found, dict):
        raise ConfigError(f"hardware profile {name!r}: alternatives must map a name to {{source, set}}, got {found!r}.")
    for alt, spec in found.items():
        where = f"hardware profile {name!r} alternative {alt!r}"
        if alt == PUBLISHED:
            raise ConfigError(f"{where}: {PUBLISHED!r} is the profile as written; give the alternative another name.")
        changes = set(spec) - {"source"} if isinstance(spec, dict) else set()
        if not changes or not changes <= {"set", "scale"} or not isinstance(spec.get("source"), str) \
                or not spec["source"].strip() or not all(isinstance(spec[k], dict) and spec[k] for k in changes):
            raise ConfigError(f"{where} must be {{source: where its numbers come from, set: {{field: value}}}} and/or "
                              f"scale: {{comm: factor, compute: factor}}, got {spec!r}.")
        scale = spec.get("scale", {"comm": 1.0, "compute": 1.0})
        if set(scale) != {"comm", "compute"} or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in scale.values()):
            raise ConfigError(f"{where} scale must be {{comm: factor > 0, compute: factor > 0}}, got {scale!r}.")
        for dotted, value in spec.get("set", {}).items():
            if dotted not in REQUIRED or dotted == "name":
                raise ConfigError(f"{where} sets {dotted!r}, which is not a numeric field of a profile (those of conf/hardware/h200.yaml).")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{where} sets {dotted} to {value!r}; it must be a number.")
    return found


def with_alternative(profile: dict, alternative: str) -> dict:
    """A copy of the profile with calibration alternative `alternative`'s fields set (`published`: unchanged; its
    `scale`, if any, is load_hardware's to apply)."""
    found = calibration_alternatives(profile)
    if alternative == PUBLISHED:
        return profile
    if alternative not in found:
        raise ConfigError(
            f"hardware profile {profile.get('name', '<unnamed>')!r} has no calibration alternative {alternative!r}; "
            f"it has {[PUBLISHED, *found]}."
        )
    out = copy.deepcopy(profile)
    for dotted, value in found[alternative].get("set", {}).items():
        *parents, leaf = dotted.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def check_hardware_config(hardware: dict) -> None:
    """The hardware group's config check (repro.config_schema composes it): every key one of a profile's
    (conf/hardware/*.yaml or REQUIRED), the top-level numbers of their type, then load_hardware's own checks (every
    number the simulator reads positive, or >= 0 where 0 means none)."""
    from repro.config_values import OPTIONAL_MAPPING, check_table, integer, option_keys, text, top_keys

    table = {"name": text(), "nodes": integer(1), "devices_per_node": integer(1), "gemm_tile_tokens": integer(1),
             "measured": OPTIONAL_MAPPING, "alternatives": OPTIONAL_MAPPING}  # alternatives: load_hardware checks them
    check_table("hardware", hardware, table, top_keys(option_keys("hardware")) | top_keys(REQUIRED))
    known = option_keys("hardware") | set(REQUIRED)

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if path not in known:
                raise ConfigError(f"hardware has no key {path!r}; a profile's keys are those of conf/hardware/h200.yaml.")
            if isinstance(value, dict) and path not in ("measured", "alternatives"):
                walk(value, path + ".")

    walk(hardware, "")
    load_hardware(hardware)


def load_hardware(profile: dict, measured_dir: Path | None = None, alternative: str = PUBLISHED) -> Hardware:
    """Validate a hardware profile dict; a missing or non-positive field is one ConfigError naming it.

    measured_dir: where a GPU's <name>.yaml is merged from (`merged_measured`; None: MEASURED_DIR). alternative: the
    calibration alternative to price with (`with_alternative`)."""
    if not isinstance(profile, dict):
        raise ConfigError(f"hardware must be a mapping (a conf/hardware/*.yaml profile), got {type(profile).__name__}.")
    name = profile.get("name", "<unnamed>")
    profile = with_alternative(profile, alternative)
    for dotted in REQUIRED:
        try:
            value = _get(profile, dotted)
        except KeyError:
            raise ConfigError(
                f"hardware profile {name!r} misses field {dotted!r}; the simulator needs every field that "
                "conf/hardware/h200.yaml lists."
            ) from None
        if dotted != "name" and (not isinstance(value, int | float) or value < 0 or (value == 0 and not dotted.endswith(
                ("latency_us", "peer_half_kb", "token_header_bytes", "rdma_gbps", "kernel_floor_us", "iteration_overhead_us")))):
            raise ConfigError(f"hardware profile {name!r}: {dotted} must be a positive number, got {value!r}.")
    measured = merged_measured(profile, measured_dir)
    parts: list[str] = []
    kernel_floor_us = measured.get("kernel_floor_us", profile["kernel_floor_us"])
    if not isinstance(kernel_floor_us, int | float) or kernel_floor_us < 0:
        raise ConfigError(f"hardware profile {name!r}: measured.kernel_floor_us must be a number >= 0, got {kernel_floor_us!r}.")
    if "kernel_floor_us" in measured:
        parts.append("kernel_floor")
    backends = {}
    for b in BACKENDS:
        cfg = profile["a2a"][b]
        phases = {}
        for phase in ("dispatch", "combine"):
            p = cfg[phase]
            rows = (measured.get("a2a") or {}).get(b, {}).get(phase)
            table = _table(rows, f"hardware {name!r} measured.a2a.{b}.{phase}") if rows else None
            if table is not None:
                parts.append(f"a2a.{b}.{phase}")
            phases[phase] = Phase(p["latency_us"] * 1e-6, p["peer_half_kb"] * 1e3, p["nvlink_gbps"] * 1e9,
                                  p["rdma_gbps"] * 1e9, table)
        backends[b] = Backend(b, phases["dispatch"], phases["combine"], float(cfg["dispatch_bytes_per_element"]),
                              float(cfg["combine_bytes_per_element"]), int(cfg["token_header_bytes"]))
    expert_tables = {
        shape: _table(rows, f"hardware {name!r} measured.expert_gemm.{shape}")
        for shape, rows in (measured.get("expert_gemm") or {}).items()
    }
    parts += [f"expert_gemm.{shape}" for shape in expert_tables]
    gate_tables = {shape: _table(rows, f"hardware {name!r} measured.gate.{shape}")
                   for shape, rows in (measured.get("gate") or {}).items()}
    parts += [f"gate.{shape}" for shape in gate_tables]
    rdma_fields = ["collective.rdma_gbps"] + [f"a2a.{b}.{phase}.rdma_gbps" for b in BACKENDS for phase in ("dispatch", "combine")]
    for dotted in rdma_fields if profile["nodes"] > 1 else ():  # across nodes, 0 GB/s would price a send at infinity
        if _get(profile, dotted) == 0:
            raise ConfigError(f"hardware profile {name!r} has {profile['nodes']} nodes but {dotted} is 0; give it a positive bandwidth.")
    gpu, eff = profile["gpu"], profile["efficiency"]
    hw = Hardware(
        name=str(name),
        nodes=int(profile["nodes"]),
        devices_per_node=int(profile["devices_per_node"]),
        gemm_flops=gpu["bf16_tflops"] * 1e12 * eff["gemm"],
        attention_flops=gpu["bf16_tflops"] * 1e12 * eff["attention"],
        memory_bandwidth=gpu["hbm_gbps"] * 1e9 * eff["memory"],
        hbm_bytes=gpu["hbm_gb"] * 1e9,
        memory_fraction=float(profile["memory_fraction"]),
        gemm_tile_tokens=int(profile["gemm_tile_tokens"]),
        kernel_floor=kernel_floor_us * 1e-6,
        iteration_overhead=profile["iteration_overhead_us"] * 1e-6,
        collective_latency=profile["collective"]["latency_us"] * 1e-6,
        collective_nvlink=profile["collective"]["nvlink_gbps"] * 1e9,
        collective_rdma=profile["collective"]["rdma_gbps"] * 1e9,
        backends=backends,
        measured_expert_gemm=expert_tables,
        measured_gate=gate_tables,
        calibrated_parts=tuple(parts),
        calibration=alternative,
    )
    scale = calibration_alternatives(profile).get(alternative, {}).get("scale")
    return hw if scale is None else scaled_hardware(hw, scale["comm"], scale["compute"])


def scaled_hardware(hw: Hardware, comm: float, compute: float) -> Hardware:
    """hw with every all-to-all and collective time x comm (latencies, 1 / bandwidths, measured tables) and every
    GEMM / memory time x compute (1 / FLOP/s, 1 / memory bandwidth, kernel floor, expert and gate tables); host time per
    iteration unchanged."""
    def phase(p: Phase) -> Phase:
        table = None if p.measured is None else p.measured * np.array([1.0, comm])
        return replace(p, latency=p.latency * comm, nvlink_bandwidth=p.nvlink_bandwidth / comm,
                       rdma_bandwidth=p.rdma_bandwidth / comm, measured=table)

    backends = {name: replace(b, dispatch=phase(b.dispatch), combine=phase(b.combine)) for name, b in hw.backends.items()}
    return replace(
        hw, gemm_flops=hw.gemm_flops / compute, attention_flops=hw.attention_flops / compute,
        memory_bandwidth=hw.memory_bandwidth / compute, kernel_floor=hw.kernel_floor * compute,
        measured_expert_gemm={k: v * np.array([1.0, compute]) for k, v in hw.measured_expert_gemm.items()},
        measured_gate={k: v * np.array([1.0, compute]) for k, v in hw.measured_gate.items()},
        collective_latency=hw.collective_latency * comm, collective_nvlink=hw.collective_nvlink / comm,
        collective_rdma=hw.collective_rdma / comm, backends=backends,
    )


def interpolate(table: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Piecewise-linear table lookup; past the last row the last segment's slope continues."""
    xs, ys = table[:, 0], table[:, 1]
    y = np.interp(x, xs, ys)
    slope = (ys[-1] - ys[-2]) / max(xs[-1] - xs[-2], 1e-30)
    return np.where(x > xs[-1], ys[-1] + (x - xs[-1]) * slope, y)
