"""The ELBO of a Bayesian network, with memory bounded by a chunk of samples, and KL-weight schedules.

For a minibatch of B examples from a dataset of N, the per-example ELBO is

.. math::
    \\mathcal L = \\frac1B\\sum_{b=1}^B \\frac1M\\sum_{i=1}^M \\log p(y_b \\mid x_b, W_i)
                 - \\beta\\,\\frac{KL(q\\,\\|\\,p)}{N},
    \\qquad W_i \\sim q,

with the KL summed over every weight of every Bayesian layer (:func:`mcgraph.nn.kl`)
and β the KL weight of the step (:class:`KLSchedule`). −𝓛 is the loss to minimise;
N·𝓛 summed over an epoch of equal batches is the dataset ELBO.

The data term averages M samples of the **whole** network (every Bayesian layer
resampled). :class:`WholeNetworkMC` evaluates it chunk by chunk: each chunk of
``S`` samples runs as one forward on the batch repeated ``S`` times, and its
gradient with respect to every parameter is taken and accumulated at once, so
autograd holds one chunk's graph at a time and the Function saves O(P)
tensors, whatever M. With the same seed the value and gradients equal the naive
estimate with every sample in one graph (``method="direct"``). At M = 1, where there is
nothing to accumulate, the default is that one-sample graph, as in a plain torch step.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..engine import budget, checks
from ..engine.estimators.chunked import accumulation_dtype, graph_leaves
from ..engine.distributed import sharded
from ..engine.noise.streams import mix_seed, resolve_seed
from ..engine.options import Sampling, resolve_sampling
from ..engine.stderr import MCEstimate, SampleMoments, refuse_with_process_group
from .chunking import device_of
from .estimator import user_stacklevel
from .context import bayesian_modules, chunks, sample_run
from .network_kl import checked_model_kl
from .layers import SampleMode
from .likelihood import LIKELIHOODS, is_per_token, log_likelihood, mask_labels
from .model_checks import (batch_size, check_batch, check_class_labels, check_token_labels, check_token_output,
                           input_grads, require_bayesian, split_batch)
from .prediction import can_vectorize, run_window

__all__ = ["elbo", "elbo_terms", "expected_data_term", "default_chunk", "ELBOTerms", "WholeNetworkMC",
           "KLSchedule", "ConstantKL", "LinearWarmupKL", "BlundellKL", "KL_SCHEDULES", "kl_schedule"]




@dataclass(frozen=True, eq=False)
class _NetworkSpec:
    """Non-tensor arguments of :class:`WholeNetworkMC`."""

    fn: Callable[[int, int], torch.Tensor]  # fn(start, stop) -> the chunk's per-sample values (S,)
    num_samples: int
    chunk_size: int | None  # None: one sample first, the rest sized from its bytes (mcgraph.engine.budget)
    want: tuple  # which inputs need a gradient
    moments: object = None  # a mcgraph.engine.stderr.SampleMoments fed with the per-sample values (return_stderr)
    shard: object = None  # a SampleShard: this process's samples only, sums all-reduced
    caller: str = "mg.nn.elbo"  # named in the error for a tensor the Function cannot differentiate
    device: torch.device = torch.device("cpu")  # whose memory budget sizes the chunks


class WholeNetworkMC(torch.autograd.Function):
    """``y = (1/M) Σ_i f_i`` for a 0-d per-sample value ``f_i`` of the whole network.

    Inputs: ``spec`` (:class:`_NetworkSpec`), then the tensors ``f`` depends on that may
    need a gradient (the model's parameters, the input). Output: 0-d.

    The forward pass walks the chunks; for each it builds the chunk's graph, takes
    ``∂(Σ_{i∈chunk} f_i)/∂θ`` for every input θ with one ``autograd.grad`` call, adds it
    to an accumulator and frees the graph. It saves the accumulated mean
    gradients (O(P)), never a graph over M samples.
    """

    @staticmethod
    def forward(ctx, spec: _NetworkSpec, *inputs):
        targets = [t for t, w in zip(inputs, spec.want) if w]
        dtype = inputs[0].dtype if inputs else torch.get_default_dtype()
        if spec.shard is None:
            total, acc, dtype = WholeNetworkMC._local(spec, targets)
        else:  # one all-reduce of the value and every gradient
            like = [((), accumulation_dtype(dtype))] + list(targets)
            total, *acc = spec.shard.sum(lambda: WholeNetworkMC._local(spec, targets, flat=True), like)
            total = total.to(dtype)
        m = spec.num_samples
        it = iter(acc)
        saved, present = [], []
        for t, w in zip(inputs, spec.want):
            g = next(it) if w else None
            present.append(g is not None)
            if g is not None:
                saved.append(g / m if m != 1 else g)
        ctx.present = present
        ctx.save_for_backward(*saved)
        return total / m

    @staticmethod
    def _local(spec: _NetworkSpec, targets, flat: bool = False):
        """Σ over this process's chunks of the value (in float32 at least, under autocast too) and of its
        gradient w.r.t. every target; ``flat``: ``[total, *grads]``, else ``(total, grads, value dtype)``."""
        total = per_sample = None
        acc: list = [None] * len(targets)
        start, stop = (0, spec.num_samples) if spec.shard is None else spec.shard.window(spec.num_samples)
        n, a, chunk = stop - start, 0, spec.chunk_size
        if chunk is not None:
            budget.given(spec.caller, chunk, n)
        while a < n:
            b = min(n, a + (chunk or 1))
            start_, stop_ = start + a, start + b
            with torch.enable_grad() if targets or chunk is None else contextlib.nullcontext():
                if chunk is None:  # the first sample, measured: the most its tensors hold at once sizes the rest
                    per_sample, kept = budget.peak_bytes(lambda: spec.fn(start_, stop_))
                    chunk = budget.from_bytes(spec.caller, max(kept // (b - a), 1), n, spec.device, probe=b - a).samples
                else:
                    per_sample = spec.fn(start_, stop_)
                value = per_sample.sum()
                if targets:
                    if a == 0 and value.requires_grad:
                        _refuse_stray_leaves(value, targets, spec.caller)
                    grads = (torch.autograd.grad(value, targets, allow_unused=True) if value.requires_grad
                             else [None] * len(targets))
                    for k, g in enumerate(grads):
                        if g is not None:
                            acc[k] = g if acc[k] is None else acc[k] + g
            if spec.moments is not None:
                spec.moments.add(per_sample.detach())
            value = value.detach().to(accumulation_dtype(value.dtype))  # float32 sums under autocast
            total = value if total is None else total + value
            a = b
        if flat:
            return [total, *acc]
        return total.to(per_sample.dtype), acc, per_sample.dtype

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        # VJP: y is a 0-d mean, so ∂L/∂θ = grad_out · (1/M) Σ_i ∂f_i/∂θ, the saved mean gradient.
        saved = iter(ctx.saved_tensors)
        return (None, *[grad_out * next(saved) if p else None for p in ctx.present])


def _refuse_stray_leaves(value: torch.Tensor, targets, caller: str) -> None:
    """Raise if ``value``'s graph reaches a tensor that requires grad outside ``targets``.

    :class:`WholeNetworkMC` takes the gradient inside its forward with respect to its inputs only: a tensor
    the data term uses without being one of them (a plain tensor attribute of the model, a tensor a
    ``likelihood`` function closes over) would silently get no gradient. One walk over the first chunk's
    graph, from ``value`` to its leaves (:func:`~mcgraph.engine.estimators.chunked.graph_leaves`).
    """
    stray = graph_leaves(value, exclude=targets)
    if stray:
        shapes = ", ".join(str(tuple(t.shape)) for t in stray[:4]) + (", ..." if len(stray) > 4 else "")
        raise ValueError(f"{caller}: the data term uses {len(stray)} tensor(s) that require grad but are not the "
                         f"model's parameters, x, y, noise_std or the parameters of an nn.Module likelihood "
                         f"(shapes {shapes}); the many-sample estimate (method='accumulated', the default from "
                         f"num_samples=2 on) differentiates only those, so these would get no gradient. Make "
                         f"them parameters of the model (nn.Parameter) or of an nn.Module likelihood, or pass "
                         f"num_samples=mg.Sampling(M, method='direct') (every sample in one graph)")


class ELBOTerms(NamedTuple):
    """``elbo`` = ``log_likelihood`` − ``kl_weight`` · ``kl`` / ``dataset_size`` (all 0-d tensors).

    ``log_likelihood`` is the per-example mean of the M-sample data term; ``kl`` the
    unscaled KL summed over weights. With ``return_stderr=True`` the ``*_stderr`` fields are
    the standard errors of the three estimates (detached); otherwise ``None``. The data term
    and the KL use independent noise, so
    ``elbo_stderr² = log_likelihood_stderr² + (kl_weight · kl_stderr / dataset_size)²``.
    """

    elbo: torch.Tensor
    log_likelihood: torch.Tensor
    kl: torch.Tensor
    log_likelihood_stderr: torch.Tensor | None = None
    kl_stderr: torch.Tensor | None = None
    elbo_stderr: torch.Tensor | None = None


#: Weight-noise elements one chunk may hold (16 MiB in float32).
CHUNK_ELEMENTS = 1 << 22


def default_chunk(model: nn.Module, num_samples: int | Sampling) -> int:
    """Samples per chunk by weight samples alone: as many as keep them under ``CHUNK_ELEMENTS``.

    Only layers that sample weights count (local reparameterization samples activations). The
    reference ``method="direct"`` evaluates its graph in such chunks; the accumulated data term sizes its
    chunks from the memory budget instead (:mod:`mcgraph.engine.budget`), which counts activations too.
    """
    num_samples, _ = resolve_sampling(num_samples)
    num_samples = checks.positive_int("num_samples", num_samples)
    numel = sum(m.weight_mu.numel() for m in bayesian_modules(model)
                if m.mode == SampleMode.SAMPLE and not m.local_reparameterization)
    return max(1, min(num_samples, CHUNK_ELEMENTS // max(1, numel)))


def expected_data_term(model: nn.Module, x, y: torch.Tensor | None = None, *, num_samples: int | Sampling,
                       likelihood="categorical", noise_std=1.0, seed: int | None = None,
                       return_stderr: bool = False):
    """``(1/B) Σ_b (1/M) Σ_i log p(y_b | x_b, W_i)`` over whole-network samples (a 0-d tensor).

    ``num_samples``: M, or a :class:`~mcgraph.Sampling` with M and how to sample: ``method``
    ``"accumulated"`` (the default for M ≥ 2: :class:`WholeNetworkMC`, each chunk's gradients accumulated
    in the forward, memory of one chunk) or ``"direct"``
    (every sample in one autograd graph, the naive reference; the default for M = 1, where the one
    sample's graph is what a plain torch step holds and there is nothing to accumulate),
    ``chunk_size`` (default: from the memory budget, :mod:`mcgraph.engine.budget`), ``vectorize`` (default: unless a BatchNorm uses batch
    statistics), ``process_group`` (the ranks, holding the same batch, split the M samples; one
    all-reduce of the value and the parameters' gradients).
    ``return_stderr=True`` returns an :class:`~mcgraph.engine.stderr.MCEstimate`: the standard error
    from the per-sample values (Σf² beside Σf in the same pass; ``num_samples >= 2``; one process only).
    The other arguments are those of :func:`elbo` (a causal LM's batch: see there).

    Example:
        >>> import torch, mcgraph as mg
        >>> net = mg.nn.bayesify(torch.nn.Linear(3, 2))
        >>> x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
        >>> a = mg.nn.expected_data_term(net, x, y, num_samples=mg.Sampling(6, chunk_size=4), seed=0)
        >>> b = mg.nn.expected_data_term(net, x, y, num_samples=mg.Sampling(6, method="direct"), seed=0)
        >>> torch.allclose(a, b)
        True
    """
    require_bayesian(model, "mg.nn.expected_data_term", noise_suffices=True)
    x, y = split_batch(x, y, "mg.nn.expected_data_term")
    check_batch(x, y, "mg.nn.expected_data_term")
    return _checked_data_term(model, x, y, num_samples, likelihood, noise_std, seed, return_stderr)


#: The data term's options it reads from its Sampling itself (no keyword of their own).
_READ_FROM_SAMPLING = {name: (None, None) for name in ("method", "chunk_size", "vectorize", "process_group")}


def _checked_data_term(model, x, y, num_samples, likelihood, noise_std, seed, return_stderr):
    """:func:`expected_data_term` once ``model`` and the batch are checked."""
    s = _as_sampling(num_samples, "num_samples")
    _, o = resolve_sampling(s, seed=(seed, None), return_stderr=(return_stderr, False), **_READ_FROM_SAMPLING)
    seed = checks.seed("seed", o["seed"])
    with sharded(s.process_group, seed, s.num_samples) as (shard, seed):
        return _expected_data_term(model, x, y, s.num_samples, likelihood, noise_std, seed, s.chunk_size,
                                   s.method, s.vectorize, o["return_stderr"], shard)


def _as_sampling(value, name: str) -> Sampling:
    """``value`` as a :class:`Sampling` (an int M, ``None`` or a Sampling); the message names ``name``."""
    if isinstance(value, Sampling):
        return value
    return Sampling(checks.positive_int(name, value, allow_none=True))


def _expected_data_term(model, x, y, num_samples, likelihood, noise_std, seed, chunk_size, method, vectorize,
                        return_stderr, shard):
    num_samples = checks.positive_int("num_samples", num_samples)
    refuse_with_process_group(return_stderr, shard)
    if not isinstance(return_stderr, bool):
        raise TypeError(f"return_stderr must be a bool, got {type(return_stderr).__name__}")
    if return_stderr and num_samples < 2:
        raise ValueError(f"num_samples must be >= 2 with return_stderr=True (a single sample has no variance "
                         f"to estimate), got {num_samples}")
    moments = SampleMoments() if return_stderr else None
    per_token = is_per_token(likelihood)
    chunk = checks.positive_int("chunk_size", chunk_size, allow_none=True)
    if method == "chunked":
        warnings.warn("the data term's method='chunked' is deprecated: use 'accumulated' (the engine's 'chunked' "
                      "is another algorithm, which replays chunks on backward)", DeprecationWarning,
                      stacklevel=user_stacklevel())
        method = "accumulated"
    if method is None:  # one sample has nothing to accumulate: its graph is a plain torch step's
        method = "direct" if num_samples == 1 and shard is None else "accumulated"
    if method not in ("accumulated", "direct"):
        raise ValueError(f"method must be 'accumulated' or 'direct', got {method!r}")
    if method == "direct" and shard is not None:
        raise ValueError("method='direct' (the naive graph, for comparisons) does not split samples across "
                         "processes: use method='accumulated' with process_group")
    if isinstance(likelihood, str) and likelihood not in LIKELIHOODS:
        raise ValueError(f"likelihood must be one of {sorted(LIKELIHOODS)} or a callable, got {likelihood!r}")
    batch = batch_size(x)
    if per_token:
        check_token_labels(x, y, "mg.nn.expected_data_term")
        y = mask_labels(y, x.get("attention_mask") if isinstance(x, dict) else None)
    if y is None:
        raise ValueError("y: the targets are required (or x as a mapping with 'labels')")
    if y.shape[:1] != (batch,):
        raise ValueError(f"y: batch size {tuple(y.shape[:1])} does not match x's {(batch,)}")
    vectorize = can_vectorize(model) if vectorize is None else bool(vectorize)
    run = sample_run(model, num_samples, seed)

    labels_checked = []

    def chunk_value(start: int, stop: int) -> torch.Tensor:
        out = run_window(model, x, run, start, stop, vectorize)  # (S, B, ...)
        if per_token:
            check_token_output(out, y, "mg.nn.expected_data_term")
        elif likelihood == "categorical" and not labels_checked:  # where the labels enter: once per call
            check_class_labels(y, out, x, "mg.nn.elbo / expected_data_term")
            labels_checked.append(True)
        size = stop - start
        target = y if size == 1 else y.repeat(size, *([1] * (y.dim() - 1)))
        ll = log_likelihood(likelihood, out.reshape(size * batch, *out.shape[2:]), target, noise_std)
        return ll.reshape(size, batch).sum(1) / batch  # per-sample values (S,)

    def result(value):
        if moments is None:
            return value
        return MCEstimate(value, moments.stderr().to(value.dtype), num_samples)

    if method == "direct":  # (the reference: every sample in one graph, evaluated a weight-sized chunk at a time)
        total = 0
        for a, b in chunks(num_samples, chunk or (1 if per_token else default_chunk(model, num_samples))):
            per_sample = chunk_value(a, b)
            if moments is not None:
                moments.add(per_sample.detach())
            total = total + per_sample.sum()
        return result(total / num_samples)
    inputs = [p for p in model.parameters()] + input_grads(x)
    if isinstance(noise_std, torch.Tensor):
        inputs.append(noise_std)
    if isinstance(likelihood, nn.Module):
        inputs.extend(likelihood.parameters())
    if y.requires_grad:
        inputs.append(y)
    inputs = list({id(t): t for t in inputs}.values())  # a tensor once (a likelihood module inside the model)
    want = tuple(torch.is_grad_enabled() and t.requires_grad for t in inputs)
    spec = _NetworkSpec(chunk_value, num_samples, chunk, want, moments, shard, "mg.nn.elbo / expected_data_term",
                        device_of(model, x))
    return result(WholeNetworkMC.apply(spec, *inputs))


def elbo_terms(model: nn.Module, x, y: torch.Tensor | None = None, *, num_samples: int | Sampling,
               dataset_size: int, kl_samples: int | Sampling | None = None, seed: int | None = None,
               kl_weight: float = 1.0, likelihood="categorical", noise_std=1.0,
               return_stderr: bool = False) -> ELBOTerms:
    """The ELBO and its two terms; see :func:`elbo` for the arguments.

    ``return_stderr=True`` also fills the standard errors of :class:`ELBOTerms` (the data
    term's from its per-sample values, the KL's from the engine, both in the pass that
    computes them; ``num_samples`` and every KL's M must be ≥ 2; one process only).

    Example:
        >>> import torch, mcgraph as mg
        >>> net = mg.nn.bayesify(torch.nn.Linear(4, 3), prior="scale_mixture", kl_samples=100)
        >>> t = mg.nn.elbo_terms(net, torch.randn(8, 4), torch.randint(0, 3, (8,)), num_samples=16,
        ...                      dataset_size=1000, seed=0, return_stderr=True)
        >>> bool(t.log_likelihood_stderr > 0), bool(t.kl_stderr > 0)   # no closed form: the KL is sampled
        (True, True)
        >>> exact = mg.nn.bayesify(torch.nn.Linear(4, 3), kl_samples=100)   # Normal prior: torch's closed form
        >>> float(mg.nn.elbo_terms(exact, torch.randn(8, 4), torch.randint(0, 3, (8,)), num_samples=16,
        ...                        dataset_size=1000, seed=0, return_stderr=True).kl_stderr)
        0.0
    """
    require_bayesian(model, "mg.nn.elbo")
    x, y = split_batch(x, y, "mg.nn.elbo")
    check_batch(x, y, "mg.nn.elbo")
    dataset_size = checks.positive_int("dataset_size", dataset_size)
    if dataset_size < batch_size(x):
        raise ValueError(f"dataset_size must be the number of training examples N, at least the batch size "
                         f"{batch_size(x)}; got {dataset_size}")
    if not isinstance(kl_weight, torch.Tensor) or kl_weight.ndim == 0:
        checks.finite_float("kl_weight", kl_weight, low=0.0)
    data, kl = _as_sampling(num_samples, "num_samples"), _as_sampling(kl_samples, "kl_samples")
    # the KL's samples are split by the data term's group unless the KL's own Sampling says otherwise
    kl_process_group = kl.process_group if isinstance(kl_samples, Sampling) else data.process_group
    _, o = resolve_sampling(data, seed=(seed, None), return_stderr=(return_stderr, False), **_READ_FROM_SAMPLING)
    seed, return_stderr, process_group = checks.seed("seed", o["seed"]), o["return_stderr"], data.process_group
    kl_samples = kl.num_samples
    if return_stderr:
        too_few = [layer for layer in bayesian_modules(model) if (kl_samples or layer.kl_samples) < 2]
        if too_few:
            raise ValueError(f"kl_samples must be >= 2 with return_stderr=True (a KL from one sample has no variance "
                             f"to estimate); {'kl_samples is ' + str(kl_samples) if kl_samples else 'a layer was built with kl_samples=' + str(too_few[0].kl_samples)}: pass kl_samples=")
    if seed is None and (process_group is not None or kl_process_group is not None):
        raise ValueError("seed: pass a seed with a process_group (the same on every rank; e.g. a function of "
                         "the step), so that the ranks draw the same noise")
    seed = resolve_seed(seed)
    data = _checked_data_term(model, x, y, data.replace(seed=None, return_stderr=False), likelihood, noise_std,
                              seed, return_stderr)
    kl_value = checked_model_kl(model, kl_samples, seed=kl.seed if kl.seed is not None else mix_seed(seed, 1 << 20),
                                method=kl.method or "auto", return_stderr=return_stderr,
                                process_group=kl_process_group)
    if not return_stderr:
        return ELBOTerms(data - kl_weight * kl_value / dataset_size, data, kl_value)
    (data, data_se, _), (kl_value, kl_se, _) = data, kl_value
    elbo_se = (data_se ** 2 + (kl_weight * kl_se / dataset_size) ** 2).sqrt()
    return ELBOTerms(data - kl_weight * kl_value / dataset_size, data, kl_value, data_se, kl_se.detach(),
                     elbo_se.detach())


def elbo(model: nn.Module, x, y: torch.Tensor | None = None, *, num_samples: int | Sampling, dataset_size: int,
         kl_samples: int | Sampling | None = None, seed: int | None = None, kl_weight: float = 1.0,
         likelihood="categorical", noise_std=1.0) -> torch.Tensor:
    r"""Per-example ELBO of a minibatch, differentiable, memory bounded by a chunk of samples.

    .. math::
        \mathcal L = \frac1B\sum_b \frac1M\sum_{i=1}^M \log p(y_b \mid x_b, W_i)
                     - \beta \frac{KL(q\|p)}{N}

    The data term averages M samples of the whole network (every Bayesian layer resampled), a
    chunk of samples at a time (:class:`WholeNetworkMC`); the KL is :func:`mcgraph.nn.kl`, divided
    by N and weighted by β. Minimise ``-elbo(...)``. The same ``seed`` gives the same value and
    gradients for any chunking and method. Language models, process groups and the options of
    ``mg.Sampling`` are described in the docs (``docs/layers-and-models.md``, ``docs/pretrained.md``,
    ``docs/distributed.md``).

    Args:
        model: the network (Bayesian layers anywhere; BatchNorm and biases deterministic).
        x: input batch ``(B, …)``, or a mapping of the model's keyword inputs (``model(**x)``; a
            ``labels`` entry is taken as ``y``); a transformers ``ModelOutput``'s ``.logits`` are scored.
        y: class indices ``(B,)`` (categorical), values (gaussian) or a causal LM's labels ``(B, T)``
            (token_categorical); ``None`` when ``x`` holds ``labels``.
        num_samples: M ≥ 1, or a :class:`~mcgraph.Sampling` (``method`` ``"accumulated"``, the default from
            M = 2, or ``"direct"``; ``chunk_size``, by default from the device's memory budget;
            ``vectorize``; ``process_group``, which needs an explicit ``seed``).
        dataset_size: N, the number of training examples (at least the batch size).
        kl_samples: the KL's M for every layer (default: each layer's ``kl_samples``), or a
            :class:`~mcgraph.Sampling` with the KL's ``method`` and ``process_group``.
        seed: noise seed (``None``: drawn from the global generator).
        kl_weight: β ≥ 0 (finite); :class:`KLSchedule` gives warm-up and Blundell's weights.
        likelihood: ``"categorical"``, ``"gaussian"``, ``"token_categorical"`` or a callable
            ``(output, target) -> (N,)`` (an ``nn.Module``'s parameters get gradients with the model's).
        noise_std: τ of the Gaussian likelihood (a float, or a tensor, which may require grad).

    Raises:
        ValueError: a model without Bayesian layers (``mg.nn.bayesify`` it first); ``x`` / ``y``
            whose shapes or labels do not fit the model (the message names them); ``dataset_size``
            below the batch size.
        TypeError: a model holding another library's unconverted Bayesian layers (the message
            names the converter).

    Returns:
        A 0-d tensor (use :func:`elbo_terms` for the two terms as well).

    Example:
        >>> import torch, mcgraph as mg
        >>> net = mg.nn.bayesify(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(),
        ...                                          torch.nn.Linear(16, 3)), posterior="radial")
        >>> x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        >>> loss = -mg.nn.elbo(net, x, y, num_samples=64, dataset_size=1000, kl_samples=100, seed=0)
        >>> loss.backward()
    """
    return elbo_terms(model, x, y, num_samples=num_samples, dataset_size=dataset_size, kl_samples=kl_samples,
                      seed=seed, kl_weight=kl_weight, likelihood=likelihood, noise_std=noise_std).elbo


# --------------------------------------------------------------------------- KL-weight schedules


class KLSchedule:
    """β for step ``t`` (0-based minibatch count): ``schedule(t) -> float``.

    The ELBO divides the KL by the dataset size N, so β = 1 weighs the KL once per
    epoch of equal batches. Subclasses: :class:`ConstantKL`, :class:`LinearWarmupKL`,
    :class:`BlundellKL`; :func:`kl_schedule` builds one by name.
    """

    def __call__(self, step: int) -> float:
        raise NotImplementedError


@dataclass(frozen=True)
class ConstantKL(KLSchedule):
    """β = ``weight`` at every step."""

    weight: float = 1.0

    def __call__(self, step: int) -> float:
        return float(self.weight)


@dataclass(frozen=True)
class LinearWarmupKL(KLSchedule):
    """β = ``final · min(1, (t + 1) / warmup_steps)``: linear warm-up, then constant."""

    warmup_steps: int
    final: float = 1.0

    def __post_init__(self):
        checks.positive_int("warmup_steps", self.warmup_steps)

    def __call__(self, step: int) -> float:
        return float(self.final) * min(1.0, (step + 1) / self.warmup_steps)


@dataclass(frozen=True)
class BlundellKL(KLSchedule):
    """Blundell et al. (2015), §3.4: minibatch i = 1…n of each epoch weighs the KL by

    .. math::
        \\pi_i = \\frac{2^{n-i}}{2^n - 1}, \\qquad \\sum_{i=1}^n \\pi_i = 1,

    so early batches carry most of the complexity cost. With the ELBO's KL / N
    scaling (one KL per epoch at β = 1/n per batch ⇔ β = 1 per example), β = n·π_i.
    Computed as ``n · 2^{-i} / (1 − 2^{-n})`` (no overflow for large n).
    """

    num_batches: int

    def __post_init__(self):
        checks.positive_int("num_batches", self.num_batches)

    def __call__(self, step: int) -> float:
        n = self.num_batches
        i = step % n + 1
        return n * math.ldexp(1.0, -i) / (1.0 - math.ldexp(1.0, -n))


KL_SCHEDULES = {"constant": ConstantKL, "linear": LinearWarmupKL, "blundell": BlundellKL}
"""Names of the KL-weight schedules."""


def kl_schedule(name: str, *, num_batches: int | None = None, warmup_steps: int | None = None,
                weight: float = 1.0) -> KLSchedule:
    """A :class:`KLSchedule` by name: ``"constant"`` (β = ``weight``), ``"linear"`` (warm-up over
    ``warmup_steps`` to ``weight``), ``"blundell"`` (needs ``num_batches`` per epoch).

    Example:
        >>> import mcgraph as mg
        >>> s = mg.nn.kl_schedule("blundell", num_batches=3)
        >>> round(sum(s(t) for t in range(3)) / 3, 6)
        1.0
    """
    if name == "constant":
        return ConstantKL(weight)
    if name == "linear":
        if warmup_steps is None:
            raise ValueError("warmup_steps is required for the 'linear' KL schedule")
        return LinearWarmupKL(warmup_steps, weight)
    if name == "blundell":
        if num_batches is None:
            raise ValueError("num_batches is required for the 'blundell' KL schedule")
        return BlundellKL(num_batches)
    raise ValueError(f"name must be one of {sorted(KL_SCHEDULES)}, got {name!r}")
