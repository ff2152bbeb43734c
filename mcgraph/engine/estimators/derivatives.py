"""Forward-mode derivative rules for the elementwise programs of the fused tier.

A traced elementwise program ``h`` (a tree of :class:`~mcgraph.engine.plan.ir.Call`,
:class:`~mcgraph.engine.plan.ir.PolyNode` and :class:`~mcgraph.engine.plan.ir.SumNode` nodes) is
*lowered* once into a plain, hashable tree whose tensors are replaced by numbered slots, so
that the same program with other tensor values (a prior with learned parameters, the next
training step) reuses one compiled body. :func:`dual` evaluates a lowered program together
with its directional derivatives, in one walk and without an autograd graph: every node
returns its value and, per direction ``d``, its tangent

.. math::
    \\dot y_d = \\sum_i \\frac{\\partial f}{\\partial x_i}\\,\\dot x_{i,d},

where a direction is ``w`` (tangent ``∂w/∂u``) or one captured tensor (tangent one). Values are
computed by the program's own torch functions, so they are the direct estimator's numbers.

New operations are one registration beside :func:`mcgraph.engine.plan.ops.register_integrand`:
:func:`register_derivative` maps a torch function's name to
``rule(args, kwargs, out, tangents) -> tangent`` (``tangents[i]`` is ``None`` for an argument
without one, the Python float ``1.0`` for an identity tangent). A program using an op without a
rule is not lowered and the fused tier falls back to its local autograd call.

Example:
    >>> import torch
    >>> from mcgraph.engine.plan.ir import Call, PolyNode
    >>> prog = lower(Call(torch.exp, (PolyNode({(1, 0): 2.0}),), {}))
    >>> value, (tangent,) = dual(prog.tree, torch.tensor([0.0, 1.0]), (1.0,), (), ({},))
    >>> torch.allclose(tangent, 2 * value)
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ...registry import Registry
from ..plan.ir import Call, Node, PolyNode, SumNode, Var, horner, horner_degrees, monomial
from ..plan.ops import normalise_name

#: name -> rule(args, kwargs, out, tangents) -> tangent (None: zero).
DERIVATIVES: Registry = Registry("forward derivative rule")


class NoRule(Exception):
    """An op (or one of its argument combinations) has no forward rule: use the autograd path."""


def register_derivative(name: str, rule: Callable | None = None):
    """Register the forward rule of the elementwise op ``name`` (as a call or a decorator).

    ``rule(args, kwargs, out, tangents)`` returns the tangent of ``out = func(*args, **kwargs)``
    given one tangent per positional argument (``None``: zero; ``1.0``: identity). It may raise
    :class:`NoRule` for argument combinations it does not cover.
    """
    return DERIVATIVES.register(name) if rule is None else DERIVATIVES.register(name, rule)


# --------------------------------------------------------------------------- tangent arithmetic
# A tangent is None (zero), the Python float 1.0 (identity: d w / d u for an untransformed form),
# or a tensor. These helpers skip the multiplications an identity or zero tangent makes useless.


def _mul(t, x):
    if t is None:
        return None
    if isinstance(t, float) and t == 1.0:
        return x
    return t * x


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _neg(t):
    return None if t is None else -t


def _div(t, x):
    if t is None:
        return None
    if isinstance(t, float) and t == 1.0:
        return 1.0 / x
    return t / x


def _tangent_tensor(t, like: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor of ``like``'s dtype (a Python float would be torch's default dtype in ``where``)."""
    if t is None:
        return torch.zeros((), dtype=like.dtype, device=like.device)
    return t if isinstance(t, torch.Tensor) else torch.tensor(t, dtype=like.dtype, device=like.device)


def _one(args, kwargs, name):
    if len(args) != 1 or kwargs:
        raise NoRule(f"{name} with {len(args)} arguments / {sorted(kwargs)}")
    return args[0]


def _unary(name: str, dfdx: Callable) -> None:
    """``f(x)``: tangent ``f'(x) · ẋ`` with ``f'`` from ``dfdx(x, out)``."""
    def rule(args, kwargs, out, tangents):
        x = _one(args, kwargs, name)
        return _mul(tangents[0], dfdx(x, out))

    register_derivative(name, rule)


