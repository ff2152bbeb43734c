"""blitz (``pip install --no-deps blitz-bayesian-pytorch``): KL, sites and conversion.

Recognised layers (subclasses of ``BayesianModule``): ``BayesianLinear``,
``BayesianConv{1,2,3}d``, ``BayesianEmbedding``, ``BayesianLSTM``, ``BayesianGRU``. Every tensor
has a sampler ``<role>_sampler`` whose Parameters ``mu`` and ``rho`` are the ones trained
(blitz wraps the layer's ``<role>_mu`` / ``<role>_rho`` in new Parameter objects sharing their
storage; gradients land on the sampler's, the layer's aliases get none), so the sites are the
sampler's Parameters; σ = log(1 + e^ρ). The prior ``<role>_prior_dist`` is the scale mixture
π N(0, σ1²) + (1 − π) N(0, σ2²) (a Normal when π = 1), or the user's ``prior_dist``. A bias
counts only when the layer uses one (``bias`` / ``use_bias``).

Recurrent layers (:class:`BlitzRecurrent`): blitz's ``BayesianLSTM`` / ``BayesianGRU`` (one
layer, batch-first, a Python loop over time steps) convert to a layer that keeps blitz's
interface and runs torch's fused kernel on one weight sample per sequence, as blitz's sampled
path does (blitz draws once per forward, too). blitz stores the weights as ``(in, 4·H)`` /
``(H, 4·H)`` (``x @ W``) with one bias of ``4·H``; the converted layer keeps those very
Parameters and hands the kernel their transposes. Not kept: the peephole variant
(``peephole=True``: not an LSTM cell torch has, and blitz's frozen path computes
``h = sigmoid(o ⊙ c)`` where its sampled path computes ``tanh``), posterior sharpening
(``sharpen=True``); both are refused.

blitz's own KL is a one-sample estimate cached by the last forward
(``log_variational_posterior − log_prior``, each with a −½ per element that cancels), with the
prior density floored: log(p(w) + 10⁻⁶). :func:`kl` is the M-sample estimate of the same
quantity, without a forward: ``prior_floor=None`` (default) uses the prior as written,
``prior_floor=1e-6`` reproduces blitz's floored density. Its forward refills a noise buffer in
place (``eps_w.data.normal_()``), so ``sample_elbo`` with ``sample_nbr > 1`` gives wrong
σ-gradients; :func:`mcgraph.interop.elbo_backward` and :func:`to_mcgraph` + ``mg.nn.elbo`` give
correct ones. Frozen layers (``freeze=True``) convert to the posterior-mean forward.

Example:
    >>> import torch, mcgraph as mg, mcgraph.interop.blitz as ibz
    >>> from blitz.modules import BayesianLinear
    >>> net = torch.nn.Sequential(BayesianLinear(4, 8, prior_pi=0.5), torch.nn.ReLU(), BayesianLinear(8, 3))
    >>> ibz.kl(net, num_samples=1000, seed=0, prior_floor=1e-6).shape
    torch.Size([])
    >>> bnn = ibz.to_mcgraph(net, kl_samples=1000)
    >>> bnn[0].weight_mu is net[0].weight_sampler.mu
    True
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributions import Distribution

from ..engine.options import Sampling
from ..nn.layers import BayesLayer
from ..nn.recurrent import BayesRNNBase
from ..nn.scales import scale_transform
from ..nn.weight_sites import SiteWeights
from . import convert, divergence
from .foreign_priors import FlooredDensity, MixturePrior, mixture
from .sites import LibraryAdapter, VariationalSite, class_names, parameter, qualified, register_adapter, site_name
from .sites import sites as _sites

__all__ = ["BlitzAdapter", "BlitzRecurrent", "sites", "kl", "to_mcgraph"]

NAME = "blitz"
_LAYERS = {"BayesianLinear": "linear", "BayesianConv1d": "conv", "BayesianConv2d": "conv", "BayesianConv3d": "conv"}


def _is_sampler(module) -> bool:
    return (isinstance(module, nn.Module) and parameter(module, "mu") is not None
            and parameter(module, "rho") is not None)


def _uses_bias(module: nn.Module) -> bool:
    flag = getattr(module, "use_bias", None)
    return bool(getattr(module, "bias", False) if flag is None else flag)


def _check_floor(prior_floor):
    if prior_floor is not None and (isinstance(prior_floor, bool) or not isinstance(prior_floor, (int, float))
                                    or not prior_floor > 0):
        raise ValueError(f"prior_floor must be None or a positive number, got {prior_floor!r}")
    return prior_floor


def _prior(prior_dist: nn.Module, like: torch.Tensor, floor: float | None) -> Distribution:
    """A blitz ``PriorWeightDistribution`` as a torch distribution (read now), floored by ``floor``."""
    if getattr(prior_dist, "dist2", None) is None:  # a user-given prior_dist (π = 1)
        base = prior_dist.dist1
    else:
        base = mixture(prior_dist.pi, prior_dist.sigma1, prior_dist.sigma2, like)
    return base if floor is None else FlooredDensity(base, floor)


def _prior_spec(prior_dist: nn.Module, floor: float | None):
    """The prior of a converted layer (a picklable factory or a distribution) from a ``PriorWeightDistribution``."""
    if getattr(prior_dist, "dist2", None) is None:
        return prior_dist.dist1 if floor is None else FlooredDensity(prior_dist.dist1, floor)
    return MixturePrior(float(prior_dist.pi), float(prior_dist.sigma1), float(prior_dist.sigma2), floor)


class _Tensor(BayesLayer):
    """One Bayesian tensor of a converted blitz recurrent layer in blitz's layout (any shape, no bias).

    A site: :class:`BlitzRecurrent` reads its draws (:func:`~mcgraph.nn.weight_sites.site_weights`)
    and never calls it; it carries the posterior, prior, KL and mode like every Bayesian layer.
    """

    def __init__(self, shape, **options) -> None:
        super().__init__(tuple(shape), 0, False, **options)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight_mu.zero_()
        self.weight_rho.fill_(self.rho_init)

    def forward(self, x):
        raise TypeError("a site of a converted blitz recurrent layer holds a tensor; the layer that owns it runs "
                        "the recurrence")

    def extra_repr(self) -> str:
        return f"shape={tuple(self.weight_mu.shape)}, " + super().extra_repr()


class BlitzRecurrent(BayesRNNBase):
    """blitz's ``BayesianLSTM`` / ``BayesianGRU`` on torch's fused kernel, holding blitz's Parameters.

    blitz's interface: ``forward(x, hidden_states=None, sharpen_loss=None)`` with ``x`` of shape
    ``(N, L, in_features)``; returns ``(output (N, L, H), (h_L, c_L))`` for the LSTM and
    ``(output, h_L)`` for the GRU, ``h_L`` and ``c_L`` of shape ``(N, H)`` (``H = out_features``).

    Sites ``ih_l0`` ``(in, 4·H)``, ``hh_l0`` ``(H, 4·H)`` and ``b_l0`` ``(4·H,)`` (when the layer
    uses a bias) in blitz's layout, whose ``weight_mu`` / ``weight_rho`` are the blitz samplers'
    Parameters. With ``W_ih``, ``W_hh``, ``b`` one draw per sequence, the kernel gets

    * LSTM (gates i, f, g, o, as torch): ``W_ihᵀ``, ``W_hhᵀ``, ``b_ih = b``, ``b_hh = 0``;
    * GRU: blitz computes ``r, z = σ(x W_ih[:, :2H] + h W_hh[:, :2H] + b[:2H])``,
      ``n = tanh(x W_ih[:, 2H:3H] + b[2H:3H] + r ⊙ (h W_hh[:, 3H:] + b[3H:]))``: torch's GRU with
      ``W_ih[:, :3H]ᵀ``, ``[W_hh[:, :2H], W_hh[:, 3H:]]ᵀ``, ``b_ih = b[:3H]``,
      ``b_hh = [0, b[3H:]]``. The columns ``W_ih[:, 3H:]`` and ``W_hh[:, 2H:3H]`` are unused by
      blitz's forward too; they keep their KL term, as in blitz's loss.

    ``sharpen_loss`` (posterior sharpening) must stay ``None``. In ``"mean"`` mode (blitz's
    ``freeze=True``) the posterior means are the weights.
    """

    def __init__(self, mode: str, in_features: int, out_features: int, bias: bool, *, priors: dict,
                 kl_samples: int, device=None, dtype=None) -> None:
        super().__init__(mode, in_features, out_features, 1, bias, True, device=device, dtype=dtype, priors=priors,
                         kl_samples=kl_samples)

    def _build_sites(self, factory: dict, options: dict) -> list[list[str]]:
        """blitz's layout (the construction hook): ``ih_l0`` ``(in, 4·H)``, ``hh_l0`` ``(H, 4·H)``, ``b_l0``."""
        priors = options.pop("priors")
        options = dict(options, scale_transform="softplus", estimator="reparameterization", **factory)
        H4 = 4 * self.hidden_size
        self.ih_l0 = _Tensor((self.input_size, H4), prior=priors["weight_ih"], **options)
        self.hh_l0 = _Tensor((self.hidden_size, H4), prior=priors["weight_hh"], **options)
        names = ["ih_l0", "hh_l0"]
        if self.bias:
            self.b_l0 = _Tensor((H4,), prior=priors["bias"], **options)
            names.append("b_l0")
        return [names]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The sites' own initialisation (the conversion then copies blitz's tensors)."""
        for site in self.sites():
            site.reset_parameters()

    def _layer_weights(self, draws: list[SiteWeights], s: int) -> list[torch.Tensor]:
        w_ih, w_hh = draws[0].at(s)[0], draws[1].at(s)[0]
        b = draws[2].at(s)[0] if self.bias else None
        H = self.hidden_size
        if self.mode == "LSTM":
            weights = [w_ih.t(), w_hh.t()]
            return weights + [b, torch.zeros_like(b)] if self.bias else weights
        weights = [w_ih[:, :3 * H].t(), torch.cat([w_hh[:, :2 * H], w_hh[:, 3 * H:]], 1).t()]
        if self.bias:
            weights += [b[:3 * H], torch.cat([torch.zeros_like(b[:2 * H]), b[3 * H:]])]
        return weights

    def forward(self, x, hidden_states=None, sharpen_loss=None):
        """blitz's forward: ``(output, (h_L, c_L))`` (LSTM) or ``(output, h_L)`` (GRU); see the class docstring."""
        if sharpen_loss is not None:
            raise ValueError("sharpen_loss: posterior sharpening is not converted to mcgraph; leave it None")
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"x: blitz's recurrent layers take a (batch, sequence, in_features) tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        hx = None
        if hidden_states is not None:
            hx = tuple(t.unsqueeze(0) for t in hidden_states) if self.mode == "LSTM" else hidden_states.unsqueeze(0)
        out, hidden = super().forward(x, hx)
        return out, self._map_hidden(hidden, lambda t: t[0])

    def extra_repr(self) -> str:
        return f"{self.mode}, in_features={self.input_size}, out_features={self.hidden_size}" + \
            ("" if self.bias else ", bias=False")


