"""Decode placement by prefill signature (beyond the paper): Attention-DP decode routed by a request's observed
prefill activations, as a PD-disaggregated engine's router could do it.

After a request's prefill its actual expert usage is known; ELDR (arXiv 2607.00466) reports that it predicts the
decode phase's usage (prefill-to-decode signature correlation 0.70-0.92 on three real MoEs). With
prefill/decode disaggregation the decode rank is chosen anyway, so choosing it by signature costs nothing extra;
with EP, co-placing experts with the decode clusters turns the prediction into locality.

Offline, on the profile split (`SignatureDecode.fit`):
1. each request's prefill signature: per layer, the normalised histogram of its prompt tokens' experts, flattened
   to [L*E] (`request_signatures`);
2. D balanced clusters of the profile requests by signature (`balanced_kmeans`: k-means whose assignment step is
   Sem-MoE's capacity mask, `semmoe.cocluster.capacity_assign`), cluster c meant for device c;
3. placement="signature": per layer, each device gets E/D experts, those the decode tokens of its cluster activate
   most, traded against expert load (`place_balanced`: Sem-MoE's greedy placement with its load term, weight
   load_weight); "signature_exact" maximises the local decode activations alone (`place_by_activations`, a linear
   assignment), which can pile hot experts on one device; "vanilla" keeps EP's blocks;
   placement="signature_time" (the default, chosen on the validate split by the decode time per step, issue 27)
   starts from "signature" and swaps experts between devices while that shortens the profile's decode steps
   (`place_for_decode_time`: per step, the busiest device's expert weights read plus the busiest rank's remote
   copies / read_copies, with each profile request on the rank the decode rule gives it): co-activated experts a
   co-placement piles on one device are spread unless their locality pays for it; "time" does the same from EP's
   blocks.
Online (`SignaturePlan`): prefill runs round-robin (`Plan.assign_requests`); after its prefill each request's
decode rank is chosen from its own prompt routing only (`assign_decode`), one request at a time:
- rule="capacity": the best-matching rank among those with fewer than min + capacity_slack decode requests
  (capacity_slack=1: every window of D requests puts one on every rank, the paper's round-robin mask);
- rule="eldr": ELDR's rule, the least-loaded (fewest decode requests) of the eldr_top best-matching ranks.
Match: match="centroid" scores rank d by -||signature - centroid_d||^2 (needs the clusters);
match="experts" by the share of the request's prefill activations whose expert sits on d (any placement).

The evaluator accounts prompt tokens on the prefill rank and generated tokens on the decode rank
(`repro.eval.accounting.decode_homes`); decode-phase LAR, balance and time are measured there.

Legend: R requests, N tokens, L MoE layers, E experts, k experts per token, D devices, F = L*E signature length.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from scipy.optimize import linear_sum_assignment

from repro.errors import ConfigError, ReproError
from repro.parallel import ParallelConfig
from repro.systems.base import Placement, Plan
from repro.systems.ep import contiguous_placement
from repro.systems.semmoe.cocluster import capacity_assign, place_experts
from repro.traces import RoutingTrace

# token rows per histogram chunk in request_signatures: int64 keys of chunk x L x k stay a few MB
SIGNATURE_CHUNK = 1 << 14

PLACEMENTS = ("signature", "signature_exact", "signature_time", "time", "vanilla")
# token copies on the busiest rank that cost as much as reading one expert's weights, on the DeepSeek-V2-Lite shape
# at H200 (conf/hardware/h200.yaml, nccl): 3 x 2048 x 1408 x 2 B / (4.8 TB/s x 0.8) = 4.5 us per expert against
# 2 x 4096 B / 290 GB/s = 28 ns per copy (dispatch + combine)
READ_COPIES = 160.0
RULES = ("capacity", "eldr")
MATCHES = ("centroid", "experts")


# ---- pure functions ------------------------------------------------------------------------------------------


def segment_counts(experts_NLk: np.ndarray, starts: np.ndarray, stops: np.ndarray, num_experts: int) -> np.ndarray:
    """float64[R, L, E] activations of expert e at layer l by the tokens starts[r] <= n < stops[r] of request r.

    experts_NLk int[N, L, k] (a memory-mapped trace array is fine: rows are read in chunks); starts, stops int[R]
    token indices into it (stops >= starts; an empty segment gives a zero row).
    """
    starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
    num_requests = len(starts)
    _, num_layers, _ = experts_NLk.shape
    if stops.shape != starts.shape or np.any(stops < starts):
        raise ReproError("segment_counts needs starts and stops of one shape with stops >= starts.")
    lengths = stops - starts
    rows = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) + np.arange(lengths.sum())
    request = np.repeat(np.arange(num_requests), lengths)
    counts = np.zeros(num_requests * num_layers * num_experts, dtype=np.int64)
    layer_base = np.arange(num_layers, dtype=np.int64)[None, :, None] * num_experts
    for first in range(0, len(rows), SIGNATURE_CHUNK):
        take = rows[first : first + SIGNATURE_CHUNK]
        experts = np.asarray(experts_NLk[take], dtype=np.int64)  # [n, L, k]
        keys = request[first : first + SIGNATURE_CHUNK, None, None] * (num_layers * num_experts) + layer_base + experts
        counts += np.bincount(keys.ravel(), minlength=len(counts))
    return counts.reshape(num_requests, num_layers, num_experts).astype(np.float64)


def normalise_signature(counts_RLE: np.ndarray) -> np.ndarray:
    """float64[R, L*E]: each layer's counts divided by their sum (a layer without tokens stays zero), flattened."""
    totals = counts_RLE.sum(axis=2, keepdims=True)
    shares = np.divide(counts_RLE, totals, out=np.zeros_like(counts_RLE, dtype=np.float64), where=totals > 0)
    return shares.reshape(len(counts_RLE), -1)


