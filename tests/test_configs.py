"""Every config composes; config groups and the code's registries agree (lightning-hydra's test_configs)."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from repro.routing import PRODUCERS
from repro.systems import REGISTRY
from repro.workloads import COMPOSED_WORKLOADS, WORKLOADS

CONF = Path(__file__).resolve().parents[1] / "conf"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes_and_its_sweep_names_existing_options(experiment):
    cfg = compose_cfg(f"experiment={experiment}")
    OmegaConf.resolve(cfg.model)
    params = cfg.hydra.sweeper.params or {}
    for key, values in params.items():
        group = key.lstrip("+").split("@")[0]
        if (CONF / group).is_dir():
            for value in str(values).split(","):
                assert value in options(group), f"{experiment}: {key}={value} is not an option of {group}/"


def test_system_configs_match_the_registry():
    assert options("system") == sorted(REGISTRY)
    for name in options("system"):
        assert compose_cfg(f"system={name}").system.name == name


def test_workload_and_model_configs_name_real_loaders():
    for name in options("workload"):
        assert compose_cfg(f"workload={name}").workload.name in (*WORKLOADS, *COMPOSED_WORKLOADS)
    for name in options("model"):
        assert compose_cfg(f"model={name}").model.kind in PRODUCERS


def test_config_typo_is_rejected_by_strict_mode():
    with pytest.raises(Exception, match="devcies"):
        compose_cfg("parallel.devcies=4")


# ---- the config check (repro/config_schema.py) agrees with the shipped configs and the code ----------------------


def resolved(*overrides, config_name="config") -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name, overrides=["logger=none", *overrides]), resolve=True)


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_passes_the_config_check(experiment):
    from repro.config_schema import check_config

    check_config(resolved(f"experiment={experiment}"))


def test_every_option_of_every_group_passes_the_config_check():
    from repro.config_schema import check_config

    for group in ("model", "workload", "system", "hardware", "logger"):
        for name in options(group):
            check_config(resolved(f"{group}={name}"))
    check_config(resolved("sim=default"))
    check_config(resolved("+exec=default"))


def test_config_check_tables_name_the_keys_the_code_reads():
    import inspect
    from dataclasses import fields

    from repro.config_schema import systems_taking
    from repro.exec.trace_mode import EXEC_TABLE as EXEC
    from repro.exec.trace_mode import ExecConfig
    from repro.parallel import PARALLEL, ParallelConfig
    from repro.sim.simulate import SIM_KEYS, SLO_KEYS
    from repro.sim.simulate import SIM_SLO_TABLE as SIM_SLO
    from repro.sim.simulate import SIM_TABLE as SIM
    from repro.workloads import load_workload
    from repro.workloads.config import WORKLOAD

    assert set(PARALLEL) == {f.name for f in fields(ParallelConfig)}
    assert set(EXEC) == {f.name for f in fields(ExecConfig)}
    assert set(WORKLOAD) == set(inspect.signature(load_workload).parameters) - {"tokenizer", "seed"}
    assert set(SIM) <= SIM_KEYS and set(SIM_SLO) == SLO_KEYS
    assert systems_taking("replicas_per_device") == ["eplb", "semmoe_hottest", "semmoe_replicated"]
    assert systems_taking("theta")[:2] == ["semmoe", "semmoe_exact"]


def test_the_torch_free_exec_check_names_the_kernel_backends_and_dtypes_the_executor_has():
    from repro.exec.trace_mode import DTYPES
    from repro.exec_config import DTYPE_NAMES, KERNEL_BACKENDS
    from repro.kernels import BACKENDS

    assert KERNEL_BACKENDS == BACKENDS and sorted(DTYPE_NAMES) == sorted(DTYPES)
