"""Priors of foreign layers as torch distributions, and as factories for converted mcgraph layers.

* :class:`FlooredDensity` — ``log(p(w) + c)``: blitz adds ``c = 1e-6`` to its prior density
  (the prior stops pulling a weight once p(w) ≪ c); unnormalised, as blitz uses it.
* :class:`MixturePrior` — a picklable factory ``like -> Distribution`` for
  ``π N(0, σ1²) + (1 − π) N(0, σ2²)`` (a Normal when π ∈ {0, 1}), optionally floored: the
  prior of converted blitz and torch-uncertainty layers.
* :class:`NormalPrior` — ``like -> N(loc, scale²)`` with scalar parameters (torchbnn).
* :class:`BufferNormalPrior` — per-element Normal priors kept as buffers of a converted
  layer (bayesian-torch's ``prior_weight_mu`` / ``prior_weight_sigma``, MOPED included).

Example:
    >>> import torch
    >>> from mcgraph.interop.foreign_priors import MixturePrior
    >>> p = MixturePrior(pi=0.5, scale1=0.1, scale2=0.002, floor=1e-6)(torch.zeros(3))
    >>> round(p.log_prob(torch.tensor(10.0)).exp().item() / 1e-6, 6)   # far in the tail: the floor c
    1.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributions import Distribution, Normal, constraints

from ..distributions import ScaleMixtureNormal
from ..nn.priors import unchecked

__all__ = ["FlooredDensity", "MixturePrior", "NormalPrior", "BufferNormalPrior", "mixture"]


class FlooredDensity(Distribution):
    """The unnormalised density ``p(w) + c`` of a base distribution ``p``: ``log_prob = logaddexp(log p, log c)``.

    Args:
        base: the distribution ``p``.
        floor: ``c > 0``.

    It has no sampler (it is a prior, evaluated only).
    """

    arg_constraints: dict = {}
    support = constraints.real

    def __init__(self, base: Distribution, floor: float) -> None:
        if not isinstance(base, Distribution):
            raise TypeError(f"base must be a Distribution, got {type(base).__name__}")
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not floor > 0 or math.isinf(floor):
            raise ValueError(f"floor must be a positive finite number, got {floor!r}")
        self.base = base
        self.floor = float(floor)
        super().__init__(base.batch_shape, base.event_shape, validate_args=False)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        lp = self.base.log_prob(value)
        return torch.logaddexp(lp, torch.full((), math.log(self.floor), dtype=lp.dtype, device=lp.device))

    def expand(self, batch_shape, _instance=None):
        return FlooredDensity(self.base.expand(batch_shape), self.floor)


def mixture(pi, scale1, scale2, like: torch.Tensor) -> Distribution:
    """``π N(0, σ1²) + (1 − π) N(0, σ2²)`` in ``like``'s dtype and device (a Normal when π is 0 or 1)."""
    t = lambda v: torch.as_tensor(v, dtype=like.dtype, device=like.device)  # noqa: E731
    pi = float(pi)
    if pi == 1.0:
        return Normal(t(0.0), t(scale1))
    if pi == 0.0:
        return Normal(t(0.0), t(scale2))
    return ScaleMixtureNormal(t(pi), t(scale1), t(scale2))


@dataclass(frozen=True)
class MixturePrior:
    """``like -> π N(0, σ1²) + (1 − π) N(0, σ2²)`` (floored by ``floor`` when given)."""

    pi: float
    scale1: float
    scale2: float
    floor: float | None = None

    def __call__(self, like: torch.Tensor) -> Distribution:
        p = mixture(self.pi, self.scale1, self.scale2, like)
        return p if self.floor is None else FlooredDensity(p, self.floor)


@dataclass(frozen=True)
class NormalPrior:
    """``like -> N(loc, scale²)`` with scalar parameters, in ``like``'s dtype and device."""

    loc: float
    scale: float

    def __post_init__(self):
        if not (math.isfinite(self.loc) and math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"NormalPrior: loc must be finite and scale positive and finite, got "
                             f"loc={self.loc!r}, scale={self.scale!r}")

    def __call__(self, like: torch.Tensor) -> Distribution:
        return unchecked(Normal, *self._tensors(like))  # the parameters were checked once, above

    def _tensors(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.as_tensor(self.loc, dtype=like.dtype, device=like.device),
                torch.as_tensor(self.scale, dtype=like.dtype, device=like.device))

    def normal_parameters(self, like: torch.Tensor) -> tuple:
        """``(loc, scale)`` of the ``Normal`` this prior builds for ``like`` (``(None, None)`` for N(0, 1)):
        what the layers' closed-form KL reads instead of building the distribution."""
        if self.loc == 0.0 and math.copysign(1.0, self.loc) > 0 and self.scale == 1.0:  # +0: x - 0 is x
            return None, None
        return self._tensors(like)


class BufferNormalPrior:
    """Per-element Normal priors read from buffers of ``owner`` when called.

    ``owner`` holds ``prior_weight_mu`` / ``prior_weight_sigma`` (and ``prior_bias_mu`` /
    ``prior_bias_sigma`` for a Bayesian bias); the parameter passed in (``like``) picks the pair
    by shape, so ``model.to(device)`` and in-place edits of the buffers are followed.
    """

    def __init__(self, owner: nn.Module) -> None:
        self.owner = owner

    def __call__(self, like: torch.Tensor) -> Distribution:
        for role in ("weight", "bias"):
            loc = getattr(self.owner, f"prior_{role}_mu", None)
            if loc is not None and loc.shape == like.shape:
                scale = getattr(self.owner, f"prior_{role}_sigma")
                return Normal(loc.to(like), scale.to(like), validate_args=False)
        raise ValueError(f"prior: no prior buffers of shape {tuple(like.shape)} on {type(self.owner).__name__}")

    def __repr__(self) -> str:
        return "BufferNormalPrior(prior_*_mu, prior_*_sigma)"
