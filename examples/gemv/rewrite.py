"""The 1-token rewrite: a piece's bias-free linear layers as ``vattn_examples::gemv``.

``rewrite(gm)`` works on a piece's Dynamo graph (torch functions, before AOT tracing), for
code compiled for exactly one token (``examples.gemv.OneTokenGemv`` calls it):

* ``F.linear(x, w)`` without a bias becomes ``vattn_examples::gemv(x, w, False)``;
* ``F.linear(silu(h[..., :I]) * h[..., I:], w)`` with ``h.split(I, -1)`` into two halves
  (SwiGLU) becomes ``vattn_examples::gemv(h, w, True)``, which applies the activation as it reads;
  ``F.linear(silu(g) * u, w)`` with separate gate and up projections (``transformers``' Llama
  MLP) becomes ``vattn_examples::gemv(g, w, True, up=u)``;
* ``F.linear(rms_norm(h), w)`` with ``transformers``' RMSNorm (float32 mean square, cast
  back, times the weight) becomes ``vattn_examples::gemv(h, w, False, None, weight, eps)``;
* ``F.linear(x, w) + r`` (either order, same shape and dtype) passes ``r`` as the residual;
* a projection whose only use is neox-style RoPE of its first heads (``qkv =
  linear.view(T, heads, D)``, ``x = qkv[:, :R]`` or all of ``qkv``, the other heads read
  only as ``qkv[:, S:]``, S >= R), written as ``transformers`` does (``x * cos +
  rotate_half(x) * sin``, ``rotate_half(x) = cat((-x2, x1), -1)``) or with the halves rolled
  (``x * cos + x.roll(D // 2, -1) * sin``, sin signed), with (T, 1, D) tables of its dtype,
  passes ``cos``, ``sin``, ``R * D`` and which sin it is: the GEMV stores the heads rotated and
  ``x`` stands for the rotation's result. Tables computed after the projection (a few pure
  ops) move before it.

A decoder layer's norms, activation and residual adds then need no kernels of their own.
``vattn_examples::gemv`` checks its inputs at run time and falls back to ``F.linear`` for
anything but one bf16/fp16 row on CUDA, so the rewrite never changes what a graph computes.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable, NamedTuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

import examples.gemv.op  # noqa: F401  (registers torch.ops.vattn_examples.gemv)

__all__ = ["rewrite"]

logger = logging.getLogger("examples.gemv.rewrite")

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


def _swiglu_pair(x: Any) -> tuple[fx.Node, fx.Node] | None:
    """``(gate, up)`` when ``x`` is ``silu(gate) * up`` with two tensors of one shape and 16-bit
    dtype (separate gate and up projections, as ``transformers``' Llama MLP has them)."""
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target in _MUL and len(x.args) == 2
            and not x.kwargs):
        return None
    act, up = x.args
    if not (isinstance(act, fx.Node) and act.op == "call_function" and act.target in _SILU
            and not act.kwargs.get("inplace", False) and len(act.args) == 1):
        return None
    gate = act.args[0]
    g_val, u_val = _value(gate), _value(up)
    if (g_val is None or u_val is None or g_val.dtype is not u_val.dtype
            or g_val.dtype not in (torch.float16, torch.bfloat16) or g_val.dim() != u_val.dim()
            or not all(statically_known_true(a == b) for a, b in zip(g_val.shape, u_val.shape))):
        return None
    return gate, up


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
    rotated: fx.Node  # x: the view, or its slice of the rotated heads
    cos: Any
    sin: Any
    cols: int  # R * D
    unsigned_sin: bool  # rotate-half as cat(-x2, x1): sin's first half is negated in the kernel
    dead: tuple[fx.Node, ...]  # add, then the nodes only it used (erase in this order)


_NEG = (operator.neg, torch.neg)


def _last_dim(dim: Any, ndim: int = 3) -> bool:
    dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
    return dim in (-1, ndim - 1)


