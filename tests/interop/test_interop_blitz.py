"""mcgraph.interop against the real blitz package (blitz-bayesian-pytorch 0.2.8)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mcgraph as mg
import mcgraph.interop as interop
from support.interop_models import (Z_4_5, NoiseRecorder, assert_data_term_gradients_match,
                            assert_kl_leaves_the_model_alone, mean_and_standard_error, mlp_loss, peer,
                            relative_error)
from mcgraph.interop import blitz as ibz

peer("blitz", "blitz-bayesian-pytorch")
from blitz.modules import BayesianConv2d, BayesianEmbedding, BayesianLinear, BayesianLSTM  # noqa: E402
from blitz.utils import variational_estimator  # noqa: E402

MIXTURE = dict(prior_pi=0.5, prior_sigma_1=0.1, prior_sigma_2=0.002)


@variational_estimator
class ConvNet(nn.Module):
    def __init__(self, **prior):
        super().__init__()
        self.conv = BayesianConv2d(2, 3, (3, 3), posterior_rho_init=-3.0, **prior)
        self.fc = BayesianLinear(12, 3, bias=False, posterior_rho_init=-3.0, **prior)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


@variational_estimator
class MLP(nn.Sequential):
    pass


def mlp(dtype=torch.float64):
    torch.manual_seed(0)
    return MLP(BayesianLinear(5, 7, posterior_rho_init=-2.0, **MIXTURE), nn.ReLU(),
               BayesianLinear(7, 3, posterior_rho_init=-2.0, **MIXTURE)).to(dtype)


def test_sites_are_the_samplers_parameters():
    torch.manual_seed(0)
    model = ConvNet(**MIXTURE)
    found = interop.sites(model)
    assert [s.name for s in found] == ["conv.weight", "conv.bias", "fc.weight"]  # fc has bias=False
    assert found[0].loc is model.conv.weight_sampler.mu and found[0].raw_scale is model.conv.weight_sampler.rho
    assert found[0].loc is not model.conv.weight_mu  # blitz's alias of the same storage
    assert isinstance(found[0].prior, mg.distributions.ScaleMixtureNormal)
    ibz.kl(model, 64, seed=0).backward()
    assert model.conv.weight_sampler.rho.grad is not None and model.conv.weight_rho.grad is None


def test_recurrent_sites_and_custom_priors():
    lstm = BayesianLSTM(3, 4, prior_dist=torch.distributions.Laplace(0.0, 1.0))
    found = interop.sites(lstm)
    assert [s.name for s in found] == ["weight_ih", "weight_hh", "bias"]
    assert found[0].loc.shape == (3, 16)
    assert isinstance(found[0].prior, torch.distributions.Laplace)
    floored = ibz.sites(lstm, prior_floor=1e-6)[0].prior
    w = torch.tensor([0.0, 30.0])
    torch.testing.assert_close(floored.log_prob(w), torch.log(torch.exp(found[0].prior.log_prob(w)) + 1e-6))


def test_kl_graph_does_not_grow_with_samples():
    model = ConvNet(**MIXTURE)
    sizes = [mg.graph_size(ibz.kl(model, m, seed=0, prior_floor=1e-6)) for m in (1, 4096)]
    assert sizes[0] == sizes[1]
    assert_kl_leaves_the_model_alone(model, lambda mod: ibz.kl(mod, 64, seed=0, prior_floor=1e-6))


@pytest.mark.parametrize("prior", [MIXTURE, dict(prior_pi=0.3, prior_sigma_1=1.0, prior_sigma_2=0.05)],
                         ids=["blitz-default-scales", "wide"])
def test_kl_agrees_with_the_mean_of_native_one_sample_estimates(prior):
    """M = 20 000 adapter KL vs the mean of 2 000 blitz estimates (forward, then nn_kl_divergence()).

    With ``prior_floor=1e-6`` both estimate the same quantity. Tolerance: 4.5 combined standard errors
    (the native spread / √2000 and the adapter's log-prior spread / √20000, both measured): two-sided
    false-alarm rate 6.8e-6 per case.
    """
    torch.manual_seed(1)
    model = MLP(BayesianLinear(4, 3, posterior_rho_init=-3.0, **prior),
                BayesianLinear(3, 2, bias=False, posterior_rho_init=-3.0, **prior))
    x = torch.randn(1, 4)
    native, log_priors = [], []
    with torch.no_grad():
        for _ in range(2000):
            model(x)
            native.append(float(model.nn_kl_divergence()))
            log_priors.append(float(model[0].log_prior + model[1].log_prior))
        ours = float(ibz.kl(model, 20_000, seed=5, prior_floor=1e-6))
    mean, se = mean_and_standard_error(native)
    se_adapter = torch.tensor(log_priors, dtype=torch.float64).std().item() / math.sqrt(20_000)
    assert abs(ours - mean) < Z_4_5 * math.hypot(se, se_adapter), (ours, mean, se, se_adapter)


# --------------------------------------------------------------------------- gradients


def _reference(model, x, y, recorder, M):
    layers = [model[0], model[2]]
    per_sample = []
    for i in range(M):
        pairs = []
        for k, layer in enumerate(layers):
            d = recorder.draws[k][i]
            w = layer.weight_sampler.mu + torch.log1p(torch.exp(layer.weight_sampler.rho)) * d["weight_sampler.eps_w"]
            b = layer.bias_sampler.mu + torch.log1p(torch.exp(layer.bias_sampler.rho)) * d["bias_sampler.eps_w"]
            pairs.append((w, b))
        per_sample.append(pairs)
    loss = sum(mlp_loss(x, y, p) for p in per_sample) / M
    return torch.autograd.grad(loss, [layers[0].weight_sampler.rho, layers[1].bias_sampler.rho])


def test_elbo_backward_is_correct_where_sample_elbo_is_not():
    M = 6
    model = mlp()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    attrs = ["weight_sampler.eps_w", "bias_sampler.eps_w"]
    rec = NoiseRecorder([model[0], model[2]], attrs)
    interop.elbo_backward(model, lambda m: F.cross_entropy(m(x), y), M)
    rec.remove()
    got = [model[0].weight_sampler.rho.grad.clone(), model[2].bias_sampler.rho.grad.clone()]
    for g, r in zip(got, _reference(model, x, y, rec, M)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-12)
    # blitz's sample_elbo: M forwards in one graph with the noise buffer refilled in place.
    model.zero_grad()
    rec = NoiseRecorder([model[0], model[2]], attrs)
    model.sample_elbo(x, y, nn.CrossEntropyLoss(), sample_nbr=M, complexity_cost_weight=0.0).backward()
    rec.remove()
    ref_rho, _ = _reference(model, x, y, rec, M)
    assert relative_error(model[0].weight_sampler.rho.grad, ref_rho) > 0.1


# --------------------------------------------------------------------------- conversion


def test_to_mcgraph_shares_the_samplers_parameters():
    model = mlp(torch.float32)  # .to(float64) would give blitz's alias weight_mu its own storage
    bnn = ibz.to_mcgraph(model, kl_samples=256)
    assert bnn[0].weight_mu is model[0].weight_sampler.mu and bnn[2].bias_rho is model[2].bias_sampler.rho
    assert isinstance(bnn[0].prior, mg.distributions.ScaleMixtureNormal)
    assert isinstance(model[0], BayesianLinear)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    before = model[0].weight_mu.detach().clone()  # blitz's alias: shares storage with the sampler's mu
    (-mg.nn.elbo(bnn, x, y, num_samples=4, dataset_size=100, seed=0)).backward()
    opt.step()
    assert not torch.equal(before, model[0].weight_mu)
    with torch.no_grad():
        model[0].freeze = True
    frozen = ibz.to_mcgraph(model, kl_samples=1)
    assert frozen[0].mode == mg.nn.SampleMode.MEAN and frozen[2].mode == mg.nn.SampleMode.SAMPLE
    torch.testing.assert_close(frozen[0](x), model[0](x))


def test_converted_elbo_gradients_match_the_per_sample_reference():
    M = 5
    model = mlp()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    bnn = ibz.to_mcgraph(model, prior_floor=1e-6, kl_samples=1)
    assert isinstance(bnn[0].prior, interop.foreign_priors.FlooredDensity)
    assert_data_term_gradients_match(bnn, [model[0].weight_sampler.rho, model[2].bias_sampler.rho,
                                           model[0].weight_sampler.mu], x, y, num_samples=M, seed=3, chunk_size=2)


def test_to_mcgraph_refuses_embedding_layers():
    # recurrent layers convert (tests/interop/test_interop_recurrent.py); blitz's embedding has no converter
    with pytest.raises(TypeError, match=r"'emb' \(BayesianEmbedding\).*elbo_backward"):
        ibz.to_mcgraph(nn.ModuleDict({"emb": BayesianEmbedding(10, 4)}), kl_samples=1)
