"""How many samples a chunk holds: a memory budget in bytes, set from the device.

A chunked estimate (the engine's chunked tier, ``mg.nn.elbo``'s data term, ``mg.nn.predict``) holds
one chunk of samples at a time: their weight samples and the activations kept for backward. The
number of samples per chunk is

.. math::
    S = \\max\\Big(1, \\Big\\lfloor \\frac{\\text{budget}}{\\text{bytes per sample}} \\Big\\rfloor\\Big)

where the bytes per sample are measured on the first chunk (:func:`peak_bytes`: the most its tensors
held at once, weight samples, activations and what autograd keeps for backward) or, where nothing is
run first, estimated from shapes. The
budget follows the device:

* **CUDA**: a quarter of the device's free memory when the call starts, at most
  :data:`CUDA_BUDGET_CAP` (2 GiB). A GPU waits on kernel launches when chunks are small: at M = 1000
  a budget of 16 MiB cut a 1.8 M-weight MLP's ELBO into 500 chunks, 6–8× slower than chunks of 128.
* **CPU**: :data:`CPU_BUDGET` (64 MiB), what the caches favour: larger chunks run no faster there and
  hold more memory.

One program-wide setting overrides it: :func:`set_chunk_budget`, the :func:`chunk_budget` context
manager, or the environment variable ``MCGRAPH_CHUNK_BUDGET`` (bytes, with an optional unit:
``"512MiB"``, ``"2GB"``; ``"auto"`` for the device's), in that order of precedence. A ``chunk_size``
given to a call (``mg.Sampling(M, chunk_size=S)``) wins over all of them. The chunk never changes the
numbers beyond float rounding: sample ``i`` reads row ``i`` of its noise stream whatever the chunks.

Each decision is logged at ``DEBUG`` on the ``mcgraph.chunks`` logger (which chunk ran and why), and
:func:`last_decision` returns the last one of this thread.

Example:
    >>> import torch, mcgraph as mg
    >>> with mg.chunk_budget("256MiB"):
    ...     mg.engine.budget.budget_bytes(torch.device("cpu")).bytes
    268435456
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import threading
import weakref
from typing import Callable, Iterator, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: The environment variable that sets the budget for the whole program (read at every call).
ENV_VAR = "MCGRAPH_CHUNK_BUDGET"
#: The CPU budget: chunks this size keep their working set near the caches.
CPU_BUDGET = 64 << 20
#: The CUDA budget is this fraction of the device's free memory ...
CUDA_FREE_FRACTION = 0.25
#: ... and at most this many bytes (larger chunks no longer shorten a step: the device is busy).
CUDA_BUDGET_CAP = 2 << 30

LOG = logging.getLogger("mcgraph.chunks")

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10 ** 3, "kib": 1 << 10, "m": 1 << 20, "mb": 10 ** 6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10 ** 9, "gib": 1 << 30, "t": 1 << 40, "tb": 10 ** 12, "tib": 1 << 40}


def parse_bytes(value, argname: str = "budget") -> int | None:
    """``value`` as a number of bytes (``None`` for ``"auto"``/``None``): an int, or a string with a unit.

    Example:
        >>> parse_bytes("1.5GiB"), parse_bytes(4096), parse_bytes("auto")
        (1610612736, 4096, None)
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{argname} must be a number of bytes, a string such as '512MiB', or 'auto', got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{argname} must be a positive number of bytes, got {value}")
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "auto"):
            return None
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", text)
        if m is None or m.group(2) not in _UNITS:
            raise ValueError(f"{argname}: cannot read {value!r} as a size (e.g. 4096, '512MiB', '2GB' or 'auto')")
        n = int(float(m.group(1)) * _UNITS[m.group(2)])
        if n < 1:
            raise ValueError(f"{argname} must be a positive size, got {value!r}")
        return n
    raise TypeError(f"{argname} must be a number of bytes, a string such as '512MiB', or 'auto', "
                    f"got {type(value).__name__}")


class Budget(NamedTuple):
    """A budget in bytes and where it came from (for the log and ``explain``)."""

    bytes: int
    why: str


_PROGRAM: list = [None]  # set_chunk_budget's value (bytes or None): the program-wide setting
_SCOPED: contextvars.ContextVar = contextvars.ContextVar("mcgraph_chunk_budget", default=None)


def set_chunk_budget(budget) -> None:
    """Set the chunk budget for the whole program: bytes (an int, or a string such as ``"512MiB"``), or
    ``"auto"``/``None`` for the device's (see the module). Overrides ``MCGRAPH_CHUNK_BUDGET``.

    Example:
        >>> import mcgraph as mg
        >>> mg.set_chunk_budget("1GiB"); mg.set_chunk_budget("auto")
    """
    _PROGRAM[0] = parse_bytes(budget)


@contextlib.contextmanager
def chunk_budget(budget) -> Iterator[None]:
    """Within the block (this thread or task only), chunks are sized from ``budget`` bytes (an int, a string
    such as ``"512MiB"``, or ``"auto"`` for the device's budget even where a program-wide one is set)."""
    token = _SCOPED.set(("auto",) if parse_bytes(budget) is None else (parse_bytes(budget),))
    try:
        yield
    finally:
        _SCOPED.reset(token)


