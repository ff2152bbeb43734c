"""Tracing an integrand ``g`` into terms the classifier can reason about.

``trace(fn, example)`` calls ``fn`` once on a :class:`Traced` tensor: a tensor
subclass that carries a real example value (so shapes, dtypes and
``torch.distributions`` code work unchanged) and a symbolic expression built
by ``__torch_function__``. The expression of the result is a sum of *pieces*

.. math::
    g(w) = \\sum_p L_p\\Big(\\sum_{(a,b)} c_{p,a,b} \\odot w^a (\\log w)^b
                             + \\sum_r h_{p,r}(w)\\Big)

where each ``L_p`` is a chain of linear maps (``sum``, ``mean``, ``reshape``,
scaling, …) applied after the expectation, each monomial ``w^a (log w)^b`` is a
candidate for the collapsed tier, and each ``h`` is an *elementwise program*
(a recorded tree of elementwise torch calls) for the fused tier. Anything else
(a reduction followed by a non-linear op, data-dependent Python control flow)
makes the whole integrand *opaque*, and it is evaluated by the chunked tier.

New elementwise operations are one registration: :func:`register_integrand`
names a torch function as elementwise (or gives it a symbolic rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .algebra import VAR, Elementwise, Expr, Piece, add_poly, mul_poly, positive_const, scalar_int, scale_poly, const_expr
from .ir import Call, func_name
from .ops import ESCAPES, IDENTITY_OPS, LINEAR_OPS, METADATA, OPS, is_elementwise, is_in_place, normalise_name


class OpaqueIntegrand(Exception):
    """Raised inside tracing when ``fn`` leaves the traceable fragment."""


# --------------------------------------------------------------------------- the traced tensor


class Traced(torch.Tensor):
    """A tensor carrying a real example value and the symbolic expression of how it depends on w."""

    _expr: Expr

    @staticmethod
    def __new__(cls, real: torch.Tensor, expr: Expr):
        t = torch.Tensor._make_subclass(cls, real.detach(), False)
        t._expr = expr
        return t

    def __repr__(self, *, tensor_contents=None):  # noqa: D105
        return f"Traced(shape={tuple(self.shape)})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = normalise_name(func)
        with torch._C.DisableTorchFunctionSubclass():
            if name in METADATA or name.startswith("_"):
                return func(*tree_map(_real, args), **tree_map(_real, kwargs))
        if name in ESCAPES:
            raise OpaqueIntegrand(f"`{name}` converts a traced value to Python (data-dependent control flow)")
        raw = getattr(func, "__name__", "")
        if is_in_place(raw) or kwargs.get("out") is not None:
            raise OpaqueIntegrand(f"in-place op `{raw}` on a traced value")
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
            real = func(*tree_map(_real, args), **tree_map(_real, kwargs))
        if not isinstance(real, torch.Tensor):
            if isinstance(real, (tuple, list)) and any(isinstance(r, torch.Tensor) for r in real):
                raise OpaqueIntegrand(f"`{name}` returns several tensors")
            return real
        expr = _symbolic(name, func, args, kwargs, real)
        return Traced(real, expr)


def _real(x):
    if isinstance(x, Traced):
        with torch._C.DisableTorchFunctionSubclass():
            return x.as_subclass(torch.Tensor)
    return x


def _expr_of(x) -> Expr | None:
    return x._expr if isinstance(x, Traced) else None


def _symbolic(name: str, func, args, kwargs, real: torch.Tensor) -> Expr:
    rule = OPS.get(name)
    if rule is not None:
        out = rule(func, args, kwargs)
        if out is not None:
            return out
    if name in IDENTITY_OPS or (name in ("to", "float", "double", "type_as") and _same_dtype(args, real)):
        return _expr_of(args[0]) if isinstance(args[0], Traced) else _as_expr(args[0])
    if name in ("add", "radd", "sub", "subtract", "rsub") and len(args) == 2 and "alpha" not in kwargs:
        a, b = args
        if name == "rsub":
            a, b = b, a
        a, b = _promoted(a, real), _promoted(b, real)
        return _add(a, _neg(b) if name in ("sub", "subtract", "rsub") else b, real)
    if name in ("neg", "negative") and len(args) == 1:
        return _neg(_as_expr(args[0]))
    if name in ("mul", "multiply", "rmul") and len(args) == 2:
        return _mul(args[0], args[1], func, kwargs, real)
    if name in ("div", "divide", "true_divide", "truediv", "rtruediv") and len(args) == 2 and not kwargs:
        a, b = (args[1], args[0]) if name == "rtruediv" else args
        return _div(a, b, func, real)
    if name in ("pow", "rpow") and len(args) == 2 and not kwargs:
        base, exponent = (args[1], args[0]) if name == "rpow" else args
        return _pow(base, exponent, real)
    if name == "square" and len(args) == 1:
        return _pow(args[0], 2, real)
    if name == "reciprocal" and len(args) == 1:
        return _div(1.0, args[0], torch.div, real)
    if name == "log" and len(args) == 1 and not kwargs:
        return _log(args[0], real)
    if name == "xlogy" and len(args) == 2 and not isinstance(args[1], (int, float)) and not kwargs:
        c, x = args
        if not isinstance(c, Traced):
            return _mul(c, Traced(_real(x).log(), _log(x, _real(x))), torch.mul, {}, real)
    if name == "exp" and len(args) == 1 and not kwargs:
        return _exp(args[0], real)
    if name in LINEAR_OPS:
        return _linear(func, args, kwargs, real)
    if is_elementwise(name):
        return _elementwise_call(func, args, kwargs)
    raise OpaqueIntegrand(f"`{name}` is neither elementwise nor linear")


def _same_dtype(args, real) -> bool:
    return isinstance(args[0], torch.Tensor) and args[0].dtype == real.dtype


def _as_expr(x) -> Expr:
    if isinstance(x, Traced):
        return x._expr
    return const_expr(x)


def _promoted(x, real) -> Expr:
    """``x``'s expression cast to the dtype of the sum ``real`` it enters, as torch promotes it there.

    Without the cast, a later constant factor distributed over the sum would meet the operand's
    own dtype: in ``0.562 * (w + (w > 0).int())`` the term ``0.562 * int`` is float32 (torch's
    default dtype), where the sum of a float64 ``w`` made it float64. Polynomial parts are computed
    in the sample's dtype, which the sum's already holds; programs and linear maps are cast.
    """
    e = _as_expr(x)
    if not isinstance(x, Traced) or _real(x).dtype == real.dtype:
        return e
    dtype = real.dtype
    el = e.elementwise
    if el is not None:
        return Expr.of(Elementwise(el.poly, tuple(Call(torch.Tensor.to, (p, dtype), {}) for p in el.programs)))
    return Expr(tuple(Piece(p.expr, p.chain + (lambda t, d=dtype: t.to(d),)) for p in e.pieces))


def _shape_of(x) -> tuple:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else ()


def _add(a: Expr, b: Expr, real) -> Expr:
    ea, eb = a.elementwise, b.elementwise
    if ea is not None and eb is not None:
        return Expr.of(Elementwise(add_poly(ea.poly, eb.poly), ea.programs + eb.programs))
    return Expr(_pieces_at(a, real) + _pieces_at(b, real))


def _pieces_at(e: Expr, real) -> tuple:
    """Pieces of ``e``; an elementwise piece joining a sum with reduced pieces is broadcast first."""
    if e.elementwise is None:
        return e.pieces
    shape = tuple(real.shape)
    return (Piece(e.pieces[0].expr, (lambda x, s=shape: x.broadcast_to(s) if tuple(x.shape) != s else x,)),)


def _neg(a: Expr) -> Expr:
    e = a.elementwise
    if e is not None:
        return Expr.of(Elementwise(scale_poly(e.poly, -1.0), tuple(Call(torch.neg, (p,), {}) for p in e.programs)))
    return Expr(tuple(Piece(p.expr, p.chain + (torch.neg,)) for p in a.pieces))


def _scale_expr(e: Expr, c, real, divide: bool = False) -> Expr:
    """``c * e`` (or ``e / c``) for a constant ``c``."""
    op = torch.div if divide else torch.mul
    el = e.elementwise
    if el is not None:
        poly = {m: (v / c if divide else v * c) for m, v in el.poly.items()}
        return Expr.of(Elementwise(poly, tuple(Call(op, (p, c), {}) for p in el.programs)))
    shape = tuple(real.shape)
    return Expr(tuple(Piece(p.expr, p.chain + (lambda x, c=c, s=shape: op(x, c).broadcast_to(s),))
                      for p in e.pieces))


def _mul(a, b, func, kwargs, real) -> Expr:
    if kwargs:
        return _elementwise_call(func, (a, b), kwargs)
    ta, tb = isinstance(a, Traced), isinstance(b, Traced)
    if ta and tb:
        ea, eb = a._expr.elementwise, b._expr.elementwise
        if ea is None or eb is None:
            raise OpaqueIntegrand("product of a reduced term with another term")
        if ea.is_poly() and eb.is_poly():
            return Expr.of(Elementwise(mul_poly(ea.poly, eb.poly)))
        return Expr.of(Elementwise({}, (Call(torch.mul, (ea.node(), eb.node()), {}),)))
    if ta:
        return _scale_expr(a._expr, b, real)
    return _scale_expr(b._expr, a, real)


def _div(a, b, func, real) -> Expr:
    if isinstance(b, Traced):
        eb = b._expr.elementwise
        if eb is None:
            raise OpaqueIntegrand("division by a reduced term")
        if eb.is_poly() and len(eb.poly) == 1:
            ((pa, pb), c), = eb.poly.items()
            if pb == 0:
                inv = Expr.of(Elementwise({(-pa, 0): 1.0 / c if isinstance(c, (int, float)) else c.reciprocal()}))
                if isinstance(a, Traced):
                    return _mul(a, Traced(torch.ones(()), inv), torch.mul, {}, real)
                return _scale_expr(inv, a, real)
        return _elementwise_call(func, (a, b), {})
    return _scale_expr(a._expr, b, real, divide=True)


def _pow(base, exponent, real) -> Expr:
    if isinstance(exponent, Traced) or not isinstance(base, Traced):
        return _elementwise_call(torch.pow, (base, exponent), {})
    e = base._expr.elementwise
    if e is None:
        raise OpaqueIntegrand("power of a reduced term")
    k = scalar_int(exponent)
    if e.is_poly() and k is not None:
        if k >= 0:
            out = {(0, 0): 1.0}
            for _ in range(k):
                out = mul_poly(out, e.poly)
            return Expr.of(Elementwise(out))
        if len(e.poly) == 1:
            ((a, b), c), = e.poly.items()
            if b == 0:
                return Expr.of(Elementwise({(a * k, 0): c ** k}))
    return _elementwise_call(torch.pow, (base, exponent), {})


def _log(x, real) -> Expr:
    e = x._expr.elementwise if isinstance(x, Traced) else None
    if e is None:
        if isinstance(x, Traced):
            raise OpaqueIntegrand("log of a reduced term")
        return const_expr(torch.log(x))
    if e.is_poly() and len(e.poly) == 1:
        ((a, b), c), = e.poly.items()
        if b == 0 and positive_const(c):
            logc = math.log(c) if isinstance(c, (int, float)) else torch.log(c)
            if a == 0:
                return const_expr(logc)
            poly = {(0, 1): float(a)}
            if not (isinstance(logc, float) and logc == 0.0):
                poly[(0, 0)] = logc
            return Expr.of(Elementwise(poly))
    return _elementwise_call(torch.log, (x,), {})


def _exp(x, real) -> Expr:
    e = x._expr.elementwise
    if e is None:
        raise OpaqueIntegrand("exp of a reduced term")
    if e.is_poly() and set(e.poly) <= {(0, 1), (0, 0)}:
        k = scalar_int(e.poly.get((0, 1), 0))
        if k is not None:
            c0 = e.poly.get((0, 0), 0.0)
            c = math.exp(c0) if isinstance(c0, (int, float)) else torch.exp(c0)
            return Expr.of(Elementwise({(k, 0): c}))
    return _elementwise_call(torch.exp, (x,), {})


def _linear(func, args, kwargs, real) -> Expr:
    traced = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Traced)]
    if len(traced) != 1 or not (isinstance(args[0], Traced)):
        raise OpaqueIntegrand(f"`{func_name(func)}` with the traced value in an unexpected position")
    src = args[0]
    rest, kw = args[1:], kwargs

    def step(x, func=func, rest=rest, kw=kw):
        return func(x, *rest, **kw)

    pieces = _pieces_at(src._expr, _real(src))
    return Expr(tuple(Piece(p.expr, p.chain + (step,)) for p in pieces))


def _elementwise_call(func, args, kwargs) -> Expr:
    def to_node(x):
        if isinstance(x, Traced):
            e = x._expr.elementwise
            if e is None:
                raise OpaqueIntegrand(f"elementwise `{func_name(func)}` applied to a reduced term")
            return e.node()
        return x

    node = Call(func, tree_map(to_node, tuple(args)), tree_map(to_node, dict(kwargs)))
    return Expr.of(Elementwise({}, (node,)))


# --------------------------------------------------------------------------- entry point


@dataclass(frozen=True)
class TraceResult:
    """What tracing found.

    Attributes:
        expr: the symbolic expression, or ``None`` when the integrand is opaque.
        out_shape: shape of ``fn(w)`` for one sample.
        reason: why the integrand is opaque (when it is).
        constant: ``fn``'s value when it does not depend on w.
        dtype: the expectation's dtype: ``fn``'s when ``fn`` returns floating values, the
            sample's floating dtype when it returns integers or booleans (see :func:`floating`).
        discrete: ``fn`` returns integers or booleans; the expression (when there is one)
            already casts them to ``dtype``.
    """

    expr: Expr | None
    out_shape: torch.Size
    reason: str = ""
    constant: torch.Tensor | None = None
    dtype: torch.dtype | None = None
    discrete: bool = False
    #: Classifications of this trace, memoised per form signature by the functional API (the trace is frozen;
    #: this dict is the one part that fills in, never reassigned).
    plans: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def opaque(self) -> bool:
        return self.expr is None and self.constant is None


def is_discrete(dtype: torch.dtype) -> bool:
    """Integer or boolean: values whose mean is taken in a floating dtype."""
    return not (dtype.is_floating_point or dtype.is_complex)


def floating(fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> Callable:
    """``fn`` with integer or boolean results cast to ``dtype`` (floating results unchanged).

    The Monte Carlo mean of an indicator ``1{w ∈ A}`` is an estimate of the probability
    P(w ∈ A), a floating value; torch would refuse the mean of booleans and take the mean
    of integers in its default dtype rather than the distribution's.
    """

    def cast(w):
        out = fn(w)
        return out.to(dtype) if isinstance(out, torch.Tensor) and is_discrete(out.dtype) else out

    return cast


def _floating_pieces(expr: Expr, out: torch.Tensor, dtype: torch.dtype, example: torch.Tensor) -> Expr:
    """``expr`` with every integer or boolean elementwise part cast to ``dtype`` before its linear maps.

    Estimators average the elementwise parts over samples, so those must be floating even
    where only a later linear map made the result floating (``2.0 * (w > 0).sum()``). The
    cast before a sum is exact for counts.
    """
    pieces = []
    for p in expr.pieces:
        if p.expr.programs:
            if not p.chain:  # the piece is the result itself
                discrete = is_discrete(out.dtype)
            else:
                with torch.no_grad():
                    discrete = is_discrete(p.expr.node()(example, {}).dtype)
            if discrete:
                p = Piece(Elementwise({}, (Call(torch.Tensor.to, (p.expr.node(), dtype), {}),)), p.chain)
        pieces.append(p)
    return Expr(tuple(pieces))


def trace(fn: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor) -> TraceResult:
    """Trace ``fn`` on a real ``example`` sample; see the module docstring.

    Raises:
        TypeError: ``fn`` is not callable or does not return a tensor.
        ValueError: ``fn`` fails on a sample of the right shape.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    try:
        out = _call(fn, Traced(example, VAR))
    except OpaqueIntegrand as e:
        with torch.no_grad():
            real_out = _call(fn, example)
        shape, dtype = _out_shape(real_out), real_out.dtype
        return TraceResult(None, shape, str(e), dtype=_mean_dtype(dtype, example), discrete=is_discrete(dtype))
    if isinstance(out, (int, float)):
        out = torch.as_tensor(out, dtype=example.dtype)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"fn must return a tensor, got {type(out).__name__}")
    dtype, discrete = _mean_dtype(out.dtype, example), is_discrete(out.dtype)
    if isinstance(out, Traced):
        expr = _floating_pieces(out._expr, out, dtype, example)
        return TraceResult(expr, torch.Size(out.shape), dtype=dtype, discrete=discrete)
    return TraceResult(None, out.shape, "fn does not depend on w", constant=out.to(dtype), dtype=dtype,
                       discrete=discrete)


class IntegrandError(ValueError):
    """``fn`` raised on a sample; the message names ``fn``, the sample's shape and the original error."""


def _call(fn, w: torch.Tensor):
    try:
        return fn(w)
    except IntegrandError:
        raise
    except (RuntimeError, IndexError, ValueError) as e:
        raise IntegrandError(f"fn failed on a sample of shape {tuple(w.shape)}: {e}") from e


def guarded(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` whose failures on a sample (a torch error, a distribution's support check on a sampled
    value) raise :class:`IntegrandError`: the estimators call it on samples the trace never saw."""

    def call(w):
        return _call(fn, w)

    return call


def _mean_dtype(dtype: torch.dtype, example: torch.Tensor) -> torch.dtype:
    return example.dtype if is_discrete(dtype) else dtype


def _out_shape(out) -> torch.Size:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"fn must return a tensor, got {type(out).__name__}")
    return out.shape
