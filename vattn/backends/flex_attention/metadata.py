"""FLEX_ATTENTION's per-step metadata and its builder.

The builder splits the step into launches (``FlexCall``): the leading one-token requests
(decodes) as a ``(Bq, H, 1, D)`` batch that needs no gather, then the other requests as a padded
``(Bq, H, Lq, D)`` batch (on CUDA, with at least ``Q_BLOCK`` queries, over a gathered copy of
their keys: ``FlexCall.kv_slots``). ``Bq`` and ``Lq`` are powers of two (``compiled.bucket``),
the block table is padded to a width that only grows: few distinct shapes, so few compiles. It
then builds the block masks of every ``MaskSpec`` its layers use, once for all of them.

On CUDA, the decode launch of a decode-only step of at most the largest capture size lives in
persistent buffers (the block masks too), updated in place: a full CUDA graph captured for that
size replays with this step's data (``UNIFORM_SINGLE_TOKEN_DECODE``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from vattn.core.enums import AttentionCGSupport
from vattn.core.interface import AttentionMetadataBuilder
from vattn.core.metadata import AttentionMetadata, AttentionSpec, CommonAttentionMetadata
from vattn.backends.flex_attention.block_mask import build_block_mask
from vattn.backends.flex_attention.compiled import bucket
from vattn.backends.flex_attention.paging import GATHER_BLOCK, FlexCall, MaskSpec
from vattn.backends.flex_attention.mods import check_mod_tensors

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

    from vattn.core.config import VattnConfig

__all__ = ["FlexAttentionMetadata", "FlexAttentionMetadataBuilder"]

logger = logging.getLogger("vattn.backends.flex_attention")

#: Queries per BlockMask tile (FlexAttention's default sparse block; a multiple of its BLOCK_M).
Q_BLOCK = 128


@dataclass
class FlexAttentionMetadata(AttentionMetadata):
    """One step's metadata.

    | field | shape / type | meaning |
    | --- | --- | --- |
    | num_actual_tokens | int | real tokens (rows of output written) |
    | num_reqs | int | requests in the batch |
    | slot_mapping | (T,) int64 | where the new K/V rows go; < 0 skipped |
    | causal | bool | the batch's causal flag |
    | block_size, num_cache_blocks | int | the cache's geometry the launches read |
    | kv_width | int | columns of every block mask's ``kv_indices`` |
    | calls | list of ``FlexCall`` | the step's launches (decodes first) |
    """

    num_actual_tokens: int
    num_reqs: int
    slot_mapping: Tensor
    causal: bool
    block_size: int
    num_cache_blocks: int
    kv_width: int
    calls: list[FlexCall]

    def block_mask(self, call: FlexCall, spec: MaskSpec) -> "BlockMask":
        """The launch's block mask for ``spec`` (built here if the builder did not: a layer it
        did not know, e.g. an impl driven directly)."""
        spec = spec.for_batch(self.causal)
        mask = call.block_masks.get(spec)
        if mask is None:
            mask = call.block_masks[spec] = build_block_mask(
                call, spec, q_block=Q_BLOCK, num_cache_blocks=self.num_cache_blocks, width=self.kv_width)
        return mask


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    """``x`` with zero rows appended up to ``rows``."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


