"""`python -m repro.run`: one Hydra job = workload -> routing trace -> system plan -> exact accounting -> runs/.

    python -m repro.run experiment=smoke logger=none
    python -m repro.run -m system=ep parallel.devices=2,4,8 parallel.attention=dp,tp

Each job writes into its output dir (runs/<name>/<overrides>/): metrics.json (summary + resolved config; written
last, so its presence means the job finished), per_layer.csv, traffic.npy, expert_load.npy, token_load.npy,
activation_map.npz, affinity_stats.csv (the paper's Table 1 on the profile split), plan/ and config.yaml. A job whose metrics.json holds the same resolved config is skipped (resume). Routing
traces and trained models are cached under cache_dir keyed by the config that made them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import hydra
import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from repro.atomic import atomic_write
from repro.errors import ReproError
from repro.parallel import ParallelConfig
from repro.traces import RoutingTrace, read_trace, select_requests, split_indices, write_trace

log = logging.getLogger("repro.run")


# ---- outputs -------------------------------------------------------------------------------------------------


def job_finished(out_dir: Path, config: dict) -> bool:
    metrics = out_dir / "metrics.json"
    if not metrics.exists():
        return False
    try:
        return json.loads(metrics.read_text()).get("config") == config
    except json.JSONDecodeError:
        return False


def config_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---- traces --------------------------------------------------------------------------------------------------


def _workload_kwargs(workload_cfg: dict, tokenizer: str, seed: int) -> dict:
    kwargs = {k: v for k, v in workload_cfg.items() if k != "name"}
    if isinstance(kwargs.get("output_len"), list):
        kwargs["output_len"] = tuple(kwargs["output_len"])
    return dict(kwargs, tokenizer=tokenizer, seed=seed)


def routed_workload(cfg: dict, workload_cfg: dict, cache_dir: Path) -> tuple[RoutingTrace, np.ndarray, np.ndarray]:
    """(trace of every request of `workload_cfg`, profile request indices, evaluate request indices).

    A trained routing model may learn only from the profile split of its training workload: cfg["train_workload"]
    when set (cross-dataset runs keep one model for every workload), else the profiling workload cfg["workload"].
    """
    from repro.routing import route_workload
    from repro.workloads import load_workload

    model_cfg, seed, fraction = cfg["model"], cfg["seed"], cfg["profile_fraction"]
    train_cfg = cfg.get("train_workload") or cfg["workload"]
    key = config_key(model_cfg, train_cfg, workload_cfg, seed, fraction)
    cached = cache_dir / "traces" / key
    if (cached / "trace" / "meta.json").exists() and (cached / "split.json").exists():
        split = json.loads((cached / "split.json").read_text())
        log.info("routing trace from cache %s", cached)
        return read_trace(cached / "trace"), np.asarray(split["profile"]), np.asarray(split["evaluate"])

    def load(wcfg: dict):
        workload = load_workload(wcfg["name"], **_workload_kwargs(wcfg, model_cfg["tokenizer"], seed))
        return workload, *split_indices(len(workload.requests), fraction, np.random.default_rng(seed))

    workload, profile_idx, eval_idx = load(workload_cfg)
    training, train_idx, _ = (workload, profile_idx, None) if train_cfg == workload_cfg else load(train_cfg)
    trace = route_workload(
        model_cfg,
        workload.requests,
        [training.requests[i] for i in train_idx],
        cache_dir=cache_dir,
        seed=seed,
        dataset=workload.name,
        tokenizer=workload.tokenizer,
        vocab_size=workload.vocab_size,
    )
    write_trace(trace, cached / "trace")
    atomic_write(
        cached / "split.json",
        lambda p: p.write_text(json.dumps({"profile": profile_idx.tolist(), "evaluate": eval_idx.tolist()})),
    )
    return trace, profile_idx, eval_idx


def build_traces(cfg: dict) -> tuple[RoutingTrace, RoutingTrace]:
    """(profile trace, evaluation trace) for this job."""
    rng = np.random.default_rng(cfg["seed"])
    if cfg.get("trace"):
        trace = read_trace(cfg["trace"])
        if cfg.get("profile_trace"):
            return read_trace(cfg["profile_trace"]), trace
        profile_idx, eval_idx = split_indices(trace.num_requests, cfg["profile_fraction"], rng)
        return select_requests(trace, profile_idx), select_requests(trace, eval_idx)
    cache_dir = Path(cfg["cache_dir"])
    trace, profile_idx, eval_idx = routed_workload(cfg, cfg["workload"], cache_dir)
    profile = select_requests(trace, profile_idx)
    if cfg.get("eval_workload"):
        other, _, other_eval_idx = routed_workload(cfg, cfg["eval_workload"], cache_dir)
        return profile, select_requests(other, other_eval_idx)
    return profile, select_requests(trace, eval_idx)


# ---- one job -------------------------------------------------------------------------------------------------


def a2a_seconds_estimate(traffic: np.ndarray, hardware: dict) -> float:
    """Dispatch + combine time if every layer's all-to-all is bound by its busiest device's send or receive.

    traffic int[L, D, D] dispatch bytes; combine mirrors it, so the total is twice the dispatch time.
    """
    busiest = np.maximum(traffic.sum(axis=2), traffic.sum(axis=1)).max(axis=1)  # [L]
    per_layer = busiest / (hardware["a2a_bandwidth_gbps"] * 1e9) + hardware["a2a_latency_us"] * 1e-6
    return float(2 * per_layer.sum())


def run_job(cfg: DictConfig, out_dir: Path) -> dict | None:
    from repro.affinity.stats import affinity_statistics
    from repro.eval import evaluate
    from repro.systems import make_system

    config = OmegaConf.to_container(cfg, resolve=True)
    if job_finished(out_dir, config):
        log.info("%s already finished with this config; skipping", out_dir)
        return None

    profile, evaluation = build_traces(config)
    parallel = ParallelConfig(**config["parallel"])
    system = make_system(config["system"]["name"], **(config["system"].get("params") or {}))
    # bounds such as the fit oracle are fitted on the evaluated routing itself, by definition
    fit_on = evaluation if getattr(system, "fits_on_evaluation", False) else profile
    t0 = time.perf_counter()
    plan = system.fit(fit_on, parallel, np.random.default_rng(config["seed"]))
    fit_seconds = time.perf_counter() - t0
    result = evaluate(plan, evaluation, history=config["history"], progress=True)
    eval_seconds = time.perf_counter() - t0 - fit_seconds

    summary = dict(result.summary)
    summary.update(
        system=config["system"]["name"],
        model=evaluation.meta.model,
        dataset=evaluation.meta.dataset,
        profile_dataset=profile.meta.dataset,
        num_requests=evaluation.num_requests,
        profile_requests=profile.num_requests,
        fit_seconds=fit_seconds,
        eval_seconds=eval_seconds,
        a2a_seconds_est=a2a_seconds_estimate(result.traffic, config["hardware"]),
    )
    # W&B first: if tracking fails, no result file has been written yet
    _log_to_wandb(config, summary, result, out_dir)
    plan.save(out_dir / "plan")
    atomic_write(out_dir / "per_layer.csv", lambda p: result.per_layer.to_csv(p, index=False))
    for name, array in (("traffic", result.traffic), ("expert_load", result.expert_load), ("token_load", result.token_load)):
        atomic_write(out_dir / f"{name}.npy", lambda p, a=array: _save_npy(p, a))
    atomic_write(out_dir / "activation_map.npz", lambda p: _save_activation_map(p, evaluation))
    # the paper's Table 1 on the profile split: how predictable each token's experts are from its id alone
    affinity = affinity_statistics(profile)
    atomic_write(out_dir / "affinity_stats.csv", lambda p: affinity.to_csv(p, index=False))
    atomic_write(out_dir / "config.yaml", lambda p: p.write_text(OmegaConf.to_yaml(config)))
    # last: its presence marks the job finished
    atomic_write(
        out_dir / "metrics.json",
        lambda p: p.write_text(json.dumps({"summary": summary, "config": config}, indent=1, default=_json_default)),
    )
    log.info(
        "%s: LAR %.4f  a2a bytes %.3e  imbalance %.3f  (%s, D=%d, %s)",
        out_dir,
        summary["lar"],
        summary["a2a_bytes"],
        summary["expert_load_imbalance_max_mean"],
        summary["system"],
        parallel.devices,
        parallel.attention,
    )
    return summary


def _save_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)


def _save_activation_map(path: Path, trace: RoutingTrace, num_tokens: int = 64) -> None:
    """token_ids int[n] (the n most frequent evaluated tokens) and counts int[L, n, E] of their activations."""
    vocab, inverse, freq = np.unique(trace.token_ids, return_inverse=True, return_counts=True)
    top = np.argsort(-freq, kind="stable")[:num_tokens]
    rank = np.full(len(vocab), -1)
    rank[top] = np.arange(len(top))
    row = rank[inverse]
    keep = row >= 0
    L, E, k = trace.num_layers, trace.meta.num_experts, trace.meta.top_k
    counts = np.zeros((L, len(top), E), dtype=np.int64)
    experts = np.asarray(trace.experts[keep], dtype=np.int64)  # [n_keep, L, k]
    layer = np.broadcast_to(np.arange(L)[None, :, None], experts.shape)
    np.add.at(counts, (layer.ravel(), np.repeat(row[keep], L * k), experts.ravel()), 1)
    with open(path, "wb") as f:
        np.savez(f, token_ids=vocab[top], counts=counts, layer_ids=np.asarray(trace.meta.layer_ids))


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x)}")


def _log_to_wandb(config: dict, summary: dict, result, out_dir: Path) -> None:
    logger = config.get("logger") or {}
    if logger.get("name") != "wandb" or os.environ.get("WANDB_MODE") == "disabled":
        return
    import wandb

    overrides = out_dir.name
    with wandb.init(
        project=logger["project"],
        mode=logger.get("mode", "offline"),
        group=config.get("name"),
        name=overrides,
        dir=str(out_dir),
        config=config,
        settings=wandb.Settings(silent=True),
        reinit="finish_previous",
    ) as run:
        run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        run.log({"per_layer": wandb.Table(dataframe=result.per_layer)})


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run_job(cfg, Path(HydraConfig.get().runtime.output_dir))
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
