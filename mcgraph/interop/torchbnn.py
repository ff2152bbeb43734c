"""torchbnn (``pip install --no-deps torchbnn``): KL loss, sites and conversion.

Recognised layers: ``BayesLinear``, ``BayesConv2d`` and ``BayesBatchNorm2d`` (with
``affine=True``), Parameters ``weight_mu``/``weight_log_sigma`` and ``bias_mu``/``bias_log_sigma``,
σ = exp(log σ) (mcgraph's ``scale_transform="exp"``), prior N(``prior_mu``, ``prior_sigma``²) with
scalar parameters.

:class:`KLLoss` replaces ``torchbnn.BKLLoss``: the closed-form Normal KL (exact) under
``method="auto"``, ``reduction="mean"`` (torchbnn's default: divided by the number of Bayesian
parameters) or ``"sum"``, computed in the parameters' dtype (torchbnn accumulates in float32).
``last_layer_only`` is not offered. :func:`to_mcgraph` converts ``BayesLinear`` and ``BayesConv2d``
(zero padding); ``BayesBatchNorm2d`` has no mcgraph counterpart and is refused, and so are
layers fixed by ``freeze()`` (they reuse one stored noise draw).

Example:
    >>> import torch, torchbnn, mcgraph.interop.torchbnn as itb
    >>> net = torch.nn.Sequential(torchbnn.BayesLinear(0.0, 0.1, 4, 8), torch.nn.ReLU(),
    ...                           torchbnn.BayesLinear(0.0, 0.1, 8, 3))
    >>> torch.allclose(itb.KLLoss(num_samples=1)(net), torchbnn.BKLLoss()(net))
    True
    >>> itb.to_mcgraph(net, kl_samples=1)[0].scale_transform.name
    'exp'
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import nn

from ..engine.options import Sampling
from ..nn.scales import scale_transform
from . import convert, divergence
from .foreign_priors import NormalPrior
from .sites import LibraryAdapter, VariationalSite, class_names, parameter, qualified, register_adapter, site_name
from .sites import sites as _sites

__all__ = ["TorchbnnAdapter", "KLLoss", "sites", "kl", "to_mcgraph"]

NAME = "torchbnn"
_CLASSES = {"BayesLinear", "_BayesConvNd", "_BayesBatchNorm"}


def _mean_over_parameters(found: Sequence[VariationalSite], values: Sequence[torch.Tensor]) -> torch.Tensor:
    """torchbnn's ``reduction="mean"``: the summed KL divided by the number of Bayesian parameters."""
    return torch.stack(list(values)).sum() / sum(s.numel for s in found)


def _prior(module: nn.Module, like: torch.Tensor):
    return NormalPrior(float(module.prior_mu), float(module.prior_sigma))(like)


