"""The ELBO way of training (``mcgraph train`` without ``--optimizer``): the network of ``--model``
made Bayesian by :func:`mcgraph.nn.bayesify`, Adam on ``-mg.nn.elbo`` (``--deterministic``: the
plain network on cross-entropy). One of the two methods the training loop of :mod:`.train` runs
(the other is :class:`~mcgraph.apps.optim_train.OptimizerTraining`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..engine.noise.streams import mix_seed
from ..engine.options import Sampling
from .training_run import (StepResult, TrainingDiverged, build_model, check_finite, check_finite_grads, evaluate,
                           family_options, fault_nonfinite, is_bayesian)

__all__ = ["ElboTraining"]


class ElboTraining:
    """Adam on the negative ELBO of the bayesified network (or cross-entropy, ``--deterministic``)."""

    def __init__(self, args, ds, n_train: int, batches: int, device, ranks):
        import mcgraph.nn as mnn

        self.args, self.device, self.ranks, self.n_train = args, device, ranks, n_train
        self.model = build_model(args, ds.input_shape, ds.num_classes).to(device)
        self.bayesian = is_bayesian(self.model)
        self.trained = ranks.wrap(self.model)  # DistributedDataParallel over the data group, or the model itself
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        warmup = max(1, int(round(args.warmup_epochs * batches)))
        self.schedule = mnn.kl_schedule(args.kl_schedule, num_batches=batches, warmup_steps=warmup,
                                        weight=args.kl_weight)
        self.skipped = 0
        self.stderr: dict = {}
        self.default_out = f"runs/{args.model}-{args.dataset}-"

    def describe(self) -> str:
        return f"{'BNN' if self.bayesian else 'deterministic'} {self.args.model}"

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_extra(self) -> dict:
        return {"skipped_steps": self.skipped}

    def load_extra(self, state: dict) -> None:
        self.skipped = int(state.get("skipped_steps", 0))

    # ------------------------------------------------------------------ one epoch

    def begin_epoch(self, epoch: int) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.args.lr * self.args.lr_decay ** epoch

    def step(self, xb, yb, step: int, first: bool, say) -> StepResult | None:
        """One optimizer step on the batch; ``None`` when it was skipped (``--on-nonfinite skip``)."""
        import mcgraph.nn as mnn

        args, ranks = self.args, self.ranks
        self.optimizer.zero_grad(set_to_none=True)
        correct = 0
        if self.bayesian:
            # standard errors of the epoch's first step (one process: they are not all-reduced)
            probe = first and not args.no_stderr and ranks.world is None
            data = Sampling(args.train_samples, chunk_size=args.chunk_size, process_group=ranks.samples)
            kl = Sampling(None, method=args.kl_method, process_group=ranks.world)
            terms = mnn.elbo_terms(self.trained, xb, yb, num_samples=data, dataset_size=self.n_train,
                                   kl_samples=kl, kl_weight=self.schedule(step), seed=mix_seed(args.seed + 1, step),
                                   return_stderr=probe and args.train_samples > 1)
            loss = -terms.elbo
            nll_b, kl_b = -terms.log_likelihood.detach(), terms.kl.detach()
            kl_term = loss.detach() - nll_b  # the weighted KL as it enters the loss
            if probe:
                self.stderr = _step_stderr(self.model, terms, args)
        else:
            logits = self.trained(xb)
            loss = nn.functional.cross_entropy(logits, yb)
            nll_b, kl_b = loss.detach(), torch.zeros(())
            kl_term = kl_b
            correct = int((logits.argmax(-1) == yb).sum())
        poison = fault_nonfinite(step + 1)
        if poison is not None:  # test hook: this term goes non-finite at this step
            nll_b, kl_term = (nll_b + math.inf, kl_term) if poison == "data" else (nll_b, kl_term + math.nan)
            loss = loss + (math.inf if poison == "data" else math.nan)
        if not bool(torch.isfinite(loss.detach())):
            if args.on_nonfinite == "stop":
                check_finite(step + 1, data_term=nll_b, KL_term=kl_term, loss=loss)
            self.skipped += 1
            say(f"step {step + 1}: non-finite loss; the step was skipped (--on-nonfinite skip)")
            return None
        loss.backward()
        bad = check_finite_grads(step + 1, self.model)
        if bad:
            if args.on_nonfinite == "stop":
                raise TrainingDiverged(f"step {step + 1}: the gradient of {bad[:5]} is not finite (the loss, "
                                       f"{float(loss.detach()):.6g}, is); nothing was written")
            self.skipped += 1
            say(f"step {step + 1}: non-finite gradient of {bad[:5]}; the step was skipped")
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.optimizer.step()
        return StepResult(float(loss.detach()), float(nll_b), float(kl_b), correct)

    def epoch_extra(self, epoch: int) -> dict:
        """The epoch's entries for ``metrics.jsonl`` and its log line: the Monte Carlo standard errors of its
        first step (one process, unless ``--no-stderr``)."""
        if self.bayesian and not self.args.no_stderr and self.ranks.world is None:
            return dict(self.stderr)
        return {}

    # ------------------------------------------------------------------ evaluation and summary

    def evaluate(self, x, y, num_samples: int) -> dict:
        return evaluate(self.model, x, y, num_samples, self.args.eval_batch_size, self.device, self.ranks.world)

    def after_evaluation(self) -> None:
        pass

    def summary_extra(self) -> dict:
        args = self.args
        return {"bayesian": self.bayesian, "posterior": None if args.deterministic else args.posterior,
                "prior": None if args.deterministic else args.prior or family_options(args.posterior)[0],
                "kl_samples": None if args.deterministic else args.kl_samples, "processes": self.ranks.size}

    def finish(self, summary: dict, out, x_test, y_test) -> None:
        pass

    markdown = staticmethod(lambda s: _markdown(s))


def _step_stderr(model, terms, args) -> dict:
    """Monte Carlo standard errors of one step's data term and KL, and the KL samples for 1 % error.

    With ``--train-samples 1`` the data term has no variance estimate and is left out; the KL's
    standard error then comes from one more KL evaluation (no graph) at the step's parameters.
    """
    import mcgraph.nn as mnn
    from ..engine.stderr import MCEstimate

    out = {}
    if terms.kl_stderr is not None:
        out["data_term_stderr"] = float(terms.log_likelihood_stderr)
        kl, kl_se = terms.kl.detach(), terms.kl_stderr
    elif min((m.kl_samples for m in mnn.bayesian_modules(model)), default=0) > 1 and args.kl_samples > 1:
        with torch.no_grad():
            kl, kl_se, _ = mnn.kl(model, args.kl_samples, method=args.kl_method, return_stderr=True)
    else:
        return out
    out["kl_stderr"] = float(kl_se)
    if float(kl_se) > 0 and float(kl) != 0:
        out["kl_samples_for_1pct"] = MCEstimate(kl, kl_se, args.kl_samples).required_samples(0.01)
    return out


def _markdown(s: dict) -> str:
    t = s["test"]
    kind = (f"Bayesian ({s['posterior']} posterior, {s['prior']} prior, {s['kl_samples']} KL samples)"
            if s["bayesian"] else "deterministic")
    lines = [
        f"# {s['model']} on {s['dataset']}", "",
        f"{kind}; {s['parameters']:,} parameters; {s['epochs']} epochs ({s['steps']} steps) on "
        f"{s['train_examples']:,} examples in {s['train_time_s']:.1f} s.", "",
        f"Test set ({t['examples']:,} examples, {t['num_samples']} predictive samples):", "",
        "| metric | value |", "| --- | --- |",
        f"| accuracy | {t['accuracy']:.4f} |",
        f"| NLL | {t['nll']:.4f} |",
        f"| ECE (15 bins) | {t['ece']:.4f} |",
        f"| Brier | {t['brier']:.4f} |",
        f"| mean predictive entropy | {t['entropy']:.4f} |",
    ]
    if "accuracy_mean_weights" in t:
        lines.append(f"| accuracy (posterior-mean weights) | {t['accuracy_mean_weights']:.4f} |")
    lines += ["", "| epoch | loss | KL | time (s) |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['epoch']} | {r['loss']:.4f} | {r['kl']:.4g} | {r['time_s']:.1f} |" for r in s["history"]]
    return "\n".join(lines) + "\n"
