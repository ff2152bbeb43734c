"""Weights of a Bayesian site for modules that run torch's fused operations on sampled weights.

A *site* is a :class:`~mcgraph.nn.BayesLinear` used as a holder of one weight matrix (and its bias)
by a module that never calls the site's ``forward``: the recurrent layers hand the sampled
weights to torch's fused recurrent kernels, the attention layer to
``F.multi_head_attention_forward``. The site keeps everything a Bayesian layer has (posterior,
prior, KL, masks, mode), so :func:`~mcgraph.nn.kl`, :func:`~mcgraph.nn.set_mode` and the pruning
tools reach it like any layer.
"""

from __future__ import annotations

import contextlib

import torch

from ..engine.noise.streams import mix_seed
from .context import NoiseKind, current_window
from .estimator import Estimator, estimator_flags, parse_estimator
from .layers import BayesLinear, SampleMode

__all__ = ["SiteWeights", "site_weights", "sample_rng", "sampled_weights_only"]


def sampled_weights_only(options: dict, what: str, why: str) -> dict:
    """The layer options of a module whose sites hand sampled *weights* to a torch kernel: local
    reparameterization and flipout (which sample activations) are refused, naming the option and ``why``."""
    if parse_estimator(options.get("estimator")) not in (None, Estimator.REPARAMETERIZATION):
        raise ValueError(f"estimator={options['estimator']!r} is not available for {what}: {why}")
    for name in ("local_reparameterization", "flipout"):
        if options.get(name):
            raise ValueError(f"{name}=True is not available for {what}: {why}")
    if options.get("local_reparameterization") is not None or options.get("flipout") is not None:
        estimator_flags(None, options.pop("local_reparameterization", None), options.pop("flipout", None))  # warns
    options["estimator"] = Estimator.REPARAMETERIZATION
    return options


class SiteWeights:
    """The weight and bias of one site for the ``S`` samples of the active window.

    ``weight``: ``(S, out, in)`` samples, or the ``(out, in)`` mean (``batched=False``); ``bias`` likewise
    (``None`` when the site has none). :meth:`at` gives sample ``s``'s pair.
    """

    __slots__ = ("weight", "bias", "batched")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batched: bool) -> None:
        self.weight, self.bias, self.batched = weight, bias, batched

    def at(self, s: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.batched:
            return self.weight, self.bias
        return self.weight[s], None if self.bias is None else self.bias[s]


def site_weights(site: BayesLinear) -> SiteWeights:
    """One draw per sample of the active window (one draw outside a window), or the means in ``"mean"`` mode."""
    if site.mode == SampleMode.MEAN:
        return SiteWeights(site.weight_mu, site._bias_mean, False)
    w = site._samples_of(site.posterior, NoiseKind.WEIGHT)
    if site.bias_mu is not None:
        return SiteWeights(w, site._samples_of(site.bias_posterior, NoiseKind.BIAS), True)
    bias = None if site.bias is None else site.bias[None].expand(w.shape[0], -1)
    return SiteWeights(w, bias, True)


@contextlib.contextmanager
def sample_rng(module: torch.nn.Module, sample: int, kind: int, device: torch.device):
    """Inside a sample window: torch's generator forked and seeded for sample ``start + sample`` of ``module``'s
    stream ``kind`` (so dropout drawn by a fused torch op replays exactly); outside a window: unchanged."""
    win = current_window()
    if win is None:
        yield
        return
    seed = mix_seed(win.run.layer_seed(module, kind), win.start + sample)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if device.type != "cpu" else "cuda"):
        torch.manual_seed(seed)
        yield
