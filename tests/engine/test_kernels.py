"""The Triton kernels against their pure-torch references: on CPU under Triton's interpreter, or compiled on CUDA.

Where they run (``MCGRAPH_KERNEL_DEVICE``, read once at collection):

* ``cpu`` (the default, what CI runs): CPU tensors, the kernels in Triton's interpreter; this
  module sets ``TRITON_INTERPRET=1`` before Triton is first imported.
* ``cuda``: CUDA tensors, the kernels compiled. ``TRITON_INTERPRET`` must be unset (a truthy
  value is a collection error); the module is skipped where ``torch.cuda.is_available()`` is
  false. Run it on its own, since other test modules set ``TRITON_INTERPRET=1`` when imported::

      MCGRAPH_KERNEL_DEVICE=cuda python -m pytest -q tests/engine/test_kernels.py

Seeded draws stay on torch's CPU generator and are moved to the device, so both devices
compare the same numbers; the references run in torch on the kernels' device.

Tiers (STYLE rule 9):

1. exact replay: every kernel against its reference in ``mcgraph.kernels.reference`` fed with
   exactly the noise the kernel draws (``materialize_noise``), over odd sizes and fp32/fp64,
   values and gradients. Tolerances: fp64 rtol 1e-10; fp32 rtol 2e-5 — the kernel sums the M
   samples sequentially, torch pairwise, and the kernel may fuse multiply-adds. The same on
   ``cuda``: the compiled kernels (fma contraction, approximate exp/log) passed them unchanged
   on an H100 (torch 2.11, Triton 3.6).
2. statistics: each noise law against its distribution (Kolmogorov–Smirnov, α = 1e-4 per law),
   and each integrand's Triton estimate against the torch backend's (different streams, same
   distribution): |difference| < 5 standard errors (two-sided false alarm 6e-7 per check).
3. graph size: independent of M.
4. the kernels compile for CUDA: Triton's front end run in a subprocess without the interpreter
   (on ``cuda`` the module itself compiles every kernel it launches, so this check is skipped).

Sizes stay small (P ≤ ~1000, M ≤ ~64): every interpreted launch runs in Python.
"""

from __future__ import annotations

import os

#: Where the kernels' inputs live: ``"cpu"`` (interpreted, the default) or ``"cuda"`` (compiled).
DEVICE = os.environ.get("MCGRAPH_KERNEL_DEVICE", "").strip().lower() or "cpu"
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"MCGRAPH_KERNEL_DEVICE={os.environ['MCGRAPH_KERNEL_DEVICE']!r}: expected 'cpu' or 'cuda'")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton (and mcgraph.kernels) is first imported
elif os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on"):
    raise ValueError(
        f"MCGRAPH_KERNEL_DEVICE=cuda runs the kernels compiled, but TRITON_INTERPRET="
        f"{os.environ['TRITON_INTERPRET']!r} is set in this process (by the environment, or by a test module "
        f"imported earlier, such as tests/engine/test_backend.py); unset it and run tests/engine/test_kernels.py on its own")

import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import distributions as D  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("MCGRAPH_KERNEL_DEVICE=cuda but torch.cuda.is_available() is False", allow_module_level=True)

import mcgraph as mg  # noqa: E402
from mcgraph import distributions as mgd  # noqa: E402
from mcgraph.kernels import utils as kutils  # noqa: E402

if DEVICE == "cpu" and not kutils.INTERPRETED:  # pragma: no cover - another module imported the kernels compiled
    pytest.skip("mcgraph.kernels was imported without TRITON_INTERPRET=1 in this process", allow_module_level=True)
if DEVICE == "cuda" and kutils.INTERPRETED:  # pragma: no cover - another module imported them interpreted
    pytest.skip("MCGRAPH_KERNEL_DEVICE=cuda, but mcgraph.kernels was imported under TRITON_INTERPRET=1 in this "
                "process; run tests/engine/test_kernels.py on its own without it", allow_module_level=True)

