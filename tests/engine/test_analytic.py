"""The analytic tier (``method="analytic"`` / ``"auto-analytic"``): exact expectations of polynomial terms.

Closed forms are compared in float64 at rtol 1e-12 (float64 rounding of a few operations).
The moments themselves are also checked against the noise samplers: the collapsed Monte
Carlo estimate at M = 20 000 must lie within 5 reported standard errors of the exact value
(false-alarm rate 6e-7 per check).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import (Cauchy, Exponential, Gamma, Gumbel, HalfNormal, InverseGamma, Laplace, LogNormal,
                                 Normal, StudentT, Uniform, Weibull)

import mcgraph as mg
from mcgraph.distributions import Logistic, Radial, Rayleigh

D = torch.float64
RTOL = 1e-12


def t(*v):
    return torch.tensor(v, dtype=D)


def test_cube_under_laplace_value_and_gradient():
    mu = t(0.3, -1.2, 2.0).requires_grad_()
    b = t(0.5, 1.0, 0.1).requires_grad_()
    e = mg.expectation(lambda w: w ** 3, Laplace(mu, b), 1, method="analytic")
    exact = mu ** 3 + 6 * mu * b ** 2       # E ξ² = 2, E ξ³ = 0
    torch.testing.assert_close(e, exact, rtol=RTOL, atol=0)
    g = torch.autograd.grad(e.sum(), (mu, b))
    torch.testing.assert_close(g[0], 3 * mu.detach() ** 2 + 6 * b.detach() ** 2, rtol=RTOL, atol=0)
    torch.testing.assert_close(g[1], 12 * mu.detach() * b.detach(), rtol=RTOL, atol=0)
    assert torch.autograd.gradcheck(lambda m, s: mg.expectation(lambda w: (w - 1) ** 4, Laplace(m, s), 1,
                                                                method="analytic"), (mu, b))


def test_kl_radial_normal_from_its_moments():
    loc = torch.randn(4, 5, dtype=D, requires_grad=True)
    scale = (0.1 + torch.rand(4, 5, dtype=D)).requires_grad_()
    q, s = Radial(loc, scale), 0.7
    p = Normal(torch.tensor(0.0, dtype=D), torch.tensor(s, dtype=D))
    kl = mg.kl_divergence(q, p, 1, method="analytic")
    n = loc.numel()      # radial ξ_j = r ε_j/‖ε‖: E ξ_j² = E r² · E(ε_j²/‖ε‖²) = 1/D
    exact = -q.entropy() + n * math.log(s * math.sqrt(2 * math.pi)) + ((loc ** 2 + scale ** 2 / n) / (2 * s * s)).sum()
    torch.testing.assert_close(kl, exact, rtol=RTOL, atol=0)
    ga = torch.autograd.grad(kl, (loc, scale))
    gb = torch.autograd.grad(exact, (loc, scale))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_normal_kl_equals_torch_closed_form():
    q = Normal(t(0.1, -2.0, 3.0), t(0.2, 1.5, 0.01))
    p = Normal(t(0.0), t(2.0))
    torch.testing.assert_close(mg.kl_divergence(q, p, 1, method="analytic"),
                               torch.distributions.kl_divergence(q, p), rtol=RTOL, atol=1e-15)


LOCATION_SCALE = {
    "Normal": Normal(t(0.3), t(1.7)),
    "Laplace": Laplace(t(-0.4), t(0.8)),
    "Logistic": Logistic(t(1.0), t(0.6)),
    "Uniform": Uniform(t(-1.0), t(2.5)),
    "Gumbel": Gumbel(t(0.2), t(1.3)),
    "StudentT": StudentT(t(7.0), t(0.5), t(2.0)),
}
SCALING = {
    "Exponential": Exponential(t(1.7)),
    "Gamma": Gamma(t(2.5), t(0.7)),
    "Weibull": Weibull(t(1.5), t(2.0)),
    "HalfNormal": HalfNormal(t(1.3)),
    "Rayleigh": Rayleigh(t(0.9)),
    "InverseGamma": InverseGamma(t(4.0), t(3.0)),
}


@pytest.mark.parametrize("name", list(LOCATION_SCALE) + list(SCALING))
def test_mean_and_variance_equal_torch(name):
    q = {**LOCATION_SCALE, **SCALING}[name]
    m1 = mg.expectation(lambda w: w, q, 1, method="analytic")
    m2 = mg.expectation(lambda w: w ** 2, q, 1, method="analytic")
    torch.testing.assert_close(m1, q.mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m2 - m1 ** 2, q.variance, rtol=1e-10, atol=1e-12)


def test_log_moments_of_scaling_families():
    k, rate = 2.5, 0.7
    e = mg.expectation(lambda w: torch.log(w), Gamma(t(k), t(rate)), 1, method="analytic")
    torch.testing.assert_close(e, torch.digamma(t(k)) - math.log(rate), rtol=RTOL, atol=0)
    e = mg.expectation(lambda w: torch.log(w) ** 2, Gamma(t(k), t(rate)), 1, method="analytic")
    exact = torch.polygamma(1, t(k)) + (torch.digamma(t(k)) - math.log(rate)) ** 2
    torch.testing.assert_close(e, exact, rtol=RTOL, atol=0)
    lam = 1.7   # E[w log w] under Exp(λ): (1 − γ − log λ) / λ
    e = mg.expectation(lambda w: w * torch.log(w), Exponential(t(lam)), 1, method="analytic")
    torch.testing.assert_close(e, t((1 - 0.5772156649015329 - math.log(lam)) / lam), rtol=RTOL, atol=0)
    e = mg.expectation(lambda w: w ** -1, Gamma(t(k), t(rate)), 1, method="analytic")
    torch.testing.assert_close(e, t(rate / (k - 1)), rtol=RTOL, atol=0)
    s = 1.3   # E log |σ Z| = log σ − (γ + log 2)/2
    e = mg.expectation(lambda w: torch.log(w), HalfNormal(t(s)), 1, method="analytic")
    torch.testing.assert_close(e, t(math.log(s) - (0.5772156649015329 + math.log(2)) / 2), rtol=RTOL, atol=0)
    # LogNormal: (log w)^b is a polynomial in the base normal
    e = mg.expectation(lambda w: torch.log(w) ** 2, LogNormal(t(0.4), t(0.9)), 1, method="analytic")
    torch.testing.assert_close(e, t(0.4 ** 2 + 0.9 ** 2), rtol=RTOL, atol=0)


SAMPLER_CHECKS = [(q, lambda w: w ** 4 - 2 * w ** 3) for q in LOCATION_SCALE.values() if not isinstance(q, StudentT)]
SAMPLER_CHECKS += [(StudentT(t(11.0), t(0.5), t(2.0)), lambda w: w ** 4 - 2 * w ** 3),
                   (Radial(torch.zeros(3, 2, dtype=D), torch.ones(3, 2, dtype=D)), lambda w: w ** 4 + w ** 2)]
SAMPLER_CHECKS += [(q, lambda w: w ** 2 * torch.log(w) ** 2 - torch.log(w)) for q in SCALING.values()
                   if not isinstance(q, InverseGamma)]
SAMPLER_CHECKS += [(InverseGamma(t(9.0), t(3.0)), lambda w: w ** 2 * torch.log(w) ** 2 - torch.log(w))]


@pytest.mark.parametrize("case", range(len(SAMPLER_CHECKS)))
def test_exact_moments_agree_with_the_noise_sampler(case):
    q, fn = SAMPLER_CHECKS[case]
    exact = mg.expectation(fn, q, 1, method="analytic")
    mc = mg.expectation(fn, q, 20_000, seed=case, method="collapsed", return_stderr=True)
    z = ((mc.value - exact) / mc.stderr).abs().max()
    assert z < 5, (type(q).__name__, float(z))


def test_graph_size_and_cost_do_not_depend_on_M():
    mu = torch.randn(100, dtype=D, requires_grad=True)
    q = Laplace(mu, torch.ones(100, dtype=D))
    fn = lambda w: (w - 1) ** 3  # noqa: E731
    one = mg.expectation(fn, q, 1, method="analytic")
    huge = mg.expectation(fn, q, 10 ** 12, method="analytic")   # 10¹⁴ draws if anything were sampled
    assert torch.equal(one, huge)
    assert mg.graph_size(one) == mg.graph_size(huge)


def test_auto_never_uses_the_exact_tier_and_auto_analytic_falls_back():
    q = Normal(t(0.3, 1.0).requires_grad_(), t(1.0, 2.0))
    fn = lambda w: w ** 3 + w.abs()  # noqa: E731
    assert mg.Tier.ANALYTIC not in mg.explain(fn, q).tiers
    plan = mg.explain(fn, q, method="auto-analytic")
    assert plan.tiers == (mg.Tier.ANALYTIC, mg.Tier.FUSED) and "EXACT" in str(plan)
    value = mg.expectation(fn, q, 1000, seed=0, method="auto-analytic")
    exact_cube = q.loc ** 3 + 3 * q.loc * q.scale ** 2
    torch.testing.assert_close(value, exact_cube + mg.expectation(lambda w: w.abs(), q, 1000, seed=0))
    # a law without moments: auto-analytic leaves the term to the sampling tiers
    c = Cauchy(t(0.0), t(1.0))
    assert mg.explain(lambda w: w ** 2, c, method="auto-analytic").tiers == (mg.Tier.COLLAPSED,)


@pytest.mark.parametrize("fn, dist, reason", [
    (lambda w: w.abs(), Normal(t(0.0), t(1.0)), "not a polynomial in the noise"),
    (lambda w: w ** 2, Cauchy(t(0.0), t(1.0)), "Cauchy noise has no moments"),
    (lambda w: w ** 4, StudentT(t(3.0), t(0.0), t(1.0)), "exists only for ν > 3"),
    (lambda w: w ** -1, Gamma(t(0.5), t(1.0)), "infinite"),
    (lambda w: torch.log(w), Normal(t(1.0), t(0.1)), "log w under a location-scale form"),
    (lambda w: torch.logsumexp(w, 0), Normal(t(0.0, 1.0), t(1.0, 1.0)), "fn \\(whole integrand\\)"),
    (lambda w: w ** 2, Gamma(t(2.0).requires_grad_(), t(1.0)), "concentration requires grad"),
])
def test_refused_with_the_reason(fn, dist, reason):
    with pytest.raises(ValueError, match=f"method='analytic' does not apply.*{reason}"):
        mg.expectation(fn, dist, 10, method="analytic")


def test_moments_of_laws_are_registered():
    """Every noise law of a registered location-scale/scaling family knows whether it has moments."""
    from mcgraph.engine.noise.moments import LogMoments, PowerMoments

    for q in list(LOCATION_SCALE.values()) + list(SCALING.values()):
        assert isinstance(mg.family_of(q).noise.moments, (PowerMoments, LogMoments))
