"""Benchmark rows: one flat record per (workload, model, method, P, M) point.

Rows are the only thing plots, tables and the Markdown summary read (STYLE rule 10).
They are written as CSV (one row per line, :data:`COLUMNS` in order) and as JSON
(``{"meta": {...}, "rows": [...]}``), so a later run or a notebook can reload them
with :func:`read_json` / ``csv.DictReader``.

Status values:

* ``ok`` — measured; ``seconds`` is the median of the timed repeats.
* ``skipped (predicted …)`` — not run: the memory or time predicted from smaller M
  exceeds the budget or the time cap.
* ``OOM`` / ``over time (…)`` — run, and ran out of memory or past the cap.
* ``REFUSED: disagrees (…)`` — its value or gradients differ from the reference at
  the same seed; no time is reported for a wrong answer.
* ``n/a (…)`` — the method does not apply to this workload (a forced tier that
  cannot compute a term, say).
* ``skipped: …`` — the whole workload could not run (a missing module, say).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mcgraph.apps import atomic_io

import torch

#: Column order of the CSV (and keys of each JSON row).
COLUMNS = (
    "workload", "model", "method", "P", "M", "device", "torch", "commit", "status",
    "bytes", "peak", "peak_over_base", "memory_metric", "seconds", "seconds_min", "repeats",
    "speedup_vs_direct", "speedup_vs_grad_accum", "value", "agreement", "predicted_bytes",
    "predicted_seconds", "note",
)


@dataclass
class Row:
    """One benchmark point.

    Attributes:
        workload: ``"kl"`` | ``"step"`` | ``"lastlayer"``; the max-M search rows are ``"<workload>-maxm"``
            (``M`` = the largest feasible M, ``status`` ``"≥ cap …"`` when the search cap was reached).
        model: the KL pair (``"normal-normal"``) or the architecture (``"resnet18"``).
        method: ``direct`` (per-sample loop), ``vectorised``, ``grad-accum``, ``mcgraph``
            (auto), a forced tier, ``randn`` (the sampling floor: plain ``torch.randn`` of M·P
            normals), or ``all`` on a workload-level ``skipped: …`` row.
        P: number of weights the expectation is over.
        M: number of Monte Carlo samples (for ``maxm`` rows: the max feasible M found).
        bytes: bytes saved for backward by the loss's autograd graph (``mg.graph_size``;
            for ``grad-accum`` the graph of one sample, the most it holds at once).
        peak: peak memory in bytes — CUDA ``max_memory_allocated`` or the peak RSS
            (VmHWM) of a fresh subprocess that ran only this point (``--rss``).
        peak_over_base: ``peak`` minus the memory held before the point ran.
        memory_metric: which measure ``peak`` is (empty when no peak was measured); for the
            max-M rows, the measure compared with the budget.
        seconds: median wall time of forward + backward over ``repeats`` timed runs.
        speedup_vs_direct / speedup_vs_grad_accum: ``seconds(baseline) / seconds``
            in the same run (> 1: faster than the baseline).
        value: the loss value (for the agreement check and the reader).
        agreement: how the value and gradients compared with the reference method.
    """

    workload: str
    model: str
    method: str
    P: int
    M: int
    device: str = "cpu"
    torch: str = torch.__version__
    commit: str = ""
    status: str = "ok"
    bytes: int | None = None
    peak: int | None = None
    peak_over_base: int | None = None
    memory_metric: str = ""
    seconds: float | None = None
    seconds_min: float | None = None
    repeats: int | None = None
    speedup_vs_direct: float | None = None
    speedup_vs_grad_accum: float | None = None
    value: float | None = None
    agreement: str = ""
    predicted_bytes: int | None = None
    predicted_seconds: float | None = None
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in COLUMNS}


def git_commit(path: str | os.PathLike | None = None) -> str:
    """``git describe --always --dirty`` of the repository holding ``path`` (or ``""``)."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=where,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def environment(device: torch.device) -> dict:
    """Versions and machine facts recorded with every run."""
    env = {
        "torch": torch.__version__,
        "commit": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "ram_bytes": total_ram_bytes(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device_name"] = props.name
        env["device_memory_bytes"] = int(props.total_memory)
    else:
        env["device_name"] = platform.processor() or platform.machine()
    return env


def total_ram_bytes() -> int | None:
    """Physical memory of this machine (``/proc/meminfo`` or ``sysconf``), or ``None``."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def write_csv(rows: list[Row], path: str | os.PathLike) -> Path:
    path = Path(path)
    with atomic_io.atomic_write(path, "w") as f:  # a killed run leaves the previous file, never half a table
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in r.as_dict().items()})
    return path


def write_json(rows: list[Row], meta: dict, path: str | os.PathLike) -> Path:
    path = Path(path)
    atomic_io.write_json(path, {"meta": meta, "rows": [r.as_dict() for r in rows]}, indent=1, default=str)
    return path


def read_json(path: str | os.PathLike) -> tuple[dict, list[Row]]:
    """Reload ``(meta, rows)`` written by :func:`write_json`."""
    data = json.loads(Path(path).read_text())
    names = {f.name for f in dataclasses.fields(Row)}
    return data["meta"], [Row(**{k: v for k, v in r.items() if k in names}) for r in data["rows"]]
