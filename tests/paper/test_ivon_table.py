"""paper_tables.ivon_table: the quick target runs every arm of both blocks and writes its table (shortened for CI)."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn not installed")


def _short(monkeypatch, epochs: int = 3):
    from paper_tables import ivon_table

    quick = ivon_table._settings(True)
    short = quick | {"seeds": 1, "epochs": epochs, "predict": 4, "lstm": quick["lstm"] | {"epochs": 1, "predict": 2}}
    monkeypatch.setattr(ivon_table, "_settings", lambda q: short)
    return ivon_table


def test_ivon_table_quick_writes_every_arm(tmp_path, monkeypatch):
    ivon_table = _short(monkeypatch)
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


def test_the_lstm_block_trains_every_arm_that_can_train_an_lstm(tmp_path, monkeypatch):
    ivon_table = _short(monkeypatch, epochs=1)
    data = ivon_table.run(tmp_path, quick=True, seed=0)
    lstm = {r["arm"]: r for r in data["rows"]["lstm_runs"]}
    assert set(lstm) == set(ivon_table.ARMS)
    scored = {a for a, r in lstm.items() if "test" in r}
    have_ref = importlib.util.find_spec("ivon") is not None
    assert {"adam", "ivon", "vogn", "bbb", "mc_dropout"} <= scored and (("ivon_opt" in scored) == have_ref)
    assert lstm["adam"]["steps"] == 8 and lstm["adam"]["features"] == 8  # digits read by rows
    # the Bayesian LSTM holds a mean and a scale per weight
    assert lstm["bbb"]["parameters"] > 1.9 * lstm["adam"]["parameters"]
    assert set(data["rows"]["lstm_step_times"]["arms"]) == scored
    md = (tmp_path / "ivon_table.md").read_text()
    assert "An LSTM on digits read by rows" in md and "The table: LSTM" in md
    assert "LSTM: IVON (mcgraph) vs Adam" in md


def test_an_optimiser_that_refuses_the_lstm_is_reported_with_its_error(tmp_path, monkeypatch):
    ivon_table = _short(monkeypatch, epochs=1)
    built = ivon_table._lstm_stepper

    def refusing(arm, *args):
        if arm == "vogn":
            raise TypeError("model: VOGN does not support lstm (LSTM)")
        return built(arm, *args)

    monkeypatch.setattr(ivon_table, "_lstm_stepper", refusing)
    data = ivon_table.run(tmp_path, quick=True, seed=0)
    vogn = next(r for r in data["rows"]["lstm_runs"] if r["arm"] == "vogn")
    assert "test" not in vogn and "does not support" in vogn["missing"]
    assert "vogn" not in data["rows"]["lstm_step_times"]["arms"]
    assert "VOGN (defaults) cannot train the LSTM" in (tmp_path / "ivon_table.md").read_text()


def test_retime_rewrites_the_step_times_from_the_recorded_runs(tmp_path, monkeypatch):
    ivon_table = _short(monkeypatch, epochs=1)
    first = ivon_table.run(tmp_path, quick=True, seed=0)
    monkeypatch.setattr(ivon_table, "run_arm", None)  # retiming must not train: a call would raise
    monkeypatch.setattr(ivon_table, "run_lstm_arm", None)
    again = ivon_table.retime(tmp_path, reps=3)
    for block in ("step_times", "lstm_step_times"):
        assert again["rows"][block]["reps"] == 3
        assert set(again["rows"][block]["arms"]) == set(first["rows"][block]["arms"])
    assert again["rows"]["runs"] == first["rows"]["runs"]
    assert json.loads((tmp_path / "ivon_table.json").read_text())["rows"]["step_times"]["reps"] == 3


def test_runs_recorded_in_the_json_are_reused_without_their_caches(tmp_path, monkeypatch):
    ivon_table = _short(monkeypatch, epochs=1)
    first = ivon_table.run(tmp_path, quick=True, seed=0)
    shutil.rmtree(tmp_path / "ivon_table_runs")  # the training caches are gone, the JSON is not

    def no_training(*args):
        raise AssertionError("a recorded run was trained again")

    monkeypatch.setattr(ivon_table, "run_arm", no_training)
    monkeypatch.setattr(ivon_table, "run_lstm_arm", lambda arm, *a: (_ for _ in ()).throw(AssertionError(arm))
                        if arm != "vogn" else {"arm": arm, "missing": "unscored rows are run again"})
    again = ivon_table.run(tmp_path, quick=True, seed=0)
    scored = lambda rows: {r["arm"]: r["test"] for r in rows if "test" in r}  # noqa: E731
    assert scored(again["rows"]["runs"]) == scored(first["rows"]["runs"])
    assert scored(again["rows"]["lstm_runs"]) == scored(first["rows"]["lstm_runs"])


def test_step_times_refuses_a_bad_number_of_rounds_or_block():
    from paper_tables import ivon_table

    with pytest.raises(ValueError, match="reps"):
        ivon_table.step_times(ivon_table._settings(True), reps=0)
    with pytest.raises(ValueError, match="block"):
        ivon_table.step_times(ivon_table._settings(True), block="resnet")
    assert ivon_table.step_times(ivon_table._settings(True), arms=[])["arms"] == {}
