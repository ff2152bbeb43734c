"""Chunks of whole-network samples sized from the device's memory budget (:mod:`mcgraph.engine.budget`).

Without a ``chunk_size``, the first chunk is one sample, run while the tensors it allocates are
counted (:func:`mcgraph.engine.budget.peak_bytes`: its weight samples, its activations, what a
backward would keep); the other chunks hold as many samples as the budget allows at that size. Sample ``i`` reads row ``i`` of every noise stream
whatever the chunks, so the result is the same for any chunking, up to float rounding.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from ..engine import budget
from .context import chunks


def device_of(model: nn.Module, x=None) -> torch.device:
    """The device whose memory a chunk of ``model`` uses: its parameters', else the input's (CPU if none)."""
    for p in model.parameters():
        return p.device
    tensors = x.values() if isinstance(x, dict) else [x]
    return next((t.device for t in tensors if isinstance(t, torch.Tensor)), torch.device("cpu"))


def sized_chunks(caller: str, run_chunk: Callable[[int, int], torch.Tensor], num_samples: int,
                 chunk_size: int | None, device: torch.device, offset: int = 0) -> Iterator[torch.Tensor]:
    """``run_chunk(start, stop)`` over windows covering ``[offset, offset + num_samples)``.

    ``chunk_size`` given: windows of that size. ``None``: a first window of one sample, measured
    (:func:`mcgraph.engine.budget.peak_bytes`; run with autograd on, so that the measure is that of a
    training chunk too; under ``torch.no_grad()`` its output is detached),
    then windows of :func:`mcgraph.engine.budget.from_bytes` samples.
    """
    if num_samples <= 0:
        return
    if chunk_size is not None:
        budget.given(caller, chunk_size, num_samples)
        for a, b in chunks(num_samples, chunk_size):
            yield run_chunk(offset + a, offset + b)
        return
    grad = torch.is_grad_enabled()
    with torch.enable_grad():
        out, kept = budget.peak_bytes(lambda: run_chunk(offset, offset + 1))
    if not grad:
        out = out.detach()
    per_sample = max(kept, out.numel() * out.element_size(), 1)
    rest = budget.from_bytes(caller, per_sample, num_samples, device, probe=1).samples
    yield out
    for a, b in chunks(num_samples - 1, rest):
        yield run_chunk(offset + 1 + a, offset + 1 + b)


__all__ = ["device_of", "sized_chunks"]
