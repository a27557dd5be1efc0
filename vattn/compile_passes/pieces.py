"""Compiling the pieces of a split graph: identical pieces are found by a hash and compiled once.

A piece is identified by its graph (ops, arguments, constants, with node names canonicalised)
and its inputs' metadata (symbolic shapes, strides, dtypes, devices). Every decoder layer's
piece is the same graph, so a model of N layers compiles about 3 pieces (first, middle,
last), whatever N. ``PieceCompiler`` runs the split module on fake inputs and hands each
piece, with its fake inputs, to the backend.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from vattn.compile_passes.piecewise import CUDAGraphPiece
from vattn.compile_passes.split import SplitItem

__all__ = ["PieceCompiler", "fake_inputs", "piece_key", "token_count_locator"]


def _target_key(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op in ("call_function",):
        t = node.target
        mod = getattr(t, "__module__", None) or ""
        return f"{mod}.{getattr(t, '__qualname__', None) or getattr(t, '__name__', None) or t}"
    if node.op == "call_method":
        return str(node.target)
    if node.op in ("get_attr", "call_module"):
        # A module attribute is per-layer state: only the very same object may share code.
        obj = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        return f"{node.target}@{id(obj)}"
    return ""


def _value_key(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"T({tuple(str(s) for s in v.shape)},{tuple(str(s) for s in v.stride())},{v.dtype},{v.device},{v.requires_grad})"
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"S({v.node.expr})"
    return f"C({v!r})"


def piece_key(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """A hash of the piece's graph (node names canonicalised) and its inputs' metadata."""
    index: dict[fx.Node, str] = {}
    lines: list[str] = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = f"%{i}"
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: index[n])
        lines.append(f"{node.op}|{_target_key(gm, node)}|{args!r}")
    lines.extend(_value_key(v) for v in example_inputs)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def token_count_locator(example_inputs: Sequence[Any]) -> tuple[int, int | None] | None:
    """Where a piece's token count is among its (fake) inputs: ``(i, None)`` for a SymInt
    argument, ``(i, d)`` for dim ``d`` of tensor argument ``i``; None unless the inputs
    have exactly one free symbol."""
    symbols: set[Any] = set()
    found: list[tuple[int, int | None]] = []
    for i, a in enumerate(example_inputs):
        if isinstance(a, torch.SymInt):
            symbols |= a.node.expr.free_symbols
            if a.node.expr.is_Symbol:
                found.append((i, None))
        elif isinstance(a, torch.Tensor):
            for d, size in enumerate(a.shape):
                if isinstance(size, torch.SymInt):
                    symbols |= size.node.expr.free_symbols
                    if size.node.expr.is_Symbol:
                        found.append((i, d))
    if len(symbols) != 1 or not found:
        return None
    return min(found, key=lambda f: f[1] is not None)  # a SymInt argument if there is one


def fake_inputs(example_inputs: Sequence[Any]) -> list[Any]:
    """The inputs as fake tensors of the backend's fake mode (symbolic sizes where Dynamo made them)."""
    from torch._guards import detect_fake_mode

    from torch._subclasses.fake_tensor import FakeTensor

    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        return list(example_inputs)
    # from_tensor finds each input's symbolic context in the active TracingContext; inputs
    # already fake (a graph loaded from vattn's cache) are used as they are.
    return [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) else t
            for t in example_inputs]


class PieceCompiler(torch.fx.Interpreter):
    """Runs the split module on fake inputs; compiles each piece with its (fake) inputs."""

    def __init__(self, module: fx.GraphModule, to_compile: Mapping[str, SplitItem], backend: Any) -> None:
        super().__init__(module)
        self.to_compile = to_compile
        self.backend = backend

    def run(self, *args: Any) -> Any:  # type: ignore[override]
        from torch._dispatch.python import enable_python_dispatcher
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = detect_fake_mode(args) or FakeTensorMode()
        with fake_mode, enable_python_dispatcher():
            return super().run(*args)

    def call_module(self, target: str, args: Any, kwargs: Any) -> Any:  # type: ignore[override]
        item = self.to_compile.get(target)
        out = _traced_outputs(item.graph) if item is not None else None
        if out is None:  # attention ops (one op: cheap), or a piece without traced values
            out = super().call_module(target, args, kwargs)
        if item is not None:
            key = piece_key(item.graph, args)
            static = self.backend.static_sizes(item.graph, args, key)  # before Inductor edits the graph
            fn = self.backend.compile_piece(item.graph, args, target, key)
            piece = CUDAGraphPiece(fn, item.index, target, static)
            self.backend.pieces.append(piece)
            self.module.__dict__[target] = piece  # shadows the submodule in the generated code
        return out


def _traced_outputs(gm: fx.GraphModule) -> Any:
    """The fake values Dynamo recorded for a piece's outputs (None if any is missing).

    They are what running the piece on the fake inputs would return, without running it:
    a 32-layer model compiles ~30 identical pieces, whose fake execution dominated the
    backend's time before (``benchmarks/bench_compile.py`` cold start).
    """
    node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    missing = []

    def value(n: fx.Node) -> Any:
        v = n.meta.get("example_value", n.meta.get("val"))  # Dynamo's graphs carry example_value
        if not isinstance(v, (torch.Tensor, torch.SymInt, int, float, bool)):
            missing.append(n)
        return v

    out = fx.node.map_arg(node.args[0], value)
    if missing:
        return None
    return tree_map(lambda v: _fresh_fake(v) if isinstance(v, torch.Tensor) else v, out)


def _fresh_fake(v: torch.Tensor) -> torch.Tensor:
    """A tensor of the fake mode now active with ``v``'s sizes, strides and storage offset
    (symbolic: one shape env), so Inductor sees the alignment the real input will have."""
    if v.storage_offset() == 0:
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
    base = torch.empty(v.untyped_storage().nbytes() // v.element_size(), dtype=v.dtype, device=v.device)
    return base.as_strided(v.shape, v.stride(), v.storage_offset())
