"""Query-quant fusion: no standalone fp8 quant kernel for q in the compiled graph.

With an fp8 KV cache the layer quantizes q with the opaque ``vattn::static_scaled_fp8_quant``
op (one Triton kernel in eager). Inside a compiled graph that op is a separate launch and a
round trip of q through memory. This pass matches it on the post-grad graph, in its
functionalized form::

    empty = aten.empty.memory_format([T, H*D], dtype=fp8)
    af = auto_functionalized_v2(vattn.static_scaled_fp8_quant, x=q, scale=s, _all_bases=[empty])
    q8 = af[1]                                  # -> views -> attention(query=...) or graph output

or, after ``defunctionalize``, as a direct call ``static_scaled_fp8_quant(out=empty, x=q, scale=s)``,
when the quantized tensor reaches (through view ops) the ``query`` of a vattn attention op in
the same graph, or a graph output (under ``vattn.compile``'s split the attention op is the next
split item, so a piece hands q to it through an output; option ``match_graph_outputs``).
It then either

* **decomposes** it into plain ATen ops ``convert(f32) -> div(scale) -> clamp_min -> clamp_max
  -> convert(fp8)`` (``quantize_fp8_native``, bitwise the same values), which Inductor fuses
  into the kernel producing q (RoPE, the QKV split): q is written once, already in fp8; or
* **folds** it into the attention op, for layers whose backend is named in the option
  ``fold_backends`` (backends whose kernel takes the model-dtype query with an fp8 KV cache,
  e.g. ``TRITON_ATTN``, which then attends in bf16 over the dequantized cache): the attention
  reads the unquantized q and the quantization disappears (more precise, not bitwise equal
  to eager). Other consumers of the quantized q still get the decomposition.

``apply`` returns the number of quant ops rewritten; ``folded`` counts the attention ops
that now read the unquantized q. The helpers below (view chains, fake values, the native
quant in ATen) are shared with ``fusion_attn_quant``.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.fx as fx

from vattn.compile_passes.pass_manager import VattnPass, register_pass
from vattn.core.config import VattnConfig, get_current_vattn_config

__all__ = ["QueryQuantFusionPass"]

aten = torch.ops.aten
prims = torch.ops.prims
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_EMPTY = (aten.empty.memory_format, aten.empty_strided.default)


def quant_op() -> torch._ops.OpOverload:
    import vattn.ops.quant_fp8  # noqa: F401  (registers the op)

    return torch.ops.vattn.static_scaled_fp8_quant.default


def attention_ops() -> tuple[torch._ops.OpOverload, ...]:
    return (torch.ops.vattn.unified_attention_with_output.default, torch.ops.vattn.unified_attention.default)


def _af_v2() -> Any:
    from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

    return auto_functionalized_v2


# ---- shared graph helpers --------------------------------------------------------------


def val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def is_view(n: fx.Node) -> bool:
    t = n.target
    return n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.is_view and bool(n.args)


def single_view_chain(start: fx.Node) -> tuple[list[fx.Node], fx.Node]:
    """Follow ``start``'s single user while it is a view of it: (the views, the last node)."""
    chain, cur = [], start
    while len(cur.users) == 1:
        (u,) = cur.users
        if not (is_view(u) and u.args[0] is cur):
            break
        chain.append(u)
        cur = u
    return chain, cur


def replay(graph: fx.Graph, chain: Iterable[fx.Node], src: fx.Node) -> fx.Node:
    """Apply the view ops of ``chain`` to ``src`` (same extra arguments); returns the last node."""
    cur = src
    for n in chain:
        cur = call(graph, n.target, (cur, *n.args[1:]), dict(n.kwargs))
    return cur


def _fake_mode(graph: fx.Graph) -> Any:
    from torch._guards import detect_fake_mode

    vals = [val(n) for n in graph.nodes if n.op == "placeholder"]
    return detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])


