"""Sparse variational dropout (Molchanov, Ashukha & Vetrov, ICML 2017): the ``"sparse_vd"`` posterior.

Each weight has a Gaussian posterior in the additive-noise parameterization,

.. math::
    q(w) = \\mathcal N(\\theta, \\sigma^2), \\qquad \\rho = \\log\\sigma^2 \\text{ trained},
    \\qquad \\log\\alpha = \\log\\sigma^2 - \\log\\theta^2,

under the improper log-uniform prior p(w) ∝ 1/|w|. Its KL depends on α only and is an
expectation of a non-polynomial integrand,

.. math::
    KL(\\alpha) = -\\tfrac12\\log(2\\pi e) - \\tfrac12\\log\\alpha
      + E_{\\varepsilon\\sim\\mathcal N(0,1)}\\log\\lvert 1 + \\sqrt{\\alpha}\\,\\varepsilon\\rvert - c_\\infty ,

with the additive constant fixed so that KL → 0 as α → ∞ (:data:`C_INF` = its limit
−½ log(2πe) − ½(γ + log 2)). Two routes, chosen by ``SparseVD(kl=...)``:

* ``kl="approx"`` (default): the published fit (Molchanov et al., 2017, Eq. 14),
  :math:`KL \\approx k_1 - k_1\\,\\mathrm{sigmoid}(k_2 + k_3\\log\\alpha) + \\tfrac12\\log(1 + \\alpha^{-1})`,
  k1 = 0.63576, k2 = 1.87320, k3 = 1.48695 (maximum deviation from the exact KL ≈ 0.0094,
  at log α ≈ −3.5);
* ``kl="mc"``: mcgraph's many-sample estimate of the same KL — ``mg.kl_divergence`` of the
  Gaussian against :class:`~mcgraph.distributions.LogUniform` (closed-form entropy, E_q[log|w|]
  by the fused tier, graph independent of the layer's ``kl_samples``), minus :data:`C_INF`.

Layers built with ``posterior="sparse_vd"`` default to ``prior="log_uniform"``, local
reparameterization, ``scale_transform="exp_half"`` (ρ = log σ²) and ρ = −10. The prior may also be
``"ard"`` (:mod:`mcgraph.nn.ard`); a prior with no sparsifying KL rule is refused.

Molchanov et al.'s code trains with two more devices (``nets/layers.py`` of
bayesgroup/variational-dropout-sparsifies-dnn, their ``train_clip=True``), which
:func:`train_clip` installs on a network's Sparse VD layers (in place, like
``torch.nn.utils.parametrizations.weight_norm``):

* **train-time zeroing**: in the mean of the pre-activation, a weight with log α ≥ ``threshold``
  (default 3) counts as 0 during training too, not only once pruned: the network trains as the
  pruned network it is scored as, and such a weight's θ feels only the KL, which shrinks it further;
* **log α clipping** to [−``log_alpha_clip``, ``log_alpha_clip``] (default 8) in the KL
  (``SparseVD(log_alpha_clip=...)``) and in the variance of the pre-activation, σ² = e^{clip(log α)}θ²
  (no gradient in log σ² outside the bounds).

Without :func:`train_clip` (the default of ``posterior="sparse_vd"``) neither is applied.

Example:
    >>> import torch, mcgraph as mg
    >>> net = mg.nn.bayesify(mg.models.get_model("lenet300_100", image_size=8), posterior="sparse_vd")
    >>> layer = net.classifier[1]
    >>> layer.local_reparameterization, str(layer.scale_transform), type(layer.prior).__name__
    (True, 'exp_half', 'LogUniform')
    >>> kl = mg.nn.kl(net)                                    # the approximation, summed over weights
    >>> mc = mg.nn.bayesify(torch.nn.Linear(4, 3), posterior=mg.nn.SparseVD(kl="mc"), kl_samples=10_000)
    >>> mg.nn.kl(mc, seed=0).shape
    torch.Size([])
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributions import Distribution, Normal
from torch.nn.utils import parametrize

from ..engine.api import kl_divergence
from ..distributions import LogUniform
from .layer_kl import find_layer_kl, register_layer_kl
from .masks import _MaskMean, _MaskScale, weight_mask
from .priors import register_posterior

__all__ = ["SparseVD", "SparseVDNormal", "K1", "K2", "K3", "C_INF", "KL_ROUTES", "log_alpha", "kl_approx",
           "kl_log_uniform", "train_clip", "is_train_clipped"]

K1, K2, K3 = 0.63576, 1.87320, 1.48695
"""The constants of the published approximation (Molchanov et al., 2017, Eq. 14)."""

C_INF = -0.5 * math.log(2 * math.pi * math.e) - 0.5 * (0.5772156649015329 + math.log(2.0))
"""lim_{α→∞} of E_q[log q] − E_q[−log|w|] for q = N(θ, αθ²): −½ log(2πe) + E log|ε| (≈ −2.0541)."""

KL_ROUTES = ("approx", "mc")


def log_alpha(q: Normal) -> torch.Tensor:
    """log α = log σ² − log θ² of a Gaussian posterior (θ = 0 gives a large finite value, zero gradient in θ)."""
    theta, sigma = q.loc, q.scale
    tiny = torch.finfo(theta.dtype).tiny
    return 2 * torch.log(sigma) - torch.log(theta * theta + tiny)


def kl_approx(log_alpha: torch.Tensor) -> torch.Tensor:
    """The published approximation of KL(N(θ, αθ²) ‖ log-uniform), zero as α → ∞.

    .. math::
        KL(\\alpha) \\approx k_1 - k_1\\,\\mathrm{sigmoid}(k_2 + k_3\\log\\alpha)
            + \\tfrac12\\log(1 + e^{-\\log\\alpha})

    Example:
        >>> import torch, mcgraph as mg
        >>> [round(v, 4) for v in mg.nn.sparse_vd.kl_approx(torch.tensor([-8.0, 0.0, 8.0])).tolist()]
        [4.6359, 0.4312, 0.0002]
    """
    return K1 - K1 * torch.sigmoid(K2 + K3 * log_alpha) + 0.5 * torch.nn.functional.softplus(-log_alpha)


def kl_log_uniform(q: Normal, num_samples: int, *, seed: int | None = None, method: str = "auto") -> torch.Tensor:
    """mcgraph's ``num_samples``-sample estimate of the KL of :func:`kl_approx`, same constant (→ 0 as α → ∞).

    ``mg.kl_divergence(N(θ, σ), LogUniform())`` − :data:`C_INF`: the entropy in closed form and
    E_q[log|w|] by the engine (fused tier: one pass, O(P) saved tensors for any M).

    Example:
        >>> import torch, mcgraph as mg
        >>> q = torch.distributions.Normal(torch.ones(3), torch.tensor([0.1, 1.0, 10.0]))
        >>> est = mg.nn.sparse_vd.kl_log_uniform(q, 200_000, seed=0)
        >>> ref = mg.nn.sparse_vd.kl_approx(mg.nn.sparse_vd.log_alpha(q))
        >>> bool((est - ref).abs().max() < 0.02)
        True
    """
    base = Normal(q.loc, q.scale, validate_args=False)
    return kl_divergence(base, LogUniform(), num_samples, seed=seed, method=method) - C_INF


class SparseVDNormal(Normal):
    """The Gaussian posterior of a sparse-VD weight: ``Normal(θ, σ)`` that knows its KL route.

    Sampling, entropy and the engine's families are those of ``Normal``; only the layer KL
    against a log-uniform prior differs (see the module docstring).

    Args:
        loc: θ.
        scale: σ.
        kl: ``"approx"`` or ``"mc"``.
        log_alpha_clip: the KL is evaluated at log α clipped to [−c, c] (``None``: not clipped).
    """

    def __init__(self, loc, scale, kl: str = "approx", validate_args=None, log_alpha_clip: float | None = None) -> None:
        super().__init__(loc, scale, validate_args=validate_args)
        self.kl_route = kl
        self.log_alpha_clip = log_alpha_clip

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(SparseVDNormal, _instance)
        new = super().expand(batch_shape, _instance=new)
        new.kl_route = self.kl_route
        new.log_alpha_clip = self.log_alpha_clip
        return new

    @property
    def log_alpha(self) -> torch.Tensor:
        """log α = log σ² − log θ²."""
        return log_alpha(self)


def _check_clip(name: str, value) -> None:
    """Refuse a log α bound that is not ``None`` or a positive finite real number."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive real number or None, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number or None, got {value!r}")


