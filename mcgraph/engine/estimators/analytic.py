"""Analytic tier: the exact expectation of a polynomial term (M = ∞ for the price of M = 1).

A collapsed term is ``G(n(θ) ∘ t̄)`` with ``t̄`` sample means of noise statistics
(:mod:`mcgraph.engine.estimators.collapsed`). Replacing each sample mean by its expectation,

.. math::
    E\\Big[\\sum_k c_k u^k\\Big] = \\sum_k c_k \\sum_{j\\le k} \\binom{k}{j} \\mu^{k-j}\\sigma^j\\,E[\\xi^j],
    \\qquad
    E[u^a (\\log u)^b] = \\theta^a \\sum_{j\\le b} \\binom{b}{j} (\\log\\theta)^{b-j} E[\\xi^a (\\log\\xi)^j],

gives the expectation itself: the same small graph as the collapsed tier, no noise
drawn, so its size and its cost do not depend on M. The moments come from the
noise law (:mod:`mcgraph.engine.noise.moments`); the classifier refuses (with the reason) the
terms whose moments are unknown or infinite.
"""

from __future__ import annotations

import torch

from ..plan.families import SamplingForm
from ..noise.moments import exact_statistic


def analytic_statistics(form: SamplingForm, keys) -> dict:
    """``{(a, j): E[ξ^a (log ξ)^j]}`` in ``form``'s dtype and device (computed in float64).

    Raises:
        NoExactMoment: a statistic has no exact form (the classifier checks first).
    """
    out = {(0, 0): torch.ones((), dtype=form.dtype, device=form.device)}
    for key in keys:
        if key == (0, 0):
            continue
        value = exact_statistic(form.noise.moments, key, tuple(form.noise_shape))
        out[key] = value.to(dtype=form.dtype, device=form.device)
    return out
