"""EM with a group spike-and-slab prior: train and prune in one shot (Ke & Fan, 2022 — seed 004, §3).

Each group ``β_g`` of ``m`` weights (a column of a Linear weight, a kernel slice of a
convolution, …) has the prior ``π N(0, v₁I) + (1 − π) N(0, v₀I)`` with ``v₀ < v₁``
(Xu & Ghosh, 2015). The decays are given on the mean-loss scale, ``e = 1/(N v)``:
``slab_decay`` ``e₁`` and ``spike_decay`` ``e₀ > e₁``. Inside any of the optimizers of
:mod:`mcgraph.optim` the MCMC-within-EM algorithm (Ročková & George, 2014) alternates

* **E-step** (:meth:`SpikeSlabEM.update`, once per epoch after ``warmup`` epochs): the
  group's inclusion probability

  .. math::
      p^*_g = \\frac{\\pi N(\\beta_g; 0, v_1 I)}{\\pi N(\\beta_g; 0, v_1 I) + (1-\\pi) N(\\beta_g; 0, v_0 I)}
      \\quad(``estep="probability"``, the paper's EM),

  or the released code's hard indicator ``p*_g = 1[mean(β_g²) ≥ soft_threshold]``
  (``estep="threshold"``). Rounding the probability to 0/1 is exactly a threshold on
  ``mean(β_g²)`` (:meth:`SpikeSlabEM.equivalent_threshold`).
* **M-step**: the weight decay of every weight of the group becomes
  ``p*_g e₁ + (1 − p*_g) e₀`` (:meth:`decay`; the prior precision ``N ×`` that for the
  Gaussian optimizers, :meth:`precision`): the optimizer's prior term switches between slab
  and spike.
* **Pruning**: groups whose statistic falls below ``hard_threshold`` are zeroed
  **permanently** (the continuous prior never gives exact zeros): ``mean(β_g²)`` (default;
  the code's Linear version) or its value range (``hard_statistic="range"``, the code's
  convolution version, which also zeroes a nearly constant group). Masks only ever lose
  entries, are applied to the weights after every step and survive ``state_dict``.

Groups per layer (one :class:`GroupSpec` per layer type, :func:`register_groups`):

============== ================================= =====================================
layer           EM groups                         pruning groups
============== ================================= =====================================
Linear          ``linear_groups="input"``: the    the same groups
                outgoing weights of an input unit
                (a column; the code's FC nets),
                ``"output"``: a neuron's incoming
                weights (a row; the code's GNN)
Conv1d/2d/3d    ``conv_groups="kernel"``: each    ``prune_conv="channels"``: whole
                ``(c_out, c_in)`` kernel slice    input channels and whole filters
                (the code); ``"filter"``,         (the code); ``"em"``: the EM groups
                ``"channel"``
============== ================================= =====================================

Biases, BatchNorm and excluded layers keep the optimizer's own (slab) prior.
:func:`mcgraph.optim.shrink` then removes dead neurons and filters physically.

Example:
    >>> import torch, mcgraph as mg
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3))
    >>> with torch.no_grad():
    ...     _ = net[0].weight.copy_(torch.tensor([[1., 0.01, 1., 0.]]).expand(3, 4))
    >>> em = mg.optim.SpikeSlabEM(net, dataset_size=100, estep="threshold", soft_threshold=0.5,
    ...                           hard_threshold=1e-3)
    >>> em.update(epoch=0)                                     # E-step, then pruning
    True
    >>> em.inclusion(net[0].weight).flatten().tolist()       # columns 0 and 2 in the slab
    [1.0, 0.0, 1.0, 0.0]
    >>> em.mask(net[0].weight)[0].tolist()                    # columns 1 and 3 pruned
    [1.0, 0.0, 1.0, 0.0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..registry import Registry
from ._checks import choice, non_negative_real, positive_real, real_in
from .choices import ConvGroups, EStep, HardStatistic, LinearGroups, PruneConv

__all__ = ["SpikeSlabEM", "GroupSpec", "register_groups", "GROUP_RULES", "ESTEPS"]

ESTEPS = tuple(e.value for e in EStep)


@dataclass(frozen=True)
class GroupSpec:
    """How one weight tensor is cut into groups.

    Attributes:
        em_dims: the dims reduced to form an EM group (the statistic keeps the others).
        prune_dims: one tuple of reduced dims per pruning grouping (each grouping prunes on its own).
    """

    em_dims: tuple[int, ...]
    prune_dims: tuple[tuple[int, ...], ...]


GROUP_RULES: Registry = Registry("spike-and-slab group rule", by_type=True)
"""Layer type → ``rule(module, options) -> GroupSpec`` for its weight."""


def register_groups(*module_types: type):
    """Register ``rule(module, options: dict) -> GroupSpec`` for ``module_types`` (decorator)."""

    def decorator(rule):
        for t in module_types:
            GROUP_RULES.register(t, rule)
        return rule

    return decorator


def _rule_for(module: nn.Module):
    return GROUP_RULES.lookup(type(module), None)


@register_groups(nn.Linear)
def _linear_groups(module: nn.Linear, options: dict) -> GroupSpec:
    dims = (0,) if options["linear_groups"] == "input" else (1,)
    return GroupSpec(dims, (dims,))


@register_groups(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def _conv_groups(module: nn.modules.conv._ConvNd, options: dict) -> GroupSpec:
    spatial = tuple(range(2, 2 + len(module.kernel_size)))
    em = {"kernel": spatial, "filter": (1,) + spatial, "channel": (0,) + spatial}[options["conv_groups"]]
    prune = (((0,) + spatial, (1,) + spatial) if options["prune_conv"] == "channels" else (em,))
    return GroupSpec(em, prune)


class SpikeSlabEM:
    """Group spike-and-slab prior with EM decay switching and permanent pruning (see the module docstring).

    Args:
        model: the network; the weights of its ``Linear``/``Conv`` layers (minus ``exclude``) are grouped.
        dataset_size: N (converts decays to variances: ``v = 1/(N e)``).
        slab_decay: e₁ (mean-loss scale).
        spike_decay: e₀ > e₁.
        prior_inclusion: π ∈ (0, 1) of the probability E-step.
        estep: ``"probability"`` (default) or ``"threshold"`` (the code's); a :class:`~mcgraph.optim.EStep`
            or its string, as are the four options below (:mod:`mcgraph.optim.choices`).
        soft_threshold: the threshold E-step's bound on ``mean(β_g²)``.
        hard_threshold: groups whose statistic is below it are pruned.
        hard_statistic: ``"mean_square"`` (default) or ``"range"``.
        linear_groups: ``"input"`` (default) or ``"output"``.
        conv_groups: ``"kernel"`` (default), ``"filter"`` or ``"channel"``.
        prune_conv: ``"channels"`` (default: input channels and filters) or ``"em"``.
        warmup: epochs before the first E-step and pruning (the code's ``warm_up``).
        exclude: qualified names of layers left out (e.g. the output layer).

    Raises:
        ValueError: a bad option (named), or no layer to group.
    """

    def __init__(self, model: nn.Module, dataset_size: int, *, slab_decay: float = 5e-4, spike_decay: float = 1e-1,
                 prior_inclusion: float = 0.5, estep: str | EStep = "probability", soft_threshold: float = 1e-2,
                 hard_threshold: float = 1e-3, hard_statistic: str | HardStatistic = "mean_square", linear_groups: str | LinearGroups = "input",
                 conv_groups: str | ConvGroups = "kernel", prune_conv: str | PruneConv = "channels", warmup: int = 0,
                 exclude=()) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if isinstance(dataset_size, bool) or not isinstance(dataset_size, (int, float)) or not dataset_size > 0:
            raise ValueError(f"dataset_size must be > 0, got {dataset_size!r}")
        self.dataset_size = dataset_size
        self.slab_decay = positive_real("slab_decay", slab_decay)
        self.spike_decay = positive_real("spike_decay", spike_decay)
        if self.spike_decay <= self.slab_decay:
            raise ValueError(f"spike_decay must be > slab_decay (the spike is the narrower prior), got "
                             f"spike_decay={spike_decay!r}, slab_decay={slab_decay!r}")
        self.prior_inclusion = real_in("prior_inclusion", prior_inclusion, 0.0, 1.0, low_open=True, high_open=True)
        self.estep = choice("estep", estep, EStep)
        self.soft_threshold = non_negative_real("soft_threshold", soft_threshold)
        self.hard_threshold = non_negative_real("hard_threshold", hard_threshold)
        if math.isnan(self.hard_threshold):
            raise ValueError("hard_threshold must not be NaN")
        self.hard_statistic = choice("hard_statistic", hard_statistic, HardStatistic)
        options = {"linear_groups": choice("linear_groups", linear_groups, LinearGroups),
                   "conv_groups": choice("conv_groups", conv_groups, ConvGroups),
                   "prune_conv": choice("prune_conv", prune_conv, PruneConv)}
        self.options = options
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0 (epochs), got {warmup!r}")
        self.warmup = warmup
        if isinstance(exclude, str):
            exclude = (exclude,)
        names = {n for n, _ in model.named_modules()}
        unknown = sorted(set(exclude) - names)
        if unknown:
            raise ValueError(f"exclude: no modules named {unknown} in the model")
        self.specs: dict[str, GroupSpec] = {}
        self.params: dict[str, nn.Parameter] = {}
        for name, module in model.named_modules():
            rule = _rule_for(module)
            if rule is None or name in exclude or getattr(module, "weight", None) is None:
                continue
            if not module.weight.requires_grad:
                continue
            key = f"{name}.weight" if name else "weight"
            self.specs[key] = rule(module, options)
            self.params[key] = module.weight
        if not self.params:
            raise ValueError("model: no Linear or Conv layer to put a spike-and-slab prior on")
        self._by_id = {id(p): k for k, p in self.params.items()}
        self.inclusions: dict[str, torch.Tensor] = {}
        self.masks: dict[str, torch.Tensor] = {k: torch.ones_like(p) for k, p in self.params.items()}
        self.epochs_done = 0

    # ------------------------------------------------------------------ the prior

    @property
    def slab_variance(self) -> float:
        return 1.0 / (self.dataset_size * self.slab_decay)

    @property
    def spike_variance(self) -> float:
        return 1.0 / (self.dataset_size * self.spike_decay)

    def equivalent_threshold(self, group_size: int) -> float:
        """The bound on ``mean(β_g²)`` above which ``p*_g > ½`` for a group of ``group_size`` weights.

        .. math::
            c = \\frac{2 v_0 v_1}{v_1 - v_0}\\Big(\\tfrac12\\log\\frac{v_1}{v_0}
                + \\frac1m\\log\\frac{1-\\pi}{\\pi}\\Big)
        """
        v0, v1, pi = self.spike_variance, self.slab_variance, self.prior_inclusion
        return 2 * v0 * v1 / (v1 - v0) * (0.5 * math.log(v1 / v0) + math.log((1 - pi) / pi) / group_size)

    def _key(self, p: torch.Tensor) -> str | None:
        return self._by_id.get(id(p))

    def inclusion(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p*`` of every group of weight ``p`` (keepdim shape; all ones before the first E-step)."""
        key = self._key(p)
        if key is None:
            return None
        found = self.inclusions.get(key)
        if found is None:
            dims = self.specs[key].em_dims
            shape = [1 if d in dims else s for d, s in enumerate(p.shape)]
            return torch.ones(shape, dtype=p.dtype, device=p.device)
        return found

    def decay(self, p: torch.Tensor) -> torch.Tensor | None:
        """The per-element decay ``p* e₁ + (1 − p*) e₀`` of ``p`` (mean-loss scale), or ``None`` if not covered."""
        incl = self.inclusion(p)
        if incl is None:
            return None
        return (incl * self.slab_decay + (1 - incl) * self.spike_decay).expand_as(p)

    def precision(self, p: torch.Tensor) -> torch.Tensor | None:
        """The per-element prior precision ``N × decay`` (full-data scale), or ``None`` if not covered."""
        d = self.decay(p)
        return None if d is None else d * self.dataset_size

    def mask(self, p: torch.Tensor) -> torch.Tensor | None:
        """The 0/1 pruning mask of ``p`` (``None`` if not covered)."""
        key = self._key(p)
        return None if key is None else self.masks[key]

    # ------------------------------------------------------------------ EM and pruning

    def _mean_square(self, w: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
        return w.square().mean(dim=dims, keepdim=True)

    @torch.no_grad()
    def e_step(self) -> None:
        """Recompute every group's inclusion probability (or indicator) from the current weights."""
        v0, v1 = self.spike_variance, self.slab_variance
        log_prior_odds = math.log(self.prior_inclusion / (1 - self.prior_inclusion))
        for key, p in self.params.items():
            dims = self.specs[key].em_dims
            w = p.detach() * self.masks[key]
            mean_sq = self._mean_square(w, dims)
            if self.estep == "threshold":
                self.inclusions[key] = (mean_sq >= self.soft_threshold).to(p.dtype)
                continue
            m = math.prod(p.shape[d] for d in dims)
            # log N(β; 0, v1 I) − log N(β; 0, v0 I) = (m/2) log(v0/v1) + ‖β‖²/2 (1/v0 − 1/v1)
            log_odds = log_prior_odds + 0.5 * m * math.log(v0 / v1) + 0.5 * m * mean_sq * (1 / v0 - 1 / v1)
            self.inclusions[key] = torch.sigmoid(log_odds)

    @torch.no_grad()
    def prune(self) -> int:
        """Zero, permanently, the groups whose statistic is below ``hard_threshold``; returns the newly pruned count."""
        newly = 0
        for key, p in self.params.items():
            w = p.detach() * self.masks[key]
            keep = torch.ones_like(w, dtype=torch.bool)
            for dims in self.specs[key].prune_dims:
                if self.hard_statistic == "range":
                    stat = w.amax(dim=dims, keepdim=True) - w.amin(dim=dims, keepdim=True)
                else:
                    stat = self._mean_square(w, dims)
                keep = keep & (stat >= self.hard_threshold)
            before = int(self.masks[key].sum())
            self.masks[key] = self.masks[key] * keep.to(p.dtype)
            newly += before - int(self.masks[key].sum())
        self.apply_masks()
        return newly

    def update(self, epoch: int) -> bool:
        """Once per epoch (before its first step): after ``warmup`` epochs, the E-step then pruning.

        Returns whether the E-step ran. ``epoch`` is 0-based; E-steps start at ``epoch == warmup``.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self.epochs_done = max(self.epochs_done, epoch)
        if epoch < self.warmup:
            return False
        self.e_step()
        self.prune()
        return True

    @torch.no_grad()
    def apply_masks(self) -> None:
        """Zero the pruned entries of every covered weight (in place)."""
        for key, p in self.params.items():
            p.mul_(self.masks[key])

    # ------------------------------------------------------------------ reports and state

    def sparsity(self) -> dict:
        """Per layer and overall: pruned fraction of the covered weights, and surviving groups.

        For a Linear layer with ``linear_groups="input"`` ``kept_inputs`` lists the input
        units whose column survives (the selected features of a first layer).
        """
        layers, total, pruned = {}, 0, 0
        for key, p in self.params.items():
            mask = self.masks[key]
            n, z = mask.numel(), int((mask == 0).sum())
            total, pruned = total + n, pruned + z
            row = {"weights": n, "pruned": z, "sparsity": z / n}
            if p.dim() == 2 and self.options["linear_groups"] == "input":
                row["kept_inputs"] = torch.nonzero(mask.amax(0) > 0).flatten().tolist()
            layers[key] = row
        return {"layers": layers, "weights": total, "pruned": pruned, "sparsity": pruned / total if total else 0.0}

    def state_dict(self) -> dict:
        """Masks, inclusion probabilities and the epoch counter, keyed by parameter name."""
        return {"masks": {k: v.clone() for k, v in self.masks.items()},
                "inclusions": {k: v.clone() for k, v in self.inclusions.items()},
                "epochs_done": self.epochs_done}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s content (and zero the pruned weights)."""
        masks = state["masks"]
        if set(masks) != set(self.masks):
            raise ValueError(f"state: masks for {sorted(masks)}, expected {sorted(self.masks)}")
        for k, v in masks.items():
            if tuple(v.shape) != tuple(self.params[k].shape):
                raise ValueError(f"state: mask {k!r} has shape {tuple(v.shape)}, the weight {tuple(self.params[k].shape)}")
            self.masks[k] = v.to(self.params[k])
        self.inclusions = {k: v.to(self.params[k]) for k, v in state.get("inclusions", {}).items()}
        self.epochs_done = int(state.get("epochs_done", 0))
        self.apply_masks()
