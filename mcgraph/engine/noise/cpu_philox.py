"""The compiled CPU noise stream: Philox4x32-10 drawn and reduced in one parallel C++ loop.

torch's CPU ``randn`` draws from one generator stream on one core, and the collapsed
tier then reads the M × P noise back from memory to sum its powers. This stream is
counter-based instead: ξ for sample ``i`` and element ``j`` of a draw of ``P``
elements is a pure function of ``(seed, i·P + j)``,

.. code-block:: text

    counter = (lo32(i·P + j), hi32(i·P + j), 0, 0)     key = (lo32(seed), hi32(seed))
    (w0, w1, w2, w3) = Philox4x32-10(counter, key)
    u1, u2 = open uniforms from the words               ξ = law(u1, u2)

— the layout of the Triton backend (:mod:`mcgraph.kernels.noise_laws`), so both
backends draw the same ξ up to float rounding of the transforms. Any sample of any
element can be drawn directly, so the stream is reproducible per sample, whatever
the chunk size, block size or number of threads, and the statistics

.. math::
    \\bar t_{a,j}[p] = \\frac1M \\sum_{i=1}^{M} \\xi_{i,p}^{a} (\\log \\xi_{i,p})^{j}

are accumulated in one loop over all cores (OpenMP, ``torch.get_num_threads()``
threads) without materialising the noise. Sums are kept in float64;
the order of the final sum over sample segments depends on (M, P) only, so the
statistics do not change with the number of threads.

The library (``mcgraph/engine/noise/csrc/cpu_philox.cpp``, plain C++ with OpenMP, no torch headers) is
compiled on first use, never at import: one ``$CXX`` (default ``c++``) call with ``-O3
-march=native -fopenmp`` (about a second), into ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``), and loaded with :mod:`ctypes`; later processes load the
cached build. Its OpenMP loop runs on torch's OpenMP runtime (the same ``libgomp`` is
loaded once) with ``torch.get_num_threads()`` threads. The build's name hashes the
source, the flags and the CPU's instruction-set flags, so a cache shared between
machines never loads code built for another CPU. When the build fails (no compiler:
``CXX`` names a missing program, or none is installed) :func:`extension` returns
``None``, :func:`unavailable_reason` says why, and :mod:`mcgraph.engine.noise.backends` keeps the
torch stream.

Example:
    >>> from mcgraph.engine.noise import cpu_philox
    >>> if cpu_philox.extension() is not None:  # builds on first use (tens of seconds, once)
    ...     xi = cpu_philox.rows("normal", (3, 4), 0, 8, seed=0)
    ...     assert xi.shape == (8, 3, 4)
"""

from __future__ import annotations

import ctypes
import math
import pathlib

import torch

from .. import native

#: Elementwise noise laws the compiled stream draws and reduces (``mcgraph.engine.noise.backends.triton_noise``
#: names) → the C++ law code.
LAWS = {"normal": 0, "laplace": 1, "logistic": 2, "cauchy": 3, "gumbel": 4, "uniform": 5, "exponential": 6,
        "half_normal": 7, "half_cauchy": 8, "rayleigh": 9}

#: Laws with ξ > 0 almost surely (statistics with log ξ allowed).
#: Laws of the rows (:func:`rows`, :class:`PhiloxCPUStream`) beyond :data:`LAWS`: ``"radial"``,
#: ξ = ε/‖ε‖·r over an event, drawn as in the Triton backend (ε the normal rows, r at counter tag 1).
#: :func:`statistics` does not take it: its statistics are reduced from the rows.
ROW_LAWS = frozenset(LAWS) | {"radial"}

POSITIVE = frozenset({"uniform", "exponential", "half_normal", "half_cauchy", "rayleigh"})

