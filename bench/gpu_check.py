"""One command for the day a GPU is lent: ``make gpu-check`` (``make gpu-check QUICK=1``: ``--quick``).

Sections, each in its own subprocess with its own time limit, so that one failure or
out-of-memory leaves the others' results:

1. ``kernel_tests`` — ``tests/engine/test_kernels.py`` compiled on the GPU (``MCGRAPH_KERNEL_DEVICE=cuda``,
   not the interpreter): every kernel against its pure-torch reference.
2. ``families`` — ``tests/nn/test_cuda_families.py`` with ``MCGRAPH_TEST_DEVICE=cuda``: every layer family and
   conversion (bayesify'd linear and convolutions, the recurrent layers in every form, embedding, attention,
   a transformer encoder, LoRA on GPT-2, peft, the peers' ``to_mcgraph``, Sparse VD, MC dropout, IVON and
   VOGN) × forward, ``mg.nn.elbo`` against ``method="direct"`` at M ∈ {1, 16}, predict and the KL; the
   report holds the family × check matrix.
3. ``kernels`` — ``bench/kernels.py``: median time, achieved bytes/s and draws/s of the
   noise-statistics and fused log-density kernels beside ``torch.randn`` + reduction (and the
   vectorised direct estimate) on the same device; bandwidth as a fraction of the measured
   device-to-device copy rate and of the device's nominal peak.
4. ``resnet18_step`` — ``mcgraph bench --workload step --model resnet18`` at M ∈ {1, 10, 100, 1000}:
   peak ``torch.cuda.max_memory_allocated`` and time of direct MC (until out of memory),
   gradient accumulation and mcgraph, and the largest M each reaches in the device's memory.
5. ``peer_mlp`` — the bayesian-torch MLP of ``bench/elbo_peers.py`` (784-1000-1000-10) at
   M ∈ {1, 16, 256, 1000}: bayesian-torch's own M-sample loop, the same model converted with
   ``mcgraph.interop.bayesian_torch.to_mcgraph`` and ``mg.nn.bayesify``'s MLP, both with ``mg.nn.elbo``'s
   defaults (no method, chunk size or KL method given), and the bayesified MLP once more with the
   estimators ``bench/elbo_peers.py`` forces (its own row); peak memory, time and the floor.
6. ``sequence`` — ``python -m bench.sequence_peers --device cuda``: the row-MNIST LSTM classifier (2 × 128)
   at M ∈ {1, 16, 64, 256}, mcgraph (its default chunks) against blitz's and bayesian-torch's own loops.
7. ``lora`` — ``python -m bench.lora_lm --device cuda`` at sequence length 128, M ∈ {1, 8, 32, 128}:
   training (the ELBO step) and prediction of ``mg.nn.bayesian_lora`` against peft LoRA's step and its
   per-sample loop (``lora-loop``: M passes of the peft model).
8. ``predict_overhead`` — ``python -m bench.predict_overhead --device cuda --samples 32``: ``mg.nn.predict``
   against M plain forwards (GPT-2 with LoRA adapters, a transformer encoder).
9. ``ivon_speed`` — ``python -m bench.ivon_speed --device cuda``: IVON's K = 1 step against Adam's (and
   ivon-opt's, when installed) on the peer MLP and LeNet-5.
10. ``optim_samples`` — ``python -m bench.optim_samples --device cuda``: IVON's and VOGN's K = 8 batched step
    against K = 1 on the peer MLP (time and peak CUDA memory).

**The floor.** The rows of ``peer_mlp``, ``sequence`` and ``lora`` carry ``randn_floor_s``: the time of
drawing the step's standard normals with ``torch.randn`` on the device (:func:`randn_floor_s`) — 2·M·P for a
training step (P: the weights one sample of mcgraph's model draws; each sample's noise is drawn in the forward
pass and again in the chunked estimator's backward), M·P for a prediction — and the step's time as a multiple
of it.

**Time** (an H100; estimated from bench/results/gpu-2026-11-27b.md, where the six sections the check had then
took 69, 43, 151, 55, 12 and 50 s, 6.3 minutes, and from what each new section runs; a section's start —
interpreter, imports, CUDA context — is 5–10 s of it). Full run: kernel_tests 69 s, families 25 s (≈ 200 tiny
tests; the module takes ~20 s on a 2-core CPU), kernels 43 s, resnet18_step 151 s, peer_mlp 65 s (a fourth arm
at the same cost as the third, ~10 s, and the floors), sequence 60 s (blitz's and bayesian-torch's Python loops
over 28 steps × 2 layers at M = 256 are most of it), lora 40 s (17 points, each building its GPT-2), predict_overhead
20 s, ivon_speed 12 s, optim_samples 50 s: about 9 minutes, with limits (``LIMITS``) that add up to 15⅔.
``--quick`` runs every section smaller (the kernel tests of the materialised rows, sizes, bad input and lead
dimensions; kernels at P ≤ 10⁷ and M ≤ 100; the ResNet-18 step at M ∈ {1, 10}, one repeat, no max-M search;
the peer MLP, sequence and LoRA ladders cut to their first two M; 1–10 repetitions; the sequence and LoRA
points in one process each) under limits (``QUICK_LIMITS``) that add up to 240 s, so it ends within 4 minutes
whatever happens: estimated kernel_tests 18 s, families 25 s, kernels 15 s, resnet18_step 20 s, peer_mlp 13 s,
sequence 15 s, lora 20 s, predict_overhead 12 s, ivon_speed 8 s, optim_samples 23 s: about 3 minutes.

Results go to ``bench/results/gpu-<date>.json`` and ``.md`` (``--out-dir``; ``gpu-<date>-quick`` with
``--quick``). ``--smoke`` runs every section on CPU at tiny sizes (Triton's interpreter, LeNet-5, a 20-16-4
MLP, a subset of the families on the CPU, an LSTM of width 8 on the digits, a GPT-2 of width 16) so that CI
keeps the script from rotting; its figures mean nothing.

Usage::

    make gpu-check                                   # on a machine with CUDA
    make gpu-check QUICK=1                           # the same in ≤ 4 minutes
    python -m bench.gpu_check --smoke --out-dir /tmp/gpu-smoke
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
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
SEQUENCE_SAMPLES = (1, 16, 64, 256)
LORA_SAMPLES = (1, 8, 32, 128)
#: The peer-MLP section's arms: (label, model to build, loss, what mcgraph is told).
PEER_ARMS = (
    ("bayesian-torch", "bayesian-torch", "bayesian-torch", "its own loop: M forwards, cross-entropy + get_kl_loss / N"),
    ("bayesian-torch+mcgraph", "bayesian-torch+mcgraph", "defaults", "to_mcgraph, mg.nn.elbo(num_samples=M): defaults"),
    ("mcgraph", "mcgraph", "defaults", "bayesify, mg.nn.elbo(num_samples=M): defaults"),
    ("mcgraph (forced tiers)", "mcgraph", "forced",
     "bayesify, num_samples=Sampling(M, method='chunked'), kl_samples=Sampling(M, method='collapsed-exact')"),
)
PEER_PROVIDERS = tuple(label for label, *_ in PEER_ARMS)
SECTIONS = ("kernel_tests", "families", "kernels", "resnet18_step", "peer_mlp", "sequence", "lora", "predict_overhead",
            "ivon_speed", "optim_samples")
#: Seconds each section may run (full mode and ``--smoke``), and with ``--quick`` (these add up to 240).
LIMITS = {"kernel_tests": 80, "families": 90, "kernels": 70, "resnet18_step": 170, "peer_mlp": 100, "sequence": 150,
          "lora": 120, "predict_overhead": 60, "ivon_speed": 40, "optim_samples": 60}
QUICK_LIMITS = {"kernel_tests": 30, "families": 32, "kernels": 20, "resnet18_step": 32, "peer_mlp": 18, "sequence": 22,
                "lora": 28, "predict_overhead": 16, "ivon_speed": 14, "optim_samples": 28}
#: ``--timeout-*`` option → section.
TIMEOUT_OPTIONS = {"tests": "kernel_tests", "families": "families", "kernels": "kernels", "step": "resnet18_step",
                   "peer": "peer_mlp", "sequence": "sequence", "lora": "lora", "predict": "predict_overhead",
                   "ivon": "ivon_speed", "optim": "optim_samples"}
#: The families (and checks) ``--smoke`` runs on the CPU: no transformers, under a minute there.
FAMILIES_SMOKE = "linear or conv2d or lstm-h0 or gru-2layer or mc-dropout or vogn-posterior"
FAMILIES_TEST = re.compile(r"test_family_on_device\[(?P<family>.+)/(?P<check>[^/]+)\]$")


def nominal_bandwidth(name: str) -> float | None:
    for key, bw in NOMINAL_BANDWIDTH:
        if key in name:
            return bw
    return None


def randn_floor_s(draws: int, device, reps: int = 5, block: int = 1 << 26) -> float:
    """Median seconds of drawing ``draws`` standard normals with ``torch.randn`` on ``device``: the floor of a
    step that samples them. Drawn in blocks of at most ``block`` values into one buffer (bounded memory;
    ``torch.randn`` writes every value, so this is an upper bound on pure generation), the device synchronised
    around each repetition, after one untimed draw."""
    import torch

    device = torch.device(device)
    draws = max(1, int(draws))
    buf = torch.empty(min(draws, block), device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def draw():
        left = draws
        while left > 0:
            n = min(left, block)
            torch.randn(n, out=buf[:n])
            left -= n

    draw()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        draw()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _env(smoke: bool) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("TRITON_INTERPRET", None)
    if smoke:
        env["TRITON_INTERPRET"] = "1"
    return env


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def limit(args, section: str) -> float:
    """The section's time limit: its ``--timeout-*`` option, else ``QUICK_LIMITS`` / ``LIMITS``."""
    given = next((getattr(args, f"timeout_{opt}") for opt, sec in TIMEOUT_OPTIONS.items() if sec == section), None)
    if given is not None:
        return given
    return (QUICK_LIMITS if args.quick and not args.smoke else LIMITS)[section]


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


