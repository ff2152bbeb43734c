"""Scale transforms σ = t(ρ) of the Bayesian layers."""

import io
import math

import pytest
import torch
import torch.nn.functional as F

import mcgraph as mg
from mcgraph import nn as mnn

REFERENCES = {
    "softplus": F.softplus,
    "exp": torch.exp,
    "exp_half": lambda rho: torch.sqrt(torch.exp(rho)),
}


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_inverse(name, dtype):
    t = mnn.scale_transform(name)
    rho = torch.linspace(-6, 4, 11, dtype=dtype)
    torch.testing.assert_close(t(rho), REFERENCES[name](rho))
    torch.testing.assert_close(t.inverse(t(rho)), rho)


@pytest.mark.parametrize("beta", [0.5, 2.0, 10.0])
def test_softplus_beta(beta):
    t = mnn.softplus_beta(beta)
    rho = torch.linspace(-5, 5, 21, dtype=torch.float64)
    torch.testing.assert_close(t(rho), torch.log1p(torch.exp(beta * rho)) / beta)
    torch.testing.assert_close(t.inverse(t(rho)), rho)
    assert mnn.softplus_beta(1) is mnn.scale_transform("softplus")


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "2"])
def test_softplus_beta_rejects(bad):
    with pytest.raises(ValueError, match="beta"):
        mnn.softplus_beta(bad)


def test_unknown_name_lists_registered():
    with pytest.raises(ValueError, match="scale_transform.*'exp_half'"):
        mnn.BayesLinear(3, 2, scale_transform="log")
    with pytest.raises(TypeError, match="scale_transform"):
        mnn.BayesLinear(3, 2, scale_transform=3)


@pytest.mark.parametrize("spec", ["exp", "exp_half", mnn.softplus_beta(3.0)])
def test_layer_uses_the_transform_everywhere(spec):
    """σ, the posterior, the bias posterior and the KL's ρ-gradient all follow the transform."""
    torch.manual_seed(0)
    layer = mnn.BayesLinear(4, 3, scale_transform=spec, bayesian_bias=True, rho_init=-3.0, dtype=torch.float64)
    t = mnn.scale_transform(spec)
    torch.testing.assert_close(layer.weight_sigma, t(layer.weight_rho))
    torch.testing.assert_close(layer.posterior.stddev, t(layer.weight_rho))
    torch.testing.assert_close(layer.bias_posterior.stddev, t(layer.bias_rho))
    # The layer's KL equals the engine's on Normal(μ, t(ρ)) with the same seeds, ρ-gradient included.
    kl = layer.kl(num_samples=64, seed=0)
    g, = torch.autograd.grad(kl, layer.weight_rho)
    rho = layer.weight_rho.detach().requires_grad_()
    q_w = torch.distributions.Normal(layer.weight_mu.detach(), t(rho))
    q_b = torch.distributions.Normal(layer.bias_mu.detach(), t(layer.bias_rho.detach()))
    ref = (mg.kl_divergence(q_w, layer.prior, 64, seed=0).sum()
           + mg.kl_divergence(q_b, layer.bias_prior, 64, seed=mg.engine.noise.streams.mix_seed(0, 1)).sum())
    g_ref, = torch.autograd.grad(ref, rho)
    torch.testing.assert_close(kl.detach(), ref.detach())
    torch.testing.assert_close(g, g_ref)
    assert f"scale_transform={t.name}" in repr(layer)


def test_bayesify_passes_the_transform_and_modules_pickle():
    net = mnn.bayesify(torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 2)),
                       scale_transform=mnn.softplus_beta(2.0), rho_init=-1.0)
    layers = mnn.bayesian_modules(net)
    assert all(l.scale_transform.name == "softplus(beta=2)" for l in layers)
    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    for a, b in zip(layers, mnn.bayesian_modules(back)):
        torch.testing.assert_close(a.weight_sigma, b.weight_sigma)
    assert math.isclose(float(layers[0].weight_sigma[0, 0]), math.log1p(math.exp(-2.0)) / 2, rel_tol=1e-6)
