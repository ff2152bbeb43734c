"""The training-step workload: one ELBO step of a Bayesian network (needs :mod:`mcgraph.nn`).

``loss = −(1/B) Σ_b log p(y_b | x_b, W) + KL(q ‖ p) / N`` with a 1-sample data
term (the same seeded weight sample for every method) and an M-sample KL over
every Bayesian layer; then ``loss.backward()``. Methods differ only in the KL:

* ``mcgraph`` / a tier: ``mg.nn.kl(model, M, method=...)``;
* ``vectorised``: ``mg.nn.kl(model, M, method="direct")``;
* ``direct``: per layer, ``−H(q) − mean_i log p(w_i)`` by the per-sample loop;
* ``grad-accum``: the data term and entropies backward once, then one backward per
  sample of ``−Σ_layers log p(w_{l,i}) / (M·N)``.

Layer ``l`` draws its KL noise from seed ``mix(kl_seed, l)`` as :func:`mcgraph.nn.kl`
does, so all methods but ``collapsed-exact`` agree.
"""

from __future__ import annotations

import torch

import mcgraph as mg
from mcgraph.engine.estimators import direct_loop_value
from mcgraph.engine.estimators.sampling import samples, stream_for
from mcgraph.models import get_model
from mcgraph.engine.noise.streams import mix_seed

from .workloads import ENGINE_METHODS, Case, NotApplicable, RunOut, _seeded_normal, _sum_rightmost

#: The architectures of the step workload (paper Fig. 2 right and §5.1).
STEP_MODELS = ("lenet5", "resnet18", "resnet50", "preact_resnet18", "densenet121", "vgg11", "vgg16")


def nn_available() -> str | None:
    """``None`` if :mod:`mcgraph.nn` is importable with what this workload uses, else why not."""
    try:
        import mcgraph.nn as mnn
    except Exception as e:  # noqa: BLE001 — any import failure means the workload cannot run
        return f"mcgraph.nn not available ({type(e).__name__}: {e})"
    missing = [n for n in ("bayesify", "kl", "bayesian_modules", "expected_data_term") if not hasattr(mnn, n)]
    return f"mcgraph.nn not available (missing {', '.join(missing)})" if missing else None


def smallest_input(model: str, channels: int, sizes=(16, 32, 64)) -> int:
    """The smallest of ``sizes`` the architecture accepts (VGG's five poolings need 32)."""
    with torch.random.fork_rng(devices=[]):
        net = get_model(model, num_classes=10, in_channels=channels).eval()
        for s in sizes:
            try:
                with torch.no_grad():
                    net(torch.zeros(1, channels, s, s))
                return s
            except RuntimeError:
                continue
    raise ValueError(f"model {model!r} accepts none of the input sizes {sizes}")


