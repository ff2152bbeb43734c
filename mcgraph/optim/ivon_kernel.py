"""IVON's update in one compiled pass on the CPU (``csrc/ivon_step.cpp``).

:meth:`mcgraph.optim.IVON.step` on CPU parameters calls :func:`step_` once per parameter instead
of about twenty foreach operations per group (and ``sampled_params`` :func:`sample_` and
:func:`record_first_` instead of two each): the same element-wise operations in the same order
and precision, so the same numbers bit for bit, with each element read and written once. The
library is compiled at first use (:class:`mcgraph.engine.native.NativeLibrary`, about a second,
cached on disk); without a C++ compiler :func:`library` returns ``None`` and IVON keeps the
foreach path.

Example:
    >>> import torch
    >>> from mcgraph.optim import ivon_kernel
    >>> ivon_kernel.supports(torch.zeros(3)), ivon_kernel.supports(torch.zeros(3, 2).t())
    (True, False)
"""

from __future__ import annotations

import ctypes
import pathlib

import torch

from ..engine import native

_SOURCE = pathlib.Path(__file__).with_name("csrc") / "ivon_step.cpp"
_ABI = 2


def _declare(lib) -> None:
    vp, i64, ci = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.mcgraph_ivon_step.argtypes = [ci, i64, vp, vp, vp, vp, vp, vp, vp, vp, ci, ci, ci]
    lib.mcgraph_ivon_step.restype = ci
    lib.mcgraph_ivon_sample.argtypes = [ci, i64, vp, vp, vp, vp, ci]
    lib.mcgraph_ivon_sample.restype = ci
    lib.mcgraph_ivon_record_first.argtypes = [ci, i64, vp, vp, vp, vp, ci, ci]
    lib.mcgraph_ivon_record_first.restype = ci
    if lib.mcgraph_ivon_abi() != _ABI:
        raise RuntimeError(f"built with ABI {lib.mcgraph_ivon_abi()}, expected {_ABI}")


_LIBRARY = native.NativeLibrary("ivon_step", _SOURCE, _declare)


def library():
    """The compiled library (built on the first call), or ``None`` when no compiler can build it."""
    return _LIBRARY.load()


def unavailable_reason() -> str | None:
    """Why :func:`library` returned ``None`` (``None`` when it loaded or was never tried)."""
    return _LIBRARY.unavailable_reason()


_DTYPES = (torch.float32, torch.float64)

#: Elements of a group below which a weight sample and its statistics stay torch's foreach operations:
#: two foreach calls cost less than one library call per parameter there (the update, twenty foreach
#: calls, is always cheaper compiled).
SAMPLE_MIN_ELEMENTS = 1 << 16


def supports(t: torch.Tensor) -> bool:
    """Whether the passes take a CPU tensor like ``t``: contiguous, float32 or float64 (the caller knows
    the tensors are on the CPU)."""
    return t.dtype in _DTYPES and t.is_contiguous()


def _lib():
    lib = library()
    if lib is None:
        raise RuntimeError(f"the compiled IVON step is unavailable: {unavailable_reason()}")
    return lib


def _checked(code: int, what: str) -> None:
    if code != 0:  # pragma: no cover - the dtype is checked by supports()
        raise RuntimeError(f"the compiled IVON {what} failed with code {code}")


def sample_(eps: torch.Tensor, inv: torch.Tensor, mean: torch.Tensor, theta: torch.Tensor) -> None:
    """A weight sample of one parameter: ``eps`` ← ε / (1/σ) = σ ⊙ ε in place, ``theta`` ← m + σ ⊙ ε
    (``torch.div`` and ``torch.add``'s numbers; every tensor of one shape and dtype, :func:`supports`)."""
    _checked(_lib().mcgraph_ivon_sample(eps.dtype == torch.float64, eps.numel(), eps.data_ptr(), inv.data_ptr(),
                                        mean.data_ptr(), theta.data_ptr(), torch.get_num_threads()), "sample")


def record_first_(grad: torch.Tensor, noise: torch.Tensor, grad_avg: torch.Tensor, hess_avg: torch.Tensor, *,
                  price: bool) -> None:
    """The first sample of a step: ``grad_avg`` ← ĝ, ``hess_avg`` ← ĝ ⊙ σε (``price``, where ``hess_avg`` may
    be ``noise`` itself) or ĝ ⊙ ĝ."""
    _checked(_lib().mcgraph_ivon_record_first(grad.dtype == torch.float64, grad.numel(), grad.data_ptr(),
                                              noise.data_ptr(), grad_avg.data_ptr(), hess_avg.data_ptr(),
                                              bool(price), torch.get_num_threads()), "record")


def step_(mean: list[torch.Tensor], momentum: list[torch.Tensor], hess: list[torch.Tensor],
          grad_avg: list[torch.Tensor], hess_avg: list[torch.Tensor], hess_wd: list[torch.Tensor],
          scale_sq: list[torch.Tensor], *, beta1: float, beta2: float, ess: float, weight_decay: float,
          debias: float, lr: float, clip_radius: float, price: bool) -> None:
    """One IVON update of a group's parameters, in place: one pass per parameter (the ``j``-th tensors of
    the lists share one shape and dtype, :func:`supports`).

    On return ``mean``, ``momentum`` and ``hess`` hold m, g and h after the step, ``hess_wd`` (h + δ at
    the start of the step on entry) holds h + δ for the next one and ``scale_sq`` holds λ (h + δ),
    the square of the next 1/σ. ``grad_avg`` and ``hess_avg`` (ĝ and the sample average of
    ĝ ⊙ σε, or of ĝ² with ``price=False``) are read only.
    """
    run = _lib().mcgraph_ivon_step
    scalars = (ctypes.c_double * 10)(beta1, 1.0 - beta1, ess, 0.5 * (1.0 - beta2) ** 2, beta2, 1.0 - beta2,
                                     debias, weight_decay, lr, clip_radius)
    clip, threads = clip_radius != float("inf"), torch.get_num_threads()
    for j, m in enumerate(mean):
        _checked(run(m.dtype == torch.float64, m.numel(), m.data_ptr(), momentum[j].data_ptr(), hess[j].data_ptr(),
                     grad_avg[j].data_ptr(), hess_avg[j].data_ptr(), hess_wd[j].data_ptr(), scale_sq[j].data_ptr(),
                     scalars, bool(price), clip, threads), "step")
