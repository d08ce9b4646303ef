"""Streaming import (issue 19 item 1): appended .npy files equal np.save's, the streamed trace is byte-identical to
write_trace of the same trace in sorted and unsorted input at any batch size, errors name the first bad row in
both paths, memory holds at most about batch_rows rows, and a killed import leaves no trace behind."""

import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_import import random_trace, small_table, table_of, write_table

import repro.traces.stream as stream
import repro.traces.tabular as tabular
from repro.errors import TraceError
from repro.traces import TraceMeta, make_trace, read_trace, write_trace
from repro.traces.tabular import import_table_to_dir

cli = importlib.import_module("repro.traces.import")
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dtype, inner", [(np.int64, ()), (np.int32, ()), (np.int16, (3, 2)), (np.float16, (58, 8))])
@pytest.mark.parametrize("chunks", [[0], [1], [5, 0, 7], [300]])
def test_appended_npy_equals_np_save(tmp_path, dtype, inner, chunks):
    rng = np.random.default_rng(0)
    parts = [rng.integers(-100, 100, (n, *inner)).astype(dtype) for n in chunks]
    appender = stream.NpyAppender(tmp_path / "a.npy", dtype, inner)
    for part in parts:
        appender.append(part)
    appender.close()
    np.save(tmp_path / "b.npy", np.concatenate(parts), allow_pickle=False)
    assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()


def test_appended_npy_whose_header_changes_size_is_rewritten(tmp_path, monkeypatch):
    monkeypatch.setattr(stream, "HEADER_ROWS_GUESS", 10**80)  # reserves a longer header than 3 rows need
    appender = stream.NpyAppender(tmp_path / "a.npy", np.int16, (2,))
    assert appender._reserved > len(stream.npy_header(np.int16, (3, 2)))
    appender.append(np.arange(6, dtype=np.int16).reshape(3, 2))
    appender.close()
    np.save(tmp_path / "b.npy", np.arange(6, dtype=np.int16).reshape(3, 2))
    assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy", "b.npy"]


def expected_trace(trace, path: Path, fmt: str, rows: int):
    """The trace the importer must produce for a table of `trace` at `path` (its meta says where it came from)."""
    meta = TraceMeta(model="imported", num_experts=8, top_k=trace.meta.top_k, layer_ids=trace.meta.layer_ids,
                     vocab_size=1000, source=f"import:{path.name}", dataset=path.stem,
                     extra={"input": str(path), "format": fmt, "rows": rows, "inferred": []})
    return make_trace(meta, trace.offsets, trace.token_ids, trace.experts, prefill_len=trace.prefill_len,
                      request_ids=trace.request_ids, request_labels=trace.request_labels, weights=trace.weights)


@pytest.mark.parametrize("suffix, fmt", [(".csv", "csv"), (".jsonl", "jsonl"), (".parquet", "parquet")])
@pytest.mark.parametrize("shuffle", [False, True], ids=["sorted", "shuffled"])
def test_streamed_trace_is_byte_identical_to_write_trace(tmp_path, suffix, fmt, shuffle):
    rng = np.random.default_rng(3)
    trace = random_trace(rng, num_requests=12)
    df = table_of(trace, rng, shuffle=shuffle)
    path = write_table(df, tmp_path / f"routing{suffix}")
    want = write_trace(expected_trace(trace, path, fmt, len(df)), tmp_path / "want")
    for batch_rows in (1, 7, 10**6):  # batches of one row, batches that cut tokens and requests, one batch
        got = tmp_path / f"got{batch_rows}"
        result = import_table_to_dir(path, got, batch_rows=batch_rows, num_experts=8, vocab_size=1000)
        assert result.sorted_input is not shuffle and result.num_tokens == trace.num_tokens
        assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir())  # no spill left
        for file in want.iterdir():
            assert (got / file.name).read_bytes() == file.read_bytes(), (batch_rows, file.name)


def test_surface_tokens_across_batches_keep_first_appearance_order(tmp_path):
    words = ["the", "cat", "the", "dog", ",", "cat", "sat"]
    rows = [dict(request_id=f"q{p // 3}", position=p % 3, layer=layer, token=w, experts=[layer, 2 + p % 3])
            for p, w in enumerate(words) for layer in (0, 1)]
    path = write_table(pd.DataFrame(rows), tmp_path / "t.csv")
    for batch_rows in (1, 3, 100):
        result = import_table_to_dir(path, tmp_path / f"o{batch_rows}", batch_rows=batch_rows)
        trace = read_trace(tmp_path / f"o{batch_rows}")
        assert result.vocab == ["the", "cat", "dog", ",", "sat"]
        np.testing.assert_array_equal(trace.token_ids, [0, 1, 0, 2, 3, 1, 4])


