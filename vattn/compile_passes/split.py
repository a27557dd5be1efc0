"""Splitting a Dynamo graph at the attention ops.

Every splitting op (``CompilationConfig.splitting_ops``) sits alone in a submodule of the split
graph; the nodes between two of them form one *piece*, which ``VattnBackend`` compiles.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from vattn.ops.library import python_impl

__all__ = ["SplitItem", "boundary_nodes", "direct_op_call", "is_splitting_node", "split_graph"]


def _op_names(target: Any) -> set[str]:
    """Names a call target answers to: ``"ns::op"`` and ``"ns::op.overload"``."""
    if isinstance(target, torch._ops.OpOverload):
        base = target._schema.name
        return {base, f"{base}.{target._overloadname}"}
    if isinstance(target, torch._ops.OpOverloadPacket):
        return {target._qualified_op_name}
    return set()


def is_splitting_node(node: fx.Node, splitting_ops: Sequence[str]) -> bool:
    return node.op == "call_function" and bool(_op_names(node.target) & set(splitting_ops))


@dataclasses.dataclass
class SplitItem:
    """One submodule of the split graph: a piece, or a lone splitting op."""

    name: str
    index: int
    is_splitting: bool
    graph: fx.GraphModule


def _partition(gm: fx.GraphModule, splitting_ops: Sequence[str]) -> dict[fx.Node, int]:
    """Each node's submodule index: splitting ops alone, the nodes between two of them together."""
    part: dict[fx.Node, int] = {}
    pid = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_splitting_node(node, splitting_ops):
            pid += 1
            part[node] = pid
            pid += 1
        else:
            part[node] = pid
    return part


def boundary_nodes(gm: fx.GraphModule, splitting_ops: Sequence[str]) -> set[fx.Node]:
    """The nodes whose values cross a submodule boundary of ``split_graph``: the inputs, and
    the values a submodule returns (to a later one or as the graph's output)."""
    part = _partition(gm, splitting_ops)
    return {n for n in gm.graph.nodes
            if n.op == "placeholder" or any(u.op == "output" or part.get(u) != part.get(n) for u in n.users)}


def split_graph(gm: fx.GraphModule, splitting_ops: Sequence[str]) -> tuple[fx.GraphModule, list[SplitItem]]:
    """Split ``gm`` so that every splitting op sits alone in a submodule.

    Returns the split module (its ``submod_<i>`` children run in order) and the items in
    execution order. Nodes between two splitting ops form one piece.
    """
    part = _partition(gm, splitting_ops)
    splitting_ids = {part[n] for n in part if is_splitting_node(n, splitting_ops)}
    from torch.fx.passes.split_module import split_module

    split_gm = split_module(gm, None, lambda n: part[n], keep_original_order=True)
    items: list[SplitItem] = []
    for node in split_gm.graph.nodes:
        if node.op != "call_module":
            continue
        index = int(node.target.rsplit("_", 1)[1])
        items.append(SplitItem(node.target, index, index in splitting_ids, getattr(split_gm, node.target)))
    return split_gm, items


def direct_op_call(gm: fx.GraphModule) -> Callable[..., Any] | None:
    """``gm`` (a lone splitting op) as a plain function calling the op's Python implementation
    directly, or None when the op has none (``vattn.ops.library.python_impl``). Skips, per
    attention op and step, ``nn.Module.__call__`` and the dispatcher (host time only)."""
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    impl = python_impl(ops[0].target) if len(ops) == 1 else None
    if impl is None:
        return None
    direct = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    node = next(n for n in direct.graph.nodes if n.op == "call_function")
    node.target = impl
    direct.recompile()
    return direct.forward
