"""blitz (``pip install --no-deps blitz-bayesian-pytorch``): KL, sites and conversion.

Recognised layers (subclasses of ``BayesianModule``): ``BayesianLinear``,
``BayesianConv{1,2,3}d``, ``BayesianEmbedding``, ``BayesianLSTM``, ``BayesianGRU``. Every tensor
has a sampler ``<role>_sampler`` whose Parameters ``mu`` and ``rho`` are the ones trained
(blitz wraps the layer's ``<role>_mu`` / ``<role>_rho`` in new Parameter objects sharing their
storage; gradients land on the sampler's, the layer's aliases get none), so the sites are the
sampler's Parameters; σ = log(1 + e^ρ). The prior ``<role>_prior_dist`` is the scale mixture
π N(0, σ1²) + (1 − π) N(0, σ2²) (a Normal when π = 1), or the user's ``prior_dist``. A bias
counts only when the layer uses one (``bias`` / ``use_bias``).

blitz's own KL is a one-sample estimate cached by the last forward
(``log_variational_posterior − log_prior``, each with a −½ per element that cancels), with the
prior density floored: log(p(w) + 10⁻⁶). :func:`kl` is the M-sample estimate of the same
quantity, without a forward: ``prior_floor=None`` (default) uses the prior as written,
``prior_floor=1e-6`` reproduces blitz's floored density. Its forward refills a noise buffer in
place (``eps_w.data.normal_()``), so ``sample_elbo`` with ``sample_nbr > 1`` gives wrong
σ-gradients; :func:`mcgraph.interop.elbo_backward` and :func:`to_mcgraph` + ``mg.nn.elbo`` give
correct ones. Frozen layers (``freeze=True``) convert to the posterior-mean forward.

Example:
    >>> import torch, mcgraph as mg, mcgraph.interop.blitz as ibz
    >>> from blitz.modules import BayesianLinear
    >>> net = torch.nn.Sequential(BayesianLinear(4, 8, prior_pi=0.5), torch.nn.ReLU(), BayesianLinear(8, 3))
    >>> ibz.kl(net, num_samples=1000, seed=0, prior_floor=1e-6).shape
    torch.Size([])
    >>> bnn = ibz.to_mcgraph(net, kl_samples=1000)
    >>> bnn[0].weight_mu is net[0].weight_sampler.mu
    True
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributions import Distribution

from ..nn.scales import scale_transform
from . import convert, divergence
from .foreign_priors import FlooredDensity, MixturePrior, mixture
from .sites import LibraryAdapter, VariationalSite, class_names, parameter, qualified, register_adapter, site_name
from .sites import sites as _sites

__all__ = ["BlitzAdapter", "sites", "kl", "to_mcgraph"]

NAME = "blitz"
_LAYERS = {"BayesianLinear": "linear", "BayesianConv1d": "conv", "BayesianConv2d": "conv", "BayesianConv3d": "conv"}


def _is_sampler(module) -> bool:
    return (isinstance(module, nn.Module) and parameter(module, "mu") is not None
            and parameter(module, "rho") is not None)


def _uses_bias(module: nn.Module) -> bool:
    flag = getattr(module, "use_bias", None)
    return bool(getattr(module, "bias", False) if flag is None else flag)


def _check_floor(prior_floor):
    if prior_floor is not None and (isinstance(prior_floor, bool) or not isinstance(prior_floor, (int, float))
                                    or not prior_floor > 0):
        raise ValueError(f"prior_floor must be None or a positive number, got {prior_floor!r}")
    return prior_floor


def _prior(prior_dist: nn.Module, like: torch.Tensor, floor: float | None) -> Distribution:
    """A blitz ``PriorWeightDistribution`` as a torch distribution (read now), floored by ``floor``."""
    if getattr(prior_dist, "dist2", None) is None:  # a user-given prior_dist (π = 1)
        base = prior_dist.dist1
    else:
        base = mixture(prior_dist.pi, prior_dist.sigma1, prior_dist.sigma2, like)
    return base if floor is None else FlooredDensity(base, floor)


@register_adapter
class BlitzAdapter(LibraryAdapter):
    """Reads blitz's Bayesian layers through their samplers (see the module docstring)."""

    name = NAME
    pip = "blitz-bayesian-pytorch"
    packages = ("blitz",)

    def owns(self, module: nn.Module) -> bool:
        return "BayesianModule" in class_names(module) and any(
            k.endswith("_sampler") and _is_sampler(m) for k, m in module.named_children())

    def layer_sites(self, module: nn.Module, name: str, *, prior_floor: float | None = None,
                    **options) -> list[VariationalSite]:
        if options:
            raise TypeError(f"blitz sites take only prior_floor, got {sorted(options)}")
        _check_floor(prior_floor)
        softplus = scale_transform("softplus")
        out = []
        for key, sampler in module.named_children():
            if not (key.endswith("_sampler") and _is_sampler(sampler)):
                continue
            role = key[: -len("_sampler")]
            if role == "bias" and not _uses_bias(module):
                continue
            prior_dist = getattr(module, f"{role}_prior_dist")
            out.append(VariationalSite(site_name(name, role), NAME, module, role, sampler.mu, sampler.rho, softplus,
                                       functools.partial(_prior, prior_dist, sampler.mu, prior_floor)))
        return out

    def to_layer(self, module: nn.Module, name: str, *, kl_samples: int, prior_floor: float | None = None,
                 **options) -> nn.Module:
        if options:
            raise TypeError(f"blitz conversion takes only prior_floor, got {sorted(options)}")
        kind = _LAYERS.get(type(module).__name__)
        if kind is None:
            raise TypeError(f"{qualified(name, module)}: only blitz's BayesianLinear and BayesianConv{{1,2,3}}d "
                            f"convert to mcgraph layers (recurrent and embedding layers do not); train the model as it "
                            f"is with mcgraph.interop.elbo_backward and mcgraph.interop.blitz.kl")
        found = {s.role: s for s in self.layer_sites(module, name, prior_floor=prior_floor)}
        pd = module.weight_prior_dist
        if getattr(pd, "dist2", None) is None:
            prior = pd.dist1 if prior_floor is None else FlooredDensity(pd.dist1, prior_floor)
        else:
            prior = MixturePrior(float(pd.pi), float(pd.sigma1), float(pd.sigma2), prior_floor)
        return convert.mcgraph_layer(kind, module, found["weight"], found.get("bias"), prior=prior,
                                     kl_samples=kl_samples, frozen=bool(getattr(module, "freeze", False)))


