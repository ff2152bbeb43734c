"""Bayesian recurrent layers: ``BayesLSTM``, ``BayesGRU`` and ``BayesRNN``, drop-in for ``nn.LSTM/GRU/RNN``.

Every weight matrix of torch's module (``weight_ih_l{k}``, ``weight_hh_l{k}``, ``weight_hr_l{k}``,
``_reverse`` for the second direction) is the weight of a :class:`~mcgraph.nn.BayesLinear` *site*
(``ih_l{k}``, ``hh_l{k}``, ``hr_l{k}``) whose bias is torch's ``bias_ih_l{k}`` / ``bias_hh_l{k}``.
The sites are the module's Bayesian layers: :func:`~mcgraph.nn.kl` sums their KL terms (the KL
of the weights, whatever the sequence length), :func:`~mcgraph.nn.set_mode`, pruning and the
sparsification rules reach them as they reach any ``BayesLinear``.

**One weight sample per sequence.** A forward draws one sample of every weight
(inside a sample window: one per Monte Carlo sample, ``W_s``), then runs torch's fused
recurrent kernel (``torch._VF.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``) on the sampled
weights, for the whole sequence:

.. math::
    h_t^{(s)} = \\text{cell}\\big(x_t, h_{t-1}^{(s)};\\, W_s\\big), \\qquad W_s \\sim q(W),
    \\quad s = 1 \\dots S,

the same ``W_s`` at every step ``t``. Inside a window of ``S`` samples the batch axis holds
the batch repeated ``S`` times (sample ``s`` owns batch rows ``s·B … (s+1)·B − 1``) and the
kernel runs once per sample on its own rows; there is never a Python loop over time steps.
In ``"mean"`` mode the posterior means are the weights and the module computes exactly what
``nn.LSTM`` computes with those weights.

Dropout between layers (``dropout > 0``, training mode; in evaluation mode too once
:func:`~mcgraph.nn.mc_dropout` has set ``mc_dropout``) is drawn by the module itself, layer by
layer: one ``(L, N, H)`` mask per Monte Carlo sample (where torch draws one per forward), from the
seeded streams of a sample run (global generator outside one), so a chunked estimate replays the
very masks of its forward.

:class:`FusedRNNBase` holds torch's interface and the runs of the fused kernel for weights given
per sample by a subclass (:meth:`FusedRNNBase._weights`); :class:`BayesRNNBase` draws them from
its sites, :class:`mcgraph.nn.mc_dropout.MCDropoutRNN` hands in a torch module's own weights.

Example:
    >>> import torch, mcgraph as mg
    >>> lstm = mg.nn.BayesLSTM(8, 16, num_layers=2, batch_first=True, posterior="normal", prior="normal")
    >>> out, (h, c) = lstm(torch.randn(4, 5, 8))
    >>> out.shape, h.shape, c.shape
    (torch.Size([4, 5, 16]), torch.Size([2, 4, 16]), torch.Size([2, 4, 16]))
    >>> len(mg.nn.bayesian_modules(lstm))     # ih_l0, hh_l0, ih_l1, hh_l1
    4
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch
from torch import _VF, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from ..engine import checks
from .context import current_window, user_shape
from .layers import BayesLayer, BayesLinear
from .weight_sites import SiteWeights, sampled_weights_only, site_weights

__all__ = ["FusedRNNBase", "BayesRNNBase", "BayesLSTM", "BayesGRU", "BayesRNN", "RECURRENT_KERNELS"]

#: ``mode -> (gates per hidden unit, fused kernel)``.
RECURRENT_KERNELS = {
    "LSTM": (4, _VF.lstm),
    "GRU": (3, _VF.gru),
    "RNN_TANH": (1, _VF.rnn_tanh),
    "RNN_RELU": (1, _VF.rnn_relu),
}

_TORCH_MODULES = {"LSTM": nn.LSTM, "GRU": nn.GRU, "RNN_TANH": nn.RNN, "RNN_RELU": nn.RNN}

#: Stream kind of the dropout after layer ``l``: ``LAYER_DROPOUT + 16·l`` (distinct from every :class:`NoiseKind`).
LAYER_DROPOUT = 6


def _packed_index(batch_sizes: torch.Tensor, sorted_indices: torch.Tensor | None, device) -> tuple:
    """``(t, b)``: the time step and original batch index of every row of a packed sequence's data."""
    bs = batch_sizes.to(torch.long)
    t = torch.repeat_interleave(torch.arange(bs.numel()), bs)
    offsets = torch.cumsum(bs, 0) - bs
    j = torch.arange(int(bs.sum())) - offsets[t]
    t, j = t.to(device), j.to(device)
    b = j if sorted_indices is None else sorted_indices.to(device)[j]
    return t, b


