"""repro.engines.router: the semantic DP-rank proxy against a fake upstream on loopback (real HTTP).

The fake upstream echoes what it received (path, query, headers with their raw spelling, body digest and the
request's "id") and can stream SSE, fail with a chosen status, stall, or return opaque (gzip-labelled) bytes.
Ranks are checked against Sem-MoE Algorithm 2 run offline on the same prompts in the same order.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections import Counter

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from multidict import CIMultiDict, MultiDict
from test_engines_capture import serve_in_thread
from test_engines_sglang import DEVICES, NUM_EXPERTS, toy_placement, write_job

from repro.engines import router as router_mod
from repro.engines.router import SemanticRouter, build_app, extract_prompt
from repro.errors import ConfigError
from repro.parallel import ParallelConfig
from repro.systems.semmoe.system import SemMoEPlan
from repro.workloads import load_tokenizer

VOCAB = 32000  # the mixtral tokenizer's
PROMPTS = [
    "What is the capital of France?", "Integrate x squared from zero to one.", "def fib(n): return n",
    "The mitochondria is the powerhouse of the cell.", "Translate 'good morning' into German.",
    "Which amendment abolished slavery?", "SELECT * FROM users WHERE id = 1;", "Solve 3x + 5 = 11 for x.",
]


def semmoe_plan(seed: int = 0, dp_assign: str = "online", vocab: int = VOCAB) -> SemMoEPlan:
    """A Sem-MoE plan with random but fixed tables (3 layers, EP 4, 97 token rows + the OOV row)."""
    rng = np.random.default_rng(seed)
    rows, layers = 97, 3
    placement = toy_placement(seed)
    dp_score = rng.dirichlet(np.full(DEVICES, 0.3), size=rows + 1).astype(np.float32)
    dp_score[rows] = 0.0
    return SemMoEPlan(
        placement, ParallelConfig(devices=DEVICES, tokens_per_step=64), np.arange(rows, dtype=np.int32),
        (np.arange(vocab) % (rows + 1)).astype(np.int32), rng.integers(0, DEVICES, (layers, rows + 1)).astype(np.int16),
        rng.uniform(0.3, 1.0, (layers, rows + 1)).astype(np.float32), dp_score, lookback=0,
        token_frequency=rng.integers(1, 50, rows + 1).astype(np.float32), dp_assign=dp_assign,
    )


def fake_upstream(log: list) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw and request.content_type == "application/json" else {}
        log.append(body.get("id"))
        echo = {"path": request.path, "raw_path": request.raw_path, "method": request.method,
                "raw_headers": [[k.decode(), v.decode()] for k, v in request.raw_headers],
                "body_sha": hashlib.sha256(raw).hexdigest(), "id": body.get("id")}
        if body.get("sleep"):
            await asyncio.sleep(body["sleep"])
        if body.get("status"):
            return web.Response(status=body["status"], text=f"upstream says {body['status']}", headers={"X-Why": "test"})
        if body.get("opaque"):
            return web.Response(body=b"\x1f\x8b\x08\x00opaque", headers={"Content-Encoding": "gzip", "X-Upstream": "yes"})
        if body.get("cookies"):
            return web.Response(body=b"two cookies", headers=MultiDict([("Set-Cookie", "a=1"), ("Set-Cookie", "b=2")]))
        if body.get("truncate") or body.get("stall"):  # promises 100 bytes, sends 10, hangs up or goes silent
            response = web.StreamResponse(headers={"Content-Length": "100"})
            await response.prepare(request)
            await response.write(b"0123456789")
            if body.get("stall"):
                await asyncio.sleep(body["stall"])
            request.transport.close()
            return response
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Upstream": "yes"})
            await response.prepare(request)
            for i in range(5):
                await response.write(f"data: {json.dumps({'i': i, 'echo': echo if i == 0 else None})}\n\n".encode())
                await asyncio.sleep(0.002)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        return web.json_response(echo, headers={"X-Upstream": "yes"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("mixtral")


@pytest.fixture
def stack(tokenizer):
    """(router URL, upstream URL, upstream log, SemanticRouter) for engine sglang, torn down after the test."""
    started = []

    def start(engine: str = "sglang", plan=None, **kwargs):
        log: list = []
        upstream_url, stop_upstream = serve_in_thread(fake_upstream(log))
        router = SemanticRouter(plan or semmoe_plan(), tokenizer)
        router_url, stop_router = serve_in_thread(build_app(router, [upstream_url], engine, **kwargs))
        started.extend([stop_router, stop_upstream])
        return router_url, upstream_url, log, router

    yield start
    for stop in started:
        stop()


async def _call(url: str, path: str, body=None, method: str = "POST", headers=None) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        async with session.request(method, url + path, json=body, headers=headers) as response:
            return response.status, dict(response.headers), await response.read()


def call(*args, **kwargs):
    return asyncio.run(_call(*args, **kwargs))


def offline_ranks(prompts_ids: list[np.ndarray]) -> list[int]:
    """Algorithm 2 on a fresh copy of the plan, all requests in one batch call."""
    plan = semmoe_plan()
    ids = np.concatenate(prompts_ids)
    lengths = np.array([len(p) for p in prompts_ids])
    return plan.assign_requests(ids, np.concatenate([[0], np.cumsum(lengths)]), lengths).tolist()


def router_exit(argv: list[str]) -> int:
    """The exit code of `python -m repro.engines.router ARGV` (a refused option exits from the parser, code 2)."""
    try:
        return router_mod.main(argv)
    except SystemExit as stop:
        return stop.code


def rank_header(echo: dict, name: str = "X-Data-Parallel-Rank") -> str | None:
    return next((v for k, v in echo["raw_headers"] if k == name), None)


def test_ranks_follow_algorithm_2_across_formats(stack, tokenizer):
    url, _, _, _ = stack()
    requests = []
    for i, text in enumerate(PROMPTS * 2):  # 16 requests = 4 mask windows of D = 4
        kind = i % 4
        if kind == 0:
            requests.append(("/v1/completions", {"prompt": text, "id": i}, tokenizer.encode(text)))
        elif kind == 1:
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": text}]}]
            requests.append(("/v1/chat/completions", {"messages": messages, "id": i}, tokenizer.encode("Be brief.\n" + text)))
        elif kind == 2:
            requests.append(("/generate", {"text": text, "id": i}, tokenizer.encode(text)))
        else:
            ids = tokenizer.encode(text)
            requests.append(("/generate", {"input_ids": ids, "id": i}, ids))
    got = []
    for path, body, _ in requests:
        status, _, raw = call(url, path, body)
        assert status == 200
        got.append(int(rank_header(json.loads(raw))))
    expected = offline_ranks([np.asarray(ids) for _, _, ids in requests])
    assert got == expected
    assert sorted(Counter(got).values()) == [4] * DEVICES  # the round-robin mask: every window covers every rank


def test_headers_bodies_and_query_pass_through(stack):
    url, upstream, _, _ = stack()
    body = {"prompt": "hello there", "id": "q1", "opaque": True}
    status, headers, raw = call(url, "/v1/completions?x=1&y=%20z", body, headers={"X-Client": "c1", "Accept-Encoding": "gzip"})
    direct = call(upstream, "/v1/completions?x=1&y=%20z", body, headers={"X-Client": "c1", "Accept-Encoding": "gzip"})
    assert (status, raw) == (direct[0], direct[2]) == (200, b"\x1f\x8b\x08\x00opaque")  # bytes untouched
    assert headers["Content-Encoding"] == "gzip" and headers["X-Upstream"] == "yes"
    status, _, raw = call(url, "/v1/completions?x=1&y=%20z", {"prompt": "hello there", "id": "q2"}, headers={"X-Client": "c1"})
    echo = json.loads(raw)
    assert echo["raw_path"] == "/v1/completions?x=1&y=%20z" and ["X-Client", "c1"] in echo["raw_headers"]
    sent = json.dumps({"prompt": "hello there", "id": "q2"}).encode()
    assert echo["body_sha"] == hashlib.sha256(sent).hexdigest()
    status, _, raw = call(url, "/v1/models", method="GET")  # not a routed path: no rank
    assert status == 200 and rank_header(json.loads(raw)) is None
    status, _, raw = call(url, "/generate", {"text": "x", "id": 3}, headers={"x-data-parallel-rank": "2"})
    # a client's own rank wins, unscored, sent once in the engine's spelling
    assert [k.lower() for k, _ in json.loads(raw)["raw_headers"]].count("x-data-parallel-rank") == 1
    assert rank_header(json.loads(raw)) == "2"


@pytest.mark.parametrize("buffer_bytes", [0, router_mod.BUFFER_BYTES])
def test_bounded_bodies_and_repeated_headers_pass_through(stack, monkeypatch, buffer_bytes):
    """Bodies up to BUFFER_BYTES are read whole and sent in one write, longer ones streamed: same bytes either way."""
    monkeypatch.setattr(router_mod, "BUFFER_BYTES", buffer_bytes)
    url, upstream, _, _ = stack()
    for body in ({"prompt": "hi", "id": 1, "opaque": True}, {"prompt": "hi", "id": 2, "cookies": True}):
        routed, direct = call(url, "/v1/completions", body), call(upstream, "/v1/completions", body)
        assert routed[0] == direct[0] == 200 and routed[2] == direct[2]
        assert routed[1]["Content-Length"] == direct[1]["Content-Length"]
    status, headers, _ = asyncio.run(_call_multi(url, {"prompt": "hi", "cookies": True}))
    assert headers.getall("Set-Cookie") == ["a=1", "b=2"]
    twice = CIMultiDict([("X-Twice", "1"), ("X-Twice", "2")])
    echo = json.loads(call(url, "/v1/completions", {"prompt": "hi"}, headers=twice)[2])
    assert [v for k, v in echo["raw_headers"] if k == "X-Twice"] == ["1", "2"]


async def _call_multi(url: str, body: dict) -> tuple[int, CIMultiDict, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            return response.status, CIMultiDict(response.headers), await response.read()


def test_stream_passes_through_intact(stack):
    url, upstream, _, _ = stack()
    body = {"prompt": "stream me", "stream": True, "id": 7}
    status, headers, raw = call(url, "/v1/completions", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = raw.decode().strip().split("\n\n")
    assert len(events) == 6 and events[-1] == "data: [DONE]"
    assert [json.loads(e[6:])["i"] for e in events[:-1]] == list(range(5))
    first = json.loads(events[0][6:])["echo"]
    assert rank_header(first) is not None
    direct = call(upstream, "/v1/completions", body)[2].decode().split("\n\n")
    assert [json.loads(e[6:])["i"] for e in direct[:5]] == list(range(5))


def test_errors_are_returned_unchanged_and_outages_are_clear(stack):
    url, upstream, _, _ = stack(timeout=0.5)
    for code in (400, 422, 503):
        status, headers, raw = call(url, "/v1/completions", {"prompt": "x", "status": code})
        assert (status, raw, headers["X-Why"]) == (code, f"upstream says {code}".encode(), "test")
    started = time.perf_counter()
    status, _, raw = call(url, "/v1/completions", {"prompt": "x", "sleep": 2})
    assert status == 504 and "did not answer" in json.loads(raw)["error"]["message"]
    assert time.perf_counter() - started < 1.9
    status, _, raw = call(url, "/v1/completions", {"prompt": "x", "stall": 2})  # silent mid-body: still a timeout
    assert status == 504 and "did not answer" in json.loads(raw)["error"]["message"]
    status, _, raw = call(url, "/v1/completions", {"prompt": "x", "truncate": True})  # nothing sent yet: a clear 502
    assert status == 502 and "mid-response" in json.loads(raw)["error"]["message"]
    assert 'semmoe_router_upstream_errors_total{kind="midstream"} 1.0' in call(url, "/metrics", method="GET")[2].decode()
    down_url, stop = serve_in_thread(web.Application())
    stop()
    router = SemanticRouter(semmoe_plan(), None)
    router_url, stop_router = serve_in_thread(build_app(router, [down_url], connect_timeout=1.0))
    try:
        status, _, raw = call(router_url, "/generate", {"input_ids": [1, 2, 3]})
        assert status == 502 and "unreachable" in json.loads(raw)["error"]["message"]
        metrics = call(router_url, "/metrics", method="GET")[2].decode()
        assert 'semmoe_router_upstream_errors_total{kind="connect"} 1.0' in metrics
    finally:
        stop_router()


def test_vllm_spelling_and_per_rank_upstreams(stack, tokenizer):
    url, _, _, _ = stack("vllm")
    _, _, raw = call(url, "/v1/completions", {"prompt": "hello"})
    assert rank_header(json.loads(raw), "X-data-parallel-rank") is not None
    logs = [[] for _ in range(DEVICES)]
    servers = [serve_in_thread(fake_upstream(log)) for log in logs]
    router = SemanticRouter(semmoe_plan(), tokenizer)
    router_url, stop_router = serve_in_thread(build_app(router, [u for u, _ in servers], "vllm"))
    try:
        for i, text in enumerate(PROMPTS):
            _, headers, raw = call(router_url, "/v1/completions", {"prompt": text, "id": i})
            assert rank_header(json.loads(raw), "X-data-parallel-rank") is None  # the URL carries the rank
            assert i in logs[int(headers["X-data-parallel-rank"])]  # and the reply names it to the client
        expected = offline_ranks([np.asarray(tokenizer.encode(t)) for t in PROMPTS])
        assert [next(r for r in range(DEVICES) if i in logs[r]) for i in range(len(PROMPTS))] == expected
    finally:
        stop_router()
        for _, stop in servers:
            stop()
    with pytest.raises(ConfigError, match="one per DP rank"):
        build_app(router, ["http://a", "http://b"])


def test_metrics_count_every_request(stack):
    url, _, _, _ = stack()
    for text in PROMPTS:
        call(url, "/v1/completions", {"prompt": text})
    call(url, "/v1/completions", {"no": "prompt"})
    text = call(url, "/metrics", method="GET")[2].decode()
    per_rank = {r: float(line.split()[-1]) for r in range(DEVICES) for line in text.splitlines()
                if line.startswith(f'semmoe_router_requests_total{{rank="{r}"}}')}
    assert sum(per_rank.values()) == len(PROMPTS) and set(per_rank.values()) == {2.0}
    assert f"semmoe_router_routing_seconds_count {float(len(PROMPTS))}" in text
    assert f"semmoe_router_added_seconds_count {float(len(PROMPTS) + 1)}" in text  # every proxied request
    assert 'semmoe_router_unscored_requests_total{reason="no_prompt"} 1.0' in text
    lar = sum(float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("semmoe_router_predicted_local_activation_rate_count"))
    assert lar == len(PROMPTS)


def test_load_no_request_lost_or_duplicated(stack):
    """600 requests, 64 concurrent (bench/bench_router.py runs the full 2,000 in separate processes)."""
    url, _, log, router = stack()
    total, concurrency = 600, 64

    async def run() -> list[tuple[int, int]]:
        limit = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def one(i: int):
                async with limit:
                    body = {"prompt": PROMPTS[i % len(PROMPTS)] + f" #{i}", "id": i, "stream": i % 5 == 0}
                    async with session.post(url + "/v1/completions", json=body) as response:
                        raw = await response.read()
                        if body["stream"]:
                            echo = json.loads(raw.decode().split("\n\n")[0][6:])["echo"]
                        else:
                            echo = json.loads(raw)
                        return echo["id"], int(rank_header(echo))

            return await asyncio.gather(*(one(i) for i in range(total)))

    results = asyncio.run(run())
    assert sorted(i for i, _ in results) == list(range(total))  # every client got its own answer once
    assert sorted(i for i in log if i is not None) == list(range(total))  # and the upstream saw each once
    assert sorted(Counter(rank for _, rank in results).values()) == [total // DEVICES] * DEVICES


def test_route_matches_plan_one_request_at_a_time():
    """route() == Algorithm 2 on a fresh plan copy request by request; its LAR == the tables' own formula."""
    router, plan = SemanticRouter(semmoe_plan(), None), semmoe_plan()
    rng = np.random.default_rng(3)
    for n in rng.integers(0, 40, 3 * DEVICES):
        ids = rng.integers(0, VOCAB, n)
        decision = router.route(router.token_ids(ids.tolist()))
        assert decision.rank == plan.assign_requests(ids, np.array([0, n]), np.array([n]))[0]
        rows = plan.row_of_token[ids]
        on_rank = plan.token_device[:, rows] == decision.rank  # [L, n]
        expected = (plan.token_confidence[:, rows] * on_rank).mean(axis=0).mean() if n else None
        assert decision.predicted_lar == pytest.approx(expected, rel=1e-6)