def first_row_of(df, request, position) -> int:
    return int(df.index[(df.request_id == request) & (df.position == position)].min())


@pytest.mark.parametrize(
    "mutate, flagged, words",
    [  # flagged(shuffled table) -> the row the error must name
        (lambda df: df.drop(index=5), lambda df: first_row_of(df, "b", 0), "lacks layer(s) [3]"),
        (lambda df: df.assign(layer=df.layer.where(df.index != 7, 0)),
         lambda df: int(df.index[df.duplicated(["request_id", "position", "layer"])].min()), "layer 0 appears twice"),
        (lambda df: df.assign(position=df.position.where(df.index < 6, 2)), lambda df: first_row_of(df, "b", 2),
         "position 1 of the request is missing"),
    ],
    ids=["missing-layer", "duplicate-layer", "gap"],
)
@pytest.mark.parametrize("batch_rows", [1, 3, 1000])
def test_unsorted_input_names_the_first_bad_row(tmp_path, mutate, flagged, words, batch_rows):
    df = mutate(small_table()).reset_index(drop=True)
    order = [0, *np.random.default_rng(5).permutation(np.arange(1, len(df)))]  # row 0 stays first: same request order
    shuffled = df.iloc[order].reset_index(drop=True)
    path = write_table(shuffled, tmp_path / "bad.parquet")
    with pytest.raises(TraceError) as e:
        import_table_to_dir(path, tmp_path / "out", batch_rows=batch_rows)
    assert f"row {flagged(shuffled) + 1}:" in str(e.value) and words in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == ["bad.parquet"]  # no temporary left


@pytest.mark.parametrize("shuffle", [False, True], ids=["sorted", "shuffled"])
def test_rows_held_at_once_are_bounded_by_batch_rows(tmp_path, monkeypatch, shuffle):
    rng = np.random.default_rng(4)
    trace = random_trace(rng, num_requests=40, with_weights=False)
    df = table_of(trace, rng, shuffle=shuffle)
    path = write_table(df, tmp_path / "t.parquet")
    seen = []
    original = tabular._Grid._check
    monkeypatch.setattr(tabular._Grid, "_check", lambda self, c: (seen.append(len(c["row"])), original(self, c))[1])
    monkeypatch.setattr(tabular, "MIN_MERGE_SLICE", 4)
    batch_rows = 24
    import_table_to_dir(path, tmp_path / "out", batch_rows=batch_rows)
    runs = -(-len(df) // batch_rows)
    bound = max(batch_rows, 4 * runs) + 3  # + the unfinished token carried over (3 layers)
    # (a shuffled table is first read as if sorted, up to its first out-of-order row: some rows are checked twice)
    assert sum(seen) >= len(df) and len(seen) > 3 and max(seen) <= bound, (max(seen), bound)


def test_cli_batch_rows(tmp_path, capsys):
    path = write_table(small_table(), tmp_path / "in.csv")
    assert cli.main([str(path), "--out", str(tmp_path / "a"), "--batch-rows", "3"]) == 0
    assert read_trace(tmp_path / "a").num_tokens == 4
    with pytest.raises(SystemExit) as refused:  # refused while parsing, before anything is read or written
        cli.main([str(path), "--out", str(tmp_path / "b"), "--batch-rows", "0"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "--batch-rows" in err and "got '0'" in err and not (tmp_path / "b").exists()


def test_sigterm_during_import_leaves_no_trace(tmp_path):
    rng = np.random.default_rng(6)
    n = 60_000
    df = pd.DataFrame({"request_id": np.repeat(np.arange(n // 4), 4) // 50, "position": (np.arange(n) // 4) % 50,
                       "layer": np.tile(np.arange(4), n // 4), "token_id": np.repeat(rng.integers(0, 99, n // 4), 4),
                       "experts": [f"[{a}, {a + 1}]" for a in rng.integers(0, 60, n)]})
    df.to_csv(tmp_path / "big.csv", index=False)
    out = tmp_path / "trace"
    proc = subprocess.Popen([sys.executable, "-m", "repro.traces.import", str(tmp_path / "big.csv"), "--out", str(out),
                             "--batch-rows", "200"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not any((p / "experts.npy").exists() for p in tmp_path.glob(".trace.*")):
        time.sleep(0.02)  # until the import is writing the arrays
    assert proc.poll() is None, "the import ended before it could be interrupted; make the input larger"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert proc.returncode != 0
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["big.csv"]
