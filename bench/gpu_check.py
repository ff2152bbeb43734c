"""One command for the day a GPU is lent: ``make gpu-check`` (≤ 8 minutes on one CUDA device).

Sections, each in its own subprocess with its own time limit, so that one failure or
out-of-memory leaves the others' results:

1. ``kernel_tests`` — ``tests/test_kernels.py`` compiled on the GPU (``MCGRAPH_KERNEL_DEVICE=cuda``,
   not the interpreter): every kernel against its pure-torch reference.
2. ``kernels`` — ``bench/kernels.py``: median time, achieved bytes/s and draws/s of the
   noise-statistics and fused log-density kernels beside ``torch.randn`` + reduction (and the
   vectorised direct estimate) on the same device; bandwidth as a fraction of the measured
   device-to-device copy rate and of the device's nominal peak.
3. ``resnet18_step`` — ``mcgraph bench --workload step --model resnet18`` at M ∈ {1, 10, 100, 1000}:
   peak ``torch.cuda.max_memory_allocated`` and time of direct MC (until out of memory),
   gradient accumulation and mcgraph, and the largest M each reaches in the device's memory.
4. ``peer_mlp`` — the bayesian-torch MLP of ``bench/elbo_peers.py`` (784-1000-1000-10) at
   M ∈ {1, 16, 256, 1000}: bayesian-torch's own M-sample loop, the same model converted with
   ``mcgraph.interop.bayesian_torch.to_mcgraph``, and ``mg.nn.bayesify``'s MLP; peak memory and time.
5. ``ivon_speed`` — ``python -m bench.ivon_speed --device cuda``: IVON's K = 1 step against Adam's (and
   ivon-opt's, when installed) on the peer MLP and LeNet-5.
6. ``optim_samples`` — ``python -m bench.optim_samples --device cuda``: IVON's and VOGN's K = 8 batched step
   against K = 1 on the peer MLP (time and peak CUDA memory).

Results go to ``bench/results/gpu-<date>.json`` and ``.md`` (``--out-dir``). ``--smoke`` runs
every section on CPU at tiny sizes (Triton's interpreter, LeNet-5, a 20-16-4 MLP) so that CI
keeps the script from rotting; its figures mean nothing.

Usage::

    make gpu-check                                   # on a machine with CUDA
    python -m bench.gpu_check --smoke --out-dir /tmp/gpu-smoke
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Nominal peak memory bandwidth (bytes/s) by device name, from the vendors' data sheets.
NOMINAL_BANDWIDTH = (
    ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12), ("A100", 1.555e12), ("L40S", 0.864e12), ("A10G", 0.6e12),
    ("RTX 4090", 1.008e12), ("V100", 0.9e12), ("T4", 0.32e12),
)
STEP_SAMPLES = (1, 10, 100, 1000)
PEER_SAMPLES = (1, 16, 256, 1000)
PEER_PROVIDERS = ("bayesian-torch", "bayesian-torch+mcgraph", "mcgraph")
SECTIONS = ("kernel_tests", "kernels", "resnet18_step", "peer_mlp", "ivon_speed", "optim_samples")


def nominal_bandwidth(name: str) -> float | None:
    for key, bw in NOMINAL_BANDWIDTH:
        if key in name:
            return bw
    return None


def _env(smoke: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("TRITON_INTERPRET", None)
    if smoke:
        env["TRITON_INTERPRET"] = "1"
    return env


def run_section(name: str, cmd: list[str], timeout: float, smoke: bool, extra_env: dict | None = None) -> dict:
    """Run one section's command; keep its status, time and the tail of its output."""
    env = _env(smoke)
    env.update(extra_env or {})
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
        out = done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        status = f"timed out after {timeout:.0f} s"
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    seconds = time.perf_counter() - t0
    print(f"[gpu-check] {name}: {status} in {seconds:.0f} s", flush=True)
    return {"name": name, "command": " ".join(cmd), "status": status, "seconds": round(seconds, 1),
            "output_tail": out[-4000:]}


# --------------------------------------------------------------------------- sections


def kernel_tests(args) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py"]
    extra = {}
    if args.smoke:
        cmd += ["-k", "materialised or sizes"]  # a handful of interpreted launches
    else:
        extra["MCGRAPH_KERNEL_DEVICE"] = "cuda"
    sec = run_section("kernel_tests", cmd, args.timeout_tests, args.smoke, extra)
    m = re.findall(r"(\d+) (passed|failed|skipped|error|errors)", sec["output_tail"])
    sec["counts"] = {k.rstrip("s") if k.startswith("error") else k: int(v) for v, k in m}
    return sec


