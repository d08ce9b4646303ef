"""The one on-disk routing-trace format.

A trace is a directory:

    meta.json           TraceMeta (model, MoE layer ids, num_experts, top_k, vocab size, tokenizer, ...)
    requests.json       per-request table: {"id": [...], "dataset": [...], "label": [...]}
    offsets.npy         int64[R+1]   request r owns tokens offsets[r]:offsets[r+1]
    token_ids.npy       int32[N]     real tokenizer ids
    experts.npy         int16[N,L,k] logical expert ids per MoE layer, top-k order
    prefill_len.npy     int32[R]     tokens before it are prompt, after it generated
    weights.npy         float16[N,L,k] (optional) gate weights

Arrays are plain `.npy` files read with `mmap_mode="r"` and `allow_pickle=False`: nothing executes on load.
Writes go to a temporary sibling directory that is renamed into place, so a reader never sees half a trace.

Legend: R requests, N tokens, L MoE layers, k experts per token.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from repro.errors import TraceError

FORMAT_VERSION = 1
ARRAY_DTYPES = {
    "offsets": np.int64,
    "token_ids": np.int32,
    "experts": np.int16,
    "prefill_len": np.int32,
    "weights": np.float16,
}
REQUIRED_ARRAYS = ("offsets", "token_ids", "experts", "prefill_len")


@dataclass(frozen=True)
class TraceMeta:
    """What produced the routing; everything a consumer needs to interpret the arrays."""

    model: str
    num_experts: int
    top_k: int
    layer_ids: tuple[int, ...]  # model layer index of each MoE layer, length L
    vocab_size: int
    tokenizer: str = ""
    source: str = ""  # "hf_capture", "replay", "import:<file>", ...
    dataset: str = ""
    dense_layers: tuple[int, ...] = ()  # model layers without a router (skipped)
    extra: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def to_json(self) -> dict:
        d = asdict(self)
        d["layer_ids"] = list(self.layer_ids)
        d["dense_layers"] = list(self.dense_layers)
        d["num_layers"] = self.num_layers
        return d

    @classmethod
    def from_json(cls, d: dict, where: str = "meta.json") -> TraceMeta:
        try:
            d = dict(d)
            d.pop("num_layers", None)
            d["layer_ids"] = tuple(int(x) for x in d["layer_ids"])
            d["dense_layers"] = tuple(int(x) for x in d.get("dense_layers", ()))
            meta = cls(**d)
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"{where} is not a valid trace meta ({e}); rewrite the trace with repro.traces.") from e
        if meta.format_version != FORMAT_VERSION:
            raise TraceError(f"{where} has format_version {meta.format_version}; this suite reads {FORMAT_VERSION}.")
        return meta


@dataclass(frozen=True)
class RoutingTrace:
    """Routing of R requests through L MoE layers (see the module docstring for shapes)."""

    meta: TraceMeta
    offsets: np.ndarray
    token_ids: np.ndarray
    experts: np.ndarray
    prefill_len: np.ndarray
    request_ids: tuple[str, ...]
    request_datasets: tuple[str, ...]
    request_labels: tuple[str, ...]
    weights: np.ndarray | None = None

    @property
    def num_requests(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_layers(self) -> int:
        return self.meta.num_layers

    def lengths(self) -> np.ndarray:
        """int64[R] tokens per request."""
        return np.diff(self.offsets)

    def request_of_token(self) -> np.ndarray:
        """int64[N] index of the request that owns each token."""
        return np.repeat(np.arange(self.num_requests), self.lengths())

    def prompt_mask(self) -> np.ndarray:
        """bool[N] True for prompt (prefill) tokens."""
        pos = np.arange(self.num_tokens) - np.repeat(self.offsets[:-1], self.lengths())
        return pos < np.repeat(self.prefill_len, self.lengths())

    def validate(self) -> RoutingTrace:
        validate(self)
        return self


def make_trace(
    meta: TraceMeta,
    offsets,
    token_ids,
    experts,
    prefill_len=None,
    request_ids=None,
    request_datasets=None,
    request_labels=None,
    weights=None,
) -> RoutingTrace:
    """Build and validate a trace from array-likes, casting to the canonical dtypes."""
    offsets = np.asarray(offsets, dtype=np.int64)
    num_requests = len(offsets) - 1
    if num_requests < 0:
        raise TraceError("offsets must have at least one entry (offsets[0] == 0).")
    lengths = np.diff(offsets)
    trace = RoutingTrace(
        meta=meta,
        offsets=offsets,
        token_ids=_cast(token_ids, np.int32, "token_ids"),
        experts=_cast(experts, np.int16, "experts"),
        prefill_len=(lengths if prefill_len is None else np.asarray(prefill_len)).astype(np.int32),
        request_ids=tuple(str(x) for x in (request_ids if request_ids is not None else range(num_requests))),
        request_datasets=tuple(str(x) for x in (request_datasets or [meta.dataset] * num_requests)),
        request_labels=tuple(str(x) for x in (request_labels or [""] * num_requests)),
        weights=None if weights is None else np.asarray(weights, dtype=np.float16),
    )
    return trace.validate()


def _cast(a, dtype, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.size and np.issubdtype(a.dtype, np.integer):
        info = np.iinfo(dtype)
        if a.min() < info.min or a.max() > info.max:
            raise TraceError(f"{name} has values outside the {np.dtype(dtype).name} range of the trace format.")
    return a.astype(dtype, copy=False)


def validate(trace: RoutingTrace) -> None:
    """Raise TraceError naming the first inconsistency; return None when the trace is well formed."""
    m = trace.meta
    if m.num_experts < 1 or m.top_k < 1 or m.top_k > m.num_experts:
        raise TraceError(f"meta has num_experts={m.num_experts}, top_k={m.top_k}; need 1 <= top_k <= num_experts.")
    if m.num_layers < 1:
        raise TraceError("meta.layer_ids is empty; a trace needs at least one MoE layer.")
    for name in REQUIRED_ARRAYS + (("weights",) if trace.weights is not None else ()):
        a = getattr(trace, name)
        if a.dtype != ARRAY_DTYPES[name]:
            raise TraceError(f"{name} has dtype {a.dtype}; the trace format needs {np.dtype(ARRAY_DTYPES[name]).name}.")
    off = trace.offsets
    if off.ndim != 1 or len(off) < 1 or off[0] != 0:
        raise TraceError("offsets must be a 1-D array starting at 0.")
    if np.any(np.diff(off) < 0):
        bad = int(np.argmax(np.diff(off) < 0))
        raise TraceError(f"offsets are not monotonic: offsets[{bad + 1}]={off[bad + 1]} < offsets[{bad}]={off[bad]}.")
    n = int(off[-1])
    if trace.token_ids.shape != (n,):
        raise TraceError(f"token_ids has shape {trace.token_ids.shape}; offsets[-1] says {n} tokens.")
    want = (n, m.num_layers, m.top_k)
    if trace.experts.shape != want:
        raise TraceError(f"experts has shape {trace.experts.shape}; meta and offsets say {want} (tokens, layers, top_k).")
    if trace.weights is not None and trace.weights.shape != want:
        raise TraceError(f"weights has shape {trace.weights.shape}; expected {want} like experts.")
    r = trace.num_requests
    if trace.prefill_len.shape != (r,):
        raise TraceError(f"prefill_len has shape {trace.prefill_len.shape}; expected ({r},) one per request.")
    if np.any(trace.prefill_len < 0) or np.any(trace.prefill_len > np.diff(off)):
        bad = int(np.argmax((trace.prefill_len < 0) | (trace.prefill_len > np.diff(off))))
        raise TraceError(f"prefill_len[{bad}]={trace.prefill_len[bad]} is outside 0..{int(np.diff(off)[bad])} (the request's length).")
    for name in ("request_ids", "request_datasets", "request_labels"):
        if len(getattr(trace, name)) != r:
            raise TraceError(f"{name} has {len(getattr(trace, name))} entries; the trace has {r} requests.")
    if n:
        lo, hi = int(trace.experts.min()), int(trace.experts.max())
        if lo < 0 or hi >= m.num_experts:
            bad = lo if lo < 0 else hi
            raise TraceError(f"expert id {bad} is outside 0..{m.num_experts - 1} (meta.num_experts={m.num_experts}).")
        _check_distinct_experts(trace.experts)
        tlo, thi = int(trace.token_ids.min()), int(trace.token_ids.max())
        if tlo < 0 or thi >= m.vocab_size:
            bad = tlo if tlo < 0 else thi
            raise TraceError(f"token id {bad} is outside 0..{m.vocab_size - 1} (meta.vocab_size={m.vocab_size}).")


DISTINCT_CHECK_ROWS = 1 << 16  # tokens per chunk of the duplicate-expert check (bounds the sorted copy's memory)


def _check_distinct_experts(experts: np.ndarray) -> None:
    """A router picks k distinct experts; a token listing one twice would be counted twice by every metric."""
    if experts.shape[2] < 2:
        return
    for start in range(0, len(experts), DISTINCT_CHECK_ROWS):
        chunk = np.sort(np.asarray(experts[start : start + DISTINCT_CHECK_ROWS]), axis=2)
        repeated = (chunk[:, :, 1:] == chunk[:, :, :-1]).any(axis=2)  # [n, L]
        if repeated.any():
            token, layer = np.argwhere(repeated)[0]
            raise TraceError(
                f"token {start + token} lists expert {int(chunk[token, layer][np.argmax(np.diff(chunk[token, layer]) == 0)])} "
                f"twice at MoE layer index {layer}; each token's top-k experts must be distinct."
            )


def write_trace(trace: RoutingTrace, path: str | os.PathLike) -> Path:
    """Validate, then write atomically to directory `path` (replacing an existing trace there)."""
    validate(trace)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        (tmp / "meta.json").write_text(json.dumps(trace.meta.to_json(), indent=1))
        (tmp / "requests.json").write_text(
            json.dumps(
                {
                    "id": list(trace.request_ids),
                    "dataset": list(trace.request_datasets),
                    "label": list(trace.request_labels),
                }
            )
        )
        for name in REQUIRED_ARRAYS + (("weights",) if trace.weights is not None else ()):
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(getattr(trace, name)), allow_pickle=False)
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_trace(path: str | os.PathLike, mmap: bool = True) -> RoutingTrace:
    """Read and validate the trace directory at `path` (arrays memory-mapped unless mmap=False)."""
    path = Path(path)
    if not path.is_dir():
        raise TraceError(f"{path} is not a trace directory; write one with repro.traces.write_trace or import one with python -m repro.traces.import.")
    meta = TraceMeta.from_json(_read_json(path / "meta.json"), where=str(path / "meta.json"))
    req = _read_json(path / "requests.json")
    arrays = {}
    for name in REQUIRED_ARRAYS + ("weights",):
        f = path / f"{name}.npy"
        if not f.exists():
            if name == "weights":
                arrays[name] = None
                continue
            raise TraceError(f"{path} is missing {name}.npy; the trace is incomplete.")
        try:
            arrays[name] = np.load(f, mmap_mode="r" if mmap else None, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise TraceError(f"{f} is truncated or corrupted ({e}); re-create the trace.") from e
    if not isinstance(req, dict) or not all(k in req for k in ("id", "dataset", "label")):
        raise TraceError(f"{path / 'requests.json'} must be an object with lists 'id', 'dataset', 'label'.")
    trace = RoutingTrace(
        meta=meta,
        request_ids=tuple(map(str, req["id"])),
        request_datasets=tuple(map(str, req["dataset"])),
        request_labels=tuple(map(str, req["label"])),
        **arrays,
    )
    validate(trace)
    return trace


def _read_json(f: Path):
    try:
        return json.loads(f.read_text())
    except FileNotFoundError as e:
        raise TraceError(f"{f.parent} is missing {f.name}; the trace is incomplete.") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{f} is truncated or corrupted ({e}); re-create the trace.") from e


def with_meta(trace: RoutingTrace, **changes) -> RoutingTrace:
    """A copy of `trace` whose meta has `changes` applied."""
    return replace(trace, meta=replace(trace.meta, **changes))
