"""Attention + output-quant fusion: the attention kernel writes fp8 output itself.

When the attention output is only consumed by a static per-tensor fp8 quantization (for an
fp8 ``o_proj``, say), the bf16 output makes a pointless round trip through memory and the
quantization costs a kernel. This pass matches, on the post-grad graph::

    empty = aten.empty.memory_format([T, H*D], dtype=bf16)
    af = auto_functionalized_v2(vattn.unified_attention_with_output, query=q, ..., layer_name="...",
                                output_scale=None, _all_bases=[empty], ...)
    o = af[1]                                    # (-> single-user views)
    # the QuantFP8 pattern as Inductor sees it post-grad:
    o8 = convert(clamp_max(clamp_min(div(convert(o, f32), s), -M), M), fp8)
    # or the opaque op: auto_functionalized_v2(vattn.static_scaled_fp8_quant, x=o, scale=s, ...)

(or the attention / quant as direct calls, after ``defunctionalize``) and replaces it with one
direct call writing an fp8 buffer::

    empty8 = aten.empty.memory_format([T, H*D], dtype=fp8)
    vattn.unified_attention_with_output(query=q, ..., output=view(empty8), output_scale=s)
    o8 = empty8 (-> the same views)

Conditions: ``s`` is a per-tensor (one-element) scale defined before the attention op; every
intermediate value has that single use; ``M`` is the fp8 dtype's max; and the layer named by
the op's ``layer_name`` (looked up in the config's ``static_forward_context``) has a backend
with ``supports_output_quant`` whose impl says ``fused_output_quant_supported(QuantKey(fp8))``
(TRITON_ATTN). The attention op must sit inside the Inductor graph: with ``vattn.compile``
that means ``CompilationConfig(splitting_ops=())``; in the default piecewise split the
attention op is a separate split item and this pass finds nothing to fuse.

``apply`` returns the number of attention ops fused.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._higher_order_ops.auto_functionalize import (
    AliasViewInfo,
    AsStridedViewInfo,
    NotView,
    SliceViewInfo,
    get_mutable_args,
    read_view_information_from_args,
)

from vattn.compile_passes.fusion_query_quant import (
    MutCall,
    arg,
    call,
    erase_if_dead,
    is_view,
    layer_backend,
    layers_digest,
    parse_mut_call,
    quant_op,
    replay,
    single_view_chain,
    val,
)
from vattn.compile_passes.pass_manager import VattnPass, register_pass
from vattn.ops.quant_fp8 import FP8_DTYPES, QuantKey

__all__ = ["AttnQuantFusionPass"]

logger = logging.getLogger("vattn.compile")

aten = torch.ops.aten
prims = torch.ops.prims


def _single_user(n: fx.Node) -> fx.Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


def _is_call(n: Any, *targets: Any) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _per_tensor_scale(s: Any) -> bool:
    v = val(s)
    return isinstance(s, fx.Node) and isinstance(v, torch.Tensor) and v.numel() == 1 and v.is_floating_point()


@dataclass
class _Quant:
    """A matched quantization: its scale, fp8 dtype, its nodes (in order), the node holding the
    fp8 result (native pattern), or the opaque op's call (``opaque``)."""

    scale: fx.Node
    dtype: torch.dtype
    nodes: list[fx.Node]
    result: fx.Node
    opaque: MutCall | None = None


def match_native_quant(x: fx.Node, n: fx.Node | None) -> _Quant | None:
    """``convert(clamp(div([convert(x, f32)], s), -M, M), fp8)``; ``n`` is x's (only) reader."""
    nodes: list[fx.Node] = []
    if _is_call(n, prims.convert_element_type.default) and n.args[1] == torch.float32:
        nodes.append(n)
        cur: fx.Node = n
        n = _single_user(n)
    else:
        cur = x
        if not isinstance(val(x), torch.Tensor) or val(x).dtype != torch.float32:
            return None
    if not (_is_call(n, aten.div.Tensor) and n.args[0] is cur and _per_tensor_scale(n.args[1])):
        return None
    scale = n.args[1]
    nodes.append(n)
    bounds: dict[str, float] = {}
    n = _single_user(n)
    while _is_call(n, aten.clamp_min.default, aten.clamp_max.default, aten.clamp.default) and len(nodes) < 5:
        if n.target is aten.clamp.default:
            bounds["min"], bounds["max"] = n.args[1], n.args[2]
        else:
            bounds["min" if n.target is aten.clamp_min.default else "max"] = n.args[1]
        nodes.append(n)
        n = _single_user(n)
    if not (_is_call(n, prims.convert_element_type.default) and n.args[1] in FP8_DTYPES):
        return None
    dtype = n.args[1]
    fmax = torch.finfo(dtype).max
    if bounds.get("min") != -fmax or bounds.get("max") != fmax:
        return None
    nodes.append(n)
    return _Quant(scale, dtype, nodes, n)


def match_opaque_quant(x: fx.Node, user: fx.Node | None, order: dict[fx.Node, int]) -> _Quant | None:
    """``vattn::static_scaled_fp8_quant`` (functional or direct; ``user``) of ``x`` into a whole fresh buffer."""
    if user is None:
        return None
    mc = parse_mut_call(user, (quant_op(),), "out", order)
    if mc is None or mc.get("x") is not x or not _per_tensor_scale(mc.get("scale")):
        return None
    if mc.functional and any(k in user.kwargs for k in ("_out_size", "_out_slice_dim")):
        return None
    if not mc.functional and arg(user, "out") is not mc.base:
        return None
    return _Quant(mc.get("scale"), val(mc.base).dtype, [user], user, opaque=mc)


