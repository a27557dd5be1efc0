"""TRITON_ATTN: vattn's own Triton paged attention.

| module | what |
| --- | --- |
| ``backend`` | ``TritonAttentionBackend``: what the backend serves, its KV-cache shape |
| ``metadata`` | per-step metadata and its builder (persistent buffers for CUDA graphs) |
| ``impl`` | ``TritonAttentionImpl``: KV store, then one attention launch per layer |
| ``config`` | ``UnifiedAttentionConfig`` and its choice from static sizes, split-KV scratch sizes |
| ``paged_attention`` | the launcher ``paged_attention`` (imports Triton) |
| ``kernels`` | the Triton kernels (attention, split-KV combine) |
| ``metadata_copy`` | one kernel that writes a step's metadata into the persistent buffers |
"""

from vattn.backends.triton.backend import TritonAttentionBackend
from vattn.backends.triton.impl import TritonAttentionImpl
from vattn.backends.triton.metadata import TritonAttentionMetadata, TritonAttentionMetadataBuilder

__all__ = [
    "TritonAttentionBackend",
    "TritonAttentionImpl",
    "TritonAttentionMetadata",
    "TritonAttentionMetadataBuilder",
]
