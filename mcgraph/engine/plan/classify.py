"""Parameterization tuples, d_P and the classifier that turns a trace into a Plan.

Def. 1 of the paper: a parameterization tuple P = (G, n, t) writes the MC sum
of ``g(W(θ, ξ_i))`` as ``G(n(θ) ∘ t(ξ_1..ξ_M))``; d_P is the dimension of
``n ∘ t``, the number of graph nodes that need a gradient. The classifier
picks a tier per term:

* **collapsed** (d_P independent of M) —
  scaling form ``w = θξ`` and ``g = w^a (log w)^b`` (Thm 1, Cor 1):
  ``E = θ^a Σ_j C(b,j) (log θ)^{b-j} · mean(ξ^a (log ξ)^j)``;
  location-scale ``w = μ + σξ`` and ``g`` a polynomial of degree K
  (Thm 2, Cor 2–3): ``E[w^k] = Σ_j C(k,j) μ^{k-j} σ^j · mean(ξ^j)``,
  d_P = C(K+2, 2) − 1; an exp transform (LogNormal) reduces ``(log w)^b`` to
  the base polynomial ``u^b`` (Cor 1–2);
* **fused** — any other elementwise term under a sampling form;
* **chunked** — everything else.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

from ..noise import backends as backend
from ..methods import ENGINE_METHODS, parse_method
from .families import GenericForm, SamplingForm, is_exp
from ..noise.moments import NoExactMoment, exact_statistic
from .algebra import Elementwise
from .ir import Node, PolyNode, SumNode, captured_tensors, format_monomial, format_poly
from .tracer import TraceResult


class Tier(str, enum.Enum):
    """How a term's expectation is computed."""

    COLLAPSED = "collapsed"  #: noise statistics without autograd, then one small graph
    FUSED = "fused"  #: one autograd Function: sample, evaluate, reduce value and gradients
    CHUNKED = "chunked"  #: chunks without a graph, replayed on backward
    DIRECT = "direct"  #: the naive graph over all samples (comparison only)
    ANALYTIC = "analytic"  #: exact expectation from the noise law's moments (M = ∞, no sampling)

    def __str__(self) -> str:
        return self.value


METHODS = tuple(m.value for m in ENGINE_METHODS)
#: Methods that take polynomial terms exactly (``"analytic"``: all terms or an error;
#: ``"auto-analytic"``: where the noise law's moments allow, the sampling tiers elsewhere).
ANALYTIC_METHODS = ("analytic", "auto-analytic")


@dataclass(frozen=True, eq=False)
class TermPlan:
    """One term of a plan.

    Attributes:
        label: the term in words (``"c·w^2 + c·w"``, ``"logaddexp(…)"``, ``"fn (whole)"``).
        tier: the tier computing it.
        piece: index of the trace piece it belongs to (-1 for the whole integrand).
        monomials: for collapsed terms, ``{(a, b): coefficient}`` in the *base* variable
            (``u = loc + scale·ξ``; equal to ``w`` unless the form has an exp transform).
        stat_keys: the noise statistics ``(a, j)`` ↦ mean ξ^a (log ξ)^j it needs.
        node: for fused terms (and Taylor terms), the elementwise program ``h(w)``.
        tuple_G, tuple_n, tuple_t: the parameterization tuple in words.
        d_P: the dimension of n ∘ t (graph nodes needing grad), independent of M where stated.
        reason: why the term is not collapsible (empty when it is).
        exact: the statistics are drawn from their exact joint law (not the same numbers as direct).
        approximate: Taylor-approximated (§4.1): the result is biased.
        chunk_body: for fused terms in :func:`mcgraph.explain`'s plan, which chunk body the fused
            tier runs, in words (filled by the estimators' side; empty otherwise).
    """

    label: str
    tier: Tier
    piece: int = -1
    monomials: tuple = ()
    stat_keys: tuple = ()
    node: Node | None = None
    tuple_G: str = ""
    tuple_n: str = ""
    tuple_t: str = ""
    d_P: int | None = None
    reason: str = ""
    exact: bool = False
    approximate: bool = False
    taylor_order: int | None = None
    chunk_body: str = ""


