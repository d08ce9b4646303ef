"""Import routing traces kept in tabular form (CSV, JSONL, Parquet) into a RoutingTrace.

Other tools (SGLang/vLLM dumps post-processed with pandas, FLAME-MoE-style parquet, hand-written CSV) keep
routing as one row per (request, position, layer):

    request_id  position  layer  token_id | token   experts      [weights]          [label]
    "q1"        0         0      415                "[3, 5]"     "[0.61, 0.39]"     "physics"

`experts` is a list of expert ids (a JSON-encoded string "[3, 5]" in CSV, a list in JSONL and Parquet), the
token is an id (`token_id`, an integer column) or a surface string (`token`, mapped to ids through a
vocabulary built on import in order of first appearance), `weights` are optional gate weights and `label` an
optional per-request class. Generated-token routing: an optional `phase` column ("prefill" or "decode" per
token; a request's prefill tokens come first) or `prefill_len` column (the request's prompt length, the same on
all its rows) sets the trace's prefill_len; without either every token is prompt. Rows may come in any order; the importer sorts by (request, position, layer), with
requests kept in order of first appearance.

Validation: every (request, position) has every layer exactly once, positions are 0..len-1, every expert list
has the same length k with no repeated id and no negative id, weights (if any) match the experts and are finite
within float16's range, a token is the same at all its layers and a request has one label. A problem raises
TraceError naming the FIRST bad row of the input (CSV: the line number in the file, the header being line 1;
JSONL: the line number; Parquet: the 1-based row number) and what is wrong. Checks run vectorised over the whole table; line numbers are
worked out only on the error path.

Legend: n rows of the table, N tokens (= n / L), L MoE layers, k experts per token, R requests.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from repro.errors import TraceError
from repro.traces.format import FLOAT16_MAX, RoutingTrace, TraceMeta, make_trace

SUFFIX_FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
INT_LIST_PATTERN = r"^\s*\[\s*(-?\d+\s*(,\s*-?\d+\s*)*)?\]\s*$"
FLOAT = r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?"
FLOAT_LIST_PATTERN = rf"^\s*\[\s*({FLOAT}\s*(,\s*{FLOAT}\s*)*)?\]\s*$"


@dataclass(frozen=True)
class _Problem:
    row: int  # 0-based data row of the input table
    what: str


def import_table(path, **options) -> RoutingTrace:
    """Read a tabular routing trace into a validated RoutingTrace (options: see import_table_with_vocab)."""
    return import_table_with_vocab(path, **options)[0]


def import_table_with_vocab(
    path,
    *,
    format: str | None = None,
    model: str = "",
    num_experts: int | None = None,
    top_k: int | None = None,
    vocab_size: int | None = None,
    dataset: str | None = None,
    tokenizer: str = "",
    token_col: str | None = None,
    request_col: str = "request_id",
    position_col: str = "position",
    layer_col: str = "layer",
    experts_col: str = "experts",
    weights_col: str | None = None,
    label_col: str | None = None,
    phase_col: str | None = None,
    prefill_len_col: str | None = None,
) -> tuple[RoutingTrace, list[str] | None]:
    """Read a tabular routing trace; returns (trace, vocabulary or None).

    format: csv | jsonl | parquet (default: from the file suffix). token_col: default `token_id` if present,
    else `token`; an integer column holds ids, a string column holds surface strings (then the vocabulary,
    entry i = surface string of id i, is returned and meta.tokenizer says "vocab.json"). weights_col and
    label_col default to `weights` / `label` when such columns exist, phase_col / prefill_len_col to `phase` /
    `prefill_len` (at most one of the two may be used). num_experts defaults to the largest
    expert id + 1, top_k to the first row's list length, vocab_size to the largest token id + 1 (meta.extra
    records which were inferred); dataset defaults to the file's stem.
    """
    path = Path(path)
    fmt = _format_of(path, format)
    # CSV cells are typed by inference; these stay text (request ids like "007", lists parsed below, surface tokens)
    text_columns = {request_col, experts_col, weights_col or "weights", label_col or "label", "token",
                    phase_col or "phase"}
    table = _read(path, fmt, text_columns)
    n = table.num_rows
    if n == 0:
        raise TraceError(f"{path} has no data rows; export at least one (request, position, layer) row.")
    columns = set(table.column_names)
    if token_col is None:
        token_col = "token_id" if "token_id" in columns else "token"
    if weights_col is None and "weights" in columns:
        weights_col = "weights"
    if label_col is None and "label" in columns:
        label_col = "label"
    if phase_col is None and "phase" in columns:
        phase_col = "phase"
    if prefill_len_col is None and "prefill_len" in columns:
        prefill_len_col = "prefill_len"
    if phase_col is not None and prefill_len_col is not None:
        raise TraceError(f"{path} has both a phase column {phase_col!r} and a prefill_len column {prefill_len_col!r}; "
                         "keep one of them (they say the same thing).")
    for role, name in [("request", request_col), ("position", position_col), ("layer", layer_col),
                       ("token", token_col), ("experts", experts_col), ("weights", weights_col), ("label", label_col),
                       ("phase", phase_col), ("prefill-len", prefill_len_col)]:
        if name is not None and name not in columns:
            raise TraceError(
                f"{path} has no {role} column {name!r} (columns: {', '.join(table.column_names)}); "
                f"pass --{role}-col with the right name."
            )
    locate = _RowLocator(path, fmt)
    problems: list[_Problem] = []

    request_codes, request_names = _factorize(table[request_col], request_col, problems)
    positions = _integer_column(table[position_col], position_col, problems)
    layers = _integer_column(table[layer_col], layer_col, problems)
    token_column = table[token_col]
    surface = pa.types.is_string(token_column.type) or pa.types.is_large_string(token_column.type)
    if surface:
        token_ids, vocab_values = _factorize(token_column, token_col, problems)
        vocab = [str(v) for v in vocab_values]
    else:
        token_ids, vocab = _integer_column(token_column, token_col, problems), None
    if vocab is None and vocab_size is not None:
        _first(problems, token_ids >= vocab_size, lambda r: f"{token_col} {token_ids[r]} is not below --vocab-size {vocab_size}")
    # the grid checks read only these columns: they run (and may find an earlier bad row) when these are clean
    keys_clean = not problems
    experts_nk = _list_column(table[experts_col], experts_col, integer=True, width=top_k, problems=problems)
    k = experts_nk.shape[1]
    weights_nk = None
    if weights_col is not None:
        weights_nk = _list_column(table[weights_col], weights_col, integer=False, width=k, problems=problems)
        _check_weights(weights_nk, weights_col, problems)
    labels = None
    if label_col is not None:
        labels = table[label_col].to_pandas().fillna("").astype(str).to_numpy()
    is_decode = declared_prefill = None
    if phase_col is not None:
        phase = table[phase_col].to_pandas().fillna("").astype(str).str.strip().str.lower().to_numpy()
        _first(problems, (phase != "prefill") & (phase != "decode"),
               lambda r: f"{phase_col} {phase[r]!r} is neither 'prefill' nor 'decode'")
        is_decode = phase == "decode"
    if prefill_len_col is not None:
        declared_prefill = _integer_column(table[prefill_len_col], prefill_len_col, problems)

    _check_expert_ids(experts_nk, num_experts, experts_col, problems)

    def token_name(token: int) -> str:
        return repr(vocab[token]) if vocab is not None else str(token)

    if keys_clean:
        order, layer_ids = _structure(request_codes, request_names, positions, layers, token_ids, token_name, labels,
                                      problems, request_col, label_col)
    if problems:
        _raise_first(problems, locate)

    num_layers = len(layer_ids)
    num_tokens = n // num_layers
    sorted_codes = request_codes[order][::num_layers]
    lengths = np.bincount(sorted_codes, minlength=len(request_names))
    prefill_len = lengths
    if is_decode is not None:
        prefill_len = _prefill_from_phase(is_decode, order, num_layers, sorted_codes, lengths, request_codes,
                                          request_names, positions, phase_col, request_col, problems)
    elif declared_prefill is not None:
        prefill_len = _prefill_from_column(declared_prefill, request_codes, request_names, lengths, prefill_len_col,
                                           request_col, problems)
    if problems:
        _raise_first(problems, locate)
    first_row_of_request = np.unique(request_codes, return_index=True)[1]
    experts_NLk = experts_nk[order].reshape(num_tokens, num_layers, k)
    inferred = []
    if num_experts is None:
        num_experts = int(experts_nk.max()) + 1
        inferred.append("num_experts")
    if vocab_size is None:
        vocab_size = len(vocab) if vocab is not None else int(token_ids.max()) + 1
        inferred.append("vocab_size")
    meta = TraceMeta(
        model=model or "imported",
        num_experts=int(num_experts),
        top_k=int(k),
        layer_ids=tuple(int(x) for x in layer_ids),
        vocab_size=int(vocab_size),
        tokenizer="vocab.json" if vocab is not None else tokenizer,
        source=f"import:{path.name}",
        dataset=path.stem if dataset is None else dataset,
        extra={"input": str(path), "format": fmt, "rows": int(n), "inferred": inferred},
    )
    trace = make_trace(
        meta,
        np.concatenate([[0], np.cumsum(lengths)]),
        token_ids[order][::num_layers],
        experts_NLk,
        prefill_len=prefill_len,
        request_ids=[str(x) for x in request_names],
        request_datasets=[meta.dataset] * len(request_names),
        request_labels=None if labels is None else [labels[r] for r in first_row_of_request],
        weights=None if weights_nk is None else weights_nk[order].reshape(num_tokens, num_layers, k),
    )
    return trace, vocab


def _prefill_from_phase(is_decode, order, num_layers, sorted_codes, lengths, request_codes, request_names, positions,
                        phase_col, request_col, problems) -> np.ndarray:
    """int64[R] prompt tokens per request from a per-row phase (bool[n] True = decode); records the first row whose
    phase differs from its token's other layers, or whose prefill token follows a decode token of its request."""
    by_token = is_decode[order].reshape(-1, num_layers)  # [N, L] in (request, position, layer) order
    mixed = np.zeros(len(is_decode), bool)
    mixed[order] = np.repeat(by_token.any(axis=1) & ~by_token.all(axis=1), num_layers)
    _first(problems, mixed, lambda r: f"{request_col} {request_names[request_codes[r]]!s} position {positions[r]}: "
           f"{phase_col} differs between the token's layers (one phase per token)")
    decode_N = by_token[:, 0]
    new_request = np.concatenate([[True], sorted_codes[1:] != sorted_codes[:-1]])
    # a prefill token after a decode token of the same request: the previous token is decode, this one is not
    late = np.concatenate([[False], decode_N[:-1] & ~decode_N[1:]]) & ~new_request
    bad = np.zeros(len(is_decode), bool)
    bad[order[np.flatnonzero(late) * num_layers]] = True
    _first(problems, bad, lambda r: f"{request_col} {request_names[request_codes[r]]!s} position {positions[r]} is "
           f"prefill after a decode token (a request's prefill tokens come first)")
    return lengths - np.bincount(sorted_codes, weights=decode_N, minlength=len(lengths)).astype(np.int64)


