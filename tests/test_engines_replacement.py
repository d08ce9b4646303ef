"""repro.engines.replacement: each change of plan exported in SGLang's and vLLM's formats with its list of expert
copies, checked against hand-built rows; bad input refused with one sentence and nothing written."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
from test_engines_sglang import DEVICES, NUM_EXPERTS, write_job

from repro.engines.replacement import main as replacement_main
from repro.parallel import ParallelConfig
from repro.systems.base import Placement, Plan


def job(root: Path, rows, devices: int = DEVICES) -> Path:
    placement = Placement(np.asarray(rows), devices, NUM_EXPERTS)
    plan = Plan(placement, ParallelConfig(devices=devices, tokens_per_step=64))
    return write_job(root, plan)


def main(argv: list[str]) -> int:
    """The CLI's exit code, whether its parser refuses (SystemExit) or its work does."""
    try:
        return replacement_main(argv)
    except SystemExit as e:
        return e.code


SAME = np.tile(np.arange(NUM_EXPERTS), (3, 1))  # 2 experts per rank, the same map in every layer
SWAPPED = SAME.copy()
SWAPPED[1, [0, 2]] = SWAPPED[1, [2, 0]]  # layer 1 swaps expert 0 (rank 0) and expert 2 (rank 1)


def test_a_swap_is_exported_in_every_format_with_its_two_copies(tmp_path, capsys):
    a, b = job(tmp_path / "a", SAME), job(tmp_path / "b", SWAPPED)
    out = tmp_path / "out"
    assert main([str(a), str(b), "--out", str(out)]) == 0
    step = out / "step_1"
    # the toy job's model: layer 0 dense, MoE layers 1-3 (plan rows 0-2); SGLang wants a row per model layer
    sglang_rows = json.loads((step / "sglang_init_expert_location.json").read_text())["physical_to_logical_map"]
    assert sglang_rows == [list(range(NUM_EXPERTS))] + SWAPPED.tolist()
    vllm_doc = json.loads((step / "vllm_placement.json").read_text())
    assert vllm_doc["physical_to_logical_map"] == SWAPPED.tolist() and vllm_doc["ep_size"] == DEVICES
    assert json.loads((step / "vllm_initial_expert_map.json").read_text()) == SWAPPED.tolist()  # MoE layers only
    with open(step / "moved_experts.csv") as f:
        moves = list(csv.DictReader(f))
    assert [(m["plan_layer"], m["expert"], m["from_device"], m["to_device"], m["link"]) for m in moves] == [
        ("1", "0", "0", "1", "nvlink"), ("1", "2", "1", "0", "nvlink")]
    assert {m["model_layer"] for m in moves} == {"2"}
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["experts_moved"] == 2 and manifest["experts_moved_per_plan_layer"] == [0, 2, 0]
    # layer 1 differs from layers 0 and 2: no single expert_to_ep_rank map, and the manifest says why
    assert not (step / "vllm_expert_to_ep_rank.json").exists()
    assert "one map for every layer" in manifest["left_out"]["vllm_expert_to_ep_rank.json"]
    assert "step 1: 2 expert copies (0 local, 2 nvlink, 0 rdma)" in capsys.readouterr().out


def test_a_layer_uniform_plan_gets_vllms_expert_to_ep_rank_and_steps_chain(tmp_path):
    moved = np.tile(np.array([2, 3, 0, 1, 4, 5, 6, 7]), (3, 1))  # experts 0-3 trade ranks 0 and 1 in every layer
    a, b, c = job(tmp_path / "a", SAME), job(tmp_path / "b", moved), job(tmp_path / "c", SAME)
    out = tmp_path / "out"
    assert main([str(a), str(b), str(c), "--out", str(out)]) == 0
    ranks = json.loads((out / "step_1" / "vllm_expert_to_ep_rank.json").read_text())["expert_to_ep_rank"]
    assert ranks == [1, 1, 0, 0, 2, 2, 3, 3]
    back = json.loads((out / "step_2" / "vllm_expert_to_ep_rank.json").read_text())["expert_to_ep_rank"]
    assert back == [0, 0, 1, 1, 2, 2, 3, 3]
    assert json.loads((out / "step_2" / "manifest.json").read_text())["experts_moved"] == 12


def test_copies_across_nodes_are_rdma(tmp_path):
    # 4 ranks, 2 per node: expert 0 (rank 0, node 0) and expert 4 (rank 2, node 1) trade places in layer 0
    rows = SAME.copy()
    rows[0, [0, 4]] = rows[0, [4, 0]]
    out = tmp_path / "out"
    a, b = job(tmp_path / "a", SAME), job(tmp_path / "b", rows)
    assert main([str(a), str(b), "--out", str(out), "--devices-per-node", "2"]) == 0
    manifest = json.loads((out / "step_1" / "manifest.json").read_text())
    assert manifest["experts_moved_by_link"] == {"local": 0, "nvlink": 0, "rdma": 2} and manifest["devices_per_node"] == 2
    assert main([str(a), str(b), "--out", str(tmp_path / "three"), "--devices-per-node", "3"]) == 2


def test_refusals_write_nothing(tmp_path, capsys):
    a, b = job(tmp_path / "a", SAME), job(tmp_path / "b", SWAPPED)
    other = job(tmp_path / "c", np.tile(np.arange(NUM_EXPERTS), (3, 1)), devices=2)
    out = tmp_path / "out"
    assert main([str(a), "--out", str(out)]) == 2
    assert "at least two plans" in capsys.readouterr().err
    assert main([str(a), str(other), "--out", str(out)]) == 2
    assert "keeps the EP size" in capsys.readouterr().err
    assert not out.exists()
    assert main([str(a), str(b), "--out", str(out)]) == 0
    assert main([str(a), str(b), "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert main([str(a), str(b), "--out", str(out), "--overwrite"]) == 0
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    assert main([str(a), str(b), "--out", str(stranger), "--overwrite"]) == 2
    assert "did not write" in capsys.readouterr().err and (stranger / "notes.txt").read_text() == "mine"
    assert main([str(a), str(b), "--out", str(a)]) == 2  # an input is never an output
