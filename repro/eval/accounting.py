"""Exact trace-driven accounting of a Plan: where every token->expert activation is served and what it costs.

Legend: N tokens, L MoE layers, k experts per token (top-k slots), D devices (EP ranks), E logical experts per
layer, R requests, T tokens in one Attention-TP step, h layers of routing history.

Two steps:
1. `home_devices(plan, trace)` asks the plan's online scheduler where each token lives before each MoE layer
   (its attention device): per request once in Attention-DP, per step and layer in Attention-TP.
2. `account(home, experts, dispatch_device, ...)` is the pure core: arrays in, counts out. Activation
   (token n, layer l, slot j) is served on dest = dispatch_device[l, home[n, l], experts[n, l, j]]; it is local
   when dest == home. A token travels once to each distinct remote destination (DeepEP deduplicates per rank),
   so dispatch bytes count distinct (token, layer, remote dest) triples; combine is the mirror image.

`evaluate(plan, trace)` runs both and summarises per layer and overall (LAR, bytes, traffic matrix, loads,
imbalance). With replicated experts the serving replica is the placement's static dispatch rule
(`Placement.dispatch_device`: local, then nearest, then least loaded), so expert load splits across replicas
exactly as that rule sends it, and `served_activations` counts what every replica served (unused replicas are
reported as waste). Everything is counted exactly in integers, in token chunks (a memory-mapped trace is read one
chunk at a time) by the compiled loop of `repro.counting`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from repro.counting import count_rows
from repro.errors import ConfigError, ReproError, TraceError
from repro.eval.time_cost import PARTS, TimeModel, time_estimate  # imports repro.sim only when a time is priced
from repro.systems.base import Plan
from repro.traces import RoutingTrace

# token-layers per chunk in `account` and `served_activations`: what one read of a memory-mapped trace holds
# (k x 2^20 expert ids, 16 MB at top-8 int16)
CHUNK_EVENTS = 1 << 20

PER_LAYER_COLUMNS = (
    "layer",
    "layer_id",
    "lar",
    "local_activations",
    "remote_activations",
    "total_activations",
    "remote_token_copies",
    "dispatch_bytes",
    "combine_bytes",
    "expert_load_imbalance_max_mean",
    "expert_load_imbalance_max_median",
    "token_imbalance_max_mean",
)


@dataclass(frozen=True)
class LayerCounts:
    """Exact per-layer counts from `account` (all int64).

    activations[l, s, d]: token->expert activations whose token lives on device s and whose expert replica
        is served on device d (all k slots, not deduplicated); the diagonal is the local activations.
    token_copies[l, s, d]: distinct (token, destination) pairs, i.e. copies of a token that device s sends
        to device d in the dispatch (the diagonal counts tokens that keep at least one activation at home).
    bytes_per_token: what one token copy costs on the wire.
    """

    activations: np.ndarray  # int64[L, D, D]
    token_copies: np.ndarray  # int64[L, D, D]
    bytes_per_token: int
    top_k: int

    @property
    def local_activations(self) -> np.ndarray:
        """int64[L] activations served on the token's own device."""
        return np.trace(self.activations, axis1=1, axis2=2)

    @property
    def total_activations(self) -> np.ndarray:
        """int64[L] all activations (N x k per layer)."""
        return self.activations.sum(axis=(1, 2))

    @property
    def remote_activations(self) -> np.ndarray:
        """int64[L] activations served on another device (not deduplicated)."""
        return self.total_activations - self.local_activations

    @property
    def remote_copies(self) -> np.ndarray:
        """int64[L, D, D] token copies sent from s to d, zero on the diagonal (local copies travel nowhere)."""
        off_diagonal = ~np.eye(self.activations.shape[1], dtype=bool)
        return self.token_copies * off_diagonal

    @property
    def remote_token_copies(self) -> np.ndarray:
        """int64[L] distinct (token, remote destination) pairs per layer."""
        return self.remote_copies.sum(axis=(1, 2))

    @property
    def traffic(self) -> np.ndarray:
        """int64[L, D, D] dispatch bytes from source device to destination device (combine is the transpose)."""
        return self.remote_copies * self.bytes_per_token

    @property
    def expert_load(self) -> np.ndarray:
        """int64[L, D] activations served by each device."""
        return self.activations.sum(axis=1)

    @property
    def token_load(self) -> np.ndarray:
        """int64[L, D] tokens whose home device is d (each token-layer contributes exactly k activations)."""
        return self.activations.sum(axis=2) // self.top_k


