"""One registry class under every registry of the package.

A :class:`Registry` is a ``dict`` (so ``PRIORS["laplace"]``, ``"normal" in POSTERIORS`` and
``sorted(MODELS)`` work as before) with

* :meth:`~Registry.register`, usable as a decorator (``@REG.register(key)``) or a call
  (``REG.register(key, value)``); a key is checked by the registry's ``check`` when given, and a
  ``unique`` registry refuses a second registration of a key;
* :meth:`~Registry.lookup`: the exact key for a registry of names, and for a registry of types
  (``by_type=True``; keys are classes or tuples of classes) the **most specific** registered key
  by method-resolution order — the sum of the classes' positions in the looked-up classes' MROs,
  like ``torch.distributions.kl.register_kl``. Results are memoised (the memo is cleared on every
  change); two equally specific keys warn once, naming both, and the first registered wins.
  A miss raises ``KeyError`` naming what was looked up and what is registered, or returns
  ``default`` when one is given.

Example:
    >>> import torch
    >>> from mcgraph.registry import Registry
    >>> RULES = Registry("layer KL rule", by_type=True)
    >>> @RULES.register((torch.distributions.Normal, torch.distributions.Distribution))
    ... def normal_anything(q, p): ...
    >>> RULES.lookup((torch.distributions.Normal, torch.distributions.Laplace)) is normal_anything
    True
    >>> RULES.lookup((torch.distributions.Laplace, torch.distributions.Laplace))
    Traceback (most recent call last):
    ...
    KeyError: 'no layer KL rule is registered for (Laplace, Laplace); registered: (Normal, Distribution)'
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Generic, Hashable, TypeVar

__all__ = ["Registry", "AmbiguousRegistration"]

V = TypeVar("V")
_MISSING = object()


class AmbiguousRegistration(UserWarning):
    """Two registered type keys are equally specific for a lookup."""


def _name(key) -> str:
    if isinstance(key, tuple):
        return "(" + ", ".join(_name(k) for k in key) + ")"
    return key.__name__ if isinstance(key, type) else repr(key)


class Registry(dict, Generic[V]):
    """A named mapping ``key -> value`` with decorator registration and MRO lookup (see the module)."""

    def __init__(self, what: str, *, by_type: bool = False, check: Callable[[Any], None] | None = None,
                 unique: bool = False):
        super().__init__()
        self.what = what
        self.by_type = by_type
        self.check = check
        self.unique = unique
        self._memo: dict = {}
        self._warned: set = set()
        #: Bumped by every change: what was derived from the registry's contents is stale when it moved.
        self.generation = 0

    # ---------------------------------------------------------------- registration

    def register(self, key: Hashable, value: V | object = _MISSING):
        """``register(key, value)`` stores and returns ``value``; ``register(key)`` is a decorator."""
        if self.by_type:
            for t in key if isinstance(key, tuple) else (key,):
                if not isinstance(t, type):
                    raise TypeError(f"{self.what}: keys must be classes (or tuples of classes), got {t!r}")
        if self.check is not None:
            self.check(key)
        if self.unique and dict.__contains__(self, key):
            raise ValueError(f"{self.what} {_name(key)} is already registered (to {dict.__getitem__(self, key)!r})")
        if value is _MISSING:
            def decorator(v: V) -> V:
                self[key] = v
                return v

            return decorator
        self[key] = value
        return value

    # ---------------------------------------------------------------- lookup

    def lookup(self, key: Hashable, default: Any = _MISSING) -> V:
        """The value for ``key`` (the most specific registered classes when ``by_type``)."""
        try:
            found = self._memo[key]
        except KeyError:
            found = self._memo[key] = self._find(key)
        except TypeError:  # an unhashable key cannot be registered either
            found = _MISSING
        if found is _MISSING:
            if default is not _MISSING:
                return default
            known = ", ".join(_name(k) for k in self) or "nothing"
            raise KeyError(f"no {self.what} is registered for {_name(key)}; registered: {known}")
        return found

    def _find(self, key):
        if not self.by_type:
            return dict.get(self, key, _MISSING)
        wanted = key if isinstance(key, tuple) else (key,)
        best, best_rank, tied = _MISSING, None, None
        for registered, value in self.items():
            have = registered if isinstance(registered, tuple) else (registered,)
            if len(have) != len(wanted) or not all(issubclass(w, h) for w, h in zip(wanted, have)):
                continue
            rank = sum(w.__mro__.index(h) for w, h in zip(wanted, have))
            if best_rank is None or rank < best_rank:
                best, best_rank, tied = value, rank, None
            elif rank == best_rank and tied is None:
                tied = registered
        if tied is not None and key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"{self.what}: two registrations are equally specific for {_name(key)} (one of them "
                          f"{_name(tied)}); the first registered is used. Register {_name(key)} itself to decide.",
                          AmbiguousRegistration, stacklevel=3)
        return best

    def registered(self) -> tuple:
        """The registered keys, in registration order."""
        return tuple(self)

    def __contains__(self, key) -> bool:
        if dict.__contains__(self, key):
            return True
        return self.by_type and self.lookup(key, None) is not None

    # ---------------------------------------------------------------- every change clears the memo

    def _changed(self):
        self.generation += 1
        self._memo.clear()
        self._warned.clear()

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._changed()

    def pop(self, *args):
        out = super().pop(*args)
        self._changed()
        return out

    def popitem(self):
        out = super().popitem()
        self._changed()
        return out

    def clear(self):
        super().clear()
        self._changed()

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self._changed()

    def setdefault(self, key, default=None):
        out = super().setdefault(key, default)
        self._changed()
        return out

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(_name(k) for k in self)})"
