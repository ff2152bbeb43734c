"""MC dropout (Gal & Ghahramani, 2016): a network's dropout kept on at prediction time.

:func:`mc_dropout` turns a deterministic network trained with dropout into a model whose every
forward draws fresh dropout masks, in training and evaluation mode alike, so that
:func:`mcgraph.nn.predict`, :func:`mcgraph.nn.forward_samples` and :mod:`mcgraph.metrics` treat it
as they treat a Bayesian network: the predictive is

.. math::
    p(y \\mid x) \\approx \\frac1M \\sum_{i=1}^M \\mathrm{softmax}\\big(f(x; W \\circ z_i)\\big),
    \\qquad z_i \\sim \\text{Bernoulli masks of rate } p .

Inside a sample run the masks are seeded like a Bayesian layer's noise: sample ``i`` uses row ``i``
of the module's own stream, so a ``seed`` reproduces the prediction for any chunk size. Outside a
run (a plain ``model(x)``) they come from torch's global generator.

Recurrent layers: the dropout that ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` apply between stacked
layers (their ``dropout=`` argument, training mode only in torch) is kept on too: such a module
becomes an :class:`MCDropoutRNN` holding the very same Parameters, which runs torch's fused
kernel layer by layer and draws one ``(L, N, H)`` mask per layer boundary and Monte Carlo sample
(torch draws one per forward; a sample here is one forward of the sequence, never a mask per time
step). The Bayesian recurrent layers (:class:`~mcgraph.nn.BayesLSTM`, …) keep their own dropout
on (``mc_dropout = True``).

Example:
    >>> import torch, mcgraph as mg
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
    ...                           torch.nn.Linear(32, 3))
    >>> mc = mg.nn.mc_dropout(net)                       # a copy; dropout stays active in eval mode
    >>> probs = mg.nn.predict(mc, torch.randn(5, 4), num_samples=100, seed=0)
    >>> probs.shape
    torch.Size([5, 3])
"""

from __future__ import annotations

import copy
import numbers

import torch
from torch import nn

from .context import NoiseKind, current_window
from .recurrent import FusedRNNBase

__all__ = ["MCDropout", "MCDropoutRNN", "mc_dropout"]

_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)


def _check_p(p) -> float:
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= float(p) < 1.0:
        raise ValueError(f"p must be a real number in [0, 1), got {p!r}")
    return float(p)


