"""``python -m mcgraph train --optimizer vogn|ivon|adaptive-vb|adam [--spike-slab ...]``: the optimizers' training path.

The plain network of ``--model`` (never bayesified) is trained with cross-entropy by

* ``ivon`` — :class:`~mcgraph.optim.IVON` (``--ess``, default the number of training examples;
  ``--hess-init``, ``--betas`` (β₁, β₂), ``--weight-decay`` (default 1e-4 here), ``--hess-approx``,
  ``--clip-radius``, ``--mc-samples``; ``--lr`` defaults to 0.1, the paper's recommendation, when it
  is not given); with ``--mc-samples`` K > 1 the K samples run as one batched forward and backward
  (:meth:`~mcgraph.optim.IVON.step_samples`; a loop where vmap refuses the model); the posterior
  predictive is ``optimizer.posterior_model()``;
* ``vogn`` — :class:`~mcgraph.optim.VOGN` (``--mc-samples``, ``--prior-precision``, ``--damping``,
  ``--tempering``, ``--betas``, …); with ``--mc-samples`` K > 1 the K samples run as one batched forward
  and backward (:meth:`~mcgraph.optim.VOGN.step_samples`; one closure call per sample where vmap refuses
  the model); the posterior predictive is ``optimizer.posterior_model()``;
* ``adaptive-vb`` — :class:`~mcgraph.optim.AdaptiveVB` (``--avb-form gaussian``, the default:
  ``--alpha``, ``--warmup-steps``, ``--curvature``) or :class:`~mcgraph.optim.AdaptiveSGHMC`
  (``--avb-form sghmc``: ``--cycles`` of the cyclical cosine rate, ``--snapshots-per-cycle``
  samples, ``--temperature``), whose prediction is the snapshot ensemble;
* ``adam`` — ``torch.optim.Adam`` (the deterministic baseline).

**Many processes** (``ivon`` and ``vogn``). Under ``torchrun --nproc-per-node R python -m mcgraph
train --optimizer ivon|vogn ...`` every rank holds the whole batch and draws its own ``--mc-samples``
K weight samples (seeded by the sample's global index, never by who draws it); the gradient and
curvature statistics are all-reduced over the R ranks (the optimizer's ``process_group``), so a step
uses R·K samples and equals the one-process step with ``--mc-samples`` R·K up to float rounding.
Rank 0 alone writes checkpoints, metrics and the summary; ``--resume`` works on any number of ranks.
The other optimizers, and ``--data-parallel`` D > 1, are refused under torchrun.

``--spike-slab`` adds :class:`~mcgraph.optim.SpikeSlabEM` (EM decay switching and permanent
pruning, once per epoch after ``--prune-warmup`` epochs) to any of them (for Adam the decay
is added to the gradient). The summary then also reports sparsity and the parameters and
multiply–accumulates of the network before and after :func:`~mcgraph.optim.shrink`.

Output is that of ``mcgraph train``: progress, ``metrics.jsonl``, ``checkpoint.pt``
(model, optimizer with its counters, scheduler, spike-and-slab masks, snapshots, generator
states; ``--resume`` continues bit for bit), and ``summary.json`` / ``summary.md``, all
written atomically; checkpoints are loaded with ``weights_only=True`` (see :mod:`.train`).
A non-finite loss or gradient stops the run naming the step (``--on-nonfinite stop``, the
default) or, with ``skip``, is left to the optimizer's own skip (VOGN, adaptive VB and SGHMC
leave parameters and state unchanged and count ``skipped_steps``; Adam and IVON skip here, IVON
counting it in its ``skipped_steps``).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import torch
from torch import nn

from ..engine.checks import all_finite
from ..registry import Registry
from .training_run import StepResult

__all__ = ["add_arguments", "OptimizerTraining", "OPTIMIZERS", "OPTIMIZER_BUILDERS", "build_optimizer", "predictive_model"]

OPTIMIZERS = ("vogn", "ivon", "adaptive-vb", "adam")  # the order --help lists them (each a builder below)

#: ``--lr`` when not given, per optimizer (the others use ``mcgraph train``'s default)
DEFAULT_LR = {"ivon": 0.1}


class _DefaultLR(float):
    """``mcgraph train``'s ``--lr`` default, marked so that an optimizer with its own default can tell it apart."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--optimizer`` and the options of :mod:`mcgraph.optim` to the ``mcgraph train`` parser."""
    g = parser.add_argument_group("optimizers (mcgraph.optim): train the plain network with VOGN, adaptive VB "
                                  "or Adam instead of the ELBO of a bayesified one")
    g.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                   help="vogn, ivon, adaptive-vb or adam (default: the ELBO training of the bayesified network)")
    lr_default = parser.get_default("lr")
    if isinstance(lr_default, float) and not isinstance(lr_default, _DefaultLR):
        parser.set_defaults(lr=_DefaultLR(lr_default))
    g.add_argument("--ess", type=_positive_float, default=None,
                   help="IVON's effective sample size λ (default: the number of training examples)")
    g.add_argument("--hess-init", type=_positive_float, default=1.0, help="IVON's initial hessian h0")
    g.add_argument("--hess-approx", default="price", choices=["price", "gradsq"], help="IVON's hessian estimator")
    g.add_argument("--clip-radius", type=_positive_float, default=float("inf"), help="IVON's element-wise step clip")
    g.add_argument("--mc-samples", type=_positive_int, default=1, help="weight samples per step (VOGN's K)")
    g.add_argument("--prior-precision", type=_non_negative_float, default=1.0, help="δ of the N(0, I/δ) prior")
    g.add_argument("--damping", type=_non_negative_float, default=3e-2, help="VOGN's external damping γ")
    g.add_argument("--tempering", type=_positive_float, default=1.0, help="VOGN's τ (after its warm-up)")
    g.add_argument("--tempering-init", type=_positive_float, default=None, help="τ at step 1 of a linear warm-up")
    g.add_argument("--tempering-warmup-steps", type=_non_negative_int, default=0)
    g.add_argument("--betas", type=float, nargs=2, default=None,
                   help="VOGN (β1, β2) [0.9 0.999]; IVON (β1, β2) [0.9 0.99999]; adaptive VB (β1, γ) [0.9 0.01]; SGHMC (β1, β2) [0.1 1]")
    g.add_argument("--data-augmentation-factor", type=_positive_float, default=1.0, help="VOGN's ρ (N ← ρN)")
    g.add_argument("--init-precision", type=_non_negative_float, default=None,
                   help="initial curvature s / precision π (default: from the first minibatch)")
    g.add_argument("--vogn-variant", default="paper", choices=["paper", "torchsso"])
    g.add_argument("--batchnorm-prior", action="store_true", help="apply the prior to BatchNorm parameters")
    g.add_argument("--avb-form", default="gaussian", choices=["gaussian", "sghmc"],
                   help="adaptive VB with μ and σ (gaussian) or its memory-lean SGHMC form")
    g.add_argument("--alpha", type=float, default=0.5, choices=[0.5, 1.0], help="adaptive VB's α")
    g.add_argument("--warmup-steps", type=_non_negative_int, default=0, help="adaptive VB's noise-free warm-up")
    g.add_argument("--curvature", default="squared_gradient", choices=["squared_gradient", "per_example"])
    g.add_argument("--precision-decay", type=_positive_float, default=1.0, help="adaptive VB's λ")
    g.add_argument("--temperature", type=_positive_float, default=None, help="SGHMC's T (default N^-1/2)")
    g.add_argument("--precision-lr", type=_non_negative_float, default=0.1, help="SGHMC's η")
    g.add_argument("--weight-decay", type=_non_negative_float, default=None,
                   help="IVON's δ [1e-4] or SGHMC's decay [5e-4] (prior precision / N); with --spike-slab SGHMC "
                        "uses the slab decay instead")
    g.add_argument("--cycles", type=_positive_int, default=1, help="cycles of SGHMC's cyclical cosine rate")
    g.add_argument("--snapshots-per-cycle", type=_positive_int, default=3)
    g.add_argument("--spike-slab", action="store_true", help="group spike-and-slab EM with one-shot pruning")
    g.add_argument("--slab-decay", type=_positive_float, default=5e-4)
    g.add_argument("--spike-decay", type=_positive_float, default=1e-1)
    g.add_argument("--prior-inclusion", type=float, default=0.5, help="π of the probability E-step")
    g.add_argument("--estep", default="probability", choices=["probability", "threshold"])
    g.add_argument("--soft-threshold", type=_non_negative_float, default=1e-2)
    g.add_argument("--hard-threshold", type=_non_negative_float, default=1e-3)
    g.add_argument("--hard-statistic", default="mean_square", choices=["mean_square", "range"])
    g.add_argument("--linear-groups", default="input", choices=["input", "output"])
    g.add_argument("--conv-groups", default="kernel", choices=["kernel", "filter", "channel"])
    g.add_argument("--prune-conv", default="channels", choices=["channels", "em"])
    g.add_argument("--prune-warmup", type=_non_negative_int, default=1, help="epochs before the first E-step")
    g.add_argument("--exclude-layers", nargs="*", default=[], help="layers without the spike-and-slab prior")


