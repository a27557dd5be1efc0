"""FLASHINFER's impl: store the step's new K/V, then ``run`` the wrappers the builder planned.

Decoder self-attention only, without ALiBi or sinks: the constructor refuses those (FlashInfer's
paged wrappers plan neither; its Hopper kernels ignore ``sinks``). Sliding window, soft cap and
scale are planned once per KV-cache group, so every layer of a group must share them (the builder
checks). fp8 KV caches attend with the layer's host scales (``_k_scale_float``, ``_v_scale_float``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vattn.core.enums import AttentionType
from vattn.core.interface import AttentionImpl
from vattn.backends.flashinfer.metadata import FlashInferMetadata
from vattn.ops.kv_store import fp8_dtype_for, layer_scales, store_kv

if TYPE_CHECKING:
    from vattn.core.interface import AttentionLayerBase as Attention

__all__ = ["SUPPORTED_ATTN_TYPES", "FlashInferImpl"]

#: The attention types the impl serves (``FlashInferBackend.supported_attn_types``).
SUPPORTED_ATTN_TYPES = (AttentionType.DECODER,)


class FlashInferImpl(AttentionImpl[FlashInferMetadata]):
    """Stores new K/V, then runs the planned decode and prefill wrappers into ``output``."""

    backend_name = "FLASHINFER"
    attn_types = SUPPORTED_ATTN_TYPES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``AttentionImpl``'s arguments."""
        super().__init__(*args, **kwargs)
        if self.alibi_slopes is not None:
            raise NotImplementedError(
                f"FLASHINFER alibi_slopes: expected None (FlashInfer's paged wrappers have no ALiBi), got "
                f"{len(self.alibi_slopes)} slopes; use TRITON_ATTN, TORCH_SDPA or FLASH_ATTN (FA2) for ALiBi layers."
            )
        if self.sinks is not None:
            raise NotImplementedError(
                f"FLASHINFER sinks: expected None (no attention sinks), got a tensor of shape "
                f"{tuple(self.sinks.shape)}; use TRITON_ATTN, TORCH_SDPA or FLASH_ATTN (flash-attn-4) for sinks."
            )
        self._fp8_dtype = fp8_dtype_for(self.kv_cache_dtype)

    def forward(self, layer: "Attention", query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor, attn_metadata: FlashInferMetadata | None,
                output: torch.Tensor | None = None, output_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query (T, H, D), key/value (T, Hk, D), kv_cache (num_blocks, 2, block_size, Hk, D) -> output (T, H, D)."""
        md = attn_metadata
        if md is None:
            return output
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            k_scale, v_scale, _ = layer_scales(layer)
            store_kv(key, value, kv_cache[:, 0], kv_cache[:, 1], md.slot_mapping, self.kv_cache_dtype, k_scale, v_scale)
        if self._fp8_dtype is not None:
            if kv_cache.dtype != self._fp8_dtype:
                kv_cache = kv_cache.view(self._fp8_dtype)
            k_scale, v_scale = layer._k_scale_float, layer._v_scale_float
        else:
            k_scale = v_scale = None
        paged = kv_cache.permute(0, 1, 3, 2, 4) if md.kv_layout == "HND" else kv_cache
        if md.decode_wrapper is not None:
            n = md.decode_rows
            md.decode_wrapper.run(query[:n], paged, k_scale=k_scale, v_scale=v_scale, out=output[:n])
        if md.prefill_wrapper is not None:
            s, e = md.prefill_start, md.prefill_start + md.prefill_rows
            md.prefill_wrapper.run(query[s:e], paged, k_scale=k_scale, v_scale=v_scale, out=output[s:e])
        return output
