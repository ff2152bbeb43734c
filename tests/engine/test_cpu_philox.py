"""The compiled CPU Philox noise stream (mcgraph.engine.noise.cpu_philox) and its backend (``MCGRAPH_BACKEND=cpu-philox``).

The library is really built here (one compiler call, about a second; cached in
``TORCH_EXTENSIONS_DIR``). What the tests establish:

* the generator: Philox4x32-10 known-answer vector (Random123), the vectorised rounds
  against the portable loop and against an independent pure-Python implementation;
* the stream equals the Triton backend's stream (same counters, same transforms), law by
  law, when Triton's interpreter is available;
* each law: Kolmogorov–Smirnov against its scipy distribution (fixed seeds; a correct
  sampler fails with probability 1e-3 per test);
* the statistics: equal to the statistics computed from this stream's own rows (tight),
  in agreement with the torch stream within standard errors (|z| < 4.5, false-alarm rate
  < 1e-5 per comparison), independent of the thread count (bit for bit);
* rows reproducible per seed, independent of how they are chunked;
* the same-seed contract on this backend: direct, collapsed, chunked and fused give the
  same value and gradients;
* the selection rule of ``auto`` and ``explain``'s line, and the silent fallback to the
  torch stream when no compiler can be run (a subprocess with ``CXX`` pointing nowhere and
  an empty extension directory).
"""

from __future__ import annotations

import os

import math
import platform
import shutil
import subprocess
import sys

import pytest
import torch
from support.native_fallback import assert_runs_without_compiler
from support.paths import ROOT
from torch import distributions as D

import mcgraph as mg
from mcgraph.engine.noise import backends as backend, cpu_philox
from mcgraph import distributions as mgd
from mcgraph.engine.noise.statistics import noise_statistics

stats = pytest.importorskip("scipy.stats")

F64 = torch.float64


@pytest.fixture(scope="module", autouse=True)
def built():
    if shutil.which(cpu_philox.compiler()) is None:  # pragma: no cover - CI has g++
        pytest.skip(f"no C++ compiler ({cpu_philox.compiler()!r}) on this machine")
    lib = cpu_philox.extension()
    assert lib is not None, cpu_philox.unavailable_reason()
    return lib


# --------------------------------------------------------------------------- the generator


def _philox_reference(c, k):
    """Philox4x32-10 (Salmon et al. 2011), in Python integers: the definition the C++ must equal."""
    c, (k0, k1) = list(c), k
    m = 0xFFFFFFFF
    for _ in range(10):
        p0, p2 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p2 >> 32) ^ c[1] ^ k0) & m, p2 & m, ((p0 >> 32) ^ c[3] ^ k1) & m, p0 & m]
        k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
    return c


def test_philox_known_answer():
    # Random123's kat_vectors: philox4x32_10, counter 0, key 0.
    words = cpu_philox.philox_words(0, 0)
    assert [int(w) for w in words[0, :, 0]] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@pytest.mark.parametrize("seed, offset", [(0, 0), (123456789, 2**32 - 7), (2**63 - 1, 2**40 + 3)])
def test_philox_vector_rounds_equal_reference(seed, offset):
    words = cpu_philox.philox_words(seed, offset)
    assert torch.equal(words[0], words[1]), "vector rounds and portable loop differ"
    key = (seed & 0xFFFFFFFF, seed >> 32)
    for lane in (0, 1, 6, 7, cpu_philox.LANES - 1):  # 6, 7 straddle the 2^32 carry for the second case
        off = offset + lane
        expected = _philox_reference((off & 0xFFFFFFFF, off >> 32, 0, 0), key)
        assert [int(w) for w in words[0, :, lane]] == expected, f"lane {lane}"


# --------------------------------------------------------------------------- the laws

SCIPY = {"normal": stats.norm, "laplace": stats.laplace, "logistic": stats.logistic, "cauchy": stats.cauchy,
         "gumbel": stats.gumbel_r, "uniform": stats.uniform, "exponential": stats.expon,
         "half_normal": stats.halfnorm, "half_cauchy": stats.halfcauchy, "rayleigh": stats.rayleigh}


def test_every_law_has_a_reference():
    assert set(SCIPY) == set(cpu_philox.LAWS)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("law", sorted(cpu_philox.LAWS))
