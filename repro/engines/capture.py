"""Real routing from a running SGLang or vLLM server, as a RoutingTrace the systems use directly.

    python -m repro.engines.capture --url http://gpu:30000 --engine sglang --plan runs/paper_dp/<job> \\
        --out traces/dsv2_mmlu workload=mmlu tokenizer=hf:deepseek-ai/DeepSeek-V2-Lite num_requests=500 output_len=32
    python -m repro.engines.capture --url http://gpu:8000 --engine vllm --model-config config.json \\
        --out traces/qwen3_mmlu workload=mmlu tokenizer=qwen num_requests=500
    python -m repro.engines.capture recorder expert_distribution_recorder_*.pt --model-config config.json --out DIR
    python -m repro.engines.capture responses saved.jsonl --engine sglang --model-config config.json --out DIR

Live capture sends each prompt of a workload (key=value arguments of repro.workloads.load_workload) as token
ids, greedy, max(output_len, 1) new tokens, with bounded concurrency, a progress bar and retries (connection
errors, timeouts, 429 and 5xx; other statuses fail at once). The server must run with
`--enable-return-routed-experts`. SGLang returns physical slots: they are mapped back to logical experts with
the placement the server was launched with (`--plan` job / `--location` JSON; neither = trivial placement).
Before anything is written the capture checks the server's reported flags (/get_server_info) and, given
`--reference-trace` (e.g. the profile trace the plan was fitted on), whether the returned slots follow the
plan at all (repro.engines.sglang.placement_evidence): a server that ignored `--init-expert-location` is
reported loudly and nothing is written. `responses` imports saved responses (JSON lines {"input_ids": [...],
"response": {...}}), `recorder` SGLang per_token recorder dumps (prefill tokens only, physical -> logical
with the map the dump reports).

Trace rows per request: the prompt, then the generated tokens that went through the model (all but the last);
prefill_len = prompt length.

Legend: Lh model layers, L MoE layers, P physical slots, R requests, n rows of one request, k top-k.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from repro import cli
from repro.engines.layout import ModelLayout
from repro.engines.payloads import (
    RETURN_FLAG,
    decode_sglang,
    decode_vllm,
    moe_columns,
    physical_to_logical,
    read_recorder_dumps,
    recorder_top_k,
)
from repro.errors import ConfigError, ReproError, TraceError
from repro.traces import RoutingTrace, TraceMeta, make_trace, read_trace, write_trace
from repro.traces.format import check_trace_destination, trace_dir_state

ENGINES = ("sglang", "vllm")
RETRY_STATUSES = {429, 500, 502, 503, 504}


@dataclass
class ServedModel:
    """What a response is decoded against: the engine, the model layout, top-k, and (SGLang) the served map
    rows int64[Lh, P] (None: the trivial placement, slot p = expert p % E)."""

    engine: str
    layout: ModelLayout
    top_k: int
    served_rows: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {ENGINES}, got {self.engine!r}.")
        if self.served_rows is not None and self.served_rows.shape[0] != self.layout.num_hidden_layers:
            raise ConfigError(
                f"the served placement has {self.served_rows.shape[0]} rows, the model {self.layout.num_hidden_layers} layers."
            )

    def moe_rows(self, num_slots: int) -> np.ndarray:
        """int64[L, P] physical -> logical of the MoE layers."""
        if self.served_rows is not None:
            return self.served_rows[list(self.layout.moe_layer_ids)]
        return np.tile(np.arange(num_slots) % self.layout.num_experts, (len(self.layout.moe_layer_ids), 1))


@dataclass
class Routed:
    """One request's routing: token_ids int64[n], experts int64[n, L, k] logical, physical int64[n, L, k] (SGLang
    only, else None), prompt_len."""

    token_ids: np.ndarray
    experts: np.ndarray
    prompt_len: int
    physical: np.ndarray | None = None


def _routed_payload(engine: str, body) -> tuple[str, str | None, list | None]:
    """(base64 routed experts, wire dtype, generated token ids or None) of a response body."""
    if not isinstance(body, dict):
        raise TraceError(f"the server answered {type(body).__name__}, not a JSON object.")
    if engine == "sglang":
        meta = body.get("meta_info") if isinstance(body.get("meta_info"), dict) else {}
        ext = body.get("sglext") if isinstance(body.get("sglext"), dict) else {}
        choice = (body.get("choices") or [{}])[0] if isinstance(body.get("choices"), list) else {}
        choice_ext = choice.get("sglext") if isinstance(choice, dict) and isinstance(choice.get("sglext"), dict) else {}
        for source in (meta, ext, choice_ext):
            if source.get("routed_experts") is not None:
                return source["routed_experts"], source.get("routed_experts_dtype"), body.get("output_ids")
    else:
        choices = body.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        if choice.get("routed_experts") is not None:
            return choice["routed_experts"], None, choice.get("token_ids")
    raise TraceError(
        f"the {engine} response has no routed experts; launch the server with {RETURN_FLAG}"
        + (" and send return_routed_experts=true." if engine == "sglang" else ".")
    )


def decode_response(served: ServedModel, body, prompt_ids: Sequence[int]) -> Routed:
    """The routing of one response to a prompt of token ids `prompt_ids`."""
    text, dtype, output_ids = _routed_payload(served.engine, body)
    layout = served.layout
    if served.engine == "sglang":
        full = decode_sglang(text, layout.num_hidden_layers, served.top_k, dtype)
    else:
        full = decode_vllm(text)
        if full.shape[2] != served.top_k:
            raise TraceError(f"vLLM returned top-{full.shape[2]} routing; the model routes top-{served.top_k}.")
    routed = moe_columns(full, layout.moe_layer_ids, layout.num_hidden_layers)
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    generated = np.asarray(output_ids if isinstance(output_ids, list) else [], dtype=np.int64)
    tokens = np.concatenate([prompt, generated])
    rows = len(routed)
    if rows < len(prompt):
        raise TraceError(f"the server returned {rows} routing rows for a {len(prompt)}-token prompt; send routed_experts_start_len=0.")
    if rows > len(tokens):
        if len(generated):
            raise TraceError(f"the server returned {rows} routing rows for {len(tokens)} prompt and generated tokens.")
        rows = len(prompt)  # generated ids not returned: keep the prompt rows, whose tokens are known
    routed = routed[:rows]
    physical = None
    if served.engine == "sglang":
        physical = routed
        routed = physical_to_logical(physical, served.moe_rows(int(physical.max()) + 1 if physical.size else 1))
    if routed.size and routed.min() < 0:
        raise TraceError("the server returned an empty (-1) expert slot in a MoE layer; the payload is corrupt.")
    return Routed(tokens[:rows], routed, len(prompt), physical)


def build_trace(
    routed: Sequence[Routed], served: ServedModel, *, model: str, dataset: str, tokenizer: str, vocab_size: int,
    source: str, request_ids: Sequence[str] | None = None, labels: Sequence[str] | None = None, extra: dict | None = None,
) -> RoutingTrace:
    """A validated RoutingTrace of decoded requests (vocab_size grows to cover generated ids past the tokenizer's)."""
    if not routed:
        raise TraceError("no request was captured; nothing to write.")
    lengths = np.array([len(r.token_ids) for r in routed], dtype=np.int64)
    token_ids = np.concatenate([r.token_ids for r in routed])
    experts = np.concatenate([r.experts for r in routed])
    layout = served.layout
    meta = TraceMeta(
        model=model, num_experts=layout.num_experts, top_k=int(experts.shape[2]), layer_ids=layout.moe_layer_ids,
        vocab_size=max(int(vocab_size), int(token_ids.max()) + 1 if len(token_ids) else 1), tokenizer=tokenizer,
        source=source, dataset=dataset, dense_layers=layout.dense_layer_ids, extra=dict(extra or {}),
    )
    return make_trace(
        meta, np.concatenate([[0], np.cumsum(lengths)]), token_ids, experts, [r.prompt_len for r in routed],
        request_ids=list(request_ids) if request_ids is not None else None,
        request_datasets=[dataset] * len(routed), request_labels=list(labels) if labels is not None else None,
    )


def reference_popularity(trace: RoutingTrace, layout: ModelLayout) -> np.ndarray:
    """float64[L, E] expert counts of a reference trace, on the layout's MoE layers."""
    if trace.meta.num_experts != layout.num_experts or set(layout.moe_layer_ids) - set(trace.meta.layer_ids):
        raise ConfigError(
            f"the reference trace ({trace.meta.num_experts} experts, layers {list(trace.meta.layer_ids)}) is not of "
            f"the served model ({layout.num_experts} experts, MoE layers {list(layout.moe_layer_ids)})."
        )
    columns = [list(trace.meta.layer_ids).index(layer) for layer in layout.moe_layer_ids]
    experts = np.asarray(trace.experts)[:, columns]
    counts = np.zeros((len(columns), layout.num_experts))
    np.add.at(counts, (np.broadcast_to(np.arange(len(columns))[None, :, None], experts.shape), experts), 1.0)
    return counts


def check_served_placement(routed: Sequence[Routed], served: ServedModel, reference: RoutingTrace) -> dict:
    """placement_evidence of captured SGLang slots; raises (after shouting) when they follow the trivial map."""
    from repro.engines.sglang import PITFALL, placement_evidence, shout

    physical = np.concatenate([r.physical for r in routed])
    num_slots = served.served_rows.shape[1] if served.served_rows is not None else served.layout.num_experts
    evidence = placement_evidence(physical, served.moe_rows(num_slots), reference_popularity(reference, served.layout))
    if evidence["verdict"] == "trivial":
        detail = (f"its routed slots match the trivial map (TV {evidence['tv_trivial']:.3f}) far better than the plan "
                  f"(TV {evidence['tv_plan']:.3f})")
        shout(PITFALL.format(detail=detail))
        raise ConfigError(PITFALL.format(detail=detail))
    return evidence


def server_flag_problems(info: dict, served: ServedModel) -> list[str]:
    """Sentences about SGLang /get_server_info flags that make a capture wrong (empty list: none)."""
    problems = []
    if info.get("enable_return_routed_experts") is False:
        problems.append(f"the server runs without {RETURN_FLAG}.")
    location = info.get("init_expert_location")
    if served.served_rows is not None and location in (None, "trivial"):
        problems.append("a placement was given but the server runs --init-expert-location trivial.")
    if served.served_rows is None and location not in (None, "trivial"):
        problems.append(f"the server runs --init-expert-location {location}; pass it with --location.")
    return problems


# ---- the HTTP client -----------------------------------------------------------------------------------------


@dataclass
class CaptureClient:
    """Sends prompts to one server; `concurrency` requests in flight, `retries` extra attempts per request."""

    url: str
    served: ServedModel
    concurrency: int = 16
    retries: int = 3
    timeout_s: float = 600.0
    model_name: str | None = None  # vLLM's "model" field (default: the first of /v1/models)
    backoff_s: float = 0.5
    stats: dict = field(default_factory=lambda: {"retries": 0})

    def request(self, prompt_ids: Sequence[int], max_new_tokens: int) -> tuple[str, dict]:
        """(path, JSON body) asking for greedy generation with routed experts."""
        if self.served.engine == "sglang":
            return "/generate", {
                "input_ids": [int(x) for x in prompt_ids], "return_routed_experts": True,
                "sampling_params": {"max_new_tokens": int(max_new_tokens), "temperature": 0.0},
            }
        return "/v1/completions", {
            "model": self.model_name, "prompt": [int(x) for x in prompt_ids], "max_tokens": int(max_new_tokens),
            "temperature": 0.0, "return_token_ids": True,
        }

    async def _post(self, session, path: str, body: dict):
        import aiohttp

        last = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), 10.0))
            try:
                async with session.post(self.url + path, json=body) as response:
                    text = await response.text()
                    if response.status == 200:
                        try:
                            return json.loads(text)
                        except json.JSONDecodeError as e:
                            raise TraceError(f"{self.url}{path} answered 200 with a body that is not JSON ({e}).") from e
                    last = f"HTTP {response.status}: {text[:200]}"
                    if response.status not in RETRY_STATUSES:
                        break
            except (TimeoutError, aiohttp.ClientError) as e:
                last = f"{type(e).__name__}: {e}"
        raise ReproError(f"{self.url}{path} failed after {attempt + 1} attempt(s) ({last}); is the server up and healthy?")

    async def server_info(self, session) -> dict | None:
        """SGLang's /get_server_info (None when the endpoint is absent or unreachable)."""
        import aiohttp

        try:
            async with session.get(self.url + "/get_server_info") as response:
                return await response.json() if response.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, ValueError):
            return None

    async def _first_model(self, session) -> str:
        async with session.get(self.url + "/v1/models") as response:
            data = await response.json() if response.status == 200 else {}
        models = data.get("data") if isinstance(data, dict) else None
        if not models:
            raise ConfigError(f"{self.url}/v1/models lists no model; pass --model-name.")
        return str(models[0]["id"])

    async def capture(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], progress: bool = True) -> list[Routed]:
        """Routing of every prompt, in prompt order (the first decode failure cancels the rest)."""
        import aiohttp
        from tqdm import tqdm

        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=min(10.0, self.timeout_s))
        limit = asyncio.Semaphore(self.concurrency)
        results: list[Routed | None] = [None] * len(prompts)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            if self.served.engine == "vllm" and self.model_name is None:
                self.model_name = await self._first_model(session)
            if self.served.engine == "sglang":
                info = await self.server_info(session)
                problems = server_flag_problems(info, self.served) if info else []
                if problems:
                    raise ConfigError(" ".join(problems))
            bar = tqdm(total=len(prompts), desc=f"capture {self.served.engine}", unit="req", disable=not progress)

            async def one(index: int) -> None:
                async with limit:
                    path, body = self.request(prompts[index], max_new_tokens[index])
                    results[index] = decode_response(self.served, await self._post(session, path, body), prompts[index])
                    bar.update()

            tasks: list[asyncio.Future] = []
            try:
                tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                bar.close()
        return results  # type: ignore[return-value]


