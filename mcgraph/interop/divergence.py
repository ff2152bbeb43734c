"""KL(q ‖ p) of a foreign model, summed over its sites or scaled as its library scales it.

.. math::
    KL(q\\|p) = \\sum_{\\text{sites } s} \\sum_j KL\\big(q_{sj} \\,\\|\\, p_{sj}\\big)

Each site's term is :func:`site_kl` = :func:`mcgraph.kl_divergence`, exact where exact exists:
torch's closed form where torch has a rule for the pair (Normal‖Normal: exact, as
bayesian-torch and torchbnn compute it), otherwise the engine's estimate with M samples
(scale mixtures, floored densities, Student-t, …), whose autograd graph does not grow with M. Parameters are read when called
(nothing is cached) and gradients land on the Parameters the user's optimizer holds; the
foreign model is not modified. Site ``i`` uses the noise seed ``mix(seed, i)``.

``reduction="sum"`` is the true KL. A library's own scaling is a named reduction of its
adapter (``"per_tensor_mean"`` for bayesian-torch, ``"mean"`` for torchbnn,
``"layer_mean"`` for torch-uncertainty), so the adapter can replace its loss unchanged.

Example:
    >>> import torch, mcgraph.interop as interop
    >>> from bayesian_torch.layers import LinearReparameterization
    >>> from bayesian_torch.models.dnn_to_bnn import get_kl_loss
    >>> layer = LinearReparameterization(4, 3)
    >>> value = interop.kl(layer, num_samples=100, reduction="per_tensor_mean")
    >>> torch.allclose(value, get_kl_loss(layer))
    True
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.distributions import Distribution

from ..engine import checks
from ..engine.api import kl_divergence
from ..engine.distributed import sharded
from ..engine.noise.streams import mix_seed, resolve_seed
from ..engine.options import Sampling, resolve_sampling
from ..engine.methods import KL_METHODS as _KL_METHODS, parse_method
from .sites import VariationalSite, foreign_layers

__all__ = ["site_kl", "sites_kl", "kl", "KL_METHODS"]

#: ``method`` values: ``"auto"`` (exact where exact exists: torch's closed form, else the engine with
#: exact polynomial terms), ``"closed-form"`` (torch's rule, required), ``"monte-carlo"`` (sampled), or
#: an engine method forced on every site (the same values as :func:`mcgraph.kl_divergence`).
KL_METHODS = tuple(m.value for m in _KL_METHODS)


def _check_method(method) -> str:
    return parse_method(method, _KL_METHODS)


def site_kl(q: Distribution, p: Distribution, num_samples: int | Sampling, *, seed: int | None = None,
            method: str = "auto", process_group=None) -> torch.Tensor:
    """KL(q ‖ p) elementwise: :func:`mcgraph.kl_divergence` (torch's closed form where it has one, else
    mcgraph's M-sample estimate under ``"auto"``).

    Args:
        q: the posterior of one site (any distribution :func:`mcgraph.kl_divergence` accepts).
        p: its prior.
        num_samples: M of the estimate (unused by a closed form), or a :class:`~mcgraph.Sampling` with
            M, ``seed``, ``method`` and ``process_group``.
        seed: noise seed of the estimate (``None``: drawn from torch's global generator).
        method: ``"auto"``, ``"closed-form"``, ``"monte-carlo"`` or an engine method (:data:`KL_METHODS`).
        process_group: split the estimate's samples across a ``torch.distributed`` group
            (:func:`mcgraph.expectation`; a closed form is computed whole on every rank).

    Returns:
        Tensor of shape ``q.batch_shape`` broadcast with p's batch shape.

    Raises:
        NotImplementedError: ``method="closed-form"`` and torch has no rule for the pair.
    """
    num_samples, o = resolve_sampling(num_samples, seed=(seed, None), method=(method, "auto"),
                                      process_group=(process_group, None))
    return kl_divergence(q, p, num_samples, seed=o["seed"], method=_check_method(o["method"]),
                         process_group=o["process_group"])


def sites_kl(found: Sequence[VariationalSite], num_samples: int, *, seed: int | None = None,
             method: str = "auto", process_group=None) -> list[torch.Tensor]:
    """The summed KL of each site (0-d tensors), site ``i`` seeded with ``mix(seed, i)``."""
    with sharded(process_group, seed, num_samples) as (shard, seed):
        num_samples = checks.positive_int("num_samples", num_samples)
        _check_method(method)
        seed = resolve_seed(seed)
        return [site_kl(s.posterior, s.prior, int(num_samples), seed=mix_seed(seed, i), method=method,
                        process_group=shard).sum()
                for i, s in enumerate(found)]


def reduce(adapter, reduction: str, found: Sequence[VariationalSite], values: Sequence[torch.Tensor]) -> torch.Tensor:
    """``"sum"`` or one of ``adapter.reductions`` applied to the per-site KLs."""
    if reduction == "sum":
        return torch.stack(list(values)).sum()
    try:
        rule = adapter.reductions[reduction]
    except KeyError:
        raise ValueError(f"reduction must be one of {['sum', *adapter.reductions]} for {adapter.name} models, "
                         f"got {reduction!r}") from None
    return rule(found, values)


def kl(model: nn.Module, num_samples: int | Sampling, *, seed: int | None = None, method: str = "auto",
       reduction: str = "sum", library: str | None = None, process_group=None, **options) -> torch.Tensor:
    """KL(q ‖ p) of a model built with another library (a 0-d tensor).

    Args:
        model: the foreign model (unchanged by the call).
        num_samples: M of every Monte Carlo site (sites with a closed form ignore it), or a
            :class:`~mcgraph.Sampling` with M, ``seed``, ``method`` and ``process_group``.
        seed: noise seed (``None``: drawn from torch's global generator).
        method: ``"auto"``, ``"closed-form"`` or an engine method (:data:`KL_METHODS`).
        reduction: ``"sum"`` (the KL) or a native reduction of the model's library.
        library: require this library's layers (``None``: whichever the model uses).
        process_group: ``None``, or a ``torch.distributed`` group whose ranks split every
            Monte Carlo site's samples; each rank gets the full KL (:mod:`mcgraph.engine.distributed`).
        **options: the library's site options (``prior_floor`` for blitz); only with ``library``.

    Raises:
        ValueError: no Bayesian layer, several libraries, an unknown reduction or method, a
            prior that does not broadcast with its tensor (naming the site).
    """
    num_samples, o = resolve_sampling(num_samples, seed=(seed, None), method=(method, "auto"),
                                      process_group=(process_group, None))
    seed, method, process_group = o["seed"], o["method"], o["process_group"]
    layers = foreign_layers(model, library)
    if options and library is None:
        raise TypeError(f"kl: options {sorted(options)} need library= (they belong to one library)")
    adapter = layers[0][2]
    found = [s for name, module, a in layers for s in a.layer_sites(module, name, **options)]
    return reduce(adapter, reduction, found, sites_kl(found, num_samples, seed=seed, method=method,
                                                      process_group=process_group))
