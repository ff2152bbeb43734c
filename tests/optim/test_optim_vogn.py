"""VOGN and AdaptiveVB: the update against hand-written references, the posterior, seeding, state, bad input."""

from __future__ import annotations

import copy
import importlib.util
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mcgraph as mg
from mcgraph.optim import VOGN, AdaptiveVB

DT = torch.float64


def _data(n=6, d=3, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=DT), torch.randint(0, k, (n,), generator=g)


def _tiny(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)


def _closure(opt, model, x, y, reduction="mean"):
    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y, reduction=reduction)
        loss.backward()
        return loss
    return closure


def _per_example(model, x, y):
    """Per-example gradients by a batch-size-1 loop: list over parameters of (n, *shape)."""
    params = list(model.parameters())
    rows = [torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params) for i in range(x.shape[0])]
    return [torch.stack([r[j] for r in rows]) for j in range(len(params))]


def _reference_vogn(model, opt, x, y, steps, *, lr, betas, delta, damping, tau, K, n_eff, s0, variant):
    """Seed 003, Algorithm 1, written out with a batch-size-1 loop (same noise as the optimizer)."""
    ref = copy.deepcopy(model)
    params = list(ref.parameters())
    mu = [p.detach().clone() for p in params]
    s = [torch.full_like(p, s0) for p in params]
    m = [torch.zeros_like(p) for p in params]
    dt = tau * delta / n_eff
    for t in range(steps):
        g_hat = [torch.zeros_like(p) for p in params]
        h_hat = [torch.zeros_like(p) for p in params]
        for k in range(K):
            eps = opt.noise(t, k)
            with torch.no_grad():
                for p, mu_j, s_j, e in zip(params, mu, s, eps):
                    var = 1.0 / (n_eff * (s_j + dt + damping))
                    if variant == "torchsso":
                        var = var * tau
                    p.copy_(mu_j + var.sqrt() * e)
            for j, gi in enumerate(_per_example(ref, x, y)):
                g_hat[j] += gi.mean(0) / K
                h_hat[j] += gi.square().mean(0) / K
        beta1, beta2 = betas
        keep = 1 - (beta2 if variant == "torchsso" else tau * beta2)
        for j in range(len(params)):
            m[j] = beta1 * m[j] + (g_hat[j] + dt * mu[j])
            s[j] = keep * s[j] + beta2 * h_hat[j]
            mu[j] = mu[j] - lr * m[j] / (s[j] + dt + damping)
    return mu, s, m


