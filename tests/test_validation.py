"""conf/validation/published.yaml: the table parses, every row re-simulates, in-sample rows are flagged."""

from pathlib import Path

import numpy as np
import pytest
import yaml

from repro.errors import ConfigError
from repro.sim.validation import TABLE, error_summary, load_table, resimulate

ROWS = load_table(TABLE)


def test_table_parses_with_both_kinds_of_rows():
    assert len({r["id"] for r in ROWS}) == len(ROWS)
    assert any(r["in_sample"] for r in ROWS) and any(not r["in_sample"] for r in ROWS)
    assert all(r["source"].strip() and r["setting"].strip() for r in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_every_row_resimulates(row):
    predicted, details = resimulate(row)
    assert np.isfinite(predicted) and predicted > 0
    assert isinstance(details, dict)


def test_error_summary_splits_in_and_out_of_sample():
    rows = [dict(r, predicted=r["measured"] * 1.1, error=0.1) for r in ROWS]
    summary = error_summary(rows)
    assert summary["in_sample"]["rows"] + summary["out_of_sample"]["rows"] == len(ROWS)
    assert summary["out_of_sample"]["median_abs_error"] == pytest.approx(0.1)


def _write(tmp_path: Path, rows) -> Path:
    path = tmp_path / "table.yaml"
    path.write_text(yaml.safe_dump({"rows": rows}))
    return path


@pytest.mark.parametrize("change, message", [
    ({"kind": "guess"}, "kind must be one of"),
    ({"in_sample": "yes"}, "in_sample must be true or false"),
    ({"unit": "ms"}, "is measured in us"),
    ({"measured": 0}, "measured must be a finite positive number"),
])
def test_bad_rows_are_one_sentence(tmp_path, change, message):
    row = dict(next(r for r in ROWS if r["kind"] == "nccl_alltoall"), **change)
    with pytest.raises(ConfigError, match=message):
        load_table(_write(tmp_path, [row]))


def test_missing_field_and_duplicate_id(tmp_path):
    row = next(r for r in ROWS if r["kind"] == "nccl_alltoall")
    with pytest.raises(ConfigError, match="misses field"):
        load_table(_write(tmp_path, [{k: v for k, v in row.items() if k != "size_bytes"}]))
    with pytest.raises(ConfigError, match="appears twice"):
        load_table(_write(tmp_path, [row, row]))
