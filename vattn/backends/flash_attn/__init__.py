"""FLASH_ATTN: FlashAttention's varlen paged kernels behind the vattn backend interface.

| module | what |
| --- | --- |
| ``backend`` | ``FlashAttentionBackend``: what the backend serves, its KV-cache shape, selection reasons |
| ``metadata`` | per-step metadata and its builder (persistent buffers for CUDA graphs) |
| ``impl`` | ``FlashAttentionImpl``: KV store, then one varlen paged call per layer |
| ``interface`` | which FlashAttention generation is installed and usable (flash-attn-4, FA3, FA2), its limits |

Only ``interface`` imports ``flash_attn`` / ``flash_attn_interface``, lazily. One varlen call
serves a mixed batch of decodes and (chunked) prefills. KV cache: logical
``(2, num_blocks, block_size, Hk, D)``, physical NHD or HND.

Features: sliding window, soft cap (all interfaces); sinks (flash-attn-4 ``learnable_sink``);
ALiBi (FA2); fp8 KV caches with fp8 queries and descales (FA3 on SM90, flash-attn-4 on SM100),
bf16 models.
"""

from vattn.backends.flash_attn.backend import FlashAttentionBackend
from vattn.backends.flash_attn.impl import FlashAttentionImpl
from vattn.backends.flash_attn.interface import FlashAttnInterface, get_flash_attn_interface, interface_reasons
from vattn.backends.flash_attn.metadata import FlashAttentionMetadata, FlashAttentionMetadataBuilder

__all__ = [
    "FlashAttentionBackend",
    "FlashAttentionImpl",
    "FlashAttentionMetadata",
    "FlashAttentionMetadataBuilder",
    "FlashAttnInterface",
    "get_flash_attn_interface",
    "interface_reasons",
]
