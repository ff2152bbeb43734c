"""What a CUDA run needs that a CPU run can observe.

* The states handed to torch's fused recurrent kernels are contiguous (cuDNN refuses others: a
  per-sample batch slice of a multi-layer ``h₀`` is not contiguous).
* Every tensor the library creates follows its inputs' device: a tensor made without ``device=`` (on
  a GPU run, a CPU tensor) never meets the inputs' tensors in an operation (:class:`_Untethered`).
* Every tensor the library creates follows its inputs' dtype: with float64 as torch's default dtype,
  a float32 model's every floating intermediate stays float32.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import mcgraph as mg
from mcgraph.nn import recurrent


@pytest.fixture
def contiguous_states(monkeypatch):
    """Wrap torch's fused kernels so that every call records whether its states were contiguous."""
    seen = []
    for mode, (gates, kernel) in list(recurrent.RECURRENT_KERNELS.items()):
        def checked(x, *args, _kernel=kernel, **kwargs):
            hx = args[1] if isinstance(args[0], torch.Tensor) and args[0].dtype in (torch.int64,) else args[0]
            states = hx if isinstance(hx, (tuple, list)) else (hx,)
            seen.append(all(t.is_contiguous() for t in states))
            return _kernel(x, *args, **kwargs)

        monkeypatch.setitem(recurrent.RECURRENT_KERNELS, mode, (gates, checked))
    return seen


class _Classifier(nn.Module):
    def __init__(self, rnn: nn.Module, hidden: int):
        super().__init__()
        self.rnn, self.head = rnn, nn.Linear(hidden, 3)

    def forward(self, x, h0=None):
        out, _ = self.rnn(x, h0)
        return self.head(out[:, -1])


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("layers,bidirectional", [(1, False), (2, False), (2, True)])
def test_recurrent_states_reach_the_kernel_contiguous(kind, layers, bidirectional, contiguous_states):
    torch.manual_seed(0)
    rnn = getattr(nn, kind)(5, 6, num_layers=layers, batch_first=True, bidirectional=bidirectional)
    net = mg.nn.bayesify(_Classifier(rnn, 6 * (2 if bidirectional else 1)))
    x, y = torch.randn(4, 7, 5), torch.tensor([0, 1, 2, 0])
    loss = -mg.nn.elbo(net, x, y, num_samples=mg.Sampling(6, chunk_size=3), dataset_size=100, seed=0)
    loss.backward()
    mg.nn.predict(net, x, 4, seed=0)
    assert contiguous_states and all(contiguous_states), contiguous_states


def test_a_given_initial_state_reaches_the_kernel_contiguous(contiguous_states):
    torch.manual_seed(0)
    layer = mg.nn.BayesLSTM(5, 6, num_layers=2, batch_first=True)
    h0 = torch.randn(4, 2, 6).transpose(0, 1)  # (layers, N, H), not contiguous
    c0 = torch.randn(2, 4, 6)
    x = torch.randn(4, 7, 5)
    out = mg.nn.forward_samples(lambda_model(layer, (h0, c0)), x, 3, seed=0)
    assert out.shape == (3, 4, 7, 6)
    assert contiguous_states and all(contiguous_states)


def lambda_model(layer, hx):
    class WithState(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            reps = x.shape[0] // hx[0].shape[1]
            return self.layer(x, tuple(h.repeat(1, reps, 1) for h in hx))[0]

    return WithState()


def _families():
    """One small network per layer family, with its input and labels."""
    torch.manual_seed(0)
    x_img, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 0])
    conv = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 6 * 6, 3))
    lstm = _Classifier(nn.LSTM(5, 6, num_layers=2, batch_first=True), 6)
    attn = nn.Sequential(nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True,
                                                                          dropout=0.0), 1),
                         nn.Flatten(), nn.Linear(8 * 7, 3))
    emb = nn.Sequential(nn.Embedding(11, 4), nn.Flatten(), nn.Linear(4 * 7, 3))
    return {
        "linear-radial": (mg.nn.bayesify(nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)),
                                         posterior="radial"), torch.randn(4, 5), y),
        "conv": (mg.nn.bayesify(conv), x_img, y),
        "lstm": (mg.nn.bayesify(lstm), torch.randn(4, 7, 5), y),
        "attention": (mg.nn.bayesify(attn), torch.randn(4, 7, 8), y),
        "embedding": (mg.nn.bayesify(emb), torch.randint(0, 11, (4, 7)), y),
        "mc-dropout": (mg.nn.mc_dropout(nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Dropout(0.2), nn.Linear(7, 3))),
                       torch.randn(4, 5), y),
    }