class StepCase(Case):
    """One training step of ``bayesify(get_model(model))`` on a seeded batch."""

    workload = "step"

    def __init__(self, model: str = "resnet18", batch: int = 32, input_size: int = 32, channels: int | None = None,
                 classes: int = 10, posterior: str = "radial", prior: str = "normal", dataset_size: int = 50_000,
                 device="cpu", dtype=torch.float32, init_seed: int = 0):
        why = nn_available()
        if why is not None:
            raise NotApplicable(why)
        import mcgraph.nn as mnn

        self.model = model
        self.batch, self.input_size, self.classes = int(batch), int(input_size), int(classes)
        self.channels = int(channels if channels is not None else (1 if model == "lenet5" else 3))
        self.posterior_name, self.prior_name = posterior, prior
        self.dataset_size = int(dataset_size)
        self.device = torch.device(device)
        self.dtype = dtype
        self.init_seed = init_seed
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed)
            net = get_model(model, num_classes=self.classes, in_channels=self.channels)
            self.net = mnn.bayesify(net, posterior=posterior, prior=prior, kl_samples=1, inplace=True)
        self.net.to(self.device, dtype).train()
        self.layers = mnn.bayesian_modules(self.net)
        if any(layer.bias_mu is not None for layer in self.layers):
            raise NotApplicable("Bayesian biases are not part of the step workload")
        self.params = [p for p in self.net.parameters() if p.requires_grad]
        self.P = sum(layer.weight_mu.numel() for layer in self.layers)
        shape = (self.batch, self.channels, self.input_size, self.input_size)
        self.x = _seeded_normal(shape, init_seed + 2).to(self.device, dtype)
        g = torch.Generator(device="cpu").manual_seed(init_seed + 3)
        self.y = torch.randint(0, self.classes, (self.batch,), generator=g).to(self.device)
        self.note = (f"BNN {model} ({posterior} q, {prior} prior), batch {self.batch}, input "
                     f"{self.channels}×{self.input_size}×{self.input_size}, 1-sample data term + M-sample KL")

    def spec(self) -> dict:
        return {"workload": "step", "model": self.model, "batch": self.batch, "input_size": self.input_size,
                "channels": self.channels, "classes": self.classes, "posterior": self.posterior_name,
                "prior": self.prior_name, "dataset_size": self.dataset_size, "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "init_seed": self.init_seed}

    def probe(self, method: str) -> None:
        """Only the KL decides whether a tier applies: classify it without the network's forward."""
        import mcgraph.nn as mnn

        if method in ENGINE_METHODS:
            with torch.no_grad():
                mnn.kl(self.net, 1, seed=0, method=ENGINE_METHODS[method])
        elif method not in ("direct", "vectorised", "grad-accum"):
            raise NotApplicable(f"unknown method {method!r}")

    def _data_loss(self, seed: int) -> torch.Tensor:
        import mcgraph.nn as mnn

        return -mnn.expected_data_term(self.net, self.x, self.y, num_samples=mg.Sampling(1, method="direct"), seed=seed)

    @staticmethod
    def _prior(layer):
        p = layer.prior
        p._validate_args = False
        return p

    def run(self, method: str, num_samples: int, seed: int, measure_bytes: bool = False) -> RunOut:
        import mcgraph.nn as mnn

        kl_seed = mix_seed(seed, 1 << 20)
        n = self.dataset_size
        if method == "grad-accum":
            return self._grad_accum(num_samples, seed, kl_seed, measure_bytes)
        data = self._data_loss(seed)
        if method in ENGINE_METHODS:
            kl = mnn.kl(self.net, num_samples, seed=kl_seed, method=ENGINE_METHODS[method])
        elif method == "vectorised":
            kl = mnn.kl(self.net, num_samples, seed=kl_seed, method="direct")
        elif method == "direct":
            kl = 0
            for i, layer in enumerate(self.layers):
                q = layer.posterior
                p = self._prior(layer)
                extra = len(q.event_shape) - len(p.event_shape)
                cross = direct_loop_value(mg.family_of(q), lambda w, p=p, e=extra: _sum_rightmost(p.log_prob(w), e),
                                          mix_seed(kl_seed, i), num_samples)
                kl = kl + (-q.entropy() - cross).sum()
        else:
            raise NotApplicable(f"unknown method {method!r}")
        loss = data + kl / n
        nbytes = mg.graph_size(loss).saved_bytes if measure_bytes else None
        loss.backward()
        return RunOut(loss.detach(), nbytes)

    def _grad_accum(self, num_samples: int, seed: int, kl_seed: int, measure_bytes: bool) -> RunOut:
        n = self.dataset_size
        first = self._data_loss(seed)
        for layer in self.layers:
            first = first - layer.posterior.entropy().sum() / n
        nbytes = mg.graph_size(first).saved_bytes if measure_bytes else None
        first.backward()
        total = first.detach()
        streams = [stream_for(mg.family_of(layer.posterior), mix_seed(kl_seed, i), num_samples)
                   for i, layer in enumerate(self.layers)]
        for s in range(num_samples):
            part = 0
            for layer, stream in zip(self.layers, streams):
                w = samples(mg.family_of(layer.posterior), stream.rows(s, s + 1).clone())[0]
                part = part - self._prior(layer).log_prob(w).sum()
            part = part / (num_samples * n)
            if measure_bytes and s == 0:
                nbytes = max(nbytes or 0, mg.graph_size(part).saved_bytes)
            part.backward()
            total = total + part.detach()
        return RunOut(total, nbytes)
