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

__all__ = ["MCDropout", "mc_dropout"]

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


def mc_dropout(model: nn.Module, *, p: float | None = None, inplace: bool = False) -> nn.Module:
    """The MC-dropout model of ``model``: every ``nn.Dropout`` / ``Dropout{1,2,3}d`` replaced by :class:`MCDropout`.

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
        ValueError: ``model`` has no dropout module, or ``p`` is not in [0, 1).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if p is not None:
        p = _check_p(p)
    if not any(isinstance(m, _DROPOUT) or isinstance(m, MCDropout) for m in model.modules()):
        raise ValueError("model: has no dropout module (nn.Dropout, nn.Dropout1d/2d/3d) to keep active; "
                         "train the network with dropout first")
    if not inplace:
        model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _DROPOUT):
                rate = child.p if p is None else p
                setattr(parent, name, MCDropout(rate, channelwise=not type(child) is nn.Dropout))
            elif isinstance(child, MCDropout) and p is not None:
                child.p = p
    return model.eval()
