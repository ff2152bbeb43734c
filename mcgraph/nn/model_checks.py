"""Checks on the model and the batch that ``mg.nn``'s entry points run before they sample.

* A model holding another library's Bayesian layers (blitz, bayesian-torch, torchbnn,
  torch-uncertainty) that was not converted: ``mg.nn`` cannot see those layers, so their KL would
  be 0 and their weights would not be sampled. The error names the layer and the converter.
* A model with no Bayesian layer at all: ``kl`` and ``elbo`` would silently reduce to 0 and to a
  plain likelihood. The error says how to make it Bayesian.
* ``x`` / ``y`` of the wrong kind or shape: errors that name ``x`` or ``y`` and the shape expected,
  rather than an internal shape of the M·B repeated batch.

``x`` is a tensor ``(B, …)`` (the model's one positional input) or a mapping of keyword inputs
whose tensors all have B rows (a HuggingFace batch: ``input_ids``, ``attention_mask``, …; the
model is called as ``model(**x)``). A ``labels`` entry is the targets ``y`` (:func:`split_batch`).

Example:
    >>> import torch, mcgraph as mg
    >>> mg.nn.kl(torch.nn.Linear(3, 2))
    Traceback (most recent call last):
    ...
    ValueError: mg.nn.kl: model has no Bayesian layer, so its KL would be 0. Make it Bayesian first: model = mg.nn.bayesify(model, ...) (or a partial conversion with skip=)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .context import BayesianModule
from .likelihood import IGNORE_INDEX

__all__ = ["FOREIGN_LIBRARIES", "foreign_bayesian_layers", "require_bayesian", "check_batch", "input_hint",
           "batch_size", "split_batch", "input_grads", "describe_batch", "check_token_labels", "check_token_output"]

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


def require_bayesian(model: nn.Module, caller: str, *, noise_suffices: bool = False) -> None:
    """Raise when ``model`` holds unconverted foreign Bayesian layers, or no Bayesian layer at all (with
    ``noise_suffices``: nor a module that varies per sample: MC dropout's noise, a snapshot ensemble's
    members, flagged ``draws_run_noise`` or ``varies_per_sample``); ``caller`` is the public
    function's name for the message."""
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
    if any(isinstance(m, BayesianModule) for m in model.modules()):
        return
    if not noise_suffices:
        raise ValueError(f"{caller}: model has no Bayesian layer, so its KL would be 0. Make it Bayesian first: "
                         f"model = mg.nn.bayesify(model, ...) (or a partial conversion with skip=)")
    if not any(getattr(m, "draws_run_noise", False) or getattr(m, "varies_per_sample", False)
               for m in model.modules()):
        raise ValueError(f"{caller}: model has no Bayesian layer and draws no noise per sample (no MC dropout), so "
                         f"its samples would all be the same network. Make it Bayesian first: model = "
                         f"mg.nn.bayesify(model, ...), or keep its dropout on with mg.nn.mc_dropout(model)")


def input_hint(model: nn.Module) -> str:
    """What the model's first weight layer expects, for error messages (``""`` when unknown)."""
    for name, module in model.named_modules():
        for attr, what in (("in_features", "input features (last dimension)"),
                           ("in_channels", "input channels (dimension 1)")):
            value = getattr(module, attr, None)
            if isinstance(value, int):
                return f"; the first layer ('{name or type(module).__name__}') expects {value} {what}"
    return ""


def split_batch(x, y, caller: str):
    """``(inputs, y)``: a mapping ``x`` loses its ``labels`` entry, which becomes ``y`` when ``y`` is ``None``.

    The model is never given ``labels`` (a HuggingFace model would compute its own loss on every
    forward). Both ``y`` and ``x['labels']`` given is an error, as is a mapping ``x`` that is not
    keyword inputs (non-string keys).
    """
    if not isinstance(x, Mapping):
        return x, y
    bad = [k for k in x if not isinstance(k, str)]
    if bad:
        raise TypeError(f"{caller}: x as a mapping holds the model's keyword inputs, so its keys must be str, "
                        f"got {bad[0]!r}")
    if "labels" not in x:
        return dict(x), y
    if y is not None:
        raise ValueError(f"{caller}: labels given twice, as y and as x['labels']; pass one of them")
    inputs = {k: v for k, v in x.items() if k != "labels"}
    return inputs, x["labels"]


def batch_size(x) -> int:
    """The rows B of a checked batch ``x`` (a tensor, or a mapping: its ``input_ids``, else its first tensor)."""
    if isinstance(x, torch.Tensor):
        return x.shape[0]
    first = x["input_ids"] if isinstance(x.get("input_ids"), torch.Tensor) else next(
        v for v in x.values() if isinstance(v, torch.Tensor))
    return first.shape[0]


def describe_batch(x) -> str:
    """``"x of shape (B, …)"``, or ``"x with input_ids (B, T), attention_mask (B, T)"`` for a mapping."""
    if isinstance(x, Mapping):
        return "x with " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in x.items() if isinstance(v, torch.Tensor))
    return f"x of shape {tuple(x.shape)}"


def input_grads(x) -> list[torch.Tensor]:
    """The tensors of ``x`` (a tensor or a mapping) that require a gradient."""
    values = x.values() if isinstance(x, Mapping) else (x,)
    return [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]


