"""The backend decision (mcgraph.engine.noise.backends) and the engine hooks it offers.

* ``backend_for``: device, Triton availability, the ``MCGRAPH_BACKEND`` override (read per call),
  clear errors; importing mcgraph imports neither Triton nor the kernels and touches no GPU.
* The same-seed contract within the Triton backend: with the hooks wired as the report asks
  (simulated here by patching the engine's ``stream_for``/``statistics``), the direct, chunked,
  collapsed and torch-fused estimators read the Triton stream and agree with the kernels.
"""

from __future__ import annotations

import os

import subprocess
import sys

import pytest
import torch
from torch import distributions as D

import mcgraph as mg
from mcgraph.engine.noise import backends as backend
from mcgraph.engine.estimators import softmax, triton_fused
from mcgraph import distributions as mgd

F64 = torch.float64


class _FakeCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device (enough for the decision, which reads only ``.device``)."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def _fake_cuda():
    return torch.Tensor._make_subclass(_FakeCuda, torch.zeros(2))


# --------------------------------------------------------------------------- the decision


def test_default_is_torch_on_cpu_and_triton_on_cuda(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    assert backend.backend_for(torch.zeros(2)) == "torch"
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    assert backend.backend_for(_fake_cuda()) == "triton"
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    assert backend.backend_for(_fake_cuda()) == "torch"


def test_override_is_read_at_call_time(monkeypatch):
    pytest.importorskip("triton")
    x = torch.zeros(2)
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    assert backend.backend_for(x) == "triton"
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    assert backend.backend_for(x) == "torch"
    monkeypatch.setenv(backend.ENV_VAR, " AUTO ")
    assert backend.backend_for(x) == "torch"
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    assert backend.backend_for(_fake_cuda()) == "torch"


def test_bad_override_and_impossible_requests(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="MCGRAPH_BACKEND"):
        backend.backend_for(torch.zeros(2))
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="not installed"):
        backend.backend_for(torch.zeros(2))
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    monkeypatch.setattr(backend, "_interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.backend_for(torch.zeros(2))
    with pytest.raises(RuntimeError, match="not supported"):
        backend.backend_for(torch.zeros(2, device="meta"))
    with pytest.raises(TypeError, match="tensor"):
        backend.backend_for([1.0])


def test_importing_mcgraph_probes_nothing():
    code = ("import sys, os, torch\n"
            "os.environ['MCGRAPH_BACKEND'] = 'bogus'\n"  # read at call time only: import must not fail
            "import mcgraph, mcgraph.engine.noise.backends, mcgraph.kernels, mcgraph.kernels.reference\n"
            "assert 'triton' not in sys.modules, 'triton imported'\n"
            "pure_torch = {'mcgraph.kernels.reference', 'mcgraph.kernels.log_densities'}\n"
            "assert not any(m.startswith('mcgraph.kernels.') and m not in pure_torch\n"
            "               for m in sys.modules), 'Triton kernels imported'\n"
            "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
            "print('OK')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", backend.ENV_VAR)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]


