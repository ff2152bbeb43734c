"""The algebra of traced expressions: sums of pieces, elementwise parts and their polynomials.

An :class:`Expr` is a sum of :class:`Piece` objects, each an :class:`Elementwise` function of ``w``
(a polynomial ``Σ c_m ⊙ w^a (log w)^b`` plus programs of :mod:`.ir`) followed by a chain of
linear maps. Polynomials are dicts ``{(a, b): c}``; the functions below add, scale and multiply
them, with coefficients that are Python numbers or tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ir import Node, PolyNode, SumNode


@dataclass
class Elementwise:
    """``Σ c_m ⊙ m(w) + Σ programs(w)``: an elementwise function of w."""

    poly: dict = field(default_factory=dict)
    programs: tuple = ()

    def node(self) -> Node:
        parts = ([PolyNode(dict(self.poly))] if self.poly else []) + list(self.programs)
        if not parts:
            return PolyNode({(0, 0): 0.0})
        return parts[0] if len(parts) == 1 else SumNode(tuple(parts))

    def is_poly(self) -> bool:
        return not self.programs


@dataclass
class Piece:
    """``chain(E)``: an elementwise expression followed by linear maps applied after E."""

    expr: Elementwise
    chain: tuple = ()  # callables x -> linear map of x

    def apply_chain(self, x: torch.Tensor) -> torch.Tensor:
        for f in self.chain:
            x = f(x)
        return x


@dataclass
class Expr:
    """Sum of pieces. ``elementwise`` when it is one piece with no chain."""

    pieces: tuple

    @property
    def elementwise(self) -> Elementwise | None:
        if len(self.pieces) == 1 and not self.pieces[0].chain:
            return self.pieces[0].expr
        return None

    @staticmethod
    def of(e: Elementwise) -> "Expr":
        return Expr((Piece(e),))


VAR = Expr.of(Elementwise({(1, 0): 1.0}))


def const_expr(c) -> Expr:
    return Expr.of(Elementwise({(0, 0): c}))


# --------------------------------------------------------------------------- polynomials


def add_poly(p: dict, q: dict) -> dict:
    out = dict(p)
    for m, c in q.items():
        out[m] = out[m] + c if m in out else c
    return out


def scale_poly(p: dict, c) -> dict:
    return {m: v * c for m, v in p.items()}


def mul_poly(p: dict, q: dict) -> dict:
    out: dict = {}
    for (a1, b1), c1 in p.items():
        for (a2, b2), c2 in q.items():
            m = (a1 + a2, b1 + b2)
            v = c1 * c2
            out[m] = out[m] + v if m in out else v
    return out


def is_int(x) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return True
    if isinstance(x, float):
        return x.is_integer()
    return False


def positive_const(c) -> bool:
    if isinstance(c, (int, float)):
        return c > 0
    if isinstance(c, torch.Tensor):
        return bool((c.detach() > 0).all())
    return False


def scalar_int(c):
    """``c`` as a python int when it is an integral scalar constant without grad, else None."""
    if is_int(c):
        return int(c)
    if isinstance(c, torch.Tensor) and not c.requires_grad:
        vals = c.detach().unique() if c.numel() > 1 else c.detach().reshape(-1)
        if vals.numel() == 1 and float(vals[0]).is_integer():
            return int(vals[0])
    return None
