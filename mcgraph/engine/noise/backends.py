"""The one module that decides between the torch, the Triton and the compiled CPU backend.

* CUDA tensor and Triton importable → ``"triton"``: compiled kernels that draw
  the noise in registers (:mod:`mcgraph.kernels`).
* Anything else → ``"torch"``: the pure-torch engine (chunked noise blocks).
* The environment variable ``MCGRAPH_BACKEND`` (``torch`` | ``triton`` | ``cpu-philox`` |
  ``auto``, read at every call, never at import) overrides: ``triton`` on CPU tensors runs
  the kernels in Triton's interpreter, which needs ``TRITON_INTERPRET=1`` set
  before :mod:`mcgraph.kernels` is first imported (tests do this).

The noise stream of a CPU form (:func:`stream_kind`). CPU tensors may read their noise
from the compiled Philox stream (:mod:`mcgraph.engine.noise.cpu_philox`: the Triton layout, drawn and
reduced to the collapsed statistics in one OpenMP loop) instead of torch's generator.
Radial forms read its rows (the Triton Radial layout, :func:`mcgraph.engine.noise.cpu_philox.rows`); their
collapsed statistics of positive powers are summed over those rows, chunk by chunk, by
:func:`mcgraph.engine.noise.cpu_philox.radial_statistics` (others: reduced from the rows in torch):

* ``MCGRAPH_BACKEND=cpu-philox``: every CPU form whose noise law the stream draws, at any M.
* ``auto`` (the default): the same, but only from :data:`CPU_PHILOX_AUTO_MIN_DRAWS` draws
  M·P on, where it is faster than torch's ``randn`` even on one core; smaller calls keep
  the torch stream (and build nothing).
* ``torch``: never.

In both cases the library must build (once per machine, on first need: about a second
with a C++ compiler; :func:`mcgraph.engine.noise.cpu_philox.extension`); if it cannot, the torch
stream runs, silently, and ``explain`` says why. The choice depends only on the form
(device, dtype, noise law), M and ``MCGRAPH_BACKEND`` — never on the method, the chunk
size or the thread count — so every method consumes the same noise for a given seed.
Moving a call across the threshold (changing M) changes the stream, hence the numbers
for that seed; ``MCGRAPH_BACKEND=torch`` pins the torch stream for all M.

Importing this module (or :mod:`mcgraph`) imports neither Triton nor the
kernels and touches no GPU; :func:`triton_available` only looks for the
package. The Triton backend has its own noise stream (Philox, see
:mod:`mcgraph.kernels.noise_laws`); within a backend every method consumes the
same noise for a given seed. The engine reaches the kernels only through the
functions below, each of which returns ``None`` when the torch path should run.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import os
import sys
from enum import Enum

import torch


#: The environment variable that overrides the automatic choice.
ENV_VAR = "MCGRAPH_BACKEND"


class Backend(str, Enum):
    """Values of ``MCGRAPH_BACKEND``."""

    #: Always the pure-torch engine.
    TORCH = "torch"
    #: Always the Triton kernels (CPU tensors: interpreter, ``TRITON_INTERPRET=1``).
    TRITON = "triton"
    #: CPU tensors: the compiled Philox noise stream at any M (torch's when it cannot be built);
    #: CUDA tensors as under ``auto``.
    CPU_PHILOX = "cpu-philox"
    #: Triton for CUDA tensors when Triton is installed; CPU tensors: the compiled Philox stream from
    #: :data:`CPU_PHILOX_AUTO_MIN_DRAWS` draws on, torch's below (the default).
    AUTO = "auto"


#: Under ``auto``, CPU forms draw from the compiled Philox stream when M·P reaches this many draws.
CPU_PHILOX_AUTO_MIN_DRAWS = 1 << 22


_TRITON_FOUND: bool | None = None


def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (looked up, not imported)."""
    global _TRITON_FOUND
    if _TRITON_FOUND is None:
        _TRITON_FOUND = importlib.util.find_spec("triton") is not None
    return _TRITON_FOUND


