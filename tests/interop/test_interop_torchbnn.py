"""mcgraph.interop against the real torchbnn package (1.2): σ = exp(log σ)."""

import pytest
import torch
from torch import nn

import mcgraph as mg
import mcgraph.interop as interop
from support.interop_models import (assert_conversion_trains_the_original, assert_data_term_gradients_match,
                            assert_kl_leaves_the_model_alone, peer)
from mcgraph.interop import torchbnn as itb

torchbnn = peer("torchbnn", "torchbnn")


def model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(torchbnn.BayesConv2d(0.0, 0.1, 2, 3, 3, padding=1), torchbnn.BayesBatchNorm2d(0.0, 0.1, 3),
                         nn.ReLU(), nn.Flatten(), torchbnn.BayesLinear(0.0, 0.1, 3 * 16, 4, bias=False),
                         nn.ReLU(), torchbnn.BayesLinear(0.2, 0.5, 4, 3)).to(dtype)


def test_sites_use_the_exp_transform():
    m = model()
    found = interop.sites(m)
    assert [s.name for s in found] == ["0.weight", "0.bias", "1.weight", "1.bias", "4.weight", "6.weight", "6.bias"]
    assert all(s.scale_transform.name == "exp" for s in found)
    assert found[0].raw_scale is m[0].weight_log_sigma
    torch.testing.assert_close(found[-1].scale, m[6].bias_log_sigma.exp())
    p = found[-1].prior
    assert (float(p.loc), float(p.scale)) == pytest.approx((0.2, 0.5))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_kl_loss_equals_bkl_loss(reduction):
    m = model()
    with torch.no_grad():
        for s in interop.sites(m):
            s.raw_scale.add_(torch.rand_like(s.raw_scale) - 1.0)  # away from the prior's σ
    ours = itb.KLLoss(reduction=reduction)(m)
    native = torchbnn.BKLLoss(reduction=reduction)(m)
    assert ours.shape == () and native.shape == (1,)
    torch.testing.assert_close(ours, native[0], rtol=1e-5, atol=0)


def test_kl_graph_does_not_grow_with_samples():
    m = model()
    sizes = [mg.graph_size(itb.kl(m, n, seed=0, method="collapsed")) for n in (1, 4096)]
    assert sizes[0] == sizes[1]
    assert_kl_leaves_the_model_alone(m, lambda mod: itb.kl(mod, 64, seed=0, method="collapsed"))


def test_to_mcgraph_converts_linear_and_conv_with_exp_scales():
    torch.manual_seed(0)
    m = nn.Sequential(torchbnn.BayesConv2d(0.0, 0.1, 2, 3, 3, padding=1, stride=2), nn.ReLU(), nn.Flatten(),
                      torchbnn.BayesLinear(0.0, 0.1, 12, 3)).double()
    bnn = itb.to_mcgraph(m, kl_samples=1)
    assert bnn[0].weight_rho is m[0].weight_log_sigma and bnn[3].bias_mu is m[3].bias_mu
    assert bnn[0].scale_transform.name == "exp" and isinstance(bnn[0].prior, torch.distributions.Normal)
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        for s in interop.sites(m):
            s.raw_scale.fill_(-80.0)  # σ = e^-80: the sampled forward is the mean forward
    with mg.nn.frozen(bnn):
        torch.testing.assert_close(bnn(x), m(x), rtol=1e-9, atol=1e-9)
    assert_conversion_trains_the_original(m, bnn, x, torch.randint(0, 3, (2,)))


def test_converted_elbo_gradients_match_the_per_sample_reference():
    torch.manual_seed(0)
    m = nn.Sequential(torchbnn.BayesLinear(0.0, 0.1, 5, 7), nn.ReLU(), torchbnn.BayesLinear(0.0, 0.1, 7, 3)).double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    assert_data_term_gradients_match(itb.to_mcgraph(m, kl_samples=1), [m[0].weight_log_sigma, m[2].bias_log_sigma], x, y,
                                     num_samples=5, seed=2, chunk_size=3)


def test_to_mcgraph_refuses_bayesian_batchnorm_and_frozen_layers():
    with pytest.raises(TypeError, match=r"'1' \(BayesBatchNorm2d\).*BatchNorm"):
        itb.to_mcgraph(model(), kl_samples=1)
    frozen = torchbnn.BayesLinear(0.0, 0.1, 3, 2)
    frozen.freeze()
    with pytest.raises(TypeError, match=r"frozen by freeze\(\)"):
        itb.to_mcgraph(nn.ModuleDict({"fc": frozen}), kl_samples=1)
    plain_norm = nn.Sequential(torchbnn.BayesLinear(0.0, 0.1, 3, 2), torchbnn.BayesBatchNorm2d(0, 0.1, 2, affine=False))
    assert isinstance(itb.to_mcgraph(plain_norm, kl_samples=1)[1], torchbnn.BayesBatchNorm2d)  # no Bayesian parameters: kept
