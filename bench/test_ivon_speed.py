"""Smoke test of bench/ivon_speed.py: every model and provider measures, and the summary states the target."""

from __future__ import annotations


import pytest
import torch

from bench import ivon_speed


@pytest.mark.parametrize("model", ["tiny", "lenet5"])
def test_models_and_providers_measure(model):
    row = ivon_speed.measure(model, ["adam", "ivon", "ivon-global", "ivon-opt", "forward-backward", "randn"], reps=2,
                             warmup=1)
    assert row["providers"]["adam"]["cpu_ratio"] == 1.0
    assert {"ivon", "ivon-global", "forward-backward", "randn"} <= set(row["providers"])
    assert all(v["wall_s"] > 0 for v in row["providers"].values())
    assert any("target <= 1.15" in line for line in ivon_speed.summary([row]))
    ops = {name: v["operations"] for name, v in row["providers"].items()}
    assert ops["randn"] == 1  # one torch.randn call
    assert ops["forward-backward"] < ops["adam"] and ops["forward-backward"] < ops["ivon"]  # the update adds calls
    assert row["operations_of"] == "outermost torch operator calls"


def test_operations_count_the_outermost_torch_calls():
    x = torch.ones(3)
    assert ivon_speed.operations_per_step(lambda: x.add(1).mul(2).sum(), cuda=False) == 3
    assert ivon_speed.operations_per_step(lambda: torch.ones(3), cuda=False) == 1  # (its fill_ is inside it)


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="model"):
        ivon_speed.workload("resnet")
