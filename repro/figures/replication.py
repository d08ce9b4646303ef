"""Report section for issue 9 (beyond the paper): replication-aware and topology-aware placement.

Reads the finished jobs of experiment=replication_dp / replication_tp (LAR and all-to-all bytes vs extra expert
memory, per attention mode and routing source, with the issue's targets checked) and experiment=multinode (EP 16 as
2 x 8: inter- and intra-node dispatch bytes and the per-level all-to-all time estimate). Input: the one-row-per-job
DataFrame of repro.figures.jobs.load_runs.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from repro.figures.palette import series_style  # noqa: E402
from repro.figures.render import FRACTIONS, metric_axis, save_png  # noqa: E402

REPLICATION_SYSTEMS = ("semmoe_replicated", "semmoe_hottest", "eplb")
MULTINODE_SYSTEMS = ("ep", "semmoe", "semmoe_hierarchical")
# the targets at EP 4, r = 2: DP LAR >= 1.15 x Sem-MoE at r = 0 and >= 1.1 x EPLB at r = 2; TP >= 1.05 x r = 0
TARGET_R = 2
TARGET_VS_R0 = {"dp": 1.15, "tp": 1.05}
TARGET_VS_EPLB = {"dp": 1.1}
# multi-node: inter-node bytes <= 0.7 x flat Sem-MoE's at equal LAR (+-0.01; checked as LAR >= flat's - 0.01) and
# <= 0.5 x vanilla EP's
TARGET_INTER_VS_FLAT, TARGET_INTER_VS_EP, EQUAL_LAR = 0.7, 0.5, 0.01


def _markdown(df: pd.DataFrame) -> str:
    def cell(v):
        if isinstance(v, float | np.floating):
            return f"{v:.4g}"
        return str(v)

    head = "| " + " | ".join(map(str, df.columns)) + " |"
    rule = "|" + "|".join("---" for _ in df.columns) + "|"
    return "\n".join([head, rule] + ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)])


def replication_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """Jobs of the replication experiments with r (extra slots per device) and extra_memory ((P - E) / E)."""
    sel = runs[runs["experiment"].astype(str).str.startswith("replication") & runs["system"].isin(REPLICATION_SYSTEMS)].copy()
    if sel.empty:
        return sel
    sel["r"] = ((sel["num_slots"] - sel["num_experts"]) / sel["devices"]).astype(int)
    sel["extra_memory"] = (sel["num_slots"] - sel["num_experts"]) / sel["num_experts"]
    return sel.sort_values(["attention", "model_name", "system", "r"])


def fig_vs_memory(sel: pd.DataFrame, metric: str, path: Path) -> Path:
    """`metric` vs extra expert memory: rows = attention mode, columns = routing source, one line per system."""
    modes, models = sorted(sel["attention"].unique()), sorted(sel["model_name"].unique())
    fig, axes = plt.subplots(len(modes), len(models), figsize=(4.2 * len(models), 3.2 * len(modes)), squeeze=False,
                             layout="constrained")
    for row, mode in enumerate(modes):
        for col, model in enumerate(models):
            ax = axes[row][col]
            cell = sel[(sel["attention"] == mode) & (sel["model_name"] == model)]
            label, scale = metric_axis(metric)
            for system, line in cell.groupby("system", sort=True):
                ax.plot(100 * line["extra_memory"], line[metric] * scale, **series_style(system))
            ax.set_title(f"{model}, {mode.upper()}, D={int(cell['devices'].iloc[0]) if len(cell) else '?'}")
            ax.set_xlabel("extra expert memory (% of the experts' weights)")
            ax.set_ylabel(label)
            if metric in FRACTIONS:
                ax.set_ylim(0, 1)
            if row == 0 and col == len(models) - 1:
                ax.legend(fontsize=7)
    return save_png(fig, path)


def replication_targets(sel: pd.DataFrame) -> pd.DataFrame:
    """One row per (attention, routing source): semmoe_replicated's LAR at r = TARGET_R against its r = 0 and
    against EPLB at the same r, the issue's targets, the largest LAR drop as r grows (monotonicity) per system,
    and the share of redundant slots that served nothing."""
    rows = []
    for (mode, model), cell in sel.groupby(["attention", "model_name"], sort=True):
        lar = cell.pivot_table(index="r", columns="system", values="lar")
        if "semmoe_replicated" not in lar or TARGET_R not in lar.index or 0 not in lar.index:
            continue
        ours = lar.loc[TARGET_R, "semmoe_replicated"]
        row = {"attention": mode, "model": model, f"lar r={TARGET_R}": ours, "lar r=0": lar.loc[0, "semmoe_replicated"]}
        row["vs r=0"] = ours / row["lar r=0"]
        row["target vs r=0"] = f">= {TARGET_VS_R0.get(mode, float('nan'))}: {'met' if row['vs r=0'] >= TARGET_VS_R0.get(mode, np.inf) else 'MISSED'}"
        if "eplb" in lar:
            row[f"eplb r={TARGET_R}"] = lar.loc[TARGET_R, "eplb"]
            row["vs eplb"] = ours / lar.loc[TARGET_R, "eplb"]
            if mode in TARGET_VS_EPLB:
                row["target vs eplb"] = f">= {TARGET_VS_EPLB[mode]}: {'met' if row['vs eplb'] >= TARGET_VS_EPLB[mode] else 'MISSED'}"
        if "semmoe_hottest" in lar:
            row[f"hottest r={TARGET_R}"] = lar.loc[TARGET_R, "semmoe_hottest"]
        row["largest LAR drop with r"] = float(max(0.0, -lar.diff().min().min()))
        waste = cell[cell["system"] == "semmoe_replicated"]
        if "replica_slots_unused_share" in waste:
            row["unused replica share (max over r)"] = float(waste["replica_slots_unused_share"].max())
        rows.append(row)
    return pd.DataFrame(rows)


def multinode_table(runs: pd.DataFrame) -> pd.DataFrame:
    """experiment=multinode: LAR, node-local activation rate, inter- / intra-node dispatch bytes, the ratios the
    issue targets and the per-level all-to-all time estimate, one row per (attention, devices, system); plus,
    from experiment=multinode_bound, the Attention-DP ceilings (dp_bound: LAR and node-local rate bounds).

    A missed DP target is marked "unreachable (bound)" when the node-local ceiling already rules it out: then
    inter-node activations >= (1 - node_local_bound) / (1 - vanilla EP's node-local rate) x vanilla EP's > 0.5x.
    """
    jobs = runs[(runs["experiment"] == "multinode") & runs["system"].isin(MULTINODE_SYSTEMS)]
    if jobs.empty:
        return pd.DataFrame()
    bounds = runs[runs["experiment"] == "multinode_bound"].set_index("devices")
    rows = []
    for (mode, devices), cell in jobs.groupby(["attention", "devices"], sort=True):
        by = cell.set_index("system")
        floor = np.nan  # inter-node activations of the best request-level system / vanilla EP's, at least
        bound = None
        if mode == "dp" and devices in bounds.index:
            bound = bounds.loc[devices]
            if "ep" in by.index and "plan_node_local_bound" in bound:
                floor = (1 - bound["plan_node_local_bound"]) / (1 - by.loc["ep", "node_local_activation_rate"])
        for system, r in by.iterrows():
            row = {"attention": mode, "devices": int(devices), "system": system, "lar": r["lar"],
                   "node-local rate": r.get("node_local_activation_rate", np.nan),
                   "inter-node bytes": r["dispatch_bytes_inter_node"],
                   "intra-node bytes": r.get("dispatch_bytes_intra_node", r["dispatch_bytes"] - r["dispatch_bytes_inter_node"]),
                   "a2a seconds (est.)": r.get("a2a_seconds_est", np.nan)}
            for base, name in (("semmoe", "inter vs flat semmoe"), ("ep", "inter vs ep")):
                if base in by.index:
                    row[name] = r["dispatch_bytes_inter_node"] / by.loc[base, "dispatch_bytes_inter_node"]
            if "dispatch_bytes_inter_node_rdma" in by.columns and "ep" in by.index:  # DeepEP: 1 copy per node
                row["RDMA bytes vs ep"] = r["dispatch_bytes_inter_node_rdma"] / by.loc["ep", "dispatch_bytes_inter_node_rdma"]
            if system == "semmoe_hierarchical" and "semmoe" in by.index and "ep" in by.index:
                # "at equal LAR +-0.01": no LAR given up for node locality (a higher LAR only helps both counts)
                kept_lar = r["lar"] >= by.loc["semmoe", "lar"] - EQUAL_LAR
                met = kept_lar and row["inter vs flat semmoe"] <= TARGET_INTER_VS_FLAT and row["inter vs ep"] <= TARGET_INTER_VS_EP
                row["targets"] = "met" if met else "MISSED" + (" (unreachable: bound)" if floor > TARGET_INTER_VS_EP else "")
            rows.append(row)
        if bound is not None:
            rows.append({"attention": mode, "devices": int(devices), "system": "dp_bound (ceiling)", "lar": bound["lar"],
                         "node-local rate": bound.get("plan_node_local_bound", np.nan),
                         "inter vs ep": f">= {floor:.3g} (activations)" if np.isfinite(floor) else np.nan})
    return pd.DataFrame(rows)


def replication_section(runs: pd.DataFrame, out_dir: str | Path = "figures") -> list[str]:
    """Markdown lines (with PNG curves written under out_dir/replication/, linked relative to out_dir) for the
    replication and multi-node experiments found in `runs`; [] when neither ran."""
    out_dir = Path(out_dir)
    lines: list[str] = []
    sel = replication_runs(runs)
    if len(sel):
        lar_png = fig_vs_memory(sel, "lar", out_dir / "replication" / "lar_vs_memory.png")
        bytes_png = fig_vs_memory(sel, "a2a_bytes", out_dir / "replication" / "a2a_bytes_vs_memory.png")
        targets = replication_targets(sel)
        lines += [
            "## Replication-aware placement (beyond the paper)", "",
            "Each device gets r extra expert slots (P = E + r x D, the engines' redundant slots; extra memory = "
            "r x D / E). semmoe_replicated fills them by co-clustering (the experts whose copy turns the most remote "
            "activation mass of the device's requests / tokens local), semmoe_hottest with the hottest experts the "
            "device lacks (same Sem-MoE placement and schedulers), eplb by load (DeepSeek EPLB). A remote token uses "
            "the replica on its own device, else its node, else the least loaded one (Placement.dispatch_device). "
            "r = 0 is Sem-MoE / EPLB without replication.", "",
            f"![LAR vs extra expert memory]({lar_png.relative_to(out_dir)})", "",
            f"![All-to-all bytes vs extra expert memory]({bytes_png.relative_to(out_dir)})", "",
        ]
        if len(targets):
            lines += [f"Targets of issue 9 at r = {TARGET_R} (evaluate split; '-': no target for that mode):", "",
                      _markdown(targets.fillna("-")), ""]
        table = sel[["attention", "model_name", "system", "r", "extra_memory", "lar", "a2a_bytes",
                     "expert_load_imbalance_max_mean", "replica_slots_unused_share"]]
        lines += ["All jobs:", "", _markdown(table), ""]
    nodes = multinode_table(runs)
    if len(nodes):
        lines += [
            "## Topology-aware placement on several nodes (beyond the paper)", "",
            "EP 16 as 2 nodes x 8 devices and EP 32 as 4 x 8. semmoe_hierarchical co-clusters by node first, then by "
            "device inside each node; flat semmoe numbers its clusters regardless of nodes. Targets: inter-node bytes "
            f"<= {TARGET_INTER_VS_FLAT} x flat Sem-MoE's at equal LAR (+-{EQUAL_LAR}; checked as LAR >= flat's - "
            f"{EQUAL_LAR}: no LAR given up) and <= {TARGET_INTER_VS_EP} x vanilla EP's. semmoe_hierarchical also aligns "
            "Attention-TP tokens by node first (an overflowing token moves to another device of its node before it "
            "crosses nodes). node-local rate: activations served on the token's own node. dp_bound (ceiling): no "
            "Attention-DP system that keeps whole requests on one rank (<= ceil(R/D) per rank, E/D experts per device) "
            "beats its LAR or node-local rate (LP relaxation, experiment=multinode_bound); its 'inter vs ep' is the "
            "floor that ceiling puts on inter-node activations relative to vanilla EP's. a2a seconds: NVLink for "
            "intra-node, the NIC for inter-node bytes, slowest device per layer (hardware profile's NCCL bandwidths; "
            "an estimate, not a measurement). RDMA bytes: one copy per token and remote node, as DeepEP's internode "
            "kernels send it before forwarding it over NVLink (the other byte columns count one copy per device).", "",
            _markdown(nodes.fillna("-")), "",
        ]
    return lines