class FusedRNNBase(nn.Module):
    """torch's recurrent interface run on torch's fused kernels, for weights given per sample by a subclass.

    The counterpart of ``torch.nn.RNNBase`` without parameters of its own: a subclass defines
    :meth:`_weights` (torch's flat weight list for every Monte Carlo sample of the active window)
    and :attr:`_weight_dtype`. Everything else (argument checks, ``hx``, unbatched and packed input,
    one kernel call per sample on its own batch rows, seeded dropout between layers) lives here.

    Args:
        mode: ``"LSTM"``, ``"GRU"``, ``"RNN_TANH"`` or ``"RNN_RELU"``.
        input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
            proj_size: as in ``torch.nn.LSTM`` (``proj_size`` for the LSTM only).

    Attributes:
        mc_dropout: keep the dropout between layers on in evaluation mode too (MC dropout, set by
            :func:`~mcgraph.nn.mc_dropout`); by default it follows ``self.training`` as torch's does.

    Raises:
        ValueError: an argument out of range (named in the message).
    """

    def __init__(self, mode: str, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 proj_size: int = 0) -> None:
        super().__init__()
        if mode not in RECURRENT_KERNELS:
            raise ValueError(f"mode must be one of {sorted(RECURRENT_KERNELS)}, got {mode!r}")
        self.mode = mode
        self.input_size = checks.positive_int("input_size", input_size)
        self.hidden_size = checks.positive_int("hidden_size", hidden_size)
        self.num_layers = checks.positive_int("num_layers", num_layers)
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0 <= dropout <= 1:
            raise ValueError(f"dropout must be a number in [0, 1] representing the probability of an element "
                             f"being zeroed, got {dropout!r}")
        if dropout > 0 and num_layers == 1:
            warnings.warn(f"dropout option adds dropout after all but last recurrent layer, so non-zero dropout "
                          f"expects num_layers greater than 1, but got dropout={dropout} and num_layers={num_layers}",
                          stacklevel=4)
        if isinstance(proj_size, bool) or not isinstance(proj_size, numbers.Integral) or proj_size < 0:
            raise ValueError(f"proj_size must be a non-negative int, got {proj_size!r}")
        if proj_size >= hidden_size:
            raise ValueError(f"proj_size must be smaller than hidden_size, got proj_size={proj_size} and "
                             f"hidden_size={hidden_size}")
        if proj_size and mode != "LSTM":
            raise ValueError(f"proj_size is an LSTM argument, got proj_size={proj_size} for mode {mode!r}")
        self.bias = bool(bias)
        self.batch_first = bool(batch_first)
        self.dropout = float(dropout)
        self.bidirectional = bool(bidirectional)
        self.proj_size = int(proj_size)
        self.mc_dropout = False

    @property
    def num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def draws_run_noise(self) -> bool:
        """Whether the module draws dropout masks itself (sample runs then give it seeded streams)."""
        return self.dropout > 0 and self.num_layers > 1

    @property
    def _dropout_active(self) -> bool:
        return (self.training or self.mc_dropout) and self.dropout > 0 and self.num_layers > 1

    def flatten_parameters(self) -> None:
        """Nothing to do (the weights are handed to the kernel at every forward); kept for ``nn.LSTM`` code."""

    # ------------------------------------------------------------------ weights (the subclass's part)

    def _weights(self):
        """``(flat(s), any_sampled)``: ``flat(s)`` is torch's flat weight list for sample ``s`` of the window
        (per layer and direction: ``w_ih, w_hh[, b_ih, b_hh][, w_hr]``); ``any_sampled`` whether they differ
        between samples."""
        raise NotImplementedError

    @property
    def _weight_dtype(self) -> torch.dtype:
        raise NotImplementedError

    # ------------------------------------------------------------------ checks

    def _check_input(self, x: torch.Tensor, batch_sizes) -> None:
        dtype = self._weight_dtype
        if x.dtype != dtype and not torch.is_autocast_enabled():
            raise ValueError(f"input: dtype {x.dtype} does not match the weights' dtype {dtype}")
        if x.size(-1) != self.input_size:
            batch_dim = None if x.dim() < 3 or batch_sizes is not None else (0 if self.batch_first else 1)
            raise ValueError(f"input: the last dimension must be input_size={self.input_size}, "
                             f"got shape {user_shape(x, batch_dim)}")

    def _expected_hidden(self, batch: int, cell: bool) -> tuple:
        size = self.hidden_size if (cell or not self.proj_size) else self.proj_size
        return (self.num_layers * self.num_directions, batch, size)

    def _check_hidden(self, hx, batch: int, batched: bool):
        """``hx`` as the kernel takes it (3-d), or a ``ValueError`` naming ``hx``."""
        is_lstm = self.mode == "LSTM"
        if is_lstm:
            if not (isinstance(hx, (tuple, list)) and len(hx) == 2 and all(isinstance(t, torch.Tensor) for t in hx)):
                raise ValueError("hx: the LSTM's hidden state is a tuple (h_0, c_0) of tensors, "
                                 f"got {type(hx).__name__}")
            parts = list(hx)
        else:
            if not isinstance(hx, torch.Tensor):
                raise ValueError(f"hx: expected a tensor, got {type(hx).__name__}")
            parts = [hx]
        want_dim = 3 if batched else 2
        out = []
        for k, t in enumerate(parts):
            name = ("h_0", "c_0")[k] if is_lstm else "hx"
            if t.dim() != want_dim:
                raise ValueError(f"hx: for {'batched 3-D' if batched else 'unbatched 2-D'} input, {name} must be "
                                 f"{want_dim}-D, got shape {tuple(t.shape)}")
            t = t if batched else t.unsqueeze(1)
            expected = self._expected_hidden(batch, cell=k == 1)
            if tuple(t.shape) != expected:
                raise ValueError(f"hx: expected {name} of shape {expected}, got {tuple(t.shape)}")
            out.append(t)
        return tuple(out) if is_lstm else out[0]

    def _zeros(self, batch: int, like: torch.Tensor):
        h = torch.zeros(self._expected_hidden(batch, False), dtype=like.dtype, device=like.device)
        if self.mode == "LSTM":
            return h, torch.zeros(self._expected_hidden(batch, True), dtype=like.dtype, device=like.device)
        return h

    @staticmethod
    def _map_hidden(hx, fn):
        return tuple(fn(t) for t in hx) if isinstance(hx, tuple) else fn(hx)

    # ------------------------------------------------------------------ forward

    def forward(self, input, hx=None):
        """torch's ``forward(input, hx=None)``: ``(output, h_n)``, or ``(output, (h_n, c_n))`` for the LSTM.

        ``input``: ``(L, N, H_in)`` (``(N, L, H_in)`` with ``batch_first``), ``(L, H_in)`` unbatched,
        or a ``PackedSequence``; ``hx``: as in torch (zeros when ``None``).
        """
        packed = isinstance(input, PackedSequence)
        if packed:
            data, batch_sizes, sorted_indices, unsorted_indices = input
            self._check_input(data, batch_sizes)
            if data.dim() != 2:
                raise ValueError(f"input: a PackedSequence's data must be 2-D, got shape {tuple(data.shape)}")
            batch = int(batch_sizes[0])
            hx = self._zeros(batch, data) if hx is None else self._map_hidden(
                self._check_hidden(hx, batch, True), lambda t: t.index_select(1, sorted_indices)
                if sorted_indices is not None else t)
            batched = True
            x = data
        else:
            if not isinstance(input, torch.Tensor):
                raise TypeError(f"input must be a tensor or a PackedSequence, got {type(input).__name__}")
            if input.dim() not in (2, 3):
                raise ValueError(f"input: expected a 2-D (unbatched) or 3-D (batched) tensor, got shape "
                                 f"{tuple(input.shape)}")
            self._check_input(input, None)
            batched = input.dim() == 3
            batch_dim = 0 if self.batch_first else 1
            x = input if batched else input.unsqueeze(batch_dim)
            batch = x.size(batch_dim)
            hx = self._zeros(batch, x) if hx is None else self._check_hidden(hx, batch, batched)
            batch_sizes = sorted_indices = unsorted_indices = None

        win = current_window()
        S = 1 if win is None else win.size
        flat, sampled = self._weights()
        if S == 1 or (not sampled and not self._dropout_active):
            out, hidden = self._run(x, batch_sizes, hx, flat(0), 0, sorted_indices)
        else:
            if batch % S:
                raise ValueError(f"input: inside a window of {S} samples the batch must be a multiple of {S} "
                                 f"(the batch repeated once per sample), got a batch of {batch}")
            if packed:
                out, hidden = self._run_packed_samples(input, hx, flat, S, unsorted_indices)
            else:
                out, hidden = self._run_samples(x, hx, flat, S, batch // S)

        if packed:
            if not (S > 1 and (sampled or self._dropout_active)) and unsorted_indices is not None:
                hidden = self._map_hidden(hidden, lambda t: t.index_select(1, unsorted_indices))
            return PackedSequence(out, batch_sizes, sorted_indices, unsorted_indices), hidden
        if not batched:
            out = out.squeeze(0 if self.batch_first else 1)
            hidden = self._map_hidden(hidden, lambda t: t.squeeze(1))
        return out, hidden

    def _run_samples(self, x, hx, flat, S: int, rows: int):
        bd = 0 if self.batch_first else 1
        outs, hiddens = [], []
        for s in range(S):
            xs = x.narrow(bd, s * rows, rows)
            hs = self._map_hidden(hx, lambda t: t.narrow(1, s * rows, rows))  # (made contiguous in _call)
            o, h = self._run(xs, None, hs, flat(s), s, None)
            outs.append(o)
            hiddens.append(h)
        out = torch.cat(outs, bd)
        if self.mode == "LSTM":
            return out, (torch.cat([h[0] for h in hiddens], 1), torch.cat([h[1] for h in hiddens], 1))
        return out, torch.cat(hiddens, 1)

    def _run_packed_samples(self, packed: PackedSequence, hx, flat, S: int, unsorted_indices):
        # hx arrives in the sorted order of `packed`: back to the original batch order first
        if unsorted_indices is not None:
            hx = self._map_hidden(hx, lambda t: t.index_select(1, unsorted_indices))
        padded, lengths = pad_packed_sequence(packed)  # (T, N, F), original batch order
        T, N = padded.shape[0], padded.shape[1]
        rows = N // S
        outs, hiddens = [], []
        for s in range(S):
            block = pack_padded_sequence(padded[:, s * rows:(s + 1) * rows], lengths[s * rows:(s + 1) * rows],
                                         enforce_sorted=False)
            hs = self._map_hidden(hx, lambda t: t.narrow(1, s * rows, rows).index_select(1, block.sorted_indices))
            o, h = self._run(block.data, block.batch_sizes, hs, flat(s), s, block.sorted_indices)
            o = pad_packed_sequence(PackedSequence(o, block.batch_sizes, block.sorted_indices,
                                                   block.unsorted_indices), total_length=T)[0]
            outs.append(o)
            hiddens.append(self._map_hidden(h, lambda t: t.index_select(1, block.unsorted_indices)))
        out = torch.cat(outs, 1)
        t, b = _packed_index(packed.batch_sizes, packed.sorted_indices, out.device)
        data = out[t, b]
        if self.mode == "LSTM":
            return data, (torch.cat([h[0] for h in hiddens], 1), torch.cat([h[1] for h in hiddens], 1))
        return data, torch.cat(hiddens, 1)

    def _call(self, x, batch_sizes, hx, weights, num_layers, dropout, train):
        _, kernel = RECURRENT_KERNELS[self.mode]
        hx = self._map_hidden(hx, lambda t: t.contiguous())  # cuDNN refuses a strided state (a no-op when it is not)
        if batch_sizes is None:
            result = kernel(x, hx, weights, self.bias, num_layers, dropout, train, self.bidirectional,
                            self.batch_first)
        else:
            result = kernel(x, batch_sizes, hx, weights, self.bias, num_layers, dropout, train, self.bidirectional)
        if self.mode == "LSTM":
            return result[0], (result[1], result[2])
        return result[0], result[1]

    def _run(self, x, batch_sizes, hx, weights, sample: int, sorted_indices):
        """One weight sample on its rows: torch's fused kernel, layer by layer only for dropout."""
        if not self._dropout_active:
            return self._call(x, batch_sizes, hx, weights, self.num_layers, self.dropout, self.training)
        per_layer = len(weights) // self.num_layers
        D = self.num_directions
        hs, cs = [], []
        for layer in range(self.num_layers):
            w = weights[layer * per_layer:(layer + 1) * per_layer]
            h = self._map_hidden(hx, lambda t: t[layer * D:(layer + 1) * D])
            x, hidden = self._call(x, batch_sizes, h, w, 1, 0.0, True)
            if self.mode == "LSTM":
                hs.append(hidden[0])
                cs.append(hidden[1])
            else:
                hs.append(hidden)
            if layer < self.num_layers - 1:
                x = x * self._dropout_mask(x, batch_sizes, sample, layer, sorted_indices)
        hidden = (torch.cat(hs), torch.cat(cs)) if self.mode == "LSTM" else torch.cat(hs)
        return x, hidden

    def _dropout_mask(self, x, batch_sizes, sample: int, layer: int, sorted_indices) -> torch.Tensor:
        """Kept / (1 − p) or 0 per element of layer ``layer``'s output (seeded per sample inside a window)."""
        keep = 1.0 - self.dropout
        dtype, device = x.dtype, x.device
        win = current_window()
        if win is None:
            return (torch.rand(x.shape, device=device) < keep).to(dtype) / keep
        # a (T, B, features) mask per sample, whatever the layout or packing of this call
        if batch_sizes is None:
            T, B = (x.shape[1], x.shape[0]) if self.batch_first else (x.shape[0], x.shape[1])
        else:
            T, B = batch_sizes.numel(), int(batch_sizes[0])
        shape = (T, B, x.shape[-1])

        def draw(n):
            return (torch.rand((n,) + shape, device=device) < keep).to(dtype)

        rows = win.run.raw_rows(self, LAYER_DROPOUT + 16 * layer, draw, shape, dtype, device, win.start, win.stop)
        mask = rows[sample] / keep
        if batch_sizes is not None:
            t, b = _packed_index(batch_sizes, sorted_indices, device)
            return mask[t, b]
        return mask.transpose(0, 1) if self.batch_first else mask

    # ------------------------------------------------------------------ conversion

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.proj_size:
            s += f", proj_size={self.proj_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if not self.bias:
            s += ", bias=False"
        if self.batch_first:
            s += ", batch_first=True"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.bidirectional:
            s += ", bidirectional=True"
        if self.mc_dropout:
            s += ", mc_dropout=True"
        return s


class BayesRNNBase(FusedRNNBase):
    """Base of the Bayesian recurrent layers (the counterpart of ``torch.nn.RNNBase``).

    Args:
        mode: ``"LSTM"``, ``"GRU"``, ``"RNN_TANH"`` or ``"RNN_RELU"``.
        input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
            proj_size: as in ``torch.nn.LSTM`` (``proj_size`` for the LSTM only).
        device, dtype: factory arguments of the parameters.
        **options: the options of every site (:class:`~mcgraph.nn.BayesLayer`): ``posterior``,
            ``prior``, ``kl_samples``, ``bayesian_bias``, ``rho_init``, ``scale_transform``.
            ``local_reparameterization`` and ``flipout`` act on a layer's pre-activations, which the
            fused kernel keeps to itself: they must be left unset (or ``False``).

    Raises:
        ValueError: an argument out of range (named in the message), or an estimator option.
    """

    def __init__(self, mode: str, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, proj_size: int = 0,
                 *, device=None, dtype=None, **options) -> None:
        super().__init__(mode, input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         proj_size)
        sampled_weights_only(options, "recurrent layers", "the fused recurrent kernel takes weights, so "
                                                           "weights are sampled (once per sequence)")
        #: per (layer, direction): the names of its sites (torch's layout: ih, hh[, hr])
        self._site_names: list[list[str]] = self._build_sites({"device": device, "dtype": dtype}, options)
        self.reset_parameters()

    def _build_sites(self, factory: dict, options: dict) -> list[list[str]]:
        """Create the Bayesian sites (the construction hook) and return their names per (layer, direction).

        torch's layout here: per layer and direction ``ih`` ``(gates·H, in)``, ``hh`` ``(gates·H, H)`` and, with
        ``proj_size``, ``hr``. A subclass whose sites hold another library's layout overrides this hook (and
        :meth:`_layer_weights`, which maps its draws to torch's flat weights); ``options`` are the keyword
        arguments the constructor was given beyond torch's, ``factory`` the device and dtype.
        """
        gates, _ = RECURRENT_KERNELS[self.mode]
        real_hidden = self.proj_size or self.hidden_size
        names_out = []
        for layer in range(self.num_layers):
            for direction in range(self.num_directions):
                suffix = f"_l{layer}" + ("_reverse" if direction else "")
                layer_input = self.input_size if layer == 0 else real_hidden * self.num_directions
                names = [f"ih{suffix}", f"hh{suffix}"]
                setattr(self, names[0], BayesLinear(layer_input, gates * self.hidden_size, self.bias, **factory,
                                                    **options))
                setattr(self, names[1], BayesLinear(real_hidden, gates * self.hidden_size, self.bias, **factory,
                                                    **options))
                if self.proj_size:
                    names.append(f"hr{suffix}")
                    setattr(self, names[2], BayesLinear(self.hidden_size, self.proj_size, False, **factory,
                                                        **options))
                names_out.append(names)
        return names_out

    # ------------------------------------------------------------------ parameters

    def sites(self) -> list[BayesLayer]:
        """The Bayesian sites in the order of :attr:`_site_names` (torch's: per layer and direction ih, hh[, hr])."""
        return [getattr(self, n) for names in self._site_names for n in names]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """μ and the biases as torch initialises the module (uniform in ±1/√hidden_size), ρ = ``rho_init``."""
        stdv = 1.0 / math.sqrt(self.hidden_size)
        for site in self.sites():
            site.weight_mu.uniform_(-stdv, stdv)
            site.weight_rho.fill_(site.rho_init)
            if site.bias is not None:
                site.bias.uniform_(-stdv, stdv)
            if site.bias_mu is not None:
                site.bias_mu.uniform_(-stdv, stdv)
                site.bias_rho.fill_(site.rho_init)

    # ------------------------------------------------------------------ weights

    @property
    def _weight_dtype(self) -> torch.dtype:
        return self.sites()[0].weight_mu.dtype

    def _layer_weights(self, draws: list[SiteWeights], s: int) -> list[torch.Tensor]:
        """torch's flat weights of one (layer, direction) for sample ``s``: ``w_ih, w_hh[, b_ih, b_hh][, w_hr]``.

        ``draws`` are the :class:`~mcgraph.nn.weight_sites.SiteWeights` of that group's sites, in
        :attr:`_site_names` order. A subclass whose sites hold the weights in another layout (a
        converted layer of another library) maps them here.
        """
        (w_ih, b_ih), (w_hh, b_hh) = draws[0].at(s), draws[1].at(s)
        weights = [w_ih, w_hh]
        if self.bias:
            weights += [b_ih, b_hh]
        if len(draws) == 3:
            weights.append(draws[2].at(s)[0])
        return weights

    def _weights(self):
        per_site = [site_weights(site) for site in self.sites()]
        sampled = any(w.batched for w in per_site)
        layout, i = [], 0
        for names in self._site_names:
            layout.append(per_site[i:i + len(names)])
            i += len(names)

        def flat(s: int) -> list[torch.Tensor]:
            return [w for group in layout for w in self._layer_weights(group, s)]

        return flat, sampled

    def _mean_weights(self) -> list[torch.Tensor]:
        """torch's flat weight list of the posterior means (what ``"mean"`` mode runs)."""
        means = [SiteWeights(site.weight_mu, site._bias_mean, False) for site in self.sites()]
        out, i = [], 0
        for names in self._site_names:
            out += self._layer_weights(means[i:i + len(names)], 0)
            i += len(names)
        return out

    # ------------------------------------------------------------------ conversion

    @classmethod
    def from_torch(cls, module: nn.RNNBase, *, init_from_weights: bool = True, **options) -> "BayesRNNBase":
        """The Bayesian counterpart of an ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` (μ and biases copied from it)."""
        p = module._flat_weights[0] if module._flat_weights else None
        factory = {"device": getattr(p, "device", None), "dtype": getattr(p, "dtype", None)}
        args = (module.input_size, module.hidden_size)
        kwargs = dict(num_layers=module.num_layers, bias=module.bias, batch_first=module.batch_first,
                      dropout=float(module.dropout), bidirectional=module.bidirectional, **factory, **options)
        if isinstance(module, nn.LSTM):
            layer = BayesLSTM(*args, proj_size=module.proj_size, **kwargs)
        elif isinstance(module, nn.GRU):
            layer = BayesGRU(*args, **kwargs)
        elif isinstance(module, nn.RNN):
            layer = BayesRNN(*args, nonlinearity=module.nonlinearity, **kwargs)
        else:
            raise TypeError(f"module must be an nn.LSTM, nn.GRU or nn.RNN, got {type(module).__name__}")
        if init_from_weights:
            layer._copy_from(module)
        return layer

    @torch.no_grad()
    def _copy_from(self, module: nn.RNNBase) -> None:
        for names in self._site_names:
            suffix = names[0][2:]
            ih, hh = getattr(self, names[0]), getattr(self, names[1])
            ih.weight_mu.copy_(getattr(module, f"weight_ih{suffix}"))
            hh.weight_mu.copy_(getattr(module, f"weight_hh{suffix}"))
            if self.bias:
                (ih.bias if ih.bias is not None else ih.bias_mu).copy_(getattr(module, f"bias_ih{suffix}"))
                (hh.bias if hh.bias is not None else hh.bias_mu).copy_(getattr(module, f"bias_hh{suffix}"))
            if len(names) == 3:
                getattr(self, names[2]).weight_mu.copy_(getattr(module, f"weight_hr{suffix}"))

    def to_torch(self) -> nn.RNNBase:
        """A torch module of the same shape holding the posterior means (the ``"mean"`` mode's function)."""
        p = self.sites()[0].weight_mu
        kwargs = dict(num_layers=self.num_layers, bias=self.bias, batch_first=self.batch_first,
                      dropout=self.dropout, bidirectional=self.bidirectional, device=p.device, dtype=p.dtype)
        if self.mode == "LSTM":
            module = nn.LSTM(self.input_size, self.hidden_size, proj_size=self.proj_size, **kwargs)
        elif self.mode == "GRU":
            module = nn.GRU(self.input_size, self.hidden_size, **kwargs)
        else:
            module = nn.RNN(self.input_size, self.hidden_size, nonlinearity=self.mode[4:].lower(), **kwargs)
        with torch.no_grad():
            for name, value in zip(module._flat_weights_names, self._mean_weights(), strict=True):
                getattr(module, name).copy_(value)
        return module


class BayesLSTM(BayesRNNBase):
    """Bayesian ``nn.LSTM``: torch's constructor, ``forward(input, hx=None)`` and ``(output, (h_n, c_n))``.

    Args:
        input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, proj_size,
            device, dtype: as in ``torch.nn.LSTM``.
        **options: the keyword arguments of :class:`~mcgraph.nn.BayesLayer` given to every weight
            (``posterior``, ``prior``, ``kl_samples``, ``bayesian_bias``, ``rho_init``,
            ``scale_transform``).

    Example:
        >>> import torch, mcgraph as mg
        >>> lstm = mg.nn.BayesLSTM(3, 5, posterior="radial", prior="scale_mixture", kl_samples=100)
        >>> out, (h, c) = lstm(torch.randn(7, 2, 3))        # (L, N, H_in): one weight sample for all 7 steps
        >>> out.shape, mg.nn.kl(lstm, seed=0).shape
        (torch.Size([7, 2, 5]), torch.Size([]))
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, proj_size: int = 0,
                 **options) -> None:
        super().__init__("LSTM", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         proj_size, **options)


class BayesGRU(BayesRNNBase):
    """Bayesian ``nn.GRU``: torch's constructor, ``forward(input, hx=None)`` and ``(output, h_n)``.

    Example:
        >>> import torch, mcgraph as mg
        >>> gru = mg.nn.BayesGRU(3, 5, num_layers=2, bidirectional=True, batch_first=True)
        >>> out, h = gru(torch.randn(2, 7, 3))
        >>> out.shape, h.shape
        (torch.Size([2, 7, 10]), torch.Size([4, 2, 5]))
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, **options) -> None:
        super().__init__("GRU", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         **options)


class BayesRNN(BayesRNNBase):
    """Bayesian Elman ``nn.RNN`` (``nonlinearity`` ``"tanh"`` or ``"relu"``): torch's interface.

    Example:
        >>> import torch, mcgraph as mg
        >>> rnn = mg.nn.BayesRNN(3, 5, nonlinearity="relu")
        >>> out, h = rnn(torch.randn(7, 3))                  # unbatched (L, H_in)
        >>> out.shape, h.shape
        (torch.Size([7, 5]), torch.Size([1, 5]))
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, nonlinearity: str = "tanh",
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 **options) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
        super().__init__(f"RNN_{nonlinearity.upper()}", input_size, hidden_size, num_layers, bias, batch_first,
                         dropout, bidirectional, **options)
        self.nonlinearity = nonlinearity
