"""Smoke test of bench/optim_samples.py at a small MLP: every kind of point measures in this process, the
interleaved run times its three points, and the summary states the targets."""

from __future__ import annotations


import pytest

from bench import optim_samples


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(optim_samples.elbo_peers, "SIZES", (12, 16, 16, 3))


def test_points_measure_and_the_summary_states_the_targets(small):
    rows = [optim_samples.measure(p, reps=2) for p in
            ("ivon:sequential:1", "ivon:batched:3", "ivon:sequential:3", "vogn:sequential:2", "vogn:batched:2",
             "adam:sequential:1")]
    for row in rows:
        assert row["step_s"] > 0 and row["cpu_s"] >= 0 and row["peak_rss_bytes"] > 0
    rows.append(optim_samples.interleaved(reps=2))
    assert rows[-1]["ivon:batched:8"]["cpu_ratio"] > 0
    rows.append({**rows[1], "point": "ivon:batched:8"})
    rows.append({**rows[3], "point": "vogn:sequential:1"})
    rows.append({**rows[4], "point": "vogn:batched:8"})
    lines = optim_samples.summary(rows)
    assert any(line.startswith("ivon K=8") and "target <= 3" in line and "target <= 1.5" in line for line in lines)
    assert any(line.startswith("vogn K=8") and "target <= 3" in line for line in lines)


def test_bad_points_are_refused():
    for bad in ("adam:batched:2", "ivon:loop:2", "ivon:batched:0", "ivon-8"):
        with pytest.raises(ValueError, match="point"):
            optim_samples.parse(bad)
