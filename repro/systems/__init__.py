"""Systems: one file each, chosen by name from the config (`system=ep`, `system=semmoe`, ...)."""

from __future__ import annotations

import importlib
import inspect

from repro.errors import ConfigError
from repro.systems.base import Placement, Plan, System, even_counts

# name -> "module:Class"; imported lazily so a system's heavy dependencies load only when used
REGISTRY: dict[str, str] = {
    "ep": "repro.systems.ep:VanillaEP",
    "round_robin": "repro.systems.ep:VanillaEP",  # the same system under the name SGLang gives its DP rule
    # the load balancers engines ship (vanilla EP placement, DP rank from the engine's live state): dp_balance.py
    "shortest_queue": "repro.systems.dp_balance:ShortestQueue",
    "minimum_tokens": "repro.systems.dp_balance:MinimumTokens",
    "vllm_dp": "repro.systems.dp_balance:VllmDP",
    "balance_route": "repro.systems.dp_balance:BalanceRoute",
    "gimbal": "repro.systems.dp_balance:Gimbal",
    "least_wait": "repro.systems.dp_balance:LeastWait",  # Sem-MoE dp_scheduler=load's load rule without affinity
    "semmoe": "repro.systems.semmoe:SemMoE",
    # the paper's Attention-DP scheduler (Algorithm 2) for the reproduction verdict; semmoe defaults to dp_scheduler=load
    "semmoe_paper": "repro.systems.semmoe:SemMoEPaper",
    # beyond the paper: r extra slots per device filled by co-clustering, or with the hottest experts (baseline)
    "semmoe_replicated": "repro.systems.semmoe.replicate:SemMoEReplicated",
    "semmoe_hottest": "repro.systems.semmoe.replicate:SemMoEHottest",
    # beyond the paper: multi-node co-clustering, by node first, then by device inside each node
    "semmoe_hierarchical": "repro.systems.semmoe.system:SemMoEHierarchical",
    "semmoe_exact": "repro.systems.milp:SemMoEExact",
    # beyond the paper: Attention-DP decode rank chosen after prefill by the request's observed expert signature
    "signature": "repro.systems.signature:SignatureDecode",
    "signature_eldr": "repro.systems.signature:SignatureELDR",
    "moetuner": "repro.systems.moetuner:MoETuner",
    "eplb": "repro.systems.eplb:EPLB",
    # kind "bound": proven LAR ceilings (oracle.py, dp_bound.py); kind "hindsight": fitted on the evaluated
    # routing, neither deployable nor a ceiling (fit_assign.py)
    "token_oracle": "repro.systems.oracle:TokenOracle",
    "dp_bound": "repro.systems.dp_bound:DPBound",
    "fit_assign": "repro.systems.fit_assign:FitAssign",
    "fit_assign_time": "repro.systems.fit_assign:FitAssignTime",  # its time variant (token balance + load cap)
}


def make_system(name: str, **params) -> System:
    """Instantiate the system registered as `name` with its config parameters."""
    if name not in REGISTRY:
        raise ConfigError(f"unknown system {name!r}; choose one of {sorted(REGISTRY)}.")
    module, cls_name = REGISTRY[name].split(":")
    cls = getattr(importlib.import_module(module), cls_name)
    accepted = inspect.signature(cls).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        unknown = sorted(set(params) - set(accepted))
        if unknown:
            raise ConfigError(f"system {name!r} has no parameter(s) {unknown}; its parameters are {sorted(accepted)}.")
    return cls(**params)


__all__ = ["REGISTRY", "Placement", "Plan", "System", "even_counts", "make_system"]
