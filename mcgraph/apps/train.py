"""``python -m mcgraph train``: train a Bayesian (or deterministic) network on a packaged dataset.

Example::

    python -m mcgraph train --model lenet5 --dataset mnist --posterior radial --prior normal \\
        --kl-samples 1000 --epochs 10 --out runs/lenet5-radial

The network is a model of :mod:`mcgraph.models` (or ``mlp``) made Bayesian by
:func:`mcgraph.nn.bayesify`; each step minimises ``-mg.nn.elbo`` (``--train-samples``
whole-network samples of the data term, ``--kl-samples`` samples of the KL through
the engine, KL / N weighted by ``--kl-schedule``). ``--deterministic`` trains the same
network with cross-entropy, for comparison. The sequence models (``--model lstm`` or
``transformer``, :mod:`mcgraph.models.sequence`) read the dataset as sequences ``(N, T, F)``:
the digits as 8 rows of 8 pixels, MNIST as 28 rows of 28, MNIST-1D as 40 steps of one value::

    python -m mcgraph train --model lstm --dataset digits --posterior normal --kl-samples 16 --epochs 5

Output, under ``--out``: ``checkpoint.pt`` (model, optimizer, epoch, step, generator states, the
run's settings; ``--resume`` continues from it), ``metrics.jsonl`` (one row per epoch), and the final
``summary.json`` and ``summary.md`` (accuracy, NLL, ECE, Brier on the test set from
``--eval-samples`` predictive samples, timings, configuration). Progress: a tqdm bar per epoch on a
terminal, one plain line per epoch into a file or a pipe (and without tqdm).

**Stop and resume.** Ctrl-C (SIGINT) stops the run with exit status 130 and one line naming the last
checkpoint and the command that resumes it, ``mcgraph train --resume PATH``. ``--resume PATH`` alone
continues the run with the checkpoint's settings (:func:`~mcgraph.apps.training_run.resume_settings`) in
the checkpoint's folder; a flag given beside it that contradicts the checkpoint is refused by name, except
the run controls (:data:`~mcgraph.apps.training_run.RUN_CONTROLS`: more ``--epochs``, ``--threads``, …).

**Crash safety.** Every file is written atomically (a temporary file, ``fsync``,
``os.replace``): a run killed at any moment leaves the previous complete checkpoint, and
``--keep-checkpoints K`` (default 1) keeps K older ones as ``checkpoint.pt.1`` … A resume
reads with ``weights_only=True`` (a checkpoint carrying anything but tensors and plain data
is refused, not run), names the file and the fault of one it cannot use, and with
``--resume-fallback`` goes back to the kept previous checkpoints. A resumed run ends with
the same parameters, bit for bit, as the uninterrupted run (CPU, same ``--threads``). A
non-finite loss or gradient stops the run naming the step and the term (data term or KL)
without writing anything (exit status 3), or is skipped with ``--on-nonfinite skip``.

**Many processes.** Under ``torchrun --nproc-per-node R python -m mcgraph train ...``
the R ranks form ``--data-parallel D`` data groups of ``S = R / D`` ranks. The ranks of
a sample group hold the same shard of each batch (batch rows ``d::D`` for data group
``d``) and split the data term's ``--train-samples`` by index; every rank splits every
layer's KL samples over all R ranks; ``DistributedDataParallel`` averages the gradients
over the D data shards (the KL, whole on every rank, is counted once). With ``D = 1``
the run follows the one-process run's parameters up to float rounding. Rank 0 alone
writes checkpoints, metrics and the summary; ``--resume`` works on any number of ranks.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import atomic_io, launch
from ..metrics import prediction_metrics
from .data import DATASETS
from ..models import MODELS
from .training_run import (Progress, TrainingDiverged, TrainingInterrupted, add_checkpoint_arguments, append_metrics,
                           build_model, evaluate, load_resume, load_splits, log, mlp, resume_log, resume_settings,
                           save_checkpoint)

__all__ = ["main", "build_parser", "parse_args", "build_model", "mlp", "evaluate", "prediction_metrics", "load_splits",
           "train", "interrupted_line", "TrainingInterrupted"]


class _HelpFormatter(argparse.HelpFormatter):
    """Adds "(default: X)" where an option has a default its help does not already state."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: {action.default})".strip()

    def _format_action(self, action):
        if action.help is None and action.option_strings and action.default not in (None, False):
            action.help = f"(default: {action.default})"
        return super()._format_action(action)


