"""The paper's figures and tables (repro.figures.paper) on fabricated runs/ dirs, the one-SLO-for-all rule on a
hand-made per-rate table, and the per-request activation artifact (repro.affinity.requests) on a hand-made trace."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import scipy.stats

from repro.affinity.requests import request_activations, spikes_kurtosis
from repro.errors import ConfigError
from repro.figures import paper
from repro.figures.jobs import load_runs
from repro.figures.report import write_report
from repro.traces import TraceMeta, make_trace

# ---- repro.affinity.requests ---------------------------------------------------------------------------------


def hand_trace():
    """3 requests, 3 MoE layers, E=4, k=2. Request 1's last token is generated (prefill 2 of 3)."""
    experts = np.array([
        # request 0 (label "a"): tokens 7, 8
        [[0, 1], [0, 2], [3, 1]],
        [[0, 2], [1, 2], [3, 2]],
        # request 1 (label "b"): tokens 7, 9 prompt, token 8 generated
        [[2, 3], [0, 3], [1, 0]],
        [[3, 0], [2, 3], [0, 2]],
        [[1, 2], [1, 2], [1, 2]],
        # request 2 (label "a"): token 7
        [[0, 1], [0, 2], [3, 1]],
    ])
    meta = TraceMeta(model="hand", num_experts=4, top_k=2, layer_ids=(1, 2, 3), vocab_size=16, dataset="d")
    return make_trace(meta, [0, 2, 5, 6], [7, 8, 7, 9, 8, 7], experts, prefill_len=[2, 2, 1],
                      request_labels=["a", "b", "a"])


def test_request_activations_by_hand():
    out = request_activations(hand_trace(), min_occurrences=1)
    assert out["layer_index"].tolist() == [0, 1, 2]
    assert out["layer_ids"].tolist() == [1, 2, 3]
    assert out["labels"].tolist() == ["a", "b", "a"]
    acts = out["activations"]
    assert acts.shape == (3, 3, 4) and acts.dtype == np.float32
    # request 0, layer 0: experts 0,1,0,2 -> [2,1,1,0]/4; request 1 (generated token left out): 2,3,3,0 -> [1,0,1,2]/4
    np.testing.assert_allclose(acts[0, 0], [0.5, 0.25, 0.25, 0.0])
    np.testing.assert_allclose(acts[1, 0], [0.25, 0.0, 0.25, 0.5])
    np.testing.assert_allclose(acts[1, 2], [0.5, 0.25, 0.25, 0.0])  # layer 2: 1,0,0,2
    np.testing.assert_allclose(acts[2, 1], [0.5, 0.0, 0.5, 0.0])
    # pairs (0,1) and (1,2) over the 5 prompt tokens: 5 x 2 x 2 = 20 triples each
    assert out["pair_layers"].tolist() == [0, 1]
    assert out["pair_layer_ids"].tolist() == [[1, 2], [2, 3]]
    co = out["coactivation"]
    assert co.shape == (2, 4, 4)
    np.testing.assert_allclose(co.sum(axis=(1, 2)), 1.0, rtol=1e-6)
    # (expert 0 at layer 0, expert 0 at layer 1): tokens 0 and 5 ({0,1}->{0,2}), token 3 ({3,0}->{2,3}: no),
    # token 1 ({0,2}->{1,2}: no), token 2 ({2,3}->{0,3}: no) -> 2 of 20
    assert co[0, 0, 0] == pytest.approx(2 / 20)
    # (expert 3 at layer 0, expert 3 at layer 1): token 2 ({2,3}->{0,3}) and token 3 ({3,0}->{2,3}) -> 2 of 20
    assert co[0, 3, 3] == pytest.approx(2 / 20)
    # kurtosis of layer 0 for token ids 7 (experts 0,1,2,3,0,1 -> [2,2,1,1]), 8 ([1,0,1,0]), 9 ([1,0,0,1])
    expected = scipy.stats.kurtosis(np.array([[2, 2, 1, 1], [1, 0, 1, 0], [1, 0, 0, 1]]) / [[6], [2], [2]],
                                    axis=1, fisher=False)
    np.testing.assert_allclose(out["token_kurtosis"], expected, rtol=1e-5)
    assert float(out["kurtosis_spikes"]) == pytest.approx(1.0)  # 2 equal spikes among 4: p = 1/2


