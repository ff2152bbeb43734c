"""The engine: expectations E_q[g(w)] whose autograd graph does not grow with the number of samples.

Floors, from the ground up: :mod:`.trace` (tracing g into terms), :mod:`.families` (distribution
class → sampling form), :mod:`.noise` and :mod:`.cpu_philox` (seeded block noise), :mod:`.moments`,
:mod:`.plan_cache`, :mod:`.backend` (torch or Triton), :mod:`.tuples` (parameterization tuples and the
plan), :mod:`.estimators` (the collapsed, fused, chunked and direct tiers), :mod:`.stderr`, and
:mod:`.api` (``expectation``, ``kl_divergence``, ``explain``). Nothing here imports :mod:`mcgraph.nn`,
:mod:`mcgraph.optim`, :mod:`mcgraph.interop` or :mod:`mcgraph.apps`.
"""
