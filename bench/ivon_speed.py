"""IVON's step time against Adam's on the same model, side by side in one process.

Models (``--models``): ``tiny`` (a 64-64-10 MLP on 64 inputs, the digits network, batch 64),
``peer`` (the 784-1000-1000-10 MLP of ``bench/elbo_peers.py``, batch 32) and ``lenet5``
(:func:`mcgraph.models.get_model`, 1×28×28 inputs, batch 64); random inputs and labels.

Providers, each a full training step (zero the gradients, forward, cross-entropy, backward, update):

* ``adam`` — ``torch.optim.Adam`` (torch's default implementation on the device);
* ``ivon`` — ``mg.optim.IVON(model, lr=0.1, ess=N, seed=0)``, one ``sampled_params(train=True)`` block
  and ``step()`` (K = 1);
* ``ivon-global`` — the same with ``seed=None`` (noise from torch's global generator, as ivon-opt);
* ``ivon-foreach`` — ``ivon`` with ``fused=False``: the update as torch foreach operations instead of
  the compiled one-pass loop the CPU default takes (the same numbers; CPU only);
* ``ivon-opt`` — the reference package's ``ivon.IVON`` in the same loop, when it is installed;
* ``forward-backward`` and ``randn`` — the floors: the step without any update, and drawing P
  standard normals (``torch.randn``) alone, the noise every IVON step needs.

The providers run interleaved (the order rotates every repeat) for ``--reps`` repeats after a
warm-up; each time is the median. With ``--threads 1`` (the default) all of torch's work runs on
the calling thread, and the thread-CPU time (``time.thread_time``) is robust to other processes
sharing the machine; the wall-clock time is reported beside it. The summary prints, per model, the
ratio of each provider to Adam (target for ``ivon``: ≤ 1.15), and rows go to ``--out`` (JSON lines).
``--device cuda`` puts the models, data and optimizer state on the GPU; the device is synchronised
around every step and the ratios are then of wall-clock time.

Usage::

    python -m bench.ivon_speed --reps 40 --out bench/results/ivon_speed.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import mcgraph as mg
from mcgraph.apps import atomic_io
from bench.harness.records import git_commit
from mcgraph.apps.training_run import mlp

MODELS = ("tiny", "peer", "lenet5")
PROVIDERS = ("adam", "ivon", "ivon-global", "ivon-foreach", "ivon-opt", "forward-backward", "randn")
DATASET = 60_000


def workload(name: str):
    """``(build() -> model, x, y)`` of a model of :data:`MODELS`."""
    g = torch.Generator().manual_seed(0)
    if name == "tiny":
        shape, batch, build = (64,), 64, lambda: mlp(10, 64, (64,), flatten=False)
    elif name == "peer":
        shape, batch, build = (784,), 32, lambda: mlp(10, 784, (1000, 1000), flatten=False)
    elif name == "lenet5":
        shape, batch, build = (1, 28, 28), 64, lambda: mg.models.get_model("lenet5")
    else:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    return build, torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)


def stepper(provider: str, build, x, y):
    """``step()`` of ``provider`` on a fresh copy of the model, on ``x``'s device (``None``: the provider
    is not installed)."""
    torch.manual_seed(0)
    model = build().to(x.device)
    numel = sum(p.numel() for p in model.parameters())
    if provider == "ivon-foreach" and x.device.type != "cpu":
        return None  # the compiled update is the CPU's: on other devices ivon is this provider
    if provider == "randn":
        return lambda: torch.randn(numel, device=x.device)
    if provider == "forward-backward":
        def step():
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
        return step
    if provider == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return step
    if provider == "ivon-opt":
        if importlib.util.find_spec("ivon") is None:
            return None
        import ivon

        opt = ivon.IVON(model.parameters(), lr=0.1, ess=DATASET)
    elif provider in ("ivon", "ivon-global", "ivon-foreach"):
        opt = mg.optim.IVON(model, lr=0.1, ess=DATASET, seed=None if provider == "ivon-global" else 0,
                            fused=False if provider == "ivon-foreach" else None)
    else:
        raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")

    def step():
        with opt.sampled_params(train=True):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def operations_per_step(step, cuda: bool) -> int:
    """What one step issues, counted by torch's profiler: kernels run on the device (CUDA), or the
    torch operator calls not made from inside another operator (CPU). On a GPU a step of a few million weights is bound by these
    launches and their dispatch on the host, not by memory."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    if cuda:
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)

    def outermost(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    return sum(1 for e in events if e.name.startswith("aten::") and outermost(e))


def measure(name: str, providers, reps: int, warmup: int = 3, device: str = "cpu") -> dict:
    build, x, y = workload(name)
    x, y = x.to(device), y.to(device)
    cuda = x.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(x.device)) if cuda else (lambda: None)
    steps = {p: s for p in providers if (s := stepper(p, build, x, y)) is not None}
    order = list(steps)
    for step in steps.values():
        for _ in range(warmup):
            step()
    walls: dict = {p: [] for p in order}
    cpus: dict = {p: [] for p in order}
    for r in range(reps):
        for p in order[r % len(order):] + order[:r % len(order)]:
            sync()
            t0, c0 = time.perf_counter(), time.thread_time()
            steps[p]()
            sync()
            cpus[p].append(time.thread_time() - c0)
            walls[p].append(time.perf_counter() - t0)
    load = list(__import__("os").getloadavg())
    row = {"model": name, "parameters": sum(p.numel() for p in build().parameters()), "batch": x.shape[0],
           "reps": reps, "threads": torch.get_num_threads(), "loadavg": load,
           "device": torch.cuda.get_device_name(x.device) if cuda else "cpu", "ratio_of": "wall" if cuda else "cpu",
           "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
           "mcgraph": mg.__version__, "commit": git_commit(), "providers": {}}
    base_cpu, base_wall = statistics.median(cpus["adam"]), statistics.median(walls["adam"])
    for p in order:
        cpu, wall = statistics.median(cpus[p]), statistics.median(walls[p])
        row["providers"][p] = {"cpu_s": cpu, "wall_s": wall, "cpu_ratio": cpu / base_cpu, "wall_ratio": wall / base_wall,
                               "operations": operations_per_step(steps[p], cuda)}
    row["operations_of"] = "device kernels" if cuda else "outermost torch operator calls"
    return row


