"""The tolerances of the same-noise contract, shared by the table-driven and the property tests.

float64: rtol 1e-9 with an absolute floor of 1e-9 × the largest magnitude of the
reference (the collapsed tier expands polynomials, so terms cancel differently than
in the direct sum). float32: rtol 2e-4 / atol 2e-4 × magnitude — a degree-3
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
                witness=None) -> None:
    """``got = (value, grads)`` equals ``ref`` within the tolerances (NaN equals NaN).

    ``none_is_zero``: an absent gradient (``None``) counts as a zero one; otherwise the
    connectivity (which gradients are ``None``) must agree.
    ``witness``: ``None`` or a callable giving ``(value, grads)`` of the reference recomputed another
    way on the same noise (in float64, gradients by forward mode), or ``None``; it judges entries
    that are non-finite in the reference and finite here.
    """
    (rv, rg), (gv, gg) = ref, got
    rv, gv = _non_finite_alike(rv, gv, f"{what} value", lambda: _witnessed(witness, None, rv), rtol)
    torch.testing.assert_close(gv, rv, rtol=rtol, atol=atol_factor * _magnitude(rv), equal_nan=True,
                               msg=lambda m: f"{what} value: {m}")
    for k, (a, b) in enumerate(zip(rg, gg)):
        if none_is_zero:
            if a is None and b is None:
                continue
            a = torch.zeros_like(b) if a is None else a
            b = torch.zeros_like(a) if b is None else b
        assert (a is None) == (b is None), f"{what}: gradient {k} connectivity differs"
        if a is not None:
            a, b = _non_finite_alike(a, b, f"{what} grad {k}", lambda k=k: _witnessed(witness, k, a), rtol)
            torch.testing.assert_close(b, a, rtol=rtol, atol=atol_factor * _magnitude(a), equal_nan=True,
                                       msg=lambda m: f"{what} grad {k}: {m}")


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
    """Where the reference gradient ``a`` is ±inf or NaN, ``b`` must be non-finite too, or equal
    (within ``rtol``) the gradient recomputed another way, ``recomputed()``; such entries are then
    compared as NaN.

    An overflowed sample makes the estimate non-finite, and which of −inf, +inf or NaN comes out
    depends on the order of the additions: ``w + log p(w)`` at ``w = inf`` is NaN per sample and
    ``inf + (−inf)`` or ``−inf`` when split into terms. Likewise for gradients: a generic form's chunk is a slice of a block's
    ``rsample`` graph, so the chunk's backward multiplies the other rows' zero gradient by their
    infinite local derivative (0·inf = NaN) where the direct estimator sums −inf terms. And the
    order of the chain rule's products decides whether a finite gradient overflows on the way:
    reverse mode forms ``softplus(w)**-4`` before multiplying by ``sigmoid(w)``, and multiplies
    ``clamp``'s zero derivative by ``exp(w) = inf``; forward rules multiply the other way and stay
    finite. Such a finite ``b`` must then equal forward-mode AD in float64 on the same noise.
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
                                                 f"recomputed gradient: {m}")
    nan = torch.full_like(a, float("nan"))
    return torch.where(bad, nan, a), torch.where(bad, nan, b)
