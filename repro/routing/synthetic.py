"""Synthetic routing: a seeded generative router with named knobs, for models whose weights are not here.

Routes the workload's real token ids through L MoE layers of E experts, k per token, with the four kinds of
structure Sem-MoE relies on, each behind one knob (conf/model/synthetic_*.yaml give the presets and say what
their values were fitted to; `repro/routing/fit_synthetic.py` is the fitting procedure):

  popularity_skew  expert popularity is Zipf-like: at every layer the experts' base weights are
                   (rank + 1) ** -skew over a seeded random order of the experts (0 = uniform load).
  domain_strength  requests of one class (their label, or their dataset: `domain_key`) shift expert
                   preferences: the class's popularity is the base weight times exp(strength * g) with g a
                   standard normal per (class, layer, expert), seeded by a hash of the class name.
  groups, cohesion every layer's experts are split into `groups` topics (a seeded near-equal partition per
                   layer; topic g at layer l is a different random set of experts at every layer). Each token
                   occurrence is in one topic per layer and takes a share `cohesion` of its k slots from that
                   topic's experts, the rest from all experts: experts of one topic are co-activated, which is
                   the structure a co-clustering placement exploits.
  concentration    how deterministic a token's experts are. Every token id has a home topic (hashed from the id,
                   the same at every layer) and, per layer and topic, a ranked list of `candidates` preferred
                   experts (M >= k) drawn from the class popularity restricted to the topic by inverse CDF at
                   uniforms hashed from (model_seed, token id, layer, topic, rank): the same token routes alike
                   across requests (as in a real model), popular experts are preferred by more tokens, and a class
                   shift moves a token's candidates coherently. An occurrence starts in its home topic with
                   probability `concentration` (else a topic drawn from the class's topic popularity), and slot j
                   takes candidate rank j with probability `concentration` (else a uniformly random rank among M).
                   1 = always the same k experts (up to explore and cohesion).
  persistence      inter-layer dependence through an expert->expert transition structure: with this
                   probability the occurrence's topic at layer l is the majority topic of its layer-(l-1) experts
                   (an expert of topic g at l-1 leads to the experts of topic g at l: a block transition), else it
                   is drawn afresh as above. With persistence, a token whose own table is spread over topics
                   has its next experts predicted by its previous ones (what Sem-MoE's Markov history uses);
                   0 = layers independent given the token id and class.
  explore          with this probability a slot draws from the class popularity instead (routing noise that
                   gives every token a thin tail over all experts).

A slot that repeats an expert of an earlier slot is redrawn from the token's candidates of its topic at a random
rank (a few rounds), then from the class popularity, then given the lowest unused expert ids: every row holds k
distinct experts. Slot 0 is the token's most likely expert (its rank-0 candidate).

Randomness: the "model" (popularity orders, class shifts, topics, token candidates) depends only on
`model_seed`; the per-occurrence draws on the run seed; both through explicit numpy Generators or a
splitmix64 hash, so the same config, seed and requests give the same trace bit for bit. Cost: O(N L k) gathers
and a few searchsorted calls per layer: ~5 s for 237k tokens x 12 layers x top-6, ~20 s for 100k tokens x 58
layers x top-8 (DeepSeek-V3 preset) on one CPU core; the searchsorted calls dominate.

What it is not: a trained router. There are no gate weights, no positional or contextual effects beyond the
class and the previous layer, and the transition structure is block-diagonal over topics; real models have
soft, overlapping expert->expert lifts (the olmoe-routing cross_count). The persistence value of the presets is not
identifiable from tables 7-8 layers apart (fit_synthetic.py); see the preset comments.

Legend: N tokens, L MoE layers, E experts, k experts per token, M candidates per token, C classes.
"""

from __future__ import annotations

import hashlib

import numpy as np

from repro.errors import ConfigError, WorkloadError
from repro.routing import prompts_trace
from repro.traces import RoutingTrace, TraceMeta
from repro.workloads.request import Request

SYNTHETIC_DEFAULTS = {
    "name": "synthetic",
    "kind": "synthetic",
    "tokenizer": "mixtral",
    "num_experts": 64,
    "top_k": 6,
    "num_layers": 26,
    "first_layer": 1,  # model layer id of the first MoE layer (layers before it are dense)
    "concentration": 0.8,
    "candidates": 12,
    "persistence": 0.5,
    "groups": 5,
    "cohesion": 0.8,
    "explore": 0.05,
    "domain_strength": 0.5,
    "popularity_skew": 0.5,
    "domain_key": "label",
    "model_seed": 0,
}
DOMAIN_KEYS = ("label", "dataset", "none")
REDRAW_ROUNDS = 8  # redraws of repeated experts from the token's candidates before falling back to popularity


