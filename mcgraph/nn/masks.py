"""Weight masks of Bayesian layers: pruned weights are the constant 0 in every forward.

A mask is a boolean tensor of the weight's shape (``True``: kept). :func:`apply_mask` registers
it as a ``torch.nn.utils.parametrize`` parametrization of ``weight_mu`` (μ ∘ m) and of
``weight_rho`` (ρ where kept, −∞ where pruned, so σ = t(ρ) = 0 for every scale transform), so
weight sampling, local reparameterization, flipout and the posterior-mean (``"mean"``) mode
all see the masked weights, and the stored parameters stay where they were
(``layer.parametrizations.weight_mu.original``). The masks are buffers: they are in
``state_dict()``, and a Bayesian layer loading a state dict that holds masks adopts them first,
so a fresh, unpruned model loads a pruned one's state dict as it is.

Example:
    >>> import torch, mcgraph as mg
    >>> from mcgraph.nn.masks import apply_mask, weight_mask
    >>> layer = mg.nn.BayesLinear(3, 2)
    >>> apply_mask(layer, torch.tensor([[True, False, True], [False, False, True]]))
    >>> int(weight_mask(layer).sum()), layer.weight_mu[0, 1].item() == 0, layer.weight_sigma[0, 1].item()
    (3, True, 0.0)
    >>> fresh = mg.nn.BayesLinear(3, 2)
    >>> _ = fresh.load_state_dict(layer.state_dict())
    >>> bool(torch.equal(weight_mask(fresh), weight_mask(layer)))
    True
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributions import Distribution
from torch.nn.utils import parametrize

__all__ = ["apply_mask", "weight_mask", "remove_mask", "unmasked_posterior", "adopt_masks"]

_KEY = "parametrizations.weight_mu.0.mask"


class _MaskMean(nn.Module):
    """μ ↦ μ ∘ m."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask.to(torch.bool).clone())

    def forward(self, mu: torch.Tensor) -> torch.Tensor:
        return mu * self.mask.to(mu.dtype)


class _MaskScale(nn.Module):
    """ρ ↦ ρ where kept, −∞ where pruned (σ = t(−∞) = 0 for softplus, exp and exp(·/2))."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask.to(torch.bool).clone())

    def forward(self, rho: torch.Tensor) -> torch.Tensor:
        return torch.where(self.mask, rho, torch.full((), -float("inf"), dtype=rho.dtype, device=rho.device))


def weight_mask(layer: nn.Module) -> torch.Tensor | None:
    """The layer's weight mask (``True``: kept), or ``None`` when it is not pruned."""
    if not parametrize.is_parametrized(layer, "weight_mu"):
        return None
    for p in layer.parametrizations.weight_mu:
        if isinstance(p, _MaskMean):
            return p.mask
    return None


def _raw(layer: nn.Module, name: str) -> torch.Tensor:
    if parametrize.is_parametrized(layer, name):
        return getattr(layer.parametrizations, name).original
    return getattr(layer, name)


def unmasked_posterior(layer: nn.Module) -> Distribution:
    """q(W) built from the stored parameters, ignoring the mask (differentiable in them)."""
    from .priors import unchecked

    mu, rho = _raw(layer, "weight_mu"), _raw(layer, "weight_rho")
    return unchecked(layer._posterior_factory, mu, layer.scale_transform(rho))


@torch.no_grad()
def apply_mask(layer: nn.Module, mask: torch.Tensor) -> None:
    """Prune ``layer``: weights where ``mask`` is ``False`` become 0 (μ = 0, σ = 0) in every forward.

    A layer that already has a mask gets the new one (masks do not accumulate: pass
    ``old & new`` to keep both).

    Raises:
        ValueError: ``mask`` is not shaped like the weight.
    """
    shape = tuple(_raw(layer, "weight_mu").shape)
    mask = torch.as_tensor(mask, device=_raw(layer, "weight_mu").device)
    if tuple(mask.shape) != shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} is not the weight shape {shape}")
    mask = mask.to(torch.bool)
    if weight_mask(layer) is not None:
        layer.parametrizations.weight_mu[0].mask.copy_(mask)
        layer.parametrizations.weight_rho[0].mask.copy_(mask)
        return
    parametrize.register_parametrization(layer, "weight_mu", _MaskMean(mask), unsafe=True)
    parametrize.register_parametrization(layer, "weight_rho", _MaskScale(mask), unsafe=True)


def remove_mask(layer: nn.Module) -> None:
    """Undo :func:`apply_mask`: the stored parameters become the layer's parameters again (unmasked)."""
    if weight_mask(layer) is None:
        return
    parametrize.remove_parametrizations(layer, "weight_mu", leave_parametrized=False)
    parametrize.remove_parametrizations(layer, "weight_rho", leave_parametrized=False)


def adopt_masks(layer: nn.Module, state_dict: dict, prefix: str) -> None:
    """Before ``layer`` loads ``state_dict``: register the mask it holds (if any and the layer has none)."""
    key = prefix + _KEY
    if key in state_dict and weight_mask(layer) is None:
        apply_mask(layer, state_dict[key])
