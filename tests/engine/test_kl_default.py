"""The KL functions are exact where an exact form exists (``method="auto"``), sampled on request.

Oracles: torch's registered closed forms (``torch.distributions.kl_divergence``), the engine's
analytic tier, and the same-seed contract among the sampling methods.
"""

import pytest
import torch
import torch.distributions as D
from torch import nn

import mcgraph as mg
import mcgraph.distributions as mgd
from mcgraph.engine.closed_form import closed_form_kl, kl_rule
from mcgraph.interop.foreign_priors import NormalPrior

F64 = torch.float64


def _q(n=6, dtype=F64):
    g = torch.Generator().manual_seed(0)
    mu = torch.randn(n, generator=g, dtype=dtype).requires_grad_()
    rho = (torch.randn(n, generator=g, dtype=dtype) - 1).requires_grad_()
    return mu, rho, D.Normal(mu, nn.functional.softplus(rho))


PAIRS_WITH_RULES = {
    "normal-normal": lambda: D.Normal(torch.tensor(0.3, dtype=F64), torch.tensor(1.7, dtype=F64)),
    "normal-laplace": lambda: D.Laplace(torch.tensor(0.0, dtype=F64), torch.tensor(0.5, dtype=F64)),
    "normal-gumbel": lambda: D.Gumbel(torch.tensor(0.0, dtype=F64), torch.tensor(2.0, dtype=F64)),
}


@pytest.mark.parametrize("name", sorted(PAIRS_WITH_RULES))
def test_auto_is_torchs_closed_form_value_and_gradient(name):
    mu, rho, q = _q()
    p = PAIRS_WITH_RULES[name]()
    state = torch.get_rng_state()
    kl = mg.kl_divergence(q, p, 1000)
    assert torch.equal(torch.get_rng_state(), state)  # no noise drawn, not even a seed
    ref = D.kl_divergence(q, p)
    assert torch.equal(kl, ref)
    g = torch.autograd.grad(kl.sum(), [mu, rho], retain_graph=True)
    g_ref = torch.autograd.grad(ref.sum(), [mu, rho], retain_graph=True)
    for a, b in zip(g, g_ref):
        assert torch.equal(a, b)
    assert mg.explain(q, p).exact and mg.explain(q, p).closed_form == kl_rule(q, p).__name__
    est = mg.kl_divergence(q, p, 1000, return_stderr=True)
    assert torch.equal(est.value, ref) and torch.equal(est.stderr, torch.zeros_like(ref))


