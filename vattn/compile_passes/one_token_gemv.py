"""Linear layers of 1-token code as vattn's Triton GEMV (``CompilationConfig.one_token_gemv``).

A batch-1 decode step is a chain of matrix-vector products, each short enough that its
launch and ramp-up cost about as much as streaming its weight. Inductor's 1-token code turns
them into fused reductions that run the Llama-3.2-1B projections at 1.4 - 2.8 TB/s on an
H100. ``vattn::gemv`` (``vattn.ops.triton_gemv``) launches with programmatic dependent
launch, so each GEMV loads its first weight block while the kernel before it finishes: the
same four projections in a dependent chain took 46 us a layer against 60 us for cuBLAS
(``benchmarks/bench_gemv.py``, H100).

``rewrite(gm)`` works on a piece's Dynamo graph (before AOT tracing), for code compiled for
exactly one token (``compile_sizes``):

* ``F.linear(x, w)`` without a bias becomes ``vattn::gemv(x, w, False)``;
* ``F.linear(silu(h[..., :I]) * h[..., I:], w)`` with ``h.split(I, -1)`` into two halves
  (SwiGLU) becomes ``vattn::gemv(h, w, True)``, which applies the activation as it reads;
* ``F.linear(rms_norm(h), w)`` with ``transformers``' RMSNorm (float32 mean square, cast
  back, times the weight) becomes ``vattn::gemv(h, w, False, None, weight, eps)``;
* ``F.linear(x, w) + r`` (either order, same shape and dtype) passes ``r`` as the residual;
* a projection whose only use is neox-style RoPE of its first heads, written as the example
  model writes it (``qkv = linear.view(T, heads, D)``, ``x = qkv[:, :R]``,
  ``x * cos + x.roll(D // 2, -1) * sin`` with (T, 1, D) tables of its dtype, the other
  heads read only as ``qkv[:, S:]``, S >= R), passes ``cos``, ``sin`` and ``R * D``: the
  GEMV stores q and k rotated and ``x`` stands for the rotation's result.

A decoder layer's norms and residual adds then need no kernels of their own: 132 instead of
163 kernels in the batch-1 step of the 1B shape, replay 0.964 -> 0.932 ms (H100); RoPE in
the QKV projection: 100 instead of 116 kernels, replay 0.873 -> 0.861 ms (H100).

``vattn::gemv`` checks its inputs at run time and falls back to ``F.linear`` for anything
but one bf16/fp16 row on CUDA, so the rewrite never changes what a graph computes.
``VattnBackend`` applies it to sm_90+ pieces compiled for 1 token, and compiles them with
Inductor's own PDL (``triton.enable_pdl``), so the norm before a GEMV lets it start early.
Together, on the Llama-3.2-1B FULL-graph decode step (H100, ``profile_step.py --gemv on off``)
the replay went from 1.017 to 0.952 ms; the GEMVs alone gave about 0.03 ms of that.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable, NamedTuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

__all__ = ["rewrite"]

logger = logging.getLogger("vattn.compile_passes.one_token_gemv")

_SILU = (F.silu, torch.ops.aten.silu.default)
_MUL = (operator.mul, torch.mul)
_ADD = (operator.add, torch.add)


def _split_half(node: Any, index: int) -> fx.Node | None:
    """``h`` when ``node`` is ``h.split(I, dim=-1)[index]`` and the split makes two halves."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem
            and node.args[1] == index):
        return None
    split = node.args[0]
    if not (isinstance(split, fx.Node) and split.op == "call_method" and split.target == "split"):
        return None
    h, size = split.args[0], split.args[1]
    dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    val = h.meta.get("example_value") if isinstance(h, fx.Node) else None
    if not isinstance(size, int) or not isinstance(val, torch.Tensor) or dim not in (-1, val.dim() - 1):
        return None
    return h if val.shape[-1] == 2 * size else None


def _swiglu_input(x: Any) -> fx.Node | None:
    """``h`` when ``x`` is ``silu(h[..., :I]) * h[..., I:]`` (see ``_split_half``)."""
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target in _MUL and len(x.args) == 2):
        return None
    act, up = x.args
    if not (isinstance(act, fx.Node) and act.op == "call_function" and act.target in _SILU
            and not act.kwargs.get("inplace", False)):
        return None
    h = _split_half(act.args[0], 0)
    return h if h is not None and _split_half(up, 1) is h else None


