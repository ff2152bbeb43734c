"""torch-uncertainty (``torch_uncertainty.layers.bayesian``, attribute names of version 0.13.0): KL, sites, conversion.

Recognised layers: ``BayesLinear`` and ``BayesConv{1,2,3}d`` with Parameters ``weight_mu``,
``weight_sigma``, ``bias_mu``, ``bias_sigma``, where the ``*_sigma`` Parameters hold **ρ** and
σ = log(1 + e^ρ), and the prior ``weight_prior_dist`` / ``bias_prior_dist``, a
``CenteredGaussianMixture`` with buffers ``pi`` = [π, 1 − π], ``mus`` = [0, 0] and ``sigmas`` =
[σ1, σ2] (a Normal when π = 1). These names hold from 0.8 to 0.13; only the attributes that
cache a forward's log-densities changed (``lvposterior`` / ``lprior`` up to 0.11,
``log_variational_posterior`` / ``log_prior`` in 0.12–0.13), and the adapter does not use them.
``LPBNNLinear`` / ``LPBNNConv2d`` (a low-rank latent model with its own KL) are refused.

torch-uncertainty's ``KLDiv`` is a one-sample estimate cached by the last forward, averaged
over the Bayesian layers, and offset by −n/2 for n weights (its log-posterior subtracts ½ per
element, its prior does not): a constant that leaves the gradients alone. :func:`kl` with
``reduction="layer_mean"`` is the M-sample estimate of the same average without the offset;
``"sum"`` is the KL. The adapter never imports torch-uncertainty (its package ``__init__``
imports lightning and torchvision); it reads the layers' attributes.

Example (``torch_uncertainty`` itself needs lightning and torchvision to import)::

    import torch, mcgraph.interop.torch_uncertainty as itu
    from torch_uncertainty.layers.bayesian import BayesLinear
    net = torch.nn.Sequential(BayesLinear(4, 8, prior_pi=0.5), torch.nn.ReLU(), BayesLinear(8, 3))
    kl = itu.kl(net, 1000, reduction="layer_mean")     # what KLDiv(net)() estimates from one sample
    bnn = itu.to_mcgraph(net, kl_samples=1000)
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import nn
from torch.distributions import Categorical, Distribution, MixtureSameFamily, Normal

from ..engine.options import Sampling
from ..nn.scales import scale_transform
from . import convert, divergence
from .foreign_priors import MixturePrior, mixture
from .sites import LibraryAdapter, VariationalSite, class_names, parameter, qualified, register_adapter, site_name
from .sites import sites as _sites

__all__ = ["TorchUncertaintyAdapter", "sites", "kl", "to_mcgraph"]

NAME = "torch-uncertainty"
_LAYERS = {"BayesLinear": "linear", "BayesConv1d": "conv", "BayesConv2d": "conv", "BayesConv3d": "conv"}


def _layer_mean(found: Sequence[VariationalSite], values: Sequence[torch.Tensor]) -> torch.Tensor:
    """torch-uncertainty's ``KLDiv`` scaling: the summed KL divided by the number of Bayesian layers."""
    layers = {id(s.module) for s in found}
    return torch.stack(list(values)).sum() / len(layers)


def _centred(prior: nn.Module) -> bool:
    return not bool(torch.any(prior.mus != 0))


def _prior(prior: nn.Module, like: torch.Tensor) -> Distribution:
    """A ``CenteredGaussianMixture`` (read now) as a torch distribution in ``like``'s dtype."""
    if _centred(prior):
        return mixture(prior.pi[0].item(), prior.sigmas[0], prior.sigmas[1], like)
    return MixtureSameFamily(Categorical(probs=prior.pi.to(like)), Normal(prior.mus.to(like), prior.sigmas.to(like)))


