"""The minimal backend of docs/backends.md and tests/test_conformance.py: plain PyTorch on the
standard paged KV-cache layout; decoder self-attention, GQA, any head and block size, CPU and CUDA."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vattn import (AttentionBackend, AttentionImpl, AttentionMetadata, AttentionMetadataBuilder, AttentionType,
                   Capabilities, CommonAttentionMetadata)


@dataclass
class MinimalMetadata(AttentionMetadata):
    num_actual_tokens: int
    slot_mapping: torch.Tensor  # (T,) int64, -1: padding; the op stores the step's K/V there
    block_table: torch.Tensor  # (B, max_blocks) int32
    query_lens: list[int]  # host lists: read once per step, not in every layer
    seq_lens: list[int]


class MinimalMetadataBuilder(AttentionMetadataBuilder[MinimalMetadata]):
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MinimalMetadata:
        cm, b = common_attn_metadata, common_attn_metadata.num_reqs
        return MinimalMetadata(num_actual_tokens=cm.num_actual_tokens, slot_mapping=cm.slot_mapping,
                               block_table=cm.block_table_tensor, query_lens=cm.query_lens_cpu[:b].tolist(),
                               seq_lens=cm.seq_lens_cpu[:b].tolist())


class MinimalImpl(AttentionImpl[MinimalMetadata]):
    attn_types = (AttentionType.DECODER,)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None):
        """query (T, H, D); kv_cache (2, num_blocks, block_size, Hk, D), holding the step's K/V;
        writes output (T, H, D), which the op allocated."""
        md = attn_metadata
        key_cache, value_cache = kv_cache.unbind(0)
        block_size, start = key_cache.shape[1], 0
        for r, (q_len, seq_len) in enumerate(zip(md.query_lens, md.seq_lens)):
            blocks = md.block_table[r, : -(-seq_len // block_size)]
            k = key_cache[blocks].flatten(0, 1)[:seq_len]  # (S, Hk, D): the request's keys in order
            v = value_cache[blocks].flatten(0, 1)[:seq_len]
            q = query[start : start + q_len]
            # Causal with the cached context: new token i sits at position seq_len - q_len + i.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                               v.transpose(0, 1).float(), attn_mask=mask, scale=self.scale,
                                               enable_gqa=True)
            output[start : start + q_len] = o.transpose(0, 1).to(output.dtype)
            start += q_len
        return output


class MinimalBackend(AttentionBackend):
    name = "CUSTOM"
    impl_cls = MinimalImpl
    metadata_cls = MinimalMetadata
    builder_cls = MinimalMetadataBuilder
    capabilities = Capabilities(
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        kv_cache_dtypes=("auto", "float16", "bfloat16", "float32"),
        accept_output_buffer=True,
        stores_kv=False,
        runs_on_cpu=True,
    )
