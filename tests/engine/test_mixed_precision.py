"""The engine and the layers under ``torch.autocast`` (CPU bfloat16).

Tolerances: the engine's statistics and accumulations stay float32 under autocast, so an
elementwise integrand's estimate equals the float32 one to float32 rounding (rtol 1e-6); where
``fn`` itself contains a matmul, torch runs it in bfloat16 (8 bits of mantissa: relative
error ≲ 2⁻⁸ per product), so those results agree to 2e-2 and come back in bfloat16, as torch's
own matmul would.
"""

from __future__ import annotations

import torch

import mcgraph as mg
import mcgraph.nn as mnn
from mcgraph.engine.estimators.collapsed import statistics

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def _q(P=512):
    g = torch.Generator().manual_seed(0)
    return torch.distributions.Normal(torch.randn(P, generator=g).requires_grad_(), torch.full((P,), 0.2))


def test_engine_statistics_stay_float32_under_autocast():
    q = _q()
    form = mg.family_of(q)
    ref = statistics(form, {(1, 0), (2, 0), (3, 0)}, 0, 300, 300, False)
    with torch.autocast(**BF16):
        got = statistics(form, {(1, 0), (2, 0), (3, 0)}, 0, 300, 300, False)
    for k in ref:
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-7)


def test_tiers_agree_with_float32_under_autocast():
    q = _q()
    mix = mg.distributions.ScaleMixtureNormal(pi=0.5, scale1=1.0, scale2=1e-3)
    cases = {
        "collapsed": lambda: mg.kl_divergence(q, torch.distributions.Normal(0.0, 1.0), 400, seed=0),
        "fused": lambda: mg.kl_divergence(q, mix, 400, seed=0),          # accumulated by a BLAS row sum
        "analytic": lambda: mg.kl_divergence(q, torch.distributions.Normal(0.0, 1.0), 1, method="analytic"),
        "stderr": lambda: mg.expectation(lambda w: w.abs(), q, 400, seed=0, return_stderr=True).stderr,
    }
    for name, run in cases.items():
        ref = run()
        with torch.autocast(**BF16):
            got = run()
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6, msg=name)
        if got.requires_grad:
            with torch.autocast(**BF16):
                g, = torch.autograd.grad(run().sum(), q.loc)
            assert torch.isfinite(g).all(), name


def test_matmul_in_fn_returns_what_torch_returns():
    q = _q(64)
    a = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    fn = lambda w: (w.reshape(8, 8) @ a).tanh()  # noqa: E731 — opaque: the chunked tier
    ref = mg.expectation(fn, q, 200, seed=0)
    with torch.autocast(**BF16):
        got = mg.expectation(fn, q, 200, seed=0)
        expected_dtype = fn(q.loc.detach()).dtype
        g, = torch.autograd.grad(mg.expectation(fn, q, 200, seed=0).sum(), q.loc)
    assert got.dtype == expected_dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
    assert g.dtype == torch.float32 and torch.isfinite(g).all()


def test_bayesian_lenet5_trains_under_cpu_bfloat16_autocast():
    torch.manual_seed(0)
    net = mnn.bayesify(mg.models.get_model("lenet5"), posterior="radial", prior="normal", kl_samples=50)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    with torch.autocast(**BF16):
        assert net(x).dtype == torch.bfloat16        # the layers compute as torch's conv/linear would
    for step in range(3):
        opt.zero_grad()
        with torch.autocast(**BF16):
            t = mnn.elbo_terms(net, x, y, num_samples=2, dataset_size=1000, seed=step, return_stderr=True)
        assert t.kl.dtype == torch.float32 and torch.isfinite(t.elbo)
        assert torch.isfinite(t.log_likelihood_stderr) and torch.isfinite(t.kl_stderr)
        (-t.elbo).backward()
        grads = [p.grad for p in net.parameters() if p.grad is not None]
        assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
        opt.step()
    plain = mnn.elbo_terms(net, x, y, num_samples=2, dataset_size=1000, seed=9)
    with torch.autocast(**BF16):
        mixed = mnn.elbo_terms(net, x, y, num_samples=2, dataset_size=1000, seed=9)
    torch.testing.assert_close(mixed.kl, plain.kl, rtol=1e-6, atol=1e-4)        # the KL has no matmul
    torch.testing.assert_close(mixed.log_likelihood.float(), plain.log_likelihood, rtol=5e-2, atol=5e-2)