def sites(model: nn.Module, *, prior_floor: float | None = None) -> list[VariationalSite]:
    """The sites of a blitz model (the samplers' Parameters), see :func:`mcgraph.interop.sites`."""
    return _sites(model, library=NAME, prior_floor=prior_floor)


def kl(model: nn.Module, num_samples: int, *, seed: int | None = None, method: str = "auto",
       prior_floor: float | None = None, process_group=None) -> torch.Tensor:
    """M-sample KL(q ‖ p) of a blitz model: what ``model.nn_kl_divergence()`` estimates from one sample.

    Args:
        model: the blitz model (no forward needed; nothing is modified).
        num_samples: M (scale-mixture priors have no closed form).
        seed, method: as in :func:`mcgraph.interop.kl`.
        prior_floor: ``1e-6`` evaluates the prior as blitz does, log(p(w) + 10⁻⁶); ``None``
            the prior as written.
    """
    return divergence.kl(model, num_samples, seed=seed, method=method, library=NAME, prior_floor=prior_floor,
                         process_group=process_group)


def to_mcgraph(model: nn.Module, *, kl_samples: int | None = None, inplace: bool = False,
               prior_floor: float | None = None) -> nn.Module:
    """Swap blitz's Linear/Conv layers for mcgraph layers holding the samplers' Parameters.

    See :mod:`mcgraph.interop.convert`; ``prior_floor`` as in :func:`kl`.

    **KL scale.** blitz's ``sample_elbo`` adds ``complexity_cost_weight ×`` the one-sample KL summed over
    every weight; ``mg.nn.elbo`` subtracts ``kl / dataset_size`` with the KL summed the same way, so
    the two agree when ``complexity_cost_weight = 1 / dataset_size`` (scale it with ``kl_weight`` otherwise).
    """
    return convert.to_mcgraph(model, NAME, kl_samples=kl_samples, inplace=inplace,
                              prior_floor=_check_floor(prior_floor))
