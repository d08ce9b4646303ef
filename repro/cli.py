"""The contract every command-line entry point keeps, made the easy path (DESIGN.md "Every entry point keeps one
contract"): bad input ends with one `error:` sentence naming the input and the fix, exit code 2, nothing written,
created or deleted; an existing output is never replaced without --overwrite, and never when it is one of the
command's own inputs.

    parser = cli.ArgumentParser(prog="python -m repro.x", description=...)
    parser.add_argument("--trace", type=cli.existing_path)        # an input: must exist
    parser.add_argument("--shard", type=cli.count)                # an integer >= 0
    cli.add_output(parser, "--out", suffix=".npz")                # an output, and --overwrite beside it
    args = parser.parse_args(argv)                                # refused inputs and outputs: exit 2 here
    return cli.run(lambda: work(args))                            # a ReproError: one line, exit 2
    ...
    cli.write_output(args.out, write, overwrite=args.overwrite)   # atomic; never clobbers without --overwrite

An argument's type is a `Kind`: a callable that argparse calls on the string, and that says in words what it takes.
The parser checks every output against the command's inputs (the values of every `InputPath` argument) and against
--overwrite before it returns, so a command's work starts only when its outputs may be written. The fuzzer
(tests/test_entry_points.py) reads the kinds to generate values each must refuse.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from repro.atomic import atomic_write
from repro.config_values import INT64_MAX
from repro.errors import ReproError

SEED_MAX = 2**32 - 1  # numpy takes larger seeds, torch.manual_seed does not (conf's seed check uses the same bound)
PORT_MAX = 65535


class OutputError(ReproError):
    """An output path cannot be written without destroying data (it exists, or it is one of the inputs)."""


# ---- argument kinds ----------------------------------------------------------------------------------------------


class Kind:
    """An argparse `type`: turns the string into a value or raises ArgumentTypeError with what it takes."""

    takes = "a value"

    def __call__(self, text: str):
        raise NotImplementedError

    def refuse(self, text: str) -> argparse.ArgumentTypeError:
        return argparse.ArgumentTypeError(f"must be {self.takes}, got {text!r}")

    def __repr__(self) -> str:  # argparse names a type in some messages
        return self.takes


class Integer(Kind):
    """An integer in [low, high] (no lower bound where low is None); "4.0" and "1e3" are refused (write 4, 1000).
    The default upper bound is the largest int64: a bigger count overflows numpy and torch deep inside a run."""

    def __init__(self, low: int | None = 0, high: int = INT64_MAX):
        self.low, self.high = low, high
        top = "that fits in 64 bits" if high == INT64_MAX else f"<= {high}"
        if low is not None and high != INT64_MAX:
            self.takes = f"an integer in [{low}, {high}]"
        else:
            self.takes = f"an integer {'' if low is None else f'>= {low} '}{top}"

    def __call__(self, text: str) -> int:
        try:
            value = int(text, 10)
        except (TypeError, ValueError):
            raise self.refuse(text) from None
        if (self.low is not None and value < self.low) or value > self.high:
            raise self.refuse(text)
        return value


class Number(Kind):
    """A finite number in (low, high] / [low, high] (NaN and inf are never a measurement or a setting)."""

    def __init__(self, low: float | None = None, high: float | None = None, *, low_open: bool = False,
                 high_open: bool = False):
        self.low, self.high, self.low_open, self.high_open = low, high, low_open, high_open
        if low is not None and high is not None:
            self.takes = f"a finite number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            self.takes = f"a finite number {'>' if low_open else '>='} {low:g}"
        else:
            self.takes = "a finite number" if high is None else f"a finite number {'<' if high_open else '<='} {high:g}"

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise self.refuse(text) from None
        if not math.isfinite(value):
            raise self.refuse(text)
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            raise self.refuse(text)
        if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
            raise self.refuse(text)
        return value


class InputPath(Kind):
    """A path that must exist now (a file, a folder, or either): a command's input."""

    def __init__(self, what: str = "any"):
        self.what = what
        self.takes = {"file": "an existing file", "dir": "an existing folder", "any": "an existing path"}[what]

    def __call__(self, text: str) -> Path:
        if not text:
            raise self.refuse(text)
        path = Path(text)
        exists = {"file": path.is_file, "dir": path.is_dir, "any": path.exists}[self.what]
        if not exists():
            raise self.refuse(text)
        return path


class OutputPath(Kind):
    """A path a command writes (a file, or a folder it fills): where it may go is checked after parsing, when the
    inputs and --overwrite are known (ArgumentParser.claim_outputs)."""

    def __init__(self, what: str = "file", suffix: str | tuple[str, ...] = ()):
        self.what = what
        self.suffixes = (suffix,) if isinstance(suffix, str) else tuple(suffix)
        self.takes = f"a {'file' if what == 'file' else 'folder'} path" + (
            f" ending in {' or '.join(self.suffixes)}" if self.suffixes else "")

    def __call__(self, text: str) -> Path:
        if not text or (self.what == "file" and text.endswith(os.sep)):
            raise self.refuse(text)
        path = Path(text)
        if self.suffixes and not text.endswith(self.suffixes):
            raise self.refuse(text)
        return path


class Url(Kind):
    """An http(s) URL with a host (and a port in 1..65535 when one is given): a server a command talks to. Refused
    at start, where a bad one was otherwise answered 502 on every request."""

    takes = "an http(s) URL with a host (such as http://127.0.0.1:30000)"

    def __call__(self, text: str) -> str:
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(text)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0..65535
        except ValueError:
            raise self.refuse(text) from None
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port == 0 or any(
                c.isspace() or not c.isprintable() for c in text):
            raise self.refuse(text)
        return text


