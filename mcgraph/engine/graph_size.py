"""Graph size, measured: autograd nodes and bytes saved for backward.

This is how memory is shown on CPU: a collapsed or fused estimate has the same
``graph_size`` at M = 1 and M = 10⁴, a direct one grows linearly in M.
"""

from __future__ import annotations

from typing import NamedTuple

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
        tensor_or_callable: a tensor, or a zero-argument callable returning a tensor (or a
            tuple of tensors). The graph behind the output(s) is walked: every node is
            counted once, and every tensor a node saves for backward (built-in nodes'
            ``_saved_*`` fields, custom Functions' ``saved_tensors``) once per storage.

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
    elif callable(tensor_or_callable):
        result = tensor_or_callable()
        outs = tuple(result) if isinstance(result, (tuple, list)) else (result,)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise TypeError("tensor_or_callable must return a tensor or a tuple of tensors")
    else:
        raise TypeError(f"tensor_or_callable must be a tensor or a callable, got {type(tensor_or_callable).__name__}")
    saved: dict = {}
    nodes = 0
    for node in _walk([o.grad_fn for o in outs]):
        nodes += 1
        for t in _saved_of(node):
            saved[_storage_key(t)] = t.untyped_storage().nbytes()
    return GraphSize(nodes, sum(saved.values()))
