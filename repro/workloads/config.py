"""The workload group's config check (conf/workload/*.yaml, also eval_workload / train_workload): every key known,
each value of the type and range load_workload takes, cross-field rules; repro.config_schema composes it."""

from __future__ import annotations

from repro.config_values import FLAG, Value, _is_int, check_table, integer, number, option_keys, text, top_keys
from repro.errors import ConfigError

WORKLOAD = {  # load_workload's arguments
    "name": text(),
    "source": text(("offline", "hub")),
    "split": text(),
    "num_requests": integer(1, null=True),
    "balanced": FLAG,
    "max_prompt_len": integer(1),
    "min_prompt_len": integer(1),
    "output_len": Value(("int", "list"), low=0),
    "request_rate": number(0),
    "path": text(null=True),
    "label_field": text(null=True),
    "input_len": integer(1, null=True),
    "input_len_lognormal": Value(("list", "null")),  # [median, p99] tokens: heavy-tailed packed lengths
    "segments": Value(("list", "null")),  # workload=drift: [{workload, requests}, ...] (repro.workloads.drift)
    "mix": Value(("list", "null")),  # workload=drift: sources of the periodic mix
    "period": integer(2, null=True),  # workload=drift: requests per period of the mix
}


def check_workload(group: str, workload: dict) -> None:
    from repro.workloads.registry import COMPOSED_WORKLOADS, WORKLOADS

    check_table(group, workload, WORKLOAD, top_keys(option_keys("workload")))
    names = sorted(WORKLOADS) + list(COMPOSED_WORKLOADS)
    if workload.get("name") not in names:
        raise ConfigError(f"{group}.name={workload.get('name')!r} is not a workload; choose one of {names}.")
    if workload.get("name") == "drift":
        from repro.workloads.drift import check_drift_schedule

        check_drift_schedule(workload.get("segments"), workload.get("mix"), workload.get("period"),
                             workload.get("num_requests"))
    elif any(workload.get(key) is not None for key in ("segments", "mix", "period")):
        raise ConfigError(f"{group}.segments, mix and period belong to workload 'drift', not {workload.get('name')!r}; "
                          "set them to null.")
    out = workload.get("output_len", 0)
    if isinstance(out, list | tuple) and not (len(out) == 2 and all(_is_int(v) for v in out) and 0 <= out[0] <= out[1]):
        raise ConfigError(f"{group}.output_len must be an integer >= 0 or a range [lo, hi] with 0 <= lo <= hi, got {out!r}.")
    if workload.get("min_prompt_len", 1) > workload.get("max_prompt_len", 1024):
        raise ConfigError(
            f"{group}.min_prompt_len={workload['min_prompt_len']} exceeds max_prompt_len={workload['max_prompt_len']}; "
            "lower min_prompt_len or raise max_prompt_len."
        )
