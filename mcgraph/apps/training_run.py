"""What both training paths of ``mcgraph train`` share (the ELBO path in :mod:`.train`, the optimizers'
path in :mod:`.optim_train`): data splits, the network, prediction metrics, progress, logs and checkpoints.

Checkpoints and ``metrics.jsonl`` are written atomically (:mod:`.atomic_io`) and read with
``weights_only=True``. A checkpoint holds everything a resume needs to continue *bitwise* as
the uninterrupted run would (CPU, same thread count): the model, the optimizer (with its
counters), the epoch and step, torch's global generator state and the shuffling generator's
state. A non-finite loss or gradient stops the run (:class:`TrainingDiverged`, naming the
step and the term) before anything is written, or with ``--on-nonfinite skip`` skips the step.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import metrics
from ..engine.checks import all_finite
from ..metrics import prediction_metrics
from . import atomic_io
from .data import load_dataset
from ..models import get_model
from ..models.sequence import is_sequence_model, sequence_model

__all__ = ["StepResult", "mlp", "build_model", "predict_probs", "evaluate", "is_bayesian", "family_options",
           "Progress", "log", "save_checkpoint", "load_splits", "resume_log", "add_checkpoint_arguments",
           "load_resume", "resume_settings", "RUN_CONTROLS", "append_metrics", "TrainingDiverged",
           "TrainingInterrupted", "check_finite", "check_finite_grads", "fault_nonfinite"]


def mlp(num_classes: int, in_features: int, hidden: tuple[int, ...] = (256, 256), *,
        flatten: bool = True) -> nn.Sequential:
    """``Flatten → [Linear → ReLU]* → Linear``: the ``--model mlp`` network (``flatten=False``: without the
    ``Flatten``, for inputs of shape ``(batch, in_features)``, as the benchmarks build their MLPs).

    Example:
        >>> import torch
        >>> mlp(10, 64, (32,))(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
        >>> mlp(10, 64, (32,), flatten=False)
        Sequential(
          (0): Linear(in_features=64, out_features=32, bias=True)
          (1): ReLU()
          (2): Linear(in_features=32, out_features=10, bias=True)
        )
    """
    layers: list[nn.Module] = [nn.Flatten()] if flatten else []
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
    """The network of ``args``: ``mlp`` or a registered model, made Bayesian unless ``--deterministic``.

    ``input_shape``: ``(C, *spatial)``, or ``(steps, features)`` for a sequence model (:func:`load_splits`
    reads the data as sequences for those).
    """
    if args.model == "mlp":
        model = mlp(num_classes, math.prod(input_shape), tuple(args.hidden))
    elif is_sequence_model(args.model):
        model = sequence_model(args.model, *input_shape, num_classes=num_classes)
    else:
        model = get_model(args.model, num_classes=num_classes, in_channels=input_shape[0])
    if args.deterministic:
        return model
    import mcgraph.nn as mnn

    return mnn.bayesify(model, posterior=args.posterior, prior=_prior(args), kl_samples=args.kl_samples,
                        init_from_weights=False, estimator=_estimator(args), rho_init=args.rho_init,
                        scale_transform=args.scale_transform, inplace=True)


def _estimator(args) -> str | None:
    """The layers' ``estimator=`` from ``--flipout`` / ``--local-reparameterization`` (neither: the family's)."""
    if args.flipout:
        return "flipout"
    return "local_reparameterization" if args.local_reparameterization else None


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
    """One epoch's progress: a tqdm bar when stderr is a terminal and tqdm is installed (the ``bench`` extra
    installs it); nothing otherwise, so a log file or a pipe gets only the loop's one line per epoch, never a
    bar's carriage-return redraws.

    A terminal that reports no size (a pseudo-terminal opened without one, as ``script`` or a CI runner
    may give) is drawn 80 columns wide: tqdm would take its 0 × 0 for a screen with no room and draw nothing.
    Use it as a context manager, so that the bar is cleared however the epoch ends (Ctrl-C included).

    Example:
        >>> with Progress(3, "epoch 1/1", enabled=False) as bar:  # --no-progress: never a bar
        ...     bar.update(loss=0.5)
        >>> bar.bar is None
        True
    """

    #: the size drawn on a terminal that reports none (tqdm keeps one column free)
    FALLBACK_SIZE = (80, 24)

    def __init__(self, total: int, desc: str, enabled: bool):
        self.bar = None
        if not (enabled and _isatty(sys.stderr)):
            return
        try:
            from tqdm import tqdm
        except ImportError:  # no bar: the epoch lines are the progress
            return
        try:
            columns, lines = os.get_terminal_size(sys.stderr.fileno())
        except (AttributeError, OSError, ValueError):
            columns, lines = 0, 0
        sized = columns > 0 and lines > 0
        if not sized:
            columns, lines = self.FALLBACK_SIZE
        self.bar = tqdm(total=total, desc=desc, leave=False, file=sys.stderr, ncols=columns - 1, nrows=lines - 1,
                        dynamic_ncols=sized)

    def update(self, **postfix):
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)
            self.bar.update(1)

    def write(self, msg: str) -> None:
        """Log ``msg`` on its own line (above the bar while one is drawn)."""
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
            sys.stderr.flush()
        else:
            log(msg)

    def close(self):
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class StepResult:
    """What one training step reports to the loop: the loss, its data term (negative log-likelihood per
    example), the KL, and the correct predictions of the batch (deterministic training only)."""

    loss: float
    nll: float
    kl: float = 0.0
    correct: int = 0


class TrainingDiverged(RuntimeError):
    """A loss or gradient went non-finite; the message names the step and the term. Nothing was written."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped the run; what had been written is complete (every write is atomic).

    Attributes:
        checkpoint: the last complete checkpoint of the run (``None``: none yet), the one to resume from.
        epochs_done: the epochs that checkpoint holds (``None``: not known).
        doing: what the run was doing (``"in epoch 3 of 5"``, ``"during the final evaluation"``, ...).
    """

    def __init__(self, checkpoint: Path | None, epochs_done: int | None, doing: str):
        self.checkpoint, self.epochs_done, self.doing = checkpoint, epochs_done, doing
        super().__init__(f"interrupted {doing} (last checkpoint: {checkpoint})")


def add_checkpoint_arguments(group) -> None:
    """``--keep-checkpoints``, ``--resume-fallback`` and ``--on-nonfinite`` (both training paths)."""
    group.add_argument("--keep-checkpoints", type=int, default=1,
                       help="keep this many previous checkpoints beside checkpoint.pt (checkpoint.pt.1 newest, "
                            "...; 0: none)")
    group.add_argument("--resume-fallback", action="store_true",
                       help="when the --resume checkpoint cannot be loaded (torn, foreign, another model), fall "
                            "back to its kept previous versions (checkpoint.pt.1, ...)")
    group.add_argument("--on-nonfinite", default="stop", choices=["stop", "skip"],
                       help="a non-finite loss or gradient: stop the run naming the step and the term (data term "
                            "or KL), never writing a checkpoint; or skip that step (no parameter update)")


def _plain(value):
    """``value`` as JSON-able plain data (a checkpoint's ``args`` must load under ``weights_only=True``)."""
    return json.loads(json.dumps(value, default=str))


def save_checkpoint(path: Path, model, optimizer, epoch: int, step: int, args, *, generator=None,
                    keep: int | None = None, **extra) -> None:
    """Atomically write ``path``: model, optimizer, epoch, step, ``args`` (as plain data), torch's global
    generator state, the shuffling ``generator``'s state and ``extra`` entries (tensors and plain data).

    Raises:
        TrainingDiverged: a parameter is not finite (the previous checkpoint is kept).
        atomic_io.AtomicWriteError: the write failed (disk full, permission denied); ``path`` is unchanged.
    """
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise TrainingDiverged(f"step {step}: parameters {bad[:5]} are not finite; the checkpoint {path} was not "
                               "overwritten")
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": int(epoch),
             "step": int(step), "args": _plain(vars(args)), "torch_rng": torch.get_rng_state(),
             "data_rng": None if generator is None else generator.get_state(), **extra}
    if keep is None:
        keep = int(getattr(args, "keep_checkpoints", 1) or 0)
    atomic_io.save_checkpoint(path, state, keep=keep)


