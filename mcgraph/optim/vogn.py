"""VOGN: Variational Online Gauss–Newton (Khan et al., 2018; Osawa et al., 2019 — seed 003).

A mean-field Gaussian posterior ``q(w) = N(μ, diag(σ²))`` over a plain network, trained
like Adam. With ``N ← ρN`` (``data_augmentation_factor`` ρ), ``δ̃ = τδ/N`` and, per step,
``K`` samples (seed 003, **Algorithm 1**, in its order of updates):

.. math::
    \\sigma &= \\big(1 / (N(s + \\tilde\\delta + \\gamma))\\big)^{1/2}, \\qquad
        w^{(k)} = \\mu + \\sigma \\odot \\epsilon^{(k)} \\quad (k = 1..K) \\\\
    \\hat g &= \\frac1K\\sum_k \\frac1M\\sum_i g_i^{(k)}, \\qquad
        \\hat h = \\frac1K\\sum_k \\frac1M\\sum_i \\big(g_i^{(k)}\\big)^2 \\quad
        \\text{(lines 10–16; all-reduced across processes)} \\\\
    m &\\leftarrow \\beta_1 m + (\\hat g + \\tilde\\delta \\mu) \\quad \\text{(line 17)} \\\\
    s &\\leftarrow (1 - \\tau\\beta_2)\\, s + \\beta_2 \\hat h \\quad \\text{(line 18)} \\\\
    \\mu &\\leftarrow \\mu - \\alpha\\, m / (s + \\tilde\\delta + \\gamma) \\quad \\text{(line 19, with the new s)}

``g_i`` is example ``i``'s gradient of the per-example loss ℓ (the closure's loss must be
the batch mean, or the sum with ``loss_reduction="sum"``); ``ĥ`` comes from one backward
per sample through :mod:`mcgraph.optim.per_example` (no batch-size-1 loop).

Paper vs the released code (torchsso): this class follows the paper. ``variant="torchsso"``
switches to the code's two differences, which matter only while τ ≠ 1 (a tempering
warm-up): the noise variance is ``τ/(N(s + δ̃ + γ))`` and the curvature average is
``(1 − β₂)s + β₂ĥ`` (no τ). Other choices, in the code's favour where the paper is silent:

* ``init_precision=None``: ``s`` starts at ``ĥ`` of one extra pass through the first
  minibatch at μ (no update), as the authors describe; a number initialises ``s`` to it.
* BatchNorm parameters are deterministic (never sampled) and, unless ``batchnorm_prior``,
  have no prior: their update is the OGN step above with ``δ̃ = 0`` (as the seed's ResNets).
* The tempering schedule is the code's linear warm-up of τ from ``tempering_init`` to
  ``tempering`` over ``tempering_warmup_steps`` steps.
* Noise is drawn from its own seeded generators (torch's global generator is never
  reseeded, unlike torchsso): sample ``k`` of draw ``t`` is reproducible from ``seed`` alone.

**Defaults** (changed from ``lr=1e-4, damping=1e-3``, which left a 64-64-10 MLP on the 1 437
digits at chance: the first sample's σ ≈ 0.6 per weight): ``lr=1e-3`` and ``damping=3e-2``
bound the initial noise by ``σ ≤ 1/√(δ + Nγ)`` (0.15 for N = 1 437, 0.024 for N = 60 000) and
train that MLP to ≥ 95 % in 20 epochs with only ``dataset_size`` given. No damping serves every
N: on the first step (when ``init_precision`` is ``None``, so the loss at μ is known) VOGN raises a
``RuntimeError`` with advice when the loss at the first weight sample is more than twice the loss
at μ, i.e. when the posterior noise swamps the network and training would end near chance
(``check_noise=False`` turns the check off).

A step whose gradients, curvature or new state are not finite is skipped with a
``RuntimeWarning``; parameters and state are left unchanged (:attr:`skipped_steps`).

**Many samples per step.** :meth:`VOGN.step` runs the closure once per sample (ĝ and ĥ from module
hooks, :class:`~mcgraph.optim.SquaredGradients`). :meth:`VOGN.step_samples` takes a loss function instead
(the loss without ``backward()``) and evaluates the K samples together, as
:meth:`mcgraph.optim.IVON.step_samples` does: the weight samples are stacked along a leading axis and one
``torch.func.vmap(grad(...))`` forward and backward per chunk gives every sample's gradient; ĥ comes from
zero probes added to each layer's output, whose gradients are the layer's per-example output gradients
(:mod:`mcgraph.optim.batched_samples`). The same noise and the same step as :meth:`step`, to float
rounding; models vmap refuses (BatchNorm in training mode) fall back to the closure path. With
``process_group`` and ``parallel="samples"`` the K samples are spread over the ranks (both paths).

Example:
    >>> import torch, torch.nn.functional as F, mcgraph as mg
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    >>> x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    >>> opt = mg.optim.VOGN(net, dataset_size=64, lr=1e-2, num_samples=2, seed=0)
    >>> def closure():
    ...     opt.zero_grad()
    ...     loss = F.cross_entropy(net(x), y)
    ...     loss.backward()
    ...     return loss
    >>> for _ in range(3):
    ...     loss = opt.step(closure)
    >>> q = opt.posterior                       # {"0.weight": Normal(μ, σ), ...}
    >>> probs = mg.nn.predict(opt.posterior_model(), x, num_samples=10, seed=0)
    >>> probs.shape
    torch.Size([64, 3])
"""

