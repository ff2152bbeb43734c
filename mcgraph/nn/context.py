"""Seeded, functional noise for Bayesian layers: sample runs and chunk windows.

A Bayesian layer never keeps noise in a buffer. Each forward draws fresh noise:

* **outside a run** (a plain ``model(x)`` call): from torch's global generator, one
  weight sample per forward, so ``torch.manual_seed`` reproduces it;
* **inside a run** (:func:`sample_run`, used by :func:`~mcgraph.nn.elbo`,
  :func:`~mcgraph.nn.predict` and :func:`~mcgraph.nn.forward_samples`): sample ``i``
  of Bayesian layer ``l`` and noise kind ``k`` is row ``i`` of a seeded block stream
  (:class:`mcgraph.engine.noise.streams.BlockStream`, blocks of :func:`block_rows` samples) whose
  seed is ``mix(mix(seed, l), k)``.
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

from ..engine.plan.families import GenericForm, SamplingForm
from ..engine.noise.streams import BlockStream, mix_seed, resolve_seed
from ..engine.options import Sampling, resolve_sampling

__all__ = ["BayesianModule", "NoiseKind", "SampleRun", "Window", "Capture", "sample_run", "window", "current_window", "capture",
           "current_capture", "bayesian_modules", "block_rows", "noise_stream", "chunks", "user_shape"]


class NoiseKind:
    """Stream identifiers of the noise a layer draws (mixed into the stream seed)."""

    WEIGHT = 0  #: weight noise ξ (shape of the weight, the posterior's noise law)
    BIAS = 1  #: bias noise (Bayesian bias only)
    OUTPUT = 2  #: standard-normal noise on the pre-activation (local reparameterization)
    SIGN_IN = 3  #: Rademacher signs on the input channels (flipout)
    SIGN_OUT = 4  #: Rademacher signs on the output channels (flipout)
    DROPOUT = 5  #: dropout masks of a module that draws per-sample noise (MC dropout)


class BayesianModule(nn.Module):
    """Base of every module whose weights carry a posterior (:class:`~mcgraph.nn.BayesLayer` and its
    kind): what :func:`bayesian_modules` collects, and what a sample run gives noise streams to."""


def bayesian_modules(model: nn.Module) -> list[nn.Module]:
    """The Bayesian layers of ``model`` in ``model.modules()`` order (``model`` itself included)."""
    return [m for m in model.modules() if isinstance(m, BayesianModule)]


#: Noise elements per stream block (4 MiB in float32): the most one layer's stream holds beyond its chunk.
BLOCK_ELEMENTS = 1 << 20


def block_rows(sample_numel: int, num_samples: int) -> int:
    """Samples per block of a layer's noise stream (a function of the sample size and M, never of the chunk)."""
    return max(1, min(num_samples, BLOCK_ELEMENTS // max(1, sample_numel)))


def noise_stream(draw: Callable[[int], torch.Tensor], shape, seed: int, num_samples: int,
                 device: torch.device) -> BlockStream:
    """The seeded stream of rows ``draw(n) -> (n, *shape)`` (global generator, forked and reseeded per block)."""
    numel = max(1, int(torch.Size(shape).numel()))
    return BlockStream(draw, num_samples, block_rows(numel, num_samples), seed, device)


def normal_draw(shape, dtype: torch.dtype, device: torch.device) -> Callable[[int], torch.Tensor]:
    """``draw(n)``: n standard-normal rows of ``shape``."""
    shape = tuple(shape)

    def draw(n):
        return torch.randn((n,) + shape, dtype=dtype, device=device)

    return draw


@dataclass(eq=False)
class SampleRun:
    """The noise of ``num_samples`` whole-network samples of one model under one seed.

    Streams are drawn by torch's generator (forked, reseeded per block of
    :func:`block_rows` samples) on the layer's device, whatever backend the engine uses
    for its own estimates; each stream keeps at most one block.

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
        """Rows ``start … stop-1`` of ``layer``'s stream for ``form``: ξ (sampling form) or w (generic form)."""
        seed = self.layer_seed(layer, kind)
        if isinstance(form, GenericForm):  # rsample rows carry this call's graph: never cached
            shape = form.shape
            return noise_stream(form.draw, shape, seed, self.num_samples, form.device).rows(start, stop)
        law, shape, dtype, device = form.noise, tuple(form.noise_shape), form.dtype, form.device

        def draw(n):
            return law.sample((n,) + shape, dtype, device)

        return self._rows((seed, "form", shape, dtype, device), draw, shape, seed, device, start, stop)

    def raw_rows(self, layer: nn.Module, kind: int, draw: Callable[[int], torch.Tensor], shape,
                 dtype: torch.dtype, device: torch.device, start: int, stop: int) -> torch.Tensor:
        """Rows of ``layer``'s stream drawn by ``draw(n) -> (n, *shape)`` (activation noise, signs)."""
        seed = self.layer_seed(layer, kind)
        return self._rows((seed, "raw", tuple(shape), dtype, device), draw, shape, seed, device, start, stop)

    def _rows(self, key, draw, shape, seed, device, start, stop):
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = noise_stream(draw, shape, seed, self.num_samples, device)
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


def sample_run(model: nn.Module, num_samples: int | Sampling, seed: int | None = None) -> SampleRun:
    """A :class:`SampleRun` for ``model``: M samples of every Bayesian layer under ``seed``.

    Args:
        model: the network; its Bayesian layers are numbered in ``model.modules()`` order.
        num_samples: M ≥ 1, or a :class:`~mcgraph.Sampling` with M and ``seed``.
        seed: non-negative int, or ``None`` to draw one from torch's global generator.

    Example:
        >>> import torch, mcgraph as mg
        >>> from mcgraph.nn.context import sample_run, window
        >>> layer = mg.nn.BayesLinear(4, 2)
        >>> run = sample_run(layer, num_samples=8, seed=0)
        >>> with window(run, 2, 5):                   # samples 2, 3, 4: the batch repeated 3 times
        ...     out = layer(torch.ones(1, 4).repeat(3, 1))
        >>> torch.allclose(out, mg.nn.forward_samples(layer, torch.ones(1, 4), 8, seed=0)[2:5, 0])
        True
    """
    num_samples, o = resolve_sampling(num_samples, seed=(seed, None))
    seed = o["seed"]
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    seed = resolve_seed(seed)
    index = {id(m): i for i, m in enumerate(bayesian_modules(model))}
    for m in model.modules():  # other per-sample noise (MC dropout) is numbered after the Bayesian layers
        if getattr(m, "draws_run_noise", False) and id(m) not in index:
            index[id(m)] = len(index)
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


def user_shape(t: torch.Tensor, batch_dim: int | None = 0) -> tuple:
    """``t``'s shape as the caller passed it, for error messages: inside a window of S samples the batch
    dimension holds the batch repeated S times, so it is shown divided by S."""
    shape = list(t.shape)
    win = current_window()
    if (win is not None and win.size > 1 and batch_dim is not None and -t.dim() <= batch_dim < t.dim()
            and shape[batch_dim] % win.size == 0):
        shape[batch_dim] //= win.size
    return tuple(shape)


def chunks(num_samples: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` windows covering ``[0, num_samples)``."""
    for start in range(0, num_samples, chunk_size):
        yield start, min(start + chunk_size, num_samples)


def rademacher(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """±1 with equal probability (global generator)."""
    return torch.randint(0, 2, tuple(shape), device=device).to(dtype) * 2 - 1


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