def account(
    home: np.ndarray,
    experts: np.ndarray,
    dispatch_device: np.ndarray,
    bytes_per_token: int,
    num_devices: int,
    *,
    progress: bool = False,
) -> LayerCounts:
    """Count where every activation is served and which token copies cross devices.

    home: int[N, L] device each token lives on before each MoE layer (a broadcast view is fine).
    experts: int[N, L, k] logical expert ids (a memory-mapped trace array is fine: it is read in chunks).
    dispatch_device: int[L, D, E] device that source device s sends expert e's tokens to
        (`Placement.dispatch_device()`; with replicas it depends on the source).
    Returns LayerCounts with activations and token_copies int64[L, D, D].
    """
    home, experts, dispatch_device = _check_account_inputs(
        home, experts, dispatch_device, bytes_per_token, num_devices
    )
    activations, token_copies, _ = _count_in_chunks(home, experts, dispatch_device, dispatch_device, 0, progress)
    return LayerCounts(
        activations=activations,
        token_copies=token_copies,
        bytes_per_token=int(bytes_per_token),
        top_k=int(experts.shape[2]),
    )


def served_activations(
    home: np.ndarray, experts: np.ndarray, dispatch_device: np.ndarray, num_devices: int
) -> np.ndarray:
    """int64[L, D, E] activations of expert e served on device d (inputs as in `account`).

    Counts every activation at the physical "slot" (serving device, expert): the per-replica load sums to the
    expert's activations and follows the dispatch rule.
    """
    home, experts, dispatch_device = _check_account_inputs(home, experts, dispatch_device, 1, num_devices)
    num_layers, _, num_experts = dispatch_device.shape
    served_slot_LDE = (dispatch_device * num_experts + np.arange(num_experts)).astype(np.int64)
    _, _, served = _count_in_chunks(home, experts, served_slot_LDE, dispatch_device, num_devices * num_experts)
    return served.reshape(num_layers, num_devices, num_experts)


def _count_in_chunks(home, experts, slot_table_LDE, device_table_LDE, num_slots: int, progress: bool = False):
    """(activations int64[L, D, D], token_copies int64[L, D, D], slot_tokens int64[L, num_slots]) of checked
    inputs, by `count_rows` over token chunks (a memory-mapped trace is read one chunk at a time); num_slots 0
    skips the slot counts."""
    num_tokens, num_layers, _ = experts.shape
    num_devices, num_experts = device_table_LDE.shape[1:]
    activations = np.zeros((1, num_layers, num_devices, num_devices), dtype=np.int64)
    token_copies = np.zeros_like(activations)
    slot_tokens = np.zeros((1, num_layers, num_slots), dtype=np.int64)
    no_nodes = np.zeros((1, num_layers, num_devices, 0), dtype=np.int64)
    chunk = max(16, CHUNK_EVENTS // num_layers)
    starts = range(0, num_tokens, chunk)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc="accounting", unit="chunk")
    for start in starts:
        experts_nLk = np.asarray(experts[start : start + chunk])
        bad_row = count_rows(np.zeros(len(experts_nLk), dtype=np.int64), home[start : start + chunk], experts_nLk,
                             slot_table_LDE, device_table_LDE, 1, activations, token_copies, no_nodes, slot_tokens)
        if bad_row >= 0:  # homes are checked already: an expert id out of range (the tables are dropped)
            _check_expert_range(experts_nLk[bad_row : bad_row + 1], num_experts, start + bad_row)
    return activations[0], token_copies[0], slot_tokens[0]


