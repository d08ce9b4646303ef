"""repro.engines.bench_serving: the per-rate row equals the simulator's on the same times; the built-in client
against fake streaming OpenAI servers on loopback (warm-up not measured, ITL from known chunk gaps, one JSONL line
per request); the external tools' command lines and result conversion (the tools are not run); the serve commands
(printed, not run) and their refusals; the Makefile's serve targets need a PLAN."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from aiohttp import web
from conftest import assert_ends, pid_written_to
from test_engines_capture import serve_in_thread
from test_engines_sglang import DEVICES, real_job, toy_job

from repro.engines import bench_serving
from repro.errors import ConfigError
from repro.sim.costs import COMPONENTS
from repro.sim.engine import RunResult
from repro.sim.metrics import rate_row
from repro.workloads.registry import Workload
from repro.workloads.request import Request


@pytest.fixture(autouse=True, scope="module")
def workloads_loaded_once():
    """Each sweep below loads its workload (~5-10 s of MMLU and tokenizer on this machine); load each one once."""
    import repro.workloads

    real, cache = repro.workloads.load_workload, {}

    def cached(name, **kwargs):
        key = (name, json.dumps(kwargs, sort_keys=True, default=str))
        if key not in cache:
            cache[key] = real(name, **kwargs)
        return cache[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(repro.workloads, "load_workload", cached)
        yield


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
                                   "--client", "builtin", "workload=mmlu", "tokenizer=mixtral", "num_requests=20", "max_prompt_len=16",
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
    with pytest.raises(SystemExit) as stop:  # refused while parsing (repro.cli.count)
        bench_serving.main(["sweep", "--url", "http://127.0.0.1:9", "--rates", "1", "--out", str(tmp_path),
                            "--model", "m", "--warmup-requests", "-1", "workload=mmlu"])
    assert stop.value.code == 2 and "--warmup-requests" in capsys.readouterr().err
    assert bench_serving.main(["sweep", "--url", "http://127.0.0.1:9", "--rates", "inf", "--out", str(tmp_path),
                               "--model", "m", "workload=mmlu"]) == 2
    assert "--rates" in capsys.readouterr().err
    assert not (tmp_path / "real_per_rate.csv").exists()


def test_serve_prints_engine_and_router_commands(tmp_path, capsys):
    job, model_dir, _ = real_job(tmp_path, redundant=4)
    for engine, flag in (("sglang", "--init-expert-location"), ("vllm", "--eplb-config")):
        assert bench_serving.main(["serve", "--engine", engine, "--plan", str(job), "--model-path", str(model_dir),
                                   "--print"]) == 0
        engine_line, router_line = capsys.readouterr().out.strip().splitlines()[-2:]
        assert flag in engine_line
        assert (f"--ep-size {DEVICES}" if engine == "sglang" else f"--data-parallel-size {DEVICES}") in engine_line
        assert "repro.engines.router" in router_line and "--upstream http://127.0.0.1:30000" in router_line
    assert (job / "engine" / "init_expert_location.json").exists() and (job / "engine" / "vllm_placement.json").exists()


def test_serve_refuses_mismatched_and_synthetic_plans(tmp_path, capsys):
    job, _ = toy_job(tmp_path)  # a synthetic-routing plan: 8 experts, mixtral token ids
    serve = ["serve", "--plan", str(job), "--print"]
    # the old `make serve-sglang` pairing: a plan of another expert count than the model
    assert bench_serving.main([*serve, "--model-path", "deepseek-ai/DeepSeek-V2-Lite"]) == 2
    assert "places 8 experts per layer but model 'deepseek_v2_lite' has 64" in capsys.readouterr().err
    _, model_dir, _ = real_job(tmp_path / "real")
    assert bench_serving.main([*serve, "--model-path", str(model_dir)]) == 2
    assert "--allow-synthetic-plan" in capsys.readouterr().err
    assert not (job / "engine").exists()
    assert bench_serving.main([*serve, "--model-path", str(model_dir), "--allow-synthetic-plan",
                               "--allow-tokenizer-mismatch"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("!! the plan in") == 2 and "--init-expert-location" in captured.out


def test_make_serve_targets_need_a_plan():
    root = Path(__file__).resolve().parents[1]
    for target in ("serve-sglang", "serve-vllm", "bench-serving"):
        done = subprocess.run(["make", "-s", "-C", str(root), target, "PLAN="], capture_output=True, text=True, timeout=30)
        assert done.returncode != 0 and f"make {target} needs PLAN=" in done.stderr
    dry = subprocess.run(["make", "-n", "-C", str(root), "serve-sglang", "PLAN=runs/x", "MODEL_CONFIG=c.json"],
                         capture_output=True, text=True, timeout=30).stdout
    assert "--plan runs/x --model-path deepseek-ai/DeepSeek-V2-Lite --model-config c.json" in dry


# ---- the built-in client: warm-up, ITL, per-request JSONL -----------------------------------------------------

GAPS = (0.03, 0.09, 0.15)  # seconds between the chunks the fake server streams


def gapped_server(seen: list, gaps=GAPS, rank: int | None = None, fail: bool = False):
    """A fake /v1/completions streaming one chunk, then one more after each of `gaps`, then an empty finish chunk
    and the usage chunk; `seen` collects every request body; `fail`: every request gets a 503."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if fail:
            return web.json_response({"error": "overloaded"}, status=503)
        headers = {"Content-Type": "text/event-stream"}
        if rank is not None:
            headers["X-Data-Parallel-Rank"] = str(rank)
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)

        async def chunk(data: dict) -> None:
            await response.write(f"data: {json.dumps(data)}\n\n".encode())

        await chunk({"choices": [{"index": 0, "text": "a"}]})
        for gap in gaps:
            await asyncio.sleep(gap)
            await chunk({"choices": [{"index": 0, "text": "b"}]})
        await chunk({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})  # carries no token
        await chunk({"choices": [], "usage": {"completion_tokens": len(gaps) + 1}})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions)])
    return app


