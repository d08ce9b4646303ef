"""A fitted plan executed on real ranks with a trace's routing: real all-to-all bytes, checked two ways.

    from repro.exec.trace_mode import ExecConfig, run_exec, run_exec_plans
    summary, per_layer, per_rank = run_exec(ExecConfig(hidden_size=64), plan, evaluation_trace, seed=0)
    [(s_ep, ...), (s_sem, ...)] = run_exec_plans(ExecConfig(), [ep_plan, semmoe_plan], trace)  # one launch

What runs: the first whole requests of the trace (at most `max_tokens` tokens), with seeded random hidden
states and seeded random SwiGLU experts per layer ([E, 2I, H] / [E, H, I], scaled 1/sqrt(fan-in)); the routing
is REPLAYED from the trace (its weights when it has them, else 1/k each), so the executed traffic is exactly
the trace's. Every MoE layer is `repro.exec.moe.ep_moe_forward` over `world_size` = plan.parallel.devices ranks,
and the residual stream carries each layer's output into the next (x <- x + moe(x)).
- Attention-DP: plan.reset(), then plan.assign_requests over the executed requests (as repro.eval.home_devices
  does); each rank runs its requests' tokens, trace order, in batches of parallel.tokens_per_step (ranks with
  fewer batches join the remaining collectives with zero tokens).
- Attention-TP: steps of parallel.tokens_per_step tokens in trace order. Every rank holds a seeded random share
  of every token's hidden state (the shares sum to it, like row-parallel attention outputs), and per layer:
  permutation from plan.shuffle_tokens (prev_experts = the true routing of the `history` previous layers, as
  home_devices passes it) -> shuffled_reduce_scatter -> ep_moe_forward on this rank's slice ->
  shuffled_all_gather.

Checks: (1) outputs vs `repro.kernels.grouped_gemm.moe_reference` computed by each rank alone on the same input
(max abs error, tolerance `atol`); (2) the bytes each rank sent in dispatch and in combine, per layer, against
the evaluator's exact prediction for the same plan and tokens, `account(home_devices(plan, subset), ...)` with
bytes_per_token = hidden x element size: source rank r's dispatch = traffic[l, r, :].sum(), its combine =
traffic[l, :, r].sum(). `bytes_match_evaluator` is True only when every (layer, rank) pair is equal.

Summary keys: world_size, attention, backend, kernel_backend (resolved), dtype, hidden_size, intermediate_size,
bytes_per_token, num_tokens, num_requests, tokens_per_rank (DP: tokens owned; TP: tokens of its reduce-scatter
slices per layer), <collective>_bytes and <collective>_seconds for each
of repro.exec.moe.COLLECTIVES (bytes summed over ranks and layers; seconds of the slowest rank, summed over
layers), evaluator_dispatch_bytes, evaluator_combine_bytes, bytes_match_evaluator, max_abs_error, atol,
output_matches_reference, launch_wall_seconds (spawn included), rank_seconds_max (the layers alone).

`run_exec_job(config, plan, trace, out_dir)` is the Hydra hook (config["exec"] holds ExecConfig's fields): it
writes exec_per_layer.csv and exec_per_rank.csv and returns summary keys prefixed "exec_" for metrics.json.

Legend: N executed tokens, R executed requests, L MoE layers, k experts per token, E experts, H hidden,
I expert intermediate size, D ranks, P physical slots per layer, T tokens in a step, S steps.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from repro.errors import ConfigError, TraceError
from repro.exec.launch import in_torchrun, join, launch, worker_device
from repro.exec.moe import (
    COLLECTIVES,
    CommRecord,
    build_local_experts,
    ep_moe_forward,
    resolve_kernel_backend,
    shuffled_all_gather,
    shuffled_reduce_scatter,
)
from repro.exec_config import (  # noqa: F401  ExecConfig and the checks are part of this module's API
    DEFAULT_ATOL,
    EXEC_MODES,
    EXEC_TABLE,
    MODEL_LOGIT_ATOL,
    ExecConfig,
    check_exec_fields,
    check_exec_table,
)
from repro.systems.base import Plan
from repro.traces import RoutingTrace, select_requests

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # DTYPE_NAMES' torch types


def check_exec_config(exec_cfg: ExecConfig | dict, parallel, world_size: int | None = None) -> ExecConfig:
    """check_exec_fields (repro.exec_config), then what depends on this machine: the kernel backend on its device."""
    exec_cfg = check_exec_fields(exec_cfg, parallel, world_size)
    resolve_kernel_backend(exec_cfg.kernel_backend, torch.device("cuda" if exec_cfg.backend == "nccl" else "cpu"))
    return exec_cfg


def check_exec(exec_cfg: ExecConfig, plan: Plan, trace: RoutingTrace, world_size: int | None = None) -> None:
    """check_exec_config, then one ConfigError sentence when the plan does not fit the trace's model."""
    check_exec_config(exec_cfg, plan.parallel, world_size)
    placement = plan.placement
    if placement.num_devices != plan.parallel.devices:
        raise ConfigError(
            f"{type(plan).__name__} places experts on {placement.num_devices} devices but its parallel config says "
            f"{plan.parallel.devices}; build the plan with one ParallelConfig."
        )
    if (placement.num_layers, placement.num_experts) != (trace.num_layers, trace.meta.num_experts):
        raise ConfigError(
            f"{type(plan).__name__} places {placement.num_experts} experts in {placement.num_layers} MoE layers but "
            f"the trace's model has {trace.meta.num_experts} experts in {trace.num_layers}; fit the plan on a trace "
            "of the same model."
        )


