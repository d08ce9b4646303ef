"""repro.engines.sglang / layout: export of plans to --init-expert-location, SGLang's rules, the pitfall checks.

Also home of the small job-directory builders the other tests/test_engines_*.py files import.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from repro.engines import sglang
from repro.engines.layout import ModelLayout, load_plan, parse_layer_ids
from repro.errors import ConfigError, TraceError
from repro.parallel import ParallelConfig
from repro.systems.base import Placement, Plan

# a DeepSeek-like toy: 4 model layers, layer 0 dense, layers 1-3 MoE with 8 experts, top-2, EP 4
NUM_EXPERTS, TOP_K, DEVICES = 8, 2, 4
MODEL = {"name": "toy_moe", "kind": "synthetic", "num_experts": NUM_EXPERTS, "top_k": TOP_K, "num_layers": 3,
         "first_layer": 1, "tokenizer": "mixtral"}


def toy_placement(seed: int = 0, devices: int = DEVICES, redundant: int = 0) -> Placement:
    """A random no-replication placement of 3 layers (or one with `redundant` extra slots, E + redundant)."""
    rng = np.random.default_rng(seed)
    rows = np.stack([rng.permutation(NUM_EXPERTS) for _ in range(3)])
    if redundant:
        rows = np.concatenate([rows, rng.integers(0, NUM_EXPERTS, (3, redundant))], axis=1)
    return Placement(rows, devices, NUM_EXPERTS)


def write_job(root: Path, plan: Plan, model: dict | None = None, attention: str = "dp") -> Path:
    """A finished-job directory as repro.run writes it (plan/ and config.yaml)."""
    plan.save(root / "plan")
    config = {"model": model or MODEL, "parallel": {"devices": plan.parallel.devices, "attention": attention,
                                                    "tokens_per_step": 64, "bytes_per_token": 16, "devices_per_node": 8}}
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    return root


def toy_job(tmp_path: Path, model: dict | None = None, attention: str = "dp", **kwargs) -> tuple[Path, Placement]:
    placement = toy_placement(**kwargs)
    plan = Plan(placement, ParallelConfig(devices=placement.num_devices, attention=attention, tokens_per_step=64))
    return write_job(tmp_path / "job", plan, model, attention), placement


def toy_model_dir(tmp_path: Path, **overrides) -> Path:
    """A local model folder holding the toy's HF config.json (DeepSeek spelling), as an engine would load it."""
    folder = tmp_path / "models" / "toy_moe"
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "deepseek_v2", "num_hidden_layers": 4, "n_routed_experts": NUM_EXPERTS,
              "first_k_dense_replace": 1, "num_experts_per_tok": TOP_K, **overrides}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def real_job(tmp_path: Path, **kwargs) -> tuple[Path, Path, Placement]:
    """(job, model folder, placement): a job whose routing was captured from the toy model with its own tokenizer."""
    model_dir = toy_model_dir(tmp_path)
    model = {"name": "", "kind": "hf", "checkpoint": str(model_dir), "tokenizer": f"hf:{model_dir}"}
    job, placement = toy_job(tmp_path, model=model, **kwargs)
    return job, model_dir, placement


