"""The plan cache: trace an integrand once, reuse the trace while that is provably safe.

:func:`mcgraph.expectation` (and everything built on it: :func:`mcgraph.kl_divergence`,
``mg.nn.kl``, ``mg.nn.elbo``, a layer's KL) needs a :class:`~mcgraph.engine.plan.tracer.TraceResult`
of ``fn``. Tracing calls ``fn`` on a real sample of the distribution's shape, one P-sized
draw plus every operation of ``fn`` on it. The trace is a function of

* ``fn``'s code and of every value ``fn`` can reach: closure cells, defaults, globals its
  code names, a bound method's ``self``, a ``functools.partial``'s arguments, and recursively
  the attributes of the ``torch.distributions`` objects (and their transforms and constraints)
  among them;
* the sample's shape, dtype and device (a trace reads shapes, never values of w);
* torch's global settings: grad mode, autocast, the default dtype, distribution validation;
* the integrand registry (:func:`mcgraph.register_integrand`).

The cache key holds all of it: Python scalars, strings, dtypes and shapes by value; a tensor
whose storage is small (≤ :data:`SMALL_TENSOR_BYTES`, not requiring grad) by its values (read
back from an accelerator: one small copy, like the finiteness check of the parameters); any
other tensor by identity (the entry keeps a reference, so an id cannot be reused).
A later call with an equal key reuses the trace and draws no example. The trace's constants
were computed from the reached values when it was made (``p.scale.log()`` inside
``log_prob``), so a hit is safe only where those constants would be recomputed equal, with
the same autograd connection. The cache therefore stores a trace only when

1. every value reached was recognised (anything else: an ``nn.Module``, a NumPy array,
   an arbitrary object, too many values: not cached);
2. no tensor in the trace carries an autograd history (``grad_fn``): such a constant is
   derived from a tensor that requires grad, and the current call's gradients must flow
   through a fresh derivation from the current tensors;
3. and, when some reached tensor is keyed by identity (large, or requiring grad), every
   tensor in the trace is one of the reached tensors itself (read live at evaluation, so
   in-place updates are seen): a constant derived from a large tensor could go stale without
   a visible change (``t.data`` updates do not bump ``t._version``).

A prior with scalar parameters rebuilt for every call (what ``mg.nn`` layers do) keys by
value and hits; a prior with learned parameters, or ``q.log_prob`` of a posterior whose
parameters require grad, is traced afresh on every call. ``fn`` must be a deterministic
function of w and of the values it reaches (as for any trace). ``mg.explain(fn, q)`` and
``str(plan)`` say whether the plan came from the cache, was traced and stored, or was
traced and not stored (and why).

Switches: :func:`set_enabled` (or the environment variable ``MCGRAPH_PLAN_CACHE=0``),
:func:`disabled` (a context manager), :func:`clear`, :func:`set_max_size` (LRU, default
:data:`DEFAULT_MAX_SIZE` entries, and at most :data:`MAX_BYTES` of tensors held by the stored
traces), :func:`info` (hits, misses, stores, size). In-place changes of a tensor keyed by identity
must go through torch operations, which bump ``tensor._version`` (part of the key): a trace's
decision on such a tensor's values (an integer exponent read from it) is not redone on a ``.data``
write.

Example:
    >>> import torch, mcgraph as mg
    >>> mg.plan_cache.clear()
    >>> q = torch.distributions.Normal(torch.zeros(3), torch.ones(3))
    >>> p = torch.distributions.Laplace(0.0, 1.0)
    >>> _ = mg.expectation(p.log_prob, q, 10, seed=0)       # traced, stored
    >>> mg.explain(p.log_prob, q).cache                      # the stored trace
    'hit'
    >>> with mg.plan_cache.disabled():
    ...     mg.explain(p.log_prob, q).cache
    'off'
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch.distributions import Distribution
from torch.distributions.constraints import Constraint
from torch.distributions.transforms import Transform

from . import ir, ops
from .ir import Node
from .tracer import TraceResult, trace

__all__ = ["CacheInfo", "DEFAULT_MAX_SIZE", "MAX_BYTES", "SMALL_TENSOR_BYTES", "cached_trace", "clear",
           "disabled", "info", "set_enabled", "set_max_size"]

#: Entries kept (least recently used dropped first).
DEFAULT_MAX_SIZE = 256
#: Bytes of tensors the stored traces may hold together (their constants, the tensors they key by
#: identity); least recently used entries are dropped beyond it, and a trace holding more is not stored.
MAX_BYTES = 256 * 2**20
#: Tensors whose storage holds at most this many bytes are keyed by value (unless they require grad).
SMALL_TENSOR_BYTES = 1024
#: Tensors of at most this many elements (CPU, a dtype below) are keyed by their values as numbers.
_SCALAR_KEY_NUMEL = 16
#: Dtypes whose values ``tolist`` returns exactly (Python floats are doubles; ints and bools as they are).
_EXACT_LIST_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool})
#: Values visited per key at most; a larger reachable state is not cached.
MAX_VALUES = 512

_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size,
          torch.layout, torch.memory_format, type(Ellipsis), type(NotImplemented))
#: Attributes that hold caches, not state: the transform's last (x, y) and its inverse's weak reference.
_SKIP_ATTRS = {"_cached_x_y", "_inv"}


class CacheInfo(NamedTuple):
    """Counters of the plan cache since the last :func:`clear`."""

    hits: int
    misses: int
    stored: int
    uncacheable: int
    size: int
    max_size: int
    enabled: bool


class _Uncacheable(Exception):
    """The reachable state of ``fn`` cannot be keyed (the reason is the message)."""


@dataclass
class _Entry:
    trace: TraceResult
    refs: tuple  # the identity-keyed objects, kept alive so that their ids stay theirs
    nbytes: int  # bytes of the tensors held (deduplicated by storage)


class _State:
    def __init__(self):
        self.entries: OrderedDict = OrderedDict()
        self.max_size = DEFAULT_MAX_SIZE
        self.nbytes = 0
        setting = os.environ.get("MCGRAPH_PLAN_CACHE", "1").strip().lower()
        self.enabled = setting not in ("0", "off", "false", "no")
        self.hits = self.misses = self.stored = self.uncacheable = 0


_STATE = _State()


def set_enabled(value: bool) -> None:
    """Switch the plan cache on or off (off: every call traces ``fn`` afresh, as before the cache)."""
    if not isinstance(value, bool):
        raise TypeError(f"value must be a bool, got {type(value).__name__}")
    _STATE.enabled = value


@contextlib.contextmanager
def disabled():
    """Context manager: no lookups and no stores inside (entries already stored stay)."""
    before = _STATE.enabled
    _STATE.enabled = False
    try:
        yield
    finally:
        _STATE.enabled = before


def clear() -> None:
    """Drop every entry and reset the counters."""
    _STATE.entries.clear()
    _STATE.nbytes = 0
    _STATE.hits = _STATE.misses = _STATE.stored = _STATE.uncacheable = 0


def set_max_size(n: int) -> None:
    """Keep at most ``n`` entries (least recently used dropped first); ``n = 0`` stores nothing."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    _STATE.max_size = n
    _evict()


