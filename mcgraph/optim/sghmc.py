"""Adaptive VB in its memory-lean SGHMC form (Ke & Fan, 2022 — seed 004; the released ``SGHMC_SPL`` code).

When the learning rate is small and the variance update is frozen, adaptive VB is
preconditioned SGHMC; tracking only the sampled weight ``w = μ + σε`` (never μ and σ)
saves the memory of the posterior's two registers. Per parameter tensor this optimizer
keeps ``ρ`` (the preconditioner's logit), the velocity ``v`` and the last noise ``ε``;
``τ = sigmoid(ρ)`` is recomputed. With learning rate ``C² = lr``, temperature ``T``,
per-datum decay ``e`` (the prior precision over N: ``δ/N``, or a spike-and-slab decay
per element) and the mean-loss gradient ``g``, one step is the code's:

.. math::
    \\rho &\\leftarrow \\rho - \\eta\\,\\big[T^2 C^3\\, e\\,\\tau + T C^{3/2}\\, \\epsilon_{prev}\\, g
            - 1/(\\tau N)\\big], \\qquad \\tau = \\operatorname{sigmoid}(\\rho) \\\\
    v &\\leftarrow \\beta_1 v - \\beta_2 C^2 (g + e\\, w) + \\sqrt{2 + 2\\beta_1^2}\\; C^{3/2} T\\, \\epsilon,
        \\qquad \\epsilon \\sim N(0, I) \\\\
    w &\\leftarrow (w + \\tau v) \\odot \\text{mask}

The bracket is the exact τ-gradient of the per-datum negative ELBO with the implied
posterior scale ``σ = τ C^{3/2} T`` (the ``g ε/σ`` Hessian estimator of the paper's §2.1),
so the gradient step ``τ C² g = σ (C^{1/2}/T) g`` is the α = ½ member of
:class:`~mcgraph.optim.AdaptiveVB`. State initialisation follows the code (ρ = 0,
``v = 10⁻³·N(0, I)``, ``ε = N(0, I)``); the noise comes from seeded generators.

Pair it with :class:`~mcgraph.optim.CyclicalCosineLR` (each cycle starts at the largest
learning rate: no small-rate warm-up, as the paper argues) and a
:class:`~mcgraph.optim.SnapshotEnsemble` of the weights near each cycle's end for
prediction, and with :class:`~mcgraph.optim.SpikeSlabEM` for one-shot pruning.

Defaults: ``betas=(0.1, 1)``, ``weight_decay=5e-4`` (slab), ``precision_lr`` η = 0.1 as in
the code; ``temperature`` defaults to ``N^{-1/2}`` (the code's sparse-regression examples;
its CIFAR scripts use ``1/N``, a much colder posterior).

A step with a non-finite gradient or new state is skipped with a ``RuntimeWarning``;
weights and state are left unchanged (:attr:`skipped_steps`).

Example:
    >>> import torch, torch.nn.functional as F, mcgraph as mg
    >>> net = torch.nn.Linear(3, 2)
    >>> opt = mg.optim.AdaptiveSGHMC(net.parameters(), dataset_size=100, lr=1e-2, seed=0)
    >>> x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    >>> F.cross_entropy(net(x), y).backward()
    >>> opt.step()
    >>> sorted(opt.state[net.weight])
    ['momentum', 'noise', 'rho']
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Iterable

import torch

from ..engine.checks import all_finite
from ..engine.noise.streams import mix_seed, resolve_seed
from ._checks import non_negative_real, positive_real, real_in
from ._state import CountedOptimizer
from .seeded_noise import fill_normal

__all__ = ["AdaptiveSGHMC"]


class AdaptiveSGHMC(CountedOptimizer):
    """Preconditioned SGHMC with an adaptive, learned preconditioner (see the module docstring).

    Args:
        params: the parameters (or parameter groups) to sample.
        dataset_size: N (> 0).
        lr: ``C²``, the learning rate (a schedule sets it per step).
        betas: ``(β₁, β₂)``: velocity retention (friction ``1 − β₁``) and gradient scale.
        weight_decay: the slab decay ``e`` where no spike-and-slab prior covers a parameter.
        temperature: T (default ``N^{-1/2}``).
        precision_lr: η, the step of the ρ update.
        seed: noise seed (``None``: drawn from torch's global generator).
        spike_slab: a :class:`~mcgraph.optim.SpikeSlabEM` (per-element decay and pruning masks).
    """

    def __init__(self, params: Iterable, dataset_size: int, lr: float = 1e-2, betas=(0.1, 1.0),
                 weight_decay: float = 5e-4, temperature: float | None = None, precision_lr: float = 0.1,
                 seed: int | None = None, spike_slab=None) -> None:
        if isinstance(dataset_size, bool) or not isinstance(dataset_size, (int, float)) or not dataset_size > 0 \
                or not math.isfinite(dataset_size):
            raise ValueError(f"dataset_size must be > 0 (the number of training examples), got {dataset_size!r}")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        t = dataset_size ** -0.5 if temperature is None else positive_real("temperature", temperature)
        defaults = {"lr": positive_real("lr", lr),
                    "betas": (real_in("betas[0]", betas[0], 0.0, 1.0, high_open=True),
                              positive_real("betas[1]", betas[1])),
                    "weight_decay": non_negative_real("weight_decay", weight_decay), "temperature": t,
                    "precision_lr": non_negative_real("precision_lr", precision_lr)}
        super().__init__(params, defaults)
        self.dataset_size = dataset_size
        self.seed = resolve_seed(seed)
        self.spike_slab = spike_slab
        self.counters = {"step": 0, "skipped": 0}

    def _reduce_statistics(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Aggregate the mean-loss gradients over data shards (no-op in one process; see
        :meth:`mcgraph.optim.GaussianVariationalOptimizer._reduce_statistics`). The noise needs no
        communication: it is seeded by ``(seed, step, parameter)``, so every rank draws the same."""
        return tensors

    def _normal(self, p: torch.Tensor, step: int, j: int, kind: int) -> torch.Tensor:
        out = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        fill_normal([(mix_seed(mix_seed(mix_seed(self.seed, step), j), kind), out)])
        return out

    def _decay(self, p: torch.Tensor, group: dict):
        if self.spike_slab is not None:
            decay = self.spike_slab.decay(p)
            if decay is not None:
                return decay
        return group["weight_decay"]

    def implied_sigma(self, p: torch.Tensor) -> torch.Tensor:
        """The posterior scale ``σ = τ C^{3/2} T`` that ``p``'s current preconditioner implies."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        rho = self.state[p].get("rho")
        tau = torch.full_like(p, 0.5) if rho is None else torch.sigmoid(rho)
        return tau * group["lr"] ** 0.75 * group["temperature"]

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One SGHMC step from the gradients in ``.grad`` (a closure, if given, is run first)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self.counters["step"] + 1
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        for g, reduced in zip(grads, self._reduce_statistics(grads)):
            if reduced is not g:
                g.copy_(reduced)
        tentative = []
        j = -1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            c2, t, eta = group["lr"], group["temperature"], group["precision_lr"]
            c = math.sqrt(c2)
            for p in group["params"]:
                j += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if "rho" not in state:
                    state["rho"] = torch.zeros_like(p)
                    state["momentum"] = 1e-3 * self._normal(p, 0, j, 0)
                    state["noise"] = self._normal(p, 0, j, 1)
                g = p.grad
                e = self._decay(p, group)
                tau = torch.sigmoid(state["rho"])
                rho = state["rho"] - eta * (t * t * c2 * c * e * tau + t * c ** 1.5 * state["noise"] * g
                                            - 1.0 / (tau * self.dataset_size))
                tau = torch.sigmoid(rho)
                eps = self._normal(p, step, j, 1)
                v = state["momentum"] * beta1 - beta2 * c2 * (g + e * p) \
                    + math.sqrt(2 + 2 * beta1 ** 2) * c ** 1.5 * t * eps
                w = p + tau * v
                mask = None if self.spike_slab is None else self.spike_slab.mask(p)
                if mask is not None:
                    w, v = w * mask, v * mask
                tentative.append((p, w, {"rho": rho, "momentum": v, "noise": eps}))
        values = [x for _, w, upd in tentative for x in (w, *upd.values())]
        if not all_finite(values):
            self.counters["skipped"] += 1
            warnings.warn(f"AdaptiveSGHMC: non-finite gradient or update at step {step}; the step was skipped and the "
                          f"weights and state left unchanged ({self.counters['skipped']} skipped so far)",
                          RuntimeWarning, stacklevel=2)
            return loss
        for p, w, upd in tentative:
            p.copy_(w)
            self.state[p].update(upd)
        self.counters["step"] = step
        return loss
