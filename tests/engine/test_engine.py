"""Engine contracts 2–5: graph size independent of M, unbiasedness against closed forms,
float64 gradcheck of every Function, and clear errors for bad input. Also the registry
and the tracer's classification of torch's log-densities."""

from __future__ import annotations

import math

import pytest
import torch
from torch import distributions as D

import mcgraph as mg
from mcgraph import distributions as mgd
from mcgraph.engine.plan.families import FAMILIES
from mcgraph.engine.plan.classify import Tier

from support.families_table import FAMILY_FACTORIES

F64 = torch.float64


def t64(x):
    return torch.tensor(x, dtype=F64)


# --------------------------------------------------------------------------- contract 2: graph size


def _normal_q(P, dtype=torch.float32):
    mu = torch.zeros(P, dtype=dtype, requires_grad=True)
    rho = torch.zeros(P, dtype=dtype, requires_grad=True)
    return lambda: D.Normal(mu, torch.nn.functional.softplus(rho))


def test_collapsed_graph_size_is_independent_of_M():
    q = _normal_q(100_000)
    sizes = [mg.graph_size(lambda: mg.kl_divergence(q(), D.Normal(0.0, 1.0), M, seed=0)) for M in (1, 10_000)]
    assert sizes[0] == sizes[1]
    assert sizes[0].saved_bytes < 10 * 100_000 * 4  # a handful of P-sized tensors, not M·P


def test_fused_graph_size_is_independent_of_M():
    # M = 10⁴ at P = 10⁵ takes ~1 min on 2 cores: see the slow test below; CI checks M = 1 vs 500.
    q = _normal_q(100_000)
    prior = mgd.ScaleMixtureNormal(0.5, 1.0, 1e-3)
    sizes = [mg.graph_size(lambda: mg.kl_divergence(q(), prior, M, seed=0, method="fused")) for M in (1, 500)]
    assert sizes[0] == sizes[1]


@pytest.mark.slow
def test_fused_graph_size_is_independent_of_M_at_1e4():
    q = _normal_q(100_000)
    sizes = [mg.graph_size(lambda: mg.expectation(torch.abs, q(), M, seed=0, method="fused")) for M in (1, 10_000)]
    assert sizes[0] == sizes[1]


def test_direct_graph_grows_with_M():
    q = _normal_q(10_000)
    small = mg.graph_size(lambda: mg.expectation(lambda w: w ** 2, q(), 1, seed=0, method="direct"))
    large = mg.graph_size(lambda: mg.expectation(lambda w: w ** 2, q(), 100, seed=0, method="direct"))
    assert large.saved_bytes > 50 * small.saved_bytes


def test_graph_size_of_a_tensor_equals_that_of_the_callable():
    q = _normal_q(1000)
    out = mg.expectation(lambda w: w ** 2, q(), 10, seed=0)
    assert mg.graph_size(out) == mg.graph_size(lambda: mg.expectation(lambda w: w ** 2, q(), 10, seed=0))
    with pytest.raises(TypeError, match="tensor_or_callable"):
        mg.graph_size(3)


# --------------------------------------------------------------------------- contract 3: unbiased
#
# Each test uses R independent replicates of the estimator (R identical elements of a batch,
# each with its own noise) and a two-sided z-test at |z| < 4.5: false-alarm rate 7e-6 per test.
# Seeds are fixed, so the tests are deterministic; the rate says how unlucky a seed would have
# to be for a correct estimator to fail.

Z = 4.5


def _assert_unbiased(estimates: torch.Tensor, truth: torch.Tensor):
    err = (estimates - truth).reshape(-1)
    se = err.std() / math.sqrt(err.numel())
    z = float(err.mean() / se)
    assert abs(z) < Z, f"biased: z = {z:.2f} (mean error {float(err.mean()):.3g}, se {float(se):.3g})"


