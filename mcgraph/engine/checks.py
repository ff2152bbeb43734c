"""Argument checks shared by every public entry point.

One rule everywhere: a wrong *type* raises :class:`TypeError`, a wrong *value* raises
:class:`ValueError`, and the message names the argument as the caller wrote it (``name``),
says what was expected and shows what was given.

Example:
    >>> from mcgraph.engine import checks
    >>> checks.positive_int("num_samples", 1000)
    1000
    >>> checks.positive_int("num_samples", 2.5)
    Traceback (most recent call last):
    ...
    TypeError: num_samples must be an int, got float (2.5)
    >>> checks.seed("seed", 2**64 + 1)
    Traceback (most recent call last):
    ...
    ValueError: seed must be in [0, 2**64), got 18446744073709551617
"""

from __future__ import annotations

import math
import numbers
from typing import Iterable, Sequence

import torch

__all__ = ["positive_int", "seed", "finite_float", "tensor", "choice", "SEED_LIMIT"]

#: Seeds are 64-bit: the counter-based streams take the seed's 64 bits as their key.
SEED_LIMIT = 2**64


def _is_int(value) -> bool:
    # Python and numpy integers; not bool, and not tensors (a count or a seed held in a tensor would
    # cost a host sync per call and usually means a mistake)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(name: str, value, *, allow_none: bool = False, minimum: int = 1) -> int | None:
    """``value`` as an ``int`` ≥ ``minimum`` (``None`` passes through when ``allow_none``)."""
    if value is None and allow_none:
        return None
    if not _is_int(value):
        expected = "an int" + (" or None" if allow_none else "")
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} ({value!r})")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def seed(name: str, value, *, allow_none: bool = True) -> int | None:
    """A seed: ``None`` (when allowed) or an int in ``[0, 2**64)``; larger ints would wrap silently."""
    if value is None and allow_none:
        return None
    if not _is_int(value):
        raise TypeError(f"{name} must be an int{' or None' if allow_none else ''}, got {type(value).__name__}"
                        f" ({value!r})")
    value = int(value)
    if not 0 <= value < SEED_LIMIT:
        raise ValueError(f"{name} must be in [0, 2**64), got {value}")
    return value


def finite_float(name: str, value, *, low: float | None = None, low_open: bool = False,
                 high: float | None = None) -> float:
    """``value`` as a finite ``float`` within ``[low, high]`` (``(low, high]`` when ``low_open``)."""
    if isinstance(value, bool) or not (isinstance(value, numbers.Real)
                                       or (isinstance(value, torch.Tensor) and value.ndim == 0)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low:g}, got {value:g}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high:g}, got {value:g}")
    return value


def tensor(name: str, value, *, ndim: int | Sequence[int] | None = None, min_ndim: int | None = None,
           floating: bool | None = None, shape_hint: str = "") -> torch.Tensor:
    """``value`` if it is a tensor of the given rank (and kind); ``shape_hint`` describes the shape expected."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' ' + shape_hint if shape_hint else ''}, got "
                        f"{type(value).__name__}")
    ranks = (ndim,) if isinstance(ndim, int) else tuple(ndim) if ndim is not None else None
    if ranks is not None and value.ndim not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise ValueError(f"{name} must have {want} dimension{'s' if ranks != (1,) else ''}"
                         f"{' ' + shape_hint if shape_hint else ''}, got shape {tuple(value.shape)}")
    if min_ndim is not None and value.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions{' ' + shape_hint if shape_hint else ''}, "
                         f"got shape {tuple(value.shape)}")
    if floating is True and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if floating is False and value.is_floating_point():
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    return value


def choice(name: str, value, choices: Iterable):
    """``value`` if it is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")
    return value
