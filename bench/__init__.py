"""mcgraph's benchmarks: development code of a source checkout, never installed with the package.

* :mod:`bench.harness` — the harness behind ``mcgraph bench`` / ``python -m bench``: memory and time
  against M, mcgraph beside direct MC and gradient accumulation, rows written as CSV/JSON/Markdown;
* one module per benchmark script, run from the checkout's root as ``python -m bench.<name>``
  (``python -m bench.elbo_peers --help``), each writing its figures under ``bench/results``;
* ``test_*.py`` — smoke tests of the scripts at tiny sizes (``make bench-smoke``).

Importing this package runs nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The checkout this package belongs to.
ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a benchmark's child process: this one's, with the checkout first on ``PYTHONPATH``
    so that ``python -m bench.<name>`` imports this checkout's ``bench`` whatever the working directory."""
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **extra}
