"""The plan cache: a reused trace gives what a fresh trace gives, whatever changed between calls.

Every check compares the cached path with the same call made with the cache disabled (a fresh
trace on every call), with the same seed: values and gradients must be equal (bitwise: the
evaluation is the same code on the same numbers).
"""

import functools

import pytest
import torch
from torch.distributions import Laplace, Normal, StudentT

import mcgraph as mg
from mcgraph.engine.plan import cache as plan_cache
from mcgraph.engine.estimators import cpu_fused
from mcgraph.distributions import ScaleMixtureNormal

SCALE = 2.0  # read as a global by an integrand below


@pytest.fixture(autouse=True)
def fresh_cache():
    plan_cache.clear()
    plan_cache.set_enabled(True)
    plan_cache.set_max_size(plan_cache.DEFAULT_MAX_SIZE)
    with cpu_fused.disabled():  # the KLs here are the engine's traced ones, not the compiled CPU loop's
        yield
    plan_cache.clear()
    plan_cache.set_enabled(True)
    plan_cache.set_max_size(plan_cache.DEFAULT_MAX_SIZE)


def _q(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(n, generator=g).requires_grad_()
    rho = (torch.randn(n, generator=g) - 1).requires_grad_()
    return mu, rho


def _run(fn_of, kind, M=64, seed=3, **kw):
    """Value and gradients (w.r.t. q's parameters and ``extra`` tensors) of one engine call."""
    mu, rho = _q()
    q = Normal(mu, torch.nn.functional.softplus(rho))
    fn, extra = fn_of()
    if kind == "kl":  # sampled: the plan cache serves the engine's path (a closed form traces nothing)
        out = mg.kl_divergence(q, fn, M, seed=seed, **{"method": "monte-carlo", **kw})
    else:
        out = mg.expectation(fn, q, M, seed=seed, **kw)
    leaves = [mu, rho] + [t for t in extra if t.requires_grad]
    grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    return out.detach(), grads


def _fresh(fn_of, kind, **kw):
    with plan_cache.disabled():
        return _run(fn_of, kind, **kw)


def _assert_same(a, b):
    (va, ga), (vb, gb) = a, b
    assert torch.equal(va, vb)
    for x, y in zip(ga, gb):
        assert (x is None and y is None) or torch.equal(x, y)


INTEGRANDS = {
    "normal prior (collapsed)": (lambda: (Normal(0.0, 1.5), ()), "kl"),
    "laplace prior (fused)": (lambda: (Laplace(0.2, 0.7), ()), "kl"),
    "scale mixture (fused)": (lambda: (ScaleMixtureNormal(0.5, 1.0, 0.01), ()), "kl"),
    "student-t prior (fused)": (lambda: (StudentT(3.0, 0.0, 1.0), ()), "kl"),
    "polynomial lambda": (lambda: (lambda w: 0.5 * (w - 1.0) ** 2 + w, ()), "e"),
    "reduction then square (chunked)": (lambda: (lambda w: w.sum() ** 2, ()), "e"),
    "global read": (lambda: (lambda w: SCALE * w ** 2, ()), "e"),
}


@pytest.mark.parametrize("name", sorted(INTEGRANDS))
def test_hit_equals_fresh_trace(name):
    fn_of, kind = INTEGRANDS[name]
    fresh = _fresh(fn_of, kind)
    first = _run(fn_of, kind)
    before = plan_cache.info()
    second = _run(fn_of, kind)
    after = plan_cache.info()
    _assert_same(first, fresh)
    _assert_same(second, fresh)
    assert after.hits == before.hits + 1 and after.misses == before.misses  # the second call: no trace


def test_explain_reports_the_plan_source():
    q = Normal(torch.zeros(3), torch.ones(3))
    p = Laplace(0.0, 1.0)
    first = mg.explain(p.log_prob, q)
    second = mg.explain(p.log_prob, q)
    assert (first.cache, second.cache) == ("stored", "hit")
    assert "from the plan cache" in str(second) and "stored in the plan cache" in str(first)
    with plan_cache.disabled():
        off = mg.explain(p.log_prob, q)
    assert off.cache == "off" and "plan cache disabled" in str(off)
    learned = Normal(torch.zeros((), requires_grad=True), 1.0)
    plan = mg.explain(learned.log_prob, q)
    assert plan.cache == "not stored" and "requires grad" in plan.cache_reason
    assert "not stored in the plan cache" in str(plan)
    # a module closed over: not keyed, traced afresh (and said so)
    net = torch.nn.Linear(3, 3)
    plan = mg.explain(lambda w: net(w).sum(), q)
    assert plan.cache == "not stored" and "Linear" in plan.cache_reason


def test_prior_updated_in_place_between_calls():
    scale = torch.tensor(1.0)
    loc = torch.zeros(5)  # large enough to be keyed by identity? no: 20 bytes, keyed by value
    big_loc = torch.zeros(1000)[:5]  # a view of a 4000-byte storage: keyed by identity

    for tensor in (scale, loc, big_loc):
        def fn_of(tensor=tensor):
            if tensor is scale:
                return Normal(0.0, scale), ()
            return Normal(tensor, 1.0), ()

        for step in range(3):
            got = _run(fn_of, "kl", seed=step)
            _assert_same(got, _fresh(fn_of, "kl", seed=step))
            with torch.no_grad():
                tensor.add_(0.5)
    # the identity-keyed loc derives constants (−loc, loc², …): those traces are never stored
    plan = mg.explain(Normal(big_loc, 1.0).log_prob, Normal(torch.zeros(5), torch.ones(5)))
    assert plan.cache == "not stored" and "identity" in plan.cache_reason


def test_directly_captured_large_tensor_is_read_live():
    """A tensor used as is (not derived) may be keyed by identity: even a ``.data`` write is seen."""
    c = torch.linspace(-1, 1, 5)
    storage_owner = torch.zeros(1000)
    c = storage_owner[:5].copy_(c)

    def fn_of():
        return (lambda w: torch.maximum(w, c)), ()

    results = []
    for step in range(3):
        got = _run(fn_of, "e", seed=step)
        _assert_same(got, _fresh(fn_of, "e", seed=step))
        results.append(got[0])
        c.data.add_(0.3)  # does not bump c._version
    assert plan_cache.info().hits >= 2
    assert not torch.equal(results[0], results[1])


def test_learned_prior_with_optimizer_steps():
    """Prior parameters that require grad, an SGD step between calls: value and every gradient as fresh."""
    def train(enabled):
        torch.manual_seed(0)
        mu, rho = _q()
        p_loc = torch.zeros((), requires_grad=True)
        p_rho = torch.zeros((), requires_grad=True)
        opt = torch.optim.SGD([mu, rho, p_loc, p_rho], lr=0.1)
        out = []
        with (plan_cache.disabled() if not enabled else torch.enable_grad()):
            for step in range(4):
                q = Normal(mu, torch.nn.functional.softplus(rho))
                p = Normal(p_loc, torch.nn.functional.softplus(p_rho))
                kl = mg.kl_divergence(q, p, 8, seed=step).sum() \
                    + mg.expectation(lambda w: (w - p_loc).abs(), q, 8, seed=step).sum()
                opt.zero_grad()
                kl.backward()
                out.append((kl.detach(), [t.grad.clone() for t in (mu, rho, p_loc, p_rho)]))
                opt.step()
        return out

    for (va, ga), (vb, gb) in zip(train(True), train(False)):
        assert torch.equal(va, vb)
        for x, y in zip(ga, gb):
            assert torch.equal(x, y)


def test_prior_rebuilt_each_call_with_different_values():
    for step, (loc, scale) in enumerate([(0.0, 1.0), (1.0, 1.0), (0.0, 3.0), (0.0, 1.0)]):
        def fn_of(loc=loc, scale=scale):
            return Normal(torch.tensor(loc), torch.tensor(scale)), ()

        _assert_same(_run(fn_of, "kl", seed=step), _fresh(fn_of, "kl", seed=step))
        # a lambda rebuilt each call, closing over a changing Python number
        lam = (lambda k: (lambda: (lambda w: k * w ** 2 - w, ())))(scale + step)
        _assert_same(_run(lam, "e", seed=step), _fresh(lam, "e", seed=step))
    assert plan_cache.info().hits >= 1  # (0, 1) came back


def test_global_changes_are_seen():
    global SCALE
    fn_of = INTEGRANDS["global read"][0]
    before = _run(fn_of, "e")
    try:
        SCALE = 5.0
        after = _run(fn_of, "e")
        _assert_same(after, _fresh(fn_of, "e"))
    finally:
        SCALE = 2.0
    assert not torch.equal(before[0], after[0])


def test_key_separates_shapes_and_dtypes():
    fn = Laplace(0.0, 1.0).log_prob
    for q in (Normal(torch.zeros(3), torch.ones(3)), Normal(torch.zeros(4), torch.ones(4)),
              Normal(torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))):
        e = mg.expectation(fn, q, 4, seed=0)
        assert e.shape == q.batch_shape and e.dtype == q.loc.dtype
    assert plan_cache.info().size == 3