@dataclass(frozen=True, eq=False)
class Plan:
    """Frozen classification of ``E_{w~dist}[fn(w)]`` that the estimators consume.

    Attributes:
        form, trace, terms, method: the sampling form, the traced integrand, the terms, the method.
        cache: where the trace came from (:mod:`mcgraph.engine.plan.cache`): ``"hit"`` (reused, no sample
            drawn), ``"stored"`` (traced on this call and kept), ``"not stored"`` (traced on this
            call; ``cache_reason`` says why it is not kept), ``"off"`` (cache disabled) or ``""``
            (classified outside the functional API).
        cache_reason: why the trace was not kept (empty otherwise).
    """

    form: SamplingForm | GenericForm
    trace: TraceResult
    terms: tuple
    method: str
    cache: str = ""
    cache_reason: str = ""

    @property
    def whole(self) -> TermPlan | None:
        """The single whole-integrand term (chunked/direct), if the plan has one."""
        if len(self.terms) == 1 and self.terms[0].piece == -1:
            return self.terms[0]
        return None

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return tuple(t.tier for t in self.terms)

    def __str__(self) -> str:
        lines = [f"Plan for E[fn(w)], {self.form.describe()}  (method={self.method})"]
        cache = _CACHE_LINES.get(self.cache)
        if cache:
            lines.append(f"  plan: {cache}" + (f" ({self.cache_reason})" if self.cache_reason else ""))
        if self.trace.constant is not None:
            lines.append("  fn does not depend on w: the expectation is fn's value")
        for i, t in enumerate(self.terms):
            flag = " [exact statistics: same law, different numbers]" if t.exact else ""
            flag += " [EXACT: the expectation itself, M = ∞, no Monte Carlo error]" \
                if t.tier == Tier.ANALYTIC else ""
            flag += f" [APPROXIMATE: Taylor order {t.taylor_order}, biased]" if t.approximate else ""
            lines.append(f"  term {i}: {t.label}")
            lines.append(f"    tier: {t.tier}{flag}")
            if t.tuple_n:
                lines.append(f"    tuple: G = {t.tuple_G}; n(θ) = {t.tuple_n}; t(ξ) = {t.tuple_t}")
            if t.d_P is not None:
                lines.append(f"    d_P = {t.d_P} (independent of M)" if t.tier != Tier.DIRECT
                             else f"    d_P = {t.d_P}·M (grows with M)")
            if t.reason:
                lines.append(f"    not collapsible: {t.reason}")
            if t.chunk_body:
                lines.append(f"    chunk body: {t.chunk_body}")
            variance = _variance_line(self.form, t)
            if variance:
                lines.append(f"    standard error: {variance}")
        lines.append(f"  noise stream: {backend.describe_stream(self.form)}")
        if stderr_mode(self)[0] == "per_sample":
            lines.append("  standard error of the total: per-sample values of fn in one extra pass over the "
                         "same noise (covariances between terms included)")
        return "\n".join(lines)

    __repr__ = __str__


@dataclass(frozen=True, eq=False)
class KLPlan:
    """How :func:`mcgraph.kl_divergence` computes KL(q ‖ p) (what ``mg.explain(q, p)`` returns).

    Attributes:
        method: the method asked for.
        closed_form: the name of torch's registered rule taken for the pair (empty when the engine
            computes the KL).
        entropy: ``"closed form"`` (``q.entropy()``), ``"estimated"`` (E_q[log q] by the engine, same
            noise) or ``""`` (a closed-form KL).
        cross: the plan of E_q[log p(w)] (``None`` for a closed-form KL).
        neg_entropy: the plan of E_q[log q(w)] when the entropy is estimated, else ``None``.
        cross_kernel: how a fused kernel for p's registered log-density computes E_q[log p(w)] in place of
            ``cross`` (empty when none does).
    """

    method: str
    closed_form: str = ""
    entropy: str = ""
    cross: Plan | None = None
    neg_entropy: Plan | None = None
    cross_kernel: str = ""

    @property
    def exact(self) -> bool:
        """No Monte Carlo error: a closed form, or a closed-form entropy and only exact cross terms."""
        if self.closed_form:
            return True
        plans = [x for x in (self.cross, self.neg_entropy) if x is not None]
        return self.entropy == "closed form" and all(
            x.trace.constant is not None or all(t.tier == Tier.ANALYTIC for t in x.terms) for x in plans)

    def __str__(self) -> str:
        head = f"Plan for KL(q || p)  (method={self.method})"
        if self.closed_form:
            return (f"{head}\n  closed form: torch's registered rule {self.closed_form} "
                    f"[EXACT: no sampling, num_samples unused]")
        lines = [head, f"  entropy: {self.entropy}" + (" (q.entropy())" if self.entropy == "closed form" else
                                                       " (E_q[log q(w)], the same noise as the cross term)"),
                 "  no closed form used: " + ("torch has no rule for the pair" if self.method == "auto"
                                              else f"method={self.method!r} samples"),
                 "  cross term E_q[log p(w)]:"]
        if self.cross_kernel:
            lines.append(f"    {self.cross_kernel}; otherwise:")
        lines += ["  " + line for line in str(self.cross).splitlines()]
        if self.neg_entropy is not None:
            lines.append("  negative entropy E_q[log q(w)]:")
            lines += ["  " + line for line in str(self.neg_entropy).splitlines()]
        lines.append("  exact: no Monte Carlo error (num_samples unused)" if self.exact else
                     "  sampled: num_samples draws for the terms not exact")
        return "\n".join(lines)

    __repr__ = __str__


