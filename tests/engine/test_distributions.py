"""Tests for mcgraph.distributions (families torch lacks).

Statistical tests are seeded, so they are deterministic; each states the
false-alarm rate it would have under a fresh seed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.integrate
import scipy.special
import scipy.stats
import torch

from mcgraph.distributions import (
    Horseshoe,
    Logistic,
    LogUniform,
    Radial,
    Rayleigh,
    ScaleMixtureNormal,
    radial_noise,
    radial_noise_entropy,
)

DTYPE = torch.float64
EULER_GAMMA = 0.5772156649015329


def _t(x):
    return torch.as_tensor(x, dtype=DTYPE)


# Elementwise (event_shape == ()) families: name -> factory(batch_shape).
def _logistic(shape):
    g = torch.Generator().manual_seed(1)
    loc = torch.randn(shape, generator=g, dtype=DTYPE)
    return Logistic(loc, 0.5 + torch.rand(shape, generator=g, dtype=DTYPE))


def _rayleigh(shape):
    g = torch.Generator().manual_seed(2)
    return Rayleigh(0.5 + torch.rand(shape, generator=g, dtype=DTYPE))


def _horseshoe(shape):
    g = torch.Generator().manual_seed(3)
    loc = torch.randn(shape, generator=g, dtype=DTYPE)
    return Horseshoe(loc, 0.5 + torch.rand(shape, generator=g, dtype=DTYPE))


def _mixture(shape):
    g = torch.Generator().manual_seed(4)
    pi = 0.1 + 0.8 * torch.rand(shape, generator=g, dtype=DTYPE)
    return ScaleMixtureNormal(pi, _t(1.0), _t(0.05), loc=torch.randn(shape, generator=g, dtype=DTYPE))


def _log_uniform(shape):
    return LogUniform(shape=shape)


ELEMENTWISE = {
    "logistic": _logistic,
    "rayleigh": _rayleigh,
    "horseshoe": _horseshoe,
    "mixture": _mixture,
    "log_uniform": _log_uniform,
}
SAMPLABLE = ["logistic", "rayleigh", "horseshoe", "mixture"]
REPARAMETERIZED = ["logistic", "rayleigh", "horseshoe"]


def _in_support(name, shape):
    x = torch.randn(shape, dtype=DTYPE)
    return x.abs() + 0.1 if name == "rayleigh" else x


# --------------------------------------------------------------------- shapes


@pytest.mark.parametrize("name", list(ELEMENTWISE))
@pytest.mark.parametrize("batch_shape", [(), (3,), (2, 3)])
@pytest.mark.parametrize("sample_shape", [(), (4,), (5, 1)])
def test_elementwise_shapes(name, batch_shape, sample_shape):
    d = ELEMENTWISE[name](batch_shape)
    assert d.batch_shape == torch.Size(batch_shape)
    assert d.event_shape == torch.Size()
    value = _in_support(name, torch.Size(sample_shape) + torch.Size(batch_shape))
    assert d.log_prob(value).shape == torch.Size(sample_shape) + torch.Size(batch_shape)
    if name in SAMPLABLE:
        x = d.sample(sample_shape)
        assert x.shape == torch.Size(sample_shape) + torch.Size(batch_shape)
        assert x.dtype == DTYPE


def test_float_parameters_give_scalar_batch():
    for d in [Logistic(0.0, 1.0), Rayleigh(2.0), Horseshoe(0.0, 1.0), ScaleMixtureNormal(0.5, 1.0, 0.1)]:
        assert d.batch_shape == torch.Size() and d.event_shape == torch.Size()
        assert d.sample((3,)).shape == (3,)


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_expand(name):
    d = ELEMENTWISE[name]((3,))
    e = d.expand((4, 3))
    assert type(e) is type(d)
    assert e.batch_shape == (4, 3)
    value = _in_support(name, (4, 3))
    torch.testing.assert_close(e.log_prob(value), d.log_prob(value))
    if name in SAMPLABLE:
        assert e.sample((2,)).shape == (2, 4, 3)


@pytest.mark.parametrize("event_shape", [(), (1,), (4,), (3, 2)])
@pytest.mark.parametrize("sample_shape", [(), (5,), (2, 3)])
def test_radial_shapes(event_shape, sample_shape):
    q = Radial(torch.zeros(event_shape, dtype=DTYPE), torch.ones(event_shape, dtype=DTYPE))
    assert q.batch_shape == torch.Size()
    assert q.event_shape == torch.Size(event_shape)
    w = q.rsample(sample_shape)
    assert w.shape == torch.Size(sample_shape) + torch.Size(event_shape)
    assert q.log_prob(w).shape == torch.Size(sample_shape)
    assert q.entropy().shape == torch.Size()
    assert q.mean.shape == q.variance.shape == torch.Size(event_shape)


def test_radial_broadcasts_loc_and_scale_into_the_event():
    q = Radial(torch.zeros(3, 1), torch.ones(4))
    assert q.event_shape == (3, 4) and q.batch_shape == ()
    assert Radial(0.0, 1.0).event_shape == ()


def test_radial_expand_adds_independent_batch():
    loc, scale = torch.randn(3, 2, dtype=DTYPE), torch.rand(3, 2, dtype=DTYPE) + 0.5
    q = Radial(loc, scale)
    e = q.expand((4,))
    assert e.batch_shape == (4,) and e.event_shape == (3, 2)
    w = e.rsample((5,))
    assert w.shape == (5, 4, 3, 2)
    lp = e.log_prob(w)
    assert lp.shape == (5, 4)
    torch.testing.assert_close(lp, q.log_prob(w))
    torch.testing.assert_close(e.entropy(), q.entropy().expand(4))
    # Each batch element has its own radius: the noise norms differ across the batch.
    norms = torch.linalg.vector_norm((w - loc) / scale, dim=(-2, -1))
    assert not torch.allclose(norms[:, 0], norms[:, 1])


def test_radial_rejects_empty_event():
    with pytest.raises(ValueError, match="non-empty"):
        Radial(torch.zeros(0), 1.0)


# ------------------------------------------------------------ reproducibility


@pytest.mark.parametrize("name", SAMPLABLE + ["radial"])
def test_manual_seed_reproduces_samples(name):
    d = Radial(torch.zeros(3), torch.ones(3)) if name == "radial" else ELEMENTWISE[name]((3,))
    torch.manual_seed(123)
    a = d.sample((7,))
    torch.manual_seed(123)
    b = d.sample((7,))
    c = d.sample((7,))
    assert torch.equal(a, b)
    assert not torch.equal(b, c)


def test_radial_noise_replays_documented_draws():
    torch.manual_seed(7)
    xi = radial_noise((6,), (3, 2), dtype=DTYPE)
    torch.manual_seed(7)
    eps = torch.randn(6, 3, 2, dtype=DTYPE)
    r = torch.randn(6, dtype=DTYPE)
    expected = eps / torch.linalg.vector_norm(eps, dim=(1, 2), keepdim=True) * r[:, None, None]
    torch.testing.assert_close(xi, expected)
    torch.testing.assert_close(torch.linalg.vector_norm(xi, dim=(1, 2)), r.abs())


def test_radial_noise_scalar_event_is_standard_normal():
    torch.manual_seed(0)
    xi = radial_noise((20000,), (), dtype=DTYPE)
    assert xi.shape == (20000,)
    # KS test against N(0, 1): false-alarm rate 1e-3 under a fresh seed.
    assert scipy.stats.kstest(xi.numpy(), "norm").pvalue > 1e-3


def test_radial_rsample_uses_radial_noise():
    loc, scale = torch.randn(4, dtype=DTYPE), torch.rand(4, dtype=DTYPE) + 0.1
    torch.manual_seed(11)
    w = Radial(loc, scale).rsample((3,))
    torch.manual_seed(11)
    xi = radial_noise((3,), (4,), dtype=DTYPE)
    torch.testing.assert_close(w, loc + scale * xi)


# -------------------------------------------------------- gradients (rsample)


@pytest.mark.parametrize("name", REPARAMETERIZED + ["radial"])
def test_rsample_gradients_flow_to_parameters(name):
    torch.manual_seed(0)
    scale = (torch.rand(3, dtype=DTYPE) + 0.5).requires_grad_()
    loc = torch.randn(3, dtype=DTYPE).requires_grad_()
    if name == "rayleigh":
        d, params = Rayleigh(scale), [scale]
    else:
        cls = {"logistic": Logistic, "horseshoe": Horseshoe, "radial": Radial}[name]
        d, params = cls(loc, scale), [loc, scale]
    assert d.has_rsample
    w = d.rsample((50,))
    w.sum().backward()
    # d/dscale sum(w) = sum of the standard noise (w - loc) / scale; d/dloc = M.
    offset = 0.0 if name == "rayleigh" else loc.detach()
    torch.testing.assert_close(scale.grad, ((w.detach() - offset) / scale.detach()).sum(0))
    if name != "rayleigh":
        torch.testing.assert_close(loc.grad, torch.full((3,), 50.0, dtype=DTYPE))
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)


def test_mixture_has_no_rsample():
    d = ScaleMixtureNormal(0.5, 1.0, 0.1)
    assert not d.has_rsample
    with pytest.raises(NotImplementedError):
        d.rsample()
    loc = torch.zeros(2, requires_grad=True)
    x = ScaleMixtureNormal(0.5, 1.0, 0.1, loc=loc).sample((3,))
    assert not x.requires_grad


@pytest.mark.parametrize("name", ["logistic", "rayleigh", "horseshoe", "mixture", "radial"])
def test_log_prob_gradcheck(name):
    torch.manual_seed(0)
    loc = torch.randn(3, dtype=DTYPE, requires_grad=True)
    scale = (torch.rand(3, dtype=DTYPE) + 0.5).requires_grad_()
    value = (torch.randn(3, dtype=DTYPE).abs() + 0.2).requires_grad_()

    def f(loc, scale, value):
        if name == "rayleigh":
            return Rayleigh(scale).log_prob(value) + 0 * loc
        if name == "mixture":
            return ScaleMixtureNormal(_t(0.3), scale, scale * 0.1, loc=loc).log_prob(value)
        cls = {"logistic": Logistic, "horseshoe": Horseshoe, "radial": Radial}[name]
        return cls(loc, scale).log_prob(value)

    assert torch.autograd.gradcheck(f, (loc, scale, value))


# ----------------------------------------------------- log_prob against scipy


def test_logistic_against_scipy():
    loc, scale = _t([0.0, -1.0, 2.5]), _t([1.0, 0.3, 4.0])
    d = Logistic(loc, scale)
    x = _t([[-50.0, 0.1, 3.0], [0.0, -1.0, 80.0]])
    ref = scipy.stats.logistic(loc.numpy(), scale.numpy())
    torch.testing.assert_close(d.log_prob(x), _t(ref.logpdf(x.numpy())))
    torch.testing.assert_close(d.cdf(x), _t(ref.cdf(x.numpy())))
    p = _t([0.1, 0.5, 0.97])
    torch.testing.assert_close(d.icdf(p), _t(ref.ppf(p.numpy())))
    torch.testing.assert_close(d.entropy(), _t(ref.entropy()))
    torch.testing.assert_close(d.mean, _t(ref.mean()))
    torch.testing.assert_close(d.variance, _t(ref.var()))


def test_logistic_log_prob_is_finite_far_in_the_tails():
    d = Logistic(0.0, 1.0)
    x = torch.tensor([-1e4, 1e4], dtype=torch.float32)
    torch.testing.assert_close(d.log_prob(x), torch.tensor([-1e4, -1e4]))


def test_rayleigh_against_scipy():
    scale = _t([0.5, 1.0, 3.0])
    d = Rayleigh(scale)
    x = _t([[0.01, 1.0, 2.0], [3.0, 0.2, 9.0]])
    ref = scipy.stats.rayleigh(scale=scale.numpy())
    torch.testing.assert_close(d.log_prob(x), _t(ref.logpdf(x.numpy())))
    torch.testing.assert_close(d.cdf(x), _t(ref.cdf(x.numpy())))
    p = _t([0.1, 0.5, 0.97])
    torch.testing.assert_close(d.icdf(p), _t(ref.ppf(p.numpy())))
    torch.testing.assert_close(d.entropy(), _t(ref.entropy()))
    torch.testing.assert_close(d.mean, _t(ref.mean()))
    torch.testing.assert_close(d.variance, _t(ref.var()))
    torch.testing.assert_close(d.mode, scale)


def test_scale_mixture_against_scipy_by_hand():
    pi, s1 = _t([0.25, 0.5, 0.9]), _t([1.0, 2.0, 0.5])
    s2, loc = _t([0.01, 0.1, 3.0]), _t([0.0, 1.0, -2.0])
    d = ScaleMixtureNormal(pi, s1, s2, loc=loc)
    x = _t([[0.0, 1.0, -2.0], [0.3, -4.0, 10.0], [40.0, 1.001, -2.5]])
    n = pi.numpy(), s1.numpy(), s2.numpy(), loc.numpy()
    ref_lp = np.logaddexp(
        np.log(n[0]) + scipy.stats.norm.logpdf(x.numpy(), n[3], n[1]),
        np.log1p(-n[0]) + scipy.stats.norm.logpdf(x.numpy(), n[3], n[2]),
    )
    torch.testing.assert_close(d.log_prob(x), _t(ref_lp))
    ref_cdf = n[0] * scipy.stats.norm.cdf(x.numpy(), n[3], n[1])
    ref_cdf = ref_cdf + (1 - n[0]) * scipy.stats.norm.cdf(x.numpy(), n[3], n[2])
    torch.testing.assert_close(d.cdf(x), _t(ref_cdf))
    torch.testing.assert_close(d.mean, loc)
    torch.testing.assert_close(d.variance, pi * s1**2 + (1 - pi) * s2**2)


def test_scale_mixture_default_loc_is_zero():
    d = ScaleMixtureNormal(0.5, 1.0, math.exp(-6))
    pdf = scipy.stats.norm.pdf
    expected = math.log(0.5 * pdf(0.7) + 0.5 * pdf(0.7, scale=math.exp(-6)))
    # Float parameters become tensors of the default dtype (float32), as in torch.
    assert d.loc.dtype == torch.get_default_dtype() and d.loc.item() == 0.0
    assert d.log_prob(torch.tensor(0.7)).item() == pytest.approx(expected, rel=1e-6)


def test_horseshoe_log_prob_within_carvalho_bounds_and_near_exact():
    loc, scale = 0.5, 2.0
    d = Horseshoe(_t(loc), _t(scale))
    x = _t([1e-3, 0.05, 0.3, 1.0, 2.0, 5.0, 30.0])  # standardised offsets
    lp = d.log_prob(loc + scale * x) + math.log(scale)  # density of x
    k = 1.0 / math.sqrt(2 * math.pi**3)
    lower = np.log(k / 2 * np.log1p(4 / x.numpy() ** 2))
    upper = np.log(k * np.log1p(2 / x.numpy() ** 2))
    assert np.all(lower < lp.numpy()) and np.all(lp.numpy() < upper)
    # Exact marginal K exp(x^2/2) E1(x^2/2): the midpoint is never more than
    # 25 % low (its limit as x -> 0) and within 5 % for |x| >= 0.5.
    exact = np.log(k) + np.log(scipy.special.exp1(x.numpy() ** 2 / 2)) + x.numpy() ** 2 / 2
    assert np.all(lp.numpy() - exact > math.log(0.75))
    assert np.all(lp.numpy() - exact < math.log(1.05))
    np.testing.assert_allclose(lp.numpy()[3:], exact[3:], atol=math.log(1.05))


def test_horseshoe_samples_use_halfcauchy_inverse_cdf():
    loc, scale = _t([0.0, 1.0]), _t([1.0, 0.1])
    torch.manual_seed(5)
    w = Horseshoe(loc, scale).rsample((100,))
    torch.manual_seed(5)
    z = torch.randn(100, 2, dtype=DTYPE).numpy()
    u = torch.rand(100, 2, dtype=DTYPE).numpy()
    lam = scipy.stats.halfcauchy.ppf(u)
    np.testing.assert_allclose(w.numpy(), loc.numpy() + scale.numpy() * lam * z, rtol=1e-9, atol=1e-12)


def test_horseshoe_sample_mass_matches_exact_density():
    torch.manual_seed(0)
    x = Horseshoe(0.0, 1.0).sample((200000,)).double()
    frac = (x.abs() < 1).double().mean().item()
    k = 1.0 / math.sqrt(2 * math.pi**3)
    def density(t):
        return 2 * k * math.exp(t * t / 2) * scipy.special.exp1(t * t / 2)

    exact, _ = scipy.integrate.quad(density, 0, 1)
    # Binomial std ~ 0.0011; 5 std gives a false-alarm rate < 1e-6.
    assert abs(frac - exact) < 5 * math.sqrt(exact * (1 - exact) / 200000)


def test_horseshoe_mean_and_variance_do_not_exist():
    d = Horseshoe(torch.zeros(2), torch.ones(2))
    assert torch.isnan(d.mean).all() and d.mean.shape == (2,)
    assert torch.isinf(d.variance).all()


# ------------------------------------------------------ sampling distribution


@pytest.mark.parametrize(
    "name,make,ref",
    [
        ("logistic", lambda: Logistic(1.0, 2.0), scipy.stats.logistic(1.0, 2.0)),
        ("rayleigh", lambda: Rayleigh(1.5), scipy.stats.rayleigh(scale=1.5)),
        ("mixture", lambda: ScaleMixtureNormal(0.3, 2.0, 0.2, loc=-1.0), None),
    ],
)
def test_samples_follow_the_cdf(name, make, ref):
    d = make()
    torch.manual_seed(2024)
    x = d.sample((20000,)).double()
    if ref is not None:
        cdf = ref.cdf
    else:
        cdf = lambda v: d.cdf(torch.as_tensor(v, dtype=torch.float32)).double().numpy()  # noqa: E731
    # KS test: false-alarm rate 1e-3 under a fresh seed.
    assert scipy.stats.kstest(x.numpy(), cdf).pvalue > 1e-3


# -------------------------------------------------------------------- Radial


def test_radial_d1_is_normal():
    loc, scale = _t([0.3]), _t([1.7])
    q = Radial(loc, scale)
    x = torch.linspace(-6, 6, 13, dtype=DTYPE)[:, None]
    torch.testing.assert_close(q.log_prob(x), torch.distributions.Normal(loc, scale).log_prob(x)[:, 0])
    torch.testing.assert_close(q.entropy(), torch.distributions.Normal(loc, scale).entropy()[0])


def test_radial_normalised_in_1d():
    q = Radial(_t(0.4), _t(0.8))
    grid = torch.linspace(-10, 10, 20001, dtype=DTYPE)
    total = torch.trapezoid(q.log_prob(grid).exp(), grid).item()
    assert total == pytest.approx(1.0, abs=1e-6)


def test_radial_normalised_in_2d():
    loc, scale = _t([0.3, -0.2]), _t([0.7, 1.3])
    q = Radial(loc, scale)
    n, half = 1600, 9.0  # midpoint grid in standardised units; loc is never a node
    h = 2 * half / n
    centres = -half + h * (torch.arange(n, dtype=DTYPE) + 0.5)
    gx, gy = torch.meshgrid(loc[0] + scale[0] * centres, loc[1] + scale[1] * centres, indexing="ij")
    dens = q.log_prob(torch.stack([gx, gy], -1)).exp()
    total = (dens.sum() * h * h * scale.prod()).item()
    # The density has an integrable 1/rho singularity at loc: O(h) grid error.
    assert total == pytest.approx(1.0, abs=1e-2)


@pytest.mark.parametrize("event_shape", [(), (2,), (5,), (3, 4)])
def test_radial_entropy_matches_monte_carlo(event_shape):
    torch.manual_seed(0)
    q = Radial(torch.randn(event_shape, dtype=DTYPE), torch.rand(event_shape, dtype=DTYPE) + 0.5)
    lp = q.log_prob(q.sample((200000,)))
    mc, se = -lp.mean().item(), lp.std().item() / math.sqrt(lp.numel())
    # 5 standard errors: false-alarm rate < 1e-6 under a fresh seed.
    assert abs(mc - q.entropy().item()) < 5 * se


def test_radial_noise_entropy_formula():
    d = 7
    log_area = math.log(2) + d / 2 * math.log(math.pi) - math.lgamma(d / 2)
    e_log_r = -(EULER_GAMMA + math.log(2)) / 2
    expected = -math.log(2) + 0.5 * math.log(2 * math.pi) + 0.5 + log_area + (d - 1) * e_log_r
    assert radial_noise_entropy(d) == pytest.approx(expected, rel=1e-12)
    assert radial_noise_entropy(1) == pytest.approx(0.5 * math.log(2 * math.pi * math.e), rel=1e-12)
    with pytest.raises(ValueError, match="dim"):
        radial_noise_entropy(0)


def test_radial_mean_and_variance_match_samples():
    torch.manual_seed(1)
    loc, scale = _t([1.0, -2.0, 0.5, 0.0]), _t([0.5, 1.0, 2.0, 3.0])
    q = Radial(loc, scale)
    w = q.sample((100000,))
    torch.testing.assert_close(q.variance, scale**2 / 4)
    torch.testing.assert_close(q.mean, loc)
    # Per element sd of the sample mean <= 3/sqrt(4*1e5) ~ 0.0047.
    torch.testing.assert_close(w.mean(0), loc, atol=0.03, rtol=0)
    torch.testing.assert_close(w.var(0), q.variance, rtol=0.03, atol=0)


# ------------------------------------------------------------ LogUniform


def test_log_uniform_log_prob():
    d = LogUniform(shape=(3,))
    x = _t([-2.0, 0.5, 10.0])
    torch.testing.assert_close(d.log_prob(x), -torch.log(x.abs()))
    # Broadcasts to the batch shape like every torch distribution.
    assert d.log_prob(_t(2.0)).shape == (3,)
    assert d.log_prob(torch.ones(4, 3, dtype=DTYPE)).shape == (4, 3)
    assert torch.isinf(d.log_prob(torch.zeros(3))).all()


def test_log_uniform_cannot_be_sampled():
    d = LogUniform()
    assert not d.has_rsample
    for draw in (d.sample, d.rsample):
        with pytest.raises(NotImplementedError, match="improper"):
            draw((2,))


def test_log_uniform_shape_and_expand():
    assert LogUniform().batch_shape == ()
    d = LogUniform(shape=(2,)).expand((5, 2))
    assert isinstance(d, LogUniform) and d.batch_shape == (5, 2)
    with pytest.raises(TypeError, match="validate_args"):
        LogUniform((3,))
    with pytest.raises(ValueError, match="shape"):
        LogUniform(shape="abc")


# ------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "make,arg",
    [
        (lambda: ScaleMixtureNormal(0.0, 1.0, 0.1), "pi"),
        (lambda: ScaleMixtureNormal(1.0, 1.0, 0.1), "pi"),
        (lambda: ScaleMixtureNormal(torch.tensor([0.5, 1.5]), 1.0, 0.1), "pi"),
        (lambda: ScaleMixtureNormal(0.5, -1.0, 0.1), "scale1"),
        (lambda: ScaleMixtureNormal(0.5, 1.0, 0.0), "scale2"),
        (lambda: ScaleMixtureNormal(0.5, 1.0, 0.1, loc=float("nan")), "loc"),
        (lambda: Logistic(0.0, 0.0), "scale"),
        (lambda: Logistic(float("nan"), 1.0), "loc"),
        (lambda: Rayleigh(-1.0), "scale"),
        (lambda: Horseshoe(0.0, -2.0), "scale"),
        (lambda: Radial(torch.zeros(3), torch.tensor([1.0, 0.0, 1.0])), "scale"),
    ],
)
def test_invalid_parameters_raise_value_error_naming_argument(make, arg):
    with pytest.raises(ValueError, match=rf"Expected parameter {arg} "):
        make()


def test_validation_can_be_switched_off():
    d = ScaleMixtureNormal(1.5, 1.0, 0.1, validate_args=False)
    assert d.pi.item() == 1.5
    assert torch.isnan(Rayleigh(1.0, validate_args=False).log_prob(torch.tensor(-1.0)))


@pytest.mark.parametrize(
    "d,value",
    [
        (Rayleigh(1.0), torch.tensor(-0.5)),
        (Logistic(0.0, 1.0), torch.tensor(float("nan"))),
        (Radial(torch.zeros(3), torch.ones(3)), torch.zeros(4)),  # wrong event shape
    ],
)
def test_log_prob_validates_samples(d, value):
    with pytest.raises(ValueError):
        d.log_prob(value)


def test_supports():
    assert Rayleigh(1.0).support is torch.distributions.constraints.nonnegative
    for d in [Logistic(0.0, 1.0), Horseshoe(0.0, 1.0), ScaleMixtureNormal(0.5, 1.0, 0.1), LogUniform()]:
        assert d.support is torch.distributions.constraints.real
    s = Radial(torch.zeros(3, 2), 1.0).support
    assert s.event_dim == 2
    assert bool(s.check(torch.zeros(5, 3, 2)).all())


# --------------------------------------------- log_prob is elementwise in value


class _Recorder(torch.Tensor):
    """Tensor subclass that records every torch function applied to it."""

    calls: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", repr(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


_NOT_ELEMENTWISE = {
    "stack", "cat", "logsumexp", "sum", "mean", "item", "tolist", "__bool__",
    "max", "min", "amax", "amin", "any", "all", "nonzero", "norm", "vector_norm",
}


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_log_prob_uses_only_elementwise_ops_on_value(name):
    d = ELEMENTWISE[name]((2, 3))
    d._validate_args = False
    plain = _in_support(name, (2, 3))
    value = plain.clone().as_subclass(_Recorder)
    _Recorder.calls = []
    out = d.log_prob(value)
    calls = set(_Recorder.calls)
    assert calls, "the recorder saw no operation"
    assert not calls & _NOT_ELEMENTWISE, calls
    assert isinstance(out, _Recorder)  # the result derives from value
    torch.testing.assert_close(out.as_subclass(torch.Tensor), d.log_prob(plain))
    # With validation on, the traced call still works.
    d._validate_args = True
    d.log_prob(plain.clone().as_subclass(_Recorder))


def test_recorder_detects_a_reduction():
    # The elementwise check above would fail on a reducing log_prob such as Radial's.
    q = Radial(torch.zeros(3), torch.ones(3), validate_args=False)
    _Recorder.calls = []
    q.log_prob(torch.ones(3).as_subclass(_Recorder))
    assert set(_Recorder.calls) & _NOT_ELEMENTWISE
