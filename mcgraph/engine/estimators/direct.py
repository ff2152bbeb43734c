"""The naive estimators, for comparisons and tests only.

``direct`` builds the whole graph over all M samples at once (vectorised; what
most libraries do): its saved tensors grow as O(M · P). ``direct_loop`` is the
paper's Fig. 4a loop, one sample at a time, with the same graph size.
"""

from __future__ import annotations

from typing import Callable

import torch

from .chunked import batched
from .sampling import samples, stream_for


def direct_value(form, fn: Callable, seed: int, num_samples: int) -> torch.Tensor:
    """``(1/M) Σ_i fn(w_i)`` with every sample in one autograd graph (vectorised over samples)."""
    rows = stream_for(form, seed, num_samples).rows(0, num_samples)
    return batched(fn)(samples(form, rows)).mean(0)


def direct_loop_value(form, fn: Callable, seed: int, num_samples: int) -> torch.Tensor:
    """The same estimate as :func:`direct_value`, accumulated by a Python loop over samples."""
    stream = stream_for(form, seed, num_samples)
    total = None
    for i in range(num_samples):
        value = fn(samples(form, stream.rows(i, i + 1))[0])
        total = value if total is None else total + value
    return total / num_samples
