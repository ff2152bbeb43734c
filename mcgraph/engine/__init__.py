"""The engine: expectations E_q[g(w)] whose autograd graph does not grow with the number of samples.

Laid out as it works, from the ground up:

* :mod:`.plan` — what to compute: the distribution's sampling form (:mod:`.plan.families`), the
  integrand traced into terms (:mod:`.plan.ir`, :mod:`.plan.algebra`, :mod:`.plan.ops`,
  :mod:`.plan.tracer`), each term's tier and parameterization tuple (:mod:`.plan.classify`), and the
  plan cache (:mod:`.plan.cache`);
* :mod:`.noise` — the ξ every tier reads: noise laws and their moments, seeded block streams, the
  compiled CPU Philox stream, the collapsed tier's statistics, and the one module that picks a
  backend (:mod:`.noise.backends`: torch, the compiled CPU loop or the Triton kernels of
  :mod:`mcgraph.kernels`);
* :mod:`.estimators` — the collapsed, fused, chunked and direct tiers;
* :mod:`.stderr`, :mod:`.distributed` and :mod:`.api` (``expectation``, ``kl_divergence``, ``explain``).

Nothing here imports :mod:`mcgraph.nn`, :mod:`mcgraph.optim`, :mod:`mcgraph.interop` or :mod:`mcgraph.apps`.
"""
