"""Many processes, one answer: real gloo process groups on CPU, spawned by the tests themselves.

Each spawned run starts R processes that join a gloo group through a FileStore in
``tmp_path`` (no network beyond the loopback), run many checks (tests/support/distributed_cases.py)
and save their results; the test compares them with the same checks run in this process
without a group. Spawning costs seconds per process, so the checks are grouped into few runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from support import distributed_cases as cases
from support.doc_blocks import python_blocks
from support.paths import ROOT
import mcgraph as mg
from mcgraph.engine.distributed import owned_range

#: rtol of the comparison with the single-process result per dtype (the contract).
RTOL = {"float64": 1e-9, "float32": 2e-4}


def spawn(world: int, names: list, tmp_path, timeout: float = 240.0) -> list[dict]:
    """Run ``cases.CASES[name]`` for ``names`` on ``world`` gloo ranks; their results, per rank."""
    store, outdir = tmp_path / f"store{world}", tmp_path / f"out{world}"
    outdir.mkdir()
    ctx = mp.start_processes(cases.worker, args=(world, str(store), names, str(outdir)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world} processes did not finish in {timeout} s")
    results = [torch.load(outdir / f"rank{r}.pt") for r in range(world)]
    for r, res in enumerate(results):
        for name, value in res.items():
            assert "__error__" not in value, f"rank {r}, case {name}:\n{value['__error__']}"
    return results


def assert_same(got: dict, ref: dict, where: str, rtol=None, rtols=RTOL) -> None:
    assert set(got) == set(ref), where
    for key, expected in ref.items():
        tol = rtol if rtol is not None else rtols["float32" if "float32" in key else "float64"]
        value = got[key]
        # rtol relative to each entry, with a floor at the tensor's scale for entries near zero
        atol = tol * float(expected.abs().max()) * 1e-2
        assert torch.allclose(value, expected, rtol=tol, atol=atol), (
            f"{where} {key}: max abs diff {float((value - expected).abs().max()):.3g}")


def test_owned_ranges_cover_the_samples_once():
    for m in (1, 2, 5, 7, 64, 1000):
        for world in (1, 2, 3, 8):
            for block in (1, 3, 6, m):
                ranges = [owned_range(m, world, r, block) for r in range(world)]
                assert ranges[0][0] == 0 and ranges[-1][1] == m
                assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
                assert all(lo <= hi for lo, hi in ranges)


def test_exit_process_flushes_and_leaves_with_the_code():
    """`launch.exit_process`: what was printed reaches the pipe, the code is the exit status, and
    atexit handlers are skipped (interpreter shutdown never runs, which is the point)."""
    code = ("import atexit, sys; from mcgraph.apps.launch import exit_process; "
            "atexit.register(lambda: print('atexit ran')); print('out', end=''); "
            "print('err', end='', file=sys.stderr); exit_process(3)")
    env = dict(os.environ, PYTHONPATH=str(Path(mg.__file__).parents[1]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out", "err")


def test_ranks_close_destroys_only_a_group_it_owns(tmp_path):
    """`Ranks.close` destroys the process group when `ranks_from_env` created it, and leaves a group
    the caller created alone."""
    import torch.distributed as dist

    from mcgraph.apps.launch import Ranks

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        Ranks(world=dist.group.WORLD).close()
        assert dist.is_initialized()
        Ranks(world=dist.group.WORLD, owns_group=True).close()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_process_group_is_validated():
    q = torch.distributions.Normal(torch.zeros(2), torch.ones(2))
    with pytest.raises((TypeError, ValueError), match="process_group"):
        mg.expectation(lambda w: w ** 2, q, 4, seed=0, process_group="world")


@pytest.mark.parametrize("world", [2, 3])
def test_every_tier_matches_one_process(world, tmp_path):
    """Every tier, float64 and float32, M in {1, 2, 7, 64} (M < R and M not divisible by R included),
    mg.nn.kl / elbo / predict on a bayesified conv net: same value and gradients as one process;
    with 2 processes also a few training steps, and VOGN / adaptive VB with samples or data split."""
    names = ["engine", "nn"] + (["train", "optim", "ddp", "fault"] if world == 2 else [])
    results = spawn(world, names, tmp_path)  # one spawned run for all of them: processes cost seconds
    ref = {"engine": cases.engine_cases(None), "nn": cases.nn_cases(None)}
    if world == 2:
        ref["train"] = cases.train_case(None)
        ref["optim"] = cases.optim_cases(None)
    for r, res in enumerate(results):
        for name in ref:
            assert_same(res[name], ref[name], f"R={world} rank {r}")
    if world == 2:
        # the training run moved the parameters (the comparison is not between two untouched nets)
        start = torch.cat([p.detach().reshape(-1) for p in cases.conv_net().parameters()])
        assert not torch.allclose(ref["train"]["train/float32/params"], start)
        check_faults_and_ddp(results)


def check_faults_and_ddp(results):
    """Failures on one rank raise on every rank; disagreements are reported; under DDP (each rank its
    own batch, KL samples split over the same ranks) the KL is counted once."""
    for r, res in enumerate(results):
        f = res["fault"]
        # the failing rank raises its own error (naming fn); the other names the rank
        assert f["integrand"].startswith("IntegrandError: fn failed") and "integrand failed on purpose" in \
            f["integrand"] if r == 1 else (
            f["integrand"].startswith("SampleParallelError") and "rank 1" in f["integrand"]
            and "integrand failed on purpose" in f["integrand"]), f["integrand"]
        for key in ("integrand-forward", "integrand-backward"):
            text = f[key]
            assert ("integrand failed" in text and "Error: " in text) if r == 1 else (
                text.startswith("SampleParallelError") and "rank 1" in text), (key, text)
        assert f["seed"].startswith("SampleParallelError") and "seed differs" in f["seed"], f["seed"]
        text = f["num_samples"]
        assert text.startswith("SampleParallelError") and "num_samples differs" in text, text
        bad = f["bad-argument-one-rank"]
        assert bad.startswith("ValueError: chunk_size must be") if r == 1 else (
            bad.startswith("SampleParallelError") and "rank 1" in bad), bad
        q = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
        assert torch.allclose(f["after"], mg.expectation(lambda w: w.abs(), q, 8, seed=0), rtol=1e-6)
    shared = [res["fault"]["seed-none"] for res in results]
    torch.testing.assert_close(shared[0], shared[1], rtol=0, atol=0)
    ref = cases.ddp_case(None)
    for r, res in enumerate(results):
        assert_same(res["ddp"], ref, f"DDP rank {r}", rtol=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_tier_many_sizes(world, tmp_path):
    results = spawn(world, ["engine-many", "optim"], tmp_path, timeout=600)
    ref = {"engine-many": cases.CASES["engine-many"](None), "optim": cases.optim_cases(None)}
    for r, res in enumerate(results):
        for name in ref:
            assert_same(res[name], ref[name], f"R={world} rank {r}")


def _train_args(out, epochs, extra=()):
    return ["train", "--model", "mlp", "--hidden", "16", "--dataset", "digits", "--epochs", str(epochs),
            "--batch-size", "64", "--limit-train", "192", "--limit-test", "64", "--kl-samples", "7",
            "--train-samples", "3", "--eval-samples", "5", "--periodic-eval-samples", "3", "--no-progress",
            "--threads", "1", "--out", str(out), *extra]


def test_train_cli_under_torchrun_matches_one_process_and_resumes(tmp_path):
    """`torchrun --nproc-per-node 2 python -m mcgraph train`: MC samples split over the 2 ranks, one
    checkpoint written by rank 0; resumed for a second epoch, the run ends with the parameters of the
    2-epoch one-process run."""
    from mcgraph.__main__ import main

    one, two = tmp_path / "one", tmp_path / "two"
    threads = torch.get_num_threads()
    try:
        assert main(_train_args(one, 2)) == 0
    finally:
        torch.set_num_threads(threads)  # --threads 1 must not slow the rest of the session
    done = cases.torchrun(2, _train_args(two, 1))
    assert done.stderr.count("epoch 1:") == 1  # rank 0 alone logs
    assert torch.load(two / "checkpoint.pt", weights_only=False)["step"] == 3
    done = cases.torchrun(2, _train_args(two, 2, ["--resume", str(two / "checkpoint.pt")]))
    assert done.stderr.count("resumed from") == 1
    a = torch.load(one / "checkpoint.pt", weights_only=False)
    b = torch.load(two / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 6
    for key, value in a["model"].items():
        torch.testing.assert_close(b["model"][key], value, rtol=2e-4, atol=1e-6)
    summary = json.loads((two / "summary.json").read_text())
    assert summary["processes"] == 2 and [r["epoch"] for r in summary["history"]] == [1, 2]


@pytest.mark.parametrize("extra", [
    pytest.param((), id="samples-split"),
    pytest.param(("--data-parallel", "2"), id="data-parallel", marks=pytest.mark.slow),
])
def test_a_torchrun_run_stopped_after_an_epoch_resumes_bitwise(tmp_path, extra):
    """Under torchrun (2 ranks) a run stopped after epoch 1 and resumed from its checkpoint ends with exactly
    the parameters of the uninterrupted 2-epoch run on the same ranks (the KL and data noise, the data
    order and Adam's state all come back from the checkpoint)."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    cases.torchrun(2, _train_args(whole, 2, list(extra)))
    cases.torchrun(2, _train_args(parts, 1, list(extra)))
    cases.torchrun(2, _train_args(parts, 2, ["--resume", str(parts / "checkpoint.pt"), *extra]))
    a = torch.load(whole / "checkpoint.pt", weights_only=True)
    b = torch.load(parts / "checkpoint.pt", weights_only=True)
    assert a["step"] == b["step"] == 6
    for key, value in a["model"].items():
        assert torch.equal(b["model"][key], value), key


@pytest.mark.slow
def test_train_cli_data_parallel_under_torchrun(tmp_path):
    """--data-parallel 2 on 2 ranks (each its half of every batch, DDP) and 1 x 2 on 4 ranks run,
    write one checkpoint and resume."""
    out = tmp_path / "dp"
    cases.torchrun(2, _train_args(out, 1, ["--data-parallel", "2"]))
    cases.torchrun(4, _train_args(out, 2, ["--resume", str(out / "checkpoint.pt"), "--data-parallel", "2"]),
              timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and [r["epoch"] for r in summary["history"]] == [1, 2]
    assert summary["processes"] == 4


@pytest.mark.slow
def test_readme_ddp_example_runs_under_torchrun(tmp_path):
    """The docs' `ddp_bnn.py` (docs/distributed.md) runs as written under `torchrun --nproc-per-node 2` and learns."""
    (code,) = [block for block in python_blocks((ROOT / "docs" / "distributed.md").read_text())
               if block.startswith("import torch, torch.distributed as dist, mcgraph as mg")]
    script = tmp_path / "ddp_bnn.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(mg.__file__).parents[1]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    accuracy = float(done.stdout.split("accuracy")[1])
    assert accuracy > 0.5, done.stdout


@pytest.mark.slow
def test_triton_backend_splits_the_same_way(tmp_path, monkeypatch):
    """MCGRAPH_BACKEND=triton (Triton's interpreter on CPU): 2 processes, which read the kernels' Philox
    stream by window and skip the whole-M statistics and log-density kernels, equal 1 process, which uses
    them (the contract's tolerances hold). The KL with a scale-mixture
    prior is left out: in one process it goes through the fused log-density kernel, which already differs
    from the torch fused tier by about 1e-6 in float64 at M = 3 (a difference between the kernel and the
    tier, not between process counts)."""
    monkeypatch.setenv("MCGRAPH_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = spawn(1, ["engine-small"], tmp_path / "one", timeout=600)[0]
    ref = {k: v for k, v in one["engine-small"].items() if not k.startswith("kl-normal-scalemix")}
    for r, res in enumerate(spawn(2, ["engine-small"], tmp_path / "two", timeout=600)):
        got = {k: v for k, v in res["engine-small"].items() if k in ref}
        assert_same(got, ref, f"triton R=2 rank {r}")
