"""IVON over a gloo process group (spawned processes): R ranks, one sample each, equal one process with K = R.

Every rank holds the same batch and draws its own weight sample (seeded: rank ``r`` draws global sample
``r``); ĝ and ĥ are averaged over the ranks. The test process runs the same steps with ``mc_samples=R``
and no group, and the two must agree to float64 rounding, for both hessian estimators.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from mcgraph.apps.launch import exit_process
from mcgraph.optim import IVON

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")

WORLD = 3
STEPS = 5


def _run(group, hess_approx: str, samples_per_rank: int = 1, sync: bool = False) -> dict:
    """STEPS IVON steps on a fixed batch; ``group=None``: one process with ``WORLD·samples_per_rank`` samples."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(torch.float64)
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))
    one = group is None and not sync
    opt = IVON(net, lr=0.1, ess=50, beta2=0.9, hess_approx=hess_approx, seed=11,
               mc_samples=samples_per_rank * (WORLD if one else 1), process_group=None if sync else group, sync=sync)

    def closure():
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        return loss

    for _ in range(STEPS):
        opt.step(closure)
    out = {f"param{i}": p.detach().clone() for i, p in enumerate(net.parameters())}
    out.update({f"hess{i}": opt.state[p]["hess"].clone() for i, p in enumerate(net.parameters())})
    return out


def worker(rank: int, world: int, store: str, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results = {}
        for name, kw in {"price": dict(hess_approx="price"), "gradsq": dict(hess_approx="gradsq"),
                         "price-2": dict(hess_approx="price", samples_per_rank=2),
                         "sync-gradsq": dict(hess_approx="gradsq", sync=True)}.items():
            try:
                results[name] = _run(dist.group.WORLD, **kw)
            except Exception:  # noqa: BLE001 -- the parent reports it
                results[name] = {"__error__": traceback.format_exc()}
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_process(0)  # gloo's threads must not meet interpreter shutdown (see mcgraph.apps.launch)


def test_ranks_with_one_sample_each_equal_one_process_with_mc_samples_equal_world(tmp_path):
    ctx = mp.start_processes(worker, args=(WORLD, str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the gloo ranks did not finish in 240 s")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    expected = {"price": _run(None, "price"), "gradsq": _run(None, "gradsq"),
                "price-2": _run(None, "price", samples_per_rank=2), "sync-gradsq": _run(None, "gradsq")}
    for r, res in enumerate(results):
        for name, ref in expected.items():
            got = res[name]
            assert "__error__" not in got, f"rank {r}, {name}:\n{got['__error__']}"
            for key, value in ref.items():
                torch.testing.assert_close(got[key], value, rtol=1e-10, atol=1e-13, msg=f"rank {r} {name} {key}")
