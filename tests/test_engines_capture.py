"""repro.engines.capture / payloads against fake SGLang and vLLM servers on loopback (real HTTP).

The fake engines route token t at model layer l to experts (base(t) + 3 l + j) % E, j < k, with base skewed
toward expert 0 (so placements are tell-apart from popularity), generate deterministic ids, and answer in each
engine's wire format: SGLang physical slots as base64 int32 (or uint16) in meta_info, vLLM logical ids as a
base64 .npy in choices[0]. Also home of `serve_in_thread`, which tests/test_engines_router.py imports.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import web
from test_engines_sglang import DEVICES, NUM_EXPERTS, TOP_K, toy_job

from repro.engines import capture, payloads
from repro.engines.layout import ModelLayout
from repro.errors import TraceError
from repro.traces import read_trace
from repro.workloads import load_workload

NUM_HIDDEN = 4
MOE_LAYERS = (1, 2, 3)
LAYOUT = ModelLayout("toy", NUM_HIDDEN, MOE_LAYERS, NUM_EXPERTS, TOP_K)
WORKLOAD = ["workload=mmlu", "tokenizer=mixtral", "num_requests=12", "max_prompt_len=24", "output_len=3", "seed=1"]


def serve_in_thread(app: web.Application, **server_options) -> tuple[str, callable]:
    """Run `app` on 127.0.0.1 (a free port) in a background thread, with aiohttp server_options; returns (base URL,
    stop())."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None, **server_options)
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(10)

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return f"http://127.0.0.1:{port}", stop


def true_experts(tokens: np.ndarray) -> np.ndarray:
    """int64[n, L, k] the fake model's logical routing of `tokens` at MOE_LAYERS."""
    tokens = np.asarray(tokens, dtype=np.int64)
    base = np.where(tokens % 4 == 0, 0, tokens % NUM_EXPERTS)
    layer = np.asarray(MOE_LAYERS)[None, :, None]
    return (base[:, None, None] + 3 * layer + np.arange(TOP_K)[None, None, :]) % NUM_EXPERTS


def generated(prompt: list[int], count: int) -> list[int]:
    return [(sum(prompt) + i) % 1000 + 3 for i in range(count)]


def fake_engine(engine: str, served_rows: np.ndarray | None = None, reported_location: str = "trivial",
                fail_first: bool = False, omit_routed: bool = False, wire_dtype: str = "int32") -> web.Application:
    """served_rows int[Lh, P]: the placement the fake SGLang really serves (None: trivial)."""
    rows = served_rows if served_rows is not None else np.tile(np.arange(NUM_EXPERTS), (NUM_HIDDEN, 1))
    slot_of = np.argsort(rows, axis=1, kind="stable")  # first slot of each expert (no replication in these tests)
    seen: set = set()

    def routing(prompt: list[int], outputs: list[int]) -> np.ndarray:
        tokens = np.asarray(prompt + outputs[:-1])
        full = np.zeros((len(tokens), NUM_HIDDEN, TOP_K), dtype=np.int64)
        full[:, list(MOE_LAYERS)] = true_experts(tokens)
        return full

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body["input_ids"]
        if fail_first and tuple(prompt) not in seen:
            seen.add(tuple(prompt))
            return web.Response(status=503, text="warming up")
        outputs = generated(prompt, body["sampling_params"]["max_new_tokens"])
        full = routing(prompt, outputs)
        physical = slot_of[np.arange(NUM_HIDDEN)[None, :, None], full]
        physical[:, [0]] = 0  # the dense layer's columns
        meta = {"prompt_tokens": len(prompt), "completion_tokens": len(outputs)}
        if not omit_routed and body.get("return_routed_experts"):
            dtype = np.dtype("<i4") if wire_dtype == "int32" else np.dtype("<u2")
            meta["routed_experts"] = base64.b64encode(physical.astype(dtype).tobytes()).decode()
            if wire_dtype != "int32":
                meta["routed_experts_dtype"] = wire_dtype
        return web.json_response({"text": "x", "output_ids": outputs, "meta_info": meta})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body["prompt"]
        outputs = generated(prompt, body["max_tokens"])
        choice = {"index": 0, "text": "x", "token_ids": outputs}
        if not omit_routed:
            buffer = io.BytesIO()
            np.save(buffer, routing(prompt, outputs).astype(np.int32), allow_pickle=False)
            choice["routed_experts"] = base64.b64encode(buffer.getvalue()).decode()
        return web.json_response({"id": "c", "choices": [choice]})

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"enable_return_routed_experts": not omit_routed, "init_expert_location": reported_location})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "toy"}]})

    app = web.Application()
    if engine == "sglang":
        app.add_routes([web.post("/generate", generate), web.get("/get_server_info", info)])
    else:
        app.add_routes([web.post("/v1/completions", completions), web.get("/v1/models", models)])
    return app


