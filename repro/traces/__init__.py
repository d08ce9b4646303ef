"""The routing-trace format: read, write, validate, split, concatenate (see format.py)."""

from repro.traces.format import RoutingTrace, TraceMeta, make_trace, read_trace, validate, with_meta, write_trace
from repro.traces.ops import Split, concat_traces, select_requests, split_indices, split_trace, trace_digest

__all__ = [
    "RoutingTrace",
    "TraceMeta",
    "concat_traces",
    "make_trace",
    "read_trace",
    "select_requests",
    "Split",
    "split_indices",
    "split_trace",
    "trace_digest",
    "validate",
    "with_meta",
    "write_trace",
]
