"""Rayleigh distribution (a scaling family)."""

from __future__ import annotations

import math

import torch
from torch.distributions import Distribution, constraints
from torch.distributions.utils import broadcast_all

__all__ = ["Rayleigh"]

_EULER_GAMMA = 0.57721566490153286060651209008240243


class Rayleigh(Distribution):
    r"""Rayleigh distribution with scale :math:`\sigma`.

    A scaling family :math:`w = \sigma\,\xi`, drawn by inversion:

    .. math::

        w = \sigma\sqrt{-2\log u}, \qquad u \sim \mathcal{U}(0, 1),

    .. math::

        \log p(w) = \log w - 2\log\sigma - \frac{w^2}{2\sigma^2}, \quad w \ge 0.

    Mean :math:`\sigma\sqrt{\pi/2}`, variance :math:`(4 - \pi)\sigma^2/2`,
    entropy :math:`1 + \log(\sigma/\sqrt2) + \gamma/2`, cdf
    :math:`1 - e^{-w^2/(2\sigma^2)}`.

    Args:
        scale (float or Tensor): positive scale :math:`\sigma`.
        validate_args (bool, optional): whether to validate arguments and
            samples (torch's global default when ``None``).

    Example:
        >>> d = Rayleigh(torch.tensor([1.0, 2.0]))
        >>> d.cdf(torch.tensor([1.0, 2.0]))
        tensor([0.3935, 0.3935])
    """

    arg_constraints = {"scale": constraints.positive}
    support = constraints.nonnegative
    has_rsample = True

    def __init__(
        self, scale: torch.Tensor | float, validate_args: bool | None = None
    ) -> None:
        (self.scale,) = broadcast_all(scale)
        super().__init__(self.scale.shape, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(Rayleigh, _instance)
        batch_shape = torch.Size(batch_shape)
        new.scale = self.scale.expand(batch_shape)
        super(Rayleigh, new).__init__(batch_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @property
    def mean(self) -> torch.Tensor:
        return self.scale * math.sqrt(math.pi / 2.0)

    @property
    def mode(self) -> torch.Tensor:
        return self.scale

    @property
    def variance(self) -> torch.Tensor:
        return (2.0 - math.pi / 2.0) * self.scale.pow(2)

    def rsample(self, sample_shape=torch.Size()) -> torch.Tensor:
        """Draws one ``torch.rand`` of the sample shape, clamped below at ``tiny``."""
        shape = self._extended_shape(sample_shape)
        u = torch.rand(shape, dtype=self.scale.dtype, device=self.scale.device)
        u = u.clamp(min=torch.finfo(u.dtype).tiny)
        return self.scale * torch.sqrt(-2.0 * torch.log(u))

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args:
            self._validate_sample(value)
        return (
            torch.log(value)
            - 2.0 * torch.log(self.scale)
            - value**2 / (2.0 * self.scale**2)
        )

    def cdf(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args:
            self._validate_sample(value)
        return -torch.expm1(-(value**2) / (2.0 * self.scale**2))

    def icdf(self, value: torch.Tensor) -> torch.Tensor:
        return self.scale * torch.sqrt(-2.0 * torch.log1p(-value))

    def entropy(self) -> torch.Tensor:
        return 1.0 + torch.log(self.scale) - 0.5 * math.log(2.0) + 0.5 * _EULER_GAMMA
