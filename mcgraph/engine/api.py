"""The functional API: :func:`expectation`, :func:`kl_divergence`, :func:`explain`."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable

import torch
from torch.distributions import Distribution, constraints

from .estimators import chunked_value, collapsed_value, cpu_fused, direct_value, fused_value, statistics, triton_fused
from .estimators.analytic import analytic_statistics
from .estimators.sampling import default_chunk, samples, stream_for
from .estimators.fused import describe_body
from .closed_form import closed_form_kl, kl_rule
from .plan.families import SamplingForm, distribution_parameters, family_of, is_exp
from .plan.tracer import floating, guarded
from .distributed import sharded
from . import checks
from .noise.streams import resolve_seed
from .methods import KL_METHODS, parse_method
from .options import Sampling, resolve_sampling
from .plan.cache import cached_trace
from .shapes import broadcast_shapes
from .stderr import MCEstimate, StderrCollector, refuse_with_process_group
from .plan.classify import KLPlan, Plan, Tier, classify

_VALIDATE = True


def set_validate_args(value: bool) -> None:
    """Switch the finiteness check of distribution parameters (one host sync per call) on or off."""
    global _VALIDATE
    _VALIDATE = bool(value)


def _sampling_arguments(num_samples, seed, method, chunk_size, return_stderr, process_group) -> tuple:
    """The functional API's sampling arguments, from keywords or a :class:`~mcgraph.Sampling` passed as
    ``num_samples`` (each option in one place)."""
    num_samples, o = resolve_sampling(num_samples, seed=(seed, None), method=(method, "auto"),
                                      chunk_size=(chunk_size, None), return_stderr=(return_stderr, False),
                                      process_group=(process_group, None))
    return num_samples, o["seed"], o["method"], o["chunk_size"], o["return_stderr"], o["process_group"]


def _check_num_samples(num_samples) -> int:
    return checks.positive_int("num_samples", num_samples)


def _check_chunk(chunk_size) -> int | None:
    return checks.positive_int("chunk_size", chunk_size, allow_none=True)


def _check_finite(dist: Distribution, argname: str) -> None:
    if not _VALIDATE:
        return
    for name, value in distribution_parameters(dist).items():
        if not value.is_floating_point():
            continue
        if value.device.type == "cpu" and value.numel() <= 16:  # a prior's few numbers: no reduction
            if all(math.isfinite(v) for v in value.detach().reshape(-1).tolist()):
                continue
        # One reduction pass; a non-finite sum (NaN/inf present, or an overflow) is confirmed exactly.
        elif bool(torch.isfinite(value.detach().sum())):
            continue
        if not bool(torch.isfinite(value.detach()).all()):
            raise ValueError(f"{argname}: parameter {name.replace('dist', argname, 1)} has non-finite values "
                             f"(shape {tuple(value.shape)})")


def _example(form, seed: int) -> torch.Tensor:
    """One real sample (no grad) for tracing: the first sample of the stream."""
    with torch.no_grad():
        return samples(form, stream_for(form, seed, 1).rows(0, 1))[0]


def _plan(fn: Callable, form, seed: int, method: str, taylor_order: int | None) -> Plan:
    """The classified trace of ``fn``: from the plan cache where that is safe, else traced on a sample."""
    traced, cache, reason = cached_trace(fn, form, lambda: _example(form, seed))
    stored = cache in ("hit", "stored")
    plan = _classified(form, traced, method, taylor_order) if stored else classify(form, traced, method, taylor_order)
    if stored and traced.constant is not None:  # the result itself: the caller gets its own copy
        plan = dataclasses.replace(plan, trace=dataclasses.replace(traced, constant=traced.constant.clone()))
    return dataclasses.replace(plan, cache=cache, cache_reason=reason)


def _classified(form, traced, method: str, taylor_order) -> Plan:
    """``classify(form, traced, …)`` for a stored trace, classified once per form signature.

    The classification reads of ``form`` only its family, noise law, shapes, transforms and number of
    parameters, never their values: a plan made for an equal signature, with ``form`` put in, is the
    plan ``classify`` would make.
    """
    if not isinstance(form, SamplingForm) or not all(is_exp(t) for t in form.transforms):
        return classify(form, traced, method, taylor_order)
    key = (type(form), id(form.noise), form.loc is None, tuple(form.shape), tuple(form.noise_shape),
           len(form.transforms), len(form.params), method, taylor_order)
    memo = traced.plans
    hit = memo.get(key)
    if hit is None or hit[0] is not form.noise:
        if len(memo) >= _PLANS_PER_TRACE:  # laws made per call (a Gamma's, a Student-t's) would grow it
            memo.clear()
        hit = memo[key] = (form.noise, classify(form, traced, method, taylor_order))  # the law kept: ids stay unique
    return dataclasses.replace(hit[1], form=form)


#: Classifications kept per stored trace (one per form signature and method in use).
_PLANS_PER_TRACE = 8


def plan_for(fn: Callable, dist: Distribution, *, seed: int = 0, method: str = "auto",
             taylor_order: int | None = None) -> Plan:
    """Trace ``fn`` under ``dist`` (or reuse the plan cache's trace) and classify it (no Monte Carlo work)."""
    return _plan(fn, family_of(dist), seed, method, taylor_order)


def explain(fn: Callable | Distribution, dist: Distribution, *, method: str = "auto",
            taylor_order: int | None = None) -> Plan | KLPlan:
    """How :func:`expectation` would compute ``E_{w~dist}[fn(w)]``, or :func:`kl_divergence` KL(q ‖ p).

    ``explain(fn, dist)`` returns the frozen :class:`~mcgraph.engine.plan.classify.Plan`; its ``str()`` lists,
    per term, the tier, the parameterization tuple (G, n, t) in words, d_P, and why a term
    is not collapsible, and whether the trace came from the plan cache
    (:mod:`mcgraph.engine.plan.cache`; ``plan.cache``).

    ``explain(q, p)`` (two distributions) returns a :class:`~mcgraph.engine.plan.classify.KLPlan`: whether
    the KL is torch's closed form (``closed_form``: the rule's name) or the engine's, with the plans
    of E_q[log p] (and of E_q[log q] when q has no entropy), and whether it is exact.

    Example:
        >>> import torch, mcgraph as mg
        >>> q = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
        >>> print(mg.explain(lambda w: (w - 1) ** 3, q).tiers)
        (<Tier.COLLAPSED: 'collapsed'>,)
        >>> mg.explain(q, torch.distributions.Normal(0.0, 1.0)).closed_form
        '_kl_normal_normal'
        >>> mg.explain(q, torch.distributions.Laplace(0.0, 1.0)).closed_form
        '_kl_normal_laplace'
        >>> mg.explain(q, torch.distributions.StudentT(3.0)).exact   # no closed form: E_q[log p] sampled
        False
    """
    if isinstance(fn, Distribution):
        return _explain_kl(fn, dist, method, taylor_order)
    plan = plan_for(fn, dist, method=method, taylor_order=taylor_order)
    return _describe_fused(plan)


def _describe_fused(plan: Plan) -> Plan:
    if not isinstance(plan.form, SamplingForm):
        return plan
    # the fused terms' chunk body, in words (the estimators know it; the plan, a floor below, does not)
    terms = tuple(dataclasses.replace(t, chunk_body=describe_body(plan.form, t.node))
                  if t.tier == Tier.FUSED and t.node is not None else t for t in plan.terms)
    return dataclasses.replace(plan, terms=terms)


def _explain_kl(q: Distribution, p: Distribution, method, taylor_order) -> KLPlan:
    if not isinstance(p, Distribution):
        raise TypeError(f"p must be a torch.distributions.Distribution to explain KL(q || p), got {type(p).__name__}")
    method = parse_method(method, KL_METHODS)
    if method in ("auto", "closed-form") and taylor_order is None:
        with torch.no_grad():
            rule = kl_rule(q, p)
            if rule is not None and closed_form_kl(q, p) is not None:
                return KLPlan(method, closed_form=getattr(rule, "__name__", repr(rule)))
        if method == "closed-form":
            raise NotImplementedError(f"method='closed-form': torch has no KL rule for {type(q).__name__} ‖ "
                                      f"{type(p).__name__}")
    engine_method = "auto-analytic" if method == "auto" else method
    extra = len(q.event_shape) - len(p.event_shape)
    cross = _describe_fused(plan_for(_log_density(p, extra), q, method=engine_method, taylor_order=taylor_order))
    kernel = _describe_cross_kernel(q, p, method) if taylor_order is None else ""
    try:
        with torch.no_grad():
            q.entropy()
        return KLPlan(method, entropy="closed form", cross=cross, cross_kernel=kernel)
    except NotImplementedError:
        entropy_method = "monte-carlo" if method in ("collapsed", "collapsed-exact", "fused") else engine_method
        return KLPlan(method, entropy="estimated", cross=cross, cross_kernel=kernel,
                      neg_entropy=_describe_fused(plan_for(q.log_prob, q, method=entropy_method)))


def _describe_cross_kernel(q: Distribution, p: Distribution, method: str) -> str:
    """``explain``'s line on the fused kernel for E_q[log p] of :data:`_CROSS_ROUTES` that applies (empty where
    none does; builds nothing)."""
    call = _KLCall(q, p, 1, None, method, None, None, False, None, len(q.event_shape) - len(p.event_shape))
    if not call.kernels_allowed:
        return ""
    return next((line for route in _CROSS_ROUTES if route.describe is not None
                 for line in [route.describe(call)] if line), "")


def evaluate(plan: Plan, fn: Callable, seed: int, num_samples: int, chunk_size: int | None,
             return_stderr: bool = False, shard=None):
    """Run a plan: the sum over pieces of chain(Σ term values). ``chunk_size=None``: each tier's default.

    The result has the trace's dtype (:attr:`~mcgraph.engine.plan.tracer.TraceResult.dtype`); an integer
    or boolean integrand is averaged in the distribution's floating dtype and its result is
    detached (piecewise constant in w: its pathwise gradient is zero almost everywhere).
    With ``return_stderr`` an :class:`~mcgraph.engine.stderr.MCEstimate` (see :mod:`mcgraph.engine.stderr`).
    """
    traced = plan.trace
    if traced.discrete:
        fn = floating(fn, traced.dtype)
    collector = StderrCollector(plan) if return_stderr else None
    out = _run_tiers(plan, fn, seed, num_samples, chunk_size, collector, shard)
    if traced.dtype is not None and out.dtype != traced.dtype:
        out = out.to(traced.dtype)
    out = out.detach() if traced.discrete else out
    if collector is None:
        return out
    se = collector.finish(fn, seed, num_samples, chunk_size, collector.stats, out)
    return MCEstimate(out, se, num_samples)


def _run_tiers(plan: Plan, fn: Callable, seed: int, num_samples: int, chunk_size: int | None,
               collector: StderrCollector | None = None, shard=None) -> torch.Tensor:
    form, traced = plan.form, plan.trace
    sink = collector.sink_for if collector is not None else (lambda term: None)

    def chunk(tier: str) -> int:
        return chunk_size if chunk_size is not None else default_chunk(form, num_samples, tier)

    if traced.constant is not None:
        return traced.constant
    whole = plan.whole
    if whole is not None:
        if whole.tier == Tier.DIRECT:
            if shard is not None:
                raise ValueError("method='direct' (the naive graph, for comparisons) does not split samples "
                                 "across processes: use process_group=None or another method")
            return direct_value(form, fn, seed, num_samples)
        return chunked_value(form, fn, seed, num_samples, chunk("chunked"), shard, moments=sink(whole))

    stats = {}
    collapsed = [t for t in plan.terms if t.tier == Tier.COLLAPSED]
    keys = set().union(*(t.stat_keys for t in collapsed)) - {(0, 0)} if collapsed else set()
    if collector is not None and collapsed:
        keys |= collector.extra_keys()
    if keys:  # a constant term (log p's normaliser) needs no noise: t̄_(0,0) = 1
        stats = statistics(form, keys, seed, num_samples, chunk("collapsed"), any(t.exact for t in collapsed),
                           shard)
        if collector is not None:
            collector.stats = stats
    analytic = [t for t in plan.terms if t.tier == Tier.ANALYTIC]
    exact_stats = analytic_statistics(form, set().union(*(t.stat_keys for t in analytic))) if analytic else {}
    piece_values: dict[int, torch.Tensor] = {}
    for term in plan.terms:
        if term.tier == Tier.COLLAPSED:  # one sample: t̄_j = ξ^j, the polynomial is evaluated at w itself
            v = collapsed_value(form, term, stats, one_sample=num_samples == 1)
        elif term.tier == Tier.ANALYTIC:
            v = collapsed_value(form, term, exact_stats)
        else:
            shape = _node_shape(form, term.node)
            v = fused_value(form, term.node, shape, seed, num_samples, chunk_size, shard, moments=sink(term))
        piece_values[term.piece] = v if term.piece not in piece_values else piece_values[term.piece] + v
    out = None
    for i, piece in enumerate(traced.expr.pieces):
        v = piece.apply_chain(piece_values[i])
        out = v if out is None else out + v
    if tuple(out.shape) != tuple(traced.out_shape):
        out = out.broadcast_to(traced.out_shape)
    return out


def _node_shape(form, node) -> torch.Size:
    shapes = [c.shape for c in node.constants() if isinstance(c, torch.Tensor)]
    return torch.Size(broadcast_shapes(form.shape, *shapes))


def _check_stderr(return_stderr, num_samples: int, taylor_order, shard=None) -> bool:
    if not isinstance(return_stderr, bool):
        raise TypeError(f"return_stderr must be a bool, got {type(return_stderr).__name__}")
    if return_stderr and num_samples < 2:
        raise ValueError(f"num_samples must be >= 2 with return_stderr=True (a single sample has no variance "
                         f"to estimate), got {num_samples}")
    if return_stderr and taylor_order is not None:
        raise ValueError("return_stderr=True with taylor_order: the Taylor approximation is biased, its "
                         "Monte Carlo error is not the error of the result; drop one of them")
    refuse_with_process_group(return_stderr, shard)
    return return_stderr


def expectation(fn: Callable, dist: Distribution, num_samples: int | Sampling, *, seed: int | None = None,
                method: str = "auto", chunk_size: int | None = None,
                taylor_order: int | None = None, return_stderr: bool = False, process_group=None):
    """Monte Carlo estimate of ``E_{w~dist}[fn(w)]`` whose graph does not grow with M.

    .. math::
        \\hat E = \\frac1M \\sum_{i=1}^M fn(w_i), \\qquad w_i = W(\\theta, \\xi_i)

    ``fn`` is traced once and split into terms; each term is computed by the
    collapsed, fused or chunked tier (see :func:`explain`). For a given ``seed``
    every method consumes the same noise ξ and returns the same value and
    gradients up to float rounding.

    Args:
        fn: maps a tensor shaped like ``dist.sample()`` to a tensor. Elementwise
            ``fn`` gives an elementwise expectation; a reducing ``fn`` the reduced one.
        dist: a ``torch.distributions.Distribution`` (registered family, or with ``rsample``).
        num_samples: M ≥ 1, or a :class:`~mcgraph.Sampling` carrying M and the options below (each option
            in one place: the Sampling or the keyword).
        seed: noise seed; ``None`` draws one from torch's global generator.
        method: ``"auto"`` | ``"collapsed"`` | ``"collapsed-exact"`` | ``"fused"`` |
            ``"chunked"`` | ``"direct"`` | ``"analytic"`` | ``"auto-analytic"``. ``"collapsed-exact"``
            draws the statistics from their exact joint law (Gaussian noise, degree ≤ 2): same
            distribution as the estimator, not the same numbers, O(P) for any M. ``"direct"`` is
            the naive graph. ``"analytic"`` takes every term exactly (a polynomial term under a
            noise law with known moments, see :mod:`mcgraph.engine.noise.moments`): no sampling, graph and time
            independent of M; a term without an exact form raises ``ValueError`` with the reason.
            ``"auto-analytic"`` is ``"auto"`` with the polynomial terms exact where they can be
            (``"auto"`` never is: the exact tier is used only when asked for).
        chunk_size: samples per chunk (memory O(chunk_size · P)); default: one noise block for
            the statistics, about 2^20 elements for the fused and chunked tiers.
        taylor_order: opt-in Taylor approximation of non-collapsible terms (paper §4.1).
        return_stderr: also return the standard error of the M-sample estimator, computed in
            the same pass (:mod:`mcgraph.engine.stderr`; needs ``num_samples >= 2``, not with
            ``taylor_order`` nor with ``process_group``).
        process_group: ``None`` (one process) or a ``torch.distributed`` process group whose
            ranks split the M samples by index (:mod:`mcgraph.engine.distributed`): every rank calls
            with the same arguments, evaluates its share, and gets the full M-sample value and
            gradients, equal to the one-process result for the same seed up to float rounding
            (one all-reduce per tier). ``seed=None`` draws one seed common to all ranks.

    Returns:
        With ``return_stderr``: an :class:`~mcgraph.engine.stderr.MCEstimate` ``(value, stderr,
        num_samples)``, ``stderr`` detached, of the value's shape, 0 for exact terms. Otherwise
        a tensor of ``fn``'s output shape, differentiable w.r.t. every tensor ``dist``
        and ``fn`` depend on, in ``fn``'s dtype when ``fn`` returns floating values.
        An integer or boolean ``fn`` (an indicator ``w > 0``, a count) is averaged in
        ``dist``'s floating dtype: ``E[1{w ∈ A}]`` estimates the probability P(w ∈ A).
        That result is detached: the integrand is piecewise constant in w, so its
        pathwise (reparameterisation) gradient is zero almost everywhere, and it is *not*
        the gradient of the probability (which needs a score-function or a smoothed
        estimator).

    Raises:
        TypeError / ValueError: bad ``num_samples``, ``seed``, ``chunk_size``, ``method``,
            non-finite parameters, or ``fn`` failing on a sample.
        NotImplementedError: ``dist`` has no registered family and no ``rsample``.

    Example:
        >>> import torch, mcgraph as mg
        >>> mu = torch.zeros(4, requires_grad=True)
        >>> q = torch.distributions.Normal(mu, torch.ones(4))
        >>> e = mg.expectation(lambda w: w ** 2, q, num_samples=10_000, seed=0)
        >>> bool(((e - 1).abs() < 0.1).all())
        True
        >>> p = mg.expectation(lambda w: w > 0, q, num_samples=10_000, seed=0)   # P(w > 0) = 0.5
        >>> p.dtype, bool(((p - 0.5).abs() < 0.05).all()), p.requires_grad
        (torch.float32, True, False)
        >>> value, stderr, _ = mg.expectation(lambda w: w ** 2, q, 10_000, seed=0, return_stderr=True)
        >>> bool(((stderr - 2 ** 0.5 / 100).abs() < 1e-3).all())   # sqrt(Var(w²) / M) = sqrt(2 / 10⁴)
        True
        >>> mg.expectation(lambda w: w ** 2, q, 1, method="analytic")   # exact: E[w²] = μ² + σ²
        tensor([1., 1., 1., 1.], grad_fn=<LocationScalePolynomialBackward>)
    """
    num_samples, seed, method, chunk_size, return_stderr, process_group = _sampling_arguments(
        num_samples, seed, method, chunk_size, return_stderr, process_group)
    with sharded(process_group, seed, num_samples) as (shard, seed):
        return _expectation(fn, dist, num_samples, seed, method, chunk_size, taylor_order, return_stderr, shard)


def _expectation(fn, dist, num_samples, seed, method, chunk_size, taylor_order, return_stderr, shard,
                 argname: str | None = "dist"):
    """:func:`expectation` inside its process group; ``argname=None``: ``dist``'s parameters were checked."""
    num_samples = _check_num_samples(num_samples)
    return_stderr = _check_stderr(return_stderr, num_samples, taylor_order, shard)
    form = family_of(dist)
    if argname is not None:
        _check_finite(dist, argname)
    seed = resolve_seed(seed)
    chunk = _check_chunk(chunk_size)
    plan = _plan(fn, form, seed, method, taylor_order)
    return evaluate(plan, guarded(fn), seed, num_samples, chunk, return_stderr, shard)


@contextlib.contextmanager
def _no_validation(dist: Distribution):
    """Evaluate ``dist.log_prob`` without per-call validation (its support is checked once on a sample)."""
    old = dist.__dict__.get("_validate_args", None)
    managed = isinstance(getattr(type(dist), "_validate_args", None), property)  # e.g. Pyro's Independent
    before = dist._validate_args
    dist._validate_args = False
    try:
        yield
    finally:
        if managed:
            dist._validate_args = before
        elif old is None:
            del dist._validate_args
        else:
            dist._validate_args = old


_UNBOUNDED = (constraints.real, constraints.real_vector)


def _check_support(q: Distribution, p: Distribution) -> None:
    """KL(q ‖ p) is +inf when q puts mass where p has none: refuse the clear case of a q on the whole
    real line under a prior with a bounded support (Beta, Gamma, HalfNormal, …)."""
    try:
        q_support, p_support = q.support, p.support
    except NotImplementedError:
        return
    unbounded = lambda c: any(c is u or type(c) is type(u) for u in _UNBOUNDED)  # noqa: E731
    if unbounded(q_support) and not unbounded(p_support) and not getattr(p, "improper", False):
        raise ValueError(f"p: {type(p).__name__}'s support ({p_support}) does not cover the support of q "
                         f"({type(q).__name__} on {q_support}), so KL(q || p) is infinite; pick a prior defined on "
                         f"the whole real line, or a posterior on the prior's support")


def _sum_rightmost(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.sum(tuple(range(-n, 0))) if n > 0 else x


def _log_density(p: Distribution, extra: int) -> Callable:
    """``w ↦ log p(w)`` summed over q's ``extra`` event dimensions that p lacks."""
    if extra == 0:
        return p.log_prob

    def log_p(w):
        return _sum_rightmost(p.log_prob(w), extra)

    return log_p


def kl_divergence(q: Distribution, p: Distribution, num_samples: int | Sampling, *, seed: int | None = None,
                  method: str = "auto", chunk_size: int | None = None,
                  taylor_order: int | None = None, return_stderr: bool = False, process_group=None):
    """KL(q ‖ p) with torch's shape semantics (``q.batch_shape``): exact where exact exists, else Monte Carlo.

    .. math::
        KL(q\\|p) = -H(q) - E_q[\\log p(w)]

    Under ``method="auto"`` (the default) the KL is exact wherever an exact form exists, as in
    Pyro's ``TraceMeanField_ELBO``: torch's registered closed form for the pair (Normal ‖ Normal,
    Laplace ‖ Normal, …; :mod:`mcgraph.engine.closed_form`); otherwise the entropy in closed form
    where ``q.entropy()`` exists (else ``E_q[log q(w)]`` estimated with the same noise) and
    ``E_q[log p(w)]`` by :func:`expectation` with its polynomial terms exact (the analytic tier)
    and the other terms sampled (collapsed / fused / chunked). :func:`explain` with ``(q, p)``
    says which. Any other method samples: ``"monte-carlo"`` picks the cheapest sampling tier per
    term, the others force one (the same-seed contract holds among them); ``"closed-form"``
    requires torch's rule.

    An improper prior (``mcgraph.distributions.LogUniform``) is accepted: its density
    is defined up to an additive constant, so the KL is too (the constant is dropped).

    Args:
        q: the approximate posterior (registered family or ``rsample``).
        p: the prior, any distribution with ``log_prob`` whose shape broadcasts with q's samples.
        num_samples: M of the sampled terms (validated always, unused by an exact KL), or a
            :class:`~mcgraph.Sampling`.
        method: ``"auto"`` (exact where exact exists), ``"closed-form"``, ``"monte-carlo"`` or
            any method of :func:`expectation` (:data:`mcgraph.engine.methods.KL_METHODS`).
        seed, chunk_size, taylor_order, process_group: as in :func:`expectation` (an exact KL is
            computed whole on every rank of ``process_group``).
        return_stderr: also return the standard error of the estimate (an
            :class:`~mcgraph.engine.stderr.MCEstimate`; 0 for a closed form). When the entropy is
            estimated too (no closed form), it shares the noise with the cross term, and the
            standard error is that of the per-sample difference ``log q(w_i) − log p(w_i)`` (one
            extra pass over the same noise).

    Returns:
        Tensor of shape ``q.batch_shape`` (broadcast with p's batch shape).

    Raises:
        NotImplementedError: ``method="closed-form"`` and torch has no rule for the pair.

    Example:
        >>> import torch, mcgraph as mg
        >>> q = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
        >>> p = mg.distributions.ScaleMixtureNormal(pi=0.5, scale1=1.0, scale2=1e-3)
        >>> mg.kl_divergence(q, p, num_samples=1000, seed=0).shape
        torch.Size([3])
        >>> n = torch.distributions.Normal(0.0, 2.0)
        >>> mg.kl_divergence(q, n, 1000)              # torch's closed form: log 2 + 1/8 − 1/2
        tensor([0.3181, 0.3181, 0.3181])
        >>> mg.kl_divergence(q, n, 1000, seed=0, method="monte-carlo").shape   # sampled on request
        torch.Size([3])
    """
    num_samples, seed, method, chunk_size, return_stderr, process_group = _sampling_arguments(
        num_samples, seed, method, chunk_size, return_stderr, process_group)
    with sharded(process_group, seed, num_samples) as (shard, seed):
        return _kl_divergence(q, p, num_samples, seed, method, chunk_size, taylor_order, return_stderr, shard)


# --------------------------------------------------------------------------- KL(q ‖ p): one validation, a table of routes


@dataclasses.dataclass(frozen=True)
class _KLCall:
    """The arguments of one KL call, validated (:func:`_validated_kl_call`)."""

    q: Distribution
    p: Distribution
    num_samples: int
    seed: int | None
    method: str
    chunk_size: int | None
    taylor_order: int | None
    return_stderr: bool
    shard: object
    extra: int  # q's event dimensions that p lacks (summed over in log p)

    @property
    def kernels_allowed(self) -> bool:
        """Whether a fused kernel for p's registered log-density may compute the cross term."""
        return (self.method in ("auto", "monte-carlo", "fused") and self.taylor_order is None
                and not self.return_stderr and self.shard is None)


def _validated_kl_call(q, p, num_samples, seed, method, chunk_size, taylor_order, return_stderr, shard) -> _KLCall:
    """Every argument check of :func:`kl_divergence`, in one place (finiteness is each route's: see below)."""
    if not isinstance(q, Distribution):
        raise TypeError(f"q must be a torch.distributions.Distribution, got {type(q).__name__}")
    if not isinstance(p, Distribution):
        raise TypeError(f"p must be a torch.distributions.Distribution, got {type(p).__name__}")
    q_shape = q.batch_shape + q.event_shape
    p_shape = p.batch_shape + p.event_shape
    try:
        broadcast_shapes(q_shape, p_shape)
    except RuntimeError as e:
        raise ValueError(f"p: shape {tuple(p_shape)} (batch {tuple(p.batch_shape)} + event "
                         f"{tuple(p.event_shape)}) does not broadcast with q's sample shape {tuple(q_shape)}") from e
    extra = len(q.event_shape) - len(p.event_shape)
    if extra < 0:
        raise ValueError(f"p: event_shape {tuple(p.event_shape)} has more dimensions than q.event_shape "
                         f"{tuple(q.event_shape)}; the KL per q batch element is undefined")
    _check_support(q, p)
    method = parse_method(method, KL_METHODS)
    return_stderr = _check_stderr(return_stderr, _check_num_samples(num_samples), taylor_order, shard)
    checks.seed("seed", seed)  # validated even where no noise is drawn
    if method == "closed-form" and taylor_order is not None:
        raise ValueError("taylor_order: an approximation of a closed form; drop taylor_order or method='closed-form'")
    return _KLCall(q, p, num_samples, seed, method, chunk_size, taylor_order, return_stderr, shard, extra)


def _closed_form_route(call: _KLCall):
    """The whole KL by torch's registered rule for the pair, or ``None`` (then the cross-term routes run).

    Finiteness costs no pass over the parameters here: a non-finite result is traced back to a
    non-finite parameter (named), else it is the KL (q outside p's support).
    """
    if call.method not in ("auto", "closed-form") or call.taylor_order is not None:
        return None
    value = closed_form_kl(call.q, call.p)
    if value is None:
        if call.method == "closed-form":
            q, p = call.q, call.p
            raise NotImplementedError(f"method='closed-form': torch has no KL rule for {type(q).__name__} ‖ "
                                      f"{type(p).__name__}" + ("" if q.event_shape == p.event_shape else
                                                               f" with event shapes {tuple(q.event_shape)} and "
                                                               f"{tuple(p.event_shape)}"))
        return None
    if _VALIDATE and not bool(torch.isfinite(value.detach().sum())):
        _check_finite(call.p, "p")
        _check_finite(call.q, "q")
    return MCEstimate(value, torch.zeros_like(value.detach()), call.num_samples) if call.return_stderr else value


# A cross-term route: ``find(call)`` says whether it applies (building and launching nothing but, for the CPU
# loop, its library), ``run(call, found, seed)`` returns ``(E_q[log p], its standard error or None, q_checked)``,
# ``describe(call, found)`` is explain's line. The first route that applies computes E_q[log p(w)].


def _cpu_loop_find(call: _KLCall):
    if not call.kernels_allowed or call.chunk_size is not None:  # (a chunk size asked for: the engine's)
        return None
    form = family_of(call.q)
    found = cpu_fused.applies(form, call.p, call.method, call.num_samples)
    return None if found is None else (form, found)


def _cpu_loop_run(call: _KLCall, found, seed: int):
    form, found = found
    q, p = call.q, call.p
    # the loop reports a non-finite parameter it reads; the checks then name it
    if any(t is not form.loc and t is not form.scale for t in distribution_parameters(q).values()):
        _check_finite(q, "q")  # q's loc and scale derived from its parameters (1 / rate, …): checked here
    cross = cpu_fused.log_prob_expectation(form, p, call.num_samples, seed, method=call.method,
                                           sum_rightmost=call.extra, found=found,
                                           check_inputs=lambda: (_check_finite(p, "p"), _check_finite(q, "q")))
    return cross, None, True


def _cpu_loop_describe(call: _KLCall) -> str:
    found = cpu_fused.plan(family_of(call.q), call.p, call.method)
    if found is None:
        return ""
    why = cpu_fused.unavailable_reason()
    if why is not None:
        return f"(the compiled CPU loop for {found[0].name}'s log-density is unavailable: {why})"
    return (f"fused: the compiled CPU loop for {found[0].name}'s log-density (value and gradients in one pass "
            f"over the same noise) when M·P ≤ {cpu_fused.MAX_ELEMENTS} draws")


def _triton_find(call: _KLCall):
    return triton_fused.kernel_plan(call.q, call.p, call.method) if call.kernels_allowed else None


def _triton_run(call: _KLCall, found, seed: int):
    _check_finite(call.p, "p")
    cross = triton_fused.log_prob_expectation(call.q, call.p, call.num_samples, seed, sum_rightmost=call.extra,
                                              method=call.method)
    return cross, None, False


def _triton_describe(call: _KLCall) -> str:
    found = triton_fused.kernel_plan(call.q, call.p, call.method)
    if found is None:
        return ""
    return (f"fused: the Triton kernel for {type(found[-1]).__name__}'s log-density (the noise drawn in "
            f"registers; value and gradients in one pass)")


def _engine_run(call: _KLCall, found, seed: int):
    _check_finite(call.p, "p")
    method = "auto-analytic" if call.method == "auto" else call.method  # "auto": polynomial terms exact
    cross = _expectation(_log_density(call.p, call.extra), call.q, call.num_samples, seed, method, call.chunk_size,
                         call.taylor_order, call.return_stderr, call.shard, argname="q")
    return (cross[0], cross[1], True) if call.return_stderr else (cross, None, True)


@dataclasses.dataclass(frozen=True)
class _CrossRoute:
    name: str
    find: Callable
    run: Callable
    describe: Callable | None = None


#: How E_q[log p(w)] is computed, in order: a fused kernel for a registered log-density (the compiled CPU loop
#: for CPU tensors, the Triton kernel on its backend; the two never apply to the same call), else the engine.
_CROSS_ROUTES = (
    _CrossRoute("compiled CPU loop", _cpu_loop_find, _cpu_loop_run, _cpu_loop_describe),
    _CrossRoute("Triton kernel", _triton_find, _triton_run, _triton_describe),
    _CrossRoute("engine", lambda call: True, _engine_run),
)


def _kl_divergence(q, p, num_samples, seed, method, chunk_size, taylor_order, return_stderr, shard):
    call = _validated_kl_call(q, p, num_samples, seed, method, chunk_size, taylor_order, return_stderr, shard)
    value = _closed_form_route(call)
    if value is not None:
        return value
    seed = resolve_seed(seed)
    with _no_validation(p):
        for route in _CROSS_ROUTES:
            found = route.find(call)
            if found is not None:
                cross, cross_se, q_checked = route.run(call, found, seed)
                if cross is not None:
                    break
        return _with_entropy(call, seed, cross, cross_se, q_checked)


def _with_entropy(call: _KLCall, seed: int, cross, cross_se, q_checked: bool):
    """KL = −H(q) − E_q[log p]: the entropy in closed form where ``q.entropy()`` exists, else E_q[log q(w)]
    estimated with the cross term's noise."""
    q, method = call.q, call.method
    try:
        entropy = q.entropy()
    except NotImplementedError:
        entropy = None
    neg_entropy_se = None
    if entropy is not None:  # −(H + E[log p]): one negation (forward and backward) instead of two
        value = (entropy + cross).neg()
    else:
        entropy_method = "monte-carlo" if method in ("collapsed", "collapsed-exact", "fused") else \
            ("auto-analytic" if method == "auto" else method)
        neg_entropy = _expectation(q.log_prob, q, call.num_samples, seed, entropy_method, call.chunk_size, None,
                                   call.return_stderr, call.shard, argname=None if q_checked else "q")
        if call.return_stderr:
            neg_entropy, neg_entropy_se, _ = neg_entropy
        value = neg_entropy - cross
    if not call.return_stderr:
        return value
    if neg_entropy_se is None or not bool((neg_entropy_se > 0).any()):
        se = cross_se
    elif not bool((cross_se > 0).any()):
        se = neg_entropy_se
    else:  # both estimated from the same noise: the error of the per-sample difference
        from .stderr import per_sample_moments

        log_p = _log_density(call.p, call.extra)
        se = per_sample_moments(family_of(q), lambda w: q.log_prob(w) - log_p(w), seed, call.num_samples,
                                call.chunk_size).stderr().to(value.dtype)
    return MCEstimate(value, se.broadcast_to(value.shape), call.num_samples)
