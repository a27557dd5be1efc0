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


import torch

from vattn.core.capabilities import Capabilities
from vattn.core.interface import AttentionBackend
from vattn.core.checks import triton_availability
from vattn.backends.triton.impl import SUPPORTED_ATTN_TYPES, TritonAttentionImpl
from vattn.backends.triton.metadata import TritonAttentionMetadata, TritonAttentionMetadataBuilder
from vattn.core.config import CACHE_DTYPES

__all__ = ["TritonAttentionBackend"]


class TritonAttentionBackend(AttentionBackend):
    """vattn's Triton backend: portable wherever Triton runs (GPU, or CPU under TRITON_INTERPRET=1)."""

    name = "TRITON_ATTN"
    impl_cls = TritonAttentionImpl
    metadata_cls = TritonAttentionMetadata
    builder_cls = TritonAttentionMetadataBuilder
    capabilities = Capabilities(
        accept_output_buffer=True, quant_query_input=True, output_quant=True,
        dtypes=(torch.float16, torch.bfloat16, torch.float32), kv_cache_dtypes=CACHE_DTYPES, sink=True,
        sliding_window=True, logits_soft_cap=True, alibi=True, attn_types=SUPPORTED_ATTN_TYPES,
        min_compute_capability=(8, 0), head_sizes=tuple(range(8, 257, 8)),
        tree_parents=True,  # the kernel's tree mask (``TritonAttentionMetadata.tree``)
        notes={
            "runs_on_cpu": "TRITON_INTERPRET=1 (tests)",
            "sliding_window": "not on cross-attention",
            "fp8_kv": "e4m3: 8.9+",
        },
    )

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return triton_availability("TRITON_ATTN")
