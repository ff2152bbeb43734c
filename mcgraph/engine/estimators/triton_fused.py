"""The fused tier's Triton kernel for registered prior log-densities: ``E_q[log p(w)]`` on CUDA in one launch.

The counterpart of :mod:`.cpu_fused` on the Triton backend
(:func:`mcgraph.kernels.fused_elementwise.fused_log_prob_expectation`: the noise drawn in registers, value
and gradients reduced over M in the same loop). :func:`kernel_plan` says whether it applies, building and
launching nothing; :func:`log_prob_expectation` runs it, or returns ``None`` for the engine's own tiers.
"""

from __future__ import annotations

import torch

from mcgraph.kernels.log_densities import kernel_takes_whole_term, log_density

from ..noise.backends import triton_form
from ..plan.families import family_of, is_exp
from ..shapes import broadcasts_to


def kernel_plan(q, p, method: str = "fused") -> tuple | None:
    """The fused Triton kernel's plan for ``E_q[log p(w)]``: ``(form, kind, law name, event_ndims, base)``
    (``base``: ``p`` without its ``Independent`` wrappers), or ``None`` when the kernel does not apply
    (builds and launches nothing).

    It applies when ``q``'s family is on the Triton backend with a Triton noise law, its transforms
    are none or one ``exp``, ``p`` (or its ``Independent`` base) has a registered Triton log-density,
    ``p``'s shape broadcasts into ``q``'s, and, under a ``method`` other than ``"fused"``, the engine
    would put the whole term in the fused tier anyway
    (:func:`mcgraph.kernels.log_densities.kernel_takes_whole_term`: no polynomial term, which
    ``"auto"`` takes exactly), as on the CPU.
    """
    form = family_of(q)
    noise = triton_form(form)  # (the kernel modules import Triton: imported below only when it applies)
    if noise is None or tuple(form.noise_shape) != tuple(form.shape):
        return None
    if not form.transforms:
        kind = "scaling" if form.is_scaling else "location_scale"
    elif len(form.transforms) == 1 and is_exp(form.transforms[0]) and not form.is_scaling:
        kind = "exp"
    else:
        return None
    from mcgraph.kernels.fused_elementwise import unwrap_independent
    from mcgraph.kernels.integrands import integrand_entry

    base, _ = unwrap_independent(p)
    if integrand_entry(type(base)) is None:
        return None
    if not kernel_takes_whole_term(log_density(type(base)), kind, method):
        return None  # the engine's plan: the polynomial terms exact ("auto") or collapsed
    if not broadcasts_to(p.batch_shape + p.event_shape, form.shape):
        return None
    return (form, kind, *noise, base)


def log_prob_expectation(q, p, num_samples: int, seed: int, *, sum_rightmost: int = 0,
                         method: str = "fused") -> torch.Tensor | None:
    """``E_q[Σ_rightmost log p(w)]`` by the fused Triton kernel, or ``None`` when it does not apply
    (:func:`kernel_plan`). Engine hook: ``mcgraph.engine.api.kl_divergence`` for the cross term, when
    ``method`` is ``"auto"``, ``"monte-carlo"`` or ``"fused"`` (on the CPU backend the hook asks
    :mod:`mcgraph.engine.estimators.cpu_fused` instead).
    """
    found = kernel_plan(q, p, method)
    if found is None:
        return None
    from mcgraph.kernels.fused_elementwise import fused_log_prob_expectation

    form, kind, name, event_ndims, _ = found
    value = fused_log_prob_expectation(
        p, form.loc, form.scale, kind, num_samples, seed, noise=name, event_ndims=event_ndims,
        shape=form.noise_shape)
    return value.sum(tuple(range(-sum_rightmost, 0))) if sum_rightmost > 0 else value
