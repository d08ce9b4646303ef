"""What every dataset loader returns, and the file / hub checks they share.

A loader turns one dataset into `RawPrompts` (ids, prompt texts, class labels; no tokens yet). Tokenizing,
filtering, sampling and timing are the same for every dataset and live in `registry.load_workload`.
Every problem with a file names the file and the line (JSONL) or the record (JSON list); every problem with
the hub names what is missing (network, HF_TOKEN) and the offline alternative.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from repro.errors import ConfigError, DataUnavailableError, WorkloadError
from repro.workloads.tokenizers import hub_offline


@dataclass(frozen=True)
class RawPrompts:
    """Prompts of one dataset before tokenization: three parallel lists of length R."""

    ids: list[str]
    texts: list[str]
    labels: list[str]

    def __post_init__(self):
        if not (len(self.ids) == len(self.texts) == len(self.labels)):
            raise WorkloadError(f"a loader returned {len(self.ids)} ids, {len(self.texts)} texts and "
                                f"{len(self.labels)} labels; they must have the same length (a bug in the loader).")

    def __len__(self) -> int:
        return len(self.ids)


def require_offline_source(dataset: str, source: str) -> None:
    """File-based datasets have no hub copy: anything but source='offline' is a config mistake."""
    if source != "offline":
        raise ConfigError(f"workload {dataset!r} reads a local file and supports only source='offline', "
                          f"got source={source!r}; set source=offline and path=<file>.")


def require_path(dataset: str, path: str | os.PathLike | None, example: str) -> Path:
    """The dataset file as a Path; a missing argument or file is one WorkloadError naming it."""
    if path is None or str(path).strip() in ("", "???"):
        raise WorkloadError(f"workload {dataset!r} needs path=<file>, e.g. path={example}.")
    file = Path(path).expanduser()
    if not file.is_file():
        raise WorkloadError(f"workload {dataset!r}: file {file} does not exist; pass path= an existing file, "
                            f"e.g. {example}.")
    return file


def read_jsonl(file: Path) -> Iterator[tuple[int, dict]]:
    """(1-based line number, record) for each non-blank line of a JSONL file; a bad line is a WorkloadError."""
    with open(file, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise WorkloadError(f"{file} line {line_no} is not valid JSON ({error.msg} at column "
                                    f"{error.colno}); fix or delete that line.") from None
            if not isinstance(record, dict):
                raise WorkloadError(f"{file} line {line_no} is a JSON {type(record).__name__}, not an object; "
                                    "each line must be one JSON object.")
            yield line_no, record


def read_json(file: Path) -> object:
    """The parsed JSON document; a parse error is a WorkloadError with the line and column."""
    try:
        with open(file, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise WorkloadError(f"{file} is not valid JSON: {error.msg} at line {error.lineno} column "
                            f"{error.colno}.") from None
    except UnicodeDecodeError as error:
        raise WorkloadError(f"{file} is not UTF-8 text (byte {error.start}); pass a JSON file.") from None


def text_field(record: dict, key: str, where: str) -> str:
    """record[key] as a string; missing or non-string values name `where` (file and line/record)."""
    if key not in record:
        raise WorkloadError(f"{where} has no field {key!r} (fields: {sorted(record)}); "
                            "fix the record or choose another label_field.")
    value = record[key]
    if not isinstance(value, str):
        if isinstance(value, (int, float, bool)):
            return str(value)  # numeric labels (e.g. an answer index) are fine as class names
        raise WorkloadError(f"{where}: field {key!r} is a {type(value).__name__}, expected a string.")
    return value


def require_hub(dataset: str, repo: str, *, gated: bool, offline_alternative: str) -> str | None:
    """Check, without touching the network, that the HF hub may be used; returns HF_TOKEN (None if unset).

    Order: a gated repo without HF_TOKEN fails first (the token is the thing to fix even when online), then
    HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE.
    """
    token = os.environ.get("HF_TOKEN") or None
    if gated and token is None:
        raise DataUnavailableError(
            f"workload {dataset!r} streams the gated HF dataset {repo}, which needs the environment variable "
            f"HF_TOKEN (after accepting its terms on huggingface.co) and network; offline, use {offline_alternative}."
        )
    if hub_offline():
        raise DataUnavailableError(
            f"workload {dataset!r} with source=hub needs the HF hub ({repo}) but HF_HUB_OFFLINE is set; "
            f"unset it on a machine with network, or use {offline_alternative}."
        )
    return token


def hub_unreachable(dataset: str, repo: str, error: Exception, offline_alternative: str) -> DataUnavailableError:
    """The error to raise when a hub request failed (no network, refused, unauthorised)."""
    return DataUnavailableError(
        f"workload {dataset!r} could not read {repo} from the HF hub ({type(error).__name__}: "
        f"{str(error).splitlines()[0][:160] if str(error) else 'no detail'}); check the network and HF_TOKEN, "
        f"or use {offline_alternative}."
    )
