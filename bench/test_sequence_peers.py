"""Smoke test of bench/sequence_peers.py at a tiny LSTM on the digits read by rows: every provider measures,
mcgraph and blitz draw the weights once per sequence and bayesian-torch once per time step, and the summary
states the targets."""

from __future__ import annotations


import pytest
import torch

from bench import sequence_peers

pytest.importorskip("sklearn", reason="the digits need scikit-learn")


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(sequence_peers, "HIDDEN", 8)
    monkeypatch.setattr(sequence_peers, "DATASET", "digits")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("provider", sequence_peers.PROVIDERS)
def test_provider_measures_and_counts_its_weight_draws(provider, tiny):
    module = {"blitz": "blitz", "bayesian-torch": "bayesian_torch"}.get(provider)
    if module is not None:
        pytest.importorskip(module, reason=f"{module} is not installed (`make interop`)")
    row = sequence_peers.measure(provider, 2, reps=1)
    assert row["provider"] == provider and row["dataset"] == "digits" and row["steps"] == 8
    assert row["saved_bytes"] > 0 and row["time_s"] > 0 and row["peak_rss_bytes"] > 0
    # one draw per sequence, except bayesian-torch's LSTM, which draws new weights at each of the 8 steps
    assert row["draws_per_sequence"] == (8 if provider == "bayesian-torch" else 1)


def test_batch_file_summary_and_fallback_note(tiny, tmp_path):
    pytest.importorskip("blitz", reason="blitz is not installed (`make interop`)")
    assert "digits read by rows" in sequence_peers.fallback_note()
    path = tmp_path / "batch.pt"
    sequence_peers.save_batch(path)
    x, y, n = sequence_peers._data(str(path))
    assert x.shape == (sequence_peers.BATCH, 8, 8) and y.shape == (sequence_peers.BATCH,) and n == 1437
    rows = [sequence_peers.measure(p, m, 1, str(path)) for p in ("mcgraph", "blitz") for m in (1, 16)]
    lines = sequence_peers.summary(rows, [1, 16])
    assert any(line.startswith("mcgraph: peak RSS M=16 / M=1") for line in lines)
    assert any("M=16: mcgraph / best peer (blitz)" in line and "target ≤ 1:" in line for line in lines)
    assert sequence_peers.predicted_rss(rows, "blitz", 64) is not None
    assert sequence_peers.predicted_rss(rows, "bayesian-torch", 64) is None
    skipped = {"provider": "blitz", "M": 64, "status": "skipped (predicted peak RSS 9.0 GiB > --max-rss-gb 6)"}
    text = sequence_peers.markdown(rows + [skipped], [1, 16, 64], "python -m bench.sequence_peers")
    assert "digits read by rows" in text and "| blitz | 16 |" in text and "| blitz | 64 | skipped" in text
