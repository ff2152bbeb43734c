"""Pruning Bayesian layers: by log α (sparse VD, ARD) or by the L1 norm of the means (Bayes by Backprop).

:func:`prune` zeroes every weight whose log α = log σ² − log μ² exceeds a threshold (default 3,
i.e. a dropout rate α/(1+α) above 95 %), in the layers whose KL is *sparsifying* (posterior
``"sparse_vd"`` or prior ``"ard"``, see :func:`mcgraph.nn.register_layer_kl`). :func:`prune_l1`
zeroes the weights with the smallest |μ| in any Bayesian layer, by threshold or by fraction
(Shridhar et al.'s pruning of trained Bayesian CNNs). Both return a :class:`SparsityReport`:
per-layer sparsity and the compression ratio |W| / |W≠0| (weights only, as the sparsification
tables count them; biases stay dense).

A pruned weight is the constant 0 in every forward (μ = σ = 0; :mod:`mcgraph.nn.masks`): the
network can still be sampled, and :func:`mcgraph.nn.freeze` runs it deterministically on the masked
means — the compact network of the sparsification literature (no ensembling). Masks are buffers,
so they are saved and loaded with ``state_dict``. Pruning again replaces the masks (the criterion is
evaluated on the stored, unmasked parameters).

Example:
    >>> import torch, mcgraph as mg
    >>> net = mg.nn.bayesify(mg.models.get_model("lenet300_100", image_size=8), posterior="sparse_vd")
    >>> report = mg.nn.prune(net, threshold=float("inf"))     # nothing is above +∞
    >>> report.compression, len(report.layers)
    (1.0, 3)
    >>> mg.nn.prune(net, threshold=-float("inf")).kept        # everything above −∞: all pruned
    0
    >>> _ = mg.nn.freeze(net)                                 # deterministic forward on the masked means
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import nn

from .context import bayesian_modules
from .layer_kl import is_sparsifying
from .masks import apply_mask, unmasked_posterior, weight_mask

__all__ = ["LayerSparsity", "SparsityReport", "prune", "prune_l1", "sparsity", "layer_log_alpha"]


@dataclass(frozen=True)
class LayerSparsity:
    """One layer's weights: ``total`` of them, ``kept`` nonzero."""

    name: str
    total: int
    kept: int

    @property
    def sparsity(self) -> float:
        """Fraction of weights that are zero."""
        return 1.0 - self.kept / self.total if self.total else 0.0


@dataclass(frozen=True)
class SparsityReport:
    """Per-layer and overall sparsity of a model's Bayesian layers (weights only)."""

    layers: tuple

    @property
    def total(self) -> int:
        return sum(layer.total for layer in self.layers)

    @property
    def kept(self) -> int:
        return sum(layer.kept for layer in self.layers)

    @property
    def sparsity(self) -> float:
        """Fraction of all weights that are zero."""
        return 1.0 - self.kept / self.total if self.total else 0.0

    @property
    def compression(self) -> float:
        """|W| / |W≠0| (``inf`` when every weight is zero)."""
        return self.total / self.kept if self.kept else math.inf

    def per_layer(self) -> str:
        """The sparsity per layer in percent, as the tables print it (``"98.9 – 97.2 – 62.0"``)."""
        return " – ".join(f"{100 * layer.sparsity:.1f}" for layer in self.layers)

    def __str__(self) -> str:
        lines = [f"{'layer':<28} {'weights':>10} {'nonzero':>10} {'sparsity':>9}"]
        lines += [f"{layer.name:<28} {layer.total:>10} {layer.kept:>10} {100 * layer.sparsity:>8.1f}%"
                  for layer in self.layers]
        lines.append(f"{'total':<28} {self.total:>10} {self.kept:>10} {100 * self.sparsity:>8.1f}%  "
                     f"compression {self.compression:.1f}x")
        return "\n".join(lines)


def _named_layers(model: nn.Module):
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    ids = {id(m) for m in bayesian_modules(model)}
    return [(name or type(m).__name__, m) for name, m in model.named_modules() if id(m) in ids]


@torch.no_grad()
def sparsity(model: nn.Module) -> SparsityReport:
    """The :class:`SparsityReport` of ``model`` as it is: nonzero posterior means of every Bayesian layer."""
    return SparsityReport(tuple(LayerSparsity(name, m.weight_mu.numel(), int(torch.count_nonzero(m.weight_mu)))
                                for name, m in _named_layers(model)))


