"""Pyro (``pip install pyro-ppl``): an ELBO whose KL terms come from mcgraph, and opt-in KL rules.

:class:`MeanFieldELBO` is a ``pyro.infer.TraceMeanField_ELBO`` that computes each latent
site's KL(q ‖ p) with :func:`site_kl`: torch's closed form where torch has a rule
(``kl_method="auto"``, the default: :func:`mcgraph.kl_divergence`'s rule, exact where exact exists),
otherwise mcgraph's ``kl_samples``-sample estimate, whose graph does not grow with the number of
samples (``kl_method="monte-carlo"`` samples every site). Where ``TraceMeanField_ELBO`` falls back to a
**one-sample** estimate (a scale-mixture, Student-t, Cauchy or log-normal prior; and Pyro's own
``AutoNormal``, whose sites are ``Delta``\\ s behind auxiliary ``<name>_unconstrained`` Normal
sites) it gets the M-sample estimate, or the exact KL: for a real-support ``AutoNormal`` site the
auxiliary Normal is taken as the site's posterior. It works with hand-written guides,
``AutoNormal``, ``AutoNormalMessenger`` (identity transforms are unwrapped) and TyXe's guides; a
site mcgraph cannot take (no ``rsample``, a constrained support behind a transform) keeps
Pyro's term, with one warning per site name. With P particles each site's KL uses P·M samples
in all. ``JitTraceMeanField_ELBO`` is not covered.

:func:`register_mc_kl` registers mcgraph's estimate with ``torch.distributions.register_kl``
for a pair torch has no rule for, so that every ``kl_divergence`` call (Pyro's ELBOs included)
uses it. The registration is global and permanent for the process; pairs that already have
a rule are refused.

Example:
    >>> import torch, pyro, pyro.distributions as dist
    >>> from pyro.infer import SVI
    >>> from pyro.infer.autoguide import AutoNormal
    >>> from mcgraph.interop.pyro import MeanFieldELBO
    >>> def model(x):
    ...     w = pyro.sample("w", dist.StudentT(3.0, 0.0, 1.0).expand([3]).to_event(1))
    ...     pyro.sample("y", dist.Normal(x @ w, 1.0).to_event(1), obs=torch.ones(4))
    >>> pyro.clear_param_store()
    >>> guide = AutoNormal(model)
    >>> svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), loss=MeanFieldELBO(kl_samples=256))
    >>> loss = svi.step(torch.randn(4, 3))       # KL(Normal ‖ StudentT) from 256 samples, not one
"""

from __future__ import annotations

import warnings

import torch
from torch.distributions import Distribution, Independent, TransformedDistribution
from torch.distributions.transforms import ComposeTransform, IndependentTransform

from ..engine import checks
from ..engine.api import kl_divergence
from ..engine.closed_form import MONTE_CARLO_RULE
from ..engine.noise.streams import mix_seed, resolve_seed
from ..engine.methods import parse_method
from . import divergence
from .sites import require

__all__ = ["MeanFieldELBO", "site_kl", "register_mc_kl"]


def _pyro():
    return require("pyro", "pyro-ppl")


def _is_identity(transform) -> bool:
    if isinstance(transform, IndependentTransform):
        return _is_identity(transform.base_transform)
    if isinstance(transform, ComposeTransform):
        return all(_is_identity(t) for t in transform.parts)
    return False


def unwrap(q: Distribution) -> Distribution:
    """``q`` without ``TransformedDistribution`` layers whose transforms are all the identity."""
    while isinstance(q, TransformedDistribution) and all(_is_identity(t) for t in q.transforms):
        base = q.base_dist
        extra = len(q.event_shape) - len(base.event_shape)
        q = Independent(base, extra) if extra > 0 else base
    return q


