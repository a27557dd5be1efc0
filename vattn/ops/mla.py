"""MLA's ops: ``vattn::unified_mla_attention_with_output`` (the layer's attention, opaque to
``torch.compile`` like ``vattn::unified_attention_with_output``) and ``vattn::concat_and_cache_mla``
(the latent-row store, with ``store_latent``, which every MLA backend calls).

The attention op looks its ``vattn.MLAAttention`` layer up by name in the forward context and
runs the layer's MLA impl: ``impl.forward(layer, q, kv_c_normed, k_pe, kv_cache, metadata,
output=output)``. Its fake only checks what it can at trace time (shapes, dtypes).
"""

from __future__ import annotations

import torch

from vattn.forward_context import get_forward_context
from vattn.ops.attention import check_call, check_traced
from vattn.ops.kv_store import quantize_to_cache
from vattn.ops.library import register_op

__all__ = ["concat_and_cache_mla", "store_latent", "unified_mla_attention_with_output"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def store_latent(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 scale: torch.Tensor) -> None:
    """Write ``cat(kv_c, k_pe)`` rows into the MLA cache at ``slot_mapping`` (< 0: skip).

    | tensor | shape |
    | --- | --- |
    | kv_c | (T, L) normalized compressed KV |
    | k_pe | (T, R) RoPE'd key, shared by the heads |
    | kv_cache | (num_blocks, block_size, L + R) |
    | slot_mapping | (>= T,) int; the first ``min(T, len)`` rows count |
    | scale | 0-dim float32; fp8 caches store ``x / scale`` |

    CUDA: one Triton launch (``vattn.kernels.mla_store``), no host sync; elsewhere torch indexing.
    """
    if kv_cache.is_cuda:
        from vattn.kernels.mla_store import triton_store_latent

        triton_store_latent(kv_c, k_pe, kv_cache, slot_mapping, scale)
        return
    n = min(kv_c.shape[0], slot_mapping.shape[0])
    slots = slot_mapping[:n].long()
    row = torch.cat([kv_c[:n], k_pe[:n]], dim=-1)
    valid = slots >= 0  # boolean indexing: fine on the CPU
    if not bool(valid.all()):
        slots, row = slots[valid], row[valid]
    row = quantize_to_cache(row, scale, kv_cache.dtype) if kv_cache.dtype in _FP8 else row.to(kv_cache.dtype)
    with torch.no_grad():
        kv_cache[slots // kv_cache.shape[1], slots % kv_cache.shape[1]] = row


def concat_and_cache_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         scale: torch.Tensor) -> None:
    """``store_latent`` as an op (vLLM's name): writes ``kv_cache`` in place."""
    store_latent(kv_c, k_pe, kv_cache, slot_mapping, scale)


def _concat_and_cache_mla_fake(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, scale: torch.Tensor) -> None:
    return None


register_op("concat_and_cache_mla", concat_and_cache_mla, mutates_args=["kv_cache"],
            fake_impl=_concat_and_cache_mla_fake)


def unified_mla_attention_with_output(q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                                      output: torch.Tensor, layer_name: str,
                                      output_scale: torch.Tensor | None = None) -> None:
    """MLA of layer ``layer_name`` written into ``output`` (T, H, v_head_dim); see ``vattn.MLAAttention``.

    | tensor | shape |
    | --- | --- |
    | q | (T, H, qk_nope_head_dim + qk_rope_head_dim), RoPE applied to its last part |
    | kv_c_normed | (T, kv_lora_rank) |
    | k_pe | (T, qk_rope_head_dim), RoPE applied |
    | output | (T, H, v_head_dim) |
    """
    ctx = get_forward_context()
    layer = ctx.layer(layer_name)
    md = ctx.metadata_for(layer_name)
    if md is None:  # warm-up / profile run (ctx.dummy_run): cache untouched, zeros out
        ctx.check_dummy_run(layer_name)
        output.zero_()
        return
    kv_cache = layer.kv_cache[0]
    check_call(layer, q, kv_c_normed, k_pe, kv_cache, md, ctx.debug_checks)
    layer.impl.forward(layer, q, kv_c_normed, k_pe, kv_cache, md, output=output, output_scale=output_scale)


def _unified_mla_attention_with_output_fake(q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                                            output: torch.Tensor, layer_name: str,
                                            output_scale: torch.Tensor | None = None) -> None:
    check_traced(q, kv_c_normed, k_pe, layer_name)


register_op(
    "unified_mla_attention_with_output",
    unified_mla_attention_with_output,
    mutates_args=["output"],
    fake_impl=_unified_mla_attention_with_output_fake,
)
