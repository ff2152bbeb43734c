"""paper_tables.sequence_table: the learning-rate schedule, the seeds' mean learning curve, and a run stopped
by the deadline that resumes from its checkpoint to exactly the uninterrupted run's curve and scores."""

from __future__ import annotations

import math

import pytest
import torch

from paper_tables import common, curves, sequence_table


@pytest.fixture(autouse=True)
def _no_deadline():
    common.set_deadline(None)
    yield
    common.set_deadline(None)


def _settings(epochs: int = 3) -> dict:
    s = sequence_table._settings(True)
    s.update({"epochs": {"digits": epochs}, "eval_every": 1})
    return s


def test_learning_rate_is_constant_or_cosine_annealed_to_zero():
    s = {"lr": {"mnist": 0.01, "digits": 0.002}, "lr_schedule": "cosine"}
    assert sequence_table.learning_rate(s, "mnist", 0, 100) == pytest.approx(0.01)
    assert sequence_table.learning_rate(s, "mnist", 50, 100) == pytest.approx(0.005)
    assert sequence_table.learning_rate(s, "mnist", 75, 100) == pytest.approx(0.005 * (1 + math.cos(0.75 * math.pi)))
    assert sequence_table.learning_rate(s, "mnist", 100, 100) == pytest.approx(0.0, abs=1e-15)
    assert sequence_table.learning_rate(s, "digits", 0, 100) == pytest.approx(0.002)
    flat = {"lr": 0.003, "lr_schedule": "constant"}
    assert sequence_table.learning_rate(flat, "mnist1d", 99, 100) == 0.003
    with pytest.raises(ValueError, match="lr_schedule"):
        sequence_table.learning_rate({"lr": 0.1, "lr_schedule": "step"}, "mnist", 0, 10)


def test_mean_curve_averages_the_epochs_every_seed_reached():
    a = [{"epoch": 2, "accuracy": 0.5, "nll": 1.0}, {"epoch": 4, "accuracy": 0.7, "nll": 0.8}]
    b = [{"epoch": 2, "accuracy": 0.7, "nll": 0.6}]  # stopped by the budget after epoch 2
    assert sequence_table.mean_curve([a, b]) == [{"epoch": 2, "accuracy": pytest.approx(0.6),
                                                  "nll": pytest.approx(0.8)}]
    assert sequence_table.mean_curve([]) == []


def test_stuck_at_chance_means_every_point_of_the_curve_near_chance():
    def run(*accuracies):
        return {"curve": [{"epoch": i + 1, "accuracy": a} for i, a in enumerate(accuracies)]}

    assert sequence_table.stuck_at_chance(run(0.09, 0.12, 0.1))
    assert not sequence_table.stuck_at_chance(run(0.09, 0.5, 0.1))  # it learned, then fell back
    assert not sequence_table.stuck_at_chance(run())  # no curve: nothing to judge
    assert sequence_table.stuck_at_chance(run(0.3, 0.31), chance=0.3)


def _without_times(row: dict) -> dict:
    return [{k: v for k, v in p.items() if k != "train_seconds"} for p in row["curve"]]


@pytest.mark.parametrize("arm", ["bayes_lstm", "mc_dropout"])
def test_a_run_stopped_by_the_deadline_resumes_to_the_uninterrupted_result(arm, tmp_path, monkeypatch, one_thread):
    """The weight draws (seeded per step) and the dropout masks (torch's global generator, kept in the checkpoint)
    continue where they stopped: the resumed run's curve and scores are the uninterrupted run's, bit for bit."""
    s = _settings()
    whole = sequence_table.run_arm(f"digits:{arm}", s, 0, tmp_path / "whole")
    assert whole["complete"] and whole["epochs_done"] == 3 and [p["epoch"] for p in whole["curve"]] == [1, 2, 3]
    assert (tmp_path / "whole" / f"digits-{arm}-seed0.json").is_file()

    checks = []
    monkeypatch.setattr(curves, "out_of_time", lambda: checks.append(1) or len(checks) > 1)  # after epoch 1
    stopped = sequence_table.run_arm(f"digits:{arm}", s, 0, tmp_path / "stopped")
    assert not stopped["complete"] and stopped["epochs_done"] == 1 and "test" in stopped  # scored where it stopped
    assert not (tmp_path / "stopped" / f"digits-{arm}-seed0.json").exists()  # cached only when complete
    monkeypatch.undo()
    torch.manual_seed(12345)  # as in a new process: the global generator is wherever it happens to be

    resumed = sequence_table.run_arm(f"digits:{arm}", s, 0, tmp_path / "stopped")
    assert resumed["complete"] and resumed["epochs_done"] == 3
    assert _without_times(resumed) == _without_times(whole)
    assert resumed["test"] == whole["test"] and resumed["ood"] == whole["ood"]
    assert resumed.get("kl_per_example") == whole.get("kl_per_example")
    assert ("kl_per_example" in whole) == (arm == "bayes_lstm")


def _one_seed_stopped_after(monkeypatch, epochs_in_all: int) -> None:
    """The quick table at one seed and 2 epochs per run, its deadline passing after ``epochs_in_all`` epochs."""
    s = _settings(epochs=2)
    s["seeds"] = 1
    monkeypatch.setattr(sequence_table, "_settings", lambda quick: s)
    checks = []
    monkeypatch.setattr(curves, "out_of_time", lambda: checks.append(1) or len(checks) > epochs_in_all)


def test_the_page_says_which_runs_stopped_early(tmp_path, monkeypatch, one_thread):
    from paper_tables.__main__ import main

    _one_seed_stopped_after(monkeypatch, epochs_in_all=1)
    assert main(["sequence_table", "--quick", "--out", str(tmp_path)]) == 0
    page = (tmp_path / "sequence_table.md").read_text()
    assert "reduced: 4 of 4 runs stopped by the budget" in page
    assert "| 1 of 2 |" in page and "| 0 of 2 |" in page  # the first arm trained one epoch, the others none


def test_complete_runs_recorded_in_the_json_are_reused_without_their_caches(tmp_path, monkeypatch, one_thread):
    import shutil

    _one_seed_stopped_after(monkeypatch, epochs_in_all=2)  # the first arm ends, the others do not start
    first = sequence_table.run(tmp_path, quick=True, seed=0)["rows"]["runs"]
    complete = [r["arm"] for r in first if r.get("complete")]
    assert complete == [first[0]["arm"]] and len(first) > 1
    shutil.rmtree(tmp_path / "sequence_table_runs")  # the training caches are gone, the JSON is not

    trained = []
    monkeypatch.setattr(sequence_table, "run_arm", lambda arm, s_, seed, runs_dir: trained.append(arm) or
                        {"key": "-", "dataset": "digits", "seed": seed, "epochs": 2, "seconds_per_epoch": None,
                         "missing": "digits: not trained in this test"})
    again = sequence_table.run(tmp_path, quick=True, seed=0)["rows"]["runs"]
    assert trained == [r["arm"] for r in first[1:]]  # the stopped runs train again, the complete one does not
    assert again[0]["cached"] and again[0]["test"] == first[0]["test"] and again[0]["curve"] == first[0]["curve"]
