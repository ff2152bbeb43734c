"""Standard errors of the engine's estimates (``return_stderr=True``).

Statistical checks: over R = 400 seeds the reported standard error must agree with the
empirical standard deviation of the estimates within 10 %. The comparison pools elements that
share a law: with n pooled replicates the relative sampling error of an SD is about
sqrt((2 + κ) / (4n)) (κ: excess kurtosis of the estimator, ≈ 0 at these M by the CLT), so
10 % is over 10 standard errors for the elementwise tiers (n = 400 · 48) and over 5 for the
whole-network data term (4 batches · 400 seeds): false-alarm rate below 1e-7 for each check.
``sqrt(mean stderr²)`` is compared, since E[stderr²] = Var(estimate) exactly.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.distributions import Gamma, Normal, ExpTransform, TransformedDistribution

import mcgraph as mg
import mcgraph.nn as mnn
from mcgraph.engine.stderr import SampleMoments, per_sample_moments

R = 400
P = 48


def _agreement(run, seeds=range(R)):
    """``(sqrt(mean reported stderr²), pooled empirical SD)`` over seeds and elements."""
    values, errors = [], []
    for seed in seeds:
        v, se, _ = run(seed)
        values.append(v.detach().double().reshape(-1))
        errors.append(se.double().reshape(-1))
    values, errors = torch.stack(values), torch.stack(errors)
    empirical = values.var(0, unbiased=True).mean().sqrt()
    reported = errors.square().mean().sqrt()
    return float(reported), float(empirical)


def _normal(P=P, dtype=torch.float64, mu=0.5, sigma=1.0):
    return Normal(torch.full((P,), mu, dtype=dtype, requires_grad=True), torch.full((P,), sigma, dtype=dtype))


CASES = {
    # tier: (fn, distribution, M)
    "collapsed": (lambda w: (w - 1) ** 3, _normal(), 1000),
    "collapsed-scaling": (lambda w: w ** 2 - 3 * torch.log(w), Gamma(torch.full((P,), 3.0, dtype=torch.float64),
                                                                    torch.full((P,), 2.0, dtype=torch.float64)), 500),
    "fused": (lambda w: torch.log1p(w.abs()), _normal(), 300),
    "chunked": (lambda w: torch.logsumexp(w.reshape(P, 4), -1), _normal(4 * P), 200),
    "per-sample (two correlated terms)": (lambda w: w ** 2 - 2 * w.abs(), _normal(mu=1.0), 300),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reported_stderr_matches_the_spread_over_400_seeds(name):
    fn, q, M = CASES[name]
    reported, empirical = _agreement(lambda s: mg.expectation(fn, q, M, seed=s, return_stderr=True))
    assert abs(reported / empirical - 1) < 0.10, (reported, empirical)


def test_the_tiers_are_the_ones_named():
    tiers = {name: mg.explain(fn, q).tiers for name, (fn, q, _) in CASES.items()}
    assert tiers["collapsed"] == (mg.Tier.COLLAPSED,) and tiers["collapsed-scaling"] == (mg.Tier.COLLAPSED,)
    assert tiers["fused"] == (mg.Tier.FUSED,) and tiers["chunked"] == (mg.Tier.CHUNKED,)
    assert set(tiers["per-sample (two correlated terms)"]) == {mg.Tier.COLLAPSED, mg.Tier.FUSED}
    assert "per-sample values of fn" in str(mg.explain(*CASES["per-sample (two correlated terms)"][:2]))


def test_covariance_between_terms_is_accounted_for():
    """w² and 2|w| share the noise and are strongly correlated: adding their variances is wrong."""
    q = _normal(mu=1.0)
    M = 300
    total = mg.expectation(lambda w: w ** 2 - 2 * w.abs(), q, M, seed=0, return_stderr=True)
    a = mg.expectation(lambda w: w ** 2, q, M, seed=0, return_stderr=True)
    b = mg.expectation(lambda w: 2 * w.abs(), q, M, seed=0, return_stderr=True)
    naive = (a.stderr ** 2 + b.stderr ** 2).sqrt()
    assert (naive > 2 * total.stderr).all()
    torch.testing.assert_close(total.value, a.value - b.value)
    # the total's error is that of the per-sample values of fn, exactly
    w = mg.family_of(q).sample(_rows(q, 0, M))
    vals = w ** 2 - 2 * w.abs()
    torch.testing.assert_close(total.stderr, vals.std(0) / math.sqrt(M))


def _rows(q, seed, M):
    from mcgraph.engine.estimators.sampling import stream_for

    return stream_for(mg.family_of(q), seed, M).rows(0, M)


@pytest.mark.parametrize("name", ["collapsed", "collapsed-scaling", "fused", "chunked"])
def test_stderr_equals_the_sample_sd_of_the_same_noise(name):
    """Same seed: the reported stderr is the per-sample values' SD / sqrt(M), whatever the tier."""
    fn, q, M = CASES[name]
    est = mg.expectation(fn, q, M, seed=3, return_stderr=True)
    form = mg.family_of(q)
    vals = torch.func.vmap(fn)(form.sample(_rows(q, 3, M)))
    torch.testing.assert_close(est.stderr, vals.std(0) / math.sqrt(M), rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(est.value, mg.expectation(fn, q, M, seed=3), rtol=1e-12, atol=1e-12)
    assert not est.stderr.requires_grad and est.value.requires_grad == q.mean.requires_grad


def test_value_and_gradient_unchanged_by_return_stderr():
    mu = torch.randn(5, dtype=torch.float64, requires_grad=True)
    q = Normal(mu, torch.ones(5, dtype=torch.float64))
    for fn in (lambda w: (w - 1) ** 3, lambda w: w.abs(), lambda w: w ** 2 - 2 * w.abs()):
        a = mg.expectation(fn, q, 64, seed=1)
        b = mg.expectation(fn, q, 64, seed=1, return_stderr=True).value
        torch.testing.assert_close(a, b)
        ga, = torch.autograd.grad(a.sum(), mu)
        gb, = torch.autograd.grad(b.sum(), mu)
        torch.testing.assert_close(ga, gb)


def test_collapsed_exact_reports_the_exact_sd_of_the_estimator():
    q = Normal(torch.tensor([0.3, -1.0], dtype=torch.float64), torch.tensor([0.5, 2.0], dtype=torch.float64))
    M = 100
    est = mg.expectation(lambda w: w ** 2 + w, q, M, seed=0, method="collapsed-exact", return_stderr=True)
    mu, s = q.loc, q.scale
    # w² + w = (μ² + μ) + (2μ + 1)σξ + σ²ξ²: Var = (2μ+1)²σ² + 2σ⁴
    exact = (((2 * mu + 1) ** 2 * s ** 2 + 2 * s ** 4) / M).sqrt()
    torch.testing.assert_close(est.stderr, exact, rtol=1e-12, atol=0)


def test_kl_stderr_closed_form_entropy_and_estimated_entropy():
    q = Normal(torch.zeros(P, dtype=torch.float64), torch.full((P,), 0.5, dtype=torch.float64))
    p = mg.distributions.ScaleMixtureNormal(pi=0.5, scale1=1.0, scale2=0.1)
    est = mg.kl_divergence(q, p, 200, seed=0, return_stderr=True)
    cross = mg.expectation(p.log_prob, q, 200, seed=0, return_stderr=True)
    torch.testing.assert_close(est.stderr, cross.stderr)   # the entropy is exact
    # no closed-form entropy: log q and log p share the noise, the error is that of their difference
    base = Normal(torch.zeros(P, dtype=torch.float64), torch.full((P,), 0.3, dtype=torch.float64))
    q2 = TransformedDistribution(base, [ExpTransform()])
    p2 = Gamma(torch.tensor(2.0, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64))
    reported, empirical = _agreement(lambda s: mg.kl_divergence(q2, p2, 200, seed=s, return_stderr=True))
    assert abs(reported / empirical - 1) < 0.10, (reported, empirical)
    value = mg.kl_divergence(q2, p2, 200, seed=0, return_stderr=True)
    torch.testing.assert_close(value.value, mg.kl_divergence(q2, p2, 200, seed=0))


def test_analytic_terms_have_zero_stderr():
    q = _normal(4)
    est = mg.expectation(lambda w: w ** 3 + w.abs(), q, 50, seed=0, method="auto-analytic", return_stderr=True)
    fused = mg.expectation(lambda w: w.abs(), q, 50, seed=0, return_stderr=True)
    torch.testing.assert_close(est.stderr, fused.stderr)   # the cubic is exact: only |w| contributes
    exact = mg.expectation(lambda w: w ** 3, q, 50, method="analytic", return_stderr=True)
    assert (exact.stderr == 0).all()


def test_bad_input():
    q = _normal(3)
    with pytest.raises(ValueError, match="num_samples must be >= 2 with return_stderr"):
        mg.expectation(lambda w: w ** 2, q, 1, return_stderr=True)
    with pytest.raises(ValueError, match="num_samples must be >= 2 with return_stderr"):
        mg.kl_divergence(q, Normal(0.0, 1.0), 1, return_stderr=True)
    with pytest.raises(TypeError, match="return_stderr"):
        mg.expectation(lambda w: w ** 2, q, 10, return_stderr=1)
    with pytest.raises(ValueError, match="taylor_order"):
        mg.expectation(lambda w: w.abs(), q, 10, taylor_order=2, return_stderr=True)
    est = mg.expectation(lambda w: w, q, 10, seed=0, return_stderr=True)
    with pytest.raises(ValueError, match="rel_error"):
        est.required_samples(0)
    one = SampleMoments()
    one.add(torch.ones(1, 3))
    assert torch.isnan(one.stderr()).all()        # internal: a single sample has no variance


def test_required_samples():
    q = Normal(torch.tensor([2.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64))
    est = mg.expectation(lambda w: w, q, 1000, seed=0, return_stderr=True)
    need = est.required_samples(0.001)
    expected = 1000 * (float(est.stderr) / (0.001 * float(est.value))) ** 2
    assert need == math.ceil(expected) and 200_000 < need < 300_000   # σ²/(0.001·μ)² = 250 000
    assert est.required_samples(10.0) == 2


def test_explain_states_the_variance_tuple():
    text = str(mg.explain(lambda w: (w - 1) ** 3, _normal(3)))
    assert "j ≤ 6" in text and "d_P = 27" in text
    assert "Σh² accumulated beside Σh" in str(mg.explain(lambda w: w.abs(), _normal(3)))
    assert "per-sample values" in str(mg.explain(lambda w: torch.logsumexp(w, 0), _normal(3)))


# --------------------------------------------------------------------------- the whole-network data term


def _net():
    torch.manual_seed(0)
    return mnn.bayesify(nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)), rho_init=-1.0,
                        kl_samples=64)


