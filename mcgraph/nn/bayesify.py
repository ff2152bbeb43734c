"""Whole-model conversion: ``bayesify``, and switching a model's layers between sampled and mean weights."""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

from torch import nn

from .context import bayesian_modules
from .layers import BayesConv, BayesConvTranspose, BayesLayer, BayesLinear, SampleMode

__all__ = ["bayesify", "set_mode", "freeze", "unfreeze", "frozen", "bayesian_modules"]

_CONVERTIBLE = {
    nn.Linear: BayesLinear,
    nn.Conv1d: BayesConv, nn.Conv2d: BayesConv, nn.Conv3d: BayesConv,
    nn.ConvTranspose1d: BayesConvTranspose, nn.ConvTranspose2d: BayesConvTranspose,
    nn.ConvTranspose3d: BayesConvTranspose,
}


def _target(module: nn.Module):
    for t in type(module).__mro__:
        if t in _CONVERTIBLE:
            return _CONVERTIBLE[t]
    return None


def bayesify(model: nn.Module, *, posterior="normal", prior=None, kl_samples: int = 1,
             init_from_weights: bool = True, local_reparameterization: bool | None = None, flipout: bool = False,
             bayesian_bias: bool = False, rho_init: float | None = None, scale_transform=None, skip=(),
             inplace: bool = False) -> nn.Module:
    """Replace every ``Linear`` / ``Conv*`` / ``ConvTranspose*`` of ``model`` by its Bayesian layer.

    Other modules (BatchNorm, pooling, activations, …) are left as they are, so
    the network's ``forward`` runs unchanged; biases and BatchNorm stay
    deterministic point estimates unless ``bayesian_bias``.

    Args:
        model: any ``nn.Module`` (a single ``Linear``/``Conv`` is converted too).
        posterior, prior, kl_samples, local_reparameterization, flipout, bayesian_bias,
            rho_init, scale_transform: the options of :class:`~mcgraph.nn.BayesLayer`, given to every layer
            (``None``: the posterior family's default, else ``"normal"``, ``False``, −5, ``"softplus"``).
        init_from_weights: μ (and the bias) copied from the trained weights; otherwise
            μ is freshly initialised.
        skip: qualified module names (as in ``model.named_modules()``) to keep deterministic,
            e.g. ``("features.0",)`` for the first conv.
        inplace: convert ``model`` itself; by default a deep copy is converted.

    Returns:
        The converted model.

    Example:
        >>> import torch, mcgraph as mg
        >>> net = mg.models.get_model("lenet5")
        >>> bnn = mg.nn.bayesify(net, posterior="radial", prior="normal", kl_samples=1000)
        >>> len(mg.nn.bayesian_modules(bnn))
        5
        >>> bnn(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(skip, str):
        skip = (skip,)
    skip = set(skip)
    names = {name for name, _ in model.named_modules()}
    unknown = skip - names
    if unknown:
        raise ValueError(f"skip: no modules named {sorted(unknown)} in the model")
    if not inplace:
        model = copy.deepcopy(model)
    options = dict(posterior=posterior, prior=prior, kl_samples=kl_samples,
                   local_reparameterization=local_reparameterization, flipout=flipout,
                   bayesian_bias=bayesian_bias, rho_init=rho_init, scale_transform=scale_transform)

    def convert(module: nn.Module):
        cls = _target(module)
        return cls.from_torch(module, init_from_weights=init_from_weights, **options)

    if "" not in skip and _target(model) is not None and not isinstance(model, BayesLayer):
        return convert(model)
    for name, parent in list(model.named_modules()):
        if isinstance(parent, BayesLayer):
            continue
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if full in skip or isinstance(child, BayesLayer) or _target(child) is None:
                continue
            setattr(parent, child_name, convert(child))
    return model


def set_mode(model: nn.Module, mode: str | SampleMode) -> nn.Module:
    """Set every Bayesian layer of ``model`` to ``"sample"`` or ``"mean"`` weights; returns ``model``."""
    try:
        mode = SampleMode(mode)
    except ValueError:
        raise ValueError(f"mode must be one of {[m.value for m in SampleMode]}, got {mode!r}") from None
    for layer in bayesian_modules(model):
        layer.mode = mode
    return model


def freeze(model: nn.Module) -> nn.Module:
    """Use the posterior means (deterministic forward) in every Bayesian layer; returns ``model``."""
    return set_mode(model, SampleMode.MEAN)


def unfreeze(model: nn.Module) -> nn.Module:
    """Sample weights again in every Bayesian layer; returns ``model``."""
    return set_mode(model, SampleMode.SAMPLE)


@contextlib.contextmanager
def frozen(model: nn.Module) -> Iterator[nn.Module]:
    """Context manager: posterior-mean weights inside, the previous modes restored after.

    Example:
        >>> import torch, mcgraph as mg
        >>> layer = mg.nn.BayesLinear(3, 2)
        >>> x = torch.ones(1, 3)
        >>> with mg.nn.frozen(layer):
        ...     same = torch.equal(layer(x), layer(x))
        >>> same
        True
    """
    layers = bayesian_modules(model)
    before = [layer.mode for layer in layers]
    freeze(model)
    try:
        yield model
    finally:
        for layer, mode in zip(layers, before):
            layer.mode = mode
