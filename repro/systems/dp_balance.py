"""The Attention-DP load balancers engines ship, as systems: vanilla EP placement, each request sent to the rank
a load rule picks from the engine's live state at its arrival (repro/systems/load.py has the rules and sources).

    system=shortest_queue   SGLang --load-balance-method shortest_queue (running + waiting requests)
    system=minimum_tokens   SGLang minimum_tokens (KV tokens in use + queued prefill tokens)
    system=vllm_dp          vLLM's DP load balancing (4 x waiting + running)
    system=balance_route    BalanceRoute BR-0-style (KV and per-iteration token utilisation, safe margin)
    system=gimbal           Gimbal-style (arXiv 2606.15177): a rank's per-iteration tokens plus its expert
                            pressure, i.e. the share of every rank's tokens its experts serve (profile expert
                            load of the placement), so a rank hosting hot experts takes fewer requests
    system=least_wait       the suite's `wait` rule (iterations before the first token, running cap included):
                            the locality-free twin of Sem-MoE's load-aware scheduler (dp_scheduler=load)
    system=round_robin      today's `ep` (no state read)

No locality term: these are what a locality-free router with the engine's view reaches, the reference for what
Sem-MoE's affinity adds (repro.figures.gain_split). Without a live view (the offline evaluator) a plan reads what
it handed out itself (`HandedOut`).

Legend: D ranks, L MoE layers, E experts.
"""

from __future__ import annotations

import numpy as np

from repro.errors import ReproError
from repro.parallel import ParallelConfig
from repro.systems.base import Placement, Plan
from repro.systems.ep import contiguous_placement
from repro.systems.eplb import device_load, expert_activation_counts
from repro.systems.load import HandedOut, RankLoad, check_rule, rank_load
from repro.traces import RoutingTrace

BALANCERS = {
    "shortest_queue": "shortest_queue",
    "minimum_tokens": "minimum_tokens",
    "vllm_dp": "vllm",
    "balance_route": "balance_route",
    "gimbal": "gimbal",
    "least_wait": "wait",
}


def expert_pressure(placement: Placement, expert_load: np.ndarray) -> np.ndarray:
    """float64[D] each device's share of the expected expert activations over all layers (sums to 1).

    expert_load float[L, E] activations per expert on the profile; replicas split an expert's load evenly."""
    per_device = device_load(expert_load.astype(np.float64), placement).sum(axis=0)
    return per_device / max(per_device.sum(), 1e-30)


def gimbal_load(view: RankLoad, pressure: np.ndarray, prompt_len: int) -> np.ndarray:
    """float64[D] per-rank work of the next iteration, in token units, if the request joins rank d: the rank's own
    tokens (decodes + queued prefill up to the budget, + this prompt) plus pressure[d] x every rank's tokens (the
    expert rows its devices serve, divided by k). pressure float64[D] from `expert_pressure`."""
    own = np.minimum(view.decoding + view.queued_prefill_tokens, view.max_batched_tokens).astype(np.float64)
    total = own.sum()
    joined = np.minimum(own + prompt_len, view.max_batched_tokens)
    return joined + pressure * (total + (joined - own))


class LoadBalancedPlan(Plan):
    """Vanilla placement; each request to the rank of least load under `rule` (ties: lowest id)."""

    reads_load = True

    def __init__(self, placement: Placement, parallel: ParallelConfig, rule: str, decode_tokens: float,
                 pressure: np.ndarray | None = None, info: dict | None = None):
        self.rule = rule if rule == "gimbal" else check_rule(rule)
        self.decode_tokens = float(decode_tokens)
        self.pressure = pressure
        super().__init__(placement, parallel, {**(info or {}), "dp_load_rule": rule})

    def reset(self) -> None:
        super().reset()
        self.handed_out = HandedOut(self.parallel.devices, max_batched_tokens=self.parallel.tokens_per_step)

    def assign_requests(self, token_ids: np.ndarray, offsets: np.ndarray, prefill_len: np.ndarray,
                        load: RankLoad | None = None) -> np.ndarray:
        """int64[R]; with a live `load` view R must be 1 (the view describes one arrival)."""
        prefill_len = np.asarray(prefill_len, dtype=np.int64)
        if load is not None and len(prefill_len) != 1:
            raise ReproError(f"a live load view describes one arrival; got {len(prefill_len)} requests with it.")
        ranks = np.empty(len(prefill_len), dtype=np.int64)
        for r, prompt in enumerate(prefill_len.tolist()):
            view = load if load is not None else self.handed_out.view()
            request_tokens = int(prompt + self.decode_tokens)
            if self.rule == "gimbal":
                cost = gimbal_load(view, self.pressure, prompt)
            else:
                cost = rank_load(view, self.rule, prompt, request_tokens)
            ranks[r] = int(np.argmin(cost))
            if load is None:  # with a live view the plan's own count is never read
                self.handed_out.add(int(ranks[r]), prompt, request_tokens)
        return ranks


class LoadBalancedEP:
    """Vanilla EP placement with a load-aware DP rank choice; subclasses name the rule (`BALANCERS`)."""

    name = "shortest_queue"

    def fit(self, profile: RoutingTrace, parallel: ParallelConfig, rng: np.random.Generator) -> Plan:
        parallel.check_experts(profile.meta.num_experts)
        placement = contiguous_placement(profile.num_layers, profile.meta.num_experts, parallel.devices)
        generated = profile.lengths() - np.asarray(profile.prefill_len)
        decode_tokens = float(generated.mean()) if len(generated) else 0.0
        rule = BALANCERS[self.name]
        pressure = expert_pressure(placement, expert_activation_counts(profile)) if rule == "gimbal" else None
        return LoadBalancedPlan(placement, parallel, rule, decode_tokens, pressure)


class ShortestQueue(LoadBalancedEP):
    name = "shortest_queue"


class MinimumTokens(LoadBalancedEP):
    name = "minimum_tokens"


class VllmDP(LoadBalancedEP):
    name = "vllm_dp"


class BalanceRoute(LoadBalancedEP):
    name = "balance_route"


class Gimbal(LoadBalancedEP):
    name = "gimbal"


class LeastWait(LoadBalancedEP):
    name = "least_wait"
