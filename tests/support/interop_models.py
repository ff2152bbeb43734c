"""Shared pieces of the mcgraph.interop tests: references, noise recording, statistics, peer imports."""

from __future__ import annotations

import importlib
import importlib.util
import math
import pathlib
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from mcgraph.engine.plan.families import family_of
from mcgraph.nn import bayesian_modules
from mcgraph.nn.context import NoiseKind, sample_run

#: z of a two-sided test at a false-alarm rate of 6.8e-6 (4.5 standard errors).
Z_4_5 = 4.5


def peer(module: str, pip: str):
    """Import a peer library or skip, naming what installs it."""
    return pytest.importorskip(module, reason=f"{pip} is not installed (`make interop` installs it)")


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


def mlp_loss(x: torch.Tensor, y: torch.Tensor, layers) -> torch.Tensor:
    """Cross-entropy of an MLP given its ``(weight, bias)`` pairs, ReLU between layers."""
    h = x
    for k, (w, b) in enumerate(layers):
        h = F.linear(h, w, b)
        if k < len(layers) - 1:
            h = F.relu(h)
    return F.cross_entropy(h, y)


class NoiseRecorder:
    """Clones named noise buffers of modules after every forward (the noise that forward used)."""

    def __init__(self, modules, attrs):
        self.draws = [[] for _ in modules]
        self.handles = [m.register_forward_hook(self._hook(k, attrs)) for k, m in enumerate(modules)]

    def _hook(self, k, attrs):
        def fn(module, inputs, output):
            self.draws[k].append({a: self._get(module, a).detach().clone() for a in attrs})
        return fn

    @staticmethod
    def _get(module, dotted):
        for part in dotted.split("."):
            module = getattr(module, part)
        return module

    def remove(self):
        for h in self.handles:
            h.remove()


def mcgraph_data_term_reference(model, x, y, num_samples: int, seed: int) -> torch.Tensor:
    """−(data term) of ``mg.nn.expected_data_term`` recomputed by plain autograd on the run's noise.

    For an MLP of mcgraph ``BayesLinear`` layers (Bayesian bias or none, σ = the layer's
    transform): each sample's weights in their own tensors, every sample in one graph.
    """
    layers = bayesian_modules(model)
    run = sample_run(model, num_samples, seed)
    with torch.no_grad():
        w_noise = [run.form_rows(l, NoiseKind.WEIGHT, family_of(l.posterior), 0, num_samples).clone()
                   for l in layers]
        b_noise = [run.form_rows(l, NoiseKind.BIAS, family_of(l.bias_posterior), 0, num_samples).clone()
                   if l.bias_mu is not None else None for l in layers]
    total = 0
    for i in range(num_samples):
        pairs = []
        for k, l in enumerate(layers):
            w = l.weight_mu + l.weight_sigma * w_noise[k][i]
            b = l.bias if l.bias_mu is None else l.bias_mu + l.bias_sigma * b_noise[k][i]
            pairs.append((w, b))
        total = total + mlp_loss(x, y, pairs)
    return total / num_samples


def assert_data_term_gradients_match(bnn, params, x, y, num_samples: int, seed: int, chunk_size: int) -> None:
    """``mg.nn.expected_data_term``'s gradients w.r.t. ``params`` equal the per-sample reference (rtol 1e-5)."""
    import mcgraph as mg

    for p in params:
        p.grad = None
    (-mg.nn.expected_data_term(bnn, x, y, num_samples=mg.Sampling(num_samples, chunk_size=chunk_size), seed=seed)).backward()
    got = [p.grad.clone() for p in params]
    ref = torch.autograd.grad(mcgraph_data_term_reference(bnn, x, y, num_samples, seed), params)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-12)


def assert_conversion_trains_the_original(model, bnn, x, y) -> None:
    """``bnn = to_mcgraph(model)`` holds every Parameter of ``model`` (the same objects), and one optimizer
    step on the converted ELBO moves each of them in the original model and its ``state_dict``."""
    import mcgraph as mg

    params = list(model.parameters())
    assert {id(p) for p in bnn.parameters()} == {id(p) for p in params}
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=0.1)
    opt.zero_grad()
    (-mg.nn.elbo(bnn, x, y, num_samples=3, dataset_size=100, seed=0)).backward()
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, params) if p.grad is not None)
    assert any(p.grad is not None for p in params)
    state = model.state_dict()
    for name, p in model.named_parameters():
        assert torch.equal(state[name], p.detach()), name


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaNs included (blitz registers ``eps_w`` as ``torch.Tensor(shape)``: uninitialised memory,
    which may hold NaN patterns, and NaN ≠ NaN under ``torch.equal``)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def assert_kl_leaves_the_model_alone(model, kl) -> None:
    """Evaluating and differentiating ``kl(model)`` changes no entry of the model's ``state_dict``."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kl(model).backward()
    after = model.state_dict()
    assert before.keys() == after.keys()
    changed = [k for k in before if not _same_bits(before[k], after[k])]
    assert not changed, f"kl changed {changed}"


def mean_and_standard_error(values) -> tuple[float, float]:
    v = torch.as_tensor(values, dtype=torch.float64)
    return float(v.mean()), float(v.std() / math.sqrt(v.numel()))


def load_torch_uncertainty():
    """torch-uncertainty's Bayesian layer and loss modules, imported from the installed wheel.

    ``import torch_uncertainty`` runs its package ``__init__``, which imports lightning and
    torchvision (the torchvision builds on the package index do not load beside the CPU torch
    build used here). Its ``layers/bayesian`` and ``losses/bayesian`` modules need only torch,
    so they are imported under bare parent packages that skip those ``__init__`` files. Returns
    ``(layers, losses, restore)``; ``restore()`` puts ``sys.modules`` back.
    """
    spec = importlib.util.find_spec("torch_uncertainty")
    if spec is None:
        pytest.skip("torch-uncertainty is not installed (`make interop` installs it)")
    root = pathlib.Path(spec.submodule_search_locations[0])
    saved = {k: v for k, v in sys.modules.items() if k == "torch_uncertainty" or k.startswith("torch_uncertainty.")}
    for name in list(saved):
        del sys.modules[name]
    for name, path in (("torch_uncertainty", root), ("torch_uncertainty.layers", root / "layers"),
                       ("torch_uncertainty.utils", root / "utils"), ("torch_uncertainty.losses", root / "losses")):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package
    layers = importlib.import_module("torch_uncertainty.layers.bayesian")
    losses = importlib.import_module("torch_uncertainty.losses.bayesian")

    def restore():
        for name in [k for k in sys.modules if k == "torch_uncertainty" or k.startswith("torch_uncertainty.")]:
            del sys.modules[name]
        sys.modules.update(saved)

    return layers, losses, restore
