"""The Sem-MoE system (arXiv 2503.04398): `SemMoE` fits Algorithm 1 on a profile and builds a `SemMoEPlan`,
which serves Algorithm 2 (Attention-DP, `assign_requests`) and Algorithm 3 (Attention-TP, `shuffle_tokens`).

Legend: L MoE layers, E experts per layer (the paper's N), D devices = EP ranks (the paper's E), t distinct
profiled token ids (table rows; row t is the OOV fallback row), u clustering units (token rows or profile
requests), R requests, N tokens, T tokens in one TP step, k experts per token, h lookback layers,
Q = D**h device histories, V vocabulary size.

Units of the co-clustering depend on the attention mode: under Attention-TP every layer clusters token ids
on its own (token level, per-layer choice, as in the paper's L); under Attention-DP a request lives on one
rank for all layers, so profile requests are clustered once and shared by every layer's expert placement
(otherwise device labels would disagree between layers and a request could be local in one layer only).
Only the `max_units` heaviest units enter the solver (8192 token rows cover ~70 % of a 512k-token profile's
load and lose no LAR on the planted bench). The plan's tables: T / T_p per layer and token row (the device
hosting most of the token's routed mass and that share), the folded DP score table, and the Markov table
A / A_p over device histories (repro.affinity.tables.device_markov_table).
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from repro.affinity.tables import (
    add_pair_counts,
    check_markov_size,
    device_markov_table,
    device_mass_from_counts,
    profile_chunks,
    profile_tokens,
    profile_vocab,
    sample_profile_requests,
    token_device_counts,
    vocab_row_map,
)
from repro.errors import ConfigError, ReproError, TraceError
from repro.parallel import ParallelConfig
from repro.systems.base import Placement, Plan
from repro.systems.load import HandedOut, RankLoad, check_rule, rank_load
from repro.systems.semmoe.cocluster import (
    CoclusterResult,
    SparseAffinity,
    balance_expert_load,
    balanced_cocluster,
    check_expert_load_cap,
)
from repro.systems.semmoe.dp import (
    DP_ASSIGNS,
    DP_SCHEDULERS,
    DP_SCORINGS,
    LEGACY_DP_ASSIGNS,
    fold_dp_scores,
    load_aware_assign,
    masked_argmax_assign,
    request_scores,
    request_votes,
    slack_argmax,
    token_balance_assign,
    window_exact_assign,
    window_lookahead,
)
from repro.systems.semmoe.predictor import DP_PREDICTORS, fit_request_predictor, learned_request_scores
from repro.systems.semmoe.topology import hierarchical_cocluster
from repro.systems.semmoe.tp import align_steps_to_slices, predict_devices
from repro.traces import RoutingTrace

CLUSTER_UNITS = ("auto", "tokens", "requests")


@dataclass(frozen=True)
class UnitGroup:
    """One co-clustering instance: the MoE layers it covers, its affinity float[L', u, E] (`SparseAffinity`),
    unit_load float[u] and the solution's unit_cluster int64[u] (device of each unit)."""

    layers: tuple[int, ...]
    affinity: SparseAffinity
    unit_load: np.ndarray
    unit_cluster: np.ndarray


class SemMoEPlan(Plan):
    """Sem-MoE placement plus the DP request scheduler and the TP token reshuffler.

    Tables: token_vocab int32[t]; row_of_token int32[V]; token_device int16[L, t+1] (T) and token_confidence
    float32[L, t+1] (T_p), row t = OOV fallback (expert popularity); dp_score float32[t+1, D];
    markov_device int16[L, Q] (A) and markov_confidence float32[L, Q] (A_p, on T_p's scale: the token
    confidence below which A wins; see `device_markov_table`), or None when lookback = 0.
    dp_assign: "online" (decided at arrival; with load_aware_lambda > 0 also pricing queued prompt tokens) or
    "batch_window" (each mask window assigned jointly, dp_token_price on queued tokens; info reports the
    look-ahead as dp_lookahead_requests_max / _mean); see repro.systems.semmoe.dp. These are dp_scheduler
    "paper" (Algorithm 2's round-robin mask); dp_scheduler "time" balances tokens instead (`token_balance_assign`:
    score - dp_balance_weight x queued-token excess, each request counting its prompt plus dp_decode_tokens).
    """

    def __init__(
        self,
        placement: Placement,
        parallel: ParallelConfig,
        token_vocab: np.ndarray,
        row_of_token: np.ndarray,
        token_device: np.ndarray,
        token_confidence: np.ndarray,
        dp_score: np.ndarray,
        markov_device: np.ndarray | None = None,
        markov_confidence: np.ndarray | None = None,
        lookback: int = 2,
        load_aware_lambda: float = 0.0,
        dp_window: int = 1,
        dp_scoring: str = "confidence",
        token_frequency: np.ndarray | None = None,
        info: dict | None = None,
        dp_assign: str = "online",
        dp_token_price: float = 0.0,
        dp_scheduler: str = "paper",
        dp_balance_weight: float = 0.0,
        dp_decode_tokens: float = 0.0,
        dp_predictor: str = "tables",
        learned_table: np.ndarray | None = None,
        learned_prior: np.ndarray | None = None,
        dp_load_rule: str = "wait",
        dp_load_slack: float = 1.0,
    ):
        if dp_predictor not in DP_PREDICTORS or (dp_predictor == "learned") != (learned_table is not None):
            raise ConfigError(
                f"dp_predictor must be one of {DP_PREDICTORS} and 'learned' comes with its fitted table, got "
                f"{dp_predictor!r} with{'out' if learned_table is None else ''} a table; refit the plan."
            )
        self.dp_predictor, self.learned_table, self.learned_prior = dp_predictor, learned_table, learned_prior
        if dp_assign not in DP_ASSIGNS:
            raise ConfigError(f"dp_assign must be one of {DP_ASSIGNS}, got {dp_assign!r}.")
        if dp_scheduler not in DP_SCHEDULERS:
            raise ConfigError(f"dp_scheduler must be one of {DP_SCHEDULERS}, got {dp_scheduler!r}.")
        self.dp_scheduler = dp_scheduler
        self.dp_balance_weight, self.dp_decode_tokens = float(dp_balance_weight), float(dp_decode_tokens)
        self.dp_load_rule, self.dp_load_slack = check_rule(dp_load_rule), float(dp_load_slack)
        self.reads_load = dp_scheduler == "load"  # the engine's live state reaches assign_requests
        self.dp_window = int(dp_window)
        self.dp_scoring = dp_scoring
        self.dp_assign, self.dp_token_price = dp_assign, float(dp_token_price)
        # "expected" score rows sum to the number of layers (device mass per layer); votes sum to <= 1
        self._gain_scale = 1.0 / max(token_device.shape[0], 1) if dp_scoring == "expected" else 1.0
        self.token_vocab = token_vocab
        self.row_of_token = row_of_token
        self.token_device = token_device
        self.token_confidence = token_confidence
        self.dp_score = dp_score
        self.markov_device = markov_device
        self.markov_confidence = markov_confidence
        self.lookback = int(lookback) if markov_device is not None else 0
        self.load_aware_lambda = float(load_aware_lambda)
        self._expert_device = placement.expert_device()
        # "vote" / "confidence": each vocabulary id casts one vote for the top device of its folded score row
        # (weight: the row's top share for "confidence", 1 for "vote"; 0 for rows without any score, e.g. OOV)
        top = np.argmax(dp_score, axis=1)
        top_score = dp_score[np.arange(len(dp_score)), top]
        row_total = dp_score.sum(axis=1)
        weight = top_score / np.maximum(row_total, 1e-30) if dp_scoring == "confidence" else (row_total > 0).astype(np.float32)
        self._vocab_device = top.astype(np.int64)[row_of_token]
        self._vocab_weight = weight.astype(np.float64)[row_of_token]
        # the score of the average profile token: subtracted so a request is placed by what sets it apart,
        # not by the devices that every request leans to (hot experts of stop words, punctuation, ...)
        self.token_frequency = token_frequency
        self.dp_prior = np.zeros(parallel.devices)
        if token_frequency is not None and token_frequency.sum() > 0:
            share = token_frequency / token_frequency.sum()
            if dp_scoring == "expected":
                self.dp_prior = share @ dp_score.astype(np.float64)
            else:
                self.dp_prior = np.bincount(top, weights=share * weight, minlength=parallel.devices)
        super().__init__(placement, parallel, info)
        # a topology-aware plan aligns by node first (an overflowing token stays on its node when it can)
        self.align_devices_per_node = parallel.devices_per_node if self.info.get("hierarchical") else None

    def reset(self) -> None:
        super().reset()
        self._position = 0
        self._taken = np.zeros(self.parallel.devices, dtype=np.int64)
        self._queued = np.zeros(self.parallel.devices, dtype=np.float64)
        self._assigned_requests = 0
        self._handed_out = HandedOut(self.parallel.devices, max_batched_tokens=self.parallel.tokens_per_step)
        self._lookahead_total = 0
        self.info["dp_lookahead_requests_max"] = 0
        self.info["dp_lookahead_requests_mean"] = 0.0
        self.info["align_moved_tokens"] = 0
        self.info["shuffled_tokens"] = 0
        self.info["align_moved_share"] = 0.0

    def _check_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        token_ids = np.asarray(token_ids)
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= len(self.row_of_token)):
            raise TraceError(
                f"token id {int(token_ids.max())} is outside the plan's vocabulary of {len(self.row_of_token)} ids; "
                "fit the plan on a profile of the same model."
            )
        return token_ids

    def assign_requests(self, token_ids: np.ndarray, offsets: np.ndarray, prefill_len: np.ndarray,
                        load: RankLoad | None = None) -> np.ndarray:
        """int64[R] DP rank per request (Algorithm 2); requests stay on their rank for decode.

        load: the ranks' live state at this arrival (one request per call then), read by dp_scheduler "load"
        only; without it that scheduler reads what the plan handed out itself."""
        if load is not None and len(prefill_len) != 1:
            raise ReproError(f"a live load view describes one arrival; got {len(prefill_len)} requests with it.")
        one_vote = len(prefill_len) == 1 and self.dp_predictor != "learned" and self.dp_scoring != "expected"
        if not one_vote:  # the one-request vote checks its ids in its compiled pass
            token_ids = self._check_tokens(token_ids)
        if self.dp_predictor == "learned":  # repro.systems.semmoe.predictor: prior already subtracted
            scores = learned_request_scores(
                self.learned_table, self.learned_prior, self.row_of_token, token_ids, offsets, prefill_len
            )
        elif self.dp_scoring == "expected":
            scores = request_scores(self.dp_score, self.row_of_token, token_ids, offsets, prefill_len)
        else:
            scores = request_votes(
                self._vocab_device, self._vocab_weight, token_ids, offsets, prefill_len, self.parallel.devices
            )
        if len(scores) == 0:
            return np.zeros(0, dtype=np.int64)
        prompt_len = np.asarray(prefill_len, dtype=np.float64)
        if self.dp_assign == "batch_window":
            # gain: the request's expected local activations per layer (tokens), without the prior: a per-rank
            # constant cancels inside a window, and prior x prompt length would not
            if self.dp_predictor == "learned":  # the predicted shares themselves (no prior), as for the tables
                scores = scores + self.learned_prior.astype(np.float32)
            gain = scores * (prompt_len * self._gain_scale)[:, None]
            lookahead = window_lookahead(len(gain), self._position, self.dp_window * self.parallel.devices)
            ranks, self._position, self._taken, self._queued = window_exact_assign(
                gain, prompt_len, self._position, self._taken, self._queued, self.dp_window, self.dp_token_price
            )
            self._lookahead_total += int(lookahead.sum())
            self.info["dp_lookahead_requests_max"] = max(self.info["dp_lookahead_requests_max"], int(lookahead.max()))
            self.info["dp_lookahead_requests_mean"] = self._lookahead_total / (self._assigned_requests + len(ranks))
            self._assigned_requests += len(ranks)
            return ranks
        # online: request r's rank depends on its own prompt and the requests before it only
        if self.dp_predictor == "tables":
            scores = scores - self.dp_prior.astype(np.float32)
        if self.dp_scheduler == "load":
            return self._load_assign(scores, prompt_len, load)
        if self.dp_scheduler == "time":
            ranks, self._queued, self._assigned_requests = token_balance_assign(
                scores, prompt_len + self.dp_decode_tokens, self._queued, self._assigned_requests,
                self.dp_balance_weight,
            )
            return ranks
        if self.load_aware_lambda > 0:
            ranks, self._position, self._taken, self._queued, self._assigned_requests = load_aware_assign(
                scores, prompt_len, self._position, self._taken, self._queued, self._assigned_requests,
                self.dp_window, self.load_aware_lambda,
            )
            return ranks
        ranks, self._position, self._taken = masked_argmax_assign(scores, self._position, self._taken, self.dp_window)
        self._assigned_requests += len(ranks)
        return ranks

    def _load_assign(self, scores: np.ndarray, prompt_len: np.ndarray, load: RankLoad | None) -> np.ndarray:
        """int64[R]: `slack_argmax` of each request's scores over its load under dp_load_rule, in arrival order."""
        ranks = np.empty(len(scores), dtype=np.int64)
        for r, prompt in enumerate(prompt_len.astype(np.int64).tolist()):
            view = load if load is not None else self._handed_out.view()
            request_tokens = int(prompt + self.dp_decode_tokens)
            cost = rank_load(view, self.dp_load_rule, prompt, request_tokens)
            ranks[r] = slack_argmax(scores[r], cost, self.dp_load_slack)
            if load is None:  # with a live view the plan's own count is never read
                self._handed_out.add(int(ranks[r]), prompt, request_tokens)
        self._assigned_requests += len(ranks)
        return ranks

    def predicted_devices(
        self, token_ids: np.ndarray, layer: int, prev_experts: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(device int64[T], confidence float32[T]): T / T_p, or A / A_p where the Markov table is more confident
        (`repro.systems.semmoe.tp.predict_devices`); prev_experts int[T, h', k] chronological."""
        rows = self.row_of_token[self._check_tokens(token_ids)]
        return predict_devices(
            rows, layer, prev_experts, self.token_device, self.token_confidence, self.markov_device,
            self.markov_confidence, self._expert_device, self.lookback, self.parallel.devices,
        )

    def shuffle_tokens(
        self, token_ids: np.ndarray, layer: int, prev_experts: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(permutation int64[T], counts int64[D]) for the shuffled reduce-scatter before MoE layer `layer`."""
        permutation, counts = self.shuffle_steps(token_ids, [len(token_ids)], layer, prev_experts)
        return permutation, counts[0]

    def shuffle_steps(
        self, token_ids: np.ndarray, step_sizes: np.ndarray, layer: int, prev_experts: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """shuffle_tokens of S steps in one call (Plan.shuffle_steps; the same numbers): a token's predicted device
        depends on the token alone, and align_steps_to_slices aligns every step within itself."""
        device, confidence = self.predicted_devices(token_ids, layer, prev_experts)
        permutation, counts, moved = align_steps_to_slices(device, confidence, step_sizes, self.parallel.devices,
                                                           self.align_devices_per_node)
        self.info["align_moved_tokens"] += moved
        self.info["shuffled_tokens"] += len(device)
        self.info["align_moved_share"] = self.info["align_moved_tokens"] / max(self.info["shuffled_tokens"], 1)
        return permutation, counts

    def write_files(self, directory: Path) -> None:
        """Placement and info (base), plus every table as .npy (no pickle) and the scalars as semmoe.json."""
        super().write_files(directory)
        directory = Path(directory)
        tables = {
            "token_vocab": self.token_vocab,
            "row_of_token": self.row_of_token,
            "token_device": self.token_device,
            "token_confidence": self.token_confidence,
            "dp_score": self.dp_score,
            "token_frequency": self.token_frequency,
            "learned_table": self.learned_table,
            "learned_prior": self.learned_prior,
        }
        if self.markov_device is not None:
            tables.update(markov_device=self.markov_device, markov_confidence=self.markov_confidence)
        for name, array in tables.items():
            if array is None:
                continue
            np.save(directory / f"{name}.npy", np.ascontiguousarray(array), allow_pickle=False)
        scalars = {
            "lookback": self.lookback,
            "load_aware_lambda": self.load_aware_lambda,
            "dp_window": self.dp_window,
            "dp_scoring": self.dp_scoring,
            "dp_assign": self.dp_assign,
            "dp_token_price": self.dp_token_price,
            "dp_scheduler": self.dp_scheduler,
            "dp_balance_weight": self.dp_balance_weight,
            "dp_decode_tokens": self.dp_decode_tokens,
            "dp_predictor": self.dp_predictor,
            "dp_load_rule": self.dp_load_rule,
            "dp_load_slack": self.dp_load_slack,
        }
        (directory / "semmoe.json").write_text(json.dumps(scalars))

    @classmethod
    def load(cls, directory: str | Path, parallel: ParallelConfig, num_experts: int) -> SemMoEPlan:
        """Read a plan written by `save` (arrays with allow_pickle=False)."""
        directory = Path(directory)

        def read(name: str):
            path = directory / f"{name}.npy"
            return np.load(path, allow_pickle=False) if path.exists() else None

        try:
            scalars = json.loads((directory / "semmoe.json").read_text())
            info = json.loads((directory / "plan_info.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{directory} does not hold a saved Sem-MoE plan ({e}); write one with plan.save().") from e
        placement = Placement.load(directory, parallel.devices, num_experts)
        return cls(
            placement, parallel, read("token_vocab"), read("row_of_token"), read("token_device"),
            read("token_confidence"), read("dp_score"), read("markov_device"), read("markov_confidence"),
            scalars["lookback"], scalars["load_aware_lambda"], scalars["dp_window"], scalars["dp_scoring"],
            read("token_frequency"), info, _saved_dp_assign(scalars), scalars.get("dp_token_price", 0.0),
            scalars.get("dp_scheduler", "paper"), scalars.get("dp_balance_weight", 0.0),
            scalars.get("dp_decode_tokens", 0.0), scalars.get("dp_predictor", "tables"), read("learned_table"),
            read("learned_prior"), scalars.get("dp_load_rule", "wait"), scalars.get("dp_load_slack", 1.0),
        )


def _saved_dp_assign(scalars: dict) -> str:
    """The dp_assign of a saved plan's semmoe.json, old option names mapped to today's (`LEGACY_DP_ASSIGNS`).

    Plans saved before the option existed ran the in-order masked argmax ("online"), and so did an old
    "exact" plan with load_aware_lambda > 0 (the load-aware path took precedence).
    """
    name = scalars.get("dp_assign", "online")
    if name == "exact" and scalars.get("load_aware_lambda", 0.0) > 0:
        return "online"
    return LEGACY_DP_ASSIGNS.get(name, name)


class SemMoE:
    """Sem-MoE: co-clustered placement (cocluster.py) + Algorithm 2 (DP, dp.py) + Algorithm 3 (TP, tp.py).

    cluster_units: "auto" (token rows per layer under Attention-TP, profile requests shared by all layers
    under Attention-DP), or force "tokens" / "requests". prompt_only: profile prompt tokens only (the paper
    profiles prompts). embeddings_path: optional .npy float[V, H] input-embedding matrix for the
    nearest-neighbour OOV fallback (without it unseen ids use each layer's expert popularity). dp_assign:
    "online" (default: the paper's Algorithm 2, each request decided at arrival; load_aware_lambda is its
    queued-token price) or "batch_window" (each mask window assigned jointly, looking ahead up to
    dp_window x D - 1 requests; dp_token_price is its queued-token price). A price of the other mode is refused.
    These are dp_scheduler "paper" (Algorithm 2's mask); dp_scheduler "time" (beyond the paper) balances queued
    tokens online with weight dp_balance_weight, a request counting its prompt plus dp_decode_tokens (None: the
    profile's mean generated tokens per request); see repro.systems.semmoe.dp.
    hierarchical: on several nodes (parallel.devices_per_node < D), co-cluster by node first, then by device
    inside each node (repro.systems.semmoe.topology); no effect on one node.
    expert_load_cap (beyond the paper; None = off): after each group's co-clustering, experts of a layer swap
    devices until the busiest device's profile expert load is <= cap x the mean, losing the least local mass
    (`balance_expert_load`; swaps stay inside a node when hierarchical); plan.info reports the swaps and the
    profile's expert load max/mean before and after.
    profile_tokens (None = all): fit on a seeded sample of whole profile requests holding at most this many
    profiled tokens (`sample_profile_requests`, seed 0), for profiles larger than the fit needs; plan.info
    reports profile_sampled_tokens whenever it is set.
    """

    name = "semmoe"

    def __init__(
        self,
        theta: float = 0.5,
        alpha: float = 1.0,
        beta: float = 1.0,
        gamma: float = 1.0,
        n_steps: int = 8,
        ft_steps: int = 64,
        lookback: int = 2,
        dp_scoring: str = "confidence",
        load_aware_lambda: float = 0.0,
        dp_window: int = 1,
        dp_assign: str = "online",
        dp_token_price: float = 0.0,
        max_units: int = 8192,
        price_iters: int = 12,
        exact_expert_step: bool = True,
        n_starts: int = 4,
        polish_rounds: int = 64,
        polish_kicks: int = 32,
        cluster_units: str = "auto",
        prompt_only: bool = False,
        embeddings_path: str | None = None,
        hierarchical: bool = False,
        dp_scheduler: str = "paper",
        dp_balance_weight: float = 0.0,
        dp_decode_tokens: float | None = None,
        expert_load_cap: float | None = None,
        dp_predictor: str = "tables",
        profile_tokens: int | None = None,
        dp_load_rule: str = "wait",
        dp_load_slack: float = 1.0,
    ):
        if profile_tokens is not None and int(profile_tokens) < 1:
            raise ConfigError(f"system.params.profile_tokens must be null (the whole profile) or >= 1, got {profile_tokens}.")
        self.profile_tokens = None if profile_tokens is None else int(profile_tokens)
        if not 0.0 < float(theta) < 1.0:
            raise ConfigError(f"system.params.theta must be strictly between 0 and 1, got {theta}.")
        if min(alpha, beta, gamma) < 0:
            raise ConfigError(f"system.params alpha, beta, gamma must be >= 0, got {alpha}, {beta}, {gamma}.")
        if int(n_steps) < 1 or int(ft_steps) < 0 or int(price_iters) < 1:
            raise ConfigError(
                f"system.params.n_steps and price_iters must be >= 1 and ft_steps >= 0, got {n_steps}, {price_iters}, {ft_steps}."
            )
        if int(n_starts) < 1:
            raise ConfigError(f"system.params.n_starts must be >= 1, got {n_starts}.")
        if int(polish_rounds) < 0 or int(polish_kicks) < 0:
            raise ConfigError(
                f"system.params.polish_rounds and polish_kicks must be >= 0 (0 = off), got {polish_rounds}, {polish_kicks}."
            )
        if int(lookback) < 0:
            raise ConfigError(f"system.params.lookback must be >= 0, got {lookback}.")
        if dp_scoring not in DP_SCORINGS:
            raise ConfigError(f"system.params.dp_scoring must be one of {DP_SCORINGS}, got {dp_scoring!r}.")
        if load_aware_lambda < 0:
            raise ConfigError(f"system.params.load_aware_lambda must be >= 0, got {load_aware_lambda}.")
        if int(max_units) < 1:
            raise ConfigError(f"system.params.max_units must be >= 1, got {max_units}.")
        if dp_assign not in DP_ASSIGNS:
            renamed = f" ({dp_assign!r} is now {LEGACY_DP_ASSIGNS[dp_assign]!r})" if dp_assign in LEGACY_DP_ASSIGNS else ""
            raise ConfigError(f"system.params.dp_assign must be one of {DP_ASSIGNS}, got {dp_assign!r}{renamed}.")
        if float(dp_token_price) < 0:
            raise ConfigError(f"system.params.dp_token_price must be >= 0, got {dp_token_price}.")
        if dp_assign == "online" and float(dp_token_price) > 0:
            raise ConfigError(
                f"system.params.dp_token_price={dp_token_price} prices queued tokens in dp_assign=batch_window only; "
                "the online assignment's queued-token price is load_aware_lambda (or set dp_assign=batch_window)."
            )
        if dp_assign == "batch_window" and load_aware_lambda > 0:
            raise ConfigError(
                f"system.params.load_aware_lambda={load_aware_lambda} prices queued tokens in dp_assign=online only; "
                "batch_window's queued-token price is dp_token_price (or set dp_assign=online)."
            )
        if dp_scheduler not in DP_SCHEDULERS:
            raise ConfigError(f"system.params.dp_scheduler must be one of {DP_SCHEDULERS}, got {dp_scheduler!r}.")
        if not float(dp_balance_weight) >= 0:
            raise ConfigError(f"system.params.dp_balance_weight must be >= 0, got {dp_balance_weight}.")
        if dp_decode_tokens is not None and not float(dp_decode_tokens) >= 0:
            raise ConfigError(
                f"system.params.dp_decode_tokens must be null (the profile's mean) or >= 0, got {dp_decode_tokens}."
            )
        if dp_scheduler == "time" and (dp_assign != "online" or load_aware_lambda > 0 or int(dp_window) != 1):
            raise ConfigError(
                "system.params.dp_scheduler=time has no round-robin mask: dp_assign=batch_window, load_aware_lambda "
                f"and dp_window (got {dp_assign}, {load_aware_lambda}, {dp_window}) belong to dp_scheduler=paper; "
                "keep them at online / 0 / 1 or set dp_scheduler=paper."
            )
        check_rule(dp_load_rule)
        if not float(dp_load_slack) >= 0:
            raise ConfigError(f"system.params.dp_load_slack must be >= 0 (in the load rule's units), got {dp_load_slack}.")
        if dp_scheduler == "load" and (dp_assign != "online" or load_aware_lambda > 0 or int(dp_window) != 1
                                       or float(dp_balance_weight) > 0):
            raise ConfigError(
                "system.params.dp_scheduler=load reads the engine's live load: dp_assign, load_aware_lambda, dp_window "
                f"and dp_balance_weight (got {dp_assign}, {load_aware_lambda}, {dp_window}, {dp_balance_weight}) belong "
                "to the other schedulers; keep them at online / 0 / 1 / 0, or choose dp_scheduler=paper or time."
            )
        if dp_scheduler == "paper" and float(dp_balance_weight) > 0:
            raise ConfigError(
                f"system.params.dp_balance_weight={dp_balance_weight} weighs token balance in dp_scheduler=time only; "
                "the paper scheduler's queued-token price is load_aware_lambda (or set dp_scheduler=time)."
            )
        if int(dp_window) < 1:
            raise ConfigError(f"system.params.dp_window must be >= 1 (requests per rank per mask window), got {dp_window}.")
        if dp_predictor not in DP_PREDICTORS:
            raise ConfigError(f"system.params.dp_predictor must be one of {DP_PREDICTORS}, got {dp_predictor!r}.")
        if cluster_units not in CLUSTER_UNITS:
            raise ConfigError(f"system.params.cluster_units must be one of {CLUSTER_UNITS}, got {cluster_units!r}.")
        self.theta, self.alpha, self.beta, self.gamma = float(theta), float(alpha), float(beta), float(gamma)
        self.n_steps, self.ft_steps, self.lookback = int(n_steps), int(ft_steps), int(lookback)
        self.price_iters, self.max_units = int(price_iters), int(max_units)
        self.exact_expert_step = bool(exact_expert_step)
        self.n_starts, self.polish_rounds, self.polish_kicks = int(n_starts), int(polish_rounds), int(polish_kicks)
        self.dp_scoring, self.load_aware_lambda, self.dp_window = dp_scoring, float(load_aware_lambda), int(dp_window)
        self.dp_assign, self.dp_token_price = dp_assign, float(dp_token_price)
        self.cluster_units, self.prompt_only, self.embeddings_path = cluster_units, bool(prompt_only), embeddings_path
        self.hierarchical = bool(hierarchical)
        self.dp_scheduler, self.dp_balance_weight = dp_scheduler, float(dp_balance_weight)
        self.dp_decode_tokens = None if dp_decode_tokens is None else float(dp_decode_tokens)
        self.expert_load_cap = check_expert_load_cap(expert_load_cap)
        self.dp_predictor = dp_predictor
        self.dp_load_rule, self.dp_load_slack = dp_load_rule, float(dp_load_slack)

    def _solver_args(self) -> dict:
        return dict(
            theta=self.theta, alpha=self.alpha, beta=self.beta, gamma=self.gamma,
            n_steps=self.n_steps, ft_steps=self.ft_steps, price_iters=self.price_iters,
            exact_expert_step=self.exact_expert_step, n_starts=self.n_starts,
            polish_rounds=self.polish_rounds, polish_kicks=self.polish_kicks,
        )

    def fit(self, profile: RoutingTrace, parallel: ParallelConfig, rng: np.random.Generator) -> SemMoEPlan:
        """Algorithm 1 on the profile, then the online tables for the resulting placement."""
        started = time.perf_counter()
        expert_device, info = self.solve_placement(profile, parallel, rng)
        plan = self.plan_for_placement(profile, parallel, expert_device, info)
        plan.info["fit_seconds"] = time.perf_counter() - started
        return plan

    def _profile_rows(self, profile: RoutingTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(kept token indices int64[N'], token_vocab int32[t], occurrences int64[t] kept tokens per row) of the
        profile, read in chunks (repro.affinity.tables.profile_vocab)."""
        keep = profile_tokens(profile, self.prompt_only)
        if self.profile_tokens is not None and len(keep) > self.profile_tokens:
            keep = sample_profile_requests(profile.offsets, keep, self.profile_tokens)
        if len(keep) == 0:
            raise TraceError(
                f"the profile split of {profile.meta.model!r} has no {'prompt ' if self.prompt_only else ''}tokens "
                "in any MoE layer; profile on more requests (or set system.params.prompt_only=false)."
            )
        token_vocab, occurrences = profile_vocab(profile, keep)
        return keep, token_vocab, occurrences

    def solve_placement(
        self, profile: RoutingTrace, parallel: ParallelConfig, rng: np.random.Generator
    ) -> tuple[np.ndarray, dict]:
        """(expert_device int64[L, E] with exactly E/D experts per device per layer, solver info)."""
        return self.cocluster(profile, parallel, rng)

    def cocluster(
        self,
        profile: RoutingTrace,
        parallel: ParallelConfig,
        rng: np.random.Generator,
        on_group: Callable[[UnitGroup, np.ndarray], None] | None = None,
    ) -> tuple[np.ndarray, dict]:
        """Algorithm 1 on the profile: (expert_device int64[L, E], solver info).

        One unit group of all layers under request units (DP), one group per layer under token units (TP).
        on_group(group, expert_device int64[L', E] of the group's layers) is called as each group is solved,
        for solvers that build on the clustering (repro.systems.semmoe.replicate); the group is dropped after
        it, so memory stays at one group's affinity.
        """
        started = time.perf_counter()
        meta = profile.meta
        num_experts, top_k, num_layers = meta.num_experts, meta.top_k, profile.num_layers
        parallel.check_experts(num_experts)  # theta, n_steps, ft_steps were checked in __init__
        keep, token_vocab, occurrences = self._profile_rows(profile)
        units = self.cluster_units
        if units == "auto":
            units = "requests" if parallel.attention == "dp" else "tokens"
        expert_device = np.empty((num_layers, num_experts), dtype=np.int64)
        objectives: list[float] = []
        if units == "requests":  # the request owning each kept token (side="right" skips empty requests)
            request_of_kept = np.searchsorted(np.asarray(profile.offsets), keep, side="right") - 1
            num_units = profile.num_requests
            unit_load = np.bincount(request_of_kept, minlength=num_units).astype(np.float64)  # request tokens
        else:
            num_units = len(token_vocab)
            unit_load = occurrences.astype(np.float64)  # a_j
        # the solver sees the `max_units` heaviest units; lighter ones (rare token ids, short requests) still
        # get tables from the resulting placement, they just do not steer it
        solver_units = np.sort(np.argsort(-unit_load, kind="stable")[: self.max_units])
        solver_units = solver_units[unit_load[solver_units] > 0]
        unit_index = np.full(num_units, -1, dtype=np.int64)
        unit_index[solver_units] = np.arange(len(solver_units))
        # one chunked pass: int counts[L, u', E] of (solver unit, expert) per layer, and every kept token's expert
        # load[L, E] (for expert_load_cap); memory is the tables', not the profile's tokens'
        count_dtype = np.int32 if len(keep) < (1 << 31) else np.int64  # a cell counts at most N' tokens
        solver_counts = np.zeros((num_layers, len(solver_units), num_experts), dtype=count_dtype)
        expert_load = np.zeros(num_layers * num_experts, dtype=np.int64)
        layer_base = (np.arange(num_layers) * num_experts)[None, :, None]
        for part, token_ids, experts in profile_chunks(profile, keep):
            unit = request_of_kept[part] if units == "requests" else np.searchsorted(token_vocab, token_ids)
            unit = unit_index[unit]
            solver = unit >= 0
            for layer in range(num_layers):
                add_pair_counts(solver_counts[layer], unit[solver], experts[solver, layer])
            if self.expert_load_cap is not None:
                expert_load += np.bincount((layer_base + experts).ravel(), minlength=len(expert_load))
        expert_load = expert_load.reshape(num_layers, num_experts).astype(np.float64)

        def sparse(layers: list[int]) -> SparseAffinity:
            """The group's affinity straight from the counts, in (layer, unit, expert) order, one layer's
            nonzeros at a time (the int64 indices np.nonzero returns would triple the table)."""
            counts = solver_counts[layers[0] : layers[-1] + 1]  # a group's layers are consecutive
            per_layer = np.count_nonzero(counts.reshape(len(layers), -1), axis=1)
            layer_start = np.concatenate([[0], np.cumsum(per_layer)])
            unit = np.empty(layer_start[-1], dtype=np.int32)
            layer_expert = np.empty(layer_start[-1], dtype=np.int32)
            value = np.empty(layer_start[-1], dtype=np.float64)
            for i in range(len(layers)):
                rows, experts = np.nonzero(counts[i])
                sel = slice(layer_start[i], layer_start[i + 1])
                unit[sel] = rows
                layer_expert[sel] = i * num_experts + experts
                value[sel] = counts[i][rows, experts].astype(np.float32)  # as the dense float32 tables were
            value /= top_k  # token units
            return SparseAffinity(unit, layer_expert, value, layer_start, len(layers), len(solver_units), num_experts)

        layer_groups = [list(range(num_layers))] if units == "requests" else [[layer] for layer in range(num_layers)]
        # one clustering shared by every layer (requests), or one per layer (tokens: memory stays at one layer's
        # nonzeros)
        load_swaps, load_before, load_after = 0, [], []
        for layers in layer_groups:
            affinity = sparse(layers)
            if len(layer_groups) == 1:
                solver_counts = None  # the affinity holds all the solver reads: free the dense counts before it runs
            result = self._solve_group(affinity, unit_load[solver_units], parallel, rng)
            if self.expert_load_cap is not None:
                result, swaps, before, after = self._balance_load(result, affinity, expert_load[layers], parallel)
                load_swaps, load_before, load_after = load_swaps + swaps, [*load_before, before], [*load_after, after]
            expert_device[layers] = result.expert_device
            objectives.append(result.objective)
            if on_group is not None:
                on_group(UnitGroup(tuple(layers), affinity, unit_load[solver_units], result.unit_cluster), result.expert_device)
        info = {
            "cluster_units": units,
            "hierarchical": self.hierarchical and parallel.num_nodes > 1,
            "objective": float(np.sum(objectives)),
            "objective_per_layer": [float(x) for x in objectives] if units == "tokens" else [],
            "profile_token_rows": len(token_vocab),
            "solver_units": len(solver_units),
            "solver_load_share": float(unit_load[solver_units].sum() / unit_load.sum()),
            "solver_seconds": time.perf_counter() - started,
        }
        if self.profile_tokens is not None:
            info["profile_sampled_tokens"] = len(keep)
        if self.expert_load_cap is not None:
            info.update(expert_load_cap=self.expert_load_cap, expert_load_swaps=int(load_swaps),
                        profile_expert_load_max_mean_before=float(np.mean(np.concatenate(load_before))),
                        profile_expert_load_max_mean_after=float(np.mean(np.concatenate(load_after))))
        return expert_device, info

    def _balance_load(
        self, result: CoclusterResult, affinity: SparseAffinity, expert_load: np.ndarray, parallel: ParallelConfig,
    ) -> tuple[CoclusterResult, int, np.ndarray, np.ndarray]:
        """(the group's result with `balance_expert_load` applied, swaps, profile expert load max/mean per layer
        float[L'] before and after). expert_load float64[L', E] counts every kept profile token of the group's
        layers, not only the solver units'."""
        node = np.arange(parallel.devices) // parallel.devices_per_node
        same_node = node[:, None] == node[None, :] if self.hierarchical and parallel.num_nodes > 1 else None
        gain = affinity.cluster_affinity(result.unit_cluster, parallel.devices)
        balanced, swaps = balance_expert_load(result.expert_device, expert_load, gain, self.expert_load_cap, same_node)
        out = CoclusterResult(result.unit_cluster, balanced, result.objective, result.history)
        return (out, swaps, _load_max_mean(result.expert_device, expert_load, parallel.devices),
                _load_max_mean(balanced, expert_load, parallel.devices))

    def _solve_group(
        self, affinity: SparseAffinity, unit_load: np.ndarray, parallel: ParallelConfig, rng: np.random.Generator
    ) -> CoclusterResult:
        """Algorithm 1 on one unit group: flat over the D devices, or with `hierarchical` on several nodes, by
        node first and by device inside each node (repro.systems.semmoe.topology)."""
        if self.hierarchical and parallel.num_nodes > 1:
            return hierarchical_cocluster(
                affinity, unit_load, parallel.devices, parallel.devices_per_node, rng, **self._solver_args()
            )
        return balanced_cocluster(affinity, unit_load, parallel.devices, rng, **self._solver_args())

    def plan_for_placement(
        self, profile: RoutingTrace, parallel: ParallelConfig, expert_device: np.ndarray, info: dict | None = None
    ) -> SemMoEPlan:
        """The online plan (tables T, T_p, dp_score, A, A_p) for a given expert_device int[L, E] placement.

        Also used by system=semmoe_exact, whose placement comes from the exact MILP.
        """
        meta = profile.meta
        expert_device = np.asarray(expert_device, dtype=np.int64)
        if expert_device.shape != (profile.num_layers, meta.num_experts):
            raise ConfigError(
                f"expert_device has shape {expert_device.shape}; the profile needs ({profile.num_layers}, {meta.num_experts})."
            )
        return self.plan_for(profile, parallel, Placement.from_expert_device(expert_device, parallel.devices), info)

    def plan_for(
        self, profile: RoutingTrace, parallel: ParallelConfig, placement: Placement, info: dict | None = None
    ) -> SemMoEPlan:
        """The online plan for any placement, replicated ones included: a device's score for a token counts
        every expert present there (`present_device_mass`), so rows of a replicated placement's T_p / dp_score
        can sum to more than one. The Markov table's device histories use placement.expert_device() (an
        expert's first device), as the run-time shuffle kernel does."""
        meta = profile.meta
        num_devices, num_layers = parallel.devices, profile.num_layers
        if (placement.num_layers, placement.num_experts, placement.num_devices) != (num_layers, meta.num_experts, num_devices):
            raise ConfigError(
                f"the placement covers {placement.num_layers} layers, {placement.num_experts} experts and "
                f"{placement.num_devices} devices; the profile and parallel config need {num_layers}, "
                f"{meta.num_experts} and {num_devices}."
            )
        check_markov_size(num_devices, self.lookback)
        expert_device = placement.expert_device()
        present = placement.replicas() > 0 if placement.is_replicated else None  # [L, E, D]
        keep, token_vocab, occurrences = self._profile_rows(profile)
        num_rows = len(token_vocab)
        token_device = np.empty((num_layers, num_rows + 1), dtype=np.int16)
        token_confidence = np.empty((num_layers, num_rows + 1), dtype=np.float32)
        dp_score = np.zeros((num_rows + 1, num_devices), dtype=np.float32)
        # int64[L, t, D] (token row, device) activation counts in one chunked pass; shared with the Markov table
        device_counts = token_device_counts(profile, keep, token_vocab, expert_device, num_devices) if present is None else None
        token_row = None if present is None else np.searchsorted(token_vocab, np.asarray(profile.token_ids[keep]))
        for layer in range(num_layers):
            mass = np.empty((num_rows + 1, num_devices), dtype=np.float32)
            if present is None:
                mass[:num_rows] = device_mass_from_counts(device_counts[layer])  # `routed_device_mass`
                # row t, the OOV fallback: the layer's expert popularity, folded onto devices
                device_load = device_counts[layer].sum(axis=0)
                mass[num_rows] = device_load / device_load.sum()
            else:  # replicated placements: per layer from the whole profile column (not chunked)
                experts = np.asarray(profile.experts[keep, layer])
                mass[:num_rows] = present_device_mass(token_row, experts, num_rows, present[layer])
                popularity = np.bincount(experts.ravel(), minlength=meta.num_experts).astype(np.float64)
                mass[num_rows] = popularity @ present[layer] / popularity.sum()
            token_device[layer] = np.argmax(mass, axis=1)
            token_confidence[layer] = mass.max(axis=1)
            dp_score += fold_dp_scores(mass, self.dp_scoring)
        dp_score[num_rows] = 0.0  # an unseen token says nothing about where its request belongs
        token_frequency = np.append(occurrences, 0).astype(np.float32)
        markov_device = markov_confidence = None
        if self.lookback > 0:
            markov_device, markov_confidence = device_markov_table(
                profile, expert_device, num_devices, self.lookback, tokens=keep, device_counts=device_counts
            )
        embeddings = None if self.embeddings_path is None else np.load(self.embeddings_path, allow_pickle=False)
        row_of_token = vocab_row_map(token_vocab, meta.vocab_size, embeddings)
        info = dict(info or {})
        info["dp_scoring"] = self.dp_scoring
        # a request's expected decode tokens: the profile's mean generated tokens (0 for prompt-only traces)
        decode_tokens = self.dp_decode_tokens
        if decode_tokens is None:
            generated = np.diff(np.asarray(profile.offsets, dtype=np.int64)) - np.asarray(profile.prefill_len)
            decode_tokens = float(generated.mean()) if len(generated) else 0.0
        info.update(dp_scheduler=self.dp_scheduler, dp_balance_weight=self.dp_balance_weight,
                    dp_decode_tokens=decode_tokens, dp_predictor=self.dp_predictor)
        if self.dp_scheduler == "load":
            info.update(dp_load_rule=self.dp_load_rule, dp_load_slack=self.dp_load_slack)
        learned_table = learned_prior = None
        if self.dp_predictor == "learned":  # ridge on the profile's prompt bags -> device shares (predictor.py)
            learned_table, learned_prior, predictor_info = fit_request_predictor(
                profile, placement, row_of_token, num_rows + 1
            )
            info.update(predictor_info)
        return SemMoEPlan(
            placement, parallel, token_vocab, row_of_token, token_device, token_confidence, dp_score,
            markov_device, markov_confidence, self.lookback, self.load_aware_lambda, self.dp_window, self.dp_scoring,
            token_frequency, info, self.dp_assign, self.dp_token_price, self.dp_scheduler, self.dp_balance_weight,
            decode_tokens, self.dp_predictor, learned_table, learned_prior, self.dp_load_rule, self.dp_load_slack,
        )


def _load_max_mean(expert_device: np.ndarray, expert_load: np.ndarray, num_devices: int) -> np.ndarray:
    """float64[L] busiest device's expert load / mean per layer; expert_device int[L, E], expert_load float[L, E]."""
    num_layers = expert_device.shape[0]
    key = np.arange(num_layers)[:, None] * num_devices + expert_device
    load = np.bincount(key.ravel(), weights=expert_load.ravel(), minlength=num_layers * num_devices)
    load = load.reshape(num_layers, num_devices)
    return load.max(axis=1) / np.maximum(load.mean(axis=1), 1e-30)


def present_device_mass(token_row: np.ndarray, experts: np.ndarray, num_rows: int, present: np.ndarray) -> np.ndarray:
    """float32[t, D] share of each token row's activations whose expert is present on device d (replicas counted).

    token_row int64[N]; experts int[N, k] one layer's routing; present bool[E, D]. Without replication it equals
    `routed_device_mass`; with it a row sums to more than one. Sparse [t, E] counts, so O(N x k + t x D).
    """
    experts = np.asarray(experts, dtype=np.int64)
    num_tokens, top_k = experts.shape
    counts = sp.csr_matrix(
        (np.ones(num_tokens * top_k, dtype=np.float32), (np.repeat(token_row, top_k), experts.ravel())),
        shape=(num_rows, present.shape[0]),
    )
    mass = np.asarray(counts @ present.astype(np.float32))
    activations = np.bincount(token_row, minlength=num_rows).astype(np.float32) * top_k
    return mass / np.maximum(activations, 1e-30)[:, None]


class SemMoEHierarchical(SemMoE):
    """`system=semmoe_hierarchical`: Sem-MoE with `hierarchical=True` (co-clustering by node, then by device inside
    each node, on parallel.devices_per_node); identical to Sem-MoE on one node."""

    name = "semmoe_hierarchical"

    def __init__(self, **params):
        check_semmoe_params(self.name, params)
        super().__init__(**{**params, "hierarchical": True})


class SemMoEPaper(SemMoE):
    """`system=semmoe_paper`: Sem-MoE with the paper's Attention-DP scheduler (Algorithm 2, dp_scheduler="paper")
    and placement (no expert-load post-pass), for the reproduction verdict; system=semmoe's configured defaults are
    the time-aware scheduler and expert_load_cap."""

    name = "semmoe_paper"

    def __init__(self, **params):
        check_semmoe_params(self.name, params)
        if params.get("dp_scheduler", "paper") != "paper" or params.get("dp_balance_weight", 0.0):
            raise ConfigError(
                f"system=semmoe_paper runs the paper's DP scheduler; got dp_scheduler={params.get('dp_scheduler')!r}, "
                f"dp_balance_weight={params.get('dp_balance_weight')}: use system=semmoe for the time-aware one."
            )
        if params.get("expert_load_cap"):
            raise ConfigError(
                f"system=semmoe_paper places experts as the paper does; got expert_load_cap={params['expert_load_cap']}: "
                "use system=semmoe for the load-capped placement."
            )
        if params.get("dp_predictor", "tables") != "tables":
            raise ConfigError(
                f"system=semmoe_paper scores requests with the paper's token tables; got dp_predictor="
                f"{params['dp_predictor']!r}: use system=semmoe for the learned predictor."
            )
        super().__init__(**{**params, "dp_scheduler": "paper", "dp_balance_weight": 0.0, "expert_load_cap": None,
                            "dp_predictor": "tables"})


def check_semmoe_params(name: str, params: dict, own: tuple[str, ...] = ()) -> None:
    """Raise a ConfigError naming the known parameters when a system built on SemMoE gets an unknown one."""
    known = set(inspect.signature(SemMoE).parameters)
    unknown = sorted(set(params) - known)
    if unknown:
        raise ConfigError(
            f"system {name!r} has no parameter(s) {unknown}; its parameters are {sorted(known | set(own))}."
        )
