"""repro.sim.trust / repro.figures.trust: the error bands, the re-priced break-even map and the report section."""

import json

import numpy as np
import pytest

from repro.figures.trust import trust_section
from repro.sim import breakeven, trust
from repro.sim.costs import phase_seconds
from repro.sim.validation import uniform_load

SMALL = {"models": ("deepseek_v2_lite",), "hardware": ("h200",), "backends": ("nccl",), "tokens": (16, 1024),
         "imbalance": (1.3,)}


def test_scaled_hardware_scales_all_to_all_and_compute_exactly():
    dep = breakeven.deployment(breakeven.load_conf("sim/shape", "deepseek_v2_lite"),
                               breakeven.load_conf("hardware", "h200"), "nccl")
    scaled = trust.scaled_deployment(dep, 1.5, 0.5)
    load = uniform_load(4 * 2**20, 8)
    base = phase_seconds(load, dep.hw.backends["nccl"].dispatch, 1)
    assert phase_seconds(load, scaled.hw.backends["nccl"].dispatch, 1) == pytest.approx(1.5 * base)
    tokens = np.array([1.0, 64.0, 4096.0])
    assert breakeven.expert_seconds(scaled, tokens) == pytest.approx(0.5 * breakeven.expert_seconds(dep, tokens))
    parts, parts_scaled = breakeven.layer_seconds(dep, tokens, np.full(3, 0.5)), \
        breakeven.layer_seconds(scaled, tokens, np.full(3, 0.5))
    assert parts_scaled["combine"] == pytest.approx(1.5 * parts["combine"])
    assert parts_scaled["gate"] == pytest.approx(0.5 * parts["gate"])


def test_zero_band_moves_nothing_and_a_band_moves_gains_the_expected_way():
    cells = trust.breakeven_under_bands({"zero": {"comm": 0.0, "compute": 0.0}, "wide": {"comm": 0.5, "compute": 0.5}},
                                        **SMALL)
    assert len(cells) == 2 * 2  # tokens x (balanced, Sem-MoE at 1.3)
    for c in cells:
        zero, wide = c["bands"]["zero"], c["bands"]["wide"]
        assert zero["comm_up"] == c["break_even_gain"] == zero["comm_down"] and not zero["flips"]
        nominal = c["break_even_gain"]
        if nominal is not None and wide["comm_up"] is not None:
            assert wide["comm_up"] <= nominal + 1e-3  # dearer all-to-all: Sem-MoE pays sooner
        if nominal is not None and wide["comm_down"] is not None:
            assert wide["comm_down"] >= nominal - 1e-3
    summary = trust.band_summary(cells, "zero")
    assert summary == {"cells": 4, "flips": 0, "max_gain_move": 0.0, "median_gain_move": 0.0}


def test_exec_errors_reads_a_bench_result_and_tolerates_its_absence(tmp_path):
    assert trust.exec_errors(tmp_path / "missing.json") is None
    stats = {"median_abs_error": 0.1, "max_abs_error": 0.3, "median_signed_error": -0.1, "cells": 4}
    summary = {p: {"all": stats} for p in ("gating", "dispatch", "experts", "combine", "dispatch_sim")}
    summary["order"] = {"comparisons": 2, "resolved": 1, "agree": 1}
    path = tmp_path / "cost_model.json"
    path.write_text(json.dumps({"results": {"summary": summary, "load_before_after": [[1, 1, 1], [1, 1, 1]]}}))
    errors = trust.exec_errors(path)
    assert errors["experts"]["max_abs_error"] == 0.3 and errors["order"]["agree"] == 1
    band = trust.bands(errors, {"worst_comm_out_of_sample": 0.2})
    assert band["gloo executor (worst)"] == {"comm": 0.3, "compute": 0.3, "from": band["gloo executor (worst)"]["from"]}


def test_report_section_renders_the_file_and_says_how_to_make_it(tmp_path, monkeypatch):
    assert "python -m repro.sim.trust" in "\n".join(trust_section(tmp_path))
    monkeypatch.setattr(trust, "published_errors", lambda: {
        "rows": [{"id": "r", "kind": "nccl_alltoall", "profile": "h100", "measured": 10, "predicted": 12, "error": 0.2,
                  "unit": "us", "in_sample": False, "source": "s", "setting": "x"}],
        "summary": {"out_of_sample": {"rows": 1, "median_abs_error": 0.2, "max_abs_error": 0.2, "worst": "r"}},
        "worst_comm_out_of_sample": 0.2})
    monkeypatch.setattr(trust, "EXEC_RESULTS", tmp_path / "none.json")  # no bench result at the default place
    result = trust.compute(None, **SMALL)
    (tmp_path / "cost_model_trust").mkdir()
    (tmp_path / "cost_model_trust" / "trust.json").write_text(json.dumps(result))
    text = "\n".join(trust_section(tmp_path))
    assert "## How far to trust the cost model" in text and "| r | x | 10 us |" in text
    assert "break-even cells that flip" in text and "no bench.bench_cost_model result" in text
