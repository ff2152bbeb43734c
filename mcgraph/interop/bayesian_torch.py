"""bayesian-torch (Intel Labs, ``pip install --no-deps bayesian-torch``): KL, sites and conversion.

Recognised layers (subclasses of ``BaseVariationalLayer_``): ``LinearReparameterization``,
``Conv{1,2,3}dReparameterization``, ``ConvTranspose{1,2,3}dReparameterization`` and their
``…Flipout`` versions, with Parameters ``mu_weight``/``rho_weight`` (Linear) or
``mu_kernel``/``rho_kernel`` (convolutions) and ``mu_bias``/``rho_bias``, σ = log(1 + e^ρ), and
the prior N(``prior_weight_mu``, ``prior_weight_sigma``²) from per-element buffers (the
constructor's ``prior_variance`` is used as a standard deviation; MOPED sets the means per
weight). ``LSTMReparameterization`` / ``LSTMFlipout`` hold two such Linear layers (``ih``,
``hh``), which are its sites.

* :func:`kl` replaces ``get_kl_loss(model)``: closed-form Normal KL (exact) under
  ``method="auto"``; ``reduction="per_tensor_mean"`` reproduces bayesian-torch's scaling (the
  mean over each tensor's elements, summed over tensors). Not reproduced: ``get_kl_loss``
  counts an LSTM's KL twice (the LSTM and its ``ih``/``hh`` children all have ``kl_loss``) and
  the LSTM's forward adds it once per time step.
* :func:`to_mcgraph` converts models built by ``dnn_to_bnn`` (``dnn_to_bnn_flag=True``, layers
  returning only their output). A prior whose buffers hold one value (the usual case) becomes that
  scalar Normal; per-element priors (MOPED) stay buffers shared with the converted layer; flipout
  layers become ``estimator="flipout"`` layers (mcgraph's flipout draws signs per example and channel,
  bayesian-torch's per element: the same estimator in distribution). ``LSTMReparameterization``
  becomes :class:`BayesianTorchLSTM` (below). Layers returning ``(out, kl)`` tuples and
  ``LSTMFlipout`` are refused.

**LSTMs: per-step sampling is not kept.** bayesian-torch's ``LSTMReparameterization`` calls its
``ih`` and ``hh`` Linear layers at every time step, so it draws new weights at every step of a
sequence (a different network per step, not a sample from q(W) run over the sequence) and, with
``return_kl``, adds the KL once per step (T times the weights' KL). The converted layer draws one
weight sample per sequence (per Monte Carlo sample) and runs torch's fused LSTM kernel on it;
its KL is the weights' KL, once, collected by ``mg.nn.kl``. Its outputs therefore differ in law
from the original's in sample mode (equal with σ → 0); its interface is kept, including the
returned "hidden state" ``(output, c_1…c_T)``: the whole sequences of h and c.

Their forward refills a noise buffer in place (``eps_weight.data.normal_()``), so M samples
summed into one graph give wrong σ-gradients; :func:`mcgraph.interop.elbo_backward` and
:func:`to_mcgraph` + ``mg.nn.elbo`` give correct ones.

Example:
    >>> import torch, mcgraph as mg, mcgraph.interop.bayesian_torch as ibt
    >>> from bayesian_torch.models.dnn_to_bnn import dnn_to_bnn, get_kl_loss
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> dnn_to_bnn(net, {"prior_mu": 0.0, "prior_sigma": 1.0, "posterior_mu_init": 0.0,
    ...                  "posterior_rho_init": -3.0, "type": "Reparameterization", "moped_enable": False})
    >>> torch.allclose(ibt.kl(net, 1, reduction="per_tensor_mean"), get_kl_loss(net))
    True
    >>> bnn = ibt.to_mcgraph(net, kl_samples=1)
    >>> bnn[0].weight_rho is net[0].rho_weight          # the same Parameter object
    True
    >>> x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    >>> (-mg.nn.elbo(bnn, x, y, num_samples=32, dataset_size=100, seed=0)).backward()
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Normal

from ..engine.options import Sampling
from ..nn.recurrent import BayesLSTM
from ..nn.scales import scale_transform
from . import convert, divergence
from .foreign_priors import BufferNormalPrior, NormalPrior
from .sites import LibraryAdapter, VariationalSite, class_names, parameter, qualified, register_adapter, site_name
from .sites import sites as _sites

__all__ = ["BayesianTorchAdapter", "BayesianTorchLSTM", "sites", "kl", "to_mcgraph"]

NAME = "bayesian-torch"
_WEIGHTS = (("mu_weight", "rho_weight"), ("mu_kernel", "rho_kernel"))


def _weight_names(module: nn.Module):
    for mu, rho in _WEIGHTS:
        if parameter(module, mu) is not None and parameter(module, rho) is not None:
            return mu, rho
    return None


def _prior(module: nn.Module, role: str) -> Normal:
    loc, scale = getattr(module, f"prior_{role}_mu"), getattr(module, f"prior_{role}_sigma")
    if loc.shape != scale.shape:  # bayesian-torch 0.5.0's ConvTranspose{1,2,3}dFlipout: sigma in the Conv layout
        raise ValueError(f"prior_{role}_mu has shape {tuple(loc.shape)} but prior_{role}_sigma has shape "
                         f"{tuple(scale.shape)}")
    return Normal(loc, scale, validate_args=False)


def _single_value(loc: torch.Tensor, scale: torch.Tensor):
    """``(μ, σ)`` when each buffer holds one value throughout, else ``None``."""
    if loc.numel() and bool((loc == loc.reshape(-1)[0]).all()) and bool((scale == scale.reshape(-1)[0]).all()):
        return float(loc.reshape(-1)[0]), float(scale.reshape(-1)[0])
    return None


def _per_tensor_mean(found: Sequence[VariationalSite], values: Sequence[torch.Tensor]) -> torch.Tensor:
    """bayesian-torch's scaling: each tensor's KL averaged over its elements, summed over tensors."""
    return torch.stack([v / s.numel for s, v in zip(found, values)]).sum()


def _is_lstm(module: nn.Module) -> bool:
    names = class_names(module)
    return "BaseVariationalLayer_" in names and ("LSTMReparameterization" in names or "LSTMFlipout" in names)


def _linear_recurrence(a: torch.Tensor, u: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
    """``c_t = a_t ⊙ c_{t−1} + u_t`` for every ``t`` of dim 1 (``a``, ``u``: ``(N, T, H)``; ``c0``: ``(N, H)``).

    An inclusive scan of the affine maps ``c ↦ a_t c + u_t`` in ⌈log2 T⌉ doubling steps (each
    composes every step with the one ``d`` before it), then ``c_t = A_t c_0 + B_t`` with
    ``A_t = Π_{j≤t} a_j`` and ``B_t = Σ_{k≤t} (Π_{k<j≤t} a_j) u_k``.
    """
    A, B, d, T = a, u, 1, a.shape[1]
    while d < T:
        B = torch.cat([B[:, :d], A[:, d:] * B[:, :-d] + B[:, d:]], 1)
        A = torch.cat([A[:, :d], A[:, d:] * A[:, :-d]], 1)
        d *= 2
    return B + A * c0.unsqueeze(1)


class BayesianTorchLSTM(BayesLSTM):
    """bayesian-torch's ``LSTMReparameterization`` interface on a :class:`~mcgraph.nn.BayesLSTM`.

    ``forward(X, hidden_states=None, return_kl=True)``: ``X`` of shape ``(N, T, in_features)``,
    ``hidden_states`` ``(h_0, c_0)`` of shape ``(N, H)``; returns ``(output, (output, c_seq))``
    with ``output = (h_1 … h_T)`` and ``c_seq = (c_1 … c_T)``, both ``(N, T, H)``, as
    bayesian-torch's layer after ``dnn_to_bnn`` does (``return_kl`` is ignored there, and here).

    Sites ``ih_l0`` / ``hh_l0``: the converted ``ih`` / ``hh`` Linear layers (their Parameters are
    the original's). One weight sample per sequence (the module docstring says why this differs
    from the original). The kernel gives ``h_t``; the cell states follow from them without a loop
    over time: the gates ``i, f, g, o`` of every step in one matrix product of ``x_t`` and
    ``h_{t−1}``, then the scan ``c_t = σ(f_t) ⊙ c_{t−1} + σ(i_t) ⊙ tanh(g_t)``
    (:func:`_linear_recurrence`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **options) -> None:
        # bayesian-torch's LSTM: one layer, one direction, batch-first
        super().__init__(in_features, out_features, 1, bias, True, **options)

    def forward(self, X, hidden_states=None, return_kl=True):
        """bayesian-torch's forward (see the class docstring)."""
        if not isinstance(X, torch.Tensor) or X.dim() != 3:
            raise ValueError(f"X: bayesian-torch's LSTM takes a (batch, sequence, in_features) tensor, got "
                             f"{tuple(X.shape) if isinstance(X, torch.Tensor) else type(X).__name__}")
        hx = None if hidden_states is None else tuple(t.unsqueeze(0) for t in hidden_states)
        out, (_, c_seq) = super().forward(X, hx)
        return out, (out, c_seq[0])

    def _run(self, x, batch_sizes, hx, weights, sample, sorted_indices):
        out, (h_n, _) = super()._run(x, batch_sizes, hx, weights, sample, sorted_indices)
        h_prev = torch.cat([hx[0][0].unsqueeze(1), out[:, :-1]], 1)
        gates = F.linear(x, weights[0], weights[2] if self.bias else None) + \
            F.linear(h_prev, weights[1], weights[3] if self.bias else None)
        i, f, g, _ = gates.chunk(4, -1)
        c_seq = _linear_recurrence(torch.sigmoid(f), torch.sigmoid(i) * torch.tanh(g), hx[1][0])
        # the cell sequence travels as the "c_n" of this sample's rows, (1, rows, T, H), joined over samples on dim 1
        return out, (h_n, c_seq.unsqueeze(0))