@pytest.fixture(scope="module")
def workload():
    return load_workload("mmlu", tokenizer="mixtral", num_requests=12, max_prompt_len=24, output_len=3, seed=1)


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps({"model_type": "deepseek_v2", "num_hidden_layers": NUM_HIDDEN, "n_routed_experts": NUM_EXPERTS,
                                "first_k_dense_replace": 1, "num_experts_per_tok": TOP_K}))
    return path


def check_against_truth(trace, workload) -> None:
    assert trace.num_requests == len(workload.requests)
    assert list(trace.request_ids) == [r.id for r in workload.requests]
    for index, request in enumerate(workload.requests):
        prompt = request.token_ids.tolist()
        tokens = np.asarray(prompt + generated(prompt, 3)[:2])
        lo, hi = trace.offsets[index], trace.offsets[index + 1]
        np.testing.assert_array_equal(trace.token_ids[lo:hi], tokens)
        np.testing.assert_array_equal(trace.experts[lo:hi], true_experts(tokens))
        assert trace.prefill_len[index] == len(prompt)
    assert trace.meta.layer_ids == MOE_LAYERS and trace.meta.dense_layers == (0,)


def test_sglang_capture_maps_physical_slots_back_with_the_plan(tmp_path, workload, model_config):
    from repro.engines.layout import load_plan
    from repro.engines.sglang import location_rows

    job, _ = toy_job(tmp_path)
    rows = location_rows(load_plan(job))
    url, stop = serve_in_thread(fake_engine("sglang", rows, reported_location="/x/placement.json"))
    try:
        out = tmp_path / "trace"
        assert capture.main(["--url", url, "--plan", str(job), "--out", str(out), "--no-progress", *WORKLOAD]) == 0
    finally:
        stop()
    trace = read_trace(out)
    check_against_truth(trace, workload)
    assert trace.meta.source == "capture:sglang" and trace.meta.top_k == TOP_K


def test_vllm_capture_reads_logical_npy(tmp_path, workload, model_config):
    url, stop = serve_in_thread(fake_engine("vllm"))
    try:
        out = tmp_path / "trace"
        args = ["--url", url, "--engine", "vllm", "--model-config", str(model_config), "--out", str(out), "--no-progress"]
        assert capture.main(args + WORKLOAD) == 0
    finally:
        stop()
    check_against_truth(read_trace(out), workload)


def test_retries_and_uint16_wire_dtype(tmp_path, workload, model_config):
    url, stop = serve_in_thread(fake_engine("sglang", fail_first=True, wire_dtype="uint16"))
    try:
        out = tmp_path / "trace"
        args = ["--url", url, "--model-config", str(model_config), "--out", str(out), "--no-progress", "--concurrency", "4"]
        assert capture.main(args + WORKLOAD) == 0
    finally:
        stop()
    trace = read_trace(out)
    check_against_truth(trace, workload)
    assert trace.meta.extra["retries"] == len(workload.requests)


def test_server_without_the_flag_names_it_and_writes_nothing(tmp_path, model_config, capsys):
    for engine in ("sglang", "vllm"):
        url, stop = serve_in_thread(fake_engine(engine, omit_routed=True))
        try:
            out = tmp_path / engine
            args = ["--url", url, "--engine", engine, "--model-config", str(model_config), "--out", str(out), "--no-progress"]
            assert capture.main(args + WORKLOAD) == 2
        finally:
            stop()
        assert "--enable-return-routed-experts" in capsys.readouterr().err
        assert not out.exists()


