"""Defunctionalization: turn ``auto_functionalized`` vattn ops back into in-place calls.

AOTAutograd functionalizes mutating custom ops: ``vattn::reshape_and_cache_flash(..,
key_cache!, value_cache!, ..)`` becomes ``auto_functionalized_v2(op, _all_bases=[kv], ..)``
whose decomposition clones the mutated bases, runs the op on the clones and copies the
result back (``copy_``) where the base is a graph input. For an attention output or a KV
cache that is a pointless copy per layer and step. This pass replaces each such node by
a direct call on the real tensors:

* the mutated arguments are regenerated from their bases (the base itself, or an
  ``as_strided`` / ``slice`` view of it, as the HOP's view information says);
* every use of the HOP's "new base" outputs is pointed at the base itself;
* the now self-referential ``copy_(base, base)`` epilogues are removed.

Only ops in the ``vattn`` namespace (option ``namespaces``) are rewritten, and only when no
later node still reads a mutated base's old value (then in-placing would change results;
the node is left to Inductor's own reinplacing). ``apply`` returns the number of ops
rewritten; ``removed_copies`` counts the ``copy_`` epilogues dropped.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch._higher_order_ops.auto_functionalize import (
    AliasViewInfo,
    AsStridedViewInfo,
    NotView,
    SliceViewInfo,
    auto_functionalized,
    auto_functionalized_v2,
    get_mutable_args,
    read_view_information_from_args,
)

from vattn.compile_passes.pass_manager import VattnPass, register_pass

__all__ = ["DefunctionalizePass"]

aten = torch.ops.aten


def _aliases(base: fx.Node) -> set[fx.Node]:
    """``base`` and every node that is a view of it (transitively)."""
    out, todo = {base}, [base]
    while todo:
        n = todo.pop()
        for u in n.users:
            t = u.target
            is_view = isinstance(t, torch._ops.OpOverload) and t.is_view
            if (is_view or t is operator.getitem) and u.args and u.args[0] is n and u not in out:
                out.add(u)
                todo.append(u)
    return out


@register_pass
class DefunctionalizePass(VattnPass):
    """See the module docstring. Options: ``namespaces`` (default ``("vattn",)``)."""

    name = "defunctionalize"

    def __init__(self, config: Any = None, **options: Any) -> None:
        options.setdefault("namespaces", ["vattn"])
        super().__init__(config, **options)
        self.removed_copies = 0

    def apply(self, graph: fx.Graph) -> int:
        order = {n: i for i, n in enumerate(graph.nodes)}
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (auto_functionalized, auto_functionalized_v2):
                continue
            op = node.args[0]
            if not isinstance(op, torch._ops.OpOverload) or op.namespace not in self.options["namespaces"]:
                continue
            if self._rewrite(graph, node, op, order):
                count += 1
        self.removed_copies += self._drop_self_copies(graph)
        return count

    def _rewrite(self, graph: fx.Graph, node: fx.Node, op: torch._ops.OpOverload, order: dict[fx.Node, int]) -> bool:
        names, types = get_mutable_args(op)
        kwargs = dict(node.kwargs)
        if node.target is auto_functionalized_v2:
            if kwargs.pop("_only_clone_these_bases", None) is not None:
                return False  # already handled by a reinplacing pass
            bases: list[fx.Node] = list(kwargs.pop("_all_bases", []))
            views = read_view_information_from_args(names, types, kwargs, bases)
            if any(isinstance(v, list) for v in views.values()):
                return False  # tensor-list mutable args: left to Inductor
        else:
            bases = [kwargs[n] for n in names]
            views = {n: NotView(i) for i, n in enumerate(names)}
        if not all(isinstance(b, fx.Node) for b in bases):
            return False
        # In-place is only safe when nothing after this node reads a base's old value.
        for base in bases:
            for alias in _aliases(base):
                for user in alias.users:
                    if user is not node and order.get(user, -1) > order[node] and not self._reads_new(user, node):
                        return False

        known = (NotView, AliasViewInfo, AsStridedViewInfo, SliceViewInfo)
        if any(v is not None and not isinstance(v, known) for v in views.values()):
            return False
        if any(u.target is not operator.getitem for u in node.users):
            return False

        with graph.inserting_before(node):
            for name in names:
                info = views[name]
                base = bases[info.base_index] if info is not None else None
                if info is None:
                    kwargs[name] = None
                elif isinstance(info, (NotView, AliasViewInfo)):
                    kwargs[name] = base
                elif isinstance(info, AsStridedViewInfo):
                    kwargs[name] = graph.call_function(
                        aten.as_strided.default, (base, info.size, info.stride, info.storage_offset)
                    )
                else:
                    kwargs[name] = graph.call_function(aten.slice.Tensor, (base, info.dim, info.start, info.end))
            call = graph.call_function(op, kwargs=kwargs)
        n_out = self._num_outputs(node, len(bases))
        for user in list(node.users):
            i = user.args[1]
            if i >= n_out:
                user.replace_all_uses_with(bases[i - n_out])
            elif n_out == 1 and len(op._schema.returns) == 1:
                user.replace_all_uses_with(call)
            else:
                with graph.inserting_after(call):
                    user.replace_all_uses_with(graph.call_function(operator.getitem, (call, i)))
            graph.erase_node(user)
        graph.erase_node(node)
        return True

    @staticmethod
    def _reads_new(user: fx.Node, node: fx.Node) -> bool:
        # copy_(base, getitem(node, k)) is the write-back epilogue: it becomes a self copy.
        return user.target == aten.copy_.default and any(
            isinstance(a, fx.Node) and a.target is operator.getitem and a.args[0] is node for a in user.args[1:]
        )

    @staticmethod
    def _num_outputs(node: fx.Node, num_bases: int) -> int:
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            return len(val) - num_bases
        returns = len(node.args[0]._schema.returns)
        return max(returns, 1) if node.target is auto_functionalized_v2 else returns

    @staticmethod
    def _drop_self_copies(graph: fx.Graph) -> int:
        n = 0
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target == aten.copy_.default and node.args[0] is node.args[1]:
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                n += 1
        return n
