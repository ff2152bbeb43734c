"""pytest-benchmark suite of the engine workloads (KL of P weights, last-layer likelihood) at small sizes.

    pytest bench/ --benchmark-only                       # time every method × pair
    pytest bench/ --benchmark-only -k "normal-normal"    # one pair
    pytest bench/ --benchmark-disable                    # CI smoke test: each body runs once

Each benchmark is one forward + backward of a :class:`bench.harness.workloads.Case` with the
harness's methods; before timing, the method's value and gradients are checked against the
reference method at the same seed (a benchmark of a wrong answer fails instead of reporting).
``extra_info`` carries P, M and the bytes saved for backward, so saved JSON rows show memory too.
"""

from __future__ import annotations

import pytest
import torch

from bench.harness.agreement import Outcome, check_equal, check_same_law
from bench.harness.workloads import KL_PAIRS, SAME_LAW_ONLY, KLCase, LastLayerCase, randn_floor

P_SMALL = 4096
M_SMALL = 100
KL_METHODS = ("direct", "vectorised", "grad-accum", "mcgraph", "collapsed", "collapsed-exact", "fused", "chunked")
REFERENCE = "vectorised"  # applies to every workload; exact


def _outcome(case, method, M, seed=0):
    case.zero_grad()
    out = case.run(method, M, seed, measure_bytes=True)
    o = Outcome.capture(out.value, case.params)
    case.zero_grad()
    return o, out.saved_bytes


def _check(case, method, M):
    """The method's answer against the reference's (exact methods) or its law (collapsed-exact)."""
    why = case.applicable(method)
    if why is not None:
        pytest.skip(f"{method} does not apply: {why[:120]}")
    ref, _ = _outcome(case, REFERENCE, M)
    out, nbytes = _outcome(case, method, M)
    if method in SAME_LAW_ONLY:
        draws = [out] + [_outcome(case, method, M, seed)[0] for seed in range(1, 8)]
        verdict = check_same_law(ref, draws)
    else:
        verdict = check_equal(out, ref)
    assert verdict, f"{method} disagrees with {REFERENCE}: {verdict.detail}"
    return nbytes


@pytest.fixture(scope="module")
def kl_cases():
    return {name: KLCase(name, P_SMALL) for name in KL_PAIRS}


@pytest.mark.parametrize("method", KL_METHODS)
@pytest.mark.parametrize("pair", list(KL_PAIRS))
def test_kl(benchmark, kl_cases, pair, method):
    case = kl_cases[pair]
    nbytes = _check(case, method, M_SMALL)
    benchmark.group = f"kl {pair} P={P_SMALL} M={M_SMALL}"
    benchmark.extra_info.update(workload="kl", model=pair, method=method, P=P_SMALL, M=M_SMALL,
                                bytes=nbytes, torch=torch.__version__)

    def step():
        case.zero_grad()
        case.run(method, M_SMALL, 0)

    benchmark(step)


@pytest.mark.parametrize("M", [1, 1000])
@pytest.mark.parametrize("method", ["mcgraph", "collapsed-exact"])
def test_kl_graph_does_not_grow_with_m(benchmark, kl_cases, method, M):
    """The Normal–Normal KL at M = 1 and M = 1000: same saved bytes, time grows only with sampling."""
    case = kl_cases["normal-normal"]
    _, nbytes = _outcome(case, method, M)
    _, nbytes_1 = _outcome(case, method, 1)
    assert nbytes == nbytes_1, f"{method}: {nbytes} saved bytes at M={M} vs {nbytes_1} at M=1"
    benchmark.group = f"kl normal-normal P={P_SMALL} M sweep"
    benchmark.extra_info.update(workload="kl", model="normal-normal", method=method, P=P_SMALL, M=M, bytes=nbytes)

    def step():
        case.zero_grad()
        case.run(method, M, 0)

    benchmark(step)


@pytest.mark.parametrize("M", [M_SMALL, 1000])
def test_randn_floor(benchmark, M):
    """Plain torch.randn of the same M·P draws: the floor the collapsed tier is compared with."""
    benchmark.group = f"kl normal-normal P={P_SMALL} M sweep" if M == 1000 else f"randn P={P_SMALL}"
    benchmark.extra_info.update(workload="randn", method="randn", P=P_SMALL, M=M)
    benchmark(randn_floor, P_SMALL, M)


@pytest.mark.parametrize("method", ["direct", "vectorised", "grad-accum", "mcgraph", "chunked"])
def test_lastlayer(benchmark, method):
    case = LastLayerCase(batch=32, classes=10, features=128)
    nbytes = _check(case, method, 32)
    benchmark.group = "lastlayer B=32 K=10 D=128 M=32"
    benchmark.extra_info.update(workload="lastlayer", model=case.model, method=method, P=case.P, M=32,
                                bytes=nbytes)

    def step():
        case.zero_grad()
        case.run(method, 32, 0)

    benchmark(step)