SWEEP = ["--model", "toy", "--no-progress", "--client", "builtin", "workload=mmlu", "tokenizer=mixtral",
         "max_prompt_len=16", "output_len=4", "num_requests=4"]


def test_warm_up_is_sent_but_not_measured_and_itl_follows_the_chunk_gaps(tmp_path, capsys):
    seen: list = []
    url, stop = serve_in_thread(gapped_server(seen, rank=1))
    out = tmp_path / "sweep"
    try:
        code = bench_serving.main(["sweep", "--url", url, "--rates", "50,100", "--out", str(out),
                                   "--warmup-requests", "3", *SWEEP])
    finally:
        stop()
    assert code == 0
    assert len(seen) == 3 + 2 * 4  # the warm-up went out ...
    table = pd.read_csv(out / "real_per_rate.csv")
    assert table["num_requests"].tolist() == [4, 4] and (table["failed_requests"] == 0).all()  # ... and is not counted
    for stat, expected in (("p50", GAPS[1]), ("mean", np.mean(GAPS))):
        assert (table[f"itl_{stat}_s"] >= expected - 0.005).all() and (table[f"itl_{stat}_s"] < expected + 0.04).all()
    assert (table["itl_p99_s"] >= GAPS[2] - 0.005).all()
    # TPOT = (last - first chunk) / (4 tokens - 1): the mean gap, as the usage chunk says 4 tokens
    assert np.allclose(table["tpot_mean_s"], table["itl_mean_s"], rtol=0.05)
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 4  # one line per measured request and rate
    records = [json.loads(line) for line in lines]
    assert [r["rate"] for r in records] == [50.0] * 4 + [100.0] * 4
    assert len({r["id"] for r in records}) == 4 and all(r["id"] for r in records)
    for r in records:
        assert r["error"] is None and r["rank"] == 1 and r["output_tokens"] == 4 and r["prompt_tokens"] <= 16
        assert len(r["itl_s"]) == len(GAPS)
        assert all(gap - 0.005 <= got < gap + 0.04 for got, gap in zip(r["itl_s"], GAPS, strict=True))
        assert r["send_s"] <= r["first_token_s"] < r["finish_s"]
        assert np.isclose(r["ttft_s"], r["first_token_s"] - r["send_s"])
        assert np.isclose(r["e2e_s"], r["finish_s"] - r["send_s"])
    config = json.loads((out / "serve_config.json").read_text())
    assert config["client"] == "builtin" and config["warmup"] == {"requests": 3, "succeeded": 3}
    printed = capsys.readouterr().out
    assert printed.count("Serving Benchmark Result") == 2 and "Median ITL (ms):" in printed and "P99 TTFT (ms):" in printed


