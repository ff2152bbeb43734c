"""TyXe (``pip install --no-deps tyxe`` beside ``pyro-ppl``; tested with 0.0.2): training with mcgraph's KL.

TyXe builds a Pyro model and guide around a PyTorch network. ``VariationalBNN.fit`` makes
its own ``TraceMeanField_ELBO`` and takes no loss argument, so :func:`fit` is the same loop
(train mode on, one ``SVI.step`` per batch, the callback after every epoch with the mean
ELBO, returning the ``SVI``) with :class:`mcgraph.interop.pyro.MeanFieldELBO`: closed-form KL
where torch has one, mcgraph's M-sample estimate otherwise (a scale-mixture or Student-t prior).

TyXe 0.0.2's own ``tyxe.guides.AutoNormal`` calls ``pyro.util.deep_getattr``, which Pyro 1.9
removed: with Pyro ≥ 1.9 build the guide with Pyro's ``AutoNormal`` (as below), whose sites
:class:`~mcgraph.interop.pyro.MeanFieldELBO` reads exactly; with Pyro ≤ 1.8.6 both work.

Example:
    >>> import torch, pyro, tyxe
    >>> from mcgraph.interop.tyxe import fit
    >>> pyro.clear_param_store()
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> prior = tyxe.priors.IIDPrior(pyro.distributions.StudentT(3.0, 0.0, 1.0))
    >>> bnn = tyxe.VariationalBNN(net, prior, tyxe.likelihoods.Categorical(dataset_size=8),
    ...                           pyro.infer.autoguide.AutoNormal)
    >>> data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
    >>> svi = fit(bnn, data, pyro.optim.Adam({"lr": 1e-2}), num_epochs=2, kl_samples=64)
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from .sites import require

__all__ = ["fit"]


def _tuple(x):
    return x if isinstance(x, (list, tuple)) else (x,)


def _to(x, device):
    return tuple(t.to(device) if device is not None else t for t in _tuple(x))


def _elbo(num_particles: int, kl_samples: int, kl_method: str, seed: int | None):
    require("tyxe", "tyxe", no_deps=True)
    from .pyro import MeanFieldELBO

    return MeanFieldELBO(num_particles, kl_samples=kl_samples, kl_method=kl_method, seed=seed)


def fit(bnn: nn.Module, data_loader, optim, num_epochs: int, *, kl_samples: int, num_particles: int = 1,
        kl_method: str = "auto", seed: int | None = None, callback: Callable | None = None, device=None):
    """``VariationalBNN.fit`` with :class:`~mcgraph.interop.pyro.MeanFieldELBO` as the loss.

    Args:
        bnn: a ``tyxe.VariationalBNN``.
        data_loader: iterable of ``(inputs, targets)`` batches, as for TyXe.
        optim: a Pyro optimizer (``pyro.optim.Adam({"lr": 1e-3})``).
        num_epochs: passes over ``data_loader``.
        kl_samples: M of each Monte Carlo KL.
        num_particles, kl_method, seed: of :class:`~mcgraph.interop.pyro.MeanFieldELBO`.
        callback: ``callback(bnn, epoch, mean_elbo)``; returning ``True`` stops training.
        device: where the batches are moved.

    Returns:
        The ``pyro.infer.SVI`` object.
    """
    from pyro.infer import SVI

    loss = _elbo(num_particles, kl_samples, kl_method, seed)
    if num_epochs < 0:
        raise ValueError(f"num_epochs must be non-negative, got {num_epochs!r}")
    old_training = bnn.net.training
    bnn.net.train(True)
    svi = SVI(bnn.model, bnn.guide, optim, loss=loss)
    try:
        for epoch in range(num_epochs):
            elbo, num_batch = 0.0, 1
            for num_batch, (inputs, targets) in enumerate(iter(data_loader), 1):
                elbo += svi.step(_to(inputs, device), _to(targets, device)[0])
            if callback is not None and callback(bnn, epoch, elbo / num_batch):
                break
    finally:
        bnn.net.train(old_training)
    return svi
