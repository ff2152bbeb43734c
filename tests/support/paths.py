"""Where the checkout's parts are, for tests that read its files or start processes in it."""

from __future__ import annotations

from pathlib import Path

#: The repository root (the folder that holds ``pyproject.toml``).
ROOT = Path(__file__).resolve().parents[2]
#: The tests' root: ``conftest.py``, ``support/`` and one folder per area.
TESTS = ROOT / "tests"
