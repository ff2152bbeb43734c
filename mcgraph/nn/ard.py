"""Automatic relevance determination: ``prior="ard"``, a Normal prior with one precision per weight.

.. math::
    p(w_{ij} \\mid \\tau_{ij}) = \\mathcal N(0, \\tau_{ij}^{-1}), \\qquad
    KL = -\\log\\sigma - \\tfrac12\\log\\tau + \\tfrac12\\tau(\\mu^2 + \\sigma^2) - \\tfrac12 .

The precisions are optimised in closed form (empirical Bayes): τ* = 1 / (μ² + σ²), so

.. math::
    KL(q \\,\\|\\, p_{\\tau^*}) = \\tfrac12\\log\\big(1 + \\mu^2/\\sigma^2\\big) = \\tfrac12\\log(1 + \\alpha^{-1}),

which, like sparse variational dropout, pushes log α → ∞ on irrelevant weights
(:func:`mcgraph.nn.prune`). The gradient in (μ, σ) equals that of the KL at fixed τ = τ*
(τ* is a stationary point). Works with any Gaussian posterior (``"normal"``, ``"sparse_vd"``).

Example:
    >>> import torch, mcgraph as mg
    >>> net = mg.nn.bayesify(torch.nn.Linear(4, 3), posterior="sparse_vd", prior="ard")
    >>> q = net.posterior
    >>> bool(torch.allclose(mg.nn.ard_precision(q), 1 / (q.loc ** 2 + q.scale ** 2)))
    True
    >>> mg.nn.kl(net).shape
    torch.Size([])
"""

from __future__ import annotations

import torch
from torch.distributions import Distribution, Normal, constraints

from .layer_kl import register_layer_kl
from .priors import register_prior

__all__ = ["ARDPrior", "ard_precision", "ard_kl"]


def ard_precision(q: Normal) -> torch.Tensor:
    """τ* = 1 / (μ² + σ²), the KL-minimising precision of each weight's prior."""
    return 1.0 / (q.loc * q.loc + q.scale * q.scale)


def ard_kl(q: Normal) -> torch.Tensor:
    """½ log(1 + μ²/σ²) elementwise: KL(q ‖ N(0, 1/τ*))."""
    return 0.5 * torch.log1p(q.loc * q.loc / (q.scale * q.scale))


class ARDPrior(Distribution):
    """The ARD prior N(0, 1/τ) with τ at its closed-form optimum for the posterior it is paired with.

    It has no density of its own (τ depends on q): :meth:`optimal` gives the Normal prior for a
    given posterior, and a Bayesian layer's KL uses :func:`ard_kl`.

    Args:
        shape: batch shape (scalar by default: broadcast to the weight).
    """

    arg_constraints: dict = {}
    support = constraints.real
    has_rsample = False
    #: The prior is a function of the posterior it is paired with (no density of its own).
    posterior_dependent = True

    def __init__(self, shape=(), validate_args=None) -> None:
        super().__init__(torch.Size(shape), validate_args=validate_args)

    def optimal(self, q: Normal) -> Normal:
        """N(0, 1/τ*) for the posterior ``q`` (τ* detached: the prior the KL is evaluated at)."""
        tau = ard_precision(q).detach()
        return Normal(torch.zeros_like(tau), tau.rsqrt())

    def check_posterior(self, q: Distribution) -> None:
        """Refuse a posterior without a registered ARD KL (ARD's closed form needs a Gaussian q).

        Raises:
            ValueError: naming the posterior.
        """
        from .layer_kl import find_layer_kl

        if find_layer_kl(type(q), ARDPrior) is None:
            raise ValueError(f"prior: 'ard' needs a Gaussian posterior ('normal' or 'sparse_vd'), "
                             f"got {type(q).__name__}")

    def log_prob(self, value):
        raise NotImplementedError("ARDPrior's precision depends on the posterior: use ARDPrior.optimal(q).log_prob")


@register_prior("ard")
def _ard_prior(like):
    """N(0, 1/τ) with one precision per weight, τ = τ* = 1/(μ² + σ²) (closed-form empirical Bayes)."""
    return ARDPrior()


@register_layer_kl(Normal, ARDPrior, sparsifying=True)
def _normal_ard(q: Normal, p: ARDPrior, num_samples: int, seed: int, method: str) -> torch.Tensor:
    return ard_kl(q)
