"""mcgraph.interop against the real bayesian-torch package (0.5.0)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mcgraph as mg
import mcgraph.interop as interop
from mcgraph.interop import bayesian_torch as ibt
from support.interop_models import NoiseRecorder, assert_data_term_gradients_match, mlp_loss, peer, relative_error

bt = peer("bayesian_torch", "bayesian-torch")
from bayesian_torch.layers import (  # noqa: E402
    Conv2dFlipout, Conv2dReparameterization, ConvTranspose2dReparameterization, LinearFlipout, LinearReparameterization,
    LSTMReparameterization)
from bayesian_torch.models.dnn_to_bnn import dnn_to_bnn, get_kl_loss  # noqa: E402

PRIOR = {"prior_mu": 0.0, "prior_sigma": 1.0, "posterior_mu_init": 0.0, "posterior_rho_init": -3.0,
         "type": "Reparameterization", "moped_enable": False}


class Mixed(nn.Module):
    """Every layer kind bayesian-torch has, in its own (out, kl) convention."""

    def __init__(self):
        super().__init__()
        self.conv = Conv2dReparameterization(2, 3, 3, padding=1)
        self.up = ConvTranspose2dReparameterization(3, 2, 2, stride=2, bias=False)
        self.flip = Conv2dFlipout(2, 2, 3)
        self.fc = LinearReparameterization(2 * 6 * 6, 5)
        self.head = LinearFlipout(5, 3)


def dnn_model(kind="Reparameterization", dtype=torch.float32):
    # bayesian-torch 0.5.0's ConvTranspose2dFlipout is broken (see test_broken_prior_buffers_are_named): the
    # Flipout model has a strided Conv2d where the other has a ConvTranspose2d.
    torch.manual_seed(0)
    middle = nn.ConvTranspose2d(3, 2, 2, stride=2) if kind == "Reparameterization" else \
        nn.Conv2d(3, 2, 3, padding=2, dilation=2, groups=1, stride=1)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), middle, nn.Flatten(),
                        nn.Linear(2 * (8 if kind == "Reparameterization" else 4) ** 2, 6), nn.ReLU(), nn.Linear(6, 3))
    dnn_to_bnn(net, dict(PRIOR, type=kind))
    return net.to(dtype)


def mlp(dtype=torch.float64):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    dnn_to_bnn(net, PRIOR)
    return net.to(dtype)


# --------------------------------------------------------------------------- sites


def test_sites_of_every_layer_kind():
    model = Mixed()
    found = interop.sites(model)
    assert [s.name for s in found] == ["conv.weight", "conv.bias", "up.weight", "flip.weight", "flip.bias",
                                       "fc.weight", "fc.bias", "head.weight", "head.bias"]
    assert {s.library for s in found} == {"bayesian-torch"}
    assert all(s.scale_transform.name == "softplus" for s in found)
    assert found[0].loc is model.conv.mu_kernel and found[0].raw_scale is model.conv.rho_kernel
    assert found[2].loc.shape == (3, 2, 2, 2)  # transposed layout (in, out / groups, k, k)
    assert found[5].loc is model.fc.mu_weight and found[6].raw_scale is model.fc.rho_bias
    torch.testing.assert_close(found[0].scale, torch.log1p(torch.exp(model.conv.rho_kernel)))
    assert [s.name for s in ibt.sites(dnn_model())] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight",
                                                         "4.bias", "6.weight", "6.bias"]


def test_lstm_sites_are_its_two_linear_layers_once():
    lstm = LSTMReparameterization(3, 4)
    found = interop.sites(lstm)
    assert [s.name for s in found] == ["ih.weight", "ih.bias", "hh.weight", "hh.bias"]
    # get_kl_loss visits the LSTM and its ih/hh children: it counts the LSTM's KL twice.
    torch.testing.assert_close(get_kl_loss(lstm), 2 * ibt.kl(lstm, 1, reduction="per_tensor_mean"))


# --------------------------------------------------------------------------- KL against the library's closed form


@pytest.mark.parametrize("build", [Mixed, dnn_model, lambda: dnn_model("Flipout")], ids=["mixed", "dnn_to_bnn",
                                                                                        "dnn_to_bnn-flipout"])
def test_per_tensor_mean_equals_get_kl_loss(build):
    model = build()
    ours = ibt.kl(model, 1, reduction="per_tensor_mean")
    torch.testing.assert_close(ours, get_kl_loss(model), rtol=1e-5, atol=0)
    exact = sum(torch.distributions.kl_divergence(s.posterior, s.prior).sum() for s in interop.sites(model))
    torch.testing.assert_close(ibt.kl(model, 1), exact, rtol=1e-6, atol=0)


def test_moped_per_element_prior_and_float64():
    model = dnn_model(dtype=torch.float64)
    torch.manual_seed(1)
    for layer in (model[0], model[4]):  # MOPED: prior means set per weight from a trained network
        layer.prior_weight_mu.copy_(torch.randn_like(layer.prior_weight_mu))
        layer.prior_weight_sigma.uniform_(0.5, 2.0)
    value = ibt.kl(model, 1, reduction="per_tensor_mean")
    assert value.dtype == torch.float64
    torch.testing.assert_close(value, get_kl_loss(model), rtol=1e-5, atol=0)
    bnn = ibt.to_mcgraph(model, kl_samples=1)  # per-element priors: the converted layers share the buffers
    assert bnn[0].prior_weight_mu is model[0].prior_weight_mu
    torch.testing.assert_close(bnn[0].prior.loc, model[0].prior_weight_mu)
    torch.testing.assert_close(bnn[0].bias_prior.scale, model[0].prior_bias_sigma)
    torch.testing.assert_close(bnn[2].prior.scale, torch.ones((), dtype=torch.float64))  # constant: scalar
    exact = sum(torch.distributions.kl_divergence(l.posterior, l.prior).sum()
                + torch.distributions.kl_divergence(l.bias_posterior, l.bias_prior).sum()
                for l in mg.nn.bayesian_modules(bnn))
    torch.testing.assert_close(exact, ibt.kl(model, 1), rtol=1e-10, atol=0)


def test_broken_prior_buffers_are_named():
    """bayesian-torch 0.5.0's ConvTranspose2dFlipout registers prior_weight_sigma in the Conv layout: its own
    kl_loss fails; the adapter names the site and the shapes."""
    model = nn.ModuleDict({"up": bt.layers.ConvTranspose2dFlipout(3, 2, 2)})
    with pytest.raises(RuntimeError):
        get_kl_loss(model)
    with pytest.raises(ValueError, match=r"site 'up.weight' \(bayesian-torch\).*\(3, 2, 2, 2\).*\(2, 3, 2, 2\)"):
        ibt.kl(model, 1)


def test_kl_graph_does_not_grow_with_samples_and_leaves_the_model_alone():
    model = Mixed()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sizes = [mg.graph_size(ibt.kl(model, m, seed=0, method="collapsed")) for m in (1, 4096)]
    assert sizes[0] == sizes[1]
    value = ibt.kl(model, 4096, seed=0, method="collapsed")
    value.backward()
    assert model.fc.rho_weight.grad is not None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --------------------------------------------------------------------------- gradients of the data term


def _recorded_reference(model, x, y, recorder, M):
    pairs_per_sample = []
    layers = [model[0], model[2]]
    for i in range(M):
        pairs = []
        for k, layer in enumerate(layers):
            d = recorder.draws[k][i]
            pairs.append((layer.mu_weight + torch.log1p(torch.exp(layer.rho_weight)) * d["eps_weight"],
                          layer.mu_bias + torch.log1p(torch.exp(layer.rho_bias)) * d["eps_bias"]))
        pairs_per_sample.append(pairs)
    loss = sum(mlp_loss(x, y, p) for p in pairs_per_sample) / M
    return torch.autograd.grad(loss, [layers[0].rho_weight, layers[0].mu_weight])


def test_elbo_backward_is_correct_where_the_native_loop_is_not():
    M = 6
    torch.manual_seed(0)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    model = mlp()
    rec = NoiseRecorder([model[0], model[2]], ["eps_weight", "eps_bias"])
    interop.elbo_backward(model, lambda m: F.cross_entropy(m(x), y), M)
    rec.remove()
    got_rho, got_mu = model[0].rho_weight.grad.clone(), model[0].mu_weight.grad.clone()
    ref_rho, ref_mu = _recorded_reference(model, x, y, rec, M)
    torch.testing.assert_close(got_rho, ref_rho, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(got_mu, ref_mu, rtol=1e-5, atol=1e-12)
    # bayesian-torch's own M-sample loop (its examples): one graph, the buffer refilled in place.
    model.zero_grad()
    rec = NoiseRecorder([model[0], model[2]], ["eps_weight", "eps_bias"])
    (sum(F.cross_entropy(model(x), y) for _ in range(M)) / M).backward()
    rec.remove()
    ref_rho, ref_mu = _recorded_reference(model, x, y, rec, M)
    assert relative_error(model[0].rho_weight.grad, ref_rho) > 0.1
    torch.testing.assert_close(model[0].mu_weight.grad, ref_mu, rtol=1e-5, atol=1e-12)  # μ-gradients are unaffected


def test_elbo_backward_adds_the_kl_once():
    model = mlp()
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    torch.manual_seed(3)
    loss = interop.elbo_backward(model, lambda m: torch.zeros((), dtype=torch.float64), 3,
                                 kl=lambda: ibt.kl(model, 1), kl_weight=0.5, dataset_size=10)
    kl = ibt.kl(model, 1)
    torch.testing.assert_close(loss, 0.5 * kl.detach() / 10)
    ref, = torch.autograd.grad(0.5 * kl / 10, model[0].rho_weight)
    torch.testing.assert_close(model[0].rho_weight.grad, ref)


# --------------------------------------------------------------------------- conversion with shared Parameters


def test_to_mcgraph_shares_parameters_and_buffers_and_keeps_the_original():
    model = dnn_model()
    params = {id(p) for p in model.parameters()}
    bnn = ibt.to_mcgraph(model, kl_samples=16)
    assert isinstance(model[0], Conv2dReparameterization)  # the original is unchanged
    assert {id(p) for p in bnn.parameters()} == params
    assert bnn[0].weight_mu is model[0].mu_kernel and bnn[0].bias_rho is model[0].rho_bias
    assert bnn[2].weight_rho is model[2].rho_kernel and bnn[4].weight_mu is model[4].mu_weight
    assert isinstance(bnn[0].prior_spec, interop.foreign_priors.NormalPrior)  # constant buffers: a scalar prior
    assert isinstance(bnn[2], mg.nn.BayesConvTranspose) and bnn[0].kl_samples == 16
    # One optimizer step on the converted model moves the original's Parameters.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 2, 4, 4), torch.randint(0, 3, (4,))
    before = model[4].mu_weight.detach().clone()
    (-mg.nn.elbo(bnn, x, y, num_samples=4, dataset_size=100, seed=0)).backward()
    opt.step()
    assert not torch.equal(before, model[4].mu_weight)
    # The original's state_dict carries the trained values.
    assert torch.equal(model.state_dict()["4.mu_weight"], bnn[4].weight_mu.detach())


@pytest.mark.parametrize("kind", ["Reparameterization", "Flipout"])
def test_converted_geometry_matches_the_original(kind):
    """With σ ≈ 0 the original's sampled forward is its mean forward: the converted mean forward equals it."""
    model = dnn_model(kind, dtype=torch.float64)
    with torch.no_grad():
        for s in interop.sites(model):
            s.raw_scale.fill_(-60.0)
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    bnn = ibt.to_mcgraph(model, kl_samples=1)
    assert all(layer.flipout == (kind == "Flipout") for layer in mg.nn.bayesian_modules(bnn))
    with mg.nn.frozen(bnn):
        torch.testing.assert_close(bnn(x), model(x), rtol=1e-9, atol=1e-9)


def test_converted_elbo_gradients_match_the_per_sample_reference():
    M = 5
    model = mlp()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    bnn = ibt.to_mcgraph(model, kl_samples=1)
    assert_data_term_gradients_match(bnn, [model[0].rho_weight, model[2].rho_bias, model[0].mu_weight], x, y,
                                     num_samples=M, seed=7, chunk_size=2)
    sizes = [mg.graph_size(-mg.nn.elbo(bnn, x, y, num_samples=m, dataset_size=60, seed=0)) for m in (2, 64)]
    assert sizes[0] == sizes[1]


def test_to_mcgraph_refuses_tuple_layers():
    # LSTMReparameterization converts after dnn_to_bnn (tests/interop/test_interop_recurrent.py), LSTMFlipout does not
    with pytest.raises(TypeError, match=r"'fc' \(LinearReparameterization\).*\(out, kl\) tuples"):
        ibt.to_mcgraph(nn.ModuleDict({"fc": LinearReparameterization(2, 2)}), kl_samples=1)
