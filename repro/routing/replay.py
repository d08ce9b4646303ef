"""Replay routing: sample each token's experts from measured per-token tables of a real model.

The tables are the olmoe-routing NPZ files (`../shared/data/README.md`): for a few model layers, how often each
token id was routed to each expert on real text (all top-k slots counted). For one token at one layer,
count[e] / occurrences is the probability that expert e is among the token's top-k: its *inclusion
probability* p[e], with sum_e p[e] = k and every p[e] <= 1 (a token cannot pick one expert twice).

Sampling. For every token we draw k DISTINCT experts whose inclusion probabilities equal p exactly, by
systematic (Madow) sampling: lay the experts' p's end to end on [0, k), draw one uniform u in [0, 1) per token
and take the experts whose interval holds one of the points u, u+1, ..., u+k-1. Each interval is at most 1
long, so it holds at most one point (the k experts are distinct) and holds one with probability exactly its
length p[e]. With a fixed expert order systematic sampling never draws some pairs (with p = 1/2 over four
experts and k = 2, experts 0 and 1 would never meet), which would plant an artificial pattern in which experts
share a device. So each token's experts are laid out in a random order, taken from a pool of random
permutations drawn per call (any order keeps the first-order probabilities exact; a pool keeps the cost at one
gather instead of a per-token sort). The k drawn experts are then written in descending order of p (of the
tilted q when layers are coupled; ties: lower expert id first), so slot 0 holds the expert the token most likely uses, which keeps "top-1" meaningful.

Layer coupling (`layer_coupling`, default 0). Real routing has inter-layer dependence beyond what the token id
explains. The tables hold it only as `cross_count[i, a, b]`: over all tokens, how often expert a at layers[i]
and expert b at layers[i+1] sat in the same top-k slot (slots are ranked by gate score; slot j paired with slot
j). What is and is not identifiable from that:
- The all-k x k pair counts between layers are not in the data, and the zipped counts depend on the slot order.
  Replay has no trustworthy slot order to compare with: the only slot-resolved measurement, `expert_count_top1`,
  is matched WORSE by replay's descending-p slot 0 than by the all-slot loads (OLMoE total variation 0.39 /
  0.26 / 0.44 at layers 0/7/15 vs 0.25 / 0.27 / 0.39), so zipping replay's slots (mutual information 0.193 at
  0->7 vs 0.123 measured) mostly measures the order rule, not dependence.
- So the target is defined order-free on the replay side: the slot-symmetrised pair matrix, all k x k pairs
  / k, which is what zipping gives when slots are paired in a random order. For independent replay its
  expectation is analytic, `independent_pairs`: sum_t n_t p_l(t, a) p_{l+1}(t, b) / k (same row/column sums as
  cross_count: the loads). It is compared with cross_count as measured. That comparison is exact only if real
  gate ranks carry no cross-layer alignment; if they do (a token's rank-0 experts pairing up), cross_count
  overstates the symmetric dependence and the coupling fitted to it overshoots. Nothing in the tables can tell.
- Residual lift G[i, a, b] = cross_count / independent_pairs (`residual_lift`, pseudo-count 1, clipped to
  [1/8, 8]; computed from the loaded tables, popularity rows of min_count-dropped tokens included). G = 1
  means the token id already explains the pair; independent replay's symmetrised pairs MI is 0.059 / 0.173
  (OLMoE 0->7 / 7->15) vs 0.123 / 0.334 for cross_count, so G > 1 on the real affinities.
- Tilt (`tilt_inclusion`): layer l is drawn after layer l-1, and token n's inclusion vector becomes
  q[b] ~ p[b] * exp(c * sum_a (1[a drawn at l-1] - p_prev[a]) * log G[a, b]), water-filled by `cap_inclusion`
  (so distinct-k systematic sampling is unchanged) with c = layer_coupling. The centring by the token's own
  previous-layer probabilities p_prev keeps the mean log tilt over the token's draws at zero: the coupling adds
  within-token co-variation (a token that took expert a at layer 0 this time leans to a's partners at layer 7)
  instead of re-adding the dependence its token id already explains, and per-token marginals move only at
  second order. An uncentred tilt (p * prod_a G[a, b]^c) drifted per-token marginals by up to 0.9 on OLMoE.
  Tokens with near-deterministic rows (p in {0, 1}) cannot carry within-token dependence, so the population
  statistic is only partly reachable.
- Measured with the whole table population replayed (`c` chosen by the best match of the symmetrised pair
  matrix to cross_count, total variation, 0->7 / 7->15): Mixtral c = 0: 0.034 / 0.050, c = 2: 0.0072 / 0.012
  (mutual information 0.015 / 0.031 vs measured 0.015 / 0.033), per-token drift unchanged (mean per-token total
  variation of the inclusion vector, tokens seen >= 100 times, 0.037 / 0.039 vs a sampling floor of 0.035 /
  0.035). OLMoE c = 0: 0.093 / 0.139, c = 0.5: 0.075 / 0.121, c = 1: 0.065 / 0.118, c = 2: 0.070 / 0.156;
  drift at layer 15: 0.048 (c = 0.5) and 0.094 (c = 1) vs a floor of 0.032, so the OLMoE default is 0.5 (the
  best match whose drift stays within ~0.015 of the floor). The remaining OLMoE gap (symmetrised MI 0.064 /
  0.181 vs 0.123 / 0.334) is dependence the tables cannot place on tokens.
With c = 0 the sampler is today's independent one, bit for bit (the random numbers drawn never depend on c).
Only consecutive recorded layers are linked (0 -> 7 -> 15, seven model layers apart). Gate weights are not
recorded and not produced. Tokens absent from the tables (or seen fewer than `min_count` times) fall back to
the layer's overall expert popularity.

Pathological rows (a probability above 1, e.g. from hand-edited or inconsistent counts) are clipped at 1 and
the rest rescaled so the row still sums to k (water-filling, `cap_inclusion`); rows with fewer than k
possible experts spread the missing mass evenly over the remaining experts.

Legend: L recorded layers, t tokens with measurements, E experts, k experts per token, N tokens to route,
M COO entries of table files, P permutations in the pool, R rows of a probability matrix.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from repro.errors import ConfigError, TraceError, WorkloadError
from repro.routing import prompts_trace
from repro.traces import RoutingTrace, TraceMeta
from repro.workloads.request import Request

TABLE_KEYS = ("layers", "num_experts", "top_k", "tte_layer", "tte_token", "tte_expert", "tte_count", "expert_count")
PERMUTATION_POOL = 256  # random expert orders per call and layer; see the module docstring
MAX_REDRAWS = 64  # a redraw is needed with probability ~1e-16 per token; more than this means a broken table
MAX_COUPLING = 4.0
LIFT_CLIP = 8.0  # residual lifts are clipped to [1/8, 8]; see residual_lift
CHUNK_ELEMENTS = 1 << 22  # tokens x experts handled at once: bounds memory to ~100 MB per chunk
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def check_replay_config(model: dict) -> None:
    """The replay producer's config check (repro.config_schema composes it): route_with_replay's keys and their
    types (layer_coupling's upper bound, MAX_COUPLING, is checked when routing)."""
    from repro.config_values import Value, check_table, integer, number, text

    check_table("model", model, {
        "name": text(), "kind": text(), "tables": Value(("list", "str")), "tokenizer": text(null=True),
        "min_count": integer(1), "layer_coupling": number(0),
    })


@dataclass(frozen=True)
class ReplayTables:
    """Per recorded layer and per token: the probability that each expert is in the token's top-k.

    token_vocab int32[t]: sorted token ids that have measurements.
    inclusion float32[L, t, E]: Pr(expert in the token's top-k); every row sums to top_k, entries in [0, 1].
    popularity float32[L, E]: the same over all tokens of the layer; the fallback for unseen tokens.
    token_count int64[L, t]: occurrences of each token at each layer in the measured text.
    cross_lift float32[L-1, E, E] or None: residual lift G[l, a, b] of (a at layer l, b at layer l+1) beyond
        what the token id explains (`residual_lift`); None when the files hold no cross_count (no coupling).
    """

    model: str
    num_experts: int
    top_k: int
    layer_ids: tuple[int, ...]
    token_vocab: np.ndarray
    inclusion: np.ndarray
    popularity: np.ndarray
    token_count: np.ndarray
    cross_lift: np.ndarray | None = None

    def __post_init__(self) -> None:
        num_layers, num_rows, num_experts = len(self.layer_ids), len(self.token_vocab), self.num_experts
        shapes = {
            "inclusion": (self.inclusion.shape, (num_layers, num_rows, num_experts)),
            "popularity": (self.popularity.shape, (num_layers, num_experts)),
            "token_count": (self.token_count.shape, (num_layers, num_rows)),
        }
        if self.cross_lift is not None:
            shapes["cross_lift"] = (self.cross_lift.shape, (max(num_layers - 1, 0), num_experts, num_experts))
        for name, (got, want) in shapes.items():
            if got != want:
                raise TraceError(f"ReplayTables.{name} has shape {got}; layer_ids, token_vocab and num_experts say {want}.")
        if not 1 <= self.top_k <= num_experts:
            raise TraceError(f"ReplayTables has top_k={self.top_k} with num_experts={num_experts}; need 1 <= top_k <= E.")
        if num_rows > 1 and np.any(np.diff(self.token_vocab) <= 0):
            raise TraceError("ReplayTables.token_vocab must be sorted and without repeats.")
        for name in ("inclusion", "popularity"):
            p = np.asarray(getattr(self, name), dtype=np.float64)
            # sampling needs every row to be a valid inclusion vector; cap_inclusion repairs one that is not
            if p.size and (p.min() < 0 or p.max() > 1 + 1e-6 or np.abs(p.sum(axis=-1) - self.top_k).max() > 1e-4):
                raise TraceError(
                    f"ReplayTables.{name} has rows outside [0, 1] or not summing to top_k={self.top_k}; "
                    "pass them through cap_inclusion first."
                )

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def rows_of(self, token_ids: np.ndarray) -> np.ndarray:
        """int64[N] table row of each token id, or t (one past the last row) for tokens without measurements."""
        token_ids = np.asarray(token_ids)
        num_rows = len(self.token_vocab)
        if num_rows == 0:
            return np.zeros(len(token_ids), dtype=np.int64)
        rows = np.searchsorted(self.token_vocab, token_ids)
        seen = self.token_vocab[np.minimum(rows, num_rows - 1)] == token_ids
        return np.where(seen, rows, num_rows).astype(np.int64)


def cap_inclusion(inclusion_RE: np.ndarray, top_k: int) -> np.ndarray:
    """Make every row a valid inclusion vector: entries in [0, 1] summing to top_k.

    inclusion_RE float[R, E] non-negative -> float64[R, E]. Rows already valid come back unchanged (up to
    rounding). Entries above 1 are clipped at 1 and the other entries rescaled to carry the rest of the mass
    (repeated until nothing exceeds 1: at most E rounds); when the remaining entries are all zero the missing
    mass is spread evenly over them.
    """
    p = np.asarray(inclusion_RE, dtype=np.float64)
    if p.ndim != 2 or np.any(~np.isfinite(p)) or np.any(p < 0):
        raise TraceError("inclusion probabilities must be a finite, non-negative [rows, experts] array.")
    num_experts = p.shape[1]
    if not 1 <= top_k <= num_experts:
        raise TraceError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts}).")
    p = p.copy()
    for _ in range(num_experts + 1):
        capped = p >= 1.0
        free = ~capped
        free_mass = np.where(free, p, 0.0).sum(axis=1, keepdims=True)
        needed = top_k - capped.sum(axis=1, keepdims=True)  # mass the uncapped experts must carry
        scaled = p * np.divide(needed, free_mass, out=np.zeros_like(free_mass), where=free_mass > 0)
        spread = np.broadcast_to(needed / np.maximum(free.sum(axis=1, keepdims=True), 1), p.shape)
        p = np.where(capped, 1.0, np.where(free_mass > 0, scaled, spread))
        if not np.any(p > 1.0 + 1e-12):
            break
    return np.minimum(p, 1.0)


