"""Property-based tests of the engine's contracts on drawn families, integrands and arguments.

Hypothesis draws a registered family with random parameters (scalars, broadcasting
``loc``/``scale``, ``Independent``, chains of transforms, generic ``rsample`` families),
an integrand from the grammar of ``integrand_grammar``, a dtype, M, a seed and a chunk
size, and checks:

1. same seed ⇒ same value and gradients in ``direct``, ``auto`` and every forced tier
   that accepts the integrand, at any chunk size (``same_noise_tolerances``; a zero and
   an absent gradient are the same);
2. the result's dtype is ``fn``'s when ``fn`` returns a floating tensor, and the
   distribution's floating dtype when it returns integers or booleans (the expectation
   of an indicator is a probability), with ``fn``'s shape; such results carry no gradient;
3. every error is a ``ValueError``/``TypeError``/``NotImplementedError`` whose message
   names the offending argument, never a torch internal error;
4. ``explain`` succeeds wherever ``expectation`` does, with the tiers ``auto`` used.

Examples per test follow the profile of ``hypothesis_profiles`` (``make test-props-slow``
runs many more). Inputs that once broke a property are pinned with ``@example``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from hypothesis import event, example, given, strategies as st
from torch import distributions as D
from torch.distributions import transforms as T
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import mcgraph as mg
import mcgraph.engine.api as api
from mcgraph.engine.estimators.sampling import samples, stream_for
from mcgraph.engine.plan.tracer import is_discrete
from mcgraph import distributions as mgd

from support.families_table import FAMILY_FACTORIES, is_positive
from support.hypothesis_profiles import examples
from support.integrand_grammar import (Affine, Apply, Binary, Cast, Coef, Compare, Divide, ExpAffine, Log, LogProb, Maximum,
                              Power, Reduce, Unary, W, Where, as_positive, compile_integrand, integrands, leaf)
from support.same_noise_tolerances import TOLERANCES, assert_same

F32, F64 = torch.float32, torch.float64

#: Families with no sampling form (every term goes chunked through ``rsample``), all with
#: positive support: name -> (mu, s) -> Distribution.
GENERIC_FAMILIES = {
    "Beta": lambda mu, s: D.Beta(s + 0.5, 2 * s + 0.5),
    "Gamma(concentration with grad)": lambda mu, s: D.Gamma(s + 1.0, s),
    "Kumaraswamy": lambda mu, s: D.Kumaraswamy(s + 0.5, s + 1.0),
}

#: Elementwise transforms drawn on top of a family: name -> (needs positive input, output positive).
TRANSFORMS = {"affine": (False, False), "exp": (False, True), "sigmoid": (False, True),
              "tanh": (False, False), "softplus": (False, True), "power": (True, True)}


@dataclass(frozen=True)
class Family:
    """A drawn posterior: a factory, parameter shapes and values, transforms and Independent."""

    name: object  # a key of FAMILY_FACTORIES or GENERIC_FAMILIES
    mu_shape: tuple
    s_shape: tuple
    param_seed: int
    dtype: torch.dtype
    transforms: tuple = ()  # ((name, value, grad), ...)
    reinterpreted: int = 0  # Independent(·, reinterpreted) around everything

    def build(self, cast=None, tangents=None):
        """``(q, leaves)``: the distribution and the tensors its gradients are taken for.

        ``cast``: build from the same ``self.dtype`` values, cast to this dtype (exactly, when wider).
        ``tangents``: forward-mode AD instead of grad, as in ``integrand_grammar.Build``.
        """
        g = torch.Generator().manual_seed(self.param_seed)
        dtype = cast or self.dtype
        mu = (torch.randn(self.mu_shape, generator=g, dtype=F64) * 0.5 + 0.2).to(self.dtype).to(dtype)
        s = (torch.rand(self.s_shape, generator=g, dtype=F64) * 0.6 + 0.4).to(self.dtype).to(dtype)
        leaves = [leaf(mu, 0, tangents), leaf(s, 1, tangents)]
        mu, s = leaves
        factory = FAMILY_FACTORIES[self.name][0] if self.name in FAMILY_FACTORIES else GENERIC_FAMILIES[self.name]
        q = factory(mu, s)
        if self.transforms:
            ts = []
            for name, value, grad in self.transforms:
                p = torch.tensor(value, dtype=self.dtype).to(dtype)
                if grad:
                    p = leaf(p, len(leaves), tangents)
                    leaves.append(p)
                ts.append({"affine": lambda: T.AffineTransform(p, 0.5 + p * p), "exp": T.ExpTransform,
                           "sigmoid": T.SigmoidTransform, "tanh": T.TanhTransform,
                           "softplus": T.SoftplusTransform, "power": lambda: T.PowerTransform(1.0 + p * p)}[name]())
            q = D.TransformedDistribution(q, ts)
        if self.reinterpreted:
            q = D.Independent(q, self.reinterpreted)
        return q, leaves

    @property
    def positive(self) -> bool:
        out = self.name in GENERIC_FAMILIES or is_positive(self.name)
        for name, _, _ in self.transforms:
            out = TRANSFORMS[name][1]
        return out


_SHAPES = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)


def _broadcast_variant(shape):
    """A shape that broadcasts to ``shape``: some dims set to 1, leading dims possibly dropped."""
    return st.tuples(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)),
                     st.integers(0, len(shape))).map(
        lambda a: tuple(1 if one else d for one, d in zip(a[0], shape))[a[1]:])


@st.composite
def families(draw, dtype=None):
    names = list(FAMILY_FACTORIES) + list(GENERIC_FAMILIES)
    name = draw(st.sampled_from(names))
    shape = draw(_SHAPES)
    if name is D.Independent and not shape:
        shape = (2,)
    mu_shape, s_shape = shape, shape
    if draw(st.booleans()):
        mu_shape = draw(_broadcast_variant(shape))
        s_shape = draw(_broadcast_variant(shape))
        if name is D.Independent and not torch.broadcast_shapes(mu_shape, s_shape):
            mu_shape = shape
    dtype = dtype or draw(st.sampled_from((F64, F32)))
    fam = Family(name, mu_shape, s_shape, draw(st.integers(0, 2**16)), dtype)
    elementwise = name not in (D.Independent, mgd.Radial)
    if elementwise and draw(st.integers(0, 3)) == 0:
        positive = fam.positive
        chain = []
        for _ in range(draw(st.integers(1, 3))):
            tname = draw(st.sampled_from(sorted(TRANSFORMS)))
            if TRANSFORMS[tname][0] and not positive:
                tname = "exp"
            positive = TRANSFORMS[tname][1]
            chain.append((tname, draw(st.floats(-1.0, 1.0).map(lambda x: round(x, 3))), draw(st.booleans())))
        fam = Family(name, mu_shape, s_shape, fam.param_seed, dtype, tuple(chain))
    batch = len(fam.build()[0].batch_shape)
    if batch and draw(st.booleans()):
        fam = Family(fam.name, mu_shape, s_shape, fam.param_seed, dtype, fam.transforms,
                     draw(st.integers(1, batch)))
    return fam


@dataclass(frozen=True)
class Case:
    """One call of the engine: family, integrand, M, seed, chunk size."""

    family: Family
    integrand: object
    num_samples: int
    seed: int
    chunk: int

    def run(self, method: str, chunk_size):
        q, leaves = self.family.build()
        fn, fn_leaves = compile_integrand(self.integrand, self.family.dtype)
        value = mg.expectation(fn, q, self.num_samples, seed=self.seed, method=method, chunk_size=chunk_size)
        targets = leaves + fn_leaves
        grads = (torch.autograd.grad(value.sum(), targets, allow_unused=True) if value.requires_grad
                 else (None,) * len(targets))
        return value, grads

    def _reference_rows(self):
        """``(form, rows)``: the form of q and the stream rows every method of this case reads."""
        form = mg.family_of(self.family.build()[0])
        return form, stream_for(form, self.seed, self.num_samples).rows(0, self.num_samples)

    def float64_witness(self):
        """``(value, gradients)`` of the direct estimate recomputed in float64 on the same noise, or ``None``.

        Judges a tier that is finite where the reference overflowed, or far from it where the reference
        is ill-conditioned. Gradients are by reverse mode, as the reference takes them, wherever that is
        finite in float64; entry by entry by forward-mode AD where float64 reverse mode itself overflows:
        through ``(1/softplus(w))**3`` it forms ``softplus(w)**-4`` before multiplying by ``sigmoid(w)``,
        and through ``clamp(exp(w))`` multiplies the clamp's zero by ``exp(w) = inf``, so the direct
        gradient is −inf or NaN where the true one (and the fused tier's forward rules) is finite; forward
        mode multiplies in the other order. And ``log w`` of ``w = exp(x)`` underflowed to 0 is −inf in
        float32, where the engine's ``log exp x = x`` and float64 agree. Only for sampling forms: a generic
        form's noise is its ``rsample``, with no float64 twin.

        Forward mode is not the first choice: torch's forward rule of ``maximum`` (and ``minimum``,
        ``fmax``, ``fmin``) is ``ẏ + [x > y]·(ẋ − ẏ)``, which loses ``ẋ`` when the other branch's tangent
        ``ẏ`` is huge (``w / softplus(w) = −2e102`` at a Cauchy draw ``w = −232``: the tangent is −2e104,
        and ``ẏ + (ẋ − ẏ) = 0``, not ``ẋ = 1``) and is NaN when it is infinite. Here ``maximum`` and
        ``minimum`` select the winning branch's tangent instead (:class:`_SelectedTangents`).
        """
        form, rows = self._reference_rows()
        if not isinstance(form, mg.SamplingForm):
            return None
        rows = rows.to(F64)
        estimate = functools.partial(self._estimate_f64, rows)
        value, targets = estimate()
        grads = (torch.autograd.grad(value.sum(), targets, allow_unused=True) if value.requires_grad
                 else (None,) * len(targets))
        grads = [torch.zeros_like(t) if g is None else g.clone() for g, t in zip(grads, targets)]
        for k, g in enumerate(grads):
            for j in torch.nonzero(~torch.isfinite(g.view(-1))).view(-1).tolist():
                tangent = torch.zeros_like(g)
                tangent.view(-1)[j] = 1.0
                with fwAD.dual_level(), _SelectedTangents():
                    derivative = fwAD.unpack_dual(estimate((k, tangent))[0].sum()).tangent
                g.view(-1)[j] = 0.0 if derivative is None else derivative
        return value.detach(), grads

    def _estimate_f64(self, rows, tangent_of_leaf=None):
        """``(direct estimate, leaves)`` in float64 on the noise ``rows``; ``tangent_of_leaf``: ``(k, tangent)``
        makes the ``k``-th leaf (the family's first) a dual tensor (inside ``fwAD.dual_level``)."""
        k, tangent = tangent_of_leaf or (-1, None)
        tangents = None if tangent_of_leaf is None else {k: tangent}
        q, leaves = self.family.build(cast=F64, tangents=tangents)
        fn, fn_leaves = compile_integrand(self.integrand, F64,
                                          tangents=None if tangents is None else {k - len(leaves): tangent})
        values = [fn(w) for w in samples(mg.family_of(q), rows)]
        return torch.stack([v.to(F64) if is_discrete(v.dtype) else v for v in values]).mean(0), leaves + fn_leaves

    def summand_magnitudes(self):
        """``(value, [per leaf])``: the largest finite ``|s|`` and ``|∂s/∂θ|`` over the operands ``s`` of the
        additions and reductions of the direct estimate (``fn``'s and the mean over samples), in float64 on
        the same noise; ``None`` for a generic form (no float64 twin of its noise).

        The engine splits ``fn`` into terms at these operations (by linearity) and sums the terms' values
        and gradients in its own order: where ``fn`` cancels summands of 1e108 (``x − x.mean()`` with
        ``x = w + w / softplus(w)`` at a Cauchy draw), their rounding is what the tiers may differ by.
        Derivatives are forward-mode tangents, one leaf entry at a time (``_SelectedTangents``).
        """
        form, rows = self._reference_rows()
        if not isinstance(form, mg.SamplingForm):
            return None
        rows = rows.to(F64)
        with torch.no_grad(), _SummandMagnitudes() as seen:
            _, leaves = self._estimate_f64(rows)
        value = seen.primal
        per_leaf = []
        for k, target in enumerate(leaves):
            largest = 0.0
            for j in range(target.numel()):
                tangent = torch.zeros_like(target, dtype=F64)
                tangent.view(-1)[j] = 1.0
                with torch.no_grad(), fwAD.dual_level(), _SelectedTangents(), _SummandMagnitudes() as seen:
                    self._estimate_f64(rows, (k, tangent))
                largest = max(largest, seen.tangent)
            per_leaf.append(largest)
        return value, per_leaf

    def summands(self):
        """``(value, [per leaf])``: the magnitudes a tier's rounding may scale with (``assert_same``'s
        ``summands``): the largest of :meth:`summand_magnitudes` and, for gradients, of
        :meth:`gradient_summands`."""
        terms = self.summand_magnitudes()
        value, per_leaf = terms if terms is not None else (0.0, None)
        jacobian = self.gradient_summands()
        per_leaf = [max(0.0 if j is None else float(j.max()), 0.0 if per_leaf is None else per_leaf[k])
                    for k, j in enumerate(jacobian)]
        return value, per_leaf

    def gradient_summands(self):
        """Per leaf, ``Σ_j |∂v_j/∂θ|`` over the direct estimate's output entries ``v_j`` (finite ones;
        ``None`` for a leaf ``v`` does not reach): the summands of the compared ``∂(Σ_j v_j)/∂θ``."""
        q, leaves = self.family.build()
        fn, fn_leaves = compile_integrand(self.integrand, self.family.dtype)
        value = mg.expectation(fn, q, self.num_samples, seed=self.seed, method="direct")
        targets = leaves + fn_leaves
        sums = [None] * len(targets)
        if not value.requires_grad:
            return sums
        for entry in value.reshape(-1):
            grads = torch.autograd.grad(entry, targets, retain_graph=True, allow_unused=True)
            for k, g in enumerate(grads):
                if g is not None:
                    g = torch.where(torch.isfinite(g), g.abs(), torch.zeros_like(g))
                    sums[k] = g if sums[k] is None else sums[k] + g
        return sums

    def samples_overflow(self) -> bool:
        """Whether a sample is ±inf or NaN even in float64 (the float32 noise cast exactly; a generic
        form's ``rsample`` rows in their own dtype): then it is no real number and ``fn`` has no value
        there to compare. ``w / w`` at ``w = exp(exp(x)) = inf`` is NaN in direct and 1 by the engine's
        algebra; ``(w + log Gamma(w)) > 0`` is False (NaN > 0) in direct and True by the algebra."""
        form, rows = self._reference_rows()
        if isinstance(form, mg.SamplingForm):
            with torch.no_grad():
                rows = samples(mg.family_of(self.family.build(cast=F64)[0]), rows.to(F64))
        return not bool(torch.isfinite(rows).all())

    def reference_output(self):
        """``fn`` on one sample: ``(output, the sample's dtype, the floating dtypes fn computed in)``.

        Raises:
            NoRealSample: ``fn`` raised on a sample that is ±inf or NaN (no real number to evaluate at).
        """
        q, _ = self.family.build()
        fn, _ = compile_integrand(self.integrand, self.family.dtype)
        with torch.no_grad(), torch.random.fork_rng():  # seeded: a replayed example sees the same sample
            torch.manual_seed(self.seed)
            w = q.sample()
            try:
                with _FloatingDtypes() as computed:
                    out = fn(w)
            except Exception as e:  # noqa: BLE001 — re-raised unless the sample is no real number
                if bool(torch.isfinite(w).all()):
                    raise
                raise NoRealSample(f"fn raised {type(e).__name__} at a non-finite sample") from e
            return out, w.dtype, computed.seen


class NoRealSample(Exception):
    """``fn`` raised on a sample that is ±inf or NaN: there is no value to compare."""


def _selected(x, y, wins):
    """``x`` where ``wins(x, y)``, ``y`` where ``wins(y, x)``, their mean at a tie (and NaN if either is)."""
    return torch.where(wins(x, y), x, torch.where(wins(y, x), y, 0.5 * x + 0.5 * y))


class _SelectedTangents(TorchFunctionMode):
    """``maximum`` / ``minimum`` as a selection (``where``), whose forward-mode tangent is the selected
    branch's, not ``ẏ + [x > y]·(ẋ − ẏ)``: the same values and the same gradients as reverse mode
    (half to each at a tie), with no cancellation against the other branch's tangent."""

    SELECT = {torch.maximum: torch.gt, torch.Tensor.maximum: torch.gt,
              torch.minimum: torch.lt, torch.Tensor.minimum: torch.lt}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        wins = self.SELECT.get(func)
        if wins is not None and not kwargs and len(args) == 2:
            return _selected(*args, wins)
        return func(*args, **(kwargs or {}))


def _largest_finite(x) -> float:
    x = x[torch.isfinite(x)] if x.is_floating_point() else x.to(F64)
    return float(x.abs().max()) if x.numel() else 0.0


class _SummandMagnitudes(TorchFunctionMode):
    """Records the largest finite ``|x|`` (``primal``) and forward tangent ``|ẋ|`` (``tangent``) over the
    tensor operands of additions, subtractions, negations and sums/means: the summands a linear split sums."""

    ADDITIVE = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, torch.sub, torch.Tensor.sub,
                torch.Tensor.__sub__, torch.Tensor.__rsub__, torch.neg, torch.Tensor.neg, torch.Tensor.__neg__,
                torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean}

    def __init__(self):
        super().__init__()
        self.primal = self.tangent = 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.ADDITIVE:
            for a in args:
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    primal, tangent = fwAD.unpack_dual(a)
                    self.primal = max(self.primal, _largest_finite(primal))
                    if tangent is not None:
                        self.tangent = max(self.tangent, _largest_finite(tangent))
        return func(*args, **(kwargs or {}))


