"""Sharded traces (repro.traces.shards): a folder of shards reads as one trace, without copying, in every reader."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from repro.affinity.tables import token_expert_counts
from repro.errors import TraceError
from repro.eval.accounting import evaluate
from repro.parallel import ParallelConfig
from repro.sim import simulate
from repro.systems import make_system
from repro.traces import (
    TraceMeta,
    concat_traces,
    make_trace,
    read_trace,
    select_requests,
    split_trace,
    trace_digest,
    write_trace,
)
from repro.traces.arrays import ConcatArray
from repro.traces.shards import write_manifest

ROOT = Path(__file__).resolve().parents[1]


def token_routed_trace(num_requests=40, seed=0, weights=True):
    """Routing fixed per token id (so placement matters), with gate weights and generated tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 30, num_requests)
    token_ids = rng.integers(0, 60, int(lengths.sum()))
    experts = np.stack([token_ids % 16, (token_ids * 7 + 3) % 16], axis=1)[:, None, :].repeat(3, axis=1)
    experts[experts[..., 0] == experts[..., 1], 1] = (experts[experts[..., 0] == experts[..., 1], 1] + 1) % 16
    meta = TraceMeta(model="toy", num_experts=16, top_k=2, layer_ids=(1, 2, 3), vocab_size=60, dataset="toy")
    return make_trace(meta, np.concatenate([[0], np.cumsum(lengths)]), token_ids, experts,
                      prefill_len=lengths - rng.integers(0, 3, num_requests).clip(max=lengths - 1),
                      request_ids=[f"r{i}" for i in range(num_requests)],
                      request_labels=[f"c{i % 3}" for i in range(num_requests)],
                      weights=rng.random((int(lengths.sum()), 3, 2)) if weights else None)


def write_shards(trace, root: Path, cuts=(0, 13, 14, 40)) -> list[Path]:
    """Write requests cuts[i]:cuts[i+1] of `trace` as shard i; returns the shard directories."""
    dirs = []
    for i, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        dirs.append(write_trace(select_requests(trace, np.arange(lo, hi)), root / f"part-{i}"))
    return dirs


@pytest.fixture
def sharded(tmp_path):
    trace = token_routed_trace()
    shards = write_shards(trace, tmp_path / "shards")
    write_manifest(tmp_path / "sharded", shards)
    return trace, read_trace(tmp_path / "sharded"), tmp_path


def test_sharded_trace_reads_as_its_concatenation(sharded):
    whole, back, tmp_path = sharded
    assert isinstance(back.experts, ConcatArray) and len(back.experts.parts) == 3
    assert back.meta == whole.meta and back.request_ids == whole.request_ids
    for name in ("offsets", "token_ids", "experts", "prefill_len", "weights"):
        np.testing.assert_array_equal(np.asarray(getattr(back, name)), getattr(whole, name))
    assert trace_digest(back) == trace_digest(whole)  # caches key a sharded trace like its concatenation
    parts = [read_trace(tmp_path / "shards" / f"part-{i}") for i in range(3)]
    assert trace_digest(back) == trace_digest(concat_traces(parts))
    # the manifest lists relative paths only: nothing was copied or linked
    manifest = json.loads((tmp_path / "sharded" / "shards.json").read_text())
    assert manifest["shards"] == ["../shards/part-0", "../shards/part-1", "../shards/part-2"]
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == ["shards.json"]


def test_concat_array_indexing_matches_numpy(sharded):
    whole, back, _ = sharded
    rng = np.random.default_rng(3)
    n = whole.num_tokens
    rows = rng.integers(-n, n, 50)
    for key in (5, -1, slice(3, 300), slice(None, None, 7), slice(250, 260), rows, (rows, 1), (slice(None), 2),
                (np.sort(rows), slice(None, 2)), rng.random(n) < 0.3, (slice(10, 400), 0, 1)):
        np.testing.assert_array_equal(back.experts[key], whole.experts[key])
    np.testing.assert_array_equal(back.token_ids == 7, whole.token_ids == 7)  # ufuncs see the rows
    assert back.experts.min() == whole.experts.min() and back.experts.max() == whole.experts.max()
    with pytest.raises(IndexError):
        back.experts[np.array([n])]


def test_every_reader_accepts_a_sharded_trace(sharded):
    whole, back, _ = sharded
    for a, b in zip(split_trace(back, 0.25), split_trace(whole, 0.25), strict=True):
        assert trace_digest(a) == trace_digest(b)
    np.testing.assert_array_equal(token_expert_counts(back)[1], token_expert_counts(whole)[1])
    parallel = ParallelConfig(devices=4, attention="tp", tokens_per_step=64)
    plans = [make_system("semmoe").fit(t, parallel, np.random.default_rng(0)) for t in (back, whole)]
    np.testing.assert_array_equal(plans[0].placement.physical_to_logical, plans[1].placement.physical_to_logical)
    timing = ("plan_solver_seconds", "plan_fit_seconds")
    summaries = [{k: v for k, v in evaluate(p, t).summary.items() if k not in timing} for p, t in zip(plans, (back, whole), strict=True)]
    assert summaries[0] == summaries[1]
    conf = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/sim/default.yaml"), resolve=True)
    conf.pop("defaults")
    conf.update(seeds=1, warmup_s=0.0, cooldown_s=0.0, duration_s=1.0, max_duration_s=1.0, min_requests=10, rates=[5.0], output_len=[2, 4],
                routing_map="trace")
    hardware = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/hardware/h200.yaml"), resolve=True)
    shape = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/sim/shape/deepseek_v2_lite.yaml"), resolve=True)
    dp = ParallelConfig(devices=4, attention="dp")
    plan = make_system("ep").fit(whole, dp, np.random.default_rng(0))
    runs = [simulate({"sim": conf, "history": 2}, plan, t, hardware, shape, np.random.default_rng(0)) for t in (back, whole)]
    pd.testing.assert_frame_equal(runs[0].per_rate.drop(columns=["wall_s", "cpu_s"], errors="ignore"),
                                  runs[1].per_rate.drop(columns=["wall_s", "cpu_s"], errors="ignore"))