#: Elements one work item of the C++ loops draws together (``LANES`` in the source).
LANES = 32
#: Elements of ε one chunk of :func:`radial_statistics` holds (16 MiB in float32), but never fewer
#: than :data:`RADIAL_MIN_CHUNK` samples: small enough that the buffer is reused from the allocator's
#: heap and read back while still cached, large enough that the float64 sums (2 × 8 bytes per element
#: and key, read and written once a chunk) cost little per sample. The whole Radial KL at P = 10⁶,
#: M = 100 against the Normal one: 1.24× on one thread, 1.31–1.34× on two (2²⁶ elements: 1.97× on
#: one). 2²³ gives 1.26× and 1.29×, but two processes sharing the cache then split the ResNet-18 KL
#: 1.70× instead of 1.76–1.82×. At P = 2.4·10⁶ the statistics take 1.36× the normal ones at 4
#: samples a chunk, 1.44× at 1.
RADIAL_CHUNK_ELEMENTS = 2**22
RADIAL_MIN_CHUNK = 4

#: Work items the statistics loop aims for (element tiles × sample segments), so that all cores are busy
#: even when P is small; the segments are a function of (M, P) only.
TARGET_ITEMS = 64

#: Samples per segment at least (a segment's sums are one K × P block of float64 partials).
MIN_SEGMENT = 256

_SOURCE = pathlib.Path(__file__).with_name("csrc") / "cpu_philox.cpp"
_FLAGS = list(native.FLAGS)
#: Seconds a build may take before it counts as failed.
BUILD_TIMEOUT = native.BUILD_TIMEOUT


def _declare(lib) -> None:
    i64, u64, vp, ci = ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int
    lib.mcgraph_philox_rows.argtypes = [ci, i64, i64, i64, u64, ci, vp, ci]
    lib.mcgraph_philox_rows.restype = ci
    lib.mcgraph_philox_stats.argtypes = [ci, i64, i64, u64, ci, vp, vp, ci, i64, i64, vp, ci]
    lib.mcgraph_philox_stats_window.restype = ci
    lib.mcgraph_philox_stats_window.argtypes = [ci, i64, i64, i64, u64, ci, vp, vp, ci, i64, i64, vp, ci]
    lib.mcgraph_philox_stats.restype = ci
    lib.mcgraph_philox_radius.argtypes = [i64, i64, i64, u64, ci, vp, ci]
    lib.mcgraph_philox_radius.restype = ci
    lib.mcgraph_scaled_power_sums.argtypes = [vp, i64, i64, i64, vp, ci, vp, ci, vp, ci]
    lib.mcgraph_scaled_power_sums.restype = ci
    lib.mcgraph_event_norms.argtypes = [vp, i64, i64, ci, vp, ci]
    lib.mcgraph_event_norms.restype = ci
    lib.mcgraph_philox_rows_norms.argtypes = [i64, i64, i64, i64, u64, ci, vp, vp, ci]
    lib.mcgraph_philox_rows_norms.restype = ci
    lib.mcgraph_philox_words.argtypes = [u64, u64, vp]
    lib.mcgraph_philox_words.restype = None
    lib.mcgraph_philox_isa.restype = ctypes.c_char_p
    if lib.mcgraph_philox_lanes() != LANES:
        raise RuntimeError(f"built with LANES = {lib.mcgraph_philox_lanes()}, expected {LANES}")


_LIBRARY = native.NativeLibrary("cpu_philox", _SOURCE, _declare, _FLAGS)
_cpu_flags = native.cpu_flags
compiler = native.compiler
build_path = _LIBRARY.build_path


def _build(path: pathlib.Path, flags=tuple(_FLAGS)) -> None:
    _LIBRARY.build(path, flags)


def _load(path: pathlib.Path):
    return _LIBRARY.open(path)


def extension():
    """The compiled library (built on first call, cached on disk), or ``None`` when it cannot be had.

    Never raises: a failed build is remembered for the rest of the process and
    :func:`unavailable_reason` returns its message.
    """
    return _LIBRARY.load()


def built() -> bool:
    """Whether this process has already loaded the library (no build is attempted)."""
    return _LIBRARY.built()


def unavailable_reason() -> str | None:
    """Why :func:`extension` returned ``None`` (``None`` when it loaded or was never tried)."""
    return _LIBRARY.unavailable_reason()


def isa() -> str | None:
    """The instruction set of the loaded build's Philox rounds (``avx512``, ``avx2``, ``portable``)."""
    lib = _LIBRARY.load() if _LIBRARY.built() else None
    return None if lib is None else lib.mcgraph_philox_isa().decode()