def test_law_ks(law, dtype):
    # 20 000 draws spread over rows and elements (P = 37: no multiple of the vector width).
    xi = cpu_philox.rows(law, (37,), 3, 3 + 541, seed=20240601, dtype=dtype)
    assert xi.dtype == dtype and xi.shape == (541, 37)
    assert torch.isfinite(xi).all()
    p = stats.kstest(xi.double().flatten().numpy(), SCIPY[law].cdf).pvalue
    assert p > 1e-3, f"{law} {dtype}: KS p = {p:.2e}"


def test_normal_ks_per_element_and_across_samples():
    # Each element's stream and each sample's draw are N(0, 1) on their own (no lane pattern).
    xi = cpu_philox.rows("normal", (64,), 0, 2000, seed=5)
    assert stats.kstest(xi[:, 17].double().numpy(), "norm").pvalue > 1e-3
    assert stats.kstest(xi[:, 63].double().numpy(), "norm").pvalue > 1e-3
    assert stats.kstest(xi[:64].flatten().double().numpy(), "norm").pvalue > 1e-3
    lag = torch.corrcoef(torch.stack([xi[:, :-1].flatten(), xi[:, 1:].flatten()]))[0, 1]
    assert abs(float(lag)) < 4.5 / math.sqrt(xi[:, 1:].numel()), "neighbouring elements correlate"


def _triton_interpreted():
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover
        return False
    from mcgraph.kernels import utils

    return utils.INTERPRETED


@pytest.mark.parametrize("dtype, rtol", [(F64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("law", sorted(cpu_philox.LAWS))
def test_rows_equal_triton_stream(law, dtype, rtol):
    if not _triton_interpreted():  # pragma: no cover
        pytest.skip("Triton's interpreter is not available in this process")
    from mcgraph.kernels.noise_laws import materialize_noise

    ours = cpu_philox.rows(law, (5, 9), 2, 10, seed=77, dtype=dtype)
    theirs = materialize_noise(law, (5, 9), 2, 10, 77, dtype, "cpu")
    if "cauchy" in law:  # tan near its poles amplifies the transforms' rounding: compare away from them
        keep = theirs.abs() < 50
        ours, theirs = ours[keep], theirs[keep]
    torch.testing.assert_close(ours, theirs, rtol=rtol, atol=rtol)


def test_statistics_equal_triton_statistics():
    if not _triton_interpreted():  # pragma: no cover
        pytest.skip("Triton's interpreter is not available in this process")
    from mcgraph.kernels.noise_stats import noise_statistics as triton_statistics

    keys = [(1, 0), (2, 0), (-1, 0), (1, 1), (0, 2)]
    ours = cpu_philox.statistics("exponential", (6, 5), 300, 11, keys, F64)
    theirs = triton_statistics("exponential", (6, 5), 300, 11, keys, F64, "cpu")
    for k in keys:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-11, atol=1e-11, msg=lambda m: f"{k}: {m}")


# --------------------------------------------------------------------------- the statistics


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 2e-5), (F64, 1e-12)])
@pytest.mark.parametrize("law, keys", [
    ("normal", [(1, 0), (2, 0), (3, 0), (4, 0)]),
    ("normal", [(2, 0), (4, 0)]),  # not the consecutive-powers fast path
    ("laplace", [(0, 0), (1, 0), (2, 0)]),
    ("exponential", [(1, 0), (-1, 0), (1, 1), (0, 1), (2, 2)]),
    ("rayleigh", [(-2, 0), (0, 1), (3, 0)]),
])
def test_statistics_equal_statistics_of_own_rows(law, keys, dtype, rtol):
    # M = 1000 and P = 37: several sample segments and a partial vector tile.
    M, shape, seed = 1000, (37,), 4321
    fast = cpu_philox.statistics(law, shape, M, seed, keys, dtype)
    stream = cpu_philox.PhiloxCPUStream(law, shape, M, seed, dtype)
    slow = noise_statistics(stream, tuple(sorted(set(keys))), 128, F64)
    for k in keys:
        assert fast[k].dtype == dtype and fast[k].shape == shape
        ref = torch.ones(shape, dtype=F64) if k == (0, 0) else slow[k]
        torch.testing.assert_close(fast[k].double(), ref, rtol=rtol, atol=rtol, msg=lambda m: f"{k}: {m}")


