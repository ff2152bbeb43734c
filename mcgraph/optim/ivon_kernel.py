"""IVON's update in one compiled pass on the CPU (``csrc/ivon_step.cpp``).

:meth:`mcgraph.optim.IVON.step` on CPU parameters calls :func:`step_` once per parameter instead
of about twenty foreach operations per group: the same element-wise operations in the same order
and precision, so the same numbers bit for bit, with each element read and written once. The
library is compiled at first use (:class:`mcgraph.engine.native.NativeLibrary`, about a second,
cached on disk); without a C++ compiler :func:`library` returns ``None`` and IVON keeps the
foreach path.

Example:
    >>> import torch
    >>> from mcgraph.optim import ivon_kernel
    >>> ivon_kernel.supports(torch.zeros(3))
    True
"""

from __future__ import annotations

import ctypes
import pathlib

import torch

from ..engine import native

_SOURCE = pathlib.Path(__file__).with_name("csrc") / "ivon_step.cpp"
_ABI = 1


def _declare(lib) -> None:
    vp, i64, ci = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.mcgraph_ivon_step.argtypes = [ci, i64, vp, vp, vp, vp, vp, vp, vp, vp, ci, ci, ci]
    lib.mcgraph_ivon_step.restype = ci
    if lib.mcgraph_ivon_abi() != _ABI:
        raise RuntimeError(f"built with ABI {lib.mcgraph_ivon_abi()}, expected {_ABI}")


_LIBRARY = native.NativeLibrary("ivon_step", _SOURCE, _declare)


def library():
    """The compiled library (built on the first call), or ``None`` when no compiler can build it."""
    return _LIBRARY.load()


def unavailable_reason() -> str | None:
    """Why :func:`library` returned ``None`` (``None`` when it loaded or was never tried)."""
    return _LIBRARY.unavailable_reason()


def supports(t: torch.Tensor) -> bool:
    """Whether :func:`step_` takes a state tensor like ``t``: contiguous, on the CPU, float32 or float64."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) and t.is_contiguous()


def step_(mean: torch.Tensor, momentum: torch.Tensor, hess: torch.Tensor, grad_avg: torch.Tensor,
          hess_avg: torch.Tensor, hess_wd: torch.Tensor, scale_sq: torch.Tensor, *, beta1: float, beta2: float,
          ess: float, weight_decay: float, debias: float, lr: float, clip_radius: float, price: bool) -> None:
    """One IVON update of one parameter, in place (every tensor of one shape and dtype, :func:`supports`).

    On return ``mean``, ``momentum`` and ``hess`` hold m, g and h after the step, ``hess_wd`` (h + δ at
    the start of the step on entry) holds h + δ for the next one and ``scale_sq`` holds λ (h + δ),
    the square of the next 1/σ. ``grad_avg`` and ``hess_avg`` (ĝ and the sample average of
    ĝ ⊙ σε, or of ĝ² with ``price=False``) are read only.
    """
    lib = library()
    if lib is None:
        raise RuntimeError(f"the compiled IVON step is unavailable: {unavailable_reason()}")
    scalars = (ctypes.c_double * 10)(beta1, 1.0 - beta1, ess, 0.5 * (1.0 - beta2) ** 2, beta2, 1.0 - beta2,
                                     debias, weight_decay, lr, clip_radius)
    code = lib.mcgraph_ivon_step(mean.dtype == torch.float64, mean.numel(), mean.data_ptr(), momentum.data_ptr(),
                                 hess.data_ptr(), grad_avg.data_ptr(), hess_avg.data_ptr(), hess_wd.data_ptr(),
                                 scale_sq.data_ptr(), scalars, bool(price), clip_radius != float("inf"),
                                 torch.get_num_threads())
    if code != 0:  # pragma: no cover - the dtype is checked by supports()
        raise RuntimeError(f"the compiled IVON step failed with code {code}")
