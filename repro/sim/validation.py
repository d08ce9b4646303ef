"""Published measurements re-simulated by the cost model (conf/validation/published.yaml).

    python -m repro.sim.validation [--table conf/validation/published.yaml]

Each row of the table names a published measurement (source, setting, value, unit), the hardware profile and
setting that price it, and whether the row was used to calibrate that profile (`in_sample`). `validate` prices
every row with repro.sim.costs (the same counting, `batch_traffic`, and pricing, `a2a_seconds` / `CostModel`, as
the simulator) and returns the rows with `predicted` and `error` = predicted / measured - 1. Row kinds are
described in the table's header; `load_table` refuses a row it cannot price with one sentence naming it.

Legend: T tokens per rank, D ranks, E experts, k experts per token, M nodes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import yaml

from repro import cli
from repro.errors import ConfigError
from repro.sim.costs import CostModel, LevelLoad, a2a_seconds, phase_seconds
from repro.sim.hardware import Hardware, load_hardware
from repro.sim.migration_cost import price_migration
from repro.sim.shapes import ModelShape, RoutingMap
from repro.sim.traffic import BatchTraffic, batch_traffic, dispatch_slots
from repro.systems.base import Placement
from repro.systems.ep import contiguous_placement

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "conf" / "validation" / "published.yaml"
KINDS = {  # kind -> (unit, fields a row of that kind needs beyond the common ones)
    "nccl_alltoall": ("us", ("ranks", "size_bytes")),
    "deepep_normal": ("GB/s", ("ep", "direction")),
    "deepep_low_latency": ("us", ("ep", "direction")),
    "moe_comm_share": ("fraction", ("shape", "backend", "ep", "tokens_per_rank")),
    "eplb_rearrangement": ("s", ("shape", "ep", "redundant_experts", "bytes_per_weight", "moved_fraction",
                                 "layer_overhead")),
}
FIT = "fit"  # an eplb_rearrangement row whose layer_overhead is `fit` sets the per-layer overhead the others use
COMMON = ("id", "kind", "profile", "measured", "unit", "in_sample", "source", "setting")
DEEPEP_HIDDEN = 7168
FP8_BYTES_PER_ELEMENT = 1 + 4 / 128  # DeepEP's tests: fp8 values + one fp32 scale per 128


def load_table(path: Path = TABLE) -> list[dict]:
    """The validated rows of a validation table (ConfigError naming the row and field otherwise)."""
    try:
        document = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"{path} is not a readable YAML validation table ({type(e).__name__}).") from None
    rows = document.get("rows") if isinstance(document, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"{path} must hold a non-empty `rows:` list (see conf/validation/published.yaml).")
    seen = set()
    for i, row in enumerate(rows):
        where = f"{path} row {i} ({row.get('id', '?') if isinstance(row, dict) else '?'})"
        if not isinstance(row, dict):
            raise ConfigError(f"{where} must be a mapping.")
        kind = row.get("kind")
        if kind not in KINDS:
            raise ConfigError(f"{where}: kind must be one of {sorted(KINDS)}, got {kind!r}.")
        missing = [f for f in COMMON + KINDS[kind][1] if f not in row]
        if missing:
            raise ConfigError(f"{where} misses field(s) {missing}.")
        if row["unit"] != KINDS[kind][0]:
            raise ConfigError(f"{where}: a {kind} row is measured in {KINDS[kind][0]}, got unit {row['unit']!r}.")
        if not isinstance(row["in_sample"], bool):
            raise ConfigError(f"{where}: in_sample must be true or false, got {row['in_sample']!r}.")
        if not _positive_number(row["measured"]):  # NaN passed `<= 0` and was priced
            raise ConfigError(f"{where}: measured must be a finite positive number, got {row['measured']!r}.")
        for field in ("ranks", "ep"):
            if field in row and not (_positive_number(row[field]) and float(row[field]).is_integer()):
                raise ConfigError(f"{where}: {field} must be a positive integer, got {row[field]!r}.")
        if "size_bytes" in row and not _positive_number(row["size_bytes"]):
            raise ConfigError(f"{where}: size_bytes must be a finite positive number, got {row['size_bytes']!r}.")
        tokens = row.get("tokens_per_rank", [1])
        if not isinstance(tokens, list) or not tokens or not all(_positive_number(t) and float(t).is_integer()
                                                                   for t in tokens):
            raise ConfigError(f"{where}: tokens_per_rank must be a non-empty list of positive integers, got {tokens!r}.")
        for field, folder in (("profile", "hardware"), ("shape", "sim/shape")):
            known = isinstance(row.get(field), str) and (ROOT / "conf" / folder / f"{row[field]}.yaml").is_file()
            if field in row and not known:
                raise ConfigError(f"{where}: {field} {row[field]!r} is not one of conf/{folder}/*.yaml.")
        if "direction" in row and row["direction"] not in ("dispatch", "combine"):
            raise ConfigError(f"{where}: direction must be dispatch or combine, got {row['direction']!r}.")
        if not isinstance(row["id"], str):
            raise ConfigError(f"{where}: id must be a string, got {row['id']!r}.")
        if row["id"] in seen:
            raise ConfigError(f"{where}: id {row['id']!r} appears twice.")
        seen.add(row["id"])
        if kind == "eplb_rearrangement":
            _check_rearrangement(row, where)
    fitted = {r["id"] for r in rows if r["kind"] == "eplb_rearrangement" and r["layer_overhead"] == FIT}
    for i, row in enumerate(rows):
        if row["kind"] == "eplb_rearrangement" and row["layer_overhead"] not in fitted | {FIT}:
            raise ConfigError(f"{path} row {i} ({row['id']}): layer_overhead must be {FIT!r} or the id of an "
                              f"eplb_rearrangement row that fits it ({sorted(fitted)}), got {row['layer_overhead']!r}.")
    return rows


def _check_rearrangement(row: dict, where: str) -> None:
    """The fields of an eplb_rearrangement row (one ConfigError naming the first bad one)."""
    redundant = row["redundant_experts"]
    if isinstance(redundant, bool) or not isinstance(redundant, int) or redundant < 0:
        raise ConfigError(f"{where}: redundant_experts must be an integer >= 0, got {redundant!r}.")
    if not _positive_number(row["bytes_per_weight"]):
        raise ConfigError(f"{where}: bytes_per_weight must be a finite positive number, got {row['bytes_per_weight']!r}.")
    fraction = row["moved_fraction"]
    if not (_positive_number(fraction) and fraction <= 1):
        raise ConfigError(f"{where}: moved_fraction must be a share of the physical slots in (0, 1], got {fraction!r}.")
    if row["layer_overhead"] == FIT and row["in_sample"] is not True:
        raise ConfigError(f"{where}: a row that fits the per-layer overhead is in-sample; set in_sample: true.")


def _positive_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and np.isfinite(value) and value > 0


def _profile(row: dict, nodes: int | None = None) -> Hardware:
    path = ROOT / "conf" / "hardware" / f"{row['profile']}.yaml"
    if not path.is_file():
        raise ConfigError(f"validation row {row['id']!r} names profile {row['profile']!r} but {path} does not exist.")
    profile = yaml.safe_load(path.read_text())
    if nodes is not None:
        profile["nodes"] = nodes
    for dotted, value in (row.get("set") or {}).items():
        *parents, leaf = dotted.split(".")
        node = profile
        for part in parents:
            node = node[part]
        node[leaf] = value
    return load_hardware(profile)


def uniform_load(size_bytes: float, devices: int) -> LevelLoad:
    """nccl-tests all-to-all: every rank sends size / D bytes to each other rank, all inside one node."""
    share = size_bytes / devices
    per_rank = np.full((1, 1, devices), share * (devices - 1))
    peers = np.full((1, 1, devices), devices - 1)
    zero = np.zeros((1, 1, devices))
    return LevelLoad((per_rank, per_rank, peers, peers), (zero, zero, zero, zero))


def deepep_routing(rng: np.random.Generator, tokens: int, devices: int, num_experts: int = 256, top_k: int = 8,
                   node_limited: bool = True) -> np.ndarray:
    """int16[D * T, 1, k]: DeepEP's test routing, |N(0, 1)| + 1 scores, top-k within the min(M, 4) best nodes
    (node_limited) or plain top-k of uniform scores (the low-latency test)."""
    if not node_limited:
        return np.argsort(-rng.random((devices * tokens, num_experts)), axis=1)[:, :top_k].astype(np.int16)[:, None, :]
    nodes = max(1, devices // 8)
    scores = np.abs(rng.standard_normal((devices * tokens, num_experts))) + 1
    if nodes > 1:
        group = scores.reshape(len(scores), nodes, -1).max(axis=2)
        keep = np.argsort(-group, axis=1)[:, : min(nodes, 4)]
        mask = np.zeros((len(scores), nodes), dtype=bool)
        np.put_along_axis(mask, keep, True, axis=1)
        scores = np.where(np.repeat(mask, num_experts // nodes, axis=1), scores, 0.0)
    return np.argsort(-scores, axis=1)[:, :top_k].astype(np.int16)[:, None, :]


def ep_traffic(experts_NLk: np.ndarray, devices: int, tokens: int, num_experts: int, devices_per_node: int) -> BatchTraffic:
    """One iteration's counts under vanilla EP (contiguous placement), T tokens living on each of D ranks."""
    placement = contiguous_placement(experts_NLk.shape[1], num_experts, devices)
    home = np.repeat(np.arange(devices), tokens)[:, None]
    return batch_traffic(np.zeros(len(home), dtype=np.int64), home, experts_NLk, dispatch_slots(placement),
                         placement.slots_per_device, 1, devices_per_node)


