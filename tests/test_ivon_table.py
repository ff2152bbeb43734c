"""paper_tables.ivon_table: the quick target runs every arm and writes its table (shortened for CI)."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn not installed")


def test_ivon_table_quick_writes_every_arm(tmp_path, monkeypatch):
    from paper_tables import ivon_table

    quick = ivon_table._settings(True)
    monkeypatch.setattr(ivon_table, "_settings", lambda q: quick | {"seeds": 1, "epochs": 3, "predict": 4})
    data = ivon_table.run(tmp_path, quick=True, seed=0)
    runs = data["rows"]["runs"]
    have_ref = importlib.util.find_spec("ivon") is not None
    assert {r["arm"] for r in runs} == set(ivon_table.ARMS)
    scored = {r["arm"] for r in runs if "test" in r}
    assert {"adam", "ivon", "vogn", "bbb"} <= scored and (("ivon_opt" in scored) == have_ref)
    assert all(0 <= r["test"]["accuracy"] <= 1 for r in runs if "test" in r)
    md = (tmp_path / "ivon_table.md").read_text()
    assert "IVON (mcgraph)" in md and "time per step / Adam" in md
    assert json.loads((tmp_path / "ivon_table.json").read_text())["target"] == "ivon_table"
    # the time column comes from one side-by-side pass over every scored arm, not from the training runs
    times = data["rows"]["step_times"]
    assert set(times["arms"]) == scored and times["reps"] == ivon_table.TIMING_REPS
    assert all(t["cpu_ms"] > 0 and t["wall_ms"] > 0 for t in times["arms"].values())
    ratios = ivon_table.step_ratios(times)
    assert ratios["adam"] == 1.0 and set(ratios) == scored
    assert "Time per step, side by side" in md and f"{ratios['ivon']:.2f}" in md


def test_retime_rewrites_the_step_times_from_the_recorded_runs(tmp_path, monkeypatch):
    from paper_tables import ivon_table

    quick = ivon_table._settings(True)
    monkeypatch.setattr(ivon_table, "_settings", lambda q: quick | {"seeds": 1, "epochs": 1, "predict": 2})
    first = ivon_table.run(tmp_path, quick=True, seed=0)
    monkeypatch.setattr(ivon_table, "run_arm", None)  # retiming must not train: a call would raise
    again = ivon_table.retime(tmp_path, reps=3)
    assert again["rows"]["step_times"]["reps"] == 3
    assert set(again["rows"]["step_times"]["arms"]) == set(first["rows"]["step_times"]["arms"])
    assert again["rows"]["runs"] == first["rows"]["runs"]
    assert json.loads((tmp_path / "ivon_table.json").read_text())["rows"]["step_times"]["reps"] == 3


def test_step_times_refuses_a_bad_number_of_rounds():
    from paper_tables import ivon_table

    with pytest.raises(ValueError, match="reps"):
        ivon_table.step_times(ivon_table._settings(True), reps=0)