def _spike_slab(args, model: nn.Module, n: int):
    if not args.spike_slab:
        return None
    from ..optim.spike_slab import SpikeSlabEM

    return SpikeSlabEM(model, n, slab_decay=args.slab_decay, spike_decay=args.spike_decay,
                       prior_inclusion=args.prior_inclusion, estep=args.estep, soft_threshold=args.soft_threshold,
                       hard_threshold=args.hard_threshold, hard_statistic=args.hard_statistic,
                       linear_groups=args.linear_groups, conv_groups=args.conv_groups, prune_conv=args.prune_conv,
                       warmup=args.prune_warmup, exclude=tuple(args.exclude_layers))


#: ``--optimizer`` name -> ``builder(args, model, n, batches, spike_slab, process_group) -> (optimizer, scheduler
#: or None)``; ``process_group`` is ``None`` in one process, else the ranks' group (builders of
#: :data:`DISTRIBUTED` optimizers only).
OPTIMIZER_BUILDERS: Registry = Registry("training optimizer", unique=True)

#: the optimizers that run under torchrun: each rank draws its own weight samples, statistics all-reduced
DISTRIBUTED = ("ivon", "vogn")


def build_optimizer(args, model: nn.Module, n: int, batches: int, spike_slab=None, process_group=None):
    """``(optimizer, scheduler or None)`` of ``args.optimizer`` for ``model`` and ``n`` training examples.

    ``process_group``: ``None``, or the ``torch.distributed`` group of the ranks (``ivon`` and ``vogn`` only)
    over which the optimizer all-reduces its statistics, each rank drawing its own ``--mc-samples`` samples.

    Raises:
        ValueError: an unknown optimizer, or a process group for one that cannot use it.
    """
    try:
        builder = OPTIMIZER_BUILDERS.lookup(args.optimizer)
    except KeyError:
        raise ValueError(f"optimizer must be one of {tuple(OPTIMIZER_BUILDERS)}, got {args.optimizer!r}") from None
    if process_group is not None and args.optimizer not in DISTRIBUTED:
        raise ValueError(f"--optimizer {args.optimizer}: only {' and '.join(DISTRIBUTED)} run under torchrun (each "
                         "rank draws its own weight samples); run the others in one process")
    return builder(args, model, n, batches, spike_slab, process_group)


