"""Smoke test of bench/elbo_peers.py at a small MLP: every provider measures, and the gradient check
tells the peers' shared-buffer loops (wrong ρ-gradients) from mcgraph's (the per-sample reference)."""

from __future__ import annotations


import pytest

from bench import elbo_peers


@pytest.mark.parametrize("provider", elbo_peers.PROVIDERS)
def test_provider_measures_and_checks_its_gradient(provider, monkeypatch):
    module = {"bayesian-torch": "bayesian_torch", "blitz": "blitz"}.get(provider.split("+")[0])
    if module is not None:
        pytest.importorskip(module, reason=f"{module} is not installed (`make interop`)")
    monkeypatch.setattr(elbo_peers, "SIZES", (12, 16, 16, 3))
    row = elbo_peers.measure(provider, 3, reps=1, grad_samples=4)
    assert row["provider"] == provider and row["saved_bytes"] > 0 and row["time_s"] > 0
    if provider in elbo_peers.PEERS:
        assert row["rho_grad_rel_err"] > 0.1
    else:
        assert row["rho_grad_rel_err"] < 1e-4


def test_interleaved_and_summary(monkeypatch):
    pytest.importorskip("blitz", reason="blitz is not installed (`make interop`)")
    monkeypatch.setattr(elbo_peers, "SIZES", (12, 16, 3))
    row = elbo_peers.interleaved_times("blitz", 2, reps=1)
    assert row["ratio"] > 0
    rows = [elbo_peers.measure(p, m, 1, 0) for p in ("blitz", "blitz+mcgraph") for m in (1, 16)]
    lines = elbo_peers.summary(rows, [1, 16])
    assert any(line.startswith("blitz+mcgraph: peak RSS") for line in lines)
    assert any("target ≤ 1:" in line for line in lines)
