"""Triton kernels of mcgraph, shipped as ``mcgraph.kernels``.

Sampling and reduction fused: each program draws its noise in registers from a
counter-based Philox stream (:mod:`.noise_laws`), evaluates, and reduces over
the M samples in the same loop, so an M × P noise tensor never exists.

* :func:`noise_statistics` — per-element means of ξ^a (log ξ)^j (collapsed tier);
* :func:`fused_log_prob_expectation` — E_q[log p(w)] with gradients (fused tier);
* :func:`softmax_cross_entropy_mc` — expected cross-entropy of Gaussian logits;
* :func:`materialize_noise` — the exact ξ those kernels draw, for tests.

Importing this package imports nothing heavy: names resolve lazily, and only
the Triton modules import Triton, so ``mcgraph.kernels.reference`` (pure torch)
works without it. On CPU tensors the kernels need ``TRITON_INTERPRET=1`` set
before they are first imported. :mod:`mcgraph.engine.backend` decides when they run.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "noise_statistics": "noise_stats",
    "fused_log_prob_expectation": "fused_elementwise",
    "fused_log_prob": "fused_elementwise",
    "FusedLogProbFunction": "fused_elementwise",
    "FormKind": "fused_elementwise",
    "softmax_cross_entropy_mc": "softmax_mc",
    "materialize_noise": "noise_laws",
    "TritonNoiseStream": "noise_laws",
    "NOISE_LAWS": "noise_laws",
    "register_noise": "noise_laws",
    "LOG_PROBS": "integrands",
    "register_log_prob": "integrands",
    "softmax_cross_entropy_mc_torch": "reference",
    "SoftmaxCrossEntropyMCFunction": "reference",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mcgraph.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
