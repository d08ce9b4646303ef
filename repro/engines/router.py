"""Semantic DP-rank router: an async HTTP proxy in front of an SGLang or vLLM server with Attention-DP.

    python -m repro.engines.router --plan runs/paper_dp/<job> --upstream http://127.0.0.1:30000 --port 8080
    python -m repro.engines.router --plan <job> --engine vllm --upstream http://127.0.0.1:8000
    python -m repro.engines.router --plan <job> --engine vllm --upstream http://h:8000 http://h:8001 ...  # external LB

For POST /v1/completions, /v1/chat/completions and SGLang's /generate it tokenizes the prompt with the model's
tokenizer (text prompts, chat message texts without the chat template, or the token ids the client sent),
scores the DP ranks with the plan's tables and sets the rank: one request at a time through
`plan.assign_requests` (Sem-MoE Algorithm 2, round-robin mask included, its streaming state kept across
requests; a non-Sem-MoE plan gives its own online behaviour, e.g. round robin). With one upstream the rank goes
in the header SGLang (`X-Data-Parallel-Rank`, entrypoints/openai/serving_base.py) or vLLM
(`X-data-parallel-rank`, `_get_data_parallel_rank`) reads; HTTP header names are case-insensitive, each engine
gets its own spelling anyway. With D upstreams (vLLM external load balancing, one server per rank) rank r's
request goes to upstream r, without a header. A request that already carries the header keeps it, unscored.

Everything is passed through unchanged: method, path, query, headers (hop-by-hop ones excepted), body bytes,
status, response headers (plus the chosen rank's header when the router chose one) and body (a body with a Content-Length up to BUFFER_BYTES is read whole and sent in one
write; any other, SSE included, is streamed chunk by chunk; compressed bodies untouched).
An unreachable upstream gives 502 (so does one that breaks off a bounded body before its end, as nothing has
been sent yet) and an upstream timeout 504, each with a JSON body saying so; an upstream error status is returned
as is; a streamed body broken off midway cuts the client connection. Every other path (/v1/models, /health, ...)
is proxied without a rank. Hostile or broken clients: a body over --max-body-mb (default 16) gets 413, a body
not received within --client-timeout seconds (default 30) 408, and a connection that has not sent complete headers
by then is closed; a body that is not JSON, nests deeper than Python's parser allows, or holds ids beyond int64 is
forwarded unscored or with those ids dropped, never a 500.
GET /metrics (Prometheus): requests per rank, predicted local activation rate per rank, routing seconds
(tokenize + score), the router's own added seconds per proxied request, upstream errors by kind, requests in
flight.

Added seconds (semmoe_router_added_seconds), measured inside the router: (handler start -> the upstream request
issued) + (the upstream body received -> the client reply handed to the socket), wall time, so the waits for
other requests' work on the event loop are in it. It is a lower bound on what the router adds: aiohttp's work
outside the handler (parsing the client's request before the handler starts, writing the upstream request and
parsing its reply) and time in kernel queues are not in it; a client-side comparison with and without the
router (bench/bench_router.py) sees them. (aiohttp's request tracing would stamp the upstream write itself,
but costs ~50 us of CPU per request, more than a tenth of the router's.)

Predicted local activation rate of a request on its rank r: the mean over its prompt tokens and the plan's
layers of T_p[l, token] where T[l, token] == r (the share of a token's routed experts the plan expects on its
top device, counted only when that device is r): a lower bound on the plan's expected LAR, from its tables.

Concurrency: scoring runs on the event loop with no await between reading and updating the plan's state, and
under a lock, so concurrent requests (coroutines or threads) see a consistent mask; prompts longer than
INLINE_CHARS characters are tokenized on a worker thread so they do not stall other requests.

Latency: the CLI freezes the start-up heap (gc.freeze): a full collection would otherwise walk the ~100k objects
that importing the plan's modules (pandas, scipy, aiohttp) leaves, a 50-100 ms stall of every request in flight
(bench/bench_router.py: one, 62 ms, fell in the 800 req/s phase and was its p99). Metric children are looked up
once. uvloop was tried and left out: 410 us of router CPU per request with it, 400-410 without.

Legend: L plan layers, D DP ranks, t profiled token rows (+1 OOV row), n prompt tokens of one request.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import re
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from repro.errors import ConfigError, ReproError
from repro.systems.base import Plan

ENGINES = ("sglang", "vllm")
RANK_HEADERS = {"sglang": "X-Data-Parallel-Rank", "vllm": "X-data-parallel-rank"}
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")
# RFC 9110 7.6.1 hop-by-hop headers, plus those the proxy recomputes for its own connection
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "content-length"}
INLINE_CHARS = 16384
# upstream bodies with a Content-Length up to this are read whole and sent in one write; longer or chunked
# ones (SSE) are streamed chunk by chunk
BUFFER_BYTES = 1 << 20
# client request bodies beyond this get 413 (a 1k-token prompt is ~10 KB of JSON; long-context ones a few MB)
MAX_BODY_BYTES = 16 << 20
# seconds a client may take to send its request headers (aiohttp's idle timeout of a fresh connection) or body
CLIENT_TIMEOUT_S = 30.0


# ---- prompts -------------------------------------------------------------------------------------------------


def extract_prompt(path: str, body) -> str | list[int] | None:
    """The prompt of a request body: text, token ids, or None when there is none to score.

    /v1/completions "prompt": a string, token ids, or a batch of either (joined); /v1/chat/completions:
    the text of every message (string contents and "text" parts) joined by newlines; /generate: "input_ids"
    (ids or a batch) or "text" (a string or a batch).
    """
    if not isinstance(body, dict):
        return None
    if path == "/v1/chat/completions":
        parts = []
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        return "\n".join(parts) if parts else None
    value = body.get("prompt") if path == "/v1/completions" else body.get("input_ids", body.get("text"))
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            return value
        if all(isinstance(x, str) for x in value):
            return "\n".join(value)
        if all(isinstance(x, list) and all(isinstance(y, int) for y in x) for x in value):
            return [y for x in value for y in x]
    return None


# ---- scoring -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    rank: int
    predicted_lar: float | None  # None: the plan has no token tables (or the prompt had no token)


class SemanticRouter:
    """Request -> DP rank with a plan's online scheduler; safe to call from several threads or coroutines."""

    def __init__(self, plan: Plan, tokenizer=None):
        from repro.systems.semmoe.system import SemMoEPlan

        if plan.parallel.attention != "dp":
            raise ConfigError(
                f"the plan was fitted for parallel.attention={plan.parallel.attention}; request routing needs an "
                "Attention-DP plan (parallel.attention=dp)."
            )
        self.plan = plan
        self.tokenizer = tokenizer
        self.num_ranks = plan.parallel.devices
        self._lock = threading.Lock()
        self._vocab = None
        self._lar_vocab = None
        if isinstance(plan, SemMoEPlan):
            if plan.dp_assign != "online":
                raise ConfigError(
                    f"the plan assigns requests with dp_assign={plan.dp_assign}, which waits for later requests; "
                    "a router decides at arrival: fit it with system.params.dp_assign=online."
                )
            self._vocab = len(plan.row_of_token)
            if tokenizer is not None and tokenizer.vocab_size > self._vocab:
                raise ConfigError(
                    f"tokenizer {tokenizer.name!r} emits {tokenizer.vocab_size} ids but the plan knows {self._vocab}; "
                    "the plan was profiled with another tokenizer (pass the model's with --tokenizer)."
                )
            on_device = plan.token_device[:, :, None] == np.arange(self.num_ranks)[None, None, :]  # [L, t+1, D]
            lar_table = (plan.token_confidence[:, :, None] * on_device).mean(axis=0).astype(np.float32)  # [t+1, D]
            # per vocabulary id [V, D]: one gather per request instead of two (V x D x 4 bytes: 4.9 MB for Qwen)
            self._lar_vocab = lar_table[plan.row_of_token]
        plan.reset()

    def token_ids(self, prompt: str | list[int]) -> np.ndarray:
        """int64[n] ids of a prompt (text through the tokenizer; ids outside the plan's vocabulary dropped)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("a text prompt needs the model's tokenizer; start the router with --tokenizer.")
            # the tokenizer's ids are below its vocab_size <= the plan's vocabulary (checked in __init__)
            return np.asarray(self.tokenizer.encode(prompt), dtype=np.int64)
        try:
            ids = np.asarray(prompt, dtype=np.int64)
        except OverflowError:  # an id beyond int64 is outside every vocabulary: drop it like any unknown id
            ids = np.asarray([x for x in prompt if -(1 << 63) <= x < (1 << 63)], dtype=np.int64)
        if self._vocab is not None:
            ids = ids[(ids >= 0) & (ids < self._vocab)]
        return ids

    def route(self, token_ids: np.ndarray) -> Decision:
        """The rank of the next request, whose prompt tokens are token_ids int[n] (state advances by one)."""
        n = len(token_ids)
        with self._lock:
            rank = int(self.plan.assign_requests(token_ids, np.array([0, n]), np.array([n]))[0])
        lar = None
        if self._lar_vocab is not None and n:
            lar = float(self._lar_vocab[token_ids, rank].mean())
        return Decision(rank, lar)


ADDED_BUCKETS = (5e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 4e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 1e-2, 2e-2,
                 5e-2, 0.1, 0.25, 1.0)
ERROR_KINDS = ("connect", "timeout", "midstream", "status_4xx", "status_5xx")


class RouterMetrics:
    """Prometheus metrics of one router, in their own registry (several routers may live in one process).

    The labelled children are looked up once here: labels() costs a lock and a dict lookup per call.
    """

    def __init__(self, num_ranks: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("semmoe_router_requests", "Requests routed, by DP rank", ["rank"], registry=self.registry)
        self.unscored = Counter("semmoe_router_unscored_requests", "Requests forwarded without scoring, by reason",
                                ["reason"], registry=self.registry)
        self.lar = Histogram("semmoe_router_predicted_local_activation_rate",
                             "Predicted local activation rate of a request on its rank (lower bound from T/T_p)",
                             ["rank"], buckets=[i / 20 for i in range(1, 21)], registry=self.registry)
        self.routing = Histogram("semmoe_router_routing_seconds", "Seconds to tokenize and score one request",
                                 buckets=[1e-5, 3e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.25],
                                 registry=self.registry)
        self.errors = Counter("semmoe_router_upstream_errors", "Upstream failures, by kind (connect, timeout, "
                              "midstream, status_4xx, status_5xx)", ["kind"], registry=self.registry)
        self.in_flight = Gauge("semmoe_router_in_flight", "Requests being proxied", registry=self.registry)
        self.added = Histogram("semmoe_router_added_seconds",
                               "Seconds the router adds to a proxied request, measured inside it: handler start -> "
                               "upstream request issued, plus upstream body received -> reply sent (a lower bound)",
                               buckets=ADDED_BUCKETS, registry=self.registry)
        # every rank shows up from the first scrape, at 0
        self.requests_of_rank = [self.requests.labels(rank=str(rank)) for rank in range(num_ranks)]
        self.lar_of_rank = [self.lar.labels(rank=str(rank)) for rank in range(num_ranks)]
        self.unscored_client_rank = self.unscored.labels(reason="client_rank")
        self.unscored_no_prompt = self.unscored.labels(reason="no_prompt")
        self.error_of_kind = {kind: self.errors.labels(kind=kind) for kind in ERROR_KINDS}

    def error(self, kind: str) -> None:
        self.error_of_kind[kind].inc()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# ---- the proxy -----------------------------------------------------------------------------------------------


def _error_response(status: int, kind: str, message: str):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class ClientRefusal(Exception):
    """A request the router answers itself with 400 and one sentence (never forwarded)."""


def client_rank(values: list[str], header: str, num_ranks: int) -> None:
    """Check a client-set rank header against the plan: the upstream would otherwise get rank 99 of 4, or 'abc'."""
    for value in values:
        if not re.fullmatch(r"[0-9]{1,9}", value.strip()) or int(value) >= num_ranks:
            raise ClientRefusal(f"{header}: {value!r} is not a DP rank of this plan (0..{num_ranks - 1}); send a rank "
                                "in that range, or no header to let the router choose.")


def check_upstreams(upstreams: Sequence[str]) -> None:
    """Each upstream an http(s) URL with a host, refused at start rather than answered 502 on every request."""
    from yarl import URL

    for text in upstreams:
        try:
            url = URL(text)
        except (ValueError, TypeError):
            url = None
        if url is None or url.scheme not in ("http", "https") or not url.host:
            raise ConfigError(f"--upstream {text!r} is not an http(s) URL with a host; give e.g. http://127.0.0.1:30000.")


class OneLineClientErrors(logging.Filter):
    """aiohttp logs a malformed client request (bad Content-Length, a 200 KB header, an undecodable body) with a
    traceback on stderr though it answered 400; such a record becomes one line naming the client's error."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError
        from aiohttp.web_protocol import RequestPayloadError

        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError | RequestPayloadError):
            reason = " ".join(str(getattr(error, "message", "") or error).split())[:200]
            record.msg, record.args, record.exc_info = (
                f"router: refused a malformed client request ({type(error).__name__}: {reason})", (), None)
        return True


