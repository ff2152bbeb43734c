"""The tolerances of the same-noise contract, shared by the table-driven and the property tests.

float64: rtol 1e-9 with an absolute floor of 1e-9 × the largest magnitude of the
reference (the collapsed tier expands polynomials, so terms cancel differently than
in the direct sum). A gradient is that of ``value.sum()``, a sum over the output's
entries: its floor is taken from the largest of those summands (the output's Jacobian
entries, ``gradient_summands``) where the sum cancels them. float32: rtol 2e-4 / atol 2e-4 × magnitude — a degree-3
expansion with |w| up to ~10 loses about 3 decimal digits of float32's ~7 to
cancellation, and chunked sums reorder additions.
"""

from __future__ import annotations

import torch

#: dtype -> (rtol, atol as a fraction of the reference's largest magnitude, at least 1).
TOLERANCES = {torch.float64: (1e-9, 1e-9), torch.float32: (2e-4, 2e-4)}


def _magnitude(x: torch.Tensor) -> float:
    finite = x[torch.isfinite(x)]
    return max(1.0, float(finite.abs().max())) if finite.numel() else 1.0


def assert_same(ref, got, rtol: float, atol_factor: float, what: str, none_is_zero: bool = False,
                witness=None, summands=None) -> None:
    """``got = (value, grads)`` equals ``ref`` within the tolerances (NaN equals NaN).

    ``none_is_zero``: an absent gradient (``None``) counts as a zero one; otherwise the
    connectivity (which gradients are ``None``) must agree.
    ``witness``: ``None`` or a callable giving ``(value, grads)`` of the reference recomputed another
    way on the same noise (in float64; gradients by reverse mode, by forward mode where that overflows),
    or ``None``; it judges entries that are non-finite in the reference and finite here.
    ``summands``: ``None`` or a callable giving ``(value, [per gradient])``, the magnitudes of what the
    compared numbers sum: the terms a tier's linear split adds in its own order (and, for gradients, the
    output entries ``v_j`` whose ``Σ_j`` is differentiated). Where a sum cancels large summands
    (``x − x.mean()`` is zero whatever ``x``), its rounding scales with them, not with the result, and
    so does the absolute floor (asked for only where a comparison misses the plain tolerance).

    Where the reference's value is ±inf or NaN, the expectation has no derivative: gradients are
    compared only where both sides give a finite number (``relu``'s backward masks the −inf of
    ``−log relu(w)`` to a zero, a forward rule divides the zero tangent by a zero: NaN).
    """
    (rv, rg), (gv, gg) = ref, got
    no_derivative = not bool(torch.isfinite(rv).all())
    recomputed_value = lambda: _witnessed(witness, None, rv)  # noqa: E731
    rv, gv = _non_finite_alike(rv, gv, f"{what} value", recomputed_value, rtol)
    _close_or_as_accurate(gv, rv, rtol, atol_factor * _magnitude(rv), f"{what} value", recomputed_value,
                          wider_atol=lambda: atol_factor * max(1.0, summands()[0]) if summands else 0.0)
    for k, (a, b) in enumerate(zip(rg, gg)):
        if none_is_zero:
            if a is None and b is None:
                continue
            a = torch.zeros_like(b) if a is None else a
            b = torch.zeros_like(a) if b is None else b
        assert (a is None) == (b is None), f"{what}: gradient {k} connectivity differs"
        if a is not None:
            recomputed = lambda k=k, a=a: _witnessed(witness, k, a)  # noqa: E731
            if no_derivative:
                both = torch.isfinite(a) & torch.isfinite(b)
                a, b = a[both], b[both]
                recomputed = lambda r=recomputed, both=both: None if r() is None else r()[both]  # noqa: E731
            a, b = _non_finite_alike(a, b, f"{what} grad {k}", recomputed, rtol)
            _close_or_as_accurate(b, a, rtol, atol_factor * _magnitude(a), f"{what} grad {k}", recomputed,
                                  wider_atol=lambda k=k: atol_factor * max(1.0, summands()[1][k]) if summands else 0.0)


#: How much farther from the wider recomputation than the reference a tier may be, where the
#: reference itself is farther from it than the tolerance.
ACCURACY_FACTOR = 4.0


