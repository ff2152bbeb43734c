"""The training CLI (``mcgraph.apps.train.main``) run in the test's own process."""

from __future__ import annotations

from pathlib import Path

import torch

from mcgraph.apps import atomic_io
from mcgraph.apps import train as mtrain


def run_main(argv: list) -> int:
    """``mcgraph train argv`` in this process; torch's thread count (which ``--threads`` sets) restored after."""
    threads = torch.get_num_threads()
    try:
        return mtrain.main(argv)
    finally:
        torch.set_num_threads(threads)


def resumed_pair(argv: list, tmp_path: Path) -> tuple[dict, dict]:
    """Train ``argv`` into ``tmp_path/ref``, then resume a copy of its checkpoint two saves back
    (``checkpoint.pt.2``) in ``tmp_path/again`` with ``--resume`` alone; the final checkpoints of both runs.
    ``argv`` must keep at least two checkpoints (``--keep-checkpoints 2``)."""
    ref, again = tmp_path / "ref", tmp_path / "again"
    assert run_main(argv + ["--out", str(ref)]) == 0
    again.mkdir()
    (again / "start.pt").write_bytes((ref / "checkpoint.pt.2").read_bytes())
    assert run_main(["--resume", str(again / "start.pt")]) == 0
    return atomic_io.load_checkpoint(ref / "checkpoint.pt")[0], atomic_io.load_checkpoint(again / "checkpoint.pt")[0]
