"""Property-based tests of the layer API on random small architectures.

Hypothesis draws a network of Linear / Conv / ConvTranspose layers of 1–3 spatial dims with
BatchNorm, pooling and activations in between, a posterior, a prior and layer options, and
checks through :func:`mcgraph.nn.bayesify`:

* the ELBO's chunked estimate equals the direct one on the same seed (value and every
  parameter's gradient, ``same_noise_tolerances``), whatever the chunk size;
* :func:`mcgraph.nn.predict` gives ``(B, K)`` finite probabilities whose rows sum to 1, the
  same for any chunk size;
* an option that does not fit the posterior is refused by ``bayesify`` with a ValueError
  naming it, never a torch internal error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import event, given, strategies as st
from torch import nn

import mcgraph as mg

from support.hypothesis_profiles import examples
from support.same_noise_tolerances import TOLERANCES, assert_same


@dataclass(frozen=True)
class Arch:
    """A small network: ``dims`` spatial dims (0: an MLP), input ``(batch, channels, *[size] * dims)``."""

    dims: int
    batch: int
    channels: int
    size: int
    blocks: tuple  # ((kind, arg), ...)
    classes: int

    def input_shape(self):
        return (self.batch, self.channels) + (self.size,) * self.dims

    def build(self) -> nn.Module:
        layers, c, s = [], self.channels, self.size
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}.get(self.dims)
        convt = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}.get(self.dims)
        bn = {0: nn.BatchNorm1d, 1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[self.dims]
        pool = {"max": {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d},
                "avg": {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d}}
        for kind, arg in self.blocks:
            if kind == "linear":
                layers.append(nn.Linear(c, arg))
                c = arg
            elif kind == "conv":
                out, k, pad, stride = arg
                layers.append(conv(c, out, k, stride=stride, padding=pad))
                c, s = out, (s + 2 * pad - k) // stride + 1
            elif kind == "convt":
                out, k, stride = arg
                layers.append(convt(c, out, k, stride=stride))
                c, s = out, (s - 1) * stride + k
            elif kind == "bn":
                layers.append(bn(c))
            elif kind == "pool":
                layers.append(pool[arg][self.dims](2))
                s = s // 2
            elif kind == "act":
                layers.append({"relu": nn.ReLU(), "tanh": nn.Tanh()}[arg])
        layers += [nn.Flatten(), nn.Linear(c * s ** self.dims, self.classes)]
        return nn.Sequential(*layers)


@st.composite
def architectures(draw):
    dims = draw(st.integers(0, 3))
    size = draw(st.integers(2, 4 if dims == 3 else 6))
    channels = draw(st.integers(1, 3))
    blocks, c, s = [], channels, size
    for _ in range(draw(st.integers(1, 3))):
        kinds = ["bn", "act"] + (["linear"] if dims == 0 else ["conv", "convt"] + (["pool"] if s >= 2 else []))
        kind = draw(st.sampled_from(kinds))
        if kind == "linear":
            c = draw(st.integers(1, 5))
            blocks.append((kind, c))
        elif kind == "conv":
            k = draw(st.integers(1, min(3, s + 2)))
            pad = draw(st.integers(0, 1))
            stride = draw(st.integers(1, 2))
            if s + 2 * pad < k:
                continue
            c = draw(st.integers(1, 3))
            blocks.append((kind, (c, k, pad, stride)))
            s = (s + 2 * pad - k) // stride + 1
        elif kind == "convt":
            k, stride = draw(st.integers(1, 3)), draw(st.integers(1, 2))
            if (s - 1) * stride + k > 8:
                continue
            c = draw(st.integers(1, 3))
            blocks.append((kind, (c, k, stride)))
            s = (s - 1) * stride + k
        elif kind == "pool":
            blocks.append((kind, draw(st.sampled_from(["max", "avg"]))))
            s //= 2
        else:
            blocks.append((kind, draw(st.sampled_from(["relu", "tanh"])) if kind == "act" else None))
    return Arch(dims, draw(st.integers(2, 3)), channels, size, tuple(blocks), draw(st.integers(2, 3)))


@dataclass(frozen=True)
class NetCase:
    arch: Arch
    posterior: str
    prior: str
    option: str  # "weights", "flipout" or "local_reparameterization"
    bayesian_bias: bool
    training: bool
    dtype: torch.dtype
    init_seed: int
    num_samples: int
    chunk: int
    seed: int

    def network(self):
        torch.manual_seed(self.init_seed)
        opts = {} if self.option == "weights" else {"estimator": self.option}
        net = mg.nn.bayesify(self.arch.build().to(self.dtype), posterior=self.posterior, prior=self.prior,
                             kl_samples=3, rho_init=-2.0, bayesian_bias=self.bayesian_bias, **opts)
        net.train(self.training)
        g = torch.Generator().manual_seed(self.init_seed)
        x = torch.randn(self.arch.input_shape(), generator=g, dtype=torch.float64).to(self.dtype)
        y = torch.randint(0, self.arch.classes, (self.arch.batch,), generator=g)
        return net, x, y


@st.composite
def net_cases(draw):
    M = draw(st.integers(1, 4))
    return NetCase(draw(architectures()), draw(st.sampled_from(sorted(mg.nn.POSTERIORS))),
                   draw(st.sampled_from(sorted(mg.nn.PRIORS))),
                   draw(st.sampled_from(["weights"] * 3 + ["flipout", "local_reparameterization"])),
                   draw(st.booleans()), draw(st.booleans()), draw(st.sampled_from([torch.float32, torch.float64])),
                   draw(st.integers(0, 2**16)), M, draw(st.integers(1, M)), draw(st.integers(0, 2**31)))


def _elbo(case: NetCase, method: str, chunk: int):
    net, x, y = case.network()
    value = mg.nn.elbo(net, x, y, num_samples=mg.Sampling(case.num_samples, method=method, chunk_size=chunk), dataset_size=100, seed=case.seed)
    params = [p for p in net.parameters() if p.requires_grad]
    return value.detach(), torch.autograd.grad(value, params, allow_unused=True)


@given(case=net_cases())
@examples(30)
def test_elbo_chunked_equals_direct_and_predict_is_a_distribution(case):
    try:
        net, x, _ = case.network()
    except ValueError as e:  # an option the posterior cannot take: refused by name
        if str(e).startswith("prior: ") and (case.posterior == "sparse_vd" or case.prior == "ard"):
            event("refused: prior")  # sparse VD and ARD pair only with each other's kind (named in the message)
            return
        event(f"refused: {case.option}")
        assert case.option != "weights" and case.option in str(e), f"unexpected refusal: {e}"
        return
    event(f"{case.arch.dims} spatial dims, {'training' if case.training else 'eval'}, {case.option}")
    rtol, atol = TOLERANCES[case.dtype]
    ref = _elbo(case, "direct", case.num_samples)
    assert ref[0].dtype == case.dtype and ref[0].shape == ()
    for chunk in sorted({1, case.chunk}):
        assert_same(ref, _elbo(case, "accumulated", chunk), rtol, atol, f"elbo chunk={chunk}", none_is_zero=True)
    probs = mg.nn.predict(net, x, case.num_samples, seed=case.seed)
    assert probs.shape == (case.arch.batch, case.arch.classes) and probs.dtype == case.dtype
    assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all())
    torch.testing.assert_close(probs.sum(-1), torch.ones(case.arch.batch, dtype=case.dtype),
                               rtol=0, atol=10 * torch.finfo(case.dtype).eps * case.arch.classes)
    again = mg.nn.predict(net, x, case.num_samples, chunk_size=case.chunk, seed=case.seed)
    torch.testing.assert_close(again, probs, rtol=rtol, atol=atol)
