"""Tabular trace importer: round trips in three formats, one test per validation error (also across batches),
the CLI. The streaming-specific tests are in test_traces_stream.py."""

import importlib
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from repro.errors import TraceError
from repro.traces import TraceMeta, make_trace, read_trace
from repro.traces.tabular import import_table, import_table_with_vocab

cli = importlib.import_module("repro.traces.import")  # "import" is a keyword: no plain import statement


def random_trace(rng, num_requests=5, layer_ids=(0, 7, 15), num_experts=8, top_k=2, with_weights=True):
    lengths = rng.integers(1, 7, num_requests)
    n = int(lengths.sum())
    experts = np.argsort(rng.random((n, len(layer_ids), num_experts)), axis=2)[..., :top_k]
    weights = rng.random((n, len(layer_ids), top_k)).astype(np.float16) if with_weights else None
    meta = TraceMeta(model="m", num_experts=num_experts, top_k=top_k, layer_ids=layer_ids, vocab_size=1000)
    return make_trace(
        meta,
        np.concatenate([[0], np.cumsum(lengths)]),
        rng.integers(0, 1000, n),
        experts,
        request_ids=[f"r{i:03d}" for i in range(num_requests)],
        request_labels=[f"class{i % 2}" for i in range(num_requests)],
        weights=weights,
    )


def table_of(trace, rng, shuffle=True) -> pd.DataFrame:
    """One row per (request, position, layer), rows shuffled so the importer has to sort."""
    rows = []
    for r in range(trace.num_requests):
        for p in range(int(trace.lengths()[r])):
            t = trace.offsets[r] + p
            for li, layer in enumerate(trace.meta.layer_ids):
                rows.append(
                    dict(
                        request_id=trace.request_ids[r],
                        position=p,
                        layer=layer,
                        token_id=int(trace.token_ids[t]),
                        experts=[int(e) for e in trace.experts[t, li]],
                        label=trace.request_labels[r],
                    )
                )
                if trace.weights is not None:
                    rows[-1]["weights"] = [float(w) for w in trace.weights[t, li]]
    df = pd.DataFrame(rows)
    if shuffle:
        # keep each request's first row first so the order of first appearance is the trace's request order
        first = ~df.duplicated("request_id")
        rest = df[~first].sample(frac=1.0, random_state=int(rng.integers(1 << 30)))
        df = pd.concat([df[first], rest], ignore_index=True)
    return df


def write_table(df: pd.DataFrame, path: Path) -> Path:
    if path.suffix == ".csv":
        out = df.copy()
        for col in ("experts", "weights"):
            if col in out:
                out[col] = out[col].map(json.dumps)
        out.to_csv(path, index=False)
    elif path.suffix == ".jsonl":
        df.to_json(path, orient="records", lines=True)
    else:
        df.to_parquet(path, index=False)
    return path


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_round_trip_every_format(tmp_path, suffix):
    rng = np.random.default_rng(1)
    trace = random_trace(rng)
    path = write_table(table_of(trace, rng), tmp_path / f"routing{suffix}")
    got = import_table(path, num_experts=8, vocab_size=1000, model="m")
    np.testing.assert_array_equal(got.offsets, trace.offsets)
    np.testing.assert_array_equal(got.token_ids, trace.token_ids)
    np.testing.assert_array_equal(got.experts, trace.experts)  # slot order kept, not sorted
    np.testing.assert_array_equal(got.weights, trace.weights)  # float16 -> text/float64 -> float16 is exact
    assert got.request_ids == trace.request_ids
    assert got.request_labels == trace.request_labels
    assert got.meta.layer_ids == (0, 7, 15) and got.meta.top_k == 2 and got.meta.num_experts == 8
    assert got.meta.source == f"import:routing{suffix}" and got.meta.dataset == "routing"


