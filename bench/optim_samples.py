"""Many weight samples per step: IVON's batched K-sample step against K = 1 and the sequential K-pass loop.

Workload (the peer MLP of ``bench/elbo_peers.py``, whose model and data this script reuses): a plain
784-1000-1000-10 MLP (``--sizes``), batch 32, cross-entropy, one optimizer step per timed repeat.

Points (``--points``, each ``optimizer:path:K``), every one in a fresh subprocess so that its peak RSS
is its own:

* ``ivon:batched:K`` — ``IVON.step_samples(loss_fn)``: the K samples' noise in ``(K, *shape)`` rows,
  the K weight samples stacked and one ``vmap(grad(...))`` forward and backward;
* ``ivon:sequential:K`` — K ``sampled_params(train=True)`` blocks, one forward and backward each
  (``K = 1`` is the plain IVON step);
* ``vogn:sequential:K`` — ``VOGN.step(closure)`` with ``num_samples=K``: one closure call per
  sample, the per-example squared gradients recorded by module hooks;
* ``vogn:batched:K`` — ``VOGN.step_samples(loss_fn, vectorize=True)``: the K weight samples stacked,
  one ``vmap(grad(...))`` forward and backward, the squared gradients from zero probes on the layers'
  outputs (:mod:`mcgraph.optim.batched_samples`);
* ``adam:sequential:1`` — ``torch.optim.Adam``, for scale.

Measured per point: ``step_s`` / ``cpu_s``, the median wall-clock and thread-CPU time of
``--reps`` steps after 3 warm-up steps (with ``--threads 1``, the default, all of torch's work runs
on the calling thread, so the CPU time is robust to other load on a shared machine), and
``peak_rss_bytes``, the subprocess's peak resident memory. ``--interleaved`` also times
``ivon:sequential:1``, ``ivon:batched:8``, ``ivon:sequential:8``, ``vogn:sequential:1`` and
``vogn:batched:8`` alternately in one process (the ratios a busy machine cannot skew). The summary
prints the ratios against ``ivon:sequential:1`` (VOGN's also against ``vogn:sequential:1``) and
the targets (K = 8 step ≤ 3× and peak RSS ≤ 1.5× K = 1), with the noise floor: the time of drawing
K·P standard normals alone (``noise_floor_cpu_s``: thread-CPU time on the CPU, synchronised wall-clock
time on CUDA). A point whose process fails is named at the end, and the script exits with 1.

``--device cuda`` runs the model, data and optimizer state on the GPU: times are then wall-clock with
the device synchronised around each step, the ratios use them, and the memory is the point's peak
``torch.cuda.max_memory_allocated`` (``peak_bytes``) instead of the process's RSS.

Usage::

    python -m bench.optim_samples --out bench/results/optim_samples.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import elbo_peers  # the peer MLP and its data
import mcgraph as mg
from mcgraph.apps import atomic_io
from bench.harness.records import git_commit
from bench import child_env

POINTS = ("adam:sequential:1", "ivon:sequential:1", "ivon:batched:2", "ivon:batched:4", "ivon:batched:8",
          "ivon:sequential:8", "vogn:sequential:1", "vogn:batched:8", "vogn:sequential:8")
INTERLEAVED = ("ivon:sequential:1", "ivon:batched:8", "ivon:sequential:8", "vogn:sequential:1", "vogn:batched:8")
#: Where the model, data and optimizer state live (``--device``).
DEVICE = torch.device("cpu")
#: Samples per vmapped pass of the batched points (``--chunk-size``; ``None``: the optimizers' default).
CHUNK_SIZE = None


def parse(point: str) -> tuple[str, str, int]:
    try:
        optimizer, path, k = point.split(":")
        k = int(k)
    except ValueError:
        raise ValueError(f"point must be optimizer:path:K, got {point!r}") from None
    if optimizer not in ("ivon", "vogn", "adam") or path not in ("batched", "sequential") or k < 1:
        raise ValueError(f"point: unknown optimizer or path, or K < 1: {point!r}")
    if path == "batched" and optimizer == "adam":
        raise ValueError(f"point: adam has no batched path, got {point!r}")
    return optimizer, path, k


def stepper(point: str, seed: int = 0):
    """``step()``: one optimizer step of ``point`` on the peer MLP and its batch."""
    optimizer, path, k = parse(point)
    x, y = (t.to(DEVICE) for t in elbo_peers._data())
    torch.manual_seed(seed)
    model = elbo_peers._mlp().to(DEVICE)
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
    elif optimizer == "vogn":
        opt = mg.optim.VOGN(model, elbo_peers.DATASET, num_samples=k, seed=seed, init_precision=1.0)

        def closure():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        if path == "batched":
            def step():
                opt.step_samples(lambda: F.cross_entropy(model(x), y), vectorize=True, chunk_size=CHUNK_SIZE)
        else:
            def step():
                opt.step(closure)
    elif path == "batched":
        opt = mg.optim.IVON(model, lr=0.1, ess=elbo_peers.DATASET, mc_samples=k, seed=seed)

        def step():
            opt.step_samples(lambda: F.cross_entropy(model(x), y), vectorize=True, chunk_size=CHUNK_SIZE)
    else:
        opt = mg.optim.IVON(model, lr=0.1, ess=elbo_peers.DATASET, mc_samples=k, seed=seed)

        def step():
            for _ in range(k):
                with opt.sampled_params(train=True):
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(model(x), y).backward()
            opt.step()
    return step


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _timed(step) -> tuple[float, float]:
    _sync()
    t0, c0 = time.perf_counter(), time.thread_time()
    step()
    _sync()
    return time.perf_counter() - t0, time.thread_time() - c0


def noise_floor(k: int, reps: int) -> float:
    """Median thread-CPU seconds of drawing ``k`` samples of the MLP's parameters with ``torch.randn`` (one
    ``randn(P)`` per sample, as the samples draw them)."""
    numel = sum(p.numel() for p in elbo_peers._mlp().parameters())
    times = []
    for _ in range(reps):
        _sync()
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(k):
            torch.randn(numel, device=DEVICE)
        _sync()
        times.append(time.thread_time() - c0 if DEVICE.type == "cpu" else time.perf_counter() - t0)
    return statistics.median(times)


def _meta() -> dict:
    return {"sizes": list(elbo_peers.SIZES), "batch": elbo_peers.BATCH, "threads": torch.get_num_threads(),
            "device": str(DEVICE) if DEVICE.type == "cpu" else torch.cuda.get_device_name(DEVICE), "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "mcgraph": mg.__version__, "commit": git_commit(), "chunk_size": CHUNK_SIZE}


def measure(point: str, reps: int) -> dict:
    step = stepper(point)
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats(DEVICE)
    for _ in range(3):
        step()
    walls, cpus = zip(*(_timed(step) for _ in range(reps)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    _, _, k = parse(point)
    row = {"point": point, "K": k, "step_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
           "walls_s": list(walls), "cpus_s": list(cpus), "peak_rss_bytes": peak,
           "noise_floor_cpu_s": noise_floor(k, 5), **_meta()}
    row["peak_bytes"] = torch.cuda.max_memory_allocated(DEVICE) if DEVICE.type == "cuda" else peak
    return row


def _time_key(row: dict) -> str:
    """The time the ratios use: thread-CPU time on CPU, synchronised wall-clock on a GPU."""
    return "cpu_s" if row.get("device", "cpu") == "cpu" else "step_s"


def interleaved(reps: int) -> dict:
    steps = {p: stepper(p) for p in INTERLEAVED}
    for step in steps.values():
        for _ in range(2):
            step()
    times: dict = {p: [] for p in INTERLEAVED}
    for r in range(reps):
        order = INTERLEAVED[r % len(INTERLEAVED):] + INTERLEAVED[:r % len(INTERLEAVED)]
        for p in order:
            times[p].append(_timed(steps[p]))
    out = {"point": "interleaved", **_meta()}
    base_wall = statistics.median(t[0] for t in times[INTERLEAVED[0]])
    base_cpu = statistics.median(t[1] for t in times[INTERLEAVED[0]])
    for p in INTERLEAVED:
        wall, cpu = statistics.median(t[0] for t in times[p]), statistics.median(t[1] for t in times[p])
        out[p] = {"step_s": wall, "cpu_s": cpu, "wall_ratio": wall / base_wall, "cpu_ratio": cpu / base_cpu}
    return out


def _run_one(args, point: str) -> dict | None:
    cmd = [sys.executable, "-m", "bench.optim_samples", "--one", point, "--reps", str(args.reps), "--threads", str(args.threads),
           "--device", args.device, *(["--chunk-size", str(args.chunk_size)] if args.chunk_size else []), "--sizes", *map(str, elbo_peers.SIZES)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if done.returncode:
        print(f"{point} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(rows: list[dict]) -> list[str]:
    """Ratios against ``ivon:sequential:1`` and the targets."""
    by = {r["point"]: r for r in rows}
    base = by.get("ivon:sequential:1")
    lines = []
    if base is None:
        return lines
    tk = _time_key(base)
    tname, mname = ("cpu time", "peak RSS") if tk == "cpu_s" else ("wall time", "peak CUDA memory")
    pk = "peak_rss_bytes" if tk == "cpu_s" else "peak_bytes"
    for r in rows:
        if r["point"] == "interleaved":
            continue
        lines.append(f"{r['point']:20s} step {1e3 * r['step_s']:8.1f} ms  cpu {1e3 * r['cpu_s']:8.1f} ms "
                     f"({r[tk] / base[tk]:.2f}x)  {mname} {r[pk] / 2**20:7.0f} MiB "
                     f"({r[pk] / base[pk]:.2f}x)  randn floor {1e3 * r['noise_floor_cpu_s']:.1f} ms")
    for name, one, top in (("ivon", base, by.get("ivon:batched:8")),
                           ("vogn", by.get("vogn:sequential:1"), by.get("vogn:batched:8"))):
        if one and top:
            t, m = top[tk] / one[tk], top[pk] / one[pk]
            lines.append(f"{name} K=8 batched / K=1: {tname} {t:.2f}x (target <= 3: {'met' if t <= 3 else 'NOT met'}), "
                         f"{mname} {m:.2f}x (target <= 1.5: {'met' if m <= 1.5 else 'NOT met'})")
    if "interleaved" in by:
        it = by["interleaved"]
        lines.append("interleaved in one process, against ivon:sequential:1: " + ", ".join(
            f"{p} {it[p]['cpu_ratio']:.2f}x cpu / {it[p]['wall_ratio']:.2f}x wall" for p in INTERLEAVED if p in it))
        if "vogn:sequential:1" in it and "vogn:batched:8" in it:
            v1, v8 = it["vogn:sequential:1"], it["vogn:batched:8"]
            lines.append(f"interleaved vogn K=8 batched / K=1: {v8['cpu_s'] / v1['cpu_s']:.2f}x cpu, "
                         f"{v8['step_s'] / v1['step_s']:.2f}x wall")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", nargs="+", default=list(POINTS))
    parser.add_argument("--sizes", type=int, nargs="+", default=list(elbo_peers.SIZES))
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--interleaved", action="store_true")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (model, data and optimizer state)")
    parser.add_argument("--chunk-size", type=int, help="samples per vmapped pass of the batched points "
                        "(default: the optimizers' own, batched_samples.default_chunk_size)")
    parser.add_argument("--out", default="bench/results/optim_samples.jsonl")
    parser.add_argument("--one", metavar="POINT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    elbo_peers.SIZES = tuple(args.sizes)
    global DEVICE, CHUNK_SIZE
    DEVICE, CHUNK_SIZE = torch.device(args.device), args.chunk_size
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        row = interleaved(args.reps) if args.one == "interleaved" else measure(args.one, args.reps)
        print(json.dumps(row))
        return 0
    for point in args.points:
        parse(point)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, failed = [], []
    for point in args.points + (["interleaved"] if args.interleaved else []):
        row = _run_one(args, point)
        if row is None:
            failed.append(point)
            continue
        rows.append(row)
        atomic_io.append_line(out, json.dumps(row))
        if point != "interleaved":
            print(f"{point:20s} step {1e3 * row['step_s']:8.1f} ms  cpu {1e3 * row['cpu_s']:8.1f} ms  "
                  f"peak {row['peak_bytes'] / 2**20:7.0f} MiB", flush=True)
    for line in summary(rows):
        print(line)
    if failed:
        print(f"failed points (see above): {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
