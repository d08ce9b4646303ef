"""ShareGPT (e.g. ShareGPT_V3_unfiltered_cleaned_split.json): prompt = the first human turn.

File layout: a JSON list of `{"id", "conversations": [{"from": "human" | "gpt" | ..., "value": str}]}`.
Conversations without any human turn (real dumps have a few, e.g. empty ones) are skipped, not errors;
structural problems (not a list, a record without `conversations`, a turn without `from`/`value`) are errors
naming the file and the record.
Label: the record's `label_field` if given (every record must have it), else "sharegpt".
"""

from __future__ import annotations

from repro.errors import WorkloadError
from repro.workloads.sources import RawPrompts, read_json, require_offline_source, require_path, text_field

EXAMPLE_PATH = "/data/ShareGPT_V3_unfiltered_cleaned_split.json"
USER_ROLES = ("human", "user")  # "user" appears in some re-exports of ShareGPT


def load_sharegpt(*, source: str = "offline", path: str | None = None, split: str = "train",
                  label_field: str | None = None, num_requests: int | None = None) -> RawPrompts:
    """First human turn of each conversation, in file order; `split` and `num_requests` are unused."""
    del split, num_requests
    require_offline_source("sharegpt", source)
    file = require_path("sharegpt", path, EXAMPLE_PATH)
    records = read_json(file)
    if not isinstance(records, list):
        raise WorkloadError(f"{file} holds a JSON {type(records).__name__}; a ShareGPT file is a JSON list of "
                            "{'id', 'conversations'} objects.")
    ids, texts, labels = [], [], []
    for index, record in enumerate(records):
        where = f"{file} record {index}"
        if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
            raise WorkloadError(f"{where} is not an object with a 'conversations' list; a ShareGPT record is "
                                "{'id', 'conversations': [{'from', 'value'}]}.")
        first_user_turn = None
        for turn_no, turn in enumerate(record["conversations"]):  # stops at the first human turn (index ~0)
            if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
                raise WorkloadError(f"{where} turn {turn_no} is not an object with 'from' and 'value'.")
            if turn["from"] in USER_ROLES:
                first_user_turn = text_field(turn, "value", f"{where} turn {turn_no}")
                break
        if first_user_turn is None:
            continue
        record_id = str(record.get("id", f"record{index}"))
        ids.append(record_id)
        texts.append(first_user_turn)
        labels.append(text_field(record, label_field, where) if label_field else "sharegpt")
    return RawPrompts(ids=ids, texts=texts, labels=labels)
