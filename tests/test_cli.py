"""repro.cli: the shared argument kinds, the output claim and the parser every entry point is built on."""

import os

import pytest

from repro import cli
from repro.atomic import atomic_write


@pytest.mark.parametrize("kind, good, bad", [
    (cli.count, {"0": 0, "7": 7, str(2**63 - 1): 2**63 - 1}, ["-1", "4.0", "1e3", "abc", "", " ", str(2**63)]),
    (cli.positive, {"1": 1}, ["0", "-3", "nan"]),
    (cli.seed, {"0": 0, str(2**32 - 1): 2**32 - 1}, [str(2**32), "1e23", "-1"]),
    (cli.port, {"8080": 8080}, ["0", "65536", "-1"]),
    (cli.rate, {"0.5": 0.5, "1e3": 1000.0}, ["0", "-1", "nan", "inf", "-inf", "abc", ""]),
    (cli.non_negative, {"0": 0.0}, ["-0.1", "nan"]),
    (cli.probability, {"0": 0.0, "1": 1.0, "0.25": 0.25}, ["1.5", "-0.5", "nan"]),
    (cli.url, {u: u for u in ("http://127.0.0.1:30000", "https://host/v1", "http://[::1]:8000", "http://h")},
     ["", "not-a-url", "127.0.0.1:8000", "ftp://h", "http://", "http://h:0", "http://h:65536", "http://[::1",
      "http://h x", "http://h:1\n"]),
])
def test_each_kind_takes_what_it_says_and_refuses_the_rest(kind, good, bad):
    for text, value in good.items():
        assert kind(text) == value
    for text in bad:
        with pytest.raises(Exception) as error:
            kind(text)
        assert f"must be {kind.takes}, got {text!r}" in str(error.value)


def parse(parser: cli.ArgumentParser, argv, capsys) -> tuple[int | None, str]:
    try:
        parser.parse_args([str(a) for a in argv])
    except SystemExit as stop:
        return stop.code, capsys.readouterr().err
    return None, capsys.readouterr().err


def export_parser() -> cli.ArgumentParser:
    parser = cli.ArgumentParser(prog="python -m export")
    parser.add_argument("config", type=cli.existing_file)
    parser.add_argument("--shard", type=cli.count, default=0)
    cli.add_output(parser, "--out", suffix=".json")
    return parser


def assert_refused(code, err, fragment):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err


def test_a_refused_value_is_one_line_and_exit_2(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text("{}")
    assert_refused(*parse(export_parser(), [config, "--shard", "-1", "--out", tmp_path / "o.json"], capsys),
                   "argument --shard: must be an integer >= 0 that fits in 64 bits, got '-1'")
    assert_refused(*parse(export_parser(), [tmp_path / "missing.json", "--out", tmp_path / "o.json"], capsys),
                   "must be an existing file")
    assert_refused(*parse(export_parser(), [config], capsys), "The following arguments are required: --out")
    assert_refused(*parse(export_parser(), [config, "--out", tmp_path / "o.csv"], capsys), "ending in .json")
    assert_refused(*parse(export_parser(), [config, "--shard=--", "--out", tmp_path / "o.json"], capsys),
                   "argument --shard: expected a value, got '--'")  # argparse alone set shard to None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_an_output_is_never_an_input_and_never_replaced_without_overwrite(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text("{}")
    for extra in ([], ["--overwrite"]):  # an input stays an input, --overwrite or not
        assert_refused(*parse(export_parser(), [config, "--out", config, *extra], capsys), "is one of this command's inputs")
    existing = tmp_path / "old.json"
    existing.write_text("keep")
    assert_refused(*parse(export_parser(), [config, "--out", existing], capsys), "exists; pass --overwrite")
    assert parse(export_parser(), [config, "--out", existing, "--overwrite"], capsys)[0] is None
    assert_refused(*parse(export_parser(), [config, "--out", config / "x.json"], capsys), "lies under the file")
    (tmp_path / "folder.json").mkdir()
    assert_refused(*parse(export_parser(), [config, "--out", tmp_path / "folder.json"], capsys), "is a folder")
    assert existing.read_text() == "keep" and config.read_text() == "{}"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder")
def test_an_unwritable_folder_is_refused_before_work(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text("{}")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert_refused(*parse(export_parser(), [config, "--out", locked / "new" / "o.json"], capsys), "is not writable")
    finally:
        locked.chmod(0o700)


def test_write_output_refuses_a_file_that_appears_while_it_writes(tmp_path):
    out = tmp_path / "o.json"

    def write(tmp):
        tmp.write_text("ours")
        out.write_text("theirs")  # another run publishes first

    with pytest.raises(cli.OutputError, match="written by another process meanwhile"):
        cli.write_output(out, write)
    assert out.read_text() == "theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["o.json"]
    cli.write_output(out, write, overwrite=True)
    assert out.read_text() == "ours"


def test_atomic_write_without_replace_keeps_an_existing_file(tmp_path):
    out = tmp_path / "x"
    out.write_text("old")
    with pytest.raises(FileExistsError):
        atomic_write(out, lambda tmp: tmp.write_text("new"), replace=False)
    assert out.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["x"]


def test_run_turns_a_repro_error_into_one_line_and_exit_2(capsys):
    from repro.errors import TraceError

    def fail():
        raise TraceError("the trace is broken; re-import it.")

    assert cli.run(fail) == 2
    assert capsys.readouterr().err == "error: the trace is broken; re-import it.\n"
    assert cli.run(lambda: None) == 0 and cli.run(lambda: 3) == 3
