"""Adaptive variational Bayes (Ke & Fan, 2022 — seed 004, §2.2): the α ∈ {½, 1} family.

A mean-field Gaussian posterior over a plain network, with the prior ``N(0, I/δ)``. The
paper's update is a proximal step in the metric ``diag(σ²)^{-α}`` and a precision
updated with momentum:

.. math::
    \\mu_{t+1} = \\mu_t - l_t\\,(\\sigma_t^2)^{\\alpha} \\odot \\nabla_\\mu(-\\mathcal L), \\qquad
    \\frac1{\\sigma_t^2} = \\frac{1 - \\lambda\\gamma}{\\sigma_{t-1}^2} + \\gamma\\,(g_t \\odot g_t + \\delta/N),

``0 < γ < 1``, λ a second rate; ``α = ½`` behaves like Adam, ``α = 1`` like a Newton
step. This class implements it on the per-datum scale, where the two rates have a
fixed meaning [our reading of pp. 1–2, the only pages available]:

.. math::
    w &= \\mu + \\sigma\\odot\\epsilon, \\quad \\sigma^2 = 1/(N\\,\\pi) \\\\
    \\pi &\\leftarrow (1 - \\lambda\\gamma_t)\\,\\pi + \\gamma_t\\,(\\hat h + \\delta/N) \\\\
    m &\\leftarrow \\beta_1 m + (1 - \\beta_1)(\\hat g + (\\delta/N)\\mu), \\quad
        \\hat m = m / (1 - \\beta_1^t) \\\\
    \\mu &\\leftarrow \\mu - l\\, \\hat m / (\\pi^{\\alpha} + \\varepsilon)

with π = 1/(Nσ²) the per-datum precision, ĝ the minibatch mean gradient and ĥ the
curvature: ``curvature="squared_gradient"`` (the paper's ``g_t ⊙ g_t``, the squared
minibatch gradient) or ``"per_example"`` (the mean of per-example squares, as VOGN, from
:mod:`mcgraph.optim.per_example`). The fixed point of π is ``(ĥ + δ/N)/λ``: λ = 1
(default) gives the variational posterior ``σ² = 1/(Nĥ + δ)``; λ ≠ 1 tempers it.
The paper's ``(σ²)^α`` on the full-data scale equals ``π^{-α}`` up to the factor ``N^{-α}``,
which is absorbed in the learning rate ``l`` so that ``α = ½`` takes Adam's learning rates.
Near a minimum the squared minibatch gradient is about ``1/B`` of the mean per-example square
(``B`` the batch size), so ``"squared_gradient"`` gives a posterior about ``√B`` times wider than
``"per_example"`` does [our derivation]; use ``"per_example"`` for VOGN-like variances.

**Warm-up.** The paper argues (i) the adaptive rate has large variance early (as Adam's,
RAdam) and (ii) with one sample and a small learning rate the injected noise swamps the
gradient, so the usual warm-up from a tiny learning rate fails for variational BNNs. Our
rule follows both points [our reading; the page with the paper's own rule is not
available]: for the first ``warmup_steps`` steps no noise is injected (w = μ) and π is
the running mean of ``ĥ + δ/N`` (rate ``γ_t = max(γ, 1/t)``, so it is a well-averaged
estimate, not a noisy EMA start), while the learning rate stays at its full value;
afterwards π is the EMA above and the weights are sampled. With ``warmup_steps=0`` π
starts at one extra pass through the first minibatch (as VOGN).

The memory-lean form the paper derives (SGHMC with a preconditioner; only the weights
are stored) is :class:`~mcgraph.optim.AdaptiveSGHMC`.

Example:
    >>> import torch, torch.nn.functional as F, mcgraph as mg
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    >>> opt = mg.optim.AdaptiveVB(net, dataset_size=32, lr=1e-2, alpha=0.5, warmup_steps=2, seed=0)
    >>> def closure():
    ...     opt.zero_grad()
    ...     loss = F.cross_entropy(net(x), y)
    ...     loss.backward()
    ...     return loss
    >>> for _ in range(4):
    ...     loss = opt.step(closure)
    >>> sorted(opt.posterior)[:2]
    ['0.bias', '0.weight']
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ._checks import choice, non_negative_real, positive_real, real_in
from .gaussian import GaussianVariationalOptimizer, renamed_sample_count
from .choices import Curvature, LossReduction, Parallel

__all__ = ["AdaptiveVB", "CURVATURES"]

#: ``"squared_gradient"``: ĥ = ĝ ⊙ ĝ (the paper); ``"per_example"``: ĥ = mean_i g_i² (as VOGN).
CURVATURES = tuple(c.value for c in Curvature)


class AdaptiveVB(GaussianVariationalOptimizer):
    """Adaptive variational Bayes with α ∈ {½, 1} (see the module docstring).

    Args:
        model: the network (layers as :class:`~mcgraph.optim.VOGN`).
        dataset_size: N.
        lr: l.
        alpha: ½ (Adam-like) or 1 (Newton-like).
        betas: ``(β₁, γ)``: the gradient momentum and the precision's rate.
        precision_decay: λ > 0 (1: the variational fixed point).
        prior_precision: δ.
        num_samples: S ≥ 1 samples per step (the paper uses 1).
        warmup_steps: steps without noise, with a running-mean precision (see above).
        curvature: ``"squared_gradient"`` (default, the paper) or ``"per_example"``.
        init_precision: initial π (default: the first minibatch's ``ĥ + δ/N``).
        eps: added to ``π^α`` in the step (as Adam's ε; guards parameters without prior and curvature).
        batchnorm_prior, loss_reduction, seed, spike_slab, process_group, parallel, num_mc_samples: as
            :class:`~mcgraph.optim.VOGN`.
    """

    def __init__(self, model: nn.Module, dataset_size: int, lr: float = 1e-3, alpha: float = 0.5,
                 betas=(0.9, 0.01), precision_decay: float = 1.0, prior_precision: float = 1.0,
                 num_samples: int = 1, warmup_steps: int = 0, curvature: str | Curvature = "squared_gradient",
                 init_precision: float | None = None, eps: float = 1e-8, batchnorm_prior: bool = False,
                 loss_reduction: str | LossReduction = "mean", seed: int | None = None, spike_slab=None,
                 process_group=None, parallel: str | Parallel = "data", num_mc_samples: int | None = None) -> None:
        if alpha not in (0.5, 1, 1.0):
            raise ValueError(f"alpha must be 0.5 or 1, got {alpha!r}")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, gamma), got {betas!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        defaults = {
            "lr": positive_real("lr", lr), "alpha": float(alpha),
            "betas": (real_in("betas[0]", betas[0], 0.0, 1.0, high_open=True),
                      real_in("betas[1]", betas[1], 0.0, 1.0, low_open=True, high_open=True)),
            "precision_decay": positive_real("precision_decay", precision_decay),
            "prior_precision": non_negative_real("prior_precision", prior_precision),
            "warmup_steps": warmup_steps,
            "curvature": choice("curvature", curvature, Curvature),
            "eps": non_negative_real("eps", eps),
        }
        num_samples = renamed_sample_count("AdaptiveVB", num_samples, num_mc_samples)
        super().__init__(model, dataset_size, defaults, num_samples=num_samples, seed=seed,
                         loss_reduction=loss_reduction, batchnorm_prior=batchnorm_prior,
                         spike_slab=spike_slab, process_group=process_group, parallel=parallel)
        if init_precision is not None:
            value = positive_real("init_precision", init_precision)
            for p, _ in self._flat():
                self.state[p]["precision"] = torch.full_like(p, value)
            self.counters["initialized"] = True

    def _per_example(self) -> bool:
        return any(g["curvature"] == "per_example" for g in self.param_groups)

    def _in_warmup(self, step: int) -> bool:
        return step <= max(g["warmup_steps"] for g in self.param_groups)

    def _sigmas(self) -> list[torch.Tensor | None]:
        out = []
        for p, group in self._flat():
            state = self.state[p]
            if not group["sample"]:
                out.append(None)
                continue
            if "precision" not in state:
                out.append(torch.zeros_like(p))
                continue
            sigma = (1.0 / (self.dataset_size * state["precision"])).sqrt()
            mask = self._mask(p)
            out.append(sigma if mask is None else sigma * mask)
        return out

    def _curvature(self, group: dict, g: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
        return g.square() if group["curvature"] == "squared_gradient" else h

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One step (S sampled closures, or one at μ during warm-up). Returns the mean loss."""
        per_example = self._per_example()
        step = self.counters["step"] + 1
        warm = self._in_warmup(step)
        if not self.counters["initialized"] and not warm:
            _, g0, h0 = self._collect(closure, None, 1, self.counters["draws"], curvature=per_example)
            self.counters["draws"] += 1
            for (p, group), gi, hi in zip(self._flat(), g0, h0 or [None] * len(g0)):
                self.state[p]["precision"] = self._curvature(group, gi, hi) + self._prior_precision(p, group) / \
                    self.dataset_size
            self.counters["initialized"] = True
        draw = self.counters["draws"]
        self.counters["draws"] += 1
        sigmas = None if warm else self._sigmas()
        loss, g, h = self._collect(closure, sigmas, 1 if warm else self.num_samples, draw, curvature=per_example)
        tentative = []
        for (p, group), gi, hi in zip(self._flat(), g, h or [None] * len(g)):
            state = self.state[p]
            beta1, gamma = group["betas"]
            delta = self._prior_precision(p, group) / self.dataset_size
            rate = max(gamma, 1.0 / step) if warm else gamma
            target = self._curvature(group, gi, hi) + delta
            pi = state.get("precision")
            pi = target if pi is None else pi * (1.0 - group["precision_decay"] * rate) + rate * target
            m = state.get("momentum")
            d = gi + delta * p
            m = d * (1.0 - beta1) if m is None else m * beta1 + d * (1.0 - beta1)
            m_hat = m / (1.0 - beta1 ** step)
            scale = pi.sqrt() if group["alpha"] == 0.5 else pi
            mu = p - group["lr"] * m_hat / (scale + group["eps"])
            mask = self._mask(p)
            if mask is not None:
                mu, m = mu * mask, m * mask
            tentative.append((p, {"param": mu, "momentum": m, "precision": pi}))
        if self._commit_or_skip(tentative, "gradient, precision or update"):
            self.counters["initialized"] = True
            self._apply_masks()
        return loss
