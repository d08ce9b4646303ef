"""repro.traces.digest: a trace folder's digest, computed once and cached beside its files for every later process;
a changed trace invalidates the cache, and a stale, malformed or forged cache is never used."""

import json
import os

import numpy as np
import pytest
from test_run import synthetic_trace_dir

from repro.traces import digest as digest_mod
from repro.traces import read_trace, trace_digest, write_trace
from repro.traces.digest import DIGEST_CACHE, dir_digest, file_states


@pytest.fixture
def trace(tmp_path):
    digest_mod.clear_process_cache()  # each test starts as a fresh process would
    yield synthetic_trace_dir(tmp_path / "trace")
    digest_mod.clear_process_cache()


def fresh_process_digest(path, monkeypatch=None, hashing_allowed: bool = True) -> str:
    """dir_digest as a new process computes it (no in-process memory); with hashing_allowed=False, hashing the
    trace fails the test (the digest must come from the cache)."""
    digest_mod.clear_process_cache()
    if not hashing_allowed:
        monkeypatch.setattr(digest_mod, "trace_digest", lambda t: pytest.fail("the trace was hashed again"))
    try:
        return dir_digest(path)
    finally:
        if monkeypatch is not None:
            monkeypatch.undo()


def test_the_digest_is_the_traces_and_a_later_process_reads_it_from_the_cache(trace, monkeypatch):
    expected = trace_digest(read_trace(trace))
    assert dir_digest(trace) == expected
    cache = json.loads((trace / DIGEST_CACHE).read_text())
    assert cache["digest"] == expected and [f[0] for f in cache["files"]] == sorted(
        p.name for p in trace.iterdir() if not p.name.startswith("."))
    assert fresh_process_digest(trace, monkeypatch, hashing_allowed=False) == expected


def edit_in_place(path, keep_mtime: bool) -> None:
    """Change one expert of experts.npy in place (same file, same size), optionally setting its mtime back."""
    before = path.stat()
    experts = np.load(path)
    experts[0, 0, 0] = (experts[0, 0, 0] + 1) % 16
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.seek(os.path.getsize(path) - experts.nbytes)
        f.write(experts.tobytes())
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert not keep_mtime or after.st_mtime_ns == before.st_mtime_ns


@pytest.mark.parametrize("how", ["rewritten", "edited in place", "edited in place, mtime set back"])
def test_a_changed_trace_invalidates_its_cache(trace, how):
    old = dir_digest(trace)
    if how == "rewritten":
        experts = np.load(trace / "experts.npy")
        experts[-1, -1, -1] = (experts[-1, -1, -1] + 1) % 16
        np.save(trace / "experts.npy", experts)
    else:
        edit_in_place(trace / "experts.npy", keep_mtime=how.endswith("set back"))
    new = fresh_process_digest(trace)
    assert new != old and new == trace_digest(read_trace(trace))
    assert json.loads((trace / DIGEST_CACHE).read_text())["digest"] == new  # the cache now holds the new state's


def test_a_stale_malformed_or_forged_cache_is_never_used(trace):
    true = dir_digest(trace)
    states = [list(s) for s in file_states(trace)]
    stale = [s if s[0] != "experts.npy" else [*s[:2], s[2] - 1, *s[3:]] for s in states]  # another mtime
    for cache in ({"format": "semmoe-trace-digest", "version": 1, "files": stale, "digest": "0" * 16},
                  {"format": "semmoe-trace-digest", "version": 1, "files": states[:-1], "digest": "0" * 16},
                  {"format": "semmoe-trace-digest", "version": 1, "files": states, "digest": "not hex"},
                  {"format": "other", "version": 1, "files": states, "digest": "0" * 16},
                  "[" * 5000, "\xff"):
        (trace / DIGEST_CACHE).write_text(cache if isinstance(cache, str) else json.dumps(cache))
        assert fresh_process_digest(trace) == true, cache


def test_a_trace_folder_it_cannot_write_is_hashed_without_a_cache(trace, monkeypatch):
    def refuse(path, text):
        raise PermissionError(13, "Permission denied")  # a read-only shared data set (root ignores chmod)

    monkeypatch.setattr(digest_mod, "atomic_write_text", refuse)
    assert dir_digest(trace) == trace_digest(read_trace(trace))
    assert not (trace / DIGEST_CACHE).exists()


def test_a_trace_folder_holding_its_cache_is_still_a_trace_to_replace(trace):
    dir_digest(trace)
    assert (trace / DIGEST_CACHE).exists()
    (trace / f".{DIGEST_CACHE}.host-1-abc").write_text("a killed cache writer's temporary")
    write_trace(read_trace(trace), trace, if_exists="replace")  # was refused: "holds '.digest.json'"
    assert not (trace / DIGEST_CACHE).exists()  # the replaced trace's cache went with it