def test_defaults_are_inferred_and_recorded(tmp_path):
    rng = np.random.default_rng(2)
    trace = random_trace(rng, with_weights=False)
    df = table_of(trace, rng).drop(columns=["label"])
    got = import_table(write_table(df, tmp_path / "t.parquet"))
    assert got.meta.num_experts == int(trace.experts.max()) + 1
    assert got.meta.vocab_size == int(trace.token_ids.max()) + 1
    assert got.meta.top_k == 2 and got.weights is None
    assert got.meta.extra["inferred"] == ["num_experts", "vocab_size"]


def test_surface_tokens_build_a_vocabulary_in_order_of_first_appearance(tmp_path):
    rows = []
    for request, words in [("a", ["the", "cat", "the"]), ("b", ["dog", ",", "cat"])]:
        for p, w in enumerate(words):
            for layer in (0, 1):
                rows.append(dict(request_id=request, position=p, layer=layer, token=w, experts=[layer, 2 + p]))
    trace, vocab = import_table_with_vocab(write_table(pd.DataFrame(rows), tmp_path / "t.csv"))
    assert vocab == ["the", "cat", "dog", ","]
    np.testing.assert_array_equal(trace.token_ids, [0, 1, 0, 2, 3, 1])
    assert trace.meta.tokenizer == "vocab.json" and trace.meta.vocab_size == 4
    np.testing.assert_array_equal(trace.experts[:, 1, 1], [2, 3, 4, 2, 3, 4])


def test_csv_request_ids_stay_text(tmp_path):
    rows = [dict(request_id="007", position=0, layer=0, token_id=5, experts=[1, 0])]
    trace = import_table(write_table(pd.DataFrame(rows), tmp_path / "t.csv"))
    assert trace.request_ids == ("007",)


# ---- validation: one test per error, each naming the first bad row -------------------------------------------

def small_table() -> pd.DataFrame:
    """2 requests x 2 positions x 2 layers; file order = (request, position, layer)."""
    rows = []
    for request in ("a", "b"):
        for p in range(2):
            for layer in (0, 3):
                rows.append(dict(request_id=request, position=p, layer=layer, token_id=10 + p,
                                 experts=[p, 2 + layer], label=f"L{request}"))
    return pd.DataFrame(rows)


def import_error(tmp_path, df, suffix=".csv", **options) -> str:
    path = write_table(df, tmp_path / f"bad{options.get('batch_rows', '')}{suffix}")
    with pytest.raises(TraceError) as e:
        import_table(path, **options)
    return str(e.value)


@pytest.mark.parametrize(
    "mutate, row, words",
    [
        (lambda df: df.drop(index=5), 4, "lacks layer(s) [3]"),  # b/0: layer 3 gone; its first row is row 4
        (lambda df: df.assign(layer=df.layer.where(df.index != 7, 0)), 7, "layer 0 appears twice"),
        (lambda df: df.assign(position=df.position.where(df.index < 6, 2)), 6, "position 1 of the request is missing"),
        (lambda df: df.assign(position=df.position.where(df.request_id != "b", df.position + 1)), 4, "start at 1, not 0"),
        (lambda df: df.assign(experts=[e if i != 3 else [1, 2, 3] for i, e in enumerate(df.experts)]), 3, "has 3 entries"),
        (lambda df: df.assign(experts=[e if i != 2 else [4, 4] for i, e in enumerate(df.experts)]), 2, "repeats an expert"),
        (lambda df: df.assign(experts=[e if i != 1 else [-1, 2] for i, e in enumerate(df.experts)]), 1, "negative expert id"),
        (lambda df: df.assign(token_id=df.token_id.where(df.index != 7, 99)), 7, "has token 99"),
        (lambda df: df.assign(label=df.label.where(df.index != 6, "other")), 6, "one label per request"),
        (lambda df: df.assign(position=df.position.where(df.index != 2, -1)), 2, "is negative"),
    ],
    ids=["missing-layer", "duplicate-layer", "gap", "not-from-zero", "k-differs", "repeated-expert",
         "negative-expert", "token-differs", "label-differs", "negative-position"],
)
@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
@pytest.mark.parametrize("batch_rows", [3, 250_000])  # batches that cut tokens and requests; one batch
def test_each_error_names_the_first_bad_row(tmp_path, suffix, mutate, row, words, batch_rows):
    df = mutate(small_table())
    message = import_error(tmp_path, df.reset_index(drop=True), suffix=suffix, batch_rows=batch_rows)
    where = {".csv": f"line {row + 2}", ".jsonl": f"line {row + 1}", ".parquet": f"row {row + 1}"}[suffix]
    assert f"{where}:" in message and words in message, message


