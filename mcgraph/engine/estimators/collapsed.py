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

The combination ``Σ_k c_k E_k`` takes one fused multiply-add pass per term (scalar
coefficients as numbers, zero coefficients skipped), so its last bits can differ from a
term-by-term product and sum; with one sample (M = 1, t̄_j = ξ^j) the polynomial is evaluated
at ``u = μ + σξ`` itself (:class:`OneSamplePolynomial`). Both agree with the direct
estimator up to float rounding, like every tier.
"""

from __future__ import annotations

import math

import torch

from ..noise import backends as backend
from torch.autograd.function import once_differentiable

from ..plan.families import SamplingForm
from ..noise.statistics import exact_gaussian_statistics, noise_statistics
from ..shapes import broadcast_shapes
from ..plan.classify import TermPlan
from .sampling import stream_for


def statistics(form: SamplingForm, keys: set, seed: int, num_samples: int, chunk_size: int,
               exact: bool, shard=None) -> dict:
    """The statistics ``{(a, j): t̄_{a,j}}`` (shape ``form.noise_shape``), without autograd.

    With a :class:`~mcgraph.engine.distributed.SampleShard` each process sums the noise of its own
    samples and the sums are all-reduced before the division by M (the exact Gaussian
    statistics are O(P) and drawn whole on every process).
    """
    if exact:
        return exact_gaussian_statistics(tuple(form.noise_shape), num_samples, seed, form.dtype, form.device)
    fused_stats = backend.noise_statistics(form, keys, seed, num_samples) if shard is None else None
    if fused_stats is not None:  # one Triton pass, the noise never materialised
        return fused_stats
    if shard is not None:
        shared = _compiled_shard_statistics(form, keys, seed, num_samples, shard)
        if shared is not None:
            return shared
    stream = stream_for(form, seed, num_samples)
    stream.owns_rows = True
    try:
        return _stream_statistics(stream, form, keys, num_samples, chunk_size, shard)
    finally:
        stream.release()  # its block buffer serves the next stream (noise.reuse_noise_blocks)


def _compiled_shard_statistics(form: SamplingForm, keys: set, seed: int, num_samples: int, shard) -> dict | None:
    """The statistics from this process's samples summed by the compiled pass (:func:`backend.noise_sums`), the
    sums all-reduced, then divided by M; ``None`` where that pass does not cover the law or the keys."""
    order = sorted(k for k in keys if k != (0, 0))
    if not order or not backend.has_noise_sums(form, order, num_samples):
        return None
    numel = math.prod(form.noise_shape)

    def compute():  # inside the collective's guard: an error here is reported to every rank
        sums = backend.noise_sums(form, order, seed, num_samples, *shard.window(num_samples))
        return [sums[k] for k in order]

    reduced = shard.sum(compute, [((numel,), torch.float64, form.device)] * len(order))
    shape = tuple(form.noise_shape)
    out = {k: (v / num_samples).reshape(shape).to(form.dtype) for k, v in zip(order, reduced)}
    if (0, 0) in keys:
        out[(0, 0)] = torch.ones(shape, dtype=form.dtype, device=form.device)
    return out


def _stream_statistics(stream, form: SamplingForm, keys: set, num_samples: int, chunk_size: int, shard):
    if shard is None:
        return noise_statistics(stream, tuple(sorted(keys)), chunk_size, form.dtype)
    from ..distributed import window_chunks

    order = sorted(k for k in keys if k != (0, 0))
    numel = (math.prod(form.noise_shape),)

    def reduce(sums):
        out = shard.sum(lambda: [sums.get(k) for k in order], [(numel, form.dtype, form.device)] * len(order))
        return {k: v for k, v in zip(order, out) if v is not None}

    start, stop = shard.stream_window(stream, num_samples)
    return noise_statistics(stream, tuple(sorted(keys)), chunk_size, form.dtype, reduce=reduce,
                            chunks=window_chunks(stream, chunk_size, start, stop), shape=form.noise_shape)


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


def _moments(mu, sigma, stats: dict, K: int) -> list:
    """``[E_0, …, E_K]``, ``E_k = Σ_j C(k,j) μ^{k−j} σ^j t̄_j`` (``E_0 = 1``)."""
    if K <= 2:  # the common case (Gaussian log-densities), in the fewest passes over P
        t = sigma * stats[(1, 0)]
        e1 = mu + t
        if K == 1:
            return [1.0, e1]
        e2 = mu * torch.add(mu, t, alpha=2)  # μ² + 2μσt̄₁
        return [1.0, e1, e2.addcmul_(sigma * sigma, stats[(2, 0)])]
    out = [1.0]
    mu_pow = [1.0, mu]
    sigma_pow = [1.0, sigma]
    for k in range(2, K + 1):
        mu_pow.append(mu_pow[-1] * mu)
        sigma_pow.append(sigma_pow[-1] * sigma)
    for k in range(1, K + 1):
        e = mu_pow[k]
        for j in range(1, k + 1):
            e = e + math.comb(k, j) * mu_pow[k - j] * sigma_pow[j] * stats[(j, 0)]
        out.append(e)
    return out


def _unpack(ctx):
    """What a polynomial Function's backward reads: ``(loc, scale, rest, coefs, need_loc, need_scale,
    need_coefs, tensor_degrees)`` (``rest``: the statistics then the tensor coefficients)."""
    loc, scale, *rest = ctx.saved_tensors
    coefs = _merge_coefs(ctx.numbers, rest[ctx.K:])
    tensor_degrees = [k for n, k in zip(ctx.numbers, ctx.degrees) if n is None]
    return (loc, scale, rest, coefs, ctx.needs_input_grad[2], ctx.needs_input_grad[3],
            ctx.needs_input_grad[4 + ctx.K:], tensor_degrees)


class LocationScalePolynomial(torch.autograd.Function):
    """``V = Σ_k c_k E_k`` with ``E_k = mean_i (μ + σξ_i)^k`` from the statistics t̄_j = mean_i ξ_i^j.

    One graph node whatever M (and whatever K); it saves μ, σ, the K statistics and the
    tensor coefficients. Inputs: ``degrees`` (tuple of k), ``numbers`` (python coefficients,
    ``None`` where the coefficient is a tensor input), ``loc``, ``scale``, ``*stats``
    (t̄_1..t̄_K, broadcastable to loc), ``*tensor_coefs``.

    VJP, for an upstream gradient g (the derivative of the sample mean, term by term)::

        ∂E_k/∂μ = k E_{k−1}
        ∂E_k/∂σ = k F_{k−1},  F_m = mean_i (μ+σξ_i)^m ξ_i = Σ_j C(m,j) μ^{m−j} σ^j t̄_{j+1}
        ∂V/∂c_k = E_k
        grad_x = sum_to_size(g · ∂V/∂x, x.shape)
    """

    @staticmethod
    def forward(ctx, degrees, numbers, loc, scale, *rest):
        K = max(degrees)
        stats = {(j, 0): t for j, t in zip(range(1, K + 1), rest[:K])}
        tensor_coefs = rest[K:]
        coefs = _merge_coefs(numbers, tensor_coefs)
        E = _moments(loc, scale, stats, K)
        value = _weighted_sum([(c, E[k]) for k, c in zip(degrees, coefs)], scale)
        ctx.degrees, ctx.numbers, ctx.K = degrees, numbers, K
        ctx.shapes = (loc.shape, scale.shape, [c.shape for c in tensor_coefs])
        ctx.save_for_backward(loc, scale, *rest)
        return torch.as_tensor(value, dtype=scale.dtype, device=scale.device)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        loc, scale, rest, coefs, need_loc, need_scale, need_coefs, tensor_degrees = _unpack(ctx)
        K = ctx.K
        stats = {(j, 0): t for j, t in zip(range(1, K + 1), rest[:K])}
        # The moments needed: E_0..E_{K-1} for μ, E_k for a coefficient c_k that needs a gradient.
        top = max([K - 1 if need_loc else 0] + [k for need, k in zip(need_coefs, tensor_degrees) if need])
        E = _moments(loc, scale, stats, top) if top > 0 else [1.0]
        grad_loc = grad_scale = None
        if need_loc:
            d = _weighted_sum([(_times(c, k), E[k - 1]) for k, c in zip(ctx.degrees, coefs) if k], scale)
            grad_loc = _to_shape(g * d, ctx.shapes[0])
        if need_scale:
            shifted = {(j, 0): stats[(j + 1, 0)] for j in range(0, K)}
            F = _moments_shifted(loc, scale, shifted, K - 1)
            d = _weighted_sum([(_times(c, k), F[k - 1]) for k, c in zip(ctx.degrees, coefs) if k], scale)
            grad_scale = _to_shape(g * d, ctx.shapes[1])
        coef_grads = []
        for need, k, shape in zip(need_coefs, tensor_degrees, ctx.shapes[2]):
            coef_grads.append(_to_shape(g * E[k], shape) if need else None)
        return (None, None, grad_loc, grad_scale, *([None] * K), *coef_grads)


class OneSamplePolynomial(LocationScalePolynomial):
    """:class:`LocationScalePolynomial` when the statistics come from one sample (M = 1).

    Same inputs, same saved bytes (so the same graph size), fewer passes: with one sample
    t̄_j = ξ^j, so ``E_k = u^k`` for ``u = μ + σ ξ`` (ξ = t̄_1), and

    .. math::
        V = \\sum_k c_k u^k, \\qquad \\frac{\\partial V}{\\partial \\mu} = D = \\sum_k k c_k u^{k-1}, \\qquad
        \\frac{\\partial V}{\\partial \\sigma} = D\\,\\xi, \\qquad \\frac{\\partial V}{\\partial c_k} = u^k.

    For K ≥ 2 it saves ``u`` in the place of t̄_2 (which one sample does not need; same shape and
    dtype), so the backward pass does not recompute it.
    VJP: ``grad_μ = sum_to_size(g·D)``, ``grad_σ = sum_to_size(g·D·ξ)``,
    ``grad_c_k = sum_to_size(g·u^k)``.
    """

    @staticmethod
    def forward(ctx, degrees, numbers, loc, scale, *rest):
        K = max(degrees)
        coefs = _merge_coefs(numbers, rest[K:])
        powers = _powers(loc, scale, rest[0], K)
        value = _weighted_sum([(c, powers[k]) for k, c in zip(degrees, coefs)], scale)
        ctx.degrees, ctx.numbers, ctx.K = degrees, numbers, K
        ctx.shapes = (loc.shape, scale.shape, [c.shape for c in rest[K:]])
        saved = list(rest)
        ctx.u_saved = K >= 2 and powers[1].shape == rest[1].shape and powers[1].dtype == rest[1].dtype
        if ctx.u_saved:
            saved[1] = powers[1]
        ctx.save_for_backward(loc, scale, *saved)
        return torch.as_tensor(value, dtype=scale.dtype, device=scale.device)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        loc, scale, rest, coefs, need_loc, need_scale, need_coefs, tensor_degrees = _unpack(ctx)
        K, xi = ctx.K, rest[0]
        needed = [k for need, k in zip(need_coefs, tensor_degrees) if need]
        top = max([K - 1 if (need_loc or need_scale) else 0] + needed)
        if top == 0:
            powers = [1.0]
        elif ctx.u_saved:
            powers = _powers(None, None, None, top, u=rest[1])
        else:
            powers = _powers(loc, scale, xi, top)
        grad_loc = grad_scale = None
        if need_loc or need_scale:
            d = _weighted_sum([(_times(c, k), powers[k - 1]) for k, c in zip(ctx.degrees, coefs) if k], scale)
            gd = g * d
            grad_loc = _to_shape(gd, ctx.shapes[0]) if need_loc else None
            grad_scale = _to_shape(gd * xi, ctx.shapes[1]) if need_scale else None
        coef_grads = []
        for need, k, shape in zip(need_coefs, tensor_degrees, ctx.shapes[2]):
            coef_grads.append(_to_shape(g * powers[k], shape) if need else None)
        return (None, None, grad_loc, grad_scale, *([None] * K), *coef_grads)


def _powers(loc, scale, xi, K: int, u=None) -> list:
    """``[1, u, u², …, u^K]`` for ``u = loc + scale·ξ`` (or the given ``u``)."""
    out = [1.0]
    if K >= 1:
        out.append(loc + scale * xi if u is None else u)
    for _ in range(2, K + 1):
        out.append(out[-1] * out[1])
    return out


def _times(c, k: int):
    """``c · k`` (``c`` a Python number or a tensor; no multiplication for k = 1)."""
    return c if k == 1 else c * k


def _weighted_sum(pairs, like: torch.Tensor) -> torch.Tensor:
    """``Σ c · x`` over ``(c, x)`` pairs (``c`` a number or a tensor, ``x`` a tensor or the number 1).

    One pass per tensor term: the first term is a product, each further one a fused in-place
    ``add_(x, alpha=c)`` / ``addcmul_(c, x)`` into it, the constant terms added last. A one-element
    coefficient (0-d, on the CPU) is read as a number (a tensor operand of one element broadcast through a
    fused kernel is several times slower than a scalar).
    """
    # A zero coefficient (a prior's mean 0 gives 0·w) costs a pass and adds nothing: the moments are
    # finite where the parameters and the noise are.
    pairs = [(c, x) for c, x in ((_as_number(c), x) for c, x in pairs)
             if isinstance(c, torch.Tensor) or c != 0]
    const = None
    terms = []
    for c, x in pairs:
        if isinstance(x, torch.Tensor):
            terms.append((c, x))
        else:
            term = c * x if x != 1 else c
            const = term if const is None else const + term
    if not terms:
        return const if isinstance(const, torch.Tensor) else _scalar(0.0 if const is None else const, like)
    (c, x), rest = terms[0], terms[1:]
    out = x * c
    tensors = [t for pair in terms for t in pair if isinstance(t, torch.Tensor)]
    if isinstance(const, torch.Tensor):
        tensors.append(const)
    in_place = all(t.dtype == out.dtype for t in tensors) and \
        broadcast_shapes(*(t.shape for t in tensors)) == tuple(out.shape)
    for c, x in rest:
        if isinstance(c, torch.Tensor):
            out = out.addcmul_(c, x) if in_place else torch.addcmul(out, c, x)
        else:
            out = out.add_(x, alpha=c) if in_place else torch.add(out, x, alpha=c)
    if const is not None and (isinstance(const, torch.Tensor) or const != 0):
        out = out.add_(const) if in_place else out + const
    return out


def _as_number(c):
    """A 0-d CPU tensor coefficient as a Python number (no device synchronisation); else ``c``."""
    if isinstance(c, torch.Tensor) and c.dim() == 0 and c.device.type == "cpu" and not c.requires_grad:
        return c.item()
    return c


def _scalar(x, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(x, dtype=like.dtype, device=like.device)


def _moments_shifted(mu, sigma, shifted: dict, K: int) -> list:
    """``[F_0, …, F_K]``, ``F_m = Σ_j C(m,j) μ^{m−j} σ^j t̄_{j+1}`` (``shifted[(j,0)] = t̄_{j+1}``)."""
    if K <= 1:
        f0 = shifted[(0, 0)]
        return [f0] if K == 0 else [f0, torch.addcmul(mu * f0, sigma, shifted[(1, 0)])]
    out = []
    for m in range(K + 1):
        f = 0
        for j in range(m + 1):
            term = shifted[(j, 0)]
            if j:
                term = sigma ** j * term
            if m - j:
                term = math.comb(m, j) * mu ** (m - j) * term
            f = f + term
        out.append(f)
    return out


def _to_shape(x: torch.Tensor, shape) -> torch.Tensor:
    """Reduce a broadcast gradient to ``shape`` (expanding first if it is smaller)."""
    if tuple(x.shape) == tuple(shape):
        return x
    full = broadcast_shapes(x.shape, shape)
    return x.expand(full).sum_to_size(shape) if full != tuple(x.shape) else x.sum_to_size(shape)


def _merge_coefs(numbers, tensor_coefs) -> list:
    it = iter(tensor_coefs)
    return [next(it) if n is None else n for n in numbers]


def collapsed_value(form: SamplingForm, term: TermPlan, stats: dict, one_sample: bool = False) -> torch.Tensor:
    """``Σ_m c_m · E[u^m]`` for a collapsed term (or its Taylor approximation).

    ``one_sample``: the statistics are those of a single sample (M = 1: t̄_j = ξ^j), so a
    location-scale polynomial is evaluated at ``u = μ + σξ`` directly (:class:`OneSamplePolynomial`).
    """
    if term.approximate:
        return taylor_value(form, term, stats)
    if not form.is_scaling:
        degrees = tuple(a for (a, _), _ in term.monomials)
        K = max(degrees)
        if K == 0:
            return _constant(term, form)
        coefs = [c for _, c in term.monomials]
        numbers = tuple(None if isinstance(c, torch.Tensor) else float(c) for c in coefs)
        tensor_coefs = [c for c in coefs if isinstance(c, torch.Tensor)]
        stat_list = [stats[(j, 0)] for j in range(1, K + 1)]
        function = OneSamplePolynomial if one_sample else LocationScalePolynomial
        return function.apply(degrees, numbers, form.loc, form.scale, *stat_list, *tensor_coefs)
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
            if not deriv.requires_grad:  # h^(k-1) is constant in u (a polynomial's end, |w|'s sign): h^(k) = 0
                break
            (deriv,) = torch.autograd.grad(deriv, dummy, torch.ones_like(deriv), create_graph=True,
                                           allow_unused=True)
            if deriv is None:
                break
            sigma_power = form.scale * sigma_power
            out = out + deriv * sigma_power * stats[(k, 0)] / math.factorial(k)
    return out


def _constant(term: TermPlan, form: SamplingForm) -> torch.Tensor:
    out = 0
    for _, c in term.monomials:
        out = out + c
    return torch.as_tensor(out, dtype=form.dtype, device=form.device) if not isinstance(out, torch.Tensor) else out