def _unary_over(name: str, denominator: Callable) -> None:
    """``f(x)`` with ``f'(x) = 1 / g(x)``: tangent ``ẋ / g(x)``, divided as autograd divides.

    ``ẋ · (1/g)`` would differ where ``1/g`` overflows: at a float32 subnormal ``x`` (``relu(w) + 1e-40``
    at a negative ``w``) the tangent ``ẋ`` is 0 and ``1/x`` is inf, so the product is NaN where ``0 / x`` is 0.
    """
    def rule(args, kwargs, out, tangents):
        x = _one(args, kwargs, name)
        return _div(tangents[0], denominator(x, out))

    register_derivative(name, rule)


def _linear_unary(name: str, factor) -> None:
    def rule(args, kwargs, out, tangents):
        _one(args, kwargs, name)
        t = tangents[0]
        return None if t is None else (t * factor if factor != 1.0 else t)

    register_derivative(name, rule)


def _zero(name: str) -> None:
    """Piecewise-constant ops (comparisons, rounding, sign): derivative zero, as autograd's."""
    register_derivative(name, lambda args, kwargs, out, tangents: None)


for _name in ("abs", "absolute"):
    _unary(_name, lambda x, out: x.sgn())
for _name in ("neg", "negative"):
    _linear_unary(_name, -1.0)
_unary("exp", lambda x, out: out)
_unary("exp2", lambda x, out: out * math.log(2.0))
_unary("expm1", lambda x, out: out + 1)
_unary_over("log", lambda x, out: x)
_unary_over("log2", lambda x, out: x * math.log(2.0))
_unary_over("log10", lambda x, out: x * math.log(10.0))
_unary_over("log1p", lambda x, out: x + 1)
_unary_over("sqrt", lambda x, out: 2 * out)
_unary("rsqrt", lambda x, out: -0.5 * out.pow(3))
_unary("square", lambda x, out: 2 * x)
_unary("reciprocal", lambda x, out: -(out * out))
_unary("sin", lambda x, out: x.cos())
_unary("cos", lambda x, out: -x.sin())
_unary("tan", lambda x, out: 1 + out * out)
_unary("tanh", lambda x, out: 1 - out * out)
_unary("sinh", lambda x, out: x.cosh())
_unary("cosh", lambda x, out: x.sinh())
_unary_over("atan", lambda x, out: 1 + x * x)
_unary("sigmoid", lambda x, out: out * (1 - out))
_unary("relu", lambda x, out: (out > 0).to(out.dtype))
_unary("erf", lambda x, out: (2 / math.sqrt(math.pi)) * torch.exp(-x * x))
_unary("erfc", lambda x, out: (-2 / math.sqrt(math.pi)) * torch.exp(-x * x))
_unary("lgamma", lambda x, out: torch.digamma(x))
_unary("digamma", lambda x, out: torch.polygamma(1, x))
_linear_unary("frac", 1.0)
for _name in ("sign", "sgn", "floor", "ceil", "round", "trunc", "lt", "le", "gt", "ge", "eq", "ne", "less",
              "greater", "less_equal", "greater_equal", "not_equal", "logical_and", "logical_or",
              "logical_not", "isfinite", "isnan", "isinf", "heaviside"):
    _zero(_name)


def _alpha(kwargs, name):
    if set(kwargs) - {"alpha"}:
        raise NoRule(f"{name} with {sorted(kwargs)}")
    return kwargs.get("alpha", 1)


def _two(args, name):
    if len(args) != 2:
        raise NoRule(f"{name} with {len(args)} arguments")
    return args


@register_derivative("add")
def _add_rule(args, kwargs, out, tangents):
    _two(args, "add")
    alpha = _alpha(kwargs, "add")
    return _add(tangents[0], tangents[1] if alpha == 1 else _mul(tangents[1], alpha))


register_derivative("radd", _add_rule)


@register_derivative("sub")
def _sub_rule(args, kwargs, out, tangents):
    _two(args, "sub")
    alpha = _alpha(kwargs, "sub")
    return _add(tangents[0], _neg(tangents[1] if alpha == 1 else _mul(tangents[1], alpha)))