@dataclass(frozen=True)
class SparseVD:
    """The ``"sparse_vd"`` posterior family: ``SparseVD(kl, log_alpha_clip)(θ, σ) -> SparseVDNormal``.

    Args:
        kl: the KL route against the log-uniform prior: ``"approx"`` (published fit) or ``"mc"``
            (the engine's many-sample estimate with the layer's ``kl_samples``).
        log_alpha_clip: evaluate the KL at log α clipped to [−c, c], with no gradient in log α outside
            (Molchanov et al.'s code clips at 8; ``None``, the default: not clipped). The ``"approx"``
            route only. :func:`train_clip` sets it, and clips the pre-activation's variance too.

    Raises:
        ValueError: an unknown ``kl`` route; a ``log_alpha_clip`` that is not positive and finite, or
            given with ``kl="mc"``.
        TypeError: a ``log_alpha_clip`` that is not a real number.
    """

    kl: str = "approx"
    log_alpha_clip: float | None = None

    #: What a layer with this posterior uses when the caller leaves the option at None.
    layer_defaults = {"prior": "log_uniform", "local_reparameterization": True, "rho_init": -10.0,
                      "scale_transform": "exp_half"}

    def __post_init__(self):
        if self.kl not in KL_ROUTES:
            raise ValueError(f"kl must be one of {KL_ROUTES}, got {self.kl!r}")
        _check_clip("log_alpha_clip", self.log_alpha_clip)
        if self.log_alpha_clip is not None and self.kl != "approx":
            raise ValueError(f"log_alpha_clip: only the 'approx' KL route clips log α, got kl={self.kl!r}")

    @property
    def __name__(self) -> str:
        options = ([] if self.kl == "approx" else [f"kl={self.kl}"]) + (
            [] if self.log_alpha_clip is None else [f"log_alpha_clip={self.log_alpha_clip:g}"])
        return "sparse_vd" + (f"({', '.join(options)})" if options else "")

    def __call__(self, loc: torch.Tensor, scale: torch.Tensor) -> SparseVDNormal:
        return SparseVDNormal(loc, scale, kl=self.kl, log_alpha_clip=self.log_alpha_clip)

    def check_prior(self, prior: Distribution) -> None:
        """Refuse a prior without a sparsifying KL rule for this posterior (e.g. ``"normal"``).

        Raises:
            ValueError: naming the prior and the usable ones.
        """
        rule = find_layer_kl(SparseVDNormal, type(prior))
        if rule is None or not rule.sparsifying:
            raise ValueError(f"prior: posterior='sparse_vd' needs a sparsifying prior ('log_uniform' or 'ard'), "
                             f"got {type(prior).__name__}")