def test_the_earliest_of_several_problems_is_reported(tmp_path):
    df = small_table()
    df.loc[6, "experts"] = [1, 1]  # row-level problem, late
    df.loc[1, "token_id"] = 42  # structural problem, early
    assert "line 3:" in import_error(tmp_path, df)


def test_malformed_csv_list_names_its_line(tmp_path):
    df = small_table()
    df["experts"] = df["experts"].map(json.dumps)
    df.loc[3, "experts"] = "[1; 2]"
    path = tmp_path / "t.csv"
    df.to_csv(path, index=False)
    with pytest.raises(TraceError, match=r"line 5: experts '\[1; 2\]' is not a JSON list"):
        import_table(path)


def test_expert_id_beyond_num_experts(tmp_path):
    assert "line 3: experts [0, 5] has an expert id not below 4 (--num-experts)" in import_error(
        tmp_path, small_table(), num_experts=4
    )


def test_csv_line_numbers_count_quoted_newlines(tmp_path):
    df = small_table()
    df["experts"] = df["experts"].map(json.dumps)
    df.loc[0:3, "label"] = "La\nmulti-line"  # rows 0-3 each span two lines (a quoted newline): lines 2-9
    df.loc[5, "experts"] = "[2, 2]"  # row 4 is line 10, row 5 line 11
    path = tmp_path / "t.csv"
    df.to_csv(path, index=False)
    with pytest.raises(TraceError, match="line 11: experts"):
        import_table(path)


def test_missing_column_and_unknown_suffix(tmp_path):
    assert "no experts column 'experts'" in import_error(tmp_path, small_table().drop(columns=["experts"]))
    path = tmp_path / "t.txt"
    path.write_text("x")
    with pytest.raises(TraceError, match="--format"):
        import_table(path)


# ---- the command line --------------------------------------------------------------------------------------

def test_cli_writes_a_readable_trace_and_vocab(tmp_path, capsys):
    rows = [dict(request_id="q", position=p, layer=0, token=w, experts=[p, 3]) for p, w in enumerate(["hi", "there"])]
    src = write_table(pd.DataFrame(rows), tmp_path / "in.jsonl")
    assert cli.main([str(src), "--out", str(tmp_path / "trace"), "--model", "mixtral"]) == 0
    trace = read_trace(tmp_path / "trace")
    assert trace.meta.model == "mixtral" and trace.num_tokens == 2
    assert json.loads((tmp_path / "trace" / "vocab.json").read_text()) == ["hi", "there"]
    assert "using 4 from the data" in capsys.readouterr().err  # num_experts inferred: said so


