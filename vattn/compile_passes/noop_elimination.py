"""No-op elimination: drop reshape/view/slice nodes that do nothing, collapse view chains.

Fusion patterns match ``op(x)`` but Dynamo and AOTAutograd leave ``x.view(T, H, D)``,
``.reshape(T, H * D)`` and ``x[:, :]`` around it. This pass, on the post-grad graph:

* replaces ``view``/``reshape``/``_unsafe_view`` whose output shape equals its input's
  by the input;
* turns ``view(view(x, a), b)`` into ``view(x, b)`` when ``x`` is contiguous (so any
  shape with its numel is a valid view), leaving the inner view to dead-code elimination;
* replaces ``slice(x, dim, 0, end)`` with ``end >= x.size(dim)`` and step 1 by ``x``.

Shapes are compared symbolically and only when statically known equal, so the pass never
adds guards. ``apply`` returns the number of nodes changed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from vattn.compile_passes.pass_manager import VattnPass, node_value, register_pass

__all__ = ["NoOpEliminationPass"]

aten = torch.ops.aten
_VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _known_eq(a: Any, b: Any) -> bool:
    return a is b or statically_known_true(a == b)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dim() == b.dim()
        and all(_known_eq(x, y) for x, y in zip(a.shape, b.shape))
        and all(_known_eq(x, y) for x, y in zip(a.stride(), b.stride()))
    )


def _known_contiguous(t: torch.Tensor) -> bool:
    """Row-major contiguous, decided without adding guards (unknown counts as not)."""
    expected: Any = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        if not (_known_eq(size, 1) or _known_eq(stride, expected)):
            return False
        expected = expected * size
    return True


def _is_noop_slice(node: fx.Node) -> bool:
    src = node_value(node.args[0])
    if src is None:
        return False
    dim = node.args[1] if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    if isinstance(end, fx.Node) or isinstance(start, fx.Node) or step != 1 or start not in (0, None):
        return False
    if end is None or (isinstance(end, int) and end >= 2**62):  # x[a:] traces as end = INT64_MAX
        return True
    return statically_known_true(end >= src.shape[dim])


@register_pass
class NoOpEliminationPass(VattnPass):
    """See the module docstring."""

    name = "noop_elimination"

    def apply(self, graph: fx.Graph) -> int:
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in _VIEW_OPS:
                src = node.args[0]
                inner = src.args[0] if isinstance(src, fx.Node) and src.target in _VIEW_OPS else None
                inner_val = node_value(inner)
                if inner_val is not None and _known_contiguous(inner_val):
                    node.update_arg(0, inner)
                    if not src.users:
                        graph.erase_node(src)
                    count += 1
                    src = inner
                a, b = node_value(src), node_value(node)
                if a is not None and b is not None and _same_layout(a, b):
                    node.replace_all_uses_with(src)
                    graph.erase_node(node)
                    count += 1
            elif node.target == aten.slice.Tensor and _is_noop_slice(node):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                count += 1
        return count
