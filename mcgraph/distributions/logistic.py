"""Location-scale logistic distribution."""

from __future__ import annotations

import math

import torch
from torch.distributions import Distribution, constraints
from torch.distributions.utils import broadcast_all

__all__ = ["Logistic"]


class Logistic(Distribution):
    r"""Logistic distribution with location :math:`\mu` and scale :math:`s`.

    Reparameterized through the logit of a uniform:

    .. math::

        w = \mu + s\,(\log u - \log(1 - u)), \qquad u \sim \mathcal{U}(0, 1),

    with density, written in terms of :math:`z = (w - \mu)/s`,

    .. math::

        \log p(w) = -z - \log s - 2\log(1 + e^{-z})
                  = -|z| - \log s - 2\log(1 + e^{-|z|}).

    The second, symmetric form (used by ``log_prob``) never overflows. Mean
    :math:`\mu`, variance :math:`\pi^2 s^2 / 3`, entropy :math:`\log s + 2`,
    cdf :math:`\sigma(z)`.

    Args:
        loc (float or Tensor): location :math:`\mu`.
        scale (float or Tensor): positive scale :math:`s`.
        validate_args (bool, optional): whether to validate arguments and
            samples (torch's global default when ``None``).

    Example:
        >>> d = Logistic(torch.zeros(2), torch.ones(2))
        >>> d.log_prob(torch.zeros(2))
        tensor([-1.3863, -1.3863])
    """

    arg_constraints = {"loc": constraints.real, "scale": constraints.positive}
    support = constraints.real
    has_rsample = True

    def __init__(
        self,
        loc: torch.Tensor | float,
        scale: torch.Tensor | float,
        validate_args: bool | None = None,
    ) -> None:
        self.loc, self.scale = broadcast_all(loc, scale)
        super().__init__(self.loc.shape, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(Logistic, _instance)
        batch_shape = torch.Size(batch_shape)
        new.loc = self.loc.expand(batch_shape)
        new.scale = self.scale.expand(batch_shape)
        super(Logistic, new).__init__(batch_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @property
    def mean(self) -> torch.Tensor:
        return self.loc

    @property
    def mode(self) -> torch.Tensor:
        return self.loc

    @property
    def variance(self) -> torch.Tensor:
        return (math.pi**2 / 3.0) * self.scale.pow(2)

    def rsample(self, sample_shape=torch.Size()) -> torch.Tensor:
        """Draws one ``torch.rand`` of the sample shape, clamped to ``(tiny, 1 - eps)``."""
        shape = self._extended_shape(sample_shape)
        finfo = torch.finfo(self.loc.dtype)
        u = torch.rand(shape, dtype=self.loc.dtype, device=self.loc.device)
        u = u.clamp(min=finfo.tiny, max=1.0 - finfo.eps)
        return self.loc + self.scale * (torch.log(u) - torch.log1p(-u))

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args:
            self._validate_sample(value)
        abs_z = torch.abs((value - self.loc) / self.scale)
        return -abs_z - torch.log(self.scale) - 2.0 * torch.log1p(torch.exp(-abs_z))

    def cdf(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args:
            self._validate_sample(value)
        return torch.sigmoid((value - self.loc) / self.scale)

    def icdf(self, value: torch.Tensor) -> torch.Tensor:
        return self.loc + self.scale * (torch.log(value) - torch.log1p(-value))

    def entropy(self) -> torch.Tensor:
        return torch.log(self.scale) + 2.0
