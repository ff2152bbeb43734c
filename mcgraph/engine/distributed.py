"""Monte Carlo samples split across the processes of a ``torch.distributed`` group.

Sample ``i`` of a stream draws its noise from ``(seed, block of i)`` alone
(:mod:`mcgraph.engine.noise`), never from who draws it. So ``R`` processes can split the
``M`` samples by index and add their partial sums: rank ``r`` evaluates the samples
of its :func:`owned_range`, and one all-reduce per tier gives every rank the sum over
all ``M`` samples:

.. math::
    \\hat E = \\frac1M \\sum_{r=0}^{R-1} \\sum_{i \\in I_r} g(w_i), \\qquad
    \\nabla \\hat E = \\frac1M \\sum_{r} \\sum_{i \\in I_r} \\nabla g(w_i),

with ``I_0 ∪ … ∪ I_{R-1} = {0, …, M−1}`` disjoint. The value and gradients equal the
single-process estimate for the same seed up to the order of the floating-point sums.

A :class:`SampleShard` is what the engine's tiers see: the rank's window of samples
(:meth:`SampleShard.window`) and :meth:`SampleShard.sum`, which all-reduces a list of
partial sums. Every reduction is preceded by a small *status* all-reduce that carries a
failure flag and the call's seed and M, so

* a rank whose local work raises (inside the integrand, say) still joins the next
  collective, every rank learns which rank failed and why, and all of them raise
  (:class:`SampleParallelError` on the others, the original exception on the failing rank)
  instead of waiting forever in a collective;
* a seed or ``num_samples`` that differs across ranks is reported before any partial sum
  is combined.

Public functions take ``process_group=None`` (one process) or a
``torch.distributed.ProcessGroup`` (``torch.distributed.group.WORLD`` for all ranks);
they build the shard with :func:`shard_for` and run their body inside
:meth:`SampleShard.guard`.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Iterator, Sequence

import torch

__all__ = ["SampleShard", "SampleParallelError", "shard_for", "owned_range", "window_chunks",
           "check_process_group", "comm_stats", "reset_comm_stats"]

_COMM = {"status_calls": 0, "data_calls": 0, "data_bytes": 0, "seconds": 0.0}


def comm_stats() -> dict:
    """Collectives issued by this process since :func:`reset_comm_stats`: counts, bytes all-reduced
    (data collectives) and wall seconds spent inside collectives (waiting for slower ranks included)."""
    return dict(_COMM)


def reset_comm_stats() -> None:
    """Zero the counters of :func:`comm_stats`."""
    _COMM.update(status_calls=0, data_calls=0, data_bytes=0, seconds=0.0)


def _all_reduce(tensor: torch.Tensor, group, op=None, kind: str = "data") -> None:
    dist = _dist()
    t0 = time.perf_counter()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group)
    _COMM["seconds"] += time.perf_counter() - t0
    _COMM[f"{kind}_calls"] += 1
    if kind == "data":
        _COMM["data_bytes"] += tensor.numel() * tensor.element_size()

# Entries of the status vector (all-reduced with MAX): the failure flag, then each checked
# quantity x as (x, -x) so that one MAX reduction gives both its maximum and its minimum.
_FAILED, _HAS_SEED, _NEG_HAS_SEED, _SEED, _NEG_SEED, _M, _NEG_M = range(7)
_STATUS_LEN = 7


class SampleParallelError(RuntimeError):
    """Another rank of the process group failed, or the ranks disagree on the call's arguments."""


def _dist():
    import torch.distributed as dist

    return dist


def check_process_group(process_group, argname: str = "process_group"):
    """``process_group`` validated: ``None``, or a group of an initialised ``torch.distributed``."""
    if process_group is None:
        return None
    dist = _dist()
    if not dist.is_available():
        raise ValueError(f"{argname}: torch.distributed is not available in this build of torch")
    if not dist.is_initialized():
        raise ValueError(f"{argname}: torch.distributed is not initialised (call "
                         "torch.distributed.init_process_group first, or pass process_group=None)")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"{argname} must be a torch.distributed.ProcessGroup or None, "
                        f"got {type(process_group).__name__}")
    return process_group


def owned_range(num_samples: int, world: int, rank: int, block: int = 1) -> tuple[int, int]:
    """The samples ``[start, stop)`` that ``rank`` of ``world`` evaluates out of ``num_samples``.

    Contiguous and disjoint ranges that cover ``[0, num_samples)``. When the stream has at
    least one noise block of ``block`` samples per rank, whole blocks are dealt out (the
    counts differ by at most one), so no block is drawn by two ranks; otherwise the samples
    themselves are split evenly (ranks then draw the blocks they share, each keeping its own
    rows). With ``num_samples < world`` some ranks own no sample.

    Example:
        >>> [owned_range(10, 3, r) for r in range(3)]
        [(0, 3), (3, 6), (6, 10)]
        >>> [owned_range(1000, 2, r, block=6) for r in range(2)]
        [(0, 498), (498, 1000)]
    """
    blocks = math.ceil(num_samples / block)
    if block > 1 and blocks >= world:
        first, last = rank * blocks // world, (rank + 1) * blocks // world
        return min(first * block, num_samples), min(last * block, num_samples)
    return rank * num_samples // world, (rank + 1) * num_samples // world