_CACHE_LINES = {
    "hit": "from the plan cache (traced on an earlier call; no sample drawn)",
    "stored": "traced on this call and stored in the plan cache",
    "not stored": "traced on this call, not stored in the plan cache",
    "off": "traced on this call (plan cache disabled)",
}


def _variance_line(form, t: TermPlan) -> str:
    """How ``return_stderr=True`` gets this term's variance, in words (empty when there is nothing to say)."""
    if t.tier == Tier.ANALYTIC:
        return "0 (exact)"
    if t.tier == Tier.FUSED:
        return "Σh² accumulated beside Σh in the same pass"
    if t.tier in (Tier.CHUNKED, Tier.DIRECT):
        return "from the per-sample values (Σf² beside Σf)"
    if t.approximate or not t.monomials:
        return ""
    if all(m == (0, 0) for m, _ in t.monomials):
        return "0 (constant)"
    if form.is_scaling:
        feats = {(a, j) for (a, b), _ in t.monomials for j in range(b + 1)} - {(0, 0)}
        keys = {(a1 + a2, j1 + j2) for a1, j1 in feats for a2, j2 in feats} | feats
        return (f"Var = Σ α_f α_g (t̄_(f+g) − t̄_f t̄_g) over the statistics ξ^a (log ξ)^j of the term; "
                f"variance tuple d_P = {len(keys)} (independent of M)")
    K = max(a for (a, _), _ in t.monomials)
    how = "exact noise moments" if t.exact else "same pass"
    return (f"Var = αᵀ C α, C_jl = t̄_(j+l) − t̄_j t̄_l, statistics mean ξ^j, j ≤ {2 * K} ({how}); "
            f"variance tuple (a polynomial of degree {2 * K}) d_P = {_cor3_dp(2 * K)} (independent of M)")


def _is_random(t: TermPlan) -> bool:
    if t.tier in (Tier.FUSED, Tier.CHUNKED, Tier.DIRECT):
        return True
    if t.tier == Tier.COLLAPSED:
        return t.approximate or any(m != (0, 0) for m, _ in t.monomials)
    return False


def stderr_mode(plan: Plan) -> tuple[str, TermPlan | None]:
    """``("zero" | "collapsed" | "fused" | "whole" | "per_sample", term)``: how the total's
    standard error is computed (see the module docstring)."""
    if plan.trace.constant is not None:
        return "zero", None
    whole = plan.whole
    if whole is not None:
        return ("whole" if whole.tier == Tier.CHUNKED else "per_sample"), whole
    random = [t for t in plan.terms if _is_random(t)]
    if not random:
        return "zero", None
    if len(random) == 1 and not plan.trace.expr.pieces[random[0].piece].chain and not random[0].approximate:
        return ("collapsed" if random[0].tier == Tier.COLLAPSED else "fused"), random[0]
    return "per_sample", None


# --------------------------------------------------------------------------- monomial rules


def base_monomial(form, m: tuple[int, int]) -> tuple[tuple[int, int] | None, str]:
    """The monomial in the base variable u for ``w^a (log w)^b``, or ``None`` and why not."""
    a, b = m
    if isinstance(form, GenericForm):
        return None, f"no sampling form ({form.reason})"
    if not form.transforms:
        return (a, b), ""
    if len(form.transforms) == 1 and is_exp(form.transforms[0]):
        if a == 0:
            return (b, 0), ""
        return None, f"{format_monomial(m)} = exp({a}·u)·… under w = exp(u) is not a polynomial in the noise"
    names = ", ".join(type(t).__name__ for t in form.transforms)
    return None, f"transforms ({names}) other than a single exp have no collapsed tuple"


