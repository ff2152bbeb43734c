"""Whole-model conversion: ``bayesify``, and switching a model's layers between sampled and mean weights."""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

from torch import nn

from .attention import BayesMultiheadAttention
from .context import BayesianModule, bayesian_modules
from .embedding import BayesEmbedding
from .estimator import Estimator, resolve_estimator
from .layers import BayesConv, BayesConvTranspose, BayesLinear, SampleMode
from .lora import BayesLoRA
from .module_select import selector
from .recurrent import BayesRNNBase

__all__ = ["bayesify", "last_layer", "set_mode", "freeze", "unfreeze", "frozen", "bayesian_modules"]

#: torch module type -> Bayesian class (``cls.from_torch(module, init_from_weights=..., **options)``).
_CONVERTIBLE = {
    nn.Linear: BayesLinear,
    nn.Conv1d: BayesConv, nn.Conv2d: BayesConv, nn.Conv3d: BayesConv,
    nn.ConvTranspose1d: BayesConvTranspose, nn.ConvTranspose2d: BayesConvTranspose,
    nn.ConvTranspose3d: BayesConvTranspose,
    nn.LSTM: BayesRNNBase, nn.GRU: BayesRNNBase, nn.RNN: BayesRNNBase,
    nn.Embedding: BayesEmbedding,
    nn.MultiheadAttention: BayesMultiheadAttention,
}

#: Modules already Bayesian (never converted, never entered); a LoRA adapter holds its own Bayesian sites.
_BAYESIAN = (BayesianModule, BayesRNNBase, BayesMultiheadAttention, BayesLoRA)

def _target(module: nn.Module):
    for t in type(module).__mro__:
        if t in _CONVERTIBLE:
            return _CONVERTIBLE[t]
    return None