@pytest.mark.parametrize("method", ["monte-carlo", "collapsed-exact", "direct"])
def test_normal_normal_kl_is_unbiased(method):  # the sampling methods ("auto" is torch's closed form here)
    R, M = 4000, 20
    q = D.Normal(torch.full((R,), 0.3, dtype=F64), torch.full((R,), 0.7, dtype=F64))
    p = D.Normal(t64(-0.2), t64(1.3))
    _assert_unbiased(mg.kl_divergence(q, p, M, seed=1, method=method), D.kl_divergence(q, p))


def test_expected_abs_is_unbiased_fused():
    R, M = 4000, 20
    mu, s = 0.4, 0.9
    q = D.Normal(torch.full((R,), mu, dtype=F64), torch.full((R,), s, dtype=F64))
    truth = s * math.sqrt(2 / math.pi) * math.exp(-mu ** 2 / (2 * s ** 2)) + mu * (1 - 2 * D.Normal(0., 1.).cdf(
        torch.tensor(-mu / s)).item())
    est = mg.expectation(torch.abs, q, M, seed=2)
    assert mg.explain(torch.abs, q).tiers == (Tier.FUSED,)
    _assert_unbiased(est, torch.full_like(est, truth))


def test_lognormal_lognormal_kl_is_unbiased():
    R, M = 4000, 20
    q = D.LogNormal(torch.full((R,), 0.5, dtype=F64), torch.full((R,), 0.4, dtype=F64))
    p = D.LogNormal(t64(0.0), t64(1.0))
    truth = D.kl_divergence(D.Normal(q.loc, q.scale), D.Normal(p.loc, p.scale))
    assert mg.explain(p.log_prob, q).tiers == (Tier.COLLAPSED,)
    _assert_unbiased(mg.kl_divergence(q, p, M, seed=3, method="monte-carlo"), truth)


def test_gamma_prior_under_exponential_q_is_unbiased():
    R, M = 4000, 20
    lam, k, r = 1.7, 2.5, 1.5
    q = D.Exponential(torch.full((R,), lam, dtype=F64))
    p = D.Gamma(t64(k), t64(r))
    # E_q[w] = 1/λ, E_q[log w] = −γ − log λ.
    e_log = -0.5772156649015329 - math.log(lam)
    truth = (k - 1) * e_log - r / lam + k * math.log(r) - math.lgamma(k)
    est = mg.expectation(p.log_prob, q, M, seed=4)
    assert mg.explain(p.log_prob, q).tiers == (Tier.COLLAPSED,)
    _assert_unbiased(est, torch.full_like(est, truth))


def test_radial_normal_cross_entropy_is_unbiased():
    R, Dm, M = 2000, 6, 20
    mu = torch.linspace(-1, 1, Dm, dtype=F64)
    sigma = torch.linspace(0.2, 0.8, Dm, dtype=F64)
    q = mgd.Radial(mu, sigma).expand((R,))
    m, s = 0.1, 1.2
    p = D.Normal(t64(m), t64(s))
    # E[ξ_j²] = E[r²]/D for radial noise, E[ξ_j] = 0.
    truth = (-0.5 * math.log(2 * math.pi * s ** 2) - ((mu - m) ** 2 + sigma ** 2 / Dm) / (2 * s ** 2)).sum()
    est = mg.expectation(lambda w: p.log_prob(w).sum(-1), q, M, seed=5)
    assert est.shape == (R,)
    _assert_unbiased(est, torch.full_like(est, float(truth)))


def test_exact_statistics_match_the_chunked_statistics_in_law():
    # Mean and variance of the collapsed estimate of E[w²] over replicates agree between the
    # chunked statistics and the exact-law draw (F-test on the variances at the same false-alarm spirit).
    R, M = 4000, 10
    q = D.Normal(torch.full((R,), 0.5, dtype=F64), torch.full((R,), 1.0, dtype=F64))
    a = mg.expectation(lambda w: w ** 2, q, M, seed=7, method="collapsed")
    b = mg.expectation(lambda w: w ** 2, q, M, seed=7, method="collapsed-exact")
    assert not torch.allclose(a, b)  # same law, different numbers
    # Var of the estimator: Var(w²)/M = (2σ⁴ + 4μ²σ²)/M = 0.3.
    for est in (a, b):
        _assert_unbiased(est, torch.full_like(est, 1.25))
        assert abs(float(est.var()) / 0.3 - 1) < 0.15  # 2·sqrt(2/R)·… : 4.7 sd of the sample variance


