"""VOGN's compiled update and noise variance (``fused``) against torch's operations: the same numbers bit for bit."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from support.kernel_spies import count_kernel_calls
from torch import nn

from mcgraph.engine import native
from mcgraph.optim import VOGN, SpikeSlabEM, cpu_kernels

pytestmark = pytest.mark.skipif(shutil.which(native.compiler()) is None, reason="no C++ compiler on this machine")


def _data(dtype, n=24):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 5, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)


def _mlp(dtype, batchnorm=False):
    torch.manual_seed(0)
    layers = [nn.Linear(5, 16)] + ([nn.BatchNorm1d(16)] if batchnorm else []) + [nn.Tanh(), nn.Linear(16, 3)]
    return nn.Sequential(*layers).to(dtype)


def _train(opt, net, x, y, steps):
    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        return loss

    losses = [opt.step(closure) for _ in range(steps)]
    return torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in losses])


def _assert_same(a, b, net_a, net_b, losses_a, losses_b):
    assert torch.equal(losses_a, losses_b)
    assert a.counters == b.counters
    for p, q in zip(net_a.parameters(), net_b.parameters()):
        assert torch.equal(p, q)
        assert a.state[p].keys() == b.state[q].keys()
        for key in a.state[p]:
            assert torch.equal(a.state[p][key], b.state[q][key]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("options", [
    {},
    {"variant": "torchsso", "tempering": 0.5, "tempering_init": 0.1, "tempering_warmup_steps": 4},
    {"tempering": 0.3, "tempering_init": 1.0, "tempering_warmup_steps": 3, "num_samples": 2},
    {"init_precision": 0.5, "prior_precision": 0.0, "data_augmentation_factor": 2.0},
])
def test_compiled_vogn_equals_torch_operations_bit_for_bit(dtype, options):
    x, y = _data(dtype)
    net_a, net_b = _mlp(dtype), _mlp(dtype)
    kw = dict(dataset_size=200, lr=0.05, seed=1, check_noise=False, **options)
    a, b = VOGN(net_a, **kw), VOGN(net_b, fused=False, **kw)
    _assert_same(a, b, net_a, net_b, _train(a, net_a, x, y, 6), _train(b, net_b, x, y, 6))
    assert a.posterior["0.weight"].scale.equal(b.posterior["0.weight"].scale)


def test_compiled_vogn_with_batchnorm_two_threads_and_batched_samples():
    x, y = _data(torch.float32)
    net_a, net_b = _mlp(torch.float32, batchnorm=True), _mlp(torch.float32, batchnorm=True)
    kw = dict(dataset_size=100, lr=0.05, seed=4, check_noise=False)
    a, b = VOGN(net_a, **kw), VOGN(net_b, fused=False, **kw)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _assert_same(a, b, net_a, net_b, _train(a, net_a, x, y, 4), _train(b, net_b, x, y, 4))
    finally:
        torch.set_num_threads(threads)
    # the batched samples (BatchNorm in eval mode: vmap takes it) go through the same update
    net_a.eval(), net_b.eval()
    a.num_samples = b.num_samples = 3
    for _ in range(2):
        la = a.step_samples(lambda: F.cross_entropy(net_a(x), y), vectorize=True)
        lb = b.step_samples(lambda: F.cross_entropy(net_b(x), y), vectorize=True)
        assert torch.equal(la, lb)
    _assert_same(a, b, net_a, net_b, la.reshape(1).double(), lb.reshape(1).double())


def test_spike_and_slab_parameters_take_torch_operations_and_agree():
    x, y = _data(torch.float64)
    nets = [_mlp(torch.float64) for _ in range(2)]
    ems = [SpikeSlabEM(net, 200, estep="threshold", soft_threshold=5e-3, hard_threshold=1e-3, warmup=1)
           for net in nets]
    a = VOGN(nets[0], 200, lr=0.05, seed=0, spike_slab=ems[0], check_noise=False)
    b = VOGN(nets[1], 200, lr=0.05, seed=0, spike_slab=ems[1], check_noise=False, fused=False)
    _assert_same(a, b, nets[0], nets[1], _train(a, nets[0], x, y, 5), _train(b, nets[1], x, y, 5))


def test_a_non_finite_update_is_skipped_on_the_compiled_path_too():
    x, y = _data(torch.float32)
    net = _mlp(torch.float32)
    opt = VOGN(net, 100, lr=0.05, seed=0, check_noise=False)
    _train(opt, net, x, y, 2)
    before = [p.detach().clone() for p in net.parameters()]
    state = {k: v.clone() for k, v in opt.state[net[0].weight].items()}
    opt.param_groups[0]["lr"] = float("inf")  # the new mean is non-finite
    with pytest.warns(RuntimeWarning, match="skipped"):
        _train(opt, net, x, y, 1)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
    assert all(torch.equal(opt.state[net[0].weight][k], v) for k, v in state.items())
    assert opt.skipped_steps == 1


def test_kernels_unit_against_the_torch_expressions():
    g = torch.Generator().manual_seed(0)
    mu, grad, hess, m, s = (torch.randn(1000, generator=g) for _ in range(5))
    s = s.abs()
    new_mu, new_m, new_s = cpu_kernels.vogn_update_(mu, grad, hess, m, s, delta=0.01, beta1=0.9, keep=0.999,
                                                    beta2=0.001, lr=0.05, damping=0.03)
    ref_m = m * 0.9 + (grad + 0.01 * mu)
    ref_s = s * 0.999 + 0.001 * hess
    assert torch.equal(new_m, ref_m) and torch.equal(new_s, ref_s)
    assert torch.equal(new_mu, mu - 0.05 * ref_m / (ref_s + 0.01 + 0.03))
    first_mu, first_m, _ = cpu_kernels.vogn_update_(mu, grad, hess, None, s, delta=0.01, beta1=0.9, keep=0.999,
                                                    beta2=0.001, lr=0.05, damping=0.03)
    assert torch.equal(first_m, grad + 0.01 * mu)
    var = cpu_kernels.vogn_variance_(s, delta=0.01, damping=0.03, size=500.0, tau=0.5)
    assert torch.equal(var, 1.0 / (500.0 * (s + 0.01 + 0.03)) * 0.5)


def test_fused_argument_is_checked():
    with pytest.raises(TypeError, match="fused"):
        VOGN(_mlp(torch.float32), 10, fused=1)


def test_the_compiled_kernels_run_and_fused_true_is_taken(monkeypatch):
    calls = count_kernel_calls(monkeypatch, ("vogn_update_", "vogn_variance_"))
    x, y = _data(torch.float32)
    nets = [_mlp(torch.float32) for _ in range(2)]
    a = VOGN(nets[0], 100, lr=0.05, seed=0, check_noise=False, fused=True)
    b = VOGN(nets[1], 100, lr=0.05, seed=0, check_noise=False, fused=False)
    la = _train(a, nets[0], x, y, 3)
    assert calls == {"vogn_update_": 3 * 4, "vogn_variance_": 3 * 4}
    _assert_same(a, b, nets[0], nets[1], la, _train(b, nets[1], x, y, 3))
    assert calls == {"vogn_update_": 3 * 4, "vogn_variance_": 3 * 4}  # fused=False calls none
