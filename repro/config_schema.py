"""The composed job config checked where it is read: every key known, every value of its type and range.

    check_config(config)      # the resolved config dict of `python -m repro.run` / `repro.tune` / `repro.exec`

Hydra's strict mode refuses a typo of an existing key, but `+key=value` adds any key, and values are whatever the
command line parsed (`parallel.devices=abc` is a string, `4.0` a float). So one declarative table per group says
what each key may hold (type and range, in repro.config_values' vocabulary); a group's keys are the table's plus
those its conf/<group>/*.yaml options define, so a key a yaml adds is known without editing this file, and a key
that no option defines is refused. Each group's own check lives with its code and is called from here
(repro.parallel's check_parallel, repro.workloads.config's check_workload, the routing producers'
check_*_config, repro.sim.hardware's check_hardware_config, repro.tracking's check_logger, repro.sim.simulate's
check_sim_table / check_sim_config, repro.exec_config's check_exec_table / check_exec_fields,
repro.tune_config's check_tune_config). System parameters are checked against the
system class's signature and annotations. The schema only composes: it sits below the entry points that call it
(run, tune, exec) and imports none of them (tests/test_layers.py).
Every problem is one ConfigError sentence naming the key, raised before any routing, training or output.

CheckSweep (a Hydra callback in conf/config.yaml) runs check_config on every job of a multirun before the first
one starts, so a sweep whose fifth job is invalid fails at once instead of after four finished jobs.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from functools import cache

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from repro.config_values import (
    CONF,
    OPTIONAL_MAPPING,
    Value,
    check_table,
    check_value,
    integer,
    number,
    option_keys,
    text,
    top_keys,
)
from repro.errors import ConfigError, ReproError, check_known_keys
from repro.jobdir import check_run_config
from repro.parallel import check_parallel
from repro.tracking import check_logger
from repro.tune_config import check_tune_config

EVALUATE_SPLITS = ("validate", "evaluate")


# ---- the tables -----------------------------------------------------------------------------------------------

ROOT = {
    "name": text(),
    "seed": integer(0, 2**32 - 1),  # numpy, torch and numba all take a 32-bit seed; 10**23 overflowed torch
    "profile_fraction": number(0, 1, low_open=True, high_open=True),
    "validate_fraction": number(0, 1, high_open=True),
    "evaluate_split": text(EVALUATE_SPLITS),
    "history": integer(0),
    "cache_dir": text(),
    "trace": text(null=True),
    "profile_trace": text(null=True),
}
# config groups: required ones, and those a job may leave out (null or absent)
GROUPS = ("model", "workload", "system", "parallel", "hardware", "logger")
OPTIONAL_GROUPS = ("sim", "exec", "eval_workload", "train_workload", "tune", "drift")

# ---- groups ---------------------------------------------------------------------------------------------------


def check_root(config: dict) -> None:
    known = set(ROOT) | set(GROUPS) | set(OPTIONAL_GROUPS) | top_keys(option_keys_of_root())
    unknown = sorted(set(config) - known)
    if unknown:
        raise ConfigError(
            f"the config has no key(s) {unknown}; its top-level keys are {sorted(known)} (a `+key=value` override "
            "adds a key, so check its spelling)."
        )
    missing = [g for g in GROUPS if not isinstance(config.get(g), dict)]
    if missing:
        raise ConfigError(f"config group(s) {missing} are missing or not mappings; choose an option, e.g. {missing[0]}=<name>.")
    check_table("", {k: v for k, v in config.items() if k in ROOT}, ROOT)
    if config.get("profile_fraction", 0.2) + config.get("validate_fraction", 0.0) >= 1:
        raise ConfigError(
            f"profile_fraction={config['profile_fraction']} + validate_fraction={config.get('validate_fraction', 0.0)} "
            "leave no requests to evaluate; keep their sum below 1."
        )
    for group in OPTIONAL_GROUPS:
        check_value(group, config.get(group), OPTIONAL_MAPPING)


@cache
def option_keys_of_root() -> frozenset[str]:
    """Top-level keys that conf/config.yaml and conf/tune.yaml define."""
    keys = set()
    for file in ("config.yaml", "tune.yaml"):
        node = OmegaConf.to_container(OmegaConf.load(CONF / file), resolve=False) or {}
        keys |= set(node) - {"defaults", "hydra"}
    return frozenset(keys)


def check_model(model: dict) -> None:
    """The routing producer's own check of its keys and values (the same one it runs before routing)."""
    from repro.routing import PRODUCERS

    kind = model.get("kind")
    if kind not in PRODUCERS:
        raise ConfigError(f"model.kind={kind!r} is not a routing producer; choose one of {sorted(PRODUCERS)}.")
    if kind == "tiny":
        from repro.routing.tiny_model import check_tiny_config

        check_tiny_config(model)
    elif kind == "synthetic":
        from repro.routing.synthetic import check_synthetic_config

        check_synthetic_config(model)
    elif kind == "hf":
        from repro.routing.hf_capture import check_hf_config

        check_hf_config(model)
    elif kind == "replay":
        from repro.routing.replay import check_replay_config

        check_replay_config(model)


