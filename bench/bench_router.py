"""Added latency of the semantic DP router (repro.engines.router) in front of an upstream that answers at once.

Three processes on this machine: a fake upstream (aiohttp, answers each POST with a small JSON echo), the router
(`python -m repro.engines.router`, the real CLI, mixtral tokenizer, a Sem-MoE plan of Qwen3-30B-A3B's size:
48 layers, EP 8, 8,192 token rows), and the client (aiohttp) sending real MMLU prompts to /v1/completions.
Each phase runs the same requests straight to the upstream and through the router; the router's added latency
is the difference of the two latency distributions at the same percentile. Phases: serial (one request in
flight); loaded (64 in flight against the instant echo: a closed loop that saturates the router, so its added
latency is queueing at the router's capacity, reported as router_capacity_rps); paced (open-loop Poisson arrivals
at each of PACED_RATES req/s, at most 64 in flight, against an upstream that takes 50 ms per request: the regime of a
real model server; PACED_RATES). Latencies are path overheads: client latency minus the time the upstream held the
request. Two runs differ by whatever else the machine does meanwhile, so a percentile difference can even come out
negative; the routed path overhead itself (client -> router -> upstream and back, minus the upstream's time) is
an upper bound on the router's added latency that does not depend on a second run. Also: the router's in-process routing time (tokenize + Algorithm 2 + predicted LAR) per
request, and a check that every request came back exactly once with ranks balanced by the round-robin mask.

Target (issue 10): p99 added latency <= 2 ms per request. The client, router and upstream share the 2 cores
(and whatever else runs on the machine), so the loaded numbers include CPU contention between them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

RANK_HEADER = "X-Data-Parallel-Rank"
PACED_RATES = (200.0, 400.0, 800.0)  # req/s offered in the paced phases (10, 20, 40 in flight at 50 ms each)


def free_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def serve_fake_upstream(port: int) -> None:
    """The upstream: echo the request id and the rank header, at once."""
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        t_in = time.monotonic()
        if body.get("delay_ms"):
            await asyncio.sleep(body["delay_ms"] / 1e3)
        return web.json_response({"id": body.get("id"), "rank": request.headers.get(RANK_HEADER), "t_in": t_in,
                                  "t_out": time.monotonic(), "choices": [{"text": "ok", "index": 0}]})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def write_plan(root: Path, seed: int = 0) -> Path:
    """A job dir with a Sem-MoE plan of Qwen3-30B-A3B's size and random tables (routing time does not depend
    on the table values)."""
    import yaml

    from repro.parallel import ParallelConfig
    from repro.systems.base import Placement
    from repro.systems.semmoe.system import SemMoEPlan

    rng = np.random.default_rng(seed)
    layers, experts, devices, rows, vocab = 48, 128, 8, 8192, 32000
    expert_device = np.tile(np.arange(experts) % devices, (layers, 1))
    placement = Placement.from_expert_device(np.stack([rng.permutation(expert_device[0]) for _ in range(layers)]), devices)
    dp_score = rng.dirichlet(np.full(devices, 0.3), size=rows + 1).astype(np.float32)
    dp_score[rows] = 0.0
    plan = SemMoEPlan(
        placement, ParallelConfig(devices=devices, tokens_per_step=4096), np.sort(rng.choice(vocab, rows, replace=False)).astype(np.int32),
        rng.integers(0, rows + 1, vocab).astype(np.int32), rng.integers(0, devices, (layers, rows + 1)).astype(np.int16),
        rng.uniform(0.2, 1.0, (layers, rows + 1)).astype(np.float32), dp_score, lookback=0,
        token_frequency=rng.integers(1, 100, rows + 1).astype(np.float32),
    )
    job = root / "job"
    plan.save(job / "plan")
    config = {"model": {"name": "qwen3_30b_a3b_shape", "num_experts": experts, "tokenizer": "mixtral"},
              "parallel": {"devices": devices, "attention": "dp", "tokens_per_step": 4096, "bytes_per_token": 4096,
                           "devices_per_node": 8}}
    (job / "config.yaml").write_text(yaml.safe_dump(config))
    return job


def wait_for(url: str, seconds: float = 60.0) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/metrics", timeout=1).read()
            return
        except urllib.error.HTTPError:
            return  # something answers
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up within {seconds:g} s")


async def send_all(url: str, prompts: list[str], concurrency: int, delay_ms: float = 0.0,
                   rate: float | None = None) -> tuple[np.ndarray, list[dict], float, int]:
    """(path overhead seconds float64[R], echoes in request order, wall seconds, most requests in flight).

    POST /v1/completions per prompt; the upstream waits delay_ms before answering. Closed loop with
    `concurrency` in flight, or (rate) open-loop Poisson arrivals at `rate` req/s (seeded). A request's path
    overhead is its client-side latency minus the time the upstream held it (both clocks CLOCK_MONOTONIC):
    what the HTTP path (and the router, when there is one) costs, without the upstream's own delay.
    """
    import aiohttp

    limit = asyncio.Semaphore(concurrency)
    overhead = np.zeros(len(prompts))
    echoes: list[dict] = [{}] * len(prompts)
    arrivals = np.cumsum(np.random.default_rng(0).exponential(1.0 / rate, len(prompts))) if rate else None
    state = {"in_flight": 0, "most": 0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        wall = time.monotonic()

        async def one(i: int) -> None:
            if arrivals is not None:
                await asyncio.sleep(max(0.0, wall + arrivals[i] - time.monotonic()))
            async with limit:
                state["in_flight"] += 1
                state["most"] = max(state["most"], state["in_flight"])
                started = time.monotonic()
                body = {"prompt": prompts[i], "id": i, "max_tokens": 1, "delay_ms": delay_ms}
                async with session.post(url + "/v1/completions", json=body) as r:
                    echoes[i] = json.loads(await r.read())
                overhead[i] = time.monotonic() - started - (echoes[i]["t_out"] - echoes[i]["t_in"])
                state["in_flight"] -= 1

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return overhead, echoes, time.monotonic() - wall, state["most"]


def percentiles(values: np.ndarray) -> dict:
    return {f"p{q}_ms": float(np.percentile(values, q) * 1e3) for q in (50, 90, 99)}


def compare(prompts: list[str], direct_url: str, router_url: str, concurrency: int, delay_ms: float = 0.0,
            rate: float | None = None) -> dict:
    """Direct and routed runs of the same prompts; added overhead per percentile, checks of the echoes."""
    direct, _, direct_wall, _ = asyncio.run(send_all(direct_url, prompts, concurrency, delay_ms, rate))
    routed, echoes, routed_wall, most = asyncio.run(send_all(router_url, prompts, concurrency, delay_ms, rate))
    ids = [e.get("id") for e in echoes]
    ranks = Counter(e.get("rank") for e in echoes)
    d, r = percentiles(direct), percentiles(routed)
    return {
        "requests": len(prompts), "concurrency_limit": concurrency, "offered_rps": rate or "closed loop",
        "upstream_delay_ms": delay_ms, "most_in_flight": most,
        "direct_overhead": d, "routed_overhead": r, "added": {k: r[k] - d[k] for k in d},
        "direct_rps": len(prompts) / direct_wall, "routed_rps": len(prompts) / routed_wall,
        "lost_or_duplicated": len(prompts) - len(set(ids) & set(range(len(prompts)))),
        "requests_per_rank": dict(sorted(ranks.items())),
    }


def routing_in_process(job: Path, prompts: list[str]) -> dict:
    """Seconds per request of SemanticRouter.token_ids + route, in this process (no HTTP)."""
    from repro.engines.layout import read_plan
    from repro.engines.router import SemanticRouter
    from repro.workloads import load_tokenizer

    plan, _, _ = read_plan(job)
    router = SemanticRouter(plan, load_tokenizer("mixtral"))
    times = np.zeros(len(prompts))
    for i, prompt in enumerate(prompts):
        started = time.perf_counter()
        router.route(router.token_ids(prompt))
        times[i] = time.perf_counter() - started
    return percentiles(times)


def run(quick: bool) -> dict:
    from repro.workloads import load_workload

    total = 500 if quick else 2000
    workload = load_workload("mmlu", tokenizer="mixtral", num_requests=total, max_prompt_len=1024, seed=0)
    prompts = [r.text for r in workload.requests]
    lengths = np.array([len(r.token_ids) for r in workload.requests])
    with tempfile.TemporaryDirectory(prefix="bench_router.") as tmp:
        job = write_plan(Path(tmp))
        upstream_port, router_port = free_port(), free_port()
        upstream = subprocess.Popen([sys.executable, "-m", "bench.bench_router", "--fake-upstream", str(upstream_port)])
        router = subprocess.Popen([
            sys.executable, "-m", "repro.engines.router", "--plan", str(job), "--port", str(router_port),
            "--upstream", f"http://127.0.0.1:{upstream_port}",
        ], stderr=subprocess.DEVNULL)
        try:
            direct_url, router_url = f"http://127.0.0.1:{upstream_port}", f"http://127.0.0.1:{router_port}"
            wait_for(direct_url)
            wait_for(router_url)
            asyncio.run(send_all(router_url, prompts[:100], 8))  # warm-up (tokenizer, connections)
            serial = compare(prompts[: total // 4], direct_url, router_url, 1)
            loaded = compare(prompts, direct_url, router_url, 64)
            # a model-server-like upstream (50 ms per request) under Poisson arrivals below the router's capacity
            paced = {rate: compare(prompts, direct_url, router_url, 64, delay_ms=50.0, rate=rate) for rate in PACED_RATES}
        finally:
            for process in (router, upstream):
                process.terminate()
                process.wait(10)
        in_process = routing_in_process(job, prompts)
    return {
        "prompt_tokens_mean": float(lengths.mean()), "prompt_tokens_max": int(lengths.max()),
        "serial_added_p50_ms": serial["added"]["p50_ms"], "serial_added_p99_ms": serial["added"]["p99_ms"],
        "serial_routed_overhead_p99_ms": serial["routed_overhead"]["p99_ms"],
        "loaded_added_p50_ms": loaded["added"]["p50_ms"], "loaded_added_p99_ms": loaded["added"]["p99_ms"],
        "routing_in_process_p50_ms": in_process["p50_ms"], "routing_in_process_p99_ms": in_process["p99_ms"],
        **{f"paced_{rate:g}rps_added_p99_ms": phase["added"]["p99_ms"] for rate, phase in paced.items()},
        **{f"paced_{rate:g}rps_routed_overhead_p99_ms": phase["routed_overhead"]["p99_ms"] for rate, phase in paced.items()},
        "router_capacity_rps": loaded["routed_rps"],
        "lost_or_duplicated": sum(p["lost_or_duplicated"] for p in (serial, loaded, *paced.values())),
        "phases": {"serial (1 in flight)": serial, "loaded (64 in flight, echo upstream)": loaded,
                   **{f"paced ({rate:g} req/s Poisson, 50 ms upstream)": phase for rate, phase in paced.items()}},
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--fake-upstream":
        serve_fake_upstream(int(sys.argv[2]))
    else:
        print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