@register_adapter
class BlitzAdapter(LibraryAdapter):
    """Reads blitz's Bayesian layers through their samplers (see the module docstring)."""

    name = NAME
    pip = "blitz-bayesian-pytorch"
    packages = ("blitz",)

    def owns(self, module: nn.Module) -> bool:
        return "BayesianModule" in class_names(module) and any(
            k.endswith("_sampler") and _is_sampler(m) for k, m in module.named_children())

    def layer_sites(self, module: nn.Module, name: str, *, prior_floor: float | None = None,
                    **options) -> list[VariationalSite]:
        if options:
            raise TypeError(f"blitz sites take only prior_floor, got {sorted(options)}")
        _check_floor(prior_floor)
        softplus = scale_transform("softplus")
        out = []
        for key, sampler in module.named_children():
            if not (key.endswith("_sampler") and _is_sampler(sampler)):
                continue
            role = key[: -len("_sampler")]
            if role == "bias" and not _uses_bias(module):
                continue
            prior_dist = getattr(module, f"{role}_prior_dist")
            out.append(VariationalSite(site_name(name, role), NAME, module, role, sampler.mu, sampler.rho, softplus,
                                       functools.partial(_prior, prior_dist, sampler.mu, prior_floor)))
        return out

    def to_layer(self, module: nn.Module, name: str, *, kl_samples: int, prior_floor: float | None = None,
                 **options) -> nn.Module:
        if options:
            raise TypeError(f"blitz conversion takes only prior_floor, got {sorted(options)}")
        found = {s.role: s for s in self.layer_sites(module, name, prior_floor=prior_floor)}
        frozen = bool(getattr(module, "freeze", False))
        recurrent = {"BayesianLSTM": "LSTM", "BayesianGRU": "GRU"}
        mode = next((recurrent[c] for c in recurrent if c in class_names(module)), None)
        if mode is not None:
            return self._recurrent(module, name, mode, found, kl_samples, prior_floor, frozen)
        kind = _LAYERS.get(type(module).__name__)
        if kind is None:
            raise TypeError(f"{qualified(name, module)}: only blitz's BayesianLinear, BayesianConv{{1,2,3}}d, "
                            f"BayesianLSTM and BayesianGRU convert to mcgraph layers (embedding layers do not); train "
                            f"the model as it is with mcgraph.interop.elbo_backward and mcgraph.interop.blitz.kl")
        prior = _prior_spec(module.weight_prior_dist, prior_floor)
        return convert.mcgraph_layer(kind, module, found["weight"], found.get("bias"), prior=prior,
                                     kl_samples=kl_samples, frozen=frozen)

    @staticmethod
    def _recurrent(module, name, mode, found, kl_samples, prior_floor, frozen) -> BlitzRecurrent:
        if getattr(module, "peephole", False):
            raise TypeError(f"{qualified(name, module)}: blitz's peephole LSTM is not an LSTM cell torch's kernels "
                            f"compute (gates from c, candidate sigmoid(x W + b), h = tanh(o ⊙ c)), and its frozen "
                            f"path computes h = sigmoid(o ⊙ c) instead; train it as it is with "
                            f"mcgraph.interop.elbo_backward and mcgraph.interop.blitz.kl")
        if getattr(module, "sharpen", False):
            raise TypeError(f"{qualified(name, module)}: posterior sharpening (sharpen=True) has no mcgraph "
                            f"counterpart; build the layer with sharpen=False, or train it as it is with "
                            f"mcgraph.interop.elbo_backward and mcgraph.interop.blitz.kl")
        w = found["weight_ih"].loc
        priors = {role: _prior_spec(getattr(module, f"{role}_prior_dist"), prior_floor)
                  for role in ("weight_ih", "weight_hh", "bias")}
        layer = BlitzRecurrent(mode, module.in_features, module.out_features, "bias" in found, priors=priors,
                               kl_samples=kl_samples, device=w.device, dtype=w.dtype)
        for site_attr, role in (("ih_l0", "weight_ih"), ("hh_l0", "weight_hh"), ("b_l0", "bias")):
            if role in found:
                convert.share(getattr(layer, site_attr), found[role], frozen=frozen)
        return layer