def request_signatures(trace: RoutingTrace, phase: str) -> np.ndarray:
    """float64[R, L*E] each request's prefill (phase="prefill": prompt tokens) or decode (phase="decode":
    generated tokens) signature: per layer the normalised histogram of its tokens' experts, flattened."""
    if phase not in ("prefill", "decode"):
        raise ConfigError(f"signature phase must be 'prefill' or 'decode', got {phase!r}.")
    starts = trace.offsets[:-1]
    middle = starts + trace.prefill_len.astype(np.int64)
    lo, hi = (starts, middle) if phase == "prefill" else (middle, trace.offsets[1:])
    return normalise_signature(segment_counts(trace.experts, lo, hi, trace.meta.num_experts))


def row_pearson(a_RF: np.ndarray, b_RF: np.ndarray) -> np.ndarray:
    """float64[R] Pearson correlation of row r of a with row r of b (NaN where either row is constant)."""
    a = a_RF - a_RF.mean(axis=1, keepdims=True)
    b = b_RF - b_RF.mean(axis=1, keepdims=True)
    norm = np.sqrt((a * a).sum(axis=1) * (b * b).sum(axis=1))
    dot = (a * b).sum(axis=1)
    return np.divide(dot, norm, out=np.full(len(dot), np.nan), where=norm > 0)


def signature_correlation(prefill_RF: np.ndarray, decode_RF: np.ndarray, *, centred: bool = False) -> float:
    """Mean over requests of the Pearson correlation between a request's prefill and decode signatures
    (float[R, F] each, `request_signatures`); requests with no decode (or no prompt) tokens are left out.
    NaN when no request has both.

    The plain correlation (ELDR's) is high whenever expert popularity is skewed, even if requests are alike: the
    shared popularity profile correlates with itself. centred=True first subtracts each phase's mean signature over
    the requests, so only what is specific to the request counts (what routing by signature can exploit)."""
    has_both = (prefill_RF.sum(axis=1) > 0) & (decode_RF.sum(axis=1) > 0)
    if not has_both.any():
        return float("nan")
    prefill, decode = prefill_RF[has_both], decode_RF[has_both]
    if centred:
        prefill, decode = prefill - prefill.mean(axis=0), decode - decode.mean(axis=0)
    return float(np.nanmean(row_pearson(prefill, decode)))


