"""Bayesian multi-head attention, bayesify of sequence models (``only=``), and a short training run."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from torch import nn
from torch.func import functional_call

import mcgraph as mg
from mcgraph.engine.plan.families import family_of
from mcgraph.models import LSTMClassifier, TransformerClassifier
from mcgraph.nn import BayesMultiheadAttention
from mcgraph.nn.context import NoiseKind, sample_run

MHA_CASES = list(itertools.product([False, True], [False, True], [False, True], [False, True], [None, 6]))


def _qkv(bf, kdim, self_attention, g):
    N, L, S = 3, 4, 5
    if self_attention:
        q = torch.randn(N, L, 8, generator=g) if bf else torch.randn(L, N, 8, generator=g)
        return q, q, q, L
    q = torch.randn(N, L, 8, generator=g) if bf else torch.randn(L, N, 8, generator=g)
    k = torch.randn(N, S, kdim or 8, generator=g) if bf else torch.randn(S, N, kdim or 8, generator=g)
    return q, k, k, S


@pytest.mark.parametrize("bf,bias_kv,zero_attn,bias,kdim", MHA_CASES)
@pytest.mark.parametrize("masks", ["none", "padding", "attn2d", "attn3d", "causal"])
@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
def test_mean_mode_is_exactly_torch(bf, bias_kv, zero_attn, bias, kdim, masks, need_weights, average):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(8, 2, bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn, kdim=kdim,
                                vdim=kdim, batch_first=bf)
    bayes = mg.nn.freeze(BayesMultiheadAttention.from_torch(ref))
    g = torch.Generator().manual_seed(1)
    causal = masks == "causal"
    if causal and kdim:
        pytest.skip("is_causal is a self-attention option")
    q, k, v, S = _qkv(bf, kdim, causal, g)
    L, N = 4, 3
    kwargs = dict(need_weights=need_weights, average_attn_weights=average)
    if masks == "padding":
        kpm = torch.rand(N, S, generator=g) < 0.3
        kpm[:, 0] = False
        kwargs["key_padding_mask"] = kpm
    elif masks == "attn2d":
        kwargs["attn_mask"] = torch.triu(torch.ones(L, S, dtype=torch.bool), 1)
    elif masks == "attn3d":
        kwargs["attn_mask"] = torch.randn(N * 2, L, S, generator=g)
    elif causal:
        kwargs.update(attn_mask=nn.Transformer.generate_square_subsequent_mask(L), is_causal=True)
    out_ref, w_ref = ref(q, k, v, **kwargs)
    out, w = bayes(q, k, v, **kwargs)
    assert torch.equal(out, out_ref)
    assert (w is None and w_ref is None) or torch.equal(w, w_ref)
    assert torch.equal(bayes(q[:, 0] if bf else q[:, 0], k[:, 0], v[:, 0])[0],
                       ref(q[:, 0], k[:, 0], v[:, 0])[0])  # unbatched


def _sampled(site, run, M):
    form = family_of(site.posterior)
    return form.sample(run.form_rows(site, NoiseKind.WEIGHT, form, 0, M))


@pytest.mark.parametrize("kdim", [None, 6])
def test_one_weight_sample_per_sample_matches_torch_with_that_sample(kdim):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(8, 2, kdim=kdim, vdim=kdim, batch_first=True)
    bayes = BayesMultiheadAttention.from_torch(ref, rho_init=-1.0)
    g = torch.Generator().manual_seed(1)
    q, k, v, S = _qkv(True, kdim, False, g)
    kpm = torch.zeros(3, S, dtype=torch.bool)
    kpm[1, -2:] = True
    am = torch.rand(3 * 2, 4, S, generator=g) < 0.2
    am[..., 0] = False

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = bayes

        def forward(self, q):
            n = q.shape[0] // 3
            out, w = self.attn(q, k.repeat(n, 1, 1), v.repeat(n, 1, 1), key_padding_mask=kpm.repeat(n, 1),
                               attn_mask=am.repeat(n, 1, 1), average_attn_weights=False)
            return torch.cat([out.flatten(1), w.flatten(1)], 1)

    model, M = Wrap(), 3
    got = mg.nn.forward_samples(model, q, M, seed=4, chunk_size=2)
    run = sample_run(model, M, seed=4)
    out_w = _sampled(bayes.out_proj, run, M)
    if kdim is None:
        in_w = _sampled(bayes.in_proj, run, M)
    else:
        qkv = [_sampled(s, run, M) for s in (bayes.q_proj, bayes.k_proj, bayes.v_proj)]
    for i in range(M):
        params = {"out_proj.weight": out_w[i]}
        if kdim is None:
            params["in_proj_weight"] = in_w[i]
        else:
            params.update({"q_proj_weight": qkv[0][i], "k_proj_weight": qkv[1][i], "v_proj_weight": qkv[2][i]})
        with torch.no_grad():
            out, w = functional_call(ref, params, (q, k, v), dict(key_padding_mask=kpm, attn_mask=am,
                                                                  average_attn_weights=False))
        torch.testing.assert_close(got[i], torch.cat([out.flatten(1), w.flatten(1)], 1), rtol=1e-5, atol=1e-6)


def test_elbo_gradients_of_attention_match_a_per_sample_reference_float64():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = BayesMultiheadAttention(8, 2, batch_first=True, rho_init=-1.5, dtype=torch.float64)
            self.head = nn.Linear(8, 3, dtype=torch.float64)

        def forward(self, x):
            return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))

    net = Net()
    x, y = torch.randn(4, 5, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    M, N = 4, 50
    value = mg.nn.elbo(net, x, y, num_samples=mg.Sampling(M, chunk_size=3), dataset_size=N, seed=2)
    params = list(net.parameters())
    grads = torch.autograd.grad(value, params)
    ref = nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    run = sample_run(net, M, seed=2)
    in_w, out_w = _sampled(net.attn.in_proj, run, M), _sampled(net.attn.out_proj, run, M)
    ll = 0
    for i in range(M):
        p = {"in_proj_weight": in_w[i], "in_proj_bias": net.attn.in_proj.bias, "out_proj.weight": out_w[i],
             "out_proj.bias": net.attn.out_proj.bias}
        h = functional_call(ref, p, (x, x, x), dict(need_weights=False))[0].mean(1)
        ll = ll + torch.distributions.Categorical(logits=net.head(h)).log_prob(y).mean()
    ref_value = ll / M - mg.nn.elbo_terms(net, x, y, num_samples=M, dataset_size=N, seed=2).kl / N
    torch.testing.assert_close(value, ref_value, rtol=1e-10, atol=1e-12)
    for g, r in zip(grads, torch.autograd.grad(ref_value, params), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-10)


def test_attention_dropout_is_replayed_by_the_chunked_elbo():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = BayesMultiheadAttention(8, 2, dropout=0.3, dtype=torch.float64)
            self.head = nn.Linear(8, 3, dtype=torch.float64)

        def forward(self, x):  # (N, L, E) in, the attention sequence-first
            x = x.transpose(0, 1)
            return self.head(self.attn(x, x, x)[0].mean(0))

    net = Net().train()
    x, y = torch.randn(4, 5, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    a = mg.nn.elbo(net, x, y, num_samples=mg.Sampling(4, chunk_size=1), dataset_size=10, seed=1)
    b = mg.nn.elbo(net, x, y, num_samples=mg.Sampling(4, method="direct"), dataset_size=10, seed=1)
    ga, gb = (torch.autograd.grad(v, list(net.parameters())) for v in (a, b))
    torch.testing.assert_close(a, b)
    for u, v in zip(ga, gb, strict=True):
        torch.testing.assert_close(u, v)


def test_bad_attention_arguments_name_them():
    with pytest.raises(ValueError, match="embed_dim must be divisible by num_heads"):
        BayesMultiheadAttention(10, 3)
    attn = BayesMultiheadAttention(8, 2)
    with pytest.raises(ValueError, match="query"):
        attn(torch.randn(4, 3, 7), torch.randn(4, 3, 8), torch.randn(4, 3, 8))
    with pytest.raises(ValueError, match="key"):
        attn(torch.randn(4, 3, 8), torch.randn(4, 3, 6), torch.randn(4, 3, 8))


# ---------------------------------------------------------------------------------------------- bayesify


def test_bayesify_converts_every_sequence_module_and_keeps_the_function():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 8, padding_idx=0)
            self.lstm = nn.LSTM(8, 8, num_layers=2, bidirectional=True, batch_first=True)
            self.gru = nn.GRU(16, 8, batch_first=True)
            self.rnn = nn.RNN(8, 8, nonlinearity="relu", batch_first=True)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, tokens):
            h = self.rnn(self.gru(self.lstm(self.emb(tokens))[0])[0])[0]
            return self.head(self.attn(h, h, h)[0].mean(1))

    net = Net()
    bnn = mg.nn.bayesify(net)
    kinds = {type(m).__name__ for m in bnn.modules()}
    assert {"BayesEmbedding", "BayesLSTM", "BayesGRU", "BayesRNN", "BayesMultiheadAttention"} <= kinds
    assert not any(type(m) in (nn.LSTM, nn.GRU, nn.RNN, nn.Embedding, nn.MultiheadAttention, nn.Linear)
                   for m in bnn.modules())
    tokens = torch.randint(0, 20, (4, 6))
    assert torch.equal(mg.nn.freeze(bnn)(tokens), net(tokens))


def test_bayesify_transformer_encoder_mean_mode_is_torch_in_train_and_eval():
    torch.manual_seed(0)
    net = TransformerClassifier(8, 10, max_len=8)
    bnn = mg.nn.bayesify(net, posterior="radial")
    x = torch.randn(4, 8, 8)
    for mode in ("train", "eval"):
        getattr(net, mode)()
        getattr(bnn, mode)()
        with mg.nn.frozen(bnn):
            torch.testing.assert_close(bnn(x), net(x), rtol=1e-6, atol=1e-6)
    bnn.eval()
    with torch.no_grad():  # inference: torch's fused encoder path must not bypass the sampled weights
        a, b = bnn(x), bnn(x)
    assert not torch.equal(a, b)
    assert all(not m.use_nested_tensor for m in bnn.modules() if isinstance(m, nn.TransformerEncoder))


def test_bayesify_only_selects_names_patterns_and_types():
    net = TransformerClassifier(8, 10, max_len=8, num_layers=2)
    head = mg.nn.bayesify(net, only="head")
    assert [type(m).__name__ for m in mg.nn.bayesian_modules(head)] == ["BayesLinear"]
    attn = mg.nn.bayesify(net, only=nn.MultiheadAttention)
    assert sum(isinstance(m, BayesMultiheadAttention) for m in attn.modules()) == 2
    assert isinstance(attn.head, nn.Linear) and isinstance(attn.encoder.layers[0].linear1, nn.Linear)
    pattern = mg.nn.bayesify(net, only="encoder.layers.1*")
    assert isinstance(pattern.encoder.layers[1].self_attn, BayesMultiheadAttention)
    assert isinstance(pattern.encoder.layers[1].linear2, mg.nn.BayesLinear)
    assert isinstance(pattern.encoder.layers[0].self_attn, nn.MultiheadAttention)
    block = mg.nn.bayesify(net, only=["encoder.layers.0"], skip=("encoder.layers.0.linear1",))
    assert isinstance(block.encoder.layers[0].linear1, nn.Linear)
    assert isinstance(block.encoder.layers[0].linear2, mg.nn.BayesLinear)
    with pytest.raises(ValueError, match="only"):
        mg.nn.bayesify(net, only="encoder.nothing")
    with pytest.raises(ValueError, match="only"):
        mg.nn.bayesify(net, only="nothing.*")
    with pytest.raises(TypeError, match="only"):
        mg.nn.bayesify(net, only=[3])


def test_elbo_graph_bytes_flat_in_num_samples_transformer_classifier():
    torch.manual_seed(0)
    net = mg.nn.bayesify(TransformerClassifier(8, 10, d_model=16, nhead=2, num_layers=1, max_len=8),
                         posterior="normal", prior="laplace", kl_samples=2)
    x, y = torch.randn(4, 8, 8), torch.arange(4)

    def size(M):
        return mg.graph_size(lambda: mg.nn.elbo(net, x, y, num_samples=M, dataset_size=100, seed=0)).saved_bytes

    a, b = size(2), size(256)
    assert abs(b - a) <= 0.05 * a, (a, b)


# ---------------------------------------------------------------------------------------------- training

def _digits_rows():
    datasets = pytest.importorskip("sklearn.datasets")
    data = datasets.load_digits()
    x = torch.tensor(data.images, dtype=torch.float32) / 16.0  # (1797, 8, 8): 8 steps of 8 pixels
    y = torch.tensor(data.target)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=g)
    x, y = x[perm], y[perm]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def _train(model, x, y, epochs, num_samples, lr=1e-2, batch=64):
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    for epoch in range(epochs):
        perm = torch.randperm(len(y), generator=g)
        for i in range(0, len(y), batch):
            idx = perm[i:i + batch]
            loss = -mg.nn.elbo(model, x[idx], y[idx], num_samples=num_samples, dataset_size=len(y),
                               kl_weight=0.1)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


def test_bayesian_lstm_learns_digits_read_by_rows():
    x, y, xt, yt = _digits_rows()
    torch.manual_seed(0)
    bnn = mg.nn.bayesify(LSTMClassifier(8, 10, hidden_size=48), rho_init=-6.0)
    start = time.perf_counter()
    _train(bnn, x, y, epochs=8, num_samples=1)
    probs = mg.nn.predict(bnn.eval(), xt, num_samples=8, seed=0)
    accuracy = (probs.argmax(1) == yt).float().mean().item()
    assert accuracy >= 0.90, (accuracy, time.perf_counter() - start)


# --------------------------------------------------------------------------- samples batched in one computation


def _window_outputs(attn, q, k, v, batched, S=3, **kw):
    """The window's outputs and the gradients of their sum, with the samples batched or one call each."""
    attn.batch_samples = batched
    attn.zero_grad()
    run = sample_run(attn, S, seed=4)
    from mcgraph.nn.context import window

    with window(run, 0, S):
        out, weights = attn(q.repeat(S, 1, 1), k.repeat(S, 1, 1), v.repeat(S, 1, 1), **kw)
    out.pow(2).sum().backward()
    return out.detach(), weights, [p.grad.clone() for p in attn.parameters() if p.grad is not None]


