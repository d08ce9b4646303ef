"""Sem-MoE (arXiv 2503.04398): balanced token-expert co-clustering offline, plus two online schedulers.

One file per algorithm, each readable on its own (its docstring has the shape legend and the method):
  cocluster.py  Algorithm 1, offline: balanced token-expert co-clustering -> expert placement.
  dp.py         Algorithm 2, Attention-DP: request scoring and the round-robin dev_mask assignment, online
                or jointly per mask window (batch_window, looks ahead); the time-aware online scheduler
                that balances queued tokens instead of request counts (dp_scheduler=time); and the load-aware one
                that reads the engine's live state (dp_scheduler=load, the configured default).
  tp.py         Algorithm 3, online Attention-TP: predicted device per token and the align to equal slices.
  system.py     `SemMoE` (fit: Algorithm 1 on a profile, then the online tables) and `SemMoEPlan`.

Every public name is re-exported here, so `from repro.systems.semmoe import X` works for all of them.
"""

from repro.systems.semmoe.cocluster import (
    SEARCH_CELLS,
    CoclusterResult,
    SparseAffinity,
    assign_units,
    balanced_cocluster,
    capacity_assign,
    check_cocluster_args,
    coclustering_objective,
    kick_units,
    perturb_units,
    place_experts,
    polish_units,
    refine_cocluster,
    swap_random_experts,
)
from repro.systems.semmoe.dp import (
    DP_ASSIGNS,
    DP_SCHEDULERS,
    DP_SCORINGS,
    LEGACY_DP_ASSIGNS,
    VOTE_CHUNK_TOKENS,
    fold_dp_scores,
    load_aware_assign,
    masked_argmax_assign,
    packed_prompts,
    request_scores,
    request_votes,
    token_balance_assign,
    window_exact_assign,
    window_lookahead,
)
from repro.systems.semmoe.system import CLUSTER_UNITS, SemMoE, SemMoEPaper, SemMoEPlan
from repro.systems.semmoe.tp import align_to_slices, inverse_permutation, predict_devices

__all__ = [
    "CLUSTER_UNITS",
    "DP_ASSIGNS",
    "DP_SCHEDULERS",
    "DP_SCORINGS",
    "LEGACY_DP_ASSIGNS",
    "SEARCH_CELLS",
    "VOTE_CHUNK_TOKENS",
    "CoclusterResult",
    "SemMoE",
    "SemMoEPaper",
    "SemMoEPlan",
    "SparseAffinity",
    "align_to_slices",
    "assign_units",
    "balanced_cocluster",
    "capacity_assign",
    "check_cocluster_args",
    "coclustering_objective",
    "fold_dp_scores",
    "inverse_permutation",
    "kick_units",
    "load_aware_assign",
    "masked_argmax_assign",
    "packed_prompts",
    "perturb_units",
    "place_experts",
    "polish_units",
    "predict_devices",
    "refine_cocluster",
    "request_scores",
    "request_votes",
    "swap_random_experts",
    "token_balance_assign",
    "window_exact_assign",
    "window_lookahead",
]
