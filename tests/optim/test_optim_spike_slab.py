"""EM spike-and-slab pruning (E-step, M-step, permanent masks) and the physically smaller network."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mcgraph.optim import VOGN, AdaptiveVB, SpikeSlabEM, count_compute, shrink


def _crafted_mlp():
    """Linear(6 → 4): columns with mean squares 1, 1e-2, 4e-4, 0, 0.25, 9e-6; Linear(4 → 2) dense."""
    net = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))
    scales = torch.tensor([1.0, 0.1, 0.02, 0.0, 0.5, 0.003])
    signs = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0, -1.0]] * 4)
    with torch.no_grad():
        net[0].weight.copy_(signs * scales)
        net[2].weight.fill_(0.3)
    return net


def test_threshold_estep_marks_exactly_the_groups_below_it():
    net = _crafted_mlp()
    em = SpikeSlabEM(net, 1000, estep="threshold", soft_threshold=5e-3, hard_threshold=1e-5)
    em.e_step()
    assert em.inclusion(net[0].weight).flatten().tolist() == [1, 1, 0, 0, 1, 0]
    assert em.inclusion(net[2].weight).flatten().tolist() == [1, 1, 1, 1]
    decay = em.decay(net[0].weight)
    assert decay.shape == net[0].weight.shape
    expected = torch.tensor([em.slab_decay, em.slab_decay, em.spike_decay, em.spike_decay, em.slab_decay,
                             em.spike_decay])
    torch.testing.assert_close(decay[0], expected.to(decay.dtype))
    torch.testing.assert_close(em.precision(net[0].weight), decay * 1000)
    assert em.decay(net[0].bias) is None and em.mask(net[0].bias) is None  # biases keep the slab prior


def test_probability_estep_is_the_posterior_inclusion_and_rounds_to_its_threshold():
    net = _crafted_mlp()
    n = 500
    em = SpikeSlabEM(net, n, slab_decay=1e-3, spike_decay=1e-1, prior_inclusion=0.3)
    em.e_step()
    incl = em.inclusion(net[0].weight).flatten()
    w = net[0].weight.detach()
    v0, v1, pi = em.spike_variance, em.slab_variance, 0.3
    for j in range(6):
        beta = w[:, j].double()
        slab = math.log(pi) + torch.distributions.Normal(0.0, v1 ** 0.5).log_prob(beta).sum()
        spike = math.log(1 - pi) + torch.distributions.Normal(0.0, v0 ** 0.5).log_prob(beta).sum()
        expected = torch.sigmoid(slab - spike)
        assert float(incl[j]) == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
        below = float(beta.square().mean()) < em.equivalent_threshold(4)
        assert (float(incl[j]) < 0.5) == below
    assert incl.tolist()[0] == pytest.approx(1.0) and incl.tolist()[3] < 0.5
    decay = em.decay(net[0].weight)[0]
    torch.testing.assert_close(decay, incl * em.slab_decay + (1 - incl) * em.spike_decay)


def test_pruning_is_permanent_and_survives_training_and_save_load():
    torch.manual_seed(0)
    net = _crafted_mlp()
    em = SpikeSlabEM(net, 200, estep="threshold", soft_threshold=5e-3, hard_threshold=1e-3, warmup=1)
    assert not em.update(0)  # warm-up epoch: nothing happens
    assert em.sparsity()["pruned"] == 0
    assert em.update(1)
    assert em.masks["0.weight"][0].tolist() == [1, 1, 0, 0, 1, 0]
    x, y = torch.randn(32, 6), torch.randint(0, 2, (32,))
    opt = VOGN(net, 200, lr=0.05, num_samples=2, seed=0, spike_slab=em)
    seen = []

    def closure():
        seen.append(net[0].weight[:, [2, 3, 5]].detach().clone())
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        return loss

    for _ in range(4):
        opt.step(closure)
    assert all(torch.count_nonzero(s) == 0 for s in seen)  # the samples are masked too
    assert torch.count_nonzero(net[0].weight[:, [2, 3, 5]]) == 0
    q = opt.posterior["0.weight"]
    assert torch.count_nonzero(q.loc[:, [2, 3, 5]]) == 0 and torch.count_nonzero(q.scale[:, [2, 3, 5]]) == 0
    # pruned columns come back to nothing even after a later E-step that would call them slab
    with torch.no_grad():
        net[0].weight[:, 3] = 5.0
    em.update(2)
    assert torch.count_nonzero(net[0].weight[:, [2, 3, 5]]) == 0
    buf = io.BytesIO()
    torch.save({"model": net.state_dict(), "em": em.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    fresh = _crafted_mlp()
    fresh.load_state_dict(state["model"])
    em2 = SpikeSlabEM(fresh, 200, estep="threshold", soft_threshold=5e-3, hard_threshold=1e-3)
    em2.load_state_dict(state["em"])
    assert torch.equal(em2.masks["0.weight"], em.masks["0.weight"])
    opt2 = AdaptiveVB(fresh, 200, lr=1e-2, seed=0, spike_slab=em2)
    for _ in range(3):
        opt2.step(lambda: (opt2.zero_grad(), F.cross_entropy(fresh(x), y).backward())[0])
    assert torch.count_nonzero(fresh[0].weight[:, [2, 3, 5]]) == 0


def test_conv_groups_kernel_estep_and_channel_pruning():
    conv = nn.Conv2d(3, 4, 3)
    with torch.no_grad():
        conv.weight.fill_(0.5)
        conv.weight[1] = 0.0          # filter 1 dead
        conv.weight[:, 2] = 1e-4      # input channel 2 nearly dead
        conv.weight[0, 0] = 1e-3      # one kernel slice small
    em = SpikeSlabEM(nn.Sequential(conv), 100, estep="threshold", soft_threshold=1e-2, hard_threshold=1e-6)
    em.e_step()
    incl = em.inclusion(conv.weight)
    assert incl.shape == (4, 3, 1, 1)
    expected = torch.ones(4, 3)
    expected[1] = 0
    expected[:, 2] = 0
    expected[0, 0] = 0
    assert torch.equal(incl[..., 0, 0], expected)
    em.prune()
    mask = em.masks["0.weight"]
    assert mask[1].sum() == 0 and mask[:, 2].sum() == 0
    assert mask[0, 0].sum() == 9  # a small kernel slice is not a pruning group under prune_conv="channels"
    em_range = SpikeSlabEM(nn.Sequential(nn.Conv2d(2, 2, 3)), 100, hard_statistic="range", hard_threshold=1e-3)
    with torch.no_grad():
        em_range.params["0.weight"].fill_(0.7)  # constant, far from zero: the code's range rule prunes it
    em_range.prune()
    assert em_range.masks["0.weight"].sum() == 0


def test_bad_spike_slab_arguments():
    net = _crafted_mlp()
    with pytest.raises(ValueError, match="hard_threshold"):
        SpikeSlabEM(net, 10, hard_threshold=float("nan"))
    with pytest.raises(ValueError, match="spike_decay"):
        SpikeSlabEM(net, 10, slab_decay=1e-2, spike_decay=1e-3)
    with pytest.raises(ValueError, match="estep"):
        SpikeSlabEM(net, 10, estep="gibbs")
    with pytest.raises(ValueError, match="no Linear or Conv"):
        SpikeSlabEM(nn.Sequential(nn.ReLU()), 10)
    with pytest.raises(ValueError, match="exclude"):
        SpikeSlabEM(net, 10, exclude=("head",))
    with pytest.raises(ValueError, match="prior_inclusion"):
        SpikeSlabEM(net, 10, prior_inclusion=1.0)


class _LeNetLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(6, 8, 3), nn.ReLU())
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(8 * 2 * 2, 10), nn.ReLU(), nn.Linear(10, 3))

    def forward(self, x):
        return self.classifier(self.features(x))


def test_shrink_removes_dead_filters_neurons_and_inputs():
    torch.manual_seed(1)
    net = _LeNetLike()
    x = torch.randn(4, 1, 8, 8)
    net(x)
    net.eval()
    with torch.no_grad():
        net.features[4].weight[:, [1, 4]] = 0       # conv2 reads nothing from conv1's filters 1 and 4
        net.features[4].weight[[0, 5]] = 0          # conv2 filters 0 and 5 are dead …
        net.features[4].bias[[0, 5]] = 0            # … including their bias (ReLU keeps them at 0)
        net.classifier[1].weight[[2, 3, 7]] = 0     # hidden neurons 2, 3, 7 dead
        net.classifier[1].bias[[2, 3, 7]] = 0
    small, report = shrink(net, x)
    assert report["traced"]
    assert report["removed"] == {"features.0": 2, "features.4": 2, "classifier.1": 3}
    layer = small.get_submodule
    conv1, bn, conv2 = layer("features.0"), layer("features.1"), layer("features.4")
    assert conv1.out_channels == 4 and bn.num_features == 4 and conv2.in_channels == 4
    assert conv2.out_channels == 6 and layer("classifier.1").in_features == 6 * 4
    assert layer("classifier.1").out_features == 7 and layer("classifier.3").in_features == 7
    torch.testing.assert_close(small(x), net(x))
    assert report["after"]["parameters"] < report["before"]["parameters"]
    assert report["after"]["macs"] < report["before"]["macs"]
    expected = count_compute(small, x)
    assert report["after"] == expected


def test_shrink_selects_live_inputs_of_the_first_layer():
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(10, 5), nn.ReLU(), nn.Linear(5, 1))
    with torch.no_grad():
        net[0].weight[:, 5:] = 0
    x = torch.randn(3, 10)
    small, report = shrink(net, x)
    assert report["selected"] == {"0": [0, 1, 2, 3, 4]}
    assert small.get_submodule("0").in_features == 5
    torch.testing.assert_close(small(x), net(x))
    counts = count_compute(net, x)
    assert counts["macs"] == 10 * 5 + 5 and counts["macs_nonzero"] == 5 * 5 + 5
    assert counts["nonzero_parameters"] == counts["parameters"] - 25


def test_shrink_untraceable_model_is_reported_not_changed():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace it
                return self.lin(x)
            return -self.lin(x)

    net = Branchy()
    small, report = shrink(net, torch.ones(2, 3))
    assert report["traced"] is False and "reason" in report
    torch.testing.assert_close(small(torch.ones(2, 3)), net(torch.ones(2, 3)))