def bayesify(model: nn.Module, *, posterior="normal", prior=None, kl_samples: int = 1,
             init_from_weights: bool = True, estimator: str | Estimator | None = None, bayesian_bias: bool = False,
             rho_init: float | None = None, scale_transform=None, skip=(), only=None, freeze_rest: bool | None = None,
             inplace: bool = False, local_reparameterization: bool | None = None,
             flipout: bool | None = None) -> nn.Module:
    """Replace the weighted modules of ``model`` by their Bayesian layers.

    Converted: ``Linear``, ``Conv*``, ``ConvTranspose*`` (:class:`~mcgraph.nn.BayesLinear`,
    :class:`~mcgraph.nn.BayesConv`, :class:`~mcgraph.nn.BayesConvTranspose`), ``LSTM`` / ``GRU`` /
    ``RNN`` (:class:`~mcgraph.nn.BayesLSTM`, …), ``Embedding`` (:class:`~mcgraph.nn.BayesEmbedding`)
    and ``MultiheadAttention`` (:class:`~mcgraph.nn.BayesMultiheadAttention`, so
    ``nn.TransformerEncoder`` / ``Decoder`` models convert with one call). Other modules
    (BatchNorm, LayerNorm, pooling, activations, …) are left as they are, so the network's
    ``forward`` runs unchanged; biases and norms stay deterministic point estimates unless
    ``bayesian_bias``.

    Args:
        model: any ``nn.Module`` (a single convertible module is converted too).
        posterior, prior, kl_samples, estimator, bayesian_bias, rho_init, scale_transform: the options of
            :class:`~mcgraph.nn.BayesLayer`, given to every layer (``None``: the posterior family's default,
            else ``"normal"``, ``"reparameterization"``, −5, ``"softplus"``). Recurrent, embedding and
            attention layers sample weights: a family's default local reparameterization is off for them,
            and an explicit ``estimator="local_reparameterization"`` or ``"flipout"`` applies to the
            linear and convolutional layers only.
        local_reparameterization, flipout: the deprecated spelling of ``estimator`` (warns).
        init_from_weights: μ (and the bias) copied from the trained weights; otherwise
            μ is freshly initialised.
        skip: qualified module names (as in ``model.named_modules()``) to keep deterministic,
            e.g. ``("features.0",)`` for the first conv.
        only: make only part of the network Bayesian: qualified module names, name patterns
            (``fnmatch``: ``"encoder.layers.*.self_attn"``) or module types (``nn.MultiheadAttention``);
            a convertible module is converted when it or a module containing it is selected.
            ``None`` (default): every convertible module. ``skip`` still applies inside.
        freeze_rest: set ``requires_grad=False`` on every Parameter outside the converted Bayesian
            layers (a partial Bayesian network on a pretrained trunk). ``None`` (default): ``True``
            when ``only`` is given, else ``False``; pass ``False`` to train the rest too.
        inplace: convert ``model`` itself; by default a deep copy is converted.

    Returns:
        The converted model.

    Raises:
        ValueError: a name in ``skip`` or ``only`` (or a pattern of ``only``) that matches no module.
        TypeError: ``model`` is not a module, or an entry of ``only`` is neither a name nor a module type.

    Example:
        >>> import torch, mcgraph as mg
        >>> net = mg.models.get_model("lenet5")
        >>> bnn = mg.nn.bayesify(net, posterior="radial", prior="normal", kl_samples=1000)
        >>> len(mg.nn.bayesian_modules(bnn))
        5
        >>> bnn(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
        >>> head_only = mg.nn.bayesify(net, only="classifier.5")  # the last layer only
        >>> len(mg.nn.bayesian_modules(head_only))
        1
        >>> head_only.features[0].weight.requires_grad        # the rest is frozen (freeze_rest)
        False
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
    selected = selector(only, names, "only")
    if freeze_rest is None:
        freeze_rest = only is not None
    elif not isinstance(freeze_rest, bool):
        raise TypeError(f"freeze_rest must be a bool or None, got {type(freeze_rest).__name__}")
    if not inplace:
        model = copy.deepcopy(model)
    estimator = resolve_estimator(estimator, local_reparameterization, flipout)
    options = dict(posterior=posterior, prior=prior, kl_samples=kl_samples, estimator=estimator,
                   bayesian_bias=bayesian_bias, rho_init=rho_init, scale_transform=scale_transform)
    sampling_options = dict(options, estimator=None)

    def convert(module: nn.Module):
        cls = _target(module)
        opts = options if cls in (BayesLinear, BayesConv, BayesConvTranspose) else sampling_options
        return cls.from_torch(module, init_from_weights=init_from_weights, **opts)

    def chosen(name: str, module: nn.Module, inherited: bool) -> bool:
        return inherited or selected is None or selected(name, module)

    root_chosen = chosen("", model, False)
    if _target(model) is not None and not isinstance(model, _BAYESIAN):
        return convert(model) if "" not in skip and root_chosen else model

    def walk(parent: nn.Module, prefix: str, inherited: bool) -> None:
        for child_name, child in list(parent.named_children()):
            full = f"{prefix}.{child_name}" if prefix else child_name
            if isinstance(child, _BAYESIAN):
                continue
            on = chosen(full, child, inherited)
            if _target(child) is not None:  # converted whole, never entered (MultiheadAttention's out_proj)
                if on and full not in skip:
                    setattr(parent, child_name, convert(child))
                continue
            walk(child, full, on)

    walk(model, "", root_chosen)
    for module in model.modules():  # torch's nested-tensor encoder path would read the mean weights directly
        if isinstance(module, nn.TransformerEncoder) and any(
                isinstance(m, BayesMultiheadAttention) for m in module.modules()):
            module.use_nested_tensor = False
    if freeze_rest:
        _freeze_outside(model, _BAYESIAN)
    return model


def _freeze_outside(model: nn.Module, kinds: tuple) -> None:
    """``requires_grad=False`` on every Parameter of ``model`` that no module of ``kinds`` holds."""
    keep = {id(p) for m in model.modules() if isinstance(m, kinds) for p in m.parameters()}
    for p in model.parameters():
        if id(p) not in keep:
            p.requires_grad_(False)


def last_layer(model: nn.Module, *, freeze_rest: bool = True, **options) -> nn.Module:
    """Make only the last ``nn.Linear`` of ``model`` Bayesian: ``bayesify(model, only=<its name>)``.

    The last-layer Bayesian network (Kristiadi et al., 2020; Harrison et al., 2024): a pretrained
    trunk kept as it is, a variational posterior over the output layer. "Last" is the last
    ``nn.Linear`` in ``model.named_modules()`` order (the head of a ``Sequential``, the ``lm_head``
    or ``classifier`` of a transformers model).

    Args:
        model: any ``nn.Module`` with at least one ``nn.Linear``.
        freeze_rest: ``requires_grad=False`` on every other Parameter (default ``True``; the
            pretrained weights stay as they are); ``False`` trains the trunk too.
        **options: the keyword arguments of :func:`bayesify` (``posterior``, ``prior``,
            ``kl_samples``, ``local_reparameterization``, ``rho_init``, ``inplace``, …), except
            ``only`` and ``skip``.

    Returns:
        The converted model (a copy unless ``inplace=True``).

    Raises:
        ValueError: ``model`` has no ``nn.Linear``.
        TypeError: ``model`` is not a module, or ``only`` / ``skip`` among ``options``.

    Example:
        >>> import torch, mcgraph as mg
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        >>> bnn = mg.nn.last_layer(net, posterior="normal", estimator="local_reparameterization")
        >>> type(bnn[2]).__name__, bnn[0].weight.requires_grad, bnn[2].weight_rho.requires_grad
        ('BayesLinear', False, True)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    for name in ("only", "skip"):
        if name in options:
            raise TypeError(f"last_layer: {name}= is not an option here (the last nn.Linear is chosen); "
                            f"use mg.nn.bayesify(model, {name}=...) for another selection")
    # not the projections nn.MultiheadAttention reads directly, nor a layer inside a Bayesian module or adapter
    closed = [name for name, m in model.named_modules() if isinstance(m, _BAYESIAN + (nn.MultiheadAttention,))]
    linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)
              and not any(name.startswith(c + ".") or (c == "" and name) for c in closed)]
    if not linear:
        raise ValueError(f"model: {type(model).__name__} has no nn.Linear layer to make Bayesian")
    return bayesify(model, only=linear[-1], freeze_rest=freeze_rest, **options)


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
