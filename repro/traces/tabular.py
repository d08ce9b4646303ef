"""Import routing traces kept in tabular form (CSV, JSONL, Parquet) into a trace directory, streaming.

Other tools (SGLang/vLLM dumps post-processed with pandas, FLAME-MoE-style parquet, hand-written CSV) keep
routing as one row per (request, position, layer):

    request_id  position  layer  token_id | token   experts      [weights]          [label]
    "q1"        0         0      415                "[3, 5]"     "[0.61, 0.39]"     "physics"

`experts` is a list of expert ids (a JSON-encoded string "[3, 5]" in CSV, a list in JSONL and Parquet), the
token is an id (`token_id`, an integer column) or a surface string (`token`, mapped to ids through a
vocabulary built on import in order of first appearance), `weights` are optional gate weights and `label` an
optional per-request class. Generated-token routing: an optional `phase` column ("prefill" or "decode" per
token; a request's prefill tokens come first) or `prefill_len` column (the request's prompt length, the same on
all its rows) sets the trace's prefill_len; without either every token is prompt. Rows may come in any order;
the trace holds them sorted by (request, position, layer), with requests kept in order of first appearance.
Arrival order: an optional `arrival_time` column (seconds, a finite number >= 0, the same on all of a request's
rows) is kept in the trace directory as arrival_time.json (`read_arrival_times`); the rule is that requests appear
in the file in arrival order (each request's arrival time >= the one before it, ties allowed), so the trace's
request order is the order they are served in (the drift experiment's windows follow it). A file listing a request
before an earlier arrival is refused: sort its requests by arrival time.

Streaming: the file is read in batches of at most `batch_rows` rows (pyarrow.csv.open_csv, pyarrow.json.open_json
in blocks of about batch_rows / 16 lines gathered into batches, since pyarrow reads dozens of blocks ahead;
ParquetFile.iter_batches) and the trace's arrays are appended to .npy files as whole tokens complete
(repro.traces.stream), inside a temporary directory renamed into place only at the end. Input already in
(request, position, layer) order -- what capture tools write -- is imported in one pass. Input in any other
order is detected at its first out-of-order row; the import then starts again as a bounded external sort: each
batch is parsed, checked, sorted and spilled as a run of .npy files into the destination's temporary directory
(about 36 + 2k (+ 2k with weights) bytes per row on disk), and the runs are merged in slices whose total is
about batch_rows rows. Peak memory is therefore bounded by batch_rows, whatever the file size, besides
O(requests) tables (ids, labels, lengths) and the O(vocabulary) surface-string table. A Parquet row group is
decoded whole by pyarrow: files written with huge row groups need memory for one of them. The trace is
byte-identical to write_trace of the same rows (and to the whole-table importer this replaced). CSV cells are
read as text and parsed per batch (Arrow's integer cast; pandas only for cells it refuses), so a bad cell is
reported as the row it is on; the "[3, 5]" expert lists are parsed by a compiled pass (repro.traces.int_lists).
Measured 2026-12-01 (bench/bench_traces.py, 2 cores, default batch_rows, process start-up included): sorted
DeepSeek-V3-shaped tables of 10 M rows import at 1.54 M rows/s from Parquet and 1.10 M rows/s from CSV, of 50 M
rows at 1.44 and 1.05 M rows/s, at <= 0.5 GB peak RSS; a 1 M-row file takes 2-3 s, about 1 s of it start-up.

Validation: every (request, position) has every layer exactly once, positions are 0..len-1, every expert list
has the same length k with no repeated id and no negative id, weights (if any) match the experts and are finite
within float16's range, a token is the same at all its layers and a request has one label. A problem raises
TraceError naming the first bad row of the input (CSV: the line number in the file, the header being line 1;
JSONL: the line number; Parquet: the 1-based row number) and what is wrong; nothing is written. Checks run
vectorised per batch; a check that spans rows (a token's layers, a request's positions) runs when the token is
complete. A bad cell stops the import at the end of the request holding it; a problem across rows is reported
after the whole file was read (a later row could show the file unsorted, and the problem spurious). A bad
request, position, layer or token cell is reported as soon as its batch is read (the checks across rows need
clean keys); problems with prefill_len or phase are reported only when nothing else is wrong. Line numbers are
worked out only on the error path.

Legend: n rows of the table, N tokens (= n / L), L MoE layers, k experts per token, R requests.
"""

from __future__ import annotations

import csv
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from repro.errors import TraceError
from repro.traces.format import FLOAT16_MAX, RoutingTrace, TraceMeta, read_trace
from repro.traces.stream import TraceStreamWriter, publish_streamed_trace

SUFFIX_FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
INT_LIST_PATTERN = r"^\s*\[\s*(-?\d+\s*(,\s*-?\d+\s*)*)?\]\s*$"
FLOAT = r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?"
FLOAT_LIST_PATTERN = rf"^\s*\[\s*({FLOAT}\s*(,\s*{FLOAT}\s*)*)?\]\s*$"
DEFAULT_BATCH_ROWS = 250_000
MIN_BATCH_ROWS = 1
MIN_MERGE_SLICE = 64  # rows taken from each run per merge step, however many runs there are
BLOCK_SAMPLE_BYTES = 1 << 20  # read to estimate a CSV/JSONL line's length, which sizes the reader's blocks
# pyarrow's CSV/JSON readers read blocks ahead of the consumer (dozens of them when parsing lags): blocks of
# batch_rows / READ_AHEAD_BLOCKS rows keep that read-ahead near a few batches; they are gathered into batches
READ_AHEAD_BLOCKS = 16
INT32_MAX = int(np.iinfo(np.int32).max)
NO_ROW = np.iinfo(np.int64).max
# pyarrow.csv's default null spellings: a CSV cell read as text counts as empty when it is one of these
CSV_NULLS = ("", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "N/A", "NA",
             "NULL", "NaN", "n/a", "nan", "null")


@dataclass(frozen=True)
class ImportResult:
    """What import_table_to_dir wrote: its meta, sizes, the surface-string vocabulary (or None) and whether the
    input was already in (request, position, layer) order (one pass) or needed the external sort."""

    meta: TraceMeta
    num_requests: int
    num_tokens: int
    vocab: list[str] | None
    sorted_input: bool


def import_table(path, **options) -> RoutingTrace:
    """Read a tabular routing trace into a validated in-memory RoutingTrace (options: import_table_with_vocab)."""
    return import_table_with_vocab(path, **options)[0]