@register_adapter
class TorchUncertaintyAdapter(LibraryAdapter):
    """Reads torch-uncertainty's Bayesian layers, ρ stored in ``*_sigma`` (see the module docstring)."""

    name = NAME
    pip = "torch-uncertainty"
    packages = ("torch_uncertainty",)
    reductions = {"layer_mean": _layer_mean}

    def owns(self, module: nn.Module) -> bool:
        names = class_names(module)
        if any(n.startswith("LPBNN") for n in names):
            return True
        return (bool(names & set(_LAYERS)) and parameter(module, "weight_mu") is not None
                and parameter(module, "weight_sigma") is not None
                and hasattr(getattr(module, "weight_prior_dist", None), "sigmas"))

    def belongs(self, module: nn.Module) -> bool:
        # Its deterministic layers (packed, batch-ensemble, norms, …) stay as they are in a conversion.
        return self.owns(module)

    def layer_sites(self, module: nn.Module, name: str, **options) -> list[VariationalSite]:
        if options:
            raise TypeError(f"torch-uncertainty sites take no options, got {sorted(options)}")
        if any(n.startswith("LPBNN") for n in class_names(module)):
            raise TypeError(f"{qualified(name, module)}: LPBNN layers (a low-rank latent model with a VAE-style KL) "
                            f"are not read by mcgraph.interop")
        softplus = scale_transform("softplus")
        out = []
        for role in ("weight", "bias"):
            mu, rho = parameter(module, f"{role}_mu"), parameter(module, f"{role}_sigma")
            if mu is not None and rho is not None:
                out.append(VariationalSite(site_name(name, role), NAME, module, role, mu, rho, softplus,
                                           functools.partial(_prior, getattr(module, f"{role}_prior_dist"), mu)))
        return out

    def to_layer(self, module: nn.Module, name: str, *, kl_samples: int, **options) -> nn.Module:
        if options:
            raise TypeError(f"torch-uncertainty conversion takes no options, got {sorted(options)}")
        found = {s.role: s for s in self.layer_sites(module, name)}
        kind = _LAYERS.get(type(module).__name__)
        if kind is None:
            raise TypeError(f"{qualified(name, module)}: only torch-uncertainty's BayesLinear and BayesConv{{1,2,3}}d "
                            f"convert to mcgraph layers")
        pd = module.weight_prior_dist
        if not _centred(pd):
            raise TypeError(f"{qualified(name, module)}: its prior mixture has non-zero means, which mcgraph's "
                            f"converted layers do not take; use mcgraph.interop.torch_uncertainty.kl")
        prior = MixturePrior(pd.pi[0].item(), pd.sigmas[0].item(), pd.sigmas[1].item())
        return convert.mcgraph_layer(kind, module, found["weight"], found.get("bias"), prior=prior,
                                     kl_samples=kl_samples, frozen=bool(getattr(module, "frozen", False)))


def sites(model: nn.Module) -> list[VariationalSite]:
    """The sites of a torch-uncertainty model, see :func:`mcgraph.interop.sites`."""
    return _sites(model, library=NAME)


def kl(model: nn.Module, num_samples: int | Sampling, *, seed: int | None = None, method: str = "auto",
       reduction: str = "sum", process_group=None) -> torch.Tensor:
    """M-sample KL(q ‖ p) of a torch-uncertainty model; ``reduction="layer_mean"`` is what ``KLDiv`` estimates
    (without its −n/2 offset)."""
    return divergence.kl(model, num_samples, seed=seed, method=method, reduction=reduction, library=NAME,
                         process_group=process_group)


def to_mcgraph(model: nn.Module, *, kl_samples: int | None = None, inplace: bool = False) -> nn.Module:
    """Swap torch-uncertainty's BayesLinear/BayesConv layers for mcgraph layers holding the same Parameters.

    **KL scale.** torch-uncertainty's ``KLDiv`` averages over the Bayesian layers (and its ELBO loss
    weighs it by ``kl_weight``); ``mg.nn.kl`` sums over every weight and ``mg.nn.elbo`` divides by
    ``dataset_size``. A one-time :class:`~mcgraph.interop.convert.KLScaleWarning` says so;
    ``kl(model, M, reduction="layer_mean")`` reproduces the average.
    """
    convert.warn_kl_scale("torch_uncertainty", "torch-uncertainty's KLDiv averages the KL over the layers;")
    return convert.to_mcgraph(model, NAME, kl_samples=kl_samples, inplace=inplace)
