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
import contextvars
import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from . import checks
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
    if device.type == "cpu":  # torch.random.fork_rng's work for the CPU generator alone, without its set-up
        generator = torch.default_generator
        state = generator.get_state()
        generator.manual_seed(seed)
        try:
            yield
        finally:
            generator.set_state(state)
        return
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
    return checks.seed("seed", seed)


def _storage_use_count(t: torch.Tensor) -> int | None:
    """How many tensors (views included) share ``t``'s storage, or ``None`` where torch cannot say."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:
        return None
    return counter(t.untyped_storage()._cdata)


#: The count of a storage that one tensor alone references (the probe holds one more reference).
_SOLE_USE_COUNT = _storage_use_count(torch.empty(1))


def _sole_owner(t: torch.Tensor) -> bool:
    """Whether no tensor but ``t`` itself references ``t``'s storage (no view, no autograd save)."""
    count = _storage_use_count(t)
    return count is not None and count == _SOLE_USE_COUNT


class Workspace:
    """Named scratch buffers reused from one noise block to the next (no fresh P-sized temporaries).

    A block of millions of elements is freshly mapped by the allocator every time it is allocated
    (glibc serves it with ``mmap`` and returns it on free), so a sampler that allocated its
    temporaries per block spent as much time in page faults as in arithmetic. A sampler asks the
    workspace for ``buffer(name, shape, dtype, device)`` instead: the same memory every block, grown
    only when a larger shape is asked for.

    Example:
        >>> work = Workspace()
        >>> a = work.buffer("tmp", (2, 3), torch.float32, torch.device("cpu"))
        >>> b = work.buffer("tmp", (1, 3), torch.float32, torch.device("cpu"))
        >>> a.shape, b.shape, a.data_ptr() == b.data_ptr()
        (torch.Size([2, 3]), torch.Size([1, 3]), True)
    """

    def __init__(self, reserve: int = 0) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.reserve = reserve  #: elements allocated at least (memory is only touched as it is used)

    def buffer(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous uninitialised tensor of ``shape`` (the named buffer, reused when large enough)."""
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != torch.device(device):
            self._buffers.pop(name, None)
            buf = self._buffers[name] = torch.empty(max(numel, self.reserve, 1), dtype=dtype, device=device)
        return buf[:numel].view(tuple(shape))

    def nbytes(self) -> int:
        """Bytes held by the workspace's buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class BlockPool:
    """At most one spare block buffer, handed from a finished noise stream to the next one.

    Consecutive estimates (the layers of :func:`mcgraph.nn.kl`) would each map a fresh block of
    memory for their noise stream and give it back to the OS when done; inside
    :func:`reuse_noise_blocks` a stream that is done (:meth:`BlockStream.release`) leaves its
    block here and the next stream draws into it. A buffer is lent to one stream at a time, and
    only to a stream with ``owns_rows`` (its consumer, the collapsed tier's statistics, releases it).
    """

    def __init__(self) -> None:
        self._spare: torch.Tensor | None = None
        #: the scratch buffers of every stream drawn inside the pool's scope (draws there run one at a time);
        #: sized for a whole block at once, so that the layers' growing blocks do not reallocate it
        self.workspace = Workspace(reserve=NOISE_BLOCK_ELEMENTS)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The spare buffer's first ``numel`` elements (flat), if it is large enough; it leaves the pool."""
        spare = self._spare
        if spare is None or spare.numel() < numel or spare.dtype != dtype or spare.device != device:
            return None
        self._spare = None
        return spare[:numel]

    def give(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` (flat, sole owner of its memory) as the spare if it is the largest offered."""
        if self._spare is None or buffer.numel() > self._spare.numel():
            self._spare = buffer

    def nbytes(self) -> int:
        """Bytes of the spare buffer and of the shared workspace."""
        spare = 0 if self._spare is None else self._spare.numel() * self._spare.element_size()
        return spare + self.workspace.nbytes()


_POOL: contextvars.ContextVar[BlockPool | None] = contextvars.ContextVar("mcgraph_noise_pool", default=None)


def _stream_workspace() -> Workspace:
    pool = _POOL.get()
    return Workspace() if pool is None else pool.workspace


@contextlib.contextmanager
def reuse_noise_blocks() -> Iterator[BlockPool]:
    """Within the block, a noise stream that is done hands its block buffer to the next stream.

    Use it around a sequence of estimates (one per layer): their streams then map one block of
    memory in all instead of one each, and share one :class:`Workspace` for the samplers' scratch.
    Both are freed when the block exits. :func:`mcgraph.nn.kl` (and so ``elbo``) runs its layers in one.

    Example:
        >>> import torch, mcgraph as mg
        >>> q = torch.distributions.Laplace(torch.zeros(5), torch.ones(5))
        >>> with reuse_noise_blocks() as pool:
        ...     a = mg.kl_divergence(q, torch.distributions.Normal(0.0, 1.0), 100, seed=0, method="monte-carlo")
        ...     b = mg.kl_divergence(q, torch.distributions.Normal(0.0, 2.0), 100, seed=0, method="monte-carlo")
        >>> pool.nbytes() > 0
        True
    """
    pool = _POOL.get()
    if pool is not None:  # nested: the outer pool serves
        yield pool
        return
    token = _POOL.set(BlockPool())
    try:
        yield _POOL.get()
    finally:
        _POOL.reset(token)


@dataclass
class BlockStream:
    """Rows ``[start, stop)`` of a seeded stream drawn in fixed blocks.

    The stream keeps one block. With ``fills_out`` the draw writes each new block into the memory
    of the previous one (and takes its scratch buffers from a :class:`Workspace`), as soon as no
    row view handed out earlier is still alive (or always, with ``owns_rows``, whose consumer
    promises to be done with a chunk's rows before it asks for the next chunk): drawing M samples
    then maps one block of memory, not ⌈M / block⌉ of them.

    Args:
        draw: ``draw(n) -> Tensor`` of shape ``(n, *shape)``, using the global RNG; with
            ``fills_out``, ``draw(n, out=buffer_or_None, work=workspace)``.
        num_samples: M, the stream length.
        block: rows per block (a function of P and M only, never of the chunk size).
        seed: the stream's seed.
        device: where the draw happens (selects which generator is forked).
        owns_rows: the consumer may modify rows in place and drops them before asking for the next
            chunk (statistics only).
        fills_out: ``draw`` takes ``out=`` and ``work=`` keyword arguments (:meth:`NoiseLaw.sample`).
    """

    draw: Callable[..., torch.Tensor]
    num_samples: int
    block: int
    seed: int
    device: torch.device
    owns_rows: bool = False  # rows may be modified in place by the consumer (statistics only)
    fills_out: bool = False
    row_shape: tuple | None = None  #: shape of one row, when known: a pooled buffer can then be used
    dtype: torch.dtype | None = None  #: dtype of the rows, with ``row_shape``
    _cache: tuple[int, torch.Tensor] | None = field(default=None, repr=False)
    _buffer: torch.Tensor | None = field(default=None, repr=False)
    _flat: torch.Tensor | None = field(default=None, repr=False)  # the pooled memory _buffer lies in
    _work: Workspace = field(default_factory=_stream_workspace, repr=False)

    def _block(self, b: int) -> torch.Tensor:
        if self._cache is not None and self._cache[0] == b and not self.owns_rows:
            return self._cache[1]
        n = min(self.block, self.num_samples - b * self.block)
        self._cache = None  # our own view of the last block must not count as a user of its memory
        out = None
        if (self.fills_out and self._buffer is not None and self._buffer.shape[0] >= n
                and (self.owns_rows or _sole_owner(self._buffer))):
            out = self._buffer[:n]
        elif self.owns_rows and self.fills_out and self.row_shape is not None and _POOL.get() is not None:
            # owned streams (statistics) are released when done: a pooled buffer comes back
            rows = min(self.block, self.num_samples)
            numel = rows * math.prod(self.row_shape)
            flat = _POOL.get().take(numel, self.dtype, torch.device(self.device))
            if flat is None:  # room for any block: pages are only touched (mapped) as they are written
                flat = torch.empty(max(numel, NOISE_BLOCK_ELEMENTS), dtype=self.dtype, device=self.device)
            self._flat, self._buffer = flat, flat[:numel].view((rows,) + tuple(self.row_shape))
            out = self._buffer[:n]
        with seeded(mix_seed(self.seed, b), self.device):
            rows = self.draw(n, out=out, work=self._work) if self.fills_out else self.draw(n)
        if out is None or rows.data_ptr() != out.data_ptr():
            # A fresh block (or a law that cannot fill ``out``): its memory serves the next blocks.
            # Only views of the buffer are handed out, so that _sole_owner sees who still holds one.
            self._buffer = rows if self.fills_out and rows.is_contiguous() else None
            self._flat = None
            rows = rows[:] if self._buffer is not None else rows
        self._cache = (b, rows)
        return rows

    def release(self) -> None:
        """The stream is done: its block buffer goes to the active :func:`reuse_noise_blocks` pool.

        The buffer is handed on only when no row view of it is alive any more; otherwise it is
        simply dropped (and freed with the last view).
        """
        self._cache = None
        flat = self._flat if self._flat is not None else self._buffer
        self._buffer = self._flat = None
        pool = _POOL.get()
        if pool is not None and flat is not None and _sole_owner(flat):
            pool.give(flat.view(-1))

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start … stop-1`` of the stream, shape ``(stop-start, *shape)``.

        Rows inside one block are a view of it; rows that straddle blocks are copied into one
        chunk-sized tensor, block after block, so that no more than one block is alive at a time.
        """
        first, last = start // self.block, (stop - 1) // self.block
        if first == last:
            blk = self._block(first)
            lo, hi = start - first * self.block, stop - first * self.block
            return blk if (lo == 0 and hi == blk.shape[0]) else blk[lo:hi]
        out, parts = None, []
        for b in range(first, last + 1):
            lo = max(start - b * self.block, 0)
            hi = min(stop - b * self.block, self.block)
            part = self._block(b)[lo:hi]
            if parts or (out is None and part.requires_grad):  # rsample rows carry a graph: concatenated
                parts.append(part)
                continue
            if out is None:
                out = part.new_empty((stop - start,) + tuple(part.shape[1:]))
            at = b * self.block + lo - start
            out[at:at + part.shape[0]].copy_(part)
            del part
        return torch.cat(parts) if parts else out

    def chunks(self, chunk_size: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Yield ``(start, stop, rows)`` over the whole stream in chunks of ``chunk_size``.

        The last chunk of a block is yielded as a copy when the stream reuses its buffer: the
        consumer's loop still holds it when it asks for the next chunk, and a view would keep the
        whole block from being redrawn in place (two blocks alive instead of one block and a chunk).
        """
        for start in range(0, self.num_samples, chunk_size):
            stop = min(start + chunk_size, self.num_samples)
            rows = self.rows(start, stop)
            if (self.fills_out and not self.owns_rows and stop < self.num_samples
                    and (stop - 1) // self.block != stop // self.block and self._buffer is not None
                    and rows.untyped_storage().data_ptr() == self._buffer.untyped_storage().data_ptr()):
                rows = rows.clone()
            yield start, stop, rows


# --------------------------------------------------------------------------- noise laws


@dataclass(frozen=True)
class NoiseLaw:
    """The law of the standard noise ξ of a sampling form.

    Attributes:
        name: human-readable name used by ``explain``.
        sampler: ``sampler(shape, dtype, device) -> Tensor`` using the global RNG; with
            ``fills_out``, ``sampler(shape, dtype, device, out=None, work=None)``, which writes ξ
            into ``out`` when given (same values as a fresh draw) and takes any scratch memory it
            needs from the :class:`Workspace` ``work``.
        positive: ξ > 0 almost surely (needed for ``log w`` under a scaling form).
        event_ndims: trailing dims of one sample that the noise couples (Radial).
        fills_out: the sampler takes ``out=`` and ``work=`` (all built-in laws do).
        moments: a :class:`~mcgraph.engine.moments.PowerMoments` (location-scale) or
            :class:`~mcgraph.engine.moments.LogMoments` (scaling) for the analytic tier, or ``None``.
    """

    name: str
    sampler: Callable[..., torch.Tensor]
    positive: bool = False
    event_ndims: int = 0
    gaussian: bool = False
    fills_out: bool = False
    moments: object = None  #: exact moments (:mod:`mcgraph.engine.moments`), or None when unknown

    def sample(self, shape, dtype, device, out: torch.Tensor | None = None,
               work: Workspace | None = None) -> torch.Tensor:
        """Draw ξ of ``shape``; ``out`` (same shape and dtype, contiguous) is filled when the law can.

        The values do not depend on ``out`` or ``work``, only where they are written.
        """
        shape = tuple(shape)
        if not self.fills_out:
            return self.sampler(shape, dtype, device)
        if out is not None and not (tuple(out.shape) == shape and out.dtype == dtype and out.is_contiguous()):
            out = None
        return self.sampler(shape, dtype, device, out=out, work=Workspace() if work is None else work)

    def __str__(self) -> str:
        return self.name


# Every sampler below makes the same torch calls, in the same order, as the out-of-place evaluation
# of its formula, but into ``out`` and reused workspace buffers: an in-place elementwise op over a
# whole tensor gives the same bits as its out-of-place form over that tensor.


def _empty(shape, dtype, device, out):
    return torch.empty(shape, dtype=dtype, device=device) if out is None else out


def _uniform_open(shape, dtype, device, out=None, work=None):
    finfo = torch.finfo(dtype)
    return torch.rand(shape, dtype=dtype, device=device, out=_empty(shape, dtype, device, out)).clamp_(
        finfo.tiny, 1.0 - finfo.eps)


def _normal(shape, dtype, device, out=None, work=None):
    return torch.randn(shape, dtype=dtype, device=device, out=_empty(shape, dtype, device, out))


def _laplace(shape, dtype, device, out=None, work=None):
    """ξ = −sign(u)·log1p(−|u|), u ~ U(−1, 1)."""
    finfo = torch.finfo(dtype)
    u = torch.rand(shape, dtype=dtype, device=device, out=_empty(shape, dtype, device, out))
    u.mul_(2).sub_(1).clamp_(-1 + finfo.eps, 1 - finfo.eps)
    log_term = torch.abs(u, out=work.buffer("laplace", shape, dtype, device)).neg_().log1p_()
    return u.sign_().neg_().mul_(log_term)


def _logistic(shape, dtype, device, out=None, work=None):
    """ξ = log u − log1p(−u), u ~ U(0, 1) (open)."""
    u = _uniform_open(shape, dtype, device, out)
    log1m = torch.neg(u, out=work.buffer("logistic", shape, dtype, device)).log1p_()
    return u.log_().sub_(log1m)


def _cauchy(shape, dtype, device, out=None, work=None):
    return _empty(shape, dtype, device, out).cauchy_()


def _gumbel(shape, dtype, device, out=None, work=None):
    """ξ = −log(−log u), u ~ U(0, 1) (open)."""
    return _uniform_open(shape, dtype, device, out).log_().neg_().log_().neg_()


def _uniform(shape, dtype, device, out=None, work=None):
    return torch.rand(shape, dtype=dtype, device=device, out=_empty(shape, dtype, device, out))


def _exponential(shape, dtype, device, out=None, work=None):
    return _empty(shape, dtype, device, out).exponential_()


def _half_normal(shape, dtype, device, out=None, work=None):
    return _normal(shape, dtype, device, out).abs_()


def _half_cauchy(shape, dtype, device, out=None, work=None):
    return _cauchy(shape, dtype, device, out).abs_()


def _rayleigh(shape, dtype, device, out=None, work=None):
    return _exponential(shape, dtype, device, out).mul_(2).sqrt_()


def _standard_gamma(concentration: torch.Tensor, shape, dtype, device, work=None):
    """Gamma(k, 1) draws of ``shape``: a fresh tensor (torch's gamma sampler has no ``out=``).

    The broadcast concentration goes into a workspace buffer rather than a fresh copy.
    """
    alpha = concentration.detach().to(dtype=dtype, device=device).expand(shape)
    alpha = alpha.contiguous() if work is None else work.buffer("gamma", shape, dtype, device).copy_(alpha)
    return torch._standard_gamma(alpha).clamp_(min=torch.finfo(dtype).tiny)


STANDARD_NORMAL = NoiseLaw("N(0, 1)", _normal, gaussian=True, fills_out=True, moments=mom.NORMAL)
STANDARD_LAPLACE = NoiseLaw("Laplace(0, 1)", _laplace, fills_out=True, moments=mom.LAPLACE)
STANDARD_LOGISTIC = NoiseLaw("Logistic(0, 1)", _logistic, fills_out=True, moments=mom.LOGISTIC)
STANDARD_CAUCHY = NoiseLaw("Cauchy(0, 1)", _cauchy, fills_out=True, moments=mom.CAUCHY)
STANDARD_GUMBEL = NoiseLaw("Gumbel(0, 1)", _gumbel, fills_out=True, moments=mom.GUMBEL)
STANDARD_UNIFORM = NoiseLaw("U(0, 1)", _uniform, positive=True, fills_out=True, moments=mom.UNIFORM)
STANDARD_EXPONENTIAL = NoiseLaw("Exp(1)", _exponential, positive=True, fills_out=True,
                                moments=mom.EXPONENTIAL)
STANDARD_HALF_NORMAL = NoiseLaw("|N(0, 1)|", _half_normal, positive=True, fills_out=True,
                                moments=mom.HALF_NORMAL)
STANDARD_HALF_CAUCHY = NoiseLaw("|Cauchy(0, 1)|", _half_cauchy, positive=True, fills_out=True,
                                moments=mom.HALF_CAUCHY)
STANDARD_RAYLEIGH = NoiseLaw("Rayleigh(1)", _rayleigh, positive=True, fills_out=True, moments=mom.RAYLEIGH)


def gamma_noise(concentration: torch.Tensor) -> NoiseLaw:
    """ξ ~ Gamma(k, 1) for a fixed shape ``k`` (broadcast against the sample)."""

    def sampler(shape, dtype, device, out=None, work=None):
        return _standard_gamma(concentration, shape, dtype, device, work)

    return NoiseLaw("Gamma(k, 1)", sampler, positive=True, fills_out=True, moments=mom.gamma(concentration))


def inverse_gamma_noise(concentration: torch.Tensor) -> NoiseLaw:
    """ξ = 1/G, G ~ Gamma(k, 1)."""

    def sampler(shape, dtype, device, out=None, work=None):
        return _standard_gamma(concentration, shape, dtype, device, work).reciprocal_()

    return NoiseLaw("1/Gamma(k, 1)", sampler, positive=True, fills_out=True,
                    moments=mom.inverse_gamma(concentration))


def weibull_noise(concentration: torch.Tensor) -> NoiseLaw:
    """ξ = E^(1/k), E ~ Exp(1): a Weibull(1, k) draw."""

    def sampler(shape, dtype, device, out=None, work=None):
        k = concentration.detach().to(dtype=dtype, device=device)
        return _exponential(shape, dtype, device, out).pow_(k.reciprocal().expand(shape))

    return NoiseLaw("Weibull(1, k)", sampler, positive=True, fills_out=True,
                    moments=mom.weibull(concentration))


def student_t_noise(df: torch.Tensor) -> NoiseLaw:
    """ξ = Z / sqrt(V/ν), Z ~ N(0,1), V ~ χ²(ν) for a fixed ``df`` ν."""

    def sampler(shape, dtype, device, out=None, work=None):
        nu = df.detach().to(dtype=dtype, device=device)
        z = _normal(shape, dtype, device, out)
        chi2 = _standard_gamma(nu / 2, shape, dtype, device, work).mul_(2)
        return z.mul_(chi2.div_(nu).rsqrt_())

    return NoiseLaw("StudentT(ν, 0, 1)", sampler, fills_out=True, moments=mom.student_t(df))


@functools.lru_cache(maxsize=None)  # a function of event_ndims alone: one law per rank of the event
def radial_noise_law(event_ndims: int) -> NoiseLaw:
    """ξ = (ε/‖ε‖)·r, ε ~ N(0, I) over the last ``event_ndims`` dims, r ~ N(0, 1).

    ε is drawn into ``out`` and divided and scaled there; its squares, whose sums give the norms,
    go into a workspace buffer. They are reduced whole, as ``eps.square().sum(dims)`` would be:
    torch splits a reduction with few outputs across threads depending on how many outputs there
    are, so summing the rows in smaller groups would not give the same bits.
    """

    def sampler(shape, dtype, device, out=None, work=None):
        eps = _normal(shape, dtype, device, out)
        lead = len(shape) - event_ndims
        r_shape = shape[:lead] + (1,) * event_ndims
        if event_ndims:
            r = torch.randn(r_shape, dtype=dtype, device=device)
            squares = torch.square(eps, out=work.buffer("radial_sq", shape, dtype, device))
            norm = squares.sum(dim=tuple(range(lead, len(shape))), keepdim=True).sqrt_()
        else:  # ε/|ε|·r with r of the full shape
            r = _normal(shape, dtype, device, work.buffer("radial_r", shape, dtype, device))
            norm = torch.abs(eps, out=work.buffer("radial_norm", shape, dtype, device))
        return eps.div_(norm).mul_(r)

    return NoiseLaw("Radial: (ε/‖ε‖)·r", sampler, event_ndims=event_ndims, fills_out=True,
                    moments=mom.radial(event_ndims))


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
