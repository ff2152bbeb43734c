"""The noise statistics of the collapsed tier, ``t̄_{a,j} = mean_i ξ_i^a (log ξ_i)^j``, without autograd.

Summed over the chunks of a noise stream, or (Gaussian ξ, degree ≤ 2) drawn directly from their
exact joint law at O(P) cost for any M.
"""

from __future__ import annotations

import math

import torch

from .streams import BlockStream, mix_seed, seeded


def noise_statistics(stream: BlockStream, keys: tuple[tuple[int, int], ...], chunk_size: int,
                     dtype: torch.dtype, *, chunks=None, reduce=None,
                     shape=None) -> dict[tuple[int, int], torch.Tensor]:
    """Per-element means t̄_{a,j} = mean_i ξ_i^a (log ξ_i)^j over the stream, without autograd.

    Row sums are taken as a matrix-vector product ``1ᵀ X`` (one BLAS pass over the
    chunk); for pure location-scale statistics (positive powers, no logs) the powers are
    formed tile by tile in cache (:func:`_power_sums`), so their cost stays small beside
    that of drawing the noise, even up to degree 2K for a variance.

    Args:
        stream: the noise stream; ``rows`` has shape ``(n, *noise_shape)``.
        keys: the ``(a, j)`` pairs needed (``a`` any integer, ``j ≥ 0``); ``(0, 0)`` is 1.
        chunk_size: samples per chunk (memory is O(chunk_size · P)).
        dtype: accumulation dtype.
        chunks: ``(start, stop, rows)`` to sum over instead of ``stream.chunks(chunk_size)``
            (one process's share of the samples, :mod:`mcgraph.engine.distributed`).
        reduce: ``reduce({key: flat sum}) -> {key: flat sum}`` applied to the sums before they are
            divided by M (the all-reduce over processes).
        shape: the noise shape (needed when ``chunks`` is empty).

    Returns:
        ``{(a, j): Tensor of shape noise_shape}``.
    """
    keys = tuple(k for k in keys if k != (0, 0))
    sums: dict[tuple[int, int], torch.Tensor] = {}
    powers = sorted({a for a, _ in keys})
    max_log = max((j for _, j in keys), default=0)

    def accumulate(key, rows2d):
        if key not in sums:
            sums[key] = torch.zeros(rows2d.shape[1], dtype=dtype, device=rows2d.device)
        if rows2d.shape[0] == 1:
            sums[key].add_(rows2d[0])
        else:  # acc += Xᵀ 1 in one BLAS pass
            sums[key].addmv_(rows2d.t(), ones[: rows2d.shape[0]])

    ones = None
    # Under torch.autocast the BLAS row sums would run in half precision: statistics stay in ``dtype``.
    with torch.no_grad(), torch.autocast(stream.device.type, enabled=False):
        for _, _, xi in (stream.chunks(chunk_size) if chunks is None else chunks):
            shape = xi.shape[1:]
            x = xi.to(dtype).reshape(xi.shape[0], -1)
            if ones is None or ones.shape[0] < x.shape[0]:
                ones = torch.ones(max(x.shape[0], chunk_size), dtype=dtype, device=x.device)
            if max_log == 0 and powers and powers[0] >= 1:  # location-scale statistics: tiled powers
                _power_sums(x, powers, accumulate)
                continue
            logx = x.log() if max_log > 0 else None
            for a in powers:
                term = _int_power(x, a)
                for j in range(max_log + 1):
                    if j > 0:
                        term = term * logx
                    if (a, j) in keys:
                        accumulate((a, j), term)
    if reduce is not None:
        sums = reduce(sums)
    return {k: (v / stream.num_samples).reshape(shape) for k, v in sums.items()}


#: Elements of one sub-chunk of :func:`_power_sums` (its running products stay in cache).
POWER_TILE_ELEMENTS = 1 << 20


def _power_sums(x: torch.Tensor, powers: list, accumulate) -> None:
    """Accumulate Σ_i x_i^a for positive integer ``powers`` (``x``: rows × elements).

    Rows are taken a few at a time so that the running product ``x^a`` stays in cache:
    the higher powers (degree ≤ 2K, for the variance of a degree-K term) then cost about
    as much as the first two.
    """
    top = powers[-1]
    step = max(1, min(x.shape[0], POWER_TILE_ELEMENTS // max(1, x.shape[1])))
    # Two reused buffers: fresh multi-megabyte tensors per tile would be page-faulted in every time.
    bufs = [torch.empty((step, x.shape[1]), dtype=x.dtype, device=x.device)
            for _ in range(2 if top > 2 else 1)]
    for start in range(0, x.shape[0], step):
        rows = x[start:start + step]
        n = rows.shape[0]
        term = rows
        for a in range(1, top + 1):
            if a > 1:
                term = torch.mul(term, rows, out=bufs[a % len(bufs)][:n])
            if a in powers:
                accumulate((a, 0), term)


def _int_power(x: torch.Tensor, a: int) -> torch.Tensor:
    if a == 0:
        return torch.ones_like(x)
    if a == 1:
        return x
    if a == 2:
        return x * x
    return x.pow(a)


def exact_gaussian_statistics(shape: tuple[int, ...], num_samples: int, seed: int,
                              dtype: torch.dtype, device: torch.device) -> dict[tuple[int, int], torch.Tensor]:
    """Draw (t̄_1, t̄_2) = (mean ξ, mean ξ²) of M iid N(0, 1) directly from their joint law.

    .. math::
        \\bar\\xi \\sim N(0, 1/M), \\quad \\sum_i (\\xi_i - \\bar\\xi)^2 \\sim \\chi^2_{M-1},
        \\quad \\overline{\\xi^2} = \\frac{SS}{M} + \\bar\\xi^2

    (independent by Cochran's theorem). Same distribution as the chunked
    statistics, different numbers; cost O(P) for any M.
    """
    with seeded(mix_seed(seed, 2**40), device):
        mean = torch.randn(shape, dtype=dtype, device=device)
        if num_samples > 1:
            mean /= math.sqrt(num_samples)
            alpha = torch.full(shape, (num_samples - 1) / 2, dtype=dtype, device=device)
            ss = 2 * torch._standard_gamma(alpha)
    # M = 1: SS = 0 and mean ξ² = (mean ξ)² exactly (the same numbers as 0 / 1 + mean², in one pass)
    second = mean * mean if num_samples == 1 else ss / num_samples + mean * mean
    return {(0, 0): torch.ones((), dtype=dtype, device=device), (1, 0): mean, (2, 0): second}
