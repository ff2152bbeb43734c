"""Foreign Bayesian layers swapped for :mod:`mcgraph.nn` layers that hold the very same Parameters.

``to_mcgraph(model)`` (one per library adapter) returns a model whose foreign Linear / Conv /
ConvTranspose layers (and the recurrent layers an adapter maps, see its module) are replaced by
:class:`~mcgraph.nn.BayesLinear`, :class:`~mcgraph.nn.BayesConv` or
:class:`~mcgraph.nn.BayesConvTranspose` layers whose
``weight_mu``, ``weight_rho``, ``bias_mu`` and ``bias_rho`` **are** the foreign Parameters
(same objects), with the library's σ = t(ρ) (:mod:`mcgraph.nn.scales`) and prior. The user's
optimizer, which holds those Parameters, trains the converted model; the original model (left
as it is unless ``inplace=True``) shares every Parameter and buffer, so its ``state_dict``
saves and loads the trained values. After conversion ``mg.nn.elbo``, ``mg.nn.kl`` and
``mg.nn.predict`` work unchanged, with correct gradients for any number of samples and a
graph that does not grow with it.

Every other module is copied structurally (new module objects sharing the same Parameter
and buffer tensors, hooks and attributes), so the converted model's ``forward`` is the
original's. A module of the foreign library that is not a convertible layer (an embedding
layer, a layer whose ``forward`` returns ``(out, kl)``, a Bayesian BatchNorm, …) is refused
with a ``TypeError`` that says why and what to do instead.

Example:
    >>> import torch, mcgraph as mg
    >>> from mcgraph.interop.convert import to_mcgraph
    >>> from blitz.modules import BayesianConv2d
    >>> net = torch.nn.Sequential(BayesianConv2d(1, 2, (3, 3)), torch.nn.Flatten())
    >>> bnn = to_mcgraph(net, "blitz", kl_samples=100)
    >>> type(bnn[0]).__name__, bnn[0].weight_rho is net[0].weight_sampler.rho
    ('BayesConv', True)
    >>> mg.nn.predict(bnn, torch.randn(2, 1, 5, 5), num_samples=8).shape
    torch.Size([2, 18])
"""

from __future__ import annotations

import copy
import warnings

from torch import nn

from ..engine import checks
from ..nn.layers import BayesConv, BayesConvTranspose, BayesLayer, BayesLinear, SampleMode
from .sites import LibraryAdapter, VariationalSite, foreign_layers

__all__ = ["to_mcgraph", "share", "structural_copy", "mcgraph_layer", "LAYER_KINDS"]

#: The layer kinds :func:`mcgraph_layer` builds.
LAYER_KINDS = ("linear", "conv", "conv_transpose")


def structural_copy(module: nn.Module, memo: dict | None = None) -> nn.Module:
    """A copy of ``module`` and its submodules that shares every Parameter, buffer and attribute value."""
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    new = copy.copy(module)
    memo[id(module)] = new
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    new._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    new._modules = {k: None if m is None else structural_copy(m, memo) for k, m in module._modules.items()}
    return new


def share(layer: BayesLayer, weight: VariationalSite, bias: VariationalSite | None = None,
          *, frozen: bool = False) -> BayesLayer:
    """Make ``layer`` hold the sites' Parameters (``weight_mu``/``weight_rho``, ``bias_mu``/``bias_rho``).

    ``layer`` must have been built with the same shapes (``bayesian_bias=True`` for a bias
    site) and the sites' scale transform; ``frozen`` sets the posterior-mean forward.

    Raises:
        ValueError: a shape or the scale transform differs.
    """
    pairs = [("weight", weight)] + ([("bias", bias)] if bias is not None else [])
    if layer.scale_transform.name != weight.scale_transform.name:
        raise ValueError(f"site {weight.name!r}: scale transform {weight.scale_transform} differs from the layer's "
                         f"{layer.scale_transform}")
    for role, site in pairs:
        for suffix, tensor in (("mu", site.loc), ("rho", site.raw_scale)):
            target = getattr(layer, f"{role}_{suffix}")
            if target is None or target.shape != tensor.shape:
                raise ValueError(f"site {site.name!r}: {role}_{suffix} of shape {tuple(tensor.shape)} does not fit "
                                 f"{type(layer).__name__} ({None if target is None else tuple(target.shape)})")
            if not isinstance(tensor, nn.Parameter):
                raise ValueError(f"site {site.name!r}: {role}_{suffix} is not an nn.Parameter")
            setattr(layer, f"{role}_{suffix}", tensor)
    if frozen:
        layer.mode = SampleMode.MEAN
    return layer


