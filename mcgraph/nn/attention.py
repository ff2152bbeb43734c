"""``BayesMultiheadAttention``: a Bayesian ``nn.MultiheadAttention`` with torch's interface.

The input projection (``in_proj``: one ``(3E, E)`` weight, or ``q_proj`` / ``k_proj`` / ``v_proj``
when ``kdim`` / ``vdim`` differ from ``embed_dim``) and the output projection (``out_proj``) are
:class:`~mcgraph.nn.BayesLinear` sites; the forward draws one sample of each per Monte Carlo
sample and hands them to ``F.multi_head_attention_forward``, the function ``nn.MultiheadAttention``
itself calls. In ``"mean"`` mode the layer computes exactly what torch's module computes with the
posterior means. ``bias_k`` / ``bias_v`` (``add_bias_kv``) are point estimates, like the biases of
every Bayesian layer without ``bayesian_bias``.

Inside a window of ``S`` samples the batch axis holds the batch repeated ``S`` times; each sample
runs on its own rows (and its own rows of a 3-D ``attn_mask`` and of ``key_padding_mask``).
Attention dropout (training mode) is drawn by torch's generator forked and seeded per sample of
the run, so a chunked estimate replays the masks of its forward.

torch's fused fast paths (``nn.TransformerEncoderLayer`` in inference) read the projection
weights directly, which would bypass the sampled weights: ``_qkv_same_embed_dim`` is therefore
``False`` on this module (it declines those paths), and :func:`~mcgraph.nn.bayesify` turns off an
encoder's nested-tensor path.
"""

from __future__ import annotations

import contextlib
import numbers

import torch
import torch.nn.functional as F
from torch import nn

from .context import current_window, user_shape
from ..engine import checks
from .layers import BayesLinear
from .weight_sites import sample_rng, sampled_weights_only, site_weights

__all__ = ["BayesMultiheadAttention"]

#: Stream kind of the attention dropout (distinct from every :class:`~mcgraph.nn.context.NoiseKind`).
ATTENTION_DROPOUT = 7