def test_monte_carlo_keeps_the_same_seed_contract_and_is_unbiased():
    _, _, q = _q(4000)
    p = PAIRS_WITH_RULES["normal-normal"]()
    mc = mg.kl_divergence(q, p, 16, seed=3, method="monte-carlo")
    torch.testing.assert_close(mc, mg.kl_divergence(q, p, 16, seed=3, method="direct"), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(mc, mg.kl_divergence(q, p, 16, seed=3, method="collapsed"), rtol=1e-10, atol=1e-10)
    err = (mc - D.kl_divergence(q, p)).detach()
    assert not torch.equal(mc, D.kl_divergence(q, p))
    assert abs(float(err.mean() / (err.std() / len(err) ** 0.5))) < 4.5  # z-test, false alarms 7e-6


def test_without_a_rule_auto_samples_the_non_polynomial_terms_with_the_same_noise():
    _, _, q = _q()
    for p in (mgd.ScaleMixtureNormal(0.5, 1.0, 1e-2), D.StudentT(3.0, 0.0, 1.0)):
        assert closed_form_kl(q, p) is None
        auto = mg.kl_divergence(q, p, 64, seed=1)
        assert torch.equal(auto, mg.kl_divergence(q, p, 64, seed=1, method="monte-carlo"))
        # the priors' scalars are float32: the same noise agrees to float32's precision
        torch.testing.assert_close(auto, mg.kl_divergence(q, p, 64, seed=1, method="direct"), rtol=1e-6, atol=1e-6)
        assert not mg.explain(q, p).exact and "torch has no rule" in str(mg.explain(q, p))
        with pytest.raises(NotImplementedError, match="closed-form.*Normal ‖"):
            mg.kl_divergence(q, p, 64, method="closed-form")


def test_polynomial_terms_without_a_rule_take_the_exact_tier():
    """Radial ‖ Normal: torch has no rule, log p is a polynomial: the KL is exact (no seed dependence)."""
    mu = torch.zeros(3, 4, dtype=F64, requires_grad=True)
    q = mgd.Radial(mu, torch.full((3, 4), 0.5, dtype=F64))
    p = D.Normal(torch.tensor(0.2, dtype=F64), torch.tensor(1.5, dtype=F64))
    a, b = mg.kl_divergence(q, p, 2, seed=0), mg.kl_divergence(q, p, 2, seed=1)
    assert torch.equal(a, b) and mg.explain(q, p).exact
    torch.testing.assert_close(a, mg.kl_divergence(q, p, 2, seed=0, method="auto-analytic"), rtol=0, atol=0)
    many = mg.kl_divergence(q, p, 200_000, seed=0, method="monte-carlo").detach()
    torch.testing.assert_close(a.detach(), many, rtol=0, atol=0.02)   # MC error ~ 1e-3 at M = 2·10⁵


def test_bayesian_layers_and_mg_nn_kl_follow_the_rule():
    torch.manual_seed(0)
    net = mg.nn.bayesify(nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)), rho_init=-2.0,
                         kl_samples=1, bayesian_bias=True)
    ref = sum(D.kl_divergence(layer.posterior, layer.prior).sum() + D.kl_divergence(
        layer.bias_posterior, layer.bias_prior).sum() for layer in mg.nn.bayesian_modules(net))
    torch.testing.assert_close(mg.nn.kl(net), ref, rtol=1e-6, atol=0)
    assert torch.equal(mg.nn.kl(net, 1, seed=0), mg.nn.kl(net, 1000, seed=5))   # kl_samples unused
    a, b = mg.nn.kl(net, 8, seed=0, method="monte-carlo"), mg.nn.kl(net, 8, seed=1, method="monte-carlo")
    assert not torch.equal(a, b)                                                  # sampled on request
    layer = mg.nn.bayesian_modules(net)[0]
    assert torch.equal(layer.kl(), layer.kl(1000, seed=3))


def test_interop_kl_is_the_same_rule():
    import mcgraph.interop as interop

    _, _, q = _q()
    p = D.Normal(0.0, 1.0)
    assert torch.equal(interop.site_kl(q, p, 8), mg.kl_divergence(q, p, 8))
    torch.testing.assert_close(interop.site_kl(q, p, 8, seed=0, method="monte-carlo"),
                               mg.kl_divergence(q, p, 8, seed=0, method="monte-carlo"), rtol=0, atol=0)


def test_a_registered_monte_carlo_rule_is_not_taken_for_a_closed_form():
    pytest.importorskip("pyro")
    from mcgraph.interop.pyro import register_mc_kl

    class LocalNormal(D.Normal):
        pass

    class LocalStudentT(D.StudentT):
        pass

    register_mc_kl(LocalNormal, LocalStudentT, 64)
    q = LocalNormal(torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64))
    p = LocalStudentT(torch.tensor(4.0, dtype=F64))
    assert kl_rule(q, p) is None
    torch.testing.assert_close(mg.kl_divergence(q, p, 64, seed=2),
                               mg.kl_divergence(q, p, 64, seed=2, method="direct"), rtol=1e-10, atol=1e-10)
    assert D.kl_divergence(q, p).shape == (3,)   # torch's registry calls the engine, which does not recurse