# ---- CLI -----------------------------------------------------------------------------------------------------


def _workload_kwargs(pairs: Sequence[str]) -> tuple[str, dict]:
    """('mmlu', load_workload kwargs) from key=value arguments (values parsed as YAML scalars / lists)."""
    kwargs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"argument {pair!r} is not key=value (e.g. workload=mmlu num_requests=100).")
        kwargs[key.strip()] = yaml.safe_load(value)
    name = kwargs.pop("workload", None)
    if not name:
        raise ConfigError("say which prompts to send with workload=<name> (mmlu, sharegpt, lmsys_chat, arena_hard).")
    if isinstance(kwargs.get("output_len"), list):
        kwargs["output_len"] = tuple(kwargs["output_len"])
    return str(name), kwargs


def _served(args, engine: str) -> tuple[ServedModel, object | None]:
    """(ServedModel, SavedPlan or None) from --plan / --location / --model-config / --shape / --top-k."""
    from repro.engines.layout import load_plan, parse_layer_ids
    from repro.engines.sglang import location_rows, read_location

    layout = ModelLayout.from_hf_config(args.model_config) if args.model_config else None
    if args.shape:
        layout = ModelLayout.from_shape(args.shape)
    saved = None
    rows = None
    if getattr(args, "plan", None):
        layer_ids = parse_layer_ids(args.layer_ids) if args.layer_ids else None
        saved = load_plan(args.plan, ep_size=args.ep_size, layout=layout, layer_ids=layer_ids)
        layout = saved.layout
        rows = location_rows(saved)
    if layout is None:
        raise ConfigError("say which model the server runs with --model-config <config.json>, --shape <name> or --plan <job>.")
    if getattr(args, "location", None):
        if args.ep_size is None:
            raise ConfigError("--location needs the server's --ep-size.")
        rows = read_location(args.location, layout, args.ep_size)
    top_k = args.top_k or layout.top_k
    if not top_k:
        raise ConfigError("the model config names no num_experts_per_tok; pass --top-k.")
    if engine == "vllm" and rows is not None:
        rows = None  # vLLM returns logical ids: no map to undo
    return ServedModel(engine, layout, int(top_k), rows), saved


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="trace directory to write (new or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace the routing trace already at --out")
    p.add_argument("--model-config", type=Path, help="the served model's HF config.json")
    p.add_argument("--shape", help="a simulator shape name (conf/sim/shape) instead of --model-config")
    p.add_argument("--top-k", type=cli.positive, help="experts per token (default: num_experts_per_tok of the config)")
    p.add_argument("--model-name", help="meta.model of the trace (default: the config's name)")


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m repro.engines.capture", description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--engine", choices=ENGINES, default="sglang")
    _model_args(p)
    p.add_argument("--plan", type=Path, help="job dir / plan dir the SGLang server was launched with")
    p.add_argument("--location", type=Path, help="--init-expert-location JSON the SGLang server was launched with")
    p.add_argument("--layer-ids", help="model layer of each plan row (default: from the job)")
    p.add_argument("--ep-size", type=cli.positive, help="EP degree (default: the job's)")
    p.add_argument("--reference-trace", type=Path, help="a trace of the same model to test the served placement against")
    p.add_argument("--concurrency", type=cli.positive, default=16)
    p.add_argument("--retries", type=cli.count, default=3)
    p.add_argument("--timeout", type=cli.rate, default=600.0, help="seconds per request attempt")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("workload", nargs="+", help="workload=<name> and load_workload key=value arguments")
    return p


