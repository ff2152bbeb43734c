"""Make a pruned network physically smaller, and count its parameters and multiply–accumulates.

:func:`shrink` traces the network with ``torch.fx`` and, for every pair *producer →
consumer* of ``Linear``/``Conv`` layers (``groups=1``) joined by a chain of channel-wise
operations with no other user (activations, dropout, pooling, BatchNorm, ``Flatten``),
removes every unit (neuron or filter) ``j`` that no longer matters:

* the consumer's weights reading unit ``j`` are all zero (for ``Flatten`` → ``Linear``: the
  whole block of the channel's ``H·W`` features), or
* the producer's weights and bias of unit ``j`` are all zero and every operation of the
  chain maps 0 to 0 (so unit ``j`` is identically zero; BatchNorm and sigmoid-like
  activations do not qualify).

The unit leaves the producer (rows, bias), the BatchNorm layers of the chain (all
per-channel tensors) and the consumer (input columns / channels). A consumer whose dead
inputs come from elsewhere (the network's input, a residual sum) keeps its interface: a
:class:`SelectFeatures` module in front of it picks the live inputs and the consumer
loses the dead columns (the sparse-regression case: only the true features are read).
The result is checked to give the original's outputs on the example input.

Example:
    >>> import torch
    >>> from mcgraph.optim import shrink, count_compute
    >>> net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> with torch.no_grad():
    ...     net[2].weight[:, 1:3] = 0             # hidden units 1 and 2 are not read
    ...     net[0].weight[:, 0] = 0               # input feature 0 is not read
    >>> small, report = shrink(net, torch.randn(5, 6))
    >>> report["after"]["parameters"], report["before"]["parameters"]
    (18, 38)
"""

from __future__ import annotations

import copy
import math

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

__all__ = ["shrink", "count_compute", "SelectFeatures"]


class SelectFeatures(nn.Module):
    """``x.index_select(dim, index)``: keep the live inputs of the next layer."""

    def __init__(self, dim: int, index: torch.Tensor, size: int) -> None:
        super().__init__()
        self.dim = dim
        self.size = size
        self.register_buffer("index", index.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(self.dim, self.index)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, kept={self.index.numel()} of {self.size}"


@torch.no_grad()
def count_compute(model: nn.Module, example_input: torch.Tensor) -> dict:
    """Parameters and multiply–accumulates per example of ``model`` on ``example_input``.

    Returns ``parameters`` (all), ``nonzero_parameters``, ``macs`` (dense, over Linear/Conv
    layers: output elements × fan-in) and ``macs_nonzero`` (the same counting only non-zero
    weights: what a sparse kernel would do). Per example: divided by the batch size.
    """
    macs = [0, 0]
    handles = []

    def hook(module, inputs, output):
        n = output.shape[0]
        w = module.weight
        nonzero = int((w != 0).sum())
        if isinstance(module, nn.Linear):
            positions = output.numel() // (n * module.out_features)
            macs[0] += positions * w.numel()
            macs[1] += positions * nonzero
        else:
            positions = math.prod(output.shape[2:])
            macs[0] += positions * w.numel()
            macs[1] += positions * nonzero

    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)):
            handles.append(m.register_forward_hook(hook))
    was_training = model.training
    model.eval()
    try:
        model(example_input)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    params = list(model.parameters())
    return {"parameters": sum(p.numel() for p in params),
            "nonzero_parameters": sum(int((p != 0).sum()) for p in params),
            "macs": macs[0], "macs_nonzero": macs[1]}


_PASS_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Tanh, nn.Identity,
                 nn.modules.dropout._DropoutNd, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
                 nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd,
                 nn.Sigmoid, nn.Softplus, nn.modules.batchnorm._BatchNorm, nn.Flatten)
_NOT_ZERO_PRESERVING = (nn.Sigmoid, nn.Softplus, nn.modules.batchnorm._BatchNorm)
_PASS_FUNCTIONS = {torch.relu: True, torch.nn.functional.relu: True, torch.tanh: True, torch.sigmoid: False,
                   torch.nn.functional.gelu: True, torch.nn.functional.silu: True,
                   torch.nn.functional.dropout: True, torch.flatten: True}
_PASS_METHODS = {"relu": True, "tanh": True, "sigmoid": False, "flatten": True, "view": True, "reshape": True}


def _is_layer(m) -> bool:
    return isinstance(m, nn.Linear) or (isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and m.groups == 1)


