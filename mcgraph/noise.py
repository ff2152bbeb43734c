"""Seeded block noise, noise laws and the statistics the collapsed tier needs.

The same-noise contract rests on this module: for a given ``seed`` every
method draws sample ``i`` from the same block of a counter-like stream, so the
direct, collapsed, fused and chunked estimators consume identical noise
whatever their chunk size.

Noise is drawn in blocks of ``rows_per_block(P, M)`` samples.  Block ``b`` is
drawn with torch's global generator reseeded to ``mix(seed, b)`` inside a
forked RNG state, so the caller's RNG state is never disturbed and samplers
that only use the global generator (``torch._standard_gamma``) are seeded too.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from . import moments as mom

#: Elements drawn per block (64 Mi): bounds the memory of one block.
NOISE_BLOCK_ELEMENTS = 1 << 26

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, block: int) -> int:
    """SplitMix64 of ``(seed, block)`` → a 63-bit seed for ``torch.manual_seed``."""
    z = (seed * 0x9E3779B97F4A7C15 + (block + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@contextlib.contextmanager
def seeded(seed: int, device: torch.device):
    """Run the body with the global generator(s) seeded to ``seed``, restoring them after."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        # Seed only the generators in use: torch.manual_seed also visits every accelerator
        # backend, which costs about a millisecond per noise block.
        torch.default_generator.manual_seed(seed)
        if devices:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


