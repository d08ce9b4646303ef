"""Row-chunked access to trace arrays: `ConcatArray` (several arrays read as one, for sharded traces), chunk
ranges, and releasing memory-mapped pages after a chunk so a pass over a big trace keeps a bounded RSS.

Legend: S parts, N rows.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import numpy as np

from repro.errors import TraceError


class LazyRows(np.lib.mixins.NDArrayOperatorsMixin):
    """A read-only array-like whose rows (axis 0) are read on demand: shape, dtype, ndim, len; indexing whose first
    key is an int, a slice or an int/bool array (further keys applied to the rows read); np.asarray materialises
    every row; ufuncs and operators such as == work through np.asarray. Subclasses read rows with `_take`."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None):
        out = self._range(0, len(self), ())
        out = np.array(out) if isinstance(out, np.memmap) else np.asarray(out)
        return out if dtype is None else out.astype(dtype, copy=False)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if any(isinstance(x, LazyRows) for x in kwargs.get("out", ())):
            raise TraceError(f"a {type(self).__name__} is read-only; it cannot be a ufunc's output.")
        inputs = tuple(np.asarray(x) if isinstance(x, LazyRows) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def min(self):
        return min(self[a:b].min() for a, b in iter_row_chunks(len(self), CHUNK_ROWS))

    def max(self):
        return max(self[a:b].max() for a, b in iter_row_chunks(len(self), CHUNK_ROWS))

    def astype(self, dtype, copy: bool = True):
        return np.asarray(self).astype(dtype)

    def reshape(self, *shape):
        return np.asarray(self).reshape(*shape)

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        first, rest = key[0], key[1:]
        if first is Ellipsis or first is None or any(k is Ellipsis or isinstance(k, (list, np.ndarray)) for k in rest):
            return np.asarray(self)[key]  # rare forms: index the materialised rows
        if isinstance(first, (int, np.integer)):
            row = int(first) + (len(self) if first < 0 else 0)
            if not 0 <= row < len(self):
                raise IndexError(f"index {int(first)} is out of bounds for axis 0 with size {len(self)}")
            return self._take(np.array([row]), rest)[0]
        if isinstance(first, slice):
            start, stop, step = first.indices(len(self))
            if step == 1:
                return self._range(start, max(start, stop), rest)
            first = np.arange(start, stop, step)
        index = np.asarray(first)
        if index.dtype == bool:
            if index.shape != (len(self),):
                raise IndexError(f"boolean index of shape {index.shape} does not match axis 0 of size {len(self)}")
            index = np.flatnonzero(index)
        rows = index.astype(np.int64, copy=False).ravel()
        rows = np.where(rows < 0, rows + len(self), rows)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"index out of bounds for axis 0 with size {len(self)}")
        out = self._take(rows, rest)
        return out.reshape(*index.shape, *out.shape[1:])

    def _range(self, start: int, stop: int, rest: tuple) -> np.ndarray:
        """Rows start:stop, then `rest`."""
        return self._take(np.arange(start, stop), rest)

    def _take(self, rows: np.ndarray, rest: tuple) -> np.ndarray:
        """Rows int64[n] (in range, in that order), then `rest`."""
        raise NotImplementedError


CHUNK_ROWS = 1 << 16  # rows per step of min / max


