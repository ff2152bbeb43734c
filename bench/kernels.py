"""Triton kernels against their roofline floors: noise draws per second and bytes per second.

Kernels (each launched through its launcher, so Python overhead is one launch):

* ``noise_stats`` — mean ξ and mean ξ² of N(0, 1) noise per element (collapsed tier);
* ``fused_log_prob`` — E_q[log p(w)] with d/dμ and d/dσ, q = N(μ, σ²), p a scale mixture
  of normals (fused tier);
* ``softmax_mc`` — expected cross-entropy of Gaussian logits, K = 1000 classes,
  B = P / K rows, with d/dm and d/ds;
* ``torch:noise_stats`` and ``torch:fused_log_prob`` — the same quantities in plain torch on the
  same device (``torch.randn`` rows and torch reductions; the vectorised direct estimate with
  backward), chunked at 2²⁶ draws: the baselines the kernels are compared with.

For every P ∈ {10⁶, 10⁷, 10⁸} and M ∈ {1, 100, 1000, 10 000}: the median time of
``triton.testing.do_bench`` (warm-up, then repetitions; inputs rotate over enough copies
to exceed the L2 cache, and every call gets a new seed), the achieved draws/s (P·M / t)
and bytes/s (bytes moved / t), and the floor counted by the roofline method:

* memory floor = bytes moved / bandwidth, with bandwidth measured by a device-to-device
  copy of 1 GiB (``dst.copy_(src)``, 2 GiB moved);
* draw floor = P·M / draw rate, with the Philox + Box–Muller rate measured by a plain
  ``torch.randn(N, out=buf)`` with N = min(P·M, 2²⁸) (scaled linearly beyond: a
  tensor of 10¹² normals does not fit). ``torch.randn`` also writes its N values, so
  this rate is itself a lower bound on generation throughput.

floor = max(memory floor, draw floor); ``of_floor`` = floor / measured time.
Configurations whose estimated time per call exceeds ``--max-seconds`` are listed
as skipped (raise it to run P = 10⁸, M = 10⁴).

Rows are appended to ``--out`` as CSV (kernel, P, M, device, version, commit, …);
the table is printed last. Needs a CUDA device: on CPU the script says why it
skips. ``--smoke`` runs tiny sizes on CPU in Triton's interpreter to exercise the
code (timings meaningless, no CSV unless ``--out`` is given).

Usage::

    python -m bench.kernels --out bench/results/kernels.csv
    python -m bench.kernels --sizes 1000000 --samples 1 100 --max-seconds 5
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

_ARGV = sys.argv[1:]
if "--smoke" in _ARGV or "--device=cpu" in _ARGV or ("--device", "cpu") in zip(_ARGV, _ARGV[1:]):
    os.environ["TRITON_INTERPRET"] = "1"  # the interpreter must be chosen before the kernels are imported

import torch  # noqa: E402

from mcgraph.apps import atomic_io  # noqa: E402
from bench.harness.records import git_commit  # noqa: E402

SIZES = (10**6, 10**7, 10**8)
SAMPLES = (1, 100, 1000, 10_000)
CLASSES = 1000
L2_ROTATE_BYTES = 256 * 2**20  # rotate inputs until the copies exceed this (H100 L2: 50 MiB)
FIELDS = ("kernel", "P", "M", "device", "version", "commit", "median_ms", "draws_per_s", "bytes_per_s",
          "floor_ms", "floor_kind", "of_floor", "bandwidth_Bps", "randn_draws_per_s")


def _version() -> str:
    import triton

    import mcgraph

    return f"mcgraph {mcgraph.__version__}; triton {triton.__version__}; torch {torch.__version__}"


# --------------------------------------------------------------------------- workloads


class Workload:
    """One kernel at one (P, M): ``make()`` builds an input set, ``run(inputs, seed)`` launches once."""

    name = ""

    def __init__(self, P: int, M: int, device):
        self.P, self.M, self.device = P, M, device

    def bytes_moved(self) -> int:
        raise NotImplementedError

    def make(self):
        raise NotImplementedError

    def run(self, inputs, seed: int):
        raise NotImplementedError


class NoiseStats(Workload):
    name = "noise_stats"
    keys = ((1, 0), (2, 0))

    def bytes_moved(self):
        return 4 * self.P * len(self.keys)  # the statistics written; ξ never leaves registers

    def make(self):
        return None

    def run(self, inputs, seed):
        from mcgraph.kernels.noise_stats import noise_statistics

        noise_statistics("normal", (self.P,), self.M, seed, self.keys, torch.float32, self.device)


class FusedLogProb(Workload):
    name = "fused_log_prob"

    def bytes_moved(self):
        return 4 * self.P * 5  # read μ, σ; write value, d/dμ, d/dσ

    def make(self):
        from mcgraph.distributions import ScaleMixtureNormal
        from mcgraph.kernels.fused_elementwise import FormKind, FusedSpec
        from mcgraph.kernels.integrands import integrand_for
        from mcgraph.kernels.noise_laws import noise_law

        prior = ScaleMixtureNormal(*torch.tensor([0.5, 1.0, 0.05], device=self.device))
        loc = torch.randn(self.P, device=self.device)
        scale = torch.rand(self.P, device=self.device) + 0.1
        spec = lambda seed: FusedSpec(integrand_for(prior), noise_law("normal"), FormKind.LOCATION_SCALE,  # noqa: E731
                                      torch.Size((self.P,)), 0, self.M, seed)
        return spec, loc, scale, tuple(integrand_for(prior).params(prior))

    def run(self, inputs, seed):
        from mcgraph.kernels.fused_elementwise import fused_log_prob_forward

        spec, loc, scale, params = inputs
        fused_log_prob_forward(spec(seed), loc, scale, params, True, True, (False,) * len(params))


class SoftmaxMC(Workload):
    name = "softmax_mc"

    def bytes_moved(self):
        rows = self.P // CLASSES
        return 4 * self.P * 4 + rows * (8 + 4)  # read m, s; write d/dm, d/ds; targets in, loss out

    def make(self):
        rows = max(1, self.P // CLASSES)
        mean = torch.randn(rows, CLASSES, device=self.device)
        std = torch.rand(rows, CLASSES, device=self.device)
        targets = torch.randint(0, CLASSES, (rows,), device=self.device)
        return mean, std, targets

    def run(self, inputs, seed):
        from mcgraph.kernels.softmax_mc import softmax_forward_triton

        mean, std, targets = inputs
        softmax_forward_triton(mean, std, targets, self.M, seed, True)


def _row_chunks(P: int, M: int, max_elements: int = 2**26):
    """Split M rows of P draws into chunks of at most ``max_elements`` (at least one row each)."""
    step = max(1, max_elements // max(1, P))
    return [(i, min(M, i + step)) for i in range(0, M, step)]


class TorchNoiseStats(NoiseStats):
    """Baseline of ``noise_stats``: ``torch.randn`` rows, then mean ξ and mean ξ² by torch reductions
    (in chunks of 2²⁶ draws, so that M·P need not fit in memory)."""

    name = "torch:noise_stats"

    def run(self, inputs, seed):
        s1 = torch.zeros(self.P, device=self.device)
        s2 = torch.zeros(self.P, device=self.device)
        for lo, hi in _row_chunks(self.P, self.M):
            xi = torch.randn(hi - lo, self.P, device=self.device)
            s1 += xi.sum(0)
            s2 += xi.square().sum(0)
        return s1 / self.M, s2 / self.M


class TorchFusedLogProb(FusedLogProb):
    """Baseline of ``fused_log_prob``: the vectorised direct estimate in torch, value and gradients:
    ``w = μ + σ·torch.randn(M, P)``, ``p.log_prob(w).mean(0)`` summed, then backward (chunked as above)."""

    name = "torch:fused_log_prob"

    def make(self):
        from mcgraph.distributions import ScaleMixtureNormal

        prior = ScaleMixtureNormal(*torch.tensor([0.5, 1.0, 0.05], device=self.device))
        loc = torch.randn(self.P, device=self.device).requires_grad_()
        scale = (torch.rand(self.P, device=self.device) + 0.1).requires_grad_()
        return prior, loc, scale

    def run(self, inputs, seed):
        prior, loc, scale = inputs
        value = 0.0
        for lo, hi in _row_chunks(self.P, self.M):
            w = loc + scale * torch.randn(hi - lo, self.P, device=self.device)
            part = prior.log_prob(w).sum() / self.M
            part.backward()
            value += part.detach()
        return value


WORKLOADS = (NoiseStats, TorchNoiseStats, FusedLogProb, TorchFusedLogProb, SoftmaxMC)


# --------------------------------------------------------------------------- floors


def _bench(fn, quick: bool) -> float:
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench`` (warm-up 25 ms, 100 ms of repetitions)."""
    import triton.testing

    if quick:  # interpreter smoke run
        import time

        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def measure_bandwidth(device, quick: bool) -> float:
    """Bytes/s of a device-to-device copy (read + write)."""
    n = (2**18 if quick else 2**28)
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src), quick)
    return 2 * 4 * n / (ms * 1e-3)


