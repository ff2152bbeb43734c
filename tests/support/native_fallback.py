"""Running a snippet where the compiled CPU libraries cannot be built (each test of a library's fallback)."""

from __future__ import annotations

import os
import subprocess
import sys

from support.paths import ROOT


def assert_runs_without_compiler(tmp_path, code: str) -> None:
    """Run ``code`` in a fresh interpreter whose ``CXX`` names no program and whose extensions folder is
    empty (so nothing cached can be loaded), on one thread; it must exit 0 and print ``OK``."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]