def test_ignored_init_expert_location_is_caught(tmp_path, model_config, capsys):
    from repro.engines.layout import load_plan
    from repro.engines.sglang import location_rows

    job, _ = toy_job(tmp_path, seed=5)
    # (1) the server says it runs the trivial placement although a plan was given
    url, stop = serve_in_thread(fake_engine("sglang", None, reported_location="trivial"))
    try:
        out = tmp_path / "a"
        assert capture.main(["--url", url, "--plan", str(job), "--out", str(out), "--no-progress", *WORKLOAD]) == 2
    finally:
        stop()
    assert "runs --init-expert-location trivial" in capsys.readouterr().err and not out.exists()
    # (2) it claims the file but serves trivially: only the returned slots give it away (vs a reference trace)
    url, stop = serve_in_thread(fake_engine("vllm"))
    reference = tmp_path / "reference"
    more = ["num_requests=40", "seed=2"]
    try:
        args = ["--url", url, "--engine", "vllm", "--model-config", str(model_config), "--out", str(reference), "--no-progress"]
        assert capture.main(args + WORKLOAD + more) == 0
    finally:
        stop()
    for served, code in ((None, 2), (location_rows(load_plan(job)), 0)):
        url, stop = serve_in_thread(fake_engine("sglang", served, reported_location="/x/loc.json"))
        try:
            out = tmp_path / f"b{code}"
            args = ["--url", url, "--plan", str(job), "--out", str(out), "--no-progress", "--reference-trace", str(reference)]
            assert capture.main(args + WORKLOAD + more) == code
        finally:
            stop()
        err = capsys.readouterr().err
        if code:
            assert "NOT serving" in err and not out.exists()
        else:
            assert read_trace(out).meta.extra["placement_check"]["verdict"] == "plan"


def test_server_down_fails_fast_with_a_sentence(tmp_path, model_config, capsys):
    url, stop = serve_in_thread(web.Application())
    stop()  # nothing listens there any more
    out = tmp_path / "t"
    args = ["--url", url, "--model-config", str(model_config), "--out", str(out), "--no-progress", "--retries", "1"]
    assert capture.main(args + WORKLOAD) == 2
    assert "failed after 2 attempt(s)" in capsys.readouterr().err and not out.exists()


def test_bad_arguments_are_one_sentence(tmp_path, model_config, capsys):
    base = ["--url", "http://127.0.0.1:9", "--out", str(tmp_path / "t")]
    assert capture.main(base + ["workload=mmlu"]) == 2
    assert "--model-config" in capsys.readouterr().err
    assert capture.main(base + ["--model-config", str(model_config), "num_requests=3"]) == 2
    assert "workload=<name>" in capsys.readouterr().err
    assert capture.main(base + ["--model-config", str(model_config), "mmlu"]) == 2
    assert "key=value" in capsys.readouterr().err


def test_payload_decoders_reject_garbage():
    with pytest.raises(TraceError, match="not valid base64"):
        payloads.decode_sglang("@@@", NUM_HIDDEN, TOP_K)
    with pytest.raises(TraceError, match="whole number"):
        payloads.decode_sglang(base64.b64encode(b"\0" * 12).decode(), NUM_HIDDEN, TOP_K)
    with pytest.raises(TraceError, match="routed_experts_dtype"):
        payloads.decode_sglang("", NUM_HIDDEN, TOP_K, "float32")
    with pytest.raises(TraceError, match=".npy"):
        payloads.decode_vllm(base64.b64encode(b"not an npy file").decode())
    buffer = io.BytesIO()
    np.save(buffer, np.array(["a"], dtype=object), allow_pickle=True)  # would need unpickling: refused
    with pytest.raises(TraceError, match=".npy"):
        payloads.decode_vllm(base64.b64encode(buffer.getvalue()).decode())
    with pytest.raises(TraceError, match="another model"):
        payloads.moe_columns(np.zeros((2, 7, TOP_K), dtype=np.int64), MOE_LAYERS, NUM_HIDDEN)
    served = capture.ServedModel("sglang", LAYOUT, TOP_K)
    with pytest.raises(TraceError, match="fewer|rows"):
        capture.decode_response(served, {"meta_info": {"routed_experts": ""}}, [1, 2])