def test_statistics_do_not_depend_on_thread_count():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_philox.statistics("normal", (3, 50), 5000, 9, [(1, 0), (2, 0)])
        rows_one = cpu_philox.rows("normal", (3, 50), 0, 64, 9)
        torch.set_num_threads(2)
        two = cpu_philox.statistics("normal", (3, 50), 5000, 9, [(1, 0), (2, 0)])
        rows_two = cpu_philox.rows("normal", (3, 50), 0, 64, 9)
    finally:
        torch.set_num_threads(before)
    for k in one:
        assert torch.equal(one[k], two[k]), k
    assert torch.equal(rows_one, rows_two)


@pytest.mark.parametrize("law, keys", [("normal", [(1, 0), (2, 0), (4, 0)]), ("laplace", [(1, 0), (2, 0)]),
                                       ("uniform", [(1, 0), (-1, 0), (0, 1)]),
                                       ("exponential", [(1, 0), (2, 0), (1, 1)])])
def test_statistics_agree_with_torch_stream(law, keys, monkeypatch):
    # Pooled over P elements, t̄ of each stream is a mean of M·P iid terms: the two means differ by a
    # N(0, s_a² + s_b²) amount, s² the per-stream variance estimated from the element-wise statistics.
    M, P = 400, 500
    zeros = torch.zeros(P, dtype=F64)
    q = {"normal": D.Normal(zeros, 1.0), "laplace": D.Laplace(zeros, 1.0), "uniform": D.Uniform(zeros, 1.0),
         "exponential": D.Exponential(zeros + 1)}[law]
    form = mg.family_of(q)
    assert backend.cpu_philox_law(form) == law
    ours = cpu_philox.statistics(law, (P,), M, 2024, keys, F64)
    from mcgraph.engine.estimators.sampling import stream_for

    monkeypatch.setenv(backend.ENV_VAR, "torch")
    theirs = noise_statistics(stream_for(form, 2024, M), tuple(sorted(keys)), M, F64)
    for k in keys:
        a, b = ours[k], theirs[k]
        se = math.sqrt((a.var() + b.var()) / P)
        z = float(a.mean() - b.mean()) / se
        assert abs(z) < 4.5, f"{law} {k}: z = {z:.2f}"


# --------------------------------------------------------------------------- the stream


def test_rows_reproducible_and_chunk_independent():
    whole = cpu_philox.rows("normal", (4, 3), 0, 50, seed=8)
    assert torch.equal(whole, cpu_philox.rows("normal", (4, 3), 0, 50, seed=8))
    assert not torch.equal(whole, cpu_philox.rows("normal", (4, 3), 0, 50, seed=9))
    stream = cpu_philox.PhiloxCPUStream("normal", (4, 3), 50, 8, torch.float32)
    for chunk in (1, 7, 50):
        parts = [rows for _, _, rows in stream.chunks(chunk)]
        assert torch.equal(torch.cat(parts), whole), chunk
    assert torch.equal(stream.rows(13, 29), whole[13:29])
    # sample i of element j depends on (seed, i·P + j) only: a shorter stream is a prefix
    shorter = cpu_philox.PhiloxCPUStream("normal", (4, 3), 20, 8, torch.float32)
    assert torch.equal(shorter.rows(0, 20), whole[:20])


def test_half_precision_rows_are_rounded_float32_rows():
    full = cpu_philox.rows("normal", (33,), 0, 10, seed=1)
    assert torch.equal(cpu_philox.rows("normal", (33,), 0, 10, seed=1, dtype=torch.bfloat16), full.bfloat16())


def test_bad_arguments():
    with pytest.raises(ValueError, match="noise"):
        cpu_philox.rows("student_t", (3,), 0, 2, 0)
    with pytest.raises(ValueError, match="start, stop"):
        cpu_philox.rows("normal", (3,), 4, 2, 0)
    with pytest.raises(ValueError, match="seed"):
        cpu_philox.rows("normal", (3,), 0, 2, -1)
    with pytest.raises(TypeError, match="dtype"):
        cpu_philox.rows("normal", (3,), 0, 2, 0, dtype=torch.int32)
    with pytest.raises(ValueError, match="not positive"):
        cpu_philox.statistics("normal", (3,), 10, 0, [(1, 1)])
    with pytest.raises(ValueError, match="num_samples"):
        cpu_philox.statistics("normal", (3,), 0, 0, [(1, 0)])


# --------------------------------------------------------------------------- the backend