def check_synthetic_config(model_cfg: dict) -> dict:
    """model_cfg merged over SYNTHETIC_DEFAULTS with every value checked; ConfigError names the bad key."""
    unknown = set(model_cfg) - set(SYNTHETIC_DEFAULTS)
    if unknown:
        raise ConfigError(f"model config has unknown keys {sorted(unknown)}; kind=synthetic accepts {sorted(SYNTHETIC_DEFAULTS)}.")
    cfg = {**SYNTHETIC_DEFAULTS, **model_cfg}
    for key in ("num_experts", "top_k", "num_layers", "candidates", "groups"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ConfigError(f"model.{key}={cfg[key]!r} must be a positive integer.")
    if not isinstance(cfg["first_layer"], int) or cfg["first_layer"] < 0:
        raise ConfigError(f"model.first_layer={cfg['first_layer']!r} must be an integer >= 0.")
    if not isinstance(cfg["model_seed"], int) or cfg["model_seed"] < 0:
        raise ConfigError(f"model.model_seed={cfg['model_seed']!r} must be an integer >= 0.")
    if cfg["top_k"] > cfg["num_experts"]:
        raise ConfigError(f"model.top_k={cfg['top_k']} exceeds model.num_experts={cfg['num_experts']}.")
    if cfg["num_experts"] > np.iinfo(np.int16).max:
        raise ConfigError(f"model.num_experts={cfg['num_experts']} does not fit the trace format's int16 expert ids.")
    if not cfg["top_k"] <= cfg["candidates"]:
        raise ConfigError(f"model.candidates={cfg['candidates']} must be at least model.top_k={cfg['top_k']}.")
    if cfg["groups"] > cfg["num_experts"]:
        raise ConfigError(f"model.groups={cfg['groups']} exceeds model.num_experts={cfg['num_experts']}.")
    for key in ("concentration", "persistence", "cohesion", "explore"):
        if not isinstance(cfg[key], (int, float)) or not 0 <= cfg[key] <= 1:
            raise ConfigError(f"model.{key}={cfg[key]!r} must be a probability in [0, 1].")
    for key in ("domain_strength", "popularity_skew"):
        if not isinstance(cfg[key], (int, float)) or cfg[key] < 0:
            raise ConfigError(f"model.{key}={cfg[key]!r} must be a number >= 0.")
    if cfg["domain_key"] not in DOMAIN_KEYS:
        raise ConfigError(f"model.domain_key={cfg['domain_key']!r} must be one of {DOMAIN_KEYS}.")
    return cfg


def hash_uniform(*keys) -> np.ndarray:
    """float64 uniforms in [0, 1) from a splitmix64 hash of integer arrays broadcast together (no Generator)."""
    x = np.uint64(0x9E3779B97F4A7C15)
    for i, key in enumerate(keys):
        k = np.asarray(key).astype(np.uint64)
        with np.errstate(over="ignore"):
            x = (x ^ (k + np.uint64(0x632BE59BD9B4E019 * (i + 1) & 0xFFFFFFFFFFFFFFFF))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(31))) * np.uint64(0x94D049BB133111EB)
            x = x ^ (x >> np.uint64(29))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _name_seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def class_popularity(cfg: dict, classes: list[str]) -> np.ndarray:
    """float64[C, L, E] each class's expert popularity per layer (rows sum to 1).

    Base: Zipf weights (rank + 1) ** -popularity_skew over a seeded random expert order per layer; a class
    multiplies them by exp(domain_strength * g), g ~ N(0, 1) seeded by (model_seed, the class name).
    """
    num_layers, num_experts = cfg["num_layers"], cfg["num_experts"]
    rng = np.random.default_rng([cfg["model_seed"], 1])
    order_LE = rng.permuted(np.tile(np.arange(num_experts), (num_layers, 1)), axis=1)
    base_LE = np.empty((num_layers, num_experts))
    np.put_along_axis(base_LE, order_LE, (np.arange(num_experts) + 1.0) ** -float(cfg["popularity_skew"]), axis=1)
    shift_CLE = np.stack(
        [np.random.default_rng([cfg["model_seed"], 2, _name_seed(c)]).standard_normal((num_layers, num_experts)) for c in classes]
    )
    weights = base_LE[None] * np.exp(float(cfg["domain_strength"]) * shift_CLE)
    return weights / weights.sum(axis=2, keepdims=True)


