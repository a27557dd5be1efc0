"""Residual-add unfusion: ``addmm(residual, x, W)`` back into ``mm(x, W) + residual`` on GPUs.

Inductor's post-grad patterns turn ``residual + x @ W`` into ``aten.addmm`` unless every
user of the sum is element-wise. In a decoder layer the sum feeds the next RMSNorm (a
reduction) and the next residual add, so the ``o_proj`` and ``down_proj`` adds of every
layer become ``addmm(residual, x, W)``. On CUDA that call first copies the residual into
its output (a device memcpy: ``addmm_out`` with an output other than its input) and then
runs the GEMM with ``beta = 1``, reading the copy back: two extra passes over the (T, hidden)
activations and, in a CUDA graph, one more node per projection. With the add left
element-wise, Inductor fuses it into the RMSNorm kernel that reads the sum anyway (and that
kernel also writes the sum when the next layer needs it).

In the Llama-3.2-1B-shaped decode step two memcpy nodes a layer go away
(``benchmarks/results/profile-unfuse-addmm-*`` has the before/after replay times).

Left as they are: an ``addmm`` with a 1-D bias (``nn.Linear(bias=True)``; ATen can hand it
to cuBLASLt's bias epilogue, which needs no copy), one with ``alpha`` or ``beta`` other than 1,
and CPU graphs (not measured there; Inductor keeps ``addmm`` fused on CPUs too).

Numerics: the GEMM result is rounded to the activation dtype before the add, as in eager
PyTorch (``residual + linear(x)``), instead of once after it.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from vattn.compile_passes.pass_manager import VattnPass, node_value, register_pass

__all__ = ["UnfuseAddmmPass"]

aten = torch.ops.aten


@register_pass
class UnfuseAddmmPass(VattnPass):
    """See the module docstring. ``apply`` returns the number of ``addmm`` nodes unfused."""

    name = "unfuse_addmm"

    def apply(self, graph: fx.Graph) -> int:
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target != aten.addmm.default:
                continue
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
                continue
            inp, mat1, mat2 = node.args[:3]
            inp_val, out_val = node_value(inp), node_value(node)
            if inp_val is None or out_val is None or inp_val.dim() != 2 or inp_val.device.type == "cpu":
                continue
            with graph.inserting_before(node):
                mm = graph.call_function(aten.mm.default, (mat1, mat2))
                add = graph.call_function(aten.add.Tensor, (mm, inp))
            m1, m2 = node_value(mat1), node_value(mat2)
            if m1 is not None and m2 is not None:
                mm.meta["val"] = aten.mm.default(m1, m2)  # fake tensors: shapes only
            add.meta["val"] = out_val
            for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
                if key in node.meta:
                    mm.meta[key] = add.meta[key] = node.meta[key]
            node.replace_all_uses_with(add)
            graph.erase_node(node)
            count += 1
        return count
