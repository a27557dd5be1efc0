"""What the FLEX_ATTENTION and TREE_ATTN tests share: running an impl over a random paged batch
(``attn_harness``), a float32 reference from explicit per-request masks, and a structural
check of the block masks the builder makes.

``explicit_reference(batch, scale, allowed)``: ``allowed[r]`` is request r's (query_len, seq_len)
bool matrix, built by the test from the mask's definition (loops or comparisons over positions,
never through vattn's mods), so the reference shares no code with the backend.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn.attention.flex_attention import create_mask

from attn_harness import RandomBatch
from vattn.backends.flex_attention import FlexAttentionImpl, FlexAttentionMetadata, FlexAttentionMetadataBuilder
from vattn.backends.flex_attention.metadata import Q_BLOCK
from vattn.backends.flex_attention.paging import MaskSpec, logical_mask, physical_mask
from vattn.core.metadata import AttentionSpec, CommonAttentionMetadata
from vattn.core.config import VattnConfig

__all__ = ["causal_allowed", "check_block_masks", "explicit_reference", "positions", "run_impl"]


def run_impl(batch: RandomBatch, impl_cls: type[FlexAttentionImpl] = FlexAttentionImpl,
             builder_cls: type[FlexAttentionMetadataBuilder] = FlexAttentionMetadataBuilder, *,
             common: CommonAttentionMetadata | None = None, compiled: bool = False, gather: bool | None = None,
             **impl_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, FlexAttentionImpl, FlexAttentionMetadata]:
    """Build metadata for ``batch`` (or ``common``), run one forward: (output, cache before, impl, metadata).
    ``gather``: every multi-token launch reads a gathered copy of its keys (True) or the cache
    in place (False); None: the builder's default."""
    spec = batch.spec
    kv_spec = AttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size, batch.kv_cache.dtype,
                            spec.kv_cache_dtype)
    builder = builder_cls(kv_spec, ["fake.attn"], VattnConfig(), torch.device(spec.device))
    builder.num_cache_blocks = batch.kv_cache.shape[1]
    if gather is not None:
        builder.gather_prefill, builder.gather_min_queries = gather, 2
    md = builder.build(0, batch.common if common is None else common)
    impl = impl_cls(spec.num_heads, spec.head_size, spec.head_size**-0.5, spec.num_kv_heads,
                    kv_cache_dtype=spec.kv_cache_dtype, compiled=compiled, **impl_kwargs)
    before = batch.kv_cache.clone()
    out = torch.zeros_like(batch.query)
    assert impl.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, md, output=out) is out
    return out, before, impl, md


def positions(batch: RandomBatch, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(query positions (ql, 1), key positions (1, S)) of request ``r``."""
    s, ql = batch.full_keys[r].shape[0], batch.spec.query_lens[r]
    dev = batch.query.device
    return torch.arange(s - ql, s, device=dev)[:, None], torch.arange(s, device=dev)[None, :]


def causal_allowed(batch: RandomBatch) -> list[torch.Tensor]:
    return [k <= q for q, k in (positions(batch, r) for r in range(batch.spec.num_reqs))]


def explicit_reference(batch: RandomBatch, scale: float, allowed: list[torch.Tensor], *,
                       score: Callable[[torch.Tensor, int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Dense float32 attention with explicit masks: (num_actual_tokens, H, D).

    ``score(s, r, q_pos, k_pos)`` transforms request r's (H, ql, S) scaled scores; ``sinks``
    (H,) add ``exp(sink)`` to each row's denominator. A row that sees no key gives zeros."""
    h = batch.spec.num_heads
    out, start = [], 0
    for r, ql in enumerate(batch.spec.query_lens):
        k, v = batch.full_keys[r], batch.full_values[r]
        g = h // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        q = batch.query[start : start + ql].float()
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        if score is not None:
            s = score(s, r, *positions(batch, r))
        s = s.masked_fill(~allowed[r].to(s.device), float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.float().to(s.device)[:, None, None].expand(h, ql, 1)], dim=-1)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)[..., : k.shape[0]]
        out.append(torch.einsum("hqk,khd->qhd", p, v))
        start += ql
    return torch.cat(out)


def check_block_masks(md: FlexAttentionMetadata, spec: MaskSpec) -> None:
    """Each launch's block mask lists exactly the blocks a tile's mask touches: every allowed
    (query, slot) pair lies in a listed block; a *full* block is allowed for every real query of
    its tile; a *partial* block has at least one allowed pair; no block is listed twice."""
    spec = spec.for_batch(md.causal)
    for call in md.calls:
        bm = md.block_mask(call, spec)
        if call.gathered:  # logical tiles over the launch's gathered keys
            assert call.kv_slots is not None
            bs, n_keys, mask = call.kv_block, call.kv_slots.shape[1], logical_mask(call, spec)
        else:
            bs, n_keys, mask = call.block_size, md.num_cache_blocks * call.block_size, physical_mask(call, spec)
        dense = create_mask(mask, call.batch, spec.heads, call.query_len, n_keys, call.qlen.device).cpu()
        real = (torch.arange(call.query_len)[None, :] < call.qlen.cpu()[:, None])  # (Bq, Lq)
        num, idx = bm.kv_num_blocks.cpu(), bm.kv_indices.cpu()
        fnum, fidx = bm.full_kv_num_blocks.cpu(), bm.full_kv_indices.cpu()
        for b in range(call.batch):
            for h in range(spec.heads):
                for t in range(-(-call.query_len // Q_BLOCK)):
                    rows = slice(t * Q_BLOCK, (t + 1) * Q_BLOCK)
                    tile = dense[b, h, rows].view(-1, n_keys // bs, bs)  # (rows, blocks, bs)
                    partial = idx[b, h, t, : num[b, h, t]].tolist()
                    full = fidx[b, h, t, : fnum[b, h, t]].tolist()
                    assert len(set(partial + full)) == len(partial) + len(full), (b, h, t, partial, full)
                    touched = set(tile.any(dim=2).any(dim=0).nonzero().flatten().tolist())
                    assert touched == set(partial + full), (b, h, t, sorted(touched), partial, full)
                    for blk in full:
                        assert tile[real[b, rows]][:, blk].all(), (b, h, t, blk)
