"""KL of a Bayesian network with Radial vs Normal posterior: wall, user and system CPU time.

    python -m bench.noise_churn --model resnet18 --num-samples 200 --threads 2
    python -m bench.noise_churn --model lenet5 --num-samples 200 --src /path/to/other/checkout
    python -m bench.noise_churn --workload elbo --posteriors radial --num-samples 1000

Each case (posterior × source tree) runs in its own subprocess, cases interleaved repeat by repeat,
so that a comparison of two checkouts (``--src``, the default is this one) sees the same machine
load. A case builds ``mcgraph.models.get_model(model, num_classes=10)``, bayesifies it with the
given posterior and a Normal(0, 1) prior, and times ``mg.nn.kl(net, M, seed=r, method="monte-carlo")`` forward +
backward (``--workload elbo``: the README's example instead, ``-mg.nn.elbo(net, x, y,
num_samples=8, dataset_size=50_000)`` forward + backward on a batch of 32 3×32×32 inputs, with
``kl_samples`` = M for the KL term). Reported per case: wall seconds, user and system CPU
seconds (``getrusage`` deltas of the call), minor page faults and the process's peak RSS. The best
(lowest wall) of the repeats is kept. System time well above a few percent of user time means
allocation / page-fault churn. Rows go to ``<out>/noise_churn.json``.

``--device cuda`` puts the network and the batch on the GPU (the call synchronised before the clock stops;
the rows then carry ``device``): the wall time is the GPU's, the CPU times are the host's launch work.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def child(args) -> None:
    args.src = args.src[0]
    sys.path.insert(0, args.src)
    import torch

    torch.set_num_threads(args.threads)
    import mcgraph as mg

    torch.manual_seed(0)
    net = mg.models.get_model(args.model, num_classes=10, in_channels=3)  # the 3×32×32 batch below
    net = mg.nn.bayesify(net, posterior=args.posterior, prior="normal", kl_samples=args.num_samples,
                         inplace=True)
    device = torch.device(args.device)
    net = net.to(device)
    params = [p for p in net.parameters() if p.requires_grad]
    x, y = torch.randn(32, 3, 32, 32).to(device), torch.randint(0, 10, (32,)).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if args.workload == "elbo":
        kl = -mg.nn.elbo(net, x, y, num_samples=8, dataset_size=50_000, seed=args.seed,
                         kl_samples=mg.Sampling(args.num_samples, method="monte-carlo"))
    else:  # sampled: Radial and Normal posteriors have a closed-form KL to a Normal prior (the default)
        kl = mg.nn.kl(net, args.num_samples, seed=args.seed, method="monte-carlo")
    kl.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    where = {} if device.type == "cpu" else {"device": device.type}
    print(json.dumps({
        "workload": args.workload, "model": args.model, "posterior": args.posterior,
        "num_samples": args.num_samples, "src": args.src,
        "mcgraph": mg.__file__, "threads": args.threads, "params": sum(p.numel() for p in params),
        "wall_s": wall, "user_s": r1.ru_utime - r0.ru_utime, "sys_s": r1.ru_stime - r0.ru_stime,
        "minflt": r1.ru_minflt - r0.ru_minflt, "peak_rss_mb": r1.ru_maxrss / 1024, "kl": float(kl.detach()),
        "load": os.getloadavg()[0], **where,
    }))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["kl", "elbo"], default="kl")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--num-samples", type=int, default=200)
    ap.add_argument("--posteriors", nargs="+", default=["normal", "radial"])
    ap.add_argument("--src", nargs="+", default=[str(HERE)], help="source trees to import mcgraph from")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the network and batch live")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--posterior", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    rows = []
    for _ in range(args.repeats):
        for src in args.src:
            for post in args.posteriors:
                cmd = [sys.executable, __file__, "--child", "--workload", args.workload,
                       "--model", args.model, "--posterior", post,
                       "--num-samples", str(args.num_samples), "--src", str(Path(src).resolve()),
                       "--threads", str(args.threads), "--seed", str(args.seed), "--device", args.device]
                env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if out.returncode:
                    sys.exit(f"case {post} @ {src} failed:\n{out.stderr}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"{row['src']:<28} {post:<7} wall {row['wall_s']:7.2f} s  user {row['user_s']:7.2f} s  "
                      f"sys {row['sys_s']:6.2f} s ({row['sys_s'] / max(row['user_s'], 1e-9):5.1%})  "
                      f"minflt {row['minflt']:>9}  peak {row['peak_rss_mb']:7.0f} MiB  "
                      f"load {row['load']:.2f}",
                      flush=True)
    best = {}
    for r in rows:
        key = (r["src"], r["posterior"])
        if key not in best or r["wall_s"] < best[key]["wall_s"]:
            best[key] = r
    print(f"\n{args.workload}, {args.model}, M = {args.num_samples}, {args.threads} thread(s); "
          f"best of {args.repeats}:")
    for src in args.src:
        src = str(Path(src).resolve())
        base = best.get((src, "normal"))
        for post in args.posteriors:
            r = best[(src, post)]
            cpu = lambda row: row["user_s"] + row["sys_s"]  # noqa: E731
            ratio = (f"  {r['wall_s'] / base['wall_s']:.2f}x Normal's wall, {cpu(r) / cpu(base):.2f}x its CPU"
                     if base else "")
            print(f"  {src:<28} {post:<7} {r['wall_s']:7.2f} s  user {r['user_s']:7.2f} s  "
                  f"sys/user {r['sys_s'] / r['user_s']:5.1%}{ratio}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        from mcgraph.apps import atomic_io

        atomic_io.write_json(Path(args.out) / "noise_churn.json", rows, indent=1)


if __name__ == "__main__":
    main()