def build_parser() -> argparse.ArgumentParser:
    import mcgraph.nn as mnn

    p = argparse.ArgumentParser(prog="mcgraph train", formatter_class=_HelpFormatter,
                                description="Train a Bayesian neural network (mcgraph.nn) on a dataset shipped in an "
                                            "installable package.")
    g_model = p.add_argument_group("model and data")
    g_model.add_argument("--model", default="lenet5", help=f"mlp or one of {sorted(MODELS)} (lstm and transformer "
                         "read the data as sequences: images row by row)")
    g_model.add_argument("--hidden", type=int, nargs="+", default=[256, 256], help="hidden widths of --model mlp")
    g_model.add_argument("--dataset", default="mnist", choices=sorted(DATASETS))
    g_model.add_argument("--image-size", type=int, default=None,
                   help="resize 2-d images (default: 28 for lenet5 on smaller images)")
    g_model.add_argument("--limit-train", type=int, default=None, help="use the first N training examples")
    g_model.add_argument("--limit-test", type=int, default=None, help="use the first N test examples")
    g_posterior = p.add_argument_group("posterior and prior")
    g_posterior.add_argument("--posterior", default="radial", choices=sorted(mnn.POSTERIORS))
    g_posterior.add_argument("--prior", default=None, choices=sorted(mnn.PRIORS),
                   help="default: the posterior family's (sparse_vd: log_uniform), else normal")
    g_posterior.add_argument("--prior-scale", type=float, default=None, help="scale of a normal/laplace/student_t prior")
    g_posterior.add_argument("--rho-init", type=float, default=None,
                   help="initial ρ (default −5 with σ = softplus(ρ); sparse_vd: log σ² = −10)")
    g_posterior.add_argument("--scale-transform", default=None,
                   help="how σ is derived from ρ: softplus (default), exp (ρ = log σ), exp_half (ρ = log σ²; "
                        "the sparse_vd default)")
    g_posterior.add_argument("--local-reparameterization", action="store_true",
                   help="sample pre-activations (the sparse_vd default)")
    g_posterior.add_argument("--flipout", action="store_true")
    g_posterior.add_argument("--deterministic", action="store_true", help="train the plain network (baseline)")
    g_elbo = p.add_argument_group("ELBO")
    g_elbo.add_argument("--kl-samples", type=int, default=1000, help="M of every layer's KL")
    g_elbo.add_argument("--kl-method", default="auto", help="the engine's method for the KL")
    g_elbo.add_argument("--train-samples", type=int, default=1, help="whole-network samples of the data term per step")
    g_elbo.add_argument("--chunk-size", type=int, default=None, help="samples per chunk of the data term")
    g_elbo.add_argument("--kl-schedule", default="constant", choices=["constant", "linear", "blundell"])
    g_elbo.add_argument("--kl-weight", type=float, default=1.0, help="β of the constant / final β of the linear schedule")
    g_elbo.add_argument("--warmup-epochs", type=float, default=1.0, help="length of the linear KL warm-up")
    g_elbo.add_argument("--no-stderr", action="store_true", help="do not log the Monte Carlo standard errors "
                   "of the data term and the KL (measured on each epoch's first step; one process only)")
    g_optimisation = p.add_argument_group("optimisation")
    g_optimisation.add_argument("--epochs", type=int, default=10)
    g_optimisation.add_argument("--batch-size", type=int, default=128)
    g_optimisation.add_argument("--lr", type=float, default=1e-3)
    g_optimisation.add_argument("--lr-decay", type=float, default=1.0, help="multiply the learning rate by this every epoch")
    g_optimisation.add_argument("--seed", type=int, default=0)
    g_optimisation.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g_optimisation.add_argument("--device", default="cpu")
    g_evaluation = p.add_argument_group("evaluation")
    g_evaluation.add_argument("--eval-samples", type=int, default=100, help="predictive samples of the final evaluation")
    g_evaluation.add_argument("--periodic-eval-samples", type=int, default=10)
    g_evaluation.add_argument("--eval-every", type=int, default=1, help="evaluate every N epochs (0: only at the end)")
    g_evaluation.add_argument("--eval-batch-size", type=int, default=1000)
    g_checkpoints = p.add_argument_group("checkpoints and output")
    g_checkpoints.add_argument("--checkpoint-every", type=int, default=1, help="save a checkpoint every N epochs")
    g_checkpoints.add_argument("--resume", default=None, help="a checkpoint.pt to continue from")
    g_checkpoints.add_argument("--out", default=None, help="output directory (default runs/<model>-<dataset>-<time>)")
    g_checkpoints.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_checkpoint_arguments(g_checkpoints)
    g_many = p.add_argument_group("many processes (torchrun)")
    g_many.add_argument("--data-parallel", type=int, default=1,
                   help="under torchrun: split each batch over this many groups of ranks (the rest of the "
                        "ranks split the Monte Carlo samples); must divide the number of ranks")
    g_many.add_argument("--dist-timeout", type=float, default=launch.DEFAULT_TIMEOUT_S,
                   help="seconds a collective waits for the other ranks: a rank that died makes the others "
                        "fail with an error instead of hanging")

    from .optim_train import add_arguments

    add_arguments(p)  # --optimizer vogn|adaptive-vb|adam and its options (absent: the ELBO training below)
    return p


