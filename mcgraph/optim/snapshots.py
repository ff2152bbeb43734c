"""A snapshot ensemble: samples of a whole network's weights, run as one stochastic model.

``SnapshotEnsemble(model)`` keeps copies of ``model``'s parameters and buffers
(:meth:`~SnapshotEnsemble.add`) and behaves like a Bayesian network whose posterior is
the uniform mixture of those points (the SG-MCMC samples of
:class:`~mcgraph.optim.AdaptiveSGHMC`, collected near each cycle's end). Inside a sample
run of :func:`mcgraph.nn.predict` / :func:`~mcgraph.nn.forward_samples`, sample ``i``
uses snapshot ``i mod S``: with ``num_samples = S`` the prediction is the exact Bayesian
model average ``(1/S) Σ_s softmax(f(x; w_s))``. Outside a run, each forward uses one
snapshot drawn from torch's global generator.

Example:
    >>> import torch, mcgraph as mg
    >>> net = torch.nn.Linear(3, 2)
    >>> ens = mg.optim.SnapshotEnsemble(net)
    >>> ens.add(); _ = torch.nn.init.zeros_(net.weight); ens.add()
    >>> len(ens), mg.nn.predict(ens, torch.ones(4, 3), num_samples=len(ens)).shape
    (2, torch.Size([4, 2]))
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.func import functional_call

from ..nn.context import current_window

__all__ = ["SnapshotEnsemble"]


class SnapshotEnsemble(nn.Module):
    """The uniform mixture of weight snapshots of one network (see the module docstring).

    Args:
        model: the network whose snapshots are taken (a deep copy is kept as the template).
    """

    #: Sample ``i`` of a run is snapshot ``i mod S``: the samples differ (``mg.nn.predict`` accepts the ensemble).
    varies_per_sample = True

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.source = model
        self.template = copy.deepcopy(model)
        self.snapshots: list[dict[str, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self.snapshots)

    @torch.no_grad()
    def add(self, model: nn.Module | None = None) -> None:
        """Store a copy of the parameters and buffers of ``model`` (default: the model given at construction)."""
        model = self.source if model is None else model
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        expected = set(self.template.state_dict())
        if set(state) != expected:
            raise ValueError("model: its state_dict keys differ from the ensemble's network")
        self.snapshots.append(state)

    def get_extra_state(self):
        return {"snapshots": self.snapshots}

    def set_extra_state(self, state) -> None:
        self.snapshots = list(state["snapshots"])

    def state_dict(self, *args, **kwargs):
        out = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        return {k: v for k, v in out.items() if not k.startswith(prefix + "source.")}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return super().load_state_dict(state_dict, strict=False, assign=assign)

    def _run(self, index: int, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.template, self.snapshots[index], (x,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Outputs of snapshot ``i mod S`` for the row block of sample ``i`` of the active window."""
        if not self.snapshots:
            raise RuntimeError("SnapshotEnsemble has no snapshots: call add() first")
        win = current_window()
        if win is None:
            index = int(torch.randint(len(self.snapshots), ()))
            return self._run(index, x)
        if x.shape[0] % win.size:
            raise ValueError(f"x: inside a window of {win.size} samples the batch dimension must be a multiple of "
                             f"{win.size}, got shape {tuple(x.shape)}")
        rows = x.shape[0] // win.size
        outs = [self._run((win.start + s) % len(self.snapshots), x[s * rows:(s + 1) * rows])
                for s in range(win.size)]
        return torch.cat(outs)
