"""Bayesian LoRA on a causal language model: peak memory and time of ELBO training and of M-sample prediction.

Workload: a GPT-2 built from a config (random initialisation, never downloaded): ``--layers`` 4, width
``--width`` 256, ``--heads`` 4, vocabulary ``--vocab``, batches of ``--batch`` 8 sequences of ``--seq``
128 tokens (two rows right-padded by a quarter, their labels −100), rank-``--rank`` adapters on every
attention and MLP projection of the blocks (``transformer.h.*``: c_attn, c_proj, c_fc, c_proj).

Training providers (``--mode train``; one step = loss and its backward; the loss is the negative ELBO
per sequence, data term with the ``token_categorical`` likelihood, KL / N):

* ``lora`` — deterministic LoRA from **peft** (``LoraConfig``, same targets and rank, ``fan_in_fan_out``
  for GPT-2's Conv1D): one forward and backward (M does not apply; measured at M = 1);
* ``mcgraph`` — ``mg.nn.bayesian_lora`` + ``mg.nn.elbo(model, batch, likelihood="token_categorical")``:
  the chunked data term (one sample per chunk), memory of one sample for any M;
* ``naive`` — the same model, M plain forwards (fresh noise each) summed into one graph, then one
  backward: memory O(M);
* ``accumulate`` — the same model, M sequential forward/backward passes (gradient accumulation).

Prediction providers (``--mode predict``; the next-token predictive ``(B, V)`` averaged over M samples):

* ``mcgraph`` — ``mg.nn.predict(model, batch, M, likelihood="token_categorical")`` (one sample per chunk,
  ``logits_to_keep`` so only the positions needed are projected on the vocabulary);
* ``vectorised`` — all M samples in one forward of the batch repeated M times (``forward_samples``,
  full logits), then the softmax at each row's last position: memory O(M);
* ``loop`` — M sequential no-grad forwards of the full model, each adding its last-position softmax.

``lora-loop`` (both modes; asked for by name, not in the default ``--providers``): peft's LoRA model run
once per sample, M times — M forward and backward passes with the gradients accumulated (training), M
no-grad forwards averaging the last-position softmax (prediction): what M samples cost a peft user who
loops over them (peft draws nothing, so the M passes compute the same numbers; the cost is the point).

Each (mode, provider, M) runs in a fresh subprocess: ``peak_rss_bytes`` is its peak resident memory
(model, batch, an M = 1 warm-up and the timed steps), ``base_rss_bytes`` the resident memory once the
model and batch are built; ``time_s`` the fastest of ``--reps`` steps; ``saved_bytes`` the autograd graph of the
training loss (``mg.graph_size``, walked outside the timer). ``--interleaved`` also times mcgraph's
M = 1 step and peft's LoRA step alternately in one process, the fair ratio on a busy machine, and mcgraph's
8-sample prediction against the loop of 8 forwards the same way.

Rows go to ``--out`` (JSON lines: mode, provider, M, sizes, device, torch, transformers, peft, mcgraph,
commit); a markdown summary with the targets (mcgraph's peak RSS at the largest M ≤ 1.3× its M = 1 value,
for training and for prediction; mcgraph's M = 1 step ≤ 1.3× peft LoRA's) is printed.

``--device cuda`` puts the model and the batch on the GPU: the steps are timed with the device synchronised,
each row adds ``peak_bytes`` (``torch.cuda.max_memory_allocated`` over the warm-up and timed steps, above
``base_bytes``, the memory of the model and batch) and a point that runs out of device memory is a row with
that status. ``--randn-floor`` adds ``weights`` (P, the adapters' sampled weights) and ``randn_floor_s``,
the time of ``torch.randn`` of the step's normals on the device (:func:`bench.gpu_check.randn_floor_s`): 2·M·P
for a training step (the chunked estimator draws each sample's noise in the forward pass and again in the
backward), M·P for a prediction.

Usage (``make interop`` installs transformers and peft)::

    python -m bench.lora_lm --samples 1 8 32 128 --interleaved --out bench/results/lora_lm.jsonl
    python -m bench.lora_lm --device cuda --providers mcgraph lora lora-loop --randn-floor
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import mcgraph as mg
from mcgraph.apps import atomic_io
from bench.harness.records import git_commit
from bench import child_env

TOKEN = "token_categorical"
TARGETS = "transformer.h.*"  # every Conv1D of the blocks: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
PEFT_TARGETS = ["c_attn", "c_proj", "c_fc"]  # the same layers, as peft names them (suffixes)
DATASET = 10_000  # N, sequences in the (notional) training set
TRAIN = ("lora", "mcgraph", "naive", "accumulate")
PREDICT = ("mcgraph", "vectorised", "loop")
PEFT_LOOP = "lora-loop"  # peft's LoRA model run M times (both modes; only when named in --providers)
DEVICE = torch.device("cpu")  # where the model and the batch live (--device)


@dataclass(frozen=True)
class Sizes:
    layers: int = 4
    width: int = 256
    heads: int = 4
    vocab: int = 50257
    seq: int = 128
    batch: int = 8
    rank: int = 8


def _config(s: Sizes):
    import transformers

    return transformers.GPT2Config(n_layer=s.layers, n_embd=s.width, n_head=s.heads, vocab_size=s.vocab,
                                   n_positions=s.seq, bos_token_id=0, eos_token_id=0)


def pretrained(s: Sizes):
    """The 'pretrained' GPT-2 (seeded random initialisation), in eval mode (its own dropout off)."""
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(_config(s)).eval()


def batch(s: Sizes) -> dict:
    """``{"input_ids", "attention_mask", "labels"}``: two rows right-padded by a quarter of the sequence."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, s.vocab, (s.batch, s.seq), generator=g)
    lengths = torch.full((s.batch,), s.seq)
    lengths[: min(2, s.batch)] = max(2, s.seq - s.seq // 4)
    mask = (torch.arange(s.seq) < lengths[:, None]).long()
    out = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    return {k: v.to(DEVICE) for k, v in out.items()}


def build(provider: str, s: Sizes):
    """The model of ``provider``, on ``DEVICE``."""
    return _build(provider, s).to(DEVICE)


def _build(provider: str, s: Sizes):
    if provider in ("lora", PEFT_LOOP):
        import peft

        config = peft.LoraConfig(r=s.rank, lora_alpha=s.rank, target_modules=PEFT_TARGETS, fan_in_fan_out=True,
                                 lora_dropout=0.0)
        return peft.get_peft_model(pretrained(s), config)
    return mg.nn.bayesian_lora(pretrained(s), rank=s.rank, targets=TARGETS, rho_init=-4.0)


# --------------------------------------------------------------------------- losses (negative ELBO per sequence)


def _nll(model, b) -> torch.Tensor:
    """One forward's negative log-likelihood per sequence (the token likelihood mg.nn.elbo uses)."""
    inputs = {k: v for k, v in b.items() if k != "labels"}
    labels = b["labels"].masked_fill(b["attention_mask"] == 0, -100)
    return -mg.nn.token_log_likelihood(model(**inputs).logits, labels).mean()


def train_step(provider: str, model, b, M: int, seed: int, size: list | None = None) -> None:
    """Loss and backward of one step; ``size`` (a list) receives the loss's ``mg.graph_size`` (not timed)."""

    def measure(loss):
        if size is not None:
            pause = time.perf_counter()
            size.append(mg.graph_size(loss))
            size.append(time.perf_counter() - pause)  # the walk's time, subtracted by the caller

    if provider == "lora":
        loss = _nll(model, b)
        measure(loss)
        loss.backward()
    elif provider == PEFT_LOOP:  # M passes of peft's model, the gradients accumulated
        for i in range(M):
            loss = _nll(model, b) / M
            if i == 0:
                measure(loss)
            loss.backward()
    elif provider == "mcgraph":
        loss = -mg.nn.elbo(model, b, num_samples=M, dataset_size=DATASET, likelihood=TOKEN, seed=seed)
        measure(loss)
        loss.backward()
    elif provider == "naive":
        loss = sum(_nll(model, b) for _ in range(M)) / M + mg.nn.kl(model, seed=seed) / DATASET
        measure(loss)
        loss.backward()
    elif provider == "accumulate":  # the graph of one sample's loss at a time (the first one measured)
        for i in range(M):
            loss = _nll(model, b) / M
            if i == 0:
                measure(loss)
            loss.backward()
        (mg.nn.kl(model, seed=seed) / DATASET).backward()
    else:
        raise ValueError(f"provider must be one of {TRAIN} for training, got {provider!r}")


@torch.no_grad()
def predict(provider: str, model, b, M: int, seed: int) -> torch.Tensor:
    """``(B, V)`` next-token predictive over M samples."""
    inputs = {k: v for k, v in b.items() if k != "labels"}
    last = inputs["attention_mask"].sum(1) - 1  # right padding: the last attended position
    rows = torch.arange(last.shape[0], device=last.device)
    if provider == "mcgraph":
        return mg.nn.predict(model, inputs, M, seed=seed, likelihood=TOKEN)
    if provider == "vectorised":
        logits = mg.nn.forward_samples(model, inputs, M, seed=seed)  # (M, B, T, V): all samples in one forward
        return torch.softmax(logits[:, rows, last], -1).mean(0)
    if provider in ("loop", PEFT_LOOP):
        total = 0
        for _ in range(M):
            total = total + torch.softmax(model(**inputs).logits[rows, last], -1)
        return total / M
    raise ValueError(f"provider must be one of {PREDICT} for prediction, got {provider!r}")


# --------------------------------------------------------------------------- one measurement


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _versions() -> dict:
    import peft
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "mcgraph": mg.__version__, "commit": git_commit()}


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def sampled_weights(model) -> int:
    """P: the weights one sample of the adapters draws."""
    return sum(m.weight_mu.numel() + (m.bias_mu.numel() if getattr(m, "bias_mu", None) is not None else 0)
               for m in mg.nn.bayesian_modules(model))


