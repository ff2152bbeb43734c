"""The Bayesian networks of Figs. 1, 2 (right) and 6: ``bayesify(get_model(name))`` and its loss pieces.

The loss of one training step is the bench's ``step`` workload
(:mod:`bench.harness.step`): a 1-sample data term plus an M-sample KL over every
Bayesian layer, divided by the dataset size N. The KL is computed

* ``direct``: per layer ``−H(q) − (1/M) Σ_i log p(w_i)`` by the paper's per-sample loop
  (Fig. 4a; ``mcgraph.engine.estimators.direct_loop_value``), the graph holding all M samples;
* ``mcgraph``: ``mg.nn.kl(model, M)`` (collapsed/fused/chunked; graph independent of M).

Layer ``l`` draws its KL noise from ``mix_seed(kl_seed, l)`` in both, as ``mg.nn.kl`` does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

import mcgraph as mg
from mcgraph.models import get_model
from mcgraph.engine.noise.streams import mix_seed

#: The architectures of the paper's Fig. 2 (right), 1 and 6, in the paper's order.
ARCHITECTURES = ("densenet121", "densenet161", "densenet169", "densenet201", "resnet18", "resnet34", "resnet50",
                 "resnet101", "resnet152", "vgg11", "vgg13", "vgg16", "vgg19")
LABELS = {"densenet121": "DenseNet-121", "densenet161": "DenseNet-161", "densenet169": "DenseNet-169",
          "densenet201": "DenseNet-201", "resnet18": "ResNet-18", "resnet34": "ResNet-34", "resnet50": "ResNet-50",
          "resnet101": "ResNet-101", "resnet152": "ResNet-152", "vgg11": "VGG-11", "vgg13": "VGG-13",
          "vgg16": "VGG-16", "vgg19": "VGG-19", "lenet5": "LeNet-5"}
DATASET_SIZE = 50_000  #: N of CIFAR-10's training set (scales the KL; irrelevant to memory)


class MissingAPI(RuntimeError):
    """An API this target needs (``mcgraph.nn`` …) is not available; the message says which."""


def nn_module():
    """``mcgraph.nn`` with what these targets use, or :class:`MissingAPI`."""
    try:
        import mcgraph.nn as mnn
    except Exception as e:  # noqa: BLE001 — any import failure means the API is missing
        raise MissingAPI(f"mcgraph.nn is not importable ({type(e).__name__}: {e})") from e
    missing = [n for n in ("bayesify", "kl", "bayesian_modules", "expected_data_term") if not hasattr(mnn, n)]
    if missing:
        raise MissingAPI(f"mcgraph.nn lacks {', '.join(missing)}")
    return mnn


class BNN(NamedTuple):
    name: str
    net: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor
    params: int  #: parameters of the deterministic network (the paper's x-axis)
    weights: int  #: weights under a posterior (the KL is over these)
    trainable: int  #: trainable tensors' elements of the Bayesian network (μ, ρ, biases, BatchNorm)


def smallest_input(name: str, sizes=(16, 32, 64)) -> int:
    """The smallest of ``sizes`` the architecture accepts (VGG's five poolings need 32)."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        net = get_model(name, num_classes=10, in_channels=1 if name == "lenet5" else 3).eval()
        for s in sizes:
            try:
                net(torch.zeros(1, 1 if name == "lenet5" else 3, s, s))
                return s
            except RuntimeError:
                continue
    raise ValueError(f"model {name!r} accepts none of the input sizes {sizes}")


def build(name: str, batch: int, input_size: int, seed: int, posterior="radial", prior="normal") -> BNN:
    """``bayesify(get_model(name))`` (training mode) and a seeded batch of standard-normal images."""
    mnn = nn_module()
    channels = 1 if name == "lenet5" else 3
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        det = get_model(name, num_classes=10, in_channels=channels)
        params = sum(p.numel() for p in det.parameters())
        net = mnn.bayesify(det, posterior=posterior, prior=prior, kl_samples=1, inplace=True).train()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, channels, input_size, input_size, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    weights = sum(m.weight_mu.numel() for m in mnn.bayesian_modules(net))
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    return BNN(name, net, x, y, params, weights, trainable)


def data_loss(b: BNN, seed: int) -> torch.Tensor:
    """−(1/B) Σ_b log p(y_b | x_b, W) with one weight sample (the same for every KL method)."""
    mnn = nn_module()
    return -mnn.expected_data_term(b.net, b.x, b.y, num_samples=mg.Sampling(1, method="direct"), seed=seed)


def kl(b: BNN, method: str, num_samples: int, kl_seed: int) -> torch.Tensor:
    """The network's KL with ``method`` ∈ {``direct``, ``mcgraph``} (see the module docstring)."""
    mnn = nn_module()
    if method == "mcgraph":
        return mnn.kl(b.net, num_samples, seed=kl_seed)
    if method != "direct":
        raise ValueError(f"method must be 'direct' or 'mcgraph', got {method!r}")
    from mcgraph.engine.estimators import direct_loop_value

    total = 0
    for i, layer in enumerate(mnn.bayesian_modules(b.net)):
        q = layer.posterior
        p = layer.prior
        p._validate_args = False
        extra = len(q.event_shape) - len(p.event_shape)

        def log_p(w, p=p, extra=extra):
            v = p.log_prob(w)
            return v.sum(tuple(range(-extra, 0))) if extra > 0 else v

        cross = direct_loop_value(mg.family_of(q), log_p, mix_seed(kl_seed, i), num_samples)
        total = total + (-q.entropy() - cross).sum()
    return total


def step_loss(b: BNN, method: str, num_samples: int, seed: int, data: torch.Tensor | None = None) -> torch.Tensor:
    """``data + KL / N`` of one step (``data`` reused when given)."""
    data = data_loss(b, seed) if data is None else data
    return data + kl(b, method, num_samples, mix_seed(seed, 1 << 20)) / DATASET_SIZE
