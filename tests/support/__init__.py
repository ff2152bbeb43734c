"""What several test areas share: reference tables, Hypothesis profiles, peer-library models, subprocess
environments and the checkout's paths. Nothing here is collected as a test; ``tests/`` is on pytest's
``pythonpath``, so a test module imports these as ``support.<module>``."""
