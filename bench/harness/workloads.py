"""Benchmark workloads: what is computed at one size for a given method, M and seed.

A :class:`Case` owns its parameters (seeded, so a subprocess rebuilds the same
ones from :meth:`Case.spec`) and runs forward + backward for any method:

========================  ====================================================
``direct``                the paper's per-sample loop (Fig. 4a): one graph holding every sample
``vectorised``            all M samples as one tensor (``method="direct"``; what most peers do)
``grad-accum``            one backward per sample, gradients accumulated (Fig. 5)
``mcgraph``               ``method="monte-carlo"`` (the sampled KL; ``"auto"`` would take a closed form)
``collapsed`` …           a tier forced: ``collapsed``, ``collapsed-exact``, ``fused``, ``chunked``
========================  ====================================================

Every method draws sample ``i`` from the engine's noise stream
(:func:`mcgraph.engine.estimators.sampling.stream_for`) at the same seed, so all but
``collapsed-exact`` return the same value and gradients.

Workloads: ``kl`` (:class:`KLCase`, one per registered :class:`KLPair`),
``lastlayer`` (:class:`LastLayerCase`) and ``step`` (:mod:`bench.harness.step`,
needs :mod:`mcgraph.nn`).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.distributions import Distribution, Gamma, Laplace, LogNormal, Normal

import mcgraph as mg
from mcgraph.distributions import Radial, ScaleMixtureNormal
from mcgraph.engine.estimators import direct_loop_value
from mcgraph.engine.estimators.sampling import samples, stream_for
from mcgraph.engine.noise.streams import rows_per_block
from mcgraph.registry import Registry

#: Baselines, in the order tables list them.
BASELINES = ("direct", "vectorised", "grad-accum")
#: mcgraph's methods: ``mcgraph`` is ``method="monte-carlo"`` (sampled), the others force a tier.
ENGINE_METHODS = {"mcgraph": "monte-carlo", "collapsed": "collapsed", "collapsed-exact": "collapsed-exact",
                  "fused": "fused", "chunked": "chunked"}
ALL_METHODS = BASELINES + tuple(ENGINE_METHODS)
#: Methods whose numbers differ from the others at the same seed (same law only).
SAME_LAW_ONLY = frozenset({"collapsed-exact"})
#: Preference for the reference of the agreement check: the cheapest exact method first.
REFERENCE_ORDER = ("collapsed", "fused", "chunked", "mcgraph", "vectorised", "direct", "grad-accum")


class RunOut(NamedTuple):
    """One forward + backward: the (detached) loss and, when asked, the bytes its graph saved."""

    value: torch.Tensor
    saved_bytes: int | None


class NotApplicable(Exception):
    """The method cannot compute this workload (the message says why)."""


class Case(abc.ABC):
    """One workload at one size.

    Attributes:
        workload: ``"kl"``, ``"lastlayer"``, ``"step"``.
        model: the KL pair or the architecture.
        P: number of weights the Monte Carlo expectation is over.
        device: where the parameters live.
        params: the leaf tensors whose gradients the agreement check compares.
        note: a line for the summary (sizes, reductions).
    """

    workload: str
    model: str
    P: int
    device: torch.device
    params: list
    note: str = ""
    methods: tuple = ALL_METHODS

    @abc.abstractmethod
    def run(self, method: str, num_samples: int, seed: int, measure_bytes: bool = False) -> RunOut:
        """Forward + backward with ``method``; gradients are left in ``p.grad`` for ``p`` in :attr:`params`."""

    @abc.abstractmethod
    def spec(self) -> dict:
        """JSON-able arguments from which :func:`build_case` rebuilds this case (same parameters)."""

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def probe(self, method: str) -> None:
        """Raise :class:`NotApplicable` or ``ValueError`` if ``method`` cannot run (default: run it at M = 1)."""
        self.run(method, 1, 0)

    def applicable(self, method: str) -> str | None:
        """``None`` if ``method`` applies, else why not (probed once at M = 1, cached)."""
        cache = self.__dict__.setdefault("_applicable", {})
        if method not in cache:
            if method not in self.methods:
                cache[method] = f"{method} is not a method of the {self.workload} workload"
            else:
                try:
                    self.probe(method)
                    cache[method] = None
                except NotApplicable as e:
                    cache[method] = str(e)
                except ValueError as e:  # the engine's own reason: a forced tier that does not apply names the term
                    cache[method] = " ".join(str(e).split())[:200]
                finally:
                    self.zero_grad()
        return cache[method]


def _sum_rightmost(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.sum(tuple(range(-n, 0))) if n > 0 else x


def _seeded_normal(shape, seed: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * std + mean


# --------------------------------------------------------------------------- KL pairs


@dataclass(frozen=True)
class KLPair:
    """A (posterior, prior) pair of the KL workload.

    Attributes:
        name: registry key (``"normal-normal"``).
        label: for tables (``"Normal q, Normal prior"``).
        make_q: ``(loc, scale) -> q`` for loc, scale of shape ``(P,)``.
        make_p: ``(device, dtype) -> p`` (built with ``validate_args=False``).
        loc_mean, loc_std: initial posterior locations ~ N(loc_mean, loc_std²).
        scale_init: initial posterior scale (σ = softplus(ρ)).
    """

    name: str
    label: str
    make_q: Callable[[torch.Tensor, torch.Tensor], Distribution]
    make_p: Callable[[torch.device, torch.dtype], Distribution]
    loc_mean: float = 0.0
    loc_std: float = 0.1
    scale_init: float = 0.05


KL_PAIRS: Registry = Registry("KL pair", unique=True)


def register_kl_pair(pair: KLPair) -> KLPair:
    """Add a pair to :data:`KL_PAIRS` (one call per pair; the CLI lists them all)."""
    return KL_PAIRS.register(pair.name, pair)


def _t(v, device, dtype):
    return torch.tensor(v, device=device, dtype=dtype)


register_kl_pair(KLPair(
    "normal-normal", "Normal q, Normal(0, 1) prior",
    lambda m, s: Normal(m, s, validate_args=False),
    lambda d, t: Normal(_t(0.0, d, t), _t(1.0, d, t), validate_args=False)))
register_kl_pair(KLPair(
    "radial-normal", "Radial q, Normal(0, 1) prior",
    lambda m, s: Radial(m, s, validate_args=False),
    lambda d, t: Normal(_t(0.0, d, t), _t(1.0, d, t), validate_args=False)))
register_kl_pair(KLPair(
    "normal-scalemix", "Normal q, scale-mixture prior (π = 0.5, σ₁ = 1, σ₂ = e⁻⁶)",
    lambda m, s: Normal(m, s, validate_args=False),
    lambda d, t: ScaleMixtureNormal(_t(0.5, d, t), _t(1.0, d, t), _t(math.exp(-6.0), d, t), validate_args=False)))
register_kl_pair(KLPair(
    "normal-laplace", "Normal q, Laplace(0, 1) prior",
    lambda m, s: Normal(m, s, validate_args=False),
    lambda d, t: Laplace(_t(0.0, d, t), _t(1.0, d, t), validate_args=False)))
register_kl_pair(KLPair(
    "lognormal-gamma", "LogNormal q, Gamma(2, 2) prior",
    lambda m, s: LogNormal(m, s, validate_args=False),
    lambda d, t: Gamma(_t(2.0, d, t), _t(2.0, d, t), validate_args=False), loc_mean=-0.5))
register_kl_pair(KLPair(
    "laplace-laplace", "Laplace q, Laplace(0, 1) prior",
    lambda m, s: Laplace(m, s, validate_args=False),
    lambda d, t: Laplace(_t(0.0, d, t), _t(1.0, d, t), validate_args=False)))

#: The pairs of the README's main command (the engine issue's comparison).
README_PAIRS = ("normal-normal", "radial-normal", "normal-scalemix")


class KLCase(Case):
    """``KL(q ‖ p)`` summed over P weights, q = pair.make_q(μ, softplus(ρ)); gradients w.r.t. (μ, ρ)."""

    workload = "kl"

    def __init__(self, pair: str | KLPair, P: int, device="cpu", dtype=torch.float32, init_seed: int = 0):
        self.pair = KL_PAIRS[pair] if isinstance(pair, str) else pair
        self.model = self.pair.name
        self.P = int(P)
        self.device = torch.device(device)
        self.dtype = dtype
        self.init_seed = init_seed
        loc = _seeded_normal((self.P,), init_seed, self.pair.loc_std, self.pair.loc_mean)
        scale = self.pair.scale_init * torch.exp(0.1 * _seeded_normal((self.P,), init_seed + 1))
        rho = torch.log(torch.expm1(scale))
        self.loc = loc.to(self.device, dtype).requires_grad_()
        self.rho = rho.to(self.device, dtype).requires_grad_()
        self.params = [self.loc, self.rho]
        self.prior = self.pair.make_p(self.device, dtype)
        self.note = self.pair.label

    def spec(self) -> dict:
        return {"workload": "kl", "model": self.model, "P": self.P, "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "init_seed": self.init_seed}

    def posterior(self) -> Distribution:
        return self.pair.make_q(self.loc, F.softplus(self.rho))

    def _log_p(self, q: Distribution) -> Callable:
        extra = len(q.event_shape) - len(self.prior.event_shape)
        p = self.prior
        return lambda w: _sum_rightmost(p.log_prob(w), extra)

    def run(self, method: str, num_samples: int, seed: int, measure_bytes: bool = False) -> RunOut:
        if method == "grad-accum":
            return self._grad_accum(num_samples, seed, measure_bytes)
        q = self.posterior()
        if method in ENGINE_METHODS:
            loss = mg.kl_divergence(q, self.prior, num_samples, seed=seed, method=ENGINE_METHODS[method]).sum()
        elif method == "vectorised":
            loss = mg.kl_divergence(q, self.prior, num_samples, seed=seed, method="direct").sum()
        elif method == "direct":
            loss = self._direct_loop(q, num_samples, seed)
        else:
            raise NotApplicable(f"unknown method {method!r}")
        nbytes = mg.graph_size(loss).saved_bytes if measure_bytes else None
        loss.backward()
        return RunOut(loss.detach(), nbytes)

    def _neg_entropy(self, q):
        try:
            return -q.entropy()
        except NotImplementedError:
            return None

    def _direct_loop(self, q, num_samples: int, seed: int) -> torch.Tensor:
        """KL = −H(q) − mean_i log p(w_i), the mean by the paper's per-sample loop."""
        form = mg.family_of(q)
        cross = direct_loop_value(form, self._log_p(q), seed, num_samples)
        neg_ent = self._neg_entropy(q)
        if neg_ent is None:
            neg_ent = direct_loop_value(form, q.log_prob, seed, num_samples)
        return (neg_ent - cross).sum()

    def _grad_accum(self, num_samples: int, seed: int, measure_bytes: bool) -> RunOut:
        """One backward per sample: Σ_i ∇[(log q(w_i)|−H(q)/M) − log p(w_i)]/M, the same noise as the others."""
        q = self.posterior()
        form = mg.family_of(q)
        stream = stream_for(form, seed, num_samples)
        nbytes = None
        total = torch.zeros((), dtype=self.dtype, device=self.device)
        neg_ent = self._neg_entropy(q)
        if neg_ent is not None:
            part = neg_ent.sum()
            part.backward()
            total += part.detach()
        for i in range(num_samples):
            q = self.posterior()
            form = mg.family_of(q)
            w = samples(form, stream.rows(i, i + 1).clone())[0]  # own copy: the graph keeps one row, not the block
            term = -self._log_p(q)(w)
            if neg_ent is None:
                term = term + q.log_prob(w)
            part = term.sum() / num_samples
            if measure_bytes and i == 0:
                nbytes = mg.graph_size(part).saved_bytes
            part.backward()
            total += part.detach()
        return RunOut(total, nbytes)


