"""The vocabulary of ``method=``, one for the engine, ``mg.nn`` and ``mcgraph.interop``.

``method`` takes a :class:`Method` or its string value, everywhere:

========================  ===============================================================
``auto``                  the default. ``mg.expectation``: the cheapest sampling tier per term
                          (collapsed, fused, chunked). The KL functions (``mg.kl_divergence``,
                          ``mg.nn.kl``, the layers', ``mcgraph.interop``'s): exact where exact
                          exists: torch's registered closed form for the (q, p) pair, else
                          E_q[log p] with its polynomial terms exact (``auto-analytic``) and the
                          other terms sampled, as Pyro's ``TraceMeanField_ELBO`` does
``monte-carlo``           sampled, never exact: the cheapest sampling tier per term (what ``auto``
                          is for ``mg.expectation``; asks the KL functions for an M-sample estimate)
``collapsed``             forced: noise statistics, then one small graph
``collapsed-exact``       forced: statistics drawn from their exact laws (same law, other numbers)
``fused``                 forced: sampling, evaluation and reduction in one pass
``chunked``               forced: chunks replayed on backward
``direct``                the naive graph over every sample (the reference for comparisons)
``analytic``              exact expectations from the noise law's moments (no sampling)
``auto-analytic``         ``analytic`` where the moments allow, ``auto`` elsewhere
``closed-form``           torch's registered ``kl_divergence`` rule, required (KL functions only)
========================  ===============================================================

Example:
    >>> import mcgraph as mg
    >>> mg.Method("collapsed-exact") is mg.Method.COLLAPSED_EXACT
    True
    >>> parse_method("colapsed")
    Traceback (most recent call last):
    ...
    ValueError: method must be one of 'auto', 'monte-carlo', 'collapsed', 'collapsed-exact', 'fused', 'chunked', 'direct', 'analytic', 'auto-analytic'; got 'colapsed'
"""

from __future__ import annotations

import enum
import functools
from typing import Iterable

__all__ = ["Method", "ENGINE_METHODS", "KL_METHODS", "parse_method"]


class Method(str, enum.Enum):
    """A value of ``method=`` (compares equal to its string)."""

    AUTO = "auto"
    MONTE_CARLO = "monte-carlo"
    COLLAPSED = "collapsed"
    COLLAPSED_EXACT = "collapsed-exact"
    FUSED = "fused"
    CHUNKED = "chunked"
    DIRECT = "direct"
    ANALYTIC = "analytic"
    AUTO_ANALYTIC = "auto-analytic"
    CLOSED_FORM = "closed-form"

    def __str__(self) -> str:
        return self.value


#: What ``mg.expectation`` takes (every method but ``closed-form``, which only a KL has).
ENGINE_METHODS = tuple(m for m in Method if m is not Method.CLOSED_FORM)
#: What the KL functions take (``mg.kl_divergence``, ``mg.nn.kl``, ``mcgraph.interop.kl``): ``auto`` is
#: exact where exact exists there (see the table above).
KL_METHODS = (Method.AUTO, Method.CLOSED_FORM) + tuple(m for m in ENGINE_METHODS if m is not Method.AUTO)


@functools.lru_cache(maxsize=None)
def _values(allowed: tuple) -> frozenset:
    return frozenset(m.value for m in allowed)


def parse_method(value, allowed: Iterable[Method] = ENGINE_METHODS, name: str = "method") -> str:
    """The string value of ``value`` (a :class:`Method` or a string) if it is among ``allowed``."""
    allowed = tuple(allowed)
    if isinstance(value, Method):
        value = value.value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str or mcgraph.Method, got {type(value).__name__}")
    if value not in _values(allowed):
        raise ValueError(f"{name} must be one of {', '.join(repr(m.value) for m in allowed)}; got {value!r}")
    return value
