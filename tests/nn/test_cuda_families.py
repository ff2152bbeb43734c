"""Every public layer family and conversion on one device: forward, the ELBO against its direct reference,
predict and the KL.

The device is ``MCGRAPH_TEST_DEVICE`` (default ``cuda``; the module skips when that is CUDA and none is
present, so ``make test`` skips it on a CPU machine). ``MCGRAPH_TEST_DEVICE=cpu`` runs it on the CPU; ``make
gpu-check`` runs it on the GPU (its ``families`` section). Each model and batch is created on the device: the
torch and peer modules are built under ``with torch.device(...)`` (and moved there, for a peer constructor that
ignores the default device), the conversions (``bayesify``, ``to_mcgraph``, ``bayesian_lora``, ``mc_dropout``,
an optimizer's ``posterior_model``) and every checked call run outside it, so that a tensor the library creates
on the wrong device fails here instead of being put right by the context.

Families (``FAMILIES``): ``bayesify`` of ``nn.Linear``, ``Conv1d/2d/3d`` and ``ConvTranspose2d``; ``BayesLSTM``,
``BayesGRU`` and ``BayesRNN`` with 1 and 2 layers, bidirectional, on packed sequences and from a given h₀;
``BayesEmbedding``; ``BayesMultiheadAttention``; a bayesified ``nn.TransformerEncoder``;
``mg.nn.bayesian_lora`` on a GPT-2 built from a config (2 layers, width 32, vocabulary 100);
``mcgraph.interop.peft`` of a peft LoRA model; bayesian-torch, blitz and torchbnn models through their
``to_mcgraph``; Sparse VD; MC dropout (a 2-layer LSTM's dropout and an ``nn.Dropout``, a Bayesian head); the
posterior model after one IVON step and after one VOGN step.

Checks (``CHECKS``), each family × each:

* ``forward`` — the output and the gradients of the model's parameters live on the device and are finite;
  off the CPU, the posterior-mean forward equals the same model's on the CPU;
* ``elbo-M1`` / ``elbo-M16`` — ``mg.nn.elbo`` with M samples by its default estimator against
  ``num_samples=mg.Sampling(M, method="direct")`` (every sample in one graph) on the same device and seed:
  the same value and the same gradients (float32, TF32 off: value rtol 1e-5; each gradient within
  ``GRAD_RTOL`` = 1e-4 of its largest magnitude, elementwise, plus ``GRAD_FLOOR`` = 1e-6 of the largest
  gradient of the call, float32 rounding); ``elbo-M16-chunks``: the same with chunks of
  5 samples (4 chunks, the last of 1, each replayed on the backward pass);
* ``predict`` — ``mg.nn.predict`` (M = 8) is a distribution over the classes, on the device, equals the
  mean softmax of ``mg.nn.forward_samples`` with the same seed (rtol 1e-5), and chunks of 3 give the same;
* ``kl`` — ``mg.nn.kl`` by default is a finite 0-d tensor on the device with gradients there; the sampled KL
  (M = 16) by the engine's default tier equals ``method="direct"`` with the same seed (value and gradients).

``test_batched_optimizer_step_equals_sequential`` checks IVON's and VOGN's K-sample step on the device:
the vmapped K = 4 step against K sequential samples on the same noise.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import mcgraph as mg
from mcgraph.interop.convert import KLScaleWarning

DEVICE = torch.device(os.environ.get("MCGRAPH_TEST_DEVICE", "cuda"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("MCGRAPH_TEST_DEVICE is cuda (the default) and torch.cuda.is_available() is False: "
                "run MCGRAPH_TEST_DEVICE=cpu pytest tests/nn/test_cuda_families.py to check the families on the CPU",
                allow_module_level=True)

#: Value tolerance of the ELBO and the KL against their direct references (float32).
VALUE_RTOL, VALUE_ATOL = 1e-5, 1e-6
#: Gradient tolerance, elementwise per parameter: |g − g_ref| ≤ GRAD_RTOL · max|g_ref| + GRAD_FLOOR · (the largest
#: |g_ref| over all the parameters). The floor is float32 rounding where a gradient cancels to 0 in one estimator
#: and to a few ulps of its terms in the other (LoRA's default prior cancels the KL's gradient on μ exactly).
GRAD_RTOL, GRAD_FLOOR = 1e-4, 1e-6
#: Predictive probabilities against the mean softmax of forward_samples.
PROB_RTOL, PROB_ATOL = 1e-5, 1e-6
#: The posterior-mean forward on the device against the CPU (off the CPU only; TF32 off).
CPU_RTOL, CPU_ATOL = 1e-4, 1e-5
DATASET = 200  # N of the ELBO
SEED = 3


@pytest.fixture(autouse=True, scope="module")
def _exact_device_math():
    """float32 everywhere: TF32 off for matmuls and cuDNN (it would round the references apart); one CPU thread
    (small recurrent steps are much slower with two OpenMP threads on a loaded 2-core machine)."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_num_threads())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if DEVICE.type == "cpu":
        torch.set_num_threads(1)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_num_threads(saved[2])


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=_gen(seed), device=DEVICE)


