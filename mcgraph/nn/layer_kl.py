"""KL terms of Bayesian layers: registered rules for (posterior, prior) pairs, else the engine.

A Bayesian layer's KL is, by default, :func:`mcgraph.kl_divergence` (closed-form entropy,
E_q[log p] by the collapsed / fused / chunked tier). Some methods define their KL term
differently: automatic relevance determination optimises the prior in closed form, sparse
variational dropout offers the published approximation of the log-uniform KL. Such a method
registers one rule for its (posterior class, prior class) pair,

.. code-block:: python

    @mg.nn.register_layer_kl(torch.distributions.Normal, MyPrior, sparsifying=True)
    def _kl(q, p, num_samples, seed, method):
        return ...            # elementwise KL, shape q.batch_shape

and the layer uses it. Lookup picks the most specific pair in both classes' MROs (as
``torch.distributions.kl.register_kl`` does). A rule marked ``sparsifying`` declares a KL that
drives weights to log α = log σ² − log μ² → ∞; :func:`mcgraph.nn.prune` prunes only layers whose
rule says so.

Pruned layers (see :mod:`mcgraph.nn.masks`): the KL is that of the weights still in the model,
computed from the stored (unmasked) variational parameters; a pruned weight is the constant 0
and contributes nothing.

The commonest pair, a Normal posterior under a Normal prior, takes torch's closed form straight
from (μ, σ) and the prior's numbers, without building the two distributions or passing through
the engine's dispatch: the same numbers and gradients, at about a third of the cost on a small
layer (the KL of every training step).

Example:
    >>> import torch, mcgraph as mg
    >>> q = torch.distributions.Normal(torch.tensor([1.0, 0.1]), torch.tensor([0.1, 1.0]))
    >>> mg.nn.divergence(q, mg.nn.make_prior("ard", q.loc), num_samples=1)   # ½ log(1 + 1/α)
    tensor([2.3076, 0.0050])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributions import Distribution, Normal
from torch.distributions.kl import _kl_normal_normal

from ..engine import api
from ..engine.closed_form import registered_kl
from ..registry import Registry
from ..engine.shapes import broadcast_shapes
from ..engine.api import kl_divergence
from ..engine.noise.streams import mix_seed, resolve_seed
from ..engine.options import Sampling, resolve_sampling
from .masks import unmasked_posterior, weight_mask

__all__ = ["LayerKLRule", "LAYER_KL", "register_layer_kl", "find_layer_kl", "divergence", "layer_kl",
           "layer_rule", "is_sparsifying", "uses_layer_rule"]


@dataclass(frozen=True)
class LayerKLRule:
    """A registered KL of one (posterior class, prior class) pair.

    Attributes:
        fn: ``fn(q, p, num_samples, seed, method) -> Tensor`` of shape ``q.batch_shape``.
        sparsifying: whether the KL drives log α → ∞ (the layer can be pruned by log α).
    """

    fn: Callable[..., torch.Tensor]
    sparsifying: bool = False


LAYER_KL: Registry = Registry("layer KL rule", by_type=True)
"""``(posterior class, prior class) -> LayerKLRule``; the most specific pair by MRO wins."""


def register_layer_kl(q_type: type, p_type: type, *, sparsifying: bool = False):
    """Register ``fn(q, p, num_samples, seed, method)`` as the layer KL of ``(q_type, p_type)`` (decorator or call).

    Raises:
        TypeError: a type that is not a ``Distribution`` subclass.
    """
    for name, t in (("q_type", q_type), ("p_type", p_type)):
        if not (isinstance(t, type) and issubclass(t, Distribution)):
            raise TypeError(f"{name} must be a torch.distributions.Distribution subclass, got {t!r}")

    def decorator(fn):
        LAYER_KL.register((q_type, p_type), LayerKLRule(fn, bool(sparsifying)))
        return fn

    return decorator


def find_layer_kl(q_type: type, p_type: type) -> LayerKLRule | None:
    """The most specific registered rule for ``(q_type, p_type)``, or ``None`` (the engine's KL applies)."""
    return LAYER_KL.lookup((q_type, p_type), None)


def divergence(q: Distribution, p: Distribution, num_samples: int | Sampling, *, seed: int | None = None,
               method: str = "auto", process_group=None) -> torch.Tensor:
    """Elementwise KL(q ‖ p) as a Bayesian layer computes it: a registered rule, else :func:`mcgraph.kl_divergence`.

    ``process_group`` splits the engine's samples across processes; a registered rule is evaluated
    whole on every rank (the same value everywhere).
    """
    num_samples, o = resolve_sampling(num_samples, seed=(seed, None), method=(method, "auto"),
                                      process_group=(process_group, None))
    seed, method, process_group = o["seed"], o["method"], o["process_group"]
    rule = find_layer_kl(type(q), type(p))
    if rule is None:
        return kl_divergence(q, p, num_samples, seed=seed, method=method, process_group=process_group)
    return rule.fn(q, p, num_samples, resolve_seed(seed), method)


def layer_rule(layer) -> LayerKLRule | None:
    """The registered KL rule of the layer's (posterior, prior) pair, or ``None`` (the engine's KL)."""
    with torch.no_grad():
        return find_layer_kl(type(unmasked_posterior(layer)), type(layer.prior))


def is_sparsifying(layer) -> bool:
    """Whether the layer's (posterior, prior) pair has a registered sparsifying KL."""
    rule = layer_rule(layer)
    return rule is not None and rule.sparsifying


def uses_layer_rule(layer) -> bool:
    """Whether the layer's KL is not the engine's plain one: a registered rule, or a pruned weight."""
    return weight_mask(layer) is not None or layer_rule(layer) is not None


def _normal_prior_numbers(spec, like: torch.Tensor) -> tuple | None:
    """``(loc, scale)`` of the prior ``spec`` gives a parameter like ``like`` when that prior is a torch
    ``Normal``, else ``None``: ``(None, None)`` for N(0, 1) (the named ``"normal"`` prior, as ``make_prior``
    builds it), a ``Normal`` instance's tensors, or what a prior factory's ``normal_parameters(like)``
    returns (the tensors its ``__call__`` would build the ``Normal`` from, ``(None, None)`` for N(0, 1))."""
    from .priors import PRIORS, _normal_prior

    if isinstance(spec, str):
        return (None, None) if PRIORS.get(spec.lower()) is _normal_prior else None
    if type(spec) is Normal:
        try:  # as make_prior checks it: a prior that no longer fits takes the general path and its error
            broadcast_shapes(spec.batch_shape, like.shape)
        except RuntimeError:
            return None
        return spec.loc, spec.scale
    numbers = getattr(spec, "normal_parameters", None)
    return None if numbers is None else numbers(like)


def _normal_normal_sum(mu: torch.Tensor, sigma: torch.Tensor, loc: torch.Tensor | None,
                       scale: torch.Tensor | None) -> torch.Tensor:
    """Σ KL(N(μ, σ²) ‖ N(loc, scale²)) by torch's ``_kl_normal_normal``, operation for operation; ``None``
    for N(0, 1), whose ``- 0`` and ``/ 1`` are exact and left out (the same numbers and gradients)."""
    if scale is None:
        var_ratio, t1 = sigma.pow(2), mu.pow(2)
    else:
        var_ratio = (sigma / scale).pow(2)
        t1 = ((mu - loc) / scale).pow(2)
    return (0.5 * (var_ratio + t1 - 1 - var_ratio.log())).sum()


def _plain_normal_kl(layer) -> torch.Tensor | None:
    """The KL of a plain Normal-posterior layer under a Normal prior, without building the distributions.

    Under ``method="auto"`` that KL is torch's closed form (:func:`mcgraph.kl_divergence`); building the
    posterior and prior objects and dispatching through the engine cost about three times the
    formula on a small layer, every training step. Returns exactly the numbers of the general path,
    or ``None`` where that path must run: another posterior, prior or layer class (one that builds
    its own distributions), a pruned layer, a registered layer rule, a KL rule re-registered with
    torch, or a result that is not finite (the general path names the parameter at fault).
    """
    plain = getattr(layer, "_has_plain_distributions", None)
    if getattr(layer, "_posterior_factory", None) is not Normal or plain is None or not plain():
        return None
    numbers = _normal_prior_numbers(layer.prior_spec, layer.weight_mu)
    bias_numbers = None if layer.bias_mu is None else _normal_prior_numbers(layer.prior_spec, layer.bias_mu)
    if (numbers is None or (layer.bias_mu is not None and bias_numbers is None) or weight_mask(layer) is not None
            or find_layer_kl(Normal, Normal) is not None or registered_kl(Normal, Normal) is not _kl_normal_normal):
        return None
    value = _normal_normal_sum(layer.weight_mu, layer.weight_sigma, *numbers)
    if bias_numbers is not None:
        value = value + _normal_normal_sum(layer.bias_mu, layer.bias_sigma, *bias_numbers)
    if api._VALIDATE and not bool(torch.isfinite(value.detach())):
        return None
    return value


def layer_kl(layer, num_samples: int, *, seed: int, method: str = "auto", process_group=None) -> torch.Tensor:
    """KL(q ‖ p) of a Bayesian layer's weight (and Bayesian bias), summed: a 0-d tensor.

    A pruned layer contributes the KL of its remaining weights only.

    Raises:
        ValueError: a pruned layer whose posterior does not factorise over the weights
            (its KL is not elementwise, so the pruned weights cannot be left out).
    """
    if method == "auto" and process_group is None:
        value = _plain_normal_kl(layer)
        if value is not None:
            return value
    mask = weight_mask(layer)
    q = layer.posterior if mask is None else unmasked_posterior(layer)
    value = divergence(q, layer.prior, num_samples, seed=seed, method=method, process_group=process_group)
    if mask is not None:
        if value.shape != mask.shape:
            raise ValueError(f"layer: the KL of a pruned {type(q).__name__} posterior has shape {tuple(value.shape)}, "
                             f"not the weight shape {tuple(mask.shape)}; pruning needs a factorised posterior")
        value = torch.where(mask, value, torch.zeros((), dtype=value.dtype, device=value.device))
    value = value.sum()
    if layer.bias_mu is not None:
        value = value + divergence(layer.bias_posterior, layer.bias_prior, num_samples, seed=mix_seed(seed, 1),
                                   method=method, process_group=process_group).sum()
    return value
