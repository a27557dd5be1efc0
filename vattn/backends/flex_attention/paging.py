"""How FlexAttention reads vattn's paged cache: each launch's geometry, and the mods that map
FlexAttention's physical indices to the logical positions user mods see.

FlexAttention is called with the whole cache as one key sequence, ``(1, Hk, num_blocks *
block_size, D)`` (a view of the NHD layout), and the step's requests as a padded query batch
``(Bq, H, Lq, D)``. Its index arguments are then physical: ``b`` is the row of the launch,
``q_idx`` the query's row ``i`` within its request, ``kv_idx`` a cache slot. The wrappers here
turn them into the request's position space:

    block = kv_idx // block_size;  j = block_pos[block]          # the block's index in its table
    owned = block_table[b, j] == block                            # the block is this request's
    kv_pos = j * block_size + kv_idx % block_size;  q_pos = ctx[b] + i

``block_pos`` (num_blocks,) is one table for the step: it assumes that a block several requests
share (prefix caching) sits at the same index in each of their tables. Validity (``owned``,
``kv_pos < seq_len``, ``i < query_len``) is part of every mask, so the mask is exact over the
whole cache, which eager FlexAttention evaluates everywhere; the compiled kernels only visit
the blocks a ``BlockMask`` lists (``vattn.backends.flex_attention.block_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from vattn.backends.flex_attention.mods import MaskMod, ScoreMod

__all__ = ["CAUSAL", "FULL", "GATHER_BLOCK", "TREE", "FlexCall", "MaskSpec", "logical_mask", "logical_score",
           "physical_mask", "physical_score"]

#: ``MaskSpec.base``: causal attention, no structural mask (non-causal batches, or a user
#: mask_mod that replaces causality), or TREE_ATTN's draft-tree mask.
CAUSAL, FULL, TREE = "causal", "full", "tree"

#: Keys per block-mask tile of a gathered launch (``FlexCall.kv_slots``).
GATHER_BLOCK = 128


@dataclass(frozen=True, eq=True)
class MaskSpec:
    """What decides one layer's mask, hence its ``BlockMask``: layers with equal specs share one.

    ``mask_mod`` compares by identity; ``window`` is the sliding window in tokens (None: none);
    ``heads``: 1 when the mask is the same for every head, else the query heads (the user
    mask depends on ``h``: block masks are then built per head).
    """

    base: str = CAUSAL
    mask_mod: MaskMod | None = None
    window: int | None = None
    heads: int = 1

    def for_batch(self, causal: bool) -> "MaskSpec":
        """This spec for a batch whose ``CommonAttentionMetadata.causal`` is ``causal``."""
        if self.base == CAUSAL and not causal:
            return MaskSpec(FULL, self.mask_mod, self.window, self.heads)
        return self


@dataclass
class FlexCall:
    """One FlexAttention launch of a step: requests ``[first_req, first_req + num_reqs)`` as a
    query batch of ``Bq`` rows of ``Lq`` queries (rows past ``num_reqs`` are padding).

    | field | shape / type | meaning |
    | --- | --- | --- |
    | first_req, num_reqs | int | the step's requests this launch serves |
    | first_token, num_tokens | int | their rows of the step's flat tokens |
    | query_len | int | Lq: queries per row (1: a decode launch, row b is token first_token + b) |
    | max_seq | int | the longest ``seq`` of the launch (host copy) |
    | query_index | (Bq, Lq) int64, or None | flat token of query i of row b (0 for padding); None for decodes |
    | output_index | (num_tokens,) int64, or None | row ``b * Lq + i`` of each of the launch's tokens |
    | req_index | (Bq,) int32 | the step's request index of row b (``b`` of user mods) |
    | qlen, ctx, seq | (Bq,) int64 | new tokens, position of the first one, tokens after the step (0: padding) |
    | block_table | (Bq, W) int32 | the rows' block ids |
    | block_pos | (num_blocks,) int32 | the step's index of each block in its table (-1 or stale: unused) |
    | block_size | int | tokens per cache block |
    | tree | (Bq, Lq, Lq) bool, or None | TREE_ATTN: query k is query i itself or its ancestor |
    | kv_slots | (Bq, Skv) int64, or None | a gathered launch: the cache slot of row b's key position j |
    | dense | bool | the tokens fill the (Bq, Lq) grid in order: the queries and output are views |
    | fresh | bool | dense, and every row is a whole prompt (no cached context) |
    | block_masks | dict | ``MaskSpec`` -> ``BlockMask``, built once per step |

    A gathered launch (long queries: prefills) reads a copy of its keys in logical order,
    ``(Bq, Hk, Skv, D)``, instead of the whole cache: its block masks then list logical tiles of
    ``GATHER_BLOCK`` keys and its mods see logical positions directly (no table lookups), which
    any FlexAttention kernel serves, FlashAttention's included. The copy costs one read of the
    keys, small beside a prefill's compute.
    """

    first_req: int
    num_reqs: int
    first_token: int
    num_tokens: int
    query_len: int
    max_seq: int
    query_index: Tensor | None
    output_index: Tensor | None
    req_index: Tensor
    qlen: Tensor
    ctx: Tensor
    seq: Tensor
    block_table: Tensor
    block_pos: Tensor
    block_size: int
    tree: Tensor | None = None
    kv_slots: Tensor | None = None
    dense: bool = False
    fresh: bool = False
    block_masks: dict[MaskSpec, Any] = field(default_factory=dict, repr=False)

    @property
    def batch(self) -> int:
        """Bq, the padded rows of the launch."""
        return self.qlen.shape[0]

    @property
    def gathered(self) -> bool:
        """The launch reads a gathered copy of its keys (``kv_slots``), not the whole cache."""
        return self.kv_slots is not None

    @property
    def kv_block(self) -> int:
        """Keys per block-mask tile: ``GATHER_BLOCK`` for a gathered launch, else one cache block."""
        return GATHER_BLOCK if self.gathered else self.block_size

    def shape_key(self) -> tuple[Any, ...]:
        """The shapes the compiled kernel specializes on (besides q, the cache and the block mask)."""
        tree = None if self.tree is None else tuple(self.tree.shape)
        slots = None if self.kv_slots is None else tuple(self.kv_slots.shape)
        return (tuple(self.block_table.shape), tuple(self.block_pos.shape), self.block_size, tree, slots, self.fresh)


def logical_mask(call: FlexCall, spec: MaskSpec) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """The mask over ``(row b, head h, query row i, key position kv)``: validity, the base
    mask, the window, then the user's mask_mod at logical positions (request ``req_index[b]``)."""
    qlen, ctx, seq, req, tree = call.qlen, call.ctx, call.seq, call.req_index, call.tree
    base, user, window = spec.base, spec.mask_mod, spec.window
    last_q = call.query_len - 1
    if call.fresh and base != TREE:
        return _fresh_mask(call.query_len, base, window, user, req)

    def mask(b: Tensor, h: Tensor, i: Tensor, kv: Tensor) -> Tensor:
        q_pos = ctx[b] + i
        ok = (i < qlen[b]) & (kv < seq[b])
        if base == CAUSAL or (base == TREE and tree is None):
            ok = ok & (kv <= q_pos)
        elif base == TREE:
            rel = kv - ctx[b]  # the key's row among the request's new tokens, when >= 0
            ancestor = tree[b, i.clamp(0, last_q), rel.clamp(0, last_q)] & (rel <= last_q)
            ok = ok & ((rel < 0) | ancestor)
        if window is not None:
            ok = ok & (kv > q_pos - window)
        if user is not None:  # at safe indices where invalid (user tensors are indexed by them)
            ok = ok & user(req[b], h, torch.where(ok, q_pos, 0), torch.where(ok, kv, 0))
        return ok

    return mask


