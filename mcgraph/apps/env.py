"""``mcgraph env`` (``python -m mcgraph env``): what a bug report needs to know about this installation.

The versions of mcgraph, Python, torch, Triton, numpy and every peer library (those not installed say so),
the devices and their memory, whether the two compiled CPU libraries build here and when they run, and the
noise backend in effect. Paste its output into a bug report.

The report is a list of sections, each a tuple of row functions; a row function takes the report's
:class:`Options` and returns ``(label, value)`` pairs. A new line is one more function in :data:`SECTIONS`.
A row function that raises prints its error in place of its rows, so one broken part never hides the rest.

Nothing here initialises CUDA unless torch is built with CUDA and a device is present, and nothing imports
Triton or the kernels (versions are read from the installed packages' metadata).

Example:
    >>> from mcgraph.apps import env
    >>> dict(env.python_rows(env.Options()))["Python"].split()[0].count(".") >= 1
    True
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

Row = tuple[str, str]


class Options(NamedTuple):
    """What the report may do: ``build`` the compiled CPU libraries (else only say whether a build is cached)."""

    build: bool = True


#: The peer libraries mcgraph converts from or is tested against, by their distribution names.
PEERS = ("bayesian-torch", "blitz-bayesian-pytorch", "torchbnn", "tyxe", "torch-uncertainty", "ivon-opt",
         "pyro-ppl", "transformers", "peft", "laplace-torch")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.1f} GiB"


# --------------------------------------------------------------------------------------------- versions


def mcgraph_rows(options: Options) -> list[Row]:
    """mcgraph's version and where it is imported from (a source checkout, or an installed package)."""
    import mcgraph

    where = Path(mcgraph.__file__).resolve().parent
    kind = "source checkout" if (where.parent / "pyproject.toml").is_file() else "installed package"
    return [("mcgraph", f"{mcgraph.__version__} ({kind}: {where})")]