def philox_words(seed: int, offset: int) -> torch.Tensor:
    """Philox4x32-10 words of counters ``offset … offset+LANES-1``: ``(2, 4, LANES)`` int64.

    Row 0 from the vectorised rounds the streams use, row 1 from the portable loop (tests
    compare both with each other and with an independent implementation).
    """
    out = torch.zeros(8 * LANES, dtype=torch.int32)
    _module().mcgraph_philox_words(_check_seed(seed), int(offset), out.data_ptr())
    return out.to(torch.int64).remainder(2**32).reshape(2, 4, LANES)


def _law_code(noise: str) -> int:
    try:
        return LAWS[noise]
    except (KeyError, TypeError):
        raise ValueError(f"noise: the CPU Philox stream has no law {noise!r}; "
                         f"it draws {sorted(LAWS)}") from None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"dtype: {dtype} is not supported by the CPU Philox stream "
                        f"(float16, bfloat16, float32 or float64)")
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return seed


def _module():
    mod = extension()
    if mod is None:
        raise RuntimeError(f"the CPU Philox extension could not be built: {unavailable_reason()}")
    return mod


def rows(noise: str, shape, start: int, stop: int, seed: int,
         dtype: torch.dtype = torch.float32, *, event_ndims: int = 0, out: torch.Tensor | None = None,
         _lib=None) -> torch.Tensor:
    """Rows ``start … stop-1`` of the stream, shape ``(stop-start, *shape)``, drawn in parallel.

    ``"radial"`` rows are ξ = ε·r/‖ε‖ with ε the ``"normal"`` rows, the norm over the last
    ``event_ndims`` dims (``|ε|`` when 0) and r a standard normal per (sample ``i``, batch element
    ``b``) at counter ``(lo32(i·B + b), hi32(i·B + b), 1, 0)`` — the Triton backend's Radial layout.
    ε is scaled in place: the only other memory is the (stop-start) × B radii and norms.

    Args:
        noise: a law of :data:`LAWS`, or ``"radial"``.
        shape: shape of one draw (P = prod(shape) elements).
        start, stop: sample indices, ``0 ≤ start ≤ stop``.
        seed: stream seed in [0, 2⁶³).
        dtype: float32 or float64 (half types are drawn in float32 and cast).
        event_ndims: ``"radial"`` only: trailing dims of ``shape`` normalised together.
        out: a contiguous float32 / float64 tensor of at least ``(stop-start)·P`` elements in the
            compute dtype of ``dtype``, drawn into (and returned as a view of) instead of a new one.

    Raises:
        RuntimeError: the extension could not be built (:func:`unavailable_reason`).
    """
    radial = noise == "radial"
    code = LAWS["normal"] if radial else _law_code(noise)
    cdt = _compute_dtype(dtype)
    seed = _check_seed(seed)
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop):
        raise ValueError(f"start, stop must be ints with 0 <= start <= stop, got {start!r}, {stop!r}")
    shape = tuple(int(s) for s in shape)
    if (isinstance(event_ndims, bool) or not isinstance(event_ndims, int)
            or not 0 <= event_ndims <= len(shape)):
        raise ValueError(f"event_ndims must be an int in [0, {len(shape)}] for shape {shape}, "
                         f"got {event_ndims!r}")
    if event_ndims and not radial:
        raise ValueError(f"event_ndims: only the 'radial' law couples elements, "
                         f"got {event_ndims} for {noise!r}")
    lib = _module() if _lib is None else _lib  # _lib: another build of the source (tests)
    size = (stop - start) * math.prod(shape)
    if out is None:
        out = torch.empty((stop - start,) + shape, dtype=cdt)
    elif (not isinstance(out, torch.Tensor) or out.dtype != cdt or out.device.type != "cpu"
          or not out.is_contiguous() or out.numel() < size):
        raise ValueError(f"out must be a contiguous CPU {cdt} tensor of at least {size} elements")
    else:
        out = out.view(-1)[:size].view((stop - start,) + shape)
    if not out.numel():
        return out.to(dtype)
    if radial:
        _radial_rows(lib, out, event_ndims, start, stop, seed)
    elif lib.mcgraph_philox_rows(code, math.prod(shape), start, stop, seed, cdt == torch.float64,
                                 out.data_ptr(), torch.get_num_threads()) != 0:
        raise RuntimeError("cpu_philox.rows: the library rejected its arguments")
    return out.to(dtype)


