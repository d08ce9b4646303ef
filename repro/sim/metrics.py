"""Serving metrics of simulated runs: latency percentiles, throughput, MoE-layer breakdown, SLO goodput.

Per request: TTFT = first token - arrival; E2E = finish - arrival; TPOT = (finish - first token) / (output - 1)
(undefined for one-token outputs, which then meet any TPOT SLO). Throughput = completed requests (or tokens) /
(last finish - first arrival). Two goodput rules:
  paper      SLO = multiplier (5) x a latency statistic at the lightest swept rate (Sem-MoE, after Wu et al. 2024);
             the result is the highest measured throughput among swept rates whose statistic meets the SLO.
  distserve  the highest request rate at which >= `attainment` (90 %) of requests meet both the TTFT and the TPOT
             SLO, bracketed by the sweep and refined by bisection (DistServe).
No rate meeting an SLO gives 0.0 and a warning sentence, never an error.

Legend: R requests, L MoE layers, C cost components (repro.sim.costs.COMPONENTS).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from repro.errors import ConfigError
from repro.sim.costs import COMPONENTS
from repro.sim.engine import RunResult

STATISTICS = ("mean", "p50", "p90", "p99")
LATENCIES = ("ttft", "tpot", "e2e")


def request_latencies(run: RunResult, output_len: np.ndarray) -> dict[str, np.ndarray]:
    """{"ttft", "tpot", "e2e"}: float64[R] seconds (tpot NaN where output_len == 1)."""
    decode_steps = (output_len - 1).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(decode_steps > 0, (run.finish - run.first_token) / decode_steps, np.nan)
    return {"ttft": run.first_token - run.arrival, "tpot": tpot, "e2e": run.finish - run.arrival}


def statistic(values: np.ndarray, name: str) -> float:
    """mean or p50 / p90 / p99 over the finite values (NaN when there are none)."""
    values = values[np.isfinite(values)]
    if not len(values):
        return float("nan")
    if name == "mean":
        return float(values.mean())
    return float(np.percentile(values, int(name[1:])))


def attainment(latency: dict[str, np.ndarray], ttft_slo: float, tpot_slo: float) -> float:
    """Share of requests meeting both the TTFT and the TPOT SLO (a request without TPOT meets that one)."""
    ok = (latency["ttft"] <= ttft_slo) & (~np.isfinite(latency["tpot"]) | (latency["tpot"] <= tpot_slo))
    return float(ok.mean())


def rate_row(rate: float, run: RunResult, prompt_len: np.ndarray, output_len: np.ndarray) -> dict:
    """One row of the per-rate table: throughput, latency statistics, MoE-layer breakdown, LAR, engine counters."""
    latency = request_latencies(run, output_len)
    makespan = float(np.nanmax(run.finish) - run.arrival.min())
    row: dict = {
        "rate": float(rate),
        "num_requests": len(output_len),
        "makespan_s": makespan,
        "throughput_rps": len(output_len) / makespan,
        "output_tok_s": float(output_len.sum()) / makespan,
        "total_tok_s": float((output_len + prompt_len).sum()) / makespan,
    }
    for name in LATENCIES:
        for stat in STATISTICS:
            row[f"{name}_{stat}_s"] = statistic(latency[name], stat)
    per_iteration = run.moe_seconds / max(run.iterations, 1)  # [L, C] mean over iterations
    mean_layer = per_iteration.mean(axis=0)
    for c, name in enumerate(COMPONENTS):
        row[f"moe_{name}_s"] = float(mean_layer[c])
    row["a2a_share"] = a2a_share(mean_layer)
    row.update(
        lar=run.local_activations / max(run.total_activations, 1),
        remote_token_copies=run.remote_copies,
        iterations=run.iterations,
        prefill_iterations=run.prefill_iterations,
        blocks=run.blocks,
        events=run.events,
        busy_share=run.busy_seconds / makespan,
        tokens_per_iteration=run.tokens / max(run.iterations, 1),
    )
    return row


def a2a_share(components_C: np.ndarray) -> float:
    """(dispatch + combine) / (gate + dispatch + experts + combine) of one MoE layer (the paper's Fig. 1 split)."""
    c = dict(zip(COMPONENTS, components_C, strict=True))
    layer = c["gate"] + c["dispatch"] + c["experts"] + c["combine"]
    return float((c["dispatch"] + c["combine"]) / layer) if layer > 0 else float("nan")


def layer_rows(rate: float, run: RunResult, layer_ids) -> list[dict]:
    """One row per MoE layer: mean seconds per iteration of each component, and its all-to-all share."""
    per_iteration = run.moe_seconds / max(run.iterations, 1)
    rows = []
    for layer, values in enumerate(per_iteration):
        row = {"rate": float(rate), "layer": layer, "layer_id": int(layer_ids[layer])}
        row.update({f"{name}_s": float(v) for name, v in zip(COMPONENTS, values, strict=True)})
        row["a2a_share"] = a2a_share(values)
        rows.append(row)
    return rows


def paper_slo(per_rate: pd.DataFrame, latency: str, stat: str, multiplier: float) -> float:
    """multiplier x the `latency`_`stat` at the lightest swept rate."""
    lightest = per_rate.loc[per_rate["rate"].idxmin()]
    return float(multiplier * lightest[f"{latency}_{stat}_s"])


def throughput_under_slo(per_rate: pd.DataFrame, latency: str, stat: str, slo: float) -> float:
    """Highest measured throughput (req/s) among swept rates whose `latency`_`stat` is within `slo`; 0.0 if none."""
    meets = per_rate[per_rate[f"{latency}_{stat}_s"] <= slo]
    return float(meets["throughput_rps"].max()) if len(meets) else 0.0


def bisect_goodput(rates: np.ndarray, attained: np.ndarray, target: float, probe: Callable[[float], float],
                   steps: int) -> tuple[float, bool]:
    """(goodput rate, bracketed): the DistServe rule over a sweep, refined by `steps` bisection probes.

    rates float64[n] ascending with attained float64[n] (share of requests meeting the SLOs); probe(rate) runs
    one more simulation and returns its attainment. Not bracketed when even the highest rate meets the target
    (the goodput is then at least that rate). 0.0 when the lightest rate already misses it.
    """
    if steps < 0:
        raise ConfigError(f"sim.slo.bisect_steps must be >= 0, got {steps}.")
    ok = attained >= target
    if not ok[0]:
        return 0.0, True
    first_miss = int(np.argmin(ok)) if not ok.all() else len(ok)
    if first_miss == len(ok):
        return float(rates[-1]), False
    low, high = float(rates[first_miss - 1]), float(rates[first_miss])
    for _ in range(steps):
        middle = 0.5 * (low + high)
        if probe(middle) >= target:
            low = middle
        else:
            high = middle
    return low, True