# ---- systems: parameters from the class signature -------------------------------------------------------------


@cache
def system_class(name: str):
    from repro.systems import REGISTRY

    module, cls_name = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls_name)


@cache
def system_parameters(name: str) -> tuple[dict[str, str], bool]:
    """({parameter: annotation string}, whether it takes any other keyword too) of system `name`.

    A class whose __init__ forwards **params to its base (semmoe_replicated -> SemMoE) takes its base's parameters
    as well; the walk up the MRO stops at the first __init__ without **params.
    """
    params: dict[str, str] = {}
    forwards = False  # the last __init__ seen passes **params on
    for klass in system_class(name).__mro__:
        if "__init__" not in vars(klass) or klass.__module__ in ("builtins", "typing", "abc"):
            continue
        forwards = False
        for p in inspect.signature(klass).parameters.values():
            if p.kind is p.VAR_KEYWORD:
                forwards = True
            elif p.kind is not p.VAR_POSITIONAL:
                annotation = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
                params.setdefault(p.name, annotation)
        if not forwards:
            return params, False
    return params, forwards  # no __init__ of its own: it takes nothing; else **params reached the end: anything


ANNOTATION_TYPES = {"int": "int", "float": "number", "str": "str", "bool": "bool", "None": "null", "dict": "dict",
                    "list": "list", "tuple": "list"}


def annotation_value(annotation: str) -> Value | None:
    """The Value an annotation such as 'int', 'float | None' or 'list[str] | tuple[str, ...]' allows; None: unknown."""
    kinds = []
    for part in annotation.split("|"):
        base = part.strip().split("[")[0]
        if base not in ANNOTATION_TYPES:
            return None
        kinds.append(ANNOTATION_TYPES[base])
    return Value(tuple(dict.fromkeys(kinds))) if kinds else None


def systems_taking(param: str) -> list[str]:
    from repro.systems import REGISTRY

    return [name for name in sorted(REGISTRY) if param in system_parameters(name)[0]]


def check_system(system: dict) -> None:
    from repro.systems import REGISTRY

    check_table("system", system, {"name": text(), "params": OPTIONAL_MAPPING})
    name = system.get("name")
    if name not in REGISTRY:
        raise ConfigError(f"unknown system {name!r}; choose one of {sorted(REGISTRY)}.")
    params = system.get("params") or {}
    accepted, open_ended = system_parameters(name)
    unknown = sorted(set(params) - set(accepted))
    if unknown and not open_ended:
        takers = systems_taking(unknown[0])
        hint = (f"only {', '.join(takers)} take {unknown[0]!r}: set it for those systems alone (a multirun over them: "
                f"-m system={','.join(takers)} system.params.{unknown[0]}=VALUE)" if takers
                else f"no system takes {unknown[0]!r}")
        raise ConfigError(f"system {name!r} has no parameter(s) {unknown}; {hint}; its parameters are {sorted(accepted)}.")
    for key, value in params.items():
        spec = annotation_value(accepted.get(key, ""))
        if spec is not None:
            check_value(f"system.params.{key}", value, spec)


def check_hardware(hardware: dict) -> None:
    from repro.sim.hardware import check_hardware_config

    check_hardware_config(hardware)


def check_sim(sim: dict) -> None:
    from repro.sim.simulate import check_sim_config, check_sim_table

    check_sim_table(sim)
    check_sim_config(sim)


def check_exec(exec_cfg: dict, parallel) -> None:
    from repro.exec_config import check_exec_fields, check_exec_table  # the group's own check, torch-free

    check_exec_table(exec_cfg)
    check_exec_fields(exec_cfg, parallel)


# ---- the whole config -----------------------------------------------------------------------------------------


def check_trace_ignores_nothing(config: dict, overrides=()) -> None:
    """trace= evaluates routing that is already tokenized and cut, and reads no workload key: a workload setting
    would be ignored without a word (paper_table2 on trace= gave one result for 256, 512 and 1,024 tokens;
    workload.num_requests, max_prompt_len and workload=arena_hard were ignored the same way). Refused: the length
    keys, wherever they come from, and every workload override on the command line (`overrides`, as Hydra lists
    them). An experiment's own workload settings describe the workload it routes; trace= replaces that workload
    as a whole (the experiments' sweeps run on traces so), so they are not the user's and pass."""
    trace = config["trace"]
    for key in ("input_len", "input_len_lognormal"):
        value = (config.get("workload") or {}).get(key)
        if value is not None:
            raise ConfigError(
                f"workload.{key}={value} cannot apply to trace={trace}: a trace's requests are already "
                f"tokenized at their own lengths; drop workload.{key} (workload.{key}=null) or route the workload "
                "instead of trace=."
            )
    for override in overrides:
        key, _, value = str(override).lstrip("+~").partition("=")
        if value.strip().lower() in ("null", "none", "~"):
            continue  # dropping a setting is what the refusals above ask for (the experiments' sweeps on traces do)
        if key == "workload" or key.startswith("workload."):
            raise ConfigError(
                f"{key}={value} cannot apply to trace={trace}: a trace job evaluates the trace's own requests and "
                f"reads no workload setting; drop {key}= or route the workload instead of trace=."
            )


