"""TORCH_SDPA: the reference backend, plain PyTorch on CPU and CUDA.

One ``forward`` serves a mixed batch of decodes and (chunked) prefills with prior context.
The builder turns the batch into padded index tensors once per step (host work); the
forward then only runs device ops: store the new K/V, gather every request's K/V pages
into a padded ``(B, max_seq_len, Hk, D)`` tensor, and attend in float32 with a mask.
Decode-only batches of plain causal attention gather whole blocks instead and let SDPA
handle GQA (``TorchSDPAImpl._decode``).

Features: GQA/MQA, causal with offset, sliding window, logits soft cap, ALiBi, sinks,
encoder / encoder-only (non-causal over the given K/V, no cache), encoder-decoder
(non-causal over encoder K/V cached once), fp8 KV caches (dequantized with the layer's
``_k_scale`` / ``_v_scale``). Memory grows with ``B * max_query_len * max_seq_len``.

| module | what |
| --- | --- |
| ``backend`` | ``TorchSDPABackend``: what it serves, its KV-cache shape |
| ``metadata`` | ``TorchSDPAMetadata`` and its builder |
| ``impl`` | ``TorchSDPAImpl`` |
"""

from vattn.backends.torch_sdpa.backend import TorchSDPABackend
from vattn.backends.torch_sdpa.impl import TorchSDPAImpl
from vattn.backends.torch_sdpa.metadata import TorchSDPAMetadata, TorchSDPAMetadataBuilder

__all__ = ["TorchSDPABackend", "TorchSDPAImpl", "TorchSDPAMetadata", "TorchSDPAMetadataBuilder"]
