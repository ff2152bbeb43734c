"""Tests for ``mcgraph.nn``: Bayesian layers, bayesify, KL, likelihood, prediction and the ELBO."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Laplace, Normal, StudentT

import mcgraph as mg
import mcgraph.nn as mnn
from mcgraph.engine.plan.families import family_of
from mcgraph.nn.context import NoiseKind, sample_run

# --------------------------------------------------------------------------- fixtures

# (class, constructor args, input shape, expected output shape)
LAYER_KINDS = [
    (mnn.BayesLinear, (5, 4), (3, 5), (3, 4)),
    (mnn.BayesConv1d, (2, 4, 3), (3, 2, 9), (3, 4, 7)),
    (mnn.BayesConv2d, (2, 4, 3), (3, 2, 7, 6), (3, 4, 5, 4)),
    (mnn.BayesConv3d, (2, 4, 3), (2, 2, 5, 5, 4), (2, 4, 3, 3, 2)),
    (mnn.BayesConvTranspose1d, (2, 4, 3), (3, 2, 6), (3, 4, 8)),
    (mnn.BayesConvTranspose2d, (2, 4, 3), (3, 2, 5, 4), (3, 4, 7, 6)),
    (mnn.BayesConvTranspose3d, (2, 4, 2), (2, 2, 3, 3, 2), (2, 4, 4, 4, 3)),
]
KIND_IDS = [k[0].__name__ for k in LAYER_KINDS]
POSTERIORS = ["normal", "radial", "laplace"]
PRIORS = ["normal", "scale_mixture", "laplace"]


def _grads(module):
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b) if x is not None)


def small_cnn():
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 6 * 6, 8), nn.ReLU(),
                         nn.Linear(8, 3))


# --------------------------------------------------------------------------- layers × posteriors × priors


@pytest.mark.parametrize("prior", PRIORS)
@pytest.mark.parametrize("posterior", POSTERIORS)
@pytest.mark.parametrize("kind", LAYER_KINDS, ids=KIND_IDS)
def test_layer_shapes_and_kl_equal_direct(kind, posterior, prior):
    cls, args, in_shape, out_shape = kind
    torch.manual_seed(0)
    layer = cls(*args, posterior=posterior, prior=prior, kl_samples=40, rho_init=-2.0)
    out = layer(torch.randn(in_shape))
    assert isinstance(out, torch.Tensor) and out.shape == out_shape  # only the output, no (out, kl)
    q = layer.posterior
    assert tuple(q.batch_shape + q.event_shape) == tuple(layer.weight_mu.shape)
    if posterior == "radial":
        assert q.event_shape == layer.weight_mu.shape  # the event is the whole weight tensor
    # the default is exact where exact exists: the functional API's rule, summed
    torch.testing.assert_close(layer.kl(seed=7), mg.kl_divergence(q, layer.prior, 40, seed=7).sum(), rtol=0, atol=0)
    got = layer.kl(seed=7, method="monte-carlo")  # the sampled KL keeps the same-noise contract
    ref = mg.kl_divergence(q, layer.prior, 40, seed=7, method="direct").sum()
    assert got.shape == ()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)
    g_got = torch.autograd.grad(got, [layer.weight_mu, layer.weight_rho])
    g_ref = torch.autograd.grad(ref, [layer.weight_mu, layer.weight_rho])
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", LAYER_KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("option", ["weights", "local_reparameterization", "flipout", "bayesian_bias"])
def test_estimators_shapes_and_chunk_invariance(kind, option):
    cls, args, in_shape, out_shape = kind
    torch.manual_seed(1)
    opts = {"weights": {}, "bayesian_bias": {"bayesian_bias": True}}.get(option, {"estimator": option})
    layer = cls(*args, **opts)
    x = torch.randn(in_shape)
    assert layer(x).shape == out_shape
    a = mnn.forward_samples(layer, x, 5, seed=3)
    b = mnn.forward_samples(layer, x, 5, seed=3, chunk_size=2)
    c = mnn.forward_samples(layer, x, 5, seed=3, vectorize=False)
    assert a.shape == (5, *out_shape)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)
    assert not torch.allclose(a[0], a[1])  # every sample has its own noise


def test_grouped_conv_and_padding_mode():
    torch.manual_seed(0)
    conv = mnn.BayesConv2d(4, 6, 3, padding=1, groups=2, padding_mode="circular", estimator="flipout")
    x = torch.randn(2, 4, 5, 5)
    assert conv(x).shape == (2, 6, 5, 5)
    a = mnn.forward_samples(conv, x, 4, seed=0)
    b = mnn.forward_samples(conv, x, 4, seed=0, vectorize=False)
    torch.testing.assert_close(a, b)
    with mnn.frozen(conv):
        ref = nn.Conv2d(4, 6, 3, padding=1, groups=2, padding_mode="circular")
        ref.weight.data.copy_(conv.weight_mu.data)
        ref.bias.data.copy_(conv.bias.data)
        torch.testing.assert_close(conv(x), ref(x))


def test_layers_keep_no_noise_buffers_and_draw_fresh_noise():
    torch.manual_seed(0)
    for cls, args, in_shape, _ in LAYER_KINDS:
        for opts in ({}, {"estimator": "local_reparameterization"}, {"estimator": "flipout"}):
            layer = cls(*args, **opts)
            assert list(layer.buffers()) == []
            x = torch.randn(in_shape)
            assert not torch.equal(layer(x), layer(x))
            torch.manual_seed(5)
            a = layer(x)
            torch.manual_seed(5)
            torch.testing.assert_close(layer(x), a)  # the global generator reproduces a forward


def test_sigma_is_softplus_of_rho_and_stable():
    layer = mnn.BayesLinear(3, 2)
    with torch.no_grad():
        layer.weight_rho.copy_(torch.tensor([[-100.0, 0.0, 100.0], [50.0, -50.0, 1.0]]))
    sigma = layer.weight_sigma
    assert torch.isfinite(sigma).all() and (sigma > 0).all()
    torch.testing.assert_close(sigma, F.softplus(layer.weight_rho))
    torch.testing.assert_close(sigma[0, 2], torch.tensor(100.0))


def test_weight_sample_law():
    """Weight sampling, local reparameterization and flipout give the same output law (seeded, 6σ bounds)."""
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    stats = []
    for opts in ({}, {"estimator": "local_reparameterization"}, {"estimator": "flipout"}):
        torch.manual_seed(0)
        layer = mnn.BayesLinear(6, 3, rho_init=0.0, **opts)
        out = mnn.forward_samples(layer, x, 4000, seed=11, chunk_size=1000)
        mean = F.linear(x, layer.weight_mu, layer.bias).detach()
        var = F.linear(x * x, layer.weight_sigma ** 2).detach()
        z = (out.mean(0) - mean) / (var / 4000).sqrt()
        assert z.abs().max() < 6
        torch.testing.assert_close(out.var(0), var, rtol=0.15, atol=0.0)
        stats.append(out.var(0))


# --------------------------------------------------------------------------- gradients with shared graphs


class BufferNoiseLinear(nn.Module):
    """The pattern of bayesian-torch / blitz: noise kept in a buffer and refilled in place."""

    def __init__(self, mu, rho):
        super().__init__()
        self.mu = nn.Parameter(mu.clone())
        self.rho = nn.Parameter(rho.clone())
        self.register_buffer("eps", torch.zeros_like(mu))

    def forward(self, x):
        eps = self.eps.data.normal_()
        return F.linear(x, self.mu + F.softplus(self.rho) * eps)


def test_sigma_gradients_correct_when_samples_share_a_graph():
    """M samples summed in ONE graph: mcgraph's ρ-gradient equals the one from each sample's own noise;
    an in-place noise buffer gives a wrong one."""
    torch.manual_seed(0)
    M = 4
    x = torch.randn(8, 5)
    layer = mnn.BayesLinear(5, 3, rho_init=-1.0)
    # mcgraph: several plain forwards in one graph, each with fresh functional noise.
    torch.manual_seed(123)
    loss = sum((layer(x) ** 2).sum() for _ in range(M))
    g_rho, = torch.autograd.grad(loss, layer.weight_rho)
    # Reference: the same noise (same generator state), each sample in its own tensor.
    torch.manual_seed(123)
    noise = [torch.randn(1, 3, 5)[0] for _ in range(M)]
    rho = layer.weight_rho.detach().clone().requires_grad_()
    ref_loss = sum((F.linear(x, layer.weight_mu.detach() + F.softplus(rho) * e, layer.bias.detach()) ** 2).sum()
                   for e in noise)
    g_ref, = torch.autograd.grad(ref_loss, rho)
    torch.testing.assert_close(g_rho, g_ref)
    torch.testing.assert_close(loss, ref_loss)
    # The buffer pattern, same values, same noise: the forward is right, the σ-gradient is not.
    buf = BufferNoiseLinear(layer.weight_mu.detach(), layer.weight_rho.detach())
    torch.manual_seed(123)
    buf_loss = sum((F.linear(x, buf.mu + F.softplus(buf.rho) * buf.eps.data.normal_(), layer.bias.detach()) ** 2).sum()
                   for _ in range(M))
    g_buf, = torch.autograd.grad(buf_loss, buf.rho)
    torch.testing.assert_close(buf_loss, ref_loss)
    assert (g_buf - g_ref).norm() / g_ref.norm() > 0.1


def test_elbo_gradients_match_explicit_noise_reference():
    """The chunked ELBO's ρ-gradient equals plain autograd on the run's noise, one tensor per sample."""
    torch.manual_seed(0)
    net = mnn.bayesify(nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 3)), rho_init=-1.0)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    M = 6
    net.zero_grad()
    (-mnn.expected_data_term(net, x, y, num_samples=mg.Sampling(M, chunk_size=4), seed=4)).backward()
    layers = mnn.bayesian_modules(net)
    run = sample_run(net, M, seed=4)
    with torch.no_grad():
        noise = [run.form_rows(l, NoiseKind.WEIGHT, family_of(l.posterior), 0, M).clone() for l in layers]
    loss = 0
    for i in range(M):
        h = F.relu(F.linear(x, layers[0].weight_mu + layers[0].weight_sigma * noise[0][i], layers[0].bias))
        h = F.linear(h, layers[1].weight_mu + layers[1].weight_sigma * noise[1][i], layers[1].bias)
        loss = loss + F.cross_entropy(h, y)
    refs = torch.autograd.grad(loss / M, [layers[0].weight_rho, layers[1].weight_rho, layers[0].weight_mu])
    for got, ref in zip([layers[0].weight_rho.grad, layers[1].weight_rho.grad, layers[0].weight_mu.grad], refs):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


def test_seeded_estimate_gradient_matches_finite_differences():
    """With a fixed seed the M-sample estimate is a deterministic function of (μ, ρ): check its ρ-gradient."""
    torch.manual_seed(0)
    layer = mnn.BayesConv1d(2, 3, 3, posterior="laplace", dtype=torch.float64, rho_init=-1.0)
    x = torch.randn(2, 2, 6, dtype=torch.float64)

    def value():
        return mnn.forward_samples(layer, x, 3, seed=2).pow(2).sum()

    g, = torch.autograd.grad(value(), layer.weight_rho)
    eps, idx = 1e-6, (1, 0, 2)
    with torch.no_grad():
        layer.weight_rho[idx] += eps
        up = value()
        layer.weight_rho[idx] -= 2 * eps
        down = value()
        layer.weight_rho[idx] += eps
    assert abs((up - down).item() / (2 * eps) - g[idx].item()) < 1e-5 * max(1.0, abs(g[idx].item()))


# --------------------------------------------------------------------------- modes


def test_mean_mode_freeze_and_frozen():
    torch.manual_seed(0)
    net = mnn.bayesify(small_cnn())
    x = torch.randn(2, 1, 8, 8)
    mnn.freeze(net)
    a, b = net(x), net(x)
    torch.testing.assert_close(a, b)
    mnn.unfreeze(net)
    assert not torch.equal(net(x), net(x))
    with mnn.frozen(net):
        torch.testing.assert_close(net(x), a)
    assert all(l.mode == mnn.SampleMode.SAMPLE for l in mnn.bayesian_modules(net))
    with pytest.raises(ValueError, match="mode"):
        mnn.set_mode(net, "random")


# --------------------------------------------------------------------------- bayesify and models


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Conv3d(1, 2, 3)
        self.bn = nn.BatchNorm3d(2)
        self.dec = nn.ConvTranspose3d(2, 1, 3)
        self.seq = nn.Sequential(nn.Conv1d(1, 2, 3), nn.ConvTranspose1d(2, 1, 3), nn.Linear(5, 4))

    def forward(self, x):
        return self.dec(torch.relu(self.bn(self.enc(x))))


def test_bayesify_converts_every_weighted_module():
    torch.manual_seed(0)
    model = Custom()
    bnn = mnn.bayesify(model, posterior="laplace", prior="scale_mixture", kl_samples=7)
    kinds = {type(m) for m in bnn.modules()}
    assert nn.Conv3d not in kinds and nn.ConvTranspose3d not in kinds and nn.Linear not in kinds
    assert isinstance(bnn.bn, nn.BatchNorm3d)  # other modules as they are
    assert len(mnn.bayesian_modules(bnn)) == 5
    assert all(l.kl_samples == 7 for l in mnn.bayesian_modules(bnn))
    torch.testing.assert_close(bnn.enc.weight_mu, model.enc.weight)  # μ from the trained weights
    torch.testing.assert_close(bnn.enc.bias, model.enc.bias)
    assert isinstance(model.enc, nn.Conv3d)  # not in place by default
    x = torch.randn(2, 1, 5, 5, 5)
    assert bnn(x).shape == model(x).shape
    with mnn.frozen(bnn):
        torch.testing.assert_close(bnn(x), model(x))
    fresh = mnn.bayesify(model, init_from_weights=False)
    assert not torch.allclose(fresh.enc.weight_mu, model.enc.weight)
    skipped = mnn.bayesify(model, skip=("enc",))
    assert isinstance(skipped.enc, nn.Conv3d)
    with pytest.raises(ValueError, match="skip"):
        mnn.bayesify(model, skip=("nope",))
    single = mnn.bayesify(nn.Linear(3, 2))
    assert isinstance(single, mnn.BayesLinear)


def test_bayesify_resnet18_parameter_counts_and_kl_graph_size():
    """ResNet-18, 10 classes: 11.17 M point-estimate-equivalent parameters; whole-model KL graph equal at M = 1, 1000."""
    torch.manual_seed(0)
    bnn = mnn.bayesify(mg.models.get_model("resnet18", num_classes=10), inplace=True)
    layers = mnn.bayesian_modules(bnn)
    rho = sum(l.weight_rho.numel() for l in layers)
    total = sum(p.numel() for p in bnn.parameters())
    assert total - rho == 11_173_962  # μ + deterministic biases and BatchNorm = the deterministic count
    assert abs((total - rho) / 1e6 - 11.17) < 0.01
    assert rho == sum(l.weight_mu.numel() for l in layers) == 11_164_352
    a = mg.graph_size(lambda: mnn.kl(bnn, 1, seed=0, method="collapsed-exact"))
    b = mg.graph_size(lambda: mnn.kl(bnn, 1000, seed=0, method="collapsed-exact"))
    assert a == b


def test_bayesify_lenet_forward_and_kl():
    bnn = mnn.bayesify(mg.models.get_model("lenet5"), posterior="radial", prior="normal", kl_samples=1000)
    assert len(mnn.bayesian_modules(bnn)) == 5
    assert bnn(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    a = mg.graph_size(lambda: mnn.kl(bnn, 1, seed=0))
    b = mg.graph_size(lambda: mnn.kl(bnn, 1000, seed=0))
    assert a == b


# --------------------------------------------------------------------------- priors and KL


@pytest.mark.parametrize("prior", [
    "student_t", "log_uniform", "horseshoe",
    Normal(0.0, 0.5), StudentT(4.0, 0.0, 1.0),
    lambda w: Laplace(torch.zeros_like(w), torch.full_like(w, 0.3)),
])
def test_other_priors(prior):
    layer = mnn.BayesLinear(4, 3, prior=prior, kl_samples=30, posterior="radial")
    kl = mnn.kl(layer, seed=0)
    assert kl.shape == () and torch.isfinite(kl)
    kl.backward()
    assert layer.weight_rho.grad is not None


def test_model_kl_sums_layers_and_uses_layer_samples():
    torch.manual_seed(0)
    net = mnn.bayesify(small_cnn(), posterior="laplace", prior="laplace", kl_samples=50)
    layers = mnn.bayesian_modules(net)
    total = mnn.kl(net, seed=3)
    from mcgraph.engine.noise.streams import mix_seed

    parts = sum(l.kl(seed=mix_seed(3, i)) for i, l in enumerate(layers))
    torch.testing.assert_close(total, parts)
    with pytest.raises(ValueError, match="mg.nn.kl: model has no Bayesian layer.*bayesify"):
        mnn.kl(nn.Linear(2, 2))  # a KL of 0 would train the network with no KL at all


def test_normal_normal_kl_close_to_closed_form():
    torch.manual_seed(0)
    layer = mnn.BayesLinear(20, 10, kl_samples=20_000, rho_init=-1.0)
    exact = torch.distributions.kl_divergence(layer.posterior, layer.prior).sum()
    torch.testing.assert_close(layer.kl(seed=0, method="collapsed-exact"), exact, rtol=0.02, atol=0.5)


def test_bayesian_bias_has_kl_and_noise():
    layer = mnn.BayesLinear(4, 3, bayesian_bias=True, posterior="laplace", kl_samples=20)
    assert layer.bias is None and layer.bias_mu is not None
    assert layer.bias_posterior is not None
    kl_w = mg.kl_divergence(layer.posterior, layer.prior, 20, seed=0).sum()
    assert layer.kl(seed=0) > kl_w


# --------------------------------------------------------------------------- validation


def test_bad_arguments_raise_named_errors():
    with pytest.raises(ValueError, match="posterior"):
        mnn.BayesLinear(2, 2, posterior="gamma-ish")
    with pytest.raises(ValueError, match="prior"):
        mnn.BayesLinear(2, 2, prior="flat-ish")
    with pytest.raises(ValueError, match="kl_samples"):
        mnn.BayesLinear(2, 2, kl_samples=0)
    with pytest.raises(ValueError, match="local_reparameterization"):
        mnn.BayesLinear(2, 2, posterior="radial", estimator="local_reparameterization")
    with pytest.raises(ValueError, match="estimator='flipout' requires a location-scale posterior"):
        mnn.BayesLinear(2, 2, posterior="lognormal", estimator="flipout")
    with pytest.raises(ValueError, match=r"estimator must be one of \['reparameterization', 'local_reparameterization', "
                                         r"'flipout'\] or None, got 'local'"):
        mnn.BayesLinear(2, 2, estimator="local")
    with pytest.raises(TypeError, match="give estimator= alone"):
        mnn.BayesLinear(2, 2, flipout=True, estimator="local_reparameterization")
    with pytest.warns(DeprecationWarning, match="use estimator="), pytest.raises(ValueError, match="at most one"):
        mnn.BayesLinear(2, 2, flipout=True, local_reparameterization=True)
    with pytest.raises(ValueError, match="prior"):
        mnn.BayesLinear(2, 2, prior=Normal(torch.zeros(5), 1.0))
    with pytest.raises(ValueError, match="in_features"):
        mnn.BayesLinear(0, 2)
    with pytest.raises(ValueError, match="spatial_dims"):
        mnn.BayesConv(2, 2, 3)
    with pytest.raises(ValueError, match="x"):
        mnn.BayesConv2d(2, 2, 3)(torch.randn(2, 5, 5))
    layer = mnn.BayesLinear(2, 2)
    with pytest.raises(ValueError, match="num_samples"):
        mnn.forward_samples(layer, torch.randn(1, 2), 0)
    with pytest.raises(ValueError, match="chunk_size"):
        mnn.predict(layer, torch.randn(1, 2), 4, chunk_size=0)
    with pytest.raises(ValueError, match="dataset_size"):
        mnn.elbo(layer, torch.randn(1, 2), torch.tensor([0]), num_samples=1, dataset_size=0)
    with pytest.raises(ValueError, match="method"):
        mnn.elbo(layer, torch.randn(1, 2), torch.tensor([0]), num_samples=mg.Sampling(1, method="magic"), dataset_size=1)
    with pytest.raises(ValueError, match="likelihood"):
        mnn.elbo(layer, torch.randn(1, 2), torch.tensor([0]), num_samples=1, dataset_size=1, likelihood="poisson")


def test_lognormal_and_callable_posteriors():
    layer = mnn.BayesLinear(3, 2, posterior=torch.distributions.LogNormal, prior="log_uniform", kl_samples=10)
    w = mnn.forward_samples(layer, torch.eye(3), 2, seed=0)
    assert w.shape == (2, 3, 2)
    assert torch.isfinite(layer.kl(seed=0))
    import functools

    layer = mnn.BayesLinear(3, 2, posterior=functools.partial(StudentT, 5.0), kl_samples=10)
    assert layer(torch.randn(4, 3)).shape == (4, 2)
    assert torch.isfinite(layer.kl(seed=0))


# --------------------------------------------------------------------------- ELBO


@pytest.mark.parametrize("posterior, option", [(p, o) for p in POSTERIORS for o in ("weights", "flipout")]
                         + [("normal", "local_reparameterization")])  # local needs a Gaussian posterior
def test_elbo_chunked_equals_direct(posterior, option):
    torch.manual_seed(0)
    opts = {"weights": {}, "bayesian_bias": {"bayesian_bias": True}}.get(option, {"estimator": option})
    net = mnn.bayesify(small_cnn(), posterior=posterior, prior="scale_mixture", kl_samples=30, rho_init=-2.0, **opts)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,))
    results = []
    for method, chunk in [("direct", 5), ("accumulated", 2), ("accumulated", 5), ("accumulated", 1)]:
        net.zero_grad()
        value = mnn.elbo(net, x, y, num_samples=mg.Sampling(5, method=method, chunk_size=chunk), dataset_size=50, seed=9)
        value.backward()
        results.append((value.detach(), _grads(net)))
    ref_value, ref_grads = results[0]
    for value, grads in results[1:]:
        torch.testing.assert_close(value, ref_value)
        assert _max_diff(grads, ref_grads) < 1e-5


def test_elbo_graph_does_not_grow_with_samples():
    torch.manual_seed(0)
    net = mnn.bayesify(nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 4)), posterior="radial")
    x, y = torch.randn(8, 20), torch.randint(0, 4, (8,))

    def size(M, method="accumulated"):
        return mg.graph_size(mnn.elbo(net, x, y, num_samples=mg.Sampling(M, method=method, chunk_size=4), dataset_size=100, kl_samples=M, seed=0))

    one, many = size(1), size(64)
    assert many.saved_bytes <= 1.05 * one.saved_bytes and many.nodes == one.nodes
    assert size(16, "direct").saved_bytes > 2 * size(1, "direct").saved_bytes


def test_elbo_at_one_sample_is_the_plain_one_sample_graph():
    # M = 1 has nothing to accumulate: the default is the direct graph (a plain torch step's), M >= 2 accumulated
    torch.manual_seed(0)
    net = mnn.bayesify(nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 4)), posterior="radial")
    x, y = torch.randn(8, 20), torch.randint(0, 4, (8,))

    def run(M, method=None):
        loss = -mnn.elbo(net, x, y, num_samples=mg.Sampling(M, method=method), dataset_size=100, seed=3)
        return loss, mg.graph_size(loss), torch.autograd.grad(loss, list(net.parameters()))

    default, direct, accumulated = run(1), run(1, "direct"), run(1, "accumulated")
    assert default[1] == direct[1] and default[1] != accumulated[1]
    assert run(2)[1] == run(2, "accumulated")[1]
    with pytest.warns(DeprecationWarning, match="method='chunked' is deprecated: use 'accumulated'"):
        old_name = run(2, "chunked")
    assert torch.equal(old_name[0], run(2, "accumulated")[0])
    torch.testing.assert_close(default[0], accumulated[0], rtol=0, atol=0)
    for a, b in zip(default[2], accumulated[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_elbo_gradients_reach_a_module_likelihood_and_y_and_stray_tensors_are_refused():
    torch.manual_seed(0)
    net = mnn.bayesify(nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1)))
    x, y = torch.randn(6, 5), torch.randn(6)

    class Gaussian(nn.Module):  # a learnable noise scale
        def __init__(self):
            super().__init__()
            self.log_s = nn.Parameter(torch.tensor(0.3))

        def forward(self, out, target):
            return Normal(out.squeeze(-1), self.log_s.exp()).log_prob(target)

    head, target = Gaussian(), y.clone().requires_grad_()
    grads = []
    for method in ("direct", "accumulated"):
        loss = -mnn.elbo(net, x, target, num_samples=mg.Sampling(3, method=method, chunk_size=2), dataset_size=60,
                         likelihood=head, seed=0)
        grads.append(torch.autograd.grad(loss, [head.log_s, target, *net.parameters()]))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert grads[1][0] != 0 and grads[1][1].abs().sum() > 0

    # a tensor the Function is not given (closed over by a likelihood function, or a model's plain attribute)
    log_s = torch.tensor(0.3, requires_grad=True)

    def closure(out, t):
        return Normal(out.squeeze(-1), log_s.exp()).log_prob(t)

    one = mnn.elbo(net, x, y, num_samples=1, dataset_size=60, likelihood=closure, seed=0)  # one plain graph
    assert torch.autograd.grad(one, log_s)[0] != 0
    with pytest.raises(ValueError, match=r"1 tensor\(s\) that require grad.*shapes \(\)\).*method='direct'"):
        mnn.elbo(net, x, y, num_samples=2, dataset_size=60, likelihood=closure, seed=0)
    direct = mnn.elbo(net, x, y, num_samples=mg.Sampling(2, method="direct"), dataset_size=60, likelihood=closure,
                      seed=0)
    assert torch.autograd.grad(direct, log_s)[0] != 0

    class Shifted(nn.Module):
        def __init__(self, body):
            super().__init__()
            self.body, self.shift = body, torch.zeros(1, requires_grad=True)  # not an nn.Parameter

        def forward(self, inputs):
            return self.body(inputs) + self.shift

    with pytest.raises(ValueError, match=r"shapes \(1,\)"):
        mnn.elbo(Shifted(net), x, y, num_samples=4, dataset_size=60, likelihood="gaussian", seed=0)
    with torch.no_grad():  # no gradient asked: nothing to refuse
        mnn.elbo(Shifted(net), x, y, num_samples=4, dataset_size=60, likelihood="gaussian", seed=0)


def test_elbo_terms_and_scaling():
    torch.manual_seed(0)
    net = mnn.bayesify(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), kl_samples=10)
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    t = mnn.elbo_terms(net, x, y, num_samples=3, dataset_size=600, kl_weight=0.5, seed=1)
    torch.testing.assert_close(t.elbo, t.log_likelihood - 0.5 * t.kl / 600)
    torch.testing.assert_close(mnn.elbo(net, x, y, num_samples=3, dataset_size=600, kl_weight=0.5, seed=1), t.elbo)
    # the data term is the mean over samples of the batch-mean log-likelihood
    out = mnn.forward_samples(net, x, 3, seed=1)
    ll = -F.cross_entropy(out.reshape(18, 2), y.repeat(3), reduction="none").mean()
    torch.testing.assert_close(t.log_likelihood, ll)


def test_elbo_with_train_mode_batchnorm_runs_samples_one_by_one():
    torch.manual_seed(0)
    net = mnn.bayesify(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(),
                                     nn.Linear(2 * 4 * 4, 3)))
    assert not mnn.can_vectorize(net)
    x, y = torch.randn(4, 1, 6, 6), torch.randint(0, 3, (4,))
    a = mnn.expected_data_term(net, x, y, num_samples=3, seed=0)
    ref = torch.stack([F.cross_entropy(mnn.forward_samples(net, x, 3, seed=0)[i], y) for i in range(3)]).mean()
    torch.testing.assert_close(a, -ref)
    net.eval()
    assert mnn.can_vectorize(net)


def test_gaussian_elbo():
    torch.manual_seed(0)
    net = mnn.bayesify(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)), posterior="laplace")
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    v = mnn.elbo(net, x, y, num_samples=4, dataset_size=10, likelihood="gaussian", noise_std=0.3, seed=0)
    v.backward()
    out = mnn.forward_samples(net, x, 4, seed=0)
    ll = Normal(out, 0.3).log_prob(y).sum(-1).mean()
    t = mnn.elbo_terms(net, x, y, num_samples=4, dataset_size=10, likelihood="gaussian", noise_std=0.3, seed=0)
    torch.testing.assert_close(t.log_likelihood, ll)


def test_kl_schedules():
    assert mnn.kl_schedule("constant")(10) == 1.0
    lin = mnn.kl_schedule("linear", warmup_steps=4)
    assert [lin(t) for t in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    bl = mnn.kl_schedule("blundell", num_batches=5)
    weights = [bl(t) for t in range(5)]
    assert math.isclose(sum(weights) / 5, 1.0) and weights == sorted(weights, reverse=True)
    assert math.isclose(weights[0] / 5, 2 ** 4 / (2 ** 5 - 1))
    assert bl(5) == bl(0)
    big = mnn.kl_schedule("blundell", num_batches=5000)
    assert math.isfinite(big(0)) and big(4999) >= 0
    with pytest.raises(ValueError, match="name"):
        mnn.kl_schedule("cosine")
    with pytest.raises(ValueError, match="warmup_steps"):
        mnn.kl_schedule("linear")


# --------------------------------------------------------------------------- many-sample likelihood


def head_model(out=4, posterior_rho=-1.0):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(),
                         mnn.BayesLinear(16, out, estimator="local_reparameterization", rho_init=posterior_rho))


def test_softmax_cross_entropy_mc_matches_naive():
    torch.manual_seed(0)
    m = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    s = (torch.rand(5, 4, dtype=torch.float64) + 0.1).requires_grad_()
    y = torch.randint(0, 4, (5,))
    M = 200
    got = mnn.softmax_cross_entropy_mc(m, s, y, M, seed=3, chunk_size=7)
    from mcgraph.nn.likelihood import gaussian_stream

    eps = gaussian_stream(m.shape, 3, M, m.dtype, m.device).rows(0, M)
    u = m + s * eps
    ref = -(torch.log_softmax(u, -1).gather(-1, y.expand(M, 5)[..., None]).squeeze(-1)).mean(0)
    torch.testing.assert_close(got, ref)
    w = torch.randn(5, dtype=torch.float64)
    g = torch.autograd.grad((got * w).sum(), [m, s])
    r = torch.autograd.grad((ref * w).sum(), [m, s])
    for a, b in zip(g, r):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(mnn.softmax_cross_entropy_mc(m, s, y, M, seed=3), got)
    sizes = {mg.graph_size(lambda: mnn.softmax_cross_entropy_mc(m, s, y, k, seed=0)) for k in (1, 1000, 20_000)}
    assert len(sizes) == 1


@pytest.mark.parametrize("likelihood", ["categorical", "gaussian"])
def test_expected_log_likelihood_equals_whole_network_estimate(likelihood):
    net = head_model(out=4 if likelihood == "categorical" else 2)
    x = torch.randn(5, 6)
    y = torch.randint(0, 4, (5,)) if likelihood == "categorical" else torch.randn(5, 2)
    M = 300
    net.zero_grad()
    a = mnn.expected_log_likelihood(net, x, y, num_samples=M, seed=5, likelihood=likelihood, noise_std=0.5)
    a.backward()
    ga = _grads(net)
    net.zero_grad()
    b = mnn.expected_data_term(net, x, y, num_samples=mg.Sampling(M, chunk_size=64), seed=5, likelihood=likelihood, noise_std=0.5)
    b.backward()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert _max_diff(ga, _grads(net)) < 1e-4
    per_row = mnn.expected_log_likelihood(net, x, y, num_samples=M, seed=5, likelihood=likelihood,
                                          noise_std=0.5, reduction="none")
    assert per_row.shape == (5,)
    sizes = {mg.graph_size(lambda: mnn.expected_log_likelihood(net, x, y, num_samples=k, seed=0,
                                                               likelihood=likelihood))
             for k in (1, 1000, 10_000)}
    assert len(sizes) == 1


def test_expected_log_likelihood_requires_a_local_reparameterized_last_layer():
    x, y = torch.randn(2, 6), torch.tensor([0, 1])
    net = nn.Sequential(nn.Linear(6, 4), mnn.BayesLinear(4, 3))
    with pytest.raises(ValueError, match="local_reparameterization"):
        mnn.expected_log_likelihood(net, x, y, num_samples=10)
    net = nn.Sequential(mnn.BayesLinear(6, 3, estimator="local_reparameterization"), nn.ReLU())
    with pytest.raises(ValueError, match="output"):
        mnn.expected_log_likelihood(net, x, y, num_samples=10)
    with pytest.raises(ValueError, match="Bayesian"):
        mnn.expected_log_likelihood(nn.Linear(6, 3), x, y, num_samples=10)


# --------------------------------------------------------------------------- prediction


def test_predict_head_only_runs_trunk_once_with_the_same_numbers():
    net = head_model()
    calls = []
    net[0].register_forward_hook(lambda *a: calls.append(1))
    x = torch.randn(5, 6)
    p = mnn.predict(net, x, 50, seed=3, chunk_size=8)
    assert len(calls) == 1  # the deterministic trunk ran once
    q = mnn.predict(net, x, 50, seed=3, trunk_once=False, chunk_size=7)
    torch.testing.assert_close(p, q)
    assert p.shape == (5, 4)
    torch.testing.assert_close(p.sum(-1), torch.ones(5))


def test_predict_full_network_and_samples():
    torch.manual_seed(0)
    net = mnn.bayesify(small_cnn(), posterior="radial")
    x = torch.randn(3, 1, 8, 8)
    pred = mnn.predict(net, x, 6, seed=1, chunk_size=4, return_samples=True)
    assert pred.probs.shape == (3, 3) and pred.sample_probs.shape == (6, 3, 3)
    torch.testing.assert_close(pred.sample_probs.mean(0), pred.probs)
    ref = torch.softmax(mnn.forward_samples(net, x, 6, seed=1), -1)
    torch.testing.assert_close(pred.sample_probs, ref)
    with pytest.raises(ValueError, match="trunk_once"):
        mnn.predict(net, x, 2, trunk_once=True)
    assert not torch.is_grad_enabled() or not pred.probs.requires_grad


def test_state_dict_round_trip():
    torch.manual_seed(0)
    net = mnn.bayesify(small_cnn(), posterior="radial", prior="scale_mixture")
    other = mnn.bayesify(small_cnn(), posterior="radial", prior="scale_mixture")
    other.load_state_dict(net.state_dict())
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(mnn.forward_samples(net, x, 3, seed=0), mnn.forward_samples(other, x, 3, seed=0))
    assert not any("eps" in k for k in net.state_dict())


@pytest.mark.parametrize("estimator, flags", [("reparameterization", (False, False)),
                                              ("local_reparameterization", (True, False)),
                                              ("flipout", (False, True))])
def test_the_estimator_option_and_its_deprecated_booleans_build_the_same_layer(estimator, flags):
    torch.manual_seed(0)
    new = mnn.BayesLinear(5, 3, estimator=mnn.Estimator(estimator))
    torch.manual_seed(0)
    with pytest.warns(DeprecationWarning, match="local_reparameterization= and flipout= are deprecated"):
        old = mnn.BayesLinear(5, 3, local_reparameterization=flags[0], flipout=flags[1])
    assert new.estimator == old.estimator == estimator
    assert (new.local_reparameterization, new.flipout) == flags
    x = torch.randn(4, 5)
    assert torch.equal(mnn.forward_samples(new, x, 3, seed=1), mnn.forward_samples(old, x, 3, seed=1))
    assert (f"estimator={estimator}" in repr(new)) == (estimator != "reparameterization")
    net = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    converted = mnn.bayesify(net, estimator=estimator)
    assert {m.estimator for m in mnn.bayesian_modules(converted)} == {estimator}


def test_a_posterior_family_s_default_estimator_applies_when_none_is_given():
    assert mnn.BayesLinear(3, 2, posterior="sparse_vd").estimator == "local_reparameterization"
    assert mnn.BayesLinear(3, 2, posterior="sparse_vd", estimator="reparameterization").estimator == \
        "reparameterization"
    assert mnn.BayesLinear(3, 2, posterior="sparse_vd", estimator="flipout").estimator == "flipout"
    assert mnn.BayesLinear(3, 2).estimator == "reparameterization"
