"""Multi-head latent attention (MLA: DeepSeek-V2/V3/R1, Kimi K2) backends.

An MLA layer (``vattn.MLAAttention``) caches one latent row per token, ``kv_lora_rank +
qk_rope_head_dim`` wide. Decodes attend in the absorbed form (multi-query attention over the
latent: ``W_UK`` folded into the query, ``W_UV`` applied to the output), prefills in the
up-projected form (per-head keys and values from ``kv_b_proj``) over their new tokens and, in
bounded chunks, their cached context.

| module | what |
| --- | --- |
| ``common`` | the backend base (latent cache shape), the metadata and its builder (decodes first) |
| ``impl`` | ``MLACommonImpl``: the latent store, weight absorption, the chunked prefill |
| ``triton_mla`` | TRITON_MLA: vattn's Triton kernels (split-KV latent decode, prefill, store) |
| ``flashinfer_mla`` | FLASHINFER_MLA: FlashInfer's MLA paged attention and ragged prefill |
| ``flashattn_mla`` | FLASH_ATTN_MLA: FlashAttention (FA3 decode with ``qv``, varlen prefill) |
| ``flashmla``, ``flashmla_sparse``, ``cutlass_mla`` | backends that state why they cannot serve |

This package imports no kernel library; each backend imports its own inside functions.
"""