def _prefill_from_column(declared, request_codes, request_names, lengths, prefill_len_col, request_col,
                         problems) -> np.ndarray:
    """int64[R] prompt tokens per request from a per-row prefill_len column, which must be one value per request
    within 0..the request's length."""
    first_row = np.unique(request_codes, return_index=True)[1]
    per_request = declared[first_row]
    _first(problems, declared != per_request[request_codes],
           lambda r: f"{prefill_len_col} {declared[r]} differs from {per_request[request_codes[r]]} given earlier for "
           f"{request_col} {request_names[request_codes[r]]!s} (one prefill_len per request)")
    _first(problems, declared > lengths[request_codes],
           lambda r: f"{prefill_len_col} {declared[r]} exceeds the {lengths[request_codes[r]]} tokens of {request_col} "
           f"{request_names[request_codes[r]]!s}")
    return per_request


def _format_of(path: Path, fmt: str | None) -> str:
    if fmt is not None:
        if fmt not in ("csv", "jsonl", "parquet"):
            raise TraceError(f"unknown table format {fmt!r}; use csv, jsonl or parquet.")
        return fmt
    if path.suffix.lower() not in SUFFIX_FORMATS:
        raise TraceError(f"cannot tell the format of {path} from its suffix; pass --format csv|jsonl|parquet.")
    return SUFFIX_FORMATS[path.suffix.lower()]