def test_torch_backend_hooks_decline(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    q = D.Normal(torch.zeros(3), torch.ones(3))
    form = mg.family_of(q)
    assert backend.noise_stream(form, 0, 4) is None
    assert backend.noise_statistics(form, {(1, 0)}, 0, 4) is None
    assert triton_fused.log_prob_expectation(q, D.Laplace(0.0, 1.0), 4, 0) is None


def test_softmax_dispatch_torch_backend(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    mean = torch.randn(5, 7, dtype=F64, requires_grad=True)
    std = torch.rand(5, 7, dtype=F64, requires_grad=True)
    y = torch.randint(0, 7, (5,))
    a = softmax.softmax_cross_entropy_mc(mean, std, y, 50, seed=3)
    b = softmax.softmax_cross_entropy_mc(mean, std, y, 50, seed=3, chunk_size=7)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for ga, gb in zip(torch.autograd.grad(a.sum(), [mean, std]), torch.autograd.grad(b.sum(), [mean, std])):
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-12)
    assert (mg.graph_size(lambda: softmax.softmax_cross_entropy_mc(mean, std, y, 1, seed=0))
            == mg.graph_size(lambda: softmax.softmax_cross_entropy_mc(mean, std, y, 200, seed=0)))


# --------------------------------------------------------------------------- Triton backend on CPU


@pytest.fixture
def triton_backend(monkeypatch):
    """``MCGRAPH_BACKEND=triton`` with the engine hooks wired as the report asks."""
    pytest.importorskip("triton")
    from mcgraph.kernels import utils

    if not utils.INTERPRETED:  # pragma: no cover
        pytest.skip("mcgraph.kernels was imported without TRITON_INTERPRET=1 in this process")
    monkeypatch.setenv(backend.ENV_VAR, "triton")
    import mcgraph.engine.api as api
    from mcgraph.engine.estimators import chunked, collapsed, direct, fused, sampling

    original = sampling.stream_for

    def stream_for(form, seed, num_samples):
        stream = backend.noise_stream(form, seed, num_samples)
        return stream if stream is not None else original(form, seed, num_samples)

    for module in (sampling, api, chunked, collapsed, direct, fused):
        if hasattr(module, "stream_for"):
            monkeypatch.setattr(module, "stream_for", stream_for)
    original_stats = collapsed.statistics

    def statistics(form, keys, seed, num_samples, chunk_size, exact, shard=None):
        stats = None if exact or shard is not None else backend.noise_statistics(form, keys, seed, num_samples)
        return stats if stats is not None else original_stats(form, keys, seed, num_samples, chunk_size, exact, shard)

    monkeypatch.setattr(api, "statistics", statistics)
    return api


def _assert_near(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_triton_stream_matches_materialised_noise(triton_backend):
    from mcgraph.kernels.noise_laws import materialize_noise

    form = mg.family_of(mgd.Radial(torch.zeros(3, 5, dtype=F64), torch.ones(3, 5, dtype=F64)))
    stream = backend.noise_stream(form, 7, 6)
    assert backend.triton_noise(form) == ("radial", form.noise.event_ndims)
    _assert_near(stream.rows(2, 6), materialize_noise("radial", form.noise_shape, 2, 6, 7, F64,
                                                event_ndims=form.noise.event_ndims))
    rows = torch.cat([r for _, _, r in stream.chunks(4)])
    _assert_near(rows, stream.rows(0, 6))
    assert backend.noise_stream(mg.family_of(D.Gamma(torch.full((3,), 2.0), 1.0)), 0, 4) is None  # no Triton law


def test_same_seed_contract_within_triton_backend(triton_backend):
    """Kernel, torch-fused, chunked and direct estimators on the Triton stream: same value and gradients."""
    mu = torch.randn(17, dtype=F64, requires_grad=True)
    s = (0.5 + torch.rand(17, dtype=F64)).requires_grad_()
    q = D.Normal(mu, s)
    prior = mgd.ScaleMixtureNormal(*torch.tensor([0.3, 1.0, 0.1], dtype=F64))  # fp64: torch takes log π in its dtype
    M, seed = 12, 5
    kernel = triton_fused.log_prob_expectation(q, prior, M, seed)
    assert kernel is not None
    results = [kernel] + [mg.expectation(prior.log_prob, q, M, seed=seed, method=m, chunk_size=c)
                          for m, c in (("fused", None), ("chunked", 5), ("direct", None))]
    grads = [torch.autograd.grad(r.sum(), [mu, s]) for r in results]
    for r, g in zip(results[1:], grads[1:]):
        _assert_near(r, results[0])
        for a, b in zip(g, grads[0]):
            _assert_near(a, b)


def test_collapsed_tier_uses_triton_statistics(triton_backend):
    mu = torch.randn(17, dtype=F64, requires_grad=True)
    s = (0.5 + torch.rand(17, dtype=F64)).requires_grad_()
    q = mgd.Logistic(mu, s)

    def fn(w):
        return (w - 1) ** 3 + 0.5 * w ** 2

    a = mg.expectation(fn, q, 16, seed=2, method="collapsed")
    b = mg.expectation(fn, q, 16, seed=2, method="direct")
    _assert_near(a, b)
    for ga, gb in zip(torch.autograd.grad(a.sum(), [mu, s]), torch.autograd.grad(b.sum(), [mu, s])):
        _assert_near(ga, gb)
    form = mg.family_of(q)
    stats = backend.noise_statistics(form, {(1, 0), (2, 0), (3, 0)}, 2, 16)
    from mcgraph.kernels.reference import noise_statistics_reference

    want = noise_statistics_reference(backend.noise_stream(form, 2, 16).rows(0, 16), [(1, 0), (2, 0), (3, 0)])
    for k in want:
        _assert_near(stats[k], want[k])


def test_log_prob_hook_forms_and_declines(triton_backend):
    theta = (0.5 + torch.rand(9, dtype=F64)).requires_grad_()
    q = D.Exponential(1 / theta)  # scaling form, exponential noise
    prior = D.Gamma(torch.tensor(2.0, dtype=F64), torch.tensor(1.5, dtype=F64))
    kernel = triton_fused.log_prob_expectation(q, prior, 8, 1)
    direct = mg.expectation(prior.log_prob, q, 8, seed=1, method="direct")
    _assert_near(kernel, direct)
    _assert_near(*[torch.autograd.grad(v.sum(), theta, retain_graph=True)[0] for v in (kernel, direct)])
    lq = D.LogNormal(torch.zeros(9, dtype=F64), theta)  # exp form
    _assert_near(triton_fused.log_prob_expectation(lq, prior, 8, 1), mg.expectation(prior.log_prob, lq, 8, seed=1,
                                                                          method="direct"))
    ind = D.Independent(D.Normal(torch.zeros(4, 3, dtype=F64), theta[:3]), 1)
    summed = triton_fused.log_prob_expectation(ind, D.Normal(0.0, 1.0), 8, 1, sum_rightmost=1)
    assert summed.shape == (4,)
    assert triton_fused.log_prob_expectation(q, D.HalfNormal(1.0), 8, 1) is None  # no Triton log-density
    assert triton_fused.log_prob_expectation(D.Normal(torch.zeros(3), 1.0), D.Normal(torch.zeros(2, 3), 1.0), 8, 1) is None


def test_softmax_dispatch_triton_backend(triton_backend):
    from mcgraph.kernels.softmax_mc import softmax_cross_entropy_mc

    mean, std, y = torch.randn(3, 6), torch.rand(3, 6), torch.tensor([0, 5, 2])
    _assert_near(softmax.softmax_cross_entropy_mc(mean, std, y, 8, seed=4), softmax_cross_entropy_mc(mean, std, y, 8, 4))
