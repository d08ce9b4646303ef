"""Optional cross-checks against SGLang's own pure-Python code (skipped unless sglang imports on this machine).

Install recipe (reference/engines.md 3; the sglang wheel pins a CUDA torch, so never without --no-deps):
    pip install -e ".[engines-cpu]" && pip install --no-deps sglang==0.5.23
Checks: our exported `--init-expert-location` rows go through SGLang's `_compute_logical_to_all_physical_map`
and `compute_logical_to_rank_dispatch_physical_map` (the code `init_by_mapping` runs) with the replica lists and
local-replica dispatch our Placement describes; our EPLB port equals SGLang's `deepseek.rebalance_experts`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_engines_sglang import DEVICES, NUM_EXPERTS, toy_job

expert_location = pytest.importorskip("sglang.srt.eplb.expert_location", reason="sglang (engines-cpu recipe) not installed")
deepseek = pytest.importorskip("sglang.srt.eplb.eplb_algorithms.deepseek")

from repro.engines import sglang  # noqa: E402
from repro.engines.layout import load_plan  # noqa: E402
from repro.systems.eplb import rebalance_experts  # noqa: E402


@pytest.mark.parametrize("redundant", [0, 4])
def test_sglang_accepts_our_location_and_dispatches_locally(tmp_path, redundant, monkeypatch):
    # outside a server SGLang has no runtime context to ask whether to prefer same-node replicas: one node here
    monkeypatch.setattr(expert_location, "_prefer_same_node_experts", lambda: False)
    job, placement = toy_job(tmp_path, redundant=redundant)
    out = tmp_path / "loc.json"
    assert sglang.main(["export", str(job), "--out", str(out)]) == 0
    rows = torch.tensor(json.loads(out.read_text())["physical_to_logical_map"])
    num_slots = rows.shape[1]
    candidates = expert_location._compute_logical_to_all_physical_map(
        physical_to_logical_map=rows, num_logical_experts=NUM_EXPERTS, ep_size=DEVICES, moe_ep_rank=None
    )
    candidates = np.asarray(candidates)
    for layer in range(rows.shape[0]):
        for expert in range(NUM_EXPERTS):
            slots = candidates[layer, expert]
            np.testing.assert_array_equal(np.sort(slots[slots >= 0]), np.flatnonzero(rows[layer].numpy() == expert))
    saved = load_plan(job)
    ours = saved.placement.dispatch_device()  # [L, D, E]
    for rank in range(DEVICES):
        theirs = expert_location.compute_logical_to_rank_dispatch_physical_map(
            torch.as_tensor(candidates), DEVICES, num_slots, rank
        ).numpy()  # [Lh, E] physical slot each expert's tokens go to from this rank
        device = theirs[list(saved.layer_ids)] // (num_slots // DEVICES)
        local = saved.placement.replicas()[:, :, rank] > 0  # [L, E]
        np.testing.assert_array_equal(device[local], rank)  # a local replica is always taken, as in our rule
        np.testing.assert_array_equal(ours[:, rank][local], rank)


@pytest.mark.parametrize("num_groups, num_nodes, num_gpus", [(4, 2, 8), (1, 1, 4), (3, 2, 4)])
def test_our_eplb_equals_sglangs(num_groups, num_nodes, num_gpus):
    rng = np.random.default_rng(num_groups * 10 + num_gpus)
    weight = rng.gamma(0.7, 100.0, (5, 24))  # continuous: no ties
    num_replicas = 24 + num_gpus
    ours = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    theirs = deepseek.rebalance_experts(
        torch.as_tensor(weight), num_replicas, num_groups, num_nodes, num_gpus, num_groups % num_nodes == 0
    )
    np.testing.assert_array_equal(ours[0], theirs[0].numpy())  # phy2log
    np.testing.assert_array_equal(ours[2], theirs[2].numpy())  # replicas per expert
    # the same replica slots per expert (the order of an expert's replicas is a naming convention: SGLang derives
    # its own lists from phy2log in init_by_mapping)
    width = max(ours[1].shape[2], theirs[1].shape[2])
    pad = [np.pad(np.sort(a, axis=2), ((0, 0), (0, 0), (0, width - a.shape[2])), constant_values=-1)
           for a in (ours[1], theirs[1].numpy())]
    np.testing.assert_array_equal(np.sort(pad[0], axis=2), np.sort(pad[1], axis=2))