def measure_randn(device, count: int, quick: bool) -> float:
    """Normal draws/s of ``torch.randn`` (Philox + Box–Muller) for min(count, 2²⁸) draws."""
    n = max(1, min(count, 2**16 if quick else 2**28))
    buf = torch.empty(n, dtype=torch.float32, device=device)
    ms = _bench(lambda: torch.randn(n, out=buf), quick)
    return n / (ms * 1e-3)


# --------------------------------------------------------------------------- driver


def run(sizes, samples, max_seconds: float, device, quick: bool):
    bandwidth = measure_bandwidth(device, quick)
    rates: dict[int, float] = {}
    rows, skipped = [], []
    version, commit = _version(), git_commit()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    for P in sizes:
        for M in samples:
            draws = P * M
            key = min(draws, 2**28)
            if key not in rates:
                rates[key] = measure_randn(device, draws, quick)
            for cls in WORKLOADS:
                work = cls(P, M, device)
                mem_floor = work.bytes_moved() / bandwidth
                draw_floor = draws / rates[key]
                floor = max(mem_floor, draw_floor)
                if not quick and floor > max_seconds:
                    skipped.append(f"{work.name} P={P:.0e} M={M}: floor {floor:.1f} s > --max-seconds {max_seconds}")
                    continue
                copies = 1 if quick else max(1, min(8, L2_ROTATE_BYTES // max(1, work.bytes_moved())))
                inputs = [work.make() for _ in range(copies)]
                state = {"call": 0}

                def call(work=work, inputs=inputs, state=state):
                    state["call"] += 1
                    work.run(inputs[state["call"] % len(inputs)], seed=state["call"])

                ms = _bench(call, quick)
                t = ms * 1e-3
                rows.append({
                    "kernel": work.name, "P": P, "M": M, "device": device_name, "version": version,
                    "commit": commit, "median_ms": f"{ms:.4f}", "draws_per_s": f"{draws / t:.4g}",
                    "bytes_per_s": f"{work.bytes_moved() / t:.4g}", "floor_ms": f"{1e3 * floor:.4f}",
                    "floor_kind": "draws" if draw_floor >= mem_floor else "bytes", "of_floor": f"{floor / t:.3f}",
                    "bandwidth_Bps": f"{bandwidth:.4g}", "randn_draws_per_s": f"{rates[key]:.4g}",
                })
                del inputs
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows, skipped


def _table(rows) -> str:
    cols = ("kernel", "P", "M", "median_ms", "draws_per_s", "bytes_per_s", "floor_ms", "floor_kind", "of_floor")
    cells = [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[k]) for row in cells)) if cells else len(c) for k, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="P values")
    parser.add_argument("--samples", type=int, nargs="+", default=list(SAMPLES), help="M values")
    parser.add_argument("--max-seconds", type=float, default=1.0,
                        help="skip configurations whose floor exceeds this many seconds per call")
    parser.add_argument("--out", type=Path, default=None,
                        help="CSV file to append rows to (default: bench/results/kernels.csv on CUDA)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on CPU in Triton's interpreter (exercises the code; timings meaningless)")
    parser.add_argument("--device", default=None, choices=["cuda", "cpu"],
                        help="cuda (the default: the kernels are GPU kernels) or cpu (Triton's interpreter, "
                             "TRITON_INTERPRET=1, at the given sizes; the default with --smoke)")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.smoke else "cuda"
    if args.smoke and args.device != "cpu":
        parser.error("--smoke runs on the CPU, in Triton's interpreter")

    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench/kernels.py: skipped — triton is not installed")
        return 0
    if args.smoke:
        device, sizes, samples = torch.device("cpu"), [1003], [1, 4]
        out = args.out
    elif args.device == "cpu":
        device, sizes, samples = torch.device("cpu"), args.sizes, args.samples
        out = args.out
    else:
        if not torch.cuda.is_available():
            print("bench/kernels.py: skipped — no CUDA device (the kernels' timings are only meaningful compiled "
                  "on a GPU; on CPU they run in Triton's Python interpreter). Use --smoke to exercise the code.")
            return 0
        device, sizes, samples = torch.device("cuda"), args.sizes, args.samples
        out = args.out or Path(__file__).resolve().parent / "results" / "kernels.csv"

    rows, skipped = run(sizes, samples, args.max_seconds, device, quick=args.smoke)
    if out is not None and rows:
        out.parent.mkdir(parents=True, exist_ok=True)
        old = out.read_text() if out.exists() else ""
        with atomic_io.atomic_write(out, "w") as f:  # the old rows and the new ones, or the old file untouched
            f.write(old)
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            if not old:
                writer.writeheader()
            writer.writerows(rows)
        print(f"{len(rows)} rows appended to {out}")
    for line in skipped:
        print("skipped:", line)
    print(f"device: {rows[0]['device'] if rows else device}; bandwidth {rows[0]['bandwidth_Bps'] if rows else '?'} B/s")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
