"""The engines' load signals (their Prometheus /metrics endpoints) as the `RankLoad` view a plan reads.

    signals = LiveLoad(num_ranks, "vllm", kv_capacity_tokens=..., max_batched_tokens=...)
    signals.update(parse_metrics(text, "vllm", num_ranks))  # after each poll of the upstream(s)
    view = signals.view()                                    # what plan.assign_requests(..., load=view) reads
    signals.dispatched(rank, prompt_tokens)                  # the router's own dispatch since the last snapshot

Gauges read per rank (the rank from the `engine` label vLLM puts on its DP engines, or `dp_rank`; with one
upstream per rank, the upstream's index):
  vLLM    vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc (a fraction; before
          v0.10 vllm:gpu_cache_usage_perc)
  SGLang  sglang:num_running_reqs, sglang:num_queue_reqs, sglang:token_usage (a fraction)
Neither engine exports queued prompt tokens per rank: the view estimates them as waiting requests x the mean
prompt tokens the router itself sent to that rank. KV use is the fraction x the configured capacity.

Snapshots are stale by up to one poll period, so, as vLLM's DP client and SGLang's DP controller do, a dispatch
counts as waiting on its rank (with its prompt tokens queued) until the next snapshot replaces the counts.

Legend: D ranks.
"""

from __future__ import annotations

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from repro.errors import ConfigError
from repro.systems.load import RankLoad

GAUGES = {
    "vllm": {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
             "vllm:kv_cache_usage_perc": "kv_fraction", "vllm:gpu_cache_usage_perc": "kv_fraction"},
    "sglang": {"sglang:num_running_reqs": "running", "sglang:num_queue_reqs": "waiting",
               "sglang:token_usage": "kv_fraction"},
}
RANK_LABELS = ("engine", "dp_rank")


def parse_metrics(text: str, engine: str, num_ranks: int, rank: int | None = None) -> dict[str, np.ndarray]:
    """{"running", "waiting", "kv_fraction"}: float64[D] from one /metrics body (NaN where a rank is absent).

    rank: the rank every sample belongs to (one upstream per rank); None reads it from the samples' labels
    (a sample without one is rank 0). Samples of ranks outside 0..D-1 are ignored."""
    if engine not in GAUGES:
        raise ConfigError(f"engine must be one of {sorted(GAUGES)}, got {engine!r}.")
    out = {field: np.full(num_ranks, np.nan) for field in ("running", "waiting", "kv_fraction")}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as e:
        raise ConfigError(f"the {engine} /metrics body is not Prometheus text ({e}).") from e
    for family in families:
        for sample in family.samples:
            field = GAUGES[engine].get(sample.name)
            if field is None:
                continue
            label = next((sample.labels[k] for k in RANK_LABELS if k in sample.labels), "0")
            at = rank if rank is not None else int(label) if label.isdigit() else -1
            if 0 <= at < num_ranks:
                # several model_name series on one rank add up; a NaN start becomes the first value
                out[field][at] = np.nansum([out[field][at], sample.value])
    return out


class LiveLoad:
    """The last snapshot of the engines' gauges plus the router's dispatches since, as a RankLoad."""

    def __init__(self, num_ranks: int, kv_capacity_tokens: int, max_batched_tokens: int,
                 max_running_requests: int = 1 << 62):
        self.num_ranks = num_ranks
        self.kv_capacity_tokens, self.max_batched_tokens = int(kv_capacity_tokens), int(max_batched_tokens)
        self.max_running_requests = int(max_running_requests)
        self.running = np.zeros(num_ranks, dtype=np.int64)
        self.waiting = np.zeros(num_ranks, dtype=np.int64)
        self.kv_used = np.zeros(num_ranks, dtype=np.int64)
        self.pending = np.zeros(num_ranks, dtype=np.int64)  # dispatches the snapshot has not seen
        self.pending_tokens = np.zeros(num_ranks, dtype=np.int64)
        self.sent_requests = np.zeros(num_ranks, dtype=np.int64)  # for the mean prompt tokens per rank
        self.sent_tokens = np.zeros(num_ranks, dtype=np.int64)
        self.snapshots = 0

    def update(self, gauges: dict[str, np.ndarray]) -> None:
        """Replace the counts with a fresh snapshot (a rank missing from it keeps its last values)."""
        for name, target in (("running", self.running), ("waiting", self.waiting)):
            seen = np.isfinite(gauges[name])
            target[seen] = np.maximum(np.rint(gauges[name][seen]), 0).astype(np.int64)
        seen = np.isfinite(gauges["kv_fraction"])
        self.kv_used[seen] = np.rint(np.clip(gauges["kv_fraction"][seen], 0, 1) * self.kv_capacity_tokens).astype(np.int64)
        self.pending[:] = 0
        self.pending_tokens[:] = 0
        self.snapshots += 1

    def dispatched(self, rank: int, prompt_tokens: int) -> None:
        self.pending[rank] += 1
        self.pending_tokens[rank] += prompt_tokens
        self.sent_requests[rank] += 1
        self.sent_tokens[rank] += prompt_tokens

    def view(self) -> RankLoad:
        mean_prompt = self.sent_tokens / np.maximum(self.sent_requests, 1)
        queued = np.rint(self.waiting * mean_prompt).astype(np.int64) + self.pending_tokens
        return RankLoad(self.running.copy(), self.waiting + self.pending, queued, self.running.copy(),
                        self.kv_used.copy(), self.kv_capacity_tokens, self.max_batched_tokens, self.max_running_requests)