def test_data_term_stderr_matches_the_spread_over_400_seeds():
    net = _net()
    reported2, empirical2 = 0.0, 0.0
    for batch in range(4):
        g = torch.Generator().manual_seed(batch)
        x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
        with torch.no_grad():
            runs = [mnn.expected_data_term(net, x, y, num_samples=16, seed=s, return_stderr=True) for s in range(R)]
        v = torch.stack([r.value for r in runs]).double()
        se = torch.stack([r.stderr for r in runs]).double()
        reported2 += float(se.square().mean())
        empirical2 += float(v.var())
    assert abs(math.sqrt(reported2 / empirical2) - 1) < 0.10, (reported2, empirical2)


def test_elbo_terms_report_stderr_of_both_terms():
    net = _net()
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    mc = mg.Sampling(method="monte-carlo")  # the Normal prior's KL is exact by default: sample it here
    t = mnn.elbo_terms(net, x, y, num_samples=16, dataset_size=100, kl_weight=0.5, seed=0, return_stderr=True,
                       kl_samples=mc)
    plain = mnn.elbo_terms(net, x, y, num_samples=16, dataset_size=100, kl_weight=0.5, seed=0, kl_samples=mc)
    torch.testing.assert_close(t.elbo, plain.elbo)
    assert t.log_likelihood_stderr > 0 and t.kl_stderr > 0
    torch.testing.assert_close(t.elbo_stderr, (t.log_likelihood_stderr ** 2 + (0.5 * t.kl_stderr / 100) ** 2).sqrt())
    assert plain.kl_stderr is None
    exact = mnn.elbo_terms(net, x, y, num_samples=16, dataset_size=100, kl_weight=0.5, seed=0, return_stderr=True)
    assert exact.kl_stderr == 0 and torch.equal(exact.elbo_stderr, exact.log_likelihood_stderr)
    # the KL's error is that of the sum over every weight (independent noise per element and layer)
    est = mnn.kl(net, seed=7, method="monte-carlo", return_stderr=True)
    assert isinstance(est, mg.MCEstimate)  # one result type for an estimate with its standard error
    kl, se, m = est
    assert m == min(layer.kl_samples for layer in mnn.bayesian_modules(net))
    parts = []
    for i, layer in enumerate(mnn.bayesian_modules(net)):
        e = mg.kl_divergence(layer.posterior, layer.prior, layer.kl_samples,
                             seed=mg.engine.noise.streams.mix_seed(7, i), method="monte-carlo", return_stderr=True)
        parts.append(e.stderr.square().sum())
    torch.testing.assert_close(se, torch.stack(parts).sum().sqrt())
    torch.testing.assert_close(kl, mnn.kl(net, seed=7, method="monte-carlo"))
    t.elbo.backward()