def replica_waste(placement, served: np.ndarray) -> dict:
    """Redundant slots and how many of them served nothing, summed over layers.

    placement: a `Placement`; served int[L, D, E] from `served_activations`. An expert with c copies in a layer
    has c - 1 redundant slots; of those, c - max(1, devices that served it) are unused (a second copy on one
    device never serves: dispatch picks a device, and that device's first slot holding the expert).
    """
    copies = placement.replicas().sum(axis=2)  # [L, E]
    serving = (served > 0).sum(axis=1)  # [L, E]
    redundant = int((copies - 1).sum())
    unused = int((copies - np.maximum(serving, 1)).sum())
    return {
        "replica_slots": redundant,
        "replica_slots_unused": unused,
        "replica_slots_unused_share": unused / redundant if redundant else 0.0,
    }


def _check_account_inputs(home, experts, dispatch_device, bytes_per_token, num_devices):
    if not isinstance(num_devices, int | np.integer) or num_devices < 1:
        raise ConfigError(f"account needs num_devices >= 1, got {num_devices!r}.")
    if not isinstance(bytes_per_token, int | np.integer) or bytes_per_token < 1:
        raise ConfigError(f"account needs an integer bytes_per_token >= 1, got {bytes_per_token!r}.")
    experts = np.asarray(experts)  # a memmap stays a view: nothing is read here
    if experts.ndim != 3 or not np.issubdtype(experts.dtype, np.integer) or experts.shape[2] < 1:
        raise TraceError(
            f"experts must be an integer array [tokens, layers, top_k>=1], got {experts.dtype} {experts.shape}."
        )
    num_tokens, num_layers, _ = experts.shape
    home = np.asarray(home)
    if home.shape != (num_tokens, num_layers) or not np.issubdtype(home.dtype, np.integer):
        raise ReproError(
            f"home must be an integer array [tokens, layers] = {(num_tokens, num_layers)}, "
            f"got {home.dtype} {home.shape}; build it with repro.eval.home_devices."
        )
    if home.size and (home.min() < 0 or home.max() >= num_devices):
        raise ReproError(f"home names devices outside 0..{num_devices - 1}; check the plan's schedulers.")
    dispatch_device = np.asarray(dispatch_device)
    if dispatch_device.ndim != 3 or dispatch_device.shape[:2] != (num_layers, num_devices):
        raise ConfigError(
            f"dispatch_device must be [layers, devices, experts] with layers={num_layers} and "
            f"devices={num_devices}, got {dispatch_device.shape}; use Placement.dispatch_device()."
        )
    if dispatch_device.size and (dispatch_device.min() < 0 or dispatch_device.max() >= num_devices):
        raise ConfigError(f"dispatch_device names devices outside 0..{num_devices - 1}.")
    return home, experts, dispatch_device


def _check_expert_range(experts_nLk: np.ndarray, num_experts: int, start: int) -> None:
    if experts_nLk.size and (experts_nLk.min() < 0 or experts_nLk.max() >= num_experts):
        bad = np.argwhere((experts_nLk < 0) | (experts_nLk >= num_experts))[0]
        raise TraceError(
            f"expert id {int(experts_nLk[tuple(bad)])} at token {start + int(bad[0])}, layer {int(bad[1])} is "
            f"outside the placement's 0..{num_experts - 1}; the trace and the plan disagree on the model."
        )