def measure(mode: str, provider: str, M: int, reps: int, s: Sizes, randn_floor: bool = False) -> dict:
    model = build(provider, s)
    b = batch(s)
    base = _rss_now()
    cuda = DEVICE.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(DEVICE)
        base_bytes = torch.cuda.memory_allocated(DEVICE)
    times, size = [], None
    try:
        for rep in range(reps + 1):  # rep 0 warms up at M = 1 (the first call builds caches and masks)
            model.zero_grad(set_to_none=True)
            walk = []
            m = M if rep else 1
            _sync()
            t0 = time.perf_counter()
            if mode == "train":
                train_step(provider, model, b, m, seed=rep, size=walk if rep == 1 else None)
            else:
                predict(provider, model, b, m, seed=rep)
            _sync()
            elapsed = time.perf_counter() - t0
            if walk:
                size, elapsed = walk[0], elapsed - walk[1]
            if rep:
                times.append(elapsed)
    except torch.cuda.OutOfMemoryError:
        if not cuda:
            raise
        return {"mode": mode, "provider": provider, "M": M, "sizes": asdict(s), "status": "out of memory",
                "device": DEVICE.type, **_versions()}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    extra = {}
    if cuda:
        extra.update(peak_bytes=int(torch.cuda.max_memory_allocated(DEVICE) - base_bytes), base_bytes=int(base_bytes),
                     device_name=torch.cuda.get_device_name(DEVICE))
    if randn_floor:
        from bench.gpu_check import randn_floor_s

        P = sampled_weights(build("mcgraph", s))
        draws = (2 if mode == "train" else 1) * M * P
        extra.update(weights=P, draws=draws, randn_floor_s=randn_floor_s(draws, DEVICE))
    return {"mode": mode, "provider": provider, "M": M, "sizes": asdict(s), "time_s": min(times), "times_s": times,
            "peak_rss_bytes": peak, "base_rss_bytes": base,
            "saved_bytes": size.saved_bytes if size is not None else None,
            "device": DEVICE.type, "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(),
            **_versions(), **extra}


