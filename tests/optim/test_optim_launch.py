"""``torchrun ... python -m mcgraph train --optimizer ivon|vogn``: each rank draws its own weight samples and
the optimizer all-reduces the statistics, so R ranks with ``--mc-samples`` K end where one process with
``--mc-samples`` R·K ends (real 2-process gloo runs under torch's launcher)."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
import torch
import torch.distributed as dist

from support.distributed_cases import torchrun
from mcgraph.apps.optim_train import build_optimizer

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
              pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn not installed")]


def _train_args(out, optimizer: str, samples: int) -> list:
    return ["train", "--model", "mlp", "--hidden", "16", "--dataset", "digits", "--epochs", "1", "--batch-size", "64",
            "--limit-train", "192", "--limit-test", "64", "--eval-samples", "4", "--eval-every", "0", "--no-progress",
            "--threads", "1", "--optimizer", optimizer, "--mc-samples", str(samples), "--out", str(out)]


@pytest.mark.parametrize("optimizer", ["ivon", pytest.param("vogn", marks=pytest.mark.slow)])
def test_two_ranks_with_one_sample_each_end_where_one_process_with_two_samples_ends(tmp_path, optimizer):
    from mcgraph.__main__ import main

    one, two, single = tmp_path / "one", tmp_path / "two", tmp_path / "single"
    threads = torch.get_num_threads()
    try:
        assert main(_train_args(one, optimizer, 2)) == 0
        assert main(_train_args(single, optimizer, 1)) == 0
    finally:
        torch.set_num_threads(threads)
    done = torchrun(2, _train_args(two, optimizer, 1))
    assert done.stderr.count("epoch 1:") == 1  # rank 0 alone logs
    a, b, c = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (one, two, single))
    assert a["step"] == b["step"] == 3
    for key, value in a["model"].items():
        torch.testing.assert_close(b["model"][key], value, rtol=1e-4, atol=1e-6, msg=key)
    # the two ranks drew different samples: one sample per step (the same on both ranks) ends elsewhere
    assert any(not torch.allclose(c["model"][k], v, rtol=1e-3, atol=1e-5) for k, v in b["model"].items())
    if optimizer == "ivon":
        assert a["optimizer"]["counters"]["step"] == b["optimizer"]["counters"]["step"] == 3


def test_optimizers_that_cannot_share_samples_are_refused_under_a_process_group():
    args = argparse.Namespace(optimizer="adam", lr=1e-3, betas=None)
    net = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="only ivon and vogn run under torchrun"):
        build_optimizer(args, net, 10, 1, process_group=object())