def expert_groups(cfg: dict) -> np.ndarray:
    """int64[L, E] group (topic) of every expert per layer: a seeded random partition into near-equal groups."""
    num_layers, num_experts, num_groups = cfg["num_layers"], cfg["num_experts"], cfg["groups"]
    rng = np.random.default_rng([cfg["model_seed"], 3])
    order_LE = rng.permuted(np.tile(np.arange(num_experts), (num_layers, 1)), axis=1)
    group_of_place = (np.arange(num_experts) * num_groups) // num_experts  # near-equal contiguous blocks
    group_LE = np.empty((num_layers, num_experts), dtype=np.int64)
    np.put_along_axis(group_LE, order_LE, np.broadcast_to(group_of_place, (num_layers, num_experts)), axis=1)
    return group_LE


class _Sampler:
    """Inverse-CDF draws from a class's popularity over all experts or within one group, at one layer."""

    def __init__(self, popularity_CLE: np.ndarray, group_LE: np.ndarray, num_groups: int):
        num_classes, num_layers, num_experts = popularity_CLE.shape
        self.num_experts, self.num_groups = num_experts, num_groups
        # all experts: row c's cumulative weights live in [c, c + 1)
        cum = np.cumsum(popularity_CLE, axis=2)
        cum /= cum[..., -1:]
        self.cum_LF = (cum + np.arange(num_classes)[:, None, None]).transpose(1, 0, 2).reshape(num_layers, -1)
        # within a group: experts sorted by group, row (c, g) lives in [c * G + g, c * G + g + 1)
        self.members_LE = np.argsort(group_LE, axis=1, kind="stable")
        sorted_pop = np.take_along_axis(popularity_CLE, self.members_LE[None], axis=2)
        sorted_group = np.take_along_axis(group_LE, self.members_LE, axis=1)  # [L, E] ascending
        group_mass = np.zeros((num_classes, num_layers, num_groups))
        for g in range(num_groups):
            group_mass[..., g] = np.where(sorted_group[None] == g, sorted_pop, 0.0).sum(axis=2)
        within = np.cumsum(sorted_pop, axis=2)
        start_of = np.take_along_axis(np.concatenate([np.zeros_like(within[..., :1]), within[..., :-1]], axis=2),
                                      np.broadcast_to(self._group_first(sorted_group)[None], within.shape), axis=2)
        frac = (within - start_of) / np.take_along_axis(group_mass, np.broadcast_to(sorted_group[None], within.shape), axis=2)
        last = np.ones(sorted_group.shape, dtype=bool)  # the last member of each group ends at exactly 1
        last[:, :-1] = sorted_group[:, 1:] != sorted_group[:, :-1]
        frac = np.where(last[None], 1.0, np.minimum(frac, 1.0))
        self.group_cum_LF = (frac + (np.arange(num_classes)[:, None, None] * num_groups + sorted_group[None]))
        self.group_cum_LF = self.group_cum_LF.transpose(1, 0, 2).reshape(num_layers, -1)
        # group popularity per class and layer, for drawing a group: [L, C * G] cumulative in [c, c + 1)
        gcum = np.cumsum(group_mass, axis=2)
        gcum /= gcum[..., -1:]
        self.group_pick_LF = (gcum + np.arange(num_classes)[:, None, None]).transpose(1, 0, 2).reshape(num_layers, -1)

    @staticmethod
    def _group_first(sorted_group_LE: np.ndarray) -> np.ndarray:
        """int64[L, E] index of the first member of each entry's group in the group-sorted order."""
        num_layers, num_experts = sorted_group_LE.shape
        new = np.ones_like(sorted_group_LE, dtype=bool)
        new[:, 1:] = sorted_group_LE[:, 1:] != sorted_group_LE[:, :-1]
        idx = np.where(new, np.arange(num_experts)[None], 0)
        return np.maximum.accumulate(idx, axis=1)

    def expert(self, layer: int, cls, u) -> np.ndarray:
        idx = np.searchsorted(self.cum_LF[layer], cls + u, side="right")
        return np.minimum(idx - cls * self.num_experts, self.num_experts - 1)

    def expert_in_group(self, layer: int, cls, group, u) -> np.ndarray:
        row = cls * self.num_groups + group
        idx = np.searchsorted(self.group_cum_LF[layer], row + u, side="right")
        place = np.minimum(idx - cls * self.num_experts, self.num_experts - 1)
        return self.members_LE[layer][place]

    def group(self, layer: int, cls, u) -> np.ndarray:
        idx = np.searchsorted(self.group_pick_LF[layer], cls + u, side="right")
        return np.minimum(idx - cls * self.num_groups, self.num_groups - 1)