def check_batch(x, y, caller: str) -> None:
    """``x`` (a tensor, or a mapping of keyword inputs) and ``y`` have the same number of rows (``y`` may be
    ``None``); every tensor of a mapping ``x`` has that number of rows."""
    if isinstance(x, Mapping):
        tensors = {k: v for k, v in x.items() if isinstance(v, torch.Tensor)}
        if not tensors:
            raise ValueError(f"{caller}: x as a mapping of keyword inputs must hold at least one tensor (e.g. "
                             f"input_ids of shape (B, T)), got keys {sorted(x)}")
        rows = batch_size(x)
        for k, v in tensors.items():
            if v.dim() == 0 or v.shape[0] != rows:
                raise ValueError(f"{caller}: every tensor of x must have the batch's {rows} rows (they are repeated "
                                 f"once per sample); x[{k!r}] has shape {tuple(v.shape)}")
        what = "x['input_ids']" if "input_ids" in tensors else "x"
    else:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{caller}: x must be a torch.Tensor of shape (B, ...) or a mapping of the model's "
                            f"keyword inputs, got {type(x).__name__}")
        if x.dim() == 0:
            raise ValueError(f"{caller}: x must have a batch dimension, shape (B, ...), got a 0-d tensor")
        rows, what = x.shape[0], "x"
    if y is None:
        return
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{caller}: y must be a torch.Tensor with one row per row of x, got {type(y).__name__}")
    if y.shape[:1] != (rows,):
        raise ValueError(f"{caller}: y must have as many rows as {what} ({rows}), got shape {tuple(y.shape)}")


def check_class_labels(y: torch.Tensor, out: torch.Tensor, x, caller: str) -> None:
    """``y`` holds class indices for the per-sample logits ``out`` ``(S, B, K, …)`` (the classes on dim 1 of
    the model's output, as ``F.cross_entropy`` reads them): shape ``(B, …)``, an integer dtype, each index in
    ``[0, K)`` or −100 (ignored). Checked once per call, where the labels enter."""
    logits = out.shape[1:]
    indices = logits[:1] + logits[2:]
    K = logits[1] if len(logits) > 1 else None
    if K is not None and tuple(y.shape) == tuple(logits) and tuple(y.shape) != tuple(indices):
        raise ValueError(f"{caller}: y has the shape of the model's output {tuple(logits)}, one row of {K} class "
                         f"scores per example; the categorical likelihood takes class indices of shape "
                         f"{tuple(indices)}: pass y.argmax(1), not one-hot (or probability) rows")
    if y.dtype.is_floating_point or y.dtype == torch.bool or y.is_complex():
        raise TypeError(f"{caller}: y must hold class indices, an integer tensor (torch.long) of shape "
                        f"{tuple(indices)}, for likelihood='categorical'; got dtype {y.dtype}"
                        + (" (whole numbers: y.long() converts them)" if y.is_floating_point() and y.numel()
                           and bool((y == y.round()).all()) else ""))
    if tuple(y.shape) != tuple(indices):
        extra = f" + {tuple(y.shape[1:])}" if y.dim() > 1 else ""
        raise ValueError(f"{caller}: y has shape {tuple(y.shape)}, so the model's output for x must have shape "
                         f"{tuple(y.shape[:1])} + (K,){extra} (K classes); {describe_batch(x)} gives an output of "
                         f"shape {tuple(logits)}")
    counted = y[y != IGNORE_INDEX]
    if K is not None and counted.numel():
        low, high = int(counted.min()), int(counted.max())
        if low < 0 or high >= K:
            bad = low if low < 0 else high
            raise ValueError(f"{caller}: y holds the class index {bad}, outside [0, {K}) for the model's {K} "
                             f"classes (dim 1 of its output; −100 marks an ignored example)")


def check_token_labels(x, y, caller: str) -> None:
    """``y`` holds a causal LM's labels: integer ``(B, T)``, shaped like ``x``'s token ids when it has them."""
    if y is None:
        raise ValueError(f"{caller}: a token likelihood needs labels: pass y of shape (B, T) or x['labels'] "
                         f"(labels = input_ids, padding set to -100, as for transformers)")
    if y.dtype.is_floating_point or y.dtype == torch.bool or y.is_complex():
        raise TypeError(f"{caller}: y must hold integer token ids (or -100), got dtype {y.dtype}")
    ids = x.get("input_ids") if isinstance(x, Mapping) else x
    if y.dim() != 2 or (isinstance(ids, torch.Tensor) and ids.shape != y.shape):
        want = f"{tuple(ids.shape)}, the shape of the token ids" if isinstance(ids, torch.Tensor) else "(B, T)"
        raise ValueError(f"{caller}: y (the labels) must have shape {want}, got {tuple(y.shape)}")


def check_token_output(out: torch.Tensor, y: torch.Tensor, caller: str) -> None:
    """The model's per-sample output ``(S, B, T, V)`` fits labels ``y`` ``(B, T)``."""
    if out.dim() != 4 or out.shape[1:3] != y.shape:
        raise ValueError(f"{caller}: a token likelihood needs (B, T, V) logits for labels y of shape "
                         f"{tuple(y.shape)}; the model returned shape {tuple(out.shape[1:])}")