@register_adapter
class BayesianTorchAdapter(LibraryAdapter):
    """Reads bayesian-torch's reparameterization and flipout layers (see the module docstring)."""

    name = NAME
    pip = "bayesian-torch"
    packages = ("bayesian_torch",)
    reductions = {"per_tensor_mean": _per_tensor_mean}

    def owns(self, module: nn.Module) -> bool:
        return _is_lstm(module) or ("BaseVariationalLayer_" in class_names(module) and _weight_names(module) is not None
                                    and hasattr(module, "prior_weight_mu") and hasattr(module, "prior_weight_sigma"))

    def layer_sites(self, module: nn.Module, name: str, **options) -> list[VariationalSite]:
        if options:
            raise TypeError(f"bayesian-torch sites take no options, got {sorted(options)}")
        if _is_lstm(module):
            return []  # its sites are those of its ih / hh Linear layers, which are layers of their own
        softplus = scale_transform("softplus")
        mu, rho = _weight_names(module)
        out = [VariationalSite(site_name(name, "weight"), NAME, module, "weight", getattr(module, mu),
                               getattr(module, rho), softplus, functools.partial(_prior, module, "weight"))]
        if parameter(module, "mu_bias") is not None:
            out.append(VariationalSite(site_name(name, "bias"), NAME, module, "bias", module.mu_bias, module.rho_bias,
                                       softplus, functools.partial(_prior, module, "bias")))
        return out

    def to_layer(self, module: nn.Module, name: str, *, kl_samples: int, **options) -> nn.Module:
        if options:
            raise TypeError(f"bayesian-torch conversion takes no options, got {sorted(options)}")
        cls = type(module).__name__
        if not getattr(module, "dnn_to_bnn_flag", False):
            raise TypeError(
                f"{qualified(name, module)} returns (out, kl) tuples (dnn_to_bnn_flag is False) that the model's "
                f"own forward unpacks, so an mcgraph layer, which returns only its output, cannot take its place. "
                f"Models built by bayesian_torch.models.dnn_to_bnn.dnn_to_bnn convert; for this one use "
                f"mcgraph.interop.elbo_backward with mcgraph.interop.bayesian_torch.kl")
        if _is_lstm(module):
            return self._lstm(module, name, kl_samples)
        if cls.startswith("Linear"):
            kind = "linear"
        elif cls.startswith("ConvTranspose"):
            kind = "conv_transpose"
        elif cls.startswith("Conv"):
            kind = "conv"
        else:
            raise TypeError(f"{qualified(name, module)}: only bayesian-torch's Linear, Conv, ConvTranspose "
                            f"(Reparameterization or Flipout) and LSTMReparameterization layers convert to mcgraph "
                            f"layers")
        return self._layer(module, name, kind, kl_samples, flipout=cls.endswith("Flipout"))

    def _layer(self, module: nn.Module, name: str, kind: str, kl_samples: int, flipout: bool) -> nn.Module:
        found = self.layer_sites(module, name)
        layer = convert.mcgraph_layer(kind, module, found[0], found[1] if len(found) > 1 else None,
                                      kl_samples=kl_samples, flipout=flipout)
        roles = ("weight", "bias")[:len(found)]
        values = {_single_value(getattr(module, f"prior_{r}_mu"), getattr(module, f"prior_{r}_sigma")) for r in roles}
        if len(values) == 1 and None not in values:
            layer.prior_spec = NormalPrior(*values.pop())  # one value throughout: a scalar prior (cheaper KL)
            return layer
        for role in roles:  # per-element priors (MOPED): the buffers are shared, read when used
            for what in ("mu", "sigma"):
                key = f"prior_{role}_{what}"
                layer.register_buffer(key, getattr(module, key), persistent=False)
        layer.prior_spec = BufferNormalPrior(layer)
        return layer

    def _lstm(self, module: nn.Module, name: str, kl_samples: int) -> BayesianTorchLSTM:
        if "LSTMFlipout" in class_names(module):
            raise TypeError(f"{qualified(name, module)}: flipout perturbs a layer's pre-activations, which torch's "
                            f"fused LSTM kernel keeps to itself, so LSTMFlipout has no mcgraph counterpart; use "
                            f"LSTMReparameterization, or train it as it is with mcgraph.interop.elbo_backward and "
                            f"mcgraph.interop.bayesian_torch.kl")
        w = module.ih.mu_weight
        bias = module.ih.mu_bias is not None
        lstm = BayesianTorchLSTM(module.in_features, module.out_features, bias, bayesian_bias=bias,
                                 kl_samples=kl_samples, device=w.device, dtype=w.dtype)
        lstm.ih_l0 = self._layer(module.ih, site_name(name, "ih"), "linear", kl_samples, flipout=False)
        lstm.hh_l0 = self._layer(module.hh, site_name(name, "hh"), "linear", kl_samples, flipout=False)
        return lstm

    def refusal(self, module: nn.Module, name: str) -> str:
        return (f"{qualified(name, module)} is a bayesian-torch module that passes (out, kl) tuples and has no mcgraph "
                f"counterpart; train the model as it is with mcgraph.interop.elbo_backward and "
                f"mcgraph.interop.bayesian_torch.kl")


