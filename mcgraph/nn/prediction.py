"""Many-sample forward passes and predictive probabilities with memory bounded by a chunk."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..engine import checks
from ..engine.distributed import sharded
from ..engine.options import resolve_sampling
from .context import SampleRun, bayesian_modules, capture, chunks, sample_run, window
from .layers import SampleMode
from .model_checks import check_batch, input_hint, require_bayesian

__all__ = ["forward_samples", "predict", "Prediction", "run_window", "can_vectorize"]


def can_vectorize(model: nn.Module) -> bool:
    """Whether samples can share one batch (the batch repeated): no BatchNorm computing batch statistics.

    A BatchNorm in training mode would mix the statistics of different weight samples, so
    such models run their samples one at a time (each sample sees exactly its own batch).
    """
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or not m.track_running_stats):
            return False
    return True


def _is_shape_error(err: RuntimeError) -> bool:
    text = str(err)
    return any(k in text for k in ("shape", "size", "mat1 and mat2", "Expected", "dimension"))


def _repeat(x: torch.Tensor, times: int) -> torch.Tensor:
    return x if times == 1 else x.repeat(times, *([1] * (x.dim() - 1)))


def run_window(model: nn.Module, x: torch.Tensor, run: SampleRun, start: int, stop: int,
               vectorize: bool) -> torch.Tensor:
    """Outputs of samples ``start … stop-1`` of ``run``: shape ``(stop - start, B, …)``."""
    size = stop - start
    if vectorize or size == 1:
        with window(run, start, stop):
            try:
                out = model(_repeat(x, size))
            except RuntimeError as err:
                if not _is_shape_error(err):
                    raise
                raise ValueError(f"x: the model cannot run on x of shape {tuple(x.shape)}{input_hint(model)} "
                                 f"({err})") from err
        if out.shape[0] != size * x.shape[0]:
            raise ValueError(f"model: expected an output with {size * x.shape[0]} rows for {size} samples of a "
                             f"batch of {x.shape[0]}, got shape {tuple(out.shape)}")
        return out.reshape(size, x.shape[0], *out.shape[1:])
    return torch.stack([run_window(model, x, run, i, i + 1, True)[0] for i in range(start, stop)])


def forward_samples(model: nn.Module, x: torch.Tensor, num_samples: int, *, seed: int | None = None,
                    chunk_size: int | None = None, vectorize: bool | None = None) -> torch.Tensor:
    """``num_samples`` forward passes, every Bayesian layer resampled each time: ``(M, B, …)``.

    Sample ``i`` uses row ``i`` of each layer's seeded noise stream, whatever the
    chunking. A chunk of ``S`` samples runs as one forward on the batch repeated
    ``S`` times (each Bayesian layer applies its ``S`` weight samples to its own row
    blocks), unless ``vectorize=False`` or a BatchNorm computes batch statistics.

    Args:
        model: the network.
        x: the input batch ``(B, …)``.
        num_samples: M ≥ 1.
        seed: noise seed (``None``: drawn from the global generator).
        chunk_size: samples per forward (default: all M).
        vectorize: run a chunk's samples in one forward (default: :func:`can_vectorize`).

    Example:
        >>> import torch, mcgraph as mg
        >>> layer = mg.nn.BayesLinear(4, 2)
        >>> a = mg.nn.forward_samples(layer, torch.ones(3, 4), 5, seed=0)
        >>> b = mg.nn.forward_samples(layer, torch.ones(3, 4), 5, seed=0, chunk_size=2)
        >>> a.shape, torch.allclose(a, b)
        (torch.Size([5, 3, 2]), True)
    """
    require_bayesian(model, "mg.nn.forward_samples", allow_none=True)
    check_batch(x, None, "mg.nn.forward_samples")
    num_samples = checks.positive_int("num_samples", num_samples)
    chunk = checks.positive_int("chunk_size", chunk_size, allow_none=True) or num_samples
    seed = checks.seed("seed", seed)
    vectorize = can_vectorize(model) if vectorize is None else bool(vectorize)
    run = sample_run(model, num_samples, seed)
    return torch.cat([run_window(model, x, run, a, b, vectorize) for a, b in chunks(num_samples, chunk)])


class Prediction(NamedTuple):
    """``probs``: ``(B, K)`` predictive probabilities; ``sample_probs``: ``(M, B, K)`` per sample."""

    probs: torch.Tensor
    sample_probs: torch.Tensor


def _trunk_features(model: nn.Module, x: torch.Tensor):
    """(head, features) when exactly one Bayesian layer samples and produces the model's output."""
    sampling = [m for m in bayesian_modules(model) if m.mode == SampleMode.SAMPLE]
    if len(sampling) != 1 or any(getattr(m, "draws_run_noise", False) for m in model.modules()):
        return None, None
    head = sampling[0]
    with capture(head, "input") as cap:
        out = model(x)
    if cap.calls != 1 or out is not cap.output:
        return None, None
    return head, cap.input


