"""Trace-driven exact accounting: LAR, dispatch/combine bytes per layer and device pair, load imbalance, and the
critical-path time estimate priced by the simulator's cost model (time_cost.py)."""

from repro.eval.accounting import (
    PER_LAYER_COLUMNS,
    EvalResult,
    LayerCounts,
    account,
    evaluate,
    home_devices,
    summarise,
)
from repro.eval.time_cost import TimeModel, load_shape, moe_layer_seconds, time_model, time_model_from_config

__all__ = [
    "PER_LAYER_COLUMNS",
    "EvalResult",
    "LayerCounts",
    "TimeModel",
    "account",
    "evaluate",
    "home_devices",
    "load_shape",
    "moe_layer_seconds",
    "summarise",
    "time_model",
    "time_model_from_config",
]