def _counts(text: str) -> dict:
    found = re.findall(r"(\d+) (passed|failed|skipped|deselected|error|errors)", text)
    return {k.rstrip("s") if k.startswith("error") else k: int(v) for v, k in found}


def kernel_tests(args) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/engine/test_kernels.py"]
    extra = {}
    if args.smoke:
        cmd += ["-k", "materialised or sizes"]  # a handful of interpreted launches
    else:
        extra["MCGRAPH_KERNEL_DEVICE"] = "cuda"
        if args.quick:  # every kernel launched and checked once, no statistical suites
            cmd += ["-k", "materialised or sizes or bad_input or lead_dims"]
    sec = run_section("kernel_tests", cmd, limit(args, "kernel_tests"), args.smoke, extra)
    sec["counts"] = _counts(sec["output_tail"])
    return sec


def families(args, scratch: Path) -> dict:
    """``tests/nn/test_cuda_families.py`` on the device; the junit XML gives the family × check matrix."""
    report = scratch / "families.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/nn/test_cuda_families.py",
           f"--junitxml={report}"]
    if args.smoke:
        cmd += ["-k", FAMILIES_SMOKE]
    sec = run_section("families", cmd, limit(args, "families"), args.smoke,
                      {"MCGRAPH_TEST_DEVICE": "cpu" if args.smoke else "cuda"})
    sec["counts"] = _counts(sec["output_tail"])
    sec["rows"] = _junit_rows(report)
    if sec["status"] == "ok" and not sec["counts"].get("passed"):
        sec["status"] = "failed (no test passed: " + (sec["output_tail"].strip().splitlines() or ["?"])[-1] + ")"
    return sec


