"""The variational optimizers' updates as pure functions: the statement of their math.

Each function takes one parameter's tensors and returns new ones, in the order of operations the
optimizers compute (so each accelerated path is checked against it bit for bit): :class:`~mcgraph.optim.IVON`'s
foreach path and the compiled CPU pass of :mod:`mcgraph.optim.cpu_kernels` for :func:`ivon_record` and
:func:`ivon_step`, :class:`~mcgraph.optim.VOGN`'s compiled pass for :func:`vogn_step`. Read these to know
what a step does; the optimizers add the bookkeeping (samples, groups, devices, checkpoints).

IVON (Shen et al., ICML 2024, Algorithm 1), per parameter, with effective sample size λ, weight decay δ,
``h + δ`` at the step's start written ``hδ``:

.. math::
    \\sigma = 1/\\sqrt{\\lambda\\,(h + \\delta)}, \\qquad \\theta = m + \\sigma\\,\\epsilon
    \\qquad \\text{(the weight sample)} \\\\
    \\hat g = \\overline{\\nabla \\ell}, \\qquad
    \\hat h = \\lambda\\,\\overline{\\nabla \\ell \\odot (\\theta - m)}\\,(h + \\delta)
    = \\overline{\\nabla\\ell \\odot \\frac{\\theta - m}{\\sigma^2}} \\quad \\text{(Price; or } \\lambda\\,\\overline{\\nabla\\ell^2})\\\\
    g \\leftarrow \\beta_1 g + (1 - \\beta_1)\\hat g, \\qquad
    h \\leftarrow \\beta_2 h + (1 - \\beta_2)\\hat h + \\tfrac12 (1 - \\beta_2)^2 \\frac{(h - \\hat h)^2}{h + \\delta} \\\\
    m \\leftarrow m - \\alpha\\,\\mathrm{clip}\\Big(\\frac{g / d + \\delta m}{h + \\delta}, \\rho\\Big)
    \\qquad (d = 1 - \\beta_1^t \\text{ or } 1, \\text{ the new } h)

Example:
    >>> import torch
    >>> from mcgraph.optim import updates
    >>> m, g, h = torch.zeros(3), torch.zeros(3), torch.ones(3)
    >>> m, g, h, hw = updates.ivon_step(m, g, h, torch.ones(3), torch.ones(3), h + 1e-4, beta1=0.9, beta2=0.99999,
    ...                                 ess=100.0, weight_decay=1e-4, debias=0.1, lr=0.1, clip_radius=1e-3,
    ...                                 price=True)
    >>> m
    tensor([-0.0001, -0.0001, -0.0001])
"""

from __future__ import annotations

import math

import torch

__all__ = ["ivon_inverse_scale", "ivon_record", "ivon_step", "vogn_step"]


def ivon_inverse_scale(hess: torch.Tensor, ess: float, weight_decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + δ, 1/σ = √(λ (h + δ)))``: the scale of the weight sample ``θ = m + ε / (1/σ)``."""
    hess_wd = hess + weight_decay
    return hess_wd, (hess_wd * ess).sqrt()


def ivon_record(grad_avg: torch.Tensor | None, hess_avg: torch.Tensor | None, grad: torch.Tensor,
                noise: torch.Tensor, count: int, price: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold sample ``count`` (1-based) into the running means ĝ and ĥ's statistic (Welford: ``a + (v − a)/c``).

    ``noise`` is the sample's ``θ − m = σ ⊙ ε``; the statistic is ``∇ℓ ⊙ noise`` (Price, scaled by
    ``λ (h + δ)`` in :func:`ivon_step`) or ``∇ℓ²`` (``gradsq``). The first sample's values are the means.
    """
    h = grad * noise if price else grad * grad
    if count == 1:
        return grad.clone(), h
    return grad_avg + (grad - grad_avg) / count, hess_avg + (h - hess_avg) / count


def ivon_step(mean: torch.Tensor, momentum: torch.Tensor, hess: torch.Tensor, grad_avg: torch.Tensor,
              hess_avg: torch.Tensor, hess_wd: torch.Tensor, *, beta1: float, beta2: float, ess: float,
              weight_decay: float, debias: float, lr: float, clip_radius: float,
              price: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One IVON step of one parameter (lines 3–6 of Algorithm 1): ``(m, g, h, h + δ)`` after it.

    Args:
        mean, momentum, hess: m, g, h before the step.
        grad_avg, hess_avg: ĝ and ĥ's statistic over the step's samples (:func:`ivon_record`).
        hess_wd: ``h + δ`` at the step's start (the samples' scale).
        debias: ``1 − β₁ᵗ``, or 1 without debiasing; lr: α (already rescaled by ``h₀ + δ`` if asked).
        clip_radius: ρ (``inf``: no clipping); price: ĥ from Price's theorem, else ``gradsq``.
    """
    g = momentum * beta1 + grad_avg * (1.0 - beta1)                       # line 3
    f = hess_avg * hess_wd if price else hess_avg                        # line 2: ĥ / λ
    f = f * ess
    corr = hess - f
    corr = corr * corr * (0.5 * (1.0 - beta2) ** 2) / hess_wd
    h = hess * beta2 + f * (1.0 - beta2) + corr                           # line 4 (eq. 8)
    step = g / debias + mean * weight_decay
    hess_wd_next = h + weight_decay
    step = step / hess_wd_next
    if math.isfinite(clip_radius):
        step = step.clamp(-clip_radius, clip_radius)
    return mean - step * lr, g, h, hess_wd_next                           # line 6


def vogn_step(mean: torch.Tensor, grad: torch.Tensor, hess: torch.Tensor, momentum: torch.Tensor | None,
              precision: torch.Tensor, *, delta: float, beta1: float, keep: float, beta2: float, lr: float,
              damping: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One VOGN step of one parameter (Osawa et al., 2019, Algorithm 1, lines 17–19): ``(μ, m, s)`` after it.

    .. math::
        m \\leftarrow \\beta_1 m + (\\hat g + \\tilde\\delta \\mu), \\quad
        s \\leftarrow k\\,s + \\beta_2 \\hat h, \\quad
        \\mu \\leftarrow \\mu - \\alpha \\frac{m}{s + \\tilde\\delta + \\text{damping}}

    ``momentum`` is ``None`` at the first step (``m = ĝ + δ̃μ``); ``keep`` is k (``1 − τβ₂``, or ``1 − β₂``
    in torchsso's variant).
    """
    g = grad + delta * mean
    m = g if momentum is None else momentum * beta1 + g                   # line 17
    s = precision * keep + beta2 * hess                                   # line 18
    return mean - lr * m / (s + delta + damping), m, s                    # line 19
