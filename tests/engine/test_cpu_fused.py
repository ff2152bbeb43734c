"""The compiled CPU loop for registered prior log-densities (:mod:`mcgraph.engine.estimators.cpu_fused`).

Every density and form kind is checked against the naive direct estimator with the same seed (same
noise): the value and the gradients in q's parameters and in the prior's. The loop sums in float64, so
float64 agrees to ~1e-12 and float32 to float32 rounding of a 1000-term mean.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.native_fallback import assert_runs_without_compiler
import torch.distributions as D

import mcgraph as mg
from mcgraph.distributions import Logistic, LogUniform, ScaleMixtureNormal
from mcgraph.engine.estimators import cpu_fused

pytestmark = pytest.mark.skipif(cpu_fused.library() is None, reason="no C++ compiler")

M = 400
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-4, atol=2e-4)}


def _numbers(dtype, grad: bool, made: list | None):
    """``x -> `` a 0-d tensor of ``dtype`` that requires grad when ``grad`` (and is appended to ``made``)."""
    def number(x):
        t = torch.tensor(x, dtype=dtype, requires_grad=grad)
        if made is not None:
            made.append(t)
        return t
    return number


def _real_priors(dtype, grad: bool, made: list | None = None):
    """Priors on the real line, with parameters that require grad when ``grad`` (each appended to ``made``)."""
    t = _numbers(dtype, grad, made)
    return {
        "normal": lambda: D.Normal(t(0.2), t(1.3)),
        "laplace": lambda: D.Laplace(t(-0.1), t(0.7)),
        "logistic": lambda: Logistic(t(0.3), t(0.9)),
        "cauchy": lambda: D.Cauchy(t(0.1), t(1.1)),
        "student_t": lambda: D.StudentT(t(3.5), t(0.2), t(0.8)),
        "scale_mixture": lambda: ScaleMixtureNormal(t(0.3), t(1.0), t(0.05), loc=t(0.01)),
    }


def _positive_priors(dtype, grad: bool, made: list | None = None):
    """Priors on w > 0 (as :func:`_real_priors`)."""
    t = _numbers(dtype, grad, made)
    return {
        "gamma": lambda: D.Gamma(t(2.5), t(1.5)),
        "log_normal": lambda: D.LogNormal(t(-0.2), t(0.6)),
        "inverse_gamma": lambda: D.InverseGamma(t(3.0), t(2.0)),
    }


def _leaves(shape, dtype):
    g = torch.Generator().manual_seed(1)
    loc = (0.5 * torch.randn(shape, generator=g, dtype=dtype)).requires_grad_()
    raw = (0.3 * torch.randn(shape, generator=g, dtype=dtype) - 1.0).requires_grad_()
    return loc, raw


def _posteriors(dtype):
    """``name -> (make q from (loc, raw), prior support)``: location-scale, scaling and exp forms."""
    sp = torch.nn.functional.softplus
    return {
        "normal": (lambda loc, raw: D.Normal(loc, sp(raw)), "real"),
        "laplace": (lambda loc, raw: D.Laplace(loc, sp(raw)), "real"),
        "uniform": (lambda loc, raw: D.Uniform(loc, loc + sp(raw)), "real"),
        "log_normal": (lambda loc, raw: D.LogNormal(loc, sp(raw)), "positive"),
        "half_normal": (lambda loc, raw: D.HalfNormal(sp(raw) + loc.detach().abs()), "positive"),
        "exponential": (lambda loc, raw: D.Exponential(sp(raw)), "positive"),
    }


def _grads(value, tensors):
    ts = [t for t in tensors if t.requires_grad]
    return torch.autograd.grad(value.sum(), ts, allow_unused=True, retain_graph=True)


def _compare(q, p, tensors, dtype, seed=3, extra=0) -> int:
    """Asserts the loop's value and gradients equal the direct estimator's; returns how many gradients (of
    ``tensors``) both give, after checking that they give the same ones."""
    form = mg.family_of(q)
    ours = cpu_fused.log_prob_expectation(form, p, M, seed, method="fused", sum_rightmost=extra)
    assert ours is not None, "the compiled loop should apply"
    log_p = (lambda w: p.log_prob(w).sum(tuple(range(-extra, 0)))) if extra else p.log_prob
    direct = mg.expectation(log_p, q, M, seed=seed, method="direct")
    assert ours.dtype == direct.dtype == dtype and ours.shape == direct.shape
    torch.testing.assert_close(ours, direct, **TOL[dtype])
    pairs = list(zip(_grads(ours, tensors), _grads(direct, tensors)))
    assert [a is None for a, _ in pairs] == [b is None for _, b in pairs]
    for a, b in pairs:
        if a is not None:
            torch.testing.assert_close(a, b, **TOL[dtype])
    return sum(a is not None for a, _ in pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("prior_grad", [False, True], ids=["prior-fixed", "prior-grad"])
@pytest.mark.parametrize("posterior", ["normal", "laplace", "uniform", "log_normal", "half_normal", "exponential"])
def test_same_value_and_gradients_as_direct(posterior, prior_grad, dtype):
    make_q, support = _posteriors(dtype)[posterior]
    made = []  # the prior parameters, as each prior is built
    priors = (_real_priors if support == "real" else _positive_priors)(dtype, prior_grad, made)
    if support == "positive":  # a real-line prior is fine on w > 0 too
        priors.update({k: v for k, v in _real_priors(dtype, prior_grad, made).items()
                       if k in ("laplace", "student_t")})
    for name, make_p in priors.items():
        loc, raw = _leaves((3, 5), dtype)
        made.clear()
        p = make_p()
        params = [t for t in made if t.requires_grad]
        assert len(params) == (len(made) if prior_grad else 0) and made
        # q's scale (raw) and every prior parameter that requires grad; q's loc where q has one
        assert _compare(make_q(loc, raw), p, [loc, raw, *params], dtype) >= 1 + len(params), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_uniform_prior(dtype):
    loc, raw = _leaves((7,), dtype)
    q = D.Normal(loc, torch.nn.functional.softplus(raw))
    assert _compare(q, LogUniform(), [loc, raw], dtype) == 2


@pytest.mark.parametrize("prior_shape", [(), (5,), (3, 1), (3, 5)])
def test_prior_parameters_broadcast(prior_shape):
    dtype = torch.float64
    loc, raw = _leaves((3, 5), dtype)
    scale = (torch.rand(prior_shape, dtype=dtype) + 0.5).requires_grad_()
    p = D.StudentT(torch.full(prior_shape, 4.0, dtype=dtype), torch.zeros(prior_shape, dtype=dtype), scale)
    assert _compare(D.Normal(loc, torch.nn.functional.softplus(raw)), p, [loc, raw, scale], dtype) == 3


def test_posterior_parameters_broadcast_and_strided():
    dtype = torch.float64
    loc = torch.randn(5, 3, dtype=dtype).requires_grad_()
    raw = torch.randn(1, dtype=dtype).requires_grad_()
    q = D.Normal(loc.t(), torch.nn.functional.softplus(raw))  # a transposed loc, one scale for all
    assert _compare(q, D.Laplace(0.0, torch.tensor(1.0, dtype=dtype)), [loc, raw], dtype) == 2


def test_independent_prior_and_extra_event_dims():
    dtype = torch.float64
    loc, raw = _leaves((4, 6), dtype)
    q = D.Independent(D.Normal(loc, torch.nn.functional.softplus(raw)), 2)
    p = D.Independent(D.Laplace(torch.zeros(6, dtype=dtype), torch.ones(6, dtype=dtype)), 1)
    assert _compare(q, p, [loc, raw], dtype, extra=1) == 2
    kl = mg.kl_divergence(q, p, M, seed=3, method="monte-carlo")
    assert kl.shape == ()


def test_kl_divergence_takes_the_loop_and_matches_direct(monkeypatch):
    calls = []
    original = cpu_fused.log_prob_expectation
    monkeypatch.setattr(cpu_fused, "log_prob_expectation", lambda *a, **k: calls.append(1) or original(*a, **k))
    loc, raw = _leaves((20,), torch.float32)
    q = D.Normal(loc, torch.nn.functional.softplus(raw))
    p = ScaleMixtureNormal(0.5, 1.0, 0.002)
    kl = mg.kl_divergence(q, p, 1000, seed=11)
    direct = mg.kl_divergence(q, p, 1000, seed=11, method="direct")
    assert calls and kl.grad_fn is not None
    torch.testing.assert_close(kl, direct, rtol=1e-4, atol=1e-4)
    for a, b in zip(_grads(kl, [loc, raw]), _grads(direct, [loc, raw])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_polynomial_densities_keep_the_exact_and_collapsed_tiers():
    """A density with a polynomial term (a Normal prior: all of it) keeps the exact tier under "auto" and the
    collapsed tier under "monte-carlo" (the same graph at every M); "fused" asks for the fused tier."""
    loc, raw = _leaves((4,), torch.float64)
    q = D.Laplace(loc, torch.nn.functional.softplus(raw))  # no closed form for Laplace ‖ Normal in torch
    form = mg.family_of(q)
    p = D.Normal(0.0, torch.tensor(2.0, dtype=torch.float64))
    assert cpu_fused.log_prob_expectation(form, p, M, 0, method="auto") is None
    assert cpu_fused.log_prob_expectation(form, p, M, 0, method="monte-carlo") is None
    assert cpu_fused.log_prob_expectation(form, p, M, 0, method="fused") is not None
    assert mg.explain(q, p).exact  # E_q[log p] exact, entropy in closed form
    sizes = [mg.graph_size(lambda m=m: mg.kl_divergence(D.Normal(loc, torch.nn.functional.softplus(raw)), p, m,
                                                        seed=0, method="monte-carlo")) for m in (1, 10_000)]
    assert sizes[0] == sizes[1]


def test_one_and_two_threads_give_the_same_bits():
    loc, raw = _leaves((600,), torch.float32)  # several tiles, enough draws for the parallel loop
    q = D.Normal(loc, torch.nn.functional.softplus(raw))
    p = D.StudentT(torch.tensor(3.0), 0.0, 1.0)
    threads = torch.get_num_threads()
    try:
        out = []
        for n in (1, 2):
            torch.set_num_threads(n)
            v = cpu_fused.log_prob_expectation(mg.family_of(q), p, 200, 5)
            out.append((v, *_grads(v, [loc, raw])))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*out))


def test_not_applied_outside_its_scope():
    loc, raw = _leaves((10,), torch.float64)
    sp = torch.nn.functional.softplus
    normal = mg.family_of(D.Normal(loc, sp(raw)))
    laplace = D.Laplace(0.0, torch.tensor(1.0, dtype=torch.float64))
    assert cpu_fused.log_prob_expectation(normal, laplace, cpu_fused.MAX_ELEMENTS // 10 + 1, 0) is None  # too large
    assert cpu_fused.log_prob_expectation(normal, D.Beta(2.0, 2.0), M, 0) is None  # no registered density
    wider = D.Laplace(0.0, torch.tensor(1.0, dtype=torch.float64))
    narrow = mg.family_of(D.Normal(loc.float(), sp(raw).float()))
    assert cpu_fused.log_prob_expectation(narrow, wider, M, 0) is None  # float64 prior over float32 samples
    assert cpu_fused.log_prob_expectation(normal, D.Laplace(0.0, 1.0), M, 0) is None  # and float32 over float64
    gamma_q = mg.family_of(D.Gamma(sp(raw) + 1.0, 1.0))  # its noise law depends on the concentration
    assert cpu_fused.log_prob_expectation(gamma_q, D.Gamma(2.0, 1.0), M, 0) is None

    class OwnDensity(D.Laplace):
        def log_prob(self, value):
            return super().log_prob(value) * 2
    assert cpu_fused.log_prob_expectation(normal, OwnDensity(0.0, 1.0), M, 0) is None


def test_non_finite_posterior_is_named():
    loc = torch.tensor([0.0, float("nan"), 1.0])
    q = D.Normal(loc, torch.ones(3), validate_args=False)
    with pytest.raises(ValueError, match=r"^q: parameter q\.loc"):
        mg.kl_divergence(q, D.Laplace(0.0, 1.0), 100, seed=0, method="monte-carlo")


def test_non_finite_prior_is_named():
    q = D.Normal(torch.zeros(3), torch.ones(3))
    p = D.Laplace(torch.tensor([0.0, float("inf"), 0.0]), 1.0, validate_args=False)
    with pytest.raises(ValueError, match=r"^p: parameter p\.loc"):
        mg.kl_divergence(q, p, 100, seed=0, method="monte-carlo")


def test_explain_names_the_loop():
    q = D.Normal(torch.zeros(3), torch.ones(3))
    text = str(mg.explain(q, ScaleMixtureNormal(0.5, 1.0, 0.002)))
    assert "compiled CPU loop for ScaleMixtureNormal's log-density" in text, text
    assert "compiled CPU loop" not in str(mg.explain(q, D.Laplace(0.0, 1.0)))  # closed form under "auto"


def test_samples_outside_the_support_give_minus_infinity_not_an_error():
    q = D.Normal(torch.zeros(3), torch.ones(3))
    value = cpu_fused.log_prob_expectation(mg.family_of(q), LogUniform(), 5, 0)
    assert torch.isfinite(value).all()  # |w| > 0 almost surely
    q0 = D.Normal(torch.zeros(2), torch.tensor([1.0, 0.0]), validate_args=False)  # w = 0 in the second element
    value = cpu_fused.log_prob_expectation(mg.family_of(q0), LogUniform(), 5, 0)
    assert math.isfinite(value[0].item()) and value[1].item() == math.inf


_FALLBACK = r"""
import torch, mcgraph as mg
from torch import distributions as D
from mcgraph.engine.estimators import cpu_fused
loc = torch.linspace(-1, 1, 6, dtype=torch.float64, requires_grad=True)
q = D.Normal(loc, 0.5)
p = D.Laplace(0.0, torch.tensor(1.0, dtype=torch.float64))
kl = mg.kl_divergence(q, p, 300, seed=4, method="monte-carlo")
direct = mg.kl_divergence(q, p, 300, seed=4, method="direct")
assert cpu_fused.library() is None and "no-such-compiler" in cpu_fused.unavailable_reason()
assert cpu_fused.log_prob_expectation(mg.family_of(q), p, 300, 4) is None
torch.testing.assert_close(kl, direct)
print("OK")
"""


def test_engine_path_without_compiler(tmp_path):
    assert_runs_without_compiler(tmp_path, _FALLBACK)


def test_disabled_runs_the_engine_with_the_same_noise():
    loc, raw = _leaves((6,), torch.float64)
    q = D.Normal(loc, torch.nn.functional.softplus(raw))
    p = D.StudentT(torch.tensor(3.0, dtype=torch.float64), 0.0, 1.0)
    looped = mg.kl_divergence(q, p, M, seed=2)
    with cpu_fused.disabled():
        assert cpu_fused.log_prob_expectation(mg.family_of(q), p, M, 2) is None
        engine = mg.kl_divergence(q, p, M, seed=2)
    assert cpu_fused.log_prob_expectation(mg.family_of(q), p, M, 2) is not None
    torch.testing.assert_close(looped, engine, **TOL[torch.float64])


def test_empty_posterior():
    for shape in [(0,), (0, 3), (4, 0)]:
        q = D.Normal(torch.zeros(shape), torch.ones(shape))
        kl = mg.kl_divergence(q, D.StudentT(torch.tensor(3.0)), 100, seed=0)
        assert kl.shape == shape


@pytest.mark.parametrize("make_p, name", [
    (lambda: D.Laplace(0.0, torch.tensor(math.inf, requires_grad=True), validate_args=False), "p.scale"),
    (lambda: ScaleMixtureNormal(0.5, 1.0, math.inf, validate_args=False), "p.scale2"),
])
def test_non_finite_prior_parameter_named_even_when_the_value_is_finite(make_p, name):
    q = D.Normal(torch.zeros(2), torch.ones(2))
    with pytest.raises(ValueError, match=rf"^p: parameter {name}"):
        mg.kl_divergence(q, make_p(), 100, seed=0, method="monte-carlo")


def test_independent_subclass_with_its_own_log_prob_is_not_unwrapped():
    class Tempered(D.Independent):
        def log_prob(self, value):
            return 0.1 * super().log_prob(value)

    q = D.Independent(D.Normal(torch.zeros(4), torch.ones(4)), 1)
    p = Tempered(D.Normal(torch.zeros(4), torch.ones(4)), 1)
    assert cpu_fused.plan(mg.family_of(q), p, "monte-carlo") is None
    torch.testing.assert_close(mg.kl_divergence(q, p, 200, seed=0, method="monte-carlo"),
                               mg.kl_divergence(q, p, 200, seed=0, method="direct"))


def test_gamma_prior_of_concentration_one_at_w_zero():
    """torch's Gamma takes (k − 1) log w as xlogy: 0 at k = 1 even where w underflows to 0."""
    q = D.LogNormal(torch.full((2,), -100.0), torch.full((2,), 2.0))  # float32: some samples underflow
    p = D.Gamma(torch.tensor(1.0), torch.tensor(2.0))
    ours = cpu_fused.log_prob_expectation(mg.family_of(q), p, 400, 0, method="fused")
    direct = mg.expectation(p.log_prob, q, 400, seed=0, method="direct")
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, direct)


def test_declined_forms():
    loc = torch.zeros(3, dtype=torch.float64)
    mixed = mg.family_of(D.Normal(loc, torch.ones(3)))  # float64 loc, float32 scale
    assert cpu_fused.plan(mixed, D.Laplace(0.0, 1.0), "monte-carlo") is None

    class ShiftedExp(D.transforms.ExpTransform):
        def _call(self, x):
            return x.exp() + 1

    q = D.TransformedDistribution(D.Normal(torch.zeros(3), torch.ones(3)), [ShiftedExp()])
    assert cpu_fused.plan(mg.family_of(q), D.Gamma(2.0, 1.0), "fused") is None
    q64 = D.Normal(torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
    assert "compiled CPU loop" not in str(mg.explain(q64, ScaleMixtureNormal(0.5, 1.0, 1e-3)))  # float32 prior


def test_non_finite_parameter_behind_a_derived_scale_is_named():
    q = D.Exponential(torch.tensor([1.0, math.inf]), validate_args=False)  # scale 1 / rate = 0: finite
    with pytest.raises(ValueError, match=r"^q: parameter q\.rate"):
        mg.kl_divergence(q, D.Gamma(torch.tensor(2.0), torch.tensor(1.0)), 100, seed=0, method="fused")
