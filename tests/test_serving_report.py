"""repro.figures.serving: paired serving ratios vs round-robin EP, the gain split and the sign disagreements."""

import numpy as np
import pandas as pd
import pytest

from repro.figures.serving import gain_split_section, serving_ratios, sign_disagreements, sign_section


def job(system, capacity, estimate, converged=True, dp_scheduler=None, run_dir=None, dp_load_rule=None):
    return {"experiment": "serve", "devices": 8, "evaluate_split": "validate", "attention": "dp", "system": system,
            "run_dir": run_dir or f"runs/serve/{system}", "capacity_rps_per_seed": capacity,
            "throughput_under_ttft_slo_rps_per_seed": capacity, "converged_capacity": converged,
            "converged_ttft": converged, "slo_rel_tol": 0.0, "time_estimate_s": estimate, "dp_scheduler": dp_scheduler,
            "dp_load_rule": dp_load_rule}


@pytest.fixture
def summary():
    return pd.DataFrame([
        job("ep", [100.0, 110.0, 90.0], 1.0),
        job("least_wait", [110.0, 121.0, 99.0], 1.1),  # 1.1x in serving, offline says slower: a disagreement
        job("semmoe", [121.0, 133.1, 108.9], 0.8, dp_scheduler="load", dp_load_rule="wait"),  # 1.21x = 1.1 (load) x 1.1 (locality)
        job("minimum_tokens", [80.0, 88.0, 72.0], 0.9),  # offline faster, serving 0.8x: a disagreement
        job("gimbal", [200.0, 1.0, 5.0], 0.9, converged=False),  # unconverged: never judged
    ])


def test_ratios_are_paired_per_seed_and_unconverged_values_are_not_used(summary):
    ratios = serving_ratios(summary).set_index("system")
    assert ratios.loc["semmoe", "capacity_mean"] == pytest.approx(1.21)
    assert ratios.loc["semmoe", "capacity_low"] == pytest.approx(1.21)  # identical per-seed ratios: zero width
    assert np.isnan(ratios.loc["gimbal", "capacity_mean"])
    assert ratios.loc["semmoe", "offline_speedup"] == pytest.approx(1.25)


def test_the_gain_split_names_the_twin_and_the_locality_part(summary):
    text = "\n".join(gain_split_section(summary))
    assert "| semmoe | 3 | 1.210 [1.210, 1.210] |" in text
    assert "1.100 [1.100, 1.100] (least_wait) | 1.100 |" in text
    assert "(add seeds: sim.seeds_until): none." in text


def test_intervals_wider_than_the_target_are_listed_and_seeds_pair_over_the_common_ones():
    wide = pd.DataFrame([job("ep", [100.0, 110.0, 90.0], 1.0),
                         job("shortest_queue", [100.0, 121.0, 81.0, 95.0], 1.0)])  # one seed more than ep
    ratios = serving_ratios(wide).set_index("system")
    assert ratios.loc["shortest_queue", "capacity_seeds"] == 3
    assert ratios.loc["shortest_queue", "capacity_mean"] == pytest.approx((1.0 + 1.1 + 0.9) / 3)
    text = "\n".join(gain_split_section(wide))
    assert "(add seeds: sim.seeds_until): shortest_queue (serve, capacity), shortest_queue (serve, ttft)." in text


def test_sign_disagreements_list_exactly_the_opposite_signs(summary):
    disagree = sign_disagreements(serving_ratios(summary))
    assert sorted(disagree["system"]) == ["least_wait", "minimum_tokens"]
    assert "2 of 4 serving jobs" in "\n".join(sign_section(summary))
