"""The process layout of a training run started by ``torchrun``: data groups × sample groups.

``torchrun --nproc-per-node R`` sets ``RANK``, ``WORLD_SIZE`` and the rendezvous address in
the environment; :func:`ranks_from_env` joins the process group (gloo on CPU, NCCL on
CUDA) and lays the R ranks out as ``D`` data groups of ``S = R / D`` ranks:

* rank ``r`` belongs to data shard ``d = r // S`` (it sees rows ``d::D`` of every batch) and
  is sample rank ``s = r % S`` within it;
* the S ranks of a data shard form its *sample group*: they split the Monte Carlo samples
  of the data term (:mod:`mcgraph.engine.distributed`), so they end each step with identical
  gradients;
* the D ranks with the same ``s`` form a *data group*, over which
  ``DistributedDataParallel`` averages the gradients of the D shards;
* the KL, which does not depend on the data, splits its samples over all R ranks.

Without ``torchrun`` (``WORLD_SIZE`` unset or 1) everything is a no-op.

**Variational optimizers** (``mcgraph train --optimizer ivon|vogn``, :mod:`.optim_train`): D = 1,
every rank holds the whole batch, and :attr:`Ranks.world` is the optimizer's ``process_group``:
each rank draws its own weight samples and the optimizer all-reduces its gradient and curvature
statistics, so R ranks with K samples each take the step of one process with R·K samples.

**A rank that dies.** Every collective waits at most ``timeout`` seconds (``mcgraph train
--dist-timeout``, default 300) for the other ranks: when one rank is killed mid-step, the
survivors fail with an error instead of hanging (under ``torchrun`` its agent usually stops
them first). Rank 0 writes checkpoints atomically, so a resume starts from the last complete one.

**Leaving.** :meth:`Ranks.close` destroys the process group the run joined. A process that ran
gloo collectives then ends through :func:`exit_process`: gloo's worker threads release the last
collective's tensors a moment after it completes, and when that happens after interpreter
shutdown has begun the process aborts (SIGABRT, "terminate called without an active exception")
although the run succeeded.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
from torch import nn

__all__ = ["Ranks", "exit_process", "joined_gloo", "ranks_from_env"]

_joined_gloo = False  # set once this process has initialized a gloo group


@dataclass
class Ranks:
    """This process's place in the run (see the module docstring).

    Attributes:
        size, rank: the number of processes and this one's rank (1 and 0 without torchrun).
        data_parallel: D, the number of data shards.
        world: the group of all ranks (``None`` with one process): splits the KL's samples.
        samples: this rank's sample group (``None`` when S = 1).
        data: this rank's data group (``None`` when D = 1).
        owns_group: whether :func:`ranks_from_env` initialized the process group (and
            :meth:`close` destroys it).
    """

    size: int = 1
    rank: int = 0
    data_parallel: int = 1
    world: object = None
    samples: object = None
    data: object = None
    owns_group: bool = False

    def close(self) -> None:
        """Destroy the process group if this run initialized it (a no-op otherwise)."""
        if self.owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.owns_group = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def shard_index(self) -> int:
        return self.rank // (self.size // self.data_parallel)

    def shard(self, idx: torch.Tensor) -> torch.Tensor:
        """This rank's rows ``d::D`` of a batch's indices.

        Example:
            >>> Ranks(size=4, rank=3, data_parallel=2).shard(torch.arange(8))  # shard d = 3 // 2 = 1
            tensor([1, 3, 5, 7])
        """
        return idx if self.data_parallel == 1 else idx[self.shard_index::self.data_parallel]

    def wrap(self, model: nn.Module) -> nn.Module:
        """``DistributedDataParallel`` over the data group, or ``model`` itself when D = 1."""
        if self.data is None:
            return model
        device_ids = None
        p = next(model.parameters(), None)
        if p is not None and p.device.type == "cuda":
            device_ids = [p.device.index]
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, process_group=self.data)

    def barrier(self) -> None:
        if self.world is not None:
            import torch.distributed as dist

            dist.barrier(group=self.world)

    def broadcast_text(self, text: str) -> str:
        """Rank 0's ``text`` on every rank (a run directory named by the clock, say)."""
        if self.world is None:
            return text
        import torch.distributed as dist

        box = [text]
        dist.broadcast_object_list(box, src=0, group=self.world)
        return box[0]

    def describe(self) -> str:
        if self.size == 1:
            return ""
        return (f" ({self.size} processes: {self.data_parallel} data shard(s) x "
                f"{self.size // self.data_parallel} sample rank(s))")


#: seconds a collective waits for the other ranks before failing (a dead rank must not hang the others)
DEFAULT_TIMEOUT_S = 300.0


def ranks_from_env(device: torch.device, data_parallel: int = 1, timeout: float = DEFAULT_TIMEOUT_S) -> Ranks:
    """Join the ``torchrun`` process group (if any) and build the layout for ``data_parallel`` shards.

    ``timeout``: seconds every collective waits for the other ranks (a killed rank makes the others fail
    with an error naming the collective within this time, instead of hanging).

    Raises:
        ValueError: ``data_parallel`` does not divide the number of processes.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"data_parallel must be a positive int, got {data_parallel!r}")
    if size % data_parallel:
        raise ValueError(f"data_parallel: {data_parallel} data shards do not divide {size} processes")
    if size == 1:
        return Ranks()
    import torch.distributed as dist

    global _joined_gloo
    wait = datetime.timedelta(seconds=float(timeout))
    owns = not dist.is_initialized()
    if owns:
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=wait)
    _joined_gloo = _joined_gloo or dist.get_backend() == "gloo"
    rank = dist.get_rank()
    per = size // data_parallel
    samples = data = None
    for d in range(data_parallel):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(d * per, (d + 1) * per)), timeout=wait)
        if rank // per == d and per > 1:
            samples = group
    for s in range(per):
        group = dist.new_group(list(range(s, size, per)), timeout=wait)
        if rank % per == s and data_parallel > 1:
            data = group
    return Ranks(size, rank, data_parallel, dist.group.WORLD, samples, data, owns_group=owns)


def joined_gloo() -> bool:
    """Whether this process has joined a gloo process group through :func:`ranks_from_env`."""
    return _joined_gloo


def exit_process(code: int = 0) -> NoReturn:
    """End this process now with ``code``, after flushing stdout and stderr.

    ``os._exit`` skips interpreter shutdown, during which a gloo worker thread that still
    releases a finished collective's tensors aborts the process (see the module docstring).
    Call it only at the very end of a process's work: ``atexit`` handlers do not run.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced streams
            pass
    os._exit(int(code))
