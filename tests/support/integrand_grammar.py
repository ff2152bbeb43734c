"""A grammar of integrands for the property tests: small trees of torch operations.

Each node builds a callable ``w -> Tensor`` and prints itself as Python source, so a
failing example reads as a lambda that can be pasted into a session. The grammar covers
what the engine's tracer must sort into tiers: polynomials, ``log`` of positive values,
``exp`` of affine maps, ``abs``, ``where``, comparisons, log-densities of registered
priors (their parameters optionally requiring grad), reductions (linear and not),
indicator functions, tensor coefficients that broadcast the output beyond the sample
shape, and integer and boolean results.

:func:`integrands` is the Hypothesis strategy; ``positive=True`` also draws nodes that
need ``w > 0`` (``log w``, Gamma or LogNormal priors applied to ``w``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.autograd.forward_ad as fwAD
from hypothesis import strategies as st
from torch import distributions as D

import mcgraph as mg
from mcgraph import distributions as mgd


@dataclass
class Build:
    """What a node needs to build its callable: the dtype, and the leaves it creates.

    ``tangents``: ``None`` for leaves that require grad; else forward-mode AD, the ``k``-th leaf
    being a dual tensor with tangent ``tangents[k]`` where given (a plain constant otherwise).
    """

    dtype: torch.dtype
    leaves: list = field(default_factory=list)
    tangents: dict | None = None

    def tensor(self, value, grad: bool = False) -> torch.Tensor:
        t = torch.as_tensor(value, dtype=self.dtype)
        if grad:
            t = leaf(t.clone(), len(self.leaves), self.tangents)
            self.leaves.append(t)
        return t


def leaf(t: torch.Tensor, k: int, tangents: dict | None) -> torch.Tensor:
    """The ``k``-th leaf: requiring grad, or (forward mode) dual with ``tangents[k]`` where given."""
    if tangents is None:
        return t.requires_grad_()
    return fwAD.make_dual(t, tangents[k]) if k in tangents else t


class Node:
    """An integrand node. ``kind`` is ``"real"``, ``"bool"`` or ``"int"``; ``positive`` means > 0."""

    kind = "real"
    positive = False

    def build(self, b: Build):
        raise NotImplementedError

    def src(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"lambda w: {self.src()}"


def _num(x: float) -> str:
    return repr(float(x))


@dataclass(frozen=True, repr=False)
class W(Node):
    positive: bool = False

    def build(self, b):
        return lambda w: w

    def src(self):
        return "w"


@dataclass(frozen=True, repr=False)
class Affine(Node):
    """``a·x + c`` (x > 0 and a, c ≥ 0 keep it positive)."""

    x: Node
    a: float
    c: float

    @property
    def positive(self):
        return self.x.positive and self.a > 0 and self.c >= 0

    def build(self, b):
        f = self.x.build(b)
        return lambda w: self.a * f(w) + self.c

    def src(self):
        return f"({_num(self.a)} * {self.x.src()} + {_num(self.c)})"


@dataclass(frozen=True, repr=False)
class Poly(Node):
    """``Σ_k c_k x^k`` (a polynomial of degree ≤ 3 in a sub-expression)."""

    x: Node
    coefs: tuple

    def build(self, b):
        f = self.x.build(b)

        def g(w):
            v = f(w)
            out = self.coefs[0] + self.coefs[1] * v
            for k, c in enumerate(self.coefs[2:], start=2):
                out = out + c * v ** k
            return out

        return g

    def src(self):
        x = self.x.src()
        terms = [_num(self.coefs[0]), f"{_num(self.coefs[1])} * {x}"]
        terms += [f"{_num(c)} * {x} ** {k}" for k, c in enumerate(self.coefs[2:], start=2)]
        return "(" + " + ".join(terms) + ")"


@dataclass(frozen=True, repr=False)
class Binary(Node):
    """``x op y`` for op in +, -, *."""

    op: str
    x: Node
    y: Node

    @property
    def kind(self):
        # two integer operands (indicators cast to long) stay integers
        return "real" if "real" in (self.x.kind, self.y.kind) else "int"

    @property
    def positive(self):
        return self.op in ("+", "*") and self.x.positive and self.y.positive

    def build(self, b):
        f, g = self.x.build(b), self.y.build(b)
        op = {"+": torch.add, "-": torch.sub, "*": torch.mul}[self.op]
        return lambda w: op(f(w), g(w))

    def src(self):
        return f"({self.x.src()} {self.op} {self.y.src()})"


@dataclass(frozen=True, repr=False)
class Coef(Node):
    """``c * x`` with a tensor coefficient ``c`` of shape ``shape`` (may broadcast the output)."""

    x: Node
    values: tuple
    shape: tuple
    grad: bool = False

    def build(self, b):
        f = self.x.build(b)
        c = b.tensor(torch.tensor(self.values, dtype=torch.float64).reshape(self.shape), self.grad)
        return lambda w: c * f(w)

    def src(self):
        grad = ", requires_grad=True" if self.grad else ""
        return f"(torch.tensor({list(self.values)}{grad}).reshape({self.shape}) * {self.x.src()})"


_UNARY = {
    "abs": torch.abs,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "softplus": torch.nn.functional.softplus,
    "sin": torch.sin,
}


@dataclass(frozen=True, repr=False)
class Unary(Node):
    name: str
    x: Node

    @property
    def positive(self):
        return self.name in ("sigmoid", "softplus")

    def build(self, b):
        f = self.x.build(b)
        op = _UNARY[self.name]
        return lambda w: op(f(w))

    def src(self):
        prefix = "torch.nn.functional" if self.name == "softplus" else "torch"
        return f"{prefix}.{self.name}({self.x.src()})"


@dataclass(frozen=True, repr=False)
class ExpAffine(Node):
    """``exp(a·x + c)``."""

    x: Node
    a: float
    c: float
    positive = True

    def build(self, b):
        f = self.x.build(b)
        return lambda w: torch.exp(self.a * f(w) + self.c)

    def src(self):
        return f"torch.exp({_num(self.a)} * {self.x.src()} + {_num(self.c)})"


@dataclass(frozen=True, repr=False)
class Log(Node):
    """``log x`` (x > 0), or ``log(|x| + 0.5)``."""

    x: Node

    def build(self, b):
        f = self.x.build(b)
        if self.x.positive:
            return lambda w: torch.log(f(w))
        return lambda w: torch.log(f(w).abs() + 0.5)

    def src(self):
        if self.x.positive:
            return f"torch.log({self.x.src()})"
        return f"torch.log({self.x.src()}.abs() + 0.5)"


@dataclass(frozen=True, repr=False)
class Power(Node):
    """``x ** p``: integer p ≥ 0 for any x, negative or fractional p for x > 0 only."""

    x: Node
    p: float

    @property
    def positive(self):
        return self.x.positive

    def build(self, b):
        f, p = self.x.build(b), self.p
        p = int(p) if float(p).is_integer() else p
        return lambda w: f(w) ** p

    def src(self):
        p = int(self.p) if float(self.p).is_integer() else self.p
        return f"{self.x.src()} ** {p!r}"


@dataclass(frozen=True, repr=False)
class Divide(Node):
    """``x / y`` with y > 0."""

    x: Node
    y: Node

    @property
    def positive(self):
        return self.x.positive

    def build(self, b):
        f, g = self.x.build(b), self.y.build(b)
        return lambda w: f(w) / g(w)

    def src(self):
        return f"({self.x.src()} / {self.y.src()})"


#: Other elementwise calls of one argument: name -> (source format, function, needs x > 0, positive result).
CALLS = {
    "square": ("torch.square({})", torch.square, False, False),
    "reciprocal": ("torch.reciprocal({})", torch.reciprocal, True, True),
    "sqrt": ("torch.sqrt({})", torch.sqrt, True, True),
    "relu": ("torch.relu({})", torch.relu, False, False),
    "clamp": ("torch.clamp({}, min=-0.5, max=1.5)", lambda x: torch.clamp(x, min=-0.5, max=1.5), False, False),
    "exp_k_log": ("torch.exp(2 * torch.log({}))", lambda x: torch.exp(2 * torch.log(x)), True, True),  # = x²
    "log_monomial": ("torch.log(0.5 * {} ** 3)", lambda x: torch.log(0.5 * x ** 3), True, False),
    "xlogy": ("torch.xlogy(torch.tensor(1.5), {})", lambda x: torch.xlogy(torch.tensor(1.5), x), True, False),
}


@dataclass(frozen=True, repr=False)
class Apply(Node):
    name: str
    x: Node

    @property
    def positive(self):
        return CALLS[self.name][3]

    def build(self, b):
        f, fn = self.x.build(b), CALLS[self.name][1]
        return lambda w: fn(f(w))

    def src(self):
        return CALLS[self.name][0].format(self.x.src())


@dataclass(frozen=True, repr=False)
class Maximum(Node):
    x: Node
    y: Node

    @property
    def positive(self):
        return self.x.positive or self.y.positive

    def build(self, b):
        f, g = self.x.build(b), self.y.build(b)
        return lambda w: torch.maximum(f(w), g(w))

    def src(self):
        return f"torch.maximum({self.x.src()}, {self.y.src()})"


@dataclass(frozen=True, repr=False)
class Compare(Node):
    """``x op t`` (a boolean tensor)."""

    x: Node
    op: str
    t: float
    kind = "bool"

    def build(self, b):
        f = self.x.build(b)
        op = {">": torch.gt, ">=": torch.ge, "<": torch.lt, "<=": torch.le}[self.op]
        return lambda w: op(f(w), self.t)

    def src(self):
        return f"({self.x.src()} {self.op} {_num(self.t)})"


@dataclass(frozen=True, repr=False)
class Where(Node):
    cond: Compare
    x: Node
    y: Node

    def build(self, b):
        c, f, g = self.cond.build(b), self.x.build(b), self.y.build(b)
        return lambda w: torch.where(c(w), f(w), g(w))

    def src(self):
        return f"torch.where({self.cond.src()}, {self.x.src()}, {self.y.src()})"


#: Casts of a boolean: name -> (source suffix, kind of the result).
CASTS = {
    "float": (".float()", "real"),
    "double": (".double()", "real"),
    "to_dtype": (".to(w.dtype)", "real"),
    "long": (".long()", "int"),
    "int": (".int()", "int"),
}


@dataclass(frozen=True, repr=False)
class Cast(Node):
    """An indicator ``(x op t).float()``, ``.long()``, … of a boolean node."""

    x: Node
    how: str

    @property
    def kind(self):
        return CASTS[self.how][1]

    def build(self, b):
        f = self.x.build(b)
        how = self.how
        if how == "to_dtype":
            return lambda w: f(w).to(w.dtype)
        return lambda w: getattr(f(w), how)()

    def src(self):
        return f"{self.x.src()}{CASTS[self.how][0]}"


#: Reductions: name -> (linear?, source format, function).
REDUCTIONS = {
    "sum": (True, "{}.sum()", lambda x: x.sum()),
    "mean": (True, "{}.mean()", lambda x: x.mean()),
    "sum_last": (True, "{}.sum(-1)", lambda x: x.sum(-1)),
    "getitem": (True, "{}.reshape(-1)[0]", lambda x: x.reshape(-1)[0]),
    "keepdim": (True, "{}.sum(-1, keepdim=True)", lambda x: x.sum(-1, keepdim=True)),
    "flip_scale": (True, "(2.0 * {}.reshape(-1).flip(0))", lambda x: 2.0 * x.reshape(-1).flip(0)),
    "minus_mean": (True, "({0} - {0}.mean())", lambda x: x - x.mean()),
    "logsumexp": (False, "torch.logsumexp({}.reshape(-1), 0)", lambda x: torch.logsumexp(x.reshape(-1), 0)),
    "max": (False, "{}.max()", lambda x: x.max()),
    "norm": (False, "{}.norm()", lambda x: x.norm()),
}


#: Reductions that apply to integers and booleans too.
DISCRETE_REDUCTIONS = ("sum", "sum_last", "getitem", "keepdim", "flip_scale")


@dataclass(frozen=True, repr=False)
class Reduce(Node):
    x: Node
    how: str

    @property
    def kind(self):
        if self.x.kind == "bool" and self.how in ("sum", "sum_last", "keepdim"):
            return "int"  # torch sums booleans to int64
        if self.how == "flip_scale":
            return "real"
        return self.x.kind

    def build(self, b):
        f, reduce = self.x.build(b), REDUCTIONS[self.how][2]
        return lambda w: reduce(f(w))

    def src(self):
        return REDUCTIONS[self.how][1].format(self.x.src())


def _prior(name: str, b: Build, loc: float, scale: float, grad: bool):
    """A prior with parameters (loc, scale), optionally leaves that require grad."""
    a, s = b.tensor(loc, grad), b.tensor(scale, grad)
    t = b.tensor
    if name == "normal":
        return D.Normal(a, s)
    if name == "laplace":
        return D.Laplace(a, s)
    if name == "student_t":
        return D.StudentT(t(4.0), a, s)
    if name == "scale_mixture":
        return mgd.ScaleMixtureNormal(t(0.3), s, s * 0.1, loc=a)
    if name == "horseshoe":
        return mgd.Horseshoe(a, s)
    if name == "gamma":
        return D.Gamma(s + 1.0, s)
    if name == "lognormal":
        return D.LogNormal(a, s)
    if name == "exponential":
        return D.Exponential(s)
    if name == "half_normal":
        return D.HalfNormal(s)
    raise KeyError(name)


#: Priors over the reals (constructed with drawn parameters) and over (0, ∞).
REAL_PRIORS = ("normal", "laplace", "student_t", "scale_mixture", "horseshoe")
POSITIVE_PRIORS = ("gamma", "lognormal", "exponential", "half_normal")


#: Registered priors with a density of their own (ARD's is set from the posterior: it has none).
_DENSITY_PRIORS = sorted(n for n in mg.nn.PRIORS
                         if not getattr(mg.nn.make_prior(n, torch.zeros(())), "posterior_dependent", False))


@dataclass(frozen=True, repr=False)
class LogProb(Node):
    """``prior.log_prob(x)``: a drawn prior, or a registered one (``mg.nn.PRIORS``) by name."""

    prior: str
    x: Node
    loc: float = 0.0
    scale: float = 1.0
    grad: bool = False
    registered: bool = False

    def build(self, b):
        f = self.x.build(b)
        prior = (mg.nn.make_prior(self.prior, b.tensor(0.0)) if self.registered
                 else _prior(self.prior, b, self.loc, self.scale, self.grad))
        return lambda w: prior.log_prob(f(w))

    def src(self):
        if self.registered:
            return f"mg.nn.make_prior({self.prior!r}, w).log_prob({self.x.src()})"
        grad = ", grad" if self.grad else ""
        return f"{self.prior}({_num(self.loc)}, {_num(self.scale)}{grad}).log_prob({self.x.src()})"


def compile_integrand(node: Node, dtype: torch.dtype, tangents: dict | None = None):
    """``(fn, leaves)``: the integrand and the tensors it created that require grad (or, with
    ``tangents``, that are dual tensors for forward-mode AD; see :class:`Build`)."""
    b = Build(dtype, tangents=tangents)
    return node.build(b), b.leaves


# --------------------------------------------------------------------------- strategies

_small = st.floats(-2.0, 2.0, allow_nan=False).map(lambda x: round(x, 3))
_slope = st.floats(-1.0, 1.0, allow_nan=False).map(lambda x: round(x, 3))
_pos = st.floats(0.1, 2.0, allow_nan=False).map(lambda x: round(x, 3))


def _real_leaf(positive: bool):
    return st.just(W(positive=positive))


@st.composite
def _coef(draw, x, sample_shape: tuple):
    """A tensor coefficient whose shape broadcasts with a sample (possibly adding a leading dim)."""
    shape = tuple(draw(st.sampled_from((1, d))) for d in sample_shape)
    if draw(st.booleans()):
        shape = shape[draw(st.integers(0, len(shape))):]  # fewer dims: broadcast from the right
    elif draw(st.integers(0, 3)) == 0:
        shape = (2,) + tuple(sample_shape)  # the output grows beyond the sample shape
    n = math.prod(shape)
    values = tuple(draw(st.lists(_small, min_size=n, max_size=n)))
    return Coef(draw(x), values, shape, draw(st.booleans()))


def as_real(n: Node) -> Node:
    """``n`` as a floating node: booleans and integers cast to the sample's dtype."""
    return n if n.kind == "real" else Cast(n, "to_dtype")