class FlexAttentionMetadataBuilder(AttentionMetadataBuilder[FlexAttentionMetadata]):
    """Builds ``FlexAttentionMetadata``; full CUDA graphs for one-token decode steps.

    ``num_cache_blocks``: the cache's block count, read from the group's bound caches when None
    (set it when driving an impl directly with a cache no layer holds).
    """

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vattn_config: "VattnConfig",
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vattn_config, device)
        self.num_cache_blocks: int | None = None
        self.width = 1  # block-table columns of every launch: a power of two that only grows
        comp = vattn_config.compilation
        self.max_graph_reqs = bucket(max([comp.max_capture_size, *comp.capture_sizes()]))
        self.use_persistent_buffers = self.device.type == "cuda"
        #: Launches of at least ``gather_min_queries`` queries (padded) read a gathered copy of
        #: their keys (``FlexCall.kv_slots``); on CUDA, where FlashAttention's kernel can then
        #: serve them. Shorter launches (decodes, draft trees) read the cache in place.
        self.gather_prefill = self.device.type == "cuda"
        self.gather_min_queries = Q_BLOCK
        self._buffers: dict[Any, Tensor] = {}
        self._specs: list[MaskSpec] | None = None
        self._captured = False

    # ---- the group's layers ------------------------------------------------------------

    def _layers(self) -> list[Any]:
        context = self.vattn_config.compilation.static_forward_context
        return [context[n] for n in self.layer_names if n in context]

    def layer_specs(self) -> list[MaskSpec]:
        """The distinct ``MaskSpec`` of the group's registered layers (their block masks are
        built with the metadata); found once, after the layers are built."""
        if self._specs is None:
            specs = [getattr(layer.impl, "mask_spec", None) for layer in self._layers()]
            self._specs = list(dict.fromkeys(s for s in specs if isinstance(s, MaskSpec)))
        return self._specs

    def _cache_blocks(self, common: CommonAttentionMetadata) -> int:
        if self.num_cache_blocks is None:
            bound = [layer.kv_cache[0] for layer in self._layers() if layer.kv_cache[0].numel()]
            if bound:
                self.num_cache_blocks = int(bound[0].shape[1])
        if self.num_cache_blocks is not None:
            return self.num_cache_blocks
        # No bound cache: the step's largest block id decides (a host sync for device tables).
        return int(common.block_table_tensor.max()) + 1 if common.block_table_tensor.numel() else 1

    # ---- buffers -----------------------------------------------------------------------

    def _buffer(self, name: Any, shape: tuple[int, ...], dtype: torch.dtype, fill: int = 0) -> Tensor:
        """A persistent buffer (reallocated, with a warning after a capture, when it must grow)."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            if buf is not None and self._captured:
                logger.warning("FLEX_ATTENTION: persistent buffer %r grows to %s after a CUDA-graph capture; "
                               "graphs captured before read the old one (capture the widest batch first).",
                               name, shape)
            buf = self._buffers[name] = torch.full(shape, fill, dtype=dtype, device=self.device)
        return buf

    def _persist(self, name: str, x: Tensor, rows: int) -> Tensor:
        """``x`` (padded with zero rows to ``rows``) copied into its persistent buffer."""
        buf = self._buffer(name, (self.max_graph_reqs, *x.shape[1:]), x.dtype)[:rows]
        buf[: x.shape[0]].copy_(x, non_blocking=True)
        buf[x.shape[0]:].zero_()
        return buf

    # ---- build -------------------------------------------------------------------------

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FlexAttentionMetadata:
        cm = common_attn_metadata
        b, t, bs = cm.num_reqs, cm.num_actual_tokens, self.kv_cache_spec.block_size
        qsl_cpu = cm.query_start_loc_cpu[: b + 1].long()
        real_cpu = qsl_cpu[:-1] < t  # padded requests (CUDA-graph padding) start past the real tokens
        qlen_cpu = qsl_cpu[1:] - qsl_cpu[:-1]
        seq_cpu = torch.where(real_cpu, cm.seq_lens_cpu[:b].long(), 0)
        longest = int(seq_cpu.max()) if b else 0
        for spec in self.layer_specs():  # the mods' per-request tensors fit the step, before anything is written
            check_mod_tensors(spec.mask_mod, b, longest)
        num_cache_blocks = self._cache_blocks(cm)
        # The table's own width counts too: CUDA-graph captures use the widest table first.
        needed = max(-(-longest // bs) if b else 1, cm.block_table_tensor.shape[1])
        self.width = max(self.width, bucket(needed))
        kv_width = self.width if self.device.type == "cuda" else max(self.width, num_cache_blocks)

        # Device copies of the per-request facts (no sync): padded requests are empty.
        qsl = cm.query_start_loc[: b + 1].long()
        real = qsl[:-1] < t
        qlen = torch.where(real, qsl[1:] - qsl[:-1], 0)
        seq = torch.where(real, cm.seq_lens[:b].long(), 0)
        table = cm.block_table_tensor[:b, : self.width]
        if table.shape[1] < self.width:
            table = torch.nn.functional.pad(table, (0, self.width - table.shape[1]))
        nd = int((qlen_cpu == 1).long().cumprod(0).sum()) if b else 0  # leading one-token requests
        slots = cm.slot_mapping
        # A decode-only step a full CUDA graph may replay: everything the graph reads is persistent.
        persistent = (self.use_persistent_buffers and nd == b and 0 < b <= self.max_graph_reqs
                      and slots.shape[0] <= self.max_graph_reqs)
        if persistent:  # the KV store inside the graph reads the slots too
            slots = self._persist("slot_mapping", slots, slots.shape[0])
        block_pos = self._block_pos(table, seq, num_cache_blocks)

        launches = [(0, nd)] if nd else []
        if nd < b and min(int(qsl_cpu[b]), t) > int(qsl_cpu[nd]):  # the rest, unless it is all padding
            launches.append((nd, b))
        calls = [self._call(cm, first, last, qsl, qsl_cpu, qlen, seq, seq_cpu, table, block_pos,
                            decode=first < nd, persistent=persistent, num_cache_blocks=num_cache_blocks)
                 for first, last in launches]
        md = FlexAttentionMetadata(
            num_actual_tokens=t, num_reqs=b, slot_mapping=slots, causal=cm.causal, block_size=bs,
            num_cache_blocks=num_cache_blocks, kv_width=kv_width, calls=calls)
        for call in calls:
            self._attach(call, cm)
            for spec in self.layer_specs():
                spec = spec.for_batch(cm.causal)
                out = self._mask_buffers(spec, call, kv_width) if persistent else None
                call.block_masks[spec] = build_block_mask(call, spec, q_block=Q_BLOCK, num_cache_blocks=num_cache_blocks,
                                                          width=kv_width, out=out)
        return md

    def _block_pos(self, table: Tensor, seq: Tensor, num_cache_blocks: int) -> Tensor:
        """(num_cache_blocks,) int32: each used block's index in its request's table. Unused
        columns are routed to a spare last slot, so the scatter needs no host sync."""
        cols = torch.arange(table.shape[1], device=table.device)
        used = cols[None, :] < -(-seq[:, None] // self.kv_cache_spec.block_size)
        if self.use_persistent_buffers:
            pos = self._buffer("block_pos", (num_cache_blocks + 1,), torch.int32, fill=-1)
        else:
            pos = torch.full((num_cache_blocks + 1,), -1, dtype=torch.int32, device=table.device)
        ok = used & (table >= 0) & (table < num_cache_blocks)  # ids past the cache (unchecked tables): unused
        target = torch.where(ok, table.long(), num_cache_blocks)
        pos.scatter_(0, target.flatten(), cols.to(torch.int32).expand_as(target).flatten())
        return pos[:num_cache_blocks]

    def _call(self, cm: CommonAttentionMetadata, first: int, last: int, qsl: Tensor, qsl_cpu: Tensor, qlen: Tensor,
              seq: Tensor, seq_cpu: Tensor, table: Tensor, block_pos: Tensor, *, decode: bool,
              persistent: bool, num_cache_blocks: int) -> FlexCall:
        """The launch of requests [first, last)."""
        n, t = last - first, cm.num_actual_tokens
        rows = bucket(n)
        first_token = int(qsl_cpu[first])
        num_tokens = min(int(qsl_cpu[last]), t) - first_token
        lq = 1 if decode else bucket(int((qsl_cpu[first + 1 : last + 1] - qsl_cpu[first:last]).max()))
        dev = qsl.device
        # int32, as FlexAttention's own indices (FlashAttention's kernels store indices as Int32).
        req = torch.arange(first, first + rows, device=dev, dtype=torch.int32).clamp(max=cm.num_reqs - 1)
        facts = {"qlen": qlen[first:last], "ctx": (seq - qlen)[first:last], "seq": seq[first:last],
                 "block_table": table[first:last]}
        if persistent:
            facts = {k: self._persist(k, v, rows) for k, v in facts.items()}
            req = self._persist("req_index", req, rows)
        else:
            facts = {k: _pad_rows(v, rows) for k, v in facts.items()}
        query_index = output_index = kv_slots = None
        dense = fresh = False
        max_seq = int(seq_cpu[first:last].max())
        if not decode:
            i = torch.arange(lq, device=dev)
            starts, lens = _pad_rows(qsl[first:last], rows), facts["qlen"]
            query_index = torch.where(i[None, :] < lens[:, None], starts[:, None] + i[None, :], 0)
            tok = torch.arange(first_token, first_token + num_tokens, device=dev)
            r = torch.searchsorted(qsl[first + 1 : last + 1], tok, right=True)
            output_index = r * lq + (tok - qsl[first:last][r])
            host_qlen = qsl_cpu[first + 1 : last + 1] - qsl_cpu[first:last]
            dense = n == rows and num_tokens == rows * lq and bool((host_qlen == lq).all())
            fresh = dense and bool((seq_cpu[first:last] == lq).all())
            if self.gather_prefill and lq >= self.gather_min_queries:
                kv_slots = self._kv_slots(facts["block_table"], facts["seq"], max_seq, num_cache_blocks)
        return FlexCall(
            first_req=first, num_reqs=n, first_token=first_token, num_tokens=num_tokens, query_len=lq,
            max_seq=max_seq, query_index=query_index, output_index=output_index,
            req_index=req, qlen=facts["qlen"], ctx=facts["ctx"], seq=facts["seq"],
            block_table=facts["block_table"], block_pos=block_pos, block_size=self.kv_cache_spec.block_size,
            kv_slots=kv_slots, dense=dense, fresh=fresh)

    def _kv_slots(self, table: Tensor, seq: Tensor, max_seq: int, num_cache_blocks: int) -> Tensor:
        """(Bq, Skv) int64: the cache slot of each row's key position ``j`` (0 past its
        sequence), ``Skv = bucket(max_seq)`` whole ``GATHER_BLOCK`` tiles. Slots are clamped into
        the cache, so a hand-built table the host never saw cannot fault the gather."""
        bs = self.kv_cache_spec.block_size
        keys = bucket(max_seq, GATHER_BLOCK)
        j = torch.arange(keys, device=table.device)
        col = (j // bs).clamp(max=table.shape[1] - 1)
        slots = table[:, col].long() * bs + j % bs
        slots = torch.where(j[None, :] < seq[:, None], slots, 0)
        return slots.clamp_(0, num_cache_blocks * bs - 1)

    def _mask_buffers(self, spec: MaskSpec, call: FlexCall, width: int) -> tuple[Tensor, ...]:
        """Persistent (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) of ``spec``."""
        rows, tiles = call.batch, -(-call.query_len // Q_BLOCK)
        full = (self.max_graph_reqs, spec.heads, tiles)
        return tuple(self._buffer((spec, part), full + ((width,) if part % 2 else ()), torch.int32)[:rows]
                     for part in range(4))

    def _attach(self, call: FlexCall, common: CommonAttentionMetadata) -> None:
        """Hook for subclasses to add per-launch data before the block masks are built (TREE_ATTN)."""

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> FlexAttentionMetadata:
        """Capture-time metadata, through the persistent buffers (from now on also off CUDA)."""
        self.use_persistent_buffers = True
        md = self.build(0, common_attn_metadata)
        self._captured = True
        return md
