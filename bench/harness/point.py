"""Run ONE benchmark point in a fresh process and report its peak RSS.

``python -m bench.harness.point '{"case": {...}, "method": "fused", "M": 100, "seed": 0}'``
rebuilds the case from its spec (same seeded parameters), records the resident
memory after set-up (``base``), runs forward + backward once and prints one JSON
line ``{"value", "peak", "base", "seconds"}`` — ``peak`` is VmHWM (the kernel's
high-water mark of resident memory), so points never contaminate each other's
measurement through a shared allocator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .measure import peak_rss_bytes, proc_status_bytes


def build_case(spec: dict):
    """The :class:`Case` described by ``Case.spec()`` (used by the per-point subprocess)."""
    spec = dict(spec)
    workload = spec.pop("workload")
    import torch

    from .step import StepCase
    from .workloads import KLCase, LastLayerCase

    dtype = getattr(torch, spec.pop("dtype", "float32"))
    if workload == "kl":
        return KLCase(spec.pop("model"), spec.pop("P"), dtype=dtype, **spec)
    if workload == "lastlayer":
        return LastLayerCase(dtype=dtype, **spec)
    if workload == "step":
        return StepCase(dtype=dtype, **spec)
    raise ValueError(f"workload must be one of kl, lastlayer, step, got {workload!r}")


def _main(argv: list[str]) -> int:
    import torch

    job = json.loads(argv[0])
    threads = job.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    if job.get("flush_denormal"):
        torch.set_flush_denormal(True)
    case = build_case(job["case"])
    base = proc_status_bytes("VmRSS") or peak_rss_bytes()
    start = time.perf_counter()
    out = case.run(job["method"], int(job["M"]), int(job["seed"]))
    seconds = time.perf_counter() - start
    print(json.dumps({"value": float(out.value.double().sum()), "peak": peak_rss_bytes(), "base": base,
                      "seconds": seconds}))
    return 0


def run_in_subprocess(case_spec: dict, method: str, num_samples: int, seed: int, timeout: float,
                      threads: int | None = None, flush_denormal: bool = False) -> dict:
    """Run the point in a fresh interpreter; returns its JSON report.

    Raises:
        MemoryError: the child was killed by the kernel (SIGKILL, the OOM killer) or
            reported an out-of-memory error.
        TimeoutError: it ran past ``timeout`` seconds (the child is killed).
        RuntimeError: any other failure (stderr's tail in the message).
    """
    job = {"case": case_spec, "method": method, "M": num_samples, "seed": seed, "threads": threads,
           "flush_denormal": flush_denormal}
    # the child imports this checkout's bench package whatever the working directory
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.harness.point", json.dumps(job)],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"subprocess ran past {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        text = " | ".join(tail)
        if proc.returncode == -9 or "out of memory" in text.lower() or "MemoryError" in text:
            raise MemoryError(f"subprocess ran out of memory (rc {proc.returncode}): {text}")
        raise RuntimeError(f"subprocess failed (rc {proc.returncode}): {text}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