def site_kl(q: Distribution, p: Distribution, num_samples: int, *, seed: int | None = None,
            method: str = "auto") -> torch.Tensor:
    """KL(q ‖ p) of one Pyro site, shape ``q.batch_shape``: closed form where torch has one, else mcgraph's.

    ``q`` is unwrapped of identity transforms first (``AutoNormalMessenger``); see
    :func:`mcgraph.interop.site_kl` for the arguments.
    """
    return divergence.site_kl(unwrap(q), p, num_samples, seed=seed, method=method)


def _real_support(p: Distribution) -> bool:
    from torch.distributions import biject_to

    try:
        return _is_identity(biject_to(p.support))
    except NotImplementedError:
        return False


def _make_mean_field_elbo():
    _pyro()
    from pyro.distributions.util import scale_and_mask
    from pyro.infer import TraceMeanField_ELBO
    from pyro.infer.util import check_fully_reparametrized, is_validation_enabled, torch_item

    class MeanFieldELBO(TraceMeanField_ELBO):
        """``TraceMeanField_ELBO`` whose KL terms come from :func:`site_kl` (see :mod:`mcgraph.interop.pyro`).

        Args:
            num_particles: P, as in Pyro's ELBOs.
            kl_samples: M of each site's KL estimate (sites with a closed form ignore it).
            kl_method: ``"auto"`` (closed form where torch has one), ``"closed-form"``,
                ``"monte-carlo"`` (sampled), or an engine method forced on every site
                (:data:`mcgraph.interop.KL_METHODS`).
            seed: noise seed; ``None`` draws one per particle from torch's global generator (so
                ``pyro.set_rng_seed`` makes runs reproducible).
            **elbo_kwargs: the other arguments of ``pyro.infer.ELBO`` (``vectorize_particles``, …).
        """

        def __init__(self, num_particles: int = 1, *, kl_samples: int, kl_method: str = "auto",
                     seed: int | None = None, **elbo_kwargs) -> None:
            kl_samples = checks.positive_int("kl_samples", kl_samples)
            divergence._check_method(kl_method)
            if seed is not None:
                resolve_seed(seed)
            super().__init__(num_particles=num_particles, **elbo_kwargs)
            self.kl_samples, self.kl_method, self.seed = int(kl_samples), kl_method, seed
            self._particles = 0
            self._warned: set = set()

        def _posterior(self, name, guide_site, model_site, guide_trace):
            """q of the site, and the auxiliary site it was read from (AutoNormal), if any."""
            q = guide_site["fn"]
            aux = guide_trace.nodes.get(f"{name}_unconstrained")
            if (type(q).__name__ == "Delta" and aux is not None and aux["type"] == "sample"
                    and aux["infer"].get("is_auxiliary") and _real_support(model_site["fn"])):
                return aux["fn"], aux["name"]
            return q, None

        def _pyro_term(self, guide_site, model_site):
            # TraceMeanField_ELBO's own term: closed form, else the one-sample estimate.
            try:
                kl_qp = torch.distributions.kl_divergence(guide_site["fn"], model_site["fn"])
                kl_qp = scale_and_mask(kl_qp, scale=guide_site["scale"], mask=guide_site["mask"])
                return kl_qp.sum() if torch.is_tensor(kl_qp) else kl_qp * guide_site["fn"].batch_shape.numel()
            except NotImplementedError:
                return guide_site["score_parts"].entropy_term.sum() - model_site["log_prob_sum"]

        def _differentiable_loss_particle(self, model_trace, guide_trace):
            base = resolve_seed(None) if self.seed is None else mix_seed(self.seed, self._particles)
            self._particles += 1
            elbo_particle = 0
            consumed = set()
            for index, (name, model_site) in enumerate(model_trace.nodes.items()):
                if model_site["type"] != "sample":
                    continue
                if model_site["is_observed"]:
                    elbo_particle = elbo_particle + model_site["log_prob_sum"]
                    continue
                guide_site = guide_trace.nodes[name]
                if is_validation_enabled():
                    check_fully_reparametrized(guide_site)
                q, aux = self._posterior(name, guide_site, model_site, guide_trace)
                try:
                    kl_qp = site_kl(q, model_site["fn"], self.kl_samples, seed=mix_seed(base, index),
                                    method=self.kl_method)
                except (TypeError, ValueError, NotImplementedError) as e:
                    if name not in self._warned:
                        self._warned.add(name)
                        warnings.warn(f"MeanFieldELBO: site {name!r} keeps Pyro's KL term ({e})", stacklevel=2)
                    elbo_particle = elbo_particle - self._pyro_term(guide_site, model_site)
                    continue
                if aux is not None:
                    consumed.add(aux)
                kl_qp = scale_and_mask(kl_qp, scale=guide_site["scale"], mask=guide_site["mask"])
                elbo_particle = elbo_particle - kl_qp.sum()
            for name, guide_site in guide_trace.nodes.items():
                if guide_site["type"] == "sample" and name not in model_trace.nodes and name not in consumed:
                    if not guide_site["infer"].get("is_auxiliary"):
                        raise ValueError(f"MeanFieldELBO: guide site {name!r} is not a site of the model and not "
                                         f"marked auxiliary (infer={{'is_auxiliary': True}})")
                    if is_validation_enabled():
                        check_fully_reparametrized(guide_site)
                    elbo_particle = elbo_particle - guide_site["score_parts"].entropy_term.sum()
            loss = -(elbo_particle.detach() if torch._C._get_tracing_state() else torch_item(elbo_particle))
            return loss, -elbo_particle

    MeanFieldELBO.__module__ = __name__
    MeanFieldELBO.__qualname__ = "MeanFieldELBO"
    return MeanFieldELBO


