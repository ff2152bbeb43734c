"""Noise statistics for the collapsed tier, one fused kernel: draw, power, reduce over M.

For a noise law and keys ``(a, j)`` (``a`` any integer, ``j ≥ 0``) the kernel
writes, per element,

.. math::
    \\bar t_{a,j} = \\frac1M \\sum_{i=1}^{M} \\xi_i^{a} (\\log \\xi_i)^{j},

which covers mean ξ^k (k ≤ K), mean log ξ and mean ξ^-k (paper Thms 1–2,
Cor. 1–3). Each program owns a block of elements and keeps a
``[n_keys, BLOCK]`` accumulator (fp32 for fp32, fp64 for fp64) in registers;
ξ never leaves registers, so memory traffic is ``n_keys · P`` writes whatever
M is. Radial noise (ξ = ε/‖ε‖·r over the event) first computes the ``M × B``
factors r/‖ε‖ (:func:`~mcgraph.kernels.noise_laws.radial_factors`), then the
statistics pass regenerates the same ε from the same counters.

No autograd: the statistics do not depend on the parameters.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .noise_laws import draw, event_size, noise_law, radial_factors
from .utils import block_for, check_device, check_num_samples, check_seed, compute_dtype, tl_dtype


@triton.jit(do_not_specialize=["seed", "P", "M", "D"])
def _noise_stats_kernel(
    out_ptr,  # (NK, P) out: t̄ for each key
    a_ptr, j_ptr,  # (NK_PAD,) int32: power a and log power j of each key (padding: 0, 0)
    factor_ptr,  # (M, P/D) radial factors r/‖ε‖ (unused unless RADIAL)
    seed, P, M, D,
    NK: tl.constexpr, NK_PAD: tl.constexpr, A_POS: tl.constexpr, A_NEG: tl.constexpr, J_MAX: tl.constexpr,
    LAW: tl.constexpr, RADIAL: tl.constexpr, BLOCK: tl.constexpr, FP64: tl.constexpr, DT: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P
    P64 = P.to(tl.int64)
    B = P // D
    keys = tl.arange(0, NK_PAD)
    a = tl.load(a_ptr + keys)[:, None]  # [NK_PAD, 1]
    j = tl.load(j_ptr + keys)[:, None]
    acc = tl.zeros([NK_PAD, BLOCK], dtype=DT)
    for i in range(0, M):
        xi = draw(seed, i * P64 + offs, LAW, FP64)
        if RADIAL:
            xi = xi * tl.load(factor_ptr + i * B + offs // D, mask=mask, other=1.0)
        x = xi[None, :]
        term = tl.full([NK_PAD, BLOCK], 1.0, DT)
        for r in tl.static_range(A_POS):  # ξ^a, a > 0: repeated products
            term = tl.where(a > r, term * x, term)
        if A_NEG > 0:  # ξ^a, a < 0
            inv = 1.0 / x
            for r in tl.static_range(A_NEG):
                term = tl.where(a < -r, term * inv, term)
        if J_MAX > 0:  # (log ξ)^j
            lg = tl.log(x)
            for r in tl.static_range(J_MAX):
                term = tl.where(j > r, term * lg, term)
        acc += term
    out = out_ptr + keys[:, None].to(tl.int64) * P64 + offs[None, :]
    tl.store(out, (acc / M).to(DT), mask=(keys[:, None] < NK) & mask[None, :])


def _check_keys(keys, positive: bool, noise: str) -> tuple[tuple[int, int], ...]:
    out = []
    for key in keys:
        if (not isinstance(key, tuple) or len(key) != 2
                or not all(isinstance(k, int) and not isinstance(k, bool) for k in key) or key[1] < 0):
            raise ValueError(f"keys: each key must be a pair (a, j) of ints with j >= 0, got {key!r}")
        if key[1] > 0 and not positive:
            raise ValueError(f"keys: {key} needs log ξ, but noise {noise!r} is not positive")
        out.append(key)
    if not out:
        raise ValueError("keys must not be empty")
    return tuple(dict.fromkeys(out))


def noise_statistics(noise: str, shape, num_samples: int, seed: int, keys, dtype: torch.dtype = torch.float32,
                     device="cpu", *, event_ndims: int = 0) -> dict[tuple[int, int], torch.Tensor]:
    """Per-element means ``t̄_{a,j} = mean_i ξ_i^a (log ξ_i)^j`` of the Triton noise stream.

    .. math::
        \\bar t_{a,j}[p] = \\frac1M \\sum_{i=1}^M \\xi_{i,p}^{a} (\\log \\xi_{i,p})^{j}

    Args:
        noise: a registered noise law name (``mcgraph.kernels.NOISE_LAWS``).
        shape: shape of one draw of ξ (P = prod(shape)).
        num_samples: M ≥ 1.
        seed: stream seed in [0, 2⁶³).
        keys: iterable of ``(a, j)``: integer power ``a`` (negative allowed), log power ``j ≥ 0``
            (``j > 0`` needs a positive law).
        dtype: float32 or float64 accumulation (half types accumulate in float32 and are cast back).
        device: ``cuda``, or ``cpu`` under ``TRITON_INTERPRET=1``.
        event_ndims: Radial only: trailing dims of ``shape`` the norm runs over.

    Returns:
        ``{(a, j): Tensor of shape `shape`}``, no autograd.

    Example:
        >>> s = noise_statistics("normal", (1000,), 100, seed=0, keys=[(1, 0), (2, 0)])  # doctest: +SKIP
        >>> s[(2, 0)].mean()  # ≈ 1
    """
    law = noise_law(noise)
    num_samples = check_num_samples(num_samples)
    check_seed(seed)
    keys = _check_keys(tuple(keys), law.positive, law.name)
    shape = tuple(int(s) for s in shape)
    cdt = compute_dtype(dtype, "dtype")
    device = torch.device(device)
    numel = math.prod(shape)
    nk = len(keys)
    out = torch.empty((nk, numel), dtype=cdt, device=device)
    check_device(out)
    if numel > 0:
        nk_pad = max(2, triton.next_power_of_2(nk))
        a = torch.zeros(nk_pad, dtype=torch.int32)
        j = torch.zeros(nk_pad, dtype=torch.int32)
        a[:nk] = torch.tensor([k[0] for k in keys], dtype=torch.int32)
        j[:nk] = torch.tensor([k[1] for k in keys], dtype=torch.int32)
        a, j = a.to(device), j.to(device)
        event = event_size(shape, event_ndims) if law.radial else 1
        factors = radial_factors(seed, 0, num_samples, numel, event, cdt, device) if law.radial else out
        block = block_for(numel, rows=nk_pad)
        _noise_stats_kernel[(triton.cdiv(numel, block),)](
            out, a, j, factors, seed, numel, num_samples, event,
            NK=nk, NK_PAD=nk_pad, A_POS=max(0, max(k[0] for k in keys)), A_NEG=max(0, -min(k[0] for k in keys)),
            J_MAX=max(k[1] for k in keys), LAW=law.transform, RADIAL=law.radial, BLOCK=block,
            FP64=cdt == torch.float64, DT=tl_dtype(cdt))
    return {k: out[n].reshape(shape).to(dtype) for n, k in enumerate(keys)}
