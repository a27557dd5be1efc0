"""RoPE into attention: a model's rotary embedding handed to the attention op, in Dynamo's graph.

transformers rotates q and k in each attention module (``apply_rotary_pos_emb``)::

    q_embed = q * cos + cat(-q[..., D/2:], q[..., :D/2]) * sin      # k likewise, same cos / sin
    attention(q_embed[0].transpose(0, 1), k_embed[0].transpose(0, 1), v, ...)

Compiled, that is an elementwise kernel of its own before every attention op, which
``vattn.compile`` cannot fuse with anything: the attention op starts a new split item. This
rewrite, run on the whole Dynamo graph before the split, finds the pattern above on both the
``query`` and the ``key`` of a vattn attention op (through single-user view chains, with one
cos and one sin for both) and calls the op with the unrotated q / k instead, plus
``rope_cos`` / ``rope_sin`` as (T, D) rows::

    attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v, ..., rope_cos=cos.reshape(-1, D), rope_sin=...)

Two other spellings of the same rotation are found too: Phi-3's ``cat([rotation of
x[..., :D], x[..., D:]], -1)`` with nothing passed through (the rotary dim is the whole head),
and gpt-oss's ``a, b = chunk(x, 2, -1); cat((a * cos - b * sin, b * cos + a * sin), -1)`` with
half-width cos / sin, whose (T, D) rows ``cat((cos, cos), -1)`` are built once, where the
model computes cos / sin, and shared by every layer.

The layer's backend then rotates q and the new keys as its kernels load them (TRITON_ATTN:
``AttentionImpl.fuses_rope``); other backends get them rotated by the op first
(``vattn.ops.rotary.apply_rotary``, the same fp32 arithmetic Inductor compiles). The rotation
nodes left without users are erased.

``CompilationConfig.fuse_rope``: None (default) rewrites the layers whose backend rotates in
its kernels, True every layer, False none. Anything else (partial rotary dims, interleaved
pairs, another layout of cos) is left alone.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

__all__ = ["fuse_rope"]

logger = logging.getLogger("vattn.compile")

_ATTENTION_OPS = ("vattn::unified_attention_with_output", "vattn::unified_attention")
#: Tensor methods a view chain from the rotated tensor to the op's argument may use.
_VIEW_METHODS = frozenset({"transpose", "view", "reshape", "permute", "contiguous", "squeeze", "unsqueeze",
                           "flatten"})
_ADD = (operator.add, torch.add)
_MUL = (operator.mul, torch.mul)
_NEG = (operator.neg, torch.neg)


def _example(n: Any) -> torch.Tensor | None:
    v = n.meta.get("example_value") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _op_name(target: Any) -> str | None:
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return None


def _arg(node: fx.Node, name: str) -> Any:
    """The op call's argument ``name`` (positional or keyword), or None."""
    if name in node.kwargs:
        return node.kwargs[name]
    op = node.target
    schema = (op.default if isinstance(op, torch._ops.OpOverloadPacket) else op)._schema
    names = [a.name for a in schema.arguments]
    i = names.index(name) if name in names else len(node.args)
    return node.args[i] if i < len(node.args) else None


def _is_view_link(n: fx.Node, src: fx.Node) -> bool:
    """``n`` is a view of ``src`` that a chain may replay: a tensor-method view, an integer index,
    or a ``.to`` that changes nothing (OLMo-2 casts the rotated q back to its own dtype)."""
    if not n.args or n.args[0] is not src:
        return False
    if n.op == "call_method" and n.target == "to":
        a, b = _example(n), _example(src)
        return a is not None and b is not None and (a.dtype, a.device) == (b.dtype, b.device)
    if n.op == "call_method":
        return n.target in _VIEW_METHODS
    if n.op == "call_function" and n.target is operator.getitem:
        idx = n.args[1]
        return isinstance(idx, int) or (isinstance(idx, tuple) and all(isinstance(i, int) for i in idx))
    return False