def test_taylor_is_opt_in_and_reported_as_approximate():
    q = D.Normal(torch.full((4,), 2.0, dtype=F64), torch.full((4,), 0.05, dtype=F64))
    plan = mg.explain(torch.log, q, taylor_order=3)
    assert plan.terms[0].approximate and "APPROXIMATE" in str(plan)
    assert mg.explain(torch.log, q).tiers == (Tier.FUSED,)
    est = mg.expectation(torch.log, q, 2000, seed=0, taylor_order=3)
    exact = mg.expectation(torch.log, q, 2000, seed=0)
    torch.testing.assert_close(est, exact, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fn, expansion", [
    # |w| near μ > 0: h' = sign(μ) is constant, so h'' and every later derivative vanish.
    (torch.abs, lambda w, mu: mu.abs() + mu.sign() * (w - mu)),
    # A cubic times a constant beyond the fused term's reach: the expansion ends at order 3.
    (lambda w: torch.abs(w) * w ** 2, lambda w, mu: mu.abs() * mu ** 2
     + 3 * mu ** 2 * (w - mu) + 3 * mu * (w - mu) ** 2 + (w - mu) ** 3),
])
def test_taylor_terms_whose_derivatives_vanish_end_the_expansion_early(fn, expansion):
    """``taylor_order`` above the integrand's last non-zero derivative gives that finite expansion."""
    mu = torch.linspace(1.0, 3.0, 5, dtype=F64).requires_grad_()
    sigma = torch.full((5,), 0.1, dtype=F64, requires_grad=True)
    q = D.Normal(mu, sigma)
    est = mg.expectation(fn, q, 500, seed=3, taylor_order=5)
    ref = mg.expectation(lambda w: expansion(w, mu), q, 500, seed=3, method="direct")
    torch.testing.assert_close(est, ref, rtol=1e-9, atol=1e-12)
    g_est = torch.autograd.grad(est.sum(), (mu, sigma))
    g_ref = torch.autograd.grad(ref.sum(), (mu, sigma))
    for a, b in zip(g_est, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------- contract 4: gradcheck


@pytest.mark.parametrize("method", ["collapsed", "fused", "chunked", "direct"])
def test_gradcheck_of_every_tier(method):
    mu = torch.randn(3, dtype=F64, requires_grad=True)
    rho = torch.randn(3, dtype=F64, requires_grad=True)
    prior_scale = torch.tensor(1.3, dtype=F64, requires_grad=True)
    fn_by_method = {"collapsed": lambda w: (w - 1) ** 3, "fused": None, "chunked": None, "direct": None}

    def f(mu, rho, prior_scale):
        q = D.Normal(mu, torch.nn.functional.softplus(rho))
        p = D.Laplace(torch.tensor(0.2, dtype=F64), prior_scale)
        fn = fn_by_method[method] or p.log_prob
        return mg.expectation(fn, q, 9, seed=3, method=method, chunk_size=4)

    inputs = (mu, rho, prior_scale) if method != "collapsed" else (mu, rho, prior_scale.detach())
    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("family", ["normal", "radial", "lognormal"])
def test_gradcheck_of_collapsed_with_prior_tensors(family):
    mu = torch.randn(3, dtype=F64, requires_grad=True)
    rho = torch.randn(3, dtype=F64, requires_grad=True)
    loc = torch.tensor(0.3, dtype=F64, requires_grad=True)
    scale = torch.tensor(1.4, dtype=F64, requires_grad=True)
    make_q = {"normal": D.Normal, "radial": mgd.Radial, "lognormal": D.LogNormal}[family]
    make_p = D.LogNormal if family == "lognormal" else D.Normal

    def f(mu, rho, loc, scale):
        q = make_q(mu, torch.nn.functional.softplus(rho))
        return mg.kl_divergence(q, make_p(loc, scale), 9, seed=2, method="collapsed")

    assert torch.autograd.gradcheck(f, (mu, rho, loc, scale))


def test_gradcheck_of_the_generic_rsample_path():
    # A concentration that requires grad sends Gamma to the generic rsample path. Only the rate is
    # gradchecked: torch's implicit-reparameterisation gradient in the concentration is not the
    # derivative of the rejection sampler at a fixed RNG state, so finite differences disagree with it.
    conc = torch.tensor([0.8, 1.6], dtype=F64, requires_grad=True)
    rate = torch.tensor([1.2, 0.7], dtype=F64, requires_grad=True)

    def f(rate):
        return mg.expectation(lambda w: w ** 2 + w.log(), D.Gamma(conc, rate), 5, seed=1, chunk_size=2)

    assert mg.explain(lambda w: w ** 2, D.Gamma(conc, rate)).tiers == (Tier.CHUNKED,)
    assert torch.autograd.gradcheck(f, (rate,))


# --------------------------------------------------------------------------- contract 5: bad input


@pytest.fixture
def q():
    return D.Normal(torch.zeros(3), torch.ones(3))


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError),
                                     ("10", TypeError), (None, TypeError)])
