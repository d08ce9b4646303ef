"""The router's PD mode (vLLM NIXL pull: decode chosen after the prefill) against fake prefill and decode servers on
loopback: the decode rank is the signature plan's `assign_decode` on the routing the prefill returned, the decode
leg carries the prefill's kv_transfer_params, and errors are one sentence each."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from aiohttp import web
from multidict import CIMultiDict
from test_engines_capture import serve_in_thread
from test_engines_router import PROMPTS, call, router_exit, semmoe_plan
from test_engines_sglang import DEVICES, NUM_EXPERTS, TOP_K, toy_placement, write_job

from repro.engines.layout import load_plan, read_plan
from repro.engines.pd import DecodeChooser, prefill_body
from repro.engines.router import DECODE_RANK_HEADER, SemanticRouter, build_app
from repro.errors import ConfigError, TraceError
from repro.parallel import ParallelConfig
from repro.systems.base import Plan
from repro.systems.signature import SignaturePlan
from repro.workloads import load_tokenizer

HIDDEN = 4  # the toy model: layer 0 dense, MoE layers 1-3 (test_engines_sglang.MODEL)


def signature_job(root, rule: str = "capacity"):
    rng = np.random.default_rng(5)
    plan = SignaturePlan(toy_placement(1), ParallelConfig(devices=DEVICES, tokens_per_step=64),
                         centroids=rng.dirichlet(np.ones(3 * NUM_EXPERTS), DEVICES), rule=rule, match="centroid",
                         capacity_slack=1, eldr_top=2)
    return write_job(root, plan)


def npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def fake_prefill(log: list) -> web.Application:
    """Answers like a vLLM prefill server: routed experts [n, 4 layers, top-2] (layer 0 zeros) and kv params."""

    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("status"):
            return web.Response(status=body["status"], text="prefill says no", headers={"X-Why": "test"})
        n = 3 + len(str(body.get("prompt", body.get("messages"))))
        routed = np.random.default_rng(len(log)).integers(0, NUM_EXPERTS, (n, HIDDEN, TOP_K))
        routed[:, 0] = 0
        kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [len(log), 7],
              "remote_engine_id": "p0", "remote_host": "10.0.0.1", "remote_port": 5600}
        log.append({"body": body, "headers": CIMultiDict(request.headers), "routed": routed[:, 1:], "kv": kv})
        reply = {"id": "cmpl-1", "choices": [{"index": 0, "text": "x"}]}
        if not body.get("no_experts"):
            reply["choices"][0]["routed_experts"] = npy_b64(routed)
        if not body.get("no_kv"):
            reply["kv_transfer_params"] = kv
        return web.json_response(reply)

    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    return app


def fake_decode(rank: int, log: list) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        log.append({"rank": rank, "body": body, "headers": CIMultiDict(request.headers)})
        if not body.get("stream"):
            return web.json_response({"decoded_by": rank})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(3):
            await response.write(f"data: {json.dumps({'i': i, 'rank': rank})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    return app


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("mixtral")


@pytest.fixture
def pd_stack(tmp_path, tokenizer):
    """start(decode_urls=DEVICES, **build_app kwargs) -> (router URL, prefill log, decode log, decode job)."""
    stops = []

    def start(decode_urls: int = DEVICES, **kwargs):
        job = signature_job(tmp_path / "decode")
        prefill_log, decode_log = [], []
        prefill_url, stop = serve_in_thread(fake_prefill(prefill_log))
        stops.append(stop)
        decodes = []
        for rank in range(decode_urls):
            url, stop = serve_in_thread(fake_decode(rank, decode_log))
            decodes.append(url)
            stops.append(stop)
        chooser = DecodeChooser(load_plan(job))
        app = build_app(SemanticRouter(semmoe_plan(), tokenizer), [prefill_url], "vllm", decode=chooser,
                        decode_upstreams=decodes, **kwargs)
        url, stop = serve_in_thread(app)
        stops.insert(0, stop)
        return url, prefill_log, decode_log, job

    yield start
    for stop in stops:
        stop()


def expected_decode_ranks(job, prefill_log: list) -> list[int]:
    """assign_decode of a fresh copy of the decode plan on the routing the prefill returned, request by request."""
    plan, _, _ = read_plan(job)
    return [int(plan.assign_decode(e["routed"], np.array([0, len(e["routed"])]), np.zeros(1))[0]) for e in prefill_log]


def test_decode_rank_is_assign_decode_on_the_prefill_routing(pd_stack):
    url, prefill_log, decode_log, job = pd_stack()
    got = []
    for i, text in enumerate(PROMPTS):
        body = {"prompt": [ord(c) for c in text], "max_tokens": 20, "id": i, "stream_options": {"x": 1}}
        status, headers, raw = call(url, "/v1/completions", body, headers={"X-Request-Id": f"r{i}"})
        assert status == 200 and json.loads(raw)["decoded_by"] == int(headers[DECODE_RANK_HEADER])
        got.append(decode_log[i]["rank"])
        sent_prefill, sent_decode = prefill_log[i], decode_log[i]
        assert sent_prefill["body"]["max_tokens"] == 1 and sent_prefill["body"]["stream"] is False
        assert sent_prefill["body"]["kv_transfer_params"]["do_remote_decode"] is True
        assert "stream_options" not in sent_prefill["body"]
        assert sent_decode["body"] == {**body, "kv_transfer_params": sent_prefill["kv"]}  # the client's, plus the kv
        assert sent_prefill["headers"]["X-Request-Id"] == sent_decode["headers"]["X-Request-Id"] == f"r{i}"
        assert sent_prefill["headers"]["X-data-parallel-rank"] == headers["X-data-parallel-rank"]
        assert "X-data-parallel-rank" not in sent_decode["headers"]  # one decode server per rank: the URL says it
    assert got == expected_decode_ranks(job, prefill_log)
    assert sorted(got) == sorted(list(range(DEVICES)) * 2)  # capacity_slack 1: each window of D fills every rank
    metrics = call(url, "/metrics", method="GET")[2].decode()
    assert sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("semmoe_router_decode_requests_total")) == len(PROMPTS)


def test_one_decode_server_gets_the_rank_in_a_header_and_streams_back(pd_stack):
    url, prefill_log, decode_log, job = pd_stack(decode_urls=1)
    messages = [{"role": "user", "content": "Hello there"}]
    status, headers, raw = call(url, "/v1/chat/completions", {"messages": messages, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = raw.decode().strip().split("\n\n")
    assert [json.loads(e[6:])["i"] for e in events[:-1]] == [0, 1, 2] and events[-1] == "data: [DONE]"
    assert decode_log[0]["headers"]["X-data-parallel-rank"] == headers[DECODE_RANK_HEADER]
    assert decode_log[0]["body"]["stream"] is True and prefill_log[0]["body"]["stream"] is False
    assert prefill_log[0]["headers"]["X-Request-Id"] == decode_log[0]["headers"]["X-Request-Id"]  # the router's own
    assert [int(headers[DECODE_RANK_HEADER])] == expected_decode_ranks(job, prefill_log)
    status, _, _ = call(url, "/v1/models", method="GET")  # not a completion: to the prefill server, as ever
    assert status == 405  # the fake prefill serves POST only


def test_pd_errors_are_one_sentence(pd_stack):
    url, _, decode_log, _ = pd_stack()
    status, headers, raw = call(url, "/v1/completions", {"prompt": "x", "status": 503})
    assert (status, raw, headers["X-Why"]) == (503, b"prefill says no", "test")  # passed through as is
    status, _, raw = call(url, "/v1/completions", {"prompt": "x", "no_kv": True})
    assert status == 502 and "no kv_transfer_params" in json.loads(raw)["error"]["message"]
    status, _, raw = call(url, "/v1/completions", {"prompt": "x", "no_experts": True})
    assert status == 502 and "--enable-return-routed-experts" in json.loads(raw)["error"]["message"]
    assert decode_log == []  # no decode leg after a failed prefill
    late_url, _, decode_log, _ = pd_stack(kv_lease=1e-9)
    status, _, raw = call(late_url, "/v1/completions", {"prompt": "x"})
    assert status == 504 and "KV lease" in json.loads(raw)["error"]["message"] and decode_log == []
    metrics = call(url, "/metrics", method="GET")[2].decode()
    assert 'semmoe_router_upstream_errors_total{kind="prefill_reply"} 2.0' in metrics


def test_pd_refusals_and_saved_plan(tmp_path, capsys):
    job = signature_job(tmp_path / "decode", rule="eldr")
    loaded = read_plan(job)[0]
    assert isinstance(loaded, SignaturePlan) and loaded.rule == "eldr" and loaded.centroids.shape == (DEVICES, 24)
    chooser = DecodeChooser(load_plan(job))
    router = SemanticRouter(semmoe_plan(), None)
    with pytest.raises(ConfigError, match="--engine vllm"):
        build_app(router, ["http://p"], "sglang", decode=chooser, decode_upstreams=["http://d"])
    with pytest.raises(ConfigError, match="one per rank of the decode plan"):
        build_app(router, ["http://p"], "vllm", decode=chooser, decode_upstreams=["http://d", "http://e"])
    with pytest.raises(ConfigError, match="--decode 'd' is not an http"):
        build_app(router, ["http://p"], "vllm", decode=chooser, decode_upstreams=["d"])
    plain = write_job(tmp_path / "plain", Plan(toy_placement(), ParallelConfig(devices=DEVICES, tokens_per_step=64)))
    with pytest.raises(ConfigError, match="system=signature"):
        DecodeChooser(load_plan(plain))
    assert prefill_body({"max_completion_tokens": 9, "min_tokens": 2})["max_completion_tokens"] == 1
    for argv, message in ((["--upstream", "http://u", "--prefill", "http://p"], "not both"),
                          (["--prefill", "http://p"], "--decode-plan"),
                          (["--upstream", "http://u", "--decode", "http://d"], "belong to PD mode")):
        assert router_exit(["--plan", str(plain), "--engine", "vllm", *argv]) == 2
        assert message in capsys.readouterr().err


def test_decode_choice_rejects_foreign_routing(tmp_path):
    chooser = DecodeChooser(load_plan(signature_job(tmp_path / "decode")))
    wrong_k = np.zeros((5, HIDDEN, TOP_K + 1), dtype=np.int64)
    with pytest.raises(TraceError, match="top-3"):
        chooser.experts({"choices": [{"routed_experts": npy_b64(wrong_k)}]})
    with pytest.raises(TraceError, match="outside 0..7"):
        chooser.experts({"choices": [{"routed_experts": npy_b64(np.full((5, HIDDEN, TOP_K), NUM_EXPERTS))}]})
    with pytest.raises(TraceError, match="cover 2 layers"):  # another model: neither its 4 layers nor the plan's 3
        chooser.experts({"choices": [{"routed_experts": npy_b64(np.zeros((5, 2, TOP_K), dtype=np.int64))}]})
