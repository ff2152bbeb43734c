"""The operation registry of the tracer: which torch functions are elementwise, linear or opaque.

New elementwise operations are one registration: :func:`register_integrand` names a torch
function as elementwise, or gives it a symbolic rule ``rule(func, args, kwargs) -> Expr | None``.
"""

from __future__ import annotations

from typing import Callable

from ...registry import Registry


#: torch functions the tracer knows as elementwise (:data:`OPS` adds the registered ones).
ELEMENTWISE_OPS: frozenset[str] = frozenset({
    "abs", "absolute", "sign", "sgn", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt",
    "square", "reciprocal", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "tanh",
    "asinh", "acosh", "atanh", "sigmoid", "logsigmoid", "softplus", "relu", "elu", "gelu", "silu", "lgamma",
    "digamma", "erf", "erfc", "erfinv", "logit", "clamp", "clip", "clamp_min", "clamp_max", "where",
    "maximum", "minimum", "fmax", "fmin", "logaddexp", "logaddexp2", "xlogy", "xlog1py", "pow", "float_power",
    "add", "sub", "subtract", "mul", "multiply", "div", "divide", "true_divide", "neg", "negative", "rsub",
    "radd", "rmul", "rtruediv", "truediv", "rpow", "lt", "le", "gt", "ge", "eq", "ne", "less", "greater",
    "less_equal", "greater_equal", "not_equal", "logical_and", "logical_or", "logical_not", "logical_xor",
    "and", "or", "xor", "invert", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "isfinite",
    "isnan", "isinf", "nan_to_num", "heaviside", "floor", "ceil", "round", "trunc", "frac", "type_as",
    "special_xlog1py", "special_entr", "entr", "log_ndtr", "special_log_ndtr", "ndtr", "special_ndtr",
    "i0", "special_i0e", "special_i1e", "polygamma", "mvlgamma", "hypot", "copysign", "fmod", "remainder",
    "float", "double", "to", "long", "int", "short", "bool", "byte", "char", "half", "bfloat16",
})

LINEAR_OPS: frozenset[str] = frozenset({
    "sum", "mean", "reshape", "view", "view_as", "flatten", "unflatten", "unsqueeze", "squeeze", "expand",
    "expand_as", "broadcast_to", "getitem", "permute", "transpose", "t", "movedim", "moveaxis", "narrow",
    "select", "sum_to_size", "diagonal", "swapaxes", "swapdims", "mT", "T", "flip", "roll", "repeat",
    "tile", "contiguous", "clone", "nansum",
})

IDENTITY_OPS: frozenset[str] = frozenset({"contiguous", "clone", "as_tensor"})

#: Conversions to Python (``bool(t)``, ``int(t)``, ``t.item()``, …): data-dependent, so the integrand is opaque.
#: ``float_``/``int_``/``bool_`` are the dunder conversions; ``t.float()``/``t.int()``/``t.bool()`` are casts.
ESCAPES: frozenset[str] = frozenset({"bool_", "item", "tolist", "float_", "int_", "index", "numpy", "nonzero", "any",
                                    "all"})

METADATA: frozenset[str] = frozenset({
    "shape", "size", "dim", "ndim", "ndimension", "numel", "dtype", "device", "requires_grad", "is_floating_point",
    "is_complex", "layout", "len", "stride", "is_contiguous", "data_ptr", "element_size", "nelement",
    "is_cuda", "names", "get_device", "storage_offset", "grad_fn", "is_leaf", "grad", "format", "repr",
    "is_sparse", "is_quantized", "is_meta", "is_nested", "untyped_storage", "_version", "output_nr",
})

#: Registered operations: ``name -> rule`` (``None``: elementwise, no symbolic rule). Its ``generation``
#: is the plan cache's key for the operation set: every registration moves it.
OPS: Registry = Registry("integrand op")


def is_elementwise(name: str) -> bool:
    """Whether the tracer treats the torch function ``name`` as elementwise (built in, or registered)."""
    return name in ELEMENTWISE_OPS or name in OPS


def register_integrand(name: str, rule: Callable | None = None):
    """Register a torch function (by name) as elementwise, or give it a symbolic rule.

    ``register_integrand("my_op")`` declares ``torch.my_op`` elementwise, so a
    term using it goes to the fused tier. ``register_integrand("my_op", rule)``
    (or as a decorator) installs ``rule(func, args, kwargs) -> Expr | None``;
    returning ``None`` falls back to the elementwise treatment.
    """
    if rule is not None:
        return OPS.register(name, rule)
    if name not in OPS:
        OPS.register(name, None)
    else:  # already registered: a registration all the same (traces made before it are not reused)
        OPS.register(name, OPS[name])
    return lambda r: OPS.register(name, r)


def is_in_place(raw: str) -> bool:
    """``add_``, ``mul_``, ``__iadd__``, …: ops that mutate their first argument."""
    if raw.startswith("__") and raw.endswith("__"):
        return raw[2:3] == "i" and raw[2:-2] not in ("index", "int", "invert")
    return raw.endswith("_") and not raw.startswith("_")


def normalise_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # property access on Tensor
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", "") or name
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name in ("float", "int", "index", "bool"):
            return {"float": "float_", "int": "int_", "index": "index", "bool": "bool_"}[name]
    return name.rstrip("_") if not name.startswith("_") else name
