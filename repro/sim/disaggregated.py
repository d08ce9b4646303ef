"""Prefill/decode-disaggregated serving: a prefill pool and a decode pool, each an `Engine` of its own (device count,
EP degree, placement and all-to-all backend from its plan and cost model), with the KV cache sent between them.

A request arrives at the prefill pool (its rank from the prefill plan's `assign_requests`), which runs its prompt
and makes its first token (TTFT); the pool serves prompts only (each request has output length 1 there). Its KV
cache (prompt tokens x KV bytes per token and layer x layers) then crosses a link priced from the hardware profile
(`kv_link`: latency + bytes / bandwidth, RDMA between pools by default; transfers do not contend, an optimistic
reading). At the decode pool the decode rank is chosen after prefill by `decode_rule`:
  plan          the decode plan's `assign_decode` (signature / ELDR: from the prompt's routing only) when it has
                one, else its `assign_requests` (round-robin for most systems);
  round_robin   rank r mod D in arrival order at the decode pool;
  plan_live     a capacity rule over the requests decoding now: the decode plan's best signature match
                (`similarity`, signature / ELDR plans) among the ranks whose running plus waiting requests are
                below the least loaded rank's + LIVE_SLACK;
  least_loaded  the rank with the fewest running plus waiting requests;
  prefill_rank  the prefill rank modulo the decode pool's ranks (what a fixed pairing of instances gives).
The request starts decoding when its whole KV cache fits that rank (first come, first served) and leaves after its
last token. Both pools are the aggregated simulator's engine (repro/sim/engine.py) priced by its cost model
(repro/sim/costs.py): `DecodeEngine` only changes where a request enters (prefilled, on the rule's rank).

`HandoffEngine` is the merged case: one pool serves both phases and re-binds each request's decode to the rule's
rank when its prefill ends (KV moved at no cost, only when it fits there); with decode_rule="stay" it is the
aggregated engine exactly (tests/test_disaggregated.py).

Legend: R requests, D ranks of a pool, L MoE layers, k experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from repro.errors import ConfigError, ReproError
from repro.sim.engine import COMPILED_FORMS, Engine, EngineConfig, Requests, RunResult
from repro.sim.hardware import Hardware
from repro.sim.shapes import ModelShape
from repro.sim.traffic import dispatch_slots
from repro.systems.base import Plan

DECODE_RULES = ("plan", "plan_live", "round_robin", "least_loaded", "prefill_rank")
KV_LINKS = ("rdma", "nvlink", "none")
# plan_live: a rank may take a decode while its running + waiting requests are below the least loaded rank's + this
# (1 would force strict rotation, which the prefill pool's completion order already scrambles)
LIVE_SLACK = 2


@dataclass(frozen=True)
class KVLink:
    """What moving a request's KV cache from the prefill to the decode pool costs: latency_s + prompt tokens x
    bytes_per_token / bytes_per_second (bytes_per_token over every layer)."""

    latency_s: float
    bytes_per_second: float
    bytes_per_token: float

    def seconds(self, prompt_len: np.ndarray) -> np.ndarray:
        """float64[R] transfer seconds of prompts of prompt_len int[R] tokens."""
        if self.bytes_per_token == 0 and self.latency_s == 0:
            return np.zeros(len(prompt_len))
        return self.latency_s + np.asarray(prompt_len, dtype=np.float64) * self.bytes_per_token / self.bytes_per_second


def kv_link(shape: ModelShape, hw: Hardware, link: str = "rdma") -> KVLink:
    """The KV link between pools from the hardware profile's collective figures: "rdma" (pools on different nodes),
    "nvlink" (one node), "none" (free: the planted merged-pool comparison)."""
    if link not in KV_LINKS:
        raise ConfigError(f"the KV link must be one of {KV_LINKS}, got {link!r}.")
    if link == "none":
        return KVLink(0.0, float("inf"), 0.0)
    bandwidth = hw.collective_rdma if link == "rdma" else hw.collective_nvlink
    return KVLink(hw.collective_latency, bandwidth, float(shape.kv_bytes_per_token_layer() * shape.num_hidden_layers))


class _DecodeRule:
    """The decode-rank choice after prefill (see the module doc); state: a round-robin counter."""

    def __init__(self, rule: str, plan: Plan, requests: Requests, prefill_rank: np.ndarray | None):
        if rule not in DECODE_RULES + ("stay",):
            raise ConfigError(f"decode_rule must be one of {DECODE_RULES}, got {rule!r}.")
        self.rule, self.plan, self.req, self.prefill_rank = rule, plan, requests, prefill_rank
        self.devices = plan.parallel.devices
        self.next = 0

    def __call__(self, r: int, engine: Engine) -> int:
        if self.rule == "stay":
            return int(engine.rank[r])
        if self.rule == "round_robin":
            self.next += 1
            return (self.next - 1) % self.devices
        if self.rule == "least_loaded":
            return int(np.argmin(engine.running + np.array([len(w) for w in engine.waiting])))
        source = -1 if self.prefill_rank is None else int(self.prefill_rank[r])
        if self.rule == "prefill_rank":
            return (int(engine.rank[r]) if source < 0 else source) % self.devices
        start, length = self.req.stream_start[r], int(self.req.prompt_len[r])
        rows = self.req.stream[start : start + length]  # the prompt's rows: what a router knows after prefill
        if self.rule == "plan_live":
            if not hasattr(self.plan, "similarity"):
                raise ConfigError(f"decode_rule=plan_live needs a plan that scores ranks by signature (system="
                                  f"signature or signature_eldr), not {type(self.plan).__name__}.")
            from repro.systems.signature import normalise_signature, segment_counts

            counts = segment_counts(self.req.experts[rows], np.array([0]), np.array([length]),
                                    self.plan.placement.num_experts)
            score = self.plan.similarity(normalise_signature(counts))[0]
            load = engine.running + np.array([len(w) for w in engine.waiting])
            return int(np.argmax(np.where(load < load.min() + LIVE_SLACK, score, -np.inf)))
        if hasattr(self.plan, "assign_decode"):
            prompt = self.req.experts[rows].view()
            prompt.flags.writeable = False
            ranks = self.plan.assign_decode(prompt, np.array([0, length]), np.array([max(source, 0)]))
        else:
            tokens = self.req.token_ids[rows].view()
            tokens.flags.writeable = False
            ranks = self.plan.assign_requests(tokens, np.array([0, length]), np.array([length], np.int32))
        ranks = np.asarray(ranks)
        if ranks.shape != (1,) or not 0 <= int(ranks[0]) < self.devices:
            raise ReproError(f"{type(self.plan).__name__} returned decode rank {ranks.tolist()} for one request; it "
                             f"must return one rank in 0..{self.devices - 1}.")
        return int(ranks[0])


class DecodeEngine(Engine):
    """The decode pool: `run(arrivals)` takes the times the requests' KV caches arrive; each enters prefilled (its
    first token made) on the decode rule's rank and decodes its remaining output_len - 1 tokens."""

    def __init__(self, plan: Plan, requests: Requests, cost, config: EngineConfig, decode_rule: str = "plan",
                 prefill_rank: np.ndarray | None = None):
        super().__init__(plan, requests, cost, dispatch_slots(plan.placement), config)
        if not self.dp:
            raise ConfigError("the decode pool places requests on Attention-DP ranks; set its parallel.attention=dp.")
        self.rule = _DecodeRule(decode_rule, plan, requests, prefill_rank)

    def run(self, arrivals, until=float("inf"), window=(0.0, float("inf"))) -> RunResult:
        self.rule.next = 0
        return super().run(arrivals, until, window)

    def _arrive(self, r: int) -> None:
        group = self.rule(r, self)
        self.rank[r] = group
        self.waiting[group].append(r)

    def _form(self):
        for g in range(self.groups):  # admitted requests start decoding at once: their prompt is in the KV cache
            while self._admissible(g):
                r = self.waiting[g].popleft()
                self.running[g] += 1
                self.kv_used[g] += self.req.prompt_len[r] + self.req.output_len[r]
                self.pos[r], self.gen[r] = self.req.prompt_len[r], 1
                self.decoding[r] = True
        return super()._form()


