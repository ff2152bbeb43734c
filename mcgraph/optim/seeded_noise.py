"""Seeded standard normals for the optimizers, drawn on several CPU threads at once.

torch draws normal noise on the CPU on one thread (one Mersenne-Twister stream per generator), so
an optimizer that needs P normals per weight sample spends a core on them while the others wait.
The seeded optimizers draw each parameter's noise from its own generator seeded with
``mix(…, j)``: those draws are independent, so :func:`fill_normal` hands them to
``torch.get_num_threads()`` worker threads, each with its own generators (torch releases the GIL
while it draws). Every tensor receives exactly the numbers
``out.normal_(generator=torch.Generator().manual_seed(seed))`` gives, whatever the number of
threads; small draws stay on the calling thread, where a thread hand-off would cost more.

Example:
    >>> import torch
    >>> from mcgraph.optim.seeded_noise import fill_normal
    >>> a, b = torch.empty(3), torch.empty(2, 2)
    >>> fill_normal([(7, a), (8, b)])
    >>> torch.equal(a, torch.empty(3).normal_(generator=torch.Generator().manual_seed(7)))
    True
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import torch

__all__ = ["fill_normal", "PARALLEL_MIN_ELEMENTS"]

#: Numbers a draw must hold to go to a worker thread (smaller ones are drawn on the calling thread).
PARALLEL_MIN_ELEMENTS = 1 << 17

_local = threading.local()
_pool_lock = threading.Lock()
_pool: dict = {}  # "executor", "workers"


def _forget_pool_in_child() -> None:
    # A forked child inherits the pool's bookkeeping but none of its threads: submitting to it would wait
    # forever. The child starts its own pool when it first needs one.
    _pool.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def _generator(device: torch.device) -> torch.Generator:
    """This thread's generator on ``device`` (reseeded before every draw)."""
    gens = _local.__dict__.setdefault("generators", {})
    key = str(device)
    gen = gens.get(key)
    if gen is None:
        gen = gens[key] = torch.Generator(device=device)
    return gen


def _draw(seed: int, out: torch.Tensor) -> None:
    gen = _generator(out.device)
    gen.manual_seed(seed)
    out.normal_(generator=gen)


def _draw_in_mode(seed: int, out: torch.Tensor, inference: bool) -> None:
    # torch's inference mode is per thread: a worker takes the caller's (an inference tensor may be
    # written only inside it)
    with torch.inference_mode(inference):
        _draw(seed, out)


def _executor(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    with _pool_lock:
        if _pool.get("workers") != workers:
            old = _pool.get("executor")
            if old is not None:
                old.shutdown(wait=False)
            _pool["executor"] = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="mcgraph-noise")
            _pool["workers"] = workers
        return _pool["executor"]


def fill_normal(jobs: list[tuple[int, torch.Tensor]]) -> None:
    """Fill each ``out`` of ``jobs`` (``(seed, out)`` pairs) with standard normals from a generator
    seeded with ``seed``, as ``out.normal_(generator=…manual_seed(seed))`` does.

    CPU draws of at least :data:`PARALLEL_MIN_ELEMENTS` numbers are spread over
    ``torch.get_num_threads()`` threads when there are two or more of them; the rest (and every draw
    on another device) run on the calling thread, in order.
    """
    workers = torch.get_num_threads()
    large = [(s, o) for s, o in jobs if o.device.type == "cpu" and o.numel() >= PARALLEL_MIN_ELEMENTS]
    if workers < 2 or len(large) < 2:
        for seed, out in jobs:
            _draw(seed, out)
        return
    chosen = {id(o) for _, o in large}
    inference = torch.is_inference_mode_enabled()
    futures = [_executor(workers).submit(_draw_in_mode, s, o, inference) for s, o in large]
    try:
        for seed, out in jobs:
            if id(out) not in chosen:
                _draw(seed, out)
    finally:
        for f in futures:
            f.result()  # re-raises a worker's error