def _device_budget(device: torch.device) -> Budget:
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        share = int(free * CUDA_FREE_FRACTION)
        if share >= CUDA_BUDGET_CAP:
            return Budget(CUDA_BUDGET_CAP, f"{device}: {format_bytes(CUDA_BUDGET_CAP)} (the cap; "
                                           f"{CUDA_FREE_FRACTION:.0%} of {format_bytes(free)} free is more)")
        return Budget(max(1, share), f"{device}: {CUDA_FREE_FRACTION:.0%} of {format_bytes(free)} free")
    return Budget(CPU_BUDGET, f"{device.type}: {format_bytes(CPU_BUDGET)} (what the caches favour)")


def budget_bytes(device: torch.device) -> Budget:
    """The budget in effect for a chunk on ``device``: the context manager's, the program's, the
    environment's, else the device's (see the module)."""
    scoped = _SCOPED.get()
    if scoped is not None and scoped[0] != "auto":
        return Budget(scoped[0], "mg.chunk_budget(...)")
    if scoped is None:
        if _PROGRAM[0] is not None:
            return Budget(_PROGRAM[0], "mg.set_chunk_budget(...)")
        env = os.environ.get(ENV_VAR, "")
        if env.strip():
            n = parse_bytes(env, ENV_VAR)
            if n is not None:
                return Budget(n, f"{ENV_VAR}={env}")
    return _device_budget(torch.device(device))


def format_bytes(n: float) -> str:
    """``n`` bytes in words: ``"64 MiB"``, ``"2 GiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


class ChunkDecision(NamedTuple):
    """The chunk a call ran with: ``samples`` per chunk after the first ``probe`` sample(s), and why."""

    caller: str
    samples: int
    probe: int
    per_sample_bytes: int | None
    budget: Budget | None
    why: str

    def __str__(self) -> str:
        return f"{self.caller}: chunks of {self.samples} sample(s) ({self.why})"


_LAST = threading.local()


def last_decision() -> ChunkDecision | None:
    """The chunk decision of this thread's last chunked call (``None`` before any)."""
    return getattr(_LAST, "decision", None)


def _record(decision: ChunkDecision) -> ChunkDecision:
    _LAST.decision = decision
    if LOG.isEnabledFor(logging.DEBUG):
        LOG.debug(str(decision))
    return decision


def given(caller: str, chunk_size: int, num_samples: int) -> ChunkDecision:
    """The decision for a ``chunk_size`` the caller gave."""
    return _record(ChunkDecision(caller, min(chunk_size, num_samples), 0, None, None, "chunk_size given"))


def from_bytes(caller: str, per_sample_bytes: int, num_samples: int, device: torch.device, *, probe: int = 0,
               measured: str = "measured on the first chunk") -> ChunkDecision:
    """Samples per chunk for the samples after the first ``probe`` ones, from ``per_sample_bytes``."""
    budget = budget_bytes(device)
    rest = max(1, num_samples - probe)
    samples = max(1, min(rest, budget.bytes // max(1, per_sample_bytes)))
    why = f"{format_bytes(per_sample_bytes)} per sample {measured}; budget {format_bytes(budget.bytes)} ({budget.why})"
    return _record(ChunkDecision(caller, samples, probe, per_sample_bytes, budget, why))


class _LivePeak(TorchDispatchMode):
    """The most bytes that tensors allocated inside the mode held at once (each storage counted once,
    released when its last tensor is freed)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.holders: dict[tuple, int] = {}  # (device, data_ptr) -> live tensors on that storage

    def _release(self, key, nbytes):
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key, nbytes = (t.device, storage.data_ptr()), storage.nbytes()
            if key not in self.holders:
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                self.holders[key] = 0
            self.holders[key] += 1
            weakref.finalize(t, self._release, key, nbytes)
        return out


def peak_bytes(run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """``(run(), the most bytes its new tensors held at once)``: what one chunk needs beyond the model.

    Every tensor an operation allocates while ``run`` runs is counted from its allocation to its release
    (a storage once, whatever its views): the weight samples, the activations, and, under autograd, what
    is kept for backward until the result's graph is freed — the transient peak of a no-grad forward
    (a language model's ``(B, T, V)`` logits) as well as a training chunk's saved tensors.
    """
    with _LivePeak() as mode:
        out = run()
    return out, mode.peak


def chunk_windows(num_samples: int, first: int, rest: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` windows over ``[0, num_samples)``: one of ``first`` samples, then of ``rest``."""
    if num_samples <= 0:
        return
    stop = min(first, num_samples)
    yield 0, stop
    while stop < num_samples:
        start, stop = stop, min(stop + rest, num_samples)
        yield start, stop


__all__ = ["Budget", "ChunkDecision", "CPU_BUDGET", "CUDA_BUDGET_CAP", "CUDA_FREE_FRACTION", "ENV_VAR", "budget_bytes",
           "chunk_budget", "chunk_windows", "format_bytes", "from_bytes", "given", "last_decision", "parse_bytes", "peak_bytes",
           "set_chunk_budget"]
