"""TRITON_ATTN: vattn's own Triton paged-attention kernels behind the backend interface.

One launch of ``vattn.backends.triton.paged_attention.paged_attention`` serves a whole mixed
batch (decodes and chunked prefills with cached context), preceded by ``store_kv``; decode
batches (and CUDA graphs captured for them) store the new K/V inside the attention kernel
(``VATTN_TRITON_FUSED_KV_STORE=0`` turns that off).

| feature | support |
| --- | --- |
| head sizes | multiples of 8 up to 256 (computed padded to a power of two) |
| block sizes | any (the kernel reads the block table per token; 16 and 32 are the GPU-tested ones) |
| dtypes | fp16, bf16, fp32 |
| KV cache | auto, bfloat16, float16, float32, fp8 / fp8_e4m3, fp8_e5m2 (per-layer scales) |
| extras | GQA/MQA, causal with offset, sliding window, soft cap, ALiBi, sinks, fp8 query, fp8 output |
| attention types | decoder, encoder-decoder (cross-attention over the cached encoder K/V) |
| CUDA graphs | ``ALWAYS``: persistent metadata buffers, one kernel path per captured size |

KV cache: logical ``(2, num_blocks, block_size, Hk, D)``; physical NHD or HND by
``vattn.backends.utils.get_kv_cache_layout()`` (the kernels use strides).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from vattn.core.interface import AttentionBackend
from vattn.core.checks import e4m3_cache_reasons, triton_availability
from vattn.backends.triton.impl import SUPPORTED_ATTN_TYPES, TritonAttentionImpl
from vattn.backends.triton.metadata import TritonAttentionMetadata, TritonAttentionMetadataBuilder
from vattn.core.layout import check_kv_cache_shape_args, paged_kv_stride_order
from vattn.core.config import CACHE_DTYPES

__all__ = ["TritonAttentionBackend"]


class TritonAttentionBackend(AttentionBackend):
    """vattn's Triton backend: portable wherever Triton runs (GPU, or CPU under TRITON_INTERPRET=1)."""

    accept_output_buffer: ClassVar[bool] = True
    supports_quant_query_input: ClassVar[bool] = True
    supports_output_quant: ClassVar[bool] = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = CACHE_DTYPES
    supports_sink: ClassVar[bool] = True
    supports_sliding_window: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    supports_alibi: ClassVar[bool] = True
    supports_tree_parents: ClassVar[bool] = True  # the kernel's tree mask (``TritonAttentionMetadata.tree``)
    supported_attn_types: ClassVar[tuple[str, ...]] = SUPPORTED_ATTN_TYPES
    runs_on_cpu: ClassVar[bool] = False
    min_compute_capability: ClassVar[tuple[int, int] | None] = (8, 0)
    feature_notes: ClassVar[dict[str, str]] = {
        "runs_on_cpu": "TRITON_INTERPRET=1 (tests)",
        "sliding_window": "not on cross-attention",
        "fp8_kv": "e4m3: 8.9+",
    }

    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_impl_cls() -> type[TritonAttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[TritonAttentionMetadata]:
        return TritonAttentionMetadata

    @staticmethod
    def get_builder_cls() -> type[TritonAttentionMetadataBuilder]:
        return TritonAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``; ``[0]`` keys, ``[1]`` values."""
        check_kv_cache_shape_args(num_blocks, block_size, num_kv_heads, head_size)
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """Identity for NHD, ``(0, 1, 3, 2, 4)`` for HND (``get_kv_cache_layout()``)."""
        return paged_kv_stride_order()

    @classmethod
    def get_supported_head_sizes(cls) -> tuple[int, ...]:
        return tuple(range(8, 257, 8))

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return triton_availability("TRITON_ATTN")

    @classmethod
    def validate_configuration(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None,
                               block_size: int, use_mla: bool = False, has_sink: bool = False,
                               use_sparse: bool = False) -> list[str]:
        """The declarations' reasons, and an e4m3 cache on a GPU older than compute capability 8.9."""
        return super().validate_configuration(head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink,
                                              use_sparse) + e4m3_cache_reasons(kv_cache_dtype)
