"""`python -m repro.tune`: choose a system's tunable defaults on the validate split, then report them on evaluate.

    python -m repro.tune -m                                   # conf/tune.yaml: Sem-MoE at EP 2/4/8, DP and TP
    python -m repro.tune model=replay_olmoe parallel.devices=4 parallel.attention=tp

One job = one deployment shape (model, workload, EP degree, attention mode):
1. Every candidate of the grid `tune.space[<attention mode>]` (parameter path -> values) is fitted on the profile
   split and accounted on the validate split; with a serving objective (capacity_rps,
   throughput_under_ttft_slo_rps, goodput_distserve_rps: a config with `sim`, e.g. experiment=serve_dp_arena) it
   is also served there by the simulator, and a candidate whose objective did not converge on every seed is
   infeasible. A candidate is feasible when it meets every cap of
   `tune.constraints` (e.g. token_imbalance_max_mean <= 1.3), or is at least no worse there than the current
   defaults; the chosen one maximises `tune.objective` among the feasible (ties: the earlier in grid order,
   which starts at the current defaults).
2. The chosen candidate and the current defaults are then fitted on the profile again and accounted on the
   evaluate split: the evaluate split is touched exactly once per reported number (two numbers per job).

Writes into the job dir: candidates.csv (every candidate's validate metrics) and tuned.json (chosen values, the
defaults, and both on validate and evaluate side by side; written last, so its presence means the job
finished). Defaults in conf/system/*.yaml quote the validate numbers of these files, never evaluate ones.
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
from pathlib import Path

import hydra
import pandas as pd
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from repro.atomic import atomic_write
from repro.config_schema import check_config
from repro.errors import ConfigError, ReproError
from repro.run import build_traces, fit_and_evaluate, log_failure, make_job, remove_failed_job_dir
from repro.tune_config import OFFLINE_SPEED, REPORTED, SERVING_OBJECTIVES

log = logging.getLogger("repro.tune")

def grid(space: dict) -> list[dict]:
    """Every combination of `space` (parameter path -> list of values), first values first."""
    keys = list(space)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*(space[k] for k in keys))]


def with_values(config: dict, values: dict) -> dict:
    """A copy of config with dotted parameter paths (e.g. system.params.theta) set to values."""
    out = OmegaConf.create(config)
    for path, value in values.items():
        OmegaConf.update(out, path, value, merge=False)
    return OmegaConf.to_container(out)


def current_values(config: dict, paths) -> dict:
    """The config's values at dotted parameter paths; a path that names no parameter is a ConfigError."""
    cfg, missing = OmegaConf.create(config), object()
    values = {path: OmegaConf.select(cfg, path, default=missing) for path in paths}
    unknown = [path for path, value in values.items() if value is missing]
    if unknown:
        raise ConfigError(f"tune.space keys {unknown} do not name config parameters; check conf/tune.yaml.")
    return {path: OmegaConf.to_object(v) if OmegaConf.is_config(v) else v for path, v in values.items()}


def feasible(summary: dict, constraints: dict, reference: dict | None = None) -> bool:
    """Every constrained metric within its cap, or at worst the defaults' own value where they exceed the cap
    (round-robin DP at EP 8 is already past a 1.3 token cap: a candidate may not be worse than the defaults)."""
    return all(summary[m] <= max(cap, (reference or {}).get(m, cap)) for m, cap in constraints.items())


def score(config: dict, profile, trace) -> dict:
    """The metrics tune compares: REPORTED from the exact accounting, plus the serving objective and whether it
    converged when config's objective is a serving one (the plan served by the simulator on `trace`)."""
    summary, _, plan = fit_and_evaluate(config, profile, trace)
    row = {m: summary[m] for m in REPORTED}
    row[OFFLINE_SPEED] = summary["num_tokens"] / summary["time_estimate_serving_s"]
    objective = config["tune"]["objective"]
    if objective in SERVING_OBJECTIVES:
        import numpy as np

        from repro.sim import simulate

        served = simulate(config, plan, trace, config["hardware"], config["sim"]["shape"],
                          np.random.default_rng(config["seed"])).summary
        row.update({objective: served[objective], SERVING_OBJECTIVES[objective]: bool(served[SERVING_OBJECTIVES[objective]])})
    return row


