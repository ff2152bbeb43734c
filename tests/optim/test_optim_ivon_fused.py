"""IVON's compiled one-pass update (``fused``) against the foreach path: the same numbers bit for bit."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch.nn.functional as F
from support.kernel_spies import count_kernel_calls
from support.native_fallback import assert_runs_without_compiler
from torch import nn

from mcgraph.engine import native
from mcgraph.optim import IVON, cpu_kernels

pytestmark = pytest.mark.skipif(shutil.which(native.compiler()) is None, reason="no C++ compiler on this machine")


def _net(dtype, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 3)).to(dtype)


def _data(dtype, n=48):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)


def _run(opt, net, x, y, steps, samples):
    for t in range(steps):
        torch.manual_seed(100 + t)
        for _ in range(samples):
            with opt.sampled_params(train=True):
                opt.zero_grad()
                F.cross_entropy(net(x).float(), y).backward()
        opt.step()


def _assert_same(a, b, net_a, net_b):
    assert a.current_step == b.current_step
    for p, q in zip(net_a.parameters(), net_b.parameters()):
        assert torch.equal(p, q)
        for key in a.state[p]:
            assert torch.equal(a.state[p][key], b.state[q][key]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hess_approx", ["price", "gradsq"])
@pytest.mark.parametrize("clip_radius", [float("inf"), 1e-3])
@pytest.mark.parametrize("flags", [(True, True), (False, False)])
def test_compiled_step_equals_the_foreach_step_bit_for_bit(dtype, hess_approx, clip_radius, flags):
    debias, rescale_lr = flags
    x, y = _data(dtype)
    net_a, net_b = _net(dtype), _net(dtype)
    kw = dict(lr=0.2, ess=60, hess_init=0.3, beta2=0.9, weight_decay=1e-2, hess_approx=hess_approx,
              clip_radius=clip_radius, debias=debias, rescale_lr=rescale_lr)
    a, b = IVON(net_a, fused=True, **kw), IVON(net_b, fused=False, **kw)
    _run(a, net_a, x, y, steps=12, samples=2)
    _run(b, net_b, x, y, steps=12, samples=2)
    _assert_same(a, b, net_a, net_b)
    assert not torch.equal(net_a[0].weight, _net(dtype)[0].weight)  # the weights moved


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hess_approx", ["price", "gradsq"])
@pytest.mark.parametrize("samples", [1, 3])  # (3: a division by the count that is not exact)
def test_compiled_samples_of_a_larger_network_equal_the_foreach_ones(dtype, hess_approx, samples):
    # Above SAMPLE_MIN_ELEMENTS the weight sample and the first sample's statistics are compiled too.
    def wide():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 300), nn.Tanh(), nn.Linear(300, 250), nn.Tanh(), nn.Linear(250, 3)).to(dtype)

    x, y = _data(dtype)
    net_a, net_b = wide(), wide()
    kw = dict(lr=0.1, ess=100, hess_approx=hess_approx, weight_decay=1e-3, beta2=0.9)  # (h sees ĥ's last bits)
    a, b = IVON(net_a, **kw), IVON(net_b, fused=False, **kw)
    _run(a, net_a, x, y, steps=4, samples=samples)
    _run(b, net_b, x, y, steps=4, samples=samples)
    assert a._numel >= cpu_kernels.SAMPLE_MIN_ELEMENTS
    _assert_same(a, b, net_a, net_b)


def test_default_takes_the_compiled_step_on_cpu_and_both_agree_over_groups_threads_and_bfloat16():
    x, y = _data(torch.float32)
    nets = [_net(torch.float32) for _ in range(2)]
    for net in nets:
        net[2].to(torch.bfloat16)  # state in float32, the parameter holds the rounded mean
    x = x.float()

    def groups(net):
        return [{"params": net[0].parameters(), "lr": 0.05, "weight_decay": 0.1, "beta1": 0.5},
                {"params": net[2].parameters(), "ess": 30.0}]

    def forward(net, x):
        return net[2](torch.tanh(net[0](x)).bfloat16()).float()

    a, b = IVON(groups(nets[0]), lr=0.1, ess=50), IVON(groups(nets[1]), lr=0.1, ess=50, fused=False)
    threads = torch.get_num_threads()
    try:
        for t in range(8):
            torch.set_num_threads(1 + t % 2)  # the compiled pass splits elements over threads
            for opt, net in ((a, nets[0]), (b, nets[1])):
                torch.manual_seed(t)
                with opt.sampled_params(train=True):
                    opt.zero_grad()
                    F.cross_entropy(forward(net, x), y).backward()
                opt.step()
    finally:
        torch.set_num_threads(threads)
    assert cpu_kernels.library() is not None and a._scales is not None  # the compiled pass made the next scales
    _assert_same(a, b, nets[0], nets[1])


def test_compiled_step_with_batched_samples_equals_the_foreach_step():
    x, y = _data(torch.float64)
    net_a, net_b = _net(torch.float64), _net(torch.float64)
    a = IVON(net_a, lr=0.1, ess=40, mc_samples=3, seed=5)
    b = IVON(net_b, lr=0.1, ess=40, mc_samples=3, seed=5, fused=False)
    for _ in range(4):
        for opt, net in ((a, net_a), (b, net_b)):
            opt.step_samples(lambda net=net: F.cross_entropy(net(x), y), vectorize=True, model=net)
    _assert_same(a, b, net_a, net_b)


@pytest.mark.parametrize("hess_approx", ["price", "gradsq"])
def test_a_parameter_without_gradient_takes_the_same_step_on_both_paths(hess_approx):
    x, y = _data(torch.float32)
    nets = [nn.ModuleList([_net(torch.float32), nn.Linear(3, 3)]) for _ in range(2)]  # the second is unused
    a = IVON(nets[0], lr=0.1, ess=40, hess_approx=hess_approx)
    b = IVON(nets[1], lr=0.1, ess=40, hess_approx=hess_approx, fused=False)
    for t in range(3):
        for opt, net in ((a, nets[0]), (b, nets[1])):
            torch.manual_seed(t)
            with opt.sampled_params(train=True):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(net[0](x), y).backward()
            opt.step()
    _assert_same(a, b, nets[0], nets[1])


def test_a_checkpoint_resumes_across_the_two_paths():
    x, y = _data(torch.float64)
    net = _net(torch.float64)
    opt = IVON(net, lr=0.1, ess=40, seed=3)
    _run(opt, net, x, y, steps=3, samples=1)
    twin_net = copy.deepcopy(net)
    twin = IVON(twin_net, lr=0.1, ess=40, seed=3, fused=False)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    _run(opt, net, x, y, steps=3, samples=1)
    _run(twin, twin_net, x, y, steps=3, samples=1)
    _assert_same(opt, twin, net, twin_net)


def _both_paths_with_an_edit(edit, seed) -> tuple[torch.Tensor, torch.Tensor]:
    """Two steps on the compiled and the foreach path, ``edit(opt, net)`` on each, two more steps: the same
    (checked here). Returns the first weight after the edited run and after the same run without the edit."""
    x, y = _data(torch.float64)
    net_a, net_b, net_c = _net(torch.float64), _net(torch.float64), _net(torch.float64)
    a, b = IVON(net_a, lr=0.1, ess=40, seed=seed), IVON(net_b, lr=0.1, ess=40, seed=seed, fused=False)
    c = IVON(net_c, lr=0.1, ess=40, seed=seed)
    for opt, net, change in ((a, net_a, edit), (b, net_b, edit), (c, net_c, lambda opt, net: None)):
        _run(opt, net, x, y, steps=2, samples=1)
        change(opt, net)
        _run(opt, net, x, y, steps=2, samples=1)
    _assert_same(a, b, net_a, net_b)
    return net_a[0].weight.detach(), net_c[0].weight.detach()


def test_changing_ess_between_steps_rescales_the_noise_on_both_paths():
    def edit(opt, net):
        opt.param_groups[0]["ess"] = 400.0
        opt.param_groups[0]["weight_decay"] = 0.5

    edited, unedited = _both_paths_with_an_edit(edit, seed=1)
    assert not torch.equal(edited, unedited)  # the edit changed the run (so both paths saw it)


def test_a_hessian_changed_between_steps_rescales_the_next_sample_on_both_paths():
    def edit(opt, net):
        opt.state[net[0].weight]["hess"].mul_(100.0)  # in place
        opt.state[net[2].weight]["hess"] = torch.full_like(opt.state[net[2].weight]["hess"], 7.0)  # replaced

    edited, unedited = _both_paths_with_an_edit(edit, seed=2)
    assert not torch.equal(edited, unedited)  # the edit changed the run (so both paths saw it)


@pytest.mark.parametrize("fused", [None, False])
def test_a_graph_built_before_the_step_cannot_be_replayed_after_it(fused):
    # The compiled step writes the weights through their pointers; it bumps their version counters as
    # torch's in-place operations do, so autograd refuses a stale graph instead of using the new weights.
    x, y = _data(torch.float32)
    net = _net(torch.float32)
    opt = IVON(net, lr=0.1, ess=40, fused=fused)
    with opt.sampled_params(train=True):
        F.cross_entropy(net(x), y).backward()
    stale = F.cross_entropy(net(x), y)  # at the mean weights
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stale.backward()


def test_fused_argument_is_checked():
    net = _net(torch.float32)
    with pytest.raises(TypeError, match="fused"):
        IVON(net, lr=0.1, ess=10, fused="yes")
    w = nn.Parameter(torch.randn(4, 3).t())  # not contiguous
    with pytest.raises(ValueError, match="fused=True.*not contiguous"):
        IVON([w], lr=0.1, ess=10, fused=True)
    opt = IVON([w], lr=0.1, ess=10)  # the default takes the foreach path for it
    with opt.sampled_params(train=True):
        (w.sum() ** 2).backward()
    opt.step()
    assert torch.isfinite(w).all()


_NO_COMPILER = r"""
import torch, torch.nn.functional as F
from mcgraph.optim import IVON, cpu_kernels
torch.manual_seed(0)
net = torch.nn.Linear(3, 2)
x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
try:
    IVON(net, lr=0.1, ess=8, fused=True)