def test_num_samples_is_validated(q, bad, exc):
    with pytest.raises(exc, match="num_samples"):
        mg.expectation(torch.abs, q, bad)
    with pytest.raises(exc, match="num_samples"):
        mg.kl_divergence(q, D.Normal(0.0, 1.0), bad)


def test_non_finite_parameters_are_rejected():
    q = D.Normal(torch.tensor([0.0, float("nan")]), torch.ones(2), validate_args=False)
    with pytest.raises(ValueError, match=r"dist: parameter dist\.loc has non-finite"):
        mg.expectation(torch.abs, q, 4)
    p = D.Normal(torch.tensor(float("inf")), torch.tensor(1.0), validate_args=False)
    with pytest.raises(ValueError, match=r"p: parameter p\.loc"):
        mg.kl_divergence(D.Normal(torch.zeros(2), torch.ones(2)), p, 4)


def test_fn_whose_output_cannot_broadcast(q):
    with pytest.raises(ValueError, match="fn failed on a sample of shape"):
        mg.expectation(lambda w: w + torch.ones(7), q, 4)
    with pytest.raises(TypeError, match="fn must return a tensor"):
        mg.expectation(lambda w: "x", q, 4)
    with pytest.raises(TypeError, match="fn must be callable"):
        mg.expectation(3, q, 4)


def test_prior_shape_mismatch_names_p(q):
    with pytest.raises(ValueError, match=r"p: shape \(7,\)"):
        mg.kl_divergence(q, D.Normal(torch.zeros(7), torch.ones(7)), 4)


def test_distribution_without_family_or_rsample():
    with pytest.raises(NotImplementedError, match="Bernoulli"):
        mg.expectation(lambda w: w, D.Bernoulli(torch.tensor([0.3])), 4)
    with pytest.raises(TypeError, match="dist must be a torch.distributions.Distribution"):
        mg.expectation(lambda w: w, torch.zeros(3), 4)


def test_bad_method_chunk_seed_and_taylor(q):
    with pytest.raises(ValueError, match="method must be one of"):
        mg.expectation(torch.abs, q, 4, method="fast")
    with pytest.raises(ValueError, match="chunk_size"):
        mg.expectation(torch.abs, q, 4, chunk_size=0)
    with pytest.raises(ValueError, match="seed"):
        mg.expectation(torch.abs, q, 4, seed=-1)
    with pytest.raises(ValueError, match="taylor_order"):
        mg.expectation(torch.abs, q, 4, taylor_order=0)
    with pytest.raises(ValueError, match="collapsed-exact"):
        mg.expectation(torch.abs, q, 4, method="collapsed-exact")
    with pytest.raises(ValueError, match="collapsed-exact"):
        mg.expectation(lambda w: w ** 3, q, 4, method="collapsed-exact")


