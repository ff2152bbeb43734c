"""The machinery shared by optimizers whose posterior is a mean-field Gaussian over a plain network.

:class:`GaussianVariationalOptimizer` takes a deterministic ``nn.Module`` (not its
``parameters()``): the module's parameters hold the posterior mean μ between steps,
and each step

1. draws ``K`` seeded weight samples ``w^{(k)} = μ + σ ⊙ ε^{(k)}`` (:meth:`noise`),
2. runs the closure (forward, mean- or sum-reduced loss, backward) at each and records
   the gradient ``ĝ_k`` and, through :class:`~mcgraph.optim.per_example.SquaredGradients`,
   the per-example squared gradients ``ĥ_k = (1/n) Σ_i g_i²``,
3. averages them over ``k`` and passes them through :meth:`_reduce_statistics`,
4. computes the new state in temporaries, checks every new tensor is finite with one host
   synchronisation, and commits it, or else skips the step with a warning and leaves
   parameters and state exactly as they were.

The parameters are restored to μ after every closure call, also when the closure raises.

**Many processes.** :meth:`_reduce_statistics` is the one place where a quantity that
must be summed over data shards or Monte Carlo samples passes (seed 003, Algorithm 1
lines 14–16: the per-process averages ``ĝ``, ``ĥ`` and the loss). With ``process_group=None``
it returns its input; with a ``torch.distributed`` group it all-reduces them (one collective,
:meth:`mcgraph.engine.distributed.SampleShard.sum`, which also checks that every rank has the same
seed and K):

* ``parallel="data"``: each rank runs the closure on its own shard of the batch with all K
  samples; the statistics are averaged over the ranks (equal shards: the statistics of the
  whole batch).
* ``parallel="samples"``: every rank holds the same batch and evaluates its share of the K
  samples; the partial averages (already divided by K) are summed. Because sample ``k`` of
  attempt ``t`` draws its noise from ``mix(mix(mix(seed, t), k), j)`` for parameter ``j``
  (never from who draws it), the step equals the one-process step up to float rounding.

Supported layers are those with a per-example rule (:mod:`mcgraph.optim.per_example`):
``Linear``, ``Conv1d/2d/3d``, ``LSTM`` (weights and biases sampled) and ``BatchNorm1d/2d/3d``
(deterministic: never sampled, without prior unless ``batchnorm_prior=True``, as the
seed's ResNet configurations). Any other module that owns trainable parameters, including
the Bayesian layers of :mod:`mcgraph.nn`, is refused with a ``TypeError`` naming it.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import torch
from torch import nn
from torch.distributions import Normal

from ..engine.checks import all_finite
from ..engine.noise.streams import mix_seed, resolve_seed
from ._checks import choice, positive_int, positive_real
from ._state import CountedOptimizer
from .choices import LossReduction, Parallel
from .per_example import RULES, SquaredGradients, rule_for
from .seeded_noise import fill_normal

__all__ = ["GaussianVariationalOptimizer", "check_model", "posterior_model", "posterior_sites"]

LOSS_REDUCTIONS = tuple(r.value for r in LossReduction)


def check_model(model: nn.Module, who: str) -> list[tuple[str, nn.Module, dict]]:
    """``(module name, module, {param name: param})`` for every module owning trainable parameters.

    Raises:
        TypeError: ``model`` is not a module, or a module with trainable parameters has no
            per-example rule (the message names it and lists the supported layers).
        ValueError: the model has no trainable parameter.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module (the network itself, not model.parameters()), "
                        f"got {type(model).__name__}")
    from ..nn.layers import BayesLayer

    out, bad, seen = [], [], set()
    for name, module in model.named_modules():
        params = {k: p for k, p in module.named_parameters(recurse=False) if p is not None and p.requires_grad
                  and id(p) not in seen}
        if not params:
            continue
        if isinstance(module, BayesLayer):
            raise TypeError(f"model: {name or '<model>'} is an mcgraph.nn Bayesian layer ({type(module).__name__}); "
                            f"{who} trains a deterministic network whose weights become the posterior mean; train "
                            "Bayesian layers with mcgraph.nn.elbo instead")
        if rule_for(module) is None:
            bad.append(f"{name or '<model>'} ({type(module).__name__})")
            continue
        seen.update(id(p) for p in params.values())
        out.append((name, module, params))
    if bad:
        raise TypeError(f"model: {who} does not support " + ", ".join(bad) + "; supported layers with parameters: "
                        + ", ".join(sorted(t.__name__ for t in RULES)) + " (parameter-free modules are fine)")
    if not out:
        raise ValueError("model has no trainable parameters")
    return out


