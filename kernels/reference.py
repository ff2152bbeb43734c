"""Pure-torch references for the kernels, and the torch (CPU) path of the softmax MC.

Nothing here imports Triton. The ``*_reference`` functions take the noise as
an argument (materialised, e.g., by :func:`mcgraph.kernels.noise_laws.materialize_noise`)
and build the naive autograd graph over all M samples: the tests compare each
kernel with them on exactly the same ξ.

:class:`SoftmaxCrossEntropyMCFunction` is the one autograd Function of the
last-layer softmax MC for both backends: the forward computes the loss and
its derivatives with a pluggable implementation (the Triton kernel, or
:func:`mcgraph.engine.estimators.softmax.softmax_forward_torch`, chunked over M
with torch's noise stream), the backward is shared.

This module imports nothing from the rest of mcgraph: the engine sits above the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.autograd.function import once_differentiable





def broadcasts_to(shape, target) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target`` (an argument check of the kernels)."""
    try:
        return tuple(torch.broadcast_shapes(shape, target)) == tuple(target)
    except RuntimeError:
        return False


# --------------------------------------------------------------------------- references on given noise


def noise_statistics_reference(xi: torch.Tensor, keys) -> dict[tuple[int, int], torch.Tensor]:
    """``{(a, j): mean_i ξ_i^a (log ξ_i)^j}`` for noise rows ``xi`` of shape ``(M, *shape)``."""
    out = {}
    for a, j in keys:
        term = xi.pow(a)
        if j:
            term = term * xi.log().pow(j)
        out[(a, j)] = term.mean(0)
    return out


def sample_from_noise(loc: torch.Tensor | None, scale: torch.Tensor, form_kind: str, xi: torch.Tensor) -> torch.Tensor:
    """``w = T(loc + scale·ξ)`` / ``scale·ξ`` for noise rows ``xi`` of shape ``(M, *shape)``."""
    form_kind = getattr(form_kind, "value", form_kind)
    if form_kind == "scaling":
        return scale * xi
    u = loc + scale * xi
    return u.exp() if form_kind == "exp" else u


def log_prob_expectation_reference(prior, loc: torch.Tensor | None, scale: torch.Tensor, form_kind: str,
                                   xi: torch.Tensor) -> torch.Tensor:
    """``mean_i prior.log_prob(w_i)`` over noise rows ``xi`` (M, *shape), the naive autograd graph."""
    return prior.log_prob(sample_from_noise(loc, scale, form_kind, xi)).mean(0)


def softmax_cross_entropy_reference(mean: torch.Tensor, std: torch.Tensor, targets: torch.Tensor,
                                    eps: torch.Tensor) -> torch.Tensor:
    """Per-row ``mean_i [logsumexp(u_i) - u_i[y]]``, ``u_i = mean + std·ε_i``.

    Args:
        mean, std: (B, K) logit means and standard deviations.
        targets: (B,) class indices.
        eps: (M, B, K) standard normal noise.

    Returns:
        (B,) expected negative log-likelihood, the naive autograd graph over M.
    """
    u = mean + std * eps
    picked = u.gather(-1, targets.reshape(1, -1, 1).expand(u.shape[0], -1, 1)).squeeze(-1)
    return (torch.logsumexp(u, -1) - picked).mean(0)


# --------------------------------------------------------------------------- softmax MC: shared Function