def interleaved(reps: int, s: Sizes) -> dict:
    """mcgraph's M = 1 ELBO step and peft LoRA's step, alternated in one process."""
    models = {p: build(p, s) for p in ("lora", "mcgraph")}
    b = batch(s)
    times: dict = {p: [] for p in models}
    for rep in range(reps + 1):
        for p, model in models.items():
            model.zero_grad(set_to_none=True)
            _sync()
            t0 = time.perf_counter()
            train_step(p, model, b, 1, seed=rep)
            _sync()
            if rep:
                times[p].append(time.perf_counter() - t0)
    best = {p: min(t) for p, t in times.items()}
    return {"mode": "interleaved", "provider": "mcgraph/lora", "M": 1, "sizes": asdict(s), "times_s": times,
            "lora_s": best["lora"], "mcgraph_s": best["mcgraph"], "ratio": best["mcgraph"] / best["lora"],
            "device": DEVICE.type, "threads": torch.get_num_threads(), **_versions()}


def interleaved_predict(reps: int, s: Sizes, M: int = 8) -> dict:
    """mcgraph's M-sample prediction and the loop of M forwards on the same model, alternated in one process."""
    model, b = build("mcgraph", s), batch(s)
    times: dict = {p: [] for p in ("mcgraph", "loop")}
    for rep in range(reps + 1):
        for p in times:
            _sync()
            t0 = time.perf_counter()
            predict(p, model, b, M if rep else 1, seed=rep)
            _sync()
            if rep:
                times[p].append(time.perf_counter() - t0)
    best = {p: min(t) for p, t in times.items()}
    return {"mode": "interleaved-predict", "provider": "mcgraph/loop", "M": M, "sizes": asdict(s), "times_s": times,
            "loop_s": best["loop"], "mcgraph_s": best["mcgraph"], "ratio": best["mcgraph"] / best["loop"],
            "device": DEVICE.type, "threads": torch.get_num_threads(), **_versions()}