def _junit_rows(path: Path) -> list[dict]:
    """One row per test case: family, check, outcome (passed / failed / error / skipped), seconds, message."""
    if not path.exists():
        return []
    import xml.etree.ElementTree as ET

    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        m = FAMILIES_TEST.match(name)
        family, check = (m["family"], m["check"]) if m else (name.partition("[")[2].rstrip("]") or name,
                                                            name.partition("[")[0].removeprefix("test_"))
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                text = (node.get("message") or node.text or "").strip()
                message = text.splitlines()[0][:200] if text else ""
                break
        rows.append({"family": family, "check": check, "outcome": outcome, "seconds": float(case.get("time", 0)),
                     "message": message, "matrix": m is not None})
    return rows


def kernels_bench(args, out_dir: Path) -> dict:
    csv_path = out_dir / f"kernels-{args.tag}.csv"
    if csv_path.exists():
        csv_path.unlink()
    cmd = [sys.executable, "-m", "bench.kernels", "--out", str(csv_path)]
    if args.smoke:
        cmd += ["--smoke"]
    else:
        sizes, samples = ([s for s in args.kernel_sizes if s <= 10**7], [m for m in args.kernel_samples if m <= 100]) \
            if args.quick else (args.kernel_sizes, args.kernel_samples)
        cmd += ["--sizes", *map(str, sizes or args.kernel_sizes[:1]), "--samples",
                *map(str, samples or args.kernel_samples[:1]), "--max-seconds", str(args.kernel_max_seconds)]
    sec = run_section("kernels", cmd, limit(args, "kernels"), args.smoke)
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
    bench_dir = out_dir / f"step-{args.tag}"
    if args.smoke:
        model, samples = "lenet5", "1,2"
    else:
        model, samples = "resnet18", ",".join(map(str, STEP_SAMPLES[:2] if args.quick else STEP_SAMPLES))
    cmd = [sys.executable, "-m", "mcgraph", "bench", "--workload", "step", "--model", model, "--samples", samples,
           "--methods", "direct,grad-accum,mcgraph", "--device", "cpu" if args.smoke else "cuda",
           "--repeats", "1" if args.smoke or args.quick else "3",
           "--time-cap", "5" if args.smoke else ("10" if args.quick else "15"),
           "--m-cap", "4" if args.smoke else "100000", "--no-plots", "--no-progress", "--out", str(bench_dir)]
    if not args.smoke:
        cmd += ["--budget", "75GB"]
        if not args.max_m or args.quick:
            cmd += ["--no-max-m"]
    sec = run_section("resnet18_step", cmd, limit(args, "resnet18_step"), args.smoke)
    rows_file = bench_dir / "rows.json"
    if rows_file.exists():
        keep = ("workload", "method", "M", "status", "seconds", "peak", "peak_over_base", "bytes", "note")
        sec["rows"] = [{k: r.get(k) for k in keep} for r in json.loads(rows_file.read_text())["rows"]]
    summary = bench_dir / "summary.md"
    if summary.exists():
        sec["summary_md"] = summary.read_text()
    return sec


