"""Full-ELBO memory, time and gradient correctness: peer libraries' own M-sample loops against mcgraph.

Workload (as the peers were measured): a Bayesian MLP 784-1000-1000-10 (``--sizes``), mean-field
Normal posterior (ρ₀ = −3), batch 32, N = 60 000, and the ELBO averaged over M whole-network
weight samples (data term and KL).

Providers (``--providers``):

* ``mcgraph`` — the MLP built with ``mg.nn.bayesify`` (N(0, 1) prior), ``mg.nn.elbo`` (chunked
  data term, KL by the engine's ``collapsed-exact`` tier with M samples);
* ``mcgraph-direct`` — the same estimate with every sample in one graph;
* ``bayesian-torch`` — the MLP built **in bayesian-torch** (``dnn_to_bnn``, N(0, 1) prior), its own
  loop: M forwards, each adding cross-entropy + ``get_kl_loss``/N, summed into one graph;
* ``bayesian-torch+mcgraph`` — the same bayesian-torch model after
  ``mcgraph.interop.bayesian_torch.to_mcgraph`` (same Parameter objects) with ``mg.nn.elbo``;
* ``blitz`` — the MLP built **in blitz** with its scale-mixture prior (π = ½, σ1 = 1, σ2 = 0.002),
  its own ``sample_elbo(x, y, CE, M, 1/N)`` (M forwards in one graph, one-sample KL each);
* ``blitz+mcgraph`` — that blitz model after ``mcgraph.interop.blitz.to_mcgraph`` (blitz's floored
  prior, ``prior_floor=1e-6``) with ``mg.nn.elbo`` (M-sample KL by the engine's fused tier).

Measured per (provider, M), each in a fresh subprocess:

* ``saved_bytes`` / ``nodes``: ``mg.graph_size`` of the loss (bytes saved for backward,
  deduplicated by storage, walking the graph);
* ``peak_rss_bytes``: the subprocess's peak resident memory over building the model and the timed
  passes (read before the gradient check, which runs after them in the same process);
* ``time_s``: the fastest of ``--reps`` forward+backward passes (``--interleaved`` also alternates
  each peer with its ``+mcgraph`` provider in one process, for a ratio that is fair on a busy machine);
* ``rho_grad_rel_err``: ‖g − g_ref‖ / ‖g_ref‖ of the first layer's ρ-gradient (data term), with
  ``g_ref`` recomputed by plain autograd from the **same** noise (recorded from the peer's buffers,
  or mcgraph's seeded rows), each sample's noise in its own tensor (M = ``--grad-samples``). The
  peers' loops reuse one noise buffer per layer, so their ρ-gradients are wrong for M > 1.

``--device cuda`` puts the models and the batch on the GPU: passes are timed with the device synchronised,
and rows add ``peak_bytes`` (``torch.cuda.max_memory_allocated`` over the timed passes, above the memory
held before them).

Rows go to ``--out`` (JSON lines: provider, M, device, torch, mcgraph, commit, …); a summary
table and the targets (mcgraph's peak RSS at the largest M ≤ 1.3× its M = 1 value, time ≤ the
peer's at every M ≥ 16) follow.

Usage (``make interop`` installs the peers)::

    python -m bench.elbo_peers --samples 1 16 64 256 --interleaved --out bench/results/elbo_peers.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import mcgraph as mg
from mcgraph.apps import atomic_io
from bench.harness.measure import peak_rss_bytes
from mcgraph.apps.training_run import mlp
from bench.harness.records import git_commit
from bench import child_env

SIZES = (784, 1000, 1000, 10)
BATCH, DATASET = 32, 60_000
RHO_INIT = -3.0
BLITZ_PRIOR = dict(prior_pi=0.5, prior_sigma_1=1.0, prior_sigma_2=0.002)
PROVIDERS = ("mcgraph", "mcgraph-direct", "bayesian-torch", "bayesian-torch+mcgraph", "blitz", "blitz+mcgraph")
PEERS = {"bayesian-torch": "bayesian-torch+mcgraph", "blitz": "blitz+mcgraph"}
DEVICE = torch.device("cpu")  # where the models and the batch live (--device)


def _data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (BATCH,), generator=g)
    return x.to(DEVICE), y.to(DEVICE)


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _mlp():
    return mlp(SIZES[-1], SIZES[0], SIZES[1:-1], flatten=False)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


def _mlp_ce(x, y, pairs):
    h = x
    for k, (w, b) in enumerate(pairs):
        h = F.linear(h, w, b)
        if k < len(pairs) - 1:
            h = F.relu(h)
    return F.cross_entropy(h, y)


# --------------------------------------------------------------------------- models


def mcgraph_model():
    import mcgraph.nn as mnn

    torch.manual_seed(0)
    return mnn.bayesify(_mlp(), posterior="normal", prior="normal", rho_init=RHO_INIT, inplace=True)


def bayesian_torch_model():
    from bayesian_torch.models.dnn_to_bnn import dnn_to_bnn

    torch.manual_seed(0)
    model = _mlp()
    dnn_to_bnn(model, {"prior_mu": 0.0, "prior_sigma": 1.0, "posterior_mu_init": 0.0, "posterior_rho_init": RHO_INIT,
                       "type": "Reparameterization", "moped_enable": False})
    return model


def blitz_model():
    from blitz.modules import BayesianLinear
    from blitz.utils import variational_estimator

    @variational_estimator
    class MLP(torch.nn.Sequential):
        pass

    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(BayesianLinear(a, b, posterior_rho_init=RHO_INIT, **BLITZ_PRIOR))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.ReLU())
    return MLP(*layers)


def converted(provider: str):
    from mcgraph import interop

    if provider == "bayesian-torch+mcgraph":
        return interop.bayesian_torch.to_mcgraph(bayesian_torch_model(), kl_samples=1)
    return interop.blitz.to_mcgraph(blitz_model(), prior_floor=1e-6, kl_samples=1)


# --------------------------------------------------------------------------- losses (the negative ELBO per example)


def mcgraph_loss(model, x, y, M, method="chunked", kl_method="collapsed-exact"):
    import mcgraph.nn as mnn

    return -mnn.elbo(model, x, y, num_samples=mg.Sampling(M, method=method), dataset_size=DATASET, kl_samples=mg.Sampling(M, method=kl_method), seed=0)


def bayesian_torch_loss(model, x, y, M):
    from bayesian_torch.models.dnn_to_bnn import get_kl_loss

    total = 0
    for _ in range(M):
        total = total + F.cross_entropy(model(x), y) + get_kl_loss(model) / DATASET
    return total / M


def blitz_loss(model, x, y, M):
    return model.sample_elbo(x, y, torch.nn.CrossEntropyLoss(), sample_nbr=M, complexity_cost_weight=1 / DATASET)


def loss_fn(provider: str, model, x, y, M):
    if provider in ("mcgraph", "bayesian-torch+mcgraph"):
        return mcgraph_loss(model, x, y, M)
    if provider == "mcgraph-direct":
        return mcgraph_loss(model, x, y, M, method="direct")
    if provider == "blitz+mcgraph":
        return mcgraph_loss(model, x, y, M, kl_method="auto")
    if provider == "bayesian-torch":
        return bayesian_torch_loss(model, x, y, M)
    if provider == "blitz":
        return blitz_loss(model, x, y, M)
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def build(provider: str):
    """The model of ``provider``, on ``DEVICE``."""
    return _build(provider).to(DEVICE)


def _build(provider: str):
    if provider in ("mcgraph", "mcgraph-direct"):
        return mcgraph_model()
    if provider == "bayesian-torch":
        return bayesian_torch_model()
    if provider == "blitz":
        return blitz_model()
    if provider in ("bayesian-torch+mcgraph", "blitz+mcgraph"):
        return converted(provider)
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


# --------------------------------------------------------------------------- ρ-gradient against the reference


def mcgraph_grad_error(model, M: int, method: str = "chunked") -> float:
    """ρ-gradient of the data term of an mcgraph model against plain autograd on the run's noise."""
    import mcgraph.nn as mnn
    from mcgraph.engine.plan.families import family_of
    from mcgraph.nn.context import NoiseKind, sample_run

    x, y = _data()
    layers = mnn.bayesian_modules(model)
    model.zero_grad()
    (-mnn.expected_data_term(model, x, y, num_samples=mg.Sampling(M, method=method), seed=0)).backward()
    got = layers[0].weight_rho.grad.clone()
    run = sample_run(model, M, seed=0)
    with torch.no_grad():
        w_noise = [run.form_rows(l, NoiseKind.WEIGHT, family_of(l.posterior), 0, M) for l in layers]
        b_noise = [run.form_rows(l, NoiseKind.BIAS, family_of(l.bias_posterior), 0, M)
                   if l.bias_mu is not None else None for l in layers]
    loss = 0
    for i in range(M):
        pairs = [(l.weight_mu + l.weight_sigma * w_noise[k][i].clone(),
                  l.bias if l.bias_mu is None else l.bias_mu + l.bias_sigma * b_noise[k][i].clone())
                 for k, l in enumerate(layers)]
        loss = loss + _mlp_ce(x, y, pairs)
    (ref,) = torch.autograd.grad(loss / M, layers[0].weight_rho)
    return _rel_err(got, ref)


