"""Decoders of the routing data SGLang and vLLM hand out, each checked before use (nothing here unpickles).

SGLang `return_routed_experts` (`meta_info["routed_experts"]` on /generate, `sglext.routed_experts` on the
OpenAI endpoints): base64 of a flat little-endian array, int32 unless `meta_info["routed_experts_dtype"]` says
"uint16" / "uint8" (newer builds, SGLANG_ROUTED_EXPERTS_DTYPE), row-major [tokens, num_hidden_layers, top_k];
the rows cover positions [0, prompt + output - 1) (the last generated token is never run through the model);
ids are PHYSICAL slots. vLLM `choices[i].routed_experts`: base64 of an `.npy` file [tokens, num_hidden_layers,
top_k] over the same positions, LOGICAL ids. Dense layers' columns hold zeros or -1 in both; only MoE layers
are read. SGLang recorder `per_token` dumps (`/dump_expert_distribution_record`, one .pt per rank):
{"records": [...], "last_physical_to_logical_map": int[Lh, P]}, each record one forward pass of one rank with
input_ids, positions, extend_seq_lens and topk_ids_of_layer int32[Lh, n, 8] (-1 padded), without request ids.

Legend: Lh model (hidden) layers, L MoE layers, P physical slots, n rows (tokens) of one response, k top-k.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from repro.errors import TraceError

SGLANG_WIRE_DTYPES = {"int32": np.dtype("<i4"), "uint16": np.dtype("<u2"), "uint8": np.dtype("u1")}
RETURN_FLAG = "--enable-return-routed-experts"


def _b64(text, what: str) -> bytes:
    if not isinstance(text, str):
        raise TraceError(f"{what} is {type(text).__name__}, not a base64 string.")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as e:
        raise TraceError(f"{what} is not valid base64 ({e}).") from e


def decode_sglang(text: str, num_hidden_layers: int, top_k: int, dtype: str | None = None) -> np.ndarray:
    """int64[n, Lh, k] physical slots from an SGLang routed_experts string (dtype: the sender's wire dtype)."""
    name = (dtype or "int32").strip().lower()
    if name not in SGLANG_WIRE_DTYPES:
        raise TraceError(f"routed_experts_dtype {dtype!r} is not one of {sorted(SGLANG_WIRE_DTYPES)}.")
    raw = _b64(text, "SGLang routed_experts")
    itemsize, row = SGLANG_WIRE_DTYPES[name].itemsize, num_hidden_layers * top_k
    if len(raw) % (itemsize * row):
        raise TraceError(
            f"SGLang routed_experts holds {len(raw)} bytes, not a whole number of [{num_hidden_layers} layers x "
            f"top-{top_k}] {name} rows; check the model (num_hidden_layers, num_experts_per_tok)."
        )
    return np.frombuffer(raw, dtype=SGLANG_WIRE_DTYPES[name]).astype(np.int64).reshape(-1, num_hidden_layers, top_k)


def decode_vllm(text: str) -> np.ndarray:
    """int64[n, Lh, k] logical experts from a vLLM routed_experts string (base64 .npy, read without pickle)."""
    raw = _b64(text, "vLLM routed_experts")
    try:
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise TraceError(f"vLLM routed_experts is not a readable .npy payload ({e}).") from e
    if not isinstance(array, np.ndarray) or array.ndim != 3 or array.dtype.kind not in "iu":
        raise TraceError(f"vLLM routed_experts must be an integer [tokens, layers, top_k] array, got {getattr(array, 'shape', '?')}.")
    return array.astype(np.int64)


def moe_columns(routed_nLhk: np.ndarray, moe_layer_ids: tuple[int, ...], num_hidden_layers: int) -> np.ndarray:
    """int64[n, L, k] the MoE layers of a [n, Lh, k] payload (a payload with exactly L layers is taken as is)."""
    layers = routed_nLhk.shape[1]
    if layers == num_hidden_layers:
        return routed_nLhk[:, list(moe_layer_ids)]
    if layers == len(moe_layer_ids):
        return routed_nLhk
    raise TraceError(
        f"routed experts cover {layers} layers but the model has {num_hidden_layers} layers, {len(moe_layer_ids)} "
        "of them MoE; the server runs another model."
    )


def physical_to_logical(physical_nLk: np.ndarray, rows_LP: np.ndarray) -> np.ndarray:
    """int64[n, L, k] logical experts of physical slots (-1 stays -1); rows_LP int[L, P] the served map."""
    physical = np.asarray(physical_nLk, dtype=np.int64)
    num_slots = rows_LP.shape[1]
    if physical.size and (physical.max() >= num_slots or physical.min() < -1):
        bad = int(physical.max() if physical.max() >= num_slots else physical.min())
        raise TraceError(f"physical expert id {bad} is outside 0..{num_slots - 1} of the served placement.")
    layer = np.broadcast_to(np.arange(rows_LP.shape[0])[None, :, None], physical.shape)
    return np.where(physical >= 0, rows_LP[layer, np.maximum(physical, 0)], -1)


# ---- recorder dumps ------------------------------------------------------------------------------------------


@dataclass
class RecorderSequences:
    """Prefill sequences rebuilt from per_token dumps: token_ids[i] int64[n_i], physical[i] int64[n_i, Lh, 8]."""

    token_ids: list[np.ndarray]
    physical: list[np.ndarray]
    physical_to_logical: np.ndarray  # int64[Lh, P] the map the server reported using
    skipped_passes: int  # decode / mixed passes (their tokens cannot be attributed to requests)
    orphan_chunks: int  # chunked-prefill continuations whose first chunk is not in the dumps


def _load_dump(path: Path) -> dict:
    import torch

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a garbled file raises struct.error, EOFError, UnpicklingError, ...
        raise TraceError(f"{path} is not a readable recorder dump under weights_only loading ({type(e).__name__}).") from e
    if not isinstance(data, dict) or "records" not in data or "last_physical_to_logical_map" not in data:
        raise TraceError(
            f"{path} is not a per_token/per_pass recorder dump (no 'records' / 'last_physical_to_logical_map'); "
            "launch SGLang with --expert-distribution-recorder-mode per_token."
        )
    return data


def _served_rows(data: dict, path: Path) -> np.ndarray:
    import torch

    rows = data["last_physical_to_logical_map"]
    rows = np.asarray(rows.numpy() if isinstance(rows, torch.Tensor) else rows)
    if rows.ndim != 2 or rows.dtype.kind not in "iu":
        raise TraceError(f"{path}: last_physical_to_logical_map is not an int[layers, slots] array.")
    return rows.astype(np.int64)


def read_served_map(paths: list[Path]) -> np.ndarray:
    """int64[Lh, P] the physical_to_logical map recorder dumps (any mode but stat) say the server used."""
    maps = [_served_rows(_load_dump(Path(path)), Path(path)) for path in paths]
    if not maps:
        raise TraceError("no recorder dump given.")
    if any(not np.array_equal(maps[0], other) for other in maps[1:]):
        raise TraceError("the dumps report different physical_to_logical maps; dump all ranks at once.")
    return maps[0]


def read_recorder_dumps(paths: list[Path]) -> RecorderSequences:
    """Rebuild the prefill sequences of per_token dump files (one per rank).

    Extend passes are split by extend_seq_lens; a chunk starting at position 0 opens a sequence, a later chunk
    continues the newest open sequence of the same rank that has exactly `position` tokens. Identical records
    seen on several ranks (Attention-TP repeats every batch on every rank) count once. Decode passes are left
    out (`skipped_passes`): they carry no request identity.
    """
    import torch

    if not paths:
        raise TraceError("no recorder dump given.")
    token_ids: list[list[np.ndarray]] = []
    physical: list[list[np.ndarray]] = []
    open_by_rank: dict[int, list[int]] = {}
    lengths: list[int] = []
    seen: set = set()
    served = None
    skipped = orphans = 0
    for path in paths:
        data = _load_dump(Path(path))
        rows = _served_rows(data, Path(path))
        if served is None:
            served = rows
        elif not np.array_equal(served, rows):
            raise TraceError(f"{path} reports another physical_to_logical map than the first dump; dump all ranks at once.")
        records = data["records"] if isinstance(data["records"], list) else []
        for index, record in enumerate(records):
            try:
                topk = record["topk_ids_of_layer"]
                ids = np.asarray(record["input_ids"], dtype=np.int64)
                positions = np.asarray(record["positions"], dtype=np.int64)
                seq_lens = record.get("extend_seq_lens")
                rank = int(record.get("rank", 0))
                topk = np.asarray(topk.numpy() if isinstance(topk, torch.Tensor) else topk, dtype=np.int64)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise TraceError(f"{path} record {index} is not a per_token record ({e}); was the mode per_token?") from e
            if topk.ndim != 3 or topk.shape[1] != len(ids) or len(positions) != len(ids):
                raise TraceError(
                    f"{path} record {index}: topk_ids_of_layer {topk.shape} does not match its {len(ids)} input ids."
                )
            if not seq_lens or int(np.sum(seq_lens)) != len(ids):
                skipped += 1
                continue
            key = (record.get("forward_pass_id"), ids.tobytes(), topk.tobytes())
            if key in seen:
                continue
            seen.add(key)
            starts = np.concatenate([[0], np.cumsum(seq_lens)[:-1]]).astype(np.int64)
            for start, length in zip(starts.tolist(), list(seq_lens), strict=True):
                chunk_ids, chunk_topk = ids[start : start + length], topk[:, start : start + length].transpose(1, 0, 2)
                first = int(positions[start]) if length else 0
                if first == 0:
                    open_by_rank.setdefault(rank, []).append(len(token_ids))
                    token_ids.append([chunk_ids])
                    physical.append([chunk_topk])
                    lengths.append(int(length))
                    continue
                target = next((s for s in reversed(open_by_rank.get(rank, [])) if lengths[s] == first), None)
                if target is None:
                    orphans += 1
                    continue
                token_ids[target].append(chunk_ids)
                physical[target].append(chunk_topk)
                lengths[target] += int(length)
    return RecorderSequences(
        [np.concatenate(parts) for parts in token_ids], [np.concatenate(parts) for parts in physical],
        served, skipped, orphans,
    )


def recorder_top_k(physical_nLk: np.ndarray) -> int:
    """Experts per token of recorder rows (the dump pads top-k to 8 with -1): the count of filled columns."""
    filled = physical_nLk >= 0
    counts = filled.sum(axis=2)
    k = int(counts.max()) if counts.size else 0
    if k == 0 or np.any(counts != k) or np.any(filled[:, :, k:]):
        raise TraceError("recorder rows do not all hold the same number of experts in their first columns; "
                         "the dump mixes models or shared-expert fusion was on (disable it for recording).")
    return k
