"""Bayesian recurrent and embedding layers against torch's own modules (the oracle)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils.rnn import pack_padded_sequence

import mcgraph as mg
from mcgraph.engine.plan.families import family_of
from mcgraph.engine.noise.streams import mix_seed
from mcgraph.nn import BayesEmbedding, BayesGRU, BayesLSTM, BayesRNN, BayesRNNBase
from mcgraph.nn.context import NoiseKind, sample_run, window

TORCH = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn_tanh": nn.RNN, "rnn_relu": nn.RNN}


def _torch_rnn(kind, *args, **kwargs):
    if kind.startswith("rnn"):
        kwargs["nonlinearity"] = kind[4:]
    return TORCH[kind](*args, **kwargs)


def _equal(a, b):
    if isinstance(a, tuple):
        return all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b)


def _close(a, b, **tol):
    if isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            _close(x, y, **tol)
    else:
        torch.testing.assert_close(a, b, **tol)


CASES = [(kind, layers, bi, bf, bias, proj)
         for kind, layers, bi, bf, bias, proj in itertools.product(
             TORCH, (1, 2), (False, True), (False, True), (True, False), (0, 3))
         if proj == 0 or kind == "lstm"]


def _inputs(bf, packed, unbatched, generator):
    T, N = 5, 3
    if unbatched:
        return torch.randn(T, 4, generator=generator)
    x = torch.randn(N, T, 4, generator=generator) if bf else torch.randn(T, N, 4, generator=generator)
    if packed:
        lengths = torch.tensor([5, 2, 4])
        return pack_padded_sequence(x, lengths, batch_first=bf, enforce_sorted=False)
    return x


@pytest.mark.parametrize("kind,layers,bi,bf,bias,proj", CASES)
@pytest.mark.parametrize("form", ["batched", "unbatched", "packed", "hx"])
def test_mean_mode_is_exactly_torch(kind, layers, bi, bf, bias, proj, form):
    torch.manual_seed(0)
    extra = {"proj_size": proj} if proj else {}
    ref = _torch_rnn(kind, 4, 6, num_layers=layers, bias=bias, batch_first=bf, bidirectional=bi, **extra)
    bayes = mg.nn.freeze(BayesRNNBase.from_torch(ref))
    if form == "packed" and proj:
        pytest.skip("torch's CPU LSTM with projections rejects PackedSequence input")
    g = torch.Generator().manual_seed(1)
    x = _inputs(bf, form == "packed", form == "unbatched", g)
    args = (x,)
    if form == "hx":
        D = 2 if bi else 1
        h = torch.randn(layers * D, 3, proj or 6, generator=g)
        args = (x, (h, torch.randn(layers * D, 3, 6, generator=g)) if kind == "lstm" else h)
    out_ref, h_ref = ref(*args)
    out, h = bayes(*args)
    if form == "packed":
        out_ref, out = out_ref.data, out.data
    assert torch.equal(out, out_ref)
    assert _equal(h, h_ref)


@pytest.mark.parametrize("kind", list(TORCH))
def test_vanishing_sigma_gives_torch_in_sample_mode(kind):
    torch.manual_seed(0)
    ref = _torch_rnn(kind, 4, 6, num_layers=2, bidirectional=True, batch_first=True)
    bayes = BayesRNNBase.from_torch(ref, rho_init=-40.0)  # σ = softplus(−40) ≈ 4e-18
    sites = mg.nn.bayesian_modules(bayes)
    assert sites and all(m.mode == mg.nn.SampleMode.SAMPLE for m in sites)  # sampled weights, not the means
    x = torch.randn(3, 5, 4)
    out, h = bayes(x)
    out_ref, h_ref = ref(x)
    _close((out, h), (out_ref, h_ref), rtol=1e-6, atol=1e-6)
    # the same layer with a σ that does not vanish samples visibly other weights: the check above can fail
    wide = BayesRNNBase.from_torch(ref, rho_init=-1.0)
    assert (wide(x)[0] - out_ref).abs().max() > 1e-3


def test_torch_signatures_and_returns():
    lstm = BayesLSTM(4, 6, 2, True, True, 0.0, True, 3)
    out, (h, c) = lstm(torch.randn(2, 7, 4))
    assert out.shape == (2, 7, 6) and h.shape == (4, 2, 3) and c.shape == (4, 2, 6)
    gru = BayesGRU(4, 6, num_layers=1, bias=False)
    out, h = gru(torch.randn(7, 2, 4))
    assert out.shape == (7, 2, 6) and h.shape == (1, 2, 6)
    rnn = BayesRNN(4, 6, 1, "relu")
    assert rnn.mode == "RNN_RELU" and rnn(torch.randn(7, 4))[0].shape == (7, 6)
    assert [n for n, _ in lstm.named_children()] == ["ih_l0", "hh_l0", "hr_l0", "ih_l0_reverse", "hh_l0_reverse",
                                                      "hr_l0_reverse", "ih_l1", "hh_l1", "hr_l1", "ih_l1_reverse",
                                                      "hh_l1_reverse", "hr_l1_reverse"]
    assert all(isinstance(m, mg.nn.BayesLinear) for m in mg.nn.bayesian_modules(lstm))
    lstm.flatten_parameters()  # nn.LSTM code calls it


def _sampled(site, run, M):
    """The M weight samples of ``site`` in ``run`` (the rows every forward of the run consumes)."""
    form = family_of(site.posterior)
    return form.sample(run.form_rows(site, NoiseKind.WEIGHT, form, 0, M))


def _torch_params(bayes, run, M, i, weights=None):
    """``{name: tensor}`` of torch's module for sample ``i`` of ``run``."""
    params = {}
    for names in bayes._site_names:
        for n in names:
            site = getattr(bayes, n)
            key = (n, "w")
            if weights is not None and key in weights:
                W = weights[key]
            else:
                W = _sampled(site, run, M)
                if weights is not None:
                    weights[key] = W
            suffix = n[2:]
            params[f"weight_{n[:2]}{suffix}"] = W[i]
            if site.bias is not None:
                params[f"bias_{n[:2]}{suffix}"] = site.bias
    return params


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("packed", [False, True])
def test_one_weight_sample_per_sequence_matches_torch_with_that_sample(kind, packed):
    torch.manual_seed(0)
    ref = _torch_rnn(kind, 4, 6, num_layers=2, bidirectional=True, batch_first=True)
    bayes = BayesRNNBase.from_torch(ref, rho_init=-1.0)
    M, x = 4, torch.randn(3, 5, 4)
    lengths = torch.tensor([5, 2, 4])

    class Last(nn.Module):  # the whole output sequence (packed: padded back), one row block per sample
        def __init__(self, rnn):
            super().__init__()
            self.rnn = rnn

        def forward(self, x):
            if packed:
                n = x.shape[0] // 3
                p = pack_padded_sequence(x, lengths.repeat(n), batch_first=True, enforce_sorted=False)
                out, h = self.rnn(p)
                return torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]
            return self.rnn(x)[0]

    model = Last(bayes)
    for chunk in (1, 3, M):
        got = mg.nn.forward_samples(model, x, M, seed=5, chunk_size=chunk)
        run = sample_run(model, M, seed=5)
        for i in range(M):
            with torch.no_grad():
                inp = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False) if packed else x
                out = functional_call(ref, _torch_params(bayes, run, M, i), (inp,))[0]
                if packed:
                    out = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]
            torch.testing.assert_close(got[i], out, rtol=1e-5, atol=1e-6)
    same = mg.nn.forward_samples(model, x, M, seed=5)
    other = mg.nn.forward_samples(model, x, M, seed=6)
    assert torch.equal(same, got) and not torch.allclose(same, other)
    assert not torch.allclose(got[0], got[1])  # samples differ from each other


