"""Report sections on Attention-DP serving against round-robin EP: where each system's gain comes from (load
balance vs locality), and where the offline estimate and serving disagree in sign.

Ratios are paired per seed (same arrivals and requests) against the `ep` job of the same experiment, devices
and evaluate split (repro.sim.metrics.ratio_interval, widened by the bisection's rel_tol); only values converged on
every seed are used, others read "unconverged".

Gain split: a load-aware Sem-MoE (dp_scheduler=load) is compared with its twin, the locality-free router with the
same load rule and no slack (`TWINS`: vanilla EP placement, the same engine view): the twin's ratio is the part a
load balancer gets, and the system's ratio over the twin's is the rest (locality, placement included). Any other
system is split against the best locality-free load balancer of the experiment.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from repro.sim.metrics import ratio_interval

RULES = {"capacity": "capacity_rps_per_seed", "ttft": "throughput_under_ttft_slo_rps_per_seed"}
LOAD_BALANCERS = ("round_robin", "shortest_queue", "minimum_tokens", "vllm_dp", "balance_route", "gimbal", "least_wait")
GROUP = ("experiment", "devices", "evaluate_split")
TARGET_HALFWIDTH = 0.05  # issue 32: every paired ratio judged within +-5 %
# Sem-MoE dp_load_rule -> the system that applies the same rule without affinity (repro/systems/dp_balance.py)
TWINS = {"shortest_queue": "shortest_queue", "minimum_tokens": "minimum_tokens", "vllm": "vllm_dp",
         "balance_route": "balance_route", "wait": "least_wait"}


def _label(job) -> str:
    """The system name, with the job folder where one experiment ran the system under several settings."""
    return job["system"] if job["_variants"] == 1 else f"{job['system']} ({str(job['run_dir']).rsplit('/', 1)[-1]})"


def serving_ratios(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per serving job of Attention-DP with an `ep` job beside it: paired capacity and TTFT-SLO throughput
    ratios vs ep (mean, low, high; NaN where unconverged) and the offline time estimate's ratio (ep / system: > 1
    says the system is faster)."""
    needed = {"capacity_rps_per_seed", "converged_capacity", "system", "attention"}
    if not needed <= set(summary.columns):
        return pd.DataFrame()
    jobs = summary[summary["capacity_rps_per_seed"].apply(lambda v: isinstance(v, list)) & (summary["attention"] == "dp")]
    rows = []
    for _, group in jobs.groupby(list(GROUP), dropna=False):
        ep = group[group["system"] == "ep"]
        if len(ep) != 1:
            continue
        ep = ep.iloc[0]
        group = group.assign(_variants=group.groupby("system")["system"].transform("size"))
        for _, job in group.iterrows():
            row = {key: job[key] for key in GROUP} | {"system": job["system"], "label": _label(job),
                                                       "dp_scheduler": job.get("dp_scheduler"),
                                                       "twin": TWINS.get(job.get("dp_load_rule"))}
            for rule, key in RULES.items():
                converged = _true(job.get(f"converged_{rule}")) and _true(ep.get(f"converged_{rule}"))
                interval = ratio_interval(job[key], ep[key], resolution=float(job.get("slo_rel_tol", 0.0) or 0.0))
                for part in ("mean", "low", "high"):
                    row[f"{rule}_{part}"] = interval[part] if converged else np.nan
                row[f"{rule}_seeds"] = interval["n"]  # paired over the seeds both jobs ran
            phased = all(_number(j.get("time_estimate_serving_s")) for j in (job, ep))
            key = "time_estimate_serving_s" if phased else "time_estimate_s"
            estimate, ep_estimate = job.get(key), ep.get(key)  # decode steps counted where the routing has them
            row["offline_speedup"] = ep_estimate / estimate if estimate and ep_estimate else np.nan
            rows.append(row)
    return pd.DataFrame(rows)


def _number(value) -> bool:
    return isinstance(value, int | float | np.number) and bool(np.isfinite(value))


def _true(value) -> bool:
    """A converged flag that is True (a missing or NaN flag is not)."""
    return isinstance(value, bool | np.bool_) and bool(value)


def _cell(row, rule: str) -> str:
    mean = row[f"{rule}_mean"]
    if not np.isfinite(mean):
        return "unconverged"
    return f"{mean:.3f} [{row[f'{rule}_low']:.3f}, {row[f'{rule}_high']:.3f}]"


