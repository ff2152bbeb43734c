"""Keeping a retired spelling working for a while: a distribution that may still be called.

A Bayesian layer's posterior and prior are both properties (``layer.posterior``,
``layer.prior``). The posterior used to be a method, ``layer.posterior()``; that call
still works, with a ``DeprecationWarning``, because the property returns the distribution
as an instance of a subclass of its own class that adds only ``__call__`` (returning the
distribution itself). The subclass keeps the class name, the MRO (so family, KL and
``isinstance`` lookups are unchanged) and the instance's attributes.
"""

from __future__ import annotations

import types
import warnings

from torch.distributions import Distribution

__all__ = ["callable_distribution"]

_TYPES: dict[type, type] = {}


def _callable_type(cls: type) -> type:
    found = _TYPES.get(cls)
    if found is not None:
        return found

    def __call__(self):
        warnings.warn(f"{self._retired_call}() is deprecated: it is a property now (like the prior); "
                      f"write {self._retired_call} without the call", DeprecationWarning, stacklevel=2)
        return self

    def body(ns):
        ns.update({"__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                   "__doc__": cls.__doc__})

    found = types.new_class(cls.__name__, (cls,), exec_body=body)
    _TYPES[cls] = found
    return found


def callable_distribution(dist: Distribution | None, spelling: str) -> Distribution | None:
    """``dist`` (same object, same class name and behaviour) that may also be called as ``spelling()``."""
    if dist is None or type(dist) in _TYPES.values():
        return dist
    dist.__class__ = _callable_type(type(dist))
    dist._retired_call = spelling
    return dist
