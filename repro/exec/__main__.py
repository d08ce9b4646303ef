"""`python -m repro.exec`: fit a plan and execute it on real ranks (repro.exec.trace_mode), as one Hydra job.

    python -m repro.exec experiment=exec logger=none                          # spawns parallel.devices ranks here
    torchrun --nproc-per-node 4 -m repro.exec experiment=exec logger=none      # this process is one rank
    srun --ntasks 8 ... torchrun --nnodes 2 --nproc-per-node 4 ... -m repro.exec experiment=exec exec.backend=nccl

Standalone, it is exactly `python -m repro.run` (whose exec hook spawns the ranks). Under torchrun (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), every rank composes the same config, reads or makes the same traces
(rank 0 first, so the routing cache is written once; the others then read it) and fits the same seeded plan,
runs its share, and rank 0 logs to W&B (repro.tracking, from the start) and writes the job dir (staged, then
published with metrics.json last, as repro.run does): metrics.json (evaluator summary + exec_* keys, and the config),
per_layer.csv, exec_per_layer.csv and exec_per_rank.csv. A WORLD_SIZE other than parallel.devices is refused
before any rank waits for another.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import repro.jobdir  # noqa: F401  registers the job_dirname resolver that conf/config.yaml's run dirs use
from repro.atomic import atomic_write
from repro.errors import ConfigError, ReproError
from repro.exec.launch import in_torchrun, init_from_env

PREPARE_TIMEOUT_S = 3600  # rank 0 may train a routing model before the others read its cached trace


def check_torchrun_world_size(parallel) -> None:
    """One ConfigError sentence, before any rendezvous or collective, unless torchrun started parallel.devices
    ranks (a mismatch would otherwise leave the ranks waiting on each other)."""
    world_size = os.environ["WORLD_SIZE"]
    if not world_size.isdigit() or int(world_size) != parallel.devices:
        raise ConfigError(
            f"torchrun started WORLD_SIZE={world_size} ranks but the plan places experts on parallel.devices="
            f"{parallel.devices} devices; start {parallel.devices} ranks (--nproc-per-node x --nnodes) or set "
            f"parallel.devices={world_size}."
        )


def torchrun_job(config: dict, out_dir: Path) -> None:
    """This process's part of a torchrun exec job; only rank 0 writes (staged, then published as repro.run does)."""
    from repro.exec.trace_mode import ExecConfig, run_exec_job

    # layer: `python -m repro.exec` is an entry point beside repro.run (the layer above the executor), so it uses
    # the runner's job steps; it is the only file of repro/exec that imports upward, and only at call time
    from repro.run import build_traces, fit_and_evaluate, make_job, publish_job, staging_dir
    from repro.tracking import JobRun

    parallel, _ = make_job(config)
    check_torchrun_world_size(parallel)
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


@hydra.main(version_base="1.3", config_path="../../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    # layer: standalone this entry point is `python -m repro.run` (see torchrun_job), and it reports failures as the
    # runner does; removing this import means retiring `python -m repro.exec` for `python -m repro.run`
    from repro.run import log_failure, remove_failed_job_dir, run_job

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        if not cfg.get("exec"):
            raise ConfigError("python -m repro.exec needs an exec config; add experiment=exec or +exec=default.")
        if in_torchrun():
            torchrun_job(OmegaConf.to_container(cfg, resolve=True), out_dir)
        else:
            run_job(cfg, out_dir)
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        if not in_torchrun():  # ranks share the folder: rank 0's staging decides what stays
            remove_failed_job_dir(out_dir)
        raise SystemExit(2) from None
    except Exception:
        log_failure("repro.exec")
        raise


if __name__ == "__main__":
    main()
