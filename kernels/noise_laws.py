"""The Triton backend's noise stream, its noise laws, and the kernel that materialises it.

Stream layout (counter-based: any sample of any element is drawn directly).
For sample ``i`` and element ``j`` of a draw of ``P`` elements (flat, C order):

.. code-block:: text

    offset  = i·P + j                                   (int64: no overflow for P·M ≥ 2³¹)
    counter = (lo32(offset), hi32(offset), tag, 0)      key = seed (64 bits)
    words   = Philox4x32-10(counter, key)               (tl.philox)

``tag = 0`` is the element noise (the counters ``tl.randint4x(seed, offset)``
uses); ``tag = 1`` is the Radial radius of (sample ``i``, batch element ``b``)
at offset ``i·B + b``. float32 turns two words into two open uniforms on a
2⁻²³ grid, float64 all four words into two open uniforms on a 2⁻⁵² grid
(``(k + ½)·2⁻ⁿ``: never 0 or 1, so no clamping is needed). A noise law maps the
two uniforms to ξ (Box–Muller for the normal; inverse CDFs otherwise).

Every kernel of the backend draws through :func:`draw`, so the materialise
kernel writes exactly the ξ the fused kernels use in registers — what the
tests compare against pure-torch references.

Adding a noise law is one ``@triton.jit`` transform ``(u1, u2) -> ξ`` plus one
:func:`register_noise` call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mcgraph.registry import Registry

from .utils import block_for, check_device, check_num_samples, check_seed, compute_dtype, tl_dtype



# --------------------------------------------------------------------------- device side


@triton.jit
def philox_uniforms(seed, offset, TAG: tl.constexpr, FP64: tl.constexpr):
    """Two open uniforms in (0, 1) per int64 ``offset`` (block), from counter (lo, hi, TAG, 0)."""
    lo = offset.to(tl.uint32)
    hi = (offset >> 32).to(tl.uint32)
    zero = lo * 0
    r0, r1, r2, r3 = tl.philox(seed, lo, hi, zero + TAG, zero)
    if FP64:
        a = ((r0.to(tl.uint64) << 20) | (r1 >> 12).to(tl.uint64)).to(tl.float64)
        b = ((r2.to(tl.uint64) << 20) | (r3 >> 12).to(tl.uint64)).to(tl.float64)
        u1 = (a + 0.5) * 2.220446049250313e-16  # 2^-52
        u2 = (b + 0.5) * 2.220446049250313e-16
    else:
        u1 = ((r0 >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23
        u2 = ((r1 >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    return u1, u2


@triton.jit
def draw(seed, offset, LAW: tl.constexpr, FP64: tl.constexpr):
    """ξ at int64 ``offset`` (element stream, tag 0) under the noise law ``LAW``."""
    u1, u2 = philox_uniforms(seed, offset, 0, FP64)
    return LAW(u1, u2)


@triton.jit
def normal_transform(u1, u2):
    """Box–Muller: sqrt(-2 log u1) · cos(2π u2)."""
    return tl.sqrt(-2.0 * tl.log(u1)) * tl.cos(6.283185307179586 * u2)


@triton.jit
def laplace_transform(u1, u2):
    """Inverse CDF: v = u1 - ½, ξ = -sign(v) · log(1 - 2|v|)."""
    v = u1 - 0.5
    return tl.where(v < 0, 1.0, -1.0) * tl.log(1.0 - 2.0 * tl.abs(v))


@triton.jit
def logistic_transform(u1, u2):
    """Inverse CDF: log u1 - log(1 - u1)."""
    return tl.log(u1) - tl.log(1.0 - u1)


@triton.jit
def cauchy_transform(u1, u2):
    """Inverse CDF: tan(π (u1 - ½))."""
    a = 3.141592653589793 * (u1 - 0.5)
    return tl.sin(a) / tl.cos(a)


@triton.jit
def gumbel_transform(u1, u2):
    """Inverse CDF: -log(-log u1)."""
    return -tl.log(-tl.log(u1))


@triton.jit
def uniform_transform(u1, u2):
    """U(0, 1) itself (open interval)."""
    return u1


@triton.jit
def exponential_transform(u1, u2):
    """Inverse CDF: -log u1."""
    return -tl.log(u1)


@triton.jit
def half_normal_transform(u1, u2):
    """|N(0, 1)|."""
    return tl.abs(normal_transform(u1, u2))


@triton.jit
def half_cauchy_transform(u1, u2):
    """|Cauchy(0, 1)|."""
    return tl.abs(cauchy_transform(u1, u2))


@triton.jit
def rayleigh_transform(u1, u2):
    """Inverse CDF: sqrt(-2 log u1)."""
    return tl.sqrt(-2.0 * tl.log(u1))


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class TritonNoise:
    """A noise law of the Triton backend.

    Attributes:
        name: registry key (``"normal"``, ``"laplace"``, …).
        transform: ``@triton.jit`` device function ``(u1, u2) -> ξ``.
        positive: ξ > 0 almost surely (``log ξ`` and scaling forms allowed).
        radial: ξ = ε/‖ε‖·r over the event (ε from ``transform``, r a standard normal per
            (sample, batch element)); kernels multiply by a precomputed factor r/‖ε‖.
    """

    name: str
    transform: object
    positive: bool = False
    radial: bool = False


NOISE_LAWS: Registry = Registry("noise law", unique=True)


def register_noise(name: str, transform, *, positive: bool = False, radial: bool = False) -> TritonNoise:
    """Register a noise law: ``transform`` is a ``@triton.jit`` function ``(u1, u2) -> ξ``."""
    return NOISE_LAWS.register(name, TritonNoise(name, transform, positive, radial))


def noise_law(name: str) -> TritonNoise:
    """The registered law ``name``; ``ValueError`` listing the known names otherwise."""
    if isinstance(name, TritonNoise):
        return name
    try:
        return NOISE_LAWS[name]
    except (KeyError, TypeError):
        raise ValueError(f"noise: unknown Triton noise law {name!r}; registered: {sorted(NOISE_LAWS)}") from None


register_noise("normal", normal_transform)
register_noise("laplace", laplace_transform)
register_noise("logistic", logistic_transform)
register_noise("cauchy", cauchy_transform)
register_noise("gumbel", gumbel_transform)
register_noise("uniform", uniform_transform, positive=True)
register_noise("exponential", exponential_transform, positive=True)
register_noise("half_normal", half_normal_transform, positive=True)
register_noise("half_cauchy", half_cauchy_transform, positive=True)
register_noise("rayleigh", rayleigh_transform, positive=True)
register_noise("radial", normal_transform, radial=True)


# --------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["seed", "i0", "P", "B", "D"])
def _radial_factor_kernel(
    factor_ptr,  # (n, B) out: r_ib / ‖ε_ib‖ for samples i0 … i0+n-1
    seed, i0, P, B, D,  # P = B·D elements per draw, D elements per event
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, FP64: tl.constexpr, DT: tl.constexpr,
):
    # one program per (sample row, tile of BLOCK_B batch elements); tile [BLOCK_B, BLOCK_D]
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(B, BLOCK_B)
    row = pid // n_tiles
    b = (pid % n_tiles) * BLOCK_B + tl.arange(0, BLOCK_B)
    b_mask = b < B
    i = (i0 + row).to(tl.int64)
    base = i * P + b.to(tl.int64) * D  # [BLOCK_B]
    ss = tl.zeros([BLOCK_B, BLOCK_D], dtype=DT)
    for e0 in range(0, D, BLOCK_D):
        e = e0 + tl.arange(0, BLOCK_D)
        eps = draw(seed, base[:, None] + e[None, :], normal_transform, FP64)
        ss += tl.where(b_mask[:, None] & (e[None, :] < D), eps * eps, 0.0)
    norm = tl.maximum(tl.sqrt(tl.sum(ss, axis=1)), 1e-30)
    u1, u2 = philox_uniforms(seed, i * B + b, 1, FP64)
    radius = normal_transform(u1, u2)
    tl.store(factor_ptr + row.to(tl.int64) * B + b, (radius / norm).to(DT), mask=b_mask)


@triton.jit(do_not_specialize=["seed", "i0", "n", "P", "D"])
def _materialize_kernel(
    out_ptr,  # (n, P) out: ξ for samples i0 … i0+n-1
    factor_ptr,  # (n, B) radial factors (unused unless RADIAL)
    seed, i0, n, P, D,
    LAW: tl.constexpr, RADIAL: tl.constexpr, BLOCK: tl.constexpr, FP64: tl.constexpr, DT: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < P
    P64 = P.to(tl.int64)
    B = P // D
    for r in range(0, n):
        i = i0 + r
        xi = draw(seed, i * P64 + offs, LAW, FP64)
        if RADIAL:
            xi = xi * tl.load(factor_ptr + r * B + offs // D, mask=mask, other=0.0)
        tl.store(out_ptr + r * P64 + offs, xi.to(DT), mask=mask)


# --------------------------------------------------------------------------- launchers


def event_size(shape, event_ndims: int) -> int:
    """D: elements of one Radial event (the last ``event_ndims`` dims of ``shape``)."""
    shape = tuple(shape)
    if event_ndims < 0 or event_ndims > len(shape):
        raise ValueError(f"event_ndims must be in [0, {len(shape)}] for shape {shape}, got {event_ndims}")
    return math.prod(shape[len(shape) - event_ndims:]) if event_ndims else 1


def radial_factors(seed: int, start: int, stop: int, numel: int, event: int, dtype: torch.dtype,
                   device) -> torch.Tensor:
    """r/‖ε‖ for samples ``start … stop-1``: first pass of the Radial noise, shape ``(stop-start, numel/event)``.

    Args:
        seed: stream seed.
        start, stop: sample rows.
        numel: P, elements per draw; ``event``: D, elements per event (divides P).
        dtype: compute dtype (float32/float64).
    """
    n, batch = stop - start, numel // event
    factors = torch.empty((max(n, 0), batch), dtype=dtype, device=device)
    if n > 0 and batch > 0:
        block_d = block_for(event)
        block_b = max(1, min(triton.next_power_of_2(batch), block_for(batch * block_d) // block_d))
        tiles = triton.cdiv(batch, block_b)
        _radial_factor_kernel[(n * tiles,)](factors, seed, start, numel, batch, event, BLOCK_B=block_b,
                                            BLOCK_D=block_d, FP64=dtype == torch.float64, DT=tl_dtype(dtype))
    return factors


def materialize_noise(noise: str, shape, start: int, stop: int, seed: int, dtype: torch.dtype = torch.float32,
                      device="cpu", *, event_ndims: int = 0) -> torch.Tensor:
    """Rows ``start … stop-1`` of the Triton noise stream, shape ``(stop-start, *shape)``.

    Exactly the ξ every Triton kernel draws in registers for the same ``seed``;
    the tests feed it to the pure-torch references.

    Args:
        noise: a registered law name (:data:`NOISE_LAWS`).
        shape: shape of one draw (P = prod(shape) elements).
        start, stop: sample indices, ``0 ≤ start ≤ stop``.
        seed: stream seed in [0, 2⁶³).
        dtype: float32 or float64 (float64 uses 52-bit uniforms; half types draw in float32).
        device: ``cuda``, or ``cpu`` under ``TRITON_INTERPRET=1``.
        event_ndims: Radial only: trailing dims normalised together.

    Example:
        >>> xi = materialize_noise("normal", (3, 4), 0, 8, seed=0)  # doctest: +SKIP
        >>> xi.shape
        torch.Size([8, 3, 4])
    """
    law = noise_law(noise)
    check_seed(seed)
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop):
        raise ValueError(f"start, stop must be ints with 0 <= start <= stop, got {start!r}, {stop!r}")
    shape = tuple(int(s) for s in shape)
    cdt = compute_dtype(dtype, "dtype")
    device = torch.device(device)
    out = torch.empty((stop - start,) + shape, dtype=cdt, device=device)
    check_device(out)
    numel = math.prod(shape)
    if out.numel() == 0:
        return out.to(dtype)
    event = event_size(shape, event_ndims) if law.radial else 1
    factors = radial_factors(seed, start, stop, numel, event, cdt, device) if law.radial else out
    block = block_for(numel)
    _materialize_kernel[(triton.cdiv(numel, block),)](
        out, factors, seed, start, stop - start, numel, event, LAW=law.transform, RADIAL=law.radial,
        BLOCK=block, FP64=cdt == torch.float64, DT=tl_dtype(cdt))
    return out.to(dtype)


class TritonNoiseStream:
    """Rows of the Triton stream with the interface of :class:`mcgraph.engine.noise.streams.BlockStream`.

    The engine's direct, chunked and torch-fused estimators read rows through
    this object on the Triton backend, so that they consume the same ξ as the
    in-register kernels (the same-seed contract within the backend). Memory is
    O(rows requested · P).

    Args:
        noise: registered law name.
        shape: shape of one draw of ξ.
        num_samples: M.
        seed: stream seed.
        dtype, device: of the rows.
        event_ndims: Radial only.
    """

    #: Whether the consumer may modify the rows in place (every call of :meth:`rows` makes fresh ones, so
    #: the flag changes nothing here; it is part of the interface).
    owns_rows = False

    def __init__(self, noise: str, shape, num_samples: int, seed: int, dtype: torch.dtype, device, *,
                 event_ndims: int = 0):
        self.law = noise_law(noise)
        self.shape = tuple(shape)
        self.num_samples = check_num_samples(num_samples)
        self.seed = check_seed(seed)
        self.dtype = dtype
        self.device = torch.device(device)
        self.event_ndims = event_ndims

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start … stop-1``, shape ``(stop-start, *shape)``."""
        return materialize_noise(self.law.name, self.shape, start, stop, self.seed, self.dtype, self.device,
                                 event_ndims=self.event_ndims)

    def chunks(self, chunk_size: int):
        """Yield ``(start, stop, rows)`` over the whole stream in chunks of ``chunk_size``."""
        for start in range(0, self.num_samples, chunk_size):
            stop = min(start + chunk_size, self.num_samples)
            yield start, stop, self.rows(start, stop)

    def release(self) -> None:
        """The stream is done. It keeps no buffer between calls, so there is nothing to hand on."""
