"""Fused tier: sample, evaluate and reduce value *and* gradients in one pass.

For an elementwise ``h`` and ``w_i = T(u_i)``, ``u_i = loc + scale·ξ_i``, the
estimate ``y = (1/M) Σ_i h(w_i; c)`` (c: tensors ``h`` closes over) has the
per-element derivatives

.. math::
    \\frac{\\partial y}{\\partial\\,loc} = \\frac1M\\sum_i \\tilde h'(u_i), \\quad
    \\frac{\\partial y}{\\partial\\,scale} = \\frac1M\\sum_i \\tilde h'(u_i)\\,\\xi_i, \\quad
    \\frac{\\partial y}{\\partial c} = \\frac1M\\sum_i \\partial_c h(w_i; c),

with ``h̃ = h ∘ T``. The forward pass accumulates ``y`` and these means chunk by
chunk, so the Function saves O(P) tensors whatever M is. A chunk's sums come from one
body (:mod:`mcgraph.engine.estimators.fused_body`) that evaluates ``h`` with its forward-mode
derivatives (:mod:`mcgraph.engine.estimators.derivatives`), compiled for large calls; a program
with an op that has no forward rule takes a local autograd call on chunk-sized tensors. VJP (backward): for an
upstream gradient ``g`` of y's shape, ``grad_x = sum_to_size(g · ∂y/∂x, x.shape)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ..plan.families import SamplingForm
from ..noise.streams import rows_per_block
from ..plan.ir import Node
from . import fused_body
from .derivatives import Lowered, NoRule, lower
from .sampling import default_chunk, sample_numel, stream_for


@dataclass(frozen=True, eq=False)
class FusedSpec:
    """Non-tensor arguments of :class:`FusedElementwiseMC`."""

    form: SamplingForm
    node: Node
    captured: tuple  # the tensors of ``node`` that need grad, in input order
    seed: int
    num_samples: int
    chunk_size: int | None  # None: default_fused_chunk
    out_shape: torch.Size
    moments: object = None  # a mcgraph.engine.stderr.SampleMoments fed with the per-sample h (return_stderr)
    shard: object = None  # a SampleShard: this process's samples only, sums all-reduced
    lowered: Lowered | None = None  # the program for the forward-rule bodies; None: the autograd path


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(0)`` as one matrix-vector product (several times faster on CPU for many rows)."""
    if x.shape[0] == 1:
        return x[0]
    flat = x.reshape(x.shape[0], -1)
    with torch.autocast(x.device.type, enabled=False):  # accumulate in x's dtype, not autocast's
        return (torch.ones(x.shape[0], dtype=x.dtype, device=x.device) @ flat).reshape(x.shape[1:])