register_derivative("subtract", _sub_rule)


@register_derivative("rsub")
def _rsub_rule(args, kwargs, out, tangents):  # out = other - alpha * self
    _two(args, "rsub")
    alpha = _alpha(kwargs, "rsub")
    return _add(tangents[1], _neg(tangents[0] if alpha == 1 else _mul(tangents[0], alpha)))


@register_derivative("mul")
def _mul_rule(args, kwargs, out, tangents):
    a, b = _two(args, "mul")
    if kwargs:
        raise NoRule("mul with keywords")
    return _add(_mul(tangents[0], b), _mul(tangents[1], a))


for _name in ("multiply", "rmul"):
    register_derivative(_name, _mul_rule)


def _quotient(ta, tb, b, out):
    """d(a / b) = ȧ / b − ḃ · out / b."""
    return _add(_div(ta, b), _neg(_mul(tb, out / b)) if tb is not None else None)


@register_derivative("div")
def _div_rule(args, kwargs, out, tangents):
    _, b = _two(args, "div")
    if kwargs.get("rounding_mode") is not None:
        return None  # floor / trunc division: piecewise constant
    if set(kwargs) - {"rounding_mode"}:
        raise NoRule(f"div with {sorted(kwargs)}")
    return _quotient(tangents[0], tangents[1], b, out)


for _name in ("divide", "true_divide", "truediv"):
    register_derivative(_name, _div_rule)


@register_derivative("rtruediv")
def _rtruediv_rule(args, kwargs, out, tangents):  # out = other / self
    a, _ = _two(args, "rtruediv")
    return _quotient(tangents[1], tangents[0], a, out)


def _power(tb, te, base, exponent, out):
    """d(base^exponent), with autograd's conventions: no base term where exponent == 0,
    no exponent term where base == 0 and exponent >= 0."""
    t = None
    if tb is not None:
        if isinstance(exponent, (int, float)):
            t = None if exponent == 0 else _mul(tb, exponent * base.pow(exponent - 1))
        else:
            t = _mul(tb, torch.where(exponent == 0, torch.zeros_like(out), exponent * base.pow(exponent - 1)))
    if te is not None:
        if isinstance(base, (int, float)):
            t = _add(t, _mul(te, out * math.log(base)) if base != 0 else _mul(te, torch.zeros_like(out)))
        else:
            zero = (base == 0) & (exponent >= 0)
            t = _add(t, _mul(te, torch.where(zero, torch.zeros_like(out), out * base.log())))
    return t


@register_derivative("pow")
def _pow_rule(args, kwargs, out, tangents):
    base, exponent = _two(args, "pow")
    if kwargs:
        raise NoRule("pow with keywords")
    return _power(tangents[0], tangents[1], base, exponent, out)


@register_derivative("rpow")
def _rpow_rule(args, kwargs, out, tangents):  # out = other ** self
    exponent, base = _two(args, "rpow")
    return _power(tangents[1], tangents[0], base, exponent, out)


@register_derivative("logaddexp")
def _logaddexp_rule(args, kwargs, out, tangents):
    """d log(eᵃ + eᵇ) = ȧ σ(a − b) + ḃ σ(b − a)."""
    a, b = _two(args, "logaddexp")
    if kwargs:
        raise NoRule("logaddexp with keywords")
    ta, tb = tangents
    if ta is None and tb is None:
        return None
    if tb is None:
        return _mul(ta, torch.sigmoid(a - b))
    if ta is None:
        return _mul(tb, torch.sigmoid(b - a))
    s = torch.sigmoid(a - b)
    return _add(_mul(ta, s), _mul(tb, 1 - s))


@register_derivative("where")
def _where_rule(args, kwargs, out, tangents):
    if len(args) != 3 or kwargs:
        raise NoRule("where with other than (condition, input, other)")
    cond = args[0]
    ta, tb = tangents[1], tangents[2]
    if ta is None and tb is None:
        return None
    return torch.where(cond, _tangent_tensor(ta, out), _tangent_tensor(tb, out))


