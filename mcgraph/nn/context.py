"""Seeded, functional noise for Bayesian layers: sample runs and chunk windows.

A Bayesian layer never keeps noise in a buffer. Each forward draws fresh noise:

* **outside a run** (a plain ``model(x)`` call): from torch's global generator, one
  weight sample per forward, so ``torch.manual_seed`` reproduces it;
* **inside a run** (:func:`sample_run`, used by :func:`~mcgraph.nn.elbo`,
  :func:`~mcgraph.nn.predict` and :func:`~mcgraph.nn.forward_samples`): sample ``i``
  of Bayesian layer ``l`` and noise kind ``k`` is row ``i`` of a seeded block stream
  (:class:`mcgraph.noise.BlockStream`) whose seed is ``mix(mix(seed, l), k)``.
  The rows do not depend on how the ``M`` samples are cut into chunks, so a chunked
  estimate consumes exactly the noise of the naive all-in-one-graph estimate.

Inside a window ``[start, stop)`` of ``S = stop - start`` samples the network's
input batch is repeated ``S`` times along dim 0 (rows ``s·B … (s+1)·B − 1`` belong
to sample ``start + s``) and every Bayesian layer applies its own ``S`` weight
samples to its own row blocks.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from ..estimators.sampling import stream_for
from ..families import GenericForm, SamplingForm
from ..noise import BlockStream, mix_seed, resolve_seed, rows_per_block

__all__ = ["NoiseKind", "SampleRun", "sample_run", "window", "current_window", "bayesian_modules"]


class NoiseKind:
    """Stream identifiers of the noise a layer draws (mixed into the stream seed)."""

    WEIGHT = 0  #: weight noise ξ (shape of the weight, the posterior's noise law)
    BIAS = 1  #: bias noise (Bayesian bias only)
    OUTPUT = 2  #: standard-normal noise on the pre-activation (local reparameterization)
    SIGN_IN = 3  #: Rademacher signs on the input channels (flipout)
    SIGN_OUT = 4  #: Rademacher signs on the output channels (flipout)


def bayesian_modules(model: nn.Module) -> list[nn.Module]:
    """The Bayesian layers of ``model`` in ``model.modules()`` order (``model`` itself included)."""
    from .layers import BayesLayer

    return [m for m in model.modules() if isinstance(m, BayesLayer)]


@dataclass(eq=False)
class SampleRun:
    """The noise of ``num_samples`` whole-network samples of one model under one seed.

    Attributes:
        seed: the run's seed.
        num_samples: M, the length of every stream.
        index: ``id(layer) -> l``, the position of each Bayesian layer in ``model.modules()``.
    """

    seed: int
    num_samples: int
    index: dict
    _streams: dict = field(default_factory=dict, repr=False)

    def layer_seed(self, layer: nn.Module, kind: int) -> int:
        """The seed of ``layer``'s stream of noise ``kind``."""
        try:
            position = self.index[id(layer)]
        except KeyError:
            raise RuntimeError(
                f"{type(layer).__name__} is not a module of the model this sample run was started for; "
                "call it through that model (or outside the run)") from None
        return mix_seed(mix_seed(self.seed, position), kind)

    def form_rows(self, layer: nn.Module, kind: int, form, start: int, stop: int) -> torch.Tensor:
        """Rows ``start … stop-1`` of the stream of ``form`` (ξ for a sampling form, w for a generic one)."""
        seed = self.layer_seed(layer, kind)
        if isinstance(form, GenericForm):  # rows carry the rsample graph of this call: never cached
            return stream_for(form, seed, self.num_samples).rows(start, stop)
        key = (seed, tuple(form.noise_shape), form.dtype, form.device)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = stream_for(form, seed, self.num_samples)
        return stream.rows(start, stop)

    def raw_rows(self, layer: nn.Module, kind: int, draw: Callable[[int], torch.Tensor], shape,
                 dtype: torch.dtype, device: torch.device, start: int, stop: int) -> torch.Tensor:
        """Rows of a stream drawn by ``draw(n) -> (n, *shape)`` (activation noise, signs)."""
        seed = self.layer_seed(layer, kind)
        key = (seed, tuple(shape), dtype, device)
        stream = self._streams.get(key)
        if stream is None:
            numel = max(1, int(torch.Size(shape).numel()))
            stream = self._streams[key] = BlockStream(draw, self.num_samples,
                                                      rows_per_block(numel, self.num_samples), seed, device)
        return stream.rows(start, stop)


