"""KL of a Bayesian ResNet-18 on 1 vs R processes: MC samples split over a gloo group.

    python -m bench.distributed_kl --num-samples 1000 --procs 1 2 --out bench/out

For each R in ``--procs`` the script spawns R processes that join a gloo group (FileStore in
a temporary directory; loopback only), build the same bayesified ResNet-18 (Radial posterior,
Normal(0, 1) prior), and time ``mg.nn.kl(net, M, seed, method="monte-carlo", process_group=group)`` forward +
backward (``--repeats`` timed runs after ``--warmup`` untimed ones). Each process reports

* ``time_s``: the median wall time of a call (forward + backward), and ``cpu_s`` the CPU time this
  process spent in it (on a machine shared with other work, the per-rank compute);
* ``comm_s``: the seconds spent inside collectives during that call (waiting for a slower rank
  included) and ``comm_bytes``: the bytes all-reduced;
* ``allreduce_s``: an isolated all-reduce of the same number of bytes after a barrier: the
  communication cost alone;
* ``peak_rss_mb``: the process's peak resident memory (``ru_maxrss``).

Rows go to ``<out>/distributed_kl.json`` (one row per process and R) and a table is printed,
with the speed-up over R = 1 and the projection of the scaling to more workers from the
measured compute / communication split: ``T(R) = T_compute(1) / R + T_comm(R)`` with a ring
all-reduce, ``T_comm(R) ∝ 2 (R − 1) / R`` times the bytes (bandwidth-bound).

``--device cuda`` puts rank r's network on GPU ``r mod`` the number of GPUs (the group stays gloo, which
all-reduces CUDA tensors; several ranks may share one GPU) and synchronises it around every timed call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mcgraph.apps import atomic_io

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's mcgraph, in the children too


def build(model: str):
    import mcgraph as mg

    torch.manual_seed(0)
    net = mg.models.get_model(model, num_classes=10)
    return mg.nn.bayesify(net, posterior="radial", prior="normal", inplace=True)


def worker(rank: int, world: int, store: str, args: dict, outdir: str) -> None:
    torch.set_num_threads(args["threads"])
    import mcgraph as mg
    from mcgraph.engine.distributed import comm_stats, reset_comm_stats

    device = torch.device("cpu")
    if args.get("device", "cpu") == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    group = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=1800))
        group = dist.group.WORLD
    net = build(args["model"]).to(device)
    params = [p for p in net.parameters() if p.requires_grad]
    times, cpus, comms, nbytes, value = [], [], [], 0, None
    for i in range(args["repeats"] + args["warmup"]):
        for p in params:
            p.grad = None
        if group is not None:
            dist.barrier()
        reset_comm_stats()
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        kl = mg.nn.kl(net, args["num_samples"], seed=i, method="monte-carlo", process_group=group)
        kl.backward()
        sync()
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = comm_stats()
        value = float(kl.detach())
        if i >= args["warmup"]:
            times.append(elapsed)
            cpus.append(cpu)
            comms.append(stats["seconds"])
            nbytes = stats["data_bytes"]
    allreduce = 0.0
    if group is not None and nbytes:
        buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        sync()
        allreduce = time.perf_counter() - t0
    row = {"bench": "distributed_kl", "model": args["model"], "posterior": "radial", "prior": "normal",
           "M": args["num_samples"], "processes": world, "rank": rank, "threads": args["threads"],
           "P": sum(p.numel() for p in params) // 2, "time_s": statistics.median(times), "times_s": times,
           "cpu_s": statistics.median(cpus),
           "comm_s": statistics.median(comms), "comm_bytes": nbytes, "allreduce_s": allreduce,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "kl_last": value,
           "torch": torch.__version__, "device": device.type, "cpus": os.cpu_count()}
    atomic_io.write_json(os.path.join(outdir, f"row{world}_{rank}.json"), row)
    if group is not None:
        dist.destroy_process_group()
        from mcgraph.apps.launch import exit_process

        exit_process(0)  # gloo's threads must not meet interpreter shutdown (see mcgraph.apps.launch)


def run(world: int, args: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(world, os.path.join(tmp, "store"), args, tmp), nprocs=world,
                           start_method="spawn", join=True)
        return [json.loads(Path(tmp, f"row{world}_{r}.json").read_text()) for r in range(world)]


def project(base: dict, rows: list[dict], workers=(2, 4, 8)) -> list[str]:
    """Speed-ups predicted from the measured compute / communication split of the R-process run."""
    world = rows[0]["processes"]
    comm = max(r["allreduce_s"] for r in rows)
    compute_1 = base["time_s"]
    out = []
    for n in workers:
        comm_n = comm * (2 * (n - 1) / n) / (2 * (world - 1) / world)
        out.append(f"R = {n}: {compute_1 / (compute_1 / n + comm_n):.2f}x "
                   f"(compute {compute_1 / n:.2f} s + all-reduce {comm_n:.3f} s)")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--num-samples", type=int, default=1000)
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before the timed ones")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where each rank's network lives (cuda: rank r on GPU r mod the GPU count)")
    p.add_argument("--out", default="bench/out")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    args = {"model": a.model, "num_samples": a.num_samples, "repeats": a.repeats, "threads": a.threads,
            "warmup": a.warmup, "device": a.device}
    rows = []
    for world in a.procs:
        rows += run(world, args)
        print(f"R = {world} done", file=sys.stderr, flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_io.write_json(out / "distributed_kl.json", rows, indent=1)
    base = next((r for r in rows if r["processes"] == 1), None)
    print("| R | rank | time (s) | speed-up | CPU (s) | comm in call (s) | isolated all-reduce (s) | "
          "MB reduced | peak RSS (MB) | KL |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        speed = f"{base['time_s'] / r['time_s']:.2f}x" if base else "-"
        cpu = r.get("cpu_s", float("nan"))
        print(f"| {r['processes']} | {r['rank']} | {r['time_s']:.2f} | {speed} | {cpu:.2f} | {r['comm_s']:.3f} | "
              f"{r['allreduce_s']:.3f} | {r['comm_bytes'] / 2**20:.1f} | {r['peak_rss_mb']:.0f} | "
              f"{r['kl_last']:.6g} |")
    if base:
        for world in sorted({r["processes"] for r in rows} - {1}):
            group = [r for r in rows if r["processes"] == world]
            print(f"\nprojection from the R = {world} split (ring all-reduce, same per-sample compute):")
            for line in project(base, group):
                print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