def sites(model: nn.Module, *, prior_floor: float | None = None) -> list[VariationalSite]:
    """The sites of a blitz model (the samplers' Parameters), see :func:`mcgraph.interop.sites`."""
    return _sites(model, library=NAME, prior_floor=prior_floor)


def kl(model: nn.Module, num_samples: int | Sampling, *, seed: int | None = None, method: str = "auto",
       prior_floor: float | None = None, process_group=None) -> torch.Tensor:
    """M-sample KL(q ‖ p) of a blitz model: what ``model.nn_kl_divergence()`` estimates from one sample.

    Args:
        model: the blitz model (no forward needed; nothing is modified).
        num_samples: M (scale-mixture priors have no closed form).
        seed, method: as in :func:`mcgraph.interop.kl`.
        prior_floor: ``1e-6`` evaluates the prior as blitz does, log(p(w) + 10⁻⁶); ``None``
            the prior as written.
    """
    return divergence.kl(model, num_samples, seed=seed, method=method, library=NAME, prior_floor=prior_floor,
                         process_group=process_group)


def to_mcgraph(model: nn.Module, *, kl_samples: int | None = None, inplace: bool = False,
               prior_floor: float | None = None) -> nn.Module:
    """Swap blitz's Linear/Conv/LSTM/GRU layers for mcgraph layers holding the samplers' Parameters.

    See :mod:`mcgraph.interop.convert`; ``prior_floor`` as in :func:`kl`. ``BayesianLSTM`` and
    ``BayesianGRU`` become :class:`BlitzRecurrent` (blitz's interface, torch's fused kernel, one
    weight sample per sequence and Monte Carlo sample).

    **KL scale.** blitz's ``sample_elbo`` adds ``complexity_cost_weight ×`` the one-sample KL summed over
    every weight; ``mg.nn.elbo`` subtracts ``kl / dataset_size`` with the KL summed the same way, so
    the two agree when ``complexity_cost_weight = 1 / dataset_size`` (scale it with ``kl_weight`` otherwise).
    """
    return convert.to_mcgraph(model, NAME, kl_samples=kl_samples, inplace=inplace,
                              prior_floor=_check_floor(prior_floor))