def python_rows(options: Options) -> list[Row]:
    """The interpreter and the platform."""
    return [("Python", f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"),
            ("platform", f"{platform.platform()} ({platform.machine()})")]


def package_rows(options: Options) -> list[Row]:
    """torch (with the CUDA/ROCm version it is built for), Triton, numpy and the peer libraries."""
    import torch

    built = (f"CUDA {torch.version.cuda}" if torch.version.cuda
             else f"ROCm {torch.version.hip}" if getattr(torch.version, "hip", None) else "CPU only")
    rows = [("torch", f"{torch.__version__} (built for {built})")]
    triton = _version("triton")
    if triton != "not installed" and importlib.util.find_spec("triton") is None:
        triton += " (installed, not importable)"
    rows += [("triton", triton), ("numpy", _version("numpy"))]
    rows += [(name, _version(name)) for name in PEERS]
    return rows


# ---------------------------------------------------------------------------------------------- devices


def _memory_bytes() -> tuple[int | None, int | None]:
    """(total, available) RAM in bytes from ``/proc/meminfo``; the total from ``sysconf`` elsewhere."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        return info.get("MemTotal"), info.get("MemAvailable")
    except (OSError, ValueError, IndexError):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), None
        except (AttributeError, ValueError, OSError):
            return None, None


def cpu_rows(options: Options) -> list[Row]:
    """CPU cores (all, usable by this process, torch's threads), the vector ISA torch runs, and RAM."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    isa = torch.backends.cpu.get_cpu_capability()
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    total, available = _memory_bytes()
    ram = "unknown" if total is None else _gib(total) + ("" if available is None else f", {_gib(available)} available")
    return [("CPU", f"{os.cpu_count()} cores, {usable} usable by this process, torch threads {torch.get_num_threads()}"),
            ("CPU vector ISA", isa + (f" (ATEN_CPU_CAPABILITY={forced})" if forced else "")),
            ("RAM", ram)]


def cuda_rows(options: Options) -> list[Row]:
    """Each CUDA device's name, compute capability and total / free memory. CUDA is initialised only when
    torch is built with it and reports a device."""
    import torch

    if not torch.backends.cuda.is_built():
        return [("CUDA", "none (this torch is built without CUDA)")]
    if not torch.cuda.is_available():
        return [("CUDA", "none available (torch is built for it; no device or driver found)")]
    rows = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        rows.append((f"cuda:{i}", f"{props.name}, compute capability {props.major}.{props.minor}, "
                                  f"{_gib(total)} total, {_gib(free)} free"))
    return rows


# ------------------------------------------------------------------------------- compiled CPU libraries


def _library_state(path: Path, load: Callable, reason: Callable, options: Options) -> str:
    """Whether a compiled library (:class:`~mcgraph.engine.native.NativeLibrary`) at ``path`` is built, builds
    now (``options.build``), or why it cannot."""
    from mcgraph.engine import native

    cached = path.exists()
    if not options.build:
        return f"built ({path})" if cached else f"not built yet (builds at first use into {path})"
    if load() is None:
        return f"cannot be built: {reason()} (compiler {native.compiler()!r})"
    return f"built ({path})" if cached else f"built now ({path})"


def cpu_philox_rows(options: Options) -> list[Row]:
    """The compiled CPU noise stream (:mod:`mcgraph.engine.noise.cpu_philox`): built or buildable. When the
    engine reads it is the ``CPU noise stream`` line of the ``Engine`` section."""
    from mcgraph.engine import native
    from mcgraph.engine.noise import cpu_philox

    compiler = shutil.which(native.compiler()) or f"{native.compiler()} (not found)"
    state = _library_state(cpu_philox.build_path(), cpu_philox.extension, cpu_philox.unavailable_reason, options)
    isa = cpu_philox.isa()
    return [("C++ compiler", compiler),
            ("compiled CPU noise stream", state + (f", Philox rounds for {isa}" if isa else ""))]


def ivon_kernel_rows(options: Options) -> list[Row]:
    """IVON's and VOGN's compiled CPU update (:mod:`mcgraph.optim.cpu_kernels`): built or buildable, and used."""
    from mcgraph.optim import cpu_kernels

    path = cpu_kernels._LIBRARY.build_path()  # noqa: SLF001 - the module exposes no build_path of its own
    state = _library_state(path, cpu_kernels.library, cpu_kernels.unavailable_reason, options)
    if not options.build:
        used = "where it builds: IVON's and VOGN's steps on CPU parameters (fused=None)"
    elif cpu_kernels.library() is None:
        used = "no: torch's foreach operations run"
    else:
        used = (f"yes: IVON's and VOGN's steps on CPU parameters (fused=None); IVON's weight samples of groups "
                f"from {cpu_kernels.SAMPLE_MIN_ELEMENTS} elements")
    return [("compiled IVON / VOGN update", state), ("  used", used)]


# ------------------------------------------------------------------------------------------ the engine


def backend_rows(options: Options) -> list[Row]:
    """``MCGRAPH_BACKEND``, the backend it resolves to for CPU (and CUDA) tensors, and the CPU noise stream."""
    import torch
    from mcgraph.engine.noise import backends

    raw = os.environ.get(backends.ENV_VAR)
    rows = [(backends.ENV_VAR, "unset (auto)" if raw is None else repr(raw))]
    try:
        mode = backends.requested_backend()
    except ValueError as exc:
        return rows + [("noise backend", f"error: {exc}")]
    rows[0] = (backends.ENV_VAR, rows[0][1] + ("" if raw is None else f" -> {mode.value}"))
    devices = [("CPU tensors", torch.empty(0))]
    if torch.backends.cuda.is_built() and torch.cuda.is_available():
        devices.append(("CUDA tensors", torch.empty(0, device="cuda")))
    for label, tensor in devices:
        try:
            rows.append((f"backend, {label}", backends.backend_for(tensor)))
        except RuntimeError as exc:
            rows.append((f"backend, {label}", f"error: {exc}"))
    if len(devices) == 1:
        triton = "installed" if backends.triton_available() else "not installed"
        rows.append(("backend, CUDA tensors", f"no CUDA device (Triton {triton})"))
    try:
        import mcgraph as mg

        form = mg.family_of(torch.distributions.Normal(torch.zeros(1), torch.ones(1)))
        rows.append(("CPU noise stream, Normal", backends.describe_stream(form)))
    except RuntimeError as exc:
        rows.append(("CPU noise stream, Normal", f"error: {exc}"))
    return rows


RowFunction = Callable[[Options], Iterable[Row]]

def chunk_budget_rows(options: Options) -> list[Row]:
    """The memory budget a chunk of ``mg.nn.elbo`` / ``predict`` would get now on each device, and why."""
    import torch
    from mcgraph.engine import budget

    rows = [(budget.ENV_VAR, os.environ.get(budget.ENV_VAR) or "unset (the device's)")]
    devices = [torch.device("cpu")]
    if torch.backends.cuda.is_built() and torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    for device in devices:
        got = budget.budget_bytes(device)
        rows.append((f"chunk budget, {device}", f"{budget.format_bytes(got.bytes)} ({got.why})"))
    return rows


#: The engine's settings in effect now, one row function each: the noise backend, the chunk budget.
ENGINE_ROWS: tuple[RowFunction, ...] = (backend_rows, chunk_budget_rows)

#: The report: (section title, row functions), printed in this order.
SECTIONS: tuple[tuple[str, tuple[RowFunction, ...]], ...] = (
    ("Versions", (mcgraph_rows, python_rows, package_rows)),
    ("Devices", (cpu_rows, cuda_rows)),
    ("Compiled CPU libraries", (cpu_philox_rows, ivon_kernel_rows)),
    ("Engine", ENGINE_ROWS),
)


def report(options: Options = Options()) -> list[tuple[str, list[Row]]]:
    """The sections of :data:`SECTIONS` and their rows."""
    out = []
    for title, functions in SECTIONS:
        rows: list[Row] = []
        for fn in functions:
            try:
                rows.extend(fn(options))
            except Exception as exc:  # noqa: BLE001 - one broken part must not hide the rest of a bug report
                rows.append((fn.__name__.removesuffix("_rows"), f"error: {type(exc).__name__}: {exc}"))
        out.append((title, rows))
    return out


def format_report(sections: list[tuple[str, list[Row]]]) -> str:
    """The sections as text: a title line, then one ``label  value`` line a row, labels aligned."""
    width = max(len(label) for _, rows in sections for label, _ in rows)
    lines = []
    for title, rows in sections:
        lines += [f"{title}:"] + [f"  {label.ljust(width)}  {value}" for label, value in rows] + [""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mcgraph env", description="Print the versions, devices, compiled libraries and backends in effect "
                                        "(for a bug report).")
    parser.add_argument("--no-build", action="store_true",
                        help="do not build the compiled CPU libraries; only say whether a build is cached")
    args = parser.parse_args(argv)
    sys.stdout.write(format_report(report(Options(build=not args.no_build))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