def _radial_rows(lib, out: torch.Tensor, event_ndims: int, start: int, stop: int, seed: int) -> None:
    """``out`` ← the radial rows ε·r/max(‖ε‖, 1e-30) (the Triton Radial factor), r the tag-1 radii."""
    eps, norms = _normal_rows_and_norms(lib, out, event_ndims, start, stop, seed)
    events, factor = _radial_factors(lib, eps, event_ndims, start, stop, seed, norms)
    events.mul_(factor.unsqueeze(-1))


def _event_layout(shape, event_ndims: int) -> tuple[int, int]:
    """``(B, D)``: the events per draw and the elements per event."""
    event = math.prod(shape[len(shape) - event_ndims:]) if event_ndims else 1
    return math.prod(shape) // event, event


def _normal_rows_and_norms(lib, out: torch.Tensor, event_ndims: int, start: int, stop: int, seed: int):
    """``out`` ← normal rows ε; returns ``(ε, ‖ε‖ per event or None)``, shape ``(n, B)`` in float64.

    Where no tile of :data:`LANES` elements straddles two events (one event per draw, or events of a
    multiple of LANES elements) the norms are summed while the rows are drawn, in the library's fixed
    order; otherwise ``None`` (:func:`_radial_factors` reads the rows again).
    """
    n, shape, fp64 = stop - start, tuple(out.shape[1:]), out.dtype == torch.float64
    batch, event = _event_layout(shape, event_ndims)
    if batch == 1 or event % LANES == 0:
        norms = torch.empty((n, batch), dtype=torch.float64)
        if lib.mcgraph_philox_rows_norms(batch * event, batch, start, stop, seed, fp64, out.data_ptr(),
                                         norms.data_ptr(), torch.get_num_threads()) != 0:
            raise RuntimeError("cpu_philox.rows: the library rejected the radial arguments")
        return out, norms
    if lib.mcgraph_philox_rows(LAWS["normal"], batch * event, start, stop, seed, fp64, out.data_ptr(),
                               torch.get_num_threads()) != 0:
        raise RuntimeError("cpu_philox.rows: the library rejected its arguments")
    return out, None


def _radial_factors(lib, eps: torch.Tensor, event_ndims: int, start: int, stop: int, seed: int,
                    norm: torch.Tensor | None = None):
    """``(ε viewed (n, B, D), r/max(‖ε‖, 1e-30) of shape (n, B))`` for normal rows ``eps``; ``norm``:
    the float64 event norms when already summed (:func:`_normal_rows_and_norms`)."""
    n = stop - start
    batch, event = _event_layout(tuple(eps.shape[1:]), event_ndims)
    radius = torch.empty((n, batch), dtype=eps.dtype)
    if lib.mcgraph_philox_radius(batch, start, stop, seed, eps.dtype == torch.float64, radius.data_ptr(),
                                 torch.get_num_threads()) != 0:
        raise RuntimeError("cpu_philox.rows: the library rejected the radius arguments")
    events = eps.view(n, batch, event)
    if norm is None:
        norm = torch.empty((n, batch), dtype=torch.float64)  # in a fixed order: whatever the chunks and threads
        if lib.mcgraph_event_norms(eps.data_ptr(), n * batch, event, eps.dtype == torch.float64,
                                   norm.data_ptr(), torch.get_num_threads()) != 0:
            raise RuntimeError("cpu_philox.rows: the library rejected the norm arguments")
    return events, radius.div_(norm.to(eps.dtype).clamp_min_(1e-30))