def import_table_with_vocab(path, *, batch_rows: int = DEFAULT_BATCH_ROWS, **options) -> tuple[RoutingTrace, list[str] | None]:
    """Read a tabular routing trace into memory; returns (trace, vocabulary or None). The import streams into a
    temporary trace directory (see import_table_to_dir for the options) that is read back whole: for files
    larger than memory use import_table_to_dir and read_trace's memory map."""
    with tempfile.TemporaryDirectory(prefix="repro_import.") as tmp:
        result = import_table_to_dir(path, Path(tmp) / "trace", batch_rows=batch_rows, **options)
        return read_trace(Path(tmp) / "trace", mmap=False), result.vocab


def import_table_to_dir(path, out, *, if_exists: str = "error", batch_rows: int = DEFAULT_BATCH_ROWS,
                        **options) -> ImportResult:
    """Stream a tabular routing trace into the trace directory `out` (published atomically; if_exists as in
    write_trace: error | replace | keep).

    Options: format csv | jsonl | parquet (default: from the file suffix); model, dataset (default: the file's
    stem), tokenizer; num_experts (default: largest expert id + 1), top_k (default: the first row's list length),
    vocab_size (default: largest token id + 1) -- meta.extra records which were inferred; token_col (default
    `token_id` if present, else `token`; an integer column holds ids, a string column surface strings, whose
    vocabulary, entry i = string of id i, is saved as vocab.json and named in meta.tokenizer); request_col,
    position_col, layer_col, experts_col; weights_col, label_col, phase_col, prefill_len_col (default: the
    columns `weights`, `label`, `phase`, `prefill_len` when present; at most one of phase and prefill_len);
    arrival_col (default `arrival_time` when present: kept as arrival_time.json, requests in arrival order).
    batch_rows bounds the rows held in memory at once.
    """
    if not isinstance(batch_rows, int) or batch_rows < MIN_BATCH_ROWS:
        raise TraceError(f"batch_rows is {batch_rows!r}; use an integer of at least {MIN_BATCH_ROWS}.")
    importer = _Importer(Path(path), batch_rows, **options)  # resolves the columns: bad ones are refused here
    result: list[ImportResult] = []

    def fill(tmp: Path) -> None:
        nonlocal importer
        try:
            result.append(importer.run(tmp, sorted_pass=True))
        except _Unsorted:
            importer.discard()
            importer = _Importer(Path(path), batch_rows, **options)
            result.append(importer.run(tmp, sorted_pass=False))

    # every row was checked on the way in (the checks cover the format's validation), so the published trace is
    # not read back: that re-read would add about half the import's time
    publish_streamed_trace(out, fill, if_exists=if_exists, validate=False)
    return result[0]


class _Unsorted(Exception):
    """The input left (request, position, layer) order: the one-pass import gives way to the external sort."""


# ---- problems: the first bad row wins -------------------------------------------------------------------------

class _Problems:
    """The earliest problem seen, by (row, stage, order of the check); stage 0 = a row's own cells, 1 = a token's
    rows together, 2 = a request's label, 3 = prefill_len / phase (reported only when nothing else is wrong)."""

    def __init__(self) -> None:
        self.main: tuple | None = None
        self.late: tuple | None = None
        self.rowwise: tuple | None = None  # the earliest of stage 0

    def add(self, row: int, stage: int, order: int, what: str) -> None:
        key = (int(row), stage, order, what)
        if stage == 0:
            self.rowwise = key if self.rowwise is None or key < self.rowwise else self.rowwise
        if stage < 3:
            self.main = key if self.main is None or key < self.main else self.main
        else:
            self.late = key if self.late is None or key < self.late else self.late

    def first_of(self, bad: np.ndarray, rows: np.ndarray, stage: int, order: int, what) -> None:
        """Record the item of bad[m] with the smallest file row rows[m] (message what(item))."""
        if bad.any():
            i = int(np.argmin(np.where(bad, rows, NO_ROW)))
            self.add(rows[i], stage, order, what(i))


class _BatchChecks:
    """Per-row checks of one batch: each check records its first bad row, in the order the checks run."""

    def __init__(self, problems: _Problems, row0: int) -> None:
        self.problems, self.row0, self.count, self.found = problems, row0, 0, False

    def first(self, bad: np.ndarray, what) -> None:
        """Record the first True row of bad[n] with the message what(row in batch)."""
        self.count += 1
        if bad.any():
            r = int(np.argmax(bad))
            self.problems.add(self.row0 + r, 0, self.count, what(r))
            self.found = True


# ---- reading in batches ---------------------------------------------------------------------------------------

def _format_of(path: Path, fmt: str | None) -> str:
    if fmt is not None:
        if fmt not in ("csv", "jsonl", "parquet"):
            raise TraceError(f"unknown table format {fmt!r}; use csv, jsonl or parquet.")
        return fmt
    if path.suffix.lower() not in SUFFIX_FORMATS:
        raise TraceError(f"cannot tell the format of {path} from its suffix; pass --format csv|jsonl|parquet.")
    return SUFFIX_FORMATS[path.suffix.lower()]


def _unreadable(path: Path, fmt: str, e: Exception) -> TraceError:
    return TraceError(f"{path} cannot be read as {fmt} ({str(e).splitlines()[0]}); fix the file or pass --format.")


def _block_bytes(path: Path, rows: int) -> int:
    """Reader block size holding about `rows` lines, from the average line length of the file's start."""
    with open(path, "rb") as f:
        sample = f.read(BLOCK_SAMPLE_BYTES)
    per_line = len(sample) / max(1, sample.count(b"\n"))
    return int(min(max(rows * per_line, 1 << 16), (1 << 31) - 1))


MAX_JSON_DEPTH = 32  # a routing row is flat (experts maybe a list of lists): depth 3
DEPTH_SCAN_BYTES = 8 << 20  # per numpy pass: a few int32 arrays of this length (~100 MB), whatever the file's size