def info() -> CacheInfo:
    """Hits, misses, stores, uncacheable traces and the current size."""
    s = _STATE
    return CacheInfo(s.hits, s.misses, s.stored, s.uncacheable, len(s.entries), s.max_size, s.enabled)


def _evict() -> None:
    while _STATE.entries and (len(_STATE.entries) > _STATE.max_size or _STATE.nbytes > MAX_BYTES):
        _, entry = _STATE.entries.popitem(last=False)
        _STATE.nbytes -= entry.nbytes


def _held_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no plain storage (sparse, …): its elements
            total += t.numel() * t.element_size()
            continue
        key = (storage.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


# --------------------------------------------------------------------------- keys


class _Keyer:
    """Walks the values ``fn`` reaches and builds a hashable key from them."""

    def __init__(self):
        self.parts: list = []
        self.refs: list = []
        self.by_identity = False
        self.seen: dict[int, int] = {}
        self.count = 0

    def add(self, x) -> None:
        self.count += 1
        if self.count > MAX_VALUES:
            raise _Uncacheable(f"fn reaches more than {MAX_VALUES} values")
        if isinstance(x, float):
            self.parts.append((float, x.hex()))  # -0.0 and 0.0 apart; nan equal to itself
            return
        if isinstance(x, _ATOMS):
            self.parts.append((type(x), x))
            return
        if isinstance(x, torch.Tensor):
            self._tensor(x)
            return
        if id(x) in self.seen:  # a cycle or a shared object: its first position
            self.parts.append(("ref", self.seen[id(x)]))
            return
        self.seen[id(x)] = len(self.parts)
        self.refs.append(x)  # keeps it alive: the ids in ``seen`` stay unique for the key's lifetime
        if isinstance(x, (tuple, list)):
            self.parts.append((type(x), len(x)))
            for v in x:
                self.add(v)
        elif isinstance(x, (set, frozenset)) and all(isinstance(v, _ATOMS) for v in x):
            self.parts.append((type(x), frozenset(x)))
        elif isinstance(x, dict):
            self.parts.append((dict, len(x)))
            for k, v in x.items():
                self.add(k)
                self.add(v)
        elif isinstance(x, (types.ModuleType, type)):
            self.parts.append(("id", id(x)))
        elif _is_builtin(x):
            owner = getattr(x, "__self__", None)
            if owner is None or isinstance(owner, (types.ModuleType, type)):
                self.parts.append(("id", id(x)))
            else:  # bound to an object (``t.mul``): the method's name and what it is bound to
                self.parts.append(("bound", type(x), getattr(x, "__name__", None)))
                self.add(owner)
        elif isinstance(x, types.FunctionType):
            self._function(x)
        elif isinstance(x, types.MethodType):
            self.parts.append(("method",))
            self.add(x.__func__)
            self.add(x.__self__)
        elif isinstance(x, functools.partial):
            self.parts.append(("partial",))
            self.add(x.func)
            self.add(x.args)
            self.add(x.keywords)
        elif isinstance(x, (Distribution, Transform, Constraint)):
            self.parts.append(("obj", type(x)))
            try:
                attrs = vars(x)
            except TypeError:
                raise _Uncacheable(f"fn reaches a {type(x).__name__} without a __dict__") from None
            for k, v in attrs.items():
                if k not in _SKIP_ATTRS:
                    self.add(k)
                    self.add(v)
        elif isinstance(x, Node):
            raise _Uncacheable("fn reaches a traced program")
        else:
            raise _Uncacheable(f"fn reaches a {type(x).__name__} (only tensors, numbers, containers, "
                               "functions and torch.distributions objects are keyed)")

    def _tensor(self, t: torch.Tensor) -> None:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise _Uncacheable(f"fn reaches a tensor subclass ({type(t).__name__})")
        meta = (t.shape, t.dtype, t.device, t.requires_grad)
        if (not t.requires_grad and t.device.type == "cpu" and t.layout == torch.strided
                and t.numel() <= _SCALAR_KEY_NUMEL and t.dtype in _EXACT_LIST_DTYPES
                and t.untyped_storage().nbytes() <= SMALL_TENSOR_BYTES):
            # a prior's few numbers (the common case, once per call): read as Python numbers, which
            # hold float64/float32 values exactly; floats by their hex (-0.0 ≠ 0.0, nan = nan)
            values = t.reshape(-1).tolist()
            self.parts.append(("numbers", *meta, tuple(v.hex() if isinstance(v, float) else v for v in values)))
            return
        if (not t.requires_grad and t.device.type != "meta" and t.layout == torch.strided
                and t.untyped_storage().nbytes() <= SMALL_TENSOR_BYTES):
            with torch.no_grad():
                flat = t.detach().resolve_conj().resolve_neg().contiguous().view(-1)
                data = flat.view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b""
            self.parts.append(("value", *meta, data))
            return
        self.by_identity = True
        self.refs.append(t)
        self.parts.append(("tensor", id(t), t._version, *meta))

    def _function(self, f: types.FunctionType) -> None:
        code = f.__code__
        self.parts.append(("fn", code))
        self.refs.append(code)
        self.add(f.__defaults__)
        self.add(f.__kwdefaults__)
        cells = f.__closure__ or ()
        self.parts.append(("cells", len(cells)))
        for cell in cells:
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                self.parts.append(("empty",))
                continue
            self.add(value)
        g = f.__globals__
        for name in _global_names(code):
            if name in g:
                self.add(name)
                self.add(g[name])


def _is_builtin(x) -> bool:
    return isinstance(x, (types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType,
                          types.MethodDescriptorType, types.MethodWrapperType, types.GetSetDescriptorType,
                          types.MemberDescriptorType, types.ClassMethodDescriptorType)) \
        or type(x).__module__ == "torch._ops"


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple:
    """Names ``code`` (and the code objects nested in it) may read as globals."""
    names, stack = [], [code]
    while stack:
        c = stack.pop()
        names.extend(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return tuple(dict.fromkeys(names))


def _registry_state() -> int:
    """What of the integrand registry a trace depends on: its generation, moved by every registration."""
    return ops.OPS.generation


def _torch_state(device: torch.device) -> tuple:
    """The global torch settings a trace can depend on: grad mode, autocast, default dtype, validation."""
    kind = device.type
    autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) \
        if kind in ("cpu", "cuda") else ()
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, torch.get_default_dtype(),
            Distribution._validate_args)