class MCDropout(nn.Module):
    """Dropout that is always on (also in ``eval()``), seeded by mcgraph's sample runs.

    Args:
        p: the dropout rate in [0, 1); kept units are scaled by 1/(1 − p).
        channelwise: drop whole channels (``nn.Dropout1d/2d/3d``): one mask value per
            (example, channel), shared over the spatial positions; else every element.

    Shape:
        Input ``(N, *)`` (channelwise: ``(N, C, *spatial)``); output: the same.
    """

    #: A module whose forward draws per-sample noise: sample runs give it a seeded stream.
    draws_run_noise = True

    def __init__(self, p: float = 0.5, channelwise: bool = False) -> None:
        super().__init__()
        self.p = _check_p(p)
        self.channelwise = bool(channelwise)

    def _mask_shape(self, x: torch.Tensor, rows: int) -> tuple:
        if self.channelwise:
            if x.dim() < 2:
                raise ValueError(f"x: channelwise dropout needs an input (N, C, ...), got shape {tuple(x.shape)}")
            return (rows, x.shape[1]) + (1,) * (x.dim() - 2)
        return (rows,) + tuple(x.shape[1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0:
            return x
        keep = 1.0 - self.p
        win = current_window()
        if win is None:
            mask = (torch.rand(self._mask_shape(x, x.shape[0]), device=x.device) < keep).to(x.dtype)
            return x * mask / keep
        S = win.size
        if x.shape[0] % S:
            raise ValueError(f"x: inside a window of {S} samples the batch dimension must be a multiple of {S}, "
                             f"got shape {tuple(x.shape)}")
        rows = x.shape[0] // S
        shape = self._mask_shape(x, rows)
        dtype, device = x.dtype, x.device

        def draw(n):
            return (torch.rand((n,) + shape, device=device) < keep).to(dtype)

        mask = win.run.raw_rows(self, NoiseKind.DROPOUT, draw, shape, dtype, device, win.start, win.stop)
        return x * mask.reshape((S * rows,) + shape[1:]) / keep

    def extra_repr(self) -> str:
        return f"p={self.p}" + (", channelwise=True" if self.channelwise else "")


class MCDropoutRNN(FusedRNNBase):
    """A torch ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` whose dropout between layers is always on (also in ``eval()``).

    The module's Parameters are registered under torch's names (``weight_ih_l0``, …): the same
    objects, so the ``state_dict`` keys and values are the torch module's. Every forward runs
    torch's fused kernel one layer at a time on those weights and multiplies the output of every
    layer but the last by a mask ``z / (1 − p)``, ``z ~ Bernoulli(1 − p)`` per element of the
    ``(L, N, H)`` output: one mask per sequence batch and Monte Carlo sample, seeded per sample
    inside a sample run (the global generator outside one).

    Args:
        module: an ``nn.LSTM``, ``nn.GRU`` or ``nn.RNN`` with ``num_layers > 1``.
        p: the rate (default: ``module.dropout``), in [0, 1).

    Shape:
        As the torch module: ``forward(input, hx=None)`` with its input forms and return values.

    Example:
        >>> import torch, mcgraph as mg
        >>> lstm = torch.nn.LSTM(3, 8, num_layers=2, dropout=0.3, batch_first=True)
        >>> mc = mg.nn.MCDropoutRNN(lstm).eval()
        >>> mc.weight_ih_l0 is lstm.weight_ih_l0
        True
        >>> x = torch.randn(2, 5, 3)
        >>> torch.equal(mc(x)[0], mc(x)[0])             # a new mask at every forward, in eval mode too
        False
    """

    def __init__(self, module: nn.RNNBase, p: float | None = None) -> None:
        if not isinstance(module, (nn.LSTM, nn.GRU, nn.RNN)):
            raise TypeError(f"module must be an nn.LSTM, nn.GRU or nn.RNN, got {type(module).__name__}")
        if module.num_layers < 2:
            raise ValueError(f"module: dropout acts between stacked layers, so num_layers must be at least 2, "
                             f"got {module.num_layers}")
        rate = _check_p(module.dropout if p is None else p)
        mode = module.mode if not isinstance(module, nn.RNN) else f"RNN_{module.nonlinearity.upper()}"
        super().__init__(mode, module.input_size, module.hidden_size, module.num_layers, module.bias,
                         module.batch_first, rate, module.bidirectional, getattr(module, "proj_size", 0))
        if isinstance(module, nn.RNN):
            self.nonlinearity = module.nonlinearity
        self._flat_weights_names = list(module._flat_weights_names)
        for name in self._flat_weights_names:
            self.register_parameter(name, getattr(module, name))
        self.mc_dropout = True

    @property
    def p(self) -> float:
        """The dropout rate (torch's ``dropout``)."""
        return self.dropout

    @property
    def _weight_dtype(self) -> torch.dtype:
        return getattr(self, self._flat_weights_names[0]).dtype

    def _weights(self):
        weights = [getattr(self, name) for name in self._flat_weights_names]
        return (lambda s: weights), False


def _is_recurrent_dropout(module: nn.Module) -> bool:
    return isinstance(module, (nn.LSTM, nn.GRU, nn.RNN)) and module.dropout > 0 and module.num_layers > 1


def mc_dropout(model: nn.Module, *, p: float | None = None, inplace: bool = False) -> nn.Module:
    """The MC-dropout model of ``model``: every ``nn.Dropout`` / ``Dropout{1,2,3}d`` replaced by :class:`MCDropout`.

    Recurrent modules with dropout between layers (``nn.LSTM(..., num_layers > 1, dropout > 0)``,
    likewise ``nn.GRU`` / ``nn.RNN``) become :class:`MCDropoutRNN` holding the same Parameters; the
    Bayesian recurrent layers keep their dropout on (``mc_dropout = True``).

    The returned model is in ``eval()`` mode (BatchNorm uses its running statistics) and its
    dropout stays active; predict with :func:`mcgraph.nn.predict` (``num_samples`` masks).

    Args:
        model: a deterministic network containing dropout modules (trained with them).
        p: a rate for every dropout module (default: each module's own ``p``).
        inplace: convert ``model`` itself; by default a deep copy (sharing nothing with ``model``).

    Returns:
        The MC-dropout model.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` has no dropout module (nor recurrent dropout), or ``p`` is not in [0, 1).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if p is not None:
        p = _check_p(p)
    if not any(isinstance(m, (*_DROPOUT, MCDropout)) or _is_recurrent_dropout(m)
               or (isinstance(m, FusedRNNBase) and m.draws_run_noise) for m in model.modules()):
        raise ValueError("model: has no dropout module (nn.Dropout, nn.Dropout1d/2d/3d, nor an nn.LSTM/GRU/RNN "
                         "with dropout between layers) to keep active; train the network with dropout first")
    if not inplace:
        model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _DROPOUT):
                rate = child.p if p is None else p
                setattr(parent, name, MCDropout(rate, channelwise=not type(child) is nn.Dropout))
            elif isinstance(child, MCDropout) and p is not None:
                child.p = p
            elif _is_recurrent_dropout(child):
                setattr(parent, name, MCDropoutRNN(child, p))
    for module in model.modules():
        if isinstance(module, FusedRNNBase) and module.draws_run_noise:
            module.mc_dropout = True
            if p is not None:
                module.dropout = p
    return model.eval()
