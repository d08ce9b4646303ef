"""Decode-phase accounting: the generated tokens measured as decode steps, beside the prompt (prefill) tokens.

`decode_summary(plan, trace)` is what every job reports (repro.run, through `fit_and_evaluate`): when the routing
holds generated tokens (prefill_len < length: the tiny model with model.max_new_tokens, an imported trace with a
phase or prefill-length column) the decode-phase scalars of `decode_phase_metrics` and the prefill tokens' LAR;
otherwise one sentence under "decode_phase" saying that there is nothing to measure.

`decode_phase_metrics` serves the generated tokens as decode steps: step t holds the t-th generated token of every
request still generating (all requests decode together, a static batch; or, with batch_requests, consecutive waves
of that many requests, as jobs do), each token on the device the evaluator
put it on (`accounting.home_devices`: Attention-DP, its request's rank, or the decode rank a plan with
`assign_decode` chose after prefill, `accounting.decode_homes`; Attention-TP, the slice the token scheduler gave
it at each layer). It reports decode LAR, token balance (over the whole decode and per step), expert load
balance, the distinct experts each rank's batch activates per step (the expert weights a rank reads when it holds
every expert, ELDR's measure), the distinct experts each EP device serves per step (the weights it reads under
EP), and, with a TimeModel, the MoE critical-path seconds of the decode steps priced by the simulator's cost model
(`time_cost.moe_layer_seconds`, iterations without prefill): a TPOT estimate of the MoE layers.

`prompt_tail_as_decode` turns a prompt-only trace into a proxy with "generated" tokens (the last part of each
prompt), for routing sources that record no generation; results on it are labelled as a proxy.

Legend: N tokens, n generated tokens, L MoE layers, k experts per token, E experts, D devices, K decode steps,
R requests, G groups.
"""

from __future__ import annotations

import numpy as np

from repro.errors import ConfigError, TraceError
from repro.eval.accounting import _max_over, account, decode_homes, home_devices
from repro.eval.time_cost import PARTS, STEPS_PER_BLOCK, TimeModel, moe_layer_seconds, time_estimate
from repro.systems.base import Plan
from repro.traces import RoutingTrace, make_trace

__all__ = ["decode_homes", "decode_phase_metrics", "decode_steps", "decode_summary", "has_generated_tokens",
           "prompt_tail_as_decode"]

# a job decodes in waves of this many requests per rank (x parallel.devices): the decode batch of a step then does
# not grow with the evaluated split (a validate and an evaluate split decode alike); 32 requests per rank is a
# moderate EP decode batch (DeepEP's low-latency kernels take up to 128 tokens per rank)
DECODE_BATCH_PER_RANK = 32

NO_DECODE = ("none: the routing holds no generated tokens (prefill_len = length for every request), so no decode "
             "metric is reported; route with model.max_new_tokens > 0 or import a trace with a phase or prefill_len "
             "column to measure decode")


def has_generated_tokens(trace: RoutingTrace) -> bool:
    """True when some request has tokens after its prefill (prefill_len < length)."""
    return bool(np.any(np.asarray(trace.prefill_len, dtype=np.int64) < trace.lengths()))


def prompt_tail_as_decode(trace: RoutingTrace, decode_share: float) -> RoutingTrace:
    """The same routing with the last ceil(decode_share x length) tokens of each request marked as generated
    (prefill_len lowered; at least one prompt token kept). A proxy for sources that route prompts only: its
    "decode" tokens are prompt tokens, routed with the prompt's context, not generated ones."""
    if not isinstance(decode_share, int | float) or isinstance(decode_share, bool) or not 0 < decode_share < 1:
        raise ConfigError(f"decode_share must be a number in (0, 1), got {decode_share!r}.")
    if np.any(trace.prefill_len < trace.lengths()):
        raise TraceError("the trace already holds generated tokens; measure its own decode instead of a proxy.")
    lengths = trace.lengths()
    tail = np.minimum(np.ceil(decode_share * lengths).astype(np.int64), np.maximum(lengths - 1, 0))
    return make_trace(trace.meta, trace.offsets, trace.token_ids, trace.experts, prefill_len=lengths - tail,
                      request_ids=trace.request_ids, request_datasets=trace.request_datasets,
                      request_labels=trace.request_labels, weights=trace.weights)


