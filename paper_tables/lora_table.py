"""Bayesian fine-tuning of a pretrained transformer: LoRA, MC-dropout LoRA, last-layer Bayesian, variational LoRA.

A small transformer classifier is **pretrained** on upright handwritten digits read row by row, then
**fine-tuned** on a shifted task with little data, four ways, and every arm is scored the same way on
the shifted test set: accuracy, NLL, ECE (15 bins), Brier, and the AUROC of telling out-of-distribution
inputs from the test inputs by predictive entropy.

**Data, and why.** scikit-learn's digits (1 797 images of 8 × 8 pixels, bundled with scikit-learn, so
the target runs offline on any machine and in CI in seconds), each image a sequence of 8 rows of 8
pixels. The images are split once per seed into two disjoint halves: the *source* half (upright
digits) pretrains the network; the *target* half is turned by 90° — every row of the sequence becomes a
column, so the pretrained attention and feed-forward weights meet inputs they never saw, while the
classes stay the same — and split into a small fine-tuning set (``finetune`` examples, the few-shot
regime where Bayesian fine-tuning is meant to help calibration) and a test set. Rotating is exact on a
pixel grid (no interpolation), and the shift is strong enough that the frozen pretrained features alone
(the last-layer arm) do not solve the task. MNIST rows → rotated MNIST rows would be the same design at
a scale a shared 2-core CPU does not run in minutes for four arms × three seeds. Out-of-distribution
inputs: Gaussian noise with the fine-tuning images' per-pixel mean and standard deviation (``noise``),
and the upright source-domain test digits (``upright``: the pretraining domain, which the fine-tuned
model should no longer be sure about).

**Network.** A pre-norm transformer encoder (:class:`RowTransformer`): a linear embedding of each row
plus a learned position table, ``layers`` blocks of multi-head self-attention with explicit ``q``,
``k``, ``v``, ``o`` projections and a ``fc1``/``fc2`` feed-forward, a final LayerNorm, mean pooling and
a linear ``head``. Every projection is an ``nn.Linear``, so LoRA can target the attention as in Hu et
al. (2021) (torch's ``nn.TransformerEncoderLayer`` reads its weights directly on its eval fast path).

**Arms** (the same pretrained weights per seed; the pretrained tensors stay frozen in every arm):

* **LoRA** — peft's ``LoraConfig`` (rank ``rank``, α = 2·rank) on q, k, v, o, fc1, fc2, the head
  trained in full (``modules_to_save``), Adam on the cross-entropy; predictions: the network.
* **MC-dropout LoRA** — the same with ``lora_dropout = p`` on the adapters' input, the dropout kept on
  at prediction (:func:`mcgraph.nn.mc_dropout`, ``predict`` samples).
* **Last-layer Bayesian** — :func:`mcgraph.nn.last_layer`: the head made Bayesian (Normal posterior,
  N(0, 1) prior), everything else frozen, Adam on ``-mg.nn.elbo``.
* **Variational LoRA (mcgraph)** — :func:`mcgraph.nn.bayesian_lora` on the same six projections (A
  Bayesian, B a point estimate at 0 — BLoB, Wang et al., 2024), the head trained as a point estimate,
  Adam on ``-mg.nn.elbo`` with ``train_samples`` samples per step and the full KL / N. The prior on A
  is N(0, ``prior_std``²) with ``prior_std`` = 0.1, the standard deviation of A's Kaiming-uniform
  initialisation at d_model 32 (1/√(3·32) ≈ 0.10): the prior says "an adapter of the size it starts
  at". With N(0, 1) a first full run (seed 0 only) left σ to grow where 300 examples do not constrain
  A and the predictive was underconfident (ECE 0.27; N(0, 0.2²): 0.15); the choice of 0.1 was made
  from those two seed-0 runs, not tuned further.

Bayesian arms and MC dropout predict with ``predict`` samples through :func:`mcgraph.nn.predict`.
Full: 3 seeds, the epochs of :func:`_settings`; ``--quick``: 2 seeds and few epochs (the CI run). Runs
are cached under ``lora_table_runs/`` keyed by their configuration. Run with
``python -m paper_tables lora_table [--quick] [--threads 1] [--out DIR]``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import vogn_table as vt
from .common import (TargetResult, cached_row, config_key, fmt_mean_sd, load_result, md_table, predictive_probs,
                     run_arms, write_cache, write_target)

NAME = "lora_table"
TITLE = ("Bayesian fine-tuning: LoRA, MC-dropout LoRA, last-layer Bayesian and variational LoRA on a shifted "
         "task — accuracy, NLL, ECE, OOD AUROC")
PAPER = ("no single published table: the expectations are those of Wang, Shi, Han, Metaxas, Wang, BLoB: Bayesian "
         "Low-Rank Adaptation by Backpropagation for Large Language Models (NeurIPS 2024) and Yang, Robeyns, Wang, "
         "Aitchison, Bayesian Low-rank Adaptation for Large Language Models (ICLR 2024)")
ARMS = ("lora", "mc_dropout", "last_layer", "variational_lora")
LABELS = {"lora": "LoRA (peft)", "mc_dropout": "MC-dropout LoRA (peft + mcgraph)",
          "last_layer": "last-layer Bayesian (mcgraph)", "variational_lora": "variational LoRA (mcgraph)"}
EXPECTED = ("Bayesian fine-tuning keeps LoRA's accuracy within a few points and lowers NLL and ECE; "
            "variational LoRA is better calibrated than MC dropout and last-layer methods")
ADAPTED = ("q", "k", "v", "o", "fc1", "fc2")


def _settings(quick: bool) -> dict:
    common = {"source": 1000, "finetune": 300, "batch": 32, "pretrain_batch": 64, "pretrain_lr": 3e-3, "lr": 1e-2,
              "rank": 4, "dropout": 0.1, "rho_init": -5.0, "prior_std": 0.1}
    if quick:  # the CI run: a smaller network, few epochs
        return common | {"pretrain_epochs": 10, "epochs": 8, "seeds": 2, "threads": 1, "predict": 8,
                         "train_samples": 1, "network": {"d_model": 16, "heads": 2, "layers": 1, "ff": 32}}
    return common | {"pretrain_epochs": 40, "epochs": 60, "seeds": 3, "threads": None, "predict": 32,
                     "train_samples": 4, "network": {"d_model": 32, "heads": 4, "layers": 2, "ff": 64}}


# --------------------------------------------------------------------------- network


class Block(nn.Module):
    """Pre-norm block: ``h + o(attention(q, k, v)(ln1 h))``, then ``h + fc2(gelu(fc1(ln2 h)))``."""

    def __init__(self, d_model: int, heads: int, ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d_model, ff), nn.Linear(ff, d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (N, T, d)
        n, t, d = h.shape
        x = self.ln1(h)

        def split(z):  # (N, T, d) -> (N, heads, T, d / heads)
            return z.reshape(n, t, self.heads, d // self.heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        h = h + self.o(a.transpose(1, 2).reshape(n, t, d))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class RowTransformer(nn.Module):
    """A transformer classifier of ``(N, T, F)`` sequences (images read by rows): ``(N, classes)`` logits."""

    def __init__(self, features: int, steps: int, classes: int, d_model: int, heads: int, layers: int,
                 ff: int) -> None:
        super().__init__()
        self.embed = nn.Linear(features, d_model)
        self.position = nn.Parameter(torch.randn(steps, d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(d_model, heads, ff) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.position[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(1))


# --------------------------------------------------------------------------- data


def data(s: dict, seed: int) -> SimpleNamespace:
    """The seed's split: upright source digits, rotated fine-tuning / test digits, OOD inputs (all ``(N, 8, 8)``)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(x.shape[0], generator=g)
    src, tgt = perm[: s["source"]], perm[s["source"]:]
    rotated = torch.rot90(x[tgt], 1, dims=(1, 2)).contiguous()  # rows become columns
    ft = s["finetune"]
    x_ft = rotated[:ft]
    mean, std = x_ft.mean(0), x_ft.std(0)
    n_test = rotated.shape[0] - ft
    noise = (mean + std * torch.randn((n_test, 8, 8), generator=g)).clamp(0, 1)
    upright_test = x[src[-n_test:]]  # source-domain digits (seen in pretraining: the pretraining domain itself)
    return SimpleNamespace(x_source=x[src], y_source=y[src], x_train=x_ft, y_train=y[tgt][:ft],
                           x_test=rotated[ft:], y_test=y[tgt][ft:], ood={"noise": noise, "upright": upright_test})


