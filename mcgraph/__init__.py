"""mcgraph: Monte Carlo expectations for Bayesian neural networks whose autograd
graph does not grow with the number of samples.

>>> import mcgraph as mg   # mg.expectation, mg.kl_divergence, mg.explain, mg.graph_size
"""

from . import distributions, metrics, models
from .engine.plan import cache as plan_cache
from .engine.api import expectation, explain, kl_divergence, set_validate_args
from .engine.budget import chunk_budget, set_chunk_budget
from .engine.graph_size import GraphSize, graph_size
from .engine.plan.families import FAMILIES, GenericForm, SamplingForm, family_of, register_family
from .engine.plan.ops import register_integrand
from .engine.plan.tracer import trace
from .engine.stderr import MCEstimate, required_samples
from .engine.methods import Method
from .engine.options import Sampling
from .engine.plan.classify import Plan, TermPlan, Tier, classify

from . import nn  # noqa: E402  (the layers build on the functional API above)
from . import optim  # noqa: E402  (the optimizers build on mcgraph.nn)

__version__ = "0.1.0"


def __getattr__(name: str):
    # ``mg.interop`` without ``import mcgraph.interop``: loaded on first use, importing no peer library
    if name == "interop":
        import importlib

        return importlib.import_module(".interop", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "FAMILIES", "GenericForm", "GraphSize", "MCEstimate", "Method", "Sampling", "Plan", "SamplingForm", "TermPlan", "Tier",
    "chunk_budget", "classify", "distributions", "expectation", "explain", "family_of", "graph_size", "kl_divergence",
    "interop", "metrics", "models", "nn", "optim", "plan_cache", "register_family", "register_integrand",
    "required_samples", "set_chunk_budget", "set_validate_args", "trace",
]
