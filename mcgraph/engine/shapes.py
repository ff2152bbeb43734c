"""Shape arithmetic for the engine's per-call paths."""

from __future__ import annotations


def broadcast_shapes(*shapes) -> tuple:
    """``torch.broadcast_shapes`` for the shapes of existing tensors, as a tuple, without its per-call
    overhead (torch's goes through its reference implementation: tens of µs, paid per term per call).

    Example:
        >>> broadcast_shapes((3, 1), (4,), ())
        (3, 4)
    """
    first = tuple(shapes[0])
    if all(tuple(s) == first for s in shapes[1:]):
        return first
    ndim = max(len(s) for s in shapes)
    out = [1] * ndim
    for s in shapes:
        for i, n in enumerate(s, ndim - len(s)):
            if n != 1:
                if out[i] not in (1, n):
                    raise RuntimeError(f"shapes {[tuple(x) for x in shapes]} do not broadcast")
                out[i] = n
    return tuple(out)


def broadcasts_to(shape, target) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target``.

    Example:
        >>> broadcasts_to((3, 1), (2, 3, 4)), broadcasts_to((3, 4), (4,))
        (True, False)
    """
    try:
        return broadcast_shapes(shape, target) == tuple(target)
    except RuntimeError:
        return False