def home_devices(plan: Plan, trace: RoutingTrace, *, history: int = 2, progress: bool = False) -> np.ndarray:
    """int16[N, L] the device each token lives on before each MoE layer, as the plan's schedulers decide.

    Attention-DP: plan.reset(), then one plan.assign_requests call over all requests in trace order; every
    token of request r lives on ranks[r] at every layer (returned as a read-only broadcast view), except that a
    plan with assign_decode moves each request's generated tokens to the rank it picks from the prompt's routing
    (`decode_homes`).
    Attention-TP: plan.reset(), then tokens in trace order in steps of parallel.tokens_per_step (the last one
    shorter); per step and layer, plan.shuffle_tokens(token_ids, layer, prev_experts) with prev_experts the
    true routing int16[T, h', k] of the h' = min(layer, history) previous layers (None when h' == 0). Plans with
    `uses_true_routing = True` (oracle bounds) also get current_experts=int16[T, k] of this layer.
    Whatever the plan returns is checked; a contract violation raises ReproError naming the plan class.
    """
    _check_plan_fits_trace(plan, trace)
    if not isinstance(history, int | np.integer) or history < 0:
        raise ConfigError(f"history must be an integer >= 0 (layers of routing the TP scheduler sees), got {history!r}.")
    num_devices = plan.parallel.devices
    plan.reset()
    if plan.parallel.attention == "dp":
        ranks = plan.assign_requests(
            read_only(trace.token_ids), read_only(trace.offsets), read_only(trace.prefill_len)
        )
        ranks = _check_ranks(plan, ranks, trace.num_requests, num_devices)
        per_token = np.repeat(ranks.astype(np.int16), trace.lengths())
        if hasattr(plan, "assign_decode"):  # PD-disaggregated decode: generated tokens on the rank chosen after prefill
            per_token = decode_homes(plan, trace, ranks)
        home = np.broadcast_to(per_token[:, None], (trace.num_tokens, trace.num_layers))
        return home

    home = np.empty((trace.num_tokens, trace.num_layers), dtype=np.int16)
    step = plan.parallel.tokens_per_step
    oracle = bool(getattr(plan, "uses_true_routing", False))
    rank_ids = np.arange(num_devices, dtype=np.int16)
    starts = range(0, trace.num_tokens, step)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc="TP token scheduling", unit="step")
    for start in starts:
        stop = min(start + step, trace.num_tokens)
        # copies, read-only: a plan must not be able to change the routing the accounting then reads
        token_ids = read_only(np.array(trace.token_ids[start:stop]))
        experts_tLk = read_only(np.array(trace.experts[start:stop]))
        for layer in range(trace.num_layers):
            first = max(0, layer - history)
            prev = experts_tLk[:, first:layer, :] if layer > first else None
            extra = {"current_experts": experts_tLk[:, layer, :]} if oracle else {}
            perm, counts = plan.shuffle_tokens(token_ids, layer, prev, **extra)
            perm, counts = _check_shuffle(plan, perm, counts, stop - start, num_devices, start, layer)
            # position j of the reduce-scatter output belongs to the rank whose slice contains j
            home[start + perm, layer] = np.repeat(rank_ids, counts)
    return home


def decode_homes(plan: Plan, trace: RoutingTrace, prefill_ranks: np.ndarray) -> np.ndarray:
    """int16[N] the device of each token: prefill_ranks[r] for request r's prompt tokens, the rank
    plan.assign_decode chose for its generated tokens. The plan is shown the prompt tokens' routing only
    (read-only), so its decode choice cannot depend on the decode routing it is evaluated on."""
    prompt = trace.prompt_mask()
    prompt_experts = read_only(np.asarray(trace.experts)[prompt])
    prompt_offsets = read_only(np.concatenate([[0], np.cumsum(trace.prefill_len, dtype=np.int64)]))
    decode = np.asarray(plan.assign_decode(prompt_experts, prompt_offsets, read_only(prefill_ranks)))
    name = type(plan).__name__
    if decode.shape != (trace.num_requests,) or not np.issubdtype(decode.dtype, np.integer):
        raise ReproError(f"{name}.assign_decode returned {decode.dtype} {decode.shape}; it must return one integer "
                         f"rank per request, shape ({trace.num_requests},).")
    if decode.size and (decode.min() < 0 or decode.max() >= plan.parallel.devices):
        raise ReproError(f"{name}.assign_decode returned ranks outside 0..{plan.parallel.devices - 1}.")
    lengths = trace.lengths()
    return np.where(prompt, np.repeat(prefill_ranks, lengths), np.repeat(decode, lengths)).astype(np.int16)