def as_positive(n: Node) -> Node:
    """``n`` as a positive floating node (``softplus`` where it may not be)."""
    n = as_real(n)
    return n if n.positive else Unary("softplus", n)


def _extend(positive: bool, sample_shape: tuple):
    def extend(children):
        # Maps, not filters: a filter on a recursive strategy rejects most draws.
        real = children.map(as_real)
        pos = children.map(as_positive)
        arith = children.map(lambda n: Cast(n, "long") if n.kind == "bool" else n)  # integers do arithmetic
        compare = st.builds(Compare, real, st.sampled_from((">", ">=", "<", "<=")), _small)
        return st.one_of(
            st.builds(Affine, arith, _slope.map(lambda a: a or 0.5), _small),
            st.builds(Poly, real, st.lists(_small, min_size=2, max_size=4).map(tuple)),
            st.builds(Binary, st.sampled_from("+-*"), arith, arith),
            st.builds(Unary, st.sampled_from(sorted(_UNARY)), real),
            st.builds(ExpAffine, _real_leaf(positive), _slope, _small),
            st.builds(Log, real),
            st.builds(Power, real, st.sampled_from((2, 3))),
            st.builds(Power, pos, st.sampled_from((-2, -1, 0.5, 1.5))),
            st.builds(Divide, real, pos),
            st.builds(Apply, st.sampled_from([k for k, v in CALLS.items() if not v[2]]), real),
            st.builds(Apply, st.sampled_from([k for k, v in CALLS.items() if v[2]]), pos),
            st.builds(Maximum, real, real),
            compare,
            st.builds(Where, compare, real, real),
            st.builds(Cast, compare, st.sampled_from(sorted(CASTS))),
            st.builds(LogProb, st.sampled_from(REAL_PRIORS), real, _small, _pos.map(lambda s: s + 0.3),
                      st.booleans()),
            st.builds(LogProb, st.sampled_from(_DENSITY_PRIORS), real, registered=st.just(True)),
            _coef(arith, sample_shape),
        )

    return extend