def _call(node: Any, functions: tuple[Any, ...] = (), method: str | None = None) -> bool:
    """Whether ``node`` calls one of ``functions`` (call_function) or the method ``method``."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in functions
    return node.op == "call_method" and node.target == method


def _value(node: Any) -> torch.Tensor | None:
    val = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _pair(node: fx.Node, first: Callable[[Any], Any]) -> tuple[Any, Any] | None:
    """``(a, b)`` for a binary ``node(a, b)`` or ``node(b, a)`` where ``first(a)`` holds."""
    if len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if first(a):
        return a, b
    if first(b):
        return b, a
    return None


def _to_float32(node: Any) -> fx.Node | None:
    """``h`` when ``node`` is ``h.float()`` or ``h.to(torch.float32)``."""
    if _call(node, method="float") and len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    if _call(node, method="to") and _arg(node, 1, "dtype") is torch.float32 and len(node.args) <= 2:
        return node.args[0]
    return None


def _mean_square(node: Any) -> fx.Node | None:
    """``xf`` when ``node`` is ``xf.pow(2).mean(-1, keepdim=True)`` (method or function forms)."""
    if not _call(node, (torch.mean,), "mean") or node.kwargs.get("keepdim") is not True:
        return None
    dim = _arg(node, 1, "dim")
    if dim not in (-1, [-1], (-1,)):
        return None
    sq = node.args[0]
    if not (_call(sq, (torch.pow,), "pow") and _arg(sq, 1, "exponent") == 2):
        return None
    return sq.args[0]


def _rms_norm_input(y: Any) -> tuple[fx.Node, fx.Node, float] | None:
    """``(h, weight, eps)`` when ``y`` is the RMSNorm of ``transformers`` (and the example model)::

        xf = h.float()  # or h.to(torch.float32)
        y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)

    with ``h`` and ``weight`` (K,) in one 16-bit dtype.
    """
    if not _call(y, _MUL):
        return None
    pair = _pair(y, lambda n: _call(n, method="to"))
    if pair is None:
        return None
    cast, weight = pair
    if len(cast.args) != 2 or cast.kwargs:
        return None
    normed, dtype = cast.args
    if not _call(normed, _MUL):
        return None
    pair = _pair(normed, lambda n: _call(n, (torch.rsqrt,), "rsqrt"))
    if pair is None:
        return None
    rsqrt, xf = pair
    shifted = rsqrt.args[0] if len(rsqrt.args) == 1 else None
    if not _call(shifted, _ADD):
        return None
    pair = _pair(shifted, lambda n: isinstance(n, fx.Node))
    if pair is None or not isinstance(pair[1], float):
        return None
    mean, eps = pair
    h = _to_float32(xf)
    if h is None or _mean_square(mean) is not xf:
        return None
    h_val, w_val = _value(h), _value(weight)
    if (h_val is None or w_val is None or h_val.dtype not in (torch.float16, torch.bfloat16)
            or dtype is not h_val.dtype or w_val.dtype is not h_val.dtype or w_val.dim() != 1
            or not statically_known_true(w_val.shape[0] == h_val.shape[-1])):
        return None
    return h, weight, eps


def _residual_add(linear: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(add, r)`` when the only use of ``linear`` is ``linear + r`` (either order) with ``r``
    of its shape and dtype (no broadcasting, no type promotion)."""
    if len(linear.users) != 1:
        return None
    (add,) = linear.users
    if not _call(add, _ADD):
        return None
    pair = _pair(add, lambda n: n is linear)
    if pair is None or pair[1] is linear:
        return None
    r = pair[1]
    out_val, r_val = _value(linear), _value(r)
    if (out_val is None or r_val is None or r_val.dtype is not out_val.dtype or r_val.dim() != out_val.dim()
            or not all(statically_known_true(a == b) for a, b in zip(r_val.shape, out_val.shape))):
        return None
    return add, r


def _head_slice(node: Any, view: fx.Node) -> tuple[int, int | None] | None:
    """``(start, stop)`` when ``node`` is ``view[:, start:stop]`` (a slice of the heads dim)."""
    if not (_call(node, (operator.getitem,)) and node.args[0] is view and isinstance(node.args[1], tuple)
            and len(node.args[1]) == 2):
        return None
    tokens, heads = node.args[1]
    if tokens != slice(None) or not isinstance(heads, slice) or heads.step not in (None, 1):
        return None
    start, stop = heads.start or 0, heads.stop
    if not isinstance(start, int) or not (stop is None or isinstance(stop, int)) or start < 0 or (stop or 0) < 0:
        return None
    return start, stop


class _Rope(NamedTuple):
    rotated: fx.Node  # the slice x of the rotated heads
    cos: Any
    sin: Any
    cols: int  # R * D
    dead: tuple[fx.Node, ...]  # add, then the nodes only it used (erase in this order)


