"""repro.sim.breakeven (MoE-layer time ratio Sem-MoE / EP from the simulator's cost model) and its figure."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from repro.errors import ConfigError
from repro.sim import breakeven as be
from repro.sim.costs import level_loads
from repro.sim.traffic import BatchTraffic, batch_traffic, dispatch_slots
from repro.systems.ep import contiguous_placement

SHAPE = be.load_conf("sim/shape", "deepseek_v2_lite")
HARDWARE = {name: be.load_conf("hardware", name) for name in ("h200", "pcie", "h100_2x8_ib")}
CASES = [(hw, b) for hw in HARDWARE for b in be.BACKENDS]


def dep_of(hw: str, backend: str, shape: dict = SHAPE) -> be.Deployment:
    return be.deployment(shape, HARDWARE[hw], backend)


@pytest.mark.parametrize("hw", ["h200", "h100_2x8_ib"])
def test_load_is_the_expectation_of_the_simulators_counts(hw):
    """Uniform random top-k routing counted by traffic.batch_traffic + costs.level_loads: the mean rank's link-level
    load (copies / activations and peers, per level and backend) and its read experts match the expected values
    that busiest_rank_load and expert_seconds price, at a decode size where peers are partly active."""
    tokens, iterations = 2, 400
    dep0 = dep_of(hw, "nccl")
    devices, experts, top_k = dep0.devices, dep0.shape.num_experts, dep0.shape.top_k
    rng = np.random.default_rng(0)
    rows = iterations * devices * tokens
    routed = np.argsort(rng.random((rows, experts)), axis=1)[:, :top_k].reshape(rows, 1, top_k)
    home = np.tile(np.repeat(np.arange(devices), tokens), iterations)[:, None]
    group = np.repeat(np.arange(iterations), devices * tokens)
    placement = contiguous_placement(1, experts, devices)
    traffic = batch_traffic(group, home, routed, dispatch_slots(placement), dep0.slots_per_device, iterations,
                            dep0.hw.devices_per_node)
    for backend in be.BACKENDS:
        dep = dep_of(hw, backend)
        counted = level_loads(traffic, backend, dep.hw.devices_per_node)
        expected = be.busiest_rank_load(dep, np.array([float(tokens)]), np.array([1.0 / devices]))
        for level in ("nvlink", "rdma"):
            if getattr(expected, level) is None:
                assert getattr(counted, level) is None
                continue
            for got, want in zip(getattr(counted, level), getattr(expected, level), strict=True):
                assert got.mean() == pytest.approx(want.item(), rel=0.03), (backend, level)
    read = (traffic.slot_tokens.reshape(iterations, devices, -1) > 0).sum(axis=2).mean()
    active = dep0.slots_per_device * (1 - (1 - top_k / experts) ** (devices * tokens))
    assert read == pytest.approx(active, rel=0.03)


def expected_traffic(dep: be.Deployment, tokens: int, lar: float) -> BatchTraffic:
    """A one-iteration BatchTraffic holding busiest_rank_load's expected counts on every rank (float counts)."""
    shape, hw, devices = dep.shape, dep.hw, dep.devices
    scale = (1 - lar) / (1 - 1 / devices)
    copy_p = scale * (1 - be.miss_probability(shape.num_experts, dep.slots_per_device, shape.top_k))
    off = ~np.eye(devices, dtype=bool)
    copies = np.where(off, tokens * copy_p, 0.0)[None, None]
    activations = np.where(off, tokens * scale * shape.top_k / devices, 0.0)[None, None]
    node_copies = None
    if hw.nodes > 1:
        node_p = scale * (1 - be.miss_probability(shape.num_experts, shape.num_experts // hw.nodes, shape.top_k))
        node_of = np.arange(devices) // hw.devices_per_node
        node_copies = np.where(node_of[:, None] != np.arange(hw.nodes), tokens * node_p, 0.0)[None, None]
    slot_tokens = np.full((1, 1, shape.num_experts), tokens * shape.top_k / dep.slots_per_device)
    return BatchTraffic(activations, copies, node_copies, slot_tokens)


@pytest.mark.parametrize("hw,backend", CASES)
@pytest.mark.parametrize("gain", [0.0, 0.3])
def test_pricing_is_the_simulators_block(hw, backend, gain):
    """At 256 tokens per rank every peer and every expert is active, so busiest_rank_load's counts are exactly the
    expected-count matrices: CostModel.block (the simulator's per-iteration pricing) on those matrices gives the
    same gate, dispatch, experts and combine seconds as layer_seconds."""
    dep, tokens = dep_of(hw, backend), 256
    lar = 1 / dep.devices + gain
    traffic = expected_traffic(dep, tokens, lar)
    d = dep.devices
    seg = {"pairs_prefill": np.zeros((1, d)), "pairs_decode": np.zeros((1, d)), "kv_read": np.zeros((1, d)),
           "tokens": np.full((1, d), float(tokens)), "samples": np.zeros((1, d))}
    block = dep.cost.block(seg, traffic, np.full((1, d), float(tokens)), None, np.array([True]))
    ours = be.layer_seconds(dep, np.array([float(tokens)]), np.array([lar]))
    for index, part in ((1, "gate"), (2, "dispatch"), (3, "experts"), (4, "combine")):
        assert ours[part][0] == pytest.approx(block["moe"][0, 0, index], rel=1e-12), part


@pytest.mark.parametrize("hw,backend", CASES)
def test_ratio_is_one_at_zero_gain_and_falls_with_gain(hw, backend):
    dep = dep_of(hw, backend)
    tokens = np.array(be.DEFAULT_TOKENS, dtype=float)
    assert np.all(be.time_ratio(dep, tokens, 0.0) == 1.0)
    gains = be.gain_grid(dep.devices)
    for f in (1.0, 1.3):
        ratio = be.time_ratio(dep, tokens[:, None], gains[None, :], f).reshape(len(tokens), len(gains))
        assert np.all(np.diff(ratio, axis=1) < 0), f  # strictly: every gain cuts remote bytes
    assert np.all(be.time_ratio(dep, tokens, 0.0, 1.3) > 1.0)  # imbalance alone costs time


@pytest.mark.parametrize("hw,backend", CASES)
def test_break_even_is_where_the_ratio_crosses_one(hw, backend):
    dep = dep_of(hw, backend)
    tokens = np.array(be.DEFAULT_TOKENS, dtype=float)
    top = 1 - 1 / dep.devices
    assert np.all(be.break_even_gain(dep, tokens, 1.0) == 0.0)  # balanced: any gain pays
    for f in (1.1, 1.3):
        gain = be.break_even_gain(dep, tokens, f)
        never = np.isnan(gain)
        assert np.all(be.time_ratio(dep, tokens[never], top, f) > 1.0)
        found, g = tokens[~never], gain[~never]
        assert np.all(g > 0)
        eps = 1e-5
        assert np.all(be.time_ratio(dep, found, g - eps, f) > 1.0)
        assert np.all(be.time_ratio(dep, found, np.minimum(g + eps, top), f) <= 1.0)


def test_a_slow_link_pays_sooner_than_nvlink():
    """Directional: on PCIe the all-to-all dominates more, so at 1,024 tokens per rank Sem-MoE with 30 % imbalance
    breaks even at a smaller LAR gain than on H200 NVLink (DeepEP normal), and full locality saves more."""
    tokens = np.array([1024.0])
    pcie, nvlink = dep_of("pcie", "deepep_normal"), dep_of("h200", "deepep_normal")
    assert be.break_even_gain(pcie, tokens, 1.3)[0] < be.break_even_gain(nvlink, tokens, 1.3)[0]
    assert be.time_ratio(pcie, tokens, 1 - 1 / 8)[0] < be.time_ratio(nvlink, tokens, 1 - 1 / 8)[0]


def test_bad_inputs_are_one_sentence():
    dep = dep_of("h200", "nccl")
    with pytest.raises(ConfigError, match="LAR gain"):
        be.time_ratio(dep, 4, -0.1)
    with pytest.raises(ConfigError, match="LAR must lie"):
        be.time_ratio(dep, 4, 0.95)
    with pytest.raises(ConfigError, match="tokens per rank"):
        be.time_ratio(dep, 0, 0.1)
    with pytest.raises(ConfigError, match="no hardware profile"):
        be.load_conf("hardware", "h900")
    with pytest.raises(ConfigError, match="do not split"):
        be.deployment(dict(SHAPE, num_experts=60, top_k=6), HARDWARE["h100_2x8_ib"], "nccl")
    with pytest.raises(ConfigError, match=">= 1"):
        be.check_arguments([1, 4], [0.9], 0.025)
    with pytest.raises(ConfigError, match="integers"):
        be.check_arguments([0], [1.1], 0.025)


def run_cli(out, *extra) -> None:
    be.main(["--out", str(out), "--models", "deepseek_v2_lite", "--hardware", "h200", "--backends", "nccl",
             "--tokens", "1", "64", "1024", *extra])


def test_cli_writes_its_results_and_refuses_a_foreign_folder(tmp_path, capsys):
    out = tmp_path / "breakeven"
    run_cli(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(be.RESULT_FILES)
    meta = json.loads((out / "breakeven.json").read_text())
    assert meta["generator"] == be.GENERATOR and "SLO" in meta["what"]
    grid, table = pd.read_csv(out / "ratio_grid.csv"), pd.read_csv(out / "breakeven.csv")
    assert len(table) == 3 * 3 and set(table["imbalance_semmoe"]) == {1.0, 1.1, 1.3}
    assert np.allclose(grid.loc[grid["lar_gain"] == 0, "ratio"].where(grid["imbalance_semmoe"] == 1.0).dropna(), 1.0)
    first = (out / "breakeven.csv").read_bytes()
    run_cli(out)  # its own earlier output is replaced, with the same numbers
    assert (out / "breakeven.csv").read_bytes() == first
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit) as exit_info:
        run_cli(foreign)
    assert exit_info.value.code == 2
    assert "was not written by" in capsys.readouterr().err
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    with pytest.raises(SystemExit):
        run_cli(tmp_path / "bad", "--imbalance", "0.5")
    assert not (tmp_path / "bad").exists()


# --- the figure and table (repro/figures/breakeven.py) ---


def write_job(runs, name, system, lar, *, devices=8, attention="dp", model="tiny", experiment="routing_sources",
              kind="system"):
    """A minimal finished job: metrics.json with the summary and config keys that read_jobs uses."""
    job = runs / experiment / name
    job.mkdir(parents=True)
    config = {"name": experiment, "parallel": {"devices": devices, "attention": attention},
              "workload": {"name": "mmlu"}, "model": {"name": model}, "system": {"name": system}}
    summary = {"lar": lar, "system": system, "kind": kind, "model": model, "token_imbalance_max_mean": 1.05,
               "expert_load_imbalance_max_mean": 1.2}
    (job / "metrics.json").write_text(json.dumps({"summary": summary, "config": config}))


def test_routing_sources_pair_semmoe_with_ep_of_the_same_deployment(tmp_path):
    from repro.figures.breakeven import routing_sources
    from repro.figures.jobs import read_jobs

    write_job(tmp_path, "a", "ep", 0.125)
    write_job(tmp_path, "b", "semmoe", 0.45)
    write_job(tmp_path, "c", "semmoe_exact", 0.55)
    write_job(tmp_path, "d", "token_oracle", 0.9, kind="bound")  # a bound is no routing source
    write_job(tmp_path, "e", "semmoe", 0.7, attention="tp")  # no ep in tp: unpaired
    write_job(tmp_path, "f", "ep", 0.0625, devices=16)
    write_job(tmp_path, "g", "semmoe", 0.3, devices=16)
    sources = routing_sources(read_jobs(tmp_path)[0])
    got = {(r.system, r.devices, r.attention): round(r.lar_gain, 6) for r in sources.itertuples()}
    assert got == {("semmoe", 8, "dp"): 0.325, ("semmoe_exact", 8, "dp"): 0.425, ("semmoe", 16, "dp"): 0.2375}
    assert routing_sources(None).empty


def test_section_renders_the_map_with_and_without_sources(tmp_path):
    from repro.figures.breakeven import breakeven_section

    runs, out = tmp_path / "runs", tmp_path / "figures"
    assert breakeven_section(runs, out) == []  # no results: no section
    be.main(["--out", str(runs / "breakeven"), "--models", "deepseek_v2_lite", "--hardware", "h200",
             "--backends", "deepep_normal", "--tokens", "1", "16", "1024", "--gain-step", "0.125"])
    lines = breakeven_section(runs, out)
    text = "\n".join(lines)
    assert (out / "breakeven_deepseek_v2_lite.png").stat().st_size > 10_000
    assert "curves only" in text and "not the throughput under an SLO" in text
    assert "| deepseek_v2_lite | h200 | deepep_normal | 1.3 | never |" in text
    write_job(runs, "a", "ep", 0.125)
    write_job(runs, "b", "semmoe", 0.45)
    text = "\n".join(breakeven_section(runs, out))
    assert "curves only" not in text and "| routing_sources | tiny | dp | 8 | semmoe |" in text


def test_unreadable_results_skip_only_their_section(tmp_path):
    from repro.figures.breakeven import breakeven_section

    results = tmp_path / "runs" / "breakeven"
    results.mkdir(parents=True)
    (results / "breakeven.json").write_text(json.dumps({"generator": be.GENERATOR}))
    (results / "ratio_grid.csv").write_text("model,ratio\nx,1.0\n")
    (results / "breakeven.csv").write_text("model\nx\n")
    lines = breakeven_section(tmp_path / "runs", tmp_path / "figures")
    assert lines[0].startswith("## When does") and "incomplete break-even results" in lines[2]
    assert not (tmp_path / "figures").exists()