def stat_keys_for(form: SamplingForm, base: tuple[int, int]) -> tuple[tuple | None, str]:
    """Noise statistics needed for E[u^a (log u)^b] under ``form``, or ``None`` and why not."""
    a, b = base
    if form.is_scaling:
        if b > 0 and not form.noise.positive:
            return None, f"log w needs positive noise, {form.noise} is not"
        return tuple((a, j) for j in range(b + 1)), ""
    if b > 0:
        return None, ("log w under a location-scale form has no tuple with d_P independent of M "
                      "(paper §4.1); use taylor_order=K for an approximation")
    if a < 0:
        return None, ("w^-k under a location-scale form has no tuple with d_P independent of M "
                      "(paper §4.1)")
    return tuple((j, 0) for j in range(a + 1)), ""


def _cor3_dp(K: int, S: int = 2) -> int:
    return math.comb(K + S, S) - 1


def _collapsed_term(form, poly: dict, piece: int, keys: set, label: str, exact: bool) -> TermPlan:
    if form.is_scaling:
        G = "Σ_m c_m · n_m ∘ t_m"
        n = "(θ^a (log θ)^(b−j))"
        t = "(mean ξ^a (log ξ)^j)"
        d_P = max(len(keys), 1)
    else:
        K = max(a for a, _ in poly)
        G = "Σ_k c_k Σ_j C(k,j) n_kj ∘ t_j"
        n = f"(μ^(k−j) σ^j), j ≤ k ≤ {K}"
        t = f"(mean ξ^j), j ≤ {K}"
        # k + 1 products per degree k present: Thm 2 (C(k+1, 1)) for one monomial, Cor 3
        # (C(K+2, 2) − 1) for a full polynomial of degree K.
        d_P = max(sum(a + 1 for a, _ in poly if a > 0), 1)
    return TermPlan(label=label, tier=Tier.COLLAPSED, piece=piece, monomials=tuple(poly.items()),
                    stat_keys=tuple(sorted(keys)), tuple_G=G, tuple_n=n, tuple_t=t, d_P=d_P, exact=exact)


def _fused_term(form, node: Node, piece: int, reason: str) -> TermPlan:
    captured = captured_tensors(node)
    d_P = len(form.params) + len(captured)
    return TermPlan(label=str(node), tier=Tier.FUSED, piece=piece, node=node,
                    tuple_G="identity (one autograd Function node)",
                    tuple_n=f"{d_P} inputs (θ and prior tensors needing grad)",
                    tuple_t="(mean h'(w_i)·∂w_i/∂θ) accumulated in one pass", d_P=d_P, reason=reason)


def _taylor_term(form, node: Node, piece: int, K: int, reason: str) -> TermPlan:
    return TermPlan(label=str(node), tier=Tier.COLLAPSED, piece=piece, node=node,
                    stat_keys=tuple((j, 0) for j in range(K + 1)),
                    tuple_G=f"Σ_k h^(k)(μ)/k! · n_k ∘ t_k, k ≤ {K}", tuple_n="(h^(k)(μ) σ^k)",
                    tuple_t=f"(mean ξ^k), k ≤ {K}", d_P=_cor3_dp(K), reason=reason,
                    approximate=True, taylor_order=K)


def _whole(form, trace: TraceResult, tier: Tier, reason: str) -> TermPlan:
    return TermPlan(label="fn (whole integrand)", tier=tier, piece=-1, reason=reason,
                    d_P=(len(form.params) if tier == Tier.DIRECT and isinstance(form, SamplingForm) else None))


# --------------------------------------------------------------------------- classify


def classify(form, trace: TraceResult, method: str = "auto", taylor_order: int | None = None) -> Plan:
    """Split the traced integrand into terms and give each a tier.

    Args:
        form: the distribution's sampling form (:func:`mcgraph.engine.plan.families.family_of`).
        trace: the traced integrand (:func:`mcgraph.engine.plan.tracer.trace`).
        method: ``"auto"`` or a forced tier (``"collapsed"``, ``"collapsed-exact"``,
            ``"fused"``, ``"chunked"``, ``"direct"``).
        taylor_order: opt-in Taylor approximation (§4.1) of non-collapsible elementwise
            terms under a location-scale form.

    Raises:
        ValueError: ``method`` is unknown, or a forced tier does not apply to a term.
    """
    method = parse_method(method)
    if taylor_order is not None and (isinstance(taylor_order, bool) or not isinstance(taylor_order, int)
                                     or taylor_order < 1):
        raise ValueError(f"taylor_order must be a positive int or None, got {taylor_order!r}")

    if trace.constant is not None:
        return Plan(form, trace, (), method)
    if method in ("chunked", "direct"):
        return Plan(form, trace, (_whole(form, trace, Tier(method), "forced by method"),), method)
    if trace.opaque or isinstance(form, GenericForm):
        reason = trace.reason if trace.opaque else f"no sampling form ({form.reason})"
        if method not in ("auto", "monte-carlo", "auto-analytic"):
            raise ValueError(f"method={method!r} does not apply to term 'fn (whole integrand)': {reason}")
        return Plan(form, trace, (_whole(form, trace, Tier.CHUNKED, reason),), method)

    exact = method == "collapsed-exact"
    terms = []
    for i, piece in enumerate(trace.expr.pieces):
        terms.extend(_classify_piece(form, piece.expr, i, method, taylor_order, exact))
    return Plan(form, trace, tuple(terms), method)


