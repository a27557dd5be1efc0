"""FLASHINFER: FlashInfer's paged prefill and decode kernels behind the vattn backend interface.

The only vattn package that imports ``flashinfer`` (lazily, inside functions). Written against
flashinfer-python 0.7.2.

| module | what |
| --- | --- |
| ``backend`` | ``FlashInferBackend``: what the backend serves, its KV-cache shape, availability |
| ``metadata`` | per-step metadata and its builder (``plan`` once per step; CUDA-graph decode wrappers) |
| ``impl`` | ``FlashInferImpl``: KV store, then ``run`` of the planned wrappers |
| ``paging`` | host-side CSR page layout, page-index gather, the shared float workspace |

* KV cache: logical shape ``(num_blocks, 2, block_size, Hk, D)``; ``[:, 0]`` keys, ``[:, 1]``
  values; physical layout NHD or HND (``vattn.backends.utils.get_kv_cache_layout``).
* One step: the builder splits the batch (decodes first) and ``plan``s a decode wrapper for the
  decodes and a prefill wrapper for the rest, once for all layers of the group; the impl stores
  the new K/V and ``run``s both into slices of the caller's output.
* CUDA graphs (``UNIFORM_SINGLE_TOKEN_DECODE``; the contract in ``vattn.cudagraph``): pure-decode
  steps of a captured size replay a wrapper built with ``use_cuda_graph=True`` over persistent
  buffers, re-planned without copies.
* Every layer of a group must share window, soft cap and scale (FlashInfer plans them); fp8 KV
  caches use the layer's host scales; sinks and ALiBi are refused (use FLASH_ATTN or TRITON_ATTN).
"""

from vattn.backends.flashinfer.backend import FlashInferBackend
from vattn.backends.flashinfer.impl import FlashInferImpl
from vattn.backends.flashinfer.metadata import FlashInferMetadata, FlashInferMetadataBuilder
from vattn.backends.flashinfer.paging import gather_page_indices, paged_kv_layout

__all__ = [
    "FlashInferBackend",
    "FlashInferImpl",
    "FlashInferMetadata",
    "FlashInferMetadataBuilder",
    "gather_page_indices",
    "paged_kv_layout",
]
