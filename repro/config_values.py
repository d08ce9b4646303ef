"""The vocabulary config checks are written in: what one key may hold (`Value`: type and range, described in
words), one key's check (`check_value`) and one group's (`check_table`), and the keys conf/<group>/*.yaml defines.
Below every config group's own check (e.g. repro.workloads.config) and repro.config_schema, which composes them."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from omegaconf import OmegaConf

from repro.errors import ConfigError, check_known_keys

CONF = Path(__file__).resolve().parents[1] / "conf"


# ---- what one key may hold ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Value:
    """The allowed values of one config key: one of `types` ("int", "number", "str", "bool", "list", "dict",
    "null"), numbers within [low, high] (open ends where low_open / high_open), strings among `choices` if given."""

    types: tuple[str, ...]
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple = ()

    def describe(self) -> str:
        words = {"int": "an integer", "number": "a number", "str": "a string", "bool": "true or false",
                 "list": "a list", "dict": "a mapping", "null": "null"}
        parts = []
        for t in self.types:
            if t == "str" and self.choices:
                parts.append(f"one of {list(self.choices)}")
            elif t in ("int", "number") and (self.low is not None or self.high is not None):
                parts.append(f"{words[t]} {self._range()}")
            else:
                parts.append(words[t])
        return " or ".join(parts)

    def _range(self) -> str:
        low, high = _show(self.low), _show(self.high)
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {low}"
        return f"{'<' if self.high_open else '<='} {high}"

    def allows(self, value) -> bool:
        return any(_matches(t, value, self) for t in self.types)


def _show(bound) -> str:
    """A range bound as a user writes it: integers exactly (4294967295, not 4.29497e+09)."""
    return str(bound) if bound is None or isinstance(bound, int) else f"{bound:g}"


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value  # not NaN


INT64_MAX = 2**63 - 1  # every integer key ends in numpy or torch: a larger one overflowed deep inside a run


def _in_range(value, spec: Value) -> bool:
    if spec.low is not None and (value < spec.low or (spec.low_open and value == spec.low)):
        return False
    if "int" in spec.types and _is_int(value) and abs(value) > INT64_MAX:
        return False
    return spec.high is None or not (value > spec.high or (spec.high_open and value == spec.high))


def _matches(kind: str, value, spec: Value) -> bool:
    if kind == "int":
        return _is_int(value) and _in_range(value, spec)
    if kind == "number":
        return _is_number(value) and abs(value) != float("inf") and _in_range(value, spec)
    if kind == "str":
        return isinstance(value, str) and (not spec.choices or value in spec.choices)
    return {"bool": lambda v: isinstance(v, bool), "list": lambda v: isinstance(v, list | tuple),
            "dict": lambda v: isinstance(v, dict), "null": lambda v: v is None}[kind](value)


def integer(low=None, high=None, null=False) -> Value:
    return Value(("int",) + (("null",) if null else ()), low, high)


def number(low=None, high=None, low_open=False, high_open=False, null=False) -> Value:
    return Value(("number",) + (("null",) if null else ()), low, high, low_open, high_open)


def text(choices=(), null=False) -> Value:
    return Value(("str",) + (("null",) if null else ()), choices=tuple(choices))


FLAG = Value(("bool",))
MAPPING = Value(("dict",))
OPTIONAL_MAPPING = Value(("dict", "null"))


def check_value(key: str, value, spec: Value) -> None:
    """Raise ConfigError unless `value` (of config key `key`, dotted) is one that `spec` allows."""
    if spec.allows(value):
        return
    hint = ""
    if "int" in spec.types and isinstance(value, float) and value.is_integer() and spec.allows(int(value)):
        hint = f"; write {int(value)} without a decimal point"
    elif "int" in spec.types and _is_int(value) and abs(value) > INT64_MAX:
        hint = f", beyond the largest 64-bit integer {INT64_MAX}"
    raise ConfigError(f"{key} must be {spec.describe()}, got {value!r}{hint}.")


def check_table(group: str, config: dict, table: dict[str, Value], known=()) -> None:
    """Every key of config group `group` in `table` or `known`, and every value in `table` of its type and range."""
    if not isinstance(config, dict):
        raise ConfigError(f"{group} must be a mapping of keys to values, got {config!r}.")
    check_known_keys(group, config, set(table) | set(known))
    for key, spec in table.items():
        if key in config:
            check_value(f"{group}.{key}" if group else key, config[key], spec)


@cache
def option_keys(group: str) -> frozenset[str]:
    """Dotted leaf paths that any conf/<group>/*.yaml option defines (a Hydra defaults list excluded)."""
    paths: set[str] = set()

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            if key == "defaults" and not prefix:
                continue
            path = f"{prefix}{key}"
            paths.add(path)
            if isinstance(value, dict):
                walk(value, path + ".")

    for file in sorted((CONF / group).glob("*.yaml")):
        walk(OmegaConf.to_container(OmegaConf.load(file), resolve=False) or {}, "")
    return frozenset(paths)


def top_keys(paths) -> set[str]:
    return {p.split(".")[0] for p in paths}