@pytest.fixture
def philox_backend(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "cpu-philox")


def _value_and_grads(fn, make_q, M, method, chunk=None):
    mu = torch.linspace(-1.0, 1.0, 40, dtype=F64).reshape(8, 5).requires_grad_()
    rho = torch.linspace(-1.0, 0.5, 40, dtype=F64).reshape(8, 5).requires_grad_()
    value = mg.expectation(fn, make_q(mu, torch.nn.functional.softplus(rho)), M, seed=31, method=method,
                           chunk_size=chunk).sum()
    return value.detach(), torch.autograd.grad(value, [mu, rho])


@pytest.mark.parametrize("name, fn, make_q, methods", [
    ("cubic", lambda w: (w - 1) ** 3 + 0.5 * w ** 2, D.Normal, ("collapsed", "fused", "chunked")),
    ("scale-mixture", mgd.ScaleMixtureNormal(*[torch.tensor(a, dtype=F64) for a in (0.3, 1.0, 0.1)]).log_prob,
     D.Normal, ("fused", "chunked")),
    ("laplace-q", lambda w: w ** 2 - w, D.Laplace, ("collapsed", "fused", "chunked")),
])
def test_same_seed_same_value_on_cpu_philox(philox_backend, name, fn, make_q, methods):
    M = 300
    q = make_q(torch.zeros(8, 5, dtype=F64), torch.ones(8, 5, dtype=F64))
    assert backend.stream_kind(mg.family_of(q), M) == "cpu-philox"
    ref_v, ref_g = _value_and_grads(fn, make_q, M, "direct")
    for method in methods:
        for chunk in (None, 7):
            v, g = _value_and_grads(fn, make_q, M, method, chunk)
            what = f"{name} {method} chunk={chunk}"
            torch.testing.assert_close(v, ref_v, rtol=1e-9, atol=1e-9, msg=lambda m: f"{what}: {m}")
            for a, b in zip(g, ref_g):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"{what}: {m}")


def test_direct_reads_the_philox_rows(philox_backend):
    q = D.Normal(torch.full((6,), 0.5, dtype=F64), 2.0)
    value = mg.expectation(lambda w: w, q, 10, seed=4, method="direct")
    xi = cpu_philox.rows("normal", (6,), 0, 10, 4, F64)
    torch.testing.assert_close(value, (0.5 + 2.0 * xi).mean(0), rtol=1e-14, atol=1e-14)


def test_kl_divergence_same_seed_across_methods(philox_backend):
    mu = torch.randn(300, dtype=F64, requires_grad=True)
    q, p = D.Normal(mu, 0.3), D.Laplace(torch.zeros((), dtype=F64), 1.0)
    ref = mg.kl_divergence(q, p, 200, seed=5, method="direct").sum()
    for method in ("monte-carlo", "fused", "chunked"):  # the sampling methods ("auto" is the closed form)
        torch.testing.assert_close(mg.kl_divergence(q, p, 200, seed=5, method=method).sum(), ref,
                                   rtol=1e-9, atol=1e-9)


