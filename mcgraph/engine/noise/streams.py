"""Seeded block noise: the stream every estimator reads its ξ from.

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
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .. import checks


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