def _deepep_normal(row: dict) -> float:
    ep = int(row["ep"])
    tokens = 1024
    hw = _profile(row, nodes=max(1, ep // 8))
    traffic = ep_traffic(deepep_routing(np.random.default_rng(ep), tokens, ep), ep, tokens, 256, 8)
    backend = hw.backends["deepep_normal"]
    from dataclasses import replace

    tested = replace(backend, dispatch_bytes_per_element=FP8_BYTES_PER_ELEMENT, combine_bytes_per_element=2.0,
                     token_header_bytes=0)
    dispatch_s, combine_s = (float(t[0, 0]) for t in a2a_seconds(traffic, tested, DEEPEP_HIDDEN, 8))
    if ep == 8:  # NVLink: received copies per rank, the rank's own included
        counted = traffic.copies[0, 0].sum(axis=0).mean()
    else:  # RDMA: copies per destination node, the own node included
        counted = traffic.node_copies[0, 0].sum(axis=1).mean()
    if row["direction"] == "dispatch":
        return counted * int(DEEPEP_HIDDEN * FP8_BYTES_PER_ELEMENT) / dispatch_s / 1e9
    return counted * 2 * DEEPEP_HIDDEN / combine_s / 1e9


def _deepep_low_latency(row: dict) -> float:
    ep = int(row["ep"])
    hw = _profile(row, nodes=max(1, ep // 8))
    traffic = ep_traffic(deepep_routing(np.random.default_rng(ep), 128, ep, node_limited=False), ep, 128, 256, 8)
    dispatch_s, combine_s = (float(t[0, 0]) for t in a2a_seconds(traffic, hw.backends["deepep_low_latency"],
                                                                 DEEPEP_HIDDEN, 8))
    return (dispatch_s if row["direction"] == "dispatch" else combine_s) * 1e6


def moe_layer_components(shape: ModelShape, hw: Hardware, backend: str, devices: int, tokens: int,
                         rng: np.random.Generator) -> dict:
    """Seconds of one MoE layer's gate, dispatch, experts (routed + shared) and combine under vanilla EP with
    uniform top-k routing of T tokens per rank (CostModel.block, Attention-DP)."""
    experts = np.argsort(-rng.random((devices * tokens, shape.num_experts)), axis=1)[:, : shape.top_k]
    traffic = ep_traffic(experts.astype(np.int16)[:, None, :], devices, tokens, shape.num_experts, hw.devices_per_node)
    mapping = RoutingMap("strict", 1, shape.num_experts, shape.top_k, 1.0, shape.moe_intermediate_size, "")
    model = CostModel(shape, hw, mapping, devices, "dp", backend)
    zeros = np.zeros((1, devices))
    seg = {"pairs_prefill": zeros, "pairs_decode": zeros, "kv_read": zeros, "tokens": np.full((1, devices), tokens),
           "samples": zeros}
    moe = model.block(seg, traffic, np.full((1, devices), tokens), None, np.array([tokens > 1]))["moe"][0, 0]
    return {"gate": float(moe[1]), "dispatch": float(moe[2]), "experts": float(moe[3]), "combine": float(moe[4])}


def _moe_comm_share(row: dict) -> tuple[float, dict]:
    shape_path = ROOT / "conf" / "sim" / "shape" / f"{row['shape']}.yaml"
    shape = ModelShape.from_config(yaml.safe_load(shape_path.read_text()))
    hw = _profile(row)
    shares = {}
    for tokens in row["tokens_per_rank"]:
        c = moe_layer_components(shape, hw, row["backend"], int(row["ep"]), int(tokens), np.random.default_rng(tokens))
        shares[int(tokens)] = (c["dispatch"] + c["combine"]) / sum(c.values())
    return max(shares.values()), {"share_by_tokens_per_rank": {t: round(s, 3) for t, s in shares.items()}}


def rearrangement_placements(num_layers: int, num_experts: int, devices: int, redundant: int, moved_fraction: float,
                             rng: np.random.Generator) -> tuple[Placement, Placement]:
    """(old, new) placements of one published rearrangement: old holds slot p -> expert p mod E (P = E +
    redundant slots, SGLang's trivial map); new moves round(moved_fraction x P) slots per layer, drawn at random,
    by a cyclic shift of their experts (a re-plan that is arbitrary with respect to the old placement, as EPLB's
    packing is: it does not look at where experts are)."""
    num_slots = num_experts + redundant
    old = np.tile(np.arange(num_slots) % num_experts, (num_layers, 1))
    moved = int(round(moved_fraction * num_slots))
    chosen = np.argsort(rng.random((num_layers, num_slots)), axis=1)[:, :moved]  # [L, m]
    layer = np.arange(num_layers)[:, None]
    new = old.copy()
    new[layer, chosen] = old[layer, np.roll(chosen, 1, axis=1)]
    return Placement(old, devices, num_experts), Placement(new, devices, num_experts)


def _rearrangement(row: dict, fits: dict[str, float]) -> tuple[float, dict]:
    """A synchronous rearrangement's stall (seconds): repro.sim.migration_cost over the row's placements, with the
    per-layer overhead fitted on the row itself (`fit`) or taken from the row that fits it."""
    shape = ModelShape.from_config(yaml.safe_load((ROOT / "conf" / "sim" / "shape" / f"{row['shape']}.yaml").read_text()))
    hw = _profile(row)
    ep, redundant = int(row["ep"]), int(row["redundant_experts"])
    if (shape.num_experts + redundant) % ep or ep != hw.num_devices:
        raise ConfigError(f"validation row {row['id']!r}: {shape.num_experts} experts + {redundant} redundant must "
                          f"split over ep={ep} ranks, and the profile must have {ep} devices (it has {hw.num_devices}).")
    old, new = rearrangement_placements(shape.num_moe_layers, shape.num_experts, ep, redundant,
                                        float(row["moved_fraction"]), np.random.default_rng(0))
    bandwidth_only = price_migration(old, new, shape, hw, "sync", bytes_per_weight=float(row["bytes_per_weight"]))
    layers_moving = int(np.count_nonzero(bandwidth_only.layer_seconds))
    if row["layer_overhead"] == FIT:
        overhead = (float(row["measured"]) - bandwidth_only.stall_s) / layers_moving
        if overhead < 0:
            raise ConfigError(f"validation row {row['id']!r}: the transfers alone ({bandwidth_only.stall_s:.3g} s) exceed "
                              "the measured stall, so no per-layer overhead >= 0 fits it.")
    else:
        overhead = fits[row["layer_overhead"]]
    stall = bandwidth_only.stall_s + overhead * layers_moving
    return stall, {"experts_moved": bandwidth_only.experts_moved, "experts_moved_rdma": int(bandwidth_only.copies_rdma.sum()),
                   "gb_moved": round(bandwidth_only.bytes_moved / 1e9, 3), "transfer_s": bandwidth_only.stall_s,
                   "layer_overhead_s": overhead, "layers": layers_moving}


def layer_overhead_fits(rows: list[dict]) -> dict[str, float]:
    """{row id: per-layer overhead (s)} of the eplb_rearrangement rows that fit it."""
    return {r["id"]: _rearrangement(r, {})[1]["layer_overhead_s"] for r in rows
            if r["kind"] == "eplb_rearrangement" and r["layer_overhead"] == FIT}


def fitted_layer_overhead_s(path: Path = TABLE) -> float:
    """Seconds per migrating layer that the table's one fitting eplb_rearrangement row sets (what to pass as
    migration_cost's layer_overhead_s to price migrations like the engines' published ones)."""
    fits = layer_overhead_fits(load_table(path))
    if len(fits) != 1:
        raise ConfigError(f"{path} must hold exactly one eplb_rearrangement row with layer_overhead: {FIT}, "
                          f"it holds {len(fits)}.")
    return next(iter(fits.values()))


def resimulate(row: dict, rows: list[dict] | None = None) -> tuple[float, dict]:
    """(predicted value in the row's unit, details) of one validated row; `rows` is its table (None: TABLE's),
    read only by an eplb_rearrangement row whose per-layer overhead another row fits."""
    kind = row["kind"]
    if kind == "eplb_rearrangement":
        return _rearrangement(row, layer_overhead_fits(load_table(TABLE) if rows is None else rows))
    if kind == "nccl_alltoall":
        hw = _profile(row)
        seconds = phase_seconds(uniform_load(float(row["size_bytes"]), int(row["ranks"])), hw.backends["nccl"].dispatch, 1)
        return float(seconds[0, 0]) * 1e6, {}
    if kind == "deepep_normal":
        return _deepep_normal(row), {}
    if kind == "deepep_low_latency":
        return _deepep_low_latency(row), {}
    return _moe_comm_share(row)


def validate(path: Path = TABLE) -> list[dict]:
    """Every row of the table with `predicted`, `error` (predicted / measured - 1) and `details`."""
    out = []
    rows = load_table(path)
    for row in rows:
        predicted, details = resimulate(row, rows)
        out.append({**row, "predicted": predicted, "error": predicted / float(row["measured"]) - 1, "details": details})
    return out


def error_summary(rows: list[dict]) -> dict:
    """{"in_sample" | "out_of_sample": {rows, median_abs_error, max_abs_error, worst}}."""
    out = {}
    for name, flag in (("in_sample", True), ("out_of_sample", False)):
        group = [r for r in rows if r["in_sample"] is flag]
        if group:
            errors = np.abs([r["error"] for r in group])
            out[name] = {"rows": len(group), "median_abs_error": round(float(np.median(errors)), 3),
                         "max_abs_error": round(float(errors.max()), 3), "worst": group[int(errors.argmax())]["id"]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(prog="python -m repro.sim.validation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", type=cli.existing_file, default=TABLE)
    args = parser.parse_args(argv)
    return cli.run(lambda: print_validation(args.table))


def print_validation(table: Path) -> None:
    rows = validate(table)
    print(f"{'id':<36} {'sample':<7} {'measured':>10} {'predicted':>10} {'error':>7}  unit")
    for r in rows:
        print(f"{r['id']:<36} {'in' if r['in_sample'] else 'OUT':<7} {r['measured']:>10.4g} {r['predicted']:>10.4g} "
              f"{r['error']:>+7.1%}  {r['unit']}")
    for name, s in error_summary(rows).items():
        print(f"{name}: {s['rows']} rows, median |error| {s['median_abs_error']:.1%}, max {s['max_abs_error']:.1%} "
              f"({s['worst']})")


if __name__ == "__main__":
    sys.exit(main())
