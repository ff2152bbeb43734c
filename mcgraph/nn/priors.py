"""Posterior families and priors of Bayesian layers, chosen by name or given directly.

A **posterior** is a callable ``(loc, scale) -> Distribution`` over one weight
tensor: a ``torch.distributions`` class such as ``torch.distributions.Laplace``,
``mcgraph.distributions.Radial`` (event = the whole tensor), a
``functools.partial(StudentT, 3.0)``, or a key of :data:`POSTERIORS`. Its
``scale`` is ``σ = softplus(ρ)``; every family the engine registers
(``mcgraph.FAMILIES``) gets the collapsed/fused KL tiers, any other family with
``rsample`` the chunked one.

A **prior** is a ``Distribution`` instance (scalar parameters broadcast to the
weight shape), a factory ``like -> Distribution`` called with the weight tensor
(so it can match device, dtype and shape), or a key of :data:`PRIORS`.

Adding a named family is one registration (a ``validate_args`` keyword, passed on to the distribution,
lets a layer build it without torch's constructor checks on every forward)::

    @mg.nn.register_prior("wide_normal")
    def _wide(like, scale=10.0, validate_args=None):
        return torch.distributions.Normal(like.new_zeros(()), like.new_tensor(scale), validate_args=validate_args)

Example:
    >>> import torch, mcgraph as mg
    >>> w = torch.zeros(3, 2)
    >>> mg.nn.make_prior("scale_mixture", w).batch_shape     # scalar parameters, broadcast to w
    torch.Size([])
    >>> sorted(mg.nn.POSTERIORS)[:3]
    ['gaussian', 'laplace', 'logistic']
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.distributions import Distribution, Laplace, LogNormal, Normal, StudentT

from ..registry import Registry
from ..engine.shapes import broadcast_shapes
from ..distributions import Horseshoe, Logistic, LogUniform, Radial, ScaleMixtureNormal

__all__ = ["POSTERIORS", "PRIORS", "register_posterior", "register_prior", "resolve_posterior",
           "make_prior", "layer_options", "LAYER_DEFAULTS", "unchecked"]

PosteriorFactory = Callable[[torch.Tensor, torch.Tensor], Distribution]
PriorFactory = Callable[..., Distribution]

POSTERIORS: Registry = Registry("posterior")
"""Named posterior families: ``name -> (loc, scale) -> Distribution``."""

PRIORS: Registry = Registry("prior")
"""Named priors: ``name -> (like, **params) -> Distribution`` with scalar parameters."""


def register_posterior(name: str):
    """Register ``factory(loc, scale) -> Distribution`` under ``name`` (decorator or call)."""
    return POSTERIORS.register(name)


def register_prior(name: str):
    """Register ``factory(like, **params) -> Distribution`` under ``name`` (decorator or call)."""
    return PRIORS.register(name)


register_posterior("normal")(Normal)
register_posterior("gaussian")(Normal)  # the same alias as the priors'
register_posterior("radial")(Radial)
register_posterior("laplace")(Laplace)
register_posterior("lognormal")(LogNormal)
register_posterior("logistic")(Logistic)


def _scalar(like: torch.Tensor, value) -> torch.Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)


@register_prior("normal")
def _normal_prior(like, scale: float = 1.0, loc: float = 0.0, validate_args=None):
    return Normal(_scalar(like, loc), _scalar(like, scale), validate_args=validate_args)


register_prior("gaussian")(_normal_prior)  # the same alias as the posteriors'


@register_prior("scale_mixture")
def _scale_mixture_prior(like, pi: float = 0.5, scale1: float = 1.0, scale2: float = math.exp(-6.0),
                         validate_args=None):
    """Blundell et al. (2015): π N(0, σ1²) + (1 − π) N(0, σ2²), defaults π = ½, −log σ1 = 0, −log σ2 = 6."""
    return ScaleMixtureNormal(_scalar(like, pi), _scalar(like, scale1), _scalar(like, scale2),
                              validate_args=validate_args)


@register_prior("laplace")
def _laplace_prior(like, scale: float = 1.0, loc: float = 0.0, validate_args=None):
    return Laplace(_scalar(like, loc), _scalar(like, scale), validate_args=validate_args)


@register_prior("student_t")
def _student_t_prior(like, df: float = 3.0, scale: float = 1.0, loc: float = 0.0, validate_args=None):
    return StudentT(_scalar(like, df), _scalar(like, loc), _scalar(like, scale), validate_args=validate_args)


@register_prior("log_uniform")
def _log_uniform_prior(like, validate_args=None):
    """The improper p(w) ∝ 1/|w| (its KL is defined up to a constant)."""
    return LogUniform(validate_args=validate_args)


@register_prior("horseshoe")
def _horseshoe_prior(like, scale: float = 1.0, loc: float = 0.0, validate_args=None):
    return Horseshoe(_scalar(like, loc), _scalar(like, scale), validate_args=validate_args)


def resolve_posterior(posterior) -> PosteriorFactory:
    """A posterior factory from a name or a callable.

    Raises:
        ValueError: unknown name.
        TypeError: neither a string nor a callable.
    """
    if isinstance(posterior, str):
        try:
            return POSTERIORS[posterior.lower()]
        except KeyError:
            raise ValueError(f"posterior must be one of {sorted(POSTERIORS)} or a callable "
                             f"(loc, scale) -> Distribution, got {posterior!r}") from None
    if isinstance(posterior, Distribution):
        raise TypeError("posterior must be a family (a callable (loc, scale) -> Distribution such as "
                        f"torch.distributions.Normal), not a distribution instance ({type(posterior).__name__})")
    if not callable(posterior):
        raise TypeError(f"posterior must be a name or a callable (loc, scale) -> Distribution, "
                        f"got {type(posterior).__name__}")
    return posterior


def unchecked(factory: Callable[..., Distribution], *args, **kwargs) -> Distribution:
    """``factory(*args, **kwargs)`` built without torch's constructor checks of its parameters (one host
    synchronisation each), passing ``validate_args=False`` to this construction only: the instance (and
    its base distributions) then follow torch's default for validating ``log_prob``, as if built plainly.
    A factory that takes no ``validate_args`` is called as it is (checked). No class attribute is touched.
    """
    try:
        dist = factory(*args, validate_args=False, **kwargs)
    except TypeError:
        return factory(*args, **kwargs)
    inner = dist
    while isinstance(inner, Distribution):
        inner.__dict__.pop("_validate_args", None)
        inner = getattr(inner, "base_dist", None)
    return dist


def make_prior(prior, like: torch.Tensor, *, validate: bool = True) -> Distribution:
    """The prior distribution for a parameter shaped like ``like``.

    Args:
        prior: a ``Distribution`` (returned as is), a name of :data:`PRIORS` (default
            parameters), or a factory ``like -> Distribution``.
        like: the parameter (device, dtype and shape to match).
        validate: ``False`` builds a *named* prior without torch's constructor checks (its
            parameters are fixed defaults, checked when the layer was built; ``log_prob`` still
            validates its argument as torch's default says); factories and instances are unaffected.

    Raises:
        ValueError: unknown name, or the prior's shape does not broadcast with ``like``.
        TypeError: a factory that does not return a ``Distribution``.
    """
    if isinstance(prior, Distribution):
        dist = prior
    elif isinstance(prior, str):
        try:
            factory = PRIORS[prior.lower()]
        except KeyError:
            raise ValueError(f"prior must be one of {sorted(PRIORS)}, a Distribution or a factory "
                             f"like -> Distribution, got {prior!r}") from None
        dist = factory(like) if validate else unchecked(factory, like)
    elif callable(prior):
        dist = prior(like)
        if not isinstance(dist, Distribution):
            raise TypeError(f"prior: the factory returned {type(dist).__name__}, expected a Distribution")
    else:
        raise TypeError(f"prior must be a Distribution, a name or a factory, got {type(prior).__name__}")
    shape = dist.batch_shape + dist.event_shape
    try:
        broadcast_shapes(shape, like.shape)
    except RuntimeError:
        raise ValueError(f"prior: shape {tuple(shape)} does not broadcast with the parameter shape "
                         f"{tuple(like.shape)}") from None
    return dist


#: The options a Bayesian layer takes when neither the call nor the posterior family sets them.
LAYER_DEFAULTS = {"prior": "normal", "local_reparameterization": False, "rho_init": -5.0,
                  "scale_transform": "softplus"}


def layer_options(posterior, prior=None, local_reparameterization=None, rho_init=None, scale_transform=None, *,
                  flipout: bool = False):
    """``(prior, local_reparameterization, rho_init, scale_transform)`` with every ``None`` filled in.

    A posterior family may carry ``layer_defaults`` (a dict with some of the keys of
    :data:`LAYER_DEFAULTS`): sparse variational dropout trains ρ = log σ² with local
    reparameterization under a log-uniform prior. What the caller gives wins; then the
    family's defaults; then :data:`LAYER_DEFAULTS`. An explicit ``flipout=True`` turns a family's default
    local reparameterization off (they are alternatives).
    """
    family = getattr(resolve_posterior(posterior), "layer_defaults", None) or {}
    given = {"prior": prior, "local_reparameterization": local_reparameterization, "rho_init": rho_init,
             "scale_transform": scale_transform}
    if flipout and local_reparameterization is None:
        given["local_reparameterization"] = False
    out = {k: v if v is not None else family.get(k, LAYER_DEFAULTS[k]) for k, v in given.items()}
    return out["prior"], out["local_reparameterization"], out["rho_init"], out["scale_transform"]
