"""One forward + backward of ``mg.nn.BayesLSTM`` at M = 1 against ``nn.LSTM`` of the same size.

Workload: 2 layers, hidden 256, input 256, T = 64, batch 32, batch-first, float32 on
CPU; the loss is ``out.square().mean()`` of the whole output sequence, and the timed step is
``loss.backward()`` after the forward (gradients set to ``None`` between steps, outside the timer).
The Bayesian layer draws one weight sample (mean-field Normal posterior, N(0, 1) prior) and runs
torch's fused LSTM kernel on it; its step therefore costs the kernel plus the draw of every weight
(μ + softplus(ρ)·ξ, 4 weight matrices) and the backward of that draw into μ and ρ.

The two providers are timed interleaved in one process (``torch`` then ``mcgraph``, ``--reps``
rounds, after ``--warmup`` rounds), so machine load hits both alike; the median of each and the
ratio of the medians are reported per thread count (``torch.set_num_threads``). Rows go to
``--out`` (JSON lines), a summary to stdout.

``--device cuda`` runs both on the GPU (torch's cuDNN LSTM against the Bayesian layer running the same
kernel on its weight sample), the device synchronised around every step; the thread count then only
sets the host's threads.

    python -m bench.recurrent_m1 --threads 1 2 --reps 41 --out bench/results/recurrent-m1.jsonl
    python -m bench.recurrent_m1 --device cuda --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch import nn

import mcgraph as mg

HERE = Path(__file__).resolve().parents[1]
#: (num_layers, hidden_size, input_size, T, batch)
SIZE = (2, 256, 256, 64, 32)
TARGET = 1.5


def build(size=None, seed: int = 0, device="cpu"):
    """``(nn.LSTM, BayesLSTM, x)`` of the workload on ``device``; the Bayesian layer's means are the torch
    module's weights."""
    layers, hidden, inputs, T, batch = SIZE if size is None else size
    torch.manual_seed(seed)
    ref = nn.LSTM(inputs, hidden, num_layers=layers, batch_first=True)
    bayes = mg.nn.BayesLSTM.from_torch(ref, posterior="normal", prior="normal")
    x = torch.randn(batch, T, inputs)
    return ref.to(device), bayes.to(device), x.to(device)


def step(module: nn.Module, x: torch.Tensor) -> float:
    """Seconds of one forward + backward (gradients cleared before the timer starts; a CUDA device
    synchronised before and after)."""
    for p in module.parameters():
        p.grad = None
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(x.device)
    t0 = time.perf_counter()
    out, _ = module(x)
    out.square().mean().backward()
    if cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - t0


def measure(threads: int, reps: int, warmup: int, size=None, device="cpu") -> dict:
    """Interleaved medians of both providers at ``threads`` threads: one result row."""
    size = SIZE if size is None else size
    torch.set_num_threads(threads)
    device = torch.device(device)
    ref, bayes, x = build(size, device=device)
    for _ in range(warmup):
        step(ref, x)
        step(bayes, x)
    times = {"torch": [], "mcgraph": []}
    for _ in range(reps):
        times["torch"].append(step(ref, x))
        times["mcgraph"].append(step(bayes, x))
    med = {k: statistics.median(v) for k, v in times.items()}
    layers, hidden, inputs, T, batch = size
    return {"bench": "recurrent_m1", "threads": threads, "reps": reps, "num_layers": layers, "hidden": hidden,
            "input": inputs, "T": T, "batch": batch, "torch_median_s": med["torch"],
            "mcgraph_median_s": med["mcgraph"], "ratio": med["mcgraph"] / med["torch"],
            "torch_min_s": min(times["torch"]), "mcgraph_min_s": min(times["mcgraph"]),
            "load_avg_1min": os.getloadavg()[0], "device": device.type, "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
            "torch_version": torch.__version__, "mcgraph_version": getattr(mg, "__version__", "?"),
            "commit": _commit()}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=41)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the layers and input live")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False")
    rows = []
    for threads in args.threads:
        row = measure(threads, args.reps, args.warmup, device=args.device)
        rows.append(row)
        print(f"threads={threads}: nn.LSTM {row['torch_median_s'] * 1e3:.2f} ms, BayesLSTM "
              f"{row['mcgraph_median_s'] * 1e3:.2f} ms (medians of {args.reps}), ratio {row['ratio']:.3f} "
              f"(target ≤ {TARGET}), load {row['load_avg_1min']:.2f}", flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


if __name__ == "__main__":
    main()