@st.composite
def integrands(draw, positive: bool = False, sample_shape: tuple = (3,), max_leaves: int = 6) -> Node:
    """An integrand tree; the top may be reduced (linearly or not) or cast to an integer."""
    body = draw(st.recursive(_real_leaf(positive), _extend(positive, tuple(sample_shape)), max_leaves=max_leaves))
    if positive and draw(st.integers(0, 4)) == 0:  # terms that need w > 0
        prior = draw(st.sampled_from(POSITIVE_PRIORS))
        pos_term = draw(st.sampled_from((Log(W(True)), LogProb(prior, W(True), 0.0, draw(_pos) + 0.3,
                                                                 draw(st.booleans())))))
        if body.kind == "real":
            body = Binary("+", body, pos_term)
    top = draw(st.integers(0, 5))
    if top == 0:
        how = draw(st.sampled_from(sorted(REDUCTIONS)))
        if body.kind != "real" and how not in DISCRETE_REDUCTIONS:  # torch takes no mean of integers
            how = "sum"
        body = Reduce(body, how)
    elif top == 1 and body.kind == "real":
        body = Binary("+", Reduce(body, draw(st.sampled_from(("sum", "mean")))), body)
    elif top == 2:
        body = Compare(body if body.kind != "bool" else W(positive), draw(st.sampled_from((">", "<"))), draw(_small))
        if draw(st.booleans()):
            body = Cast(body, draw(st.sampled_from(sorted(CASTS))))
    return body
