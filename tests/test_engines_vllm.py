"""repro.engines.vllm: MoE-layer placement export and the `vllm.general_plugins` EPLB-policy plugin.

vLLM itself is a multi-GB CUDA wheel, so the plugin runs against a fake `vllm` package that reproduces the
0.33.0 pieces it touches: EPLB_POLICIES, AbstractEplbPolicy, and EPLBConfig / ParallelConfig as real pydantic
dataclasses whose policy field is Literal["default"] (so a name outside it fails validation like in vLLM).
"""

from __future__ import annotations

import json
import sys
import tomllib
import types
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
import pydantic
import pytest
import torch
from test_engines_sglang import DEVICES, NUM_EXPERTS, real_job, toy_job

from repro.engines import vllm as vllm_engine
from repro.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


# vllm/config/parallel.py as far as the plugin is concerned (pydantic dataclasses; policy a one-name Literal)
FAKE_PARALLEL = """
from typing import Literal

import pydantic
from pydantic.dataclasses import dataclass

EPLBPolicyOption = Literal["default"]


@dataclass
class EPLBConfig:
    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    use_async: bool = False
    policy: EPLBPolicyOption = "default"


@dataclass
class ParallelConfig:
    enable_eplb: bool = False
    eplb_config: EPLBConfig = pydantic.Field(default_factory=EPLBConfig)
"""


@pytest.fixture(params=["", "from __future__ import annotations\n"], ids=["annotations", "string-annotations"])
def fake_vllm(request, monkeypatch):
    """Install a fake vllm 0.33.0 into sys.modules; returns its modules by dotted name."""

    class AbstractEplbPolicy(ABC):
        @classmethod
        @abstractmethod
        def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices=None):
            raise NotImplementedError

    class DefaultEplbPolicy(AbstractEplbPolicy):
        @classmethod
        def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks, old_global_expert_indices=None):
            return torch.arange(num_replicas).repeat(weight.shape[0], 1) % weight.shape[1]

    modules = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.config", "vllm.config.parallel", "vllm.distributed", "vllm.distributed.eplb",
        "vllm.distributed.eplb.policy", "vllm.distributed.eplb.policy.abstract")}
    modules["vllm"].__version__ = vllm_engine.SUPPORTED_VLLM
    modules["vllm.distributed.eplb.policy.abstract"].AbstractEplbPolicy = AbstractEplbPolicy
    modules["vllm.distributed.eplb.policy"].EPLB_POLICIES = {"default": DefaultEplbPolicy}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    exec(compile(request.param + FAKE_PARALLEL, "vllm/config/parallel.py", "exec"), modules["vllm.config.parallel"].__dict__)
    monkeypatch.setattr(vllm_engine, "_REGISTERED", {})
    return modules


def exported(tmp_path, redundant: int = 0) -> tuple[Path, dict]:
    job, placement = toy_job(tmp_path, redundant=redundant)
    out = tmp_path / "placement.json"
    assert vllm_engine.main(["export", str(job), "--out", str(out)]) == 0
    return out, json.loads(out.read_text())


def test_export_holds_moe_layers_only(tmp_path):
    job, placement = toy_job(tmp_path, redundant=4)
    out = tmp_path / "p.json"
    assert vllm_engine.main(["export", str(job), "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    np.testing.assert_array_equal(document["physical_to_logical_map"], placement.physical_to_logical)
    assert document["moe_layer_ids"] == [1, 2, 3] and document["ep_size"] == DEVICES
    # a plan covering fewer MoE layers than the model: the others keep vLLM's initial map
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 6, "n_routed_experts": NUM_EXPERTS, "first_k_dense_replace": 1}))
    assert vllm_engine.main(["export", str(job), "--out", str(out), "--model-config", str(config), "--layer-ids", "1,3,5",
                             "--overwrite"]) == 0
    rows = np.asarray(json.loads(out.read_text())["physical_to_logical_map"])
    assert rows.shape == (5, NUM_EXPERTS + 4)
    np.testing.assert_array_equal(rows[[0, 2, 4]], placement.physical_to_logical)
    np.testing.assert_array_equal(rows[1], np.arange(NUM_EXPERTS + 4) % NUM_EXPERTS)


def test_plugin_is_inert_without_the_variable(monkeypatch):
    monkeypatch.delenv(vllm_engine.ENV_PLACEMENT, raising=False)
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    vllm_engine.register()
    assert "vllm" not in sys.modules  # nothing imported, nothing patched