def _extremum(name, pick_first):
    def rule(args, kwargs, out, tangents):
        a, b = _two(args, name)
        if kwargs:
            raise NoRule(f"{name} with keywords")
        ta, tb = tangents
        if ta is None and tb is None:
            return None
        ta, tb = _tangent_tensor(ta, out), _tangent_tensor(tb, out)
        # autograd's convention: a tie splits the gradient in halves
        return torch.where(pick_first(a, b), ta, torch.where(a == b, (ta + tb) / 2, tb))

    register_derivative(name, rule)


_extremum("maximum", lambda a, b: a > b)
_extremum("minimum", lambda a, b: a < b)


@register_derivative("clamp")
def _clamp_rule(args, kwargs, out, tangents):
    x, lo, hi = (list(args) + [None, None])[:3]
    lo, hi = kwargs.get("min", lo), kwargs.get("max", hi)
    if any(t is not None for t in tangents[1:]) or any(isinstance(b, torch.Tensor) for b in (lo, hi)):
        raise NoRule("clamp with tensor bounds")
    keep = torch.ones_like(x, dtype=torch.bool)
    if lo is not None:
        keep = keep & (x >= lo)
    if hi is not None:
        keep = keep & (x <= hi)
    return None if tangents[0] is None else torch.where(keep, _tangent_tensor(tangents[0], out),
                                                        _tangent_tensor(None, out))


register_derivative("clip", _clamp_rule)


@register_derivative("clamp_min")
def _clamp_min_rule(args, kwargs, out, tangents):
    return _clamp_rule(args[:1], {"min": args[1] if len(args) > 1 else kwargs.get("min")}, out, tangents[:1])


@register_derivative("clamp_max")
def _clamp_max_rule(args, kwargs, out, tangents):
    return _clamp_rule(args[:1], {"max": args[1] if len(args) > 1 else kwargs.get("max")}, out, tangents[:1])


@register_derivative("softplus")
def _softplus_rule(args, kwargs, out, tangents):
    """softplus_β(x) = log(1 + e^{βx})/β, linear above the threshold: ẋ σ(βx) or ẋ."""
    names = ("beta", "threshold")
    extra = dict(zip(names, args[1:]))
    extra.update(kwargs)
    if set(extra) - set(names):
        raise NoRule(f"softplus with {sorted(extra)}")
    x = args[0]
    beta, threshold = extra.get("beta", 1.0), extra.get("threshold", 20.0)
    if tangents[0] is None:
        return None
    bx = x * beta
    return _mul(tangents[0], torch.where(bx > threshold, _tangent_tensor(1.0, out), torch.sigmoid(bx)))


@register_derivative("xlogy")
def _xlogy_rule(args, kwargs, out, tangents):
    """d(x log y) = ẋ log y (zero where x = 0, as autograd) + ẏ x / y."""
    x, y = _two(args, "xlogy")
    tx, ty = tangents
    t = None
    if tx is not None:
        t = _mul(tx, torch.xlogy((x != 0).to(out.dtype), y))
    if ty is not None:
        t = _add(t, _mul(ty, x / y))
    return t


def _cast_rule(args, kwargs, out, tangents):
    """``to`` / ``float`` / ``double`` / ``type_as``: the tangent cast alike; none for discrete results."""
    t = tangents[0] if tangents else None
    if t is None or not out.dtype.is_floating_point:
        return None
    return t.to(out.dtype) if isinstance(t, torch.Tensor) else t


for _name in ("to", "float", "double", "type_as", "half", "bfloat16"):
    register_derivative(_name, _cast_rule)


# --------------------------------------------------------------------------- lowering


_LITERALS = (int, float, bool, str, type(None), torch.dtype, torch.device)
_NAN = float("nan")


@dataclass(frozen=True)
class Lowered:
    """A program lowered for :func:`dual`.

    Attributes:
        tree: nested tuples, hashable: ``("w",)``, ``("poly", ((a, b, ref), …))``,
            ``("call", func, name, args, kwargs)``, ``("sum", parts)``; a ``ref`` is
            ``("slot", k)`` (the k-th tensor of :attr:`tensors`) or ``("lit", value)``.
        tensors: the program's tensors, deduplicated, in slot order.
    """

    tree: tuple
    tensors: tuple

    def key(self) -> tuple:
        """The program's structure and its tensors' dtypes and ranks: what a compiled body depends on
        (not their values, nor their sizes: compiled bodies take any size)."""
        return self.tree, tuple((t.dtype, t.dim(), t.device.type) for t in self.tensors)

    def slot_of(self, tensor: torch.Tensor) -> int:
        for k, t in enumerate(self.tensors):
            if t is tensor:
                return k
        raise KeyError("tensor is not one of the program's")


