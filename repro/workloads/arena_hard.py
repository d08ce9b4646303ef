"""Arena-hard-auto (Apache-2.0): real Chatbot Arena prompts with topic labels, the offline LMSYS stand-in.

Reads a question JSONL in either layout:
- the one under ../shared/data/arena-hard: `{"uid", "category", "cluster" (v0.1) | "subcategory" (v2.0), "prompt"}`;
- upstream lmarena/arena-hard-auto: `{"question_id", "category", "cluster", "turns": [{"content"}]}`.
Label: `label_field` if given, else "cluster" when the record has it, else "subcategory", else "category".
"""

from __future__ import annotations

from repro.errors import WorkloadError
from repro.workloads.sources import RawPrompts, read_jsonl, require_offline_source, require_path, text_field

EXAMPLE_PATH = "../shared/data/arena-hard/v0.1-question.jsonl"
DEFAULT_LABEL_FIELDS = ("cluster", "subcategory", "category")


def load_arena_hard(*, source: str = "offline", path: str | None = None, split: str = "test",
                    label_field: str | None = None, num_requests: int | None = None) -> RawPrompts:
    """Every question of an arena-hard question.jsonl, in file order; `split` and `num_requests` are unused."""
    del split, num_requests
    require_offline_source("arena_hard", source)
    file = require_path("arena_hard", path, EXAMPLE_PATH)
    ids, texts, labels = [], [], []
    for line_no, record in read_jsonl(file):
        where = f"{file} line {line_no}"
        if "prompt" in record:
            text = text_field(record, "prompt", where)
        elif isinstance(record.get("turns"), list) and record["turns"] and isinstance(record["turns"][0], dict):
            text = text_field(record["turns"][0], "content", f"{where} turns[0]")
        else:
            raise WorkloadError(f"{where} has neither a 'prompt' string nor 'turns': [{{'content': ...}}]; "
                                "it is not an arena-hard question record.")
        field = label_field or next((key for key in DEFAULT_LABEL_FIELDS if key in record), None)
        if field is None:
            raise WorkloadError(f"{where} has none of the label fields {list(DEFAULT_LABEL_FIELDS)}; "
                                "set label_field to one of its fields.")
        ids.append(str(record.get("uid", record.get("question_id", f"line{line_no}"))))
        texts.append(text)
        labels.append(text_field(record, field, where))
    return RawPrompts(ids=ids, texts=texts, labels=labels)