def peer_grad_error(provider: str, model, M: int) -> float:
    """The peer's own M-sample loop: its ρ-gradient against plain autograd on the noise it actually drew."""
    x, y = _data()
    layers = [m for m in model if not isinstance(m, torch.nn.ReLU)]
    if provider == "bayesian-torch":
        params = [(l.mu_weight, l.rho_weight, l.mu_bias, l.rho_bias) for l in layers]

        def noise(l):
            return l.eps_weight, l.eps_bias
    else:  # blitz trains its samplers' Parameters
        params = [(l.weight_sampler.mu, l.weight_sampler.rho, l.bias_sampler.mu, l.bias_sampler.rho) for l in layers]

        def noise(l):
            return l.weight_sampler.eps_w, l.bias_sampler.eps_w
    drawn = [[] for _ in layers]

    def hook(k):
        def fn(mod, inp, out):
            drawn[k].append(tuple(t.clone() for t in noise(mod)))
        return fn

    handles = [l.register_forward_hook(hook(k)) for k, l in enumerate(layers)]
    total = 0
    for _ in range(M):
        total = total + F.cross_entropy(model(x), y)
    for h in handles:
        h.remove()
    model.zero_grad()
    (total / M).backward()
    got = params[0][1].grad.clone()
    loss = 0
    for i in range(M):
        pairs = [(mu + torch.log1p(torch.exp(rho)) * drawn[k][i][0],
                  bmu + torch.log1p(torch.exp(brho)) * drawn[k][i][1]) for k, (mu, rho, bmu, brho) in enumerate(params)]
        loss = loss + _mlp_ce(x, y, pairs)
    (ref,) = torch.autograd.grad(loss / M, params[0][1])
    return _rel_err(got, ref)