def test_cache_is_bounded_lru():
    plan_cache.set_max_size(3)
    q = Normal(torch.zeros(2), torch.ones(2))
    fns = [functools.partial(torch.mul, float(k)) for k in range(5)]
    for fn in fns:
        mg.expectation(fn, q, 2, seed=0)
    assert plan_cache.info().size == 3
    assert mg.explain(fns[-1], q).cache == "hit"
    assert mg.explain(fns[0], q).cache == "stored"  # evicted, traced again
    plan_cache.set_max_size(0)
    assert plan_cache.info().size == 0
    assert mg.explain(fns[0], q).cache == "not stored"
    with pytest.raises(ValueError, match="n must be"):
        plan_cache.set_max_size(-1)
    with pytest.raises(TypeError, match="value must be a bool"):
        plan_cache.set_enabled("yes")


def test_layer_kl_hits_in_training_at_one_sample():
    """The engine's own KL path (mg.nn.elbo at M = 1, one optimizer step per call) reuses its traces."""
    def train(enabled):
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        net = mg.nn.bayesify(mlp, prior="normal", kl_samples=1)
        opt = torch.optim.Adam(net.parameters(), lr=0.05)
        x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
        losses = []
        with (plan_cache.disabled() if not enabled else torch.enable_grad()):
            for step in range(4):
                loss = -mg.nn.elbo(net, x, y, num_samples=1, dataset_size=100, seed=step, kl_samples=mg.Sampling(None, method="collapsed-exact"))
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        return losses, [p.detach().clone() for p in net.parameters()]

    cached = train(True)
    info = plan_cache.info()
    # two layers of different shapes, their weights' KLs at each of the 4 steps: one trace per shape
    assert (info.stored, info.misses, info.hits) == (2, 2, 4 * 2 - 2)
    fresh = train(False)
    assert all(torch.equal(a, b) for a, b in zip(cached[0], fresh[0]))
    assert all(torch.equal(a, b) for a, b in zip(cached[1], fresh[1]))