def _betas(args) -> dict:
    return {} if args.betas is None else {"betas": tuple(args.betas)}


@OPTIMIZER_BUILDERS.register("vogn")
def _vogn(args, model, n, batches, spike_slab, process_group=None):
    from ..optim.vogn import VOGN

    samples, parallel = args.mc_samples, "data"
    if process_group is not None:  # each rank evaluates its K of the R·K samples (split by index)
        import torch.distributed as dist

        samples, parallel = args.mc_samples * dist.get_world_size(process_group), "samples"
    return VOGN(model, n, lr=args.lr, prior_precision=args.prior_precision, damping=args.damping,
                tempering=args.tempering, tempering_init=args.tempering_init,
                tempering_warmup_steps=args.tempering_warmup_steps, num_samples=samples,
                data_augmentation_factor=args.data_augmentation_factor, init_precision=args.init_precision,
                variant=args.vogn_variant, batchnorm_prior=args.batchnorm_prior, seed=args.seed,
                spike_slab=spike_slab, process_group=process_group, parallel=parallel, **_betas(args)), None


@OPTIMIZER_BUILDERS.register("ivon")
def _ivon(args, model, n, batches, spike_slab, process_group=None):
    from ..optim.ivon import IVON

    if spike_slab is not None:
        raise ValueError("--spike-slab: not available with --optimizer ivon (use vogn, adaptive-vb or adam)")
    kw = {} if args.betas is None else {"beta1": args.betas[0], "beta2": args.betas[1]}
    return IVON(model, lr=args.lr, ess=args.ess or n, hess_init=args.hess_init,
                weight_decay=1e-4 if args.weight_decay is None else args.weight_decay,
                mc_samples=args.mc_samples, hess_approx=args.hess_approx, clip_radius=args.clip_radius,
                seed=args.seed, process_group=process_group, **kw), None


