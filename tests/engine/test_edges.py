"""The API's edges: no silent wrong answer, and every error names the argument the user wrote.

Each test is one situation a new user meets; the checks live in ``mcgraph.engine.checks`` and
``mcgraph.nn.model_checks``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import mcgraph as mg
import mcgraph.nn as mnn


def _bnn(kl_samples=4):
    torch.manual_seed(0)
    return mnn.bayesify(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), kl_samples=kl_samples)


def _batch(b=6):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 4, generator=g), torch.randint(0, 3, (b,), generator=g)


# --------------------------------------------------------------------------- silent wrong answers


def _peer_models():
    out = []
    try:
        from blitz.modules import BayesianLinear

        out.append(("blitz", lambda: nn.Sequential(BayesianLinear(4, 8), nn.ReLU(), BayesianLinear(8, 3)),
                    "BayesianLinear"))
    except ImportError:
        pass
    try:
        from bayesian_torch.models.dnn_to_bnn import dnn_to_bnn

        def bayesian_torch_mlp():
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
            dnn_to_bnn(model, {"prior_mu": 0.0, "prior_sigma": 1.0, "posterior_mu_init": 0.0,
                               "posterior_rho_init": -3.0, "type": "Reparameterization", "moped_enable": False})
            return model

        out.append(("bayesian_torch", bayesian_torch_mlp, "LinearReparameterization"))
    except ImportError:
        pass
    return out


PEERS = _peer_models()


@pytest.mark.skipif(not PEERS, reason="no peer library installed (make interop)")
@pytest.mark.parametrize("lib, build, cls", PEERS, ids=[p[0] for p in PEERS])
@pytest.mark.parametrize("call", ["kl", "elbo", "elbo_terms", "predict"])
def test_an_unconverted_peer_model_is_refused_with_the_converter_named(lib, build, cls, call):
    model = build()
    x, y = _batch()
    fn = {"kl": lambda: mnn.kl(model, 4, seed=0),
          "elbo": lambda: mnn.elbo(model, x, y, num_samples=2, dataset_size=100, seed=0),
          "elbo_terms": lambda: mnn.elbo_terms(model, x, y, num_samples=2, dataset_size=100, seed=0),
          "predict": lambda: mnn.predict(model, x, 4, seed=0)}[call]
    with pytest.raises(TypeError, match=rf"{cls} at '0'.*mcgraph\.interop\.{lib}\.to_mcgraph"):
        fn()
    # after the conversion the same calls run, with a KL that is not 0
    from mcgraph import interop

    bnn = getattr(interop, lib).to_mcgraph(model, kl_samples=4)
    assert float(mnn.kl(bnn, seed=0)) > 0


@pytest.mark.parametrize("call", ["kl", "elbo", "elbo_terms"])
def test_a_model_without_bayesian_layers_is_refused(call):
    plain = nn.Sequential(nn.Linear(4, 3))
    x, y = _batch()
    fn = {"kl": lambda: mnn.kl(plain),
          "elbo": lambda: mnn.elbo(plain, x, y, num_samples=2, dataset_size=100),
          "elbo_terms": lambda: mnn.elbo_terms(plain, x, y, num_samples=2, dataset_size=100)}[call]
    with pytest.raises(ValueError, match="no Bayesian layer.*bayesify"):
        fn()


@pytest.mark.skipif(not PEERS, reason="no peer library installed (make interop)")
def test_to_mcgraph_has_no_silent_one_sample_default():
    from mcgraph import interop

    lib, build, _ = PEERS[0]
    with pytest.raises(TypeError, match="kl_samples is required"):
        getattr(interop, lib).to_mcgraph(build())
    with pytest.raises(TypeError, match="kl_samples must be an int"):
        getattr(interop, lib).to_mcgraph(build(), kl_samples=2.5)


def test_stderr_with_one_sample_kl_names_kl_samples_not_num_samples():
    net = _bnn(kl_samples=1)
    x, y = _batch()
    with pytest.raises(ValueError, match="kl_samples must be >= 2 with return_stderr.*kl_samples=1"):
        mnn.elbo_terms(net, x, y, num_samples=32, dataset_size=100, seed=0, return_stderr=True)
    t = mnn.elbo_terms(net, x, y, num_samples=32, dataset_size=100, kl_samples=mg.Sampling(8, method="monte-carlo"),
                       seed=0, return_stderr=True)
    assert t.kl_stderr > 0


@pytest.mark.skipif(not any(p[0] == "bayesian_torch" for p in PEERS), reason="bayesian-torch is not installed")
def test_converting_from_bayesian_torch_warns_once_about_the_kl_scale():
    from mcgraph import interop
    from mcgraph.interop import convert

    convert._SCALE_WARNED.discard("bayesian_torch")
    build = dict((p[0], p[1]) for p in PEERS)["bayesian_torch"]
    with pytest.warns(convert.KLScaleWarning, match="get_kl_loss averages.*dataset_size"):
        interop.bayesian_torch.to_mcgraph(build(), kl_samples=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        interop.bayesian_torch.to_mcgraph(build(), kl_samples=2)  # once per process
    assert "KL scale" in interop.bayesian_torch.to_mcgraph.__doc__


@pytest.mark.parametrize("where", ["expectation", "kl_divergence", "elbo", "predict", "kl"])
def test_a_seed_beyond_64_bits_is_refused_not_wrapped(where):
    q = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
    net = _bnn()
    x, y = _batch()
    fn = {"expectation": lambda s: mg.expectation(lambda w: w * w, q, 4, seed=s),
          "kl_divergence": lambda s: mg.kl_divergence(q, torch.distributions.Laplace(0.0, 1.0), 4, seed=s),
          "elbo": lambda s: mnn.elbo(net, x, y, num_samples=2, dataset_size=100, seed=s),
          "predict": lambda s: mnn.predict(net, x, 2, seed=s),
          "kl": lambda s: mnn.kl(net, seed=s)}[where]
    fn(2**64 - 1)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\), got 18446744073709551617"):
        fn(2**64 + 1)
    with pytest.raises(TypeError, match="seed must be an int"):
        fn(1.0)


@pytest.mark.parametrize("weight", [math.nan, math.inf, -1.0])
def test_kl_weight_must_be_finite_and_non_negative(weight):
    x, y = _batch()
    with pytest.raises(ValueError, match="kl_weight must be"):
        mnn.elbo(_bnn(), x, y, num_samples=2, dataset_size=100, kl_weight=weight)


def test_dataset_size_smaller_than_the_batch_is_refused():
    x, y = _batch(6)
    with pytest.raises(ValueError, match="dataset_size must be the number of training examples N, at least the "
                                         "batch size 6; got 5"):
        mnn.elbo(_bnn(), x, y, num_samples=2, dataset_size=5)
    mnn.elbo(_bnn(), x, y, num_samples=2, dataset_size=6)


# --------------------------------------------------------------------------- errors that name the argument


def test_wrong_input_width_names_x_and_the_features_expected():
    _, y = _batch()
    with pytest.raises(ValueError, match=r"x: the model cannot run on x of shape \(6, 5\); the first layer "
                                         r"\('0'\) expects 4 input features"):
        mnn.elbo(_bnn(), torch.randn(6, 5), y, num_samples=4, dataset_size=100)
    with pytest.raises(ValueError, match=r"x: .*shape \(6, 5\)"):
        mnn.predict(_bnn(), torch.randn(6, 5), 4)


def test_a_3d_input_names_x_and_y_shapes():
    _, y = _batch()
    with pytest.raises(ValueError, match=r"y has shape \(6,\), so the model's output for x must have shape "
                                         r"\(6,\) \+ \(K,\).*x of shape \(6, 2, 4\) gives an output of shape \(6, 2, 3\)"):
        mnn.elbo(_bnn(), torch.randn(6, 2, 4), y, num_samples=4, dataset_size=100)


@pytest.mark.parametrize("call", ["elbo", "predict"])
def test_x_as_a_list_is_a_type_error_naming_x(call):
    x, y = _batch()
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        if call == "elbo":
            mnn.elbo(_bnn(), x.tolist(), y, num_samples=2, dataset_size=100)
        else:
            mnn.predict(_bnn(), x.tolist(), 2)
    with pytest.raises(ValueError, match=r"y must have as many rows as x \(6\), got shape \(5,\)"):
        mnn.elbo(_bnn(), x, y[:5], num_samples=2, dataset_size=100)


def test_a_prior_whose_support_misses_q_names_p_not_an_internal_distribution():
    q = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match=r"p: Beta's support .* does not cover the support of q \(Normal"):
        mg.kl_divergence(q, torch.distributions.Beta(2.0, 2.0), 10, seed=0)
    lq = torch.distributions.LogNormal(torch.zeros(3), torch.ones(3))  # positive under positive: fine
    assert torch.isfinite(mg.kl_divergence(lq, torch.distributions.Gamma(2.0, 1.0), 10, seed=0)).all()


def test_a_fractional_sample_count_is_a_type_error_everywhere():
    q = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
    x, y = _batch()
    calls = [lambda: mg.kl_divergence(q, torch.distributions.Laplace(0.0, 1.0), 2.5),
             lambda: mg.expectation(lambda w: w, q, 2.5),
             lambda: mnn.elbo(_bnn(), x, y, num_samples=2.5, dataset_size=100),
             lambda: mnn.predict(_bnn(), x, 2.5),
             lambda: mnn.kl(_bnn(), 2.5)]
    if PEERS:
        from mcgraph import interop

        lib, build, _ = PEERS[0]
        calls.append(lambda: getattr(interop, lib).kl(build(), 2.5))
    for call in calls:
        with pytest.raises(TypeError, match="num_samples must be an int.*, got float"):
            call()


def test_the_checks_module_is_the_one_rule():
    from mcgraph.engine import checks

    import numpy as np

    assert checks.positive_int("n", np.int64(3)) == 3
    with pytest.raises(TypeError, match="n must be an int, got Tensor"):
        checks.positive_int("n", torch.tensor(3))
    with pytest.raises(TypeError, match="n must be an int"):
        checks.positive_int("n", True)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        checks.positive_int("n", 0)
    assert checks.positive_int("n", None, allow_none=True) is None
    with pytest.raises(ValueError, match="w must be > 0, got 0"):
        checks.finite_float("w", 0.0, low=0.0, low_open=True)


def test_return_stderr_is_an_mc_estimate_from_the_functional_and_the_model_kl():
    q = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
    a = mg.kl_divergence(q, torch.distributions.Laplace(0.0, 1.0), 8, seed=0, return_stderr=True)
    b = mnn.kl(_bnn(kl_samples=8), seed=0, method="monte-carlo", return_stderr=True)
    assert isinstance(a, mg.MCEstimate) and isinstance(b, mg.MCEstimate)
    assert b.num_samples == 8 and b.stderr > 0
    exact = mnn.kl(_bnn(kl_samples=8), seed=0, return_stderr=True)  # the default prior's KL: closed form
    assert isinstance(exact, mg.MCEstimate) and exact.stderr == 0


# --------------------------------------------------------------------------- the command line


def test_the_command_line_lists_its_commands_and_exits_0():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "mcgraph", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "train" in done.stdout and "bench" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "mcgraph", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown command 'nope'" in bad.stderr


def test_train_help_is_grouped_and_shows_defaults():
    from mcgraph.apps.train import build_parser

    text = build_parser().format_help()
    for group in ("model and data:", "posterior and prior:", "ELBO:", "optimisation:", "evaluation:",
                  "checkpoints and output:"):
        assert group in text
    assert "(default: mnist)" in text and "(default: 1000)" in text and "(default: 0.001)" in text


def test_progress_draws_no_bar_into_a_log_file(tmp_path, monkeypatch):
    import sys

    from mcgraph.apps.training_run import Progress

    with open(tmp_path / "log.txt", "w") as log:
        monkeypatch.setattr(sys, "stderr", log)
        bar = Progress(10, "epoch 1/1", enabled=True)
        for _ in range(10):
            bar.update(loss=1.0)
        bar.close()
    assert bar.bar is None and "\r" not in (tmp_path / "log.txt").read_text()


# --------------------------------------------------------------------------- options bound once


def test_a_sampling_object_carries_the_options_and_matches_the_keyword_call():
    q = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
    p = torch.distributions.Laplace(0.0, 1.0)
    opts = mg.Sampling(64, seed=3, method=mg.Method.FUSED, return_stderr=True)
    a = mg.kl_divergence(q, p, opts)
    b = mg.kl_divergence(q, p, 64, seed=3, method="fused", return_stderr=True)
    assert isinstance(a, mg.MCEstimate) and torch.equal(a.value, b.value) and torch.equal(a.stderr, b.stderr)
    e = mg.expectation(lambda w: w * w, q, mg.Sampling(16, seed=1, chunk_size=4))
    assert torch.equal(e, mg.expectation(lambda w: w * w, q, 16, seed=1, chunk_size=4))
    net, (x, _) = _bnn(kl_samples=8), _batch()
    assert torch.equal(mnn.kl(net, mg.Sampling(seed=2)), mnn.kl(net, seed=2))
    assert torch.equal(mnn.predict(net, x, mg.Sampling(8, seed=5, chunk_size=3)), mnn.predict(net, x, 8, chunk_size=3, seed=5))


def test_a_sampling_object_is_validated_when_made_and_refuses_a_second_value():
    with pytest.raises(TypeError, match="num_samples must be an int or None, got float"):
        mg.Sampling(2.5)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
        mg.Sampling(4, seed=-1)
    q = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
    with pytest.raises(TypeError, match="method: given both in the Sampling passed as num_samples"):
        mg.expectation(lambda w: w, q, mg.Sampling(4, method="fused"), method="chunked")
    with pytest.raises(ValueError, match="method must be one of"):
        mg.expectation(lambda w: w, q, mg.Sampling(4, method="magic"))
    assert mg.Sampling(4).replace(seed=3) == mg.Sampling(4, seed=3)


def test_a_sampling_option_the_call_does_not_take_is_refused_not_ignored():
    q = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
    with pytest.raises(TypeError, match="num_samples: this call does not use the Sampling's vectorize"):
        mg.expectation(lambda w: w, q, mg.Sampling(4, vectorize=True))
    net, (x, y) = _bnn(kl_samples=8), _batch()
    with pytest.raises(TypeError, match="does not use the Sampling's chunk_size"):
        mnn.kl(net, mg.Sampling(4, chunk_size=2))
    with pytest.raises(TypeError, match="does not use the Sampling's method, return_stderr"):
        mnn.predict(net, x, mg.Sampling(4, method="direct", return_stderr=True))
    # the data term reads method, chunk_size, vectorize and process_group from its Sampling
    mnn.elbo(net, x, y, num_samples=mg.Sampling(4, method="direct", chunk_size=2, vectorize=False),
             dataset_size=100, seed=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 4097, -1])
def test_all_finite_finds_every_non_finite_value(dtype, bad, where):
    from mcgraph.engine.checks import all_finite

    good = [torch.randn(5000).to(dtype), torch.arange(4), torch.zeros(0), torch.tensor(True)]
    assert all_finite(good)
    assert all_finite([])
    x = torch.randn(64, 128).to(dtype)
    x.view(-1)[where] = bad
    assert not all_finite(good + [x])
    assert not all_finite([x.t()])  # a strided view
    big = torch.full((3,), torch.finfo(torch.float64).max, dtype=torch.float64)
    assert all_finite([big])  # large but finite: no false alarm from a sum's overflow


# --------------------------------------------------------------------------- edges that refuse with advice


@pytest.mark.parametrize("call", ["predict", "forward_samples", "expected_data_term"])
def test_a_deterministic_model_is_refused_where_samples_would_all_be_equal(call):
    plain = nn.Sequential(nn.Linear(4, 3))
    x, y = _batch()
    fn = {"predict": lambda m: mnn.predict(m, x, 4, seed=0),
          "forward_samples": lambda m: mnn.forward_samples(m, x, 4, seed=0),
          "expected_data_term": lambda m: mnn.expected_data_term(m, x, y, num_samples=4, seed=0)}[call]
    with pytest.raises(ValueError, match=r"no Bayesian layer and draws no noise per sample.*bayesify.*mc_dropout"):
        fn(plain)
    fn(mnn.mc_dropout(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 3))))  # MC dropout samples


def test_float_labels_are_refused_where_they_enter_with_the_dtype_expected():
    x, y = _batch()
    with pytest.raises(TypeError, match=r"y must hold class indices, an integer tensor \(torch.long\).*float32"
                                        r".*y\.long\(\)"):
        mnn.elbo(_bnn(), x, y.float(), num_samples=4, dataset_size=100, seed=0)


def test_a_class_index_out_of_range_names_y_and_the_classes():
    x, y = _batch()
    y = y.clone()
    y[0] = 3  # the model has 3 classes
    with pytest.raises(ValueError, match=r"y holds the class index 3, outside \[0, 3\) for the model's 3 classes"):
        mnn.elbo(_bnn(), x, y, num_samples=4, dataset_size=100, seed=0)
    y[0] = -100  # ignored, as torch's cross-entropy ignores it
    mnn.elbo(_bnn(), x, y, num_samples=4, dataset_size=100, seed=0)


def test_one_hot_labels_are_refused_with_class_indices_suggested():
    x, y = _batch()
    one_hot = nn.functional.one_hot(y, 3)
    for labels in (one_hot, one_hot.float()):
        with pytest.raises(ValueError, match=r"y has the shape of the model's output \(6, 3\).*pass y\.argmax\(1\)"):
            mnn.elbo(_bnn(), x, labels, num_samples=4, dataset_size=100, seed=0)


def test_a_layer_shape_error_reports_the_callers_batch_not_the_repeated_one():
    torch.manual_seed(0)

    class Reader(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 3)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    net = mnn.bayesify(Reader())
    x, y = torch.randn(32, 5, 64), torch.randint(0, 3, (32,))  # 64 features where the LSTM reads 8
    with pytest.raises(ValueError, match=r"input_size=8, got shape \(32, 5, 64\)"):
        mnn.elbo(net, x, y, num_samples=mg.Sampling(4, chunk_size=4), dataset_size=100, seed=0)


def test_priors_take_the_posteriors_aliases():
    torch.manual_seed(0)
    a = mnn.BayesLinear(4, 3, posterior="gaussian", prior="gaussian")
    b = mnn.BayesLinear(4, 3, posterior="normal", prior="normal")
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(mnn.kl(a), mnn.kl(b))
    assert set(mnn.POSTERIORS) & {"normal", "gaussian", "laplace"} <= set(mnn.PRIORS)


def _public_callables():
    """Every public function (and Bayesian layer method) of mg, mg.nn and mg.interop.* taking ``num_samples``."""
    import importlib
    import inspect

    modules = [mg, mnn, mg.interop] + [importlib.import_module(f"mcgraph.interop.{n}")
                                       for n in ("bayesian_torch", "blitz", "torchbnn", "torch_uncertainty")]
    found = {}
    for module in modules:
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name, None)
            if inspect.isfunction(obj) and "num_samples" in inspect.signature(obj).parameters:
                found[f"{module.__name__}.{name}"] = obj
    found["mcgraph.nn.BayesLayer.kl"] = mnn.BayesLayer.kl
    return found


@pytest.mark.parametrize("name", sorted(_public_callables()))
def test_every_public_call_with_a_sample_count_takes_a_sampling(name):
    import inspect
    import typing

    fn = _public_callables()[name]
    annotation = inspect.signature(fn).parameters["num_samples"].annotation
    assert "Sampling" in str(annotation), f"{name}: num_samples is annotated {annotation!r}"
    hints = typing.get_type_hints(fn)
    assert mg.Sampling in typing.get_args(hints["num_samples"])


def test_a_sampling_gives_the_keyword_call_s_numbers_everywhere():
    net, (x, y) = _bnn(kl_samples=8), _batch()
    s = mg.Sampling(6, seed=4, chunk_size=4)
    assert torch.equal(mnn.forward_samples(net, x, s), mnn.forward_samples(net, x, 6, seed=4, chunk_size=4))
    m, sd = torch.randn(5, 3), torch.rand(5, 3) + 0.1
    t = torch.tensor([0, 1, 2, 0, 1])
    assert torch.equal(mnn.softmax_cross_entropy_mc(m, sd, t, s), mnn.softmax_cross_entropy_mc(m, sd, t, 6, seed=4,
                                                                                                  chunk_size=4))
    head = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), mnn.BayesLinear(8, 3, estimator="local_reparameterization"))
    assert torch.equal(mnn.expected_log_likelihood(head, x, y, num_samples=s),
                       mnn.expected_log_likelihood(head, x, y, num_samples=6, seed=4, chunk_size=4))
    layer = mnn.BayesLinear(4, 3, posterior="radial", kl_samples=5)
    k = mg.Sampling(7, seed=2, method="monte-carlo")
    assert torch.equal(layer.kl(k), layer.kl(7, seed=2, method="monte-carlo"))
    assert torch.equal(layer.kl(mg.Sampling(seed=2)), layer.kl(seed=2))  # M from the layer's kl_samples
    q, p = layer.posterior, layer.prior
    assert torch.equal(mnn.divergence(q, p, k), mnn.divergence(q, p, 7, seed=2, method="monte-carlo"))
    with pytest.raises(TypeError, match="seed: given both in the Sampling"):
        mnn.forward_samples(net, x, s, seed=1)
    with pytest.raises(TypeError, match="does not use the Sampling's vectorize"):
        mnn.softmax_cross_entropy_mc(m, sd, t, mg.Sampling(6, vectorize=True))
    with pytest.raises(TypeError, match="positional"):
        mnn.predict(net, x, 8, 3)  # chunk_size is keyword-only
