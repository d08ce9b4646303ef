"""`python -m repro.run`: one Hydra job = workload -> routing trace -> system plan -> exact accounting -> runs/.

    python -m repro.run experiment=smoke logger=none
    python -m repro.run -m system=ep parallel.devices=2,4,8 parallel.attention=dp,tp
    torchrun --nproc-per-node 4 -m repro.run experiment=exec logger=none   # this process is one rank (torchrun_job)

Each job writes into its output dir (runs/<name>/<overrides>/): metrics.json (summary + resolved config; written
last, so its presence means the job finished; the same bytes in every run of one config), timings.json (wall-clock
seconds of this run), per_layer.csv, traffic.npy, expert_load.npy, token_load.npy,
activation_map.npz, request_activations.npz (the paper's Fig. 6 a-c), affinity_stats.csv (the paper's Table 1 on
the profile split), plan/ and config.yaml. They are written into a staging folder (.staging-*) and then moved
into place, metrics.json last (after the old one is removed): a kill leaves the previous complete job or an
unfinished one, never a finished-looking mix of two runs. A job whose metrics.json holds the same resolved config
is skipped (resume). Routing traces and trained models are cached under cache_dir keyed by the config that made them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import hydra
import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from repro.atomic import atomic_dir, atomic_write, process_alive
from repro.config_schema import check_config, multirun_argv
from repro.errors import ConfigError, ReproError
from repro.jobdir import (
    job_dirname,  # noqa: F401  registers the resolver conf/config.yaml names its run dirs with
    remove_failed_job_dir,  # tune, exec and count_job take it from repro.jobdir
)
from repro.parallel import ParallelConfig
from repro.traces import RoutingTrace, Split, read_trace, select_requests, split_indices, trace_digest, write_trace
from repro.tracking import JobRun

log = logging.getLogger("repro.run")


# ---- outputs -------------------------------------------------------------------------------------------------


def job_finished(out_dir: Path, config: dict, digests: dict) -> bool:
    """True when out_dir holds a finished job of this config on traces with these content digests."""
    metrics = out_dir / "metrics.json"
    if not metrics.exists():
        return False
    try:
        done = json.loads(metrics.read_text())
    except json.JSONDecodeError:
        return False
    return done.get("config") == config and done.get("summary", {}).get("trace_digests") == digests


# Every file or folder a job may publish into its output dir besides metrics.json: a rerun removes the ones it does
# not write again, so a finished job never mixes two runs (say an old sim_per_rate.csv beside new metrics).
JOB_OUTPUTS = (
    "plan", "per_layer.csv", "traffic.npy", "expert_load.npy", "token_load.npy", "activation_map.npz",
    "request_activations.npz", "affinity_stats.csv", "config.yaml", "sim_per_rate.csv", "sim_per_layer.csv", "sim_probes.csv",
    "sim_requests.parquet",
    "exec_per_layer.csv", "exec_per_rank.csv", "timings.json", "drift_windows.csv", "drift_events.csv",
    "drift_serving.csv",
)
# Staging folders start with "." (figures' rglob("metrics.json") finds none there: metrics.json is never staged)
# and name their host and process, so a rerun can remove those its killed predecessors left behind.
STAGING_PREFIX = ".staging-"


def remove_dead_staging(out_dir: Path) -> None:
    """Remove staging folders in out_dir left by killed jobs of this host (their process is gone); folders of
    live processes or of other hosts (a shared file system) are left alone."""
    host = socket.gethostname()
    for folder in out_dir.glob(f"{STAGING_PREFIX}*"):
        stem = folder.name[len(STAGING_PREFIX):]
        parts = stem.rsplit("-", 2)  # host-pid-random (tempfile's random part has no "-")
        if len(parts) == 3 and parts[0] == host and parts[1].isdigit() and not process_alive(int(parts[1])):
            shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def staging_dir(out_dir: Path) -> Iterator[Path]:
    """A fresh staging folder inside out_dir (same file system, so publishing is renames only); removed on exit,
    whether the job published (it is empty then) or failed."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_dead_staging(out_dir)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{socket.gethostname()}-{os.getpid()}-", dir=out_dir))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def non_finite(value, path: str = "") -> tuple[str, float] | None:
    """(dotted key path, value) of the first NaN or infinite number in a JSON-like value, or None."""
    if isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    else:
        is_float = isinstance(value, float | np.floating)
        return (path, float(value)) if is_float and not np.isfinite(value) else None
    return next((found for key, item in items if (found := non_finite(item, key)) is not None), None)