def decode_steps(trace: RoutingTrace) -> np.ndarray:
    """int64[N] decode step of each token (its index among its request's generated tokens; -1 for prompt)."""
    position = np.arange(trace.num_tokens) - np.repeat(trace.offsets[:-1], trace.lengths())
    return position - np.repeat(trace.prefill_len.astype(np.int64), trace.lengths())


def distinct_per_group(group_nL: np.ndarray, experts_nLk: np.ndarray, num_groups: int, num_experts: int) -> np.ndarray:
    """int64[G, L] distinct experts among the activations of each group's rows at each layer.

    group_nL int[n] (one group per row, all layers) or int[n, L] (per row and layer), values in 0..G-1;
    experts_nLk int[n, L, k]."""
    _, num_layers, _ = experts_nLk.shape
    group = np.asarray(group_nL, dtype=np.int64)
    group = group[:, None] if group.ndim == 1 else group
    keys = ((group[:, :, None] * num_layers + np.arange(num_layers)[None, :, None]) * num_experts
            + np.asarray(experts_nLk, dtype=np.int64))
    present = np.unique(keys.ravel())
    return np.bincount(present // num_experts, minlength=num_groups * num_layers).reshape(num_groups, num_layers)


def decode_phase_metrics(plan: Plan, trace: RoutingTrace, *, time_model: TimeModel | None = None,
                         home_NL: np.ndarray | None = None, batch_requests: int | None = None) -> dict:
    """Decode-phase scalars of `plan` on `trace` (see the module doc), all prefixed decode_:
    lar, tokens, steps, batch_tokens_mean (tokens per step), a2a_bytes (dispatch + combine of the decode tokens),
    token_imbalance_max_mean (decode tokens per rank over the whole decode, mean over layers),
    step_token_imbalance_max_mean (mean over steps and layers of each step's max/mean batch size),
    expert_load_imbalance_max_mean (mean over layers), batch_distinct_experts_max / _mean (per step and layer, the
    busiest / mean rank's distinct experts among its batch's activations, averaged), device_distinct_experts_max /
    _mean (the same for the experts each EP device serves: the weights it reads), and with time_model:
    moe_seconds (sum over decode steps of the MoE critical path, trace layers), moe_seconds_per_step (its mean per
    step, a TPOT estimate of the MoE part) and its parts moe_{dispatch,experts,combine}_seconds_per_step.
    home_NL: int[N, L] the evaluator's token devices when already computed (`EvalResult.home`), else asked anew.
    batch_requests: None serves every request in one static decode batch; an integer serves them in consecutive
    waves of that many requests (in trace order), each wave a static batch, so the batch per step does not grow
    with the number of requests evaluated (a validate and an evaluate split then decode at the same batch size).
    """
    step_N = decode_steps(trace)
    if batch_requests is not None:
        if not isinstance(batch_requests, int | np.integer) or batch_requests < 1:
            raise ConfigError(f"batch_requests must be an integer >= 1 or None, got {batch_requests!r}.")
        wave_R = np.arange(trace.num_requests) // int(batch_requests)
        generated_R = trace.lengths() - np.asarray(trace.prefill_len, dtype=np.int64)
        wave_len = np.zeros(int(wave_R.max()) + 1 if trace.num_requests else 0, dtype=np.int64)
        np.maximum.at(wave_len, wave_R, generated_R)
        wave_start = np.cumsum(wave_len) - wave_len
        step_N = np.where(step_N >= 0, step_N + np.repeat(wave_start[wave_R], trace.lengths()), -1)
    rows = np.flatnonzero(step_N >= 0)
    if len(rows) == 0:
        raise TraceError("the trace has no generated tokens (prefill_len = length everywhere); route with generation "
                         "or use prompt_tail_as_decode for a proxy.")
    devices, num_experts, num_layers = plan.parallel.devices, plan.placement.num_experts, trace.num_layers
    if home_NL is None:
        home_NL = home_devices(plan, trace)
    home_nL = np.asarray(home_NL[rows], dtype=np.int64)
    experts_nLk = np.asarray(trace.experts[rows], dtype=np.int64)
    step_n = step_N[rows]
    num_steps = int(step_n.max()) + 1
    dispatch_LDE = plan.placement.dispatch_device()
    counts = account(home_nL, experts_nLk, dispatch_LDE, plan.parallel.bytes_per_token, devices)
    layer_L = np.arange(num_layers)
    # tokens per (step, layer, device): the decode batch of each rank at each layer (constant over layers in DP)
    tokens_KLD = np.bincount(((step_n[:, None] * num_layers + layer_L) * devices + home_nL).ravel(),
                             minlength=num_steps * num_layers * devices).reshape(num_steps, num_layers, devices)
    per_rank_LD = tokens_KLD.sum(axis=0)
    batch, served = _distinct_experts(step_n, home_nL, experts_nLk, dispatch_LDE, num_steps, num_experts)
    step_max_mean = tokens_KLD.max(axis=2) / tokens_KLD.mean(axis=2)
    out = {
        "decode_lar": float(counts.local_activations.sum() / counts.total_activations.sum()),
        "decode_tokens": int(len(rows)),
        "decode_steps": num_steps,
        "decode_batch_tokens_mean": float(len(rows) / num_steps),
        "decode_a2a_bytes": int(2 * counts.traffic.sum()),
        "decode_token_imbalance_max_mean": float(_max_over(per_rank_LD, np.mean).mean()),
        "decode_step_token_imbalance_max_mean": float(step_max_mean.mean()),
        "decode_expert_load_imbalance_max_mean": float(_max_over(counts.expert_load, np.mean).mean()),
        "decode_batch_distinct_experts_max": float(batch.max(axis=1).mean()),
        "decode_batch_distinct_experts_mean": float(batch.mean()),
        "decode_device_distinct_experts_max": float(served.max(axis=1).mean()),
        "decode_device_distinct_experts_mean": float(served.mean()),
    }
    if time_model is not None:
        seconds = decode_moe_seconds(time_model, step_n, home_nL, experts_nLk, num_steps, devices,
                                     plan.parallel.attention)
        total = sum(seconds[part] for part in PARTS)
        out.update(decode_moe_seconds=float(total.sum()), decode_moe_seconds_per_step=float(total.sum() / num_steps))
        for part in PARTS:
            out[f"decode_moe_{part}_seconds_per_step"] = float(seconds[part].sum() / num_steps)
    return out


def _distinct_experts(step_n, home_nL, experts_nLk, dispatch_LDE, num_steps: int, num_experts: int):
    """(batch, served) int64[K, D, L]: distinct experts among each rank's decode batch per step and layer, and
    distinct experts each device serves (activations of that step landing there), counted STEPS_PER_BLOCK steps at
    a time so the keys stay small."""
    num_layers, devices, _ = dispatch_LDE.shape
    layer_L = np.arange(num_layers)
    batch = np.zeros((num_steps, devices, num_layers), dtype=np.int64)
    served = np.zeros_like(batch)
    order = np.argsort(step_n, kind="stable")
    bounds = np.searchsorted(step_n[order], np.arange(0, num_steps + STEPS_PER_BLOCK, STEPS_PER_BLOCK))
    for first, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=False)):
        if lo >= hi:
            continue
        rows, base = order[lo:hi], first * STEPS_PER_BLOCK
        step, home, experts = step_n[rows] - base, home_nL[rows], experts_nLk[rows]
        num_k = int(step.max()) + 1
        groups = num_k * devices
        batch[base : base + num_k] = distinct_per_group(step[:, None] * devices + home, experts, groups,
                                                        num_experts).reshape(num_k, devices, num_layers)
        # a device serves an expert of layer l in a step when any activation of that step lands there
        dest = dispatch_LDE[layer_L[None, :, None], home[:, :, None], experts]  # [n, L, k]
        keys = np.unique((((step[:, None, None] * devices + dest) * num_layers + layer_L[None, :, None])
                          * num_experts + experts).ravel())
        served[base : base + num_k] = np.bincount(keys // num_experts, minlength=groups * num_layers).reshape(
            num_k, devices, num_layers)
    return batch, served


