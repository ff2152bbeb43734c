"""The runnable examples in the public docstrings stay runnable."""

import doctest
import importlib

import pytest

MODULES = ["mcgraph.api", "mcgraph.diagnostics", "mcgraph.metrics", "mcgraph.distributions.radial",
           "mcgraph.distributions.scale_mixture", "mcgraph.distributions.log_uniform",
           "mcgraph.distributions.logistic", "mcgraph.distributions.rayleigh", "mcgraph.distributions.horseshoe",
           "mcgraph.models.registry", "mcgraph.backend", "mcgraph.kernels.reference", "mcgraph.nn.layers",
           "mcgraph.nn.convert", "mcgraph.nn.variational", "mcgraph.nn.prediction", "mcgraph.nn.likelihood",
           "mcgraph.nn.scales", "mcgraph.optim.per_example", "mcgraph.optim.gaussian", "mcgraph.optim.vogn",
           "mcgraph.optim.adaptive_vb", "mcgraph.optim.sghmc", "mcgraph.optim.schedules", "mcgraph.optim.snapshots",
           "mcgraph.optim.spike_slab", "mcgraph.optim.shrink"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
