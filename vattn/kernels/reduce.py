"""Row-reduction combiners shared by vattn's Triton kernels: ``tl.reduce(x, axis, MAX)`` and
``tl.reduce(x, axis, SUM)``.

They are Triton's own combiners (what ``tl.max`` / ``tl.sum`` use; the CPU interpreter reduces
those with numpy), so no ``triton.language`` @jit helper is called: those are compiled-mode
objects unless ``TRITON_INTERPRET`` was set before triton was imported, and the tests build the
kernels in interpreter mode after the fact. Triton versions without them get plain @jit ones.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["MAX", "SUM"]


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add2(a, b):
    return a + b


MAX = getattr(tl.standard, "_elementwise_max", _max2)
SUM = getattr(tl.standard, "_sum_combine", _add2)
