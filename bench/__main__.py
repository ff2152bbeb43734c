"""``python -m bench [options]`` (from a checkout's root): the quick KL comparison (``mcgraph bench --quick``) by default.

Any option of ``mcgraph bench`` may follow; ``--full`` (or ``--params``) selects the real size.
"""

from __future__ import annotations

import sys

from .harness.cli import main


def _argv(argv: list[str]) -> list[str]:
    if "--full" in argv or "--quick" in argv or any(a == "--params" or a.startswith("--params=") for a in argv):
        return argv
    return ["--quick", *argv]


if __name__ == "__main__":
    raise SystemExit(main(_argv(sys.argv[1:])))
