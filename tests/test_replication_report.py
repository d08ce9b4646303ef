"""repro.figures.replication: the report section from a hand-made runs table (targets met / missed, PNGs)."""

import pandas as pd

from repro.figures.replication import replication_section


def runs_table() -> pd.DataFrame:
    rows = []
    lar = {"semmoe_replicated": [0.30, 0.36], "semmoe_hottest": [0.30, 0.33], "eplb": [0.25, 0.30]}
    for system, values in lar.items():
        for r, value in zip((0, 2), values, strict=True):
            rows.append({"experiment": "replication_dp", "system": system, "attention": "dp", "model_name": "m",
                         "devices": 4, "num_experts": 16, "num_slots": 16 + 4 * r, "lar": value, "a2a_bytes": 1e9 * (1 - value),
                         "expert_load_imbalance_max_mean": 1.1, "replica_slots_unused_share": 0.0})
    for mode in ("tp", "dp"):
        for system, lar_, inter in (("ep", 0.06, 100.0), ("semmoe", 0.10, 90.0), ("semmoe_hierarchical", 0.105, 45.0)):
            rows.append({"experiment": "multinode", "system": system, "attention": mode, "model_name": "m", "devices": 16,
                         "num_experts": 64, "num_slots": 64, "lar": lar_, "dispatch_bytes": 200.0,
                         "node_local_activation_rate": 0.5 if system == "ep" else 0.7,
                         "dispatch_bytes_inter_node": inter if mode == "tp" else 2 * inter,
                         "dispatch_bytes_intra_node": 200.0 - inter, "a2a_seconds_est": 1.0})
    # the DP ceiling: at most 0.7 of activations on their node -> inter-node >= 0.3 / 0.5 = 0.6 x vanilla EP's
    rows.append({"experiment": "multinode_bound", "system": "dp_bound", "attention": "dp", "model_name": "m",
                 "devices": 16, "num_experts": 64, "num_slots": 64, "lar": 0.2, "plan_node_local_bound": 0.7})
    return pd.DataFrame(rows)


def test_section_checks_the_targets_and_writes_the_curves(tmp_path):
    text = "\n".join(replication_section(runs_table(), tmp_path))
    # DP r=2: 0.36 / 0.30 = 1.2 >= 1.15 (met); 0.36 / 0.30 (eplb) = 1.2 >= 1.1 (met)
    assert "| dp | m | 0.36 | 0.3 | 1.2 | >= 1.15: met | 0.3 | 1.2 | >= 1.1: met | 0.33 |" in text
    # hierarchical: 45 / 90 = 0.5 <= 0.7 and 45 / 100 <= 0.5 at LAR within 0.01 of flat
    assert "| tp | 16 | semmoe_hierarchical | 0.105 | 0.7 | 45 | 155 | 1 | 0.5 | 0.45 | met |" in text
    # DP: 90 / 180 = 0.5 <= 0.7 vs flat and 90 / 200 = 0.45 <= 0.5 vs ep: met; the ceiling row comes after
    assert "| dp | 16 | semmoe_hierarchical | 0.105 | 0.7 | 90 | 155 | 1 | 0.5 | 0.45 | met |" in text
    assert "| dp | 16 | dp_bound (ceiling) | 0.2 | 0.7 | - | - | - | - | >= 0.6 (activations) | - |" in text
    for png in ("lar_vs_memory.png", "a2a_bytes_vs_memory.png"):
        assert (tmp_path / "replication" / png).stat().st_size > 1000 and f"replication/{png}" in text
    missed = runs_table()
    missed.loc[(missed["system"] == "semmoe_hierarchical"), "lar"] = 0.05  # LAR given up: 0.05 < flat's 0.10 - 0.01
    text = "\n".join(replication_section(missed, tmp_path))
    assert "| tp | 16 | semmoe_hierarchical | 0.05 |" in text and "| MISSED |" in text
    # the DP ceiling's floor 0.6 > 0.5 says the vanilla-EP target was out of reach for any request-level system
    assert "| MISSED (unreachable: bound) |" in text
    assert replication_section(pd.DataFrame({"experiment": ["x"], "system": ["ep"]}), tmp_path) == []


def test_multinode_table_reports_rdma_bytes_against_vanilla_ep():
    from repro.figures.replication import multinode_table

    runs = runs_table()
    runs["dispatch_bytes_inter_node_rdma"] = runs["system"].map({"ep": 80.0, "semmoe": 60.0, "semmoe_hierarchical": 20.0})
    table = multinode_table(runs).set_index(["attention", "system"])
    assert table.loc[("tp", "semmoe_hierarchical"), "RDMA bytes vs ep"] == 0.25
    assert table.loc[("dp", "semmoe"), "RDMA bytes vs ep"] == 0.75
