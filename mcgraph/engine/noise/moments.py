"""Exact moments of the standard noise laws: what the analytic (M = ∞) tier needs.

A collapsed term is ``Σ_m c_m · n_m(θ) · t̄_m`` with ``t̄_m`` a sample mean of a noise
statistic (Thms 1–2). Where the noise law's moments are known, the sample mean can be
replaced by its expectation, which gives the exact value of the term for the price
of M = 1 (and, for the Monte Carlo tiers, the exact variance of the estimator).

* **location-scale noise** (``w = μ + σξ``): the raw moments ``E[ξ^j]``, ``j ≥ 0``:

  ====================  ======================================================
  N(0, 1)               ``(j − 1)!!`` for even j, 0 for odd j
  Laplace(0, 1)         ``j!`` for even j, 0 for odd j
  Logistic(0, 1)        ``(2^j − 2) π^j |B_j|`` for even j (B: Bernoulli numbers)
  U(0, 1)               ``1 / (j + 1)``
  Gumbel(0, 1)          from the cumulants ``κ_1 = γ``, ``κ_n = (n − 1)! ζ(n)``
  StudentT(ν)           ``ν^{j/2} Π_{i ≤ j/2} (2i − 1)/(ν − 2i)`` for even ``j < ν``
  Radial in R^D         ``(j − 1)!! · Π_{i < j/2} (2i + 1)/(D + 2i)`` for even j
                        (ξ_d = r·ε_d/‖ε‖: r ~ N(0, 1) times a Beta(½, (D−1)/2) root)
  ====================  ======================================================

* **scaling noise** (``w = θξ``, ξ > 0): ``E[ξ^s (log ξ)^n] = f^{(n)}(s)`` with
  ``f(s) = E[ξ^s] = exp g(s)``; since ``f' = f g'``,
  ``f^{(n)} = Σ_{i<n} C(n−1, i) f^{(i)} g^{(n−i)}``, and ``g`` is a log-gamma:

  ====================  ======================================================
  Gamma(k, 1), Exp(1)   ``g = lgamma(k + s) − lgamma(k)``             (s > −k)
  1/Gamma(k, 1)         ``g = lgamma(k − s) − lgamma(k)``             (s < k)
  Weibull(1, k)         ``g = lgamma(1 + s/k)``                       (s > −k)
  |N(0, 1)|             ``g = (s/2) log 2 + lgamma((s+1)/2) − ½ log π`` (s > −1)
  Rayleigh(1)           ``g = (s/2) log 2 + lgamma(1 + s/2)``         (s > −2)
  ====================  ======================================================

Cauchy and half-Cauchy noise have no moments of order ≥ 1: no exact form.

A law's moments are an attribute of :class:`mcgraph.engine.noise.laws.NoiseLaw` (``moments``);
a new law is exact once it carries a :class:`PowerMoments` or :class:`LogMoments`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import torch

EULER_GAMMA = 0.57721566490153286061


class NoExactMoment(ValueError):
    """The moment does not exist (or is not known) for this noise law."""


def _tensor(x, dtype=torch.float64) -> torch.Tensor:
    return x.to(dtype) if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=dtype)


@dataclass(frozen=True)
class PowerMoments:
    """Raw moments ``E[ξ^j]`` of a location-scale noise law.

    Attributes:
        moment: ``moment(j, noise_shape) -> float | Tensor``; raises :class:`NoExactMoment`
            when ``E[ξ^j]`` does not exist.
    """

    moment: Callable[[int, tuple], object]

    def __call__(self, j: int, noise_shape=()) -> torch.Tensor:
        if j == 0:
            return torch.ones((), dtype=torch.float64)
        return _tensor(self.moment(j, tuple(noise_shape)))


@dataclass(frozen=True)
class LogMoments:
    """``E[ξ^s (log ξ)^n]`` of a positive scaling noise law, from ``g(s) = log E[ξ^s]``.

    Attributes:
        log_moment: ``g(s)`` (float or Tensor).
        derivative: ``derivative(s, n) = g^{(n)}(s)`` for ``n ≥ 1``.
        exists: ``exists(s) -> bool``: ``E[ξ^s] < ∞``.
        domain: the condition in words (for error messages).
    """

    log_moment: Callable[[float], object]
    derivative: Callable[[float, int], object]
    exists: Callable[[float], bool]
    domain: str

    def __call__(self, a: int, n: int = 0) -> torch.Tensor:
        if not self.exists(a):
            raise NoExactMoment(f"E[ξ^{a}] is infinite ({self.domain})")
        f = [torch.exp(_tensor(self.log_moment(a)))]
        dg = [None] + [_tensor(self.derivative(a, k)) for k in range(1, n + 1)]
        for m in range(1, n + 1):
            f.append(sum(math.comb(m - 1, i) * f[i] * dg[m - i] for i in range(m)))
        return f[n]


# --------------------------------------------------------------------------- location-scale laws


def _double_factorial(n: int) -> int:
    return math.prod(range(n, 0, -2)) if n > 0 else 1


def _even_only(rule: Callable[[int, tuple], object]) -> Callable[[int, tuple], object]:
    def moment(j, shape):
        return 0.0 if j % 2 else rule(j, shape)

    return moment


def _bernoulli(n: int) -> Fraction:
    """The Bernoulli number B_n (B_1 = −1/2)."""
    b = [Fraction(1)]
    for m in range(1, n + 1):
        b.append(-sum(math.comb(m + 1, k) * b[k] for k in range(m)) / (m + 1))
    return b[n]


def _logistic(j: int, shape) -> float:
    return float((2 ** j - 2) * math.pi ** j * abs(_bernoulli(j)))


def _zeta(n: int) -> float:
    one = torch.tensor(1.0, dtype=torch.float64)
    return float(torch.special.zeta(torch.tensor(float(n), dtype=torch.float64), one))


def _gumbel(j: int, shape) -> float:
    kappa = [0.0, EULER_GAMMA] + [math.factorial(n - 1) * _zeta(n) for n in range(2, j + 1)]
    m = [1.0]
    for n in range(1, j + 1):
        m.append(sum(math.comb(n - 1, i) * kappa[i + 1] * m[n - 1 - i] for i in range(n)))
    return m[j]


def _cauchy(j: int, shape):
    raise NoExactMoment("Cauchy noise has no moments of order ≥ 1")


NORMAL = PowerMoments(_even_only(lambda j, s: float(_double_factorial(j - 1))))
LAPLACE = PowerMoments(_even_only(lambda j, s: float(math.factorial(j))))
LOGISTIC = PowerMoments(_even_only(_logistic))
UNIFORM = PowerMoments(lambda j, s: 1.0 / (j + 1))
GUMBEL = PowerMoments(_gumbel)
CAUCHY = PowerMoments(_cauchy)


def student_t(df: torch.Tensor) -> PowerMoments:
    """``E[T^j]`` of a standard Student-t with ``df`` ν: exists for ``j < ν``."""

    def moment(j, shape):
        nu = df.detach().to(torch.float64)
        if not bool((nu > j).all()):
            raise NoExactMoment(f"it exists only for ν > {j} (ν = {nu.min().item():g})")
        if j % 2:
            return torch.zeros_like(nu)
        out = nu ** (j // 2)
        for i in range(1, j // 2 + 1):
            out = out * (2 * i - 1) / (nu - 2 * i)
        return out

    return PowerMoments(moment)


def radial(event_ndims: int) -> PowerMoments:
    """Marginal moments of radial noise ``ξ = r·ε/‖ε‖`` over an event of ``D`` elements."""

    def moment(j, shape):
        if j % 2:
            return 0.0
        D = math.prod(shape[len(shape) - event_ndims:]) if event_ndims else 1
        out = float(_double_factorial(j - 1))
        for i in range(j // 2):
            out *= (2 * i + 1) / (D + 2 * i)
        return out

    return PowerMoments(moment)


# --------------------------------------------------------------------------- scaling laws


def _pg(n: int, x) -> torch.Tensor:
    return torch.special.polygamma(n, _tensor(x))


def gamma(concentration) -> LogMoments:
    """ξ ~ Gamma(k, 1) (k = 1: Exp(1))."""
    kt = _tensor(concentration.detach() if isinstance(concentration, torch.Tensor) else concentration)
    return LogMoments(lambda s: torch.lgamma(kt + s) - torch.lgamma(kt), lambda s, n: _pg(n - 1, kt + s),
                      lambda s: bool((kt + s > 0).all()), "needs k + a > 0")


def inverse_gamma(concentration) -> LogMoments:
    """ξ = 1/G, G ~ Gamma(k, 1)."""
    kt = _tensor(concentration.detach() if isinstance(concentration, torch.Tensor) else concentration)
    return LogMoments(lambda s: torch.lgamma(kt - s) - torch.lgamma(kt),
                      lambda s, n: (-1) ** n * _pg(n - 1, kt - s),
                      lambda s: bool((kt - s > 0).all()), "needs k − a > 0")


def weibull(concentration) -> LogMoments:
    """ξ = E^{1/k}, E ~ Exp(1)."""
    kt = _tensor(concentration.detach() if isinstance(concentration, torch.Tensor) else concentration)
    return LogMoments(lambda s: torch.lgamma(1 + s / kt), lambda s, n: kt ** (-n) * _pg(n - 1, 1 + s / kt),
                      lambda s: bool((1 + s / kt > 0).all()), "needs 1 + a/k > 0")


def _half_normal_g(s):
    return 0.5 * s * math.log(2) + math.lgamma((s + 1) / 2) - 0.5 * math.log(math.pi)


def _half_normal_dg(s, n):
    base = _pg(n - 1, (s + 1) / 2) * 0.5 ** n
    return base + 0.5 * math.log(2) if n == 1 else base


def _rayleigh_dg(s, n):
    base = _pg(n - 1, 1 + s / 2) * 0.5 ** n
    return base + 0.5 * math.log(2) if n == 1 else base


EXPONENTIAL = gamma(1.0)
HALF_NORMAL = LogMoments(_half_normal_g, _half_normal_dg, lambda s: s > -1, "needs a > −1")
RAYLEIGH = LogMoments(lambda s: 0.5 * s * math.log(2) + math.lgamma(1 + s / 2), _rayleigh_dg,
                      lambda s: s > -2, "needs a > −2")
HALF_CAUCHY = LogMoments(lambda s: 0.0, lambda s, n: 0.0, lambda s: False,
                         "half-Cauchy noise has no moments of order ≥ 1")


def exact_statistic(moments, key: tuple[int, int], noise_shape=()) -> torch.Tensor:
    """``E[ξ^a (log ξ)^j]`` in float64, or :class:`NoExactMoment` with the reason.

    Example:
        >>> from mcgraph.engine.noise import moments
        >>> float(moments.exact_statistic(moments.LAPLACE, (4, 0)))           # 4! for Laplace(0, 1)
        24.0
        >>> round(float(moments.exact_statistic(moments.EXPONENTIAL, (0, 1))), 6)   # E log ξ = −γ
        -0.577216
    """
    a, j = key
    if moments is None:
        raise NoExactMoment("its moments are not registered (mcgraph.engine.noise.moments)")
    if isinstance(moments, PowerMoments):
        if j:
            raise NoExactMoment("log ξ of a location-scale noise has no exact form here")
        if a < 0:
            raise NoExactMoment("negative powers of a location-scale noise have no exact form")
        return moments(a, noise_shape)
    return moments(a, j)