def test_auto_selects_by_work_and_law(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    small = mg.family_of(D.Normal(torch.zeros(10), 1.0))
    assert backend.stream_kind(small, 100) == "torch"
    assert backend.noise_stream(small, 0, 100) is None
    threshold = backend.CPU_PHILOX_AUTO_MIN_DRAWS
    at = -(-threshold // 10)  # the first M with M·P ≥ threshold
    assert backend.stream_kind(small, at - 1) == "torch"
    assert backend.stream_kind(small, at) == "cpu-philox"
    assert isinstance(backend.noise_stream(small, 0, at), cpu_philox.PhiloxCPUStream)
    # laws the compiled stream does not draw, and GenericForms, keep the torch stream at any M
    gamma = mg.family_of(D.Gamma(torch.full((10,), 2.0), 1.0))
    assert backend.stream_kind(gamma, threshold) == "torch"
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    assert backend.stream_kind(small, threshold) == "torch"
    monkeypatch.setenv(backend.ENV_VAR, "cpu-philox")
    assert backend.stream_kind(small, 1) == "cpu-philox"
    assert backend.backend_for(torch.zeros(2)) == "torch"  # the engine stays torch's; only the noise changes


def test_explain_names_the_stream(monkeypatch):
    q = D.Normal(torch.zeros(3), 1.0)
    monkeypatch.setenv(backend.ENV_VAR, "cpu-philox")
    assert "compiled CPU Philox4x32-10" in str(mg.explain(lambda w: w ** 2, q))
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    assert "noise stream: torch's generator" in str(mg.explain(lambda w: w ** 2, q))
    monkeypatch.delenv(backend.ENV_VAR)
    assert f"when M·P ≥ {backend.CPU_PHILOX_AUTO_MIN_DRAWS}" in str(mg.explain(lambda w: w ** 2, q))


_FALLBACK = r"""
import os, torch, mcgraph as mg
from torch import distributions as D
from mcgraph.engine.noise import backends as backend, cpu_philox
q = D.Normal(torch.linspace(-1, 1, 20, dtype=torch.float64), 0.5)
os.environ["MCGRAPH_BACKEND"] = "cpu-philox"
fell_back = mg.expectation(lambda w: w ** 2, q, 50, seed=3, method="collapsed")
kind = backend.stream_kind(mg.family_of(q), 50)
text = str(mg.explain(lambda w: w ** 2, q))
os.environ["MCGRAPH_BACKEND"] = "torch"
torch_value = mg.expectation(lambda w: w ** 2, q, 50, seed=3, method="collapsed")
assert kind == "torch", kind
assert cpu_philox.extension() is None and "no-such-compiler" in cpu_philox.unavailable_reason()
assert not cpu_philox.build_path().exists()
assert torch.equal(fell_back, torch_value)
assert "compiled CPU Philox stream is unavailable" in text, text
print("OK")
"""


def test_falls_back_to_torch_stream_without_compiler(tmp_path):
    assert_runs_without_compiler(tmp_path, _FALLBACK)


def test_import_and_small_calls_build_nothing(tmp_path):
    code = ("import os, torch, mcgraph as mg\n"
            "from mcgraph.engine.noise import cpu_philox\n"
            "q = torch.distributions.Normal(torch.zeros(5), 1.0)\n"
            "mg.expectation(lambda w: w ** 2, q, 100, seed=0)\n"
            "print(mg.explain(lambda w: w ** 2, q))\n"
            "assert not cpu_philox.built() and cpu_philox.unavailable_reason() is None\n"
            "assert not os.path.exists(os.environ['TORCH_EXTENSIONS_DIR'])\n"
            "print('OK')\n")
    env = {k: v for k, v in os.environ.items() if k != backend.ENV_VAR}
    env.update(TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 instruction-set flags")
def test_instruction_set_paths_draw_identical_noise(tmp_path):
    # The AVX-512, AVX2 and portable builds of the source must draw the same ξ bit for bit (IEEE
    # operations in the same order, explicit FMAs): a cache built on another CPU never changes numbers.
    laws = sorted(cpu_philox.LAWS)
    ref = {(law, dt): cpu_philox.rows(law, (45,), 5, 45, 3, dt) for law in laws for dt in (torch.float32, F64)}
    for name, extra in {"avx2": ["-mno-avx512f"], "portable": ["-mno-avx512f", "-mno-avx2"]}.items():
        path = tmp_path / f"{name}.so"
        cpu_philox._build(path, [*cpu_philox._FLAGS, *extra])
        lib = cpu_philox._load(path)
        if name == "portable" or "avx2" in cpu_philox._cpu_flags().split():
            assert lib.mcgraph_philox_isa().decode() == name
        words = torch.zeros(8 * cpu_philox.LANES, dtype=torch.int32)
        lib.mcgraph_philox_words(99, 2**32 - 9, words.data_ptr())
        assert torch.equal(words[: 4 * cpu_philox.LANES], words[4 * cpu_philox.LANES:]), name
        for (law, dt), expected in ref.items():
            assert torch.equal(cpu_philox.rows(law, (45,), 5, 45, 3, dt, _lib=lib), expected), (name, law, dt)


# --------------------------------------------------------------------------- Radial rows


def test_radial_rows_unit_directions_and_normal_radius():
    # ξ = ε/‖ε‖·r: each event of ξ has norm |r|, ξ/|r| has unit norm, and r = ±‖ξ‖ is N(0, 1)
    # (sign(r) is not seen by ‖ξ‖: |r| is tested against the half-normal, KS, false-alarm rate 1e-3).
    xi = cpu_philox.rows("radial", (50, 4, 6), 0, 120, seed=9, dtype=F64, event_ndims=2)
    eps = cpu_philox.rows("normal", (50, 4, 6), 0, 120, seed=9, dtype=F64)
    radius = xi.flatten(2).norm(dim=-1)  # (120, 50) = |r|
    direction = xi.flatten(2) / radius.unsqueeze(-1)
    torch.testing.assert_close(direction.norm(dim=-1), torch.ones(120, 50, dtype=F64), rtol=1e-12, atol=0)
    # the direction is ε's: ξ is ε scaled by one factor per (sample, batch element)
    unit_eps = eps.flatten(2) / eps.flatten(2).norm(dim=-1, keepdim=True)
    torch.testing.assert_close(direction.abs(), unit_eps.abs(), rtol=1e-12, atol=1e-12)
    signed = (xi.flatten(2) / unit_eps)[..., 0]  # r with its sign
    assert stats.kstest(signed.flatten().numpy(), "norm").pvalue > 1e-3
    assert stats.kstest(radius.flatten().numpy(), "halfnorm").pvalue > 1e-3
    # event_ndims = 0: each element is its own event, ξ = sign(ε)·r
    xi0 = cpu_philox.rows("radial", (200,), 0, 50, seed=3, dtype=F64)
    assert stats.kstest(xi0.flatten().numpy(), "norm").pvalue > 1e-3


@pytest.mark.parametrize("dtype, rtol", [(F64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("shape, event_ndims", [((4, 6, 5), 2), ((4, 6, 5), 1), ((7,), 0), ((3, 5), 2)])
def test_radial_rows_equal_triton_stream(shape, event_ndims, dtype, rtol):
    if not _triton_interpreted():  # pragma: no cover
        pytest.skip("Triton's interpreter is not available in this process")
    from mcgraph.kernels.noise_laws import materialize_noise

    ours = cpu_philox.rows("radial", shape, 2, 10, seed=77, dtype=dtype, event_ndims=event_ndims)
    theirs = materialize_noise("radial", shape, 2, 10, 77, dtype, "cpu", event_ndims=event_ndims)
    torch.testing.assert_close(ours, theirs, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype, rtol", [(F64, 1e-14), (torch.float32, 1e-6)])
@pytest.mark.parametrize("shape, event_ndims", [((4, 6, 5), 2), ((3, 64), 1), ((4, 6, 5), 1), ((7,), 0),
                                                ((1 << 18,), 1)])
def test_radial_rows_are_normal_rows_scaled_by_radius_over_norm(shape, event_ndims, dtype, rtol):
    """ξ = ε·r/‖ε‖ with ε the normal rows and r the tag-1 radii of the same counters, ‖ε‖ here in float64
    by torch, whichever way the library sums the norms: while drawing (one event per draw; events of
    whole tiles) or from the rows (events straddling tiles). 8 rows of 2¹⁸: the rows drawn with their
    norms are written by streaming stores (2²¹ elements and more)."""
    n, event = 8, math.prod(shape[len(shape) - event_ndims:]) if event_ndims else 1
    batch = math.prod(shape) // event
    eps = cpu_philox.rows("normal", shape, 3, 3 + n, seed=8, dtype=dtype).double().reshape(n, batch, event)
    radius = torch.empty((n, batch), dtype=dtype)
    assert cpu_philox._module().mcgraph_philox_radius(batch, 3, 3 + n, 8, dtype == F64, radius.data_ptr(), 1) == 0
    expected = eps * (radius.double() / eps.norm(dim=-1)).unsqueeze(-1)
    xi = cpu_philox.rows("radial", shape, 3, 3 + n, seed=8, dtype=dtype, event_ndims=event_ndims)
    torch.testing.assert_close(xi.double().reshape(n, batch, event), expected, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("threads", [1, 2])
def test_radial_rows_chunk_and_thread_independent_and_checked(threads):
    shape = (3, 40000)  # events long enough for torch to split a reduction over them across threads
    whole = cpu_philox.rows("radial", shape, 0, 30, seed=5, event_ndims=1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        parts = [cpu_philox.rows("radial", shape, s, min(s + 7, 30), seed=5, event_ndims=1)
                 for s in range(0, 30, 7)]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(torch.cat(parts), whole)
    with pytest.raises(ValueError, match="event_ndims"):
        cpu_philox.rows("radial", (3, 8), 0, 2, seed=5, event_ndims=3)
    with pytest.raises(ValueError, match="event_ndims"):
        cpu_philox.rows("normal", (3, 8), 0, 2, seed=5, event_ndims=1)
    with pytest.raises(ValueError, match="noise"):
        cpu_philox.statistics("radial", (3, 8), 10, 5, [(1, 0)])


def _radial_value_and_grads(fn, M, method, chunk=None):
    mu = torch.linspace(-1.0, 1.0, 40, dtype=F64).reshape(8, 5).requires_grad_()
    rho = torch.linspace(-1.0, 0.5, 40, dtype=F64).reshape(8, 5).requires_grad_()
    q = mgd.Radial(mu, torch.nn.functional.softplus(rho))
    value = mg.expectation(fn, q, M, seed=13, method=method, chunk_size=chunk).sum()
    return value.detach(), torch.autograd.grad(value, [mu, rho])


def test_radial_same_seed_same_value_on_cpu_philox(philox_backend):
    M = 200
    q = mgd.Radial(torch.zeros(8, 5, dtype=F64), torch.ones(8, 5, dtype=F64))
    assert backend.stream_kind(mg.family_of(q), M) == "cpu-philox"
    fused = backend.noise_statistics(mg.family_of(q), ((1, 0), (2, 0), (3, 0)), 13, M)
    own = cpu_philox.PhiloxCPUStream("radial", (8, 5), M, 13, F64, event_ndims=2)
    generic = noise_statistics(own, ((1, 0), (2, 0), (3, 0)), 7, F64)  # the rows, reduced in torch
    for key in generic:
        torch.testing.assert_close(fused[key], generic[key], rtol=1e-12, atol=1e-14)
    assert cpu_philox.radial_statistics((8, 5), M, 13, [(1, 1)], F64, event_ndims=2) is None  # log ξ: rows
    stream = backend.noise_stream(mg.family_of(q), 13, M)
    assert isinstance(stream, cpu_philox.PhiloxCPUStream) and stream.event_ndims == 2
    fn = lambda w: (w - 1) ** 3 + 0.5 * w ** 2  # noqa: E731
    ref_v, ref_g = _radial_value_and_grads(fn, M, "direct")
    xi = cpu_philox.rows("radial", (8, 5), 0, M, 13, F64, event_ndims=2)
    mu = torch.linspace(-1.0, 1.0, 40, dtype=F64).reshape(8, 5)
    sigma = torch.nn.functional.softplus(torch.linspace(-1.0, 0.5, 40, dtype=F64).reshape(8, 5))
    torch.testing.assert_close(ref_v, fn(mu + sigma * xi).mean(0).sum(), rtol=1e-12, atol=1e-12)
    for method in ("collapsed", "chunked"):
        for chunk in (None, 7):
            v, g = _radial_value_and_grads(fn, M, method, chunk)
            what = f"radial {method} chunk={chunk}"
            torch.testing.assert_close(v, ref_v, rtol=1e-9, atol=1e-9, msg=lambda m: f"{what}: {m}")
            for a, b in zip(g, ref_g):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("shape, event_ndims", [((5, 12), 1), ((5, 12), 2), ((3, 64), 1)])
@pytest.mark.parametrize("dtype, rtol", [(F64, 1e-12), (torch.float32, 2e-5)])
def test_radial_statistics_equal_statistics_of_own_rows(dtype, rtol, shape, event_ndims):
    # events straddling the 32-element tiles (D = 12: norms summed from the rows), one event per draw
    # with a partial tile (P = 60) and events of two whole tiles (D = 64: norms summed while drawing),
    # several chunks
    keys = ((1, 0), (2, 0), (4, 0))
    fused = cpu_philox.radial_statistics(shape, 90, 21, keys, dtype, event_ndims=event_ndims, chunk_size=16)
    with mg.engine.noise.streams.reuse_noise_blocks():  # the second call draws into the first one's buffer
        pooled = [cpu_philox.radial_statistics(shape, 90, 21, keys, dtype, event_ndims=event_ndims,
                                               chunk_size=16) for _ in range(2)]
    for key in keys:
        assert torch.equal(pooled[0][key], fused[key]) and torch.equal(pooled[1][key], fused[key])
    xi = cpu_philox.rows("radial", shape, 0, 90, 21, dtype, event_ndims=event_ndims).double()
    for a, _ in keys:
        torch.testing.assert_close(fused[(a, 0)], (xi ** a).mean(0).to(dtype), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("noise, keys", [("normal", ((1, 0), (2, 0), (3, 0))),
                                         ("exponential", ((1, 0), (-1, 0), (0, 1), (2, 2)))])
@pytest.mark.parametrize("dtype, rtol", [(F64, 1e-12), (torch.float32, 2e-5)])
def test_law_sums_over_windows_are_the_statistics_times_m(noise, keys, dtype, rtol):
    """The elementwise laws' windowed sums: windows partitioning [0, M) add up to M times the statistics,
    and a window's sums are those of its own rows (its absolute counters)."""
    shape, m = (3, 50), 41
    whole = cpu_philox.statistics(noise, shape, m, 8, keys, dtype)
    parts = [cpu_philox.sums(noise, shape, 8, keys, dtype, start=a, stop=b)
             for a, b in [(0, 20), (20, 20), (20, 41)]]
    for key in keys:
        total = sum(p[key] for p in parts)
        assert total.dtype == F64 and total.shape == (150,)
        torch.testing.assert_close((total / m).reshape(shape).to(dtype), whole[key], rtol=rtol, atol=rtol)
    xi = cpu_philox.rows(noise, shape, 20, 41, 8, dtype).double()
    for a, j in keys:
        torch.testing.assert_close(parts[2][(a, j)], (xi ** a * xi.log() ** j).sum(0).reshape(-1), rtol=rtol,
                                   atol=rtol)
    with pytest.raises(ValueError, match="log"):
        cpu_philox.sums("normal", shape, 8, ((1, 1),), dtype, start=0, stop=3)


@pytest.mark.parametrize("dtype, rtol", [(F64, 1e-12), (torch.float32, 2e-5)])
def test_radial_sums_over_windows_are_the_statistics_times_m(dtype, rtol):
    """A process's window [start, stop) of the Radial stream, summed by the compiled pass: windows that
    partition [0, M) (an empty one included) add up to M times the statistics, and each window's sums are
    those of its own rows."""
    shape, keys, m = (5, 12), ((1, 0), (2, 0), (3, 0)), 37
    whole = cpu_philox.radial_statistics(shape, m, 4, keys, dtype, event_ndims=1)
    cuts = [(0, 11), (11, 11), (11, 30), (30, 37)]
    parts = [cpu_philox.radial_sums(shape, 4, keys, dtype, start=a, stop=b, event_ndims=1, chunk_size=6)
             for a, b in cuts]
    for key in keys:
        total = sum(p[key] for p in parts)
        assert total.dtype == F64 and total.shape == (60,)
        torch.testing.assert_close((total / m).reshape(shape).to(dtype), whole[key], rtol=rtol, atol=rtol)
    xi = cpu_philox.rows("radial", shape, 11, 30, 4, dtype, event_ndims=1).double()
    for a, _ in keys:
        torch.testing.assert_close(parts[2][(a, 0)], (xi ** a).sum(0).reshape(-1), rtol=rtol, atol=rtol)
    assert cpu_philox.radial_sums(shape, 4, ((1, 1),), dtype, start=0, stop=5) is None  # logs: not covered
    with pytest.raises(ValueError, match="start, stop"):
        cpu_philox.radial_sums(shape, 4, keys, dtype, start=5, stop=2)


def test_radial_kl_same_seed_across_methods_and_auto_selection(philox_backend, monkeypatch):
    mu = torch.randn(300, dtype=F64, requires_grad=True)
    q, p = mgd.Radial(mu, torch.full((300,), 0.3, dtype=F64)), D.Normal(torch.zeros((), dtype=F64), 1.0)
    ref = mg.kl_divergence(q, p, 100, seed=5, method="direct").sum()
    for method in ("monte-carlo", "fused", "chunked"):  # sampled ("auto": Radial ‖ Normal is exact)
        torch.testing.assert_close(mg.kl_divergence(q, p, 100, seed=5, method=method).sum(), ref,
                                   rtol=1e-9, atol=1e-9)
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    form = mg.family_of(q)
    at = -(-backend.CPU_PHILOX_AUTO_MIN_DRAWS // 300)
    assert backend.stream_kind(form, at - 1) == "torch"
    assert backend.stream_kind(form, at) == "cpu-philox"
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    assert backend.stream_kind(form, at) == "torch"