# wall-clock measurements of this run: they differ between two runs of one config, so they go to timings.json and
# metrics.json holds what two runs reproduce byte for byte (`cmp a/metrics.json b/metrics.json` compares two runs)
TIMING_KEYS = frozenset({"fit_seconds", "eval_seconds", "sim_wall_s", "sim_cpu_s", "sim_requests_per_wall_s",
                         "sim_events_per_wall_s"})


def is_timing(key: str) -> bool:
    """True for a wall-clock key: TIMING_KEYS, repro.exec's measured seconds (exec_*seconds*) and the plan's solver
    and fit times (plan_*_seconds; a system's modelled times are named *_s or *_est, never plan_*_seconds)."""
    return (key in TIMING_KEYS or (key.startswith("exec_") and "seconds" in key)
            or (key.startswith("plan_") and key.endswith("_seconds")))


def split_timings(summary: dict) -> tuple[dict, dict]:
    """(the summary without wall-clock keys, those keys), each in the summary's order."""
    return ({k: v for k, v in summary.items() if not is_timing(k)}, {k: v for k, v in summary.items() if is_timing(k)})


def undefined_ratios_as_null(summary: dict) -> dict:
    """max/median ratios are infinite when the median is 0 (a valid but degenerate trace: all tokens on fewer experts
    than half the devices hold): null with a warning, not a refusal that blamed the input."""
    undefined = [k for k, v in summary.items() if "_max_median" in k and isinstance(v, float) and np.isinf(v)]
    if not undefined:
        return summary
    note = (f"{', '.join(undefined)} undefined (the median load is 0: fewer than half the devices receive any "
            "expert work); written as null, see the max/mean ratios")
    log.warning(note)
    return {**summary, **dict.fromkeys(undefined), "warnings": [*summary.get("warnings", []), note]}


def metrics_text(summary: dict, config: dict) -> str:
    """metrics.json's text: strict JSON (no NaN / Infinity, which strict readers reject), or one ReproError.
    Wall-clock keys are left out (split_timings; publish_job writes them to timings.json), so the text is the same
    in every run of one config."""
    payload = {"summary": split_timings(summary)[0], "config": config}
    found = non_finite(payload)
    if found is not None:
        raise ReproError(
            f"metrics.json would hold the non-finite number {found[1]} at {found[0]}; check the inputs it is "
            "computed from (hardware bandwidths and latencies, trace weights, config values) and rerun."
        )
    return json.dumps(payload, indent=1, default=_json_default, allow_nan=False)


def publish_job(staging: Path, out_dir: Path, summary: dict, config: dict) -> None:
    """Move a job's staged outputs into out_dir, metrics.json last.

    The old metrics.json goes first, so a kill at any later point leaves an unfinished job (no metrics.json), never
    a finished-looking folder that mixes two runs; stale outputs this run did not write go next; files move with
    os.replace and plan/ by an atomic folder swap; metrics.json is written (atomically) only once everything else is there.
    """
    text = metrics_text(summary, config)  # a non-finite metric fails here, with the old job still whole
    timings = {k: v if not isinstance(v, float) or np.isfinite(v) else None for k, v in split_timings(summary)[1].items()}
    (out_dir / "metrics.json").unlink(missing_ok=True)
    staged = sorted(path.name for path in staging.iterdir())
    for name in sorted(set(JOB_OUTPUTS) - set(staged)):
        stale = out_dir / name
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale)
        else:
            stale.unlink(missing_ok=True)
    for name in staged:
        source, target = staging / name, out_dir / name
        if source.is_dir():  # atomic_dir swaps it in whole (the renamed staged folder fills its empty temporary)
            atomic_dir(target, lambda tmp, source=source: os.replace(source, tmp), replace=True)
        else:
            os.replace(source, target)
    if timings:
        atomic_write(out_dir / "timings.json", lambda p: p.write_text(json.dumps(timings, indent=1) + "\n"))
    atomic_write(out_dir / "metrics.json", lambda p: p.write_text(text))


