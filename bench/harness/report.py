"""Tables, the Markdown summary, the target checks and the PNG plots — all read from rows only."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Iterable

from mcgraph.apps import atomic_io
from .measure import format_bytes, format_seconds
from .records import Row
from .workloads import ALL_METHODS

_METHOD_ORDER = ALL_METHODS + ("randn",)


def _order(method: str) -> int:
    return _METHOD_ORDER.index(method) if method in _METHOD_ORDER else len(_METHOD_ORDER)


def groups(rows: Iterable[Row]) -> "OrderedDict[tuple[str, str], list[Row]]":
    """Ladder rows grouped by (workload, model), in first-seen order (max-M rows excluded)."""
    out: OrderedDict = OrderedDict()
    for r in rows:
        if not r.workload.endswith("-maxm"):
            out.setdefault((r.workload, r.model), []).append(r)
    return out


def _short_status(r: Row) -> str:
    s = r.status
    if s.startswith("skipped (predicted") and ("budget" in s):
        return "skip: mem"
    if s.startswith("skipped (predicted"):
        return "skip: time"
    if s.startswith("skipped ("):
        return "skip: " + s[len("skipped ("):].split(" at ")[0]
    if s.startswith("over time"):
        return "over time"
    if s.startswith("REFUSED"):
        return "REFUSED"
    if s.startswith("n/a"):
        return "n/a"
    if s.startswith("error"):
        return "error"
    return s


def _cell(r: Row | None, what: str) -> str:
    if r is None:
        return ""
    if not r.ok:
        return _short_status(r)
    if what == "bytes":
        return format_bytes(r.bytes)
    if what == "peak":
        return format_bytes(r.peak_over_base if r.peak_over_base is not None else r.peak)
    if what == "seconds":
        text = format_seconds(r.seconds)
        sp = [f"{v:.3g}×" if v is not None else "–" for v in (r.speedup_vs_direct, r.speedup_vs_grad_accum)]
        if r.method not in ("randn",) and any(v is not None for v in (r.speedup_vs_direct, r.speedup_vs_grad_accum)):
            text += f" ({sp[0]}|{sp[1]})"
        return text
    raise ValueError(what)


def wide(rows: list[Row], what: str) -> tuple[list[str], list[list[str]]]:
    """``(header, body)``: one line per method, one column per M."""
    ms = sorted({r.M for r in rows})
    by = {(r.method, r.M): r for r in rows}
    methods = sorted({r.method for r in rows}, key=_order)
    if what in ("bytes", "peak"):
        methods = [m for m in methods if m != "randn"]
        if what == "peak" and not any(r.peak is not None for r in rows):
            return [], []
    header = ["method"] + [f"M={m}" for m in ms]
    body = []
    for m in methods:
        cells = [_cell(by.get((m, M)), what) for M in ms]
        if what != "seconds" and all(c == "n/a" for c in cells if c):
            cells = ["n/a"] + [""] * (len(cells) - 1)
        body.append([m] + cells)
    return header, body


_TITLES = {"bytes": "bytes saved for backward",
           "peak": "peak memory over the pre-run baseline",
           "seconds": "forward + backward time, median (speed-up vs direct | vs grad-accum)"}


def _text_table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(b) for b in body])


def _md_table(header: list[str], body: list[list[str]]) -> str:
    esc = lambda c: str(c).replace("|", "\\|")  # noqa: E731
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(esc(c) for c in b) + " |" for b in body]
    return "\n".join(out)


def _case_title(key, rows: list[Row], notes: dict) -> str:
    workload, model = key
    r = rows[0]
    note = notes.get(key, "")
    return f"{workload} · {model}" + (f" — {note}" if note else "") + f" (P = {r.P:,}, {r.device})"


def maxm_rows(rows: Iterable[Row]) -> list[Row]:
    return [r for r in rows if r.workload.endswith("-maxm")]


def _maxm_table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    if not rows:
        return [], []
    models = list(OrderedDict.fromkeys((r.workload[:-5], r.model) for r in rows))
    methods = sorted({r.method for r in rows}, key=_order)
    by = {(r.workload[:-5], r.model, r.method): r for r in rows}
    header = ["workload · model"] + methods
    body = []
    for w, m in models:
        cells = []
        for meth in methods:
            r = by.get((w, m, meth))
            if r is None:
                cells.append("")
            elif r.status.startswith("≥"):
                cells.append(f"≥ {r.M:,} (cap)")
            elif r.status == "ok":
                cells.append(f"{r.M:,}" + ("*" if "extrapolated" in r.note else "~" if "interpolated" in r.note else ""))
            else:
                cells.append(r.status[:30])
        body.append([f"{w} · {m}"] + cells)
    return header, body


def text_report(rows: list[Row], notes: dict | None = None, targets: list | None = None) -> str:
    """The plain-text tables printed at the end of a run."""
    notes = notes or {}
    parts = []
    for key, rs in groups(rows).items():
        parts.append("== " + _case_title(key, rs, notes) + " ==")
        for what in ("bytes", "peak", "seconds"):
            header, body = wide(rs, what)
            if header:
                parts.append(f"{_TITLES[what]}:")
                parts.append(_text_table(header, body))
        parts.append("")
    header, body = _maxm_table(maxm_rows(rows))
    if header:
        budget = next((r.note.split(";")[0] for r in maxm_rows(rows)), "")
        parts.append(f"== max M under the memory budget ({budget}; * = extrapolated beyond, ~ = interpolated "
                     f"between measured M) ==")
        parts.append(_text_table(header, body))
        parts.append("")
    if targets:
        parts.append("== targets (reported, not tests) ==")
        for name, verdict, detail in targets:
            parts.append(f"[{verdict}] {name}: {detail}")
    return "\n".join(parts).rstrip() + "\n"


# --------------------------------------------------------------------------- targets


def _ok(rows, **kw) -> list[Row]:
    return [r for r in rows if r.ok and all(getattr(r, k) == v for k, v in kw.items())]


def check_targets(rows: list[Row]) -> list[tuple[str, str, str]]:
    """The issue's targets as ``(name, "PASS" | "FAIL" | "not measured", detail)``."""
    out = []
    ladder = [r for r in rows if not r.workload.endswith("-maxm")]

    # 1. flat memory of the collapsed and fused tiers
    details, verdicts = [], []
    for (w, model), rs in groups(ladder).items():
        for meth in ("collapsed", "fused"):
            ok = {r.M: r.bytes for r in _ok(rs, method=meth) if r.bytes is not None}
            if 1 not in ok or len(ok) < 2:
                continue
            top = 10_000 if 10_000 in ok else max(ok)
            ratio = ok[top] / max(ok[1], 1)
            verdicts.append(ratio <= 1.05 if top >= 10_000 else None)
            details.append(f"{w}/{model}/{meth}: {ratio:.3f} at M={top}")
    out.append(("collapsed & fused: bytes(M=10000) ≤ 1.05 × bytes(M=1)", _verdict(verdicts),
                "; ".join(details) or "no collapsed/fused rows"))

    # 2. training step of ResNet-18 at M = 1000
    rs = [r for r in ladder if r.workload == "step" and r.model == "resnet18" and r.M == 1000]
    mc = next((r for r in rs if r.method == "mcgraph" and r.ok), None)
    if mc is None:
        out.append(("step resnet18, M=1000: ≥ 10× faster than direct (or direct OOM), ≥ 14× than grad-accum",
                    "not measured", "no ok mcgraph row for step/resnet18 at M=1000"))
    else:
        direct = next((r for r in rs if r.method == "direct"), None)
        ga = next((r for r in rs if r.method == "grad-accum"), None)
        d_ok = (mc.speedup_vs_direct is not None and mc.speedup_vs_direct >= 10) or (
            direct is not None and (direct.status in ("OOM",) or "budget" in direct.status))
        g_ok = mc.speedup_vs_grad_accum is not None and mc.speedup_vs_grad_accum >= 14
        det = (f"vs direct: {_fmt_speed(mc.speedup_vs_direct, direct)}; "
               f"vs grad-accum: {_fmt_speed(mc.speedup_vs_grad_accum, ga)}")
        undecided = mc.speedup_vs_grad_accum is None
        out.append(("step resnet18, M=1000: ≥ 10× faster than direct (or direct OOM), ≥ 14× than grad-accum",
                    "not measured" if undecided and d_ok else ("PASS" if d_ok and g_ok else "FAIL"), det))

    # 3. max M: mcgraph ≥ 1000 × direct
    mm = maxm_rows(rows)
    details, verdicts = [], []
    for (w, model) in OrderedDict.fromkeys((r.workload, r.model) for r in mm):
        by = {r.method: r for r in mm if r.workload == w and r.model == model}
        d, m = by.get("direct"), by.get("mcgraph")
        if d is None or m is None or d.status not in ("ok",) or not (m.status == "ok" or m.status.startswith("≥")):
            continue
        ratio = m.M / max(d.M, 1)
        capped = m.status.startswith("≥")
        verdicts.append(True if ratio >= 1000 else (None if capped else False))
        details.append(f"{w[:-5]}/{model}: mcgraph {'≥ ' if capped else ''}{m.M:,} vs direct {d.M:,} "
                       f"→ {'≥ ' if capped else ''}{ratio:,.0f}×")
    out.append(("max M under the budget: mcgraph ≥ 1000 × direct's", _verdict(verdicts),
                "; ".join(details) or "no max-M rows for both direct and mcgraph"))

    # 4. collapsed vs plain randn (Gaussian noise: the KL pairs with a Normal posterior)
    details, verdicts, info = [], [], []
    for (w, model), rs in groups(ladder).items():
        col = {r.M: r.seconds for r in _ok(rs, method="collapsed")}
        rn = {r.M: r.seconds for r in _ok(rs, method="randn")}
        both = sorted(set(col) & set(rn))
        if not both:
            continue
        M = both[-1]
        ratio = col[M] / rn[M]
        if w != "kl":
            continue  # a network's forward dominates: not a sampling comparison
        if model.startswith("normal-"):
            verdicts.append(ratio <= 1.5)
            details.append(f"{w}/{model}: {ratio:.2f}× randn at M={M}")
        else:
            info.append(f"{w}/{model}: {ratio:.2f}× at M={M}")
    text = "; ".join(details) or "no Normal-posterior KL rows with collapsed and randn at a common M"
    if info:
        text += " (not Gaussian noise, for information: " + "; ".join(info) + ")"
    out.append(("collapsed within 1.5× of plain torch.randn for the same draws (Gaussian noise)",
                _verdict(verdicts), text))
    return out


