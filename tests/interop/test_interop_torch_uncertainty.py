"""mcgraph.interop against torch-uncertainty 0.13.0's Bayesian layers and KLDiv loss.

``import torch_uncertainty`` needs lightning and torchvision, and the torchvision builds on the
package index do not load beside this CPU torch build; the layer and loss modules themselves
need only torch, so :func:`load_torch_uncertainty` imports them from the installed wheel
without the package ``__init__``.
"""

import math

import pytest
import torch
from torch import nn

import mcgraph as mg
import mcgraph.interop as interop
from support.interop_models import (Z_4_5, assert_conversion_trains_the_original, assert_data_term_gradients_match,
                            assert_kl_leaves_the_model_alone, load_torch_uncertainty, mean_and_standard_error)
from mcgraph.interop import torch_uncertainty as itu


@pytest.fixture(scope="module")
def tu():
    layers, losses, restore = load_torch_uncertainty()
    yield layers, losses
    restore()


def test_sites_read_rho_from_the_sigma_parameters(tu):
    layers, _ = tu
    torch.manual_seed(0)
    model = nn.Sequential(layers.BayesConv2d(2, 3, 3, prior_pi=0.5), nn.Flatten(), layers.BayesLinear(12, 2))
    found = interop.sites(model)
    assert [s.name for s in found] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert found[0].raw_scale is model[0].weight_sigma and found[2].loc is model[2].weight_mu
    torch.testing.assert_close(found[0].scale, torch.log1p(torch.exp(model[0].weight_sigma)))
    assert isinstance(found[0].prior, mg.distributions.ScaleMixtureNormal)
    assert isinstance(found[2].prior, torch.distributions.Normal)  # prior_pi = 1


def test_layer_mean_agrees_with_the_mean_of_native_kldiv_estimates(tu):
    """M = 20 000 adapter KL (``layer_mean``) vs the mean of 2 000 ``KLDiv`` estimates plus n / (2 L).

    KLDiv's log-posterior subtracts ½ per weight and its prior does not, so its estimates are offset
    by −n/2 over L layers. Tolerance: 4.5 combined standard errors (native spread / √2000, the
    adapter's log-prior spread / √20000, both measured): false-alarm rate 6.8e-6.
    """
    layers, losses = tu
    torch.manual_seed(2)
    model = nn.Sequential(layers.BayesLinear(4, 3, prior_pi=0.5, sigma_init=-3.0), nn.ReLU(),
                          layers.BayesLinear(3, 2, prior_pi=0.3, prior_sigma_1=1.0, prior_sigma_2=0.05,
                                             sigma_init=-3.0, bias=False))
    kl_div = losses.KLDiv(model)
    n = sum(s.numel for s in interop.sites(model))
    x = torch.randn(1, 4)
    native, log_priors = [], []
    with torch.no_grad():
        for _ in range(2000):
            model(x)
            native.append(float(kl_div()) + n / 2 / 2)
            log_priors.append(float(model[0].log_prior + model[2].log_prior))
        ours = float(itu.kl(model, 20_000, seed=3, reduction="layer_mean"))
    mean, se = mean_and_standard_error(native)
    se_adapter = torch.tensor(log_priors, dtype=torch.float64).std().item() / math.sqrt(20_000) / 2
    assert abs(ours - mean) < Z_4_5 * math.hypot(se, se_adapter), (ours, mean, se, se_adapter)


def test_kl_graph_does_not_grow_with_samples(tu):
    layers, _ = tu
    model = nn.Sequential(layers.BayesLinear(4, 3, prior_pi=0.5))
    sizes = [mg.graph_size(itu.kl(model, m, seed=0)) for m in (1, 4096)]
    assert sizes[0] == sizes[1]
    assert_kl_leaves_the_model_alone(model, lambda mod: itu.kl(mod, 64, seed=0))


def test_to_mcgraph_shares_parameters_and_matches_the_mean_forward(tu):
    layers, _ = tu
    torch.manual_seed(0)
    model = nn.Sequential(layers.BayesConv2d(2, 3, 3, padding=1, padding_mode="reflect", prior_pi=0.5),
                          nn.Flatten(), layers.BayesLinear(48, 2)).double()
    bnn = itu.to_mcgraph(model, kl_samples=100)
    assert bnn[0].weight_rho is model[0].weight_sigma and bnn[2].bias_mu is model[2].bias_mu
    assert bnn[0].padding_mode == "reflect" and isinstance(bnn[0].prior, mg.distributions.ScaleMixtureNormal)
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    assert_conversion_trains_the_original(model, bnn, x, torch.randint(0, 2, (2,)))
    for layer in (model[0], model[2]):
        layer.freeze()
    frozen = itu.to_mcgraph(model, kl_samples=1)
    assert all(l.mode == mg.nn.SampleMode.MEAN for l in mg.nn.bayesian_modules(frozen))
    torch.testing.assert_close(frozen(x), model(x), rtol=1e-12, atol=1e-12)


def test_converted_elbo_gradients_match_the_per_sample_reference(tu):
    layers, _ = tu
    torch.manual_seed(0)
    model = nn.Sequential(layers.BayesLinear(5, 7, sigma_init=-2.0), nn.ReLU(),
                          layers.BayesLinear(7, 3, sigma_init=-2.0)).double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    assert_data_term_gradients_match(itu.to_mcgraph(model, kl_samples=1), [model[0].weight_sigma, model[2].bias_sigma], x, y,
                                     num_samples=4, seed=1, chunk_size=3)


def test_lpbnn_layers_are_refused(tu):
    layers, _ = tu
    model = nn.Sequential(layers.BayesLinear(4, 3), layers.LPBNNLinear(3, 2, num_estimators=2))
    with pytest.raises(TypeError, match=r"'1' \(LPBNNLinear\).*LPBNN"):
        itu.kl(model, 10)
