"""Seed 001's random-labels experiment (Molchanov et al., 2017, §5.3; Zhang et al., 2017).

The training labels are replaced by a seeded random permutation of themselves, so they carry no
information about the inputs. A plain fully connected network (LeNet-300-100, cross-entropy, no
regularisation) memorises them: train accuracy → 100 %, test accuracy at chance. The same network
with Sparse VD (``posterior="sparse_vd"``, ``-mg.nn.elbo``) finds nothing worth keeping: after
pruning at log α > 3 (almost) every weight is gone and the network predicts at chance on both
sets. Train accuracy is measured on the shuffled labels it was trained on.
"""

from __future__ import annotations

import numpy as np
import torch

from .common import TargetResult, log, md_table, timed, write_target

NAME = "random_labels"
TITLE = "Seed 001: random labels — a dense network memorises, Sparse VD prunes to an (almost) empty model"
PAPER = ("Molchanov, Ashukha, Vetrov. Variational Dropout Sparsifies Deep Neural Networks. ICML 2017, §5.3 "
         "(seed 001's 'Random Labeling' slide)")
ARMS = ("dense", "sparse_vd")
LABELS = {"dense": "FC (plain)", "sparse_vd": "FC + Sparse VD"}
#: The seed's MNIST rows: train accuracy %, test accuracy %, sparsity % (FC + BD: binary dropout).
PAPER_ROWS = {"dense": (100, 10, "—"), "sparse_vd": (10, 10, 100)}


def _settings(quick: bool) -> dict:
    # The digits in both modes: memorising 50 000 random MNIST labels takes far more epochs than a shared
    # 2-core CPU affords (the seed trains for hundreds of epochs on a GPU).
    if quick:
        return {"dataset": "digits", "seeds": 1, "epochs": 40, "warmup": 10, "batch": 64, "lr": 1e-3}
    return {"dataset": "digits", "seeds": 3, "epochs": 100, "warmup": 10, "batch": 64, "lr": 1e-3}


@torch.no_grad()
def _accuracy(model, x, y) -> float:
    from .sparsify import predict_probs

    return float((predict_probs(model, x, None, 0).argmax(-1) == y).double().mean())


def run_one(arm: str, s: dict, seed: int) -> dict:
    import mcgraph.nn as mnn

    from .sparsify import fit, load, network

    ds = load(s["dataset"], seed)
    y_shuffled = ds.y_train[torch.randperm(ds.y_train.numel(), generator=torch.Generator().manual_seed(seed + 99))]
    model = network("lenet300_100", ds, seed)
    bayesian = arm == "sparse_vd"
    if bayesian:
        model = mnn.bayesify(model, posterior="sparse_vd", inplace=True)
    sec = fit(model, ds.x_train, y_shuffled, bayesian=bayesian, epochs=s["epochs"], batch=s["batch"], lr=s["lr"],
              seed=seed, warmup_epochs=s["warmup"] if bayesian else 0)
    row = {"arm": arm, "seed": seed, "epochs": s["epochs"], "seconds_per_epoch": sec,
           "train_examples": int(ds.x_train.shape[0]),
           "label_agreement": float((y_shuffled == ds.y_train).double().mean())}
    if bayesian:
        report = mnn.prune(model)
        mnn.freeze(model)
        row.update({"sparsity": report.sparsity, "per_layer_sparsity": [la.sparsity for la in report.layers],
                    "nonzero": report.kept, "weights": report.total})
    row.update({"train_accuracy": _accuracy(model, ds.x_train, y_shuffled),
                "test_accuracy": _accuracy(model, ds.x_test, ds.y_test)})
    return row