def layer_log_alpha(layer: nn.Module) -> torch.Tensor:
    """log α = log σ² − log μ² of every weight of a Gaussian-posterior layer (from the stored parameters).

    Raises:
        ValueError: the posterior is not location-scale (has no ``loc`` / ``scale``).
    """
    q = unmasked_posterior(layer)
    if not (hasattr(q, "loc") and hasattr(q, "scale")):
        raise ValueError(f"layer: log α needs a Gaussian posterior with loc and scale, got {type(q).__name__}")
    mu, sigma = q.loc, q.scale
    return 2 * torch.log(sigma) - torch.log(mu * mu + torch.finfo(mu.dtype).tiny)


def _check_threshold(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN")
    return value


@torch.no_grad()
def prune(model: nn.Module, threshold: float = 3.0) -> SparsityReport:
    """Zero every weight with log α > ``threshold`` in the sparsifying layers of ``model`` (in place).

    .. math::
        w_{ij} \\leftarrow 0 \\quad\\text{where}\\quad \\log\\alpha_{ij} = \\log\\sigma^2_{ij} - \\log\\mu^2_{ij}
        > \\text{threshold}

    Args:
        model: a network with sparse-VD or ARD layers (other Bayesian layers are left as they are).
        threshold: log α above which a weight is removed (3: dropout rate > 95 %). ``+inf`` prunes
            nothing, ``-inf`` everything.

    Returns:
        The :class:`SparsityReport` of the pruned layers.

    Raises:
        ValueError: ``threshold`` is NaN, or ``model`` has no sparsifying layer (say which to use).
        TypeError: ``threshold`` is not a real number.
    """
    threshold = _check_threshold("threshold", threshold)
    layers = [(name, m) for name, m in _named_layers(model) if is_sparsifying(m)]
    if not layers:
        raise ValueError("model: has no sparse layers to prune by log α (build them with posterior='sparse_vd' "
                         "or prior='ard'; mg.nn.prune_l1 prunes any Bayesian layer by |μ|)")
    for _, m in layers:
        apply_mask(m, ~(layer_log_alpha(m) > threshold))
    return SparsityReport(tuple(LayerSparsity(name, m.weight_mu.numel(), int(torch.count_nonzero(m.weight_mu)))
                                for name, m in layers))


@torch.no_grad()
def prune_l1(model: nn.Module, *, threshold: float | None = None, fraction: float | None = None) -> SparsityReport:
    """Zero the weights of smallest |μ| in every Bayesian layer of ``model`` (in place).

    Exactly one of:

    * ``threshold``: remove weights with |μ| ≤ threshold;
    * ``fraction``: remove the ``fraction`` of all weights (pooled over layers) with the smallest |μ|.

    Args:
        model: a network with Bayesian layers.
        threshold: a non-negative |μ| cut-off.
        fraction: in [0, 1].

    Returns:
        The :class:`SparsityReport` of every Bayesian layer.

    Raises:
        ValueError: both or neither of ``threshold`` and ``fraction``; NaN, negative or out-of-range values;
            no Bayesian layer.

    Example:
        >>> import torch, mcgraph as mg
        >>> net = mg.nn.bayesify(mg.models.get_model("lenet5", width=0.5))
        >>> round(mg.nn.prune_l1(net, fraction=0.5).sparsity, 3)
        0.5
    """
    if (threshold is None) == (fraction is None):
        raise ValueError("give exactly one of threshold and fraction")
    layers = _named_layers(model)
    if not layers:
        raise ValueError("model: has no Bayesian layers to prune (convert it with mg.nn.bayesify)")
    mus = [unmasked_posterior(m).mean.abs() for _, m in layers]
    if threshold is not None:
        cut = _check_threshold("threshold", threshold)
        if cut < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold!r}")
        masks = [mu > cut for mu in mus]
    else:
        frac = _check_threshold("fraction", fraction)
        if not 0.0 <= frac <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
        flat = torch.cat([mu.flatten() for mu in mus])
        k = int(round(frac * flat.numel()))
        keep = torch.ones_like(flat, dtype=torch.bool)
        if k:
            keep[torch.argsort(flat, stable=True)[:k]] = False
        masks = list(torch.split(keep, [mu.numel() for mu in mus]))
        masks = [mk.reshape(mu.shape) for mk, mu in zip(masks, mus)]
    for (_, m), mask in zip(layers, masks):
        apply_mask(m, mask)
    return sparsity(model)


def is_pruned(layer: nn.Module) -> bool:
    """Whether the layer carries a weight mask."""
    return weight_mask(layer) is not None
