"""Bayesian layers: ``BayesLinear`` and one N-d convolution (plain and transposed).

Every layer holds a variational posterior over its weight,

.. math::
    q(W) = \\text{posterior}(\\mu, \\sigma), \\qquad \\sigma = t(\\rho)
    \\;(\\text{default } t = \\operatorname{softplus}, \\text{ see } :mod:`mcgraph.nn.scales`),

built on demand by the property :attr:`BayesLayer.posterior`, and a prior ``p(W)``
(the property :attr:`BayesLayer.prior`). ``forward`` returns only the output; the KL term is
collected from the modules by :func:`mcgraph.nn.kl`, which calls
:meth:`BayesLayer.kl` = ``mg.kl_divergence(q, p, kl_samples)``: exact where exact exists (torch's
closed form, or the engine's exact tier for polynomial terms), else the collapsed, fused or chunked
tier, graph independent of ``kl_samples``.

Noise is functional: every forward draws fresh noise (global generator, or the
seeded streams of a sample run, see :mod:`mcgraph.nn.context`) into new tensors.
Nothing is kept in a buffer, so several samples can share one autograd graph
and every σ-gradient uses its own sample's noise.

Three forward estimators:

* **weight sampling** (default): ``W_s = T(μ + σ ξ_s)`` for each sample ``s``;
* **local reparameterization** (Kingma et al., 2015; Gaussian posteriors):
  the pre-activation is Gaussian, ``y = x μ + b + \\sqrt{x^2 σ^2}\\, ε``;
* **flipout** (Wen et al., 2018; location-scale posteriors with symmetric noise):
  ``y = x μ + b + ((x ∘ s_{in}) ΔW_s) ∘ s_{out}``, ``ΔW_s = W_s − μ``, with
  Rademacher signs per example and channel.

Bias (and BatchNorm, left untouched) is a deterministic point estimate unless
``bayesian_bias=True``.
"""

from __future__ import annotations

import enum
import math
import numbers

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Distribution
from torch.nn.modules.utils import _ntuple, _reverse_repeat_tuple

from ..engine import checks
from ..engine.plan.families import GenericForm, SamplingForm, family_of, location_scale_form
from ..engine.noise.streams import resolve_seed
from ..engine.options import Sampling, resolve_sampling
from ..engine.stderr import MCEstimate, refuse_with_process_group
from .context import BayesianModule, NoiseKind, current_capture, current_window, form_noise_global, normal_draw, rademacher
from .layer_kl import layer_kl
from .masks import adopt_masks
from .estimator import Estimator, estimator_flags, to_estimator
from .priors import layer_options, make_prior, resolve_posterior, unchecked
from .scales import scale_transform as resolve_scale_transform

__all__ = ["SampleMode", "BayesLayer", "BayesLinear", "BayesConv", "BayesConv1d", "BayesConv2d",
           "BayesConv3d", "BayesConvTranspose", "BayesConvTranspose1d", "BayesConvTranspose2d",
           "BayesConvTranspose3d"]


class SampleMode(str, enum.Enum):
    """Which weights a Bayesian layer's forward uses."""

    SAMPLE = "sample"  #: a fresh posterior sample per forward (per sample of a run)
    MEAN = "mean"  #: the posterior location μ (deterministic; "frozen")

    def __str__(self) -> str:
        return self.value


def _std(var: torch.Tensor) -> torch.Tensor:
    """√var, kept away from the infinite derivative of √ at 0 (an all-zero input row)."""
    return var.clamp_min(torch.finfo(var.dtype).tiny).sqrt()


