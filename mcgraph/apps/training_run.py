"""What both training paths of ``mcgraph train`` share (the ELBO path in :mod:`.train`, the optimizers'
path in :mod:`.optim_train`): data splits, the network, prediction metrics, progress, logs and checkpoints."""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import torch
from torch import nn

from .. import metrics
from ..metrics import prediction_metrics
from .data import load_dataset
from ..models import get_model

__all__ = ["mlp", "build_model", "predict_probs", "evaluate", "is_bayesian", "family_options", "Progress", "log", "save_checkpoint",
           "load_splits", "resume_log"]


def mlp(num_classes: int, in_features: int, hidden: tuple[int, ...] = (256, 256)) -> nn.Sequential:
    """``Flatten → [Linear → ReLU]* → Linear``: the ``--model mlp`` network.

    Example:
        >>> import torch
        >>> mlp(10, 64, (32,))(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def _prior(args):
    if args.prior_scale is None:
        return args.prior  # None: the posterior family's default prior
    import mcgraph.nn as mnn

    if (args.prior or "normal") not in ("normal", "laplace", "student_t", "horseshoe"):
        raise ValueError(f"--prior-scale applies to normal, laplace, student_t and horseshoe priors, not {args.prior!r}")
    return functools.partial(mnn.PRIORS[args.prior or "normal"], scale=args.prior_scale)


def build_model(args, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The network of ``args``: ``mlp`` or a registered model, made Bayesian unless ``--deterministic``."""
    if args.model == "mlp":
        model = mlp(num_classes, math.prod(input_shape), tuple(args.hidden))
    else:
        model = get_model(args.model, num_classes=num_classes, in_channels=input_shape[0])
    if args.deterministic:
        return model
    import mcgraph.nn as mnn

    return mnn.bayesify(model, posterior=args.posterior, prior=_prior(args), kl_samples=args.kl_samples,
                        init_from_weights=False, local_reparameterization=args.local_reparameterization or None,
                        flipout=args.flipout, rho_init=args.rho_init,
                        scale_transform=args.scale_transform, inplace=True)


def family_options(posterior):
    """The layer options a posterior family implies (``prior``, …) when the command line leaves them out."""
    from ..nn.priors import layer_options

    return layer_options(posterior)


def is_bayesian(model: nn.Module) -> bool:
    import mcgraph.nn as mnn

    return bool(mnn.bayesian_modules(model))


@torch.no_grad()


def predict_probs(model: nn.Module, x: torch.Tensor, num_samples: int, batch_size: int, device,
                  process_group=None) -> torch.Tensor:
    """Predictive probabilities of ``x`` (``num_samples`` weight samples; softmax of a deterministic model).

    ``process_group``: the ranks (each holding all of ``x``) split the samples.
    """
    import mcgraph.nn as mnn

    model.eval()
    bayes = is_bayesian(model)
    out = []
    for start in range(0, x.shape[0], batch_size):
        xb = x[start:start + batch_size].to(device)
        if bayes:
            out.append(mnn.predict(model, xb, num_samples, process_group=process_group).cpu())
        else:
            out.append(torch.softmax(model(xb), -1).cpu())
    return torch.cat(out)


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_samples: int, batch_size: int,
             device, process_group=None) -> dict:
    """Accuracy, NLL, ECE (15 bins), Brier score and mean predictive entropy on ``(x, y)``."""
    probs = predict_probs(model, x, num_samples, batch_size, device, process_group)
    out = prediction_metrics(probs, y)
    out["num_samples"] = num_samples if is_bayesian(model) else 1
    if is_bayesian(model):
        import mcgraph.nn as mnn

        with mnn.frozen(model):
            mean_probs = predict_probs(model, x, 1, batch_size, device)
        out["accuracy_mean_weights"] = float(metrics.accuracy(mean_probs, y))
    return out


class Progress:
    """A tqdm bar on a terminal when tqdm is installed; nothing otherwise (logs get one line per epoch,
    never a bar's carriage-return redraws)."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self.bar = None

    def update(self, **postfix):
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def save_checkpoint(path: Path, model, optimizer, epoch: int, step: int, args) -> None:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step,
                "args": vars(args)}, path)


def load_splits(args):
    """``(dataset, (x_train, y_train), (x_test, y_test), (x_eval, y_eval))`` of ``args`` (limits applied;
    the evaluation split is the validation set when the dataset has one, else the test set)."""
    image_size = args.image_size
    if image_size is None and args.model == "lenet5" and args.dataset in ("digits",):
        image_size = 28
    ds = load_dataset(args.dataset, seed=args.seed, image_size=image_size)
    x_train, y_train = ds.x_train, ds.y_train
    if args.limit_train:
        x_train, y_train = x_train[:args.limit_train], y_train[:args.limit_train]
    x_test, y_test = ds.x_test, ds.y_test
    if args.limit_test:
        x_test, y_test = x_test[:args.limit_test], y_test[:args.limit_test]
    x_eval, y_eval = (ds.x_val, ds.y_val) if ds.x_val is not None else (x_test, y_test)
    if args.limit_test and x_eval is not None:
        x_eval, y_eval = x_eval[:args.limit_test], y_eval[:args.limit_test]
    return ds, (x_train, y_train), (x_test, y_test), (x_eval, y_eval)


def resume_log(args, out: Path, start_epoch: int, n_train: int, write: bool = True):
    """``(shuffling generator, history rows, metrics.jsonl path)`` for a run starting at ``start_epoch``.

    The generator has drawn the shuffles of the epochs already done; after a resume the log
    keeps only their rows.
    """
    gen = torch.Generator().manual_seed(args.seed)
    for _ in range(start_epoch):  # the same shuffles after a resume
        torch.randperm(n_train, generator=gen)
    history = []
    log_path = out / "metrics.jsonl"
    if args.resume and log_path.is_file():  # keep the epochs already done
        rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
        history = [r for r in rows if r.get("epoch", 0) <= start_epoch]
        if write:
            log_path.write_text("".join(json.dumps(r) + "\n" for r in history))
    return gen, history, log_path
