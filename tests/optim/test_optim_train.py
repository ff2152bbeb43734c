"""``python -m mcgraph train --optimizer ...`` and the optimizer seeds' paper_tables targets at CI scale."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from mcgraph.apps import train as mtrain
from support.train_cli import resumed_pair

HAS_SKLEARN = importlib.util.find_spec("sklearn") is not None
pytestmark = pytest.mark.skipif(not HAS_SKLEARN, reason="scikit-learn not installed")


def _read(out):
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


COMMON = ["--model", "mlp", "--hidden", "64", "--dataset", "digits", "--batch-size", "128", "--no-progress",
          "--threads", "1", "--eval-samples", "8", "--periodic-eval-samples", "4"]


def test_vogn_cli_trains_evaluates_checkpoints_and_resumes(tmp_path):
    out = tmp_path / "vogn"
    args = COMMON + ["--optimizer", "vogn", "--lr", "5e-3", "--damping", "0.03", "--mc-samples", "2",
                     "--eval-every", "1", "--out", str(out)]
    assert mtrain.main(args + ["--epochs", "2"]) == 0
    summary, rows = _read(out)
    assert summary["optimizer"] == "vogn" and summary["bayesian"] and summary["skipped_steps"] == 0
    assert summary["test"]["num_samples"] == 8 and summary["test"]["accuracy"] > 0.5
    assert "test_accuracy" in rows[0] and rows[-1]["step"] == 2 * 12
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["optimizer"]["counters"]["step"] == 24
    assert mtrain.main(args + ["--epochs", "3", "--resume", str(out / "checkpoint.pt")]) == 0
    summary, rows = _read(out)
    assert summary["steps"] == 36 and [r["epoch"] for r in rows] == [1, 2, 3]
    md = (out / "summary.md").read_text()
    assert "Trained with vogn" in md and "| ECE (15 bins) |" in md


def test_sghmc_with_spike_slab_prunes_and_reports_the_smaller_network(tmp_path):
    out = tmp_path / "sghmc"
    assert mtrain.main(COMMON + ["--optimizer", "adaptive-vb", "--avb-form", "sghmc", "--lr", "0.5", "--cycles", "2",
                                 "--snapshots-per-cycle", "2", "--epochs", "4", "--eval-every", "0", "--spike-slab",
                                 "--estep", "threshold", "--soft-threshold", "3e-2", "--spike-decay", "0.3",
                                 "--hard-threshold", "1e-3", "--prune-warmup", "1", "--out", str(out)]) == 0
    summary, rows = _read(out)
    assert summary["posterior"].startswith("snapshot ensemble (4)") and summary["test"]["num_samples"] == 4
    assert summary["sparsity"]["sparsity"] > 0 and rows[-1]["sparsity"] == summary["sparsity"]["sparsity"]
    before, after = summary["shrink"]["before"], summary["shrink"]["after"]
    assert after["parameters"] < before["parameters"] and after["macs"] < before["macs"]
    small = torch.load(out / "pruned_model.pt", weights_only=False)
    assert sum(p.numel() for p in small.parameters()) == after["parameters"]
    assert "Spike-and-slab pruning" in (out / "summary.md").read_text()


def test_adaptive_vb_and_adam_paths(tmp_path):
    for extra in (["--optimizer", "adaptive-vb", "--alpha", "1.0", "--lr", "3e-2", "--curvature", "per_example",
                   "--prior-precision", "10", "--warmup-steps", "5"],
                  ["--optimizer", "adam", "--spike-slab", "--prune-warmup", "0"]):
        out = tmp_path / extra[1]
        assert mtrain.main(COMMON + extra + ["--epochs", "1", "--eval-every", "0", "--out", str(out)]) == 0
        summary, _ = _read(out)
        assert summary["optimizer"] == extra[1] and 0 <= summary["test"]["accuracy"] <= 1


def test_default_path_unchanged_and_bad_optimizer_arguments(tmp_path):
    args = mtrain.build_parser().parse_args([])
    assert args.optimizer is None  # without --optimizer: the ELBO training of the bayesified network
    with pytest.raises(SystemExit):
        mtrain.main(["--optimizer", "sgd"])
    with pytest.raises(SystemExit):
        mtrain.main(["--optimizer", "vogn", "--mc-samples", "0"])
    with pytest.raises(SystemExit):
        mtrain.main(["--optimizer", "vogn", "--damping", "-1"])


def test_vogn_on_digits_reaches_90_percent_on_three_seeds():
    """The quick vogn_table arms: VOGN ≥ 90 % test accuracy for every seed (asserted); ECE beside Adam's (printed)."""
    from paper_tables.vogn_table import _settings, run_arm

    s = _settings(quick=True)
    torch.set_num_threads(1)
    rows = {arm: [run_arm(arm, s, seed) for seed in (0, 1, 2)] for arm in ("vogn", "adam")}
    for r in rows["vogn"]:
        assert r["test"]["accuracy"] >= 0.90, r
        assert r["skipped_steps"] == 0
    ece = {arm: sum(r["test"]["ece"] for r in rs) / 3 for arm, rs in rows.items()}
    acc = {arm: sum(r["test"]["accuracy"] for r in rs) / 3 for arm, rs in rows.items()}
    print(f"\ndigits, 3 seeds: VOGN accuracy {acc['vogn']:.4f} ECE {ece['vogn']:.4f}; Adam accuracy {acc['adam']:.4f} "
          f"ECE {ece['adam']:.4f}")