def test_plugin_installs_the_plan_as_an_eplb_policy(tmp_path, fake_vllm, monkeypatch):
    out, document = exported(tmp_path, redundant=4)
    parallel = fake_vllm["vllm.config.parallel"]
    with pytest.raises(pydantic.ValidationError):  # before: vLLM refuses the name
        parallel.EPLBConfig(policy="semmoe")
    monkeypatch.setenv(vllm_engine.ENV_PLACEMENT, str(out))
    vllm_engine.register()
    vllm_engine.register()  # vLLM calls plugins in every process, sometimes twice: idempotent
    assert parallel.EPLBConfig(policy="semmoe").policy == "semmoe"
    assert parallel.ParallelConfig(eplb_config={"policy": "semmoe", "num_redundant_experts": 4}).eplb_config.policy == "semmoe"
    with pytest.raises(pydantic.ValidationError):
        parallel.EPLBConfig(policy="other")
    policy = fake_vllm["vllm.distributed.eplb.policy"].EPLB_POLICIES["semmoe"]
    weight = torch.rand(3, NUM_EXPERTS)
    got = policy.rebalance_experts(weight, NUM_EXPERTS + 4, 1, 1, DEVICES)
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), document["physical_to_logical_map"])
    with pytest.raises(ConfigError, match="export the plan for this model"):
        policy.rebalance_experts(weight, NUM_EXPERTS, 1, 1, DEVICES)  # vLLM launched without the redundant slots


def test_plugin_refuses_other_versions_and_bad_files(tmp_path, fake_vllm, monkeypatch):
    out, _ = exported(tmp_path)
    monkeypatch.setenv(vllm_engine.ENV_PLACEMENT, str(out))
    fake_vllm["vllm"].__version__ = "0.34.1"
    with pytest.raises(ConfigError, match="supports vLLM 0.33.0"):
        vllm_engine.register()
    fake_vllm["vllm"].__version__ = vllm_engine.SUPPORTED_VLLM
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"physical_to_logical_map": [[0, 1]]}))
    monkeypatch.setenv(vllm_engine.ENV_PLACEMENT, str(bad))
    with pytest.raises(ConfigError, match="not a Sem-MoE vLLM placement"):
        vllm_engine.register()
    document = json.loads(out.read_text())
    document["physical_to_logical_map"][0][0] = document["physical_to_logical_map"][0][1]
    bad.write_text(json.dumps(document))
    with pytest.raises(ConfigError, match="has no slot"):
        vllm_engine.register()
    assert "semmoe" not in fake_vllm["vllm.distributed.eplb.policy"].EPLB_POLICIES


def test_launch_command_and_entry_point(tmp_path, capsys):
    job, model_dir, _ = real_job(tmp_path, redundant=4)
    assert vllm_engine.main(["launch", str(job), "--out", str(tmp_path / "p.json"), "--model", str(model_dir)]) == 0
    command = capsys.readouterr().out.strip().splitlines()[-1]
    assert command.startswith(f"{vllm_engine.ENV_PLACEMENT}={(tmp_path / 'p.json').resolve()} vllm serve {model_dir}")
    eplb = json.loads(command.split("--eplb-config ")[1].split(" --")[0].strip("'"))
    assert eplb == {"policy": "semmoe", "num_redundant_experts": 4, "step_interval": 64, "use_async": False}
    assert "--data-parallel-size 4" in command and "--enable-expert-parallel" in command
    assert "--no-enable-prefix-caching" in command  # bench_serving re-sends its prompts at every rate
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    module, _, function = entry["semmoe_placement"].partition(":")
    assert getattr(sys.modules.get(module) or __import__(module, fromlist=[function]), function) is vllm_engine.register


def test_launch_checks_the_plan_against_the_served_model(tmp_path, capsys):
    job, _ = toy_job(tmp_path)  # fitted on synthetic routing, mixtral token ids
    out = tmp_path / "p.json"
    argv = ["launch", str(job), "--out", str(out), "--model", "deepseek-ai/DeepSeek-V2-Lite"]
    assert vllm_engine.main(argv) == 2
    assert "places 8 experts per layer but model 'deepseek_v2_lite' has 64" in capsys.readouterr().err
    _, model_dir, _ = real_job(tmp_path / "real")
    argv = ["launch", str(job), "--out", str(out), "--model", str(model_dir)]
    assert vllm_engine.main(argv) == 2
    assert "--allow-synthetic-plan" in capsys.readouterr().err and not out.exists()
    assert vllm_engine.main([*argv, "--allow-synthetic-plan"]) == 2  # and the tokenizer is not the model's
    assert "--allow-tokenizer-mismatch" in capsys.readouterr().err and not out.exists()
    assert vllm_engine.main([*argv, "--allow-synthetic-plan", "--allow-tokenizer-mismatch"]) == 0
    assert capsys.readouterr().err.count("!! the plan in") == 2 and out.exists()  # both overrides, both shouted
    assert vllm_engine.main(["export", str(job), "--out", str(tmp_path / "e.json")]) == 0  # export serves nothing
