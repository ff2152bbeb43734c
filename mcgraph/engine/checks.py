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

import torch

__all__ = ["positive_int", "seed", "finite_float", "all_finite", "SEED_LIMIT"]

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


def all_finite(tensors) -> bool:
    """Whether every element of every tensor in ``tensors`` is finite (integer and bool tensors are).

    A tensor's minimum and maximum are finite exactly when all its elements are (the reduction
    propagates NaN and keeps ±inf), so one ``aminmax`` pass per tensor decides it, with one host
    synchronisation per device. On a CPU that is about 20× faster than ``torch.isfinite(t).all()``,
    which writes a boolean tensor of ``t``'s size first.

    Example:
        >>> all_finite([torch.ones(3), torch.tensor([1.0, float("nan")])])
        False
    """
    flags: dict = {}
    for t in tensors:
        if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
            continue
        t = t.detach()
        if t.is_complex():
            t = torch.view_as_real(t)
        flags.setdefault(t.device, []).append(torch.isfinite(torch.stack(torch.aminmax(t))).all())
    return all(bool(torch.stack(fs).all()) for fs in flags.values())