def train(args, *, resumed: tuple[dict, Path] | None = None) -> dict:
    """Run the training of ``args`` (from :func:`build_parser`); returns the summary dict.

    One loop for every way of training: the method is :class:`~mcgraph.apps.elbo_training.ElboTraining`
    (the bayesified network on the ELBO), or, with ``--optimizer NAME``,
    :class:`~mcgraph.apps.optim_train.OptimizerTraining` with the optimizer registered under ``NAME``
    (:data:`~mcgraph.apps.optim_train.OPTIMIZER_BUILDERS`). The loop owns the data order, progress,
    evaluation, metrics, checkpoints (atomic; ``--resume`` continues bit for bit) and the summary.
    Under ``torchrun`` it joins the process group and leaves it when done (or failed).

    ``resumed``: ``(state, file)``, the checkpoint of ``args.resume`` already read (by :func:`main`, which takes
    the run's settings from it); without it the checkpoint is read here.

    Raises:
        TrainingInterrupted: Ctrl-C (SIGINT); it names the last complete checkpoint. Nothing partial is left:
            a write that was under way is abandoned and the file keeps its previous content.
    """
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    ranks = launch.ranks_from_env(device, getattr(args, "data_parallel", 1),
                                  getattr(args, "dist_timeout", launch.DEFAULT_TIMEOUT_S))
    try:
        return _train(args, device, ranks, resumed)
    finally:
        ranks.close()


@dataclass
class _Reached:
    """How far the run has got, for the line a Ctrl-C prints: the last complete checkpoint, the epochs it holds
    (``None``: not known yet) and what the run was doing."""

    checkpoint: Path | None = None
    epochs_done: int | None = None
    doing: str = "before training"


def _train(args, device: torch.device, ranks: launch.Ranks, resumed) -> dict:
    reached = _Reached()
    if resumed is not None:
        reached.checkpoint, reached.epochs_done = Path(resumed[1]), int(resumed[0]["epoch"])
    elif args.resume:
        reached.checkpoint = Path(args.resume)
    try:
        return _run(args, device, ranks, resumed, reached)
    except KeyboardInterrupt:
        raise TrainingInterrupted(reached.checkpoint, reached.epochs_done, reached.doing) from None