def exec_subset(trace: RoutingTrace, max_tokens: int) -> RoutingTrace:
    """The trace's first whole requests holding at most max_tokens tokens together."""
    fits = int(np.searchsorted(np.cumsum(trace.lengths()), max_tokens, side="right"))
    if fits == 0:
        raise TraceError(
            f"the trace's first request has {int(trace.lengths()[0]) if trace.num_requests else 0} tokens, more "
            f"than exec.max_tokens={max_tokens}; raise exec.max_tokens."
        )
    return select_requests(trace, np.arange(fits))


# ---- the schedule, fixed by the driver before any rank starts ------------------------------------------------


def dp_token_ranks(plan: Plan, trace: RoutingTrace) -> np.ndarray:
    """int64[N] rank of each token: plan.reset(), then one assign_requests over all requests (as home_devices)."""
    plan.reset()
    ranks_R = np.asarray(plan.assign_requests(np.array(trace.token_ids), np.array(trace.offsets),
                                              np.array(trace.prefill_len)), dtype=np.int64)
    return np.repeat(ranks_R, trace.lengths())


def tp_shuffles(plan: Plan, trace: RoutingTrace, history: int) -> tuple[np.ndarray, np.ndarray]:
    """(permutation int64[L, N] step-local, counts int64[S, L, D]): plan.reset(), then per step of
    parallel.tokens_per_step tokens and per layer plan.shuffle_tokens, called exactly as home_devices calls it."""
    plan.reset()
    step, num_layers, devices = plan.parallel.tokens_per_step, trace.num_layers, plan.parallel.devices
    starts = range(0, trace.num_tokens, step)
    permutation_LN = np.empty((num_layers, trace.num_tokens), dtype=np.int64)
    counts_SLD = np.empty((len(starts), num_layers, devices), dtype=np.int64)
    oracle = bool(getattr(plan, "uses_true_routing", False))
    for s, start in enumerate(starts):
        stop = min(start + step, trace.num_tokens)
        token_ids, experts_TLk = np.array(trace.token_ids[start:stop]), np.array(trace.experts[start:stop])
        for layer in range(num_layers):
            first = max(0, layer - history)
            prev = experts_TLk[:, first:layer, :] if layer > first else None
            extra = {"current_experts": experts_TLk[:, layer, :]} if oracle else {}
            perm, counts = plan.shuffle_tokens(token_ids, layer, prev, **extra)
            permutation_LN[layer, start:stop], counts_SLD[s, layer] = perm, counts
    return permutation_LN, counts_SLD


