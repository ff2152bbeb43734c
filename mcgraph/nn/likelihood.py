"""Many-sample expected log-likelihood of a network whose last layer is Bayesian.

With local reparameterization the last layer's pre-activation is Gaussian per
(example, output) given the trunk features ``h`` (paper, Observation 1):

.. math::
    u = m + s\\,\\varepsilon, \\qquad m = h\\mu_W + b, \\quad s^2 = h^2\\sigma_W^2,
    \\quad \\varepsilon \\sim N(0, I),

so E_q[log p(y | u)] needs M samples of a ``(B, K)`` tensor, not of the network.

* **classification** — ``E[−log softmax(u)_y]`` is estimated with M samples by
  :class:`SoftmaxCrossEntropyMC`, which draws the noise chunk by chunk and
  accumulates value and gradients in one pass (saved tensors O(B·K), any M). It
  is the exact Monte Carlo estimator, not a Taylor expansion.
* **regression** — ``log N(y; u, τ²)`` is a polynomial of degree 2 in u, so it
  collapses (Thm 2): the noise statistics mean(ε), mean(ε²) are accumulated
  without autograd, then one small graph in (m, s) is built.

Both consume the noise the last layer draws inside a sample run with the same
seed, so the value equals the whole-network estimate of
:func:`~mcgraph.nn.elbo` when only the last layer is stochastic.

The per-row likelihoods of the whole-network ELBO are a :data:`LIKELIHOODS` registry:
``"categorical"``, ``"gaussian"`` and ``"token_categorical"`` (causal language models, see
:func:`token_log_likelihood`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..registry import Registry
from ..engine.noise.streams import BlockStream, resolve_seed
from ..engine.options import Sampling, resolve_sampling
from .context import NoiseKind, bayesian_modules, capture, noise_stream, normal_draw, sample_run, window
from .layers import SampleMode

__all__ = ["SoftmaxCrossEntropyMC", "softmax_cross_entropy_mc", "expected_log_likelihood", "log_likelihood",
           "LIKELIHOODS", "IGNORE_INDEX", "is_per_token", "token_log_likelihood", "mask_labels"]

#: Label of a position that contributes nothing (HuggingFace's and ``F.cross_entropy``'s ``ignore_index``).
IGNORE_INDEX = -100


def _categorical(output: torch.Tensor, target: torch.Tensor, noise_std) -> torch.Tensor:
    ll = -F.cross_entropy(output, target, reduction="none")
    return ll.reshape(ll.shape[0], -1).sum(1)


def _gaussian(output: torch.Tensor, target: torch.Tensor, noise_std) -> torch.Tensor:
    target = target.reshape(output.shape)
    std = torch.as_tensor(noise_std, dtype=output.dtype, device=output.device)
    ll = -0.5 * ((target - output) / std) ** 2 - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return ll.reshape(ll.shape[0], -1).sum(1)


def token_log_likelihood(logits: torch.Tensor, labels: torch.Tensor, noise_std=None) -> torch.Tensor:
    """Log-likelihood of each sequence under a causal LM: ``(N, T, V)`` logits, ``(N, T)`` labels → ``(N,)``.

    The labels are **shifted inside**, as HuggingFace's causal LMs do (``labels = input_ids`` is
    right): the logits at position t score the label at position t + 1,

    .. math::
        \\log p(y_n) = \\sum_{t=0}^{T-2} [y_{n,t+1} \\ne -100]\\,
        \\log\\operatorname{softmax}(\\text{logits}_{n,t})_{y_{n,t+1}},

    and positions labelled :data:`IGNORE_INDEX` (−100) count for nothing. The sum is over tokens,
    not their mean: with ``n`` counted tokens in a batch of ``B`` sequences, the mean of this over
    the batch is ``−outputs.loss · n / B`` for transformers' own ``outputs.loss`` (a mean over the
    batch's tokens), so the ELBO's ``dataset_size`` counts sequences.

    Args:
        logits: ``(N, T, V)`` next-token logits.
        labels: ``(N, T)`` token ids in ``[0, V)`` or −100.
        noise_std: unused (the registry's signature).

    Example:
        >>> import torch, mcgraph as mg
        >>> logits = torch.zeros(2, 4, 10)                       # uniform over 10 tokens
        >>> labels = torch.tensor([[1, 2, 3, 4], [5, 6, -100, -100]])
        >>> mg.nn.token_log_likelihood(logits, labels) / -torch.log(torch.tensor(10.))
        tensor([3., 1.])
    """
    if logits.dim() != 3:
        raise ValueError(f"logits: a token likelihood needs (N, T, V) logits, got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels must have shape {tuple(logits.shape[:2])} (one label per position of the logits), "
                         f"got {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be integer token ids, got dtype {labels.dtype}")
    n, t, v = logits.shape
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # position t scores label t + 1
    nll = F.cross_entropy(logits.reshape(n * t, v), shifted.reshape(n * t).long(), ignore_index=IGNORE_INDEX,
                          reduction="none")
    return -nll.reshape(n, t).sum(1)


token_log_likelihood.per_token = True


def is_per_token(likelihood) -> bool:
    """Whether ``likelihood`` (a name or a callable) scores ``(N, T, V)`` logits position by position.

    A registered likelihood declares it with the attribute ``per_token = True``. ``mg.nn`` then
    sets the labels of positions whose ``attention_mask`` is 0 to −100 (:func:`mask_labels`),
    evaluates one sample per chunk unless told otherwise (a sequence model's activations and
    ``(B, T, V)`` logits dwarf its weights), and :func:`~mcgraph.nn.predict` returns next-token
    probabilities.
    """
    if callable(likelihood) and not isinstance(likelihood, str):
        return bool(getattr(likelihood, "per_token", False))
    return isinstance(likelihood, str) and bool(getattr(LIKELIHOODS.get(likelihood), "per_token", False))


def mask_labels(labels: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``labels`` with :data:`IGNORE_INDEX` wherever ``attention_mask`` is 0 (padding scores nothing).

    HuggingFace counts every label that is not −100, padded or not; its collators set padded
    labels to −100. Masking here as well makes a padded position count for nothing whatever its
    label, so ``labels = input_ids`` is safe with padding.
    """
    if attention_mask is None:
        return labels
    if attention_mask.shape != labels.shape:
        raise ValueError(f"x['attention_mask'] must have the labels' shape {tuple(labels.shape)}, got "
                         f"{tuple(attention_mask.shape)}")
    return labels.masked_fill(attention_mask == 0, IGNORE_INDEX)


LIKELIHOODS: Registry = Registry("likelihood")
"""``name -> fn(output (N, …), target (N, …), noise_std) -> log-likelihood per row (N,)``; a function
with ``per_token = True`` scores ``(N, T, V)`` logits per position (:func:`is_per_token`)."""
LIKELIHOODS.register("categorical", _categorical)
LIKELIHOODS.register("gaussian", _gaussian)
LIKELIHOODS.register("token_categorical", token_log_likelihood)


def log_likelihood(likelihood, output: torch.Tensor, target: torch.Tensor, noise_std=1.0) -> torch.Tensor:
    """Per-row log-likelihood ``(N,)`` of ``target`` under the network ``output``.

    Args:
        likelihood: ``"categorical"`` (softmax over dim 1 of the logits, targets are class
            indices), ``"gaussian"`` (N(target; output, noise_std²), summed over non-batch
            dims), ``"token_categorical"`` (a causal LM's ``(N, T, V)`` logits against ``(N, T)``
            labels, shifted inside, −100 ignored: :func:`token_log_likelihood`), or a callable
            ``(output, target) -> (N,)``.
    """
    if callable(likelihood) and not isinstance(likelihood, str):
        out = likelihood(output, target)
        if out.shape != output.shape[:1]:
            raise ValueError(f"likelihood: the callable must return one log-likelihood per row, shape "
                             f"{tuple(output.shape[:1])}, got {tuple(out.shape)}")
        return out
    try:
        fn = LIKELIHOODS[likelihood]
    except (KeyError, TypeError):
        raise ValueError(f"likelihood must be one of {sorted(LIKELIHOODS)} or a callable, got {likelihood!r}") from None
    return fn(output, target, noise_std)


# --------------------------------------------------------------------------- softmax cross-entropy MC


def gaussian_stream(shape, seed: int, num_samples: int, dtype: torch.dtype, device: torch.device) -> BlockStream:
    """The stream of standard-normal rows ``(n, *shape)``: what a local-reparameterization layer draws."""
    return noise_stream(normal_draw(shape, dtype, device), shape, seed, num_samples, device)


@dataclass(frozen=True, eq=False)
class _SoftmaxSpec:
    stream: BlockStream
    num_samples: int
    chunk_size: int


class SoftmaxCrossEntropyMC(torch.autograd.Function):
    """``ℓ_b = (1/M) Σ_i [logsumexp(u_i,b) − u_i,b,y_b]``, ``u_i = mean + std·ε_i``.

    Inputs: ``spec`` (noise stream, M, chunk size), ``mean`` ``(B, K)``, ``std`` ``(B, K)``,
    ``target`` ``(B,)`` int64. Output: ``(B,)``. Saves two ``(B, K)`` tensors for any M.
    """

    @staticmethod
    def forward(ctx, spec: _SoftmaxSpec, mean, std, target):
        acc_dtype = torch.float64 if mean.dtype == torch.float64 else torch.float32
        m, s = mean.detach().to(acc_dtype), std.detach().to(acc_dtype)
        onehot = F.one_hot(target, m.shape[-1]).to(acc_dtype)
        value = torch.zeros(m.shape[0], dtype=acc_dtype, device=m.device)
        d_mean = torch.zeros_like(m)
        d_std = torch.zeros_like(m)
        for start in range(0, spec.num_samples, spec.chunk_size):
            eps = spec.stream.rows(start, min(start + spec.chunk_size, spec.num_samples)).to(acc_dtype)
            u = m + s * eps  # (C, B, K)
            lse = torch.logsumexp(u, -1, keepdim=True)
            value += (lse.squeeze(-1) - (u * onehot).sum(-1)).sum(0)
            g = torch.exp(u - lse) - onehot  # ∂ℓ/∂u = softmax(u) − onehot(y)
            d_mean += g.sum(0)
            d_std += (g * eps).sum(0)
        n = spec.num_samples
        ctx.save_for_backward((d_mean / n).to(mean.dtype), (d_std / n).to(std.dtype))
        return (value / n).to(mean.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        # VJP: ∂ℓ_b/∂mean_bk = (1/M) Σ_i (softmax(u_i)_bk − 1[k = y_b]),
        #      ∂ℓ_b/∂std_bk  = (1/M) Σ_i (softmax(u_i)_bk − 1[k = y_b]) ε_i,bk;
        # grad_mean = g_b · ∂ℓ_b/∂mean_b (likewise std); no gradient for target.
        d_mean, d_std = ctx.saved_tensors
        g = grad_out.unsqueeze(-1)
        return None, g * d_mean, g * d_std, None


def softmax_cross_entropy_mc(mean: torch.Tensor, std: torch.Tensor, target: torch.Tensor, num_samples: int | Sampling,
                             *, seed: int | None = None, chunk_size: int | None = None) -> torch.Tensor:
    """Monte Carlo softmax cross-entropy of Gaussian logits, memory O(B·K) in M.

    .. math::
        \\ell_b = \\frac1M \\sum_{i=1}^M -\\log \\operatorname{softmax}(m_b + s_b \\odot \\varepsilon_{ib})_{y_b},
        \\qquad \\varepsilon_{ib} \\sim N(0, I_K)

    Args:
        mean: ``(B, K)`` logit means m.
        std: ``(B, K)`` positive logit standard deviations s.
        target: ``(B,)`` class indices.
        num_samples: M ≥ 1, or a :class:`~mcgraph.Sampling` with M, ``seed`` and ``chunk_size``.
        seed: noise seed (``None``: drawn from the global generator).
        chunk_size: samples per chunk (default: one noise block).

    Returns:
        ``(B,)`` per-example estimates, differentiable in ``mean`` and ``std``.

    Example:
        >>> import torch, mcgraph as mg
        >>> m = torch.zeros(4, 3, requires_grad=True)
        >>> loss = mg.nn.softmax_cross_entropy_mc(m, torch.ones(4, 3), torch.tensor([0, 1, 2, 0]), 10_000, seed=0)
        >>> loss.shape
        torch.Size([4])
    """
    if mean.dim() != 2 or std.shape != mean.shape:
        raise ValueError(f"mean and std must both be (B, K), got mean {tuple(mean.shape)}, std {tuple(std.shape)}")
    if target.shape != mean.shape[:1]:
        raise ValueError(f"target must have shape {tuple(mean.shape[:1])}, got {tuple(target.shape)}")
    num_samples, o = resolve_sampling(num_samples, seed=(seed, None), chunk_size=(chunk_size, None))
    seed, chunk_size = o["seed"], o["chunk_size"]
    if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    seed = resolve_seed(seed)
    stream = gaussian_stream(mean.shape, seed, int(num_samples), mean.dtype, mean.device)
    return _softmax_ce(stream, mean, std, target, chunk_size)


def _softmax_ce(stream: BlockStream, mean, std, target, chunk_size):
    chunk = stream.block if chunk_size is None else _check_chunk(chunk_size)
    return SoftmaxCrossEntropyMC.apply(_SoftmaxSpec(stream, stream.num_samples, chunk), mean, std, target.long())


def _check_chunk(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    return int(chunk_size)


# --------------------------------------------------------------------------- expected log-likelihood


def _normal_statistics(stream: BlockStream, chunk_size) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean ε, mean ε²) over the stream, chunk by chunk, without autograd."""
    chunk = stream.block if chunk_size is None else _check_chunk(chunk_size)
    s1 = s2 = None
    with torch.no_grad():
        for start in range(0, stream.num_samples, chunk):
            eps = stream.rows(start, min(start + chunk, stream.num_samples))
            a, b = eps.sum(0), (eps * eps).sum(0)
            s1, s2 = (a, b) if s1 is None else (s1 + a, s2 + b)
    return s1 / stream.num_samples, s2 / stream.num_samples


def _reduce(value: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return value.mean()
    if reduction == "sum":
        return value.sum()
    if reduction == "none":
        return value
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def last_bayesian_layer(model: nn.Module):
    """The last Bayesian layer in sample mode (``model.modules()`` order), or ``None``."""
    layers = [m for m in bayesian_modules(model) if m.mode == SampleMode.SAMPLE]
    return layers[-1] if layers else None


def expected_log_likelihood(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, num_samples: int | Sampling,
                            likelihood: str = "categorical", noise_std=1.0, seed: int | None = None,
                            chunk_size: int | None = None, reduction: str = "mean") -> torch.Tensor:
    """E_q[log p(y | x, W)] over M ≥ 1000 samples of the last layer, memory O(B·K) in M.

    The network runs once; its last Bayesian layer (which must produce the model's
    output and use ``local_reparameterization``) returns the moments (m, s²) of its
    Gaussian pre-activation, and the expectation over ``u = m + sε`` is taken with
    ``num_samples`` samples:

    .. math::
        \\text{categorical:}\\; \\frac1M\\sum_i \\log\\operatorname{softmax}(m + s\\varepsilon_i)_y
        \\qquad
        \\text{gaussian:}\\; \\frac1M\\sum_i \\log N(y;\\, m + s\\varepsilon_i,\\, \\tau^2)
        = -\\frac{(y-m)^2 - 2(y-m)s\\bar\\varepsilon + s^2\\overline{\\varepsilon^2}}{2\\tau^2} - \\log\\tau\\sqrt{2\\pi}

    Other Bayesian layers in sample mode (in the trunk) are sampled once (sample 0
    of the run). The noise is the last layer's noise in a sample run with ``seed``,
    so with a deterministic trunk the value equals :func:`~mcgraph.nn.elbo`'s data term.

    Args:
        model: the network.
        x: input batch ``(B, …)``.
        y: targets: class indices ``(B,)`` or values shaped like the output.
        num_samples: M ≥ 1.
        likelihood: ``"categorical"`` or ``"gaussian"``.
        noise_std: τ of the Gaussian likelihood (float or tensor).
        seed: noise seed (``None``: drawn from the global generator).
        chunk_size: samples per chunk of the softmax estimate.
        reduction: ``"mean"`` | ``"sum"`` over examples, or ``"none"`` for ``(B,)``.

    Raises:
        ValueError: no Bayesian layer in sample mode, the last one lacks local
            reparameterization, or its output is not the model's output.

    Example:
        >>> import torch, mcgraph as mg
        >>> net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(),
        ...                           mg.nn.BayesLinear(16, 3, estimator="local_reparameterization"))
        >>> ll = mg.nn.expected_log_likelihood(net, torch.randn(8, 5), torch.randint(0, 3, (8,)),
        ...                                    num_samples=2000, seed=0)
        >>> ll.shape
        torch.Size([])
    """
    head = last_bayesian_layer(model)
    if head is None:
        raise ValueError("model: has no Bayesian layer in sample mode")
    if not head.local_reparameterization:
        raise ValueError(f"model: the last Bayesian layer ({type(head).__name__}) must use "
                         "estimator='local_reparameterization'")
    if likelihood not in ("categorical", "gaussian"):
        raise ValueError(f"likelihood must be 'categorical' or 'gaussian', got {likelihood!r}")
    num_samples, o = resolve_sampling(num_samples, seed=(seed, None), chunk_size=(chunk_size, None))
    seed, chunk_size = o["seed"], o["chunk_size"]
    run = sample_run(model, num_samples, seed)
    with window(run, 0, 1), capture(head, "moments") as cap:
        out = model(x)
    if cap.calls != 1 or out is not cap.output:
        raise ValueError("model: the output of its last Bayesian layer must be the model's output "
                         "(called once, with nothing after it)")
    mean, std = cap.output, cap.variance.clamp_min(torch.finfo(cap.variance.dtype).tiny).sqrt()
    seed_out = run.layer_seed(head, NoiseKind.OUTPUT)
    if likelihood == "categorical":
        if mean.dim() != 2:
            raise ValueError(f"model: categorical expected_log_likelihood needs (B, K) logits, got "
                             f"{tuple(mean.shape)}")
        stream = gaussian_stream(mean.shape, seed_out, num_samples, mean.dtype, mean.device)
        value = -_softmax_ce(stream, mean, std, y, chunk_size)
    else:
        target = y.reshape(mean.shape).to(mean.dtype)
        tau = torch.as_tensor(noise_std, dtype=mean.dtype, device=mean.device)
        stream = gaussian_stream(mean.shape, seed_out, num_samples, mean.dtype, mean.device)
        t1, t2 = _normal_statistics(stream, chunk_size)
        r = target - mean
        # (1/M) Σ_i (y − m − s ε_i)² = r² − 2 r s mean(ε) + s² mean(ε²)  (collapsed, Thm 2)
        sq = r * r - 2 * r * std * t1 + std * std * t2
        value = -0.5 * sq / tau ** 2 - torch.log(tau) - 0.5 * math.log(2 * math.pi)
        value = value.reshape(value.shape[0], -1).sum(1)
    return _reduce(value, reduction)
