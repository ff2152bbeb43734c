"""Collapsed tier: noise statistics without autograd, then ONE small graph G(n(θ) ∘ t̄).

For a location-scale base ``u = μ + σξ`` (Thm 2, Cor 3)

.. math::
    \\frac1M\\sum_i u_i^k = \\sum_{j=0}^{k} \\binom{k}{j} \\mu^{k-j} \\sigma^j \\, \\bar t_j,
    \\qquad \\bar t_j = \\frac1M \\sum_i \\xi_i^j,

and for a scaling base ``u = θξ`` (Thm 1, Cor 1)

.. math::
    \\frac1M\\sum_i u_i^a (\\log u_i)^b = \\theta^a \\sum_{j=0}^{b} \\binom{b}{j}
    (\\log\\theta)^{b-j} \\, \\bar t_{a,j}, \\qquad \\bar t_{a,j} = \\frac1M\\sum_i \\xi_i^a (\\log\\xi_i)^j.

The statistics t̄ are computed chunk by chunk under ``no_grad`` (memory
O(chunk · P)); only the final combination with θ enters the autograd graph, so
its size does not depend on M.
"""

from __future__ import annotations

import math

import torch

from .. import backend
from ..families import SamplingForm
from ..noise import exact_gaussian_statistics, noise_statistics
from ..tuples import TermPlan
from .sampling import stream_for


def statistics(form: SamplingForm, keys: set, seed: int, num_samples: int, chunk_size: int,
               exact: bool) -> dict:
    """The statistics ``{(a, j): t̄_{a,j}}`` (shape ``form.noise_shape``), without autograd."""
    if exact:
        return exact_gaussian_statistics(tuple(form.noise_shape), num_samples, seed, form.dtype, form.device)
    fused_stats = backend.noise_statistics(form, keys, seed, num_samples)
    if fused_stats is not None:  # one Triton pass, the noise never materialised
        return fused_stats
    stream = stream_for(form, seed, num_samples)
    stream.owns_rows = True
    return noise_statistics(stream, tuple(sorted(keys)), chunk_size, form.dtype)


def base_moment(form: SamplingForm, a: int, b: int, stats: dict) -> torch.Tensor:
    """E[u^a (log u)^b] from the statistics, as a differentiable function of (loc, scale)."""
    if form.is_scaling:
        theta = form.scale
        out = 0
        log_theta = theta.log() if b else None
        for j in range(b + 1):
            coef = math.comb(b, j) * (log_theta ** (b - j) if b - j else 1)
            out = out + coef * (stats[(a, j)] if (a, j) != (0, 0) else 1.0)
        return theta ** a * out if a else out
    mu, sigma = form.loc, form.scale
    out = 0
    for j in range(a + 1):
        term = stats[(j, 0)] if j else 1.0
        if j:
            term = sigma ** j * term if j > 1 else sigma * term
        if a - j:
            term = math.comb(a, j) * (mu ** (a - j) if a - j > 1 else mu) * term
        out = out + term
    return out if isinstance(out, torch.Tensor) else torch.as_tensor(out, dtype=form.dtype, device=form.device)


def collapsed_value(form: SamplingForm, term: TermPlan, stats: dict) -> torch.Tensor:
    """``Σ_m c_m · E[u^m]`` for a collapsed term (or its Taylor approximation)."""
    if term.approximate:
        return taylor_value(form, term, stats)
    out = 0
    for (a, b), c in term.monomials:
        moment = base_moment(form, a, b, stats) if (a, b) != (0, 0) else 1.0
        out = out + c * moment
    if not isinstance(out, torch.Tensor):
        out = torch.as_tensor(out, dtype=form.dtype, device=form.device)
    return out


def taylor_value(form: SamplingForm, term: TermPlan, stats: dict) -> torch.Tensor:
    """§4.1: E[h(T(μ + σξ))] ≈ Σ_{k≤K} h̃^(k)(μ)/k! · σ^k · mean(ξ^k), h̃ = h ∘ T.

    The derivatives are taken by nested autograd at u = μ with ``create_graph``,
    so the result stays differentiable in μ, σ and the tensors ``h`` closes over.
    """
    K = term.taylor_order
    probe = torch.zeros((), dtype=form.dtype, device=form.device, requires_grad=True)
    with torch.enable_grad():
        u = form.loc + probe.expand_as(form.loc) if form.loc.requires_grad else form.loc.detach() + probe
        u = u.expand(form.shape) if u.shape != form.shape else u
        dummy = torch.zeros(u.shape, dtype=form.dtype, device=form.device, requires_grad=True)
        x = u + dummy
        h = term.node(form.apply_transforms(x), {})
        out = h
        deriv = h
        sigma_power = 1
        for k in range(1, K + 1):
            (deriv,) = torch.autograd.grad(deriv, dummy, torch.ones_like(deriv), create_graph=True)
            sigma_power = form.scale * sigma_power
            out = out + deriv * sigma_power * stats[(k, 0)] / math.factorial(k)
    return out
