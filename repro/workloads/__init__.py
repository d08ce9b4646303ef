"""Workloads: real prompts (MMLU, LMSYS-Chat-1M, ShareGPT, arena-hard; ARC, HellaSwag, TriviaQA, NQ-open, basic
arithmetic; a drifting mix of them) tokenized with real model tokenizers.

    from repro.workloads import load_workload
    workload = load_workload("mmlu", tokenizer="mixtral", num_requests=570, balanced=True, request_rate=10.0)

Each Request carries id, dataset, class label, int32 token ids, output length and arrival time. This package
never routes or places anything.
"""

from repro.workloads.registry import (
    COMPOSED_WORKLOADS,
    WORKLOADS,
    Workload,
    balanced_quotas,
    draw_output_lens,
    load_workload,
    poisson_arrivals,
    sample_indices,
)
from repro.workloads.request import Request
from repro.workloads.sources import RawPrompts
from repro.workloads.tokenizers import TOKENIZERS, Tokenizer, load_tokenizer

__all__ = [
    "COMPOSED_WORKLOADS", "TOKENIZERS", "WORKLOADS", "RawPrompts", "Request", "Tokenizer", "Workload", "balanced_quotas",
    "draw_output_lens", "load_tokenizer", "load_workload", "poisson_arrivals", "sample_indices",
]