from mcgraph.kernels.fused_elementwise import FormKind, fused_log_prob_expectation  # noqa: E402
from mcgraph.kernels.integrands import LOG_PROBS  # noqa: E402
from mcgraph.kernels.noise_laws import NOISE_LAWS, materialize_noise  # noqa: E402
from mcgraph.kernels.noise_stats import noise_statistics  # noqa: E402
from mcgraph.kernels.softmax_mc import softmax_cross_entropy_mc  # noqa: E402
from mcgraph.kernels.reference import (  # noqa: E402
    log_prob_expectation_reference,
    noise_statistics_reference,
    softmax_cross_entropy_reference,
)

F32, F64 = torch.float32, torch.float64
DTYPES = [F32, F64]
SIZES = [1, 17, 1003]


def assert_near(actual, expected, dtype, what=""):
    rtol = 1e-10 if dtype == F64 else 2e-5
    scale = expected.detach().abs().max().clamp_min(1.0)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * float(scale), msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- noise stream


def test_materialised_rows_are_counter_based():
    full = materialize_noise("normal", (5, 7), 0, 9, seed=3, device=DEVICE)
    assert full.shape == (9, 5, 7) and full.device.type == DEVICE
    torch.testing.assert_close(materialize_noise("normal", (5, 7), 4, 9, seed=3, device=DEVICE), full[4:],
                               rtol=0, atol=0)
    assert not torch.equal(materialize_noise("normal", (5, 7), 0, 9, seed=4, device=DEVICE), full)


def test_offsets_do_not_wrap_at_32_bits():
    # sample i = 4 294 968 of P = 1000 starts at offset 4 294 968 000 > 2^32; its wrapped twin is
    # sample 0, element 704. A 32-bit counter would repeat those draws.
    P, i = 1000, 4_294_968
    far = materialize_noise("uniform", (P,), i, i + 1, seed=11, device=DEVICE)[0]
    near = materialize_noise("uniform", (P,), 0, 1, seed=11, device=DEVICE)[0]
    assert not torch.equal(far[: P - 704], near[704:])


_SCIPY = {"normal": "norm", "laplace": "laplace", "logistic": "logistic", "cauchy": "cauchy",
          "gumbel": "gumbel_r", "uniform": "uniform", "exponential": "expon", "half_normal": "halfnorm",
          "half_cauchy": "halfcauchy", "rayleigh": "rayleigh"}


@pytest.mark.parametrize("name", sorted(NOISE_LAWS))
def test_noise_law_distribution(name):
    stats = pytest.importorskip("scipy.stats")
    if name == "radial":  # ξ = ε/‖ε‖·r over the event: ‖ξ‖ = |r| ~ half-normal, ξ/‖ξ‖ on the sphere
        xi = materialize_noise(name, (50, 8), 0, 20, seed=1, dtype=F64, device=DEVICE, event_ndims=1).cpu()
        norms = xi.norm(dim=-1).flatten()
        assert stats.kstest(norms.numpy(), "halfnorm").pvalue > 1e-4
        first = (xi[..., 0] / xi.norm(dim=-1)).flatten()  # a coordinate of the uniform direction in R^8
        assert stats.kstest(first.numpy(), stats.beta(3.5, 3.5, loc=-1, scale=2).cdf).pvalue > 1e-4
        return
    for dtype in DTYPES:
        xi = materialize_noise(name, (1003,), 0, 4, seed=5, dtype=dtype, device=DEVICE).flatten().double().cpu()
        assert torch.isfinite(xi).all()
        assert stats.kstest(xi.numpy(), _SCIPY[name]).pvalue > 1e-4, (name, dtype)
        if NOISE_LAWS[name].positive:
            assert (xi > 0).all()