def systematic_sample(inclusion_EN: np.ndarray, uniforms_N: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Systematic (Madow) sampling of top_k distinct experts per token with exact inclusion probabilities.

    inclusion_EN float[E, N]: column n holds token n's probabilities (expert-major so the running sum over
    experts is a loop of contiguous vector adds); each column sums to top_k, entries in [0, 1].
    uniforms_N float[N] in [0, 1).
    Returns (positions int64[k, N], ok bool[N]): positions[:, n] are the drawn rows of column n, ascending.
    Row e is drawn iff one of the points u, u+1, ..., u+k-1 falls in [C[e-1], C[e]) with C the column's
    running sum; over u uniform that happens with probability inclusion[e, n] exactly. ok is False only where
    rounding let an interval of length ~1 catch two points (positions of such tokens are meaningless; draw
    them again with a fresh uniform).
    """
    num_experts, num_tokens = inclusion_EN.shape
    cum_EN = np.array(inclusion_EN, dtype=np.float64)  # a copy: the running sum is built in place
    for e in range(1, num_experts):  # loop over experts, vectorised over tokens
        np.add(cum_EN[e], cum_EN[e - 1], out=cum_EN[e])
    # rescale so each column ends at exactly k: total/total is exactly 1 in IEEE arithmetic
    cum_EN *= top_k / cum_EN[-1]
    # points below C[e] = ceil(C[e] - u); expert e catches a point iff that count grows from e-1 to e
    cum_EN -= uniforms_N
    points_below_EN = np.ceil(cum_EN, out=cum_EN)
    caught_EN = np.empty(points_below_EN.shape, dtype=bool)
    np.greater(points_below_EN[0], 0.0, out=caught_EN[0])
    np.greater(points_below_EN[1:], points_below_EN[:-1], out=caught_EN[1:])
    # the counts telescope to exactly k points, so fewer than k catching experts means one caught two
    ok = np.count_nonzero(caught_EN, axis=0) == top_k
    caught_EN &= ok
    expert_idx, token_idx = np.nonzero(caught_EN)
    positions_kN = np.zeros((top_k, num_tokens), dtype=np.int64)
    # the point that expert e catches is number points_below[e] - 1: that is its slot, ascending in e
    positions_kN[points_below_EN[expert_idx, token_idx].astype(np.int64) - 1, token_idx] = expert_idx
    return positions_kN, ok


def order_by_probability(experts_kN: np.ndarray, probs_kN: np.ndarray) -> np.ndarray:
    """Sort each column's experts by descending probability, ties by ascending expert id.

    experts_kN int[k, N] (ids < 2**32), probs_kN float32[k, N] non-negative -> int64[k, N].
    One uint64 key per entry: the complemented float32 bits of p (for p >= 0 the bit pattern grows with the
    value) above the expert id; an odd-even transposition sort over the k rows (k passes of vectorised
    min/max) then orders every column at once, with no per-token sort call.
    """
    p_bits = np.ascontiguousarray(probs_kN, dtype=np.float32).view(np.uint32)
    keys = (~p_bits).astype(np.uint64) << np.uint64(32) | experts_kN.astype(np.uint64)
    top_k = len(keys)
    for sweep in range(top_k):
        for i in range(sweep % 2, top_k - 1, 2):
            low = np.minimum(keys[i], keys[i + 1])
            np.maximum(keys[i], keys[i + 1], out=keys[i + 1])
            keys[i] = low
    return (keys & np.uint64(0xFFFFFFFF)).astype(np.int64)


def independent_pairs(inclusion_LtE: np.ndarray, token_count_Lt: np.ndarray, top_k: int) -> np.ndarray:
    """Expected slot-symmetrised pair counts of layer-independent replay.

    inclusion_LtE float[L, t, E] (rows sum to top_k; include a popularity row for unseen tokens if they are
    replayed), token_count_Lt int[L, t] -> float64[L-1, E, E]: entry [l, a, b] = sum_t n_t p_l(t, a)
    p_{l+1}(t, b) / k, the expected count of (a at layer l, b at layer l+1) over all k x k slot pairs divided by
    k, i.e. the expected zipped count if the slots of one layer were paired with those of the next in a random
    order. Given the token the layers are independent, so inclusions multiply. Row/column sums are the loads.
    """
    p = np.asarray(inclusion_LtE, dtype=np.float64)
    n = np.asarray(token_count_Lt, dtype=np.float64)
    pairs = [(p[i] * n[i][:, None]).T @ p[i + 1] / top_k for i in range(len(p) - 1)]
    return np.stack(pairs) if pairs else np.zeros((0, p.shape[2], p.shape[2]))


def residual_lift(cross_LEE: np.ndarray, independent_LEE: np.ndarray) -> np.ndarray:
    """float32[L-1, E, E] lift of measured pair counts over layer-independent replay, (cross + 1) / (indep + 1).

    cross_LEE: measured zipped pair counts (the NPZ cross_count); independent_LEE: `independent_pairs` scaled to
    the same total. The pseudo-count of one pair keeps empty cells finite; the lift is clipped to
    [1 / LIFT_CLIP, LIFT_CLIP] so one rare pair cannot take over a token's row.
    """
    cross = np.asarray(cross_LEE, dtype=np.float64)
    indep = np.asarray(independent_LEE, dtype=np.float64)
    return np.clip((cross + 1.0) / (indep + 1.0), 1.0 / LIFT_CLIP, LIFT_CLIP).astype(np.float32)


def tilt_inclusion(
    inclusion_NE: np.ndarray,
    previous_Nk: np.ndarray,
    previous_inclusion_NE: np.ndarray,
    log_lift_EE: np.ndarray,
    top_k: int,
) -> np.ndarray:
    """Tilt each token's inclusion probabilities by how its previous-layer draw deviates from the token's norm.

    inclusion_NE float[N, E]: the token's inclusion vector at this layer (valid rows); previous_Nk int[N, k]: the
    experts drawn at the previous recorded layer; previous_inclusion_NE float[N, E]: the token's inclusion vector
    there (what previous_Nk is on average); log_lift_EE float[E, E]: coupling x log residual lift (previous
    expert -> this expert). Returns float64[N, E]:
        q[n, b] proportional to p[n, b] * exp(sum_a (1[a in previous[n]] - p_prev[n, a]) * log_lift[a, b]),
    rescaled to sum k and water-filled at 1 (`cap_inclusion`): a valid inclusion vector with the support of p.
    The centring by p_prev makes the mean log tilt over the token's own previous draws zero, so the tilt moves
    co-occurrence within a token's routing without shifting the token's marginals (to first order).
    """
    log_w_NE = -(np.asarray(previous_inclusion_NE, dtype=np.float64) @ log_lift_EE)
    for slot in range(previous_Nk.shape[1]):  # k vectorised adds, no [N, k, E] temporary
        log_w_NE += log_lift_EE[previous_Nk[:, slot]]
    log_w_NE -= log_w_NE.max(axis=1, keepdims=True)  # exp stays <= 1; the scale is renormalised away
    q_NE = np.asarray(inclusion_NE, dtype=np.float64) * np.exp(log_w_NE)
    q_NE *= top_k / q_NE.sum(axis=1, keepdims=True)
    return cap_inclusion(q_NE, top_k)


def sample_routing(
    tables: ReplayTables, token_ids: np.ndarray, rng: np.random.Generator, layer_coupling: float = 0.0
) -> np.ndarray:
    """Draw top-k experts for every token at every recorded layer.

    token_ids int[N] -> experts int16[N, L, k]: k distinct experts per token and layer, drawn with the
    measured inclusion probabilities (popularity for tokens without measurements), slot 0 the expert with the
    highest probability. With layer_coupling = 0 layers are drawn independently given the token; with
    layer_coupling in (0, 1] layer l's probabilities are first tilted by tables.cross_lift ** layer_coupling of
    the experts drawn at layer l-1 (`tilt_inclusion`; module docstring). The random numbers drawn do not
    depend on layer_coupling, and layer_coupling = 0 takes exactly the uncoupled path.
    """
    layer_coupling = float(layer_coupling)
    if not 0.0 <= layer_coupling <= MAX_COUPLING:
        raise ConfigError(f"layer_coupling={layer_coupling} must be in [0, {MAX_COUPLING}] (0: layers independent given the token).")
    if layer_coupling > 0 and tables.cross_lift is None and tables.num_layers > 1:
        raise ConfigError(
            f"layer_coupling={layer_coupling} needs inter-layer pair counts (cross_count) in the replay tables of "
            f"{tables.model}; set model.layer_coupling=0 or use tables that hold cross_count."
        )
    token_ids = np.asarray(token_ids)
    if token_ids.ndim != 1 or not (token_ids.size == 0 or np.issubdtype(token_ids.dtype, np.integer)):
        raise TraceError(f"token_ids must be a 1-D integer array, got shape {token_ids.shape} dtype {token_ids.dtype}.")
    num_tokens, num_experts, top_k = len(token_ids), tables.num_experts, tables.top_k
    if (len(tables.token_vocab) + 1) * num_experts >= 2**31:
        raise TraceError(f"replay tables of {len(tables.token_vocab)} tokens x {num_experts} experts are too large to index.")
    experts_NLk = np.empty((num_tokens, tables.num_layers, top_k), dtype=np.int16)
    rows_N = tables.rows_of(token_ids)
    chunk = max(1, CHUNK_ELEMENTS // num_experts)
    for layer in range(tables.num_layers):
        # the popularity row is appended as row t, where rows_of sends unseen tokens
        table_tE = np.concatenate([tables.inclusion[layer], tables.popularity[layer][None]]).astype(np.float32)
        table_flat = table_tE.ravel()
        pool_EP = rng.permuted(np.tile(np.arange(num_experts, dtype=np.int32), (PERMUTATION_POOL, 1)), axis=1).T.copy()
        coupled = layer_coupling > 0 and layer > 0
        if coupled:
            log_lift_EE = layer_coupling * np.log(tables.cross_lift[layer - 1].astype(np.float64))
            previous_tE = np.concatenate([tables.inclusion[layer - 1], tables.popularity[layer - 1][None]])
        for start in range(0, num_tokens, chunk):
            rows = rows_N[start : start + chunk]
            n = len(rows)
            # expert laid out at place e; take() keeps the result C-ordered (pool[:, idx] would be token-major)
            order_EN = pool_EP.take(rng.integers(0, PERMUTATION_POOL, size=n), axis=1)
            # int32 indices halve the index traffic; systematic_sample sums in float64
            if coupled:
                previous_nk = experts_NLk[start : start + n, layer - 1].astype(np.int64)
                tilted_flat = tilt_inclusion(table_tE[rows], previous_nk, previous_tE[rows], log_lift_EE, top_k).astype(np.float32).ravel()
                probs_EN = tilted_flat[order_EN + (np.arange(n) * num_experts).astype(np.int32)]
            else:
                probs_EN = table_flat[order_EN + (rows * num_experts).astype(np.int32)]
            positions_kN, ok = systematic_sample(probs_EN, rng.random(n), top_k)
            redraws = 0
            while not ok.all():  # rounding at p ~ 1 only: vanishingly rare, redraw those tokens
                if redraws == MAX_REDRAWS:
                    raise TraceError(
                        f"replay sampling kept failing at layer {tables.layer_ids[layer]}; the table rows are not "
                        "valid inclusion probabilities (pass them through cap_inclusion)."
                    )
                redraws += 1
                bad = np.flatnonzero(~ok)
                positions_kN[:, bad], ok[bad] = systematic_sample(probs_EN[:, bad], rng.random(len(bad)), top_k)
            flat_kN = positions_kN * n + np.arange(n)
            chosen_kN = order_EN.ravel()[flat_kN]
            ordered_kN = order_by_probability(chosen_kN, probs_EN.ravel()[flat_kN])
            experts_NLk[start : start + n, layer] = ordered_kN.T
    return experts_NLk


def load_replay_tables(paths: list[Path] | Path, min_count: int = 1) -> ReplayTables:
    """Read one or more olmoe-routing NPZ files of one model (domains merged by adding counts).

    A directory stands for every `*.npz` inside it. Tokens seen fewer than `min_count` times are dropped
    (they replay from popularity). The model name is the files' folder name (e.g. `mixtral-8x7b`).
    """
    files = _expand_table_paths(paths)
    if int(min_count) < 1:
        raise ConfigError(f"min_count={min_count} must be at least 1 (tokens seen fewer times replay from popularity).")
    parts = [_read_table_file(f) for f in files]
    first, first_file = parts[0], files[0]
    for part, f in zip(parts[1:], files[1:], strict=True):
        for key in ("model", "num_experts", "top_k", "layers"):
            if not np.array_equal(np.asarray(part[key]), np.asarray(first[key])):
                raise ConfigError(
                    f"replay tables {first_file} and {f} disagree on {key} ({first[key]} vs {part[key]}); "
                    "merge only domains of one model."
                )
    num_layers, num_experts, top_k = len(first["layers"]), first["num_experts"], first["top_k"]
    layer_M = np.concatenate([p["tte_layer"] for p in parts]).astype(np.int64)
    token_M = np.concatenate([p["tte_token"] for p in parts]).astype(np.int64)
    expert_M = np.concatenate([p["tte_expert"] for p in parts]).astype(np.int64)
    count_M = np.concatenate([p["tte_count"] for p in parts]).astype(np.float64)
    vocab = np.unique(token_M)
    flat = (layer_M * len(vocab) + np.searchsorted(vocab, token_M)) * num_experts + expert_M
    counts_LtE = np.bincount(flat, weights=count_M, minlength=num_layers * len(vocab) * num_experts)
    counts_LtE = counts_LtE.reshape(num_layers, len(vocab), num_experts)
    occurrences_Lt = counts_LtE.sum(axis=2) / top_k  # every occurrence adds k assignments
    keep = occurrences_Lt.min(axis=0) >= int(min_count) if len(vocab) else np.zeros(0, bool)
    dropped_Lt = occurrences_Lt[:, ~keep].sum(axis=1)  # occurrences that replay from popularity
    counts_LtE, occurrences_Lt, vocab = counts_LtE[:, keep], occurrences_Lt[:, keep], vocab[keep]
    inclusion = counts_LtE / np.maximum(occurrences_Lt, 1e-300)[..., None]
    inclusion = cap_inclusion(inclusion.reshape(-1, num_experts), top_k).reshape(inclusion.shape)
    load_LE = np.sum([p["expert_count"] for p in parts], axis=0).astype(np.float64)
    popularity = cap_inclusion(load_LE / np.maximum(load_LE.sum(axis=1, keepdims=True) / top_k, 1e-300), top_k)
    cross_lift = None
    if all(p.get("cross_count") is not None for p in parts) and num_layers > 1:
        cross_LEE = np.sum([p["cross_count"] for p in parts], axis=0).astype(np.float64)
        # what independent replay of these very tables produces, popularity rows included
        independent = independent_pairs(
            np.concatenate([inclusion, popularity[:, None]], axis=1),
            np.concatenate([occurrences_Lt, dropped_Lt[:, None]], axis=1),
            top_k,
        )
        scale = cross_LEE.sum(axis=(1, 2), keepdims=True) / np.maximum(independent.sum(axis=(1, 2), keepdims=True), 1e-300)
        cross_lift = residual_lift(cross_LEE, independent * scale)
    return ReplayTables(
        model=first["model"],
        num_experts=num_experts,
        top_k=top_k,
        layer_ids=tuple(int(x) for x in first["layers"]),
        token_vocab=vocab.astype(np.int32),
        inclusion=inclusion.astype(np.float32),
        popularity=popularity.astype(np.float32),
        token_count=np.rint(occurrences_Lt).astype(np.int64),
        cross_lift=cross_lift,
    )


def _expand_table_paths(paths) -> list[Path]:
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not items:
        raise ConfigError("no replay table files given; pass the olmoe-routing NPZ files of one model (model.tables).")
    files: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(path.glob("*.npz"))
            if not found:
                raise ConfigError(f"replay table folder {path} holds no .npz files; pass the olmoe-routing NPZ files of one model.")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(
                f"replay table {path} does not exist; pass model.tables=[<path to olmoe-routing/<model>/<domain>.npz>, ...] "
                "or set REPRO_SHARED_DATA to the folder holding olmoe-routing."
            )
    return files


def _read_table_file(path: Path) -> dict:
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in TABLE_KEYS if k not in npz.files]
            if missing:
                raise TraceError(
                    f"{path} is not a replay table (missing {', '.join(missing)}); expected the olmoe-routing NPZ "
                    "format of shared/data/README.md."
                )
            d = {k: np.asarray(npz[k]) for k in TABLE_KEYS}
            d["cross_count"] = np.asarray(npz["cross_count"]) if "cross_count" in npz.files else None
    except (OSError, ValueError, EOFError) as e:
        raise TraceError(f"{path} cannot be read as an NPZ file ({e}); re-create or re-download it.") from e
    num_layers, num_experts, top_k = len(d["layers"]), int(d["num_experts"]), int(d["top_k"])
    coo = [d[k] for k in ("tte_layer", "tte_token", "tte_expert", "tte_count")]
    problem = None
    if not 1 <= top_k <= num_experts:
        problem = f"top_k={top_k} with num_experts={num_experts}"
    elif len({len(a) for a in coo}) != 1:
        problem = "tte_* arrays of different lengths"
    elif len(coo[0]) and (coo[0].min() < 0 or coo[0].max() >= num_layers):
        problem = f"tte_layer outside 0..{num_layers - 1}"
    elif len(coo[0]) and (coo[2].min() < 0 or coo[2].max() >= num_experts):
        problem = f"tte_expert outside 0..{num_experts - 1}"
    elif len(coo[0]) and (coo[1].min() < 0 or coo[3].min() < 0):
        problem = "negative token ids or counts"
    elif d["expert_count"].shape != (num_layers, num_experts):
        problem = f"expert_count of shape {d['expert_count'].shape}, expected {(num_layers, num_experts)}"
    elif d["cross_count"] is not None and d["cross_count"].shape != (num_layers - 1, num_experts, num_experts):
        problem = f"cross_count of shape {d['cross_count'].shape}, expected {(num_layers - 1, num_experts, num_experts)}"
    if problem:
        raise TraceError(f"{path} is inconsistent ({problem}); re-create it from the routing counts.")
    d.update(model=path.parent.name, num_experts=num_experts, top_k=top_k)
    return d


def resolve_table_paths(spec) -> list[Path]:
    """Config value (a path, a glob, or a list of them) -> sorted existing files.

    Relative paths are tried against the working directory first, then the project root, so a config's
    default `../shared/data/...` works from the repository and from a Hydra run directory alike.
    """
    patterns = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec or [])
    if not patterns:
        raise ConfigError("model.tables is empty; list the olmoe-routing NPZ files (globs allowed) to replay.")
    files: list[Path] = []
    for pattern in map(str, patterns):
        candidates = [pattern] if os.path.isabs(pattern) else [pattern, str(PROJECT_ROOT / pattern)]
        matches: list[str] = []
        for candidate in candidates:
            if glob.has_magic(candidate):
                matches = sorted(glob.glob(candidate))
            else:
                matches = [candidate] if os.path.exists(candidate) else []
            if matches:
                break
        if not matches:
            raise ConfigError(
                f"replay table {pattern!r} matches no file; pass model.tables=[<path to olmoe-routing/<model>/*.npz>] "
                "or set REPRO_SHARED_DATA to the folder holding olmoe-routing."
            )
        files.extend(Path(m) for m in matches)
    return files


def route_with_replay(
    model_cfg: dict,
    requests: list[Request],
    train_requests: list[Request],
    *,
    cache_dir: Path,
    seed: int,
    dataset: str,
    tokenizer: str,
    vocab_size: int,
) -> RoutingTrace:
    """Route the prompts of `requests` by replaying measured tables (model_cfg: conf/model/replay_*.yaml).

    model_cfg keys: name, kind ("replay"), tables (paths or globs of NPZ files), tokenizer (the tokenizer
    the tables' ids come from; it must match the workload's), min_count (default 1), layer_coupling (default 0:
    layers independent given the token; see the module docstring). `train_requests` and
    `cache_dir` are unused: the tables are measured already and loading them takes well under a second.
    Every request's prompt is routed (prefill_len = prompt length); generated tokens are not replayed.
    """
    del train_requests, cache_dir
    table_tokenizer = str(model_cfg.get("tokenizer", "") or "")
    if table_tokenizer and tokenizer and table_tokenizer != tokenizer:
        raise ConfigError(
            f"replay tables of {model_cfg.get('name', 'this model')} hold {table_tokenizer!r} token ids but the workload "
            f"was tokenized with {tokenizer!r}; tokenize the workload with {table_tokenizer!r} or pick the matching replay model."
        )
    if not requests:
        raise WorkloadError("route_with_replay got no requests; the workload is empty after filtering.")
    files = resolve_table_paths(model_cfg.get("tables"))
    min_count = int(model_cfg.get("min_count", 1) or 1)
    tables = load_replay_tables(files, min_count=min_count)
    token_ids = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in requests])
    layer_coupling = float(model_cfg.get("layer_coupling", 0.0) or 0.0)
    experts = sample_routing(tables, token_ids, np.random.default_rng(seed), layer_coupling=layer_coupling)
    seen = tables.rows_of(token_ids) < len(tables.token_vocab)
    meta = TraceMeta(
        model=tables.model,
        num_experts=tables.num_experts,
        top_k=tables.top_k,
        layer_ids=tables.layer_ids,
        vocab_size=int(vocab_size),
        tokenizer=tokenizer or table_tokenizer,
        source="replay",
        dataset=dataset,
        extra={
            "tables": [str(f) for f in files],
            "min_count": min_count,
            "seed": int(seed),
            "token_coverage": float(seen.mean()) if len(seen) else 0.0,
            "layer_coupling": layer_coupling,
            "layers_independent": layer_coupling == 0,
        },
    )
    return prompts_trace(meta, requests, experts)
