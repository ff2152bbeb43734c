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


# --------------------------------------------------------------------------- subclass-safe construction


def test_from_torch_builds_the_class_it_is_called_on():
    class MyConv(mg.nn.BayesConv2d):
        pass

    class MyLinear(mg.nn.BayesLinear):
        pass

    class MyUp(mg.nn.BayesConvTranspose2d):
        pass

    assert type(MyConv.from_torch(torch.nn.Conv2d(3, 4, 3))) is MyConv
    assert type(MyLinear.from_torch(torch.nn.Linear(3, 4))) is MyLinear
    assert type(MyUp.from_torch(torch.nn.ConvTranspose2d(3, 4, 2))) is MyUp
    assert type(mg.nn.BayesConv.from_torch(torch.nn.Conv1d(3, 4, 3))) is mg.nn.BayesConv
    with pytest.raises(ValueError, match=r"module: BayesConv2d converts 2-d convolutions, got Conv1d"):
        mg.nn.BayesConv2d.from_torch(torch.nn.Conv1d(3, 4, 3))


def test_a_subclass_that_builds_its_own_distributions_takes_the_general_kl_path():
    class Shifted(mg.nn.BayesLinear):
        @property
        def prior(self):
            return torch.distributions.Normal(torch.tensor(0.5), torch.tensor(1.0))

    torch.manual_seed(0)
    plain, shifted = mg.nn.BayesLinear(4, 3), Shifted(4, 3)
    shifted.load_state_dict(plain.state_dict())
    assert plain._has_plain_distributions() and not shifted._has_plain_distributions()
    expected = torch.distributions.kl_divergence(shifted.posterior, shifted.prior).sum()
    torch.testing.assert_close(shifted.kl(), expected)
    assert not torch.allclose(plain.kl(), shifted.kl())


def test_the_recurrent_construction_hook_builds_another_layout():
    """A subclass of BayesRNNBase builds its own sites through the hook, never bypassing __init__."""
    from mcgraph.nn.recurrent import BayesRNNBase

    class Counted(BayesRNNBase):
        def _build_sites(self, factory, options):
            names = super()._build_sites(factory, options)
            self.sites_built = [n for group in names for n in group]
            return names

    layer = Counted("LSTM", 3, 4, num_layers=2)
    assert layer.sites_built == ["ih_l0", "hh_l0", "ih_l1", "hh_l1"]
    out, (h, c) = layer(torch.randn(5, 2, 3))
    assert out.shape == (5, 2, 4) and h.shape == c.shape == (2, 2, 4)