def config_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---- traces --------------------------------------------------------------------------------------------------

SPLITS = ("validate", "evaluate")  # what a job may evaluate on; systems are always fitted on the profile split


def _workload_kwargs(workload_cfg: dict, tokenizer: str, seed: int) -> dict:
    kwargs = {k: v for k, v in workload_cfg.items() if k != "name"}
    if isinstance(kwargs.get("output_len"), list):
        kwargs["output_len"] = tuple(kwargs["output_len"])
    return dict(kwargs, tokenizer=tokenizer, seed=seed)


def request_split(cfg: dict, num_requests: int) -> Split:
    """The seeded profile / validate / evaluate split of a workload or trace of `num_requests` requests."""
    return split_indices(
        num_requests, cfg["profile_fraction"], np.random.default_rng(cfg["seed"]), cfg.get("validate_fraction", 0.0)
    )


def routed_workload(cfg: dict, workload_cfg: dict, cache_dir: Path, on_progress=None) -> tuple[RoutingTrace, Split]:
    """(trace of every request of `workload_cfg`, its profile / validate / evaluate split).

    A trained routing model may learn only from the profile split of its training workload: cfg["train_workload"]
    when set (cross-dataset runs keep one model for every workload), else the profiling workload cfg["workload"].
    The profile split does not depend on validate_fraction, so the cached trace is keyed without it.
    """
    from repro.routing import ROUTING_CACHE_VERSION, route_workload
    from repro.workloads import load_workload

    model_cfg, seed, fraction = cfg["model"], cfg["seed"], cfg["profile_fraction"]
    train_cfg = cfg.get("train_workload") or cfg["workload"]
    # the routing code's version is part of the key: a trace routed by older code (or an older tiny model) is
    # never reused for this config
    key = config_key(model_cfg, train_cfg, workload_cfg, seed, fraction, ROUTING_CACHE_VERSION)
    cached = cache_dir / "traces" / key
    if (cached / "trace" / "meta.json").exists():
        log.info("routing trace from cache %s", cached)
        trace = read_trace(cached / "trace")
        return trace, request_split(cfg, trace.num_requests)

    def load(wcfg: dict):
        workload = load_workload(wcfg["name"], **_workload_kwargs(wcfg, model_cfg["tokenizer"], seed))
        return workload, request_split(cfg, len(workload.requests))

    workload, split = load(workload_cfg)
    training, train_split = (workload, split) if train_cfg == workload_cfg else load(train_cfg)
    trace = route_workload(
        model_cfg,
        workload.requests,
        [training.requests[i] for i in train_split.profile],
        cache_dir=cache_dir,
        seed=seed,
        dataset=workload.name,
        tokenizer=workload.tokenizer,
        vocab_size=workload.vocab_size,
        on_progress=on_progress,  # training and capture progress, to W&B (repro.tracking)
    )
    if trace.meta.extra.get("model_cached", True):  # routing of a model a time budget cut short is not reused
        write_trace(trace, cached / "trace", if_exists="keep")  # jobs racing on one entry: the first wins
    return trace, split


def check_trace_options(cfg: dict) -> None:
    """Reject option combinations that would silently evaluate something other than what was asked."""
    if cfg.get("evaluate_split", "evaluate") not in SPLITS:
        raise ConfigError(f"evaluate_split must be one of {SPLITS}, got {cfg['evaluate_split']!r}.")
    if cfg.get("trace"):
        for key in ("eval_workload", "train_workload"):
            if cfg.get(key):
                raise ConfigError(
                    f"trace= evaluates an existing routing trace, so {key} (which routes a workload) would be "
                    f"ignored; drop one of them."
                )
        if cfg.get("profile_trace") and Path(cfg["profile_trace"]).resolve() == Path(cfg["trace"]).resolve():
            raise ConfigError("profile_trace is the evaluated trace itself; give a different trace or drop profile_trace.")
    elif cfg.get("profile_trace"):
        raise ConfigError("profile_trace needs trace= (the trace to evaluate); drop it or add trace=.")


