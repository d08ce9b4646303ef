"""Semantic DP-rank router: an async HTTP proxy in front of an SGLang or vLLM server with Attention-DP.

    python -m repro.engines.router --plan runs/paper_dp/<job> --upstream http://127.0.0.1:30000 --port 8080
    python -m repro.engines.router --plan <job> --engine vllm --upstream http://127.0.0.1:8000
    python -m repro.engines.router --plan <job> --engine vllm --upstream http://h:8000 http://h:8001 ...  # external LB
    python -m repro.engines.router --plan <job> --engine vllm --prefill http://p:8100 \
        --decode http://d:8200 http://d:8201 ... --decode-plan <signature job>  # PD, decode chosen after prefill

For POST /v1/completions, /v1/chat/completions and SGLang's /generate it tokenizes the prompt with the model's
tokenizer (text prompts, chat message texts without the chat template, or the token ids the client sent),
scores the DP ranks with the plan's tables and sets the rank: one request at a time through
`plan.assign_requests` (Sem-MoE Algorithm 2, round-robin mask included, its streaming state kept across
requests; a non-Sem-MoE plan gives its own online behaviour, e.g. round robin). With one upstream the rank goes
in the header SGLang (`X-Data-Parallel-Rank`, entrypoints/openai/serving_base.py) or vLLM
(`X-data-parallel-rank`, `_get_data_parallel_rank`) reads; HTTP header names are case-insensitive, each engine
gets its own spelling anyway. With D upstreams (vLLM external load balancing, one server per rank) rank r's
request goes to upstream r, without a header. A request that already carries the header keeps its rank, unscored
(with D upstreams it goes to that rank's upstream); a rank outside the plan's, or two different ranks, get 400.

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
A plan that reads the engines' live load (`reads_load`: the load balancers of repro/systems/dp_balance.py,
Sem-MoE with dp_scheduler=load) gets it from the upstreams' own /metrics, polled every --load-poll-ms
(repro.engines.load_signals: running and waiting requests and KV use per rank; the router's dispatches since the
last poll count as waiting); a failed poll keeps the last values and counts an upstream error of kind load_signals.

GET /metrics (Prometheus): requests per rank, predicted local activation rate per rank, routing seconds
(tokenize + score), the router's own added seconds per proxied request, upstream errors by kind, requests in
flight, plan swaps.

A new plan (issue 34: a re-placement) replaces the one in place without stopping the router: SIGHUP re-reads
--plan (Plan.save writes it atomically; `reload_plan`), or a program calls `SemanticRouter.swap_plan`. The new
plan's tables are built and checked first (same DP ranks, online assignment, the tokenizer's vocabulary), then
swapped in under the routing lock: each request is scored wholly by the plan in place when it takes the lock,
requests already sent upstream keep their rank (their KV cache lives there), none is dropped or held. A plan that
cannot be read or routed is refused with one line on stderr and the plan in place stays. Swap the engines' expert
placement first (repro.engines.replacement exports it): the router then sends requests after it.

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

PD mode (vLLM 0.33.0's NIXL pull connector; `repro.engines.pd` has the protocol): --prefill replaces --upstream
and --decode names the decode servers (one URL, rank in the header, or one per rank of the decode plan). A
completions request goes to the prefill server first (its rank chosen as above), rewritten to prefill only; its
JSON reply is read whole, the decode rank chosen by the decode plan (system=signature / signature_eldr) from the
reply's routed experts (`assign_decode`), and the client's body with the reply's kv_transfer_params sent to that
decode server, whose reply is relayed as above (its rank in X-Semmoe-Decode-Rank). A prefill error status is
returned as is; a reply without kv_transfer_params or routed experts gets 502, and a decode leg that would start
later than --kv-lease seconds (the prefill's kv_lease_duration) after the prefill reply 504, each with one
sentence. Other requests go to the prefill server as in the plain mode.

Legend: L plan layers, D DP ranks, t profiled token rows (+1 OOV row), n prompt tokens of one request.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import re
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from repro import cli
from repro.engines.load_signals import LiveLoad, parse_metrics
from repro.engines.pd import KV_LEASE_S, PD_PATHS, DecodeChooser, decode_body, prefill_body
from repro.errors import ConfigError, ReproError, TraceError
from repro.systems.base import Plan

ENGINES = ("sglang", "vllm")
RANK_HEADERS = {"sglang": "X-Data-Parallel-Rank", "vllm": "X-data-parallel-rank"}
DECODE_RANK_HEADER = "X-Semmoe-Decode-Rank"  # PD mode: the decode rank, on the reply to the client
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
LOAD_POLL_S = 0.05  # how often a load-reading plan's router polls the upstreams' /metrics (vLLM's coordinator: 100 ms)


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


@dataclass(frozen=True)
class _Routing:
    """What one plan routes with, swapped as one object (SemanticRouter.swap_plan): the plan, its token vocabulary
    (None: any id), its predicted-LAR table float32[V, D] (None: no token tables), the live load it reads (None)."""

    plan: Plan
    vocab: int | None
    lar_vocab: np.ndarray | None
    live: LiveLoad | None


class SemanticRouter:
    """Request -> DP rank with a plan's online scheduler; safe to call from several threads or coroutines.

    `swap_plan` replaces the plan while requests are routed: the new plan's tables are built and checked first,
    then swapped in under the routing lock, so each request is scored wholly by one plan (the one in place when it
    takes the lock), a request already routed keeps its rank, and none is dropped (the proxy never waits on it).
    """

    def __init__(self, plan: Plan, tokenizer=None, live: LiveLoad | None = None):
        self.tokenizer = tokenizer
        self.num_ranks = plan.parallel.devices
        self._live_source = live  # the engines' live load; a plan that reads it gets it (build_app polls it)
        self._lock = threading.Lock()
        self.swaps = 0
        self._routing = self._prepare(plan)
        plan.reset()

    @property
    def plan(self) -> Plan:
        return self._routing.plan

    @property
    def live(self) -> LiveLoad | None:
        return self._routing.live

    def _prepare(self, plan: Plan) -> _Routing:
        """The routing state of `plan`, checked (ConfigError: one sentence) against this router's ranks and tokenizer."""
        from repro.systems.semmoe.system import SemMoEPlan

        if plan.parallel.attention != "dp":
            raise ConfigError(
                f"the plan was fitted for parallel.attention={plan.parallel.attention}; request routing needs an "
                "Attention-DP plan (parallel.attention=dp)."
            )
        if plan.parallel.devices != self.num_ranks:
            raise ConfigError(f"the new plan has {plan.parallel.devices} DP ranks but the router serves {self.num_ranks}; "
                              "a swapped plan must keep the ranks.")
        vocab = lar_vocab = None
        if isinstance(plan, SemMoEPlan):
            if plan.dp_assign != "online":
                raise ConfigError(
                    f"the plan assigns requests with dp_assign={plan.dp_assign}, which waits for later requests; "
                    "a router decides at arrival: fit it with system.params.dp_assign=online."
                )
            vocab = len(plan.row_of_token)
            if self.tokenizer is not None and self.tokenizer.vocab_size > vocab:
                raise ConfigError(
                    f"tokenizer {self.tokenizer.name!r} emits {self.tokenizer.vocab_size} ids but the plan knows {vocab}; "
                    "the plan was profiled with another tokenizer (pass the model's with --tokenizer)."
                )
            on_device = plan.token_device[:, :, None] == np.arange(self.num_ranks)[None, None, :]  # [L, t+1, D]
            lar_table = (plan.token_confidence[:, :, None] * on_device).mean(axis=0).astype(np.float32)  # [t+1, D]
            # per vocabulary id [V, D]: one gather per request instead of two (V x D x 4 bytes: 4.9 MB for Qwen)
            lar_vocab = lar_table[plan.row_of_token]
        live = self._live_source if getattr(plan, "reads_load", False) else None
        return _Routing(plan, vocab, lar_vocab, live)

    def swap_plan(self, plan: Plan) -> None:
        """Route every request from now on with `plan` (its online state reset); requests routed before keep their
        rank. The new tables are built before the lock is taken: routing never waits for them."""
        routing = self._prepare(plan)
        plan.reset()
        with self._lock:
            self._routing = routing
            self.swaps += 1

    def token_ids(self, prompt: str | list[int]) -> np.ndarray:
        """int64[n] ids of a prompt (text through the tokenizer; ids outside the plan's vocabulary dropped)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("a text prompt needs the model's tokenizer; start the router with --tokenizer.")
            # the tokenizer's ids are below its vocab_size <= the plan's vocabulary (checked in _prepare)
            return np.asarray(self.tokenizer.encode(prompt), dtype=np.int64)
        try:
            ids = np.asarray(prompt, dtype=np.int64)
        except OverflowError:  # an id beyond int64 is outside every vocabulary: drop it like any unknown id
            ids = np.asarray([x for x in prompt if -(1 << 63) <= x < (1 << 63)], dtype=np.int64)
        vocab = self._routing.vocab
        if vocab is not None:
            ids = ids[(ids >= 0) & (ids < vocab)]
        return ids

    def route(self, token_ids: np.ndarray) -> Decision:
        """The rank of the next request, whose prompt tokens are token_ids int[n] (state advances by one)."""
        with self._lock:
            routing = self._routing  # one plan for the whole decision, even if a swap waits for the lock
            if routing.vocab is not None:  # ids were filtered before the lock, possibly by the plan swapped out
                token_ids = token_ids[(token_ids >= 0) & (token_ids < routing.vocab)]
            n = len(token_ids)
            live = {} if routing.live is None else {"load": routing.live.view()}
            rank = int(routing.plan.assign_requests(token_ids, np.array([0, n]), np.array([n]), **live)[0])
            if routing.live is not None:
                routing.live.dispatched(rank, n)
        lar = None
        if routing.lar_vocab is not None and n:
            lar = float(routing.lar_vocab[token_ids, rank].mean())
        return Decision(rank, lar)


ADDED_BUCKETS = (5e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 4e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 1e-2, 2e-2,
                 5e-2, 0.1, 0.25, 1.0)
ERROR_KINDS = ("connect", "timeout", "midstream", "status_4xx", "status_5xx", "prefill_reply", "kv_lease", "load_signals")


class RouterMetrics:
    """Prometheus metrics of one router, in their own registry (several routers may live in one process).

    The labelled children are looked up once here: labels() costs a lock and a dict lookup per call.
    """

    def __init__(self, num_ranks: int, decode_ranks: int = 0):
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
                              "midstream, status_4xx, status_5xx; PD: prefill_reply, kv_lease)", ["kind"],
                              registry=self.registry)
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
        if decode_ranks:
            decode = Counter("semmoe_router_decode_requests", "PD mode: requests sent to decode, by decode rank",
                             ["rank"], registry=self.registry)
            self.decode_of_rank = [decode.labels(rank=str(rank)) for rank in range(decode_ranks)]

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


def client_rank(values: list[str], header: str, num_ranks: int) -> int:
    """The rank a client set in its rank header(s), checked against the plan: the upstream would otherwise get rank
    99 of 4, or 'abc'; two different ranks in one request name no upstream."""
    for value in values:
        if not re.fullmatch(r"[0-9]{1,9}", value.strip()) or int(value) >= num_ranks:
            raise ClientRefusal(f"{header}: {value!r} is not a DP rank of this plan (0..{num_ranks - 1}); send a rank "
                                "in that range, or no header to let the router choose.")
    ranks = sorted({int(value) for value in values})
    if len(ranks) > 1:
        raise ClientRefusal(f"{header} is sent {len(values)} times with different ranks {ranks}; send it once, or no "
                            "header to let the router choose.")
    return ranks[0]


def check_upstreams(upstreams: Sequence[str], flag: str = "--upstream") -> None:
    """Each upstream an http(s) URL with a host, refused at start rather than answered 502 on every request."""
    from yarl import URL

    for text in upstreams:
        try:
            url = URL(text)
        except (ValueError, TypeError):
            url = None
        if url is None or url.scheme not in ("http", "https") or not url.host:
            raise ConfigError(f"{flag} {text!r} is not an http(s) URL with a host; give e.g. http://127.0.0.1:30000.")


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
    client_timeout: float = CLIENT_TIMEOUT_S, decode: DecodeChooser | None = None,
    decode_upstreams: Sequence[str] = (), kv_lease: float = KV_LEASE_S, load_poll_s: float = LOAD_POLL_S,
):
    """The aiohttp application proxying to `upstreams` (one URL, or one per DP rank).

    A request body over max_body_bytes gets 413; one not received within client_timeout seconds gets 408.
    Serve it with server_options(client_timeout) so slow request headers time out too. PD mode (decode given,
    engine vllm): `upstreams` are the prefill servers, decode_upstreams the decode servers (one, or one per rank
    of decode's plan), kv_lease the prefill's kv_lease_duration in seconds.
    """
    import aiohttp
    from aiohttp import web
    from aiohttp.web_protocol import RequestPayloadError

    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {ENGINES}, got {engine!r}.")
    check_upstreams(upstreams, "--prefill" if decode else "--upstream")
    quiet_client_errors()
    upstreams = [u.rstrip("/") for u in upstreams]
    if len(upstreams) not in (1, router.num_ranks):
        raise ConfigError(
            f"give one upstream (rank in a header) or one per DP rank ({router.num_ranks}), got {len(upstreams)}."
        )
    if decode is not None:
        if engine != "vllm":
            raise ConfigError("PD mode needs --engine vllm: SGLang chooses the decode server before the prefill runs "
                              "(docs/engines.md).")
        check_upstreams(decode_upstreams, "--decode")
        decode_upstreams = [u.rstrip("/") for u in decode_upstreams]
        if len(decode_upstreams) not in (1, decode.num_ranks):
            raise ConfigError(f"give one --decode URL (rank in a header) or one per rank of the decode plan "
                              f"({decode.num_ranks}), got {len(decode_upstreams)}.")
        if not math.isfinite(kv_lease) or kv_lease <= 0:
            raise ConfigError(f"the KV lease must be a finite number of seconds > 0, got {kv_lease!r}.")
    header = RANK_HEADERS[engine]
    metrics = RouterMetrics(router.num_ranks, decode.num_ranks if decode else 0)
    from prometheus_client import Gauge

    Gauge("semmoe_router_plan_swaps", "Plans swapped in since start (SIGHUP reloads of --plan)",
          registry=metrics.registry).set_function(lambda: router.swaps)
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def start(app: web.Application) -> None:
        app[session_key] = aiohttp.ClientSession(
            auto_decompress=False,  # bodies go through byte for byte, compressed or not
            connector=aiohttp.TCPConnector(limit=max_connections),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=timeout),
        )

    async def stop(app: web.Application) -> None:
        if poller_key in app:
            app[poller_key].cancel()
        await app[session_key].close()

    poller_key = web.AppKey("load_poller", asyncio.Task)

    async def poll_load(app: web.Application) -> None:
        """Read every upstream's /metrics each load_poll_s into router.live (a failed read keeps the last values)."""
        while True:
            for index, base in enumerate(upstreams if router.live is not None else ()):  # a swap may change it
                try:
                    async with app[session_key].get(base + "/metrics") as reply:
                        text = (await reply.read()).decode("utf-8", "replace") if reply.status == 200 else None
                except (aiohttp.ClientError, TimeoutError):
                    text = None
                if text is None:
                    metrics.error("load_signals")
                    continue
                try:
                    gauges = parse_metrics(text, engine, router.num_ranks, index if len(upstreams) > 1 else None)
                except ConfigError:
                    metrics.error("load_signals")
                    continue
                with router._lock:
                    router._live_source.update(gauges)
            await asyncio.sleep(load_poll_s)

    async def start_polling(app: web.Application) -> None:
        if router._live_source is not None:  # polled while the plan in place reads it (a swap may change that)
            app[poller_key] = asyncio.get_running_loop().create_task(poll_load(app))

    async def decide(request: web.Request, raw: bytes) -> int | None:
        if request.method != "POST" or request.path not in ROUTED_PATHS:
            return None
        if header in request.headers:  # a CIMultiDict: any spelling
            # the client's rank is kept, unscored; it still picks the upstream (with one per rank, rank 3's request
            # once went to rank 0's server) and replaces the client's header (proxy)
            rank = client_rank(request.headers.getall(header), header, router.num_ranks)
            metrics.unscored_client_rank.inc()
            return rank
        prompt = extract_prompt(request.path, _json_object(raw))
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

    def target(bases: list[str], rank: int | None) -> tuple[str, list]:
        """(upstream URL, headers to add): rank r's own upstream, or the only one with the rank in a header."""
        if rank is not None and len(bases) > 1:
            return bases[rank], []
        return bases[0], [] if rank is None else [(header, str(rank))]

    def failure(base: str, e: Exception) -> web.Response:
        """The router's reply to an upstream that could not be reached or did not answer in time."""
        if isinstance(e, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
            metrics.error("connect")
            return _error_response(502, "upstream_unavailable", f"upstream {base} is unreachable ({type(e).__name__}: {e}).")
        if isinstance(e, TimeoutError):
            metrics.error("timeout")
            return _error_response(504, "upstream_timeout", f"upstream {base} did not answer within {timeout:g} s.")
        metrics.error("connect")
        return _error_response(502, "upstream_unavailable", f"upstream {base} failed before answering ({type(e).__name__}: {e}).")

    async def relay(request: web.Request, base: str, headers: list, data: bytes, extra: list, started: float,
                    waited: float = 0.0) -> web.StreamResponse:
        """Send the request's method, path and query with these headers and body to `base` and hand the reply to
        the client (reply headers plus `extra`); `waited`: seconds of an earlier upstream leg, not router work."""
        sent = time.perf_counter()
        try:
            async with request.app[session_key].request(
                request.method, base + request.rel_url.raw_path_qs, headers=headers, data=data if data else None,
                allow_redirects=False,
            ) as upstream:
                reply_headers = [(k, v) for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP] + extra
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
                metrics.added.observe(sent - started - waited + time.perf_counter() - received)
                return response
        except (aiohttp.ClientError, TimeoutError) as e:
            return failure(base, e)

    async def disaggregated(request: web.Request, body: dict, headers: list, rank: int | None,
                            started: float) -> web.StreamResponse:
        """PD mode: the prefill leg, read whole; the decode rank from its routed experts; the decode leg relayed."""
        extra = [] if rank is None else [(header, str(rank))]
        if not any(k.lower() == "x-request-id" for k, _ in headers):
            headers = headers + [("X-Request-Id", str(uuid.uuid4()))]  # both legs carry the same request id
        base, rank_headers = target(upstreams, rank)
        prefill_headers = [(k, v) for k, v in headers if k.lower() != "accept-encoding"] + rank_headers  # JSON to read
        sent = time.perf_counter()
        try:
            async with request.app[session_key].post(base + request.rel_url.raw_path_qs, headers=prefill_headers,
                                                     data=json.dumps(prefill_body(body)).encode()) as upstream:
                reply = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            return failure(base, e)
        received = time.perf_counter()
        if upstream.status >= 400:  # the prefill's own error, as it gave it
            metrics.error(f"status_{upstream.status // 100}xx")
            reply_headers = [(k, v) for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP]
            return web.Response(body=reply, status=upstream.status, reason=upstream.reason, headers=reply_headers + extra)
        try:
            try:
                parsed = json.loads(reply)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
                raise TraceError(f"the prefill reply is not JSON ({e}).") from e
            kv = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
            if not isinstance(kv, dict) or not kv:
                raise TraceError("the prefill reply has no kv_transfer_params; launch the prefill server with "
                                 """--kv-transfer-config '{"kv_connector":"NixlPullConnector","kv_role":"kv_both"}'.""")
            decode_rank = decode.choose(decode.experts(parsed))
        except TraceError as e:
            metrics.error("prefill_reply")
            return _error_response(502, "bad_prefill_reply", f"prefill upstream {base}: {e}")
        late = time.perf_counter() - received  # the lease ran from the prefill's end, a little before its reply
        if late > kv_lease:
            metrics.error("kv_lease")
            return _error_response(504, "kv_lease_expired", f"the decode leg would start {late:.3g} s after the prefill "
                                   f"reply, past the prefill's KV lease of {kv_lease:g} s (--kv-lease).")
        metrics.decode_of_rank[decode_rank].inc()
        decode_base, decode_headers = target(decode_upstreams, decode_rank)
        decode_headers = [(k, v) for k, v in headers if k.lower() != header.lower()] + decode_headers
        extra.append((DECODE_RANK_HEADER, str(decode_rank)))
        data = json.dumps(decode_body(body, kv)).encode()
        return await relay(request, decode_base, decode_headers, data, extra, started, waited=received - sent)

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
        # decoded, so its Content-Encoding stays behind (a gzip body went upstream plain but labelled gzip: 500).
        # A rank header is the router's to set (target): with one upstream per rank the rank is in the URL
        dropped = HOP_BY_HOP | {"content-encoding"} | ({header.lower()} if rank is not None else set())
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in dropped]
        metrics.in_flight.inc()
        try:
            if decode is not None and request.method == "POST" and request.path in PD_PATHS:
                body = _json_object(raw)
                if body is not None:
                    return await disaggregated(request, body, headers, rank, started)
            base, rank_headers = target(upstreams, rank)
            # the client learns the rank its request ran on (bench_serving records it)
            extra = [] if rank is None else [(header, str(rank))]
            return await relay(request, base, headers + rank_headers, raw, extra, started)
        finally:
            metrics.in_flight.dec()

    if max_body_bytes <= 0 or client_timeout <= 0:
        raise ConfigError("the body size limit and the client timeout must be > 0.")
    app = web.Application(client_max_size=max_body_bytes)
    app.on_startup.append(start)
    app.on_startup.append(start_polling)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def _json_object(raw: bytes) -> dict | None:
    """A request body's JSON object, or None (not JSON, not an object, nested too deep)."""
    try:
        body = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


def _timed_token_ids(router: SemanticRouter, prompt) -> tuple[np.ndarray, float]:
    started = time.perf_counter()
    ids = router.token_ids(prompt)
    return ids, time.perf_counter() - started


# ---- CLI -----------------------------------------------------------------------------------------------------


def build_parser() -> cli.ArgumentParser:
    """The router's options, each of a shared kind (repro.cli): a bad value is one sentence naming the option, exit
    code 2, before the plan is read or a port opened."""
    p = cli.ArgumentParser(prog="python -m repro.engines.router", description=__doc__.splitlines()[0])
    p.add_argument("--plan", type=cli.existing_dir, required=True, help="job directory under runs/ or its plan/ folder")
    p.add_argument("--upstream", nargs="+", type=cli.url, help="server URL, or one URL per DP rank")
    p.add_argument("--prefill", nargs="+", type=cli.url,
                   help="PD mode (vLLM, NIXL): prefill server URL, or one per DP rank")
    p.add_argument("--decode", nargs="+", type=cli.url,
                   help="PD mode: decode server URL, or one per rank of the decode plan")
    p.add_argument("--decode-plan", type=cli.existing_dir,
                   help="PD mode: job directory of a system=signature / signature_eldr plan")
    p.add_argument("--kv-lease", type=cli.rate, default=KV_LEASE_S,
                   help="PD mode: seconds the prefill holds the KV blocks (its kv_lease_duration)")
    p.add_argument("--model-config", type=cli.existing_file,
                   help="PD mode: the served model's config.json (default: the decode job's model)")
    p.add_argument("--shape", help="PD mode: a simulator shape (conf/sim/shape) instead of --model-config")
    p.add_argument("--engine", choices=ENGINES, default="sglang")
    p.add_argument("--tokenizer", help="the model's tokenizer (mixtral, qwen, olmoe, hf:<repo or folder>); default: the job's")
    p.add_argument("--ep-size", type=cli.positive, help="DP ranks = EP degree (default: the job's parallel.devices)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=cli.port, default=8080)
    p.add_argument("--connect-timeout", type=cli.rate, default=5.0, help="seconds to connect to the upstream")
    p.add_argument("--timeout", type=cli.rate, default=600.0, help="seconds the upstream may stay silent")
    p.add_argument("--client-timeout", type=cli.rate, default=CLIENT_TIMEOUT_S,
                   help="seconds a client may take to send a request's headers, and its body")
    p.add_argument("--max-body-mb", type=cli.rate, default=MAX_BODY_BYTES / 2**20,
                   help="largest request body accepted, in MiB (413 beyond)")
    p.add_argument("--load-poll-ms", type=cli.rate, default=LOAD_POLL_S * 1000,
                   help="a load-reading plan: how often the upstreams' /metrics are read, in ms")
    p.add_argument("--kv-capacity-tokens", type=cli.positive, default=1_000_000,
                   help="a load-reading plan: KV-cache tokens per rank (the engine reports a fraction)")
    p.add_argument("--max-batched-tokens", type=cli.positive, default=8192,
                   help="a load-reading plan: the engine's per-rank token budget per iteration (chunked prefill size)")
    p.add_argument("--max-running-requests", type=cli.positive, default=256,
                   help="a load-reading plan: the engine's per-rank running-request cap (SGLang max_running_requests, "
                        "vLLM max_num_seqs)")
    return p


def make_router(args) -> tuple[SemanticRouter, object]:
    from repro.engines.layout import read_plan
    from repro.workloads import load_tokenizer

    plan, config, _ = read_plan(args.plan, args.ep_size)
    name = args.tokenizer or ((config or {}).get("model") or {}).get("tokenizer")
    if not name:
        raise ConfigError("the job config names no tokenizer; pass the model's with --tokenizer.")
    tokenizer = load_tokenizer(name)
    live = LiveLoad(plan.parallel.devices, args.kv_capacity_tokens, args.max_batched_tokens, args.max_running_requests)
    return SemanticRouter(plan, tokenizer, live), tokenizer


def make_decode(args) -> DecodeChooser:
    """The PD mode's decode rule: --decode-plan read like --plan, on the served model's layout."""
    from repro.engines.layout import ModelLayout, load_plan

    if not args.decode or not args.decode_plan:
        raise ConfigError("PD mode needs --decode URL(s) and --decode-plan <signature job> beside --prefill.")
    if args.model_config and args.shape:
        raise ConfigError("pass --model-config or --shape, not both.")
    layout = (ModelLayout.from_hf_config(args.model_config) if args.model_config
              else ModelLayout.from_shape(args.shape) if args.shape else None)
    return DecodeChooser(load_plan(args.decode_plan, layout=layout))


def reload_plan(router: SemanticRouter, args) -> bool:
    """Re-read --plan and swap it in (SemanticRouter.swap_plan); a plan that cannot be read or routed is refused
    with one line on stderr and the plan in place kept. True when swapped."""
    from repro.engines.layout import read_plan

    try:
        plan, _, _ = read_plan(args.plan, args.ep_size)
        router.swap_plan(plan)
    except ReproError as e:
        print(f"error: plan reload refused, the current plan stays: {e}", file=sys.stderr)
        return False
    print(f"reloaded the plan from {args.plan} (swap {router.swaps})", file=sys.stderr)
    return True


def install_reload(router: SemanticRouter, args) -> None:
    """SIGHUP re-reads --plan (written atomically by Plan.save) and swaps it in on a worker thread: the event loop
    keeps serving while the new tables are built."""
    import signal

    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=reload_plan, args=(router, args), daemon=True).start())