def lower(node: Node) -> Lowered | None:
    """``node`` as a :class:`Lowered` program, or ``None`` when some op has no forward rule
    (lowered once per program and set of rules: a cached trace's nodes are evaluated on every call)."""
    memo = node.__dict__.get("_lowered")
    if memo is not None and memo[0] == DERIVATIVES.generation:
        return memo[1]
    try:
        out = _lower(node)
    except NoRule:
        out = None
    node.__dict__["_lowered"] = (DERIVATIVES.generation, out)
    return out


def missing_rule(node: Node) -> str:
    """Why ``node`` cannot be lowered (empty when it can)."""
    try:
        _lower(node)
    except NoRule as e:
        return str(e)
    return ""


def _lower(node: Node) -> Lowered:
    tensors: list = []
    index: dict[int, int] = {}

    def ref(x):
        if isinstance(x, torch.Tensor):
            if id(x) not in index:
                index[id(x)] = len(tensors)
                tensors.append(x)
            return ("slot", index[id(x)])
        if isinstance(x, float) and math.isnan(x):
            return ("lit", _NAN)  # one NaN object: equal keys (nan != nan) for the compile cache
        if isinstance(x, _LITERALS):
            return ("lit", x)
        raise NoRule(f"an argument of type {type(x).__name__}")

    def arg(x):
        return go(x) if isinstance(x, Node) else ref(x)

    def go(n: Node) -> tuple:
        if type(n) is Var:
            return ("w",)
        if type(n) is PolyNode:
            return ("poly", tuple((a, b, ref(c)) for (a, b), c in n.poly.items()))
        if type(n) is SumNode:
            return ("sum", tuple(go(p) for p in n.parts))
        if type(n) is Call:
            name = normalise_name(n.func)
            if name not in DERIVATIVES:
                raise NoRule(f"no forward rule for `{name}`")
            return ("call", n.func, name, tuple(arg(a) for a in n.args),
                    tuple(sorted((k, arg(v)) for k, v in n.kwargs.items())))
        raise NoRule(f"node type {type(n).__name__}")

    tree = go(node)
    try:
        hash(tree)
    except TypeError as e:
        raise NoRule(f"an unhashable argument ({e})") from e
    return Lowered(tree, tuple(tensors))


# --------------------------------------------------------------------------- dual evaluation


def dual(tree: tuple, w: torch.Tensor, w_tangents: tuple, tensors: tuple, slot_tangents: tuple):
    """Value of the lowered ``tree`` at ``w`` and its tangent along each direction.

    Args:
        tree: :attr:`Lowered.tree`.
        w: the sample rows.
        w_tangents: per direction, the tangent of ``w`` (``None``, ``1.0`` or a tensor).
        tensors: the values of the program's slots (same order as :attr:`Lowered.tensors`).
        slot_tangents: per direction, ``{slot: tangent}`` for the slots that move along it.

    Returns:
        ``(value, tangents)``, one tangent per direction (``None`` when zero).
    """
    kind = tree[0]
    if kind == "w":
        return w, tuple(w_tangents)
    if kind == "poly":
        return _dual_poly(tree[1], w, w_tangents, tensors, slot_tangents)
    if kind == "sum":
        value, tangents = dual(tree[1][0], w, w_tangents, tensors, slot_tangents)
        for part in tree[1][1:]:
            v, t = dual(part, w, w_tangents, tensors, slot_tangents)
            value = value + v
            tangents = tuple(_add(a, b) for a, b in zip(tangents, t))
        return value, tangents
    _, func, name, args, kwargs = tree
    vals, tans = [], []
    for a in args:
        v, t = _dual_arg(a, w, w_tangents, tensors, slot_tangents)
        vals.append(v)
        tans.append(t)
    kw = {}
    for k, a in kwargs:
        v, t = _dual_arg(a, w, w_tangents, tensors, slot_tangents)
        if any(x is not None for x in t):
            raise NoRule(f"`{name}`: a keyword argument depends on w")
        kw[k] = v
    out = func(*vals, **kw)
    rule = DERIVATIVES[name]
    tangents = []
    for d in range(len(w_tangents)):
        ts = tuple(t[d] for t in tans)
        tangents.append(None if all(t is None for t in ts) else rule(tuple(vals), kw, out, ts))
    return out, tuple(tangents)


