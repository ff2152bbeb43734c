"""How a Bayesian layer turns its posterior into a sampled output: the ``estimator=`` option.

=============================== ==================================================================
``"reparameterization"``        draw the weight, w = μ + σ ε, and apply it (every posterior family)
``"local_reparameterization"``  draw the pre-activation from its Gaussian moments (Kingma et al.,
                                2015; mean-field Gaussian posteriors)
``"flipout"``                   one weight perturbation decorrelated across the batch by random
                                signs (Wen et al., 2018; location-scale posteriors)
=============================== ==================================================================

``None`` takes the posterior family's default (``"local_reparameterization"`` for Sparse VD),
else ``"reparameterization"``. The booleans ``local_reparameterization=`` and ``flipout=``
are the older spelling of the same choice: still accepted, with a ``DeprecationWarning``, never
together with ``estimator=``.
"""

from __future__ import annotations

import enum
import sys
import warnings

__all__ = ["Estimator", "estimator_flags", "resolve_estimator"]


class Estimator(str, enum.Enum):
    """The output estimator of a Bayesian layer (see the module docstring)."""

    REPARAMETERIZATION = "reparameterization"
    LOCAL_REPARAMETERIZATION = "local_reparameterization"
    FLIPOUT = "flipout"

    def __str__(self) -> str:
        return self.value


def parse_estimator(estimator) -> Estimator | None:
    """``estimator`` as an :class:`Estimator` (``None`` stays ``None``), refused by name when unknown."""
    if estimator is None:
        return None
    try:
        return Estimator(estimator)
    except ValueError:
        raise ValueError(f"estimator must be one of {[e.value for e in Estimator]} or None, "
                         f"got {estimator!r}") from None


def user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside the package (the user's call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("mcgraph."):
        frame, level = frame.f_back, level + 1
    return level


def estimator_flags(estimator, local_reparameterization: bool | None = None,
                    flipout: bool | None = None) -> tuple[bool | None, bool]:
    """``(local_reparameterization, flipout)`` for a layer given ``estimator`` or the deprecated booleans.

    ``local_reparameterization`` is ``None`` when the choice is left to the posterior family.

    Raises:
        TypeError: ``estimator`` given together with a boolean.
        ValueError: an unknown ``estimator``.
    """
    legacy = local_reparameterization is not None or flipout not in (None, False)
    if legacy:
        if estimator is not None:
            raise TypeError("estimator: give estimator= alone (local_reparameterization= and flipout= are its "
                            "deprecated spellings)")
        warnings.warn("local_reparameterization= and flipout= are deprecated: use estimator='local_reparameterization', "
                      "'flipout' or 'reparameterization'", DeprecationWarning, stacklevel=user_stacklevel())
        if local_reparameterization and flipout:
            raise ValueError("local_reparameterization and flipout are alternatives; set at most one")
        return (None if local_reparameterization is None else bool(local_reparameterization)), bool(flipout)
    e = parse_estimator(estimator)
    if e is None:
        return None, False
    return e is Estimator.LOCAL_REPARAMETERIZATION, e is Estimator.FLIPOUT


def to_estimator(local_reparameterization: bool | None, flipout: bool | None) -> Estimator | None:
    """The :class:`Estimator` the booleans stand for (``None``: the posterior family's default)."""
    if flipout:
        return Estimator.FLIPOUT
    if local_reparameterization is None:
        return None
    return Estimator.LOCAL_REPARAMETERIZATION if local_reparameterization else Estimator.REPARAMETERIZATION


def resolve_estimator(estimator, local_reparameterization: bool | None = None,
                      flipout: bool | None = None) -> Estimator | None:
    """The ``estimator=`` a converter hands its layers: ``estimator``, or what the deprecated booleans
    stand for (with the warning of :func:`estimator_flags`); ``None`` leaves it to the posterior family."""
    return to_estimator(*estimator_flags(estimator, local_reparameterization, flipout))
