"""What the processes of tests/engine/test_distributed.py run (importable by the spawned children).

Each case takes ``group`` (``None``: one process) and returns ``{name: tensor}``; the test
runs it once in the test process and once on every rank of a real gloo group, and compares.
Every case builds its own tensors from ``torch.manual_seed``, so all ranks hold the same ones.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import mcgraph as mg
from mcgraph.apps.launch import exit_process
from mcgraph.engine.distributed import SampleParallelError

#: Seconds a collective may wait before gloo gives up (a hang fails the test instead of blocking it).
TIMEOUT_S = 60


def _flat(value: torch.Tensor, grads) -> torch.Tensor:
    return torch.cat([value.detach().reshape(-1)] + [g.reshape(-1) for g in grads]).to(torch.float64)


def _grads(value: torch.Tensor, params) -> list:
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


def _params(shape, dtype):
    mu = torch.randn(shape, dtype=dtype, requires_grad=True)
    rho = (torch.randn(shape, dtype=dtype) - 1).requires_grad_()
    return mu, rho


def _on_backend(name: str, call):
    """``call()`` with ``MCGRAPH_BACKEND=name`` (the engine reads it on every call)."""
    before = os.environ.get("MCGRAPH_BACKEND")
    os.environ["MCGRAPH_BACKEND"] = name
    try:
        return call()
    finally:
        if before is None:
            del os.environ["MCGRAPH_BACKEND"]
        else:
            os.environ["MCGRAPH_BACKEND"] = before


def engine_cases(group, sizes=(1, 2, 7, 64), dtypes=(torch.float64, torch.float32)) -> dict:
    """Every tier of mg.expectation / mg.kl_divergence: value and gradients per (tier, dtype, M)."""
    out = {}
    for dtype in dtypes:
        torch.manual_seed(0)
        mu, rho = _params((3, 4), dtype)
        c = torch.randn(4, dtype=dtype, requires_grad=True)

        def normal():
            return torch.distributions.Normal(mu, torch.nn.functional.softplus(rho))

        def radial():
            return mg.distributions.Radial(mu, torch.nn.functional.softplus(rho), validate_args=False)

        cases = {
            "collapsed": lambda m, s: mg.expectation(lambda w: (w - c) ** 3, normal(), m, seed=s,
                                                     process_group=group),
            "collapsed-scaling": lambda m, s: mg.expectation(
                lambda w: w.log() ** 2, torch.distributions.LogNormal(mu, torch.nn.functional.softplus(rho)),
                m, seed=s, process_group=group),
            "fused": lambda m, s: mg.expectation(lambda w: (w * c).abs(), normal(), m, seed=s,
                                                 process_group=group),
            "chunked": lambda m, s: mg.expectation(lambda w: torch.logsumexp(w * c, -1), normal(), m, seed=s,
                                                   process_group=group),
            "chunked-forced": lambda m, s: mg.expectation(
                lambda w: w ** 2, normal(), m, seed=s, method="chunked", chunk_size=3, process_group=group),
            "kl-radial-normal": lambda m, s: mg.kl_divergence(
                radial(), torch.distributions.Normal(0.0, 1.0), m, seed=s, process_group=group),
            "kl-normal-scalemix": lambda m, s: mg.kl_divergence(
                normal(), mg.distributions.ScaleMixtureNormal(0.5, 1.0, 0.01), m, seed=s,
                process_group=group),
            "collapsed-philox": lambda m, s: _on_backend("cpu-philox", lambda: mg.expectation(
                lambda w: (w - c) ** 3, normal(), m, seed=s, process_group=group)),  # windowed compiled sums
            "kl-radial-normal-mc-philox": lambda m, s: _on_backend("cpu-philox", lambda: mg.kl_divergence(
                radial(), torch.distributions.Normal(0.0, 1.0), m, seed=s, method="monte-carlo",
                process_group=group)),  # each rank sums its window in the compiled Radial pass
            "kl-radial-entropy-mc": lambda m, s: mg.kl_divergence(
                radial(), mg.distributions.ScaleMixtureNormal(0.5, 1.0, 0.01), m, seed=s, method="chunked",
                chunk_size=2, process_group=group),
        }
        for name, call in cases.items():
            for m in sizes:
                value = call(m, 11)
                grads = _grads(value.sum(), [mu, rho, c])
                out[f"{name}/{str(dtype)[6:]}/M={m}"] = _flat(value, grads)
    return out


def conv_net(posterior: str = "radial"):
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(3 * 4 * 4, 3))
    return mg.nn.bayesify(net, posterior=posterior, prior="normal", kl_samples=5)


def _batch(n=4, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def nn_cases(group, sizes=(1, 5)) -> dict:
    """mg.nn.kl, mg.nn.elbo (whole-network tier + KL) and mg.nn.predict on a bayesified conv net."""
    out = {}
    x, y = _batch()
    for m in sizes:
        net = conv_net()
        params = list(net.parameters())
        kl = mg.nn.kl(net, m, seed=3, process_group=group)
        out[f"nn.kl/float32/M={m}"] = _flat(kl, _grads(kl, params))
        loss = -mg.nn.elbo(net, x, y, num_samples=mg.Sampling(m, chunk_size=2, process_group=group), dataset_size=100, kl_samples=m + 2, seed=4)
        out[f"nn.elbo/float32/M={m}"] = _flat(loss, _grads(loss, params))
        out[f"nn.predict/float32/M={m}"] = mg.nn.predict(net, x, m, chunk_size=2, seed=5, process_group=group)
    out.update(interop_cases(group))
    return out


def interop_cases(group, sizes=(2, 7)) -> dict:
    """mg.interop.kl of a torchbnn model, the Monte Carlo tier forced (empty without torchbnn)."""
    try:
        import torchbnn
    except ImportError:
        return {}
    import mcgraph.interop as interop

    out = {}
    torch.manual_seed(3)
    model = torch.nn.Sequential(torchbnn.BayesLinear(0.0, 0.1, 5, 4), torch.nn.ReLU(),
                                torchbnn.BayesLinear(0.0, 0.1, 4, 3)).double()
    params = list(model.parameters())
    for m in sizes:
        kl = interop.kl(model, m, seed=6, method="fused", process_group=group)
        out[f"interop.kl/float64/M={m}"] = _flat(kl, _grads(kl, params))
    return out


def train_case(group, steps: int = 3) -> dict:
    """A few Adam steps on -elbo; every rank holds the same batch and splits the samples."""
    net = conv_net()
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    x, y = _batch(8)
    for step in range(steps):
        opt.zero_grad()
        loss = -mg.nn.elbo(net, x, y, num_samples=mg.Sampling(3, process_group=group), dataset_size=100, kl_samples=5, seed=100 + step)
        loss.backward()
        opt.step()
    return {"train/float32/params": torch.cat([p.detach().reshape(-1) for p in net.parameters()])}


def ddp_case(group, steps: int = 3) -> dict:
    """DDP over ``group`` (rank r: batch r), KL samples split over the same group, counted once.

    With ``group=None`` the reference: one process averages the data terms of every rank's
    batch and adds the KL once. ``world`` batches are used either way.
    """
    world = 2 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    net = conv_net()
    model = net if group is None else torch.nn.parallel.DistributedDataParallel(net, process_group=group)
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    batches = [_batch(4, seed=10 + r) for r in range(world)]
    for step in range(steps):
        opt.zero_grad()
        if group is None:
            data = sum(mg.nn.expected_data_term(net, x, y, num_samples=3, seed=200 + step)
                       for x, y in batches)
            kl = mg.nn.kl(net, 5, seed=300 + step)
            loss = -(data / world) + kl / 100
        else:
            x, y = batches[rank]
            data = mg.nn.expected_data_term(model, x, y, num_samples=3, seed=200 + step)
            kl = mg.nn.kl(net, 5, seed=300 + step, process_group=group)
            loss = -data + kl / 100
        loss.backward()
        opt.step()
    return {"ddp/params": torch.cat([p.detach().reshape(-1) for p in net.parameters()])}


def optim_cases(group, steps: int = 3) -> dict:
    """VOGN (closure and batched samples) and adaptive VB: K = 3 samples split over the ranks, or the batch split
    over them."""
    from mcgraph.optim import VOGN, AdaptiveVB

    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    out = {}
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g)
    for cls, path in ((VOGN, "closure"), (VOGN, "batched"), (AdaptiveVB, "closure")):
        for parallel in ("samples", "data"):
            torch.manual_seed(8)
            model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(),
                                        torch.nn.Linear(6, 3)).double()
            opt = cls(model, 100, lr=0.05, num_samples=3, seed=9,
                      process_group=group, parallel=parallel)
            xs, ys = (x, y) if parallel == "samples" or group is None else (x[rank::world], y[rank::world])

            def closure():
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(xs), ys)
                loss.backward()
                return loss

            for _ in range(steps):
                if path == "batched":  # the rank's samples in one vmapped pass (VOGN.step_samples)
                    opt.step_samples(lambda: torch.nn.functional.cross_entropy(model(xs), ys), vectorize=True)
                else:
                    opt.step(closure)
            key = f"optim/{cls.__name__}/{parallel}/float64" + ("/batched" if path == "batched" else "")
            out[key] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]
                                 + [t.reshape(-1) for st in opt.state.values() for t in st.values()
                                    if isinstance(t, torch.Tensor) and t.is_floating_point()])
    return out


def fault_cases(group) -> dict:
    """Failures on one rank, and disagreements, raise on every rank; the group stays usable."""
    rank = dist.get_rank(group)
    out = {}
    q = torch.distributions.Normal(torch.zeros(3, requires_grad=True), torch.ones(3))

    def attempt(name, call):
        try:
            call()
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 -- recorded for the test to check
            out[name] = f"{type(e).__name__}: {e}"

    def bad_whole(w):  # chunked tier: raises on rank 1 only (in the probe, before any collective)
        if rank == 1:
            raise ValueError("integrand failed on purpose")
        return torch.logsumexp(w, -1)

    attempt("integrand", lambda: mg.expectation(bad_whole, q, 8, seed=0, process_group=group))

    calls = {"n": 0}

    def bad_later(w):  # raises on rank 1 in the forward, after tracing and the probe succeeded
        calls["n"] += 1
        if rank == 1 and calls["n"] > 2:
            raise ValueError("integrand failed late on purpose")
        return torch.logsumexp(w, -1)

    attempt("integrand-forward", lambda: mg.expectation(bad_later, q, 8, seed=0, process_group=group))

    state = {"backward": False}

    def bad_backward(w):  # raises on rank 1 while the backward replays its chunks
        if rank == 1 and state["backward"]:
            raise ValueError("integrand failed in backward on purpose")
        return torch.logsumexp(w, -1)

    def run_backward():
        v = mg.expectation(bad_backward, q, 8, seed=0, process_group=group)
        state["backward"] = True
        v.backward()

    attempt("integrand-backward", run_backward)
    attempt("seed", lambda: mg.expectation(lambda w: w.abs(), q, 8, seed=rank, process_group=group))
    attempt("num_samples", lambda: mg.kl_divergence(q, torch.distributions.Laplace(0.0, 1.0), 8 + rank,
                                                    seed=0, process_group=group))
    attempt("bad-argument-one-rank", lambda: mg.expectation(
        lambda w: w ** 2, q, 8, seed=0, chunk_size=4 if rank == 0 else 0, process_group=group))
    # seed=None on every rank, with different global RNG states: the ranks still agree on one seed
    torch.manual_seed(1000 + rank)
    out["seed-none"] = mg.expectation(lambda w: torch.logsumexp(w, -1), q, 8, process_group=group).detach()
    # After all of that the group still works and gives the right answer.
    v = mg.expectation(lambda w: w.abs(), q, 8, seed=0, process_group=group)
    out["after"] = v.detach()
    out["is_error_class"] = SampleParallelError.__name__
    return out


CASES = {"engine": engine_cases, "nn": nn_cases, "train": train_case, "ddp": ddp_case, "fault": fault_cases,
         "optim": optim_cases,
         "engine-many": lambda group: engine_cases(group, sizes=(1, 2, 3, 4, 5, 6, 7, 64, 257, 1000)),
         "engine-small": lambda group: engine_cases(group, sizes=(1, 3, 7))}


def worker(rank: int, world: int, store: str, names: list, outdir: str) -> None:
    """One rank: join the gloo group through a FileStore, run the named cases, save what they return."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        results = {}
        for name in names:
            try:
                results[name] = CASES[name](dist.group.WORLD)
            except Exception:  # noqa: BLE001 -- the parent reports it
                results[name] = {"__error__": traceback.format_exc()}
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while another still talks to it (an abort otherwise)
    finally:
        dist.destroy_process_group()
    exit_process(0)  # gloo's threads must not meet interpreter shutdown (see mcgraph.apps.launch)


def torchrun(nproc: int, argv: list, timeout: float = 180.0) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc -m mcgraph *argv`` (one thread per rank); asserts it
    exits with 0 and returns the finished process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(mg.__file__).parents[1]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "mcgraph", *argv]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done