def test_export_from_job_dir_matches_hand_built_rows(tmp_path):
    job, placement = toy_job(tmp_path)
    out = tmp_path / "location.json"
    assert sglang.main(["export", str(job), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert list(data) == ["physical_to_logical_map"]
    rows = np.asarray(data["physical_to_logical_map"])
    assert rows.shape == (4, NUM_EXPERTS)
    np.testing.assert_array_equal(rows[0], np.arange(NUM_EXPERTS))  # the dense layer: trivial
    np.testing.assert_array_equal(rows[1:], placement.physical_to_logical)
    layout = ModelLayout("toy", 4, (1, 2, 3), NUM_EXPERTS, TOP_K)
    np.testing.assert_array_equal(sglang.read_location(out, layout, DEVICES, 0), rows)


def test_replicated_plan_uses_redundant_slots_and_launch_says_so(tmp_path, capsys):
    job, model_dir, placement = real_job(tmp_path, redundant=4)
    out = tmp_path / "loc.json"
    assert sglang.main(["launch", str(job), "--out", str(out), "--model-path", str(model_dir)]) == 0
    captured = capsys.readouterr()
    assert "!!" not in captured.err  # real routing, the model's own tokenizer: nothing to warn about
    command = captured.out.strip().splitlines()[-1].split()
    assert command[command.index("--ep-num-redundant-experts") + 1] == "4"
    assert command[command.index("--ep-size") + 1] == command[command.index("--tp-size") + 1] == str(DEVICES)
    assert command[command.index("--attn-dp-size") + 1] == str(DEVICES)
    for flag in ("--enable-return-routed-experts", "--moe-a2a-backend", "--ep-dispatch-algorithm", "--disable-radix-cache"):
        assert flag in command
    assert command[command.index("--init-expert-location") + 1] == str(out.resolve())
    rows = np.asarray(json.loads(out.read_text())["physical_to_logical_map"])
    assert rows.shape == (4, NUM_EXPERTS + 4)
    np.testing.assert_array_equal(rows[0], np.arange(12) % NUM_EXPERTS)


def test_attention_tp_launch_has_no_attention_dp(tmp_path, capsys):
    job, model_dir, _ = real_job(tmp_path, attention="tp")
    assert sglang.main(["launch", str(job), "--out", str(tmp_path / "l.json"), "--model-path", str(model_dir)]) == 0
    assert "--attn-dp-size" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "config_overrides, words",
    [
        ({"n_routed_experts": 16}, "places 8 experts per layer but model"),  # the 16-vs-64 case of `make serve-sglang`
        ({"num_experts_per_tok": 4}, "top-2 routing"),
        ({"first_k_dense_replace": 2}, "the plan has 3 layers and model"),
    ],
)
def test_launch_refuses_a_model_of_another_shape(tmp_path, capsys, config_overrides, words):
    model_dir = toy_model_dir(tmp_path, **config_overrides)
    job, _ = toy_job(tmp_path, model={**MODEL, "kind": "hf", "tokenizer": f"hf:{model_dir}"})
    out = tmp_path / "loc.json"
    assert sglang.main(["launch", str(job), "--out", str(out), "--model-path", str(model_dir)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1  # one sentence
    assert not out.exists()


def test_launch_needs_the_models_shape_and_compares_whole_layouts(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    job, _ = toy_job(tmp_path)
    out = tmp_path / "loc.json"
    allow = ["--allow-synthetic-plan", "--allow-tokenizer-mismatch"]
    assert sglang.main(["launch", str(job), "--out", str(out), "--model-path", "org/unknown-model", *allow]) == 2
    assert "cannot tell the shape of model 'org/unknown-model'" in capsys.readouterr().err
    # a known hub id without a config.json at hand: its simulator shape (64 experts) refuses the 8-expert toy
    assert sglang.main(["launch", str(job), "--out", str(out), "--model-path", "deepseek-ai/DeepSeek-V2-Lite", *allow]) == 2
    assert "places 8 experts per layer but model 'deepseek_v2_lite' has 64" in capsys.readouterr().err
    # the synthetic job describes a 4-layer model; a 6-layer model whose layers 1-3 are MoE too is another model
    model_dir = toy_model_dir(tmp_path, num_hidden_layers=6)
    assert sglang.main(["launch", str(job), "--out", str(out), "--model-path", str(model_dir), *allow]) == 2
    assert "fitted for a model of 4 layers with MoE layers 1-3 but" in capsys.readouterr().err
    # ... unless the rows are mapped explicitly (a plan covering some MoE layers)
    assert sglang.main(["launch", str(job), "--out", str(out), "--model-path", str(model_dir), *allow,
                        "--layer-ids", "1,3,5"]) == 0
    assert not (tmp_path / "empty_cache").exists()


def test_model_layout_from_the_hf_cache_and_known_ids(tmp_path, monkeypatch):
    from repro.engines.layout import served_model_layout

    cache = tmp_path / "hub"
    snapshot = cache / "models--org--toy" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"num_hidden_layers": 5, "num_local_experts": 4}))
    (cache / "models--org--toy" / "refs").mkdir()
    (cache / "models--org--toy" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    layout = served_model_layout("org/toy")
    assert (layout.num_hidden_layers, layout.num_experts, layout.moe_layer_ids) == (5, 4, (0, 1, 2, 3, 4))
    assert served_model_layout("Qwen/Qwen3-30B-A3B").num_experts == 128
    assert served_model_layout(str(toy_model_dir(tmp_path))).moe_layer_ids == (1, 2, 3)
    with pytest.raises(ConfigError, match="not both"):
        served_model_layout("org/toy", tmp_path / "c.json", "deepseek_v3")


def _trace_meta(folder: Path, **fields) -> Path:
    folder.mkdir(parents=True)
    meta = {"model": "toy", "num_experts": NUM_EXPERTS, "top_k": TOP_K, "layer_ids": [1, 2, 3], "vocab_size": 100,
            "tokenizer": "", "source": "", "dataset": "mmlu", **fields}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.mark.parametrize("kind", ["synthetic", "tiny", "replay", "trace:synthetic", "trace:replay", "hf_random"])
def test_launch_refuses_plans_fitted_on_synthetic_routing_unless_allowed(tmp_path, capsys, kind):
    model_dir = toy_model_dir(tmp_path)
    model = {**MODEL, "kind": kind, "tokenizer": f"hf:{model_dir}"}
    if kind == "hf_random":
        model = {**MODEL, "kind": "hf", "tokenizer": f"hf:{model_dir}", "from_config": {"config_class": "X"}}
    job, _ = toy_job(tmp_path, model=model)
    if kind.startswith("trace:"):  # a trace= job: the profile trace's meta.json says where its routing came from
        trace = _trace_meta(tmp_path / "trace", source=kind[6:], tokenizer=f"hf:{model_dir}")
        config = yaml.safe_load((job / "config.yaml").read_text())
        config.update(trace=str(trace), model={"kind": "hf", "tokenizer": f"hf:{model_dir}"})  # not what is read
        (job / "config.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "loc.json"
    argv = ["launch", str(job), "--out", str(out), "--model-path", str(model_dir)]
    assert sglang.main(argv) == 2
    err = capsys.readouterr().err
    assert "routing" in err and "--allow-synthetic-plan" in err and err.count("\n") == 1
    assert not out.exists()
    assert sglang.main([*argv, "--allow-synthetic-plan"]) == 0
    err = capsys.readouterr().err
    assert "!!" in err and "--allow-synthetic-plan" in err and "not on routing of" in err
    assert out.exists()


def test_launch_refuses_another_tokenizer_unless_allowed(tmp_path, capsys):
    model_dir = toy_model_dir(tmp_path)
    job, _ = toy_job(tmp_path, model={"kind": "hf", "checkpoint": str(model_dir), "tokenizer": "hf:other/model"})
    out = tmp_path / "loc.json"
    argv = ["launch", str(job), "--out", str(out), "--model-path", str(model_dir), "--overwrite"]  # launched 3 times
    assert sglang.main(argv) == 2
    assert "tokenizer 'hf:other/model'" in capsys.readouterr().err and not out.exists()
    assert sglang.main([*argv, "--allow-tokenizer-mismatch"]) == 0
    assert "!!" in capsys.readouterr().err
    # a real capture with the model's tokenizer passes; a bare plan folder cannot be told and is warned about
    trace = _trace_meta(tmp_path / "trace", source="capture:sglang", tokenizer="hf:org/toy_moe")
    config = yaml.safe_load((job / "config.yaml").read_text())
    (job / "config.yaml").write_text(yaml.safe_dump({**config, "trace": str(trace)}))
    assert sglang.main(argv) == 0 and "!!" not in capsys.readouterr().err
    (job / "config.yaml").unlink()
    assert sglang.main([*argv, "--ep-size", str(DEVICES)]) == 0
    assert "cannot tell what routing" in capsys.readouterr().err


def test_tokenizer_matches_the_model():
    from repro.engines.layout import tokenizer_matches

    assert tokenizer_matches("hf:deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite")
    assert tokenizer_matches("hf:deepseek-ai/DeepSeek-V2-Lite", "/models/dsv2", "deepseek-ai/DeepSeek-V2-Lite")
    assert tokenizer_matches("mixtral", "mistralai/Mixtral-8x7B-Instruct-v0.1")
    assert tokenizer_matches("qwen", "Qwen/Qwen3-30B-A3B") and tokenizer_matches("olmoe", "allenai/OLMoE-1B-7B-0924")
    assert not tokenizer_matches("mixtral", "deepseek-ai/DeepSeek-V2-Lite", "deepseek_v2_lite")
    assert not tokenizer_matches("hf:Qwen/Qwen3-30B-A3B", "deepseek-ai/DeepSeek-V2-Lite")


LAYOUT = ModelLayout("toy", 4, (1, 2, 3), NUM_EXPERTS, TOP_K)
GOOD = np.tile(np.arange(NUM_EXPERTS), (4, 1)).tolist()


@pytest.mark.parametrize(
    "data, ep, redundant, words",
    [
        ([[0]], 4, None, "JSON object"),
        ({"physical_to_logical_map": GOOD, "ep_size": 4}, 4, None, "extra key"),
        ({"physical_to_logical_map": GOOD[:3]}, 4, None, "num_hidden_layers=4"),
        ({"physical_to_logical_map": [r[:6] for r in GOOD]}, 4, None, "fewer than"),
        ({"physical_to_logical_map": GOOD}, 3, None, "not divisible by --ep-size 3"),
        ({"physical_to_logical_map": GOOD}, 4, 2, "--ep-num-redundant-experts 2"),
        ({"physical_to_logical_map": [GOOD[0]] * 3 + [[9] + GOOD[0][1:]]}, 4, None, "expert 9"),
        ({"physical_to_logical_map": [GOOD[0]] * 3 + [[1] + GOOD[0][1:]]}, 4, None, "expert 0 has no slot in layer 3"),
        ({"physical_to_logical_map": [[float(x) for x in r] for r in GOOD]}, 4, None, "integer rows"),
        ({"physical_to_logical_map": GOOD[:3] + [GOOD[0][:5]]}, 4, None, "rectangular"),
    ],
)
def test_check_location_applies_sglang_rules(data, ep, redundant, words):
    with pytest.raises(ConfigError, match=words):
        sglang.check_location(data, LAYOUT, ep, redundant)


def test_location_file_must_end_in_json(tmp_path):
    path = tmp_path / "loc.txt"
    path.write_text(json.dumps({"physical_to_logical_map": GOOD}))
    with pytest.raises(ConfigError, match="inline JSON"):
        sglang.read_location(path, LAYOUT, 4)


def test_plan_for_another_model_is_refused_and_nothing_written(tmp_path, capsys):
    job, _ = toy_job(tmp_path)
    config = tmp_path / "config.json"
    # right layer count, wrong expert count
    config.write_text(json.dumps({"num_hidden_layers": 4, "n_routed_experts": 16, "first_k_dense_replace": 1}))
    out = tmp_path / "out.json"
    assert sglang.main(["export", str(job), "--out", str(out), "--model-config", str(config)]) == 2
    assert "fitted for another model" in capsys.readouterr().err
    assert not out.exists()
    # right experts, but plan rows would land on a dense layer
    config.write_text(json.dumps({"num_hidden_layers": 4, "n_routed_experts": 8, "first_k_dense_replace": 2}))
    with pytest.raises(ConfigError, match="not MoE layers"):
        load_plan(job, layout=ModelLayout.from_hf_config(config), layer_ids=(1, 2, 3))
    with pytest.raises(ConfigError, match="not MoE layers"):  # the job's own rows are model layers 1-3
        load_plan(job, layout=ModelLayout.from_hf_config(config))
    (job / "config.yaml").unlink()
    with pytest.raises(ConfigError, match="--layer-ids"):  # 3 plan rows, 2 MoE layers: which is which?
        load_plan(job, layout=ModelLayout.from_hf_config(config), ep_size=DEVICES)


def test_plan_dir_without_job_needs_ep_size(tmp_path):
    job, _ = toy_job(tmp_path)
    (job / "config.yaml").unlink()
    with pytest.raises(ConfigError, match="--ep-size"):
        load_plan(job / "plan", layout=LAYOUT)
    saved = load_plan(job / "plan", layout=LAYOUT, ep_size=DEVICES)
    assert saved.layer_ids == (1, 2, 3)
    with pytest.raises(ConfigError, match="no saved plan"):
        load_plan(tmp_path)


def test_hf_config_layouts(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "deepseek_v2", "num_hidden_layers": 27, "n_routed_experts": 64,
                                "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts_per_tok": 6}))
    layout = ModelLayout.from_hf_config(path)
    assert layout.moe_layer_ids == tuple(range(1, 27)) and layout.dense_layer_ids == (0,) and layout.top_k == 6
    path.write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 6, "num_experts": 128,
                                "decoder_sparse_step": 1, "mlp_only_layers": [2], "num_experts_per_tok": 8}))
    assert ModelLayout.from_hf_config(path).moe_layer_ids == (0, 1, 3, 4, 5)
    path.write_text(json.dumps({"model_type": "mixtral", "num_hidden_layers": 32, "num_local_experts": 8}))
    assert ModelLayout.from_hf_config(path).moe_layer_ids == tuple(range(32))
    path.write_text(json.dumps({"num_hidden_layers": 4}))
    with pytest.raises(ConfigError, match="supported MoE model"):
        ModelLayout.from_hf_config(path)
    shape = ModelLayout.from_shape("deepseek_v2_lite")
    assert (shape.num_hidden_layers, shape.moe_layer_ids[0], shape.num_experts) == (27, 1, 64)
    assert parse_layer_ids("0,7,15") == (0, 7, 15) and parse_layer_ids("1-3,9") == (1, 2, 3, 9)
    with pytest.raises(ConfigError, match="layer ids"):
        parse_layer_ids("a-b")


