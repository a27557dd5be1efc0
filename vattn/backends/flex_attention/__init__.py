"""FLEX_ATTENTION: PyTorch FlexAttention over vattn's paged cache, with user-defined masks and scores.

``vattn.Attention(..., mask_mod=..., score_mod=...)`` takes FlexAttention's mods over logical
positions (``mods``: prefix-LM, document packing, chunked local, sliding window, streaming sinks,
soft cap, ALiBi); without them the layer computes causal attention like every backend. The
layer's sliding window, soft cap, ALiBi and sinks are served through the same mods.

How paging meets FlexAttention: the cache is read in place as one key sequence of
``num_blocks * block_size`` slots (NHD layout), the step's requests form a padded query batch,
and each launch's ``BlockMask`` lists, per query tile, the *physical* blocks to read (the
request's logical blocks through its block table, split into masked and full ones). The
mask_mod FlexAttention runs maps physical slots back to positions and applies validity, the
base mask (causal or TREE_ATTN's tree), the window and the user's mask_mod. The builder
computes all of it once per step, for every layer; the impl only launches.

Cache contents: a masked key still multiplies its value by a zero probability, so values must
be finite in every slot a listed block holds, the unwritten tail of a request's last block
included (``allocate_kv_cache`` zero-fills; a step that wrote NaN could reach the next request
to reuse the block). TORCH_SDPA masks such slots out; FLEX_ATTENTION reads the cache in place.

| feature | support |
| --- | --- |
| dtypes | fp16, bf16, fp32; caches auto, bfloat16, float16, float32 (no fp8) |
| head sizes | 16-256, multiples of 8; CUDA block sizes: multiples of 16 |
| extras | GQA/MQA, sliding window, soft cap, ALiBi, sinks, mask_mod, score_mod |
| attention types | decoder |
| CUDA graphs | ``UNIFORM_SINGLE_TOKEN_DECODE``: decode steps replay from persistent block masks |

| module | what |
| --- | --- |
| ``backend`` | ``FlexAttentionBackend``: what it serves, its KV-cache shape |
| ``metadata`` | per-step metadata and its builder (launches, block masks, persistent buffers) |
| ``impl`` | ``FlexAttentionImpl``: KV store, then one FlexAttention launch per ``FlexCall`` |
| ``paging`` | ``FlexCall``, ``MaskSpec`` and the logical / physical mods |
| ``block_mask`` | the block masks, logical blocks classified and mapped to physical ones |
| ``compiled`` | one compiled FlexAttention per static shape |
| ``mods`` | ready-made mask and score mods |
"""

from vattn.backends.flex_attention import mods
from vattn.backends.flex_attention.backend import FlexAttentionBackend
from vattn.backends.flex_attention.impl import FlexAttentionImpl
from vattn.backends.flex_attention.metadata import FlexAttentionMetadata, FlexAttentionMetadataBuilder
from vattn.backends.flex_attention.paging import FlexCall, MaskSpec

__all__ = [
    "FlexAttentionBackend",
    "FlexAttentionImpl",
    "FlexAttentionMetadata",
    "FlexAttentionMetadataBuilder",
    "FlexCall",
    "MaskSpec",
    "mods",
]