def squared_distances(points_RF: np.ndarray, centroids_DF: np.ndarray) -> np.ndarray:
    """float64[R, D] squared Euclidean distance of every point to every centroid."""
    return ((points_RF**2).sum(axis=1)[:, None] - 2.0 * points_RF @ centroids_DF.T
            + (centroids_DF**2).sum(axis=1)[None, :])


def balanced_kmeans(
    points_RF: np.ndarray, num_clusters: int, rng: np.random.Generator, iters: int = 30, slack: float = 0.0
) -> tuple[np.ndarray, np.ndarray, int]:
    """(labels int64[R], centroids float64[D, F], iterations run): k-means with at most (1 + slack) x R / D points
    per cluster.

    Seeded k-means++ start; each assignment step is `capacity_assign` on -distance (every point proposes to its
    nearest open cluster, a cluster keeps its nearest proposers up to capacity); centroids are the members' means
    (an empty cluster keeps its centroid). Stops when the labels repeat or after `iters` rounds.
    """
    num_points = len(points_RF)
    if num_points < num_clusters:
        raise ConfigError(f"balanced_kmeans needs at least {num_clusters} points (one per cluster), got {num_points}.")
    first = int(rng.integers(num_points))
    centroids = [points_RF[first]]
    for _ in range(1, num_clusters):  # k-means++: next centre drawn in proportion to the squared distance
        dist = squared_distances(points_RF, np.array(centroids)).min(axis=1).clip(min=0.0)
        total = dist.sum()
        pick = int(rng.choice(num_points, p=dist / total)) if total > 0 else int(rng.integers(num_points))
        centroids.append(points_RF[pick])
    centroids = np.array(centroids, dtype=np.float64)
    labels = np.full(num_points, -1, dtype=np.int64)
    ones = np.ones(num_points)
    for iteration in range(1, iters + 1):
        new = capacity_assign(-squared_distances(points_RF, centroids), ones, slack)
        if np.array_equal(new, labels):
            return labels, centroids, iteration
        labels = new
        sums = np.zeros_like(centroids)
        np.add.at(sums, labels, points_RF)
        sizes = np.bincount(labels, minlength=num_clusters)
        filled = sizes > 0
        centroids[filled] = sums[filled] / sizes[filled, None]
    return labels, centroids, iters


def place_by_activations(cluster_act_LDE: np.ndarray) -> np.ndarray:
    """int64[L, E] expert -> device with exactly E/D experts per device, maximising per layer the activations
    sum_e cluster_act[l, device(e), e] (device d serves cluster d's tokens): a linear assignment of experts to
    E slots, slot s on device s // (E/D), as Sem-MoE's exact placement step does (semmoe.cocluster.place_experts).
    It ignores expert load: `place_balanced` is the load-aware variant."""
    num_layers, num_devices, num_experts = cluster_act_LDE.shape
    if num_experts % num_devices:
        raise ConfigError(f"{num_experts} experts do not split evenly over {num_devices} devices.")
    capacity = num_experts // num_devices
    expert_device = np.empty((num_layers, num_experts), dtype=np.int64)
    for layer in range(num_layers):  # O(E^3) each, E <= a few hundred
        slot_gain = np.repeat(cluster_act_LDE[layer], capacity, axis=0)  # [E slots, E]
        experts, slots = linear_sum_assignment(slot_gain.T, maximize=True)
        expert_device[layer, experts] = slots // capacity
    return expert_device