class _FloatingDtypes(TorchFunctionMode):
    """Records the floating dtypes of every tensor the torch calls inside it return."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen.update(t.dtype for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
        return out


@st.composite
def cases(draw):
    fam = draw(families())
    q, _ = fam.build()
    sample_shape = tuple(q.batch_shape + q.event_shape)
    integrand = draw(integrands(positive=fam.positive, sample_shape=sample_shape))
    M = draw(st.integers(1, 24))
    return Case(fam, integrand, M, draw(st.integers(0, 2**31)), draw(st.integers(1, M + 3)))


# --------------------------------------------------------------------------- helpers

#: The arguments of ``expectation`` / ``explain`` an error message may name.
ARGUMENTS = ("fn", "dist", "num_samples", "seed", "method", "chunk_size", "taylor_order")
_NAMED = re.compile(r"\b(" + "|".join(ARGUMENTS) + r")\b")
NOT_APPLICABLE = re.compile(r"method='[\w-]+' does not apply to term")


def assert_ours(exc: BaseException, bad: tuple = ARGUMENTS) -> None:
    """A documented error type whose message names one of the ``bad`` arguments."""
    assert isinstance(exc, (ValueError, TypeError, NotImplementedError)), \
        f"raw {type(exc).__name__} escaped: {exc}"
    named = set(_NAMED.findall(str(exc)))
    assert named & set(bad), f"{type(exc).__name__} names none of {bad}: {exc}"


@contextlib.contextmanager
def recorded_plans():
    """The plans ``expectation`` uses (api._plan observed, not replaced: a stored trace's plan is classified
    once and reused, so ``classify`` itself is not called on every call)."""
    plans = []
    original = api._plan

    def observe(*args, **kwargs):
        plan = original(*args, **kwargs)
        plans.append(plan)
        return plan

    api._plan = observe
    try:
        yield plans
    finally:
        api._plan = original


def _expected_dtype(out: torch.Tensor, sample_dtype: torch.dtype) -> torch.dtype:
    return out.dtype if (out.is_floating_point() or out.is_complex()) else sample_dtype


# --------------------------------------------------------------------------- properties 1, 2, 4

# Regressions: each pinned input once broke a property.
_NORMAL = Family(D.Normal, (3,), (3,), 0, F64)
_MAX_OF_W_AND_W_OVER_SOFTPLUS = Reduce(Maximum(W(), Divide(W(), Unary("softplus", W()))), "flip_scale")
#: E[x − x.mean()], x = w⁴, w ~ HalfCauchy: the entries sum to zero for every sample, so the compared gradient
#: of their sum is exactly zero by the collapsed tier's algebra and −2.3e-5 in direct's rounding of ~1e11 terms.
_SUM_OF_CENTRED_QUARTICS = Case(Family(D.HalfCauchy, (3,), (3,), 0, F64), Reduce(Power(Power(W(), 2), 2), "minus_mean"),
                                5, 0, 1)
#: E[x − x.mean()] of a scalar x = w + w / softplus(w): zero, with terms of 1e108 at a Cauchy draw (seed 1414213).
_CANCELLING_TERMS = Case(Family(D.Cauchy, (), (), 0, F64),
                         Reduce(Binary("+", W(), Divide(W(), Unary("softplus", W()))), "minus_mean"), 4, 175, 1)
#: E[−log relu(w)], w ~ Normal: +inf (any w < 0 gives −log 0). It has no derivative; relu's backward masks the
#: −inf to a zero gradient, the fused tier's forward rule divides a zero tangent by a zero (NaN).
_MINUS_LOG_RELU = Case(Family(D.Normal, (), (), 0, F64, (("affine", 0.0, False),)),
                       LogProb("log_uniform", Apply("relu", W()), registered=True), 1, 0, 1)


@given(case=cases())
@example(case=Case(_NORMAL, Compare(W(), ">", 0.0), 50, 1, 7))  # P(w > 0): bool, raw torch error
@example(case=Case(_NORMAL, Cast(Compare(W(), ">", 0.0), "long"), 50, 1, 7))  # int: float32 under float64
@example(case=Case(_NORMAL, Reduce(Compare(W(), ">", 0.0), "sum"), 9, 3, 2))  # a count: direct failed
@example(case=Case(Family("Kumaraswamy", (2,), (2,), 0, F64), W(), 5, 0, 2))  # fused dropped grads of a, b
@example(case=Case(Family(D.Normal, (2,), (2,), 0, F64, (("exp", 0.0, False), ("power", 0.5, True))),
                   Unary("abs", W()), 5, 0, 2))  # ... and of a PowerTransform's exponent
@example(case=Case(Family(D.HalfCauchy, (), (), 0, F32), Coef(W(), (-1.588, 0.1), (2,)), 2, 5, 2))  # fused: wrong
@example(case=Case(_NORMAL, Coef(ExpAffine(W(), 0.3, -1.0), (-1.0, 2.0), (2, 1), True), 30, 5, 20))  # fused: raised
@example(case=Case(Family(D.HalfCauchy, (), (), 2, F32), Divide(W(True), W(True)), 2, 3, 3))  # w/w: a float, no tensor
@example(case=Case(Family(D.HalfCauchy, (), (), 2, F32),
                   Where(Compare(Divide(W(True), W(True)), "<=", 0.5), W(True), Power(W(True), 2)), 2, 3, 3))
@example(case=Case(Family(mgd.Logistic, (), (), 474, F64), Reduce(Cast(Compare(W(), ">", 0.0), "double"), "flip_scale"),
                   3, 3, 1))  # 2.0 * a boolean's linear map: a float result from a boolean term
# An integer term times a Python float is float32 (torch's default dtype) under a float64 q: compared at
# float32's tolerance (found by the slow profile).
@example(case=Case(Family(D.Normal, (), (), 0, F64, (("affine", 0.0, False),)),
                   Affine(Cast(Compare(W(), ">", 0.0), "long"), 0.5, 0.672), 1, 1, 1))
# A 0-d float64 coefficient times a float32 term of a scalar q: float64 per sample (two 0-d tensors),
# float32 on the fused tier's batched rows until it evaluated scalar samples under vmap (slow profile).
@example(case=Case(Family(D.Laplace, (), (), 0, F64),
                   Reduce(Coef(Cast(Compare(W(), ">", 0.0), "float"), (0.688,), ()), "flip_scale"), 1, 0, 1))
# A float64 Beta (concentrations stored in an inner Dirichlet) read as float32 by its form, so the plan
# cache reused a float32 case's trace: float64 in, float32 out (slow profile; regression test in
# tests/engine/test_plan_cache.py, since it needs a float32 case first in the same process).
@example(case=Case(Family("Beta", (), (), 0, F32, (("affine", 0.0, False),)), Reduce(W(), "flip_scale"), 1, 0, 1))
@example(case=Case(Family("Beta", (), (), 0, F64, (("affine", 0.0, False),)), Reduce(W(), "flip_scale"), 1, 0, 1))
# exp(affine(exp(Exponential))) overflows to inf: the direct gradient is −inf, the chunked one NaN (a generic
# form's chunk backpropagates through its whole block's rsample graph: 0·inf); both non-finite (slow profile).
@example(case=Case(Family(D.Exponential, (1, 1), (1, 1), 0, F64,
                          (("exp", 0.0, False), ("affine", 0.0, True), ("exp", 0.0, False))),
                   Binary("+", W(True), Log(W(True))), 10, 0, 1))
# The grammar called long + long a real node, so as_positive applied softplus to integers (a raw torch
# error in the test's own integrand; slow profile): a sum of integers is an integer node now.
@example(case=Case(Family(D.Normal, (), (), 0, F64, (("affine", 0.0, False),)),
                   Divide(W(), as_positive(Binary("+", Cast(Compare(W(), ">", 0.0), "long"),
                                                  Cast(Compare(W(), ">", 0.0), "long")))), 1, 0, 1))
# (1/softplus(w))**3 at a far Cauchy tail: reverse mode overflows softplus(w)**-4 to inf before multiplying by
# sigmoid(w), so the direct gradient is −inf; the fused tier's forward rules give −2.4e37, which the float64
# recomputation on the same noise confirms (slow profile).
@example(case=Case(Family(D.Cauchy, (), (), 8694, F32),
                   Reduce(Power(Apply("reciprocal", as_positive(W(positive=False))), 3), "flip_scale"), 15, 316, 1))
# clamp(exp(w)) at a HalfCauchy sample of 767: exp overflows in both dtypes, reverse mode multiplies clamp's zero
# derivative by inf (NaN), forward rules give 0; forward-mode AD in float64 agrees (slow profile).
@example(case=Case(Family(D.HalfCauchy, (1, 2), (1, 2), 0, F32), Apply("clamp", ExpAffine(W(True), 1.0, 0.0)), 5, 0, 1))
@example(case=Case(Family(D.HalfCauchy, (1, 2), (1, 2), 0, F64), Apply("clamp", ExpAffine(W(True), 1.0, 0.0)), 5, 0, 1))
# 0.562 * (w + int): the sum is float64, but the engine distributed 0.562 over it onto the int term alone, which
# torch made float32 (the default dtype); the tracer now casts a sum's operands to the sum's dtype (slow profile).
@example(case=Case(Family(D.Normal, (), (), 0, F64, (("affine", 0.0, False),)),
                   Affine(Binary("+", W(), Cast(Compare(W(), ">", 0.0), "int")), 0.562, 0.5), 1, 1, 1))
# w + log Gamma(w) at w = exp(Cauchy) = inf: NaN per sample in direct, −inf as a sum of terms (slow profile).
@example(case=Case(Family(D.Cauchy, (), (), 0, F32, (("exp", 0.0, False),)),
                   Binary("+", W(True), LogProb("gamma", W(True), 0.0, 1.3, False, False)), 10, 0, 1))
# w + log w at w = exp(Cauchy) underflowed to 0 in float32: direct is −inf, the engine's log exp x = x is finite,
# and so is float64 on the same noise (slow profile).
@example(case=Case(Family(D.Cauchy, (), (), 0, F32, (("exp", 0.0, False),)),
                   Reduce(Binary("+", W(True), Log(W(True))), "flip_scale"), 2, 750, 1))
# A scale-mixture prior's log-density of a scale mixture's log-density in float32: direct is 6e-4 from float64 on
# the same noise, the fused tier 1.5e-3; both are as accurate as float32 allows here (slow profile).
@example(case=Case(Family(D.Independent, (2,), (2,), 4, F32),
                   LogProb("scale_mixture", LogProb("scale_mixture", W(), -1.462, 1.8, False, False),
                           0.0, 1.0, False, True),
                   11, 179411424, 1))
# exp(2 log softplus(w)) at w = −103 in float32: softplus is subnormal and σ(w) = 0; the fused tier's log rule
# multiplied 0 by 1/x = inf (NaN) where direct divides, 0/x = 0; rules of the form ẋ/g(x) now divide (slow profile).
@example(case=Case(Family(D.Cauchy, (), (), 1, F32), Apply("exp_k_log", as_positive(W())), 17, 2410, 1))
# w / w at w = exp(exp(affine(Cauchy))) = inf even in float64: direct and float64 give NaN, the engine's algebra
# gives 1; and (w + log Gamma(w)) > 0 at such a w: False in direct (NaN > 0), True by the algebra. No real sample,
# no value to compare: only dtype and shape are checked (slow profile).
@example(case=Case(Family(D.Cauchy, (1, 1), (1, 1), 0, F64, (("affine", 0.0, False), ("exp", 0.0, False),
                                                             ("exp", 0.0, False))),
                   Divide(W(True), W(True)), 1, 1, 1))
@example(case=Case(Family(D.LogNormal, (2, 2), (2, 2), 0, F64, (("exp", 0.0, False), ("exp", 0.0, False))),
                   Compare(Binary("+", W(True), LogProb("gamma", W(True), 0.0, 0.8, False, False)), ">", 0.0),
                   2, 8191, 1))
# 0.5·long + 0.688 is float32 inside a float64 result: direct rounds 1.188 to float32, auto adds 0.688 to the
# float64 log-term by linearity; they differ at float32's precision (slow profile).
@example(case=Case(Family(D.Normal, (), (), 0, F64, (("exp", 0.0, False),)),
                   Binary("+", Affine(Cast(Compare(W(), ">", 0.0), "long"), 0.5, 0.688), Log(W(positive=True))),
                   1, 0, 1))
# max(w, w / softplus(w)) at a Cauchy draw w = −232 (float32 direct: NaN, softplus underflows): the fused tier's
# gradient is float64 reverse mode's, but the forward-mode witness lost the selected branch's tangent to torch's
# rule ẏ + [x > y]·(ẋ − ẏ) with ẏ = −2e104 (seed 20261126, slow profile); and at w = −1023, where w / softplus(w)
# is −inf even in float64 and float64 reverse mode is NaN, that rule gave NaN.
# horseshoe.log_prob(0·w) at a float32 reference sample w = exp(exp(Exponential draw)) = inf: 0·w is NaN and the
# prior's support check raises (seed 90210, slow profile). No real sample: only that every error is ours (the
# direct-raises case is test_an_infinite_sample_where_direct_raises_and_a_cached_plan_returns_is_judged_fairly).
@example(case=Case(Family(D.Exponential, (), (), 0, F32, (("exp", 0.0, False), ("exp", 0.0, False))),
                   LogProb("horseshoe", Affine(W(), 0.0, 0.0), registered=True), 1, 0, 1))
@example(case=Case(Family(D.Cauchy, (), (), 0, F32), _MAX_OF_W_AND_W_OVER_SOFTPLUS, 5, 22960, 1))
@example(case=Case(Family(D.Cauchy, (), (), 0, F32), _MAX_OF_W_AND_W_OVER_SOFTPLUS, 3, 1226, 1))
@example(case=_SUM_OF_CENTRED_QUARTICS)  # the gradient of a sum that cancels summands ~1e11 (seed 90210)
@example(case=_CANCELLING_TERMS)  # auto's sum of four terms ~1e108 rounds to 1.0, direct's to 0 (seed 1414213)
@example(case=_MINUS_LOG_RELU)  # E = +inf: direct's gradient 0, the fused tier's NaN (seed 777001)
# log(0.5·(0.125·w)³) at w ≈ 1e13 in float32: the trace expands (0.125·w)³ to 0.00195·w³, whose w³ overflowed to
# inf where direct's (0.125·w)³ is finite; polynomials are evaluated by Horner's rule now (seed 8675309, slow profile).
@example(case=Case(Family(D.TransformedDistribution, (1,), (1,), 1470, F32,
                          (("exp", 0.0, False), ("power", 0.0, False), ("power", 0.0, False))),
                   Reduce(Apply("log_monomial", Affine(W(), 0.125, 0.0)), "flip_scale"), 5, 34563685, 1))
@examples(150)
def test_same_seed_same_value_and_gradients(case):
    try:
        out, sample_dtype, computed = case.reference_output()
    except NoRealSample:
        event("fn raised at a sample that is ±inf or NaN: only that every error is ours")
        _errors_are_ours(case)
        return
    dtype = _expected_dtype(out, sample_dtype)
    # The coarsest of q's dtype, the result's and those fn computes in: a float32 result of a float64 q is
    # rounded to float32, and so is a float32 part of a float64 result (an integer term times a Python
    # float), whose rounding a sum split into terms by linearity does not repeat.
    rtol, atol = TOLERANCES[torch.float32 if torch.float32 in {case.family.dtype, dtype, *computed}
                            else case.family.dtype]
    try:
        ref = case.run("direct", None)
    except Exception as e:  # noqa: BLE001 — any error must be one of ours; then every method fails alike
        event(f"direct raised {type(e).__name__}")
        assert_ours(e)
        if case.samples_overflow():
            # no real sample: direct's arithmetic meets inf or NaN (w / w, 0·w) where the engine's algebra
            # may not (w / w = 1): a method may raise the same error or return, never raise another kind
            event("direct raised at a sample that is ±inf or NaN even in float64: only that errors are ours")
            _errors_are_ours(case)
            return
        with pytest.raises(type(e)):
            case.run("auto", None)
        return
    with recorded_plans() as plans:
        auto = case.run("auto", None)
    assert plans, "expectation formed no plan through api._plan: observe auto's plan where it is formed"
    plan = mg.explain(*_explain_args(case))
    assert plan.tiers == plans[-1].tiers, f"explain says {plan.tiers}, auto used {plans[-1].tiers}"
    event(f"auto tiers: {' + '.join(sorted({str(t) for t in plan.tiers})) or 'constant'}")
    event(f"result dtype: {dtype}" + (" (boolean/integer fn)" if not out.is_floating_point() else ""))
    witness = functools.cache(case.float64_witness)  # computed only if the reference overflowed
    summands = functools.cache(case.summands)  # computed only where a comparison misses the tolerance
    overflowed = case.samples_overflow()
    if overflowed:
        event("a sample is ±inf or NaN even in float64: values not compared")
    runs = [("direct", None), ("auto", None)] + [(m, case.chunk) for m in ("auto", "collapsed", "fused", "chunked")]
    for method, chunk in runs:
        try:
            got = {("direct", None): ref, ("auto", None): auto}.get((method, chunk)) or case.run(method, chunk)
        except ValueError as e:
            if method in ("collapsed", "fused") and NOT_APPLICABLE.search(str(e)):
                with pytest.raises(ValueError, match=NOT_APPLICABLE):
                    mg.explain(*_explain_args(case), method=method)
                continue
            raise
        value, what = got[0], f"{method}/chunk={chunk}"
        assert value.dtype == dtype, f"{what}: dtype {value.dtype}, expected {dtype}"
        assert value.shape == out.shape, f"{what}: shape {tuple(value.shape)}, expected {tuple(out.shape)}"
        if not (out.is_floating_point() or out.is_complex()):
            assert not value.requires_grad, f"{what}: a boolean/integer integrand's result requires grad"
        if overflowed:
            continue
        assert_same((ref[0].detach(), ref[1]), (value.detach(), got[1]), rtol, atol, what, none_is_zero=True,
                    witness=witness, summands=summands)


def test_an_infinite_sample_where_direct_raises_and_a_cached_plan_returns_is_judged_fairly():
    """At w = exp(exp(x)) = inf (even in float64), laplace.log_prob(w / w) is log_prob(NaN): direct's support
    check raises. With the plan cache holding the trace made at a finite sample, the engine evaluates
    w / w = 1 by its algebra and returns. Neither is a value at a real number; the judge asks only that any
    error is ours (seed 90210 of the slow profile found it; the old judge demanded that auto raise too)."""
    validating = D.Distribution._validate_args  # the support check that raises at NaN (global torch state)
    D.Distribution.set_default_validate_args(True)
    try:
        _judge_an_infinite_sample_where_direct_raises()
    finally:
        D.Distribution.set_default_validate_args(validating)


def _judge_an_infinite_sample_where_direct_raises():
    from hypothesis import given, settings

    from mcgraph.engine.plan.tracer import IntegrandError

    term = Binary("+", LogProb("laplace", Divide(W(), W()), registered=True), Log(W(positive=True)))
    fam = Family(D.Exponential, (), (), 0, F64, (("exp", 0.0, False), ("exp", 0.0, False)))
    case = Case(fam, Binary("+", Reduce(term, "sum"), term), 1, 1, 1)
    warm = Case(fam, case.integrand, 1, 2, 1)
    assert case.samples_overflow() and not warm.samples_overflow()
    warm.run("auto", None)  # the plan cache keeps the trace made at a finite sample
    with pytest.raises(IntegrandError):
        case.run("direct", None)
    case.run("auto", None)  # returns: w / w = 1 by the algebra, at w = inf

    @settings(max_examples=1, database=None, deadline=None)
    @given(st.just(case))
    def judged(c):
        test_same_seed_same_value_and_gradients.hypothesis.inner_test(case=c)

    judged()


def _errors_are_ours(case) -> None:
    """Every method on ``case`` returns, or raises an error of ours (one that names an argument)."""
    for method, chunk in [("auto", None), ("chunked", case.chunk), ("direct", None)]:
        try:
            case.run(method, chunk)
        except Exception as e:  # noqa: BLE001
            assert_ours(e)


@pytest.mark.parametrize("case", [
    Case(Family(D.Normal, (2,), (2,), 3, F64, (("affine", 0.3, True), ("exp", 0.0, False))),
         Coef(Binary("+", W(True), Log(W(True))), (0.5, -1.0), (2,), True), 7, 1, 2),
    Case(Family(D.Cauchy, (), (), 8694, F32), Power(Apply("reciprocal", as_positive(W())), 3), 15, 0, 1),
    Case(Family(D.Laplace, (3,), (1,), 1, F32), Apply("clamp", ExpAffine(W(), 0.7, -0.2)), 9, 2, 4),
], ids=["normal+transforms+coef", "cauchy", "laplace-clamp"])
def test_the_float64_witness_equals_direct_where_direct_is_finite(case):
    """The recomputation that judges overflowed references is itself checked against reverse mode."""
    value, grads = case.run("direct", None)
    assert not case.samples_overflow()
    witness_value, witness = case.float64_witness()
    rtol = TOLERANCES[case.family.dtype][0]
    torch.testing.assert_close(witness_value, value.detach().to(F64), rtol=rtol, atol=0.0)
    assert len(witness) == len(grads)
    for g, w in zip(grads, witness):
        g = torch.zeros_like(w) if g is None else g.to(F64)
        assert bool(torch.isfinite(g).all())
        torch.testing.assert_close(w, g, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("case", [
    Case(Family(D.Cauchy, (), (), 0, F32), _MAX_OF_W_AND_W_OVER_SOFTPLUS, 5, 22960, 1),
    Case(Family(D.Cauchy, (), (), 0, F32), _MAX_OF_W_AND_W_OVER_SOFTPLUS, 3, 1226, 1),
], ids=["w=-232: the other branch -2e102", "w=-1023: the other branch -inf in float64"])
def test_the_float64_witness_differentiates_maximum_through_the_selected_branch(case):
    """The witness of E[2 max(w, w / softplus(w))], w = μ + s·x, equals its hand-derived gradient.

    With ``f(w) = 2 max(w, w / softplus(w))``: ``f'(w) = 2`` where ``w`` wins, else
    ``2 (1 / softplus(w) − w σ(w) / softplus(w)²)``; ``∂/∂μ = mean f'(w)``, ``∂/∂s = mean f'(w) (w − μ) / s``.
    Float32 direct is NaN on both draws (the witness judges the finite tiers there); at ``w = −232`` the
    other branch's forward tangent is −2e104 and torch's forward rule of ``maximum`` cancels the selected one
    against it; at ``w = −1023`` float64 reverse mode is NaN as well, so forward mode answers.
    """
    assert not bool(torch.isfinite(case.run("direct", None)[1][0]).all())
    _, rows = case._reference_rows()
    q, (mu, s) = case.family.build(cast=F64)
    with torch.no_grad():
        w = samples(mg.family_of(q), rows.to(F64))
        softplus = torch.nn.functional.softplus(w)
        other = w / softplus
        value = (2 * torch.maximum(w, other)).mean(0)
        df = torch.where(w > other, 2.0, 2 * (1 / softplus - w * torch.sigmoid(w) / softplus ** 2))
        expected = [df.mean(0), (df * (w - mu) / s).mean(0)]
    witness_value, witness = case.float64_witness()
    torch.testing.assert_close(witness_value, value.reshape(1), rtol=1e-12, atol=0.0)
    assert len(witness) == 2
    for got, want in zip(witness, expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=0.0)


def test_the_gradient_of_a_cancelling_sum_is_judged_by_its_summands():
    """Direct's gradient of Σ_j E[x_j − mean x] (exactly zero) is rounding of Jacobian entries ~1e11: the
    judge's absolute floor scales with them (``gradient_summands``), and only where the sum cancels."""
    case = _SUM_OF_CENTRED_QUARTICS
    ref, got = case.run("direct", None), case.run("collapsed", None)
    assert float(ref[1][1].abs().max()) > 1e-6 and bool((got[1][1] == 0).all())
    rtol, atol = TOLERANCES[F64]
    args = ((ref[0].detach(), ref[1]), (got[0].detach(), got[1]), rtol, atol, "collapsed")
    with pytest.raises(AssertionError, match="grad 1"):
        assert_same(*args, none_is_zero=True)
    summands = case.gradient_summands()
    assert float(summands[1].max()) > 1e9
    floors = (0.0, [0.0 if t is None else float(t.max()) for t in summands])
    assert_same(*args, none_is_zero=True, summands=lambda: floors)
    wrong = (got[0].detach(), (None, got[1][1] + 1e-3 * summands[1]))  # an error the size of the summands
    with pytest.raises(AssertionError, match="grad 1"):
        assert_same(args[0], wrong, rtol, atol, "collapsed", none_is_zero=True, summands=lambda: floors)


