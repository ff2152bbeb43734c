"""peft (``pip install peft``): LoRA models turned into variational LoRA whose means are peft's Parameters.

:func:`to_mcgraph` takes a model holding peft LoRA layers (``get_peft_model(model, LoraConfig(...))``,
``PeftModel.from_pretrained``) and returns a structural copy (:func:`mcgraph.interop.convert.structural_copy`:
new module objects sharing every Parameter and buffer) in which each ``peft.tuners.lora.Linear`` is a
:class:`mcgraph.nn.BayesLoRA`:

.. math::
    y = \\text{base\\_layer}(x) + B\\,A\\,\\text{dropout}(x)\\cdot\\text{scaling},
    \\qquad q(A) = \\text{posterior}\\big(\\mu_A,\\, t(\\rho_A)\\big),

where ``μ_A`` **is** peft's ``lora_A[adapter].weight`` (the same Parameter object) and ``B`` is peft's
``lora_B[adapter]`` module itself (deterministic, as in BLoB; ``variational="both"`` makes it a Bayesian
site whose mean is peft's ``lora_B`` weight). Only ρ is new: a Parameter beside μ in the converted
layer (``…lora_A.weight_rho`` in ``state_dict``). Hence:

* the optimizer over the converted model's trainable Parameters moves peft's ``lora_A`` / ``lora_B``;
* ``peft_model.save_pretrained(path)`` (on the peft model you converted, which shares the Parameters)
  saves the trained means in peft's format, and ``PeftModel.from_pretrained`` loads them back;
* σ is saved by the converted model's ``state_dict()`` (keys ending in ``weight_rho``);
* in ``"mean"`` mode (:func:`mcgraph.nn.frozen`) the converted model computes peft's own forward.

Converted: ``peft.tuners.lora.Linear`` around an ``nn.Linear`` or a transformers ``Conv1D``, with one
active adapter, plain LoRA (DoRA and the other LoRA variants, merged or disabled adapters, LoRA on
embeddings or convolutions are refused with the reason). peft's ``lora_dropout`` becomes
:class:`mcgraph.nn.AdapterDropout` of the same rate (on in ``train()`` only, seeded per sample).
peft's ``requires_grad`` flags are kept (the base frozen, ``modules_to_save`` trainable).

Example:
    >>> import torch, mcgraph as mg, mcgraph.interop.peft as ipeft
    >>> from peft import LoraConfig, get_peft_model
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    >>> peft_model = get_peft_model(net, LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"]))
    >>> bnn = ipeft.to_mcgraph(peft_model, prior="normal", kl_samples=8)
    >>> layer = bnn.base_model.model[0]
    >>> type(layer).__name__, layer.lora_A.weight_mu is peft_model.base_model.model[0].lora_A["default"].weight
    ('BayesLoRA', True)
    >>> x = torch.randn(4, 8)
    >>> with mg.nn.frozen(bnn):
    ...     torch.equal(bnn(x), peft_model(x))
    True
"""

from __future__ import annotations

from torch import nn

from ..nn.estimator import resolve_estimator
from ..nn.layers import BayesLinear
from ..nn.lora import VARIATIONAL_FACTORS, AdapterDropout, BayesLoRA, adaptable
from .convert import structural_copy
from .sites import qualified, require

__all__ = ["to_mcgraph", "lora_layers"]


def _lora_classes():
    lora = require("peft.tuners.lora", "peft")
    return lora.LoraLayer, lora.Linear


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, layer)`` of every peft LoRA layer of ``model`` (``peft.tuners.lora.LoraLayer``)."""
    lora_layer, _ = _lora_classes()
    return [(name, m) for name, m in model.named_modules() if isinstance(m, lora_layer)]


def _active_adapter(name: str, layer: nn.Module) -> str:
    """The one active adapter of ``layer``, checked convertible (plain LoRA, unmerged, enabled)."""
    _, linear = _lora_classes()
    where = qualified(name, layer)
    if not isinstance(layer, linear) or adaptable(layer.base_layer) is None:
        raise TypeError(f"peft_model: {where} is a peft LoRA layer around {type(layer.base_layer).__name__}; "
                        f"to_mcgraph converts LoRA on nn.Linear and transformers Conv1D layers only (leave the "
                        f"others out of LoraConfig.target_modules)")
    if layer.merged:
        raise ValueError(f"peft_model: {where} has merged adapters {layer.merged_adapters}: its base weight holds "
                         f"W0 + ΔW; call peft_model.unmerge_adapter() first")
    if layer.disable_adapters:
        raise ValueError(f"peft_model: {where} has its adapters disabled; enable them "
                         f"(peft_model.enable_adapter_layers())")
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1:
        raise ValueError(f"peft_model: {where} has {len(active)} active LoRA adapters {active}; activate exactly one "
                         f"(peft_model.set_adapter(name))")
    adapter = active[0]
    if layer.use_dora.get(adapter, False) or adapter in getattr(layer, "lora_variant", {}):
        raise TypeError(f"peft_model: {where} uses a LoRA variant (DoRA or another) for adapter {adapter!r}; "
                        f"to_mcgraph converts plain LoRA (use_dora=False)")
    a = layer.lora_A[adapter]
    if not isinstance(a, nn.Linear) or a.bias is not None or not isinstance(layer.lora_B[adapter], nn.Linear):
        raise TypeError(f"peft_model: {where}: lora_A / lora_B of adapter {adapter!r} are not bias-free / plain "
                        f"nn.Linear factors ({type(a).__name__}, {type(layer.lora_B[adapter]).__name__})")
    return adapter


def _site(factor: nn.Linear, options: dict) -> BayesLinear:
    """A Bayesian site whose μ (and deterministic bias) are ``factor``'s very Parameters; ρ new."""
    w = factor.weight
    site = BayesLinear(factor.in_features, factor.out_features, factor.bias is not None, device=w.device,
                       dtype=w.dtype, **options)
    site.weight_mu = w
    if factor.bias is not None:
        site.bias = factor.bias
    return site