def _labels(n, k, seed=1):
    return torch.randint(0, k, (n,), generator=_gen(seed), device=DEVICE)


@dataclasses.dataclass(frozen=True)
class Case:
    """A family's model on the device, its batch and how it is scored.

    ``model(x)`` returns ``(B, K)`` logits (categorical) or a causal LM's output (``token_categorical``, ``x`` a
    batch dict holding the labels, ``y`` None). ``mean_is_deterministic``: the posterior-mean forward draws no
    noise (MC dropout's does), so it can be compared with the CPU's.
    """

    model: nn.Module
    x: object
    y: torch.Tensor | None
    likelihood: str = "categorical"
    mean_is_deterministic: bool = True

    def logits(self, out):
        return out.logits if hasattr(out, "logits") else out

    def params(self):
        return [p for p in self.model.parameters() if p.requires_grad]


# --------------------------------------------------------------------------- builders (torch side on the device)


def _built(make: Callable[[], nn.Module]) -> nn.Module:
    """``make()`` under the device's default-device context, then moved there (a peer's legacy constructor,
    ``torch.Tensor(shape)``, ignores the context)."""
    with DEVICE:
        torch.manual_seed(0)
        module = make()
    return module.to(DEVICE)


def _mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _bayesified(make, x, **options) -> Case:
    return Case(mg.nn.bayesify(_built(make), rho_init=-2.0, **options), x, _labels(x.shape[0], 3))


LAYERS = {
    "linear": lambda: _bayesified(_mlp, _randn(5, 6)),
    "conv1d": lambda: _bayesified(lambda: nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Flatten(),
                                                        nn.Linear(4 * 6, 3)), _randn(5, 2, 8)),
    "conv2d": lambda: _bayesified(lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                                                        nn.Linear(4 * 5 * 5, 3)), _randn(5, 2, 5, 5)),
    "conv3d": lambda: _bayesified(lambda: nn.Sequential(nn.Conv3d(2, 3, 2), nn.ReLU(), nn.Flatten(),
                                                        nn.Linear(3 * 3 * 3 * 3, 3)), _randn(4, 2, 4, 4, 4)),
    "convtranspose2d": lambda: _bayesified(lambda: nn.Sequential(nn.ConvTranspose2d(2, 3, 2, stride=2), nn.ReLU(),
                                                                 nn.Flatten(), nn.Linear(3 * 6 * 6, 3)),
                                           _randn(5, 2, 3, 3)),
}


class _Recurrent(nn.Module):
    """A recurrent layer and a head on the last step. ``lengths``: the input is packed with them inside
    the forward (a chunk of S samples repeats the batch S times, so the lengths repeat too); ``h0``: a
    learnt initial state, repeated likewise."""

    def __init__(self, rnn, lengths=None, h0=False):
        super().__init__()
        self.rnn, self.lengths = rnn, lengths
        D = 2 if rnn.bidirectional else 1
        self.head = nn.Linear(D * rnn.hidden_size, 3)
        shape = (D * rnn.num_layers, 1, rnn.hidden_size)
        self.h0 = nn.Parameter(0.5 * torch.randn(shape)) if h0 else None
        self.c0 = nn.Parameter(0.5 * torch.randn(shape)) if h0 and isinstance(rnn, (nn.LSTM, mg.nn.BayesLSTM)) \
            else None

    def forward(self, x):
        n = x.shape[0]
        hx = None
        if self.h0 is not None:
            hx = self.h0.expand(-1, n, -1).contiguous()
            if self.c0 is not None:
                hx = (hx, self.c0.expand(-1, n, -1).contiguous())
        if self.lengths is None:
            return self.head(self.rnn(x, hx)[0][:, -1])
        lengths = self.lengths * (n // len(self.lengths))
        out, _ = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False), hx)
        out, _ = pad_packed_sequence(out, batch_first=True)
        last = torch.as_tensor([t - 1 for t in lengths], device=out.device)
        return self.head(out[torch.arange(n, device=out.device), last])


