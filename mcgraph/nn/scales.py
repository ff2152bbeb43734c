"""How a Bayesian layer derives its posterior scale σ from the raw parameter ρ it trains.

A layer stores ``weight_rho`` (and ``bias_rho``) and builds ``q(W) = posterior(μ, σ(ρ))``.
The map ``ρ ↦ σ`` is a :class:`ScaleTransform`, chosen by name or given directly:

=================  ==========================================  ==========================================
name               σ(ρ)                                        ρ is … (used by)
=================  ==========================================  ==========================================
``"softplus"``     ``log(1 + e^ρ)``                            the default (Blundell et al.; bayesian-torch,
                                                               blitz, torch-uncertainty)
``"exp"``          ``e^ρ``                                     log σ (torchbnn)
``"exp_half"``     ``e^{ρ/2}``                                 log σ² (sparse variational dropout)
=================  ==========================================  ==========================================

:func:`softplus_beta` gives ``σ = log(1 + e^{βρ}) / β`` (Shridhar et al.'s β).
A new transform is one registration::

    mg.nn.register_scale_transform(mg.nn.ScaleTransform("sigmoid", torch.sigmoid, torch.logit))

Example:
    >>> import torch, mcgraph as mg
    >>> t = mg.nn.scale_transform("exp_half")
    >>> t(torch.tensor([0.0, 2.0]))
    tensor([1.0000, 2.7183])
    >>> t.inverse(t(torch.tensor([-3.0])))
    tensor([-3.])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ..registry import Registry

__all__ = ["ScaleTransform", "SCALE_TRANSFORMS", "register_scale_transform", "scale_transform", "softplus_beta"]


@dataclass(frozen=True)
class ScaleTransform:
    """A map ``σ = forward(ρ)`` from the raw scale parameter to the posterior scale, with its inverse.

    Attributes:
        name: how the layer's ``repr`` and error messages call it.
        forward: ``ρ ↦ σ`` (elementwise, differentiable, positive).
        inverse: ``σ ↦ ρ`` (used to initialise ρ from a wanted σ).
    """

    name: str
    forward: Callable[[torch.Tensor], torch.Tensor]
    inverse: Callable[[torch.Tensor], torch.Tensor]
    #: ``(factory, args)`` that rebuild this transform, so modules holding it pickle (``torch.save``).
    rebuild: tuple | None = field(default=None, repr=False, compare=False)

    def __reduce__(self):
        if self.rebuild is not None:
            return self.rebuild
        if SCALE_TRANSFORMS.get(self.name) is self:
            return scale_transform, (self.name,)
        return super().__reduce__()

    def __call__(self, rho: torch.Tensor) -> torch.Tensor:
        return self.forward(rho)

    def __str__(self) -> str:
        return self.name


SCALE_TRANSFORMS: Registry = Registry("scale transform")
"""Named scale transforms: ``name -> ScaleTransform``."""


def register_scale_transform(transform: ScaleTransform) -> ScaleTransform:
    """Register ``transform`` under ``transform.name`` (returns it)."""
    if not isinstance(transform, ScaleTransform):
        raise TypeError(f"transform must be a ScaleTransform, got {type(transform).__name__}")
    return SCALE_TRANSFORMS.register(transform.name, transform)


def _inverse_softplus(sigma: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    # ρ = log(e^{βσ} − 1)/β, written stably for large βσ: βσ + log(1 − e^{−βσ}).
    z = beta * sigma
    return (z + torch.log(-torch.expm1(-z))) / beta


def softplus_beta(beta: float) -> ScaleTransform:
    """``σ = log(1 + e^{βρ}) / β``: a sharper (β > 1) or softer (β < 1) softplus."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0 or beta != beta:
        raise ValueError(f"beta must be a positive real number, got {beta!r}")
    beta = float(beta)
    if beta == 1.0:
        return SCALE_TRANSFORMS["softplus"]
    return ScaleTransform(f"softplus(beta={beta:g})", lambda rho: F.softplus(rho, beta=beta),
                          lambda sigma: _inverse_softplus(sigma, beta), rebuild=(softplus_beta, (beta,)))


register_scale_transform(ScaleTransform("softplus", F.softplus, _inverse_softplus))
register_scale_transform(ScaleTransform("exp", torch.exp, torch.log))
register_scale_transform(ScaleTransform("exp_half", lambda rho: torch.exp(0.5 * rho), lambda sigma: 2 * torch.log(sigma)))


def scale_transform(spec: str | ScaleTransform) -> ScaleTransform:
    """The :class:`ScaleTransform` named ``spec`` (or ``spec`` itself).

    Raises:
        ValueError: an unknown name (the message lists the registered ones).
        TypeError: neither a name nor a :class:`ScaleTransform`.
    """
    if isinstance(spec, ScaleTransform):
        return spec
    if isinstance(spec, str):
        try:
            return SCALE_TRANSFORMS[spec]
        except KeyError:
            raise ValueError(f"scale_transform: unknown name {spec!r}; registered: {sorted(SCALE_TRANSFORMS)}"
                             ) from None
    raise TypeError(f"scale_transform must be a name or a ScaleTransform, got {type(spec).__name__}")
