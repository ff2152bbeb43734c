"""The variational optimizers' element-wise updates as compiled passes on the CPU (``csrc/cpu_kernels.cpp``).

:meth:`mcgraph.optim.IVON.step` on CPU parameters calls :func:`ivon_step_` once per group instead of
about twenty foreach operations (and ``sampled_params`` :func:`ivon_sample_`,
:func:`ivon_record_first_` and :func:`ivon_record_next_` instead of two to seven each); :class:`mcgraph.optim.VOGN` calls
:func:`vogn_update_` and :func:`vogn_variance_` instead of about ten tensor expressions per
parameter. Each runs the same element-wise operations in the same order and precision as the torch
path, so the numbers are the same bit for bit, with each element read and written once. The library
is compiled at first use (:class:`mcgraph.engine.native.NativeLibrary`, about a second, cached on
disk); without a C++ compiler :func:`library` returns ``None`` and the optimizers keep torch's
operations.

Example:
    >>> import torch
    >>> from mcgraph.optim import cpu_kernels
    >>> cpu_kernels.fits(torch.zeros(3)), cpu_kernels.fits(torch.zeros(3, 2).t())
    (True, False)
"""

from __future__ import annotations

import ctypes
import pathlib

import torch

from ..engine import native

_SOURCE = pathlib.Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
_ABI = 2


def _declare(lib) -> None:
    vp, i64, ci = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.mcgraph_ivon_step.argtypes = [ci, i64, vp, vp, vp, vp, vp, vp, vp, vp, ci, ci, ci]
    lib.mcgraph_ivon_step.restype = ci
    lib.mcgraph_ivon_sample.argtypes = [ci, i64, vp, vp, vp, vp, ci]
    lib.mcgraph_ivon_sample.restype = ci
    lib.mcgraph_ivon_record_first.argtypes = [ci, i64, vp, vp, vp, vp, ci, ci]
    lib.mcgraph_ivon_record_first.restype = ci
    lib.mcgraph_ivon_record_next.argtypes = [ci, i64, vp, vp, vp, vp, ctypes.c_double, ci, ci]
    lib.mcgraph_ivon_record_next.restype = ci
    lib.mcgraph_vogn_update.argtypes = [ci, i64, vp, vp, vp, vp, vp, vp, vp, vp, vp, ci]
    lib.mcgraph_vogn_update.restype = ci
    lib.mcgraph_vogn_variance.argtypes = [ci, i64, vp, vp, vp, ci, ci]
    lib.mcgraph_vogn_variance.restype = ci
    if lib.mcgraph_cpu_kernels_abi() != _ABI:
        raise RuntimeError(f"built with ABI {lib.mcgraph_cpu_kernels_abi()}, expected {_ABI}")


_LIBRARY = native.NativeLibrary("optim_cpu_kernels", _SOURCE, _declare)


def library():
    """The compiled library (built on the first call), or ``None`` when no compiler can build it."""
    return _LIBRARY.load()


def unavailable_reason() -> str | None:
    """Why :func:`library` returned ``None`` (``None`` when it loaded or was never tried)."""
    return _LIBRARY.unavailable_reason()


def checked_fused(fused, who: str) -> bool | None:
    """An optimizer's ``fused`` argument, checked: ``None``, ``True`` or ``False``; ``True`` raises here
    when the kernels cannot be built, naming ``who`` and the reason."""
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"fused must be None, True or False, got {fused!r}")
    if fused and library() is None:
        raise RuntimeError(f"fused=True: the compiled {who} could not be built ({unavailable_reason()}); "
                           f"install a C++ compiler or set CXX, or pass fused=None / False")
    return fused


_DTYPES = (torch.float32, torch.float64)

#: Elements of a group below which a weight sample and its statistics stay torch's foreach operations:
#: two foreach calls cost less than one library call per parameter there (the update, twenty foreach
#: calls, is always cheaper compiled).
SAMPLE_MIN_ELEMENTS = 1 << 16


_STRIDED = torch.strided


