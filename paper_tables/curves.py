"""Long training runs that can stop and resume: a checkpoint after every epoch, and a curve of scores.

Not a target: ``sparse_vd_table`` and ``vogn_table`` train at the seeds' schedules (hundreds of
epochs) with it, ``sequence_table`` to convergence. A run is a loop over epochs; after each one
:func:`train_epochs` writes, atomically, the state of every object it was given (model, optimizer,
data-order generator), torch's global generator (dropout masks draw from it), the epochs done, the
training seconds and the curve so far. Started again with the same key it continues from the
last completed epoch, so stopping a run (a ``--budget-minutes`` deadline, SIGKILL, a reboot) costs
at most one epoch. A different key (other settings) starts from scratch.

The curve holds ``evaluate(epoch)`` every ``every`` epochs and at the last one; ``evaluate`` must not
change the training state (score a copy when scoring prunes or freezes).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from mcgraph.apps import atomic_io

from .common import log, out_of_time

__all__ = ["train_epochs"]


def _state(obj):
    return obj.get_state() if isinstance(obj, torch.Generator) else obj.state_dict()


def _load(obj, state) -> None:
    if isinstance(obj, torch.Generator):
        obj.set_state(state)
    else:
        obj.load_state_dict(state)


def train_epochs(path: str | Path | None, key: str, objects: dict, epochs: int, run_epoch: Callable[[int], None],
                 evaluate: Callable[[int], dict], every: int = 1, label: str = "") -> dict:
    """Run epochs ``0 .. epochs - 1`` of ``run_epoch``, resuming from the checkpoint at ``path``.

    Args:
        path: the checkpoint file (``torch.save``; replaced atomically after every epoch); ``None``: none.
        key: the run's settings hash; a checkpoint with another key is ignored (and overwritten).
        objects: name → object with ``state_dict``/``load_state_dict`` (a module, an optimizer) or a
            ``torch.Generator``; saved and restored together.
        epochs: the schedule's length.
        run_epoch: trains epoch ``e`` (0-based) in place.
        evaluate: scores after epoch ``e``; a dict of floats, appended to the curve with ``epoch = e + 1``.
        every: score every ``every`` epochs (and after the last).
        label: the run's name in progress lines.

    Returns:
        ``{"curve": [...], "epochs_done": k, "complete": k == epochs, "train_seconds": s,
        "seconds_per_epoch": s / k}``. Stops early, with ``complete`` false, when the deadline of
        :func:`paper_tables.common.set_deadline` has passed after an epoch.
    """
    path = None if path is None else Path(path)
    done, curve, seconds = 0, [], 0.0
    if path is not None and path.is_file():
        ckpt = torch.load(path, weights_only=False)
        if ckpt.get("key") == key:
            for name, obj in objects.items():
                _load(obj, ckpt["states"][name])
            done, curve, seconds = ckpt["epochs_done"], ckpt["curve"], ckpt["train_seconds"]
            if "torch_rng" in ckpt:  # dropout masks and other draws from torch's global generator
                torch.set_rng_state(ckpt["torch_rng"])
            log(f"{label}: resuming after epoch {done} of {epochs}")
    while done < epochs and not out_of_time():
        t0 = time.perf_counter()
        run_epoch(done)
        seconds += time.perf_counter() - t0
        done += 1
        if done % every == 0 or done == epochs:
            point = {"epoch": done, "train_seconds": seconds, **evaluate(done - 1)}
            curve.append(point)
            log(f"{label}: epoch {done}/{epochs} " + ", ".join(
                f"{k} {v:.4g}" for k, v in point.items() if k != "epoch" and isinstance(v, float)))
        if path is None:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_io.atomic_write(path, "wb") as f:
            torch.save({"key": key, "epochs_done": done, "curve": curve, "train_seconds": seconds,
                        "states": {name: _state(obj) for name, obj in objects.items()},
                        "torch_rng": torch.get_rng_state()}, f)
    return {"curve": curve, "epochs_done": done, "complete": done >= epochs, "train_seconds": seconds,
            "seconds_per_epoch": seconds / done if done else None}