def build_traces(cfg: dict, on_progress=None) -> tuple[RoutingTrace, RoutingTrace]:
    """(profile trace, evaluated trace) for this job; the evaluated part is cfg["evaluate_split"] (default evaluate).

    With trace= and profile_trace=, the profile is the other trace and `trace` is split into validate and
    evaluate only (validate_fraction / (1 - profile_fraction) of it validates, the paper's share).
    """
    check_trace_options(cfg)
    part = cfg.get("evaluate_split", "evaluate")
    if cfg.get("trace"):
        trace = read_trace(cfg["trace"])
        if cfg.get("profile_trace"):
            profile = read_trace(cfg["profile_trace"])
            if trace_digest(profile) == trace_digest(trace):
                raise ConfigError("profile_trace holds the same routing as trace; evaluating on the profile is not a result.")
            share = cfg.get("validate_fraction", 0.0) / (1.0 - cfg["profile_fraction"])
            if share == 0.0:
                return profile, trace
            rest = split_indices(trace.num_requests, share, np.random.default_rng(cfg["seed"]))
            return profile, select_requests(trace, rest.profile if part == "validate" else rest.evaluate)
        split = request_split(cfg, trace.num_requests)
        return select_requests(trace, split.profile), select_requests(trace, split.part(part))
    cache_dir = Path(cfg["cache_dir"])
    trace, split = routed_workload(cfg, cfg["workload"], cache_dir, on_progress)
    profile = select_requests(trace, split.profile)
    if cfg.get("eval_workload"):
        other, other_split = routed_workload(cfg, cfg["eval_workload"], cache_dir, on_progress)
        return profile, select_requests(other, other_split.part(part))
    return profile, select_requests(trace, split.part(part))


# ---- one job -------------------------------------------------------------------------------------------------


def unrouted_experts(*traces: RoutingTrace) -> int:
    """Expert ids below meta.num_experts that no token of these traces is routed to, in any layer."""
    from repro.affinity.tables import PROFILE_CHUNK_TOKENS
    from repro.traces.arrays import iter_row_chunks, release_pages

    num_experts = traces[0].meta.num_experts
    routed = np.zeros(num_experts, dtype=np.int64)
    for t in traces:  # in row chunks: a big memory-mapped trace is never held whole
        for start, stop in iter_row_chunks(t.num_tokens, PROFILE_CHUNK_TOKENS):
            routed += np.bincount(np.asarray(t.experts[start:stop]).ravel(), minlength=num_experts)[:num_experts]
            release_pages(t.experts)
    return int((routed == 0).sum())


def make_job(config: dict):
    """(ParallelConfig, system) of a job's config; every config error surfaces here, before any routing is made."""
    from repro.systems import make_system

    check_config(config)  # every key known, every value of its type and range (one sentence)
    check_trace_options(config)
    parallel = ParallelConfig.from_config(config["parallel"])
    system = make_system(config["system"]["name"], **(config["system"].get("params") or {}))
    lookback = getattr(system, "lookback", 0)
    if parallel.attention == "tp" and lookback > config["history"]:
        raise ConfigError(
            f"system.params.lookback={lookback} needs {lookback} layers of routing history but history="
            f"{config['history']}; set history>={lookback} or a smaller lookback."
        )
    if config.get("sim"):  # the serving simulator's config errors, before any routing
        from repro.sim import check_sim_config

        check_sim_config(config["sim"])
    if config.get("exec"):  # real multi-process execution (repro.exec): its config errors surface here too
        from repro.exec.trace_mode import check_exec_config

        exec_cfg = check_exec_config(config["exec"], parallel)
        if exec_cfg.mode == "model" and (config.get("trace") or config["model"].get("kind") != "tiny"):
            raise ConfigError(
                "exec.mode=model runs the tiny model that routes the workload (model=tiny_mixtral, no trace=); "
                "use exec.mode=trace to execute an imported trace or another routing model."
            )
    return parallel, system


