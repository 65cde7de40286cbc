"""The fitted step-time model against held-out end-to-end measurements (heldout.py).

These pin where the model stands today (docs/planner.md shows the table): a
change to the model or its constants that moves predictions away from the
measurements fails here.
"""
import pytest

from pdserve.planner import validate


@pytest.fixture(scope="module")
def rows():
    return validate.rows()


def test_roofline_is_a_lower_bound_on_every_measurement(rows):
    assert all(r["roofline_ratio"] < 1.0 for r in rows)
    assert all(r["predicted_s"] > r["predicted_s"] * r["roofline_ratio"] / r["ratio"] for r in rows)


def test_fitted_model_is_within_a_third_at_most_points_and_never_off_by_2x(rows):
    s = validate.summary(rows)
    assert s["points"] == 54
    assert 0.80 <= s["median"] <= 1.10
    assert s["in_band"] >= 38
    assert 0.45 <= s["min"] and s["max"] <= 1.40


def test_fitted_beats_the_roofline_everywhere(rows):
    for r in rows:
        assert abs(r["ratio"] - 1.0) < abs(r["roofline_ratio"] - 1.0), r


def test_tp2_points_are_all_within_the_band(rows):
    tp2 = [r for r in rows if r["tp"] == 2]
    assert len(tp2) == 16 and all(0.75 <= r["ratio"] <= 1.33 for r in tp2)


def test_the_table_lists_every_point(rows):
    assert validate.table(rows).count("\n") == len(rows) + 1
