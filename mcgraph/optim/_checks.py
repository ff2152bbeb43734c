"""Argument checks shared by the optimizers (errors name the argument, its value and what was expected)."""

from __future__ import annotations

import enum
import math
import numbers

__all__ = ["positive_int", "positive_real", "real_in", "non_negative_real", "choice", "seed_or_none"]


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite real number, got {value!r}")
    return float(value)


def positive_real(name: str, value) -> float:
    v = _real(name, value)
    if v <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return v


def non_negative_real(name: str, value) -> float:
    v = _real(name, value)
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return v


def real_in(name: str, value, low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> float:
    """``value`` in ``[low, high]`` (ends excluded where ``*_open``)."""
    v = _real(name, value)
    if v < low or v > high or (low_open and v == low) or (high_open and v == high):
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be in {lo}{low}, {high}{hi}, got {value!r}")
    return v


def choice(name: str, value, options: type[enum.Enum]) -> str:
    """The string of ``options``' member ``value`` (a member or its string)."""
    try:
        return options(value).value
    except ValueError:
        raise ValueError(f"{name} must be one of {sorted(o.value for o in options)}, got {value!r}") from None


def seed_or_none(name: str, value) -> int | None:
    """``None`` or an int in ``[0, 2**64)`` (a noise seed)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < 2 ** 64:
        raise ValueError(f"{name} must be None or an int in [0, 2**64), got {value!r}")
    return int(value)