@OPTIMIZER_BUILDERS.register("adaptive-vb")
def _adaptive_vb(args, model, n, batches, spike_slab, process_group=None):
    if args.avb_form == "gaussian":
        from ..optim.adaptive_vb import AdaptiveVB

        return AdaptiveVB(model, n, lr=args.lr, alpha=args.alpha, precision_decay=args.precision_decay,
                          prior_precision=args.prior_precision, num_samples=args.mc_samples,
                          warmup_steps=args.warmup_steps, curvature=args.curvature,
                          init_precision=args.init_precision or None, batchnorm_prior=args.batchnorm_prior,
                          seed=args.seed, spike_slab=spike_slab, **_betas(args)), None
    from ..optim.schedules import CyclicalCosineLR
    from ..optim.sghmc import AdaptiveSGHMC

    decay = args.slab_decay if spike_slab is not None else (5e-4 if args.weight_decay is None
                                                             else args.weight_decay)  # the slab prior on the rest
    opt = AdaptiveSGHMC(model.parameters(), n, lr=args.lr, weight_decay=decay, temperature=args.temperature,
                        precision_lr=args.precision_lr, seed=args.seed, spike_slab=spike_slab, **_betas(args))
    total = args.epochs * batches
    cycles = min(args.cycles, total)
    return opt, CyclicalCosineLR(opt, total, cycles, snapshots_per_cycle=args.snapshots_per_cycle)


@OPTIMIZER_BUILDERS.register("adam")
def _adam(args, model, n, batches, spike_slab, process_group=None):
    return torch.optim.Adam(model.parameters(), lr=args.lr, **_betas(args)), None


def predictive_model(optimizer, model: nn.Module, ensemble) -> tuple[nn.Module, int | None]:
    """``(model to predict with, exact number of samples or None)`` for the trained ``optimizer``."""
    from ..optim.gaussian import GaussianVariationalOptimizer
    from ..optim.ivon import IVON

    if isinstance(optimizer, (GaussianVariationalOptimizer, IVON)):
        return optimizer.posterior_model().eval(), None
    if ensemble is not None and len(ensemble):
        return ensemble.eval(), len(ensemble)
    return model.eval(), 1


@torch.no_grad()
def _evaluate(predictor: nn.Module, exact: int | None, x, y, num_samples: int, batch_size: int, device,
              seed: int) -> dict:
    import mcgraph.nn as mnn
    from ..metrics import prediction_metrics

    m = num_samples if exact is None else exact
    probs = []
    for i, start in enumerate(range(0, x.shape[0], batch_size)):
        xb = x[start:start + batch_size].to(device)
        if exact == 1:
            probs.append(torch.softmax(predictor(xb), -1).cpu())
        else:
            probs.append(mnn.predict(predictor, xb, m, seed=seed * 1_000_003 + i).cpu())
    out = prediction_metrics(torch.cat(probs), y)
    out["num_samples"] = m
    return out


def _checkpoint(path: Path, model, optimizer, scheduler, spike_slab, ensemble, epoch: int, step: int, args,
                generator=None):
    from .training_run import save_checkpoint

    save_checkpoint(path, model, optimizer, epoch, step, args, generator=generator,
                    scheduler=None if scheduler is None else scheduler.state_dict(),
                    spike_slab=None if spike_slab is None else spike_slab.state_dict(),
                    snapshots=None if ensemble is None else ensemble.snapshots)


