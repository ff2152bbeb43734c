"""The cost of sampling in prediction: ``mg.nn.predict`` with M samples against M plain forwards.

Workloads (``--workload``):

* ``gpt2-lora`` — a GPT-2 built from a config (``--layers`` 2, width ``--width`` 64, 4 heads, vocabulary
  ``--vocab`` 1000, never downloaded) with ``mg.nn.bayesian_lora`` adapters of rank 8 on every projection
  of its blocks; a batch of ``--batch`` 64 sequences of ``--seq`` 32 tokens; the next-token predictive
  (``likelihood="token_categorical"``, the logits of the last position only);
* ``encoder`` — ``mg.nn.bayesify`` of a 2-layer ``nn.TransformerEncoder`` (width 32, 4 heads, feed-forward
  64) with a linear head on its mean token: a classifier; a batch of 128 sequences of 16 tokens.

Providers, each timed on the same batch, interleaved round by round (thread-CPU time on the CPU, CUDA
events' wall time on a GPU; the median of ``--reps`` rounds):

* ``loop`` — M plain forwards of the model under ``torch.no_grad()``, each drawing its own weights from
  torch's global generator (what a user writes by hand), summing the softmaxes;
* ``predict`` — ``mg.nn.predict(model, x, M)`` with its defaults;
* ``predict-loop`` / ``predict-batched`` — the same with ``vectorize=False`` (one forward per sample) and
  ``vectorize=True`` (a chunk's samples in one forward of the batch repeated), chunk sizes by default.

The ratio predict / loop is the overhead of mcgraph's seeded, chunked sampling. Rows go to ``--out``
(JSON lines with the environment); the summary prints the ratios.

Usage::

    python -m bench.predict_overhead --workload gpt2-lora encoder --samples 32 --reps 7
    python -m bench.predict_overhead --device cuda --samples 32 128
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import mcgraph as mg
from mcgraph.apps import atomic_io
from bench.harness.records import git_commit

WORKLOADS = ("gpt2-lora", "encoder")
PROVIDERS = ("loop", "predict", "predict-loop", "predict-batched")


def gpt2_lora(args, device):
    import transformers

    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=args.vocab,
                                     n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(config)
    model = mg.nn.bayesian_lora(base, 8, targets="transformer.h.*").to(device).eval()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    x = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def plain():
        return torch.softmax(model(**x, logits_to_keep=1).logits[:, -1], -1)

    return model, x, plain, "token_categorical"


class _EncoderClassifier(nn.Module):
    def __init__(self, width: int = 32, layers: int = 2, classes: int = 10):
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


def encoder(args, device):
    torch.manual_seed(0)
    model = mg.nn.bayesify(_EncoderClassifier()).to(device).eval()
    x = torch.randn(128, 16, 32, device=device)

    def plain():
        return torch.softmax(model(x), -1)

    return model, x, plain, "categorical"


BUILD = {"gpt2-lora": gpt2_lora, "encoder": encoder}


def _timer(device):
    if device.type == "cuda":
        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000
        return timed

    def timed(fn):
        t = time.thread_time()
        fn()
        return time.thread_time() - t
    return timed


def measure(workload: str, M: int, args, device) -> list[dict]:
    model, x, plain, likelihood = BUILD[workload](args, device)

    @torch.no_grad()
    def loop():
        total = 0
        for _ in range(M):
            total = total + plain()
        return total / M

    runs = {
        "loop": loop,
        "predict": lambda: mg.nn.predict(model, x, M, seed=0, likelihood=likelihood),
        "predict-loop": lambda: mg.nn.predict(model, x, mg.Sampling(M, vectorize=False), seed=0,
                                              likelihood=likelihood),
        "predict-batched": lambda: mg.nn.predict(model, x, mg.Sampling(M, vectorize=True), seed=0,
                                                 likelihood=likelihood),
    }
    runs = {k: v for k, v in runs.items() if k in args.providers}
    timed = _timer(device)
    for fn in runs.values():  # warm-up (and the first call's one-off work)
        fn()
    times = {k: [] for k in runs}
    for _ in range(args.reps):
        for name, fn in runs.items():
            times[name].append(timed(fn))
    base = statistics.median(times["loop"]) if "loop" in times else None
    env = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu": platform.processor() or platform.machine(), "commit": git_commit()}
    rows = []
    for name, ts in times.items():
        t = statistics.median(ts)
        rows.append({"bench": "predict_overhead", "workload": workload, "provider": name, "M": M, "time_s": t,
                     "vs_loop": (t / base) if base else None, "reps": args.reps, **env})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--samples", type=int, nargs="+", default=[32])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU; default: torch's)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", type=Path, default=None, help="append the rows to this JSON-lines file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    rows = []
    for workload in args.workload:
        for M in args.samples:
            for row in measure(workload, M, args, device):
                rows.append(row)
                ratio = "" if row["vs_loop"] is None else f"  {row['vs_loop']:.2f}x the loop"
                print(f"{workload:10s} M={M:<4d} {row['provider']:16s} {row['time_s'] * 1000:9.1f} ms{ratio}",
                      flush=True)
    if args.out is not None:
        text = args.out.read_text() if args.out.exists() else ""
        atomic_io.write_text(args.out, text + "".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