def test_the_gradient_of_terms_cancelling_inside_fn_is_judged_by_the_terms():
    """E[x − x.mean()] of a scalar x = w + w / softplus(w): zero for every sample. auto splits it into four
    terms (w and −w collapsed, ±w / softplus(w) fused, ~1e108 at a Cauchy draw) and its sum of their
    gradients rounds to 1.0 where direct's is 0: within rounding of the terms, which the judge's floor
    (``summand_magnitudes``: forward tangents of the additions' operands) sees and the output's Jacobian
    (zero here) does not."""
    case = _CANCELLING_TERMS
    ref, got = case.run("direct", None), case.run("auto", None)
    assert float(ref[1][0]) == 0.0 and float(got[1][0]) != 0.0
    assert case.gradient_summands()[0] is None or float(case.gradient_summands()[0].max()) == 0.0
    value, per_leaf = case.summand_magnitudes()
    assert min(per_leaf) > 1e100 and value > 1e100
    rtol, atol = TOLERANCES[F64]
    args = ((ref[0].detach(), ref[1]), (got[0].detach(), got[1]), rtol, atol, "auto")
    with pytest.raises(AssertionError, match="grad 0"):
        assert_same(*args, none_is_zero=True)
    assert_same(*args, none_is_zero=True, summands=case.summands)