class _SkippedStep(Exception):
    """IVON's samples were not finite under ``--on-nonfinite skip``: they are dropped, the step is skipped."""


def _loss_step(kind: str, optimizer, closure, spike_slab, on_nonfinite: str = "stop"):
    if kind in ("vogn", "adaptive-vb-gaussian"):  # IVON steps through OptimizerTraining.step
        return optimizer.step(closure)
    loss = closure()
    if not bool(torch.isfinite(loss.detach())) and on_nonfinite == "skip" and kind == "adam":
        print("adam: non-finite loss; the step was skipped", file=sys.stderr, flush=True)
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    if kind == "adam" and spike_slab is not None:
        with torch.no_grad():
            for p in spike_slab.params.values():
                if p.grad is not None:
                    p.grad.add_(spike_slab.decay(p) * p)
    if kind == "adam":
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not all_finite(grads):
            print("adam: non-finite gradient; the step was skipped", file=sys.stderr, flush=True)
            return loss.detach()
    optimizer.step()
    if spike_slab is not None and kind == "adam":
        spike_slab.apply_masks()
    return loss.detach()


class OptimizerTraining:
    """The plain network of ``--model`` trained by ``--optimizer`` on cross-entropy (one of the two methods
    the training loop of :mod:`.train` runs; the other is :class:`~mcgraph.apps.elbo_training.ElboTraining`)."""

    def __init__(self, args, ds, n_train: int, batches: int, device, ranks):
        from ..optim.snapshots import SnapshotEnsemble
        from .training_run import build_model

        if isinstance(args.lr, _DefaultLR) and args.optimizer in DEFAULT_LR:
            args.lr = DEFAULT_LR[args.optimizer]
        args.lr = float(args.lr)
        self.args, self.device = args, device
        plain = argparse.Namespace(**{**vars(args), "deterministic": True})
        self.model = build_model(plain, ds.input_shape, ds.num_classes).to(device)
        if ranks.size > 1 and ranks.data_parallel > 1:
            raise ValueError(f"--data-parallel: --optimizer {args.optimizer} under torchrun gives every rank the whole "
                             "batch and its own weight samples; use --data-parallel 1")
        self.spike_slab = _spike_slab(args, self.model, n_train)
        self.optimizer, self.scheduler = build_optimizer(args, self.model, n_train, batches, self.spike_slab,
                                                         process_group=ranks.world)
        self.kind = args.optimizer if args.optimizer != "adaptive-vb" else f"adaptive-vb-{args.avb_form}"
        self.ensemble = SnapshotEnsemble(self.model) if self.kind == "adaptive-vb-sghmc" else None
        self.bayesian = self.kind != "adam"
        self.loss_fn = nn.CrossEntropyLoss()
        # vmap refuses BatchNorm in training mode: known once, so IVON's samples never retry it every step
        self._vmap_ok = not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.model.modules())
        self.default_out = f"runs/{args.model}-{args.dataset}-{args.optimizer}-"

    @property
    def skipped(self) -> int:
        return int(getattr(self.optimizer, "skipped_steps", 0))

    def describe(self) -> str:
        args = self.args
        return (f"{args.optimizer}{'/' + args.avb_form if args.optimizer == 'adaptive-vb' else ''} on {args.model}"
                f"{' + spike-and-slab EM' if self.spike_slab else ''}")

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_extra(self) -> dict:
        return {"scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                "spike_slab": None if self.spike_slab is None else self.spike_slab.state_dict(),
                "snapshots": None if self.ensemble is None else self.ensemble.snapshots}

    def load_extra(self, state: dict) -> None:
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.spike_slab is not None and state.get("spike_slab") is not None:
            self.spike_slab.load_state_dict(state["spike_slab"])
        if self.ensemble is not None and state.get("snapshots"):
            self.ensemble.snapshots = list(state["snapshots"])

    # ------------------------------------------------------------------ one epoch

    def begin_epoch(self, epoch: int) -> None:
        if self.scheduler is None:
            for group in self.optimizer.param_groups:
                group["lr"] = self.args.lr * self.args.lr_decay ** epoch
        if self.spike_slab is not None:
            self.spike_slab.update(epoch)

    def step(self, xb, yb, step: int, first: bool, say) -> StepResult:
        from . import training_run as base

        args, model, optimizer = self.args, self.model, self.optimizer

        def closure(step=step):
            optimizer.zero_grad(set_to_none=True)
            loss = self.loss_fn(model(xb), yb)
            if base.fault_nonfinite(step + 1) is not None:  # test hook
                loss = loss + math.inf
            if args.on_nonfinite == "stop":
                base.check_finite(step + 1, data_term=loss)
            loss.backward()
            if args.on_nonfinite == "stop":
                bad = base.check_finite_grads(step + 1, model)
                if bad:
                    raise base.TrainingDiverged(f"step {step + 1}: the gradient of {bad[:5]} is not finite "
                                                f"(the data term, {float(loss.detach()):.6g}, is); nothing "
                                                "was written")
            return loss

        if self.kind == "ivon":  # K > 1 samples batched where the model allows (vmap refuses training BatchNorm)
            try:
                loss = float(optimizer.step_samples(lambda: self._data_term(xb, yb, step),
                                                    vectorize=None if self._vmap_ok else False,
                                                    before_step=functools.partial(self._check_samples, step)))
            except _SkippedStep as skipped:
                optimizer.counters["skipped"] += 1
                print(f"ivon: step {step + 1}: {skipped}; the step was skipped", file=sys.stderr, flush=True)
                loss = math.nan
        elif self.kind == "vogn" and optimizer.num_samples > 1:  # K samples batched where vmap allows
            skipped = optimizer.skipped_steps
            loss = float(optimizer.step_samples(lambda: self._data_term(xb, yb, step)))
            if args.on_nonfinite == "stop":  # the closure path's checks, after the samples (the run ends unwritten)
                base.check_finite(step + 1, data_term=torch.tensor(loss))
                if optimizer.skipped_steps > skipped:
                    raise base.TrainingDiverged(f"step {step + 1}: the gradient or curvature of a weight sample is "
                                                f"not finite (the data term, {loss:.6g}, is); nothing was written")
        else:
            loss = float(_loss_step(self.kind, optimizer, closure, self.spike_slab, args.on_nonfinite))
        if self.scheduler is not None:
            if self.scheduler.is_snapshot_step(step):
                self.ensemble.add()
            self.scheduler.step()
        return StepResult(loss, loss)

    def _data_term(self, xb, yb, step: int) -> torch.Tensor:
        from . import training_run as base

        loss = self.loss_fn(self.model(xb), yb)
        return loss + math.inf if base.fault_nonfinite(step + 1) is not None else loss  # test hook

    def _check_samples(self, step: int, loss: torch.Tensor) -> None:
        """IVON's samples, before its update: a non-finite loss or gradient stops the run (nothing written) or,
        with ``--on-nonfinite skip``, skips the step (weights and state unchanged)."""
        from . import training_run as base

        if bool(torch.isfinite(loss)) and self.optimizer.recorded_finite():
            return
        if self.args.on_nonfinite == "skip":
            raise _SkippedStep("non-finite loss or gradient" if bool(torch.isfinite(loss)) else "non-finite loss")
        base.check_finite(step + 1, data_term=loss)
        raise base.TrainingDiverged(f"step {step + 1}: the gradient of a weight sample is not finite (the data "
                                    f"term, {float(loss):.6g}, is); nothing was written")

    def epoch_extra(self, epoch: int) -> dict:
        """The epoch's entries for ``metrics.jsonl`` and its log line (the sparsity under ``--spike-slab``)."""
        return {} if self.spike_slab is None else {"sparsity": self.spike_slab.sparsity()["sparsity"]}

    # ------------------------------------------------------------------ evaluation and summary

    def evaluate(self, x, y, num_samples: int) -> dict:
        predictor, exact = predictive_model(self.optimizer, self.model, self.ensemble)
        return _evaluate(predictor, exact, x, y, num_samples, self.args.eval_batch_size, self.device, self.args.seed)

    def after_evaluation(self) -> None:
        self.model.train()

    def summary_extra(self) -> dict:
        args, kind, optimizer = self.args, self.kind, self.optimizer
        return {
            "bayesian": self.bayesian, "optimizer": args.optimizer,
            "form": args.avb_form if args.optimizer == "adaptive-vb" else None,
            "posterior": {"vogn": "normal (VOGN)", "ivon": "normal (IVON)", "adaptive-vb-gaussian": "normal (adaptive VB)",
                          "adaptive-vb-sghmc": f"snapshot ensemble ({len(self.ensemble) if self.ensemble else 0})",
                          "adam": None}[kind],
            "prior": None if kind == "adam" else ("spike-and-slab" if self.spike_slab else
                                                  f"normal(precision={_ivon_prior(optimizer)})" if kind == "ivon" else
                                                  f"normal(δ={args.prior_precision})"),
            "kl_samples": None, "skipped_steps": self.skipped,
        }

    def finish(self, summary: dict, out, x_test, y_test) -> None:
        """The test accuracy of the mean weights; with spike-and-slab, the shrunk network."""
        from . import atomic_io

        args, model, device = self.args, self.model, self.device
        with torch.no_grad():
            model.eval()
            mean_probs = torch.cat([torch.softmax(model(x_test[i:i + args.eval_batch_size].to(device)), -1).cpu()
                                    for i in range(0, x_test.shape[0], args.eval_batch_size)])
        test = summary["test"]
        test["accuracy_mean_weights"] = float((mean_probs.argmax(-1) == y_test).double().mean())
        if self.spike_slab is not None:
            from ..optim.shrink import shrink

            small, report = shrink(model.eval(), x_test[:2].to(device))
            summary["sparsity"] = self.spike_slab.sparsity()
            summary["shrink"] = {k: v for k, v in report.items() if k != "selected"}
            with atomic_io.atomic_write(out / "pruned_model.pt") as f:
                torch.save(small, f)  # a whole module (read it with weights_only=False, only if you trust it)

    markdown = staticmethod(lambda s: _markdown(s))