def _read(path: Path, fmt: str, text_columns: set[str]) -> pa.Table:
    if not path.is_file():
        raise TraceError(f"{path} does not exist; pass the CSV, JSONL or Parquet file to import.")
    try:
        if fmt == "csv":
            import pyarrow.csv as pa_csv

            with open(path, newline="", encoding="utf-8", errors="replace") as f:
                header = next(csv.reader(f), [])
            keep_text = {c: pa.string() for c in header if c in text_columns}
            return pa_csv.read_csv(
                path,
                parse_options=pa_csv.ParseOptions(newlines_in_values=True),  # quoted multi-line labels/tokens
                convert_options=pa_csv.ConvertOptions(column_types=keep_text),
            )
        if fmt == "jsonl":
            import pyarrow.json as pa_json

            return pa_json.read_json(path)
        import pyarrow.parquet as pa_parquet

        return pa_parquet.read_table(path)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
        raise TraceError(f"{path} cannot be read as {fmt} ({str(e).splitlines()[0]}); fix the file or pass --format.") from e


def _first(problems: list[_Problem], bad: np.ndarray, what) -> None:
    """Record the first True row of bad[n] with the message what(row)."""
    if bad.any():
        row = int(np.argmax(bad))
        problems.append(_Problem(row, what(row)))