COMPILED_FORMS[DecodeEngine._form] = True  # engine_loop.serve's prefilled admission reproduces it


class HandoffEngine(Engine):
    """One pool for both phases whose decode rank is chosen when the prefill ends (the merged-pool case)."""

    def __init__(self, plan: Plan, requests: Requests, cost, config: EngineConfig, decode_rule: str = "plan"):
        super().__init__(plan, requests, cost, dispatch_slots(plan.placement), config)
        self.rule = _DecodeRule(decode_rule, plan, requests, None)

    def run(self, arrivals, until=float("inf"), window=(0.0, float("inf"))) -> RunResult:
        self.rule.next = 0
        return super().run(arrivals, until, window)

    def _commit(self, payload, now: float) -> None:
        was = self.decoding.copy()
        super()._commit(payload, now)
        for r in np.flatnonzero(self.decoding & ~was):  # prefill just ended: bind the decode
            old, new = int(self.rank[r]), self.rule(int(r), self)
            need = self.req.prompt_len[r] + self.req.output_len[r]
            fits = (self.kv_used[new] + need <= self.cfg.kv_capacity_tokens
                    and self.running[new] < self.cfg.max_running_requests)
            if new != old and fits:
                self.running[old] -= 1
                self.kv_used[old] -= need
                self.running[new] += 1
                self.kv_used[new] += need
                self.rank[r] = new


