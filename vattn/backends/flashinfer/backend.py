"""``FlashInferBackend``: what FLASHINFER serves, its KV-cache shape, and whether it can run here."""

from __future__ import annotations

import functools

import torch

from vattn.core.capabilities import Capabilities
from vattn.core.checks import library_availability
from vattn.core.interface import AttentionBackend
from vattn.backends.flashinfer.impl import SUPPORTED_ATTN_TYPES, FlashInferImpl
from vattn.backends.flashinfer.metadata import FlashInferMetadata, FlashInferMetadataBuilder
from vattn.core.layout import check_kv_cache_shape_args

__all__ = ["FlashInferBackend"]


@functools.lru_cache(maxsize=1)
def _availability() -> tuple[bool, str]:
    return library_availability("FLASHINFER", "flashinfer", "pip install flashinfer-python")


class FlashInferBackend(AttentionBackend):
    """FlashInfer paged attention: fp16/bf16, head sizes 64/128/256, fp8 KV caches, NHD/HND."""

    name = "FLASHINFER"
    impl_cls = FlashInferImpl
    metadata_cls = FlashInferMetadata
    builder_cls = FlashInferMetadataBuilder
    capabilities = Capabilities(
        accept_output_buffer=True, dtypes=(torch.float16, torch.bfloat16), sliding_window=True,
        logits_soft_cap=True, attn_types=SUPPORTED_ATTN_TYPES, min_compute_capability=(7, 5),
        head_sizes=(64, 128, 256),
        kv_cache_dtypes=(
            "auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2",
        ),
        notes={
            "sliding_window": "one per KV-cache group",
            "logits_soft_cap": "one per KV-cache group",
            "dtypes": "bf16: 8.0+",
            "fp8_kv": "e4m3: 8.9+",
        },
    )

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        """``(num_blocks, 2, block_size, num_kv_heads, head_size)``: FlashInfer's paged layout."""
        check_kv_cache_shape_args(num_blocks, block_size, num_kv_heads, head_size)
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

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
        return reasons
