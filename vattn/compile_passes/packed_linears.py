"""Sibling linear layers over one packed weight as one GEMM: ``vattn::packed_linear``.

A ``transformers`` decoder layer projects one input three times (``q_proj``, ``k_proj``,
``v_proj``) and its MLP input twice (``gate_proj``, ``up_proj``): separate GEMMs, a launch
each, the narrow k / v ones far from the GPU's throughput. vLLM's models hold one packed
weight per group instead (``QKVParallelLinear``, ``MergedColumnParallelLinear``).
``pack_linear_weights`` gives a model that layout without changing its code: the modules'
weights become consecutive row blocks of one buffer (``vattn.integrations.transformers.wrap``
calls it). In ``VattnBackend``, ``mark`` first tags, in the whole Dynamo graph,

    q = linear(x, w_q); k = linear(x, w_k); v = linear(x, w_v)      # bias-free

whose weights are consecutive rows of one storage (seen on the capture's inputs; the tags
travel with a trace saved to ``cache_dir``, so a warm start does not depend on how the file
rebuilds its fake tensors). ``rewrite`` then
turns each tagged group of a piece (after ``CompilationConfig.piece_passes``, so that a
1-token rewrite such as ``examples.gemv`` sees the separate linears) into

    qkv = vattn::packed_linear(x, [w_q, w_k, w_v])    # (..., N_q + N_k + N_v)
    q, k, v = narrow(qkv, -1, 0, N_q), narrow(qkv, -1, N_q, N_k), ...

and the ``view`` calls on ``q``, ``k``, ``v`` into ``reshape`` (same values; a column slice
cannot always be viewed). The op checks the packing again on every call: weights are
runtime inputs, and identical pieces of other layers run the same code. Packed, it runs one
``F.linear`` over the storage's ``(sum N, K)`` rows; otherwise each linear and a concatenation
(correct, slower).

Eager (uncompiled) inference gets the one GEMM too: ``pack_linear_weights`` makes the members
``PackedLinear`` (an ``nn.Linear``). Without grad, the first member called with an input runs
the group's GEMM and keeps the other members' column slices for that input, which they return
when called with the same tensor, unchanged since (its version counter); any other call runs
its own ``F.linear``. Model code sees column slices where it saw whole outputs: splitting
their last dimension (``.view(*shape, -1, head_dim)``, as transformers does) still works.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

__all__ = ["MARK", "PackedLinear", "mark", "pack_linear_weights", "packed_rows", "rewrite"]

logger = logging.getLogger("vattn.compile")

_LINEAR = (F.linear, torch._C._nn.linear)


def _storage_key(t: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def packed_rows(weights: Sequence[torch.Tensor]) -> bool:
    """Whether ``weights`` ((N_i, K) each) are consecutive row blocks of one row-major storage:
    one ``(sum N_i, K)`` matrix starting at the first (real or fake tensors; static sizes)."""
    if len(weights) < 2:
        return False
    first = weights[0]
    if first.dim() != 2:
        return False
    k = first.shape[1]
    offset = first.storage_offset()
    if not all(isinstance(v, int) for v in (k, offset)):
        return False
    key = _storage_key(first)
    for w in weights:
        if (w.dim() != 2 or w.dtype != first.dtype or w.device != first.device or w.shape[1] != k
                or not isinstance(w.shape[0], int) or w.stride() != (k, 1) or w.storage_offset() != offset
                or _storage_key(w) != key):
            return False
        offset += w.shape[0] * k
    return offset * first.element_size() <= first.untyped_storage().nbytes()


@torch.library.custom_op("vattn::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """``cat([F.linear(x, w) for w in weights], -1)``: (..., K) by (N_i, K) each -> (..., sum N_i);
    one GEMM where ``packed_rows(weights)``."""
    if packed_rows(weights):
        first = weights[0]
        k = first.shape[1]
        return F.linear(x, first.as_strided((sum(w.shape[0] for w in weights), k), (k, 1)))
    return torch.cat([F.linear(x, w) for w in weights], -1)


@packed_linear.register_fake
def _packed_linear_fake(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weights = inputs
    ctx.save_for_backward(x, *weights)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x, *weights = ctx.saved_tensors
    grads = grad.split([w.shape[0] for w in weights], -1)
    grad_x = sum(g @ w for g, w in zip(grads, weights))
    x2 = x.reshape(-1, x.shape[-1])
    return grad_x, [g.reshape(-1, g.shape[-1]).t() @ x2 for g in grads]


packed_linear.register_autograd(_backward, setup_context=_setup_context)


def _linear_of(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(x, weight) of a bias-free ``F.linear`` node."""
    if node.op != "call_function" or node.target not in _LINEAR or node.kwargs.get("bias") is not None:
        return None
    if len(node.args) == 3 and node.args[2] is not None or len(node.args) not in (2, 3):
        return None
    x, w = node.args[:2]
    if not (isinstance(x, fx.Node) and isinstance(w, fx.Node)):
        return None
    return x, w


