"""repro.tune: defaults are chosen on the validate split; the evaluate split only reports them."""

import json
import re

import numpy as np
import pandas as pd
import pytest
from test_run import compose, synthetic_trace_dir

from repro.traces import read_trace, write_trace
from repro.tune import grid, tune_job


def tune_config(trace_dir, *overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf
    from test_run import ROOT

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("tune", overrides=["logger=none", f"trace={trace_dir}", "parallel.attention=tp",
                                                "parallel.tokens_per_step=256", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def test_grid_starts_at_the_first_values():
    assert grid({"a": [1, 2], "b": ["x", "y"]})[:2] == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}]
    assert len(grid({"a": [1, 2], "b": ["x", "y", "z"]})) == 6


def test_choice_is_made_on_validate_and_blind_to_the_evaluate_split(tmp_path):
    trace_dir = synthetic_trace_dir(tmp_path / "t")
    config = tune_config(trace_dir)
    result = tune_job(config, tmp_path / "a")
    table = pd.read_csv(tmp_path / "a" / "candidates.csv")
    assert len(table) == result["num_candidates"] == len(grid(config["tune"]["space"]["tp"]))
    best = table[table["feasible"]]["lar"].max()
    assert result["chosen"]["validate"]["lar"] == best
    assert json.loads((tmp_path / "a" / "tuned.json").read_text())["chosen"]["evaluate"]["lar"] > 0

    # scramble the routing of the evaluate split only: the choice and its validate scores must not move
    from repro.run import request_split

    trace = read_trace(trace_dir, mmap=False)
    evaluate = request_split(compose(f"trace={trace_dir}"), trace.num_requests).evaluate
    rows = np.concatenate([np.arange(trace.offsets[r], trace.offsets[r + 1]) for r in evaluate])
    experts = np.array(trace.experts)
    experts[rows] = (experts[rows] + 7) % trace.meta.num_experts
    write_trace(trace.__class__(**{**trace.__dict__, "experts": experts}), trace_dir)
    again = tune_job(config, tmp_path / "b")
    assert again["chosen"]["values"] == result["chosen"]["values"]
    assert again["chosen"]["validate"] == result["chosen"]["validate"]
    assert again["chosen"]["evaluate"] != result["chosen"]["evaluate"]  # positive control: evaluate did change


def test_the_offline_speed_objective_maximises_tokens_per_estimated_second(tmp_path):
    trace_dir = synthetic_trace_dir(tmp_path / "t")
    result = tune_job(tune_config(trace_dir, "tune.objective=offline_tokens_per_s"), tmp_path / "a")
    table = pd.read_csv(tmp_path / "a" / "candidates.csv")
    assert result["chosen"]["validate"]["offline_tokens_per_s"] == table[table["feasible"]]["offline_tokens_per_s"].max()
    assert table["offline_tokens_per_s"].gt(0).all()


@pytest.mark.parametrize("override, message", [
    ("tune.objective=a2a_bytes", "tune.objective must be one of ['lar', 'offline_tokens_per_s', 'capacity_rps'"),
    ("+tune.constraints.nope=1.5", "tune.constraints.nope is not a metric"),
    ("tune.space.tp={system.params.lookback:[]}", "tune.space.tp.system.params.lookback must be a non-empty list"),
    ("parallel.devices=abc", "parallel.devices must be an integer"),
])
def test_a_bad_tune_config_is_refused_before_any_candidate_runs(tmp_path, monkeypatch, override, message):
    import repro.tune
    from repro.errors import ConfigError

    def no_routing(*_):
        raise AssertionError("routing was read before the config was checked")

    monkeypatch.setattr(repro.tune, "build_traces", no_routing)
    with pytest.raises(ConfigError, match=re.escape(message)):
        tune_job(tune_config("/nonexistent/trace", override), tmp_path / "job")
    assert not (tmp_path / "job").exists()


def test_the_default_tune_config_is_sound():
    from repro.tune_config import check_tune_config

    check_tune_config(tune_config("/nonexistent/trace")["tune"])


def test_a_serving_objective_is_measured_by_the_simulator_on_validate(tmp_path):
    """tune.objective=capacity_rps serves every candidate (here two DP slack values of the load-aware Sem-MoE) on the
    validate split; only converged candidates are feasible, and the choice is the highest converged capacity."""
    trace_dir = synthetic_trace_dir(tmp_path / "t")
    config = tune_config(
        trace_dir, "parallel.attention=dp", "parallel.devices=4", "sim=default", "sim.routing_map=trace",
        "sim.rates=[20,2000]", "sim.seeds=1", "sim.duration_s=1", "sim.min_requests=40", "sim.warmup_s=0.2",
        "sim.cooldown_s=0.1", "sim.drain_s=1", "sim.max_duration_s=2", "sim.output_len=4",
        "tune.objective=capacity_rps", "tune.constraints={}",
        "system.params.dp_scheduler=load", "system.params.dp_balance_weight=0", "system.params.n_starts=1",
        "system.params.polish_rounds=0",
        "~tune.space.dp", "+tune.space.dp={system.params.dp_load_slack:[1.0,0.0]}",
    )
    result = tune_job(config, tmp_path / "a")
    table = pd.read_csv(tmp_path / "a" / "candidates.csv")
    assert list(table["system.params.dp_load_slack"]) == [1.0, 0.0]
    assert table["capacity_rps"].gt(0).all() and "converged_capacity" in table
    feasible = table[table["feasible"]]
    assert feasible["converged_capacity"].all()
    assert result["chosen"]["validate"]["capacity_rps"] == feasible["capacity_rps"].max()
    assert result["chosen"]["evaluate"]["capacity_rps"] > 0
    with pytest.raises(Exception, match="measured in serving"):
        tune_job(tune_config(trace_dir, "tune.objective=capacity_rps"), tmp_path / "b")