def _dump(path: Path, rows: np.ndarray) -> Path:
    torch.save({"records": [], "last_physical_to_logical_map": torch.as_tensor(rows, dtype=torch.int32)}, path)
    return path


def test_served_map_mismatch_is_loud(tmp_path, capsys):
    job, placement = toy_job(tmp_path)
    out = tmp_path / "loc.json"
    assert sglang.main(["export", str(job), "--out", str(out)]) == 0
    rows = np.asarray(json.loads(out.read_text())["physical_to_logical_map"])
    base = ["served", str(out), "--shape", "deepseek_v2_lite", "--ep-size", "4"]
    common = ["--model-config", str(tmp_path / "c.json"), "--ep-size", "4"]
    (tmp_path / "c.json").write_text(json.dumps({"num_hidden_layers": 4, "n_routed_experts": 8, "first_k_dense_replace": 1}))
    assert sglang.main(["served", str(out), "--dump", str(_dump(tmp_path / "a.pt", rows)), *common]) == 0
    trivial = np.tile(np.arange(NUM_EXPERTS), (4, 1))
    assert sglang.main(["served", str(out), "--dump", str(_dump(tmp_path / "b.pt", trivial)), *common]) == 3
    err = capsys.readouterr().err
    assert "NOT serving" in err and "3 layers differ" in err
    assert sglang.compare_served_map(trivial, rows) == [1, 2, 3]
    (tmp_path / "bad.pt").write_bytes(b"not a torch file")
    assert sglang.main(["served", str(out), "--dump", str(tmp_path / "bad.pt"), *common]) == 2
    assert sglang.main(base + ["--dump", str(tmp_path / "a.pt")]) == 2  # DeepSeek-V2-Lite has 27 layers, not 4


