"""``python -m mcgraph train --optimizer ivon``: defaults, posterior predictive, checkpoint and resume."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from mcgraph.apps import train as mtrain

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn not installed")

COMMON = ["--model", "mlp", "--hidden", "64", "--dataset", "digits", "--batch-size", "64", "--no-progress",
          "--threads", "1", "--eval-samples", "8", "--periodic-eval-samples", "4"]


def _read(out):
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def test_ivon_cli_trains_with_its_defaults_checkpoints_and_resumes(tmp_path):
    out = tmp_path / "ivon"
    args = COMMON + ["--optimizer", "ivon", "--eval-every", "1", "--out", str(out)]
    assert mtrain.main(args + ["--epochs", "3"]) == 0
    summary, rows = _read(out)
    assert summary["optimizer"] == "ivon" and summary["posterior"] == "normal (IVON)" and summary["bayesian"]
    assert summary["config"]["lr"] == 0.1  # IVON's default learning rate when --lr is not given
    assert summary["test"]["num_samples"] == 8 and summary["test"]["accuracy"] > 0.85
    assert "test_accuracy" in rows[0] and rows[-1]["step"] == 3 * 23
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["optimizer"]["counters"]["step"] == 69 and state["optimizer"]["counters"]["seed"] == 0
    assert mtrain.main(args + ["--epochs", "4", "--resume", str(out / "checkpoint.pt")]) == 0
    summary, rows = _read(out)
    assert summary["steps"] == 92 and [r["epoch"] for r in rows] == [1, 2, 3, 4]
    assert "Trained with ivon" in (out / "summary.md").read_text()


def test_ivon_cli_options_and_refusals(tmp_path):
    out = tmp_path / "ivon_opts"
    assert mtrain.main(COMMON + ["--optimizer", "ivon", "--lr", "0.05", "--ess", "2000", "--hess-init", "0.5",
                                 "--hess-approx", "gradsq", "--betas", "0.9", "0.999", "--weight-decay", "1e-3",
                                 "--mc-samples", "2", "--clip-radius", "1.0", "--epochs", "1", "--eval-every", "0",
                                 "--out", str(out)]) == 0
    summary, _ = _read(out)
    assert summary["config"]["lr"] == 0.05 and summary["prior"] == "normal(precision=2.0)"
    assert 0 <= summary["test"]["accuracy"] <= 1
    with pytest.raises(SystemExit):
        mtrain.main(["--optimizer", "ivon", "--ess", "0"])
    with pytest.raises(SystemExit):
        mtrain.main(["--optimizer", "ivon", "--hess-approx", "exact"])
    with pytest.raises(ValueError, match="spike-slab"):
        mtrain.main(COMMON + ["--optimizer", "ivon", "--spike-slab", "--epochs", "1", "--out", str(tmp_path / "x")])
