"""Variational sites of a model written in another library, and the registry of library adapters.

A **site** is one Bayesian weight or bias tensor of a foreign model: the live Parameters the
user's optimizer holds (location μ and raw scale ρ), how σ is derived from ρ, and the prior,
built at call time from the module's current attributes and buffers:

.. math::
    q(w) = \\mathcal N\\big(\\mu,\\, t(\\rho)^2\\big), \\qquad p(w) = \\text{the layer's prior}.

Each foreign library has one adapter module in :mod:`mcgraph.interop` that subclasses
:class:`LibraryAdapter` and registers it (``@register_adapter``). An adapter recognises its
layers by class and attribute names and never imports its library: the user's model already
carries every tensor it needs. :func:`sites` asks every registered adapter; the adapters are
found by scanning the :mod:`mcgraph.interop` package, so no list of libraries exists anywhere.

Example:
    >>> import torch, mcgraph.interop as interop
    >>> from bayesian_torch.layers import LinearReparameterization
    >>> found = interop.sites(LinearReparameterization(4, 3))
    >>> [(s.name, tuple(s.loc.shape), s.scale_transform.name) for s in found]
    [('weight', (3, 4), 'softplus'), ('bias', (3,), 'softplus')]
    >>> type(found[0].prior).__name__
    'Normal'
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping, Sequence

import torch
from torch import nn
from torch.distributions import Distribution, Normal

from ..registry import Registry
from ..nn.layers import BayesLayer
from ..nn.scales import ScaleTransform

__all__ = ["VariationalSite", "LibraryAdapter", "ADAPTERS", "register_adapter", "load_adapters", "sites",
           "adapter_of", "foreign_layers", "require", "qualified", "site_name", "class_names", "parameter"]


@dataclass(frozen=True, eq=False)
class VariationalSite:
    """One Bayesian tensor of a foreign model.

    Attributes:
        name: the module path and the tensor's role, e.g. ``"features.0.weight"``.
        library: the adapter's name (``"bayesian-torch"``, ``"blitz"``, …).
        module: the layer that owns the tensor.
        role: ``"weight"``, ``"bias"`` (or ``"weight_ih"``, ``"weight_hh"`` for recurrent layers).
        loc: the live Parameter μ (the object the optimizer holds and gradients land on).
        raw_scale: the live Parameter ρ, σ = ``scale_transform(ρ)``.
        scale_transform: ``ρ ↦ σ`` (:mod:`mcgraph.nn.scales`).
        make_prior: ``() -> Distribution``, built from the module's attributes when called.
    """

    name: str
    library: str
    module: nn.Module
    role: str
    loc: torch.Tensor
    raw_scale: torch.Tensor
    scale_transform: ScaleTransform
    make_prior: Callable[[], Distribution]

    @property
    def numel(self) -> int:
        """Number of elements of the tensor."""
        return self.loc.numel()

    @property
    def scale(self) -> torch.Tensor:
        """σ = ``scale_transform(raw_scale)``, differentiable in ρ."""
        return self.scale_transform(self.raw_scale)

    @property
    def posterior(self) -> Distribution:
        """q(w) = Normal(μ, σ) over the tensor (batch shape = the tensor's shape); a property, as on
        :class:`mcgraph.nn.BayesLayer`."""
        return Normal(self.loc, self.scale, validate_args=False)

    @property
    def prior(self) -> Distribution:
        """p(w), checked to broadcast with the tensor.

        Raises:
            ValueError: the prior's shape does not broadcast to the tensor's (names the site).
        """
        try:
            dist = self.make_prior()
        except (RuntimeError, ValueError) as e:  # e.g. prior buffers whose shapes do not broadcast
            raise ValueError(f"prior of site {self.name!r} ({self.library}): {e}") from e
        shape = dist.batch_shape + dist.event_shape
        try:
            fits = torch.broadcast_shapes(shape, self.loc.shape) == self.loc.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"prior of site {self.name!r} ({self.library}): shape {tuple(shape)} does not broadcast "
                             f"to the tensor's shape {tuple(self.loc.shape)}")
        return dist


#: ``reduction(sites, values) -> 0-d tensor``: how a library scales the per-site KLs (each a 0-d sum).
Reduction = Callable[[Sequence[VariationalSite], Sequence[torch.Tensor]], torch.Tensor]


class LibraryAdapter:
    """How mcgraph reads one foreign library's Bayesian layers (subclass, then :func:`register_adapter`).

    Class attributes:
        name: the library as users call it (``"bayesian-torch"``).
        pip: the package to install (named by errors about a missing library).
        packages: its top-level import names; a module defined there belongs to the library.
        reductions: native KL scalings besides ``"sum"`` (:data:`Reduction` by name).
    """

    name: ClassVar[str]
    pip: ClassVar[str]
    packages: ClassVar[tuple[str, ...]] = ()
    reductions: ClassVar[Mapping[str, Reduction]] = {}

    def owns(self, module: nn.Module) -> bool:
        """Whether ``module`` is a Bayesian layer of this library (by class and attribute names)."""
        raise NotImplementedError

    def layer_sites(self, module: nn.Module, name: str, **options) -> list[VariationalSite]:
        """The sites of one layer that :meth:`owns` accepted; ``name`` is its module path."""
        raise NotImplementedError

    def belongs(self, module: nn.Module) -> bool:
        """Whether ``module`` is defined by this library (layer or not)."""
        return type(module).__module__.partition(".")[0] in self.packages or self.owns(module)

    def to_layer(self, module: nn.Module, name: str, *, kl_samples: int, **options) -> nn.Module:
        """The :mod:`mcgraph.nn` layer holding the very Parameters of ``module`` (see :mod:`.convert`).

        Raises:
            TypeError: ``module`` cannot be converted (the message says why and what to do instead).
        """
        raise TypeError(f"{qualified(name, module)}: {self.name} layers cannot be converted to mcgraph layers")

    def refusal(self, module: nn.Module, name: str) -> str:
        """Why a module of this library that is not a convertible layer stops a conversion."""
        return (f"{qualified(name, module)} is a {self.name} module that has no mcgraph counterpart; train the "
                f"model as it is with mcgraph.interop.elbo_backward and mcgraph.interop.kl")


ADAPTERS: Registry = Registry("library adapter")
"""The registered adapters: ``library name -> LibraryAdapter``."""


def register_adapter(adapter):
    """Register a :class:`LibraryAdapter` subclass (decorator) or instance (call); returns its argument."""
    instance = adapter() if isinstance(adapter, type) else adapter
    if not isinstance(instance, LibraryAdapter):
        raise TypeError(f"adapter must be a LibraryAdapter, got {type(instance).__name__}")
    ADAPTERS.register(instance.name, instance)
    return adapter


_loaded = False


def load_adapters() -> dict[str, LibraryAdapter]:
    """Import every module of :mod:`mcgraph.interop` once, so that each adapter registers itself.

    None of them imports its foreign library at module level.
    """
    global _loaded
    if not _loaded:
        package = importlib.import_module(__name__.rpartition(".")[0])
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{info.name}")
        _loaded = True
    return ADAPTERS


def qualified(name: str, module: nn.Module) -> str:
    """``"'features.0' (Conv2dReparameterization)"``: how errors name a module."""
    return f"{name or '<model>'!r} ({type(module).__name__})"


def site_name(module_name: str, role: str) -> str:
    """``"features.0.weight"``: a site's name from its module path and role."""
    return f"{module_name}.{role}" if module_name else role


def class_names(module: nn.Module) -> set[str]:
    """The names of the classes in ``type(module).__mro__`` (recognition without importing a library)."""
    return {c.__name__ for c in type(module).__mro__}


def parameter(module: nn.Module, name: str) -> nn.Parameter | None:
    """``module.<name>`` when it is an ``nn.Parameter``, else ``None``."""
    value = getattr(module, name, None)
    return value if isinstance(value, nn.Parameter) else None


def adapter_of(module: nn.Module) -> LibraryAdapter | None:
    """The adapter whose library owns ``module`` as a Bayesian layer, if any (mcgraph layers: ``None``)."""
    if isinstance(module, BayesLayer):
        return None
    for adapter in load_adapters().values():
        if adapter.owns(module):
            return adapter
    return None


def foreign_layers(model: nn.Module, library: str | None) -> list[tuple[str, nn.Module, LibraryAdapter]]:
    """``(name, layer, adapter)`` for every foreign Bayesian layer, checked to come from one library."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    adapters = load_adapters()
    if library is not None and library not in adapters:
        raise ValueError(f"library must be one of {sorted(adapters)}, got {library!r}")
    found = []
    for name, module in model.named_modules():
        adapter = adapter_of(module)
        if adapter is not None:
            found.append((name, module, adapter))
    if not found:
        raise ValueError(f"model: no Bayesian layer of {library or ' / '.join(sorted(adapters))} in "
                         f"{type(model).__name__}; mcgraph.interop reads layers of those libraries (for mcgraph's "
                         f"own layers use mcgraph.nn.kl)")
    first = {}
    for name, module, adapter in found:
        first.setdefault(adapter.name, (name, module))
    if len(first) > 1:
        seen = ", ".join(f"{lib}: {qualified(*nm)}" for lib, nm in first.items())
        raise ValueError(f"model mixes Bayesian layers of several libraries ({seen}); their KLs use different "
                         f"conventions, convert or train each model separately")
    if library is not None and found[0][2].name != library:
        raise ValueError(f"model: its Bayesian layers are {found[0][2].name} layers (e.g. "
                         f"{qualified(found[0][0], found[0][1])}), not {library} layers")
    return found


def sites(model: nn.Module, *, library: str | None = None, **options) -> list[VariationalSite]:
    """Every Bayesian weight and bias of a foreign model, in ``model.named_modules()`` order.

    Args:
        model: a model built with one supported library (a single layer too).
        library: require this library (an adapter name); ``None`` accepts whichever one the
            model uses.
        **options: the library's site options (``prior_floor`` for blitz); only with ``library``.

    Returns:
        A list of :class:`VariationalSite`.

    Raises:
        ValueError: no Bayesian layer, layers of several libraries, or not ``library``'s layers.
        TypeError: ``model`` is not an ``nn.Module``, or options without ``library``.
    """
    if options and library is None:
        raise TypeError(f"sites: options {sorted(options)} need library= (they belong to one library)")
    out = []
    for name, module, adapter in foreign_layers(model, library):
        out.extend(adapter.layer_sites(module, name, **options))
    return out


def require(module: str, pip: str, *, no_deps: bool = False):
    """Import ``module`` or raise an ``ImportError`` that names the package to install.

    Raises:
        ImportError: the library is missing (the message gives the ``pip install`` line).
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        flag = "--no-deps " if no_deps else ""
        raise ImportError(f"this mcgraph.interop adapter needs the {pip!r} package: pip install {flag}{pip}"
                          f" (import of {module!r} failed: {e})") from e
