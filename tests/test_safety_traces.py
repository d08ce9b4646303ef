"""Issue 18 for traces: nothing the suite did not write is deleted, concurrent writers and readers are safe,
SIGTERM leaves no temporary, and bad weights / meta values / empty traces give one sentence."""

import importlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from repro.atomic import atomic_dir
from repro.errors import TraceError
from repro.traces import TraceMeta, make_trace, read_trace, trace_digest, write_trace
from repro.traces.format import trace_dir_state
from repro.traces.tabular import import_table

cli = importlib.import_module("repro.traces.import")


def small_trace(seed=0, num_requests=6, layers=2, num_experts=8, top_k=2, weights=True):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 8, num_requests)
    n = int(lengths.sum())
    meta = TraceMeta(model="toy", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(layers)), vocab_size=50)
    return make_trace(
        meta,
        np.concatenate([[0], np.cumsum(lengths)]),
        rng.integers(0, 50, n),
        np.argsort(rng.random((n, layers, num_experts)), axis=2)[:, :, :top_k],
        weights=rng.random((n, layers, top_k)) if weights else None,
    )


def snapshot(root: Path) -> dict:
    """{relative path: bytes or 'dir'} of everything under root: 'nothing written, nothing deleted' is equality."""
    return {str(p.relative_to(root)): ("dir" if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def one_sentence_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


# ---- the importer never deletes what it did not write --------------------------------------------------------

def importer_csv(path: Path) -> Path:
    rows = [dict(request_id="q", position=p, layer=0, token_id=p, experts=json.dumps([p, 3])) for p in range(2)]
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def make_file(root):
    (root / "out").write_text("my notes")


def make_foreign_dir(root):
    (root / "out").mkdir()
    (root / "out" / "thesis.tex").write_text("years of work")


def make_partial_trace(root):
    (root / "out").mkdir()
    (root / "out" / "meta.json").write_text("{}")


def make_trace_with_foreign_file(root):
    write_trace(small_trace(), root / "out")
    (root / "out" / "notes.txt").write_text("mine")


def make_existing_trace(root):
    write_trace(small_trace(), root / "out")


def make_link(root):
    write_trace(small_trace(), root / "real")
    (root / "out").symlink_to(root / "real")


@pytest.mark.parametrize(
    "prepare, out, input_name, extra_args, message",
    [
        (make_file, "out", "in.csv", [], "is a file"),
        (make_foreign_dir, "out", "in.csv", [], "'thesis.tex', which is not part of a routing trace"),
        (make_partial_trace, "out", "in.csv", [], "lacks offsets.npy"),
        (make_trace_with_foreign_file, "out", "in.csv", ["--overwrite"], "'notes.txt', which is not part"),
        (make_existing_trace, "out", "in.csv", [], "already holds a routing trace; pass --overwrite"),
        (make_link, "out", "in.csv", ["--overwrite"], "symbolic link"),
        (None, ".", "in.csv", ["--overwrite"], "contains the input file"),  # --out is the input's own folder
        (None, "..", "sub/in.csv", ["--overwrite"], "contains the input file"),  # ... or one above it
        (make_existing_trace, "out", "out/in.csv", ["--overwrite"], "contains the input file"),  # input in the trace
    ],
)
def test_importer_refuses_an_out_it_would_destroy(tmp_path, capsys, monkeypatch, prepare, out, input_name,
                                                   extra_args, message):
    root = tmp_path / "root"
    root.mkdir()
    if prepare is not None:
        prepare(root)
    src = root / input_name
    src.parent.mkdir(parents=True, exist_ok=True)
    importer_csv(src)
    monkeypatch.chdir(src.parent)
    before = snapshot(tmp_path)
    assert cli.main([str(src), "--out", str(out if prepare is None else root / out), *extra_args]) == 2
    assert message in one_sentence_error(capsys.readouterr().err)
    assert snapshot(tmp_path) == before  # nothing written, nothing deleted, no temporary left


@pytest.mark.parametrize("prepare", [None, "empty", "trace"])
def test_importer_writes_a_new_or_empty_out_and_replaces_a_trace_only_with_overwrite(tmp_path, capsys, prepare):
    src = importer_csv(tmp_path / "in.csv")
    out = tmp_path / "out"
    if prepare == "empty":
        out.mkdir()
    elif prepare == "trace":
        write_trace(small_trace(), out)
    args = [str(src), "--out", str(out)] + (["--overwrite"] if prepare == "trace" else [])
    assert cli.main(args) == 0, capsys.readouterr().err
    assert read_trace(out).meta.source == "import:in.csv"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.csv", "out"]  # no temporary sibling


# ---- write_trace: what may be replaced or reused -------------------------------------------------------------

def test_write_trace_modes(tmp_path):
    first, second = small_trace(seed=1), small_trace(seed=2)
    path = write_trace(first, tmp_path / "t", if_exists="keep")
    assert trace_digest(read_trace(path)) == trace_digest(first)
    write_trace(second, path, if_exists="keep")  # first writer wins
    assert trace_digest(read_trace(path)) == trace_digest(first)
    with pytest.raises(TraceError, match="already holds a routing trace"):
        write_trace(second, path, if_exists="error")
    write_trace(second, path, if_exists="replace")
    assert trace_digest(read_trace(path)) == trace_digest(second)
    with pytest.raises(TraceError, match="if_exists must be one of"):
        write_trace(second, path, if_exists="overwrite")
    (path / "notes.txt").write_text("mine")
    for mode in ("replace", "keep", "error"):
        with pytest.raises(TraceError, match="never replaced"):
            write_trace(first, path, if_exists=mode)
    assert (path / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


def test_trace_dir_state(tmp_path):
    assert trace_dir_state(tmp_path / "nothing") == ("absent", "")
    (tmp_path / "empty").mkdir()
    assert trace_dir_state(tmp_path / "empty") == ("empty", "")
    write_trace(small_trace(weights=False), tmp_path / "t", extra_files={"vocab.json": "[]"})
    assert trace_dir_state(tmp_path / "t") == ("trace", "")
    with pytest.raises(TraceError, match="cannot add 'notes.txt'"):
        write_trace(small_trace(), tmp_path / "u", extra_files={"notes.txt": ""})
    assert not (tmp_path / "u").exists()


# ---- concurrent writers and a reader -------------------------------------------------------------------------

WORKER = textwrap.dedent(
    """
    import json, sys, time
    from repro.traces import read_trace, trace_digest, write_trace
    role, target, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    deadline = time.monotonic() + seconds
    if role == "writer":
        source, modes = sys.argv[4], sys.argv[5].split(",")
        trace = read_trace(source, mmap=False)
        writes = 0
        while time.monotonic() < deadline:
            write_trace(trace, target, if_exists=modes[writes % len(modes)])
            writes += 1
        print(json.dumps({"writes": writes}))
    else:
        allowed = set(sys.argv[4].split(","))
        reads = before_first = 0
        failures = []
        while time.monotonic() < deadline:
            try:
                digest = trace_digest(read_trace(target))
                reads += 1
                if digest not in allowed:
                    failures.append("read a trace no writer wrote: " + digest)
            except Exception as e:  # noqa: BLE001 - every failure is counted, the test shows the first ones
                if reads == 0 and "is not a trace directory" in str(e):
                    before_first += 1  # nothing published yet
                else:
                    failures.append(f"{type(e).__name__}: {e}")
        print(json.dumps({"reads": reads, "before_first": before_first, "failures": failures[:3],
                          "num_failures": len(failures)}))
    """
)


@pytest.mark.parametrize(
    "sources, modes",
    [
        ("same", ["keep", "replace"]),  # one cache entry written by several jobs (first writer wins, or a swap)
        ("two", ["replace"]),  # different contents swapped in and out: a read must never mix two traces
    ],
)
def test_concurrent_writers_and_a_reader(tmp_path, sources, modes):
    a = small_trace(seed=3, num_requests=60, layers=4)
    b = small_trace(seed=4, num_requests=60, layers=4)
    write_trace(a, tmp_path / "a")
    write_trace(b, tmp_path / "b")
    writer_sources = ["a", "a", "a"] if sources == "same" else ["a", "b", "a"]
    allowed = {trace_digest(a)} | ({trace_digest(b)} if sources == "two" else set())
    target, seconds = tmp_path / "shared" / "trace", 2.5
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def start(*args):
        return subprocess.Popen([sys.executable, "-c", WORKER, *map(str, args)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)

    reader = start("reader", target, seconds + 1.0, ",".join(sorted(allowed)))
    writers = [start("writer", target, seconds, tmp_path / s, ",".join(modes)) for s in writer_sources]
    results = []
    for p in [*writers, reader]:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err  # no writer (nor the reader) died of an error
        results.append(json.loads(out))
    read = results[-1]
    assert read["num_failures"] == 0, read["failures"]
    assert read["reads"] > 5 and all(r["writes"] > 3 for r in results[:-1]), results
    final = read_trace(target)
    assert trace_digest(final) in allowed
    if sources == "same":
        assert trace_digest(final) == trace_digest(a)
    assert sorted(p.name for p in target.parent.iterdir()) == ["trace"]  # every temporary removed


# ---- SIGTERM during an atomic write leaves no temporary ------------------------------------------------------

SIGTERM_CHILD = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    from repro.atomic import atomic_dir, atomic_write
    kind, previous, target = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    # a mask blocking SIGTERM is inherited through exec from whatever thread of the test worker spawned us: clear
    # it, this test is about the writer's handler, not about the worker's state
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if previous == "exit":
        signal.signal(signal.SIGTERM, lambda s, f: sys.exit(3))
    elif previous == "flag":  # graceful shutdown: the program finishes what it is doing
        signal.signal(signal.SIGTERM, lambda s, f: print("flagged", flush=True))

    def slow_write(tmp):
        out = tmp / "part.bin" if tmp.is_dir() else tmp
        out.write_bytes(b"x" * 1000)
        print("writing", flush=True)
        for _ in range(5 if previous == "flag" else 600):  # short sleeps: the handler runs within 0.1 s
            time.sleep(0.1)

    (atomic_dir if kind == "dir" else atomic_write)(target, slow_write)
    print("done", flush=True)
    """
)


@pytest.mark.parametrize(
    "kind, previous, returncode, published",
    [
        ("file", "default", -signal.SIGTERM, False),
        ("dir", "default", -signal.SIGTERM, False),
        ("file", "exit", 3, False),  # the program's own handler exits: the writer's cleanup runs
        ("dir", "exit", 3, False),
        ("file", "flag", 0, True),  # the program's own handler returns: the write completes
    ],
)
def test_sigterm_mid_write_leaves_no_temporary(tmp_path, kind, previous, returncode, published):
    target = tmp_path / "out" / "result"
    child = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_CHILD, kind, previous, str(target)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert child.stdout.readline().strip() == "writing"
    assert any(p.name.startswith(".result.") for p in (tmp_path / "out").iterdir())  # the temporary is there
    child.send_signal(signal.SIGTERM)
    try:
        out, err = child.communicate(timeout=45)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        pytest.fail(f"the writer outlived SIGTERM by 45 s; its output: {out!r} {err!r}")
    assert child.returncode == returncode, err
    assert ("flagged" in out) == (previous == "flag")  # the program's own handler ran
    assert [p.name for p in (tmp_path / "out").iterdir()] == (["result"] if published else [])


def test_atomic_dir_first_writer_wins_and_cleans_up_on_error(tmp_path):
    def writes(text):
        return lambda d: (d / "x").write_text(text)

    assert atomic_dir(tmp_path / "d", writes("1")) is True
    assert atomic_dir(tmp_path / "d", writes("2")) is False
    assert (tmp_path / "d" / "x").read_text() == "1"
    inode = os.stat(tmp_path / "d").st_ino
    assert atomic_dir(tmp_path / "d", writes("3"), replace=True) is True
    assert (tmp_path / "d" / "x").read_text() == "3" and os.stat(tmp_path / "d").st_ino != inode
    with pytest.raises(ZeroDivisionError):
        atomic_dir(tmp_path / "d", lambda d: 1 / 0, replace=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"] and (tmp_path / "d" / "x").read_text() == "3"


# ---- gate weights, meta value types, empty traces: one sentence ------------------------------------------------

@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e6])
def test_make_trace_rejects_non_finite_or_overflowing_weights(bad):
    t = small_trace()
    weights = np.array(t.weights, dtype=np.float64)
    weights[3, 1, 0] = bad
    with pytest.raises(TraceError, match=r"token 3|\(3, 1, 0\)") as e:
        make_trace(t.meta, t.offsets, t.token_ids, t.experts, weights=weights)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_read_trace_rejects_non_finite_weights(tmp_path, bad):
    write_trace(small_trace(), tmp_path / "t")
    weights = np.load(tmp_path / "t" / "weights.npy")
    weights[2, 0, 1] = bad
    np.save(tmp_path / "t" / "weights.npy", weights)
    with pytest.raises(TraceError, match="gate weight of token 2 at MoE layer index 0 .slot 1. is"):
        read_trace(tmp_path / "t")


@pytest.mark.parametrize(
    "suffix, bad, message",
    [
        (".parquet", float("nan"), "has a NaN or infinite weight"),
        (".parquet", float("inf"), "has a NaN or infinite weight"),
        (".parquet", 1e6, "beyond the float16 range"),
        (".csv", 1e6, "beyond the float16 range"),
    ],
)
def test_importer_rejects_bad_weights_naming_the_row(tmp_path, suffix, bad, message):
    rows = [dict(request_id="q", position=p, layer=0, token_id=p, experts=[p, 3], weights=[0.5, 0.5]) for p in range(3)]
    rows[1]["weights"] = [0.5, bad]
    df = pd.DataFrame(rows)
    path = tmp_path / f"in{suffix}"
    if suffix == ".csv":
        df.assign(experts=df.experts.map(json.dumps), weights=df.weights.map(json.dumps)).to_csv(path, index=False)
    else:  # through pyarrow: pandas would store NaN in a list as null
        pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(TraceError, match=message) as e:
        import_table(path)
    assert ("line 3:" if suffix == ".csv" else "row 2:") in str(e.value)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_experts", "abc", "num_experts is 'abc'; it must be an integer"),
        ("top_k", 2.5, "top_k is 2.5; it must be an integer"),
        ("vocab_size", None, "vocab_size is None; it must be an integer"),
        ("num_experts", True, "num_experts is True; it must be an integer"),
        ("layer_ids", ["a", 1], "layer_ids holds 'a'"),
        ("layer_ids", [0, 1.5], "layer_ids holds 1.5"),
        ("layer_ids", [0, -1], "layer_ids holds -1"),
        ("layer_ids", "0,1", "layer_ids is '0,1'; it must be a list"),
        ("dense_layers", {"a": 1}, "dense_layers is"),
        ("model", 7, "model is 7; it must be a string"),
        ("extra", [], "extra is []; it must be an object"),
        ("format_version", 2, "format_version 2"),
        ("model", "DELETE", "missing 1 required positional argument"),
    ],
)
def test_meta_json_value_types_give_one_sentence(tmp_path, field, value, message):
    write_trace(small_trace(), tmp_path / "t")
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    if value == "DELETE":
        del meta[field]
    else:
        meta[field] = value
    (tmp_path / "t" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(TraceError, match=None) as e:
        read_trace(tmp_path / "t")
    assert message in str(e.value) and "meta.json" in str(e.value) and "\n" not in str(e.value)


def test_meta_json_that_is_not_an_object(tmp_path):
    write_trace(small_trace(), tmp_path / "t")
    (tmp_path / "t" / "meta.json").write_text("[1, 2]")
    with pytest.raises(TraceError, match="holds a JSON list, not an object"):
        read_trace(tmp_path / "t")


@pytest.mark.parametrize("offsets", [[0], [0, 0], [0, 0, 0]])
def test_zero_token_trace_is_one_sentence(tmp_path, offsets):
    meta = small_trace().meta
    empty = dict(offsets=offsets, token_ids=np.zeros(0, np.int32), experts=np.zeros((0, meta.num_layers, meta.top_k)))
    with pytest.raises(TraceError, match="no tokens"):
        make_trace(meta, **empty)
    # the same on disk (written by hand: write_trace refuses it)
    write_trace(small_trace(), tmp_path / "t")
    np.save(tmp_path / "t" / "offsets.npy", np.asarray(offsets, np.int64))
    np.save(tmp_path / "t" / "token_ids.npy", np.zeros(0, np.int32))
    np.save(tmp_path / "t" / "experts.npy", np.zeros((0, meta.num_layers, meta.top_k), np.int16))
    np.save(tmp_path / "t" / "prefill_len.npy", np.zeros(len(offsets) - 1, np.int32))
    (tmp_path / "t" / "weights.npy").unlink()
    n = len(offsets) - 1
    (tmp_path / "t" / "requests.json").write_text(json.dumps({"id": [str(i) for i in range(n)], "dataset": [""] * n,
                                                              "label": [""] * n}))
    with pytest.raises(TraceError, match=f"the trace has {n} requests and no tokens"):
        read_trace(tmp_path / "t")



def test_a_destination_swapped_while_it_is_listed_is_listed_again(tmp_path, monkeypatch):
    """A writer's check can list the old directory while another writer's swap deletes it: the half-deleted
    listing must not be taken for 'not a trace' (seen once in a full run of test_concurrent_writers_and_a_reader)."""
    from repro.traces import format as trace_format

    write_trace(small_trace(seed=3, num_requests=4, layers=2), tmp_path / "t")
    identities = iter([(1, 1), (1, 2), (1, 2), (1, 2)])  # swapped during the first listing, stable after
    listings = iter([("other", "lacks meta.json, so it is not a complete routing trace"), ("trace", "")])
    monkeypatch.setattr(trace_format, "_dir_identity", lambda path: next(identities))
    monkeypatch.setattr(trace_format, "_trace_dir_state_once", lambda path: next(listings))
    assert trace_format.trace_dir_state(tmp_path / "t") == ("trace", "")
