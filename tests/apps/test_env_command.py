"""``mcgraph env`` / ``python -m mcgraph env``: the report a bug report asks for (:mod:`mcgraph.apps.env`)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcgraph.apps import env as env_command
from support.paths import ROOT

SECTIONS = ("Versions:", "Devices:", "Compiled CPU libraries:", "Engine:")


def _run(args, *, extra_env=None, cwd=ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MCGRAPH_BACKEND"}
    env.update(OMP_NUM_THREADS="1", **(extra_env or {}))
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    return done


def _rows(report: str) -> dict[str, str]:
    """``label -> value`` of the report's indented lines (labels are separated from values by 2+ spaces)."""
    rows = {}
    for line in report.splitlines():
        if line.startswith("  "):
            label, _, value = line.strip().partition("  ")
            rows[label.strip()] = value.strip()
    return rows


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def test_python_m_mcgraph_env_prints_versions_devices_libraries_and_backend():
    report = _run([sys.executable, "-m", "mcgraph", "env"]).stdout
    assert [line for line in report.splitlines() if line.endswith(":") and not line.startswith(" ")] == \
        list(SECTIONS), report
    rows = _rows(report)
    assert rows["mcgraph"].startswith("0.1.0 (source checkout"), rows["mcgraph"]
    assert rows["Python"].startswith(".".join(map(str, sys.version_info[:3]))), rows["Python"]
    assert rows["torch"].startswith(torch.__version__), rows["torch"]
    for name in ("triton", "numpy", *env_command.PEERS):  # every peer: its version, or that it is missing
        assert rows[name].startswith(_version(name)), (name, rows[name])
    assert rows["CPU"].startswith(f"{os.cpu_count()} cores") and "GiB" in rows["RAM"], rows
    if not torch.backends.cuda.is_built():
        assert rows["CUDA"].startswith("none"), rows["CUDA"]
    for library in ("compiled CPU noise stream", "compiled IVON / VOGN update"):
        assert rows[library].startswith(("built", "cannot be built")), (library, rows[library])
    assert rows["MCGRAPH_BACKEND"] == "unset (auto)" and rows["backend, CPU tensors"] == "torch", rows
    assert "M·P ≥" in rows["CPU noise stream, Normal"], rows["CPU noise stream, Normal"]


def test_the_console_script_has_the_command():
    script = Path(sys.executable).with_name("mcgraph")
    if not script.exists():
        pytest.skip(f"no console script beside {sys.executable} (pip install -e . makes it)")
    helped = _run([script, "--help"]).stdout
    assert "env" in helped.split("commands:")[1], helped
    report = _run([script, "env", "--no-build"]).stdout
    assert all(section in report for section in SECTIONS), report


NO_TRITON = """if True:
    import sys
    sys.modules["triton"] = None  # import triton raises and find_spec("triton") is None, as without the package
    from mcgraph.__main__ import main
    code = main(["env", "--no-build"])
    import torch
    assert not torch.cuda.is_initialized()
    assert sys.modules["triton"] is None and "mcgraph.kernels.utils" not in sys.modules  # no Triton kernel
    raise SystemExit(code)
"""


def test_runs_without_cuda_and_without_triton_and_imports_neither():
    report = _run([sys.executable, "-c", NO_TRITON], extra_env={"CUDA_VISIBLE_DEVICES": ""}).stdout
    rows = _rows(report)
    assert rows["triton"] in ("not installed", f"{_version('triton')} (installed, not importable)"), rows["triton"]
    assert rows["CUDA"].startswith("none"), rows["CUDA"]
    assert rows["backend, CUDA tensors"] == "no CUDA device (Triton not installed)", rows
    assert rows["backend, CPU tensors"] == "torch", rows


def test_without_a_compiler_the_libraries_say_why_and_that_torch_runs(tmp_path):
    report = _run([sys.executable, "-m", "mcgraph", "env"],
                  extra_env={"CXX": str(tmp_path / "no-such-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path)}).stdout
    rows = _rows(report)
    for library in ("compiled CPU noise stream", "compiled IVON / VOGN update"):
        assert rows[library].startswith("cannot be built:") and "no-such-compiler" in rows[library], rows[library]
    assert rows["used"].startswith("no:"), rows["used"]
    assert "unavailable" in rows["CPU noise stream, Normal"], rows["CPU noise stream, Normal"]


@pytest.mark.parametrize("value, cpu, stream", [
    ("torch", "torch", "torch's generator"),
    ("cpu-philox", "torch", "[MCGRAPH_BACKEND=cpu-philox]"),
    ("bogus", None, None),
])
def test_the_backend_rows_follow_mcgraph_backend(monkeypatch, value, cpu, stream):
    monkeypatch.setenv("MCGRAPH_BACKEND", value)
    rows = dict(env_command.backend_rows(env_command.Options(build=False)))
    if cpu is None:
        assert rows["MCGRAPH_BACKEND"] == repr(value) and rows["noise backend"].startswith("error:"), rows
        return
    assert rows["MCGRAPH_BACKEND"] == f"{value!r} -> {value}", rows
    assert rows["backend, CPU tensors"] == cpu and stream in rows["CPU noise stream, Normal"], rows


def test_a_row_function_that_fails_prints_its_error_and_the_rest_still_prints(monkeypatch):
    def broken_rows(options):
        raise OSError("no such thing")

    title, functions = env_command.SECTIONS[0]
    monkeypatch.setattr(env_command, "SECTIONS", ((title, (broken_rows, *functions)), *env_command.SECTIONS[1:]))
    report = env_command.format_report(env_command.report(env_command.Options(build=False)))
    rows = _rows(report)
    assert rows["broken"] == "error: OSError: no such thing", rows
    assert rows["mcgraph"] and rows["torch"] and "MCGRAPH_BACKEND" in rows, report
