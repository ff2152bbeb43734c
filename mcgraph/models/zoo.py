"""Name -> builder registry for the model zoo.

A builder is any callable ``builder(num_classes=..., in_channels=..., ...)``
returning an ``nn.Module``. Adding a model is one function plus one
``@register_model`` line; :func:`get_model` never needs editing.

Example:
    >>> from mcgraph.models import get_model
    >>> net = get_model("resnet18", num_classes=10)
    >>> sum(p.numel() for p in net.parameters())
    11173962
"""

from __future__ import annotations

from typing import Callable, TypeVar

from torch import nn

from ..registry import Registry

__all__ = ["MODELS", "register_model", "get_model"]

Builder = Callable[..., nn.Module]
_B = TypeVar("_B", bound=Builder)

MODELS: Registry = Registry("model", unique=True)
"""Every registered builder, keyed by its public name."""


def register_model(name: str | None = None) -> Callable[[_B], _B]:
    """Decorator registering a model builder in :data:`MODELS`.

    Args:
        name: Registry key; defaults to the builder's ``__name__``.

    Returns:
        A decorator that registers the builder and returns it unchanged.

    Raises:
        ValueError: If ``name`` is already registered.

    Example:
        >>> from torch import nn
        >>> @register_model("tiny_mlp_doc")
        ... def tiny_mlp_doc(num_classes=10, in_channels=4):
        ...     return nn.Linear(in_channels, num_classes)
        >>> get_model("tiny_mlp_doc", num_classes=3).out_features
        3
        >>> del MODELS["tiny_mlp_doc"]
    """

    def decorator(builder: _B) -> _B:
        return MODELS.register(builder.__name__ if name is None else name, builder)

    return decorator


def get_model(name: str, **kwargs: object) -> nn.Module:
    """Build the registered model ``name``.

    Args:
        name: A key of :data:`MODELS`, e.g. ``"resnet18"``.
        **kwargs: Forwarded to the builder (``num_classes``, ``in_channels``, ...);
            an argument the builder does not take raises ``TypeError``.

    Returns:
        A freshly initialised deterministic ``nn.Module``.

    Raises:
        ValueError: If ``name`` is not registered; the message lists valid names.
    """
    try:
        builder = MODELS[name]
    except (KeyError, TypeError):
        valid = ", ".join(sorted(MODELS))
        raise ValueError(f"name must be one of [{valid}], got {name!r}") from None
    return builder(**kwargs)
