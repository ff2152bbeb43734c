"""Sparse variational dropout (Molchanov, Ashukha & Vetrov, ICML 2017): the ``"sparse_vd"`` posterior.

Each weight has a Gaussian posterior in the additive-noise parameterization,

.. math::
    q(w) = \\mathcal N(\\theta, \\sigma^2), \\qquad \\rho = \\log\\sigma^2 \\text{ trained},
    \\qquad \\log\\alpha = \\log\\sigma^2 - \\log\\theta^2,

under the improper log-uniform prior p(w) ∝ 1/|w|. Its KL depends on α only and is an
expectation of a non-polynomial integrand,

.. math::
    KL(\\alpha) = -\\tfrac12\\log(2\\pi e) - \\tfrac12\\log\\alpha
      + E_{\\varepsilon\\sim\\mathcal N(0,1)}\\log\\lvert 1 + \\sqrt{\\alpha}\\,\\varepsilon\\rvert - c_\\infty ,

with the additive constant fixed so that KL → 0 as α → ∞ (:data:`C_INF` = its limit
−½ log(2πe) − ½(γ + log 2)). Two routes, chosen by ``SparseVD(kl=...)``:

* ``kl="approx"`` (default): the published fit (Molchanov et al., 2017, Eq. 14),
  :math:`KL \\approx k_1 - k_1\\,\\mathrm{sigmoid}(k_2 + k_3\\log\\alpha) + \\tfrac12\\log(1 + \\alpha^{-1})`,
  k1 = 0.63576, k2 = 1.87320, k3 = 1.48695 (maximum deviation from the exact KL ≈ 0.0094,
  at log α ≈ −3.5);
* ``kl="mc"``: mcgraph's many-sample estimate of the same KL — ``mg.kl_divergence`` of the
  Gaussian against :class:`~mcgraph.distributions.LogUniform` (closed-form entropy, E_q[log|w|]
  by the fused tier, graph independent of the layer's ``kl_samples``), minus :data:`C_INF`.

Layers built with ``posterior="sparse_vd"`` default to ``prior="log_uniform"``, local
reparameterization, ``scale_transform="exp_half"`` (ρ = log σ²) and ρ = −10. The prior may also be
``"ard"`` (:mod:`mcgraph.nn.ard`); a prior with no sparsifying KL rule is refused.

Example:
    >>> import torch, mcgraph as mg
    >>> net = mg.nn.bayesify(mg.models.get_model("lenet300_100", image_size=8), posterior="sparse_vd")
    >>> layer = net.classifier[1]
    >>> layer.local_reparameterization, str(layer.scale_transform), type(layer.prior).__name__
    (True, 'exp_half', 'LogUniform')
    >>> kl = mg.nn.kl(net)                                    # the approximation, summed over weights
    >>> mc = mg.nn.bayesify(torch.nn.Linear(4, 3), posterior=mg.nn.SparseVD(kl="mc"), kl_samples=10_000)
    >>> mg.nn.kl(mc, seed=0).shape
    torch.Size([])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributions import Distribution, Normal

from ..engine.api import kl_divergence
from ..distributions import LogUniform
from .layer_kl import find_layer_kl, register_layer_kl
from .priors import register_posterior

__all__ = ["SparseVD", "SparseVDNormal", "K1", "K2", "K3", "C_INF", "KL_ROUTES", "log_alpha", "kl_approx",
           "kl_log_uniform"]

K1, K2, K3 = 0.63576, 1.87320, 1.48695
"""The constants of the published approximation (Molchanov et al., 2017, Eq. 14)."""

C_INF = -0.5 * math.log(2 * math.pi * math.e) - 0.5 * (0.5772156649015329 + math.log(2.0))
"""lim_{α→∞} of E_q[log q] − E_q[−log|w|] for q = N(θ, αθ²): −½ log(2πe) + E log|ε| (≈ −2.0541)."""

KL_ROUTES = ("approx", "mc")


def log_alpha(q: Normal) -> torch.Tensor:
    """log α = log σ² − log θ² of a Gaussian posterior (θ = 0 gives a large finite value, zero gradient in θ)."""
    theta, sigma = q.loc, q.scale
    tiny = torch.finfo(theta.dtype).tiny
    return 2 * torch.log(sigma) - torch.log(theta * theta + tiny)


def kl_approx(log_alpha: torch.Tensor) -> torch.Tensor:
    """The published approximation of KL(N(θ, αθ²) ‖ log-uniform), zero as α → ∞.

    .. math::
        KL(\\alpha) \\approx k_1 - k_1\\,\\mathrm{sigmoid}(k_2 + k_3\\log\\alpha)
            + \\tfrac12\\log(1 + e^{-\\log\\alpha})

    Example:
        >>> import torch, mcgraph as mg
        >>> [round(v, 4) for v in mg.nn.sparse_vd.kl_approx(torch.tensor([-8.0, 0.0, 8.0])).tolist()]
        [4.6359, 0.4312, 0.0002]
    """
    return K1 - K1 * torch.sigmoid(K2 + K3 * log_alpha) + 0.5 * torch.nn.functional.softplus(-log_alpha)


def kl_log_uniform(q: Normal, num_samples: int, *, seed: int | None = None, method: str = "auto") -> torch.Tensor:
    """mcgraph's ``num_samples``-sample estimate of the KL of :func:`kl_approx`, same constant (→ 0 as α → ∞).

    ``mg.kl_divergence(N(θ, σ), LogUniform())`` − :data:`C_INF`: the entropy in closed form and
    E_q[log|w|] by the engine (fused tier: one pass, O(P) saved tensors for any M).

    Example:
        >>> import torch, mcgraph as mg
        >>> q = torch.distributions.Normal(torch.ones(3), torch.tensor([0.1, 1.0, 10.0]))
        >>> est = mg.nn.sparse_vd.kl_log_uniform(q, 200_000, seed=0)
        >>> ref = mg.nn.sparse_vd.kl_approx(mg.nn.sparse_vd.log_alpha(q))
        >>> bool((est - ref).abs().max() < 0.02)
        True
    """
    base = Normal(q.loc, q.scale, validate_args=False)
    return kl_divergence(base, LogUniform(), num_samples, seed=seed, method=method) - C_INF


class SparseVDNormal(Normal):
    """The Gaussian posterior of a sparse-VD weight: ``Normal(θ, σ)`` that knows its KL route.

    Sampling, entropy and the engine's families are those of ``Normal``; only the layer KL
    against a log-uniform prior differs (see the module docstring).

    Args:
        loc: θ.
        scale: σ.
        kl: ``"approx"`` or ``"mc"``.
    """

    def __init__(self, loc, scale, kl: str = "approx", validate_args=None) -> None:
        super().__init__(loc, scale, validate_args=validate_args)
        self.kl_route = kl

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(SparseVDNormal, _instance)
        new = super().expand(batch_shape, _instance=new)
        new.kl_route = self.kl_route
        return new

    @property
    def log_alpha(self) -> torch.Tensor:
        """log α = log σ² − log θ²."""
        return log_alpha(self)


@dataclass(frozen=True)
class SparseVD:
    """The ``"sparse_vd"`` posterior family: ``SparseVD(kl)(θ, σ) -> SparseVDNormal``.

    Args:
        kl: the KL route against the log-uniform prior: ``"approx"`` (published fit) or ``"mc"``
            (the engine's many-sample estimate with the layer's ``kl_samples``).

    Raises:
        ValueError: an unknown ``kl`` route.
    """

    kl: str = "approx"

    #: What a layer with this posterior uses when the caller leaves the option at None.
    layer_defaults = {"prior": "log_uniform", "local_reparameterization": True, "rho_init": -10.0,
                      "scale_transform": "exp_half"}

    def __post_init__(self):
        if self.kl not in KL_ROUTES:
            raise ValueError(f"kl must be one of {KL_ROUTES}, got {self.kl!r}")

    @property
    def __name__(self) -> str:
        return "sparse_vd" if self.kl == "approx" else f"sparse_vd(kl={self.kl})"

    def __call__(self, loc: torch.Tensor, scale: torch.Tensor) -> SparseVDNormal:
        return SparseVDNormal(loc, scale, kl=self.kl)

    def check_prior(self, prior: Distribution) -> None:
        """Refuse a prior without a sparsifying KL rule for this posterior (e.g. ``"normal"``).

        Raises:
            ValueError: naming the prior and the usable ones.
        """
        rule = find_layer_kl(SparseVDNormal, type(prior))
        if rule is None or not rule.sparsifying:
            raise ValueError(f"prior: posterior='sparse_vd' needs a sparsifying prior ('log_uniform' or 'ard'), "
                             f"got {type(prior).__name__}")


register_posterior("sparse_vd")(SparseVD())


@register_layer_kl(SparseVDNormal, LogUniform, sparsifying=True)
def _sparse_vd_log_uniform(q: SparseVDNormal, p, num_samples: int, seed: int, method: str) -> torch.Tensor:
    if q.kl_route == "mc":
        return kl_log_uniform(q, num_samples, seed=seed, method=method)
    return kl_approx(log_alpha(q))
