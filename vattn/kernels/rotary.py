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
def rotate_half_load(x_ptrs, partner_ptrs, cos_ptrs, sin_ptrs, first_half, mask, OUT_TY: tl.constexpr):
    """Load ``x`` and return it rotated, in ``OUT_TY`` (the dtype of ``x``).

    ``partner_ptrs`` point at ``x[d + D/2]`` where ``first_half`` (d < D/2) and at
    ``x[d - D/2]`` elsewhere; ``cos_ptrs`` / ``sin_ptrs`` at the rows' ``cos[d]`` / ``sin[d]``.
    Every pointer tensor has ``x_ptrs``' shape; masked elements are 0."""
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(partner_ptrs, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptrs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptrs, mask=mask, other=0.0).to(tl.float32)
    return (x * c + tl.where(first_half, -xp, xp) * s).to(OUT_TY)
