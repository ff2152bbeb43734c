"""Recurrent layers of blitz (0.2.8) and bayesian-torch (0.5.0) converted to mcgraph: the peers as the oracle.

Each test skips (naming the package) when its peer is missing.
"""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import mcgraph as mg
from support.interop_models import Z_4_5, peer
from mcgraph.engine.plan.families import family_of
from mcgraph.nn.context import NoiseKind, sample_run, window
from mcgraph.nn.weight_sites import site_weights

F64 = torch.float64


def _blitz():
    peer("blitz", "blitz-bayesian-pytorch")
    import blitz.modules as bm
    import mcgraph.interop.blitz as ibz
    return bm, ibz


def _bt():
    peer("bayesian_torch", "bayesian-torch")
    import bayesian_torch.layers as bl
    import mcgraph.interop.bayesian_torch as ibt
    return bl, ibt


def _inputs(dtype=F64, batch=3, T=7, features=4, hidden=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, T, features, generator=g, dtype=dtype)
    h, c = (0.5 * torch.randn(batch, hidden, generator=g, dtype=dtype) for _ in range(2))
    return x, h, c


class Classifier(nn.Module):
    """The last step of a recurrent layer (any library's interface) through a linear head."""

    def __init__(self, rnn: nn.Module, hidden: int = 5):
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(hidden, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


# --------------------------------------------------------------------------- blitz


def _blitz_layer(cell="lstm", dtype=F64, **kwargs):
    bm, _ = _blitz()
    torch.manual_seed(0)
    cls = {"lstm": bm.BayesianLSTM, "gru": bm.BayesianGRU}[cell]
    # float32 modules: .to(float64) would give blitz's aliases (weight_ih_mu …) their own storage
    layer = cls(4, 5, posterior_rho_init=-2.0, **kwargs)
    with torch.no_grad():
        for s in layer.modules():
            for name, p in list(s._parameters.items()):
                if p is not None:
                    s._parameters[name] = nn.Parameter(p.detach().to(dtype))
    for role in ("weight_ih", "weight_hh", "bias"):  # blitz's aliases are the samplers' Parameters again
        setattr(layer, f"{role}_mu", getattr(layer, f"{role}_sampler").mu)
        setattr(layer, f"{role}_rho", getattr(layer, f"{role}_sampler").rho)
    return layer


def _hidden(cell, h, c):
    return (h, c) if cell == "lstm" else h


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("freeze", [False, True], ids=["mean-mode", "frozen"])
def test_blitz_mean_mode_is_blitz_frozen_forward(cell, freeze):
    _, ibz = _blitz()
    layer = _blitz_layer(cell, prior_pi=0.5)
    x, h, c = _inputs()
    bnn = ibz.to_mcgraph(nn.ModuleDict({"rnn": layer}), kl_samples=4)["rnn"]
    assert isinstance(bnn, ibz.BlitzRecurrent) and bnn.mode == cell.upper()
    layer.freeze = True
    ref = layer(x, _hidden(cell, h, c))
    if freeze:  # a frozen blitz layer converts to the posterior-mean forward
        bnn = ibz.to_mcgraph(nn.ModuleDict({"rnn": layer}), kl_samples=4)["rnn"]
        assert all(s.mode == mg.nn.SampleMode.MEAN for s in bnn.sites())
        got = bnn(x, _hidden(cell, h, c))
    else:
        with mg.nn.frozen(bnn):
            got = bnn(x, _hidden(cell, h, c))
    torch.testing.assert_close(got, ref, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(bnn.to_torch()(x, (h[None], c[None]) if cell == "lstm" else h[None])[0], ref[0],
                               rtol=1e-13, atol=1e-14)


def test_blitz_lstm_without_bias_and_default_hidden_state():
    _, ibz = _blitz()
    layer = _blitz_layer("lstm", dtype=torch.float32, bias=False)
    x = _inputs(torch.float32)[0]
    bnn = ibz.to_mcgraph(nn.ModuleDict({"rnn": layer}), kl_samples=4)["rnn"]
    assert not bnn.bias and [n for n, _ in bnn.named_children()] == ["ih_l0", "hh_l0"]
    layer.freeze = True  # blitz's sampled path fails without a bias (it adds None); its frozen path adds 0
    with mg.nn.frozen(bnn):
        torch.testing.assert_close(bnn(x), layer(x))


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_blitz_converted_layer_samples_once_per_sequence(cell):
    """One forward = blitz's own recurrence (its frozen path) run on one draw of every tensor."""
    _, ibz = _blitz()
    layer = _blitz_layer(cell)
    x, h, c = _inputs()
    bnn = ibz.to_mcgraph(nn.ModuleDict({"rnn": layer}), kl_samples=4)["rnn"]
    torch.manual_seed(7)
    out = bnn(x, _hidden(cell, h, c))
    torch.manual_seed(7)
    w_ih, w_hh, b = (site_weights(site).at(0)[0] for site in bnn.sites())  # the draws of that forward, in order
    oracle = copy.deepcopy(layer)
    with torch.no_grad():
        oracle.weight_ih_mu.copy_(w_ih)
        oracle.weight_hh_mu.copy_(w_hh)
        oracle.bias_mu.copy_(b)
    oracle.freeze = True
    torch.testing.assert_close(out, oracle(x, _hidden(cell, h, c)), rtol=1e-13, atol=1e-14)
    assert (out[0] - layer(x, _hidden(cell, h, c))[0]).abs().max() > 1e-3  # the draw is not the mean


def test_blitz_shares_parameters_and_an_optimizer_step_moves_them():
    _, ibz = _blitz()
    layer = _blitz_layer("gru", prior_pi=0.5)
    model = Classifier(layer).to(F64)
    bnn = ibz.to_mcgraph(model, kl_samples=8)
    rnn = bnn.rnn
    assert rnn.ih_l0.weight_mu is layer.weight_ih_sampler.mu and rnn.hh_l0.weight_rho is layer.weight_hh_sampler.rho
    assert rnn.b_l0.weight_mu is layer.bias_sampler.mu and rnn.b_l0.weight_rho is layer.bias_sampler.rho
    assert {id(p) for p in bnn.parameters()} <= {id(p) for p in model.parameters()}
    assert isinstance(model.rnn, _blitz()[0].BayesianGRU)  # the original is left as it is
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _inputs()[0], torch.tensor([0, 1, 2])
    before = [p.detach().clone() for p in (layer.weight_ih_sampler.mu, layer.weight_hh_sampler.rho,
                                            layer.bias_sampler.rho)]
    (-mg.nn.elbo(bnn, x, y, num_samples=4, dataset_size=100, seed=0)).backward()
    opt.step()
    after = (layer.weight_ih_sampler.mu, layer.weight_hh_sampler.rho, layer.bias_sampler.rho)
    assert all(not torch.equal(a, b) for a, b in zip(before, after))


def test_blitz_kl_is_the_sum_of_the_weights_kl():
    _, ibz = _blitz()
    # Normal prior (π = 1): closed form, exact
    layer = _blitz_layer("lstm", prior_pi=1.0, prior_sigma_1=0.3)
    bnn = ibz.to_mcgraph(nn.ModuleDict({"rnn": layer}), kl_samples=4)["rnn"]
    prior = torch.distributions.Normal(0.0, torch.tensor(0.3, dtype=F64))
    exact = sum(torch.distributions.kl_divergence(torch.distributions.Normal(s.mu, F.softplus(s.rho)), prior).sum()
                for s in (layer.weight_ih_sampler, layer.weight_hh_sampler, layer.bias_sampler))
    torch.testing.assert_close(mg.nn.kl(bnn, seed=0), exact, rtol=1e-12, atol=0)
    # scale-mixture prior: Monte Carlo, against entropy + Gauss–Hermite quadrature of E_q[log p] per weight
    layer = _blitz_layer("gru", prior_pi=0.5, prior_sigma_1=1.0, prior_sigma_2=0.05)
    bnn = ibz.to_mcgraph(nn.ModuleDict({"rnn": layer}), kl_samples=4)["rnn"]
    nodes, weights = (torch.as_tensor(a, dtype=F64) for a in np.polynomial.hermite.hermgauss(80))
    ref = 0.0
    with torch.no_grad():
        for s in (layer.weight_ih_sampler, layer.weight_hh_sampler, layer.bias_sampler):
            mu, sigma = s.mu.reshape(-1, 1), F.softplus(s.rho).reshape(-1, 1)
            w = mu + math.sqrt(2.0) * sigma * nodes
            log_p = torch.logsumexp(torch.stack([math.log(0.5) + torch.distributions.Normal(0.0, 1.0).log_prob(w),
                                                 math.log(0.5) + torch.distributions.Normal(0.0, 0.05).log_prob(w)]),
                                    0)
            expected_log_p = (log_p * weights).sum(-1) / math.sqrt(math.pi)
            entropy = 0.5 * math.log(2 * math.pi * math.e) + torch.log(sigma.reshape(-1))
            ref += float((-entropy - expected_log_p).sum())
    est = mg.nn.kl(bnn, 4096, seed=0, return_stderr=True)
    assert abs(est.value.item() - ref) <= Z_4_5 * est.stderr.item(), (est.value.item(), ref, est.stderr.item())
    before = mg.nn.kl(bnn, 4096, seed=0)  # the same samples as the stderr path's (its sums may round apart)
    torch.testing.assert_close(before, est.value, rtol=1e-13, atol=0)
    # the KL does not depend on any forward (nor its sequence length)
    bnn(_inputs(T=3)[0])
    assert torch.equal(mg.nn.kl(bnn, 4096, seed=0), before)


def test_blitz_elbo_chunking_and_graph_flat_in_samples():
    _, ibz = _blitz()
    model = Classifier(_blitz_layer("lstm", prior_pi=0.5)).to(F64)
    bnn = ibz.to_mcgraph(model, kl_samples=4)
    x, y = _inputs()[0], torch.tensor([0, 1, 2])
    params = [p for p in bnn.parameters()]
    a = mg.nn.elbo(bnn, x, y, num_samples=mg.Sampling(4, chunk_size=1), dataset_size=50, seed=2)
    ga = torch.autograd.grad(a, params)
    b = mg.nn.elbo(bnn, x, y, num_samples=mg.Sampling(4, method="direct"), dataset_size=50, seed=2)
    gb = torch.autograd.grad(b, params)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for u, v in zip(ga, gb, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-12)
    sizes = [mg.graph_size(lambda m=m: mg.nn.elbo(bnn, x, y, num_samples=m, dataset_size=50, seed=0)).saved_bytes
             for m in (2, 64)]
    assert abs(sizes[1] - sizes[0]) <= 0.05 * sizes[0], sizes


def test_blitz_refusals():
    bm, ibz = _blitz()
    with pytest.raises(TypeError, match=r"'rnn' \(BayesianLSTM\).*peephole"):
        ibz.to_mcgraph(nn.ModuleDict({"rnn": bm.BayesianLSTM(3, 4, peephole=True)}), kl_samples=1)
    with pytest.raises(TypeError, match=r"'rnn' \(BayesianGRU\).*sharpen"):
        ibz.to_mcgraph(nn.ModuleDict({"rnn": bm.BayesianGRU(3, 4, sharpen=True)}), kl_samples=1)
    bnn = ibz.to_mcgraph(nn.ModuleDict({"rnn": bm.BayesianLSTM(3, 4)}), kl_samples=1)["rnn"]
    with pytest.raises(ValueError, match="sharpen_loss"):
        bnn(torch.randn(2, 5, 3), sharpen_loss=torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"x: .*\(batch, sequence, in_features\)"):
        bnn(torch.randn(5, 3))
    with pytest.raises(TypeError, match="holds a tensor"):
        bnn.ih_l0(torch.randn(2, 3))


# --------------------------------------------------------------------------- bayesian-torch


def _bt_lstm(bias=True, rho=-3.0, dtype=F64):
    bl, _ = _bt()
    torch.manual_seed(0)
    lstm = bl.LSTMReparameterization(4, 5, posterior_rho_init=rho, bias=bias).to(dtype)
    lstm.dnn_to_bnn_flag = True  # as dnn_to_bnn leaves it: the layer returns (out, hidden), no KL
    return lstm


def _convert_bt(module):
    _, ibt = _bt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mg.interop.convert.KLScaleWarning)  # the one-time notice of the conversion
        return ibt.to_mcgraph(module, kl_samples=4)


@pytest.mark.parametrize("bias", [True, False])
def test_bt_converted_lstm_equals_the_original_with_vanishing_sigma(bias):
    _, ibt = _bt()
    lstm = _bt_lstm(bias, rho=-60.0)  # σ = softplus(−60) ≈ 1e-26: every per-step draw is μ to float64 rounding
    x, h, c = _inputs()
    ref_out, (ref_h, ref_c) = lstm(x, (h, c))
    bnn = _convert_bt(nn.ModuleDict({"rnn": lstm}))["rnn"]
    assert isinstance(bnn, ibt.BayesianTorchLSTM)
    for forward in ("sample", "mean"):
        mg.nn.set_mode(bnn, forward)
        out, (hs, cs) = bnn(x, (h, c))
        assert hs is out and cs.shape == ref_c.shape == (3, 7, 5)
        torch.testing.assert_close(out, ref_out, rtol=1e-13, atol=1e-14)
        torch.testing.assert_close(cs, ref_c, rtol=1e-13, atol=1e-14)
    mg.nn.set_mode(bnn, "mean")
    torch.testing.assert_close(bnn(x)[0], lstm(x, (h * 0, c * 0))[0], rtol=1e-13, atol=1e-14)


def test_bt_dnn_to_bnn_model_converts():
    _, ibt = _bt()
    from bayesian_torch.models.dnn_to_bnn import dnn_to_bnn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(4, 5, batch_first=True)
            self.fc = nn.Linear(5, 3)

        def forward(self, x):
            out, (h, c) = self.lstm(x)
            return self.fc(out[:, -1])

    torch.manual_seed(0)
    net = Net()
    dnn_to_bnn(net, {"prior_mu": 0.0, "prior_sigma": 1.0, "posterior_mu_init": 0.0, "posterior_rho_init": -60.0,
                     "type": "Reparameterization", "moped_enable": False})
    net = net.to(F64)
    x = _inputs()[0]
    bnn = _convert_bt(net)
    assert isinstance(bnn.lstm, ibt.BayesianTorchLSTM) and isinstance(bnn.fc, mg.nn.BayesLinear)
    assert {id(p) for p in bnn.parameters()} == {id(p) for p in net.parameters()}
    h0 = torch.zeros(3, 5, dtype=F64)
    ref = net.fc(net.lstm(x, (h0, h0))[0][:, -1])  # bayesian-torch's default state is float32 zeros
    torch.testing.assert_close(bnn(x), ref, rtol=1e-13, atol=1e-14)


def _torch_lstm_run(x, h, c, w_ih, w_hh, b_ih, b_hh):
    ref = nn.LSTM(x.shape[-1], w_hh.shape[1], batch_first=True, dtype=x.dtype)
    params = {"weight_ih_l0": w_ih, "weight_hh_l0": w_hh, "bias_ih_l0": b_ih, "bias_hh_l0": b_hh}
    return functional_call(ref, params, (x, (h[None], c[None])))


def test_bt_converted_lstm_samples_once_per_sequence():
    """Sample s of a window = torch's nn.LSTM loaded with sample s's weights, at every step; c_seq = its cell states."""
    _, ibt = _bt()
    lstm = _bt_lstm(rho=-2.0)
    bnn = _convert_bt(nn.ModuleDict({"rnn": lstm}))["rnn"]
    x, h, c = _inputs()
    S = 3
    run = sample_run(bnn, S, seed=4)
    with window(run, 0, S):
        out, (_, cs) = bnn(x.repeat(S, 1, 1), (h.repeat(S, 1), c.repeat(S, 1)))

    def draws(site, kind, q):
        form = family_of(q)
        return form.sample(run.form_rows(site, kind, form, 0, S))

    ih, hh = bnn.ih_l0, bnn.hh_l0
    w = [draws(ih, NoiseKind.WEIGHT, ih.posterior), draws(hh, NoiseKind.WEIGHT, hh.posterior),
         draws(ih, NoiseKind.BIAS, ih.bias_posterior), draws(hh, NoiseKind.BIAS, hh.bias_posterior)]
    B = x.shape[0]
    for s in range(S):
        ref_out, (_, ref_c) = _torch_lstm_run(x, h, c, *(t[s] for t in w))
        torch.testing.assert_close(out[s * B:(s + 1) * B], ref_out, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(cs[s * B:(s + 1) * B, -1], ref_c[0], rtol=1e-12, atol=1e-13)
        for t in range(1, x.shape[1]):  # every step's cell state: the prefix run's c_n
            prefix = _torch_lstm_run(x[:, :t], h, c, *(u[s] for u in w))[1][1][0]
            torch.testing.assert_close(cs[s * B:(s + 1) * B, t - 1], prefix, rtol=1e-12, atol=1e-13)
    assert (out[:B] - out[B:2 * B]).abs().max() > 1e-3  # the samples differ


def test_bt_kl_is_the_weights_kl_once_where_the_original_adds_it_per_step():
    _, ibt = _bt()
    lstm = _bt_lstm(rho=-2.0)
    bnn = _convert_bt(nn.ModuleDict({"rnn": lstm}))["rnn"]
    exact = ibt.kl(lstm, 1)  # closed-form Normal KL summed over ih and hh (weights and biases)
    torch.testing.assert_close(mg.nn.kl(bnn, seed=0), exact, rtol=1e-12, atol=0)
    parts = sum(torch.distributions.kl_divergence(s.posterior, s.prior).sum() for s in mg.interop.sites(lstm))
    torch.testing.assert_close(exact, parts, rtol=1e-12, atol=0)
    # the original's forward (return_kl) adds its per-tensor-mean KL once per time step
    lstm.dnn_to_bnn_flag = False
    for T in (3, 7):
        x, h, c = _inputs(T=T)
        *_, kl_native = lstm(x, (h, c))
        torch.testing.assert_close(kl_native, T * ibt.kl(lstm, 1, reduction="per_tensor_mean"), rtol=1e-12, atol=0)
        bnn(x, (h, c))
        torch.testing.assert_close(mg.nn.kl(bnn, seed=0), exact, rtol=1e-12, atol=0)


def test_bt_shares_parameters_and_an_optimizer_step_moves_them():
    _, ibt = _bt()
    lstm = _bt_lstm()
    model = Classifier(lstm).to(F64)
    bnn = _convert_bt(model)
    assert bnn.rnn.ih_l0.weight_mu is lstm.ih.mu_weight and bnn.rnn.hh_l0.bias_rho is lstm.hh.rho_bias
    assert {id(p) for p in bnn.parameters()} == {id(p) for p in model.parameters()}
    assert [s.name for s in mg.interop.sites(model)] == ["rnn.ih.weight", "rnn.ih.bias", "rnn.hh.weight",
                                                         "rnn.hh.bias"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _inputs()[0], torch.tensor([0, 1, 2])
    before = [p.detach().clone() for p in (lstm.ih.mu_weight, lstm.hh.rho_weight, lstm.ih.rho_bias)]
    (-mg.nn.elbo(bnn, x, y, num_samples=4, dataset_size=100, seed=0)).backward()
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, (lstm.ih.mu_weight, lstm.hh.rho_weight,
                                                              lstm.ih.rho_bias)))
    assert torch.equal(model.state_dict()["rnn.ih.mu_weight"], bnn.rnn.ih_l0.weight_mu.detach())


def test_bt_refusals():
    bl, ibt = _bt()
    lstm = bl.LSTMReparameterization(3, 4)  # returns (out, hidden, kl): the model unpacks three values
    with pytest.raises(TypeError, match=r"'rnn' \(LSTMReparameterization\).*\(out, kl\) tuples"):
        ibt.to_mcgraph(nn.ModuleDict({"rnn": lstm}), kl_samples=1)
    flip = bl.LSTMFlipout(3, 4)
    flip.dnn_to_bnn_flag = True
    with pytest.raises(TypeError, match=r"'rnn' \(LSTMFlipout\).*flipout"):
        ibt.to_mcgraph(nn.ModuleDict({"rnn": flip}), kl_samples=1)
    lstm.dnn_to_bnn_flag = True
    bnn = _convert_bt(nn.ModuleDict({"rnn": lstm}))["rnn"]
    with pytest.raises(ValueError, match=r"X: .*\(batch, sequence, in_features\)"):
        bnn(torch.randn(5, 3))
