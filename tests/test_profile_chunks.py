"""Profiling in chunks (repro.affinity.tables.profile_chunks) and partial count tables merged across shard jobs
(repro.affinity.partial): the tables equal the one-pass ones exactly, whatever the chunking or sharding."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import repro.affinity.tables as tables
from repro.affinity.partial import count_shard, dense_counts, load_table, merge_tables, save_table
from repro.affinity.tables import (
    encode_tokens,
    layer_token_expert_counts,
    profile_tokens,
    sample_profile_requests,
    token_expert_counts,
)
from repro.errors import ConfigError, TraceError
from repro.parallel import ParallelConfig
from repro.systems import make_system
from repro.traces import read_trace, select_requests, write_trace
from repro.traces.shards import write_manifest
from tests.test_trace_shards import token_routed_trace, write_shards

ROOT = Path(__file__).resolve().parents[1]


def one_pass_counts(trace, prompt_only):
    """token_expert_counts as it was computed before chunking: the whole profile column per layer."""
    keep = profile_tokens(trace, prompt_only)
    vocab, row = encode_tokens(np.asarray(trace.token_ids)[keep])
    experts = np.asarray(trace.experts)[keep]
    return vocab, np.stack([layer_token_expert_counts(row, experts[:, layer], len(vocab), trace.meta.num_experts)
                            for layer in range(trace.num_layers)])


@pytest.fixture
def sharded(tmp_path):
    trace = token_routed_trace(num_requests=60, seed=2)
    write_manifest(tmp_path / "sharded", write_shards(trace, tmp_path / "parts", cuts=(0, 20, 21, 45, 60)))
    return trace, tmp_path / "sharded"


@pytest.mark.parametrize("prompt_only", [False, True])
def test_chunked_counts_equal_the_one_pass_table(sharded, monkeypatch, prompt_only):
    whole, path = sharded
    want_vocab, want = one_pass_counts(whole, prompt_only)
    for chunk in (37, 1 << 17):  # many chunks, some straddling shard boundaries; and one chunk
        monkeypatch.setattr(tables, "PROFILE_CHUNK_TOKENS", chunk)
        for trace in (whole, read_trace(path)):
            vocab, counts = token_expert_counts(trace, prompt_only=prompt_only)
            np.testing.assert_array_equal(vocab, want_vocab)
            assert counts.dtype == np.float32 and np.array_equal(counts, want)


@pytest.mark.parametrize("attention, params", [("tp", {"expert_load_cap": 1.05}), ("dp", {"prompt_only": True, "max_units": 20})])
def test_semmoe_plan_does_not_depend_on_the_chunking(sharded, monkeypatch, attention, params):
    whole, path = sharded
    parallel = ParallelConfig(devices=4, attention=attention, tokens_per_step=64)

    def fit(trace):
        plan = make_system("semmoe", n_starts=1, polish_rounds=4, **params).fit(trace, parallel, np.random.default_rng(0))
        return [plan.placement.physical_to_logical, plan.token_device, plan.token_confidence, plan.dp_score,
                plan.markov_device, plan.markov_confidence, plan.token_frequency]

    reference = fit(whole)
    monkeypatch.setattr(tables, "PROFILE_CHUNK_TOKENS", 53)
    for got in (fit(whole), fit(read_trace(path))):
        for a, b in zip(got, reference, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_partial_tables_from_parallel_jobs_merge_to_the_single_process_table(sharded, tmp_path):
    whole, path = sharded
    jobs = [subprocess.Popen([sys.executable, "-m", "repro.affinity.partial", "count", "--trace", str(path),
                              "--shard", str(i), "--out", str(tmp_path / f"part{i}.npz")], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(4)]
    assert all(job.wait(timeout=60) == 0 for job in jobs), [job.stderr.read() for job in jobs]
    merged = subprocess.run([sys.executable, "-m", "repro.affinity.partial", "merge", "--trace", str(path), "--out",
                             str(tmp_path / "merged.npz"), *(str(tmp_path / f"part{i}.npz") for i in (2, 0, 3, 1))],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert merged.returncode == 0, merged.stderr
    vocab, counts = dense_counts(load_table(tmp_path / "merged.npz"))
    want_vocab, want = token_expert_counts(read_trace(path))
    np.testing.assert_array_equal(vocab, want_vocab)
    assert np.array_equal(counts, want) and np.array_equal(counts, one_pass_counts(whole, False)[1])
    # a plain (unsharded) trace is one shard
    write_trace(whole, tmp_path / "plain")
    count_shard(tmp_path / "plain", 0, tmp_path / "plain0.npz")
    assert np.array_equal(dense_counts(merge_tables(tmp_path / "plain", [tmp_path / "plain0.npz"]))[1], want)


def test_bad_partials_are_refused_and_nothing_is_written(sharded, tmp_path):
    whole, path = sharded
    parts = [count_shard(path, i, tmp_path / f"p{i}.npz") for i in range(4)]
    other = tmp_path / "other"
    write_manifest(other, write_shards(token_routed_trace(num_requests=60, seed=3), tmp_path / "o", cuts=(0, 20, 21, 45, 60)))
    foreign = count_shard(other, 1, tmp_path / "foreign.npz")
    (tmp_path / "junk.npz").write_bytes(b"not an npz")
    for paths, match in (
        ([parts[0], parts[1], parts[2]], "no partial table covers shard 3"),
        ([*parts, parts[2]], "shard 2 is counted in both"),
        ([parts[0], foreign, parts[2], parts[3]], "counted on another trace"),
        ([*parts[:3], tmp_path / "junk.npz"], "is not a count table"),
    ):
        with pytest.raises(TraceError, match=match):
            save_table(merge_tables(path, paths), tmp_path / "merged.npz")
        assert not (tmp_path / "merged.npz").exists()
    with pytest.raises(TraceError, match="shard 4 is not one of the 4 shards"):
        count_shard(path, 4, tmp_path / "p4.npz")
    assert not (tmp_path / "p4.npz").exists()


@pytest.mark.parametrize("attention", ["tp", "dp"])
def test_profile_tokens_cap_fits_on_a_seeded_sample_of_whole_requests(sharded, attention):
    whole, _ = sharded
    cap = whole.num_tokens // 3
    kept = sample_profile_requests(whole.offsets, np.arange(whole.num_tokens), cap)
    assert 0 < len(kept) <= cap
    assert np.array_equal(kept, sample_profile_requests(whole.offsets, np.arange(whole.num_tokens), cap))  # seeded
    requests = np.unique(np.searchsorted(whole.offsets, kept, side="right") - 1)
    assert len(kept) == whole.lengths()[requests].sum()  # whole requests only
    parallel = ParallelConfig(devices=4, attention=attention, tokens_per_step=64)

    def fit(trace, **params):
        return make_system("semmoe", n_starts=1, polish_rounds=4, **params).fit(trace, parallel, np.random.default_rng(0))

    capped, subset = fit(whole, profile_tokens=cap), fit(select_requests(whole, requests))
    assert capped.info["profile_sampled_tokens"] == len(kept)
    for name in ("token_vocab", "token_device", "token_confidence", "markov_device", "markov_confidence"):
        assert np.array_equal(getattr(capped, name), getattr(subset, name)), name
    assert np.array_equal(capped.placement.physical_to_logical, subset.placement.physical_to_logical)
    assert capped.token_frequency.sum() == len(kept) < whole.num_tokens  # the cap did leave tokens out
    with pytest.raises(ConfigError, match="profile_tokens must be null"):
        make_system("semmoe", profile_tokens=0)


def test_statistics_and_request_tables_do_not_depend_on_the_chunking(sharded, monkeypatch):
    import pandas as pd

    from repro.affinity.requests import request_activations
    from repro.affinity.stats import affinity_statistics

    whole, path = sharded
    want_stats = affinity_statistics(whole, min_occurrences=2)
    want_requests = request_activations(whole, max_requests=25)
    monkeypatch.setattr(tables, "PROFILE_CHUNK_TOKENS", 29)
    for trace in (whole, read_trace(path)):
        pd.testing.assert_frame_equal(affinity_statistics(trace, min_occurrences=2), want_stats, check_exact=True)
        got = request_activations(trace, max_requests=25)
        for name, value in want_requests.items():
            assert np.array_equal(got[name], value), name


def test_count_jobs_fanned_out_by_a_hydra_launcher_merge_to_the_single_process_table(sharded, tmp_path):
    """The documented cluster recipe with Hydra's local launcher: a multirun over the shard index, then merge."""
    whole, path = sharded
    run = subprocess.run([sys.executable, "-m", "repro.affinity.count_job", "-m", f"trace={path}", "shard=range(0,4)",
                          f"out_dir={tmp_path / 'tables'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in (tmp_path / "tables").iterdir()) == ["0.npz", "1.npz", "2.npz", "3.npz"]
    merged = merge_tables(path, sorted((tmp_path / "tables").iterdir()))
    np.testing.assert_array_equal(dense_counts(merged)[1], one_pass_counts(whole, False)[1])
    # a shard index the trace does not have: one sentence, no table
    bad = subprocess.run([sys.executable, "-m", "repro.affinity.count_job", f"trace={path}", "shard=4",
                          f"out_dir={tmp_path / 'bad'}", f"hydra.run.dir={tmp_path / 'run'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "shard 4 is not one of the 4 shards" in bad.stderr
    assert not any((tmp_path / "bad").glob("*.npz"))
