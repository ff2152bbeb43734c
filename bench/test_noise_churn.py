"""Smoke test of bench/noise_churn.py at a small M: each workload and posterior runs in its fresh process on
the model named, and its row says so (the ELBO workload feeds every model a 3-channel 32×32 batch)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("noise_churn.py")


@pytest.mark.parametrize("workload", ["kl", "elbo"])
def test_lenet5_rows_for_both_posteriors(tmp_path, workload):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--workload", workload, "--model", "lenet5", "--num-samples",
                           "4", "--threads", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "noise_churn.json").read_text())
    assert sorted(r["posterior"] for r in rows) == ["normal", "radial"]
    for r in rows:
        assert (r["workload"], r["model"], r["num_samples"]) == (workload, "lenet5", 4)
        assert r["wall_s"] > 0 and r["params"] > 60_000 and r["kl"] == r["kl"]  # a number, not NaN
