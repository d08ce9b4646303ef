"""The serving engine: continuous batching with chunked prefill, Attention-DP ranks in lockstep or one
Attention-TP group, driven by the system's schedulers and the trace's routing.

Attention-DP: `plan.assign_requests` picks a request's rank when it arrives (one request per call, streaming, as
a router does); a plan with `reads_load` also gets the ranks' live state (`RankLoad`: running and waiting
requests, queued prefill tokens, decoding requests, KV used) as of the last committed iteration. Every iteration, each rank forms its own batch under a token budget (`max_batched_tokens`) and a
request cap (`max_running_requests`), admitting requests first-come-first-served when their whole KV cache
(prompt + output tokens, no preemption) fits the rank's capacity:
  mixed          decode tokens of running requests first, then prefill chunks (Sarathi / vLLM-style);
  prefill_first  a rank with prefill work runs a prefill-only batch and its decodes wait (SGLang's default).
All ranks then step through every MoE layer together: the slowest rank's attention sets when the dispatch
starts, the slowest rank's experts when the combine starts; an idle rank runs an empty batch.
Attention-TP: one batch over all tokens; before each MoE layer `plan.shuffle_tokens` splits the batch's tokens
into equal reduce-scatter slices (its Algorithm 3 for Sem-MoE), which decides where each token's dispatch starts.

An iteration's input tokens are stream positions: prefill chunks of the prompt, then one token per decode step
(decode step j feeds stream position prompt_len + j - 1, whose routing is the captured generated token or a
documented stand-in, see `simulate`). Iterations that only decode and during which no request arrives or
finishes have the same batch composition; they are costed together in one vectorised block of up to
`max_block_iterations` (exactly what stepping one by one gives: same costs, same sequential time sums).

A run may change plan at given times (`changes`, repro/sim/plan_changes.py): each change's migration stalls every
rank (sync) or slows the links (async) before the new plan's dispatch tables and request scheduler take over;
with no changes the run is what it always was, bit for bit.

Attention-DP steps run compiled (repro/sim/engine_loop.py, issue 33): when a step's block ends before the next
queued event, the next step follows in the same compiled call, so Python sees only the events (arrivals, and any a
caller queues); `_form`, `_start`, `_commit`, `_finish` and `_cost_block` below stay the definition, which
engine_loop mirrors statement for statement and which still runs for Attention-TP, for subclasses that change a step
(DecodeEngine's admission excepted) and where the compiled pricing declines. Same numbers either way, bit for bit.

A run may stop at a horizon (`until`): requests unfinished then keep NaN finish (and first-token) times. Over a
measurement window (`window`, by iteration start time) the MoE-layer components are also summed apart for
iterations that hold prefill tokens and for decode-only ones (their costs differ: see repro/sim/metrics.py).

Legend: R requests, G attention groups (D ranks in DP, 1 in TP), K iterations in a block, B decode requests,
N token rows of a block, L MoE layers, k experts per token, D devices.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass

import numpy as np

from repro.errors import ConfigError, ReproError
from repro.sim import engine_loop
from repro.sim.costs import COMPONENTS, SEG_KEYS, CostModel
from repro.sim.engine_loop import _block_rows
from repro.sim.events import ARRIVAL, CHANGE, STEP_END, EventQueue
from repro.sim.plan_changes import PlanChange, check_chain, cost_while_migrating
from repro.sim.traffic import device_tables, stream_traffic
from repro.systems.base import Plan
from repro.systems.load import RankLoad

SCHEDULES = ("mixed", "prefill_first")
PROMPT_CACHE_BYTES = 64 << 20  # whole-prompt counts an engine keeps across its runs (Engine._counted_prompts)


@dataclass(frozen=True)
class Requests:
    """Rate-independent inputs. Compact rows hold each request's trace tokens contiguously, prompt first.

    prompt_len, output_len (>= 1): int64[R]; row_start int64[R] first compact row of request r;
    stream_start int64[R] and stream int64[S]: stream position p of request r is compact row
    stream[stream_start[r] + p] (p < prompt_len: the prompt; then the decode inputs); experts int16[N, L, k];
    token_ids int32[N].
    """

    prompt_len: np.ndarray
    output_len: np.ndarray
    row_start: np.ndarray
    stream_start: np.ndarray
    stream: np.ndarray
    experts: np.ndarray
    token_ids: np.ndarray

    @property
    def num_requests(self) -> int:
        return len(self.prompt_len)


@dataclass(frozen=True)
class EngineConfig:
    max_batched_tokens: int  # per rank (DP) or for the TP group
    max_running_requests: int  # per rank (DP) or for the TP group
    schedule: str
    kv_capacity_tokens: int  # per rank (DP) or for the TP group
    max_block_iterations: int
    iteration_overhead: float  # seconds added to every iteration (scheduler, launch)
    history: int  # MoE layers of routing history the TP token scheduler sees


@dataclass
class RunResult:
    """One simulated run: per-request times (float64[R], seconds) and summed per-layer costs."""

    arrival: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    rank: np.ndarray  # int64[R] attention rank (0 in TP)
    moe_seconds: np.ndarray  # float64[L, C] component seconds summed over iterations (COMPONENTS order)
    iterations: int = 0
    blocks: int = 0
    events: int = 0
    prefill_iterations: int = 0
    busy_seconds: float = 0.0
    dense_seconds: float = 0.0
    head_seconds: float = 0.0
    local_activations: int = 0
    total_activations: int = 0
    remote_copies: int = 0
    tokens: int = 0
    # measurement window, index 0 = iterations holding prefill tokens, 1 = decode-only iterations
    window_moe_seconds: np.ndarray | None = None  # float64[2, L, C] component seconds summed over the window
    window_iterations: np.ndarray | None = None  # int64[2]
    window_seconds: np.ndarray | None = None  # float64[2] iteration seconds
    window_tokens: np.ndarray | None = None  # int64[2] tokens in those iterations
    window_prefill_tokens: int = 0  # prompt tokens among them
    changes: list | None = None  # one dict per plan change that began (Engine._begin_change)
    stall_seconds: float = 0.0  # seconds every rank stood still for synchronous migrations


class Engine:
    """Simulate one arrival sequence (see the module docstring); `cost` prices blocks, `plan` schedules."""

    def __init__(self, plan: Plan, requests: Requests, cost: CostModel | None, slot_table: np.ndarray,
                 config: EngineConfig):
        if config.schedule not in SCHEDULES:
            raise ConfigError(f"sim.schedule must be one of {SCHEDULES}, got {config.schedule!r}.")
        self.plan, self.req, self.cost, self.cfg = plan, requests, cost, config
        self.slot_table = slot_table
        self._first_served = (plan, slot_table, cost)  # what every run starts with, whatever changes a run made
        self.devices = plan.parallel.devices
        self.dp = plan.parallel.attention == "dp"
        self.groups = self.devices if self.dp else 1
        self.spd = plan.placement.slots_per_device
        self.dpn = plan.parallel.devices_per_node
        self.oracle = bool(getattr(plan, "uses_true_routing", False))
        self.reads_load = self.dp and bool(getattr(plan, "reads_load", False))
        need = requests.prompt_len + requests.output_len
        if need.max() > config.kv_capacity_tokens:
            r = int(np.argmax(need))
            raise ConfigError(
                f"request {r} needs {int(need[r])} tokens of KV cache but a rank holds {config.kv_capacity_tokens}; "
                "shorten prompts or outputs, or use hardware with more memory."
            )

    # ---- the event loop --------------------------------------------------------------------------------------

    def run(self, arrivals: np.ndarray, until: float = float("inf"),
            window: tuple[float, float] = (0.0, float("inf")), changes: tuple[PlanChange, ...] = ()) -> RunResult:
        """Serve the first len(arrivals) requests, arriving at arrivals float64[R'] (seconds, any order), until all
        finish or the simulated clock passes `until`; sum the window's costs for iterations starting in
        [window[0], window[1]); change plan as `changes` say (repro/sim/plan_changes.py `priced_changes`)."""
        num_requests = len(arrivals)
        if num_requests > self.req.num_requests:
            raise ReproError(f"{num_requests} arrival times for {self.req.num_requests} requests; pass at most one each.")
        if self.plan is not self._first_served[0] or self.cost is not self._first_served[2]:
            self._serve(*self._first_served[:2])  # an earlier run changed plan: start from the first again
            self.cost = self._first_served[2]
        self._asked: deque[PlanChange] = deque()
        self._migrating = False
        self.window = (float(window[0]), float(window[1]))
        self.plan.reset()
        self.rank = np.full(num_requests, -1, dtype=np.int64)
        self.pos = np.zeros(num_requests, dtype=np.int64)  # stream positions processed
        self.gen = np.zeros(num_requests, dtype=np.int64)  # tokens generated
        self.decoding = np.zeros(num_requests, dtype=bool)
        self.waiting = WaitQueues(self.groups, num_requests)
        self.prefilling: list[list[int]] = [[] for _ in range(self.groups)]
        self.running = np.zeros(self.groups, dtype=np.int64)
        self.kv_used = np.zeros(self.groups, dtype=np.int64)
        # the rest of the live state a load-reading plan sees at an arrival (`RankLoad`), kept up to date at commits
        self.prefill_backlog = np.zeros(self.groups, dtype=np.int64)  # prompt tokens not yet prefilled
        self.decoding_count = np.zeros(self.groups, dtype=np.int64)
        self.last_dt = float("inf")
        num_layers = self.req.experts.shape[1]
        self.result = RunResult(
            arrival=np.asarray(arrivals, dtype=np.float64), first_token=np.full(num_requests, np.nan),
            finish=np.full(num_requests, np.nan), rank=self.rank, moe_seconds=np.zeros((num_layers, len(COMPONENTS))),
            window_moe_seconds=np.zeros((2, num_layers, len(COMPONENTS))), window_iterations=np.zeros(2, np.int64),
            window_seconds=np.zeros(2), window_tokens=np.zeros(2, np.int64), changes=[],
        )
        queue = EventQueue()
        for r in np.argsort(arrivals, kind="stable"):
            queue.push(float(arrivals[r]), ARRIVAL, int(r))
        for change in changes:
            if not isinstance(change, PlanChange):
                raise ReproError(f"Engine.run takes plan changes made by repro.sim.plan_changes.priced_changes, got {change!r}.")
            queue.push(change.time_s, CHANGE, change)
        check_chain(self.plan, changes)
        loop = self._compiled_loop(num_requests)
        busy = False
        while len(queue):
            now, priority, payload = queue.pop()
            if now > until:  # the horizon: what is still queued or running stays unfinished
                break
            if priority == ARRIVAL:
                self._arrive(payload)
                if not busy:  # wake up after every arrival at this instant has been queued
                    queue.push(now, STEP_END, None)
                    busy = True
            elif priority == CHANGE:  # asked for (it waits for the next iteration boundary), or an async one's end
                if isinstance(payload, _Migration):
                    self._end_change(payload, now)
                else:
                    self._asked.append(payload)
                if not busy:  # an idle engine is at a boundary now
                    busy = self._begin_change(now, queue)
            elif loop is not None and payload is True and (self._migrating or not self._asked):
                # no change is due at this boundary: commit and step on to the next queued event, compiled
                busy = self._steps(loop, True, True, now, queue, until)
            else:
                if isinstance(payload, _Migration):  # a synchronous migration's stall ends
                    self._end_change(payload, now)
                elif payload is not None:
                    self._commit(payload, now) if loop is None else self._steps(loop, True, False, now, queue, until)
                busy = self._begin_change(now, queue) or (
                    self._start(now, queue) if loop is None else self._steps(loop, False, True, now, queue, until))
        self.result.events = queue.popped
        if loop is not None:
            self._write_back(loop)
        return self.result

    # ---- plan changes (repro/sim/plan_changes.py) ----------------------------------------------------------------

    def _serve(self, plan: Plan, slot_table: np.ndarray) -> None:
        """Serve `plan` from now on: its dispatch tables and its (reset) schedulers; placed requests keep their rank."""
        if plan.parallel.devices != self.devices or plan.placement.slots_per_device != self.spd:
            raise ConfigError(f"a plan change must keep {self.devices} devices and {self.spd} slots per device.")
        self.plan, self.slot_table = plan, slot_table
        self.oracle = bool(getattr(plan, "uses_true_routing", False))
        self.reads_load = self.dp and bool(getattr(plan, "reads_load", False))
        self._device_tables_LDE = None  # the tables of the old slot table (same shape: the cache would not notice)
        plan.reset()

    def _begin_change(self, now: float, queue: EventQueue) -> bool:
        """At an iteration boundary: begin the oldest change asked for, unless one is migrating. True when it
        stalls the engine (a synchronous migration: its end is a STEP_END)."""
        if self._migrating or not self._asked:
            return False
        change = self._asked.popleft()
        cost = change.cost
        migration = _Migration(change, {**cost.summary(), "asked_s": change.time_s, "start_s": now})
        if cost.duration_s == 0.0:  # nothing moves: the new plan serves at once
            self._end_change(migration, now)
            return self._begin_change(now, queue)
        self._migrating = True
        if cost.mode == "sync":
            queue.push(now + cost.stall_s, STEP_END, migration)
            self.result.stall_seconds += cost.stall_s
            return True
        self.cost = cost_while_migrating(self._first_served[2], change)
        queue.push(now + cost.duration_s, CHANGE, migration)
        return False

    def _end_change(self, migration: _Migration, now: float) -> None:
        self._serve(migration.change.plan, migration.change.slot_table)
        self.cost = self._first_served[2]
        self._migrating = False
        self.result.changes.append({**migration.record, "end_s": now})

    def _arrive(self, r: int) -> None:
        group = 0
        if self.dp:
            start, length = self.req.row_start[r], self.req.prompt_len[r]
            prompt = self.req.token_ids[start : start + length].view()
            prompt.flags.writeable = False  # a scheduler reads the prompt; it must not be able to change it
            live = {"load": self._load_view()} if self.reads_load else {}
            ranks = np.asarray(self.plan.assign_requests(prompt, np.array([0, length]), np.array([length], np.int32), **live))
            if ranks.shape != (1,) or not 0 <= int(ranks[0]) < self.devices:
                raise ReproError(
                    f"{type(self.plan).__name__}.assign_requests returned {ranks.tolist()} for one request; it must "
                    f"return one rank in 0..{self.devices - 1}."
                )
            group = int(ranks[0])
        self.rank[r] = group
        self.waiting[group].append(r)
        self.prefill_backlog[group] += self.req.prompt_len[r]

    def _load_view(self) -> RankLoad:
        """The ranks' state as of the last committed iteration (copies: the plan must not change the engine's)."""
        return RankLoad(self.running.copy(), self.waiting.size.copy(), self.prefill_backlog.copy(), self.decoding_count.copy(),
                        self.kv_used.copy(), self.cfg.kv_capacity_tokens, self.cfg.max_batched_tokens,
                        self.cfg.max_running_requests)

    def _admissible(self, g: int) -> bool:
        if not self.waiting[g] or self.running[g] >= self.cfg.max_running_requests:
            return False
        r = self.waiting[g][0]
        return self.kv_used[g] + self.req.prompt_len[r] + self.req.output_len[r] <= self.cfg.kv_capacity_tokens

    # ---- the compiled steps (repro/sim/engine_loop.py) ---------------------------------------------------------

    def _compiled_loop(self, num_requests: int) -> dict | None:
        """The arguments of engine_loop.serve for this run, or None where the steps stay in Python: Attention-TP
        (the plan's token scheduler runs per layer), a subclass that changes a step (other than DecodeEngine's
        admission), pricing the compiled kernels decline, or expert ids outside the placement (the Python path
        raises the error that names the row)."""
        cls = type(self)
        if not self.dp or self.cost is None or cls._form not in COMPILED_FORMS or any(
                getattr(cls, name) is not getattr(Engine, name) for name in ("_start", "_commit", "_finish")) \
                or cls._cost_block is not _PYTHON_COST_BLOCK:
            return None
        inputs = self.cost._compiled
        num_layers, num_devices, num_experts = self.slot_table.shape
        num_nodes = -(-num_devices // self.dpn)
        if inputs is None or (num_nodes > 1 and num_nodes != inputs["nodes"]) or num_devices != self.cost.devices:
            return None
        req = self.req
        static = getattr(self, "_loop_static", None)
        if static is None or static["requests"] is not req:
            static = self._loop_static = {
                "requests": req, "valid": _experts_in_range(req.experts, num_experts),
                "stream_id": np.unique(req.stream_start, return_inverse=True)[1].astype(np.int64)}
        if not static["valid"]:
            return None
        groups, cfg = self.groups, self.cfg
        self.prefilling = None  # engine_loop keeps the requests in prefill (pf, pf_len)
        return {
            "state": (self.rank, self.pos, self.gen, self.decoding, self.result.first_token, self.result.finish,
                      self.waiting.next, self.running, self.kv_used, self.prefill_backlog, self.decoding_count,
                      self.waiting.head, self.waiting.tail, self.waiting.size,
                      np.full((groups, cfg.max_running_requests), -1, dtype=np.int64), np.zeros(groups, np.int64),
                      np.zeros(num_requests, np.int64), np.zeros((2, groups * (cfg.max_running_requests + 1)), np.int64),
                      np.zeros(3, np.int64), np.zeros(engine_loop.ACC_SIZE, np.int64), np.array([0.0, np.inf]),
                      self.result.moe_seconds, self.result.window_moe_seconds, self.result.window_iterations,
                      self.result.window_seconds, self.result.window_tokens),
            "requests": (req.prompt_len, req.output_len, req.stream_start, req.stream, static["stream_id"], req.experts),
            "config": (np.array([cfg.max_batched_tokens, cfg.max_running_requests, cfg.kv_capacity_tokens,
                                 cfg.max_block_iterations, int(cfg.schedule == "prefill_first"),
                                 int(COMPILED_FORMS[cls._form])], dtype=np.int64), float(cfg.iteration_overhead)),
            "pricing": self._loop_pricing(), "end": np.zeros(1),
        }

    def _loop_pricing(self) -> tuple:
        """engine_loop.serve's placement and pricing arguments for the engine's current slot table and cost model
        (`_steps` rebuilds them when either is replaced during a run)."""
        inputs = self.cost._compiled
        num_devices = self.slot_table.shape[1]
        num_nodes = -(-num_devices // self.dpn)
        cache = self._loop_cache()
        device_table, device_bits = self._device_tables()
        kinds = inputs["kinds"] if self.cost.backend == "deepep_auto" else np.full(2, inputs["kinds"][0], np.int64)
        m = inputs["measured"]
        return (self.slot_table, device_table, device_bits, num_devices * self.spd, self.dpn, num_nodes, kinds,
                inputs["node"], inputs["one_node"], self.cost.hw.devices_per_node, inputs["phase_params"],
                inputs["phase_bytes"], m[0], m[1], m[2], m[3], inputs["c"], inputs["expert_table"],
                inputs["slot_seconds"], inputs["gate_table"], cache["key"], cache["meta"], cache["counts"],
                cache["stats"], self.cost)

    def _steps(self, loop: dict, commit: bool, start: bool, now: float, queue: EventQueue, until: float) -> bool:
        """engine_loop.serve at the STEP_END at `now` (commit: the block in flight; start: the next steps): False
        when the engine falls idle or nothing was started, else its next STEP_END is queued."""
        pricing = loop["pricing"]
        if pricing[0] is not self.slot_table or pricing[-1] is not self.cost:  # a plan change during the run
            if self.cost._compiled is None or self.cost.devices != self.slot_table.shape[1]:
                raise ReproError("a plan change's cost model is one the compiled engine steps cannot price (see "
                                 "CostModel._compiled_inputs); keep the hardware tables' sizes strictly increasing.")
            pricing = loop["pricing"] = self._loop_pricing()
        status = engine_loop.serve(commit, start, now, queue.peek_time(), until, self.window[0], self.window[1],
                                   *loop["requests"], *loop["state"], *loop["config"], *pricing[:-1], loop["end"])
        if status == engine_loop.IDLE:
            return False
        if status == engine_loop.A2A_ERROR:  # what CostModel.block raises for this block (phase_seconds)
            raise ConfigError("a backend's rdma_gbps is 0 but the placement sends tokens across nodes; set it.")
        if status == engine_loop.BAD_ROW:  # unreachable: expert ids are checked before a run takes this path
            raise ReproError("a token row names an expert outside the placement; check the trace's model.")
        queue.push(float(loop["end"][0]), STEP_END, True)
        return True

    def _write_back(self, loop: dict) -> None:
        """RunResult's sums kept by the compiled steps."""
        acc, accf, res = loop["state"][19], loop["state"][20], self.result
        res.iterations += int(acc[engine_loop.ACC_ITERATIONS])
        res.blocks += int(acc[engine_loop.ACC_BLOCKS])
        res.prefill_iterations += int(acc[engine_loop.ACC_PREFILL_ITERATIONS])
        res.local_activations += int(acc[engine_loop.ACC_LOCAL])
        res.total_activations += int(acc[engine_loop.ACC_TOTAL])
        res.remote_copies += int(acc[engine_loop.ACC_REMOTE])
        res.tokens += int(acc[engine_loop.ACC_TOKENS])
        res.window_prefill_tokens += int(acc[engine_loop.ACC_WINDOW_PREFILL_TOKENS])
        res.events += int(acc[engine_loop.ACC_EVENTS])
        res.busy_seconds += float(accf[engine_loop.ACCF_BUSY])

    def _loop_cache(self) -> dict:
        """The compiled steps' whole-prompt counts (what `_counted_prompts` keeps, same rule and bound), reset when
        the slot table or the requests change: key int32[streams, G], meta int64[2] (kept, capacity), counts int32[
        capacity, L, W] (np.zeros: pages are touched only by kept prompts), stats int64[capacity, 3]."""
        cache = getattr(self, "_compiled_prompts", None)
        if cache is None or cache["slot_table"] is not self.slot_table or cache["requests"] is not self.req:
            num_layers, num_devices = self.slot_table.shape[:2]
            nodes = -(-num_devices // self.dpn)
            width = 2 * num_devices + (nodes if nodes > 1 else 0) + num_devices * self.spd
            capacity = max(1, PROMPT_CACHE_BYTES // (num_layers * width * 4 + 24))
            streams = int(np.unique(self.req.stream_start).size)
            room = min(capacity, streams * self.groups)
            cache = self._compiled_prompts = {
                "slot_table": self.slot_table, "requests": self.req,
                "key": np.full((streams, self.groups), -2, dtype=np.int32),
                "meta": np.array([0, capacity], dtype=np.int64),
                "counts": np.zeros((room, num_layers, width), dtype=np.int32), "stats": np.zeros((room, 3), np.int64)}
        return cache

    # ---- batch formation ----------------------------------------------------------------------------------------

    def _form(self) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """(decode requests int64[B], prefill segments [(request, tokens)]) of the next iteration."""
        dec = np.flatnonzero(self.decoding)
        n_dec = np.bincount(self.rank[dec], minlength=self.groups)
        stalled = np.zeros(self.groups, dtype=bool)
        segments: list[tuple[int, int]] = []
        budget_cap = self.cfg.max_batched_tokens
        for g in range(self.groups):
            if self.cfg.schedule == "prefill_first":
                if not (self.prefilling[g] or self._admissible(g)):
                    continue
                stalled[g] = n_dec[g] > 0
                budget = budget_cap
            else:
                budget = budget_cap - int(n_dec[g])
            for r in self.prefilling[g]:
                if budget <= 0:
                    break
                q = min(int(self.req.prompt_len[r] - self.pos[r]), budget)
                segments.append((r, q))
                budget -= q
            while budget > 0 and self._admissible(g):
                r = self.waiting[g].popleft()
                self.prefilling[g].append(r)
                self.running[g] += 1
                self.kv_used[g] += self.req.prompt_len[r] + self.req.output_len[r]
                q = min(int(self.req.prompt_len[r]), budget)
                segments.append((r, q))
                budget -= q
        if stalled.any():
            dec = dec[~stalled[self.rank[dec]]]
        return dec, segments

    def _start(self, now: float, queue: EventQueue) -> bool:
        """Form and price the next block; schedule its end. False when there is nothing to run."""
        dec, segments = self._form()
        if not len(dec) and not segments:
            return False
        num_k = 1
        if not segments:
            room = int((self.req.output_len[dec] - self.gen[dec]).min())
            num_k = min(room, self.cfg.max_block_iterations)
            next_arrival = queue.peek_time()
            if np.isfinite(next_arrival):
                estimate = (next_arrival - now) / self.last_dt * 1.25 + 1
                num_k = int(min(num_k, max(1, estimate)))
        total, moe, stats = self._cost_block(dec, segments, num_k)
        ends = np.cumsum(np.concatenate([[now], total]))[1:]
        executed = num_k
        if np.isfinite(queue.peek_time()):
            executed = min(int(np.searchsorted(ends, queue.peek_time(), side="left")) + 1, num_k)
        self.last_dt = float(total[executed - 1])
        res = self.result
        res.iterations += executed
        res.blocks += 1
        res.prefill_iterations += int(bool(segments))
        res.busy_seconds += float(total[:executed].sum())
        res.moe_seconds += moe[:executed].sum(axis=0)
        for key, values in stats.items():
            setattr(res, key, getattr(res, key) + int(values[:executed].sum()))
        starts = np.concatenate([[now], ends[: executed - 1]])
        inside = (starts >= self.window[0]) & (starts < self.window[1])
        if inside.any():
            phase = 0 if segments else 1  # a block with prefill segments is one iteration
            res.window_moe_seconds[phase] += moe[:executed][inside].sum(axis=0)
            res.window_iterations[phase] += int(inside.sum())
            res.window_seconds[phase] += float(total[:executed][inside].sum())
            res.window_tokens[phase] += int(stats["tokens"][:executed][inside].sum())
            res.window_prefill_tokens += sum(q for _, q in segments)
        queue.push(float(ends[executed - 1]), STEP_END, (dec, segments, executed))
        return True

    def _commit(self, payload, now: float) -> None:
        dec, segments, executed = payload
        req, res = self.req, self.result
        if len(dec):
            self.pos[dec] += executed
            self.gen[dec] += executed
            self._finish(dec[self.gen[dec] == req.output_len[dec]], now)
        for r, q in segments:
            self.pos[r] += q
            self.prefill_backlog[self.rank[r]] -= q
            if self.pos[r] == req.prompt_len[r]:
                self.prefilling[self.rank[r]].remove(r)
                res.first_token[r] = now
                self.gen[r] = 1
                if req.output_len[r] == 1:
                    self._finish(np.array([r]), now)
                else:
                    self.decoding[r] = True
                    self.decoding_count[self.rank[r]] += 1

    def _finish(self, done: np.ndarray, now: float) -> None:
        if not len(done):
            return
        self.result.finish[done] = now
        groups = self.rank[done]
        np.subtract.at(self.decoding_count, groups[self.decoding[done]], 1)
        self.decoding[done] = False
        np.subtract.at(self.running, groups, 1)
        np.subtract.at(self.kv_used, groups, self.req.prompt_len[done] + self.req.output_len[done])

    # ---- pricing ------------------------------------------------------------------------------------------------

    def _cost_block(self, dec: np.ndarray, segments: list[tuple[int, int]], num_k: int):
        """(total float64[K] seconds per iteration, moe float64[K, L, C], stats {name: int64[K]}).

        Rows: decode request b's input at iteration i is stream position pos[b] + i; a prefill segment's rows are
        the next q prompt positions (a whole prompt in Attention-DP: its counts kept from an earlier block or run,
        `_counted_prompts`). Counted and priced in one compiled call (`CostModel.count_and_price`); where it
        declines, counted by `stream_traffic` and priced by `CostModel.price_arrays` or `CostModel.block`. The
        numbers of the former numpy pricing, bit for bit (tests/test_sim_speed.py, bench/sim_reference.py)."""
        req = self.req
        dec_group = self.rank[dec] if self.dp else np.zeros(len(dec), dtype=np.int64)
        seg_r = np.fromiter((r for r, _ in segments), dtype=np.int64, count=len(segments))
        seg_q = np.fromiter((q for _, q in segments), dtype=np.int64, count=len(segments))
        seg_g = self.rank[seg_r] if self.dp else np.zeros(len(segments), dtype=np.int64)
        prompts = self._counted_prompts(seg_r, seg_q, seg_g) if self.dp and len(segments) else None
        seg_rows = np.ones(len(segments), dtype=np.bool_) if prompts is None else prompts[1]
        rows_N, group_N, home_N, seg5, tokens_K = _block_rows(req.stream, req.stream_start, req.prompt_len, self.pos,
                                                             dec, dec_group, seg_r, seg_q, seg_g, seg_rows, num_k,
                                                             self.groups)
        num_layers = req.experts.shape[1]
        slices = None
        if self.dp:
            home_NL = np.broadcast_to(home_N[:, None], (len(home_N), num_layers))
        else:
            home_NL, slices = self._tp_homes(rows_N, group_N, req.experts[rows_N], num_k)
        has_prefill = np.zeros(num_k, dtype=bool)
        has_prefill[0] = bool(segments)
        fused = self.cost.count_and_price(rows_N, group_N, home_NL, req.experts, self.slot_table, self._device_tables(),
                                          self.spd, self.dpn, seg5, slices, has_prefill,
                                          None if prompts is None else prompts[0])
        if fused is not None:
            total, moe, counted = fused
        else:  # two steps: counting raises a bad row's error, block prices what the compiled kernels decline
            if prompts is not None:  # prompts not counted after all are not kept
                for key in prompts[2]:
                    del self._prompt_cache["index"][key]
            if not seg_rows.all():  # the rows of every prompt, counted with the block
                seg_rows[:] = True
                rows_N, group_N, home_N, _, _ = _block_rows(req.stream, req.stream_start, req.prompt_len, self.pos, dec,
                                                            dec_group, seg_r, seg_q, seg_g, seg_rows, num_k, self.groups)
                home_NL = np.broadcast_to(home_N[:, None], (len(home_N), num_layers))
            traffic, counted = stream_traffic(rows_N, group_N, home_NL, req.experts, self.slot_table,
                                              self._device_tables(), self.spd, num_k, self.dpn)
            priced = self.cost.price_arrays(seg5, traffic, slices, has_prefill)
            if priced is None:
                seg = dict(zip(SEG_KEYS, seg5, strict=True))
                block = self.cost.block(seg, traffic, seg["tokens"] if self.dp else None, slices, has_prefill)
                priced = (block["total"], None, None, block["moe"])
            total, moe = priced[0], priced[3]
        stats = {
            "local_activations": counted[:, 1],
            "total_activations": counted[:, 0],
            "remote_copies": counted[:, 2],
            "tokens": tokens_K,
        }
        return total + self.cfg.iteration_overhead, moe, stats

    def _tp_homes(self, rows_N, group_N, experts_NLk, num_k):
        """(home int64[N, L], slice sizes int64[K, L, D]) from plan.shuffle_steps: per layer, the K iterations'
        tokens in one call (each iteration shuffled within itself, as one plan.shuffle_tokens call would)."""
        num_rows, num_layers, _ = experts_NLk.shape
        home = np.empty((num_rows, num_layers), dtype=np.int64)
        slices = np.zeros((num_k, num_layers, self.devices), dtype=np.int64)
        order = np.argsort(group_N, kind="stable")  # iteration after iteration
        sizes = np.bincount(group_N, minlength=num_k)
        step_of = group_N[order]
        rank_of_slot = np.tile(np.arange(self.devices), num_k)
        token_ids = self.req.token_ids[rows_N[order]]
        experts = experts_NLk[order]
        perms = np.empty((num_layers, num_rows), dtype=np.int64)
        for layer in range(num_layers):
            first = max(0, layer - self.cfg.history)
            prev = experts[:, first:layer] if layer > first else None
            extra = {"current_experts": experts[:, layer]} if self.oracle else {}
            perm, counts = self.plan.shuffle_steps(token_ids, sizes, layer, prev, **extra)
            perm, counts = np.asarray(perm, dtype=np.int64), np.asarray(counts, dtype=np.int64)
            if perm.shape != (num_rows,) or counts.shape != (num_k, self.devices):
                self._bad_shuffle()
            perms[layer], slices[:, layer] = perm, counts
        # checked once for every layer: each iteration's tokens permuted among themselves into even slices
        if num_rows and not (np.array_equal(slices.sum(axis=2), np.broadcast_to(sizes[:, None], (num_k, num_layers)))
                             and slices.min() >= 0 and (slices.max(axis=2) - slices.min(axis=2)).max() <= 1
                             and np.array_equal(np.sort(perms, axis=1), np.broadcast_to(np.arange(num_rows), perms.shape))
                             and np.array_equal(step_of[perms], np.broadcast_to(step_of, perms.shape))):
            self._bad_shuffle()
        ranks = np.repeat(np.tile(rank_of_slot, num_layers), slices.transpose(1, 0, 2).ravel()).reshape(num_layers, -1)
        home[order[perms], np.arange(num_layers)[:, None]] = ranks
        return home, slices

    def _bad_shuffle(self):
        raise ReproError(f"{type(self.plan).__name__}.shuffle_tokens returned no permutation of an iteration's tokens "
                         f"into {self.devices} reduce-scatter slices differing by at most one token; see "
                         "Plan.shuffle_tokens.")

    def _counted_prompts(self, seg_r: np.ndarray, seg_q: np.ndarray, seg_g: np.ndarray):
        """(counted: what CostModel.count_and_price adds to iteration 0, rows_needed bool[S], new keys) for an
        Attention-DP block's prefill segments: a segment that is a whole prompt seen before on the same rank (a
        request stream served again: the rates and probes of a sweep serve the same requests) is counted once more,
        alone, in the compiled call, and kept for later blocks and runs of this engine; the others (first sightings,
        partial chunks, or a full cache) are counted with the block's rows (rows_needed). Memory: L x (2 D + M + P)
        int32 + 3 int64 per kept prompt (8.3 KiB at L = 26, D = 8, P = 64), at most PROMPT_CACHE_BYTES per engine,
        and a set of the (stream, rank) pairs seen (about 100 bytes each)."""
        cache = getattr(self, "_prompt_cache", None)
        num_layers, num_devices = self.slot_table.shape[:2]
        nodes = -(-num_devices // self.dpn)
        width = 2 * num_devices + (nodes if nodes > 1 else 0) + num_devices * self.spd
        if cache is None or cache["slot_table"] is not self.slot_table or cache["requests"] is not self.req:
            capacity = max(1, PROMPT_CACHE_BYTES // (num_layers * width * 4 + 24))
            cache = self._prompt_cache = {"slot_table": self.slot_table, "requests": self.req, "index": {}, "seen": set(),
                                          "capacity": capacity,
                                          "counts": np.zeros((min(capacity, 64), num_layers, width), dtype=np.int32),
                                          "stats": np.zeros((min(capacity, 64), 3), dtype=np.int64)}
        req, index = self.req, cache["index"]
        rows_needed = np.ones(len(seg_r), dtype=np.bool_)
        slots, homes, new = [], [], []
        for j in range(len(seg_r)):
            r, q, g = int(seg_r[j]), int(seg_q[j]), int(seg_g[j])
            if self.pos[r] != 0 or q != req.prompt_len[r]:
                continue
            key = (int(req.stream_start[r]), g)
            slot = index.get(key)
            if slot is None:
                if key not in cache["seen"]:  # kept from its second sighting on: a single run pays nothing
                    cache["seen"].add(key)
                    continue
                if len(index) >= cache["capacity"]:
                    continue
                slot = index[key] = len(index)
                new.append((key, slot, q, g))
            slots.append(slot)
            homes.append(g)
            rows_needed[j] = False
        if len(index) > len(cache["counts"]):
            grow = min(cache["capacity"], max(len(index), 2 * len(cache["counts"]))) - len(cache["counts"])
            cache["counts"] = np.concatenate([cache["counts"], np.zeros((grow,) + cache["counts"].shape[1:], np.int32)])
            cache["stats"] = np.concatenate([cache["stats"], np.zeros((grow, 3), np.int64)])
        miss = np.array([(key[0], q, g, slot) for key, slot, q, g in new], dtype=np.int64).reshape(-1, 4).T
        counted = (cache["counts"], cache["stats"], np.array(slots, dtype=np.int64), np.array(homes, dtype=np.int64),
                   req.stream, np.ascontiguousarray(miss[0]), np.ascontiguousarray(miss[1]),
                   np.ascontiguousarray(miss[2]), np.ascontiguousarray(miss[3]))
        return counted, rows_needed, [key for key, *_ in new]

    def _device_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """traffic.device_tables of the slot table, computed once (2 x 8 bytes per (layer, device, expert))."""
        cached = getattr(self, "_device_tables_LDE", None)
        if cached is None or cached[0] is not self.slot_table:  # a swapped slot table gets its own
            cached = self._device_tables_LDE = (self.slot_table, device_tables(self.slot_table, self.spd))
        return cached[1]


def _experts_in_range(experts_RLk: np.ndarray, num_experts: int) -> bool:
    """engine_loop.experts_in_range, once per experts array and expert count in a process (a scan of the whole
    trace: ~0.2 s for 200 M ids; engines of one run and the runs of a sweep share the array). Kept by identity: an
    array changed in place after a check is not checked again."""
    key = (id(experts_RLk), num_experts)
    known = _CHECKED_EXPERTS.get(key)
    if known is None or known[0]() is not experts_RLk:
        if len(_CHECKED_EXPERTS) > 64:  # drop the entries of arrays gone
            for stale in [k for k, (ref, _) in _CHECKED_EXPERTS.items() if ref() is None]:
                del _CHECKED_EXPERTS[stale]
        known = _CHECKED_EXPERTS[key] = (weakref.ref(experts_RLk),
                                         bool(engine_loop.experts_in_range(experts_RLk, num_experts)))
    return known[1]


_CHECKED_EXPERTS: dict = {}
_PYTHON_COST_BLOCK = Engine._cost_block
# Engine._form and the subclasses' forms engine_loop.serve reproduces: True for DecodeEngine's prefilled admission
COMPILED_FORMS = {Engine._form: False}


class WaitQueues:
    """The ranks' FIFO queues of waiting requests, linked through request ids (what engine_loop reads and pops):
    head, tail, size int64[G] (-1 when empty), next int64[R]. `queues[g]` behaves as a deque (append, popleft, [0],
    len, truth); 8 bytes per request plus 24 per rank."""

    def __init__(self, groups: int, num_requests: int):
        self.head = np.full(groups, -1, dtype=np.int64)
        self.tail = np.full(groups, -1, dtype=np.int64)
        self.size = np.zeros(groups, dtype=np.int64)
        self.next = np.full(num_requests, -1, dtype=np.int64)

    def __getitem__(self, g: int) -> _Queue:
        return _Queue(self, g)

    def __len__(self) -> int:
        return len(self.size)

    def __iter__(self):
        return (_Queue(self, g) for g in range(len(self.size)))


class _Queue:
    """One rank's queue of a WaitQueues."""

    def __init__(self, queues: WaitQueues, g: int):
        self.q, self.g = queues, g

    def append(self, r: int) -> None:
        q, g = self.q, self.g
        if q.size[g]:
            q.next[q.tail[g]] = r
        else:
            q.head[g] = r
        q.tail[g] = r
        q.next[r] = -1
        q.size[g] += 1

    def popleft(self) -> int:
        q, g = self.q, self.g
        if not q.size[g]:
            raise IndexError("pop from an empty queue")
        r = int(q.head[g])
        q.size[g] -= 1
        q.head[g] = q.next[r] if q.size[g] else -1
        if not q.size[g]:
            q.tail[g] = -1
        return r

    def __getitem__(self, i: int) -> int:
        if i != 0 or not self.q.size[self.g]:
            raise IndexError("a wait queue reads only its head")
        return int(self.q.head[self.g])

    def __len__(self) -> int:
        return int(self.q.size[self.g])

    def __bool__(self) -> bool:
        return bool(self.q.size[self.g])


@dataclass(frozen=True)
class _Migration:
    """A change that began: the change and its record so far (RunResult.changes)."""

    change: PlanChange
    record: dict
