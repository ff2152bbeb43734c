"""Seed 002 (Shridhar et al., Bayesian CNNs with Bayes by Backprop) and MC dropout beside BBB.

LeNet-5 three ways at full and half width (``width=0.5``): deterministic (cross-entropy), Bayes by
Backprop (``mg.nn.bayesify``: Normal posterior, σ = softplus(ρ) with β (``mg.nn.softplus_beta``),
local reparameterization, N(0, σ_p²) prior, ``-mg.nn.elbo``), and MC dropout (the deterministic
network with dropout before each hidden fully connected layer, trained with cross-entropy, predicted
through ``mg.nn.mc_dropout``). Scored on the test set: accuracy, NLL, ECE (15 bins), AUROC of
misclassification detection (predictive entropy) and the trainable parameter count. Then the seed's
L1 pruning of trained means: accuracy against the fraction of weights removed (``mg.nn.prune_l1``,
smallest |μ| pooled over layers; the deterministic network by its smallest |w| the same way).

The seed gives no numbers, only claims; the comparison rows check them on our runs.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from .common import TargetResult, fmt_mean_sd, log, md_table, timed, with_dropout, write_target

NAME = "bbb_cnn"
TITLE = "Seed 002: Bayesian LeNet-5 (BBB) vs half width vs deterministic, L1 pruning curves; MC dropout beside BBB"
PAPER = ("Shridhar, Laumann, Liwicki. A Comprehensive guide to Bayesian Convolutional Neural Network with "
         "Variational Inference (seed 002's slides); Gal & Ghahramani 2016 for MC dropout")
ARMS = ("deterministic", "bbb", "mc_dropout")
WIDTHS = (1.0, 0.5)
LABELS = {"deterministic": "deterministic", "bbb": "BBB", "mc_dropout": "MC dropout"}


def _settings(quick: bool) -> dict:
    from .sparsify import dataset_name

    base = {"batch": 64, "lr": 1e-3, "prior_scale": 0.1, "rho_init": -5.0, "beta": 1.0, "dropout": 0.25,
            "fractions": [0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 0.98]}
    if quick:
        return base | {"dataset": dataset_name(True), "seeds": 1, "epochs": 2, "predict": 4,
                       "fractions": [0.0, 0.5, 0.9]}
    if dataset_name(False) == "mnist":  # what a shared 2-core CPU affords (the seed: GPUs)
        return base | {"dataset": "mnist", "seeds": 1, "epochs": 1, "predict": 8, "batch": 128}
    return base | {"dataset": "digits", "seeds": 3, "epochs": 10, "predict": 32}


def _arm_name(arm: str, width: float) -> str:
    return f"{arm}@{width:g}"


def _model(arm: str, width: float, s: dict, ds, seed: int):
    import functools

    import mcgraph.nn as mnn

    from .sparsify import network

    model = network("lenet5", ds, seed, width=width)
    if arm == "mc_dropout":
        return with_dropout(model, s["dropout"])
    if arm == "bbb":
        prior = functools.partial(mnn.PRIORS["normal"], scale=s["prior_scale"])
        return mnn.bayesify(model, posterior="normal", prior=prior, estimator="local_reparameterization",
                            rho_init=s["rho_init"], scale_transform=mnn.softplus_beta(s["beta"]),
                            init_from_weights=False, inplace=True)
    return model


def _predictor(arm: str, model):
    import mcgraph.nn as mnn

    return (mnn.mc_dropout(model), False) if arm == "mc_dropout" else (model, arm == "deterministic")


@torch.no_grad()
def _det_prune(model, fraction: float):
    """A copy of a deterministic network with the ``fraction`` smallest |w| (Linear/Conv weights, pooled) zeroed."""
    out = copy.deepcopy(model)
    weights = [m.weight for m in out.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    flat = torch.cat([w.abs().flatten() for w in weights])
    k = int(round(fraction * flat.numel()))
    if k:
        order = torch.argsort(flat, stable=True)[:k]
        keep = torch.ones_like(flat, dtype=torch.bool)
        keep[order] = False
        for w, mk in zip(weights, torch.split(keep, [w.numel() for w in weights])):
            w.mul_(mk.reshape(w.shape).to(w.dtype))
    return out


def run_one(arm: str, width: float, s: dict, seed: int) -> dict:
    import mcgraph.nn as mnn

    from .sparsify import fit, load, predict_probs, score

    ds = load(s["dataset"], seed, 28)
    model = _model(arm, width, s, ds, seed)
    sec = fit(model, ds.x_train, ds.y_train, bayesian=arm == "bbb", epochs=s["epochs"], batch=s["batch"], lr=s["lr"],
              seed=seed)
    predictor, det = _predictor(arm, model)
    samples = None if det else s["predict"]
    row = {"arm": arm, "width": width, "seed": seed, "epochs": s["epochs"], "seconds_per_epoch": sec,
           "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "train_examples": int(ds.x_train.shape[0]), "test_examples": int(ds.x_test.shape[0])}
    row["test"] = score(predict_probs(predictor, ds.x_test, samples, seed), ds.y_test)
    curve = []
    if arm in ("bbb", "deterministic"):
        for f in s["fractions"]:
            if arm == "bbb":
                mnn.prune_l1(model, fraction=f)
                acc = score(predict_probs(model, ds.x_test, samples, seed), ds.y_test)["accuracy"]
            else:
                acc = score(predict_probs(_det_prune(model, f), ds.x_test, None, seed), ds.y_test)["accuracy"]
            curve.append({"fraction": f, "accuracy": acc})
    row["pruning_curve"] = curve
    return row


def run(out_dir, quick: bool = False, seed: int = 0) -> dict:
    s = _settings(quick)
    result = TargetResult(NAME, TITLE, quick, seed, params=s, paper=PAPER)
    seeds = [seed + i for i in range(s["seeds"])]
    runs = []
    with timed(result):
        for sd in seeds:
            for width in WIDTHS:
                for arm in ARMS:
                    r = run_one(arm, width, s, sd)
                    runs.append(r)
                    log(f"{LABELS[arm]} width {width:g} seed {sd}: accuracy {100 * r['test']['accuracy']:.2f} %, "
                        f"ECE {r['test']['ece']:.4f} ({r['seconds_per_epoch']:.2f} s/epoch)")
    result.seeds = seeds
    result.rows = {"runs": runs}
    return report(out_dir, result)


def aggregate(runs: list) -> dict:
    out = {}
    for width in WIDTHS:
        for arm in ARMS:
            rs = [r for r in runs if r["arm"] == arm and r["width"] == width]
            if not rs:
                continue
            row = {"params": rs[0]["params"], "seeds": [r["seed"] for r in rs],
                   "seconds_per_epoch": float(np.mean([r["seconds_per_epoch"] for r in rs]))}
            for k in ("accuracy", "nll", "ece", "brier", "auroc"):
                v = [r["test"][k] for r in rs if r["test"][k] is not None]
                row[k] = (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0) if v else (None, None)
            if rs[0]["pruning_curve"]:
                fr = [c["fraction"] for c in rs[0]["pruning_curve"]]
                row["curve"] = {"fraction": fr, "accuracy": np.mean([[c["accuracy"] for c in r["pruning_curve"]]
                                                                     for r in rs], 0).tolist()}
            out[_arm_name(arm, width)] = row
    return out


def report(out_dir, result: TargetResult) -> dict:
    s = result.params
    runs = result.rows["runs"]
    agg = aggregate(runs)
    result.rows["aggregate"] = agg
    result.scale = (f"LeNet-5 (width 1 and 0.5) on {s['dataset']}"
                    f"{' resized to 28×28' if s['dataset'] == 'digits' else ''} "
                    f"({runs[0]['train_examples']} training / "
                    f"{runs[0]['test_examples']} test examples), {s['epochs']} epochs, batch {s['batch']}, Adam lr "
                    f"{s['lr']}, seeds {result.seeds}. BBB: N(0, {s['prior_scale']}²) prior, ρ init {s['rho_init']}, "
                    f"softplus β = {s['beta']}, local reparameterization, 1 sample per step; MC dropout p = "
                    f"{s['dropout']}; {s['predict']} predictive samples. The seed: MNIST / CIFAR-10 on GPUs.")
    a1, ah = agg.get("bbb@1"), agg.get("bbb@0.5")
    d1 = agg.get("deterministic@1")
    if a1 and d1:
        gap = 100 * (a1["accuracy"][0] - d1["accuracy"][0])
        result.compare("BBB LeNet-5 vs deterministic: accuracy", "comparable (the seed's claim; no numbers given)",
                       f"{100 * a1['accuracy'][0]:.2f} % vs {100 * d1['accuracy'][0]:.2f} % (Δ {gap:+.2f} pp); ECE "
                       f"{a1['ece'][0]:.4f} vs {d1['ece'][0]:.4f}", f"{s['epochs']} epochs",
                       "measured, not assumed")
    if a1 and ah:
        result.compare("BBB half width vs full width", "accuracy kept with half the filters (claim)",
                       f"{100 * ah['accuracy'][0]:.2f} % vs {100 * a1['accuracy'][0]:.2f} %; parameters "
                       f"{ah['params']:,} vs {a1['params']:,}", f"{s['epochs']} epochs", "measured")
        keep = [(f, acc) for f, acc in zip(a1["curve"]["fraction"], a1["curve"]["accuracy"])
                if acc >= a1["curve"]["accuracy"][0] - 0.01]
        result.compare("L1 pruning of BBB means: largest fraction within 1 pp of unpruned", "— (claim: weights "
                       "can be removed)", f"{keep[-1][0]:.2f} (accuracy {100 * keep[-1][1]:.2f} %)",
                       f"fractions {s['fractions']}", "measured")
    for width in WIDTHS:
        m, b = agg.get(_arm_name("mc_dropout", width)), agg.get(_arm_name("bbb", width))
        if m and b:
            result.compare(f"MC dropout beside BBB, width {width:g}: accuracy, NLL, ECE, AUROC", "—",
                           f"MC dropout {100 * m['accuracy'][0]:.2f} %, {m['nll'][0]:.3f}, {m['ece'][0]:.4f}, "
                           f"{m['auroc'][0] or float('nan'):.3f}; BBB {100 * b['accuracy'][0]:.2f} %, "
                           f"{b['nll'][0]:.3f}, "
                           f"{b['ece'][0]:.4f}, {b['auroc'][0] or float('nan'):.3f}", f"{s['epochs']} epochs",
                           "the baseline every BNN table carries")
    rows = [(LABELS[k.split("@")[0]], k.split("@")[1], f"{a['params']:,}", fmt_mean_sd(a["accuracy"], 100, 2),
             fmt_mean_sd(a["nll"]), fmt_mean_sd(a["ece"], 1, 4), fmt_mean_sd(a["auroc"]),
             f"{a['seconds_per_epoch']:.2f}") for k, a in agg.items()]
    result.section("Accuracy, calibration, parameters", md_table(
        ("method", "width", "parameters", "accuracy %", "NLL", "ECE", "AUROC", "s/epoch"), rows))
    curves = [(k, *(f"{100 * v:.1f}" for v in a["curve"]["accuracy"])) for k, a in agg.items() if "curve" in a]
    if curves:
        result.section("L1 pruning: test accuracy (%) against the fraction of weights removed", md_table(
            ("model", *(f"{f:g}" for f in s["fractions"])), curves))
    return write_target(out_dir, result, plot)


def plot(result: TargetResult, path) -> None:
    import matplotlib.pyplot as plt

    agg = result.rows["aggregate"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    for k, v in agg.items():
        if "curve" in v:
            a.plot(v["curve"]["fraction"], [100 * x for x in v["curve"]["accuracy"]], "o-", label=k)
    a.set_xlabel("fraction of weights pruned (smallest |μ|)")
    a.set_ylabel("test accuracy (%)")
    a.legend()
    names = list(agg)
    b.bar(names, [agg[k]["ece"][0] for k in names])
    b.set_ylabel("ECE")
    b.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


__all__ = ["run", "run_one", "aggregate", "report", "plot"]
