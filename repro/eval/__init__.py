"""Trace-driven exact accounting: LAR, dispatch/combine bytes per layer and device pair, load imbalance."""

from repro.eval.accounting import (
    PER_LAYER_COLUMNS,
    EvalResult,
    LayerCounts,
    account,
    evaluate,
    home_devices,
    summarise,
)

__all__ = ["PER_LAYER_COLUMNS", "EvalResult", "LayerCounts", "account", "evaluate", "home_devices", "summarise"]
