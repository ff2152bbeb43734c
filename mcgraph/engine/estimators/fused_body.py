"""Chunk bodies of the fused tier: value and derivatives of ``h̃ = h ∘ T`` in one pass per chunk.

For noise rows ``ξ`` (shape ``(n, *noise_shape)``) a body computes ``u = loc + scale·ξ``,
``w = T(u)`` and, by the forward rules of :mod:`mcgraph.engine.estimators.derivatives`, the row sums

.. math::
    \\sum_i h(w_i), \\quad \\sum_i \\tilde h'(u_i), \\quad \\sum_i \\tilde h'(u_i)\\,\\xi_i, \\quad
    \\sum_i \\partial_c h(w_i; c)

with no autograd graph. Where a compiler works, the body is compiled once per (program
structure, shapes, dtypes, wanted derivatives) with ``torch.compile`` (Inductor; on CPU it
emits vectorised C++), the row axis marked dynamic so that chunk sizes do not recompile.
Shapes are dynamic (one compile serves every size of a program of the same ranks: the layers
of a network, the last chunk). Compiling takes seconds to tens of seconds, so it is used only
when one call has at least
:data:`COMPILE_MIN_ELEMENTS` sample elements (``M · numel(h)``); smaller calls, and every call
where compiling fails, run the same body eagerly (same numbers within float rounding).

``MCGRAPH_FUSED_BODY`` overrides the choice: ``auto`` (the default), ``eager`` (never compile),
``compiled`` (compile whatever the size), ``autograd`` (the local autograd call per chunk that
programs without forward rules use).

Example:
    >>> import torch, mcgraph as mg
    >>> q = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
    >>> y = mg.expectation(lambda w: torch.log1p(w.abs()), q, 100, seed=0)
    >>> last_path()
    'eager'
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
from dataclasses import dataclass

import torch

from ..shapes import broadcast_shapes
from .derivatives import Lowered, NoRule, dual

#: One call compiles its chunk body only from this many sample elements (M · numel(h)) on:
#: compiling costs ~5–50 s on a 2-core machine, an eager pass over 2^23 elements ~0.3–0.5 s.
COMPILE_MIN_ELEMENTS = 1 << 23

#: Flush denormals to zero while the chunk bodies of calls from :data:`FLUSH_MIN_ELEMENTS` sample
#: elements on run (see :func:`flush_denormals`); smaller calls skip the probe and the switch.
FLUSH_DENORMALS = True
FLUSH_MIN_ELEMENTS = 1 << 16

_ENV = "MCGRAPH_FUSED_BODY"
_MODES = ("auto", "eager", "compiled", "autograd")
_COMPILED: dict = {}  # key -> compiled body, or None where compiling failed
_STATE = threading.local()


def last_path() -> str | None:
    """Which body the last fused call of this thread ran: ``compiled``, ``eager`` or ``autograd``."""
    return getattr(_STATE, "path", None)


def _set_path(path: str) -> None:
    _STATE.path = path


def body_mode() -> str:
    """``auto`` | ``eager`` | ``compiled`` | ``autograd``, from ``MCGRAPH_FUSED_BODY`` (default ``auto``)."""
    mode = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{_ENV} must be one of {', '.join(_MODES)}, got {mode!r}")
    return mode


def compiler_available() -> bool:
    """``torch.compile`` can run here (dynamo supported on this Python; a C++ compiler for CPU)."""
    try:
        import torch._dynamo

        if not torch._dynamo.is_dynamo_supported():
            return False
    except Exception:  # an exotic build without dynamo
        return False
    import shutil

    return any(shutil.which(c) for c in ("g++", "c++", "clang++", "gcc"))


def wants_compile(elements: int, device: torch.device) -> bool:
    """Whether a call over ``elements`` sample elements should run a compiled body."""
    mode = body_mode()
    if mode in ("eager", "autograd") or (mode == "auto" and elements < COMPILE_MIN_ELEMENTS):
        return False
    return device.type == "cpu" and compiler_available()


def describe(lowered: Lowered | None, reason: str = "") -> str:
    """The chunk body in words, for ``explain``."""
    mode = body_mode()
    if lowered is None or mode == "autograd":
        why = reason or f"{_ENV}=autograd"
        return f"a local autograd call per chunk ({why})"
    if mode == "eager":
        return f"value and derivatives by forward rules in one pass (eager; {_ENV}=eager)"
    if mode == "compiled":
        when = f"({_ENV}=compiled) where a compiler works"
    else:
        when = f"when M·numel(h) ≥ {COMPILE_MIN_ELEMENTS:,} and a compiler works".replace(",", " ")
    return f"value and derivatives by forward rules in one pass; compiled with torch.compile {when}, " \
           "eager otherwise"


# --------------------------------------------------------------------------- flush to zero


def _flushing() -> bool:
    """Whether this thread flushes denormals now (a denormal float32 reads back as zero)."""
    return float(torch.tensor([1e-40], dtype=torch.float32).mul_(1.0)[0]) == 0.0


@contextlib.contextmanager
def flush_denormals(enabled: bool = True):
    """Flush denormals to zero in the body (SSE FTZ/DAZ on x86), restoring the previous setting.

    Results below ~1e-38 (float32) become 0; an estimate whose terms are that small is 0 to
    float32's resolution anyway. Only the calling thread's setting changes.
    """
    if not enabled:
        yield
        return
    before = _flushing()
    if before or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


# --------------------------------------------------------------------------- the body


@dataclass(frozen=True)
class BodySpec:
    """What a chunk body depends on besides its tensors (hashable: the compile-cache key).

    Attributes:
        tree: the lowered program (:attr:`Lowered.tree`).
        slots: ``(dtype, rank, device type)`` of each program tensor.
        out_ndim: the rank of ``h`` for one sample (sizes come from the inputs).
        scaling: the form has no location (``u = scale·ξ``).
        transform: ``""`` or ``"exp"``: ``w = u`` or ``w = exp(u)``.
        want_loc, want_scale: the derivatives in loc / scale are wanted.
        grad_slots: slots whose ``∂h/∂c`` is wanted, in the order the sums are returned.
        scalar: a scalar sample (rows of shape ``(n,)``): ``h`` under ``vmap``, as ``fn`` is.
        keep_h: also return the per-sample ``h`` (for standard errors; eager bodies only).
    """

    tree: tuple
    slots: tuple
    out_ndim: int
    scaling: bool
    transform: str
    want_loc: bool
    want_scale: bool
    grad_slots: tuple
    scalar: bool
    keep_h: bool = False


def _align(x: torch.Tensor, ndim: int) -> torch.Tensor:
    extra = ndim - (x.dim() - 1)
    return x.reshape((x.shape[0],) + (1,) * extra + tuple(x.shape[1:])) if extra > 0 else x


#: Below this many elements a chunk's row sum is ``sum(0)``: the product's set-up costs more there.
ROW_SUM_MATMUL_MIN = 1 << 16


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(0)`` as one matrix-vector product (several times faster than ``sum(0)`` eagerly on CPU)."""
    if x.shape[0] == 1:
        return x[0]
    if x.numel() < ROW_SUM_MATMUL_MIN:
        return x.sum(0)
    flat = x.reshape(x.shape[0], -1)
    with torch.autocast(x.device.type, enabled=False):
        return (torch.ones(x.shape[0], dtype=x.dtype, device=x.device) @ flat).reshape(x.shape[1:])


