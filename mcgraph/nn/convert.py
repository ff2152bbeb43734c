"""Whole-model helpers: ``bayesify``, the KL of a model, and sample/mean switching."""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import torch
from torch import nn

from ..distributed import sharded
from ..noise import mix_seed, resolve_seed, reuse_noise_blocks
from .context import bayesian_modules
from .layers import BayesConv, BayesConvTranspose, BayesLayer, BayesLinear, SampleMode

__all__ = ["bayesify", "kl", "set_mode", "freeze", "unfreeze", "frozen", "bayesian_modules"]

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


def kl(model: nn.Module, num_samples: int | None = None, *, seed: int | None = None,
       method: str = "auto", return_stderr: bool = False, process_group=None):
    """Sum of KL(q ‖ p) over the Bayesian layers of ``model``, each with its own prior.

    .. math::
        KL(q\\|p) = \\sum_{\\text{layers } l} \\sum_{j} KL(q_{lj} \\| p_{lj})

    (a sum over weights; scale it by the dataset size yourself or use
    :func:`~mcgraph.nn.elbo`). Each layer's term goes through
    :func:`mcgraph.kl_divergence`, so the graph does not grow with M.

    Args:
        model: a module containing Bayesian layers (or a Bayesian layer).
        num_samples: M for every layer; ``None`` uses each layer's ``kl_samples``.
        seed: noise seed; layer ``l`` uses ``mix(seed, l)`` (``None``: drawn once).
        method: the engine's method (``"auto"``, ``"collapsed-exact"``, ``"direct"``, …).
        return_stderr: return ``(value, stderr)``, the standard error of the sum (layers are
            seeded apart, so their variances add; see :meth:`BayesLayer.kl`).
        process_group: ``None``, or a ``torch.distributed`` group whose ranks split every layer's
            samples (:func:`mcgraph.expectation`); each rank gets the full KL and its gradients,
            so under data parallelism the KL is counted once (see the README).

    Returns:
        A 0-d tensor (0 when the model has no Bayesian layer).

    Example:
        >>> import torch, mcgraph as mg
        >>> bnn = mg.nn.bayesify(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
        ...                                          torch.nn.Linear(8, 2)), prior="laplace", kl_samples=100)
        >>> value = mg.nn.kl(bnn, seed=0)
        >>> value.shape, value.requires_grad
        (torch.Size([]), True)
    """
    # the layers' noise streams draw one after another into one block of memory
    with sharded(process_group, seed, 0 if num_samples is None else num_samples) as (shard, seed), \
            reuse_noise_blocks():
        layers = bayesian_modules(model)
        seed = resolve_seed(seed)
        total = var = None
        for i, layer in enumerate(layers):
            v = layer.kl(num_samples, seed=mix_seed(seed, i), method=method, return_stderr=return_stderr,
                         process_group=shard)
            if return_stderr:
                v, se = v
                var = se * se if var is None else var + se * se
            total = v if total is None else total + v
    if total is None:
        p = next(model.parameters(), None)
        total = torch.zeros((), dtype=p.dtype if p is not None else None,
                            device=p.device if p is not None else None)
        var = torch.zeros_like(total)
    return (total, var.sqrt()) if return_stderr else total


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
