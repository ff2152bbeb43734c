"""The environment of a child process in the subprocess tests (training CLI, crash safety)."""

from __future__ import annotations

import os
from pathlib import Path

import mcgraph as mg

#: the checkout (or install) root the child imports mcgraph from
ROOT = str(Path(mg.__file__).parents[1])

#: fault-injection switches of mcgraph.apps.atomic_io and the training loop: never inherited from the parent
FAULT_VARIABLES = ("MCGRAPH_ATOMIC_PAUSE_S", "MCGRAPH_ATOMIC_FAIL", "MCGRAPH_ATOMIC_MATCH", "MCGRAPH_FAULT_NONFINITE")


def child_env(**extra) -> dict:
    """The parent's environment with one thread, mcgraph importable from ``ROOT``, no inherited fault
    switches, then ``extra``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for key in FAULT_VARIABLES:
        env.pop(key, None)
    env.update(extra)
    return env