def test_placement_evidence_tells_plan_from_trivial():
    rng = np.random.default_rng(1)
    placement = toy_placement(seed=3)
    popularity = rng.dirichlet(np.full(NUM_EXPERTS, 0.3), size=3)  # skewed, per layer

    def route(num_tokens: int) -> np.ndarray:  # int[N, L, k] logical experts
        return np.stack([
            np.stack([rng.choice(NUM_EXPERTS, TOP_K, replace=False, p=popularity[layer]) for layer in range(3)])
            for _ in range(num_tokens)
        ])

    logical = route(3000)
    # the reference: expert counts of an independent profile of the same "model"
    profile = route(3000)
    popularity = np.stack([np.bincount(profile[:, layer].ravel(), minlength=NUM_EXPERTS) for layer in range(3)])
    slot_of = np.argsort(placement.physical_to_logical, axis=1)  # [L, E] slot of each expert (no replication)
    served_plan = slot_of[np.arange(3)[None, :, None], logical]
    evidence = sglang.placement_evidence(served_plan, placement.physical_to_logical, popularity)
    assert evidence["verdict"] == "plan" and evidence["tv_plan"] < 0.05 < evidence["tv_trivial"]
    # a server that ignored the file returns logical ids as physical ones
    assert sglang.placement_evidence(logical, placement.physical_to_logical, popularity)["verdict"] == "trivial"
    trivial_rows = np.tile(np.arange(NUM_EXPERTS), (3, 1))
    assert sglang.placement_evidence(logical, trivial_rows, popularity)["verdict"] == "indistinguishable"
    assert sglang.placement_evidence(logical[:3], placement.physical_to_logical, popularity)["verdict"] == "inconclusive"
    with pytest.raises(TraceError, match="beyond"):
        sglang.placement_evidence(logical + 8, placement.physical_to_logical, popularity)