def requested_backend() -> Backend:
    """``MCGRAPH_BACKEND`` as a :class:`Backend` (``auto`` when unset); read now, not cached."""
    raw = os.environ.get(ENV_VAR, "")
    known = _PARSED.get(raw)
    if known is not None:
        return known
    try:
        known = Backend(raw.strip().lower() or Backend.AUTO.value)
    except ValueError:
        raise ValueError(f"{ENV_VAR}={os.environ.get(ENV_VAR)!r}: expected one of "
                         f"{[b.value for b in Backend]}") from None
    _PARSED[raw] = known
    return known


_PARSED: dict[str, Backend] = {}  # the variable's raw values seen, parsed (it is read on every call)


def _interpreting() -> bool:
    """Whether the kernels run (or will run, once imported) in Triton's interpreter."""
    utils = sys.modules.get("mcgraph.kernels.utils")
    if utils is not None:
        return utils.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


def backend_for(tensor: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"``: which backend computes with ``tensor``'s device.

    Raises:
        ValueError: ``MCGRAPH_BACKEND`` has an unknown value.
        RuntimeError: ``MCGRAPH_BACKEND=triton`` but Triton is missing, or the tensor is on
            CPU without Triton's interpreter, or on a device Triton does not run on.

    Example:
        >>> backend_for(torch.zeros(3))  # CPU tensor, no override
        'torch'
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    mode = requested_backend()
    device = tensor.device.type
    if mode == Backend.TORCH:
        return "torch"
    if mode in (Backend.AUTO, Backend.CPU_PHILOX):  # cpu-philox: a CPU noise stream in torch's engine
        return "triton" if device == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError(f"{ENV_VAR}=triton but the triton package is not installed")
    if device == "cuda":
        return "triton"
    if device == "cpu":
        if not _interpreting():
            raise RuntimeError(
                f"{ENV_VAR}=triton on CPU tensors runs Triton's interpreter: set TRITON_INTERPRET=1 in the "
                f"environment before mcgraph.kernels is first imported (it was "
                f"{'imported compiled' if 'mcgraph.kernels.utils' in sys.modules else 'not set'})")
        return "triton"
    raise RuntimeError(f"{ENV_VAR}=triton: device {tensor.device} is not supported by the Triton kernels "
                       f"(cuda, or cpu under TRITON_INTERPRET=1)")


# --------------------------------------------------------------------------- engine noise laws → Triton


@functools.lru_cache(maxsize=None)
def _standard_laws() -> dict[int, str]:
    """``id(law) → name`` of the engine's standard noise laws that have a Triton counterpart (module constants)."""
    from . import laws as nz

    return {id(nz.STANDARD_NORMAL): "normal", id(nz.STANDARD_LAPLACE): "laplace",
            id(nz.STANDARD_LOGISTIC): "logistic", id(nz.STANDARD_CAUCHY): "cauchy",
            id(nz.STANDARD_GUMBEL): "gumbel", id(nz.STANDARD_UNIFORM): "uniform",
            id(nz.STANDARD_EXPONENTIAL): "exponential", id(nz.STANDARD_HALF_NORMAL): "half_normal",
            id(nz.STANDARD_HALF_CAUCHY): "half_cauchy", id(nz.STANDARD_RAYLEIGH): "rayleigh"}


def triton_noise(form) -> tuple[str, int] | None:
    """``(law name, event_ndims)`` of the Triton noise law matching ``form.noise``; ``None`` if none does.

    Laws whose parameters live in a sampler closure (Gamma, inverse Gamma, Weibull,
    Student-t noise) have no Triton counterpart: their forms keep the torch stream.
    """
    law = getattr(form, "noise", None)
    if law is None:
        return None
    name = _standard_laws().get(id(law))
    if name is not None:
        return name, 0
    if law.name.startswith("Radial"):
        return "radial", law.event_ndims
    return None


def triton_form(form) -> tuple[str, int] | None:
    """The Triton noise of a :class:`~mcgraph.engine.plan.families.SamplingForm` on the Triton backend, else ``None``."""
    if getattr(form, "noise", None) is None or backend_for(form.scale) != "triton":
        return None
    return triton_noise(form)


def cpu_philox_law(form) -> str | None:
    """The compiled CPU stream's law for ``form`` (a CPU :class:`~mcgraph.engine.plan.families.SamplingForm` with a
    floating dtype and a law of :data:`mcgraph.engine.noise.cpu_philox.ROW_LAWS`: the elementwise laws, or
    ``"radial"``, whose statistics are reduced from the rows), else ``None``. Builds nothing."""
    from .cpu_philox import ROW_LAWS

    if getattr(form, "noise", None) is None or form.device.type != "cpu" or not form.dtype.is_floating_point:
        return None
    noise = triton_noise(form)
    if noise is None or noise[0] not in ROW_LAWS or (noise[1] != 0 and noise[0] != "radial"):
        return None
    return noise[0]


def _cpu_philox_wanted(form, num_samples: int) -> bool:
    """Whether ``MCGRAPH_BACKEND`` asks for the compiled stream for this form and M (builds nothing)."""
    mode = requested_backend()
    if mode == Backend.CPU_PHILOX:
        return True
    return mode == Backend.AUTO and num_samples * math.prod(form.noise_shape) >= CPU_PHILOX_AUTO_MIN_DRAWS


def stream_kind(form, num_samples: int) -> str:
    """Which noise stream the engine reads for ``form`` and M: ``"triton"``, ``"cpu-philox"`` or ``"torch"``.

    A function of (form, M, ``MCGRAPH_BACKEND``) only (see the module docstring); for
    ``"cpu-philox"`` it builds the library on first need and answers ``"torch"`` when it cannot.

    Example:
        >>> import torch, mcgraph as mg
        >>> form = mg.family_of(torch.distributions.Normal(torch.zeros(3), torch.ones(3)))
        >>> stream_kind(form, 10)  # 30 draws: below the auto threshold
        'torch'
    """
    if triton_form(form) is not None:
        return "triton"
    if cpu_philox_law(form) is None or not _cpu_philox_wanted(form, num_samples):
        return "torch"
    from . import cpu_philox

    return "cpu-philox" if cpu_philox.extension() is not None else "torch"


def describe_stream(form) -> str:
    """``explain``'s line on the noise stream of ``form`` (builds nothing)."""
    from . import cpu_philox

    if triton_form(form) is not None:
        return "Philox4x32-10 in the Triton kernels (backend triton)"
    torch_stream = "torch's generator, blocks seeded by mix_seed(seed, block)"
    law = cpu_philox_law(form)
    mode = requested_backend()
    if law is None or mode not in (Backend.AUTO, Backend.CPU_PHILOX):
        return torch_stream
    if cpu_philox.unavailable_reason() is not None:
        why = cpu_philox.unavailable_reason()
        return f"{torch_stream} (the compiled CPU Philox stream is unavailable: {why})"
    state = (f"built for {cpu_philox.isa()}" if cpu_philox.built() else "built at first use")
    how = ("rows drawn, normalised per event, then power sums in one pass" if law == "radial"
           else "draw and statistics in one loop")
    compiled = (f"compiled CPU Philox4x32-10, {how} over {torch.get_num_threads()} thread(s) ({state})")
    if mode == Backend.CPU_PHILOX:
        return f"{compiled} [MCGRAPH_BACKEND=cpu-philox]"
    return f"{compiled} when M·P ≥ {CPU_PHILOX_AUTO_MIN_DRAWS} draws, else {torch_stream}"


def noise_stream(form, seed: int, num_samples: int):
    """The Triton or compiled CPU noise stream of ``form`` (``rows``/``chunks`` like
    :class:`mcgraph.engine.noise.streams.BlockStream`), or ``None`` for the torch stream (:func:`stream_kind`).

    Engine hook: the first statement of ``mcgraph.engine.estimators.sampling.stream_for``, so the
    direct, chunked, collapsed and torch-fused estimators read the same ξ as the kernels.
    """
    kind = stream_kind(form, num_samples)
    if kind == "cpu-philox":
        from .cpu_philox import PhiloxCPUStream

        return PhiloxCPUStream(cpu_philox_law(form), form.noise_shape, num_samples, seed, form.dtype,
                               event_ndims=triton_noise(form)[1])
    if kind != "triton":
        return None
    name, event_ndims = triton_form(form)
    from mcgraph.kernels.noise_laws import TritonNoiseStream

    return TritonNoiseStream(name, form.noise_shape, num_samples, seed, form.dtype,
                                                    form.device, event_ndims=event_ndims)


def noise_statistics(form, keys, seed: int, num_samples: int) -> dict | None:
    """``{(a, j): mean_i ξ_i^a (log ξ_i)^j}`` (shape ``form.noise_shape``) in one pass that never
    materialises the noise — one Triton kernel, or the compiled CPU loop — or ``None`` (torch stream).

    Engine hook: ``mcgraph.engine.estimators.collapsed.statistics`` before its chunked torch path
    (not for ``exact``: the exact Gaussian sampler is O(P) already).
    """
    kind = stream_kind(form, num_samples)
    if kind == "cpu-philox":
        from . import cpu_philox

        if cpu_philox_law(form) not in cpu_philox.LAWS:  # Radial: powers summed over its rows
            return cpu_philox.radial_statistics(tuple(form.noise_shape), num_samples, seed,
                                                tuple(sorted(keys)), form.dtype,
                                                event_ndims=triton_noise(form)[1])
        return cpu_philox.statistics(cpu_philox_law(form), tuple(form.noise_shape), num_samples, seed,
                                     tuple(sorted(keys)), form.dtype)
    if kind != "triton":
        return None
    name, event_ndims = triton_form(form)
    from mcgraph.kernels.noise_stats import noise_statistics as triton_statistics

    return triton_statistics(name, tuple(form.noise_shape), num_samples, seed,
                                                    tuple(sorted(keys)), form.dtype, form.device,
                                                    event_ndims=event_ndims)


def noise_sums(form, keys, seed: int, num_samples: int, start: int, stop: int) -> dict | None:
    """``{(a, j): Σ_{start ≤ i < stop} ξ_i^a (log ξ_i)^j}`` (float64, shape ``(P,)``) of this process's samples
    ``[start, stop)`` in the compiled pass of :func:`noise_statistics`, or ``None`` (the caller reduces the
    stream's rows). Covers the laws of the compiled CPU stream (the elementwise ones and Radial), whose rows
    the torch path would otherwise materialise and reduce chunk by chunk.

    Engine hook: ``mcgraph.engine.estimators.collapsed.statistics`` with a process group.
    """
    if not has_noise_sums(form, keys, num_samples):
        return None
    from . import cpu_philox

    keys = tuple(sorted(k for k in keys if k != (0, 0)))
    law = cpu_philox_law(form)
    if law in cpu_philox.LAWS:
        return cpu_philox.sums(law, tuple(form.noise_shape), seed, keys, form.dtype, start=start, stop=stop)
    return cpu_philox.radial_sums(tuple(form.noise_shape), seed, keys, form.dtype, start=start, stop=stop,
                                  event_ndims=triton_noise(form)[1])


def has_noise_sums(form, keys, num_samples: int) -> bool:
    """Whether :func:`noise_sums` covers ``form``, ``keys`` and M (a function of them and of
    ``MCGRAPH_BACKEND`` only: every process of a group answers alike; builds the library on first need)."""
    if stream_kind(form, num_samples) != "cpu-philox":
        return False
    from . import cpu_philox

    return cpu_philox.sums_cover(cpu_philox_law(form), keys)
