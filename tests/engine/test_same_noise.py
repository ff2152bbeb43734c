"""Contract 1: same seed ⇒ same answer, for every registered family × every integrand kind.

For each (family, integrand, M) the direct estimator (one graph over all M
samples) is the reference; ``auto``, every applicable forced tier and two chunk
sizes must give the same value and the same gradients w.r.t. the family's
parameters, within the tolerances of ``same_noise_tolerances``.
"""

from __future__ import annotations

import pytest
import torch
from torch import distributions as D

import mcgraph as mg
from mcgraph import distributions as mgd
from mcgraph.engine.plan.classify import Tier

from support.families_table import FAMILY_FACTORIES, is_positive, make
from support.same_noise_tolerances import assert_same as _assert_same

F64 = torch.float64


def _prior(cls, *args, dtype=F64):
    return cls(*[torch.tensor(a, dtype=dtype) for a in args])


def integrands(dtype):
    real = {
        "poly3": lambda w: (w - 1) ** 3 + 0.5 * w ** 2,
        "normal_prior": _prior(D.Normal, 0.3, 1.5, dtype=dtype).log_prob,
        "laplace_prior": _prior(D.Laplace, 0.1, 0.7, dtype=dtype).log_prob,
        "mixture_prior": _prior(mgd.ScaleMixtureNormal, 0.3, 1.0, 0.1, dtype=dtype).log_prob,
        "abs": torch.abs,
        "reduced_poly": lambda w: (w ** 2).sum() * 0.5 - w.mean(),
        "opaque": lambda w: torch.logsumexp(w.reshape(-1), 0),
    }
    positive = {
        "gamma_prior": _prior(D.Gamma, 2.0, 1.5, dtype=dtype).log_prob,
        "inverse_power_log": lambda w: w ** -2 + torch.log(w),
        "lognormal_prior": _prior(D.LogNormal, 0.2, 0.8, dtype=dtype).log_prob,
    }
    return real, positive


def _pairs():
    real, positive = integrands(F64)
    for fam in FAMILY_FACTORIES:
        for name in real:
            yield fam, name
        if is_positive(fam):
            for name in positive:
                yield fam, name


def _params(dtype, n=5):
    g = torch.Generator().manual_seed(11)
    mu = (torch.randn(n, generator=g, dtype=F64) * 0.5 + 0.2).to(dtype).requires_grad_()
    s = (torch.rand(n, generator=g, dtype=F64) * 0.6 + 0.4).to(dtype).requires_grad_()
    return mu, s


def _evaluate(fam, fn, M, method, chunk, dtype):
    mu, s = _params(dtype)
    q = make(fam, mu, s)
    value = mg.expectation(fn, q, M, seed=1234, method=method, chunk_size=chunk)
    grads = torch.autograd.grad(value.sum(), [mu, s], allow_unused=True)
    return value.detach(), grads


def _methods(fam, fn, dtype):
    mu, s = _params(dtype)
    plan = mg.explain(fn, make(fam, mu, s))
    methods = ["auto", "chunked"]
    if plan.whole is None:
        methods.append("fused")
        if all(t.tier == Tier.COLLAPSED for t in plan.terms):
            methods.append("collapsed")
    return methods, plan


@pytest.mark.parametrize("M", [1, 7, 64])
@pytest.mark.parametrize("fam,name", list(_pairs()), ids=lambda x: getattr(x, "__name__", x))
def test_every_method_matches_direct_float64(fam, name, M):
    real, positive = integrands(F64)
    fn = {**real, **positive}[name]
    ref = _evaluate(fam, fn, M, "direct", None, F64)
    methods, plan = _methods(fam, fn, F64)
    for method in methods:
        for chunk in (None, 3, 5):
            got = _evaluate(fam, fn, M, method, chunk, F64)
            _assert_same(ref, got, 1e-9, 1e-9, f"{fam.__name__}/{name}/M={M}/{method}/chunk={chunk}")


