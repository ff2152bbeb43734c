"""Smoke test of bench/lora_lm.py on a tiny GPT-2: every training and prediction provider measures in
process, the predictions of the three prediction providers are distributions, and the summary states
the targets."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (`make interop`)")
pytest.importorskip("peft", reason="peft is not installed (`make interop`)")

_spec = importlib.util.spec_from_file_location("lora_lm", pathlib.Path(__file__).with_name("lora_lm.py"))
lora_lm = importlib.util.module_from_spec(_spec)
sys.modules["lora_lm"] = lora_lm  # its dataclass looks its module up
_spec.loader.exec_module(lora_lm)

TINY = lora_lm.Sizes(layers=1, width=16, heads=2, vocab=64, seq=8, batch=2, rank=2)


def test_every_provider_measures_and_the_summary_states_the_targets():
    rows = [lora_lm.measure("train", p, 1 if p == "lora" else 3, 1, TINY) for p in lora_lm.TRAIN]
    rows += [lora_lm.measure("train", "mcgraph", 1, 1, TINY)]
    rows += [lora_lm.measure("predict", p, m, 1, TINY) for p in lora_lm.PREDICT for m in (1, 3)]
    rows += [lora_lm.interleaved(1, TINY), lora_lm.interleaved_predict(1, TINY, 2)]
    for r in rows:
        if not r["mode"].startswith("interleaved"):
            assert r["time_s"] > 0 and r["peak_rss_bytes"] > 0 and r["base_rss_bytes"] > 0
    assert all(r["saved_bytes"] > 0 for r in rows if r["mode"] == "train")
    lines = lora_lm.summary(rows)
    assert any(line.startswith("- predict: mcgraph peak RSS M=3 / M=1") for line in lines)
    assert any("train, interleaved in one process" in line for line in lines)
    assert any("predict, interleaved in one process" in line for line in lines)


def test_prediction_providers_agree_in_mean_mode():
    """With the posterior means every sample is the same network: the three providers give the same
    next-token distribution (so they compute the same thing, only their memory and time differ)."""
    model = lora_lm.build("mcgraph", TINY)
    b = lora_lm.batch(TINY)
    with torch.no_grad():
        for m in model.modules():  # move B off 0 so the adapters matter
            if isinstance(m, lora_lm.mg.nn.BayesLoRA):
                m.lora_B.weight.normal_()
    with lora_lm.mg.nn.frozen(model):
        probs = [lora_lm.predict(p, model, b, 3, seed=0) for p in lora_lm.PREDICT]
    for p in probs:
        torch.testing.assert_close(p.sum(-1), torch.ones(TINY.batch))
        torch.testing.assert_close(p, probs[0], rtol=1e-5, atol=1e-6)