# --------------------------------------------------------------------------- last layer


class LastLayerCase(Case):
    """Expected log-likelihood of a Bayesian last layer: B × K logits, M weight samples.

    ``loss = −E_{W~q}[Σ_b log softmax(h_b Wᵀ)_{y_b}]`` with q = Normal(μ, softplus(ρ))
    over W of shape (K, D), fixed features h (B, D) and labels y (B,). The
    integrand couples a whole row (softmax), so mcgraph runs it in the chunked tier.
    """

    workload = "lastlayer"

    def __init__(self, batch: int = 32, classes: int = 10, features: int = 512, device="cpu",
                 dtype=torch.float32, init_seed: int = 0):
        self.batch, self.classes, self.features = int(batch), int(classes), int(features)
        self.model = f"B{self.batch}xK{self.classes}xD{self.features}"
        self.P = self.classes * self.features
        self.device = torch.device(device)
        self.dtype = dtype
        self.init_seed = init_seed
        loc = _seeded_normal((self.classes, self.features), init_seed, 1 / math.sqrt(self.features))
        rho = torch.full((self.classes, self.features), math.log(math.expm1(0.05)), dtype=torch.float64)
        self.loc = loc.to(self.device, dtype).requires_grad_()
        self.rho = rho.to(self.device, dtype).requires_grad_()
        self.params = [self.loc, self.rho]
        self.h = _seeded_normal((self.batch, self.features), init_seed + 2).to(self.device, dtype)
        g = torch.Generator(device="cpu").manual_seed(init_seed + 3)
        self.y = torch.randint(0, self.classes, (self.batch,), generator=g).to(self.device)
        self.note = f"last layer: B = {self.batch} × K = {self.classes} logits, D = {self.features} features"

    def spec(self) -> dict:
        return {"workload": "lastlayer", "batch": self.batch, "classes": self.classes, "features": self.features,
                "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
                "init_seed": self.init_seed}

    def posterior(self) -> Distribution:
        return Normal(self.loc, F.softplus(self.rho), validate_args=False)

    def log_lik(self, w: torch.Tensor) -> torch.Tensor:
        logits = self.h @ w.transpose(-1, -2)
        return logits.log_softmax(-1).gather(-1, self.y[:, None]).sum()

    def run(self, method: str, num_samples: int, seed: int, measure_bytes: bool = False) -> RunOut:
        if method == "grad-accum":
            q = self.posterior()
            form = mg.family_of(q)
            stream = stream_for(form, seed, num_samples)
            total = torch.zeros((), dtype=self.dtype, device=self.device)
            nbytes = None
            for i in range(num_samples):
                form = mg.family_of(self.posterior())
                part = -self.log_lik(samples(form, stream.rows(i, i + 1).clone())[0]) / num_samples
                if measure_bytes and i == 0:
                    nbytes = mg.graph_size(part).saved_bytes
                part.backward()
                total += part.detach()
            return RunOut(total, nbytes)
        q = self.posterior()
        if method == "direct":
            loss = -direct_loop_value(mg.family_of(q), self.log_lik, seed, num_samples)
        elif method == "vectorised" or method in ENGINE_METHODS:
            m = "direct" if method == "vectorised" else ENGINE_METHODS[method]
            loss = -mg.expectation(self.log_lik, q, num_samples, seed=seed, method=m)
        else:
            raise NotApplicable(f"unknown method {method!r}")
        nbytes = mg.graph_size(loss).saved_bytes if measure_bytes else None
        loss.backward()
        return RunOut(loss.detach(), nbytes)


# --------------------------------------------------------------------------- sampling floor


def randn_floor(P: int, num_samples: int, device="cpu", dtype=torch.float32) -> None:
    """Draw M·P standard normals with plain ``torch.randn`` in the engine's block sizes (no reduction)."""
    block = rows_per_block(P, num_samples)
    for start in range(0, num_samples, block):
        torch.randn((min(block, num_samples - start), P), device=device, dtype=dtype)