class BayesLayer(BayesianModule):
    """Base class of the Bayesian layers (not used directly).

    Subclasses define the deterministic operation ``_op(x, weight, bias)``, its
    per-sample version ``_op_samples(x, weights, S)`` (weights of shape
    ``(S, *weight_shape)``, input rows grouped sample-major) and the channel axis.

    Args:
        weight_shape: shape of the weight tensor.
        out_channels: length of the bias.
        bias: whether the layer has a bias.
        posterior: the posterior family: a name of :data:`mcgraph.nn.POSTERIORS`
            (``"normal"``, ``"radial"``, ``"laplace"``, ``"lognormal"``, ``"logistic"``) or a
            callable ``(loc, scale) -> Distribution`` (``torch.distributions.Laplace``, …).
        prior: the prior: a name of :data:`mcgraph.nn.PRIORS` (``"normal"``,
            ``"scale_mixture"``, ``"laplace"``, ``"student_t"``, ``"log_uniform"``,
            ``"horseshoe"``, ``"ard"``), a ``Distribution`` (scalar parameters broadcast to the
            weight), or a factory ``like -> Distribution``.
            ``prior``, ``local_reparameterization``, ``rho_init`` and ``scale_transform`` left at
            ``None`` take the posterior family's defaults (``"sparse_vd"``: log-uniform prior,
            local reparameterization, ρ = log σ² = −10), else ``"normal"``, ``False``, −5 and
            ``"softplus"``.
        kl_samples: M of this layer's Monte Carlo KL. It matters only where a term is sampled:
            under the default ``method="auto"`` a (posterior, prior) pair with a closed form
            (Normal ‖ Normal, …) or only exact terms draws no noise and ignores it; under
            ``method="monte-carlo"`` (or a forced tier) every term is sampled with M = ``kl_samples``.
        estimator: how the output is sampled (:class:`~mcgraph.nn.Estimator`): ``"reparameterization"``
            (draw the weights), ``"local_reparameterization"`` (draw the pre-activations; mean-field
            Gaussian posteriors only) or ``"flipout"`` (decorrelate the weight perturbation across the
            batch, Wen et al., 2018; location-scale posteriors without a transform). ``None``: the
            posterior family's default, else ``"reparameterization"``.
        bayesian_bias: give the bias a posterior (same family) and a KL term; by
            default it is a deterministic point estimate.
        rho_init: initial ρ; σ = softplus(ρ) (−5 gives σ ≈ 0.0067) under the default transform.
        scale_transform: how σ is derived from ρ: a name of
            :data:`mcgraph.nn.SCALE_TRANSFORMS` (``"softplus"``, ``"exp"``: ρ = log σ,
            ``"exp_half"``: ρ = log σ²) or a :class:`~mcgraph.nn.ScaleTransform`
            (:func:`~mcgraph.nn.softplus_beta` for a softplus with β).
        device, dtype: factory arguments of the parameters.

    Attributes:
        weight_mu, weight_rho: the posterior parameters of the weight (σ = ``scale_transform(ρ)``).
        bias: the deterministic bias (``None`` when absent or Bayesian).
        bias_mu, bias_rho: the posterior parameters of a Bayesian bias (else ``None``).
        mode: :class:`SampleMode` (``"sample"`` or ``"mean"``).
        estimator: the :class:`~mcgraph.nn.Estimator` in use; ``local_reparameterization`` and
            ``flipout`` are its two booleans.

    ``local_reparameterization=`` and ``flipout=`` are accepted as the deprecated spelling of
    ``estimator=`` (with a ``DeprecationWarning``).
    """

    _channel_axis = 1

    def __init__(self, weight_shape, out_channels: int, bias: bool, *, posterior="normal", prior=None,
                 kl_samples: int = 1, estimator: str | Estimator | None = None, bayesian_bias: bool = False,
                 rho_init: float | None = None, scale_transform=None, device=None, dtype=None,
                 local_reparameterization: bool | None = None, flipout: bool | None = None) -> None:
        super().__init__()
        local_reparameterization, flipout = estimator_flags(estimator, local_reparameterization, flipout)
        # Options left at None take the posterior family's defaults (e.g. "sparse_vd"), else the base ones.
        prior, local_reparameterization, rho_init, scale_transform = layer_options(
            posterior, prior, local_reparameterization, rho_init, scale_transform, flipout=flipout)
        fk = {"device": device, "dtype": dtype}
        self.weight_mu = nn.Parameter(torch.empty(weight_shape, **fk))
        self.weight_rho = nn.Parameter(torch.empty(weight_shape, **fk))
        if bias and bayesian_bias:
            self.register_parameter("bias", None)
            self.bias_mu = nn.Parameter(torch.empty(out_channels, **fk))
            self.bias_rho = nn.Parameter(torch.empty(out_channels, **fk))
        else:
            self.bias = nn.Parameter(torch.empty(out_channels, **fk)) if bias else None
            self.register_parameter("bias_mu", None)
            self.register_parameter("bias_rho", None)
        self.posterior_family = posterior
        self._posterior_factory = resolve_posterior(posterior)
        self.prior_spec = prior
        self.kl_samples = checks.positive_int("kl_samples", kl_samples)
        self.local_reparameterization = bool(local_reparameterization)
        self.flipout = bool(flipout)
        if not isinstance(rho_init, numbers.Real):
            raise ValueError(f"rho_init must be a real number, got {rho_init!r}")
        self.rho_init = float(rho_init)
        self.scale_transform = resolve_scale_transform(scale_transform)
        self.mode = SampleMode.SAMPLE
        self.reset_parameters()
        self._check_options()

    # ------------------------------------------------------------------ parameters and distributions

    @property
    def estimator(self) -> Estimator:
        """The output estimator: ``"local_reparameterization"``, ``"flipout"`` or ``"reparameterization"``."""
        return to_estimator(self.local_reparameterization, self.flipout)

    def reset_parameters(self) -> None:
        """μ as torch initialises the deterministic layer (Kaiming-uniform), ρ = ``rho_init``."""
        nn.init.kaiming_uniform_(self.weight_mu, a=math.sqrt(5))
        nn.init.constant_(self.weight_rho, self.rho_init)
        fan_in, _ = nn.init._calculate_fan_in_and_fan_out(self.weight_mu)
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)
        if self.bias_mu is not None:
            nn.init.uniform_(self.bias_mu, -bound, bound)
            nn.init.constant_(self.bias_rho, self.rho_init)

    def _check_options(self) -> None:
        if self.local_reparameterization and self.flipout:
            raise ValueError("local_reparameterization and flipout are alternatives; set at most one")
        with torch.no_grad():
            q = self._posterior_factory(self.weight_mu, self.weight_sigma)
            if not isinstance(q, Distribution):
                raise TypeError(f"posterior must return a Distribution, got {type(q).__name__}")
            if tuple(q.batch_shape + q.event_shape) != tuple(self.weight_mu.shape):
                raise ValueError(f"posterior: the distribution's shape {tuple(q.batch_shape + q.event_shape)} "
                                 f"is not the weight shape {tuple(self.weight_mu.shape)}")
            form = family_of(q)
            name = type(q).__name__
            if self.local_reparameterization and not (
                    isinstance(form, SamplingForm) and form.noise.gaussian and not form.noise.event_ndims
                    and not form.transforms and form.loc is not None):
                raise ValueError(f"estimator='local_reparameterization' requires a mean-field Gaussian posterior "
                                 f"(the pre-activation must be Gaussian), got posterior={name}")
            if self.flipout and not (isinstance(form, SamplingForm) and form.loc is not None
                                     and not form.transforms):
                raise ValueError(f"estimator='flipout' requires a location-scale posterior w = μ + σξ with symmetric "
                                 f"noise, got posterior={name}")
            check_prior = getattr(self._posterior_factory, "check_prior", None)
            prior = make_prior(self.prior_spec, self.weight_mu)
            if check_prior is not None:
                check_prior(prior)
            if hasattr(prior, "check_posterior"):  # a prior set from q (ARD) names the posteriors it can pair with
                prior.check_posterior(q)
            if self.bias_mu is not None:
                make_prior(self.prior_spec, self.bias_mu)

    @property
    def weight_sigma(self) -> torch.Tensor:
        """σ = ``scale_transform(ρ)`` (default softplus, stable for large |ρ|)."""
        return self.scale_transform(self.weight_rho)

    @property
    def bias_sigma(self) -> torch.Tensor | None:
        return None if self.bias_rho is None else self.scale_transform(self.bias_rho)

    @property
    def posterior(self) -> Distribution:
        """q(W) = posterior(weight_mu, scale_transform(weight_rho)), differentiable in both.

        A property, like :attr:`prior`, returning a plain torch distribution. Built without
        argument validation (σ > 0 by construction; validation would synchronise with the device
        on every forward).
        """
        return unchecked(self._posterior_factory, self.weight_mu, self.weight_sigma)

    @property
    def bias_posterior(self) -> Distribution | None:
        """q(b) for a Bayesian bias, else ``None`` (a property, like :attr:`bias_prior`)."""
        if self.bias_mu is None:
            return None
        return unchecked(self._posterior_factory, self.bias_mu, self.bias_sigma)

    @property
    def prior(self) -> Distribution:
        """p(W), built for the weight's device and dtype (a named prior without re-checking its defaults)."""
        return make_prior(self.prior_spec, self.weight_mu, validate=False)

    @property
    def bias_prior(self) -> Distribution | None:
        return None if self.bias_mu is None else make_prior(self.prior_spec, self.bias_mu, validate=False)

    @property
    def is_bayesian_bias(self) -> bool:
        return self.bias_mu is not None

    #: Whether :attr:`posterior`, :attr:`prior` and their bias twins are :class:`BayesLayer`'s own; a subclass
    #: that defines one builds its distributions another way (set by ``__init_subclass__``).
    _plain_distributions = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if any(name in cls.__dict__ for name in ("posterior", "prior", "bias_posterior", "bias_prior")):
            cls._plain_distributions = False

    def _has_plain_distributions(self) -> bool:
        """Whether the layer builds its distributions as :class:`BayesLayer` does (else its KL takes the general
        path)."""
        return type(self)._plain_distributions

    def kl(self, num_samples: int | Sampling | None = None, *, seed: int | None = None, method: str = "auto",
           return_stderr: bool = False, process_group=None):
        """KL(q ‖ p) of this layer's weight (and Bayesian bias), summed: a 0-d tensor.

        .. math::
            KL = \\sum_j \\big(E_q[\\log q(w)] - E_q[\\log p(w)]\\big)_j

        computed by :func:`mcgraph.kl_divergence`: exact where exact exists under ``method="auto"``
        (``num_samples`` unused then), else with ``num_samples`` (default ``kl_samples``) samples;
        its autograd graph does not grow with M. A (posterior, prior)
        pair with a registered layer KL (:func:`mcgraph.nn.register_layer_kl`: ARD, Sparse VD's
        fit) uses that rule; a pruned layer counts its remaining weights only.

        Args:
            num_samples: M (default: ``self.kl_samples``), or a :class:`~mcgraph.Sampling` with M (or
                ``None``) and the options below.
            seed: noise seed (``None``: drawn from the global generator).
            method: the KL's method (``"auto"``: exact where exact exists; ``"monte-carlo"``:
                sampled; ``"collapsed-exact"``, ``"direct"``, …; :data:`mcgraph.engine.methods.KL_METHODS`).
            return_stderr: return an :class:`~mcgraph.MCEstimate` ``(value, stderr, num_samples)``:
                the elements of q's batch (and the bias, seeded apart) have independent noise, so
                their variances add (not with ``process_group``).
            process_group: split the samples across a ``torch.distributed`` group
                (see :func:`mcgraph.expectation`).

        Example:
            >>> import torch, mcgraph as mg
            >>> layer = mg.nn.BayesLinear(4, 3, posterior="radial", prior="scale_mixture", kl_samples=100)
            >>> layer.kl(seed=0).shape
            torch.Size([])
        """
        num_samples, o = resolve_sampling(num_samples, seed=(seed, None), method=(method, "auto"),
                                          return_stderr=(return_stderr, False), process_group=(process_group, None))
        seed, method, return_stderr, process_group = o["seed"], o["method"], o["return_stderr"], o["process_group"]
        m = self.kl_samples if num_samples is None else checks.positive_int("num_samples", num_samples)
        seed = resolve_seed(seed)
        refuse_with_process_group(return_stderr, process_group)
        if return_stderr:
            from .kl_stderr import layer_kl_with_stderr

            value, stderr = layer_kl_with_stderr(self, m, seed, method)
            return MCEstimate(value, stderr, m)
        # a registered rule for (q, p), else the engine
        return layer_kl(self, m, seed=seed, method=method, process_group=process_group)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        adopt_masks(self, state_dict, prefix)  # a pruned layer's masks, before its parameters
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ------------------------------------------------------------------ forward

    def _op(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def _op_samples(self, x: torch.Tensor, weights: torch.Tensor, S: int) -> torch.Tensor:
        raise NotImplementedError

    @property
    def in_channels_(self) -> int:
        raise NotImplementedError

    def _channels(self, t: torch.Tensor, ndim: int) -> torch.Tensor:
        """``(N, C)`` per-row, per-channel values broadcast against an ``ndim``-d activation."""
        n, c = t.shape
        if self._channel_axis == -1:
            return t.reshape(n, *([1] * (ndim - 2)), c)
        return t.reshape(n, c, *([1] * (ndim - 2)))

    _min_input_dims = 2

    def _rows_per_sample(self, x: torch.Tensor, S: int) -> int:
        if x.dim() < self._min_input_dims:
            raise ValueError(f"x: {type(self).__name__} needs a batched input with at least "
                             f"{self._min_input_dims} dimensions, got shape {tuple(x.shape)}")
        if x.shape[0] % S:
            raise ValueError(f"x: inside a window of {S} samples the batch dimension must be a multiple of "
                             f"{S} (the batch repeated once per sample), got shape {tuple(x.shape)}")
        return x.shape[0] // S

    def _form_rows(self, form, kind: int) -> torch.Tensor:
        win = current_window()
        if win is None:
            return form_noise_global(form)
        return win.run.form_rows(self, kind, form, win.start, win.stop)

    def _raw_rows(self, kind: int, draw, shape, dtype, device) -> torch.Tensor:
        win = current_window()
        if win is None:
            return draw(1)
        return win.run.raw_rows(self, kind, draw, shape, dtype, device, win.start, win.stop)

    def _samples_of(self, q: Distribution, kind: int) -> torch.Tensor:
        """``(S, *shape)`` draws of q for the active window (one draw outside a window)."""
        form = family_of(q)
        rows = self._form_rows(form, kind)
        if isinstance(form, GenericForm):
            return rows
        return form.sample(rows)

    def _posterior_samples(self, kind: int) -> torch.Tensor:
        """:meth:`_samples_of` the weight's (``NoiseKind.WEIGHT``) or the bias's posterior; a plain
        location-scale family's form is built from (μ, σ) directly, without the distribution."""
        loc, scale = (self.weight_mu, self.weight_sigma) if kind == NoiseKind.WEIGHT else (self.bias_mu,
                                                                                            self.bias_sigma)
        form = location_scale_form(self._posterior_factory, loc, scale)
        if form is None:
            return self._samples_of(self.posterior if kind == NoiseKind.WEIGHT else self.bias_posterior, kind)
        return form.sample(self._form_rows(form, kind))

    def _sample_bias(self, rows: int, S: int, ndim: int, delta: bool) -> torch.Tensor | None:
        """Per-row bias samples ``(S·rows, C)`` broadcast to the activation (``b_s − μ_b`` if ``delta``);
        ``(1, C)`` for one sample."""
        b = self._posterior_samples(NoiseKind.BIAS)
        if delta:
            b = b - self.bias_mu
        if S > 1:  # one sample's bias broadcasts over the rows as it is (no copy, two graph nodes fewer)
            b = b[:, None, :].expand(S, rows, b.shape[-1]).reshape(S * rows, b.shape[-1])
        return self._channels(b, ndim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for one posterior sample per (sample, example) block.

        Outside a sample run: one fresh sample from the global generator. Inside a
        window of ``S`` samples (:func:`mcgraph.nn.forward_samples`): ``x`` is the batch
        repeated ``S`` times and sample ``s`` acts on rows ``s·B … (s+1)·B − 1``.
        In ``"mean"`` mode the posterior location is used.
        """
        if self.mode == SampleMode.MEAN:
            return self._op(x, self.weight_mu, self._bias_mean)
        cap = current_capture()
        if cap is not None and cap.layer is self:
            return self._record(cap, x)
        win = current_window()
        S = 1 if win is None else win.size
        rows = self._rows_per_sample(x, S)
        if self.local_reparameterization:
            return self._forward_local(x, S, rows)
        if self.flipout:
            return self._forward_flipout(x, S, rows)
        w = self._posterior_samples(NoiseKind.WEIGHT)
        out = self._op_samples(x, w, S)
        if self.bias is not None:
            out = out + self._channels(self.bias[None], out.dim()).to(out.dtype)  # autocast: as F.linear
        elif self.bias_mu is not None:
            out = out + self._sample_bias(rows, S, out.dim(), delta=False).to(out.dtype)
        return out

    def _record(self, cap, x: torch.Tensor) -> torch.Tensor:
        cap.calls += 1
        cap.input = x
        if cap.kind == "moments":
            cap.output, cap.variance = self.moments(x)
        else:
            cap.output = self._op(x, self.weight_mu, self._bias_mean)
        return cap.output

    def _forward_local(self, x: torch.Tensor, S: int, rows: int) -> torch.Tensor:
        # y = x μ + b + sqrt(x² σ² + σ_b²) ε,  ε ~ N(0, 1) per output element and sample
        mean, var = self.moments(x)
        return mean + _std(var) * self._output_noise(mean, rows)

    def _output_noise(self, mean: torch.Tensor, rows: int) -> torch.Tensor:
        shape = (rows,) + tuple(mean.shape[1:])
        draw = normal_draw(shape, mean.dtype, mean.device)
        return self._raw_rows(NoiseKind.OUTPUT, draw, shape, mean.dtype, mean.device).reshape(mean.shape)

    def moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and variance of the Gaussian pre-activation (local reparameterization).

        .. math::
            m = x\\mu + b, \\qquad s^2 = x^2\\sigma^2 \\;(+\\,\\sigma_b^2)

        Raises:
            ValueError: the layer does not use local reparameterization.
        """
        if not self.local_reparameterization:
            raise ValueError("moments() needs estimator='local_reparameterization'")
        sigma = self.weight_sigma
        b_var = None if self.bias_mu is None else self.bias_sigma ** 2
        return self._op(x, self.weight_mu, self._bias_mean), self._op(x * x, sigma * sigma, b_var)

    @property
    def _bias_mean(self) -> torch.Tensor | None:
        return self.bias if self.bias_mu is None else self.bias_mu

    def _forward_flipout(self, x: torch.Tensor, S: int, rows: int) -> torch.Tensor:
        # y = x μ + b + ((x ∘ s_in) ΔW_s) ∘ s_out,  ΔW_s = W_s − μ
        q = self.posterior
        mean = self._op(x, self.weight_mu, self._bias_mean)
        delta = self._samples_of(q, NoiseKind.WEIGHT) - self.weight_mu
        dtype, device = x.dtype, x.device
        c_in, c_out = self.in_channels_, mean.shape[self._channel_axis]

        def signs(channels):
            return lambda n: rademacher((n, rows, channels), dtype, device)

        s_in = self._raw_rows(NoiseKind.SIGN_IN, signs(c_in), (rows, c_in), dtype, device)
        s_out = self._raw_rows(NoiseKind.SIGN_OUT, signs(c_out), (rows, c_out), dtype, device)
        s_in = self._channels(s_in.reshape(S * rows, c_in), x.dim())
        s_out = self._channels(s_out.reshape(S * rows, c_out), mean.dim())
        out = mean + self._op_samples(x * s_in, delta, S) * s_out
        if self.bias_mu is not None:
            out = out + self._sample_bias(rows, S, out.dim(), delta=True).to(out.dtype)
        return out

    def extra_repr(self) -> str:
        family = self.posterior_family if isinstance(self.posterior_family, str) else \
            getattr(self.posterior_family, "__name__", type(self.posterior_family).__name__)
        prior = self.prior_spec if isinstance(self.prior_spec, str) else type(self.prior_spec).__name__
        flags = [f"posterior={family}", f"prior={prior}", f"kl_samples={self.kl_samples}"]
        if self.scale_transform.name != "softplus":
            flags.append(f"scale_transform={self.scale_transform}")
        if self.estimator is not Estimator.REPARAMETERIZATION:
            flags.append(f"estimator={self.estimator}")
        if self.bias_mu is not None:
            flags.append("bayesian_bias=True")
        if self.mode != SampleMode.SAMPLE:
            flags.append(f"mode={self.mode}")
        return ", ".join(flags)


class BayesLinear(BayesLayer):
    """Bayesian ``nn.Linear``: ``y = x Wᵀ + b`` with ``W ~ q(W)``.

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        bias: whether to add a (deterministic, unless ``bayesian_bias``) bias.
        **options: the keyword arguments of :class:`BayesLayer` (``posterior``, ``prior``,
            ``kl_samples``, ``local_reparameterization``, ``flipout``, ``bayesian_bias``,
            ``rho_init``, ``scale_transform``, ``device``, ``dtype``).

    Shape:
        Input ``(N, *, in_features)``; output ``(N, *, out_features)``.

    Example:
        >>> import torch, mcgraph as mg
        >>> layer = mg.nn.BayesLinear(784, 10, posterior="radial", prior="normal", kl_samples=1000)
        >>> layer(torch.randn(32, 784)).shape
        torch.Size([32, 10])
        >>> mg.nn.kl(layer, seed=0).shape
        torch.Size([])
    """

    _channel_axis = -1

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **options) -> None:
        self.in_features = checks.positive_int("in_features", in_features)
        self.out_features = checks.positive_int("out_features", out_features)
        super().__init__((out_features, in_features), out_features, bias, **options)

    @property
    def in_channels_(self) -> int:
        return self.in_features

    def _op(self, x, weight, bias):
        return F.linear(x, weight, bias)

    def _op_samples(self, x, weights, S):
        if S == 1:
            return F.linear(x, weights[0])
        out = torch.matmul(x.reshape(S, -1, self.in_features), weights.transpose(-1, -2))
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None or self.bias_mu is not None}, " + super().extra_repr()

    @classmethod
    def from_torch(cls, module: nn.Linear, *, init_from_weights: bool = True, **options) -> "BayesLinear":
        """The Bayesian counterpart of ``module`` (μ copied from its weight when ``init_from_weights``)."""
        p = module.weight
        layer = cls(module.in_features, module.out_features, module.bias is not None,
                    device=p.device, dtype=p.dtype, **options)
        if init_from_weights:
            layer._copy_from(module)
        return layer

    @torch.no_grad()
    def _copy_from(self, module: nn.Module) -> None:
        self.weight_mu.copy_(module.weight)
        if module.bias is not None:
            (self.bias if self.bias is not None else self.bias_mu).copy_(module.bias)


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


