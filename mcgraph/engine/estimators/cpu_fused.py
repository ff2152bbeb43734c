"""The fused tier's CPU kernel for registered prior log-densities: ``E_q[log p(w)]`` in one compiled pass.

For the cross term of ``mg.kl_divergence(q, p)`` with a prior that has a registered log-density
(:mod:`mcgraph.kernels.log_densities`: Laplace, Student-t, the scale mixture, …) the generic fused
tier traces ``p.log_prob``, classifies it and evaluates it with forward-mode derivatives, about forty
small torch operations and their Python around them per call. This module computes the same
estimate

.. math::
    \\hat E = \\frac1M \\sum_{i=1}^M h(w_i; c) + A(c), \\qquad w_i = T(loc + scale\\,\\xi_i),

with the gradients in ``loc``, ``scale`` and the prior's parameters ``c``
(``∂/∂loc = (1/M) Σ_i h'(w_i) T'(u_i)``, ``∂/∂scale = (1/M) Σ_i h'(w_i) T'(u_i) ξ_i``,
``∂/∂c = (1/M) Σ_i ∂_c h(w_i; c) + ∂_c A``) in one loop of ``csrc/cpu_fused.cpp`` over the rows of
the same noise stream (:func:`mcgraph.engine.estimators.sampling.stream_for`): the same ξ as every
other method for the seed, so the value and gradients equal the direct estimator's up to float
rounding (each element is evaluated in the rows' precision and summed in float64). The Function
keeps O(P) tensors whatever M is.

It applies to a CPU location-scale, scaling or ``exp``-transformed form of float32 or float64 whose
noise is a standard law without parameters (the laws of :func:`mcgraph.engine.noise.backends.triton_noise`) and
has the sample's shape, a prior (optionally ``Independent``) with a registered density whose
shape broadcasts into the sample's and whose parameters have the form's dtype, for calls without a
``chunk_size`` (one asked for gets the engine's chunks) of at most :data:`MAX_ELEMENTS` draws (above it
torch's vectorised operations are as fast per element: the loop here calls the scalar ``exp`` and
``log1p`` of the C library, the generic tier's operations run vectorised). Under ``method="auto"`` and
``"monte-carlo"`` it is used only for densities whose every w-dependent term is the fused tier's
(:data:`mcgraph.kernels.log_densities.WHOLLY_FUSED`): the engine would take a polynomial term exactly (``"auto"``) or by the collapsed
tier, so its estimate and its graph are the ones it would have without the loop; ``method="fused"`` asks
for the fused tier for every density. The library is compiled at first use
(:class:`mcgraph.engine.native.NativeLibrary`, 2–3 seconds, cached on disk); without a compiler
:func:`log_prob_expectation` returns ``None`` and the engine's fused tier runs.

Example:
    >>> import torch, mcgraph as mg
    >>> from mcgraph.engine.estimators import cpu_fused
    >>> q = torch.distributions.Normal(torch.zeros(3, requires_grad=True), torch.ones(3))
    >>> p = torch.distributions.Laplace(0.0, 1.0)
    >>> e = cpu_fused.log_prob_expectation(mg.family_of(q), p, 1000, seed=0, method="monte-carlo")
    >>> e is None or e.shape == (3,)
    True
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import math
import pathlib
from typing import Callable

import torch
from torch.distributions import Distribution, Independent
from torch.autograd.function import once_differentiable

from .. import native
from ..noise.backends import backend_for, triton_noise
from ..plan.families import SamplingForm
from mcgraph.kernels.log_densities import FORM_KINDS, LogDensity, kernel_takes_whole_term, log_density
from ..shapes import broadcasts_to
from .fused import transform_name, derivatives_vjp, save_derivatives
from .sampling import stream_for

_SOURCE = pathlib.Path(__file__).with_name("csrc") / "cpu_fused.cpp"
_ABI = 5
_FORMS = {kind: code for code, kind in enumerate(FORM_KINDS)}  # the loop's form codes


def _declare(lib) -> None:
    vp, i64, ci = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.mcgraph_cpu_fused_log_prob.argtypes = [ci, ci, ci, i64, i64, vp, vp, i64, vp, i64, vp, vp, ci, ci, ci, vp, ci]
    lib.mcgraph_cpu_fused_log_prob.restype = ci
    if lib.mcgraph_cpu_fused_abi() != _ABI:
        raise RuntimeError(f"built with ABI {lib.mcgraph_cpu_fused_abi()}, expected {_ABI}")


_LIBRARY = native.NativeLibrary("cpu_fused", _SOURCE, _declare)


def library():
    """The compiled library (built on the first call), or ``None`` when no compiler can build it."""
    return _LIBRARY.load()


def unavailable_reason() -> str | None:
    """Why :func:`library` returned ``None`` (``None`` when it loaded or was never tried)."""
    return _LIBRARY.unavailable_reason()


#: Draws (M · P) above which the generic fused tier runs instead (see the module docstring). Measured on
#: one thread of a 2-core x86 machine, forward + backward of the whole KL against the generic tier: Laplace,
#: Cauchy, logistic and Student-t priors 0.5–0.9× from 10⁴ to 10⁶ draws and about 1.0–1.3× from 3·10⁶; the
#: scale mixture (two transcendental calls per draw) about 0.9–1.1× from 10⁴ to 10⁶ and 1.45× at 3·10⁶.
MAX_ELEMENTS = 1 << 20

_DTYPES = (torch.float32, torch.float64)
_Params, _Steps, _Pointers = ctypes.c_void_p * 4, ctypes.c_int64 * 4, ctypes.c_void_p * 7


def _unwrap(p: Distribution) -> tuple[Distribution, int]:
    """``(base, n)``: ``p`` without its ``Independent`` wrappers (those that keep ``Independent.log_prob``)."""
    n = 0
    while isinstance(p, Independent) and type(p).log_prob is Independent.log_prob:
        n += p.reinterpreted_batch_ndims
        p = p.base_dist
    return p, n


def _form_kind(form) -> str | None:
    """The loop's name for ``form``: the fused bodies' transforms (none, or one exp), exp with a location."""
    transform = transform_name(form.transforms)
    if transform == "":
        return "scaling" if form.loc is None else "location_scale"
    return "exp" if transform == "exp" and form.loc is not None else None


_DISABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("mcgraph_cpu_fused_disabled", default=False)


@contextlib.contextmanager
def disabled():
    """Inside the block the engine's fused tier computes every cross term (for comparisons with it).

    Example:
        >>> import torch, mcgraph as mg
        >>> q = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
        >>> with disabled():
        ...     kl = mg.kl_divergence(q, torch.distributions.StudentT(3.0), 100, seed=0)
    """
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        _DISABLED.reset(token)


def plan(form, p: Distribution, method: str) -> tuple[LogDensity, str, tuple] | None:
    """``(density, form kind, the prior's parameters)`` when the loop computes ``E_q[log p]`` for ``form`` under
    ``method``, else ``None`` (builds nothing; the size limit is :func:`applies`'s)."""
    if not isinstance(form, SamplingForm) or form.device.type != "cpu" or form.dtype not in _DTYPES \
            or (form.loc is not None and form.loc.dtype != form.dtype) \
            or backend_for(form.scale) != "torch":  # (on the Triton backend, its kernel)
        return None
    if tuple(form.noise_shape) != tuple(form.shape) or triton_noise(form) is None:
        return None  # (a law with parameters, a Gamma's or a Student-t's, may carry their gradient in ξ)
    kind = _form_kind(form)
    base, _ = _unwrap(p)
    entry = log_density(type(base))
    if kind is None or entry is None:
        return None
    if not kernel_takes_whole_term(entry, kind, method):
        return None
    if not broadcasts_to(base.batch_shape + base.event_shape, form.shape):
        return None
    params = tuple(torch.as_tensor(c) for c in entry.params(base))
    if any(c.dtype != form.dtype or c.device.type != "cpu" for c in params):
        return None  # (torch computes with float32 parameters in float32 even beside float64 samples)
    return entry, kind, params


def applies(form, p: Distribution, method: str, num_samples: int) -> tuple[LogDensity, str, tuple] | None:
    """:func:`plan` when :func:`log_prob_expectation` computes ``E_q[log p]`` for these arguments, else ``None``
    (builds the library on first need: ``None`` without a compiler)."""
    if _DISABLED.get() or num_samples * math.prod(form.shape) > MAX_ELEMENTS:
        return None
    found = plan(form, p, method)
    return found if found is not None and library() is not None else None


def _operand(t: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """``t`` as the kernel reads it: a contiguous tensor of ``dtype`` and its step (0: one number for all)."""
    if t.dtype != dtype:
        t = t.to(dtype)
    if t.numel() == 1:
        return (t if t.is_contiguous() else t.contiguous()), 0
    if t.shape != shape:
        t = t.expand(shape)
    return (t if t.is_contiguous() else t.contiguous()), 1


class _LogProbMC(torch.autograd.Function):
    """``(1/M) Σ_i h(w_i; c)`` with its derivatives computed in the forward pass (see the module).

    Inputs: ``run`` (a callable of the wanted mask that returns the means: the value, then one per input,
    ``None`` where not wanted), ``loc`` (or ``None``), ``scale``, ``*params``. Output: the sample's shape.
    """

    @staticmethod
    def forward(ctx, run, loc, scale, *params):
        inputs = (loc, scale, *params)  # (all of the samples' dtype: plan)
        value, *derivs = run([t is not None and t.requires_grad for t in inputs])
        save_derivatives(ctx, inputs, derivs)
        return value

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        return derivatives_vjp(ctx, grad_out)


def log_prob_expectation(form, p: Distribution, num_samples: int, seed: int, *, method: str = "monte-carlo",
                         sum_rightmost: int = 0, found=None,
                         check_inputs: Callable[[], None] | None = None) -> torch.Tensor | None:
    """``E_q[Σ_rightmost log p(w)]`` (``q``'s :class:`~mcgraph.engine.plan.families.SamplingForm` ``form``) by the
    compiled loop, differentiable in ``form.loc``, ``form.scale`` and ``p``'s parameters; ``None`` when it does
    not apply (:func:`applies`, whose result the caller may pass as ``found``; see the module docstring).

    The loop checks the numbers it reads (loc, scale, the prior's parameters): when one is not finite it
    calls ``check_inputs()`` before returning, where the caller names the argument at fault (an O(P)
    check inside the loop instead of a pass over every parameter on every call).
    """
    found = found if found is not None else applies(form, p, method, num_samples)
    if found is None:
        return None
    entry, kind, params = found
    lib = library()
    _, reinterpreted = _unwrap(p)
    dtype = form.dtype
    shape = torch.Size(form.shape)
    numel = math.prod(shape)

    # A(c) in the loop unless the prior's parameters need its gradient (then a torch expression, after)
    normalized = not any(c.requires_grad for c in params) or entry.normalizer is None

    def run(want):
        operands = [None if t is None else _operand(t.detach(), shape, dtype) for t in (form.loc, form.scale, *params)]
        (loc, loc_step), (scale, scale_step) = operands[0] or (None, 0), operands[1]
        wanted = [k for k, w in enumerate(want) if w]
        value = torch.empty(shape, dtype=dtype)
        derivs = torch.empty((len(wanted),) + shape, dtype=dtype)  # saved for backward: one buffer, no value
        ptrs = _Pointers(value.data_ptr())
        for row, k in enumerate(wanted):
            ptrs[1 + k] = derivs.data_ptr() + row * numel * derivs.element_size()
        # M · P ≤ MAX_ELEMENTS ≤ one noise block: a view of the stream's block holds every row
        xi = stream_for(form, seed, num_samples).rows(0, num_samples)
        if not xi.is_contiguous():
            xi = xi.contiguous()
        code = lib.mcgraph_cpu_fused_log_prob(
            dtype == torch.float64, entry.code, _FORMS[kind], num_samples, numel, xi.data_ptr(),
            None if loc is None else loc.data_ptr(), loc_step, scale.data_ptr(), scale_step,
            _Params(*[c.data_ptr() for c, _ in operands[2:]]), _Steps(*[step for _, step in operands[2:]]),
            len(params), sum(1 << k for k in wanted), normalized, ptrs, torch.get_num_threads())
        if code > 0:  # pragma: no cover - the arguments are checked above
            raise RuntimeError(f"the compiled fused log-density failed with code {code}")
        if code < 0 and check_inputs is not None:
            check_inputs()
        rows = iter(derivs.unbind(0))
        return [value] + [next(rows) if w else None for w in want]

    value = _LogProbMC.apply(run, form.loc, form.scale, *params)
    if not normalized:
        value = value + entry.normalizer(*params)
    total = reinterpreted + sum_rightmost
    return value.sum(tuple(range(-total, 0))) if total > 0 else value