def decode_summary(plan: Plan, trace: RoutingTrace, *, time_model: TimeModel | None = None,
                   home_NL: np.ndarray | None = None) -> dict:
    """What a job reports about its phases: {"decode_phase": NO_DECODE} when the routing holds no generated token,
    else {"decode_phase": "measured", prefill_lar, prefill_tokens, decode_batch_requests, **decode_phase_metrics(...)}
    (prefill_lar: the LAR of the prompt tokens alone, on the same homes; decode in waves of DECODE_BATCH_PER_RANK x
    parallel.devices requests)."""
    if not has_generated_tokens(trace):
        return {"decode_phase": NO_DECODE}
    if home_NL is None:
        home_NL = home_devices(plan, trace)
    prompt = np.flatnonzero(trace.prompt_mask())
    out: dict = {"decode_phase": "measured", "prefill_tokens": int(len(prompt))}
    if len(prompt):
        counts = account(np.asarray(home_NL[prompt]), np.asarray(trace.experts[prompt]),
                         plan.placement.dispatch_device(), plan.parallel.bytes_per_token, plan.parallel.devices)
        out["prefill_lar"] = float(counts.local_activations.sum() / counts.total_activations.sum())
    batch = DECODE_BATCH_PER_RANK * plan.parallel.devices
    out["decode_batch_requests"] = batch
    out.update(decode_phase_metrics(plan, trace, time_model=time_model, home_NL=home_NL, batch_requests=batch))
    if time_model is not None:
        # the job's offline time as serving runs it: prompt tokens in prefill steps, generated ones in decode steps
        # (time_estimate_s prices every token as prefill, which hides a decode slowdown behind prefill-heavy totals)
        prefill = time_estimate(time_model, np.asarray(home_NL[prompt]), np.asarray(trace.experts[prompt]),
                                plan.parallel.attention) if len(prompt) else {part: np.zeros(1) for part in PARTS}
        out["prefill_time_estimate_s"] = float(sum(prefill[part].sum() for part in PARTS))
        out["time_estimate_phases_s"] = out["prefill_time_estimate_s"] + out.get("decode_moe_seconds", 0.0)
    return out


