"""The contract every other part of vattn builds on, importing nothing above it.

| module | holds |
| --- | --- |
| ``interface`` | ``AttentionBackend``, ``AttentionImpl``, ``AttentionMetadataBuilder``, ``AttentionLayerBase`` |
| ``capabilities`` | ``Capabilities``: what a backend serves, one frozen declaration |
| ``enums`` | ``AttentionType``, ``AttentionCGSupport`` |
| ``registry`` | ``AttentionBackendEnum``, ``MambaAttentionBackendEnum``, ``register_backend`` |
| ``metadata`` | ``CommonAttentionMetadata`` (the batch) and its checks, ``AttentionSpec``, ``AttentionMetadata`` |
| ``mamba`` | the mixer backends' contract: ``MambaSpec``, ``MambaMetadata``, ``MambaBackend`` |
| ``config`` | ``VattnConfig``, ``CacheConfig``, ``CompilationConfig`` |
| ``layout`` | the paged cache's physical layout (NHD / HND) |
| ``checks`` | a layer's arguments, FlexAttention mods, availability helpers |
| ``batch_checks`` | ``StepChecks``: a batch against a cache, once per step |
| ``debug_checks`` | device-side checks of hand-built metadata (``VATTN_DEBUG_CHECKS=1``) |

Above it: ``vattn.ops`` (the opaque ops, which own the KV store, output and per-call guards),
the layers (``vattn.Attention``, ``vattn.MLAAttention``, ``vattn.mixers``), and the backends
(``vattn.backends``), which import only the core, the ops and the kernels.
"""
