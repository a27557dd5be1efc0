"""TORCH_SDPA's per-step metadata and its builder (padded index tensors, built once per step)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from vattn.core.enums import AttentionCGSupport
from vattn.core.interface import AttentionMetadataBuilder
from vattn.core.metadata import AttentionMetadata, CommonAttentionMetadata
from vattn.ops.kv_store import valid_slots

__all__ = ["TorchSDPAMetadata", "TorchSDPAMetadataBuilder"]


@dataclass
class TorchSDPAMetadata(AttentionMetadata):
    """One step's metadata. B = num_reqs, Lq = max_query_len, Lk = max_seq_len.

    ``query_index`` to ``output_index`` describe the batch padded to (B, Lq) queries and (B, Lk)
    keys; they are None until ``padded()`` makes them (the impl calls it where it needs them).

    | field | shape / type | meaning |
    | --- | --- | --- |
    | num_actual_tokens | int | real tokens (rows of output written) |
    | slot_mapping | (T,) int64 | where the new K/V rows go; < 0 skipped |
    | table_covers | bool | the block table has ceil(Lk / block_size) columns |
    | query_index | (B, Lq) int64 | token row of query i of request b (0 where padding) |
    | query_pos | (B, Lq) int64 | absolute position of that query (seq_len - query_len + i) |
    | key_valid | (B, Lk) bool | key position j < seq_len of request b |
    | key_block, key_offset | (B, Lk) int64, or None | cache block / offset of key j (0 where invalid); None when the block table cannot cover Lk (encoder-only batches) |
    | encoder_key_valid | (B, Lq) bool | for encoder self-attention: key j < query_len |
    | output_index | (num_actual_tokens,) int64 | row ``b * Lq + i`` of each token in the padded output |
    | causal | bool | the batch's causal flag |
    | decode_blocks | (B, ceil(Lk / block_size)) int64, or None | a decode-only batch (one token per request): each request's blocks, which the decode path gathers whole |
    | decode_key_valid | (B, 1, 1, Lb) bool, or None | key j < seq_len in those blocks (Lb = their tokens) |
    | decode_first_block | int, or None | CPU, one decoding request whose blocks are consecutive: the first (its keys are a view of the cache) |
    | store_slots, store_rows | (S,) int64, (S,) int64 or None; or None | CPU: the valid entries of ``slot_mapping`` and their rows (None: rows 0..S-1), for ``store_rows``; None on other devices (``store_kv`` filters in its kernel) |
    """

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    causal: bool = True
    table_covers: bool = True
    decode_blocks: torch.Tensor | None = None
    decode_key_valid: torch.Tensor | None = None
    decode_first_block: int | None = None
    store_slots: torch.Tensor | None = None
    store_rows: torch.Tensor | None = None
    # The padded-batch fields: made on first use (``padded()``); a decode-only batch of plain
    # causal layers never uses them.
    query_index: torch.Tensor | None = None
    query_pos: torch.Tensor | None = None
    key_valid: torch.Tensor | None = None
    key_block: torch.Tensor | None = None
    key_offset: torch.Tensor | None = None
    encoder_key_valid: torch.Tensor | None = None
    output_index: torch.Tensor | None = None
    _make_padded: Callable[[], dict[str, torch.Tensor | None]] | None = field(default=None, repr=False, compare=False)

    def padded(self) -> "TorchSDPAMetadata":
        """This metadata with its padded-batch fields made (once)."""
        if self._make_padded is not None:
            for name, value in self._make_padded().items():
                setattr(self, name, value)
            self._make_padded = None
        return self


class TorchSDPAMetadataBuilder(AttentionMetadataBuilder[TorchSDPAMetadata]):
    """Builds ``TorchSDPAMetadata``. No full CUDA graphs: the forward's shapes follow the batch."""

    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    metadata_cls: ClassVar[type[TorchSDPAMetadata]] = TorchSDPAMetadata  # a subclass for backends extending it

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TorchSDPAMetadata:
        cm = common_attn_metadata
        B, Lq, Lk = cm.num_reqs, cm.max_query_len, cm.max_seq_len
        dev = cm.query_start_loc.device
        qsl = cm.query_start_loc[: B + 1].long()
        seq_lens = cm.seq_lens[:B].long()
        qlens = qsl[1:] - qsl[:-1]

        block_size = self.kv_cache_spec.block_size
        bt = cm.block_table_tensor
        limit = self.unchecked_block_limit(cm) if dev.type != "cpu" else None
        if limit is not None:  # ids never seen on the host: keep reads inside the cache (no device assert)
            bt = bt.clamp(0, limit - 1)
        unchecked = limit is not None  # device metadata no host check read: clamp every gather index too
        n_blocks = -(-Lk // block_size)
        table_covers = bt.shape[1] >= n_blocks
        num_tokens = cm.num_actual_tokens

        def make_padded() -> dict[str, torch.Tensor | None]:
            i = torch.arange(Lq, device=dev)
            query_valid = i[None, :] < qlens[:, None]
            j = torch.arange(Lk, device=dev)
            key_valid = j[None, :] < seq_lens[:, None]
            key_block = key_offset = None
            if table_covers:
                cols = (j // block_size).expand(B, Lk)
                key_block = torch.where(key_valid, bt[:B].long().gather(1, cols), 0)
                key_offset = torch.where(key_valid, j % block_size, 0)
            # Token t belongs to request r with qsl[r] <= t < qsl[r + 1]; its padded row is r * Lq + (t - qsl[r]).
            t = torch.arange(num_tokens, device=dev)
            r = torch.searchsorted(qsl[1:], t, right=True)
            query_index = torch.where(query_valid, qsl[:-1, None] + i[None, :], 0)
            output_index = r * Lq + (t - qsl[r])
            if unchecked:  # a wrong query_start_loc reads wrong rows, never past q or the padded output
                query_index = query_index.clamp(0, max(num_tokens - 1, 0))
                output_index = output_index.clamp(0, max(B * Lq - 1, 0))
            return dict(query_index=query_index,
                        query_pos=(seq_lens - qlens)[:, None] + i[None, :], key_valid=key_valid,
                        key_block=key_block, key_offset=key_offset, encoder_key_valid=query_valid,
                        output_index=output_index)

        decode_blocks = decode_key_valid = decode_first_block = None
        if Lq == 1 and cm.num_actual_tokens == B and B and bt.shape[1] >= n_blocks:
            decode_blocks = bt[:B, :n_blocks].long()
            lb = torch.arange(n_blocks * block_size, device=dev)
            decode_key_valid = (lb[None, :] < seq_lens[:, None])[:, None, None, :]
            if B == 1 and dev.type == "cpu" and bool((decode_blocks[0].diff() == 1).all()):
                decode_first_block = int(decode_blocks[0, 0])
        store_slots = store_rows = None
        if dev.type == "cpu":  # host data: filtering the slots once here saves each layer's store the work
            store_slots, store_rows = valid_slots(cm.slot_mapping, cm.slot_mapping.shape[0])

        qlens_cpu = cm.query_lens_cpu[:B]
        thr = self.reorder_batch_threshold or 1
        is_decode = qlens_cpu <= thr
        num_decodes = int(is_decode.sum())
        num_decode_tokens = int(qlens_cpu[is_decode].sum())
        return self.metadata_cls(
            num_actual_tokens=cm.num_actual_tokens,
            num_reqs=B,
            max_query_len=Lq,
            max_seq_len=Lk,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=B - num_decodes,
            num_prefill_tokens=cm.num_actual_tokens - num_decode_tokens,
            slot_mapping=cm.slot_mapping,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=bt,
            causal=cm.causal,
            table_covers=table_covers,
            decode_blocks=decode_blocks,
            decode_key_valid=decode_key_valid,
            decode_first_block=decode_first_block,
            store_slots=store_slots,
            store_rows=store_rows,
            _make_padded=make_padded,
        )