def _shape(node: fx.Node):
    meta = node.meta.get("tensor_meta")
    return None if meta is None or not hasattr(meta, "shape") else tuple(meta.shape)


def _step(gm: fx.GraphModule, node: fx.Node):
    """``(input node, zero_preserving, kind)`` if ``node`` is a pass-through op on its first argument, else None.

    ``kind`` is ``"flatten"`` for an op that flattens (N, C, *S) to (N, C·S), ``"bn"`` for BatchNorm, else ``"pass"``.
    """
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    src = node.args[0]
    kind, zero = "pass", True
    if node.op == "call_module":
        m = gm.get_submodule(node.target)
        if not isinstance(m, _PASS_MODULES):
            return None
        zero = not isinstance(m, _NOT_ZERO_PRESERVING)
        if isinstance(m, nn.Flatten):
            kind = "flatten"
        elif isinstance(m, nn.modules.batchnorm._BatchNorm):
            kind = "bn"
    elif node.op == "call_function" and node.target in _PASS_FUNCTIONS:
        zero = _PASS_FUNCTIONS[node.target]
        kind = "flatten" if node.target is torch.flatten else "pass"
    elif node.op == "call_method" and node.target in _PASS_METHODS:
        zero = _PASS_METHODS[node.target]
        kind = "flatten" if node.target in ("flatten", "view", "reshape") else "pass"
    else:
        return None
    if kind == "flatten":
        a, b = _shape(src), _shape(node)
        if a is None or b is None or len(b) != 2 or b[0] != a[0]:
            return None
        if len(a) == 2:
            kind = "pass"
    elif node.op != "call_module":
        a, b = _shape(src), _shape(node)
        if a is None or b is None or a[:2] != b[:2]:  # pooling/activations keep batch and channels
            return None
    return src, zero, kind


def _chain(gm: fx.GraphModule, consumer: fx.Node):
    """Walk back from ``consumer``'s input: ``(producer node or None, ops, zero_preserving, block, start)``."""
    node = consumer.args[0]
    ops, zero, block = [], True, 1
    while True:
        if len(node.users) != 1:
            return None, ops, zero, block, node
        if node.op == "call_module" and _is_layer(gm.get_submodule(node.target)):
            return node, ops, zero, block, node
        step = _step(gm, node)
        if step is None:
            return None, ops, zero, block, node
        src, z, kind = step
        if kind == "flatten":
            shape = _shape(src)
            block = math.prod(shape[2:])
        ops.append((node, kind))
        zero = zero and z
        node = src


def _dead_inputs(layer: nn.Module, channels: int, block: int) -> torch.Tensor:
    """Bool ``(channels,)``: the consumer's weights reading each input unit are all zero."""
    w = layer.weight
    if isinstance(layer, nn.Linear):
        return (w.reshape(w.shape[0], channels, block) == 0).all(2).all(0)
    return (w == 0).transpose(0, 1).reshape(w.shape[1], -1).all(1)


def _dead_outputs(layer: nn.Module) -> torch.Tensor:
    w = layer.weight
    dead = (w.reshape(w.shape[0], -1) == 0).all(1)
    if layer.bias is not None:
        dead = dead & (layer.bias == 0)
    return dead


def _resized(layer: nn.Module, out_keep=None, in_keep=None, block: int = 1) -> nn.Module:
    w, b = layer.weight, layer.bias
    if out_keep is not None:
        w = w[out_keep]
        b = None if b is None else b[out_keep]
    if in_keep is not None:
        if isinstance(layer, nn.Linear) and block > 1:
            cols = (in_keep[:, None] * block + torch.arange(block, device=in_keep.device)).reshape(-1)
            w = w[:, cols]
        else:
            w = w[:, in_keep]
    if isinstance(layer, nn.Linear):
        new = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
    else:
        new = type(layer)(w.shape[1], w.shape[0], layer.kernel_size, layer.stride, layer.padding, layer.dilation,
                          1, b is not None, layer.padding_mode, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w)
        if b is not None:
            new.bias.copy_(b)
    new.train(layer.training)
    return new


def _resized_bn(bn: nn.modules.batchnorm._BatchNorm, keep: torch.Tensor) -> nn.Module:
    new = copy.deepcopy(bn)
    new.num_features = int(keep.numel())
    with torch.no_grad():
        for name in ("weight", "bias"):
            p = getattr(bn, name)
            if p is not None:
                setattr(new, name, nn.Parameter(p[keep].clone(), requires_grad=p.requires_grad))
        for name in ("running_mean", "running_var"):
            t = getattr(bn, name)
            if t is not None:
                setattr(new, name, t[keep].clone())
    return new