@pytest.mark.parametrize("variant", ["paper", "torchsso"])
def test_vogn_steps_equal_hand_written_algorithm_1(variant):
    x, y = _data()
    model = _tiny()
    hyper = dict(lr=0.05, betas=(0.9, 0.3), delta=3.0, damping=0.01, tau=0.5, K=3, s0=0.2)
    start = copy.deepcopy(model)
    opt = VOGN(model, dataset_size=40, lr=hyper["lr"], betas=hyper["betas"], prior_precision=hyper["delta"],
               damping=hyper["damping"], tempering=hyper["tau"], num_samples=hyper["K"],
               data_augmentation_factor=2.0, init_precision=hyper["s0"], variant=variant, seed=11)
    for _ in range(2):
        opt.step(_closure(opt, model, x, y))
    mu, s, m = _reference_vogn(start, opt, x, y, 2, n_eff=80.0, variant=variant, **hyper)
    for p, mu_j, s_j, m_j in zip(model.parameters(), mu, s, m):
        torch.testing.assert_close(p.detach(), mu_j, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(opt.state[p]["precision"], s_j, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(opt.state[p]["momentum"], m_j, rtol=1e-10, atol=1e-12)


def test_vogn_first_step_initialises_s_from_one_pass_at_the_mean():
    x, y = _data(seed=1)
    model = _tiny(1)
    start = copy.deepcopy(model)
    opt = VOGN(model, dataset_size=30, lr=0.1, betas=(0.0, 0.5), prior_precision=1.0, damping=0.0, seed=3)
    calls = []
    closure = _closure(opt, model, x, y)
    opt.step(lambda: calls.append(1) or closure())
    assert len(calls) == 2  # the extra initialisation pass, then K = 1
    h0 = [g.square().mean(0) for g in _per_example(start, x, y)]
    # the step itself (draw 1) is Algorithm 1 from s0 = ĥ(μ)
    ref = copy.deepcopy(start)
    params = list(ref.parameters())
    eps = opt.noise(1, 0)
    dt = 1.0 / 30
    with torch.no_grad():
        for p, s0, e in zip(params, h0, eps):
            p.add_((1.0 / (30 * (s0 + dt))).sqrt() * e)
    g = _per_example(ref, x, y)
    for p, p0, s0, gi in zip(model.parameters(), start.parameters(), h0, g):
        s = 0.5 * s0 + 0.5 * gi.square().mean(0)
        mu = p0 - 0.1 * (gi.mean(0) + dt * p0) / (s + dt)
        torch.testing.assert_close(p.detach(), mu.detach(), rtol=1e-10, atol=1e-12)


def test_sum_reduction_gives_the_same_step():
    x, y = _data(seed=2)
    a, b = _tiny(2), _tiny(2)
    oa = VOGN(a, 10, lr=0.1, num_samples=2, init_precision=0.1, seed=0)
    ob = VOGN(b, 10, lr=0.1, num_samples=2, init_precision=0.1, seed=0, loss_reduction="sum")
    oa.step(_closure(oa, a, x, y))
    ob.step(_closure(ob, b, x, y, reduction="sum"))
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_adaptive_vb_sum_reduction_without_per_example_curvature():
    x, y = _data(seed=12)
    a, b = _tiny(12), _tiny(12)
    oa = AdaptiveVB(a, 10, lr=0.01, seed=0)
    ob = AdaptiveVB(b, 10, lr=0.01, seed=0, loss_reduction="sum")
    for _ in range(2):
        oa.step(_closure(oa, a, x, y))
        ob.step(_closure(ob, b, x, y, reduction="sum"))
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_infinite_prior_precision_collapses_the_posterior_to_the_prior():
    x, y = _data(seed=3)
    model = _tiny(3)
    delta = 1e12
    opt = VOGN(model, dataset_size=20, lr=1.0, betas=(0.0, 0.5), prior_precision=delta, damping=0.0, seed=0)
    for _ in range(3):
        opt.step(_closure(opt, model, x, y))
    prior = torch.distributions.Normal(torch.zeros((), dtype=DT), torch.tensor(delta ** -0.5, dtype=DT))
    for name, q in opt.posterior.items():
        torch.testing.assert_close(q.scale, prior.scale.expand_as(q.scale), rtol=1e-6, atol=0)
        assert float(q.loc.abs().max()) < 1e-3 * float(prior.scale), name
        kl = torch.distributions.kl_divergence(q, prior).sum()
        assert float(kl) < 1e-5, (name, float(kl))


def test_noise_is_seeded_reproducible_and_standard_normal():
    x, y = _data(seed=4)
    runs = []
    for seed, disturb in ((5, False), (5, True), (6, False)):
        model = _tiny(4)
        opt = VOGN(model, 10, lr=0.05, num_samples=4, init_precision=0.5, seed=seed)
        for _ in range(3):
            if disturb:
                torch.rand(100)  # the global generator is neither used nor reseeded
            opt.step(_closure(opt, model, x, y))
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(runs[0], runs[1])
    assert not torch.allclose(runs[0], runs[2])
    # ε over many draws is N(0, 1): mean and variance within 5 standard errors (false alarm < 1e-6)
    opt = VOGN(_tiny(), 10, init_precision=1.0, seed=0)
    eps = torch.cat([e.flatten() for t in range(200) for e in opt.noise(t, t % 3)])
    n = eps.numel()
    assert abs(float(eps.mean())) < 5 / n ** 0.5
    assert abs(float(eps.var()) - 1) < 5 * (2 / n) ** 0.5
    before = torch.random.get_rng_state()
    opt.noise(0, 0)
    assert torch.equal(before, torch.random.get_rng_state())


def test_state_dict_round_trip_continues_identically():
    x, y = _data(seed=5)
    model = _tiny(5)
    opt = VOGN(model, 10, lr=0.05, num_samples=2, seed=1, tempering=0.5, tempering_init=0.1,
               tempering_warmup_steps=5)
    for _ in range(2):
        opt.step(_closure(opt, model, x, y))
    model2 = copy.deepcopy(model)
    opt2 = VOGN(model2, 10, lr=0.05, num_samples=2, seed=1, tempering=0.5, tempering_init=0.1,
                tempering_warmup_steps=5)
    state = opt.state_dict()
    torch.save(state, buf := __import__("io").BytesIO())
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    assert opt2.counters == opt.counters
    for _ in range(2):
        opt.step(_closure(opt, model, x, y))
        opt2.step(_closure(opt2, model2, x, y))
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtypes_and_posterior_plugs_into_predict(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 6, 4)).to(dtype)
    x, y = torch.randn(8, 1, 8, dtype=dtype), torch.randint(0, 4, (8,))
    opt = VOGN(model, 100, lr=1e-2, num_samples=2, seed=0)
    for _ in range(2):
        opt.step(_closure(opt, model, x, y))
    q = opt.posterior
    assert sorted(q) == ["0.bias", "0.weight", "3.bias", "3.weight"]
    assert all(d.loc.dtype == dtype and bool((d.scale > 0).all()) for d in q.values())
    assert all(opt.state[p]["precision"].dtype == dtype for p in model.parameters())
    bnn = opt.posterior_model()
    assert len(mg.nn.bayesian_modules(bnn)) == 2
    probs = mg.nn.predict(bnn, x, num_samples=16, seed=0)
    assert probs.dtype == dtype and torch.allclose(probs.sum(-1), torch.ones(8, dtype=dtype))
    assert torch.isfinite(mg.nn.kl(bnn, seed=0))
    with mg.nn.frozen(bnn):  # posterior-mean weights: the trained network itself
        torch.testing.assert_close(bnn(x), model(x))
    # the posterior model's samples have the posterior's spread
    w = bnn[3]
    torch.testing.assert_close(w.weight_sigma, q["3.weight"].scale)
    torch.testing.assert_close(w.bias_sigma, q["3.bias"].scale)


def test_batchnorm_is_deterministic_and_without_prior_by_default():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    x, y = torch.randn(6, 1, 6, 6), torch.randint(0, 3, (6,))
    opt = VOGN(model, 50, lr=1e-2, num_samples=3, init_precision=0.1, seed=0)
    bn = model[1]
    seen = []
    closure = _closure(opt, model, x, y)

    def watching():
        seen.append((bn.weight.detach().clone(), model[0].weight.detach().clone()))
        return closure()

    w0 = bn.weight.detach().clone()
    opt.step(watching)
    assert all(torch.equal(a, w0) for a, _ in seen)  # BN never sampled
    assert not torch.equal(seen[0][1], seen[1][1])  # conv weights are
    assert "1.weight" not in opt.posterior
    groups = {g["module"]: g for g in opt.param_groups}
    assert not groups["1"]["prior"] and not groups["1"]["sample"] and groups["0"]["prior"]
    with_prior = VOGN(copy.deepcopy(model), 50, batchnorm_prior=True)
    assert {g["module"]: g["prior"] for g in with_prior.param_groups}["1"]
    probs = mg.nn.predict(opt.posterior_model().eval(), x, num_samples=4, seed=0)
    assert probs.shape == (6, 3)


def test_nan_gradient_skips_the_step_and_keeps_the_state():
    x, y = _data(seed=6)
    model = _tiny(6)
    opt = VOGN(model, 10, lr=0.05, num_samples=2, seed=0)
    opt.step(_closure(opt, model, x, y))
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    bad_x = x.clone()
    bad_x[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step(_closure(opt, model, bad_x, y))
    assert opt.skipped_steps == 1 and opt.counters["step"] == 1
    for p, p0 in zip(model.parameters(), params):
        assert torch.equal(p, p0)
    for p, saved in zip(model.parameters(), state):
        for key, value in saved.items():
            assert torch.equal(opt.state[p][key], value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step(_closure(opt, model, x, y))  # training goes on
    assert opt.counters["step"] == 2


def test_closure_error_restores_the_mean():
    model = _tiny(7)
    opt = VOGN(model, 10, num_samples=2, init_precision=0.1, seed=0)
    before = [p.detach().clone() for p in model.parameters()]

    def failing():
        raise RuntimeError("data loader broke")

    with pytest.raises(RuntimeError, match="data loader broke"):
        opt.step(failing)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_bad_input_is_named():
    model = _tiny()
    with pytest.raises(ValueError, match="dataset_size"):
        VOGN(model, 0)
    with pytest.raises(ValueError, match="dataset_size"):
        VOGN(model, -5)
    with pytest.raises(ValueError, match="dataset_size"):
        VOGN(model, float("nan"))
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        VOGN(model, 10, num_samples=0)
    with pytest.warns(DeprecationWarning, match=r"VOGN\(num_mc_samples=...\) is deprecated; use num_samples"):
        assert VOGN(model, 10, num_mc_samples=3).num_samples == 3
    with pytest.raises(TypeError, match="num_mc_samples is the deprecated name of num_samples"):
        VOGN(model, 10, num_samples=2, num_mc_samples=3)
    with pytest.warns(DeprecationWarning, match="num_mc_samples is deprecated"):
        assert VOGN(model, 10, num_samples=2).num_mc_samples == 2
    with pytest.raises(ValueError, match="lr"):
        VOGN(model, 10, lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        VOGN(model, 10, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="variant"):
        VOGN(model, 10, variant="keras")
    with pytest.raises(TypeError, match=r"LayerNorm"):
        VOGN(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)), 10)
    with pytest.raises(TypeError, match="Bayesian layer"):
        VOGN(nn.Sequential(mg.nn.BayesLinear(3, 3)), 10)
    with pytest.raises(TypeError, match="not model.parameters"):
        VOGN(model.parameters(), 10)
    with pytest.raises(ValueError, match="closure"):
        VOGN(model, 10).step(None)
    with pytest.raises(ValueError, match="alpha"):
        AdaptiveVB(model, 10, alpha=0.7)
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        AdaptiveVB(model, 10, num_samples=0)
    with pytest.warns(DeprecationWarning, match=r"AdaptiveVB\(num_mc_samples=...\)"):
        assert AdaptiveVB(model, 10, num_mc_samples=2).num_samples == 2
    with pytest.raises(ValueError, match=r"parallel must be one of \['data', 'samples'\], got 'rows'"):
        AdaptiveVB(model, 10, parallel="rows")
    assert AdaptiveVB(model, 10, curvature=mg.optim.Curvature.PER_EXAMPLE).defaults["curvature"] == "per_example"
    assert VOGN(model, 10, loss_reduction=mg.optim.LossReduction.SUM).loss_reduction == "sum"


def test_adaptive_vb_alpha_one_is_vogn_without_momentum_and_damping():
    """AdaptiveVB(α = 1, β₁ = 0, per-example curvature, λ = 1) ≡ VOGN(β₁ = 0, γ = 0, τ = 1) with π = s + δ/N."""
    x, y = _data(seed=8)
    a, b = _tiny(8), _tiny(8)
    va = VOGN(a, 25, lr=0.05, betas=(0.0, 0.2), prior_precision=2.0, damping=0.0, num_samples=2, seed=4)
    vb = AdaptiveVB(b, 25, lr=0.05, alpha=1.0, betas=(0.0, 0.2), prior_precision=2.0, num_samples=2,
                    curvature="per_example", eps=0.0, seed=4)
    for _ in range(3):
        va.step(_closure(va, a, x, y))
        vb.step(_closure(vb, b, x, y))
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(vb.state[q]["precision"], va.state[p]["precision"] + 2.0 / 25,
                                   rtol=1e-10, atol=1e-12)


def test_adaptive_vb_alpha_half_step_and_warmup_without_noise():
    x, y = _data(seed=9)
    model = _tiny(9)
    start = copy.deepcopy(model)
    opt = AdaptiveVB(model, 40, lr=0.01, alpha=0.5, betas=(0.9, 0.05), prior_precision=4.0, warmup_steps=2, seed=0)
    seen = []
    closure = _closure(opt, model, x, y)
    opt.step(lambda: seen.append([p.detach().clone() for p in model.parameters()]) or closure())
    assert all(torch.equal(a, b) for a, b in zip(seen[0], start.parameters()))  # warm-up: w = μ
    params = list(start.parameters())
    g = torch.autograd.grad(F.cross_entropy(start(x), y), params)
    for p, p0, gi in zip(model.parameters(), params, g):
        d = gi + 4.0 / 40 * p0
        pi = gi.square() + 4.0 / 40  # step 1 of the warm-up: the running mean is the first value
        mu = p0 - 0.01 * d / (pi.sqrt() + 1e-8)  # m̂ = d after bias correction
        torch.testing.assert_close(p.detach(), mu.detach(), rtol=1e-10, atol=1e-12)
    opt.step(closure)
    assert opt.posterior["0.weight"].scale.shape == (4, 3)
    seen.clear()
    opt.step(lambda: seen.append(model[0].weight.detach().clone()) or closure())  # after warm-up: sampled
    assert not torch.equal(seen[0], model[0].weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vogn_on_cuda_matches_cpu_shapes_and_runs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 3)).cuda()
    x, y = torch.randn(16, 1, 8, 8, device="cuda"), torch.randint(0, 3, (16,), device="cuda")
    opt = VOGN(model, 100, lr=1e-2, num_samples=2, seed=0)
    for _ in range(3):
        opt.step(_closure(opt, model, x, y))
    assert all(v.is_cuda for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    assert mg.nn.predict(opt.posterior_model(), x, num_samples=4, seed=0).is_cuda


# --------------------------------------------------------------------------- many processes


def _distributed_worker(rank, world, path, init_file):
    import torch.distributed as dist

    from mcgraph.apps.launch import exit_process

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        class AllReduceVOGN(VOGN):
            def _reduce_statistics(self, tensors):
                for t in tensors:
                    dist.all_reduce(t)
                    t.div_(world)
                return tensors

        x, y = _data(n=8, seed=10)
        model = _tiny(10)
        opt = AllReduceVOGN(model, 30, lr=0.05, num_samples=2, seed=2)
        shard = slice(rank * 4, rank * 4 + 4)
        for _ in range(2):
            opt.step(_closure(opt, model, x[shard], y[shard]))
        torch.save([p.detach() for p in model.parameters()], f"{path}.{rank}")
        dist.barrier()  # no rank tears gloo down while the other still talks to it (an abort otherwise)
    finally:
        dist.destroy_process_group()
    exit_process(0)  # gloo's threads must not meet interpreter shutdown (see mcgraph.apps.launch)


def test_reduce_statistics_is_the_one_place_for_data_parallelism(tmp_path):
    """Two gloo processes, each with half of the batch and an all-reducing ``_reduce_statistics``,
    take exactly the single-process step on the whole batch."""
    import torch.multiprocessing as mp

    x, y = _data(n=8, seed=10)
    model = _tiny(10)
    opt = VOGN(model, 30, lr=0.05, num_samples=2, seed=2)
    for _ in range(2):
        opt.step(_closure(opt, model, x, y))
    path = str(tmp_path / "params")
    mp.spawn(_distributed_worker, args=(2, path, str(tmp_path / "init")), nprocs=2, join=True)
    for rank in range(2):
        for p, q in zip(model.parameters(), torch.load(f"{path}.{rank}")):
            torch.testing.assert_close(q, p.detach(), rtol=1e-10, atol=1e-12)
    assert not os.path.exists(str(tmp_path / "never"))


# ---------------------------------------------------------------------------------------- defaults that train


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn not installed")
def test_vogn_with_only_dataset_size_reaches_90_percent_on_digits():
    """A 64-64-10 MLP on digits, 20 epochs, batch 64: the defaults train (they ended at chance before)."""
    from mcgraph.apps.data import load_dataset

    torch.set_num_threads(1)
    ds = load_dataset("digits")
    xtr, ytr, xte, yte = ds.x_train.flatten(1), ds.y_train, ds.x_test.flatten(1), ds.y_test
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = VOGN(net, dataset_size=xtr.shape[0], seed=0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        perm = torch.randperm(xtr.shape[0], generator=gen)
        for i in range(0, xtr.shape[0], 64):
            idx = perm[i:i + 64]
            opt.step(_closure(opt, net, xtr[idx], ytr[idx]))
    probs = mg.nn.predict(opt.posterior_model(), xte, num_samples=16, seed=0)
    acc = float((probs.argmax(-1) == yte).double().mean())
    assert acc >= 0.90 and opt.skipped_steps == 0, acc


def test_vogn_fails_loudly_when_the_first_sample_swamps_the_network():
    torch.manual_seed(0)
    x, y = torch.randn(64, 20), torch.randint(0, 5, (64,))
    net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    opt = VOGN(net, dataset_size=20, damping=0.0, seed=0)  # σ ≈ 1 per weight
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(RuntimeError, match="swamps the network.*damping"):
        opt.step(_closure(opt, net, x, y))
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    opt = VOGN(net, dataset_size=20, damping=0.0, seed=0, check_noise=False)
    opt.step(_closure(opt, net, x, y))


# --------------------------------------------------------------------------- K samples in one vmapped pass


def _conv(seed=0, batchnorm=False):
    torch.manual_seed(seed)
    layers = [nn.Conv2d(1, 2, 3)] + ([nn.BatchNorm2d(2)] if batchnorm else []) + [
        nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)]
    return nn.Sequential(*layers).to(DT)


def _pair(make, **kw):
    """Two copies of one network and a VOGN on each (the same seed: the same noise)."""
    a, b = make(), make()
    b.load_state_dict(a.state_dict())
    opts = [VOGN(m, 50, lr=0.05, seed=3, check_noise=False, **kw) for m in (a, b)]
    return (a, opts[0]), (b, opts[1])


def _loss(model, x, y, reduction="mean"):
    return lambda: F.cross_entropy(model(x), y, reduction=reduction)


def _assert_same_state(oa, a, ob, b, rtol=1e-12, atol=1e-14):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)
        for key in ("precision", "momentum"):
            torch.testing.assert_close(oa.state[p][key], ob.state[q][key], rtol=rtol, atol=atol)
    assert oa.counters == ob.counters


@pytest.mark.parametrize("case", ["mlp", "mlp-sum", "conv", "conv-batchnorm-eval", "mlp-chunks-of-1",
                                  "mlp-given-precision"])
def test_batched_samples_take_the_step_of_k_closure_calls_on_the_same_noise(case):
    """step_samples (vmap over the K weight samples, curvature from output probes) against step (K closure
    calls with hooks): the same weights, momentum and precision over three steps, float64 rounding apart."""
    reduction = "sum" if case.endswith("sum") else "mean"
    kw = {"num_samples": 4}
    if case == "mlp-given-precision":
        kw["init_precision"] = 0.2
    if case.startswith("conv"):
        make = lambda: _conv(4, batchnorm="batchnorm" in case)  # noqa: E731
        x, y = torch.randn(6, 1, 6, 6, dtype=DT), torch.randint(0, 3, (6,))
    else:
        make = lambda: _tiny(4)  # noqa: E731
        x, y = _data(seed=4)
    (a, oa), (b, ob) = _pair(make, loss_reduction=reduction, **kw)
    if "batchnorm" in case:
        a.eval(), b.eval()
    chunk = 1 if case.endswith("chunks-of-1") else 3
    for _ in range(3):
        la = oa.step_samples(_loss(a, x, y, reduction), vectorize=True, chunk_size=chunk)
        lb = ob.step(_closure(ob, b, x, y, reduction))
        torch.testing.assert_close(la, lb, rtol=1e-12, atol=1e-14)
    _assert_same_state(oa, a, ob, b)
    for p, q in zip(a.parameters(), b.parameters()):  # ĝ of the last step, as step leaves it
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def test_batched_samples_fall_back_where_vmap_cannot_run_the_model():
    """BatchNorm with batch statistics: vectorize=None takes the closure path (the same step, no trace of the
    refused attempt in the state); vectorize=True names the layer."""
    x, y = torch.randn(6, 1, 6, 6, dtype=DT), torch.randint(0, 3, (6,))
    (a, oa), (b, ob) = _pair(lambda: _conv(5, batchnorm=True), num_samples=3)
    for _ in range(2):
        oa.step_samples(_loss(a, x, y))
        ob.step(_closure(ob, b, x, y))
    _assert_same_state(oa, a, ob, b, rtol=0, atol=0)
    for m, n in zip(a.buffers(), b.buffers()):  # the running statistics saw one pass per sample, as in step
        assert torch.equal(m, n)
    from mcgraph.optim.batched_samples import Unbatchable

    with pytest.raises(Unbatchable, match="1: BatchNorm in training mode"):
        oa.step_samples(_loss(a, x, y), vectorize=True)


def test_a_layer_called_twice_per_forward_is_run_sample_by_sample():
    torch.manual_seed(6)
    shared = nn.Linear(3, 3).to(DT)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(3, 2).to(DT))
    twin = copy.deepcopy(model)
    x, y = _data(seed=6)
    oa, ob = (VOGN(m, 50, num_samples=2, seed=1, check_noise=False) for m in (model, twin))
    oa.step_samples(_loss(model, x, y))
    ob.step(_closure(ob, twin, x, y))
    _assert_same_state(oa, model, ob, twin, rtol=0, atol=0)
    # the refusal is remembered: later steps take the closure path without the batched attempt
    tried = []
    batched = oa._collect_batched
    oa._collect_batched = lambda *a, **k: tried.append(1) or batched(*a, **k)
    oa.step_samples(_loss(model, x, y))
    ob.step(_closure(ob, twin, x, y))
    assert not tried
    _assert_same_state(oa, model, ob, twin, rtol=0, atol=0)