def test_seed_none_follows_torch_manual_seed(q):
    torch.manual_seed(0)
    a = mg.expectation(torch.abs, q, 10)
    torch.manual_seed(0)
    b = mg.expectation(torch.abs, q, 10)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_caller_rng_state_is_untouched(q):
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    mg.expectation(torch.abs, q, 10, seed=4)
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)


# --------------------------------------------------------------------------- registry and tracing


def test_every_registered_family_resolves_to_a_form():
    for dist_type in FAMILIES.registered():
        assert dist_type in FAMILY_FACTORIES, f"no test factory for registered family {dist_type.__name__}"
        q = FAMILY_FACTORIES[dist_type][0](torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64))
        form = mg.family_of(q)
        assert isinstance(form, (mg.SamplingForm, mg.GenericForm))
        assert tuple(form.shape) == tuple(q.batch_shape + q.event_shape)


def test_a_new_family_is_one_class_plus_one_registration():
    class ShiftedExponential(D.Distribution):
        arg_constraints = {}
        has_rsample = True

        def __init__(self, shift, rate):
            self.shift, self.rate = shift, rate
            super().__init__(shift.shape, validate_args=False)

        def rsample(self, sample_shape=torch.Size()):
            raise AssertionError("the engine must not call rsample for a registered family")

    from mcgraph.engine.noise.laws import STANDARD_EXPONENTIAL

    @mg.register_family(ShiftedExponential)
    def _rule(d):
        return mg.SamplingForm(noise=STANDARD_EXPONENTIAL, loc=d.shift, scale=d.rate.reciprocal(),
                               shape=d.batch_shape)

    shift = torch.full((2000,), 1.0, dtype=F64)
    rate = torch.full((2000,), 2.0, dtype=F64)
    q = ShiftedExponential(shift, rate)
    assert mg.explain(lambda w: w ** 2, q).tiers == (Tier.COLLAPSED,)
    est = mg.expectation(lambda w: w, q, 10, seed=0)
    _assert_unbiased(est, torch.full_like(est, 1.5))


def test_register_integrand_declares_an_elementwise_op():
    q = D.Normal(torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64))
    assert mg.explain(torch.special.bessel_j0, q).tiers == (Tier.CHUNKED,)
    mg.register_integrand("special_bessel_j0")
    try:
        assert mg.explain(torch.special.bessel_j0, q).tiers == (Tier.FUSED,)
        a = mg.expectation(torch.special.bessel_j0, q, 16, seed=0)
        b = mg.expectation(torch.special.bessel_j0, q, 16, seed=0, method="direct")
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    finally:
        from mcgraph.engine.plan.ops import OPS
        OPS.pop("special_bessel_j0")


def _poly_of(fn, q):
    traced = mg.trace(fn, q.sample())
    (piece,) = traced.expr.pieces
    return piece.expr


def test_torch_log_densities_trace_to_the_paper_terms():
    q = D.Normal(torch.zeros(3), torch.ones(3))
    normal = _poly_of(D.Normal(0.5, 2.0).log_prob, q)
    assert set(normal.poly) == {(0, 0), (1, 0), (2, 0)} and not normal.programs
    qp = D.Exponential(torch.ones(3))
    gamma = _poly_of(D.Gamma(2.0, 3.0).log_prob, qp)
    assert set(gamma.poly) == {(0, 0), (0, 1), (1, 0)} and not gamma.programs
    lognormal = _poly_of(D.LogNormal(0.1, 0.7).log_prob, qp)
    assert set(lognormal.poly) == {(0, 0), (0, 1), (0, 2)} and not lognormal.programs
    laplace = _poly_of(D.Laplace(0.0, 1.0).log_prob, q)
    assert laplace.programs


