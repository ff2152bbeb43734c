"""mcgraph from models written with other Bayesian-NN libraries.

One module per library, each turning the foreign model into *sites* (live Parameters and a
prior, :class:`VariationalSite`) that the engine takes from there:

================================  ==========================================================================
module                            what it gives
================================  ==========================================================================
``interop.bayesian_torch``        ``kl`` (``"per_tensor_mean"`` = ``get_kl_loss``), ``to_mcgraph`` (``dnn_to_bnn``)
``interop.blitz``                 ``kl`` (M-sample estimate of ``nn_kl_divergence``; ``prior_floor``), ``to_mcgraph``
``interop.torchbnn``              ``KLLoss`` (drop-in ``BKLLoss``), ``kl``, ``to_mcgraph`` (σ = exp(log σ))
``interop.torch_uncertainty``     ``kl`` (``"layer_mean"`` as ``KLDiv``), ``to_mcgraph``
``interop.pyro``                  ``MeanFieldELBO`` (a ``TraceMeanField_ELBO``), ``site_kl``, ``register_mc_kl``
``interop.tyxe``                  ``fit`` (``VariationalBNN.fit`` with ``MeanFieldELBO``), ``use_mcgraph_kl``
``interop.peft``                  ``to_mcgraph``: peft LoRA as variational LoRA (means: peft's Parameters)
================================  ==========================================================================

and, for any of the layer libraries, :func:`sites`, :func:`kl` and :func:`elbo_backward`
(one forward and backward per sample: correct gradients with any library, memory of one
sample). ``import mcgraph`` and ``import mcgraph.interop`` import none of these libraries; the
layer adapters recognise layers by class and attribute names and never import theirs;
``interop.pyro``, ``interop.tyxe`` and ``interop.peft`` import Pyro / TyXe / peft when used and raise
an ``ImportError`` naming the package to install when it is missing.

Example:
    >>> import torch, mcgraph.interop as interop
    >>> from blitz.modules import BayesianLinear
    >>> layer = BayesianLinear(4, 3, prior_pi=0.5, prior_sigma_1=1.0, prior_sigma_2=0.01)
    >>> kl = interop.kl(layer, num_samples=1000, seed=0)      # M-sample KL, graph independent of M
    >>> kl.backward()
    >>> layer.weight_sampler.rho.grad.shape                   # gradients land on blitz's trained tensors
    torch.Size([3, 4])
"""

from __future__ import annotations

import importlib
import importlib.util

from .backward import elbo_backward
from .divergence import KL_METHODS, kl, site_kl
from .sites import ADAPTERS, LibraryAdapter, VariationalSite, load_adapters, register_adapter, sites

__all__ = ["ADAPTERS", "KL_METHODS", "LibraryAdapter", "VariationalSite", "elbo_backward", "kl", "load_adapters",
           "register_adapter", "site_kl", "sites"]


def __getattr__(name: str):
    # A library's module loads on first access (none of them imports its library at module level).
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