def test_radial_kl_stderr_is_that_of_the_event_sum():
    layer = mnn.BayesLinear(6, 4, posterior="radial", prior="normal", kl_samples=50, rho_init=-1.0)
    reported, empirical = _agreement(lambda s: layer.kl(seed=s, method="monte-carlo", return_stderr=True),
                                     seeds=range(R))
    assert abs(reported / empirical - 1) < 0.15, (reported, empirical)   # 0-d: n = 400, SD error ≈ 3.5 %


def test_per_sample_moments_are_the_same_noise():
    q = _normal(3)
    m = per_sample_moments(mg.family_of(q), lambda w: w, 0, 10, 4)
    w = mg.family_of(q).sample(_rows(q, 0, 10))
    torch.testing.assert_close(m.stderr(), w.std(0) / math.sqrt(10))



def test_a_one_process_group_gives_the_one_process_standard_errors(tmp_path):
    """A group of one process is no split (``shard_for`` returns ``None``): standard errors are allowed
    and equal those without a group. (With more ranks they are refused: see ``refuse_with_process_group``.)"""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        q = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
        a = mg.expectation(lambda w: w.abs(), q, 10, seed=0, return_stderr=True, process_group=group)
        b = mg.expectation(lambda w: w.abs(), q, 10, seed=0, return_stderr=True)
        torch.testing.assert_close(a.value, b.value, rtol=0, atol=0)
        torch.testing.assert_close(a.stderr, b.stderr, rtol=0, atol=0)
        assert bool((a.stderr > 0).all())
    finally:
        dist.destroy_process_group()