@register_adapter
class TorchbnnAdapter(LibraryAdapter):
    """Reads torchbnn's layers, σ = exp(log σ) (see the module docstring)."""

    name = NAME
    pip = "torchbnn"
    packages = ("torchbnn",)
    reductions = {"mean": _mean_over_parameters}

    def owns(self, module: nn.Module) -> bool:
        return bool(_CLASSES & class_names(module)) and hasattr(module, "weight_log_sigma") \
            and hasattr(module, "prior_mu") and hasattr(module, "prior_sigma")

    def belongs(self, module: nn.Module) -> bool:
        # A BayesBatchNorm2d without affine parameters is a plain BatchNorm: it converts by staying as it is.
        return self.owns(module)

    def layer_sites(self, module: nn.Module, name: str, **options) -> list[VariationalSite]:
        if options:
            raise TypeError(f"torchbnn sites take no options, got {sorted(options)}")
        exp = scale_transform("exp")
        out = []
        for role in ("weight", "bias"):
            mu, log_sigma = parameter(module, f"{role}_mu"), parameter(module, f"{role}_log_sigma")
            if mu is not None and log_sigma is not None:
                out.append(VariationalSite(site_name(name, role), NAME, module, role, mu, log_sigma, exp,
                                           functools.partial(_prior, module, mu)))
        return out

    def to_layer(self, module: nn.Module, name: str, *, kl_samples: int, **options) -> nn.Module:
        if options:
            raise TypeError(f"torchbnn conversion takes no options, got {sorted(options)}")
        cls = type(module).__name__
        if "_BayesBatchNorm" in class_names(module):
            raise TypeError(f"{qualified(name, module)}: a Bayesian BatchNorm has no mcgraph counterpart; train the "
                            f"model as it is with mcgraph.interop.elbo_backward and mcgraph.interop.torchbnn.KLLoss")
        if getattr(module, "weight_eps", None) is not None:
            raise TypeError(f"{qualified(name, module)} is frozen by freeze() (it reuses one stored noise draw); call "
                            f"unfreeze() before converting, and mcgraph.nn.freeze on the result for mean weights")
        if cls != "BayesLinear" and getattr(module, "padding_mode", "zeros") != "zeros":
            raise TypeError(f"{qualified(name, module)}: padding_mode={module.padding_mode!r} pads as torch 1.2 did "
                            f"(torchbnn's own rule), which mcgraph's layers do not reproduce; only zero padding "
                            f"converts")
        found = {s.role: s for s in self.layer_sites(module, name)}
        prior = NormalPrior(float(module.prior_mu), float(module.prior_sigma))
        return convert.mcgraph_layer("linear" if cls == "BayesLinear" else "conv", module, found["weight"],
                                     found.get("bias"), prior=prior, kl_samples=kl_samples)


class KLLoss(nn.Module):
    """Drop-in for ``torchbnn.BKLLoss``: ``KLLoss(num_samples)(model)`` is the model's KL(q ‖ p).

    Args:
        num_samples: M of engine-estimated sites (Normal priors use the closed form under
            ``method="auto"``).
        reduction: ``"mean"`` (torchbnn's: divided by the number of Bayesian parameters) or ``"sum"``.
        seed, method: as in :func:`mcgraph.interop.kl`.
    """

    def __init__(self, num_samples: int = 1, reduction: str = "mean", *, seed: int | None = None,
                 method: str = "auto") -> None:
        super().__init__()
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.num_samples, self.reduction, self.seed, self.method = num_samples, reduction, seed, method

    def forward(self, model: nn.Module) -> torch.Tensor:
        return kl(model, self.num_samples, seed=self.seed, method=self.method, reduction=self.reduction)

    def extra_repr(self) -> str:
        return f"num_samples={self.num_samples}, reduction={self.reduction!r}, method={self.method!r}"


def sites(model: nn.Module) -> list[VariationalSite]:
    """The sites of a torchbnn model, see :func:`mcgraph.interop.sites`."""
    return _sites(model, library=NAME)


def kl(model: nn.Module, num_samples: int | Sampling, *, seed: int | None = None, method: str = "auto",
       reduction: str = "sum", process_group=None) -> torch.Tensor:
    """KL(q ‖ p) of a torchbnn model; ``reduction="mean"`` equals ``bayesian_kl_loss(model)``."""
    return divergence.kl(model, num_samples, seed=seed, method=method, reduction=reduction, library=NAME,
                         process_group=process_group)


def to_mcgraph(model: nn.Module, *, kl_samples: int | None = None, inplace: bool = False) -> nn.Module:
    """Swap torchbnn's Linear/Conv2d layers for mcgraph layers holding the same Parameters (σ = exp(ρ)).

    **KL scale.** ``torchbnn.BKLLoss()`` (``reduction="mean"``) divides the summed KL by the number
    of Bayesian parameters; ``mg.nn.kl`` is the sum, and ``mg.nn.elbo`` divides it by
    ``dataset_size``. A one-time :class:`~mcgraph.interop.convert.KLScaleWarning` says so;
    :class:`KLLoss` reproduces ``BKLLoss``.
    """
    convert.warn_kl_scale("torchbnn", "torchbnn's BKLLoss divides the summed KL by the number of parameters;")
    return convert.to_mcgraph(model, NAME, kl_samples=kl_samples, inplace=inplace)
