"""Chunked tier: forward over chunks without a graph, backward replays each chunk.

``y = (1/M) Σ_i fn(w_i)`` for any ``fn`` (a whole network, a softmax over a row).
The forward keeps only the seed; the backward redraws each chunk's noise from
the same seed, rebuilds that chunk's graph, and accumulates

.. math::
    \\bar x \\mathrel{+}= \\Big(\\frac{\\partial}{\\partial x}\\sum_{i\\in\\text{chunk}}
    fn(w_i)\\Big)^{\\!\\top} \\frac{g}{M}

for every input ``x`` (upstream gradient ``g``). Memory is O(chunk), never O(M).

Inputs are the sampling form's (loc, scale) — replayed through detached copies
— plus the autograd *leaves* that ``fn`` (or a generic ``rsample``) reaches,
found by one probe evaluation. Gradients w.r.t. those leaves flow through any
graph that links them to ``fn`` (``retain_graph`` keeps that outer graph).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.autograd.function import once_differentiable

from ..plan.families import GenericForm, SamplingForm
from .sampling import samples, stream_for


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision values (autocast), the values' own floating dtype otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def batched(fn: Callable) -> Callable:
    """``fn`` over a leading sample axis: ``torch.func.vmap`` when it works, else a loop."""
    vf = torch.func.vmap(fn)

    def loop(w):
        return torch.stack([fn(wi) for wi in w])

    def call(w):
        if call.use_loop:
            return loop(w)
        try:
            return vf(w)
        except Exception:  # vmap cannot run fn (data-dependent code, in-place ops): loop instead
            call.use_loop = True
            return loop(w)

    call.use_loop = False
    return call


def graph_leaves(out: torch.Tensor, exclude=()) -> list[torch.Tensor]:
    """Autograd leaves (tensors with ``requires_grad``) that ``out`` depends on."""
    excluded = {id(t) for t in exclude}
    seen, stack, leaves = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None and id(var) not in excluded and all(v is not var for v in leaves):
            leaves.append(var)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return leaves


@dataclass(frozen=True, eq=False)
class ChunkedSpec:
    """Non-tensor arguments of :class:`ChunkedMC`."""

    form: SamplingForm | GenericForm
    fn: Callable
    seed: int
    num_samples: int
    chunk_size: int
    n_params: int  # leading inputs that are the form's (loc, scale)
    moments: object = None  # a mcgraph.engine.stderr.SampleMoments fed with the per-sample values (return_stderr)
    shard: object = None  # a SampleShard: this process's samples only, sums all-reduced
    out_like: tuple = ()  # (shape, dtype, device) of the output: a process without samples adds zeros


def _window(spec: ChunkedSpec, stream) -> tuple[int, int]:
    return (0, spec.num_samples) if spec.shard is None else spec.shard.stream_window(stream, spec.num_samples)


class ChunkedMC(torch.autograd.Function):
    """``y = mean_i fn(w_i)``; inputs ``(spec, *params, *leaves)``, output ``fn``'s shape."""

    @staticmethod
    def forward(ctx, spec: ChunkedSpec, *inputs):
        ctx.spec = spec
        ctx.input_count = len(inputs)
        ctx.save_for_backward(*inputs)
        total = None
        stream = stream_for(spec.form, spec.seed, spec.num_samples)
        start, stop = _window(spec, stream)
        with torch.no_grad():
            for a in range(start, stop, spec.chunk_size):
                rows = stream.rows(a, min(a + spec.chunk_size, stop))
                values = spec.fn(samples(spec.form, rows))
                if spec.moments is not None:
                    spec.moments.add(values)
                part = values.sum(0, dtype=accumulation_dtype(values.dtype))
                total = part if total is None else total + part
        if spec.shard is not None:
            (total,) = spec.shard.sum(lambda: [total], [(spec.out_like[0], accumulation_dtype(spec.out_like[1]),
                                                         spec.out_like[2])])
            if total is None:
                total = torch.zeros(spec.out_like[0], dtype=spec.out_like[1], device=spec.out_like[2])
        return (total / spec.num_samples).to(spec.out_like[1])  # fn's dtype (an autocast dtype stays)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        spec: ChunkedSpec = ctx.spec
        inputs = ctx.saved_tensors
        params, leaves = inputs[: spec.n_params], inputs[spec.n_params:]
        if spec.shard is not None:  # one all-reduce of every input's gradient
            grads = spec.shard.sum(lambda: ChunkedMC._replay(spec, params, leaves, grad_out), inputs)
            return (None, *grads)
        return (None, *ChunkedMC._replay(spec, params, leaves, grad_out))

    @staticmethod
    def _replay(spec: ChunkedSpec, params, leaves, grad_out) -> list:
        """Σ over this process's chunks of the chunk's VJP, one entry per input (``None``: no gradient)."""
        grads = [None] * (len(params) + len(leaves))
        stream = stream_for(spec.form, spec.seed, spec.num_samples)
        g = grad_out / spec.num_samples
        lo, hi = _window(spec, stream)
        for start in range(lo, hi, spec.chunk_size):
            with torch.enable_grad():  # a generic form's rows carry the rsample graph
                rows = stream.rows(start, min(start + spec.chunk_size, hi))
                p = [t.detach().requires_grad_(t.requires_grad) for t in params]
                if isinstance(spec.form, SamplingForm):
                    loc, scale = (p if spec.form.loc is not None else (None, p[0]))
                    w = spec.form.apply_transforms(spec.form.base(rows, loc, scale))
                    w = w.expand((rows.shape[0],) + tuple(spec.form.shape))
                else:
                    w = rows
                value = spec.fn(w).sum(0)
                targets = [t for t in (*p, *leaves) if t.requires_grad]
                if not targets or not value.requires_grad:
                    continue
                part = torch.autograd.grad(value, targets, g, retain_graph=True, allow_unused=True)
            it = iter(part)
            for k, t in enumerate((*p, *leaves)):
                if t.requires_grad:
                    gk = next(it)
                    if gk is not None:
                        grads[k] = gk if grads[k] is None else grads[k] + gk
        return grads


def chunked_value(form, fn: Callable, seed: int, num_samples: int, chunk_size: int,
                  shard=None, moments=None) -> torch.Tensor:
    """E[fn(w)] by the chunked Function, connected to every tensor the samples and ``fn`` depend on.

    ``shard`` (a :class:`mcgraph.engine.distributed.SampleShard`) restricts this process to its samples;
    ``moments`` (a :class:`mcgraph.engine.stderr.SampleMoments`) also receives the per-sample values.
    """
    bfn = batched(fn)
    # Probe one chunk of one sample to find the leaves fn (and a generic rsample) reach.
    stream = stream_for(form, seed, num_samples)
    if isinstance(form, SamplingForm):
        params = form.params
        detached = [t.detach().requires_grad_() for t in params]
        loc, scale = detached if form.loc is not None else (None, detached[0])
        probe_rows = stream.rows(0, 1)
        with torch.enable_grad():
            w = form.apply_transforms(form.base(probe_rows, loc, scale))
            w = w.expand((1,) + tuple(form.shape))
            out = bfn(w)
        leaves = graph_leaves(out, exclude=detached) if out.requires_grad else []
    else:
        params = ()
        with torch.enable_grad():
            out = bfn(stream.rows(0, 1))
        leaves = graph_leaves(out) if out.requires_grad else []
    spec = ChunkedSpec(form, bfn, seed, num_samples, chunk_size, len(params), moments, shard,
                       (tuple(out.shape[1:]), out.dtype, out.device))
    return ChunkedMC.apply(spec, *params, *leaves)
