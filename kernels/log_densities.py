"""The prior log-densities the fused kernels evaluate per sample, split into their w-dependent part and the rest.

A log-density is written ``log p(w; c) = h(w; c) + A(c)``: the kernels (the Triton ones of
:mod:`mcgraph.kernels.integrands`, the compiled CPU loop of :mod:`mcgraph.engine.estimators.cpu_fused`)
evaluate ``h`` and its derivatives per sample, and ``A`` (``normalizer``) is added once as a
differentiable torch expression, so that ``lgamma`` and its kin never run per sample. Each entry
names:

* ``params(dist)``: the distribution's parameter tensors ``c``, at most four, in the kernels' slot order;
* ``normalizer(*params)``: ``A(c)`` (``None`` when it is 0);
* ``positive``: the support is ``w > 0``;
* ``code``: the integrand's number in ``csrc/cpu_fused.cpp``.

Lookup follows the distribution's MRO, like ``torch.distributions.kl.register_kl``, but only when the
class inherits the registered class's ``log_prob`` unchanged: a subclass that overrides ``log_prob`` is
not given its parent's density.

Example:
    >>> import torch
    >>> from mcgraph.kernels.log_densities import log_density
    >>> entry = log_density(torch.distributions.Laplace)
    >>> entry.code, [p.item() for p in entry.params(torch.distributions.Laplace(0.0, 2.0))]
    (1, [0.0, 2.0])
    >>> log_density(torch.distributions.Beta) is None
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributions import Cauchy, Distribution, Gamma, InverseGamma, Laplace, LogNormal, Normal, StudentT

from mcgraph.distributions import Logistic, LogUniform, ScaleMixtureNormal
from mcgraph.registry import Registry

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


@dataclass(frozen=True)
class LogDensity:
    """A prior's log-density as the kernels take it (see the module docstring for the fields)."""

    dist_type: type
    code: int
    params: Callable[[Distribution], tuple]
    normalizer: Callable[..., torch.Tensor] | None = None
    positive: bool = False

    @property
    def name(self) -> str:
        return self.dist_type.__name__


def _location_scale(d):
    return d.loc, d.scale


def _concentration_rate(d):
    return d.concentration, d.rate


def _student_t_normalizer(df, loc, scale):
    return (torch.lgamma(0.5 * (df + 1)) - torch.lgamma(0.5 * df) - 0.5 * torch.log(df * math.pi)
            - torch.log(scale))


def _gamma_normalizer(k, rate):
    return k * torch.log(rate) - torch.lgamma(k)


#: Distribution class → :class:`LogDensity` (:func:`log_density` looks them up).
LOG_DENSITIES: Registry = Registry("kernel log-density", by_type=True)

for _entry in (
        LogDensity(Normal, 0, _location_scale, lambda loc, scale: -torch.log(scale) - _HALF_LOG_2PI),
        LogDensity(Laplace, 1, _location_scale, lambda loc, scale: -torch.log(2 * scale)),
        LogDensity(Logistic, 2, _location_scale, lambda loc, scale: -torch.log(scale)),
        LogDensity(Cauchy, 3, _location_scale, lambda loc, scale: -torch.log(scale) - math.log(math.pi)),
        LogDensity(StudentT, 4, lambda d: (d.df, d.loc, d.scale), _student_t_normalizer),
        LogDensity(ScaleMixtureNormal, 5, lambda d: (d.pi, d.scale1, d.scale2, d.loc),
                   lambda pi, s1, s2, loc: -_HALF_LOG_2PI),
        LogDensity(LogUniform, 6, lambda d: ()),
        LogDensity(Gamma, 7, _concentration_rate, _gamma_normalizer, positive=True),
        LogDensity(LogNormal, 8, _location_scale, lambda loc, scale: -torch.log(scale) - _HALF_LOG_2PI,
                   positive=True),
        LogDensity(InverseGamma, 9, _concentration_rate, _gamma_normalizer, positive=True)):
    LOG_DENSITIES.register(_entry.dist_type, _entry)


def inherited_entry(registry: Registry, dist_type: type):
    """The entry (with a ``dist_type``) of ``registry``'s most specific registered base of ``dist_type``, when
    ``dist_type`` inherits that base's ``log_prob`` unchanged, else ``None`` (the rule of both kernels' tables)."""
    entry = registry.lookup(dist_type, None)
    if entry is None or getattr(dist_type, "log_prob") is not getattr(entry.dist_type, "log_prob"):
        return None
    return entry


def log_density(dist_type: type) -> LogDensity | None:
    """The entry of the most specific registered base whose ``log_prob`` ``dist_type`` inherits, else ``None``."""
    return inherited_entry(LOG_DENSITIES, dist_type)


#: The sample forms the kernels evaluate: ``w = loc + scale·ξ``, ``w = scale·ξ`` and ``w = exp(loc + scale·ξ)``
#: (in the order of their codes in ``csrc/cpu_fused.cpp``).
FORM_KINDS = ("location_scale", "scaling", "exp")

#: ``(density name, form kind)`` pairs whose log-density has no polynomial term in the noise, so that the
#: engine's plan puts all of it (but its constant) in the fused tier. Under ``method="auto"`` and
#: ``"monte-carlo"`` only these take a kernel for the whole cross term (the compiled CPU loop, the Triton
#: kernel): for the others the engine takes the polynomial terms exactly (``"auto"``) or by the collapsed
#: tier, and a kernel would change the estimate. ``method="fused"`` asks for the kernel for every density.
WHOLLY_FUSED = frozenset({(name, kind) for name in ("Laplace", "Logistic", "Cauchy", "StudentT", "ScaleMixtureNormal")
                          for kind in FORM_KINDS} | {("LogUniform", "location_scale"), ("LogUniform", "scaling")})


def kernel_takes_whole_term(entry: LogDensity | None, kind: str, method: str) -> bool:
    """Whether a kernel computes the whole ``E_q[log p]`` for a prior whose :func:`log_density` is ``entry``
    (``None``: none registered) and a sample form of ``kind`` under ``method`` (see :data:`WHOLLY_FUSED`)."""
    if method == "fused":
        return True
    return entry is not None and (entry.name, kind) in WHOLLY_FUSED
