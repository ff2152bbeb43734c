"""Full-ELBO memory, time and gradient correctness: mcgraph against its peers.

Workload (as the peers were measured): a Bayesian MLP 784-1000-1000-10, mean-field
Normal posterior (ρ₀ = −3), N(0, 1) prior, batch 32, N = 60 000, and the ELBO
averaged over M whole-network weight samples (data term and KL).

Providers:

* ``mcgraph`` — ``mg.nn.elbo`` (chunked data term, KL by the engine's
  ``collapsed-exact`` tier with M samples);
* ``mcgraph-direct`` — the same estimate with every sample in one graph;
* ``bayesian-torch`` — ``LinearReparameterization`` layers, M forward passes
  (each returning ``(out, kl)``) summed into one loss, as in its examples.
  (blitz and Pyro are not installed here.)

Measured per (provider, M), each in a fresh subprocess:

* ``saved_bytes`` / ``nodes``: ``mg.graph_size`` of the loss (bytes saved for
  backward, deduplicated by storage, walking the graph);
* ``peak_rss_bytes``: the subprocess's peak resident memory;
* ``time_s``: the fastest of ``--reps`` forward+backward passes (``--interleaved`` also
  alternates the two providers in one process, for a ratio that is fair on a busy machine);
* ``rho_grad_rel_err``: ‖g − g_ref‖ / ‖g_ref‖ of the first layer's ρ-gradient, with
  ``g_ref`` recomputed by plain autograd from the **same** noise, each sample's
  noise in its own tensor (M = ``--grad-samples``).

Rows go to ``--out`` (JSON lines: provider, M, device, torch, mcgraph, commit, …).

Usage::

    python bench/elbo_peers.py --samples 1 16 64 256 --out bench/results/elbo_peers.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mcgraph.bench.records import git_commit

SIZES = (784, 1000, 1000, 10)
BATCH, DATASET = 32, 60_000
RHO_INIT = -3.0


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (BATCH,), generator=g)


# --------------------------------------------------------------------------- mcgraph


def mcgraph_model():
    import mcgraph.nn as mnn

    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.ReLU())
    return mnn.bayesify(torch.nn.Sequential(*layers), posterior="normal", prior="normal", rho_init=RHO_INIT,
                        inplace=True)


def mcgraph_loss(model, x, y, M, method):
    import mcgraph.nn as mnn

    return -mnn.elbo(model, x, y, num_samples=M, dataset_size=DATASET, kl_samples=M, kl_method="collapsed-exact",
                     method=method, seed=0)


def mcgraph_grad_error(M: int, method: str) -> float:
    """ρ-gradient of mcgraph's data term against plain autograd on the same noise, sample by sample."""
    import mcgraph.nn as mnn
    from mcgraph.families import family_of
    from mcgraph.nn.context import NoiseKind, sample_run

    model = mcgraph_model()
    x, y = _data()
    model.zero_grad()
    (-mnn.expected_data_term(model, x, y, num_samples=M, seed=0, method=method)).backward()
    got = model[0].weight_rho.grad.clone()
    layers = mnn.bayesian_modules(model)
    run = sample_run(model, M, seed=0)
    rhos = [layer.weight_rho for layer in layers]
    with torch.no_grad():
        noise = [run.form_rows(layer, NoiseKind.WEIGHT, family_of(layer.posterior()), 0, M) for layer in layers]
    loss = 0
    for i in range(M):
        h = x
        for k, layer in enumerate(layers):
            w = layer.weight_mu + F.softplus(layer.weight_rho) * noise[k][i].clone()
            h = F.linear(h, w, layer.bias)
            if k < len(layers) - 1:
                h = F.relu(h)
        loss = loss + F.cross_entropy(h, y)
    (ref,) = torch.autograd.grad(loss / M, rhos[0])
    return float((got - ref).norm() / ref.norm())


# --------------------------------------------------------------------------- bayesian-torch


def bayesian_torch_model():
    from bayesian_torch.layers import LinearReparameterization

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(
                LinearReparameterization(a, b, posterior_rho_init=RHO_INIT) for a, b in zip(SIZES[:-1], SIZES[1:]))

        def forward(self, x):
            kl = 0
            for k, layer in enumerate(self.layers):
                x, kl_k = layer(x)
                kl = kl + kl_k
                if k < len(self.layers) - 1:
                    x = F.relu(x)
            return x, kl

    torch.manual_seed(0)
    return MLP()


def bayesian_torch_loss(model, x, y, M):
    total = 0
    for _ in range(M):
        out, kl = model(x)
        total = total + F.cross_entropy(out, y) + kl / DATASET
    return total / M


def bayesian_torch_grad_error(M: int) -> float:
    """bayesian-torch's ρ-gradient against plain autograd on the noise it actually drew (weight and bias)."""
    model = bayesian_torch_model()
    x, y = _data()
    drawn_w = [[] for _ in model.layers]
    drawn_b = [[] for _ in model.layers]

    def hook(k):
        def fn(mod, inp, out):
            drawn_w[k].append(mod.eps_weight.clone())
            drawn_b[k].append(mod.eps_bias.clone())
        return fn

    hooks = [layer.register_forward_hook(hook(k)) for k, layer in enumerate(model.layers)]
    total = 0
    for _ in range(M):
        out, _ = model(x)
        total = total + F.cross_entropy(out, y)
    for h in hooks:
        h.remove()
    (total / M).backward()
    got = model.layers[0].rho_weight.grad.clone()
    loss = 0
    for i in range(M):
        h = x
        for k, layer in enumerate(model.layers):
            w = layer.mu_weight + torch.log1p(torch.exp(layer.rho_weight)) * drawn_w[k][i]
            b = layer.mu_bias + torch.log1p(torch.exp(layer.rho_bias)) * drawn_b[k][i]
            h = F.linear(h, w, b)
            if k < len(model.layers) - 1:
                h = F.relu(h)
        loss = loss + F.cross_entropy(h, y)
    (ref,) = torch.autograd.grad(loss / M, model.layers[0].rho_weight)
    return float((got - ref).norm() / ref.norm())


