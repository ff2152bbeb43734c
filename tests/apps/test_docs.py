"""The runnable examples in the public docstrings stay runnable."""

import doctest
import importlib

import pytest

MODULES = ["mcgraph.engine.api", "mcgraph.engine.graph_size", "mcgraph.metrics", "mcgraph.distributions.radial",
           "mcgraph.distributions.scale_mixture", "mcgraph.distributions.log_uniform",
           "mcgraph.distributions.logistic", "mcgraph.distributions.rayleigh", "mcgraph.distributions.horseshoe",
           "mcgraph.models.zoo", "mcgraph.engine.noise.backends", "mcgraph.engine.estimators.softmax", "mcgraph.nn.layers",
           "mcgraph.nn.bayesify", "mcgraph.nn.network_kl", "mcgraph.nn.variational", "mcgraph.nn.prediction", "mcgraph.nn.likelihood",
           "mcgraph.nn.scales", "mcgraph.optim.per_example", "mcgraph.optim.gaussian", "mcgraph.optim.vogn",
           "mcgraph.optim.adaptive_vb", "mcgraph.optim.sghmc", "mcgraph.optim.schedules", "mcgraph.optim.snapshots",
           "mcgraph.optim.spike_slab", "mcgraph.optim.shrink", "mcgraph.engine.distributed", "mcgraph.apps.launch",
           "mcgraph.nn.sparse_vd", "mcgraph.nn.ard",
           "mcgraph.nn.layer_kl", "mcgraph.nn.masks", "mcgraph.nn.pruning", "mcgraph.nn.mc_dropout",
           "mcgraph.models.lenet", "mcgraph.models.lenet_sparse"]


# Modules whose examples use a peer library (`make interop` installs them): skipped without it.
NEEDS = {"mcgraph.interop": "blitz", "mcgraph.interop.sites": "bayesian_torch",
         "mcgraph.interop.divergence": "bayesian_torch", "mcgraph.interop.backward": "bayesian_torch",
         "mcgraph.interop.convert": "blitz", "mcgraph.interop.bayesian_torch": "bayesian_torch",
         "mcgraph.interop.blitz": "blitz", "mcgraph.interop.torchbnn": "torchbnn", "mcgraph.interop.pyro": "pyro",
         "mcgraph.interop.tyxe": "tyxe", "mcgraph.nn.lora": "transformers", "mcgraph.interop.peft": "peft"}
MODULES += ["mcgraph.interop.foreign_priors", "mcgraph.engine.stderr", "mcgraph.engine.noise.moments", "mcgraph.engine.estimators.derivatives",
            "mcgraph.engine.estimators.fused_body"]
MODULES += ["mcgraph.engine.noise.cpu_philox"]  # its example builds the library (about a second, once per machine)
MODULES += ["mcgraph.engine.plan.cache", "mcgraph.engine.estimators.cpu_fused", "mcgraph.kernels.log_densities"]
MODULES += ["mcgraph.engine.noise.streams", "mcgraph.optim.ivon"]
MODULES += ["mcgraph.nn.module_select"]
MODULES += ["mcgraph.engine.checks", "mcgraph.registry", "mcgraph.engine.methods", "mcgraph.engine.options",
            "mcgraph.nn.model_checks"]


@pytest.mark.parametrize("name", MODULES + sorted(NEEDS))
def test_docstring_examples(name):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name], reason=f"{name}'s examples need {NEEDS[name]} (`make interop`)")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
