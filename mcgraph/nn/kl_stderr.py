"""Standard errors of a Bayesian network's Monte Carlo terms: the KL of a layer, summed.

A layer's KL is a sum over its weights (and its Bayesian bias) of M-sample estimates.
The elements of the posterior's batch have independent noise (each draws its own ξ; a
Radial posterior is one event, whose sum over elements the engine's standard error already
covers), and the bias is seeded apart, so the variances of the summed estimates add:

.. math::
    \\operatorname{se}\\Big(\\sum_j \\widehat{KL}_j\\Big) = \\Big(\\sum_j \\operatorname{se}_j^2\\Big)^{1/2}.
"""

from __future__ import annotations

import torch

from ..engine.api import kl_divergence
from ..engine.noise.streams import mix_seed

__all__ = ["layer_kl_with_stderr"]


def layer_kl_with_stderr(layer, num_samples: int, seed: int,
                         method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(KL, stderr)`` of ``layer``'s weight (and Bayesian bias), with the seeds of ``layer.kl``.

    A layer whose KL comes from a registered rule (ARD, Sparse VD's fit) or that is pruned
    (:func:`mcgraph.nn.layer_kl.layer_kl`) reports a NaN standard error: the rule's error is not known.
    """
    from .layer_kl import layer_kl, uses_layer_rule

    if uses_layer_rule(layer):
        value = layer_kl(layer, num_samples, seed=seed, method=method)
        return value, torch.full_like(value.detach(), float("nan"))
    est = kl_divergence(layer.posterior, layer.prior, num_samples, seed=seed, method=method,
                        return_stderr=True)
    value, var = est.value.sum(), est.stderr.square().sum()
    if layer.bias_mu is not None:
        b = kl_divergence(layer.bias_posterior, layer.bias_prior, num_samples, seed=mix_seed(seed, 1),
                          method=method, return_stderr=True)
        value, var = value + b.value.sum(), var + b.stderr.square().sum()
    return value, var.sqrt()