def test_kl_is_the_sum_of_the_weights_kl_and_independent_of_sequence_length():
    torch.manual_seed(0)
    lstm = BayesLSTM(4, 6, num_layers=2, proj_size=2, bidirectional=True, prior="normal", rho_init=-2.0)
    sites = mg.nn.bayesian_modules(lstm)
    assert len(sites) == 12
    per_site = sum(s.kl(seed=mix_seed(0, i)) for i, s in enumerate(sites))
    torch.testing.assert_close(mg.nn.kl(lstm, seed=0), per_site)
    exact = sum(torch.distributions.kl_divergence(s.posterior, s.prior).sum() for s in sites)
    torch.testing.assert_close(mg.nn.kl(lstm, 4000, seed=0), exact, rtol=2e-3, atol=0)
    before = mg.nn.kl(lstm, seed=0)
    for T in (1, 50):
        lstm(torch.randn(T, 2, 4)).__class__
        torch.testing.assert_close(mg.nn.kl(lstm, seed=0), before)
    # the ELBO's KL term does not see T
    head = nn.Sequential()
    x1, x2 = torch.randn(2, 3, 4), torch.randn(2, 40, 4)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = BayesLSTM(4, 6, batch_first=True)
            self.head = nn.Linear(6, 3)

        def forward(self, x):
            return self.head(self.lstm(x)[0][:, -1])

    net = Net()
    y = torch.tensor([0, 1])
    k1 = mg.nn.elbo_terms(net, x1, y, num_samples=2, dataset_size=10, seed=0).kl
    k2 = mg.nn.elbo_terms(net, x2, y, num_samples=2, dataset_size=10, seed=0).kl
    torch.testing.assert_close(k1, k2)
    del head