RNN_KINDS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}
RNN_FORMS = {  # form: (num_layers, bidirectional, packed, h0)
    "1layer": (1, False, False, False),
    "2layer": (2, False, False, False),
    "bidirectional": (2, True, False, False),
    "packed": (2, False, True, False),
    "h0": (2, False, False, True),
}
LENGTHS = [5, 2, 4, 3]


def _recurrent(kind: str, form: str) -> Case:
    layers, bi, packed, h0 = RNN_FORMS[form]
    net = _built(lambda: _Recurrent(RNN_KINDS[kind](4, 6, num_layers=layers, bidirectional=bi, batch_first=True),
                                    LENGTHS if packed else None, h0))
    bnn = mg.nn.bayesify(net, rho_init=-2.0)
    assert type(bnn.rnn).__name__ == {"lstm": "BayesLSTM", "gru": "BayesGRU", "rnn": "BayesRNN"}[kind]
    return Case(bnn, _randn(4, 5, 4), _labels(4, 3))


RECURRENT = {f"{kind}-{form}": functools.partial(_recurrent, kind, form) for kind in RNN_KINDS for form in RNN_FORMS}


class _Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = mg.nn.BayesEmbedding(20, 8, padding_idx=0, rho_init=-2.0)
        self.head = mg.nn.BayesLinear(8, 3, rho_init=-2.0)

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(1))


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = mg.nn.BayesMultiheadAttention(8, 2, batch_first=True, rho_init=-2.0)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        n = x.shape[0]
        mask = torch.zeros(n, x.shape[1], dtype=torch.bool, device=x.device)
        mask[::2, -1] = True  # key padding on every other sequence
        return self.head(self.attn(x, x, x, key_padding_mask=mask)[0].mean(1))


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


def _tokens() -> Case:
    net = _built(_Tokens)
    ids = torch.randint(0, 20, (5, 6), generator=_gen(2), device=DEVICE)
    ids[0, -2:] = 0  # the padding row
    return Case(net, ids, _labels(5, 3))


def _encoder() -> Case:
    bnn = mg.nn.bayesify(_built(_Encoder), rho_init=-2.0)
    assert any(isinstance(m, mg.nn.BayesMultiheadAttention) for m in bnn.modules())
    return Case(bnn, _randn(4, 5, 8), _labels(4, 3))


SEQUENCE = {
    "embedding": _tokens,
    "multihead-attention": lambda: Case(_built(_Attention), _randn(4, 5, 8), _labels(4, 3)),
    "transformer-encoder": _encoder,
}


# --------------------------------------------------------------------------- language models and peers

VOCAB = 100


def _gpt2():
    tr = pytest.importorskip("transformers", reason="transformers is not installed (make interop installs it)")
    config = tr.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0,
                           eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return tr.GPT2LMHeadModel(config).eval()


