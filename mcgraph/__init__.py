"""mcgraph: Monte Carlo expectations for Bayesian neural networks whose autograd
graph does not grow with the number of samples.

>>> import mcgraph as mg   # mg.expectation, mg.kl_divergence, mg.explain, mg.graph_size
"""

from . import distributions, metrics, models, plan_cache
from .api import expectation, explain, kl_divergence, set_validate_args
from .diagnostics import GraphSize, graph_size
from .families import FAMILIES, GenericForm, SamplingForm, family_of, register_family
from .integrands import register_integrand, trace
from .stderr import MCEstimate, required_samples
from .tuples import Plan, TermPlan, Tier, classify

from . import nn  # noqa: E402  (the layers build on the functional API above)
from . import optim  # noqa: E402  (the optimizers build on mcgraph.nn)

__version__ = "0.1.0"

__all__ = [
    "FAMILIES", "GenericForm", "GraphSize", "MCEstimate", "Plan", "SamplingForm", "TermPlan", "Tier",
    "classify", "distributions", "expectation", "explain", "family_of", "graph_size", "kl_divergence",
    "metrics", "models", "nn", "optim", "plan_cache", "register_family", "register_integrand",
    "required_samples", "set_validate_args", "trace",
]
