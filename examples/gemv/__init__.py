"""Batch-1 linear layers as one Triton GEMV each, routed into ``vattn.compile`` by a piece pass.

A batch-1 decode step is a chain of matrix-vector products, each short enough that its launch
and ramp-up cost about as much as streaming its weight. ``OneTokenGemv`` rewrites the pieces
``vattn.compile`` compiles for exactly one token (``CompilationConfig.compile_sizes`` holding 1)
so that every bias-free ``F.linear`` runs ``torch.ops.vattn_examples.gemv``, with a decoder
layer's RMSNorm, SwiGLU activation, residual add and RoPE fused into the projections around
them, and separate projections of one input (q / k / v, gate / up) in one
``vattn_examples::gemv_group`` launch (``rewrite.py`` lists the idioms it matches). Plug it in
through the public hook::

    cfg = vattn.VattnConfig(compilation=vattn.CompilationConfig(
        compile_sizes=(1,), piece_passes=(OneTokenGemv(),)))

| module | what |
| --- | --- |
| ``kernel`` | the Triton GEMV (``launch_gemv``, ``launch_gemv_group``), with programmatic dependent launch on sm_90+ |
| ``op`` | ``vattn_examples::gemv`` / ``gemv_group``: the kernel for one bf16/fp16 row on CUDA, torch elsewhere |
| ``rewrite`` | the FX rewrite of a 1-token piece's linear layers into that op |

The LM head runs outside the compiled pieces (on the rows a step samples from);
``gemv_lm_head(model)`` sends a ``transformers`` model's through the same op, as
``examples/model.py``'s ``ParallelLMHead`` does.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from examples.gemv import rewrite
from vattn.kernels.launch import pdl_supported

__all__ = ["GemvLinear", "OneTokenGemv", "gemv_lm_head"]


class OneTokenGemv:
    """``CompilationConfig.piece_passes`` entry: the 1-token rewrite on sm_90+ GPUs.

    Pieces compiled for any other token count, or on other devices, are left alone (the
    rewrite is only faster where the kernel overlaps its weight loads with the kernel before
    it, which needs programmatic dependent launch).
    """

    __name__ = "OneTokenGemv"

    def __call__(self, graph: fx.GraphModule, example_inputs: Sequence[Any], num_tokens: int | None) -> int:
        if num_tokens != 1:
            return 0
        devices = {a.device for a in example_inputs if isinstance(a, torch.Tensor)}
        if len(devices) != 1 or not pdl_supported(devices.pop()):
            return 0
        return rewrite.rewrite(graph)


class GemvLinear(nn.Linear):
    """A bias-free ``nn.Linear`` whose forward is ``vattn_examples::gemv``: the Triton GEMV for one
    bf16/fp16 row on CUDA, ``F.linear`` for anything else (same parameters and state-dict keys).
    Calls that autograd records (the op has no backward) run ``nn.Linear``'s forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return super().forward(x)
        return torch.ops.vattn_examples.gemv(x, self.weight, False)


def gemv_lm_head(model: nn.Module) -> bool:
    """Make the output embedding of a ``transformers`` model (or of its
    ``vattn.integrations.transformers`` wrap, through ``hf_model``) a ``GemvLinear``, in place,
    when it is a bias-free ``nn.Linear``; returns whether it did. A batch-1 step's LM head
    then streams its (vocab, hidden) weight with the GEMV instead of cuBLAS."""
    hf = getattr(model, "hf_model", model)
    get = getattr(hf, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not nn.Linear or head.bias is not None:
        return False
    head.__class__ = GemvLinear
    return True
