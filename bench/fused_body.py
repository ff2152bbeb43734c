"""The fused tier's chunk bodies side by side: autograd (before), forward rules eager, compiled.

    python -m bench.fused_body --pairs normal-scalemix normal-laplace --P 16384 --M 1000 --threads 1 2

One process, interleaved rounds, best of ``--repeats``: for each KL pair and thread count it
times ``KL(q ‖ p)`` forward + backward by the fused tier (``KLCase.run("fused", …)``) with each
chunk body (``MCGRAPH_FUSED_BODY`` = ``autograd`` | ``eager`` | ``compiled``; flush-to-zero on and
off for the forward-rule bodies) next to the sampling floor (``randn_floor``: plain
``torch.randn`` of the same M·P draws in the engine's blocks), and a breakdown of a compiled
call: drawing the noise blocks alone, the chunk bodies alone over pre-drawn noise. The load
average is printed beside every round (the machine may be shared). Rows go to
``<out>/fused_body.json``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch

from mcgraph.apps import atomic_io
from bench.harness.workloads import KLCase, randn_floor
from mcgraph.engine.estimators import fused_body
from mcgraph.engine.estimators.sampling import default_chunk, stream_for

VARIANTS = {  # name -> (MCGRAPH_FUSED_BODY, flush denormals)
    "autograd": ("autograd", False),
    "eager": ("eager", True),
    "eager-noftz": ("eager", False),
    "compiled": ("compiled", True),
    "compiled-noftz": ("compiled", False),
}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _call(case: KLCase, variant: str, M: int):
    mode, ftz = VARIANTS[variant]
    os.environ["MCGRAPH_FUSED_BODY"] = mode
    fused_body.FLUSH_DENORMALS = ftz
    try:
        case.run("fused", M, 0)
        case.zero_grad()
    finally:
        os.environ.pop("MCGRAPH_FUSED_BODY", None)
        fused_body.FLUSH_DENORMALS = True
    return fused_body.last_path()


def _breakdown(case: KLCase, M: int):
    """Drawing the noise alone, and the compiled chunk bodies alone over pre-drawn noise."""
    import mcgraph as mg
    from mcgraph.engine.estimators.derivatives import lower
    from mcgraph.engine.estimators.fused import _body_spec, FusedSpec

    q = case.posterior()
    form = mg.family_of(q)
    chunk = default_chunk(form, M, "fused")

    def draw():
        for _ in stream_for(form, 0, M).chunks(chunk):
            pass

    plan = mg.explain(case.prior.log_prob, q)
    term = next(t for t in plan.terms if t.node is not None)
    low = lower(term.node)
    spec = FusedSpec(form, term.node, (), 0, M, chunk, torch.Size(form.shape), lowered=low)
    body = _body_spec(spec, [True, True])
    tensors = tuple(t.detach() for t in low.tensors)
    rows = [xi for _, _, xi in stream_for(form, 0, M).chunks(chunk)]
    loc, scale = form.loc.detach(), form.scale.detach()

    def bodies():
        with fused_body.flush_denormals():
            for xi in rows:
                fused_body.run_chunk(body, True, xi, loc, scale, tensors)

    bodies()  # compiled (or cached) before timing
    return draw, bodies


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", nargs="+", default=["normal-scalemix", "normal-laplace"])
    ap.add_argument("--P", type=int, default=16384)
    ap.add_argument("--M", type=int, default=1000)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--device", default="cpu", choices=["cpu"],
                    help="cpu only: these are the CPU fused tier's chunk bodies (on a GPU the fused tier is the Triton "
                         "kernel: bench/kernels.py)")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    rows = []
    for name in args.pairs:
        case = KLCase(name, args.P)
        for threads in args.threads:
            torch.set_num_threads(threads)
            for v in args.variants:  # warm-up: compiles once per program and thread count (not timed)
                t0 = time.perf_counter()
                path = _call(case, v, args.M)
                print(f"{name}: warm-up {v} ({path}, {threads} threads) {time.perf_counter() - t0:.1f} s",
                      flush=True)
            draw, bodies = _breakdown(case, args.M)
            best = {k: math.inf for k in ["randn", "draw", "bodies"] + list(args.variants)}
            loads = []
            for _ in range(args.repeats):
                loads.append(os.getloadavg()[0])
                best["randn"] = min(best["randn"], _timed(lambda: randn_floor(args.P, args.M)))
                for v in args.variants:
                    best[v] = min(best[v], _timed(lambda: _call(case, v, args.M)))
                best["draw"] = min(best["draw"], _timed(draw))
                best["bodies"] = min(best["bodies"], _timed(bodies))
            floor = best["randn"]
            print(f"\n{name}  P = {args.P}  M = {args.M}  threads = {threads}  "
                  f"load average {min(loads):.2f}–{max(loads):.2f}  (best of {args.repeats})")
            for k, t in best.items():
                print(f"  {k:16s} {t * 1e3:9.1f} ms   {t / floor:6.2f}× randn")
                rows.append({"pair": name, "P": args.P, "M": args.M, "threads": threads, "what": k,
                             "seconds": t, "ratio_to_randn": t / floor, "load_min": min(loads),
                             "load_max": max(loads), "torch": torch.__version__})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_io.write_json(out / "fused_body.json", rows, indent=1)
    print(f"\nrows: {out / 'fused_body.json'}")


if __name__ == "__main__":
    main()
