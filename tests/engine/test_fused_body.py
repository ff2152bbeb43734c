"""The fused tier's chunk bodies: forward rules, the compiled body, the autograd fallback, flush-to-zero.

* every registered forward rule against ``torch.func.jvp`` of the op itself (float64);
* the forward-rule body against the direct estimator at the same seed (value and gradients,
  learned prior tensors included), and against the autograd body it replaces;
* the compiled body (``torch.compile``, threshold overridden on small shapes) against the eager
  one, with chunk-size changes that do not recompile; a failing compiler falls back silently;
* ``flush_denormals`` restores the caller's setting.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import distributions as D

import mcgraph as mg
from mcgraph.distributions import ScaleMixtureNormal
from mcgraph.engine.estimators import derivatives, fused_body
from mcgraph.engine.estimators.sampling import samples, stream_for

from support.paths import TESTS
from support.same_noise_tolerances import TOLERANCES, assert_same

F64 = torch.float64


# --------------------------------------------------------------------------- rules against jvp


def _pos(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=g, dtype=F64) * 1.3 + 0.2


def _real(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=F64)


_T = torch.Tensor
#: rule name -> (function, positional args (tensors get tangents), keyword args)
OPS = {
    "abs": (torch.abs, (_real(),), {}), "absolute": (torch.absolute, (_real(),), {}),
    "neg": (torch.neg, (_real(),), {}), "negative": (torch.negative, (_real(),), {}),
    "exp": (torch.exp, (_real(),), {}), "exp2": (torch.exp2, (_real(),), {}),
    "expm1": (torch.expm1, (_real(),), {}), "log": (torch.log, (_pos(),), {}),
    "log2": (torch.log2, (_pos(),), {}), "log10": (torch.log10, (_pos(),), {}),
    "log1p": (torch.log1p, (_pos(),), {}), "sqrt": (torch.sqrt, (_pos(),), {}),
    "rsqrt": (torch.rsqrt, (_pos(),), {}), "square": (torch.square, (_real(),), {}),
    "reciprocal": (torch.reciprocal, (_pos(),), {}), "sin": (torch.sin, (_real(),), {}),
    "cos": (torch.cos, (_real(),), {}), "tan": (torch.tan, (_real(),), {}),
    "tanh": (torch.tanh, (_real(),), {}), "sinh": (torch.sinh, (_real(),), {}),
    "cosh": (torch.cosh, (_real(),), {}), "atan": (torch.atan, (_real(),), {}),
    "sigmoid": (torch.sigmoid, (_real(),), {}), "relu": (torch.relu, (_real(),), {}),
    "erf": (torch.erf, (_real(),), {}), "erfc": (torch.erfc, (_real(),), {}),
    "lgamma": (torch.lgamma, (_pos(),), {}), "digamma": (torch.digamma, (_pos(),), {}),
    "frac": (torch.frac, (_real() * 3,), {}), "add": (torch.add, (_real(), _pos()), {"alpha": 2.0}),
    "radd": (_T.__radd__, (_real(), _pos()), {}), "sub": (torch.sub, (_real(), _pos()), {"alpha": 0.5}),
    "subtract": (torch.subtract, (_real(), _pos()), {}), "rsub": (_T.__rsub__, (_real(), _pos()), {}),
    "mul": (torch.mul, (_real(), _pos()), {}), "multiply": (torch.multiply, (_real(), _pos()), {}),
    "rmul": (_T.__rmul__, (_real(), _pos()), {}), "div": (torch.div, (_real(), _pos()), {}),
    "divide": (torch.divide, (_real(), _pos()), {}),
    "true_divide": (torch.true_divide, (_real(), _pos()), {}),
    "truediv": (_T.__truediv__, (_real(), _pos()), {}),
    "rtruediv": (_T.__rtruediv__, (_pos(), _real()), {}), "pow": (torch.pow, (_pos(), _real()), {}),
    "rpow": (_T.__rpow__, (_real(), _pos()), {}),
    "logaddexp": (torch.logaddexp, (_real(), _real(seed=5)), {}),
    "where": (torch.where, (_real(seed=7) > 0, _real(), _pos()), {}),
    "maximum": (torch.maximum, (_real(), _real(seed=5)), {}),
    "minimum": (torch.minimum, (_real(), _real(seed=5)), {}),
    "clamp": (torch.clamp, (_real(), -0.5, 0.7), {}), "clip": (torch.clip, (_real(), -0.5, 0.7), {}),
    "clamp_min": (torch.clamp_min, (_real(), -0.2), {}), "clamp_max": (torch.clamp_max, (_real(), 0.3), {}),
    "softplus": (torch.nn.functional.softplus, (_real() * 3,), {"beta": 2.0, "threshold": 4.0}),
    "xlogy": (torch.xlogy, (_real(), _pos()), {}), "to": (_T.to, (_real(), F64), {}),
    "float": (_T.float, (_real().float(),), {}), "double": (_T.double, (_real(),), {}),
    "type_as": (_T.type_as, (_real(), _pos()), {}), "half": (_T.half, (_real().half(),), {}),
    "bfloat16": (_T.bfloat16, (_real().bfloat16(),), {}),
}
ZERO_RULES = ("sign", "sgn", "floor", "ceil", "round", "trunc", "lt", "le", "gt", "ge", "eq", "ne", "less",
              "greater", "less_equal", "greater_equal", "not_equal", "logical_and", "logical_or",
              "logical_not", "isfinite", "isnan", "isinf", "heaviside")


def test_every_registered_rule_is_tested():
    assert set(derivatives.DERIVATIVES) == set(OPS) | set(ZERO_RULES)


@pytest.mark.parametrize("name", sorted(OPS))
def test_forward_rule_matches_jvp_of_the_op(name):
    func, args, kwargs = OPS[name]
    tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dtype.is_floating_point]
    g = torch.Generator().manual_seed(3)
    tangents = [torch.randn(args[i].shape, generator=g, dtype=F64).to(args[i].dtype) for i in tensor_pos]

    def f(*xs):
        full = list(args)
        for i, x in zip(tensor_pos, xs):
            full[i] = x
        return func(*full, **kwargs)

    out, expected = torch.func.jvp(f, tuple(args[i] for i in tensor_pos), tuple(tangents))
    rule_tangents = [None] * len(args)
    for i, t in zip(tensor_pos, tangents):
        rule_tangents[i] = t
    got = derivatives.DERIVATIVES[name](tuple(args), kwargs, func(*args, **kwargs), tuple(rule_tangents))
    low_precision = out.dtype in (torch.half, torch.bfloat16)
    tol = dict(rtol=1e-2, atol=1e-2) if low_precision else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got, expected, **tol)
    # one argument at a time: the others carry no tangent
    for k, i in enumerate(tensor_pos):
        only = [None] * len(args)
        only[i] = tangents[k]
        part = derivatives.DERIVATIVES[name](tuple(args), kwargs, out, tuple(only))
        one_tangent = tuple(t if j == i else torch.zeros_like(t) for j, t in zip(tensor_pos, tangents))
        _, exp_part = torch.func.jvp(f, tuple(args[j] for j in tensor_pos), one_tangent)
        torch.testing.assert_close(torch.zeros_like(exp_part) if part is None else part, exp_part, **tol)


@pytest.mark.parametrize("name", ZERO_RULES)
def test_piecewise_constant_ops_have_zero_tangent(name):
    assert derivatives.DERIVATIVES[name]((_real(),), {}, _real(), (torch.ones(6, dtype=F64),)) is None


def test_a_rule_is_one_registration_and_an_op_without_one_is_not_lowered():
    q = D.Normal(torch.zeros(2), torch.ones(2))
    node = mg.explain(lambda w: torch.erfinv(torch.tanh(w)), q).terms[0].node
    assert derivatives.lower(node) is None
    assert "erfinv" in derivatives.missing_rule(node)
    try:
        derivatives.register_derivative("erfinv", lambda args, kw, out, t: derivatives._mul(
            t[0], math.sqrt(math.pi) / 2 * torch.exp(out * out)))
        assert derivatives.lower(node) is not None
    finally:
        del derivatives.DERIVATIVES["erfinv"]


def test_bad_body_mode_is_named(monkeypatch):
    monkeypatch.setenv("MCGRAPH_FUSED_BODY", "fast")
    with pytest.raises(ValueError, match="MCGRAPH_FUSED_BODY"):
        fused_body.body_mode()


# --------------------------------------------------------------------------- same seed as direct


def _scale_mixture(dtype):
    return ScaleMixtureNormal(torch.tensor(0.5, dtype=dtype), torch.tensor(1.0, dtype=dtype),
                              torch.tensor(math.exp(-6.0), dtype=dtype), validate_args=False)


def _learned():
    """A prior with learned parameters: (prior factory, its leaves)."""
    mu = torch.tensor([0.1, -0.2, 0.3], dtype=F64, requires_grad=True)
    log_s = torch.tensor([0.0, 0.2, -0.3], dtype=F64, requires_grad=True)
    return (lambda: D.Normal(mu, log_s.exp())), [mu, log_s]


CASES = {
    "scale-mixture": lambda dtype: (_scale_mixture(dtype).log_prob, D.Normal, []),
    "laplace": lambda dtype: (D.Laplace(torch.tensor(0.0, dtype=dtype),
                                        torch.tensor(1.0, dtype=dtype)).log_prob, D.Normal, []),
    "lognormal-exp": lambda dtype: (lambda w: torch.sigmoid(w) * w.sqrt() + torch.log(w) ** 2 / (1 + w),
                                    D.LogNormal, []),
    "where-clamp-pow": lambda dtype: (lambda w: torch.where(w > 0.1, w.clamp(max=0.8) ** 3, torch.exp(-w * w))
                                      + torch.maximum(w, 0.2 * w), D.Normal, []),
    "learned-prior": lambda dtype: (lambda w, p=_learned(): (p[0]().log_prob(w).sin(), p[1]), D.Normal, None),
}


def _run(case, dtype, method, M=23, chunk=5):
    fn, family, extra = CASES[case](dtype)
    if extra is None:  # the integrand builds its own leaves
        probe = fn(torch.zeros(3, dtype=dtype))
        extra = list(probe[1])
        fn = (lambda f: (lambda w: f(w)[0]))(fn)
    g = torch.Generator().manual_seed(11)
    loc = (torch.randn(3, generator=g, dtype=F64) * 0.3).to(dtype).requires_grad_()
    rho = (torch.randn(3, generator=g, dtype=F64) * 0.2 - 1).to(dtype).requires_grad_()
    q = family(loc, torch.nn.functional.softplus(rho))
    y = mg.expectation(fn, q, M, seed=4, method=method, chunk_size=chunk if method != "direct" else None)
    grads = torch.autograd.grad(y.sum(), [loc, rho] + extra, allow_unused=True)
    return y.detach(), list(grads), fused_body.last_path()


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_rule_body_matches_direct_and_the_autograd_body(case, dtype, monkeypatch):
    ref = _run(case, dtype, "direct")
    got = _run(case, dtype, "fused")
    assert got[2] == "eager"
    rtol, atol = TOLERANCES[dtype]
    assert_same(ref[:2], got[:2], rtol, atol, f"{case}/{dtype}", none_is_zero=True)
    monkeypatch.setenv("MCGRAPH_FUSED_BODY", "autograd")
    old = _run(case, dtype, "fused")
    assert old[2] == "autograd"
    assert_same(old[:2], got[:2], rtol, atol, f"{case}/{dtype} autograd body", none_is_zero=True)


#: ``x`` below is the float32 subnormal 1e-40 with a zero tangent wherever ``relu(w)`` is 0: built from
#: ``relu`` and ``+`` alone, which every CPU ISA computes exactly (torch's vectorised ``softplus`` rounds a
#: subnormal result to 0 with AVX2 kernels and keeps it with AVX-512 ones), so the case is the same on
#: every host. ``1 / x`` overflows to inf: a rule written ``ẋ · (1/x)`` gives 0 · inf = NaN there.
_SUBNORMAL = 1e-40


def _x(w):
    return torch.relu(w) + _SUBNORMAL


@pytest.mark.parametrize("fn", [
    lambda w: torch.exp(2 * torch.log(_x(w))),
    lambda w: torch.sqrt(_x(w)) * 0.0 + torch.log2(_x(w)) * 0.0,
    lambda w: torch.log10(_x(w)) * 0.0,
], ids=["exp-2-log", "sqrt-log2-times-zero", "log10-times-zero"])
def test_forward_rules_divide_where_a_reciprocal_overflows(fn):
    """At ``x`` subnormal with a zero tangent, a rule of the form ``ẋ / g(x)`` divides as autograd does:
    0 / x = 0, where ``ẋ · (1/x)`` would be 0 · inf = NaN; the direct gradient is finite on every host."""
    loc = torch.tensor([-103.14, 0.3], requires_grad=True)
    scale = torch.tensor([1e-6, 1.0], requires_grad=True)
    w = loc.detach()[:1]
    assert 0 < float(_x(w)) < torch.finfo(torch.float32).tiny and math.isinf(float(1 / _x(w)))  # the premise
    ref = mg.expectation(fn, D.Normal(loc, scale), 9, seed=1, method="direct")
    got = mg.expectation(fn, D.Normal(loc, scale), 9, seed=1, method="fused")
    assert fused_body.last_path() == "eager"
    ref_grads = torch.autograd.grad(ref.sum(), [loc, scale])
    got_grads = torch.autograd.grad(got.sum(), [loc, scale])
    assert all(bool(torch.isfinite(g).all()) for g in ref_grads)
    assert all(bool(torch.isfinite(g).all()) for g in got_grads)
    assert_same((ref.detach(), ref_grads), (got.detach(), got_grads), *TOLERANCES[torch.float32], "subnormal")


@pytest.mark.parametrize("fn", [
    lambda w: torch.exp(2 * torch.log(torch.nn.functional.softplus(w))),
    lambda w: torch.sqrt(torch.nn.functional.softplus(w)) * 0.0 + torch.log2(torch.nn.functional.softplus(w)) * 0.0,
], ids=["exp-2-log", "sqrt-log2-times-zero"])
def test_a_subnormal_softplus_gives_the_direct_numbers_on_this_host(fn):
    """``softplus(−103)`` in float32 is the subnormal 1.4e-45 with AVX-512 kernels and 0 with AVX2 or scalar
    ones (then ``log`` gives −inf and the direct gradient is NaN). Whatever this host's torch computes, the
    fused tier gives the same value and gradients as the direct estimator at the same seed, NaN where it is
    NaN and finite where it is finite."""
    loc = torch.tensor([-103.14, 0.3], requires_grad=True)
    scale = torch.tensor([1e-6, 1.0], requires_grad=True)
    ref = mg.expectation(fn, D.Normal(loc, scale), 9, seed=1, method="direct")
    got = mg.expectation(fn, D.Normal(loc, scale), 9, seed=1, method="fused")
    assert fused_body.last_path() == "eager"
    ref_grads = torch.autograd.grad(ref.sum(), [loc, scale])
    got_grads = torch.autograd.grad(got.sum(), [loc, scale])
    for r, g in zip(ref_grads, got_grads):
        assert torch.equal(torch.isfinite(r), torch.isfinite(g)), (r, g)
    assert_same((ref.detach(), ref_grads), (got.detach(), got_grads), *TOLERANCES[torch.float32], "subnormal")


def test_an_op_without_a_rule_runs_the_autograd_body_with_the_same_numbers():
    def q():
        return D.Normal(torch.tensor([0.1, 0.2], dtype=F64, requires_grad=True), torch.ones(2, dtype=F64))

    fn = lambda w: torch.erfinv(torch.tanh(w))  # noqa: E731
    ref = mg.expectation(fn, q(), 17, seed=2, method="direct")
    got = mg.expectation(fn, q(), 17, seed=2, method="fused")
    assert fused_body.last_path() == "autograd"
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
    assert "no forward rule for `erfinv`" in str(mg.explain(fn, q()))


def test_standard_errors_are_fed_by_the_forward_rule_body():
    q = D.Normal(torch.zeros(4, dtype=F64, requires_grad=True), torch.ones(4, dtype=F64))
    est = mg.expectation(lambda w: torch.log1p(w.abs()), q, 40, seed=0, method="fused", return_stderr=True)
    assert fused_body.last_path() == "eager"
    form = mg.family_of(q)
    per = torch.log1p(samples(form, stream_for(form, 0, 40).rows(0, 40)).abs())
    torch.testing.assert_close(est.stderr, per.std(0) / math.sqrt(40))


def test_explain_names_the_chunk_body():
    q = D.Normal(torch.zeros(3), torch.ones(3))
    text = str(mg.explain(lambda w: torch.log1p(w.abs()), q))
    assert "chunk body: value and derivatives by forward rules" in text
    assert "torch.compile" in text


# --------------------------------------------------------------------------- the compiled body


def _kl_learned_scale_mixture(P=48, M=37, chunk=8):
    g = torch.Generator().manual_seed(0)
    loc = (torch.randn(P, generator=g) * 0.1).requires_grad_()
    rho = torch.full((P,), math.log(math.expm1(0.05))).requires_grad_()
    log_pi = torch.tensor(-0.5, requires_grad=True)
    prior = ScaleMixtureNormal(log_pi.exp(), torch.tensor(1.0), torch.tensor(math.exp(-6.0)),
                               validate_args=False)
    q = D.Normal(loc, torch.nn.functional.softplus(rho))
    y = mg.kl_divergence(q, prior, M, seed=1, method="fused", chunk_size=chunk).sum()
    grads = torch.autograd.grad(y, [loc, rho, log_pi])
    return y.detach(), list(grads), fused_body.last_path()


def _needs_compiler():
    # checked when the test runs, not at collection: torch._dynamo imports Triton, which must not be
    # imported before tests/engine/test_backend.py sets TRITON_INTERPRET
    if not fused_body.compiler_available():
        pytest.skip("torch.compile cannot run here")


def test_compiled_body_matches_eager_and_sizes_do_not_recompile(monkeypatch):
    _needs_compiler()
    from torch._dynamo.utils import counters

    monkeypatch.setenv("MCGRAPH_FUSED_BODY", "eager")
    eager = _kl_learned_scale_mixture()
    monkeypatch.setenv("MCGRAPH_FUSED_BODY", "compiled")
    compiled = _kl_learned_scale_mixture()
    assert (eager[2], compiled[2]) == ("eager", "compiled")
    assert_same(eager[:2], compiled[:2], 2e-5, 2e-5, "compiled vs eager body")
    graphs = counters["stats"]["unique_graphs"]
    again = _kl_learned_scale_mixture(M=29, chunk=6)  # other chunk sizes (6 and a last one of 5), other M
    assert again[2] == "compiled" and counters["stats"]["unique_graphs"] == graphs
    other = _kl_learned_scale_mixture(P=40)  # another layer's size: the same compiled body
    assert other[2] == "compiled" and counters["stats"]["unique_graphs"] == graphs
    # the threshold: under it, auto runs the eager body
    monkeypatch.setenv("MCGRAPH_FUSED_BODY", "auto")
    assert _kl_learned_scale_mixture()[2] == "eager"
    monkeypatch.setattr(fused_body, "COMPILE_MIN_ELEMENTS", 48 * 37)
    assert _kl_learned_scale_mixture()[2] == "compiled"


_BODY_IN_A_PROCESS = """
import os, sys
sys.path[:0] = [{here!r}, {tests!r}]
import torch
from test_fused_body import _kl_learned_scale_mixture
value, grads, path = _kl_learned_scale_mixture()
print(path, repr(float(value)), repr(float(grads[0].sum())))
"""


def _capabilities_to_mix() -> tuple[str, str]:
    """Two ``ATEN_CPU_CAPABILITY`` values of different vector widths that this CPU runs."""
    top = torch.backends.cpu.get_cpu_capability().lower()
    if top == "avx512":
        return "avx2", "avx512"
    if top == "avx2":
        return "avx2", "default"
    pytest.skip(f"one vector width here ({top})")


def test_a_body_cached_under_another_cpu_capability_is_compiled_anew(tmp_path):
    """Inductor's cache key leaves out the vector width it compiles for: a second process under another
    ``ATEN_CPU_CAPABILITY`` reading the first one's cached body compiled it with the wrong width (heap
    corruption under AVX-512 after AVX2; a compile error, hence the eager body, under scalar code).
    ``cpp.simdlen`` in the compile options makes the width part of the key."""
    _needs_compiler()
    import os
    import subprocess
    import sys

    code = _BODY_IN_A_PROCESS.format(here=str(Path(__file__).parent), tests=str(TESTS))
    results = []
    for capability in _capabilities_to_mix():
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "MCGRAPH_FUSED_BODY": "compiled",
               "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (capability, proc.stderr[-3000:])
        results.append(proc.stdout.split())
    assert [r[0] for r in results] == ["compiled", "compiled"], results
    for r in results[1:]:
        assert float(r[1]) == pytest.approx(float(results[0][1]), rel=2e-5)
        assert float(r[2]) == pytest.approx(float(results[0][2]), rel=2e-4, abs=1e-6)


def test_default_fused_chunk_takes_two_rows_where_the_body_compiles(monkeypatch):
    # a sample larger than GRAPH_CHUNK_ELEMENTS gets one row per chunk, which the compiled body does not take
    # (it runs eagerly): where that body will run, the fused tier's default chunk is two rows instead
    from mcgraph.engine.estimators import fused, sampling

    q = D.Normal(torch.zeros(48), torch.ones(48))
    sizes = []
    stream_for = fused.stream_for

    def recording(form, seed, num_samples):  # the chunk size the Function asks the real stream for
        stream = stream_for(form, seed, num_samples)
        chunks = stream.chunks
        stream.chunks = lambda size: (sizes.append(size), chunks(size))[1]
        return stream

    def chunk(fn=torch.abs, dist=q, m=37, **kw):
        sizes.clear()
        mg.expectation(fn, dist, m, seed=0, method="fused", **kw)
        return sizes[-1]

    monkeypatch.setattr(fused, "stream_for", recording)
    monkeypatch.setattr(sampling, "GRAPH_CHUNK_ELEMENTS", 40)
    monkeypatch.setattr(fused_body, "COMPILE_MIN_ELEMENTS", 48 * 37)
    monkeypatch.setattr(fused_body, "compiler_available", lambda: True)
    monkeypatch.setattr(fused_body, "_compiled", lambda spec: None)  # the decision only: no compile here
    monkeypatch.setenv("MCGRAPH_FUSED_BODY", "auto")
    assert chunk() == 2
    assert chunk(m=36) == 1  # under the threshold: the eager body, one row
    assert chunk(lambda w: torch.erfinv(torch.tanh(w))) == 1  # no forward-rule program: the autograd chunk
    assert chunk(return_stderr=True) == 1  # per-sample values kept: the eager body
    assert chunk(dist=D.TransformedDistribution(q, [D.ExpTransform(), D.ExpTransform()])) == 1
    assert fused.default_fused_chunk(mg.engine.plan.families.family_of(q), 1, True) == 1
    for mode in ("eager", "autograd"):
        monkeypatch.setenv("MCGRAPH_FUSED_BODY", mode)
        assert chunk() == 1
    monkeypatch.setenv("MCGRAPH_FUSED_BODY", "auto")
    monkeypatch.setattr(sampling, "GRAPH_CHUNK_ELEMENTS", 48 * 3)
    assert chunk() == 3
    monkeypatch.setattr(sampling, "GRAPH_CHUNK_ELEMENTS", 40)
    monkeypatch.setattr(mg.engine.noise.streams, "NOISE_BLOCK_ELEMENTS", 60)  # a noise block of one row
    assert chunk() == 1


def test_large_samples_take_the_compiled_body_by_default(monkeypatch):
    _needs_compiler()
    from mcgraph.engine.estimators import cpu_fused, sampling

    # M = 38: every chunk two rows (last_path() is the last chunk's, and a single last row runs eagerly)
    monkeypatch.setattr(sampling, "GRAPH_CHUNK_ELEMENTS", 40)  # one row per chunk before
    monkeypatch.setattr(fused_body, "COMPILE_MIN_ELEMENTS", 48 * 38)
    monkeypatch.setenv("MCGRAPH_FUSED_BODY", "auto")
    with cpu_fused.disabled():  # the engine's chunks, not the registered prior's compiled loop
        default = _kl_learned_scale_mixture(M=38, chunk=None)
        assert default[2] == "compiled"
        monkeypatch.setenv("MCGRAPH_FUSED_BODY", "eager")
        eager = _kl_learned_scale_mixture(M=38, chunk=None)
    assert eager[2] == "eager"
    assert_same(eager[:2], default[:2], 2e-5, 2e-5, "default chunk, compiled vs eager body")


_VALIDATION_AFTER_COMPILE = """
import torch, mcgraph as mg
from torch import distributions as D
from mcgraph.distributions import ScaleMixtureNormal
from mcgraph.engine.estimators import fused_body
D.Distribution.set_default_validate_args({setting})
q = D.Normal(torch.zeros(48, requires_grad=True), torch.full((48,), 0.05))
mg.expectation(ScaleMixtureNormal(0.5, 1.0, 1e-3).log_prob, q, 37, seed=1, method="fused")  # the engine's body
print(fused_body.last_path(), D.Distribution._validate_args)
"""


@pytest.mark.parametrize("setting", [True, False])
def test_compiling_a_body_keeps_the_distribution_validation_setting(setting):
    """dynamo's first ``torch.compile`` in a process turns torch.distributions' argument validation off
    for the rest of it; compiling a fused body puts the user's setting back (a fresh process: the
    switch happens once per process)."""
    _needs_compiler()
    import os
    import subprocess
    import sys

    env = dict(os.environ, MCGRAPH_FUSED_BODY="compiled")
    done = subprocess.run([sys.executable, "-c", _VALIDATION_AFTER_COMPILE.format(setting=setting)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["compiled", str(setting)]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["laplace", "lognormal-exp", "where-clamp-pow"])
def test_compiled_body_matches_direct(case, monkeypatch):
    _needs_compiler()
    ref = _run(case, torch.float32, "direct", M=40, chunk=7)
    monkeypatch.setenv("MCGRAPH_FUSED_BODY", "compiled")
    got = _run(case, torch.float32, "fused", M=40, chunk=7)
    assert got[2] == "compiled"
    assert_same(ref[:2], got[:2], *TOLERANCES[torch.float32], case, none_is_zero=True)


@pytest.mark.parametrize("where", ["compile", "call"])
def test_a_failing_compiler_falls_back_to_the_eager_body(where, monkeypatch):
    def broken(*args, **kwargs):
        if where == "compile":
            raise RuntimeError("no compiler")
        return lambda *a: (_ for _ in ()).throw(RuntimeError("compiled code failed"))

    monkeypatch.setattr(fused_body, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(fused_body, "compiler_available", lambda: True)
    monkeypatch.setenv("MCGRAPH_FUSED_BODY", "eager")
    eager = _kl_learned_scale_mixture()
    monkeypatch.setenv("MCGRAPH_FUSED_BODY", "compiled")
    fallback = _kl_learned_scale_mixture()
    assert fallback[2] == "eager"
    assert_same(eager[:2], fallback[:2], 0, 0, "fallback")


# --------------------------------------------------------------------------- flush to zero


def test_flush_denormals_restores_the_callers_setting():
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals")
    with fused_body.flush_denormals():
        assert float(tiny * 1.0) == 0.0
    assert float(tiny * 1.0) != 0.0
    torch.set_flush_denormal(True)
    try:
        with fused_body.flush_denormals():
            pass
        assert float(tiny * 1.0) == 0.0  # it was on before: still on
    finally:
        torch.set_flush_denormal(False)


def test_programs_with_the_same_structure_share_a_key():
    """The compile cache's key: tensor values are inputs (a learned prior reuses its compiled body),
    Python literals are part of the program."""
    q = D.Normal(torch.zeros(3), torch.ones(3))

    def key(fn):
        node = next(t.node for t in mg.explain(fn, q).terms if t.node is not None)
        return derivatives.lower(node).key()

    laplace = lambda loc: D.Laplace(torch.tensor(loc), torch.tensor(1.0)).log_prob  # noqa: E731
    assert key(laplace(0.1)) == key(laplace(0.7))
    nan_clamp = lambda: (lambda w: torch.clamp(w, min=float("nan")).exp())  # noqa: E731
    assert key(nan_clamp()) == key(nan_clamp())
    assert key(lambda w: torch.clamp(w, min=0.5).exp()) != key(lambda w: torch.clamp(w, min=0.25).exp())
