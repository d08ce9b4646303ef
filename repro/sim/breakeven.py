"""When does co-scheduling pay: the MoE-layer time of Sem-MoE over vanilla EP, priced by the simulator's cost model.

    python -m repro.sim.breakeven --out runs/breakeven

One MoE layer in Attention-DP, on the critical path (the busiest rank): gate + dispatch + experts + combine, each
priced by repro/sim/costs.py for a model shape (conf/sim/shape) on a hardware profile (conf/hardware) with one
all-to-all backend. Attention and everything outside the MoE layer costs both systems the same and is left out,
so the ratio is that of the MoE layer alone; the throughput-under-SLO ratio needs queueing (the serving
experiments of repro.sim.simulate) and is not computed here.

The two systems differ in two numbers only:
- LAR (local activation rate): vanilla EP under uniform routing has 1/D; Sem-MoE has 1/D + gain. The busiest
  rank's remote traffic (per-rank deduplicated copies, per-node copies of DeepEP's normal kernels, and per-expert
  activations of its low-latency kernels) keeps EP's spread over the remote ranks and is scaled by
  (1 - LAR) / (1 - 1/D); the number of peers a rank talks to follows from the scaled per-token probabilities.
- imbalance f (max/mean): the busiest rank carries f x the mean token load: f x the tokens through the gate,
  f x the copies it sends and receives, f x the rows of its grouped GEMMs.
Under EP's uniform routing every per-rank count below is the exact expectation of what repro/sim/traffic.py
counts on random top-k routing (tests/test_breakeven.py checks it against `level_loads`); the counts are then
priced by `costs.phase_seconds`, `CostModel.experts` and the CostModel's GEMM roofline, not by a formula of this
module. Assumed, not measured: Sem-MoE's remote traffic keeps EP's dedup ratio and spread, and its batch reads
as many distinct experts as EP's (concentrated routing may read fewer).

Break-even gain: the smallest LAR gain at which Sem-MoE's layer time is at most EP's (0 when any gain pays,
'never' when even LAR = 1 does not pay, e.g. when the imbalance costs more compute than the all-to-all can save).

Legend: X grid points (settings priced in one call), D devices, M nodes, S expert slots per device, E experts,
k experts per token.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from repro import cli
from repro.atomic import atomic_dir
from repro.errors import ConfigError, ReproError
from repro.sim.costs import CostModel, LevelLoad, phase_seconds
from repro.sim.hardware import BACKENDS, Hardware, load_hardware
from repro.sim.shapes import ModelShape, RoutingMap

CONF = Path(__file__).resolve().parents[2] / "conf"
PARTS = ("gate", "dispatch", "experts", "combine")
GENERATOR = "repro.sim.breakeven"  # written into breakeven.json; an --out holding another program's files is refused
RESULT_FILES = ("breakeven.json", "ratio_grid.csv", "breakeven.csv")
DEFAULT_MODELS = ("deepseek_v2_lite", "qwen3_30b_a3b")
DEFAULT_HARDWARE = ("h200", "pcie", "h100_2x8_ib")
DEFAULT_TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
DEFAULT_IMBALANCE = (1.1, 1.3)  # Sem-MoE's busiest rank at 10 % and 30 % over the mean (EP stays at 1.0)
GAIN_STEP = 0.025
BISECT_TOL = 1e-7


def load_conf(group: str, name: str) -> dict:
    """conf/<group>/<name>.yaml as a plain dict (YAML anchors resolved), as repro/sim reads its profiles."""
    from omegaconf import OmegaConf

    path = CONF.joinpath(*group.split("/"), f"{name}.yaml")
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"there is no {group} profile {name!r} in {path.parent}; choose one of {known}.")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


@dataclass(frozen=True)
class Deployment:
    """One model shape on one hardware profile with one all-to-all backend, Attention-DP over every GPU."""

    shape: ModelShape
    hw: Hardware
    backend: str
    cost: CostModel

    @property
    def devices(self) -> int:
        return self.hw.num_devices

    @property
    def slots_per_device(self) -> int:
        return self.shape.num_experts // self.devices


def deployment(shape: dict, hardware: dict, backend: str) -> Deployment:
    """A Deployment from a conf/sim/shape dict and a conf/hardware dict (validated by the simulator's loaders)."""
    model, hw = ModelShape.from_config(shape), load_hardware(hardware)
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if model.num_experts % hw.num_devices:
        raise ConfigError(f"shape {model.name!r} has {model.num_experts} experts, which do not split over the "
                          f"{hw.num_devices} GPUs of hardware {hw.name!r}; pick a profile whose GPU count divides it.")
    mapping = RoutingMap("strict", model.num_moe_layers, model.num_experts, model.top_k, 1.0,
                         model.moe_intermediate_size, f"shape {model.name}, uniform routing")
    return Deployment(model, hw, backend, CostModel(model, hw, mapping, hw.num_devices, "dp", backend))


def miss_probability(num_experts: int, group_size: int, top_k: int) -> float:
    """P(a token's k distinct experts, drawn uniformly, avoid a given group of `group_size` experts)."""
    return math.comb(num_experts - group_size, top_k) / math.comb(num_experts, top_k)


def _hit(x: np.ndarray, trials: np.ndarray) -> np.ndarray:
    """P(at least one of `trials` independent tries with probability x succeeds)."""
    return -np.expm1(trials * np.log1p(-np.minimum(x, 1.0)))


def busiest_rank_load(dep: Deployment, tokens_X: np.ndarray, lar_X: np.ndarray) -> LevelLoad:
    """The busiest rank's link-level load (costs.LevelLoad, arrays float64[X, 1, 1]: X settings, one layer, the
    one rank on the critical path) in the backend's units: copies (nccl, deepep_normal) or activations
    (deepep_low_latency) sent / received and peers.

    tokens_X float[X]: the rank's tokens (tokens per rank x imbalance); lar_X float[X] in [1/D, 1].
    Each remote rank gets a copy of a token with probability s x p (p = EP's under uniform top-k routing,
    s = (1 - LAR) / (1 - 1/D)); a peer is active when at least one of its candidate tokens sends to it.
    DeepEP normal across nodes: one RDMA copy per remote node, then NVLink forwarding of the copies of the M
    source ranks with the forwarder's local index (costs._deepep_normal_load).
    """
    shape, hw = dep.shape, dep.hw
    devices, per_node, nodes = hw.num_devices, hw.devices_per_node, hw.nodes
    n = np.asarray(tokens_X, dtype=np.float64)[:, None, None]
    scale = (1.0 - np.asarray(lar_X, dtype=np.float64)) / (1.0 - 1.0 / devices)
    scale = scale[:, None, None]
    copy_p = scale * (1.0 - miss_probability(shape.num_experts, dep.slots_per_device, shape.top_k))
    # units per (peer, token): a copy, or (low latency) each activation of that peer's experts
    unit = scale * shape.top_k / devices if dep.backend == "deepep_low_latency" else copy_p

    def level(peers: int, sent_per_peer: np.ndarray, active_per_peer: np.ndarray):
        sent, active = peers * sent_per_peer, peers * active_per_peer
        return (sent, sent, active, active)  # every rank alike: it receives what it sends

    if dep.backend == "deepep_normal" and nodes > 1:
        nvlink = level(per_node - 1, nodes * n * copy_p, _hit(copy_p, nodes * n))
        node_p = scale * (1.0 - miss_probability(shape.num_experts, shape.num_experts // nodes, shape.top_k))
        rdma = level(nodes - 1, n * node_p, _hit(node_p, n))
        return LevelLoad(nvlink, rdma)
    nvlink = level(per_node - 1, n * unit, _hit(copy_p, n))
    rdma = level(devices - per_node, n * unit, _hit(copy_p, n)) if nodes > 1 else None
    return LevelLoad(nvlink, rdma)


def expert_seconds(dep: Deployment, tokens_X: np.ndarray) -> np.ndarray:
    """float64[X] routed grouped-GEMM seconds of a rank serving tokens_X x k rows (CostModel.experts).

    Its S experts are each hit by any of the D x tokens tokens of the batch with probability k/E (uniform
    routing), so ~a = S (1 - (1 - k/E)^(D tokens)) of them are read; the rows are spread evenly over them, and a
    fractional a is priced between floor(a) and ceil(a) active slots (linear in between).
    """
    shape, devices, slots = dep.shape, dep.devices, dep.slots_per_device
    tokens = np.asarray(tokens_X, dtype=np.float64)
    rows = tokens * shape.top_k
    active = slots * _hit(np.full_like(tokens, shape.top_k / shape.num_experts), devices * tokens)
    active = np.minimum(active, rows)  # never more experts than rows
    low, high = np.floor(active), np.ceil(active)

    def priced(count: np.ndarray) -> np.ndarray:
        per_slot = np.where(count > 0, rows / np.maximum(count, 1.0), 0.0)
        slot_XS = np.where(np.arange(slots)[None, :] < count[:, None], per_slot[:, None], 0.0)
        slot_XLP = np.tile(slot_XS, (1, devices))[:, None, :]  # every rank alike
        return dep.cost.experts(slot_XLP)[:, 0, 0]

    weight = active - low
    return (1.0 - weight) * priced(low) + weight * priced(high)


def layer_seconds(dep: Deployment, tokens_X: np.ndarray, lar_X: np.ndarray) -> dict[str, np.ndarray]:
    """Seconds of one MoE layer on the busiest rank, {part: float64[X]} for PARTS and "total".

    tokens_X float[X]: the busiest rank's tokens (tokens per rank x imbalance); lar_X float[X] its LAR.
    Gate and shared experts as the simulator's DP block prices them (CostModel GEMM roofline on the rank's tokens).
    """
    tokens = np.asarray(tokens_X, dtype=np.float64)
    lar = np.asarray(lar_X, dtype=np.float64)
    if tokens.shape != lar.shape or tokens.ndim != 1:
        raise ConfigError(f"tokens and LAR must be 1-D arrays of one length, got shapes {tokens.shape} and {lar.shape}.")
    if np.any(~np.isfinite(tokens)) or np.any(tokens <= 0):
        raise ConfigError("tokens per rank must be finite and > 0.")
    if np.any(~np.isfinite(lar)) or np.any(lar < 1.0 / dep.devices - 1e-12) or np.any(lar > 1.0):
        raise ConfigError(f"LAR must lie in [1/D, 1] = [{1.0 / dep.devices:.4g}, 1] on {dep.devices} GPUs.")
    backend = dep.hw.backends[dep.backend]
    load = busiest_rank_load(dep, tokens, lar)
    dispatch_bytes, combine_bytes = backend.bytes_per_token(dep.shape.hidden_size)
    cost = dep.cost
    parts = {
        "gate": cost.gate(tokens),
        "dispatch": phase_seconds(load, backend.dispatch, dispatch_bytes)[:, 0],
        "experts": expert_seconds(dep, tokens) + cost._gemm(tokens, cost.shared_params),
        "combine": phase_seconds(load, backend.combine, combine_bytes)[:, 0],
    }
    parts["total"] = sum(parts[p] for p in PARTS)
    return parts


def time_ratio(dep: Deployment, tokens_per_rank, lar_gain, imbalance_semmoe=1.0, imbalance_ep=1.0) -> np.ndarray:
    """float64[X] MoE-layer time of Sem-MoE (LAR 1/D + gain, imbalance_semmoe) over EP (LAR 1/D, imbalance_ep).
    Arguments broadcast against each other."""
    tokens, gain, f_sem, f_ep = (np.ravel(a).astype(np.float64) for a in
                                 np.broadcast_arrays(tokens_per_rank, lar_gain, imbalance_semmoe, imbalance_ep))
    if np.any(~np.isfinite(gain)) or np.any(gain < 0):
        raise ConfigError("LAR gain must be finite and >= 0 (Sem-MoE's LAR over EP's 1/D).")
    base = 1.0 / dep.devices
    semmoe = layer_seconds(dep, tokens * f_sem, base + gain)["total"]
    ep = layer_seconds(dep, tokens * f_ep, np.full_like(gain, base))["total"]
    return semmoe / ep


def break_even_gain(dep: Deployment, tokens_per_rank, imbalance_semmoe=1.0, imbalance_ep=1.0,
                    tol: float = BISECT_TOL) -> np.ndarray:
    """float64[X] the smallest LAR gain at which Sem-MoE's layer time <= EP's: 0 when any gain pays, NaN ('never')
    when even LAR = 1 does not. Bisection on all settings at once (the ratio falls monotonically with the gain)."""
    tokens, f_sem, f_ep = (np.ravel(a).astype(np.float64) for a in
                           np.broadcast_arrays(tokens_per_rank, imbalance_semmoe, imbalance_ep))
    top = 1.0 - 1.0 / dep.devices

    def ratio(gain):
        return time_ratio(dep, tokens, gain, f_sem, f_ep)

    low, high = np.zeros_like(tokens), np.full_like(tokens, top)
    pays_at_zero, never = ratio(low) <= 1.0, ratio(high) > 1.0
    while np.any(high - low > tol):
        mid = 0.5 * (low + high)
        pays = ratio(mid) <= 1.0
        high, low = np.where(pays, mid, high), np.where(pays, low, mid)
    return np.where(pays_at_zero, 0.0, np.where(never, np.nan, high))


def gain_grid(devices: int, step: float = GAIN_STEP) -> np.ndarray:
    """LAR gains 0, step, ..., up to and including 1 - 1/D (Sem-MoE's LAR from 1/D to 1)."""
    top = 1.0 - 1.0 / devices
    return np.unique(np.append(np.arange(0.0, top, step), top))


def imbalance_settings(semmoe_imbalance) -> list[tuple[float, float]]:
    """(EP, Sem-MoE) imbalance pairs: both balanced, then Sem-MoE at each given max/mean."""
    return [(1.0, 1.0)] + [(1.0, float(f)) for f in semmoe_imbalance if float(f) != 1.0]


def compute(models=DEFAULT_MODELS, hardware=DEFAULT_HARDWARE, backends=BACKENDS, tokens=DEFAULT_TOKENS,
            semmoe_imbalance=DEFAULT_IMBALANCE, step: float = GAIN_STEP) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """(ratio grid: one row per model x hardware x backend x tokens x imbalance x gain, break-even table: one row per
    setting, description for breakeven.json). Pure: the same arguments give the same numbers."""
    check_arguments(tokens, semmoe_imbalance, step)
    grid_rows, be_rows, profiles = [], [], {}
    shapes = {m: load_conf("sim/shape", m) for m in models}
    profiles_hw = {h: load_conf("hardware", h) for h in hardware}
    for model in models:
        for hw_name in hardware:
            for backend in backends:
                dep = deployment(shapes[model], profiles_hw[hw_name], backend)
                profiles[hw_name] = {"devices": dep.devices, "nodes": dep.hw.nodes,
                                     "calibrated_parts": list(dep.hw.calibrated_parts)}
                grid_rows.append(_grid(dep, tokens, semmoe_imbalance, step))
                be_rows.append(_break_even_rows(dep, tokens, semmoe_imbalance))
    meta = {
        "generator": GENERATOR,
        "what": "MoE-layer time (gate + dispatch + experts + combine on the busiest rank, Attention-DP) of Sem-MoE "
                "over vanilla EP, priced by repro/sim/costs.py; not the throughput-under-SLO ratio (that needs "
                "queueing: the serving experiments)",
        "models": list(models), "hardware": profiles, "backends": list(backends), "tokens_per_rank": list(tokens),
        "imbalance_settings": imbalance_settings(semmoe_imbalance), "gain_step": step,
        "assumptions": [
            "vanilla EP: uniform top-k routing, LAR = 1/D, imbalance 1.0",
            "Sem-MoE: LAR = 1/D + gain; remote copies, per-node copies and activations scaled by (1 - LAR) / (1 - 1/D) "
            "with EP's spread over remote ranks and EP's dedup ratio",
            "imbalance f: the busiest rank carries f x the mean tokens through gate, all-to-all and experts",
            "both systems read as many distinct experts per batch (uniform-routing expectation)",
            "attention, dense layers and LM head cost both systems the same and are left out",
        ],
    }
    return pd.concat(grid_rows, ignore_index=True), pd.concat(be_rows, ignore_index=True), meta


def check_arguments(tokens, semmoe_imbalance, step: float) -> None:
    if not len(tokens) or any(not float(t).is_integer() or t < 1 for t in tokens):
        raise ConfigError(f"tokens per rank must be integers >= 1, got {list(tokens)}.")
    if any(not np.isfinite(f) or f < 1.0 for f in semmoe_imbalance):
        raise ConfigError(f"imbalance is a max/mean ratio, so it must be finite and >= 1, got {list(semmoe_imbalance)}.")
    if not 0.0 < step <= 0.5:
        raise ConfigError(f"the LAR gain step must lie in (0, 0.5], got {step}.")


def _labels(dep: Deployment) -> dict:
    return {"model": dep.shape.name, "hardware": dep.hw.name, "backend": dep.backend, "devices": dep.devices}


def _grid(dep: Deployment, tokens, semmoe_imbalance, step: float) -> pd.DataFrame:
    gains = gain_grid(dep.devices, step)
    rows = []
    for f_ep, f_sem in imbalance_settings(semmoe_imbalance):
        tok, gain = (a.ravel() for a in np.meshgrid(np.asarray(tokens, dtype=np.float64), gains, indexing="ij"))
        base = np.full_like(gain, 1.0 / dep.devices)
        ep = layer_seconds(dep, tok * f_ep, base)
        semmoe = layer_seconds(dep, tok * f_sem, base + gain)
        frame = pd.DataFrame({"tokens_per_rank": tok.astype(np.int64), "imbalance_ep": f_ep, "imbalance_semmoe": f_sem,
                              "lar_gain": gain, "lar_ep": base, "lar_semmoe": base + gain,
                              "ratio": semmoe["total"] / ep["total"]})
        for name, parts in (("ep", ep), ("semmoe", semmoe)):
            for part in (*PARTS, "total"):
                frame[f"{name}_{part}_us"] = parts[part] * 1e6
        rows.append(frame)
    return pd.concat(rows, ignore_index=True).assign(**_labels(dep))


def _break_even_rows(dep: Deployment, tokens, semmoe_imbalance) -> pd.DataFrame:
    rows = []
    tok = np.asarray(tokens, dtype=np.float64)
    top = 1.0 - 1.0 / dep.devices
    for f_ep, f_sem in imbalance_settings(semmoe_imbalance):
        gain = break_even_gain(dep, tok, f_sem, f_ep)
        ep = layer_seconds(dep, tok * f_ep, np.full_like(tok, 1.0 / dep.devices))
        rows.append(pd.DataFrame({
            "tokens_per_rank": tok.astype(np.int64), "imbalance_ep": f_ep, "imbalance_semmoe": f_sem,
            "break_even_gain": gain, "break_even_lar": gain + 1.0 / dep.devices,
            "pays": np.where(np.isnan(gain), "never", np.where(gain == 0, "any gain", "above break-even")),
            "ratio_at_lar_1": time_ratio(dep, tok, top, f_sem, f_ep),
            "ep_layer_us": ep["total"] * 1e6,
            "ep_a2a_share": (ep["dispatch"] + ep["combine"]) / ep["total"],
        }))
    return pd.concat(rows, ignore_index=True).assign(**_labels(dep))


def write_results(out: Path, grid: pd.DataFrame, table: pd.DataFrame, meta: dict) -> Path:
    """Publish breakeven.json, ratio_grid.csv and breakeven.csv at `out` in one rename. An earlier output of this
    program is replaced; anything else at `out` is refused untouched."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        try:
            ours = json.loads((out / "breakeven.json").read_text(encoding="utf-8")).get("generator") == GENERATOR
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise ConfigError(f"{out} exists and was not written by {GENERATOR}; pick another --out (nothing was written).")

    def fill(tmp: Path) -> None:
        grid.to_csv(tmp / "ratio_grid.csv", index=False)
        table.to_csv(tmp / "breakeven.csv", index=False)
        (tmp / "breakeven.json").write_text(json.dumps(meta, indent=2, allow_nan=False) + "\n", encoding="utf-8")

    atomic_dir(out, fill, replace=True)
    return out


def main(argv=None) -> None:
    parser = cli.ArgumentParser(prog="python -m repro.sim.breakeven", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/breakeven", help="output folder (default runs/breakeven)")
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="conf/sim/shape names")
    parser.add_argument("--hardware", nargs="+", default=list(DEFAULT_HARDWARE), help="conf/hardware names")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--tokens", nargs="+", type=cli.positive, default=list(DEFAULT_TOKENS),
                        help="tokens per rank per iteration")
    parser.add_argument("--imbalance", nargs="+", type=cli.Number(1), default=list(DEFAULT_IMBALANCE),
                        help="Sem-MoE's busiest-rank max/mean load (EP's is 1.0; 1.0 for both is always included)")
    parser.add_argument("--gain-step", type=cli.Number(0, 1, low_open=True), default=GAIN_STEP,
                        help="LAR gain step of the ratio grid")
    args = parser.parse_args(argv)
    try:
        grid, table, meta = compute(args.models, args.hardware, args.backends, args.tokens, args.imbalance,
                                    args.gain_step)
        out = write_results(Path(args.out), grid, table, meta)
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    shown = table[table["imbalance_semmoe"] != table["imbalance_ep"]]
    with pd.option_context("display.width", 160, "display.max_rows", 400):
        gains = shown.pivot_table(index=["model", "hardware", "backend", "imbalance_semmoe"], columns="tokens_per_rank",
                                  values="break_even_gain", dropna=False).round(3).astype(object)
        print("break-even LAR gain of Sem-MoE over EP (EP balanced; 'never': not even at LAR = 1):")
        print(gains.where(gains.notna(), "never").to_string())
    print(f"wrote {out}/ ({len(grid)} ratio rows, {len(table)} break-even rows)")


if __name__ == "__main__":
    main()