def test_cli_bad_input_exits_2_with_one_sentence_and_writes_nothing(tmp_path, capsys):
    df = small_table().drop(index=5)
    src = write_table(df, tmp_path / "in.csv")
    assert cli.main([str(src), "--out", str(tmp_path / "trace")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "line 6:" in err and "Traceback" not in err
    assert not (tmp_path / "trace").exists()


# ---- the compiled "[3, 5]" parser equals the pattern it replaced ---------------------------------------------------

LIST_ALPHABET = st.sampled_from(["[", "]", ",", " ", "\t", "-", "0", "3", "12", "+", "x", "\n", "5"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.lists(LIST_ALPHABET, max_size=8).map("".join),
                          st.lists(st.integers(-300, 300), max_size=5).map(str),
                          st.just("[" + "9" * 19 + "]")), min_size=1, max_size=20))
def test_int_list_parser_matches_the_pattern(cells):
    """Malformed exactly where INT_LIST_PATTERN (Arrow's RE2, whose \\s is [\\t\\n\\f\\r ]) does not match or a
    number has more than 18 digits; values are int() of the pieces."""
    from repro.traces.int_lists import parse_int_lists, string_buffers
    from repro.traces.tabular import INT_LIST_PATTERN

    column = pa.array([*cells, None], type=pa.string())
    flat, lengths, malformed = parse_int_lists(*string_buffers(column), np.array([False] * len(cells) + [True]))
    pattern = re.compile(INT_LIST_PATTERN.replace(r"\s", r"[\t\n\f\r ]"))
    whitespace = " \t\n\f\r"
    expected_values, expected_lengths, expected_malformed = [], [], []
    for cell in cells:
        inner = cell.strip(whitespace)[1:-1].strip(whitespace)
        values = [int(piece) for piece in inner.split(",")] if pattern.match(cell) and inner else []
        bad = pattern.match(cell) is None or any(len(str(abs(v))) > 18 for v in values)
        expected_malformed.append(bad)
        expected_lengths.append(0 if bad else len(values))
        expected_values += [] if bad else values
    assert malformed.tolist() == [*expected_malformed, False]  # the null cell is not malformed, and empty
    assert lengths.tolist() == [*expected_lengths, 0]
    assert flat.tolist() == expected_values


def test_int_list_parser_reads_sliced_and_large_string_arrays():
    from repro.traces.int_lists import parse_int_lists, string_buffers

    for column in (pa.array(["[9]", "[1, 2]", " [ -3 ] "])[1:], pa.array(["[9]", "[1, 2]", " [ -3 ] "], type=pa.large_string())[1:]):
        flat, lengths, malformed = parse_int_lists(*string_buffers(column), np.zeros(2, bool))
        assert flat.tolist() == [1, 2, -3] and lengths.tolist() == [2, 1] and not malformed.any()


# ---- the optional arrival-time column: kept beside the trace, requests in arrival order --------------------------

@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_arrival_time_column_is_kept_in_request_order(tmp_path, suffix):
    from repro.traces.tabular import import_table_to_dir, read_arrival_times

    df = small_table().assign(arrival_time=lambda d: d.request_id.map({"a": 0.5, "b": 0.5}))  # ties are allowed
    df.loc[df.request_id == "b", "arrival_time"] = 2.25
    path = write_table(df, tmp_path / f"arrivals{suffix}")
    import_table_to_dir(path, tmp_path / "trace")
    assert read_arrival_times(tmp_path / "trace").tolist() == [0.5, 2.25]
    assert read_trace(tmp_path / "trace").request_ids == ("a", "b")
    plain = write_table(small_table(), tmp_path / f"plain{suffix}")
    import_table_to_dir(plain, tmp_path / "plain")
    assert read_arrival_times(tmp_path / "plain") is None


@pytest.mark.parametrize(
    "arrivals, row, words",
    [
        ({"a": 3.0, "b": 1.0}, 4, "arrives at arrival_time 1.0, before a listed before it"),
        ({"a": float("nan"), "b": 1.0}, 0, "is not a finite number of seconds >= 0"),
        ({"a": float("inf"), "b": 1.0}, 0, "is not a finite number of seconds >= 0"),
        ({"a": -1.0, "b": 1.0}, 0, "is not a finite number of seconds >= 0"),
    ],
    ids=["out-of-order", "nan", "inf", "negative"],
)
def test_bad_arrival_times_are_refused_in_one_sentence(tmp_path, arrivals, row, words):
    df = small_table().assign(arrival_time=lambda d: d.request_id.map(arrivals))
    message = import_error(tmp_path, df, suffix=".parquet")
    assert f"row {row + 1}:" in message and words in message, message
    assert message.count(". ") == 0, message  # one sentence


def test_arrival_time_must_be_one_per_request_and_a_number(tmp_path):
    df = small_table().assign(arrival_time=1.0)
    df.loc[2, "arrival_time"] = 1.5
    assert "one arrival time per request" in import_error(tmp_path, df, suffix=".jsonl")
    text = small_table().assign(arrival_time="soon")
    assert "'soon' is not a finite number of seconds" in import_error(tmp_path, text, suffix=".csv")
