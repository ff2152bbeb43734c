"""MC dropout between stacked recurrent layers: torch's ``dropout=`` of nn.LSTM/GRU/RNN kept on per Monte Carlo sample."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mcgraph as mg
from mcgraph.nn import MCDropoutRNN
from mcgraph.nn.context import sample_run
from mcgraph.nn.recurrent import LAYER_DROPOUT

P = 0.4


class Classifier(nn.Module):
    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(rnn.hidden_size * (2 if rnn.bidirectional else 1), 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def _net(cell="lstm", bidirectional=False, dtype=torch.float64, dropout=P):
    torch.manual_seed(0)
    cls = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[cell]
    return Classifier(cls(3, 5, num_layers=2, batch_first=True, dropout=dropout, bidirectional=bidirectional,
                          dtype=dtype)).to(dtype)


def _x(dtype=torch.float64):
    return torch.randn(4, 6, 3, generator=torch.Generator().manual_seed(1), dtype=dtype)


def test_mc_dropout_replaces_the_recurrent_module_and_keeps_its_parameters():
    net = _net()
    keys = list(net.state_dict())
    mc = mg.nn.mc_dropout(net, inplace=True)
    assert isinstance(mc.rnn, MCDropoutRNN) and mc.rnn.p == P and not mc.training
    assert list(mc.state_dict()) == keys  # torch's parameter names, unchanged
    copy = mg.nn.mc_dropout(_net())
    assert copy.rnn.weight_ih_l0 is not net.rnn.weight_ih_l0  # a deep copy by default
    assert mg.nn.mc_dropout(_net(), p=0.1).rnn.p == 0.1
    # one optimizer step on the MC model moves the original module's Parameters (inplace: the same objects)
    lstm = nn.LSTM(3, 5, num_layers=2, dropout=P)
    wrapped = MCDropoutRNN(lstm)
    assert all(getattr(wrapped, n) is getattr(lstm, n) for n in lstm._flat_weights_names)


@pytest.mark.parametrize("cell,bidirectional", [("lstm", False), ("gru", True), ("rnn", False)])
def test_same_seed_same_output_and_masks_differ_across_samples(cell, bidirectional):
    mc = mg.nn.mc_dropout(_net(cell, bidirectional))
    x = _x()
    a = mg.nn.forward_samples(mc, x, 6, seed=0)
    b = mg.nn.forward_samples(mc, x, 6, seed=0, chunk_size=1)  # any chunking replays the same masks
    c = mg.nn.forward_samples(mc, x, 6, seed=0, vectorize=False)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert not torch.equal(a, mg.nn.forward_samples(mc, x, 6, seed=1))
    for i in range(6):
        for j in range(i):
            assert (a[i] - a[j]).abs().max() > 1e-6, (i, j)
    probs = mg.nn.predict(mc, x, num_samples=6, seed=0)
    torch.testing.assert_close(probs, a.softmax(-1).mean(0))


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_each_sample_is_torch_with_one_mask_per_sequence(cell):
    """Sample i = torch's one-layer kernels with sample i's (T, B, H) mask between them, nothing else."""
    M = 3
    mc = mg.nn.mc_dropout(_net(cell))
    x = _x()
    got = mg.nn.forward_samples(mc, x, M, seed=5)
    rnn = mc.rnn
    run = sample_run(mc, M, seed=5)
    keep = 1 - P
    shape = (x.shape[1], x.shape[0], 5)  # (T, B, H): the layer-0 output, time-major
    masks = run.raw_rows(rnn, LAYER_DROPOUT, lambda n: (torch.rand((n,) + shape) < keep).to(x.dtype), shape,
                         x.dtype, x.device, 0, M)
    assert 0 < masks.mean() < 1
    cls = {"lstm": nn.LSTM, "gru": nn.GRU}[cell]
    layers = [cls(3 if k == 0 else 5, 5, batch_first=True, dtype=x.dtype) for k in range(2)]
    with torch.no_grad():
        for k, layer in enumerate(layers):
            for name in layer._flat_weights_names:
                getattr(layer, name).copy_(getattr(rnn, name.replace("_l0", f"_l{k}")))
    for i in range(M):
        h = layers[0](x)[0] * masks[i].transpose(0, 1) / keep
        ref = mc.head(layers[1](h)[0][:, -1])
        torch.testing.assert_close(got[i], ref, rtol=1e-12, atol=1e-12)


def test_dropout_is_off_in_eval_without_mc_dropout():
    net = _net().eval()
    x = _x()
    with torch.no_grad():
        plain = net(x)
        assert torch.equal(plain, net(x))  # torch's nn.LSTM in eval: no dropout
    with pytest.raises(ValueError, match="draws no noise per sample"):
        mg.nn.forward_samples(net, x, 3, seed=0)  # every sample would be the same network
    bayes = mg.nn.freeze(mg.nn.bayesify(_net(), kl_samples=1)).eval()
    assert isinstance(bayes.rnn, mg.nn.BayesLSTM) and not bayes.rnn.mc_dropout
    out = mg.nn.forward_samples(bayes, x, 3, seed=0)
    torch.testing.assert_close(out[0], plain, rtol=1e-12, atol=1e-12)  # mean weights, no dropout
    assert torch.equal(out[0], out[2])
    # MC dropout of the Bayesian model: its own recurrent dropout stays on in eval (mean weights here)
    mc = mg.nn.mc_dropout(bayes)
    assert mc.rnn.mc_dropout and "mc_dropout=True" in repr(mc.rnn)
    out = mg.nn.forward_samples(mc, x, 3, seed=0)
    assert (out[0] - out[1]).abs().max() > 1e-6
    assert torch.equal(out, mg.nn.forward_samples(mc, x, 3, seed=0, chunk_size=1))


def test_models_without_recurrent_dropout_are_refused():
    for rnn in (nn.LSTM(3, 5, num_layers=2), nn.LSTM(3, 5, num_layers=1)):
        with pytest.raises(ValueError, match="no dropout module"):
            mg.nn.mc_dropout(Classifier(rnn))
    with pytest.raises(TypeError, match="module must be an nn.LSTM"):
        MCDropoutRNN(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="num_layers"):
        MCDropoutRNN(nn.LSTM(3, 5))
    with pytest.raises(ValueError, match="p must be"):
        MCDropoutRNN(nn.LSTM(3, 5, num_layers=2), p=1.5)
