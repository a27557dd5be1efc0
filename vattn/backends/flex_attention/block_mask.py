"""The ``BlockMask`` of one launch: which cache blocks each tile of queries reads, mapped from
logical to physical blocks. Built by the metadata builder, once per step and ``MaskSpec``,
shared by every layer of that spec.

For row ``b`` and query tile ``r`` (``q_block`` queries), each of the request's logical blocks
``m`` (``block_size`` keys) is *empty* (skipped), *partial* (the kernel applies the mask_mod) or
*full* (every real query of the tile sees every key: no mask_mod). The causal / non-causal
masks with a window are classified from position ranges; any other mask (a user mask_mod,
TREE_ATTN) by evaluating it densely on the logical positions (``create_mask``, in chunks of
tiles). The lists of partial and full blocks are then compacted and mapped through the block
table to physical ids (a gathered launch keeps logical ids; its tiles are ``GATHER_BLOCK``
keys): ``kv_indices (Bq, Hm, R, width)`` with ``Hm`` 1 (or the query heads for a per-head
mask) and ``R = ceil(Lq / q_block)``.

| argument | meaning |
| --- | --- |
| ``width`` | columns of ``kv_indices``: at least the blocks a request uses; on CPU at least the cache's blocks (Inductor's CPU template asks for it) |
| ``out`` | persistent ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)`` to write into (CUDA graphs), or None |
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_mask

from vattn.backends.flex_attention.paging import CAUSAL, FULL, TREE, FlexCall, MaskSpec, logical_mask, physical_mask

__all__ = ["build_block_mask", "classify_blocks", "DENSE_CHUNK"]

#: Elements of the dense mask evaluated at once (bounds the builder's temporary memory).
DENSE_CHUNK = 1 << 25


def _analytic(call: FlexCall, spec: MaskSpec, q_block: int, num_tiles: int, num_blocks: int) -> tuple[Tensor, Tensor]:
    """(visible, full), each (Bq, 1, R, M), of the causal / full base masks with a window,
    from the tiles' query positions and the blocks' key positions."""
    dev, bs = call.qlen.device, call.kv_block
    qlen, ctx, seq = call.qlen[:, None], call.ctx[:, None], call.seq[:, None]
    r = torch.arange(num_tiles, device=dev)[None, :]
    i_lo = r * q_block
    i_hi = torch.minimum((r + 1) * q_block, qlen) - 1
    has_q = (i_lo < qlen)[:, :, None]                           # (Bq, R, 1)
    p_lo, p_hi = (ctx + i_lo)[:, :, None], (ctx + i_hi)[:, :, None]
    m = torch.arange(num_blocks, device=dev)[None, :]
    k_lo, k_end = m * bs, (m + 1) * bs                           # keys [k_lo, k_end)
    has_k = (k_lo < seq)[:, None, :]                             # (Bq, 1, M)
    visible = has_q & has_k
    full = visible & (k_end <= seq)[:, None, :]
    if spec.base == CAUSAL:
        visible = visible & (k_lo[:, None, :] <= p_hi)
        full = full & (k_end[:, None, :] - 1 <= p_lo)
    if spec.window is not None:
        k_hi = torch.minimum(k_end, seq) - 1
        visible = visible & (k_hi[:, None, :] > p_lo - spec.window)
        full = full & (k_lo[:, None, :] > p_hi - spec.window)
    return visible[:, None], (full & visible)[:, None]


def _dense(call: FlexCall, spec: MaskSpec, q_block: int, num_tiles: int, num_blocks: int) -> tuple[Tensor, Tensor]:
    """(visible, full), each (Bq, Hm, R, M), by evaluating the logical mask on every position.
    Query rows past a request's length count as neither (they are padding)."""
    bq, bs, dev, lq = call.batch, call.kv_block, call.qlen.device, call.query_len
    hm = spec.heads
    mask = logical_mask(call, spec)
    keys = num_blocks * bs
    tiles_at_once = max(1, DENSE_CHUNK // max(1, bq * hm * min(q_block, lq) * keys))
    visible, full = [], []
    for t0 in range(0, num_tiles, tiles_at_once):
        nt = min(tiles_at_once, num_tiles - t0)
        i0, rows = t0 * q_block, min(nt * q_block, lq - t0 * q_block)
        dense = create_mask(lambda b, h, i, kv: mask(b, h, i + i0, kv), bq, hm, rows, keys, dev)
        padding = torch.arange(i0, i0 + rows, device=dev)[None, :] >= call.qlen[:, None]  # (Bq, rows)
        if rows < nt * q_block:  # the last tile's rows past Lq: padding too
            dense = torch.nn.functional.pad(dense, (0, 0, 0, nt * q_block - rows))
            padding = torch.nn.functional.pad(padding, (0, nt * q_block - rows), value=True)
        dense = dense.view(bq, hm, nt, q_block, num_blocks, bs)
        padding = padding.view(bq, 1, nt, q_block, 1, 1)
        visible.append(dense.any(dim=5).any(dim=3))
        full.append((dense | padding).all(dim=5).all(dim=3))
    vis, ful = torch.cat(visible, dim=2), torch.cat(full, dim=2)
    return vis, ful & vis


def classify_blocks(call: FlexCall, spec: MaskSpec, q_block: int) -> tuple[Tensor, Tensor]:
    """(partial, full) bool, each (Bq, Hm, R, M) with ``M = ceil(max seq / block_size)`` over
    the launch: the logical blocks each tile reads with and without the mask_mod."""
    num_tiles = -(-call.query_len // q_block)
    num_blocks = _num_kv_tiles(call)
    if spec.mask_mod is None and (spec.base in (CAUSAL, FULL) or call.tree is None):
        if spec.base == TREE:  # a launch without draft trees (decodes): causal
            spec = MaskSpec(CAUSAL, None, spec.window, spec.heads)
        visible, full = _analytic(call, spec, q_block, num_tiles, num_blocks)
    else:
        visible, full = _dense(call, spec, q_block, num_tiles, num_blocks)
    return visible & ~full, full


def _num_kv_tiles(call: FlexCall) -> int:
    """Key tiles of the launch's longest row: cache blocks, or a gathered launch's tiles."""
    if call.kv_slots is not None:
        return max(1, -(-call.max_seq // call.kv_block))
    return min(call.block_table.shape[1], max(1, -(-call.max_seq // call.block_size)))


def _compact(selected: Tensor, table: Tensor, width: int, out: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
    """(count (Bq, Hm, R) int32, physical ids (Bq, Hm, R, width) int32) of the selected logical
    blocks of each tile, in logical order."""
    bq, hm, r, m = selected.shape
    count = selected.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort((~selected).to(torch.uint8), dim=-1, stable=True)  # selected first
    ids = table[:, None, None, :m].expand(bq, hm, r, m).gather(-1, order)
    ids = torch.where(torch.arange(m, device=ids.device) < count[..., None], ids, 0).to(torch.int32)
    if out is None:
        num, idx = count, ids.new_zeros((bq, hm, r, width))
    else:
        num, idx = out
        num.copy_(count)
        idx.zero_()
    idx[..., :m] = ids
    return num, idx


def build_block_mask(call: FlexCall, spec: MaskSpec, *, q_block: int, num_cache_blocks: int, width: int,
                     out: tuple[Tensor, Tensor, Tensor, Tensor] | None = None) -> BlockMask:
    """The launch's ``BlockMask`` for ``spec``: physical (its mask_mod is ``physical_mask``), or
    over a gathered launch's logical tiles (``logical_mask``; ``num_cache_blocks`` and ``width``
    are then its own)."""
    partial, full = classify_blocks(call, spec, q_block)
    if call.kv_slots is not None:
        keys = call.kv_slots.shape[1]
        width = keys // call.kv_block
        table = torch.arange(width, dtype=torch.int32, device=call.qlen.device).expand(call.batch, width)
        mask_mod = logical_mask(call, spec)
    else:
        keys = num_cache_blocks * call.block_size
        table = call.block_table
        mask_mod = physical_mask(call, spec)
    kv = _compact(partial, table, width, None if out is None else out[:2])
    full_kv = _compact(full, table, width, None if out is None else out[2:])
    return BlockMask.from_kv_blocks(
        kv[0], kv[1], full_kv[0], full_kv[1], BLOCK_SIZE=(q_block, call.kv_block), mask_mod=mask_mod,
        seq_lengths=(call.query_len, keys), compute_q_blocks=False,
    )
