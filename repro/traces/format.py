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
Writes go to a temporary sibling directory that is renamed into place (repro.atomic.atomic_dir), so a reader
never sees half a trace; concurrent writers of one path are safe (write_trace's if_exists), and write_trace never
deletes what is not a trace (trace_dir_state).

A trace may also be a folder of shards: a `shards.json` manifest listing trace directories in request order
(same model, experts, layers, vocabulary and tokenizer; request ids unique across shards). read_trace reads it
without copying arrays (repro.traces.shards: `python -m repro.traces.shards combine OUT SHARD...` writes one).

Legend: R requests, N tokens, L MoE layers, k experts per token.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from repro.atomic import atomic_dir
from repro.errors import TraceError
from repro.traces.arrays import ConcatArray, release_pages
from repro.traces.manifest import MANIFEST, SHARED_META, is_sharded, manifest_shards

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
        if not isinstance(d, dict):
            raise TraceError(f"{where} holds a JSON {type(d).__name__}, not an object; re-create the trace with repro.traces.")
        d = dict(d)
        stated = d.pop("num_layers", None)  # derived from layer_ids; a file that disagrees with itself is refused
        if stated is not None and isinstance(d.get("layer_ids"), list) and stated != len(d["layer_ids"]):
            raise TraceError(
                f"{where} says num_layers={stated!r} but layer_ids lists {len(d['layer_ids'])} MoE layers; "
                "fix one of them or re-create the trace."
            )
        version = d.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:  # checked first: another version may have other fields
            raise TraceError(f"{where} has format_version {version!r}; this suite reads {FORMAT_VERSION}.")
        for name in ("layer_ids", "dense_layers"):
            if name in d:
                if not isinstance(d[name], list):
                    raise TraceError(f"{where}: {name} is {d[name]!r}; it must be a list of integer model layer indices.")
                d[name] = tuple(d[name])
        try:
            meta = cls(**d)
        except TypeError as e:  # a missing or unknown key
            raise TraceError(f"{where} is not a valid trace meta ({e}); rewrite the trace with repro.traces.") from e
        check_meta_fields(meta, where)
        return meta


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_meta_fields(meta: TraceMeta, where: str = "trace meta") -> None:
    """Raise TraceError naming the first meta field whose value has the wrong type (JSON lets any type through)."""
    for name in ("num_experts", "top_k", "vocab_size", "format_version"):
        value = getattr(meta, name)
        if not _is_int(value):
            raise TraceError(f"{where}: {name} is {value!r}; it must be an integer (fix it or re-create the trace).")
    for name in ("model", "tokenizer", "source", "dataset"):
        value = getattr(meta, name)
        if not isinstance(value, str):
            raise TraceError(f"{where}: {name} is {value!r}; it must be a string (fix it or re-create the trace).")
    for name in ("layer_ids", "dense_layers"):
        bad = [x for x in getattr(meta, name) if not _is_int(x) or x < 0]
        if bad:
            raise TraceError(
                f"{where}: {name} holds {bad[0]!r}; it must list non-negative integer model layer indices "
                "(fix it or re-create the trace)."
            )
    if not isinstance(meta.extra, dict):
        raise TraceError(f"{where}: extra is {meta.extra!r}; it must be an object (fix it or re-create the trace).")


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
        weights=None if weights is None else _weights_float16(weights),
    )
    return trace.validate()


FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504