def _run(args, device: torch.device, ranks: launch.Ranks, resumed, reached: _Reached) -> dict:
    from .elbo_training import ElboTraining
    from .optim_train import OptimizerTraining

    ds, (x_train, y_train), (x_test, y_test), (x_eval, y_eval) = load_splits(args)
    n_train = x_train.shape[0]
    batches = math.ceil(n_train / args.batch_size)
    method = (OptimizerTraining if args.optimizer else ElboTraining)(args, ds, n_train, batches, device, ranks)
    model, optimizer = method.model, method.optimizer

    out = Path(args.out or ranks.broadcast_text(method.default_out + time.strftime("%Y%m%d-%H%M%S")))
    if ranks.is_main:
        out.mkdir(parents=True, exist_ok=True)
    ranks.barrier()
    start_epoch, step, data_rng = 0, 0, None
    if args.resume:
        if resumed is not None and device.type != "cpu":  # read on the CPU for its settings: read again onto device
            resumed = None
        state, used = load_resume(args, model, optimizer, device, loaded=resumed)
        method.load_extra(state)
        start_epoch, step, data_rng = int(state["epoch"]), int(state["step"]), state.get("data_rng")
        reached.checkpoint, reached.epochs_done = used, start_epoch
        if ranks.is_main:
            log(f"resumed from {used} at epoch {start_epoch}")
    n_params = sum(p.numel() for p in model.parameters())
    say = log if ranks.is_main else (lambda msg: None)
    say(f"{method.describe()} on {args.dataset}: {n_params:,} parameters, {n_train} training examples, "
        f"{batches} batches/epoch -> {out}" + ranks.describe())

    gen, history, log_path = resume_log(args, out, start_epoch, n_train, write=ranks.is_main, data_rng=data_rng)
    t_train = sum(r.get("time_s", 0.0) for r in history)
    for epoch in range(start_epoch, args.epochs):
        reached.doing = f"in epoch {epoch + 1} of {args.epochs}"
        method.begin_epoch(epoch)
        model.train()
        perm = torch.randperm(n_train, generator=gen)
        t0 = time.perf_counter()
        sums = {"loss": 0.0, "nll": 0.0, "kl": 0.0}
        with Progress(batches, f"epoch {epoch + 1}/{args.epochs}", not args.no_progress and ranks.is_main) as bar:
            note = bar.write if ranks.is_main else say
            for b in range(batches):
                idx = ranks.shard(perm[b * args.batch_size:(b + 1) * args.batch_size])
                xb, yb = x_train[idx].to(device), y_train[idx].to(device)
                result = method.step(xb, yb, step, b == 0, note)
                step += 1
                if result is None:  # skipped (--on-nonfinite skip)
                    continue
                sums["loss"] += result.loss
                sums["nll"] += result.nll
                sums["kl"] += result.kl
                bar.update(loss=sums["loss"] / (b + 1), nll=sums["nll"] / (b + 1), kl=result.kl)
        t_epoch = time.perf_counter() - t0
        t_train += t_epoch
        row = {"epoch": epoch + 1, "step": step, "time_s": t_epoch, "loss": sums["loss"] / batches,
               "train_nll": sums["nll"] / batches, "kl": sums["kl"] / batches,
               "lr": optimizer.param_groups[0]["lr"], "skipped_steps": method.skipped}
        extra = method.epoch_extra(epoch)
        row.update(extra)
        last = epoch + 1 == args.epochs
        line = f"epoch {epoch + 1}: loss {row['loss']:.4f}  kl {row['kl']:.4g}"
        if args.eval_every and ((epoch + 1) % args.eval_every == 0) and not last:
            split = "val" if ds.x_val is not None else "test"
            ev = method.evaluate(x_eval, y_eval, args.periodic_eval_samples)
            method.after_evaluation()
            row.update({f"{split}_{k}": v for k, v in ev.items() if k not in ("examples", "num_samples")})
            line += f"  {split} acc {ev['accuracy']:.4f}  nll {ev['nll']:.4f}  ece {ev['ece']:.4f}"
        line += "".join(f"  {k} {v:.4g}" for k, v in extra.items()) + f"  ({t_epoch:.1f} s)"
        history.append(row)
        if ranks.is_main:
            append_metrics(log_path, history)
        if args.checkpoint_every and ((epoch + 1) % args.checkpoint_every == 0 or last) and ranks.is_main:
            save_checkpoint(out / "checkpoint.pt", model, optimizer, epoch + 1, step, args, generator=gen,
                            **method.checkpoint_extra())
            reached.checkpoint, reached.epochs_done = out / "checkpoint.pt", epoch + 1
        reached.doing = f"after epoch {epoch + 1} of {args.epochs}"
        say(line)  # one line per epoch, after the checkpoint: an epoch in the log is an epoch on disk
        ranks.barrier()
    reached.doing = "during the final evaluation"

    t0 = time.perf_counter()
    test = method.evaluate(x_test, y_test, args.eval_samples)
    summary = {"model": args.model, "dataset": args.dataset, **method.summary_extra(), "epochs": args.epochs,
               "steps": step, "parameters": n_params, "train_examples": n_train, "train_time_s": t_train,
               "eval_time_s": time.perf_counter() - t0, "test": test, "history": history, "config": vars(args),
               "out": str(out)}
    if ranks.is_main:
        method.finish(summary, out, x_test, y_test)
        if not args.checkpoint_every:
            save_checkpoint(out / "checkpoint.pt", model, optimizer, args.epochs, step, args, generator=gen,
                            **method.checkpoint_extra())
            reached.checkpoint, reached.epochs_done = out / "checkpoint.pt", args.epochs
        atomic_io.write_json(out / "summary.json", summary, indent=2, default=str)
        atomic_io.write_text(out / "summary.md", method.markdown(summary))
    ranks.barrier()
    say(f"test: accuracy {test['accuracy']:.4f}  NLL {test['nll']:.4f}  ECE {test['ece']:.4f}  "
        f"Brier {test['brier']:.4f}  -> {out / 'summary.md'}")
    return summary