def evaluator_bytes(plan: Plan, trace: RoutingTrace, bytes_per_token: int, history: int) -> tuple[np.ndarray, np.ndarray]:
    """(dispatch int64[L, D], combine int64[L, D]): bytes each source rank sends per layer, by the evaluator."""
    from repro.eval import account, home_devices

    counts = account(home_devices(plan, trace, history=history), trace.experts, plan.placement.dispatch_device(),
                     bytes_per_token, plan.parallel.devices)
    return counts.traffic.sum(axis=2), counts.traffic.sum(axis=1)


# ---- one rank ------------------------------------------------------------------------------------------------


def _generator(*keys: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(np.random.SeedSequence(list(keys)).generate_state(1, np.uint64)[0] >> 1))


def expert_weights(seed: int, layer: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype):
    """(w13 [E, 2I, H], w2 [E, H, I]) of one layer, seeded by (seed, layer), on the CPU, in `dtype`."""
    g = _generator(seed, 1, layer)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def tp_shares(x_TH: torch.Tensor, seed: int, layer: int, step: int, num_ranks: int, rank: int) -> torch.Tensor:
    """This rank's share [T, H] of x: x / D plus seeded zero-sum noise, so the D shares sum to x (up to rounding)."""
    noise_DTH = torch.randn((num_ranks, *x_TH.shape), generator=_generator(seed, 2, layer, step))
    noise_DTH -= noise_DTH.mean(dim=0)
    return (x_TH.float() / num_ranks + noise_DTH[rank].to(x_TH.device)).to(x_TH.dtype)


def exec_worker(rank: int, world_size: int, *, setups: list[dict]) -> dict:
    """One rank of `run_exec_plans`: {"runs": [execute_setup(...) for each setup]}, all in one process group."""
    return {"runs": [execute_setup(rank, world_size, setup) for setup in setups]}


def execute_setup(rank: int, world_size: int, setup: dict) -> dict:
    """One rank of one plan's execution: every MoE layer on its tokens; returns {"comm": CommRecord rows,
    "max_abs_error", "tokens", "seconds"}. setup: what `prepare` made (identical on every rank)."""
    from repro.kernels.grouped_gemm import moe_reference

    device = worker_device(dist.get_backend(), rank)
    dtype = DTYPES[setup["dtype"]]
    hidden, inter, seed = setup["hidden_size"], setup["intermediate_size"], setup["seed"]
    num_experts, step = setup["num_experts"], setup["tokens_per_step"]
    experts_NLk = torch.as_tensor(setup["experts"].astype(np.int64), device=device)
    weights_NLk = torch.as_tensor(setup["weights"], dtype=torch.float32, device=device)
    num_tokens, num_layers, _ = experts_NLk.shape
    x_NH = torch.randn(num_tokens, hidden, generator=_generator(seed, 0)).to(device, dtype)
    record, worst = CommRecord(barrier=setup["barrier_timing"]), 0.0
    if setup["attention"] == "dp":
        mine = np.flatnonzero(setup["token_rank"] == rank)
        batches = [mine[s * step:(s + 1) * step] for s in range(setup["num_steps"])]
    else:
        starts = range(0, num_tokens, step)
    dist.barrier()
    started = time.perf_counter()
    for layer in range(num_layers):
        w13, w2 = (w.to(device) for w in expert_weights(seed, layer, num_experts, hidden, inter, dtype))
        local = build_local_experts(setup["physical_to_logical"][layer], rank, world_size, w13, w2)
        expert_rank_E = torch.as_tensor(setup["dispatch_device"][layer, rank], device=device)
        ids_Nk, weights_Nk = experts_NLk[:, layer], weights_NLk[:, layer]
        if setup["attention"] == "dp":
            for batch in batches:
                rows = torch.as_tensor(batch, device=device)
                x_TH = x_NH[rows]
                y_TH = ep_moe_forward(x_TH, ids_Nk[rows], weights_Nk[rows], expert_rank_E, local, num_experts,
                                      layer=layer, record=record, backend=setup["kernel_backend"])
                worst = max(worst, _max_error(y_TH, moe_reference(x_TH, ids_Nk[rows], weights_Nk[rows], w13, w2)))
                x_NH[rows] = x_TH + y_TH
            continue
        for s, start in enumerate(starts):
            stop = min(start + step, num_tokens)
            permutation_T, counts_D = setup["permutation"][layer, start:stop], setup["counts"][s, layer]
            x_TH = x_NH[start:stop]
            x_tH = shuffled_reduce_scatter(tp_shares(x_TH, seed, layer, s, world_size, rank), permutation_T,
                                           counts_D, layer=layer, record=record)
            offset = int(counts_D[:rank].sum())
            rows = torch.as_tensor(start + permutation_T[offset:offset + int(counts_D[rank])], device=device)
            y_tH = ep_moe_forward(x_tH, ids_Nk[rows], weights_Nk[rows], expert_rank_E, local, num_experts,
                                  layer=layer, record=record, backend=setup["kernel_backend"])
            y_TH = shuffled_all_gather(y_tH, permutation_T, counts_D, layer=layer, record=record)
            reference = moe_reference(x_TH, ids_Nk[start:stop], weights_Nk[start:stop], w13, w2)
            worst = max(worst, _max_error(y_TH, reference))
            x_NH[start:stop] = x_TH + y_TH
    seconds = time.perf_counter() - started
    # DP: the tokens this rank owns; TP: the tokens of its reduce-scatter slices (per layer, mean over layers)
    tokens = len(mine) if setup["attention"] == "dp" else setup["counts"][:, :, rank].sum() // num_layers
    return {"comm": record.to_json(), "max_abs_error": worst, "tokens": int(tokens), "seconds": seconds}