from __future__ import annotations

import enum
import math
import warnings
from typing import Callable

import torch
from torch import nn

from ..engine.checks import all_finite
from . import cpu_kernels, updates
from ._checks import non_negative_real, positive_int, positive_real, real_in
from .gaussian import GaussianVariationalOptimizer, renamed_sample_count
from .choices import LossReduction, Parallel

__all__ = ["VOGN", "VOGNVariant"]


class VOGNVariant(str, enum.Enum):
    """Where τ enters (differs between the paper and torchsso only while τ ≠ 1)."""

    PAPER = "paper"  #: σ² = 1/(N(s + δ̃ + γ)), s ← (1 − τβ₂)s + β₂ĥ (seed 003, Algorithm 1)
    TORCHSSO = "torchsso"  #: σ² = τ/(N(s + δ̃ + γ)), s ← (1 − β₂)s + β₂ĥ (the released code)

    def __str__(self) -> str:
        return self.value


class VOGN(GaussianVariationalOptimizer):
    """Variational Online Gauss–Newton (see the module docstring for the update).

    Args:
        model: the network (``Linear``, ``Conv1d/2d/3d``, ``LSTM``, ``BatchNorm*``; parameter-free modules
            anywhere). Its parameters hold μ between steps.
        dataset_size: N, the number of training examples.
        lr: α.
        betas: ``(β₁, β₂)``: momentum and the curvature average's rate (weight on the new ĥ).
        prior_precision: δ of the prior ``N(0, I/δ)``.
        damping: γ ≥ 0, the external damping.
        tempering: τ > 0 (after the warm-up).
        tempering_init: τ at step 1 of a linear warm-up (default: no warm-up).
        tempering_warmup_steps: length of that warm-up in steps.
        num_samples: K ≥ 1 weight samples per step.
        data_augmentation_factor: ρ > 0 (``N ← ρN``).
        init_precision: initial ``s`` (default: ``ĥ`` of the first minibatch).
        variant: ``"paper"`` (default) or ``"torchsso"`` (:class:`VOGNVariant`).
        batchnorm_prior: give BatchNorm parameters the prior too.
        loss_reduction: ``"mean"`` or ``"sum"`` (how the closure's loss reduces the batch).
        seed: noise seed (``None``: drawn from torch's global generator).
        spike_slab: a :class:`~mcgraph.optim.SpikeSlabEM` (per-element prior precision and pruning).
        check_noise: on the first step (when ``init_precision`` is ``None``), raise if the loss at the
            first weight sample is more than twice the loss at μ (see "Defaults" above).
        process_group, parallel: all-reduce ĝ, ĥ and the loss over a ``torch.distributed`` group,
            ``"data"`` (averaged over batch shards) or ``"samples"`` (the K samples split by index);
            see :mod:`mcgraph.optim.gaussian`.
        fused: how the noise variance and the update are computed on CPU parameters. ``None``
            (default): compiled loops (:mod:`mcgraph.optim.cpu_kernels`, built by the C++ compiler at
            the first step, about a second once per machine) where a parameter is contiguous float32
            or float64 on the CPU, its prior term is a number and no pruning mask applies, and a
            compiler is found; else torch's operations. ``True``: the same, raising at construction
            when the kernels cannot be built. ``False``: torch's operations. Both give the same numbers
            bit for bit.
        num_mc_samples: the deprecated name of ``num_samples`` (warns).

    Raises:
        TypeError: an unsupported layer owns parameters, or ``model`` is not a module.
        ValueError: a hyperparameter out of range (named in the message).
    """

    def __init__(self, model: nn.Module, dataset_size: int, lr: float = 1e-3, betas=(0.9, 0.999),
                 prior_precision: float = 1.0, damping: float = 3e-2, tempering: float = 1.0,
                 tempering_init: float | None = None, tempering_warmup_steps: int = 0, num_samples: int = 1,
                 data_augmentation_factor: float = 1.0, init_precision: float | None = None,
                 variant: str | VOGNVariant = VOGNVariant.PAPER, batchnorm_prior: bool = False,
                 loss_reduction: str | LossReduction = "mean", seed: int | None = None, spike_slab=None,
                 process_group=None, parallel: str | Parallel = "data", check_noise: bool = True,
                 fused: bool | None = None, num_mc_samples: int | None = None) -> None:
        self.fused = cpu_kernels.checked_fused(fused, "VOGN kernels")
        self.check_noise = bool(check_noise)
        self._vmap_refused = False  # step_samples found a layer vmap cannot batch: later calls take step()
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        try:
            variant = VOGNVariant(variant)
        except ValueError:
            raise ValueError(f"variant must be one of {[v.value for v in VOGNVariant]}, got {variant!r}") from None
        if isinstance(tempering_warmup_steps, bool) or not isinstance(tempering_warmup_steps, int) \
                or tempering_warmup_steps < 0:
            raise ValueError(f"tempering_warmup_steps must be an int >= 0, got {tempering_warmup_steps!r}")
        defaults = {
            "lr": positive_real("lr", lr),
            "betas": (real_in("betas[0]", betas[0], 0.0, 1.0, high_open=True),
                      real_in("betas[1]", betas[1], 0.0, 1.0, low_open=True)),
            "prior_precision": non_negative_real("prior_precision", prior_precision),
            "damping": non_negative_real("damping", damping),
            "tempering": positive_real("tempering", tempering),
            "tempering_init": None if tempering_init is None else positive_real("tempering_init", tempering_init),
            "tempering_warmup_steps": tempering_warmup_steps,
            "data_augmentation_factor": positive_real("data_augmentation_factor", data_augmentation_factor),
            "init_precision": None if init_precision is None else non_negative_real("init_precision", init_precision),
            "variant": variant.value,
        }
        num_samples = renamed_sample_count("VOGN", num_samples, num_mc_samples)
        super().__init__(model, dataset_size, defaults, num_samples=num_samples, seed=seed,
                         loss_reduction=loss_reduction, batchnorm_prior=batchnorm_prior,
                         spike_slab=spike_slab, process_group=process_group, parallel=parallel)
        if init_precision is not None:
            for p, _ in self._flat():
                self.state[p]["precision"] = torch.full_like(p, float(init_precision))
            self.counters["initialized"] = True

    def _compiled(self, *tensors) -> bool:
        """Whether the compiled kernels take these tensors together (see ``fused``)."""
        return self.fused is not False and cpu_kernels.fits(*tensors) and cpu_kernels.library() is not None

    # ------------------------------------------------------------------ schedule and scales

    def tempering_at(self, group: dict, step: int) -> float:
        """τ at (1-based) ``step``: the linear warm-up, then ``tempering``."""
        final, init, steps = group["tempering"], group["tempering_init"], group["tempering_warmup_steps"]
        if init is None or steps == 0 or step >= steps:
            return final
        return init + (final - init) * (step - 1) / steps

    def _n(self, group: dict) -> float:
        return self.dataset_size * group["data_augmentation_factor"]

    def _delta_tilde(self, p, group: dict, tau: float):
        """δ̃ = τδ/N (δ per element under a spike-and-slab prior)."""
        return self._prior_precision(p, group) * (tau / self._n(group))

    def _sigmas(self) -> list[torch.Tensor | None]:
        out = []
        step = self.counters["step"] + 1
        for p, group in self._flat():
            state = self.state[p]
            if not group["sample"] or "precision" not in state:
                out.append(None if not group["sample"] else torch.zeros_like(p))
                continue
            tau = self.tempering_at(group, step)
            delta = self._delta_tilde(p, group, tau)
            torchsso = group["variant"] == VOGNVariant.TORCHSSO
            if not isinstance(delta, torch.Tensor) and self._compiled(state["precision"]):
                var = cpu_kernels.vogn_variance_(state["precision"], delta=delta, damping=group["damping"],
                                                 size=self._n(group), tau=tau if torchsso else None)
            else:
                var = 1.0 / (self._n(group) * (state["precision"] + delta + group["damping"]))
                if torchsso:
                    var = var * tau
            sigma = var.sqrt_()
            mask = self._mask(p)
            out.append(sigma if mask is None else sigma * mask)
        return out

    def _check_noise(self, at_mean: float, sampled: float) -> None:
        """Raise when the first weight sample more than doubles the loss (the noise swamps the network)."""
        if not (math.isfinite(at_mean) and math.isfinite(sampled)) or at_mean <= 0 or sampled <= 2.0 * at_mean:
            return
        group = self.param_groups[0]
        floor = (self._n(group) * (group["prior_precision"] * group["tempering"] / self._n(group) + group["damping"]))
        raise RuntimeError(
            f"VOGN: the loss at the first weight sample is {sampled:.4g}, {sampled / at_mean:.1f}x the loss "
            f"{at_mean:.4g} at the mean: the posterior noise (initial σ up to 1/√(N(δ/N + γ)) = {floor ** -0.5:.3g} "
            f"per weight with N = {self._n(group):g}, δ = {group['prior_precision']:g}, γ = {group['damping']:g}) "
            "swamps the network, and training would end near chance. Raise damping (γ) or prior_precision (δ), "
            "lower tempering, or pass init_precision; check_noise=False turns this check off")

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One VOGN step: K sampled closures, then Algorithm 1 lines 17–19. Returns the mean loss.

        The closure zeroes nothing it does not own, calls the model, computes the loss
        (mean over the batch) and calls ``backward()``; it is called ``K`` times (``K + 1``
        on the first step when ``init_precision`` is ``None``).
        """
        return self._step(closure, lambda sigmas, draw: self._collect(closure, sigmas, self.num_samples, draw,
                                                                     curvature=True))

    def step_samples(self, loss_fn: Callable[[], torch.Tensor], *, vectorize: bool | None = None,
                     chunk_size: int | None = None) -> torch.Tensor:
        """One VOGN step from K weight samples evaluated together; returns their mean loss.

        ``loss_fn()`` calls the model and returns the batch's loss (mean, or sum with
        ``loss_reduction="sum"``) **without** calling ``backward()``. With ``vectorize`` (default: when
        K > 1 and the model allows it) the samples run ``chunk_size`` at a time as one batched forward
        and backward each (``torch.func.vmap`` over the stacked weight samples; the per-example squared
        gradients from zero probes on the layers' outputs, see :mod:`mcgraph.optim.batched_samples`).
        Otherwise, or when vmap refuses the model (BatchNorm in training mode, a layer called twice per
        forward) and ``vectorize`` is ``None``, the step is :meth:`step` with a closure around
        ``loss_fn`` (a refusal found in the batched pass is remembered: later calls take :meth:`step` at
        once). Both give the same step on the same noise, up to float rounding.

        Memory: a chunk of S samples holds S stacked weight samples and their gradients (about
        ``2·S·P`` numbers) beside S times the batch's activations.

        Args:
            loss_fn: the loss of the current batch through the model's forward.
            vectorize: ``True`` (vmap or raise), ``False`` (one closure call per sample), ``None``
                (vmap when K > 1 and possible).
            chunk_size: samples per batched pass (default: all K while ``K·P`` ≤ 2²⁴ numbers, 2²⁶ on
                CUDA, else as many as fit: :func:`~mcgraph.optim.batched_samples.default_chunk_size`).

        Raises:
            mcgraph.optim.batched_samples.Unbatchable: ``vectorize=True`` and vmap cannot run the model.

        Example:
            >>> import torch, torch.nn.functional as F, mcgraph as mg
            >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
            >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
            >>> opt = mg.optim.VOGN(net, dataset_size=16, num_samples=8, seed=0)
            >>> loss = opt.step_samples(lambda: F.cross_entropy(net(x), y))
        """
        from .batched_samples import Unbatchable, check_batchable

        if chunk_size is not None:
            chunk_size = positive_int("chunk_size", chunk_size)

        def closure():
            loss = loss_fn()
            loss.backward()
            return loss

        if vectorize is False or (vectorize is None and (self.num_samples == 1 or self._vmap_refused)):
            return self.step(closure)
        try:
            check_batchable(self.model)  # before the initialisation pass runs the model once
        except Unbatchable:
            if vectorize:
                raise
            return self.step(closure)
        counters = dict(self.counters)
        precision = {p: self.state[p].get("precision") for p, _ in self._flat()}
        buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        try:
            return self._step(closure, lambda sigmas, draw: self._collect_batched(
                loss_fn, sigmas, self.num_samples, draw, chunk_size))
        except Unbatchable:
            if vectorize:
                raise
            self._vmap_refused = True
        # nothing was committed: forget the initialisation pass, if any, and take the step sample by sample
        self.counters.update(counters)
        for n, b in self.model.named_buffers():
            b.copy_(buffers[n])
        for p, value in precision.items():
            if value is None:
                self.state[p].pop("precision", None)
            else:
                self.state[p]["precision"] = value
        return self.step(closure)

    @torch.no_grad()
    def _step(self, closure: Callable[[], torch.Tensor], collect) -> torch.Tensor:
        mean_loss = None
        if not self.counters["initialized"]:
            mean_loss, _, h = self._collect(closure, None, 1, self.counters["draws"], curvature=True)
            self.counters["draws"] += 1
            if not all_finite(h):
                self.counters["skipped"] += 1
                warnings.warn("VOGN: non-finite curvature in the initialisation pass; it will be retried at the "
                              "next step", RuntimeWarning, stacklevel=2)
                return torch.tensor(float("nan"))
            for (p, _), hi in zip(self._flat(), h):
                self.state[p]["precision"] = hi.clone()
            self.counters["initialized"] = True
        draw = self.counters["draws"]
        self.counters["draws"] += 1
        loss, g, h = collect(self._sigmas(), draw)
        if mean_loss is not None and self.check_noise:
            self._check_noise(float(mean_loss), float(loss))
        step = self.counters["step"] + 1
        tentative = []
        for (p, group), gi, hi in zip(self._flat(), g, h):
            state = self.state[p]
            beta1, beta2 = group["betas"]
            tau = self.tempering_at(group, step)
            delta = self._delta_tilde(p, group, tau)
            m = state.get("momentum")
            keep = 1.0 - (beta2 if group["variant"] == VOGNVariant.TORCHSSO else tau * beta2)
            mask = self._mask(p)
            if mask is None and not isinstance(delta, torch.Tensor) and self._compiled(
                    p, gi, hi, state["precision"], *([] if m is None else [m])):
                mu, m, s = cpu_kernels.vogn_update_(p.detach(), gi, hi, m, state["precision"], delta=delta,
                                                    beta1=beta1, keep=keep, beta2=beta2, lr=group["lr"],
                                                    damping=group["damping"])  # lines 17-19 in one pass
            else:  # lines 17-19 (the compiled pass above is their accelerator, equal bit for bit)
                mu, m, s = updates.vogn_step(p.detach(), gi, hi, m, state["precision"], delta=delta, beta1=beta1,
                                             keep=keep, beta2=beta2, lr=group["lr"], damping=group["damping"])
            if mask is not None:
                mu, m = mu * mask, m * mask
            tentative.append((p, {"param": mu, "momentum": m, "precision": s}))
        if self._commit_or_skip(tentative, "gradient, curvature or update"):
            self._apply_masks()
        return loss
