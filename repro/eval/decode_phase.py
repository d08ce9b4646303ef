"""Decode-phase accounting: where generated tokens live when a plan moves a request's decode to another rank.

A plan with an `assign_decode(prompt_experts, prompt_offsets, prefill_ranks) -> int[R]` method (a PD-
disaggregated router: `repro.systems.signature`) decides each request's decode rank after its prefill, from the
routing of its prompt tokens only. `decode_homes` asks it and returns the per-token device the evaluator
(`home_devices`) uses: prompt tokens on the prefill rank, generated tokens on the decode rank.

`decode_phase_metrics` measures the generated tokens alone, served as decode steps: step t holds the t-th
generated token of every request still generating (all requests decode together, a static batch), each on its
decode rank. It reports decode LAR, token balance (over the whole decode and per step), expert load balance, the
distinct experts each rank's batch activates per step (the expert weights a rank reads when it holds every
expert, ELDR's measure), the distinct experts each EP device serves per step (the weights it reads under EP),
and, with a TimeModel, the MoE critical-path seconds of the decode steps priced by the simulator's cost model
(`time_cost.moe_layer_seconds`, decode iterations): a TPOT estimate of the MoE layers.

`prompt_tail_as_decode` turns a prompt-only trace into a proxy with "generated" tokens (the last part of each
prompt), for routing sources that record no generation; results on it are labelled as a proxy.

Legend: N tokens, n generated tokens, L MoE layers, k experts per token, E experts, D devices, K decode steps,
R requests.
"""

from __future__ import annotations

import numpy as np

from repro.errors import ConfigError, ReproError, TraceError
from repro.eval.accounting import _max_over, account, home_devices, read_only
from repro.eval.time_cost import STEPS_PER_BLOCK, TimeModel, moe_layer_seconds
from repro.systems.base import Plan
from repro.traces import RoutingTrace, make_trace


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


