"""The cyclical cosine learning rate of cyclical SG-MCMC (Zhang et al., 2020), as the Ke & Fan code uses it.

With ``L = ⌊total_steps / cycles⌋`` steps per cycle and step ``k`` (0-based),

.. math::
    \\text{lr}_k = \\tfrac12\\big(\\cos(\\pi\\,(k \\bmod L)/L) + 1\\big)\\,\\text{lr}_0 ,

so every cycle starts at the largest rate (no small-rate warm-up: seed 004, §2.2 argues
a variational BNN's gradient drowns in the injected noise at tiny rates) and ends near 0,
where samples are collected (:meth:`CyclicalCosineLR.is_snapshot_step`).

Example:
    >>> import torch
    >>> from mcgraph.optim import CyclicalCosineLR
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> sched = CyclicalCosineLR(opt, total_steps=8, cycles=2)
    >>> rates = []
    >>> for _ in range(8):
    ...     rates.append(round(opt.param_groups[0]["lr"], 3))
    ...     opt.step(); sched.step()
    >>> rates
    [1.0, 0.854, 0.5, 0.146, 1.0, 0.854, 0.5, 0.146]
"""

from __future__ import annotations

import math

import torch

from ._checks import positive_int, real_in

__all__ = ["CyclicalCosineLR"]


class CyclicalCosineLR(torch.optim.lr_scheduler.LRScheduler):
    """Cyclical cosine schedule: ``cycles`` cosine decays from each group's initial rate over ``total_steps``.

    Args:
        optimizer: the optimizer whose ``lr`` it sets (call :meth:`step` after every optimizer step).
        total_steps: the length of training in steps.
        cycles: M ≥ 1 cycles (``total_steps ≥ cycles``).
        snapshots_per_cycle: how many samples :meth:`is_snapshot_step` marks per cycle.
        snapshot_fraction: the samples are spread over this last fraction of each cycle.
    """

    def __init__(self, optimizer, total_steps: int, cycles: int = 1, snapshots_per_cycle: int = 1,
                 snapshot_fraction: float = 0.1, last_epoch: int = -1) -> None:
        self.total_steps = positive_int("total_steps", total_steps)
        self.cycles = positive_int("cycles", cycles)
        if self.cycles > self.total_steps:
            raise ValueError(f"cycles must be <= total_steps, got cycles={cycles}, total_steps={total_steps}")
        self.cycle_length = self.total_steps // self.cycles
        self.snapshots_per_cycle = positive_int("snapshots_per_cycle", snapshots_per_cycle)
        self.snapshot_fraction = real_in("snapshot_fraction", snapshot_fraction, 0.0, 1.0, low_open=True)
        super().__init__(optimizer, last_epoch)

    def factor(self, k: int) -> float:
        """The multiplier of the initial rate at step ``k`` (0-based)."""
        r = (k % self.cycle_length) / self.cycle_length
        return 0.5 * (math.cos(math.pi * r) + 1.0)

    def get_lr(self) -> list[float]:
        return [base * self.factor(self.last_epoch) for base in self.base_lrs]

    def snapshot_positions(self) -> list[int]:
        """Positions in a cycle (0-based) after whose step a sample is taken: the cycle's last step and
        ``snapshots_per_cycle − 1`` earlier ones spread evenly over its last ``snapshot_fraction``."""
        length = self.cycle_length
        span = max(1, int(round(self.snapshot_fraction * length)))
        count = min(self.snapshots_per_cycle, length)
        gap = max(1, span // max(1, count - 1))
        return sorted({max(0, length - 1 - i * gap) for i in range(count)})

    def is_snapshot_step(self, k: int) -> bool:
        """Whether the weights after step ``k`` (0-based, counted over the whole run) are a sample."""
        if k >= self.cycle_length * self.cycles:
            return False
        return (k % self.cycle_length) in self.snapshot_positions()
