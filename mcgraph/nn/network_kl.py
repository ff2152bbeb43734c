"""The KL of a whole model: the sum of its Bayesian layers' KL terms, each with its own prior."""

from __future__ import annotations

from torch import nn

from ..engine import checks
from ..engine.distributed import sharded
from ..engine.noise.streams import mix_seed, resolve_seed, reuse_noise_blocks
from ..engine.options import Sampling, resolve_sampling
from ..engine.stderr import MCEstimate
from .context import bayesian_modules
from .model_checks import require_bayesian

__all__ = ["kl"]


def kl(model: nn.Module, num_samples: int | Sampling | None = None, *, seed: int | None = None,
       method: str = "auto", return_stderr: bool = False, process_group=None):
    """Sum of KL(q ‖ p) over the Bayesian layers of ``model``, each with its own prior.

    .. math::
        KL(q\\|p) = \\sum_{\\text{layers } l} \\sum_{j} KL(q_{lj} \\| p_{lj})

    (a sum over weights; scale it by the dataset size yourself or use
    :func:`~mcgraph.nn.elbo`). Each layer's term goes through
    :func:`mcgraph.kl_divergence`: exact where exact exists under ``method="auto"`` (torch's closed
    form: Normal ‖ Normal, …; ``num_samples`` unused), else sampled with a graph that does not
    grow with M.

    Args:
        model: a module containing Bayesian layers (or a Bayesian layer).
        num_samples: M for every layer; ``None`` uses each layer's ``kl_samples``; or a
            :class:`~mcgraph.Sampling` carrying M and the options below.
        seed: noise seed; layer ``l`` uses ``mix(seed, l)`` (``None``: drawn once).
        method: the KL's method (``"auto"``: exact where exact exists; ``"monte-carlo"``: sampled;
            ``"collapsed-exact"``, ``"direct"``, …; :data:`mcgraph.engine.methods.KL_METHODS`).
        return_stderr: return an :class:`~mcgraph.MCEstimate` ``(value, stderr, num_samples)``: the
            standard error of the sum (layers are seeded apart, so their variances add; see
            :meth:`BayesLayer.kl`); ``num_samples`` is the smallest M of the layers.
        process_group: ``None``, or a ``torch.distributed`` group whose ranks split every layer's
            samples (:func:`mcgraph.expectation`); each rank gets the full KL and its gradients,
            so under data parallelism the KL is counted once (see the README).

    Returns:
        A 0-d tensor.

    Raises:
        ValueError: ``model`` has no Bayesian layer (its KL would silently be 0).
        TypeError: ``model`` holds another library's Bayesian layers that were not converted
            (``mcgraph.interop.<library>.to_mcgraph``).

    Example:
        >>> import torch, mcgraph as mg
        >>> bnn = mg.nn.bayesify(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
        ...                                          torch.nn.Linear(8, 2)), prior="laplace", kl_samples=100)
        >>> value = mg.nn.kl(bnn, seed=0)
        >>> value.shape, value.requires_grad
        (torch.Size([]), True)
    """
    require_bayesian(model, "mg.nn.kl")
    return checked_model_kl(model, num_samples, seed=seed, method=method, return_stderr=return_stderr,
                            process_group=process_group)


def checked_model_kl(model: nn.Module, num_samples: int | None = None, *, seed: int | None = None,
                     method: str = "auto", return_stderr: bool = False, process_group=None):
    """:func:`kl` once ``model`` is known to hold Bayesian layers and no unconverted foreign ones."""
    num_samples, o = resolve_sampling(num_samples, seed=(seed, None), method=(method, "auto"),
                                      return_stderr=(return_stderr, False), process_group=(process_group, None))
    seed, method, return_stderr, process_group = o["seed"], o["method"], o["return_stderr"], o["process_group"]
    num_samples = checks.positive_int("num_samples", num_samples, allow_none=True)
    seed = checks.seed("seed", seed)
    # the layers' noise streams draw one after another into one block of memory
    with sharded(process_group, seed, 0 if num_samples is None else num_samples) as (shard, seed), \
            reuse_noise_blocks():
        layers = bayesian_modules(model)
        seed = resolve_seed(seed)
        total = var = None
        for i, layer in enumerate(layers):
            v = layer.kl(num_samples, seed=mix_seed(seed, i), method=method, return_stderr=return_stderr,
                         process_group=shard)
            if return_stderr:
                v, se = v[0], v[1]
                var = se * se if var is None else var + se * se
            total = v if total is None else total + v
    if return_stderr:
        m = num_samples if num_samples is not None else min(layer.kl_samples for layer in layers)
        return MCEstimate(total, var.sqrt(), m)
    return total