def fit_and_evaluate(config: dict, profile: RoutingTrace, evaluation: RoutingTrace, progress: bool = False):
    """(summary, EvalResult, plan): fit config's system on the profile (a hindsight system or bound on
    `evaluation`) and account it exactly on `evaluation`. The one place a system meets routing."""
    from repro.eval import evaluate, time_model_from_config
    from repro.eval.decode_phase import decode_summary

    parallel, system = make_job(config)
    kind = getattr(system, "kind", "system")
    # hindsight systems and bounds are fitted on the evaluated routing itself, by definition
    fits_on_evaluation = getattr(system, "fits_on_evaluation", False)
    fit_on = evaluation if fits_on_evaluation else profile
    t0 = time.perf_counter()
    plan = system.fit(fit_on, parallel, np.random.default_rng(config["seed"]))
    fit_seconds = time.perf_counter() - t0
    # the critical-path time (dispatch + experts + combine of the busiest rank) priced by the simulator's cost model
    priced = time_model_from_config(config, plan, evaluation)
    result = evaluate(plan, evaluation, history=config["history"], progress=progress, time_model=priced)
    # decode as a phase of its own: decode LAR, balance, weights read and time per step (or one "none" sentence)
    phases = decode_summary(plan, evaluation, time_model=priced, home_NL=result.home)
    eval_seconds = time.perf_counter() - t0 - fit_seconds

    summary = dict(result.summary)
    summary.update(phases)
    summary.update(
        system=config["system"]["name"],
        kind=kind,
        bound_constraint=getattr(system, "bound_constraint", None),
        model=evaluation.meta.model,
        dataset=evaluation.meta.dataset,
        profile_dataset=profile.meta.dataset,
        evaluate_split=config.get("evaluate_split", "evaluate"),
        num_requests=evaluation.num_requests,
        fit_split=config.get("evaluate_split", "evaluate") if fits_on_evaluation else "profile",
        fit_requests=fit_on.num_requests,
        fit_seconds=fit_seconds,
        eval_seconds=eval_seconds,
        # all-to-all part of that time (the busiest rank's dispatch + combine, per link level)
        a2a_seconds_est=result.summary["time_estimate_dispatch_s"] + result.summary["time_estimate_combine_s"],
        # the offline estimate serving is compared with: prefill steps plus decode steps where the routing holds
        # generated tokens (repro.eval.decode_phase), else every token in prefill steps
        time_estimate_serving_s=phases.get("time_estimate_phases_s", result.summary["time_estimate_s"]),
    )
    if kind == "bound" and "lar_bound" in plan.info:
        # a bound reports its proven ceiling; the evaluated plan is the feasible witness below it
        summary.update(lar_achieved=summary["lar"], lar=float(plan.info["lar_bound"]))
        summary["bound_gap"] = summary["lar"] - summary["lar_achieved"]
        if "lar_bound_per_layer" in plan.info:
            result.per_layer["lar_achieved"] = result.per_layer["lar"]
            result.per_layer["lar"] = np.asarray(plan.info["lar_bound_per_layer"], dtype=float)
    return summary, result, plan


def run_job(cfg: DictConfig, out_dir: Path, replace_other: bool = False) -> dict | None:
    """One job into out_dir. replace_other=True lets it replace another config's finished results there (in code
    only: the command line refuses, see job_claim)."""
    config = OmegaConf.to_container(cfg, resolve=True)
    make_job(config)  # config errors before any (slow) routing
    with job_claim(out_dir, config, replace_other):  # one job folder, one config
        # the W&B run starts with the job, before routing and training, and is marked failed if the job raises
        with JobRun(config, out_dir) as tracking:
            return tracked_job(config, out_dir, tracking)


CLAIM = ".job-claim.json"  # the run working in a job folder: host, pid, config key (hidden: figures never read it)


