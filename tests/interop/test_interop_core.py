"""mcgraph.interop's core: import hygiene, the adapter registry, errors, priors, elbo_backward's arguments."""

import copy
import io
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

import mcgraph as mg
import mcgraph.interop as interop
from support.interop_models import peer
from mcgraph.interop.foreign_priors import FlooredDensity, MixturePrior

PEERS = ("bayesian_torch", "blitz", "torchbnn", "torch_uncertainty", "pyro", "tyxe", "lightning", "torchvision")


def test_importing_mcgraph_and_its_interop_imports_no_peer_library():
    """In a fresh process: nothing of the peers is imported, and a missing one is named by its pip package."""
    code = f"""
import sys, importlib.abc
import mcgraph, mcgraph.interop as interop
interop.load_adapters()
for name in ("bayesian_torch", "blitz", "torchbnn", "torch_uncertainty", "pyro", "tyxe"):
    getattr(interop, name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {PEERS!r})
assert not loaded, loaded

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "pyro":
            raise ImportError("hidden")
sys.meta_path.insert(0, Hide())
try:
    interop.pyro.MeanFieldELBO
except ImportError as e:
    assert "pip install pyro-ppl" in str(e), e
else:
    raise AssertionError("no ImportError")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_every_registered_adapter_is_complete():
    adapters = interop.load_adapters()
    assert {"bayesian-torch", "blitz", "torchbnn", "torch-uncertainty"} <= set(adapters)
    for name, adapter in adapters.items():
        assert adapter.name == name and adapter.pip and adapter.packages
        assert type(adapter).owns is not interop.LibraryAdapter.owns
        assert type(adapter).layer_sites is not interop.LibraryAdapter.layer_sites
    with pytest.raises(AttributeError):
        interop.no_such_library


def test_models_without_foreign_layers_are_refused():
    plain = nn.Sequential(nn.Linear(3, 2))
    with pytest.raises(ValueError, match="no Bayesian layer"):
        interop.kl(plain, 10)
    with pytest.raises(ValueError, match="no Bayesian layer"):
        interop.sites(mg.nn.bayesify(plain))  # mcgraph's own layers: mg.nn.kl
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        interop.sites("model")
    with pytest.raises(ValueError, match="library must be one of"):
        interop.sites(plain, library="edward")


def test_mixed_libraries_are_refused():
    peer("bayesian_torch", "bayesian-torch")
    peer("blitz", "blitz-bayesian-pytorch")
    from bayesian_torch.layers import LinearReparameterization
    from blitz.modules import BayesianLinear

    model = nn.Sequential(LinearReparameterization(3, 4), BayesianLinear(4, 2))
    with pytest.raises(ValueError, match=r"bayesian-torch: '0' \(LinearReparameterization\).*blitz: '1' "
                                         r"\(BayesianLinear\)"):
        interop.kl(model, 10)
    with pytest.raises(ValueError, match="are bayesian-torch layers.*not blitz"):
        interop.blitz.kl(nn.Sequential(LinearReparameterization(3, 4)), 10)


def test_argument_errors():
    peer("bayesian_torch", "bayesian-torch")
    peer("blitz", "blitz-bayesian-pytorch")
    from bayesian_torch.layers import LinearReparameterization
    from blitz.modules import BayesianLinear

    layer = LinearReparameterization(3, 4)
    layer.prior_weight_mu = torch.zeros(5)  # a prior that does not broadcast with the weight
    with pytest.raises(ValueError, match=r"site 'weight' \(bayesian-torch\)"):
        interop.kl(layer, 10)
    layer = LinearReparameterization(3, 4)
    layer.prior_bias_mu = torch.zeros(2, 4)  # broadcasts, but to a larger shape than the bias
    layer.prior_bias_sigma = torch.ones(2, 4)
    with pytest.raises(ValueError, match=r"site 'bias'.*\(2, 4\) does not broadcast to the tensor's shape \(4,\)"):
        interop.kl(layer, 10)
    layer = LinearReparameterization(3, 4)
    with pytest.raises(ValueError, match="reduction must be one of"):
        interop.kl(layer, 10, reduction="mean")
    with pytest.raises(ValueError, match="method must be one of"):
        interop.kl(layer, 10, method="exact")
    with pytest.raises(ValueError, match="num_samples"):
        interop.kl(layer, 0)
    with pytest.raises(TypeError, match="need library="):
        interop.kl(layer, 10, prior_floor=1e-6)
    with pytest.raises(ValueError, match="prior_floor"):
        interop.blitz.kl(BayesianLinear(3, 2), 10, prior_floor=-1.0)
    with pytest.raises(NotImplementedError, match="closed-form.*ScaleMixtureNormal"):
        interop.blitz.kl(BayesianLinear(3, 2, prior_pi=0.5), 10, method="closed-form")
    with pytest.raises(ValueError, match="kl_samples"):
        interop.bayesian_torch.to_mcgraph(layer, kl_samples=0)


def test_elbo_backward_argument_errors():
    model = nn.Linear(2, 2)

    def loss(m):
        return m(torch.ones(1, 2)).sum()

    with pytest.raises(ValueError, match="num_samples"):
        interop.elbo_backward(model, loss, 0)
    with pytest.raises(ValueError, match="dataset_size is required"):
        interop.elbo_backward(model, loss, 2, kl=torch.zeros(()))
    with pytest.raises(ValueError, match="loss_fn must return a tensor with one element"):
        interop.elbo_backward(model, lambda m: m(torch.ones(3, 2)), 2)
    with pytest.raises(TypeError, match="loss_fn"):
        interop.elbo_backward(model, "loss", 2)


def test_floored_density_and_mixture_prior():
    base = torch.distributions.Normal(0.0, 0.1)
    w = torch.tensor([0.0, 0.3, 5.0])
    floored = FlooredDensity(base, 1e-6)
    torch.testing.assert_close(floored.log_prob(w), torch.log(base.log_prob(w).exp() + 1e-6))
    assert floored.log_prob(torch.tensor(50.0)).item() == pytest.approx(math.log(1e-6))
    with pytest.raises(ValueError, match="floor"):
        FlooredDensity(base, 0.0)
    like = torch.zeros(2, dtype=torch.float64)
    assert isinstance(MixturePrior(1.0, 0.1, 0.4)(like), torch.distributions.Normal)
    p = MixturePrior(0.25, 1.0, 0.01)(like)
    assert isinstance(p, mg.distributions.ScaleMixtureNormal) and p.pi.dtype == torch.float64


def test_converted_models_copy_and_pickle():
    peer("bayesian_torch", "bayesian-torch")
    from bayesian_torch.models.dnn_to_bnn import dnn_to_bnn

    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    dnn_to_bnn(net, {"prior_mu": 0.0, "prior_sigma": 1.0, "posterior_mu_init": 0.0, "posterior_rho_init": -3.0,
                     "type": "Reparameterization", "moped_enable": False})
    net[0].prior_weight_mu.normal_()  # per-element prior means: buffers shared with the converted layer
    bnn = interop.bayesian_torch.to_mcgraph(net, kl_samples=1)
    buffer = io.BytesIO()
    torch.save(bnn, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(bnn)
    for other in (loaded, copied):
        torch.testing.assert_close(mg.nn.kl(other, 64, seed=0), mg.nn.kl(bnn, 64, seed=0))
        assert other[0].prior_spec.owner is other[0]
    same = interop.bayesian_torch.to_mcgraph(net, inplace=True, kl_samples=1)
    assert same is net and isinstance(net[0], mg.nn.BayesLinear)