# --------------------------------------------------------------------------- pretraining and the four arms

_PRETRAINED: dict = {}


def _network(s: dict) -> RowTransformer:
    n = s["network"]
    return RowTransformer(8, 8, 10, n["d_model"], n["heads"], n["layers"], n["ff"])


def pretrained(s: dict, seed: int, ds) -> tuple[RowTransformer, float]:
    """The network trained on the upright source digits (Adam, cross-entropy), computed once per seed and
    process, and its accuracy on the rotated test digits (before any fine-tuning)."""
    key = (json.dumps({k: s[k] for k in ("source", "pretrain_batch", "pretrain_lr", "pretrain_epochs", "network")},
                      sort_keys=True), seed)
    if key not in _PRETRAINED:
        torch.manual_seed(seed)
        net = _network(s)
        _fit_plain(net, ds.x_source, ds.y_source, s["pretrain_epochs"], s["pretrain_batch"], s["pretrain_lr"],
                   seed + 17)
        with torch.no_grad():
            accuracy = float((net.eval()(ds.x_test).argmax(-1) == ds.y_test).float().mean())
        _PRETRAINED[key] = ({k: v.clone() for k, v in net.state_dict().items()}, accuracy)
    state, accuracy = _PRETRAINED[key]
    net = _network(s)
    net.load_state_dict(state)
    return net.eval(), accuracy