def test_request_activations_caps_and_rare_tokens():
    out = request_activations(hand_trace(), layers=[1], max_requests=2, max_pairs=1, min_occurrences=2)
    assert out["activations"].shape == (2, 1, 4)
    assert out["request_index"].tolist() == [0, 1] and out["labels"].tolist() == ["a", "b"]
    assert out["pair_layers"].tolist() == [0]
    # layer 1's prompt tokens: only id 7 is seen twice (3 times) -> one kurtosis value
    assert out["token_kurtosis"].shape == (1,)
    assert int(out["kurtosis_layer"]) == 1


def test_spikes_kurtosis_matches_the_paper_regime():
    assert spikes_kurtosis(64, 6) == pytest.approx(8.7701, rel=1e-4)
    row = np.zeros(64)
    row[:6] = 1 / 6
    assert spikes_kurtosis(64, 6) == pytest.approx(scipy.stats.kurtosis(row, fisher=False))


def test_request_activations_bad_input():
    with pytest.raises(ConfigError, match="outside"):
        request_activations(hand_trace(), layers=[3])
    with pytest.raises(ConfigError, match=">= 1"):
        request_activations(hand_trace(), max_requests=0)


# ---- repro.figures.paper -------------------------------------------------------------------------------------

SHAPE = "deepseek_v2_lite"


def per_rate_table(rates, ttft, e2e, throughput, lar, dispatch_us=20.0, experts_us=40.0) -> pd.DataFrame:
    """A sim_per_rate table with the simulator's columns; every latency statistic of a kind gets one value x (1, 1, 1.2, 1.5)."""
    n = len(rates)
    table = {"rate": rates, "num_requests": [100] * n, "makespan_s": [100 / t for t in throughput],
             "throughput_rps": throughput, "output_tok_s": [128 * t for t in throughput],
             "total_tok_s": [(128 + 100) * t for t in throughput]}
    for name, values in (("ttft", ttft), ("tpot", [0.01] * n), ("e2e", e2e)):
        for stat, factor in (("mean", 1.0), ("p50", 1.0), ("p90", 1.2), ("p99", 1.5)):
            table[f"{name}_{stat}_s"] = [v * factor for v in values]
    table.update(moe_attention_s=[1e-5] * n, moe_gate_s=[3e-6] * n, moe_dispatch_s=[dispatch_us * 1e-6] * n,
                 moe_experts_s=[experts_us * 1e-6] * n, moe_combine_s=[dispatch_us * 1e-6] * n, moe_tp_collectives_s=[0.0] * n)
    layer = 3 + 2 * dispatch_us + experts_us
    table["a2a_share"] = [2 * dispatch_us / layer] * n
    table["lar"] = [lar] * n
    table["remote_token_copies"] = [round(1000 * (1 - lar))] * n
    return pd.DataFrame(table)