class ConcatArray(LazyRows):
    """Read-only concatenation along axis 0 of arrays (memory maps) with one dtype and trailing shape; an index
    touches only the parts holding the rows it selects. parts: arrays of shapes [n_s, ...]; starts int64[S+1] the
    first row of each part."""

    def __init__(self, parts):
        self.parts = tuple(parts)
        if not self.parts:
            raise TraceError("a ConcatArray needs at least one part.")
        self.dtype = self.parts[0].dtype
        tail = self.parts[0].shape[1:]
        for p in self.parts:
            if p.dtype != self.dtype or p.shape[1:] != tail:
                raise TraceError(f"cannot concatenate arrays of {p.dtype}{p.shape} and {self.dtype}{self.parts[0].shape}.")
        self.starts = np.concatenate([[0], np.cumsum([len(p) for p in self.parts])]).astype(np.int64)
        self.shape = (int(self.starts[-1]), *tail)

    def __repr__(self) -> str:
        return f"ConcatArray({self.dtype}{self.shape}, {len(self.parts)} parts)"

    def min(self):
        return min(p.min() for p in self.parts)

    def max(self):
        return max(p.max() for p in self.parts)

    def _range(self, start: int, stop: int, rest: tuple) -> np.ndarray:
        lo = max(int(np.searchsorted(self.starts, start, side="right")) - 1, 0)
        hi = max(int(np.searchsorted(self.starts, stop, side="left")), lo + 1)
        pieces = [
            self.parts[s][(slice(max(start - self.starts[s], 0), min(stop, self.starts[s + 1]) - self.starts[s]), *rest)]
            for s in range(lo, min(hi, len(self.parts)))
        ]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _take(self, rows: np.ndarray, rest: tuple) -> np.ndarray:
        part_of = np.searchsorted(self.starts, rows, side="right") - 1
        tail = self.parts[0][(np.zeros(0, dtype=np.int64), *rest)].shape[1:]
        out = np.empty((len(rows), *tail), dtype=self.dtype)
        order = np.argsort(part_of, kind="stable")
        bounds = np.searchsorted(part_of[order], np.arange(len(self.parts) + 1))
        for s in np.flatnonzero(np.diff(bounds)):
            sel = order[bounds[s] : bounds[s + 1]]
            out[sel] = self.parts[s][(rows[sel] - self.starts[s], *rest)]
        return out


class RowsView(LazyRows):
    """Rows `rows` int64[n] of `base` (an array, memory map or LazyRows), read only when indexed: a request subset
    of a big trace without copying its routing. A run of consecutive rows is read as one slice of base."""

    def __init__(self, base, rows: np.ndarray):
        self.base, self.rows = base, np.asarray(rows, dtype=np.int64)
        self.dtype, self.shape = base.dtype, (len(self.rows), *base.shape[1:])

    def __repr__(self) -> str:
        return f"RowsView({self.dtype}{self.shape} of {self.base!r})"

    def _range(self, start: int, stop: int, rest: tuple) -> np.ndarray:
        rows = self.rows[start:stop]
        if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and np.all(np.diff(rows) == 1):
            return self.base[(slice(int(rows[0]), int(rows[-1]) + 1), *rest)]
        return self._take(np.arange(start, stop), rest)

    def _take(self, rows: np.ndarray, rest: tuple) -> np.ndarray:
        return np.asarray(self.base[(self.rows[rows], *rest)])


def array_parts(array) -> tuple:
    """The arrays whose rows make up `array`: its parts for a ConcatArray, its base's for a RowsView, else (array,)."""
    if isinstance(array, ConcatArray):
        return array.parts
    return array_parts(array.base) if isinstance(array, RowsView) else (array,)


def release_pages(array) -> None:
    """Drop `array`'s memory-mapped pages from this process's resident set (no-op for in-memory arrays).

    Reading a memory-mapped trace row by row keeps every page it touched resident (counted in RSS) until the
    kernel needs the memory; chunked readers call this after each chunk so their RSS stays at the chunk's size.
    The pages stay in the page cache: a later read costs a page-table fault, not a disk read.
    """
    for part in array_parts(array):
        handle = getattr(part, "_mmap", None)  # numpy's memmap keeps its mmap.mmap here (its base chain's root)
        if isinstance(handle, mmap.mmap) and hasattr(handle, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            try:
                handle.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):  # a closed map or a platform without it: residency is only a cost
                pass


def iter_row_chunks(num_rows: int, chunk_rows: int) -> Iterator[tuple[int, int]]:
    """(start, stop) ranges of at most chunk_rows rows covering 0..num_rows."""
    if chunk_rows < 1:
        raise TraceError(f"chunk size must be >= 1 row, got {chunk_rows}.")
    for start in range(0, num_rows, chunk_rows):
        yield start, min(start + chunk_rows, num_rows)