def radial_statistics(shape, num_samples: int, seed: int, keys, dtype: torch.dtype = torch.float32, *,
                      event_ndims: int = 0, chunk_size: int | None = None) -> dict | None:
    """``{(a, 0): mean_i ξ_i^a}`` of the ``"radial"`` rows for positive powers ``a``, else ``None``.

    Chunk by chunk: ε drawn into one reused buffer, the factors r/‖ε‖ as in :func:`rows`, then
    Σ_i (ε_i·f_i)^a summed in float64 by one parallel C++ pass over the buffer — the ξ of
    :func:`rows` (the same float product), never written back. Keys with logs or ``a < 1``
    give ``None`` (the caller reduces the rows instead).

    Args:
        shape: shape of one draw of ξ.
        num_samples: M ≥ 1.
        seed: stream seed in [0, 2⁶³).
        keys: ``(a, j)`` pairs; ``(0, 0)`` is 1.
        dtype: of the statistics and of the draws (float64 draws in float64, others in float32).
        event_ndims: trailing dims of ``shape`` normalised together.
        chunk_size: samples per chunk (default: about :data:`RADIAL_CHUNK_ELEMENTS` elements, at least
            :data:`RADIAL_MIN_CHUNK` samples).
    """
    keys = tuple(dict.fromkeys(tuple(k) for k in keys))
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    sums = radial_sums(shape, seed, keys, dtype, start=0, stop=num_samples, event_ndims=event_ndims,
                       chunk_size=chunk_size)
    if sums is None:
        return None
    shape = tuple(int(s) for s in shape)
    out = {k: torch.ones(shape, dtype=dtype) for k in keys if k == (0, 0)}
    return {**out, **{k: v.div(num_samples).reshape(shape).to(dtype) for k, v in sums.items()}}


def radial_sums(shape, seed: int, keys, dtype: torch.dtype = torch.float32, *, start: int, stop: int,
                event_ndims: int = 0, chunk_size: int | None = None) -> dict | None:
    """``{(a, 0): Σ_{start ≤ i < stop} ξ_i^a}`` in float64, shape ``(P,)``: the sums of samples ``[start, stop)``
    of the stream :func:`radial_statistics` averages (a process's share of the M samples; the shares' sums
    over a partition of ``[0, M)``, divided by M, are the statistics). ``None`` for keys it does not cover.
    """
    if not sums_cover("radial", keys):
        return None
    keys = tuple(dict.fromkeys(tuple(k) for k in keys))
    drawn = [k for k in keys if k != (0, 0)]
    cdt = _compute_dtype(dtype)
    seed = _check_seed(seed)
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop):
        raise ValueError(f"start, stop: a window 0 <= start <= stop of samples, got {start!r}, {stop!r}")
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if not isinstance(event_ndims, int) or not 0 <= event_ndims <= len(shape):
        raise ValueError(f"event_ndims must be an int in [0, {len(shape)}] for shape {shape}, "
                         f"got {event_ndims!r}")
    event = math.prod(shape[len(shape) - event_ndims:]) if event_ndims else 1
    if not drawn or numel == 0:
        return {k: torch.zeros(numel, dtype=torch.float64) for k in drawn}
    sums = _radial_power_sums(shape, start, stop, seed, drawn, cdt, event, event_ndims, chunk_size)
    return {k: sums[n] for n, k in enumerate(drawn)}