def test_bad_method_names_the_argument():
    _, _, q = _q()
    with pytest.raises(ValueError, match="method must be one of 'auto', 'closed-form', 'monte-carlo'"):
        mg.kl_divergence(q, D.Normal(0.0, 1.0), 8, method="exact")
    with pytest.raises(ValueError, match="method must be one of"):
        mg.expectation(torch.abs, q, 8, method="closed-form")
    with pytest.raises(ValueError, match="num_samples"):   # validated even where it is unused
        mg.kl_divergence(q, D.Normal(0.0, 1.0), 0)


# ------------------------------------------------------------------ the layers' Normal ‖ Normal shortcut

LAYER_PRIORS = {
    "named": lambda dtype: "normal",
    "instance": lambda dtype: D.Normal(torch.tensor(0.2, dtype=dtype), torch.tensor(0.7, dtype=dtype)),
    "per-weight": lambda dtype: D.Normal(torch.linspace(-1, 1, 20, dtype=dtype).view(4, 5),
                                         torch.linspace(0.5, 2, 20, dtype=dtype).view(4, 5)),
    "factory": lambda dtype: NormalPrior(0.3, 0.5),  # what the peer adapters build (bayesian-torch's prior_sigma)
    "factory-standard": lambda dtype: NormalPrior(0.0, 1.0),
}