def rows_per_block(sample_numel: int, num_samples: int) -> int:
    """Samples per noise block: as many as fit in ``NOISE_BLOCK_ELEMENTS``, at most ``num_samples``."""
    return max(1, min(num_samples, NOISE_BLOCK_ELEMENTS // max(1, sample_numel)))


def resolve_seed(seed: int | None) -> int:
    """``seed`` validated, or one drawn from torch's global generator when ``None``."""
    if seed is None:
        return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    return seed


@dataclass
class BlockStream:
    """Rows ``[start, stop)`` of a seeded stream drawn in fixed blocks.

    Args:
        draw: ``draw(n) -> Tensor`` of shape ``(n, *shape)``, using the global RNG.
        num_samples: M, the stream length.
        block: rows per block (a function of P and M only, never of the chunk size).
        seed: the stream's seed.
        device: where the draw happens (selects which generator is forked).
    """

    draw: Callable[[int], torch.Tensor]
    num_samples: int
    block: int
    seed: int
    device: torch.device
    owns_rows: bool = False  # rows may be modified in place by the consumer (statistics only)
    _cache: tuple[int, torch.Tensor] | None = field(default=None, repr=False)

    def _block(self, b: int) -> torch.Tensor:
        if self._cache is not None and self._cache[0] == b and not self.owns_rows:
            return self._cache[1]
        n = min(self.block, self.num_samples - b * self.block)
        reuse = self._cache[1] if (self.owns_rows and self._cache is not None
                                   and self._cache[1].shape[0] == n) else None
        with seeded(mix_seed(self.seed, b), self.device):
            rows = self.draw(n, out=reuse) if reuse is not None else self.draw(n)
        self._cache = (b, rows)
        return rows

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start … stop-1`` of the stream, shape ``(stop-start, *shape)``."""
        first, last = start // self.block, (stop - 1) // self.block
        parts = []
        for b in range(first, last + 1):
            lo = max(start - b * self.block, 0)
            hi = min(stop - b * self.block, self.block)
            blk = self._block(b)
            parts.append(blk if (lo == 0 and hi == blk.shape[0]) else blk[lo:hi])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def chunks(self, chunk_size: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Yield ``(start, stop, rows)`` over the whole stream in chunks of ``chunk_size``."""
        for start in range(0, self.num_samples, chunk_size):
            stop = min(start + chunk_size, self.num_samples)
            yield start, stop, self.rows(start, stop)


# --------------------------------------------------------------------------- noise laws


@dataclass(frozen=True)
class NoiseLaw:
    """The law of the standard noise ξ of a sampling form.

    Attributes:
        name: human-readable name used by ``explain``.
        sampler: ``sampler(shape, dtype, device) -> Tensor`` using the global RNG.
        positive: ξ > 0 almost surely (needed for ``log w`` under a scaling form).
        event_ndims: trailing dims of one sample that the noise couples (Radial).
        moments: a :class:`~mcgraph.moments.PowerMoments` (location-scale) or
            :class:`~mcgraph.moments.LogMoments` (scaling) for the analytic tier, or ``None``.
    """

    name: str
    sampler: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
    positive: bool = False
    event_ndims: int = 0
    gaussian: bool = False
    fills_out: bool = False
    moments: object = None  #: exact moments (:mod:`mcgraph.moments`), or None when unknown

    def sample(self, shape, dtype, device, out: torch.Tensor | None = None) -> torch.Tensor:
        """Draw ξ of ``shape``; ``out`` (same shape and dtype) is filled in place when the law can."""
        if out is not None and self.fills_out and tuple(out.shape) == tuple(shape) and out.dtype == dtype:
            return self.sampler(tuple(shape), dtype, device, out=out)
        return self.sampler(tuple(shape), dtype, device)

    def __str__(self) -> str:
        return self.name


def _uniform_open(shape, dtype, device):
    finfo = torch.finfo(dtype)
    return torch.rand(shape, dtype=dtype, device=device).clamp_(finfo.tiny, 1.0 - finfo.eps)


def _normal(shape, dtype, device, out=None):
    if out is not None:
        return torch.randn(shape, dtype=dtype, device=device, out=out)
    return torch.randn(shape, dtype=dtype, device=device)


def _laplace(shape, dtype, device):
    finfo = torch.finfo(dtype)
    u = torch.rand(shape, dtype=dtype, device=device) * 2 - 1
    u = u.clamp_(-1 + finfo.eps, 1 - finfo.eps)
    return -u.sign() * torch.log1p(-u.abs())


def _logistic(shape, dtype, device):
    u = _uniform_open(shape, dtype, device)
    return u.log() - torch.log1p(-u)


def _cauchy(shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device).cauchy_()


def _gumbel(shape, dtype, device):
    u = _uniform_open(shape, dtype, device)
    return -torch.log(-torch.log(u))


def _uniform(shape, dtype, device):
    return torch.rand(shape, dtype=dtype, device=device)


def _exponential(shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device).exponential_()


def _half_normal(shape, dtype, device):
    return torch.randn(shape, dtype=dtype, device=device).abs_()


def _half_cauchy(shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device).cauchy_().abs_()


def _rayleigh(shape, dtype, device):
    return torch.sqrt(2 * _exponential(shape, dtype, device))


def _standard_gamma(concentration: torch.Tensor, shape, dtype, device):
    alpha = concentration.detach().to(dtype=dtype, device=device).expand(shape).contiguous()
    return torch._standard_gamma(alpha).clamp_(min=torch.finfo(dtype).tiny)


STANDARD_NORMAL = NoiseLaw("N(0, 1)", _normal, gaussian=True, fills_out=True, moments=mom.NORMAL)
STANDARD_LAPLACE = NoiseLaw("Laplace(0, 1)", _laplace, moments=mom.LAPLACE)
STANDARD_LOGISTIC = NoiseLaw("Logistic(0, 1)", _logistic, moments=mom.LOGISTIC)
STANDARD_CAUCHY = NoiseLaw("Cauchy(0, 1)", _cauchy, moments=mom.CAUCHY)
STANDARD_GUMBEL = NoiseLaw("Gumbel(0, 1)", _gumbel, moments=mom.GUMBEL)
STANDARD_UNIFORM = NoiseLaw("U(0, 1)", _uniform, positive=True, moments=mom.UNIFORM)
STANDARD_EXPONENTIAL = NoiseLaw("Exp(1)", _exponential, positive=True, moments=mom.EXPONENTIAL)
STANDARD_HALF_NORMAL = NoiseLaw("|N(0, 1)|", _half_normal, positive=True, moments=mom.HALF_NORMAL)
STANDARD_HALF_CAUCHY = NoiseLaw("|Cauchy(0, 1)|", _half_cauchy, positive=True, moments=mom.HALF_CAUCHY)
STANDARD_RAYLEIGH = NoiseLaw("Rayleigh(1)", _rayleigh, positive=True, moments=mom.RAYLEIGH)


def gamma_noise(concentration: torch.Tensor) -> NoiseLaw:
    """ξ ~ Gamma(k, 1) for a fixed shape ``k`` (broadcast against the sample)."""
    return NoiseLaw(
        f"Gamma(k, 1)",
        lambda shape, dtype, device: _standard_gamma(concentration, shape, dtype, device),
        positive=True, moments=mom.gamma(concentration),
    )


def inverse_gamma_noise(concentration: torch.Tensor) -> NoiseLaw:
    """ξ = 1/G, G ~ Gamma(k, 1)."""
    return NoiseLaw(
        "1/Gamma(k, 1)",
        lambda shape, dtype, device: _standard_gamma(concentration, shape, dtype, device).reciprocal_(),
        positive=True, moments=mom.inverse_gamma(concentration),
    )


def weibull_noise(concentration: torch.Tensor) -> NoiseLaw:
    """ξ = E^(1/k), E ~ Exp(1): a Weibull(1, k) draw."""

    def sampler(shape, dtype, device):
        k = concentration.detach().to(dtype=dtype, device=device)
        return _exponential(shape, dtype, device).pow_(k.reciprocal().expand(shape))

    return NoiseLaw("Weibull(1, k)", sampler, positive=True, moments=mom.weibull(concentration))


def student_t_noise(df: torch.Tensor) -> NoiseLaw:
    """ξ = Z / sqrt(V/ν), Z ~ N(0,1), V ~ χ²(ν) for a fixed ``df`` ν."""

    def sampler(shape, dtype, device):
        nu = df.detach().to(dtype=dtype, device=device)
        z = torch.randn(shape, dtype=dtype, device=device)
        chi2 = 2 * _standard_gamma(nu / 2, shape, dtype, device)
        return z * torch.rsqrt(chi2 / nu)

    return NoiseLaw("StudentT(ν, 0, 1)", sampler, moments=mom.student_t(df))


def radial_noise_law(event_ndims: int) -> NoiseLaw:
    """ξ = (ε/‖ε‖)·r, ε ~ N(0, I) over the last ``event_ndims`` dims, r ~ N(0, 1)."""

    def sampler(shape, dtype, device):
        eps = torch.randn(shape, dtype=dtype, device=device)
        dims = tuple(range(len(shape) - event_ndims, len(shape)))
        r_shape = shape[: len(shape) - event_ndims] + (1,) * event_ndims
        r = torch.randn(r_shape, dtype=dtype, device=device)
        norm = eps.square().sum(dim=dims, keepdim=True).sqrt() if dims else eps.abs()
        return eps / norm * r

    return NoiseLaw("Radial: (ε/‖ε‖)·r", sampler, event_ndims=event_ndims, moments=mom.radial(event_ndims))


# --------------------------------------------------------------------------- statistics


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
            (one process's share of the samples, :mod:`mcgraph.distributed`).
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