def fake_job(root: Path, experiment: str, system: str, attention: str = "dp", devices: int = 8, per_rate=None,
             model: dict | None = None, **summary) -> Path:
    """One finished job dir in repro.run's schema (metrics.json last), optionally with a serving sweep."""
    out = root / experiment / f"devices={devices},attention={attention},system={system}"
    out.mkdir(parents=True)
    model = model or {"name": "synthetic_deepseek_v2_lite", "kind": "synthetic", "domain_key": "label"}
    config = {"name": experiment, "model": model, "workload": {"name": "mmlu"}, "eval_workload": None,
              "system": {"name": system, "params": {}}, "parallel": {"devices": devices, "attention": attention},
              "seed": 0, "profile_fraction": 0.2}
    row = {"system": system, "kind": "system", "lar": 0.125, "a2a_bytes": 2.0**30, "top_k": 2,
           "expert_load_imbalance_max_mean": 1.2, "expert_load_imbalance_max_median": 1.3,
           "token_imbalance_max_mean": 1.1, "evaluate_split": "evaluate"}
    if per_rate is not None:
        config["sim"] = {"slo": {"statistic": "mean", "multiplier": 5}}
        row.update(sim_shape=SHAPE, sim_hardware="h200", sim_backend="deepep_auto", sim_num_requests=100,
                   sim_output_len_source="fixed:128", sim_decode_routing="prompt_resample",
                   sim_time_basis="uncalibrated (roofline)", sim_routing_map="trace routing matches shape",
                   throughput_under_ttft_slo_rps=1.0, throughput_under_e2e_slo_rps=1.0, goodput_distserve_rps=1.5)
        per_rate.to_csv(out / "sim_per_rate.csv", index=False)
    row.update(summary)
    np.save(out / "traffic.npy", np.ones((2, devices, devices)))
    pd.DataFrame({"layer_id": [1, 2], "lar": [row["lar"]] * 2, "dispatch_bytes": [1.0, 2.0]}).to_csv(
        out / "per_layer.csv", index=False)
    (out / "metrics.json").write_text(json.dumps({"summary": row, "config": config}))
    return out


def activation_files(out: Path) -> None:
    """request_activations.npz from the real function on a 40-request trace with two classes, and an activation map."""
    rng = np.random.default_rng(0)
    lengths = np.full(40, 6)
    labels = ["abstract_algebra"] * 20 + ["philosophy"] * 20
    # class a routes to experts {0, 1}, class b to {2, 3}, with one random slot so requests differ
    base = np.where(np.repeat(np.arange(40) < 20, 6)[:, None, None], [[0, 1]], [[2, 3]])
    experts = np.broadcast_to(base, (240, 3, 2)).copy()
    experts[:, :, 1] = np.where(rng.random((240, 3)) < 0.5, experts[:, :, 1], 4 + rng.integers(0, 4, (240, 3)))
    meta = TraceMeta(model="hand", num_experts=8, top_k=2, layer_ids=(1, 2, 3), vocab_size=32)
    trace = make_trace(meta, np.concatenate([[0], np.cumsum(lengths)]), rng.integers(0, 32, 240), experts,
                       request_labels=labels)
    np.savez(out / "request_activations.npz", **request_activations(trace))
    np.savez(out / "activation_map.npz", token_ids=np.arange(4), counts=rng.integers(0, 5, (3, 4, 8)),
             layer_ids=np.array([1, 2, 3]))


@pytest.fixture
def runs(tmp_path) -> Path:
    root = tmp_path / "runs"
    rates = [10.0, 20.0, 40.0]
    ep = per_rate_table(rates, [0.010, 0.030, 0.060], [1.0, 3.0, 6.0], [10.0, 19.0, 30.0], 0.125)
    sem = per_rate_table(rates, [0.008, 0.020, 0.045], [0.9, 2.0, 4.0], [10.0, 19.5, 38.0], 0.25, dispatch_us=15.0)
    moe = per_rate_table(rates, [0.010, 0.040, 0.080], [1.0, 3.5, 7.0], [10.0, 18.0, 29.0], 0.13)
    for system, table in (("ep", ep), ("moetuner", moe), ("semmoe", sem)):
        job = fake_job(root, "serve_dp", system, per_rate=table, lar=float(table["lar"].iloc[0]))
    activation_files(job)
    for system, table in (("ep", ep), ("semmoe", sem)):
        fake_job(root, "serve_tp", system, attention="tp", per_rate=table)
    tiny = {"name": "tiny_mixtral", "kind": "tiny"}
    for devices in (2, 4):
        for system, lar in (("ep", 0.25), ("moetuner", 0.26), ("semmoe", 0.3)):
            fake_job(root, "paper_dp", system, devices=devices, model=tiny, lar=lar if devices == 4 else 0.5)
    for system, lar, seconds in (("ep", 0.25, 0.2), ("semmoe", 0.4, 0.15)):
        fake_job(root, "exec", system, devices=4, model=tiny, lar=lar, exec_dispatch_seconds=seconds,
                 exec_combine_seconds=seconds)
    return root