def main(argv: list[str] | None = None) -> int:
    from aiohttp import web

    parser = build_parser()
    args = parser.parse_args(argv)  # every value checked by its kind (timeouts finite and > 0, ports, URLs, paths)
    if bool(args.upstream) == bool(args.prefill):
        parser.error("give --upstream (plain mode) or --prefill with --decode (PD mode), not both or neither")
    if not args.prefill and (args.decode or args.decode_plan):
        parser.error("--decode and --decode-plan belong to PD mode; give --prefill instead of --upstream")
    try:
        decode = make_decode(args) if args.prefill else None
        router, tokenizer = make_router(args)
        app = build_app(router, args.prefill or args.upstream, args.engine, connect_timeout=args.connect_timeout,
                        timeout=args.timeout, max_body_bytes=int(args.max_body_mb * 2**20),
                        client_timeout=args.client_timeout, decode=decode, decode_upstreams=args.decode or (),
                        kv_lease=args.kv_lease, load_poll_s=args.load_poll_ms / 1000)
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    install_reload(router, args)
    where = f"{args.upstream}" if decode is None else f"prefill {args.prefill}, decode {args.decode}"
    print(f"routing {router.num_ranks} DP ranks of {where} ({args.engine}, tokenizer {tokenizer.name}) "
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