def _radial_power_sums(shape: tuple, first: int, last: int, seed: int, drawn: list, cdt: torch.dtype, event: int,
                       event_ndims: int, chunk_size: int | None) -> torch.Tensor:
    """``(len(drawn), P)`` float64 sums of ξ_i^a over samples ``[first, last)``, chunk by chunk (see
    :func:`radial_statistics`)."""
    from .streams import _POOL  # the block pool of mcgraph.engine.noise.streams.reuse_noise_blocks

    numel = math.prod(shape)
    acc = torch.zeros((len(drawn), numel), dtype=torch.float64)
    if last <= first:
        return acc
    lib = _module()
    chunk = chunk_size or min(last - first, max(RADIAL_MIN_CHUNK, RADIAL_CHUNK_ELEMENTS // numel))
    pool = _POOL.get()
    buffer = pool.take(chunk * numel, cdt, torch.device("cpu")) if pool is not None else None
    if buffer is None:
        buffer = torch.empty(chunk * numel, dtype=cdt)
    powers = torch.tensor([a for a, _ in drawn], dtype=torch.int64)
    fp64 = cdt == torch.float64
    for start in range(first, last, chunk):
        stop = min(start + chunk, last)
        eps = buffer[:(stop - start) * numel].view((stop - start,) + shape)
        eps, norms = _normal_rows_and_norms(lib, eps, event_ndims, start, stop, seed)
        _, factor = _radial_factors(lib, eps, event_ndims, start, stop, seed, norms)
        if lib.mcgraph_scaled_power_sums(eps.data_ptr(), stop - start, numel, event, factor.data_ptr(),
                                         len(drawn), powers.data_ptr(), fp64, acc.data_ptr(),
                                         torch.get_num_threads()) != 0:
            raise RuntimeError("cpu_philox.radial_statistics: the library rejected its arguments")
    if pool is not None:  # the next layer's draw reuses it (no fresh mapping, no page faults)
        pool.give(buffer._base if buffer._base is not None else buffer)
    return acc


def segments_for(num_samples: int, numel: int) -> int:
    """Sample segments of the statistics loop: enough work items for all cores, a function of (M, P) only."""
    tiles = max(1, -(-numel // LANES))
    return max(1, min(-(-TARGET_ITEMS // tiles), num_samples // MIN_SEGMENT))


def statistics(noise: str, shape, num_samples: int, seed: int, keys,
               dtype: torch.dtype = torch.float32) -> dict[tuple[int, int], torch.Tensor]:
    """``{(a, j): mean_i ξ_i^a (log ξ_i)^j}`` of the stream, shape ``shape``, in one parallel pass.

    .. math::
        \\bar t_{a,j}[p] = \\frac1M \\sum_{i=1}^M \\xi_{i,p}^{a} (\\log \\xi_{i,p})^{j}

    Args:
        noise: a law of :data:`LAWS`.
        shape: shape of one draw of ξ.
        num_samples: M ≥ 1.
        seed: stream seed in [0, 2⁶³).
        keys: ``(a, j)`` pairs, ``a`` any int, ``j ≥ 0`` (``j > 0`` needs a positive law); ``(0, 0)`` is 1.
        dtype: of the returned statistics (the sums are float64 whatever the dtype).

    Raises:
        RuntimeError: the extension could not be built (:func:`unavailable_reason`).
    """
    code = _law_code(noise)
    _compute_dtype(dtype)
    seed = _check_seed(seed)
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    keys = _checked_keys(noise, keys)
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    out = {k: torch.ones(shape, dtype=dtype) for k in keys if k == (0, 0)}
    drawn = [k for k in keys if k != (0, 0)]
    if not drawn:
        return out
    if numel == 0:
        return {**out, **{k: torch.empty(shape, dtype=dtype) for k in drawn}}
    means = _law_sums(code, numel, 0, num_samples, seed, drawn, dtype).div_(num_samples)
    return {**out, **{k: means[n].reshape(shape).to(dtype) for n, k in enumerate(drawn)}}


def sums(noise: str, shape, seed: int, keys, dtype: torch.dtype = torch.float32, *, start: int,
         stop: int) -> dict[tuple[int, int], torch.Tensor]:
    """``{(a, j): Σ_{start ≤ i < stop} ξ_i^a (log ξ_i)^j}`` in float64, shape ``(P,)``: samples ``[start, stop)``
    of the stream :func:`statistics` averages (a process's share of the M samples; the shares' sums over a
    partition of ``[0, M)``, divided by M, are the statistics). ``(0, 0)`` is not a key here.
    """
    code = _law_code(noise)
    _compute_dtype(dtype)
    seed = _check_seed(seed)
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop):
        raise ValueError(f"start, stop: a window 0 <= start <= stop of samples, got {start!r}, {stop!r}")
    drawn = _checked_keys(noise, keys)
    if (0, 0) in drawn:
        raise ValueError("keys: (0, 0) is the constant 1, not a sum of draws; leave it out")
    numel = math.prod(int(s) for s in shape)
    if stop == start or numel == 0 or not drawn:
        return {k: torch.zeros(numel, dtype=torch.float64) for k in drawn}
    total = _law_sums(code, numel, start, stop - start, seed, drawn, dtype)
    return {k: total[n] for n, k in enumerate(drawn)}


def _checked_keys(noise: str, keys) -> tuple:
    """``keys`` without repeats, each checked: a pair ``(a, j)`` of ints with ``j ≥ 0``, ``j > 0`` only for a
    positive law (raises ``ValueError`` naming the key)."""
    keys = tuple(dict.fromkeys(tuple(k) for k in keys))
    for a, j in keys:
        if not isinstance(a, int) or not isinstance(j, int) or j < 0:
            raise ValueError(f"keys: each key must be a pair (a, j) of ints with j >= 0, got {(a, j)!r}")
        if j > 0 and noise not in POSITIVE:
            raise ValueError(f"keys: {(a, j)} needs log ξ, but noise {noise!r} is not positive")
    return keys


def sums_cover(noise: str, keys) -> bool:
    """Whether the windowed sums cover every key of ``keys`` but ``(0, 0)``: :func:`sums` for a law of
    :data:`LAWS` (any ``(a, j)`` its statistics take), :func:`radial_sums` for ``"radial"`` (positive powers)."""
    drawn = [tuple(k) for k in keys if tuple(k) != (0, 0)]
    if not all(isinstance(a, int) and not isinstance(a, bool) and isinstance(j, int) for a, j in drawn):
        return False
    if noise == "radial":
        return all(a >= 1 and j == 0 for a, j in drawn)
    return noise in LAWS and all(j >= 0 and (j == 0 or noise in POSITIVE) for _, j in drawn)


def _law_sums(code: int, numel: int, first: int, count: int, seed: int, drawn: list, dtype) -> torch.Tensor:
    """``(len(drawn), P)`` float64 sums over samples ``[first, first + count)`` by the parallel statistics loop."""
    lib = _module()
    a = torch.tensor([k[0] for k in drawn], dtype=torch.int64)
    j = torch.tensor([k[1] for k in drawn], dtype=torch.int64)
    segments = segments_for(count, numel)
    seg_len = -(-count // segments)
    segments = -(-count // seg_len)
    tiles = -(-numel // LANES)
    partial = torch.zeros((segments, len(drawn), tiles * LANES), dtype=torch.float64)
    if lib.mcgraph_philox_stats_window(code, numel, first, count, seed, len(drawn), a.data_ptr(), j.data_ptr(),
                                       dtype == torch.float64, segments, seg_len, partial.data_ptr(),
                                       torch.get_num_threads()) != 0:
        raise RuntimeError("cpu_philox.statistics: the library rejected its arguments")
    total = partial[0]
    for s in range(1, segments):  # a fixed order: the same sums for any number of threads
        total += partial[s]
    return total[:, :numel]


class PhiloxCPUStream:
    """Rows of the compiled stream with the interface of :class:`mcgraph.engine.noise.streams.BlockStream`.

    The direct, chunked and fused estimators read their rows through this object, so
    they consume the same ξ as :func:`statistics` (the same-seed contract on this stream).

    Args:
        noise: a law of :data:`LAWS`, or ``"radial"``.
        shape: shape of one draw of ξ.
        num_samples: M.
        seed: stream seed.
        dtype: of the rows.
        event_ndims: ``"radial"`` only: trailing dims normalised together.
    """

    device = torch.device("cpu")
    #: Set by a consumer that drops each chunk's rows before asking for the next (the collapsed
    #: statistics): the rows are then drawn into one buffer reused from chunk to chunk.
    owns_rows = False

    def __init__(self, noise: str, shape, num_samples: int, seed: int, dtype: torch.dtype, *,
                 event_ndims: int = 0):
        self.noise = noise
        self.event_ndims = event_ndims
        self.shape = tuple(shape)
        self.num_samples = num_samples
        self.seed = seed
        self.dtype = dtype
        self._buffer = None

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start … stop-1``, shape ``(stop-start, *shape)``."""
        out = None
        if self.owns_rows and _compute_dtype(self.dtype) == self.dtype:
            size = (stop - start) * math.prod(self.shape)
            if self._buffer is None or self._buffer.numel() < size:
                self._buffer = torch.empty(size, dtype=self.dtype)
            out = self._buffer
        return rows(self.noise, self.shape, start, stop, self.seed, self.dtype, event_ndims=self.event_ndims,
                    out=out)

    def release(self) -> None:
        """The consumer is done with the rows: drop the reused buffer."""
        self._buffer = None

    def chunks(self, chunk_size: int):
        """Yield ``(start, stop, rows)`` over the whole stream in chunks of ``chunk_size``."""
        for start in range(0, self.num_samples, chunk_size):
            stop = min(start + chunk_size, self.num_samples)
            yield start, stop, self.rows(start, stop)