FLOAT32_PAIRS = [(D.Normal, "poly3"), (D.Normal, "mixture_prior"), (mgd.Radial, "normal_prior"),
                 (D.LogNormal, "gamma_prior"), (D.Exponential, "gamma_prior"), (D.Laplace, "laplace_prior"),
                 (D.Normal, "opaque")]


@pytest.mark.parametrize("fam,name", FLOAT32_PAIRS, ids=lambda x: getattr(x, "__name__", x))
def test_every_method_matches_direct_float32(fam, name):
    real, positive = integrands(torch.float32)
    fn = {**real, **positive}[name]
    ref = _evaluate(fam, fn, 64, "direct", None, torch.float32)
    methods, _ = _methods(fam, fn, torch.float32)
    for method in methods:
        for chunk in (None, 5):
            got = _evaluate(fam, fn, 64, method, chunk, torch.float32)
            _assert_same(ref, got, 2e-4, 2e-4, f"{fam.__name__}/{name}/{method}/chunk={chunk}")


def test_forcing_a_tier_that_does_not_apply_names_the_term():
    mu, s = _params(F64)
    q = D.Normal(mu, s)
    with pytest.raises(ValueError, match=r"method='collapsed' does not apply to term 'abs\(w\)'"):
        mg.expectation(torch.abs, q, 10, seed=0, method="collapsed")
    with pytest.raises(ValueError, match=r"method='fused' does not apply to term 'fn \(whole integrand\)'"):
        mg.expectation(lambda w: torch.logsumexp(w, 0), q, 10, seed=0, method="fused")


def test_kl_divergence_methods_agree_with_direct():
    real, _ = integrands(F64)
    p = _prior(mgd.ScaleMixtureNormal, 0.5, 1.0, 1e-3)
    results = {}
    for method in ("direct", "auto", "fused", "chunked"):
        mu, s = _params(F64)
        kl = mg.kl_divergence(D.Normal(mu, s), p, 64, seed=5, method=method)
        results[method] = (kl.detach(), torch.autograd.grad(kl.sum(), [mu, s]))
    for method in ("auto", "fused", "chunked"):
        _assert_same(results["direct"], results[method], 1e-9, 1e-9, f"kl/{method}")


PRIORS_WITH_GRAD = {
    "normal": lambda a, b: D.Normal(a, b),
    "laplace": lambda a, b: D.Laplace(a, b),
    "mixture": lambda a, b: mgd.ScaleMixtureNormal(torch.tensor(0.3, dtype=F64), b, b * 0.1, loc=a),
    "student_t": lambda a, b: D.StudentT(torch.tensor(4.0, dtype=F64), a, b),
}


@pytest.mark.parametrize("prior", list(PRIORS_WITH_GRAD))
@pytest.mark.parametrize("fam", [D.Normal, mgd.Radial, D.LogNormal])
def test_prior_parameter_gradients_match_direct(prior, fam):
    """Gradients also flow to prior tensors that require grad, identically in every tier."""
    results = {}
    for method in ("direct", "auto", "fused", "chunked"):
        mu, s = _params(F64)
        a = torch.tensor(0.3, dtype=F64, requires_grad=True)
        b = torch.tensor(1.4, dtype=F64, requires_grad=True)
        p = PRIORS_WITH_GRAD[prior](a, b)
        fn = (lambda w: p.log_prob(w).sum(-1)) if fam is mgd.Radial else p.log_prob
        value = mg.expectation(fn, make(fam, mu, s), 16, seed=9, method=method, chunk_size=5)
        grads = torch.autograd.grad(value.sum(), [mu, s, a, b], allow_unused=True)
        results[method] = (value.detach(), grads)
    for method in ("auto", "fused", "chunked"):
        _assert_same(results["direct"], results[method], 1e-9, 1e-9, f"{fam.__name__}/{prior}/{method}")