def _key(fn: Callable, form) -> tuple[tuple, tuple, bool]:
    k = _Keyer()
    k.add(fn)
    # A trace reads the sample's shape, dtype and device, never its values.
    sample = (type(form), tuple(form.shape), form.dtype, form.device)
    key = (sample, _torch_state(form.device), _registry_state(), tuple(k.parts))
    return key, tuple(k.refs), k.by_identity


# --------------------------------------------------------------------------- what a trace holds


def _trace_tensors(result: TraceResult) -> list:
    """Every tensor a trace holds: coefficients, program constants, the linear maps' arguments.

    Raises:
        _Uncacheable: a callable in the trace whose tensors cannot be listed.
    """
    out: list = []
    if result.constant is not None:
        out.append(result.constant)
    if result.expr is None:
        return out
    for piece in result.expr.pieces:
        e = piece.expr
        out.extend(c for c in e.poly.values() if isinstance(c, torch.Tensor))
        for node in e.programs:
            out.extend(_node_tensors(node))
        for f in piece.chain:
            out.extend(_callable_tensors(f))
    return out


def _node_tensors(node) -> list:
    out = []
    for c in node.constants():
        if isinstance(c, torch.Tensor):
            out.append(c)
    stack = [node]
    while stack:  # the functions the program calls may hold tensors too (a registered rule's closure)
        n = stack.pop()
        if isinstance(n, ir.Call):
            out.extend(_callable_tensors(n.func))
            stack.extend(x for x in (*n.args, *n.kwargs.values()) if isinstance(x, Node))
        elif isinstance(n, ir.SumNode):
            stack.extend(n.parts)
        elif not isinstance(n, (ir.Var, ir.PolyNode)):
            raise _Uncacheable(f"the trace holds a {type(n).__name__} program node")
    return out


