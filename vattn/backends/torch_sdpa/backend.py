"""``TorchSDPABackend``: the reference backend's static facts (see the package docstring)."""

from __future__ import annotations

from typing import ClassVar

import torch

from vattn.core.enums import AttentionType
from vattn.core.interface import AttentionBackend
from vattn.backends.torch_sdpa.impl import TorchSDPAImpl
from vattn.backends.torch_sdpa.metadata import TorchSDPAMetadata, TorchSDPAMetadataBuilder
from vattn.core.layout import check_kv_cache_shape_args, paged_kv_stride_order
from vattn.core.config import CACHE_DTYPES

__all__ = ["TorchSDPABackend"]


class TorchSDPABackend(AttentionBackend):
    """Reference backend: any head size, fp16/bf16/fp32, every KV-cache dtype and feature, CPU and CUDA."""

    accept_output_buffer: ClassVar[bool] = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = CACHE_DTYPES
    supports_sink: ClassVar[bool] = True
    supports_sliding_window: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    supports_alibi: ClassVar[bool] = True
    supported_attn_types: ClassVar[tuple[str, ...]] = AttentionType.ALL
    runs_on_cpu: ClassVar[bool] = True
    min_compute_capability: ClassVar[tuple[int, int] | None] = None
    feature_notes: ClassVar[dict[str, str]] = {
        "sliding_window": "not on cross-attention",
        "alibi": "not on cross-attention",
        "fp8_kv": "e4m3 on CUDA: 8.9+",
    }

    @staticmethod
    def get_name() -> str:
        return "TORCH_SDPA"

    @staticmethod
    def get_impl_cls() -> type[TorchSDPAImpl]:
        return TorchSDPAImpl

    @staticmethod
    def get_metadata_cls() -> type[TorchSDPAMetadata]:
        return TorchSDPAMetadata

    @staticmethod
    def get_builder_cls() -> type[TorchSDPAMetadataBuilder]:
        return TorchSDPAMetadataBuilder

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
        """Identity for the NHD layout, ``(0, 1, 3, 2, 4)`` for HND (``get_kv_cache_layout()``)."""
        return paged_kv_stride_order()