def _fresh_mask(lq: int, base: str, window: int | None, user: MaskMod | None,
                req: Tensor) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """``logical_mask`` of a fresh launch: every row holds ``lq`` queries at positions 0..lq-1
    over the same keys, so only the user's mask reads a tensor (kernels that cannot read
    captured tensors serve the rest)."""

    def mask(b: Tensor, h: Tensor, i: Tensor, kv: Tensor) -> Tensor:
        ok = kv <= i if base == CAUSAL else kv < lq
        if window is not None:
            ok = ok & (kv > i - window)
        if user is not None:  # at safe indices where invalid (0: ``x * ok`` keeps the index dtype)
            ok = ok & user(req[b], h, i * ok, kv * ok)
        return ok

    return mask


def _logical_kv(bs: int, table: Tensor, pos: Tensor, b: Tensor, kv_idx: Tensor) -> tuple[Tensor, Tensor]:
    """(owned, kv_pos) of physical slot ``kv_idx`` for row ``b`` (kv_pos 0 where not owned)."""
    block = kv_idx // bs
    j = pos[block]
    owned = (j >= 0) & (table[b, j.clamp(0, table.shape[1] - 1)] == block)
    return owned, torch.where(owned, j * bs + kv_idx % bs, 0)


def physical_mask(call: FlexCall, spec: MaskSpec) -> MaskMod:
    """FlexAttention's mask_mod for this launch: physical indices in, the logical mask out.

    The closures capture tensors and ints only (never the ``FlexCall``), so Dynamo guards on
    their shapes and values, not on a new object every step."""
    logical = logical_mask(call, spec)
    bs, table, pos = call.block_size, call.block_table, call.block_pos

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        owned, kv_pos = _logical_kv(bs, table, pos, b, kv_idx)
        return owned & logical(b, h, q_idx, kv_pos)

    return mask_mod


def logical_score(call: FlexCall, score_mods: tuple[ScoreMod, ...]) -> ScoreMod | None:
    """FlexAttention's score_mod for a gathered launch, whose ``kv_idx`` is the logical key
    position: ``score_mods`` applied in order (safe indices where the position is masked)."""
    if not score_mods:
        return None
    lq, fresh = call.query_len, call.fresh
    qlen, ctx, seq, req = call.qlen, call.ctx, call.seq, call.req_index

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if fresh:
            q_pos, kv_pos = q_idx, torch.where(kv_idx < lq, kv_idx, 0)
        else:
            ok = (q_idx < qlen[b]) & (kv_idx < seq[b])
            q_pos, kv_pos = torch.where(ok, ctx[b] + q_idx, 0), torch.where(ok, kv_idx, 0)
        for fn in score_mods:
            score = fn(score, req[b], h, q_pos, kv_pos)
        return score

    return score_mod


def physical_score(call: FlexCall, score_mods: tuple[ScoreMod, ...]) -> ScoreMod | None:
    """FlexAttention's score_mod for this launch: ``score_mods`` applied in order at logical
    positions (safe indices where the position is masked anyway); None when there are none."""
    if not score_mods:
        return None
    bs, table, pos = call.block_size, call.block_table, call.block_pos
    qlen, ctx, seq, req = call.qlen, call.ctx, call.seq, call.req_index

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        owned, kv_pos = _logical_kv(bs, table, pos, b, kv_idx)
        ok = owned & (q_idx < qlen[b]) & (kv_pos < seq[b])
        q_pos, kv_pos = torch.where(ok, ctx[b] + q_idx, 0), torch.where(ok, kv_pos, 0)
        for fn in score_mods:
            score = fn(score, req[b], h, q_pos, kv_pos)
        return score

    return score_mod
