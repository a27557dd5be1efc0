"""fp8 helpers shared by vattn's Triton kernels.

``round_to_fp8_grid`` rounds fp32 values to the nearest (ties to even) fp8 value, still in
fp32. On a GPU the ``cvt`` instructions round correctly and it is never used; the Triton CPU
interpreter (``TRITON_INTERPRET=1``, Triton 3.9) mis-rounds fp32 -> fp8 when rounding carries
into the exponent (124.0 -> e4m3 gives 64.0), so launchers enable it for CPU tensors only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["FP8_DTYPES", "fp8_round_fix", "round_to_fp8_grid", "to_cache_dtype"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def fp8_round_fix(dtype: torch.dtype, device: torch.device) -> int:
    """The ``FP8_ROUND_FIX`` constexpr: fp8 mantissa bits on CPU (the interpreter), else 0."""
    if device.type == "cuda" or dtype not in _MANTISSA_BITS:
        return 0
    return _MANTISSA_BITS[dtype]


@triton.jit
def round_to_fp8_grid(x, MANT: tl.constexpr):
    """Round fp32 ``x`` to the fp8 grid with ``MANT`` mantissa bits (3: e4m3fn, 2: e5m2),
    keeping the sign of a value that rounds to zero (-0.0005 -> -0.0, as ``cvt`` gives)."""
    MIN_EXP: tl.constexpr = -6 if MANT == 3 else -14
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXP)
    quantum = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)
    y = tl.abs(x) / quantum
    y = (y + 12582912.0) - 12582912.0  # round half to even via 1.5 * 2**23
    y = y * quantum
    return tl.where(bits < 0, -y, y)


@triton.jit
def to_cache_dtype(x, scale_ptr, cache_ty, FP8: tl.constexpr, FP8_MAX: tl.constexpr, ROUND_FIX: tl.constexpr):
    """New K or V values as a paged KV cache of element type ``cache_ty`` stores them: fp8
    caches ``clamp(x / scale, -FP8_MAX, FP8_MAX)`` rounded to nearest (``ROUND_FIX``: the
    interpreter's fix, see ``fp8_round_fix``), other caches ``x`` cast."""
    if FP8:
        y = x.to(tl.float32) / tl.load(scale_ptr)
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        if ROUND_FIX:
            y = round_to_fp8_grid(y, ROUND_FIX)
        return y.to(cache_ty)
    return x.to(cache_ty)