def test_gradients_of_an_infinite_expectation_are_compared_only_where_both_are_numbers():
    """E[−log relu(w)] = +inf: direct's gradient is 0, fused's NaN; neither is a derivative, both pass. A
    finite gradient that differs still fails: the rule drops NaN/inf entries, not comparisons."""
    case = _MINUS_LOG_RELU
    ref, got = case.run("direct", None), case.run("fused", None)
    assert math.isinf(float(ref[0].detach())) and bool(torch.isfinite(ref[1][0]).all())
    assert not bool(torch.isfinite(got[1][0]).all())
    rtol, atol = TOLERANCES[F64]
    assert_same((ref[0].detach(), ref[1]), (got[0].detach(), got[1]), rtol, atol, "fused", none_is_zero=True)
    with pytest.raises(AssertionError, match="grad 0"):
        assert_same((ref[0].detach(), ref[1]), (got[0].detach(), (ref[1][0] + 1.0, ref[1][1])), rtol, atol, "x",
                    none_is_zero=True)


def _explain_args(case):
    q, _ = case.family.build()
    fn, _ = compile_integrand(case.integrand, case.family.dtype)
    return fn, q


# --------------------------------------------------------------------------- property 3: errors


class Bad:
    """A bad argument value, labelled for Hypothesis' output."""

    def __init__(self, value, label):
        self.value, self.label = value, label

    def __repr__(self):
        return f"Bad({self.label})"


