"""Launch helpers shared by the kernels: dtypes, block sizes, argument checks.

Importing this module imports Triton. Whether the kernels run compiled (CUDA)
or in Triton's interpreter (CPU tensors, ``TRITON_INTERPRET=1``) is fixed when
``@triton.jit`` decorates them, i.e. when this package's kernel modules are
first imported; :data:`INTERPRETED` records it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl



def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


#: ``True`` when the kernels were decorated under ``TRITON_INTERPRET=1`` (CPU tensors).
INTERPRETED: bool = _interpreting()

#: Torch dtype → Triton compute dtype. Half types are computed in float32.
_COMPUTE = {torch.float32: torch.float32, torch.float64: torch.float64,
            torch.float16: torch.float32, torch.bfloat16: torch.float32}
_TL = {torch.float32: tl.float32, torch.float64: tl.float64}


def compute_dtype(dtype: torch.dtype, argname: str) -> torch.dtype:
    """The dtype a kernel computes and accumulates in for inputs of ``dtype`` (fp32 or fp64)."""
    if dtype not in _COMPUTE:
        raise TypeError(f"{argname}: dtype {dtype} is not supported by the Triton kernels "
                        f"(expected float16, bfloat16, float32 or float64)")
    return _COMPUTE[dtype]


def tl_dtype(dtype: torch.dtype):
    """Triton dtype of a compute dtype (float32 or float64)."""
    return _TL[dtype]


def block_for(numel: int, rows: int = 1) -> int:
    """Elements per program for a loop-over-samples kernel of ``numel`` elements.

    Compiled: 1024 elements (8 per thread at 4 warps), divided by the number of
    accumulator ``rows`` a program keeps. Interpreted: as large as the problem
    (≤ 4096) so that few programs run, since each interpreted op costs the same
    Python overhead whatever its width.
    """
    cap = (4096 if INTERPRETED else 1024) // max(1, triton.next_power_of_2(rows))
    return max(16, min(triton.next_power_of_2(max(1, numel)), max(16, cap)))


def check_device(*tensors: torch.Tensor) -> None:
    """Raise when a tensor's device cannot run the kernels as decorated (compiled vs interpreted)."""
    for t in tensors:
        if t.device.type == "cpu" and not INTERPRETED:
            raise RuntimeError(
                "mcgraph.kernels: CPU tensors need Triton's interpreter, but the kernels were imported without "
                "TRITON_INTERPRET=1; set it in the environment before mcgraph.kernels is first imported")
        if t.device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"mcgraph.kernels: device {t.device} is not supported (expected cuda, or cpu "
                               f"under TRITON_INTERPRET=1)")


def check_num_samples(num_samples) -> int:
    if isinstance(num_samples, bool) or not isinstance(num_samples, int):
        raise TypeError(f"num_samples must be an int, got {type(num_samples).__name__} ({num_samples!r})")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    return num_samples


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} ({seed!r})")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return seed