def tune_job(config: dict, out_dir: Path) -> dict:
    check_config(config)  # every config error (tune included) before the first (slow) fit
    tune = config["tune"]
    mode = config["parallel"]["attention"]
    space = (tune.get("space") or {}).get(mode)
    if not space:
        raise ConfigError(f"tune.space has no grid for attention mode {mode!r}; add tune.space.{mode}.")
    if tune["objective"] in SERVING_OBJECTIVES and not config.get("sim"):
        raise ConfigError(f"tune.objective={tune['objective']} is measured in serving: add sim=default or a serving "
                          "experiment (e.g. experiment=serve_dp_arena).")
    defaults = current_values(config, space)
    candidates = grid(space)
    if defaults not in candidates:
        candidates.insert(0, defaults)
    for candidate in candidates:
        make_job(with_values(config, candidate))  # every config error before the first (slow) fit

    validate_cfg = dict(config, evaluate_split="validate")
    profile, validate = build_traces(validate_cfg)
    rows = []
    for candidate in candidates:  # the defaults first
        rows.append({**candidate, **score(with_values(validate_cfg, candidate), profile, validate)})
        log.info("validate %s: %s %.4f", candidate, tune["objective"], rows[-1][tune["objective"]])
    reference = rows[candidates.index(defaults)]
    converged = SERVING_OBJECTIVES.get(tune["objective"])
    for row in rows:
        row["feasible"] = feasible(row, tune["constraints"], reference) and (converged is None or row[converged])
    table = pd.DataFrame(rows)
    ok = table[table["feasible"]]
    if ok.empty:
        raise ConfigError(
            f"no candidate meets tune.constraints {tune['constraints']} on the validate split; relax them or widen tune.space."
        )
    best = int(ok[tune["objective"]].idxmax())  # first maximum = earliest in grid order
    chosen = candidates[best]

    evaluate_cfg = dict(config, evaluate_split="evaluate")
    profile, evaluation = build_traces(evaluate_cfg)
    scores = {}
    reported = [m for m in table.columns if m in REPORTED or m in SERVING_OBJECTIVES or m in (converged, OFFLINE_SPEED)]
    for label, values in (("default", defaults), ("chosen", chosen)):
        evaluated = score(with_values(evaluate_cfg, values), profile, evaluation)
        scores[label] = {
            "values": values,
            "validate": {m: rows[candidates.index(values)][m] for m in reported},
            "evaluate": {m: evaluated[m] for m in reported},
            "feasible_on_validate": bool(rows[candidates.index(values)]["feasible"]),
        }
    result = {
        "system": config["system"]["name"],
        "model": config["model"]["name"],
        "workload": config["workload"]["name"],
        "devices": config["parallel"]["devices"],
        "attention": mode,
        "objective": tune["objective"],
        "constraints": tune["constraints"],
        "num_candidates": len(candidates),
        **scores,
        "config": config,
    }
    atomic_write(out_dir / "candidates.csv", lambda p: table.to_csv(p, index=False))
    atomic_write(out_dir / "tuned.json", lambda p: p.write_text(json.dumps(result, indent=1, default=str)))
    log.info(
        "%s: chosen %s (validate %.4f, evaluate %.4f); default %s (validate %.4f, evaluate %.4f)",
        out_dir, chosen, scores["chosen"]["validate"][tune["objective"]], scores["chosen"]["evaluate"][tune["objective"]],
        defaults, scores["default"]["validate"][tune["objective"]], scores["default"]["evaluate"][tune["objective"]],
    )
    return result


@hydra.main(version_base="1.3", config_path="../conf", config_name="tune")
def main(cfg: DictConfig) -> None:
    try:
        config = OmegaConf.to_container(cfg, resolve=True)
        out_dir = Path(HydraConfig.get().runtime.output_dir)
        done = out_dir / "tuned.json"
        if done.exists() and json.loads(done.read_text()).get("config") == config:
            log.info("%s already tuned with this config; skipping", out_dir)
            return
        tune_job(config, out_dir)
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        remove_failed_job_dir(Path(HydraConfig.get().runtime.output_dir))
        raise SystemExit(2) from None
    except Exception:
        log_failure("repro.tune")
        raise


if __name__ == "__main__":
    main()
