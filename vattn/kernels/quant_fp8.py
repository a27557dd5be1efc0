"""The Triton kernel behind ``vattn::static_scaled_fp8_quant`` on CUDA.

One program per (row, column block) of ``x`` viewed as (R, C) (R = ``x.shape[0]``, C = the
rest flattened; the inner dims must be contiguous, as they are for a q/k/v split of a fused
QKV projection, else ``x`` is copied first). It computes ``saturate(x / scale)`` with IEEE
division (``div_rn``, like torch) and a NaN-propagating clamp, then rounds to fp8 (nearest
even), so it matches ``vattn.ops.quant_fp8.quantize_fp8_native`` bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vattn.kernels.fp8 import fp8_round_fix, round_to_fp8_grid

__all__ = ["triton_static_fp8_quant"]


@triton.jit
def _static_fp8_quant_kernel(
    x_ptr, out_ptr, scale_ptr,
    n_cols, x_row_stride, out_row_stride, group_size,
    FP8_MAX: tl.constexpr, PER_GROUP: tl.constexpr, BLOCK: tl.constexpr, FP8_ROUND_FIX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if PER_GROUP:
        s = tl.load(scale_ptr + cols // group_size, mask=mask, other=1.0).to(tl.float32)
    else:
        s = tl.load(scale_ptr).to(tl.float32)
    y = tl.math.div_rn(x, s)
    y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))  # NaN stays NaN
    if FP8_ROUND_FIX:  # the interpreter's cast mis-rounds; the fix loses the sign of zero
        r = round_to_fp8_grid(y, FP8_ROUND_FIX)
        y = tl.where(r == 0.0, y * 0.0, r)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as (R, C) without a copy when its inner dims are contiguous, else a contiguous copy."""
    if t.dim() == 0:
        return t.reshape(1, 1)
    if t.dim() == 1:
        return t.view(1, -1) if t.stride(0) == 1 else t.contiguous().view(1, -1)
    try:
        rows = t.view(t.shape[0], -1)
    except RuntimeError:
        return t.contiguous().view(t.shape[0], -1)
    return rows if rows.stride(1) == 1 else t.contiguous().view(t.shape[0], -1)


def triton_static_fp8_quant(out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> None:
    """``out = saturate(x / scale).to(out.dtype)``; see ``vattn.ops.quant_fp8.static_scaled_fp8_quant``.

    | tensor | shape | dtype |
    | --- | --- | --- |
    | x | (R, ...) | fp16 / bf16 / fp32 |
    | out | x's shape | float8_e4m3fn / float8_e5m2 |
    | scale | () / (1,) per tensor, (G,) per group of each row | float32 |

    No host synchronization (CUDA-graph safe). Empty ``x`` launches nothing.
    """
    if x.numel() == 0:
        return
    x2 = _as_rows(x)
    n_rows, n_cols = x2.shape
    staged = not out.is_contiguous()  # write a contiguous buffer, then copy into ``out``
    o2 = torch.empty((n_rows, n_cols), dtype=out.dtype, device=out.device) if staged else out.view(n_rows, n_cols)
    groups = scale.numel()
    block = min(1024, triton.next_power_of_2(n_cols))
    grid = (n_rows, triton.cdiv(n_cols, block))
    _static_fp8_quant_kernel[grid](
        x2, o2, scale,
        n_cols, x2.stride(0), o2.stride(0), max(n_cols // groups, 1),
        FP8_MAX=float(torch.finfo(out.dtype).max), PER_GROUP=groups > 1, BLOCK=block,
        FP8_ROUND_FIX=fp8_round_fix(out.dtype, out.device),
        num_warps=4 if block >= 512 else 1,
    )
    if staged:
        out.copy_(o2.view(out.shape))
