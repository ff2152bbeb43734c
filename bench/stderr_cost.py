"""What ``return_stderr=True`` costs: time of the same call with and without it, side by side.

Cases (P elements, M samples, float32, same seed):

* ``collapsed-kl`` — ``mg.kl_divergence(Normal, Normal prior)``: the cross term is a degree-2
  polynomial; its variance needs the statistics mean ξ^j for j ≤ 4, accumulated in the same
  noise pass (target: ≤ 1.3× at M = 1000);
* ``collapsed-cubic`` — ``mg.expectation((w − 1)³)``: statistics up to j = 6 instead of 3;
* ``fused`` — ``mg.expectation(log1p(|w|))``: Σh² beside Σh;
* ``chunked`` — ``mg.expectation(logsumexp over rows)``: Σf² over per-sample values;
* ``analytic`` — ``method="analytic"`` for the KL, for scale (no sampling at all).

Each repeat runs the two variants back to back (forward + backward), alternating which goes
first; the median of the per-repeat times and their ratio are reported. Rows go to ``--out``
(JSON lines: case, P, M, seconds_plain, seconds_stderr, ratio, torch, commit).

``--device cuda`` puts the parameters on the GPU (each call synchronised before the clock stops; the rows
then carry ``device``).

Usage (from the repository root; ``PYTHONPATH=.`` makes the checkout's ``mcgraph`` the one imported)::

    python -m bench.stderr_cost --params 100000 --samples 1000 --repeats 9 \
        --out bench/results/stderr_cost.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import mcgraph as mg
from mcgraph.apps import atomic_io
from bench.harness.records import git_commit



def cases(P: int, device="cpu"):
    device = torch.device(device)

    def normal():
        mu = torch.randn(P).to(device).requires_grad_()
        rho = torch.full((P,), -3.0, device=device, requires_grad=True)
        return torch.distributions.Normal(mu, torch.nn.functional.softplus(rho)), (mu, rho)

    prior = torch.distributions.Normal(0.0, 1.0) if device.type == "cpu" else \
        torch.distributions.Normal(*torch.tensor([0.0, 1.0], device=device))
    rows = max(1, P // 16)
    return {
        "collapsed-kl": (lambda q, M, s, e: mg.kl_divergence(q, prior, M, seed=s, method="monte-carlo",
                                                           return_stderr=e), normal),
        "collapsed-cubic": (lambda q, M, s, e: mg.expectation(lambda w: (w - 1) ** 3, q, M, seed=s,
                                                              return_stderr=e), normal),
        "fused": (lambda q, M, s, e: mg.expectation(lambda w: torch.log1p(w.abs()), q, M, seed=s,
                                                    return_stderr=e), normal),
        "chunked": (lambda q, M, s, e: mg.expectation(lambda w: torch.logsumexp(w.reshape(rows, -1), -1), q, M,
                                                      seed=s, return_stderr=e), normal),
        "analytic": (lambda q, M, s, e: mg.kl_divergence(q, prior, M, seed=s, method="analytic",
                                                         return_stderr=e), normal),
    }


def _once(call, make, M: int, seed: int, stderr: bool) -> float:
    q, params = make()
    t0 = time.perf_counter()
    out = call(q, M, seed, stderr)
    value = out.value if stderr else out
    value.sum().backward()
    if value.device.type == "cuda":
        torch.cuda.synchronize(value.device)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=100_000, help="P (default 100000)")
    p.add_argument("--samples", type=int, nargs="+", default=[1000], help="M values (default 1000)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cases", nargs="+", default=None, help="subset of the cases")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the parameters live")
    p.add_argument("--out", default=None, help="append JSON lines here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    commit = git_commit()
    table = []
    for name, (call, make) in cases(args.params, args.device).items():
        if args.cases and name not in args.cases:
            continue
        for M in args.samples:
            _once(call, make, M, 0, False), _once(call, make, M, 0, True)  # warm-up
            plain, with_se = [], []
            for r in range(args.repeats):
                order = (False, True) if r % 2 == 0 else (True, False)
                for e in order:
                    (with_se if e else plain).append(_once(call, make, M, r, e))
            row = {"case": name, "P": args.params, "M": M, "seconds_plain": statistics.median(plain),
                   "seconds_stderr": statistics.median(with_se), "repeats": args.repeats,
                   "threads": torch.get_num_threads(), "torch": torch.__version__, "commit": commit,
                   **({} if args.device == "cpu" else {"device": args.device})}
            row["ratio"] = row["seconds_stderr"] / row["seconds_plain"]
            table.append(row)
            print(f"{name:16s} P={args.params:>9,} M={M:>6}: {row['seconds_plain']:.4f} s -> "
                  f"{row['seconds_stderr']:.4f} s with return_stderr  (×{row['ratio']:.3f})", flush=True)
            if args.out:
                atomic_io.append_line(args.out, json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
