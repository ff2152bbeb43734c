"""A Bayesian layer's posterior and prior are both properties returning plain torch distributions."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch import nn

import mcgraph as mg
import mcgraph.nn as mnn


def test_posterior_and_prior_are_reached_the_same_way():
    layer = mnn.BayesLinear(4, 3, bayesian_bias=True, prior="laplace")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q, p = layer.posterior, layer.prior
        qb, pb = layer.bias_posterior, layer.bias_prior
    assert type(q).__name__ == "Normal" and isinstance(q, torch.distributions.Normal)
    assert isinstance(p, torch.distributions.Laplace) and isinstance(pb, torch.distributions.Laplace)
    assert q.batch_shape == (3, 4) and qb.batch_shape == (3,)
    torch.testing.assert_close(q.stddev, layer.weight_sigma)
    assert q.loc.requires_grad and mg.family_of(q).noise.name == "N(0, 1)"
    torch.distributions.kl_divergence(q, torch.distributions.Normal(0.0, 1.0))   # torch's KL registry still applies
    assert mnn.BayesLinear(2, 2).bias_posterior is None


def test_the_posterior_is_a_plain_torch_distribution():
    layer = mnn.BayesLinear(4, 3, bayesian_bias=True)
    q, p = layer.posterior, layer.prior
    assert type(q) is torch.distributions.Normal and type(layer.bias_posterior) is torch.distributions.Normal
    assert callable(q) == callable(p) == False  # noqa: E712  (no callable shim on either)
    with pytest.raises(TypeError):
        layer.posterior()
    torch.testing.assert_close(q.mean, layer.weight_mu)
    assert q.expand((2, 3, 4)).batch_shape == (2, 3, 4)
    est = layer.kl(8, seed=0, method="monte-carlo", return_stderr=True)
    assert isinstance(est, mg.MCEstimate) and est.num_samples == 8 and est.stderr > 0
    assert layer.kl(8, seed=0, return_stderr=True).stderr == 0  # Normal ‖ Normal: torch's closed form


def test_internal_callers_do_not_warn():
    torch.manual_seed(0)
    net = mnn.bayesify(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)),
                       posterior="radial", kl_samples=10)
    x, y = torch.randn(4, 1, 6, 6), torch.randint(0, 3, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        loss = -mnn.elbo(net, x, y, num_samples=3, dataset_size=100, seed=0)
        loss.backward()
        mnn.predict(net, x, num_samples=2)
        mnn.kl(net, seed=0, return_stderr=True)
    assert pickle.loads(pickle.dumps(net)) is not None   # modules pickle (distributions are built on demand)