def read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view: schedulers may read the routing they are given, never change what is accounted."""
    view = np.asarray(a).view()
    view.flags.writeable = False
    return view


def _check_plan_fits_trace(plan: Plan, trace: RoutingTrace) -> None:
    placement = plan.placement
    if placement.num_layers != trace.num_layers:
        raise ConfigError(
            f"{type(plan).__name__} was fitted for {placement.num_layers} MoE layers but the trace has "
            f"{trace.num_layers}; fit the system on a trace of the same model."
        )
    if placement.num_experts != trace.meta.num_experts:
        raise ConfigError(
            f"{type(plan).__name__} places {placement.num_experts} experts per layer but the trace's model has "
            f"{trace.meta.num_experts}; fit the system on a trace of the same model."
        )
    if placement.num_devices != plan.parallel.devices:
        raise ConfigError(
            f"{type(plan).__name__} places experts on {placement.num_devices} devices but its parallel config "
            f"says {plan.parallel.devices}; build the plan with one ParallelConfig."
        )
    if placement.is_replicated and not np.array_equal(placement.node_of_device(), plan.parallel.node_of_device()):
        raise ConfigError(
            f"{type(plan).__name__}'s replicated placement was built for devices_per_node="
            f"{placement.devices_per_node} but parallel.devices_per_node={plan.parallel.devices_per_node}; the "
            "replica each token uses depends on the nodes, so build the placement with the parallel config's value."
        )
    if trace.num_tokens == 0:
        raise TraceError("the trace has no tokens; there is nothing to evaluate.")


def _check_ranks(plan: Plan, ranks, num_requests: int, num_devices: int) -> np.ndarray:
    name = type(plan).__name__
    ranks = np.asarray(ranks)
    if ranks.shape != (num_requests,) or not np.issubdtype(ranks.dtype, np.integer):
        raise ReproError(
            f"{name}.assign_requests returned {ranks.dtype} {ranks.shape}; it must return one integer DP rank "
            f"per request, shape ({num_requests},)."
        )
    if ranks.size and (ranks.min() < 0 or ranks.max() >= num_devices):
        bad = int(np.argmax((ranks < 0) | (ranks >= num_devices)))
        raise ReproError(
            f"{name}.assign_requests sent request {bad} to rank {int(ranks[bad])}; ranks must lie in "
            f"0..{num_devices - 1}."
        )
    return ranks


def _check_shuffle(plan: Plan, perm, counts, num_step_tokens: int, num_devices: int, start: int, layer: int):
    where = f"{type(plan).__name__}.shuffle_tokens (step at token {start}, layer {layer})"
    perm, counts = np.asarray(perm), np.asarray(counts)
    if perm.shape != (num_step_tokens,) or not np.issubdtype(perm.dtype, np.integer):
        raise ReproError(
            f"{where} returned a permutation of {perm.dtype} {perm.shape}; it must be an integer permutation "
            f"of range({num_step_tokens})."
        )
    perm = perm.astype(np.int64, copy=False)
    if (
        perm.min() < 0
        or perm.max() >= num_step_tokens
        or np.any(np.bincount(perm, minlength=num_step_tokens) != 1)
    ):
        raise ReproError(
            f"{where} returned a permutation that repeats or misses tokens; every one of the "
            f"{num_step_tokens} tokens must appear exactly once."
        )
    if counts.shape != (num_devices,) or not np.issubdtype(counts.dtype, np.integer):
        raise ReproError(
            f"{where} returned per-rank counts of {counts.dtype} {counts.shape}; it must return {num_devices} "
            "integer slice sizes, one per rank."
        )
    if counts.sum() != num_step_tokens or counts.min() < 0 or counts.max() - counts.min() > 1:
        raise ReproError(
            f"{where} returned slice sizes {counts.tolist()}; a reduce-scatter needs non-negative sizes that "
            f"sum to {num_step_tokens} and differ by at most one."
        )
    return perm, counts


@dataclass
class EvalResult:
    """What one evaluation of a plan on a trace produced (see `evaluate`)."""

    summary: dict  # overall scalars, see evaluate
    per_layer: pd.DataFrame  # one row per MoE layer, columns PER_LAYER_COLUMNS
    traffic: np.ndarray  # int64[L, D, D] dispatch bytes from source to destination device
    expert_load: np.ndarray  # int64[L, D] activations served by each device
    token_load: np.ndarray  # int64[L, D] tokens whose home (attention) device is d at layer l
    activations: np.ndarray  # int64[L, D, D] activations from home device to serving device
    served: np.ndarray | None = None  # int64[L, D, E] activations of expert e served on d (replicated plans only)
    home: np.ndarray | None = None  # int16[N, L] each token's device before each layer (`home_devices`), set by evaluate


def evaluate(
    plan: Plan, trace: RoutingTrace, *, history: int = 2, progress: bool = False, time_model: TimeModel | None = None
) -> EvalResult:
    """Exact accounting of `plan` on `trace` in the plan's attention mode.

    summary: lar, local_activations, remote_activations, total_activations, dispatch_bytes, combine_bytes,
    a2a_bytes (dispatch + combine), dispatch_bytes_inter_node (crossing parallel.devices_per_node) and
    dispatch_bytes_intra_node (the rest), dispatch_bytes_inter_node_rdma (one copy per token and remote node,
    as DeepEP's internode kernels send it before forwarding over NVLink), node_local_activation_rate
    (activations served on the token's own node / all; equals lar on one node), remote_token_copies,
    replica_slots / replica_slots_unused /
    replica_slots_unused_share (redundant slots summed over layers, and those that served no activation:
    `replica_waste`; all 0 without replication), expert_load_imbalance_max_mean / _max_median and token_imbalance_max_mean (mean over
    layers of the per-layer max/mean or max/median over devices; a max/median is inf when more than half the
    devices get nothing) and the same with suffix _worst (max over layers), num_tokens, num_requests, num_layers,
    devices, top_k, num_experts, num_slots, bytes_per_token, attention, history, and every scalar of plan.info
    prefixed "plan_".
    With a time_model (`repro.eval.time_cost.time_model`): time_estimate_s, the critical-path seconds of serving
    the trace's MoE layers priced by the simulator's cost model, split into time_estimate_dispatch_s /
    _experts_s / _combine_s, with time_estimate_steps and what was priced (hardware, shape, backend, step
    tokens); per_layer then has columns time_dispatch_s, time_experts_s, time_combine_s.
    """
    home_NL = home_devices(plan, trace, history=history, progress=progress)
    seconds = None
    if time_model is not None:
        seconds = time_estimate(time_model, home_NL, trace.experts, plan.parallel.attention)
    dispatch_LDE = plan.placement.dispatch_device()
    counts = account(
        home_NL,
        trace.experts,
        dispatch_LDE,
        plan.parallel.bytes_per_token,
        plan.parallel.devices,
        progress=progress,
    )
    served = None
    if plan.placement.is_replicated:  # only replicas can sit idle; skip the extra pass otherwise
        served = served_activations(home_NL, trace.experts, dispatch_LDE, plan.parallel.devices)
    node_copies = None
    if plan.parallel.num_nodes > 1:
        # the same count with each destination device replaced by its node: one copy per (token, node), the
        # RDMA copies of DeepEP's internode dispatch (forwarded over NVLink inside the node)
        node_copies = account(
            home_NL, trace.experts, dispatch_LDE // plan.parallel.devices_per_node, plan.parallel.bytes_per_token,
            plan.parallel.devices,
        ).token_copies[:, :, : plan.parallel.num_nodes]
    result = replace(summarise(plan, trace, counts, history=history, served=served, node_copies=node_copies),
                     home=home_NL)
    if seconds is not None:
        for part in PARTS:
            result.summary[f"time_estimate_{part}_s"] = float(seconds[part].sum())
            result.per_layer[f"time_{part}_s"] = seconds[part]
        result.summary["time_estimate_s"] = float(sum(seconds[part].sum() for part in PARTS))
        result.summary["time_estimate_steps"] = int(seconds["steps"])
        result.summary.update(time_model.description)
    return result


def summarise(
    plan: Plan,
    trace: RoutingTrace,
    counts: LayerCounts,
    *,
    history: int = 2,
    served: np.ndarray | None = None,
    node_copies: np.ndarray | None = None,
) -> EvalResult:
    """Turn exact LayerCounts into per-layer rows and overall scalars (pure bookkeeping, no routing).

    served int[L, D, E] (`served_activations`) gives the replica waste; None means no replicated expert.
    node_copies int[L, D, Nn]: distinct (token, destination node) pairs per source device (None on one node)."""
    local = counts.local_activations
    total = counts.total_activations
    traffic = counts.traffic
    dispatch_per_layer = traffic.sum(axis=(1, 2))
    expert_load, token_load = counts.expert_load, counts.token_load
    expert_max_mean = _max_over(expert_load, np.mean)
    expert_max_median = _max_over(expert_load, np.median)
    token_max_mean = _max_over(token_load, np.mean)
    per_layer = pd.DataFrame(
        {
            "layer": np.arange(trace.num_layers),
            "layer_id": np.asarray(trace.meta.layer_ids, dtype=np.int64),
            "lar": local / total,
            "local_activations": local,
            "remote_activations": total - local,
            "total_activations": total,
            "remote_token_copies": counts.remote_token_copies,
            "dispatch_bytes": dispatch_per_layer,
            "combine_bytes": dispatch_per_layer,
            "expert_load_imbalance_max_mean": expert_max_mean,
            "expert_load_imbalance_max_median": expert_max_median,
            "token_imbalance_max_mean": token_max_mean,
        },
        columns=list(PER_LAYER_COLUMNS),
    )
    node = np.arange(plan.parallel.devices) // plan.parallel.devices_per_node
    inter_node = node[:, None] != node[None, :]
    dispatch_bytes = int(dispatch_per_layer.sum())
    summary: dict = {
        "lar": float(local.sum() / total.sum()),
        "local_activations": int(local.sum()),
        "remote_activations": int((total - local).sum()),
        "total_activations": int(total.sum()),
        "dispatch_bytes": dispatch_bytes,
        "combine_bytes": dispatch_bytes,
        "a2a_bytes": 2 * dispatch_bytes,
        "dispatch_bytes_inter_node": int(traffic[:, inter_node].sum()),
        "dispatch_bytes_intra_node": dispatch_bytes - int(traffic[:, inter_node].sum()),
        "node_local_activation_rate": float(counts.activations[:, ~inter_node].sum() / total.sum()),
        "dispatch_bytes_inter_node_rdma": 0 if node_copies is None else int(
            node_copies[:, node[:, None] != np.arange(node_copies.shape[2])[None, :]].sum()
            * plan.parallel.bytes_per_token
        ),
        "remote_token_copies": int(counts.remote_token_copies.sum()),
        "token_imbalance_max_mean": float(token_max_mean.mean()),
        "token_imbalance_max_mean_worst": float(token_max_mean.max()),
        "expert_load_imbalance_max_mean": float(expert_max_mean.mean()),
        "expert_load_imbalance_max_mean_worst": float(expert_max_mean.max()),
        "expert_load_imbalance_max_median": float(expert_max_median.mean()),
        "expert_load_imbalance_max_median_worst": float(expert_max_median.max()),
        "num_tokens": trace.num_tokens,
        "num_requests": trace.num_requests,
        "num_layers": trace.num_layers,
        "devices": plan.parallel.devices,
        "top_k": trace.meta.top_k,
        "num_experts": plan.placement.num_experts,
        "num_slots": plan.placement.num_slots,
        "bytes_per_token": plan.parallel.bytes_per_token,
        "attention": plan.parallel.attention,
        "history": int(history),
    }
    if served is None:
        summary.update(replica_slots=0, replica_slots_unused=0, replica_slots_unused_share=0.0)
    else:
        summary.update(replica_waste(plan.placement, served))
    for key, value in plan.info.items():
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, bool | int | float | str):
            summary[f"plan_{key}"] = value
    return EvalResult(
        summary=summary,
        per_layer=per_layer,
        traffic=traffic,
        expert_load=expert_load,
        token_load=token_load,
        activations=counts.activations,
        served=served,
    )


def _max_over(load_LD: np.ndarray, centre) -> np.ndarray:
    """float64[L] max over devices divided by centre (mean or median) over devices; inf when the centre is 0."""
    peak = load_LD.max(axis=1).astype(np.float64)
    middle = centre(load_LD, axis=1).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = peak / middle
    # an empty layer is perfectly balanced; a zero median with a non-zero peak is unbounded imbalance
    return np.where(peak == 0, 1.0, ratio)