@pytest.mark.parametrize("case", ["self", "self-padding", "self-3d-mask", "cross-kdim", "mean-mode"])
def test_batched_samples_equal_one_call_per_sample(case):
    """The batched path (per-sample projections as batched products, one attention over every row)
    computes what one ``F.multi_head_attention_forward`` per sample computes, gradients included."""
    torch.manual_seed(0)
    kdim = 6 if case == "cross-kdim" else None
    attn = BayesMultiheadAttention(8, 2, batch_first=True, kdim=kdim, vdim=kdim, dtype=torch.float64)
    if case == "mean-mode":
        mg.nn.set_mode(attn, "mean")
    q = torch.randn(2, 5, 8, dtype=torch.float64)
    k = q if kdim is None else torch.randn(2, 7, kdim, dtype=torch.float64)
    v = k
    kw = {"need_weights": False}
    if case == "self-padding":
        pad = torch.tensor([[False] * 3 + [True] * 2, [False] * 5])
        kw["key_padding_mask"] = pad.repeat(3, 1)
    if case == "self-3d-mask":
        kw["attn_mask"] = torch.randn(3 * 2 * 2, 5, 5, dtype=torch.float64)
    loop = _window_outputs(attn, q, k, v, False, **kw)
    batched = _window_outputs(attn, q, k, v, True, **kw)
    torch.testing.assert_close(batched[0], loop[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(batched[2], loop[2]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_calls_the_batched_path_does_not_cover_run_one_call_per_sample():
    """Attention weights, ``bias_k``/``bias_v`` and attention dropout in training run per sample (then the
    numbers are the per-sample path's whatever ``batch_samples`` says)."""
    torch.manual_seed(0)
    attn = BayesMultiheadAttention(8, 2, batch_first=True, add_bias_kv=True)
    q = torch.randn(2, 5, 8)
    assert not attn._batches_samples(q, False, None, False)
    plain = BayesMultiheadAttention(8, 2, batch_first=True)
    plain.batch_samples = True
    assert plain._batches_samples(q, False, None, False)
    assert not plain._batches_samples(q, True, None, False)  # need_weights
    assert not plain._batches_samples(q, False, None, True)  # is_causal without a mask: torch's error, per sample
    plain.batch_samples = None  # the default: batched on CUDA only
    assert plain._batches_samples(q, False, None, False) == (q.device.type in BayesMultiheadAttention.BATCHED_DEVICES)
    out, weights = _window_outputs(attn, q, q, q, True)[:2]
    assert weights is not None and out.shape == (6, 5, 8)
