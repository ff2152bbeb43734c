"""The one registry class: registration as a decorator or a call, most specific type by MRO, memoised
lookup cleared by every change, a warning on ties, an error naming the types on a miss."""

from __future__ import annotations

import warnings

import pytest
import torch.distributions as D

import mcgraph as mg
from mcgraph.registry import AmbiguousRegistration, Registry


class Base:
    pass


class Left(Base):
    pass


class Right(Base):
    pass


class Both(Left, Right):
    pass


def test_names_register_as_decorator_or_call_and_behave_as_a_dict():
    reg = Registry("thing")

    @reg.register("a")
    def a():
        return 1

    assert reg.register("b", 2) == 2
    assert reg.lookup("a") is a and reg["b"] == 2 and sorted(reg) == ["a", "b"] and "a" in reg
    with pytest.raises(KeyError, match="no thing is registered for 'c'; registered: 'a', 'b'"):
        reg.lookup("c")
    assert reg.lookup("c", None) is None


def test_unique_refuses_a_second_registration():
    reg = Registry("model", unique=True)
    reg.register("m", 1)
    with pytest.raises(ValueError, match="model 'm' is already registered"):
        reg.register("m", 2)


def test_the_most_specific_class_wins_and_the_memo_follows_changes():
    reg = Registry("rule", by_type=True)
    reg.register(Base, "base")
    assert reg.lookup(Both) == "base"
    reg.register(Left, "left")           # a new, more specific registration replaces the memoised answer
    assert reg.lookup(Both) == "left" and reg.lookup(Right) == "base"
    del reg[Left]
    assert reg.lookup(Both) == "base"
    assert Both in reg and int not in reg
    with pytest.raises(KeyError, match=r"no rule is registered for int; registered: Base"):
        reg.lookup(int)
    with pytest.raises(TypeError, match="keys must be classes"):
        reg.register("Base", 1)


def test_a_tie_warns_once_and_the_first_registration_is_used():
    reg = Registry("rule", by_type=True)
    reg.register((Left, Base), "left-base")
    reg.register((Base, Left), "base-left")
    with pytest.warns(AmbiguousRegistration, match=r"equally specific for \(Left, Left\).*\(Base, Left\)"):
        assert reg.lookup((Left, Left)) == "left-base"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reg.lookup((Left, Left)) == "left-base"  # memoised: no second warning
    reg.register((Left, Left), "exact")  # registering the pair itself decides
    assert reg.lookup((Left, Left)) == "exact"


def test_pairs_of_types_rank_by_the_sum_of_mro_distances():
    reg = Registry("pair rule", by_type=True)
    reg.register((D.Normal, D.Distribution), "normal-any")
    reg.register((D.Distribution, D.Laplace), "any-laplace")
    reg.register((D.Normal, D.Laplace), "normal-laplace")
    assert reg.lookup((D.Normal, D.Laplace)) == "normal-laplace"
    assert reg.lookup((D.Normal, D.Cauchy)) == "normal-any"
    assert reg.lookup((D.Cauchy, D.Laplace)) == "any-laplace"


@pytest.mark.parametrize("registry", [
    "mcgraph.engine.plan.families.FAMILIES", "mcgraph.engine.plan.ops.OPS", "mcgraph.engine.estimators.derivatives.DERIVATIVES",
    "mcgraph.nn.priors.PRIORS", "mcgraph.nn.priors.POSTERIORS", "mcgraph.nn.layer_kl.LAYER_KL",
    "mcgraph.nn.scales.SCALE_TRANSFORMS", "mcgraph.models.zoo.MODELS", "mcgraph.interop.sites.ADAPTERS",
    "mcgraph.apps.data.DATASETS", "bench.harness.workloads.KL_PAIRS", "mcgraph.optim.per_example.RULES",
    "mcgraph.optim.spike_slab.GROUP_RULES", "mcgraph.nn.likelihood.LIKELIHOODS",
])
def test_every_registry_of_the_package_is_one(registry):
    import importlib

    module, _, name = registry.rpartition(".")
    assert isinstance(getattr(importlib.import_module(module), name), Registry)


def test_family_lookup_still_follows_the_mro():
    class MyNormal(D.Normal):
        pass

    assert mg.family_of(MyNormal(0.0, 1.0)).name in ("Normal", "MyNormal")
    assert mg.FAMILIES.lookup(MyNormal) is mg.FAMILIES.lookup(D.Normal)


def test_the_training_cli_looks_optimizers_up_by_name():
    from mcgraph.apps.optim_train import OPTIMIZER_BUILDERS, OPTIMIZERS

    assert isinstance(OPTIMIZER_BUILDERS, Registry) and set(OPTIMIZER_BUILDERS) == set(OPTIMIZERS)