def test_router_is_thread_safe():
    router = SemanticRouter(semmoe_plan(), None)
    ranks: list[int] = []
    guard = threading.Lock()

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(100):
            rank = router.route(rng.integers(0, VOCAB, rng.integers(1, 60))).rank
            with guard:
                ranks.append(rank)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(Counter(ranks).values()) == [200] * DEVICES


def test_refusals(tokenizer, tmp_path, capsys):
    with pytest.raises(ConfigError, match="dp_assign=online"):
        SemanticRouter(semmoe_plan(dp_assign="batch_window"), tokenizer)
    with pytest.raises(ConfigError, match="another tokenizer"):
        SemanticRouter(semmoe_plan(vocab=1000), tokenizer)
    tp = semmoe_plan()
    tp.parallel = ParallelConfig(devices=DEVICES, attention="tp", tokens_per_step=64)
    with pytest.raises(ConfigError, match="Attention-DP"):
        SemanticRouter(tp, tokenizer)
    with pytest.raises(ConfigError, match="--tokenizer"):
        SemanticRouter(semmoe_plan(), None).token_ids("text")
    job = write_job(tmp_path / "job", semmoe_plan(), model={"name": "toy", "num_experts": NUM_EXPERTS})
    assert router_exit(["--plan", str(job), "--upstream", "http://127.0.0.1:9"]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    assert extract_prompt("/v1/completions", {"prompt": [[1, 2], [3]]}) == [1, 2, 3]
    assert extract_prompt("/v1/completions", {"prompt": ["a", "b"]}) == "a\nb"
    assert extract_prompt("/generate", {"sampling_params": {}}) is None
    assert extract_prompt("/v1/chat/completions", "not a dict") is None


def _raw_exchange(url: str, chunks: list[bytes], wait: float) -> bytes:
    """Send `chunks` on a raw TCP connection, wait, then read what the server says until it closes (or 5 s)."""
    import socket
    from urllib.parse import urlparse

    where = urlparse(url)
    with socket.create_connection((where.hostname, where.port), timeout=5) as sock:
        for chunk in chunks:
            sock.sendall(chunk)
        time.sleep(wait)
        received = b""
        try:
            while data := sock.recv(65536):
                received += data
        except (TimeoutError, ConnectionResetError):
            pass
        return received


def test_hostile_clients_get_clear_answers(tokenizer):
    """Oversized ids and deep JSON are forwarded unscored (no 500), big bodies get 413, slow bodies 408, slow
    headers a closed connection: no client holds the router beyond its timeout."""
    log: list = []
    upstream_url, stop_upstream = serve_in_thread(fake_upstream(log))
    router = SemanticRouter(semmoe_plan(), tokenizer)
    app = build_app(router, [upstream_url], max_body_bytes=4096, client_timeout=0.5)
    url, stop_router = serve_in_thread(app, **router_mod.server_options(client_timeout=0.5))
    try:
        status, _, raw = call(url, "/v1/completions", {"prompt": [1, 2**63, 2**70, 5], "id": "big"})
        assert status == 200 and json.loads(raw)["id"] == "big"
        assert router.token_ids([1, 2**63, 5]).tolist() == [1, 5]
        deep = ("[" * 2000 + "]" * 2000).encode()  # deeper than json's recursion limit, within the body limit
        status, _, _ = asyncio.run(_post_raw(url, deep))
        assert status == 200  # unscored, passed through
        status, _, _ = call(url, "/v1/completions", {"prompt": "x" * 5000})
        assert status == 413
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
        started = time.perf_counter()
        reply = _raw_exchange(url, [head, b'{"prompt": "'], wait=0.0)
        assert reply.startswith(b"HTTP/1.1 408") and time.perf_counter() - started < 4
        started = time.perf_counter()
        assert _raw_exchange(url, [b"POST /v1/completions HTTP/1.1\r\nHost:"], wait=0.0) == b""
        assert time.perf_counter() - started < 4  # closed by the router after ~0.5 s, not held
    finally:
        stop_router()
        stop_upstream()


async def _post_raw(url: str, body: bytes) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", data=body, headers={"Content-Type": "text/plain"}) as r:  # the fake upstream parses only JSON
            return r.status, dict(r.headers), await r.read()


def test_routing_seconds_include_tokenization_of_long_prompts(stack, monkeypatch):
    url, _, _, router = stack()
    original = router.token_ids

    def slow_token_ids(prompt):
        time.sleep(0.05)
        return original(prompt)

    monkeypatch.setattr(router, "token_ids", slow_token_ids)
    assert call(url, "/v1/completions", {"prompt": "word " * (router_mod.INLINE_CHARS // 4)})[0] == 200
    _, _, raw = call(url, "/metrics", method="GET")
    total = next(float(line.split()[-1]) for line in raw.decode().splitlines()
                 if line.startswith("semmoe_router_routing_seconds_sum"))
    assert total >= 0.05


def test_cli_port_refusals(tokenizer, tmp_path, capsys):
    import socket

    job = write_job(tmp_path / "job", semmoe_plan(), model={"name": "toy", "num_experts": NUM_EXPERTS})
    assert router_exit(["--plan", str(job), "--upstream", "http://127.0.0.1:9", "--port", "70000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: argument --port") and "[1, 65535]" in err[0]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = router_mod.main(["--plan", str(job), "--upstream", "http://127.0.0.1:9", "--tokenizer", "mixtral",
                                "--port", str(port)])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: cannot listen on") and "--port" in err


# ---- live load from the engines' /metrics ------------------------------------------------------------------------


def vllm_metrics(running: list[int], waiting: list[int], kv: list[float]) -> str:
    lines = []
    for name, values in (("vllm:num_requests_running", running), ("vllm:num_requests_waiting", waiting),
                         ("vllm:kv_cache_usage_perc", kv)):
        lines.append(f"# TYPE {name} gauge")
        lines += [f'{name}{{engine="{rank}",model_name="m"}} {value}' for rank, value in enumerate(values)]
    return "\n".join(lines) + "\n"


def test_a_load_reading_plan_routes_by_the_engines_metrics(tokenizer):
    """A fake vLLM with 4 DP engines reports its queues on /metrics; the shortest_queue plan follows them, and
    counts its own dispatches as waiting until the next poll shows them."""
    from repro.engines.load_signals import LiveLoad, parse_metrics
    from repro.systems.dp_balance import LoadBalancedPlan

    state = {"text": vllm_metrics([5, 5, 0, 5], [2, 2, 1, 2], [0.5, 0.5, 0.1, 0.5]), "polls": 0}
    log: list = []
    echo = fake_upstream(log)

    async def metrics_handler(request: web.Request) -> web.Response:
        state["polls"] += 1
        return web.Response(text=state["text"], content_type="text/plain")

    engine_app = web.Application()
    engine_app.router.add_get("/metrics", metrics_handler)
    engine_app.add_subapp("/v1", echo)
    upstream_url, stop_upstream = serve_in_thread(engine_app)
    plan = LoadBalancedPlan(toy_placement(0), ParallelConfig(devices=DEVICES, tokens_per_step=64), "shortest_queue", 0.0)
    router = SemanticRouter(plan, tokenizer, LiveLoad(DEVICES, 1000, 64))
    router_url, stop_router = serve_in_thread(build_app(router, [upstream_url], "vllm", load_poll_s=0.01))
    try:
        deadline = time.monotonic() + 5
        while router.live.snapshots < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        header = router_mod.RANK_HEADERS["vllm"]

        def routed_rank() -> int:
            status, _, body = call(router_url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1})
            assert status == 200
            return int(dict((k.lower(), v) for k, v in json.loads(body)["raw_headers"])[header.lower()])

        assert routed_rank() == 2  # the only rank with a short queue
        state["text"] = vllm_metrics([0, 9, 9, 9], [0, 3, 3, 3], [0.0, 0.9, 0.9, 0.9])
        deadline = time.monotonic() + 5
        polls = state["polls"]
        while state["polls"] < polls + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert routed_rank() == 0
    finally:
        stop_router()
        stop_upstream()
    # between polls, dispatches count: four requests at once spread over the four idle ranks
    live = LiveLoad(DEVICES, 1000, 64)
    live.update(parse_metrics(vllm_metrics([0] * DEVICES, [0] * DEVICES, [0.0] * DEVICES), "vllm", DEVICES))
    plan.reset()
    spread = []
    for _ in range(DEVICES):
        rank = int(plan.assign_requests(np.arange(3), np.array([0, 3]), np.array([3]), load=live.view())[0])
        live.dispatched(rank, 3)
        spread.append(rank)
    assert sorted(spread) == list(range(DEVICES))
    # SGLang's gauges, one upstream per rank: the upstream's index is the rank
    sglang = "sglang:num_running_reqs 4\nsglang:num_queue_reqs 1\nsglang:token_usage 0.25\n"
    gauges = parse_metrics(sglang, "sglang", DEVICES, rank=3)
    assert gauges["running"][3] == 4 and gauges["waiting"][3] == 1 and np.isnan(gauges["running"][0])
    with pytest.raises(ConfigError):
        parse_metrics("{not prometheus", "vllm", DEVICES)