def call(graph: fx.Graph, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> fx.Node:
    """``graph.call_function`` at the current insert point, with ``meta["val"]`` computed in fake mode."""
    node = graph.call_function(target, args, kwargs or {})
    mode = _fake_mode(graph)
    if mode is None or not isinstance(target, torch._ops.OpOverload):
        return node
    fargs, fkwargs = fx.node.map_arg((args, kwargs or {}), val)
    try:
        with mode:
            node.meta["val"] = target(*fargs, **fkwargs)
    except Exception:  # meta is best effort; Inductor recomputes what it needs
        pass
    return node


def arg(node: fx.Node, name: str) -> Any:
    """Argument ``name`` of a call to a vattn op (direct call: kwarg or positional; HOP: kwarg)."""
    if name in node.kwargs:
        return node.kwargs[name]
    op = node.target
    if isinstance(op, torch._ops.OpOverload):
        for i, a in enumerate(op._schema.arguments):
            if a.name == name:
                return node.args[i] if i < len(node.args) else a.default_value
    return None


def set_arg(node: fx.Node, name: str, value: Any) -> None:
    op = node.target
    if name not in node.kwargs and isinstance(op, torch._ops.OpOverload):
        for i, a in enumerate(op._schema.arguments):
            if a.name == name and i < len(node.args):
                node.update_arg(i, value)
                return
    node.update_kwarg(name, value)


@dataclass
class MutCall:
    """A call of a mutating vattn op with one mutated argument whose base is a fresh ``empty``.

    ``node`` is the ``auto_functionalized_v2`` node or the direct call; ``base`` the ``empty``;
    ``results`` the nodes reading the mutated value afterwards (``af[k]``, or the base itself
    for the users of a direct call's base that come after it).
    """

    node: fx.Node
    op: torch._ops.OpOverload
    mutated: str
    base: fx.Node
    results: list[fx.Node]
    functional: bool

    def get(self, name: str) -> Any:
        return self.node.kwargs.get(name) if self.functional else arg(self.node, name)


def parse_mut_call(node: fx.Node, ops: tuple[Any, ...], mutated: str, order: dict[fx.Node, int]) -> MutCall | None:
    """``node`` as a ``MutCall`` of one of ``ops`` whose ``mutated`` arg is a whole fresh ``empty``."""
    if node.op != "call_function":
        return None
    if node.target is _af_v2() and node.args and node.args[0] in ops:
        kw = node.kwargs
        bases = list(kw.get("_all_bases", []))
        idx = kw.get(f"_{mutated}_base_index")
        if len(bases) != 1 or idx != 0 or kw.get("_only_clone_these_bases") is not None:
            return None
        base = bases[0]
        if not _is_fresh_empty(base, {node}):
            return None
        results = [u for u in node.users if u.target is operator.getitem and u.args[1] == _num_outputs(node)]
        if len(results) != len(node.users):
            return None
        return MutCall(node, node.args[0], mutated, base, results, functional=True)
    if node.target in ops:
        out = arg(node, mutated)
        if not isinstance(out, fx.Node):
            return None
        base, pre = out, []
        while is_view(base):
            pre.append(base)
            base = base.args[0]
        if not _is_fresh_empty(base, {node, *pre}, allow_later=order, after=node):
            return None
        results = [base] if any(order.get(u, -1) > order[node] for u in base.users) else []
        return MutCall(node, node.target, mutated, base, results, functional=False)
    return None


def _num_outputs(af: fx.Node) -> int:
    """Index of the first "new base" output of an ``auto_functionalized_v2`` node."""
    v = af.meta.get("val")
    if isinstance(v, (tuple, list)):
        return len(v) - len(af.kwargs.get("_all_bases", []))
    return max(len(af.args[0]._schema.returns), 1)


def _is_fresh_empty(base: Any, allowed: set[fx.Node], allow_later: dict[fx.Node, int] | None = None,
                    after: fx.Node | None = None) -> bool:
    """``base`` is an ``empty`` read before ``after`` only by ``allowed`` (its views included)."""
    if not (isinstance(base, fx.Node) and base.op == "call_function" and base.target in _EMPTY):
        return False
    for u in base.users:
        if u in allowed:
            continue
        if allow_later is not None and after is not None and allow_later.get(u, -1) > allow_later[after]:
            continue
        return False
    return True


def layers_digest(config: VattnConfig | None, facts: Any) -> str:
    """A hash of ``facts(layer)`` for every registered layer: part of a pass's ``uuid()`` when its
    decisions depend on the layers' backends (a cached graph must not be reused for others)."""
    cfg = config if config is not None else get_current_vattn_config()
    from vattn.mixers.base import MambaBase

    items = sorted((name, repr(facts(layer))) for name, layer in cfg.compilation.static_forward_context.items()
                   if not isinstance(layer, MambaBase))  # mixers run no attention to fuse into
    return hashlib.sha256(repr(items).encode()).hexdigest()


def layer_backend(config: VattnConfig | None, layer_name: Any) -> Any:
    """The ``vattn.Attention`` registered as ``layer_name`` in the config's static forward context."""
    cfg = config if config is not None else get_current_vattn_config()
    return cfg.compilation.static_forward_context.get(layer_name) if isinstance(layer_name, str) else None


def emit_native_quant(graph: fx.Graph, x: fx.Node, scale: Any, dtype: torch.dtype) -> fx.Node | None:
    """``quantize_fp8_native(x, scale, dtype)`` as post-grad ATen nodes; None if shapes are unsupported."""
    xv, sv = val(x), val(scale)
    if not isinstance(xv, torch.Tensor) or not isinstance(sv, torch.Tensor):
        return None
    finfo = torch.finfo(dtype)
    xf = x if xv.dtype == torch.float32 else call(graph, prims.convert_element_type.default, (x, torch.float32))
    s = scale if sv.dtype == torch.float32 else call(graph, prims.convert_element_type.default, (scale, torch.float32))
    groups = sv.numel()
    if groups == 1:
        y = call(graph, aten.div.Tensor, (xf, s))
    else:
        tail = list(xv.shape[1:])
        if xv.dim() < 2 or not all(isinstance(d, int) for d in tail):
            return None
        per_row = 1
        for d in tail:
            per_row *= d
        if per_row % groups:
            return None
        x3 = call(graph, aten.reshape.default, (xf, [-1, groups, per_row // groups]))
        s3 = call(graph, aten.reshape.default, (s, [1, groups, 1]))
        y = call(graph, aten.reshape.default, (call(graph, aten.div.Tensor, (x3, s3)), [-1, *tail]))
    y = call(graph, aten.clamp_min.default, (y, finfo.min))
    y = call(graph, aten.clamp_max.default, (y, finfo.max))
    return call(graph, prims.convert_element_type.default, (y, dtype))


# ---- the pass ----------------------------------------------------------------------------


@register_pass
class QueryQuantFusionPass(VattnPass):
    """See the module docstring.

    Options: ``match_graph_outputs`` (default True: also rewrite a quantized q that leaves the
    graph, i.e. goes to the attention op of the next split item), ``fold_backends`` (default
    empty: backend names whose layers read the unquantized q instead).
    """

    name = "query_quant_fusion"

    def __init__(self, config: VattnConfig | None = None, **options: Any) -> None:
        options.setdefault("match_graph_outputs", True)
        options["fold_backends"] = sorted(options.get("fold_backends", ()))
        super().__init__(config, **options)
        self.folded = 0

    def uuid(self) -> str:
        """The source/options hash, plus each layer's backend when folding depends on it."""
        base = super().uuid()
        if not self.options["fold_backends"]:
            return base
        digest = layers_digest(self.config, lambda layer: layer.attn_backend.get_name())
        return hashlib.sha256(f"{base}|{digest}".encode()).hexdigest()

    def apply(self, graph: fx.Graph) -> int:
        order = {n: i for i, n in enumerate(graph.nodes)}
        qop, count = quant_op(), 0
        for node in list(graph.nodes):
            mc = parse_mut_call(node, (qop,), "out", order)
            if mc is None or not _whole_base(mc):
                continue
            readers = [(r, u) for r in mc.results for u in r.users
                       if mc.functional or order.get(u, -1) > order[mc.node]]
            targets = self._consumers(readers)
            if targets is None:
                continue
            self._rewrite(graph, mc, targets, order)
            count += 1
        return count

    def _consumers(self, readers: list[tuple[fx.Node, fx.Node]]) -> list[tuple[list[fx.Node], fx.Node]] | None:
        """(view chain from the quantized q, attention node) per attention reading it; None: no match."""
        found: list[tuple[list[fx.Node], fx.Node]] = []
        leaves = 0
        for src, user in readers:
            chain: list[fx.Node] = []
            if is_view(user) and user.args[0] is src:
                more, _ = single_view_chain(user)
                chain = [user, *more]
            end = chain[-1] if chain else src
            for c in (end.users if chain else [user]):
                if c.op == "output":
                    leaves += bool(self.options["match_graph_outputs"])
                elif self._is_attention_query(c, end):
                    found.append((chain, c))
        return found if found or leaves else None

    @staticmethod
    def _is_attention_query(node: fx.Node, q: fx.Node) -> bool:
        ops = attention_ops()
        if node.op != "call_function":
            return False
        if node.target is _af_v2() and node.args and node.args[0] in ops:
            return node.kwargs.get("query") is q
        return node.target in ops and arg(node, "query") is q

    def _rewrite(self, graph: fx.Graph, mc: MutCall, targets: list[tuple[list[fx.Node], fx.Node]],
                 order: dict[fx.Node, int]) -> None:
        x, scale = mc.get("x"), mc.get("scale")
        dtype = val(mc.base).dtype
        fold = set(self.options["fold_backends"])
        for chain, attn in targets:
            functional = attn.target is _af_v2()
            layer = layer_backend(self.config, attn.kwargs.get("layer_name") if functional
                                  else arg(attn, "layer_name"))
            if layer is None or layer.attn_backend.get_name() not in fold:
                continue
            with graph.inserting_before(attn):
                q = replay(graph, chain, x)
            if functional:
                attn.update_kwarg("query", q)
            else:
                set_arg(attn, "query", q)
            self.folded += 1
        with graph.inserting_before(mc.node):
            q8 = emit_native_quant(graph, x, scale, dtype)
        assert q8 is not None, "per-tensor / per-head scales always decompose"
        for r in mc.results:
            if mc.functional:
                r.replace_all_uses_with(q8)
                graph.erase_node(r)
            else:
                r.replace_all_uses_with(q8, delete_user_cb=lambda u: order.get(u, -1) > order[mc.node])
        graph.erase_node(mc.node)
        for chain, _ in targets:  # views of q8 that only fed folded attention ops
            for n in reversed(chain):
                if not n.users:
                    graph.erase_node(n)
        erase_if_dead(graph, q8)
        erase_if_dead(graph, mc.base)


def _whole_base(mc: MutCall) -> bool:
    """The quant writes its whole ``out`` buffer (not a view of a larger one)."""
    if mc.functional:
        return not any(k in mc.node.kwargs for k in ("_out_size", "_out_slice_dim"))
    return arg(mc.node, "out") is mc.base


def erase_if_dead(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and then its inputs while they have no users (pure ATen nodes only)."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n.users or n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        if n.target._schema.is_mutable:
            continue
        inputs = [a for a in n.all_input_nodes]
        graph.erase_node(n)
        todo += inputs
