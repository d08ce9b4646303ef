"""The `tune` config group's check (conf/tune.yaml): what repro.tune may optimise, cap and search. Kept apart from
the tuner so that repro.config_schema, which composes every group's check below the entry points, need not
import the tuner (which imports the runner, which imports the schema)."""

from __future__ import annotations

from repro.errors import ConfigError, check_known_keys

REPORTED = ("lar", "a2a_bytes", "token_imbalance_max_mean", "expert_load_imbalance_max_mean")
# serving objectives (a config with `sim`, e.g. experiment=serve_dp_arena): the simulator's mean over seeds of the
# highest rate meeting the rule, and the summary key saying whether every seed's value converged
SERVING_OBJECTIVES = {"capacity_rps": "converged_capacity", "throughput_under_ttft_slo_rps": "converged_ttft",
                      "goodput_distserve_rps": "converged_distserve"}
# the offline time estimate as throughput: tokens / time_estimate_serving_s (prefill steps plus decode steps where
# the routing has generated tokens, repro.eval.decode_phase), so a decode slowdown counts
OFFLINE_SPEED = "offline_tokens_per_s"
OBJECTIVES = ("lar", OFFLINE_SPEED, *SERVING_OBJECTIVES)  # maximised: higher is better
CAPPED = ("a2a_bytes", "token_imbalance_max_mean", "expert_load_imbalance_max_mean")  # constraints: metric <= cap
ATTENTION_MODES = ("dp", "tp")


def check_tune_config(tune: dict) -> None:
    """One ConfigError sentence for a tune config that cannot give a result, before any candidate is fitted:
    an objective that is not maximised, a constraint on a metric the candidates do not report or with a cap
    that is not a number, an attention mode without a grid, or a parameter with no values to try."""
    check_known_keys("tune", tune, ("objective", "constraints", "space"))
    if tune.get("objective") not in OBJECTIVES:
        raise ConfigError(f"tune.objective must be one of {list(OBJECTIVES)} (maximised), got {tune.get('objective')!r}.")
    constraints = tune.get("constraints") or {}
    if not isinstance(constraints, dict):
        raise ConfigError(f"tune.constraints must map metrics to caps, got {constraints!r}.")
    for metric, cap in constraints.items():
        if metric not in CAPPED:
            raise ConfigError(f"tune.constraints.{metric} is not a metric a cap applies to; choose from {list(CAPPED)}.")
        if isinstance(cap, bool) or not isinstance(cap, int | float) or not 0 < cap < float("inf"):
            raise ConfigError(f"tune.constraints.{metric} must be a number > 0, got {cap!r}.")
    space = tune.get("space")
    if not isinstance(space, dict) or not space:
        raise ConfigError(f"tune.space must map attention modes {list(ATTENTION_MODES)} to grids, got {space!r}.")
    for mode, params in space.items():
        if mode not in ATTENTION_MODES:
            raise ConfigError(f"tune.space.{mode} is not an attention mode; use {list(ATTENTION_MODES)}.")
        if not isinstance(params, dict) or not params:
            raise ConfigError(f"tune.space.{mode} must map parameter paths to lists of values, got {params!r}.")
        for path, values in params.items():
            if not isinstance(values, list) or not values:
                raise ConfigError(f"tune.space.{mode}.{path} must be a non-empty list of values to try, got {values!r}.")
