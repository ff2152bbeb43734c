"""``mcgraph bench``: memory and runtime vs M of mcgraph against direct MC, vectorised MC and
gradient accumulation; max M under a memory budget; tables, CSV/JSON rows, Markdown and plots.

Examples::

    python -m mcgraph bench --quick --out bench-out          # < 2 min on a 2-core CPU (the README's command)
    python -m bench.harness                                  # the same quick KL comparison, table only
    python -m mcgraph bench --full --out out                 # KL at P = 11.2 M (a ResNet-18's worth)
    python -m mcgraph bench --workload step --model resnet18 --samples 1,10,100,1000 --device cuda
    python -m mcgraph bench --workload lastlayer --samples 1,10,100,1000
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time

import torch

from .runner import Settings, run_cases
from .measure import format_bytes, parse_bytes, parse_count
from .progress import Progress
from .records import Row, environment, git_commit, total_ram_bytes
from .report import check_targets, text_report, write_all
from .workloads import ALL_METHODS, KL_PAIRS, README_PAIRS, KLCase, LastLayerCase, NotApplicable

WORKLOADS = ("kl", "step", "lastlayer")
FULL_P = 11_200_000  # a ResNet-18's worth of weights
QUICK_P = 1 << 14


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mcgraph bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0],
        epilog="Pairs (--model for kl): " + ", ".join(KL_PAIRS) + ".  Methods: " + ", ".join(ALL_METHODS) + ".")
    p.add_argument("--workload", action="append", default=None,
                   help="kl | step | lastlayer (repeat or comma-separate; default kl)")
    p.add_argument("--model", nargs="+", default=None,
                   help="KL pairs for kl (default: all; --quick: the README's three), architectures for step "
                        "(default: lenet5 resnet18 resnet50 preact_resnet18 densenet121 vgg11 vgg16; --quick: lenet5)")
    p.add_argument("--samples", type=_csv, default=None, help="the M ladder, e.g. 1,10,100,1000 (default "
                   "1,10,100,1000,10000; step: 1,10,100,1000)")
    p.add_argument("--methods", type=_csv, default=None, help=f"subset of {','.join(ALL_METHODS)} (default all)")
    p.add_argument("--budget", default=None, help="memory budget of the max-M search (default 11GB, the paper's "
                   "2080 Ti); also caps which points run")
    p.add_argument("--run-budget", default=None, help="skip points whose predicted memory exceeds this "
                   "(default: 70%% of RAM on CPU, 90%% of GPU memory on CUDA, at most --budget when given)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out", default=None, help="write rows.csv, rows.json, summary.md and PNG plots here")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help=f"reduced sizes (kl: P = {QUICK_P:,}), short caps: "
                      "< 2 min on a 2-core CPU")
    mode.add_argument("--full", action="store_true", help=f"the real sizes (kl: P = {FULL_P:,}); the default "
                      "unless --quick")
    p.add_argument("--params", default=None, help="P of the kl workload, e.g. 11.2M, 64k, 2**16")
    p.add_argument("--seed", type=int, default=0, help="noise seed shared by every method")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (median); default 3")
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs (the checked first run counts); default 1")
    p.add_argument("--time-cap", type=float, default=None, help="seconds per run; slower points (predicted or "
                   "measured) are recorded as skipped / over time (default 60, --quick 2)")
    p.add_argument("--rss", action="store_true", help="also run each point in a fresh subprocess for its peak "
                   "RSS (CPU; slow: one interpreter start per point)")
    p.add_argument("--no-max-m", dest="max_m", action="store_false", help="skip the max-M search")
    p.add_argument("--m-cap", type=parse_count, default=2**20, help="largest M of the max-M search (default 2**20)")
    p.add_argument("--batch", type=int, default=32, help="batch size (step, lastlayer); default 32")
    p.add_argument("--input-size", type=int, default=None, help="image side of the step workload (default 32 on "
                   "CUDA; on CPU the smallest of 16, 32 the model accepts)")
    p.add_argument("--posterior", default="radial", help="posterior of the step workload (default radial, as the "
                   "paper)")
    p.add_argument("--prior", default="normal", help="prior of the step workload (default normal)")
    p.add_argument("--classes", type=int, default=10, help="K of the lastlayer workload (and step classes)")
    p.add_argument("--features", type=int, default=512, help="D of the lastlayer workload (default 512)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's, or 1 when "
                   "the load average already fills the cores)")
    p.add_argument("--flush-denormal", action="store_true", help="torch.set_flush_denormal(True): avoids the "
                   "CPU's slow subnormal arithmetic (e.g. the scale-mixture prior's log-sum-exp)")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="do not write PNG plots")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--list", action="store_true", help="list workloads, KL pairs, models and methods, then exit")
    return p


def _workloads(args) -> list[str]:
    names = []
    for w in args.workload or ["kl"]:
        names += _csv(w)
    bad = [w for w in names if w not in WORKLOADS]
    if bad:
        raise SystemExit(f"mcgraph bench: --workload must be among {', '.join(WORKLOADS)}, got {', '.join(bad)}")
    return list(dict.fromkeys(names))


def _device(args) -> torch.device:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("mcgraph bench: --device cuda, but torch.cuda.is_available() is False")
    if args.device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def _run_budget(args, device: torch.device) -> float:
    if args.run_budget is not None:
        return parse_bytes(args.run_budget)
    if device.type == "cuda":
        machine = 0.9 * torch.cuda.get_device_properties(device).total_memory
    else:
        ram = total_ram_bytes()
        machine = 0.7 * ram if ram else math.inf
    return min(machine, parse_bytes(args.budget)) if args.budget is not None else machine


def make_cases(args, workloads: list[str], device: torch.device, dtype: torch.dtype,
               notes: dict, skipped: list[Row], commit: str) -> list:
    from .step import STEP_MODELS, nn_available, smallest_input

    cases = []
    models = list(args.model or [])
    pair_names = [m for m in models if m in KL_PAIRS]
    arch_names = [m for m in models if m not in KL_PAIRS]
    if "kl" in workloads:
        if models and not pair_names:
            raise SystemExit(f"mcgraph bench: no KL pair among --model {' '.join(models)}; pairs: "
                             f"{', '.join(KL_PAIRS)}")
        names = pair_names or (list(README_PAIRS) if args.quick else list(KL_PAIRS))
        P = parse_count(args.params) if args.params else (QUICK_P if args.quick else FULL_P)
        for name in names:
            c = KLCase(name, P, device=device, dtype=dtype)
            reduced = f"; P reduced to {P:,} by --quick (full: {FULL_P:,})" if args.quick and not args.params else ""
            notes[("kl", name)] = c.note + reduced
            cases.append(c)
    if "step" in workloads:
        from mcgraph.models import MODELS

        unknown = [m for m in arch_names if m not in MODELS]
        if unknown:
            raise SystemExit(f"mcgraph bench: unknown model(s) {', '.join(unknown)}; architectures: "
                             f"{', '.join(sorted(MODELS))}; KL pairs: {', '.join(KL_PAIRS)}")
        names = arch_names or (["lenet5"] if args.quick else list(STEP_MODELS))
        why = nn_available()
        for name in names:
            if why is not None:
                skipped.append(Row("step", name, "all", 0, 0, device=str(device), commit=commit,
                                   status=f"skipped: {why}"))
                continue
            channels = 1 if name == "lenet5" else 3
            size = args.input_size or (32 if device.type == "cuda" else smallest_input(name, channels))
            try:
                c = _step_case(name, args, size, channels, device, dtype)
            except NotApplicable as e:
                skipped.append(Row("step", name, "all", 0, 0, device=str(device), commit=commit,
                                   status=f"skipped: {e}"))
                continue
            reduced = "" if args.input_size or device.type == "cuda" or size >= 32 else \
                f"; input reduced to {size}×{size} on CPU (CUDA default 32; --input-size)"
            notes[("step", name)] = c.note + reduced
            cases.append(c)
    if "lastlayer" in workloads:
        c = LastLayerCase(args.batch, args.classes, args.features, device=device, dtype=dtype)
        notes[("lastlayer", c.model)] = c.note
        cases.append(c)
    return cases


def _step_case(name, args, size, channels, device, dtype):
    from .step import StepCase  # imported lazily: it needs mcgraph.nn

    return StepCase(name, batch=args.batch, input_size=size, channels=channels, classes=args.classes,
                    posterior=args.posterior, prior=args.prior, device=device, dtype=dtype)


def _busy_warning() -> str:
    """A warning when other processes already occupy the cores (timings become noisy), else ``""``."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return ""
    cores = os.cpu_count() or 1
    if load < 0.75 * cores:
        return ""
    return (f"the machine is busy (1-min load {load:.1f} on {cores} cores): timings will be noisy, and "
            f"intra-op threads stall on an oversubscribed CPU")