def _weights_float16(weights) -> np.ndarray:
    """float16[N, L, k]; a finite value beyond float16's range would silently become inf, so it is refused here."""
    w = np.asarray(weights)
    if w.dtype != np.float16 and w.size and np.issubdtype(w.dtype, np.floating):
        over = np.isfinite(w) & (np.abs(w) > FLOAT16_MAX)
        if over.any():
            where = np.unravel_index(int(np.argmax(over)), w.shape)
            raise TraceError(
                f"gate weight {float(w[where])!r} at (token, layer, slot) {tuple(int(i) for i in where)} is beyond "
                f"the float16 range (|w| <= {FLOAT16_MAX:g}) of the trace format; export normalised gate weights."
            )
    return w.astype(np.float16, copy=False)


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
    check_meta_fields(m)
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
    if n == 0:
        raise TraceError(
            f"the trace has {len(off) - 1} requests and no tokens; a trace needs at least one routed token "
            "(re-create it from a non-empty workload)."
        )
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
    if len(set(trace.request_ids)) != r:
        seen: set = set()
        twice = next(i for i in trace.request_ids if i in seen or seen.add(i))
        raise TraceError(
            f"request id {twice!r} appears twice in requests.json; request ids must be unique (every split and "
            "per-request result is keyed by them): re-export the trace with distinct ids."
        )
    lo, hi, repeated = _scan_experts(trace.experts)
    if lo < 0 or hi >= m.num_experts:
        bad = lo if lo < 0 else hi
        raise TraceError(f"expert id {bad} is outside 0..{m.num_experts - 1} (meta.num_experts={m.num_experts}).")
    if repeated:
        raise TraceError(repeated)
    tlo, thi = int(trace.token_ids.min()), int(trace.token_ids.max())
    if tlo < 0 or thi >= m.vocab_size:
        bad = tlo if tlo < 0 else thi
        raise TraceError(f"token id {bad} is outside 0..{m.vocab_size - 1} (meta.vocab_size={m.vocab_size}).")
    if trace.weights is not None:
        _check_finite_weights(trace.weights)


DISTINCT_CHECK_ROWS = 1 << 16  # tokens per chunk of the duplicate-expert check (bounds the sorted copy's memory)


def _scan_experts(experts: np.ndarray) -> tuple[int, int, str]:
    """(lowest id, highest id, why the first token listing an expert twice is refused, or "") in one pass over
    experts[N, L, k] in row chunks, memory-mapped pages released after each (a big trace's RSS stays at a chunk).

    A router picks k distinct experts; a token listing one twice would be counted twice by every metric.
    """
    lo, hi, repeated = np.iinfo(np.int64).max, np.iinfo(np.int64).min, ""
    for start in range(0, len(experts), DISTINCT_CHECK_ROWS):
        chunk = np.asarray(experts[start : start + DISTINCT_CHECK_ROWS])
        lo, hi = min(lo, int(chunk.min())), max(hi, int(chunk.max()))
        if not repeated and experts.shape[2] >= 2:
            chunk = np.sort(chunk, axis=2)
            twice = (chunk[:, :, 1:] == chunk[:, :, :-1]).any(axis=2)  # [n, L]
            if twice.any():
                token, layer = np.argwhere(twice)[0]
                repeated = (
                    f"token {start + token} lists expert {int(chunk[token, layer][np.argmax(np.diff(chunk[token, layer]) == 0)])} "
                    f"twice at MoE layer index {layer}; each token's top-k experts must be distinct."
                )
        release_pages(experts)
    return lo, hi, repeated


def _check_finite_weights(weights: np.ndarray) -> None:
    """Negative, NaN or inf gate weights (inf is also what an overflowing float16 cast leaves) would poison every weighted
    metric; checked in chunks so a memory-mapped trace is not copied whole."""
    for start in range(0, len(weights), DISTINCT_CHECK_ROWS):
        chunk = np.asarray(weights[start : start + DISTINCT_CHECK_ROWS])
        # float16 is NaN or inf exactly when its 5 exponent bits are all set; integer ops are ~4x np.isfinite's speed
        bits = chunk.view(np.uint16)
        finite = (bits & 0x7C00) != 0x7C00
        negative = (bits > 0x8000) & finite  # sign bit set, not -0.0: a gate weight is a probability share
        release_pages(weights)
        if negative.any():
            token, layer, slot = np.argwhere(negative)[0]
            raise TraceError(
                f"gate weight of token {start + token} at MoE layer index {layer} (slot {slot}) is "
                f"{float(weights[start + token, layer, slot])!r}; gate weights must be >= 0 (re-export them, or drop "
                "weights.npy)."
            )
        if not finite.all():
            token, layer, slot = np.argwhere(~finite)[0]
            value = weights[start + token, layer, slot]
            raise TraceError(
                f"gate weight of token {start + token} at MoE layer index {layer} (slot {slot}) is {float(value)!r}; "
                "weights must be finite and within float16 range (re-export them, or drop weights.npy)."
            )


TRACE_EXTRA_FILES = ("vocab.json", "arrival_time.json")  # files a trace directory may hold beside meta, requests and arrays
TRACE_FILES = frozenset({"meta.json", "requests.json", *TRACE_EXTRA_FILES, *(f"{n}.npy" for n in ARRAY_DTYPES)})
DIGEST_CACHE = ".digest.json"  # the trace's own digest, cached by repro.traces.digest