FAMILIES = list(_families())


def _run(net, x, y):
    """The data term's gradient (the ELBO's where the network has a KL), a prediction, the KL."""
    if mg.nn.bayesian_modules(net):
        loss = -mg.nn.elbo(net, x, y, num_samples=mg.Sampling(5, chunk_size=2), dataset_size=100, seed=0)
        kl = mg.nn.kl(net, 8, seed=0)
    else:  # MC dropout: no posterior, no KL
        loss = -mg.nn.expected_data_term(net, x, y, num_samples=mg.Sampling(5, chunk_size=2), seed=0)
        kl = loss.new_zeros(())
    loss.backward()
    probs = mg.nn.predict(net, x, 4, seed=0)
    return loss, probs, kl


class _Untethered(TorchFunctionMode):
    """Follows tensors made by a factory call without ``device=`` (``torch.zeros(3)``, ``torch.tensor(x)``)
    and those computed from them alone: on CUDA they would live on the CPU. An operation that mixes
    one of them (not a 0-d tensor, which torch moves by itself) with a tensor of the inputs' device is
    recorded: on a GPU it raises, or copies through the host. ``.to(device)`` tethers a tensor."""

    def __init__(self):
        super().__init__()
        self.untethered: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive: ids stay unique)
        self.mixed: list[str] = []

    def _mark(self, out):
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.untethered[id(t)] = t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _device_constructors():
            if kwargs.get("device") is None:
                self._mark(out)
            return out
        name = getattr(func, "__name__", "")
        if name in ("to", "cuda", "cpu") and (name != "to" or any(
                isinstance(a, (torch.device, str)) or (isinstance(a, torch.Tensor) and id(a) not in self.untethered)
                for a in list(args[1:]) + [kwargs.get("device"), kwargs.get("other")] if a is not None)):
            self.untethered.pop(id(out), None)  # moved to a device (on the CPU .to(cpu) returns the same tensor)
            return out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        loose = [t for t in tensors if id(t) in self.untethered]
        if loose:
            tethered = [t for t in tensors if id(t) not in self.untethered and t.dim() > 0]
            if tethered and any(t.dim() > 0 for t in loose):
                self.mixed.append(f"{name or func}: {[tuple(t.shape) for t in loose]} with "
                                  f"{[tuple(t.shape) for t in tethered]}")
            elif not tethered:
                self._mark(out)
        return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_follows_the_inputs_device(family):
    net, x, y = _families()[family]
    with _Untethered() as mode:
        loss, probs, kl = _run(net, x, y)
    assert not mode.mixed, mode.mixed[:10]


class _Promotions(TorchDispatchMode):
    """Operations where a float32 tensor of the network meets a wider tensor and comes out float64: a
    tensor made without ``dtype=`` (torch's default dtype) promoting the network's arithmetic. Explicit
    casts (the engine's float64 accumulators, its exact moments computed in float64) are not promotions."""

    CASTS = {"aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout", "aten.copy_.default",
             "aten.copy.default", "aten.lift_fresh.default", "aten._local_scalar_dense.default"}

    def __init__(self):
        super().__init__()
        self.promoted = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in self.CASTS:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        narrow = any(t.dtype == torch.float32 and t.dim() > 0 for t in inputs)
        wide = any(t.dtype == torch.float64 for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        if narrow and wide:
            self.promoted.add(str(func))
        return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_follows_the_inputs_dtype(family):
    """float64 as torch's default dtype, a float32 network: no operation promotes the network's float32
    tensors to float64 (a tensor made without ``dtype=`` would), and every result is float32."""
    net, x, y = _families()[family]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _Promotions() as mode:
            loss, probs, kl = _run(net, x, y)
    finally:
        torch.set_default_dtype(previous)
    assert loss.dtype == probs.dtype == kl.dtype == torch.float32
    assert all(p.grad is None or p.grad.dtype == p.dtype for p in net.parameters())
    assert not mode.promoted, sorted(mode.promoted)
