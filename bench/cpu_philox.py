"""The compiled CPU Philox sampler against ``torch.randn``, side by side in one process.

For each P (elements) and thread count, the same M·P standard normals are

* ``randn`` — drawn by ``torch.randn`` alone, in the engine's noise blocks
  (:func:`bench.harness.workloads.randn_floor`: the sampling floor, no reduction);
* ``torch-stats`` — what the collapsed tier does on the torch stream: the seeded noise
  blocks plus the statistics mean ξ, mean ξ² (:func:`mcgraph.engine.noise.statistics.noise_statistics`);
* ``philox-stats`` — the compiled stream's statistics (:func:`mcgraph.engine.noise.cpu_philox.statistics`):
  drawn and reduced in one parallel loop, the noise never materialised;
* with ``--engine``, also ``kl-torch`` / ``kl-philox`` — one ``mg.kl_divergence`` (Normal q,
  Normal prior; collapsed cross term) forward + backward with ``MCGRAPH_BACKEND=torch`` and
  ``MCGRAPH_BACKEND=cpu-philox``.

Each repeat runs the three back to back, rotating which goes first; the best time of each is
reported with the ratios ``randn / philox-stats`` (target ≥ 1.5 on 2 cores) and
``torch-stats / philox-stats``, and the load average before and after. Rows go to ``--out``
(JSON lines).

Usage (from the repository root)::

    python -m bench.cpu_philox --params 16384 --samples 1000 --threads 1,2 --repeats 7 --engine
    python -m bench.cpu_philox --params 11200000 --samples 20 --threads 1,2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import mcgraph as mg
from mcgraph.engine.noise import cpu_philox
from mcgraph.apps import atomic_io
from bench.harness.records import git_commit
from bench.harness.workloads import randn_floor
from mcgraph.engine.noise.streams import BlockStream, rows_per_block
from mcgraph.engine.noise.statistics import noise_statistics



def _torch_stats(P: int, M: int, seed: int) -> None:
    block = rows_per_block(P, M)
    def draw(n, out=None):
        return torch.randn((n, P)) if out is None else torch.randn((n, P), out=out)

    stream = BlockStream(draw, M, block, seed, torch.device("cpu"), owns_rows=True)
    noise_statistics(stream, ((1, 0), (2, 0)), block, torch.float32)


def _kl(P: int, M: int, stream: str):
    mu = torch.zeros(P, requires_grad=True)
    rho = torch.full((P,), -3.0, requires_grad=True)
    prior = torch.distributions.Normal(0.0, 1.0)

    def step():
        os.environ["MCGRAPH_BACKEND"] = stream
        try:
            q = torch.distributions.Normal(mu, torch.nn.functional.softplus(rho))
            mg.kl_divergence(q, prior, M, seed=0, method="monte-carlo").sum().backward()  # not the closed form
        finally:
            os.environ.pop("MCGRAPH_BACKEND")

    return step


def run(P: int, M: int, threads: int, repeats: int, engine: bool = False) -> dict:
    torch.set_num_threads(threads)
    fns = {
        "randn": lambda: randn_floor(P, M),
        "torch-stats": lambda: _torch_stats(P, M, 0),
        "philox-stats": lambda: cpu_philox.statistics("normal", (P,), M, 0, [(1, 0), (2, 0)]),
    }
    if engine:
        fns.update({"kl-torch": _kl(P, M, "torch"), "kl-philox": _kl(P, M, "cpu-philox")})
    names = list(fns)
    best = {n: float("inf") for n in names}
    load_before = os.getloadavg()[0]
    for rep in range(repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            t0 = time.perf_counter()
            fns[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
    return {"P": P, "M": M, "threads": threads, **{f"seconds_{n}": best[n] for n in names},
            "randn_over_philox": best["randn"] / best["philox-stats"],
            "torch_stats_over_philox": best["torch-stats"] / best["philox-stats"],
            **({"kl_torch_over_philox": best["kl-torch"] / best["kl-philox"]} if engine else {}),
            "load_before": load_before, "load_after": os.getloadavg()[0], "isa": cpu_philox.isa(),
            "torch": torch.__version__, "commit": git_commit()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="16384", help="comma-separated P values")
    ap.add_argument("--samples", type=int, default=1000, help="M")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engine", action="store_true", help="also time mg.kl_divergence on both streams")
    ap.add_argument("--device", default="cpu", choices=["cpu"],
                    help="cpu only: the compiled Philox stream is the CPU's sampler (on a GPU the Triton kernels "
                         "draw: bench/kernels.py)")
    ap.add_argument("--out", default=None, help="JSON-lines file to append rows to")
    args = ap.parse_args(argv)
    if cpu_philox.extension() is None:
        raise SystemExit(f"the CPU Philox library could not be built: {cpu_philox.unavailable_reason()}")
    for P in (int(p) for p in args.params.split(",")):
        for threads in (int(t) for t in args.threads.split(",")):
            row = run(P, args.samples, threads, args.repeats, args.engine)
            print(f"P={P} M={args.samples} threads={threads}: randn {row['seconds_randn'] * 1e3:.1f} ms, "
                  f"torch-stats {row['seconds_torch-stats'] * 1e3:.1f} ms, "
                  f"philox-stats {row['seconds_philox-stats'] * 1e3:.1f} ms → randn/philox "
                  f"{row['randn_over_philox']:.2f}×, "
                  f"torch-stats/philox {row['torch_stats_over_philox']:.2f}× "
                  f"(load {row['load_before']:.2f} → {row['load_after']:.2f})", flush=True)
            if args.engine:
                print(f"  kl_divergence: torch stream {row['seconds_kl-torch'] * 1e3:.1f} ms, "
                      f"cpu-philox {row['seconds_kl-philox'] * 1e3:.1f} ms → "
                      f"{row['kl_torch_over_philox']:.2f}×", flush=True)
            if args.out:
                atomic_io.append_line(args.out, json.dumps(row))


if __name__ == "__main__":
    main()