def _rope_epilogue(linear: fx.Node) -> _Rope | None:
    """A ``_Rope`` when the 1-token projection ``linear`` (T, N) only feeds neox-style RoPE
    of its first heads (the example model's fused QKV)::

        qkv = linear.view(T, heads, D)
        x = qkv[:, :R]                          # the heads RoPE rotates (q and k)
        add = x * cos + x.roll(D // 2, -1) * sin    # cos, sin: (T or 1, 1, D), sin signed
        ... qkv[:, S:] with S >= R              # any other use reads heads it does not rotate

    Once the projection stores rotated values, the slice ``x`` holds ``add``'s. The dtypes
    must all be the projection's (no promotion)."""
    if len(linear.users) != 1:
        return None
    (view,) = linear.users
    out_val, view_val = _value(linear), _value(view)
    if not (_call(view, method="view") and view.args[0] is linear and out_val is not None
            and view_val is not None and view_val.dim() == 3 and out_val.dim() == 2):
        return None
    d = view_val.shape[-1]
    if not isinstance(d, int) or d % 2:
        return None
    found = None
    for use in view.users:
        span = _head_slice(use, view)
        if span is None:
            return None
        if span[0] == 0 and span[1] is not None and len(use.users) == 2:
            if found is not None:
                return None
            found = use
    if found is None:
        return None
    r = found.args[1][1].stop
    if not (isinstance(view_val.shape[1], int) and 0 < r <= view_val.shape[1]):
        return None
    if any(u is not found and _head_slice(u, view)[0] < r for u in view.users):  # reads a rotated head
        return None
    users = list(found.users)
    roll = next((u for u in users if _call(u, (torch.roll,), "roll")), None)
    if roll is None or roll.args[0] is not found:
        return None
    shifts, dims = _arg(roll, 1, "shifts"), _arg(roll, 2, "dims")
    shifts = shifts[0] if isinstance(shifts, (tuple, list)) and len(shifts) == 1 else shifts
    dims = dims[0] if isinstance(dims, (tuple, list)) and len(dims) == 1 else dims
    if shifts not in (d // 2, -(d // 2)) or dims not in (-1, 2):
        return None
    (mul_cos,) = [u for u in users if u is not roll]
    if len(roll.users) != 1 or len(mul_cos.users) != 1 or not _call(mul_cos, _MUL):
        return None
    (mul_sin,) = roll.users
    (add,) = mul_cos.users
    if not (_call(mul_sin, _MUL) and _call(add, _ADD) and len(mul_sin.users) == 1
            and set(add.args) == {mul_cos, mul_sin} and len(add.args) == 2 and not add.kwargs):
        return None
    cos = _pair(mul_cos, lambda n: n is found)
    sin = _pair(mul_sin, lambda n: n is roll)
    if cos is None or sin is None:
        return None
    cos, sin = cos[1], sin[1]
    dt = out_val.dtype
    for t in (cos, sin):
        val = _value(t)
        if (val is None or val.dtype is not dt or val.dim() != 3 or val.shape[-1] != d
                or not statically_known_true(val.shape[1] == 1)):
            return None
    if _value(add) is None or _value(add).dtype is not dt:
        return None
    return _Rope(found, cos, sin, r * d, (add, mul_sin, roll, mul_cos))


def rewrite(gm: fx.GraphModule) -> int:
    """Replace the bias-free ``F.linear`` calls of ``gm`` by ``vattn::gemv`` (in place,
    recompiled), fusing SwiGLU or RMSNorm into their input and a residual add into their
    output; returns how many linear layers were replaced."""
    count = fused = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch._C._nn.linear:
            continue
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if bias is not None:
            continue
        args: tuple[Any, ...] = (x, w, False, None, None, 0.0)
        h = _swiglu_input(x)
        norm = None if h is not None else _rms_norm_input(x)
        if h is not None:
            args = (h, w, True, None, None, 0.0)
        elif norm is not None:
            args = (norm[0], w, False, None, norm[1], norm[2])
        res = _residual_add(node)
        rope = None if res is not None else _rope_epilogue(node)
        anchor = node
        if res is not None:  # insert at the add: the residual may be computed after the linear
            anchor, args = res[0], (*args[:3], res[1], *args[4:])
        if rope is not None and not all(order[t] < order[node] for t in (rope.cos, rope.sin)):
            rope = None  # the gemv takes the linear's place: cos and sin must be computed by then
        if rope is not None:
            args = (*args, rope.cos, rope.sin, rope.cols)
        with gm.graph.inserting_before(anchor):
            new = gm.graph.call_function(torch.ops.vattn.gemv.default, args)
        new.meta.update(anchor.meta)
        anchor.replace_all_uses_with(new)
        gm.graph.erase_node(anchor)
        if anchor is not node:
            gm.graph.erase_node(node)
        if rope is not None:  # the slice of the heads now reads rotated values: it stands for the add
            rope.dead[0].replace_all_uses_with(rope.rotated)
            for dead in rope.dead:
                gm.graph.erase_node(dead)
        count += 1
        fused += (h is not None) + (norm is not None) + (res is not None) + (rope is not None)
    if count:  # the SwiGLU and norm nodes left unused are dropped by Inductor's dead-code elimination
        gm.recompile()
        logger.debug("one_token_gemv: %d linear layers -> vattn::gemv, %d input/output fusions", count, fused)
    return count