count = Integer(0)  # how many, an index
positive = Integer(1)  # a size, a number of ranks
seed = Integer(0, SEED_MAX)
port = Integer(1, PORT_MAX)
rate = Number(0, low_open=True)  # requests per second, a threshold, a timeout in seconds
non_negative = Number(0)
probability = Number(0, 1)
existing_file = InputPath("file")
existing_dir = InputPath("dir")
existing_path = InputPath("any")
url = Url()


def output_file(suffix: str | tuple[str, ...] = ()) -> OutputPath:
    return OutputPath("file", suffix)


output_dir = OutputPath("dir")


# ---- outputs -----------------------------------------------------------------------------------------------------


def claim_output(path: str | os.PathLike, *, name: str = "--out", inputs=(), overwrite: bool = False,
                 what: str = "file") -> Path:
    """Refuse (OutputError, one sentence) an output that would destroy data or cannot be written; create nothing.

    Refused: one of `inputs` (never, even with --overwrite: an export once replaced the config.json it had just
    read); an existing file without `overwrite`; a folder where a file belongs or the other way round; a place under
    a file or in a folder this user cannot write. A folder output (`what="dir"`) that exists and is not empty needs
    `overwrite` as a file does.
    """
    path = Path(path)
    resolved = path.expanduser().resolve()
    for source in inputs:
        if source is not None and Path(source).expanduser().resolve() == resolved:
            raise OutputError(f"{name} {path} is one of this command's inputs; write the output to another path.")
    if path.is_dir() and what == "file":
        raise OutputError(f"{name} {path} is a folder; name a file to write.")
    if path.exists() and not path.is_dir() and what == "dir":
        raise OutputError(f"{name} {path} is a file; name a folder to write into.")
    if path.exists() and not overwrite and (what == "file" or any(path.iterdir())):
        raise OutputError(f"{name} {path} exists; pass --overwrite to replace it, or choose a new path.")
    ancestor = resolved.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"{name} {path} lies under the file {ancestor}; choose a path in a folder.")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputError(f"{name} {path} cannot be written (the folder {ancestor} is not writable); choose a "
                          "writable place.")
    return path


def write_output(path: str | os.PathLike, write: Callable[[Path], object], *, overwrite: bool = False,
                 name: str = "--out", inputs=()) -> Path:
    """Write a file output atomically (write(tmp) then rename) after claim_output; without `overwrite` the rename
    never replaces a file that appeared meanwhile (another run's), which is then refused."""
    path = claim_output(path, name=name, inputs=inputs, overwrite=overwrite)
    try:
        atomic_write(path, write, replace=overwrite)
    except FileExistsError:
        raise OutputError(f"{name} {path} was written by another process meanwhile; pass --overwrite to replace "
                          "it, or choose a new path.") from None
    except OSError as e:
        raise OutputError(f"cannot write {name} {path} ({e.strerror or e}); choose a writable place.") from None
    return path


def write_text_output(path: str | os.PathLike, text: str, **claim) -> Path:
    return write_output(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), **claim)


# ---- the parser and the runner -----------------------------------------------------------------------------------


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the contract: a refusal is one `error:` line (no usage block) and exit code 2; after parsing,
    every OutputPath argument is claimed against the InputPath arguments and --overwrite (claim_output)."""

    def error(self, message: str):
        sentence = message[:1].upper() + message[1:] if message.startswith("the ") else message
        print(f"error: {sentence.rstrip('.')}; see {self.prog} --help.", file=sys.stderr)
        raise SystemExit(2)

    def parse_known_args(self, args=None, namespace=None):
        for arg in sys.argv[1:] if args is None else args:
            # argparse drops a "--" value before the type sees it: `--n=--` left n at None (the fuzzer found it)
            if isinstance(arg, str) and arg.startswith("-") and arg.endswith("=--"):
                self.error(f"argument {arg.partition('=')[0]}: expected a value, got '--'")
        namespace, extras = super().parse_known_args(args, namespace)
        try:
            self.claim_outputs(namespace)
        except OutputError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        return namespace, extras

    def claim_outputs(self, namespace: argparse.Namespace) -> None:
        inputs, outputs = [], []
        for action in self._actions:
            value = getattr(namespace, action.dest, None)
            values = value if isinstance(value, list) else [value]
            if isinstance(action.type, InputPath):
                inputs += [v for v in values if v is not None]
            elif isinstance(action.type, OutputPath):
                outputs += [(action, v) for v in values if v is not None]
        overwrite = bool(getattr(namespace, "overwrite", False))
        for action, path in outputs:
            name = action.option_strings[0] if action.option_strings else action.dest.upper()
            claim_output(path, name=name, inputs=inputs, overwrite=overwrite, what=action.type.what)


def add_output(parser: argparse.ArgumentParser, flag: str = "--out", *, suffix: str | tuple[str, ...] = (),
               what: str = "file", help: str | None = None, **kwargs) -> None:
    """Add an output argument (required unless `required=False` or a default is given) and, once per parser,
    --overwrite (replace an existing output)."""
    if flag.startswith("-"):
        kwargs.setdefault("required", "default" not in kwargs)
    parser.add_argument(flag, type=OutputPath(what, suffix), help=help, **kwargs)
    if not any("--overwrite" in a.option_strings for a in parser._actions):
        parser.add_argument("--overwrite", action="store_true", help="replace an existing output")


def run(work: Callable[[], int | None]) -> int:
    """Run a command's work: its return code (0 for None), or 2 with one `error:` line for a ReproError."""
    try:
        code = work()
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if code is None else code