@dataclass(frozen=True, eq=False)
class Window:
    """Samples ``start … stop-1`` of ``run`` are being evaluated (the batch is repeated ``size`` times)."""

    run: SampleRun
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


_WINDOW: contextvars.ContextVar[Window | None] = contextvars.ContextVar("mcgraph_nn_window", default=None)


def current_window() -> Window | None:
    """The active sample window, or ``None`` outside :func:`window`."""
    return _WINDOW.get()


def sample_run(model: nn.Module, num_samples: int, seed: int | None = None) -> SampleRun:
    """A :class:`SampleRun` for ``model``: M samples of every Bayesian layer under ``seed``.

    Args:
        model: the network; its Bayesian layers are numbered in ``model.modules()`` order.
        num_samples: M ≥ 1.
        seed: non-negative int, or ``None`` to draw one from torch's global generator.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    seed = resolve_seed(seed)
    index = {id(m): i for i, m in enumerate(bayesian_modules(model))}
    return SampleRun(seed, num_samples, index)


@contextlib.contextmanager
def window(run: SampleRun, start: int, stop: int) -> Iterator[Window]:
    """Evaluate samples ``start … stop-1`` of ``run`` (the caller repeats the batch ``stop - start`` times)."""
    if not 0 <= start < stop <= run.num_samples:
        raise ValueError(f"window [{start}, {stop}) is not inside [0, {run.num_samples})")
    token = _WINDOW.set(Window(run, start, stop))
    try:
        yield _WINDOW.get()
    finally:
        _WINDOW.reset(token)


@contextlib.contextmanager
def outside_window() -> Iterator[None]:
    """Suspend the active window (layers draw from the global generator again)."""
    token = _WINDOW.set(None)
    try:
        yield
    finally:
        _WINDOW.reset(token)


def chunks(num_samples: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` windows covering ``[0, num_samples)``."""
    for start in range(0, num_samples, chunk_size):
        yield start, min(start + chunk_size, num_samples)


def rademacher(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """±1 with equal probability (global generator)."""
    return torch.randint(0, 2, tuple(shape), device=device).to(dtype).mul_(2).sub_(1)


def form_noise_global(form) -> torch.Tensor:
    """One row (shape ``(1, *noise_shape)``) of ``form``'s noise from the global generator."""
    if isinstance(form, SamplingForm):
        return form.draw_noise(1)
    return form.draw(1)


@dataclass(eq=False)
class Capture:
    """Records what one Bayesian layer sees during a forward (see :func:`capture`).

    ``kind="input"``: the layer stores its input and returns its mean-weight output;
    ``kind="moments"``: it stores the Gaussian pre-activation moments (m, s²) and returns m.
    """

    layer: nn.Module
    kind: str
    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    variance: torch.Tensor | None = None
    calls: int = 0


_CAPTURE: contextvars.ContextVar[Capture | None] = contextvars.ContextVar("mcgraph_nn_capture", default=None)


def current_capture() -> Capture | None:
    return _CAPTURE.get()


@contextlib.contextmanager
def capture(layer: nn.Module, kind: str) -> Iterator[Capture]:
    """Within the block, ``layer``'s forward records its input (or moments) instead of sampling."""
    if kind not in ("input", "moments"):
        raise ValueError(f"kind must be 'input' or 'moments', got {kind!r}")
    token = _CAPTURE.set(Capture(layer, kind))
    try:
        yield _CAPTURE.get()
    finally:
        _CAPTURE.reset(token)
