"""AdaptiveSGHMC (the SGHMC form of adaptive VB), the cyclical cosine schedule and the snapshot ensemble."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mcgraph as mg
from mcgraph.optim import AdaptiveSGHMC, CyclicalCosineLR, SnapshotEnsemble, SpikeSlabEM

DT = torch.float64


def _setup(seed=0):
    torch.manual_seed(seed)
    model = nn.Linear(3, 2).to(DT)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 3, generator=g, dtype=DT), torch.randint(0, 2, (5,), generator=g)
    return model, x, y


def _grad(model, x, y):
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()


def test_step_equals_the_released_code_written_out():
    model, x, y = _setup()
    n, lr, t, eta, beta1, beta2, decay = 50, 0.04, 0.3, 0.1, 0.1, 1.0, 5e-3
    opt = AdaptiveSGHMC(model.parameters(), n, lr=lr, betas=(beta1, beta2), weight_decay=decay, temperature=t,
                        precision_lr=eta, seed=3)
    params = list(model.parameters())
    w = [p.detach().clone() for p in params]
    rho = [torch.zeros_like(p) for p in params]
    v = [1e-3 * opt._normal(p, 0, j, 0) for j, p in enumerate(params)]
    eps_prev = [opt._normal(p, 0, j, 1) for j, p in enumerate(params)]
    c = math.sqrt(lr)
    for step in (1, 2):
        _grad(model, x, y)
        opt.step()
        # the reference, on its own copy of the weights
        ref = nn.Linear(3, 2).to(DT)
        with torch.no_grad():
            ref.weight.copy_(w[0])
            ref.bias.copy_(w[1])
        grads = torch.autograd.grad(F.cross_entropy(ref(x), y), list(ref.parameters()))
        for j, g in enumerate(grads):
            tau = torch.sigmoid(rho[j])
            rho[j] = rho[j] - eta * (t ** 2 * c ** 3 * decay * tau + t * c ** 1.5 * eps_prev[j] * g - 1 / (tau * n))
            tau = torch.sigmoid(rho[j])
            eps = opt._normal(params[j], step, j, 1)
            v[j] = beta1 * v[j] - beta2 * c ** 2 * (g + decay * w[j]) + math.sqrt(2 + 2 * beta1 ** 2) * c ** 1.5 * t * eps
            w[j] = w[j] + tau * v[j]
            eps_prev[j] = eps
        for j, p in enumerate(params):
            torch.testing.assert_close(p.detach(), w[j], rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(opt.state[p]["rho"], rho[j], rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(opt.state[p]["momentum"], v[j], rtol=1e-12, atol=1e-14)


def test_nan_gradient_skips_and_state_round_trips():
    model, x, y = _setup(1)
    opt = AdaptiveSGHMC(model.parameters(), 20, lr=0.01, seed=0)
    _grad(model, x, y)
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    saved = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    model.weight.grad[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    assert opt.skipped_steps == 1 and opt.counters["step"] == 1
    for p, b, s in zip(model.parameters(), before, saved):
        assert torch.equal(p, b) and all(torch.equal(opt.state[p][k], v) for k, v in s.items())
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    twin_model = nn.Linear(3, 2).to(DT)
    twin_model.load_state_dict(model.state_dict())
    twin = AdaptiveSGHMC(twin_model.parameters(), 20, lr=0.01, seed=0)
    twin.load_state_dict(torch.load(buf, weights_only=True))
    for m, o in ((model, opt), (twin_model, twin)):
        _grad(m, x, y)
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin_model.parameters()))


def test_bad_arguments():
    model, _, _ = _setup()
    with pytest.raises(ValueError, match="dataset_size"):
        AdaptiveSGHMC(model.parameters(), 0)
    with pytest.raises(ValueError, match="temperature"):
        AdaptiveSGHMC(model.parameters(), 10, temperature=0.0)
    with pytest.raises(ValueError, match="betas"):
        AdaptiveSGHMC(model.parameters(), 10, betas=(1.0, 1.0))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(ValueError, match="cycles"):
        CyclicalCosineLR(opt, total_steps=3, cycles=4)


def test_pruned_groups_stay_zero_under_sghmc():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight[:, :2] = 1e-4  # inputs 0 and 1: tiny columns
    em = SpikeSlabEM(model, 100, estep="threshold", soft_threshold=1e-3, hard_threshold=1e-6, warmup=0)
    em.update(0)
    assert em.masks["0.weight"][:, :2].sum() == 0
    opt = AdaptiveSGHMC(model.parameters(), 100, lr=0.05, seed=0, spike_slab=em)
    x, y = torch.randn(16, 6), torch.randint(0, 2, (16,))
    for _ in range(5):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert torch.count_nonzero(model[0].weight[:, :2]) == 0
    assert torch.count_nonzero(opt.state[model[0].weight]["momentum"][:, :2]) == 0
    # the spike decay acts where the E-step says "spike"
    assert float(em.decay(model[0].weight)[0, 0]) == pytest.approx(em.spike_decay)


def test_cyclical_cosine_schedule_and_snapshot_steps():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = CyclicalCosineLR(opt, total_steps=20, cycles=2, snapshots_per_cycle=3, snapshot_fraction=0.4)
    rates = []
    for _ in range(20):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [2.0 * 0.5 * (math.cos(math.pi * (k % 10) / 10) + 1) for k in range(20)]
    assert rates == pytest.approx(expected)
    assert rates[0] == rates[10] == 2.0  # each cycle starts at the largest rate
    assert sched.snapshot_positions() == [5, 7, 9]
    assert [k for k in range(20) if sched.is_snapshot_step(k)] == [5, 7, 9, 15, 17, 19]
    state = sched.state_dict()
    again = CyclicalCosineLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0), 20, 2)
    again.load_state_dict(state)
    assert again.last_epoch == sched.last_epoch


def test_snapshot_ensemble_is_the_exact_model_average_in_predict():
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    ens = SnapshotEnsemble(net)
    weights = []
    for _ in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.normal_()
        ens.add()
        weights.append(copy_state(net))
    x = torch.randn(7, 4)
    expected = torch.stack([torch.softmax(run_with(net, w, x), -1) for w in weights]).mean(0)
    for chunk in (1, 2, 3):
        got = mg.nn.predict(ens, x, num_samples=3, chunk_size=chunk)
        torch.testing.assert_close(got, expected)
    samples = mg.nn.forward_samples(ens, x, 6)
    torch.testing.assert_close(samples[4], run_with(net, weights[1], x))  # sample i uses snapshot i mod 3
    state = ens.state_dict()
    fresh = SnapshotEnsemble(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)))
    fresh.load_state_dict(state)
    assert len(fresh) == 3
    torch.testing.assert_close(mg.nn.predict(fresh, x, num_samples=3), expected)
    with pytest.raises(RuntimeError, match="no snapshots"):
        SnapshotEnsemble(net)(x)


def copy_state(net):
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def run_with(net, state, x):
    from torch.func import functional_call

    return functional_call(net, state, (x,))
