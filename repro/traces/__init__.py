"""The routing-trace format: read, write, validate, split, concatenate (see format.py)."""

from repro.traces.format import RoutingTrace, TraceMeta, make_trace, read_trace, validate, with_meta, write_trace
from repro.traces.ops import concat_traces, select_requests, split_indices, split_trace

__all__ = [
    "RoutingTrace",
    "TraceMeta",
    "concat_traces",
    "make_trace",
    "read_trace",
    "select_requests",
    "split_indices",
    "split_trace",
    "validate",
    "with_meta",
    "write_trace",
]