class _Classifier(nn.Module):
    def __init__(self, cell="lstm", dropout=0.0, **options):
        super().__init__()
        cls = {"lstm": BayesLSTM, "gru": BayesGRU}[cell]
        self.rnn = cls(3, 5, num_layers=2, batch_first=True, dropout=dropout, **options)
        self.head = mg.nn.BayesLinear(5, 4, **options)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_elbo_gradients_match_a_per_sample_torch_reference_float64(cell):
    torch.manual_seed(0)
    net = _Classifier(cell, rho_init=-1.5, dtype=torch.float64)
    x, y = torch.randn(4, 6, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    M, N = 5, 100
    value = mg.nn.elbo(net, x, y, num_samples=mg.Sampling(M, chunk_size=2), dataset_size=N, seed=3)
    grads = torch.autograd.grad(value, list(net.parameters()))
    # reference: torch's module with each sample's weights, every sample in one graph
    ref = (nn.LSTM if cell == "lstm" else nn.GRU)(3, 5, num_layers=2, batch_first=True, dtype=torch.float64)
    run = sample_run(net, M, seed=3)
    weights = {}
    head_w = _sampled(net.head, run, M)
    ll = 0
    for i in range(M):
        out = functional_call(ref, _torch_params(net.rnn, run, M, i, weights), (x,))[0][:, -1]
        logits = torch.nn.functional.linear(out, head_w[i], net.head.bias)
        ll = ll + torch.distributions.Categorical(logits=logits).log_prob(y).mean()
    terms = mg.nn.elbo_terms(net, x, y, num_samples=M, dataset_size=N, seed=3)
    ref_value = ll / M - terms.kl / N
    torch.testing.assert_close(value, ref_value, rtol=1e-10, atol=1e-12)
    ref_grads = torch.autograd.grad(ref_value, list(net.parameters()))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-10)