#: ``args`` entries whose difference makes a checkpoint belong to another run.
_IDENTITY = ("model", "hidden", "dataset", "deterministic", "posterior", "optimizer", "avb_form", "image_size")

#: The flags a resumed run may set apart from its checkpoint: where it runs (``--threads``, ``--device`` and the
#: ranks' layout), what it shows, keeps and reports after training (``--no-progress``, ``--keep-checkpoints``,
#: ``--checkpoint-every``, ``--resume-fallback``, ``--eval-samples``), what a failure does (``--on-nonfinite``),
#: and how far it goes (``--epochs``, never below the epochs the checkpoint holds). Every other setting shapes
#: the numbers of the steps to come and must agree with the checkpoint.
RUN_CONTROLS = frozenset({"epochs", "threads", "device", "data_parallel", "dist_timeout", "no_progress",
                          "keep_checkpoints", "checkpoint_every", "resume_fallback", "eval_samples", "on_nonfinite"})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def resume_settings(args, given, state: dict, used: Path):
    """The settings of the run ``state`` (a checkpoint read from ``used``) continues, and the flags that change.

    The rule of ``mcgraph train --resume PATH [flags]``:

    * a setting the command line leaves out is the checkpoint's (``--resume PATH`` alone continues the run as it
      was: model, data, posterior, optimizer, ``--lr``, ``--seed``, ``--epochs``, ``--threads``, …);
    * a flag given beside ``--resume`` that agrees with the checkpoint is accepted; one that contradicts it is
      refused by name (``--lr 0.01 contradicts the checkpoint's lr 0.001``), unless it is one of
      :data:`RUN_CONTROLS`;
    * ``--epochs`` may extend the run, never cut it below the epochs the checkpoint holds, and is fixed for
      ``--avb-form sghmc``, whose cyclical learning rate is laid out over the run's epochs;
    * the output folder is the checkpoint's folder (``metrics.jsonl`` and the kept checkpoints live there); an
      ``--out`` must name that folder.

    A checkpoint that carries no settings leaves ``args`` as they are.

    Args:
        args: the parsed command line (``argparse.Namespace``); not modified.
        given: the names (``dest``) of the options the command line gave explicitly.
        state: the checkpoint, as :func:`~mcgraph.apps.atomic_io.load_checkpoint` returns it.
        used: the file it came from.

    Returns:
        ``(settings, changes)``: a new namespace, and one ``"--flag new (checkpoint: old)"`` per run control
        the command line changes.

    Raises:
        atomic_io.CheckpointError: naming the checkpoint and every contradicting flag.

    Example:
        >>> import argparse
        >>> state = {"epoch": 2, "args": {"lr": 0.001, "epochs": 3, "seed": 0, "out": "runs/a"}}
        >>> cli = argparse.Namespace(lr=0.001, epochs=5, seed=0, out=None, resume="runs/a/checkpoint.pt")
        >>> settings, changes = resume_settings(cli, {"lr", "epochs"}, state, Path("runs/a/checkpoint.pt"))
        >>> settings.epochs, settings.out, changes
        (5, 'runs/a', ['--epochs 5 (checkpoint: 3)'])
        >>> resume_settings(cli, {"lr"}, state, Path("runs/a/checkpoint.pt"))[0].epochs
        3
        >>> cli.lr = 0.01
        >>> resume_settings(cli, {"lr"}, state, Path("runs/a/checkpoint.pt"))
        Traceback (most recent call last):
        ...
        mcgraph.apps.atomic_io.CheckpointError: checkpoint runs/a/checkpoint.pt: --lr 0.01 contradicts the \
checkpoint's lr 0.001. Leave it out to continue the run as it was, or start a new run without --resume
    """
    import argparse

    saved = state.get("args")
    if not isinstance(saved, dict):
        return argparse.Namespace(**vars(args)), []
    settings = dict(vars(args))
    folder = Path(used).parent
    conflicts, changes = [], []
    for name, stored in saved.items():
        if name in ("resume", "out") or name not in settings:
            continue
        if name not in given:
            settings[name] = stored
            continue
        value = settings[name]
        if _plain(value) == stored:
            continue
        if name == "epochs" and (int(value) < int(state.get("epoch", 0))):
            conflicts.append(f"--epochs {value} is fewer than the {state.get('epoch')} epochs the checkpoint holds")
        elif name == "epochs" and saved.get("optimizer") == "adaptive-vb" and saved.get("avb_form") == "sghmc":
            conflicts.append(f"--epochs {value} contradicts the checkpoint's epochs {stored} (the cyclical learning "
                             "rate of --avb-form sghmc is laid out over the run's epochs)")
        elif name in RUN_CONTROLS:
            changes.append(f"{_flag(name)} {_shown(value)} (checkpoint: {_shown(stored)})")
        else:
            shown = _flag(name) if value is True else f"{_flag(name)} {_shown(value)}"
            conflicts.append(f"{shown} contradicts the checkpoint's {name} {_shown(stored)}")
    if "out" in given and settings.get("out") is not None and Path(settings["out"]).resolve() != folder.resolve():
        conflicts.append(f"--out {settings['out']} contradicts the checkpoint's run folder {folder} (a resumed run "
                         f"continues in its checkpoint's folder; to branch it, copy {Path(used).name} into "
                         f"{settings['out']} and resume that copy)")
    if conflicts:
        hint = "Leave it out" if len(conflicts) == 1 else "Leave them out"
        raise atomic_io.CheckpointError(used, "; ".join(conflicts) + f". {hint} to continue the run as it was, or "
                                        "start a new run without --resume")
    settings["out"] = str(folder)
    return argparse.Namespace(**settings), changes