RESUME = ["--model", "mlp", "--hidden", "8", "--dataset", "digits", "--batch-size", "128", "--limit-train", "512",
          "--limit-test", "64", "--eval-samples", "2", "--periodic-eval-samples", "2", "--eval-every", "1",
          "--no-progress", "--threads", "1", "--epochs", "3", "--keep-checkpoints", "2"]


@pytest.mark.parametrize("extra", [
    ["--optimizer", "adam"],
    ["--optimizer", "vogn", "--lr", "5e-3", "--mc-samples", "2"],
    ["--optimizer", "ivon", "--mc-samples", "2"],
    ["--optimizer", "adaptive-vb", "--mc-samples", "2"],
    ["--optimizer", "adaptive-vb", "--avb-form", "sghmc", "--snapshots-per-cycle", "2"],
    ["--optimizer", "vogn", "--spike-slab", "--prune-warmup", "1"],
], ids=["adam", "vogn", "ivon", "adaptive-vb", "sghmc", "vogn-spike-slab"])
def test_resume_is_bitwise_exact(tmp_path, extra):
    """Resumed from the checkpoint of epoch 1 (kept as checkpoint.pt.2) by ``--resume PATH`` alone (the
    optimizer and its options, ``--lr`` and the epochs come from the checkpoint), a run ends with the
    uninterrupted run's parameters, optimizer state and snapshots bit for bit; checkpoints load with
    weights_only=True."""
    a, b = resumed_pair(RESUME + extra, tmp_path)
    assert a["epoch"] == b["epoch"] == 3 and a["step"] == b["step"]
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    flat = lambda s: [v for v in torch.utils._pytree.tree_leaves(s) if isinstance(v, torch.Tensor)]  # noqa: E731
    assert all(torch.equal(x, y) for x, y in zip(flat(a["optimizer"]), flat(b["optimizer"])))
    assert all(torch.equal(x, y) for x, y in zip(flat(a["snapshots"]), flat(b["snapshots"])))
    rows = [json.loads(line) for line in (tmp_path / "again" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [2, 3]  # a fresh directory: the resumed epochs only


def test_vogn_cli_batched_samples_stop_on_a_nonfinite_data_term_without_writing(tmp_path, monkeypatch, capsys):
    """``--mc-samples 2`` steps through VOGN.step_samples: a non-finite data term at step 2 stops the run (exit 3,
    the step named, no checkpoint), as the closure path does."""
    monkeypatch.setenv("MCGRAPH_FAULT_NONFINITE", "2:data")
    out = tmp_path / "stop"
    assert mtrain.main(COMMON + ["--optimizer", "vogn", "--lr", "5e-3", "--mc-samples", "2", "--epochs", "1",
                                 "--eval-every", "0", "--out", str(out)]) == 3
    assert "step 2: the data term is not finite" in capsys.readouterr().err
    assert not (out / "checkpoint.pt").exists()
