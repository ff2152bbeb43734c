"""Family registry: distribution class → sampling form ``w = T(loc + scale · ξ)``.

A *sampling form* says how a reparameterised draw is built from parameters θ
and standard noise ξ (paper §4, Thm 1–2):

* location-scale: ``w = μ + σ ξ`` (Normal, Laplace, Radial, …);
* scaling: ``w = θ ξ`` with ``ξ > 0`` (Exponential, Gamma with fixed shape, …);
* transformed: an elementwise transform ``T`` on top (LogNormal = exp of a
  location-scale draw, Cor. 1–2).

A distribution whose parameters cannot all be moved out of the noise (a Gamma
concentration that requires grad, say) gets a :class:`GenericForm`, which draws
with ``dist.rsample`` and sends every term to the chunked tier.

Adding a family is one rule plus one registration::

    @mg.register_family(MyDist)
    def _my_dist(d):
        return SamplingForm(noise=STANDARD_NORMAL, loc=d.loc, scale=d.scale, shape=d.batch_shape)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch.distributions import (
    AffineTransform,
    Cauchy,
    Distribution,
    ExpTransform,
    Exponential,
    Gamma,
    Gumbel,
    HalfCauchy,
    HalfNormal,
    Independent,
    InverseGamma,
    Laplace,
    LogNormal,
    Normal,
    StudentT,
    Transform,
    TransformedDistribution,
    Uniform,
    Weibull,
)

from ..noise import laws as nz
from ...registry import Registry
from ...distributions import Logistic, Radial, Rayleigh


@dataclass(frozen=True, eq=False)
class SamplingForm:
    """``w = T(loc + scale · ξ)``, ξ drawn from ``noise`` with shape ``noise_shape``.

    Attributes:
        noise: the law of ξ.
        scale: σ (location-scale) or θ (scaling); broadcastable to ``shape``.
        loc: μ, or ``None`` for a scaling form.
        shape: the shape of one sample ``w`` (``batch_shape + event_shape``).
        noise_shape: the shape of one draw of ξ (broadcast against loc/scale).
        transforms: elementwise transforms applied after the affine base.
        name: the family's name, for ``explain``.
    """

    noise: nz.NoiseLaw
    scale: torch.Tensor
    loc: torch.Tensor | None
    shape: torch.Size
    noise_shape: torch.Size | None = None
    transforms: tuple = ()
    name: str = ""

    def __post_init__(self):
        if self.noise_shape is None:
            object.__setattr__(self, "noise_shape", torch.Size(self.shape))

    @property
    def is_scaling(self) -> bool:
        return self.loc is None

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.loc, self.scale) if t is not None)

    @property
    def dtype(self) -> torch.dtype:
        return self.scale.dtype

    @property
    def device(self) -> torch.device:
        return self.scale.device

    def draw_noise(self, n: int, out: torch.Tensor | None = None, work=None) -> torch.Tensor:
        """n draws of ξ, shape ``(n, *noise_shape)`` (global RNG: call inside ``seeded``).

        ``out`` and ``work`` (a :class:`mcgraph.engine.noise.streams.Workspace`) only say where the draw is
        written (see :meth:`mcgraph.engine.noise.laws.NoiseLaw.sample`); the values are the same.
        """
        return self.noise.sample((n,) + tuple(self.noise_shape), self.dtype, self.device, out=out, work=work)

    def base(self, xi: torch.Tensor, loc=None, scale=None) -> torch.Tensor:
        """``u = loc + scale · ξ`` (or ``scale · ξ``), optionally with substitute parameters."""
        loc = self.loc if loc is None else loc
        scale = self.scale if scale is None else scale
        u = scale * xi
        return u if self.loc is None else loc + u

    def apply_transforms(self, u: torch.Tensor) -> torch.Tensor:
        for t in self.transforms:
            u = t(u)
        return u

    def sample(self, xi: torch.Tensor) -> torch.Tensor:
        """``w`` for the noise rows ``xi``, shape ``(n, *shape)``.

        One row is computed without the sample axis and given it as a view: the same numbers, and
        the gradients of loc and scale need no reduction over a broadcast axis of size 1.
        """
        if xi.shape[0] == 1:
            w = self.apply_transforms(self.base(xi[0]))
            w = w.expand(self.shape) if w.shape != self.shape else w
            return w.unsqueeze(0)
        w = self.apply_transforms(self.base(xi))
        return w.expand((xi.shape[0],) + tuple(self.shape)) if w.shape[1:] != self.shape else w

    def describe(self) -> str:
        base = "θ·ξ" if self.is_scaling else "μ + σ·ξ"
        for t in self.transforms:
            base = f"{type(t).__name__.replace('Transform', '').lower()}({base})"
        return f"{self.name}: w = {base}, ξ ~ {self.noise}"


@dataclass(frozen=True, eq=False)
class GenericForm:
    """Draw with ``dist.rsample`` (no collapsible structure); every term goes chunked.

    Attributes:
        dist: the distribution.
        reason: why no sampling form applies.
    """

    dist: Distribution
    reason: str
    name: str = ""
    shape: torch.Size = field(default_factory=torch.Size)

    @property
    def dtype(self) -> torch.dtype:
        return _dtype_of(self.dist)

    @property
    def device(self) -> torch.device:
        return _device_of(self.dist)

    def draw(self, n: int) -> torch.Tensor:
        return self.dist.rsample((n,))

    def describe(self) -> str:
        return f"{self.name}: w = rsample() (generic: {self.reason})"


# --------------------------------------------------------------------------- registry


def _check_distribution_type(t) -> None:
    if not (isinstance(t, type) and issubclass(t, Distribution)):
        raise TypeError(f"register_family expects Distribution subclasses, got {t!r}")


#: Distribution class -> rule ``dist -> SamplingForm | GenericForm``; the most specific class in a
#: distribution's MRO wins, like ``torch.distributions.kl.register_kl``.
FAMILIES: Registry = Registry("sampling family", by_type=True, check=_check_distribution_type)


def register_family(*types: type):
    """Register ``rule(dist) -> SamplingForm | GenericForm`` for ``types``: a decorator
    (``@register_family(Normal)``) or a call (``register_family(Normal)(rule)``)."""
    for t in types:
        _check_distribution_type(t)

    def decorator(rule):
        for t in types:
            FAMILIES.register(t, rule)
        return rule

    return decorator


def family_of(dist) -> SamplingForm | GenericForm:
    """The sampling form of ``dist``.

    Raises:
        TypeError: ``dist`` is not a ``torch.distributions.Distribution``.
        NotImplementedError: no family is registered and ``dist`` has no ``rsample``.
    """
    if not isinstance(dist, Distribution):
        raise TypeError(f"dist must be a torch.distributions.Distribution, got {type(dist).__name__}")
    rule = FAMILIES.lookup(type(dist), None)
    form = rule(dist) if rule is not None else None
    if form is None:
        if not dist.has_rsample:
            raise NotImplementedError(
                f"dist: no sampling family is registered for {type(dist).__name__} and it has no "
                f"rsample; register one with mcgraph.register_family({type(dist).__name__})")
        form = GenericForm(dist, f"no sampling family registered for {type(dist).__name__}")
    if isinstance(form, GenericForm) and not dist.has_rsample:
        raise NotImplementedError(f"dist: {type(dist).__name__} cannot be reparameterised ({form.reason})")
    shape = dist.batch_shape + dist.event_shape
    if form.name and form.shape == shape:
        return form
    return dataclasses.replace(form, name=form.name or type(dist).__name__, shape=torch.Size(shape))


def _dtype_of(dist: Distribution) -> torch.dtype:
    for t in _tensor_params(dist):
        if t.is_floating_point():
            return t.dtype
    return torch.get_default_dtype()


def _device_of(dist: Distribution) -> torch.device:
    for t in _tensor_params(dist):
        return t.device
    return torch.device("cpu")


def _tensor_params(dist: Distribution):
    """The tensor parameters of ``dist`` (through ``Independent`` and transforms).

    Stored parameters first; then those a distribution exposes as properties over another
    distribution (``Beta``'s concentrations live in its inner ``Dirichlet``), read only when no
    parameter is stored, so a lazily computed one (``probs`` from ``logits``) is never forced.
    """
    while isinstance(dist, (Independent, TransformedDistribution)):
        dist = dist.base_dist
    names = list(getattr(dist, "arg_constraints", {}))
    stored = [dist.__dict__[n] for n in names if isinstance(dist.__dict__.get(n), torch.Tensor)]
    if stored:
        yield from stored
        return
    for name in names:
        try:
            v = getattr(dist, name)
        except Exception:  # noqa: BLE001 — a property that cannot be read names no dtype
            continue
        if isinstance(v, torch.Tensor):
            yield v


def distribution_parameters(dist: Distribution) -> dict[str, torch.Tensor]:
    """Named tensor parameters of ``dist`` (through Independent/Transformed wrappers)."""
    out = {}
    prefix = "dist"
    while isinstance(dist, (Independent, TransformedDistribution)):
        if isinstance(dist, TransformedDistribution):
            for i, t in enumerate(dist.transforms):
                for attr in ("loc", "scale"):
                    v = getattr(t, attr, None)
                    if isinstance(v, torch.Tensor):
                        out[f"{prefix}.transforms[{i}].{attr}"] = v
        dist = dist.base_dist
        prefix += ".base_dist"
    for name in getattr(dist, "arg_constraints", {}):
        v = dist.__dict__.get(name)
        if isinstance(v, torch.Tensor):
            out[f"{prefix}.{name}"] = v
    return out


def _needs_grad(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _location_scale(noise: nz.NoiseLaw):
    def rule(d):
        return SamplingForm(noise=noise, loc=d.loc, scale=d.scale, shape=d.batch_shape, name=type(d).__name__)

    _PLAIN_LOCATION_SCALE[rule] = noise
    return rule


_PLAIN_LOCATION_SCALE: dict = {}  # rule -> noise law, for the rules that read loc and scale alone


def location_scale_form(family, loc: torch.Tensor, scale: torch.Tensor) -> SamplingForm | None:
    """``family_of(family(loc, scale))`` without building the distribution, or ``None``.

    For a class registered itself (not through a base class: a subclass may take other
    arguments) with one of the built-in location-scale rules, and ``loc`` and ``scale`` of one
    shape and dtype (the distribution would broadcast nothing): what a Bayesian layer's forward
    draws from on every call.
    """
    if not isinstance(family, type) or loc.shape != scale.shape or loc.dtype != scale.dtype:
        return None
    noise = _PLAIN_LOCATION_SCALE.get(FAMILIES.get(family))
    if noise is None:
        return None
    return SamplingForm(noise=noise, loc=loc, scale=scale, shape=loc.shape, name=family.__name__)


register_family(Normal)(_location_scale(nz.STANDARD_NORMAL))
register_family(Laplace)(_location_scale(nz.STANDARD_LAPLACE))
register_family(Cauchy)(_location_scale(nz.STANDARD_CAUCHY))
register_family(Logistic)(_location_scale(nz.STANDARD_LOGISTIC))


@register_family(Gumbel)
def _gumbel(d: Gumbel):
    return SamplingForm(noise=nz.STANDARD_GUMBEL, loc=d.loc, scale=d.scale, shape=d.batch_shape, name=type(d).__name__)


@register_family(StudentT)
def _student_t(d: StudentT):
    if _needs_grad(d.df):
        return GenericForm(d, "StudentT df requires grad: the noise law depends on it")
    return SamplingForm(noise=nz.student_t_noise(d.df), loc=d.loc, scale=d.scale, shape=d.batch_shape,
                        name=type(d).__name__)


@register_family(Uniform)
def _uniform(d: Uniform):
    return SamplingForm(noise=nz.STANDARD_UNIFORM, loc=d.low, scale=d.high - d.low, shape=d.batch_shape,
                        name=type(d).__name__)


@register_family(Radial)
def _radial(d: Radial):
    return SamplingForm(noise=nz.radial_noise_law(len(d.event_shape)), loc=d.loc, scale=d.scale,
                        shape=d.batch_shape + d.event_shape, name=type(d).__name__)


@register_family(Exponential)
def _exponential(d: Exponential):
    return SamplingForm(noise=nz.STANDARD_EXPONENTIAL, loc=None, scale=d.rate.reciprocal(), shape=d.batch_shape,
                        name=type(d).__name__)


@register_family(Gamma)
def _gamma(d: Gamma):
    if _needs_grad(d.concentration):
        return GenericForm(d, "Gamma concentration requires grad: the noise law depends on it")
    return SamplingForm(noise=nz.gamma_noise(d.concentration), loc=None, scale=d.rate.reciprocal(),
                        shape=d.batch_shape, name=type(d).__name__)


@register_family(InverseGamma)
def _inverse_gamma(d: InverseGamma):
    conc, rate = d.base_dist.concentration, d.base_dist.rate
    if _needs_grad(conc):
        return GenericForm(d, "InverseGamma concentration requires grad: the noise law depends on it")
    return SamplingForm(noise=nz.inverse_gamma_noise(conc), loc=None, scale=rate, shape=d.batch_shape,
                        name=type(d).__name__)


@register_family(Weibull)
def _weibull(d: Weibull):
    if _needs_grad(d.concentration):
        return GenericForm(d, "Weibull concentration requires grad: the noise law depends on it")
    return SamplingForm(noise=nz.weibull_noise(d.concentration), loc=None, scale=d.scale, shape=d.batch_shape,
                        name=type(d).__name__)


@register_family(HalfNormal)
def _half_normal(d: HalfNormal):
    return SamplingForm(noise=nz.STANDARD_HALF_NORMAL, loc=None, scale=d.scale, shape=d.batch_shape,
                        name=type(d).__name__)


@register_family(HalfCauchy)
def _half_cauchy(d: HalfCauchy):
    return SamplingForm(noise=nz.STANDARD_HALF_CAUCHY, loc=None, scale=d.scale, shape=d.batch_shape,
                        name=type(d).__name__)


@register_family(Rayleigh)
def _rayleigh(d: Rayleigh):
    return SamplingForm(noise=nz.STANDARD_RAYLEIGH, loc=None, scale=d.scale, shape=d.batch_shape, name=type(d).__name__)


@register_family(Independent)
def _independent(d: Independent):
    base = family_of(d.base_dist)
    if isinstance(base, GenericForm):
        return GenericForm(d, base.reason)
    return SamplingForm(noise=base.noise, loc=base.loc, scale=base.scale, shape=d.batch_shape + d.event_shape,
                        noise_shape=base.noise_shape, transforms=base.transforms,
                        name=f"Independent({base.name})")


@register_family(TransformedDistribution)
def _transformed(d: TransformedDistribution):
    """Fold affine transforms into (loc, scale); keep elementwise ones (exp, …) as ``transforms``."""
    base = family_of(d.base_dist)
    if isinstance(base, GenericForm):
        return GenericForm(d, base.reason)
    loc, scale, transforms = base.loc, base.scale, list(base.transforms)
    for t in d.transforms:
        if isinstance(t, AffineTransform) and not transforms and t.event_dim == 0:
            shift = t.loc
            scale = t.scale * scale
            if loc is not None:
                loc = shift + t.scale * loc
            elif not (isinstance(shift, (int, float)) and shift == 0):
                loc = torch.as_tensor(shift, dtype=scale.dtype, device=scale.device)
        elif _holds_grad(t):
            return GenericForm(d, f"{type(t).__name__} has parameters that require grad: a sampling form "
                                  "differentiates only its base's loc and scale")
        elif t.domain.event_dim == 0 and t.codomain.event_dim == 0 and t.bijective:
            transforms.append(t)
        else:
            return GenericForm(d, f"{type(t).__name__} is not an elementwise bijection")
    return SamplingForm(noise=base.noise, loc=loc, scale=scale, shape=d.batch_shape + d.event_shape,
                        noise_shape=base.noise_shape, transforms=tuple(transforms),
                        name=f"{type(d).__name__}({base.name})")


def _holds_grad(transform: Transform) -> bool:
    """Whether ``transform`` (or a transform inside it) keeps a tensor that requires grad."""
    stack, seen = [transform], set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                return True
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, Transform):
            stack.extend(v for k, v in vars(x).items() if k != "_cached_x_y")  # the cache holds samples
    return False


@register_family(LogNormal)
def _log_normal(d: LogNormal):
    return SamplingForm(noise=nz.STANDARD_NORMAL, loc=d.loc, scale=d.scale, shape=d.batch_shape,
                        transforms=(ExpTransform(),), name=type(d).__name__)


def is_exp(t) -> bool:
    return isinstance(t, ExpTransform)
