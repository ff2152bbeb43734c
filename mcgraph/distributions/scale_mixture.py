"""Two-component zero-centred Gaussian scale mixture (Blundell et al., 2015)."""

from __future__ import annotations

import math

import torch
from torch.distributions import Distribution, constraints
from torch.distributions.utils import broadcast_all

__all__ = ["ScaleMixtureNormal", "open_unit_interval"]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


class _OpenInterval(constraints.Constraint):
    """Constrains to the open interval ``(lower_bound, upper_bound)``."""

    def __init__(self, lower_bound: float, upper_bound: float) -> None:
        self.lower_bound = lower_bound
        self.upper_bound = upper_bound
        super().__init__()

    def check(self, value):
        return (self.lower_bound < value) & (value < self.upper_bound)

    def __repr__(self):
        return (
            f"{self.__class__.__name__[1:]}(lower_bound={self.lower_bound}, "
            f"upper_bound={self.upper_bound})"
        )


#: The open interval (0, 1) (torch only ships the closed and half-open ones).
open_unit_interval = _OpenInterval(0.0, 1.0)


def _normal_log_prob(value, loc, scale):
    z = (value - loc) / scale
    return -0.5 * z * z - torch.log(scale) - _HALF_LOG_2PI


class ScaleMixtureNormal(Distribution):
    r"""Scale mixture of two normals sharing one location.

    The "scale mixture" prior of Blundell et al. (ICML 2015, Eq. 7), applied
    elementwise (``event_shape == ()``):

    .. math::

        p(w) = \pi\,\mathcal{N}(w; \mu, \sigma_1^2)
             + (1 - \pi)\,\mathcal{N}(w; \mu, \sigma_2^2),

    evaluated stably as
    :math:`\operatorname{logaddexp}(\log\pi + \log\mathcal{N}_1,\
    \log(1-\pi) + \log\mathcal{N}_2)`. The mean is :math:`\mu`, the variance
    :math:`\pi\sigma_1^2 + (1-\pi)\sigma_2^2`. The choice of component is
    discrete, so the family has ``sample`` but no ``rsample``.

    Args:
        pi (float or Tensor): weight of the first component, in :math:`(0, 1)`.
        scale1 (float or Tensor): positive scale :math:`\sigma_1`.
        scale2 (float or Tensor): positive scale :math:`\sigma_2`.
        loc (float or Tensor): shared location :math:`\mu` (default 0).
        validate_args (bool, optional): whether to validate arguments and
            samples (torch's global default when ``None``).

    Example:
        >>> p = ScaleMixtureNormal(0.5, 1.0, math.exp(-6.0))
        >>> p.log_prob(torch.zeros(3)).shape
        torch.Size([3])
    """

    arg_constraints = {
        "pi": open_unit_interval,
        "scale1": constraints.positive,
        "scale2": constraints.positive,
        "loc": constraints.real,
    }
    support = constraints.real
    has_rsample = False

    def __init__(
        self,
        pi: torch.Tensor | float,
        scale1: torch.Tensor | float,
        scale2: torch.Tensor | float,
        loc: torch.Tensor | float = 0.0,
        validate_args: bool | None = None,
    ) -> None:
        self.pi, self.scale1, self.scale2, self.loc = broadcast_all(
            pi, scale1, scale2, loc
        )
        super().__init__(self.loc.shape, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(ScaleMixtureNormal, _instance)
        batch_shape = torch.Size(batch_shape)
        for name in ("pi", "scale1", "scale2", "loc"):
            setattr(new, name, getattr(self, name).expand(batch_shape))
        super(ScaleMixtureNormal, new).__init__(batch_shape, validate_args=False)
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
        return self.pi * self.scale1.pow(2) + (1.0 - self.pi) * self.scale2.pow(2)

    def sample(self, sample_shape=torch.Size()) -> torch.Tensor:
        """Draws ``eps ~ N(0, 1)`` then ``u ~ U(0, 1)``; component 1 where ``u < pi``."""
        shape = self._extended_shape(sample_shape)
        with torch.no_grad():
            eps = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
            u = torch.rand(shape, dtype=self.loc.dtype, device=self.loc.device)
            scale = torch.where(u < self.pi, self.scale1, self.scale2)
            return self.loc + scale * eps

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args:
            self._validate_sample(value)
        lp1 = _normal_log_prob(value, self.loc, self.scale1)
        lp2 = _normal_log_prob(value, self.loc, self.scale2)
        return torch.logaddexp(
            torch.log(self.pi) + lp1, torch.log1p(-self.pi) + lp2
        )

    def cdf(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args:
            self._validate_sample(value)
        z1 = (value - self.loc) / (self.scale1 * math.sqrt(2.0))
        z2 = (value - self.loc) / (self.scale2 * math.sqrt(2.0))
        return 0.5 * (
            self.pi * (1.0 + torch.erf(z1)) + (1.0 - self.pi) * (1.0 + torch.erf(z2))
        )
