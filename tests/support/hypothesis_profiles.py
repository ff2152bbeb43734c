"""Hypothesis profiles of the property tests, chosen by ``MCGRAPH_HYPOTHESIS_PROFILE``.

* ``ci`` (default): no example database, derandomized (the same examples on every run),
  a bounded number of examples per test (its ``max_examples`` scaled by the profile) so
  that the property suites stay well under two minutes on a 2-core machine.
* ``slow``: ``slow_factor`` times more examples per test, random, no database; run on demand
  with ``make test-props-slow`` (or ``MCGRAPH_HYPOTHESIS_PROFILE=slow pytest tests/engine/test_properties.py tests/nn/test_properties_nn.py``);
  ``MCGRAPH_HYPOTHESIS_SLOW_FACTOR`` changes the factor (default 64: about 21 000 examples in all) and pytest's
  ``--hypothesis-seed=N`` replays a run.

Tests take their example count from :func:`examples`, so the profile scales every test.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE = os.environ.get("MCGRAPH_HYPOTHESIS_PROFILE", "ci")
_FACTOR = {"ci": 1, "slow": int(os.environ.get("MCGRAPH_HYPOTHESIS_SLOW_FACTOR", "64"))}
if PROFILE not in _FACTOR:
    raise ValueError(f"MCGRAPH_HYPOTHESIS_PROFILE must be one of {sorted(_FACTOR)}, got {PROFILE!r}")

_COMMON = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much])
settings.register_profile("ci", derandomize=True, **_COMMON)
settings.register_profile("slow", derandomize=False, **_COMMON)
settings.load_profile(PROFILE)


def examples(n: int) -> settings:
    """Settings with ``n`` examples in the ``ci`` profile, ``n × factor`` in ``slow``."""
    return settings(max_examples=n * _FACTOR[PROFILE])
