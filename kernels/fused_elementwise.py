"""Fused elementwise Monte Carlo: E_q[log p(w)] with its gradients, noise drawn in registers.

For a sample ``w_i = T(u_i)`` with ``u_i = loc + scale·ξ_i`` (location-scale,
``T = id``; transformed, ``T = exp``) or ``w_i = scale·ξ_i`` (scaling), and a
registered log-density ``log p(w; c) = h(w; c) + A(c)``
(:mod:`mcgraph.kernels.integrands`), one kernel computes per element

.. math::
    y = \\frac1M \\sum_i h(w_i; c), \\quad
    \\frac{\\partial y}{\\partial loc} = \\frac1M \\sum_i h'(w_i) T'(u_i), \\quad
    \\frac{\\partial y}{\\partial scale} = \\frac1M \\sum_i h'(w_i) T'(u_i)\\,\\xi_i, \\quad
    \\frac{\\partial y}{\\partial c_k} = \\frac1M \\sum_i \\partial_{c_k} h(w_i; c),

drawing ξ_i from the Philox stream inside the loop over ``i``
(:mod:`mcgraph.kernels.noise_laws`). Memory traffic: the inputs read once,
value and the requested derivatives written once, whatever M. The
:class:`FusedLogProbFunction` saves only the requested derivatives (O(P));
``A(c)`` is added outside as a small torch expression.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable
from torch.distributions import Distribution, Independent

from .integrands import TritonIntegrand, integrand_for
from .noise_laws import TritonNoise, draw, event_size, noise_law, radial_factors
from .reference import broadcasts_to
from .utils import block_for, check_device, check_num_samples, check_seed, compute_dtype, tl_dtype


class FormKind(str, Enum):
    """How one sample is built from ``(loc, scale)`` and the noise ξ."""

    #: ``w = loc + scale·ξ``
    LOCATION_SCALE = "location_scale"
    #: ``w = scale·ξ`` with ξ > 0 (``loc`` is ``None``)
    SCALING = "scaling"
    #: ``w = exp(loc + scale·ξ)`` (a log-normal-type posterior, paper Cor. 1–2)
    EXP = "exp"


_FORM_CODE = {FormKind.LOCATION_SCALE: 0, FormKind.SCALING: 1, FormKind.EXP: 2}


# --------------------------------------------------------------------------- kernel


@triton.jit
def _load(ptr, offs, mask, SCALAR: tl.constexpr, DT: tl.constexpr):
    """A parameter: one broadcast scalar (SCALAR) or a block of P elements."""
    if SCALAR:
        x = tl.load(ptr).to(DT)
    else:
        x = tl.load(ptr + offs, mask=mask, other=1.0).to(DT)
    return x


@triton.jit(do_not_specialize=["seed", "P", "M", "D"])
def _fused_log_prob_kernel(
    value_ptr,  # (P,) out: mean_i h(w_i)
    dloc_ptr, dscale_ptr,  # (P,) out: mean_i ∂h/∂loc, mean_i ∂h/∂scale (if NEED_LOC / NEED_SCALE)
    dparam_ptr,  # (4, P) out: row k = mean_i ∂h/∂p_k (if bit k of NEED_P)
    loc_ptr, scale_ptr,  # (P,) or (1,) (bits 0, 1 of SCALAR); loc unused if FORM == 1
    p0_ptr, p1_ptr, p2_ptr, p3_ptr,  # (P,) or (1,) (bits 2…5 of SCALAR); unused slots: any (1,) tensor
    factor_ptr,  # (M, P/D) radial factors r/‖ε‖ (unused unless RADIAL)
    seed, P, M, D,
    FN: tl.constexpr, LAW: tl.constexpr, RADIAL: tl.constexpr, FORM: tl.constexpr, SCALAR: tl.constexpr,
    NEED_LOC: tl.constexpr, NEED_SCALE: tl.constexpr, NEED_P: tl.constexpr,
    BLOCK: tl.constexpr, FP64: tl.constexpr, DT: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P
    P64 = P.to(tl.int64)
    B = P // D
    scale = _load(scale_ptr, offs, mask, (SCALAR >> 1) & 1, DT)
    loc = scale * 0.0
    if FORM != 1:
        loc = _load(loc_ptr, offs, mask, SCALAR & 1, DT)
    q0 = _load(p0_ptr, offs, mask, (SCALAR >> 2) & 1, DT)
    q1 = _load(p1_ptr, offs, mask, (SCALAR >> 3) & 1, DT)
    q2 = _load(p2_ptr, offs, mask, (SCALAR >> 4) & 1, DT)
    q3 = _load(p3_ptr, offs, mask, (SCALAR >> 5) & 1, DT)
    acc_v = tl.zeros([BLOCK], dtype=DT)
    acc_l = tl.zeros([BLOCK], dtype=DT)
    acc_s = tl.zeros([BLOCK], dtype=DT)
    acc_0 = tl.zeros([BLOCK], dtype=DT)
    acc_1 = tl.zeros([BLOCK], dtype=DT)
    acc_2 = tl.zeros([BLOCK], dtype=DT)
    acc_3 = tl.zeros([BLOCK], dtype=DT)
    for i in range(0, M):
        xi = draw(seed, i * P64 + offs, LAW, FP64)
        if RADIAL:
            xi = xi * tl.load(factor_ptr + i * B + offs // D, mask=mask, other=1.0)
        if FORM == 1:
            w = scale * xi
        else:
            w = loc + scale * xi
            if FORM == 2:
                w = tl.exp(w)
        h, dw, d0, d1, d2, d3 = FN(w, q0, q1, q2, q3)
        if FORM == 2:
            dw = dw * w  # chain rule through exp: ∂h/∂u = h'(w)·w
        acc_v += h
        if NEED_LOC:
            acc_l += dw
        if NEED_SCALE:
            acc_s += dw * xi
        if NEED_P & 1:
            acc_0 += d0
        if NEED_P & 2:
            acc_1 += d1
        if NEED_P & 4:
            acc_2 += d2
        if NEED_P & 8:
            acc_3 += d3
    tl.store(value_ptr + offs, acc_v / M, mask=mask)
    if NEED_LOC:
        tl.store(dloc_ptr + offs, acc_l / M, mask=mask)
    if NEED_SCALE:
        tl.store(dscale_ptr + offs, acc_s / M, mask=mask)
    if NEED_P & 1:
        tl.store(dparam_ptr + offs, acc_0 / M, mask=mask)
    if NEED_P & 2:
        tl.store(dparam_ptr + P64 + offs, acc_1 / M, mask=mask)
    if NEED_P & 4:
        tl.store(dparam_ptr + 2 * P64 + offs, acc_2 / M, mask=mask)
    if NEED_P & 8:
        tl.store(dparam_ptr + 3 * P64 + offs, acc_3 / M, mask=mask)


# --------------------------------------------------------------------------- launcher


@dataclass(frozen=True, eq=False)
class FusedSpec:
    """Non-tensor arguments of :class:`FusedLogProbFunction`.

    Attributes:
        integrand: the registered log-density.
        law: the noise law of ξ.
        form: how w is built.
        shape: shape of one draw of ξ, which is also the output shape.
        event_ndims: Radial only.
        num_samples: M.
        seed: stream seed.
    """

    integrand: TritonIntegrand
    law: TritonNoise
    form: FormKind
    shape: torch.Size
    event_ndims: int
    num_samples: int
    seed: int


def _flat(x: torch.Tensor, shape: torch.Size, dtype: torch.dtype, name: str) -> tuple[torch.Tensor, bool]:
    """``x`` as a contiguous (P,) tensor, or (1,) plus ``True`` when it is one broadcast value."""
    if not broadcasts_to(x.shape, shape):
        raise ValueError(f"{name}: shape {tuple(x.shape)} does not broadcast to the noise shape {tuple(shape)}")
    x = x.detach().to(dtype)
    if x.numel() == 1:
        return x.reshape(1).contiguous(), True
    return x.expand(shape).contiguous().reshape(-1), False


def fused_log_prob_forward(spec: FusedSpec, loc, scale, params, need_loc: bool, need_scale: bool,
                           need_params) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, list]:
    """Launch the kernel; returns ``(value, dloc, dscale, [dparam_k or None])``, each of shape ``spec.shape``.

    Args:
        loc: broadcastable to ``spec.shape``, or ``None`` (scaling form).
        scale: broadcastable to ``spec.shape``.
        params: up to four tensors, each broadcastable to ``spec.shape``.
    """
    shape = spec.shape
    dtype = compute_dtype(scale.dtype, "scale")
    check_device(scale)
    numel = math.prod(shape)
    device = scale.device
    flat, scalar = [], 0
    inputs = [(loc, "loc"), (scale, "scale")] + [(p, f"prior parameter {k}") for k, p in enumerate(params)]
    for k, (x, name) in enumerate(inputs):
        if x is None:
            t, s = torch.zeros(1, dtype=dtype, device=device), True
        else:
            if x.device != device:
                raise ValueError(f"{name}: device {x.device} differs from scale's device {device}")
            t, s = _flat(x, shape, dtype, name)
        flat.append(t)
        scalar |= int(s) << k
    while len(flat) < 6:  # unused parameter slots
        scalar |= 1 << len(flat)
        flat.append(flat[1])
    need_p = sum(1 << k for k, n in enumerate(need_params) if n)
    value = torch.empty(numel, dtype=dtype, device=device)
    dloc = torch.empty(numel, dtype=dtype, device=device) if need_loc else value
    dscale = torch.empty(numel, dtype=dtype, device=device) if need_scale else value
    dparam = torch.empty((4, numel), dtype=dtype, device=device) if need_p else value
    if numel:
        law = spec.law
        event = event_size(shape, spec.event_ndims) if law.radial else 1
        factors = radial_factors(spec.seed, 0, spec.num_samples, numel, event, dtype, device) if law.radial else value
        block = block_for(numel)
        _fused_log_prob_kernel[(triton.cdiv(numel, block),)](
            value, dloc, dscale, dparam, *flat, factors, spec.seed, numel, spec.num_samples, event,
            FN=spec.integrand.device_fn, LAW=law.transform, RADIAL=law.radial, FORM=_FORM_CODE[spec.form],
            SCALAR=scalar, NEED_LOC=need_loc, NEED_SCALE=need_scale, NEED_P=need_p, BLOCK=block,
            FP64=dtype == torch.float64, DT=tl_dtype(dtype))
    dps = [dparam[k].reshape(shape) if n else None for k, n in enumerate(need_params)]
    return (value.reshape(shape), dloc.reshape(shape) if need_loc else None,
            dscale.reshape(shape) if need_scale else None, dps)


class FusedLogProbFunction(torch.autograd.Function):
    """``y = mean_i h(w_i; c)`` (the w-dependent part of a registered log-density), gradients fused.

    Inputs: ``spec`` (:class:`FusedSpec`); ``loc`` broadcastable to ``spec.shape`` or ``None``;
    ``scale`` broadcastable to ``spec.shape``; ``*params`` (≤ 4) each broadcastable to
    ``spec.shape``. Output: shape ``spec.shape``, dtype of ``scale``.
    """

    @staticmethod
    def forward(ctx, spec: FusedSpec, loc, scale, *params):
        need = ctx.needs_input_grad
        value, dloc, dscale, dparams = fused_log_prob_forward(spec, loc, scale, params, need[1], need[2], need[3:])
        derivs = [dloc, dscale, *dparams]
        ctx.inputs = [(None, None) if x is None else (x.shape, x.dtype) for x in (loc, scale, *params)]
        ctx.present = [d is not None for d in derivs]
        ctx.save_for_backward(*[d for d in derivs if d is not None])
        return value.to(scale.dtype)

    # VJP. y[p] = (1/M) Σ_i h(w_ip; c_p), w_ip = T(loc_p + scale_p ξ_ip) (scaling: w_ip = scale_p ξ_ip),
    # every input broadcast to the shape S of y. Per element, by the chain rule,
    #   ∂y[p]/∂loc_p   = (1/M) Σ_i h'(w_ip) T'(u_ip)            (T' = 1, or w_ip for T = exp)
    #   ∂y[p]/∂scale_p = (1/M) Σ_i h'(w_ip) T'(u_ip) ξ_ip        (scaling: (1/M) Σ_i h'(w_ip) ξ_ip)
    #   ∂y[p]/∂c_k,p   = (1/M) Σ_i ∂h/∂c_k (w_ip; c_p),
    # the per-element means the forward saved (D_x, shape S). y[p] depends on x only through x's
    # broadcast value at p, so for an upstream gradient g (shape S):
    #   grad_x = sum_to_size(g ⊙ D_x, x.shape).
    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        saved = iter(ctx.saved_tensors)
        grads = []
        for present, (shape, dtype) in zip(ctx.present, ctx.inputs):
            grads.append((grad_out * next(saved)).sum_to_size(shape).to(dtype) if present else None)
        return (None, *grads)


fused_log_prob = FusedLogProbFunction.apply


def unwrap_independent(prior: Distribution) -> tuple[Distribution, int]:
    """``(base, n)``: ``prior`` without its ``Independent`` wrappers, and how many dims they reinterpreted."""
    n = 0
    while isinstance(prior, Independent):
        n += prior.reinterpreted_batch_ndims
        prior = prior.base_dist
    return prior, n


def fused_log_prob_expectation(prior: Distribution, loc: torch.Tensor | None, scale: torch.Tensor,
                               form_kind: FormKind | str, num_samples: int, seed: int, *, noise: str = "normal",
                               event_ndims: int = 0, shape=None) -> torch.Tensor:
    """``E_q[log prior(w)]`` by M samples drawn in registers, differentiable in loc, scale and the prior.

    .. math::
        \\hat E = \\frac1M \\sum_{i=1}^M \\log p(w_i), \\qquad
        w_i = T(loc + scale\\,\\xi_i) \\ \\text{or}\\ scale\\,\\xi_i

    Args:
        prior: a distribution with a registered Triton log-density
            (:data:`mcgraph.kernels.LOG_PROBS`), optionally wrapped in ``Independent``
            (its reinterpreted dims are summed). Its parameters may require grad.
        loc: posterior location, broadcastable to ``shape``; ``None`` for the scaling form.
        scale: posterior scale (or θ of a scaling form), broadcastable to ``shape``.
        form_kind: a :class:`FormKind` (``"location_scale"``, ``"scaling"``, ``"exp"``).
        num_samples: M ≥ 1.
        seed: stream seed in [0, 2⁶³).
        noise: the law of ξ (a registered name; ``"radial"`` needs ``event_ndims``).
        event_ndims: Radial only: trailing dims the noise is normalised over.
        shape: shape of one draw of ξ; default ``broadcast(loc.shape, scale.shape)``. The
            prior's batch shape must broadcast into it.

    Returns:
        Tensor of ``shape`` (less the prior's reinterpreted dims), ``scale``'s dtype.

    Example:
        >>> mu = torch.zeros(5, requires_grad=True)  # doctest: +SKIP
        >>> prior = torch.distributions.Laplace(0.0, 1.0)
        >>> e = fused_log_prob_expectation(prior, mu, torch.ones(5), "location_scale", 100, seed=0)
        >>> e.sum().backward()
    """
    if not isinstance(prior, Distribution):
        raise TypeError(f"prior must be a torch.distributions.Distribution, got {type(prior).__name__}")
    base, reinterpreted = unwrap_independent(prior)
    integrand = integrand_for(base)
    try:
        form = FormKind(form_kind)
    except ValueError:
        raise ValueError(f"form_kind: expected one of {[f.value for f in FormKind]}, got {form_kind!r}") from None
    law = noise_law(noise)
    num_samples = check_num_samples(num_samples)
    check_seed(seed)
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale must be a tensor, got {type(scale).__name__}")
    if (loc is None) != (form == FormKind.SCALING):
        raise ValueError(f"loc must be None exactly for the scaling form, got loc={type(loc).__name__} "
                         f"with form_kind={form.value!r}")
    if form == FormKind.SCALING and not law.positive:
        raise ValueError(f"noise: the scaling form needs a positive noise law, {law.name!r} is not")
    if shape is None:
        shape = scale.shape if loc is None else torch.broadcast_shapes(loc.shape, scale.shape)
    shape = torch.Size(shape)
    prior_shape = base.batch_shape + base.event_shape
    if not broadcasts_to(prior_shape, shape):
        raise ValueError(f"prior: shape {tuple(prior_shape)} does not broadcast into the noise shape {tuple(shape)}")
    params = tuple(integrand.params(base))
    if len(params) > 4:
        raise ValueError(f"prior: {integrand.name} has {len(params)} parameters; the kernel takes at most 4")
    spec = FusedSpec(integrand, law, form, shape, event_ndims, num_samples, seed)
    value = fused_log_prob(spec, loc, scale, *params)
    if integrand.normalizer is not None:
        value = value + integrand.normalizer(*params)
    return value.sum(tuple(range(-reinterpreted, 0))) if reinterpreted else value
