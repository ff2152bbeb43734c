"""``python -m mcgraph train --optimizer ivon``: defaults, posterior predictive, checkpoint and resume."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch

from mcgraph.apps import train as mtrain

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn not installed")

COMMON = ["--model", "mlp", "--hidden", "64", "--dataset", "digits", "--batch-size", "64", "--no-progress",
          "--threads", "1", "--eval-samples", "8", "--periodic-eval-samples", "4"]


def _read(out):
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def test_ivon_cli_trains_with_its_defaults_checkpoints_and_resumes(tmp_path):
    out = tmp_path / "ivon"
    args = COMMON + ["--optimizer", "ivon", "--eval-every", "1", "--out", str(out)]
    assert mtrain.main(args + ["--epochs", "3"]) == 0
    summary, rows = _read(out)
    assert summary["optimizer"] == "ivon" and summary["posterior"] == "normal (IVON)" and summary["bayesian"]
    assert summary["config"]["lr"] == 0.1  # IVON's default learning rate when --lr is not given
    assert summary["test"]["num_samples"] == 8 and summary["test"]["accuracy"] > 0.85
    assert "test_accuracy" in rows[0] and rows[-1]["step"] == 3 * 23
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["optimizer"]["counters"]["step"] == 69 and state["optimizer"]["counters"]["seed"] == 0
    assert mtrain.main(args + ["--epochs", "4", "--resume", str(out / "checkpoint.pt")]) == 0
    summary, rows = _read(out)
    assert summary["steps"] == 92 and [r["epoch"] for r in rows] == [1, 2, 3, 4]
    assert "Trained with ivon" in (out / "summary.md").read_text()


def test_ivon_cli_options_and_refusals(tmp_path):
    out = tmp_path / "ivon_opts"
    assert mtrain.main(COMMON + ["--optimizer", "ivon", "--lr", "0.05", "--ess", "2000", "--hess-init", "0.5",
                                 "--hess-approx", "gradsq", "--betas", "0.9", "0.999", "--weight-decay", "1e-3",
                                 "--mc-samples", "2", "--clip-radius", "1.0", "--epochs", "1", "--eval-every", "0",
                                 "--out", str(out)]) == 0
    summary, _ = _read(out)
    assert summary["config"]["lr"] == 0.05 and summary["prior"] == "normal(precision=2.0)"
    assert 0 <= summary["test"]["accuracy"] <= 1
    with pytest.raises(SystemExit):
        mtrain.main(["--optimizer", "ivon", "--ess", "0"])
    with pytest.raises(SystemExit):
        mtrain.main(["--optimizer", "ivon", "--hess-approx", "exact"])
    with pytest.raises(ValueError, match="spike-slab"):
        mtrain.main(COMMON + ["--optimizer", "ivon", "--spike-slab", "--epochs", "1", "--out", str(tmp_path / "x")])


def test_ivon_cli_batches_its_samples_and_ends_where_the_sample_loop_ends(tmp_path, monkeypatch):
    """``--mc-samples 3``: one vmapped forward/backward per step (the same noise as three sampled passes)."""
    from mcgraph.optim import IVON

    args = COMMON + ["--optimizer", "ivon", "--mc-samples", "3", "--epochs", "1", "--eval-every", "0",
                     "--limit-train", "256"]
    calls = []
    vectorized = IVON._vectorized_samples

    def counting(self, *a, **k):
        out = vectorized(self, *a, **k)
        calls.append(1)  # only a batched pass that succeeded counts
        return out

    monkeypatch.setattr(IVON, "_vectorized_samples", counting)
    assert mtrain.main(args + ["--out", str(tmp_path / "batched")]) == 0
    assert len(calls) == 4  # 256 examples in batches of 64: one batched pass per step

    def refuse(self, *a, **k):
        raise RuntimeError("vmap refuses this model")

    monkeypatch.setattr(IVON, "_vectorized_samples", refuse)  # the loop of three sampled passes instead
    assert mtrain.main(args + ["--out", str(tmp_path / "loop")]) == 0
    a, b = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=True) for d in ("batched", "loop"))
    assert a["optimizer"]["counters"]["step"] == b["optimizer"]["counters"]["step"] == 4
    for key, value in a["model"].items():
        torch.testing.assert_close(b["model"][key], value, rtol=1e-4, atol=1e-6, msg=key)


def test_ivon_cli_batched_samples_stop_on_a_nonfinite_data_term_without_writing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MCGRAPH_FAULT_NONFINITE", "2:data")
    out = tmp_path / "run"
    code = mtrain.main(COMMON + ["--optimizer", "ivon", "--mc-samples", "2", "--epochs", "1", "--eval-every", "0",
                                 "--out", str(out)])
    assert code == 3
    assert "step 2: the data term is not finite" in capsys.readouterr().err
    assert not (out / "checkpoint.pt").exists()


@pytest.mark.parametrize("vectorize", [True, False], ids=["vmapped", "loop"])
def test_ivon_dropped_samples_leave_weights_and_state_unchanged(vectorize):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    loss_fn = lambda: torch.nn.functional.cross_entropy(net(x), y)  # noqa: E731
    opt = IVON_(net)
    opt.step_samples(loss_fn, vectorize=vectorize)  # one real step first: momentum and h are not at their start
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    state = copy.deepcopy(opt.state_dict())

    def refuse(loss):
        assert opt.recorded_finite()
        raise ValueError("stop")

    with pytest.raises(ValueError, match="stop"):
        opt.step_samples(loss_fn, vectorize=vectorize, before_step=refuse)
    for k, v in net.state_dict().items():
        torch.testing.assert_close(v, weights[k], rtol=0, atol=0)
    _assert_same_state(opt.state_dict(), state)
    # the next step draws the noise the refused one drew: it equals that step on an untouched copy
    twin_net = copy.deepcopy(net)
    twin = IVON_(twin_net)
    twin.load_state_dict(state)
    opt.step_samples(loss_fn, vectorize=vectorize)
    twin.step_samples(lambda: torch.nn.functional.cross_entropy(twin_net(x), y), vectorize=vectorize)
    for (k, v), w in zip(net.state_dict().items(), twin_net.state_dict().values()):
        torch.testing.assert_close(v, w, rtol=0, atol=0, msg=k)

    finite = []
    loss = opt.step_samples(lambda: loss_fn() * float("nan"), vectorize=vectorize,
                            before_step=lambda loss: finite.append(opt.recorded_finite()))
    assert finite == [False] and not bool(torch.isfinite(loss))
    assert opt.counters["step"] == 3  # a check that does not raise lets the update happen


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["counters"] == b["counters"]
    for key, st in b["state"].items():
        for name, value in st.items():
            torch.testing.assert_close(a["state"][key][name], value, rtol=0, atol=0, msg=f"{key}.{name}")


def test_ivon_cli_skips_nonfinite_steps_with_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MCGRAPH_FAULT_NONFINITE", "2:data")
    out = tmp_path / "run"
    assert mtrain.main(COMMON + ["--optimizer", "ivon", "--mc-samples", "2", "--epochs", "1", "--eval-every", "0",
                                 "--on-nonfinite", "skip", "--out", str(out)]) == 0
    assert "ivon: step 2: non-finite loss; the step was skipped" in capsys.readouterr().err
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["optimizer"]["counters"]["skipped"] == 1 and state["optimizer"]["counters"]["step"] == 22
    assert all(bool(torch.isfinite(v).all()) for v in state["model"].values())


def IVON_(net):
    from mcgraph.optim import IVON

    return IVON(net, lr=0.1, ess=16, mc_samples=4, seed=0)