def _close_or_as_accurate(b, a, rtol: float, atol: float, what: str, recomputed, wider_atol=None) -> None:
    """``b`` equals the reference ``a`` within the tolerances, or is nearly as accurate as ``a``.

    The fixed float32 tolerance assumes a well-conditioned integrand. A nested log-density (a
    scale-mixture prior of a scale mixture's log-density, both with σ ≈ 0.0025) amplifies float32's
    rounding a thousandfold, so the reference is itself 6e-4 (relative) away from the same
    computation in float64, and a tier that multiplies in another order lands elsewhere at that
    distance. Such a tier passes when, entry by entry, its error against a recomputation in a
    wider dtype is at most ``ACCURACY_FACTOR`` × the reference's plus the tolerance.

    ``wider_atol``: ``None`` or a callable giving an absolute floor from the magnitude of what the
    compared number sums (asked for only when ``atol`` fails); it replaces ``atol`` when larger.
    """
    try:
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")
        return
    except AssertionError:
        if wider_atol is not None:
            atol = max(atol, wider_atol())
    try:
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")
    except AssertionError:
        r = recomputed()
        if r is None or torch.finfo(r.dtype).eps >= torch.finfo(b.dtype).eps:
            raise
        r, a64, b64 = r.to(torch.float64), a.to(torch.float64), b.to(torch.float64)
        both = torch.isfinite(a64) & torch.isfinite(b64)
        allowed = ACCURACY_FACTOR * (a64 - r).abs() + atol + rtol * r.abs()
        worse = both & ~((b64 - r).abs() <= allowed)
        if bool(worse.any()):
            raise AssertionError(f"{what}: not within the tolerance of the reference, and farther from the "
                                 f"recomputation in {r.dtype} than {ACCURACY_FACTOR}× the reference: "
                                 f"{b64[worse].tolist()} vs reference {a64[worse].tolist()}, recomputed "
                                 f"{r[worse].tolist()}") from None
        torch.testing.assert_close(b[~both], a[~both], equal_nan=True, msg=lambda m: f"{what}: {m}")


def _witnessed(witness, k: int | None, like: torch.Tensor):
    """The witness's value (``k`` is ``None``) or ``k``-th gradient (an absent one is zero)."""
    out = witness() if witness is not None else None
    if out is None:
        return None
    value, grads = out
    if k is None:
        return value
    return torch.zeros_like(like, dtype=torch.float64) if grads[k] is None else grads[k]


def _non_finite_alike(a: torch.Tensor, b: torch.Tensor, what: str, recomputed=lambda: None, rtol: float = 0.0):
    """Where the reference ``a`` is ±inf or NaN, ``b`` must be non-finite too, or equal (within
    ``rtol``) the recomputation ``recomputed()``; such entries are then compared as NaN.

    An overflowed sample makes the estimate non-finite, and which of −inf, +inf or NaN comes out
    depends on the order of the additions: ``w + log p(w)`` at ``w = inf`` is NaN per sample and
    ``−inf`` when split into terms. Likewise for gradients: a generic form's chunk is a slice of a
    block's ``rsample`` graph, so its backward multiplies the other rows' zero gradient by their
    infinite local derivative (0·inf = NaN) where the direct estimator sums −inf terms. And the
    order of the chain rule's products decides whether a finite gradient overflows on the way:
    reverse mode forms ``softplus(w)**-4`` before multiplying by ``sigmoid(w)``, and multiplies
    ``clamp``'s zero derivative by ``exp(w) = inf``; forward rules multiply the other way and stay
    finite. Such a finite ``b`` must then equal the recomputation in float64 on the same noise
    (gradients by reverse mode where that is finite in float64, else by forward mode).
    """
    bad = ~torch.isfinite(a)
    if not bool(bad.any()):
        return a, b
    finite_here = bad & torch.isfinite(b)
    if bool(finite_here.any()):
        r = recomputed()
        assert r is not None, f"{what}: non-finite in the reference, finite here (no recomputation to judge it)"
        r = r.to(b.dtype)  # a true value beyond b's range rounds to ±inf here, and then b cannot match it
        torch.testing.assert_close(b[finite_here], r[finite_here], rtol=rtol, atol=0.0,
                                   msg=lambda m: f"{what}: non-finite in the reference, finite here and not the "
                                                 f"recomputation: {m}")
    nan = torch.full_like(a, float("nan"))
    return torch.where(bad, nan, a), torch.where(bad, nan, b)