def test_step_samples_of_an_lstm_runs_sample_by_sample_and_takes_the_closure_step():
    """An LSTM's outputs are a tuple: the batched probes cannot serve it, so its samples take the closure path."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm, self.head = nn.LSTM(3, 4, num_layers=2, batch_first=True), nn.Linear(4, 3)

        def forward(self, x):
            return self.head(self.lstm(x)[0][:, -1])

    def make():
        torch.manual_seed(7)
        return Net().to(DT)

    x, y = torch.randn(8, 5, 3, dtype=DT), torch.randint(0, 3, (8,))
    (a, oa), (b, ob) = _pair(make, num_samples=2)
    for _ in range(2):
        oa.step_samples(_loss(a, x, y))
        ob.step(_closure(ob, b, x, y))
    _assert_same_state(oa, a, ob, b, rtol=0, atol=0)


def test_step_samples_arguments():
    x, y = _data()
    model = _tiny()
    opt = VOGN(model, 50, num_samples=2, seed=0, check_noise=False)
    with pytest.raises(ValueError, match="chunk_size"):
        opt.step_samples(_loss(model, x, y), chunk_size=0)
    one = VOGN(_tiny(), 50, seed=0, check_noise=False)  # K = 1: the closure path, which needs no vmap
    assert torch.isfinite(one.step_samples(_loss(one.model, x, y)))


def test_default_chunk_size_fits_the_device_budget():
    from mcgraph.optim import batched_samples as bs

    peer = 784 * 1000 + 1000 + 1000 * 1000 + 1000 + 1000 * 10 + 10  # the peer MLP: eight samples in one pass
    assert bs.default_chunk_size(8, peer) == 8
    assert bs.default_chunk_size(8, peer, "cpu") == 8
    assert bs.default_chunk_size(64, peer) == bs.CHUNK_ELEMENTS // peer < 64
    assert bs.default_chunk_size(64, peer, torch.device("cuda")) == bs.CUDA_CHUNK_ELEMENTS // peer < 64
    assert bs.CUDA_CHUNK_ELEMENTS // peer > bs.CHUNK_ELEMENTS // peer
    assert bs.default_chunk_size(3, 10 * bs.CUDA_CHUNK_ELEMENTS, "cuda") == 1  # at least one sample
    assert bs.default_chunk_size(5, 0) == 5


class _Tagger(nn.Module):
    """An embedding, an LSTM and a linear head: the parameters a sequence model's optimiser sees."""

    def __init__(self, bidirectional: bool = False):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.lstm = nn.LSTM(4, 5, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(5 * (2 if bidirectional else 1), 3)

    def forward(self, tokens):
        out, _ = self.lstm(self.emb(tokens))
        return self.head(out[:, -1])


@pytest.mark.parametrize("bidirectional", [False, True])
def test_vogn_trains_an_lstm_and_its_posterior_model_samples_the_lstm_with_the_posterior_spread(bidirectional):
    torch.manual_seed(0)
    model = _Tagger(bidirectional).double()
    model.emb.weight.requires_grad_(False)  # VOGN has no per-example rule for embeddings: frozen here
    tokens, y = torch.randint(0, 7, (16, 6)), torch.randint(0, 3, (16,))
    opt = VOGN(model, 100, lr=1e-2, num_samples=2, seed=0)
    for _ in range(3):
        opt.step(_closure(opt, model, tokens, y))
    q = opt.posterior
    assert {n for n in q if n.startswith("lstm.")} == {f"lstm.{n}" for n in model.lstm._flat_weights_names}
    bnn = opt.posterior_model()
    lstm = bnn.lstm
    assert isinstance(lstm, mg.nn.BayesLSTM) and isinstance(bnn.emb, nn.Embedding)
    torch.testing.assert_close(bnn.emb.weight, model.emb.weight)  # not in the posterior: its trained values
    for name in model.lstm._flat_weights_names:  # weight_ih_l0 -> site ih_l0's weight, …
        leaf, _, site = name.partition("_")
        layer = getattr(lstm, site)
        torch.testing.assert_close(getattr(layer, f"{leaf}_mu"), q[f"lstm.{name}"].loc)
        torch.testing.assert_close(getattr(layer, f"{leaf}_sigma"), q[f"lstm.{name}"].scale)
    with mg.nn.frozen(bnn):  # the posterior means: the trained network itself
        torch.testing.assert_close(bnn(tokens), model(tokens))
    probs = mg.nn.predict(bnn, tokens, num_samples=8, seed=0)
    assert torch.allclose(probs.sum(-1), torch.ones(16, dtype=probs.dtype))


def test_posterior_model_keeps_every_module_the_posterior_does_not_reach():
    torch.manual_seed(1)
    model = _Tagger()
    head_only = {n: torch.distributions.Normal(p.detach(), torch.full_like(p, 0.1))
                 for n, p in model.named_parameters() if n.startswith("head.")}
    bnn = mg.optim.posterior_model(model, head_only)
    # the embedding and the LSTM are not in the posterior: kept as they are, never sampled with a default σ
    assert isinstance(bnn.emb, nn.Embedding) and isinstance(bnn.lstm, nn.LSTM)
    assert [type(m).__name__ for m in mg.nn.bayesian_modules(bnn)] == ["BayesLinear"]
    partial = {"lstm.weight_ih_l0": torch.distributions.Normal(model.lstm.weight_ih_l0.detach(), 0.2)}
    bnn = mg.optim.posterior_model(model, partial)
    torch.testing.assert_close(bnn.lstm.ih_l0.weight_sigma, torch.full((20, 4), 0.2))
    # the LSTM's other parameters keep their values: σ is the smallest normal number
    assert float(bnn.lstm.hh_l0.weight_sigma.max()) <= torch.finfo(torch.float32).tiny * 1.01
    torch.testing.assert_close(bnn.lstm.hh_l1.bias_mu, model.lstm.bias_hh_l1)
    with pytest.raises(ValueError, match="emb.weight"):
        mg.optim.posterior_model(model, {"emb.weight": torch.distributions.Normal(model.emb.weight.detach(), 0.1)})


def test_vogn_refuses_an_lstm_with_dropout_in_training_and_steps_it_in_eval_mode():
    torch.manual_seed(2)
    lstm = nn.LSTM(3, 4, num_layers=2, dropout=0.5, batch_first=True)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm, self.head = lstm, nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.lstm(x)[0][:, -1])

    model = Net()
    x, y = torch.randn(8, 5, 3), torch.randint(0, 2, (8,))
    opt = VOGN(model, 50, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="dropout"):
        opt.step(_closure(opt, model, x, y))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # nothing written
    model.eval()
    opt.step(_closure(opt, model, x, y))
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
