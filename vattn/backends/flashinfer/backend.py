"""``FlashInferBackend``: what FLASHINFER serves, its KV-cache shape, and whether it can run here."""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from vattn.core.interface import AttentionBackend
from vattn.core.checks import e4m3_cache_reasons
from vattn.backends.flashinfer.impl import SUPPORTED_ATTN_TYPES, FlashInferImpl
from vattn.backends.flashinfer.metadata import FlashInferMetadata, FlashInferMetadataBuilder
from vattn.core.layout import check_kv_cache_shape_args, paged_kv_stride_order

__all__ = ["FlashInferBackend"]


@functools.lru_cache(maxsize=1)
def _availability() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "FLASHINFER needs a CUDA GPU and none is visible"
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # ImportError, or a broken CUDA/JIT setup raising at import
        return False, f"flashinfer is not importable ({type(e).__name__}: {e}); pip install flashinfer-python"
    return True, ""


class FlashInferBackend(AttentionBackend):
    """FlashInfer paged attention: fp16/bf16, head sizes 64/128/256, fp8 KV caches, NHD/HND."""

    accept_output_buffer: ClassVar[bool] = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = (
        "auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2",
    )
    supports_sink: ClassVar[bool] = False
    supports_sliding_window: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    supports_alibi: ClassVar[bool] = False
    supported_attn_types: ClassVar[tuple[str, ...]] = SUPPORTED_ATTN_TYPES
    runs_on_cpu: ClassVar[bool] = False
    min_compute_capability: ClassVar[tuple[int, int] | None] = (7, 5)
    feature_notes: ClassVar[dict[str, str]] = {
        "sliding_window": "one per KV-cache group",
        "logits_soft_cap": "one per KV-cache group",
        "dtypes": "bf16: 8.0+",
        "fp8_kv": "e4m3: 8.9+",
    }

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_impl_cls() -> type[FlashInferImpl]:
        return FlashInferImpl

    @staticmethod
    def get_metadata_cls() -> type[FlashInferMetadata]:
        return FlashInferMetadata

    @staticmethod
    def get_builder_cls() -> type[FlashInferMetadataBuilder]:
        return FlashInferMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        """``(num_blocks, 2, block_size, num_kv_heads, head_size)``: FlashInfer's paged layout."""
        check_kv_cache_shape_args(num_blocks, block_size, num_kv_heads, head_size)
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """Identity for NHD; ``(0, 1, 3, 2, 4)`` for HND (heads before tokens in memory)."""
        return paged_kv_stride_order()

    @classmethod
    def get_supported_head_sizes(cls) -> tuple[int, ...]:
        return (64, 128, 256)

    @classmethod
    def get_supported_block_sizes(cls) -> tuple[int, ...]:
        return (1, 2, 4, 8, 16, 32, 64, 128)

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return _availability()

    @classmethod
    def validate_configuration(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None,
                               block_size: int, use_mla: bool = False, has_sink: bool = False,
                               use_sparse: bool = False) -> list[str]:
        """The declarations' reasons, and what this GPU generation lacks (``feature_notes``)."""
        reasons = super().validate_configuration(head_size, dtype, kv_cache_dtype, block_size, use_mla,
                                                 has_sink, use_sparse)
        if torch.cuda.is_available():
            cap = torch.cuda.get_device_capability()
            if dtype == torch.bfloat16 and cap < (8, 0):
                reasons.append(f"bfloat16 needs compute capability 8.0, this GPU has {cap[0]}.{cap[1]}; use float16")
        return reasons + e4m3_cache_reasons(kv_cache_dtype)
