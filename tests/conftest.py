"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Run the test on one torch thread, then restore the count.

    Two uses: small recurrent and attention steps are ~50x slower with two OpenMP threads on a loaded
    2-core machine (the threads spin for each other) than with one; and a result compared bit for bit
    with a one-thread subprocess needs the same reduction order.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