def fits(*tensors: torch.Tensor) -> bool:
    """Whether one kernel call takes ``tensors`` together: dense, contiguous CPU tensors, all float32 or all
    float64, of one number of elements. (A real tensor has no lazily conjugated or negated views outside
    torch's private API.)"""
    first = tensors[0]
    if first is None:
        return False
    dtype, numel = first.dtype, first.numel()
    if dtype not in _DTYPES:
        return False
    for t in tensors:  # (a plain loop: this runs for every parameter at every step)
        if t is None or t.dtype != dtype or t.numel() != numel or not t.is_cpu or t.layout is not _STRIDED \
                or not t.is_contiguous():
            return False
    return True


def group_fits(*lists: list[torch.Tensor]) -> bool:
    """Whether :func:`ivon_step_` takes a group's lists: the ``j``-th tensors of every list :func:`fits` together."""
    return all(fits(*tensors) for tensors in zip(*lists))


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"{what}: the compiled kernels take dense, contiguous CPU tensors of one dtype "
                         f"(float32 or float64) and one size")


def _lib():
    lib = library()
    if lib is None:
        raise RuntimeError(f"the compiled optimizer kernels are unavailable: {unavailable_reason()}")
    return lib


def _checked(code: int, what: str) -> None:
    if code != 0:  # pragma: no cover - the dtype is checked before every call
        raise RuntimeError(f"the compiled {what} failed with code {code}")


def ivon_sample_(eps: torch.Tensor, inv: torch.Tensor, mean: torch.Tensor, theta: torch.Tensor) -> None:
    """A weight sample of one parameter: ``eps`` ← ε / (1/σ) = σ ⊙ ε in place, ``theta`` ← m + σ ⊙ ε
    (``torch.div`` and ``torch.add``'s numbers; the tensors must :func:`fits` together)."""
    _require(fits(eps, inv, mean, theta), "ivon_sample_")
    _checked(_lib().mcgraph_ivon_sample(eps.dtype == torch.float64, eps.numel(), eps.data_ptr(), inv.data_ptr(),
                                        mean.data_ptr(), theta.data_ptr(), torch.get_num_threads()), "IVON sample")


def ivon_record_first_(grad: torch.Tensor, noise: torch.Tensor, grad_avg: torch.Tensor, hess_avg: torch.Tensor, *,
                       price: bool) -> None:
    """The first sample of a step: ``grad_avg`` ← ĝ, ``hess_avg`` ← ĝ ⊙ σε (``price``, where ``hess_avg`` may
    be ``noise`` itself) or ĝ ⊙ ĝ."""
    _require(fits(grad, noise, grad_avg, hess_avg), "ivon_record_first_")
    _checked(_lib().mcgraph_ivon_record_first(grad.dtype == torch.float64, grad.numel(), grad.data_ptr(),
                                              noise.data_ptr(), grad_avg.data_ptr(), hess_avg.data_ptr(),
                                              bool(price), torch.get_num_threads()), "IVON record")


def ivon_record_next_(grad: torch.Tensor, noise: torch.Tensor, grad_avg: torch.Tensor, hess_avg: torch.Tensor, *,
                      count: int, price: bool) -> None:
    """A later sample of a step (Welford, as ivon-opt): ``a ← a + (v − a)/count`` for ``v`` = ĝ into
    ``grad_avg`` and ``v`` = ĝ ⊙ σε (``price``) or ĝ ⊙ ĝ into ``hess_avg`` (``noise`` is read only)."""
    _require(fits(grad, noise, grad_avg, hess_avg), "ivon_record_next_")
    _checked(_lib().mcgraph_ivon_record_next(grad.dtype == torch.float64, grad.numel(), grad.data_ptr(),
                                             noise.data_ptr(), grad_avg.data_ptr(), hess_avg.data_ptr(),
                                             float(count), bool(price), torch.get_num_threads()), "IVON record")