_UNSET = object()


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, frozenset[str]]:
    """``(args, the options argv gives)``: the parse of ``argv``, and the ``dest`` of every option it names
    (a resumed run takes the others from its checkpoint, :func:`~.training_run.resume_settings`).

    Example:
        >>> args, given = parse_args(build_parser(), ["--lr", "0.01", "--flipout"])
        >>> args.lr, args.epochs, sorted(given)
        (0.01, 10, ['flipout', 'lr'])
    """
    defaults = vars(parser.parse_args([]))
    parsed = vars(parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(defaults, _UNSET))))
    given = frozenset(name for name, value in parsed.items() if value is not _UNSET)
    return argparse.Namespace(**{k: defaults[k] if v is _UNSET else v for k, v in parsed.items()}), given


def interrupted_line(stop: KeyboardInterrupt, args) -> str:
    """The one line a Ctrl-C prints: where the run stopped, its last checkpoint and the command that resumes it.

    Example:
        >>> stop = TrainingInterrupted(Path("runs/a/checkpoint.pt"), 2, "in epoch 3 of 5")
        >>> print(interrupted_line(stop, None))
        mcgraph train: interrupted in epoch 3 of 5; runs/a/checkpoint.pt holds epoch 2; resume with: mcgraph \
train --resume runs/a/checkpoint.pt
    """
    if isinstance(stop, TrainingInterrupted):
        checkpoint, done, doing = stop.checkpoint, stop.epochs_done, stop.doing
    else:  # before the run began: only the checkpoint it was to resume from is known
        checkpoint = Path(args.resume) if getattr(args, "resume", None) else None
        done, doing = None, "before training"
    if checkpoint is None:
        return f"mcgraph train: interrupted {doing}, before the first checkpoint; nothing to resume"
    holds = "" if done is None else f"; {checkpoint} holds epoch {done}"
    torchrun = " (under torchrun, as before)" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    return (f"mcgraph train: interrupted {doing}{holds}; resume with: mcgraph train --resume "
            f"{shlex.quote(str(checkpoint))}{torchrun}")


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _launch_problem(args, given) -> str | None:
    """Why ``args`` cannot run in this launch (a setting a resumed run took from its checkpoint, say), or ``None``."""
    origin = lambda name: "" if name in given else " (the checkpoint's)"  # noqa: E731
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % args.data_parallel:
        return (f"--data-parallel {args.data_parallel}{origin('data_parallel')} does not divide the {world} "
                "process(es) of this launch: give --data-parallel with a divisor of it")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        return f"--device {args.device}{origin('device')}: no CUDA device here: give --device cpu"
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mcgraph train``; returns the exit status (130 after Ctrl-C).

    ``--resume PATH`` takes the run's settings from the checkpoint (:func:`~.training_run.resume_settings`): the
    flags given beside it must agree with them, except the run controls (:data:`~.training_run.RUN_CONTROLS`).
    """
    parser = build_parser()
    args, given = parse_args(parser, sys.argv[1:] if argv is None else list(argv))
    if args.model != "mlp" and args.model not in MODELS:
        parser.error(f"--model must be mlp or one of {sorted(MODELS)}, got {args.model!r}")
    for name in ("epochs", "batch_size", "kl_samples", "train_samples", "eval_samples", "periodic_eval_samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.data_parallel < 1:
        parser.error(f"--data-parallel must be >= 1, got {args.data_parallel}")
    if args.keep_checkpoints < 0:
        parser.error(f"--keep-checkpoints must be >= 0, got {args.keep_checkpoints}")
    try:
        resumed = None
        if args.resume:
            resumed = atomic_io.load_checkpoint(args.resume, map_location="cpu", fallback=args.resume_fallback,
                                                warn=log)
            args, changes = resume_settings(args, given, *resumed)
            if changes and _rank0():
                log(f"resuming {resumed[1]} with " + ", ".join(changes))
        unfit = _launch_problem(args, given)
        if unfit:
            print(f"mcgraph train: {unfit}", file=sys.stderr)
            return 2
        train(args, resumed=resumed)
    except KeyboardInterrupt as stop:  # Ctrl-C: one line, no traceback
        if _rank0():
            print(interrupted_line(stop, args), file=sys.stderr, flush=True)
        return 130
    except ImportError as e:  # an optional dataset package is missing
        print(f"mcgraph train: {e}", file=sys.stderr)
        return 1
    except (atomic_io.CheckpointError, atomic_io.AtomicWriteError) as e:
        print(f"mcgraph train: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"mcgraph train: diverged: {e}", file=sys.stderr)
        return 3
    except RuntimeError as e:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            raise
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        print(f"mcgraph train: rank {os.environ.get('RANK', '?')} of {world}: the process group failed (another "
              f"rank died, or did not answer within --dist-timeout {args.dist_timeout:g} s): {first}. Resume from "
              "the last checkpoint with --resume.", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
