"""The ELBO's gradient for a model of any library, one forward and backward per sample.

.. math::
    \\mathcal L = \\frac1M\\sum_{i=1}^M \\ell(f_{W_i}) + \\beta\\,\\frac{KL(q\\|p)}{N},
    \\qquad W_i \\sim q \\text{ drawn by the model's own forward}

:func:`elbo_backward` runs ``loss_fn(model)`` M times; each value is backpropagated with
weight 1/M at once and its graph freed before the next forward. Memory is that of one
sample, time is O(M), and the gradients are those of M independent samples, also for
layers that keep their noise in a buffer refilled in place (bayesian-torch, blitz), whose
σ-gradients are wrong when several samples share one graph: autograd keeps the buffer, the
next sample overwrites it through ``.data`` and every earlier sample's backward reads the
last noise. The KL term (e.g. :func:`mcgraph.interop.kl`, whose graph does not grow with
its own M) is backpropagated once.

It accumulates into ``.grad`` as ``loss.backward()`` does and returns the detached loss; it
cannot return a differentiable loss (convert the model with ``to_mcgraph`` and use
``mg.nn.elbo`` for that).

Example:
    >>> import torch, torch.nn.functional as F, mcgraph.interop as interop
    >>> from bayesian_torch.layers import LinearReparameterization
    >>> model = LinearReparameterization(4, 3)
    >>> x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    >>> loss = interop.elbo_backward(model, lambda m: F.cross_entropy(m(x)[0], y), num_samples=16,
    ...                              kl=interop.kl(model, 100), dataset_size=1000)
    >>> loss.requires_grad, model.rho_weight.grad.shape
    (False, torch.Size([3, 4]))
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..engine import checks
from ..engine.options import Sampling, resolve_sampling

__all__ = ["elbo_backward"]


def _scalar(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name} must return a tensor with one element, got {got}")
    return value.reshape(())


def elbo_backward(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], num_samples: int | Sampling, *,
                  kl: torch.Tensor | Callable[[], torch.Tensor] | None = None, kl_weight: float = 1.0,
                  dataset_size: int | None = None) -> torch.Tensor:
    """Backpropagate the M-sample negative ELBO sample by sample; returns its detached value.

    Args:
        model: the network (any library); each call of ``loss_fn`` draws its own weights.
        loss_fn: ``loss_fn(model) -> 0-d tensor``: one sample's data loss (e.g. the batch mean
            cross-entropy of one forward).
        num_samples: M ≥ 1 (or a :class:`~mcgraph.Sampling` holding only M: the samples are the
            model's own draws, so it takes no seed or other option).
        kl: the KL term, a 0-d tensor or a callable returning one (``None``: no KL term).
        kl_weight: β.
        dataset_size: N, the KL's divisor (required with ``kl``).

    Returns:
        The detached 0-d loss ``mean_i loss_fn + β·KL/N``.

    Raises:
        ValueError: a non-positive ``num_samples`` or ``dataset_size``, a ``kl`` without
            ``dataset_size``, or a ``loss_fn`` value that is not a one-element tensor.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model), got {type(loss_fn).__name__}")
    num_samples, _ = resolve_sampling(num_samples)
    m = checks.positive_int("num_samples", num_samples)
    if kl is not None and dataset_size is None:
        raise ValueError("dataset_size is required when kl is given (the KL is divided by it)")
    if dataset_size is not None:
        dataset_size = checks.positive_int("dataset_size", dataset_size)
    if not isinstance(kl_weight, torch.Tensor) or kl_weight.ndim == 0:
        checks.finite_float("kl_weight", kl_weight, low=0.0)
    total = None
    for _ in range(m):
        value = _scalar("loss_fn", loss_fn(model))
        if value.requires_grad:
            (value / m).backward()
        value = value.detach()
        total = value if total is None else total + value
    total = total / m
    if kl is not None:
        value = _scalar("kl", kl() if callable(kl) else kl)
        term = kl_weight * value / dataset_size
        if term.requires_grad:
            term.backward()
        total = total + term.detach()
    return total