def test_one_slo_for_all_systems_by_hand():
    # ep sets the SLO: 5 x 0.01 s = 0.05 s TTFT; 5 x 1 s = 5 s E2E
    ep = per_rate_table([1.0, 2.0, 3.0], [0.010, 0.030, 0.060], [1.0, 4.0, 6.0], [1.0, 1.9, 2.5], 0.1)
    # semmoe's own lightest TTFT (5 ms) would give it a 25 ms SLO and 1.0 req/s; under ep's SLO it reaches 2.0
    sem = per_rate_table([1.0, 2.0, 3.0], [0.005, 0.030, 0.049], [0.5, 2.0, 4.9], [1.0, 2.0, 2.9], 0.2)
    one = paper.one_slo_throughput({"ep": ep, "semmoe": sem}, "mean", 5)
    assert one.loc["ep", "ttft_slo_s"] == pytest.approx(0.05) and one.loc["semmoe", "ttft_slo_s"] == pytest.approx(0.05)
    assert one.loc["ep", "throughput_under_ttft_slo_rps"] == pytest.approx(1.9)
    assert one.loc["semmoe", "throughput_under_ttft_slo_rps"] == pytest.approx(2.9)
    assert bool(one.loc["semmoe", "all_rates_meet_ttft"]) and not bool(one.loc["ep", "all_rates_meet_ttft"])
    assert one.loc["ep", "throughput_under_e2e_slo_rps"] == pytest.approx(1.9)
    assert one.loc["semmoe", "throughput_under_e2e_slo_rps"] == pytest.approx(2.9)
    # p99 statistic: ep's lightest p99 TTFT is 15 ms -> SLO 75 ms; semmoe's p99 at 3 req/s is 73.5 ms
    p99 = paper.one_slo_throughput({"ep": ep, "semmoe": sem}, "p99", 5)
    assert p99.loc["ep", "ttft_slo_s"] == pytest.approx(0.075)
    assert p99.loc["semmoe", "throughput_under_ttft_slo_rps"] == pytest.approx(2.9)


def test_pca_and_class_share_by_hand():
    x = np.array([[0.0, 0.0, 1.0], [2.0, 0.0, 1.0], [4.0, 0.0, 1.0], [6.0, 0.0, 1.0]])
    xy = paper.pca_2d(x)
    np.testing.assert_allclose(np.abs(xy[:, 0]), [3, 1, 1, 3])
    np.testing.assert_allclose(xy[:, 1], 0, atol=1e-12)
    # classes {0, 2} and {4, 6}: between = 4 x 2^2 = 16 of total 20
    assert paper.class_variance_share(x, np.array(["a", "a", "b", "b"])) == pytest.approx(0.8)


def test_successor_mass_by_hand():
    joint = np.array([[0.3, 0.1], [0.1, 0.5]])  # expert 0 mostly -> 0, expert 1 mostly -> 1
    conditional, marginal = paper.successor_mass(joint, 1)
    assert conditional == pytest.approx(0.3 + 0.5)  # each row's top successor
    assert marginal == pytest.approx(0.6)  # the next layer's most popular expert alone (column sums 0.4, 0.6)