def _dual_arg(a, w, w_tangents, tensors, slot_tangents):
    if a[0] == "lit":
        return a[1], (None,) * len(w_tangents)
    if a[0] == "slot":
        return tensors[a[1]], tuple(s.get(a[1]) for s in slot_tangents)
    return dual(a, w, w_tangents, tensors, slot_tangents)


def _resolve(ref, tensors):
    return tensors[ref[1]] if ref[0] == "slot" else ref[1]


def _dual_poly(terms, w, w_tangents, tensors, slot_tangents):
    """``Σ c·w^a (log w)^b`` exactly as :class:`PolyNode` evaluates it, with
    ``d(w^a (log w)^b)/dw = w^(a-1) (log w)^(b-1) (a log w + b)``; a polynomial in ``w`` of degree
    ≥ 2 by Horner's rule, its value, ``dp/dw`` and the coefficients' tangents alike (:func:`horner`)."""
    degree = horner_degrees({(a, b): None for a, b, _ in terms})
    if degree is not None:
        return _dual_horner(terms, degree, w, w_tangents, tensors, slot_tangents)
    out = None
    logw = None
    ndir = len(w_tangents)
    tangents = [None] * ndir
    for a, b, ref in terms:
        term, logw = monomial(w, a, b, logw)
        c = _resolve(ref, tensors)
        value = torch.zeros_like(w) + c if term is None else c * term
        out = value if out is None else out + value
        # d/dw of the monomial, times c
        dm = None
        if any(t is not None for t in w_tangents) and (a or b):
            if b == 0:
                dm = c if a == 1 else c * (a * (w if a == 2 else w.pow(a - 1)))
            else:
                lw = logw
                inner = a * lw + b if a else b
                pw = w.pow(a - 1) if a != 1 else None
                lp = lw.pow(b - 1) if b > 1 else None
                dm = inner
                if pw is not None:
                    dm = dm * pw
                if lp is not None:
                    dm = dm * lp
                dm = c * dm
        for d in range(ndir):
            t = _mul(w_tangents[d], dm) if dm is not None else None
            tc = slot_tangents[d].get(ref[1]) if ref[0] == "slot" else None
            if tc is not None:
                t = _add(t, _mul(tc, term) if term is not None else tc)
            tangents[d] = _add(tangents[d], t)
    if out is None:
        return torch.zeros_like(w), tuple(tangents)
    return out, tuple(tangents)


def _dual_horner(terms, degree, w, w_tangents, tensors, slot_tangents):
    """:func:`_dual_poly` for ``p(w) = Σ_k c_k w^k``: ``p``, ``p'`` (coefficients ``k·c_k``) and, per
    direction, ``ẇ·p'(w) + Σ_k ċ_k w^k``, each by Horner's rule."""
    coefs = {a: _resolve(ref, tensors) for a, _, ref in terms}
    out = horner(w, coefs, degree)
    slope = None
    if any(t is not None for t in w_tangents):
        slope = horner(w, {k - 1: k * c for k, c in coefs.items() if k}, degree - 1)
    tangents = []
    for d, wt in enumerate(w_tangents):
        t = _mul(wt, slope) if wt is not None else None
        dcoefs = {a: slot_tangents[d][ref[1]] for a, _, ref in terms
                  if ref[0] == "slot" and slot_tangents[d].get(ref[1]) is not None}
        if dcoefs:
            top = max(dcoefs)
            t = _add(t, horner(w, dcoefs, top) if top else torch.zeros_like(w) + dcoefs[0])
        tangents.append(t)
    return out, tuple(tangents)
