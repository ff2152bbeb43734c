"""Radial posterior of Farquhar, Osborne & Gal (2020).

The radial family keeps the location-scale form of a mean-field Gaussian but
replaces its noise with a direction uniform on the unit sphere times a scalar
standard-normal radius, so that samples do not concentrate on a thin shell in
high dimension.
"""

from __future__ import annotations

import math

import torch
from torch.distributions import Distribution, constraints
from torch.distributions.utils import broadcast_all

__all__ = ["Radial", "radial_noise", "radial_noise_entropy"]

_EULER_GAMMA = 0.57721566490153286060651209008240243
_LOG_2 = math.log(2.0)
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _event_dims(event_ndim: int) -> tuple[int, ...]:
    return tuple(range(-event_ndim, 0))


def _log_sphere_area(dim: int) -> float:
    """Log surface area of the unit sphere :math:`S^{D-1} \\subset \\mathbb{R}^D`."""
    return _LOG_2 + 0.5 * dim * math.log(math.pi) - math.lgamma(0.5 * dim)


def radial_noise(
    sample_shape: torch.Size | tuple[int, ...],
    event_shape: torch.Size | tuple[int, ...],
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    r"""Draws standard radial noise from the global RNG.

    Each of the ``prod(sample_shape)`` draws is a vector over the event
    dimensions

    .. math::

        \xi = \frac{\epsilon}{\lVert \epsilon \rVert_2}\, r, \qquad
        \epsilon \sim \mathcal{N}(0, I_D), \quad r \sim \mathcal{N}(0, 1),

    where the norm runs over all :math:`D = \prod` ``event_shape`` elements of
    one draw. ``epsilon`` is drawn first (one ``torch.randn`` of shape
    ``sample_shape + event_shape``), then ``r`` (one ``torch.randn`` of shape
    ``sample_shape``), so a fixed ``torch.manual_seed`` reproduces the draw.

    Args:
        sample_shape: leading shape; one independent radius per element.
        event_shape: shape of one event; the direction is normalised over it.
            ``()`` gives :math:`D = 1` and :math:`\xi \sim \mathcal{N}(0, 1)`.
        dtype: floating dtype of the result (default: torch's default dtype).
        device: device of the result.

    Returns:
        Tensor of shape ``sample_shape + event_shape``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> xi = radial_noise((4,), (3, 2))
        >>> xi.shape
        torch.Size([4, 3, 2])
    """
    sample_shape = torch.Size(sample_shape)
    event_shape = torch.Size(event_shape)
    eps = torch.randn(sample_shape + event_shape, dtype=dtype, device=device)
    radius = torch.randn(sample_shape, dtype=dtype, device=device)
    dims = _event_dims(len(event_shape))
    if dims:
        norm = torch.linalg.vector_norm(eps, dim=dims, keepdim=True)
    else:
        norm = eps.abs()
    norm = norm.clamp_min(torch.finfo(eps.dtype).tiny)
    radius = radius.reshape(sample_shape + (1,) * len(event_shape))
    return eps.div_(norm).mul_(radius)  # in place: the same bits as eps / norm * radius


def radial_noise_entropy(dim: int) -> float:
    r"""Differential entropy of standard radial noise in :math:`\mathbb{R}^D`.

    With :math:`\rho = \lVert\xi\rVert = |r|` half-normal and
    :math:`\mathbb{E}[\log|r|] = -(\gamma + \log 2)/2`,

    .. math::

        H(\xi) = -\log 2 + \tfrac12\log(2\pi) + \tfrac12 + \log S_{D-1}
                 - \tfrac{D-1}{2}(\gamma + \log 2),
        \qquad S_{D-1} = \frac{2\pi^{D/2}}{\Gamma(D/2)}.

    For :math:`D = 1` this is the standard-normal entropy
    :math:`\tfrac12\log(2\pi e)`.

    Args:
        dim: number of event elements :math:`D \ge 1`.

    Returns:
        The entropy in nats.

    Example:
        >>> round(radial_noise_entropy(1), 6) == round(0.5 * math.log(2 * math.pi * math.e), 6)
        True
    """
    if dim < 1:
        raise ValueError(f"Expected dim >= 1, got dim={dim}.")
    return (
        -_LOG_2
        + _HALF_LOG_2PI
        + 0.5
        + _log_sphere_area(dim)
        - 0.5 * (dim - 1) * (_EULER_GAMMA + _LOG_2)
    )


class Radial(Distribution):
    r"""Radial distribution (Farquhar, Osborne & Gal, AISTATS 2020, Sec. 3).

    The event is the whole parameter tensor: ``batch_shape == ()`` and
    ``event_shape == broadcast(loc, scale).shape`` (``expand`` may add batch
    dimensions in front). A sample is

    .. math::

        w = \mu + \sigma \odot \xi, \qquad
        \xi = \frac{\epsilon}{\lVert\epsilon\rVert}\, r, \quad
        \epsilon \sim \mathcal{N}(0, I_D),\ r \sim \mathcal{N}(0, 1),

    with :math:`D` the number of event elements. The noise has density

    .. math::

        p(\xi) = \frac{2\,\varphi(\rho)}{S_{D-1}\,\rho^{D-1}}, \qquad
        \rho = \lVert\xi\rVert,\quad S_{D-1} = \frac{2\pi^{D/2}}{\Gamma(D/2)},

    so :math:`\log q(w) = \log p((w-\mu)/\sigma) - \sum_j \log\sigma_j`, and
    the entropy is :math:`\sum_j \log\sigma_j + H(\xi)` with :math:`H(\xi)`
    from :func:`radial_noise_entropy`. The mean is :math:`\mu` and the
    per-element variance :math:`\sigma_j^2 / D`. For :math:`D = 1` the
    distribution is :math:`\mathcal{N}(\mu, \sigma^2)`.

    ``log_prob`` reduces over the event (it needs :math:`\lVert\xi\rVert`), so
    unlike the other families here it is not elementwise in ``value``.

    Args:
        loc (float or Tensor): location :math:`\mu`; with ``scale`` defines the
            event shape.
        scale (float or Tensor): positive per-element scale :math:`\sigma`.
        validate_args (bool, optional): whether to validate arguments and
            samples (torch's global default when ``None``).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> q = Radial(torch.zeros(3, 2), torch.ones(3, 2))
        >>> w = q.rsample((5,))
        >>> w.shape, q.log_prob(w).shape
        (torch.Size([5, 3, 2]), torch.Size([5]))
    """

    arg_constraints = {"loc": constraints.real, "scale": constraints.positive}
    has_rsample = True

    def __init__(
        self,
        loc: torch.Tensor | float,
        scale: torch.Tensor | float,
        validate_args: bool | None = None,
    ) -> None:
        self.loc, self.scale = broadcast_all(loc, scale)
        if self.loc.numel() == 0:
            raise ValueError(
                "Expected loc and scale to broadcast to a non-empty event, got "
                f"shape {tuple(self.loc.shape)}."
            )
        super().__init__(torch.Size(), self.loc.shape, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(Radial, _instance)
        batch_shape = torch.Size(batch_shape)
        full = batch_shape + self.event_shape
        new.loc = self.loc.expand(full)
        new.scale = self.scale.expand(full)
        super(Radial, new).__init__(batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @property
    def support(self):
        return constraints.independent(constraints.real, len(self.event_shape))

    @property
    def event_numel(self) -> int:
        """Number of elements :math:`D` of one event."""
        return self.event_shape.numel()

    @property
    def mean(self) -> torch.Tensor:
        return self.loc

    @property
    def variance(self) -> torch.Tensor:
        return self.scale.pow(2) / self.event_numel

    def rsample(self, sample_shape=torch.Size()) -> torch.Tensor:
        sample_shape = torch.Size(sample_shape)
        xi = radial_noise(
            sample_shape + self.batch_shape,
            self.event_shape,
            dtype=self.loc.dtype,
            device=self.loc.device,
        )
        return self.loc + self.scale * xi

    def _sum_event(self, x: torch.Tensor) -> torch.Tensor:
        dims = _event_dims(len(self.event_shape))
        return x.sum(dims) if dims else x

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args:
            self._validate_sample(value)
        dim = self.event_numel
        z = (value - self.loc) / self.scale
        sq_norm = self._sum_event(z * z)
        log_p = (
            _LOG_2 - _HALF_LOG_2PI - _log_sphere_area(dim) - 0.5 * sq_norm
        )
        if dim > 1:
            # (D - 1) log rho = (D - 1)/2 log rho^2
            log_p = log_p - 0.5 * (dim - 1) * torch.log(sq_norm)
        return log_p - self._sum_event(torch.log(self.scale))

    def entropy(self) -> torch.Tensor:
        return self._sum_event(torch.log(self.scale)) + radial_noise_entropy(
            self.event_numel
        )
