"""The report's "How far to trust the cost model" section, read from runs/cost_model_trust/trust.json.

That file is written by `python -m repro.sim.trust` (the cost model's errors against the gloo executor and
against published measurements, and the break-even map re-priced under each error band); without it the section
is one line saying how to make it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from repro.figures.render import markdown_table

RESULTS = "cost_model_trust"  # the folder under runs/ that repro.sim.trust writes by default
PHASES = ("gating", "dispatch", "experts", "combine", "dispatch_sim")


def _table(columns: list[str], rows: list[list]) -> str:
    return markdown_table(pd.DataFrame(rows, columns=columns))


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:+.0%}" if x < 0 else f"{x:.0%}"


def trust_section(runs_dir: str | Path) -> list[str]:
    path = Path(runs_dir) / RESULTS / "trust.json"
    lines = ["## How far to trust the cost model", ""]
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return lines + [f"No `{path}` yet: run `python -m bench.cpu_check`, `python -m bench --only cost_model`, then "
                        f"`python -m repro.sim.trust --out {Path(runs_dir) / RESULTS}`.", ""]
    lines += ["Every time in this report is priced by repro/sim/costs.py. Its measured errors (docs/cost_model.md; "
              "relative error = predicted / measured - 1):", ""]
    ex = data.get("exec")
    if ex:
        best = ex.get("best_of_repeats") or {}
        rows = [[p, _pct(ex[p]["median_abs_error"]), _pct(ex[p]["max_abs_error"]), _pct(ex[p]["median_signed_error"]),
                 "yes" if ex[p]["median_abs_error"] <= 0.20 else "**no**",
                 _pct(best[p]["median_abs_error"]) if p in best else "n/a"] for p in PHASES if p in ex]
        order = ex.get("order") or {}
        lines += [f"**Real executions** (repro.exec MoE layers on gloo, 2 and 4 ranks, ep and Sem-MoE, prefill and "
                  f"decode batches; CPU profile from bench.cpu_check's microbenchmarks only; machine load "
                  f"{ex.get('load')}): target median |error| <= 20 % per phase.", "",
                  _table(["phase", "median abs error", "max abs error", "median signed", "meets 20 %",
                         "median abs error, best of repeats"], rows), "",
                  f"`dispatch` prices the executor's three calls (counts, hidden states, ids + weights), `dispatch_sim` "
                  f"the simulator's single call. Best of repeats: both sides summarised by their fastest call (the load of "
                  f"the shared machine mostly removed). Ordering ep vs Sem-MoE: {order.get('resolved', 0)} of "
                  f"{order.get('comparisons', 0)} batch settings had a measured difference above twice the "
                  f"run-to-run noise; the model agreed on {order.get('agree', 0)} of them.", ""]
    else:
        lines += ["**Real executions**: no bench.bench_cost_model result was found when trust.json was written.", ""]
    pub = data["published"]
    summ = pub["summary"]
    lines += ["**Published measurements** (conf/validation/published.yaml, `python -m repro.sim.validation`): "
              + "; ".join(f"{name.replace('_', '-')} {s['rows']} rows, median |error| {s['median_abs_error']:.0%}, "
                          f"max {s['max_abs_error']:.0%} ({s['worst']})" for name, s in summ.items()) + ".", ""]
    out_rows = [[r["id"], r["setting"], f"{r['measured']:g} {r['unit']}", f"{r['predicted']:.3g}", _pct(r["error"])]
                for r in pub["rows"] if not r["in_sample"]]
    lines += [_table(["out-of-sample row", "setting", "measured", "predicted", "error"], out_rows), ""]
    band_rows = [[name, f"x(1 ± {b['comm']:.2f})", f"x(1 ± {b['compute']:.2f})",
                  f"{data['breakeven_by_band'][name]['flips']} of {data['breakeven_by_band'][name]['cells']}",
                  data["breakeven_by_band"][name]["max_gain_move"]] for name, b in data["bands"].items()]
    lines += ["**Does the break-even map survive?** Each band scales every all-to-all term (comm) and every GEMM / "
              "memory term (compute) by its error, in the two directions that move a cell most; a cell flips when "
              "its status (Sem-MoE pays at any LAR gain / from a gain / never) changes.", "",
              _table(["band", "comm", "compute", "break-even cells that flip", "largest move of a break-even "
                              "gain"], band_rows), ""]
    first = next(iter(data["bands"]))
    flipped = [c for c in data["breakeven"] if c["bands"][first]["flips"]]
    if flipped:
        lines += [f"Cells that flip under the {first} band: "
                  + "; ".join(f"{c['model']} on {c['hardware']} / {c['backend']}, {c['tokens_per_rank']} tokens per rank, "
                              f"Sem-MoE imbalance {c['imbalance_semmoe']} ({c['status']} -> "
                              f"{c['bands'][first]['comm_up']} / {c['bands'][first]['comm_down']})" for c in flipped[:12])
                  + ".", ""]
    lines += ["The verdict rows (R1's all-to-all share, R4's throughput ratios) are re-priced under the published "
              "and the executor-median bands by experiment `cost_bands` (serve_dp under each corner; `make "
              "reproduce-beyond`): the verdict section's table \"Under the cost model's measured error bands\" says "
              "where one flips.", ""]
    return lines
