"""What the engine computes for ``E_q[g(w)]``: the sampling form of ``q``, the traced terms of ``g``,
and the plan that gives each term a tier (families → IR / algebra / ops → tracer → classify, cached)."""