def mcgraph_layer(kind: str, module: nn.Module, weight: VariationalSite, bias: VariationalSite | None = None, *,
                  prior="normal", kl_samples: int = 1, flipout: bool = False, frozen: bool = False) -> BayesLayer:
    """The mcgraph layer of ``kind`` (:data:`LAYER_KINDS`) for ``module``, holding the sites' Parameters.

    Shapes come from the weight site, the convolution geometry from ``module``'s torch-named
    attributes (``in_channels``, ``out_channels``, ``stride``, ``padding``, ``dilation``,
    ``groups``, ``output_padding``, ``padding_mode``); σ = t(ρ) from the site.

    Args:
        kind: ``"linear"``, ``"conv"`` or ``"conv_transpose"``.
        module: the foreign layer (read, not modified).
        weight, bias: its sites (``bias=None``: no bias).
        prior: the layer's prior (see :class:`mcgraph.nn.BayesLayer`).
        kl_samples: M of the layer's KL.
        flipout: use the flipout estimator.
        frozen: posterior-mean forward (the foreign layer was frozen).
    """
    w = weight.loc
    options = dict(prior=prior, kl_samples=kl_samples, estimator="flipout" if flipout else "reparameterization",
                   bayesian_bias=bias is not None,
                   scale_transform=weight.scale_transform, device=w.device, dtype=w.dtype)
    if kind == "linear":
        layer = BayesLinear(w.shape[1], w.shape[0], bias is not None, **options)
    elif kind in ("conv", "conv_transpose"):
        g = {k: getattr(module, k) for k in ("in_channels", "out_channels", "stride", "padding", "dilation", "groups")}
        if kind == "conv":
            layer = BayesConv(g["in_channels"], g["out_channels"], tuple(w.shape[2:]), g["stride"], g["padding"],
                              g["dilation"], g["groups"], bias is not None,
                              getattr(module, "padding_mode", "zeros"), spatial_dims=w.dim() - 2, **options)
        else:
            layer = BayesConvTranspose(g["in_channels"], g["out_channels"], tuple(w.shape[2:]), g["stride"],
                                       g["padding"], getattr(module, "output_padding", 0), g["groups"],
                                       bias is not None, g["dilation"], spatial_dims=w.dim() - 2, **options)
    else:
        raise ValueError(f"kind must be one of {LAYER_KINDS}, got {kind!r}")
    return share(layer, weight, bias, frozen=frozen)


def _check_kl_samples(kl_samples, library: str) -> int:
    if kl_samples is None:
        raise TypeError(f"mcgraph.interop.{library}.to_mcgraph: kl_samples is required, the number of Monte Carlo "
                        f"samples of each converted layer's KL (mg.nn.kl and mg.nn.elbo use it). mcgraph's KL graph "
                        f"does not grow with it, so take many: e.g. kl_samples=64; kl_samples=1 reproduces a "
                        f"one-sample estimate")
    return checks.positive_int("kl_samples", kl_samples)


_SCALE_WARNED: set[str] = set()


def warn_kl_scale(library: str, native: str) -> None:
    """Say once per process how ``library``'s own KL scaling (``native``) maps to mcgraph's."""
    if library in _SCALE_WARNED:
        return
    _SCALE_WARNED.add(library)
    warnings.warn(f"{library} -> mcgraph: {native} mg.nn.kl sums the KL over every weight, and mg.nn.elbo divides "
                  f"it by dataset_size (the ELBO per example), so the KL's share of the loss changes with the switch. "
                  f"mcgraph.interop.{library}.kl(model, ..., reduction=...) reproduces the library's own scaling.",
                  KLScaleWarning, stacklevel=3)


class KLScaleWarning(UserWarning):
    """A converted model's KL is scaled differently from the library's own KL loss."""


def _convert_tree(module: nn.Module, name: str, adapter: LibraryAdapter, options: dict) -> nn.Module:
    if adapter.owns(module):
        return adapter.to_layer(module, name, **options)
    if not isinstance(module, BayesLayer) and adapter.belongs(module):
        raise TypeError(adapter.refusal(module, name))
    for child_name, child in list(module.named_children()):
        full = f"{name}.{child_name}" if name else child_name
        new = _convert_tree(child, full, adapter, options)
        if new is not child:
            setattr(module, child_name, new)
    return module


def to_mcgraph(model: nn.Module, library: str, *, kl_samples: int | None = None, inplace: bool = False,
               **options) -> nn.Module:
    """Replace ``library``'s Bayesian layers of ``model`` by mcgraph layers holding the same Parameters.

    Args:
        model: a model (or one layer) built with ``library``.
        library: the adapter's name (each adapter module's ``to_mcgraph`` fixes it).
        kl_samples: M of each converted layer's KL (:meth:`mcgraph.nn.BayesLayer.kl`); required: there is
            no silent one-sample default (the graph does not grow with M, so e.g. 64 costs memory as 1 does).
        inplace: convert ``model`` itself; by default a structural copy is converted and
            ``model`` is left as it is (sharing every Parameter and buffer with the result).
        **options: the library's conversion options (``prior_floor`` for blitz).

    Returns:
        The converted model.

    Raises:
        ValueError: no Bayesian layer of ``library``, or layers of several libraries.
        TypeError: a module that cannot be converted (the message names it and says why).
    """
    adapter = foreign_layers(model, library)[0][2]
    options = dict(options, kl_samples=_check_kl_samples(kl_samples, library))
    target = model if inplace else structural_copy(model)
    return _convert_tree(target, "", adapter, options)
