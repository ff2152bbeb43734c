"""Per-example squared gradients (mcgraph.optim.per_example) against a batch-size-1 autograd loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mcgraph.optim.per_example import SquaredGradients, per_example_loop, unsupported_modules


def _ce(out, target):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1), reduction="sum")


def _assert_matches_loop(model, x, y, loss=_ce, rtol=1e-10):
    model = model.double()
    x = x.double()
    with SquaredGradients(model) as sq:
        loss(model(x), y).backward()
    reference = per_example_loop(model, loss, x, y)
    assert sq.batch_size == x.shape[0]
    assert set(sq.sums) == set(reference)
    for p, ref in reference.items():
        torch.testing.assert_close(sq.sums[p], ref, rtol=rtol, atol=1e-300)
        assert float(ref.abs().max()) > 0  # the check is not vacuous


def _conv(dims):
    return {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]


def _bn(dims):
    return {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims]


def test_linear_mlp_with_inplace_relu():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(inplace=True), nn.Linear(7, 3))
    _assert_matches_loop(net, torch.randn(9, 5), torch.randint(0, 3, (9,)))


def test_linear_on_sequences_sums_over_positions():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    _assert_matches_loop(net, torch.randn(5, 7, 4), torch.randint(0, 3, (5, 7)))


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("options", [
    {"stride": 2, "padding": 1},
    {"dilation": 2, "padding": "same"},
    {"groups": 2, "padding": 1, "padding_mode": "circular"},
    {"padding": 1, "padding_mode": "reflect", "bias": False},
], ids=["stride-pad", "dilation-same", "groups-circular", "reflect-nobias"])
def test_conv_nd(dims, options):
    torch.manual_seed(dims)
    conv = _conv(dims)
    size = {1: 9, 2: 7, 3: 5}[dims]
    net = nn.Sequential(conv(2, 4, 3, **options), nn.ReLU(), conv(4, 3, 2), nn.Flatten(), nn.LazyLinear(3))
    x = torch.randn(4, 2, *([size] * dims))
    net(x)  # materialise the lazy layer
    _assert_matches_loop(net, x, torch.randint(0, 3, (4,)))


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_batchnorm_eval_mode(dims):
    torch.manual_seed(10 + dims)
    conv, bn = _conv(dims), _bn(dims)
    net = nn.Sequential(conv(2, 3, 3, padding=1), bn(3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4))
    x = torch.randn(5, 2, *([5] * dims))
    net.train()
    net(x)
    with torch.no_grad():  # non-trivial running statistics and affine parameters
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.uniform_(-0.5, 0.5)
    net.eval()
    _assert_matches_loop(net, x, torch.randint(0, 4, (5,)))


def test_batchnorm1d_on_features():
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    x = torch.randn(7, 4)
    net(x)
    net.eval()
    _assert_matches_loop(net, x, torch.randint(0, 2, (7,)))


def test_batchnorm_train_mode_terms_sum_to_the_gradient():
    """With batch statistics the examples interact; the shares still sum to the batch gradient."""
    torch.manual_seed(4)
    net = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    net = net.double()
    x = torch.randn(6, 1, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 2, (6,))
    from mcgraph.optim.per_example import rule_for

    bn = net[1]
    record = {}

    def hook(module, inputs, output):
        record["a"] = rule_for(module).prepare(module, inputs[0])
        output.register_hook(lambda g: record.update(b=g))

    handle = bn.register_forward_hook(hook)
    _ce(net(x), y).backward()
    handle.remove()
    shares = rule_for(bn).per_example(bn, record["a"], record["b"])
    torch.testing.assert_close(shares["weight"].sum(0), bn.weight.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(shares["bias"].sum(0), bn.bias.grad, rtol=1e-10, atol=1e-12)


def test_shared_layer_sums_shares_before_squaring():
    torch.manual_seed(5)
    shared = nn.Linear(4, 4)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared, self.head = shared, nn.Linear(4, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))

    _assert_matches_loop(Twice(), torch.randn(6, 4), torch.randint(0, 3, (6,)))


def test_large_conv_is_chunked(monkeypatch):
    import mcgraph.optim.per_example as pe

    monkeypatch.setattr(pe, "CHUNK_ELEMENTS", 100)  # forces chunks of one example
    torch.manual_seed(6)
    net = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    _assert_matches_loop(net, torch.randn(5, 2, 6, 6), torch.randint(0, 2, (5,)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_kept(dtype):
    net = nn.Sequential(nn.Linear(3, 2)).to(dtype)
    with SquaredGradients(net) as sq:
        net(torch.randn(4, 3, dtype=dtype)).sum().backward()
    assert all(v.dtype == dtype for v in sq.sums.values())


def test_unsupported_layers_are_named():
    net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    assert unsupported_modules(net) == [("1", "LayerNorm")]
    with pytest.raises(TypeError, match=r"1 \(LayerNorm\)"):
        SquaredGradients(net)
    frozen = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    for p in frozen[1].parameters():
        p.requires_grad_(False)
    assert unsupported_modules(frozen) == []  # frozen parameters are not trained: fine


def test_different_batch_sizes_are_refused():
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    model = nn.ModuleList([a, b])
    with pytest.raises(ValueError, match="different batch sizes"):
        with SquaredGradients(model):
            (a(torch.randn(4, 3)).sum() + b(torch.randn(5, 3)).sum()).backward()


class _SequenceNet(nn.Module):
    """An LSTM read by a linear head: through its last output, its mean output, h_n or c_n; optionally started
    from a state computed from each example's first step (passed positionally or as ``hx=``)."""

    def __init__(self, lstm: nn.LSTM, read: str = "last", state: str | None = None):
        super().__init__()
        self.lstm, self.read, self.state = lstm, read, state
        dirs = 2 if lstm.bidirectional else 1
        width = lstm.hidden_size * (dirs if read in ("last", "mean") else 1)
        self.head = nn.Linear(width, 3)
        self.init = nn.Linear(lstm.input_size, 2 * lstm.num_layers * dirs * lstm.hidden_size) if state else None

    def forward(self, x):  # x: (n, T, F)
        seq = x if self.lstm.batch_first else x.transpose(0, 1)
        args, kwargs = (seq,), {}
        if self.state:
            n, dirs = x.shape[0], 2 if self.lstm.bidirectional else 1
            hc = torch.tanh(self.init(x[:, 0])).reshape(n, 2, self.lstm.num_layers * dirs, self.lstm.hidden_size)
            hx = (hc[:, 0].transpose(0, 1).contiguous(), hc[:, 1].transpose(0, 1).contiguous())
            if self.state == "kwarg":
                kwargs["hx"] = hx
            else:
                args += (hx,)
        out, (h, c) = self.lstm(*args, **kwargs)
        if not self.lstm.batch_first:
            out = out.transpose(0, 1)
        if self.read == "last":
            return self.head(out[:, -1])
        if self.read == "mean":
            return self.head(out.mean(1))
        return self.head((h if self.read == "h_n" else c)[-1])