class GaussianVariationalOptimizer(CountedOptimizer):
    """Base class (not used directly): mean-field Gaussian ``q(w) = N(μ, diag(σ²))`` over a network.

    One parameter group per module that owns parameters, carrying ``module`` (its
    qualified name), ``sample`` (whether its parameters are sampled) and ``prior``
    (whether the prior applies). Subclasses define :meth:`_sigmas`, :meth:`_tentative`
    and the step itself.

    Args:
        model: the network (see the module docstring for the supported layers).
        dataset_size: N, the number of training examples (> 0).
        defaults: the hyperparameters of every group.
        num_samples: K ≥ 1 weight samples per step.
        seed: the noise seed (``None``: drawn from torch's global generator).
        loss_reduction: ``"mean"`` (default) or ``"sum"``: how the closure's loss reduces the batch.
        batchnorm_prior: apply the prior to BatchNorm parameters too.
        spike_slab: a :class:`~mcgraph.optim.spike_slab.SpikeSlabEM` whose per-element prior
            precision replaces ``prior_precision`` on the weights it covers, and whose pruning
            masks are applied to μ and to every sample.
        process_group: ``None`` (one process) or a ``torch.distributed`` group over which the
            statistics are all-reduced (see the module docstring).
        parallel: ``"data"`` (ranks hold different batch shards) or ``"samples"`` (ranks hold the
            same batch and split the K samples).
    """

    def __init__(self, model: nn.Module, dataset_size: int, defaults: dict, *, num_samples: int = 1,
                 seed: int | None = None, loss_reduction: str | LossReduction = "mean", batchnorm_prior: bool = False,
                 spike_slab=None, process_group=None, parallel: str | Parallel = "data") -> None:
        who = type(self).__name__
        modules = check_model(model, who)
        if isinstance(dataset_size, bool) or not isinstance(dataset_size, (int, float)) or not dataset_size > 0 \
                or not math.isfinite(dataset_size):
            raise ValueError(f"dataset_size must be > 0 (the number of training examples), got {dataset_size!r}")
        self.dataset_size = dataset_size
        self.num_samples = positive_int("num_samples", num_samples)
        self.loss_reduction = choice("loss_reduction", loss_reduction, LossReduction)
        self.seed = resolve_seed(seed)
        self.parallel = choice("parallel", parallel, Parallel)
        self._shard = None
        if process_group is not None:
            from ..engine.distributed import SampleShard, check_process_group

            self._shard = SampleShard(check_process_group(process_group))
            self._shard.seed, self._shard.num_samples = self.seed, self.num_samples
        self.model = model
        self.spike_slab = spike_slab
        groups = []
        for name, module, params in modules:
            is_bn = isinstance(module, nn.modules.batchnorm._BatchNorm)
            groups.append({"params": list(params.values()), "module": name, "sample": not is_bn,
                           "prior": (not is_bn) or bool(batchnorm_prior)})
        super().__init__(groups, defaults)
        self._modules = [m for _, m, _ in modules]
        self._names = {p: f"{g['module']}.{k}" if g["module"] else k
                       for g, (_, _, params) in zip(self.param_groups, modules) for k, p in params.items()}
        self.counters = {"step": 0, "draws": 0, "skipped": 0, "initialized": False}

    # ------------------------------------------------------------------ bookkeeping

    @property
    def num_mc_samples(self) -> int:
        """Deprecated: :attr:`num_samples`."""
        warnings.warn(f"{type(self).__name__}.num_mc_samples is deprecated; use .num_samples", DeprecationWarning,
                      stacklevel=2)
        return self.num_samples

    def _flat(self) -> list[tuple[nn.Parameter, dict]]:
        return [(p, g) for g in self.param_groups for p in g["params"]]

    def noise(self, draw: int, sample: int, out: list | None = None) -> list[torch.Tensor | None]:
        """ε of sample ``sample`` of noise draw ``draw`` for every parameter (``None`` where not sampled).

        Parameter ``j`` (in param-group order) uses the seed ``mix(mix(mix(seed, draw), sample), j)``,
        so the noise depends only on ``(seed, draw, sample, j)``. ``out``: per parameter, a tensor of its
        shape to draw into (the same numbers), or ``None``.
        """
        base = mix_seed(mix_seed(self.seed, draw), sample)
        eps: list = []
        jobs = []
        for j, (p, group) in enumerate(self._flat()):
            if not group["sample"]:
                eps.append(None)
                continue
            e = out[j] if out is not None and out[j] is not None else torch.empty(p.shape, dtype=p.dtype,
                                                                                   device=p.device)
            eps.append(e)
            jobs.append((mix_seed(base, j), e))
        fill_normal(jobs)  # (independent draws: several threads)
        return eps

    def _prior_precision(self, p: nn.Parameter, group: dict) -> torch.Tensor | float:
        """δ of ``p`` on the full-data scale: the spike-and-slab precision where it covers ``p``, else the group's."""
        if not group["prior"]:
            return 0.0
        if self.spike_slab is not None:
            precision = self.spike_slab.precision(p)
            if precision is not None:
                return precision
        return group["prior_precision"]

    def _mask(self, p: nn.Parameter) -> torch.Tensor | None:
        return None if self.spike_slab is None else self.spike_slab.mask(p)

    # ------------------------------------------------------------------ the sampled closure

    def _reduce_statistics(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Aggregate per-process statistics over data shards / MC-sample groups (no-op in one process).

        Every tensor that is an average over this process's examples and samples passes here
        once per step: ``ĝ`` and ``ĥ`` of every parameter, then the mean loss (a 0-d tensor).
        With a process group they are all-reduced (one collective; seed 003, Algorithm 1
        lines 14–16): averaged over the ranks for ``parallel="data"``, summed for
        ``parallel="samples"`` (each rank's share is already divided by K).
        """
        if self._shard is None:
            return tensors
        reduced = self._shard.sum(lambda: tensors, tensors)
        if self.parallel == "data":
            reduced = [t / self._shard.world for t in reduced]
        return reduced

    def _sample_indices(self, num_samples: int) -> range:
        """The samples ``k`` this process evaluates (all of them, unless ``parallel="samples"``)."""
        if self._shard is None or self.parallel == "data":
            return range(num_samples)
        return range(*self._shard.window(num_samples))

    def _collect(self, closure: Callable, sigmas: list | None, num_samples: int, draw: int, curvature: bool):
        """Run the closure at ``num_samples`` samples (μ itself when ``sigmas`` is None).

        Returns ``(loss, ĝ list, ĥ list or None)``, averaged over the samples and reduced.
        """
        if closure is None:
            raise ValueError(f"closure: {type(self).__name__}.step needs a closure that runs the forward pass, the "
                             "loss and backward() (and returns the loss)")
        flat = self._flat()
        params = [p for p, _ in flat]
        means = [p.detach().clone() for p in params]
        g_acc = [torch.zeros_like(p) for p in params]
        h_acc = [torch.zeros_like(p) for p in params] if curvature else None
        loss_acc = None
        record = curvature or self.loss_reduction == "sum"  # a summed loss needs the batch size
        try:
            for k in self._sample_indices(num_samples):
                if sigmas is not None:
                    eps = self.noise(draw, k)
                    for p, mu, sigma, e in zip(params, means, sigmas, eps):
                        if e is not None:
                            w = mu + sigma * e
                            mask = self._mask(p)
                            p.copy_(w if mask is None else w * mask)
                for p in params:
                    p.grad = None
                recorder = SquaredGradients(self.model, self._modules) if record else None
                with torch.enable_grad():
                    if recorder is not None:
                        with recorder:
                            loss = closure()
                    else:
                        loss = closure()
                loss = torch.as_tensor(loss if loss is not None else float("nan")).detach()
                loss_acc = loss / num_samples if loss_acc is None else loss_acc + loss / num_samples
                n = recorder.batch_size if recorder is not None else None
                if record and n is None:
                    raise ValueError("closure: no supported layer of the model ran a forward pass with gradients "
                                     "(the closure must call the model and backward())")
                g_scale = 1.0 if self.loss_reduction == "mean" or n is None else 1.0 / n
                h_scale = (n if self.loss_reduction == "mean" else 1.0 / n) if n else 1.0
                for i, p in enumerate(params):
                    if p.grad is not None:
                        g_acc[i].add_(p.grad, alpha=g_scale / num_samples)
                    if curvature and p in recorder.sums:
                        h_acc[i].add_(recorder.sums[p], alpha=h_scale / num_samples)
        finally:
            for p, mu in zip(params, means):
                p.copy_(mu)
        return self._reduced(params, g_acc, h_acc, loss_acc, curvature)

    def _collect_batched(self, loss_fn: Callable[[], torch.Tensor], sigmas: list, num_samples: int, draw: int,
                         chunk_size: int | None):
        """:meth:`_collect` at ``num_samples`` samples (always with curvature), ``chunk_size`` of them per
        vmapped forward and backward (:func:`~mcgraph.optim.batched_samples.sample_squared_gradients`).

        ``loss_fn()`` returns the batch's loss without calling ``backward()``. Each sample's weights,
        noise and statistics are those of :meth:`_collect` (the same ``noise(draw, k)``, the same
        scaling by the batch size); the parameters are never modified.

        Raises:
            Unbatchable: vmap cannot evaluate the model (nothing was recorded).
        """
        from .batched_samples import default_chunk_size, sample_squared_gradients

        flat = self._flat()
        params = [p for p, _ in flat]
        names = {id(p): n for n, p in self.model.named_parameters()}
        indices = list(self._sample_indices(num_samples))
        if chunk_size is None:
            chunk_size = default_chunk_size(len(indices) or 1, sum(p.numel() for p in params), params[0].device)
        g_acc = [torch.zeros_like(p) for p in params]
        h_acc = [torch.zeros_like(p) for p in params]
        loss_acc = None
        sampled = [group["sample"] for _, group in flat]
        for start in range(0, len(indices), chunk_size):
            chunk = indices[start:start + chunk_size]
            # the samples' noise drawn into (S, *shape) rows, then w = μ + σ·ε in place (as _collect forms it)
            rows = [torch.empty((len(chunk),) + tuple(p.shape), dtype=p.dtype, device=p.device) if s else None
                    for p, s in zip(params, sampled)]
            for i, k in enumerate(chunk):
                self.noise(draw, k, out=[None if r is None else r[i] for r in rows])
            stacked = {}
            for p, sigma, w in zip(params, sigmas, rows):
                if w is None:
                    w = p.detach().expand((len(chunk),) + tuple(p.shape))
                else:
                    w.mul_(sigma).add_(p.detach())
                    mask = self._mask(p)
                    w = w if mask is None else w.mul_(mask)
                stacked[names[id(p)]] = w
            del rows
            grads, squared, losses, n = sample_squared_gradients(self.model, self._modules, loss_fn, stacked)
            del stacked
            if n is None:
                raise ValueError("loss_fn: no supported layer of the model ran a forward pass (loss_fn must call "
                                 "the model)")
            g_scale = 1.0 if self.loss_reduction == "mean" else 1.0 / n
            h_scale = n if self.loss_reduction == "mean" else 1.0 / n
            for i, p in enumerate(params):
                g_acc[i].add_(grads[names[id(p)]].sum(0), alpha=g_scale / num_samples)
                if names[id(p)] in squared:
                    h_acc[i].add_(squared[names[id(p)]], alpha=h_scale / num_samples)
            part = losses.sum() / num_samples
            loss_acc = part if loss_acc is None else loss_acc + part
        return self._reduced(params, g_acc, h_acc, loss_acc, True)

    def _reduced(self, params: list, g_acc: list, h_acc: list | None, loss_acc, curvature: bool):
        """The samples' averages through :meth:`_reduce_statistics`; ``p.grad`` set to ĝ. ``(loss, ĝ, ĥ)``."""
        if loss_acc is None:  # this process evaluated no sample (parallel="samples", K < processes)
            loss_acc = torch.zeros((), dtype=params[0].dtype, device=params[0].device)
        reduced = self._reduce_statistics(g_acc + (h_acc or []) + [loss_acc])
        g = reduced[:len(params)]
        h = reduced[len(params):2 * len(params)] if curvature else None
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        return reduced[-1], g, h

    def _commit_or_skip(self, tentative: list[tuple[nn.Parameter, dict]], what: str) -> bool:
        """Write ``{"param": new μ, state key: value}`` if every value is finite; else warn and skip."""
        values = [v for _, upd in tentative for v in upd.values() if isinstance(v, torch.Tensor)]
        if not all_finite(values):
            bad = next((self._names.get(p, "?") for p, upd in tentative
                        if not all_finite(v for v in upd.values() if isinstance(v, torch.Tensor))),
                       "?")
            self.counters["skipped"] += 1
            warnings.warn(f"{type(self).__name__}: non-finite {what} at step {self.counters['step'] + 1} (first at "
                          f"parameter {bad!r}); the step was skipped and the parameters and state left unchanged "
                          f"({self.counters['skipped']} skipped so far)", RuntimeWarning, stacklevel=3)
            return False
        for p, upd in tentative:
            state = self.state[p]
            for key, value in upd.items():
                if key == "param":
                    p.copy_(value)
                else:
                    state[key] = value
        self.counters["step"] += 1
        return True

    def _apply_masks(self) -> None:
        if self.spike_slab is not None:
            self.spike_slab.apply_masks()

    # ------------------------------------------------------------------ posterior

    def _sigmas(self) -> list[torch.Tensor | None]:
        """σ of every parameter (param-group order; ``None`` where not sampled)."""
        raise NotImplementedError

    @property
    def posterior(self) -> dict[str, Normal]:
        """The learned posterior: ``{parameter name: Normal(μ, σ)}`` for every sampled parameter (a
        property, as on :class:`mcgraph.nn.BayesLayer` and the interop sites).

        Names are those of ``model.named_parameters()``; pruned entries (spike-and-slab) have
        μ = σ = 0. Deterministic parameters (BatchNorm) are not included: their value is the
        model's.
        """
        out = {}
        for (p, group), sigma in zip(self._flat(), self._sigmas()):
            if sigma is not None:
                out[self._names[p]] = Normal(p.detach().clone(), sigma.detach().clone(), validate_args=False)
        return out

    def posterior_model(self) -> nn.Module:
        """A copy of the network whose layers sample from the learned posterior (:func:`posterior_model`).

        It plugs into :func:`mcgraph.nn.predict`, :func:`~mcgraph.nn.forward_samples`,
        :func:`~mcgraph.nn.kl` and the metrics unchanged.
        """
        return posterior_model(self.model, self.posterior, prior_precision=self._model_prior_precision())

    def _model_prior_precision(self) -> float | None:
        values = {g["prior_precision"] for g in self.param_groups if g["prior"] and "prior_precision" in g}
        return values.pop() if len(values) == 1 else None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def posterior_sites(model: nn.Module) -> dict[str, tuple[str, str]]:
    """``{parameter name: (Bayesian module name, "weight" or "bias")}`` for every parameter
    :func:`posterior_model` can sample: the weights and biases of ``Linear`` and ``Conv1d/2d/3d`` layers and
    of ``LSTM`` / ``GRU`` / ``RNN`` modules (whose ``weight_ih_l0`` is the weight of the site ``ih_l0`` of
    :class:`mcgraph.nn.BayesLSTM`, ``bias_hh_l1_reverse`` the bias of ``hh_l1_reverse``, …)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)) and not isinstance(m, nn.modules.conv._ConvTransposeNd):
            for leaf in ("weight", "bias"):
                if getattr(m, leaf, None) is not None:
                    out[_join(name, leaf)] = (name, leaf)
        elif isinstance(m, nn.RNNBase) and type(m) in (nn.LSTM, nn.GRU, nn.RNN):
            for flat in m._flat_weights_names:
                leaf, _, site = flat.partition("_")  # weight_ih_l0 -> ("weight", "ih_l0")
                out[_join(name, flat)] = (_join(name, site), leaf)
    return out


def posterior_model(model: nn.Module, posterior: dict[str, Normal], *, prior_precision: float | None = None,
                    ) -> nn.Module:
    """A copy of ``model`` whose layers with parameters in ``posterior`` sample ``w ~ posterior``.

    Each ``Linear``/``Conv`` layer and ``LSTM``/``GRU``/``RNN`` module with a parameter in ``posterior``
    becomes the matching :mod:`mcgraph.nn` Bayesian layer (:func:`mcgraph.nn.bayesify`, Normal posterior,
    ``scale_transform="exp"`` so ``ρ = log σ`` holds σ exactly, a Bayesian bias where the bias is in
    ``posterior``); a parameter of such a layer left out of ``posterior`` keeps its value (σ the smallest
    normal number), and every other module (BatchNorm, embeddings, attention, a layer with nothing in
    ``posterior``) keeps its trained values. The prior of the Bayesian layers is ``N(0, 1/prior_precision)``
    (used by :func:`mcgraph.nn.kl` only).

    Args:
        model: the network the posterior belongs to (its parameter names key ``posterior``).
        posterior: ``{parameter name: Normal(μ, σ)}`` (e.g. ``VOGN.posterior``).
        prior_precision: δ of the prior (default 1).

    Raises:
        ValueError: a name of ``posterior`` is not a parameter of ``model``, is one no Bayesian layer samples
            (:func:`posterior_sites`), or its shape is not the parameter's.

    Example:
        >>> import torch, mcgraph as mg
        >>> from torch.distributions import Normal
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 2))
        >>> q = {n: Normal(p.detach(), torch.full_like(p, 0.1)) for n, p in net.named_parameters()}
        >>> bnn = mg.optim.posterior_model(net, q)
        >>> mg.nn.predict(bnn, torch.zeros(4, 3), num_samples=8, seed=0).shape
        torch.Size([4, 2])
    """
    import functools

    from .. import nn as mnn
    from ..nn.bayesify import _target

    if not isinstance(posterior, dict):
        raise TypeError(f"posterior must be a dict of parameter name -> Normal, got {type(posterior).__name__}")
    named = dict(model.named_parameters())
    unknown = sorted(set(posterior) - set(named))
    if unknown:
        raise ValueError(f"posterior: no parameters named {unknown} in the model")
    sites = posterior_sites(model)
    bad = sorted(set(posterior) - set(sites))
    if bad:
        raise ValueError(f"posterior: {bad} are not weights or biases of Linear/Conv1d/2d/3d layers or "
                         "LSTM/GRU/RNN modules")
    delta = 1.0 if prior_precision is None else positive_real("prior_precision", prior_precision)
    owners = {n.rpartition(".")[0] for n in posterior}  # the modules holding a parameter of the posterior
    # every module bayesify would convert and the posterior does not reach keeps its trained values
    skip = tuple(name for name, m in model.named_modules() if _target(m) is not None and name not in owners)
    prior = functools.partial(mnn.PRIORS["normal"], scale=delta ** -0.5)
    bnn = mnn.bayesify(model, posterior="normal", prior=prior, scale_transform="exp", bayesian_bias=True,
                       init_from_weights=True, skip=skip)
    modules = dict(bnn.named_modules())
    with torch.no_grad():
        for pname, (site, leaf) in sites.items():
            if pname.rpartition(".")[0] not in owners:
                continue
            layer = modules[site]
            mu, rho = getattr(layer, f"{leaf}_mu"), getattr(layer, f"{leaf}_rho")
            q = posterior.get(pname)
            if q is None:  # a parameter left out of the posterior stays at its value (σ = the smallest normal)
                rho.fill_(math.log(torch.finfo(rho.dtype).tiny))
                continue
            if tuple(q.loc.shape) != tuple(mu.shape):
                raise ValueError(f"posterior: {pname} has shape {tuple(q.loc.shape)}, the parameter "
                                 f"{tuple(mu.shape)}")
            mu.copy_(q.loc)
            rho.copy_(q.scale.clamp_min(torch.finfo(q.scale.dtype).tiny).log())
    return bnn


def renamed_sample_count(who: str, num_samples: int, num_mc_samples: int | None) -> int:
    """``num_samples``, or the deprecated ``num_mc_samples`` with a warning (not both)."""
    if num_mc_samples is None:
        return num_samples
    if num_samples != 1:
        raise TypeError(f"{who}: num_mc_samples is the deprecated name of num_samples; give num_samples only")
    warnings.warn(f"{who}(num_mc_samples=...) is deprecated; use num_samples=...", DeprecationWarning, stacklevel=3)
    return num_mc_samples
