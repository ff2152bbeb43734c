"""Choosing part of a network: qualified module names, ``fnmatch`` patterns or module types.

:func:`mcgraph.nn.bayesify` (``only=``) and :func:`mcgraph.nn.bayesian_lora` (``targets=``) take the
same kind of selection; :func:`selector` turns it into a predicate on ``(name, module)``.

Example:
    >>> from torch import nn
    >>> from mcgraph.nn.module_select import selector
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    >>> names = {n for n, _ in net.named_modules()}
    >>> pick = selector(["0", nn.ReLU], names, "only")
    >>> [n for n, m in net.named_modules() if pick(n, m)]
    ['0', '1']
"""

from __future__ import annotations

import fnmatch
from typing import Callable

from torch import nn

__all__ = ["selector", "WILDCARDS"]

#: Characters that make a string a pattern rather than a qualified name.
WILDCARDS = frozenset("*?[")


def selector(selection, names: set, argument: str) -> Callable[[str, nn.Module], bool] | None:
    """``selected(name, module) -> bool`` for ``selection`` (``None``: ``None``, i.e. everything).

    Args:
        selection: a qualified module name (as in ``model.named_modules()``), an ``fnmatch`` pattern
            (``"encoder.layers.*.self_attn"``), an ``nn.Module`` subclass, or a sequence of these.
        names: the qualified names of the model's modules.
        argument: the caller's argument name, for error messages.

    Raises:
        ValueError: a name that is not a module of the model, or a pattern that matches none.
        TypeError: an entry that is neither a string nor an ``nn.Module`` subclass.
    """
    if selection is None:
        return None
    items = (selection,) if isinstance(selection, (str, type)) else tuple(selection)
    exact, patterns, types = set(), [], []
    for item in items:
        if isinstance(item, type) and issubclass(item, nn.Module):
            types.append(item)
        elif isinstance(item, str) and WILDCARDS & set(item):
            if not any(fnmatch.fnmatchcase(n, item) for n in names):
                raise ValueError(f"{argument}: the pattern {item!r} matches no module of the model")
            patterns.append(item)
        elif isinstance(item, str):
            exact.add(item)
        else:
            raise TypeError(f"{argument}: expected qualified module names, name patterns or nn.Module types, "
                            f"got {item!r}")
    unknown = exact - names
    if unknown:
        raise ValueError(f"{argument}: no modules named {sorted(unknown)} in the model")
    types = tuple(types)

    def selected(name: str, module: nn.Module) -> bool:
        return (name in exact or any(fnmatch.fnmatchcase(name, p) for p in patterns)
                or (bool(types) and isinstance(module, types)))

    return selected