def _fit_plain(model, x, y, epochs, batch, lr, seed) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(x.shape[0], generator=gen)
        for b in range(0, x.shape[0], batch):
            idx = perm[b:b + batch]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def _fit_elbo(model, x, y, s, seed) -> None:
    import mcgraph.nn as mnn

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=s["lr"])
    gen = torch.Generator().manual_seed(seed)
    step = 0
    for _ in range(s["epochs"]):
        model.train()
        perm = torch.randperm(x.shape[0], generator=gen)
        for b in range(0, x.shape[0], s["batch"]):
            idx = perm[b:b + s["batch"]]
            loss = -mnn.elbo(model, x[idx], y[idx], num_samples=s["train_samples"], dataset_size=x.shape[0],
                             seed=seed * 1_000_003 + step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1


def build(arm: str, s: dict, base: RowTransformer) -> nn.Module:
    """The arm's model around the pretrained ``base`` (its tensors frozen)."""
    import mcgraph.nn as mnn

    if arm in ("lora", "mc_dropout"):
        import peft

        config = peft.LoraConfig(r=s["rank"], lora_alpha=2 * s["rank"], target_modules=list(ADAPTED),
                                 lora_dropout=s["dropout"] if arm == "mc_dropout" else 0.0, modules_to_save=["head"])
        return peft.get_peft_model(base, config)
    if arm == "last_layer":
        return mnn.last_layer(base, posterior="normal", prior="normal", rho_init=s["rho_init"])
    if arm == "variational_lora":
        return mnn.bayesian_lora(base, rank=s["rank"], alpha=2 * s["rank"],
                                 targets=[f"blocks.*.{name}" for name in ADAPTED], trainable="head",
                                 posterior="normal", prior=torch.distributions.Normal(0.0, s["prior_std"]),
                                 rho_init=s["rho_init"])
    raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")


def fit(arm: str, s: dict, ds, seed: int):
    """Fine-tune one arm; returns ``(predictor, deterministic?, seconds per epoch, trainable parameters, the
    pretrained network's accuracy on the rotated test digits)``."""
    import mcgraph.nn as mnn

    base, row_accuracy = pretrained(s, seed, ds)
    torch.manual_seed(seed + 1)  # the adapters' initialisation: the same whatever ran before in the process
    model = build(arm, s, base)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    t0 = time.perf_counter()
    if arm in ("lora", "mc_dropout"):
        _fit_plain(model, ds.x_train, ds.y_train, s["epochs"], s["batch"], s["lr"], seed)
    else:
        _fit_elbo(model, ds.x_train, ds.y_train, s, seed)
    seconds = (time.perf_counter() - t0) / s["epochs"]
    changed = [n for n, p in model.named_parameters() if n in frozen and not torch.equal(p, frozen[n])]
    if changed:
        raise RuntimeError(f"{arm}: pretrained tensors changed during fine-tuning: {changed[:3]}")
    if arm == "lora":
        return model.eval(), True, seconds, trainable, row_accuracy
    if arm == "mc_dropout":
        return mnn.mc_dropout(model), False, seconds, trainable, row_accuracy
    return model.eval(), False, seconds, trainable, row_accuracy


def _key(s: dict, arm: str, seed: int) -> str:
    cfg = {k: v for k, v in s.items() if k not in ("seeds", "threads")}
    cfg.update({"arm": arm, "seed": seed})
    return config_key(cfg)


def run_arm(arm: str, s: dict, seed: int, runs_dir: Path | None = None) -> dict:
    """Fine-tune and score one arm with one seed (cached in ``runs_dir`` by configuration)."""
    from mcgraph import metrics

    key = _key(s, arm, seed)
    cache = None if runs_dir is None else runs_dir / f"{arm}-seed{seed}.json"
    cached = cached_row(cache, key)
    if cached is not None:
        return cached
    row = {"key": key, "arm": arm, "seed": seed, "epochs": s["epochs"], "seconds_per_epoch": None, "cached": False}
    if arm in ("lora", "mc_dropout") and importlib.util.find_spec("peft") is None:
        row["missing"] = "peft is not installed (make interop)"
        return row
    ds = data(s, seed)
    row.update({"source_examples": int(ds.x_source.shape[0]), "train_examples": int(ds.x_train.shape[0]),
                "test_examples": int(ds.x_test.shape[0])})
    (predictor, deterministic, row["seconds_per_epoch"], row["trainable_parameters"],
     row["pretrained_test_accuracy"]) = fit(arm, s, ds, seed)
    t0 = time.perf_counter()
    probs = predictive_probs(predictor, deterministic, ds.x_test, s["predict"], seed)
    row["test"] = vt.score(probs, ds.y_test)
    entropy_in = metrics.predictive_entropy(probs)
    row["ood"] = {}
    for kind, x_ood in ds.ood.items():
        p_ood = predictive_probs(predictor, deterministic, x_ood, s["predict"], seed + 1)
        row["ood"][kind] = float(metrics.auroc(entropy_in, metrics.predictive_entropy(p_ood)))
    row["predict_seconds"] = time.perf_counter() - t0
    if cache is not None:
        write_cache(cache, row)
    return row


def aggregate(runs: list) -> dict:
    """``{arm: {score: (mean, sample std)}}`` over the seeds."""
    out = {}
    for arm in ARMS:
        rs = [r for r in runs if r["arm"] == arm and "test" in r]
        if not rs:
            continue
        values = {k: [r["test"][k] for r in rs] for k in ("accuracy", "nll", "ece", "brier")}
        values["seconds_per_epoch"] = [r["seconds_per_epoch"] for r in rs]
        values["pretrained_accuracy"] = [r["pretrained_test_accuracy"] for r in rs]
        for kind in ("noise", "upright"):
            values[f"ood_{kind}"] = [r["ood"][kind] for r in rs]
        row = {"seeds": [r["seed"] for r in rs], "trainable_parameters": rs[0]["trainable_parameters"]}
        for k, v in values.items():
            row[k] = (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0)
        out[arm] = row
    return out


def run(out_dir, quick: bool = False, seed: int = 0) -> dict:
    """Pretrain, fine-tune every arm × seed (or reuse cached runs) and write ``lora_table.{md,png,json}``."""
    s = _settings(quick)
    result = TargetResult(NAME, TITLE, quick, seed, params=s, paper=PAPER)
    runs_dir = Path(out_dir) / f"{NAME}_runs" / ("quick" if quick else "full")
    runs = run_arms(result, s, seed, ARMS, LABELS, run_arm, runs_dir)
    result.rows = {"runs": runs}
    missing = sorted({r["missing"] for r in runs if "missing" in r})
    if missing:
        result.status = "reduced: " + "; ".join(missing)
    return report(out_dir, result)


def rerender(out_dir) -> dict:
    """Rebuild ``lora_table.{md,png}`` from ``lora_table.json`` (no training)."""
    return report(out_dir, load_result(out_dir, NAME))


def report(out_dir, result: TargetResult) -> dict:
    """Aggregate the runs, fill the comparisons and sections, write the target."""
    s = result.params
    runs = result.rows["runs"]
    agg = aggregate(runs)
    result.rows["aggregate"] = agg
    n = s["network"]
    sizes = next((r for r in runs if "train_examples" in r), None)
    counts = (f"{sizes['source_examples']} upright source digits, {sizes['train_examples']} rotated fine-tuning / "
              f"{sizes['test_examples']} rotated test digits" if sizes else "digits")
    result.scale = (f"sklearn digits read by rows (8 steps of 8 pixels): {counts}; pretraining {s['pretrain_epochs']} "
                    f"epochs (Adam lr {s['pretrain_lr']}, batch {s['pretrain_batch']}), fine-tuning {s['epochs']} epochs (Adam lr {s['lr']}), batch "
                    f"{s['batch']}, seeds {result.seeds}. Network: pre-norm transformer, d_model {n['d_model']}, "
                    f"{n['heads']} heads, {n['layers']} blocks, feed-forward {n['ff']}. LoRA rank {s['rank']} (α = "
                    f"{2 * s['rank']}) on q, k, v, o, fc1, fc2 with the head trained; MC dropout p = {s['dropout']}; "
                    f"Bayesian arms: Normal posterior (ρ₀ = {s['rho_init']}), prior N(0, 1) on the head "
                    f"(last layer) and N(0, {s['prior_std']}²) on the adapters' A, {s['train_samples']} "
                    f"samples per step, KL / N at weight 1. Predictive distributions from {s['predict']} samples "
                    "(LoRA: the network). CPU, this machine under its load.")
    base = agg.get("lora")
    for arm in ("mc_dropout", "last_layer", "variational_lora"):
        a = agg.get(arm)
        if a is None or base is None:
            continue
        gap = 100 * (a["accuracy"][0] - base["accuracy"][0])
        calibrated = a["nll"][0] <= base["nll"][0] and a["ece"][0] <= base["ece"][0]
        result.compare(f"{LABELS[arm]} vs LoRA", EXPECTED,
                       f"Δacc {gap:+.2f} pp; NLL {a['nll'][0]:.3f} vs {base['nll'][0]:.3f}; ECE {a['ece'][0]:.3f} vs "
                       f"{base['ece'][0]:.3f}; noise AUROC {a['ood_noise'][0]:.3f} vs {base['ood_noise'][0]:.3f}: "
                       "calibration " + ("holds" if calibrated else "does not hold"),
                       f"digits → rotated digits, {len(a['seeds'])} seeds", "a small network and data set, CPU")
    rows = [(LABELS[arm], a["trainable_parameters"], fmt_mean_sd(a["accuracy"], 100, 2), fmt_mean_sd(a["nll"]),
             fmt_mean_sd(a["ece"]), fmt_mean_sd(a["brier"]), fmt_mean_sd(a["ood_noise"]), fmt_mean_sd(a["ood_upright"]),
             f"{a['seconds_per_epoch'][0]:.2f}")
            for arm, a in agg.items()]
    result.section("The table", md_table(("fine-tuning", "trainable parameters", "test accuracy (%)", "NLL", "ECE",
                                          "Brier", "OOD AUROC (noise)", "OOD AUROC (upright digits)", "s/epoch"),
                                         rows))
    if agg:
        pre = next(iter(agg.values()))["pretrained_accuracy"]
        result.section("Before fine-tuning", f"The pretrained network's accuracy on the rotated test digits: "
                       f"{fmt_mean_sd(pre, 100, 2)} % (mean ± sd over seeds): the shift is real.")
    per_run = [(LABELS[r["arm"]], r["seed"],
                *(("—",) * 5 if "test" not in r else (
                    f"{100 * r['test']['accuracy']:.2f}", f"{r['test']['nll']:.4f}", f"{r['test']['ece']:.4f}",
                    f"{r['ood']['noise']:.4f}", f"{r['ood']['upright']:.4f}")),
                "—" if r["seconds_per_epoch"] is None else f"{r['seconds_per_epoch']:.2f}",
                "yes" if r.get("cached") else "no") for r in runs]
    result.section("Every run", md_table(("fine-tuning", "seed", "test acc (%)", "NLL", "ECE", "AUROC noise",
                                          "AUROC upright", "s/epoch", "reused"), per_run))
    result.section("How it is measured", "ECE: 15 equal-width confidence bins (`mcgraph.metrics.ece`). OOD AUROC: "
                   "`mcgraph.metrics.auroc` of the predictive entropy, out-of-distribution inputs as positives, the "
                   "rotated test digits as negatives; noise: Gaussian with the fine-tuning images' per-pixel mean and "
                   "standard deviation, clipped to [0, 1]; upright: source-domain digits (the pretraining domain). "
                   "Every arm checks that the pretrained tensors are bitwise unchanged after fine-tuning. Time per "
                   "epoch: wall time of the fine-tuning loop only, on this machine under its load. The adapters' "
                   f"prior N(0, {s['prior_std']}²) (the scale of A's initialisation) was fixed after two seed-0 "
                   "runs of the variational arm at full scale: with N(0, 1) its ECE was 0.27, with N(0, 0.2²) "
                   "0.15 (underconfident: σ grew where 300 examples do not constrain A); it was not tuned further.")
    env = result.env or {}
    load = env.get("load_average_1min_at_start")
    result.section("How it was run", f"`python -m paper_tables {NAME}{' --quick' if result.quick else ''} --threads "
                   f"{env.get('torch_threads', '?')}`: wall time {result.wall_s:.1f} s for every arm and seed "
                   f"(pretraining included, cached runs excepted), on {env.get('cpu_count', '?')} CPUs whose 1-minute "
                   f"load average was {'?' if load is None else f'{load:.1f}'} at the start (other work shared "
                   "the machine: the times are indicative, the accuracies and scores are not affected).")
    return write_target(out_dir, result, plot)


def plot(result: TargetResult, path) -> None:
    """Test accuracy, NLL, ECE and noise-OOD AUROC per arm (mean ± sd over seeds)."""
    import matplotlib.pyplot as plt

    agg = result.rows.get("aggregate", {})
    arms = [a for a in ARMS if a in agg]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, (key, label, scale) in zip(axes, (("accuracy", "test accuracy (%)", 100), ("nll", "NLL", 1),
                                              ("ece", "ECE", 1), ("ood_noise", "OOD AUROC (noise)", 1))):
        stats = [agg[a].get(key) or (None, None) for a in arms]
        means = [m * scale if m is not None else math.nan for m, _ in stats]
        sds = [sd * scale if sd is not None else 0 for _, sd in stats]
        ax.bar([LABELS[a].replace(" (mcgraph)", "").replace(" (peft + mcgraph)", "") for a in arms], means, yerr=sds)
        ax.set_title(label)
        ax.tick_params(axis="x", labelrotation=25)
    fig.suptitle(f"digits → rotated digits: mean ± sd over seeds {result.seeds}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


__all__ = ["RowTransformer", "Block", "data", "pretrained", "build", "fit", "run_arm", "aggregate", "run", "report",
           "plot"]