def _convert(layer: nn.Module, adapter: str, variational: str, options: dict) -> BayesLoRA:
    a, b = layer.lora_A[adapter], layer.lora_B[adapter]
    lora_a = _site(a, options) if variational in ("A", "both") else a
    lora_b = _site(b, options) if variational in ("B", "both") else b
    peft_dropout = layer.lora_dropout[adapter]
    dropout = None
    if isinstance(peft_dropout, nn.Dropout) and peft_dropout.p > 0:
        dropout = AdapterDropout(peft_dropout.p).train(peft_dropout.training)
    out = BayesLoRA(layer.base_layer, lora_a, lora_b, layer.scaling[adapter], dropout)
    return out.train(layer.training)


def to_mcgraph(peft_model: nn.Module, *, posterior="normal", prior=None, kl_samples: int = 1, variational: str = "A",
               estimator: str | None = None, rho_init: float | None = None, scale_transform=None,
               local_reparameterization: bool | None = None, flipout: bool | None = None) -> nn.Module:
    """The variational-LoRA model of a peft LoRA model: the adapters' means are peft's Parameters.

    Args:
        peft_model: a ``peft.PeftModel`` (or any module) holding peft LoRA layers.
        posterior, prior, kl_samples, estimator, rho_init, scale_transform: the options of
            :class:`~mcgraph.nn.BayesLayer` for the variational factor(s), as in :func:`mcgraph.nn.bayesian_lora`.
        local_reparameterization, flipout: the deprecated spelling of ``estimator`` (warns).
        variational: ``"A"`` (default, BLoB: peft's ``lora_A`` carries the posterior), ``"B"`` or ``"both"``.

    Returns:
        A structural copy of ``peft_model`` (sharing every Parameter and buffer) whose LoRA layers are
        :class:`~mcgraph.nn.BayesLoRA`; ``peft_model`` itself is left as it is.

    Raises:
        ImportError: peft is not installed.
        TypeError: ``peft_model`` is not a module; a LoRA layer that cannot be converted (DoRA, LoRA on an
            embedding or convolution; the message names it).
        ValueError: no peft LoRA layer; a layer with merged or disabled adapters, or not exactly one active
            adapter; ``variational`` not one of ``"A"``, ``"B"``, ``"both"``.
    """
    if not isinstance(peft_model, nn.Module):
        raise TypeError(f"peft_model must be an nn.Module, got {type(peft_model).__name__}")
    if variational not in VARIATIONAL_FACTORS:
        raise ValueError(f"variational must be one of {VARIATIONAL_FACTORS}, got {variational!r}")
    found = lora_layers(peft_model)
    if not found:
        raise ValueError(f"peft_model: {type(peft_model).__name__} holds no peft LoRA layer (build it with "
                         f"peft.get_peft_model(model, peft.LoraConfig(...)))")
    adapters = {name: _active_adapter(name, layer) for name, layer in found}  # all checked before any change
    estimator = resolve_estimator(estimator, local_reparameterization, flipout)
    options = dict(posterior=posterior, prior=prior, kl_samples=kl_samples, estimator=estimator, rho_init=rho_init,
                   scale_transform=scale_transform)
    model = structural_copy(peft_model)
    copies = dict(model.named_modules())
    if "" in adapters:
        return _convert(model, adapters[""], variational, options)
    for name in adapters:
        parent_name, _, child = name.rpartition(".")
        setattr(copies[parent_name], child, _convert(copies[name], adapters[name], variational, options))
    return model
