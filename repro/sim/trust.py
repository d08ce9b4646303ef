"""How far to trust the cost model: its measured errors, and which break-even cells survive them.

    python -m repro.sim.trust [--exec bench/results/cost_model.json] [--out runs/cost_model_trust] [--overwrite]

Collects the cost model's measured errors (issue 26) and re-prices the "when does co-scheduling pay" map
(repro.sim.breakeven) with each term scaled by them:
- real executions: bench.bench_cost_model's result file (the gloo executor per phase vs the cost model with the
  CPU profile bench.cpu_check measured; per phase the median and max |relative error|); absent: left out;
- published measurements: repro.sim.validation over conf/validation/published.yaml (in- and out-of-sample rows).
Bands: each names a communication scale e_c (every all-to-all term: latencies and 1 / bandwidths, tables too) and
a compute scale e_x (gate and expert GEMMs: 1 / FLOP/s, 1 / memory bandwidth, kernel floor, expert tables). A
break-even cell is priced at the nominal model and at the two corners that move it most: comm x (1 + e_c) with
compute x (1 - e_x) (all-to-all dearer: Sem-MoE pays sooner) and comm x (1 - e_c) with compute x (1 + e_x)
(Sem-MoE pays later); a factor never drops below FLOOR_SCALE. A cell flips when its status (pays at any gain /
pays from a gain / never pays) differs between the nominal price and a corner.
Writes <out>/trust.json atomically (repro.figures.trust renders it into the report).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from repro import cli
from repro.errors import ConfigError
from repro.sim import breakeven
from repro.sim.costs import CostModel
from repro.sim.hardware import scaled_hardware
from repro.sim.shapes import RoutingMap

ROOT = Path(__file__).resolve().parents[2]
EXEC_RESULTS = ROOT / "bench" / "results" / "cost_model.json"
OUT = ROOT / "runs" / "cost_model_trust"
FLOOR_SCALE = 0.1  # a term scaled down by a > 90 % error keeps a tenth of its price
COMM_KINDS = ("nccl_alltoall", "deepep_normal", "deepep_low_latency")


def scaled_deployment(dep: breakeven.Deployment, comm: float, compute: float) -> breakeven.Deployment:
    hw = scaled_hardware(dep.hw, comm, compute)
    s = dep.shape
    mapping = RoutingMap("strict", s.num_moe_layers, s.num_experts, s.top_k, 1.0, s.moe_intermediate_size, "scaled")
    return breakeven.Deployment(s, hw, dep.backend, CostModel(s, hw, mapping, hw.num_devices, "dp", dep.backend))


def exec_errors(path: Path, required: bool = False) -> dict | None:
    """{phase: {median_abs_error, max_abs_error, median_signed_error}} of bench.bench_cost_model's result file
    (the "all" group), plus "load" and "order". The default file may be absent or hold a failed run (None: the
    executor band is left out, and the report says so); a file the user named (required=True) must hold a result,
    and a file that is there must be one (ConfigError otherwise: a mistyped --exec once dropped the band silently)."""
    path = Path(path)
    redo = "rerun `python -m bench --only cost_model` or pass --exec to another file"
    if not path.is_file():
        if required:
            raise ConfigError(f"--exec {path} is not a file; {redo}.")
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        raise ConfigError(f"{path} is not a readable bench.bench_cost_model result; {redo}.") from None
    results = record.get("results") if isinstance(record, dict) else None
    if not results:
        if required or not isinstance(record, dict) or "ok" not in record:
            raise ConfigError(f"{path} holds no bench.bench_cost_model `results`; {redo}.")
        return None  # the default file of a failed bench run: no executor measurement to band
    try:
        summary = results["summary"]
        out = {phase: summary[phase]["all"] for phase in ("gating", "dispatch", "experts", "combine", "dispatch_sim")}
        out["best_of_repeats"] = {p: v["all"] for p, v in (summary.get("best_of_repeats") or {}).items()}
    except (KeyError, TypeError, AttributeError):
        raise ConfigError(f"{path}'s `results` lack the per-phase summary bench.bench_cost_model writes; {redo}.") from None
    out["order"] = summary.get("order")
    out["load"] = results.get("load_before_after")
    out["started_utc"] = record.get("started_utc")
    return out


def published_errors() -> dict:
    """Rows of repro.sim.validation with their errors, and the in- / out-of-sample summary."""
    from repro.sim.validation import error_summary, validate

    rows = validate()
    keep = ("id", "kind", "profile", "measured", "predicted", "error", "unit", "in_sample", "source", "setting")
    return {"rows": [{k: r[k] for k in keep} for r in rows], "summary": error_summary(rows),
            "worst_comm_out_of_sample": max((abs(r["error"]) for r in rows
                                             if not r["in_sample"] and r["kind"] in COMM_KINDS), default=0.0)}


def bands(exec_err: dict | None, published: dict) -> dict:
    """{name: {"comm": e_c, "compute": e_x, "from": sentence}} of the error bands the map is re-priced under."""
    out = {"published out-of-sample all-to-all (worst)": {
        "comm": round(published["worst_comm_out_of_sample"], 3), "compute": 0.0,
        "from": "worst |error| of the out-of-sample DeepEP / NCCL rows; no published compute row"}}
    if exec_err is not None:
        for stat, label in (("median_abs_error", "median"), ("max_abs_error", "worst")):
            out[f"gloo executor ({label})"] = {
                "comm": round(max(exec_err["dispatch"][stat], exec_err["combine"][stat]), 3),
                "compute": round(max(exec_err["gating"][stat], exec_err["experts"][stat]), 3),
                "from": f"{label} |error| per phase of bench.bench_cost_model (dispatch / combine; gating / experts)"}
    return out


def _status(gain: float) -> str:
    return "never" if np.isnan(gain) else ("any gain" if gain == 0 else "from a gain")


def breakeven_under_bands(band_map: dict, models=breakeven.DEFAULT_MODELS, hardware=breakeven.DEFAULT_HARDWARE,
                          backends=breakeven.BACKENDS, tokens=breakeven.DEFAULT_TOKENS,
                          imbalance=breakeven.DEFAULT_IMBALANCE) -> list[dict]:
    """One row per break-even cell (model, hardware, backend, tokens per rank, Sem-MoE imbalance): the break-even
    LAR gain nominal and at each band's two corners, and whether its status flips."""
    rows = []
    for model in models:
        shape = breakeven.load_conf("sim/shape", model)
        for hw_name in hardware:
            hw_conf = breakeven.load_conf("hardware", hw_name)
            for backend in backends:
                try:
                    dep = breakeven.deployment(shape, hw_conf, backend)
                except ConfigError:
                    continue
                settings = [(t, f_sem, f_ep) for t in tokens for f_ep, f_sem in breakeven.imbalance_settings(imbalance)]
                t_x, sem_x, ep_x = (np.array(v, dtype=np.float64) for v in zip(*settings, strict=True))
                nominal = breakeven.break_even_gain(dep, t_x, sem_x, ep_x, tol=1e-4)
                corners = {}
                for name, band in band_map.items():
                    c, x = band["comm"], band["compute"]
                    for corner, (sc, sx) in (("comm_up", (1 + c, max(FLOOR_SCALE, 1 - x))),
                                             ("comm_down", (max(FLOOR_SCALE, 1 - c), 1 + x))):
                        scaled = scaled_deployment(dep, sc, sx)
                        corners[(name, corner)] = breakeven.break_even_gain(scaled, t_x, sem_x, ep_x, tol=1e-4)
                for i, (t, f_sem, f_ep) in enumerate(settings):
                    row = {"model": model, "hardware": hw_name, "backend": backend, "tokens_per_rank": int(t),
                           "imbalance_semmoe": f_sem, "imbalance_ep": f_ep, "break_even_gain": _num(nominal[i]),
                           "status": _status(nominal[i]), "bands": {}}
                    for name in band_map:
                        up, down = corners[(name, "comm_up")][i], corners[(name, "comm_down")][i]
                        row["bands"][name] = {"comm_up": _num(up), "comm_down": _num(down),
                                              "flips": _status(up) != row["status"] or _status(down) != row["status"]}
                    rows.append(row)
    return rows


