"""The discrete-event core: a heap of (time, priority, sequence) keys.

A plain `heapq` loop needs no library: it ran ~4.3 M trivial events/s against ~1.2 M for SimPy on the
reference machine (../shared/reference/simulators.md), and the numpy work on traffic matrices dominates anyway. The key is total and deterministic: equal times are broken by priority (an
arrival at time t is seen by an engine step that ends at t), then by insertion order.
"""

from __future__ import annotations

import heapq
import itertools

ARRIVAL = 0  # before STEP_END at equal times: a request arriving as a step ends joins the next batch
CHANGE = 1  # a placement change asked for, or an async migration's end (repro/sim/plan_changes.py): before a step
# ending at the same instant, so that step's boundary begins (or ends) it
STEP_END = 2


class EventQueue:
    """Min-heap of events; `pop` returns (time, priority, payload) in key order."""

    def __init__(self) -> None:
        self._heap: list = []
        self._sequence = itertools.count()
        self.popped = 0

    def push(self, time: float, priority: int, payload=None) -> None:
        heapq.heappush(self._heap, (time, priority, next(self._sequence), payload))

    def pop(self) -> tuple[float, int, object]:
        time, priority, _, payload = heapq.heappop(self._heap)
        self.popped += 1
        return time, priority, payload

    def peek_time(self) -> float:
        """Time of the next event, or +inf when there is none."""
        return self._heap[0][0] if self._heap else float("inf")

    def __len__(self) -> int:
        return len(self._heap)
