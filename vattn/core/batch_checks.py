"""What a step's batch must satisfy to run on a paged KV cache, checked on the host before
anything is written (no device sync).

``StepChecks`` holds one ``CommonAttentionMetadata``'s host facts: the longest sequence, the
block table's width, and, where vattn's helpers built the metadata, the block size its slots
were computed for and the largest block id it uses. Where the slot mapping and block table
themselves live on the CPU it keeps them too, and checks their contents (``check_batch``) the
first time it meets a cache. ``StepChecks.check(block_size, num_blocks)`` runs once per step
per cache geometry (memoized): ``PagedKVCache.build_metadata`` calls it for every group, the
attention op for the cache bound to each layer (then it is one tuple comparison).

Contents of device tensors are checked only with ``VATTN_DEBUG_CHECKS=1``
(``vattn.core.debug_checks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import torch

__all__ = ["StepChecks", "cache_geometry", "check_batch", "check_duplicate_blocks", "fail"]

_FIX_SLOTS = ("compute slot = block_table[r][pos // block_size] * block_size + pos % block_size for each new token "
              "(vattn.build_common_attn_metadata does), with -1 for padding")


def fail(name: str, expected: str, got: object, fix: str) -> NoReturn:
    """Raise the ``ValueError`` every check of user input raises: argument, expected, actual, fix."""
    raise ValueError(f"{name}: expected {expected}, got {got}; {fix}")


def check_duplicate_blocks(table: np.ndarray, used: np.ndarray, written: np.ndarray, writer: np.ndarray,
                           name: str, vals: np.ndarray | None = None) -> None:
    """No block twice in one request's table, and no block written this step in another
    request's table (blocks shared read-only, as prefix caching shares them, are fine).

    Args:
        table: (B, W) block ids; ``used``: (B, W) bool, the ids each request reads (its first
            ceil(seq_len / block_size) columns; rows of padding requests all False).
        written / writer: block id and request of every slot this step writes.
        vals: ``table[used]`` when the caller has it.
    """
    vals = table[used] if vals is None else vals
    if vals.size < 2:
        return
    ordered = np.sort(vals.astype(np.int32) if vals.size and vals.max() < 2**31 else vals)  # int32 sorts faster
    same = ordered[1:] == ordered[:-1]
    if not same.any():  # the common case: every block id once
        return
    rows = np.nonzero(used)[0]
    order = np.argsort(vals, kind="stable")
    sv, sr = vals[order], rows[order]
    twice = (sv[1:] == sv[:-1]) & (sr[1:] == sr[:-1])
    if twice.any():
        k = int(np.nonzero(twice)[0][0])
        fail(name, "distinct block ids within each request's used blocks",
             f"block {int(sv[k])} twice in request {int(sr[k])}'s table {table[sr[k]][used[sr[k]]].tolist()[:16]}",
             "give every block_size positions of a request a block of their own")
    hit = np.isin(written, ordered[1:][same])
    if hit.any():
        blk = int(written[hit][0])
        users = sorted(set(rows[vals == blk].tolist()))
        fail(name, "every block written this step to appear in the table of the request writing it only",
             f"block {blk} written by request {int(writer[hit][0])} and in the tables of requests {users}",
             "give each request blocks of its own to write (share only full, read-only prefix blocks)")


def check_batch(qsl: np.ndarray, seq: np.ndarray, table: np.ndarray, slots: np.ndarray, *, num_reqs: int,
                num_tokens: int, num_slot_tokens: int | None, causal: bool, block_size: int,
                num_blocks: int | None, prefix: str = "CommonAttentionMetadata.") -> None:
    """Check a batch's block table and slot mapping (host arrays) against a cache geometry.

    | array | shape | meaning |
    | --- | --- | --- |
    | qsl | (>= B + 1,) | query_start_loc (already checked monotonic from 0) |
    | seq | (>= B,) | seq_lens |
    | table | (>= B, W) | block ids |
    | slots | (>= T,) | slot_mapping; the first ``num_tokens`` (``num_slot_tokens``) are real |

    Slots must be -1 or inside the cache, unique, and (causal self-attention) where the block
    table puts each token; used block ids inside ``[0, num_blocks)``; blocks not shared as
    ``check_duplicate_blocks`` says. Vectorized: O(T + B * W).
    """
    b = num_reqs
    qsl, seq, table = qsl[: b + 1].astype(np.int64), seq[:b].astype(np.int64), table[:b].astype(np.int64)
    cross = num_slot_tokens is not None
    real = slots[: num_slot_tokens if cross else num_tokens].astype(np.int64)
    if real.size and real.min() < -1:
        i = int(np.nonzero(real < -1)[0][0])
        fail(prefix + "slot_mapping", "-1 (padding: the token writes nothing) or a slot >= 0",
             f"{int(real[i])} for token {i}", _FIX_SLOTS)
    if real.size and num_blocks is not None and real.max() >= num_blocks * block_size:
        i = int(np.nonzero(real >= num_blocks * block_size)[0][0])
        fail(prefix + "slot_mapping", f"slots below num_blocks * block_size = {num_blocks} * {block_size} "
             f"= {num_blocks * block_size} (the KV cache's size)", f"{int(real[i])} for token {i}", _FIX_SLOTS)
    need = -(-seq // block_size)
    used = np.arange(table.shape[1])[None, :] < need[:, None]
    vals = table[used]
    if vals.size and (vals.min() < 0 or (num_blocks is not None and vals.max() >= num_blocks)):
        bad = used & ((table < 0) | (table >= (num_blocks if num_blocks is not None else np.iinfo(np.int64).max)))
        r = int(np.nonzero(bad.any(1))[0][0])
        fail(prefix + "block_table_tensor", f"block ids in [0, num_blocks = {num_blocks}) in the first "
             f"ceil(seq_len / block_size) columns", f"{table[r][bad[r]][:4].tolist()} in request {r}'s row",
             "use ids of blocks allocated in this cache (kv.num_blocks)")
    qlen = np.diff(qsl)
    req = np.repeat(np.arange(b), np.maximum(qlen, 0))[:num_tokens]
    if causal and not cross and req.size:
        pos = np.arange(req.size) - qsl[req] + (seq - qlen)[req]
        expect = table[req, pos // block_size] * block_size + pos % block_size
        s = real[: req.size]
        bad_t = (s >= 0) & (s != expect)
        if bad_t.any():
            t = int(np.nonzero(bad_t)[0][0])
            r, p = int(req[t]), int(pos[t])
            fail(prefix + "slot_mapping", f"slot {int(expect[t])} for token {t} (request {r}, position {p}: block "
                 f"{int(table[r, p // block_size])} of its table, offset {p % block_size}), or -1",
                 int(s[t]), _FIX_SLOTS)
    written = real[real >= 0]
    if written.size > 1:
        ordered = np.sort(written)
        dup = ordered[1:] == ordered[:-1]
        if dup.any():
            slot = int(ordered[1:][dup][0])
            fail(prefix + "slot_mapping", "each slot written by one token at most",
                 f"slot {slot} for tokens {np.nonzero(real == slot)[0].tolist()}", _FIX_SLOTS)
    attending = (qsl[:-1] < num_tokens) & (qlen > 0) if not cross else np.ones(b, dtype=bool)
    writer = req[real >= 0] if not cross and req.size == real.size else np.full(written.size, -1)
    check_duplicate_blocks(table, used & attending[:, None], written // block_size, writer,
                           prefix + "block_table_tensor")


def cache_geometry(backend: Any, kv_cache: torch.Tensor, *, block_size: int, num_kv_heads: int, head_size: int,
                   cache_dtype: str, name: str) -> tuple[int, int]:
    """``(block_size, num_blocks)`` of ``kv_cache`` when it has the shape ``backend`` gives a
    layer of these sizes (``get_kv_cache_shape``) for some block count; else ``ValueError``."""
    shape_of = backend.get_kv_cache_shape
    one = shape_of(1, block_size, num_kv_heads, head_size, cache_dtype)
    two = shape_of(2, block_size, num_kv_heads, head_size, cache_dtype)
    dim = next((i for i, (a, b) in enumerate(zip(one, two)) if a != b), None)
    shape = tuple(kv_cache.shape)
    if dim is not None and len(shape) == len(one) and shape[dim] > 0:
        if shape == tuple(shape_of(shape[dim], block_size, num_kv_heads, head_size, cache_dtype)):
            return block_size, shape[dim]
    want = ", ".join("num_blocks" if i == dim else str(x) for i, x in enumerate(one))
    fail(f"{name}: kv_cache", f"a {backend.get_name()} cache of shape ({want}) for num_kv_heads={num_kv_heads}, "
         f"head_size={head_size}, block_size={block_size}", f"a tensor of shape {shape}",
         "allocate it with vattn.allocate_kv_cache(cfg, ...) for this model, or bind a tensor of that shape")


@dataclass(eq=False)
class StepChecks:
    """The host facts of one ``CommonAttentionMetadata`` and its checks against cache geometries.

    | field | meaning |
    | --- | --- |
    | refs | the metadata's (query_start_loc_cpu, seq_lens_cpu, block_table_tensor, slot_mapping) these describe |
    | device | where the metadata's device tensors live |
    | max_seq_len | the longest seq_len of the batch (host mirror) |
    | table_width | block_table_tensor's columns |
    | block_size | the block size the slots were computed for (vattn's helpers), or None (unknown) |
    | max_block | the largest block id the requests use, or None (not known on the host) |
    | host_batch | (qsl, seq, table, slots) numpy arrays and ``check_batch`` keywords, or None (device tensors) |
    | stamp | after ``bind``: the metadata's tensor fields with their version counters, and its scalar fields, when the facts were taken |

    The facts stay valid while the metadata's tensors are the same objects, unedited: ``bind``
    records each tensor field's ``_version`` (which every in-place torch op on it, or on a view
    of it, increments) and its scalar fields, so an edit after construction
    (``common.slot_mapping[3] = ...``, on the host or the device, or ``common.max_seq_len = 40``)
    makes ``describes`` False and ``PagedKVCache.check`` takes the facts
    again, host tensors checked in full. Writes that bypass torch's version counter (through a
    ``.numpy()`` view or ``.data``) are not seen: construct a new ``CommonAttentionMetadata``
    after those (construction checks it).
    """

    refs: tuple[Any, ...] = field(repr=False)
    device: torch.device
    max_seq_len: int
    table_width: int
    block_size: int | None = None
    max_block: int | None = None
    host_batch: tuple[tuple[np.ndarray, ...], dict[str, Any]] | None = field(default=None, repr=False)
    passed: tuple[int, int | None] | None = None
    device_checked: bool = False
    stamp: tuple[tuple[Any, ...], tuple[int, ...], tuple[Any, ...]] | None = field(default=None, repr=False)

    def describes(self, md: Any) -> bool:
        """Whether these facts are about ``md``'s tensors (not a copy's with other tensors) as
        they are now (after ``bind``: none replaced or edited in place since)."""
        if self.stamp is None:
            now = (md.query_start_loc_cpu, md.seq_lens_cpu, md.block_table_tensor, md.slot_mapping)
            return all(a is b for a, b in zip(self.refs, now))
        tensors, versions, scalars = self.stamp
        for a, b, v in zip(tensors, _tensor_fields(md), versions):
            if a is not b or a._version != v:
                return False
        return scalars == _scalar_fields(md)

    def bind(self, md: Any) -> None:
        """Record ``md``'s tensor fields with their version counters, and its scalar fields (the
        end of its construction, or of a recheck)."""
        tensors = _tensor_fields(md)
        self.stamp = (tensors, tuple(t._version for t in tensors), _scalar_fields(md))

    def check(self, block_size: int, num_blocks: int | None, where: str) -> None:
        """Raise ``ValueError`` unless the batch fits a cache of ``num_blocks`` blocks of
        ``block_size`` tokens (``where`` names that cache in the message). Memoized."""
        key = (block_size, num_blocks)
        if key == self.passed:
            return
        if self.block_size is not None and self.block_size != block_size:
            fail("block_size", f"{block_size}, the block size of {where}", f"metadata built with block_size="
                 f"{self.block_size}", "build it with kv.common_metadata(...) or vattn.build_common_attn_metadata("
                 "..., block_size=kv.block_size)")
        need = -(-self.max_seq_len // block_size)
        if need > self.table_width:
            fail("CommonAttentionMetadata.block_table_tensor", f"at least ceil(max seq_len / block_size) = "
                 f"ceil({self.max_seq_len} / {block_size}) = {need} columns for {where}",
                 f"{self.table_width} columns", "give each request ceil(seq_len / block_size) block ids "
                 "(or check seq_lens: each is cached + new tokens)")
        if self.max_block is not None and num_blocks is not None and self.max_block >= num_blocks:
            fail("block_tables", f"block ids below num_blocks = {num_blocks} ({where})",
                 f"block id {self.max_block}", "use ids of blocks allocated in this cache (kv.num_blocks), or "
                 "pass num_blocks=kv.num_blocks to build_common_attn_metadata to catch this where it is built")
        if self.host_batch is not None:
            arrays, kw = self.host_batch
            check_batch(*arrays, block_size=block_size, num_blocks=num_blocks, **kw)
        self.passed = key

    def for_padded(self, refs: tuple[Any, ...]) -> "StepChecks":
        """These facts for the same batch with padding added by vattn (slot -1, padded requests
        of at most one token on block 0), whose (query_start_loc_cpu, seq_lens_cpu,
        block_table_tensor, slot_mapping) are ``refs``."""
        return StepChecks(
            refs=refs,
            device=self.device, max_seq_len=max(self.max_seq_len, 1), table_width=self.table_width,
            block_size=self.block_size, max_block=None if self.max_block is None else max(self.max_block, 0),
            host_batch=self.host_batch,
        )


def _tensor_fields(md: Any) -> tuple[Any, ...]:
    """The tensors of a ``CommonAttentionMetadata`` that kernels or host work read."""
    return (md.query_start_loc, md.query_start_loc_cpu, md.seq_lens, md.seq_lens_cpu, md.num_computed_tokens_cpu,
            md.block_table_tensor, md.slot_mapping)


def _scalar_fields(md: Any) -> tuple[Any, ...]:
    return (md.num_reqs, md.num_actual_tokens, md.max_query_len, md.max_seq_len, md.causal, md.num_slot_tokens)


def unchecked_block_limit(cm: Any, vattn_config: Any, layer_names: list[str], blocks_dim: int) -> int | None:
    """``num_blocks`` of the KV cache bound to ``layer_names[0]`` (its dimension ``blocks_dim``)
    when ``cm``'s block ids were never seen on the host (hand-built metadata with a device block
    table), else None.

    Builders clamp such tables into ``[0, num_blocks)`` with one device op (no host sync): a bad
    id then reads a wrong block instead of faulting the GPU; ``VATTN_DEBUG_CHECKS=1`` rejects it
    instead. Tables from vattn's helpers, and host tables, are checked on the host and never clamped.
    """
    facts = cm.host_checks
    if facts is not None and (facts.max_block is not None or facts.host_batch is not None) or not layer_names:
        return None
    layer = vattn_config.compilation.static_forward_context.get(layer_names[0])
    caches = getattr(layer, "kv_cache", None)
    cache = caches[0] if caches else None
    if not isinstance(cache, torch.Tensor) or cache.dim() <= blocks_dim or not cache.numel():
        return None
    return int(cache.shape[blocks_dim])