def make_body(spec: BodySpec, compiled: bool):
    """``body(xi, loc, scale, *tensors) -> (Σh, Σh̃', Σh̃'ξ, *Σ∂h/∂c[, h])`` for ``spec``.

    Sums of derivatives not wanted are ``None``. Raises :class:`NoRule` (eagerly) where a rule
    does not cover an argument combination.
    """
    ndim = spec.out_ndim
    row_sum = (lambda x: x.sum(0)) if compiled else _row_sum
    # traced shapes are symbolic under the compiler: torch's own there
    bshapes = torch.broadcast_shapes if compiled else broadcast_shapes
    want_u = spec.want_loc or spec.want_scale

    def evaluate(w, w_tangents, tensors, slot_tangents):
        if spec.scalar:
            # torch's 0-d promotion: h of one scalar sample, batched as fn's (see fused._evaluate)
            def one(x):
                v, ts = dual(spec.tree, x, w_tangents, tensors, slot_tangents)
                return (v,) + tuple(torch.zeros_like(v) if t is None else torch.as_tensor(t, dtype=v.dtype)
                                    .expand(v.shape) for t in ts)
            try:
                outs = torch.func.vmap(one)(w)
                return outs[0], tuple(outs[1:])
            except NoRule:
                raise
            except Exception:  # an op vmap cannot batch: the batched rows, as fused._evaluate
                pass
        return dual(spec.tree, w, w_tangents, tensors, slot_tangents)

    def body(xi, loc, scale, *tensors):
        n = xi.shape[0]
        u = scale * xi
        if not spec.scaling:
            u = loc + u
        # h's shape for one sample: the sample's broadcast with the program's tensors
        full = (n,) + tuple(bshapes(u.shape[1:], *(t.shape for t in tensors)))
        u = _align(u, ndim)
        w = u.exp() if spec.transform == "exp" else u
        # directions: d/dw (then times dw/du, the chain rule), then one per wanted captured tensor
        directions_w = ([1.0] if want_u else []) + [None] * len(spec.grad_slots)
        directions_c = ([{}] if want_u else []) + [{k: 1.0} for k in spec.grad_slots]
        h, tangents = evaluate(w, tuple(directions_w), tensors, tuple(directions_c))
        h = h.expand(full)
        outs = [row_sum(h)]
        tangents = list(tangents)
        if want_u:
            gu = tangents.pop(0)
            if gu is not None and spec.transform == "exp":
                gu = gu * w
            if gu is None:
                outs += [None, None]
            else:
                gu = gu.expand(full) if isinstance(gu, torch.Tensor) else torch.full(full, gu, dtype=u.dtype,
                                                                                      device=u.device)
                gu = gu.to(u.dtype)  # as autograd: the gradient in the input's dtype
                outs.append(row_sum(gu) if spec.want_loc else None)
                outs.append(row_sum(gu * _align(xi, ndim)) if spec.want_scale else None)
        else:
            outs += [None, None]
        for k, t in zip(spec.grad_slots, tangents[:len(spec.grad_slots)] if spec.grad_slots else []):
            if t is None:
                outs.append(None)
            else:
                c = tensors[k]
                t = t.expand(full) if isinstance(t, torch.Tensor) else torch.full(full, t, dtype=c.dtype,
                                                                                  device=c.device)
                outs.append(row_sum(t.to(c.dtype)))
        if spec.keep_h:
            outs.append(h)
        return tuple(outs)

    return body