def synthetic_routing(
    cfg: dict, token_ids: np.ndarray, class_of_token: np.ndarray, classes: list[str], rng: np.random.Generator
) -> np.ndarray:
    """experts int16[N, L, k] for token_ids int[N] of classes class_of_token int[N] (indices into classes).

    cfg: a checked config (check_synthetic_config). Every row holds k distinct experts. See the module
    docstring for the generative model.
    """
    num_tokens = len(token_ids)
    num_layers, top_k = cfg["num_layers"], cfg["top_k"]
    num_cand, num_groups, seed = cfg["candidates"], cfg["groups"], cfg["model_seed"]
    concentration, persistence, cohesion, explore = (
        float(cfg[k]) for k in ("concentration", "persistence", "cohesion", "explore")
    )
    group_LE = expert_groups(cfg)
    sampler = _Sampler(class_popularity(cfg, classes), group_LE, num_groups)
    tokens_N = np.asarray(token_ids, dtype=np.int64)
    class_N = np.asarray(class_of_token, dtype=np.int64)
    tokens_N1, class_N1 = tokens_N[:, None], class_N[:, None]
    slot_1k = np.arange(top_k)[None, :]
    # the token's home group (one per token id, the same at every layer)
    home_N = np.minimum((hash_uniform(seed, tokens_N, 1 << 20) * num_groups).astype(np.int64), num_groups - 1)

    experts_NLk = np.empty((num_tokens, num_layers, top_k), dtype=np.int16)
    prev_Nk = None
    for layer in range(num_layers):
        # the occurrence's group: kept from the previous layer's experts, else the token's home group, else a
        # group drawn from the class's group popularity
        at_home = rng.random(num_tokens) < concentration
        group_N = np.where(at_home, home_N, sampler.group(layer, class_N, rng.random(num_tokens)))
        if prev_Nk is not None and persistence > 0:
            keep = rng.random(num_tokens) < persistence
            group_N = np.where(keep, _majority(group_LE[layer - 1][prev_Nk], num_groups), group_N)
        group_N1 = group_N[:, None]
        # each slot: the token's rank-j candidate in the group (or a random rank), outside the group with
        # probability 1 - cohesion, from the class popularity with probability explore
        fixed = rng.random((num_tokens, top_k)) < concentration
        rank_Nk = np.where(fixed, slot_1k, rng.integers(0, num_cand, (num_tokens, top_k)))
        u_Nk = hash_uniform(seed, tokens_N1, layer, group_N1, rank_Nk)
        experts_Nk = sampler.expert_in_group(layer, class_N1, group_N1, u_Nk)
        rows, cols = np.nonzero(rng.random((num_tokens, top_k)) >= cohesion)
        u_out = hash_uniform(seed, tokens_N[rows], layer, num_groups, rank_Nk[rows, cols])
        experts_Nk[rows, cols] = sampler.expert(layer, class_N[rows], u_out)
        rows, cols = np.nonzero(rng.random((num_tokens, top_k)) < explore)
        experts_Nk[rows, cols] = sampler.expert(layer, class_N[rows], rng.random(len(rows)))
        _make_distinct(experts_Nk, layer, tokens_N, class_N, group_N, sampler, rng, cfg)
        experts_NLk[:, layer] = experts_Nk
        prev_Nk = experts_Nk
    return experts_NLk


def _majority(group_Nk: np.ndarray, num_groups: int) -> np.ndarray:
    """int64[N] most frequent group of each row (ties: the group of the earliest slot among the tied)."""
    votes = np.zeros((len(group_Nk), num_groups), dtype=np.int64)
    rows = np.arange(len(group_Nk))
    for j in range(group_Nk.shape[1]):
        votes[rows, group_Nk[:, j]] += 1
    best = votes.max(axis=1, keepdims=True)
    slot_votes = np.take_along_axis(votes, group_Nk, axis=1)
    first = np.argmax(slot_votes == best, axis=1)
    return group_Nk[rows, first]


def _repeat_rows(experts_nk: np.ndarray) -> np.ndarray:
    """bool[n, k]: the slot holds an expert already held by an earlier slot of its row."""
    top_k = experts_nk.shape[1]
    rep = np.zeros(experts_nk.shape, dtype=bool)
    for j in range(1, top_k):
        for i in range(j):
            rep[:, j] |= experts_nk[:, j] == experts_nk[:, i]
    return rep


