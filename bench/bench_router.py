"""Added latency of the semantic DP router (repro.engines.router) in front of an upstream, and its CPU cost.

Three processes on this machine: a fake upstream (aiohttp, answers each POST with a small JSON echo), the router
(`python -m repro.engines.router`, the real CLI, mixtral tokenizer, a Sem-MoE plan of Qwen3-30B-A3B's size:
48 layers, EP 8, 8,192 token rows), and the client (aiohttp) sending real MMLU prompts to /v1/completions.
Each phase runs the same requests straight to the upstream and through the router.

Two measures of what the router adds, both reported, each labelled:
- client-side: the difference of the routed and direct distributions of path overhead (client latency minus the
  time the upstream held the request, both CLOCK_MONOTONIC) at the same percentile. Complete (every cost of the
  extra hop is in it) but a difference of two runs, so whatever else the machine does meanwhile moves it, and
  it can even come out negative; the routed path overhead alone is an upper bound that needs no second run.
- server-side: the router's own histogram semmoe_router_added_seconds (handler start -> upstream request issued,
  plus upstream body received -> reply handed to the socket), scraped from /metrics before and after the
  phase; a percentile is given as the upper edge of the bucket it falls in. A lower bound: aiohttp's parsing
  and writing outside the handler and kernel queues are not in it.
Plus the router process's CPU seconds per request over the phase (/proc/<pid>/stat).

Phases: serial (one request in flight); issue (the issue's bounded load test: ISSUE_REQUESTS requests,
ISSUE_CONCURRENCY in flight, closed loop, every request checked back exactly once) against the instant echo,
where it saturates the 2 shared cores, and against an upstream that takes 50 ms per request (a model server's
regime); paced (open-loop Poisson arrivals at each of PACED_RATES req/s, at most 64 in flight, 50 ms upstream).
Also: the in-process routing time (tokenize + Algorithm 2 + predicted LAR) per request.

Target (issue 10): p99 added latency <= TARGET_P99_MS per request; issue_target_met is computed from the
client-side p99 of the issue phase against the echo upstream (server-side flags are reported beside it).
Why a saturated closed loop cannot meet it here (Little's law): C = 64 requests cycling with no think time each
take C / throughput; the router is one event-loop thread, so its throughput is at most 1 / (its CPU per request)
and a routed request takes at least C x cpu, against C / direct_rps direct (router_bound_added_mean_ms). The
target needs the router's whole CPU per request under (2 ms + C / direct_rps) / C (router_cpu_budget_for_target_us,
~120 us here), while tokenizing one MMLU prompt alone takes ~0.1 ms and the router measures ~0.4 ms. The
model-like closed loop (50 ms upstream) is below the router's capacity; its tail is the first wave of C requests
arriving at once, hence also client_side_added_after_first_wave. The client, router and upstream share the 2
cores (and whatever else runs on the machine, see load_average), so loaded numbers include their contention.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np

from repro.proctree import die_with, stop_group

RANK_HEADER = "X-Data-Parallel-Rank"
ISSUE_REQUESTS, ISSUE_CONCURRENCY = 2000, 64  # the issue's bounded load test
TARGET_P99_MS = 2.0  # the issue's target for the router's added latency
UPSTREAM_DELAY_MS = 50.0  # a model server's time per request, for the model-like phases
PACED_RATES = (200.0, 400.0, 800.0)  # req/s offered in the paced phases (10, 20, 40 in flight at 50 ms each)
ADDED_METRIC = "semmoe_router_added_seconds_bucket"


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
    gc.freeze()  # the harness's own collector pauses would land in both runs' tails
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc; fields 14 and 15 of stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def added_histogram(router_url: str) -> tuple[np.ndarray, np.ndarray]:
    """(upper bucket edges float64[B] in seconds, +inf last; cumulative counts float64[B]) of the router's
    semmoe_router_added_seconds, scraped from its /metrics."""
    text = urllib.request.urlopen(router_url + "/metrics", timeout=10).read().decode()
    edges, counts = [], []
    for line in text.splitlines():
        if line.startswith(ADDED_METRIC):
            edges.append(float(line.split('le="', 1)[1].split('"', 1)[0]))
            counts.append(float(line.rsplit(" ", 1)[1]))
    return np.array(edges), np.array(counts)


def bucket_percentiles(edges: np.ndarray, cumulative: np.ndarray) -> dict:
    """Upper edge in ms of the bucket holding each percentile (None past the last finite edge), from cumulative
    bucket counts float[B] of one phase."""
    total = cumulative[-1]
    out = {}
    for q in (50, 90, 99):
        edge = edges[int(np.searchsorted(cumulative, q / 100 * total))] if total else np.nan
        out[f"p{q}_le_ms"] = None if not np.isfinite(edge) else float(edge * 1e3)
    return out


def compare(prompts: list[str], direct_url: str, router_url: str, router_pid: int, concurrency: int,
            delay_ms: float = 0.0, rate: float | None = None) -> dict:
    """Direct and routed runs of the same prompts: added latency client-side (per percentile) and server-side
    (the router's histogram over the routed run), the router's CPU per request, checks of the echoes."""
    direct, _, direct_wall, _ = asyncio.run(send_all(direct_url, prompts, concurrency, delay_ms, rate))
    edges, before = added_histogram(router_url)
    cpu_before = cpu_seconds(router_pid)
    routed, echoes, routed_wall, most = asyncio.run(send_all(router_url, prompts, concurrency, delay_ms, rate))
    cpu = cpu_seconds(router_pid) - cpu_before
    server = bucket_percentiles(edges, added_histogram(router_url)[1] - before)
    ids = [e.get("id") for e in echoes]
    ranks = Counter(e.get("rank") for e in echoes)
    d, r = percentiles(direct), percentiles(routed)
    # a closed loop starts with `concurrency` requests at once: that first wave queues at the router
    d_later, r_later = percentiles(direct[concurrency:]), percentiles(routed[concurrency:])
    return {
        "requests": len(prompts), "concurrency_limit": concurrency, "offered_rps": rate or "closed loop",
        "upstream_delay_ms": delay_ms, "most_in_flight": most,
        "direct_overhead": d, "routed_overhead": r, "client_side_added": {k: r[k] - d[k] for k in d},
        "client_side_added_after_first_wave": {k: r_later[k] - d_later[k] for k in d},
        "server_side_added": server, "router_cpu_us_per_request": cpu / len(prompts) * 1e6,
        "direct_rps": len(prompts) / direct_wall, "routed_rps": len(prompts) / routed_wall,
        "lost_or_duplicated": len(prompts) - len(set(ids) & set(range(len(prompts)))) + len(ids) - len(set(ids)),
        "requests_per_rank": dict(sorted(ranks.items())),
    }


def issue_summary(prefix: str, phase: dict) -> dict:
    """The issue's numbers for one closed-loop phase: added p50/p99 both ways, target flags, and the least
    added latency a one-thread router with the measured CPU per request allows in this loop."""
    client, server = phase["client_side_added"], phase["server_side_added"]
    server_p99 = server["p99_le_ms"]
    concurrency, cpu_us = phase["concurrency_limit"], phase["router_cpu_us_per_request"]
    # Little's law: C requests cycling with no think time take C / throughput each; the router (one event-loop
    # thread) serves at most 1 / cpu requests a second, so a routed request takes >= C x cpu, a direct one
    # C / direct_rps
    direct_cycle_ms = concurrency / phase["direct_rps"] * 1e3
    return {
        f"{prefix}_client_side_added_p50_ms": client["p50_ms"],
        f"{prefix}_client_side_added_p99_ms": client["p99_ms"],
        f"{prefix}_client_side_added_p99_after_first_wave_ms": phase["client_side_added_after_first_wave"]["p99_ms"],
        f"{prefix}_server_side_added_p50_le_ms": server["p50_le_ms"],
        f"{prefix}_server_side_added_p99_le_ms": server_p99,
        f"{prefix}_target_met": bool(client["p99_ms"] <= TARGET_P99_MS),
        f"{prefix}_server_side_target_met": server_p99 is not None and server_p99 <= TARGET_P99_MS,
        f"{prefix}_router_cpu_us_per_request": cpu_us,
        f"{prefix}_router_bound_added_mean_ms": max(0.0, concurrency * cpu_us / 1e3 - direct_cycle_ms),
        f"{prefix}_router_cpu_budget_for_target_us": (TARGET_P99_MS + direct_cycle_ms) / concurrency * 1e3,
        f"{prefix}_lost_or_duplicated": phase["lost_or_duplicated"],
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

    total = 500 if quick else ISSUE_REQUESTS
    workload = load_workload("mmlu", tokenizer="mixtral", num_requests=total, max_prompt_len=1024, seed=0)
    prompts = [r.text for r in workload.requests]
    lengths = np.array([len(r.token_ids) for r in workload.requests])
    cores = len(os.sched_getaffinity(0))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_router.") as tmp:
        job = write_plan(Path(tmp))
        upstream_port, router_port = free_port(), free_port()
        # both die with this benchmark, even by SIGKILL, and are stopped as groups (repro.proctree)
        tied = {"preexec_fn": functools.partial(die_with, os.getpid()), "start_new_session": True}
        upstream = subprocess.Popen([sys.executable, "-m", "bench.bench_router", "--fake-upstream", str(upstream_port)],
                                    **tied)
        router = subprocess.Popen([
            sys.executable, "-m", "repro.engines.router", "--plan", str(job), "--port", str(router_port),
            "--upstream", f"http://127.0.0.1:{upstream_port}",
        ], stderr=subprocess.DEVNULL, **tied)
        try:
            direct_url, router_url = f"http://127.0.0.1:{upstream_port}", f"http://127.0.0.1:{router_port}"
            wait_for(direct_url)
            wait_for(router_url)
            asyncio.run(send_all(router_url, prompts[:100], 8))  # warm-up (tokenizer, connections)
            gc.collect()
            gc.freeze()  # a full collection in the client (it keeps every echo) would land in one run's tail
            serial = compare(prompts[: total // 4], direct_url, router_url, router.pid, 1)
            issue = compare(prompts, direct_url, router_url, router.pid, ISSUE_CONCURRENCY)
            issue_model = compare(prompts, direct_url, router_url, router.pid, ISSUE_CONCURRENCY,
                                  delay_ms=UPSTREAM_DELAY_MS)
            paced = {rate: compare(prompts, direct_url, router_url, router.pid, 64, delay_ms=UPSTREAM_DELAY_MS,
                                   rate=rate) for rate in PACED_RATES}
        finally:
            gc.unfreeze()
            for process in (router, upstream):
                stop_group(process, 10)
        in_process = routing_in_process(job, prompts)
    phases = {"serial (1 in flight)": serial, "issue (closed loop, echo upstream)": issue,
              f"issue (closed loop, {UPSTREAM_DELAY_MS:g} ms upstream)": issue_model,
              **{f"paced ({rate:g} req/s Poisson, {UPSTREAM_DELAY_MS:g} ms upstream)": phase
                 for rate, phase in paced.items()}}
    return {
        "prompt_tokens_mean": float(lengths.mean()), "prompt_tokens_max": int(lengths.max()),
        "issue_requests": len(prompts), "issue_concurrency": ISSUE_CONCURRENCY, "target_p99_ms": TARGET_P99_MS,
        "issue_target_met": bool(issue["client_side_added"]["p99_ms"] <= TARGET_P99_MS),
        **issue_summary("issue_echo", issue),
        **issue_summary(f"issue_{UPSTREAM_DELAY_MS:g}ms", issue_model),
        "serial_client_side_added_p50_ms": serial["client_side_added"]["p50_ms"],
        "serial_client_side_added_p99_ms": serial["client_side_added"]["p99_ms"],
        "serial_server_side_added_p99_le_ms": serial["server_side_added"]["p99_le_ms"],
        "serial_routed_overhead_p99_ms": serial["routed_overhead"]["p99_ms"],
        "routing_in_process_p50_ms": in_process["p50_ms"], "routing_in_process_p99_ms": in_process["p99_ms"],
        **{f"paced_{rate:g}rps_client_side_added_p99_ms": phase["client_side_added"]["p99_ms"]
           for rate, phase in paced.items()},
        **{f"paced_{rate:g}rps_server_side_added_p99_le_ms": phase["server_side_added"]["p99_le_ms"]
           for rate, phase in paced.items()},
        **{f"paced_{rate:g}rps_routed_overhead_p99_ms": phase["routed_overhead"]["p99_ms"]
           for rate, phase in paced.items()},
        "router_capacity_rps": issue["routed_rps"],
        "lost_or_duplicated": sum(p["lost_or_duplicated"] for p in phases.values()),
        "cores_usable": cores, "load_average_1min_before": load_before, "load_average_1min_after": os.getloadavg()[0],
        "phases": phases,
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--fake-upstream":
        serve_fake_upstream(int(sys.argv[2]))
    else:
        print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