def test_a_failing_server_fails_the_warm_up_and_writes_nothing(tmp_path, capsys):
    seen: list = []
    url, stop = serve_in_thread(gapped_server(seen, fail=True))
    try:
        code = bench_serving.main(["sweep", "--url", url, "--rates", "50", "--out", str(tmp_path / "o"),
                                   "--warmup-requests", "2", *SWEEP])
        assert code == 2 and "warm-up requests" in capsys.readouterr().err and len(seen) == 2
        assert not (tmp_path / "o").exists()
        # without a warm-up the failures are counted per rate and named
        code = bench_serving.main(["sweep", "--url", url, "--rates", "50", "--out", str(tmp_path / "o"),
                                   "--warmup-requests", "0", *SWEEP])
    finally:
        stop()
    assert code == 0
    table = pd.read_csv(tmp_path / "o" / "real_per_rate.csv")
    assert table["failed_requests"].tolist() == [4] and table["num_requests"].tolist() == [0]
    assert "HTTP 503" in table["first_error"][0]
    records = [json.loads(line) for line in (tmp_path / "o" / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all("503" in r["error"] and r["ttft_s"] is None for r in records)


# ---- external tools (not installed here: command lines and result conversion) ---------------------------------


def test_tool_command_lines(tmp_path):
    args = dict(url="http://127.0.0.1:8080", model="m", tokenizer="org/tok", dataset=tmp_path / "d.json",
                num_prompts=500, output_len=128, rate=4.0, seed=7, max_in_flight=64, warmup=8)
    sglang = bench_serving.tool_command("sglang", **args, result=tmp_path / "r.jsonl")
    assert sglang[1:3] == ["-m", "sglang.bench_serving"]
    flags = dict(zip(sglang[3::2], sglang[4::2], strict=False))
    assert {k: flags[k] for k in ("--backend", "--base-url", "--dataset-name", "--num-prompts", "--sharegpt-output-len",
                                  "--request-rate", "--seed", "--max-concurrency", "--warmup-requests")} == {
        "--backend": "sglang-oai", "--base-url": "http://127.0.0.1:8080", "--dataset-name": "sharegpt",
        "--num-prompts": "500", "--sharegpt-output-len": "128", "--request-rate": "4", "--seed": "7",
        "--max-concurrency": "64", "--warmup-requests": "8"}
    assert sglang[sglang.index("--output-file") + 1] == str(tmp_path / "r.jsonl") and "--output-details" in sglang
    assert sglang[-4:] == ["--model", "m", "--tokenizer", "org/tok"]
    vllm = bench_serving.tool_command("vllm", **args, result=tmp_path / "r.json")
    assert vllm[:3] == ["vllm", "bench", "serve"]
    for flag, value in (("--dataset-name", "custom"), ("--custom-output-len", "128"), ("--num-warmups", "8"),
                        ("--request-rate", "4"), ("--endpoint", "/v1/completions"), ("--result-dir", str(tmp_path)),
                        ("--result-filename", "r.json"), ("--temperature", "0"), ("--max-concurrency", "64")):
        assert vllm[vllm.index(flag) + 1] == value, flag
    for flag in ("--ignore-eos", "--save-detailed", "--disable-shuffle", "--skip-chat-template"):
        assert flag in vllm
    bench_serving.write_tool_dataset("sglang", ["p one", "p two"], tmp_path / "d.json")
    rows = json.loads((tmp_path / "d.json").read_text())
    assert [r["conversations"][0]["value"] for r in rows] == ["p one", "p two"]
    bench_serving.write_tool_dataset("vllm", ["p one", "p two"], tmp_path / "d.jsonl")
    assert [json.loads(x)["prompt"] for x in (tmp_path / "d.jsonl").read_text().splitlines()] == ["p one", "p two"]


# per-request details as both tools write them: request 2 failed
DETAILS = {"duration": 2.0, "ttfts": [0.1, 0.2, 0.0], "itls": [[0.01, 0.03], [0.02, 0.02], []], "input_lens": [5, 7, 9],
           "output_lens": [3, 3, 0], "errors": ["", "", "Traceback: boom"], "completed": 2}


def test_tool_results_become_the_per_rate_row():
    row, records = bench_serving.tool_rate(DETAILS, 4.0, "sglang")
    assert row["num_requests"] == 2 and row["failed_requests"] == 1 and row["first_error"] == "Traceback: boom"
    assert np.isclose(row["throughput_rps"], 1.0) and np.isclose(row["output_tok_s"], 3.0)
    assert np.isclose(row["total_tok_s"], (3 + 3 + 5 + 7) / 2.0)
    assert np.isclose(row["ttft_mean_s"], 0.15) and np.isclose(row["e2e_mean_s"], (0.14 + 0.24) / 2)
    assert np.isclose(row["tpot_mean_s"], (0.02 + 0.02) / 2) and np.isclose(row["itl_mean_s"], 0.02)
    assert np.isclose(row["itl_p50_s"], 0.02)
    assert len(records) == 3 and records[2]["error"] == "Traceback: boom" and records[2]["ttft_s"] is None
    with_e2e, _ = bench_serving.tool_rate({**DETAILS, "e2els": [0.5, 0.6, 0.0]}, 4.0, "vllm")
    assert np.isclose(with_e2e["e2e_mean_s"], 0.55)
    with pytest.raises(bench_serving.ReproError, match="--output-details"):
        bench_serving.tool_rate({"duration": 1.0}, 4.0, "sglang")


def test_sweep_drives_an_installed_tool(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_serving, "tool_available", lambda client: client == "vllm")
    calls = []

    def fake_run(argv, **popen):  # what `vllm bench serve --save-detailed` leaves behind
        calls.append(argv)
        folder, name = argv[argv.index("--result-dir") + 1], argv[argv.index("--result-filename") + 1]
        prompts = Path(argv[argv.index("--dataset-path") + 1]).read_text().splitlines()
        assert len(prompts) == 4 and all(json.loads(p)["prompt"] for p in prompts)
        (Path(folder) / name).write_text(json.dumps(DETAILS))
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(bench_serving.subprocess, "run", fake_run)
    out = tmp_path / "o"
    code = bench_serving.main(["sweep", "--url", "http://127.0.0.1:9", "--rates", "2,4", "--out", str(out),
                               *[a for a in SWEEP if a not in ("--client", "builtin")]])
    assert code == 0 and [c[c.index("--request-rate") + 1] for c in calls] == ["2", "4"]  # auto picked vllm
    assert all(c[c.index("--custom-output-len") + 1] == "4" and c[c.index("--model") + 1] == "toy" for c in calls)
    table = pd.read_csv(out / "real_per_rate.csv")
    assert table["rate"].tolist() == [2.0, 4.0] and table["num_requests"].tolist() == [2, 2]
    assert table["tool_dropped_requests"].tolist() == [1, 1]  # 3 results for 4 prompts: said, not hidden
    assert len((out / "requests.jsonl").read_text().splitlines()) == 6
    assert len((out / "vllm_results.jsonl").read_text().splitlines()) == 2
    assert json.loads((out / "serve_config.json").read_text())["client"] == "vllm"
    assert "Serving Benchmark Result" in capsys.readouterr().out
    # the tools take one output length
    varied = Workload("toy", [Request(str(i), "toy", "x", np.arange(3), output_len=4 + i) for i in range(2)], "mixtral", 10)
    with pytest.raises(ConfigError, match="output lengths vary"):
        bench_serving.run_tool("vllm", None, varied, "http://127.0.0.1:9", [1.0])
    monkeypatch.setattr(bench_serving, "tool_available", lambda client: False)
    with pytest.raises(ConfigError, match="not installed"):
        bench_serving.choose_client("sglang")
    assert bench_serving.choose_client("auto") == "builtin"


SERVE_CHILD = """
import sys, types
from repro.engines import bench_serving
pids = sys.argv[1]
sleeper = [sys.executable, "-c", f"import os, time; open({pids!r}, 'a').write(str(os.getpid()) + chr(10)); time.sleep(60)"]
bench_serving.serve_commands = lambda args: (sleeper, {}, sleeper)
bench_serving._wait_healthy = lambda url, seconds, process: None
args = types.SimpleNamespace(print=False, server_port=1, router_port=2, startup_timeout=1)
sys.exit(bench_serving.run_serve(args))
"""


def test_serve_stops_engine_and_router_on_sigterm(tmp_path):
    """`serve` waits for Ctrl-C or SIGTERM; either must stop the engine and the router it started (an unblocked
    SIGTERM would kill the waiting process and orphan both)."""
    import os
    import signal
    import sys
    import time

    pids = tmp_path / "pids"
    child = subprocess.Popen([sys.executable, "-c", SERVE_CHILD, str(pids)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(pids.read_text().split() if pids.exists() else []) < 2:
        time.sleep(0.05)
    assert "Ctrl-C stops both" in child.stderr.readline()  # it waits now
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 0
    for pid in map(int, pids.read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


SWEEP_WITH_A_HANGING_TOOL = """
import sys
from repro.engines import bench_serving as b
pids = sys.argv[1]
b.tool_available = lambda client: client == "vllm"
b._first_model = lambda url: "toy"
b.tool_command = lambda *args: ["sh", "-c", f"echo $$ >> {pids}; exec sleep 60"]  # a benchmark tool that hangs
sys.exit(b.main(["sweep", "--url", "http://127.0.0.1:9", "--rates", "1", "--out", sys.argv[2], "--client", "vllm",
                 *sys.argv[3:]]))
"""


def test_a_sweep_killed_by_sigkill_leaves_no_benchmark_tool_running(tmp_path):
    """Item 6: SIGKILL of `bench_serving sweep` left its sglang / vllm benchmark tool loading the server under init;
    the tool now gets SIGTERM from the kernel when the sweep dies (PR_SET_PDEATHSIG)."""
    import signal
    import sys

    pids = tmp_path / "pids"
    sweep = subprocess.Popen([sys.executable, "-c", SWEEP_WITH_A_HANGING_TOOL, str(pids), str(tmp_path / "out"),
                              *[a for a in SWEEP if a not in ("--client", "builtin")]],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tool = pid_written_to(pids, 60)
    sweep.send_signal(signal.SIGKILL)
    sweep.wait()
    assert_ends(tool, 5, "the benchmark tool outlived the killed sweep")
