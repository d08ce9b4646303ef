"""repro.tune: defaults are chosen on the validate split; the evaluate split only reports them."""

import json

import numpy as np
import pandas as pd
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