def _ops(v: dict) -> str:
    return f", {v['operations']} ops" if "operations" in v else ""


def summary(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        kind = row.get("ratio_of", "cpu")
        other = "wall" if kind == "cpu" else "cpu"
        cells = ", ".join(f"{p} {v[kind + '_ratio']:.2f}x ({1e3 * v[kind + '_s']:.2f} ms {kind}, "
                          f"{v[other + '_ratio']:.2f}x {other}{_ops(v)})"
                          for p, v in row["providers"].items() if p != "adam")
        adam = row["providers"]["adam"]
        lines.append(f"{row['model']} ({row['parameters']:,} parameters, batch {row['batch']}, {row['device']}): "
                     f"adam {1e3 * adam[kind + '_s']:.2f} ms {kind}{_ops(adam)}; relative to adam: {cells}")
        if "operations_of" in row:
            lines.append(f"  (ops: {row['operations_of']} per step)")
        ivon = row["providers"].get("ivon")
        if ivon:
            ok = "met" if ivon[kind + "_ratio"] <= 1.15 else "NOT met"
            lines.append(f"  ivon / adam = {ivon[kind + '_ratio']:.2f} ({kind} time; target <= 1.15: {ok})")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default="bench/results/ivon_speed.jsonl")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (models, data and optimizer state)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    providers = ["adam"] + [p for p in args.providers if p != "adam"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models:
        row = measure(name, providers, args.reps, device=args.device)
        rows.append(row)
        atomic_io.append_line(out, json.dumps(row))
        print(summary([row])[0], flush=True)
    print()
    for line in summary(rows):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
