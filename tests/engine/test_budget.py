"""The chunk a chunked estimate runs with: a memory budget in bytes, set from the device.

* the budget: the device's (a CUDA device's free memory queried at its boundary, stubbed here), then
  ``MCGRAPH_CHUNK_BUDGET``, ``mg.set_chunk_budget``, ``mg.chunk_budget`` — and a call's ``chunk_size``
  over all of them;
* what a chunk holds is measured (weight samples and activations), so a network whose activations dwarf
  its weight samples gets small chunks where the weight count alone would have put every sample in one;
* the same value and gradients for every budget (the same-seed contract);
* each decision is logged and readable afterwards.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import mcgraph as mg
from mcgraph.engine import budget
from mcgraph.engine.estimators.sampling import GRAPH_CHUNK_ELEMENTS, default_chunk


@pytest.fixture(autouse=True)
def no_program_budget(monkeypatch):
    monkeypatch.delenv(budget.ENV_VAR, raising=False)
    yield
    mg.set_chunk_budget("auto")


def test_sizes_are_read_with_their_units():
    assert budget.parse_bytes("512MiB") == 512 << 20
    assert budget.parse_bytes("2GB") == 2 * 10 ** 9
    assert budget.parse_bytes("1.5 GiB") == 3 << 29
    assert budget.parse_bytes(4096) == 4096
    assert budget.parse_bytes("auto") is None and budget.parse_bytes(None) is None
    with pytest.raises(ValueError, match="budget"):
        budget.parse_bytes("lots")
    with pytest.raises(ValueError, match="positive"):
        budget.parse_bytes(0)
    with pytest.raises(TypeError, match="budget"):
        budget.parse_bytes(True)


def test_the_cpu_budget_and_what_overrides_it(monkeypatch):
    cpu = torch.device("cpu")
    assert budget.budget_bytes(cpu).bytes == budget.CPU_BUDGET
    monkeypatch.setenv(budget.ENV_VAR, "8MiB")
    assert budget.budget_bytes(cpu) == (8 << 20, f"{budget.ENV_VAR}=8MiB")
    mg.set_chunk_budget("16MiB")  # the program's setting over the environment's
    assert budget.budget_bytes(cpu).bytes == 16 << 20
    with mg.chunk_budget("32MiB"):  # the block's over the program's
        assert budget.budget_bytes(cpu).bytes == 32 << 20
        with mg.chunk_budget("auto"):  # the device's, whatever the program sets
            assert budget.budget_bytes(cpu).bytes == budget.CPU_BUDGET
    assert budget.budget_bytes(cpu).bytes == 16 << 20
    monkeypatch.setenv(budget.ENV_VAR, "nonsense")
    mg.set_chunk_budget(None)
    with pytest.raises(ValueError, match=budget.ENV_VAR):
        budget.budget_bytes(cpu)


@pytest.mark.parametrize("free,expected", [(80 << 30, budget.CUDA_BUDGET_CAP), (4 << 30, 1 << 30)])
def test_a_cuda_budget_follows_the_free_memory_with_a_cap(monkeypatch, free, expected):
    """The device-memory query stubbed at its boundary (this machine may have no GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 << 30))
    got = budget.budget_bytes(torch.device("cuda", 0))
    assert got.bytes == expected
    assert "free" in got.why


def _wide_net():
    """A Bayesian layer of 16 weights feeding a deterministic layer of 64 k outputs: the activations, not
    the weight samples, fill a chunk."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1 << 16), nn.ReLU(), nn.Linear(1 << 16, 3))
    return mg.nn.bayesify(net, skip=["2", "4"])


def _loss_and_grads(net, x, y, sampling):
    net.zero_grad()
    loss = -mg.nn.elbo(net, x, y, num_samples=sampling, dataset_size=100, seed=3)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in net.parameters() if p.grad is not None]


def test_activations_count_in_a_chunk():
    net = _wide_net()
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    M = 32
    assert mg.nn.default_chunk(net, M) == M  # the weight samples alone would fit every sample in one chunk
    with mg.chunk_budget("16MiB"):
        _loss_and_grads(net, x, y, M)
    decision = budget.last_decision()
    assert decision.probe == 1 and decision.per_sample_bytes > 8 * (1 << 16) * 4  # one sample's activations
    assert 1 <= decision.samples < M - 1
    assert decision.samples * decision.per_sample_bytes <= 16 << 20


@pytest.mark.parametrize("budget_size", ["1KiB", "3MiB", "1GiB"])
def test_every_budget_gives_the_value_and_gradients_of_the_direct_estimate(budget_size):
    net = _wide_net()
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    ref = _loss_and_grads(net, x, y, mg.Sampling(9, method="direct"))
    with mg.chunk_budget(budget_size):
        got = _loss_and_grads(net, x, y, 9)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1], ref[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_given_chunk_size_wins_and_the_decision_is_logged(caplog):
    net = _wide_net()
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with caplog.at_level(logging.DEBUG, logger="mcgraph.chunks"), mg.chunk_budget("1KiB"):
        _loss_and_grads(net, x, y, mg.Sampling(6, chunk_size=4))
        assert budget.last_decision().samples == 4 and "chunk_size given" in budget.last_decision().why
        mg.nn.predict(net, x, 6, seed=0)
    assert "chunks of 4 sample(s) (chunk_size given)" in caplog.text
    assert "mg.nn.predict: chunks of 1 sample(s)" in caplog.text and "per sample measured" in caplog.text


def test_predict_and_forward_samples_are_sized_and_equal_for_any_budget():
    net = _wide_net()
    x = torch.randn(8, 4)
    ref = mg.nn.predict(net, x, mg.Sampling(7, chunk_size=7), seed=1)
    ref_samples = mg.nn.forward_samples(net, x, 7, seed=1, chunk_size=7)
    for size in ("1KiB", "2MiB", "1GiB"):
        with mg.chunk_budget(size):
            torch.testing.assert_close(mg.nn.predict(net, x, 7, seed=1), ref)
            torch.testing.assert_close(mg.nn.forward_samples(net, x, 7, seed=1), ref_samples)
    with torch.no_grad(), mg.chunk_budget("1KiB"):
        out = mg.nn.forward_samples(net, x, 3, seed=1)
    assert not out.requires_grad  # the measured first chunk keeps no graph under no_grad


def test_the_engine_chunked_tier_scales_with_the_budget():
    q = torch.distributions.Normal(torch.zeros(1000), torch.ones(1000))
    form = mg.family_of(q)
    assert default_chunk(form, 10 ** 6, "chunked") == GRAPH_CHUNK_ELEMENTS // 1000
    with mg.chunk_budget(budget.CPU_BUDGET * 8):
        assert default_chunk(form, 10 ** 6, "chunked") == 8 * GRAPH_CHUNK_ELEMENTS // 1000
    with mg.chunk_budget(1):
        assert default_chunk(form, 10 ** 6, "chunked") == 1