def check_config(config: dict, overrides=()) -> None:
    """Raise one ConfigError sentence for the first unknown key or ill-typed / out-of-range value of a resolved
    job config (the dict of OmegaConf.to_container(cfg, resolve=True)); return None when it is sound. `overrides`:
    the command line's overrides where known (what the user asked for, beyond the config files)."""
    check_root(config)
    from repro.workloads.config import check_workload  # the workload group's own check (imports its registry)

    parallel = check_parallel(config["parallel"])
    check_workload("workload", config["workload"])
    for group in ("eval_workload", "train_workload"):
        if config.get(group):
            check_workload(group, config[group])
    if config.get("trace"):  # nothing is routed: the model's keys only, without importing its producer (torch)
        check_known_keys("model", config["model"], top_keys(option_keys("model")))
        check_trace_ignores_nothing(config, overrides)
    else:
        check_model(config["model"])
    check_system(config["system"])
    check_hardware(config["hardware"])
    check_logger(config["logger"])
    if config.get("sim"):
        check_sim(config["sim"])
    if config.get("exec"):
        check_exec(config["exec"], parallel)
    if config.get("tune"):
        check_tune_config(config["tune"])
    if config.get("drift"):
        from repro.drift.timeline import check_drift_config  # the drift group's own check

        check_drift_config(config["drift"])


# ---- multirun: every job checked before the first runs --------------------------------------------------------

try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra is a dependency; keep the module importable without it
    Callback = object


def sweep_jobs(config) -> list[list[str]]:
    """The override lists of every job Hydra's basic sweeper will launch for this multirun config."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    overrides = parser.parse_overrides(params + list(config.hydra.overrides.task))
    return [list(job) for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def job_config(master, overrides: list[str]) -> dict:
    """The resolved task config (no `hydra` node) of one sweep job, as the job itself will see it."""
    from hydra.core.global_hydra import GlobalHydra

    cfg = GlobalHydra.instance().config_loader().load_sweep_config(master, overrides)
    task = OmegaConf.to_container(cfg, resolve=False)
    task.pop("hydra", None)
    return OmegaConf.to_container(OmegaConf.create(task), resolve=True)


def multirun_argv(argv: list[str]) -> list[str]:
    """argv with each plain `system.params.KEY=VALUE` of a multirun (-m) turned into `++system.params.KEY=VALUE`.

    Why: Hydra applies a multirun's non-swept overrides to its base config, composed with the default system (ep),
    which lacks system-specific keys, so `-m system=semmoe_replicated,semmoe_hottest system.params.replicas_per_device=2`
    died with "Key 'replicas_per_device' is not in struct" though both swept systems take it. `++` sets the key in
    the base config too; CheckSweep still refuses, before the first job, a job whose system does not take it.
    A swept value (`=0,2`) is left alone: Hydra applies it per job already."""
    if "-m" not in argv[1:] and "--multirun" not in argv[1:]:
        return list(argv)
    plain = re.compile(r"system\.params\.[\w.]+=")
    return [argv[0]] + [f"++{a}" if plain.match(a) and "," not in a.split("=", 1)[1] else a for a in argv[1:]]


class CheckSweep(Callback):
    """Hydra callback: before a multirun launches anything, check_config every job; the first bad one ends the
    sweep with one `error:` line naming the job (exit code 2), as a single run would. A single run is checked
    before Hydra creates its folder (on_run_start)."""

    def on_run_start(self, config, **kwargs) -> None:
        overrides = list(config.hydra.overrides.task)
        check_run_config(config, lambda task: check_config(task, overrides))

    def on_multirun_start(self, config, **kwargs) -> None:
        if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
            return  # another sweeper chooses its jobs as it goes: each job checks itself when it starts
        command_line = list(config.hydra.overrides.task)  # the user's; an experiment's sweeper params are its own
        for overrides in sweep_jobs(config):
            try:
                task = job_config(config, overrides)
            except OmegaConfBaseException:
                continue  # an interpolation that does not resolve here: the job reports it itself
            try:
                check_config(task, command_line)
            except ReproError as e:
                print(f"error: sweep job [{' '.join(overrides)}]: {e}", file=sys.stderr)
                raise SystemExit(2) from None