def _half_of(node: Any, x: fx.Node, d: int) -> int | None:
    """0 for ``x[..., :d/2]``, 1 for ``x[..., d/2:]`` (a getitem of ``x``'s last dim), else None."""
    if not (_call(node, (operator.getitem,)) and node.args[0] is x and isinstance(node.args[1], tuple)):
        return None
    *lead, last = node.args[1]
    if not isinstance(last, slice) or last.step not in (None, 1) or not (
            lead == [Ellipsis] or lead == [slice(None)] * 2):
        return None
    if last.start in (None, 0) and last.stop == d // 2:
        return 0
    if last.start == d // 2 and last.stop in (None, d):
        return 1
    return None


def _rotation(x: fx.Node, d: int) -> tuple[fx.Node, bool, tuple[fx.Node, ...]] | None:
    """``(rotate_half(x), unsigned_sin, nodes)`` among the users of ``x`` (D its last dim):
    ``x.roll(D // 2, -1)`` (times a signed sin), or transformers' ``cat((-x2, x1), -1)`` with
    ``x1, x2`` its halves (times the plain sin). ``nodes``: the ones that only serve it."""
    for u in x.users:
        if _call(u, (torch.roll,), "roll") and u.args[0] is x:
            shifts = _arg(u, 1, "shifts")
            shifts = shifts[0] if isinstance(shifts, (tuple, list)) and len(shifts) == 1 else shifts
            if shifts in (d // 2, -(d // 2)) and _last_dim(_arg(u, 2, "dims")) and len(u.users) == 1:
                return u, False, (u,)
    halves = [u for u in x.users if _half_of(u, x, d) is not None]
    if len(halves) != 2 or {_half_of(u, x, d) for u in halves} != {0, 1}:
        return None
    x1, x2 = sorted(halves, key=lambda u: _half_of(u, x, d))
    if len(x1.users) != 1 or len(x2.users) != 1:
        return None
    (neg,) = x2.users
    (cat,) = x1.users
    if not (_call(neg, _NEG) and len(neg.users) == 1 and next(iter(neg.users)) is cat and len(cat.users) == 1
            and _call(cat, (torch.cat,), None)):
        return None
    parts = _arg(cat, 0, "tensors")
    if not (isinstance(parts, (tuple, list)) and list(parts) == [neg, x1] and _last_dim(_arg(cat, 1, "dim", 0))):
        return None
    return cat, True, (cat, neg, x2, x1)


def _rope_epilogue(linear: fx.Node) -> _Rope | None:
    """A ``_Rope`` when the 1-token projection ``linear`` (T, N) only feeds neox-style RoPE
    of its first heads, as the example model (fused QKV) or a transformers-style model
    (separate q / k projections) writes it::

        qkv = linear.view(T, heads, D)  # transformers: (1, T, N).view(1, T, heads, D).transpose(1, 2)
        x = qkv[:, :R]          # the heads RoPE rotates (or x = qkv: all of them)
        add = x * cos + x.roll(D // 2, -1) * sin    # sin signed: its first half -sin
        add = x * cos + torch.cat((-x[..., D // 2:], x[..., : D // 2]), -1) * sin  # or this
        ... qkv[:, S:] with S >= R                  # any other use reads heads it does not rotate

    cos, sin: (T or 1, 1, D). Once the projection stores rotated values, ``x`` holds
    ``add``'s. The dtypes must all be the projection's (no promotion)."""
    if len(linear.users) != 1:
        return None
    (view,) = linear.users
    out_val, view_val = _value(linear), _value(view)
    if not (_call(view, method="view") and view.args[0] is linear and out_val is not None
            and view_val is not None and (out_val.dim(), view_val.dim()) in ((2, 3), (3, 4))):
        return None
    heads, d = view_val.shape[-2], view_val.shape[-1]
    if not isinstance(d, int) or not isinstance(heads, int) or d % 2:
        return None
    found, r = None, 0
    if out_val.dim() == 3:  # transformers: (1, T, N) -> view (1, T, H, D) -> transpose(1, 2), every head rotated
        tr = next(iter(view.users)) if len(view.users) == 1 else None
        if not (_call(tr, (torch.transpose,), "transpose") and tr.args[0] is view and not tr.kwargs
                and {a % 4 for a in tr.args[1:]} == {1, 2} and len(tr.args) == 3):
            return None
        found, r = tr, heads
    elif all(_head_slice(u, view) is None for u in view.users):
        found, r = view, heads  # every head rotated
    else:
        for use in view.users:
            span = _head_slice(use, view)
            if span is None:
                return None
            if span[0] == 0 and span[1] is not None and len(use.users) >= 2:
                if found is not None:
                    return None
                found, r = use, span[1]
        if found is None or not 0 < r <= heads:
            return None
        if any(u is not found and _head_slice(u, view)[0] < r for u in view.users):  # reads a rotated head
            return None
    rotation = _rotation(found, d)
    if rotation is None:
        return None
    rot, unsigned, rot_nodes = rotation
    rest = [u for u in found.users if u not in rot_nodes]
    if len(rest) != 1 or len(rot.users) != 1:
        return None
    (mul_cos,) = rest
    (mul_sin,) = rot.users
    if not (_call(mul_cos, _MUL) and _call(mul_sin, _MUL) and len(mul_cos.users) == 1 and len(mul_sin.users) == 1):
        return None
    (add,) = mul_cos.users
    if not (_call(add, _ADD) and len(add.args) == 2 and not add.kwargs and set(add.args) == {mul_cos, mul_sin}):
        return None
    cos = _pair(mul_cos, lambda n: n is found)
    sin = _pair(mul_sin, lambda n: n is rot)
    if cos is None or sin is None:
        return None
    cos, sin = cos[1], sin[1]
    dt, ndim = out_val.dtype, view_val.dim()
    for t in (cos, sin):  # (T or 1, 1, D), or (1, 1, T or 1, D) beside transformers' (1, H, T, D)
        val = _value(t)
        if (val is None or val.dtype is not dt or val.dim() != ndim or val.shape[-1] != d
                or not all(statically_known_true(s == 1) for s in val.shape[1:ndim - 2])):
            return None
    if _value(add) is None or _value(add).dtype is not dt:
        return None
    return _Rope(found, cos, sin, r * d, unsigned, (add, mul_sin, *rot_nodes, mul_cos))


def _hoist(value: Any, before: fx.Node, order: dict[fx.Node, int], budget: int = 4) -> bool:
    """Whether ``value`` is computed before ``before``, moving it there if it is not and it is
    a pure op of at most ``budget`` nodes on what is (transformers' ``cos.unsqueeze(1)``,
    written after the projections); ``order`` holds the nodes' positions (kept up to date)."""
    if not isinstance(value, fx.Node) or order[value] < order[before]:
        return True
    if value is before or value.op not in ("call_function", "call_method") or value.is_impure() or budget <= 0:
        return False
    inputs = value.all_input_nodes
    if not all(_hoist(n, before, order, budget - 1) for n in inputs):
        return False
    before.prepend(value)
    order.update((n, i) for i, n in enumerate(before.graph.nodes))
    return True


def rewrite(gm: fx.GraphModule) -> int:
    """Replace the bias-free ``F.linear`` calls of ``gm`` by ``vattn_examples::gemv`` (in place,
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
        kwargs: dict[str, Any] = {}
        h = _swiglu_input(x)
        pair = None if h is not None else _swiglu_pair(x)
        norm = None if h is not None or pair is not None else _rms_norm_input(x)
        if h is not None:
            args = (h, w, True, None, None, 0.0)
        elif pair is not None:  # the up projection as its own input
            args, kwargs = (pair[0], w, True, None, None, 0.0), {"up": pair[1]}
        elif norm is not None:
            args = (norm[0], w, False, None, norm[1], norm[2])
        res = _residual_add(node)
        rope = None if res is not None else _rope_epilogue(node)
        anchor = node
        if res is not None:  # insert at the add: the residual may be computed after the linear
            anchor, args = res[0], (*args[:3], res[1], *args[4:])
        if rope is not None and not all(_hoist(t, node, order) for t in (rope.cos, rope.sin)):
            rope = None  # the gemv takes the linear's place: cos and sin must be computed by then
        if rope is not None:
            args = (*args, rope.cos, rope.sin, rope.cols, rope.unsigned_sin)
        with gm.graph.inserting_before(anchor):
            new = gm.graph.call_function(torch.ops.vattn_examples.gemv.default, args, kwargs)
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
        fused += (h is not None or pair is not None) + (norm is not None) + (res is not None) + (rope is not None)
    groups = _group_projections(gm) if count else 0
    if count:  # the SwiGLU and norm nodes left unused are dropped by Inductor's dead-code elimination
        gm.recompile()
        logger.debug("OneTokenGemv: %d linear layers -> vattn_examples::gemv, %d input/output fusions, %d groups",
                     count, fused, groups)
    return count


_GEMV = torch.ops.vattn_examples.gemv.default


def _group_member(node: fx.Node) -> tuple[tuple[Any, ...], bool] | None:
    """(group key, rotated) for a gemv that may share a launch with others of its input: no SwiGLU,
    no residual, and RoPE (if any) on all of its heads."""
    if node.op != "call_function" or node.target is not _GEMV or node.kwargs or len(node.args) not in (6, 10):
        return None
    x, w, silu, res, nw, eps = node.args[:6]
    if silu or res is not None:
        return None
    if len(node.args) == 6:
        return (x, nw, eps), False
    cos, sin, cols, unsigned = node.args[6:]
    w_val = _value(w)
    if w_val is None or not statically_known_true(w_val.shape[0] == cols):
        return None
    return (x, nw, eps, cos, sin, unsigned), True


def _group_projections(gm: fx.GraphModule) -> int:
    """Fold the gemvs of one input (a model's separate q / k / v projections after one norm, or
    gate / up) into one ``vattn_examples::gemv_group`` each: the rotated ones (q, k) first, then
    the plain ones, 2 or 3 a launch, each member's output a ``narrow`` of the group's (the
    ``view`` calls on it become ``reshape``). Returns how many groups were made."""
    by_input: dict[tuple[Any, ...], list[tuple[fx.Node, bool, tuple[Any, ...]]]] = {}
    for node in gm.graph.nodes:
        member = _group_member(node)
        if member is not None:
            key, rotated = member
            by_input.setdefault(key[:3], []).append((node, rotated, key))
    made = 0
    for members in by_input.values():
        order = {n: i for i, n in enumerate(gm.graph.nodes)}  # anew: earlier groups added nodes
        rotated = [m for m in members if m[1]]
        plain = [m for m in members if not m[1]]
        if len({m[2] for m in rotated}) > 1:  # RoPE with different tables: leave them alone
            continue
        chosen = rotated + plain
        if not 2 <= len(chosen) <= 3:
            continue
        first = min((m[0] for m in chosen), key=order.__getitem__)
        x, nw, eps = chosen[0][2][:3]
        rope = chosen[0][2][3:] if rotated else (None, None, False)
        inputs = [x, nw, *rope[:2], *(m[0].args[1] for m in chosen)]
        if any(isinstance(t, fx.Node) and order[t] > order[first] for t in inputs):
            continue  # an input computed after the first member (the group takes its place)
        vals = [_value(m[0]) for m in chosen]
        if any(v is None or not isinstance(v.shape[-1], int) for v in vals):
            continue
        with gm.graph.inserting_before(first):
            group = gm.graph.call_function(torch.ops.vattn_examples.gemv_group.default, (
                x, [m[0].args[1] for m in chosen], nw, eps, rope[0], rope[1], len(rotated), rope[2]))
            outs, start = [], 0
            for v in vals:
                outs.append(gm.graph.call_function(torch.narrow, (group, -1, start, v.shape[-1])))
                start += v.shape[-1]
        group.meta["example_value"] = vals[0].new_empty((*vals[0].shape[:-1], start))
        for (node, _, _), out in zip(chosen, outs):
            out.meta.update(node.meta)
            for user in list(node.users):
                if user.op == "call_method" and user.target == "view":
                    user.target = "reshape"  # a column slice cannot always be viewed
            node.replace_all_uses_with(out)
            gm.graph.erase_node(node)
        made += 1
    return made
