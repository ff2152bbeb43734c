"""Regenerate the paper's tables and figures at CPU scale, side by side with the published values.

``python -m paper_tables all [--quick] [--out DIR]`` or one target at a time
(``table1``, ``theorems``, ``fig2_left``, ``fig2_right``, ``fig1_fig6``, ``fig7_fig8``, and the optimizer
seeds' ``vogn_table`` and ``spike_slab``, the sparsification seeds' ``sparse_vd_kl``, ``sparse_vd_table``,
``random_labels`` and ``bbb_cnn``, ``ivon_table``, the sequence models' ``sequence_table``, and the
Bayesian fine-tuning seed's ``lora_table``).
Each target is a module with ``run(out_dir, quick, seed) -> dict`` writing
``<target>.md``, ``<target>.png`` and ``<target>.json`` and refreshing ``README.md``
of the output folder; see ``paper_tables/README.md``.

Adding a target is one module plus one line in :data:`TARGETS`.
"""

from __future__ import annotations

import importlib
from typing import Callable

#: target name → module (imported on first use, so ``--help`` imports no torch).
TARGETS: dict[str, str] = {
    "table1": "paper_tables.table1",
    "theorems": "paper_tables.theorems",
    "fig2_left": "paper_tables.fig2_left",
    "fig2_right": "paper_tables.fig2_right",
    "fig1_fig6": "paper_tables.fig1_fig6",
    "fig7_fig8": "paper_tables.fig7_fig8",
    "vogn_table": "paper_tables.vogn_table",
    "spike_slab": "paper_tables.spike_slab",
    "sparse_vd_kl": "paper_tables.sparse_vd_kl",
    "sparse_vd_table": "paper_tables.sparse_vd_table",
    "random_labels": "paper_tables.random_labels",
    "bbb_cnn": "paper_tables.bbb_cnn",
    "ivon_table": "paper_tables.ivon_table",
    "sequence_table": "paper_tables.sequence_table",
    "lora_table": "paper_tables.lora_table",
}


def get_target(name: str) -> Callable[..., dict]:
    """The ``run(out_dir, quick, seed)`` function of target ``name``.

    Raises:
        ValueError: unknown name (the message lists the targets).
    """
    if name not in TARGETS:
        raise ValueError(f"target must be one of {sorted(TARGETS)}, got {name!r}")
    return importlib.import_module(TARGETS[name]).run


__all__ = ["TARGETS", "get_target"]
