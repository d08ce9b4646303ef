"""Real serving benchmark of a plan: launch the engine with its placement and the semantic router, then sweep
request rates and record TTFT / TPOT / ITL / E2E in the simulator's per-rate schema. Needs GPUs; never run in CI.

    # 8-GPU server, Attention-DP, DeepSeek-V2-Lite, a plan fitted on its captured routing (prints what it runs,
    # then serves; the model's config.json comes from the model folder, the HF cache or a known hub id):
    python -m repro.engines.bench_serving serve --engine sglang --plan runs/<job> \\
        --model-path deepseek-ai/DeepSeek-V2-Lite
    # in another shell, through the router (port 8080):
    python -m repro.engines.bench_serving sweep --url http://127.0.0.1:8080 --rates 2,4,8,16,32 \\
        --out runs/serve_real/dsv2_semmoe workload=mmlu tokenizer=hf:deepseek-ai/DeepSeek-V2-Lite \\
        num_requests=500 output_len=128
    # the baseline: the same server without --init-expert-location, straight to port 30000 (no router)

`serve` checks that the plan fits the served model (experts, top-k, MoE layers; repro.engines.layout.check_serving)
and refuses a plan fitted on synthetic routing or on another tokenizer's ids unless --allow-synthetic-plan /
--allow-tokenizer-mismatch, exports the placement (SGLang `--init-expert-location` JSON, or the vLLM plugin's
placement file) into the job's engine/ folder, starts the server, waits for /health, starts `python -m
repro.engines.router` in front of it and keeps both until Ctrl-C (`--print` only prints the commands). The three
end together (repro.proctree): when serve dies, even by SIGKILL, the kernel sends both SIGTERM; when either child
dies, serve stops the other's whole process group and its own (an engine's own children included), SIGKILL after
STOP_GRACE_S.

`sweep` sends the workload's prompts at each rate (Poisson arrivals, seeded; open loop, at most --max-in-flight
outstanding) with one of three clients (--client, default auto: the first installed):
- `sglang`: `python -m sglang.bench_serving --backend sglang-oai` on a ShareGPT-format file of the prompts (the
  workload's token ids decoded to text with its tokenizer), --sharegpt-output-len, --output-details;
- `vllm`: `vllm bench serve --dataset-name custom` on a JSONL file of the prompts, --custom-output-len,
  --save-detailed;
- `builtin` (neither installed): token ids to /v1/completions, streamed, greedy, ignore_eos so every request
  generates exactly its output_len, after --warmup-requests requests that are not measured (the vLLM plugin's
  placement takes effect at the first EPLB rearrangement, a few dozen forward steps in).
The external tools take one output length and run their own warm-up (--warmup-requests is passed on); their
per-request results are converted to the same rows.

Outputs, written when the whole sweep is done (atomically): <out>/real_per_rate.csv, the columns of
repro.sim.metrics.rate_row that a real server can measure (rate, num_requests, makespan_s, throughput_rps,
output_tok_s, total_tok_s, {ttft,tpot,e2e}_{mean,p50,p90,p99}_s; TTFT = first streamed token - send time, TPOT =
(last - first token) / (output tokens - 1), E2E = last - send) plus failed_requests, itl_{mean,p50,p90,p99}_s
(ITL: the gaps between consecutive streamed chunks that carry text, pooled over the rate's requests, as
sglang.bench_serving and vllm bench serve define it) and, when --router-metrics points at the router, requests
per rank and the mean predicted local activation rate; <out>/requests.jsonl, one line per measured request
(rate, request index and id, send / first token / finish seconds from the rate's start, prompt and output
tokens, ttft / tpot / e2e, the ITL list, the DP rank when the response names it, the error); and
<out>/serve_config.json (the arguments, the workload, the client, the warm-up). A summary table like
sglang.bench_serving's is printed per rate. The figures can put sim_per_rate.csv and real_per_rate.csv of the
same system side by side.

Legend: R requests per rate, G inter-token gaps of a rate.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from repro import cli
from repro.atomic import atomic_write, atomic_write_text
from repro.errors import ConfigError, ReproError
from repro.proctree import STOP_SIGNALS, die_with, stop_group
from repro.sim.metrics import LATENCIES, STATISTICS, statistic

REAL_COLUMNS = ("rate", "num_requests", "makespan_s", "throughput_rps", "output_tok_s", "total_tok_s") + tuple(
    f"{name}_{stat}_s" for name in LATENCIES for stat in STATISTICS
)
ITL_COLUMNS = tuple(f"itl_{stat}_s" for stat in STATISTICS)
CLIENTS = ("auto", "builtin", "sglang", "vllm")
RANK_HEADERS = ("X-Data-Parallel-Rank", "X-data-parallel-rank")  # aiohttp looks headers up case-insensitively


def latency_row(rate: float, ttft: np.ndarray, e2e: np.ndarray, output_tokens: np.ndarray, prompt_tokens: np.ndarray,
                makespan: float, failed: int, itl: np.ndarray | None = None) -> dict:
    """One real_per_rate.csv row from the completed requests' ttft / e2e float64[R] seconds, output / prompt
    tokens int[R], the rate's makespan (first send -> last finish, seconds), the failures and every inter-token gap
    of the rate float64[G] (None: not measured). TPOT = (e2e - ttft) / (output tokens - 1), NaN for one token."""
    output_tokens = np.asarray(output_tokens, dtype=np.int64)
    prompt_tokens = np.asarray(prompt_tokens, dtype=np.int64)
    decode_steps = (output_tokens - 1).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(decode_steps > 0, (e2e - ttft) / decode_steps, np.nan)
    latency = {"ttft": np.asarray(ttft, dtype=np.float64), "tpot": tpot, "e2e": np.asarray(e2e, dtype=np.float64)}
    done = len(output_tokens)
    row = {
        "rate": float(rate), "num_requests": int(done), "makespan_s": float(makespan) if done else float("nan"),
        "throughput_rps": done / makespan if done else 0.0,
        "output_tok_s": float(output_tokens.sum()) / makespan if done else 0.0,
        "total_tok_s": float((output_tokens + prompt_tokens).sum()) / makespan if done else 0.0,
    }
    for name in LATENCIES:
        for stat in STATISTICS:
            row[f"{name}_{stat}_s"] = statistic(latency[name], stat)
    row["failed_requests"] = int(failed)
    gaps = np.asarray(itl if itl is not None else [], dtype=np.float64)
    for stat in STATISTICS:
        row[f"itl_{stat}_s"] = statistic(gaps, stat)
    return row


def per_rate_row(rate: float, send: np.ndarray, first: np.ndarray, finish: np.ndarray, output_tokens: np.ndarray,
                 prompt_tokens: np.ndarray, failed: int, itl: np.ndarray | None = None) -> dict:
    """One real_per_rate.csv row; send / first / finish float64[R] seconds of the completed requests,
    output_tokens / prompt_tokens int[R]. Same definitions as repro.sim.metrics (TPOT NaN for one-token outputs)."""
    makespan = float(finish.max() - send.min()) if len(send) else float("nan")
    return latency_row(rate, first - send, finish - send, output_tokens, prompt_tokens, makespan, failed, itl)


def summary_table(row: dict, client: str) -> str:
    """The per-rate summary as sglang.bench_serving prints it (ms), from a real_per_rate.csv row."""

    def ms(value: float) -> str:
        return f"{value * 1e3:<10.2f}" if np.isfinite(value) else "n/a"

    lines = [f"{' Serving Benchmark Result ':=^50}", f"{'Client:':<40} {client}",
             f"{'Traffic request rate:':<40} {row['rate']:g}",
             f"{'Successful requests:':<40} {row['num_requests']}", f"{'Failed requests:':<40} {row['failed_requests']}",
             f"{'Benchmark duration (s):':<40} {row['makespan_s']:<10.2f}",
             f"{'Request throughput (req/s):':<40} {row['throughput_rps']:<10.2f}",
             f"{'Output token throughput (tok/s):':<40} {row['output_tok_s']:<10.2f}",
             f"{'Total token throughput (tok/s):':<40} {row['total_tok_s']:<10.2f}"]
    for title, name in (("End-to-End Latency", "e2e"), ("Time to First Token", "ttft"),
                        ("Time per Output Token (excl. 1st token)", "tpot"), ("Inter-Token Latency", "itl")):
        label = "E2E Latency" if name == "e2e" else name.upper()
        lines.append(f"{title:-^50}")
        lines += [f"{f'Mean {label} (ms):':<40} {ms(row[f'{name}_mean_s'])}",
                  f"{f'Median {label} (ms):':<40} {ms(row[f'{name}_p50_s'])}",
                  f"{f'P90 {label} (ms):':<40} {ms(row[f'{name}_p90_s'])}",
                  f"{f'P99 {label} (ms):':<40} {ms(row[f'{name}_p99_s'])}"]
    lines.append("=" * 50)
    return "\n".join(line.rstrip() for line in lines)


def _finite_or_none(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


@dataclass
class Sent:
    """One request of the built-in client: times are time.monotonic() seconds (NaN: never reached)."""

    send: float = float("nan")
    chunks: list[float] = field(default_factory=list)  # arrival of every streamed chunk that carried text
    finish: float = float("nan")
    output_tokens: int = 0
    rank: int | None = None
    error: str | None = None


async def _stream(session, url: str, body: dict, sent: Sent) -> None:
    """Send one streamed completion and fill `sent` (chunk times, finish, output tokens, rank)."""
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise ReproError(f"HTTP {response.status}: {(await response.text())[:200]}")
        rank = next((response.headers[h] for h in RANK_HEADERS if h in response.headers), None)
        sent.rank = int(rank) if rank is not None and str(rank).isdigit() else None
        buffer = b""
        tokens = 0
        async for piece in response.content.iter_any():
            arrived = time.monotonic()
            buffer += piece
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                line = event.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                data = json.loads(line[5:])
                if not isinstance(data, dict):
                    raise ReproError(f"a streamed event is not a JSON object: {line[:80]!r}")
                # a chunk counts when it carries text, as in sglang.bench_serving / vllm bench serve (the final
                # usage chunk and an empty finish chunk do not)
                if any(isinstance(c, dict) and c.get("text") for c in data.get("choices") or []):
                    sent.chunks.append(arrived)
                usage = data.get("usage") or {}
                tokens = int(usage.get("completion_tokens") or tokens)
    if not sent.chunks:
        raise ReproError("the stream carried no token")
    sent.finish = time.monotonic()
    sent.output_tokens = tokens or len(sent.chunks)


def _body(model: str, prompt: np.ndarray, output_len: int) -> dict:
    return {"model": model, "prompt": [int(x) for x in prompt], "max_tokens": int(output_len), "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def _session(timeout: float):
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=timeout))


async def _send(session, url: str, body: dict, sent: Sent) -> None:
    import aiohttp

    sent.send = time.monotonic()
    try:
        await _stream(session, url, body, sent)
    except (ReproError, aiohttp.ClientError, TimeoutError, json.JSONDecodeError, ValueError) as e:
        sent.error = f"{type(e).__name__}: {e}"


async def warm_up(url: str, model: str, prompts: Sequence[np.ndarray], output_lens: Sequence[int], count: int,
                  max_in_flight: int, timeout: float) -> int:
    """Send the first `count` prompts (cycled) at once, at most max_in_flight outstanding, and measure nothing;
    returns how many succeeded. A ReproError when every one failed: the server is not serving."""
    if count <= 0:
        return 0
    limit = asyncio.Semaphore(max_in_flight)
    sent = [Sent() for _ in range(count)]
    async with _session(timeout) as session:

        async def one(i: int) -> None:
            async with limit:
                await _send(session, url, _body(model, prompts[i % len(prompts)], output_lens[i % len(prompts)]), sent[i])

        await asyncio.gather(*(one(i) for i in range(count)))
    ok = sum(s.error is None for s in sent)
    if not ok:
        raise ReproError(f"all {count} warm-up requests to {url} failed (first: {sent[0].error}); check the server.")
    return ok


async def sweep_rate(url: str, model: str, prompts: Sequence[np.ndarray], output_lens: Sequence[int], rate: float,
                     seed: int, max_in_flight: int, timeout: float, progress: bool,
                     request_ids: Sequence[str] | None = None) -> tuple[dict, list[dict]]:
    """Send every prompt once with Poisson arrivals at `rate` req/s; (the per-rate row, one record per request)."""
    from tqdm import tqdm

    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, len(prompts)))
    limit = asyncio.Semaphore(max_in_flight)
    sent = [Sent() for _ in prompts]
    bar = tqdm(total=len(prompts), desc=f"rate {rate:g}/s", unit="req", disable=not progress)
    async with _session(timeout) as session:
        start = time.monotonic()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.monotonic()))
            async with limit:
                await _send(session, url, _body(model, prompts[i], output_lens[i]), sent[i])
            bar.update()

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    bar.close()
    prompt_tokens = np.array([len(p) for p in prompts], dtype=np.int64)
    done = np.array([s.error is None for s in sent], dtype=bool)
    send = np.array([s.send for s in sent])
    first = np.array([s.chunks[0] if s.chunks else np.nan for s in sent])
    finish = np.array([s.finish for s in sent])
    outputs = np.array([s.output_tokens for s in sent], dtype=np.int64)
    gaps = [np.diff(s.chunks) for s in sent]
    itl = np.concatenate([g for g, ok in zip(gaps, done, strict=True) if ok] or [np.zeros(0)])
    row = per_rate_row(rate, send[done], first[done], finish[done], outputs[done], prompt_tokens[done],
                       int((~done).sum()), itl)
    errors = [s.error for s in sent if s.error]
    if errors:
        row["first_error"] = errors[0]
    records = []
    for i, s in enumerate(sent):
        ok = bool(done[i])
        records.append({
            "rate": float(rate), "request": i, "id": request_ids[i] if request_ids is not None else None,
            "send_s": _finite_or_none(s.send - start), "first_token_s": _finite_or_none(first[i] - start),
            "finish_s": _finite_or_none(s.finish - start), "prompt_tokens": int(prompt_tokens[i]),
            "output_tokens": int(outputs[i]) if ok else None,
            "ttft_s": _finite_or_none(first[i] - s.send) if ok else None,
            "tpot_s": _finite_or_none((s.finish - first[i]) / (outputs[i] - 1)) if ok and outputs[i] > 1 else None,
            "e2e_s": _finite_or_none(s.finish - s.send) if ok else None,
            "itl_s": [float(x) for x in gaps[i]], "rank": s.rank, "error": s.error,
        })
    return row, records


# ---- external clients: sglang.bench_serving, vllm bench serve ---------------------------------------------------


def tool_available(client: str) -> bool:
    """Whether `python -m sglang.bench_serving` (with the packages it imports) or the `vllm` CLI is installed."""
    if client == "sglang":
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            return False
        module = Path(next(iter(spec.submodule_search_locations))) / "bench_serving.py"
        return module.is_file() and all(importlib.util.find_spec(m) for m in ("aiohttp", "requests", "transformers"))
    if client == "vllm":
        return shutil.which("vllm") is not None
    return True


def choose_client(requested: str) -> str:
    """The client of --client: auto = sglang.bench_serving, else vllm bench serve, else the built-in one."""
    if requested == "auto":
        return next((c for c in ("sglang", "vllm") if tool_available(c)), "builtin")
    if not tool_available(requested):
        what = "python -m sglang.bench_serving" if requested == "sglang" else "the vllm CLI"
        raise ConfigError(f"--client {requested}: {what} is not installed here; install it or use --client builtin.")
    return requested


def write_tool_dataset(client: str, texts: Sequence[str], path: Path) -> None:
    """The prompts as the tool's dataset file: ShareGPT JSON (sglang: `--dataset-name sharegpt`, first turn the
    prompt; the second turn is required but unused with --sharegpt-output-len) or custom JSONL (vllm)."""
    if client == "sglang":
        rows = [{"conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": ""}]} for t in texts]
        atomic_write_text(path, json.dumps(rows))
    else:
        atomic_write_text(path, "".join(json.dumps({"prompt": t}) + "\n" for t in texts))


def tool_command(client: str, url: str, model: str | None, tokenizer: str | None, dataset: Path, num_prompts: int,
                 output_len: int, rate: float, seed: int, max_in_flight: int, warmup: int, result: Path) -> list[str]:
    """argv of one rate of the external benchmark (sglang.bench_serving 0.5.x / vllm bench serve 0.33 flags): the
    same prompts, greedy, ignore_eos, streamed, Poisson at `rate`, per-request details saved to `result`."""
    if client == "sglang":
        argv = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang-oai", "--base-url", url,
                "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--num-prompts", str(num_prompts),
                "--sharegpt-output-len", str(output_len), "--request-rate", f"{rate:g}", "--seed", str(seed),
                "--max-concurrency", str(max_in_flight), "--warmup-requests", str(warmup),
                "--output-file", str(result), "--output-details"]
    else:
        argv = ["vllm", "bench", "serve", "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
                "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template", "--disable-shuffle",
                "--num-prompts", str(num_prompts), "--custom-output-len", str(output_len), "--ignore-eos",
                "--temperature", "0", "--request-rate", f"{rate:g}", "--seed", str(seed),
                "--max-concurrency", str(max_in_flight), "--num-warmups", str(warmup),
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
                "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name]
    if model:
        argv += ["--model", model]
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    return argv


def read_tool_result(path: Path) -> dict:
    """The tool's result object of one run: sglang appends a JSON line per run (the last is ours), vLLM writes one
    JSON object."""
    try:
        text = path.read_text().strip()
        return json.loads(text.splitlines()[-1] if path.suffix == ".jsonl" else text)
    except (OSError, IndexError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReproError(f"the benchmark tool left no readable result in {path} ({e}); see its output above.") from e


def tool_rate(result: dict, rate: float, client: str) -> tuple[dict, list[dict]]:
    """(per-rate row, per-request records) of one run of an external tool from its per-request details
    (ttfts, itls, input_lens, output_lens, errors; e2els when the tool gives them, else ttft + the ITL sum) and
    its duration (the makespan). The tools do not report send times, so records hold latencies only."""
    try:
        ttft = np.asarray(result["ttfts"], dtype=np.float64)
        gaps = [np.asarray(g, dtype=np.float64) for g in result["itls"]]
        inputs = np.asarray(result["input_lens"], dtype=np.int64)
        outputs = np.asarray(result["output_lens"], dtype=np.int64)
        errors = [str(e or "") for e in result["errors"]]
        duration = float(result["duration"])
    except (KeyError, TypeError, ValueError) as e:
        raise ReproError(f"the {client} benchmark result lacks per-request details ({e}); it must be run with "
                         "--output-details (sglang) / --save-detailed (vllm).") from e
    if not len(ttft) == len(gaps) == len(inputs) == len(outputs) == len(errors):
        raise ReproError(f"the {client} benchmark result's per-request lists differ in length.")
    e2e = np.asarray(result["e2els"], dtype=np.float64) if "e2els" in result else \
        ttft + np.array([g.sum() for g in gaps])
    ok = np.array([not e for e in errors], dtype=bool)
    itl = np.concatenate([g for g, good in zip(gaps, ok, strict=True) if good] or [np.zeros(0)])
    row = latency_row(rate, ttft[ok], e2e[ok], outputs[ok], inputs[ok], duration, int((~ok).sum()), itl)
    errors_seen = [e for e in errors if e]
    if errors_seen:
        row["first_error"] = errors_seen[0][-200:]
    records = [{
        "rate": float(rate), "request": i, "id": None, "send_s": None, "first_token_s": None, "finish_s": None,
        "prompt_tokens": int(inputs[i]), "output_tokens": int(outputs[i]) if ok[i] else None,
        "ttft_s": float(ttft[i]) if ok[i] else None,
        "tpot_s": float((e2e[i] - ttft[i]) / (outputs[i] - 1)) if ok[i] and outputs[i] > 1 else None,
        "e2e_s": float(e2e[i]) if ok[i] else None, "itl_s": [float(x) for x in gaps[i]], "rank": None,
        "error": errors[i] or None,
    } for i in range(len(ttft))]
    return row, records


def run_tool(client: str, args, workload, url: str, rates: Sequence[float]) -> tuple[list[dict], list[dict], list[dict]]:
    """(per-rate rows, request records, raw results) of an external tool run once per rate on the workload."""
    from repro.workloads import load_tokenizer

    output_lens = {max(r.output_len, 1) for r in workload.requests}
    if len(output_lens) != 1:
        raise ConfigError(f"the workload's output lengths vary ({min(output_lens)}..{max(output_lens)}) but {client}'s "
                          "benchmark takes one; give output_len=<n> or use --client builtin.")
    output_len = output_lens.pop()
    if client == "sglang" and output_len < 4:
        raise ConfigError(f"sglang.bench_serving refuses an output length below 4 (got {output_len}); use --client builtin.")
    tokenizer = load_tokenizer(workload.tokenizer)
    texts = [tokenizer.decode([int(x) for x in r.token_ids]) for r in workload.requests]
    hf_tokenizer = workload.tokenizer[3:] if workload.tokenizer.startswith("hf:") else None
    rows, records, raw = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_serving_") as folder:
        dataset = Path(folder) / ("prompts.json" if client == "sglang" else "prompts.jsonl")
        write_tool_dataset(client, texts, dataset)
        for index, rate in enumerate(rates):
            result = Path(folder) / f"rate{index}.{'jsonl' if client == 'sglang' else 'json'}"
            argv = tool_command(client, url, args.model, hf_tokenizer, dataset, len(texts), output_len, rate,
                                args.seed + index, args.max_in_flight, args.warmup_requests, result)
            print("$ " + " ".join(argv), file=sys.stderr)
            before = router_snapshot(args.router_metrics) if args.router_metrics else {}
            # the tool dies with this sweep, even by SIGKILL: an orphaned one kept loading the server (repro.proctree)
            code = subprocess.run(argv, preexec_fn=functools.partial(die_with, os.getpid())).returncode
            if code != 0:
                raise ReproError(f"{client}'s benchmark exited with status {code} at rate {rate:g}; see its output above.")
            data = read_tool_result(result)
            row, rate_records = tool_rate(data, rate, client)
            if len(rate_records) != len(texts):  # sglang drops prompts that re-tokenize to fewer than 2 tokens
                row["tool_dropped_requests"] = len(texts) - len(rate_records)
                print(f"note: {client}'s benchmark ran {len(rate_records)} of the {len(texts)} prompts.", file=sys.stderr)
            if args.router_metrics:
                row.update(_delta(router_snapshot(args.router_metrics), before))
            rows.append(row)
            records += rate_records
            raw.append(data)
            print(summary_table(row, client))
    return rows, records, raw


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
    if not rates or not all(np.isfinite(rates)) or min(rates) <= 0 or args.max_in_flight < 1:
        raise ConfigError("--rates must be positive finite numbers and --max-in-flight >= 1.")
    # before any request: a sweep of a real engine is costly, and a rerun into the same folder replaced the last one
    cli.claim_output(Path(args.out) / "real_per_rate.csv", overwrite=args.overwrite)
    if args.warmup_requests < 0:
        raise ConfigError(f"--warmup-requests must be >= 0, got {args.warmup_requests}.")
    client = choose_client(args.client)
    name, kwargs = _workload_kwargs(args.workload)
    workload = load_workload(name, **kwargs)
    url = args.url.rstrip("/")
    raw: list[dict] = []
    warmed = None
    if client == "builtin":
        prompts = [r.token_ids for r in workload.requests]
        output_lens = [max(r.output_len, 1) for r in workload.requests]
        model = args.model or _first_model(url)
        warmed = asyncio.run(warm_up(url, model, prompts, output_lens, args.warmup_requests, args.max_in_flight,
                                     args.timeout))
        rows, records = [], []
        for index, rate in enumerate(rates):
            before = router_snapshot(args.router_metrics) if args.router_metrics else {}
            row, rate_records = asyncio.run(sweep_rate(url, model, prompts, output_lens, rate, args.seed + index,
                                                       args.max_in_flight, args.timeout, not args.no_progress,
                                                       [r.id for r in workload.requests]))
            if args.router_metrics:
                row.update(_delta(router_snapshot(args.router_metrics), before))
            rows.append(row)
            records += rate_records
            print(summary_table(row, client))
    else:
        rows, records, raw = run_tool(client, args, workload, url, rates)
    table = pd.DataFrame(rows)
    out = Path(args.out)
    atomic_write(out / "real_per_rate.csv", lambda p: table.to_csv(p, index=False))
    atomic_write_text(out / "requests.jsonl", "".join(json.dumps(r, allow_nan=False) + "\n" for r in records))
    if raw:
        atomic_write_text(out / f"{client}_results.jsonl", "".join(json.dumps(r) + "\n" for r in raw))
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    atomic_write_text(out / "serve_config.json", json.dumps(
        {"args": config, "client": client, "warmup": {"requests": args.warmup_requests, "succeeded": warmed},
         "workload": workload.config}, indent=1))
    return table


# ---- serve ---------------------------------------------------------------------------------------------------


def serve_commands(args) -> tuple[list[str], dict, list[str]]:
    """(engine argv, engine env additions, router argv); exports the placement into <job>/engine/."""
    from repro.engines import sglang, vllm
    from repro.engines.sglang import load_for_serving

    saved = load_for_serving(args, args.model_path)
    folder = saved.source.parent / "engine"
    placement = saved.placement
    redundant = placement.num_slots - placement.num_experts
    attention = saved.plan.parallel.attention
    env: dict = {}
    if args.engine == "sglang":
        location = folder / "init_expert_location.json"
        sglang.export_location(saved, location, overwrite=True)  # the job's own derived file, re-made each serve
        engine = sglang.launch_command(args.model_path, location, placement.num_devices, attention, redundant, args.server_port)
    else:
        location = folder / "vllm_placement.json"
        vllm.export_placement(saved, location, overwrite=True)
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


CHILD_POLL_S = 1.0  # how often serve checks that the engine and the router still run
STOP_GRACE_S = 60.0  # a child's group gets SIGTERM, then SIGKILL after this long (an engine frees its GPU memory)


def run_serve(args) -> int:
    import shlex

    engine, env, router = serve_commands(args)
    print(" ".join(f"{k}={v}" for k, v in env.items()) + (" " if env else "") + shlex.join(engine))
    print(shlex.join(router))
    if args.print:
        return 0
    # each child leads its own process group (stopped as a whole: an engine killed by SIGKILL left its own
    # children running) and gets SIGTERM from the kernel when serve dies, even by SIGKILL (repro.proctree)
    tied = functools.partial(die_with, os.getpid())
    server = subprocess.Popen(engine, env={**os.environ, **env}, preexec_fn=tied, start_new_session=True)
    proxy, status = None, 0
    try:
        _wait_healthy(f"http://127.0.0.1:{args.server_port}/health", args.startup_timeout, server)
        proxy = subprocess.Popen(router, preexec_fn=tied, start_new_session=True)
        # sigtimedwait takes a signal only while it is blocked; unblocked, SIGTERM would kill this process before the
        # finally below stops the engine and the router. Between signals the two are polled: when one dies, the
        # other is stopped (a killed engine left the router forwarding to nothing).
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        print(f"serving: engine on :{args.server_port}, router on :{args.router_port}; Ctrl-C stops both", file=sys.stderr)
        while server.poll() is None and proxy.poll() is None:
            if signal.sigtimedwait(STOP_SIGNALS, CHILD_POLL_S) is not None:
                break
        for name, process in (("engine", server), ("router", proxy)):
            if process.poll() is not None:
                print(f"error: the {name} exited with status {process.returncode}; stopped the other one too.",
                      file=sys.stderr)
                status = 1
                break
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        for process in (proxy, server):
            if process is not None:  # the group even when its leader has exited: its children may remain
                stop_group(process, STOP_GRACE_S)
    return status


def build_parser() -> argparse.ArgumentParser:
    from repro.engines.sglang import _layout_args, _serving_args

    p = cli.ArgumentParser(prog="python -m repro.engines.bench_serving", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="export the placement, start the engine and the router")
    serve.add_argument("--engine", choices=["sglang", "vllm"], default="sglang")
    serve.add_argument("--plan", type=cli.existing_dir, required=True, help="job directory under runs/ or its plan/ folder")
    serve.add_argument("--model-path", required=True, help="HF id or local folder the engine serves")
    serve.add_argument("--tokenizer", help="the router's tokenizer (default: the job's)")
    serve.add_argument("--server-port", type=cli.port, default=30000)
    serve.add_argument("--router-port", type=cli.port, default=8080)
    serve.add_argument("--startup-timeout", type=cli.rate, default=1800.0)
    serve.add_argument("--print", action="store_true", help="only print the commands")
    _layout_args(serve)
    _serving_args(serve)
    sweep = sub.add_parser("sweep", help="request-rate sweep against a running server or router")
    sweep.add_argument("--url", type=cli.url, required=True, help="the router (or the server itself, for a baseline)")
    sweep.add_argument("--rates", required=True, help="comma-separated request rates (req/s)")
    sweep.add_argument("--out", type=Path, required=True, help="folder for real_per_rate.csv (e.g. runs/serve_real/<name>)")
    sweep.add_argument("--overwrite", action="store_true", help="replace the results of an earlier sweep in --out")
    sweep.add_argument("--model", help="the model field of each request (default: the first of /v1/models)")
    sweep.add_argument("--router-metrics", type=cli.url,
                       help="the router's /metrics URL, to record requests per rank and LAR")
    sweep.add_argument("--max-in-flight", type=cli.positive, default=1024)
    sweep.add_argument("--timeout", type=cli.rate, default=1800.0, help="seconds per request")
    sweep.add_argument("--seed", type=cli.seed, default=0)
    sweep.add_argument("--client", choices=CLIENTS, default="auto",
                       help="sglang.bench_serving, vllm bench serve, or the built-in client (auto: the first installed)")
    sweep.add_argument("--warmup-requests", type=cli.count, default=8,
                       help="requests sent before the first rate and not measured (vLLM installs the plan at its "
                            "first EPLB rearrangement)")
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