def test_gradcheck_float64_through_the_fused_kernel():
    torch.manual_seed(0)
    lstm = BayesLSTM(3, 4, num_layers=2, bidirectional=True, proj_size=2, dtype=torch.float64, rho_init=-1.0)
    run = sample_run(lstm, 2, seed=0)
    x = torch.randn(5, 4, 3, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(4, 4, 2, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(4, 4, 4, dtype=torch.float64, requires_grad=True)
    mu = lstm.ih_l1.weight_mu

    def f(x, h0, c0, mu_value):
        with window(run, 0, 2):
            out, (h, c) = functional_call(lstm, {"ih_l1.weight_mu": mu_value}, (x, (h0, c0)))
        return out, h, c

    assert torch.autograd.gradcheck(f, (x, h0, c0, mu.detach().clone().requires_grad_()))


def test_dropout_between_layers_is_replayed_by_the_chunked_elbo():
    torch.manual_seed(0)
    net = _Classifier("lstm", dropout=0.5, dtype=torch.float64).train()
    x, y = torch.randn(4, 6, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    a = mg.nn.elbo(net, x, y, num_samples=mg.Sampling(4, chunk_size=1), dataset_size=10, seed=1)
    ga = torch.autograd.grad(a, list(net.parameters()))
    b = mg.nn.elbo(net, x, y, num_samples=mg.Sampling(4, method="direct"), dataset_size=10, seed=1)
    gb = torch.autograd.grad(b, list(net.parameters()))
    torch.testing.assert_close(a, b)
    for u, v in zip(ga, gb, strict=True):
        torch.testing.assert_close(u, v)
    mg.nn.freeze(net.eval())  # mean weights and no dropout in eval: every sample is the same
    c = mg.nn.forward_samples(net, x, 2, seed=1)
    torch.testing.assert_close(c[0], c[1])


def _graph_bytes(net, x, y, M):
    return mg.graph_size(lambda: mg.nn.elbo(net, x, y, num_samples=M, dataset_size=100, seed=0)).saved_bytes


def test_elbo_graph_bytes_flat_in_num_samples_lstm_classifier():
    torch.manual_seed(0)
    net = mg.nn.bayesify(mg.models.sequence.LSTMClassifier(8, 10, hidden_size=16), posterior="radial",
                         prior="scale_mixture", kl_samples=4)
    x, y = torch.randn(6, 8, 8), torch.arange(6)
    a, b = _graph_bytes(net, x, y, 2), _graph_bytes(net, x, y, 256)
    assert abs(b - a) <= 0.05 * a, (a, b)


def test_predict_and_pruning_reach_the_sites():
    torch.manual_seed(0)
    net = mg.nn.bayesify(mg.models.sequence.LSTMClassifier(8, 10, hidden_size=16), posterior="sparse_vd")
    x = torch.randn(3, 8, 8)
    probs = mg.nn.predict(net, x, num_samples=5, seed=0, chunk_size=2)
    torch.testing.assert_close(probs, mg.nn.predict(net, x, num_samples=5, seed=0, chunk_size=5))
    report = mg.nn.prune(net, threshold=-float("inf"))
    assert report.kept == 0 and len(report.layers) == 3
    mg.nn.freeze(net)
    plain = net.lstm.to_torch()  # the pruned means: zero weights, the (deterministic) biases kept
    assert all(not w.any() for n, w in plain.named_parameters() if n.startswith("weight"))
    assert torch.equal(net.lstm(x)[0], plain(x)[0])


@pytest.mark.parametrize("make,error", [
    (lambda: BayesLSTM(4, 6, proj_size=6), "proj_size"),
    (lambda: BayesLSTM(4, 6, proj_size=-1), "proj_size"),
    (lambda: BayesGRU(4, 6, proj_size=2), "proj_size"),
    (lambda: BayesLSTM(4, 0), "hidden_size"),
    (lambda: BayesLSTM(4, 6, dropout=1.5), "dropout"),
    (lambda: BayesRNN(4, 6, nonlinearity="sigmoid"), "nonlinearity"),
    (lambda: BayesLSTM(4, 6, local_reparameterization=True), "local_reparameterization"),
    (lambda: BayesLSTM(4, 6, estimator="flipout"), "estimator='flipout' is not available for recurrent layers"),
    (lambda: BayesEmbedding(10, 4, padding_idx=10), "padding_idx"),
])
def test_bad_construction_names_the_argument(make, error):
    with pytest.raises(ValueError, match=error):
        make()


def test_bad_forward_input_names_the_argument():
    lstm = BayesLSTM(4, 6, num_layers=2)
    with pytest.raises(ValueError, match="input"):
        lstm(torch.randn(5, 2, 3))
    with pytest.raises(ValueError, match="input"):
        lstm(torch.randn(5, 2, 4, 1))
    with pytest.raises(ValueError, match="hx"):
        lstm(torch.randn(5, 2, 4), (torch.zeros(1, 2, 6), torch.zeros(2, 2, 6)))
    with pytest.raises(ValueError, match="hx"):
        lstm(torch.randn(5, 2, 4), torch.zeros(2, 2, 6))
    with pytest.raises(ValueError, match="hx"):
        BayesGRU(4, 6)(torch.randn(5, 2, 4), torch.zeros(1, 3, 6))
    run = sample_run(lstm, 3, seed=0)
    with window(run, 0, 3), pytest.raises(ValueError, match="multiple of 3"):
        lstm(torch.randn(5, 4, 4))


# ---------------------------------------------------------------------------------------------- embedding

@pytest.mark.parametrize("padding_idx,max_norm,scale", [(None, None, False), (0, None, True), (-1, 1.0, False)])
def test_embedding_mean_mode_is_exactly_torch(padding_idx, max_norm, scale):
    torch.manual_seed(0)
    ref = nn.Embedding(10, 4, padding_idx=padding_idx, max_norm=max_norm, scale_grad_by_freq=scale)
    bayes = mg.nn.freeze(BayesEmbedding.from_torch(ref))
    x = torch.tensor([[0, 3, 9, 3], [1, 1, 0, 2]])
    out_ref, out = ref(x), bayes(x)
    assert torch.equal(out, out_ref)
    out_ref.sum().backward()
    out.sum().backward()
    torch.testing.assert_close(bayes.weight_mu.grad, ref.weight.grad)


def test_embedding_padding_row_is_zero_and_gets_no_gradient():
    emb = BayesEmbedding(10, 4, padding_idx=2, rho_init=0.0)
    x = torch.tensor([[2, 3, 2], [1, 2, 5]])
    out = mg.nn.forward_samples(emb, x, 3, seed=0)
    assert torch.equal(out[:, x == 2], torch.zeros_like(out[:, x == 2]))
    out.square().sum().backward()
    assert emb.weight_mu.grad[2].abs().sum() == 0 and emb.weight_rho.grad[2].abs().sum() == 0
    assert emb.weight_mu.grad[3].abs().sum() > 0


def test_embedding_samples_are_the_rows_of_each_drawn_table():
    torch.manual_seed(0)
    emb = BayesEmbedding(7, 3, rho_init=-1.0)
    x = torch.tensor([[0, 6], [2, 2]])
    M = 4
    for chunk in (1, 4):
        got = mg.nn.forward_samples(emb, x, M, seed=2, chunk_size=chunk)
        tables = _sampled(emb, sample_run(emb, M, seed=2), M)
        for i in range(M):
            assert torch.equal(got[i], tables[i][x])
