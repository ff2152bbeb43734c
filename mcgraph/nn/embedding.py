"""``BayesEmbedding``: a Bayesian ``nn.Embedding`` (a posterior over the embedding table).

The table ``W ∈ R^{V×D}`` has the posterior of every Bayesian layer; a forward looks its rows up
in one draw ``W_s`` per Monte Carlo sample (inside a window of ``S`` samples: one gather in the
``S`` stacked tables, index ``x + s·V``). torch's semantics are kept: the row ``padding_idx``
is zero in every output and receives no gradient from the data term, ``max_norm`` renormalises
the looked-up rows of the table in use (the drawn table; in ``"mean"`` mode μ itself, as torch
renormalises its weight), and in ``"mean"`` mode the layer is ``F.embedding`` on μ.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import nn

from .context import NoiseKind, current_capture, current_window
from ..engine import checks
from .layers import BayesLayer, SampleMode
from .weight_sites import sampled_weights_only

__all__ = ["BayesEmbedding"]


class BayesEmbedding(BayesLayer):
    """Bayesian ``nn.Embedding``.

    Args:
        num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq:
            as in ``torch.nn.Embedding`` (``sparse`` gradients are not available: the sampled
            table's gradient reaches μ and ρ densely).
        **options: the keyword arguments of :class:`~mcgraph.nn.BayesLayer` (``posterior``,
            ``prior``, ``kl_samples``, ``rho_init``, ``scale_transform``, ``device``, ``dtype``);
            ``local_reparameterization`` and ``flipout`` do not apply to a lookup.

    Shape:
        Input: an integer tensor ``(*)``; output ``(*, embedding_dim)``. Inside a window of ``S``
        samples dim 0 holds the batch repeated ``S`` times.

    Example:
        >>> import torch, mcgraph as mg
        >>> emb = mg.nn.BayesEmbedding(10, 4, padding_idx=0)
        >>> out = emb(torch.tensor([[0, 3, 5]]))
        >>> out.shape, bool((out[0, 0] == 0).all())
        (torch.Size([1, 3, 4]), True)
    """

    _channel_axis = -1

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, **options) -> None:
        self.num_embeddings = checks.positive_int("num_embeddings", num_embeddings)
        self.embedding_dim = checks.positive_int("embedding_dim", embedding_dim)
        if padding_idx is not None:
            if isinstance(padding_idx, bool) or not isinstance(padding_idx, numbers.Integral) \
                    or not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx must be an int within [-{num_embeddings}, {num_embeddings}), "
                                 f"got {padding_idx!r}")
            padding_idx = int(padding_idx) % num_embeddings
        self.padding_idx = padding_idx
        if max_norm is not None and (not isinstance(max_norm, numbers.Real) or not max_norm > 0):
            raise ValueError(f"max_norm must be a positive number or None, got {max_norm!r}")
        self.max_norm = None if max_norm is None else float(max_norm)
        self.norm_type = float(norm_type)
        self.scale_grad_by_freq = bool(scale_grad_by_freq)
        if sparse:
            raise ValueError("sparse=True is not available for BayesEmbedding: the gradient of a drawn table "
                             "reaches μ and ρ densely")
        self.sparse = False
        options = sampled_weights_only(options, "an embedding lookup", "its weights are sampled")
        super().__init__((num_embeddings, embedding_dim), embedding_dim, False, **options)

    def reset_parameters(self) -> None:
        """μ ~ N(0, 1) as torch initialises the table (the padding row zero), ρ = ``rho_init``."""
        nn.init.normal_(self.weight_mu)
        nn.init.constant_(self.weight_rho, self.rho_init)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight_mu[self.padding_idx].fill_(0)

    @property
    def in_channels_(self) -> int:
        return self.num_embeddings

    def _op(self, x, weight, bias=None):
        return F.embedding(x, weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq)

    def moments(self, x):
        raise ValueError("moments() needs local_reparameterization=True, which an embedding does not use")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Rows of one drawn table per sample (``"mean"`` mode: ``F.embedding`` on μ)."""
        if input.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input: expected an integer (int32 or int64) tensor of indices, got {input.dtype}")
        if self.mode == SampleMode.MEAN:
            return self._op(input, self.weight_mu)
        cap = current_capture()
        if cap is not None and cap.layer is self:
            return self._record(cap, input)
        win = current_window()
        S = 1 if win is None else win.size
        if S > 1 and (input.dim() == 0 or input.shape[0] % S):
            raise ValueError(f"input: inside a window of {S} samples the batch dimension must be a multiple of "
                             f"{S} (the batch repeated once per sample), got shape {tuple(input.shape)}")
        w = self._samples_of(self.posterior, NoiseKind.WEIGHT)
        if S == 1:
            out = F.embedding(input, w[0], None, self.max_norm, self.norm_type, self.scale_grad_by_freq)
        else:
            V = self.num_embeddings
            rows = input.shape[0] // S
            offsets = (torch.arange(S, device=input.device, dtype=input.dtype) * V).reshape(
                S, *([1] * input.dim()))
            index = (input.reshape(S, rows, *input.shape[1:]) + offsets).reshape(input.shape)
            out = F.embedding(index, w.reshape(S * V, self.embedding_dim), None, self.max_norm, self.norm_type,
                              self.scale_grad_by_freq)
        if self.padding_idx is not None:
            out = out.masked_fill((input == self.padding_idx).unsqueeze(-1), 0.0)
        return out

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.max_norm is not None:
            s += f", max_norm={self.max_norm}"
        if self.norm_type != 2:
            s += f", norm_type={self.norm_type}"
        if self.scale_grad_by_freq:
            s += ", scale_grad_by_freq=True"
        return s + ", " + super().extra_repr()

    @classmethod
    def from_torch(cls, module: nn.Embedding, *, init_from_weights: bool = True, **options) -> "BayesEmbedding":
        """The Bayesian counterpart of an ``nn.Embedding`` (μ copied from its table when ``init_from_weights``)."""
        p = module.weight
        layer = cls(module.num_embeddings, module.embedding_dim, module.padding_idx, module.max_norm,
                    module.norm_type, module.scale_grad_by_freq, device=p.device, dtype=p.dtype, **options)
        if init_from_weights:
            layer._copy_from(module)
        return layer

    @torch.no_grad()
    def _copy_from(self, module: nn.Module) -> None:
        self.weight_mu.copy_(module.weight)