def test_registration_invalidates():
    q = Normal(torch.zeros(2), torch.ones(2))
    fn = Laplace(0.0, 1.0).log_prob
    assert mg.explain(fn, q).cache == "stored"
    assert mg.explain(fn, q).cache == "hit"
    mg.register_integrand("abs")  # already elementwise: a registration all the same
    assert mg.explain(fn, q).cache == "stored"


def test_key_holds_grad_mode_and_autocast():
    """A trace made under no_grad (constants without autograd history) is not reused with grad on."""
    mu, rho = _q()
    loc = torch.tensor(0.3, requires_grad=True)
    q = Normal(mu, rho.exp())
    with torch.no_grad():
        mg.expectation(Normal(loc, 1.0).log_prob, q, 4, seed=0)
    got = torch.autograd.grad(mg.expectation(Normal(loc, 1.0).log_prob, q, 4, seed=0).sum(), loc)
    with plan_cache.disabled():
        ref = torch.autograd.grad(mg.expectation(Normal(loc, 1.0).log_prob, q, 4, seed=0).sum(), loc)
    assert torch.equal(got[0], ref[0])
    fn = lambda w: (w.reshape(5, 1) @ torch.ones(1, 2)).tanh()  # noqa: E731
    plain = mg.expectation(fn, q, 4, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = mg.expectation(fn, q, 4, seed=0)
    assert (plain.dtype, low.dtype) == (torch.float32, torch.bfloat16)


def test_readme_example_runs(capsys):
    from support.doc_blocks import python_blocks, section
    from support.paths import ROOT

    (code,) = python_blocks(section((ROOT / "docs" / "concepts.md").read_text(), "## The plan cache"))
    exec(compile(code, "docs/concepts.md (plan cache)", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["stored", "hit"] and "not stored in the plan cache" in out[3]
    assert plan_cache.info().max_size == 64


def test_bound_builtin_methods_key_their_tensor():
    """``c.mul`` is keyed by the tensor it is bound to, not by the (short-lived) method object."""
    q = Normal(torch.zeros(3), torch.ones(3))
    for value in (1.0, 2.0, 3.0, 2.0):
        c = torch.tensor(value)
        got = mg.expectation(c.mul, q, 4, seed=0)
        with plan_cache.disabled():
            ref = mg.expectation(c.mul, q, 4, seed=0)
        assert torch.equal(got, ref)
    assert plan_cache.info().hits == 1  # 2.0 came back


def test_cache_is_bounded_in_bytes(monkeypatch):
    """Traces holding large tensors are dropped least recently used first beyond MAX_BYTES."""
    q = Normal(torch.zeros(4096), torch.ones(4096))
    monkeypatch.setattr(plan_cache, "MAX_BYTES", 3 * 4096 * 4)
    tensors = [torch.full((4096,), float(k)) for k in range(5)]
    for c in tensors:
        assert mg.explain(lambda w, c=c: torch.maximum(w, c), q).cache == "stored"  # c used as it is
    info = plan_cache.info()
    assert info.size == 3 and plan_cache._STATE.nbytes <= plan_cache.MAX_BYTES
    view = torch.zeros(4 * 4096)[:4096]  # its whole storage counts
    plan = mg.explain(lambda w: torch.maximum(w, view), q)
    assert plan.cache == "not stored" and "MAX_BYTES" in plan.cache_reason


@pytest.mark.parametrize("prior", sorted(mg.nn.PRIORS))
@pytest.mark.parametrize("posterior", ["normal", "radial", "laplace", "lognormal"])
def test_every_registered_prior_hits_and_agrees(prior, posterior):
    """Each named prior, rebuilt by ``layer.prior`` on every call: the layer's KL reuses its trace, and
    value and gradients equal those of a fresh trace."""
    from mcgraph.nn.layer_kl import uses_layer_rule

    torch.manual_seed(0)
    try:
        layer = mg.nn.BayesLinear(4, 3, posterior=posterior, prior=prior, kl_samples=8)
    except ValueError as e:  # a prior that names the posteriors it pairs with (ARD)
        pytest.skip(str(e))
    if uses_layer_rule(layer):
        pytest.skip(f"{prior}: a registered layer KL, not the engine's")

    def kl_and_grads():  # sampled: a closed-form pair (Normal, Laplace under Normal) traces nothing
        value = layer.kl(seed=0, method="monte-carlo")
        return value.detach(), torch.autograd.grad(value, [layer.weight_mu, layer.weight_rho])

    with plan_cache.disabled():
        ref = kl_and_grads()
    for _ in range(3):
        _assert_same(kl_and_grads(), ref)
    assert plan_cache.info().hits >= 2


def test_a_constant_result_is_not_shared_between_calls():
    q = Normal(torch.zeros(3), torch.ones(3))

    def fn(w):  # does not depend on w: the expectation is its value
        return torch.full((3,), 2.0)

    first = mg.expectation(fn, q, 4, seed=0)
    first.add_(1.0)  # the caller owns its result: the stored one is not touched
    second = mg.expectation(fn, q, 4, seed=0)
    second.add_(1.0)
    assert plan_cache.info().hits == 1
    assert torch.equal(mg.expectation(fn, q, 4, seed=0), torch.full((3,), 2.0))


def _beta(dtype):
    return torch.distributions.Beta(torch.tensor(2.0, dtype=dtype), torch.tensor(3.0, dtype=dtype))


def _chi2(dtype):
    return torch.distributions.Chi2(torch.tensor(3.0, dtype=dtype))


@pytest.mark.parametrize("make", [_beta, _chi2], ids=["beta", "chi2"])
def test_the_key_holds_the_dtype_of_parameters_exposed_as_properties(make):
    """Beta's concentrations live in an inner Dirichlet, Chi2's df is computed: the form still reads
    their dtype, so a float32 call's trace is never reused for a float64 q (found by the slow profile:
    float64 in, float32 out)."""
    from mcgraph.engine.plan.families import family_of

    for dtype in (torch.float32, torch.float64):
        assert family_of(make(dtype)).dtype == dtype
    fn = functools.partial(torch.mul, 2.0)
    outs = [mg.expectation(fn, make(dtype), 4, seed=0) for dtype in (torch.float32, torch.float64)]
    assert [o.dtype for o in outs] == [torch.float32, torch.float64]
    with plan_cache.disabled():
        fresh = mg.expectation(fn, make(torch.float64), 4, seed=0)
    assert torch.equal(outs[1], fresh)


@pytest.mark.parametrize("method", ["direct", "chunked", "auto"])
@pytest.mark.parametrize("cached", [True, False], ids=["cache", "no-cache"])
def test_fn_failing_on_a_sample_is_an_error_naming_fn(method, cached):
    """An integrand that fails on some samples (here a validated support check) raises a ValueError
    naming ``fn``, whether the failure comes at the trace or, after a cache hit, only at evaluation
    (found by the slow profile: torch's raw support error escaped)."""
    q = Normal(torch.zeros(4, requires_grad=True), torch.ones(4))
    prior = torch.distributions.Exponential(torch.tensor(1.0), validate_args=True)

    def fn(w):
        return prior.log_prob(w)

    plan_cache.set_enabled(cached)
    for seed in range(3):  # later calls hit the cache when it is on: the sample is then only evaluated
        with pytest.raises(ValueError, match=r"fn failed on a sample .*support"):
            mg.expectation(fn, q, 8, seed=seed, method=method)


def test_a_stored_trace_keeps_its_classification_and_a_bounded_number_of_them():
    """A hit reuses the trace's classification for an equal form signature (no classify call), and forms whose
    noise law is made per call (Student-t) do not grow the per-trace memo without bound."""
    from mcgraph.engine import api

    mg.plan_cache.clear()
    p = torch.distributions.Laplace(0.0, 1.0)
    q = lambda: Normal(torch.zeros(4, requires_grad=True), torch.ones(4))  # noqa: E731
    mg.kl_divergence(q(), p, 10, seed=0, method="monte-carlo")
    calls = []
    original = api.classify
    api.classify = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        for _ in range(3):
            mg.kl_divergence(q(), p, 10, seed=0, method="monte-carlo")
        assert calls == []
        for i in range(3 * api._PLANS_PER_TRACE):
            t = torch.distributions.StudentT(torch.tensor(3.0 + i), torch.zeros(4, requires_grad=True), torch.ones(4))
            mg.expectation(p.log_prob, t, 10, seed=0)
    finally:
        api.classify = original
    assert calls  # a new law is classified
    sizes = [len(e.trace.__dict__.get("_plans", {})) for e in mg.plan_cache._STATE.entries.values()]
    assert sizes and max(sizes) <= api._PLANS_PER_TRACE
