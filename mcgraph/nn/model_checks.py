"""Checks on the model and the batch that ``mg.nn``'s entry points run before they sample.

* A model holding another library's Bayesian layers (blitz, bayesian-torch, torchbnn,
  torch-uncertainty) that was not converted: ``mg.nn`` cannot see those layers, so their KL would
  be 0 and their weights would not be sampled. The error names the layer and the converter.
* A model with no Bayesian layer at all: ``kl`` and ``elbo`` would silently reduce to 0 and to a
  plain likelihood. The error says how to make it Bayesian.
* ``x`` / ``y`` of the wrong kind or shape: errors that name ``x`` or ``y`` and the shape expected,
  rather than an internal shape of the M·B repeated batch.

Example:
    >>> import torch, mcgraph as mg
    >>> mg.nn.kl(torch.nn.Linear(3, 2))
    Traceback (most recent call last):
    ...
    ValueError: mg.nn.kl: model has no Bayesian layer, so its KL would be 0. Make it Bayesian first: model = mg.nn.bayesify(model, ...) (or a partial conversion with skip=)
"""

from __future__ import annotations

import torch
from torch import nn

from .context import BayesianModule

__all__ = ["FOREIGN_LIBRARIES", "foreign_bayesian_layers", "require_bayesian", "check_batch", "input_hint"]

#: Top-level packages of the Bayesian-layer libraries ``mcgraph.interop`` converts, and the name of
#: the adapter module (``mcgraph.interop.<name>.to_mcgraph``). Read by class, never imported.
FOREIGN_LIBRARIES = {"blitz": "blitz", "bayesian_torch": "bayesian_torch", "torchbnn": "torchbnn",
                     "torch_uncertainty": "torch_uncertainty"}


def _library_of(module: nn.Module) -> str | None:
    root = type(module).__module__.partition(".")[0]
    return FOREIGN_LIBRARIES.get(root)


def foreign_bayesian_layers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(qualified name, module, adapter name)`` of the outermost modules of ``model`` defined by a
    foreign Bayesian-layer library that hold Parameters (``""`` names ``model`` itself)."""
    found, inside = [], []
    for name, module in model.named_modules():
        if any(name == p or name.startswith(p + ".") for p in inside if p) or ("" in inside and name):
            continue
        if isinstance(module, BayesianModule):
            continue
        lib = _library_of(module)
        if lib is not None and next(module.parameters(), None) is not None:
            found.append((name, module, lib))
            inside.append(name)
    return found


def require_bayesian(model: nn.Module, caller: str, *, allow_none: bool = False) -> None:
    """Raise when ``model`` holds unconverted foreign Bayesian layers, or (unless ``allow_none``)
    no Bayesian layer at all; ``caller`` is the public function's name for the message."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}: model must be a torch.nn.Module, got {type(model).__name__}")
    foreign = foreign_bayesian_layers(model)
    if foreign:
        name, module, lib = foreign[0]
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        where = f"'{name}'" if name else "the model itself"
        raise TypeError(
            f"{caller}: model holds {lib}'s {type(module).__name__} at {where}{more}, which mcgraph.nn does not "
            f"sample: its KL would count as 0. Convert the model first: "
            f"model = mcgraph.interop.{lib}.to_mcgraph(model, kl_samples=...) (the converted layers share the "
            f"same Parameters), or use mcgraph.interop.{lib}.kl for the KL alone")
    if not allow_none and not any(isinstance(m, BayesianModule) for m in model.modules()):
        raise ValueError(f"{caller}: model has no Bayesian layer, so its KL would be 0. Make it Bayesian first: "
                         f"model = mg.nn.bayesify(model, ...) (or a partial conversion with skip=)")


def input_hint(model: nn.Module) -> str:
    """What the model's first weight layer expects, for error messages (``""`` when unknown)."""
    for name, module in model.named_modules():
        for attr, what in (("in_features", "input features (last dimension)"),
                           ("in_channels", "input channels (dimension 1)")):
            value = getattr(module, attr, None)
            if isinstance(value, int):
                return f"; the first layer ('{name or type(module).__name__}') expects {value} {what}"
    return ""


def check_batch(x, y, caller: str) -> None:
    """``x`` and ``y`` are tensors with the same number of rows (``y`` may be ``None``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{caller}: x must be a torch.Tensor of shape (B, ...), got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{caller}: x must have a batch dimension, shape (B, ...), got a 0-d tensor")
    if y is None:
        return
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{caller}: y must be a torch.Tensor with one row per row of x, got {type(y).__name__}")
    if y.shape[:1] != x.shape[:1]:
        raise ValueError(f"{caller}: y must have as many rows as x ({x.shape[0]}), got shape {tuple(y.shape)}")