register_posterior("sparse_vd")(SparseVD())


@register_layer_kl(SparseVDNormal, LogUniform, sparsifying=True)
def _sparse_vd_log_uniform(q: SparseVDNormal, p, num_samples: int, seed: int, method: str) -> torch.Tensor:
    if q.kl_route == "mc":
        return kl_log_uniform(q, num_samples, seed=seed, method=method)
    la = log_alpha(q)
    clip = getattr(q, "log_alpha_clip", None)
    return kl_approx(la if clip is None else la.clamp(-clip, clip))


# ---------------------------------------------------------------- train-time zeroing and clipping


class _TrainClipMean(_MaskMean):
    """θ ↦ θ ∘ m ∘ 1[log α < threshold], log α from the stored θ and ρ = log σ² (a weight mask that also
    zeroes, while training, the weights a pruning at ``threshold`` would remove; ``m`` is the pruning mask,
    all True until :func:`mcgraph.nn.prune`)."""

    def __init__(self, mask: torch.Tensor, rho: torch.Tensor, threshold: float) -> None:
        super().__init__(mask)
        self._rho = [rho]  # the layer's stored ρ (a list: not a parameter of this module; deep-copied with it)
        self.threshold = threshold

    def forward(self, mu: torch.Tensor) -> torch.Tensor:
        rho = self._rho[0]
        with torch.no_grad():
            keep = (rho - torch.log(mu * mu + torch.finfo(mu.dtype).tiny)) < self.threshold
        return mu * (self.mask & keep).to(mu.dtype)

    def extra_repr(self) -> str:
        return f"threshold={self.threshold:g}"