def decode_moe_seconds(model: TimeModel, step_n: np.ndarray, home_nL: np.ndarray, experts_nLk: np.ndarray,
                       num_steps: int, devices: int, attention: str = "dp") -> dict[str, np.ndarray]:
    """{"dispatch", "experts", "combine"}: float64[K] MoE critical-path seconds (summed over trace layers) of each
    decode step, priced as iterations without prefill by the simulator's cost model (as time_cost.time_estimate
    prices steps). home_nL int[n, L] (or int[n]: one device for every layer)."""
    from repro.sim.traffic import batch_traffic  # the simulator package only where a time is priced (as time_cost)

    out = {part: np.zeros(num_steps) for part in PARTS}
    num_layers = experts_nLk.shape[1]
    home_nL = np.asarray(home_nL, dtype=np.int64)
    home_nL = np.broadcast_to(home_nL[:, None], (len(home_nL), num_layers)) if home_nL.ndim == 1 else home_nL
    for first in range(0, num_steps, STEPS_PER_BLOCK):
        rows = np.flatnonzero((step_n >= first) & (step_n < first + STEPS_PER_BLOCK))
        if len(rows) == 0:
            continue
        group = step_n[rows] - first
        num_k = int(group.max()) + 1
        home = home_nL[rows]
        traffic = batch_traffic(group, home, experts_nLk[rows], model.slot_table, model.slots_per_device, num_k,
                                model.devices_per_node)
        tokens_KD = slices = None
        if attention == "dp":
            tokens_KD = np.bincount(group * devices + home[:, 0], minlength=num_k * devices).reshape(num_k, devices)
        else:
            key = (group[:, None] * num_layers + np.arange(num_layers)) * devices + home
            slices = np.bincount(key.ravel(), minlength=num_k * num_layers * devices).reshape(num_k, num_layers, devices)
        seconds = moe_layer_seconds(model.cost, traffic, tokens_KD, slices, np.zeros(num_k, dtype=bool))
        for part in PARTS:
            out[part][first : first + num_k] = seconds[part].sum(axis=1)
    return out