def kernels_bench(args, out_dir: Path) -> dict:
    csv_path = out_dir / f"kernels-{args.date}.csv"
    if csv_path.exists():
        csv_path.unlink()
    cmd = [sys.executable, "-m", "bench.kernels", "--out", str(csv_path)]
    if args.smoke:
        cmd += ["--smoke"]
    else:
        cmd += ["--sizes", *map(str, args.kernel_sizes), "--samples", *map(str, args.kernel_samples),
                "--max-seconds", str(args.kernel_max_seconds)]
    sec = run_section("kernels", cmd, args.timeout_kernels, args.smoke)
    rows = []
    if csv_path.exists():
        import csv

        with csv_path.open() as f:
            rows = list(csv.DictReader(f))
    bw_peak = nominal_bandwidth(rows[0]["device"]) if rows else None
    for r in rows:
        bps, copy = float(r["bytes_per_s"]), float(r["bandwidth_Bps"])
        r["of_copy_bandwidth"] = round(bps / copy, 4)
        r["of_nominal_bandwidth"] = round(bps / bw_peak, 4) if bw_peak else None
    base = {(r["kernel"].removeprefix("torch:"), r["P"], r["M"]): r for r in rows if r["kernel"].startswith("torch:")}
    for r in rows:
        b = base.get((r["kernel"], r["P"], r["M"]))
        if b is not None and not r["kernel"].startswith("torch:"):
            r["speedup_vs_torch"] = round(float(b["median_ms"]) / float(r["median_ms"]), 2)
    sec["rows"] = rows
    sec["nominal_bandwidth_Bps"] = bw_peak
    return sec


def resnet18_step(args, out_dir: Path) -> dict:
    bench_dir = out_dir / f"step-{args.date}"
    model, samples = ("lenet5", "1,2") if args.smoke else ("resnet18", ",".join(map(str, STEP_SAMPLES)))
    cmd = [sys.executable, "-m", "mcgraph", "bench", "--workload", "step", "--model", model, "--samples", samples,
           "--methods", "direct,grad-accum,mcgraph", "--device", "cpu" if args.smoke else "cuda",
           "--repeats", "1" if args.smoke else "3", "--time-cap", "5" if args.smoke else "15",
           "--m-cap", "4" if args.smoke else "100000", "--no-plots", "--no-progress", "--out", str(bench_dir)]
    if not args.smoke:
        cmd += ["--budget", "75GB"]
        if not args.max_m:
            cmd += ["--no-max-m"]
    sec = run_section("resnet18_step", cmd, args.timeout_step, args.smoke)
    rows_file = bench_dir / "rows.json"
    if rows_file.exists():
        keep = ("workload", "method", "M", "status", "seconds", "peak", "peak_over_base", "bytes", "note")
        sec["rows"] = [{k: r.get(k) for k in keep} for r in json.loads(rows_file.read_text())["rows"]]
    summary = bench_dir / "summary.md"
    if summary.exists():
        sec["summary_md"] = summary.read_text()
    return sec


def peer_mlp(args) -> dict:
    samples = (1, 2) if args.smoke else PEER_SAMPLES
    cmd = [sys.executable, "-m", "bench.gpu_check", "--peer-mlp-worker", "--samples", *map(str, samples)]
    if args.smoke:
        cmd += ["--smoke"]
    sec = run_section("peer_mlp", cmd, args.timeout_peer, args.smoke)
    rows = []
    for line in sec["output_tail"].splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    sec["rows"] = rows
    return sec