def peer_mlp(args, scratch: Path) -> dict:
    samples = (1, 2) if args.smoke else PEER_SAMPLES[:2] if args.quick else PEER_SAMPLES
    reps = 1 if args.smoke or args.quick else 3
    cmd = [sys.executable, "-m", "bench.gpu_check", "--peer-mlp-worker", "--samples", *map(str, samples),
           "--reps", str(reps)]
    if args.smoke:
        cmd += ["--smoke"]
    return _jsonl_section("peer_mlp", cmd, scratch / "peer_mlp.jsonl", args)


def _peer_loss(kind: str, model, x, y, M: int):
    """The negative ELBO per example of one peer-MLP arm: the peer's own loop, mcgraph's defaults, or the
    estimators ``bench/elbo_peers.py`` forces."""
    from bench import elbo_peers as ep

    if kind == "bayesian-torch":
        return ep.bayesian_torch_loss(model, x, y, M)
    if kind == "forced":
        return ep.mcgraph_loss(model, x, y, M)
    import mcgraph as mg

    return -mg.nn.elbo(model, x, y, num_samples=M, dataset_size=ep.DATASET, seed=0)


def peer_mlp_worker(samples: list[int], smoke: bool, reps: int = 3, out: Path | None = None) -> int:
    """Each (arm, M): build the model on the device, one warm-up step, then peak memory and the median time
    of ``reps`` forward+backward steps; out-of-memory is recorded, not raised. Every row carries the floor
    of its M: ``torch.randn`` of 2·M·P normals on the device (P: the bayesified MLP's weights). Rows are
    printed and appended to ``out`` (JSON lines)."""
    from mcgraph.apps import atomic_io

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        if out is not None:
            atomic_io.append_line(out, json.dumps(row))

    import torch

    import mcgraph as mg
    from bench import elbo_peers as ep

    device = torch.device("cpu" if smoke else "cuda")
    if smoke:
        ep.SIZES = (20, 16, 4)
    arms = PEER_ARMS
    if not _installed("bayesian_torch"):
        emit({"provider": "bayesian-torch", "status": "skipped: bayesian-torch is not installed"})
        arms = tuple(a for a in PEER_ARMS if not a[1].startswith("bayesian-torch"))
    x, y = (t.to(device) for t in ep._data())
    weights = sum(m.weight_mu.numel() + (m.bias_mu.numel() if m.bias_mu is not None else 0)
                  for m in mg.nn.bayesian_modules(ep.mcgraph_model()))
    floors = {M: randn_floor_s(2 * M * weights, device) for M in samples}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for provider, build, kind, settings in arms:
        for M in samples:
            row = {"provider": provider, "settings": settings, "M": M, "device": str(device), "weights": weights,
                   "randn_floor_s": floors[M]}
            model = None
            try:
                model = ep.build(build).to(device)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
                _peer_loss(kind, model, x, y, M).backward()  # warm-up (compiles kernels, plans)
                times = []
                for _ in range(reps):
                    model.zero_grad(set_to_none=True)
                    sync()
                    t0 = time.perf_counter()
                    _peer_loss(kind, model, x, y, M).backward()
                    sync()
                    times.append(time.perf_counter() - t0)
                row.update(status="ok", time_s=sorted(times)[len(times) // 2])
                row["of_floor"] = row["time_s"] / floors[M]
                if device.type == "cuda":
                    row["peak_bytes"] = int(torch.cuda.max_memory_allocated() - base)
            except Exception as exc:  # noqa: BLE001 - out of memory is a result here
                oom = isinstance(exc, getattr(torch.cuda, "OutOfMemoryError", ())) or "out of memory" in str(exc)
                row.update(status="out of memory" if oom else f"error: {type(exc).__name__}: {exc}"[:300])
            finally:
                del model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            emit(row)
    return 0


def _jsonl_section(name: str, cmd: list[str], out: Path, args, extra_env: dict | None = None) -> dict:
    """Run a bench script that appends JSON rows to ``out`` (a scratch file) and keep the rows and its summary."""
    out.unlink(missing_ok=True)
    sec = run_section(name, cmd + ["--out", str(out)], limit(args, name), args.smoke, extra_env)
    sec["rows"] = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []
    out.unlink(missing_ok=True)
    return sec


def sequence(args, scratch: Path) -> dict:
    """``bench/sequence_peers.py`` on the device: mcgraph at its default chunks against the installed peers."""
    providers = ["mcgraph"] + [p for p, mod in (("blitz", "blitz"), ("bayesian-torch", "bayesian_torch"))
                               if _installed(mod)]
    samples = (1, 2) if args.smoke else SEQUENCE_SAMPLES[:2] if args.quick else SEQUENCE_SAMPLES
    cmd = [sys.executable, "-m", "bench.sequence_peers", "--device", "cpu" if args.smoke else "cuda",
           "--samples", *map(str, samples), "--providers", *providers, "--chunk-size", "0", "--randn-floor",
           "--reps", "1" if args.smoke or args.quick else "2", "--in-process"]
    # on the GPU the device's memory is what counts: no point is skipped for the host's (in-process) RSS
    cmd += ["--dataset", "digits", "--hidden", "8", "--threads", "1"] if args.smoke else \
        ["--dataset", "auto", "--max-rss-gb", "64"]
    sec = _jsonl_section("sequence", cmd, scratch / "sequence.jsonl", args)
    for r in sec["rows"]:
        if "time_s" in r and r.get("randn_floor_s"):
            r["of_floor"] = r["time_s"] / r["randn_floor_s"]
    for p in ("blitz", "bayesian-torch"):
        if p not in providers:
            sec["rows"].append({"provider": p, "status": f"skipped: {p} is not installed"})
    sec["summary"] = list(dict.fromkeys(  # the fallback note is printed first and last: once
        line for line in sec["output_tail"].splitlines()
        if line.startswith(("mcgraph: peak", "blitz: peak", "bayesian-torch: peak", "M=", "NOTE:"))))
    return sec


def lora(args, scratch: Path) -> dict:
    """``bench/lora_lm.py`` on the device: mcgraph's ELBO step and prediction against peft LoRA's step and loop."""
    missing = [m for m in ("transformers", "peft") if not _installed(m)]
    if missing:
        print(f"[gpu-check] lora: skipped ({', '.join(missing)} not installed)", flush=True)
        return {"name": "lora", "command": "", "status": f"skipped: {', '.join(missing)} not installed",
                "seconds": 0.0, "output_tail": "", "rows": []}
    samples = (1, 2) if args.smoke else LORA_SAMPLES[:2] if args.quick else LORA_SAMPLES
    cmd = [sys.executable, "-m", "bench.lora_lm", "--device", "cpu" if args.smoke else "cuda", "--modes", "train",
           "predict", "--providers", "mcgraph", "lora", "lora-loop", "--samples", *map(str, samples),
           "--reps", "1" if args.smoke or args.quick else "2", "--randn-floor", "--in-process"]
    if args.smoke:
        cmd += ["--layers", "1", "--width", "16", "--heads", "2", "--vocab", "64", "--seq", "8", "--batch", "2",
                "--rank", "2", "--threads", "1"]
    else:
        cmd += ["--seq", "128"]
    sec = _jsonl_section("lora", cmd, scratch / "lora.jsonl", args)
    for r in sec["rows"]:
        if "time_s" in r and r.get("randn_floor_s"):
            r["of_floor"] = r["time_s"] / r["randn_floor_s"]
    sec["summary"] = [line for line in sec["output_tail"].splitlines() if line.startswith("- ")]
    return sec


def predict_overhead(args, scratch: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.predict_overhead", "--device", "cpu" if args.smoke else "cuda"]
    if args.smoke:
        cmd += ["--workload", "encoder", "--samples", "4", "--reps", "1", "--threads", "1"]
    else:
        cmd += ["--samples", "32", "--reps", "3" if args.quick else "7"]
        if not _installed("transformers"):
            cmd += ["--workload", "encoder"]
    return _jsonl_section("predict_overhead", cmd, scratch / "predict_overhead.jsonl", args)


def ivon_speed(args, scratch: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.ivon_speed"]
    if args.smoke:
        cmd += ["--models", "tiny", "--providers", "adam", "ivon", "--reps", "3"]
    else:
        cmd += ["--device", "cuda", "--models", "peer", "lenet5", "--reps", "10" if args.quick else "30"]
    return _jsonl_section("ivon_speed", cmd, scratch / "ivon_speed.jsonl", args)


def optim_samples(args, scratch: Path) -> dict:
    cmd = [sys.executable, "-m", "bench.optim_samples", "--points", "ivon:sequential:1",
           "ivon:batched:4" if args.smoke else "ivon:batched:8", "vogn:sequential:1",
           "vogn:batched:4" if args.smoke else "vogn:batched:8"]
    cmd += ["--sizes", "12", "16", "16", "3", "--reps", "2"] if args.smoke else \
        ["--device", "cuda", "--reps", "3" if args.quick else "15"]
    return _jsonl_section("optim_samples", cmd, scratch / "optim_samples.jsonl", args)


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


def _ms(v) -> str:
    """Seconds as milliseconds, 3 significant digits."""
    return "–" if v is None else f"{v * 1e3:.3g}"


def _times(v) -> str:
    return "–" if v is None else f"{v:.2f}×" if v < 100 else f"{v:.0f}×"


def _families_md(sec: dict) -> list[str]:
    rows = sec.get("rows") or []
    lines = ["", "## Every family on the device (tests/nn/test_cuda_families.py)", "", f"Counts: {sec.get('counts')}"]
    matrix = [r for r in rows if r["matrix"]]
    if matrix:
        checks = list(dict.fromkeys(r["check"] for r in matrix))
        mark = {"passed": "ok", "failed": "**FAILED**", "error": "**ERROR**", "skipped": "skipped"}
        cells: dict = {}
        for r in matrix:
            cells.setdefault(r["family"], {})[r["check"]] = mark.get(r["outcome"], r["outcome"])
        lines += ["", "| family | " + " | ".join(checks) + " |", "|---|" + "---|" * len(checks)]
        for family, row in cells.items():
            lines.append(f"| {family} | " + " | ".join(row.get(c, "–") for c in checks) + " |")
    others = [r for r in rows if r not in matrix]
    if others:
        lines += ["", "| test | case | outcome |", "|---|---|---|"]
        lines += [f"| {r['check']} | {r['family']} | {r['outcome']} |" for r in others]
    bad = [r for r in rows if r["outcome"] in ("failed", "error")]
    if bad:
        lines += ["", "Failures:", ""] + [f"- {r['family']} / {r['check']}: {r['message']}" for r in bad]
    skipped = sorted({r["message"] for r in rows if r["outcome"] == "skipped" and r["message"]})
    if skipped:
        lines += ["", "Skipped: " + "; ".join(skipped)]
    return lines


def _timed_cells(r: dict) -> str:
    """The cells status | time ms | randn floor ms | × floor | peak memory of a timed row."""
    status = "ok" if "time_s" in r else r.get("status", "?")
    return (f"{status} | {_ms(r.get('time_s'))} | {_ms(r.get('randn_floor_s'))} | {_times(r.get('of_floor'))} | "
            f"{_fmt_bytes(r.get('peak_bytes'))}")


def _sequence_md(sec: dict) -> list[str]:
    lines = ["", "## Bayesian LSTM classifier, full ELBO over M samples (bench/sequence_peers.py)", ""]
    first = next((r for r in sec["rows"] if "time_s" in r), {})
    if first:
        lines += [f"Workload: {first.get('dataset')} read by rows ({first.get('steps')} steps of "
                  f"{first.get('features')}), batch {first.get('batch')}, LSTM {first.get('layers')} × "
                  f"{first.get('hidden')} + linear head; mcgraph with its default chunks; P = {first.get('weights')} "
                  f"sampled weights; floor = torch.randn of 2·M·P normals on the device.", ""]
    lines += ["| provider | M | status | time ms | randn floor ms | × floor | peak memory | weight draws per "
              "sequence |", "|---|---|---|---|---|---|---|---|"]
    for r in sec["rows"]:
        lines.append(f"| {r['provider']} | {r.get('M', '')} | {_timed_cells(r)} | {r.get('draws_per_sequence', '–')} |")
    if sec.get("summary"):
        lines += [""] + [f"    {line}" for line in sec["summary"]]
    return lines


def _lora_md(sec: dict) -> list[str]:
    lines = ["", "## Bayesian LoRA on GPT-2: ELBO training and prediction (bench/lora_lm.py)", ""]
    first = next((r for r in sec["rows"] if "time_s" in r), {})
    if first:
        lines += [f"Sizes: {first.get('sizes')}; P = {first.get('weights')} adapter weights sampled; `lora`: peft's "
                  f"step (M = 1), `lora-loop`: M passes of peft's model; floor = torch.randn of 2·M·P normals "
                  f"(training) or M·P (prediction).", ""]
    lines += ["| mode | provider | M | status | time ms | randn floor ms | × floor | peak memory |",
              "|---|---|---|---|---|---|---|---|"]
    for r in sec["rows"]:
        if str(r.get("mode", "")).startswith("interleaved"):
            continue
        lines.append(f"| {r['mode']} | {r['provider']} | {r['M']} | {_timed_cells(r)} |")
    return lines


def _predict_md(sec: dict) -> list[str]:
    lines = ["", "## mg.nn.predict against M plain forwards (bench/predict_overhead.py)", "",
             "| workload | provider | M | time ms | × loop |", "|---|---|---|---|---|"]
    for r in sec["rows"]:
        lines.append(f"| {r['workload']} | {r['provider']} | {r['M']} | {r['time_s'] * 1e3:.2f} | "
                     f"{_times(r.get('vs_loop'))} |")
    return lines


def markdown(result: dict) -> str:
    mode = "smoke (CPU, interpreter: figures meaningless)" if result["smoke"] else "CUDA"
    if result.get("quick"):
        mode += ", quick (reduced sizes and repetitions)"
    lines = [f"# GPU check, {result['date']}", "",
             f"Device: {result['device']}; torch {result['torch']}; triton {result['triton']}; "
             f"commit {result['commit']}; mode: {mode}.",
             "", "| section | status | seconds |", "|---|---|---|"]
    for s in result["sections"]:
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']} |")
    secs = {s["name"]: s for s in result["sections"]}
    if "kernel_tests" in secs:
        lines += ["", "## Kernel tests compiled on the device", "", f"Counts: {secs['kernel_tests'].get('counts')}"]
    if "families" in secs:
        lines += _families_md(secs["families"])
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
        first = next((r for r in pm["rows"] if "weights" in r), {})
        lines += ["", "## bayesian-torch MLP (784-1000-1000-10), full ELBO over M samples", "",
                  f"P = {first.get('weights', '?')} sampled weights; floor = torch.randn of 2·M·P normals on the "
                  "device. Arms: " + "; ".join(f"`{label}`: {settings}" for label, _, _, settings in PEER_ARMS) + ".",
                  "", "| provider | M | status | time ms | randn floor ms | × floor | peak memory |",
                  "|---|---|---|---|---|---|---|"]
        for r in pm["rows"]:
            lines.append(f"| {r['provider']} | {r.get('M', '')} | {r['status']} | {_ms(r.get('time_s'))} | "
                         f"{_ms(r.get('randn_floor_s'))} | {_times(r.get('of_floor'))} | "
                         f"{_fmt_bytes(r.get('peak_bytes'))} |")
    if secs.get("sequence", {}).get("rows"):
        lines += _sequence_md(secs["sequence"])
    if secs.get("lora", {}).get("rows"):
        lines += _lora_md(secs["lora"])
    if secs.get("predict_overhead", {}).get("rows"):
        lines += _predict_md(secs["predict_overhead"])
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


def _ok(status: str) -> bool:
    """A section counts as done when it ran (``ok``) or was skipped for a missing optional package."""
    return status == "ok" or status.startswith("skipped")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny sizes (CI)")
    p.add_argument("--quick", action="store_true",
                   help="every section at reduced sizes and repetitions, within 4 minutes (the limits' sum)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--sections", nargs="+", default=list(SECTIONS))
    for opt, section in TIMEOUT_OPTIONS.items():
        p.add_argument(f"--timeout-{opt}", type=float, default=None,
                       help=f"seconds of the {section} section (default {LIMITS[section]:g}, --quick "
                            f"{QUICK_LIMITS[section]:g})")
    p.add_argument("--kernel-sizes", type=int, nargs="+", default=[10**6, 10**7, 10**8])
    p.add_argument("--kernel-samples", type=int, nargs="+", default=[1, 100, 1000])
    p.add_argument("--kernel-max-seconds", type=float, default=0.05, help="skip kernel points whose floor exceeds this")
    p.add_argument("--no-max-m", dest="max_m", action="store_false", help="skip the step's max-M search")
    p.add_argument("--peer-mlp-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--samples", type=int, nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer_mlp_worker:
        return peer_mlp_worker(args.samples, args.smoke, args.reps, args.out)

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
    args.tag = args.date + ("-quick" if args.quick else "")  # a quick run's files beside, not over, a full run's
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

    result = {"date": args.date, "smoke": args.smoke, "quick": args.quick, "torch": torch.__version__,
              "triton": triton_version, "device": "cpu" if args.smoke else torch.cuda.get_device_name(0),
              "machine": platform.node(), "commit": git_commit(), "sections": []}
    stem = "gpu-smoke" + ("-quick" if args.quick else "") if args.smoke else f"gpu-{args.tag}"
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    runners = {"kernel_tests": lambda: kernel_tests(args), "families": lambda: families(args, scratch),
               "kernels": lambda: kernels_bench(args, args.out_dir),
               "resnet18_step": lambda: resnet18_step(args, args.out_dir), "peer_mlp": lambda: peer_mlp(args, scratch),
               "sequence": lambda: sequence(args, scratch), "lora": lambda: lora(args, scratch),
               "predict_overhead": lambda: predict_overhead(args, scratch),
               "ivon_speed": lambda: ivon_speed(args, scratch), "optim_samples": lambda: optim_samples(args, scratch)}
    assert set(runners) == set(SECTIONS) == set(LIMITS) == set(QUICK_LIMITS)
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
    return 0 if all(_ok(s["status"]) for s in result["sections"]) else 1


if __name__ == "__main__":
    sys.exit(main())
