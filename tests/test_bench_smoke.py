"""Every bench/bench_*.py runs in quick mode through `python -m bench` and writes its result file.

gpu_check needs CUDA and is not a bench_ module; the benchmarks' numbers are not checked here (they are
measurements), only that each one runs to the end and records `ok` with its results.
"""

import json

import pytest

from bench.__main__ import GROUPS, discover, main

# `--only <group>` runs each of the group's benchmarks: a member of a group is run (and checked) with it, once
GROUPED = {member for group, members in GROUPS.items() for member in members if member != group}


@pytest.mark.slow  # ~15-95 s each on the shared 2-core machine; still part of make test
@pytest.mark.parametrize("name", [n for n in discover() if n not in GROUPED])
def test_bench_runs_quick_and_writes_its_result(name, tmp_path):
    assert main(["--only", name, "--quick", "--out", str(tmp_path)]) == 0
    for ran in GROUPS.get(name, [name]):
        record = json.loads((tmp_path / f"{ran}.json").read_text())
        assert record["ok"] and record["quick"] and record["results"], record.get("error")
        assert f"## {ran} (quick" in (tmp_path / "SUMMARY.md").read_text()


def test_bench_rejects_an_unknown_name(tmp_path):
    assert main(["--only", "no_such_bench", "--out", str(tmp_path)]) == 2
    assert not (tmp_path / "SUMMARY.md").exists()