def _callable_tensors(f) -> list:
    """Tensors a callable of the trace holds (defaults, closure cells, partial arguments; one level deep)."""
    if _is_builtin(f) or isinstance(f, type):
        return []
    if isinstance(f, functools.partial):
        values = [f.func, *f.args, *f.keywords.values()]
    elif isinstance(f, types.FunctionType):
        values = list(f.__defaults__ or ())
        for cell in f.__closure__ or ():
            try:
                values.append(cell.cell_contents)
            except ValueError:
                pass
    else:
        raise _Uncacheable(f"the trace holds a {type(f).__name__} callable")
    out: list = []
    while values:
        v = values.pop()
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            values.extend(v.values())
        elif isinstance(v, (tuple, list)):
            values.extend(v)
    return out


def _why_not_stored(result: TraceResult, refs: tuple, by_identity: bool) -> str:
    try:
        tensors = _trace_tensors(result)
    except _Uncacheable as e:
        return str(e)
    if any(t.grad_fn is not None for t in tensors):
        return ("a constant of the trace is computed from a tensor that requires grad: gradients must flow "
                "through a fresh derivation")
    if by_identity:
        reached = {id(r) for r in refs if isinstance(r, torch.Tensor)}
        if any(id(t) not in reached for t in tensors):
            return ("a constant of the trace is computed from a tensor keyed by identity (large, or "
                    "requiring grad): its value could change unseen")
    return ""


# --------------------------------------------------------------------------- entry point


def cached_trace(fn: Callable, form, example: Callable[[], torch.Tensor]) -> tuple[TraceResult, str, str]:
    """``(trace, status, reason)`` for ``fn`` under ``form``.

    ``example()`` draws the sample to trace on; it is called only on a miss. ``status`` is
    ``"hit"`` (reused, no sample drawn), ``"stored"`` (traced and kept), ``"not stored"``
    (traced; ``reason`` says why it is not kept) or ``"off"`` (the cache is disabled).
    """
    if not _STATE.enabled:
        return trace(fn, example()), "off", ""
    try:
        key, refs, by_identity = _key(fn, form)
        hash(key)
    except (_Uncacheable, TypeError) as e:
        _STATE.uncacheable += 1
        reason = str(e) if isinstance(e, _Uncacheable) else f"fn's reachable state is not hashable ({e})"
        return trace(fn, example()), "not stored", reason
    entry = _STATE.entries.get(key)
    if entry is not None:
        _STATE.entries.move_to_end(key)
        _STATE.hits += 1
        return entry.trace, "hit", ""
    _STATE.misses += 1
    result = trace(fn, example())
    reason = _why_not_stored(result, refs, by_identity)
    if reason:
        _STATE.uncacheable += 1
        return result, "not stored", reason
    if _STATE.max_size == 0:
        return result, "not stored", "the cache's max_size is 0"
    nbytes = _held_bytes(_trace_tensors(result) + [r for r in refs if isinstance(r, torch.Tensor)])
    if nbytes > MAX_BYTES:
        _STATE.uncacheable += 1
        return result, "not stored", f"the trace holds {nbytes / 2**20:.0f} MiB of tensors (over MAX_BYTES)"
    _STATE.entries[key] = _Entry(result, refs, nbytes)
    _STATE.nbytes += nbytes
    _STATE.stored += 1
    _evict()
    return result, "stored", ""
