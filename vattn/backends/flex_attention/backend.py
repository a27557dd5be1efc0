"""``FlexAttentionBackend``: FLEX_ATTENTION's static facts (see the package docstring)."""

from __future__ import annotations


import torch

from vattn.core.enums import AttentionType
from vattn.core.capabilities import Capabilities
from vattn.core.interface import AttentionBackend
from vattn.backends.flex_attention.impl import SUPPORTED_KV_CACHE_DTYPES, FlexAttentionImpl
from vattn.backends.flex_attention.metadata import FlexAttentionMetadata, FlexAttentionMetadataBuilder

__all__ = ["FlexAttentionBackend"]

#: The cache block is FlexAttention's sparse key block; its CUDA kernels tile keys by at least 16.
CUDA_BLOCK_MULTIPLE = 16


class FlexAttentionBackend(AttentionBackend):
    """PyTorch FlexAttention over the paged cache, with user ``mask_mod`` / ``score_mod``; CPU and CUDA."""

    name = "FLEX_ATTENTION"
    impl_cls = FlexAttentionImpl
    metadata_cls = FlexAttentionMetadata
    builder_cls = FlexAttentionMetadataBuilder
    capabilities = Capabilities(
        accept_output_buffer=True, dtypes=(torch.float16, torch.bfloat16, torch.float32),
        kv_cache_dtypes=SUPPORTED_KV_CACHE_DTYPES, sink=True, sliding_window=True, logits_soft_cap=True,
        alibi=True, mask_mod=True, score_mod=True, attn_types=(AttentionType.DECODER,), runs_on_cpu=True,
        head_sizes=tuple(range(8, 257, 8)),
        notes={
            "head_sizes": "CUDA: 16 and up",
            "sinks": "CPU: the reference path (slow)",
            "block_sizes": "CUDA: multiples of 16",
            "cuda_graphs": "other steps piecewise",
            "runs_on_cpu": "slow (a reference path); TORCH_SDPA is far faster for layers without mods",
        },
    )

    @staticmethod
    def get_kv_cache_stride_order() -> tuple[int, ...]:
        """Identity (NHD) whatever ``VATTN_KV_CACHE_LAYOUT`` says: FlexAttention reads the cache as
        one key sequence, a view only of the NHD layout."""
        return (0, 1, 2, 3, 4)

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        except ImportError as e:
            return False, f"this torch has no FlexAttention ({e}); install torch >= 2.11"
        return True, ""

    @classmethod
    def validate_configuration(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None,
                               block_size: int, use_mla: bool = False, has_sink: bool = False,
                               use_sparse: bool = False) -> list[str]:
        """The declarations' reasons, and on a CUDA machine a block size that is not a multiple of 16
        or a head size below 16 (FlexAttention's CUDA kernels tile by 16)."""
        reasons = super().validate_configuration(head_size, dtype, kv_cache_dtype, block_size, use_mla,
                                                 has_sink, use_sparse)
        if torch.cuda.is_available() and block_size % CUDA_BLOCK_MULTIPLE:
            reasons.append(f"block_size {block_size}: FlexAttention's CUDA kernels need a multiple of "
                           f"{CUDA_BLOCK_MULTIPLE} (a key tile lies inside one cache block)")
        if torch.cuda.is_available() and head_size < CUDA_BLOCK_MULTIPLE:
            reasons.append(f"head_size {head_size}: FlexAttention's CUDA kernels need at least {CUDA_BLOCK_MULTIPLE}")
        return reasons