def check_softmax_args(mean, std, targets) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Size]:
    """Validate ``mean (*, K)``, ``std`` broadcastable to it, ``targets (*)``; flatten to (B, K), (B,)."""
    for name, t in (("mean_logits", mean), ("std_logits", std), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if mean.dim() < 1 or not mean.is_floating_point():
        raise ValueError(f"mean_logits: expected a floating tensor of shape (*, K), got {mean.dtype} "
                         f"{tuple(mean.shape)}")
    if not broadcasts_to(std.shape, mean.shape):
        raise ValueError(f"std_logits: shape {tuple(std.shape)} does not broadcast to mean_logits' "
                         f"{tuple(mean.shape)}")
    if targets.shape != mean.shape[:-1]:
        raise ValueError(f"targets: expected shape {tuple(mean.shape[:-1])} (mean_logits without its class dim), "
                         f"got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"targets: expected an integer tensor of class indices, got {targets.dtype}")
    K = mean.shape[-1]
    if targets.device.type == "cpu" and targets.numel() and not bool(((targets >= 0) & (targets < K)).all()):
        raise ValueError(f"targets: class indices must lie in [0, {K})")
    lead = mean.shape[:-1]
    return (mean.reshape(-1, K), std.expand(mean.shape).reshape(-1, K), targets.reshape(-1), lead)


@dataclass(frozen=True, eq=False)
class SoftmaxMCSpec:
    """How the forward of :class:`SoftmaxCrossEntropyMCFunction` runs.

    ``forward(mean (B,K), std (B,K), targets (B,), need_grad) -> (loss (B,), dmean, dstd)`` with
    ``dmean``/``dstd`` of shape (B, K) (``None`` when ``need_grad`` is false).
    """

    forward: Callable
    lead_shape: torch.Size


class SoftmaxCrossEntropyMCFunction(torch.autograd.Function):
    """Expected log-softmax cross-entropy of Gaussian logits, gradients fused into the forward.

    Inputs: ``spec`` (:class:`SoftmaxMCSpec`), ``mean`` (B, K), ``std`` (B, K), ``targets`` (B,) int.
    Output: (B,) per-row ``mean_i [logsumexp(u_i) - u_i[y]]``, ``u_i = mean + std·ε_i``.
    Saves two (B, K) tensors whatever M.
    """

    @staticmethod
    def forward(ctx, spec: SoftmaxMCSpec, mean, std, targets):
        need = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        loss, dmean, dstd = spec.forward(mean, std, targets, need)
        ctx.dtypes = (mean.dtype, std.dtype)
        if need:
            ctx.save_for_backward(dmean, dstd)
        return loss.to(mean.dtype)

    # VJP. L_b = (1/M) Σ_i [lse_k(u_ibk) - u_ib,y_b], u_ibk = m_bk + s_bk ε_ibk. With
    # p_ibk = softmax_k(u_ib) = exp(u_ibk - lse(u_ib)), ∂lse/∂u_ibk = p_ibk and ∂u_ibk/∂(m_bk, s_bk) = (1, ε_ibk):
    #   ∂L_b/∂m_bk = (1/M) Σ_i (p_ibk - [k = y_b])          =: Dm_bk
    #   ∂L_b/∂s_bk = (1/M) Σ_i (p_ibk - [k = y_b]) ε_ibk    =: Ds_bk
    # L_b depends only on row b, so for an upstream gradient g (B,):
    #   grad_m = g[:, None] ⊙ Dm,  grad_s = g[:, None] ⊙ Ds;  targets are indices (no gradient).
    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        dmean, dstd = ctx.saved_tensors
        g = grad_loss.unsqueeze(-1)
        gm = (g * dmean).to(ctx.dtypes[0]) if ctx.needs_input_grad[1] else None
        gs = (g * dstd).to(ctx.dtypes[1]) if ctx.needs_input_grad[2] else None
        return None, gm, gs, None


softmax_cross_entropy_mc_apply = SoftmaxCrossEntropyMCFunction.apply


def run_softmax_mc(forward: Callable, mean, std, targets) -> torch.Tensor:
    """Validate, flatten to (B, K), apply :class:`SoftmaxCrossEntropyMCFunction`, restore ``mean``'s lead shape."""
    mean2, std2, targets2, lead = check_softmax_args(mean, std, targets)
    loss = softmax_cross_entropy_mc_apply(SoftmaxMCSpec(forward, lead), mean2, std2, targets2)
    return loss.reshape(lead)
