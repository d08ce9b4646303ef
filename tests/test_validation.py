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


# ---- eplb_rearrangement rows (issue 34): the stall of a synchronous rearrangement ------------------------------

REARRANGEMENTS = [r for r in ROWS if r["kind"] == "eplb_rearrangement"]


def test_the_per_layer_overhead_is_fitted_on_one_in_sample_row_and_tested_on_the_others():
    fitted = [r for r in REARRANGEMENTS if r["layer_overhead"] == "fit"]
    assert len(fitted) == 1 and fitted[0]["in_sample"] is True
    predicted, details = resimulate(fitted[0], ROWS)
    assert predicted == pytest.approx(fitted[0]["measured"], rel=1e-12)  # fitted: error 0 by construction
    # the fit: (measured - transfers) / layers that move
    assert details["layer_overhead_s"] == pytest.approx((0.26 - details["transfer_s"]) / 26, rel=1e-12)
    others = [r for r in REARRANGEMENTS if r["layer_overhead"] != "fit"]
    assert others and not any(r["in_sample"] for r in others)
    for row in others:
        predicted, more = resimulate(row, ROWS)
        assert more["layer_overhead_s"] == details["layer_overhead_s"]
        assert predicted == pytest.approx(more["transfer_s"] + more["layers"] * more["layer_overhead_s"], rel=1e-12)


def test_the_fitted_overhead_is_the_fitting_rows():
    from repro.sim.validation import fitted_layer_overhead_s

    fitted = next(r for r in REARRANGEMENTS if r["layer_overhead"] == "fit")
    assert fitted_layer_overhead_s() == resimulate(fitted, ROWS)[1]["layer_overhead_s"] > 0


def test_rearrangement_placements_move_the_stated_share_of_slots():
    from repro.sim.validation import rearrangement_placements

    old, new = rearrangement_placements(3, 8, 4, 4, 0.5, np.random.default_rng(0))
    assert old.physical_to_logical.shape == (3, 12)
    changed = (old.physical_to_logical != new.physical_to_logical).sum(axis=1)
    assert np.all(changed <= 6) and np.all(changed >= 4)  # 6 slots shifted; a shift onto an equal expert changes nothing
    assert np.array_equal(np.sort(old.physical_to_logical, axis=1), np.sort(new.physical_to_logical, axis=1))


@pytest.mark.parametrize("change, message", [
    ({"moved_fraction": 1.5}, "moved_fraction must be a share"),
    ({"redundant_experts": -1}, "redundant_experts must be an integer >= 0"),
    ({"bytes_per_weight": 0}, "bytes_per_weight must be a finite positive number"),
    ({"layer_overhead": "nobody"}, "layer_overhead must be 'fit' or the id"),
    ({"in_sample": False}, "fits the per-layer overhead is in-sample"),
    ({"unit": "ms"}, "is measured in s"),
])
def test_bad_rearrangement_rows_are_one_sentence(tmp_path, change, message):
    fitted = next(r for r in REARRANGEMENTS if r["layer_overhead"] == "fit")
    with pytest.raises(ConfigError, match=message):
        load_table(_write(tmp_path, [dict(fitted, **change)]))


def test_a_rearrangement_row_whose_profile_lacks_its_ranks_is_refused(tmp_path):
    fitted = next(r for r in REARRANGEMENTS if r["layer_overhead"] == "fit")
    row = dict(fitted, ep=16)  # h100 has 8 devices
    rows = load_table(_write(tmp_path, [row]))
    with pytest.raises(ConfigError, match="must split over ep=16 ranks, and the profile must have 16 devices"):
        resimulate(rows[0], rows)
