"""Last-layer softmax MC: expected cross-entropy of Gaussian logits, one program per row.

Paper Observation 1 replaces E[log softmax] by a Taylor expansion; this kernel
computes the exact Monte Carlo estimate instead. For logits
``u_ibk = m_bk + s_bk·ε_ibk`` (the local-reparameterisation output of the last
layer), program ``b`` loops over the M samples, draws ``ε_ib·`` in registers
(normal law of :mod:`mcgraph.kernels.noise_laws`, offset ``i·B·K + b·K + k``),
and accumulates

.. math::
    L_b = \\frac1M\\sum_i \\big[\\mathrm{lse}(u_{ib}) - u_{ib y_b}\\big], \\quad
    D^m_{bk} = \\frac1M\\sum_i (p_{ibk} - [k = y_b]), \\quad
    D^s_{bk} = \\frac1M\\sum_i (p_{ibk} - [k = y_b])\\,\\varepsilon_{ibk}.

A row of up to ``SINGLE_MAX`` classes lives in registers; a longer row is
swept in chunks twice per sample (online log-sum-exp, then the softmax
gradient), regenerating the same ε, with D accumulated in the (B, K) output.
Memory is O(B·K) for any M. The autograd Function (and its VJP) is shared with
the torch path: :class:`mcgraph.kernels.reference.SoftmaxCrossEntropyMCFunction`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .noise_laws import draw, normal_transform
from .reference import run_softmax_mc
from .utils import INTERPRETED, check_device, check_num_samples, check_seed, compute_dtype, tl_dtype

#: Longest row kept in registers; longer rows are swept in chunks of ``CHUNK_K``.
SINGLE_MAX = 4096
CHUNK_K = 2048


@triton.jit(do_not_specialize=["seed", "B", "K", "M"])
def _softmax_mc_kernel(
    loss_ptr,  # (B,) out: L_b
    dmean_ptr, dstd_ptr,  # (B, K) out: Dm, Ds (if NEED_GRAD; zero-initialised when not SINGLE)
    mean_ptr, std_ptr,  # (B, K) logit means and standard deviations
    target_ptr,  # (B,) class indices in [0, K)
    seed, B, K, M,
    NEED_GRAD: tl.constexpr, SINGLE: tl.constexpr, BLOCK_K: tl.constexpr, FP64: tl.constexpr,
    DT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    K64 = K.to(tl.int64)
    P64 = B.to(tl.int64) * K64  # elements per sample of ε
    base = row * K64
    y = tl.load(target_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    loss = tl.sum(tl.zeros([BLOCK_K], dtype=DT), axis=0)
    if SINGLE:
        mask = cols < K
        m = tl.load(mean_ptr + base + cols, mask=mask, other=0.0).to(DT)
        s = tl.load(std_ptr + base + cols, mask=mask, other=0.0).to(DT)
        is_y = cols == y
        gm = tl.zeros([BLOCK_K], dtype=DT)
        gs = tl.zeros([BLOCK_K], dtype=DT)
        for i in range(0, M):
            eps = draw(seed, i * P64 + base + cols, normal_transform, FP64)
            u = tl.where(mask, m + s * eps, float("-inf"))
            mx = tl.max(u, axis=0)
            e = tl.exp(u - mx)
            z = tl.sum(e, axis=0)
            loss += mx + tl.log(z) - tl.sum(tl.where(is_y, u, 0.0), axis=0)
            if NEED_GRAD:
                g = e / z - tl.where(is_y, 1.0, 0.0)
                gm += g
                gs += g * eps
        if NEED_GRAD:
            tl.store(dmean_ptr + base + cols, gm / M, mask=mask)
            tl.store(dstd_ptr + base + cols, gs / M, mask=mask)
    else:
        for i in range(0, M):
            off = i * P64 + base
            mx = tl.max(tl.full([BLOCK_K], float("-inf"), DT), axis=0)
            z = tl.sum(tl.zeros([BLOCK_K], dtype=DT), axis=0)
            uy = tl.sum(tl.zeros([BLOCK_K], dtype=DT), axis=0)
            for k0 in range(0, K, BLOCK_K):  # pass 1: online log-sum-exp
                c = k0 + cols
                mask = c < K
                m = tl.load(mean_ptr + base + c, mask=mask, other=0.0).to(DT)
                s = tl.load(std_ptr + base + c, mask=mask, other=0.0).to(DT)
                eps = draw(seed, off + c, normal_transform, FP64)
                u = tl.where(mask, m + s * eps, float("-inf"))
                mx_new = tl.maximum(mx, tl.max(u, axis=0))
                z = z * tl.exp(mx - mx_new) + tl.sum(tl.exp(u - mx_new), axis=0)
                mx = mx_new
                uy += tl.sum(tl.where(c == y, u, 0.0), axis=0)
            lse = mx + tl.log(z)
            loss += lse - uy
            if NEED_GRAD:
                for k0 in range(0, K, BLOCK_K):  # pass 2: same ε, softmax gradient into the outputs
                    c = k0 + cols
                    mask = c < K
                    m = tl.load(mean_ptr + base + c, mask=mask, other=0.0).to(DT)
                    s = tl.load(std_ptr + base + c, mask=mask, other=0.0).to(DT)
                    eps = draw(seed, off + c, normal_transform, FP64)
                    g = tl.exp(m + s * eps - lse) - tl.where(c == y, 1.0, 0.0)
                    gm = tl.load(dmean_ptr + base + c, mask=mask, other=0.0)
                    gs = tl.load(dstd_ptr + base + c, mask=mask, other=0.0)
                    tl.store(dmean_ptr + base + c, gm + g, mask=mask)
                    tl.store(dstd_ptr + base + c, gs + g * eps, mask=mask)
        if NEED_GRAD:
            for k0 in range(0, K, BLOCK_K):
                c = k0 + cols
                mask = c < K
                tl.store(dmean_ptr + base + c, tl.load(dmean_ptr + base + c, mask=mask, other=0.0) / M, mask=mask)
                tl.store(dstd_ptr + base + c, tl.load(dstd_ptr + base + c, mask=mask, other=0.0) / M, mask=mask)
    tl.store(loss_ptr + row, loss / M)


def softmax_forward_triton(mean: torch.Tensor, std: torch.Tensor, targets: torch.Tensor, num_samples: int,
                           seed: int, need_grad: bool, block_k: int | None = None):
    """Launch the kernel: loss (B,) and, if ``need_grad``, Dm, Ds (B, K).

    Args:
        mean, std: (B, K) (any float dtype; computed in float32, or float64 for float64 input).
        targets: (B,) int class indices in [0, K).
        block_k: force the chunk width (a power of two); rows longer than it take the swept path.
    """
    check_device(mean)
    B, K = mean.shape
    dtype = compute_dtype(mean.dtype, "mean_logits")
    m = mean.detach().to(dtype).contiguous()
    s = std.detach().to(dtype).contiguous()
    t = targets.contiguous()
    if block_k is None:
        block_k = triton.next_power_of_2(K) if K <= SINGLE_MAX else CHUNK_K
    single = K <= block_k
    loss = torch.empty(B, dtype=dtype, device=mean.device)
    make = torch.empty if single else torch.zeros
    dm = make((B, K), dtype=dtype, device=mean.device) if need_grad else loss
    ds = make((B, K), dtype=dtype, device=mean.device) if need_grad else loss
    if B and K:
        num_warps = 4 if block_k <= 1024 else 8
        _softmax_mc_kernel[(B,)](loss, dm, ds, m, s, t, seed, B, K, num_samples, NEED_GRAD=need_grad,
                                 SINGLE=single, BLOCK_K=block_k, FP64=dtype == torch.float64, DT=tl_dtype(dtype),
                                 num_warps=1 if INTERPRETED else num_warps)
    return loss, (dm if need_grad else None), (ds if need_grad else None)


def softmax_cross_entropy_mc(mean_logits: torch.Tensor, std_logits: torch.Tensor, targets: torch.Tensor,
                             num_samples: int, seed: int, *, block_k: int | None = None) -> torch.Tensor:
    """Expected log-softmax cross-entropy of Gaussian logits, ε drawn in registers (Triton).

    .. math::
        L_b = \\frac1M \\sum_{i=1}^M \\Big[\\log\\sum_k e^{u_{ibk}} - u_{ib y_b}\\Big],
        \\qquad u_{ibk} = m_{bk} + s_{bk}\\,\\varepsilon_{ibk}

    Args:
        mean_logits: (*, K) logit means.
        std_logits: (*, K) logit standard deviations (or broadcastable to ``mean_logits``).
        targets: (*) integer class indices in [0, K).
        num_samples: M ≥ 1.
        seed: stream seed in [0, 2⁶³); ε is ``materialize_noise("normal", (B, K), 0, M, seed)``.
        block_k: optional chunk width (power of two) forcing the swept path for rows longer than it.

    Returns:
        (*) per-row expected NLL, differentiable in ``mean_logits`` and ``std_logits``;
        memory O(B·K) for any M.

    Example:
        >>> m = torch.zeros(4, 3, device="cuda", requires_grad=True)  # doctest: +SKIP
        >>> s = torch.ones(4, 3, device="cuda")
        >>> softmax_cross_entropy_mc(m, s, torch.tensor([0, 1, 2, 0], device="cuda"), 1000, seed=0).shape
        torch.Size([4])
    """
    num_samples = check_num_samples(num_samples)
    check_seed(seed)
    if block_k is not None and (block_k < 1 or block_k & (block_k - 1)):
        raise ValueError(f"block_k must be a power of two, got {block_k}")

    def forward(mean, std, targets, need_grad):
        return softmax_forward_triton(mean, std, targets, num_samples, seed, need_grad, block_k)

    return run_softmax_mc(forward, mean_logits, std_logits, targets)