def test_explain_reports_tier_tuple_dp_and_reasons():
    q = D.Normal(torch.zeros(3), torch.ones(3))
    plan = mg.explain(lambda w: (w - 1) ** 3 + torch.abs(w), q)
    text = str(plan)
    assert plan.tiers == (Tier.COLLAPSED, Tier.FUSED)
    assert plan.terms[0].d_P == math.comb(3 + 2, 2) - 1  # Cor. 3, K = 3, S = 2
    assert "n(θ) = (μ^(k−j) σ^j)" in text and "not collapsible" in text and "d_P = 9" in text
    assert mg.explain(lambda w: w ** 4, q).terms[0].d_P == 5  # Thm 2, S = 2: C(k+1, 1)
    scaling = mg.explain(lambda w: w ** 3, D.Exponential(torch.ones(3)))
    assert scaling.terms[0].d_P == 1  # Thm 1
    opaque = mg.explain(lambda w: torch.softmax(w, 0), q)
    assert opaque.tiers == (Tier.CHUNKED,) and "softmax" in str(opaque)
    with pytest.raises(AttributeError):
        plan.terms = ()  # frozen


def test_data_dependent_control_flow_goes_chunked_and_stays_correct():
    def fn(w):
        return w.sum() if bool(w.sum() > 0) else -w.sum()

    q = D.Normal(torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64))
    assert mg.explain(fn, q).tiers == (Tier.CHUNKED,)
    a = mg.expectation(fn, q, 20, seed=0)
    b = mg.expectation(fn, q, 20, seed=0, method="direct")
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("make_q,make_p,shape", [
    (lambda: mgd.Radial(torch.zeros(3, 4, dtype=F64), torch.ones(3, 4, dtype=F64)),
     lambda: D.Normal(t64(0.0), t64(1.0)), ()),
    (lambda: D.Independent(D.Normal(torch.zeros(3, 4, dtype=F64), torch.ones(3, 4, dtype=F64)), 1),
     lambda: D.Normal(t64(0.0), t64(1.0)), (3,)),
    (lambda: D.Independent(D.Normal(torch.zeros(3, 4, dtype=F64), torch.ones(3, 4, dtype=F64)), 1),
     lambda: D.Independent(D.Normal(torch.zeros(4, dtype=F64), torch.ones(4, dtype=F64)), 1), (3,)),
    (lambda: D.Normal(torch.zeros(3, 4, dtype=F64), torch.ones(3, 4, dtype=F64)),
     lambda: D.Laplace(torch.zeros(4, dtype=F64), torch.ones(4, dtype=F64)), (3, 4)),
])
def test_kl_follows_torch_shape_semantics(make_q, make_p, shape):
    assert mg.kl_divergence(make_q(), make_p(), 8, seed=0).shape == torch.Size(shape)  # exact where exact exists
    kl = mg.kl_divergence(make_q(), make_p(), 8, seed=0, method="monte-carlo")
    assert kl.shape == torch.Size(shape)
    ref = mg.kl_divergence(make_q(), make_p(), 8, seed=0, method="direct")
    torch.testing.assert_close(kl, ref, rtol=1e-9, atol=1e-9)


def test_kl_matches_torch_closed_form_for_independent_normals():
    q = D.Independent(D.Normal(torch.full((4000, 3), 0.2, dtype=F64), torch.full((4000, 3), 0.5, dtype=F64)), 1)
    p = D.Independent(D.Normal(torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64)), 1)
    _assert_unbiased(mg.kl_divergence(q, p, 16, seed=2, method="monte-carlo"), D.kl_divergence(q, p))
    torch.testing.assert_close(mg.kl_divergence(q, p, 16, seed=2), D.kl_divergence(q, p), rtol=0, atol=0)


