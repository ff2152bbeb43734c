"""Large-P speed targets, side by side with the figures they must beat.

    python -m bench.large_p --P 1000000 --M 100 --threads 1 2 --reps 5 --out bench/results/large_p.jsonl

For each thread count, interleaved repeat by repeat in one process (medians of ``--reps`` after one
warm-up call of each):

* ``fused``: KL(Normal q ‖ scale-mixture prior) forward + backward on the fused tier
  (``method="fused"``) against ``torch.randn(M, P)`` — target ≤ 2.5×;
* ``radial``: the sampled KL (``method="monte-carlo"``: Radial ‖ Normal also has an exact form) of a
  Radial q against the same KL of a Normal q, same P and M, Normal(0, 1) prior — target ≤ 1.3×, with
  system time under 10 % of the Radial call's CPU time.

Wall-clock seconds (the ratios), process CPU seconds and system seconds (``getrusage``) per call; the
load average is printed beside every result, since the machine may be shared.

``--device cuda`` puts the parameters (and the priors' parameters) on the GPU: the fused tier is then the
Triton kernel, every call is synchronised before the clock stops, and the rows carry ``device``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import torch

import mcgraph as mg
from mcgraph.distributions import Radial, ScaleMixtureNormal

TARGETS = {"fused": 2.5, "radial": 1.3}


def cases(P: int, M: int, device="cpu") -> dict:
    """name -> zero-argument callables, timed one after the other."""
    device = torch.device(device)
    shape = (P // 1000, 1000) if P % 1000 == 0 else (P,)
    loc = torch.zeros(shape, requires_grad=True, device=device)
    rho = torch.full(shape, -2.0, requires_grad=True, device=device)
    if device.type == "cpu":
        normal_prior = torch.distributions.Normal(0.0, 1.0)
        mixture = ScaleMixtureNormal(0.5, 1.0, 1e-3)
    else:
        normal_prior = torch.distributions.Normal(*torch.tensor([0.0, 1.0], device=device))
        mixture = ScaleMixtureNormal(*torch.tensor([0.5, 1.0, 1e-3], device=device))

    def synced(call):
        if device.type != "cuda":
            return call

        def run():
            call()
            torch.cuda.synchronize(device)
        return run

    def kl(q_type, prior, method):
        def call():
            loc.grad = rho.grad = None
            q = q_type(loc, torch.nn.functional.softplus(rho))
            mg.kl_divergence(q, prior, M, seed=0, method=method).sum().backward()
        return synced(call)

    return {"fused-scale-mixture": kl(torch.distributions.Normal, mixture, "fused"),
            "randn(M, P)": synced(lambda: torch.randn(M, P, device=device)),
            "normal-monte-carlo": kl(torch.distributions.Normal, normal_prior, "monte-carlo"),
            "radial-monte-carlo": kl(Radial, normal_prior, "monte-carlo")}


def measure(P: int, M: int, threads: int, reps: int, device="cpu") -> dict:
    torch.set_num_threads(threads)
    calls = cases(P, M, device)
    for f in calls.values():  # warm-up: builds, plan cache, allocator
        f()
    rows = {name: {"wall": [], "cpu": [], "sys": []} for name in calls}
    for _ in range(reps):
        for name, f in calls.items():
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            f()
            wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            rows[name]["wall"].append(wall)
            rows[name]["cpu"].append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
            rows[name]["sys"].append(r1.ru_stime - r0.ru_stime)
    med = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in rows.items()}
    return {"P": P, "M": M, "threads": threads, "reps": reps, "load": os.getloadavg()[0],
            "median_s": med,
            "fused_over_randn": med["fused-scale-mixture"]["wall"] / med["randn(M, P)"]["wall"],
            "radial_over_normal": med["radial-monte-carlo"]["wall"] / med["normal-monte-carlo"]["wall"],
            "radial_sys_share": med["radial-monte-carlo"]["sys"] / max(med["radial-monte-carlo"]["cpu"], 1e-9),
            "torch": torch.__version__, **({} if torch.device(device).type == "cpu" else {"device": str(device)})}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--P", type=int, default=1_000_000)
    ap.add_argument("--M", type=int, default=100)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the parameters live")
    ap.add_argument("--out", default=None, help="append one JSON line per thread count")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False")
    for threads in args.threads:
        row = measure(args.P, args.M, threads, args.reps, args.device)
        med = row["median_s"]
        print(f"P = {args.P}, M = {args.M}, {threads} thread(s), load {row['load']:.2f}:")
        for name, m in med.items():
            print(f"  {name:22s} {m['wall'] * 1e3:9.1f} ms wall  {m['cpu'] * 1e3:9.1f} ms CPU  "
                  f"{m['sys'] * 1e3:7.1f} ms sys")
        print(f"  fused / randn   {row['fused_over_randn']:.2f}x  (target <= {TARGETS['fused']}x)")
        print(f"  radial / normal {row['radial_over_normal']:.2f}x  (target <= {TARGETS['radial']}x), "
              f"system time {100 * row['radial_sys_share']:.1f} % of the Radial call's CPU (target < 10 %)")
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