def test_run_py_evaluates_a_sharded_trace_like_its_concatenation(sharded, tmp_path):
    whole, _, _ = sharded
    write_trace(whole, tmp_path / "whole")
    lars = []
    for name in ("sharded", "whole"):
        res = subprocess.run(
            [sys.executable, "-m", "repro.run", "logger=none", f"hydra.run.dir={tmp_path / ('job_' + name)}",
             f"trace={tmp_path / name}", "system=ep", "parallel.attention=dp"],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
            env={**__import__("os").environ, "WANDB_MODE": "disabled", "REPRO_CACHE": str(tmp_path / "cache")},
        )
        assert res.returncode == 0, res.stderr[-3000:]
        lars.append(json.loads((tmp_path / f"job_{name}" / "metrics.json").read_text())["summary"]["lar"])
    assert lars[0] == lars[1]


def test_bad_shards_are_refused_and_nothing_is_written(tmp_path):
    trace = token_routed_trace()
    a, b, c = write_shards(trace, tmp_path)
    other_model = write_trace(replace(trace, meta=replace(trace.meta, top_k=2, layer_ids=(1, 2, 4))), tmp_path / "other")
    for shards, match in (
        ([a, a], "request id 'r0' is in both shard .*part-0 and shard .*part-0"),
        ([a, other_model], "shard .*other has layer_ids=\\(1, 2, 4\\)"),
        ([a, tmp_path / "missing"], "not a trace directory"),
    ):
        with pytest.raises(TraceError, match=match):
            write_manifest(tmp_path / "out", shards)
        assert not (tmp_path / "out").exists()
    no_weights = write_trace(select_requests(token_routed_trace(weights=False), np.arange(14, 40)), tmp_path / "nw")
    with pytest.raises(TraceError, match="lacks gate weights"):
        write_manifest(tmp_path / "out", [a, no_weights])
    # a manifest whose shard disappeared later
    write_manifest(tmp_path / "ok", [a, b, c])
    import shutil

    shutil.rmtree(b)
    with pytest.raises(TraceError, match="part-1 listed in .*shards.json is missing"):
        read_trace(tmp_path / "ok")
    (tmp_path / "ok" / "shards.json").write_text('{"format": "x"}')
    with pytest.raises(TraceError, match="is not a version-1 repro-sharded-trace manifest"):
        read_trace(tmp_path / "ok")


def test_combine_command_line(tmp_path):
    a, b, c = write_shards(token_routed_trace(), tmp_path)
    ok = subprocess.run([sys.executable, "-m", "repro.traces.shards", "combine", str(tmp_path / "all"), str(a), str(b), str(c)],
                        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert read_trace(tmp_path / "all").num_requests == 40
    bad = subprocess.run([sys.executable, "-m", "repro.traces.shards", "combine", str(tmp_path / "dup"), str(a), str(a)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "request id" in bad.stderr
    assert not (tmp_path / "dup").exists()


def test_a_big_split_of_an_on_disk_trace_stays_on_disk(sharded, monkeypatch, tmp_path):
    """select_requests returns RowsViews beyond LAZY_SELECT_BYTES (0 here): same values, nothing copied."""
    import repro.traces.ops as ops
    from repro.traces.arrays import RowsView

    whole, back, _ = sharded
    monkeypatch.setattr(ops, "LAZY_SELECT_BYTES", 0)
    lazy, eager = split_trace(back, 0.3), split_trace(whole, 0.3)
    assert isinstance(lazy[0].experts, RowsView) and isinstance(lazy[1].weights, RowsView)
    assert not isinstance(eager[0].experts, RowsView)  # an in-memory source is copied as before
    rng = np.random.default_rng(4)
    for a, b in zip(lazy, eager, strict=True):
        assert trace_digest(a) == trace_digest(b)
        n = b.num_tokens
        for key in (3, slice(2, 90), rng.integers(-n, n, 30), (slice(None), 1), rng.random(n) < 0.5):
            np.testing.assert_array_equal(a.experts[key], b.experts[key])
    parallel = ParallelConfig(devices=4, attention="tp", tokens_per_step=64)
    plans = [make_system("semmoe", n_starts=1).fit(t[0], parallel, np.random.default_rng(0)) for t in (lazy, eager)]
    timing = ("plan_solver_seconds", "plan_fit_seconds")
    summaries = [{k: v for k, v in evaluate(p, t[1]).summary.items() if k not in timing}
                 for p, t in zip(plans, (lazy, eager), strict=True)]
    assert summaries[0] == summaries[1]
    write_trace(lazy[1], tmp_path / "written")
    assert trace_digest(read_trace(tmp_path / "written")) == trace_digest(eager[1])