class _TrainClipScale(_MaskScale):
    """ρ = log σ² ↦ clip(ρ − log θ², −c, c) + log θ², so that σ² = e^{clip(log α)} θ², and −∞ where pruned."""

    def __init__(self, mask: torch.Tensor, mu: torch.Tensor, clip: float | None) -> None:
        super().__init__(mask)
        self._mu = [mu]  # the layer's stored θ
        self.clip = clip

    def forward(self, rho: torch.Tensor) -> torch.Tensor:
        if self.clip is not None:
            mu = self._mu[0]
            log_mu2 = torch.log(mu * mu + torch.finfo(mu.dtype).tiny)
            rho = (rho - log_mu2).clamp(-self.clip, self.clip) + log_mu2
        return super().forward(rho)

    def extra_repr(self) -> str:
        return f"clip={self.clip}"


def _stored(layer: nn.Module, name: str) -> torch.Tensor:
    if parametrize.is_parametrized(layer, name):
        return getattr(layer.parametrizations, name).original
    return getattr(layer, name)


def is_train_clipped(layer: nn.Module) -> bool:
    """Whether :func:`train_clip` is installed on ``layer``."""
    return parametrize.is_parametrized(layer, "weight_mu") and isinstance(layer.parametrizations.weight_mu[0],
                                                                          _TrainClipMean)


