"""Many-sample forward passes and predictive probabilities with memory bounded by a chunk.

The batch ``x`` is a tensor (``model(x)``) or a mapping of keyword inputs (``model(**x)``, a
HuggingFace batch); the model returns a tensor or an output with ``.logits`` (a transformers
``ModelOutput``). For a causal language model (``likelihood="token_categorical"``),
:func:`predict` returns the predictive distribution of each sequence's next token.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from ..engine import checks
from ..engine.distributed import sharded
from ..engine.options import Sampling, resolve_sampling
from .chunking import device_of, sized_chunks
from .context import SampleRun, bayesian_modules, capture, sample_run, window
from .layers import SampleMode
from .likelihood import is_per_token
from .model_checks import batch_size, check_batch, describe_batch, input_hint, require_bayesian, split_batch

__all__ = ["forward_samples", "predict", "Prediction", "run_window", "can_vectorize", "model_output", "call_model"]


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


def _repeat(x, times: int):
    """``x`` (a tensor, or a mapping whose tensors are) repeated ``times`` times along dim 0."""
    if isinstance(x, Mapping):
        return {k: _repeat(v, times) if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    return x if times == 1 else x.repeat(times, *([1] * (x.dim() - 1)))


def call_model(model: nn.Module, x, extra: dict | None = None):
    """``model(x)``, or ``model(**x)`` for a mapping of keyword inputs; ``extra`` keywords added."""
    extra = extra or {}
    return model(**x, **extra) if isinstance(x, Mapping) else model(x, **extra)


def model_output(out) -> torch.Tensor:
    """The tensor a model returned: ``out`` itself, or the ``logits`` of a transformers ``ModelOutput``."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, Mapping):
        logits = out.get("logits")
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(f"model: must return a tensor or an output with a .logits tensor (a transformers "
                    f"ModelOutput), got {type(out).__name__}")


def run_window(model: nn.Module, x, run: SampleRun, start: int, stop: int, vectorize: bool,
               extra: dict | None = None) -> torch.Tensor:
    """Outputs of samples ``start … stop-1`` of ``run``: shape ``(stop - start, B, …)``.

    ``x``: a tensor or a mapping of keyword inputs (see the module); ``extra``: keywords for the model.
    """
    size, rows = stop - start, batch_size(x)
    if vectorize or size == 1:
        with window(run, start, stop):
            try:
                out = model_output(call_model(model, _repeat(x, size), extra))
            except RuntimeError as err:
                if not _is_shape_error(err):
                    raise
                raise ValueError(f"x: the model cannot run on {describe_batch(x)}{input_hint(model)} ({err})") from err
        if out.dim() == 0 or out.shape[0] != size * rows:
            raise ValueError(f"model: expected an output with {size * rows} rows for {size} samples of a "
                             f"batch of {rows}, got shape {tuple(out.shape)}")
        return out.reshape(size, rows, *out.shape[1:])
    return torch.stack([run_window(model, x, run, i, i + 1, True, extra)[0] for i in range(start, stop)])


def forward_samples(model: nn.Module, x: torch.Tensor, num_samples: int | Sampling, *, seed: int | None = None,
                    chunk_size: int | None = None, vectorize: bool | None = None) -> torch.Tensor:
    """``num_samples`` forward passes, every Bayesian layer resampled each time: ``(M, B, …)``.

    Sample ``i`` uses row ``i`` of each layer's seeded noise stream, whatever the
    chunking. A chunk of ``S`` samples runs as one forward on the batch repeated
    ``S`` times (each Bayesian layer applies its ``S`` weight samples to its own row
    blocks), unless ``vectorize=False`` or a BatchNorm computes batch statistics.

    Args:
        model: the network.
        x: the input batch ``(B, …)``, or a mapping of keyword inputs (``labels`` is dropped).
        num_samples: M ≥ 1, or a :class:`~mcgraph.Sampling` with M and the options below.
        seed: noise seed (``None``: drawn from the global generator).
        chunk_size: samples per forward (default: from the device's memory budget,
            :mod:`mcgraph.engine.budget`).
        vectorize: run a chunk's samples in one forward (default: :func:`can_vectorize`).

    Example:
        >>> import torch, mcgraph as mg
        >>> layer = mg.nn.BayesLinear(4, 2)
        >>> a = mg.nn.forward_samples(layer, torch.ones(3, 4), 5, seed=0)
        >>> b = mg.nn.forward_samples(layer, torch.ones(3, 4), 5, seed=0, chunk_size=2)
        >>> a.shape, torch.allclose(a, b)
        (torch.Size([5, 3, 2]), True)
    """
    require_bayesian(model, "mg.nn.forward_samples", noise_suffices=True)
    x, _ = split_batch(x, None, "mg.nn.forward_samples")
    check_batch(x, None, "mg.nn.forward_samples")
    num_samples, o = resolve_sampling(num_samples, seed=(seed, None), chunk_size=(chunk_size, None),
                                      vectorize=(vectorize, None))
    seed, chunk_size, vectorize = o["seed"], o["chunk_size"], o["vectorize"]
    num_samples = checks.positive_int("num_samples", num_samples)
    chunk = checks.positive_int("chunk_size", chunk_size, allow_none=True)
    seed = checks.seed("seed", seed)
    vectorize = can_vectorize(model) if vectorize is None else bool(vectorize)
    run = sample_run(model, num_samples, seed)
    return torch.cat(list(sized_chunks("mg.nn.forward_samples", lambda a, b: run_window(model, x, run, a, b, vectorize),
                                       num_samples, chunk, device_of(model, x))))


