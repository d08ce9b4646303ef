"""A Request: what a serving engine receives, before any routing or placement."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Request:
    """One prompt of a workload.

    token_ids int32[S]: the prompt tokenized with the real model tokenizer.
    label: the semantic class (MMLU subject, arena-hard cluster, chat language, ...).
    output_len: tokens the request will generate; arrival_time: seconds since the workload start.
    """

    id: str
    dataset: str
    label: str
    token_ids: np.ndarray
    output_len: int = 0
    arrival_time: float = 0.0
    text: str = ""

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids)