def grad_error(provider: str, M: int) -> float:
    if provider in PEERS:
        return peer_grad_error(provider, build(provider), M)
    return mcgraph_grad_error(build(provider), M, "direct" if provider == "mcgraph-direct" else "chunked")


# --------------------------------------------------------------------------- one measurement


def measure(provider: str, M: int, reps: int, grad_samples: int) -> dict:
    import mcgraph as mg

    x, y = _data()
    model = build(provider)
    cuda = DEVICE.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(DEVICE)
        base = torch.cuda.memory_allocated(DEVICE)
    loss = loss_fn(provider, model, x, y, M)
    size = mg.graph_size(loss)
    del loss
    times = []
    for _ in range(reps):
        model.zero_grad(set_to_none=True)
        _sync()
        t0 = time.perf_counter()
        loss = loss_fn(provider, model, x, y, M)
        loss.backward()
        _sync()
        times.append(time.perf_counter() - t0)
        del loss
    peak_rss = peak_rss_bytes()  # VmHWM, before the gradient check's own graphs
    extra = {"peak_bytes": int(torch.cuda.max_memory_allocated(DEVICE) - base)} if cuda else {}
    grad_err = grad_error(provider, grad_samples) if grad_samples else None
    return {
        "provider": provider, "M": M, "batch": BATCH, "sizes": list(SIZES),
        "saved_bytes": size.saved_bytes, "nodes": size.nodes, "time_s": min(times), "times_s": times,
        "peak_rss_bytes": peak_rss,
        "rho_grad_rel_err": grad_err, "grad_samples": grad_samples,
        "device": DEVICE.type, "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "mcgraph": mg.__version__, "commit": git_commit(), **extra,
    }


def interleaved_times(peer: str, M: int, reps: int) -> dict:
    """Forward+backward times of a peer's loop and its ``+mcgraph`` provider alternated in one process."""
    x, y = _data()
    names = (peer, PEERS[peer])
    models = {name: build(name) for name in names}
    times: dict = {name: [] for name in names}
    for _ in range(reps):
        for name in names:
            models[name].zero_grad(set_to_none=True)
            _sync()
            t0 = time.perf_counter()
            loss = loss_fn(name, models[name], x, y, M)
            loss.backward()
            _sync()
            times[name].append(time.perf_counter() - t0)
            del loss
    best = {name: min(t) for name, t in times.items()}
    return {"provider": f"interleaved:{peer}", "M": M, "times_s": times, "peer_s": best[peer],
            "mcgraph_s": best[PEERS[peer]], "ratio": best[PEERS[peer]] / best[peer], "sizes": list(SIZES),
            "device": DEVICE.type, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "commit": git_commit()}