def _probs_like(model, x, run, head, features, vectorize) -> torch.Tensor:
    """A zero tensor shaped like the ``(B, K)`` probabilities (one sample's forward, not added)."""
    if head is not None:
        with window(run, 0, 1):
            logits = head(features)
    else:
        logits = run_window(model, x, run, 0, 1, vectorize)[0]
    return torch.zeros_like(logits)


@torch.no_grad()
def predict(model: nn.Module, x: torch.Tensor, num_samples: int, chunk_size: int | None = None, *,
            seed: int | None = None, return_samples: bool = False, trunk_once: bool | None = None,
            vectorize: bool | None = None, process_group=None):
    """Predictive probabilities ``(1/M) Σ_i softmax(f(x; W_i))``, memory bounded by the chunk.

    When exactly one Bayesian layer samples and its output is the model's output
    (a Bayesian head on a deterministic or frozen trunk), the trunk runs once and
    only the head is evaluated M times; the numbers are those of the full path
    (same noise rows). Runs under ``torch.no_grad()``.

    Args:
        model: a classifier returning ``(B, K)`` logits.
        x: the input batch.
        num_samples: M ≥ 1.
        chunk_size: samples per forward (default ``min(M, 64)``).
        seed: noise seed (``None``: drawn from the global generator).
        return_samples: also return the ``(M, B, K)`` per-sample probabilities
            (memory O(M·B·K)).
        trunk_once: force (``True``) or forbid (``False``) the run-the-trunk-once path;
            default: use it when it applies.
        vectorize: as in :func:`forward_samples`.
        process_group: ``None``, or a ``torch.distributed`` group whose ranks (holding the same
            ``x``) split the M samples; one all-reduce of the ``(B, K)`` sum. Not with
            ``return_samples``.

    Returns:
        ``(B, K)`` probabilities, or a :class:`Prediction` when ``return_samples``.

    Example:
        >>> import torch, mcgraph as mg
        >>> net = mg.nn.bayesify(mg.models.get_model("lenet5"), posterior="radial")
        >>> probs = mg.nn.predict(net, torch.zeros(2, 1, 28, 28), num_samples=8, seed=0)
        >>> probs.shape, bool(torch.allclose(probs.sum(-1), torch.ones(2)))
        (torch.Size([2, 10]), True)
    """
    require_bayesian(model, "mg.nn.predict", allow_none=True)
    check_batch(x, None, "mg.nn.predict")
    num_samples, o = resolve_sampling(num_samples, seed=(seed, None), chunk_size=(chunk_size, None),
                                      vectorize=(vectorize, None), process_group=(process_group, None))
    seed, chunk_size, vectorize, process_group = o["seed"], o["chunk_size"], o["vectorize"], o["process_group"]
    seed = checks.seed("seed", seed)
    with sharded(process_group, seed, num_samples) as (shard, seed):
        if shard is not None and return_samples:
            raise ValueError("return_samples=True keeps every sample on one process: use process_group=None")
        return _predict(model, x, num_samples, chunk_size, seed, return_samples, trunk_once, vectorize, shard)


def _predict(model, x, num_samples, chunk_size, seed, return_samples, trunk_once, vectorize, shard):
    num_samples = checks.positive_int("num_samples", num_samples)
    chunk = checks.positive_int("chunk_size", chunk_size, allow_none=True) or min(num_samples, 64)
    vectorize = can_vectorize(model) if vectorize is None else bool(vectorize)
    run = sample_run(model, num_samples, seed)
    head, features = (None, None) if trunk_once is False else _trunk_features(model, x)
    if trunk_once and head is None:
        raise ValueError("trunk_once=True needs exactly one Bayesian layer in sample mode whose output is the "
                         "model's output")
    total, parts = None, []
    lo, hi = (0, num_samples) if shard is None else shard.window(num_samples)
    for a, b in chunks(hi - lo, chunk):
        start, stop = lo + a, lo + b
        if head is not None:
            with window(run, start, stop):
                logits = head(_repeat(features, stop - start))
            logits = logits.reshape(stop - start, x.shape[0], *logits.shape[1:])
        else:
            logits = run_window(model, x, run, start, stop, vectorize)
        p = torch.softmax(logits, dim=-1 if logits.dim() == 3 else 2)
        total = p.sum(0) if total is None else total + p.sum(0)
        if return_samples:
            parts.append(p)
    if shard is not None:
        like = total if total is not None else _probs_like(model, x, run, head, features, vectorize)
        (total,) = shard.sum(lambda: [total], [like])
    probs = total / num_samples
    if return_samples:
        return Prediction(probs, torch.cat(parts))
    return probs
