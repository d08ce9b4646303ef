"""Real serving benchmark of a plan: launch the engine with its placement and the semantic router, then sweep
request rates and record TTFT / TPOT / E2E in the simulator's per-rate schema. Needs GPUs; never run in CI.

    # 8-GPU server, Attention-DP, DeepSeek-V2-Lite, plan of a finished job (prints what it runs, then serves):
    python -m repro.engines.bench_serving serve --engine sglang --plan runs/paper_dp/<job> \\
        --model-path deepseek-ai/DeepSeek-V2-Lite --model-config config.json
    # in another shell, through the router (port 8080):
    python -m repro.engines.bench_serving sweep --url http://127.0.0.1:8080 --rates 2,4,8,16,32 \\
        --out runs/serve_real/dsv2_semmoe workload=mmlu tokenizer=hf:deepseek-ai/DeepSeek-V2-Lite \\
        num_requests=500 output_len=128
    # the baseline: the same server without --init-expert-location, straight to port 30000 (no router)

`serve` exports the placement (SGLang `--init-expert-location` JSON, or the vLLM plugin's placement file) into
the job's engine/ folder, starts the server, waits for /health, starts `python -m repro.engines.router` in
front of it and keeps both until Ctrl-C (`--print` only prints the commands). `sweep` sends the workload's
prompts (token ids, /v1/completions, streamed, greedy, ignore_eos so every request generates exactly its
output_len) with Poisson arrivals at each rate (seeded; open loop, at most --max-in-flight outstanding) and
writes <out>/real_per_rate.csv: the columns of repro.sim.metrics.rate_row that a real server can measure
(rate, num_requests, makespan_s, throughput_rps, output_tok_s, total_tok_s, {ttft,tpot,e2e}_{mean,p50,p90,p99}_s;
TTFT = first streamed token - send time, TPOT = (last - first token) / (output tokens - 1), E2E = last - send)
plus failed_requests, and, when --router-metrics points at the router, requests per rank and the mean
predicted local activation rate. <out>/serve_config.json records the arguments. The figures can then put
sim_per_rate.csv and real_per_rate.csv of the same system side by side.

Legend: R requests per rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from repro.atomic import atomic_write, atomic_write_text
from repro.errors import ConfigError, ReproError
from repro.sim.metrics import LATENCIES, STATISTICS, statistic

REAL_COLUMNS = ("rate", "num_requests", "makespan_s", "throughput_rps", "output_tok_s", "total_tok_s") + tuple(
    f"{name}_{stat}_s" for name in LATENCIES for stat in STATISTICS
)


def per_rate_row(rate: float, send: np.ndarray, first: np.ndarray, finish: np.ndarray, output_tokens: np.ndarray,
                 prompt_tokens: np.ndarray, failed: int) -> dict:
    """One real_per_rate.csv row; send / first / finish float64[R] seconds of the completed requests,
    output_tokens / prompt_tokens int[R]. Same definitions as repro.sim.metrics (TPOT NaN for one-token outputs)."""
    decode_steps = (output_tokens - 1).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(decode_steps > 0, (finish - first) / decode_steps, np.nan)
    latency = {"ttft": first - send, "tpot": tpot, "e2e": finish - send}
    makespan = float(finish.max() - send.min()) if len(send) else float("nan")
    row = {
        "rate": float(rate), "num_requests": int(len(send)), "makespan_s": makespan,
        "throughput_rps": len(send) / makespan if len(send) else 0.0,
        "output_tok_s": float(output_tokens.sum()) / makespan if len(send) else 0.0,
        "total_tok_s": float((output_tokens + prompt_tokens).sum()) / makespan if len(send) else 0.0,
    }
    for name in LATENCIES:
        for stat in STATISTICS:
            row[f"{name}_{stat}_s"] = statistic(latency[name], stat)
    row["failed_requests"] = int(failed)
    return row


async def _one(session, url: str, body: dict) -> tuple[float, float, int]:
    """(first token time, finish time, output tokens) of one streamed completion (time.monotonic seconds)."""
    first = None
    tokens = chunks = 0
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise ReproError(f"HTTP {response.status}: {(await response.text())[:200]}")
        buffer = b""
        async for piece in response.content.iter_any():
            buffer += piece
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                line = event.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                data = json.loads(line[5:])
                if data.get("choices"):
                    first = first if first is not None else time.monotonic()
                    chunks += 1
                usage = data.get("usage") or {}
                tokens = int(usage.get("completion_tokens") or tokens)
    if first is None:
        raise ReproError("the stream carried no token")
    return first, time.monotonic(), tokens or chunks


async def sweep_rate(url: str, model: str, prompts: Sequence[np.ndarray], output_lens: Sequence[int], rate: float,
                     seed: int, max_in_flight: int, timeout: float, progress: bool) -> dict:
    """Send every prompt once with Poisson arrivals at `rate` req/s; the per-rate row."""
    import aiohttp
    from tqdm import tqdm

    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, len(prompts)))
    limit = asyncio.Semaphore(max_in_flight)
    send, first, finish = (np.full(len(prompts), np.nan) for _ in range(3))
    outputs = np.zeros(len(prompts), dtype=np.int64)
    errors: list[str] = []
    bar = tqdm(total=len(prompts), desc=f"rate {rate:g}/s", unit="req", disable=not progress)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        start = time.monotonic()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.monotonic()))
            body = {"model": model, "prompt": [int(x) for x in prompts[i]], "max_tokens": int(output_lens[i]),
                    "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            async with limit:
                send[i] = time.monotonic()
                try:
                    first[i], finish[i], outputs[i] = await _one(session, url, body)
                except (ReproError, aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
                    errors.append(f"{type(e).__name__}: {e}")
            bar.update()

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    bar.close()
    done = np.isfinite(finish)
    prompt_tokens = np.array([len(p) for p in prompts], dtype=np.int64)
    row = per_rate_row(rate, send[done], first[done], finish[done], outputs[done], prompt_tokens[done], int((~done).sum()))
    if errors:
        row["first_error"] = errors[0]
    return row


def router_snapshot(metrics_url: str) -> dict:
    """Requests per rank and predicted-LAR sums/counts from a router's /metrics (empty when unreachable)."""
    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except (OSError, urllib.error.URLError):
        return {}
    out: dict = {}
    for line in text.splitlines():
        if line.startswith("semmoe_router_requests_total{"):
            rank = line.split('rank="')[1].split('"')[0]
            out[f"router_requests_rank{rank}"] = float(line.split()[-1])
        for suffix in ("sum", "count"):
            if line.startswith(f"semmoe_router_predicted_local_activation_rate_{suffix}"):
                out[f"lar_{suffix}"] = out.get(f"lar_{suffix}", 0.0) + float(line.split()[-1])
    return out


