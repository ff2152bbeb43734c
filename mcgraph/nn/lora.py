"""Variational low-rank adapters (Bayesian LoRA) on a frozen pretrained network.

:func:`bayesian_lora` wraps each targeted layer ``y = base(x)`` (an ``nn.Linear``, or a GPT-2-style
``transformers`` ``Conv1D``) in a :class:`BayesLoRA`,

.. math::
    y = \\text{base}(x) + \\frac{\\alpha}{r}\\, B\\,A\\,\\text{dropout}(x),
    \\qquad A \\in \\mathbb R^{r\\times d_{in}},\\; B \\in \\mathbb R^{d_{out}\\times r},

whose factor ``A`` (by default; see ``variational``) is a Bayesian site: a
:class:`~mcgraph.nn.BayesLinear` without bias, with a mean-field posterior of any registered family
and a prior of any registered family. The pretrained tensors are frozen (``requires_grad=False``) and
never written. Everything :mod:`mcgraph.nn` does with Bayesian layers applies to the sites: an M-sample
forward in a sample run (the batch repeated, sample ``s`` of ``A`` on its own row block),
:func:`~mcgraph.nn.kl` (the adapters' KL only: the base weights carry no posterior),
:func:`~mcgraph.nn.elbo`, :func:`~mcgraph.nn.elbo_terms`, :func:`~mcgraph.nn.predict`,
``process_group``, ``return_stderr``, :func:`~mcgraph.nn.set_mode` / :func:`~mcgraph.nn.frozen`,
and the sparsification tools (:func:`~mcgraph.nn.prune_l1`, ``posterior="sparse_vd"`` with
:func:`~mcgraph.nn.prune`).

**Which factor is variational.** We follow BLoB (Wang, Shi, Han, Metaxas and Wang, "BLoB: Bayesian
Low-Rank Adaptation by Backpropagation for Large Language Models", NeurIPS 2024): ``A`` carries the
posterior, ``B`` is a point estimate initialised to 0. Three reasons:

* with ``B`` fixed, :math:`\\Delta W = BA` is linear in ``A``, so a Gaussian ``q(A)`` is a Gaussian
  posterior over the full update, :math:`\\operatorname{vec}(\\Delta W) \\sim
  \\mathcal N\\big(\\operatorname{vec}(B M_A),\\,
  (I \\otimes B)\\,\\operatorname{diag}(\\sigma_A^2)\\,(I \\otimes B^\\top)\\big)`,
  a low-rank, correlated covariance on the weight at the cost of mean-field parameters on ``A``
  (``vec`` stacks columns);
  a product of two random factors is not Gaussian, and its variance carries the cross term σ_A²σ_B²;
* ``B = 0`` at initialisation makes every *sample* of ΔW zero, not only its mean, so the adapted
  network is exactly the pretrained one until training moves ``B`` (with a variational ``B`` the
  samples would perturb the pretrained function before any data is seen);
* half the variational parameters of making both factors Bayesian.

``variational="both"`` (or ``"B"``) is available for comparison; then the mean of ΔW is 0 at
initialisation but its samples are not.

**What the prior regularises** (``prior_on``, default ``"scale"`` for the Normal and other location
priors). LoRA has a scale symmetry:
A → cA, B → B/c leaves ΔW = BA unchanged. A prior on ``A`` alone (B is a free point estimate) can
therefore always be lowered by shrinking A's mean and growing B, while it holds σ_A at the prior's
scale: the *relative* noise σ_A/|μ_A| grows until it swamps the update. Trained as a strict ELBO
(``prior_on="all"``) on a 300-example fine-tuning task, μ_A shrank 3–15× below its initial size,
‖B‖ grew to compensate, the noise of ΔW was 1.1–12× its mean and the predictive was
underconfident and 5 pp less accurate than plain LoRA (``paper_tables/lora_table``). With
``prior_on="scale"`` the KL is evaluated at the stop-gradient of A's mean (:class:`ScaleOnlyPrior`):
the same KL value, but its gradient reaches ρ only, so the means follow the data term alone and σ
settles where the data and the prior balance. That is **not a strict ELBO gradient**; it is what BLoB's training
effectively runs (its optimiser steps the means on the NLL, the KL reaches them only through a
separate small plain-SGD step). ``prior_on="all"`` restores the ELBO.

**The default prior** (``prior=None`` with a Normal posterior) is :class:`InitNormal`: N(0, s²)
with s² the variance of the factor's own initialisation, Kaiming-uniform U(±1/√fan_in), i.e.
s = 1/√(3·fan_in) (0.10 for a 32-wide layer, 0.021 for a 768-wide one): "an adapter of the
size it starts at". Under ``prior_on="scale"`` the prior's scale is where σ goes where the data
do not constrain A, so it sets the noise level; N(0, 1) would let σ grow to 1 there.

The strict ELBO with the N(0, 1) prior is ``prior="normal", prior_on="all"``.

Example:
    >>> import torch, mcgraph as mg
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    >>> lora = mg.nn.bayesian_lora(net, rank=2, alpha=4.0, prior="normal", kl_samples=8)
    >>> x = torch.randn(5, 8)
    >>> torch.equal(lora(x), net(x))                      # B = 0: exactly the pretrained network
    True
    >>> [n for n, p in lora.named_parameters() if p.requires_grad][:3]     # and the same for layer 2
    ['0.lora_A.weight_mu', '0.lora_A.weight_rho', '0.lora_B.weight']
    >>> loss = -mg.nn.elbo(lora, x, torch.tensor([0, 1, 2, 0, 1]), num_samples=16, dataset_size=100, seed=0)
    >>> loss.backward()
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributions import Cauchy, Distribution, Laplace, Normal, StudentT

from ..engine import checks
from .context import BayesianModule
from .estimator import Estimator, resolve_estimator
from .layers import BayesLinear
from .mc_dropout import MCDropout
from .module_select import selector
from .priors import layer_options, make_prior

__all__ = ["BayesLoRA", "AdapterDropout", "InitNormal", "ScaleOnlyPrior", "bayesian_lora", "is_conv1d", "adaptable",
           "VARIATIONAL_FACTORS", "PRIOR_ON"]

#: The choices of ``variational``: which LoRA factors carry a posterior.
VARIATIONAL_FACTORS = ("A", "B", "both")

#: The choices of ``prior_on``: which variational parameters the KL's gradient reaches.
PRIOR_ON = ("all", "scale")

#: Prior classes :class:`ScaleOnlyPrior` can wrap: ``cls(*args, loc, scale)`` families (a KL that depends on
#: the posterior's mean through ``μ − loc`` only).
_LOCATION_PRIORS = (Normal, Laplace, Cauchy, StudentT)


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is ``transformers``' ``Conv1D`` (GPT-2 style: ``y = x W + b``, ``W`` of shape
    ``(in, out)``), recognised by class name and module path so that ``transformers`` stays optional."""
    return any(c.__name__ == "Conv1D" and c.__module__.startswith("transformers.") for c in type(module).__mro__)