def _bad_fns(dtype):
    return st.sampled_from([
        Bad(3, "not callable"),
        Bad(lambda w: "w", "returns a str"),
        Bad(lambda w: [w], "returns a list"),
        Bad(lambda w: None, "returns None"),
        Bad(lambda w: w @ torch.ones(7, 7, dtype=dtype), "shape mismatch inside"),
        Bad(lambda w: w.reshape(-1, 11), "bad reshape"),
        Bad(lambda w: w.reshape(-1)[100], "index out of range"),
    ])


_BAD_DISTS = st.sampled_from([
    Bad("normal", "a string"),
    Bad(torch.zeros(3), "a tensor"),
    Bad(D.Bernoulli(torch.tensor([0.3, 0.6])), "no rsample"),
    Bad(D.Categorical(torch.tensor([0.3, 0.7])), "no rsample, integer support"),
    Bad(D.Normal(torch.tensor([0.0, float("nan")]), torch.tensor([1.0, 1.0]), validate_args=False), "NaN loc"),
    Bad(D.Laplace(torch.tensor([0.0, 1.0]), torch.tensor([1.0, float("inf")]), validate_args=False), "inf scale"),
])

_BAD = {
    "num_samples": [0, -3, 2.5, True, "10", None, torch.tensor(5), float("nan")],
    "seed": [-1, 1.5, "0", True, torch.tensor(3)],
    "method": ["Auto", "", None, 3, "collapsed_exact"],
    "chunk_size": [0, -1, 2.5, True, "4", float("inf")],
    "taylor_order": [0, -2, 1.5, True, "2"],
}
_GOOD = {
    "num_samples": st.one_of(st.integers(1, 20), st.just(np.int64(7))),
    "seed": st.one_of(st.none(), st.integers(0, 2**40)),
    "method": st.sampled_from(["auto", "direct", "chunked", "fused", "collapsed", "collapsed-exact", "analytic",
                               "auto-analytic"]),
    "chunk_size": st.one_of(st.none(), st.integers(1, 25)),
    "taylor_order": st.one_of(st.none(), st.integers(1, 3)),
}