MARK = "vattn_packed_linear"
"""Node meta key of a linear in a packed group: ``(group, position)``, set on the whole Dynamo
graph by ``mark`` (and kept in the traces vattn saves)."""


def _value(node: fx.Node, inputs: dict[fx.Node, Any]) -> torch.Tensor | None:
    v = inputs.get(node, node.meta.get("example_value", node.meta.get("val")))
    return v if isinstance(v, torch.Tensor) else None


def mark(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Tag the bias-free linears of one input whose weights are consecutive rows of one storage
    (``packed_rows`` on the example inputs, real or Dynamo's fakes) with ``MARK``; run on each
    graph Dynamo hands the backend (a loaded trace keeps the tags it was saved with). Returns
    the groups tagged."""
    graph = gm.graph
    inputs = dict(zip((n for n in graph.nodes if n.op == "placeholder"), example_inputs))
    by_storage: dict[tuple[fx.Node, Any], list[tuple[fx.Node, torch.Tensor]]] = {}
    for node in graph.nodes:
        xw = _linear_of(node)
        w = None if xw is None else _value(xw[1], inputs)
        if w is not None and w.dim() == 2:
            by_storage.setdefault((xw[0], _storage_key(w)), []).append((node, w))
    groups = 0
    for members in by_storage.values():
        members.sort(key=lambda m: m[1].storage_offset())
        run: list[tuple[fx.Node, torch.Tensor]] = []
        for m in [*members, None]:
            if m is not None and run and packed_rows([run[-1][1], m[1]]):
                run.append(m)
                continue
            if len(run) >= 2 and packed_rows([w for _, w in run]):
                for i, (node, _) in enumerate(run):
                    node.meta[MARK] = (groups, i)
                groups += 1
            run = [m] if m is not None else []
    return groups


def rewrite(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Fold each group of linears ``mark`` tagged (all of it in this piece, one input) into one
    ``vattn::packed_linear`` and a ``narrow`` per member (see the module docstring). Returns
    the groups made."""
    graph = gm.graph
    inputs = dict(zip((n for n in graph.nodes if n.op == "placeholder"), example_inputs))
    groups: dict[int, list[tuple[int, fx.Node]]] = {}
    for node in graph.nodes:
        if MARK in node.meta and _linear_of(node) is not None:
            group, position = node.meta[MARK]
            groups.setdefault(group, []).append((position, node))
    made = 0
    for members in groups.values():
        members.sort(key=lambda m: m[0])
        nodes = [n for _, n in members]
        if [p for p, _ in members] != list(range(len(nodes))) or len(nodes) < 2:
            continue  # not all of the group is here
        x = nodes[0].args[0]
        weights = [n.args[1] for n in nodes]
        rows = [_value(w, inputs) for w in weights]
        if any(n.args[0] is not x for n in nodes) or any(r is None or not isinstance(r.shape[0], int) for r in rows):
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min(nodes, key=order.__getitem__)
        if any(order[t] > order[first] for t in [x, *weights]):
            continue
        with graph.inserting_before(first):
            packed = graph.call_function(torch.ops.vattn.packed_linear.default, (x, weights))
            parts, start = [], 0
            for r in rows:
                parts.append(graph.call_function(torch.narrow, (packed, -1, start, r.shape[0])))
                start += r.shape[0]
        for node, part in zip(nodes, parts):
            part.meta.update({k: v for k, v in node.meta.items() if k != MARK})
            for user in list(node.users):
                if user.op == "call_method" and user.target == "view":
                    user.target = "reshape"  # a column slice cannot always be viewed
            node.replace_all_uses_with(part)
            graph.erase_node(node)
        made += 1
    if made:
        graph.lint()
        gm.recompile()
    return made


class _EagerGroup:
    """One packed group's eager state: the members, their row counts, the weight addresses
    last checked (``packed_rows``) and its answer, and the outputs kept for one input."""

    __slots__ = ("members", "sizes", "ptrs", "packed", "x", "version", "outs")

    def __init__(self, members: list[PackedLinear]) -> None:
        self.members = members
        self.sizes = [m.weight.shape[0] for m in members]
        self.ptrs: tuple[int, ...] = ()
        self.packed = False
        self.x: torch.Tensor | None = None
        self.version = -1
        self.outs: list[torch.Tensor | None] = []

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s ``F.linear(x, w_index)``: a kept slice, else the group's GEMM, else its own."""
        if self.x is x and self.version == x._version:
            out = self.outs[index]
            if out is not None:
                self.outs[index] = None
                if not any(o is not None for o in self.outs):
                    self.x, self.outs = None, []
                return out
        params = [m._parameters for m in self.members]
        weights = [p["weight"] for p in params]
        ptrs = tuple(w.data_ptr() for w in weights)
        if ptrs != self.ptrs:  # first call, or the weights were replaced or moved
            self.ptrs, self.packed = ptrs, packed_rows(weights)
        if not self.packed or any(p["bias"] is not None for p in params):  # unpacked, or a bias added since
            return F.linear(x, weights[index], params[index]["bias"])
        first = weights[0]
        k = first.shape[1]
        outs: list[torch.Tensor | None] = list(F.linear(x, first.as_strided((sum(self.sizes), k), (k, 1)))
                                              .split(self.sizes, -1))
        out = outs[index]
        outs[index] = None
        self.x, self.version, self.outs = x, x._version, outs
        return out


class PackedLinear(nn.Linear):
    """A bias-free ``nn.Linear`` whose weight ``pack_linear_weights`` packed with its siblings'
    (same parameters and state dict as before). Eager inference under ``torch.no_grad`` runs
    the group as one GEMM (module docstring); with grad enabled, on ``torch.inference_mode``
    tensors (no version counter to tell an input changed in place), under ``torch.compile``
    (where ``rewrite`` does it) or once the packing is undone, it is a plain ``nn.Linear``."""

    _vattn_group: _EagerGroup
    _vattn_index: int

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or torch.is_grad_enabled() or input.is_inference():
            return F.linear(input, self.weight, self.bias)  # inference tensors keep no version counter
        return self._vattn_group.output(self._vattn_index, input)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, packed={self._vattn_index + 1} of {len(self._vattn_group.members)}"


def pack_linear_weights(module: nn.Module, groups: Sequence[Sequence[str]] = (("q_proj", "k_proj", "v_proj"),
                                                                          ("gate_proj", "up_proj"))) -> int:
    """Give every submodule's bias-free ``nn.Linear`` children named in one of ``groups`` one
    weight buffer: their weights become consecutive row blocks of it, in the group's order
    (the same ``Parameter`` objects, their ``.data`` swapped: values, dtypes, devices and
    ``requires_grad`` unchanged), which ``rewrite`` runs as one GEMM.

    In-place updates (``load_state_dict``, ``copy_``) keep the packing; assigning a new
    ``Parameter``, or moving the module to another device or dtype, undoes it (each linear
    then runs on its own). A group is left as it is where a member is missing, has a bias,
    differs in input width, dtype or device, or shares its weight with another parameter
    (tied). Plain ``nn.Linear`` members become ``PackedLinear``, which runs the group as one
    GEMM in eager inference too (module docstring). Returns the groups packed."""
    owners: dict[Any, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        key = (p.device, p.untyped_storage().data_ptr()) if p.device.type != "meta" else id(p)
        owners[key] = owners.get(key, 0) + 1
    packed = 0
    for parent in module.modules():
        for names in groups:
            linears = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, nn.Linear) and m.bias is None for m in linears):
                continue
            ws = [m.weight for m in linears]
            first = ws[0]
            if (first.device.type == "meta" or packed_rows(ws)
                    or any(w.shape[1] != first.shape[1] or w.dtype != first.dtype or w.device != first.device
                           or owners.get((w.device, w.untyped_storage().data_ptr()), 0) != 1 for w in ws)):
                continue
            with torch.no_grad():
                buffer = torch.cat([w.detach() for w in ws])
            start = 0
            for w in ws:  # the same Parameter objects (optimizers, weight-sync maps keep working)
                w.data = buffer[start:start + w.shape[0]]
                start += w.shape[0]
            if all(type(m) is nn.Linear for m in linears):  # not a subclass with its own forward
                for m in linears:
                    m.__class__ = PackedLinear
                eager = _EagerGroup(linears)
                for i, m in enumerate(linears):
                    m._vattn_group, m._vattn_index = eager, i
            packed += 1
    if packed:
        logger.debug("pack_linear_weights: %d groups packed", packed)
    return packed