def gain_split_section(summary: pd.DataFrame) -> list[str]:
    """Markdown lines: each system's serving ratio vs round-robin EP, split into a load-balancer part and the rest."""
    ratios = serving_ratios(summary)
    if ratios.empty:
        return []
    lines = ["## Where the serving gains come from (Attention-DP, vs round-robin EP)", "",
             "Capacity (highest rate with a stable queue) and TTFT-SLO throughput of each system over `ep`'s, paired "
             "per seed with 95 % intervals. *Load part*: the locality-free router's ratio (for a load-aware Sem-MoE "
             "the system applying its load rule without affinity; else the best load balancer of the experiment); "
             "*locality part*: the system's ratio over that router's (placement and affinity together).", "",
             "| experiment | D | split | system | seeds | capacity vs ep | TTFT-SLO vs ep | load part (router) | "
             "locality part | offline estimate vs ep |", "|---" * 10 + "|"]
    for key, group in ratios.groupby(list(GROUP), dropna=False):
        balancers = group[group["system"].isin(LOAD_BALANCERS) & np.isfinite(group["capacity_mean"])]
        best = balancers.loc[balancers["capacity_mean"].idxmax()] if len(balancers) else None
        for _, row in group.sort_values("label").iterrows():
            router = None
            if row["system"] not in LOAD_BALANCERS and row["system"] != "ep":
                twin = group[group["system"] == row["twin"]] if row["dp_scheduler"] == "load" else group.iloc[:0]
                router = twin.iloc[0] if len(twin) else best
            load = "-" if router is None else f"{_cell(router, 'capacity')} ({router['label']})"
            judged = router is not None and np.isfinite(row["capacity_mean"]) and np.isfinite(router["capacity_mean"])
            locality = f"{row['capacity_mean'] / router['capacity_mean']:.3f}" if judged else "-"
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {row['label']} | {row['capacity_seeds']} | "
                         f"{_cell(row, 'capacity')} | {_cell(row, 'ttft')} | {load} | {locality} | "
                         f"{row['offline_speedup']:.3f} |")
    wide = [f"{row['label']} ({row['experiment']}, {rule})" for _, row in ratios[ratios["system"] != "ep"].iterrows()
            for rule in RULES if np.isfinite(row[f"{rule}_mean"]) and not within_target(row, rule)]
    lines += ["", f"Intervals wider than +-{TARGET_HALFWIDTH:.0%} of the ratio (add seeds: sim.seeds_until): "
              + (", ".join(wide) if wide else "none") + "."]
    return lines + [""]


def within_target(row, rule: str) -> bool:
    """Whether a paired ratio's interval lies within +-TARGET_HALFWIDTH of its mean."""
    mean = row[f"{rule}_mean"]
    return row[f"{rule}_high"] <= mean * (1 + TARGET_HALFWIDTH) and row[f"{rule}_low"] >= mean * (1 - TARGET_HALFWIDTH)


def sign_disagreements(ratios: pd.DataFrame) -> pd.DataFrame:
    """The rows whose offline estimate says faster than ep (> 1) while serving capacity is below ep's beyond its
    interval, or the reverse."""
    if ratios.empty:
        return ratios
    offline_faster = ratios["offline_speedup"] > 1
    serving_slower = ratios["capacity_high"] < 1
    serving_faster = ratios["capacity_low"] > 1
    return ratios[(offline_faster & serving_slower) | (~offline_faster & serving_faster)]


def sign_section(summary: pd.DataFrame) -> list[str]:
    """Markdown lines: every serving job whose offline estimate and serving capacity disagree in sign vs ep."""
    ratios = serving_ratios(summary)
    if ratios.empty:
        return []
    disagree = sign_disagreements(ratios[ratios["system"] != "ep"])
    lines = ["## Offline estimate vs serving: sign disagreements", "",
             f"{len(disagree)} of {int((ratios['system'] != 'ep').sum())} serving jobs (Attention-DP, vs `ep`) have an "
             "offline time estimate and a serving capacity on opposite sides of 1 (serving beyond its interval). "
             "The offline estimate prices fixed steps over the whole evaluated split assigned at once, with no engine "
             "state: it charges round robin for a token imbalance continuous batching removes, and cannot see the "
             "queue a scheduler builds (docs/dp_routing.md).", ""]
    if len(disagree):
        lines += ["| experiment | D | split | system | offline estimate vs ep | capacity vs ep |", "|---" * 6 + "|"]
        lines += [f"| {r['experiment']} | {r['devices']} | {r['evaluate_split']} | {r['label']} | "
                  f"{r['offline_speedup']:.3f} | {_cell(r, 'capacity')} |" for _, r in disagree.iterrows()]
    return lines + [""]