def _classify_piece(form, e: Elementwise, i: int, method: str, taylor_order, exact: bool) -> list:
    if method == "fused":
        return [_fused_term(form, e.node(), i, "forced by method")]
    collapsible: dict = {}
    keys: set = set()
    rest: dict = {}
    reasons = []
    for m, c in e.poly.items():
        base, why = base_monomial(form, m)
        k, why2 = stat_keys_for(form, base) if base is not None else (None, why)
        if k is None:
            rest[m] = c
            reasons.append(f"{format_monomial(m)}: {why2}")
        else:
            collapsible[base] = collapsible[base] + c if base in collapsible else c
            keys.update(x for x in k if x != (0, 0))
    programs = list(e.programs)
    if programs:
        reasons.append("non-polynomial elementwise term: no parameterization tuple with d_P independent of M")
    leftovers = ([PolyNode(rest)] if rest else []) + programs
    out = []
    if collapsible:
        label = format_poly({m: c for m, c in e.poly.items() if m not in rest})
        if exact:
            _check_exact(form, keys, label)
        why_not = analytic_reason(form, keys) if method in ANALYTIC_METHODS else "not asked for"
        if not why_not:
            term = _collapsed_term(form, collapsible, i, keys, label, False)
            out.append(dataclasses.replace(term, tier=Tier.ANALYTIC, tuple_t=term.tuple_t.replace(
                "mean", "E") + " exactly, from the noise law's moments"))
        elif method == "analytic":
            raise ValueError(f"method='analytic' does not apply to term '{label}': {why_not}; "
                             "method='auto-analytic' leaves such terms to the sampling tiers")
        else:
            out.append(_collapsed_term(form, collapsible, i, keys, label, exact))
    if leftovers:
        node = leftovers[0] if len(leftovers) == 1 else SumNode(tuple(leftovers))
        reason = "; ".join(reasons)
        if taylor_order is not None and not form.is_scaling:
            term = _taylor_term(form, node, i, taylor_order, reason)
            if exact:  # the Taylor polynomial needs mean ξ^k for every k ≤ taylor_order
                _check_exact(form, set(term.stat_keys), str(node))
            out.append(term)
        elif method in ("collapsed", "collapsed-exact"):
            raise ValueError(f"method={method!r} does not apply to term '{node}': {reason}")
        elif method == "analytic":
            raise ValueError(f"method='analytic' does not apply to term '{node}': it is not a polynomial "
                             f"in the noise, so it has no exact form ({reason}); method='auto-analytic' "
                             "leaves it to the sampling tiers")
        else:
            out.append(_fused_term(form, node, i, reason))
    return out


def analytic_reason(form, keys) -> str:
    """Why the statistics ``keys`` have no exact expectation under ``form``'s noise (empty when they do)."""
    for key in sorted(keys):
        if key == (0, 0):
            continue
        try:
            exact_statistic(form.noise.moments, key, tuple(form.noise_shape))
        except NoExactMoment as e:
            a, j = key
            stat = f"ξ^{a}" + (f"·(log ξ)^{j}" if j else "")
            return f"E[{stat}] under {form.noise}: {e}"
    return ""


def _check_exact(form, keys: set, label: str) -> None:
    if not form.noise.gaussian or form.noise.event_ndims or form.is_scaling or not keys <= {(0, 0), (1, 0), (2, 0)}:
        raise ValueError(
            f"method='collapsed-exact' does not apply to term '{label}': the exact joint law of the "
            f"statistics is implemented for Gaussian location-scale noise and degree ≤ 2 "
            f"(noise {form.noise}, statistics {sorted(keys)})")
