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
from hydra.utils import to_absolute_path
from omegaconf import DictConfig

from repro.affinity.partial import count_shard
from repro.errors import ConfigError, ReproError


def count_job(cfg: DictConfig) -> Path:
    """Write shard cfg.shard's partial table of cfg.trace to <cfg.out_dir>/<shard>.npz; returns that path."""
    if not cfg.trace:
        raise ConfigError("count_job needs trace=<trace folder>; a sharded one is made by python -m repro.traces.shards combine.")
    shard = cfg.shard
    if isinstance(shard, bool) or not isinstance(shard, int):
        raise ConfigError(f"shard must be an integer shard index, got {shard!r}.")
    out_dir = Path(to_absolute_path(str(cfg.out_dir)))
    out_dir.mkdir(parents=True, exist_ok=True)
    return count_shard(to_absolute_path(str(cfg.trace)), shard, out_dir / f"{shard}.npz", bool(cfg.prompt_only),
                       overwrite=bool(cfg.overwrite))


@hydra.main(version_base="1.3", config_path="../../conf", config_name="count_job")
def main(cfg: DictConfig) -> None:
    try:
        print(count_job(cfg))
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