class BayesMultiheadAttention(nn.Module):
    """Bayesian ``nn.MultiheadAttention``.

    Args:
        embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first,
            device, dtype: as in ``torch.nn.MultiheadAttention``.
        **options: the keyword arguments of :class:`~mcgraph.nn.BayesLayer` given to the projections
            (``posterior``, ``prior``, ``kl_samples``, ``bayesian_bias``, ``rho_init``, ``scale_transform``).

    Raises:
        ValueError: ``embed_dim`` not divisible by ``num_heads``, or another argument out of range.

    Example:
        >>> import torch, mcgraph as mg
        >>> attn = mg.nn.BayesMultiheadAttention(8, 2, batch_first=True, posterior="radial")
        >>> x = torch.randn(3, 5, 8)
        >>> out, weights = attn(x, x, x)
        >>> out.shape, weights.shape
        (torch.Size([3, 5, 8]), torch.Size([3, 5, 5]))
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, *, device=None, dtype=None, **options) -> None:
        super().__init__()
        self.embed_dim = checks.positive_int("embed_dim", embed_dim)
        self.num_heads = checks.positive_int("num_heads", num_heads)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim} and "
                             f"num_heads={num_heads}")
        self.kdim = embed_dim if kdim is None else checks.positive_int("kdim", kdim)
        self.vdim = embed_dim if vdim is None else checks.positive_int("vdim", vdim)
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0 <= dropout <= 1:
            raise ValueError(f"dropout must be a number in [0, 1], got {dropout!r}")
        self.dropout = float(dropout)
        self.batch_first = bool(batch_first)
        self.head_dim = embed_dim // num_heads
        self.add_zero_attn = bool(add_zero_attn)
        sampled_weights_only(options, "attention", "the projections' weights are sampled and handed to "
                                                   "F.multi_head_attention_forward")
        self.qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        #: ``False`` always: declines torch's fused paths that would read the weights directly.
        self._qkv_same_embed_dim = False
        fk = {"device": device, "dtype": dtype}
        if self.qkv_same_embed_dim:
            self.in_proj = BayesLinear(embed_dim, 3 * embed_dim, bias, **fk, **options)
        else:
            self.q_proj = BayesLinear(embed_dim, embed_dim, bias, **fk, **options)
            self.k_proj = BayesLinear(self.kdim, embed_dim, bias, **fk, **options)
            self.v_proj = BayesLinear(self.vdim, embed_dim, bias, **fk, **options)
        self.out_proj = BayesLinear(embed_dim, embed_dim, bias, **fk, **options)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, embed_dim), **fk))
            self.bias_v = nn.Parameter(torch.empty((1, 1, embed_dim), **fk))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()

    @torch.no_grad()
    def _reset_parameters(self) -> None:
        """torch's initialisation of the means: Xavier-uniform input projection, zero biases."""
        for site in self._in_sites():
            nn.init.xavier_uniform_(site.weight_mu)
            bias = site._bias_mean
            if bias is not None:
                bias.zero_()
        out_bias = self.out_proj._bias_mean
        if out_bias is not None:
            out_bias.zero_()
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def _in_sites(self) -> list[BayesLinear]:
        return [self.in_proj] if self.qkv_same_embed_dim else [self.q_proj, self.k_proj, self.v_proj]

    @property
    def draws_run_noise(self) -> bool:
        """Whether attention dropout is drawn (sample runs then give it a seeded generator)."""
        return self.dropout > 0

    @property
    def in_proj_weight(self) -> torch.Tensor | None:
        """torch's name for the packed input projection: its posterior mean (``None`` with separate q/k/v)."""
        return self.in_proj.weight_mu if self.qkv_same_embed_dim else None

    @property
    def in_proj_bias(self) -> torch.Tensor | None:
        """torch's packed input-projection bias: the posterior mean (``None`` without bias)."""
        biases = [site._bias_mean for site in self._in_sites()]
        if biases[0] is None:
            return None
        return biases[0] if len(biases) == 1 else torch.cat(biases)

    # ------------------------------------------------------------------ forward

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False):
        """torch's ``forward``: ``(attn_output, attn_output_weights)`` (weights ``None`` unless ``need_weights``)."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor) or t.dim() not in (2, 3):
                raise ValueError(f"{name}: expected a 2-D (unbatched) or 3-D (batched) tensor, got "
                                 f"{getattr(t, 'shape', type(t).__name__)}")
        batch_dim = None if query.dim() < 3 else (0 if self.batch_first else 1)
        for name, t, size in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if t.shape[-1] != size:
                what = {"query": "embed_dim", "key": "kdim", "value": "vdim"}[name]
                raise ValueError(f"{name}: the last dimension must be {what}={size}, got shape "
                                 f"{user_shape(t, batch_dim)}")
        is_batched = query.dim() == 3
        key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                             other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                             target_type=query.dtype)
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)
        if self.batch_first and is_batched:  # keep the identities query is key is value (torch's packed path)
            if key is value:
                if query is key:
                    query = key = value = query.transpose(1, 0)
                else:
                    query, key = (x.transpose(1, 0) for x in (query, key))
                    value = key
            else:
                query, key, value = (x.transpose(1, 0) for x in (query, key, value))

        win = current_window()
        S = 1 if win is None else win.size
        sites = [site_weights(site) for site in self._in_sites()]
        out_site = site_weights(self.out_proj)
        sampled = any(w.batched for w in sites) or out_site.batched
        if S == 1 or not (sampled or (self.training and self.dropout > 0)):
            out, weights = self._attend(query, key, value, sites, out_site, 0, key_padding_mask, attn_mask,
                                        need_weights, average_attn_weights, is_causal)
        elif self._batches_samples(query, need_weights, attn_mask, is_causal):
            out, weights = self._attend_batched(query, key, value, sites, out_site, S, key_padding_mask, attn_mask)
        else:
            if not is_batched:
                raise ValueError(f"query: inside a window of {S} samples the input must be batched (the batch "
                                 f"repeated once per sample), got shape {tuple(query.shape)}")
            batch = query.shape[1]
            if batch % S:
                raise ValueError(f"query: inside a window of {S} samples the batch must be a multiple of {S}, got "
                                 f"a batch of {batch}")
            rows = batch // S
            outs, ws = [], []
            for s in range(S):
                def block(t, dim=1):
                    return t.narrow(dim, s * rows, rows)
                q = block(query)
                k = q if key is query else block(key)
                v = k if value is key else (q if value is query else block(value))
                kpm = None if key_padding_mask is None else block(key_padding_mask, 0)
                am = attn_mask
                if am is not None and am.dim() == 3:
                    am = am.narrow(0, s * rows * self.num_heads, rows * self.num_heads)
                o, w = self._attend(q, k, v, sites, out_site, s, kpm, am, need_weights, average_attn_weights,
                                    is_causal)
                outs.append(o)
                ws.append(w)
            out = torch.cat(outs, 1)
            weights = torch.cat(ws, 0) if need_weights else None
        if self.batch_first and is_batched:
            return out.transpose(1, 0), weights
        return out, weights

    #: Whether a window's samples run as one batched computation (``True``), one attention call per sample
    #: (``False``), or as :data:`BATCHED_DEVICES` says for the input's device (``None``, the default).
    batch_samples: bool | None = None
    #: Device types on which ``batch_samples=None`` batches: on a GPU one launch for S samples beats S
    #: launches; on a CPU S calls of torch's fused attention were measured faster than the batched products
    #: (``bench/predict_overhead.py``).
    BATCHED_DEVICES = ("cuda",)

    def _batches_samples(self, query, need_weights, attn_mask, is_causal) -> bool:
        """Whether the batched path serves this call: it covers what a transformer layer asks for (no
        attention weights, no ``bias_k``/``bias_v``, no zero attention, no attention dropout in training)."""
        wanted = self.batch_samples if self.batch_samples is not None else query.device.type in self.BATCHED_DEVICES
        return (wanted and not need_weights and self.bias_k is None and not self.add_zero_attn
                and not (self.training and self.dropout > 0) and not (is_causal and attn_mask is None))

    @staticmethod
    def _per_sample_linear(x: torch.Tensor, weights, S: int, rows: int) -> torch.Tensor:
        """``x`` ``(L, S·rows, in)``: sample ``s``'s rows times its own weight ``(out, in)`` (one batched product)."""
        w, b = weights
        if w.dim() == 2:  # the mean ("mean" mode): one weight for every sample
            return F.linear(x, w, b)
        L = x.shape[0]
        xs = x.reshape(L, S, rows, x.shape[-1]).transpose(0, 1).reshape(S, L * rows, x.shape[-1])
        y = torch.bmm(xs, w.transpose(1, 2)) if b is None else torch.baddbmm(b.unsqueeze(1), xs, w.transpose(1, 2))
        return y.reshape(S, L, rows, y.shape[-1]).transpose(0, 1).reshape(L, S * rows, y.shape[-1])

    def _attend_batched(self, query, key, value, sites, out_site, S, key_padding_mask, attn_mask):
        """The window's ``S`` samples at once: per-sample projections as batched products, then one scaled
        dot-product attention over every row (attention itself has no weights), as
        ``F.multi_head_attention_forward`` computes it for each sample (``need_weights=False``)."""
        L, N, E = query.shape
        Lk, rows, H, D = key.shape[0], N // S, self.num_heads, self.head_dim
        if self.qkv_same_embed_dim and query is key and key is value:  # self-attention: one packed product
            q, k, v = self._per_sample_linear(query, (sites[0].weight, sites[0].bias), S, rows).chunk(3, dim=-1)
        else:
            if self.qkv_same_embed_dim:
                w, b = sites[0].weight, sites[0].bias
                parts = [(w[..., i * E:(i + 1) * E, :], None if b is None else b[..., i * E:(i + 1) * E])
                         for i in range(3)]
            else:
                parts = [(site.weight, site.bias) for site in sites]
            q, k, v = (self._per_sample_linear(x, part, S, rows) for x, part in zip((query, key, value), parts))
        mask = None
        if attn_mask is not None:
            mask = attn_mask.view(N, H, L, Lk) if attn_mask.dim() == 3 else attn_mask.view(1, 1, L, Lk)
        if key_padding_mask is not None:
            pad = key_padding_mask.view(N, 1, 1, Lk)
            mask = pad if mask is None else mask + pad
        q, k, v = (t.reshape(t.shape[0], N * H, D).transpose(0, 1).reshape(N, H, t.shape[0], D) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (N, H, L, D)
        out = out.permute(2, 0, 1, 3).reshape(L, N, E)
        return self._per_sample_linear(out, (out_site.weight, out_site.bias), S, rows), None

    def _attend(self, query, key, value, sites, out_site, s, key_padding_mask, attn_mask, need_weights,
                average_attn_weights, is_causal):
        out_w, out_b = out_site.at(s)
        if self.qkv_same_embed_dim:
            in_w, in_b = sites[0].at(s)
            extra = {}
        else:
            (q_w, q_b), (k_w, k_b), (v_w, v_b) = (w.at(s) for w in sites)
            in_w, in_b = None, None if q_b is None else torch.cat([q_b, k_b, v_b])
            extra = dict(use_separate_proj_weight=True, q_proj_weight=q_w, k_proj_weight=k_w, v_proj_weight=v_w)
        with sample_rng(self, s, ATTENTION_DROPOUT, query.device) if self.training and self.dropout > 0 \
                else contextlib.nullcontext():
            return F.multi_head_attention_forward(
                query, key, value, self.embed_dim, self.num_heads, in_w, in_b, self.bias_k, self.bias_v,
                self.add_zero_attn, self.dropout, out_w, out_b, training=self.training,
                key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
                average_attn_weights=average_attn_weights, is_causal=is_causal, **extra)

    # ------------------------------------------------------------------ conversion

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention, *, init_from_weights: bool = True,
                   **options) -> "BayesMultiheadAttention":
        """The Bayesian counterpart of an ``nn.MultiheadAttention`` (means and biases copied from it)."""
        p = module.out_proj.weight
        layer = cls(module.embed_dim, module.num_heads, module.dropout, module.out_proj.bias is not None,
                    module.bias_k is not None, module.add_zero_attn, module.kdim, module.vdim, module.batch_first,
                    device=p.device, dtype=p.dtype, **options)
        if init_from_weights:
            layer._copy_from(module)
        return layer

    @torch.no_grad()
    def _copy_from(self, module: nn.MultiheadAttention) -> None:
        E = self.embed_dim
        if self.qkv_same_embed_dim:
            self.in_proj.weight_mu.copy_(module.in_proj_weight)
        else:
            for site, name in zip(self._in_sites(), ("q_proj_weight", "k_proj_weight", "v_proj_weight")):
                site.weight_mu.copy_(getattr(module, name))
        if module.in_proj_bias is not None:
            for i, site in enumerate(self._in_sites()):
                n = site.weight_mu.shape[0]
                site._bias_mean.copy_(module.in_proj_bias[i * E:i * E + n])
        self.out_proj.weight_mu.copy_(module.out_proj.weight)
        if module.out_proj.bias is not None:
            self.out_proj._bias_mean.copy_(module.out_proj.bias)
        if module.bias_k is not None:
            self.bias_k.copy_(module.bias_k)
            self.bias_v.copy_(module.bias_v)

    def extra_repr(self) -> str:
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if not self.qkv_same_embed_dim:
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        if self.batch_first:
            s += ", batch_first=True"
        return s
