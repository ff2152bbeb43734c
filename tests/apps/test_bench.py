"""Tests of the benchmark harness (``bench.harness``): rows and files, refusal of wrong answers,
prediction-based skipping, the max-M search. Fast: tiny sizes, synthetic cases."""

from __future__ import annotations

import csv
import json
import math
import os

import pytest
import torch

from bench.harness import cli
from bench.__main__ import _argv
from bench.harness.agreement import Outcome, check_equal, check_same_law
from bench.harness.runner import CaseRunner, Settings
from bench.harness.measure import LinearFit, Probe, max_feasible_m, parse_bytes, parse_count
from bench.harness.records import COLUMNS, read_json
from bench.harness.report import check_targets, text_report
from support.paths import ROOT
from bench.harness.workloads import (ALL_METHODS, KL_PAIRS, Case, KLCase, LastLayerCase, NotApplicable, RunOut)


@pytest.fixture(autouse=True)
def _one_thread():
    """These tests check logic, not speed: one intra-op thread keeps them fast on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class LinearCase(Case):
    """A synthetic case: value = sum(θ)·(1 + bias), saved bytes = a + b·M, optional OOM above ``oom_at``.

    Records every (method, M) it is run at, so a test can tell a skipped point from a run one.
    """

    workload = "synthetic"
    methods = ("direct", "grad-accum", "mcgraph", "fused")

    def __init__(self, a=1000, b=100, wrong=(), oom_at=None):
        self.model, self.P, self.device = "linear", 8, torch.device("cpu")
        self.theta = torch.ones(8, requires_grad=True)
        self.params = [self.theta]
        self.a, self.b, self.wrong, self.oom_at = a, b, set(wrong), oom_at
        self.calls = []

    def spec(self):
        return {}

    def run(self, method, num_samples, seed, measure_bytes=False):
        if method not in self.methods:
            raise NotApplicable(f"{method} is not defined here")
        self.calls.append((method, num_samples))
        if self.oom_at is not None and method == "direct" and num_samples >= self.oom_at:
            raise MemoryError("synthetic out of memory")
        scale = 1.01 if method in self.wrong else 1.0
        loss = (self.theta * scale).sum() * (1 + 1 / (seed + 2))
        loss.backward()
        nbytes = self.a + (self.b * num_samples if method == "direct" else 0)
        return RunOut(loss.detach(), nbytes if measure_bytes else None)


def _settings(**kw):
    base = dict(samples=(1, 10, 100), repeats=1, time_cap=30.0, randn=False, same_law_draws=4)
    base.update(kw)
    return Settings(**base)


# --------------------------------------------------------------------------- the CLI end to end


def test_quick_kl_run_writes_rows_markdown_and_plots(tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli.main(["--quick", "--params", "256", "--samples", "1,10,100", "--model", "normal-normal", "--m-cap", "4096",
                   "--repeats", "1", "--no-progress", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "bytes saved for backward" in printed and "max M under the memory budget" in printed
    with open(out / "rows.csv") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        rows = list(reader)
    methods = {r["method"] for r in rows if r["workload"] == "kl"}
    assert set(ALL_METHODS) | {"randn"} <= methods
    for r in rows:
        assert r["torch"] == torch.__version__ and r["device"] == "cpu" and r["P"] == "256"
    ok = [r for r in rows if r["workload"] == "kl" and r["status"] == "ok" and r["method"] != "randn"]
    assert ok and all(float(r["seconds"]) > 0 and int(r["bytes"]) > 0 and r["agreement"] for r in ok)
    meta, jrows = read_json(out / "rows.json")
    assert len(jrows) == len(rows) and meta["environment"]["torch"] == torch.__version__
    assert set(json.loads((out / "rows.json").read_text())["rows"][0]) == set(COLUMNS)
    md = (out / "summary.md").read_text()
    assert "## Targets" in md and "| method | M=1 | M=10 | M=100 |" in md and "P reduced to 256" not in md
    for name in ("memory_kl_normal-normal.png", "time_kl_normal-normal.png", "maxm_kl.png"):
        assert (out / name).stat().st_size > 1000
    # collapsed and fused memory does not grow with M; direct's does
    by = {(r["method"], int(r["M"])): r for r in ok}
    assert int(by["collapsed", 100]["bytes"]) == int(by["collapsed", 1]["bytes"])
    assert int(by["direct", 100]["bytes"]) > 50 * int(by["direct", 1]["bytes"]) / 2


def test_python_dash_m_mcgraph_bench_defaults_to_quick():
    assert _argv([]) == ["--quick"]
    assert _argv(["--out", "x"]) == ["--quick", "--out", "x"]
    assert _argv(["--full"]) == ["--full"]
    assert _argv(["--params", "64k"]) == ["--params", "64k"]


def test_cli_rejects_unknown_names():
    with pytest.raises(SystemExit):
        cli.main(["--workload", "nope", "--no-progress"])
    with pytest.raises(SystemExit):
        cli.main(["--methods", "magic", "--no-progress"])
    with pytest.raises(SystemExit, match="no KL pair"):
        cli.main(["--model", "resnet18", "--no-progress", "--quick"])


# --------------------------------------------------------------------------- agreement


@pytest.mark.parametrize("wrong", ["grad-accum", "fused"])
def test_a_method_that_disagrees_is_refused_and_not_timed(wrong):
    case = LinearCase(wrong={wrong})
    rows = CaseRunner(case, _settings(samples=(1, 10))).run()
    bad = [r for r in rows if r.method == wrong]
    assert bad and all(r.status.startswith("REFUSED: disagrees") for r in bad)
    assert all(r.seconds is None and r.speedup_vs_direct is None for r in bad)
    good = [r for r in rows if r.method != wrong]
    assert all(r.ok and r.seconds is not None for r in good)
    # the reference is the cheapest method of the agreeing majority, even when the cheapest is the wrong one
    ref = "fused" if wrong != "fused" else "mcgraph"
    assert next(r for r in rows if r.method == ref).agreement == "reference"
    assert next(r for r in rows if r.method == "direct").agreement.startswith(f"vs {ref}")


def test_refusal_on_a_real_kl_case():
    class WrongKL(KLCase):
        def run(self, method, num_samples, seed, measure_bytes=False):
            out = super().run(method, num_samples, seed, measure_bytes)
            if method == "vectorised":
                self.loc.grad.mul_(1.001)  # gradients 0.1 % off
            return out

    rows = CaseRunner(WrongKL("normal-normal", 64), _settings(samples=(10,), methods=("collapsed", "vectorised",
                                                                                         "direct"))).run()
    by = {r.method: r for r in rows}
    assert by["collapsed"].ok and by["direct"].ok
    assert by["vectorised"].status.startswith("REFUSED") and "grad rel err" in by["vectorised"].status


def test_check_equal_and_same_law():
    ref = Outcome(10.0, (torch.ones(3, dtype=torch.float64),))
    assert check_equal(Outcome(10.0 * (1 + 1e-6), (torch.ones(3, dtype=torch.float64),)), ref)
    assert not check_equal(Outcome(10.1, ref.grads), ref)
    assert not check_equal(Outcome(10.0, (torch.full((3,), 1.01, dtype=torch.float64),)), ref)
    assert not check_equal(Outcome(10.0, (None,)), ref)
    gen = torch.Generator().manual_seed(0)
    draws = [Outcome(float(torch.randn((), generator=gen)), ()) for _ in range(8)]
    assert check_same_law(Outcome(0.3, ()), draws)
    assert not check_same_law(Outcome(50.0, ()), draws)


def test_collapsed_exact_is_checked_statistically():
    rows = CaseRunner(KLCase("normal-normal", 128), _settings(samples=(100,), methods=(
        "collapsed", "collapsed-exact", "direct"))).run()
    by = {r.method: r for r in rows}
    assert by["collapsed-exact"].ok, by["collapsed-exact"].status
    assert "same law, different numbers" in by["collapsed-exact"].agreement
    assert by["direct"].ok and "value rel err" in by["direct"].agreement


@pytest.mark.parametrize("pair", sorted(KL_PAIRS))
def test_every_kl_pair_agrees_across_methods(pair):
    rows = CaseRunner(KLCase(pair, 64), _settings(samples=(3,))).run()
    assert not [r for r in rows if r.status.startswith(("REFUSED", "error"))], [r.status for r in rows]
    assert {r.method for r in rows if r.ok} >= {"direct", "vectorised", "grad-accum", "mcgraph", "fused", "chunked"}


def test_lastlayer_case_agrees_and_skips_elementwise_tiers():
    rows = CaseRunner(LastLayerCase(batch=4, classes=3, features=5), _settings(samples=(1, 4))).run()
    by = {(r.method, r.M): r for r in rows}
    for m in ("direct", "vectorised", "grad-accum", "mcgraph", "chunked"):
        assert by[m, 4].ok, by[m, 4].status
    assert by["fused", 1].status.startswith("n/a")


# --------------------------------------------------------------------------- skipping, OOM, time


def test_an_infeasible_point_is_recorded_as_skipped_not_run():
    case = LinearCase(a=1000, b=10_000)
    # direct at M=100 needs ≈ 1e6 saved bytes (× peak_factor 2): over a 1 MB budget; M=1, 10 fit.
    rows = CaseRunner(case, _settings(run_budget=1e6)).run()
    d = {r.M: r for r in rows if r.method == "direct"}
    assert d[1].ok and d[10].ok
    assert d[100].status.startswith("skipped (predicted") and "budget" in d[100].status
    assert d[100].predicted_bytes == pytest.approx(1000 + 10_000 * 100, rel=1e-6)
    assert ("direct", 100) not in case.calls
    assert {r.M for r in rows if r.method == "mcgraph" and r.ok} == {1, 10, 100}


def test_a_point_predicted_over_the_time_cap_is_skipped():
    class Slow(LinearCase):
        def run(self, method, num_samples, seed, measure_bytes=False):
            if method == "grad-accum":
                import time

                time.sleep(0.002 * num_samples)
            return super().run(method, num_samples, seed, measure_bytes)

    case = Slow()
    rows = CaseRunner(case, _settings(samples=(1, 10, 1000), time_cap=0.5)).run()
    ga = {r.M: r for r in rows if r.method == "grad-accum"}
    assert ga[10].ok and ga[1000].status.startswith("skipped (predicted") and "cap" in ga[1000].status
    assert ("grad-accum", 1000) not in case.calls


def test_out_of_memory_is_recorded_not_raised():
    case = LinearCase(oom_at=10)
    rows = CaseRunner(case, _settings()).run()
    d = {r.M: r for r in rows if r.method == "direct"}
    assert d[1].ok and d[10].status == "OOM" and d[100].status.startswith("skipped (OOM at M=10")
    assert ("direct", 100) not in case.calls


def test_speedups_are_relative_to_direct_and_grad_accum_in_the_same_run():
    rows = CaseRunner(LinearCase(), _settings(samples=(10,))).run()
    by = {r.method: r for r in rows}
    m = by["mcgraph"]
    assert m.speedup_vs_direct == pytest.approx(by["direct"].seconds / m.seconds)
    assert m.speedup_vs_grad_accum == pytest.approx(by["grad-accum"].seconds / m.seconds)


# --------------------------------------------------------------------------- max M


def test_max_m_search_finds_the_boundary_of_linear_memory():
    calls = []

    def probe(m):
        calls.append(m)
        return Probe(1000 + 100 * m, "measured")

    result = max_feasible_m(probe, budget=1_000_000, m_cap=2**20)
    assert result.m == (1_000_000 - 1000) // 100 and not result.capped and result.basis == "measured"
    assert len(calls) < 40  # doubling then bisection, not a scan


@pytest.mark.parametrize("budget", [1000 + 100 * 7, 1000 + 100 * 8 - 1, 1000 + 100 * 1024])
def test_max_m_exact_at_powers_of_two_and_between(budget):
    assert max_feasible_m(lambda m: Probe(1000 + 100 * m, "measured"), budget).m == (budget - 1000) // 100


def test_max_m_capped_flat_memory_and_nothing_fits():
    flat = max_feasible_m(lambda m: Probe(5000, "measured"), budget=10_000, m_cap=4096)
    assert flat.capped and flat.m == 4096 and str(flat).startswith("≥4096")
    assert max_feasible_m(lambda m: Probe(10**9, "measured"), budget=10).m == 0
    oom = max_feasible_m(lambda m: Probe(None if m > 300 else 1.0, "measured"), budget=10)
    assert oom.m == 300
    ext = max_feasible_m(lambda m: Probe(100 * m, "measured" if m < 64 else "extrapolated"), budget=10_000)
    assert ext.m == 100 and "extrapolated" in ext.basis


def test_harness_max_m_rows_on_a_tiny_budget():
    case = LinearCase(a=1000, b=100)
    runner = CaseRunner(case, _settings(samples=(1, 10, 100), maxm_budget=1000 + 100 * 333, m_cap=4096))
    runner.run()
    rows = {r.method: r for r in runner.search_max_m()}
    assert rows["direct"].M == 333 and rows["direct"].workload == "synthetic-maxm"
    assert rows["mcgraph"].M == 4096 and rows["mcgraph"].status.startswith("≥")
    assert any("max M" in line for line in text_report(runner.rows).splitlines())
    assert check_targets(runner.rows)


# --------------------------------------------------------------------------- small pieces


def test_linear_fit_and_parsers():
    f = LinearFit.through([(1, 10.0), (10, 100.0), (100, 1000.0)])
    assert f(1000) == pytest.approx(10_000)
    assert LinearFit.through([(10, 50.0)])(100) == pytest.approx(500)  # proportional guess from one point
    assert LinearFit.through([(1, 5.0), (10, 5.0)])(10**6) == pytest.approx(5.0)
    assert parse_bytes("11GB") == 11 * 10**9 and parse_bytes("512MiB") == 512 * 2**20 and parse_bytes(2048) == 2048
    with pytest.raises(ValueError, match="budget"):
        parse_bytes("eleven")
    assert parse_count("11.2M") == 11_200_000 and parse_count("2**14") == 16384 and parse_count("64k") == 64_000


def test_peak_rss_of_a_fresh_subprocess():
    from bench.harness.point import run_in_subprocess

    rep = run_in_subprocess(KLCase("normal-normal", 256).spec(), "direct", 10, 0, timeout=120)
    assert rep["peak"] >= rep["base"] > 0 and math.isfinite(rep["value"])


# --------------------------------------------------------------------------- the training-step workload


def test_step_workload_is_skipped_with_a_clear_row_without_mcgraph_nn(monkeypatch, tmp_path, capsys):
    import bench.harness.step as step

    monkeypatch.setattr(step, "nn_available", lambda: "mcgraph.nn not available (ImportError: test)")
    rc = cli.main(["--workload", "step", "--model", "lenet5", "--no-progress", "--no-max-m", "--out", str(tmp_path)])
    assert rc == 0
    rows = list(csv.DictReader(open(tmp_path / "rows.csv")))
    assert len(rows) == 1 and rows[0]["status"] == "skipped: mcgraph.nn not available (ImportError: test)"


def test_step_case_methods_agree_on_a_small_network():
    step = pytest.importorskip("bench.harness.step")
    if step.nn_available() is not None:
        pytest.skip(step.nn_available())
    case = step.StepCase("lenet5", batch=4, input_size=16)
    rows = CaseRunner(case, _settings(samples=(3,), methods=("collapsed", "direct", "vectorised", "grad-accum",
                                                             "mcgraph", "fused"))).run()
    by = {r.method: r for r in rows}
    for m in ("collapsed", "direct", "vectorised", "grad-accum", "mcgraph", "fused"):
        assert by[m].ok, (m, by[m].status)
    assert by["direct"].bytes > by["grad-accum"].bytes


def test_bench_without_matplotlib_writes_everything_else(tmp_path):
    """matplotlib made unimportable in a fresh interpreter (a real ImportError, via sitecustomize)."""
    import subprocess
    import sys

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), str(ROOT)]))
    code = ("import sys\ntry:\n    import matplotlib\nexcept ImportError:\n    pass\nelse:\n    sys.exit(3)\n"
            "from bench.harness.cli import main\n"
            f"sys.exit(main(['--quick', '--params', '64', '--samples', '1,10', '--model', 'normal-normal', "
            f"'--methods', 'direct,collapsed', '--no-max-m', '--repeats', '1', '--no-progress', '--out', {str(out)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "matplotlib is not importable" in proc.stderr and "without plots" in proc.stderr, proc.stderr
    assert "pip install matplotlib" in proc.stderr
    assert "Traceback" not in proc.stderr
    for name in ("rows.csv", "rows.json", "summary.md"):
        assert (out / name).stat().st_size > 0
    assert not list(out.glob("*.png"))
    assert "no plots" in proc.stdout


def test_mcgraph_bench_finds_the_checkout_or_says_how(monkeypatch, capsys):
    """``mcgraph bench`` runs the harness of the checkout mcgraph was imported from; an installed wheel has
    no harness (it is development code), and the command says where to get it instead of a traceback."""
    import mcgraph.__main__ as entry

    root = ROOT
    assert entry._checkout_root() == root
    with pytest.raises(SystemExit) as done:  # the harness's own argparse answers --help
        entry.main(["bench", "--help"])
    assert done.value.code == 0 and "--workload" in capsys.readouterr().out
    monkeypatch.setattr(entry, "_checkout_root", lambda: None)
    assert entry.main(["bench", "--quick"]) == 2
    assert "python -m bench" in capsys.readouterr().err


def test_the_harness_is_not_part_of_the_installed_package():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not any(p.startswith("bench") or "apps.bench" in p for p in config["tool"]["setuptools"]["packages"])
    assert not (ROOT / "mcgraph" / "apps" / "bench").exists()