def _fmt_speed(v, base: Row | None) -> str:
    if v is not None:
        return f"{v:.3g}×"
    if base is None:
        return "baseline not run"
    return f"baseline {base.status}"


def _verdict(vs: list) -> str:
    if not vs or all(v is None for v in vs):
        return "not measured"
    if any(v is False for v in vs):
        return "FAIL"
    return "PASS" if all(v is True for v in vs) else "PASS (partly measured)"


# --------------------------------------------------------------------------- Markdown


def markdown(rows: list[Row], meta: dict, targets: list, plots: list[str], notes: dict | None = None) -> str:
    notes = notes or {}
    env = meta.get("environment", {})
    lines = ["# mcgraph benchmark", ""]
    lines.append(f"- command: `{meta.get('command', '')}`")
    lines.append(f"- device: {env.get('device', '')} ({env.get('device_name', '')}), "
                 f"{env.get('cpu_count', '?')} CPU cores, torch {env.get('torch', '')}, "
                 f"commit {env.get('commit', '') or 'unknown'}")
    for k in ("mode", "sizes", "memory", "timing", "agreement", "budget", "load"):
        if meta.get(k):
            lines.append(f"- {k}: {meta[k]}")
    lines.append(f"- wall time of the run: {meta.get('wall_seconds', 0):.1f} s")
    lines.append("")
    lines.append("Methods: `direct` = per-sample loop holding every sample's graph (paper Fig. 4a); "
                 "`vectorised` = all M samples in one tensor; `grad-accum` = one backward per sample "
                 "(paper Fig. 5); `mcgraph` = `method=\"auto\"`; `collapsed`, `collapsed-exact`, `fused`, "
                 "`chunked` = that tier forced; `randn` = plain `torch.randn` of the same M·P draws. "
                 "`skip: mem`/`skip: time` = predicted from smaller M to exceed the budget/cap, not run; "
                 "`REFUSED` = disagreed with the reference at the same seed, so no time is reported.")
    lines.append("")
    if targets:
        lines.append("## Targets (reported, not tests)")
        lines.append("")
        lines.append(_md_table(["target", "verdict", "detail"], [list(t) for t in targets]))
        lines.append("")
    header, body = _maxm_table(maxm_rows(rows))
    if header:
        lines.append("## Max M under the memory budget")
        lines.append("")
        lines.append("(* = extrapolated linearly beyond the measured M; ~ = interpolated between measured M; "
                     "≥ = the search cap was reached)")
        lines.append("")
        lines.append(_md_table(header, body))
        lines.append("")
    for key, rs in groups(rows).items():
        lines.append(f"## {_case_title(key, rs, notes)}")
        lines.append("")
        for what in ("bytes", "peak", "seconds"):
            header, body = wide(rs, what)
            if header:
                lines.append(f"**{_TITLES[what]}**")
                lines.append("")
                lines.append(_md_table(header, body))
                lines.append("")
        flagged = [r for r in rs if r.status.startswith(("REFUSED", "error"))]
        for r in flagged:
            lines.append(f"- {r.method} at M={r.M}: {r.status}")
        if flagged:
            lines.append("")
    if plots:
        lines.append("## Plots")
        lines.append("")
        lines += [f"![{p}]({p})" for p in plots]
        lines.append("")
    lines.append("Rows: `rows.csv` / `rows.json` (one per point; `agreement` says how each matched the reference).")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- plots


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def plot(rows: list[Row], out_dir: str | Path) -> list[str]:
    """Log–log memory and time vs M per case, and a max-M bar chart per workload; returns file names."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    written = []
    for (w, model), rs in groups(rows).items():
        for what, ylabel in (("bytes", "bytes saved for backward"), ("seconds", "fwd + bwd seconds (median)")):
            fig, ax = plt.subplots(figsize=(6.4, 4.4))
            drawn = 0
            for meth in sorted({r.method for r in rs}, key=_order):
                if what == "bytes" and meth == "randn":
                    continue
                pts = sorted((r.M, getattr(r, what)) for r in rs
                             if r.method == meth and r.ok and getattr(r, what))
                pred = sorted((r.M, r.predicted_bytes if what == "bytes" else r.predicted_seconds) for r in rs
                              if r.method == meth and r.status.startswith("skipped (predicted")
                              and (r.predicted_bytes if what == "bytes" else r.predicted_seconds))
                if not pts:
                    continue
                style = dict(linestyle="--", color="black") if meth == "randn" else {}
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=meth, **style)
                if pred:
                    ax.plot([pts[-1][0]] + [p[0] for p in pred], [pts[-1][1]] + [p[1] for p in pred],
                            linestyle=":", marker="x", color=line.get_color())
                drawn += 1
            if not drawn:
                plt.close(fig)
                continue
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("M (Monte Carlo samples)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{w} · {model} (P = {rs[0].P:,}, {rs[0].device})", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8, title="dotted ×: predicted, skipped", title_fontsize=7)
            name = f"{'memory' if what == 'bytes' else 'time'}_{_safe(w)}_{_safe(model)}.png"
            fig.tight_layout()
            fig.savefig(out_dir / name, dpi=110)
            plt.close(fig)
            written.append(name)
    mm = maxm_rows(rows)
    for w in OrderedDict.fromkeys(r.workload for r in mm):
        rs = [r for r in mm if r.workload == w and (r.status == "ok" or r.status.startswith("≥"))]
        if not rs:
            continue
        models = list(OrderedDict.fromkeys(r.model for r in rs))
        methods = sorted({r.method for r in rs}, key=_order)
        fig, ax = plt.subplots(figsize=(max(6.4, 1.4 * len(models) * max(1, len(methods)) / 3), 4.4))
        width = 0.8 / len(methods)
        for j, meth in enumerate(methods):
            xs, hs, capped = [], [], []
            for i, model in enumerate(models):
                r = next((r for r in rs if r.model == model and r.method == meth), None)
                if r is not None and r.M > 0:
                    xs.append(i + (j - (len(methods) - 1) / 2) * width)
                    hs.append(r.M)
                    capped.append(r.status.startswith("≥"))
            bars = ax.bar(xs, hs, width=width, label=meth)
            for b, c in zip(bars, capped):
                if c:
                    b.set_hatch("//")
        ax.set_yscale("log")
        ax.set_ylim(bottom=max(0.5, min(r.M for r in rs if r.M > 0) / 10))
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models, rotation=20, fontsize=8)
        ax.set_ylabel("max M under the budget")
        ax.set_title(f"max feasible M ({w[:-5]}; hatched: reached the search cap)", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        name = f"maxm_{_safe(w[:-5])}.png"
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written


def write_all(rows: list[Row], meta: dict, out_dir: str | Path, notes: dict | None = None,
              plots: bool = True) -> dict:
    """rows.csv, rows.json, summary.md and the PNGs into ``out_dir``; returns the paths."""
    from .records import write_csv, write_json

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = check_targets(rows)
    meta = dict(meta, targets=[list(t) for t in targets],
                notes={f"{w}/{m}": n for (w, m), n in (notes or {}).items()})
    paths = {"csv": write_csv(rows, out_dir / "rows.csv"), "json": write_json(rows, meta, out_dir / "rows.json")}
    names = plot(rows, out_dir) if plots else []
    md = out_dir / "summary.md"
    atomic_io.write_text(md, markdown(rows, meta, targets, names, notes))
    paths["markdown"] = md
    paths["plots"] = [out_dir / n for n in names]
    return paths


__all__ = ["check_targets", "groups", "markdown", "plot", "text_report", "wide", "write_all"]