def _record(rank, pass_id, ids, positions, seq_lens, rows_topk):
    return {"forward_pass_id": pass_id, "rank": rank, "gatherer_key": "primary", "input_ids": [int(x) for x in ids],
            "positions": [int(x) for x in positions], "extend_seq_lens": seq_lens, "forward_mode": 1 if seq_lens else 2,
            "topk_ids_of_layer": torch.as_tensor(rows_topk, dtype=torch.int32), "misc_objects": []}


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's note on the junk file below
def test_recorder_dump_import_rebuilds_sequences(tmp_path, model_config):
    from repro.engines.layout import load_plan
    from repro.engines.sglang import location_rows

    job, _ = toy_job(tmp_path, seed=2)
    rows = location_rows(load_plan(job))
    slot_of = np.argsort(rows, axis=1, kind="stable")
    seq_a, seq_b = np.arange(40, 52), np.arange(100, 107)

    def topk(tokens):  # int32[Lh, n, 8] physical, -1 padded, dense layer all -1
        out = np.full((NUM_HIDDEN, len(tokens), 8), -1)
        logical = true_experts(tokens).transpose(1, 0, 2)
        out[list(MOE_LAYERS), :, :TOP_K] = slot_of[np.asarray(MOE_LAYERS)[:, None, None], logical]
        return out

    # pass 0: seq_a's first 8 tokens and all of seq_b; pass 1: a decode step; pass 2: seq_a's last 4 (chunked)
    first = np.concatenate([seq_a[:8], seq_b])
    records = [
        _record(0, 0, first, list(range(8)) + list(range(7)), [8, 7], topk(first)),
        _record(0, 1, [5, 6], [8, 7], None, topk(np.array([5, 6]))),
        _record(0, 2, seq_a[8:], range(8, 12), [4], topk(seq_a[8:])),
    ]
    dumps = []
    for rank in (0, 1):  # Attention-TP: rank 1 recorded the very same passes
        path = tmp_path / f"expert_distribution_recorder_1.0_{rank}.pt"
        torch.save({"records": records, "last_physical_to_logical_map": torch.as_tensor(rows)}, path)
        dumps.append(str(path))
    out = tmp_path / "trace"
    assert capture.main(["recorder", *dumps, "--model-config", str(model_config), "--out", str(out), "--dataset", "d"]) == 0
    trace = read_trace(out)
    assert trace.num_requests == 2
    np.testing.assert_array_equal(trace.token_ids, np.concatenate([seq_a, seq_b]))
    np.testing.assert_array_equal(trace.experts, true_experts(np.concatenate([seq_a, seq_b])))
    assert trace.meta.extra["skipped_passes"] == 2
    (tmp_path / "junk.pt").write_bytes(b"\x80\x04junk")
    assert capture.main(["recorder", str(tmp_path / "junk.pt"), "--model-config", str(model_config), "--out", str(tmp_path / "j")]) == 2
    assert not (tmp_path / "j").exists()


def test_saved_responses_import(tmp_path, model_config):
    prompt = [11, 12, 16, 20]
    outputs = generated(prompt, 2)
    full = np.zeros((len(prompt) + 1, NUM_HIDDEN, TOP_K), dtype=np.int32)
    full[:, list(MOE_LAYERS)] = true_experts(np.asarray(prompt + outputs[:1]))
    buffer = io.BytesIO()
    np.save(buffer, full, allow_pickle=False)
    line = {"input_ids": prompt, "response": {"choices": [{"token_ids": outputs, "routed_experts": base64.b64encode(buffer.getvalue()).decode()}]}}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(line) + "\n")
    out = tmp_path / "trace"
    assert capture.main(["responses", str(path), "--engine", "vllm", "--model-config", str(model_config), "--out", str(out)]) == 0
    trace = read_trace(out)
    np.testing.assert_array_equal(trace.experts, true_experts(np.asarray(prompt + outputs[:1])))
    assert trace.prefill_len.tolist() == [4] and DEVICES == 4
