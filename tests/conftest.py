"""Fixtures shared by every test area (tests/engine, nn, optim, interop, apps, paper; helpers in tests/support)."""

from __future__ import annotations

import os

import pytest
import torch

# The Triton kernels run under Triton's interpreter in the test process, unless the run is the device check's
# (MCGRAPH_KERNEL_DEVICE=cuda for tests/engine/test_kernels.py, MCGRAPH_TEST_DEVICE=cuda for
# tests/nn/test_cuda_families.py). Triton reads the variable when first imported, which may happen while any
# area's modules are collected, so it is set here, before the first of them.
if "cuda" not in (os.environ.get("MCGRAPH_KERNEL_DEVICE", "").strip().lower(),
                  os.environ.get("MCGRAPH_TEST_DEVICE", "").strip().lower()):
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
