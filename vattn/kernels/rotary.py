"""Rotary position embedding (rotate-half / NeoX form) applied where a kernel loads q or k.

``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x[D/2:], x[:D/2])`` over the
head dim, ``cos`` / ``sin`` given per token as (T, D) rows (transformers computes them once a
step, any RoPE scaling included). Computed in fp32 and rounded once to the input dtype, as
Inductor computes the same expression, so a fused rotation stores the keys an unfused one does.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["rotate_half_load"]


@triton.jit
def rotate_half_load(row_ptrs, stride_d, offs_d, cos_rows, sin_rows, mask, HEAD_SIZE: tl.constexpr,
                     OUT_TY: tl.constexpr):
    """Load rows of ``x`` and return them rotated, in ``OUT_TY`` (the dtype of ``x``).

    ``row_ptrs``: where each row starts (element ``d`` at ``+ d * stride_d``); ``cos_rows`` /
    ``sin_rows``: where each row's contiguous (D,) cos / sin start; ``offs_d``: the head-dim
    offsets, shaped to broadcast against the rows (``offs_d[None, :]`` for a tile of rows, as
    is for one row). Masked elements are 0."""
    first_half = offs_d < HEAD_SIZE // 2  # element d pairs with d + D/2 (first half) or d - D/2
    partner = tl.where(first_half, offs_d + HEAD_SIZE // 2, offs_d - HEAD_SIZE // 2)
    x = tl.load(row_ptrs + offs_d * stride_d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row_ptrs + partner * stride_d, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_rows + offs_d, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_rows + offs_d, mask=mask, other=0.0).to(tl.float32)
    return (x * c + tl.where(first_half, -xp, xp) * s).to(OUT_TY)
