"""Registry of elementwise integrands with a Triton implementation: prior log-densities.

An integrand is the w-dependent part ``h(w; c)`` of a log-density
``log p(w; c) = h(w; c) + A(c)``:

* a ``@triton.jit`` device function ``(w, p0, p1, p2, p3) -> (h, ∂h/∂w, ∂h/∂p0, …, ∂h/∂p3)``
  evaluated per sample inside the fused kernel (unused parameter slots and their
  derivatives are zeros);
* ``params(dist)``: the distribution's parameter tensors, at most four, in slot order;
* ``normalizer(*params)``: the w-free part ``A(c)`` as a differentiable torch
  expression (``None`` when it is 0), added once outside the kernel, so that
  ``lgamma``/``digamma`` never run per sample;
* ``positive``: the density's support is w > 0.

Adding an integrand is one device function plus one registration::

    @register_log_prob(MyPrior, params=lambda d: (d.loc, d.scale),
                       normalizer=lambda loc, scale: -scale.log())
    @triton.jit
    def my_prior_log_prob(w, loc, scale, p2, p3):
        ...
        return h, dh_dw, dh_dloc, dh_dscale, w * 0.0, w * 0.0

Lookup follows the distribution's MRO (most specific class first), like
``torch.distributions.kl.register_kl``, but only when the class inherits the
registered class's ``log_prob`` unchanged: a subclass that overrides
``log_prob`` is not silently given its parent's density.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl
from torch.distributions import Cauchy, Distribution, Gamma, InverseGamma, Laplace, LogNormal, Normal, StudentT

from mcgraph.distributions import Logistic, LogUniform, ScaleMixtureNormal
from .log_densities import LOG_DENSITIES, inherited_entry
from mcgraph.registry import Registry


@dataclass(frozen=True)
class TritonIntegrand:
    """A registered log-density (see the module docstring for the fields)."""

    dist_type: type
    device_fn: object
    params: Callable[[Distribution], tuple]
    normalizer: Callable[..., torch.Tensor | float] | None
    positive: bool

    @property
    def name(self) -> str:
        return self.dist_type.__name__


#: Distribution class -> :class:`TritonIntegrand` (see :func:`integrand_entry` for the lookup rule).
LOG_PROBS: Registry = Registry("Triton log-density", by_type=True)


def register_log_prob(dist_type: type, *, params: Callable[[Distribution], tuple],
                      normalizer: Callable[..., torch.Tensor] | None = None, positive: bool = False):
    """Register the ``@triton.jit`` log-density of ``dist_type`` (a decorator)."""
    if not (isinstance(dist_type, type) and issubclass(dist_type, Distribution)):
        raise TypeError(f"register_log_prob expects a Distribution subclass, got {dist_type!r}")

    def decorator(device_fn):
        LOG_PROBS.register(dist_type, TritonIntegrand(dist_type, device_fn, params, normalizer, positive))
        return device_fn

    return decorator


def integrand_entry(dist_type: type) -> TritonIntegrand | None:
    """The entry of the most specific registered base whose ``log_prob`` ``dist_type`` inherits."""
    return inherited_entry(LOG_PROBS, dist_type)


# --------------------------------------------------------------------------- device helpers


@triton.jit
def log1p(x):
    """log(1 + x), accurate for small |x| (Goldberg's trick; exact IEEE, no libdevice)."""
    y = 1.0 + x
    d = y - 1.0
    return tl.where(d == 0.0, x, tl.log(y) * (x / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _sign(x):
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))


# --------------------------------------------------------------------------- integrands


def _builtin(dist_type: type) -> dict:
    """The parameters, normaliser and support of a built-in density (shared with the CPU loop:
    :mod:`mcgraph.kernels.log_densities`)."""
    entry = LOG_DENSITIES[dist_type]
    return {"params": entry.params, "normalizer": entry.normalizer, "positive": entry.positive}



@register_log_prob(Normal, **_builtin(Normal))
@triton.jit
def normal_log_prob(w, loc, scale, p2, p3):
    """h = -z²/2, z = (w - loc)/scale."""
    z = (w - loc) / scale
    dw = -z / scale
    return -0.5 * z * z, dw, -dw, z * z / scale, w * 0.0, w * 0.0


@register_log_prob(Laplace, **_builtin(Laplace))
@triton.jit
def laplace_log_prob(w, loc, scale, p2, p3):
    """h = -|w - loc|/scale."""
    d = w - loc
    dw = -_sign(d) / scale
    return -tl.abs(d) / scale, dw, -dw, tl.abs(d) / (scale * scale), w * 0.0, w * 0.0


@register_log_prob(Logistic, **_builtin(Logistic))
@triton.jit
def logistic_log_prob(w, loc, scale, p2, p3):
    """h = -|z| - 2 log(1 + e^{-|z|}); ∂h/∂z = -tanh(z/2)."""
    z = (w - loc) / scale
    e = tl.exp(-tl.abs(z))
    dz = -_sign(z) * (1.0 - e) / (1.0 + e)
    return -tl.abs(z) - 2.0 * log1p(e), dz / scale, -dz / scale, -dz * z / scale, w * 0.0, w * 0.0


@register_log_prob(Cauchy, **_builtin(Cauchy))
@triton.jit
def cauchy_log_prob(w, loc, scale, p2, p3):
    """h = -log(1 + z²)."""
    z = (w - loc) / scale
    dz = -2.0 * z / (1.0 + z * z)
    return -log1p(z * z), dz / scale, -dz / scale, -dz * z / scale, w * 0.0, w * 0.0


@register_log_prob(StudentT, **_builtin(StudentT))
@triton.jit
def student_t_log_prob(w, df, loc, scale, p3):
    """h = -(ν+1)/2 · log(1 + z²/ν); ∂h/∂ν = -½ log(1 + z²/ν) + (ν+1)/2 · z²/(ν(ν + z²))."""
    z = (w - loc) / scale
    z2 = z * z
    l1 = log1p(z2 / df)
    dz = -(df + 1.0) * z / (df + z2)
    ddf = -0.5 * l1 + 0.5 * (df + 1.0) * z2 / (df * (df + z2))
    return -0.5 * (df + 1.0) * l1, dz / scale, ddf, -dz / scale, -dz * z / scale, w * 0.0


@register_log_prob(ScaleMixtureNormal, **_builtin(ScaleMixtureNormal))
@triton.jit
def scale_mixture_log_prob(w, pi, scale1, scale2, loc):
    """h = logaddexp(log π - log σ₁ - z₁²/2, log(1-π) - log σ₂ - z₂²/2); r = σ(a - b) weighs the gradients."""
    z1 = (w - loc) / scale1
    z2 = (w - loc) / scale2
    a = tl.log(pi) - tl.log(scale1) - 0.5 * z1 * z1
    b = log1p(-pi) - tl.log(scale2) - 0.5 * z2 * z2
    hi = tl.maximum(a, b)
    h = hi + log1p(tl.exp(-tl.abs(a - b)))
    r = 1.0 / (1.0 + tl.exp(b - a))
    dw = -(r * z1 / scale1 + (1.0 - r) * z2 / scale2)
    dpi = r / pi - (1.0 - r) / (1.0 - pi)
    ds1 = r * (z1 * z1 - 1.0) / scale1
    ds2 = (1.0 - r) * (z2 * z2 - 1.0) / scale2
    return h, dw, dpi, ds1, ds2, -dw


@register_log_prob(LogUniform, **_builtin(LogUniform))
@triton.jit
def log_uniform_log_prob(w, p0, p1, p2, p3):
    """h = -log|w| (improper prior of sparse variational dropout, constant dropped)."""
    return -tl.log(tl.abs(w)), -1.0 / w, w * 0.0, w * 0.0, w * 0.0, w * 0.0


@register_log_prob(Gamma, **_builtin(Gamma))
@triton.jit
def gamma_log_prob(w, k, rate, p2, p3):
    """h = (k - 1) log w - rate · w."""
    lw = tl.log(w)
    return (k - 1.0) * lw - rate * w, (k - 1.0) / w - rate, lw, -w, w * 0.0, w * 0.0


@register_log_prob(LogNormal, **_builtin(LogNormal))
@triton.jit
def log_normal_log_prob(w, loc, scale, p2, p3):
    """h = -log w - z²/2, z = (log w - loc)/scale."""
    lw = tl.log(w)
    z = (lw - loc) / scale
    return -lw - 0.5 * z * z, (-1.0 - z / scale) / w, z / scale, z * z / scale, w * 0.0, w * 0.0


@register_log_prob(InverseGamma, **_builtin(InverseGamma))
@triton.jit
def inverse_gamma_log_prob(w, k, rate, p2, p3):
    """h = -(k + 1) log w - rate / w."""
    lw = tl.log(w)
    iw = 1.0 / w
    return -(k + 1.0) * lw - rate * iw, (rate * iw - (k + 1.0)) * iw, -lw, -iw, w * 0.0, w * 0.0


def integrand_for(prior: Distribution) -> TritonIntegrand:
    """The registered integrand for ``prior``; ``NotImplementedError`` naming its type otherwise."""
    entry = integrand_entry(type(prior))
    if entry is None:
        names = sorted(t.__name__ for t in LOG_PROBS.registered())
        raise NotImplementedError(f"prior: no Triton log-density is registered for {type(prior).__name__} "
                                  f"(registered: {names}); use mcgraph.kernels.integrands.register_log_prob")
    return entry