@pytest.mark.parametrize("layers, bidirectional, batch_first, bias, read, state", [
    (1, False, True, True, "last", None),
    (2, False, True, True, "mean", None),
    (2, True, True, True, "mean", None),
    (1, True, False, True, "mean", "positional"),
    (1, False, False, True, "h_n", "positional"),
    (2, False, False, False, "c_n", "kwarg"),
    (2, True, False, True, "mean", "kwarg"),
])
def test_lstm_matches_the_batch_size_one_loop(layers, bidirectional, batch_first, bias, read, state):
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 5, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, bias=bias)
    x, y = torch.randn(6, 7, 4), torch.randint(0, 3, (6,))
    _assert_matches_loop(_SequenceNet(lstm, read, state), x, y)


def test_lstm_called_twice_sums_its_shares_before_squaring():
    torch.manual_seed(1)
    lstm = nn.LSTM(3, 4, batch_first=True)
    head = nn.Linear(4, 2)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm, self.head = lstm, head

        def forward(self, x):
            a, _ = self.lstm(x)
            b, _ = self.lstm(x.flip(1))
            return self.head(a[:, -1] + b[:, -1])

    _assert_matches_loop(Twice(), torch.randn(5, 6, 3), torch.randint(0, 2, (5,)))


def test_lstm_with_dropout_matches_the_loop_in_eval_mode_and_is_refused_in_training():
    torch.manual_seed(2)
    net = _SequenceNet(nn.LSTM(3, 4, num_layers=2, dropout=0.3, batch_first=True)).double()
    x, y = torch.randn(5, 6, 3, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises(ValueError, match="dropout"):
        with SquaredGradients(net):
            _ce(net(x), y).backward()
    net.eval()
    _assert_matches_loop(net, x, y)


def test_lstm_inputs_it_cannot_take_are_refused_by_name():
    lstm = nn.LSTM(3, 4, batch_first=True)
    with pytest.raises(ValueError, match="unbatched"):
        with SquaredGradients(lstm):
            lstm(torch.randn(6, 3))[0].sum().backward()
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(2, 5, 3), [5, 3], batch_first=True)
    with pytest.raises(TypeError, match="PackedSequence"):
        with SquaredGradients(lstm):
            lstm(packed)
    projected = nn.LSTM(3, 4, proj_size=2, batch_first=True)
    with pytest.raises(ValueError, match="proj_size"):
        with SquaredGradients(projected):
            projected(torch.randn(2, 5, 3))