def distinct_per_group(group_n: np.ndarray, experts_nLk: np.ndarray, num_groups: int, num_experts: int) -> np.ndarray:
    """int64[G, L] distinct experts among the activations of each group's rows (group_n int[n] in 0..G-1)."""
    _, num_layers, _ = experts_nLk.shape
    keys = (group_n[:, None, None] * num_layers + np.arange(num_layers)[None, :, None]) * num_experts + experts_nLk
    present = np.unique(keys.ravel())
    return np.bincount(present // num_experts, minlength=num_groups * num_layers).reshape(num_groups, num_layers)


def decode_phase_metrics(plan: Plan, trace: RoutingTrace, *, time_model: TimeModel | None = None) -> dict:
    """Decode-phase scalars of `plan` on `trace` (Attention-DP; see the module doc), all prefixed decode_:
    lar, tokens, steps, token_imbalance_max_mean (decode tokens per rank over the whole decode),
    step_token_imbalance_max_mean (mean over steps of each step's max/mean batch size),
    expert_load_imbalance_max_mean (mean over layers), batch_distinct_experts_max / _mean (per step and layer,
    the busiest / mean rank's distinct experts among its batch's activations, averaged), device_distinct_experts_max
    (the same for the experts each EP device serves), and with time_model: moe_seconds (sum over decode steps of the
    MoE critical path, trace layers) and moe_seconds_per_step (its mean per step, a TPOT estimate of the MoE part).
    """
    if plan.parallel.attention != "dp":
        raise ConfigError("decode-phase metrics follow requests on Attention-DP ranks; set parallel.attention=dp.")
    step_N = decode_steps(trace)
    rows = np.flatnonzero(step_N >= 0)
    if len(rows) == 0:
        raise TraceError("the trace has no generated tokens (prefill_len = length everywhere); route with generation "
                         "or use prompt_tail_as_decode for a proxy.")
    devices, num_experts = plan.parallel.devices, plan.placement.num_experts
    home_n = np.asarray(home_devices(plan, trace)[rows, 0], dtype=np.int64)
    experts_nLk = np.asarray(trace.experts[rows], dtype=np.int64)
    step_n = step_N[rows]
    num_steps = int(step_n.max()) + 1
    dispatch_LDE = plan.placement.dispatch_device()
    counts = account(home_n[:, None].repeat(trace.num_layers, axis=1), experts_nLk, dispatch_LDE,
                     plan.parallel.bytes_per_token, devices)
    tokens_KD = np.bincount(step_n * devices + home_n, minlength=num_steps * devices).reshape(num_steps, devices)
    per_rank = tokens_KD.sum(axis=0)
    batch = distinct_per_group(step_n * devices + home_n, experts_nLk, num_steps * devices, num_experts)
    batch = batch.reshape(num_steps, devices, -1)  # [K, D, L]
    dest_nLk = dispatch_LDE[np.arange(trace.num_layers)[None, :, None], home_n[:, None, None], experts_nLk]
    # a device serves an expert of layer l for a step when any activation of that step lands there: group by
    # (step, device, layer) with the destination device in place of the home
    served = np.zeros((num_steps, devices, trace.num_layers), dtype=np.int64)
    layer_nLk = np.broadcast_to(np.arange(trace.num_layers)[None, :, None], experts_nLk.shape)
    keys = np.unique((((step_n[:, None, None] * devices + dest_nLk) * trace.num_layers + layer_nLk) * num_experts
                      + experts_nLk).ravel())
    served.ravel()[:] = np.bincount(keys // num_experts, minlength=served.size)
    step_max_mean = tokens_KD.max(axis=1) / tokens_KD.mean(axis=1)
    out = {
        "decode_lar": float(counts.local_activations.sum() / counts.total_activations.sum()),
        "decode_tokens": int(len(rows)),
        "decode_steps": num_steps,
        "decode_token_imbalance_max_mean": float(per_rank.max() / per_rank.mean()),
        "decode_step_token_imbalance_max_mean": float(step_max_mean.mean()),
        "decode_expert_load_imbalance_max_mean": float(_max_over(counts.expert_load, np.mean).mean()),
        "decode_batch_distinct_experts_max": float(batch.max(axis=1).mean()),
        "decode_batch_distinct_experts_mean": float(batch.mean()),
        "decode_device_distinct_experts_max": float(served.max(axis=1).mean()),
    }
    if time_model is not None:
        seconds = decode_moe_seconds(time_model, step_n, home_n, experts_nLk, num_steps, devices)
        out.update(decode_moe_seconds=float(seconds.sum()), decode_moe_seconds_per_step=float(seconds.sum() / num_steps))
    return out


def decode_moe_seconds(model: TimeModel, step_n: np.ndarray, home_n: np.ndarray, experts_nLk: np.ndarray,
                       num_steps: int, devices: int) -> np.ndarray:
    """float64[K] MoE critical-path seconds (dispatch + experts + combine, summed over trace layers) of each decode
    step, priced as decode iterations by the simulator's cost model (as time_cost.time_estimate prices steps)."""
    from repro.sim.traffic import batch_traffic  # the simulator package only where a time is priced (as time_cost)

    out = np.zeros(num_steps)
    num_layers = experts_nLk.shape[1]
    for first in range(0, num_steps, STEPS_PER_BLOCK):
        rows = np.flatnonzero((step_n >= first) & (step_n < first + STEPS_PER_BLOCK))
        if len(rows) == 0:
            continue
        group = step_n[rows] - first
        num_k = int(group.max()) + 1
        home_NL = np.broadcast_to(home_n[rows, None], (len(rows), num_layers))
        traffic = batch_traffic(group, home_NL, experts_nLk[rows], model.slot_table, model.slots_per_device, num_k,
                                model.devices_per_node)
        tokens_KD = np.bincount(group * devices + home_n[rows], minlength=num_k * devices).reshape(num_k, devices)
        seconds = moe_layer_seconds(model.cost, traffic, tokens_KD, None, np.zeros(num_k, dtype=bool))
        out[first : first + num_k] = sum(part.sum(axis=1) for part in seconds.values())
    return out