def is_digest_cache(name: str) -> bool:
    """Whether `name` in a trace folder is its digest cache or a temporary of that cache's writer: part of the
    trace, not foreign data that would stop the folder being replaced."""
    return name == DIGEST_CACHE or name.startswith(f".{DIGEST_CACHE}.")
IF_EXISTS = ("replace", "keep", "error")


def trace_dir_state(path: str | os.PathLike) -> tuple[str, str]:
    """What is at `path`, for a writer: ("absent" | "empty" | "trace" | "other", why-not-a-trace or "").

    A trace is a directory holding meta.json and every required array, and nothing a trace never holds; only
    "absent", "empty" and "trace" may be written over. A symbolic link is "other": replacing it would not
    replace what it points to.
    """
    path = Path(path)
    # a concurrent writer may swap the directory and delete the old one while it is listed (a half-deleted
    # listing reads as "not a trace"): list again until the directory is the same before and after
    for _ in range(READ_ATTEMPTS):
        before = _dir_identity(path)
        state = _trace_dir_state_once(path)
        if _dir_identity(path) == before:
            break
    return state


def _trace_dir_state_once(path: Path) -> tuple[str, str]:
    if path.is_symlink():
        return "other", f"is a symbolic link (to {os.readlink(path)})"
    if not path.exists():
        return "absent", ""
    if not path.is_dir():
        return "other", "is a file, not a directory"
    try:
        names = {entry.name for entry in os.scandir(path)}
    except OSError as e:
        return "other", f"cannot be listed ({e.strerror})"
    if not names:
        return "empty", ""
    foreign = sorted(n for n in names - TRACE_FILES if not is_digest_cache(n))
    if foreign:
        return "other", f"holds {foreign[0]!r}, which is not part of a routing trace"
    missing = [f for f in ("meta.json", *(f"{n}.npy" for n in REQUIRED_ARRAYS)) if f not in names]
    if missing:
        return "other", f"lacks {missing[0]}, so it is not a complete routing trace"
    return "trace", ""


def check_trace_destination(path: str | os.PathLike, if_exists: str = "replace") -> str:
    """Raise TraceError unless write_trace(..., if_exists) may write at `path`; returns trace_dir_state's kind."""
    if if_exists not in IF_EXISTS:
        raise TraceError(f"if_exists must be one of {IF_EXISTS}, got {if_exists!r}.")
    kind, why = trace_dir_state(path)
    if kind == "other":
        raise TraceError(f"{path} {why}; nothing was written: choose a new or empty folder (it is never replaced).")
    if kind == "trace" and if_exists == "error":
        raise TraceError(f"{path} already holds a routing trace; nothing was written: choose another folder or replace it explicitly.")
    return kind