@st.composite
def calls(draw):
    """Arguments of ``expectation``, each either good or (sometimes) bad; the bad ones are named."""
    fam = draw(families())
    q, _ = fam.build()
    bad = set()
    fn = draw(integrands(positive=fam.positive, sample_shape=tuple(q.batch_shape + q.event_shape)))
    if draw(st.integers(0, 4)) == 0:
        fn, bad = draw(_bad_fns(fam.dtype)), bad | {"fn"}
    dist = fam
    if draw(st.integers(0, 5)) == 0:
        dist, bad = draw(_BAD_DISTS), bad | {"dist"}
    kwargs = {}
    for name, good in _GOOD.items():
        if draw(st.integers(0, 6)) == 0:
            kwargs[name] = Bad(draw(st.sampled_from(_BAD[name])), name)
            bad.add(name)
        else:
            kwargs[name] = draw(good)
    return fn, dist, kwargs, tuple(sorted(bad)), fam.dtype


def _value(x):
    return x.value if isinstance(x, Bad) else x


@given(call=calls())
# collapsed-exact with a Taylor term of order 3 needed mean ξ³, which the exact law does not give: a raw
# KeyError (found by the slow profile), now a ValueError naming method='collapsed-exact'.
@example(call=(Reduce(Binary("+", W(positive=True), Log(W(positive=True))), "flip_scale"),
               Family(D.LogNormal, (), (), 0, F64), {"num_samples": 7, "seed": None, "method": "collapsed-exact",
                                                    "chunk_size": None, "taylor_order": 3}, (), F64))
