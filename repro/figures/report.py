"""Figures and figures/REPORT.md, read only from finished jobs under runs/.

One function per figure; each takes the collected results and an output path and returns the path it wrote.
A job counts when its metrics.json exists (written last by repro.run); repro.figures.jobs finds and reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from repro.atomic import atomic_write_text  # noqa: E402
from repro.drift.report import report as drift_report  # noqa: E402
from repro.figures.breakeven import breakeven_section  # noqa: E402
from repro.figures.jobs import find_job_files, log, read_jobs, skipped_lines, sweep_notes  # noqa: E402
from repro.figures.palette import series_style  # noqa: E402
from repro.figures.paper import paper_section  # noqa: E402
from repro.figures.render import FRACTIONS, markdown_table, metric_axis, save_png  # noqa: E402
from repro.figures.replication import replication_section  # noqa: E402
from repro.figures.serving import gain_split_section, sign_section  # noqa: E402
from repro.figures.table2 import table2_section  # noqa: E402
from repro.figures.trust import trust_section  # noqa: E402
from repro.figures.verdict import verdict_section  # noqa: E402

# Hydra override keys (last dotted part) that a figure's panels and colours already tell apart; the others name a
# job within a panel
PANEL_OVERRIDES = {"devices", "attention", "system", "model", "workload", "eval_workload"}


def _overrides(job: str) -> dict[str, str]:
    """A job folder's name (Hydra's override dirname, "parallel.devices=4,system=ep") as {key: value}."""
    items = {}
    for item in str(job).split(","):
        key, sep, value = item.partition("=")
        if sep:
            items[key.lstrip("+~")] = value
    return items


def _series_extra(job: str) -> str:
    """The job's overrides that no panel shows ("lookback=2"), short keys; "" when none."""
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in _overrides(job).items() if k.split(".")[-1] not in PANEL_OVERRIDES)


def _panel_name(keys: dict) -> str:
    parts = [f"{v}" if k != "attention" else f"Attention-{str(v).upper()}" for k, v in keys.items() if k != "devices"]
    return ", ".join(parts + ([f"EP {keys['devices']}"] if "devices" in keys else []))


def _plot_series(ax, jobs: pd.DataFrame, x: str, y: str, scale: float) -> None:
    """One line per series of `jobs` (rows: x, y, system, kind, job), in the palette's colour and line style; a
    series is a system plus the overrides that tell its jobs apart (lookback=0 vs 2), never an average of jobs."""
    jobs = jobs.assign(extra=[_series_extra(j) for j in jobs["job"]])
    for (system, kind), same_system in jobs.groupby(["system", "kind"], sort=True, dropna=False):
        variants = sorted(same_system["extra"].unique())
        for variant, (extra, line) in enumerate(same_system.groupby("extra", sort=True)):
            # jobs of one system that differ in something else: same colour family, own marker and shade
            style = series_style(system, kind, variant=variant if len(variants) > 1 else 0)
            if len(variants) > 1 and extra:
                style["label"] += f" [{extra}]"
            line = line.sort_values(x)
            ax.plot(line[x], line[y] * scale, ms=3.5, **style)


def _legend(fig, axes) -> None:
    """One legend for the whole figure, right of the panels (a series drawn in several panels is listed once)."""
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    if handles:
        fig.legend(handles.values(), handles.keys(), loc="outside right center", fontsize=7)


def _finish_axis(ax, metric: str, ylabel: bool) -> None:
    label, _ = metric_axis(metric)
    if ylabel:
        ax.set_ylabel(label)
    if metric in FRACTIONS:
        ax.set_ylim(0, 1)  # fixed, so panels and figures compare at a glance (no auto-zoom)