class _BayesConvNd(BayesLayer):
    """One N-d implementation of Bayesian convolutions, plain and transposed (``spatial_dims`` ∈ {1, 2, 3})."""

    _channel_axis = 1

    def __init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                 padding_mode, output_padding, transposed: bool, spatial_dims: int, **options) -> None:
        if spatial_dims not in _CONV:
            raise ValueError(f"spatial_dims must be 1, 2 or 3, got {spatial_dims!r}")
        nt = _ntuple(spatial_dims)
        self.spatial_dims = spatial_dims
        self.in_channels = checks.positive_int("in_channels", in_channels)
        self.out_channels = checks.positive_int("out_channels", out_channels)
        self.groups = checks.positive_int("groups", groups)
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"groups={groups} must divide in_channels={in_channels} and out_channels={out_channels}")
        self.kernel_size = nt(kernel_size)
        self.stride = nt(stride)
        self.dilation = nt(dilation)
        self.padding = padding if isinstance(padding, str) else nt(padding)
        self.output_padding = nt(output_padding)
        self.transposed = bool(transposed)
        if padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            raise ValueError(f"padding_mode must be 'zeros', 'reflect', 'replicate' or 'circular', got {padding_mode!r}")
        if padding_mode != "zeros" and (transposed or isinstance(padding, str)):
            raise ValueError(f"padding_mode={padding_mode!r} needs a plain convolution with integer padding")
        self.padding_mode = padding_mode
        self._reversed_padding = (_reverse_repeat_tuple(self.padding, 2) if not isinstance(padding, str)
                                  else None)
        if transposed:
            shape = (in_channels, out_channels // groups, *self.kernel_size)
        else:
            shape = (out_channels, in_channels // groups, *self.kernel_size)
        self._min_input_dims = spatial_dims + 2
        super().__init__(shape, out_channels, bias, **options)

    @property
    def in_channels_(self) -> int:
        return self.in_channels

    def _conv(self, x, weight, bias, groups):
        if self.transposed:
            return _CONV_T[self.spatial_dims](x, weight, bias, self.stride, self.padding, self.output_padding,
                                              groups, self.dilation)
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding, mode=self.padding_mode)
            return _CONV[self.spatial_dims](x, weight, bias, self.stride, 0, self.dilation, groups)
        return _CONV[self.spatial_dims](x, weight, bias, self.stride, self.padding, self.dilation, groups)

    def _op(self, x, weight, bias):
        return self._conv(x, weight, bias, self.groups)

    def _op_samples(self, x, weights, S):
        if S == 1:
            return self._conv(x, weights[0], None, self.groups)
        # S weight samples as one grouped convolution: sample s owns channel block s.
        rows = x.shape[0] // S
        spatial = x.shape[2:]
        xs = x.reshape(S, rows, self.in_channels, *spatial).transpose(0, 1).reshape(rows, S * self.in_channels,
                                                                                   *spatial)
        ws = weights.reshape(S * weights.shape[1], *weights.shape[2:])
        out = self._conv(xs, ws, None, S * self.groups)
        out = out.reshape(rows, S, self.out_channels, *out.shape[2:]).transpose(0, 1)
        return out.reshape(S * rows, self.out_channels, *out.shape[3:])

    def extra_repr(self) -> str:
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
             f"padding={self.padding}")
        if self.transposed and any(self.output_padding):
            s += f", output_padding={self.output_padding}"
        if any(d != 1 for d in self.dilation):
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode}"
        return s + ", " + super().extra_repr()

    @torch.no_grad()
    def _copy_from(self, module: nn.Module) -> None:
        self.weight_mu.copy_(module.weight)
        if module.bias is not None:
            (self.bias if self.bias is not None else self.bias_mu).copy_(module.bias)