def ivon_step_(mean: list[torch.Tensor], momentum: list[torch.Tensor], hess: list[torch.Tensor],
               grad_avg: list[torch.Tensor], hess_avg: list[torch.Tensor], hess_wd: list[torch.Tensor],
               scale_sq: list[torch.Tensor], *, beta1: float, beta2: float, ess: float, weight_decay: float,
               debias: float, lr: float, clip_radius: float, price: bool, checked: bool = False) -> None:
    """One IVON update of a group's parameters, in place: one pass per parameter (the ``j``-th tensors of
    the lists must :func:`fits` together; ``checked=True``: the caller has just made sure with
    :func:`group_fits`). Nothing is written unless every parameter fits.

    On return ``mean``, ``momentum`` and ``hess`` hold m, g and h after the step, ``hess_wd`` (h + δ at
    the start of the step on entry) holds h + δ for the next one and ``scale_sq`` holds λ (h + δ),
    the square of the next 1/σ. ``grad_avg`` and ``hess_avg`` (ĝ and the sample average of
    ĝ ⊙ σε, or of ĝ² with ``price=False``) are read only.
    """
    lists = (mean, momentum, hess, grad_avg, hess_avg, hess_wd, scale_sq)
    _require(len({len(x) for x in lists}) == 1 and (checked or group_fits(*lists)), "ivon_step_")
    run = _lib().mcgraph_ivon_step
    scalars = (ctypes.c_double * 10)(beta1, 1.0 - beta1, ess, 0.5 * (1.0 - beta2) ** 2, beta2, 1.0 - beta2,
                                     debias, weight_decay, lr, clip_radius)
    clip, threads = clip_radius != float("inf"), torch.get_num_threads()
    for j, m in enumerate(mean):
        _checked(run(m.dtype == torch.float64, m.numel(), m.data_ptr(), momentum[j].data_ptr(), hess[j].data_ptr(),
                     grad_avg[j].data_ptr(), hess_avg[j].data_ptr(), hess_wd[j].data_ptr(), scale_sq[j].data_ptr(),
                     scalars, bool(price), clip, threads), "IVON step")


def vogn_update_(mean: torch.Tensor, grad: torch.Tensor, hess: torch.Tensor, momentum: torch.Tensor | None,
                 precision: torch.Tensor, *, delta: float, beta1: float, keep: float, beta2: float, lr: float,
                 damping: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """VOGN's new ``(μ, m, s)`` of one parameter in new tensors (the inputs are read only):
    ``m = β₁ m + (ĝ + δ̃ μ)`` (``ĝ + δ̃ μ`` when ``momentum`` is ``None``), ``s = keep·s + β₂ ĥ``,
    ``μ − α m / (s + δ̃ + γ)`` (the tensors must :func:`fits` together)."""
    _require(fits(mean, grad, hess, precision, *(() if momentum is None else (momentum,))), "vogn_update_")
    outs = tuple(torch.empty_like(mean) for _ in range(3))
    scalars = (ctypes.c_double * 6)(delta, beta1, keep, beta2, lr, damping)
    _checked(_lib().mcgraph_vogn_update(mean.dtype == torch.float64, mean.numel(), mean.data_ptr(), grad.data_ptr(),
                                        hess.data_ptr(), None if momentum is None else momentum.data_ptr(),
                                        precision.data_ptr(), *(t.data_ptr() for t in outs), scalars,
                                        torch.get_num_threads()), "VOGN update")
    return outs


def vogn_variance_(precision: torch.Tensor, *, delta: float, damping: float, size: float,
                   tau: float | None) -> torch.Tensor:
    """VOGN's noise variance ``1 / (N (s + δ̃ + γ))`` (times ``tau`` unless it is ``None``) in a new tensor."""
    _require(fits(precision), "vogn_variance_")
    out = torch.empty_like(precision)
    scalars = (ctypes.c_double * 4)(delta, damping, size, 1.0 if tau is None else tau)
    _checked(_lib().mcgraph_vogn_variance(precision.dtype == torch.float64, precision.numel(), precision.data_ptr(),
                                          out.data_ptr(), scalars, tau is not None, torch.get_num_threads()),
             "VOGN variance")
    return out