def peer_mlp_worker(samples: list[int], smoke: bool) -> int:
    """Each (provider, M): build the model on the device, one warm-up step, then peak memory and the
    median time of three forward+backward steps; out-of-memory is recorded, not raised."""
    import torch

    from bench import elbo_peers as ep

    device = torch.device("cpu" if smoke else "cuda")
    if smoke:
        ep.SIZES = (20, 16, 4)
    try:
        import bayesian_torch  # noqa: F401
        providers = PEER_PROVIDERS
    except ImportError:
        print(json.dumps({"provider": "bayesian-torch", "status": "skipped: bayesian-torch is not installed"}))
        providers = ("mcgraph",)
    x, y = (t.to(device) for t in ep._data())

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for provider in providers:
        for M in samples:
            row = {"provider": provider, "M": M, "device": str(device)}
            model = None
            try:
                model = ep.build(provider).to(device)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
                ep.loss_fn(provider, model, x, y, M).backward()  # warm-up (compiles kernels, plans)
                times = []
                for _ in range(1 if smoke else 3):
                    model.zero_grad(set_to_none=True)
                    sync()
                    t0 = time.perf_counter()
                    ep.loss_fn(provider, model, x, y, M).backward()
                    sync()
                    times.append(time.perf_counter() - t0)
                row.update(status="ok", time_s=sorted(times)[len(times) // 2])
                if device.type == "cuda":
                    row["peak_bytes"] = int(torch.cuda.max_memory_allocated() - base)
            except Exception as exc:  # noqa: BLE001 - out of memory is a result here
                oom = isinstance(exc, getattr(torch.cuda, "OutOfMemoryError", ())) or "out of memory" in str(exc)
                row.update(status="out of memory" if oom else f"error: {type(exc).__name__}: {exc}"[:300])
            finally:
                del model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
    return 0


def _jsonl_section(name: str, cmd: list[str], out: Path, timeout: float, args) -> dict:
    """Run a bench script that appends JSON rows to ``out`` (a scratch file) and keep the rows and its summary."""
    out.unlink(missing_ok=True)
    sec = run_section(name, cmd + ["--out", str(out)], timeout, args.smoke)
    sec["rows"] = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []
    out.unlink(missing_ok=True)
    return sec


def ivon_speed(args, scratch: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.ivon_speed"]
    if args.smoke:
        cmd += ["--models", "tiny", "--providers", "adam", "ivon", "--reps", "3"]
    else:
        cmd += ["--device", "cuda", "--models", "peer", "lenet5", "--reps", "30"]
    return _jsonl_section("ivon_speed", cmd, scratch / "ivon_speed.jsonl", args.timeout_ivon, args)


def optim_samples(args, scratch: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.optim_samples", "--points", "ivon:sequential:1",
           "ivon:batched:4" if args.smoke else "ivon:batched:8", "vogn:sequential:1",
           "vogn:batched:4" if args.smoke else "vogn:batched:8"]
    cmd += ["--sizes", "12", "16", "16", "3", "--reps", "2"] if args.smoke else ["--device", "cuda", "--reps", "15"]
    return _jsonl_section("optim_samples", cmd, scratch / "optim_samples.jsonl", args.timeout_optim, args)


# --------------------------------------------------------------------------- report


def _fmt_bytes(n) -> str:
    if n is None:
        return "–"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


def markdown(result: dict) -> str:
    lines = [f"# GPU check, {result['date']}", "",
             f"Device: {result['device']}; torch {result['torch']}; triton {result['triton']}; "
             f"commit {result['commit']}; mode: {'smoke (CPU, interpreter: figures meaningless)' if result['smoke'] else 'CUDA'}.",
             "", "| section | status | seconds |", "|---|---|---|"]
    for s in result["sections"]:
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']} |")
    secs = {s["name"]: s for s in result["sections"]}
    if "kernel_tests" in secs:
        lines += ["", "## Kernel tests compiled on the device", "", f"Counts: {secs['kernel_tests'].get('counts')}"]
    k = secs.get("kernels")
    if k and k.get("rows"):
        lines += ["", "## Kernels", "",
                  f"Nominal peak bandwidth: {k['nominal_bandwidth_Bps'] or 'unknown'} B/s; measured copy: "
                  f"{k['rows'][0]['bandwidth_Bps']} B/s.", "",
                  "| kernel | P | M | median ms | draws/s | bytes/s | of copy bw | of nominal bw | of floor | × torch |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in k["rows"]:
            lines.append(f"| {r['kernel']} | {r['P']} | {r['M']} | {r['median_ms']} | {r['draws_per_s']} | "
                         f"{r['bytes_per_s']} | {r['of_copy_bandwidth']} | {r['of_nominal_bandwidth']} | "
                         f"{r['of_floor']} | {r.get('speedup_vs_torch', '')} |")
    st = secs.get("resnet18_step")
    if st and st.get("summary_md"):
        lines += ["", "## ResNet-18 ELBO step (mcgraph bench --workload step)", "", st["summary_md"]]
    pm = secs.get("peer_mlp")
    if pm and pm.get("rows"):
        lines += ["", "## bayesian-torch MLP (784-1000-1000-10), full ELBO over M samples", "",
                  "| provider | M | status | time s | peak memory |", "|---|---|---|---|---|"]
        for r in pm["rows"]:
            t = f"{r['time_s']:.4f}" if "time_s" in r else "–"
            lines.append(f"| {r['provider']} | {r.get('M', '')} | {r['status']} | {t} | "
                         f"{_fmt_bytes(r.get('peak_bytes'))} |")
    iv = secs.get("ivon_speed")
    if iv and iv.get("rows"):
        lines += ["", "## IVON's step against Adam's (K = 1)", "",
                  "| model | Adam ms | provider | × Adam | of |", "|---|---|---|---|---|"]
        for row in iv["rows"]:
            kind = row.get("ratio_of", "cpu")
            adam = row["providers"]["adam"][f"{kind}_s"] * 1e3
            for name, v in row["providers"].items():
                if name != "adam":
                    lines.append(f"| {row['model']} | {adam:.3f} | {name} | {v[kind + '_ratio']:.2f} | {kind} time |")
    om = secs.get("optim_samples")
    if om and om.get("rows"):
        lines += ["", "## K samples per step (IVON, VOGN; the peer MLP on CUDA)", "",
                  "| point | step ms | peak memory |", "|---|---|---|"]
        for row in om["rows"]:
            lines.append(f"| {row['point']} | {row['step_s'] * 1e3:.2f} | {_fmt_bytes(row.get('peak_bytes'))} |")
        lines += [""] + [f"    {line}" for line in om["output_tail"].splitlines()
                         if line.startswith(("ivon K=", "vogn K="))]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny sizes (CI)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--sections", nargs="+", default=list(SECTIONS))
    # The limits add up to 8 minutes; the sections took 66, 47, 157 and 56 s on an H100 (2026-11-27).
    p.add_argument("--timeout-tests", type=float, default=80)
    p.add_argument("--timeout-kernels", type=float, default=70)
    p.add_argument("--timeout-step", type=float, default=170)
    p.add_argument("--timeout-peer", type=float, default=60)
    p.add_argument("--timeout-ivon", type=float, default=40)
    p.add_argument("--timeout-optim", type=float, default=60)
    p.add_argument("--kernel-sizes", type=int, nargs="+", default=[10**6, 10**7, 10**8])
    p.add_argument("--kernel-samples", type=int, nargs="+", default=[1, 100, 1000])
    p.add_argument("--kernel-max-seconds", type=float, default=0.05, help="skip kernel points whose floor exceeds this")
    p.add_argument("--no-max-m", dest="max_m", action="store_false", help="skip the step's max-M search")
    p.add_argument("--peer-mlp-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--samples", type=int, nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer_mlp_worker:
        return peer_mlp_worker(args.samples, args.smoke)

    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False). On a machine without one, "
              "run `python -m bench.gpu_check --smoke` to exercise the script.", file=sys.stderr)
        return 2
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    args.date = _dt.date.today().isoformat()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    try:  # the kernels live in ./kernels, which mcgraph/kernels links to
        import mcgraph.kernels  # noqa: F401
    except ModuleNotFoundError as err:
        print(f"gpu-check: {err}. mcgraph must be installed in this interpreter ({sys.executable}): run "
              "`python -m pip install --no-deps --no-build-isolation -e .` first, or `make gpu-check` with the "
              "project's virtual environment.", file=sys.stderr)
        return 2
    from bench.harness.records import git_commit
    from mcgraph.apps import atomic_io

    result = {"date": args.date, "smoke": args.smoke, "torch": torch.__version__, "triton": triton_version,
              "device": "cpu" if args.smoke else torch.cuda.get_device_name(0), "machine": platform.node(),
              "commit": git_commit(), "sections": []}
    stem = "gpu-smoke" if args.smoke else f"gpu-{args.date}"
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    runners = {"kernel_tests": lambda: kernel_tests(args), "kernels": lambda: kernels_bench(args, args.out_dir),
               "resnet18_step": lambda: resnet18_step(args, args.out_dir), "peer_mlp": lambda: peer_mlp(args),
               "ivon_speed": lambda: ivon_speed(args, scratch), "optim_samples": lambda: optim_samples(args, scratch)}
    assert set(runners) == set(SECTIONS)
    bad = [s for s in args.sections if s not in runners]
    if bad:
        p.error(f"--sections must be among {', '.join(runners)}, got {', '.join(bad)}")
    try:
        for name in args.sections:
            result["sections"].append(runners[name]())
            # written after every section, so a later failure or a killed run leaves the earlier results
            atomic_io.write_text(args.out_dir / f"{stem}.json", json.dumps(result, indent=1) + "\n")
            atomic_io.write_text(args.out_dir / f"{stem}.md", markdown(result))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(markdown(result))
    return 0 if all(s["status"] == "ok" for s in result["sections"]) else 1


if __name__ == "__main__":
    sys.exit(main())