def test_every_figure_renders_its_png_and_lines(runs, tmp_path):
    summary, _ = load_runs(runs)
    out = tmp_path / "figs"
    expected = {
        paper.fig1_breakdown: ("fig1_moe_breakdown.png", ["59.2 %", "uncalibrated", "**synthetic router**"]),
        paper.fig4_latency_throughput: ("fig4_serve_dp_deepseek_v2_lite_synthetic_deepseek_v2_lite_mmlu_dp8.png",
                                        ["SLO", "uncalibrated"]),
        paper.tables5_6_throughput_under_slo: (None, ["1.31x / 3.21x", "DistServe goodput (own SLO)"]),
        paper.table2_tp_latency: (None, ["84.87", "mean 100 tokens", "uncalibrated"]),
        paper.fig5a_lar_vs_moe_latency: ("fig5a_lar_vs_moe_latency.png", ["41.8 %"]),
        paper.fig5b_lar_imbalance: ("fig5b_lar_imbalance.png", ["+15.4 %", "**small model**"]),
        paper.fig6a_request_pca: ("fig6a_request_pca.png", ["class share of variance"]),
        paper.fig6b_heatmap_kurtosis: ("fig6b_heatmap_kurtosis.png", ["kurtosis > 8"]),
        paper.fig6c_interlayer: ("fig6c_interlayer.png", ["lift"]),
        paper.fig6d_a2a_vs_local: ("fig6d_a2a_vs_local.png", ["gloo", "| 0.857 | 0.857 | 0.750 |"]),
    }
    assert set(expected) == set(paper.FIGURES)
    for figure, (png, phrases) in expected.items():
        text = "\n".join(figure(summary, out))
        for phrase in phrases:
            assert phrase in text, (figure.__name__, phrase)
        if png:
            assert (out / "paper" / png).stat().st_size > 1000, figure.__name__


def test_tables_use_one_slo_and_the_numbers_it_gives(runs, tmp_path):
    summary, _ = load_runs(runs)
    text = "\n".join(paper.tables5_6_throughput_under_slo(summary, tmp_path))
    # ep's SLO: TTFT 5 x 10 ms = 50 ms; ep meets it up to 20 req/s (19.0 req/s), moetuner too (18.0 req/s; 80 ms at
    # 40 req/s misses), semmoe at every rate (38.0 req/s, the sweep's ceiling)
    assert "| ep | 19.0 | 1.00x |" in text
    assert "| moetuner | 18.0 | 0.95x |" in text
    assert "| semmoe | 38.0 (all) | 2.00x |" in text
    assert "TTFT 2.00x" in text  # Sem-MoE / vanilla
    fig1 = "\n".join(paper.fig1_breakdown(summary, tmp_path))
    assert "48.2 % @ 10" in fig1  # (20 + 20) / (3 + 20 + 40 + 20) us
    headline = "\n".join(paper.headline(summary))
    assert "paper: 59.2 %" in headline and "TTFT 2.00x" in headline and "(paper: 1.31x / 3.21x)" in headline


def test_sections_are_skipped_without_their_jobs(tmp_path):
    root = tmp_path / "runs"
    fake_job(root, "paper_dp", "ep", model={"name": "tiny_mixtral", "kind": "tiny"})
    summary, _ = load_runs(root)
    for figure in paper.FIGURES:
        assert figure(summary, tmp_path / "figs") == [], figure.__name__
    assert paper.paper_section(summary, tmp_path / "figs") == []


def test_write_report_includes_the_paper_section(runs, tmp_path):
    report = write_report(runs, tmp_path / "figs").read_text()
    assert "## The paper's figures and tables, regenerated" in report
    assert "### Headline" in report and "### Fig. 6d" in report
    for image in (tmp_path / "figs" / "paper").glob("*.png"):
        assert f"paper/{image.name}" in report


def test_the_paper_figures_judge_algorithm_2_in_attention_dp():
    """Where a DP experiment ran semmoe_paper, the paper figures call it semmoe and the time-aware default
    semmoe_load; TP rows and experiments without semmoe_paper are unchanged."""
    import pandas as pd

    from repro.figures.paper import as_the_papers_system

    summary = pd.DataFrame({
        "experiment": ["a", "a", "a", "b", "c"], "attention": ["dp", "dp", "dp", "dp", "tp"],
        "system": ["ep", "semmoe", "semmoe_paper", "semmoe", "semmoe"]})
    renamed = as_the_papers_system(summary)
    assert renamed["system"].tolist() == ["ep", "semmoe_load", "semmoe", "semmoe", "semmoe"]
    assert summary["system"].tolist()[1:3] == ["semmoe", "semmoe_paper"]  # the input is left alone