def build_import_parser(kind: str) -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog=f"python -m repro.engines.capture {kind}")
    p.add_argument("inputs", type=Path, nargs="+")
    _model_args(p)
    p.add_argument("--dataset", default="", help="dataset name for the trace")
    p.add_argument("--tokenizer", default="", help="tokenizer the token ids come from (meta.tokenizer)")
    if kind == "responses":
        p.add_argument("--engine", choices=ENGINES, default="sglang")
        p.add_argument("--location", type=Path, help="--init-expert-location JSON of the SGLang server")
        p.add_argument("--ep-size", type=cli.positive)
    return p


def if_exists(args) -> str:
    return "replace" if args.overwrite else "error"


def check_out(args) -> None:
    """Refuse, before any work, an --out that write_trace may not write: a routing trace already there without
    --overwrite (a capture once replaced an earlier one silently), or anything that is not a trace."""
    if trace_dir_state(args.out)[0] == "trace" and not args.overwrite:
        raise ConfigError(f"--out {args.out} already holds a routing trace; pass --overwrite to replace it or choose "
                          "another folder.")
    check_trace_destination(args.out, if_exists(args))


def _live(argv: list[str]) -> tuple[RoutingTrace, argparse.Namespace]:
    from repro.workloads import load_workload

    args = build_parser().parse_args(argv)
    check_out(args)  # before a capture that can take hours
    if args.concurrency < 1 or args.retries < 0 or args.timeout <= 0:
        raise ConfigError("--concurrency must be >= 1, --retries >= 0 and --timeout > 0.")
    name, kwargs = _workload_kwargs(args.workload)
    served, saved = _served(args, args.engine)
    reference = read_trace(args.reference_trace) if args.reference_trace else None
    if reference is not None:
        reference_popularity(reference, served.layout)  # wrong model: fail before sending anything
    workload = load_workload(name, **kwargs)
    client = CaptureClient(args.url.rstrip("/"), served, args.concurrency, args.retries, args.timeout)
    prompts = [r.token_ids for r in workload.requests]
    routed = asyncio.run(client.capture(prompts, [max(r.output_len, 1) for r in workload.requests], not args.no_progress))
    extra = {"url": args.url, "workload": workload.config, "retries": client.stats["retries"],
             "placement": str(args.plan or args.location or "trivial")}
    if served.engine == "sglang" and reference is not None:
        extra["placement_check"] = check_served_placement(routed, served, reference)
    trace = build_trace(
        routed, served, model=args.model_name or served.layout.name, dataset=workload.name,
        tokenizer=workload.tokenizer, vocab_size=workload.vocab_size, source=f"capture:{served.engine}",
        request_ids=[r.id for r in workload.requests], labels=workload.labels, extra=extra,
    )
    return trace, args


