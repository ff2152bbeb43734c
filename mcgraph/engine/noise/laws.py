"""Noise laws: the standard noise ξ of each sampling form, with its sampler and exact moments.

A :class:`NoiseLaw` draws ``ξ`` into a tensor of a given shape; the standard laws are module
constants (the Triton and compiled CPU backends recognise them by identity), the laws with a
parameter (Gamma, inverse Gamma, Weibull, Student-t, Radial) are built per family.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from . import moments as mom
from .streams import Workspace


@dataclass(frozen=True)
class NoiseLaw:
    """The law of the standard noise ξ of a sampling form.

    Attributes:
        name: human-readable name used by ``explain``.
        sampler: ``sampler(shape, dtype, device) -> Tensor`` using the global RNG; with
            ``fills_out``, ``sampler(shape, dtype, device, out=None, work=None)``, which writes ξ
            into ``out`` when given (same values as a fresh draw) and takes any scratch memory it
            needs from the :class:`Workspace` ``work``.
        positive: ξ > 0 almost surely (needed for ``log w`` under a scaling form).
        event_ndims: trailing dims of one sample that the noise couples (Radial).
        fills_out: the sampler takes ``out=`` and ``work=`` (all built-in laws do).
        moments: a :class:`~mcgraph.engine.noise.moments.PowerMoments` (location-scale) or
            :class:`~mcgraph.engine.noise.moments.LogMoments` (scaling) for the analytic tier, or ``None``.
    """

    name: str
    sampler: Callable[..., torch.Tensor]
    positive: bool = False
    event_ndims: int = 0
    gaussian: bool = False
    fills_out: bool = False
    moments: object = None  #: exact moments (:mod:`mcgraph.engine.noise.moments`), or None when unknown

    def sample(self, shape, dtype, device, out: torch.Tensor | None = None,
               work: Workspace | None = None) -> torch.Tensor:
        """Draw ξ of ``shape``; ``out`` (same shape and dtype, contiguous) is filled when the law can.

        The values do not depend on ``out`` or ``work``, only where they are written.
        """
        shape = tuple(shape)
        if not self.fills_out:
            return self.sampler(shape, dtype, device)
        if out is not None and not (tuple(out.shape) == shape and out.dtype == dtype and out.is_contiguous()):
            out = None
        return self.sampler(shape, dtype, device, out=out, work=Workspace() if work is None else work)

    def __str__(self) -> str:
        return self.name


# Every sampler below makes the same torch calls, in the same order, as the out-of-place evaluation
# of its formula, but into ``out`` and reused workspace buffers: an in-place elementwise op over a
# whole tensor gives the same bits as its out-of-place form over that tensor.


def _empty(shape, dtype, device, out):
    return torch.empty(shape, dtype=dtype, device=device) if out is None else out


def _uniform_open(shape, dtype, device, out=None, work=None):
    finfo = torch.finfo(dtype)
    return torch.rand(shape, dtype=dtype, device=device, out=_empty(shape, dtype, device, out)).clamp_(
        finfo.tiny, 1.0 - finfo.eps)


def _normal(shape, dtype, device, out=None, work=None):
    return torch.randn(shape, dtype=dtype, device=device, out=_empty(shape, dtype, device, out))


def _laplace(shape, dtype, device, out=None, work=None):
    """ξ = −sign(u)·log1p(−|u|), u ~ U(−1, 1)."""
    finfo = torch.finfo(dtype)
    u = torch.rand(shape, dtype=dtype, device=device, out=_empty(shape, dtype, device, out))
    u.mul_(2).sub_(1).clamp_(-1 + finfo.eps, 1 - finfo.eps)
    log_term = torch.abs(u, out=work.buffer("laplace", shape, dtype, device)).neg_().log1p_()
    return u.sign_().neg_().mul_(log_term)


def _logistic(shape, dtype, device, out=None, work=None):
    """ξ = log u − log1p(−u), u ~ U(0, 1) (open)."""
    u = _uniform_open(shape, dtype, device, out)
    log1m = torch.neg(u, out=work.buffer("logistic", shape, dtype, device)).log1p_()
    return u.log_().sub_(log1m)


def _cauchy(shape, dtype, device, out=None, work=None):
    return _empty(shape, dtype, device, out).cauchy_()


def _gumbel(shape, dtype, device, out=None, work=None):
    """ξ = −log(−log u), u ~ U(0, 1) (open)."""
    return _uniform_open(shape, dtype, device, out).log_().neg_().log_().neg_()


def _uniform(shape, dtype, device, out=None, work=None):
    return torch.rand(shape, dtype=dtype, device=device, out=_empty(shape, dtype, device, out))


def _exponential(shape, dtype, device, out=None, work=None):
    return _empty(shape, dtype, device, out).exponential_()


def _half_normal(shape, dtype, device, out=None, work=None):
    return _normal(shape, dtype, device, out).abs_()


def _half_cauchy(shape, dtype, device, out=None, work=None):
    return _cauchy(shape, dtype, device, out).abs_()


def _rayleigh(shape, dtype, device, out=None, work=None):
    return _exponential(shape, dtype, device, out).mul_(2).sqrt_()


def _standard_gamma(concentration: torch.Tensor, shape, dtype, device, work=None):
    """Gamma(k, 1) draws of ``shape``: a fresh tensor (torch's gamma sampler has no ``out=``).

    The broadcast concentration goes into a workspace buffer rather than a fresh copy.
    """
    alpha = concentration.detach().to(dtype=dtype, device=device).expand(shape)
    alpha = alpha.contiguous() if work is None else work.buffer("gamma", shape, dtype, device).copy_(alpha)
    return torch._standard_gamma(alpha).clamp_(min=torch.finfo(dtype).tiny)


STANDARD_NORMAL = NoiseLaw("N(0, 1)", _normal, gaussian=True, fills_out=True, moments=mom.NORMAL)
STANDARD_LAPLACE = NoiseLaw("Laplace(0, 1)", _laplace, fills_out=True, moments=mom.LAPLACE)
STANDARD_LOGISTIC = NoiseLaw("Logistic(0, 1)", _logistic, fills_out=True, moments=mom.LOGISTIC)
STANDARD_CAUCHY = NoiseLaw("Cauchy(0, 1)", _cauchy, fills_out=True, moments=mom.CAUCHY)
STANDARD_GUMBEL = NoiseLaw("Gumbel(0, 1)", _gumbel, fills_out=True, moments=mom.GUMBEL)
STANDARD_UNIFORM = NoiseLaw("U(0, 1)", _uniform, positive=True, fills_out=True, moments=mom.UNIFORM)
STANDARD_EXPONENTIAL = NoiseLaw("Exp(1)", _exponential, positive=True, fills_out=True,
                                moments=mom.EXPONENTIAL)
STANDARD_HALF_NORMAL = NoiseLaw("|N(0, 1)|", _half_normal, positive=True, fills_out=True,
                                moments=mom.HALF_NORMAL)
STANDARD_HALF_CAUCHY = NoiseLaw("|Cauchy(0, 1)|", _half_cauchy, positive=True, fills_out=True,
                                moments=mom.HALF_CAUCHY)
STANDARD_RAYLEIGH = NoiseLaw("Rayleigh(1)", _rayleigh, positive=True, fills_out=True, moments=mom.RAYLEIGH)


def gamma_noise(concentration: torch.Tensor) -> NoiseLaw:
    """ξ ~ Gamma(k, 1) for a fixed shape ``k`` (broadcast against the sample)."""

    def sampler(shape, dtype, device, out=None, work=None):
        return _standard_gamma(concentration, shape, dtype, device, work)

    return NoiseLaw("Gamma(k, 1)", sampler, positive=True, fills_out=True, moments=mom.gamma(concentration))


def inverse_gamma_noise(concentration: torch.Tensor) -> NoiseLaw:
    """ξ = 1/G, G ~ Gamma(k, 1)."""

    def sampler(shape, dtype, device, out=None, work=None):
        return _standard_gamma(concentration, shape, dtype, device, work).reciprocal_()

    return NoiseLaw("1/Gamma(k, 1)", sampler, positive=True, fills_out=True,
                    moments=mom.inverse_gamma(concentration))


def weibull_noise(concentration: torch.Tensor) -> NoiseLaw:
    """ξ = E^(1/k), E ~ Exp(1): a Weibull(1, k) draw."""

    def sampler(shape, dtype, device, out=None, work=None):
        k = concentration.detach().to(dtype=dtype, device=device)
        return _exponential(shape, dtype, device, out).pow_(k.reciprocal().expand(shape))

    return NoiseLaw("Weibull(1, k)", sampler, positive=True, fills_out=True,
                    moments=mom.weibull(concentration))


def student_t_noise(df: torch.Tensor) -> NoiseLaw:
    """ξ = Z / sqrt(V/ν), Z ~ N(0,1), V ~ χ²(ν) for a fixed ``df`` ν."""

    def sampler(shape, dtype, device, out=None, work=None):
        nu = df.detach().to(dtype=dtype, device=device)
        z = _normal(shape, dtype, device, out)
        chi2 = _standard_gamma(nu / 2, shape, dtype, device, work).mul_(2)
        return z.mul_(chi2.div_(nu).rsqrt_())

    return NoiseLaw("StudentT(ν, 0, 1)", sampler, fills_out=True, moments=mom.student_t(df))


@functools.lru_cache(maxsize=None)  # a function of event_ndims alone: one law per rank of the event
def radial_noise_law(event_ndims: int) -> NoiseLaw:
    """ξ = (ε/‖ε‖)·r, ε ~ N(0, I) over the last ``event_ndims`` dims, r ~ N(0, 1).

    ε is drawn into ``out`` and divided and scaled there; its squares, whose sums give the norms,
    go into a workspace buffer. They are reduced whole, as ``eps.square().sum(dims)`` would be:
    torch splits a reduction with few outputs across threads depending on how many outputs there
    are, so summing the rows in smaller groups would not give the same bits.
    """

    def sampler(shape, dtype, device, out=None, work=None):
        eps = _normal(shape, dtype, device, out)
        lead = len(shape) - event_ndims
        r_shape = shape[:lead] + (1,) * event_ndims
        if event_ndims:
            r = torch.randn(r_shape, dtype=dtype, device=device)
            squares = torch.square(eps, out=work.buffer("radial_sq", shape, dtype, device))
            norm = squares.sum(dim=tuple(range(lead, len(shape))), keepdim=True).sqrt_()
        else:  # ε/|ε|·r with r of the full shape
            r = _normal(shape, dtype, device, work.buffer("radial_r", shape, dtype, device))
            norm = torch.abs(eps, out=work.buffer("radial_norm", shape, dtype, device))
        return eps.div_(norm).mul_(r)

    return NoiseLaw("Radial: (ε/‖ε‖)·r", sampler, event_ndims=event_ndims, fills_out=True,
                    moments=mom.radial(event_ndims))
