"""IVON: Improved Variational Online Newton (Shen et al., "Variational Learning is Effective for Large
Deep Networks", ICML 2024; the reference package is ``ivon-opt``).

A mean-field Gaussian posterior ``q(θ) = N(m, diag(σ²))`` learned at the cost of Adam: the
curvature comes from the reparameterisation trick (noise × gradient, Price's theorem), so one
ordinary backward per sample is all a step needs. With effective sample size λ (``ess``), weight
decay δ (the prior ``N(0, I/(λδ))``), learning rate α and, per step, ``K`` samples (the paper's
**Algorithm 1**, lines 1–7; the hessian update is its eq. (8), the Riemannian-gradient correction
of Lin et al., 2020, that keeps ``h`` positive):

.. math::
    \\sigma &= 1 / \\sqrt{\\lambda (h + \\delta)}, \\qquad
        \\theta^{(k)} = m + \\sigma \\odot \\epsilon^{(k)}, \\quad \\epsilon^{(k)} \\sim N(0, I) \\\\
    \\hat g &= \\frac1K \\sum_k \\nabla \\bar\\ell(\\theta^{(k)}), \\qquad
        \\hat h = \\frac1K \\sum_k \\nabla \\bar\\ell(\\theta^{(k)}) \\odot
        \\frac{\\theta^{(k)} - m}{\\sigma^2} \\quad \\text{(lines 1–2)} \\\\
    g &\\leftarrow \\beta_1 g + (1 - \\beta_1) \\hat g \\quad \\text{(line 3)} \\\\
    h &\\leftarrow \\beta_2 h + (1 - \\beta_2) \\hat h
        + \\tfrac12 (1 - \\beta_2)^2 \\frac{(h - \\hat h)^2}{h + \\delta} \\quad \\text{(line 4, eq. 8)} \\\\
    m &\\leftarrow m - \\alpha_t \\,
        \\mathrm{clip}\\Big(\\frac{g / (1 - \\beta_1^t) + \\delta m}{h + \\delta}, \\rho\\Big)
        \\quad \\text{(lines 5–6, with the new } h)

``ℓ̄`` is the minibatch mean loss (the closure's loss must be the batch mean). ``hess_approx=
"gradsq"`` replaces ``ĥ`` by ``λ ĝ²`` (the reference's alternative); ``rescale_lr`` uses
``α_t = α (h₀ + δ)``, so ``lr`` is on the scale of SGD's (the paper's Appendix A recommends
``lr ≈ 0.1`` with ``h₀`` 0.01–1 and ``ess`` the number of training examples); ``clip_radius`` ρ
clips each element of the preconditioned step; ``debias`` is Adam's ``1 − β₁ᵗ``.

The update is stated once, as pure functions, in :mod:`mcgraph.optim.updates` (:func:`~mcgraph.optim.updates.ivon_record`,
:func:`~mcgraph.optim.updates.ivon_step`); :meth:`IVON.step` runs it as foreach operations, or as one
compiled pass per parameter on the CPU (:mod:`mcgraph.optim.cpu_kernels`), both equal to it bit for bit
(tested). Moving from ivon-opt is one line (``ivon.IVON`` → ``mg.optim.IVON``, the same arguments and
defaults); what differs is listed in the docs (``docs/optimizers.md``, "From ivon-opt").

**Gradient accumulation.** One weight sample covers the whole batch: enter ``sampled_params``
once per Monte Carlo sample and accumulate the micro-batches' gradients inside it, each mean loss
weighted by its share of the batch; this is exactly the step of one large batch::

    for _ in range(train_samples):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            for xb, yb in zip(x.split(32), y.split(32)):
                (F.cross_entropy(model(xb), yb) * len(xb) / len(x)).backward()
    opt.step()

Entering ``sampled_params`` once per micro-batch (calling ``zero_grad`` each time) is valid too,
but each micro-batch then has its own weight sample (more noise, another estimator).

Example:
    >>> import torch, torch.nn.functional as F, mcgraph as mg
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    >>> x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    >>> opt = mg.optim.IVON(net, lr=0.1, ess=64, seed=0)
    >>> for _ in range(3):
    ...     with opt.sampled_params(train=True):
    ...         opt.zero_grad()
    ...         F.cross_entropy(net(x), y).backward()
    ...     opt.step()
    >>> q = opt.posterior                       # {"0.weight": Normal(m, σ), ...}
    >>> mg.nn.predict(opt.posterior_model(), x, num_samples=10, seed=0).shape
    torch.Size([64, 3])
"""

from __future__ import annotations

import contextlib
import enum
import math
import numbers
import weakref
from typing import Callable, Iterator

import torch
from torch import nn
from torch.autograd.graph import increment_version
from torch.distributions import Normal

from ..engine.checks import all_finite
from ..engine.noise.streams import mix_seed
from ._checks import non_negative_real, positive_int, positive_real, real_in, seed_or_none
from ._state import CountedOptimizer
from . import cpu_kernels
from .batched_samples import Unbatchable, check_batchable, default_chunk_size
from .seeded_noise import fill_normal

__all__ = ["IVON", "HessApprox"]

#: parameter dtypes whose optimizer state (mean, momentum, hessian) is kept in float32
LOW_PRECISION = (torch.float16, torch.bfloat16)