def write_trace(
    trace: RoutingTrace,
    path: str | os.PathLike,
    *,
    if_exists: str = "replace",
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Validate, then publish the trace directory at `path` in one atomic rename (a reader never sees half a trace).

    `path` may be absent or an empty directory. When it already holds a routing trace, if_exists decides:
    "replace" swaps ours in atomically and deletes the old one; "keep" is first-writer-wins, for caches that
    several processes may fill at once: the trace already there (or published by a concurrent writer while we
    wrote) is kept and ours discarded, unread and uncompared (the cache key is what makes them the same);
    "error" refuses. Anything else at `path` (a file, a link, a folder that is not a trace) is refused with
    TraceError and never deleted. extra_files ({name: text}, names from TRACE_EXTRA_FILES, e.g. vocab.json)
    are written inside the same atomic publish.
    """
    validate(trace)
    path = Path(path)
    extra_files = dict(extra_files or {})
    unknown = sorted(set(extra_files) - set(TRACE_EXTRA_FILES))
    if unknown:
        raise TraceError(f"write_trace cannot add {unknown[0]!r} to a trace; its extra files are {TRACE_EXTRA_FILES}.")
    if check_trace_destination(path, if_exists) == "trace" and if_exists == "keep":
        return path

    def write_into(tmp: Path) -> None:
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
        for name, text in extra_files.items():
            (tmp / name).write_text(text, encoding="utf-8")

    return publish_trace_dir(path, write_into, if_exists)


def publish_trace_dir(path: Path, write_into, if_exists: str) -> Path:
    """Publish the trace write_into(tmp) writes at `path` in one atomic rename (write_trace's if_exists rules);
    a writer that lost the race to another reuses only a trace and refuses anything else."""
    try:
        published = atomic_dir(path, write_into, replace=if_exists == "replace")
    except OSError as e:
        raise TraceError(f"cannot write the trace to {path} ({e}); check the folder's permissions and free space.") from e
    if not published:  # another writer published first (or it appeared since the check): only a trace is reused
        kind, why = trace_dir_state(path)
        if kind != "trace":
            raise TraceError(f"{path} {why}; nothing was written: choose a new or empty folder (it is never replaced).")
        if if_exists == "error":
            raise TraceError(f"{path} already holds a routing trace; nothing was written: choose another folder or replace it explicitly.")
    return path


READ_ATTEMPTS = 20  # re-reads when the trace directory was swapped out while its files were being opened


def read_trace(path: str | os.PathLike, mmap: bool = True) -> RoutingTrace:
    """Read and validate the trace directory at `path` (arrays memory-mapped unless mmap=False).

    Writers may replace the trace while we read it (write_trace publishes whole directories by rename or atomic
    swap, and never changes a published one). So the directory is opened once and all its files opened through
    that handle before any is read: the result is one writer's trace, never a mix, whatever is renamed meanwhile,
    and memory maps stay valid after the old directory is deleted. Only when the writer deletes the old
    directory between our opens is a file missing (even the optional weights.npy); then `path` names another
    directory and the read is repeated. A folder with a shards.json manifest is read as a sharded trace
    (read_sharded_trace: each shard read this way, arrays concatenated without copying).
    """
    path = Path(path)
    if is_sharded(path):
        return read_sharded_trace(path, mmap)
    for _ in range(READ_ATTEMPTS):
        before = _dir_identity(path)
        try:
            return _read_trace_once(path, mmap)
        except _TraceReplaced:
            continue
        except TraceError:
            if _dir_identity(path) == before:
                raise
    raise TraceError(f"{path} was replaced {READ_ATTEMPTS} times while being read; stop the processes rewriting it and retry.")


def combine_shards(shards: list, names: list[str]):
    """One RoutingTrace over `shards` (RoutingTraces in request order), refusing mismatched meta or request ids.

    names[i] names shard i in messages. Arrays are not copied: token_ids, experts and weights are
    ConcatArrays over the shards' arrays; offsets int64[R+1] and prefill_len int32[R] are concatenated.
    """
    first = shards[0].meta
    for name, trace in zip(names[1:], shards[1:], strict=True):
        for key in SHARED_META:
            if getattr(trace.meta, key) != getattr(first, key):
                raise TraceError(
                    f"{name} has {key}={getattr(trace.meta, key)!r} but {names[0]} has {getattr(first, key)!r}; "
                    "every shard of a sharded trace must come from the same model and tokenizer."
                )
        if (trace.weights is None) != (shards[0].weights is None):
            raise TraceError(
                f"{name} {'lacks' if trace.weights is None else 'has'} gate weights but {names[0]} "
                f"{'has' if shards[0].weights is not None else 'lacks'} them; all shards or none must carry weights.npy."
            )
    owner: dict[str, int] = {}
    for index, trace in enumerate(shards):
        for request_id in trace.request_ids:
            if owner.setdefault(request_id, index) != index:
                raise TraceError(
                    f"request id {request_id!r} is in both {names[owner[request_id]]} and {names[index]}; request ids "
                    "must be unique across shards (re-export one capture with distinct ids)."
                )
    lengths = np.concatenate([t.lengths() for t in shards])
    datasets = sorted({t.meta.dataset for t in shards})
    return RoutingTrace(
        meta=replace(first, dataset="+".join(datasets)),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        token_ids=ConcatArray([t.token_ids for t in shards]),
        experts=ConcatArray([t.experts for t in shards]),
        prefill_len=np.concatenate([t.prefill_len for t in shards]).astype(np.int32),
        request_ids=tuple(i for t in shards for i in t.request_ids),
        request_datasets=tuple(d for t in shards for d in t.request_datasets),
        request_labels=tuple(x for t in shards for x in t.request_labels),
        weights=None if shards[0].weights is None else ConcatArray([t.weights for t in shards]),
    )


def read_sharded_trace(path: str | os.PathLike, mmap: bool = True):
    """The sharded trace at `path` (see the module docstring); each shard is read and validated by read_trace."""
    path = Path(path)
    shard_dirs = manifest_shards(path)
    shards = []
    for shard_dir in shard_dirs:
        if is_sharded(shard_dir):
            raise TraceError(f"shard {shard_dir} of {path} is itself sharded; list its shards in {path / MANIFEST} instead.")
        if not shard_dir.is_dir():
            raise TraceError(f"shard {shard_dir} listed in {path / MANIFEST} is missing; restore it or re-create the manifest.")
        shards.append(read_trace(shard_dir, mmap=mmap))
    return combine_shards(shards, [f"shard {s}" for s in shard_dirs])


class _TraceReplaced(TraceError):
    """The directory opened was swapped out (and is being deleted) before all its files were opened."""


def _dir_identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _read_trace_once(path: Path, mmap: bool) -> RoutingTrace:
    names = ("meta.json", "requests.json", *(f"{n}.npy" for n in REQUIRED_ARRAYS + ("weights",)))
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise TraceError(
            f"{path} is not a trace directory ({e.strerror}); write one with repro.traces.write_trace or import one "
            "with python -m repro.traces.import."
        ) from e
    files = {}
    try:
        for name in names:  # all opened before any is read: one directory's files, even if it is renamed meanwhile
            try:
                files[name] = os.fdopen(os.open(name, os.O_RDONLY, dir_fd=dir_fd), "rb")
            except FileNotFoundError:
                files[name] = None
            except OSError as e:
                raise TraceError(f"cannot open {path / name} ({e.strerror}); check its permissions.") from e
        if None in files.values():  # an optional weights.npy, or a swapped-out directory being deleted under us
            st = os.fstat(dir_fd)
            if (st.st_dev, st.st_ino) != _dir_identity(path):
                for f in files.values():
                    if f is not None:
                        f.close()
                raise _TraceReplaced(f"{path} was replaced while being read.")
    finally:
        os.close(dir_fd)
    try:
        return _parse_trace(path, files, mmap)
    finally:
        for f in files.values():
            if f is not None:
                f.close()


def _parse_trace(path: Path, files: dict, mmap: bool) -> RoutingTrace:
    meta = TraceMeta.from_json(_read_json(path, "meta.json", files["meta.json"]), where=str(path / "meta.json"))
    req = _read_json(path, "requests.json", files["requests.json"])
    arrays = {}
    for name in REQUIRED_ARRAYS + ("weights",):
        f = files[f"{name}.npy"]
        if f is None:
            if name == "weights":
                arrays[name] = None
                continue
            raise TraceError(f"{path} is missing {name}.npy; the trace is incomplete.")
        try:
            arrays[name] = _load_npy(f, mmap)
        except (ValueError, OSError, EOFError) as e:
            raise TraceError(f"{path / (name + '.npy')} is truncated or corrupted ({e}); re-create the trace.") from e
    if not isinstance(req, dict) or not all(isinstance(req.get(k), list) for k in ("id", "dataset", "label")):
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


def _load_npy(f, mmap: bool) -> np.ndarray:
    """The array in the open .npy file f; memory-mapped through the open file (np.load maps file names only)."""
    if not mmap:
        return np.load(f, allow_pickle=False)
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        raise ValueError(f".npy format version {version} is not one np.save writes for these arrays")
    if dtype.hasobject:
        raise ValueError("an object array (a pickle) is not allowed")
    if int(np.prod(shape)) == 0:
        return np.empty(shape, dtype)
    return np.memmap(f, dtype=dtype, mode="r", offset=f.tell(), shape=shape, order="F" if fortran_order else "C")


def _read_json(path: Path, name: str, f):
    if f is None:
        raise TraceError(f"{path} is missing {name}; the trace is incomplete.")
    try:
        return json.loads(f.read().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{path / name} is truncated or corrupted ({e}); re-create the trace.") from e


def with_meta(trace: RoutingTrace, **changes) -> RoutingTrace:
    """A copy of `trace` whose meta has `changes` applied."""
    return replace(trace, meta=replace(trace.meta, **changes))
