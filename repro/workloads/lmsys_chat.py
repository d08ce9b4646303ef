"""LMSYS-Chat-1M: real chatbot conversations; prompt = first user turn; label = language (or model).

source="hub": streams the gated HF dataset `lmsys/lmsys-chat-1m` (split train) with HF_TOKEN; it stops after
`scan_limit(num_requests)` conversations so a workload of a few thousand requests does not read a million.
source="offline": a local JSONL export with the hub's fields (`conversation_id`, `conversation`: [{"role",
"content"}], `language`, `model`) passed as path=; without one, use workload arena_hard (same population).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from repro.errors import ConfigError, DataUnavailableError, WorkloadError
from repro.workloads.sources import RawPrompts, hub_unreachable, read_jsonl, require_hub, require_path, text_field

REPO = "lmsys/lmsys-chat-1m"
OFFLINE_ALTERNATIVE = ("workload=arena_hard with path=../shared/data/arena-hard/v0.1-question.jsonl, "
                       "workload=sharegpt with a local ShareGPT JSON, or source=offline with a local JSONL export")


def scan_limit(num_requests: int | None) -> int:
    """Conversations to stream from the hub: 10x the request count (room for filtering and balancing), >= 10k."""
    return 100_000 if num_requests is None else max(10 * num_requests, 10_000)


def _records_to_prompts(records: Iterable[tuple[str, dict]], label_field: str) -> RawPrompts:
    ids, texts, labels = [], [], []
    for where, record in records:
        conversation = record.get("conversation")
        if not isinstance(conversation, list):
            raise WorkloadError(f"{where} has no 'conversation' list; an LMSYS-Chat-1M record is "
                                "{'conversation_id', 'conversation': [{'role', 'content'}], 'language', 'model'}.")
        first_user_turn = next((turn for turn in conversation
                                if isinstance(turn, dict) and turn.get("role") == "user"), None)
        if first_user_turn is None:
            continue  # nothing the user said: no prompt to serve
        ids.append(str(record.get("conversation_id", where)))
        texts.append(text_field(first_user_turn, "content", f"{where} first user turn"))
        labels.append(text_field(record, label_field, where))
    return RawPrompts(ids=ids, texts=texts, labels=labels)


def load_lmsys_chat(*, source: str = "hub", path: str | None = None, split: str = "train",
                    label_field: str | None = None, num_requests: int | None = None) -> RawPrompts:
    """First user turn of each conversation; `split` is unused (the dataset has only "train")."""
    del split
    label_field = label_field or "language"
    if source == "offline":
        if path is None:
            raise DataUnavailableError(
                f"workload 'lmsys_chat' has no offline copy ({REPO} is gated and may not be redistributed); "
                f"use {OFFLINE_ALTERNATIVE}, or set source=hub with HF_TOKEN and network."
            )
        file = require_path("lmsys_chat", path, "/data/lmsys-chat-1m.jsonl")
        return _records_to_prompts(((f"{file} line {n}", r) for n, r in read_jsonl(file)), label_field)
    if source != "hub":
        raise ConfigError(f"lmsys_chat source must be 'hub' or 'offline', got {source!r}.")
    token = require_hub("lmsys_chat", REPO, gated=True, offline_alternative=OFFLINE_ALTERNATIVE)
    import datasets

    try:
        stream = datasets.load_dataset(REPO, split="train", token=token, streaming=True)
        records = list(itertools.islice(stream, scan_limit(num_requests)))
    except Exception as error:  # noqa: BLE001 - connection, HTTP 401/403 (terms not accepted), not found
        raise hub_unreachable("lmsys_chat", REPO, error, OFFLINE_ALTERNATIVE) from error
    return _records_to_prompts(((f"{REPO} row {n}", r) for n, r in enumerate(records)), label_field)
