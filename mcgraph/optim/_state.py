"""What every optimizer of :mod:`mcgraph.optim` keeps beside torch's state: counters (their seeded noise is
:mod:`mcgraph.optim.seeded_noise`)."""

from __future__ import annotations

import torch

__all__ = ["CountedOptimizer"]


class CountedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` with ``counters`` saved in its ``state_dict``.

    Subclasses set ``self.counters`` (a dict of ints/bools, at least ``"skipped"``) after
    ``super().__init__``; :meth:`state_dict` / :meth:`load_state_dict` round-trip it.
    """

    counters: dict

    def state_dict(self) -> dict:
        """torch's optimizer state plus ``counters`` (steps, noise draws, skipped steps)."""
        state = super().state_dict()
        state["counters"] = dict(self.counters)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        counters = state_dict.pop("counters", None)
        super().load_state_dict(state_dict)
        if counters is not None:
            self.counters.update(counters)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because a gradient or the new state was not finite."""
        return int(self.counters["skipped"])