def _set(gm: fx.GraphModule, target: str, module: nn.Module) -> None:
    parent, _, leaf = target.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, leaf, module)


@torch.no_grad()
def shrink(model: nn.Module, example_input: torch.Tensor, *, atol: float = 1e-5) -> tuple[nn.Module, dict]:
    """A physically smaller copy of ``model`` without its dead neurons, filters and inputs.

    Args:
        model: the pruned network (its zeros decide; e.g. after :class:`~mcgraph.optim.SpikeSlabEM`).
        example_input: a batch the network accepts (shapes are propagated with it; eval mode).
        atol: tolerance of the built-in check that outputs are unchanged.

    Returns:
        ``(small_model, report)``: a ``torch.fx.GraphModule`` (or an unchanged copy with
        ``report["traced"] = False`` when the network cannot be traced) and
        ``{"before": count, "after": count, "removed": {layer: units}, "selected": {layer: kept inputs}}``
        with the counts of :func:`count_compute`.

    Raises:
        RuntimeError: the smaller network's outputs differ from the original's (a bug, never silent).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(example_input, torch.Tensor):
        raise TypeError(f"example_input must be a tensor, got {type(example_input).__name__}")
    before = count_compute(model, example_input)
    was_training = model.training
    source = copy.deepcopy(model).eval()
    reference = source(example_input)
    try:
        gm = fx.symbolic_trace(copy.deepcopy(source))
    except Exception as e:  # noqa: BLE001 — untraceable networks are reported, not shrunk
        out = copy.deepcopy(model)
        return out, {"before": before, "after": before, "removed": {}, "selected": {}, "traced": False,
                     "reason": f"{type(e).__name__}: {e}"}
    ShapeProp(gm).propagate(example_input)
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    removed, selected = {}, {}
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or calls[node.target] != 1 or not _is_layer(gm.get_submodule(node.target)):
            continue
        consumer = gm.get_submodule(node.target)
        producer_node, ops, zero, block, start = _chain(gm, node)
        producer = None
        if producer_node is not None and calls[producer_node.target] == 1:
            producer = gm.get_submodule(producer_node.target)
        in_units = consumer.weight.shape[1] // (block if isinstance(consumer, nn.Linear) else 1)
        if producer is not None and producer.weight.shape[0] == in_units:
            dead = _dead_inputs(consumer, in_units, block)
            if zero:
                dead = dead | _dead_outputs(producer)
            if not dead.any() or dead.all():
                continue
            keep = torch.nonzero(~dead).flatten()
            _set(gm, producer_node.target, _resized(producer, out_keep=keep))
            for op, kind in ops:
                if kind == "bn":
                    _set(gm, op.target, _resized_bn(gm.get_submodule(op.target), keep))
            _set(gm, node.target, _resized(consumer, in_keep=keep, block=block))
            removed[producer_node.target] = int(dead.sum())
        elif producer is None:
            dead = _dead_inputs(consumer, consumer.weight.shape[1], 1)
            if not dead.any() or dead.all():
                continue
            keep = torch.nonzero(~dead).flatten()
            dim = -1 if isinstance(consumer, nn.Linear) else 1
            name = f"{node.target.replace('.', '_')}_select"
            gm.add_submodule(name, SelectFeatures(dim, keep, consumer.weight.shape[1]))
            with gm.graph.inserting_before(node):
                sel = gm.graph.call_module(name, (node.args[0],))
            node.replace_input_with(node.args[0], sel)
            _set(gm, node.target, _resized(consumer, in_keep=keep))
            selected[node.target] = keep.tolist()
    gm.graph.lint()
    gm.recompile()
    out = gm(example_input)
    if out.shape != reference.shape or not torch.allclose(out, reference, atol=atol, rtol=1e-4):
        raise RuntimeError(f"shrink: the smaller network's outputs differ from the original's (max |Δ| "
                           f"{float((out - reference).abs().max()) if out.shape == reference.shape else 'shape'}); "
                           "this is a bug")
    gm.train(was_training)
    after = count_compute(gm, example_input)
    return gm, {"before": before, "after": after, "removed": removed, "selected": selected, "traced": True}
