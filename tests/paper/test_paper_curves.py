"""paper_tables.curves: long runs resume from their epoch checkpoint after SIGKILL or a deadline, and end
exactly where an uninterrupted run ends (same weights, same optimizer state, same curve)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from paper_tables import common, sparse_vd_table, vogn_table
from paper_tables.curves import train_epochs
from support.paths import ROOT



def _settings(epochs: int = 6, pretrain: int = 2) -> dict:
    s = sparse_vd_table._settings(True)
    s.update({"epochs": {"lenet300_100": epochs}, "pretrain": {"lenet300_100": pretrain},
              "warmup": {"lenet300_100": 2}, "eval_every": {"lenet300_100": 1}})
    return s


def _weights(runs_dir: Path) -> dict:
    ckpt = torch.load(runs_dir / "lenet300_100-sparse_vd-seed0.ckpt", weights_only=False)
    return ckpt["states"]


def _strip_times(curve):
    return [{k: v for k, v in point.items() if k != "train_seconds"} for point in curve]


@pytest.fixture(autouse=True)
def _no_deadline():
    common.set_deadline(None)
    yield
    common.set_deadline(None)



def test_sparse_vd_run_killed_with_sigkill_resumes_to_the_uninterrupted_result(tmp_path, one_thread):
    whole = sparse_vd_table.run_one("lenet300_100", "sparse_vd", _settings(), 0, tmp_path / "whole")
    assert whole["complete"] and whole["epochs_done"] == 6 and len(whole["curve"]) == 6

    runs = tmp_path / "killed"
    script = textwrap.dedent(f"""
        import sys, time, torch
        sys.path.insert(0, {str(ROOT)!r})
        torch.set_num_threads(1)
        from paper_tables import sparse_vd_table, curves
        s = sparse_vd_table._settings(True)
        s.update({{"epochs": {{"lenet300_100": 6}}, "pretrain": {{"lenet300_100": 2}},
                  "warmup": {{"lenet300_100": 2}}, "eval_every": {{"lenet300_100": 1}}}})
        original = curves.train_epochs
        def slow(path, key, objects, epochs, run_epoch, evaluate, **kw):
            def run_and_wait(e):
                run_epoch(e)
                time.sleep(0.3)
            return original(path, key, objects, epochs, run_and_wait, evaluate, **kw)
        curves.train_epochs = slow
        from pathlib import Path
        sparse_vd_table.run_one("lenet300_100", "sparse_vd", s, 0, Path({str(runs)!r}))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True, cwd=ROOT)
    for line in proc.stderr:  # kill it mid-schedule, after its third Sparse VD epoch was scored
        if "Sparse VD seed 0: epoch 3/6" in line:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    ckpt = torch.load(runs / "lenet300_100-sparse_vd-seed0.ckpt", weights_only=False)
    assert 2 <= ckpt["epochs_done"] < 6
    assert not (runs / "lenet300_100-sparse_vd-seed0.json").exists()  # the row is cached only when complete

    resumed = sparse_vd_table.run_one("lenet300_100", "sparse_vd", _settings(), 0, runs)
    assert resumed["complete"] and resumed["epochs_done"] == 6
    assert _strip_times(resumed["curve"]) == _strip_times(whole["curve"])
    assert resumed["error"] == whole["error"] and resumed["nonzero"] == whole["nonzero"]
    a, b = _weights(tmp_path / "whole"), _weights(runs)
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, rtol=0, atol=0, msg=name)
    assert torch.equal(a["data_order"], b["data_order"])
    assert a["optimizer"]["state"][0]["step"] == b["optimizer"]["state"][0]["step"]