def _nulls(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return column.is_null().to_numpy(zero_copy_only=False)


def _factorize(column: pa.ChunkedArray, name: str, problems: list[_Problem]) -> tuple[np.ndarray, np.ndarray]:
    """int64[n] codes in order of first appearance, and the distinct values."""
    null = _nulls(column)
    _first(problems, null, lambda r: f"{name} is empty")
    codes, uniques = pd.factorize(column.to_pandas(), sort=False)
    return np.maximum(codes, 0).astype(np.int64), np.asarray(uniques, dtype=object)


def _integer_column(column: pa.ChunkedArray, name: str, problems: list[_Problem]) -> np.ndarray:
    """int64[n] non-negative integers; bad rows are recorded and read as 0."""
    null = _nulls(column)
    if pa.types.is_integer(column.type):
        values = column.fill_null(0).to_numpy().astype(np.int64)
        bad_type = np.zeros(len(values), bool)
    else:
        numbers = pd.to_numeric(column.to_pandas(), errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
        bad_type = ~null & ~(np.isfinite(numbers) & (numbers == np.round(numbers)))
        values = np.where(bad_type | null, 0, np.nan_to_num(numbers)).astype(np.int64)
    _first(problems, null, lambda r: f"{name} is empty")
    _first(problems, bad_type, lambda r: f"{name} {column[r].as_py()!r} is not an integer")
    _first(problems, values < 0, lambda r: f"{name} {values[r]} is negative")
    return values


def _list_column(column: pa.ChunkedArray, name: str, *, integer: bool, width: int | None,
                 problems: list[_Problem]) -> np.ndarray:
    """int64 or float64 [n, k]: the lists of a column (JSON-encoded strings in CSV), all of length k."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    null = _nulls(column)
    _first(problems, null, lambda r: f"{name} is empty")
    malformed = np.zeros(len(column), bool)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        pattern = INT_LIST_PATTERN if integer else FLOAT_LIST_PATTERN
        malformed = ~null & ~pc.match_substring_regex(column, pattern).fill_null(True).to_numpy(zero_copy_only=False)
        kind = "integers" if integer else "numbers"
        _first(problems, malformed, lambda r: f"{name} {column[r].as_py()!r} is not a JSON list of {kind} like [3, 5]")
        text = pc.if_else(pa.array(malformed | null), pa.scalar("[]"), column)
        inner = pc.utf8_trim(text, "[] \t")
        # "" (an empty list) would split into one empty string: map it to null, which splits into nothing
        inner = pc.if_else(pc.equal(inner, ""), pa.scalar(None, pa.string()), inner)
        lists = pc.split_pattern(inner, ",")
        lengths = pc.list_value_length(lists).fill_null(0).to_numpy(zero_copy_only=False)
        flat_text = pc.utf8_trim_whitespace(pc.list_flatten(lists))
        flat = pc.cast(flat_text, pa.int64() if integer else pa.float64()).to_numpy(zero_copy_only=False)
    elif pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or pa.types.is_fixed_size_list(column.type):
        value_type = column.type.value_type
        ok_type = pa.types.is_integer(value_type) if integer else (pa.types.is_integer(value_type) or pa.types.is_floating(value_type))
        if not ok_type:
            raise TraceError(f"column {name!r} holds lists of {value_type}; it needs lists of {'integers' if integer else 'numbers'}.")
        lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False)
        flat_values = pc.list_flatten(column)
        inner_null = flat_values.is_null().to_numpy(zero_copy_only=False)
        parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        if inner_null.any():
            bad = np.zeros(len(column), bool)
            bad[parents[inner_null]] = True
            _first(problems, bad, lambda r: f"{name} {column[r].as_py()!r} contains an empty entry")
        flat = flat_values.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64 if integer else np.float64)
    else:
        raise TraceError(f"column {name!r} has type {column.type}; it needs a list per row (a JSON string like \"[3, 5]\" in CSV).")
    valid = ~null & ~malformed & (lengths > 0)
    _first(problems, ~null & ~malformed & (lengths == 0), lambda r: f"{name} is an empty list")
    k = int(width) if width is not None else (int(lengths[np.argmax(valid)]) if valid.any() else 1)
    wrong = valid & (lengths != k)
    _first(problems, wrong, lambda r: f"{name} has {lengths[r]} entries where the other rows have {k}"
           + (" (--top-k)" if width is not None and integer else ""))
    out = np.zeros((len(column), k), dtype=np.int64 if integer else np.float64)
    good = valid & ~wrong
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    take = starts[good][:, None] + np.arange(k)
    if good.any():
        out[good] = flat[take]
    return out


def _check_expert_ids(experts_nk: np.ndarray, num_experts: int | None, name: str, problems: list[_Problem]) -> None:
    _first(problems, (experts_nk < 0).any(axis=1), lambda r: f"{name} {experts_nk[r].tolist()} has a negative expert id")
    limit = num_experts if num_experts is not None else np.iinfo(np.int16).max + 1
    flag = "--num-experts" if num_experts is not None else "the trace format's int16 range"
    _first(problems, (experts_nk >= limit).any(axis=1), lambda r: f"{name} {experts_nk[r].tolist()} has an expert id not below {limit} ({flag})")
    ordered = np.sort(experts_nk, axis=1)
    _first(problems, (ordered[:, 1:] == ordered[:, :-1]).any(axis=1), lambda r: f"{name} {experts_nk[r].tolist()} repeats an expert")


def _check_weights(weights_nk: np.ndarray, name: str, problems: list[_Problem]) -> None:
    """float64[n, k] gate weights must survive the trace format's float16: finite and |w| <= 65504."""
    finite = np.isfinite(weights_nk).all(axis=1)
    _first(problems, ~finite, lambda r: f"{name} {weights_nk[r].tolist()} has a NaN or infinite weight")
    _first(problems, finite & (np.abs(weights_nk) > FLOAT16_MAX).any(axis=1),
           lambda r: f"{name} {weights_nk[r].tolist()} has a weight beyond the float16 range (|w| <= {FLOAT16_MAX:g}) "
           "of the trace format")


def _structure(request_codes, request_names, positions, layers, token_ids, token_name, labels, problems, request_col,
               label_col):
    """Sort rows by (request, position, layer) and check the table is a full grid; returns (order int64[n], layer ids)."""
    n = len(positions)
    order = np.lexsort((layers, positions, request_codes))  # stable: ties keep file order
    req_s, pos_s, lay_s = request_codes[order], positions[order], layers[order]
    layer_ids = np.unique(layers)
    num_layers = len(layer_ids)

    def where(r: int) -> str:
        return f"request {request_names[request_codes[r]]!s} position {positions[r]}"

    same_key = (req_s[1:] == req_s[:-1]) & (pos_s[1:] == pos_s[:-1]) & (lay_s[1:] == lay_s[:-1])
    duplicate = np.zeros(n, bool)
    duplicate[order[1:][same_key]] = True
    _first(problems, duplicate, lambda r: f"{where(r)} layer {layers[r]} appears twice (each layer once per token)")

    new_group = np.concatenate([[True], (req_s[1:] != req_s[:-1]) | (pos_s[1:] != pos_s[:-1])])
    group_start = np.flatnonzero(new_group)
    group_of_sorted = np.cumsum(new_group) - 1
    group_size = np.diff(np.append(group_start, n))
    group_first_row = np.minimum.reduceat(order, group_start)  # earliest file row of each (request, position)
    group_req, group_pos = req_s[group_start], pos_s[group_start]

    def missing_layers(r: int) -> str:
        g = group_of_sorted[np.flatnonzero(order == r)[0]]
        have = lay_s[group_start[g] : group_start[g] + group_size[g]]
        lacking = np.setdiff1d(layer_ids, have).tolist()
        return f"{where(r)} lacks layer(s) {lacking} (the table's layers are {layer_ids.tolist()})"

    incomplete = np.zeros(n, bool)
    incomplete[group_first_row[group_size < num_layers]] = True
    _first(problems, incomplete, missing_layers)

    # positions of each request must run 0, 1, 2, ...: compare each group's position with its rank in the request
    request_start = np.concatenate([[True], group_req[1:] != group_req[:-1]])
    rank = np.arange(len(group_start)) - np.maximum.accumulate(np.where(request_start, np.arange(len(group_start)), 0))
    gap = np.zeros(n, bool)
    gap[group_first_row[group_pos != rank]] = True

    def gap_message(r: int) -> str:
        g = group_of_sorted[np.flatnonzero(order == r)[0]]
        if rank[g] == 0:
            return f"{where(r)}: the request's positions start at {group_pos[g]}, not 0"
        return f"{where(r)}: position {group_pos[g - 1] + 1} of the request is missing (positions must be 0..length-1)"

    _first(problems, gap, gap_message)

    token_of_group = token_ids[group_first_row]
    mismatch = np.zeros(n, bool)
    mismatch[order] = token_ids[order] != token_of_group[group_of_sorted]
    _first(problems, mismatch, lambda r: f"{where(r)} layer {layers[r]} has token {token_name(token_ids[r])} but the "
           f"same position has token {token_name(token_of_group[group_of_sorted[np.flatnonzero(order == r)[0]]])} "
           "at another layer")

    if labels is not None:
        first_row_of_request = np.unique(request_codes, return_index=True)[1]
        label_of_request = labels[first_row_of_request]
        _first(problems, labels != label_of_request[request_codes],
               lambda r: f"{label_col} {labels[r]!r} differs from {label_of_request[request_codes[r]]!r} given "
               f"earlier for {request_col} {request_names[request_codes[r]]!s} (one label per request)")
    return order, layer_ids


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


def _raise_first(problems: list[_Problem], locate: _RowLocator) -> None:
    first = min(problems, key=lambda p: p.row)  # min is stable: equal rows keep check order
    raise TraceError(f"{locate.path} {locate(first.row)}: {first.what}; fix that row and import again.")