@examples(150)
def test_every_error_is_ours_and_explain_never_fails_where_expectation_succeeds(call):
    node, dist, kwargs, bad, dtype = call
    q = dist.build()[0] if isinstance(dist, Family) else dist.value
    fn = node.value if isinstance(node, Bad) else compile_integrand(node, dtype)[0]
    args = {k: _value(v) for k, v in kwargs.items()}
    try:
        mg.expectation(fn, q, args["num_samples"], seed=args["seed"], method=args["method"],
                       chunk_size=args["chunk_size"], taylor_order=args["taylor_order"])
    except Exception as e:  # noqa: BLE001 — the property is about what is raised
        event(f"raised {type(e).__name__} ({'bad ' + '+'.join(bad) if bad else 'good arguments'})")
        assert_ours(e, bad or ARGUMENTS)
        if not bad:  # good arguments may still be refused: a forced tier or Taylor order that does not apply
            assert NOT_APPLICABLE.search(str(e)) or "collapsed-exact" in str(e), f"good call refused: {e}"
        return
    event("succeeded")
    assert not bad, f"bad {bad} accepted"
    mg.explain(fn, q, method=args["method"], taylor_order=args["taylor_order"])


# --------------------------------------------------------------------------- boolean integrands: values


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("method", ["auto", "fused", "chunked", "direct"])
def test_probability_of_positive_weight_matches_the_normal_cdf(dtype, method):
    """E[1{w > 0}] = Φ(μ/σ) for w ~ N(μ, σ²); z-test per element, |z| < 4.5 (false-alarm rate 7e-6 each)."""
    M = 4000
    mu = torch.tensor([-1.0, -0.2, 0.0, 0.3, 1.5], dtype=dtype)
    sigma = torch.tensor([0.5, 1.0, 2.0, 0.7, 1.2], dtype=dtype)
    q = D.Normal(mu.clone().requires_grad_(), sigma)
    p_hat = mg.expectation(lambda w: w > 0, q, M, seed=3, method=method)
    assert p_hat.dtype == dtype and p_hat.shape == mu.shape and not p_hat.requires_grad
    p = 0.5 * (1 + torch.erf(mu.double() / (sigma.double() * math.sqrt(2))))
    z = (p_hat.double() - p) / torch.sqrt(p * (1 - p) / M).clamp_min(1e-12)
    assert bool((z.abs() < 4.5).all()), f"z = {z.tolist()}"
    count = mg.expectation(lambda w: (w > 0).long().sum(), q, M, seed=3, method=method)
    assert count.dtype == dtype and count.shape == ()
    torch.testing.assert_close(count, p_hat.sum(), rtol=1e-5 if dtype == F32 else 1e-12, atol=0)