# --------------------------------------------------------------------------- driver and summary


def _run_one(args, mode: str, provider: str, M: int) -> dict | None:
    if args.in_process:
        s = Sizes(**{k: getattr(args, k) for k in asdict(Sizes())})
        gc.collect()  # the previous point's model and graphs
        try:
            if mode == "interleaved":
                row = interleaved(max(3, args.reps), s)
            elif mode == "interleaved-predict":
                row = interleaved_predict(max(3, args.reps), s, M)
            else:
                row = measure(mode, provider, M, args.reps, s, args.randn_floor)
        except Exception as exc:  # noqa: BLE001 - a point that fails is named, the others still run
            print(f"{mode} {provider} M={M} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return None
        return {**row, "in_process": True}
    cmd = [sys.executable, "-m", "bench.lora_lm", "--one", mode, provider, str(M), "--reps", str(args.reps),
           "--threads", str(args.threads), "--device", args.device] + _size_args(args) + \
        (["--randn-floor"] if args.randn_floor else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if done.returncode:
        print(f"{mode} {provider} M={M} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def _size_args(args) -> list[str]:
    return [f"--{k}={getattr(args, k)}" for k in asdict(Sizes())]


def _units(row: dict) -> str:
    return "points of one process" if row.get("in_process") else "processes"


def summary(rows: list[dict]) -> list[str]:
    """A markdown table of the rows and the targets' verdicts."""
    mib = 2 ** 20
    device_columns = any("peak_bytes" in r or "randn_floor_s" in r for r in rows)
    lines = ["| mode | provider | M | time / step (s) | peak RSS (MiB) | RSS over base (MiB) | saved for backward "
             "(MiB) |" + (" peak device memory (MiB) | randn floor (s) |" if device_columns else ""),
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if device_columns else "")]
    for r in rows:
        if r["mode"].startswith("interleaved"):
            continue
        if "time_s" not in r:
            lines.append(f"| {r['mode']} | {r['provider']} | {r['M']} | {r.get('status', '—')} | | | |"
                         + (" | |" if device_columns else ""))
            continue
        saved = "" if r.get("saved_bytes") is None else f"{r['saved_bytes'] / mib:.1f}"
        extra = ""
        if device_columns:
            extra = (f" {r['peak_bytes'] / mib:.0f} |" if "peak_bytes" in r else " – |") + \
                (f" {r['randn_floor_s']:.4f} |" if "randn_floor_s" in r else " – |")
        lines.append(f"| {r['mode']} | {r['provider']} | {r['M']} | {r['time_s']:.3f} | "
                     f"{r['peak_rss_bytes'] / mib:.0f} | {(r['peak_rss_bytes'] - r['base_rss_bytes']) / mib:.0f} | "
                     f"{saved} |" + extra)
    lines.append("")
    rows = [r for r in rows if "status" not in r]
    by = {(r["mode"], r["provider"], r["M"]): r for r in rows}
    for mode in ("train", "predict"):
        ms = sorted(M for (md, p, M) in by if md == mode and p == "mcgraph")
        if len(ms) >= 2:
            one, top = by[(mode, "mcgraph", ms[0])], by[(mode, "mcgraph", ms[-1])]
            key, what = ("peak_bytes", "peak device memory") if "peak_bytes" in one and "peak_bytes" in top else \
                ("peak_rss_bytes", "peak RSS")
            ratio = top[key] / max(one[key], 1)
            lines.append(f"- {mode}: mcgraph {what} M={ms[-1]} / M={ms[0]} = {ratio:.2f} "
                         f"(target ≤ 1.3: {'met' if ratio <= 1.3 else 'NOT met'})")
    one, lora = by.get(("train", "mcgraph", 1)), by.get(("train", "lora", 1))
    if one and lora:
        ratio = one["time_s"] / lora["time_s"]
        lines.append(f"- train: mcgraph M=1 step / peft LoRA step = {ratio:.2f} (separate {_units(one)}; "
                     f"target ≤ 1.3: {'met' if ratio <= 1.3 else 'NOT met'})")
    for r in rows:
        if r["mode"] == "interleaved":
            lines.append(f"- train, interleaved in one process: mcgraph M=1 {r['mcgraph_s']:.3f} s / peft LoRA "
                         f"{r['lora_s']:.3f} s = {r['ratio']:.2f} (target ≤ 1.3: "
                         f"{'met' if r['ratio'] <= 1.3 else 'NOT met'})")
        if r["mode"] == "interleaved-predict":
            lines.append(f"- predict, interleaved in one process: mcgraph M={r['M']} {r['mcgraph_s']:.3f} s / loop of "
                         f"{r['M']} forwards {r['loop_s']:.3f} s = {r['ratio']:.2f}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--modes", nargs="+", default=["train", "predict"], choices=["train", "predict"])
    parser.add_argument("--providers", nargs="+", default=sorted(set(TRAIN) | set(PREDICT)),
                        choices=sorted(set(TRAIN) | set(PREDICT) | {PEFT_LOOP}))
    parser.add_argument("--max-naive", type=int, default=8, help="largest M for naive / vectorised (memory O(M))")
    parser.add_argument("--max-accumulate", type=int, default=128, help="largest M for accumulate / loop")
    parser.add_argument("--reps", type=int, default=2, help="timed steps per point (after an M = 1 warm-up)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--interleaved", action="store_true", help="also time mcgraph M=1 vs peft LoRA alternately")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model and batch live")
    parser.add_argument("--in-process", action="store_true",
                        help="measure every point in this process (no fresh process per point, so a point's peak RSS "
                             "includes the earlier ones'; for smoke runs)")
    parser.add_argument("--randn-floor", action="store_true",
                        help="add the time of torch.randn of the step's 2·M·P normals on the device to each row")
    parser.add_argument("--out", default="bench/results/lora_lm.jsonl")
    parser.add_argument("--report", action="store_true",
                        help="print the summary of the rows already in --out (the last row of each point) and exit")
    for k, v in asdict(Sizes()).items():
        parser.add_argument(f"--{k}", type=int, default=v)
    parser.add_argument("--one", nargs=3, metavar=("MODE", "PROVIDER", "M"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    s = Sizes(**{k: getattr(args, k) for k in asdict(Sizes())})
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        mode, provider, M = args.one[0], args.one[1], int(args.one[2])
        if mode == "interleaved":  # a ratio wants a few tries
            row = interleaved(max(3, args.reps), s)
        elif mode == "interleaved-predict":
            row = interleaved_predict(max(3, args.reps), s, M)
        else:
            row = measure(mode, provider, M, args.reps, s, args.randn_floor)
        print(json.dumps(row))
        return 0
    out = Path(args.out)
    if args.report:
        latest = {}
        for line in out.read_text().splitlines():
            r = json.loads(line)
            latest[(r["mode"], r["provider"], r["M"])] = r
        order = {"train": 0, "predict": 1, "interleaved": 2, "interleaved-predict": 3}
        for line in summary(sorted(latest.values(), key=lambda r: (order[r["mode"]], r["provider"], r["M"]))):
            print(line)
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    plan = []
    for mode in args.modes:
        for provider in (TRAIN if mode == "train" else PREDICT) + (PEFT_LOOP,):
            if provider not in args.providers:
                continue
            for M in args.samples:
                if provider == "lora" and M != 1:
                    continue
                if provider in ("naive", "vectorised") and M > args.max_naive:
                    continue
                if provider in ("accumulate", "loop", PEFT_LOOP) and M > args.max_accumulate:
                    continue
                plan.append((mode, provider, M))
    if args.interleaved:
        plan.append(("interleaved", "mcgraph/lora", 1))
        plan.append(("interleaved-predict", "mcgraph/loop", 8))
    for mode, provider, M in plan:
        t0 = time.perf_counter()
        row = _run_one(args, mode, provider, M)
        if row is None:
            continue
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        atomic_io.append_line(out, json.dumps(row))
        if "time_s" not in row and not mode.startswith("interleaved"):
            print(f"{mode:7s} {provider:10s} M={M:4d}  {row['status']}", flush=True)
        elif mode.startswith("interleaved"):
            print(f"{mode} M={M}: ratio {row['ratio']:.2f}", flush=True)
        else:
            print(f"{mode:7s} {provider:10s} M={M:4d}  time {row['time_s']:8.3f} s  peak RSS "
                  f"{row['peak_rss_bytes'] / 2**20:7.0f} MiB (base {row['base_rss_bytes'] / 2**20:.0f})", flush=True)
    for line in summary(rows):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