def place_balanced(cluster_act_LDE: np.ndarray, rng: np.random.Generator, load_weight: float = 1.0,
                   ft_steps: int = 64) -> np.ndarray:
    """int64[L, E] expert -> device, E/D per device, trading the clusters' local activations against expert load:
    Sem-MoE's greedy placement (`semmoe.cocluster.place_experts`, experts in descending load, each to the device
    maximising its share of the expert's activations minus load_weight x its load beyond the fair share, then
    ft_steps swaps that gain without raising the layer's busiest device), with co-activation left out."""
    num_layers, _, num_experts = cluster_act_LDE.shape
    hotness = cluster_act_LDE.sum(axis=1)
    no_coactivation = np.zeros((num_layers, num_experts, num_experts), dtype=np.float32)
    return place_experts(cluster_act_LDE, hotness, no_coactivation, cluster_act_LDE.shape[1], rng, alpha=0.0,
                         beta=1.0, gamma=load_weight, ft_steps=ft_steps)


def decode_step_tables(experts_NLk: np.ndarray, offsets: np.ndarray, prefill_len: np.ndarray, rank_R: np.ndarray,
                       num_experts: int, num_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """(active float32[L, K, E], sent float32[L, K, D, E]) of the decode steps of a trace whose request r decodes on
    rank_R[r]: step t holds every request's t-th generated token (a static batch, as the evaluator serves decode);
    active[l, t, e] = 1 when some token of step t activates expert e at layer l (its weights are read), sent[l, t,
    d, e] = activations of expert e by step t's tokens living on rank d."""
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    generated = lengths - np.asarray(prefill_len, dtype=np.int64)
    rows = np.repeat(offsets[:-1] + prefill_len, generated) + (
        np.arange(generated.sum()) - np.repeat(np.cumsum(generated) - generated, generated))
    step = np.arange(generated.sum()) - np.repeat(np.cumsum(generated) - generated, generated)
    rank = np.repeat(np.asarray(rank_R, dtype=np.int64), generated)
    experts = np.asarray(experts_NLk[rows], dtype=np.int64)  # [n, L, k]
    _, num_layers, _ = experts.shape
    num_steps = int(step.max()) + 1 if len(step) else 0
    keys = (((np.arange(num_layers)[None, :, None] * num_steps + step[:, None, None]) * num_devices
             + rank[:, None, None]) * num_experts + experts)
    sent = np.bincount(keys.ravel(), minlength=num_layers * num_steps * num_devices * num_experts)
    sent = sent.reshape(num_layers, num_steps, num_devices, num_experts).astype(np.float32)
    return (sent.sum(axis=2) > 0).astype(np.float32), sent


def decode_step_cost(expert_device_E: np.ndarray, active_KE: np.ndarray, sent_KDE: np.ndarray,
                     read_copies: float) -> float:
    """Surrogate of one layer's decode time summed over steps, in expert-weight reads: per step, the busiest
    device's distinct active experts (the weights it reads) plus the busiest rank's remote copies (max of sent and
    received activations) divided by read_copies (the copies that cost as much as reading one expert's weights)."""
    num_devices = sent_KDE.shape[1]
    reads, remote = _device_loads(expert_device_E, active_KE, sent_KDE, num_devices)
    return float(reads.max(axis=1).sum() + remote.max(axis=1).sum() / read_copies)


def _device_loads(expert_device_E, active_KE, sent_KDE, num_devices):
    """(reads float[K, D], remote float[K, D]): active experts each device holds, and max(sent, received) remote
    activations of each rank, per step."""
    onehot_ED = np.eye(num_devices, dtype=np.float32)[expert_device_E]
    reads = active_KE @ onehot_ED
    on_device_KDD = np.einsum("kse,ed->ksd", sent_KDE, onehot_ED)  # from rank s to device d
    local = np.einsum("kdd->kd", on_device_KDD)
    send = on_device_KDD.sum(axis=2) - local
    recv = on_device_KDD.sum(axis=1) - local
    return reads, np.maximum(send, recv)


def place_for_decode_time(active_LKE: np.ndarray, sent_LKDE: np.ndarray, expert_device_LE: np.ndarray,
                          read_copies: float, max_swaps: int = 64) -> np.ndarray:
    """int64[L, E] expert -> device (E/D per device kept) improving `decode_step_cost` from expert_device_LE by
    best-improvement swaps: each round prices every swap of an expert of a device that is the busiest in some step
    with an expert of another device (vectorised: a swap changes two devices' columns only), and applies the best
    one while it lowers the layer's cost (at most max_swaps per layer).

    active_LKE float[L, K, E], sent_LKDE float[L, K, D, E] from `decode_step_tables` (the profile's decode steps
    with its requests on the ranks the decode rule would give them). Co-activated experts piled on one device make
    it the busiest in the steps they are active together; the swaps spread them unless locality pays for it."""
    out = np.array(expert_device_LE, dtype=np.int64, copy=True)
    num_layers, num_steps, num_devices, num_experts = sent_LKDE.shape
    chunk = max(1, (1 << 22) // max(1, num_steps * num_devices))  # candidates priced at once
    for layer in range(num_layers):
        active, sent, where = active_LKE[layer], sent_LKDE[layer], out[layer]
        total_KE = sent.sum(axis=1)  # activations of e in step k from all ranks
        rank_total_KD = sent.sum(axis=2)
        for _ in range(max_swaps):
            onehot = np.eye(num_devices, dtype=np.float32)[where]
            reads = active @ onehot  # [K, D]
            diag = np.einsum("kde,ed->kd", sent, onehot)  # local activations of each rank
            colsum = total_KE @ onehot  # activations each device serves
            remote = np.maximum(rank_total_KD - diag, colsum - diag)
            best = float(reads.max(axis=1).sum() + remote.max(axis=1).sum() / read_copies)
            hot = np.unique((reads + remote / read_copies).argmax(axis=1))
            e_c, f_c = np.nonzero(np.isin(where, hot)[:, None] & (where[:, None] != where[None, :]))
            if not len(e_c):
                break
            costs = np.empty(len(e_c))
            for lo in range(0, len(e_c), chunk):
                e, f = e_c[lo : lo + chunk], f_c[lo : lo + chunk]
                d1, d2 = where[e], where[f]
                steps = np.arange(num_steps)[None, :]
                r = np.repeat(reads[None], len(e), axis=0)  # [C, K, D]
                m = np.repeat(remote[None], len(e), axis=0)
                move = (active[:, f] - active[:, e]).T  # [C, K]
                r[np.arange(len(e))[:, None], steps, d1[:, None]] += move
                r[np.arange(len(e))[:, None], steps, d2[:, None]] -= move
                for d, gone, come in ((d1, e, f), (d2, f, e)):
                    new_diag = diag[:, d].T - sent[:, d, gone].T + sent[:, d, come].T  # [C, K]
                    new_col = colsum[:, d].T - total_KE[:, gone].T + total_KE[:, come].T
                    new_send = rank_total_KD[:, d].T - new_diag
                    m[np.arange(len(e))[:, None], steps, d[:, None]] = np.maximum(new_send, new_col - new_diag)
                costs[lo : lo + chunk] = r.max(axis=2).sum(axis=1) + m.max(axis=2).sum(axis=1) / read_copies
            pick = int(costs.argmin())
            if costs[pick] >= best - 1e-6:
                break
            e, f = e_c[pick], f_c[pick]
            where[e], where[f] = where[f], where[e]
    return out


def device_expert_mask(placement: Placement) -> np.ndarray:
    """float64[L*E, D]: 1 where device d holds a replica of expert e of layer l (row l*E + e)."""
    present = placement.replicas() > 0  # [L, E, D]
    return present.reshape(-1, placement.num_devices).astype(np.float64)


# ---- online: the decode router ---------------------------------------------------------------------------------


class SignaturePlan(Plan):
    """Round-robin prefill; decode rank per request from its observed prefill signature (see the module doc).

    centroids float64[D, F] (match="centroid"); the only online state is each rank's decode-request count.
    """

    def __init__(self, placement: Placement, parallel: ParallelConfig, *, centroids: np.ndarray | None, rule: str,
                 match: str, capacity_slack: int, eldr_top: int, info: dict | None = None):
        self.centroids = centroids
        self.rule, self.match = rule, match
        self.capacity_slack, self.eldr_top = int(capacity_slack), int(eldr_top)
        self._expert_mask = device_expert_mask(placement)
        super().__init__(placement, parallel, info)

    def reset(self) -> None:
        super().reset()
        self._decode_count = np.zeros(self.parallel.devices, dtype=np.int64)

    def write_files(self, directory: Path) -> None:
        """The placement and plan_info.json, plus signature.json (the decode rule) and centroids.npy (match=centroid)."""
        super().write_files(directory)
        rule = {"rule": self.rule, "match": self.match, "capacity_slack": self.capacity_slack, "eldr_top": self.eldr_top}
        (directory / "signature.json").write_text(json.dumps(rule))
        if self.centroids is not None:
            np.save(directory / "centroids.npy", self.centroids, allow_pickle=False)

    @classmethod
    def load(cls, directory: str | Path, parallel: ParallelConfig, num_experts: int) -> SignaturePlan:
        """Read a plan written by `save` (its decode rule and centroids; online state starts fresh)."""
        directory = Path(directory)
        try:
            rule = json.loads((directory / "signature.json").read_text())
            info = json.loads((directory / "plan_info.json").read_text())
            centroids = np.load(directory / "centroids.npy", allow_pickle=False) if rule["match"] == "centroid" else None
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"{directory} does not hold a saved signature plan ({e}); write one with plan.save().") from e
        placement = Placement.load(directory, parallel.devices, num_experts)
        if centroids is not None and centroids.shape != (parallel.devices, placement.num_layers * num_experts):
            raise ConfigError(f"{directory / 'centroids.npy'} is {centroids.shape}, not [devices, layers x experts].")
        return cls(placement, parallel, centroids=centroids, rule=rule["rule"], match=rule["match"],
                   capacity_slack=rule["capacity_slack"], eldr_top=rule["eldr_top"], info=info)

    def similarity(self, signatures_RF: np.ndarray) -> np.ndarray:
        """float64[R, D] how well each rank matches each request's prefill signature (higher is better)."""
        if self.match == "centroid":
            return -squared_distances(signatures_RF, self.centroids)
        return signatures_RF @ self._expert_mask  # expected local share, summed over layers

    def assign_decode(self, prompt_experts: np.ndarray, prompt_offsets: np.ndarray, prefill_ranks: np.ndarray) -> np.ndarray:
        """int64[R] decode rank of each request, streaming (later calls continue the counts).

        prompt_experts int[Np, L, k]: the routing of the requests' prompt tokens only (what a router knows once
        the prefill is done); prompt_offsets int64[R+1] into it; prefill_ranks int[R] (unused here: any rank can
        take the decode, as in PD disaggregation).
        """
        num_experts = self.placement.num_experts
        counts = segment_counts(prompt_experts, prompt_offsets[:-1], prompt_offsets[1:], num_experts)
        return self.decide(normalise_signature(counts))

    def decide(self, signatures_RF: np.ndarray) -> np.ndarray:
        """int64[R] decode rank of each request from its prefill signature float[R, F] (what an engine accumulates
        from the router outputs during prefill), streaming: the decision alone, without the histogram."""
        score = self.similarity(np.asarray(signatures_RF, dtype=np.float64))
        # each request's ranks from best to worst match (stable: the lower rank on a tie), as plain lists: the
        # streaming loop below is then a few Python operations per request
        preferences = np.argsort(-score, axis=1, kind="stable").tolist()
        count = self._decode_count.tolist()
        top, slack, capacity = min(self.eldr_top, self.parallel.devices), self.capacity_slack, self.rule == "capacity"
        ranks = []
        for prefs in preferences:  # one request at a time: each decision sees the counts so far
            if capacity:  # the best match among ranks below min + capacity_slack decode requests
                floor = min(count) + slack
                rank = next(d for d in prefs if count[d] < floor)
            else:  # ELDR: least loaded among the `top` best matches, the better match on a tie
                rank = min(prefs[:top], key=count.__getitem__)
            ranks.append(rank)
            count[rank] += 1
        self._decode_count[:] = count
        return np.array(ranks, dtype=np.int64)


class SignatureDecode:
    """Balanced clusters of prefill signatures, experts placed by the clusters' decode activations, decode routed
    by observed prefill signature (Attention-DP only). Parameters: see conf/system/signature.yaml."""

    name = "signature"
    kind = "system"

    def __init__(self, placement: str = "signature_time", rule: str = "capacity", match: str = "centroid",
                 capacity_slack: int = 1, eldr_top: int = 2, kmeans_iters: int = 30, cluster_slack: float = 0.0,
                 load_weight: float = 1.0, read_copies: float = READ_COPIES, time_swaps: int = 64):
        choices = {"placement": (placement, PLACEMENTS), "rule": (rule, RULES), "match": (match, MATCHES)}
        for key, (value, allowed) in choices.items():
            if value not in allowed:
                raise ConfigError(f"system.params.{key}={value!r} is not one of {list(allowed)}.")
        for key, value in (("capacity_slack", capacity_slack), ("eldr_top", eldr_top), ("kmeans_iters", kmeans_iters),
                           ("time_swaps", time_swaps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"system.params.{key} must be an integer >= 1, got {value!r}.")
        if not isinstance(cluster_slack, int | float) or isinstance(cluster_slack, bool) or not 0 <= cluster_slack <= 1:
            raise ConfigError(f"system.params.cluster_slack must be a number in [0, 1], got {cluster_slack!r}.")
        if not isinstance(load_weight, int | float) or isinstance(load_weight, bool) or not 0 <= load_weight < np.inf:
            raise ConfigError(f"system.params.load_weight must be a finite number >= 0, got {load_weight!r}.")
        if not isinstance(read_copies, int | float) or isinstance(read_copies, bool) or not 0 < read_copies < np.inf:
            raise ConfigError(f"system.params.read_copies must be a finite number > 0, got {read_copies!r}.")
        if placement in ("vanilla", "time") and match == "centroid":
            raise ConfigError(
                f"placement={placement} puts no cluster on a device, so match=centroid has no rank to point to; use "
                f"match=experts with placement={placement}."
            )
        self.placement, self.rule, self.match = placement, rule, match
        self.capacity_slack, self.eldr_top = capacity_slack, eldr_top
        self.kmeans_iters, self.cluster_slack = kmeans_iters, float(cluster_slack)
        self.load_weight = float(load_weight)
        self.read_copies, self.time_swaps = float(read_copies), time_swaps

    def fit(self, profile: RoutingTrace, parallel: ParallelConfig, rng: np.random.Generator) -> SignaturePlan:
        if parallel.attention != "dp":
            raise ConfigError("system=signature places decode requests on Attention-DP ranks; set parallel.attention=dp.")
        parallel.check_experts(profile.meta.num_experts)
        num_devices, num_experts = parallel.devices, profile.meta.num_experts
        decode_tokens = int((profile.lengths() - profile.prefill_len).sum())
        if self.placement != "vanilla" and decode_tokens == 0:
            raise ConfigError(
                "the profile has no generated tokens (prefill_len = length everywhere), so there are no decode "
                "activations to place experts by; route with generation (model.max_new_tokens > 0), import a trace "
                "with a phase or prefill_len column, or use placement=vanilla."
            )
        starts, middle = profile.offsets[:-1], profile.offsets[:-1] + profile.prefill_len.astype(np.int64)
        prefill = normalise_signature(segment_counts(profile.experts, starts, middle, num_experts))
        decode_counts = segment_counts(profile.experts, middle, profile.offsets[1:], num_experts)  # [R, L, E]
        info = {"placement": self.placement, "rule": self.rule, "match": self.match,
                "profile_decode_tokens": decode_tokens}
        decode = normalise_signature(decode_counts)
        for key, centred in (("profile_signature_correlation", False), ("profile_signature_correlation_centred", True)):
            correlation = signature_correlation(prefill, decode, centred=centred)
            if np.isfinite(correlation):  # NaN without decode tokens: left out rather than reported
                info[key] = correlation
        centroids = None
        if self.placement == "time":  # EP's blocks, then swaps that shorten the decode step (no clusters)
            expert_device = contiguous_placement(profile.num_layers, num_experts, num_devices).expert_device()
            placement = self._for_decode_time(expert_device, profile, parallel, None, info)
        elif self.placement != "vanilla":  # clusters are needed only to co-place experts with them
            labels, centroids, iterations = balanced_kmeans(
                prefill, num_devices, rng, self.kmeans_iters, self.cluster_slack
            )
            cluster_act = np.zeros((num_devices, profile.num_layers, num_experts))
            np.add.at(cluster_act, labels, decode_counts)
            cluster_act = cluster_act.transpose(1, 0, 2)  # [L, D, E]
            expert_device = (place_by_activations(cluster_act) if self.placement == "signature_exact"
                             else place_balanced(cluster_act, rng, self.load_weight))
            if self.placement == "signature_time":  # the co-placement, then swaps that shorten the decode step
                placement = self._for_decode_time(expert_device, profile, parallel, centroids, info)
            else:
                placement = Placement.from_expert_device(expert_device, num_devices)
            sizes = np.bincount(labels, minlength=num_devices)
            info.update(kmeans_iterations=iterations, cluster_size_max_mean=float(sizes.max() * num_devices / len(labels)))
        else:
            placement = contiguous_placement(profile.num_layers, num_experts, num_devices)
        return SignaturePlan(placement, parallel, centroids=centroids,
                             rule=self.rule, match=self.match, capacity_slack=self.capacity_slack,
                             eldr_top=self.eldr_top, info=info)


    def _plan(self, placement: Placement, parallel: ParallelConfig, centroids, info=None) -> SignaturePlan:
        return SignaturePlan(placement, parallel, centroids=centroids, rule=self.rule, match=self.match,
                             capacity_slack=self.capacity_slack, eldr_top=self.eldr_top, info=info)

    def _for_decode_time(self, expert_device_LE: np.ndarray, profile: RoutingTrace, parallel: ParallelConfig,
                         centroids, info: dict) -> Placement:
        """The placement after `place_for_decode_time` from expert_device_LE, priced on the profile's decode steps
        with each profile request on the rank this system's decode rule gives it under the starting placement."""
        start = Placement.from_expert_device(expert_device_LE, parallel.devices)
        plan = self._plan(start, parallel, centroids)
        prompt = profile.prompt_mask()
        offsets = np.concatenate([[0], np.cumsum(profile.prefill_len, dtype=np.int64)])
        ranks = plan.assign_decode(np.asarray(profile.experts)[prompt], offsets, np.zeros(profile.num_requests))
        active, sent = decode_step_tables(profile.experts, profile.offsets, profile.prefill_len, ranks,
                                          profile.meta.num_experts, parallel.devices)
        before = sum(decode_step_cost(expert_device_LE[layer], active[layer], sent[layer], self.read_copies)
                     for layer in range(profile.num_layers))
        expert_device = place_for_decode_time(active, sent, expert_device_LE, self.read_copies, self.time_swaps)
        after = sum(decode_step_cost(expert_device[layer], active[layer], sent[layer], self.read_copies)
                    for layer in range(profile.num_layers))
        info.update(profile_decode_step_cost_start=before, profile_decode_step_cost=after,
                    time_swapped_experts=int((expert_device != expert_device_LE).sum()))
        return Placement.from_expert_device(expert_device, parallel.devices)


class SignatureELDR(SignatureDecode):
    """The same plan with ELDR's decode rule: least-loaded among the eldr_top best signature matches."""

    name = "signature_eldr"

    def __init__(self, placement: str = "signature_time", rule: str = "eldr", match: str = "centroid",
                 capacity_slack: int = 1, eldr_top: int = 2, kmeans_iters: int = 30, cluster_slack: float = 0.0,
                 load_weight: float = 1.0, read_copies: float = READ_COPIES, time_swaps: int = 64):
        super().__init__(placement, rule, match, capacity_slack, eldr_top, kmeans_iters, cluster_slack, load_weight,
                         read_copies, time_swaps)