def fig_per_layer(per_layer: pd.DataFrame, metric: str, path: Path, note: str = "") -> Path:
    """`metric` per MoE layer, one line per job: a row of panels per routing source (model) x evaluated workload x
    attention mode present, a column per EP degree. Models with different layer counts get their own panels, so
    no line averages layers of different models. `note` (e.g. "partial sweep") goes in the title."""
    label_keys = [k for k in ("model_name", "eval_workload", "attention") if k in per_layer]
    rows = sorted({tuple(r) for r in per_layer[label_keys].itertuples(index=False)}, key=str)
    degrees = sorted(per_layer["devices"].unique())
    fig, axes = plt.subplots(len(rows), len(degrees), figsize=(3.8 * len(degrees), 2.9 * len(rows)),
                             squeeze=False, sharey=metric in FRACTIONS, layout="constrained")
    _, scale = metric_axis(metric)
    for r, values in enumerate(rows):
        in_row = (per_layer[label_keys] == pd.Series(values, index=label_keys)).all(axis=1)
        for c, devices in enumerate(degrees):
            ax = axes[r][c]
            sel = per_layer[in_row & (per_layer["devices"] == devices)]
            _plot_series(ax, sel, "layer_id", metric, scale)
            ax.set_title(_panel_name({**dict(zip(label_keys, values, strict=True)), "devices": devices}), fontsize=8)
            ax.set_xlabel("model layer index (MoE layers)")
            ax.xaxis.get_major_locator().set_params(integer=True)
            _finish_axis(ax, metric, c == 0)
    _legend(fig, axes.ravel())
    if note:
        fig.suptitle(note, fontsize=9, color="#b00020")
    return save_png(fig, path)