def train_clip(module: nn.Module, threshold: float = 3.0, log_alpha_clip: float | None = 8.0) -> nn.Module:
    """Train ``module``'s Sparse VD layers as Molchanov et al.'s code does (``train_clip=True``); in place.

    In every Sparse VD layer (posterior ``"sparse_vd"``, any sparsifying prior, ρ = log σ²):

    .. math::
        m = x\\,(\\theta \\circ 1[\\log\\alpha < t]) + b, \\qquad
        s^2 = x^2\\,(e^{\\mathrm{clip}(\\log\\alpha, -c, c)}\\,\\theta^2), \\qquad
        KL = \\sum KL_{\\text{approx}}(\\mathrm{clip}(\\log\\alpha, -c, c)),

    with log α = log σ² − log θ² of the stored parameters, t = ``threshold`` and c = ``log_alpha_clip``.
    A weight past the threshold is 0 in the mean (sampled forwards and :func:`mcgraph.nn.freeze` alike)
    but keeps its θ and σ: the KL still acts on it, and it comes back if log α falls below t again.
    The weights are those :func:`mcgraph.nn.prune` at the same threshold removes (it removes log α > t;
    the two differ only at log α = t exactly), so the network trains as the pruned network it is scored
    as; :func:`mcgraph.nn.sparsity` counts them as zeros.

    Installed as weight-mask parametrizations (:mod:`mcgraph.nn.masks`): the stored parameters, the
    optimizer's, stay where they are, ``state_dict`` keys are those of a pruned layer, and pruning
    afterwards combines both. Calling it again replaces the settings.

    Args:
        module: a network (or one layer) with Sparse VD layers.
        threshold: log α at and above which a weight counts as 0 in the mean while training (3, as
            :func:`mcgraph.nn.prune`); ``inf``: none.
        log_alpha_clip: the bound c of log α in the KL and the variance (Molchanov et al.: 8); ``None``:
            no clipping.

    Returns:
        ``module``.

    Raises:
        TypeError: ``module`` is not a module; ``threshold`` or ``log_alpha_clip`` is not a real number.
        ValueError: ``threshold`` is NaN; ``log_alpha_clip`` is not positive and finite; ``module`` has no
            Sparse VD layer, or one whose scale transform is not ``"exp_half"`` (ρ = log σ²) or whose KL
            route is ``"mc"`` while clipping.

    Example:
        >>> import torch, mcgraph as mg
        >>> net = mg.nn.bayesify(mg.models.get_model("lenet300_100", image_size=8), posterior="sparse_vd")
        >>> net = mg.nn.sparse_vd.train_clip(net)            # the authors' threshold 3 and clip 8
        >>> layer = net.classifier[1]
        >>> mg.nn.sparse_vd.is_train_clipped(layer), layer.posterior_family.__name__
        (True, 'sparse_vd(log_alpha_clip=8)')
        >>> with torch.no_grad():
        ...     layer.parametrizations.weight_mu.original[0, :3] = torch.tensor([1.0, 1e-3, 1e-6])
        >>> layer.weight_mu[0, :3].tolist()                   # log α = −10 − log θ²: −10, 3.8, 17.6
        [1.0, 0.0, 0.0]
        >>> mg.nn.prune(net).layers[0].kept == int(torch.count_nonzero(layer.weight_mu))
        True
    """
    from .context import bayesian_modules
    from .layer_kl import is_sparsifying

    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if isinstance(threshold, bool) or not isinstance(threshold, (numbers.Real, torch.Tensor)):
        raise TypeError(f"threshold must be a real number, got {type(threshold).__name__}")
    threshold = float(threshold)
    if math.isnan(threshold):
        raise ValueError("threshold must not be NaN")
    _check_clip("log_alpha_clip", log_alpha_clip)
    clip = None if log_alpha_clip is None else float(log_alpha_clip)
    layers = [m for m in bayesian_modules(module)
              if isinstance(getattr(m, "_posterior_factory", None), SparseVD) and is_sparsifying(m)]
    if not layers:
        raise ValueError("module: has no Sparse VD layers (build them with posterior='sparse_vd')")
    for m in layers:
        name = getattr(m.scale_transform, "name", None)
        if name != "exp_half":
            raise ValueError(f"module: train_clip needs the Sparse VD layers' scale_transform='exp_half' (ρ = log σ²), "
                             f"got {name!r}")
        if clip is not None and m._posterior_factory.kl != "approx":
            raise ValueError(f"log_alpha_clip: only the 'approx' KL route clips log α, got kl={m._posterior_factory.kl!r}")
    for m in layers:
        family = SparseVD(kl=m._posterior_factory.kl, log_alpha_clip=clip)
        m._posterior_factory = family
        m.posterior_family = family
        mask = weight_mask(m)
        mu, rho = _stored(m, "weight_mu"), _stored(m, "weight_rho")
        if mask is None:
            mask = torch.ones(mu.shape, dtype=torch.bool, device=mu.device)
        else:
            mask = mask.clone()
            parametrize.remove_parametrizations(m, "weight_mu", leave_parametrized=False)
            parametrize.remove_parametrizations(m, "weight_rho", leave_parametrized=False)
        parametrize.register_parametrization(m, "weight_mu", _TrainClipMean(mask, rho, threshold), unsafe=True)
        parametrize.register_parametrization(m, "weight_rho", _TrainClipScale(mask, mu, clip), unsafe=True)
    return module