def sites(model: nn.Module) -> list[VariationalSite]:
    """The sites of a bayesian-torch model (see :func:`mcgraph.interop.sites`)."""
    return _sites(model, library=NAME)


def kl(model: nn.Module, num_samples: int | Sampling, *, seed: int | None = None, method: str = "auto",
       reduction: str = "sum", process_group=None) -> torch.Tensor:
    """KL(q ‖ p) of a bayesian-torch model: ``reduction="per_tensor_mean"`` equals ``get_kl_loss(model)``.

    See :func:`mcgraph.interop.kl` for the arguments; under ``method="auto"`` every site is the
    closed-form Normal KL (``num_samples`` is unused); an engine method estimates it with M samples.
    """
    return divergence.kl(model, num_samples, seed=seed, method=method, reduction=reduction, library=NAME,
                         process_group=process_group)


def to_mcgraph(model: nn.Module, *, kl_samples: int | None = None, inplace: bool = False) -> nn.Module:
    """Swap a ``dnn_to_bnn`` model's layers for mcgraph layers holding the same Parameters.

    See :mod:`mcgraph.interop.convert`. σ = softplus(ρ); Flipout layers keep flipout; the prior is
    the scalar N(μ, σ²) when the buffers hold one value, else the shared per-element buffers (MOPED).
    ``LSTMReparameterization`` becomes :class:`BayesianTorchLSTM`, which samples the weights once per
    sequence where the original re-samples them at every time step (see the module docstring).

    **KL scale.** bayesian-torch's ``get_kl_loss`` averages each tensor's KL over its elements and
    sums over tensors, and its examples add ``get_kl_loss(model) / batch_size`` to the loss.
    ``mg.nn.kl`` sums over every weight, and ``mg.nn.elbo`` subtracts ``kl / dataset_size``: the
    KL per example of the variational objective. So the KL weighs differently after the switch
    (a one-time :class:`~mcgraph.interop.convert.KLScaleWarning` says so);
    ``kl(model, reduction="per_tensor_mean")`` reproduces ``get_kl_loss``.
    """
    convert.warn_kl_scale("bayesian_torch", "get_kl_loss averages each tensor's KL over its elements;")
    return convert.to_mcgraph(model, NAME, kl_samples=kl_samples, inplace=inplace)