def quiet_client_errors() -> None:
    """Install OneLineClientErrors on aiohttp's server logger (once)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, OneLineClientErrors) for f in logger.filters):
        logger.addFilter(OneLineClientErrors())


def server_options(client_timeout: float = CLIENT_TIMEOUT_S) -> dict:
    """aiohttp server (AppRunner / run_app) options of the router: a connection that has not sent a complete
    request within client_timeout seconds is closed (slow or idle clients do not hold connections), and after an
    early reply (408, 413) the unread rest of a body is drained for at most client_timeout seconds."""
    return {"keepalive_timeout": client_timeout, "lingering_time": client_timeout}


def build_app(
    router: SemanticRouter, upstreams: Sequence[str], engine: str = "sglang", *, connect_timeout: float = 5.0,
    timeout: float = 600.0, max_connections: int = 1024, max_body_bytes: int = MAX_BODY_BYTES,
    client_timeout: float = CLIENT_TIMEOUT_S,
):
    """The aiohttp application proxying to `upstreams` (one URL, or one per DP rank).

    A request body over max_body_bytes gets 413; one not received within client_timeout seconds gets 408.
    Serve it with server_options(client_timeout) so slow request headers time out too.
    """
    import aiohttp
    from aiohttp import web
    from aiohttp.web_protocol import RequestPayloadError

    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {ENGINES}, got {engine!r}.")
    check_upstreams(upstreams)
    quiet_client_errors()
    upstreams = [u.rstrip("/") for u in upstreams]
    if len(upstreams) not in (1, router.num_ranks):
        raise ConfigError(
            f"give one upstream (rank in a header) or one per DP rank ({router.num_ranks}), got {len(upstreams)}."
        )
    header = RANK_HEADERS[engine]
    metrics = RouterMetrics(router.num_ranks)
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def start(app: web.Application) -> None:
        app[session_key] = aiohttp.ClientSession(
            auto_decompress=False,  # bodies go through byte for byte, compressed or not
            connector=aiohttp.TCPConnector(limit=max_connections),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=timeout),
        )

    async def stop(app: web.Application) -> None:
        await app[session_key].close()

    async def decide(request: web.Request, raw: bytes) -> int | None:
        if request.method != "POST" or request.path not in ROUTED_PATHS:
            return None
        if header in request.headers:  # a CIMultiDict: any spelling
            client_rank(request.headers.getall(header), header, router.num_ranks)
            metrics.unscored_client_rank.inc()
            return None
        try:
            body = json.loads(raw) if raw else None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # nested too deep: not a prompt we score
            body = None
        prompt = extract_prompt(request.path, body)
        if prompt is None:
            metrics.unscored_no_prompt.inc()
            return None
        if isinstance(prompt, str) and len(prompt) > INLINE_CHARS:
            # the tokenization is timed in its thread: the thread-pool wait is not routing work, tokenizing is
            ids, tokenize_seconds = await asyncio.get_running_loop().run_in_executor(None, _timed_token_ids, router, prompt)
        else:
            ids, tokenize_seconds = _timed_token_ids(router, prompt)
        started = time.perf_counter()
        decision = router.route(ids)
        metrics.routing.observe(tokenize_seconds + time.perf_counter() - started)
        metrics.requests_of_rank[decision.rank].inc()
        if decision.predicted_lar is not None:
            metrics.lar_of_rank[decision.rank].observe(decision.predicted_lar)
        return decision.rank

    async def proxy(request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        if request.method == "GET" and request.path == "/metrics":
            return web.Response(body=metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
        try:
            async with asyncio.timeout(client_timeout):
                raw = await request.read()  # over client_max_size: aiohttp's 413
        except TimeoutError:
            response = _error_response(408, "request_timeout", f"the request body did not arrive within {client_timeout:g} s.")
            response.force_close()  # the rest of the body may still come: this connection cannot carry another request
            return response
        except RequestPayloadError as e:  # e.g. a Content-Encoding: gzip body that is not gzip
            response = _error_response(400, "bad_request_body", f"the request body could not be decoded ({' '.join(str(e.__cause__ or e).split())}).")
            response.force_close()
            return response
        try:
            rank = await decide(request, raw)
        except ClientRefusal as e:
            return _error_response(400, "bad_request", str(e))
        # a list, not a dict: a header the client sent twice goes upstream twice. aiohttp hands over the body
        # decoded, so its Content-Encoding stays behind (a gzip body went upstream plain but labelled gzip: 500)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP | {"content-encoding"}]
        base = upstreams[0]
        if rank is not None and len(upstreams) == 1:
            headers.append((header, str(rank)))
        elif rank is not None:
            base = upstreams[rank]
        url = base + request.rel_url.raw_path_qs
        metrics.in_flight.inc()
        sent = time.perf_counter()
        try:
            async with request.app[session_key].request(
                request.method, url, headers=headers, data=raw if raw else None, allow_redirects=False,
            ) as upstream:
                reply_headers = [(k, v) for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP]
                if rank is not None:  # the client learns the rank its request ran on (bench_serving records it)
                    reply_headers.append((header, str(rank)))
                length = upstream.content_length
                if upstream.status >= 400:
                    metrics.error(f"status_{upstream.status // 100}xx")
                if length is not None and length <= BUFFER_BYTES:
                    # a bounded body: read it whole, then headers and body leave in one write (a StreamResponse
                    # sends its headers at once, a Response holds them for the body)
                    try:
                        body = await upstream.read()
                    except TimeoutError:
                        raise  # the upstream went silent (aiohttp's read timeout is a ClientError too): 504 below
                    except aiohttp.ClientError as e:
                        metrics.error("midstream")
                        return _error_response(502, "upstream_failed", f"upstream {base} failed mid-response: {e}.")
                    received = time.perf_counter()
                    reply_headers.append(("Content-Length", str(length)))
                    response = web.Response(body=body, status=upstream.status, reason=upstream.reason,
                                            headers=reply_headers)
                    await response.prepare(request)
                    await response.write_eof()
                else:
                    response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                                  headers=reply_headers)
                    if length is not None:
                        response.content_length = length
                    await response.prepare(request)
                    try:
                        async for chunk in upstream.content.iter_any():
                            await response.write(chunk)
                    except (aiohttp.ClientError, TimeoutError) as e:
                        # headers are out: the status cannot change any more; cut the connection so the client
                        # sees it
                        metrics.error("midstream")
                        if request.transport is not None:
                            request.transport.close()
                        raise ConnectionResetError(f"upstream {base} failed mid-response: {e}") from e
                    received = time.perf_counter()
                    await response.write_eof()
                metrics.added.observe(sent - started + time.perf_counter() - received)
                return response
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            metrics.error("connect")
            return _error_response(502, "upstream_unavailable", f"upstream {base} is unreachable ({type(e).__name__}: {e}).")
        except TimeoutError:
            metrics.error("timeout")
            return _error_response(504, "upstream_timeout", f"upstream {base} did not answer within {timeout:g} s.")
        except aiohttp.ClientError as e:
            metrics.error("connect")
            return _error_response(502, "upstream_unavailable", f"upstream {base} failed before answering ({type(e).__name__}: {e}).")
        finally:
            metrics.in_flight.dec()

    if max_body_bytes <= 0 or client_timeout <= 0:
        raise ConfigError("the body size limit and the client timeout must be > 0.")
    app = web.Application(client_max_size=max_body_bytes)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def _timed_token_ids(router: SemanticRouter, prompt) -> tuple[np.ndarray, float]:
    started = time.perf_counter()
    ids = router.token_ids(prompt)
    return ids, time.perf_counter() - started


# ---- CLI -----------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m repro.engines.router", description=__doc__.splitlines()[0])
    p.add_argument("--plan", type=Path, required=True, help="job directory under runs/ or its plan/ folder")
    p.add_argument("--upstream", nargs="+", required=True, help="server URL, or one URL per DP rank")
    p.add_argument("--engine", choices=ENGINES, default="sglang")
    p.add_argument("--tokenizer", help="the model's tokenizer (mixtral, qwen, olmoe, hf:<repo or folder>); default: the job's")
    p.add_argument("--ep-size", type=int, help="DP ranks = EP degree (default: the job's parallel.devices)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8080)
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to the upstream")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the upstream may stay silent")
    p.add_argument("--client-timeout", type=float, default=CLIENT_TIMEOUT_S,
                   help="seconds a client may take to send a request's headers, and its body")
    p.add_argument("--max-body-mb", type=float, default=MAX_BODY_BYTES / 2**20,
                   help="largest request body accepted, in MiB (413 beyond)")
    return p


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"a TCP port is an integer in 1..65535, got {text!r}")
    return int(text)


def make_router(args) -> tuple[SemanticRouter, object]:
    from repro.engines.layout import read_plan
    from repro.workloads import load_tokenizer

    plan, config, _ = read_plan(args.plan, args.ep_size)
    name = args.tokenizer or ((config or {}).get("model") or {}).get("tokenizer")
    if not name:
        raise ConfigError("the job config names no tokenizer; pass the model's with --tokenizer.")
    tokenizer = load_tokenizer(name)
    return SemanticRouter(plan, tokenizer), tokenizer


def main(argv: list[str] | None = None) -> int:
    from aiohttp import web

    args = build_parser().parse_args(argv)
    try:
        limits = (args.connect_timeout, args.timeout, args.client_timeout, args.max_body_mb)
        if not all(math.isfinite(x) and x > 0 for x in limits):  # nan passed a `<= 0` test
            raise ConfigError("--connect-timeout, --timeout, --client-timeout and --max-body-mb must be finite numbers > 0.")
        router, tokenizer = make_router(args)
        app = build_app(router, args.upstream, args.engine, connect_timeout=args.connect_timeout, timeout=args.timeout,
                        max_body_bytes=int(args.max_body_mb * 2**20), client_timeout=args.client_timeout)
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"routing {router.num_ranks} DP ranks of {args.upstream} ({args.engine}, tokenizer {tokenizer.name}) "
          f"on http://{args.host}:{args.port}; metrics at /metrics", file=sys.stderr)
    # everything alive now lives as long as the process: keep it out of the collector's full passes (module doc)
    gc.collect()
    gc.freeze()
    try:
        web.run_app(app, host=args.host, port=args.port, access_log=None, print=None,
                    **server_options(args.client_timeout))
    except OSError as e:  # port in use, host not an address of this machine, no permission
        print(f"error: cannot listen on {args.host}:{args.port} ({e.strerror or e}); choose another --port or --host.",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