def _run_one(args, provider: str, M: int, grad_samples: int) -> dict | None:
    cmd = [sys.executable, "-m", "bench.elbo_peers", "--one", provider, str(M), "--reps", str(args.reps), "--grad-samples",
           str(grad_samples), "--threads", str(args.threads), "--sizes", *map(str, SIZES), "--device", args.device]
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if done.returncode:
        print(f"{provider} M={M} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(rows: list[dict], samples: list[int]) -> list[str]:
    """Lines comparing each peer with its ``+mcgraph`` provider, and the targets."""
    by = {(r["provider"], r["M"]): r for r in rows}
    lines = []
    for name in ("mcgraph", "bayesian-torch+mcgraph", "blitz+mcgraph"):
        one, top = by.get((name, samples[0])), by.get((name, samples[-1]))
        if one and top:
            ratio = top["peak_rss_bytes"] / one["peak_rss_bytes"]
            lines.append(f"{name}: peak RSS M={samples[-1]} / M={samples[0]} = {ratio:.2f} "
                         f"(target ≤ 1.3: {'met' if ratio <= 1.3 else 'NOT met'})")
    for peer, ours in PEERS.items():
        one, top = by.get((peer, samples[0])), by.get((peer, samples[-1]))
        if one and top:
            lines.append(f"{peer}: peak RSS M={samples[-1]} / M={samples[0]} = "
                         f"{top['peak_rss_bytes'] / one['peak_rss_bytes']:.1f}")
        for M in samples:
            a, b = by.get((ours, M)), by.get((peer, M))
            if a and b:
                ok = "" if M < 16 else f" (target ≤ 1: {'met' if a['time_s'] <= b['time_s'] else 'NOT met'})"
                lines.append(f"M={M}: {ours} / {peer} time {a['time_s'] / b['time_s']:.2f}x{ok}, peak RSS "
                             f"{a['peak_rss_bytes'] / 2**20:.0f} vs {b['peak_rss_bytes'] / 2**20:.0f} MiB")
    return lines


def main(argv=None) -> int:
    global SIZES, DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="MLP widths, input to output")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--grad-samples", type=int, default=4, help="M of the gradient check (0: skip)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--max-direct", type=int, default=64, help="largest M for mcgraph-direct")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the models and batch live")
    parser.add_argument("--out", default="bench/results/elbo_peers.jsonl")
    parser.add_argument("--interleaved", action="store_true",
                        help="also time each peer and its +mcgraph provider alternately in one process")
    parser.add_argument("--one", nargs=2, metavar=("PROVIDER", "M"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    SIZES, DEVICE = tuple(args.sizes), torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        provider, M = args.one[0], int(args.one[1])
        if provider.startswith("interleaved:"):
            row = interleaved_times(provider.split(":", 1)[1], M, args.reps)
        else:
            row = measure(provider, M, args.reps, args.grad_samples)
        print(json.dumps(row))
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for provider in args.providers:
        for M in args.samples:
            if provider == "mcgraph-direct" and M > args.max_direct:
                continue
            row = _run_one(args, provider, M, args.grad_samples if M == args.samples[0] else 0)
            if row is None:
                continue
            rows.append(row)
            atomic_io.append_line(out, json.dumps(row))
            err = row["rho_grad_rel_err"]
            print(f"{provider:23s} M={M:4d}  saved {row['saved_bytes'] / 2**20:9.1f} MiB  "
                  f"peak RSS {row['peak_rss_bytes'] / 2**20:9.1f} MiB  time {row['time_s']:8.3f} s"
                  + (f"  ρ-grad rel. err {err:.2e} (M={row['grad_samples']})" if err is not None else ""), flush=True)
    if args.interleaved:
        for peer in PEERS:
            if not {peer, PEERS[peer]} <= set(args.providers):
                continue
            for M in args.samples:
                row = _run_one(args, f"interleaved:{peer}", M, 0)
                if row is None:
                    continue
                atomic_io.append_line(out, json.dumps(row))
                print(f"interleaved {peer:14s} M={M:4d}  {PEERS[peer]} {row['mcgraph_s']:.3f} s  {peer} "
                      f"{row['peer_s']:.3f} s  ratio {row['ratio']:.2f}x", flush=True)
    for line in summary(rows, args.samples):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