def _list() -> int:
    from mcgraph.models import MODELS

    from .step import STEP_MODELS, nn_available

    print("workloads:", ", ".join(WORKLOADS))
    print("kl pairs:")
    for name, pair in KL_PAIRS.items():
        print(f"  {name:18s} {pair.label}{'  (README / --quick)' if name in README_PAIRS else ''}")
    print("step architectures (default):", ", ".join(STEP_MODELS))
    print("all architectures:", ", ".join(sorted(MODELS)))
    print("methods:", ", ".join(ALL_METHODS))
    why = nn_available()
    print("mcgraph.nn:", "available" if why is None else why)
    return 0


PLOTS_HINT = "pip install matplotlib (or pip install 'mcgraph[bench]') for the PNG plots"


def plotting_available() -> str | None:
    """``None`` when matplotlib imports, else why not (checked before any point runs)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return f"matplotlib is not importable ({e})"
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mcgraph bench``; returns the exit status (1 if a method was refused or errored)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.list:
        return _list()
    no_plots = plotting_available() if args.out and args.plots else None
    if no_plots:  # say it now, not after every point has run
        print(f"mcgraph bench: {no_plots}: rows.csv, rows.json and summary.md will be written without plots; "
              f"{PLOTS_HINT}", file=sys.stderr)
        args.plots = False
    start = time.perf_counter()
    busy = _busy_warning()
    if args.threads is None and busy:
        args.threads = 1
        busy += "; using --threads 1 (pass --threads N to override)"
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.flush_denormal:
        torch.set_flush_denormal(True)
    workloads = _workloads(args)
    device = _device(args)
    dtype = getattr(torch, args.dtype)
    commit = git_commit()
    quick = args.quick
    if args.methods:
        bad = [m for m in args.methods if m not in ALL_METHODS]
        if bad:
            raise SystemExit(f"mcgraph bench: unknown method(s) {', '.join(bad)}; methods: {', '.join(ALL_METHODS)}")
    if args.samples:
        samples = tuple(sorted({parse_count(s) for s in args.samples}))
        if samples[0] < 1:
            raise SystemExit("mcgraph bench: --samples must be positive")
    else:
        samples = (1, 10, 100, 1000) if workloads == ["step"] else (1, 10, 100, 1000, 10_000)
    budget = parse_bytes(args.budget) if args.budget is not None else 11e9
    settings = Settings(
        samples=samples, methods=tuple(args.methods or ()), seed=args.seed, repeats=max(1, args.repeats),
        warmup=max(1, args.warmup), slow_seconds=0.2 if quick else 10.0, slow_repeats=1,
        time_cap=args.time_cap if args.time_cap is not None else (2.0 if quick else 60.0),
        run_budget=_run_budget(args, device), rss=args.rss and device.type == "cpu",
        maxm_budget=budget, m_cap=args.m_cap, probe_time_cap=0.5 if quick else 20.0,
        probe_budget=0.3 if quick else 60.0,
        device=device, dtype=dtype, threads=args.threads, flush_denormal=args.flush_denormal, commit=commit)

    if busy:
        print(f"mcgraph bench: {busy}", file=sys.stderr)
    notes: dict = {}
    skipped: list[Row] = []
    cases = make_cases(args, workloads, device, dtype, notes, skipped, commit)
    progress = Progress(1, enabled=args.progress)
    try:
        rows = skipped + run_cases(cases, settings, progress, max_m=args.max_m)
    finally:
        progress.close()
    wall = time.perf_counter() - start

    env = environment(device)
    meta = {
        "command": "mcgraph bench " + " ".join(shlex.quote(a) for a in argv),
        "environment": env,
        "mode": ("quick (reduced sizes, short time cap)" if quick else "full"),
        "sizes": "; ".join(f"{w}/{m}: {n}" for (w, m), n in notes.items()),
        "memory": ("'bytes' = bytes saved for backward by the loss's autograd graph (mg.graph_size; grad-accum: "
                   "one sample's graph)" + (f"; 'peak' = {settings.memory_metric}" if settings.memory_metric
                                            else "; no peak measured (pass --rss on CPU)")),
        "timing": (f"median of {settings.repeats} timed runs after {settings.warmup} warm-up "
                   f"({'1 run for points slower than %.2g s; ' % settings.slow_seconds if settings.slow_seconds < math.inf else ''}"
                   f"time cap {settings.time_cap:g} s per run, predicted from smaller M"
                   f"{', CUDA synchronised' if device.type == 'cuda' else ''})"),
        "agreement": ("every method's value and gradients are compared with the reference (the cheapest exact "
                      "method) at the same seed, rtol 1e-4 relative to the norm; collapsed-exact by a t-test "
                      f"over {settings.same_law_draws} seeds (same law, different numbers)"),
        "budget": (f"max-M search budget {format_bytes(settings.maxm_budget)} "
                   f"({'cuda max_memory_allocated' if device.type == 'cuda' else 'saved-for-backward bytes'}), "
                   f"M cap {settings.m_cap:,}; points predicted above {format_bytes(settings.run_budget)} "
                   f"(peak ≈ {settings.peak_factor:g} × saved bytes on CPU) are not run"),
        "wall_seconds": wall,
        "load": busy or "machine not oversubscribed at start",
        "settings": {k: (str(v) if not isinstance(v, (int, float, str, bool, type(None), tuple, list)) else v)
                     for k, v in vars(settings).items()},
    }
    targets = check_targets(rows)
    if args.out:
        paths = write_all(rows, meta, args.out, notes, plots=args.plots)
        where = f"wrote {paths['csv']}, {paths['json']}, {paths['markdown']}" + (
            f" and {len(paths['plots'])} plots" if paths["plots"] else "") + (
            f" (no plots: {no_plots}; {PLOTS_HINT})" if no_plots else "")
    else:
        where = "pass --out DIR to write rows.csv, rows.json, summary.md and plots"
    print(text_report(rows, notes, targets))
    print(f"{len(rows)} rows in {wall:.1f} s on {device} (torch {torch.__version__}, commit {commit or '?'}); {where}")
    bad = [r for r in rows if r.status.startswith(("REFUSED", "error"))]
    for r in bad:
        print(f"!! {r.workload}/{r.model} {r.method} M={r.M}: {r.status}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
