"""Standard errors of the engine's Monte Carlo estimates, computed in the pass that makes them.

The estimate of ``E[g(w)]`` is the sample mean ``ĝ = (1/M) Σ_i g(w_i)``; its standard
error is ``sqrt(s² / M)`` with ``s²`` the sample variance of the per-sample values
``g(w_i)``. Per tier (``return_stderr=True`` of :func:`mcgraph.expectation`):

* **collapsed** — a term ``h = Σ_f α_f(θ) φ_f(ξ)`` is linear in the noise features
  ``φ_f = ξ^a (log ξ)^j`` (location-scale: ``ξ^j``, ``α_j = Σ_k c_k C(k,j) μ^{k−j} σ^j``), so

  .. math::
      \\frac1M \\sum_i (h_i - \\bar h)^2 = \\sum_{f,g} \\alpha_f \\alpha_g
      \\big(\\bar t_{f+g} - \\bar t_f\\, \\bar t_g\\big),

  a polynomial of twice the degree: its statistics (``mean ξ^j``, ``j ≤ 2K``) collapse
  too and are accumulated in the same noise pass as the estimate's. With
  ``method="collapsed-exact"`` (statistics drawn from their law, no sample to take a
  variance of) the exact moments of the noise law replace them: the reported value is the
  estimator's true standard deviation ``sqrt(Var h / M)``.
* **fused** — ``Σ(h − h_1)`` and ``Σ(h − h_1)²`` accumulated beside ``Σh`` in the same pass
  (shifted by the first sample's value, against cancellation).
* **chunked** (and the whole-network data term of :func:`mcgraph.nn.elbo_terms`) — the same
  sums over the per-sample values, in the forward pass.
* **analytic** — 0: the value is the expectation itself.

**Sums of terms.** The terms of one integrand share the noise, so the variance of their
sum is not the sum of their variances. When a plan has a single random term (others
constant or analytic) whose piece is not followed by a linear map, its variance is the
total's. Otherwise (several random terms, or a term followed by a reduction such as a sum
over a Radial event), the standard error of the *total* comes from the per-sample values of
``fn`` itself in one extra pass over the same noise (no graph, memory of one chunk): all
covariances between terms are included. ``mg.explain`` says which applies.

``num_samples = 1`` leaves no variance to estimate: ``return_stderr=True`` then raises a
``ValueError``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .estimators.analytic import analytic_statistics
from .estimators.chunked import batched
from .estimators.sampling import default_chunk, samples, stream_for
from .plan.classify import Plan, TermPlan, stderr_mode

__all__ = ["MCEstimate", "SampleMoments", "required_samples", "stderr_mode"]



def refuse_with_process_group(return_stderr, process_group) -> None:
    """Standard errors are one process's: ``return_stderr=True`` with a process group is refused."""
    if return_stderr is True and process_group is not None:
        raise ValueError("return_stderr=True with process_group: standard errors are computed by one process "
                         "only; call with process_group=None to get them")


class MCEstimate(NamedTuple):
    """A Monte Carlo estimate with its standard error (unpacks as ``value, stderr, num_samples``).

    Attributes:
        value: the estimate (differentiable as without ``return_stderr``).
        stderr: its standard error, detached, same shape; 0 where the value is exact.
        num_samples: M.
    """

    value: torch.Tensor
    stderr: torch.Tensor
    num_samples: int

    def required_samples(self, rel_error: float) -> int:
        """The M at which every element's standard error would be ``rel_error · |value|``.

        See :func:`required_samples`.
        """
        return required_samples(self, rel_error)


def required_samples(estimate: MCEstimate, rel_error: float) -> int:
    """Samples needed for a relative standard error ``rel_error`` on every element.

    The standard error falls as ``1/sqrt(M)``, so element ``k`` needs
    ``M · (stderr_k / (rel_error · |value_k|))²`` samples; the largest over elements is
    returned (at least 2). An element whose value is 0 with a positive standard error needs
    infinitely many samples: a ``ValueError`` says so.

    Example:
        >>> import torch, mcgraph as mg
        >>> q = torch.distributions.Normal(torch.ones(3), torch.ones(3))
        >>> est = mg.expectation(lambda w: w ** 2, q, 1000, seed=0, return_stderr=True)
        >>> est.required_samples(0.01) > 1000          # 1 % needs more than 1000 samples
        True
    """
    if isinstance(rel_error, bool) or not isinstance(rel_error, (int, float)) or not rel_error > 0:
        raise ValueError(f"rel_error must be a positive number, got {rel_error!r}")
    value, se = estimate.value.detach().double(), estimate.stderr.double()
    if bool(((value == 0) & (se > 0)).any()):
        raise ValueError("estimate: an element is 0 with a positive standard error; "
                         "no M reaches a relative error")
    ratio = torch.where(se > 0, se / (rel_error * value.abs()), torch.zeros_like(se))
    need = estimate.num_samples * float(ratio.max()) ** 2 if ratio.numel() else 0.0
    return max(2, math.ceil(need))