def adaptable(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a layer a LoRA adapter can wrap (``nn.Linear``, ``Conv1D``), else ``None``."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        w = module.weight
        return int(w.shape[0]), int(w.shape[1])
    return None


class AdapterDropout(MCDropout):
    """LoRA's dropout on the adapter input: active in ``train()`` mode only (as ``nn.Dropout``), and
    inside a sample run seeded per sample (as :class:`~mcgraph.nn.MCDropout`), so a ``seed`` gives the
    same ELBO and gradients for any chunk size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        return super().forward(x)


class InitNormal:
    """The default prior of :func:`bayesian_lora`'s factors: N(0, s²) with s = ``gain`` / √(3·fan_in), the
    standard deviation of the factor's Kaiming-uniform(a=√5) initialisation U(±1/√fan_in) (for A of shape
    ``(r, in)``: fan_in = in; for B: r).

    A prior factory (``like -> Normal``), usable as ``prior=`` of any Bayesian layer.

    Args:
        gain: a multiplier of the scale (default 1: the initialisation's own spread).

    Raises:
        ValueError: ``gain`` not a finite positive number.

    Example:
        >>> import torch
        >>> from mcgraph.nn.lora import InitNormal
        >>> p = InitNormal()(torch.empty(4, 48))
        >>> round(float(p.scale[0, 0]), 4), tuple(p.batch_shape)
        (0.0833, (4, 48))
    """

    def __init__(self, gain: float = 1.0) -> None:
        self.gain = checks.finite_float("gain", gain, low=0.0, low_open=True)

    def scale(self, like: torch.Tensor) -> float:
        """s for a parameter shaped like ``like`` (``(out, in)``: fan_in = in; 1-d: its length)."""
        fan_in = int(like.shape[1]) if like.dim() > 1 else int(like.shape[0])
        return self.gain / (3.0 * max(fan_in, 1)) ** 0.5

    def normal_parameters(self, like: torch.Tensor) -> tuple:
        """``(loc, scale)`` tensors of the Normal built for ``like`` (the layers' closed-form KL reads them)."""
        return (torch.zeros((), dtype=like.dtype, device=like.device),
                torch.full((), self.scale(like), dtype=like.dtype, device=like.device))

    def __call__(self, like: torch.Tensor) -> Normal:
        loc, scale = self.normal_parameters(like)
        return Normal(loc.expand(like.shape), scale.expand(like.shape))

    def __repr__(self) -> str:
        return f"InitNormal(gain={self.gain:g})"


class ScaleOnlyPrior:
    """A prior whose KL term regularises the posterior's scale only: ``prior_on="scale"``.

    Called with a parameter ``like`` (a layer builds its prior from its mean, ``prior(weight_mu)``), it
    returns the wrapped prior with its location shifted by ``like − like.detach()``: a shift whose value
    is exactly 0, so the prior, the KL and the ELBO have their usual **values**, but whose gradient
    cancels the KL's gradient on μ. For a posterior and prior of location families the KL depends on
    μ only through ``μ − loc``, so the KL is KL(q(sg μ, σ) ‖ p) and its gradient reaches σ (ρ) only
    (on μ it is 0, up to rounding in the sampled tiers), in every path that computes it: the closed
    form, the Monte Carlo tiers and ``return_stderr``. The means then follow the data term alone.
    **Not a strict ELBO gradient** (see :mod:`mcgraph.nn.lora` for why :func:`bayesian_lora` uses it
    by default).

    Args:
        prior: the prior to wrap: a name (``"normal"``), a ``Normal`` / ``Laplace`` / ``Cauchy`` / ``StudentT``
            instance, or a factory ``like -> Distribution`` returning one of those (:class:`InitNormal`).

    Raises:
        ValueError: (when called) the prior is not of a location family listed above.
    """

    def __init__(self, prior) -> None:
        if isinstance(prior, ScaleOnlyPrior):
            prior = prior.prior
        self.prior = prior

    def _shift(self, like: torch.Tensor) -> torch.Tensor:
        return like - like.detach()  # 0 in value; d/dμ = 1

    def normal_parameters(self, like: torch.Tensor) -> tuple | None:
        """``(loc, scale)`` of the Normal built for ``like`` (the layers' closed-form KL reads them), or
        ``None`` when the wrapped prior is not a Normal."""
        from .layer_kl import _normal_prior_numbers

        numbers = _normal_prior_numbers(self.prior, like)
        if numbers is None:
            return None
        loc, scale = numbers
        if scale is None:  # N(0, 1)
            scale = torch.ones((), dtype=like.dtype, device=like.device)
        shift = self._shift(like)
        return (shift if loc is None else loc + shift), scale

    def __call__(self, like: torch.Tensor) -> Distribution:
        p = make_prior(self.prior, like, validate=False)
        if type(p) not in _LOCATION_PRIORS:
            families = ", ".join(c.__name__ for c in _LOCATION_PRIORS)
            raise ValueError(f"prior_on='scale' needs a prior of a location family ({families}), got "
                             f"{type(p).__name__}; pass prior_on='all'")
        shift = self._shift(like)
        if type(p) is StudentT:
            return StudentT(p.df, p.loc + shift, p.scale, validate_args=False)
        return type(p)(p.loc + shift, p.scale, validate_args=False)

    def __repr__(self) -> str:
        return f"ScaleOnlyPrior({self.prior!r})"


def _check_prior_on(prior_on) -> str | None:
    if prior_on is not None and (not isinstance(prior_on, str) or prior_on not in PRIOR_ON):
        raise ValueError(f"prior_on must be one of {PRIOR_ON} or None, got {prior_on!r}")
    return prior_on


def _resolve_prior_on(prior_on: str | None, prior, like: torch.Tensor) -> str:
    """``prior_on`` with ``None`` filled in: ``"scale"`` for a prior of a location family, else ``"all"``."""
    if prior_on is not None:
        return prior_on
    try:
        with torch.no_grad():
            p = make_prior(prior, like, validate=False)
    except Exception:  # noqa: BLE001 — a prior that does not build: the layer's own check reports it
        return "all"
    return "scale" if type(p) in _LOCATION_PRIORS else "all"


def _factor_dtype(factor: nn.Module) -> torch.dtype:
    return (factor.weight_mu if isinstance(factor, BayesLinear) else factor.weight).dtype


def _keeps_torch_fused_paths_off(module: nn.Module, args) -> None:
    """A forward pre-hook that changes nothing: its presence turns torch's fused encoder path off."""
    return None


class BayesLoRA(nn.Module):
    """A frozen layer plus a low-rank update: ``base_layer(x) + lora_B(lora_A(lora_dropout(x))) · scaling``.

    The attribute names and the order of operations are peft's (``peft.tuners.lora.Linear``), so a
    converted peft layer computes what peft computes (:mod:`mcgraph.interop.peft`).

    Args:
        base_layer: the pretrained layer (``nn.Linear`` or ``Conv1D``), called as it is.
        lora_A: ``(in → r)`` factor: a :class:`~mcgraph.nn.BayesLinear` site or an ``nn.Linear``, no bias.
        lora_B: ``(r → out)`` factor, likewise (it may have a bias, as peft's ``lora_bias``).
        scaling: α / r.
        lora_dropout: a module applied to the adapter's input (default: none).

    Shape:
        Input ``(N, *, in_features)``; output ``(N, *, out_features)``.

    Attributes:
        rank: r, the factors' inner dimension.
        in_features, out_features: the base layer's (for ``Conv1D``: ``weight.shape``).
        scaling: α / r.
    """

    def __init__(self, base_layer: nn.Module, lora_A: nn.Module, lora_B: nn.Module, scaling: float,
                 lora_dropout: nn.Module | None = None) -> None:
        super().__init__()
        shape = adaptable(base_layer)
        if shape is None:
            raise TypeError(f"base_layer must be an nn.Linear or a transformers Conv1D, "
                            f"got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.lora_A = lora_A
        self.lora_B = lora_B
        self.lora_dropout = nn.Identity() if lora_dropout is None else lora_dropout
        self.scaling = float(scaling)
        self.in_features, self.out_features = shape
        self.rank = int((lora_A.weight_mu if isinstance(lora_A, BayesLinear) else lora_A.weight).shape[0])
        # torch's fused inference path of nn.TransformerEncoderLayer reads linear1.weight / linear2.weight
        # (here: the frozen base weight) instead of calling the layer; it declines any layer holding a module
        # with a forward hook, so this no-op hook keeps the adapter in the computation.
        self.register_forward_pre_hook(_keeps_torch_fused_paths_off)

    @property
    def weight(self) -> torch.Tensor:
        """The pretrained weight (``base_layer.weight``: code that reads a layer's weight, tied embeddings)."""
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        """The pretrained bias (``base_layer.bias``)."""
        return self.base_layer.bias

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        dtype = result.dtype
        a_dtype = _factor_dtype(self.lora_A)
        if x.dtype != a_dtype:
            x = x.to(a_dtype)
        result = result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        return result.to(dtype)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """ΔW = scaling · B A at the factors' means, shaped like ``base_layer.weight`` (``(out, in)``;
        ``(in, out)`` for ``Conv1D``)."""
        a = self.lora_A.weight_mu if isinstance(self.lora_A, BayesLinear) else self.lora_A.weight
        b = self.lora_B.weight_mu if isinstance(self.lora_B, BayesLinear) else self.lora_B.weight
        delta = (b @ a) * self.scaling
        return delta.T if is_conv1d(self.base_layer) else delta

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scaling={self.scaling:g}"


def _factor(in_f: int, out_f: int, variational: bool, zero: bool, options: dict, like: torch.Tensor) -> nn.Module:
    """One LoRA factor: a Bayesian site or an ``nn.Linear`` (no bias); μ (weight) zero or peft's Kaiming-uniform."""
    fk = {"device": like.device, "dtype": like.dtype if like.is_floating_point() else None}
    if variational:
        factor = BayesLinear(in_f, out_f, bias=False, **options, **fk)
        if zero:
            with torch.no_grad():
                factor.weight_mu.zero_()
        return factor
    factor = nn.Linear(in_f, out_f, bias=False, **fk)  # Kaiming-uniform(a=√5), as peft initialises lora_A
    if zero:
        nn.init.zeros_(factor.weight)
    return factor


def _candidates(model: nn.Module):
    """``(name, parent, child name, module)`` of every adaptable layer, outside Bayesian layers, existing
    adapters and ``nn.MultiheadAttention`` (whose forward reads ``out_proj.weight`` without calling it)."""
    out = []

    def walk(parent: nn.Module, prefix: str) -> None:
        for child_name, child in parent.named_children():
            full = f"{prefix}.{child_name}" if prefix else child_name
            if isinstance(child, (BayesianModule, BayesLoRA, nn.MultiheadAttention)):
                continue
            if adaptable(child) is not None:
                out.append((full, parent, child_name, child))
                continue
            walk(child, full)

    if adaptable(model) is not None:
        return [("", None, "", model)]
    walk(model, "")
    return out


def _check_variational(variational) -> str:
    if variational not in VARIATIONAL_FACTORS:
        raise ValueError(f"variational must be one of {VARIATIONAL_FACTORS}, got {variational!r}")
    return variational


def _check_dropout(dropout) -> float:
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"dropout must be a real number in [0, 1), got {type(dropout).__name__} ({dropout!r})")
    if not (0.0 <= float(dropout) < 1.0):
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    return float(dropout)


def _check_rank(rank: int, name: str, layer: nn.Module) -> None:
    in_f, out_f = adaptable(layer)
    if rank > min(in_f, out_f):
        raise ValueError(f"rank={rank} is larger than the layer {name or type(layer).__name__!r} allows: "
                         f"min(in_features, out_features) = min({in_f}, {out_f}) = {min(in_f, out_f)}; choose a "
                         f"smaller rank or leave the layer out with targets=")


def make_adapter(base_layer: nn.Module, rank: int, *, alpha: float | None = None, dropout: float = 0.0,
                 variational: str = "A", name: str = "", **options) -> BayesLoRA:
    """A :class:`BayesLoRA` around ``base_layer`` (A: Kaiming-uniform mean, B: 0; see :func:`bayesian_lora`;
    ``options`` are the variational factors' :class:`~mcgraph.nn.BayesLayer` options, taken as given: the
    defaults of :func:`bayesian_lora` (its prior, ``prior_on``) are not filled in here).

    Raises:
        ValueError: ``rank`` larger than ``min(in_features, out_features)`` of the layer (``name`` in the message).
    """
    shape = adaptable(base_layer)
    if shape is None:
        raise TypeError(f"base_layer must be an nn.Linear or a transformers Conv1D, got {type(base_layer).__name__}")
    in_f, out_f = shape
    _check_rank(rank, name, base_layer)
    scaling = (rank if alpha is None else alpha) / rank
    like = base_layer.weight
    a = _factor(in_f, rank, variational in ("A", "both"), False, options, like)
    b = _factor(rank, out_f, variational in ("B", "both"), True, options, like)
    drop = AdapterDropout(dropout) if dropout > 0 else None
    return BayesLoRA(base_layer, a, b, scaling, drop)


def bayesian_lora(model: nn.Module, rank: int, *, targets=None, alpha: float | None = None, dropout: float = 0.0,
                  posterior="normal", prior=None, prior_on: str | None = None, kl_samples: int = 1,
                  variational: str = "A", estimator: str | Estimator | None = None, rho_init: float | None = None,
                  scale_transform=None, trainable=None, inplace: bool = False,
                  local_reparameterization: bool | None = None, flipout: bool | None = None) -> nn.Module:
    """Variational LoRA: a Bayesian low-rank update ``(α/r)·B·A`` on each targeted layer of a frozen model.

    .. math::
        W = W_0 + \\frac{\\alpha}{r} B A, \\qquad q(A) = \\prod_{ij} q(A_{ij}), \\quad
        KL = \\sum_{\\text{adapters}} KL\\big(q(A)\\,\\|\\,p(A)\\big)

    ``W_0`` (every pretrained Parameter of ``model``) is frozen and never written; ``A`` has a mean-field
    posterior of family ``posterior`` and the prior ``prior``; ``B`` is a point estimate initialised to 0,
    so the adapted model's output at initialisation equals the pretrained model's exactly, for every
    weight sample (BLoB, Wang et al., 2024; why, in :mod:`mcgraph.nn.lora`). Train with
    :func:`~mcgraph.nn.elbo` (its KL is the adapters' only), predict with :func:`~mcgraph.nn.predict`.

    Args:
        model: any ``nn.Module`` holding ``nn.Linear`` layers or ``transformers`` ``Conv1D`` layers (GPT-2's
            attention and MLP projections; their ``(in, out)`` weight layout is handled). A transformers
            model built from a config or loaded with ``from_pretrained`` works as it is.
        rank: r ≥ 1, at most ``min(in_features, out_features)`` of every targeted layer.
        targets: which layers get an adapter: qualified module names, ``fnmatch`` patterns
            (``"transformer.h.*.attn.c_attn"``) or module types, as :func:`~mcgraph.nn.bayesify`'s ``only``;
            a layer is adapted when it or a module containing it is selected. ``None`` (default): every
            ``nn.Linear`` and ``Conv1D`` (except inside ``nn.MultiheadAttention``, whose forward reads
            its weights directly).
        alpha: α of the scaling α / r (default: r, i.e. scaling 1, peft's default with ``lora_alpha = r``).
        dropout: LoRA dropout on the adapter's input in [0, 1), in ``train()`` mode only (seeded per sample
            inside sample runs).
        posterior, kl_samples, estimator, rho_init, scale_transform: the options of
            :class:`~mcgraph.nn.BayesLayer` for the variational factor(s) (``None``: the posterior family's
            default, else ``"reparameterization"``, −5, ``"softplus"``).
        local_reparameterization, flipout: the deprecated spelling of ``estimator`` (warns).
        prior: the factors' prior, as :class:`~mcgraph.nn.BayesLayer`'s ``prior=``. ``None`` (default):
            the posterior family's default prior (``"sparse_vd"``: log-uniform), and where that is the
            Normal, :class:`InitNormal`: N(0, 1/(3·fan_in)), the spread of the factor's initialisation.
            ``"normal"`` is N(0, 1).
        prior_on: what the KL regularises: ``"scale"`` evaluates each factor's KL at the stop-gradient
            of its mean (:class:`ScaleOnlyPrior`), so the prior's gradient reaches ρ only and the means
            follow the data term (not a strict ELBO gradient; BLoB's effective training; the KL's value is
            unchanged); ``"all"``: the ELBO's KL, whose gradient also pulls the means to the prior's.
            ``None`` (default): ``"scale"`` where the prior is of a location family (Normal, Laplace,
            Cauchy, Student-t: every default but ``"sparse_vd"``'s), else ``"all"`` (a log-uniform prior's
            KL acts through the means by design). Why ``"scale"``: the module's doc and
            ``docs/pretrained.md``.
        variational: ``"A"`` (default, BLoB), ``"B"`` or ``"both"``: the factors with a posterior; the
            others are deterministic ``nn.Linear`` factors. A variational ``B`` has mean 0 at
            initialisation but non-zero samples.
        trainable: modules whose Parameters stay trainable besides the adapters (a new classification
            head, a LayerNorm), selected like ``targets``; by default every non-adapter Parameter is frozen.
        inplace: adapt ``model`` itself; by default a deep copy is adapted and ``model`` is left as it is.

    Returns:
        The adapted model: each targeted layer replaced by a :class:`BayesLoRA` holding it as ``base_layer``.

    Raises:
        TypeError: ``model`` is not a module; ``rank``, ``dropout`` or an entry of ``targets`` of the wrong type.
        ValueError: ``rank`` ≤ 0 or larger than ``min(in_features, out_features)`` of a targeted layer;
            ``targets`` (or ``trainable``) naming no module or selecting no ``Linear`` / ``Conv1D`` layer;
            ``model`` without any ``Linear`` / ``Conv1D`` layer; ``alpha`` not a finite positive number;
            ``dropout`` outside [0, 1); ``variational`` not one of ``"A"``, ``"B"``, ``"both"``;
            ``prior_on`` not one of ``"all"``, ``"scale"``, ``None``, or ``"scale"`` with a prior that is
            not of a location family.

    Example:
        >>> import torch, mcgraph as mg
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0,
        ...                     eos_token_id=0)
        >>> gpt = GPT2LMHeadModel(config).eval()              # eval(): GPT-2's own dropout off
        >>> lora = mg.nn.bayesian_lora(gpt, rank=4, targets="transformer.h.*.attn.c_attn", kl_samples=8)
        >>> type(lora.transformer.h[0].attn.c_attn).__name__, len(mg.nn.bayesian_modules(lora))
        ('BayesLoRA', 2)
        >>> ids = torch.randint(0, 50, (2, 7))
        >>> torch.equal(lora(ids).logits, gpt(ids).logits)
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    rank = checks.positive_int("rank", rank)
    if alpha is not None:
        alpha = checks.finite_float("alpha", alpha, low=0.0, low_open=True)
    dropout = _check_dropout(dropout)
    variational = _check_variational(variational)
    prior_on = _check_prior_on(prior_on)
    if prior is None and layer_options(posterior)[0] == "normal":
        prior = InitNormal()
    names = {name for name, _ in model.named_modules()}
    selected = selector(targets, names, "targets")
    keep = selector(trainable, names, "trainable")
    found = _candidates(model)
    if not found:
        raise ValueError(f"model: {type(model).__name__} has no nn.Linear or transformers Conv1D layer to adapt "
                         f"(outside Bayesian layers, existing adapters and nn.MultiheadAttention)")
    if selected is not None:
        chosen = set()
        for name, module in model.named_modules():
            if selected(name, module):
                chosen.add(name)
        found = [c for c in found if any(c[0] == s or c[0].startswith(s + ".") or s == "" for s in chosen)]
        if not found:
            raise ValueError(f"targets: {targets!r} selects no nn.Linear or transformers Conv1D layer of the model "
                             f"(outside nn.MultiheadAttention and existing adapters)")
    for name, _, _, module in found:  # every rank checked before anything changes
        _check_rank(rank, name, module)
    like = torch.zeros(rank, adaptable(found[0][3])[0])
    prior_on = _resolve_prior_on(prior_on, layer_options(posterior, prior)[0], like)
    if prior_on == "scale":
        prior = ScaleOnlyPrior(layer_options(posterior, prior)[0])
        ScaleOnlyPrior(prior)(like)  # a prior of another family: the error names prior_on
    estimator = resolve_estimator(estimator, local_reparameterization, flipout)
    options = dict(posterior=posterior, prior=prior, kl_samples=kl_samples, estimator=estimator, rho_init=rho_init,
                   scale_transform=scale_transform)
    if not inplace:
        wanted = {c[0] for c in found}
        model = copy.deepcopy(model)
        found = [c for c in _candidates(model) if c[0] in wanted]
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = {name: make_adapter(module, rank, alpha=alpha, dropout=dropout, variational=variational, name=name,
                                   **options) for name, _, _, module in found}
    if "" in adapters:
        model = adapters[""]
    for name, parent, child_name, _ in found:
        if parent is not None:
            setattr(parent, child_name, adapters[name])
    for module in model.modules():  # the nested-tensor encoder path would also run the fused layers
        if isinstance(module, nn.TransformerEncoder) and any(isinstance(m, BayesLoRA) for m in module.modules()):
            module.use_nested_tensor = False
    if keep is not None:
        for name, module in model.named_modules():
            if keep(name, module):
                for p in module.parameters():
                    p.requires_grad_(True)
    return model
