"""Sums of per-example squared gradients, from one backward pass (no batch-size-1 loop).

For a loss ``L = Σ_i c·ℓ_i`` over a batch of ``n`` examples (``c = 1/n`` for a mean,
``1`` for a sum) and a parameter θ of a supported layer, the backward pass gives
``∂L/∂θ = Σ_i p_i`` where ``p_i = c·∇_θ ℓ_i`` is example ``i``'s share.
:class:`SquaredGradients` records, during that same backward, the layer's input
``a`` (forward hook) and output gradient ``b`` (a hook on the output tensor) and returns

.. math::
    S_\\theta = \\sum_{i=1}^n p_i \\odot p_i ,

from which an optimizer forms ``ĥ = (1/n) Σ_i g_i²`` with ``g_i = p_i / c``
(VOGN's Gauss–Newton estimate; seed 003, Algorithm 1 line 12).

Per layer (``p_i`` exactly, every formula checked against a batch-size-1 autograd loop):

* ``Linear`` on ``(n, in)``: ``p_i = b_i a_iᵀ``, so ``S_W = (b²)ᵀ(a²)`` and ``S_b = Σ_i b_i²``
  (the activation × output-gradient identity, no per-example tensor); on ``(n, *, in)``
  the shares are summed over the extra axes first (``einsum``).
* ``Conv1d/2d/3d`` (any stride, padding, dilation, groups, padding mode): the per-example
  weight gradients are one grouped ``convolution_backward`` with the batch folded into the
  groups (``n·groups`` groups), in chunks of examples that bound the memory to
  :data:`CHUNK_ELEMENTS`; the bias share is ``Σ_spatial b_i`` (exact, squared after the sum).
* ``BatchNorm1d/2d/3d`` (affine): ``p_γ,i = Σ_spatial x̂_i b_i``, ``p_β,i = Σ_spatial b_i``
  with ``x̂`` recomputed from the input with the statistics the layer used.
* ``LSTM`` (padded input, any number of layers, either direction, ``batch_first`` or not, an initial
  state): the layer recomputed step by step from its recorded input, and the LSTM's backward
  recurrence run by hand on the recorded gradients of ``output``, ``h_n`` and ``c_n``; with the gates'
  gradients ``δG``,
  ``p_i(W_ih) = Σ_t δG_it x_itᵀ``, ``p_i(W_hh) = Σ_t δG_it h_i,t-1ᵀ`` (:class:`LSTMRule`).

In a network that normalises with batch statistics (BatchNorm in training mode) the
examples interact, so ``p_i`` is example ``i``'s term of the batch gradient (as in
torchsso and BackPACK), not the gradient of ``ℓ_i`` alone.

A layer called several times in one forward (shared weights) has its shares summed
over the calls before squaring. Every supported layer's input must have the batch on
dim 0 (an LSTM's on dim 1 when it is not ``batch_first``), and one closure must run exactly one
forward and one backward.

Extending: one rule class plus :func:`register_rule`; the most specific class wins.

Example:
    >>> import torch
    >>> from mcgraph.optim.per_example import SquaredGradients
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    >>> with SquaredGradients(net) as sq:
    ...     torch.nn.functional.cross_entropy(net(x), y, reduction="sum").backward()
    >>> sq.batch_size, sq.sums[net[0].weight].shape
    (5, torch.Size([4, 3]))
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import Registry

__all__ = ["SquaredGradients", "PerExampleRule", "register_rule", "rule_for", "RULES", "CHUNK_ELEMENTS",
           "common_batch_size", "unsupported_modules", "per_example_loop"]

#: Most elements of one chunk of per-example gradients held at once (float32: 64 MiB).
CHUNK_ELEMENTS = 1 << 24


class PerExampleRule:
    """How one layer type turns its input ``a`` and output gradient ``b`` into per-example shares.

    Subclasses implement :meth:`per_example`; :meth:`squared_sum` may be overridden by a
    cheaper identity. ``prepare`` runs in the forward hook (it may transform the input,
    e.g. pad it or normalise it) and must not keep a graph.
    """

    def prepare(self, module: nn.Module, a: torch.Tensor) -> torch.Tensor:
        return a.detach()

    def prepare_call(self, module: nn.Module, args: tuple, kwargs: dict):
        """What the rule keeps of one call (default: :meth:`prepare` of the first positional input)."""
        return self.prepare(module, args[0])

    def outputs(self, module: nn.Module, output) -> list[torch.Tensor]:
        """The output tensors whose gradients the rule reads (default: the output, when it is one tensor)."""
        return [output] if isinstance(output, torch.Tensor) else []

    def output_gradients(self, module: nn.Module, grads: list[torch.Tensor]):
        """``b`` for :meth:`per_example` from the gradients of :meth:`outputs` (zeros where none reached one)."""
        return grads[0]

    def batch_size(self, a) -> int:
        """The number of examples of a prepared call."""
        return int(a.shape[0])

    def per_example(self, module: nn.Module, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{param name: (n, *param.shape)}`` shares ``p_i`` of the call with input ``a``, output grad ``b``."""
        raise NotImplementedError

    def squared_sum(self, module: nn.Module, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{param name: Σ_i p_i²}`` for one call (default: square :meth:`per_example`)."""
        return {k: v.square().sum(0) for k, v in self.per_example(module, a, b).items()}


RULES: Registry = Registry("per-example gradient rule", by_type=True)
"""Layer type → its rule (see :func:`register_rule`)."""


def register_rule(*module_types: type) -> Callable[[type], type]:
    """Register a :class:`PerExampleRule` subclass for ``module_types`` (decorator)."""

    def decorator(cls: type) -> type:
        for t in module_types:
            RULES.register(t, cls())
        return cls

    return decorator


def rule_for(module: nn.Module) -> PerExampleRule | None:
    """The rule of the most specific registered class of ``module`` (``None`` when unsupported)."""
    return RULES.lookup(type(module), None)


def _trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    return {k: p for k, p in module.named_parameters(recurse=False) if p is not None and p.requires_grad}


def unsupported_modules(model: nn.Module) -> list[tuple[str, str]]:
    """``(qualified name, type name)`` of every module owning trainable parameters that no rule supports."""
    return [(name or "<model>", type(m).__name__) for name, m in model.named_modules()
            if _trainable(m) and rule_for(m) is None]


def _chunks(n: int, per_example_numel: int) -> Iterable[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // max(1, per_example_numel))
    for start in range(0, n, step):
        yield start, min(n, start + step)


@register_rule(nn.Linear)
class LinearRule(PerExampleRule):
    """``p_i = Σ_t b_{it} a_{it}ᵀ`` (``t`` over the extra axes of ``(n, *, in)``)."""

    def per_example(self, module, a, b):
        a3, b3 = a.reshape(a.shape[0], -1, a.shape[-1]), b.reshape(b.shape[0], -1, b.shape[-1])
        out = {"weight": torch.einsum("nto,nti->noi", b3, a3)}
        if module.bias is not None:
            out["bias"] = b3.sum(1)
        return out

    def squared_sum(self, module, a, b):
        if a.dim() != 2:
            return super().squared_sum(module, a, b)
        b2 = b.square()
        out = {"weight": b2.t() @ a.square()}
        if module.bias is not None:
            out["bias"] = b2.sum(0)
        return out


def _same_padding(module: nn.modules.conv._ConvNd) -> list[int]:
    """``F.pad`` widths of ``padding='same'`` (torch puts the odd extra element on the right)."""
    pad = []
    for d, k in zip(reversed(module.dilation), reversed(module.kernel_size)):
        total = d * (k - 1)
        pad += [total // 2, total - total // 2]
    return pad


@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvRule(PerExampleRule):
    """Per-example weight gradients as one grouped ``convolution_backward`` (batch folded into the groups)."""

    def prepare(self, module, a):
        a = a.detach()
        if module.padding_mode != "zeros":
            return F.pad(a, module._reversed_padding_repeated_twice, mode=module.padding_mode)
        if module.padding == "same":
            return F.pad(a, _same_padding(module))
        return a

    @staticmethod
    def _padding(module) -> list[int]:
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            return [0] * len(module.kernel_size)  # already applied by prepare
        return list(module.padding)

    def per_example(self, module, a, b):
        w = module.weight
        n = a.shape[0]
        parts = []
        for start, stop in _chunks(n, w.numel()):
            m = stop - start
            aa = a[start:stop].reshape(1, m * a.shape[1], *a.shape[2:])
            bb = b[start:stop].reshape(1, m * b.shape[1], *b.shape[2:])
            zero_weight = w.new_zeros(()).expand(m * w.shape[0], *w.shape[1:])
            _, gw, _ = torch.ops.aten.convolution_backward(
                bb, aa, zero_weight, None, list(module.stride), self._padding(module), list(module.dilation),
                False, [0] * len(module.kernel_size), m * module.groups, [False, True, False])
            parts.append(gw.reshape(m, *w.shape))
        out = {"weight": torch.cat(parts) if len(parts) > 1 else parts[0]}
        if module.bias is not None:
            out["bias"] = b.sum(tuple(range(2, b.dim())))
        return out

    def squared_sum(self, module, a, b):
        w = module.weight
        total = None
        for start, stop in _chunks(a.shape[0], w.numel()):
            part = self.per_example(module, a[start:stop], b[start:stop])["weight"].square().sum(0)
            total = part if total is None else total + part
        out = {"weight": total}
        if module.bias is not None:
            out["bias"] = b.sum(tuple(range(2, b.dim()))).square().sum(0)
        return out


@register_rule(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
class BatchNormRule(PerExampleRule):
    """``p_γ,i = Σ_spatial x̂_i b_i`` and ``p_β,i = Σ_spatial b_i``, ``x̂`` with the statistics the layer used."""

    def prepare(self, module, a):
        a = a.detach()
        batch_stats = module.training or module.running_mean is None
        with torch.no_grad():
            if batch_stats:
                return F.batch_norm(a, None, None, None, None, True, 0.0, module.eps)
            return F.batch_norm(a, module.running_mean, module.running_var, None, None, False, 0.0, module.eps)

    def per_example(self, module, a, b):
        dims = tuple(range(2, b.dim()))
        out = {}
        if module.weight is not None:
            out["weight"] = (a * b).sum(dims) if dims else a * b
        if module.bias is not None:
            out["bias"] = b.sum(dims) if dims else b
        return out


def inputs_in_order(inputs: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``inputs`` (n, T, ·) with its time axis in ``order`` (a view when the order is forward)."""
    return inputs if order[0] == 0 else inputs.flip(1)


@register_rule(nn.LSTM)
class LSTMRule(PerExampleRule):
    """Per-example gradients of an ``nn.LSTM`` from its gates' gradients, recomputed step by step.

    torch's LSTM is one fused operator, so the hooks see only its input and its outputs' gradients. The
    rule recomputes the layer step by step (the same cell equations, the gates
    ``G_t = W_ih x_t + b_ih + W_hh h_{t-1} + b_hh`` of every layer and direction) and runs the LSTM's
    backward recurrence by hand on the recorded gradients of ``output``, ``h_n`` and ``c_n``, batched over
    the examples. The examples do not interact, so the gates' gradients ``δG`` are per example, and

    .. math::
        p_i(W_{ih}) = \\sum_t δG_{it} x_{it}^\\top, \\quad p_i(W_{hh}) = \\sum_t δG_{it} h_{i,t-1}^\\top, \\quad
        p_i(b_{ih}) = p_i(b_{hh}) = \\sum_t δG_{it}

    (the linear layer's identity with time as the extra axis). Exact up to float rounding: the recomputed
    forward is torch's to rounding, not bit for bit. Takes batched padded input, either ``batch_first``,
    several layers, both directions and an initial state; refuses a ``PackedSequence``, unbatched
    input, ``proj_size > 0`` and dropout between layers in training mode (the masks the forward drew
    cannot be recomputed).
    """

    def prepare_call(self, module, args, kwargs):
        x = args[0]
        hx = args[1] if len(args) > 1 else kwargs.get("hx")
        where = f"nn.LSTM({module.input_size}, {module.hidden_size})"
        if x.dim() != 3:  # (a PackedSequence is refused by outputs)
            raise ValueError(f"model: {where} got unbatched input of shape {tuple(x.shape)}; per-example "
                             "gradients need a batch")
        if module.proj_size:
            raise ValueError(f"model: {where} has proj_size={module.proj_size}; per-example gradients of an "
                             "LSTM with projections are not supported")
        if module.training and module.dropout > 0 and module.num_layers > 1:
            raise ValueError(f"model: {where} applies dropout={module.dropout} between its layers in training "
                             "mode; its per-example gradients would need the dropout masks the forward drew. Use "
                             "dropout=0, or put nn.Dropout between separate LSTM modules")
        x = x.detach() if module.batch_first else x.detach().transpose(0, 1)
        h0 = c0 = None
        if hx is not None:
            h0, c0 = hx[0].detach(), hx[1].detach()
        return x, h0, c0

    def outputs(self, module, output):
        out, (h, c) = output
        if isinstance(out, nn.utils.rnn.PackedSequence):
            raise TypeError(f"model: nn.LSTM({module.input_size}, {module.hidden_size}) got a PackedSequence; "
                            "per-example gradients of an LSTM take padded (batch, time, features) tensors")
        return [out, h, c]

    def output_gradients(self, module, grads):
        g_out, g_h, g_c = grads
        return (g_out if module.batch_first else g_out.transpose(0, 1)), g_h, g_c

    def batch_size(self, a) -> int:
        return int(a[0].shape[0])

    @torch.no_grad()
    def _gate_gradients(self, module, a, b) -> list:
        """``[(layer, direction, δG, inputs, previous h)]``, each ``(n, T, ·)`` in the direction's processing
        order, for the recorded call: the layer run forward step by step (keeping every step's gates and
        cells), then the LSTM's backward recurrence by hand, from the last layer down."""
        x, h0, c0 = a
        g_out, g_h, g_c = b
        n, steps = x.shape[0], x.shape[1]
        dirs = 2 if module.bidirectional else 1
        hidden = module.hidden_size
        if h0 is None:
            h0 = c0 = x.new_zeros(module.num_layers * dirs, n, hidden)
        saved, layer_in = [], x
        for layer in range(module.num_layers):
            outs = []
            for d in range(dirs):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                w_ih, w_hh = getattr(module, "weight_ih" + sfx), getattr(module, "weight_hh" + sfx)
                bias = getattr(module, "bias_ih" + sfx) + getattr(module, "bias_hh" + sfx) if module.bias else None
                proj = F.linear(layer_in, w_ih, bias)  # (n, T, 4H): the input's part of every step's gates
                h, c = h0[layer * dirs + d], c0[layer * dirs + d]
                order = list(range(steps - 1, -1, -1)) if d else list(range(steps))
                acts, cells, prev_h, prev_c, hs = [], [], [], [], [None] * steps
                for t in order:
                    i, f, cell, o = torch.addmm(proj[:, t], h, w_hh.t()).chunk(4, 1)
                    i, f, cell, o = i.sigmoid(), f.sigmoid(), cell.tanh(), o.sigmoid()
                    prev_h.append(h)
                    prev_c.append(c)
                    c = f * c + i * cell
                    h = o * c.tanh()
                    acts.append((i, f, cell, o))
                    cells.append(c)
                    hs[t] = h
                outs.append(torch.stack(hs, 1))
                saved.append((inputs_in_order(layer_in, order), order, acts, cells, prev_h, prev_c, w_ih, w_hh))
            layer_in = torch.cat(outs, -1) if dirs > 1 else outs[0]
        result = [None] * len(saved)
        d_out = g_out  # the gradient of the current layer's output sequence, (n, T, dirs·H) in time order
        for layer in range(module.num_layers - 1, -1, -1):
            d_in = None
            for d in range(dirs):
                k = layer * dirs + d
                inputs, order, acts, cells, prev_h, prev_c, w_ih, w_hh = saved[k]
                d_seq = d_out[..., d * hidden:(d + 1) * hidden]
                dh_next, dc_next = g_h[k], g_c[k]
                deltas = [None] * steps
                for s in range(steps - 1, -1, -1):  # the processing order, backwards
                    i, f, cell, o = acts[s]
                    tc = cells[s].tanh()
                    dh = d_seq[:, order[s]] + dh_next
                    dc = dh * o * (1 - tc * tc) + dc_next
                    deltas[s] = delta = torch.cat((dc * cell * i * (1 - i), dc * prev_c[s] * f * (1 - f),
                                                   dc * i * (1 - cell * cell), dh * tc * o * (1 - o)), 1)
                    dc_next = dc * f
                    dh_next = delta @ w_hh
                dg = torch.stack(deltas, 1)
                result[k] = (layer, d, dg, inputs, torch.stack(prev_h, 1))
                if layer:  # the gradient of the layer below's output: δG (in time order) through W_ih
                    part = (dg.flip(1) if d else dg) @ w_ih
                    d_in = part if d_in is None else d_in + part
            d_out = d_in
        return result

    def per_example(self, module, a, b):
        shares = {}
        for layer, d, dg, inputs, prev in self._gate_gradients(module, a, b):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            shares["weight_ih" + sfx] = torch.einsum("ntg,nti->ngi", dg, inputs)
            shares["weight_hh" + sfx] = torch.einsum("ntg,nth->ngh", dg, prev)
            if module.bias:
                shares["bias_ih" + sfx] = shares["bias_hh" + sfx] = dg.sum(1)
        return shares

    def squared_sum(self, module, a, b):
        out = {}
        for layer, d, dg, inputs, prev in self._gate_gradients(module, a, b):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            for name, x in (("weight_ih", inputs), ("weight_hh", prev)):
                total = None
                for start, stop in _chunks(dg.shape[0], dg.shape[2] * x.shape[2]):
                    shares = torch.bmm(dg[start:stop].transpose(1, 2), x[start:stop])  # (m, 4H, in)
                    part = shares.mul_(shares).sum(0)
                    total = part if total is None else total + part
                out[name + sfx] = total
            if module.bias:
                out["bias_ih" + sfx] = dg.sum(1).square().sum(0)
                out["bias_hh" + sfx] = out["bias_ih" + sfx].clone()
        return out


class SquaredGradients:
    """Context manager: ``Σ_i p_i²`` of every supported layer's parameters over one backward.

    Args:
        model: the network; every module that owns trainable parameters must have a rule
            (else ``TypeError`` naming it).
        modules: restrict recording to these modules (default: every supported module).

    Attributes (after the block):
        sums: ``{parameter: Σ_i p_i²}`` (same shape and dtype as the parameter).
        batch_size: ``n``, the batch size the layers saw (dim 0 of their input).

    Raises:
        TypeError: a module with trainable parameters has no rule.
        ValueError: layers saw different batch sizes, or a layer ran but no gradient reached it
            (only for layers whose parameters the backward reached).
    """

    def __init__(self, model: nn.Module, modules: Iterable[nn.Module] | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        bad = unsupported_modules(model)
        if bad:
            raise TypeError("model: no per-example rule for " + ", ".join(f"{n} ({t})" for n, t in bad)
                            + f"; supported layers: {sorted({t.__name__ for t in RULES})} (parameter-free modules "
                            "are fine)")
        chosen = list(model.modules()) if modules is None else list(modules)
        self.modules = [m for m in chosen if _trainable(m) and rule_for(m) is not None]
        self._handles: list = []
        self._calls: dict[int, list] = {}
        self.sums: dict[nn.Parameter, torch.Tensor] = {}
        self.batch_size: int | None = None

    def __enter__(self) -> "SquaredGradients":
        self._calls = {id(m): [] for m in self.modules}
        for m in self.modules:
            self._handles.append(m.register_forward_hook(self._forward_hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> bool:
        for h in self._handles:
            h.remove()
        self._handles = []
        if exc[0] is None:
            self._finish()
        self._calls = {}
        return False

    def _forward_hook(self, module, args, kwargs, output):
        rule = rule_for(module)
        outs = rule.outputs(module, output) if torch.is_grad_enabled() else []
        if not any(o.requires_grad for o in outs):
            return
        # [prepared inputs, the outputs' gradients (None until the backward reaches them), the outputs' layouts]
        record = [rule.prepare_call(module, args, kwargs), [None] * len(outs),
                  [(o.shape, o.dtype, o.device) for o in outs]]
        self._calls[id(module)].append(record)
        for k, o in enumerate(outs):
            if o.requires_grad:
                def grad_hook(grad, record=record, k=k):
                    record[1][k] = grad.detach()

                o.register_hook(grad_hook)

    @staticmethod
    def _reached(module, records) -> list:
        """``(a, b)`` of the calls the backward reached (an output without a gradient counts as zeros)."""
        rule = rule_for(module)
        out = []
        for a, grads, layouts in records:
            if all(g is None for g in grads):
                continue
            grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                     for g, (shape, dtype, device) in zip(grads, layouts)]
            out.append((a, rule.output_gradients(module, grads)))
        return out

    def _finish(self) -> None:
        sizes = set()
        self.sums = {}
        for m in self.modules:
            calls = self._reached(m, self._calls.get(id(m), []))
            if not calls:
                continue
            rule = rule_for(m)
            sizes.update(rule.batch_size(a) for a, _ in calls)
            params = _trainable(m)
            if len(calls) == 1:
                squared = rule.squared_sum(m, *calls[0])
            else:
                shares = None
                for a, b in calls:
                    part = rule.per_example(m, a, b)
                    shares = part if shares is None else {k: shares[k] + part[k] for k in shares}
                squared = {k: v.square().sum(0) for k, v in shares.items()}
            for name, value in squared.items():
                if name in params:
                    p = params[name]
                    self.sums[p] = self.sums[p] + value if p in self.sums else value
        self.batch_size = common_batch_size(sizes)


def common_batch_size(sizes) -> int | None:
    """The one batch size the recorded layers saw (``None`` when none ran).

    Raises:
        ValueError: they saw different ones.
    """
    sizes = set(sizes)
    if len(sizes) > 1:
        raise ValueError(f"model: the supported layers saw different batch sizes {sorted(sizes)}; every layer's "
                         "input must have the batch on dim 0")
    return sizes.pop() if sizes else None


def per_example_loop(model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     x: torch.Tensor, y: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
    """Reference: ``Σ_i (∇_θ ℓ_i)²`` by a batch-size-1 loop (``loss_fn`` returns the loss of one example).

    Slow by design; used to test :class:`SquaredGradients`. BatchNorm must be in eval mode
    (a batch of one has no batch statistics).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), params, allow_unused=True)
        for t, g in zip(total, grads):
            if g is not None:
                t.add_(g.square())
    return dict(zip(params, total))