def first_difference(a, b, path: str = "") -> str:
    """The dotted path of the first key whose value differs between two JSON-like configs ("" when equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            found = first_difference(a.get(key), b.get(key), f"{path}.{key}" if path else str(key))
            if found:
                return found
        return ""
    return "" if a == b else (path or "the config")


@contextmanager
def job_claim(out_dir: Path, config: dict, replace_other: bool = False) -> Iterator[None]:
    """Hold out_dir for this config while the job runs. Refused (ConfigError, before any work): a folder holding
    another config's finished results (a later run silently replaced them), and a folder another live process is
    running a job in (two concurrent runs both "succeeded", the later one's results replacing the other's). A claim
    left by a killed run of this host (its process gone) is taken over; the claim is removed when the job ends."""
    out_dir = Path(out_dir)
    metrics = out_dir / "metrics.json"
    try:
        done = json.loads(metrics.read_text()).get("config") if metrics.exists() else None
    except (OSError, ValueError, AttributeError):
        done = None  # unreadable: not a finished result of anyone's (the job replaces it)
    if done is not None and done != config and not replace_other:
        raise ConfigError(
            f"{out_dir} holds the finished results of another config (it differs in {first_difference(done, config)});"
            " choose another hydra.run.dir, or move that folder away to rerun there."
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    claim, mine = out_dir / CLAIM, {"host": socket.gethostname(), "pid": os.getpid(), "config": config_key(config)}
    for _ in range(2):  # a second try after removing a dead run's claim
        try:
            fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(claim.read_text())
            except (OSError, ValueError):
                holder = {}
            if holder.get("host") == mine["host"] and isinstance(holder.get("pid"), int) and not process_alive(holder["pid"]):
                claim.unlink(missing_ok=True)
                continue
            raise ConfigError(
                f"{out_dir} is in use by another run (pid {holder.get('pid', '?')} on {holder.get('host', '?')}); "
                "wait for it to finish, or choose another hydra.run.dir."
            ) from None
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        break
    else:
        raise ConfigError(f"{out_dir} was claimed by another run meanwhile; choose another hydra.run.dir.")
    try:
        yield
    finally:
        try:
            still_mine = json.loads(claim.read_text()).get("pid") == mine["pid"]
        except (OSError, ValueError, AttributeError):
            still_mine = False
        if still_mine:  # never another run's claim (one that took over ours, wrongly thinking us dead)
            claim.unlink(missing_ok=True)


def drift_stream(config: dict, on_progress=None) -> RoutingTrace:
    """The whole routed stream of a drift job, in arrival order (no profile / evaluate split: the drift job takes its
    profile from the stream's head): trace= as stored, else the workload routed (cached like any workload)."""
    if config.get("trace"):
        return read_trace(config["trace"])
    trace, _ = routed_workload(config, config["workload"], Path(config["cache_dir"]), on_progress)
    return trace


def tracked_drift_job(config: dict, out_dir: Path, tracking: JobRun) -> dict | None:
    """A drift job (config["drift"], repro.drift.timeline): every re-placement policy window by window."""
    from repro.drift.timeline import drift_job

    stream = drift_stream(config, on_progress=tracking.on_progress)
    digests = {"evaluated": trace_digest(stream)}
    if job_finished(out_dir, config, digests):
        log.info("%s already finished with this config and this trace; skipping", out_dir)
        return None
    tracking.start()
    summary, rows, events, serving = drift_job(config, stream)
    summary["trace_digests"] = digests
    metrics_text(summary, config)  # a non-finite metric fails before anything is written
    with staging_dir(out_dir) as staging:
        atomic_write(staging / "drift_windows.csv", lambda p: rows.to_csv(p, index=False))
        atomic_write(staging / "drift_events.csv", lambda p: events.to_csv(p, index=False))
        if len(serving):  # the serving pass's per-window series (drift.serving.enabled)
            atomic_write(staging / "drift_serving.csv", lambda p: serving.to_csv(p, index=False))
        atomic_write(staging / "config.yaml", lambda p: p.write_text(OmegaConf.to_yaml(config)))
        # W&B: every policy's scalars as <policy>.<key>, and the per-window series and events as tables
        flat = {**summary, **{f"{name}.{key}": value for name, policy in summary["policies"].items()
                              for key, value in policy.items()}}
        tables = {"drift_windows": rows, "drift_events": events, **({"drift_serving": serving} if len(serving) else {})}
        tracking.log_results(flat, tables=tables, files_dir=staging)
        publish_job(staging, out_dir, summary, config)
    log.info("%s: drift, headline %s keeps %s of the hindsight a2a gain, moves %s of EPLB's experts", out_dir,
             summary["headline_policy"], summary["gain_kept_vs_hindsight"], summary["experts_moved_vs_eplb"])
    return summary


def tracked_job(config: dict, out_dir: Path, tracking: JobRun) -> dict | None:
    """run_job's work, reported to `tracking` (which does nothing when W&B is off)."""
    if config.get("drift"):
        return tracked_drift_job(config, out_dir, tracking)
    profile, evaluation = build_traces(config, on_progress=tracking.on_progress)
    digests = {"profile": trace_digest(profile), "evaluated": trace_digest(evaluation)}
    if job_finished(out_dir, config, digests):
        log.info("%s already finished with this config and these traces; skipping", out_dir)
        return None
    tracking.start()  # a resume that is not skipped starts its run now (see repro.tracking)
    tracking.add_routing(evaluation)

    summary, result, plan = fit_and_evaluate(config, profile, evaluation, progress=True)
    summary["trace_digests"] = digests
    unrouted = unrouted_experts(profile, evaluation)
    summary["unrouted_experts"] = unrouted
    if unrouted:
        summary["warnings"] = [
            f"{unrouted} of meta.num_experts={evaluation.meta.num_experts} expert ids are never routed to in any "
            "layer; check the trace's num_experts (balance and placement count them as idle experts)."
        ]
        log.warning(summary["warnings"][0])
    # the routing's own warnings (e.g. a tiny model a time budget cut short) belong in metrics.json too
    routing_warnings = dict.fromkeys(profile.meta.extra.get("warnings", []) + evaluation.meta.extra.get("warnings", []))
    if routing_warnings:
        summary["warnings"] = summary.get("warnings", []) + list(routing_warnings)
    summary = undefined_ratios_as_null(summary)
    with staging_dir(out_dir) as staging:  # every output is written here, then published into out_dir at once
        if config.get("exec"):  # run the plan on real ranks; writes exec_per_layer.csv / exec_per_rank.csv
            from repro.exec.trace_mode import run_exec_job

            summary.update(run_exec_job(config, plan, evaluation, staging))
        sim_tables, sim_requests = {}, None
        if config.get("sim"):  # serve the plan on simulated hardware over a sweep of request rates
            from repro.sim import simulate

            sim = simulate(config, plan, evaluation, config["hardware"], config["sim"]["shape"],
                           np.random.default_rng(config["seed"]), progress=True)
            summary.update({k: v for k, v in sim.summary.items() if k != "warnings"})
            summary["warnings"] = summary.get("warnings", []) + sim.summary["warnings"]
            sim_tables, sim_requests = sim.tables, sim.requests
        metrics_text(summary, config)  # a non-finite metric fails before W&B sees it
        write_job_outputs(staging, config, profile, evaluation, result, plan, sim_tables, sim_requests)
        # W&B logs from the staging folder before anything is published: if tracking fails, nothing is
        tracking.log_results(summary, result.per_layer, sim_tables, files_dir=staging)
        publish_job(staging, out_dir, summary, config)
    log.info(
        "%s: LAR %.4f  a2a bytes %.3e  imbalance %.3f  (%s %s, D=%d, %s)",
        out_dir,
        summary["lar"],
        summary["a2a_bytes"],
        summary["expert_load_imbalance_max_mean"],
        summary["kind"],
        summary["system"],
        summary["devices"],
        config["parallel"]["attention"],
    )
    return summary


def write_job_outputs(staging: Path, config: dict, profile: RoutingTrace, evaluation: RoutingTrace, result, plan,
                      sim_tables: dict, sim_requests=None) -> None:
    """Every output of run_job but metrics.json (JOB_OUTPUTS), written into the staging folder."""
    from repro.affinity.stats import affinity_statistics

    for name, table in sim_tables.items():
        atomic_write(staging / f"{name}.csv", lambda p, t=table: t.to_csv(p, index=False))
    if sim_requests is not None:  # ~10^5 rows per serving job: Parquet, not CSV (and not a W&B table)
        atomic_write(staging / "sim_requests.parquet", lambda p: sim_requests.to_parquet(p, index=False))
    plan.save(staging / "plan")
    atomic_write(staging / "per_layer.csv", lambda p: result.per_layer.to_csv(p, index=False))
    for name, array in (("traffic", result.traffic), ("expert_load", result.expert_load), ("token_load", result.token_load)):
        atomic_write(staging / f"{name}.npy", lambda p, a=array: _save_npy(p, a))
    atomic_write(staging / "activation_map.npz", lambda p: _save_activation_map(p, evaluation))
    atomic_write(staging / "request_activations.npz", lambda p: _save_request_activations(p, evaluation))
    # the paper's Table 1 on the profile split: how predictable each token's experts are from its id alone
    affinity = affinity_statistics(profile)
    atomic_write(staging / "affinity_stats.csv", lambda p: affinity.to_csv(p, index=False))
    atomic_write(staging / "config.yaml", lambda p: p.write_text(OmegaConf.to_yaml(config)))


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


def _save_request_activations(path: Path, trace: RoutingTrace) -> None:
    """Per-request expert activations, adjacent-layer co-activation and per-token kurtosis (the paper's Fig. 6)."""
    from repro.affinity.requests import request_activations

    with open(path, "wb") as f:
        np.savez_compressed(f, **request_activations(trace))


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x)}")