# --------------------------------------------------------------------------- noise statistics


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name, keys", [
    ("normal", [(1, 0), (2, 0), (3, 0), (4, 0)]),
    ("exponential", [(1, 0), (-1, 0), (-2, 0), (0, 1), (1, 1), (0, 2)]),
])
def test_noise_statistics_match_reference(name, keys, size, dtype):
    M, seed = 16, 2
    got = noise_statistics(name, (size,), M, seed, keys, dtype, DEVICE)
    want = noise_statistics_reference(materialize_noise(name, (size,), 0, M, seed, dtype, DEVICE), keys)
    for key in keys:
        assert got[key].shape == (size,) and got[key].dtype == dtype and got[key].device.type == DEVICE
        assert_near(got[key], want[key], dtype, f"{name} {key}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_radial_statistics_match_reference(dtype):
    keys, M = [(1, 0), (2, 0), (3, 0)], 8
    got = noise_statistics("radial", (3, 17), M, 4, keys, dtype, DEVICE, event_ndims=1)
    xi = materialize_noise("radial", (3, 17), 0, M, 4, dtype, DEVICE, event_ndims=1)
    want = noise_statistics_reference(xi, keys)
    for key in keys:
        assert_near(got[key], want[key], dtype, f"radial {key}")


def test_noise_statistics_bad_input():
    with pytest.raises(ValueError, match="registered"):
        noise_statistics("nope", (3,), 4, 0, [(1, 0)], device=DEVICE)
    with pytest.raises(ValueError, match="not positive"):
        noise_statistics("normal", (3,), 4, 0, [(0, 1)], device=DEVICE)
    with pytest.raises(ValueError, match="keys"):
        noise_statistics("normal", (3,), 4, 0, [(1, -1)], device=DEVICE)
    with pytest.raises(ValueError, match="num_samples"):
        noise_statistics("normal", (3,), 0, 0, [(1, 0)], device=DEVICE)
    with pytest.raises(TypeError, match="dtype"):
        noise_statistics("normal", (3,), 4, 0, [(1, 0)], torch.int32, DEVICE)


# --------------------------------------------------------------------------- fused elementwise MC


def _t(x, dtype, grad=True):
    return torch.tensor(x, dtype=dtype, device=DEVICE, requires_grad=grad)


# (prior factory, form kind, noise law); priors with positive support get a positive w.
PRIORS = {
    "Normal": (lambda dt: D.Normal(_t(0.3, dt), _t(1.5, dt)), "location_scale", "normal"),
    "Laplace": (lambda dt: D.Laplace(_t(0.1, dt), _t(0.7, dt)), "location_scale", "logistic"),
    "Logistic": (lambda dt: mgd.Logistic(_t(0.1, dt), _t(0.7, dt)), "location_scale", "laplace"),
    "Cauchy": (lambda dt: D.Cauchy(_t(-0.2, dt), _t(0.9, dt)), "location_scale", "normal"),
    "StudentT": (lambda dt: D.StudentT(_t(3.0, dt), _t(0.1, dt), _t(0.7, dt)), "location_scale", "normal"),
    "ScaleMixtureNormal": (lambda dt: mgd.ScaleMixtureNormal(_t(0.3, dt), _t(1.0, dt), _t(0.1, dt), _t(0.05, dt)),
                           "location_scale", "normal"),
    "LogUniform": (lambda dt: mgd.LogUniform(), "location_scale", "normal"),
    "Gamma": (lambda dt: D.Gamma(_t(2.0, dt), _t(1.5, dt)), "exp", "normal"),
    "LogNormal": (lambda dt: D.LogNormal(_t(0.2, dt), _t(0.8, dt)), "scaling", "exponential"),
    "InverseGamma": (lambda dt: D.InverseGamma(_t(3.0, dt), _t(1.5, dt)), "scaling", "half_normal"),
}


def test_every_registered_integrand_is_covered_and_resolves():
    names = {t.__name__ for t in LOG_PROBS.registered()}
    assert names == set(PRIORS)
    for t in LOG_PROBS.registered():
        prior = PRIORS[t.__name__][0](F64)
        entry = LOG_PROBS.lookup(type(prior))
        assert entry is not None and entry.dist_type is t
        assert len(entry.params(prior)) <= 4


def _leaves(*tensors):
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            out[id(t)] = t
    return list(out.values())


def _prior_leaves(prior):
    return _leaves(*[v for v in vars(prior).values() if isinstance(v, torch.Tensor)],
                   *([prior.base_dist.concentration, prior.base_dist.rate] if isinstance(prior, D.InverseGamma)
                     else []),
                   *([prior.base_dist.loc, prior.base_dist.scale] if isinstance(prior, D.LogNormal) else []))


def _posterior(size, dtype, form, seed=0):
    g = torch.Generator().manual_seed(seed)  # drawn on CPU, then moved: the same numbers on every device
    loc = None if form == "scaling" else (0.5 * torch.randn(size, generator=g, dtype=dtype)).to(DEVICE).requires_grad_()
    scale = (0.3 + 0.5 * torch.rand(size, generator=g, dtype=dtype)).to(DEVICE).requires_grad_()
    return loc, scale


def _check_fused(prior, form, noise, size, dtype, M=12, seed=7, event_ndims=0, shape=None):
    loc, scale = _posterior(size, dtype, form)
    leaves = _leaves(loc, scale) + _prior_leaves(prior)
    got = fused_log_prob_expectation(prior, loc, scale, form, M, seed, noise=noise, event_ndims=event_ndims)
    xi = materialize_noise(noise, shape or (size,), 0, M, seed, dtype, DEVICE, event_ndims=event_ndims)
    want = log_prob_expectation_reference(prior, loc, scale, form, xi)
    assert_near(got, want, dtype, "value")
    weights = torch.linspace(0.5, 1.5, got.numel(), dtype=dtype, device=DEVICE).reshape(got.shape)
    g_got = torch.autograd.grad((got * weights).sum(), leaves)
    g_want = torch.autograd.grad((want * weights).sum(), leaves)
    for k, (a, b) in enumerate(zip(g_got, g_want)):
        assert_near(a, b, dtype, f"gradient {k}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(PRIORS))
def test_fused_matches_reference_each_integrand(name, dtype):
    factory, form, noise = PRIORS[name]
    _check_fused(factory(dtype), form, noise, 17, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [1, 1003])
def test_fused_matches_reference_sizes(size, dtype):
    _check_fused(PRIORS["ScaleMixtureNormal"][0](dtype), "location_scale", "normal", size, dtype, M=8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_elementwise_prior_parameters_and_radial_noise(dtype):
    g = torch.Generator().manual_seed(1)  # drawn on CPU, then moved
    prior = D.Normal(torch.randn(3, 17, generator=g, dtype=dtype).to(DEVICE).requires_grad_(),
                     (0.5 + torch.rand(17, generator=g, dtype=dtype)).to(DEVICE).requires_grad_())
    loc = torch.randn(3, 17, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
    scale = (0.2 + torch.rand(3, 1, generator=g, dtype=dtype)).to(DEVICE).requires_grad_()
    leaves = [loc, scale, prior.loc, prior.scale]
    got = fused_log_prob_expectation(prior, loc, scale, "location_scale", 8, 5, noise="radial", event_ndims=1)
    xi = materialize_noise("radial", (3, 17), 0, 8, 5, dtype, DEVICE, event_ndims=1)
    want = log_prob_expectation_reference(prior, loc, scale, "location_scale", xi)
    assert_near(got, want, dtype, "value")
    for a, b in zip(torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves)):
        assert_near(a, b, dtype, "gradient")


def test_fused_independent_prior_sums_its_event():
    prior = D.Independent(D.Laplace(torch.zeros(4, 5, dtype=F64, device=DEVICE),
                                    torch.ones(4, 5, dtype=F64, device=DEVICE)), 1)
    loc, scale = torch.zeros(4, 5, dtype=F64, device=DEVICE), torch.ones(4, 5, dtype=F64, device=DEVICE)
    got = fused_log_prob_expectation(prior, loc, scale, "location_scale", 4, 0)
    base = fused_log_prob_expectation(prior.base_dist, loc, scale, "location_scale", 4, 0)
    assert got.shape == (4,)
    assert_near(got, base.sum(-1), F64)


def test_fused_bad_input():
    # Every case raises while validating, before a launch; the priors built from Python floats
    # (CPU tensors) are never compared with loc/scale's device.
    loc, scale = torch.zeros(3, device=DEVICE), torch.ones(3, device=DEVICE)

    class Unregistered(D.Normal):
        def log_prob(self, value):
            return super().log_prob(value) * 2

    with pytest.raises(NotImplementedError, match="Unregistered"):
        fused_log_prob_expectation(Unregistered(0.0, 1.0), loc, scale, "location_scale", 4, 0)
    with pytest.raises(NotImplementedError, match="HalfNormal"):
        fused_log_prob_expectation(D.HalfNormal(1.0), loc, scale, "location_scale", 4, 0)
    with pytest.raises(ValueError, match="form_kind"):
        fused_log_prob_expectation(D.Normal(0.0, 1.0), loc, scale, "affine", 4, 0)
    with pytest.raises(ValueError, match="loc must be None"):
        fused_log_prob_expectation(D.Normal(0.0, 1.0), loc, scale, FormKind.SCALING, 4, 0, noise="exponential")
    with pytest.raises(ValueError, match="positive"):
        fused_log_prob_expectation(D.Gamma(2.0, 1.0), None, scale, "scaling", 4, 0, noise="normal")
    with pytest.raises(ValueError, match="prior"):
        fused_log_prob_expectation(D.Normal(torch.zeros(4, device=DEVICE), 1.0), loc, scale, "location_scale", 4, 0)
    with pytest.raises(ValueError, match="num_samples"):
        fused_log_prob_expectation(D.Normal(0.0, 1.0), loc, scale, "location_scale", 0, 0)
    with pytest.raises(ValueError, match="seed"):
        fused_log_prob_expectation(D.Normal(0.0, 1.0), loc, scale, "location_scale", 4, -1)


# --------------------------------------------------------------------------- softmax MC


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, K, block_k", [(1, 1, None), (3, 17, None), (2, 1003, None), (2, 37, 16)])
def test_softmax_mc_matches_reference(B, K, block_k, dtype):
    M, seed = 8, 9
    g = torch.Generator().manual_seed(B * K)  # drawn on CPU, then moved
    mean = (2 * torch.randn(B, K, generator=g, dtype=dtype)).to(DEVICE).requires_grad_()
    std = torch.rand(B, K, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
    targets = torch.randint(0, K, (B,), generator=g).to(DEVICE)
    got = softmax_cross_entropy_mc(mean, std, targets, M, seed, block_k=block_k)
    eps = materialize_noise("normal", (B, K), 0, M, seed, dtype, DEVICE)
    want = softmax_cross_entropy_reference(mean, std, targets, eps)
    assert_near(got, want, dtype, "loss")
    w = torch.linspace(0.5, 1.5, B, dtype=dtype, device=DEVICE)
    for a, b in zip(torch.autograd.grad((got * w).sum(), [mean, std]),
                    torch.autograd.grad((want * w).sum(), [mean, std])):
        assert_near(a, b, dtype, "gradient")


def test_softmax_mc_lead_dims_and_no_grad():
    mean, std = torch.randn(2, 3, 5).to(DEVICE), torch.rand(2, 3, 5).to(DEVICE)  # torch's global CPU generator
    targets = torch.randint(0, 5, (2, 3)).to(DEVICE)
    loss = softmax_cross_entropy_mc(mean, std, targets, 4, 0)
    assert loss.shape == (2, 3) and loss.grad_fn is None
    flat = softmax_cross_entropy_mc(mean.reshape(6, 5), std.reshape(6, 5), targets.reshape(6), 4, 0)
    assert_near(loss.reshape(6), flat, F32)


def test_softmax_mc_bad_input():
    mean, std = torch.zeros(2, 3, device=DEVICE), torch.ones(2, 3, device=DEVICE)
    if DEVICE == "cpu":  # the range of class indices is checked on CPU only: on CUDA it would sync the host
        with pytest.raises(ValueError, match="targets"):
            softmax_cross_entropy_mc(mean, std, torch.tensor([0, 3], device=DEVICE), 4, 0)
    with pytest.raises(ValueError, match="targets"):
        softmax_cross_entropy_mc(mean, std, torch.tensor([0], device=DEVICE), 4, 0)
    with pytest.raises(ValueError, match="std_logits"):
        softmax_cross_entropy_mc(mean, torch.ones(3, 3, device=DEVICE), torch.tensor([0, 1], device=DEVICE), 4, 0)
    with pytest.raises(ValueError, match="num_samples"):
        softmax_cross_entropy_mc(mean, std, torch.tensor([0, 1], device=DEVICE), 0, 0)


# --------------------------------------------------------------------------- graph size


def test_graph_size_independent_of_num_samples():
    loc = torch.zeros(100, device=DEVICE, requires_grad=True)
    scale = torch.ones(100, device=DEVICE, requires_grad=True)
    prior = mgd.ScaleMixtureNormal(torch.tensor(0.5, device=DEVICE), 1.0, 0.1)  # the floats follow pi's device

    def fused(m):
        return lambda: fused_log_prob_expectation(prior, loc, scale, "location_scale", m, 0)

    assert mg.graph_size(fused(1)) == mg.graph_size(fused(48))
    mean = torch.zeros(4, 10, device=DEVICE, requires_grad=True)
    std = torch.ones(4, 10, device=DEVICE, requires_grad=True)
    targets = torch.zeros(4, dtype=torch.int64, device=DEVICE)

    def softmax(m):
        return lambda: softmax_cross_entropy_mc(mean, std, targets, m, 0)

    assert mg.graph_size(softmax(1)) == mg.graph_size(softmax(48))


# --------------------------------------------------------------------------- statistical agreement


def _per_sample_dloc(prior, loc, scale, form, w):
    """∂ log p(w_i)/∂loc per sample (the chain through T), for the standard error of the gradient."""
    w = w.detach().requires_grad_()
    (gw,) = torch.autograd.grad(prior.log_prob(w).sum(), w)
    return gw * w.detach() if form == "exp" else gw


@pytest.mark.parametrize("name", sorted(PRIORS))
def test_triton_and_torch_backends_agree_in_distribution(name, monkeypatch):
    """Mean over P iid elements of the M-sample estimate: Triton vs torch (different streams).

    Each side averages P·M iid terms; the difference is ~N(0, 2σ²/(PM)) with σ² the per-sample
    variance, estimated from torch draws. Checked: |Δ| < 5 SE for the value and the loc-gradient
    (scaling forms: the scale-gradient).

    The engine side is pinned to ``MCGRAPH_BACKEND=torch``: under ``auto`` CUDA tensors would
    take the Triton backend too. On CPU, at M·P = 16 000 draws, ``auto`` picks the same
    torch backend and stream, so the numbers there are those of ``auto``.
    """
    monkeypatch.setenv("MCGRAPH_BACKEND", "torch")
    factory, form, noise = PRIORS[name]
    prior = factory(F64)
    P, M = 1000, 16
    loc = None if form == "scaling" else torch.full((P,), 0.2, dtype=F64, device=DEVICE, requires_grad=True)
    scale = torch.full((P,), 0.6, dtype=F64, device=DEVICE, requires_grad=True)
    param = scale if loc is None else loc
    tri = fused_log_prob_expectation(prior, loc, scale, form, M, 123, noise=noise)
    (tri_g,) = torch.autograd.grad(tri.sum(), param)
    q = {"location_scale": {"normal": D.Normal, "logistic": mgd.Logistic, "laplace": D.Laplace},
         "exp": {"normal": D.LogNormal}}.get(form, {}).get(noise)
    if q is not None:
        q = q(loc, scale)
    else:  # scaling: w = scale·ξ with ξ from the named positive law
        q = {"exponential": lambda s: D.Exponential(1 / s), "half_normal": D.HalfNormal}[noise](scale)
    ref = mg.expectation(prior.log_prob, q, M, seed=321)
    (ref_g,) = torch.autograd.grad(ref.sum(), param)
    with torch.no_grad():
        w = q.sample((64,))
        values = prior.log_prob(w)
    if loc is None:  # ∂ log p(θ ξ)/∂θ = p'(w)·ξ = p'(w)·w/θ
        grads = _per_sample_dloc(prior, loc, scale, "location_scale", w) * w / scale.detach()
    else:
        grads = _per_sample_dloc(prior, loc, scale, form, w)
    for what, a, b, per_sample in (("value", tri, ref, values), ("gradient", tri_g, ref_g, grads)):
        se = math.sqrt(2 * per_sample.var().item() / (P * M))
        diff = (a.mean() - b.mean()).item()
        assert abs(diff) < 5 * se, f"{name} {what}: Triton {a.mean().item():.5f} vs torch {b.mean().item():.5f}"


# --------------------------------------------------------------------------- compiled front end


_FRONT_END = textwrap.dedent("""
    import itertools, sys
    import triton, triton.language as tl
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.compiler.compiler import make_backend
        from triton._C.libtriton import ir
        target = GPUTarget("cuda", 90, 32)
        backend = make_backend(target)
        options = backend.parse_options({})
    except Exception as e:  # Triton's internal API moved
        print("SKIP", repr(e)); sys.exit(0)
    from mcgraph.kernels import noise_laws as nl, noise_stats as ns, fused_elementwise as fe, softmax_mc as sm
    from mcgraph.kernels.integrands import LOG_PROBS
    assert not nl.draw.__class__.__name__.startswith("Interpreted")

    def front_end(fn, sig, consts):
        sig = {**sig, **{k: "constexpr" for k in consts}}
        context = ir.context(); ir.load_dialects(context); backend.load_dialects(context)
        ASTSource(fn=fn, signature=sig, constexprs=consts).make_ir(
            target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)

    n = 0
    for fp64 in (False, True):
        t, DT = ("fp64", tl.float64) if fp64 else ("fp32", tl.float32)
        ints = lambda *names: {k: "i32" for k in names}
        for law in nl.NOISE_LAWS.values():
            front_end(nl._materialize_kernel, {"out_ptr": f"*{t}", "factor_ptr": f"*{t}", "seed": "i64",
                      **ints("i0", "n", "P", "D")},
                      dict(LAW=law.transform, RADIAL=law.radial, BLOCK=1024, FP64=fp64, DT=DT)); n += 1
        front_end(nl._radial_factor_kernel, {"factor_ptr": f"*{t}", "seed": "i64", **ints("i0", "P", "B", "D")},
                  dict(BLOCK_B=4, BLOCK_D=256, FP64=fp64, DT=DT)); n += 1
        front_end(ns._noise_stats_kernel, {"out_ptr": f"*{t}", "a_ptr": "*i32", "j_ptr": "*i32",
                  "factor_ptr": f"*{t}", "seed": "i64", **ints("P", "M", "D")},
                  dict(NK=3, NK_PAD=4, A_POS=2, A_NEG=1, J_MAX=1, LAW=nl.exponential_transform, RADIAL=True,
                       BLOCK=256, FP64=fp64, DT=DT)); n += 1
        ptrs = ["value_ptr", "dloc_ptr", "dscale_ptr", "dparam_ptr", "loc_ptr", "scale_ptr", "p0_ptr", "p1_ptr",
                "p2_ptr", "p3_ptr", "factor_ptr"]
        for entry, (form, scalar, need) in itertools.product(
                [LOG_PROBS.lookup(c) for c in LOG_PROBS.registered()],
                [(0, 0, (True, True, 15)), (1, 0b111111, (False, True, 0)), (2, 0b000010, (False, False, 5))]):
            front_end(fe._fused_log_prob_kernel, {**{p: f"*{t}" for p in ptrs}, "seed": "i64", **ints("P", "M", "D")},
                      dict(FN=entry.device_fn, LAW=nl.normal_transform, RADIAL=form == 0, FORM=form, SCALAR=scalar,
                           NEED_LOC=need[0], NEED_SCALE=need[1], NEED_P=need[2], BLOCK=1024, FP64=fp64, DT=DT)); n += 1
        for single, grad in itertools.product((True, False), (True, False)):
            front_end(sm._softmax_mc_kernel, {"loss_ptr": f"*{t}", "dmean_ptr": f"*{t}", "dstd_ptr": f"*{t}",
                      "mean_ptr": f"*{t}", "std_ptr": f"*{t}", "target_ptr": "*i64", "seed": "i64",
                      **ints("B", "K", "M")},
                      dict(NEED_GRAD=grad, SINGLE=single, BLOCK_K=1024, FP64=fp64, DT=DT)); n += 1
    print("OK", n)
""")


@pytest.mark.skipif(DEVICE == "cuda", reason="MCGRAPH_KERNEL_DEVICE=cuda: this module compiles every kernel it "
                                            "launches, which covers the front end")
def test_kernels_pass_triton_front_end_for_cuda():
    """Every kernel × dtype × integrand × option combination lowers to Triton IR for sm_90 (no GPU needed).

    The interpreter is lenient about types that the compiler rejects (loop-carried dtypes,
    constexpr misuse); this runs the compiler's front end in a process without TRITON_INTERPRET.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", _FRONT_END], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if proc.stdout.startswith("SKIP"):
        pytest.skip(f"Triton's compiler API differs: {proc.stdout.strip()}")
    assert proc.stdout.startswith("OK"), proc.stdout


@pytest.mark.skipif(DEVICE == "cuda", reason="gloo's all-reduce is the CPU's; the Triton path is the same Python")
def test_a_shard_reads_the_triton_stream_by_window(tmp_path, monkeypatch):
    """Under a process group each rank's collapsed statistics read its window of the Triton stream (rows
    materialised, summed, all-reduced) instead of the whole-M kernel: the stream object must serve that path
    to its end (``release`` included), and the value is the one process's. A one-rank group's shard, passed
    as the enclosing call's, runs the split path in this process."""
    import torch.distributed as dist

    from mcgraph.engine.distributed import SampleShard

    monkeypatch.setenv("MCGRAPH_BACKEND", "triton")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        loc = torch.linspace(-1, 1, 7, dtype=F64, device=DEVICE).requires_grad_()
        q = D.Normal(loc, torch.full((7,), 0.4, dtype=F64, device=DEVICE))
        fn = lambda w: (w - 0.5) ** 3  # noqa: E731
        whole = mg.expectation(fn, q, 5, seed=11, method="collapsed")
        split = mg.expectation(fn, q, 5, seed=11, method="collapsed", process_group=SampleShard(dist.group.WORLD))
        torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)
        (g_whole,) = torch.autograd.grad(whole.sum(), loc)
        (g_split,) = torch.autograd.grad(split.sum(), loc)
        torch.testing.assert_close(g_split, g_whole, rtol=1e-12, atol=1e-12)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(DEVICE == "cuda", reason="the torch backend's reference value is computed on the CPU")
def test_auto_kl_is_exact_on_the_triton_backend_where_it_is_on_the_cpu(monkeypatch):
    """Radial ‖ Normal under ``"auto"``: torch has no rule, but log p is a polynomial, so the engine takes
    E_q[log p] exactly and q's entropy in closed form. The Triton backend takes its fused log-density kernel
    only where the engine would sample the whole term (or under ``method="fused"``), so the KL there is
    the same exact number for any M and seed, equal to the torch backend's; ``"fused"`` still samples."""
    torch.manual_seed(0)
    loc = torch.randn(4, 5, dtype=F64, device=DEVICE)
    scale = torch.rand(4, 5, dtype=F64, device=DEVICE) + 0.2
    q, p = mgd.Radial(loc, scale), D.Normal(0.0, 1.0)
    monkeypatch.setenv("MCGRAPH_BACKEND", "torch")
    exact = mg.kl_divergence(q, p, 10, seed=0)
    monkeypatch.setenv("MCGRAPH_BACKEND", "triton")
    for M, seed in ((1, 0), (7, 3), (100, 11)):
        torch.testing.assert_close(mg.kl_divergence(q, p, M, seed=seed), exact, rtol=1e-12, atol=1e-12)
    sampled = [mg.kl_divergence(q, p, 7, seed=s, method="fused") for s in (0, 1)]
    assert not torch.allclose(sampled[0], sampled[1])  # the kernel draws: two seeds, two estimates
    assert ((sampled[0] - exact).abs() < 0.5 * exact.abs()).all()  # (an estimate of the same KL)


def test_explain_names_the_triton_log_density_kernel_where_it_runs(monkeypatch):
    """``explain`` says when the Triton kernel computes E_q[log p] (a prior without a polynomial term) and
    says nothing of it where the engine's plan runs instead (a Normal prior under ``"auto"``)."""
    monkeypatch.setenv("MCGRAPH_BACKEND", "triton")
    loc = torch.zeros(6, dtype=F64, device=DEVICE)
    q = D.Normal(loc, torch.full((6,), 0.5, dtype=F64, device=DEVICE))
    mixture = str(mg.explain(q, mgd.ScaleMixtureNormal(0.5, 1.0, 0.01)))  # (no closed form)
    assert "Triton kernel for ScaleMixtureNormal's log-density" in mixture
    wrapped = mgd.ScaleMixtureNormal(0.5, torch.ones(6, dtype=F64, device=DEVICE), 0.01)
    wrapped = str(mg.explain(D.Independent(q, 1), D.Independent(wrapped, 1)))
    assert "Triton kernel for ScaleMixtureNormal's log-density" in wrapped  # the prior's own name, not the wrapper's
    radial = mgd.Radial(loc, torch.full((6,), 0.5, dtype=F64, device=DEVICE))
    normal = str(mg.explain(radial, D.Normal(0.0, 1.0)))
    assert "log-density (the noise drawn in registers" not in normal and "EXACT" in normal
