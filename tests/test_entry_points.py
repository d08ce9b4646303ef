"""The contract of every entry point (DESIGN.md "Every entry point keeps one contract"), checked on every entry point
this test can find, so that a new one is held to it without being listed anywhere.

Discovery: every module under repro/ and bench/ with an `if __name__ == "__main__":` block (and every __main__.py).
A module is either a Hydra app (`@hydra.main`: its config checks live in repro.config_schema and test_audit.py's
table), an argparse app whose `main(argv)` builds a repro.cli.ArgumentParser (captured here without running
anything: the first parse raises), or one of the INTERNAL helpers below, with the reason it is not a user's entry
point. Then every typed option of every argparse app (and of each subcommand) is driven with values its kind must
refuse (hypothesis strategies: negative, zero, NaN, inf, huge, empty, wrong type; missing paths, a folder where a
file belongs), and the refusal must be: exit code 2, one `error:` line naming the option, no traceback, nothing
written in the working folder. The default run is deterministic and small (make test); `make test-fuzz` runs the
`fuzz`-marked tests with many more examples and every entry point as a subprocess.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from repro import cli

ROOT = Path(__file__).resolve().parents[1]

# modules with a __main__ block that are not a user's entry point, and why
INTERNAL = {
    "bench.bench_baselines": "a benchmark module: run by `python -m bench --only baselines`, whose flags are checked",
    "bench.bench_disaggregated": "a benchmark module: run by `python -m bench`",
    "bench.bench_kernels": "a benchmark module: run by `python -m bench`",
    "bench.bench_oracle": "a benchmark module: run by `python -m bench`",
    "bench.bench_router": "a benchmark module: run by `python -m bench`; --fake-upstream is its own child process",
    "bench.bench_semmoe": "a benchmark module: run by `python -m bench`",
    "bench.bench_signature": "a benchmark module: run by `python -m bench`",
    "bench.engine_cpu_moe": "run by bench.engine_cpu in the engine's own venv, which has no repro package",
    "bench.engine_cpu_capture": "run by bench.engine_cpu in the engine's own venv with two paths it made itself",
}
# argparse apps still on plain argparse types, and why (each is a known gap of issue 35, not a pass)
NOT_YET: dict[str, str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__main__" else parts)


def has_main_block(source: str) -> bool:
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            names = {getattr(n, "id", None) for n in ast.walk(node.test)}
            values = {getattr(n, "value", None) for n in ast.walk(node.test)}
            if "__name__" in names and "__main__" in values:
                return True
    return False


def discover() -> dict[str, str]:
    """{module: "hydra" | "argparse" | "internal"} of every entry point under repro/ and bench/."""
    found = {}
    for folder in ("repro", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            source = path.read_text()
            if path.name == "__main__.py" or has_main_block(source):
                name = module_name(path)
                found[name] = ("internal" if name in INTERNAL else "hydra" if "@hydra.main" in source else "argparse")
    return found


ENTRY_POINTS = discover()


class Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def captured_parser(module: str) -> argparse.ArgumentParser:
    """The parser `module.main(argv)` builds, taken at its first parse: nothing of the command runs."""
    package_main = (ROOT / module.replace(".", "/") / "__main__.py").is_file()
    main = importlib.import_module(f"{module}.__main__" if package_main else module).main

    def capture(self, args=None, namespace=None):
        raise Captured(self)

    saved = argparse.ArgumentParser.parse_known_args, cli.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_known_args = cli.ArgumentParser.parse_known_args = capture
    try:
        main([])
    except Captured as got:
        return got.parser
    finally:
        argparse.ArgumentParser.parse_known_args, cli.ArgumentParser.parse_known_args = saved
    raise AssertionError(f"{module}.main(argv) returned without parsing its arguments; build its command line on "
                         "repro.cli.ArgumentParser")


@dataclass(frozen=True)
class Option:
    module: str
    prefix: tuple[str, ...]  # the subcommands before it
    flag: str
    kind: object  # the action's type

    def __str__(self) -> str:
        return " ".join([self.module, *self.prefix, self.flag])


def options_of(module: str) -> list[Option]:
    """Every option (with a type) of the module's parser and of each of its subcommands' parsers."""
    found = []

    def walk(parser: argparse.ArgumentParser, prefix: tuple[str, ...]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*prefix, name))
            elif action.option_strings and action.type is not None and action.nargs != 0:
                found.append(Option(module, prefix, action.option_strings[-1], action.type))

    walk(captured_parser(module), ())
    return found


ARGPARSE_APPS = sorted(m for m, kind in ENTRY_POINTS.items() if kind == "argparse")
TYPED_OPTIONS = [o for m in ARGPARSE_APPS if m not in NOT_YET for o in options_of(m)]


def test_discovery_finds_the_entry_points_this_suite_documents():
    """Positive control of the discovery: the documented entry points of each kind are found and classified."""
    assert {"repro.run": "hydra", "repro.tune": "hydra"}.items() <= ENTRY_POINTS.items()
    for module in ("repro.affinity.partial", "repro.engines.sglang", "repro.sim.trust", "bench.cpu_check", "bench",
                   "repro.figures", "repro.traces.import"):
        assert ENTRY_POINTS[module] == "argparse", module
    assert set(INTERNAL) <= set(ENTRY_POINTS), "an INTERNAL entry that no longer exists: remove it"
    assert len(TYPED_OPTIONS) > 40


@pytest.mark.parametrize("module", [m for m in ARGPARSE_APPS if m not in NOT_YET])
def test_every_argparse_app_is_built_on_the_shared_parser(module):
    parser = captured_parser(module)
    assert isinstance(parser, cli.ArgumentParser), f"{module}: build its parser with repro.cli.ArgumentParser"


@pytest.mark.parametrize("option", TYPED_OPTIONS, ids=str)
def test_every_number_option_has_a_shared_kind(option):
    """A bare int or float takes -1, 1e308 or inf for a count, a port or a timeout; a shared kind says its range."""
    assert option.kind not in (int, float), f"{option}: type={option.kind.__name__}; use a repro.cli kind"


# output options that keep the contract by a check of their own (not repro.cli's claim), and how
OWN_OUTPUT_RULES = {
    ("bench", "--out"): "regenerates its own bench/results/<name>.json and SUMMARY.md",
    ("bench.bench_fit_scale", "out"): "a scratch folder of generated shards for the scaling benchmark",
    ("bench.cpu_check", "--out"): "checks every file it will write (cpu_check.json, both profiles) before calibrating",
    ("bench.engine_cpu", "--out"): "regenerates its own results folder",
    ("bench.gpu_check", "--out"): "a results folder per GPU run",
    ("repro.engines.bench_serving", "--out"): "claims <out>/real_per_rate.csv before any request (--overwrite)",
    ("repro.engines.capture", "--out"): "a trace folder: refuses a trace without --overwrite, and anything else",
    ("repro.figures", "--out"): "regenerates the report's own figures folder; refuses a file",
    ("repro.figures.breakeven", "--out"): "regenerates the report's own figures folder",
    ("repro.figures.diff", "--out"): "check_out_dir: a folder, never a file",
    ("repro.figures.table2", "--out"): "regenerates the report's own figures folder",
    ("repro.sim.breakeven", "--out"): "replaces only its own earlier output; anything else there is refused",
    ("repro.traces.import", "--out"): "a trace folder: refuses a trace without --overwrite, and anything else",
    ("repro.traces.shards", "out"): "refuses an existing shards.json without --overwrite",
}


def output_options() -> list[tuple[str, str, object]]:
    """(module, flag or positional name, type) of every argument named like an output (--out, out)."""
    found = []

    def walk(module: str, parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(module, sub)
            elif action.dest == "out":
                found.append((module, (action.option_strings or [action.dest])[0], action.type))

    for module in ARGPARSE_APPS:
        walk(module, captured_parser(module))
    return found


def test_every_output_is_claimed_or_has_its_own_stated_rule():
    """A new entry point's --out either goes through repro.cli's claim or is added to OWN_OUTPUT_RULES with how it
    keeps the contract; a listed rule whose output is gone (or now claimed) must be removed."""
    outputs = output_options()
    unclaimed = {(m, flag) for m, flag, kind in outputs if not isinstance(kind, cli.OutputPath)}
    missing = sorted(unclaimed - set(OWN_OUTPUT_RULES))
    assert not missing, f"outputs with no claim and no stated rule: {missing}"
    assert set(OWN_OUTPUT_RULES) <= unclaimed, f"stale rules: {sorted(set(OWN_OUTPUT_RULES) - unclaimed)}"
    assert any(isinstance(kind, cli.OutputPath) for _, _, kind in outputs)  # positive control: claims are found


# ---- generated bad values ----------------------------------------------------------------------------------------

# "--": argparse drops it before any type sees it (`--n=--` set n to None); repro.cli.ArgumentParser refuses it
WRONG_TYPE = st.sampled_from(["", " ", "abc", "1,2", "0x10", "None", "[]", "\x00", "--"])


def bad_values(kind) -> st.SearchStrategy[str]:
    """Strings that `kind` must refuse."""
    if isinstance(kind, cli.Integer):
        below = st.integers(max_value=kind.low - 1) if kind.low is not None else st.nothing()
        return st.one_of(below.map(str), st.integers(min_value=kind.high + 1).map(str), WRONG_TYPE,
                         st.sampled_from(["nan", "inf", "-inf", "1.5", "4.0", "1e3"]))
    if isinstance(kind, cli.Number):
        below = (st.floats(max_value=kind.low, exclude_max=not kind.low_open, allow_nan=False, allow_infinity=False)
                 if kind.low is not None else st.nothing())
        above = (st.floats(min_value=kind.high, exclude_min=not kind.high_open, allow_nan=False, allow_infinity=False)
                 if kind.high is not None else st.nothing())
        return st.one_of(below.map(repr), above.map(repr), WRONG_TYPE.filter(str.strip),
                         st.sampled_from(["nan", "inf", "-inf", "NaN", "1e999"]))
    if isinstance(kind, cli.InputPath):
        missing = st.text("abcxyz_", min_size=1, max_size=12).map(lambda s: f"missing_{s}")
        wrong_sort = {"file": st.just("a_folder"), "dir": st.just("a_file"), "any": st.nothing()}[kind.what]
        return st.one_of(missing, wrong_sort, st.just(""))
    if isinstance(kind, cli.Url):
        return st.one_of(WRONG_TYPE, st.sampled_from(["127.0.0.1:8000", "ftp://h", "http://", "http://h:0",
                                                      "http://h:65536", "http://h:-1", "http://[::1", "http://h x"]),
                         st.integers(65536, 10**30).map(lambda port: f"http://127.0.0.1:{port}"))
    if isinstance(kind, cli.OutputPath):
        if kind.suffixes:
            return st.sampled_from(["out.txt", "out", "out" + kind.suffixes[0] + ".bak"])
        return st.just("") if kind.what == "dir" else st.sampled_from(["", "a_folder/"])
    return st.nothing()


FUZZED = [o for o in TYPED_OPTIONS if not bad_values(o.kind).is_empty]


def refusal(option: Option, value: str, folder: Path) -> tuple[int | None, str]:
    """(exit code, stderr) of parsing `option value` (in `folder`, which holds a_file and a_folder)."""
    parser = captured_parser(option.module)
    err = io.StringIO()
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args([*option.prefix, f"{option.flag}={value}"])
    except SystemExit as stop:
        return stop.code, err.getvalue()
    finally:
        os.chdir(cwd)
    return None, err.getvalue()


def assert_refused(option: Option, value: str, folder: Path) -> None:
    before = sorted(p.name for p in folder.iterdir())
    code, err = refusal(option, value, folder)
    lines = err.strip().splitlines()
    assert code == 2, f"{option}={value!r} was taken (stderr: {err!r})"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{option}={value!r}: {err!r}"
    assert option.flag in lines[0] and "Traceback" not in err, f"{option}={value!r}: {err!r}"
    assert sorted(p.name for p in folder.iterdir()) == before, f"{option}={value!r} wrote into the working folder"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cwd")
    (folder / "a_file").write_text("x")
    (folder / "a_folder").mkdir()
    return folder


@pytest.mark.parametrize("option", FUZZED, ids=str)
def test_each_option_refuses_the_plainest_bad_value(option, folder):
    """One fixed bad value per option (deterministic coverage of every option, whatever hypothesis draws)."""
    plain = {cli.Integer: "-1" if getattr(option.kind, "low", None) is not None else "abc", cli.Number: "nan",
             cli.InputPath: "missing_path", cli.OutputPath: "", cli.Url: "not-a-url"}
    assert_refused(option, next(v for t, v in plain.items() if isinstance(option.kind, t)), folder)


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_generated_bad_values_are_refused_by_every_option(data, folder):
    option = data.draw(st.sampled_from(FUZZED), label="option")
    assert_refused(option, data.draw(bad_values(option.kind), label="value"), folder)


@pytest.mark.fuzz
@settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_generated_bad_values_at_length(data, folder):
    option = data.draw(st.sampled_from(FUZZED), label="option")
    assert_refused(option, data.draw(bad_values(option.kind), label="value"), folder)


# ---- every entry point as the user runs it -----------------------------------------------------------------------


@pytest.mark.fuzz
@pytest.mark.parametrize("module", sorted(m for m, kind in ENTRY_POINTS.items() if kind != "internal"))
def test_an_unknown_flag_is_one_line_exit_2_and_writes_nothing(module, tmp_path):
    """`python -m MODULE --no-such-flag=1` from an empty folder (Hydra apps: `+no_such_key=1`)."""
    bad = "+no_such_key=1" if ENTRY_POINTS[module] == "hydra" else "--no-such-flag=1"
    env = dict(os.environ, WANDB_MODE="disabled", REPRO_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", module, bad, *(["logger=none"] if module in ("repro.run", "repro.tune")
                                                                 else [])],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:") or ": error:" in line]
    assert res.returncode == 2 and len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert list(tmp_path.iterdir()) == [], f"{module} wrote {sorted(p.name for p in tmp_path.iterdir())}"


# ---- hostile trace inputs ----------------------------------------------------------------------------------------

import_main = importlib.import_module("repro.traces.import").main  # `import` is a keyword: no plain import


def table_rows(requests: int = 2, positions: int = 3, layers: int = 2) -> list[dict]:
    return [{"request_id": f"r{r}", "position": i, "layer": layer, "token_id": 3 + i, "experts": [layer, 2 + i]}
            for r in range(requests) for i in range(positions) for layer in range(layers)]


# how a table is spoiled -> (whether the importer must refuse it, what to do to the rows or the text)
def _deep(rows, depth, escape):
    rows[-1]["request_id"] = "r1\\" if escape else "r1"  # a string ending in an escaped backslash
    return rows, ("experts", "[" * depth + "1" + "]" * depth)


HOSTILE = {
    "deep nesting": (True, lambda rows, n: _deep(rows, 33 + n % 5000, escape=False)),
    "deep nesting after an escaped backslash": (True, lambda rows, n: _deep(rows, 33 + n % 5000, escape=True)),
    "expert out of range": (True, lambda rows, n: (rows[n % len(rows)].update(experts=[0, 16 + n]) or rows, None)),
    "negative expert": (True, lambda rows, n: (rows[n % len(rows)].update(experts=[0, -1 - n % 3]) or rows, None)),
    "duplicate row": (True, lambda rows, n: (rows + [dict(rows[n % len(rows)])], None)),
    "inconsistent top-k": (True, lambda rows, n: (rows[n % len(rows)].update(experts=[0, 1, 2]) or rows, None)),
    "negative token id": (True, lambda rows, n: (rows[n % len(rows)].update(token_id=-1 - n) or rows, None)),
    "non-integer token id": (True, lambda rows, n: (rows[n % len(rows)].update(token_id=1.5) or rows, None)),
    "NaN gate weight": (True, lambda rows, n: ([dict(r, weights=[0.5, float("nan") if i == n % len(rows) else 0.5])
                                                for i, r in enumerate(rows)], None)),
    "huge cell": (False, lambda rows, n: (rows[n % len(rows)].update(note="x" * (10_000 + 1000 * n)) or rows, None)),
}


def hostile_table(folder: Path, kind: str, n: int, compressed: bool) -> tuple[Path, list[str]]:
    import gzip
    import json

    rows, raw_cell = HOSTILE[kind][1](table_rows(), n)
    lines = [json.dumps(r) for r in rows]
    if raw_cell is not None:  # a cell json.dumps cannot write (nesting deeper than its recursion allows)
        key, text = raw_cell
        lines[-1] = lines[-1].replace(f'"{key}": {json.dumps(rows[-1][key])}', f'"{key}": {text}')
    data = ("\n".join(lines) + "\n").encode()
    path = folder / ("routing.jsonl.gz" if compressed else "routing.jsonl")
    path.write_bytes(gzip.compress(data) if compressed else data)
    return path, ["--format", "jsonl", "--num-experts", "16"]


def assert_import_keeps_the_contract(kind: str, n: int, compressed: bool) -> None:
    import tempfile

    from repro.traces import read_trace

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        table, flags = hostile_table(folder, kind, n, compressed)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = import_main([str(table), "--out", str(folder / "trace"), *flags])
        must_refuse = HOSTILE[kind][0]
        if code == 0 and not must_refuse:
            read_trace(folder / "trace")  # what it wrote is a valid trace
            return
        errors = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
        assert code == 2, f"{kind} (n={n}, gzip={compressed}) was imported (exit {code})"
        assert len(errors) == 1 and "Traceback" not in err.getvalue(), err.getvalue()[-2000:]
        assert [p.name for p in folder.iterdir()] == [table.name], f"{kind}: left {list(folder.iterdir())}"


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_each_hostile_table_is_refused_or_imported_whole(kind):
    assert_import_keeps_the_contract(kind, 0, compressed=False)


@settings(max_examples=40, derandomize=True, deadline=None)
@given(kind=st.sampled_from(sorted(HOSTILE)), n=st.integers(0, 10_000), compressed=st.booleans())
def test_generated_hostile_tables(kind, n, compressed):
    assert_import_keeps_the_contract(kind, n, compressed)


@pytest.mark.fuzz
@settings(max_examples=1000, deadline=None)
@given(kind=st.sampled_from(sorted(HOSTILE)), n=st.integers(0, 100_000), compressed=st.booleans())
def test_generated_hostile_tables_at_length(kind, n, compressed):
    assert_import_keeps_the_contract(kind, n, compressed)
