"""The torch backend of the last-layer softmax Monte Carlo: expected cross-entropy of Gaussian logits.

The forward draws ε from the engine's seeded block stream chunk by chunk, without autograd,
and accumulates the loss with its derivatives; the autograd Function and its backward are the
kernels' own (:class:`mcgraph.kernels.reference.SoftmaxCrossEntropyMCFunction`), shared with the
Triton kernel.
"""

from __future__ import annotations

import math

import torch

from mcgraph.kernels.reference import run_softmax_mc

from ..noise.backends import backend_for
from ..noise.streams import BlockStream, resolve_seed, rows_per_block


def softmax_noise_stream(shape, num_samples: int, seed: int, dtype: torch.dtype, device) -> BlockStream:
    """The torch backend's ε stream for the softmax MC: rows of shape ``(n, B, K)``, drawn in seeded blocks."""
    shape = tuple(shape)
    numel = max(1, math.prod(shape))
    return BlockStream(lambda n: torch.randn((n,) + shape, dtype=dtype, device=device), num_samples,
                       rows_per_block(numel, num_samples), seed, torch.device(device))


def softmax_forward_torch(mean: torch.Tensor, std: torch.Tensor, targets: torch.Tensor, num_samples: int,
                          seed: int, chunk_size: int | None, need_grad: bool):
    """Loss (B,) and, if ``need_grad``, Dm, Ds (B, K), chunk by chunk over M without autograd.

    Args:
        mean, std: (B, K); targets: (B,); chunk_size: samples per chunk (memory O(chunk·B·K)).
    """
    B, K = mean.shape
    dtype = torch.float64 if mean.dtype == torch.float64 else torch.float32
    m, s = mean.detach().to(dtype), std.detach().to(dtype)
    idx = targets.reshape(1, B, 1).to(torch.int64)
    stream = softmax_noise_stream((B, K), num_samples, seed, dtype, mean.device)
    chunk = chunk_size or stream.block
    loss = torch.zeros(B, dtype=dtype, device=mean.device)
    dm = torch.zeros((B, K), dtype=dtype, device=mean.device) if need_grad else None
    ds = torch.zeros((B, K), dtype=dtype, device=mean.device) if need_grad else None
    with torch.no_grad():
        for _, _, eps in stream.chunks(chunk):
            u = m + s * eps
            lse = torch.logsumexp(u, -1)
            ix = idx.expand(u.shape[0], B, 1)
            loss += (lse - u.gather(-1, ix).squeeze(-1)).sum(0)
            if need_grad:
                g = torch.exp(u - lse.unsqueeze(-1))
                g.scatter_add_(-1, ix, torch.full(ix.shape, -1.0, dtype=dtype, device=mean.device))
                dm += g.sum(0)
                ds += (g * eps).sum(0)
    if need_grad:
        dm /= num_samples
        ds /= num_samples
    return loss / num_samples, dm, ds


def softmax_cross_entropy_mc_torch(mean_logits: torch.Tensor, std_logits: torch.Tensor, targets: torch.Tensor,
                                   num_samples: int, seed: int | None = None,
                                   chunk_size: int | None = None) -> torch.Tensor:
    """Expected cross-entropy of Gaussian logits, pure torch, graph and memory independent of M.

    .. math::
        L_b = \\frac1M \\sum_{i=1}^M \\Big[\\log\\sum_k e^{u_{ibk}} - u_{ib y_b}\\Big],
        \\qquad u_{ibk} = m_{bk} + s_{bk}\\,\\varepsilon_{ibk}

    The exact Monte Carlo version of the paper's Observation 1 (no Taylor step).
    Noise is torch's seeded block stream (same seed ⇒ same value for any ``chunk_size``).

    Args:
        mean_logits: (*, K) logit means (e.g. the local-reparameterisation mean of the last layer).
        std_logits: (*, K) logit standard deviations, or broadcastable to ``mean_logits``.
        targets: (*) integer class indices in [0, K).
        num_samples: M ≥ 1.
        seed: noise seed (``None``: drawn from torch's global generator).
        chunk_size: samples per chunk; memory O(chunk·B·K). Default: one noise block.

    Returns:
        (*) per-row expected negative log-likelihood, differentiable in mean and std.

    Example:
        >>> m = torch.zeros(4, 3, requires_grad=True)
        >>> loss = softmax_cross_entropy_mc_torch(m, torch.ones(4, 3), torch.tensor([0, 1, 2, 0]), 100, seed=0)
        >>> loss.shape
        torch.Size([4])
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    seed = resolve_seed(seed)

    def forward(mean, std, targets, need_grad):
        return softmax_forward_torch(mean, std, targets, num_samples, seed, chunk_size, need_grad)

    return run_softmax_mc(forward, mean_logits, std_logits, targets)


def softmax_cross_entropy_mc(mean_logits: torch.Tensor, std_logits: torch.Tensor, targets: torch.Tensor,
                             num_samples: int, seed: int | None = None,
                             chunk_size: int | None = None) -> torch.Tensor:
    """Expected cross-entropy of Gaussian logits ``u = mean + std·ε`` per row, on the backend of ``mean_logits``.

    .. math::
        L_b = \\frac1M \\sum_{i=1}^M \\Big[\\log\\sum_k e^{u_{ibk}} - u_{ib y_b}\\Big]

    Triton: ε in registers, memory O(B·K) for any M. Torch: chunks of ``chunk_size``
    samples, memory O(chunk·B·K). The two backends use different noise streams.

    Args:
        mean_logits: (*, K); std_logits: (*, K) or broadcastable; targets: (*) ints in [0, K).
        num_samples: M ≥ 1; seed: ``None`` draws one from torch's global generator.
        chunk_size: torch backend only.

    Returns:
        (*) per-row expected NLL, differentiable in ``mean_logits`` and ``std_logits``.

    Example:
        >>> m = torch.zeros(2, 3, requires_grad=True)
        >>> softmax_cross_entropy_mc(m, torch.ones(2, 3), torch.tensor([0, 2]), 10, seed=0).shape
        torch.Size([2])
    """
    seed = resolve_seed(seed)
    if backend_for(mean_logits) == "triton":
        from mcgraph.kernels.softmax_mc import softmax_cross_entropy_mc as triton_softmax_mc

        return triton_softmax_mc(mean_logits, std_logits, targets, num_samples, seed)
    return softmax_cross_entropy_mc_torch(mean_logits, std_logits, targets, num_samples,
                                                                seed=seed, chunk_size=chunk_size)
