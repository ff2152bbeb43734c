"""The agreement check: no time is reported for a wrong answer.

Every exact method (direct loop, vectorised, grad-accum, mcgraph and its
forced tiers) consumes the same noise for a given seed, so its value and
gradients must equal the reference's up to float rounding
(:func:`check_equal`). ``collapsed-exact`` draws the noise statistics from
their exact law — same distribution, different numbers — and is checked
statistically instead (:func:`check_same_law`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

import torch

#: Relative tolerance for float32 (value: relative to |value|; gradients: relative to the norm).
RTOL = {torch.float32: 1e-4, torch.float64: 1e-9, torch.float16: 1e-2, torch.bfloat16: 1e-2}

#: |t| threshold of :func:`check_same_law`. With K = 8 draws the statistic is
#: t-distributed with 7 degrees of freedom; P(|t| > 8) ≈ 9·10⁻⁵ per compared
#: scalar (two-sided), so a correct method is refused about once in 10⁴ checks.
T_THRESHOLD = 8.0


@dataclass(frozen=True)
class Outcome:
    """What one run of a method produced: the loss value and the parameter gradients."""

    value: float
    grads: tuple  # of tensors (None for an input that received no gradient)

    @classmethod
    def capture(cls, value, params: Sequence[torch.Tensor]) -> "Outcome":
        v = float(value.detach().double().sum()) if isinstance(value, torch.Tensor) else float(value)
        # host copies in the parameters' dtype (norms are taken in float64 when compared)
        return cls(v, tuple(None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in params))


@dataclass(frozen=True)
class Verdict:
    ok: bool
    detail: str

    def __bool__(self) -> bool:
        return self.ok


def _rel(a: float, b: float, floor: float) -> float:
    return abs(a - b) / max(abs(b), floor)


def check_equal(out: Outcome, ref: Outcome, rtol: float = 1e-4, atol: float = 1e-30) -> Verdict:
    """Same value and gradients as ``ref`` up to ``rtol`` (gradients: relative to the norm of ref's).

    Returns a :class:`Verdict` whose ``detail`` gives the worst relative errors.
    """
    if not math.isfinite(out.value):
        return Verdict(False, f"value {out.value} is not finite")
    v_err = _rel(out.value, ref.value, atol)
    worst = v_err
    parts = [f"value rel err {v_err:.1e}"]
    if len(out.grads) != len(ref.grads):
        return Verdict(False, f"{len(out.grads)} gradients vs {len(ref.grads)} in the reference")
    g_errs = []
    for k, (g, r) in enumerate(zip(out.grads, ref.grads)):
        if g is None and r is None:
            continue
        if g is None or r is None:
            return Verdict(False, f"gradient {k} is missing in {'the method' if g is None else 'the reference'}")
        if g.shape != r.shape:
            return Verdict(False, f"gradient {k} has shape {tuple(g.shape)}, reference {tuple(r.shape)}")
        if not bool(torch.isfinite(g).all()):
            return Verdict(False, f"gradient {k} has non-finite entries")
        err = float(torch.linalg.vector_norm(g.double() - r.double())) / max(
            float(torch.linalg.vector_norm(r, dtype=torch.float64)), atol)
        g_errs.append(err)
    if g_errs:
        worst = max(worst, *g_errs)
        parts.append(f"grad rel err {max(g_errs):.1e}")
    detail = ", ".join(parts)
    return Verdict(worst <= rtol, detail if worst <= rtol else f"{detail} > rtol {rtol:g}")


def _scalars(o: Outcome) -> list[tuple[str, float]]:
    out = [("value", o.value)]
    for k, g in enumerate(o.grads):
        if g is not None:
            out.append((f"sum(grad{k})", float(g.sum(dtype=torch.float64))))
            out.append((f"|grad{k}|", float(torch.linalg.vector_norm(g, dtype=torch.float64))))
    return out


def check_same_law(ref: Outcome, draws: Sequence[Outcome], threshold: float = T_THRESHOLD,
                   rtol: float = 1e-4) -> Verdict:
    """``ref`` looks like one more draw from the law of ``draws`` (independent seeds).

    For each scalar s (the value, and the sum and norm of each gradient), with
    mean m and standard deviation sd of s over the K draws,
    ``t = (s_ref − m) / (sd · sqrt(1 + 1/K))`` is t-distributed with K − 1 degrees
    of freedom when ``ref`` and the draws share a law; the check fails when
    ``|t| > threshold`` (see :data:`T_THRESHOLD` for the false-alarm rate). ``sd``
    is floored at ``rtol · |m|`` so a law with (numerically) no spread compares by
    relative error.
    """
    if len(draws) < 3:
        raise ValueError(f"draws must hold at least 3 outcomes, got {len(draws)}")
    k = len(draws)
    ref_s = _scalars(ref)
    draw_s = [_scalars(d) for d in draws]
    worst_name, worst_t = "", 0.0
    for i, (name, s) in enumerate(ref_s):
        xs = [d[i][1] for d in draw_s]
        m = statistics.fmean(xs)
        sd = max(statistics.stdev(xs), rtol * abs(m), 1e-30)
        t = abs(s - m) / (sd * math.sqrt(1 + 1 / k))
        if not math.isfinite(t) or t > worst_t:
            worst_name, worst_t = name, t
    detail = f"same law, different numbers: max |t| = {worst_t:.2f} ({worst_name}, {k} draws)"
    ok = math.isfinite(worst_t) and worst_t <= threshold
    return Verdict(ok, detail if ok else f"{detail} > {threshold:g}")