def check_json_depth(path: Path, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse a JSON Lines file with a value nested deeper than `limit` ([ and { outside strings), streaming.

    pyarrow's JSON reader recurses per level: a value nested 50,000 deep crashed the process (segfault) and
    10,000 deep ran for minutes. The file is read as pyarrow reads it (a .gz / .bz2 / .zst / .lz4 name is
    decompressed: a compressed file once skipped this check) in whole lines; a block whose lines open at most
    `limit` brackets each (strings included: an upper bound) passes at once, any other is scanned exactly."""
    lines = 0
    for chunk in _line_blocks(path):
        b = np.frombuffer(chunk, dtype=np.uint8)
        opens = (b == ord("[")) | (b == ord("{"))
        if _most_opens_on_a_line(b, opens) > limit and (at := _first_too_deep(b, opens, limit)) >= 0:
            line = lines + chunk.count(b"\n", 0, at) + 1
            raise TraceError(
                f"{path} nests a value more than {limit} levels deep (line {line}); "
                "a routing table's rows are flat: fix the file or export it again."
            )
        lines += chunk.count(b"\n")


def _line_blocks(path: Path) -> Iterator[bytes]:
    """The file's bytes, decompressed as pyarrow's readers decompress them, in blocks of whole lines of about
    DEPTH_SCAN_BYTES (a longer line is one block)."""
    with pa.input_stream(str(path), compression="detect") as stream:
        rest = b""
        while block := stream.read(DEPTH_SCAN_BYTES):
            data = rest + block
            cut = data.rfind(b"\n") + 1
            rest = data[cut:]
            if cut:
                yield data[:cut]
        if rest:
            yield rest


def _most_opens_on_a_line(b: np.ndarray, opens: np.ndarray) -> int:
    """The most [ and { any one line of the block holds (bytes b, opens: their positions as a mask)."""
    where = np.flatnonzero(opens)
    if not len(where):
        return 0
    return int(np.bincount(np.searchsorted(np.flatnonzero(b == ord("\n")), where)).max())


def _first_too_deep(b: np.ndarray, opens: np.ndarray, limit: int) -> int:
    """Index of the first byte nesting deeper than `limit` outside strings, or -1. A quote toggles the in-string
    state unless an odd run of backslashes precedes it (`"r1\\\\"` ends its string: a rule of "the byte before is a
    backslash" hid the nesting after it); quotes and levels start afresh on every line, so a malformed line cannot
    hide the next one's nesting."""
    index = np.arange(len(b))
    line_start = np.maximum.accumulate(np.where(b == ord("\n"), index, -1))  # last newline at or before each byte
    backslash = b == ord("\\")
    last_other = np.maximum.accumulate(np.where(backslash, -1, index))  # last byte that is not a backslash
    run_before = np.zeros(len(b), dtype=np.int64)  # backslashes just before each byte
    run_before[1:] = index[:-1] - last_other[:-1]
    quote = (b == ord('"')) & (run_before % 2 == 0)
    inside = _since_line_start(np.cumsum(quote, dtype=np.int64), line_start) % 2 == 1  # its opening quote too
    closes = (b == ord("]")) | (b == ord("}"))
    level = _since_line_start(np.cumsum(np.where(inside, 0, opens.astype(np.int64) - closes)), line_start)
    return int(np.argmax(level > limit)) if level.max() > limit else -1


def _since_line_start(running: np.ndarray, line_start: np.ndarray) -> np.ndarray:
    """A running sum restarted after every newline (line_start: index of the last newline at or before each byte)."""
    return running - np.where(line_start >= 0, running[np.maximum(line_start, 0)], 0)


def _columns_of(path: Path, fmt: str) -> list[str]:
    if not path.is_file():
        raise TraceError(f"{path} does not exist; pass the CSV, JSONL or Parquet file to import.")
    try:
        if fmt == "csv":
            with open(path, newline="", encoding="utf-8", errors="replace") as f:
                return next(csv.reader(f), [])
        if fmt == "parquet":
            import pyarrow.parquet as pa_parquet

            return list(pa_parquet.ParquetFile(path).schema_arrow.names)
        import pyarrow.json as pa_json

        check_json_depth(path)  # before pyarrow's parser, which recursion crashes or stalls on deep nesting
        return list(pa_json.open_json(path, read_options=pa_json.ReadOptions(block_size=_block_bytes(path, 1000))).schema.names)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
        raise _unreadable(path, fmt, e) from e


def _batches(path: Path, fmt: str, used: list[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
    """The table's `used` columns in record batches of at most batch_rows rows; CSV cells as text."""
    try:
        if fmt == "csv":
            import pyarrow.csv as pa_csv

            reader = pa_csv.open_csv(
                path,
                read_options=pa_csv.ReadOptions(block_size=_block_bytes(path, batch_rows // READ_AHEAD_BLOCKS)),
                parse_options=pa_csv.ParseOptions(newlines_in_values=True),  # quoted multi-line labels/tokens
                convert_options=pa_csv.ConvertOptions(column_types={c: pa.string() for c in used}, include_columns=used),
            )
        elif fmt == "jsonl":
            import pyarrow.json as pa_json

            reader = pa_json.open_json(path, read_options=pa_json.ReadOptions(
                block_size=_block_bytes(path, batch_rows // READ_AHEAD_BLOCKS)))
        else:
            import pyarrow.parquet as pa_parquet

            parquet = pa_parquet.ParquetFile(path)
            # one reader per row group: a single iter_batches over the file keeps ~10 bytes per row read (pyarrow
            # 26: 0.35 GB more peak RSS at 50 M rows)
            reader = (batch for group in range(parquet.num_row_groups)
                      for batch in parquet.iter_batches(batch_size=batch_rows, row_groups=[group], columns=used))
        pending, rows = [], 0  # small blocks gathered into batches of batch_rows rows
        for block in reader:
            pending.append(pa.RecordBatch.from_arrays([block.column(c) for c in used], names=used))
            rows += block.num_rows
            if rows >= batch_rows:
                yield from _rebatch(pending, batch_rows, final=False)
                rows = sum(b.num_rows for b in pending)
        yield from _rebatch(pending, batch_rows, final=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
        raise _unreadable(path, fmt, e) from e


def _rebatch(pending: list[pa.RecordBatch], batch_rows: int, final: bool) -> Iterator[pa.RecordBatch]:
    """Whole batches of batch_rows rows from the blocks in `pending` (and the rest when final); what is left of a
    block stays in `pending`."""
    if not pending:
        return
    merged = pa.Table.from_batches(pending).combine_chunks()
    pending.clear()
    whole = merged.num_rows if final else merged.num_rows - merged.num_rows % batch_rows
    for start in range(0, whole, batch_rows):
        yield merged.slice(start, batch_rows).to_batches()[0]
    if whole < merged.num_rows:
        pending.append(merged.slice(whole).to_batches()[0])


# ---- one batch's cells ----------------------------------------------------------------------------------------

def _nulls(column: pa.Array) -> np.ndarray:
    if column.null_count == 0:
        return np.zeros(len(column), bool)
    return column.is_null().to_numpy(zero_copy_only=False)


def _is_text(column: pa.Array) -> bool:
    return pa.types.is_string(column.type) or pa.types.is_large_string(column.type)


class _Codes:
    """Integer codes of values in order of first appearance, across batches (request ids, surface tokens, labels)."""

    def __init__(self) -> None:
        self.index: dict = {}
        self.values: list = []

    def encode(self, column: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes int64[n] (a null reads as code 0), new codes int64[m], their first row in the batch int64[m])."""
        encoded = column.dictionary_encode()
        local = encoded.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        before = len(self.values)
        mapping = np.empty(len(encoded.dictionary), np.int64)
        for i, value in enumerate(encoded.dictionary.to_pylist()):
            code = self.index.get(value)
            if code is None:
                code = self.index[value] = len(self.values)
                self.values.append(value)
            mapping[i] = code
        codes = np.where(local >= 0, mapping[np.maximum(local, 0)] if len(mapping) else 0, 0)
        # the dictionary is in order of first appearance: a local code's first row is where it exceeds all before
        seen = np.maximum.accumulate(np.concatenate([[-1], local[:-1]]))
        first_rows = np.flatnonzero(local > seen)
        new = codes[first_rows] >= before
        return codes, codes[first_rows][new], first_rows[new]


def _integer_column(column: pa.Array, name: str, checks: _BatchChecks, text_nulls: bool) -> np.ndarray:
    """int64[n] non-negative integers; bad rows are recorded and read as 0. text_nulls: CSV text, where the
    pyarrow null spellings ("", NA, ...) mean an empty cell."""
    null = _nulls(column)
    if pa.types.is_integer(column.type):
        values = column.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        bad_type = np.zeros(len(values), bool)
    else:
        try:  # the common case, clean integer text: Arrow's parser
            values = pc.cast(column, pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
            bad_type = np.zeros(len(values), bool)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            if text_nulls and _is_text(column):
                null |= pc.is_in(column, value_set=pa.array(CSV_NULLS)).to_numpy(zero_copy_only=False)
            numbers = pd.to_numeric(column.to_pandas(), errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
            bad_type = ~null & ~(np.isfinite(numbers) & (numbers == np.round(numbers)))
            values = np.where(bad_type | null, 0, np.nan_to_num(numbers)).astype(np.int64)
    checks.first(null, lambda r: f"{name} is empty")
    checks.first(bad_type, lambda r: f"{name} {column[r].as_py()!r} is not an integer")
    checks.first(values < 0, lambda r: f"{name} {values[r]} is negative")
    return values


def _list_column(column: pa.Array, name: str, *, integer: bool, width: int | None, width_flag: bool,
                 checks: _BatchChecks) -> tuple[np.ndarray, bool]:
    """(int64 or float64 [n, k], whether k was known): the lists of a column (JSON-encoded strings in CSV), all of
    length k = width, or the first valid row's length when width is None. width_flag: width came from --top-k."""
    null = _nulls(column)
    checks.first(null, lambda r: f"{name} is empty")
    malformed = np.zeros(len(column), bool)
    if _is_text(column) and integer:
        from repro.traces.int_lists import parse_int_lists, string_buffers  # numba only where CSV lists are parsed

        offsets, data = string_buffers(column)
        flat, lengths, malformed = parse_int_lists(offsets, data, null)
        checks.first(malformed, lambda r: f"{name} {column[r].as_py()!r} is not a JSON list of integers like [3, 5]")
    elif _is_text(column):
        pattern = FLOAT_LIST_PATTERN
        malformed = ~null & ~pc.match_substring_regex(column, pattern).fill_null(True).to_numpy(zero_copy_only=False)
        checks.first(malformed, lambda r: f"{name} {column[r].as_py()!r} is not a JSON list of numbers like [3, 5]")
        text = pc.if_else(pa.array(malformed | null), pa.scalar("[]"), column) if (malformed | null).any() else column
        inner = pc.utf8_trim(text, "[] \t")
        # "" (an empty list) would split into one empty string: map it to null, which splits into nothing
        inner = pc.if_else(pc.equal(inner, ""), pa.scalar(None, pa.string()), inner)
        lists = pc.split_pattern(inner, ",")
        lengths = pc.list_value_length(lists).fill_null(0).to_numpy(zero_copy_only=False)
        flat_text = pc.utf8_trim_whitespace(pc.list_flatten(lists))
        flat = pc.cast(flat_text, pa.float64()).to_numpy(zero_copy_only=False)
    elif pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or pa.types.is_fixed_size_list(column.type):
        value_type = column.type.value_type
        ok_type = pa.types.is_integer(value_type) if integer else (pa.types.is_integer(value_type) or pa.types.is_floating(value_type))
        if not ok_type:
            raise TraceError(f"column {name!r} holds lists of {value_type}; it needs lists of {'integers' if integer else 'numbers'}.")
        lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False)
        flat_values = pc.list_flatten(column)
        inner_null = flat_values.is_null().to_numpy(zero_copy_only=False)
        if inner_null.any():
            parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
            bad = np.zeros(len(column), bool)
            bad[parents[inner_null]] = True
            checks.first(bad, lambda r: f"{name} {column[r].as_py()!r} contains an empty entry")
        flat = flat_values.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64 if integer else np.float64)
    else:
        raise TraceError(f"column {name!r} has type {column.type}; it needs a list per row (a JSON string like \"[3, 5]\" in CSV).")
    valid = ~null & ~malformed & (lengths > 0)
    checks.first(~null & ~malformed & (lengths == 0), lambda r: f"{name} is an empty list")
    known = width is not None or bool(valid.any())
    k = int(width) if width is not None else (int(lengths[np.argmax(valid)]) if valid.any() else 1)
    wrong = valid & (lengths != k)
    checks.first(wrong, lambda r: f"{name} has {lengths[r]} entries where the other rows have {k}"
                 + (" (--top-k)" if width_flag and integer else ""))
    good = valid & ~wrong
    if good.all() and len(flat) == len(column) * k:  # every row has k entries: the flat values are the table
        return flat.reshape(len(column), k), known
    out = np.zeros((len(column), k), dtype=np.int64 if integer else np.float64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    if good.any():
        out[good] = flat[starts[good][:, None] + np.arange(k)]
    return out, known


def _check_expert_ids(experts_nk: np.ndarray, num_experts: int | None, name: str, checks: _BatchChecks) -> None:
    checks.first((experts_nk < 0).any(axis=1), lambda r: f"{name} {experts_nk[r].tolist()} has a negative expert id")
    limit = num_experts if num_experts is not None else np.iinfo(np.int16).max + 1
    flag = "--num-experts" if num_experts is not None else "the trace format's int16 range"
    checks.first((experts_nk >= limit).any(axis=1), lambda r: f"{name} {experts_nk[r].tolist()} has an expert id not below {limit} ({flag})")
    checks.first(_repeats(experts_nk), lambda r: f"{name} {experts_nk[r].tolist()} repeats an expert")


def _repeats(experts_nk: np.ndarray) -> np.ndarray:
    """bool[n]: the row lists an id twice. For small k the k(k-1)/2 column comparisons beat a row-wise sort."""
    k = experts_nk.shape[1]
    if k > 16:
        ordered = np.sort(experts_nk, axis=1)
        return (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    repeated = np.zeros(len(experts_nk), bool)
    columns = [np.ascontiguousarray(experts_nk[:, j]) for j in range(k)]
    for j in range(1, k):
        for i in range(j):
            repeated |= columns[i] == columns[j]
    return repeated


def _check_weights(weights_nk: np.ndarray, name: str, checks: _BatchChecks) -> None:
    """float64[n, k] gate weights must survive the trace format's float16: finite and |w| <= 65504."""
    finite = np.isfinite(weights_nk).all(axis=1)
    checks.first(~finite, lambda r: f"{name} {weights_nk[r].tolist()} has a NaN or infinite weight")
    checks.first(finite & (np.abs(weights_nk) > FLOAT16_MAX).any(axis=1),
                 lambda r: f"{name} {weights_nk[r].tolist()} has a weight beyond the float16 range (|w| <= {FLOAT16_MAX:g}) "
                 "of the trace format")


# ---- the import ------------------------------------------------------------------------------------------------

ROW_KEYS = ("row", "code", "pos", "layer")  # a parsed row's sort key, in order: request code, position, layer, file row


class _Importer:
    """One import attempt: options resolved, per-request tables, the grid checker and the writer."""

    def __init__(self, path: Path, batch_rows: int, *, format: str | None = None, model: str = "",
                 num_experts: int | None = None, top_k: int | None = None, vocab_size: int | None = None,
                 dataset: str | None = None, tokenizer: str = "", token_col: str | None = None,
                 request_col: str = "request_id", position_col: str = "position", layer_col: str = "layer",
                 experts_col: str = "experts", weights_col: str | None = None, label_col: str | None = None,
                 phase_col: str | None = None, prefill_len_col: str | None = None,
                 arrival_col: str | None = None) -> None:
        self.path, self.batch_rows = path, batch_rows
        self.fmt = _format_of(path, format)
        columns = _columns_of(path, self.fmt)
        present = set(columns)
        token_col = token_col or ("token_id" if "token_id" in present else "token")
        weights_col = weights_col or ("weights" if "weights" in present else None)
        label_col = label_col or ("label" if "label" in present else None)
        phase_col = phase_col or ("phase" if "phase" in present else None)
        prefill_len_col = prefill_len_col or ("prefill_len" if "prefill_len" in present else None)
        arrival_col = arrival_col or ("arrival_time" if "arrival_time" in present else None)
        if phase_col is not None and prefill_len_col is not None:
            raise TraceError(f"{path} has both a phase column {phase_col!r} and a prefill_len column {prefill_len_col!r}; "
                             "keep one of them (they say the same thing).")
        for role, name in [("request", request_col), ("position", position_col), ("layer", layer_col),
                           ("token", token_col), ("experts", experts_col), ("weights", weights_col), ("label", label_col),
                           ("phase", phase_col), ("prefill-len", prefill_len_col), ("arrival", arrival_col)]:
            if name is not None and name not in present:
                raise TraceError(f"{path} has no {role} column {name!r} (columns: {', '.join(columns)}); "
                                 f"pass --{role}-col with the right name.")
        self.cols = dict(request=request_col, position=position_col, layer=layer_col, token=token_col,
                         experts=experts_col, weights=weights_col, label=label_col, phase=phase_col,
                         prefill=prefill_len_col, arrival=arrival_col)
        self.used = list(dict.fromkeys(c for c in self.cols.values() if c is not None))
        self.model, self.dataset, self.tokenizer = model, dataset, tokenizer
        self.num_experts, self.vocab_size = num_experts, vocab_size
        self.k, self.k_from_flag = top_k, top_k is not None
        self.surface: bool | None = None  # decided by the first batch
        self.requests, self.vocab, self.labels = _Codes(), _Codes(), _Codes()
        self.request_first_row = np.zeros(0, np.int64)  # [R] file row where each request first appears
        self.request_label = np.zeros(0, np.int64)  # [R] label code on that row
        self.request_prefill = np.zeros(0, np.int64)  # [R] declared prefill_len on that row
        self.request_arrival = np.zeros(0, np.float64)  # [R] arrival time (seconds) on that row
        self.problems = _Problems()
        self.rows = 0
        self.max_expert = self.max_token = -1
        self.grid: _Grid | None = None

    # -- driving ------------------------------------------------------------------------------------------------

    def run(self, tmp: Path, sorted_pass: bool) -> ImportResult:
        self.grid = _Grid(self, tmp)
        if sorted_pass:
            last = None  # (code, pos, layer) of the previous row
            for batch in _batches(self.path, self.fmt, self.used, self.batch_rows):
                parsed = self._parse(batch)
                last = _check_sorted(parsed, last)
                self.grid.push(parsed)
                self._raise_if_settled()
        else:
            runs_dir = tmp / ".runs"
            runs_dir.mkdir()
            runs = [self._spill(self._parse(batch), runs_dir, i)
                    for i, batch in enumerate(_batches(self.path, self.fmt, self.used, self.batch_rows))]
            for chunk in _merge(runs, self.batch_rows):
                self.grid.push(chunk)
            del runs
            shutil.rmtree(runs_dir)
        if self.rows == 0:
            raise TraceError(f"{self.path} has no data rows; export at least one (request, position, layer) row.")
        return self.grid.finish(sorted_pass)

    def discard(self) -> None:
        if self.grid is not None and self.grid.writer is not None:
            self.grid.writer.discard()

    def _raise_if_settled(self) -> None:
        """Raise the earliest problem once no later check can find an earlier one: checks across rows look back
        at most to the first row of the request still open. Only a row's own problem is raised early: a problem
        across rows assumes sorted input, which a later row may disprove (then the external sort checks again)."""
        main = self.problems.main
        if main is not None and main[1] == 0 and main[0] < self.grid.open_request_row():
            self.raise_problem(main)

    def raise_problem(self, problem: tuple) -> None:
        raise TraceError(f"{self.path} {_RowLocator(self.path, self.fmt)(problem[0])}: {problem[3]}; "
                         "fix that row and import again.")

    @staticmethod
    def _spill(parsed: dict, runs_dir: Path, index: int) -> dict:
        """Sort one parsed batch by (request, position, layer, row) and save it as a run of memory-mapped arrays."""
        order = np.lexsort((parsed["layer"], parsed["pos"], parsed["code"]))  # stable: rows stay in file order
        run = {}
        for name, values in parsed.items():
            file = runs_dir / f"{index}.{name}.npy"
            np.save(file, values[order], allow_pickle=False)
            run[name] = np.load(file, mmap_mode="r")
        return run

    # -- one batch ----------------------------------------------------------------------------------------------

    def _parse(self, batch: pa.RecordBatch) -> dict:
        """Check a batch's cells and return its columns: row, code, pos, layer int64[n], token int32[n],
        experts int16[n, k], weights float16[n, k] (optional), decode bool[n] (optional)."""
        n, row0, cols, problems = batch.num_rows, self.rows, self.cols, self.problems
        checks = _BatchChecks(problems, row0)
        self.rows += n
        text_nulls = self.fmt == "csv"
        column = batch.column

        request_column = column(cols["request"])
        checks.first(_nulls(request_column), lambda r: f"{cols['request']} is empty")
        code, new_codes, new_rows = self.requests.encode(request_column)
        pos = _integer_column(column(cols["position"]), cols["position"], checks, text_nulls)
        layer = _integer_column(column(cols["layer"]), cols["layer"], checks, text_nulls)
        token_column = column(cols["token"])
        if self.surface is None:
            self.surface = _is_text(token_column) and (cols["token"] == "token" or self.fmt != "csv"
                                                       or not _all_integer_text(token_column))
        if self.surface:
            checks.first(_nulls(token_column), lambda r: f"{cols['token']} is empty")
            token = self.vocab.encode(token_column)[0]
        else:
            token = _integer_column(token_column, cols["token"], checks, text_nulls)
            if self.vocab_size is not None:
                checks.first(token >= self.vocab_size,
                             lambda r: f"{cols['token']} {token[r]} is not below --vocab-size {self.vocab_size}")
            checks.first(token > INT32_MAX, lambda r: f"{cols['token']} {token[r]} is beyond the int32 range of the trace format")
        if checks.found:  # a bad key cell: the checks across rows need clean keys, so the cells' problems are final
            self.raise_problem(problems.rowwise)

        experts, known = _list_column(column(cols["experts"]), cols["experts"], integer=True, width=self.k,
                                      width_flag=self.k_from_flag, checks=checks)
        if self.k is None and known:
            self.k = experts.shape[1]
        weights = None
        if cols["weights"] is not None:
            weights, _ = _list_column(column(cols["weights"]), cols["weights"], integer=False, width=experts.shape[1],
                                      width_flag=False, checks=checks)
            _check_weights(weights, cols["weights"], checks)
        label_codes = None
        if cols["label"] is not None:
            label_column = column(cols["label"])
            if not _is_text(label_column):
                label_column = pa.array(label_column.to_pandas().fillna("").astype(str), pa.string())
            label_codes = self.labels.encode(label_column.fill_null(""))[0]
        decode = None
        if cols["phase"] is not None:
            phase = pc.utf8_lower(pc.utf8_trim_whitespace(pc.cast(column(cols["phase"]), pa.string()).fill_null("")))
            decode = pc.equal(phase, "decode").to_numpy(zero_copy_only=False)
            prefill = pc.equal(phase, "prefill").to_numpy(zero_copy_only=False)
            checks.first(~decode & ~prefill, lambda r: f"{cols['phase']} {phase[r].as_py()!r} is neither 'prefill' nor 'decode'")
        declared = None
        if cols["prefill"] is not None:
            declared = _integer_column(column(cols["prefill"]), cols["prefill"], checks, text_nulls)
        arrival = None
        if cols["arrival"] is not None:
            arrival_column = column(cols["arrival"])
            arrival = pd.to_numeric(pd.Series(arrival_column.to_pandas(), dtype=object), errors="coerce").to_numpy(
                dtype=np.float64, na_value=np.nan)
            checks.first(~(np.isfinite(arrival) & (arrival >= 0)),
                         lambda r: f"{cols['arrival']} {arrival_column[r].as_py()!r} is not a finite number of seconds >= 0")
        _check_expert_ids(experts, self.num_experts, cols["experts"], checks)

        # per-request values are those of the request's first row
        self.request_first_row = np.concatenate([self.request_first_row, row0 + new_rows])
        if label_codes is not None:
            self.request_label = np.concatenate([self.request_label, label_codes[new_rows]])
            want = self.request_label[code]
            bad = label_codes != want
            if bad.any():
                r = int(np.argmax(bad))
                problems.add(row0 + r, 2, 0, f"{cols['label']} {self.labels.values[label_codes[r]]!r} differs from "
                             f"{self.labels.values[want[r]]!r} given earlier for {cols['request']} "
                             f"{self.request_name(code[r])} (one label per request)")
        if declared is not None:
            self.request_prefill = np.concatenate([self.request_prefill, declared[new_rows]])
            want = self.request_prefill[code]
            bad = declared != want
            if bad.any():
                r = int(np.argmax(bad))
                problems.add(row0 + r, 3, 0, f"{cols['prefill']} {declared[r]} differs from {want[r]} given earlier for "
                             f"{cols['request']} {self.request_name(code[r])} (one prefill_len per request)")
        if arrival is not None:
            self.request_arrival = np.concatenate([self.request_arrival, arrival[new_rows]])
            want = self.request_arrival[code]
            bad = (arrival != want) & np.isfinite(arrival)
            if bad.any():
                r = int(np.argmax(bad))
                problems.add(row0 + r, 3, 1, f"{cols['arrival']} {arrival[r]} differs from {want[r]} given earlier for "
                             f"{cols['request']} {self.request_name(code[r])} (one arrival time per request)")
        if n:
            self.max_expert = max(self.max_expert, int(experts.max()))
            self.max_token = max(self.max_token, int(token.max()))
        parsed = {"row": row0 + np.arange(n, dtype=np.int64), "code": code, "pos": pos, "layer": layer,
                  "token": token.astype(np.int32),  # out-of-range values were reported above
                  "experts": experts.astype(np.int16)}
        if weights is not None:
            parsed["weights"] = weights.astype(np.float16)
        if decode is not None:
            parsed["decode"] = decode
        return parsed

    def request_name(self, code: int) -> str:
        return str(self.requests.values[int(code)])

    def token_name(self, token: int) -> str:
        return repr(self.vocab.values[int(token)]) if self.surface else str(int(token))

    # -- the end ------------------------------------------------------------------------------------------------

    def meta(self, layer_ids: np.ndarray) -> TraceMeta:
        inferred = []
        num_experts, vocab_size = self.num_experts, self.vocab_size
        if num_experts is None:
            num_experts = self.max_expert + 1
            inferred.append("num_experts")
        if vocab_size is None:
            vocab_size = len(self.vocab.values) if self.surface else self.max_token + 1
            inferred.append("vocab_size")
        return TraceMeta(
            model=self.model or "imported",
            num_experts=int(num_experts),
            top_k=int(self.k),
            layer_ids=tuple(int(x) for x in layer_ids),
            vocab_size=int(vocab_size),
            tokenizer="vocab.json" if self.surface else self.tokenizer,
            source=f"import:{self.path.name}",
            dataset=self.path.stem if self.dataset is None else self.dataset,
            extra={"input": str(self.path), "format": self.fmt, "rows": int(self.rows), "inferred": inferred},
        )


def _all_integer_text(column: pa.Array) -> bool:
    try:
        pc.cast(column, pa.int64())
        return True
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    numbers = pd.to_numeric(column.to_pandas(), errors="coerce")
    return bool(numbers.notna().all())


def _check_sorted(parsed: dict, last: tuple | None) -> tuple | None:
    """Raise _Unsorted when the batch's (code, pos, layer) keys decrease anywhere (equal keys are duplicates, which
    the grid reports); returns the batch's last key."""
    code, pos, layer = parsed["code"], parsed["pos"], parsed["layer"]
    if not len(code):
        return last
    if last is not None:
        code, pos, layer = (np.concatenate([[v], a]) for v, a in zip(last, (code, pos, layer), strict=True))
    dc, dp, dl = np.diff(code), np.diff(pos), np.diff(layer)
    if not ((dc > 0) | ((dc == 0) & ((dp > 0) | ((dp == 0) & (dl >= 0))))).all():
        raise _Unsorted
    return int(code[-1]), int(pos[-1]), int(layer[-1])


def _merge(runs: list[dict], batch_rows: int) -> Iterator[dict]:
    """Rows of all runs (each sorted by (code, pos, layer, row)) in that order, in chunks of about batch_rows rows:
    each step takes a slice of every run, keeps what sorts before the smallest slice end of the runs that go on,
    and sorts that."""
    cursor = [0] * len(runs)
    sizes = [len(run["row"]) for run in runs]
    while True:
        active = [i for i in range(len(runs)) if cursor[i] < sizes[i]]
        if not active:
            return
        step = max(MIN_MERGE_SLICE, batch_rows // len(active))
        ends = {i: min(cursor[i] + step, sizes[i]) for i in active}
        bound = min((tuple(int(runs[i][key][ends[i] - 1]) for key in ("code", "pos", "layer", "row"))
                     for i in active if ends[i] < sizes[i]), default=None)
        parts = []
        for i in active:
            piece = {name: np.asarray(values[cursor[i] : ends[i]]) for name, values in runs[i].items()}
            if bound is not None:
                c, p, la, r = (piece[key] for key in ("code", "pos", "layer", "row"))
                b0, b1, b2, b3 = bound
                keep = (c < b0) | ((c == b0) & ((p < b1) | ((p == b1) & ((la < b2) | ((la == b2) & (r <= b3))))))
                take = int(keep.sum())  # a prefix: the run is sorted
                piece = {name: values[:take] for name, values in piece.items()}
            cursor[i] += len(piece["row"])
            parts.append(piece)
        chunk = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
        order = np.lexsort((chunk["row"], chunk["layer"], chunk["pos"], chunk["code"]))
        yield {name: values[order] for name, values in chunk.items()}


class _Grid:
    """Rows in (request, position, layer, row) order, pushed in chunks of any size: checks that every token has
    each layer once, positions run 0..len-1, a token is the same at all its layers and the phases are in order,
    and appends each chunk of whole tokens to the trace (while nothing is wrong)."""

    def __init__(self, importer: _Importer, directory: Path) -> None:
        self.imp, self.directory = importer, directory
        self.layer_ids: np.ndarray | None = None
        self.first_token: tuple | None = None  # (first file row, code, pos) of the first token
        self.tail: dict | None = None  # rows of the last token, which may go on in the next chunk
        self.last = (-1, -1, -1, False)  # (code, position, rank in its request, decode) of the last token checked
        self.lengths = np.zeros(0, np.int64)  # [R] tokens per request
        self.decoded = np.zeros(0, np.int64)  # [R] decode tokens per request
        self.writer: TraceStreamWriter | None = None

    def open_request_row(self) -> int:
        """First file row of the request whose rows may still come (no row before it can be flagged later)."""
        if self.tail is None or not len(self.tail["row"]):
            return NO_ROW
        return int(self.imp.request_first_row[self.tail["code"][0]])

    def push(self, chunk: dict) -> None:
        if self.tail is not None:
            chunk = {name: np.concatenate([self.tail[name], values]) for name, values in chunk.items()}
        code, pos = chunk["code"], chunk["pos"]
        if not len(code):
            return
        change = np.flatnonzero((code[1:] != code[:-1]) | (pos[1:] != pos[:-1]))
        cut = int(change[-1]) + 1 if len(change) else 0
        self.tail = {name: values[cut:] for name, values in chunk.items()}
        if cut:
            self._check({name: values[:cut] for name, values in chunk.items()})

    def _check(self, c: dict) -> None:
        """Check whole tokens c (sorted) and append them to the trace."""
        imp, problems, cols = self.imp, self.imp.problems, self.imp.cols
        row, code, pos, layer = (c[key] for key in ROW_KEYS)
        n = len(row)
        new = np.ones(n, bool)
        new[1:] = (code[1:] != code[:-1]) | (pos[1:] != pos[:-1])
        starts = np.flatnonzero(new)  # [G] first sorted row of each token
        size = np.diff(np.append(starts, n))
        token_of_row = np.repeat(np.arange(len(starts)), size)
        first_row = np.minimum.reduceat(row, starts)  # earliest file row of each token
        if self.layer_ids is None:
            self.layer_ids = np.unique(layer[: size[0]])
            self.first_token = (int(first_row[0]), int(code[0]), int(pos[0]), int(size[0]))
        layer_ids = self.layer_ids
        num_layers = len(layer_ids)

        def where(i: int) -> str:  # a sorted row
            return f"request {imp.request_name(code[i])} position {pos[i]}"

        slot = np.minimum(np.searchsorted(layer_ids, layer), num_layers - 1)
        unknown = layer_ids[slot] != layer
        r0, code0, pos0, size0 = self.first_token
        if unknown.any() and size0 < len(self.layer_ids) + len(np.unique(layer[unknown])):
            # the first token lacks the layers first seen here (unless duplicates fill its rows: reported as such)
            extra = np.unique(layer[unknown])
            everything = np.union1d(layer_ids, extra)
            problems.add(r0, 1, 1, f"request {imp.request_name(code0)} position {pos0} lacks layer(s) {extra.tolist()} "
                         f"(the table's layers are {everything.tolist()})")
        same = np.zeros(n, bool)
        same[1:] = ~new[1:] & (layer[1:] == layer[:-1])
        problems.first_of(same, row, 1, 0, lambda i: f"{where(i)} layer {layer[i]} appears twice (each layer once per token)")

        def missing_layers(g: int) -> str:
            have = layer[starts[g] : starts[g] + size[g]]
            return (f"{where(starts[g])} lacks layer(s) {np.setdiff1d(layer_ids, have).tolist()} "
                    f"(the table's layers are {layer_ids.tolist()})")

        problems.first_of(size < num_layers, first_row, 1, 1, missing_layers)

        # positions of each request must run 0, 1, 2, ...: compare each token's position with its rank in the request
        last_code, last_pos, last_rank, last_decode = self.last
        token_code, token_pos = code[starts], pos[starts]
        previous_code = np.concatenate([[last_code], token_code[:-1]])
        previous_pos = np.concatenate([[last_pos], token_pos[:-1]])
        index = np.arange(len(starts))
        request_start = np.maximum.accumulate(np.where(token_code != previous_code, index, -1))
        rank = np.where(request_start >= 0, index - request_start, last_rank + 1 + index)

        def gap_message(g: int) -> str:
            if rank[g] == 0:
                return f"{where(starts[g])}: the request's positions start at {token_pos[g]}, not 0"
            return f"{where(starts[g])}: position {previous_pos[g] + 1} of the request is missing (positions must be 0..length-1)"

        problems.first_of(token_pos != rank, first_row, 1, 2, gap_message)

        token = c["token"]
        if np.all(row[1:] > row[:-1]):  # file order: each token's earliest row is its first
            reference = starts
        else:
            reference = np.lexsort((row, token_of_row))[starts]
        reference_token = token[reference][token_of_row]
        problems.first_of(token != reference_token, row, 1, 3,
                          lambda i: f"{where(i)} layer {layer[i]} has token {imp.token_name(token[i])} but the same "
                          f"position has token {imp.token_name(reference_token[i])} at another layer")

        grow = max(0, len(imp.requests.values) - len(self.lengths))
        self.lengths = np.concatenate([self.lengths, np.zeros(grow, np.int64)])
        self.decoded = np.concatenate([self.decoded, np.zeros(grow, np.int64)])
        np.add.at(self.lengths, token_code, 1)
        if "decode" in c:
            decode = c["decode"]
            some = np.logical_or.reduceat(decode, starts)
            every = np.logical_and.reduceat(decode, starts)
            problems.first_of(some & ~every, first_row, 3, 1,
                              lambda g: f"{cols['request']} {imp.request_name(token_code[g])} position {token_pos[g]}: "
                              f"{cols['phase']} differs between the token's layers (one phase per token)")
            token_decode = decode[starts]  # the token's phase at its first layer
            previous_decode = np.concatenate([[last_decode], token_decode[:-1]])
            late = previous_decode & ~token_decode & (token_code == previous_code)
            problems.first_of(late, row[starts], 3, 2,
                              lambda g: f"{cols['request']} {imp.request_name(token_code[g])} position {token_pos[g]} is "
                              "prefill after a decode token (a request's prefill tokens come first)")
            np.add.at(self.decoded, token_code, token_decode)
            last_decode = bool(token_decode[-1])
        self.last = (int(token_code[-1]), int(token_pos[-1]), int(rank[-1]), last_decode)

        if problems.main is None and problems.late is None:  # whole tokens, each with every layer once, in order
            if self.writer is None:
                self.writer = TraceStreamWriter(self.directory, num_layers, imp.k, "weights" in c)
            tokens = len(starts)
            self.writer.append(token[starts], c["experts"].reshape(tokens, num_layers, imp.k),
                               c["weights"].reshape(tokens, num_layers, imp.k) if "weights" in c else None)

    def finish(self, sorted_input: bool) -> ImportResult:
        """Check the last token and the per-request rules, write the per-request tables; raise the first problem."""
        imp, problems, cols = self.imp, self.imp.problems, self.imp.cols
        if self.tail is not None and len(self.tail["row"]):
            self._check(self.tail)
        self.tail = None
        if problems.main is not None:
            imp.raise_problem(problems.main)
        lengths = self.lengths
        prefill_len = lengths
        if cols["phase"] is not None:
            prefill_len = lengths - self.decoded
        elif cols["prefill"] is not None:
            declared = imp.request_prefill
            problems.first_of(declared > lengths, imp.request_first_row, 3, 3,
                              lambda q: f"{cols['prefill']} {declared[q]} exceeds the {lengths[q]} tokens of "
                              f"{cols['request']} {imp.request_name(q)}")
            prefill_len = declared
        if cols["arrival"] is not None:
            arrival = imp.request_arrival
            early = np.concatenate([[False], np.diff(arrival) < 0])  # [R] arrives before the request listed before it
            problems.first_of(early, imp.request_first_row, 3, 4,
                              lambda q: f"{cols['request']} {imp.request_name(q)} arrives at {cols['arrival']} "
                              f"{arrival[q]}, before {imp.request_name(q - 1)} listed before it at {arrival[q - 1]} "
                              "(requests must appear in arrival order: sort them by arrival time)")
        if problems.late is not None:
            imp.raise_problem(problems.late)
        meta = imp.meta(self.layer_ids)
        names = [str(x) for x in imp.requests.values]
        labels = ([str(imp.labels.values[c]) for c in imp.request_label] if cols["label"] is not None
                  else [""] * len(names))
        vocab = [str(v) for v in imp.vocab.values] if imp.surface else None
        extra = {} if vocab is None else {"vocab.json": json.dumps(vocab, ensure_ascii=False)}
        if cols["arrival"] is not None:
            extra["arrival_time.json"] = json.dumps([float(t) for t in imp.request_arrival])
        self.writer.finish(meta, lengths, prefill_len, names, [meta.dataset] * len(names), labels, extra)
        return ImportResult(meta, len(names), int(lengths.sum()), vocab, sorted_input)


class _RowLocator:
    """Turns a 0-based data row into the words that find it in the input file (only called on errors)."""

    def __init__(self, path: Path, fmt: str) -> None:
        self.path, self.fmt = path, fmt

    def __call__(self, row: int) -> str:
        if self.fmt == "parquet":
            return f"row {row + 1}"
        try:
            with open(self.path, newline="", encoding="utf-8", errors="replace") as f:
                if self.fmt == "csv":
                    reader = csv.reader(f)
                    next(reader, None)  # the header
                    line_before = reader.line_num
                    for i, _ in enumerate(reader):
                        if i == row:
                            return f"line {line_before + 1}"
                        line_before = reader.line_num
                else:
                    seen = -1
                    for line_number, line in enumerate(f, start=1):
                        seen += bool(line.strip())  # pyarrow's JSON reader skips blank lines
                        if seen == row:
                            return f"line {line_number}"
        except OSError:
            pass
        return f"data row {row + 1}"


def read_arrival_times(trace_dir) -> np.ndarray | None:
    """float64[R] arrival time (seconds) of each request of an imported trace directory, in request order (the order
    they arrive in), or None when the import had no arrival-time column."""
    path = Path(trace_dir) / "arrival_time.json"
    if not path.exists():
        return None
    try:
        return np.asarray(json.loads(path.read_text()), dtype=np.float64)
    except (OSError, ValueError) as error:
        raise TraceError(f"{path} is not a JSON list of arrival times ({error}); import the table again.") from None