# --------------------------------------------------------------------------- one measurement


def measure(provider: str, M: int, reps: int, grad_samples: int) -> dict:
    import mcgraph as mg

    x, y = _data()
    if provider.startswith("mcgraph"):
        method = "direct" if provider == "mcgraph-direct" else "chunked"
        model = mcgraph_model()

        def loss_fn():
            return mcgraph_loss(model, x, y, M, method)

        grad_err = mcgraph_grad_error(grad_samples, method) if grad_samples else None
    elif provider == "bayesian-torch":
        model = bayesian_torch_model()

        def loss_fn():
            return bayesian_torch_loss(model, x, y, M)

        grad_err = bayesian_torch_grad_error(grad_samples) if grad_samples else None
    else:
        raise ValueError(f"provider must be mcgraph, mcgraph-direct or bayesian-torch, got {provider!r}")

    loss = loss_fn()
    size = mg.graph_size(loss)
    del loss
    times = []
    for _ in range(reps):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = loss_fn()
        loss.backward()
        times.append(time.perf_counter() - t0)
        del loss
    return {
        "provider": provider, "M": M, "batch": BATCH, "sizes": list(SIZES),
        "saved_bytes": size.saved_bytes, "nodes": size.nodes, "time_s": min(times), "times_s": times,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rho_grad_rel_err": grad_err, "grad_samples": grad_samples,
        "device": "cpu", "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "mcgraph": mg.__version__, "commit": git_commit(),
    }


def interleaved_times(M: int, reps: int) -> dict:
    """Forward+backward times of mcgraph and bayesian-torch alternated in one process (fair under load)."""
    x, y = _data()
    mc, bt = mcgraph_model(), bayesian_torch_model()
    runs = {"mcgraph": lambda: mcgraph_loss(mc, x, y, M, "chunked"),
            "bayesian-torch": lambda: bayesian_torch_loss(bt, x, y, M)}
    times: dict = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            for model in (mc, bt):
                model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = fn()
            loss.backward()
            times[name].append(time.perf_counter() - t0)
            del loss
    best = {name: min(t) for name, t in times.items()}
    return {"provider": "interleaved", "M": M, "times_s": times, "mcgraph_s": best["mcgraph"],
            "bayesian_torch_s": best["bayesian-torch"], "ratio": best["mcgraph"] / best["bayesian-torch"],
            "device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__, "commit": git_commit()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--providers", nargs="+", default=["mcgraph", "mcgraph-direct", "bayesian-torch"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--grad-samples", type=int, default=4, help="M of the gradient check (0: skip)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--max-direct", type=int, default=64, help="largest M for mcgraph-direct")
    parser.add_argument("--out", default="bench/results/elbo_peers.jsonl")
    parser.add_argument("--interleaved", action="store_true",
                        help="also time mcgraph and bayesian-torch alternately in one process (fair under load)")
    parser.add_argument("--one", nargs=2, metavar=("PROVIDER", "M"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        provider, M = args.one[0], int(args.one[1])
        row = interleaved_times(M, args.reps) if provider == "interleaved" else \
            measure(provider, M, args.reps, args.grad_samples)
        print(json.dumps(row))
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for provider in args.providers:
        for M in args.samples:
            if provider == "mcgraph-direct" and M > args.max_direct:
                continue
            cmd = [sys.executable, __file__, "--one", provider, str(M), "--reps", str(args.reps),
                   "--grad-samples", str(args.grad_samples if M == args.samples[0] else 0),
                   "--threads", str(args.threads)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                print(f"{provider} M={M} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            err = row["rho_grad_rel_err"]
            print(f"{provider:15s} M={M:4d}  saved {row['saved_bytes'] / 2**20:9.1f} MiB  "
                  f"peak RSS {row['peak_rss_bytes'] / 2**20:9.1f} MiB  time {row['time_s']:8.3f} s"
                  + (f"  ρ-grad rel. err {err:.2e}" if err is not None else ""), flush=True)
    if args.interleaved and {"mcgraph", "bayesian-torch"} <= set(args.providers):
        for M in args.samples:
            cmd = [sys.executable, __file__, "--one", "interleaved", str(M), "--reps", str(args.reps),
                   "--threads", str(args.threads)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                print(f"interleaved M={M} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"interleaved     M={M:4d}  mcgraph {row['mcgraph_s']:.3f} s  bayesian-torch "
                  f"{row['bayesian_torch_s']:.3f} s  ratio {row['ratio']:.2f}x", flush=True)
    by = {(r["provider"], r["M"]): r for r in rows}
    for M in args.samples:
        a, b = by.get(("mcgraph", M)), by.get(("bayesian-torch", M))
        if a and b:
            print(f"M={M}: mcgraph / bayesian-torch time {a['time_s'] / b['time_s']:.2f}x, saved bytes "
                  f"{a['saved_bytes'] / 2**20:.1f} vs {b['saved_bytes'] / 2**20:.1f} MiB")
    one = by.get(("mcgraph", min(args.samples)))
    for M in args.samples:
        r = by.get(("mcgraph", M))
        if one and r:
            print(f"mcgraph saved bytes M={M} / M={one['M']}: {r['saved_bytes'] / one['saved_bytes']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