def _import(kind: str, argv: list[str]) -> tuple[RoutingTrace, argparse.Namespace]:
    args = build_import_parser(kind).parse_args(argv)
    check_out(args)
    if kind == "recorder":
        args.engine = "sglang"
        args.location = None
        args.ep_size = None
    served, _ = _served(args, args.engine)
    if kind == "recorder":
        sequences = read_recorder_dumps(args.inputs)
        if sequences.physical_to_logical.shape[0] != served.layout.num_hidden_layers:
            raise TraceError(
                f"the dumps cover {sequences.physical_to_logical.shape[0]} layers, the model {served.layout.num_hidden_layers}."
            )
        served = ServedModel("sglang", served.layout, served.top_k, sequences.physical_to_logical)
        rows = served.moe_rows(sequences.physical_to_logical.shape[1])
        routed = []
        for ids, physical in zip(sequences.token_ids, sequences.physical, strict=True):
            moe = moe_columns(physical, served.layout.moe_layer_ids, served.layout.num_hidden_layers)
            moe = moe[:, :, : recorder_top_k(moe)]
            routed.append(Routed(ids, physical_to_logical(moe, rows), len(ids), moe))
        extra = {"skipped_passes": sequences.skipped_passes, "orphan_chunks": sequences.orphan_chunks}
        if sequences.skipped_passes or sequences.orphan_chunks:
            print(f"note: {sequences.skipped_passes} decode passes and {sequences.orphan_chunks} orphan prefill chunks "
                  "carry no request identity and were left out.", file=sys.stderr)
    else:
        routed, extra = [], {}
        for path in args.inputs:
            try:
                lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
                raise TraceError(f"{path} is not JSON lines ({e}).") from e
            for number, line in enumerate(lines, 1):
                if not isinstance(line, dict) or not isinstance(line.get("input_ids"), list) or "response" not in line:
                    raise TraceError(f"{path} line {number} lacks 'input_ids' (a list) or 'response'.")
                routed.append(decode_response(served, line["response"], line["input_ids"]))
    trace = build_trace(
        routed, served, model=args.model_name or served.layout.name, dataset=args.dataset, tokenizer=args.tokenizer,
        vocab_size=1, source=f"import:{kind}", extra=extra,
    )
    return trace, args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in ("recorder", "responses"):
            trace, args = _import(argv[0], argv[1:])
        else:
            trace, args = _live(argv)
        out = args.out
        write_trace(trace, out, if_exists=if_exists(args))
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = trace.meta
    print(f"wrote {out}: {trace.num_requests} requests, {trace.num_tokens} tokens, {m.num_layers} MoE layers, "
          f"{m.num_experts} experts, top-{m.top_k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