class SampleMoments:
    """Running ``Σ(x − x₁)`` and ``Σ(x − x₁)²`` over per-sample rows ``(n, *shape)``.

    Accumulated in float32 (float64 for float64 rows); the shift by the first sample
    keeps the sums free of cancellation when the values are far from 0.
    """

    def __init__(self) -> None:
        self.count = 0
        self.shift = self.s1 = self.s2 = None

    def add(self, rows: torch.Tensor) -> None:
        with torch.no_grad():
            acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
            r = rows.detach().to(acc)
            if self.shift is None:
                self.shift = r[0].clone()
            d = r - self.shift
            s1, s2 = d.sum(0), (d * d).sum(0)
            self.s1 = s1 if self.s1 is None else self.s1 + s1
            self.s2 = s2 if self.s2 is None else self.s2 + s2
            self.count += r.shape[0]

    def stderr(self) -> torch.Tensor:
        """``sqrt(s² / M)`` with the unbiased sample variance ``s²`` (NaN for a single sample)."""
        n = self.count
        if n < 2:
            return torch.full_like(self.s1, float("nan"))
        var = (self.s2 - self.s1 * self.s1 / n).clamp_min(0) / (n - 1)
        return (var / n).sqrt()


# --------------------------------------------------------------------------- which route a plan takes


# --------------------------------------------------------------------------- collapsed variance


def term_features(form, term: TermPlan) -> dict:
    """``{(a, j): α}``: the term as ``Σ α_f φ_f(ξ)`` (constant feature dropped), detached."""
    feats: dict = {}

    def add(key, value):
        feats[key] = feats[key] + value if key in feats else value

    with torch.no_grad():
        if form.is_scaling:
            theta = form.scale.detach()
            for (a, b), c in term.monomials:
                c = c.detach() if isinstance(c, torch.Tensor) else c
                for j in range(b + 1):
                    if (a, j) == (0, 0):
                        continue
                    coef = c * math.comb(b, j) * (theta.log() ** (b - j) if b - j else 1.0)
                    add((a, j), coef * theta ** a if a else coef)
        else:
            mu, sigma = form.loc.detach(), form.scale.detach()
            for (k, _), c in term.monomials:
                c = c.detach() if isinstance(c, torch.Tensor) else c
                for j in range(1, k + 1):
                    add((j, 0), c * math.comb(k, j) * mu ** (k - j) * sigma ** j)
    return feats


def variance_keys(form, term: TermPlan) -> set:
    """The statistics ``Var`` of the term needs: its features and their pairwise products."""
    feats = set(term_features(form, term))
    return feats | {(a1 + a2, j1 + j2) for a1, j1 in feats for a2, j2 in feats}


def collapsed_variance(form, term: TermPlan, stats: dict) -> torch.Tensor:
    """``(1/M) Σ_i (h_i − h̄)² = Σ_{f,g} α_f α_g (t̄_{f+g} − t̄_f t̄_g)`` per element (population form)."""
    feats = list(term_features(form, term).items())
    var = None
    with torch.no_grad():
        for i, (f, af) in enumerate(feats):
            for g, ag in feats[i:]:
                cov = stats[(f[0] + g[0], f[1] + g[1])] - stats[f] * stats[g]
                part = (af * ag if f == g else 2 * af * ag) * cov
                var = part if var is None else var + part
    return var


# --------------------------------------------------------------------------- collector used by the engine


class StderrCollector:
    """What the tiers accumulate for ``return_stderr=True`` and how the total's error is formed."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.mode, self.term = stderr_mode(plan)
        self.moments = SampleMoments() if self.mode in ("fused", "whole") else None
        self.stats: dict = {}  # the collapsed tier's statistics, set by the engine

    def extra_keys(self) -> set:
        """Statistics to add to the collapsed tier's pass (none for exact statistics)."""
        if self.mode == "collapsed" and not self.term.exact:
            return variance_keys(self.plan.form, self.term)
        return set()

    def sink_for(self, term: TermPlan) -> SampleMoments | None:
        return self.moments if self.mode in ("fused", "whole") and term is self.term else None

    def finish(self, fn, seed: int, num_samples: int, chunk_size: int | None, stats: dict,
               out: torch.Tensor) -> torch.Tensor:
        form = self.plan.form
        if self.mode == "zero":
            se = torch.zeros(out.shape, dtype=out.dtype, device=out.device)
        elif self.mode == "collapsed":
            if self.term.exact:  # statistics drawn from their law: report the exact SD of the estimator
                exact = analytic_statistics(form, variance_keys(form, self.term))
                se = (collapsed_variance(form, self.term, exact).clamp_min(0) / num_samples).sqrt()
            else:
                se = (collapsed_variance(form, self.term, stats).clamp_min(0) / (num_samples - 1)).sqrt()
        elif self.mode in ("fused", "whole"):
            se = self.moments.stderr()
        else:
            se = per_sample_moments(form, fn, seed, num_samples, chunk_size).stderr()
        se = se.to(out.dtype)
        return se.broadcast_to(out.shape) if tuple(se.shape) != tuple(out.shape) else se


def per_sample_moments(form, fn, seed: int, num_samples: int, chunk_size: int | None) -> SampleMoments:
    """Moments of ``fn(w_i)`` over the same noise stream as the estimate (no graph, one chunk in memory)."""
    chunk = chunk_size if chunk_size is not None else default_chunk(form, num_samples, "chunked")
    bfn = batched(fn)
    moments = SampleMoments()
    with torch.no_grad():
        for _, _, rows in stream_for(form, seed, num_samples).chunks(chunk):
            moments.add(bfn(samples(form, rows)))
    return moments
