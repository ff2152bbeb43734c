"""The harness: run every method of a case over the M ladder, check agreement, time, search max M.

For each M (ascending) and each method — the reference first, the cheapest exact
method that applies (:data:`~bench.harness.workloads.REFERENCE_ORDER`):

1. **predict** memory and time from the method's smaller-M measurements
   (:class:`~bench.harness.measure.LinearFit`); a point predicted to exceed the
   memory budget or the time cap is recorded ``skipped (predicted …)``, not run;
2. **run once** (the warm-up) measuring the bytes saved for backward, and on
   CUDA the peak allocation; out-of-memory or over-time is recorded, not raised;
3. **check agreement** with the reference at the same seed
   (:mod:`~bench.harness.agreement`); a disagreeing method is ``REFUSED`` and
   no time is reported for it;
4. **time** the median of the repeats (1 repeat for slow points in quick mode);
5. optionally run the point again in a fresh subprocess for its peak RSS.

A ``randn`` row per M gives the sampling floor: plain ``torch.randn`` for the
same M·P draws. :func:`search_max_m` then finds, per method, the largest M under
the max-M budget by doubling and bisection, running a probe only when it is
predicted cheap and extrapolating (and saying so) otherwise.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from dataclasses import dataclass, field

import torch

from .agreement import RTOL, Outcome, check_equal, check_same_law
from .measure import (
    CudaPeak, LinearFit, MaxM, Probe, format_bytes, format_seconds, is_oom, max_feasible_m, time_call, time_runs,
)
from .point import run_in_subprocess
from .progress import Progress
from .records import Row
from .workloads import REFERENCE_ORDER, SAME_LAW_ONLY, Case, NotApplicable, randn_floor


@dataclass
class Settings:
    """How points are run (the CLI fills this; see ``mcgraph bench --help``).

    Attributes:
        samples: the M ladder (ascending).
        methods: methods to compare (the reference is added when missing).
        seed: the noise seed shared by every method.
        repeats, warmup: timed repeats (median) and untimed warm-up runs (the first
            run, which also measures memory and agreement, counts as one warm-up).
        slow_seconds, slow_repeats: a point whose first run took longer than
            ``slow_seconds`` is timed ``slow_repeats`` times (quick mode: 1).
        time_cap: seconds; a point predicted (or found) slower is skipped (over time).
        run_budget: bytes; a point whose predicted peak exceeds it is skipped.
        peak_factor: predicted peak = ``peak_factor`` × predicted saved bytes when no
            peak is measured (CPU without ``rss``): transients (the (M, P) value and
            gradient buffers of the vectorised form) come on top of the saved tensors;
            measured peak RSS / saved bytes: ≈ 3.0–3.4 for ``vectorised``, ≈ 1–2 for ``direct``.
        rss: also run each point in a fresh subprocess for its peak RSS.
        randn: add the ``randn`` floor row per M.
        same_law_draws: draws (seeds) for the statistical check of ``collapsed-exact``.
        maxm_budget: bytes for the max-M search (the paper's 11 GB 2080 Ti).
        m_cap: the largest M the max-M search tries.
        maxm_methods: methods searched (default: all that ran).
        probe_time_cap: a max-M probe predicted slower than this is extrapolated, not run.
        probe_budget: seconds of probe runs per method and case; beyond it probes are extrapolated.
        device, dtype: where and in which precision parameters live.
        threads, flush_denormal: forwarded to per-point subprocesses.
    """

    samples: tuple = (1, 10, 100, 1000, 10000)
    methods: tuple = ()
    seed: int = 0
    repeats: int = 3
    warmup: int = 1
    slow_seconds: float = math.inf
    slow_repeats: int = 1
    time_cap: float = 60.0
    run_budget: float = math.inf
    peak_factor: float = 3.5
    rss: bool = False
    randn: bool = True
    same_law_draws: int = 8
    maxm_budget: float = 11e9
    m_cap: int = 2**20
    maxm_methods: tuple | None = None
    probe_time_cap: float = 10.0
    probe_budget: float = 120.0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    threads: int | None = None
    flush_denormal: bool = False
    commit: str = ""

    @property
    def memory_metric(self) -> str:
        """What the ``peak`` column holds (``bytes`` is always the saved-for-backward bytes)."""
        if self.device.type == "cuda":
            return "cuda max_memory_allocated"
        return "peak RSS (VmHWM) of a fresh subprocess" if self.rss else ""


class PointTimeout(Exception):
    pass


@contextlib.contextmanager
def alarm(seconds: float):
    """Interrupt the body after ``seconds`` (main thread, POSIX only; otherwise a no-op)."""
    usable = (math.isfinite(seconds) and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def handler(signum, frame):
        raise PointTimeout(f"interrupted after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class History:
    """Measured (M, bytes, peak, seconds) of one method, for predictions and max M."""

    bytes: list = field(default_factory=list)
    peak: list = field(default_factory=list)
    seconds: list = field(default_factory=list)
    failed_at: int | None = None
    failure: str = ""
    probe_seconds: float = 0.0

    def memory_fit(self, use_peak: bool) -> LinearFit | None:
        return LinearFit.through(self.peak if use_peak and self.peak else self.bytes)

    def time_fit(self) -> LinearFit | None:
        """Seconds vs M; from a single point, flat (its time): a fixed cost (a network's forward) may dominate
        it, so the proportional guess would skip the second point of every ladder. The second point is what
        the slope is learnt from; an unexpectedly slow one is stopped by the alarm and recorded over time."""
        pts = {m for m, _ in self.seconds}
        if len(pts) == 1:
            return LinearFit(self.seconds[-1][1], 0.0)
        return LinearFit.through(self.seconds)


class CaseRunner:
    """Runs one :class:`~bench.harness.workloads.Case` under :class:`Settings`, collecting :class:`Row` s."""

    def __init__(self, case: Case, settings: Settings, progress: Progress | None = None):
        self.case = case
        self.s = settings
        self.progress = progress or Progress(1, enabled=False)
        self.history: dict[str, History] = {}
        self.rows: list[Row] = []
        self.methods, self.not_applicable = self._methods()

    # ------------------------------------------------------------------ set-up

    def _methods(self) -> tuple[list, dict]:
        wanted = list(self.s.methods or self.case.methods)
        na = {}
        for m in list(wanted):
            why = self.case.applicable(m)
            if why is not None:
                na[m] = why
        ok = [m for m in wanted if m not in na]
        exact = [m for m in ok if m not in SAME_LAW_ONLY]
        if len(exact) < 2 or not exact:  # add the cheapest exact method as the reference
            for m in REFERENCE_ORDER:
                if m not in ok and m in self.case.methods and self.case.applicable(m) is None:
                    ok.append(m)
                    break
        ref_first = sorted(ok, key=lambda m: REFERENCE_ORDER.index(m) if m in REFERENCE_ORDER else 99)
        order = [m for m in ref_first if m in REFERENCE_ORDER][:1]
        order += [m for m in ok if m not in order]
        return order, na

    def points(self) -> int:
        return len(self.s.samples) * (len(self.methods) + int(self.s.randn))

    def _row(self, method: str, M: int, **kw) -> Row:
        return Row(workload=self.case.workload, model=self.case.model, method=method, P=self.case.P, M=M,
                   device=str(self.s.device), commit=self.s.commit, memory_metric=self.s.memory_metric, **kw)

    # ------------------------------------------------------------------ ladder

    def run(self) -> list[Row]:
        for m, why in self.not_applicable.items():
            self.rows.append(self._row(m, self.s.samples[0], status=f"n/a ({why})"))
        for M in self.s.samples:
            # 1. every method's first run (memory, value, gradients; the warm-up)
            firsts: dict[str, Outcome] = {}
            at_m: dict[str, Row] = {}
            for method in self.methods:
                self.progress.set(f"{self.case.workload} {self.case.model} M={M} {method}")
                row, outcome = self._first_run(method, M)
                at_m[method] = row
                if outcome is not None:
                    firsts[method] = outcome
                self.progress.advance()
            # 2. agreement: the reference is the cheapest method of the largest agreeing group
            ref_name = self._reference(firsts)
            for method, outcome in firsts.items():
                if not self._agrees(at_m[method], method, M, outcome, ref_name, firsts):
                    continue
                # 3. time the methods whose answer was accepted
                self._time(at_m[method], method, M)
            rows = [at_m[m] for m in self.methods]
            if self.s.randn:
                self.progress.set(f"{self.case.workload} {self.case.model} M={M} randn floor")
                rows.append(self._randn(M))
                self.progress.advance()
            _speedups(rows)
            self.rows.extend(rows)
        return self.rows

    def _reference(self, firsts: dict) -> str | None:
        """The first (cheapest) method of the largest group of mutually agreeing exact outcomes."""
        exact = [(m, o) for m, o in firsts.items() if m not in SAME_LAW_ONLY]
        groups: list[list[str]] = []
        for m, o in exact:
            for g in groups:
                if check_equal(o, firsts[g[0]], rtol=RTOL.get(self.s.dtype, 1e-4)):
                    g.append(m)
                    break
            else:
                groups.append([m])
        if not groups:
            return None
        rank = lambda m: REFERENCE_ORDER.index(m) if m in REFERENCE_ORDER else len(REFERENCE_ORDER)  # noqa: E731
        best = max(groups, key=lambda g: (len(g), -min(rank(m) for m in g)))
        return min(best, key=rank)

    def _agrees(self, row: Row, method: str, M: int, outcome: Outcome, ref_name: str | None,
                firsts: dict) -> bool:
        """Check ``outcome`` against the reference; a disagreeing row becomes ``REFUSED`` (and is not timed)."""
        s = self.s
        ref = firsts.get(ref_name)
        if method in SAME_LAW_ONLY:
            if ref is None:
                row.agreement = "unchecked (no exact reference ran at this M)"
                return True
            draws = [outcome] + [self._outcome(method, M, s.seed + k) for k in range(1, s.same_law_draws)]
            verdict = check_same_law(ref, draws)
        elif method == ref_name:
            others = [m for m in firsts if m != method and m not in SAME_LAW_ONLY]
            row.agreement = "reference" if others else "unchecked (the only exact method that ran at this M)"
            return True
        else:
            verdict = check_equal(outcome, ref, rtol=RTOL.get(s.dtype, 1e-4))
        row.agreement = f"vs {ref_name}: {verdict.detail}"
        if not verdict:
            row.status = f"REFUSED: disagrees ({verdict.detail})"
            row.bytes = row.value = row.peak = row.peak_over_base = None
        return bool(verdict)

    def _predict(self, method: str, M: int) -> tuple[float | None, float | None, float | None]:
        """(saved bytes, peak, seconds) at M from the method's measured smaller M (``None``: nothing measured)."""
        h = self.history.get(method)
        if h is None:
            return None, None, None
        use_peak = self.s.device.type == "cuda" or self.s.rss
        mf, tf, bf = h.memory_fit(use_peak), h.time_fit(), LinearFit.through(h.bytes)
        pred_mem = mf(M) if mf else None
        if pred_mem is None:
            peak = None
        elif use_peak and h.peak:
            peak = pred_mem
        else:
            peak = pred_mem * self.s.peak_factor
        return (bf(M) if bf else None), peak, (tf(M) if tf else None)

    def _first_run(self, method: str, M: int) -> tuple[Row, Outcome | None]:
        """Predict, then run once: memory, value and gradients (``None`` outcome when not run or failed)."""
        s, case = self.s, self.case
        h = self.history.setdefault(method, History())
        if h.failed_at is not None and M > h.failed_at:
            return self._row(method, M, status=f"skipped ({h.failure} at M={h.failed_at})"), None
        pred_bytes, pred_peak, pred_sec = self._predict(method, M)
        row = self._row(method, M, predicted_bytes=None if pred_bytes is None else int(pred_bytes),
                        predicted_seconds=pred_sec)
        if pred_peak is not None and pred_peak > s.run_budget:
            row.status = (f"skipped (predicted {format_bytes(pred_peak)} > budget {format_bytes(s.run_budget)})")
            return row, None
        if pred_sec is not None and pred_sec > s.time_cap:
            row.status = f"skipped (predicted {format_seconds(pred_sec)} > cap {format_seconds(s.time_cap)})"
            return row, None
        case.zero_grad()
        box = {}

        def first_run():
            box["out"] = case.run(method, M, s.seed, True)

        try:
            with alarm(3 * s.time_cap + 10), CudaPeak(s.device) as cp:
                first = time_call(first_run, s.device)
        except PointTimeout as e:
            h.failed_at, h.failure = M, "over time"
            row.status = f"over time ({e})"
            return row, None
        except Exception as e:  # noqa: BLE001 — recorded, never raised: one bad point must not end the run
            case.zero_grad()
            if is_oom(e):
                _free(s.device)
                h.failed_at, h.failure = M, "OOM"
                row.status = "OOM"
                return row, None
            if isinstance(e, NotApplicable):
                row.status = f"n/a ({e})"
                return row, None
            row.status = f"error: {type(e).__name__}: {str(e)[:200]}"
            return row, None
        out = box.pop("out")
        row.bytes = out.saved_bytes
        row.value = float(out.value.double().sum())
        row.seconds_min = first  # replaced by the timed runs
        if cp.peak is not None:
            row.peak, row.peak_over_base = cp.peak, cp.peak - (cp.base or 0)
        outcome = Outcome.capture(out.value, case.params)
        case.zero_grad()
        if first > s.time_cap:
            h.failed_at, h.failure = M, "over time"
            row.status = f"over time ({format_seconds(first)} > cap {format_seconds(s.time_cap)})"
            row.seconds = first
            h.bytes.append((M, row.bytes))
            return row, None
        return row, outcome

    def _time(self, row: Row, method: str, M: int) -> None:
        """Median of the timed repeats (after the extra warm-ups), then the optional subprocess peak RSS."""
        s, case = self.s, self.case
        h = self.history[method]
        first = row.seconds_min
        repeats = s.repeats if first <= s.slow_seconds else s.slow_repeats
        warm = max(0, s.warmup - 1)

        def once():
            case.zero_grad()
            case.run(method, M, s.seed)

        self.progress.set(f"{self.case.workload} {self.case.model} M={M} {method} (timing)")
        try:
            with alarm(3 * s.time_cap * (repeats + warm) + 10):
                t = time_runs(once, s.device, repeats, warm)
        except PointTimeout as e:
            row.status = f"over time ({e})"
            return
        except Exception as e:  # noqa: BLE001
            if is_oom(e):
                _free(s.device)
                row.status = "OOM"
                return
            raise
        finally:
            case.zero_grad()
        row.seconds, row.seconds_min, row.repeats = t.median, t.minimum, t.repeats
        if s.rss and s.device.type == "cpu":
            try:
                rep = run_in_subprocess(case.spec(), method, M, s.seed, timeout=3 * s.time_cap + 60,
                                        threads=s.threads, flush_denormal=s.flush_denormal)
                row.peak, row.peak_over_base = rep["peak"], rep["peak"] - rep["base"]
            except MemoryError:
                row.note = "subprocess ran out of memory"
            except (TimeoutError, RuntimeError) as e:
                row.note = f"rss: {e}"[:200]
        h.bytes.append((M, row.bytes))
        h.seconds.append((M, row.seconds_min))
        if row.peak is not None:  # CUDA: the absolute peak (what a device budget bounds); RSS: above the baseline
            absolute = s.device.type == "cuda" or row.peak_over_base is None
            h.peak.append((M, row.peak if absolute else row.peak_over_base))

    def _outcome(self, method: str, M: int, seed: int) -> Outcome:
        self.case.zero_grad()
        out = self.case.run(method, M, seed)
        o = Outcome.capture(out.value, self.case.params)
        self.case.zero_grad()
        return o

    def _randn(self, M: int) -> Row:
        s, P = self.s, self.case.P
        h = self.history.setdefault("randn", History())
        tf = h.time_fit()
        pred = tf(M) if tf else None
        row = self._row("randn", M, predicted_seconds=pred,
                        note=f"plain torch.randn of M·P = {M * P:.3g} normals (sampling floor)")
        if pred is not None and pred > s.time_cap:
            row.status = f"skipped (predicted {format_seconds(pred)} > cap {format_seconds(s.time_cap)})"
            return row
        first = time_call(lambda: randn_floor(P, M, s.device, s.dtype), s.device)
        repeats = s.repeats if first <= s.slow_seconds else s.slow_repeats
        t = time_runs(lambda: randn_floor(P, M, s.device, s.dtype), s.device, repeats, max(0, s.warmup - 1))
        row.seconds, row.seconds_min, row.repeats = t.median, t.minimum, t.repeats
        h.seconds.append((M, t.median))
        return row

    # ------------------------------------------------------------------ max M

    def search_max_m(self) -> list[Row]:
        """Largest M under ``maxm_budget`` per method (doubling, then bisection)."""
        s = self.s
        methods = [m for m in (s.maxm_methods or self.methods) if m in self.methods]
        rows = []
        for method in methods:
            self.progress.set(f"max M {self.case.workload} {self.case.model} {method}")
            h = self.history.get(method)
            if h is None or not h.bytes:
                rows.append(self._maxm_row(method, None, "not measured (no point of this method ran)"))
                continue
            if len({m for m, _ in h.bytes}) < 2:  # one point gives no slope: measure a second if it is cheap
                self._probe(method, 2 * max(m for m, _ in h.bytes), force=True)
            if len({m for m, _ in h.bytes}) < 2:
                rows.append(self._maxm_row(method, None, "not measured (fewer than two measured M, no slope)"))
                continue
            result = max_feasible_m(lambda M, m=method: self._probe(m, M), s.maxm_budget, m_cap=s.m_cap)
            rows.append(self._maxm_row(method, result, ""))
        self.progress.advance()
        self.rows.extend(rows)
        return rows

    def _probe(self, method: str, M: int, force: bool = False) -> Probe:
        """Memory at M: measured if the ladder ran it; interpolated between measured points; run if it is
        beyond them and predicted cheap (time and memory); else extrapolated from the last two measured."""
        s, h = self.s, self.history[method]
        use_peak = s.device.type == "cuda"
        series = {m: v for m, v in (h.peak if use_peak and h.peak else h.bytes) if v is not None}
        if M in series:
            return Probe(series[M], "measured")
        if h.failed_at is not None and M >= h.failed_at and h.failure == "OOM":
            return Probe(None, "oom")
        below = [m for m in series if m < M]
        above = [m for m in series if m > M]
        if below and above:
            lo, hi = max(below), min(above)
            return Probe(series[lo] + (series[hi] - series[lo]) * (M - lo) / (hi - lo), "interpolated")
        mf = h.memory_fit(use_peak)
        tf = h.time_fit()
        pred_mem = mf(M)
        pred_sec = tf(M) if tf else math.inf
        peak = pred_mem if use_peak else pred_mem * s.peak_factor
        cheap = pred_sec <= s.probe_time_cap and h.probe_seconds + pred_sec <= s.probe_budget
        if peak <= s.run_budget and (cheap or (force and pred_sec <= s.time_cap)):
            self.case.zero_grad()
            box = {}

            def probe_run():
                box["out"] = self.case.run(method, M, s.seed, True)

            try:
                with CudaPeak(s.device) as cp:
                    secs = time_call(probe_run, s.device)
                out = box.pop("out")
            except Exception as e:  # noqa: BLE001
                if is_oom(e):
                    _free(s.device)
                    return Probe(None, "oom")
                raise
            finally:
                self.case.zero_grad()
            h.probe_seconds += secs
            h.bytes.append((M, out.saved_bytes))
            h.seconds.append((M, secs))
            if cp.peak is not None:
                h.peak.append((M, cp.peak))
            return Probe(cp.peak if use_peak else out.saved_bytes, "measured")
        return Probe(pred_mem, "extrapolated")

    def _maxm_row(self, method: str, result: MaxM | None, why: str) -> Row:
        s = self.s
        metric = "cuda max_memory_allocated" if s.device.type == "cuda" else "saved-for-backward bytes"
        row = Row(workload=f"{self.case.workload}-maxm", model=self.case.model, method=method, P=self.case.P,
                  M=0, device=str(s.device), commit=s.commit, memory_metric=metric)
        if result is None:
            row.status = why
            return row
        row.M = result.m
        row.status = f"≥ cap {s.m_cap}" if result.capped else "ok"
        mem = dict((m, v) for m, v, _ in result.probes).get(result.m)
        row.bytes = None if mem is None else int(mem)
        measured = max((m for m, _, b in result.probes if b == "measured"), default=None)
        row.note = (f"budget {format_bytes(s.maxm_budget)}; {result.basis}"
                    + (f"; largest measured M = {measured}" if measured else ""))
        return row


def _speedups(rows: list[Row]) -> None:
    base = {r.method: r.seconds for r in rows if r.ok and r.seconds}
    for r in rows:
        if not (r.ok and r.seconds) or r.method == "randn":
            continue
        if "direct" in base:
            r.speedup_vs_direct = base["direct"] / r.seconds
        if "grad-accum" in base:
            r.speedup_vs_grad_accum = base["grad-accum"] / r.seconds


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_cases(cases: list[Case], settings: Settings, progress: Progress | None = None,
              max_m: bool = True) -> list[Row]:
    """The ladder (and the max-M search) for every case; rows in run order."""
    runners = [CaseRunner(c, settings, progress) for c in cases]
    if progress is not None:
        progress.add(sum(r.points() for r in runners) + (len(runners) if max_m else 0) - progress.total)
    rows = []
    for r in runners:
        rows.extend(r.run())
        if max_m:
            rows.extend(r.search_max_m())
    return rows


__all__ = ["CaseRunner", "History", "Settings", "alarm", "run_cases"]