def _dims_of(cls, spatial_dims, kernel_size) -> int:
    if spatial_dims is None:
        spatial_dims = getattr(cls, "_default_dims", None)
    if spatial_dims is None:
        if isinstance(kernel_size, (tuple, list)):
            spatial_dims = len(kernel_size)
        else:
            raise ValueError("spatial_dims must be given (1, 2 or 3) when kernel_size is an int")
    return spatial_dims


def _from_dims(cls, module: nn.Module) -> int:
    """The spatial dimensions of the torch convolution ``module``, refused when ``cls`` fixes other ones."""
    dims = len(module.kernel_size)
    fixed = getattr(cls, "_default_dims", None)
    if fixed is not None and fixed != dims:
        raise ValueError(f"module: {cls.__name__} converts {fixed}-d convolutions, got {type(module).__name__} "
                         f"({dims}-d); use {cls.__mro__[1].__name__}.from_torch or the {dims}-d class")
    return dims


class BayesConv(_BayesConvNd):
    """Bayesian N-d convolution (``nn.Conv1d/2d/3d``), one class for every dimension.

    ``BayesConv1d``, ``BayesConv2d`` and ``BayesConv3d`` only fix ``spatial_dims``.
    With ``S`` weight samples in a window the ``S`` convolutions run as one grouped
    convolution (sample ``s`` owns channel block ``s``).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
            padding_mode: as in ``torch.nn.Conv2d``.
        spatial_dims: 1, 2 or 3 (default: the subclass's, else ``len(kernel_size)``).
        **options: the keyword arguments of :class:`BayesLayer`.

    Example:
        >>> import torch, mcgraph as mg
        >>> conv = mg.nn.BayesConv2d(3, 8, 3, padding=1, posterior="laplace", prior="scale_mixture")
        >>> conv(torch.randn(2, 3, 16, 16)).shape
        torch.Size([2, 8, 16, 16])
        >>> mg.nn.BayesConv(3, 8, (3, 3, 3))(torch.randn(1, 3, 5, 5, 5)).shape
        torch.Size([1, 8, 3, 3, 3])
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", *, spatial_dims: int | None = None,
                 **options) -> None:
        dims = _dims_of(type(self), spatial_dims, kernel_size)
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, 0, False, dims, **options)

    @classmethod
    def from_torch(cls, module: nn.modules.conv._ConvNd, *, init_from_weights: bool = True, **options) -> "BayesConv":
        """The Bayesian counterpart of an ``nn.Conv{1,2,3}d`` (μ copied from it when ``init_from_weights``)."""
        p = module.weight
        layer = cls(module.in_channels, module.out_channels, module.kernel_size, module.stride,
                    module.padding, module.dilation, module.groups, module.bias is not None,
                    module.padding_mode, spatial_dims=_from_dims(cls, module), device=p.device,
                    dtype=p.dtype, **options)
        if init_from_weights:
            layer._copy_from(module)
        return layer


class BayesConv1d(BayesConv):
    """:class:`BayesConv` with ``spatial_dims=1`` (``nn.Conv1d``)."""

    _default_dims = 1


class BayesConv2d(BayesConv):
    """:class:`BayesConv` with ``spatial_dims=2`` (``nn.Conv2d``)."""

    _default_dims = 2


class BayesConv3d(BayesConv):
    """:class:`BayesConv` with ``spatial_dims=3`` (``nn.Conv3d``)."""

    _default_dims = 3


class BayesConvTranspose(_BayesConvNd):
    """Bayesian N-d transposed convolution (``nn.ConvTranspose1d/2d/3d``), one class for every dimension.

    The weight has torch's transposed layout ``(in_channels, out_channels / groups, *kernel_size)``.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, output_padding, groups, bias,
            dilation: as in ``torch.nn.ConvTranspose2d`` (``padding_mode`` must be ``"zeros"``).
        spatial_dims: 1, 2 or 3 (default: the subclass's, else ``len(kernel_size)``).
        **options: the keyword arguments of :class:`BayesLayer`.

    Example:
        >>> import torch, mcgraph as mg
        >>> up = mg.nn.BayesConvTranspose2d(8, 4, 2, stride=2, estimator="local_reparameterization")
        >>> up(torch.randn(2, 8, 5, 5)).shape
        torch.Size([2, 4, 10, 10])
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, output_padding=0,
                 groups: int = 1, bias: bool = True, dilation=1, padding_mode: str = "zeros", *,
                 spatial_dims: int | None = None, **options) -> None:
        dims = _dims_of(type(self), spatial_dims, kernel_size)
        if padding_mode != "zeros":
            raise ValueError(f"padding_mode must be 'zeros' for a transposed convolution, got {padding_mode!r}")
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, output_padding, True, dims, **options)

    @classmethod
    def from_torch(cls, module: nn.modules.conv._ConvTransposeNd, *, init_from_weights: bool = True,
                   **options) -> "BayesConvTranspose":
        """The Bayesian counterpart of an ``nn.ConvTranspose{1,2,3}d``."""
        p = module.weight
        layer = cls(module.in_channels, module.out_channels, module.kernel_size, module.stride,
                    module.padding, module.output_padding, module.groups, module.bias is not None,
                    module.dilation, spatial_dims=_from_dims(cls, module), device=p.device,
                    dtype=p.dtype, **options)
        if init_from_weights:
            layer._copy_from(module)
        return layer


class BayesConvTranspose1d(BayesConvTranspose):
    """:class:`BayesConvTranspose` with ``spatial_dims=1`` (``nn.ConvTranspose1d``)."""

    _default_dims = 1


class BayesConvTranspose2d(BayesConvTranspose):
    """:class:`BayesConvTranspose` with ``spatial_dims=2`` (``nn.ConvTranspose2d``)."""

    _default_dims = 2


class BayesConvTranspose3d(BayesConvTranspose):
    """:class:`BayesConvTranspose` with ``spatial_dims=3`` (``nn.ConvTranspose3d``)."""

    _default_dims = 3
