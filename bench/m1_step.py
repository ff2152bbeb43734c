"""One M = 1 training step: bayesian-torch's own loop vs the same model converted with ``to_mcgraph``.

Workload (``bench/elbo_peers.py``'s peer): the MLP 784-1000-1000-10 (P ≈ 1.8 M weights and
biases) built in bayesian-torch with ``dnn_to_bnn`` (N(0, 1) prior, ρ₀ = −3), batch 32,
N = 60 000. One step is what a user's loop runs at M = 1:

* ``bayesian-torch``: ``zero_grad``; ``cross_entropy(model(x), y) + get_kl_loss(model) / N``
  (one weight sample per layer, closed-form KL); ``backward``; ``Adam.step``;
* ``mcgraph``: a second copy of the same model after ``mcgraph.interop.bayesian_torch.to_mcgraph``;
  ``zero_grad``; ``-mg.nn.elbo(bnn, x, y, num_samples=1, dataset_size=N)`` (the KL under the default
  ``method="auto"``: torch's closed form); ``backward``; ``Adam.step``.

Modes (all in one run by default):

* ``interleaved``: the two steps alternated in one process, ``--reps`` times each after a
  warm-up, at 1 and 2 threads; the ratio of medians (target ≤ 1.15×), also for forward+backward
  alone (no optimizer);
* ``fresh``: each provider in ``--fresh-runs`` fresh processes (interleaved order): import, build,
  and the first ``--fresh-steps`` steps timed one by one; the ratio of the first step and of the
  whole (target ≤ 1.3×), and what the first call costs;
* ``profile``: ``torch.profiler`` over 20 steps of each: ``randn`` / ``normal_`` / ``softplus`` calls
  per step, and the top operators.

The machine may be shared with other jobs: every ratio is measured side by side in one run.

``--device cuda`` puts both models and the batch on the GPU; every timed step is synchronised before the
clock stops, and the profile records the CUDA kernels too.

Usage::

    python -m bench.m1_step                    # all modes, prints a table
    python -m bench.m1_step --modes interleaved --reps 40 --json out.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from bench import child_env

SIZES = (784, 1000, 1000, 10)
BATCH, DATASET = 32, 60_000
RHO_INIT = -3.0
PROVIDERS = ("bayesian-torch", "mcgraph")
TARGET_INTERLEAVED, TARGET_FRESH = 1.15, 1.3
DEVICE = torch.device("cpu")  # where the models and the batch live (--device)


def _data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (BATCH,), generator=g)
    return x.to(DEVICE), y.to(DEVICE)


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _peer_model():
    from bayesian_torch.models.dnn_to_bnn import dnn_to_bnn

    # Built here, not by mcgraph.apps.training_run.mlp: the fresh bayesian-torch process times its
    # imports and its build without importing mcgraph.
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    dnn_to_bnn(model, {"prior_mu": 0.0, "prior_sigma": 1.0, "posterior_mu_init": 0.0, "posterior_rho_init": RHO_INIT,
                       "type": "Reparameterization", "moped_enable": False})
    return model.to(DEVICE)


def build(provider: str):
    """``(model, optimizer, loss_fn)`` of one provider."""
    model = _peer_model()
    if provider == "mcgraph":
        import mcgraph as mg
        from mcgraph import interop

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the conversion's note on the KL's scale
            model = interop.bayesian_torch.to_mcgraph(model, kl_samples=1)

        def loss_fn(m, x, y):
            return -mg.nn.elbo(m, x, y, num_samples=1, dataset_size=DATASET)
    elif provider == "bayesian-torch":
        from bayesian_torch.models.dnn_to_bnn import get_kl_loss

        def loss_fn(m, x, y):
            return F.cross_entropy(m(x), y) + get_kl_loss(m) / DATASET
    else:
        raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")
    return model, torch.optim.Adam(model.parameters(), lr=1e-4), loss_fn


def step(built, x, y, optimizer_step: bool = True) -> None:
    model, opt, loss_fn = built
    opt.zero_grad(set_to_none=True)
    loss_fn(model, x, y).backward()
    if optimizer_step:
        opt.step()
    _sync()


def interleaved(threads: int, reps: int, warmup: int = 3) -> dict:
    torch.set_num_threads(threads)
    x, y = _data()
    built = {p: build(p) for p in PROVIDERS}
    out = {}
    for with_opt in (True, False):
        times = {p: [] for p in PROVIDERS}
        for _ in range(warmup):
            for p in PROVIDERS:
                step(built[p], x, y, with_opt)
        for i in range(reps):
            order = PROVIDERS if i % 2 == 0 else PROVIDERS[::-1]
            for p in order:
                _sync()
                t0 = time.perf_counter()
                step(built[p], x, y, with_opt)
                times[p].append(time.perf_counter() - t0)
        med = {p: statistics.median(t) for p, t in times.items()}
        out["step" if with_opt else "forward+backward"] = {
            "bayesian_torch_ms": 1e3 * med["bayesian-torch"], "mcgraph_ms": 1e3 * med["mcgraph"],
            "ratio": med["mcgraph"] / med["bayesian-torch"]}
    return out


def _child(provider: str, steps: int) -> None:
    """One fresh process: import, build, and ``steps`` steps timed one by one (JSON on stdout)."""
    t0 = time.perf_counter()
    importlib.import_module("bayesian_torch")
    if provider == "mcgraph":
        importlib.import_module("mcgraph")
    t_import = time.perf_counter() - t0
    x, y = _data()
    t0 = time.perf_counter()
    built = build(provider)
    t_build = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(built, x, y)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"provider": provider, "import_s": t_import, "build_s": t_build, "steps_s": times}))


def fresh(runs: int, steps: int, threads: int) -> dict:
    rows = {p: [] for p in PROVIDERS}
    env = child_env(OMP_NUM_THREADS=str(threads))
    for i in range(runs):
        for p in (PROVIDERS if i % 2 == 0 else PROVIDERS[::-1]):
            r = subprocess.run([sys.executable, "-m", "bench.m1_step", "--child", p, "--fresh-steps", str(steps),
                                "--device", DEVICE.type], capture_output=True, text=True, env=env, check=True)
            rows[p].append(json.loads(r.stdout.strip().splitlines()[-1]))

    def med(p, f):
        return statistics.median(f(r) for r in rows[p])

    first = {p: med(p, lambda r: r["steps_s"][0]) for p in PROVIDERS}
    rest = {p: med(p, lambda r: statistics.median(r["steps_s"][1:])) for p in PROVIDERS}
    total = {p: med(p, lambda r: sum(r["steps_s"])) for p in PROVIDERS}
    return {"threads": threads, "runs": runs, "steps": steps,
            "import_s": {p: med(p, lambda r: r["import_s"]) for p in PROVIDERS},
            "build_s": {p: med(p, lambda r: r["build_s"]) for p in PROVIDERS},
            "first_step_ms": {p: 1e3 * v for p, v in first.items()},
            "later_step_ms": {p: 1e3 * v for p, v in rest.items()},
            "all_steps_ms": {p: 1e3 * v for p, v in total.items()},
            "ratio_first": first["mcgraph"] / first["bayesian-torch"],
            "ratio_all_steps": total["mcgraph"] / total["bayesian-torch"]}


def profile(steps: int = 20) -> dict:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    x, y = _data()
    out = {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
    for p in PROVIDERS:
        built = build(p)
        for _ in range(3):
            step(built, x, y)
        with torch_profile(activities=activities) as prof:
            for _ in range(steps):
                step(built, x, y)
        events = prof.key_averages()
        count = {}
        for e in events:
            for key in ("randn", "normal_", "softplus", "log1p", "exp"):
                if e.key in (f"aten::{key}",):
                    count[key] = count.get(key, 0) + e.count
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
        out[p] = {"per_step": {k: v / steps for k, v in count.items()},
                  "top_self_cpu_ms_per_step": [(e.key, round(e.self_cpu_time_total / 1e3 / steps, 3), e.count // steps)
                                               for e in top]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["interleaved", "fresh", "profile"],
                    choices=["interleaved", "fresh", "profile"])
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--fresh-runs", type=int, default=3)
    ap.add_argument("--fresh-steps", type=int, default=10)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the models and batch live")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False")
    if args.child:
        _child(args.child, args.fresh_steps)
        return 0
    results = {"torch": torch.__version__, "cpus": os.cpu_count(), **({} if DEVICE.type == "cpu" else
                                                                        {"device": DEVICE.type})}
    if "interleaved" in args.modes:
        for t in args.threads:
            r = interleaved(t, args.reps)
            results[f"interleaved_{t}t"] = r
            for what, v in r.items():
                print(f"interleaved, {t} thread(s), {what:17s}: bayesian-torch {v['bayesian_torch_ms']:7.1f} ms  "
                      f"mcgraph {v['mcgraph_ms']:7.1f} ms  ratio {v['ratio']:.2f}x  (target <= {TARGET_INTERLEAVED}x)",
                      flush=True)
    if "fresh" in args.modes:
        for t in args.threads:
            r = fresh(args.fresh_runs, args.fresh_steps, t)
            results[f"fresh_{t}t"] = r
            print(f"fresh processes, {t} thread(s), median of {r['runs']}: first step bayesian-torch "
                  f"{r['first_step_ms']['bayesian-torch']:.1f} ms, mcgraph {r['first_step_ms']['mcgraph']:.1f} ms "
                  f"(ratio {r['ratio_first']:.2f}x); first {r['steps']} steps {r['all_steps_ms']['bayesian-torch']:.0f} "
                  f"vs {r['all_steps_ms']['mcgraph']:.0f} ms (ratio {r['ratio_all_steps']:.2f}x, target <= "
                  f"{TARGET_FRESH}x); later steps {r['later_step_ms']['bayesian-torch']:.1f} vs "
                  f"{r['later_step_ms']['mcgraph']:.1f} ms; import {r['import_s']['bayesian-torch']:.2f} vs "
                  f"{r['import_s']['mcgraph']:.2f} s, build {r['build_s']['bayesian-torch']:.2f} vs "
                  f"{r['build_s']['mcgraph']:.2f} s", flush=True)
    if "profile" in args.modes:
        torch.set_num_threads(args.threads[-1])
        r = profile()
        results["profile"] = r
        for p, v in r.items():
            print(f"profile {p}: per step {v['per_step']}")
            for key, ms, n in v["top_self_cpu_ms_per_step"]:
                print(f"    {key:40s} {ms:8.3f} ms/step  x{n}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