def run(out_dir, quick: bool = False, seed: int = 0) -> dict:
    s = _settings(quick)
    result = TargetResult(NAME, TITLE, quick, seed, params=s, paper=PAPER)
    seeds = [seed + i for i in range(s["seeds"])]
    runs = []
    with timed(result):
        for sd in seeds:
            for arm in ARMS:
                r = run_one(arm, s, sd)
                runs.append(r)
                log(f"{LABELS[arm]} seed {sd}: train {100 * r['train_accuracy']:.1f} %, test "
                    f"{100 * r['test_accuracy']:.1f} %"
                    + (f", sparsity {100 * r['sparsity']:.2f} %" if "sparsity" in r else ""))
    result.seeds = seeds
    result.rows = {"runs": runs}
    return report(out_dir, result)


def report(out_dir, result: TargetResult) -> dict:
    s = result.params
    runs = result.rows["runs"]
    result.scale = (f"LeNet-300-100 on {s['dataset']} ({runs[0]['train_examples']} training examples, labels "
                    f"permuted at random: {100 * np.mean([r['label_agreement'] for r in runs]):.1f} % agree with the "
                    f"truth by chance), {s['epochs']} epochs (Sparse VD: KL warm-up {s['warmup']}), "
                    f"batch {s['batch']}, "
                    f"Adam lr {s['lr']}, seeds {result.seeds}. The seed: MNIST (and CIFAR-10 with VGG).")
    rows = []
    for arm in ARMS:
        rs = [r for r in runs if r["arm"] == arm]
        tr = [100 * r["train_accuracy"] for r in rs]
        te = [100 * r["test_accuracy"] for r in rs]
        sp = [100 * r["sparsity"] for r in rs if "sparsity" in r]
        p = PAPER_ROWS[arm]
        ours = f"train {np.mean(tr):.1f} %, test {np.mean(te):.1f} %"
        ours += f", sparsity {np.mean(sp):.2f} %" if sp else ""
        result.compare(f"MNIST → {s['dataset']}: {LABELS[arm]}", f"train {p[0]} %, test {p[1]} %"
                       + (f", sparsity {p[2]} %" if arm == "sparse_vd" else ""), ours,
                       f"{s['epochs']} epochs, {len(rs)} seeds",
                       "the seed's dense arm uses binary dropout; ours is plain" if arm == "dense" else
                       "different dataset; same effect expected")
        rows.append((LABELS[arm], p[0], p[1], p[2], f"{np.mean(tr):.1f}", f"{np.mean(te):.1f}",
                     f"{np.mean(sp):.2f}" if sp else "—"))
    result.section("The table, seed vs ours", md_table(
        ("architecture", "seed train acc %", "seed test acc %", "seed sparsity %", "ours train acc %",
         "ours test acc %", "ours sparsity %"), rows))
    result.section("Every run", md_table(
        ("arm", "seed", "train acc %", "test acc %", "sparsity per layer %", "nonzero / weights", "s/epoch"),
        [(LABELS[r["arm"]], r["seed"], f"{100 * r['train_accuracy']:.1f}", f"{100 * r['test_accuracy']:.1f}",
          " – ".join(f"{100 * v:.2f}" for v in r.get("per_layer_sparsity", [])) or "—",
          f"{r['nonzero']} / {r['weights']}" if "nonzero" in r else "—", f"{r['seconds_per_epoch']:.2f}")
         for r in runs]))
    return write_target(out_dir, result, plot)


def plot(result: TargetResult, path) -> None:
    import matplotlib.pyplot as plt

    runs = result.rows["runs"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.25
    for j, (key, label) in enumerate((("train_accuracy", "train acc"), ("test_accuracy", "test acc"),
                                      ("sparsity", "sparsity"))):
        vals = [100 * np.mean([r.get(key, 0.0) for r in runs if r["arm"] == arm]) for arm in ARMS]
        ax.bar(np.arange(len(ARMS)) + (j - 1) * width, vals, width, label=label)
    ax.set_xticks(range(len(ARMS)), [LABELS[a] for a in ARMS])
    ax.set_ylabel("%")
    ax.set_ylim(0, 105)
    ax.legend()
    ax.set_title(f"random labels, {result.params['dataset']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


__all__ = ["run", "run_one", "report", "plot"]