def __getattr__(name: str):
    # MeanFieldELBO subclasses Pyro's class, so it is built when first asked for.
    if name == "MeanFieldELBO":
        cls = _make_mean_field_elbo()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _has_rule(q_type: type, p_type: type) -> bool:
    from ..engine.closed_form import registered_kl

    return registered_kl(q_type, p_type) is not NotImplemented


def register_mc_kl(q_type: type, p_type: type, num_samples: int, *, method: str = "auto"):
    """Register mcgraph's M-sample KL(q ‖ p) with ``torch.distributions.register_kl`` (global, permanent).

    For a pair torch has no rule for (Normal ‖ StudentT, Normal ‖ Cauchy, Normal ‖
    ``ScaleMixtureNormal`` or ``MixtureSameFamily``, …): afterwards every
    ``torch.distributions.kl_divergence(q, p)`` call, Pyro's ``TraceMeanField_ELBO`` included,
    returns :func:`mcgraph.kl_divergence` with ``num_samples`` samples (noise from torch's global
    generator) instead of raising ``NotImplementedError``.

    Args:
        q_type, p_type: ``Distribution`` subclasses.
        num_samples: M.
        method: the engine's method (:data:`mcgraph.engine.plan.classify.METHODS`).

    Returns:
        The registered function.

    Raises:
        ValueError: torch already has a rule for the pair (a registration would shadow it), or a
            bad ``num_samples`` / ``method``.
        TypeError: a type is not a ``Distribution`` subclass.
    """
    for arg, t in (("q_type", q_type), ("p_type", p_type)):
        if not (isinstance(t, type) and issubclass(t, Distribution)):
            raise TypeError(f"{arg} must be a torch.distributions.Distribution subclass, got {t!r}")
    num_samples = checks.positive_int("num_samples", num_samples)
    method = parse_method(method)
    if _has_rule(q_type, p_type):
        raise ValueError(f"torch already has a KL rule for {q_type.__name__} ‖ {p_type.__name__}; register_mc_kl "
                         f"only adds rules for pairs without one")
    m = int(num_samples)

    def mc_kl(q, p):
        return kl_divergence(q, p, m, method=method)

    mc_kl.__name__ = f"mcgraph_kl_{q_type.__name__}_{p_type.__name__}"
    setattr(mc_kl, MONTE_CARLO_RULE, True)  # an estimate, not a closed form: mg.kl_divergence skips it
    torch.distributions.register_kl(q_type, p_type)(mc_kl)
    return mc_kl