def _max_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y.float() - reference.float()).abs().max()) if y.numel() else 0.0


# ---- the driver ----------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    """What the driver fixes before any rank starts: the rank inputs and the evaluator's prediction."""

    setup: dict  # arrays and scalars every rank reads (see execute_setup)
    subset: RoutingTrace  # the executed requests
    expected_dispatch_LD: np.ndarray  # int64[L, D] evaluator's dispatch bytes per source rank
    expected_combine_LD: np.ndarray  # int64[L, D] evaluator's combine bytes per sending rank


def prepare(exec_cfg: ExecConfig, plan: Plan, trace: RoutingTrace, *, seed: int = 0, history: int = 2,
            world_size: int | None = None) -> Prepared:
    """Check the inputs, cut the executed subset, fix the schedule and ask the evaluator for the bytes."""
    check_exec(exec_cfg, plan, trace, world_size)
    subset = exec_subset(trace, exec_cfg.max_tokens)
    top_k = subset.meta.top_k
    weights = (np.full(subset.experts.shape, 1.0 / top_k, dtype=np.float32) if subset.weights is None
               else np.asarray(subset.weights, dtype=np.float32))
    setup = {
        "attention": plan.parallel.attention,
        "tokens_per_step": plan.parallel.tokens_per_step,
        "dtype": exec_cfg.dtype,
        "hidden_size": exec_cfg.hidden_size,
        "intermediate_size": exec_cfg.intermediate_size,
        "kernel_backend": exec_cfg.kernel_backend,
        "barrier_timing": bool(exec_cfg.barrier_timing),
        "seed": int(seed),
        "num_experts": subset.meta.num_experts,
        "experts": np.asarray(subset.experts),
        "weights": weights,
        "physical_to_logical": plan.placement.physical_to_logical,
        "dispatch_device": plan.placement.dispatch_device(),
    }
    if plan.parallel.attention == "dp":
        token_rank = dp_token_ranks(plan, subset)
        most = np.bincount(token_rank, minlength=plan.parallel.devices).max()
        setup.update(token_rank=token_rank, num_steps=int(-(-most // plan.parallel.tokens_per_step)))
    else:
        setup["permutation"], setup["counts"] = tp_shuffles(plan, subset, history)
    expected_dispatch_LD, expected_combine_LD = evaluator_bytes(plan, subset, bytes_per_token(exec_cfg), history)
    return Prepared(setup, subset, expected_dispatch_LD, expected_combine_LD)


def bytes_per_token(exec_cfg: ExecConfig) -> int:
    """hidden x element size: what one token copy of the executed hidden states weighs on the wire."""
    return exec_cfg.hidden_size * torch.empty(0, dtype=DTYPES[exec_cfg.dtype]).element_size()


def run_exec_plans(
    exec_cfg: ExecConfig, plans: list[Plan], trace: RoutingTrace, *, seed: int = 0, history: int = 2
) -> list[tuple[dict, pd.DataFrame, pd.DataFrame]]:
    """[(summary, per_layer, per_rank)] per plan, all executed in ONE process group (plans of one device count).

    Spawns the ranks here, or, under torchrun, runs this process as its rank (every rank must call it with the
    same arguments; every rank gets the same result). per_layer: one row per MoE layer, bytes summed over ranks,
    seconds of the slowest rank per collective, the evaluator's bytes and the match; per_rank: one row per
    (layer, rank).
    """
    world_size = int(os.environ["WORLD_SIZE"]) if in_torchrun() else None
    prepared = [prepare(exec_cfg, plan, trace, seed=seed, history=history, world_size=world_size) for plan in plans]
    devices = {plan.parallel.devices for plan in plans}
    if len(devices) != 1:
        raise ConfigError(f"plans executed together must share one device count, got {sorted(devices)}; run them apart.")
    setups = [p.setup for p in prepared]
    started = time.perf_counter()
    if world_size is not None:
        results = join(exec_worker, backend=exec_cfg.backend, timeout_s=exec_cfg.timeout_s, setups=setups)
    else:
        results = launch(exec_worker, devices.pop(), backend=exec_cfg.backend, timeout_s=exec_cfg.timeout_s,
                         setups=setups)
    wall = time.perf_counter() - started
    return [summarise(exec_cfg, p, [r["runs"][i] for r in results], wall) for i, p in enumerate(prepared)]


def run_exec(
    exec_cfg: ExecConfig, plan: Plan, trace: RoutingTrace, *, seed: int = 0, history: int = 2
) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """(summary, per_layer, per_rank) of one plan (see run_exec_plans and the module docstring)."""
    return run_exec_plans(exec_cfg, [plan], trace, seed=seed, history=history)[0]


def summarise(exec_cfg: ExecConfig, prepared: Prepared, results: list[dict], wall: float):
    """(summary, per_layer, per_rank) from every rank's result of one setup."""
    subset = prepared.subset
    records = [CommRecord.from_json(r["comm"]) for r in results]
    per_rank = _per_rank_rows(records, subset.num_layers, prepared.expected_dispatch_LD, prepared.expected_combine_LD)
    per_layer = _per_layer_rows(per_rank, subset)
    worst = max(r["max_abs_error"] for r in results)
    device = torch.device("cuda" if exec_cfg.backend == "nccl" else "cpu")
    summary = {
        "world_size": len(results),
        "attention": prepared.setup["attention"],
        "backend": exec_cfg.backend,
        "kernel_backend": resolve_kernel_backend(exec_cfg.kernel_backend, device),
        "dtype": exec_cfg.dtype,
        "hidden_size": exec_cfg.hidden_size,
        "intermediate_size": exec_cfg.intermediate_size,
        "bytes_per_token": bytes_per_token(exec_cfg),
        "num_tokens": subset.num_tokens,
        "num_requests": subset.num_requests,
        "tokens_per_rank": [r["tokens"] for r in results],
        "evaluator_dispatch_bytes": int(prepared.expected_dispatch_LD.sum()),
        "evaluator_combine_bytes": int(prepared.expected_combine_LD.sum()),
        "bytes_match_evaluator": bool(per_rank["bytes_match"].all()),
        "max_abs_error": worst,
        "atol": exec_cfg.tolerance,
        "barrier_timing": bool(exec_cfg.barrier_timing),
        "output_matches_reference": bool(worst <= exec_cfg.tolerance),
        "launch_wall_seconds": wall,
        "rank_seconds_max": max(r["seconds"] for r in results),
    }
    for name in COLLECTIVES:
        summary[f"{name}_bytes"] = int(per_layer[f"{name}_bytes"].sum())
        summary[f"{name}_seconds"] = float(per_layer[f"{name}_seconds"].sum())
    return summary, per_layer, per_rank


def _per_rank_rows(records, num_layers: int, expected_dispatch_LD, expected_combine_LD) -> pd.DataFrame:
    rows = []
    for rank, record in enumerate(records):
        for layer in range(num_layers):
            row = {"layer": layer, "rank": rank}
            for name in COLLECTIVES:
                row[f"{name}_bytes"] = record.bytes_of(layer, name)
                row[f"{name}_seconds"] = record.seconds.get((layer, name), 0.0)
            row["evaluator_dispatch_bytes"] = int(expected_dispatch_LD[layer, rank])
            row["evaluator_combine_bytes"] = int(expected_combine_LD[layer, rank])
            row["bytes_match"] = (row["dispatch_bytes"] == row["evaluator_dispatch_bytes"]
                                  and row["combine_bytes"] == row["evaluator_combine_bytes"])
            rows.append(row)
    return pd.DataFrame(rows)


def _per_layer_rows(per_rank: pd.DataFrame, trace: RoutingTrace) -> pd.DataFrame:
    """Bytes summed over ranks; seconds of the slowest rank (a collective ends when its last rank does)."""
    byte_columns = [c for c in per_rank.columns if c.endswith("_bytes")]
    second_columns = [c for c in per_rank.columns if c.endswith("_seconds")]
    grouped = per_rank.groupby("layer")
    per_layer = pd.concat(
        [grouped[byte_columns].sum(), grouped[second_columns].max(), grouped[["bytes_match"]].all()], axis=1
    ).reset_index()
    per_layer.insert(1, "layer_id", np.asarray(trace.meta.layer_ids, dtype=np.int64)[per_layer["layer"]])
    return per_layer


def run_exec_job(config: dict, plan: Plan, trace: RoutingTrace, out_dir: Path | None) -> dict:
    """The Hydra hook: run_exec with config["exec"], the job's seed and history; writes exec_per_layer.csv and
    exec_per_rank.csv into out_dir (None: write nothing, e.g. torchrun ranks other than 0) and returns the summary
    with keys prefixed "exec_"."""
    from repro.atomic import atomic_write

    exec_cfg = ExecConfig.from_config(config["exec"])
    if exec_cfg.mode == "model":
        return {f"exec_{key}": value for key, value in run_model_job(config, exec_cfg, plan, trace).items()}
    summary, per_layer, per_rank = run_exec(exec_cfg, plan, trace, seed=config["seed"], history=config["history"])
    if out_dir is not None:
        atomic_write(Path(out_dir) / "exec_per_layer.csv", lambda p: per_layer.to_csv(p, index=False))
        atomic_write(Path(out_dir) / "exec_per_rank.csv", lambda p: per_rank.to_csv(p, index=False))
    return {f"exec_{key}": value for key, value in summary.items()}


def run_model_job(config: dict, exec_cfg: ExecConfig, plan: Plan, trace: RoutingTrace) -> dict:
    """exec.mode=model: the tiny model that routed `trace` runs its first requests (up to exec.max_tokens) on real
    ranks (repro.exec.model.run_model); returns its scalars plus the byte totals and the logit tolerance check."""
    from repro.exec.model import load_tiny_model, run_model

    model, vocab = load_tiny_model(trace, cache_dir=config["cache_dir"])
    result = run_model(
        plan, exec_subset(trace, exec_cfg.max_tokens), model, vocab, world_size=exec_cfg.world_size,
        backend=exec_cfg.backend, kernel_backend=exec_cfg.kernel_backend, history=config["history"],
        timeout_s=exec_cfg.timeout_s,
    )
    summary = {key: value for key, value in result.items() if isinstance(value, bool | int | float | str)}
    # the trace mode's key names, so both modes read alike in metrics.json and the report
    summary["bytes_match_evaluator"] = summary.pop("bytes_match")
    for name in ("dispatch", "combine"):
        summary[f"{name}_bytes"] = int(np.sum(result[f"{name}_bytes"]))
        summary[f"evaluator_{name}_bytes"] = int(np.sum(result[f"expected_{name}_bytes"]))
    for name, per_rank in result["collective_seconds"].items():
        summary[f"{name}_seconds"] = float(max(per_rank))
    summary["rank_seconds_max"] = float(max(result["forward_seconds"]))
    summary["output_matches_reference"] = result["max_logit_error"] <= MODEL_LOGIT_ATOL
    return summary
