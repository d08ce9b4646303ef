"""repro.exec on 4 (or 2) gloo ranks: outputs vs the single-process MoE, bytes per rank and layer vs the evaluator
(ep, semmoe, eplb with redundant slots, a hand-built replicated placement; Attention-DP and TP; a rank without
tokens), hand-worked byte counts, a dying rank, and one-sentence errors. Few launches: each spawn costs seconds.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from repro.errors import ConfigError, ReproError
from repro.exec.launch import launch
from repro.exec.moe import CommRecord, build_local_experts, ep_moe_forward, shuffled_all_gather, shuffled_reduce_scatter
from repro.exec.trace_mode import ExecConfig, check_exec, check_exec_config, run_exec_plans
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.systems.base import Placement, Plan
from repro.traces import TraceMeta, make_trace, split_trace

ROOT = Path(__file__).resolve().parents[1]
E, L, K, D = 8, 3, 2, 4


def routed_trace(num_requests=48, weights=True, seed=0):
    """Token-determined routing (expert pair mostly fixed by the token id) with per-token gate weights."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 30, num_requests)
    n = int(lengths.sum())
    tokens = rng.integers(0, 60, n)
    first = np.stack([(tokens + 3 * layer) % E for layer in range(L)], axis=1)
    noisy = rng.random((n, L)) < 0.2
    second = np.where(noisy, (first + 1 + rng.integers(0, E - 1, (n, L))) % E, (first + 4) % E)
    meta = TraceMeta(model="t", num_experts=E, top_k=K, layer_ids=(1, 2, 3), vocab_size=60)
    gate = rng.random((n, L, K)).astype(np.float16) if weights else None
    return make_trace(meta, np.concatenate([[0], np.cumsum(lengths)]), tokens, np.stack([first, second], 2), weights=gate)


class IdleLastRank(Plan):
    """Round-robin over ranks 0..D-2: rank D-1 gets no tokens in Attention-DP."""

    def assign_requests(self, token_ids, offsets, prefill_len):
        return np.arange(len(offsets) - 1) % (self.parallel.devices - 1)


def replicated_placement() -> Placement:
    """P = E + D slots: experts 0..7 contiguous, then one replica each of 0, 2, 5, 7 (3 slots per rank)."""
    row = np.array([0, 1, 2, 3, 4, 5, 6, 7, 0, 2, 5, 7])
    return Placement(np.tile(row, (L, 1)), D, E)


@pytest.fixture(scope="module")
def executed():
    profile, evaluation = split_trace(routed_trace(), 0.3)
    plans, names = [], []
    for attention in ("dp", "tp"):
        parallel = ParallelConfig(devices=D, attention=attention, tokens_per_step=64)
        for system, params in (("ep", {}), ("semmoe", {}), ("eplb", {"num_redundant": 4})):
            plans.append(make_system(system, **params).fit(profile, parallel, np.random.default_rng(0)))
            names.append(f"{system}-{attention}")
        hand = IdleLastRank if attention == "dp" else Plan
        plans.append(hand(replicated_placement(), parallel))
        names.append(f"replicated-{attention}")
    cfg = ExecConfig(hidden_size=32, intermediate_size=48, max_tokens=400, timeout_s=60)
    return dict(zip(names, run_exec_plans(cfg, plans, evaluation, seed=3), strict=True)), plans


def test_every_plan_matches_evaluator_bytes_and_reference_outputs(executed):
    results, _ = executed
    for name, (summary, per_layer, per_rank) in results.items():
        assert summary["max_abs_error"] <= 1e-5, name
        assert summary["output_matches_reference"], name
        # per rank and layer, measured == evaluator, in both directions
        assert (per_rank["dispatch_bytes"] == per_rank["evaluator_dispatch_bytes"]).all(), name
        assert (per_rank["combine_bytes"] == per_rank["evaluator_combine_bytes"]).all(), name
        assert summary["bytes_match_evaluator"] and summary["dispatch_bytes"] > 0, name
        assert len(per_layer) == L and len(per_rank) == L * D
        assert summary["num_tokens"] <= 400 and summary["bytes_per_token"] == 32 * 4
        # the routing metadata: 2k int32 per remote copy, as many copies as hidden rows
        assert summary["dispatch_meta_bytes"] * 32 == summary["dispatch_bytes"] * 2 * K
        tp = name.endswith("-tp")
        assert (summary["reduce_scatter_bytes"] > 0) == tp and (summary["all_gather_bytes"] > 0) == tp


def test_token_placement_changes_the_real_traffic(executed):
    results, _ = executed
    tp = {name: s["dispatch_bytes"] for name, (s, _, _) in results.items() if name.endswith("-tp")}
    assert tp["semmoe-tp"] < 0.8 * tp["ep-tp"]


def test_zero_token_rank_and_replicas(executed):
    results, plans = executed
    summary, _, per_rank = results["replicated-dp"]
    assert summary["tokens_per_rank"][D - 1] == 0 and min(summary["tokens_per_rank"][: D - 1]) > 0
    idle = per_rank[per_rank["rank"] == D - 1]
    assert (idle["dispatch_bytes"] == 0).all() and (idle["combine_bytes"] > 0).any()
    # sources disagree on which replica serves a replicated expert: both copies really serve tokens
    dispatch = replicated_placement().dispatch_device()
    assert len(set(dispatch[0, :, 0].tolist())) > 1
    assert results["eplb-dp"][0]["bytes_match_evaluator"] and plans[2].placement.num_slots == E + D


# ---- hand-worked: 2 ranks, 4 experts ---------------------------------------------------------------------------

H = 8