@register_pass
class AttnQuantFusionPass(VattnPass):
    """See the module docstring. No options."""

    name = "attn_quant_fusion"

    def uuid(self) -> str:
        """The source/options hash plus what every layer's backend supports (fusion depends on it)."""
        def facts(layer: Any) -> tuple[Any, ...]:
            supported = [bool(layer.impl.fused_output_quant_supported(QuantKey(d))) for d in FP8_DTYPES]
            return (layer.attn_backend.get_name(), bool(layer.attn_backend.supports_output_quant), *supported)

        return hashlib.sha256(f"{super().uuid()}|{layers_digest(self.config, facts)}".encode()).hexdigest()

    def apply(self, graph: fx.Graph) -> int:
        order = {n: i for i, n in enumerate(graph.nodes)}
        op = torch.ops.vattn.unified_attention_with_output.default
        count = 0
        for node in list(graph.nodes):
            mc = parse_mut_call(node, (op,), "output", order)
            if mc is None or mc.get("output_scale") is not None:
                continue
            post = self._post_chain(mc, order)
            if post is None:
                continue
            chain, value, first = post
            quant = match_native_quant(value, first) or match_opaque_quant(value, first, order)
            if quant is None or order.get(quant.scale, -1) > order[mc.node]:
                continue
            if not self._layer_supports(mc.get("layer_name"), quant.dtype):
                continue
            count += self._rewrite(graph, mc, chain, quant, order)
        return count

    @staticmethod
    def _post_chain(mc: MutCall, order: dict[fx.Node, int]) -> tuple[list[fx.Node], fx.Node, fx.Node | None] | None:
        """(single-use views from the attention result, the value they end in, its one reader)."""
        if mc.functional:
            if len(mc.results) != 1:
                return None
            chain, end = single_view_chain(mc.results[0])
            return chain, end, _single_user(end)
        later = [u for u in mc.base.users if order.get(u, -1) > order[mc.node]]
        if len(later) != 1:
            return None
        (u,) = later
        if not (is_view(u) and u.args[0] is mc.base):
            return [], mc.base, u
        more, end = single_view_chain(u)
        return [u, *more], end, _single_user(end)

    def _layer_supports(self, layer_name: Any, dtype: torch.dtype) -> bool:
        layer = layer_backend(self.config, layer_name)
        if layer is None:
            logger.debug("attn_quant_fusion: layer %r not in the static forward context", layer_name)
            return False
        return bool(layer.attn_backend.supports_output_quant) and bool(
            layer.impl.fused_output_quant_supported(QuantKey(dtype))
        )

    def _rewrite(self, graph: fx.Graph, mc: MutCall, chain: list[fx.Node], quant: _Quant,
                 order: dict[fx.Node, int]) -> bool:
        op = mc.op
        base = mc.base
        with graph.inserting_before(mc.node):
            base8 = call(graph, base.target, base.args, {**base.kwargs, "dtype": quant.dtype})
            out8 = self._output_arg(graph, mc, base8)
            if out8 is None:  # an output view the HOP describes in a way we do not rebuild
                graph.erase_node(base8)
                return False
            kwargs = {a.name: mc.get(a.name) for a in op._schema.arguments}
            kwargs.update(output=out8, output_scale=quant.scale)
            fused = call(graph, op, (), kwargs)
        with graph.inserting_before(fused.next):
            result = replay(graph, chain, base8)
        # Uses of the quantized tensor now read the fused fp8 output.
        if quant.opaque is None:
            quant.result.replace_all_uses_with(result)
        else:
            q = quant.opaque
            for r in q.results:
                r.replace_all_uses_with(
                    result, delete_user_cb=lambda u, q=q: q.functional or order.get(u, -1) > order[q.node])
        dead = [*quant.nodes[::-1]]
        if quant.opaque is not None and quant.opaque.functional:
            dead = [*quant.opaque.results, *dead]
        dead += chain[::-1]
        dead += mc.results if mc.functional else []
        dead.append(mc.node)
        for n in dead:
            if not n.users:
                graph.erase_node(n)
        if quant.opaque is not None:
            erase_if_dead(graph, quant.opaque.base)
        _erase_views_and_base(graph, base)
        return True

    @staticmethod
    def _output_arg(graph: fx.Graph, mc: MutCall, base8: fx.Node) -> fx.Node | None:
        """The ``output`` argument rebuilt on the fp8 base (same view of it)."""
        if not mc.functional:
            out, pre = arg(mc.node, "output"), []
            while out is not mc.base:
                pre.append(out)
                out = out.args[0]
            return replay(graph, pre[::-1], base8)
        names, types = get_mutable_args(mc.op)
        views = read_view_information_from_args(names, types, dict(mc.node.kwargs), [mc.base])
        info = views.get("output")
        if isinstance(info, (NotView, AliasViewInfo)):
            return base8
        if isinstance(info, AsStridedViewInfo):
            return call(graph, aten.as_strided.default, (base8, info.size, info.stride, info.storage_offset))
        if isinstance(info, SliceViewInfo):
            return call(graph, aten.slice.Tensor, (base8, info.dim, info.start, info.end))
        return None


def _erase_views_and_base(graph: fx.Graph, base: fx.Node) -> None:
    """Erase the old output buffer and its views once nothing reads them."""
    for u in list(base.users):
        if is_view(u) and not u.users:
            graph.erase_node(u)
    erase_if_dead(graph, base)