def fig_vs_ep(summary: pd.DataFrame, metric: str, path: Path, note: str = "") -> Path:
    """Overall `metric` against EP degree, one line per series (system + the overrides that tell its jobs apart):
    a row of panels per routing source x evaluated workload, a column per attention mode; 1/D (the LAR of
    uniform placement) dotted on LAR panels."""
    label_keys = ["model_name", "eval_workload"]
    rows = sorted({tuple(r) for r in summary[label_keys].itertuples(index=False)}, key=str)
    modes = sorted(summary["attention"].unique())
    fig, axes = plt.subplots(len(rows), len(modes), figsize=(4.4 * len(modes), 3.3 * len(rows)),
                             squeeze=False, sharey=metric in FRACTIONS, layout="constrained")
    _, scale = metric_axis(metric)
    d = np.array(sorted(summary["devices"].unique()))
    for r, values in enumerate(rows):
        in_row = (summary[label_keys] == pd.Series(values, index=label_keys)).all(axis=1)
        for c, mode in enumerate(modes):
            ax = axes[r][c]
            _plot_series(ax, summary[in_row & (summary["attention"] == mode)], "devices", metric, scale)
            if metric == "lar":
                ax.plot(d, 1.0 / d, ":", color="0.4", label="1/D (uniform placement)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(d, [str(x) for x in d])
            ax.minorticks_off()
            ax.set_title(_panel_name({"model_name": values[0], "eval_workload": values[1], "attention": mode}),
                         fontsize=8)
            ax.set_xlabel("EP degree D (devices)")
            _finish_axis(ax, metric, c == 0)
    _legend(fig, axes.ravel())
    if note:
        fig.suptitle(note, fontsize=9, color="#b00020")
    return save_png(fig, path)


def fig_traffic_heatmap(run_dir: Path, path: Path) -> Path:
    """Dispatch bytes from each source device to each destination device, summed over MoE layers."""
    traffic = np.load(Path(run_dir) / "traffic.npy").sum(axis=0)
    fig, ax = plt.subplots(figsize=(4.6, 3.8))
    sns.heatmap(traffic / 2**20, annot=traffic.shape[0] <= 8, fmt=".0f", cmap="rocket_r", ax=ax,
                cbar_kws={"label": "dispatch MiB, summed over MoE layers"})
    ax.set_xlabel("destination device")
    ax.set_ylabel("source device")
    return save_png(fig, path)


def fig_activation_heatmap(run_dir: Path, path: Path) -> Path:
    """Token x expert activation shares of the most frequent evaluated tokens, first and last MoE layer."""
    with np.load(Path(run_dir) / "activation_map.npz", allow_pickle=False) as z:
        counts, layer_ids = z["counts"], z["layer_ids"]
    picks = sorted({0, len(layer_ids) - 1})
    fig, axes = plt.subplots(1, len(picks), figsize=(4.6 * len(picks), 4.2), squeeze=False, layout="constrained")
    for ax, layer in zip(axes[0], picks, strict=True):
        share = counts[layer] / np.maximum(counts[layer].sum(axis=1, keepdims=True), 1)
        sns.heatmap(share, cmap="mako_r", vmin=0, vmax=share.max(), ax=ax, yticklabels=False,
                    cbar_kws={"label": "share of the token's activations"})
        ax.set_title(f"model layer {layer_ids[layer]}")
        ax.set_xlabel("expert")
        ax.set_ylabel(f"{share.shape[0]} most frequent tokens")
    return save_png(fig, path)


def systems_table(summary: pd.DataFrame) -> str:
    """Markdown table: kind, LAR, a2a bytes, imbalance per system x EP degree x attention mode (x workloads).

    Bounds report their proven ceiling as `lar` (and the LAR of their feasible witness as `lar_achieved`);
    hindsight rows are fitted on the evaluated routing and are neither deployable nor ceilings.
    """
    group = ["workload", "eval_workload", "evaluate_split", "attention", "devices"]
    cols = group + ["system", "kind", "lar", "lar_achieved", "a2a_bytes", "expert_load_imbalance_max_mean",
                    "token_imbalance_max_mean", "plan_dp_lookahead_requests_max"]
    cols = [c for c in cols if c in summary and summary[c].notna().any()]
    # jobs that differ in something else than the columns (e.g. a swept system parameter) are told apart by job
    if summary.duplicated(subset=[c for c in group + ["system"] if c in summary]).any():
        cols.insert(cols.index("system") + 1, "job")
    table = summary[cols].sort_values(cols[: cols.index("system") + 1]).copy()
    keys = list(zip(*(table[c] for c in group), strict=True))

    def ratio_to(systems: tuple[str, ...], column: str) -> None:
        if "lar" not in table:  # e.g. drift jobs without their per-window horizon runs measure no LAR
            return
        ref = table[table["system"].isin(systems)].set_index(group)["lar"]
        ref = ref[~ref.index.duplicated()]
        if len(ref):
            table[column] = [lar / ref.get(k, np.nan) for lar, k in zip(table["lar"], keys, strict=True)]

    ratio_to(("ep",), "lar_vs_ep")
    # the ceiling of each mode: the token oracle (TP) or the DP bound (DP), whichever the sweep ran
    ratio_to(("token_oracle", "dp_bound"), "lar_vs_bound")
    if "a2a_bytes" in table:
        table["a2a_bytes"] = table["a2a_bytes"].map(lambda b: f"{b / 2**20:.1f} MiB")
    text = markdown_table(table)
    bounds = summary[summary["kind"] == "bound"].drop_duplicates("system") if "kind" in summary else summary.iloc[:0]
    notes = [f"- `{b.system}` (bound): {b.bound_constraint}" for b in bounds.itertuples() if isinstance(b.bound_constraint, str)]
    if (summary.get("kind") == "hindsight").any():
        notes.append("- kind `hindsight`: fitted on the evaluated routing itself; neither a deployable system nor a ceiling.")
    return text + ("\n\n" + "\n".join(notes) if notes else "")


def affinity_section(run_dir: Path) -> list[str]:
    """The paper's Table 1 (static top-k F1, cumulative top-k hotness, max non-top-k hotness) of a job's profile."""
    path = run_dir / "affinity_stats.csv"
    if not path.exists():
        return []
    stats = pd.read_csv(path)
    cols = ["model_layer", "f1_p25", "f1_p50", "f1_p75", "topk_hotness_p50", "max_nontopk_hotness_p50", "kurtosis_p50"]
    return ["### Token-expert affinity of the profile split (paper Table 1)", "",
            markdown_table(stats[[c for c in cols if c in stats]]), ""]


def routing_sources_section(runs: pd.DataFrame) -> list[str]:
    """Per routing source (model): Sem-MoE's Attention-TP LAR with the token table alone (lookback 0) and with
    the Markov history (lookback 2), beside the paper's Table 1 statistics of that source's profile split."""
    rows = []
    for run in runs.itertuples():
        stats_path = Path(run.run_dir) / "affinity_stats.csv"
        stats = pd.read_csv(stats_path) if stats_path.exists() else pd.DataFrame()
        row = {"model": run.model_name, "devices": run.devices, "lookback": run.lookback, "lar": run.lar}
        for col in ("f1_p50", "topk_hotness_p50", "max_nontopk_hotness_p50"):
            if col in stats:
                row[f"{col} (median over layers)"] = float(stats[col].median())
        rows.append(row)
    table = pd.DataFrame(rows)
    if table["lookback"].nunique() < 2:
        return []
    lar = table.pivot_table(index=["model", "devices"], columns="lookback", values="lar")
    lar.columns = [f"lar_lookback_{int(c)}" for c in lar.columns]
    first, last = lar.columns[0], lar.columns[-1]
    lar["history_gain"] = lar[last] - lar[first]
    stats = table.drop(columns=["lookback", "lar"]).groupby(["model", "devices"]).first()
    out = lar.join(stats).reset_index()
    return ["### Inter-layer dependence per routing source (Sem-MoE, Attention-TP)", "",
            "history_gain = LAR with the Markov history minus LAR with the token table alone (same placement "
            "rule, same evaluate split); the Table 1 columns show how deterministic each source's token->expert "
            "routing is.", "", markdown_table(out), ""]


def tuned_section(runs_dir: Path) -> list[str]:
    """Tuned defaults (python -m repro.tune): chosen on validate, then both the default and the chosen values
    measured once on evaluate."""
    rows, constraints = [], {}
    for path in find_job_files(runs_dir, "tuned.json"):
        try:
            t = json.loads(path.read_text(encoding="utf-8"))
            objective = t["objective"]
            row = {
                "system": t["system"], "model": t["model"], "workload": t["workload"], "attention": t["attention"],
                "devices": t["devices"],
                "default": ", ".join(f"{k.split('.')[-1]}={v}" for k, v in t["default"]["values"].items()),
                "chosen on validate": ", ".join(f"{k.split('.')[-1]}={v}" for k, v in t["chosen"]["values"].items()),
                f"default {objective} (validate)": t["default"]["validate"][objective],
                f"chosen {objective} (validate)": t["chosen"]["validate"][objective],
                f"default {objective} (evaluate)": t["default"]["evaluate"][objective],
                f"chosen {objective} (evaluate)": t["chosen"]["evaluate"][objective],
            }
            constraints = t["constraints"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            log.warning("skipped the tuning result %s: it cannot be read (%s: %s).", path, type(error).__name__, error)
            continue
        rows.append(row)
    if not rows:
        return []
    return ["## Tuned defaults (`python -m repro.tune`)", "",
            "Each grid candidate was fitted on the profile split and compared on the validate split (feasible: "
            + ", ".join(f"{k} <= {v}" for k, v in constraints.items())
            + "); only the defaults and the chosen values were then measured on the evaluate split, once each.", "",
            markdown_table(pd.DataFrame(rows).sort_values(["system", "model", "attention", "devices"])), ""]


def exec_section(runs: pd.DataFrame) -> list[str]:
    """Real multi-process execution (repro.exec): bytes the ranks sent vs the evaluator's count, output error,
    and measured all-to-all seconds, with both as ratios to vanilla EP of the same attention mode."""
    if "exec_dispatch_bytes" not in runs or runs["exec_dispatch_bytes"].isna().all():
        return []
    runs = runs[runs["exec_dispatch_bytes"].notna()].copy()
    error = runs["exec_max_logit_error"] if "exec_max_logit_error" in runs else runs["exec_max_abs_error"]
    runs["exec_max_error"] = error.fillna(runs.get("exec_max_abs_error"))
    runs["exec_a2a_seconds"] = runs["exec_dispatch_seconds"] + runs["exec_combine_seconds"]
    ep = runs[runs["system"] == "ep"].set_index("attention")
    for column, ratio in (("exec_dispatch_bytes", "bytes_vs_ep"), ("exec_a2a_seconds", "a2a_seconds_vs_ep"),
                          ("exec_evaluator_dispatch_bytes", "evaluator_bytes_vs_ep")):
        runs[ratio] = [v / ep[column].get(a, np.nan) for v, a in zip(runs[column], runs["attention"], strict=True)]
    cols = ["attention", "system", "exec_world_size", "exec_num_tokens", "exec_dispatch_bytes",
            "exec_evaluator_dispatch_bytes", "exec_bytes_match_evaluator", "bytes_vs_ep", "evaluator_bytes_vs_ep",
            "exec_a2a_seconds", "a2a_seconds_vs_ep", "exec_max_error", "exec_output_matches_reference"]
    if "exec_routing_match" in runs:
        cols.append("exec_routing_match")
    table = runs[[c for c in cols if c in runs]].sort_values(["attention", "system"])
    for column in ("exec_world_size", "exec_num_tokens", "exec_dispatch_bytes", "exec_evaluator_dispatch_bytes"):
        table[column] = table[column].astype(np.int64)
    table["exec_max_error"] = table["exec_max_error"].map(lambda e: f"{e:.1e}")
    return ["### Real execution on gloo ranks (`repro.exec`)", "",
            "Bytes are what the ranks' dispatch all-to-alls sent to other ranks (hidden states only; routing "
            "metadata is counted apart), next to the evaluator's count for the same plan and tokens; seconds are "
            "wall time in the dispatch + combine collectives on this CPU machine (gloo), not a GPU estimate. "
            "max_error: output vs the single-process model (logits for the tiny model).", "",
            markdown_table(table), ""]


DECODE_COLUMNS = ("prefill_lar", "decode_lar", "decode_token_imbalance_max_mean", "decode_step_token_imbalance_max_mean",
                  "decode_batch_distinct_experts_max", "decode_device_distinct_experts_max", "decode_moe_seconds_per_step")


def decode_section(runs: pd.DataFrame) -> list[str]:
    """Decode as a phase of its own (repro.eval.decode_phase): prefill and decode LAR side by side, decode token
    balance, expert weights read per step and the MoE time per decode step, with its ratio to vanilla EP. Jobs
    whose routing has no generated tokens are named in one line."""
    if "decode_phase" not in runs or runs["decode_phase"].isna().all():
        return []
    measured = runs[runs["decode_phase"] == "measured"].copy()
    lines = ["### Decode phase (generated tokens, served as decode steps)", ""]
    if len(measured) < len(runs):
        lines += [f"- {len(runs) - len(measured)} of {len(runs)} jobs: routing without generated tokens, so no decode "
                  "metric (route with model.max_new_tokens > 0 or import prefill lengths).", ""]
    if not len(measured):
        return lines
    group = [c for c in ("eval_workload", "attention", "devices") if c in measured]
    if "decode_moe_seconds_per_step" in measured:
        ep = measured[measured["system"] == "ep"].drop_duplicates(group).set_index(group)["decode_moe_seconds_per_step"]
        keys = list(zip(*(measured[c] for c in group), strict=True))
        measured["decode_time_vs_ep"] = [t / ep.get(k if len(k) > 1 else k[0], np.nan)
                                         for t, k in zip(measured["decode_moe_seconds_per_step"], keys, strict=True)]
        measured["decode_moe_seconds_per_step"] = measured["decode_moe_seconds_per_step"] * 1e3
        measured = measured.rename(columns={"decode_moe_seconds_per_step": "decode_moe_ms_per_step"})
    cols = group + ["system"] + [c.replace("seconds_per_step", "ms_per_step") for c in DECODE_COLUMNS] + ["decode_time_vs_ep"]
    table = measured[[c for c in cols if c in measured]].sort_values(group + ["system"])
    lines += ["Decode step t holds every request's t-th generated token on the device the plan put it; time is the MoE "
              "critical path of a step (busiest device: remote copies, rows, expert weights read) priced by the "
              "simulator's cost model. decode_time_vs_ep < 1: faster decode steps than vanilla EP.", "",
              markdown_table(table), ""]
    return lines


def convergence_section(summary: pd.DataFrame) -> list[str]:
    """Markdown lines: the convergence status of every serving job (repro.sim.metrics.steady_state): per rule,
    whether the runs deciding it converged on every seed, and the runs that reached sim.max_duration_s unconverged.
    The verdict judges only converged values."""
    if "sim_runs" not in summary:
        return []
    jobs = summary[summary["sim_runs"].notna()].sort_values(["experiment", "system"])
    if not len(jobs):
        return []
    rules = ("ttft", "e2e", "distserve", "capacity")
    lines = ["## Serving convergence", "",
             "Each simulated run doubles its arrivals until its window settles the queue's stability and, when stable, "
             "the 95 % half-widths of mean TTFT and E2E are within `sim.rel_halfwidth` (2 %); a bisection probe until "
             "every rule's comparison with its SLO is settled; up to `sim.max_duration_s`. A rule's value is "
             "converged when the runs deciding it (the highest meeting rate and the lowest failing one) settled it on "
             "every seed (the capacity rule asks only the stability verdict). The verdict judges only converged "
             "values.", "",
             "| experiment | system | " + " | ".join(rules) + " | runs converged | unconverged runs (first 3) |",
             "|---" * (len(rules) + 4) + "|"]
    for job in jobs.itertuples():
        flags = ["yes" if getattr(job, f"converged_{r}", None) is True else "**no**" for r in rules]
        runs = getattr(job, "sim_unconverged_runs", None)
        runs = runs if isinstance(runs, list) else []
        done = getattr(job, "sim_runs_converged", float("nan"))
        share = f"{int(done)} / {int(job.sim_runs)}" if pd.notna(done) else "not recorded"
        lines.append(f"| {job.experiment} | {job.system} | " + " | ".join(flags) + f" | {share} | "
                     + ("; ".join(runs[:3]) or "-") + " |")
    return lines + [""]


def _config_block(run_dir: str) -> str:
    cfg = json.loads((Path(run_dir) / "metrics.json").read_text())["config"]
    keep = {k: cfg[k] for k in ("model", "workload", "system", "parallel", "seed", "profile_fraction", "validate_fraction")
            if k in cfg}
    return "```json\n" + json.dumps(keep, indent=1) + "\n```"


def drift_section(runs: pd.DataFrame) -> list[str]:
    """The drift experiment's policy tables and its targets (repro.drift.report), for jobs that ran it."""
    if "policies" not in runs or not runs["policies"].notna().any():
        return []
    folders = [Path(d) for d in runs["run_dir"]]
    return ["### Placement over time (python -m repro.drift.report)", "", drift_report(folders[0].parent, folders), ""]


def experiment_section(experiment: str, runs: pd.DataFrame, layers: pd.DataFrame, out_dir: Path,
                       partial: str = "") -> list[str]:
    """Markdown lines of one experiment: its systems table, figures (PNGs under out_dir/<experiment>/), the
    sections only some experiments have, and its config. `partial`: the sweep_notes sentence, when incomplete."""
    heading = f"## Experiment `{experiment}`" + (" (partial sweep)" if partial else "")
    swept = [c for c in ("system", "devices", "attention", "eval_workload", "model_name") if runs[c].nunique() > 1]
    lines = [heading, ""]
    if partial:
        lines += [f"**{partial[0].upper() + partial[1:]}**: the figures and tables below show only those; rerun "
                  "the sweep to complete it.", ""]
    lines += [f"{len(runs)} jobs; swept: {', '.join(swept) or 'nothing'}.", "", systems_table(runs), ""]
    note = f"{experiment}: {partial}" if partial else ""
    figs = []
    if len(layers):
        figs.append(("LAR per MoE layer", fig_per_layer(layers, "lar", out_dir / experiment / "lar_per_layer.png", note)))
        figs.append(("All-to-all dispatch bytes per MoE layer",
                     fig_per_layer(layers, "dispatch_bytes", out_dir / experiment / "bytes_per_layer.png", note)))
    if runs["devices"].nunique() > 1:
        figs.append(("LAR vs EP degree", fig_vs_ep(runs, "lar", out_dir / experiment / "lar_vs_ep.png", note)))
        figs.append(("All-to-all bytes vs EP degree",
                     fig_vs_ep(runs, "a2a_bytes", out_dir / experiment / "bytes_vs_ep.png", note)))
    biggest = runs.sort_values(["devices", "attention"]).iloc[-1]
    if (Path(biggest["run_dir"]) / "traffic.npy").exists():
        figs.append((f"Device x device traffic ({biggest['system']}, D={biggest['devices']}, {biggest['attention']})",
                     fig_traffic_heatmap(Path(biggest["run_dir"]), out_dir / experiment / "traffic_heatmap.png")))
    if (Path(biggest["run_dir"]) / "activation_map.npz").exists():
        figs.append(("Token x expert activation map (evaluation split)",
                     fig_activation_heatmap(Path(biggest["run_dir"]), out_dir / experiment / "activation_heatmap.png")))
    for title, path in figs:
        lines += [f"### {title}", "", f"![{title}]({path.relative_to(out_dir)})", ""]
    lines += routing_sources_section(runs) if experiment.startswith("routing_sources") else []
    lines += exec_section(runs)
    lines += drift_section(runs)
    lines += decode_section(runs)
    lines += affinity_section(Path(runs["run_dir"].iloc[0]))
    lines += ["Config of the jobs (first job shown; swept keys vary):", "", _config_block(runs["run_dir"].iloc[0]), ""]
    return lines


def write_report(runs_dir: str | Path, out_dir: str | Path) -> Path:
    """Render every figure for every experiment found under runs_dir and write out_dir/REPORT.md.

    The report is a list of sections, each a function of the loaded jobs returning markdown lines ([] when its
    jobs are absent); a new section is one more entry below."""
    summary, per_layer, skipped = read_jobs(runs_dir)
    out_dir = Path(out_dir)
    partial = sweep_notes(summary, skipped)
    lines = ["# Report", "", f"Generated by `make figures` from `{runs_dir}/` ({len(summary)} finished jobs).", "",
             *skipped_lines(skipped, runs_dir),
             *[f"- **{experiment}**: {note}." for experiment, note in partial.items()], *([""] if partial else []),
             "Every row says its kind: `system` (deployable, fitted on the profile split), `bound` (a proven ceiling, "
             "with the constraint it holds under; dashed in the figures) or `hindsight` (fitted on the evaluated "
             "routing, not a ceiling; dash-dotted). Each system has one colour in every figure. "
             "Systems are fitted on the profile split (20 % of requests), defaults tuned on the validate split "
             "(10 %), and numbers reported on the evaluate split (70 %) unless the evaluate_split column says otherwise.", ""]
    header = len(lines)  # the verdict goes here, computed last so its links find the sections below
    lines += tuned_section(Path(runs_dir))
    lines += paper_section(summary, out_dir)
    lines += table2_section(summary, out_dir)
    lines += replication_section(summary, out_dir)
    lines += breakeven_section(runs_dir, out_dir, summary)
    lines += trust_section(runs_dir)
    lines += convergence_section(summary)
    lines += gain_split_section(summary)
    lines += sign_section(summary)
    for experiment, runs in summary.groupby("experiment", sort=True):
        layers = per_layer[per_layer["experiment"] == experiment] if len(per_layer) else per_layer
        lines += experiment_section(experiment, runs, layers, out_dir, partial.get(experiment, ""))
    lines[header:header] = verdict_section(summary, runs_dir, out_dir, lines)
    report = out_dir / "REPORT.md"
    atomic_write_text(report, "\n".join(lines))
    return report