def _delta(after: dict, before: dict) -> dict:
    """Router counters accumulated during one rate, and the mean predicted LAR over that rate's requests."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    if delta.get("lar_count"):
        delta["predicted_lar_mean"] = delta["lar_sum"] / delta["lar_count"]
    return {k: v for k, v in delta.items() if not k.startswith("lar_")}


def _first_model(url: str) -> str:
    try:
        data = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=10).read())
        return str(data["data"][0]["id"])
    except (OSError, KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"cannot list models at {url}/v1/models ({e}); pass --model.") from e


def run_sweep(args) -> pd.DataFrame:
    from repro.engines.capture import _workload_kwargs
    from repro.workloads import load_workload

    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError as e:
        raise ConfigError(f"--rates {args.rates!r} is not a comma-separated list of numbers.") from e
    if not rates or min(rates) <= 0 or args.max_in_flight < 1:
        raise ConfigError("--rates must be positive numbers and --max-in-flight >= 1.")
    name, kwargs = _workload_kwargs(args.workload)
    workload = load_workload(name, **kwargs)
    prompts = [r.token_ids for r in workload.requests]
    output_lens = [max(r.output_len, 1) for r in workload.requests]
    url = args.url.rstrip("/")
    model = args.model or _first_model(url)
    rows = []
    for index, rate in enumerate(rates):
        before = router_snapshot(args.router_metrics) if args.router_metrics else {}
        row = asyncio.run(sweep_rate(url, model, prompts, output_lens, rate, args.seed + index, args.max_in_flight,
                                     args.timeout, not args.no_progress))
        if args.router_metrics:
            row.update(_delta(router_snapshot(args.router_metrics), before))
        rows.append(row)
        print(f"rate {rate:g}/s: {row['num_requests']} done, {row['failed_requests']} failed, TTFT p50 "
              f"{row['ttft_p50_s'] * 1e3:.1f} ms, TPOT p50 {row['tpot_p50_s'] * 1e3:.1f} ms", file=sys.stderr)
    table = pd.DataFrame(rows)
    out = Path(args.out)
    atomic_write(out / "real_per_rate.csv", lambda p: table.to_csv(p, index=False))
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    atomic_write_text(out / "serve_config.json", json.dumps({"args": config, "workload": workload.config}, indent=1))
    return table


# ---- serve ---------------------------------------------------------------------------------------------------


def serve_commands(args) -> tuple[list[str], dict, list[str]]:
    """(engine argv, engine env additions, router argv); exports the placement into <job>/engine/."""
    from repro.engines import sglang, vllm
    from repro.engines.sglang import load_saved

    saved = load_saved(args)
    folder = saved.source.parent / "engine"
    placement = saved.placement
    redundant = placement.num_slots - placement.num_experts
    attention = saved.plan.parallel.attention
    env: dict = {}
    if args.engine == "sglang":
        location = folder / "init_expert_location.json"
        sglang.export_location(saved, location)
        engine = sglang.launch_command(args.model_path, location, placement.num_devices, attention, redundant, args.server_port)
    else:
        location = folder / "vllm_placement.json"
        vllm.export_placement(saved, location)
        assignment, *engine = vllm.launch_command(args.model_path, location, placement.num_devices, attention, redundant,
                                                  args.server_port)
        key, _, value = assignment.partition("=")
        env[key] = value
    router = [sys.executable, "-m", "repro.engines.router", "--plan", str(args.plan), "--engine", args.engine,
              "--upstream", f"http://127.0.0.1:{args.server_port}", "--port", str(args.router_port)]
    if args.tokenizer:
        router += ["--tokenizer", args.tokenizer]
    return engine, env, router


def _wait_healthy(url: str, seconds: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ReproError(f"the server exited with status {process.returncode} before {url} became healthy.")
        try:
            if urllib.request.urlopen(url, timeout=5).status == 200:
                return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(5)
    raise ReproError(f"{url} was not healthy after {seconds:g} s; see the server's log.")


def run_serve(args) -> int:
    import shlex

    engine, env, router = serve_commands(args)
    print(" ".join(f"{k}={v}" for k, v in env.items()) + (" " if env else "") + shlex.join(engine))
    print(shlex.join(router))
    if args.print:
        return 0
    server = subprocess.Popen(engine, env={**os.environ, **env})
    proxy = None
    try:
        _wait_healthy(f"http://127.0.0.1:{args.server_port}/health", args.startup_timeout, server)
        proxy = subprocess.Popen(router)
        print(f"serving: engine on :{args.server_port}, router on :{args.router_port}; Ctrl-C stops both", file=sys.stderr)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        for process in (proxy, server):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(60)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from repro.engines.sglang import _layout_args

    p = argparse.ArgumentParser(prog="python -m repro.engines.bench_serving", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="export the placement, start the engine and the router")
    serve.add_argument("--engine", choices=["sglang", "vllm"], default="sglang")
    serve.add_argument("--plan", type=Path, required=True, help="job directory under runs/ or its plan/ folder")
    serve.add_argument("--model-path", required=True, help="HF id or local folder the engine serves")
    serve.add_argument("--tokenizer", help="the router's tokenizer (default: the job's)")
    serve.add_argument("--server-port", type=int, default=30000)
    serve.add_argument("--router-port", type=int, default=8080)
    serve.add_argument("--startup-timeout", type=float, default=1800.0)
    serve.add_argument("--print", action="store_true", help="only print the commands")
    _layout_args(serve)
    sweep = sub.add_parser("sweep", help="request-rate sweep against a running server or router")
    sweep.add_argument("--url", required=True, help="the router (or the server itself, for a baseline)")
    sweep.add_argument("--rates", required=True, help="comma-separated request rates (req/s)")
    sweep.add_argument("--out", type=Path, required=True, help="folder for real_per_rate.csv (e.g. runs/serve_real/<name>)")
    sweep.add_argument("--model", help="the model field of each request (default: the first of /v1/models)")
    sweep.add_argument("--router-metrics", help="the router's /metrics URL, to record requests per rank and LAR")
    sweep.add_argument("--max-in-flight", type=int, default=1024)
    sweep.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    sweep.add_argument("--seed", type=int, default=0)
    sweep.add_argument("--no-progress", action="store_true")
    sweep.add_argument("workload", nargs="+", help="workload=<name> and load_workload key=value arguments")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return run_serve(args)
        table = run_sweep(args)
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {Path(args.out) / 'real_per_rate.csv'}: {len(table)} rates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
