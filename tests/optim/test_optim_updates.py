"""The optimizers' updates stated once (:mod:`mcgraph.optim.updates`) and their accelerators checked against
that statement bit for bit: IVON's foreach step and record, and the compiled CPU passes of IVON and VOGN."""

from __future__ import annotations

import math

import pytest
import torch

import mcgraph as mg
from mcgraph.optim import cpu_kernels, updates

F32, F64 = torch.float32, torch.float64


def _states(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)

    def r(scale=1.0, positive=False):
        t = torch.randn(shape, generator=g, dtype=F64) * scale
        return (t.abs() + 0.1 if positive else t).to(dtype)

    return {"mean": r(), "momentum": r(0.1), "hess": r(positive=True), "grad_avg": r(), "hess_avg": r(0.5)}


def _ivon_after_one_step(states, fused, *, price, clip, debias, dtype, ess=50.0, wd=1e-3, lr=0.05):
    """IVON's step from given states (m, g, h, ĝ, ĥ), through the optimizer's own path."""
    p = torch.nn.Parameter(states["mean"].clone())
    opt = mg.optim.IVON([p], lr=lr, ess=ess, weight_decay=wd, clip_radius=clip, debias=debias,
                        hess_approx="price" if price else "gradsq", fused=fused)
    st = opt.state[p]
    st["momentum"].copy_(states["momentum"])
    st["hess"].copy_(states["hess"])
    opt._avg_grad, opt._avg_hess, opt._count = [states["grad_avg"].clone()], [states["hess_avg"].clone()], 1
    opt.step()
    return p.detach().clone(), st["momentum"].clone(), st["hess"].clone()


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("price", [True, False])
@pytest.mark.parametrize("clip", [1e-3, math.inf])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "compiled"])
def test_ivon_step_paths_equal_the_stated_update_bitwise(dtype, price, clip, fused):
    if fused and cpu_kernels.library() is None:
        pytest.skip(f"no compiled library here: {cpu_kernels.unavailable_reason()}")
    states = _states((cpu_kernels.SAMPLE_MIN_ELEMENTS + 13,), dtype, seed=1)  # rescale_lr: α (h₀ + δ), h₀ = 1
    got = _ivon_after_one_step(states, fused, price=price, clip=clip, debias=True, dtype=dtype)
    hess_wd, _ = updates.ivon_inverse_scale(states["hess"], 50.0, 1e-3)
    want = updates.ivon_step(states["mean"], states["momentum"], states["hess"], states["grad_avg"],
                             states["hess_avg"], hess_wd, beta1=0.9, beta2=0.99999, ess=50.0, weight_decay=1e-3,
                             debias=1.0 - 0.9, lr=0.05 * (1.0 + 1e-3), clip_radius=clip, price=price)
    for a, b, what in zip(got, want[:3], ("m", "g", "h")):
        assert torch.equal(a, b), what


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("price", [True, False])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "compiled"])
def test_ivon_record_equals_the_stated_running_means_bitwise(dtype, price, fused):
    """Three samples (gradient, noise σ ⊙ ε) folded by the optimizer equal :func:`updates.ivon_record`."""
    if fused and cpu_kernels.library() is None:
        pytest.skip(f"no compiled library here: {cpu_kernels.unavailable_reason()}")
    n = cpu_kernels.SAMPLE_MIN_ELEMENTS + 5
    p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
    opt = mg.optim.IVON([p], lr=0.1, ess=100.0, hess_approx="price" if price else "gradsq", fused=fused)
    g = torch.Generator().manual_seed(4)
    grad_avg = hess_avg = None
    for k in range(1, 4):
        grad, noise = (torch.randn(n, generator=g, dtype=F64).to(dtype) for _ in range(2))
        opt._record([grad], [noise.clone()])
        grad_avg, hess_avg = updates.ivon_record(grad_avg, hess_avg, grad, noise, k, price)
    assert opt._count == 3
    assert torch.equal(opt._avg_grad[0], grad_avg)
    assert torch.equal(opt._avg_hess[0], hess_avg)


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("first", [True, False])
def test_vogn_compiled_pass_equals_the_stated_update_bitwise(dtype, first):
    if cpu_kernels.library() is None:
        pytest.skip(f"no compiled library here: {cpu_kernels.unavailable_reason()}")
    s = _states((257,), dtype, seed=2)
    momentum = None if first else s["momentum"]
    kwargs = dict(delta=1e-3, beta1=0.9, keep=0.999, beta2=1e-3, lr=1e-2, damping=1e-4)
    got = cpu_kernels.vogn_update_(s["mean"], s["grad_avg"], s["hess_avg"].abs(), momentum, s["hess"], **kwargs)
    want = updates.vogn_step(s["mean"], s["grad_avg"], s["hess_avg"].abs(), momentum, s["hess"], **kwargs)
    for a, b, what in zip(got, want, ("mu", "m", "s")):
        assert torch.equal(a, b), what
