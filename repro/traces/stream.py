"""Write a routing trace incrementally: its per-token arrays appended chunk by chunk, the whole published at once.

The importer (repro.traces.tabular) cannot hold a production capture in memory, so it appends token_ids,
experts and weights to .npy files as rows arrive and writes the small per-request arrays, requests.json and
meta.json at the end. Everything goes into a repro.atomic.atomic_dir temporary that is renamed into place only
when the trace is complete: a kill at any moment leaves no half trace (the temporary is removed on an exception
and on SIGTERM). The files are byte-identical to what repro.traces.format.write_trace writes for the same trace:
an appended .npy gets np.save's header for its final shape.

Legend: R requests, N tokens, L MoE layers, k experts per token.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from repro.errors import TraceError
from repro.traces.format import (
    ARRAY_DTYPES,
    TRACE_EXTRA_FILES,
    TraceMeta,
    check_trace_destination,
    publish_trace_dir,
    read_trace,
)

HEADER_ROWS_GUESS = 10**12 - 1  # the header space reserved up front is sized for this many rows (np.save pads to 64)
COPY_BYTES = 1 << 24  # chunk of the rare header-resize copy


def npy_header(dtype, shape: tuple[int, ...]) -> bytes:
    """The exact header np.save writes for a C-ordered array of this dtype and shape."""
    out = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
              "shape": tuple(int(s) for s in shape)}  # Python ints: numpy ints would print as np.int64(...)
    np.lib.format.write_array_header_1_0(out, header)
    return out.getvalue()


class NpyAppender:
    """An .npy file filled by appending chunks along axis 0 (chunk: dtype[n, *inner_shape]); close() writes the
    header for the final row count, so the file equals np.save of the concatenated chunks."""

    def __init__(self, path: Path, dtype, inner_shape: tuple[int, ...] = ()) -> None:
        self.path, self.dtype, self.inner_shape, self.rows = Path(path), np.dtype(dtype), tuple(inner_shape), 0
        self._reserved = len(npy_header(self.dtype, (HEADER_ROWS_GUESS, *self.inner_shape)))
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed by close(), possibly much later)
        self._file.write(b"\0" * self._reserved)

    def append(self, chunk: np.ndarray) -> None:
        chunk = np.ascontiguousarray(chunk)
        if chunk.dtype != self.dtype or chunk.shape[1:] != self.inner_shape:
            raise ValueError(f"{self.path.name}: chunk {chunk.dtype}{chunk.shape} does not fit {self.dtype}[n, {self.inner_shape}]")
        if chunk.size:
            self._file.write(memoryview(chunk.reshape(-1)).cast("B"))
        self.rows += len(chunk)

    def close(self) -> None:
        header = npy_header(self.dtype, (self.rows, *self.inner_shape))
        if len(header) == self._reserved:
            self._file.seek(0)
            self._file.write(header)
            self._file.close()
            return
        self._file.close()  # the header needs another size (never for realistic shapes): rewrite the file once
        moved = self.path.with_name(self.path.name + ".data")
        os.replace(self.path, moved)
        with open(moved, "rb") as src, open(self.path, "wb") as dst:
            src.seek(self._reserved)
            dst.write(header)
            shutil.copyfileobj(src, dst, COPY_BYTES)
        moved.unlink()

    def discard(self) -> None:
        self._file.close()


class TraceStreamWriter:
    """Appends a trace's tokens into `directory` (a fresh temporary): append() per chunk of whole tokens, then
    finish() with the per-request tables."""

    def __init__(self, directory: Path, num_layers: int, top_k: int, with_weights: bool) -> None:
        directory = Path(directory)
        self.token_ids = NpyAppender(directory / "token_ids.npy", ARRAY_DTYPES["token_ids"])
        self.experts = NpyAppender(directory / "experts.npy", ARRAY_DTYPES["experts"], (num_layers, top_k))
        self.weights = (NpyAppender(directory / "weights.npy", ARRAY_DTYPES["weights"], (num_layers, top_k))
                        if with_weights else None)
        self.directory = directory

    @property
    def num_tokens(self) -> int:
        return self.token_ids.rows

    def append(self, token_ids: np.ndarray, experts: np.ndarray, weights: np.ndarray | None = None) -> None:
        """token_ids int32[n], experts int16[n, L, k], weights float16[n, L, k] (when the trace has weights)."""
        self.token_ids.append(token_ids)
        self.experts.append(experts)
        if self.weights is not None:
            self.weights.append(weights)

    def finish(self, meta: TraceMeta, lengths: np.ndarray, prefill_len: np.ndarray, request_ids: list[str],
               request_datasets: list[str], request_labels: list[str], extra_files: dict[str, str] | None = None) -> None:
        """Close the arrays and write the rest as write_trace would (lengths, prefill_len: [R])."""
        for appender in (self.token_ids, self.experts, self.weights):
            if appender is not None:
                appender.close()
        d = self.directory
        (d / "meta.json").write_text(json.dumps(meta.to_json(), indent=1))
        (d / "requests.json").write_text(json.dumps({"id": list(request_ids), "dataset": list(request_datasets),
                                                     "label": list(request_labels)}))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(ARRAY_DTYPES["offsets"])
        np.save(d / "offsets.npy", offsets, allow_pickle=False)
        np.save(d / "prefill_len.npy", np.asarray(prefill_len).astype(ARRAY_DTYPES["prefill_len"]), allow_pickle=False)
        for name, text in (extra_files or {}).items():
            if name not in TRACE_EXTRA_FILES:
                raise TraceError(f"a trace cannot hold {name!r}; its extra files are {TRACE_EXTRA_FILES}.")
            (d / name).write_text(text, encoding="utf-8")

    def discard(self) -> None:
        """Close the files of an abandoned attempt (the caller removes or reuses the directory)."""
        for appender in (self.token_ids, self.experts, self.weights):
            if appender is not None:
                appender.discard()


def publish_streamed_trace(path, fill: Callable[[Path], None], *, if_exists: str = "error", validate: bool = True) -> Path:
    """Call fill(tmp) to write a trace into a fresh temporary directory, check it with read_trace (memory-mapped,
    chunked; validate=False skips that re-read for a writer that checked every row on the way in) and publish it
    at `path` in one atomic rename, with write_trace's rules for what is already there (if_exists replace | keep |
    error; anything that is not a trace is refused and never deleted)."""
    path = Path(path)
    if check_trace_destination(path, if_exists) == "trace" and if_exists == "keep":
        return path

    def write_into(tmp: Path) -> None:
        fill(tmp)
        if validate:
            read_trace(tmp)  # the format's own validation, in chunks over the memory-mapped arrays

    return publish_trace_dir(path, write_into, if_exists)