def _ivon_prior(optimizer) -> float:
    group = optimizer.param_groups[0]
    return group["ess"] * group["weight_decay"]


def _markdown(s: dict) -> str:
    t = s["test"]
    what = s["optimizer"] + (f" ({s['form']} form)" if s.get("form") else "")
    lines = [
        f"# {s['model']} on {s['dataset']}", "",
        f"Trained with {what}; posterior: {s['posterior'] or 'none (point estimate)'}; prior: {s['prior'] or 'none'}; "
        f"{s['parameters']:,} parameters; {s['epochs']} epochs ({s['steps']} steps, {s['skipped_steps']} skipped) on "
        f"{s['train_examples']:,} examples in {s['train_time_s']:.1f} s.", "",
        f"Test set ({t['examples']:,} examples, {t['num_samples']} predictive samples):", "",
        "| metric | value |", "| --- | --- |",
        f"| accuracy | {t['accuracy']:.4f} |", f"| NLL | {t['nll']:.4f} |", f"| ECE (15 bins) | {t['ece']:.4f} |",
        f"| Brier | {t['brier']:.4f} |", f"| mean predictive entropy | {t['entropy']:.4f} |",
        f"| accuracy (mean weights) | {t['accuracy_mean_weights']:.4f} |",
    ]
    if "shrink" in s:
        b, a = s["shrink"]["before"], s["shrink"]["after"]
        lines += ["", f"Spike-and-slab pruning: {100 * s['sparsity']['sparsity']:.2f} % of the grouped weights pruned.",
                  "", "| | parameters | non-zero parameters | MACs / example | non-zero MACs / example |",
                  "| --- | --- | --- | --- | --- |",
                  f"| before shrinking | {b['parameters']:,} | {b['nonzero_parameters']:,} | {b['macs']:,} | "
                  f"{b['macs_nonzero']:,} |",
                  f"| after shrinking | {a['parameters']:,} | {a['nonzero_parameters']:,} | {a['macs']:,} | "
                  f"{a['macs_nonzero']:,} |"]
    lines += ["", "| epoch | loss | time (s) |", "| --- | --- | --- |"]
    lines += [f"| {r['epoch']} | {r['loss']:.4f} | {r['time_s']:.1f} |" for r in s["history"]]
    return "\n".join(lines) + "\n"