except RuntimeError as e:
    assert "fused=True" in str(e) and "no-such-compiler" in str(e), e
else:
    raise AssertionError("fused=True built without a compiler")
opt = IVON(net, lr=0.1, ess=8)
with opt.sampled_params(train=True):
    F.cross_entropy(net(x), y).backward()
opt.step()
assert cpu_kernels.library() is None and opt._scales is None
print("OK")
"""


def test_without_a_compiler_the_default_keeps_the_foreach_step_and_fused_true_says_why(tmp_path):
    assert_runs_without_compiler(tmp_path, _NO_COMPILER)


# ---------------------------------------------------------------------------------------- the review's cases


def _wide(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 300), nn.Tanh(), nn.Linear(300, 250), nn.Tanh(), nn.Linear(250, 3)).to(dtype)


def test_the_compiled_passes_run_and_split_elements_over_threads_without_changing_a_bit(monkeypatch):
    calls = count_kernel_calls(monkeypatch, ["ivon_step_", "ivon_sample_", "ivon_record_first_", "ivon_record_next_"])
    x, y = _data(torch.float32)
    runs = []
    threads = torch.get_num_threads()
    try:
        for n_threads, fused in ((1, None), (2, None), (2, False)):
            torch.set_num_threads(n_threads)
            net = _wide()
            opt = IVON(net, lr=0.1, ess=100, beta2=0.9, fused=fused)
            _run(opt, net, x, y, steps=3, samples=2)
            runs.append((opt, net))
    finally:
        torch.set_num_threads(threads)
    assert calls["ivon_step_"] == 6 and calls["ivon_sample_"] == 12 * 6  # 2 runs x 3 steps (x 2 samples x 6 tensors)
    assert calls["ivon_record_first_"] == calls["ivon_record_next_"] == 6 * 6
    _assert_same(runs[0][0], runs[1][0], runs[0][1], runs[1][1])
    _assert_same(runs[1][0], runs[2][0], runs[1][1], runs[2][1])


def test_the_step_bumps_the_version_of_every_tensor_it_writes():
    x, y = _data(torch.float32)
    net = _net(torch.float32)
    opt = IVON(net, lr=0.1, ess=40)
    _run(opt, net, x, y, steps=1, samples=1)
    w = net[0].weight
    before = {k: opt.state[w][k]._version for k in ("momentum", "hess")}, w._version
    _run(opt, net, x, y, steps=1, samples=1)
    assert all(opt.state[w][k]._version > v for k, v in before[0].items()) and w._version > before[1]


def test_a_hessian_replaced_after_the_old_one_is_freed_rescales_the_next_sample():
    # Python may give the new tensor the freed one's id: the cache compares the tensors themselves.
    def edit(opt, net):
        state = opt.state[net[0].weight]
        shape, dtype = state["hess"].shape, state["hess"].dtype
        del state["hess"]
        state["hess"] = torch.full(shape, 7.0, dtype=dtype)

    edited, unedited = _both_paths_with_an_edit(edit, seed=2)
    assert not torch.equal(edited, unedited)  # the edit changed the run (so both paths saw it)


def test_state_of_another_dtype_takes_torch_operations_or_raises_before_writing_under_fused_true():
    x, y = _data(torch.float64)
    source = _net(torch.float32)
    saved = IVON(source, lr=0.1, ess=40, seed=1)
    _run(saved, source, x.float(), y, steps=2, samples=1)
    checkpoint = saved.state_dict()  # float32 state
    nets = [_net(torch.float64) for _ in range(3)]
    opts = [IVON(nets[0], lr=0.1, ess=40, seed=1), IVON(nets[1], lr=0.1, ess=40, seed=1, fused=False),
            IVON(nets[2], lr=0.1, ess=40, seed=1, fused=True)]
    for opt in opts:
        opt.load_state_dict(checkpoint)  # keeps the float32 state of a float64 model
    _run(opts[0], nets[0], x, y, steps=2, samples=1)
    _run(opts[1], nets[1], x, y, steps=2, samples=1)
    _assert_same(opts[0], opts[1], nets[0], nets[1])
    before = [p.detach().clone() for p in nets[2].parameters()]
    with opts[2].sampled_params(train=True):
        F.cross_entropy(nets[2](x), y).backward()
    with pytest.raises(RuntimeError, match="fused=True.*Nothing was updated"):
        opts[2].step()
    assert opts[2].current_step == 2 and all(torch.equal(p, b) for p, b in zip(nets[2].parameters(), before))


def test_non_contiguous_gradients_take_the_compiled_step_under_fused_true():
    x, y = _data(torch.float32)
    outs = []
    for fused in (True, False):
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(5, 6))
        opt = IVON([w], lr=0.1, ess=40, seed=0, fused=fused)
        for _ in range(2):
            with opt.sampled_params(train=True):
                w.grad = (2 * torch.randn(6, 5, generator=torch.Generator().manual_seed(3))).t()  # strided
            opt.step()
        outs.append((w.detach().clone(), opt.state[w]["hess"].clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_nan_gradients_and_a_huge_clip_radius_give_the_same_numbers_on_both_paths():
    x, y = _data(torch.float32)
    results = []
    for fused in (None, False):
        net = _net(torch.float32)
        opt = IVON(net, lr=0.1, ess=40, seed=0, clip_radius=1e39, fused=fused)  # above float32's largest number
        _run(opt, net, x, y, steps=2, samples=1)
        with opt.sampled_params(train=True):
            net[0].weight.grad = torch.full_like(net[0].weight, float("nan"))
        opt.step()
        results.append([t.clone() for p in net.parameters() for t in (p.detach(), opt.state[p]["hess"])])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(results[0][0]).all()
