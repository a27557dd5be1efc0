"""``FlashAttentionBackend``: what FLASH_ATTN serves (by the installed interface), its KV-cache shape."""

from __future__ import annotations

from typing import ClassVar

import torch

from vattn.core.enums import AttentionCGSupport
from vattn.core.interface import AttentionBackend
from vattn.backends.flash_attn import interface as fa_interface
from vattn.backends.flash_attn.impl import SUPPORTED_ATTN_TYPES, FlashAttentionImpl
from vattn.backends.flash_attn.metadata import FlashAttentionMetadata, FlashAttentionMetadataBuilder
from vattn.core.layout import check_kv_cache_shape_args, paged_kv_stride_order

__all__ = ["FlashAttentionBackend"]


class FlashAttentionBackend(AttentionBackend):
    """FlashAttention (flash-attn-4, FA3 or FA2, whichever is installed) over a paged KV cache."""

    accept_output_buffer: ClassVar[bool] = True
    supports_quant_query_input: ClassVar[bool] = True  # fp8 KV caches attend with fp8 queries
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = (
        "auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2",
    )
    supports_sink: ClassVar[bool] = True
    supports_sliding_window: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    supports_alibi: ClassVar[bool] = True
    supported_attn_types: ClassVar[tuple[str, ...]] = SUPPORTED_ATTN_TYPES
    runs_on_cpu: ClassVar[bool] = False
    min_compute_capability: ClassVar[tuple[int, int] | None] = (8, 0)
    feature_notes: ClassVar[dict[str, str]] = {
        "alibi": "FA2",
        "sinks": "flash-attn-4",
        "fp8_kv": "FA3 on SM90, flash-attn-4 on SM100; bf16 models",
        "min_compute_capability": "FA3: 9.0, flash-attn-4: 9.0/10.x",
        "block_sizes": "FA2: multiples of 256",
        "head_sizes": "flash-attn-4 on SM100: <= 128 or 256",
        "cuda_graphs": "FA2: uniform batches",
    }

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return FlashAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[FlashAttentionMetadata]:
        return FlashAttentionMetadata

    @staticmethod
    def get_builder_cls() -> type[FlashAttentionMetadataBuilder]:
        return FlashAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``; ``[0]`` keys, ``[1]`` values."""
        check_kv_cache_shape_args(num_blocks, block_size, num_kv_heads, head_size)
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """Identity for NHD; ``(0, 1, 3, 2, 4)`` for HND."""
        return paged_kv_stride_order()

    @classmethod
    def get_supported_head_sizes(cls) -> tuple[int, ...]:
        """Multiples of 8 up to 256, over all interfaces (``interface_reasons`` narrows it per GPU)."""
        return tuple(range(8, 257, 8))

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        iface, why = fa_interface.get_flash_attn_interface()
        return iface is not None, why

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int,
        use_mla: bool = False,
        has_sink: bool = False,
        use_sparse: bool = False,
    ) -> list[str]:
        """Every reason the installed interface cannot serve the configuration (``interface_reasons``)."""
        iface, why = fa_interface.get_flash_attn_interface()
        if iface is None:
            return [why]
        major, minor = torch.cuda.get_device_capability()
        reasons = fa_interface.interface_reasons(iface.name, major * 10 + minor, head_size, dtype,
                                                 kv_cache_dtype or "auto", block_size, has_sink)
        if use_mla:
            reasons.append("MLA not supported (use an MLA backend)")
        if use_sparse:
            reasons.append("sparse attention not supported")
        return reasons

    @classmethod
    def get_cudagraph_support(cls) -> AttentionCGSupport:
        iface, _ = fa_interface.get_flash_attn_interface()
        return fa_interface.cg_support(iface)