def load_resume(args, model, optimizer, device, loaded: tuple[dict, Path] | None = None) -> tuple[dict, Path]:
    """Load ``args.resume`` (``weights_only=True``; with ``--resume-fallback`` its previous versions) into
    ``model`` and ``optimizer`` and restore torch's global generator; returns ``(state, file used)``.

    ``loaded``: ``(state, file)`` already read by :func:`~mcgraph.apps.atomic_io.load_checkpoint` (the command
    line reads the checkpoint once, for its settings and its state); it is checked the same way.

    Raises:
        atomic_io.CheckpointError: naming the file and what is wrong (missing, torn, foreign, another model).
    """
    expected = model.state_dict()

    def validate(state, path):
        saved = state.get("args") or {}
        diff = [f"{k}={saved[k]!r} (this run: {getattr(args, k)!r})" for k in _IDENTITY
                if k in saved and hasattr(args, k) and _plain(getattr(args, k)) != saved[k]]
        if diff:
            raise atomic_io.CheckpointError(path, "belongs to another run: " + ", ".join(diff))
        got = state["model"]
        if not isinstance(got, dict):
            raise atomic_io.CheckpointError(path, "its 'model' entry is not a state_dict")
        missing = sorted(set(expected) - set(got))
        unexpected = sorted(set(got) - set(expected))
        shapes = [f"{k}: {tuple(got[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
                  if k in got and isinstance(v, torch.Tensor) and isinstance(got[k], torch.Tensor)
                  and got[k].shape != v.shape]
        if missing or unexpected or shapes:
            raise atomic_io.CheckpointError(path, "is a checkpoint of another model: " + "; ".join(
                part for part in (f"missing {missing[:5]}" if missing else "",
                                  f"unexpected {unexpected[:5]}" if unexpected else "",
                                  f"shapes differ {shapes[:5]}" if shapes else "") if part))

    if loaded is not None:
        state, used = loaded
        validate(state, used)
    else:
        state, used = atomic_io.load_checkpoint(args.resume, map_location=device,
                                                fallback=bool(getattr(args, "resume_fallback", False)),
                                                validate=validate, warn=log)
    model.load_state_dict(state["model"])
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError, TypeError) as e:
        raise atomic_io.CheckpointError(used, f"its optimizer state does not fit this run's optimizer ({e})") from None
    if state.get("torch_rng") is not None:
        torch.set_rng_state(state["torch_rng"].cpu())
    return state, used


