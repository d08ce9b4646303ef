"""The digest of a trace directory (trace_digest: every byte of its routing), computed once and cached in the
directory itself, so that each of many processes (one count job per shard, then the merge) need not re-hash the
whole trace.

    dir_digest("traces/day/shard_03")  # -> 16 hex chars, = trace_digest(read_trace(...))

The cache is `<trace>/.digest.json`: {"format", "version", "files": [[name, size, mtime_ns, ctime_ns, inode, device],
...] of every trace file, "digest"}. It is used only while every file still has the state it records; any change
(a rewrite, an atomic replacement: a new inode; an edit in place, even one whose mtime was set back: the ctime moves)
makes it stale, and a stale, unreadable or malformed cache is never trusted: the digest is computed again and the
cache rewritten. The digest is written only when the files did not change while they were hashed. A trace
directory this user cannot write is hashed each time (once per process: the in-process cache below). The cache is
part of the trace folder (repro.traces.format.TRACE_FILES): a trace replaced as a folder takes its cache with it.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from repro.atomic import atomic_write_text
from repro.errors import TraceError
from repro.traces.format import DIGEST_CACHE, read_trace
from repro.traces.ops import trace_digest

FORMAT, VERSION = "semmoe-trace-digest", 1
_HEX16 = re.compile(r"[0-9a-f]{16}")


def file_states(directory: str | Path) -> tuple[tuple, ...]:
    """(name, size, mtime_ns, ctime_ns, inode, device) of each file of the trace at `directory`, by name; hidden
    files (the cache itself, temporaries) are not the trace's."""
    directory = Path(directory)
    try:
        files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
        stats = [(p.name, p.stat()) for p in files]
    except OSError as e:
        raise TraceError(f"cannot read the trace {directory} ({e.strerror or e}); is it a complete trace?") from e
    return tuple((name, s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino, s.st_dev) for name, s in stats)


def dir_digest(directory: str | Path) -> str:
    """trace_digest of the trace at `directory`, from its cache when the cache matches the files' state."""
    directory = Path(directory).resolve()
    return _digest(str(directory), file_states(directory))


def cached_digest(directory: str | Path, states: tuple[tuple, ...]) -> str | None:
    """The digest the cache of `directory` holds for exactly these file states; None when absent, unreadable,
    malformed or stale."""
    try:
        cache = json.loads((Path(directory) / DIGEST_CACHE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(cache, dict) or cache.get("format") != FORMAT or cache.get("version") != VERSION:
        return None
    digest = cache.get("digest")
    if cache.get("files") != [list(s) for s in states] or not isinstance(digest, str) or not _HEX16.fullmatch(digest):
        return None
    return digest


@functools.lru_cache(maxsize=256)
def _digest(directory: str, states: tuple[tuple, ...]) -> str:
    """The digest of the trace whose files are in `states` (lru: a process asks for each shard several times)."""
    digest = cached_digest(directory, states)
    if digest is not None:
        return digest
    digest = trace_digest(read_trace(directory))
    if file_states(directory) == states:  # the files did not change while hashed: the digest is of `states`
        cache = {"format": FORMAT, "version": VERSION, "files": [list(s) for s in states], "digest": digest}
        try:
            atomic_write_text(Path(directory) / DIGEST_CACHE, json.dumps(cache) + "\n")
        except OSError:  # a read-only trace (a shared data set): hashed again by the next process, still exact
            pass
    return digest


def clear_process_cache() -> None:
    """Forget this process's digests (tests: a fresh process)."""
    _digest.cache_clear()