class HessApprox(str, enum.Enum):
    """How one sample estimates the diagonal hessian ``ĥ``."""

    PRICE = "price"  #: ``ĝ ⊙ (θ − m)/σ²``, the reparameterisation (Price's theorem) estimator (Algorithm 1, line 2)
    GRADSQ = "gradsq"  #: ``λ ĝ²``, a squared-gradient (Gauss–Newton-like) estimate

    def __str__(self) -> str:
        return self.value


def _state_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.float32 if p.dtype in LOW_PRECISION else p.dtype


def _radius(value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(float(value)) or not value > 0:
        raise ValueError(f"clip_radius must be > 0 (float('inf') for no clipping), got {value!r}")
    return float(value)


def _bump_versions(tensors: list[torch.Tensor]) -> None:
    """Bump the autograd version counters of tensors written through their pointers (one call where
    torch takes a list, from 2.5; one per tensor before)."""
    if _LIST_INCREMENT:
        increment_version(tensors)
    else:  # pragma: no cover - torch < 2.5
        for t in tensors:
            increment_version(t)


def _takes_a_list() -> bool:
    try:
        increment_version([torch.zeros(1)])
    except TypeError:  # pragma: no cover - torch < 2.5
        return False
    return True


_LIST_INCREMENT = _takes_a_list()

#: 0-d tensors of the scalars of the foreach ops on CPU parameters, by (value, dtype) (see :meth:`IVON._scalar`)
_SCALARS: dict = {}


class IVON(CountedOptimizer):
    """Improved Variational Online Newton (see the module docstring for the update and the loop).

    Args:
        params: the parameters (an iterable of tensors or of parameter-group dicts, as for any torch
            optimizer), or the ``nn.Module`` itself (its parameters; the posterior is then keyed by
            their names and :meth:`posterior_model` needs no argument).
        lr: α, the learning rate (the paper recommends about 0.1 with ``rescale_lr``).
        ess: λ, the effective sample size, usually the number of training examples.
        hess_init: h₀ > 0, the initial hessian (larger: smaller initial noise σ = 1/√(λ(h₀ + δ))).
        beta1: the gradient momentum β₁ ∈ [0, 1].
        beta2: the hessian momentum β₂ ∈ [0, 1].
        weight_decay: δ ≥ 0 (the prior precision per example).
        mc_samples: K ≥ 1 closure calls per :meth:`step` when a closure is given.
        hess_approx: ``"price"`` (default) or ``"gradsq"`` (:class:`HessApprox`).
        clip_radius: ρ > 0, element-wise clipping of the preconditioned step (``inf``: none).
        sync: all-reduce the statistics over torch.distributed's default group when it is initialised
            (ivon-opt's switch; ``process_group`` names a group explicitly).
        debias: divide the momentum by ``1 − β₁ᵗ``.
        rescale_lr: use ``α (h₀ + δ)`` as the step size.
        seed: ``None`` (default): noise from torch's global generator, drawn as ivon-opt draws it;
            an int: noise from this optimizer's own generators, draw ``k`` (the k-th ``sampled_params``
            block since the last step, training or not) of step ``t`` of parameter ``j`` seeded with
            ``mix(mix(mix(seed, t), k), j)`` (reproducible, resumable bitwise).
        process_group: ``None`` or a ``torch.distributed`` group over which ĝ and ĥ are averaged.
        fused: how :meth:`step` updates CPU parameters. ``None`` (default): one compiled pass per
            parameter (:mod:`mcgraph.optim.cpu_kernels`, built by the C++ compiler at the first step,
            about a second once per machine) where the state is contiguous float32 or float64 on the
            CPU and a compiler is found, else torch's foreach operations; ``True``: the compiled pass,
            raising if it cannot be had; ``False``: the foreach operations. Both give the same numbers
            bit for bit; the compiled pass reads and writes each element once instead of about twenty
            times (on a 1.8 M-parameter MLP, one thread, it took step() from 9.6 to 3.9 ms).

    Raises:
        ValueError: a hyperparameter out of range, or no parameters.
        TypeError: ``params`` holds something that is not a tensor.
    """

    def __init__(self, params, lr: float, ess: float, hess_init: float = 1.0, beta1: float = 0.9,
                 beta2: float = 0.99999, weight_decay: float = 1e-4, mc_samples: int = 1,
                 hess_approx: str | HessApprox = HessApprox.PRICE, clip_radius: float = float("inf"),
                 sync: bool = False, debias: bool = True, rescale_lr: bool = True, *, seed: int | None = None,
                 process_group=None, fused: bool | None = None) -> None:
        self.model = params if isinstance(params, nn.Module) else None
        if self.model is not None:
            params = list(self.model.parameters())
        try:
            hess_approx = HessApprox(hess_approx)
        except ValueError:
            raise ValueError(f"hess_approx must be one of {[h.value for h in HessApprox]}, got {hess_approx!r}") \
                from None
        defaults = {
            "lr": non_negative_real("lr", lr),
            "ess": positive_real("ess", ess),
            "hess_init": positive_real("hess_init", hess_init),
            "beta1": real_in("beta1", beta1, 0.0, 1.0),
            "beta2": real_in("beta2", beta2, 0.0, 1.0),
            "weight_decay": non_negative_real("weight_decay", weight_decay),
            "mc_samples": positive_int("mc_samples", mc_samples),
            "clip_radius": _radius(clip_radius),
        }
        super().__init__(params, defaults)
        flat = self._flat()
        if not flat:
            raise ValueError("params: IVON got no parameters")
        for p, _ in flat:
            if not p.is_floating_point():
                raise TypeError(f"params: IVON needs floating-point parameters, got one of dtype {p.dtype}")
        for group in self.param_groups:  # a group given as a dict re-checks its own overrides
            for key in ("lr", "weight_decay"):
                non_negative_real(key, group[key])
            for key in ("ess", "hess_init"):
                positive_real(key, group[key])
            real_in("beta1", group["beta1"], 0.0, 1.0)
            real_in("beta2", group["beta2"], 0.0, 1.0)
            _radius(group["clip_radius"])
        self._on_cpu = all(p.device.type == "cpu" for p, _ in flat)
        self.fused = cpu_kernels.checked_fused(fused, "IVON step")
        if fused:
            unfit = [p for p, _ in flat if p.device.type != "cpu" or not p.is_contiguous()]
            if unfit:
                raise ValueError(f"fused=True: the compiled step takes contiguous CPU parameters; one is "
                                 f"{'on ' + str(unfit[0].device) if unfit[0].device.type != 'cpu' else 'not contiguous'} "
                                 f"(pass fused=None to use it where it applies, or fused=False)")
        self._numel: int | None = None  # numbers in the parameters (computed at the first sample)
        self.mc_samples = defaults["mc_samples"]
        self.hess_approx = hess_approx.value
        self.sync = bool(sync)
        self.debias = bool(debias)
        self.rescale_lr = bool(rescale_lr)
        seed = seed_or_none("seed", seed)
        self._group = None
        if process_group is not None:
            from ..engine.distributed import check_process_group

            self._group = check_process_group(process_group)
        self.counters = {"step": 0, "skipped": 0, "seed": seed}
        self._active = False
        #: models step_samples ran in the loop because vmap refused them (not saved: tried again after a resume)
        self._looped_models: weakref.WeakSet = weakref.WeakSet()
        self._reset_samples()
        with torch.no_grad():
            for p, group in flat:
                state = self.state[p]
                dtype = _state_dtype(p)
                state["momentum"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
                state["hess"] = torch.full(p.shape, float(group["hess_init"]), dtype=dtype, device=p.device)
                if dtype != p.dtype:
                    state["mean"] = p.detach().to(dtype)

    # ------------------------------------------------------------------ bookkeeping

    @property
    def seed(self) -> int | None:
        """The noise seed (``None``: torch's global generator)."""
        return self.counters["seed"]

    @property
    def current_step(self) -> int:
        """Steps taken (ivon-opt's attribute; saved in :meth:`state_dict`)."""
        return int(self.counters["step"])

    def _scalar(self, value: float, tensors: list[torch.Tensor]):
        """``value`` for a multiplication or division of ``tensors`` by a foreach op: a 0-d tensor of their
        dtype when every parameter is on the CPU and the tensors share a dtype (torch takes it about
        three times faster than a Python number there, with the same results: the number is rounded to
        that dtype either way), else the number."""
        if not self._on_cpu or not tensors:
            return value
        dtype = tensors[0].dtype
        if dtype not in (torch.float32, torch.float64) or any(t.dtype != dtype for t in tensors):
            return value  # (half types compute with the number in float32: a half 0-d tensor would round it)
        key = (value, dtype)
        tensor = _SCALARS.get(key)
        if tensor is None:
            if len(_SCALARS) > 256:  # the debiasing factor changes every step: keep the cache small
                _SCALARS.clear()
            tensor = _SCALARS[key] = torch.tensor(value, dtype=dtype)
        return tensor

    def _flat(self) -> list[tuple[torch.Tensor, dict]]:
        return [(p, g) for g in self.param_groups for p in g["params"]]

    def _reset_samples(self) -> None:
        self._count = 0  # samples recorded (train=True) since the last step
        self._draws = 0  # noise draws since the last step (train or not)
        self._avg_grad: list[torch.Tensor] | None = None
        self._avg_hess: list[torch.Tensor] | None = None  # ĝ ⊙ noise (price) or ĝ² (gradsq), averaged
        self._scales: list | None = None  # per group: (key, h + δ, √(λ(h + δ))) until the next step

    def _scale_key(self, group: dict) -> tuple:
        """What a group's scales depend on: λ, δ and its hessian tensors (themselves, compared by identity,
        and their version counters, so a hessian replaced or changed in place by anyone but :meth:`step` is
        seen)."""
        hess = tuple(self.state[p]["hess"] for p in group["params"])
        return group["ess"], group["weight_decay"], hess, tuple(h._version for h in hess)

    @staticmethod
    def _same_key(a: tuple, b: tuple) -> bool:
        return a[:2] == b[:2] and a[3] == b[3] and len(a[2]) == len(b[2]) and all(x is y for x, y in zip(a[2], b[2]))

    def _group_scales(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Per group ``(h + δ, 1/σ = √(λ (h + δ)))``, computed once per step (h changes only in :meth:`step`;
        the compiled step makes the next step's as it updates h).

        Recomputed when a group's λ, δ or hessian was changed since (the key); the step reuses ``h + δ``
        (the same numbers ivon-opt computes again).
        """
        keys = [self._scale_key(g) for g in self.param_groups]
        if self._scales is None or len(self._scales) != len(keys) \
                or not all(self._same_key(k, cached) for k, (cached, _, _) in zip(keys, self._scales)):
            scales = []
            for key, group in zip(keys, self.param_groups):
                ess, wd, hess = key[:3]
                hess_wd = torch._foreach_add(list(hess), wd)
                inv = torch._foreach_mul(hess_wd, self._scalar(ess, hess_wd))
                torch._foreach_sqrt_(inv)
                scales.append((key, hess_wd, inv))
            self._scales = scales
        return [(hess_wd, inv) for _, hess_wd, inv in self._scales]

    def _mean(self, p: torch.Tensor) -> torch.Tensor:
        """m of ``p`` in its state dtype (the float32 copy for a low-precision parameter)."""
        mean = self.state[p].get("mean")
        return p.detach() if mean is None else mean

    def _std_inverse(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """``1/σ = √(λ (h + δ))``."""
        return (group["ess"] * (self.state[p]["hess"] + group["weight_decay"])).sqrt()

    def _world(self) -> tuple[int, int, object]:
        """``(rank, world size, group)`` of the statistics' all-reduce (``(0, 1, None)`` without one)."""
        group = self._group
        if group is None and self.sync:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                group = dist.group.WORLD
        if group is None:
            return 0, 1, None
        import torch.distributed as dist

        return dist.get_rank(group), dist.get_world_size(group), group

    def _noise(self, inverse_scales: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """``σ ⊙ ε`` of the next sample for every parameter (in its state dtype): row 0 of
        :meth:`_noise_rows` ``(1)``, drawn without the sample axis (the one-sample path of every step);
        ``inverse_scales`` is 1/σ (:meth:`_inverse_scales`), or ``None`` for ε itself."""
        flat = self._flat()
        eps = []
        if self.seed is None:
            for group in self.param_groups:
                ps = group["params"]
                if len({p.device for p in ps}) == 1 and len({_state_dtype(p) for p in ps}) == 1:
                    flat_eps = torch.randn(sum(p.numel() for p in ps), device=ps[0].device, dtype=_state_dtype(ps[0]))
                    eps += [e.view(p.shape) for e, p in zip(flat_eps.split([p.numel() for p in ps]), ps)]
                else:
                    eps += [torch.randn(p.shape, device=p.device, dtype=_state_dtype(p)) for p in ps]
        else:
            rank, world, _ = self._world()
            base = mix_seed(mix_seed(self.seed, self.counters["step"]), self._draws * world + rank)
            eps = [torch.empty(p.shape, device=p.device, dtype=_state_dtype(p)) for p, _ in flat]
            fill_normal([(mix_seed(base, j), e) for j, e in enumerate(eps)])  # (independent: several threads)
        self._draws += 1
        if inverse_scales is not None:
            torch._foreach_div_(eps, inverse_scales)
        return eps

    def _inverse_scales(self) -> list[torch.Tensor]:
        """1/σ of every parameter, in :meth:`_flat` order."""
        return [v for _, group_inv in self._group_scales() for v in group_inv]

    def _noise_rows(self, samples: int) -> list[torch.Tensor]:
        """``σ ⊙ ε`` of the next ``samples`` draws, ``(samples, *p.shape)`` per parameter (its state dtype).

        Row ``k`` holds the numbers ``samples`` successive :meth:`_noise` calls would draw: from torch's
        global generator, group by group as ivon-opt draws them (``normal_`` on a row consumes the
        generator as ``randn`` of its size does), or, with a seed, draw ``k`` of parameter ``j`` from
        ``mix(mix(mix(seed, t), k·R + r), j)``. Advances the draw count by ``samples``.
        """
        flat = self._flat()
        if self.seed is None:
            rows, draws = [], []  # draws: per group, the tensors whose rows one sample draws, in order
            for group in self.param_groups:
                ps = group["params"]
                if len({p.device for p in ps}) == 1 and len({_state_dtype(p) for p in ps}) == 1:
                    # one draw per group and sample, as ivon-opt draws it; each parameter's rows are a view
                    buffer = torch.empty((samples, sum(p.numel() for p in ps)), dtype=_state_dtype(ps[0]),
                                         device=ps[0].device)
                    rows += [part.view(samples, *p.shape)
                             for part, p in zip(buffer.split([p.numel() for p in ps], dim=1), ps)]
                    draws.append([buffer])
                else:
                    mine = [torch.empty((samples, *p.shape), dtype=_state_dtype(p), device=p.device) for p in ps]
                    rows += mine
                    draws.append(mine)
            for k in range(samples):
                for tensors in draws:
                    for t in tensors:
                        t[k].normal_()
        else:
            rows = [torch.empty((samples, *p.shape), dtype=_state_dtype(p), device=p.device) for p, _ in flat]
            rank, world, _ = self._world()
            step_seed = mix_seed(self.seed, self.counters["step"])
            jobs = []
            for k in range(samples):
                base = mix_seed(step_seed, (self._draws + k) * world + rank)
                jobs += [(mix_seed(base, j), rows[j][k]) for j in range(len(flat))]
            fill_normal(jobs)
        self._draws += samples
        for r, v in zip(rows, [v for _, group_inv in self._group_scales() for v in group_inv]):
            r.div_(v)
        return rows

    # ------------------------------------------------------------------ sampling

    @contextlib.contextmanager
    def sampled_params(self, train: bool = False) -> Iterator[None]:
        """Hold the parameters at a weight sample ``θ = m + σ ⊙ ε`` inside the ``with`` block.

        With ``train=True`` the gradients found in ``.grad`` on leaving the block are recorded as one
        Monte Carlo sample of the next :meth:`step` (a parameter without ``.grad`` counts as a zero
        gradient). On leaving, normally or by an exception, the parameters are the mean again; a block
        left by an exception records nothing. Inside another ``sampled_params`` block it does nothing.
        """
        if self._active:
            yield
            return
        flat = self._flat()
        with torch.no_grad():
            means = [self._mean(p) for p, _ in flat]
            invs = self._inverse_scales()
            if self._compiled_sample() and cpu_kernels.group_fits(means, invs):
                noise, thetas = self._noise(None), [torch.empty_like(m) for m in means]
                for eps, inv, mean, theta in zip(noise, invs, means, thetas):
                    cpu_kernels.ivon_sample_(eps, inv, mean, theta)
            else:
                noise = self._noise(invs)
                thetas = torch._foreach_add(means, noise)
            saved = [p.data for p, _ in flat]
            for (p, _), theta in zip(flat, thetas):
                p.data = theta if theta.dtype == p.dtype else theta.to(p.dtype)
        self._active = True
        try:
            yield
        finally:
            self._active = False
            with torch.no_grad():
                for (p, _), data in zip(flat, saved):
                    p.data = data
        if train:
            self._record([p.grad for p, _ in flat], noise)

    @torch.no_grad()
    def _record(self, grads: list[torch.Tensor | None], noise: list[torch.Tensor]) -> None:
        """Fold one sample's gradients into the running means (Welford, as ivon-opt): ``a + (v − a)/c``.

        ``noise`` (this sample's ``σ ⊙ ε``, no longer needed) is overwritten; the gradients are not.
        """
        flat = self._flat()
        first = self._avg_grad is None
        price = self.hess_approx == HessApprox.PRICE
        compiled = self._compiled_sample() and all(gi is not None for gi in grads)
        if compiled and first and cpu_kernels.group_fits(grads, noise):
            g = [torch.empty_like(n) for n in noise]
            h = noise if price else [torch.empty_like(n) for n in noise]
            for gi, n, ga, ha in zip(grads, noise, g, h):
                cpu_kernels.ivon_record_first_(gi, n, ga, ha, price=price)
            self._count = 1
            self._avg_grad, self._avg_hess = g, h
            return
        if compiled and not first and cpu_kernels.group_fits(grads, noise, self._avg_grad, self._avg_hess):
            self._count += 1
            for gi, n, ga, ha in zip(grads, noise, self._avg_grad, self._avg_hess):
                cpu_kernels.ivon_record_next_(gi, n, ga, ha, count=self._count, price=price)
            return
        # the first is kept: a copy, contiguous whatever the gradient's layout (the step's buffers)
        if first and all(gi is not None and gi.dtype == _state_dtype(p) and gi.is_contiguous()
                         for gi, (p, _) in zip(grads, flat)):
            g = list(torch._foreach_mul(grads, 1.0))  # the copies in one foreach call (x·1 is x, bit for bit)
        else:
            g = [torch.zeros(p.shape, dtype=_state_dtype(p), device=p.device) if gi is None
                 else gi.to(_state_dtype(p), copy=True, memory_format=torch.contiguous_format) if first
                 else gi.to(_state_dtype(p)) for gi, (p, _) in zip(grads, flat)]
        if price:
            torch._foreach_mul_(noise, g)
            h = noise
        else:
            h = list(torch._foreach_mul(g, g))
        self._count += 1
        if first:
            self._avg_grad, self._avg_hess = g, h
            return
        c = self._count
        step = torch._foreach_sub(g, self._avg_grad)
        torch._foreach_div_(step, self._scalar(c, step))
        torch._foreach_add_(self._avg_grad, step)
        torch._foreach_sub_(h, self._avg_hess)
        torch._foreach_div_(h, self._scalar(c, h))
        torch._foreach_add_(self._avg_hess, h)

    # ------------------------------------------------------------------ step

    def _reduce(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        _, world, group = self._world()
        if group is None or world == 1:
            return self._avg_grad, self._avg_hess
        from ..engine.distributed import SampleShard

        tensors = list(self._avg_grad) + list(self._avg_hess)
        reduced = [t / world for t in SampleShard(group).sum(lambda: tensors, tensors)]
        n = len(self._avg_grad)
        return reduced[:n], reduced[n:]

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Update m, g and h from the samples recorded since the last step (Algorithm 1, lines 3–7).

        With a ``closure`` (forward, mean loss, ``backward()``, returning the loss), it is first run
        ``mc_samples`` times, each inside ``sampled_params(train=True)`` with the gradients cleared
        before; returns the mean of its losses (``None`` without a closure).

        Raises:
            RuntimeError: no sample was recorded since the last step (no ``sampled_params(train=True)``
                block and no closure); the weights are left unchanged.
        """
        loss = None
        if closure is not None:
            losses = []
            for _ in range(self.mc_samples):
                self.zero_grad(set_to_none=True)
                with self.sampled_params(train=True), torch.enable_grad():
                    losses.append(closure())
            loss = sum(losses) / len(losses) if all(v is not None for v in losses) else None
        if self._count == 0:
            raise RuntimeError("IVON.step: no gradient sample was recorded since the last step; run the forward "
                               "and backward passes inside `with optimizer.sampled_params(train=True):` (once per "
                               "Monte Carlo sample, the micro-batches of gradient accumulation inside one block), "
                               "or pass a closure to step()")
        avg_grad, avg_hess = self._reduce()
        scales = self._group_scales()
        groups, i = [], 0  # per group: (its ĝ, its ĥ, its state lists, whether the compiled pass takes them)
        for group, (hess_wd, inv) in zip(self.param_groups, scales):
            ps = group["params"]
            gbar, fbar = avg_grad[i:i + len(ps)], avg_hess[i:i + len(ps)]
            i += len(ps)
            states = [self.state[p] for p in ps]
            lists = ([self._mean(p) for p in ps], [st["momentum"] for st in states], [st["hess"] for st in states],
                     gbar, fbar, hess_wd, inv)
            groups.append((states, lists, self._compiled_step(lists)))  # (raises before anything is written)
        self.counters["step"] += 1
        t = self.counters["step"]
        next_scales = []  # per group, (key, h + δ, 1/σ) of the next step where the compiled pass made them
        for group, (states, lists, compiled) in zip(self.param_groups, groups):
            ps = group["params"]
            means, momentum, hess, gbar, fbar, hess_wd, inv = lists
            b1, b2, wd, ess = group["beta1"], group["beta2"], group["weight_decay"], group["ess"]
            lr = group["lr"] * (group["hess_init"] + wd) if self.rescale_lr else group["lr"]
            debias = 1.0 - math.pow(b1, float(t)) if self.debias else 1.0        # line 5
            # ρ no larger than the state's largest number (torch refuses a larger clamp bound; same numbers)
            radius = min([group["clip_radius"], *(torch.finfo(m.dtype).max for m in means)])
            if compiled:
                cpu_kernels.ivon_step_(means, momentum, hess, gbar, fbar, hess_wd, inv, beta1=b1, beta2=b2, ess=ess,
                                       weight_decay=wd, debias=debias, lr=lr, clip_radius=radius,
                                       price=self.hess_approx == HessApprox.PRICE, checked=True)
                _bump_versions([*means, *momentum, *hess, *hess_wd])  # written through their pointers
                for p, st in zip(ps, states):
                    if "mean" in st:
                        p.copy_(st["mean"])
                torch._foreach_sqrt_(inv)  # torch's square root, as _group_scales takes it
                next_scales.append((self._scale_key(group), hess_wd, inv))
                continue
            # updates.ivon_step as one foreach call per operation and group, in place (bitwise equal to it, and
            # to ivon-opt's order of operations), on the samples' buffers, which are free
            # after their last use (ĝ -> (1-β₁)ĝ -> the correction, ĥ -> f -> the step): a step allocates
            # nothing of the parameters' size (fresh temporaries cost more than the copies on CPU).
            torch._foreach_mul_(momentum, self._scalar(b1, momentum))
            torch._foreach_mul_(gbar, self._scalar(1.0 - b1, gbar))
            torch._foreach_add_(momentum, gbar)                                    # line 3: g
            if self.hess_approx == HessApprox.PRICE:
                torch._foreach_mul_(fbar, hess_wd)                                 # line 2: ĝ ε/σ = ĝ·noise·(h + δ)
            torch._foreach_mul_(fbar, self._scalar(ess, fbar))                          # f = ĥ (times λ)
            corr = gbar
            torch._foreach_copy_(corr, hess)
            torch._foreach_sub_(corr, fbar)
            torch._foreach_mul_(corr, corr)
            torch._foreach_mul_(corr, self._scalar(0.5 * (1.0 - b2) ** 2, corr))
            torch._foreach_div_(corr, hess_wd)                                     # ½(1-β₂)²(h - f)²/(h + δ)
            torch._foreach_mul_(hess, self._scalar(b2, hess))
            torch._foreach_mul_(fbar, self._scalar(1.0 - b2, fbar))
            torch._foreach_add_(hess, fbar)
            torch._foreach_add_(hess, corr)                                        # line 4: h
            step = fbar
            torch._foreach_copy_(step, momentum)
            torch._foreach_div_(step, self._scalar(debias, step))
            decay = corr
            torch._foreach_copy_(decay, means)
            torch._foreach_mul_(decay, self._scalar(wd, decay))
            torch._foreach_add_(step, decay)
            torch._foreach_copy_(hess_wd, hess)
            torch._foreach_add_(hess_wd, wd)
            torch._foreach_div_(step, hess_wd)
            if math.isfinite(group["clip_radius"]):
                torch._foreach_clamp_min_(step, -radius)
                torch._foreach_clamp_max_(step, radius)
            torch._foreach_mul_(step, self._scalar(lr, step))
            torch._foreach_sub_(means, step)                                       # line 6: m
            for p, st in zip(ps, states):
                if "mean" in st:
                    p.copy_(st["mean"])
        self._reset_samples()
        if len(next_scales) == len(self.param_groups):
            self._scales = next_scales
        return loss

    def _compiled_sample(self) -> bool:
        """Whether a weight sample and its statistics may take the compiled passes (``fused`` allows it, the
        parameters are on the CPU and hold at least :data:`~mcgraph.optim.cpu_kernels.SAMPLE_MIN_ELEMENTS`
        numbers, and the library builds); the caller checks the tensors with
        :func:`~mcgraph.optim.cpu_kernels.group_fits`."""
        if self.fused is False or not self._on_cpu:
            return False
        if self._numel is None:
            self._numel = sum(p.numel() for p, _ in self._flat())
        return self._numel >= cpu_kernels.SAMPLE_MIN_ELEMENTS and cpu_kernels.library() is not None

    def _compiled_step(self, lists: tuple) -> bool:
        """Whether :meth:`step` updates a group (its lists: m, g, h, ĝ, ĥ, h + δ, 1/σ) by the compiled pass
        (see ``fused``); under ``fused=True`` a group it cannot take raises."""
        if self.fused is False or not self._on_cpu:
            return False
        if not cpu_kernels.group_fits(*lists):
            if self.fused:
                raise RuntimeError("fused=True: a parameter's optimizer state is not a dense, contiguous CPU "
                                   "tensor of the parameter's dtype (float32 or float64), e.g. after loading a "
                                   "checkpoint of another dtype or moving the model; pass fused=None to take "
                                   "torch's operations there. Nothing was updated.")
            return False
        return cpu_kernels.library() is not None

    def step_samples(self, loss_fn: Callable[[], torch.Tensor], *, vectorize: bool | None = None,
                     model: nn.Module | None = None, chunk_size: int | None = None,
                     before_step: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """One step from ``mc_samples`` weight samples evaluated together; returns their mean loss.

        ``loss_fn()`` calls the model and returns the batch-mean loss **without** calling
        ``backward()``. With ``vectorize`` (default: when K > 1 and the model allows it) the samples run
        ``chunk_size`` at a time as one batched forward and backward each: the parameters are stacked
        along a leading sample axis and ``torch.func.vmap(torch.func.grad(...))`` evaluates ``loss_fn``
        at every sample of the chunk. Otherwise, or when vmap refuses the model and ``vectorize`` is
        ``None``, the samples run one after the other. vmap refuses BatchNorm in training mode (batch
        statistics would mix the samples; its running statistics are updated in place) and other
        in-place updates of buffers; such models fall back to the loop, and later calls run them in the
        loop at once (no noise drawn for an attempt that cannot succeed). Both paths use the same noise as K
        ``sampled_params(train=True)`` blocks and give the same step up to float rounding.

        Memory: a chunk of S samples holds ``S`` stacked weight samples, their noise and their
        gradients (about ``3·S·P`` numbers for P parameters) beside the batch's activations times S.

        Args:
            loss_fn: the loss of the current batch, computed through the model's forward.
            vectorize: ``True`` (vmap or raise), ``False`` (a loop), ``None`` (vmap if K > 1 and possible).
            model: the network (default: the one given to the constructor; needed for vmap).
            chunk_size: samples per batched pass (default: all K while ``K·P`` ≤ 2²⁴ numbers, 2²⁶ on CUDA,
                else as many as fit: :func:`~mcgraph.optim.batched_samples.default_chunk_size`).
            before_step: called with the samples' mean loss once they are all recorded, before the update
                (a training loop's finiteness check: :meth:`recorded_finite` tells whether the gradients
                are). When it raises, the recorded samples are dropped and the weights and the optimizer's
                state are left as they were.

        Raises:
            ValueError: ``vectorize=True`` without a model, or a ``chunk_size`` that is not a positive int.

        Example:
            >>> import torch, torch.nn.functional as F, mcgraph as mg
            >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
            >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
            >>> opt = mg.optim.IVON(net, lr=0.1, ess=16, mc_samples=8, seed=0)
            >>> loss = opt.step_samples(lambda: F.cross_entropy(net(x), y))
        """
        model = model if model is not None else self.model
        if vectorize and model is None:
            raise ValueError("model: step_samples(vectorize=True) needs the network (IVON(model, ...) or model=)")
        if chunk_size is not None:
            chunk_size = positive_int("chunk_size", chunk_size)
        else:
            flat = self._flat()
            chunk_size = default_chunk_size(self.mc_samples, sum(p.numel() for p, _ in flat), flat[0][0].device)
        draws, count = self._draws, self._count
        batched = vectorize or (vectorize is None and model is not None and self.mc_samples > 1
                                and model not in self._looped_models)
        if batched and not vectorize:  # BatchNorm with batch statistics: the loop, before any noise is drawn
            try:
                check_batchable(model)
            except Unbatchable:
                batched = False
        if batched:
            try:
                losses = []
                for start in range(0, self.mc_samples, chunk_size):
                    size = min(chunk_size, self.mc_samples - start)
                    losses.append(self._vectorized_samples(loss_fn, model, size) * size)
            except Exception:  # noqa: BLE001 -- vmap refuses the model (in-place buffer updates, …)
                if vectorize or self._count != count:
                    raise
                self._draws = draws  # nothing was recorded: the loop draws the same noise
                self._looped_models.add(model)  # and later calls go there at once
            else:
                return self._step_checked(sum(losses) / self.mc_samples, before_step)
        losses = []
        for _ in range(self.mc_samples):
            with self.sampled_params(train=True):
                self.zero_grad(set_to_none=True)
                with torch.enable_grad():
                    loss = loss_fn()
                    loss.backward()
                losses.append(loss.detach())
        return self._step_checked(torch.stack(losses).mean(), before_step)

    def _step_checked(self, loss: torch.Tensor, before_step) -> torch.Tensor:
        if before_step is not None:
            try:
                before_step(loss)
            except BaseException:
                self._reset_samples()
                raise
        self.step()
        return loss

    @torch.no_grad()
    def recorded_finite(self) -> bool:
        """Whether every statistic recorded since the last step (mean gradient, Hessian estimate) is finite."""
        stats = (self._avg_grad or []) + (self._avg_hess or [])
        return all_finite(stats)

    def _vectorized_samples(self, loss_fn: Callable[[], torch.Tensor], model: nn.Module, samples: int) -> torch.Tensor:
        """Record ``samples`` samples from one vmapped forward/backward; returns their mean loss.

        The samples' noise is drawn into ``(S, *shape)`` rows (the numbers of S ``sampled_params``
        blocks), the weights ``m + σ ε_k`` are stacked along a leading sample axis, and
        ``vmap(grad(loss))`` gives the ``(S, *shape)`` gradients in one batched forward and backward.
        """
        from torch.func import grad, vmap
        from torch.nn.utils.stateless import _reparametrize_module

        flat = self._flat()
        names = self._names(model)
        missing = [n for n in names.values() if n.startswith("param_groups.")]
        if missing:
            raise ValueError(f"model: does not hold the optimizer's parameters {missing}")
        with torch.no_grad():
            noise = self._noise_rows(samples)
            stacked = {}
            for (p, _), n in zip(flat, noise):
                theta = torch.add(self._mean(p), n)  # (S, *shape): m + σ ε_k, as sampled_params forms it
                stacked[names[id(p)]] = theta if theta.dtype == p.dtype else theta.to(p.dtype)

        def loss_at(params: dict) -> tuple[torch.Tensor, torch.Tensor]:
            with _reparametrize_module(model, params):
                loss = loss_fn()
            return loss, loss.detach()

        with torch.enable_grad():
            grads, losses = vmap(grad(loss_at, has_aux=True), randomness="different")(stacked)
        del stacked
        self._record_rows([grads.pop(names[id(p)]) for p, _ in flat], noise)
        return losses.mean()

    @torch.no_grad()
    def _record_rows(self, grads: list[torch.Tensor], noise: list[torch.Tensor]) -> None:
        """Fold S samples at once: ``grads`` and ``noise`` are ``(S, *shape)`` per parameter (both overwritten).

        The S samples' mean joins the running mean with weight ``S / (count + S)``: the K-sample means of
        :meth:`_record`'s Welford recursion up to float rounding.
        """
        flat = self._flat()
        samples = noise[0].shape[0]
        g = [gi.to(_state_dtype(p)) for gi, (p, _) in zip(grads, flat)]
        g_mean = [gi.mean(0) for gi in g]
        if self.hess_approx == HessApprox.PRICE:
            torch._foreach_mul_(noise, g)
            h = noise
        else:
            torch._foreach_mul_(g, g)
            h = g
        h_mean = [hi.mean(0) for hi in h]
        self._count += samples
        if self._avg_grad is None:
            self._avg_grad, self._avg_hess = g_mean, h_mean
            return
        weight = samples / self._count
        for avg, new in ((self._avg_grad, g_mean), (self._avg_hess, h_mean)):
            torch._foreach_sub_(new, avg)
            torch._foreach_mul_(new, self._scalar(weight, new))
            torch._foreach_add_(avg, new)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """torch's optimizer state (m for low-precision parameters, g, h) plus the step count and seed."""
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict`, keeping each state tensor's saved dtype (torch casts them to the parameter's)."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        for i, (p, _) in zip(ids, self._flat()):
            for key, value in saved.get(i, {}).items():
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.detach().clone().to(p.device)
        self._reset_samples()

    # ------------------------------------------------------------------ posterior

    def _names(self, model: nn.Module | None) -> dict:
        named = {} if model is None else {id(p): n for n, p in model.named_parameters()}
        out = {}
        for gi, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                out[id(p)] = named.get(id(p), f"param_groups.{gi}.params.{j}")
        return out

    @property
    def posterior(self) -> dict[str, Normal]:
        """The learned posterior: ``{parameter name: Normal(m, σ)}``, ``σ = 1/√(λ(h + δ))`` (a property,
        as on :class:`mcgraph.nn.BayesLayer`).

        Names are those of the constructor's model's ``named_parameters()``; parameters it does not
        hold (or all, when built from parameters) are named ``"param_groups.<i>.params.<j>"``
        (:meth:`posterior_of` names them by another module).
        """
        return self.posterior_of(self.model)

    def posterior_of(self, model: nn.Module | None) -> dict[str, Normal]:
        """:attr:`posterior` with names from ``model.named_parameters()``."""
        names = self._names(model)
        out = {}
        for p, group in self._flat():
            mean = self._mean(p).detach().clone()
            out[names[id(p)]] = Normal(mean, (1.0 / self._std_inverse(p, group)).to(mean.dtype), validate_args=False)
        return out

    def posterior_model(self, model: nn.Module | None = None) -> nn.Module:
        """A copy of the network whose ``Linear``/``Conv`` layers and ``LSTM``/``GRU``/``RNN`` modules sample
        from the learned posterior.

        It plugs into :func:`mcgraph.nn.predict` and the metrics unchanged (as
        :meth:`mcgraph.optim.VOGN.posterior_model`); other parameters (BatchNorm, embeddings, attention)
        keep their mean. The prior of the Bayesian layers is ``N(0, 1/(λδ))``.

        Args:
            model: the network these parameters belong to (default: the one given to the constructor).

        Raises:
            ValueError: no model is known.
        """
        from .gaussian import posterior_model, posterior_sites

        model = model if model is not None else self.model
        if model is None:
            raise ValueError("model: IVON was built from parameters, not a module; pass the network "
                             "(opt.posterior_model(model))")
        convertible = posterior_sites(model)
        q = {k: v for k, v in self.posterior_of(model).items() if k in convertible}
        if not q:
            raise ValueError("model: none of IVON's parameters is a weight or bias of a Linear/Conv layer or an "
                             "LSTM/GRU/RNN module of it")
        deltas = {g["ess"] * g["weight_decay"] for g in self.param_groups}
        delta = deltas.pop() if len(deltas) == 1 else None
        return posterior_model(model, q, prior_precision=delta if delta else None)