def hand_worker(rank, world_size):
    """Rank 0 owns 3 tokens, rank 1 none; experts 0, 1 on rank 0 and 2, 3 on rank 1. Then a shuffled
    reduce-scatter / all-gather of 5 tokens over the 2 ranks."""
    from repro.kernels.grouped_gemm import moe_reference

    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(4, 6, H, generator=g), torch.randn(4, H, 3, generator=g)
    x = torch.randn(3, H, generator=g)
    ids = torch.tensor([[0, 2], [1, 0], [2, 3]])
    weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
    if rank == 1:
        x, ids, weights = x[:0], ids[:0], weights[:0]
    record = CommRecord(barrier=True)  # timing mode: bytes must not change
    local = build_local_experts(np.array([0, 1, 2, 3]), rank, world_size, w13, w2)
    y = ep_moe_forward(x, ids, weights, torch.tensor([0, 0, 1, 1]), local, 4, layer=0, record=record, backend="torch")
    error = float((y - moe_reference(x, ids, weights, w13, w2)).abs().max()) if len(x) else 0.0

    full = torch.arange(5 * H, dtype=torch.float32).view(5, H)
    permutation, counts = [4, 0, 3, 1, 2], [3, 2]
    mine = shuffled_reduce_scatter(full * (rank + 1) / 3, permutation, counts, layer=1, record=record)
    back = shuffled_all_gather(mine * 2, permutation, counts, layer=1, record=record)
    return {"error": error, "y_rows": len(y), "comm": record.to_json(), "slice": mine.tolist(), "back": back.tolist(),
            "rank": dist.get_rank()}


def test_hand_worked_bytes_and_shuffles():
    results = launch(hand_worker, 2, timeout_s=30)
    first, second = (CommRecord.from_json(r["comm"]) for r in results)
    assert results[0]["error"] <= 1e-5 and results[1]["y_rows"] == 0
    # rank 0 sends tokens 0 and 2 to rank 1 (token 1 stays); rank 1 returns their two partial sums
    assert (first.bytes_of(0, "dispatch"), second.bytes_of(0, "dispatch")) == (2 * H * 4, 0)
    assert (first.bytes_of(0, "combine"), second.bytes_of(0, "combine")) == (0, 2 * H * 4)
    assert first.bytes_of(0, "dispatch_meta") == 2 * (2 * K) * 4 and first.bytes_of(0, "counts") == 8
    # the slices: rank 0 holds tokens 4, 0, 3, rank 1 tokens 1, 2 (partials (r+1)/3 sum to 1)
    full = np.arange(5 * H, dtype=np.float32).reshape(5, H)
    np.testing.assert_allclose(results[0]["slice"], full[[4, 0, 3]], rtol=1e-6)
    np.testing.assert_allclose(results[1]["slice"], full[[1, 2]], rtol=1e-6)
    for r in results:
        np.testing.assert_allclose(r["back"], 2 * full, rtol=1e-6)
    # one padded slice of 3 rows leaves each rank in each direction
    assert first.bytes_of(1, "reduce_scatter") == second.bytes_of(1, "all_gather") == 3 * H * 4


# ---- faults and bad inputs ---------------------------------------------------------------------------------------


def dying_worker(rank, world_size):
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 1:
        os._exit(3)
    for _ in range(5):
        dist.all_reduce(t)
    return {}


def test_a_dying_rank_is_named_and_nobody_hangs():
    with pytest.raises(ReproError, match=r"rank 1 of 4 failed: the process exited with code 3"):
        launch(dying_worker, 4, timeout_s=5)


def test_bad_inputs_are_one_sentence(monkeypatch):
    parallel = ParallelConfig(devices=D)
    with pytest.raises(ConfigError, match="exec world size is 3 but the plan places experts on 4 devices"):
        check_exec_config(ExecConfig(world_size=3), parallel)
    with pytest.raises(ConfigError, match="bfloat16 runs on GPUs only"):
        check_exec_config(ExecConfig(dtype="bfloat16"), parallel)
    with pytest.raises(ConfigError, match="exec has no key"):
        check_exec_config({"hiden_size": 8}, parallel)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="kernel backend triton needs a GPU"):
        check_exec_config(ExecConfig(kernel_backend="triton"), parallel)
    other = make_trace(TraceMeta(model="o", num_experts=16, top_k=K, layer_ids=(0, 1, 2), vocab_size=60),
                       [0, 2], [1, 2], np.zeros((2, L, K), dtype=np.int16) + np.arange(K))
    with pytest.raises(ConfigError, match="places 8 experts in 3 MoE layers but the trace's model has 16 experts"):
        check_exec(ExecConfig(), Plan(replicated_placement(), parallel), other)


@pytest.mark.slow
def test_hydra_exec_job_writes_exec_metrics(tmp_path):
    """python -m repro.run experiment=exec on an imported trace without gate weights (uniform 1/k replayed), Attention-TP."""
    from repro.traces import write_trace

    write_trace(routed_trace(30, weights=False, seed=1), tmp_path / "trace")
    env = dict(os.environ, WANDB_MODE="disabled", REPRO_CACHE=str(tmp_path / "cache"))
    res = subprocess.run(
        [sys.executable, "-m", "repro.run", "experiment=exec", "logger=none", f"trace={tmp_path / 'trace'}",
         "system=semmoe", "parallel.attention=tp", "parallel.tokens_per_step=64", "exec.hidden_size=16",
         "exec.intermediate_size=16", f"hydra.run.dir={tmp_path / 'job'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "job" / "metrics.json").read_text())["summary"]
    assert summary["exec_bytes_match_evaluator"] and summary["exec_max_abs_error"] <= 1e-5
    assert summary["exec_dispatch_bytes"] == summary["exec_evaluator_dispatch_bytes"] > 0
    rows = (tmp_path / "job" / "exec_per_layer.csv").read_text().splitlines()
    assert len(rows) == L + 1 and re.search(r"dispatch_seconds", rows[0])
