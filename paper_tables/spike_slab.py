"""Seed 004 (Ke & Fan): one-shot training and pruning with adaptive SGHMC and EM under a spike-and-slab prior.

Two experiments, every run through :class:`mcgraph.optim.AdaptiveSGHMC` with a
:class:`~mcgraph.optim.CyclicalCosineLR` schedule and :class:`~mcgraph.optim.SpikeSlabEM`:

1. **The sparse-regression examples of the released code** (``sparse_regression/Example1–3``):
   ``x_j = (z_0 + z_j)/√2`` with standard-normal ``z`` (truncated to ±10, as the generator;
   pairwise correlation ½), ``p`` = 1000 or 2000 inputs of which 5 matter:

   ====  =====  ===========================================================================  ============
   ex.   p      truth                                                                        network
   ====  =====  ===========================================================================  ============
   1     1000   ``tanh(2 tanh(2x₁ − x₂)) + 2 tanh(tanh(x₃ − 2x₄)) − tanh(2x₅) + N(0, 1)``        1000-5-3-1
   2     2000   ``5x₂/(1 + x₁²) + 5 sin(x₃x₄) + 2x₅ + N(0, 1)``                                  2000-6-4-3-1
   3     1000   ``1[exp(x₁) + x₂² + 5 sin(x₃x₄) − 3 > 0]`` (BCE; x₅ plays no role)                1000-6-4-3-1
   ====  =====  ===========================================================================  ============

   with the notebooks' settings (columns of every Linear weight as groups, decays, thresholds,
   50 warm-up epochs, 6 cosine cycles, ``T = N^{-1/2}``, batch 1024). Reported: the input
   columns that survive, the sparsity over **all** parameters (the code's ``count_sparsity``
   convention, which reproduces the notebooks' percentages exactly when only the true columns
   survive), and the test error, beside the notebooks' numbers. Both E-steps run: the code's
   threshold and the paper's probability.
2. **Accuracy against sparsity** on a classifier (``--quick``: the digits MLP; full: LeNet-5 on
   MNIST): one-shot EM pruning at several spike decays, each compared with unstructured
   magnitude pruning of the dense network (the same optimizer without the prior) at the same
   per-layer sparsity, without retraining; and the parameters and multiply–accumulates of the
   physically smaller network (:func:`mcgraph.optim.shrink`).

The paper's own tables (CIFAR/ImageNet) were not available; the numbers beside ours are the
released notebooks' saved outputs. Runs are cached under ``spike_slab_runs/``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .common import TargetResult, config_key, load_result, log, md_table, timed, write_target, write_cache

NAME = "spike_slab"
TITLE = "Seed 004: one-shot EM spike-and-slab pruning — sparse regression examples and accuracy vs sparsity"
PAPER = ("Ke, Fan. On the optimization and pruning for Bayesian deep learning. arXiv 2210.12957 (seed 004); "
         "numbers from its released code's notebooks")
#: Example → (test metric as printed, sparsity %, surviving input columns (1-based)), from the notebooks' outputs.
NOTEBOOK = {1: ("test MSE 1.108", 98.97, [1, 2, 3, 4, 5]), 2: ("test MSE 2.494", 99.31, [1, 2, 3, 4, 5]),
            3: ("test acc 96.1 %, BCE 0.100", 98.73, [1, 2, 3, 4])}
EXAMPLES = {1: {"p": 1000, "hidden": (5, 3), "loss": "mse", "decays": (2e-4, 1e-2), "thresholds": (1e-2, 1e-3),
                "lr": 0.01, "epochs": 3000},
            2: {"p": 2000, "hidden": (6, 4, 3), "loss": "mse", "decays": (5e-4, 1e-2), "thresholds": (1e-2, 1e-3),
                "lr": 0.01, "epochs": 6000},
            3: {"p": 1000, "hidden": (6, 4, 3), "loss": "bce", "decays": (5e-4, 1e-2), "thresholds": (2e-2, 1e-3),
                "lr": 0.1, "epochs": 3000}}


def _settings(quick: bool) -> dict:
    if quick:
        return {"regression": {"examples": [1], "p": 1000, "n_train": 2048, "n_test": 512, "batch": 256,
                               "epochs": 200, "warmup": 60, "cycles": 3, "seeds": 1, "esteps": ["threshold"]},
                "classifier": {"dataset": "digits", "model": "mlp", "hidden": 100, "epochs": 20, "batch": 64,
                               "lr": 0.5, "cycles": 2, "warmup": 4, "sweep": [[0.1, 3e-2], [0.3, 3e-2]],
                               "slab_decay": 5e-4, "hard_threshold": 1e-3, "seeds": 1}}
    return {"regression": {"examples": [1, 2, 3], "p": None, "n_train": 10_240, "n_test": 1024, "batch": 1024,
                           "epochs": None, "warmup": 50, "cycles": 6, "seeds": 2,
                           "esteps": ["threshold", "probability"], "seeds_per_estep": {"probability": 1}},
            "classifier": {"dataset": "mnist", "model": "lenet5", "hidden": None, "epochs": 10, "batch": 128,
                           "lr": 0.5, "cycles": 2, "warmup": 2, "sweep": [[0.1, 2e-3], [0.1, 5e-3], [0.1, 1e-2]],
                           "slab_decay": 5e-4, "hard_threshold": 2e-4, "seeds": 1,
                           "exclude": ["classifier.5"]}}


# --------------------------------------------------------------------------- sparse regression


def make_regression(example: int, n: int, p: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x (n, p), y (n,))`` of the code's data generator ``example`` (1, 2 or 3)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, p + 1, generator=g, dtype=torch.float64)
    while bool((z.abs() > 10).any()):  # the generator's truncation at ±10 (never hit in practice)
        bad = z.abs() > 10
        z[bad] = torch.randn(int(bad.sum()), generator=g, dtype=torch.float64)
    x = (z[:, :1] + z[:, 1:]) / math.sqrt(2)
    x1, x2, x3, x4, x5 = (x[:, j] for j in range(5))
    noise = torch.randn(n, generator=g, dtype=torch.float64)
    if example == 1:
        y = torch.tanh(2 * torch.tanh(2 * x1 - x2)) + 2 * torch.tanh(torch.tanh(x3 - 2 * x4)) - torch.tanh(2 * x5) \
            + noise
    elif example == 2:
        y = 5 * x2 / (1 + x1 ** 2) + 5 * torch.sin(x3 * x4) + 2 * x5 + noise
    elif example == 3:
        y = (torch.exp(x1) + x2 ** 2 + 5 * torch.sin(x3 * x4) - 3 > 0).double()
    else:
        raise ValueError(f"example must be 1, 2 or 3, got {example!r}")
    return x.float(), y.float()


def _mlp(p: int, hidden, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers, width = [], p
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def _train_sghmc(model, x, y, loss_fn, *, n_epochs, batch, lr, cycles, warmup, spike_slab, decay, seed,
                 snapshots_per_cycle=3):
    """Adaptive SGHMC with the cyclical cosine rate (and EM when ``spike_slab``); returns ``(ensemble, seconds)``."""
    from mcgraph.optim import AdaptiveSGHMC, CyclicalCosineLR, SnapshotEnsemble

    n = x.shape[0]
    steps = math.ceil(n / batch)
    opt = AdaptiveSGHMC(model.parameters(), n, lr=lr, weight_decay=decay, seed=seed, spike_slab=spike_slab)
    sched = CyclicalCosineLR(opt, n_epochs * steps, cycles, snapshots_per_cycle=snapshots_per_cycle,
                             snapshot_fraction=0.05)
    ensemble = SnapshotEnsemble(model)
    gen = torch.Generator().manual_seed(seed)
    k = 0
    t0 = time.perf_counter()
    for epoch in range(n_epochs):
        if spike_slab is not None:
            spike_slab.update(epoch)
        perm = torch.randperm(n, generator=gen)
        model.train()
        for b in range(steps):
            idx = perm[b * batch:(b + 1) * batch]
            opt.zero_grad()
            loss_fn(model(x[idx]), y[idx]).backward()
            opt.step()
            if sched.is_snapshot_step(k):
                ensemble.add()
            sched.step()
            k += 1
    return ensemble, opt, time.perf_counter() - t0


def _zero_fraction(model: nn.Module) -> float:
    params = list(model.parameters())
    return sum(int((p == 0).sum()) for p in params) / sum(p.numel() for p in params)


def regression_run(example: int, estep: str, r: dict, seed: int) -> dict:
    """One sparse-regression run of ``example`` with the E-step ``estep``."""
    from mcgraph.optim import SpikeSlabEM, count_compute, shrink

    cfg = EXAMPLES[example]
    p = r["p"] or cfg["p"]
    epochs = r["epochs"] or cfg["epochs"]
    x, y = make_regression(example, r["n_train"], p, seed=1000 * seed + example)
    xt, yt = make_regression(example, r["n_test"], p, seed=1000 * seed + example + 500)
    model = _mlp(p, cfg["hidden"], seed)
    slab, spike = cfg["decays"]
    soft, hard = cfg["thresholds"]
    em = SpikeSlabEM(model, x.shape[0], slab_decay=slab, spike_decay=spike, estep=estep, soft_threshold=soft,
                     hard_threshold=hard, linear_groups="input", warmup=r["warmup"])
    bce = cfg["loss"] == "bce"

    def loss_fn(out, target):
        out = out.squeeze(-1)
        return F.binary_cross_entropy_with_logits(out, target) if bce else F.mse_loss(out, target)

    ensemble, opt, seconds = _train_sghmc(model, x, y, loss_fn, n_epochs=epochs, batch=r["batch"], lr=cfg["lr"],
                                          cycles=r["cycles"], warmup=r["warmup"], spike_slab=em, decay=slab,
                                          seed=seed)
    model.eval()
    with torch.no_grad():
        out_final = model(xt).squeeze(-1)
        outs = torch.stack([ensemble._run(i, xt).squeeze(-1) for i in range(len(ensemble))])
    row = {"example": example, "estep": estep, "seed": seed, "p": p, "epochs": epochs, "n_train": x.shape[0],
           "seconds": seconds, "skipped_steps": opt.skipped_steps, "snapshots": len(ensemble),
           "sparsity_all_parameters": _zero_fraction(model),
           "sparsity_grouped_weights": em.sparsity()["sparsity"],
           "kept_inputs": [j + 1 for j in em.sparsity()["layers"]["0.weight"]["kept_inputs"]]}
    if bce:
        prob_final = torch.sigmoid(out_final)
        prob_bma = torch.sigmoid(outs).mean(0)
        row.update({"test_accuracy": float(((prob_final > 0.5).float() == yt).float().mean()),
                    "test_bce": float(F.binary_cross_entropy(prob_final.clamp(1e-7, 1 - 1e-7), yt)),
                    "test_accuracy_bma": float(((prob_bma > 0.5).float() == yt).float().mean()),
                    "test_bce_bma": float(F.binary_cross_entropy(prob_bma.clamp(1e-7, 1 - 1e-7), yt))})
    else:
        row.update({"test_mse": float(F.mse_loss(out_final, yt)), "test_mse_bma": float(F.mse_loss(outs.mean(0), yt))})
    small, rep = shrink(model, xt[:4])
    row["shrink"] = {"before": rep["before"], "after": rep["after"]}
    row["counts"] = count_compute(model, xt[:4])
    return row


# --------------------------------------------------------------------------- accuracy vs sparsity


def _classifier(c: dict, seed: int) -> nn.Module:
    from mcgraph.models import get_model
    from mcgraph.apps.train import mlp

    torch.manual_seed(seed)
    return mlp(10, 64, (c["hidden"],)) if c["model"] == "mlp" else get_model(c["model"], num_classes=10)


def _accuracy(model: nn.Module, x, y) -> float:
    model.eval()
    with torch.no_grad():
        return float(torch.cat([model(x[i:i + 1000]).argmax(-1) for i in range(0, x.shape[0], 1000)]).eq(y)
                     .double().mean())


def _magnitude_prune(model: nn.Module, layer_sparsity: dict) -> nn.Module:
    """Unstructured magnitude pruning: in each named weight, zero the smallest |w| to the given fraction."""
    import copy

    pruned = copy.deepcopy(model)
    params = dict(pruned.named_parameters())
    with torch.no_grad():
        for name, frac in layer_sparsity.items():
            w = params[name]
            k = int(round(frac * w.numel()))
            if k <= 0:
                continue
            cut = w.abs().flatten().kthvalue(k).values
            w.mul_((w.abs() > cut).to(w.dtype))
    return pruned


def classifier_runs(c: dict, seed: int) -> list[dict]:
    """Dense SGHMC (the magnitude-pruning baseline), then EM pruning at each spike decay; accuracy and sparsity."""
    from mcgraph.apps.data import load_dataset
    from mcgraph.optim import SpikeSlabEM, shrink

    ds = load_dataset(c["dataset"], seed=seed)
    x, y, xt, yt = ds.x_train, ds.y_train, ds.x_test, ds.y_test
    loss = nn.CrossEntropyLoss()
    common = dict(n_epochs=c["epochs"], batch=c["batch"], lr=c["lr"], cycles=c["cycles"], warmup=c["warmup"],
                  decay=c["slab_decay"], seed=seed, snapshots_per_cycle=1)
    dense = _classifier(c, seed)
    _, _, dense_s = _train_sghmc(dense, x, y, loss, spike_slab=None, **common)
    dense_acc = _accuracy(dense, xt, yt)
    rows = [{"method": "dense", "seed": seed, "spike_decay": None, "accuracy": dense_acc, "sparsity": 0.0,
             "seconds": dense_s}]
    for spike, soft in c["sweep"]:
        model = _classifier(c, seed)
        em = SpikeSlabEM(model, x.shape[0], slab_decay=c["slab_decay"], spike_decay=spike, estep="threshold",
                         soft_threshold=soft, hard_threshold=c["hard_threshold"], warmup=c["warmup"],
                         exclude=tuple(c.get("exclude", ())))
        _, _, secs = _train_sghmc(model, x, y, loss, spike_slab=em, **common)
        sp = em.sparsity()
        layer_sparsity = {k: v["sparsity"] for k, v in sp["layers"].items()}
        small, rep = shrink(model, xt[:2])
        magnitude = _magnitude_prune(dense, layer_sparsity)
        rows.append({"method": "em", "seed": seed, "spike_decay": spike, "soft_threshold": soft, "accuracy": _accuracy(model, xt, yt),
                     "accuracy_shrunk": _accuracy(small, xt, yt), "sparsity": sp["sparsity"],
                     "layer_sparsity": layer_sparsity, "seconds": secs, "shrink": {"before": rep["before"],
                                                                                  "after": rep["after"],
                                                                                  "removed": rep["removed"]}})
        rows.append({"method": "magnitude", "seed": seed, "spike_decay": spike, "soft_threshold": soft,
                     "accuracy": _accuracy(magnitude, xt, yt), "sparsity": sp["sparsity"]})
    return rows


# --------------------------------------------------------------------------- the target


def _key(part: dict, what: str, seed: int) -> str:
    """The cache key of one run: its part's settings, what it computes and its seed (dumped with ``default=str``,
    as the recorded caches were)."""
    return config_key({"part": part, "what": what, "seed": seed}, default=str)


def _cached(runs_dir: Path, name: str, key: str, compute):
    path = runs_dir / f"{name}.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if old.get("key") == key:
            return old["value"], True
    value = compute()
    write_cache(path, {"key": key, "value": value})
    return value, False


def run(out_dir, quick: bool = False, seed: int = 0) -> dict:
    """Run both experiments (or reuse cached runs) and write ``spike_slab.{md,png,json}``."""
    s = _settings(quick)
    result = TargetResult(NAME, TITLE, quick, seed, params=s, paper=PAPER)
    runs_dir = Path(out_dir) / f"{NAME}_runs" / ("quick" if quick else "full")
    r, c = s["regression"], s["classifier"]
    regression, classifier = [], []
    threads = torch.get_num_threads()
    if quick:
        torch.set_num_threads(1)
    try:
        with timed(result):
            for sd in [seed + i for i in range(r["seeds"])]:
                for ex in r["examples"]:
                    for estep in r["esteps"]:
                        if sd - seed >= r.get("seeds_per_estep", {}).get(estep, r["seeds"]):
                            continue
                        row, hit = _cached(runs_dir, f"regression-ex{ex}-{estep}-seed{sd}",
                                           _key(r, f"ex{ex}-{estep}", sd), lambda: regression_run(ex, estep, r, sd))
                        regression.append(row)
                        took = "cached" if hit else f"{row['seconds']:.0f} s"
                        log(f"example {ex} ({estep} E-step) seed {sd}: kept inputs {row['kept_inputs']}, sparsity "
                            f"{100 * row['sparsity_all_parameters']:.2f} % ({took})")
            for sd in [seed + i for i in range(c["seeds"])]:
                rows, hit = _cached(runs_dir, f"classifier-seed{sd}", _key(c, "classifier", sd),
                                    lambda: classifier_runs(c, sd))
                classifier += rows
                log(f"classifier seed {sd}: " + ", ".join(f"{x['method']} {100 * x['accuracy']:.2f} % at "
                                                          f"{100 * x['sparsity']:.1f} %" for x in rows))
    finally:
        torch.set_num_threads(threads)
    result.seeds = sorted({x["seed"] for x in regression + classifier})
    result.rows = {"regression": regression, "classifier": classifier}
    return report(out_dir, result)


def rerender(out_dir) -> dict:
    """Rebuild ``spike_slab.{md,png}`` from ``spike_slab.json`` (no training)."""
    return report(out_dir, load_result(out_dir, NAME))


def _mean_sd(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.4g}"
    return f"{np.mean(values):.4g} ± {np.std(values, ddof=1):.2g}"


def report(out_dir, result: TargetResult) -> dict:
    s = result.params
    r, c = s["regression"], s["classifier"]
    reg, cls = result.rows["regression"], result.rows["classifier"]
    for ex in r["examples"]:
        metric, sparsity, kept = NOTEBOOK[ex]
        for estep in r["esteps"]:
            rows = [x for x in reg if x["example"] == ex and x["estep"] == estep]
            if not rows:
                continue
            exact = sum(x["kept_inputs"] == [k for k in kept] for x in rows)
            if "test_mse" in rows[0]:
                ours_metric = (f"test MSE {_mean_sd([x['test_mse'] for x in rows])} (BMA "
                               f"{_mean_sd([x['test_mse_bma'] for x in rows])})")
            else:
                ours_metric = (f"test acc {_mean_sd([100 * x['test_accuracy'] for x in rows])} %, BCE "
                               f"{_mean_sd([x['test_bce'] for x in rows])}")
            scale = (f"p = {rows[0]['p']}, n = {rows[0]['n_train']}, {rows[0]['epochs']} epochs, "
                     f"{len(rows)} seed(s), {estep} E-step")
            result.compare(f"example {ex}: {metric.split(' ')[0] + ' ' + metric.split(' ')[1]}", metric, ours_metric,
                           scale, "the notebooks' single run vs ours; test data drawn with its own seed"
                           + (" (quick: smaller p, n and epochs)" if result.quick else ""))
            result.compare(f"example {ex}: sparsity (all parameters), surviving inputs",
                           f"{sparsity} %, columns {kept}",
                           f"{_mean_sd([100 * x['sparsity_all_parameters'] for x in rows])} %; exactly the notebook's "
                           f"columns in {exact}/{len(rows)} run(s); columns: "
                           + "; ".join(str(x["kept_inputs"]) for x in rows),
                           scale, "—" if exact == len(rows) else "measured")
    em = [x for x in cls if x["method"] == "em"]
    for x in em:
        mag = next(m for m in cls if m["method"] == "magnitude" and m["spike_decay"] == x["spike_decay"]
                   and m.get("soft_threshold") == x.get("soft_threshold") and m["seed"] == x["seed"])
        dense = next(m for m in cls if m["method"] == "dense" and m["seed"] == x["seed"])
        b, a = x["shrink"]["before"], x["shrink"]["after"]
        result.compare(f"{c['model']} / {c['dataset']}, spike decay {x['spike_decay']}, soft threshold "
                       f"{x.get('soft_threshold')}: accuracy at "
                       f"{100 * x['sparsity']:.1f} % sparsity", "— (not in the paper)",
                       f"EM one-shot {100 * x['accuracy']:.2f} % vs magnitude {100 * mag['accuracy']:.2f} % "
                       f"(dense {100 * dense['accuracy']:.2f} %); {b['parameters']:,} → {a['parameters']:,} "
                       f"parameters, {b['macs']:,} → {a['macs']:,} MACs/example",
                       f"{c['epochs']} epochs, seed {x['seed']}", "the paper reports CIFAR/ImageNet only (tables not available)")
    reg_rows = []
    for x in reg:
        err = (f"{x['test_mse']:.3f} / {x['test_mse_bma']:.3f}" if "test_mse" in x else
               f"{100 * x['test_accuracy']:.1f} % / {100 * x['test_accuracy_bma']:.1f} %")
        reg_rows.append((x["example"], x["estep"], x["seed"], x["p"], x["epochs"], err,
                         f"{100 * x['sparsity_all_parameters']:.2f}", f"{100 * x['sparsity_grouped_weights']:.2f}",
                         str(x["kept_inputs"]), f"{x['shrink']['before']['parameters']} → {x['shrink']['after']['parameters']}",
                         f"{x['seconds']:.0f}"))
    result.section("Sparse regression, every run", md_table(
        ("ex.", "E-step", "seed", "p", "epochs", "test MSE or acc: final / BMA", "sparsity, all params (%)",
         "sparsity, grouped weights (%)", "surviving inputs (1-based)", "parameters before → after shrink",
         "train s"), reg_rows))
    cls_rows = [(x["method"], x["seed"], "—" if x["spike_decay"] is None else f"{x['spike_decay']} / {x.get('soft_threshold')}",
                 f"{100 * x['accuracy']:.2f}", f"{100 * x['sparsity']:.2f}",
                 f"{x['shrink']['before']['parameters']:,} → {x['shrink']['after']['parameters']:,}" if "shrink" in x
                 else "—",
                 f"{x['shrink']['before']['macs']:,} → {x['shrink']['after']['macs']:,}" if "shrink" in x else "—",
                 f"{100 * x['accuracy_shrunk']:.2f}" if "accuracy_shrunk" in x else "—") for x in cls]
    result.section(f"Accuracy vs sparsity ({c['model']} on {c['dataset']})", md_table(
        ("method", "seed", "spike decay / soft threshold", "test accuracy (%)", "sparsity of grouped weights (%)",
         "parameters (dense → shrunk)", "MACs / example (dense → shrunk)", "accuracy of the shrunk network (%)"),
        cls_rows) + "\n\nMagnitude: unstructured pruning of the dense network (the same optimizer and schedule "
                    "without the spike-and-slab prior) to the EM run's per-layer sparsity, no retraining.")
    result.scale = (f"Regression: examples {r['examples']}, n = {r['n_train']} training / {r['n_test']} test, "
                    + (f"p = {r['p']}, {r['epochs']} epochs, " if r["p"] else "the notebooks' p and epochs, ")
                    + f"batch {r['batch']}, {r['cycles']} cosine cycles, EM after {r['warmup']} warm-up epochs, "
                    f"{r['seeds']} seed(s) (per E-step: {r.get('seeds_per_estep') or 'all'}), E-steps {r['esteps']}. Classifier: {c['model']} on {c['dataset']}, "
                    f"{c['epochs']} epochs, batch {c['batch']}, lr {c['lr']}, {c['cycles']} cycles, (spike decay, soft "
                    f"threshold) ∈ {c['sweep']}, hard threshold {c['hard_threshold']}. The paper: CIFAR-10/100 and ImageNet on GPUs (tables not available).")
    return write_target(out_dir, result, plot)


def plot(result: TargetResult, path) -> None:
    import matplotlib.pyplot as plt

    cls = result.rows["classifier"]
    reg = result.rows["regression"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for method, color in (("em", "#5a5"), ("magnitude", "#a75")):
        pts = sorted((x["sparsity"], x["accuracy"]) for x in cls if x["method"] == method)
        if pts:
            axes[0].plot([100 * p for p, _ in pts], [100 * a for _, a in pts], "o-", color=color,
                         label="EM one-shot" if method == "em" else "magnitude (same sparsity)")
    dense = [x for x in cls if x["method"] == "dense"]
    if dense:
        axes[0].axhline(100 * np.mean([x["accuracy"] for x in dense]), color="#777", ls="--", label="dense")
    axes[0].set_xlabel("sparsity of grouped weights (%)")
    axes[0].set_ylabel("test accuracy (%)")
    axes[0].legend()
    axes[0].set_title(f"{result.params['classifier']['model']} / {result.params['classifier']['dataset']}")
    labels = [f"ex{x['example']} {x['estep'][:4]} s{x['seed']}" for x in reg]
    axes[1].bar(labels, [100 * x["sparsity_all_parameters"] for x in reg], color="#59a")
    for ex, (_, sp, _) in NOTEBOOK.items():
        if any(x["example"] == ex for x in reg):
            axes[1].axhline(sp, color="#a55", lw=0.8, ls=":")
    axes[1].set_ylabel("sparsity, all parameters (%)")
    axes[1].set_ylim(90, 100)
    axes[1].tick_params(axis="x", rotation=60)
    axes[1].set_title("sparse regression (dotted: notebooks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


__all__ = ["run", "rerender", "make_regression", "regression_run", "classifier_runs", "plot"]
