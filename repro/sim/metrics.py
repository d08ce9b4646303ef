"""Serving metrics of simulated runs: steady-state window, queue stability, latency percentiles, throughput,
MoE-layer breakdown (prefill-containing and decode-only iterations apart), SLO rules, rate bisection, ratios.

Per request: TTFT = first token - arrival; E2E = finish - arrival; TPOT = (finish - first token) / (output - 1)
(undefined, NaN, for one-token outputs, which then meet any TPOT SLO). A request unfinished when a run stops at its
horizon has infinite latencies: it misses every SLO; the latency statistics are over finished requests and the row
counts the unfinished ones.

Steady state. A run's measurement window [t0, t1] excludes the warm-up (before t0) and the drain (after t1, when
arrivals have stopped or are about to). Latency statistics cover the requests arriving in the window; throughput is
the requests (tokens) *completing* in the window over its length. The window is cut into batches (`steady_state`):
the queue is `stable` when the trend of the number of requests in the system (arrived, unfinished), a least-squares
slope through its batch means, lies with 95 % confidence at or below `tolerance` x the offered rate per second,
`unstable` when it lies above, `undecided` when the interval straddles it (the simulator then lengthens the run).
Batch means make the decision robust to heavy tails: one long prompt moves one batch, not the verdict, and a
stable queue's count, however bursty, has no trend over the whole window. A run is `converged` when it is
decidedly unstable, or stable with the batch-means 95 % half-widths of its mean TTFT and mean E2E within
`rel_halfwidth` (2 %) of their values (a stable queue's throughput is the offered rate; see `steady_state`). The waiting queue (arrived, no first token yet), where an overload piles
up once the running set is full, and completions / arrivals in the window are reported beside it.

SLO rules (thresholds fixed before any bisection, the same for every system compared; see repro/sim/simulate.py):
  paper      a latency statistic (mean by default) of the window's requests within multiplier (5) x that statistic
             of the reference system at the lightest load (Sem-MoE's rule, after Wu et al. 2024);
  distserve  >= `attainment` (90 %) of the window's requests meet both the TTFT and the TPOT SLO (DistServe).
A rate meets a rule only with a stable queue (when required) and no unfinished window request: an unstable queue
has no steady-state latency, its latencies grow with the length of the run. "Throughput under an SLO" is then found
by `bisect_rate` to a stated relative tolerance, and ratios between systems by `ratio_interval` over paired seeds.

Legend: R requests, L MoE layers, C cost components (repro.sim.costs.COMPONENTS), S seeds, T time samples.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

from repro.errors import ConfigError
from repro.sim.costs import COMPONENTS
from repro.sim.engine import RunResult

STATISTICS = ("mean", "p50", "p90", "p99")
LATENCIES = ("ttft", "tpot", "e2e")
PHASES = ("prefill", "decode")  # iterations holding prefill tokens; decode-only iterations
LAYER_COMPONENTS = ("gate", "dispatch", "experts", "combine")  # the paper's MoE-layer split (Fig. 1)
QUEUE_SAMPLES = 64  # points of the in-system count fitted for the queue trend


def request_latencies(run: RunResult, output_len: np.ndarray) -> dict[str, np.ndarray]:
    """{"ttft", "tpot", "e2e"}: float64[R] seconds; +inf where the run stopped first; tpot NaN where output_len == 1."""
    first = np.where(np.isnan(run.first_token), np.inf, run.first_token)
    finish = np.where(np.isnan(run.finish), np.inf, run.finish)
    decode_steps = (output_len - 1).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(np.isfinite(finish), (finish - first) / decode_steps, np.inf)
    tpot = np.where(decode_steps > 0, tpot, np.nan)
    return {"ttft": first - run.arrival, "tpot": tpot, "e2e": finish - run.arrival}


def overlaps_changes(run: RunResult) -> np.ndarray:
    """bool[R]: requests whose life (arrival to finish; unfinished: to the end) overlaps a plan change's migration
    (RunResult.changes: [start_s, end_s), a stall or an async migration)."""
    finish = np.where(np.isnan(run.finish), np.inf, run.finish)
    out = np.zeros(len(run.arrival), dtype=bool)
    for change in run.changes or ():
        out |= (run.arrival < change["end_s"]) & (finish > change["start_s"])
    return out


def latency_around_changes(run: RunResult, output_len: np.ndarray, stat: str = "p99") -> dict:
    """{"<latency>_<stat>_s_during" | "_outside": seconds}: TTFT, TPOT and E2E of the requests a migration overlaps
    (`overlaps_changes`) and of the others, and how many of each (what a placement change does to serving)."""
    latencies = request_latencies(run, np.asarray(output_len)[: len(run.arrival)])
    during = overlaps_changes(run)
    out = {"requests_during": int(during.sum()), "requests_outside": int((~during).sum())}
    for name in LATENCIES:
        out[f"{name}_{stat}_s_during"] = statistic(latencies[name][during], stat)
        out[f"{name}_{stat}_s_outside"] = statistic(latencies[name][~during], stat)
    return out


def statistic(values: np.ndarray, name: str) -> float:
    """mean or p50 / p90 / p99 over the finite values (NaN when there are none)."""
    values = values[np.isfinite(values)]
    if not len(values):
        return float("nan")
    if name == "mean":
        return float(values.mean())
    return float(np.percentile(values, int(name[1:])))


def window_requests(arrival: np.ndarray, window: tuple[float, float]) -> np.ndarray:
    """bool[R]: requests arriving in the window [t0, t1] (both ends included)."""
    return (arrival >= window[0]) & (arrival <= window[1])


def queue_trend(arrival: np.ndarray, leave: np.ndarray, window: tuple[float, float],
                samples: int = QUEUE_SAMPLES) -> tuple[float, float]:
    """(slope in requests/s, mean) of the number of requests arrived and not yet left (leave float64[R]: the time
    a request leaves the queue measured, NaN = never) at `samples` evenly spaced times of the window: a
    least-squares line through them."""
    times_T = np.linspace(window[0], window[1], samples)
    left = np.sort(leave[np.isfinite(leave)])
    count_T = (np.searchsorted(np.sort(arrival), times_T, side="right")
               - np.searchsorted(left, times_T, side="right")).astype(np.float64)
    if window[1] <= window[0]:
        return 0.0, float(count_T.mean())
    slope = np.polyfit(times_T - times_T.mean(), count_T, 1)[0]
    return float(slope), float(count_T.mean())


def batch_interval(values_B: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """(mean, half-width) of batch means values_B float[B]: the Student-t interval at `confidence` over the B
    batches (B - 1 dof). A non-finite batch or fewer than 2 batches gives an infinite half-width."""
    values_B = np.asarray(values_B, dtype=np.float64)
    if len(values_B) < 2 or not np.all(np.isfinite(values_B)):
        return (float(values_B.mean()) if len(values_B) else float("nan")), float("inf")
    half = scipy_stats.t.ppf(0.5 + confidence / 2, len(values_B) - 1) * values_B.std(ddof=1) / np.sqrt(len(values_B))
    return float(values_B.mean()), float(half)


def trend_interval(times_B: np.ndarray, values_B: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """(slope, half-width) of the least-squares line through batch means values_B float[B] at times_B float[B]:
    the Student-t interval of the slope (B - 2 dof). Fewer than 3 batches give an infinite half-width."""
    times_B, values_B = np.asarray(times_B, np.float64), np.asarray(values_B, np.float64)
    centred = times_B - times_B.mean()
    spread = float((centred**2).sum())
    if len(values_B) < 3 or spread <= 0:
        return 0.0, float("inf")
    slope = float((centred * (values_B - values_B.mean())).sum() / spread)
    residual = values_B - values_B.mean() - slope * centred
    se = np.sqrt((residual**2).sum() / (len(values_B) - 2) / spread)
    return slope, float(scipy_stats.t.ppf(0.5 + confidence / 2, len(values_B) - 2) * se)


def steady_state(arrival: np.ndarray, first_token: np.ndarray, finish: np.ndarray, rate: float,
                 window: tuple[float, float], tolerance: float, batches: int = 16, rel_halfwidth: float = 0.02,
                 confidence: float = 0.95) -> dict:
    """The window cut into `batches` equal batches, and what the whole window says about the run (batch means,
    so that a heavy-tailed request only moves the batch it falls in):

    - stability: the trend of the number of requests in the system (arrived, unfinished), a least-squares slope
      through its batch means with a `confidence` interval. "unstable" when the whole interval lies above
      `tolerance` x rate (requests pile up faster than that), "stable" when it lies at or below it, "undecided"
      otherwise (a longer window is needed); `stable_point` is the slope's point estimate against the tolerance.
    - throughput (completions per second of each batch) and the mean TTFT and E2E of the requests arriving in each
      batch: the means over batches and their interval half-widths (infinite while a window request is unfinished).
    - converged: "unstable" (no steady state, and the decision is settled), or "stable" with the mean TTFT's and
      mean E2E's half-widths within `rel_halfwidth` of their means. A stable queue's long-run throughput is the
      offered rate, and the verdict "stable" already bounds it (completions keep up with arrivals to within
      `tolerance`, with 95 % confidence); the window's own completion count adds only the arrivals' Poisson noise
      (+/- 2 % takes ~10,000 completions, 100 s at 100 req/s), so its half-width is reported, not required.

    arrival, first_token, finish: float64[R] seconds (NaN: not yet).
    """
    edges = np.linspace(window[0], window[1], batches + 1)
    length = (window[1] - window[0]) / batches
    samples = np.linspace(window[0], window[1], batches * 8 + 1)[:-1] + (window[1] - window[0]) / (batches * 16)
    left = np.sort(finish[np.isfinite(finish)])
    count = (np.searchsorted(np.sort(arrival), samples, side="right")
             - np.searchsorted(left, samples, side="right")).astype(np.float64)
    count_B = count.reshape(batches, 8).mean(axis=1)
    mids_B = (edges[:-1] + edges[1:]) / 2
    slope, slope_half = trend_interval(mids_B, count_B, confidence)
    allowed = tolerance * rate
    decision = ("unstable" if slope - slope_half > allowed else "stable" if slope + slope_half <= allowed
                else "undecided")
    done_B = np.histogram(finish[np.isfinite(finish)], bins=edges)[0]
    throughput, throughput_half = batch_interval(done_B / length, confidence)
    batch_of = batch_of_arrival(arrival, window, batches)
    inside = batch_of >= 0
    row = {"stability": decision, "stable_point": bool(slope <= allowed), "in_system_trend_rps": slope,
           "in_system_trend_halfwidth_rps": slope_half, "window_batches": int(batches),
           "throughput_batch_rps": throughput, "throughput_halfwidth_rps": throughput_half}
    for name, end in (("ttft", first_token), ("e2e", finish)):
        latency = np.where(np.isfinite(end), end - arrival, np.inf)[inside]
        total_B = np.bincount(batch_of[inside], weights=np.where(np.isfinite(latency), latency, 0.0),
                              minlength=batches)
        n_B = np.bincount(batch_of[inside], minlength=batches)
        late_B = np.bincount(batch_of[inside], weights=~np.isfinite(latency), minlength=batches)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_B = np.where(late_B > 0, np.inf, total_B / n_B)
        mean, half = batch_interval(mean_B[n_B > 0], confidence)
        row[f"{name}_batch_mean_s"], row[f"{name}_halfwidth_s"] = mean, half
    row["converged"] = bool(decision == "unstable" or (
        decision == "stable" and row["ttft_halfwidth_s"] <= rel_halfwidth * row["ttft_batch_mean_s"]
        and row["e2e_halfwidth_s"] <= rel_halfwidth * row["e2e_batch_mean_s"]))
    return row


def run_until_converged(run: Callable[[int], dict], requests: int, cap: int,
                        enough: Callable[[dict], bool] | None = None) -> tuple[dict, int]:
    """(row, extensions): run(n) -> a row of `steady_state`'s keys, for n = requests, 2 x requests, ... until
    enough(row) (default: the row has converged) or n reaches `cap` (the last n is the cap itself); the row of the
    last run, and how many times the run was lengthened. An "unstable" verdict must hold on two runs in a row (n / 2 and n): under heavy-tailed
    service one huge job's backlog, draining slowly, looks like a trend in a window a few times its drain time
    long; a real overload keeps growing in the window twice as long, an excursion is diluted in it. A row that
    reached the cap unconverged keeps converged False; stability_settled says whether its stability verdict was
    (a queue near its capacity can settle that long before its latencies converge)."""
    extensions, previous = 0, None
    while True:
        row = run(requests)
        confirmed = row["stability"] != "unstable" or (previous is not None and previous["stability"] == "unstable")
        row["converged"] = bool(row["converged"] and confirmed)
        row["stability_settled"] = bool(confirmed and row["stability"] != "undecided")
        if (enough(row) if enough is not None else row["converged"]) or requests >= cap:
            return row, extensions
        previous, requests, extensions = row, min(2 * requests, cap), extensions + 1


def batch_of_arrival(arrival: np.ndarray, window: tuple[float, float], batches: int) -> np.ndarray:
    """int64[R]: the window batch each request arrived in (-1 outside the window), as `steady_state` cuts it."""
    edges = np.linspace(window[0], window[1], batches + 1)
    batch = np.minimum(np.searchsorted(edges, arrival, side="right") - 1, batches - 1)
    return np.where((arrival >= window[0]) & (arrival <= window[1]), batch, -1)


def decided(mean: float, halfwidth: float, threshold: float, rel_halfwidth: float) -> bool:
    """Whether a comparison of an estimate with a threshold is settled: its interval lies on one side of the
    threshold, or it is within `rel_halfwidth` of its value (then the comparison is as precise as asked)."""
    return bool(abs(mean - threshold) > halfwidth or halfwidth <= rel_halfwidth * abs(mean))


def span_to_settle(row: dict, rule: str, thresholds: dict, tolerance: float, rel_halfwidth: float) -> float:
    """Seconds of arrivals at which a run would settle `rule` (capacity, ttft, e2e, distserve) if its estimates
    stayed where they are and every half-width shrank as 1 / sqrt(arrivals span) (batch means of a stationary run):
    an extrapolation that sizes sim.max_duration_s, not a measurement. The run's own span when it already settled
    the rule; inf when the queue's trend sits exactly on tolerance x rate.

    row: a probe row (`rate_row` and the rule flags: stability, stability_settled, stable_point, in_system_trend_rps
    and its half-width, <name>_batch_mean_s and <name>_halfwidth_s, attainment and its half-width, settled_<rule>,
    arrivals_span_s); thresholds: {"ttft", "e2e": SLO seconds of the mean statistic, "attainment": DistServe's
    share}; without "ttft" / "e2e" (an SLO on another statistic, which settles only on a converged run) the run
    must converge: both latency half-widths within rel_halfwidth of their means. tolerance: sim.stable_tolerance.

    Why: near a knee the latency rises by a large factor within one bisection step, so a deciding run's estimate can
    sit next to its SLO; the factor by which its half-width must shrink is what a longer cap buys (a run whose
    estimate is 10 % from its SLO with a 35 % half-width needs ~12x the arrivals)."""
    span = float(row["arrivals_span_s"])
    if row[f"settled_{rule}"]:
        return span

    def factor(estimate: float, halfwidth: float, threshold: float | None, relative: bool) -> float:
        """(halfwidth / the distance it must shrink to)^2; threshold None: only the relative precision counts."""
        gap = abs(estimate - threshold) if threshold is not None else 0.0
        if relative:  # `decided` also settles a comparison measured to within rel_halfwidth of its value
            gap = max(gap, rel_halfwidth * abs(estimate))
        return (halfwidth / gap) ** 2 if gap > 0 else float("inf")

    needed = 1.0
    if not row["stability_settled"]:
        needed = factor(row["in_system_trend_rps"], row["in_system_trend_halfwidth_rps"], tolerance * row["rate"], False)
        if row["stability"] == "unstable":  # an unstable verdict holds only on two runs in a row (run_until_converged)
            needed = max(needed, 2.0)
    if rule == "distserve" and row["stable_point"]:  # an overloaded queue fails every SLO; else the latency decides
        needed = max(needed, factor(row["attainment"], row["attainment_halfwidth"], thresholds["attainment"], True))
    elif rule in thresholds and row["stable_point"]:
        needed = max(needed, factor(row[f"{rule}_batch_mean_s"], row[f"{rule}_halfwidth_s"], thresholds[rule], True))
    elif rule != "capacity" and row["stable_point"]:  # converged: a half-width within rel_halfwidth of its mean
        needed = max([needed] + [factor(row[f"{name}_batch_mean_s"], row[f"{name}_halfwidth_s"], None, True)
                                 for name in ("ttft", "e2e")])
    return span * max(needed, 1.0)


def share_interval(ok_R: np.ndarray, batch_R: np.ndarray, batches: int, confidence: float = 0.95) -> tuple[float, float]:
    """(share, half-width): the share of requests with ok_R bool[R] and its batch-means interval over the batches
    batch_R int[R] they arrived in (batches without a request left out)."""
    counts = np.bincount(batch_R, minlength=batches)
    hits = np.bincount(batch_R, weights=ok_R.astype(np.float64), minlength=batches)
    share = float(ok_R.mean()) if len(ok_R) else float("nan")
    return share, batch_interval(hits[counts > 0] / counts[counts > 0], confidence)[1]


def phase_breakdown(run: RunResult) -> dict:
    """Per phase (prefill-containing / decode-only iterations of the window): mean seconds per iteration of every
    MoE-layer component (mean over layers), the all-to-all share, the MoE layer's total, iterations, mean tokens
    per iteration and mean iteration seconds. Empty phases give NaN (no iteration to average)."""
    row: dict = {}
    empty = run.window_iterations is None
    for p, phase in enumerate(PHASES):
        count = 0 if empty else int(run.window_iterations[p])
        mean_C = run.window_moe_seconds[p].mean(axis=0) / count if count else np.full(len(COMPONENTS), np.nan)
        for c, name in enumerate(COMPONENTS):
            row[f"moe_{name}_{phase}_s"] = float(mean_C[c])
        parts = dict(zip(COMPONENTS, mean_C, strict=True))
        row[f"moe_layer_{phase}_s"] = float(sum(parts[c] for c in LAYER_COMPONENTS))
        row[f"a2a_share_{phase}"] = a2a_share(mean_C) if count else float("nan")
        row[f"{phase}_iterations_window"] = count
        row[f"tokens_per_{phase}_iteration"] = float(run.window_tokens[p]) / count if count else float("nan")
        row[f"{phase}_iteration_s"] = float(run.window_seconds[p]) / count if count else float("nan")
    # with mixed batching most tokens of a "prefill" iteration can be decode tokens: say how many are prompt tokens
    tokens = 0 if empty else int(run.window_tokens[0])
    row["prefill_token_share"] = run.window_prefill_tokens / tokens if tokens else float("nan")
    return row


def rate_row(rate: float, run: RunResult, prompt_len: np.ndarray, output_len: np.ndarray,
             window: tuple[float, float] | None = None, tolerance: float = 0.05, batches: int = 16,
             rel_halfwidth: float = 0.02) -> dict:
    """One row of the per-rate table for the run's first len(run.arrival) requests (prompt_len / output_len of
    at least that length): steady-state window throughput and queue stability, latency statistics of the window's
    requests, the MoE-layer breakdown (whole run, and per phase over the window), LAR, engine counters.

    window None: the whole run, [first arrival, last finish] (throughput = requests / makespan, a burst measure,
    as a real benchmark client reports it). `stable` is `steady_state`'s decision, or its point estimate where the
    window could not decide (`stability` says which; `converged` whether the run's estimates have converged).
    """
    n = len(run.arrival)
    prompt_len, output_len = prompt_len[:n], output_len[:n]
    latency = request_latencies(run, output_len)
    makespan = float(np.nanmax(run.finish) - run.arrival.min()) if np.isfinite(run.finish).any() else float("nan")
    if window is None:
        window = (float(run.arrival.min()), float(np.nanmax(run.finish)))
    length = window[1] - window[0]
    inside = window_requests(run.arrival, window)
    done = (run.finish >= window[0]) & (run.finish <= window[1])  # NaN compares False
    waiting_slope, waiting = queue_trend(run.arrival, run.first_token, window)
    system_slope, in_system = queue_trend(run.arrival, run.finish, window)
    arrival_rate = inside.sum() / length
    throughput = done.sum() / length
    row: dict = {
        "rate": float(rate),
        "num_requests": int(inside.sum()),
        "requests_total": n,
        "window_start_s": float(window[0]),
        "window_end_s": float(window[1]),
        "makespan_s": makespan,
        "throughput_rps": float(throughput),
        "output_tok_s": float(output_len[done].sum() / length),
        "total_tok_s": float((output_len[done] + prompt_len[done]).sum() / length),
        "arrival_rate_window_rps": float(arrival_rate),
        "completion_to_arrival": float(throughput / arrival_rate) if arrival_rate > 0 else float("nan"),
        "queue_slope_rps": waiting_slope,
        "waiting_mean": waiting,
        "in_system_slope_rps": system_slope,
        "in_system_mean": in_system,
        "unfinished": int((inside & ~np.isfinite(run.finish)).sum()),
    }
    row.update(steady_state(run.arrival, run.first_token, run.finish, rate, window, tolerance, batches,
                            rel_halfwidth))
    row["stable"] = row["stability"] == "stable" or (row["stability"] == "undecided" and row["stable_point"])
    for name in LATENCIES:
        for stat in STATISTICS:
            row[f"{name}_{stat}_s"] = statistic(latency[name][inside], stat)
    per_iteration = run.moe_seconds / max(run.iterations, 1)  # [L, C] mean over all iterations of the run
    mean_layer = per_iteration.mean(axis=0)
    for c, name in enumerate(COMPONENTS):
        row[f"moe_{name}_s"] = float(mean_layer[c])
    row["a2a_share"] = a2a_share(mean_layer)
    row.update(phase_breakdown(run))
    row.update(
        lar=run.local_activations / max(run.total_activations, 1),
        remote_token_copies=run.remote_copies,
        iterations=run.iterations,
        prefill_iterations=run.prefill_iterations,
        blocks=run.blocks,
        events=run.events,
        busy_share=run.busy_seconds / makespan if makespan > 0 else float("nan"),
        tokens_per_iteration=run.tokens / max(run.iterations, 1),
    )
    return row


def a2a_share(components_C: np.ndarray) -> float:
    """(dispatch + combine) / (gate + dispatch + experts + combine) of one MoE layer (the paper's Fig. 1 split)."""
    c = dict(zip(COMPONENTS, components_C, strict=True))
    layer = sum(c[name] for name in LAYER_COMPONENTS)
    return float((c["dispatch"] + c["combine"]) / layer) if layer > 0 else float("nan")


def layer_rows(rate: float, run: RunResult, layer_ids) -> list[dict]:
    """One row per MoE layer: mean seconds per iteration of each component over the whole run, and over the window's
    prefill-containing (`_prefill_s`) and decode-only (`_decode_s`) iterations apart, with the all-to-all shares."""
    per_iteration = run.moe_seconds / max(run.iterations, 1)
    counts = run.window_iterations if run.window_iterations is not None else np.zeros(2, np.int64)
    rows = []
    for layer, values in enumerate(per_iteration):
        row = {"rate": float(rate), "layer": layer, "layer_id": int(layer_ids[layer])}
        row.update({f"{name}_s": float(v) for name, v in zip(COMPONENTS, values, strict=True)})
        row["a2a_share"] = a2a_share(values)
        for p, phase in enumerate(PHASES):
            mean_C = run.window_moe_seconds[p, layer] / counts[p] if counts[p] else np.full(len(COMPONENTS), np.nan)
            row.update({f"{name}_{phase}_s": float(v) for name, v in zip(COMPONENTS, mean_C, strict=True)})
            row[f"a2a_share_{phase}"] = a2a_share(mean_C) if counts[p] else float("nan")
        rows.append(row)
    return rows


def paper_slo(per_rate: pd.DataFrame, latency: str, stat: str, multiplier: float) -> float:
    """multiplier x the `latency`_`stat` at the lightest swept rate (the first row of that rate)."""
    lightest = per_rate.loc[per_rate["rate"].idxmin()]
    return float(multiplier * lightest[f"{latency}_{stat}_s"])


def throughput_under_slo(per_rate: pd.DataFrame, latency: str, stat: str, slo: float) -> float:
    """Highest measured throughput (req/s) among swept rates whose `latency`_`stat` is within `slo`; 0.0 if none.
    A grid reading, kept for tables that hold no bisection; `bisect_rate` is the measurement."""
    meets = per_rate[per_rate[f"{latency}_{stat}_s"] <= slo]
    return float(meets["throughput_rps"].max()) if len(meets) else 0.0


def bisect_rate(meets: Callable[[float], bool], grid: np.ndarray, rel_tol: float, start: int = 0,
                max_probes: int = 64, lattice: float | None = None) -> dict:
    """The highest rate meeting an SLO rule, to a relative tolerance: gallop along the ascending `grid` from index
    `start` (1, 2, 4, ... steps) to a bracket, halve it to a meeting grid rate next to a failing one, then bisect
    that geometrically until high / low - 1 <= rel_tol. meets(rate) runs (or looks up) one simulation. With
    `lattice` (a rate), each midpoint snaps to the nearest lattice * (1 + rel_tol)^k strictly inside the bracket, so that bisections of
    several rules probe the same rates and share their runs.

    Returns {"low": highest rate seen to meet (0.0 when even grid[0] fails), "high": lowest rate seen to fail
    above it (inf when even grid[-1] meets: not bracketed), "bracketed": bool, "probes": rates asked in order}.
    With a noisy (not monotone) rule the search finds one crossing reachable from `start`, not necessarily the first.
    """
    grid = np.asarray(grid, dtype=np.float64)
    if not len(grid) or np.any(grid <= 0) or np.any(np.diff(grid) <= 0):
        raise ConfigError(f"the rate grid must be ascending rates > 0, got {grid.tolist()}.")
    if not rel_tol > 0:
        raise ConfigError(f"sim.slo.rel_tol must be > 0, got {rel_tol!r}.")
    probes: list[float] = []

    def ask(rate: float) -> bool:
        probes.append(float(rate))
        return bool(meets(float(rate)))

    # gallop from `start` (steps of 1, 2, 4, ... grid indices) to a bracket of grid rates, then halve it to two
    # neighbours: a start k grid steps from the crossing costs ~2 log2(k) runs instead of k
    n, i = len(grid), int(np.clip(start, 0, len(grid) - 1))
    up = ask(grid[i])
    last, stride = i, 1
    while True:
        j = min(last + stride, n - 1) if up else max(last - stride, 0)
        if j == last:  # ran off the grid: every rate meets (up) or fails (down)
            if up:
                return {"low": float(grid[-1]), "high": float("inf"), "bracketed": False, "probes": probes}
            return {"low": 0.0, "high": float(grid[0]), "bracketed": True, "probes": probes}
        if ask(grid[j]) != up:
            break
        last, stride = j, stride * 2
    lo_i, hi_i = (last, j) if up else (j, last)  # grid[lo_i] meets, grid[hi_i] fails
    while hi_i - lo_i > 1:
        mid = (lo_i + hi_i) // 2
        if ask(grid[mid]):
            lo_i = mid
        else:
            hi_i = mid
    low, high = float(grid[lo_i]), float(grid[hi_i])
    while high / low - 1 > rel_tol * (1 + 1e-9) and len(probes) < max_probes:  # a ladder step is one tolerance
        middle = float(np.sqrt(low * high))
        if lattice is not None:
            step = np.log1p(rel_tol)
            snapped = float(lattice * np.exp(step * np.round(np.log(middle / lattice) / step)))
            middle = snapped if low < snapped < high else middle
        if ask(middle):
            low = middle
        else:
            high = middle
    return {"low": low, "high": high, "bracketed": True, "probes": probes}


def ratio_interval(numerator_S, denominator_S, confidence: float = 0.95, resolution: float = 0.0) -> dict:
    """Paired ratio of two systems' per-seed values (same seed = same arrivals and requests): the mean of the
    per-seed ratios and its Student-t interval at `confidence`, widened by `resolution`.

    numerator_S, denominator_S: float[S] (S >= 2 for an interval); lists of different lengths are paired over
    their common seeds 0..S-1 (a job whose sim.seeds_until added seeds has more; seed i is the same in both). resolution: the relative width each value is
    known to (bisection's rel_tol: the true crossing lies within a factor 1 + rel_tol above the rate found), so
    the interval becomes [low / (1 + resolution), high x (1 + resolution)]; without it, seeds whose rates land
    on the same lattice steps would give a zero-width interval. Returns {"mean", "low", "high", "n", "ratios":
    list}; a seed whose denominator is 0 gives no ratio (left out; n says how many remain); NaN bounds when
    fewer than 2 ratios remain.
    """
    num, den = np.asarray(numerator_S, dtype=np.float64), np.asarray(denominator_S, dtype=np.float64)
    if num.ndim != 1 or den.ndim != 1:
        raise ConfigError(f"ratio_interval needs two per-seed value lists, got shapes {num.shape} and {den.shape}.")
    common = min(len(num), len(den))
    num, den = num[:common], den[:common]
    if not 0 < confidence < 1:
        raise ConfigError(f"ratio_interval's confidence must be in (0, 1), got {confidence!r}.")
    if not resolution >= 0:
        raise ConfigError(f"ratio_interval's resolution must be >= 0, got {resolution!r}.")
    keep = (den != 0) & np.isfinite(num) & np.isfinite(den)
    ratios = num[keep] / den[keep]
    n = len(ratios)
    mean = float(ratios.mean()) if n else float("nan")
    if n < 2:
        return {"mean": mean, "low": float("nan"), "high": float("nan"), "n": n, "ratios": ratios.tolist()}
    half = scipy_stats.t.ppf(0.5 + confidence / 2, n - 1) * ratios.std(ddof=1) / np.sqrt(n)
    return {"mean": mean, "low": float((mean - half) / (1 + resolution)), "high": float((mean + half) * (1 + resolution)),
            "n": n, "ratios": ratios.tolist()}
