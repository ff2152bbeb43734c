"""Horseshoe distribution (Carvalho, Polson & Scott, 2010)."""

from __future__ import annotations

import math

import torch
from torch.distributions import Distribution, constraints
from torch.distributions.utils import broadcast_all

__all__ = ["Horseshoe"]

# K = 1 / sqrt(2 pi^3), the constant of Carvalho et al. (2010), Theorem 1.
_LOG_K = -0.5 * math.log(2.0 * math.pi**3)


class Horseshoe(Distribution):
    r"""Horseshoe distribution as a half-Cauchy scale mixture of normals.

    .. math::

        w = \mu + s\,\lambda\,z, \qquad
        \lambda \sim \mathcal{C}^{+}(0, 1), \quad z \sim \mathcal{N}(0, 1).

    ``rsample`` draws ``z`` (one ``torch.randn``) and then ``u`` (one
    ``torch.rand``) and sets :math:`\lambda = \tan(\pi u / 2)`, the half-Cauchy
    inverse cdf, so the sample is pathwise in :math:`\mu` and :math:`s`.

    **The density is approximate.** The marginal density of
    :math:`x = (w - \mu)/s` has no elementary closed form (it equals
    :math:`K e^{x^2/2} E_1(x^2/2)` with the exponential integral :math:`E_1`,
    which torch lacks). Carvalho et al. (Biometrika 2010, Theorem 1) bound it,
    with :math:`K = (2\pi^3)^{-1/2}`, by

    .. math::

        \frac{K}{2}\log\!\left(1 + \frac{4}{x^2}\right) < p(x)
        < K\log\!\left(1 + \frac{2}{x^2}\right),

    and ``log_prob`` returns the log of the midpoint of the two bounds,

    .. math::

        \log \hat p(w) = \log\frac{K}{4}
            + \log\!\left(\log\!\left(1 + \frac{4}{x^2}\right)
                          + 2\log\!\left(1 + \frac{2}{x^2}\right)\right) - \log s,

    using elementwise operations only. Its relative error is at most about
    5 % for :math:`|x| \ge 0.5`; as :math:`x \to 0` (where both it and the
    true density diverge logarithmically) it tends to 3/4 of the true density,
    and it integrates to about 0.963 rather than 1. The mean does not exist (``nan``), the variance is
    infinite; there is no closed-form entropy.

    Args:
        loc (float or Tensor): location :math:`\mu`.
        scale (float or Tensor): positive global scale :math:`s`.
        validate_args (bool, optional): whether to validate arguments and
            samples (torch's global default when ``None``).

    Example:
        >>> d = Horseshoe(0.0, 1.0)
        >>> bool(d.log_prob(torch.tensor(1.0)) < d.log_prob(torch.tensor(0.1)))
        True
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
        new = self._get_checked_instance(Horseshoe, _instance)
        batch_shape = torch.Size(batch_shape)
        new.loc = self.loc.expand(batch_shape)
        new.scale = self.scale.expand(batch_shape)
        super(Horseshoe, new).__init__(batch_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @property
    def mean(self) -> torch.Tensor:
        return torch.full(
            self._extended_shape(), math.nan, dtype=self.loc.dtype, device=self.loc.device
        )

    @property
    def mode(self) -> torch.Tensor:
        return self.loc

    @property
    def variance(self) -> torch.Tensor:
        return torch.full(
            self._extended_shape(), math.inf, dtype=self.loc.dtype, device=self.loc.device
        )

    def rsample(self, sample_shape=torch.Size()) -> torch.Tensor:
        shape = self._extended_shape(sample_shape)
        z = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
        u = torch.rand(shape, dtype=self.loc.dtype, device=self.loc.device)
        lam = torch.tan(0.5 * math.pi * u)
        return self.loc + self.scale * lam * z

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args:
            self._validate_sample(value)
        x = (value - self.loc) / self.scale
        inv_sq = 1.0 / (x * x)
        bounds = torch.log1p(4.0 * inv_sq) + 2.0 * torch.log1p(2.0 * inv_sq)
        return (_LOG_K - math.log(4.0)) + torch.log(bounds) - torch.log(self.scale)