def _lm_batch():
    ids = torch.randint(1, VOCAB, (3, 8), generator=_gen(4), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0  # a right-padded row
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _move_b(model, scale=0.3):
    """B = 0 at initialisation makes A's gradient 0: give every adapter a B so that the gradients are checked."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, mg.nn.BayesLoRA):
                b = m.lora_B.weight
                b.copy_(scale * torch.randn(b.shape, generator=_gen(5), device=b.device, dtype=b.dtype))


def _gpt2_lora() -> Case:
    gpt = _built(_gpt2)
    lora = mg.nn.bayesian_lora(gpt, rank=2, alpha=4.0, rho_init=-2.0, kl_samples=4)
    _move_b(lora)
    return Case(lora, _lm_batch(), None, likelihood="token_categorical")


def _peft() -> Case:
    tr = pytest.importorskip("transformers", reason="transformers is not installed (make interop installs it)")
    peft = pytest.importorskip("peft", reason="peft is not installed (make interop installs it)")
    del tr
    from mcgraph.interop import peft as ipeft

    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
                             init_lora_weights=False)  # random B: the adapters change the output
    pm = _built(lambda: peft.get_peft_model(_gpt2(), config))
    return Case(ipeft.to_mcgraph(pm, kl_samples=4, rho_init=-2.0), _lm_batch(), None, likelihood="token_categorical")


BT_PRIOR = {"prior_mu": 0.0, "prior_sigma": 1.0, "posterior_mu_init": 0.0, "posterior_rho_init": -3.0,
            "type": "Reparameterization", "moped_enable": False}


def _bayesian_torch() -> Case:
    pytest.importorskip("bayesian_torch", reason="bayesian-torch is not installed (make interop installs it)")
    from bayesian_torch.models.dnn_to_bnn import dnn_to_bnn

    from mcgraph.interop import bayesian_torch as ibt

    def make():
        net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.ConvTranspose2d(3, 2, 2, stride=2),
                            nn.Flatten(), nn.Linear(2 * 8 * 8, 6), nn.ReLU(), nn.Linear(6, 3))
        dnn_to_bnn(net, BT_PRIOR)
        return net

    return Case(ibt.to_mcgraph(_built(make), kl_samples=4), _randn(4, 2, 4, 4), _labels(4, 3))


def _blitz() -> Case:
    pytest.importorskip("blitz", reason="blitz-bayesian-pytorch is not installed (make interop installs it)")
    from blitz.modules import BayesianConv2d, BayesianLinear

    from mcgraph.interop import blitz as ibz

    mixture = dict(prior_pi=0.5, prior_sigma_1=0.1, prior_sigma_2=0.002, posterior_rho_init=-3.0)

    def make():
        return nn.Sequential(BayesianConv2d(2, 3, (3, 3), **mixture), nn.ReLU(), nn.Flatten(),
                             BayesianLinear(12, 3, **mixture))

    return Case(ibz.to_mcgraph(_built(make), prior_floor=1e-6, kl_samples=4), _randn(4, 2, 4, 4), _labels(4, 3))


def _torchbnn() -> Case:
    torchbnn = pytest.importorskip("torchbnn", reason="torchbnn is not installed (make interop installs it)")
    from mcgraph.interop import torchbnn as itb

    def make():
        return nn.Sequential(torchbnn.BayesConv2d(0.0, 0.1, 2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(),
                             torchbnn.BayesLinear(0.0, 0.1, 3 * 16, 4), nn.ReLU(), torchbnn.BayesLinear(0.2, 0.5, 4, 3))

    return Case(itb.to_mcgraph(_built(make), kl_samples=4), _randn(4, 2, 4, 4), _labels(4, 3))


PEERS = {"gpt2-bayesian-lora": _gpt2_lora, "peft": _peft, "bayesian-torch": _bayesian_torch, "blitz": _blitz,
         "torchbnn": _torchbnn}


# --------------------------------------------------------------------------- sparsification, MC dropout, optimizers


class _DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(4, 6, num_layers=2, dropout=0.3, batch_first=True)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.drop(self.rnn(x)[0][:, -1]))


def _mc_dropout() -> Case:
    bnn = mg.nn.bayesify(_built(_DropoutNet), only="head", rho_init=-2.0)  # a Bayesian head: the ELBO has a KL
    mc = mg.nn.mc_dropout(bnn)
    assert isinstance(mc.rnn, mg.nn.MCDropoutRNN) and isinstance(mc.drop, mg.nn.MCDropout)
    return Case(mc, _randn(4, 5, 4), _labels(4, 3), mean_is_deterministic=False)


def _optimizer_posterior(name: str) -> Case:
    net = _built(_mlp)
    x, y = _randn(8, 6), _labels(8, 3)
    if name == "ivon":
        opt = mg.optim.IVON(net, lr=0.05, ess=DATASET, mc_samples=2, seed=0)
    else:
        opt = mg.optim.VOGN(net, DATASET, lr=0.05, num_samples=2, seed=0)
    loss = opt.step_samples(lambda: F.cross_entropy(net(x), y))
    assert loss.device == DEVICE and torch.isfinite(loss)
    _assert_state_on_device(opt)
    return Case(opt.posterior_model(), x, y)


SPARSE = {
    "sparse-vd": lambda: _bayesified(_mlp, _randn(5, 6), posterior="sparse_vd"),
    "mc-dropout": _mc_dropout,
    "ivon-posterior": functools.partial(_optimizer_posterior, "ivon"),
    "vogn-posterior": functools.partial(_optimizer_posterior, "vogn"),
}

FAMILIES = {**LAYERS, **RECURRENT, **SEQUENCE, **PEERS, **SPARSE}
CHECKS = ("forward", "elbo-M1", "elbo-M16", "elbo-M16-chunks", "predict", "kl")


@functools.cache
def _case(name: str) -> Case:
    """Each family's case, built once per session (the checks never write into a model: gradients are taken
    with ``torch.autograd.grad``)."""
    torch.manual_seed(0)  # the conversions' initial values do not depend on which tests ran before
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KLScaleWarning)  # the converters say the peers scale their KL otherwise
        case = FAMILIES[name]()
    _assert_on_device(case.model, name)
    return case


def _assert_on_device(model: nn.Module, what: str) -> None:
    wrong = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device != DEVICE]
    assert not wrong, f"{what}: not on {DEVICE}: {wrong[:5]}"


def _assert_state_on_device(opt) -> None:
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value.device == DEVICE, f"optimizer state {key!r} on {value.device}"


def _assert_grads(grads, params, what: str) -> None:
    assert any(g is not None and bool(g.abs().sum() > 0) for g in grads), f"{what}: every gradient is zero"
    for g, p in zip(grads, params, strict=True):
        if g is not None:
            assert g.device == DEVICE and g.shape == p.shape, (what, g.device, g.shape)
            assert bool(torch.isfinite(g).all()), f"{what}: a non-finite gradient"


def _assert_same_grads(got, ref, what: str) -> None:
    scale = max((float(r.abs().max()) for r in ref if r is not None), default=0.0)
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        if r is None:
            assert g is None or not bool(g.abs().sum()), f"{what}: gradient {i} only on one side"
            continue
        tol = GRAD_RTOL * float(r.abs().max()) + GRAD_FLOOR * scale + 1e-12
        err = float((g - r).abs().max())
        assert err <= tol, f"{what}: gradient {i} {tuple(r.shape)} differs by {err:.3g} > {tol:.3g}"


def _grad(value, params):
    return torch.autograd.grad(value, params, allow_unused=True)


# --------------------------------------------------------------------------- the matrix


def _forward(case: Case, name: str) -> torch.Tensor:
    model, params = case.model, case.params()
    x = case.x if case.likelihood == "categorical" else {k: v for k, v in case.x.items() if k != "labels"}
    out = case.logits(model(**x) if isinstance(x, dict) else model(x))
    _assert_grads(_grad(out.square().mean(), params), params, f"{name} forward")
    if DEVICE.type == "cpu" or not case.mean_is_deterministic:
        return out
    with mg.nn.frozen(model):  # the posterior means: the device's forward is the CPU's
        here = case.logits(model(**x) if isinstance(x, dict) else model(x))
        cpu_model = copy.deepcopy(model).cpu()
        x_cpu = {k: v.cpu() for k, v in x.items()} if isinstance(x, dict) else x.cpu()
        with mg.nn.frozen(cpu_model):
            there = case.logits(cpu_model(**x_cpu) if isinstance(x_cpu, dict) else cpu_model(x_cpu))
    torch.testing.assert_close(here.cpu(), there, rtol=CPU_RTOL, atol=CPU_ATOL)
    return out


def _elbo(case: Case, name: str, M: int, chunk_size: int | None = None) -> torch.Tensor:
    params = case.params()

    def value(num_samples):
        return mg.nn.elbo(case.model, case.x, case.y, num_samples=num_samples, dataset_size=DATASET, seed=SEED,
                          likelihood=case.likelihood)

    got = value(M if chunk_size is None else mg.Sampling(M, chunk_size=chunk_size))
    ref = value(mg.Sampling(M, method="direct"))
    assert ref.device == DEVICE and got.shape == ()
    torch.testing.assert_close(got, ref, rtol=VALUE_RTOL, atol=VALUE_ATOL)
    g_got, g_ref = _grad(got, params), _grad(ref, params)
    _assert_grads(g_got, params, f"{name} elbo M={M}")
    _assert_same_grads(g_got, g_ref, f"{name} elbo M={M} against direct")
    return got


def _predict(case: Case, name: str, M: int = 8) -> torch.Tensor:
    probs = mg.nn.predict(case.model, case.x, M, seed=SEED, likelihood=case.likelihood)
    samples = mg.nn.forward_samples(case.model, case.x, M, seed=SEED)
    if case.likelihood == "token_categorical":  # the next token: each row's last attended position
        samples = case.logits(samples)
        last = case.x["attention_mask"].sum(1) - 1
        samples = samples[:, torch.arange(samples.shape[1], device=DEVICE), last]
    ref = torch.softmax(samples, -1).mean(0)
    assert probs.shape == ref.shape
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[0], device=DEVICE), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs, ref, rtol=PROB_RTOL, atol=PROB_ATOL)
    chunked = mg.nn.predict(case.model, case.x, M, chunk_size=3, seed=SEED, likelihood=case.likelihood)
    torch.testing.assert_close(chunked, probs, rtol=PROB_RTOL, atol=PROB_ATOL)  # any chunking: the same samples
    return probs


def _kl(case: Case, name: str, M: int = 16) -> torch.Tensor:
    params = case.params()
    default = mg.nn.kl(case.model, seed=SEED)
    assert default.device == DEVICE and default.shape == () and bool(torch.isfinite(default))
    _assert_grads(_grad(default, params), params, f"{name} kl")
    got = mg.nn.kl(case.model, M, seed=SEED, method="monte-carlo")
    ref = mg.nn.kl(case.model, M, seed=SEED, method="direct")
    torch.testing.assert_close(got, ref, rtol=VALUE_RTOL, atol=VALUE_ATOL)
    _assert_same_grads(_grad(got, params), _grad(ref, params), f"{name} sampled kl against direct")
    return got


RUN = {"forward": _forward, "elbo-M1": functools.partial(_elbo, M=1), "elbo-M16": functools.partial(_elbo, M=16),
       "elbo-M16-chunks": functools.partial(_elbo, M=16, chunk_size=5), "predict": _predict, "kl": _kl}


@pytest.mark.parametrize("family,check", [(f, c) for f in FAMILIES for c in CHECKS],
                         ids=[f"{f}/{c}" for f in FAMILIES for c in CHECKS])  # ids family/check: the report's matrix
def test_family_on_device(family, check):
    result = RUN[check](_case(family), family)  # each check compares against its reference and returns its result
    assert result.device == DEVICE, f"{family}/{check}: result on {result.device}, not {DEVICE}"
    assert bool(torch.isfinite(result).all()), f"{family}/{check}: non-finite result"


# --------------------------------------------------------------------------- optimizer steps


@pytest.mark.parametrize("name", ["ivon", "vogn"])
def test_batched_optimizer_step_equals_sequential(name):
    """K = 4 weight samples in one vmapped pass against K one after the other, on the same noise (the optimizers'
    seeded streams): the same mean loss and the same updated means, state on the device."""
    nets = [_built(_mlp) for _ in range(2)]
    x, y = _randn(16, 6), _labels(16, 3)
    if name == "ivon":
        opts = [mg.optim.IVON(n, lr=0.05, ess=DATASET, beta2=0.9, mc_samples=4, seed=1) for n in nets]
    else:
        opts = [mg.optim.VOGN(n, DATASET, lr=0.05, num_samples=4, seed=1) for n in nets]
    for _ in range(2):
        losses = [opt.step_samples(lambda net=net: F.cross_entropy(net(x), y), vectorize=v)
                  for opt, net, v in zip(opts, nets, (True, False))]
        assert all(loss.device == DEVICE for loss in losses)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for opt in opts:
        _assert_state_on_device(opt)
    for a, b in zip(*(n.parameters() for n in nets), strict=True):
        assert a.device == DEVICE
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