def _make_distinct(experts_Nk, layer, tokens_N, class_N, group_N, sampler: _Sampler, rng, cfg) -> None:
    """Redraw repeated slots in place: the token's group candidates, then class popularity, then free ids."""
    num_experts, num_cand, seed = cfg["num_experts"], cfg["candidates"], cfg["model_seed"]
    bad = np.flatnonzero(_repeat_rows(experts_Nk).any(axis=1))
    for attempt in range(2 * REDRAW_ROUNDS):
        if len(bad) == 0:
            return
        sub = experts_Nk[bad]
        rows, cols = np.nonzero(_repeat_rows(sub))
        tok, cls = tokens_N[bad][rows], class_N[bad][rows]
        if attempt < REDRAW_ROUNDS:
            u = hash_uniform(seed, tok, layer, group_N[bad][rows], rng.integers(0, num_cand, len(rows)))
            sub[rows, cols] = sampler.expert_in_group(layer, cls, group_N[bad][rows], u)
        else:
            sub[rows, cols] = sampler.expert(layer, cls, rng.random(len(rows)))
        experts_Nk[bad] = sub
        bad = bad[_repeat_rows(sub).any(axis=1)]
    # last resort (tiny E or extreme skew): the lowest expert ids the row does not hold yet, in order
    for row in np.array_split(bad, max(1, len(bad) // 4096)):  # bounded memory: rows x E booleans per chunk
        sub = experts_Nk[row]
        dup = _repeat_rows(sub)
        held = np.zeros((len(row), num_experts), dtype=bool)
        np.put_along_axis(held, np.where(dup, sub[:, :1], sub), True, axis=1)
        free_order = np.argsort(held, axis=1, kind="stable")  # unheld experts first, ascending id
        fill_rank = np.maximum(np.cumsum(dup, axis=1) - 1, 0)
        experts_Nk[row] = np.where(dup, np.take_along_axis(free_order, fill_rank, axis=1), sub)


def route_with_synthetic(
    model_cfg: dict,
    requests: list[Request],
    train_requests: list[Request],
    *,
    cache_dir,
    seed: int,
    dataset: str,
    tokenizer: str,
    vocab_size: int,
) -> RoutingTrace:
    """Route the prompts of `requests` with the synthetic router (model_cfg: conf/model/synthetic_*.yaml).

    `train_requests` and `cache_dir` are unused: nothing is learned. Every request's prompt is routed
    (prefill_len = prompt length). Classes are the requests' labels (domain_key=label; an empty label falls
    back to the dataset), their datasets (dataset) or one class for all (none).
    """
    del train_requests, cache_dir
    cfg = check_synthetic_config(model_cfg)
    if not requests:
        raise WorkloadError("route_with_synthetic got no requests; the workload is empty after filtering.")
    lengths = np.array([len(r.token_ids) for r in requests], dtype=np.int64)
    token_ids = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in requests])
    if token_ids.size and token_ids.min() < 0:
        raise WorkloadError(f"token id {int(token_ids.min())} is negative; tokenize the workload with a real tokenizer.")
    names = [request_class(r, cfg["domain_key"]) for r in requests]
    classes = sorted(set(names))
    index = {c: i for i, c in enumerate(classes)}
    class_of_token = np.repeat(np.array([index[c] for c in names], dtype=np.int64), lengths)
    experts = synthetic_routing(cfg, token_ids, class_of_token, classes, np.random.default_rng(seed))
    first = cfg["first_layer"]
    meta = TraceMeta(
        model=str(cfg["name"]),
        num_experts=cfg["num_experts"],
        top_k=cfg["top_k"],
        layer_ids=tuple(range(first, first + cfg["num_layers"])),
        vocab_size=int(vocab_size),
        tokenizer=tokenizer or str(cfg["tokenizer"]),
        source="synthetic",
        dataset=dataset,
        dense_layers=tuple(range(first)),
        extra={
            "seed": int(seed),
            "classes": len(classes),
            **{k: cfg[k] for k in ("concentration", "candidates", "persistence", "groups", "cohesion", "explore", "domain_strength",
                                   "popularity_skew", "domain_key", "model_seed")},
        },
    )
    return prompts_trace(meta, requests, experts)


def request_class(request: Request, domain_key: str) -> str:
    """The class name that shifts a request's expert preferences (see route_with_synthetic)."""
    if domain_key == "none":
        return ""
    if domain_key == "label" and request.label:
        return f"label:{request.label}"
    return f"dataset:{request.dataset}"