@pytest.mark.parametrize("fn", [
    lambda w: w.clone().add_(1.0) ** 2,
    lambda w: (lambda v: (v.__iadd__(1.0), v ** 2)[1])(w.clone()),
])
def test_in_place_ops_are_not_traced_but_still_correct(fn):
    q = D.Normal(torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64))
    assert mg.explain(fn, q).tiers == (Tier.CHUNKED,)
    a = mg.expectation(fn, q, 20, seed=0)
    b = mg.expectation(fn, q, 20, seed=0, method="direct")
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_detach_inside_fn_is_respected():
    fn = lambda w: w.detach() * w  # noqa: E731  gradient flows through one factor only
    mu = torch.zeros(3, dtype=F64, requires_grad=True)
    grads = []
    for method in ("auto", "direct"):
        e = mg.expectation(fn, D.Normal(mu, torch.ones(3, dtype=F64)), 16, seed=0, method=method)
        grads.append(torch.autograd.grad(e.sum(), mu)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fn", [
    lambda w: 0.562 * (w + (w > 0).int()),
    lambda w: (w - (w > 0.3).long()) / 3.0,
    lambda w: 0.3 * ((w > 0).sum() + w.sum()),
    lambda w: 0.7 * (w ** 2 + (w > 0).sum(-1, keepdim=True)),
], ids=["int", "long-divided", "reduced count", "broadcast count"])
def test_a_constant_distributed_over_a_sum_meets_the_sums_dtype(fn):
    """``c · (w + k)`` with an integer ``k``: torch computes the sum in w's float64, so the engine's
    ``c · k`` term must be float64 too, not ``int × float`` in torch's default float32."""
    q = D.Normal(t64([0.1, -0.3, 0.2]), t64([1.0, 0.5, 2.0]))
    a = mg.expectation(fn, q, 40, seed=3)
    b = mg.expectation(fn, q, 40, seed=3, method="direct")
    assert a.dtype == b.dtype == F64
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", ["fused", "auto"])
def test_a_traced_polynomial_does_not_overflow_where_its_factored_form_does_not(method):
    """log1p((0.125·w)³ + w) at w ≈ 1e13 in float32: the trace expands the argument to 0.00195·w³ + w, and
    w³ (1.2e39) overflows float32 where (0.125·w)³ (2.3e36) does not. The fused tier evaluates the polynomial
    by Horner's rule, so value and gradients equal direct's on the same noise."""
    def fn(w):
        return torch.log1p((0.125 * w) ** 3 + w)

    def run(how):
        loc = torch.full((4,), 30.0, requires_grad=True)  # w = exp(30 + 0.01·ε) ≈ 1.1e13
        scale = torch.full((4,), 0.01, requires_grad=True)
        out = mg.expectation(fn, torch.distributions.LogNormal(loc, scale), 7, seed=3, method=how)
        return (out, *torch.autograd.grad(out.sum(), (loc, scale)))

    direct, got = run("direct"), run(method)
    assert all(torch.isfinite(t).all() for t in direct)
    for a, b in zip(direct, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    plan = mg.explain(fn, torch.distributions.LogNormal(torch.full((4,), 30.0), torch.full((4,), 0.01)))
    assert [str(t) for t in plan.tiers] == ["fused"]


def test_tracing_patches_no_torch_class_while_another_thread_validates():
    """A distribution built inside the integrand validates the traced sample's real value without
    ``Distribution._validate_sample`` being replaced: another thread validating meanwhile sees torch's."""
    import threading

    from mcgraph.engine.plan import cache as plan_cache

    original = D.Distribution.__dict__["_validate_sample"]
    seen, refused, stop = [], [], threading.Event()

    def validate_elsewhere():
        half = D.HalfNormal(1.0, validate_args=True)
        while not stop.is_set():
            seen.append(D.Distribution.__dict__["_validate_sample"] is original)
            try:
                half.log_prob(torch.tensor(-1.0))
            except ValueError:
                refused.append(True)

    q = D.Normal(torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64))
    other = threading.Thread(target=validate_elsewhere)
    other.start()
    try:
        for i in range(20):
            def fn(w, i=i):
                seen.append(D.Distribution.__dict__["_validate_sample"] is original)
                return D.Normal(float(i), 1.0, validate_args=True).log_prob(w)

            with plan_cache.disabled():
                assert mg.explain(fn, q).tiers == (Tier.COLLAPSED,)
    finally:
        stop.set()
        other.join()
    assert seen and all(seen)
    assert refused  # the other thread's validation ran, and refused the value outside the support