def _sgd_epochs(calls: list, stop_after_first: bool = False):
    """A one-layer model, its SGD, and an epoch function that records its epoch in ``calls``."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def run_epoch(e):
        calls.append(e)
        opt.zero_grad()
        model(torch.ones(4, 3)).pow(2).mean().backward()
        opt.step()
        if stop_after_first:
            common.set_deadline(0)  # the deadline passes during epoch 0

    return {"model": model, "optimizer": opt}, run_epoch, lambda e: {"bias": float(model.bias.detach())}


def test_deadline_stops_after_an_epoch_and_the_next_call_continues(tmp_path):
    calls = []
    path = tmp_path / "run.ckpt"
    objects, run_epoch, evaluate = _sgd_epochs(calls, stop_after_first=True)
    first = train_epochs(path, "k", objects, 4, run_epoch, evaluate)
    assert calls == [0] and first["epochs_done"] == 1 and not first["complete"]
    common.set_deadline(None)
    fresh, run_rest, evaluate_fresh = _sgd_epochs(calls)  # a new process: fresh objects, state from the file
    second = train_epochs(path, "k", fresh, 4, run_rest, evaluate_fresh)
    assert calls == [0, 1, 2, 3] and second["complete"] and [p["epoch"] for p in second["curve"]] == [1, 2, 3, 4]
    assert second["curve"][0] == first["curve"][0]
    other = train_epochs(path, "other settings", fresh, 1, run_rest, lambda e: {})
    assert other["epochs_done"] == 1 and calls[-1] == 0  # another key starts again from epoch 0


def test_budget_minutes_zero_reports_the_epochs_reached(tmp_path, one_thread):
    from paper_tables.__main__ import main

    assert main(["sparse_vd_table", "--quick", "--budget-minutes", "0", "--out", str(tmp_path)]) == 0
    record = __import__("json").loads((tmp_path / "sparse_vd_table.json").read_text())
    runs = record["rows"]["runs"]
    assert runs and all(not r["complete"] and r["epochs_done"] == 0 for r in runs)
    assert "0 of 10" in (tmp_path / "sparse_vd_table.md").read_text()
    with pytest.raises(SystemExit, match="--budget-minutes"):
        main(["sparse_vd_table", "--quick", "--budget-minutes", "-1", "--out", str(tmp_path)])


def test_a_bayesian_arm_starts_from_the_original_of_its_own_settings(tmp_path, one_thread):
    s = _settings(epochs=1, pretrain=1)
    sparse_vd_table.run_one("lenet300_100", "sparse_vd", s, 0, tmp_path)
    longer = _settings(epochs=1, pretrain=2)  # other pretraining: a new original, never the old weights
    row = sparse_vd_table.run_one("lenet300_100", "sparse_vd", longer, 0, tmp_path)
    assert row["init"] == "original (2 epochs)" and row["complete"]
    assert len(list(tmp_path.glob("lenet300_100-original-seed0-*.pt"))) == 2
    with pytest.raises(ValueError, match="runs_dir"):
        sparse_vd_table.run_one("lenet300_100", "sparse_vd", s, 0, None)


def test_vogn_claim_is_read_at_the_last_epoch_both_curves_reached():
    adam = {"curve": [{"epoch": e, "accuracy": 0.98, "ece": 0.010} for e in (1, 2, 3, 4)]}
    vogn = {"curve": [{"epoch": 1, "accuracy": 0.97, "ece": 0.005}, {"epoch": 2, "accuracy": 0.975, "ece": 0.02}]}
    claim = vogn_table.claim_at_matched_epochs(adam, vogn)
    assert claim["epoch"] == 2 and claim["epochs_compared"] == 2 and claim["epochs_vogn_lower_ece"] == 1
    assert claim["accuracy_gap_pp"] == pytest.approx(-0.5) and not claim["holds"]  # ECE 0.02 > 0.01 at epoch 2
    assert vogn_table.claim_at_matched_epochs(adam, {"curve": []}) is None


@pytest.mark.parametrize("net, error, compression, expected", [
    ("lenet300_100", 1.95, 70.0, "reproduced"),
    ("lenet300_100", 2.10, 55.0, "reproduced within 0.18 pp error at 0.81× the seed's compression"),
    ("lenet300_100", 2.30, 55.0, "not reproduced"),
    ("lenet300_100", 1.90, 40.0, "not reproduced"),
    ("lenet5_caffe", 0.95, 150.0, "reproduced within 0.20 pp error at 0.54× the seed's compression"),
    ("lenet5_caffe", 1.10, 300.0, "not reproduced"),
    ("lenet5_caffe", 1.03, 300.0, "not reproduced"),  # within 0.3 pp of 0.75 %, but above the 1.0 % accepted
    ("lenet5_caffe", 0.95, 300.0, "reproduced"),
])
def test_sparse_vd_verdict(net, error, compression, expected):
    assert sparse_vd_table.verdict(net, error, compression, True) == expected
    assert sparse_vd_table.verdict(net, error, compression, False).endswith("the schedule is unfinished)")


def test_a_curve_key_depends_on_its_own_arm_and_the_shared_settings_only():
    sched = vogn_table.SEED_SCHEDULE
    fewer = {k: v for k, v in sched.items() if k != "ivon"}
    assert vogn_table._curve_key(fewer, "adam", 0) == vogn_table._curve_key(sched, "adam", 0)
    assert vogn_table._curve_key(sched, "adam", 0) != vogn_table._curve_key(sched, "adam", 1)
    assert vogn_table._curve_key(sched | {"batch": 64}, "vogn", 0) != vogn_table._curve_key(sched, "vogn", 0)
    other = sched | {"vogn": sched["vogn"] | {"lr": 1e-3}}
    assert vogn_table._curve_key(other, "vogn", 0) != vogn_table._curve_key(sched, "vogn", 0)
    assert vogn_table._curve_key(other, "ivon", 0) == vogn_table._curve_key(sched, "ivon", 0)


def test_sparse_vd_recorded_runs_are_reused_and_a_missing_start_is_trained_again(tmp_path, one_thread):
    """A complete run recorded in a written table (the caches gone) is returned without training; a recorded
    original network whose weights file is gone is trained again when a Bayesian arm needs it as its start."""
    s = _settings(epochs=3, pretrain=2)
    first = sparse_vd_table.run_one("lenet300_100", "sparse_vd", s, 0, tmp_path / "first")
    original = sparse_vd_table.run_one("lenet300_100", "original", s, 0, tmp_path / "first")
    assert first["complete"] and original["complete"] and original["cached"]
    recorded = {r["key"]: dict(r, cached=False) for r in (first, original)}

    empty = tmp_path / "empty"
    reused = sparse_vd_table.run_one("lenet300_100", "sparse_vd", s, 0, empty, recorded)
    assert reused["cached"] and reused["error"] == first["error"] and reused["curve"] == first["curve"]
    assert not empty.exists()  # nothing was trained, nothing written

    only_original = {original["key"]: recorded[original["key"]]}
    again = sparse_vd_table.run_one("lenet300_100", "sparse_vd", s, 0, empty, only_original)
    assert again["complete"] and not again["cached"]
    assert (empty / f"lenet300_100-original-seed0-{original['key']}.pt").is_file()  # its start was retrained
    assert _strip_times(again["curve"]) == _strip_times(first["curve"]) and again["error"] == first["error"]


def test_recorded_runs_are_the_accepted_rows_of_the_same_scale(tmp_path):
    rows = [{"key": "a", "complete": True, "error": 0.1}, {"key": "b", "complete": False, "error": 0.2},
            {"complete": True}]
    result = common.TargetResult("t", "a table", True, 0, rows={"runs": rows, "more": [{"key": "c", "complete": True}]})
    common.write_target(tmp_path, result, None)
    complete = lambda r: r["complete"]  # noqa: E731
    assert common.recorded_runs(tmp_path, "t", True, complete) == {"a": rows[0] | {"cached": True}}
    assert set(common.recorded_runs(tmp_path, "t", True, complete, blocks=("runs", "more"))) == {"a", "c"}
    assert common.recorded_runs(tmp_path, "t", False, complete) == {}  # another scale
    assert common.recorded_runs(tmp_path / "none", "t", True, complete) == {}
