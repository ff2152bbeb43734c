"""The seeded sample stream shared by every estimator (the same-noise contract)."""

from __future__ import annotations

import math

import torch

from ..budget import CPU_BUDGET, budget_bytes
from ..noise import backends as backend
from ..plan.families import GenericForm, SamplingForm
from ..noise.streams import BlockStream, rows_per_block


def sample_numel(form) -> int:
    return max(1, math.prod(form.noise_shape if isinstance(form, SamplingForm) else form.shape))


def stream_for(form, seed: int, num_samples: int) -> BlockStream:
    """Rows of ξ for a :class:`SamplingForm`, rows of w (``rsample``) for a :class:`GenericForm`.

    On the Triton backend (CUDA tensors, or ``MCGRAPH_BACKEND=triton``) the rows come from the
    kernels' Philox stream instead, so that every method of that backend sees the same noise.
    """
    triton_stream = backend.noise_stream(form, seed, num_samples)
    if triton_stream is not None:
        return triton_stream
    block = rows_per_block(sample_numel(form), num_samples)
    if isinstance(form, SamplingForm):  # ξ is drawn into the stream's reused block buffer
        return BlockStream(form.draw_noise, num_samples, block, seed, form.device, fills_out=form.noise.fills_out,
                           row_shape=tuple(form.noise_shape), dtype=form.dtype)
    return BlockStream(form.draw, num_samples, block, seed, form.device)


#: Sample elements per chunk for tiers that build per-chunk autograd graphs (fused, chunked) at the CPU
#: budget (:data:`mcgraph.engine.budget.CPU_BUDGET`): small enough for the chunk's temporaries to stay near
#: cache, large enough to amortise overhead. Other budgets scale it (a GPU's: 32× on a large device).
GRAPH_CHUNK_ELEMENTS = 1 << 20


def default_chunk(form, num_samples: int, tier: str = "collapsed") -> int:
    """Default samples per chunk: one noise block for statistics; for graph-building tiers, the sample
    elements the memory budget of the form's device allows (:mod:`mcgraph.engine.budget`; ~1 Mi on a CPU)."""
    if tier == "collapsed":
        return rows_per_block(sample_numel(form), num_samples)
    elements = GRAPH_CHUNK_ELEMENTS * budget_bytes(form.device).bytes // CPU_BUDGET
    return max(1, min(num_samples, elements // sample_numel(form)))


def samples(form, rows: torch.Tensor) -> torch.Tensor:
    """w for stream rows: ``T(loc + scale·ξ)`` or the rsample rows themselves."""
    if isinstance(form, GenericForm):
        return rows
    return form.sample(rows)