def check_finite(step: int, **terms) -> None:
    """Raise :class:`TrainingDiverged` naming ``step`` and the first term (``data_term=``, ``kl=``, …) whose
    value is not finite. One host sync for all terms."""
    values = [torch.as_tensor(v).detach() for v in terms.values()]
    if all_finite(values):
        return
    for (name, _), v in zip(terms.items(), values):
        if not bool(torch.isfinite(v).all()):
            raise TrainingDiverged(f"step {step}: the {name.replace('_', ' ')} is not finite "
                                   f"({float(v.double().sum())}); nothing was written")


def check_finite_grads(step: int, model) -> list[str]:
    """Names of ``model``'s parameters whose gradient is not finite (empty: all finite; one host sync)."""
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    if all_finite(g for _, g in named):
        return []
    return [n for n, g in named if not bool(torch.isfinite(g).all())]


def fault_nonfinite(step: int) -> str | None:
    """Test hook: ``MCGRAPH_FAULT_NONFINITE=<step>:<data|kl>`` makes that term non-finite at that step."""
    spec = os.environ.get("MCGRAPH_FAULT_NONFINITE")
    if not spec:
        return None
    at, _, term = spec.partition(":")
    return term or "data" if int(at) == step else None


def load_splits(args):
    """``(dataset, (x_train, y_train), (x_test, y_test), (x_eval, y_eval))`` of ``args`` (limits applied;
    the evaluation split is the validation set when the dataset has one, else the test set). A sequence model
    (``lstm``, ``transformer``) gets the inputs as sequences ``(N, T, F)``: images read row by row."""
    image_size = args.image_size
    if image_size is None and args.model == "lenet5" and args.dataset in ("digits",):
        image_size = 28
    ds = load_dataset(args.dataset, seed=args.seed, image_size=image_size, sequence=is_sequence_model(args.model))
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


def resume_log(args, out: Path, start_epoch: int, n_train: int, write: bool = True, data_rng=None):
    """``(shuffling generator, history rows, metrics.jsonl path)`` for a run starting at ``start_epoch``.

    The generator has drawn the shuffles of the epochs already done (``data_rng``, a checkpoint's saved
    state, or a replay of those shuffles); after a resume the log keeps only their rows (rewritten
    atomically).
    """
    gen = torch.Generator().manual_seed(args.seed)
    if data_rng is not None:
        gen.set_state(data_rng)
    else:
        for _ in range(start_epoch):  # the same shuffles after a resume
            torch.randperm(n_train, generator=gen)
    history = []
    log_path = out / "metrics.jsonl"
    if args.resume and log_path.is_file():  # keep the epochs already done
        rows = []
        for line in log_path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a torn line of a log written by an older version
                continue
        history = [r for r in rows if r.get("epoch", 0) <= start_epoch]
        if write:
            append_metrics(log_path, history)
    return gen, history, log_path


def append_metrics(log_path: Path, history: list[dict]) -> None:
    """Atomically write ``metrics.jsonl``: one JSON row per entry of ``history``."""
    atomic_io.write_text(log_path, "".join(json.dumps(r) + "\n" for r in history))
