"""Smoke test of bench/recurrent_m1.py at a tiny size: both providers run, one row with its fields comes out."""

from __future__ import annotations

import json

import torch

from bench import recurrent_m1

TINY = (2, 8, 4, 5, 3)


def test_the_bayesian_layer_is_the_torch_module_in_mean_mode():
    ref, bayes, x = recurrent_m1.build(TINY)
    torch.testing.assert_close(bayes.to_torch()(x)[0], ref(x)[0], rtol=0, atol=0)


def test_measure_and_main_write_rows(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    try:
        row = recurrent_m1.measure(1, reps=2, warmup=1, size=TINY)
        assert row["torch_median_s"] > 0 and row["mcgraph_median_s"] > 0 and row["ratio"] > 0
        assert (row["num_layers"], row["hidden"], row["T"]) == (2, 8, 5)
        monkeypatch.setattr(recurrent_m1, "SIZE", TINY)
        out = tmp_path / "rows.jsonl"
        recurrent_m1.main(["--threads", "1", "--reps", "1", "--warmup", "0", "--out", str(out)])
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(rows) == 1 and rows[0]["threads"] == 1 and rows[0]["hidden"] == 8
    finally:
        torch.set_num_threads(threads)
