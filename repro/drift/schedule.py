"""When the engines' own rebalancers re-plan, mapped onto windows of requests. Pure arithmetic, hand-checkable.

The mapping from engine steps to windows, stated once: window w stands for steps_per_window[w] engine steps
(`steps_per_window`: either a fixed number of steps per window, drift.window_steps, when each window is read as a
sample of that much traffic, or the window's own tokens / drift.step_tokens, whole steps counted in the window
where they end). Step s (1-based) falls in window w when sum(steps[:w]) < s <= sum(steps[:w + 1]).

- vLLM EPLB (`vllm/config/parallel.py` EPLBConfig): every `step_interval` steps it rearranges, on the expert load
  recorded over the last `window_size` steps. Here a rearrangement due at a step inside window w takes effect at the
  end of window w (window granularity), on the load of the last window_size steps' tokens before that boundary.
- SGLang (`eplb_rebalance_num_iterations`): the same arithmetic with the iteration count, and (PR #8345) skipped when
  the recent utilisation (mean / max per-device load) exceeds `eplb_min_rebalancing_utilization_threshold` (1.0, the
  default, never skips).

Legend: W windows.
"""

from __future__ import annotations

import numpy as np

from repro.errors import ConfigError


def steps_per_window(window_tokens: np.ndarray, step_tokens: int, window_steps: int | None = None) -> np.ndarray:
    """int64[W] engine steps each window stands for (module docstring): window_steps for every window when set, else
    each window's own tokens / step_tokens, whole steps counted where they end (no token lost between windows).

    window_tokens int[W] tokens in each window; step_tokens >= 1 tokens per engine step."""
    window_tokens = np.asarray(window_tokens, dtype=np.int64)
    if isinstance(step_tokens, bool) or int(step_tokens) < 1:
        raise ConfigError(f"drift.step_tokens must be an integer >= 1 (tokens per engine step), got {step_tokens!r}.")
    if window_steps is not None:
        if isinstance(window_steps, bool) or int(window_steps) < 1:
            raise ConfigError(f"drift.window_steps must be null or an integer >= 1, got {window_steps!r}.")
        return np.full(len(window_tokens), int(window_steps), dtype=np.int64)
    done = np.cumsum(window_tokens) // int(step_tokens)  # whole steps finished by each window's end
    return np.diff(np.concatenate([[0], done]))


def rebalances_in_window(steps_W: np.ndarray, interval: int) -> np.ndarray:
    """int64[W] how many rebalances fall inside each window when one is due every `interval` steps (steps
    interval, 2 x interval, ...); a window with a count > 0 re-plans at its end (once: later ones would see the
    same load)."""
    if int(interval) < 1:
        raise ConfigError(f"a rebalance interval must be >= 1 step, got {interval}.")
    ends = np.cumsum(np.asarray(steps_W, dtype=np.int64))
    starts = ends - np.asarray(steps_W, dtype=np.int64)
    return ends // int(interval) - starts // int(interval)


def load_window_tokens(end_token: int, window_size_steps: int, tokens_per_step: float) -> tuple[int, int]:
    """(first token, end token) of the load an EPLB re-plan at token `end_token` reads: the last window_size steps,
    i.e. round(window_size x tokens_per_step) tokens before end_token (clipped at the stream start)."""
    span = int(round(window_size_steps * tokens_per_step))
    return max(0, int(end_token) - span), int(end_token)


def utilization(device_load_LD: np.ndarray) -> float:
    """SGLang's balancedness: mean over layers of mean / max per-device load (1 = perfectly balanced)."""
    load = np.asarray(device_load_LD, dtype=np.float64)
    return float(np.mean(load.mean(axis=1) / np.maximum(load.max(axis=1), 1e-30)))
