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
  (SwiGLU) becomes ``vattn::gemv(h, w, True)``, which applies the activation as it reads.

``vattn::gemv`` checks its inputs at run time and falls back to ``F.linear`` for anything
but one bf16/fp16 row on CUDA, so the rewrite never changes what a graph computes.
``VattnBackend`` applies it to sm_90+ pieces compiled for 1 token, and compiles them with
Inductor's own PDL (``triton.enable_pdl``), so the norm before a GEMV lets it start early.
Together, on the Llama-3.2-1B FULL-graph decode step (H100, ``profile_step.py --gemv on off``)
the replay went from 1.017 to 0.952 ms; the GEMVs alone gave about 0.03 ms of that.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

__all__ = ["rewrite"]

_SILU = (F.silu, torch.ops.aten.silu.default)
_MUL = (operator.mul, torch.mul)


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


def rewrite(gm: fx.GraphModule) -> int:
    """Replace the bias-free ``F.linear`` calls of ``gm`` by ``vattn::gemv`` (in place,
    recompiled); returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch._C._nn.linear:
            continue
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if bias is not None:
            continue
        h = _swiglu_input(x)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.vattn.gemv.default, (x, w, False) if h is None else (h, w, True))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    if count:  # the SwiGLU nodes left unused are dropped by Inductor's dead-code elimination
        gm.recompile()
    return count
