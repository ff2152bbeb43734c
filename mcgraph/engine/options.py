"""Sampling options bound once: :class:`Sampling`.

Every entry point that draws Monte Carlo samples (``mg.expectation``, ``mg.kl_divergence``,
``mg.nn.kl``, ``mg.nn.elbo``'s two terms, ``mg.nn.predict``) takes its sample count either as an
``int`` with keyword options beside it (the simple call stays simple) or as one
:class:`Sampling` that carries them all, validated once when it is made, the way Pyro's ELBO
objects bind ``num_particles``:

>>> import torch, mcgraph as mg
>>> q = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
>>> p = torch.distributions.Laplace(0.0, 1.0)
>>> fast = mg.Sampling(1000, seed=0, method="fused")
>>> torch.equal(mg.kl_divergence(q, p, fast), mg.kl_divergence(q, p, 1000, seed=0, method="fused"))
True
>>> mg.kl_divergence(q, p, fast, seed=1)
Traceback (most recent call last):
...
TypeError: seed: given both in the Sampling passed as num_samples (0) and as a keyword (1); pass it in one place

A new sampling option is one field here; the entry points read it from the :class:`Sampling`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from . import checks
from .methods import Method

__all__ = ["Sampling", "resolve_sampling"]


@dataclass(frozen=True)
class Sampling:
    """How one expectation is sampled.

    Attributes:
        num_samples: M (``None``: the caller's default, e.g. each layer's ``kl_samples``).
        seed: the noise seed (``None``: drawn from torch's global generator per call).
        method: a :class:`~mcgraph.Method` or its string (the entry point says which it takes).
        chunk_size: samples per chunk (``None``: the tier's default).
        vectorize: ``mg.nn``: evaluate a chunk's samples in one forward (``None``: when no BatchNorm
            uses batch statistics).
        process_group: a ``torch.distributed`` group whose ranks split the M samples.
        return_stderr: also return the standard error (an :class:`~mcgraph.MCEstimate`).
    """

    num_samples: int | None = None
    seed: int | None = None
    method: str | Method | None = None
    chunk_size: int | None = None
    vectorize: bool | None = None
    process_group: Any = None
    return_stderr: bool = False

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "num_samples", checks.positive_int("num_samples", self.num_samples, allow_none=True))
        set_(self, "seed", checks.seed("seed", self.seed))
        set_(self, "chunk_size", checks.positive_int("chunk_size", self.chunk_size, allow_none=True))
        if isinstance(self.method, Method):
            set_(self, "method", self.method.value)
        elif self.method is not None and not isinstance(self.method, str):
            raise TypeError(f"method must be a str or mcgraph.Method, got {type(self.method).__name__}")
        for name in ("return_stderr",):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.vectorize is not None and not isinstance(self.vectorize, bool):
            raise TypeError(f"vectorize must be a bool or None, got {type(self.vectorize).__name__}")

    def replace(self, **changes) -> "Sampling":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


def resolve_sampling(num_samples, **given) -> tuple[Any, dict]:
    """``(num_samples, options)`` from an entry point's arguments.

    ``num_samples`` is an ``int`` (or ``None``) with the options as keywords, or a :class:`Sampling`;
    ``given`` maps each option the entry point has to ``(value, default)``. With a :class:`Sampling`,
    an option also given as a non-default keyword is refused (one place for each option), and so is an
    option the entry point does not take (never silently ignored); an option the :class:`Sampling`
    leaves at ``None`` / its default takes the keyword's value.
    """
    if not isinstance(num_samples, Sampling):
        return num_samples, {k: v for k, (v, _) in given.items()}
    unused = [name for name, f in Sampling.__dataclass_fields__.items()
              if name != "num_samples" and name not in given and getattr(num_samples, name) != f.default]
    if unused:
        raise TypeError(f"num_samples: this call does not use the Sampling's {', '.join(unused)} "
                        f"(it takes {', '.join(sorted(given)) or 'only the number of samples'}); leave "
                        f"{'them' if len(unused) > 1 else 'it'} unset")
    out = {}
    for name, (value, default) in given.items():
        bound = getattr(num_samples, name)
        field_default = Sampling.__dataclass_fields__[name].default
        keyword_set = value is not default and value != default
        if keyword_set and bound != field_default:
            raise TypeError(f"{name}: given both in the Sampling passed as num_samples ({bound!r}) and as a keyword "
                            f"({value!r}); pass it in one place")
        out[name] = bound if bound != field_default or not keyword_set else value
        if out[name] is None and default is not None and bound == field_default and not keyword_set:
            out[name] = default
    return num_samples.num_samples, out