class Prediction(NamedTuple):
    """``probs``: ``(B, K)`` predictive probabilities; ``sample_probs``: ``(M, B, K)`` per sample."""

    probs: torch.Tensor
    sample_probs: torch.Tensor


def _trunk_features(model: nn.Module, x, extra):
    """(head, features) when exactly one Bayesian layer samples and produces the model's output."""
    sampling = [m for m in bayesian_modules(model) if m.mode == SampleMode.SAMPLE]
    if len(sampling) != 1 or any(getattr(m, "draws_run_noise", False) for m in model.modules()):
        return None, None
    head = sampling[0]
    with capture(head, "input") as cap:
        out = model_output(call_model(model, x, extra))
    if cap.calls != 1 or out is not cap.output:
        return None, None
    return head, cap.input


class _NextToken(NamedTuple):
    """Where each sequence's next token is predicted: ``last`` ``(B,)`` positions of ``T``."""

    last: torch.Tensor
    length: int

    @staticmethod
    def of(x) -> "_NextToken":
        """The last attended position of every row of ``x`` (token ids ``(B, T)`` or a mapping with them)."""
        ids = x.get("input_ids", x.get("attention_mask")) if isinstance(x, Mapping) else x
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            got = "no input_ids" if ids is None else f"shape {tuple(ids.shape)}"
            raise ValueError(f"x: next-token prediction needs token ids of shape (B, T) (x, or x['input_ids']), "
                             f"got {got}")
        rows, length = ids.shape
        mask = x.get("attention_mask") if isinstance(x, Mapping) else None
        if mask is None:
            return _NextToken(torch.full((rows,), length - 1, dtype=torch.long, device=ids.device), length)
        if mask.shape != ids.shape:
            raise ValueError(f"x['attention_mask'] must have shape {tuple(ids.shape)}, got {tuple(mask.shape)}")
        attended = mask != 0
        empty = ~attended.any(1)
        if bool(empty.any()):
            raise ValueError(f"x['attention_mask']: row {int(empty.nonzero()[0])} attends to no position, so it has "
                             f"no next token to predict")
        last = length - 1 - attended.flip(1).int().argmax(1)  # the last position whose mask is 1
        return _NextToken(last, length)

    def keep(self, model: nn.Module, x) -> dict:
        """``{"logits_to_keep": k}`` when the model takes it (transformers' causal LMs): logits of the last k
        positions only, k covering every row's last position."""
        takes = "logits_to_keep" in inspect.signature(model.forward).parameters
        if not takes or (isinstance(x, Mapping) and "logits_to_keep" in x):
            return {}
        return {"logits_to_keep": int(self.length - self.last.min())}

    def select(self, logits: torch.Tensor) -> torch.Tensor:
        """``(S, B, T', V)`` logits of the last ``T'`` positions → ``(S, B, V)`` at each row's last position."""
        if logits.dim() != 4:
            raise ValueError(f"model: next-token prediction needs (B, T, V) logits, got shape "
                             f"{tuple(logits.shape[1:])}")
        index = self.last - (self.length - logits.shape[2])
        if bool((index < 0).any()):
            raise ValueError(f"model: returned logits for {logits.shape[2]} positions, fewer than the "
                             f"{self.length - int(self.last.min())} the attention mask needs")
        rows = torch.arange(logits.shape[1], device=logits.device)
        return logits[:, rows, index.to(logits.device)]


def _sample_logits(model, x, run, start, stop, head, features, vectorize, extra) -> torch.Tensor:
    """Logits of samples ``start … stop-1``: ``(S, B, …)`` (the head alone when the trunk ran once)."""
    if head is None:
        return run_window(model, x, run, start, stop, vectorize, extra)
    with window(run, start, stop):
        logits = head(_repeat(features, stop - start))
    return logits.reshape(stop - start, batch_size(x), *logits.shape[1:])


