"""FLASH_ATTN's impl: store the step's new K/V, then one varlen paged call for the whole batch.

One call of the installed interface (``vattn.backends.flash_attn.interface``) serves a mixed
batch of decodes and (chunked) prefills. Decoder self-attention only. Sliding window and soft cap
on every interface; ALiBi on FA2 and sinks on flash-attn-4 (``learnable_sink``): with a GPU the
constructor refuses them where the installed interface lacks them, without one the first forward
does. fp8 KV caches attend with fp8 queries and per-request descales (FA3 on SM90, flash-attn-4
on SM100).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vattn.core.enums import AttentionType
from vattn.core.interface import AttentionImpl
from vattn.backends.flash_attn import interface as fa_interface
from vattn.backends.flash_attn.interface import FlashAttnInterface
from vattn.backends.flash_attn.metadata import FlashAttentionMetadata
from vattn.ops.kv_store import fp8_dtype_for, layer_scales, store_kv

if TYPE_CHECKING:
    from vattn.core.interface import AttentionLayerBase as Attention

__all__ = ["SUPPORTED_ATTN_TYPES", "FlashAttentionImpl"]

#: The attention types the impl serves (``FlashAttentionBackend.supported_attn_types``).
SUPPORTED_ATTN_TYPES = (AttentionType.DECODER,)


class FlashAttentionImpl(AttentionImpl[FlashAttentionMetadata]):
    """Stores new K/V, then one varlen paged call for the whole (mixed) batch."""

    backend_name = "FLASH_ATTN"
    attn_types = SUPPORTED_ATTN_TYPES

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``AttentionImpl``'s arguments."""
        super().__init__(*args, **kwargs)
        self._fp8_dtype = fp8_dtype_for(self.kv_cache_dtype)
        self._iface: FlashAttnInterface | None = None
        self._dev_cache: dict[str, torch.Tensor] = {}
        if (self.alibi_slopes is not None or self.sinks is not None) and torch.cuda.is_available():
            self._interface()  # refuse ALiBi / sinks the installed interface lacks at construction

    def _interface(self) -> FlashAttnInterface:
        """The installed interface; refuses ALiBi and sinks where it has none."""
        if self._iface is None:
            iface, why = fa_interface.get_flash_attn_interface()
            if iface is None:
                raise RuntimeError(f"FLASH_ATTN cannot run: {why}")
            if self.alibi_slopes is not None and iface.name != "fa2":
                raise NotImplementedError(
                    f"FLASH_ATTN alibi_slopes: expected None with {iface.name} {iface.version} (ALiBi needs "
                    f"FA2), got {self.alibi_slopes.numel()} slopes; use TRITON_ATTN or TORCH_SDPA for ALiBi layers."
                )
            if self.sinks is not None and iface.name != "fa4":
                raise NotImplementedError(
                    f"FLASH_ATTN sinks: expected None with {iface.name} {iface.version} (sinks need "
                    f"flash-attn-4), got a tensor of shape {tuple(self.sinks.shape)}; use TRITON_ATTN or TORCH_SDPA."
                )
            self._iface = iface
        return self._iface

    def _on_device(self, name: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` as float32 on ``device``, converted once (not inside a captured graph)."""
        cached = self._dev_cache.get(name)
        if cached is None or cached.device != device:
            cached = self._dev_cache[name] = t.to(device=device, dtype=torch.float32)
        return cached

    def forward(self, layer: "Attention", query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor, attn_metadata: FlashAttentionMetadata | None,
                output: torch.Tensor | None = None, output_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query (T, H, D) (fp8 with an fp8 cache), key/value (T, Hk, D), kv_cache (2, N, bs, Hk, D) -> output."""
        md = attn_metadata
        if md is None:
            return output
        iface = self._interface()
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            k_scale, v_scale, _ = layer_scales(layer)
            store_kv(key, value, key_cache, value_cache, md.slot_mapping, self.kv_cache_dtype, k_scale, v_scale)
        descale: dict[str, torch.Tensor] = {}
        if self._fp8_dtype is not None:
            key_cache, value_cache = key_cache.view(self._fp8_dtype), value_cache.view(self._fp8_dtype)
            shape = (md.query_start_loc.shape[0] - 1, self.num_kv_heads)
            descale = {f"{c}_descale": getattr(layer, f"_{c}_scale").expand(shape) for c in "qkv"}
        out = output[: query.shape[0]]
        window = self.sliding_window
        if iface.name == "fa4":
            kwargs: dict[str, Any] = dict(
                cu_seqlens_q=md.query_start_loc, seqused_k=md.seq_lens, page_table=md.block_table,
                max_seqlen_q=md.max_query_len, max_seqlen_k=md.max_seq_len, softmax_scale=self.scale,
                causal=md.causal, softcap=self.logits_soft_cap or 0.0, num_splits=1,
                learnable_sink=None if self.sinks is None else self._on_device("sinks", self.sinks, query.device),
                **descale,
            )
            if iface.has_out:
                iface.fn(query, key_cache, value_cache, out=out,
                         window_size_left=window[0] if window else None,
                         window_size_right=window[1] if window else None, **kwargs)
                return output
            for name in descale:  # the public varlen entry point has no descales (and no out=)
                del kwargs[name]
            res = iface.fn(query, key_cache, value_cache, window_size=window if window else (None, None), **kwargs)
        elif iface.name == "fa3":
            res = iface.fn(
                query, key_cache, value_cache, cache_seqlens=md.seq_lens, page_table=md.block_table,
                cu_seqlens_q=md.query_start_loc, max_seqlen_q=md.max_query_len, softmax_scale=self.scale,
                causal=md.causal, window_size=window if window else (-1, -1),
                softcap=self.logits_soft_cap or 0.0, **descale,
            )
        else:
            alibi = None if self.alibi_slopes is None else self._on_device("alibi", self.alibi_slopes, query.device)
            res = iface.fn(
                query, key_cache, value_cache, md.query_start_loc, md.cu_seqlens_k, md.max_query_len,
                md.max_seq_len, softmax_scale=self.scale, causal=md.causal,
                window_size=window if window else (-1, -1), softcap=self.logits_soft_cap or 0.0,
                alibi_slopes=alibi, block_table=md.block_table,
            )
        out.copy_(res[0] if isinstance(res, tuple) else res)
        return output
