"""Shared plumbing of the paper targets: result records, Markdown tables, plots, the index README.

Every target's ``run(out_dir, quick, seed)`` measures, then calls :func:`write_target`, which
writes three files from one :class:`TargetResult`:

* ``<target>.json`` — the raw measured rows (machine-readable, what the tables are made of),
  the comparison rows, the seeds, the scale and the wall time;
* ``<target>.md`` — the comparison table (quantity | paper | ours | scale | why different)
  followed by the target's own detail sections;
* ``<target>.png`` — drawn by the target's ``plot(result, path)`` from the same rows.

:func:`write_index` rebuilds ``README.md`` of the output folder from every ``<target>.json``
present, so running one target at a time keeps the index complete.

The helpers the targets share live here too: :func:`config_key` (the cache key of a run's settings),
:func:`fmt_mean_sd` (a mean ± sd cell), :func:`predictive_probs` (a trained model's predictive
distribution), :func:`with_dropout`, :func:`log_run` (a run's progress line) and :func:`bar_grid`
(mean ± sd bars of several arms). A target never imports another target's private names: what two
targets share is here, or a public, documented name of the target that owns it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from mcgraph.apps import atomic_io
from bench.harness.records import git_commit

PAPER = ("Nazarovs, Mehta, Lokhande, Singh. Graph Reparameterizations for Enabling 1000+ Monte Carlo "
         "Iterations in Bayesian Deep Neural Networks. UAI 2021")


@dataclass
class Comparison:
    """One line of a target's comparison table.

    Attributes:
        quantity: what is compared (``"max M, DenseNet-121, direct"``).
        paper: the published value, as printed (or read approximately off a figure: say so).
        ours: our value.
        scale: the scale we ran at (input size, batch, M, seeds, dataset…).
        why: why the numbers differ (or ``"—"`` when they agree by construction).
    """

    quantity: str
    paper: str
    ours: str
    scale: str
    why: str


@dataclass
class TargetResult:
    """Everything one target produced; serialised to ``<target>.json``.

    Attributes:
        target: the target's name (``"table1"``).
        title: the paper artefact(s) it regenerates.
        quick: run at toy scale (``--quick``).
        seed: the base seed; every seed used is listed in ``seeds``.
        seeds: the seeds actually used (or a description of how they derive from ``seed``).
        scale: one paragraph: what was run, at which size, and why not at the paper's.
        comparisons: the comparison rows (also shown in the index README).
        rows: raw measured rows (list of flat dicts).
        sections: extra Markdown sections ``(heading, body)`` for ``<target>.md``.
        status: ``"ok"``, or ``"reduced: …"`` when something needed was missing.
        wall_s: wall time of the run (set by :func:`timed`).
        env: versions and machine facts.
        params: the target's settings (what ``--quick`` chose), so a report can be rebuilt from the JSON.
        paper: the publication the target reproduces (default: the UAI 2021 paper of this folder).
    """

    target: str
    title: str
    quick: bool
    seed: int
    seeds: list = field(default_factory=list)
    scale: str = ""
    comparisons: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    sections: list = field(default_factory=list)
    status: str = "ok"
    wall_s: float = 0.0
    env: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    paper: str = PAPER

    def compare(self, quantity: str, paper, ours, scale: str, why: str) -> None:
        self.comparisons.append(Comparison(quantity, str(paper), str(ours), scale, why))

    def section(self, heading: str, body: str) -> None:
        self.sections.append((heading, body))

    def to_json(self) -> dict:
        d = asdict(self)
        d["comparisons"] = [asdict(c) if isinstance(c, Comparison) else c for c in self.comparisons]
        return d


def load_result(out_dir: str | os.PathLike, target: str) -> TargetResult:
    """The :class:`TargetResult` of ``<out_dir>/<target>.json``, comparisons and sections cleared
    (a target's ``report`` rebuilds them from the rows).

    Raises:
        FileNotFoundError: the target has not been run into ``out_dir``.
    """
    path = Path(out_dir) / f"{target}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run `python -m paper_tables {target}` first")
    data = json.loads(path.read_text())
    names = {f for f in TargetResult.__dataclass_fields__}
    result = TargetResult(**{k: v for k, v in data.items() if k in names})
    result.comparisons, result.sections = [], []
    return result


def environment() -> dict:
    """Versions and machine facts recorded with every target."""
    load = None
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        pass
    return {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "commit": git_commit(Path(__file__).parent),
            "load_average_1min_at_start": load, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def md_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A GitHub Markdown table (``|`` in cells escaped)."""
    def cell(v) -> str:
        return "" if v is None else str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def fmt_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "—"
    n = float(n)
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def fmt_params(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


def fmt_mean_sd(pair, scale: float = 1.0, digits: int = 3) -> str:
    """A Markdown cell ``"mean ± sd"`` of a ``(mean, sd)`` pair (both times ``scale``, ``digits`` decimals);
    ``"—"`` when the mean is ``None`` (no scored run)."""
    mean, sd = pair
    return "—" if mean is None else f"{mean * scale:.{digits}f} ± {sd * scale:.{digits}f}"


def config_key(cfg, *, default=None) -> str:
    """The cache key of a run: the first 10 hex digits of the SHA-1 of ``json.dumps(cfg, sort_keys=True)``
    (``default`` is passed on to :func:`json.dumps`: ``str`` for settings JSON cannot hold).

    Cached runs and the runs recorded in ``paper_tables/results`` are found by this string: changing how it
    is computed, or what a target puts into ``cfg``, makes every recorded run of that target run again."""
    return hashlib.sha1(json.dumps(cfg, sort_keys=True, default=default).encode()).hexdigest()[:10]


@torch.no_grad()
def predictive_probs(predictor: nn.Module, deterministic: bool, x: torch.Tensor, samples: int,
                     seed: int) -> torch.Tensor:
    """The predictive distribution ``(N, classes)`` (float64) of a trained model over ``x``, in batches of 1000:
    the softmax of ``predictor(x)`` when ``deterministic``, else :func:`mcgraph.nn.predict` with ``samples``
    weight samples, batch ``i`` seeded ``seed * 1_000_003 + i``."""
    import mcgraph.nn as mnn

    out = []
    for i, start in enumerate(range(0, x.shape[0], 1000)):
        xb = x[start:start + 1000]
        if deterministic:
            out.append(torch.softmax(predictor(xb), -1))
        else:
            out.append(mnn.predict(predictor, xb, samples, seed=seed * 1_000_003 + i))
    return torch.cat(out).double()


def with_dropout(model: nn.Module, p: float) -> nn.Module:
    """``model`` (changed in place) with ``Dropout(p)`` inserted after every ``ReLU`` or ``Tanh`` that feeds a
    ``Linear`` of a ``Sequential`` (the classifier), for MC dropout arms."""
    for module in list(model.modules()):
        if not isinstance(module, nn.Sequential):
            continue
        children = list(module.children())
        if not any(isinstance(c, nn.Linear) for c in children):
            continue
        out = []
        for i, child in enumerate(children):
            out.append(child)
            feeds_linear = any(isinstance(c, nn.Linear) for c in children[i + 1:i + 2])
            if isinstance(child, (nn.ReLU, nn.Tanh)) and feeds_linear:
                out.append(nn.Dropout(p))
        module._modules.clear()
        for j, child in enumerate(out):
            module.add_module(str(j), child)
    return model


def comparison_table(comparisons: Sequence) -> str:
    rows = [(c["quantity"], c["paper"], c["ours"], c["scale"], c["why"]) if isinstance(c, dict)
            else (c.quantity, c.paper, c.ours, c.scale, c.why) for c in comparisons]
    return md_table(("quantity", "paper", "ours", "scale", "why different"), rows)


def write_target(out_dir: str | os.PathLike, result: TargetResult,
                 plot: Callable[[TargetResult, Path], None] | None) -> dict:
    """Write ``<target>.json``, ``.md`` and ``.png``; then refresh the index README. Returns the JSON dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = result.to_json()
    atomic_io.write_json(out / f"{result.target}.json", data, indent=1, default=str)
    png = out / f"{result.target}.png"
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        try:
            plot(result, png)
        finally:
            plt.close("all")
    provenance = out / f"{result.target}.provenance.md"
    atomic_io.write_text(out / f"{result.target}.md", render_markdown(
        data, png.name if png.exists() else None, provenance.read_text() if provenance.is_file() else None))
    write_index(out)
    return data


def render_markdown(data: dict, png: str | None, provenance: str | None = None) -> str:
    """The target's Markdown page. ``provenance``: hand-written notes on how the recorded run was made (the
    commands, their wall time and the machine's load when runs were resumed or split over processes), kept
    in ``<target>.provenance.md`` beside the outputs and shown before the environment."""
    mode = "quick (toy scale)" if data["quick"] else "full"
    lines = [f"# {data['title']}", "",
             f"Target `{data['target']}`, mode: {mode}, base seed {data['seed']}, wall time "
             f"{data['wall_s']:.1f} s, status: {data['status']}.", "",
             f"Paper: {data.get('paper', PAPER)}.", "", "## Scale", "", data["scale"], ""]
    if data.get("seeds"):
        lines += [f"Seeds: {data['seeds']}", ""]
    lines += ["## Paper vs ours", "", comparison_table(data["comparisons"]), ""]
    if png:
        lines += [f"![{data['target']}]({png})", ""]
    for heading, body in data.get("sections", []):
        lines += [f"## {heading}", "", body, ""]
    if provenance:
        lines += ["## How the recorded run was made", "", provenance.strip(), ""]
    env = data.get("env", {})
    lines += ["## Environment", "", md_table(("key", "value"), sorted(env.items())), ""]
    return "\n".join(lines)


#: Order of the targets in the index (the CLI's ``all`` order).
ORDER = ("table1", "theorems", "fig2_left", "fig2_right", "fig1_fig6", "fig7_fig8", "vogn_table", "spike_slab",
         "sparse_vd_kl", "sparse_vd_table", "random_labels", "bbb_cnn", "ivon_table", "sequence_table", "lora_table")


def write_index(out_dir: str | os.PathLike) -> Path:
    """``README.md`` of the output folder: every target's comparison table, scale and wall time."""
    out = Path(out_dir)
    found = []
    for name in ORDER:
        p = out / f"{name}.json"
        if p.is_file():
            try:
                found.append(json.loads(p.read_text()))
            except json.JSONDecodeError:
                continue
    lines = ["# Paper tables and figures, regenerated at CPU scale", "",
             f"Paper: {PAPER}.", "",
             "Each artefact below shows the paper's value beside ours, the scale we ran at and why the "
             "numbers differ. Figures' values are read off the paper's text extraction where the text "
             "gives them; where only axis ticks are readable this is said. Regenerate with "
             "`python -m paper_tables all [--quick]` (see `paper_tables/README.md`).", "",
             md_table(("target", "artefact", "mode", "seed", "wall time", "status", "files"),
                      [(f"[{d['target']}]({d['target']}.md)", d["title"], "quick" if d["quick"] else "full",
                        d["seed"], f"{d['wall_s']:.1f} s", d["status"],
                        f"{d['target']}.md, {d['target']}.png, {d['target']}.json") for d in found]), ""]
    missing = [n for n in ORDER if n not in {d["target"] for d in found}]
    if missing:
        lines += [f"Not run into this folder yet: {', '.join(missing)}.", ""]
    for d in found:
        lines += [f"## {d['title']} (`{d['target']}`)", ""]
        if d.get("paper", PAPER) != PAPER:
            lines += [f"Paper: {d['paper']}.", ""]
        lines += [d["scale"], "", comparison_table(d["comparisons"]), ""]
        if (out / f"{d['target']}.png").is_file():
            lines += [f"![{d['target']}]({d['target']}.png)", ""]
    path = out / "README.md"
    atomic_io.write_text(path, "\n".join(lines))
    return path


def write_cache(path: str | os.PathLike, obj) -> None:
    """Atomically write a run cache (JSON): an interrupted full run leaves either the previous cache or the
    new one, so the resumed run never reads half a file."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_io.write_json(path, obj, indent=1, default=str)


def read_cache(path: str | os.PathLike):
    """A run cache written by :func:`write_cache`, or ``None`` when it is absent or unreadable (a torn file
    left by an older version: the run is recomputed)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def run_arms(result: "TargetResult", s: dict, seed: int, arms, labels: dict, run_arm, runs_dir) -> list[dict]:
    """Every arm × seed of a table of training runs (``run_arm(arm, s, seed, runs_dir) -> row``, cached by
    the target), timed into ``result``, under ``s["threads"]`` torch threads when set; sets
    ``result.seeds`` and returns the rows (each with its ``arm``)."""
    import torch

    seeds = [seed + i for i in range(s["seeds"])]
    runs = []
    threads = torch.get_num_threads()
    if s.get("threads"):
        torch.set_num_threads(s["threads"])
    try:
        with timed(result):
            for sd in seeds:
                for arm in arms:
                    r = run_arm(arm, s, sd, runs_dir)
                    r["arm"] = arm
                    runs.append(r)
                    log_run(f"{labels[arm]} seed {sd}", r)
    finally:
        torch.set_num_threads(threads)
    result.seeds = seeds
    return runs


def cached_row(cache, key: str) -> dict | None:
    """The row cached at ``cache`` (marked ``cached``) when it was computed for ``key``; ``None`` when there is
    no cache, it is unreadable, or it belongs to other settings (the run is then recomputed)."""
    old = None if cache is None else read_cache(cache)
    if isinstance(old, dict) and old.get("key") == key:
        return old | {"cached": True}
    return None


def recorded_runs(out_dir, target: str, quick: bool, scored, blocks=("runs",)) -> dict:
    """``{key: row}`` (marked ``cached``) of the runs recorded in ``out_dir``'s ``<target>.json`` at the same
    scale, from its row lists ``blocks``, that ``scored(row)`` accepts. The ``<target>_runs/`` caches are not
    versioned: a recorded run with the same key is the same run, so it is not trained again."""
    try:
        old = load_result(out_dir, target)
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if old.quick != quick or not isinstance(old.rows, dict):
        return {}
    rows = [r for block in blocks for r in old.rows.get(block, [])]
    return {r["key"]: r | {"cached": True} for r in rows if "key" in r and scored(r)}


def reusing(recorded: dict, run_arm, key_of):
    """``run_arm(arm, s, seed, runs_dir)`` that returns the recorded row (:func:`recorded_runs`) when one has
    the run's key ``key_of(arm, s, seed)``, and trains otherwise."""
    def run_or_reuse(arm, s, seed, runs_dir):
        row = recorded.get(key_of(arm, s, seed))
        return dict(row) if row is not None else run_arm(arm, s, seed, runs_dir)
    return run_or_reuse


def paired(rs: list, base: list, scores=("accuracy", "nll", "ece")) -> dict | None:
    """Per-seed differences ``arm − base`` of the test ``scores`` (``r["test"]``) on the seeds both rows lists
    have: ``{score: (mean, sample sd, pairs)}``; ``None`` when no seed is shared."""
    import numpy as np

    by_seed = {r["seed"]: r for r in base if "test" in r}
    pairs = [(r, by_seed[r["seed"]]) for r in rs if "test" in r and r["seed"] in by_seed]
    if not pairs:
        return None
    out = {}
    for k in scores:
        d = [a["test"][k] - b["test"][k] for a, b in pairs]
        out[k] = (float(np.mean(d)), float(np.std(d, ddof=1)) if len(d) > 1 else 0.0, len(d))
    return out


def verdict(ok: bool, why_not: str) -> str:
    """A claim row's verdict: ``"reproduced"``, or ``"not reproduced, because <why_not>"``."""
    return "reproduced" if ok else f"not reproduced, because {why_not}"


_DEADLINE: float | None = None


def set_deadline(seconds: float | None) -> None:
    """Stop long runs (:func:`paper_tables.curves.train_epochs`) after the epoch that passes ``seconds``
    from now; ``None`` removes the deadline. The stopped runs report the epochs they reached and resume
    when run again."""
    global _DEADLINE
    _DEADLINE = None if seconds is None else time.monotonic() + float(seconds)


def out_of_time() -> bool:
    """Whether the deadline of :func:`set_deadline` has passed."""
    return _DEADLINE is not None and time.monotonic() >= _DEADLINE


def log(msg: str) -> None:
    """One progress line on stderr (targets that run for minutes say what they are doing)."""
    import sys

    print(f"[paper_tables]   {msg}", file=sys.stderr, flush=True)


#: The test metrics :func:`log_run` can name, as it names them.
_METRIC_NAMES = {"accuracy": "test accuracy", "nll": "NLL", "ece": "ECE"}


def log_run(label: str, r: dict, metrics: Sequence[str] = ("accuracy", "ece")) -> None:
    """One progress line for a training run's row: its test ``metrics`` and seconds per epoch (or "cached"),
    or why it has none (``r["missing"]``, or a deadline that came before its first epoch)."""
    if "test" not in r:
        log(f"{label}: " + r.get("missing", "stopped by the budget before its first epoch (resumes when run again)"))
        return
    took = "cached" if r.get("cached") else f"{r['seconds_per_epoch']:.2f} s/epoch"
    log(f"{label}: " + ", ".join(f"{_METRIC_NAMES[m]} {r['test'][m]:.4f}" for m in metrics) + f" ({took})")


def bar_grid(blocks: Sequence, metrics: Sequence, labels: dict, path, title: str, *,
             size: tuple[float, float] = (16, 3.8), rotation: float = 30, zoom: Sequence[str] = ()) -> None:
    """Mean ± sd bars of several arms, one row of panels per block and one panel per metric.

    ``blocks``: ``(name, {arm: {metric: (mean, sd) | None}})`` per row; ``metrics``: ``(key, label, scale)``
    per column; ``labels``: arm -> bar label, in the bars' order (arms a block lacks are left out);
    ``size``: the figure's width and each row's height (inches); ``zoom``: metrics whose y-axis starts 10
    below the lowest bar (accuracies close to 100). A metric missing for an arm is an empty bar.
    """
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(blocks), len(metrics), figsize=(size[0], size[1] * len(blocks)), squeeze=False)
    for row, (name, agg) in zip(axes, blocks):
        arms = [a for a in labels if a in agg]
        for ax, (key, label, scale) in zip(row, metrics):
            stats = [agg[a].get(key) or (None, None) for a in arms]
            means = [m * scale if m is not None else math.nan for m, _ in stats]
            sds = [sd * scale if sd is not None else 0 for _, sd in stats]
            ax.bar([labels[a] for a in arms], means, yerr=sds)
            ax.set_title(f"{name}: {label}")
            ax.tick_params(axis="x", labelrotation=rotation)
            finite = [m for m in means if not math.isnan(m)]
            if key in zoom and finite:
                ax.set_ylim(max(0, min(finite) - 10), 100)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


class timed:
    """``with timed(result): ...`` sets ``result.wall_s`` and ``result.env``."""

    def __init__(self, result: TargetResult):
        self.result = result

    def __enter__(self):
        self.result.env = environment()
        self.start = time.perf_counter()
        return self.result

    def __exit__(self, *exc):
        self.result.wall_s = time.perf_counter() - self.start
        return False
