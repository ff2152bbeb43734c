"""Graph size, measured: autograd nodes and bytes saved for backward.

This is how memory is shown on CPU: a collapsed or fused estimate has the same
``graph_size`` at M = 1 and M = 10⁴, a direct one grows linearly in M.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class GraphSize(NamedTuple):
    """``nodes``: autograd nodes reachable from the output (all need grad);
    ``saved_bytes``: bytes of the tensors saved for backward, deduplicated by storage."""

    nodes: int
    saved_bytes: int


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return (t.device.type, s.data_ptr(), s.nbytes())


def _saved_of(node):
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                value = getattr(node, name)
            except Exception:  # freed buffers or non-tensor saved values
                continue
            items = value if isinstance(value, (tuple, list)) else (value,)
            for v in items:
                if isinstance(v, torch.Tensor):
                    yield v
    if hasattr(node, "saved_tensors"):
        try:
            yield from node.saved_tensors
        except Exception:
            return


def _walk(roots):
    seen, stack = set(), [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(n for n, _ in node.next_functions if n is not None)


def graph_size(tensor_or_callable) -> GraphSize:
    """Autograd nodes that require grad and bytes saved for backward (deduplicated by storage).

    Args:
        tensor_or_callable: a tensor (its graph is walked), or a zero-argument callable
            returning a tensor (or a tuple of tensors), run under saved-tensor hooks so
            that every tensor autograd saves while it runs is counted.

    Example:
        >>> import torch, mcgraph as mg
        >>> mu = torch.zeros(1000, requires_grad=True)
        >>> q = torch.distributions.Normal(mu, 1.0)
        >>> a = mg.graph_size(lambda: mg.expectation(lambda w: w ** 2, q, 1, seed=0))
        >>> b = mg.graph_size(lambda: mg.expectation(lambda w: w ** 2, q, 10_000, seed=0))
        >>> a == b
        True
    """
    if isinstance(tensor_or_callable, torch.Tensor):
        outs = (tensor_or_callable,)
        saved: dict = {}
        for node in _walk([tensor_or_callable.grad_fn]):
            for t in _saved_of(node):
                saved[_storage_key(t)] = t.untyped_storage().nbytes()
        nodes = sum(1 for _ in _walk([tensor_or_callable.grad_fn]))
        return GraphSize(nodes, sum(saved.values()))
    if not callable(tensor_or_callable):
        raise TypeError(f"tensor_or_callable must be a tensor or a callable, got {type(tensor_or_callable).__name__}")
    saved = {}

    def pack(t):
        saved[_storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = tensor_or_callable()
    outs = result if isinstance(result, (tuple, list)) else (result,)
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise TypeError("tensor_or_callable must return a tensor or a tuple of tensors")
    nodes = sum(1 for _ in _walk([o.grad_fn for o in outs]))
    return GraphSize(nodes, sum(saved.values()))