def compiles(spec: BodySpec) -> bool:
    """Whether ``spec``'s chunks of two rows or more may run the compiled body: not when it keeps the
    per-sample h (standard errors) or the sample is a scalar (h under vmap); single rows run eagerly too."""
    return not spec.keep_h and not spec.scalar


def run_chunk(spec: BodySpec, compile_: bool, xi, loc, scale, tensors):
    """One chunk's sums by the compiled body (when asked and it works) or the eager one."""
    if compile_ and xi.shape[0] > 1 and compiles(spec):
        fn = _compiled(spec)
        if fn is not None:
            try:
                with torch.no_grad():  # one grad mode: dynamo guards on it
                    out = fn(xi, loc, scale, *tensors)
                _set_path("compiled")
                return out
            except Exception:  # the compiler or a guard failed: this program runs eagerly from now on
                _COMPILED[spec] = None
    out = make_body(spec, compiled=False)(xi, loc, scale, *tensors)
    _set_path("eager")
    return out


def simd_bits() -> int:
    """The vector width, in bits, Inductor's C++ takes in this process (``ATEN_CPU_CAPABILITY`` included);
    1 (no vectors) where it finds none.

    Passed to ``torch.compile`` as ``cpp.simdlen`` so that it is part of Inductor's cache key. Left
    implicit, it is not: a process under AVX-512 reads a body that a process under AVX2 cached in the same
    cache folder, compiles that 8-lane source with 16-lane vectors, and corrupts the heap (seen with
    torch 2.13).
    """
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    return isa.bit_width() if isa else 1


def _compiled(spec: BodySpec):
    """The compiled body of ``spec`` (``None`` where compiling failed), compiled on its first call.

    Each spec gets its own code object: dynamo keeps a bounded number of compiled entries per
    code object (its recompile limit), which programs sharing one would exhaust. An entry is
    compiled per torch thread count (Inductor's C++ is specialised to it) and reused after.
    """
    if spec not in _COMPILED:
        # dynamo's first torch.compile in a process switches torch.distributions' argument validation
        # off for good (TorchPatcher.patch); the user's setting is theirs, so it is put back.
        validating = torch.distributions.Distribution._validate_args
        try:
            fn = make_body(spec, compiled=True)
            code = fn.__code__.replace(co_name=f"fused_chunk_body_{len(_COMPILED)}")
            fn = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
            _COMPILED[spec] = torch.compile(fn, fullgraph=True, dynamic=True, options={"cpp.simdlen": simd_bits()})
        except Exception:
            _COMPILED[spec] = None
        finally:
            torch.distributions.Distribution.set_default_validate_args(validating)
    return _COMPILED[spec]


__all__ = ["BodySpec", "COMPILE_MIN_ELEMENTS", "NoRule", "body_mode", "compiler_available", "compiles", "describe",
           "flush_denormals", "last_path", "make_body", "run_chunk", "simd_bits", "wants_compile"]
