"""Measuring one point: time, memory, predictions from smaller M, max-M search.

* Time: :func:`time_runs` — ``time.perf_counter`` around each call, CUDA
  synchronised before and after; the median of the timed repeats is reported.
* Memory: bytes saved for backward (``mg.graph_size`` of the loss), CUDA
  ``max_memory_allocated``, or the peak RSS of a fresh subprocess
  (:mod:`bench.harness.point`).
* Prediction: :class:`LinearFit` through the two largest measured M of a method,
  used to skip a point predicted to exceed the memory budget or the time cap
  before it is launched.
* :func:`max_feasible_m`: doubling, then bisection, on a memory probe.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int | float) -> int:
    """``"11GB"`` → 11·10⁹, ``"512MiB"`` → 512·2²⁰, ``"1.5e9"`` → 1.5·10⁹.

    Raises:
        ValueError: unparsable text (the message names the value).
    """
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"budget must look like '11GB', '512MiB' or a number of bytes, got {text!r}")
    try:
        return int(float(m.group(1)) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"budget must look like '11GB', '512MiB' or a number of bytes, got {text!r}") from None


def parse_count(text: str | int) -> int:
    """``"11.2M"`` → 11 200 000, ``"64k"`` → 64 000, ``"2**14"`` → 16 384, ``"4096"`` → 4096."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower().replace("_", "")
    if "**" in s:
        base, _, exp = s.partition("**")
        return int(base) ** int(exp)
    scale = {"k": 1e3, "m": 1e6, "g": 1e9}.get(s[-1:], None)
    try:
        return int(round(float(s[:-1]) * scale)) if scale else int(s)
    except ValueError:
        raise ValueError(f"expected a count like '11.2M', '64k', '2**14' or '4096', got {text!r}") from None


def format_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return ""
    n = float(n)
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def format_seconds(s: float | None) -> str:
    if s is None:
        return ""
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def synchronize(device: torch.device) -> None:
    """Wait for queued CUDA work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds for one call of ``fn``, CUDA synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


class Timing(NamedTuple):
    median: float
    minimum: float
    repeats: int


def time_runs(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 0) -> Timing:
    """Median and minimum over ``repeats`` timed calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        time_call(fn, device)
    times = [time_call(fn, device) for _ in range(max(1, repeats))]
    return Timing(statistics.median(times), min(times), len(times))


# --------------------------------------------------------------------------- memory


class CudaPeak:
    """``with CudaPeak(device) as p: ...`` → ``p.peak`` (max allocated) and ``p.base`` (allocated before)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak: int | None = None
        self.base: int | None = None

    def __enter__(self):
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = int(torch.cuda.memory_allocated(self.device))
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
        return False


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory error from torch (CUDA or CPU allocator) or Python."""
    if isinstance(exc, MemoryError):
        return True
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text
                                               or "not enough memory" in text)


def proc_status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes, or ``None``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process (VmHWM, else ``getrusage``)."""
    hwm = proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    try:
        import resource
        import sys

        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(r) if sys.platform == "darwin" else int(r) * 1024
    except (ImportError, OSError):
        return None


# --------------------------------------------------------------------------- prediction


@dataclass(frozen=True)
class LinearFit:
    """``y ≈ intercept + slope · M`` through measured points (slope clamped at ≥ 0).

    Fitted through the two largest measured M (memory and time of every method
    are affine in M at fixed P, up to the block structure of the noise).
    """

    intercept: float
    slope: float

    @classmethod
    def through(cls, points: Sequence[tuple[int, float]]) -> "LinearFit | None":
        pts = sorted({int(m): float(y) for m, y in points if y is not None}.items())
        if not pts:
            return None
        if len(pts) == 1:
            m, y = pts[0]
            return cls(0.0, y / max(m, 1))  # proportional: the pessimistic guess
        (m1, y1), (m2, y2) = pts[-2], pts[-1]
        slope = max(0.0, (y2 - y1) / (m2 - m1))
        return cls(y2 - slope * m2, slope)

    def __call__(self, m: int) -> float:
        return max(0.0, self.intercept + self.slope * m)


# --------------------------------------------------------------------------- max M


class Probe(NamedTuple):
    """What a probe at M found: the memory (bytes, ``None`` if it ran out), and how."""

    memory: float | None
    basis: str  # "measured" | "interpolated" | "extrapolated" | "oom"


@dataclass(frozen=True)
class MaxM:
    """Largest M whose memory stays within the budget.

    Attributes:
        m: that M (0 when even M = 1 does not fit).
        capped: the search stopped at ``m_cap`` with memory to spare ("≥ M_cap").
        basis: ``"measured"`` when every decisive probe ran, else names the extrapolation.
        probes: ``((M, memory, basis), …)`` in probe order.
    """

    m: int
    capped: bool
    basis: str
    probes: tuple = ()

    def __str__(self) -> str:
        return f"≥{self.m} (cap)" if self.capped else str(self.m)


def max_feasible_m(probe: Callable[[int], Probe], budget: float, m_cap: int = 2**20, m_start: int = 1) -> MaxM:
    """Largest M ≤ ``m_cap`` with ``probe(M).memory ≤ budget``: doubling, then bisection.

    Doubling from ``m_start`` finds the first M that does not fit (or reaches
    ``m_cap``); bisection between the last M that fits and that one finds the
    boundary exactly, assuming memory non-decreasing in M.

    Args:
        probe: ``probe(M) -> Probe``; ``memory=None`` means it ran out of memory.
        budget: bytes.
        m_cap: the largest M tried; a method that fits there is reported ``≥ m_cap``.
        m_start: first M (≥ 1).

    Example:
        >>> f = lambda m: Probe(1000 + 100 * m, "measured")
        >>> max_feasible_m(f, budget=10_000).m
        90
    """
    if m_cap < 1 or m_start < 1:
        raise ValueError(f"m_cap and m_start must be >= 1, got m_cap={m_cap}, m_start={m_start}")
    seen: dict[int, Probe] = {}

    def fits(m: int) -> bool:
        if m not in seen:
            seen[m] = probe(m)
        mem = seen[m].memory
        return mem is not None and mem <= budget

    def result(m: int, capped: bool) -> MaxM:
        decisive = [seen[k] for k in (m, good_hi) if k in seen]
        bases = {p.basis for p in decisive}
        if bases <= {"measured", "oom"}:
            basis = "measured"
        elif "extrapolated" in bases:
            basis = "extrapolated (linear fit of the two largest measured M)"
        else:
            basis = "interpolated between measured M"
        return MaxM(m, capped, basis, tuple((k, p.memory, p.basis) for k, p in seen.items()))

    good_hi = None
    m = min(m_start, m_cap)
    if not fits(m):
        if m == 1:
            return result(0, False)
        return max_feasible_m(probe, budget, m_cap=m - 1, m_start=1)
    lo, hi = m, None
    while hi is None:
        nxt = min(lo * 2, m_cap)
        if nxt == lo:  # lo == m_cap and it fits
            return result(lo, True)
        if fits(nxt):
            lo = nxt
        else:
            hi = nxt
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    good_hi = hi
    return result(lo, False)