def _view_chain(arg: Any) -> tuple[fx.Node, list[fx.Node]] | None:
    """Walk back from the op's argument through single-user views: (the first non-view node, the
    views from it to ``arg`` in order), or None."""
    if not isinstance(arg, fx.Node) or len(arg.users) != 1:  # the op is its only user
        return None
    chain: list[fx.Node] = []
    cur = arg
    while (cur.op in ("call_method", "call_function") and cur.args and isinstance(cur.args[0], fx.Node)
           and _is_view_link(cur, cur.args[0])):
        chain.append(cur)
        cur = cur.args[0]
        if len(cur.users) != 1:
            return None
    chain.reverse()
    return cur, chain


def _call(n: Any, targets: tuple[Any, ...]) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets and len(n.args) >= 1


def _half_slice(n: Any, x: fx.Node, half: int) -> str | None:
    """"lo" / "hi" where ``n`` is ``x[..., :half]`` / ``x[..., half:]``."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target is operator.getitem
            and n.args[0] is x and isinstance(n.args[1], tuple) and len(n.args[1]) == 2
            and n.args[1][0] is Ellipsis and isinstance(n.args[1][1], slice)):
        return None
    s = n.args[1][1]
    if s.step not in (None, 1):
        return None
    if s.start in (None, 0) and s.stop == half:
        return "lo"
    if s.start == half and s.stop is None:
        return "hi"
    return None


def _cat2(n: Any) -> tuple[Any, Any, Any] | None:
    """(a, b, dim) where ``n`` is ``torch.cat((a, b), dim)``, else None."""
    if not (isinstance(n, fx.Node) and n.op == "call_function" and n.target is torch.cat):
        return None
    parts = n.args[0]
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
    return (parts[0], parts[1], dim) if isinstance(parts, (tuple, list)) and len(parts) == 2 else None


def _rotation(add: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, list[fx.Node]] | None:
    """(x, cos, sin, the rotation's nodes) where ``add`` is ``x * cos + cat(-x2, x1, dim=-1) * sin``."""
    if not _call(add, _ADD) or len(add.args) != 2 or add.kwargs:
        return None
    for plain, rotated in (add.args, add.args[::-1]):
        if not (_call(plain, _MUL) and _call(rotated, _MUL) and len(plain.args) == 2 and len(rotated.args) == 2):
            continue
        for cat, sin in (rotated.args, rotated.args[::-1]):
            found = _cat2(cat)
            if found is None or not _call(found[0], _NEG):
                continue
            neg, lo, dim = found
            hi = neg.args[0]
            x = hi.args[0] if isinstance(hi, fx.Node) and hi.args else None
            ex = _example(x)
            if ex is None or ex.dim() < 2 or dim not in (-1, ex.dim() - 1) or not isinstance(ex.shape[-1], int):
                continue
            half = ex.shape[-1] // 2
            if ex.shape[-1] % 2 or _half_slice(hi, x, half) != "hi" or _half_slice(lo, x, half) != "lo":
                continue
            for a, cos in (plain.args, plain.args[::-1]):
                if a is x and isinstance(cos, fx.Node) and isinstance(sin, fx.Node):
                    return x, cos, sin, [add, plain, rotated, cat, neg, hi, lo]
    return None


def _token_rows(x: torch.Tensor, cos: torch.Tensor, width: int) -> bool:
    """Whether ``cos`` holds one row of ``width`` per token of ``x``: the token dim (``x``'s one
    symbolic size) has ``x``'s size, every other dim but the last is 1. Sizes are compared as
    expressions (no guard is added)."""
    tok = [i for i, s in enumerate(x.shape) if isinstance(s, torch.SymInt)]
    if len(tok) != 1 or cos.dim() != x.dim() or cos.shape[-1] != width:
        return False
    (t,) = tok
    for i, s in enumerate(cos.shape[:-1]):
        if i == t:
            if not (isinstance(s, torch.SymInt) and str(s) == str(x.shape[t])):
                return False
        elif not (isinstance(s, int) and s == 1):
            return False
    return True


def _pass_through(cat: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, list[fx.Node]] | None:
    """Phi-3's form with nothing passed through, ``cat([rotate_half_form(x[..., :D]), x[..., D:]], -1)``
    (the rotary dim is the whole head): (x, cos, sin, the rotation's nodes), as ``_rotation``."""
    found = _cat2(cat)
    if found is None or found[2] != -1 or not isinstance(found[0], fx.Node):
        return None
    rotated, rest, _ = found
    rot = _rotation(rotated)
    if rot is None:
        return None
    x_rot = rot[0]
    if not (x_rot.target is operator.getitem and isinstance(rest, fx.Node) and rest.target is operator.getitem
            and rest.args[0] is x_rot.args[0]):
        return None
    ex, er = _example(x_rot.args[0]), _example(rest)
    d = ex.shape[-1] if ex is not None else None
    if er is None or er.shape[-1] != 0 or x_rot.args[1] != (Ellipsis, slice(None, d, None)):
        return None
    return x_rot.args[0], rot[1], rot[2], [cat, *rot[3], x_rot, rest]


def _halves(cat: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, list[fx.Node]] | None:
    """gpt-oss's form ``a, b = chunk(x, 2, -1); cat((a * cos - b * sin, b * cos + a * sin), -1)``
    with (..., D/2) cos / sin: rotate-half by ``cat((cos, cos), -1)``. (x, cos, sin, nodes)."""
    found = _cat2(cat)
    if found is None or found[2] != -1:
        return None
    first, second, _ = found
    muls = (*first.args, *second.args) if isinstance(first, fx.Node) and isinstance(second, fx.Node) else ()
    if not (_call(first, (operator.sub, torch.sub)) and _call(second, _ADD) and len(first.args) == 2
            and len(second.args) == 2 and all(_call(m, _MUL) and len(m.args) == 2 for m in muls)):
        return None
    (a, cos), (b, sin) = first.args[0].args, first.args[1].args
    halves = [a, b]
    if not (isinstance(a, fx.Node) and a.target is operator.getitem and isinstance(b, fx.Node)
            and b.target is operator.getitem and a.args[0] is b.args[0] and (a.args[1], b.args[1]) == (0, 1)):
        return None
    chunk = a.args[0]
    is_chunk = (chunk.op == "call_function" and chunk.target is torch.chunk) or (
        chunk.op == "call_method" and chunk.target == "chunk")
    chunk_dim = chunk.args[2] if len(chunk.args) > 2 else chunk.kwargs.get("dim", 0)
    if not (is_chunk and chunk.args[1] == 2 and chunk_dim == -1 and len(chunk.users) == 2):
        return None
    wanted = {(b, cos), (a, sin)}
    if {tuple(m.args) for m in second.args} != wanted and {tuple(m.args[::-1]) for m in second.args} != wanted:
        return None
    return chunk.args[0], cos, sin, [cat, first, second, *first.args, *second.args, *halves, chunk]


def _match(arg: Any, head_size: int) -> tuple[fx.Node, list[fx.Node], fx.Node, fx.Node, list[fx.Node], bool] | None:
    """(unrotated x, the view chain to replay on it, cos, sin, rotation nodes, whether cos / sin
    hold half rows) for an op argument, in any of the three forms above."""
    found = _view_chain(arg)
    if found is None:
        return None
    end, chain = found
    rot = _rotation(end) or _pass_through(end)
    half = rot is None
    rot = rot or _halves(end)
    if rot is None:
        return None
    x, cos, sin, nodes = rot
    ex, ec, es = _example(x), _example(cos), _example(sin)
    if ex is None or ec is None or es is None or ex.shape[-1] != head_size:
        return None
    width = head_size // 2 if half else head_size
    if not (_token_rows(ex, ec, width) and _token_rows(ex, es, width)):
        return None
    return x, chain, cos, sin, nodes, half


def _method(graph: fx.Graph, src: fx.Node, name: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
            like: fx.Node | None = None) -> fx.Node:
    """``src.<name>(*args, **kwargs)`` (a method name) or ``name(src, *args, **kwargs)`` (a function)
    as a node, with its example value (fake) where it can be computed."""
    if isinstance(name, str):
        node = graph.call_method(name, (src, *args), kwargs)
    else:
        node = graph.call_function(name, (src, *args), kwargs)
    if like is not None:
        node.meta.update({k: v for k, v in like.meta.items() if k != "example_value"})
    ex = _example(src)
    if ex is not None:
        try:
            fn = getattr(ex, name) if isinstance(name, str) else (lambda *a, **k: name(ex, *a, **k))
            node.meta["example_value"] = fn(*args, **kwargs)
        except Exception:  # best effort: the split and the piece compiles trace their own values
            pass
    return node


def _replay(graph: fx.Graph, chain: list[fx.Node], src: fx.Node) -> fx.Node:
    """``chain``'s views applied to ``src`` (``view`` as ``reshape``: ``src`` may not be contiguous)."""
    cur = src
    for n in chain:
        if n.op == "call_method":
            cur = _method(graph, cur, "reshape" if n.target == "view" else n.target, n.args[1:], dict(n.kwargs), n)
        else:  # an integer index
            cur = _method(graph, cur, n.target, n.args[1:], dict(n.kwargs), n)
    return cur


def _erase_unused(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase those of ``nodes`` left without users, and then those that leaves without users."""
    pending = list(dict.fromkeys(nodes))
    while dead := [n for n in pending if not n.users]:
        for n in dead:
            graph.erase_node(n)
            pending.remove(n)


def _full_rows(graph: fx.Graph, half: fx.Node, head_size: int, memo: dict[fx.Node, fx.Node]) -> fx.Node:
    """(T, D) rows ``cat((c, c), -1)`` of half rows ``half`` ((..., D/2), an unsqueeze of the
    model's rows or those rows): built once per source, right after it, so every layer's
    attention shares one tensor (no kernel a layer)."""
    src = half.args[0] if half.op == "call_method" and half.target == "unsqueeze" else half
    if src not in memo:
        with graph.inserting_after(src):
            cat = graph.call_function(torch.cat, ((src, src), -1))
            ex = _example(src)
            if ex is not None:
                try:
                    cat.meta["example_value"] = torch.cat((ex, ex), -1)
                except Exception:  # best effort, as in _method
                    pass
        with graph.inserting_after(cat):
            memo[src] = _method(graph, cat, "reshape", (-1, head_size), {})
    return memo[src]


def fuse_rope(gm: fx.GraphModule, layers: dict[str, Any], mode: bool | None = None) -> int:
    """Hand the RoPE of q and k to each vattn attention op of ``gm`` that takes it (see the module
    docstring); ``layers``: layer name -> ``vattn.Attention`` (the config's ``static_forward_context``).
    Returns the number of attention ops rewritten."""
    if mode is False:
        return 0
    graph = gm.graph
    count = 0
    full_rows: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or _op_name(node.target) not in _ATTENTION_OPS:
            continue
        if _arg(node, "rope_cos") is not None:
            continue
        layer = layers.get(_arg(node, "layer_name"))
        impl = getattr(layer, "impl", None)
        if impl is None or getattr(layer, "query_quant", None) is not None:
            continue
        if mode is None and not getattr(impl, "fuses_rope", False):
            continue
        q = _match(_arg(node, "query"), layer.head_size)
        k = _match(_arg(node, "key"), layer.head_size)
        if q is None or k is None or q[2] is not k[2] or q[3] is not k[3] or q[5] != k[5]:
            continue
        (qx, q_chain, cos, sin, q_nodes, half), (kx, k_chain, _, _, k_nodes, _) = q, k
        head_size = layer.head_size
        with graph.inserting_before(node):
            new_q = _replay(graph, q_chain, qx)
            new_k = _replay(graph, k_chain, kx)
        if half:
            rows_cos, rows_sin = (_full_rows(graph, t, head_size, full_rows) for t in (cos, sin))
        else:
            with graph.inserting_before(node):
                rows_cos = _method(graph, cos, "reshape", (-1, head_size), {})
                rows_sin = _method(graph, sin, "reshape", (-1, head_size), {})
        old = (_arg(node, "query"), _arg(node, "key"))
        node.args = tuple(new_q if a is old[0] else new_k if a is old[1] else a for a in node.args)
        node.kwargs = {**{k_: (new_q if v is old[0] else new_k if v is old[1] else v) for k_, v in node.kwargs.items()},
                       "rope_cos": rows_cos, "rope_sin": rows_sin}
        _erase_unused(graph, [*reversed(q_chain), *reversed(k_chain), *q_nodes, *k_nodes])
        count += 1
    if count:
        graph.lint()
        gm.recompile()
        logger.debug("vattn.compile: RoPE handed to %d attention ops", count)
    return count