@dataclass
class PDResult:
    """One disaggregated run: per-request arrival, first-token (prefill pool), decode-start (KV arrived) and finish
    times (float64[R] seconds; NaN when unfinished), ranks in each pool, and each pool's RunResult."""

    arrival: np.ndarray
    first_token: np.ndarray
    kv_arrival: np.ndarray
    finish: np.ndarray
    output_len: np.ndarray
    prompt_len: np.ndarray
    prefill: RunResult
    decode: RunResult | None


def run_disaggregated(prefill_plan: Plan, prefill_cost, prefill_config: EngineConfig, decode_plan: Plan, decode_cost,
                      decode_config: EngineConfig, requests: Requests, arrivals: np.ndarray, link: KVLink,
                      decode_rule: str = "plan") -> PDResult:
    """Serve requests arriving at arrivals float64[R] (seconds) on a prefill pool and a decode pool (see the module
    doc). Each pool: a plan (its placement and parallel config), a CostModel for its device count and backend
    (normal kernels for prefill, low-latency for decode) and an EngineConfig."""
    arrivals = np.asarray(arrivals, dtype=np.float64)
    num = len(arrivals)
    prompt_only = Requests(requests.prompt_len[:num], np.ones(num, dtype=np.int64), requests.row_start[:num],
                           requests.stream_start[:num], requests.stream, requests.experts, requests.token_ids)
    prefill = Engine(prefill_plan, prompt_only, prefill_cost, dispatch_slots(prefill_plan.placement),
                     prefill_config).run(arrivals)
    output_len = np.asarray(requests.output_len[:num], dtype=np.int64)
    kv_arrival = prefill.first_token + link.seconds(requests.prompt_len[:num])
    finish = prefill.finish.copy()  # one-token outputs end at the prefill pool
    decode = None
    going = np.flatnonzero((output_len > 1) & np.isfinite(kv_arrival))
    if len(going):
        sub = Requests(requests.prompt_len[going], output_len[going], requests.row_start[going],
                       requests.stream_start[going], requests.stream, requests.experts, requests.token_ids)
        engine = DecodeEngine(decode_plan, sub, decode_cost, decode_config, decode_rule, prefill.rank[going])
        decode = engine.run(kv_arrival[going])
        finish[going] = decode.finish
    return PDResult(arrivals, prefill.first_token, kv_arrival, finish, output_len,
                    np.asarray(requests.prompt_len[:num], dtype=np.int64), prefill, decode)


def pd_metrics(result: PDResult, ttft_slo_s: float, tpot_slo_s: float) -> dict:
    """Per-pool serving numbers of a run: prefill pool TTFT (mean, p90) and prompt tokens/s; decode pool TPOT
    ((finish - first token) / (output - 1), mean and p90, the KV transfer included) and output tokens/s; goodput
    (requests/s finishing within both SLOs) over the span from the first arrival to the last finish."""
    done = np.isfinite(result.finish)
    ttft = result.first_token - result.arrival
    multi = done & (result.output_len > 1)
    tpot = (result.finish - result.first_token)[multi] / (result.output_len[multi] - 1)
    span = float(np.nanmax(result.finish) - result.arrival.min()) if done.any() else float("nan")
    good = done & (ttft <= ttft_slo_s)
    good[multi] &= tpot <= tpot_slo_s
    out = {
        "requests": int(len(result.arrival)), "finished": int(done.sum()),
        "prefill_ttft_mean_s": float(np.nanmean(ttft)), "prefill_ttft_p90_s": float(np.nanpercentile(ttft, 90)),
        "prefill_tokens_per_s": float(result.prompt_len[done].sum() / span),
        "decode_tpot_mean_s": float(tpot.mean()) if len(tpot) else float("nan"),
        "decode_tpot_p90_s": float(np.percentile(tpot, 90)) if len(tpot) else float("nan"),
        "decode_tokens_per_s": float((result.output_len[done] - 1).sum() / span),
        "kv_transfer_mean_s": float(np.nanmean(result.kv_arrival - result.first_token)),
        "goodput_requests_per_s": float(good.sum() / span),
    }
    if result.decode is not None and result.decode.total_activations:
        out["decode_lar"] = result.decode.local_activations / result.decode.total_activations
    if result.prefill.total_activations:
        out["prefill_lar"] = result.prefill.local_activations / result.prefill.total_activations
    return out
