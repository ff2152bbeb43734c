"""Seeded normals drawn on several threads: the numbers of one generator per draw, whatever the threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mcgraph.optim import seeded_noise
from mcgraph.optim.seeded_noise import PARALLEL_MIN_ELEMENTS, fill_normal


def _expected(seed: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(like).normal_(generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_draw_gets_its_own_generators_numbers_on_any_number_of_threads(threads, dtype):
    big = PARALLEL_MIN_ELEMENTS
    rows = torch.empty(4, big + 5, dtype=dtype)
    outs = [torch.empty(big, dtype=dtype), torch.empty(3, dtype=dtype), torch.empty(2, big // 2 + 1, dtype=dtype),
            *rows]  # (the rows are views of one buffer, as the optimizers draw them)
    seeds = [11, 12, 13, 14, 15, 16, 17]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        fill_normal(list(zip(seeds, outs)))
    finally:
        torch.set_num_threads(before)
    for seed, out in zip(seeds, outs):
        assert torch.equal(out, _expected(seed, out))


def test_a_worker_error_reaches_the_caller():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        bad = torch.empty(PARALLEL_MIN_ELEMENTS, dtype=torch.int64)  # normal_ has no integer kernel
        with pytest.raises(RuntimeError):
            fill_normal([(1, torch.empty(PARALLEL_MIN_ELEMENTS)), (2, bad)])
    finally:
        torch.set_num_threads(before)


def test_the_pool_follows_torchs_thread_count():
    before = torch.get_num_threads()
    big = [(s, torch.empty(PARALLEL_MIN_ELEMENTS)) for s in range(3)]
    try:
        torch.set_num_threads(2)
        fill_normal(big)
        assert seeded_noise._pool["workers"] == 2
        torch.set_num_threads(3)
        fill_normal(big)
        assert seeded_noise._pool["workers"] == 3
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, _expected(s, o)) for s, o in big)


def test_a_forked_child_draws_with_its_own_pool():
    import multiprocessing as mp

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fill_normal([(s, torch.empty(PARALLEL_MIN_ELEMENTS)) for s in range(2)])  # the parent's pool exists
        ctx = mp.get_context("fork")
        with ctx.Pool(1) as pool:
            ok, workers = pool.apply_async(_draw_in_child).get(timeout=120)  # (without the fork hook: hangs)
    finally:
        torch.set_num_threads(before)
    assert ok and workers == 2


def _draw_in_child() -> bool:
    # Only serial torch work here: a forked child cannot enter the parent's OpenMP thread pool (a torch
    # limitation unrelated to the noise pool), so the comparison is done in numpy.
    outs = [(s, torch.empty(PARALLEL_MIN_ELEMENTS)) for s in range(3)]
    fill_normal(outs)  # torch.get_num_threads() is the parent's 2: the pool is used
    return all(np.array_equal(o.numpy(), _expected(s, o).numpy()) for s, o in outs), seeded_noise._pool.get("workers")


def test_draws_inside_inference_mode_are_taken_by_the_workers_too():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch.inference_mode():
            outs = [(s, torch.empty(PARALLEL_MIN_ELEMENTS)) for s in range(3)]
            fill_normal(outs)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, _expected(s, o)) for s, o in outs)