def log_failure(job: str) -> None:
    """Write the exception being handled, with its traceback, into the job's log (a job that crashed after it started
    left an empty log; the traceback went to the terminal only)."""
    logging.getLogger(job).exception("%s failed", job)


def torchrun_job(config: dict, out_dir: Path) -> None:
    """This process's part of a torchrun exec job (`torchrun ... -m repro.run experiment=exec`): every rank composes
    the same config, reads or makes the same traces (rank 0 first, so the routing cache is written once; the others
    then read it) and fits the same seeded plan, runs its share, and rank 0 logs to W&B and writes the job dir
    (staged, then published with metrics.json last, as run_job does). A WORLD_SIZE other than parallel.devices is
    refused before any rank waits for another."""
    import datetime as dt
    from contextlib import nullcontext

    import torch.distributed as dist

    from repro.exec.launch import PREPARE_TIMEOUT_S, check_torchrun_world_size, init_from_env
    from repro.exec.trace_mode import ExecConfig, run_exec_job

    parallel, _ = make_job(config)
    check_torchrun_world_size(parallel.devices)
    exec_cfg = ExecConfig.from_config(config["exec"])
    rank = init_from_env(exec_cfg.backend, exec_cfg.timeout_s)
    # rank 0's W&B run starts before routing and is marked failed if this rank's job raises (repro.tracking)
    with JobRun(config, out_dir, enabled=rank == 0) as tracking, \
            staging_dir(out_dir) if rank == 0 else nullcontext(None) as staging:
        try:
            # a gloo group with a long timeout only for this wait: the exec collectives keep exec.timeout_s
            waiting = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=PREPARE_TIMEOUT_S))
            if rank != 0:
                dist.barrier(group=waiting)
            profile, evaluation = build_traces(config, on_progress=tracking.on_progress)
            if rank == 0:
                dist.barrier(group=waiting)
            summary, result, plan = fit_and_evaluate(config, profile, evaluation)
            summary.update(run_exec_job(config, plan, evaluation, staging))
        finally:
            dist.destroy_process_group()
        if rank == 0:
            tracking.add_routing(evaluation)
            atomic_write(staging / "per_layer.csv", lambda p: result.per_layer.to_csv(p, index=False))
            # before publishing, as run_job does: nothing is published if tracking fails
            tracking.log_results(summary, result.per_layer, files_dir=staging)
            publish_job(staging, out_dir, summary, config)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    torchrun = False
    if cfg.get("exec"):  # under torchrun this process is one rank of the exec job (repro.exec imports torch)
        from repro.exec.launch import in_torchrun

        torchrun = in_torchrun()
    try:
        if torchrun:
            torchrun_job(OmegaConf.to_container(cfg, resolve=True), out_dir)
        else:
            run_job(cfg, out_dir)
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        if not torchrun:  # ranks share the folder: rank 0's staging decides what stays
            remove_failed_job_dir(out_dir)
        raise SystemExit(2) from None
    except Exception:
        log_failure("repro.run")
        raise


if __name__ == "__main__":
    sys.argv = multirun_argv(sys.argv)  # a system-specific key in a sweep over systems
    main()
