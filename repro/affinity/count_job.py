"""Profile a sharded trace in parallel jobs with a Hydra launcher: one job per shard writes its partial count
table (repro.affinity.partial), and one merge sums them exactly. No scheduler of our own: the launcher fans out.

    # on this machine (Hydra's local launcher runs the jobs one after another)
    python -m repro.affinity.count_job -m trace=traces/day 'shard=range(0,24)' out_dir=parts
    # on a SLURM cluster (pip install -e ".[slurm]"): one array task per shard
    python -m repro.affinity.count_job -m trace=traces/day 'shard=range(0,24)' out_dir=parts \
        hydra/launcher=submitit_slurm hydra.launcher.timeout_min=60 hydra.launcher.cpus_per_task=2
    python -m repro.affinity.partial merge --trace traces/day --out tables.npz parts/*.npz

Relative paths are taken from the directory the command was started in (every job sees the same files, as on
a cluster's shared file system). A job's table is written atomically, so a killed job leaves nothing that merge
would take for a result; merge refuses missing, repeated or foreign parts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.utils import to_absolute_path
from omegaconf import DictConfig

from repro.affinity.partial import count_shard
from repro.config_values import FLAG, check_table, integer, text
from repro.errors import ConfigError, ReproError
from repro.jobdir import check_run_config, remove_failed_job_dir

KEYS = {"trace": text(null=True), "shard": integer(0), "out_dir": text(), "prompt_only": FLAG, "overwrite": FLAG}


def check_count_job(config: dict) -> None:
    """One ConfigError sentence for an unknown key, an ill-typed value or a missing trace (an unknown key was ignored)."""
    check_table("count_job", config, KEYS)
    if not config.get("trace"):
        raise ConfigError("count_job needs trace=<trace folder>; a sharded one is made by python -m repro.traces.shards "
                          "combine.")


class CheckCountJob(Callback):
    """Hydra callback (conf/count_job.yaml): a refused config ends before Hydra creates the job's folder."""

    def on_run_start(self, config, **kwargs) -> None:
        check_run_config(config, check_count_job)

    def on_multirun_start(self, config, **kwargs) -> None:
        check_run_config(config, check_count_job)  # the swept shard is checked by each job


def count_job(cfg: DictConfig) -> Path:
    """Write shard cfg.shard's partial table of cfg.trace to <cfg.out_dir>/<shard>.npz; returns that path."""
    check_count_job(dict(cfg))
    out_dir = Path(to_absolute_path(str(cfg.out_dir)))
    return count_shard(to_absolute_path(str(cfg.trace)), cfg.shard, out_dir / f"{cfg.shard}.npz", bool(cfg.prompt_only),
                       overwrite=bool(cfg.overwrite))


@hydra.main(version_base="1.3", config_path="../../conf", config_name="count_job")
def main(cfg: DictConfig) -> None:
    try:
        print(count_job(cfg))
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        remove_failed_job_dir(Path(HydraConfig.get().runtime.output_dir))
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