def _layer(prior, bias, dtype, cls=mg.nn.BayesLinear, args=(5, 4)):
    torch.manual_seed(0)
    layer = cls(*args, prior=prior, bayesian_bias=bias, dtype=dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("prior", list(LAYER_PRIORS))
def test_plain_normal_layer_kl_is_the_engines_closed_form_bit_for_bit(prior, bias, dtype):
    """A Normal-posterior layer under a Normal prior skips building the distributions (the KL of every
    training step of the commonest BNN); its value and gradients are those of the engine's closed form."""
    from mcgraph.nn.layer_kl import _plain_normal_kl

    if prior == "per-weight" and bias:
        pytest.skip("a per-weight prior shaped like the weight does not fit the bias")
    layer = _layer(LAYER_PRIORS[prior](dtype), bias, dtype)
    assert _plain_normal_kl(layer) is not None  # the shortcut applies
    fast = layer.kl(seed=0)
    engine = layer.kl(seed=0, method="closed-form")  # the engine's path: torch's rule on the distributions
    assert fast.dtype == dtype and torch.equal(fast, engine)
    params = [layer.weight_mu, layer.weight_rho] + ([layer.bias_mu, layer.bias_rho] if bias else [])
    for a, b in zip(torch.autograd.grad(fast, params), torch.autograd.grad(engine, params), strict=True):
        assert torch.equal(a, b)
    expected = D.kl_divergence(layer.posterior, layer.prior).sum()
    if bias:
        expected = expected + D.kl_divergence(layer.bias_posterior, layer.bias_prior).sum()
    torch.testing.assert_close(fast, expected, rtol=0, atol=0)


def test_plain_normal_layer_kl_on_a_convolution():
    from mcgraph.nn.layer_kl import _plain_normal_kl

    layer = _layer("normal", True, torch.float32, mg.nn.BayesConv2d, (2, 3, 3))
    assert _plain_normal_kl(layer) is not None
    assert torch.equal(layer.kl(seed=0), layer.kl(seed=0, method="closed-form"))


def test_plain_normal_layer_kl_steps_aside_where_the_general_path_decides():
    from mcgraph.nn.layer_kl import LAYER_KL, _plain_normal_kl
    from mcgraph.nn.masks import apply_mask, unmasked_posterior

    assert _plain_normal_kl(_layer("laplace", False, F64)) is None  # another prior
    assert _plain_normal_kl(mg.nn.BayesLinear(5, 4, posterior="radial")) is None  # another posterior
    layer = _layer("normal", True, F64)
    mg.nn.register_layer_kl(D.Normal, D.Normal)(lambda q, p, m, seed, method: torch.zeros_like(q.loc) + 7.0)
    try:  # a registered layer rule wins over the closed form
        assert _plain_normal_kl(layer) is None
        assert float(layer.kl(seed=0)) == 7.0 * (20 + 4)
    finally:
        LAYER_KL.pop((D.Normal, D.Normal))
    assert _plain_normal_kl(layer) is not None
    with torch.no_grad():
        layer.weight_mu[1, 2] = float("nan")
    assert _plain_normal_kl(layer) is None  # not finite: the general path names the parameter
    with pytest.raises(ValueError, match=r"q: parameter q\.loc has non-finite values \(shape \(4, 5\)\)"):
        layer.kl(seed=0)
    pruned = _layer("normal", False, F64)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[0] = False
    apply_mask(pruned, mask)
    assert _plain_normal_kl(pruned) is None  # a pruned layer counts its remaining weights only
    kept = D.kl_divergence(unmasked_posterior(pruned), pruned.prior)[1:].sum()
    torch.testing.assert_close(pruned.kl(seed=0), kept, rtol=1e-12, atol=0)


def test_registered_kl_reads_torchs_memo_and_sees_new_registrations():
    from torch.distributions.kl import _KL_MEMOIZE, _KL_REGISTRY, _kl_normal_normal

    from mcgraph.engine.closed_form import registered_kl

    class Narrow(D.Normal):
        pass

    assert registered_kl(D.Normal, D.Normal) is _kl_normal_normal
    assert registered_kl(Narrow, D.Normal) is _kl_normal_normal  # by MRO, then remembered
    assert registered_kl(D.Normal, D.StudentT) is NotImplemented

    def rule(q, p):
        return torch.zeros_like(q.loc)

    D.register_kl(Narrow, D.Normal)(rule)  # clears torch's memo: the new rule is seen at once
    try:
        assert registered_kl(Narrow, D.Normal) is rule
        q = Narrow(torch.zeros(3), torch.ones(3))
        assert torch.equal(mg.kl_divergence(q, D.Normal(1.0, 2.0), 10), torch.zeros(3))
    finally:
        del _KL_REGISTRY[Narrow, D.Normal]
        _KL_MEMOIZE.clear()
    assert registered_kl(Narrow, D.Normal) is _kl_normal_normal


def test_plain_normal_layer_kl_keeps_signed_zeros_and_the_prior_shape_check():
    from mcgraph.nn.layer_kl import _plain_normal_kl

    # loc = -0.0: μ - loc turns μ = -0.0 into +0.0, so that subtraction is not skipped (same gradient sign)
    layer = mg.nn.BayesLinear(2, 1, prior=NormalPrior(-0.0, 1.0), dtype=F64)
    with torch.no_grad():
        layer.weight_mu.fill_(-0.0)
    assert NormalPrior(-0.0, 1.0).normal_parameters(layer.weight_mu)[0] is not None
    assert NormalPrior(0.0, 1.0).normal_parameters(layer.weight_mu) == (None, None)
    fast = torch.autograd.grad(layer.kl(seed=0), layer.weight_mu)[0]
    engine = torch.autograd.grad(layer.kl(seed=0, method="closed-form"), layer.weight_mu)[0]
    assert torch.equal(fast, engine) and torch.equal(torch.signbit(fast), torch.signbit(engine))
    # a prior that no longer fits the weight: the general path's error, not torch's
    layer = mg.nn.BayesLinear(5, 4)
    layer.prior_spec = D.Normal(torch.zeros(7), 1.0)
    assert _plain_normal_kl(layer) is None
    with pytest.raises(ValueError, match=r"prior: shape \(7,\) does not broadcast with the parameter shape \(4, 5\)"):
        layer.kl(seed=0)
    # a weight-shaped prior fits the weight but not a Bayesian bias: the general path's error too
    layer = mg.nn.BayesLinear(5, 4, bayesian_bias=True)
    layer.prior_spec = D.Normal(torch.zeros(4, 5), torch.ones(4, 5))
    assert _plain_normal_kl(layer) is None
    with pytest.raises(ValueError, match=r"prior: shape \(4, 5\) does not broadcast with the parameter shape \(4,\)"):
        layer.kl(seed=0)