def _num(x: float) -> float | None:
    return None if np.isnan(x) else round(float(x), 4)


def compute(exec_path: Path | None = None, **breakeven_kwargs) -> dict:
    """The bands and the re-priced map; exec_path None reads the default bench result when there is one."""
    exec_err = exec_errors(exec_path or EXEC_RESULTS, required=exec_path is not None)
    exec_path = exec_path or EXEC_RESULTS
    published = published_errors()
    band_map = bands(exec_err, published)
    cells = breakeven_under_bands(band_map, **breakeven_kwargs)
    return {"generated_by": "repro.sim.trust", "exec": exec_err, "exec_source": str(exec_path),
            "published": published, "bands": band_map, "breakeven": cells,
            "breakeven_by_band": {name: band_summary(cells, name) for name in band_map}}


def band_summary(cells: list[dict], band: str) -> dict:
    """Over the cells: how many flip status under `band`, and the largest move of a finite break-even gain."""
    moves = [abs(c["bands"][band][corner] - c["break_even_gain"]) for c in cells for corner in ("comm_up", "comm_down")
             if c["break_even_gain"] is not None and c["bands"][band][corner] is not None]
    return {"cells": len(cells), "flips": sum(c["bands"][band]["flips"] for c in cells),
            "max_gain_move": round(max(moves), 4) if moves else None,
            "median_gain_move": round(float(np.median(moves)), 4) if moves else None}


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(prog="python -m repro.sim.trust", description=__doc__.split("\n\n")[0])
    parser.add_argument("--exec", type=cli.existing_file, default=None,
                        help=f"bench.bench_cost_model's result JSON (default: {EXEC_RESULTS} when it exists)")
    cli.add_output(parser, "--out", what="dir", default=OUT, help="folder to write trust.json into")
    args = parser.parse_args(argv)

    def work() -> None:
        result = compute(args.exec)
        out = cli.write_text_output(args.out / "trust.json", json.dumps(result, indent=1) + "\n", overwrite=args.overwrite)
        print(f"bands {json.dumps(result['bands'])}\nbreak-even cells per band: {result['breakeven_by_band']}\n-> {out}")

    return cli.run(work)


if __name__ == "__main__":
    sys.exit(main())