@torch.no_grad()
def predict(model: nn.Module, x, num_samples: int | Sampling, *, chunk_size: int | None = None,
            seed: int | None = None, return_samples: bool = False, trunk_once: bool | None = None,
            vectorize: bool | None = None, process_group=None, likelihood: str = "categorical"):
    """Predictive probabilities ``(1/M) Σ_i softmax(f(x; W_i))``, memory bounded by the chunk.

    When exactly one Bayesian layer samples and its output is the model's output
    (a Bayesian head on a deterministic or frozen trunk), the trunk runs once and
    only the head is evaluated M times; the numbers are those of the full path
    (same noise rows). Runs under ``torch.no_grad()``.

    **Causal language models** (``likelihood="token_categorical"``): ``x`` is token ids ``(B, T)``
    or a mapping ``{"input_ids", "attention_mask", …}`` (``labels`` is dropped) and the model
    returns ``(B, T, V)`` logits or a ``ModelOutput`` with ``.logits``. The result is the
    predictive of each sequence's **next token**, ``(B, V)``, read at its last position whose
    ``attention_mask`` is 1 (right or left padding). A model whose ``forward`` takes
    ``logits_to_keep`` (transformers' causal LMs) computes only the positions needed.

    Args:
        model: a classifier returning ``(B, K)`` logits (or a causal LM, see above).
        x: the input batch: a tensor, or a mapping of the model's keyword inputs.
        num_samples: M ≥ 1, or a :class:`~mcgraph.Sampling` with M and ``seed``, ``chunk_size``,
            ``vectorize``, ``process_group``.
        chunk_size: samples per forward (default: from the device's memory budget,
            :mod:`mcgraph.engine.budget`: the first sample's bytes size the chunks of the rest).
        seed: noise seed (``None``: drawn from the global generator).
        return_samples: also return the ``(M, B, K)`` per-sample probabilities
            (memory O(M·B·K)).
        trunk_once: force (``True``) or forbid (``False``) the run-the-trunk-once path;
            default: use it when it applies.
        vectorize: as in :func:`forward_samples`.
        process_group: ``None``, or a ``torch.distributed`` group whose ranks (holding the same
            ``x``) split the M samples; one all-reduce of the ``(B, K)`` sum. Not with
            ``return_samples``.
        likelihood: ``"categorical"`` (softmax over the classes: the last dim of ``(B, K)``
            logits, dim 1 otherwise) or ``"token_categorical"`` (next-token probabilities ``(B, V)``).

    Returns:
        ``(B, K)`` probabilities, or a :class:`Prediction` when ``return_samples``.

    Example:
        >>> import torch, mcgraph as mg
        >>> net = mg.nn.bayesify(mg.models.get_model("lenet5"), posterior="radial")
        >>> probs = mg.nn.predict(net, torch.zeros(2, 1, 28, 28), num_samples=8, seed=0)
        >>> probs.shape, bool(torch.allclose(probs.sum(-1), torch.ones(2)))
        (torch.Size([2, 10]), True)
    """
    require_bayesian(model, "mg.nn.predict", noise_suffices=True)
    x, _ = split_batch(x, None, "mg.nn.predict")
    check_batch(x, None, "mg.nn.predict")
    if likelihood not in ("categorical",) and not is_per_token(likelihood):
        raise ValueError(f"likelihood must be 'categorical' or 'token_categorical', got {likelihood!r}")
    num_samples, o = resolve_sampling(num_samples, seed=(seed, None), chunk_size=(chunk_size, None),
                                      vectorize=(vectorize, None), process_group=(process_group, None))
    seed, chunk_size, vectorize, process_group = o["seed"], o["chunk_size"], o["vectorize"], o["process_group"]
    seed = checks.seed("seed", seed)
    with sharded(process_group, seed, num_samples) as (shard, seed):
        if shard is not None and return_samples:
            raise ValueError("return_samples=True keeps every sample on one process: use process_group=None")
        next_token = _NextToken.of(x) if is_per_token(likelihood) else None
        return _predict(model, x, num_samples, chunk_size, seed, return_samples, trunk_once, vectorize, shard,
                        next_token)


def _predict(model, x, num_samples, chunk_size, seed, return_samples, trunk_once, vectorize, shard, next_token):
    num_samples = checks.positive_int("num_samples", num_samples)
    chunk = checks.positive_int("chunk_size", chunk_size, allow_none=True)
    vectorize = can_vectorize(model) if vectorize is None else bool(vectorize)
    extra = next_token.keep(model, x) if next_token is not None else {}
    run = sample_run(model, num_samples, seed)
    head, features = (None, None) if trunk_once is False else _trunk_features(model, x, extra)
    if trunk_once and head is None:
        raise ValueError("trunk_once=True needs exactly one Bayesian layer in sample mode whose output is the "
                         "model's output")

    def probabilities(logits):  # (S, B, …) -> (S, B, K)
        if next_token is not None:
            return torch.softmax(next_token.select(logits), dim=-1)
        return torch.softmax(logits, dim=-1 if logits.dim() == 3 else 2)

    total, parts = None, []
    lo, hi = (0, num_samples) if shard is None else shard.window(num_samples)
    for p in sized_chunks("mg.nn.predict",
                          lambda a, b: probabilities(_sample_logits(model, x, run, a, b, head, features, vectorize,
                                                                    extra)),
                          hi - lo, chunk, device_of(model, x), offset=lo):
        total = p.sum(0) if total is None else total + p.sum(0)
        if return_samples:
            parts.append(p)
    if shard is not None:
        if total is None:  # this rank has no samples: a zero tensor shaped like the sum, for the all-reduce
            total = torch.zeros_like(probabilities(_sample_logits(model, x, run, 0, 1, head, features, vectorize,
                                                                  extra))[0])
        (total,) = shard.sum(lambda: [total], [total])
    probs = total / num_samples
    if return_samples:
        return Prediction(probs, torch.cat(parts))
    return probs
