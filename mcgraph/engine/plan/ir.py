"""The intermediate representation of a traced integrand: elementwise programs over ``w``.

A program is a tree of :class:`Node` objects evaluated as ``node(w, subs)``: :class:`Var` (the
sample ``w``), :class:`PolyNode` (``Σ c·w^a (log w)^b``), :class:`Call` (one recorded torch call)
and :class:`SumNode`. ``subs`` maps ``id(tensor)`` of a constant the program closed over to the
tensor to use instead (the fused tier substitutes detached copies). The fused tier evaluates these
programs, the classifier formats them for ``explain``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

Monomial = tuple[int, int]  # (a, b): w**a * log(w)**b
Coef = Any  # python number or Tensor


class Node:
    """A node of an elementwise program, evaluated as ``node(w, subs)``."""

    def __call__(self, w: torch.Tensor, subs: dict[int, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def constants(self):
        return ()


@dataclass(eq=False)
class Var(Node):
    def __call__(self, w, subs):
        return w

    def __str__(self):
        return "w"


def _sub(value, subs):
    if isinstance(value, torch.Tensor):
        return subs.get(id(value), value)
    return value


def monomial(w: torch.Tensor, a: int, b: int, logw: torch.Tensor | None):
    """``(w^a (log w)^b, log w)``; the monomial is ``None`` for ``a = b = 0`` (the constant 1).

    ``logw`` is ``log w`` when a previous monomial computed it (else ``None``); it is returned,
    computed once, for the next.
    """
    term = w.pow(a) if a not in (0, 1) else (w if a == 1 else None)
    if b:
        logw = w.log() if logw is None else logw
        lt = logw if b == 1 else logw.pow(b)
        term = lt if term is None else term * lt
    return term, logw


def horner_degrees(poly: dict) -> int | None:
    """The degree K of ``poly`` when it is a polynomial in ``w`` alone (every ``(a, b)`` has ``b = 0``
    and ``a ≥ 0``) of degree at least 2, else ``None``: then :func:`horner` evaluates it."""
    if not poly or any(b or a < 0 for a, b in poly):
        return None
    degree = max(a for a, _ in poly)
    return degree if degree >= 2 else None


def horner(w: torch.Tensor, coefs: dict[int, Coef], degree: int) -> torch.Tensor:
    """``Σ_k coefs[k]·w^k`` (``0 ≤ k ≤ degree``, missing coefficients are 0) by Horner's rule.

    ``(0.125·w)³`` traces to ``0.00195·w³``: summed as powers, ``w³`` overflows float32 at
    ``|w| > 7e12`` although the value is finite up to ``|w| = 5.6e13``. Horner's partial results
    ``c_K·w^j`` (j ≤ K) never exceed the leading term's magnitude when ``|w| ≥ 1``, and never
    exceed ``|c_K|`` when ``|w| < 1``, so nothing overflows that the polynomial's terms would not.
    """
    out = coefs[degree]
    for k in range(degree - 1, -1, -1):
        out = out * w
        c = coefs.get(k)
        if c is not None:
            out = out + c
    return out


@dataclass(eq=False)
class PolyNode(Node):
    poly: dict

    def __call__(self, w, subs):
        degree = horner_degrees(self.poly)
        if degree is not None:
            return horner(w, {a: _sub(c, subs) for (a, _), c in self.poly.items()}, degree)
        out = None
        logw = None
        for (a, b), c in self.poly.items():
            term, logw = monomial(w, a, b, logw)
            c = _sub(c, subs)
            # A constant monomial (w / w = w^0) is still a tensor of w's shape: callers expand it.
            term = torch.zeros_like(w) + c if term is None else c * term
            out = term if out is None else out + term
        return out if out is not None else torch.zeros_like(w)

    def constants(self):
        return tuple(self.poly.values())

    def __str__(self):
        return format_poly(self.poly)


@dataclass(eq=False)
class Call(Node):
    func: Callable
    args: tuple
    kwargs: dict

    def __call__(self, w, subs):
        def ev(x):
            if isinstance(x, Node):
                return x(w, subs)
            return _sub(x, subs)

        return self.func(*tree_map(ev, self.args), **tree_map(ev, self.kwargs))

    def constants(self):
        # a program is not changed once traced, and a cached trace is evaluated on every call: once
        cached = self.__dict__.get("_constants")
        if cached is None:
            leaves, _ = tree_flatten((self.args, self.kwargs))
            out = []
            for x in leaves:
                out.extend(x.constants() if isinstance(x, Node) else [x])
            cached = self.__dict__["_constants"] = tuple(out)
        return cached

    def __str__(self):
        inner = ", ".join(str(a) if isinstance(a, Node) else _short(a) for a in self.args)
        return f"{func_name(self.func)}({inner})"


@dataclass(eq=False)
class SumNode(Node):
    parts: tuple

    def __call__(self, w, subs):
        out = self.parts[0](w, subs)
        for p in self.parts[1:]:
            out = out + p(w, subs)
        return out

    def constants(self):
        cached = self.__dict__.get("_constants")
        if cached is None:
            cached = self.__dict__["_constants"] = tuple(c for p in self.parts for c in p.constants())
        return cached

    def __str__(self):
        return " + ".join(str(p) for p in self.parts)


def _short(x) -> str:
    if isinstance(x, torch.Tensor):
        return "c" if x.numel() != 1 else f"{x.detach().reshape(()).item():.3g}"
    return repr(x)


def func_name(func) -> str:
    return getattr(func, "__name__", str(func)).strip("_")


def format_monomial(m: Monomial) -> str:
    a, b = m
    parts = []
    if a:
        parts.append("w" if a == 1 else f"w^{a}")
    if b:
        parts.append("log w" if b == 1 else f"(log w)^{b}")
    return "·".join(parts) or "1"


def _format_coef(c, m: Monomial) -> str:
    mono = format_monomial(m)
    if isinstance(c, (int, float)):
        if m == (0, 0):
            return f"{c:g}"
        return mono if c == 1 else (f"-{mono}" if c == -1 else f"{c:g}·{mono}")
    return "c" if m == (0, 0) else f"c·{mono}"


def format_poly(poly: dict) -> str:
    """The polynomial in words; tensor coefficients are shown as ``c``."""
    text = " + ".join(_format_coef(poly[m], m) for m in sorted(poly)) or "0"
    return text.replace("+ -", "− ")


def captured_tensors(node: Node) -> tuple[torch.Tensor, ...]:
    """Tensors a program closes over that require grad, deduplicated, in a fixed order."""
    seen, out = set(), []
    for c in node.constants():
        if isinstance(c, torch.Tensor) and c.requires_grad and id(c) not in seen:
            seen.add(id(c))
            out.append(c)
    return tuple(out)