def test_steady_state_tables_use_each_jobs_bisected_seeds_and_paired_intervals(tmp_path):
    root = tmp_path / "runs"
    rates = [10.0, 20.0, 40.0]
    grid = per_rate_table(rates, [0.010, 0.030, 0.060], [1.0, 3.0, 6.0], [10.0, 19.0, 30.0], 0.125)
    seeds = {"ep": ([20.0, 22.0, 21.0], [30.0, 30.0, 30.0]), "semmoe": ([24.0, 26.4, 25.2], [33.0, 31.5, 30.0])}
    for system, (ttft, e2e) in seeds.items():
        # the labels simulate() writes: ep serves as its own reference
        fake_job(root, "serve_dp", system, per_rate=grid, slo_reference="ep (this plan)" if system == "ep" else "ep",
                 sim_seeds=3, slo_ttft_s=0.05,
                 slo_e2e_s=5.0, throughput_under_ttft_slo_rps=float(np.mean(ttft)),
                 throughput_under_ttft_slo_rps_per_seed=ttft, throughput_under_e2e_slo_rps=float(np.mean(e2e)),
                 throughput_under_e2e_slo_rps_per_seed=e2e, goodput_distserve_rps=10.0,
                 goodput_distserve_rps_per_seed=[10.0, 10.0, 10.0], converged_ttft=True, converged_e2e=True,
                 converged_distserve=system == "ep")
    summary, _ = load_runs(root)
    text = "\n".join(paper.tables5_6_throughput_under_slo(summary, tmp_path))
    assert "| semmoe | 25 | 1.20x [1.20, 1.20] | 32 | 1.05x [" in text and "| 10 (unconverged) |" in text
    assert "— read off the rate grid" not in text and "bisected on 3 paired seeds" in text
    # Sem-MoE's TTFT ratio is 1.20 on every seed: a zero-width interval; E2E ratios 1.10, 1.05, 1.00 -> 1.05x
    assert "| semmoe | 25 | 1.20x [1.20, 1.20] | 32 | 1.05x [" in text
    assert "vs `ep`: TTFT 1.20x, E2E 1.05x" in text
    headline = "\n".join(paper.headline(summary))
    assert "TTFT 1.20x [1.20, 1.20], E2E 1.05x [" in headline


def test_fig1_splits_prefill_and_decode_and_says_where_semmoe_is_faster_or_slower(tmp_path):
    root = tmp_path / "runs"
    grid = per_rate_table([10.0, 40.0], [0.01, 0.02], [1.0, 2.0], [10.0, 39.0], 0.125)
    for part in ("attention", "gate", "dispatch", "experts", "combine", "tp_collectives"):
        grid[f"moe_{part}_prefill_s"], grid[f"moe_{part}_decode_s"] = grid[f"moe_{part}_s"] * 2, grid[f"moe_{part}_s"]
    grid["a2a_share_prefill"], grid["a2a_share_decode"] = 0.40, 0.30
    phases = {"ep": (100e-6, 50e-6), "semmoe": (80e-6, 60e-6)}  # Sem-MoE: prefill 0.80x, decode 1.20x
    for system, (prefill, decode) in phases.items():
        fake_job(root, "serve_dp", system, per_rate=grid, moe_layer_prefill_s_lightest=prefill,
                 moe_layer_decode_s_lightest=decode, moe_layer_prefill_s_heaviest_stable=prefill,
                 moe_layer_decode_s_heaviest_stable=None)
    summary, _ = load_runs(root)
    text = "\n".join(paper.fig1_breakdown(summary, tmp_path))
    assert "| 40.0 % | 30.0 % |" in text  # the two phases' all-to-all shares at the lightest rate
    semmoe = next(line for line in text.splitlines() if "| semmoe |" in line)
    assert semmoe.endswith("| 0.80x (faster) | 0.80x (faster) | 1.20x (slower) | n/a |")
