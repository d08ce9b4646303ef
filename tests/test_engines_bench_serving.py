"""repro.engines.bench_serving: the per-rate row equals the simulator's on the same times; the sweep client
against a fake streaming OpenAI server on loopback; the serve commands (printed, not run)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pandas as pd
from aiohttp import web
from test_engines_capture import serve_in_thread
from test_engines_sglang import DEVICES, toy_job

from repro.engines import bench_serving
from repro.sim.costs import COMPONENTS
from repro.sim.engine import RunResult
from repro.sim.metrics import rate_row


def test_per_rate_row_matches_the_simulator():
    rng = np.random.default_rng(0)
    send = np.sort(rng.uniform(0, 10, 50))
    first = send + rng.uniform(0.01, 0.2, 50)
    outputs = rng.integers(1, 20, 50)
    finish = first + (outputs - 1) * 0.02 + rng.uniform(0, 0.01, 50)
    prompts = rng.integers(5, 100, 50)
    ours = bench_serving.per_rate_row(4.0, send, first, finish, outputs, prompts, failed=2)
    run = RunResult(send, first, finish, np.zeros(50, dtype=np.int64), np.zeros((1, len(COMPONENTS))), busy_seconds=1.0)
    sim = rate_row(4.0, run, prompts, outputs)
    for column in bench_serving.REAL_COLUMNS:
        assert np.isclose(ours[column], sim[column], equal_nan=True), column
    assert ours["failed_requests"] == 2


def streaming_server(token_delay: float = 0.002):
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(0.01)  # "prefill"
        for _ in range(body["max_tokens"]):
            await response.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n".encode())
            await asyncio.sleep(token_delay)
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"], "prompt_tokens": len(body["prompt"])}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "toy"}]})

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/v1/models", models)])
    return app


def test_sweep_writes_the_per_rate_table(tmp_path):
    url, stop = serve_in_thread(streaming_server())
    out = tmp_path / "runs" / "serve_real" / "toy"
    try:
        code = bench_serving.main(["sweep", "--url", url, "--rates", "40,80", "--out", str(out), "--no-progress",
                                   "workload=mmlu", "tokenizer=mixtral", "num_requests=20", "max_prompt_len=16",
                                   "output_len=5"])
    finally:
        stop()
    assert code == 0
    table = pd.read_csv(out / "real_per_rate.csv")
    assert list(table.columns[: len(bench_serving.REAL_COLUMNS)]) == list(bench_serving.REAL_COLUMNS)
    assert table["rate"].tolist() == [40.0, 80.0] and table["num_requests"].tolist() == [20, 20]
    assert (table["failed_requests"] == 0).all()
    assert (table["ttft_p50_s"] >= 0.01).all() and (table["e2e_p50_s"] > table["ttft_p50_s"]).all()
    assert (table["tpot_p50_s"] >= 0.002).all() and (table["tpot_p50_s"] < 0.1).all()
    assert np.allclose(table["output_tok_s"] / table["throughput_rps"], 5.0)
    assert json.loads((out / "serve_config.json").read_text())["workload"]["num_requests"] == 20


def test_bad_rates_are_refused(tmp_path, capsys):
    assert bench_serving.main(["sweep", "--url", "http://127.0.0.1:9", "--rates", "1,x", "--out", str(tmp_path),
                               "--model", "m", "workload=mmlu"]) == 2
    assert "--rates" in capsys.readouterr().err
    assert not (tmp_path / "real_per_rate.csv").exists()


def test_serve_prints_engine_and_router_commands(tmp_path, capsys):
    job, _ = toy_job(tmp_path, redundant=4)
    for engine, flag in (("sglang", "--init-expert-location"), ("vllm", "--eplb-config")):
        assert bench_serving.main(["serve", "--engine", engine, "--plan", str(job), "--model-path", "m", "--print"]) == 0
        engine_line, router_line = capsys.readouterr().out.strip().splitlines()[-2:]
        assert flag in engine_line
        assert (f"--ep-size {DEVICES}" if engine == "sglang" else f"--data-parallel-size {DEVICES}") in engine_line
        assert "repro.engines.router" in router_line and "--upstream http://127.0.0.1:30000" in router_line
    assert (job / "engine" / "init_expert_location.json").exists() and (job / "engine" / "vllm_placement.json").exists()
