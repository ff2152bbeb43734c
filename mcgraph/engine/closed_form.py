"""Closed-form KL: torch's registered rule for a (q, p) pair, where one exists.

The KL functions (:func:`mcgraph.kl_divergence` and everything built on it) take the exact
KL by default wherever one exists, as Pyro's ``TraceMeanField_ELBO`` does:

1. torch's registry (``torch.distributions.kl.register_kl``: Normal ‖ Normal, Laplace ‖ Normal,
   Independent pairs, …), the most specific pair by MRO, when q and p have the same event shape
   (the engine's convention sums p's log-density over q's extra event dimensions; torch's rules
   do not);
2. otherwise the engine: closed-form entropy, E_q[log p] with its polynomial terms exact
   (the analytic tier) and the other terms sampled.

A rule registered by :func:`mcgraph.interop.pyro.register_mc_kl` is itself a Monte Carlo
estimate that calls the engine; it carries the attribute :data:`MONTE_CARLO_RULE` and is not
taken for a closed form (else the engine would call itself).

Example:
    >>> import torch
    >>> q = torch.distributions.Normal(torch.zeros(2), torch.ones(2))
    >>> closed_form_kl(q, torch.distributions.Normal(0.0, 2.0))     # log 2 + 1/8 − 1/2
    tensor([0.3181, 0.3181])
    >>> closed_form_kl(q, torch.distributions.StudentT(3.0)) is None
    True
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributions import Distribution
from torch.distributions.kl import _KL_MEMOIZE, _dispatch_kl  # torch's own lookup; no public query exists

__all__ = ["MONTE_CARLO_RULE", "registered_kl", "kl_rule", "closed_form_kl"]

#: Attribute set (to ``True``) on a function registered with torch's KL registry that estimates
#: the KL by Monte Carlo through the engine: never taken as a closed form.
MONTE_CARLO_RULE = "__mcgraph_monte_carlo__"


def registered_kl(q_type: type, p_type: type) -> Callable | object:
    """torch's registered KL function for ``(q_type, p_type)``, the most specific pair by MRO, or
    ``NotImplemented``: ``_dispatch_kl`` through torch's memo, as ``torch.distributions.kl_divergence``
    looks it up (``register_kl`` clears the memo). ``_dispatch_kl`` alone walks the whole registry:
    about 20 µs a call."""
    key = (q_type, p_type)
    try:
        return _KL_MEMOIZE[key]
    except KeyError:
        fn = _KL_MEMOIZE[key] = _dispatch_kl(q_type, p_type)
        return fn


def kl_rule(q: Distribution, p: Distribution) -> Callable | None:
    """torch's registered KL rule for ``(type(q), type(p))``, or ``None`` where there is none (or where
    q and p differ in event shape, or the rule is a registered Monte Carlo estimate)."""
    if q.event_shape != p.event_shape:
        return None
    fn = registered_kl(type(q), type(p))
    if fn is NotImplemented or getattr(fn, MONTE_CARLO_RULE, False):
        return None
    return fn


def closed_form_kl(q: Distribution, p: Distribution) -> torch.Tensor | None:
    """KL(q ‖ p) by torch's registered rule (shape: q's and p's batch shapes broadcast), or ``None``.

    A rule that declines the pair at run time (``NotImplementedError``, e.g. ``Independent`` pairs
    that reinterpret different numbers of dimensions) counts as no rule.
    """
    rule = kl_rule(q, p)
    if rule is None:
        return None
    try:
        return rule(q, p)
    except NotImplementedError:
        return None