def _align(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """Rows ``(n, *s)`` viewed as ``(n, 1, …, 1, *s)`` with ``ndim`` dims after the sample axis.

    ``h``'s tensors may broadcast its output beyond the sample shape (``c * w`` with ``c`` of
    shape ``(2, 1)`` and ``w`` of shape ``(3,)``); the sample axis must stay in front.
    """
    extra = ndim - (x.dim() - 1)
    return x.reshape((x.shape[0],) + (1,) * extra + tuple(x.shape[1:])) if extra > 0 else x


def _evaluate(node: Node, w: torch.Tensor, subs: dict) -> torch.Tensor:
    """``h`` on rows ``w`` of shape ``(n, *out_shape)``, with the per-sample semantics of ``fn``.

    A scalar sample (``w`` of shape ``(n,)``) is evaluated under ``vmap``, as the direct estimator
    evaluates ``fn``: torch promotes two 0-d tensors by category and width (0-d float32 times 0-d
    float64 is float64) but lets a 0-d tensor defer to a dimensioned one, so evaluating the batched
    ``(n,)`` rows directly could round ``h`` to float32 where ``fn`` of one sample is float64.
    """
    if w.dim() == 1:
        try:
            return torch.func.vmap(lambda x: node(x, subs))(w)
        except Exception:  # an op vmap cannot batch: the batched rows, as for any other shape
            pass
    return node(w, subs)


def _body_spec(spec: FusedSpec, want: list) -> fused_body.BodySpec | None:
    """The forward-rule chunk body for ``spec``, or ``None`` when the autograd path must run."""
    form = spec.form
    if spec.lowered is None or fused_body.body_mode() == "autograd":
        return None
    transform = transform_name(form.transforms)
    if transform is None:
        return None
    slots = [spec.lowered.slot_of(c) for c, w in zip(spec.captured, want[2:]) if w]
    return fused_body.BodySpec(
        spec.lowered.tree, spec.lowered.key()[1], len(spec.out_shape), form.loc is None, transform,
        bool(want[0]), bool(want[1]), tuple(slots), len(spec.out_shape) == 0, spec.moments is not None)


def _spread(sums: tuple, want: list) -> tuple:
    """A body's sums ``(Σh, Σh̃', Σh̃'ξ, *wanted Σ∂h/∂c[, h])`` laid out as the autograd chunk's:
    one entry per captured tensor (``None`` where not wanted), then ``h`` (or ``None``)."""
    head, rest = list(sums[:3]), iter(sums[3:])
    per_c = [next(rest) if w else None for w in want[2:]]
    return tuple(head + per_c) + (next(rest, None),)


def transform_name(transforms) -> str | None:
    """``""`` (w = u), ``"exp"`` (w = eᵘ), or ``None`` for transforms the bodies do not cover."""
    if not transforms:
        return ""
    if len(transforms) == 1 and type(transforms[0]) is torch.distributions.transforms.ExpTransform:
        return "exp"
    return None


def _autograd_chunk(spec: FusedSpec, want: list, xi, loc_d, scale_d, captured) -> tuple:
    """One chunk's ``(Σh, Σh̃', Σh̃'ξ, *Σ∂h/∂c, h)`` by a local autograd call (the fallback path)."""
    form = spec.form
    out_shape = tuple(spec.out_shape)
    n = xi.shape[0]
    full = (n,) + out_shape
    fused_body._set_path("autograd")
    with torch.enable_grad():
        u = _align(form.base(xi, loc_d, scale_d), len(out_shape)).expand(full)
        u_leaf = u.detach().requires_grad_(any(want[:2]))
        c_leaves = [c.detach().expand(out_shape).requires_grad_(w) if w else c.detach()
                    for c, w in zip(captured, want[2:])]
        subs = {id(c): leaf for c, leaf in zip(spec.captured, c_leaves)}
        h = _evaluate(spec.node, form.apply_transforms(u_leaf), subs).expand(full)
        inputs = ([u_leaf] if any(want[:2]) else []) + [leaf for leaf, w in zip(c_leaves, want[2:]) if w]
        # h may not depend on an input (or carry no gradient at all, like where(w > 0, 1., 0.)):
        # such a derivative is zero.
        grads = (list(torch.autograd.grad(h, inputs, torch.ones_like(h), allow_unused=True))
                 if inputs and h.requires_grad else [None] * len(inputs))
    h = h.detach()
    out = [_row_sum(h), None, None]
    if any(want[:2]):
        gu = grads.pop(0)
        if want[0] and gu is not None:
            out[1] = _row_sum(gu)
        if want[1] and gu is not None:
            out[2] = _row_sum(gu * _align(xi, len(out_shape)))
    for w in want[2:]:
        out.append(grads.pop(0) if w else None)  # already summed over the chunk's rows by autograd
    return tuple(out) + (h,)


class FusedElementwiseMC(torch.autograd.Function):
    """``y = mean_i h(T(loc + scale·ξ_i))`` with gradients accumulated in the forward pass.

    Inputs: ``spec`` (:class:`FusedSpec`), ``loc`` (broadcastable to the sample shape,
    or ``None`` for a scaling form), ``scale`` (same), ``*captured`` (each broadcastable to
    ``spec.out_shape``). Output: shape ``spec.out_shape``.
    """

    @staticmethod
    def forward(ctx, spec: FusedSpec, loc, scale, *captured):
        form = spec.form
        out_shape = tuple(spec.out_shape)
        want = [loc is not None and loc.requires_grad, scale.requires_grad] + [c.requires_grad for c in captured]
        dtype = form.dtype
        value = torch.zeros(out_shape, dtype=dtype, device=form.device)
        acc = [torch.zeros(out_shape, dtype=dtype, device=form.device) if w else None for w in want]
        loc_d = loc.detach() if loc is not None else None
        scale_d = scale.detach()
        body = _body_spec(spec, want)
        elements = spec.num_samples * math.prod(out_shape)
        compile_ = body is not None and fused_body.wants_compile(elements, form.device)
        chunk = spec.chunk_size or default_fused_chunk(form, spec.num_samples, compile_ and fused_body.compiles(body))
        stream = stream_for(form, spec.seed, spec.num_samples)
        if spec.shard is None:
            rows = stream.chunks(chunk)
        else:
            from ..distributed import window_chunks

            rows = window_chunks(stream, chunk, *spec.shard.stream_window(stream, spec.num_samples))
        flush = fused_body.FLUSH_DENORMALS and elements >= fused_body.FLUSH_MIN_ELEMENTS
        tensors = tuple(t.detach() for t in spec.lowered.tensors) if body is not None else ()
        with fused_body.flush_denormals(flush):
            for _, _, xi in rows:
                if body is not None:
                    try:
                        sums = fused_body.run_chunk(body, compile_, xi, loc_d, scale_d, tensors)
                        sums = _spread(sums, want)
                    except NoRule:  # an argument combination no forward rule covers: autograd from here on
                        body = None
                if body is None:
                    sums = _autograd_chunk(spec, want, xi, loc_d, scale_d, captured)
                value += sums[0]
                if spec.moments is not None:
                    spec.moments.add(sums[-1])
                for k, w in enumerate(want):
                    if w and sums[1 + k] is not None:
                        acc[k] += sums[1 + k]
        if spec.shard is not None:  # one all-reduce of the value and every derivative
            value, *acc = spec.shard.sum(lambda: [value, *acc], [value, *[value] * len(acc)])
        m = spec.num_samples
        save_derivatives(ctx, (loc, scale, *captured), [a / m if a is not None else None for a in acc])
        return value / m

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        return derivatives_vjp(ctx, grad_out)


def save_derivatives(ctx, inputs, derivs) -> None:
    """Keep, for :func:`derivatives_vjp`, ``∂y/∂x`` (elementwise, y's shape; ``None`` where not wanted) of each
    input ``x`` (``None`` for an absent one) of a Function that computed them in its forward pass."""
    ctx.input_shapes = [None if t is None else t.shape for t in inputs]
    ctx.present = [d is not None for d in derivs]
    ctx.save_for_backward(*[d for d in derivs if d is not None])


def derivatives_vjp(ctx, grad_out) -> tuple:
    """The VJP of such a Function whose first argument is not a tensor: ``(None, *grad_x)``, with
    ``grad_x = sum_to_size(grad_out · ∂y/∂x, x.shape)``."""
    saved = iter(ctx.saved_tensors)
    return (None, *[(grad_out * next(saved)).sum_to_size(shape) if present else None
                    for present, shape in zip(ctx.present, ctx.input_shapes)])


def describe_body(form: SamplingForm, node: Node) -> str:
    """Which chunk body the fused tier runs for ``node`` under ``form``, in words (for ``explain``)."""
    from .derivatives import missing_rule

    if transform_name(form.transforms) is None:
        return fused_body.describe(None, "transforms other than one exp have no forward rule")
    return fused_body.describe(lower(node), missing_rule(node))


def fused_value(form: SamplingForm, node: Node, out_shape, seed: int, num_samples: int,
                chunk_size: int | None, shard=None, moments=None) -> torch.Tensor:
    """E[h(w)] by the fused Function (autograd-connected to loc, scale and h's tensors).

    ``chunk_size``: samples per chunk, ``None`` for :func:`default_fused_chunk`.
    ``shard`` (a :class:`mcgraph.engine.distributed.SampleShard`) restricts this process to its samples;
    ``moments`` (a :class:`mcgraph.engine.stderr.SampleMoments`) also receives the per-sample values.
    """
    from ..plan.ir import captured_tensors

    captured = captured_tensors(node)
    spec = FusedSpec(form, node, captured, seed, num_samples, chunk_size, torch.Size(out_shape), moments,
                     shard, lower(node))
    return FusedElementwiseMC.apply(spec, form.loc, form.scale, *captured)


def default_fused_chunk(form: SamplingForm, num_samples: int, compiled: bool) -> int:
    """Samples per chunk of the fused tier: :func:`~mcgraph.engine.estimators.sampling.default_chunk`'s, but at
    least two when the chunks will run the ``compiled`` body (``wants_compile`` and
    :func:`~mcgraph.engine.estimators.fused_body.compiles` of the call's body).

    That body takes chunks of two rows or more (a single row runs the eager body, several times slower), and a
    sample of more than ``GRAPH_CHUNK_ELEMENTS`` would otherwise make one-row chunks. It holds no temporary of
    the chunk's size beside the rows. Not where a noise block holds a single row (two-row chunks would then be
    copied across blocks).
    """
    rows = default_chunk(form, num_samples, "fused")
    if compiled and rows == 1 and num_samples > 1 and rows_per_block(sample_numel(form), num_samples) >= 2:
        return 2
    return rows