def window_chunks(stream, chunk_size: int, start: int, stop: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(a, b, rows)`` over rows ``[start, stop)`` of ``stream`` in chunks of ``chunk_size``."""
    for a in range(start, stop, chunk_size):
        b = min(a + chunk_size, stop)
        yield a, b, stream.rows(a, b)


def _mark(exc: BaseException) -> BaseException:
    exc._mcgraph_reported = True  # reported to the other ranks already: outer guards pass it on
    return exc


def _reported(exc: BaseException) -> bool:
    return bool(getattr(exc, "_mcgraph_reported", False))


class SampleShard:
    """One rank's share of a Monte Carlo call over a process group.

    Attributes:
        group: the ``torch.distributed`` process group.
        rank, world: this process's rank in ``group`` and the group's size.
        seed, num_samples: the call's seed and M, agreed on by :meth:`agree`.
    """

    def __init__(self, group) -> None:
        dist = _dist()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.seed: int | None = None
        self.num_samples: int | None = None
        backend = str(dist.get_backend(group)).lower()
        self.device = (torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend
                       else torch.device("cpu"))

    def __repr__(self) -> str:
        return (f"SampleShard(rank={self.rank}, world={self.world}, seed={self.seed}, "
                f"num_samples={self.num_samples})")

    # ------------------------------------------------------------------ ownership

    def window(self, num_samples: int, block: int = 1) -> tuple[int, int]:
        """This rank's samples ``[start, stop)`` of a stream of ``num_samples`` in blocks of ``block``."""
        return owned_range(num_samples, self.world, self.rank, block)

    def stream_window(self, stream, num_samples: int) -> tuple[int, int]:
        """This rank's rows of ``stream`` (its noise blocks when it has many)."""
        return self.window(num_samples, int(getattr(stream, "block", 1) or 1))

    # ------------------------------------------------------------------ collectives

    def _status(self, failed: bool) -> torch.Tensor:
        status = torch.zeros(_STATUS_LEN, dtype=torch.int64, device=self.device)
        status[_FAILED] = int(failed)
        if not failed and self.seed is not None:
            status[_HAS_SEED], status[_NEG_HAS_SEED] = 1, -1
            status[_SEED], status[_NEG_SEED] = self.seed, -self.seed
            status[_M], status[_NEG_M] = self.num_samples, -self.num_samples
        elif failed:
            # A failing rank must not look like a disagreement: it takes the extreme values out of the MAX.
            status[_NEG_HAS_SEED] = status[_NEG_SEED] = status[_NEG_M] = -(2 ** 62)
            status[_HAS_SEED] = status[_SEED] = status[_M] = -(2 ** 62)
        _all_reduce(status, self.group, _dist().ReduceOp.MAX, "status")
        return status.cpu()

    def _raise_remote(self, own: BaseException | None):
        """Everyone learns who failed (one object all-gather, on the failure path only)."""
        messages = [None] * self.world
        mine = None if own is None else f"{type(own).__name__}: {own}"
        _dist().all_gather_object(messages, mine, group=self.group)
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        if own is not None:
            if hasattr(own, "add_note"):
                own.add_note(f"(raised on rank {self.rank} of {self.world}; every rank of the process group "
                             "was told and raised too)")
            raise _mark(own)
        text = "; ".join(f"rank {r}: {m}" for r, m in failed)
        raise _mark(SampleParallelError(
            f"rank {self.rank} of {self.world}: the Monte Carlo computation failed on "
            f"{'rank' if len(failed) == 1 else 'ranks'} {', '.join(str(r) for r, _ in failed)} ({text})"))

    def _check(self, status: torch.Tensor, seed: bool = True) -> None:
        """Raise on every rank if a rank failed or the ranks disagree on the seed (if ``seed``) or M."""
        if int(status[_FAILED]):
            self._raise_remote(None)
        if self.seed is None:
            return

        def spread(slot: int, neg: int) -> tuple[int, int]:
            return -int(status[neg]), int(status[slot])

        lo, hi = spread(_HAS_SEED, _NEG_HAS_SEED)
        if lo != hi:
            raise _mark(SampleParallelError("process_group: some ranks passed seed=None and others a seed; "
                                            "pass the same seed on every rank (or None on all of them)"))
        for name, slot, neg, check in (("seed", _SEED, _NEG_SEED, seed), ("num_samples", _M, _NEG_M, True)):
            lo, hi = spread(slot, neg)
            if check and lo != hi:
                raise _mark(SampleParallelError(
                    f"{name} differs across the ranks of the process group (from {lo} to {hi}); every rank "
                    f"must pass the same {name} to split one estimate"))

    def agree(self, seed: int | None, num_samples: int) -> int:
        """Check ``num_samples`` (and ``seed``) across ranks; returns the common seed.

        ``seed=None`` on every rank: each rank draws one from its global generator and the
        largest draw is used by all, so the ranks share the noise whatever their RNG states.
        """
        from .noise.streams import resolve_seed

        given = seed is not None
        self.num_samples = int(num_samples)
        self.seed = resolve_seed(seed)
        status = torch.zeros(_STATUS_LEN, dtype=torch.int64, device=self.device)
        status[_HAS_SEED], status[_NEG_HAS_SEED] = int(given), -int(given)
        status[_SEED], status[_NEG_SEED] = self.seed, -self.seed
        status[_M], status[_NEG_M] = self.num_samples, -self.num_samples
        _all_reduce(status, self.group, _dist().ReduceOp.MAX, "status")
        status = status.cpu()
        self._check(status, seed=given)
        if not given:
            self.seed = int(status[_SEED])
        return self.seed

    def sum(self, compute: Callable[[], Sequence[torch.Tensor | None]],
            like: Sequence[torch.Tensor | tuple]) -> list[torch.Tensor | None]:
        """All-reduce (sum) the partial sums ``compute()`` returns, one collective per dtype.

        Args:
            compute: this rank's local work, returning one tensor (or ``None``: nothing to add)
                per entry of ``like``. An exception inside it is reported to every rank.
            like: per entry, a tensor or ``(shape, dtype[, device])`` giving the entry's shape and dtype
                (used where a rank has nothing to add, e.g. it owns no sample).

        Returns:
            The sums over ranks; an entry that is ``None`` on every rank stays ``None``.
        """
        try:
            parts = list(compute())
        except Exception as exc:  # noqa: BLE001 -- told to every rank, then re-raised here
            if _reported(exc):
                raise
            self._status(failed=True)
            self._raise_remote(exc)
        if len(parts) != len(like):
            raise RuntimeError(f"internal: {len(parts)} partial sums for {len(like)} entries")
        status = self._status(failed=False)
        self._check(status)
        specs = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else (tuple(t[0]), t[1])
                 for t in like]
        devices = [t.device if isinstance(t, torch.Tensor) else (t[2] if len(t) > 2 else self.device)
                   for t in like]
        out: list[torch.Tensor | None] = [None] * len(parts)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (_, dtype) in enumerate(specs):
            by_dtype.setdefault(dtype, []).append(i)
        for dtype, idx in by_dtype.items():
            flat = []
            for i in idx:
                shape = specs[i][0]
                p = parts[i]
                if p is None:
                    flat.append(torch.zeros(math.prod(shape), dtype=dtype, device=self.device))
                else:
                    flat.append(p.detach().to(device=self.device, dtype=dtype).reshape(-1))
            presence = torch.tensor([0.0 if parts[i] is None else 1.0 for i in idx], dtype=dtype,
                                    device=self.device)
            buf = torch.cat(flat + [presence])
            _all_reduce(buf, self.group)
            offset = 0
            for i in idx:
                n = math.prod(specs[i][0])
                out[i] = buf[offset:offset + n].reshape(specs[i][0])
                offset += n
            present = buf[offset:].tolist()
            for k, i in enumerate(idx):
                if present[k] == 0.0:
                    out[i] = None
                else:
                    out[i] = out[i].to(parts[i].device if parts[i] is not None else devices[i])
        return out

    @contextlib.contextmanager
    def guard(self):
        """Run a public call's body: a local failure is reported to every rank before it propagates.

        A failure after the call's last collective that happens on one rank only cannot be
        reported (the other ranks have returned); the engine's work after its last reduction
        is the same on every rank.
        """
        try:
            yield self
        except Exception as exc:  # noqa: BLE001
            if _reported(exc):
                raise
            self._status(failed=True)
            self._raise_remote(exc)


def shard_for(process_group) -> SampleShard | None:
    """The :class:`SampleShard` of ``process_group`` (``None`` for no group or a group of one process)."""
    group = check_process_group(process_group)
    if group is None:
        return None
    dist = _dist()
    if dist.get_world_size(group) == 1:
        return None
    return SampleShard(group)


@contextlib.contextmanager
def sharded(process_group, seed: int | None,
            num_samples: int) -> Iterator[tuple[SampleShard | None, int | None]]:
    """``with sharded(group, seed, M) as (shard, seed):`` a guarded call body with the agreed seed.

    ``shard`` is ``None`` without a group (``seed`` is then returned unchanged). A
    :class:`SampleShard` passed as ``process_group`` is the shard of an enclosing public call
    (``kl`` of a model calls ``kl_divergence`` per layer): it is used as it is.
    """
    if isinstance(process_group, SampleShard):  # the shard of an enclosing call: already agreed
        yield process_group, seed
        return
    shard = shard_for(process_group)
    if shard is None:
        yield None, seed
        return
    with shard.guard():
        agreed = shard.agree(seed, num_samples)
        yield shard, agreed
